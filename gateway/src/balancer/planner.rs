//! The step planner: given a cost model and the decode sequences of a step (each with the
//! cpu-workers holding its KV positions), decides which positions of each sequence the
//! gpu-worker attends (a prefix, rounded to KV blocks) and which the cpu-workers attend
//! (the rest, each worker its own blocks), so that the predicted step time is least.
//!
//! Time model of one step (seconds): the gpu-worker runs the linear layers, then per layer
//! its attention share while the cpu-workers run theirs, then waits for them:
//!
//! ```text
//! T = linear(tokens) + max( gpu_attn · G , max_w (cpu_fixed_w + cpu_attn_w · C_w) )
//! ```
//!
//! with G and C_w the KV positions (all layers counted once) attended by the gpu-worker and
//! cpu-worker w. With two interleaved sub-batches (NEO/APEX-style overlap) the gpu-worker
//! runs one sub-batch's linear layers while the cpu-workers attend the other's, so
//!
//! ```text
//! T = max( linear₂(tokens) + gpu_attn · G , max_w (cpu_fixed_w + cpu_attn_w · C_w) )
//! ```
//!
//! where linear₂ is the linear layers run as two passes (their fixed cost twice). The `lp`
//! policy solves, for each form: minimise μ subject to μ ≥ g₀ + gpu_attn · Σ g_s (g₀ =
//! linear₂ with overlap, else 0), μ ≥ cpu_fixed_w + cpu_attn_w · Σ_s c_{s,w},
//! g_s + Σ_w c_{s,w} = n_s, 0 ≤ g_s ≤ gpu_max_s, 0 ≤ c_{s,w} ≤ held_{s,w} — a linear
//! program (good_lp with the microlp solver); rounds each g_s to a block boundary, predicts
//! the realised plans' times and keeps the faster.
//!
//! When the gpu-worker's device is the CPU and the cpu-workers run on the same cores (local
//! mode on a machine without a GPU), the two sides cannot attend at the same time, only take
//! turns, so the step time is the sum, and overlap hides nothing:
//!
//! ```text
//! T = linear(tokens) + gpu_attn · G + Σ_w (cpu_fixed_w + cpu_attn_w · C_w)
//! ```
//!
//! The LP then minimises that sum (each position goes to the cheaper side), and the all-gpu
//! plan is kept instead when it is predicted faster (it pays no cpu-worker's fixed cost).

use std::ops::Range;

use good_lp::{constraint, variable, variables, Expression, Solution, SolverModel};

/// Measured (or assumed) costs, in seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct CostModel {
    /// Per step on the gpu-worker, whatever the batch.
    pub linear_fixed: f64,
    /// Per batch token (prefill or decode) for the linear layers, norms, LM head.
    pub linear_per_token: f64,
    /// The gpu-worker's decode attention per KV position.
    pub gpu_attn_per_pos: f64,
    /// Per cpu-worker: cost of a step's job(s) whatever their size (exchange, wake-up).
    pub cpu_fixed: Vec<f64>,
    /// Per cpu-worker: decode attention per KV position.
    pub cpu_attn_per_pos: Vec<f64>,
    /// The linear layers as two interleaved sub-batches: per step, and per batch token.
    pub overlapped_fixed: f64,
    pub overlapped_per_token: f64,
    /// Measured over predicted time of overlapped steps (≥ 1: the pipeline's bubbles —
    /// the first and last half-layer, uneven halves — that the max() does not see).
    pub overlap_slowdown: f64,
    /// The gpu-worker computes on the cores the cpu-workers use: attention shares take turns
    /// instead of running side by side (the sum form of the time model).
    pub shared_cores: bool,
    /// The linear layers' line (per step, per batch token) of a step in which no cpu-worker
    /// attends, where it differs from `linear_*`: the CUDA device then runs each layer wholly
    /// on the GPU, never waiting for the host (on the H200, a 1B-shaped model's batch-1 step
    /// took 1.9 ms so and ~3.3 ms with a cpu-worker's share). `None`: the same line.
    pub local_linear: Option<(f64, f64)>,
}

