//! `duet simulate --nodes 1,4,16`: the capacity of several Duet nodes behind a
//! balancer that hashes sessions onto them (deploy/nginx/duet.conf: nginx's consistent
//! hashing, 160 points per node on a 32-bit ring). A node is full when its sessions' KV
//! fills its host arenas (the `lp` policy keeps every session's KV there; the GPU mirrors a
//! prefix); hashing gives some node more than its share, so a cluster is full when its
//! fullest node is. Two limits: the sessions the arenas hold (open sessions, idle or not,
//! each at the same context), and the sessions that can decode at once while each still gets
//! a given speed (the simulator's steady-state decode step).

use serde::Serialize;

use super::{Policy, Setup, GIB};

/// Points per node on the ring (nginx: 160 per unit of weight).
const POINTS_PER_NODE: u64 = 160;

/// One row of the capacity table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodesRow {
    pub nodes: usize,
    /// The fullest node's share of the session keys × nodes (1 = perfectly even).
    pub imbalance: f64,
    /// Sessions the cluster holds when its fullest node's arenas are full.
    pub sessions: usize,
    /// KV those sessions hold, and what the nodes' arenas hold, bytes.
    pub kv_held_bytes: f64,
    pub kv_capacity_bytes: f64,
    /// Sessions that can decode at once with each getting at least the target speed on the
    /// fullest node.
    pub decoding_at_speed: usize,
    /// Decode tokens/s of the whole cluster with those sessions generating.
    pub tokens_per_s: f64,
}

/// splitmix64: the ring's point positions (a fixed, well-mixed stand-in for nginx's CRC32).
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Each node's share of uniformly hashed keys on a ring of `POINTS_PER_NODE` points per node:
/// a key goes to the first point at or after its hash (wrapping around).
pub fn ring_shares(nodes: usize) -> Vec<f64> {
    let mut points: Vec<(u32, usize)> =
        (0..nodes).flat_map(|n| (0..POINTS_PER_NODE).map(move |j| ((mix((n as u64) << 32 | j) >> 32) as u32, n))).collect();
    points.sort_unstable();
    let mut shares = vec![0.0; nodes];
    let ring = f64::from(u32::MAX) + 1.0;
    for (i, &(pos, node)) in points.iter().enumerate() {
        let before = if i == 0 { f64::from(points[points.len() - 1].0) - ring } else { f64::from(points[i - 1].0) };
        shares[node] += (f64::from(pos) - before) / ring;
    }
    shares
}