/// One decode sequence of the step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqDemand {
    /// Positions to attend: `0..n_ctx`.
    pub n_ctx: usize,
    /// Who holds which positions, in position order, covering `0..n_ctx`.
    pub held: Vec<(u32, Range<usize>)>,
    /// The gpu-worker may attend positions `0..gpu_max` (all of them when it reads the
    /// cpu-workers' arenas; the mirrored prefix with a GPU-resident KV copy).
    pub gpu_max: usize,
}

/// Who attends which positions of one sequence (`None`: the gpu-worker).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    pub cpu_worker: Option<u32>,
    pub range: Range<usize>,
}

/// A planned step.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Per sequence (in the order given), its shares in position order.
    pub shares: Vec<Vec<Share>>,
    /// Predicted step time, seconds.
    pub predicted_s: f64,
    /// Run as two interleaved sub-batches.
    pub overlap: bool,
    /// KV positions the gpu-worker attends.
    pub gpu_positions: usize,
    /// KV positions each cpu-worker attends.
    pub cpu_positions: Vec<usize>,
}

impl CostModel {
    pub fn n_workers(&self) -> usize {
        self.cpu_attn_per_pos.len()
    }

    /// Predicted step time of `tokens` batch tokens with these attention loads.
    pub fn step_time(&self, tokens: usize, gpu_positions: usize, cpu_positions: &[usize], overlap: bool) -> f64 {
        let gpu = self.gpu_attn_per_pos * gpu_positions as f64;
        let cpu = cpu_positions
            .iter()
            .enumerate()
            .filter(|(_, &c)| c > 0)
            .map(|(w, &c)| self.cpu_fixed[w] + self.cpu_attn_per_pos[w] * c as f64);
        let local = cpu_positions.iter().all(|&c| c == 0);
        let (fixed, per_token) = match self.local_linear {
            Some(line) if local && !overlap => line,
            _ => (self.linear_fixed, self.linear_per_token),
        };
        let linear = fixed + per_token * tokens as f64;
        if self.shared_cores {
            return linear + gpu + cpu.sum::<f64>();
        }
        let cpu = cpu.fold(0.0, f64::max);
        if overlap {
            (self.overlapped_fixed + self.overlapped_per_token * tokens as f64 + gpu).max(cpu) * self.overlap_slowdown
        } else {
            linear + gpu.max(cpu)
        }
    }
}

/// The shares of every sequence when the gpu-worker takes the prefix `prefix[s]` of
/// sequence `s`, and the plan's predicted time.
pub fn realise(cost: &CostModel, tokens: usize, seqs: &[SeqDemand], prefix: &[usize], overlap: bool) -> Plan {
    let mut cpu_positions = vec![0usize; cost.n_workers()];
    let mut gpu_positions = 0;
    let shares = seqs
        .iter()
        .zip(prefix)
        .map(|(s, &p)| {
            let p = p.min(s.n_ctx);
            let mut out = Vec::new();
            if p > 0 {
                out.push(Share { cpu_worker: None, range: 0..p });
                gpu_positions += p;
            }
            for (w, r) in &s.held {
                let r = r.start.max(p)..r.end.min(s.n_ctx);
                if r.start < r.end {
                    if let Some(c) = cpu_positions.get_mut(*w as usize) {
                        *c += r.len();
                    }
                    // Adjacent ranges of one worker become one share.
                    match out.last_mut() {
                        Some(Share { cpu_worker: Some(last), range }) if *last == *w && range.end == r.start => range.end = r.end,
                        _ => out.push(Share { cpu_worker: Some(*w), range: r }),
                    }
                }
            }
            out
        })
        .collect();
    let predicted_s = cost.step_time(tokens, gpu_positions, &cpu_positions, overlap);
    Plan { shares, predicted_s, overlap, gpu_positions, cpu_positions }
}

/// Why the LP could not be solved (the caller falls back to a static split).
#[derive(Debug, thiserror::Error)]
#[error("the attention LP failed: {0}")]
pub struct PlanError(String);

/// The LP plan: the split that minimises the predicted step time, rounded to `block_size`;
/// with `may_overlap`, also the best split of an overlapped step, and the faster of both.
pub fn plan_lp(cost: &CostModel, tokens: usize, seqs: &[SeqDemand], block_size: usize, may_overlap: bool) -> Result<Plan, PlanError> {
    let plain = solve(cost, tokens, seqs, block_size, false)?;
    if !may_overlap || seqs.len() < 2 || cost.shared_cores {
        return Ok(plain);
    }
    let overlapped = solve(cost, tokens, seqs, block_size, true)?;
    Ok(if overlapped.predicted_s < plain.predicted_s { overlapped } else { plain })
}

/// How much slower (relative) a plan whose GPU prefixes are even may be predicted than the
/// LP's own and still be kept: rounding to blocks moves either by a few positions.
const EVEN_SPLIT_SLACK: f64 = 0.005;

/// `total` positions for the GPU spread over `seqs` as one level: each sequence's prefix the
/// same number of whole blocks, or all it may take (`gpu_max`, its context) where that is
/// less; the blocks left below `total` one each to the first sequences that can take them.
fn level_prefixes(seqs: &[SeqDemand], total: usize, block_size: usize) -> Vec<usize> {
    let bs = block_size.max(1);
    let caps: Vec<usize> = seqs.iter().map(|s| s.gpu_max.min(s.n_ctx)).collect();
    let given = |level: usize| caps.iter().map(|&c| c.min(level)).sum::<usize>();
    // The highest level of whole blocks that stays within the total.
    let (mut lo, mut hi) = (0usize, caps.iter().max().copied().unwrap_or(0).div_ceil(bs));
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if given(mid * bs) <= total {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let level = lo * bs;
    let mut prefix: Vec<usize> = caps.iter().map(|&c| c.min(level)).collect();
    let mut left = total.saturating_sub(prefix.iter().sum());
    for (p, &c) in prefix.iter_mut().zip(&caps) {
        let more = c.min(*p + bs) - *p;
        if more > 0 && more <= left {
            *p += more;
            left -= more;
        }
    }
    prefix
}

/// The LP plan of one form: overlapped (two interleaved sub-batches) or not.
pub fn solve(cost: &CostModel, tokens: usize, seqs: &[SeqDemand], block_size: usize, overlap: bool) -> Result<Plan, PlanError> {
    if seqs.is_empty() {
        return Ok(realise(cost, tokens, seqs, &[], false));
    }
    let n_workers = cost.n_workers();
    let mut vars = variables!();
    let mu = vars.add(variable().min(0.0));
    let mut gpu = Vec::with_capacity(seqs.len());
    // Per sequence, per worker holding some of it: (worker, variable).
    let mut cpu: Vec<Vec<(usize, good_lp::Variable)>> = Vec::with_capacity(seqs.len());
    for s in seqs {
        gpu.push(vars.add(variable().min(0.0).max(s.gpu_max.min(s.n_ctx) as f64)));
        let mut held = vec![0usize; n_workers];
        for (w, r) in &s.held {
            if let Some(h) = held.get_mut(*w as usize) {
                *h += r.end.min(s.n_ctx).saturating_sub(r.start);
            }
        }
        cpu.push(held.iter().enumerate().filter(|(_, &h)| h > 0).map(|(w, &h)| (w, vars.add(variable().min(0.0).max(h as f64)))).collect());
    }
    let mut model = vars.minimise(mu).using(good_lp::microlp);
    let gpu_total: Expression = gpu.iter().copied().sum();
    let gpu_base = if overlap && !cost.shared_cores { cost.overlapped_fixed + cost.overlapped_per_token * tokens as f64 } else { 0.0 };
    let loads: Vec<Option<Expression>> = (0..n_workers)
        .map(|w| {
            let vs: Vec<good_lp::Variable> = cpu.iter().flatten().filter(|(x, _)| *x == w).map(|(_, v)| *v).collect();
            (!vs.is_empty()).then(|| cost.cpu_fixed[w] + cost.cpu_attn_per_pos[w] * vs.into_iter().sum::<Expression>())
        })
        .collect();
    if cost.shared_cores {
        let cpu_total: Expression = loads.iter().flatten().cloned().sum();
        model = model.with(constraint!(mu >= cost.gpu_attn_per_pos * gpu_total + cpu_total));
    } else {
        model = model.with(constraint!(mu >= gpu_base + cost.gpu_attn_per_pos * gpu_total));
        for load in loads.into_iter().flatten() {
            model = model.with(constraint!(mu >= load));
        }
    }
    for (s, (g, cs)) in seqs.iter().zip(gpu.iter().zip(&cpu)) {
        let covered: Expression = cs.iter().map(|(_, v)| *v).sum::<Expression>() + *g;
        model = model.with(constraint!(covered == s.n_ctx as f64));
    }
    let solution = model.solve().map_err(|e| PlanError(e.to_string()))?;
    let bs = block_size.max(1);
    let prefix: Vec<usize> = seqs
        .iter()
        .zip(&gpu)
        .map(|(s, g)| {
            let want = solution.value(*g).max(0.0);
            let cap = s.gpu_max.min(s.n_ctx);
            // To the nearest block boundary, or to the GPU's whole allowance where that is
            // nearer: an LP that gave the GPU all of a 1 217-position context must not leave
            // its last position to a cpu-worker (1 216 is the boundary nearest 1 217).
            let rounded = ((want / bs as f64).round() as usize) * bs;
            if rounded >= cap || cap as f64 - want < (want - rounded as f64).abs() { cap } else { rounded }
        })
        .collect();
    let mut solved = realise(cost, tokens, seqs, &prefix, overlap);
    // Where the GPU is not saturated the LP is degenerate: any split of its total among the
    // sequences is as good, and the solver's vertex gives some sequences all they may take and
    // others nothing (on 64 equal sequences: 46 and 18), which sequences shifting from step to
    // step. Each shift makes the GPU's KV mirror drop one sequence's prefix and upload
    // another's, so the total is spread evenly instead, unless that is predicted slower (a
    // cpu-worker the LP chose to relieve).
    let even = realise(cost, tokens, seqs, &level_prefixes(seqs, prefix.iter().sum(), bs), overlap);
    if even.predicted_s <= solved.predicted_s * (1.0 + EVEN_SPLIT_SLACK) {
        solved = even;
    }
    // The LP cannot see what a step with no cpu-worker saves (their fixed costs, and the
    // cheaper line of `local_linear`): the plan that gives the GPU all it may take is
    // priced on its own, and kept when it is faster.
    let all_gpu = realise(cost, tokens, seqs, &seqs.iter().map(|s| s.gpu_max).collect::<Vec<_>>(), overlap);
    Ok(if all_gpu.predicted_s < solved.predicted_s { all_gpu } else { solved })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost(gpu: f64, cpu: &[f64]) -> CostModel {
        CostModel {
            linear_fixed: 0.001,
            linear_per_token: 0.0001,
            gpu_attn_per_pos: gpu,
            cpu_fixed: vec![0.0; cpu.len()],
            cpu_attn_per_pos: cpu.to_vec(),
            overlapped_fixed: 0.002,
            overlapped_per_token: 0.0001,
            overlap_slowdown: 1.0,
            shared_cores: false,
            local_linear: None,
        }
    }

    fn on(worker: u32, n: usize) -> SeqDemand {
        SeqDemand { n_ctx: n, held: vec![(worker, 0..n)], gpu_max: n }
    }

    fn gpu_prefixes(plan: &Plan) -> Vec<usize> {
        plan.shares.iter().map(|s| s.iter().find(|x| x.cpu_worker.is_none()).map_or(0, |x| x.range.end)).collect()
    }

    #[test]
    fn an_unsaturated_gpu_attends_the_same_prefix_of_every_sequence() {
        // 64 sequences of 8 208 over a KV mirror that gives each 7 360: the GPU is cheaper per
        // position but the LP balances it against the cpu-worker below its allowance. The
        // solver's vertex gave 46 sequences 7 360 and 18 none; the plan is even instead, and
        // predicted as fast.
        let cost = CostModel { cpu_fixed: vec![0.005], ..cost(4.4e-8, &[5.3e-8]) };
        for step in 0..3 {
            let n = 8208 + step;
            let seqs: Vec<SeqDemand> = (0..64).map(|_| SeqDemand { gpu_max: 7360, ..on(0, n) }).collect();
            let plan = solve(&cost, 64, &seqs, 64, false).unwrap();
            let p = gpu_prefixes(&plan);
            let (lo, hi) = (*p.iter().min().unwrap(), *p.iter().max().unwrap());
            assert!(hi - lo <= 64 && lo > 0, "step {step}: prefixes {lo}..{hi}");
            let total: usize = p.iter().sum();
            assert!(total < 64 * 7360 && total > 64 * 5000, "step {step}: {total}");
        }
    }

    #[test]
    fn level_prefixes_fill_evenly_within_each_allowance() {
        let seqs = [SeqDemand { gpu_max: 100, ..on(0, 1000) }, on(0, 1000), on(0, 300), on(0, 1000)];
        // Level 256 (four blocks) gives 100 + 3 × 256 = 868 of 1 000; of the 132 left the
        // second takes a block (320), the third the 44 up to its context (300), and the 24
        // left are not a block.
        assert_eq!(level_prefixes(&seqs, 1000, 64), vec![100, 320, 300, 256]);
        assert_eq!(level_prefixes(&seqs, 0, 64), vec![0; 4]);
        assert_eq!(level_prefixes(&seqs, 1 << 20, 64), vec![100, 1000, 300, 1000]);
    }

    #[test]
    fn equal_speeds_split_in_half() {
        let c = cost(1e-6, &[1e-6]);
        let seqs: Vec<_> = (0..4).map(|_| on(0, 1024)).collect();
        let p = plan_lp(&c, 4, &seqs, 16, false).unwrap();
        assert_eq!(p.gpu_positions + p.cpu_positions[0], 4096);
        assert!((p.gpu_positions as i64 - 2048).abs() <= 16 * 4, "{p:?}");
        let all_cpu = realise(&c, 4, &seqs, &[0; 4], false).predicted_s;
        assert!(p.predicted_s < 0.6 * all_cpu + c.step_time(4, 0, &[0], false), "{} vs {all_cpu}", p.predicted_s);
    }

    #[test]
    fn the_lp_leaves_no_sliver_of_a_block_to_a_cpu_worker() {
        // A GPU 100 times faster: the LP gives it all 1 217 positions, and 1 216 is the block
        // boundary nearest that; its last position must not go to the cpu-worker (on the
        // H200 such a sliver cost the step its whole-layer path).
        let c = cost(1e-8, &[1e-6]);
        let p = solve(&c, 1, &[on(0, 1217)], 16, false).unwrap();
        assert_eq!((p.gpu_positions, p.cpu_positions[0]), (1217, 0), "{p:?}");
        // Where the LP wants a share on the cpu-worker, it still gets whole blocks.
        let p = solve(&cost(1e-6, &[1e-6]), 1, &[on(0, 1217)], 16, false).unwrap();
        assert_eq!(p.gpu_positions % 16, 0, "{p:?}");
        assert!(p.cpu_positions[0] > 500, "{p:?}");
    }

    #[test]
    fn a_step_without_cpu_workers_is_priced_on_its_own_line() {
        // Equal attention speeds, so the LP alone would split each context in half; but a
        // step with a cpu-worker's share pays 1.4 ms more of linear layers (the CUDA device's
        // round trips to the host, every layer), which a short context's split does not win back.
        let c = CostModel { linear_fixed: 0.0019, local_linear: Some((0.0005, 0.0001)), ..cost(1e-6, &[1e-6]) };
        let p = plan_lp(&c, 1, &[on(0, 1000)], 16, true).unwrap();
        assert_eq!((p.gpu_positions, p.cpu_positions[0]), (1000, 0), "{p:?}");
        assert!((p.predicted_s - (0.0005 + 0.0001 + 1000.0 * 1e-6)).abs() < 1e-12, "{p:?}");
        // A long one's does.
        let p = plan_lp(&c, 1, &[on(0, 100_000)], 16, true).unwrap();
        assert!(p.cpu_positions[0] > 40_000, "{p:?}");
        assert!((p.predicted_s - c.step_time(1, p.gpu_positions, &p.cpu_positions, p.overlap)).abs() < 1e-12);
    }

    #[test]
    fn a_cpu_twice_as_slow_gets_a_third() {
        let c = cost(1e-6, &[2e-6]);
        let seqs: Vec<_> = (0..3).map(|_| on(0, 3000)).collect();
        let p = plan_lp(&c, 3, &seqs, 1, false).unwrap();
        // G = 2 C and G + C = 9000: G = 6000.
        assert!((p.gpu_positions as i64 - 6000).abs() <= 3, "{p:?}");
        assert!((p.predicted_s - c.step_time(3, 6000, &[3000], false)).abs() < 1e-9);
    }

    #[test]
    fn on_shared_cores_each_position_goes_to_the_cheaper_side() {
        // Side by side a cpu-worker twice as slow would take a third (above); taking turns on
        // the same cores, any position it takes costs twice what it would on the gpu-worker.
        let shared = |gpu: f64, cpu: f64| CostModel { shared_cores: true, ..cost(gpu, &[cpu]) };
        let seqs: Vec<_> = (0..3).map(|_| on(0, 3000)).collect();
        let p = plan_lp(&shared(1e-6, 2e-6), 3, &seqs, 1, true).unwrap();
        assert_eq!((p.gpu_positions, p.cpu_positions[0], p.overlap), (9000, 0, false), "{p:?}");
        let c = shared(2e-6, 1e-6);
        let p = plan_lp(&c, 3, &seqs, 1, true).unwrap();
        assert_eq!((p.gpu_positions, p.cpu_positions[0]), (0, 9000), "{p:?}");
        // The time is the sum of both sides' work.
        assert!((c.step_time(3, 100, &[200], false) - (0.001 + 0.0003 + 100.0 * 2e-6 + 200.0 * 1e-6)).abs() < 1e-12);
        // A cpu-worker's fixed cost is paid only when it has work: a small saving per
        // position does not buy it.
        let c = CostModel { cpu_fixed: vec![0.02], ..shared(2e-6, 1e-6) };
        let p = plan_lp(&c, 3, &seqs, 1, false).unwrap();
        assert_eq!(p.cpu_positions[0], 0, "{p:?}");
    }

    #[test]
    fn two_workers_and_a_slow_gpu_balance_all_three() {
        // The gpu-worker is 4x slower than either cpu-worker: G : C0 : C1 = 1 : 4 : 4.
        let c = cost(4e-6, &[1e-6, 1e-6]);
        let seqs = vec![on(0, 4500), on(1, 4500)];
        let p = plan_lp(&c, 2, &seqs, 1, false).unwrap();
        assert!((p.gpu_positions as i64 - 1000).abs() <= 2, "{p:?}");
        assert!((p.cpu_positions[0] as i64 - 4000).abs() <= 2 && (p.cpu_positions[1] as i64 - 4000).abs() <= 2, "{p:?}");
    }

    #[test]
    fn where_the_kv_lives_limits_each_worker() {
        // Worker 0 holds everything; worker 1 is fast but holds nothing: it gets nothing.
        let c = cost(1e-6, &[1e-6, 1e-9]);
        let p = plan_lp(&c, 1, &[on(0, 1000)], 1, false).unwrap();
        assert_eq!(p.cpu_positions[1], 0);
        assert!((p.gpu_positions as i64 - 500).abs() <= 1, "{p:?}");
        // A gpu-worker that may attend only a 100-position prefix (its mirrored KV).
        let limited = SeqDemand { gpu_max: 100, ..on(0, 1000) };
        let p = plan_lp(&cost(1e-9, &[1e-6]), 1, &[limited], 1, false).unwrap();
        assert_eq!(p.gpu_positions, 100);
    }

    #[test]
    fn shares_cover_every_position_once_and_round_to_blocks() {
        let c = cost(1e-6, &[1.3e-6, 0.7e-6]);
        let seqs = vec![
            SeqDemand { n_ctx: 1000, held: vec![(0, 0..512), (1, 512..1000)], gpu_max: 1000 },
            on(1, 37),
            on(0, 1),
        ];
        let p = plan_lp(&c, 3, &seqs, 16, true).unwrap();
        for (s, shares) in seqs.iter().zip(&p.shares) {
            let mut next = 0;
            for sh in shares {
                assert_eq!(sh.range.start, next, "{shares:?}");
                assert!(sh.range.end > sh.range.start);
                if sh.cpu_worker.is_none() {
                    assert!(sh.range.end % 16 == 0 || sh.range.end == s.n_ctx, "{shares:?}");
                }
                next = sh.range.end;
            }
            assert_eq!(next, s.n_ctx);
        }
    }

    #[test]
    fn overlap_hides_the_linear_layers_behind_cpu_attention() {
        // Linear 0.1 s, attention 0.4 s on either side for 8000 positions.
        let c = CostModel {
            linear_fixed: 0.1,
            linear_per_token: 0.0,
            gpu_attn_per_pos: 5e-5,
            cpu_fixed: vec![0.0],
            cpu_attn_per_pos: vec![5e-5],
            overlapped_fixed: 0.1,
            overlapped_per_token: 0.0,
            overlap_slowdown: 1.0,
            shared_cores: false,
            local_linear: None,
        };
        let seqs: Vec<_> = (0..4).map(|_| on(0, 2000)).collect();
        // Without overlap: 0.1 + 0.2 (half each). With: max(0.1 + a_g G, a_c C) = 0.25 at
        // G = 3000, C = 5000.
        let plain = plan_lp(&c, 4, &seqs, 1, false).unwrap();
        assert!((plain.predicted_s - 0.3).abs() < 1e-3 && !plain.overlap, "{plain:?}");
        let best = plan_lp(&c, 4, &seqs, 1, true).unwrap();
        assert!(best.overlap && (best.predicted_s - 0.25).abs() < 1e-3, "{best:?}");
        assert!((best.gpu_positions as i64 - 3000).abs() <= 4, "{best:?}");
        // Linear layers that cost twice as much split in two: overlap no longer pays.
        let costly = CostModel { overlapped_fixed: 0.3, ..c };
        assert!(!plan_lp(&costly, 4, &seqs, 1, true).unwrap().overlap);
    }

    #[test]
    fn static_prefixes_predict_their_time() {
        let c = cost(2e-6, &[1e-6]);
        let seqs = vec![on(0, 100), on(0, 300)];
        let all_gpu = realise(&c, 2, &seqs, &[100, 300], false);
        assert_eq!((all_gpu.gpu_positions, all_gpu.cpu_positions[0]), (400, 0));
        assert!((all_gpu.predicted_s - (0.001 + 0.0002 + 400.0 * 2e-6)).abs() < 1e-12);
        let all_cpu = realise(&c, 2, &seqs, &[0, 0], false);
        assert_eq!(all_cpu.shares[1], vec![Share { cpu_worker: Some(0), range: 0..300 }]);
    }
}