/// The largest batch at or below `most` whose decode step gives each sequence at least
/// `speed` tokens/s (0 when not even one does).
fn batch_at_speed(setup: &Setup, context: usize, most: usize, speed: f64) -> usize {
    let fast = |b: usize| setup.evaluate(Policy::Lp, b, context).step_s <= 1.0 / speed;
    let (mut lo, mut hi) = (0, most);
    if fast(hi) {
        return hi;
    }
    // fast(lo) (or lo = 0) and !fast(hi): the step time grows with the batch.
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if fast(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Cluster-wide tokens/s with `total` sessions spread by `shares`, each node at most `most`.
fn cluster_tokens_per_s(setup: &Setup, context: usize, shares: &[f64], total: usize, most: usize) -> f64 {
    shares
        .iter()
        .map(|s| ((total as f64 * s).round() as usize).min(most))
        .filter(|&b| b > 0)
        .map(|b| setup.evaluate(Policy::Lp, b, context).tokens_per_s)
        .sum()
}

/// The capacity of clusters of each of `node_counts` nodes of `setup`, at `context`
/// positions per session and `speed` tokens/s per decoding session.
pub fn capacity_table(setup: &Setup, context: usize, speed: f64, node_counts: &[usize]) -> anyhow::Result<Vec<NodesRow>> {
    if let Some(why) = setup.weights_problem() {
        anyhow::bail!("{why}");
    }
    let (_, per_node) = setup.largest_batch(context);
    anyhow::ensure!(per_node >= 1, "one session of {context} positions does not fit a node's KV arenas: lower --context or raise --host-kv-gib");
    let at_speed = batch_at_speed(setup, context, per_node, speed);
    let kv_per_session = context as f64 * setup.kv_bytes_per_pos();
    let node_kv = setup.capacity().host_kv_blocks as f64 * setup.assumptions.block_size as f64 * setup.kv_bytes_per_pos();
    let mut rows = Vec::new();
    for &n in node_counts {
        anyhow::ensure!(n >= 1, "--nodes takes counts of at least 1");
        let shares = ring_shares(n);
        let fullest = shares.iter().copied().fold(0.0, f64::max);
        let sessions = (per_node as f64 / fullest).floor() as usize;
        let decoding_at_speed = (at_speed as f64 / fullest).floor() as usize;
        rows.push(NodesRow {
            nodes: n,
            imbalance: fullest * n as f64,
            sessions,
            kv_held_bytes: sessions as f64 * kv_per_session,
            kv_capacity_bytes: n as f64 * node_kv,
            decoding_at_speed,
            tokens_per_s: cluster_tokens_per_s(setup, context, &shares, decoding_at_speed, at_speed),
        });
    }
    Ok(rows)
}

/// The table as Markdown, with what it means for when to add a node.
pub fn render(setup: &Setup, context: usize, speed: f64, rows: &[NodesRow]) -> String {
    let mut out = format!(
        "Nodes of {} + {} socket(s) x {:.0} GiB KV, {} ({} weights), every session at {context} positions, lp policy;\n\
         sessions hashed onto the nodes by their key (consistent hashing, {POINTS_PER_NODE} points per node)\n\n\
         | nodes | fullest node's share x nodes | sessions held (KV full) | KV held | KV capacity | sessions decoding at >= {speed} tok/s each | decode tokens/s then |\n\
         |---:|---:|---:|---:|---:|---:|---:|\n",
        setup.gpu.name,
        setup.cpu.sockets,
        setup.cpu.kv_bytes / GIB,
        setup.model.name,
        setup.weights.name(),
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {:.2} | {} | {:.0} GiB | {:.0} GiB | {} | {:.0} |\n",
            r.nodes,
            r.imbalance,
            r.sessions,
            r.kv_held_bytes / GIB,
            r.kv_capacity_bytes / GIB,
            r.decoding_at_speed,
            r.tokens_per_s,
        ));
    }
    out.push_str(&format!(
        "\nA cluster is full when its fullest node is: the hash gives that node more than its share\n\
         of the sessions (second column), so N nodes hold N x (one node's sessions) / that factor.\n\
         Add a node when the sessions kept open at this context near `sessions held` (past it the\n\
         least recently used idle sessions are evicted, and their next turns prefill again), or when\n\
         the sessions generating at the same time near `sessions decoding` (past it each gets less\n\
         than {speed} tokens/s)."
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulator::machines::{CpuSpec, GpuPreset, ModelPreset, WeightDtype};
    use crate::simulator::Assumptions;

    fn setup() -> Setup {
        Setup {
            gpu: GpuPreset::A10.spec(),
            cpu: CpuSpec::new(2, 150.0, 32, 30.0, 96.0),
            model: ModelPreset::Llama31_8b.shape(),
            weights: WeightDtype::Int8,
            assumptions: Assumptions::default(),
        }
    }

    #[test]
    fn the_ring_gives_every_key_to_some_node_and_spreads_them_nearly_evenly() {
        for n in [1, 4, 16] {
            let shares = ring_shares(n);
            assert!((shares.iter().sum::<f64>() - 1.0).abs() < 1e-9, "{shares:?}");
            let fullest = shares.iter().copied().fold(0.0, f64::max) * n as f64;
            assert!((1.0..1.35).contains(&fullest), "{n} nodes: the fullest holds {fullest:.2}x its share");
        }
        assert_eq!(ring_shares(1), vec![1.0]);
    }

    #[test]
    fn more_nodes_hold_more_sessions_but_less_than_linearly() {
        let s = setup();
        let rows = capacity_table(&s, 4096, 10.0, &[1, 4, 16]).unwrap();
        let one = s.largest_batch(4096).1;
        assert_eq!(rows[0].sessions, one, "one node holds what its arenas hold");
        for w in rows.windows(2) {
            assert!(w[1].sessions > w[0].sessions && w[1].decoding_at_speed > w[0].decoding_at_speed, "{w:?}");
            assert!(w[1].tokens_per_s > w[0].tokens_per_s, "{w:?}");
        }
        for r in &rows {
            assert!(r.sessions <= r.nodes * one && r.kv_held_bytes <= r.kv_capacity_bytes, "{r:?}");
            assert!((r.sessions as f64 - (r.nodes * one) as f64 / r.imbalance).abs() <= 1.0, "{r:?}");
            assert!(r.decoding_at_speed <= r.sessions, "{r:?}");
        }
    }

    #[test]
    fn the_batch_at_speed_is_the_largest_whose_step_is_fast_enough() {
        let s = setup();
        let most = s.largest_batch(4096).1;
        let b = batch_at_speed(&s, 4096, most, 10.0);
        assert!(b >= 1 && b < most, "{b} of {most}");
        assert!(s.evaluate(Policy::Lp, b, 4096).step_s <= 0.1);
        assert!(s.evaluate(Policy::Lp, b + 1, 4096).step_s > 0.1);
    }

    #[test]
    fn a_context_no_node_holds_is_a_clear_error() {
        let e = capacity_table(&setup(), 100_000_000, 10.0, &[1]).unwrap_err().to_string();
        assert!(e.contains("does not fit a node's KV arenas"), "{e}");
    }
}
