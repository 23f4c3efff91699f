//! A mixture of experts' routed experts as the host computes them, for every device: the
//! device computes the router's logits, and [`HostExperts::moe`] routes the rows as
//! llama.cpp's `build_moe_ffn` does, hands the experts held elsewhere to the cpu-workers
//! (`RemoteExperts`), runs the held ones from the memory-mapped file (`ExpertBank`, repacked
//! where the kernels take it) and adds each row's weighted outputs. The CPU device and the
//! CUDA device (KTransformers' split: attention and the shared weights on the GPU, the
//! experts on the host) share it, so a row's experts compute the same bits on either.

use std::ops::Range;
use std::sync::Arc;

use duet_kernels::ggml_exact::soft_max_row;
use duet_kernels::mlp;
use duet_model::config::{Experts, LlamaConfig};
use duet_model::experts::{ExpertBank, ExpertTensors};
use duet_model::gguf::GgufFile;

use super::expert_usage::{ExpertUsage, RoutedTokens};
use super::{ExpertItem, RemoteExperts};
use crate::error::{GpuWorkerError, Result};

/// The routed experts a device holds (all, or the placed ones when the cpu-workers serve
/// them), and how often the router chose each.
pub struct HostExperts {
    bank: ExpertBank,
    counts: Experts,
    /// Whether the cpu-workers serve the experts (the bank holds only those placed).
    remote: bool,
    usage: ExpertUsage,
}

impl HostExperts {
    /// The experts of `layers` when `local` (none when the cpu-workers serve them).
    pub fn load(file: Arc<GgufFile>, c: &LlamaConfig, tensors: ExpertTensors, local: bool, layers: &Range<usize>, repack: bool) -> Result<Self> {
        let counts = c.experts.ok_or_else(|| GpuWorkerError::InvalidRequest("routed experts of a model without expert counts".into()))?;
        let bank = ExpertBank::load(file, c, tensors, |l, _| local && layers.contains(&l), repack)?;
        tracing::info!(held = bank.held_count(), repacked = bank.repacked_matrices(), "routed experts on the host");
        Ok(HostExperts { bank, counts, remote: !local, usage: ExpertUsage::new(c.n_layer, counts.n_expert) })
    }

    /// How many experts are held, summed over the layers.
    pub fn held_count(&self) -> usize {
        self.bank.held_count()
    }

    /// How many expert matrices were repacked into interleaved rows.
    pub fn repacked_matrices(&self) -> usize {
        self.bank.repacked_matrices()
    }

    /// Whether every routed expert is held here.
    pub fn holds_all(&self) -> bool {
        self.bank.holds_all()
    }

    /// The routed tokens per expert since the last call, reset to zero.
    pub fn take_usage(&self) -> Vec<RoutedTokens> {
        self.usage.take()
    }

    /// Holds the experts `held[l]` of each layer `l` from now on (the cpu-workers serve the
    /// rest); how many experts came or went.
    pub fn place(&mut self, held: &[Vec<usize>]) -> Result<usize> {
        if !self.remote {
            return Err(GpuWorkerError::InvalidRequest("placing routed experts needs a mixture with its experts on the cpu-workers".into()));
        }
        let (n_layer, n_expert) = (self.bank.tensors().layers.len(), self.bank.tensors().n_expert);
        if held.len() != n_layer || held.iter().flatten().any(|&e| e >= n_expert) {
            return Err(GpuWorkerError::InvalidRequest(format!("an expert placement names {} layers of {n_layer}, or an expert past {n_expert}", held.len())));
        }
        let mut moved = 0;
        for (l, want) in held.iter().enumerate() {
            for e in 0..n_expert {
                moved += usize::from(self.bank.set_held(l, e, want.contains(&e))?);
            }
        }
        Ok(moved)
    }

    /// The mixture of layer `l` over rows `x` (`[row][n_embd]`, normed) whose router logits
    /// are `logits` (`[row][n_expert]`), as llama.cpp's `build_moe_ffn` computes it: the
    /// router's softmax, the `n_used` likeliest experts (their probabilities renormalised to
    /// sum 1 where the architecture does, the sum clamped at f16's smallest normal), each
    /// expert's MLP on the rows routed to it, and per row the weighted outputs added in the
    /// order the experts were chosen. The experts not held go to `remote` first, so they run
    /// while the held ones compute. The experts `elsewhere` names are the caller's (the CUDA
    /// device's hot experts on the GPU): they are left out of the sum, and their routed rows
    /// and weights returned, per expert, for the caller to add.
    pub fn moe(&self, l: usize, mut logits: Vec<f32>, x: &[f32], remote: &mut dyn RemoteExperts, elsewhere: &dyn Fn(usize) -> bool) -> Result<(Vec<f32>, Vec<RoutedRows>)> {
        let e = self.counts;
        let d = self.bank.tensors().n_embd;
        if logits.len() * d != x.len() * e.n_expert {
            return Err(GpuWorkerError::InvalidRequest(format!("{} router logits for {} rows of {d}", logits.len(), x.len() / d)));
        }
        let routes: Vec<Vec<(usize, f32)>> = logits
            .chunks_mut(e.n_expert)
            .map(|p| {
                soft_max_row(p);
                let mut order: Vec<usize> = (0..e.n_expert).collect();
                order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
                let mut chosen: Vec<(usize, f32)> = order[..e.n_used].iter().map(|&i| (i, p[i])).collect();
                if e.norm_weights {
                    let sum = (chosen.iter().map(|&(_, w)| f64::from(w)).sum::<f64>() as f32).max(6.103_515_6e-5);
                    chosen.iter_mut().for_each(|(_, w)| *w /= sum);
                }
                chosen
            })
            .collect();
        self.usage.record(l, routes.iter().map(Vec::as_slice));
        let held = |ex: usize| self.bank.holds(l, ex) && !elsewhere(ex);
        // (row, choice) of each row routed to expert `ex`, in row order.
        let routed_to = |ex: usize| -> Vec<(usize, usize)> {
            routes.iter().enumerate().flat_map(|(t, r)| r.iter().position(|&(i, _)| i == ex).map(|k| (t, k))).collect()
        };
        let theirs: Vec<RoutedRows> = (0..e.n_expert)
            .filter(|&ex| elsewhere(ex))
            .map(|ex| RoutedRows { expert: ex, rows: routed_to(ex).into_iter().map(|(t, k)| (t, routes[t][k].1)).collect() })
            .filter(|r| !r.rows.is_empty())
            .collect();
        // (row, choice) of each item sent away, in the order sent.
        let (mut away, mut away_of) = (Vec::new(), Vec::new());
        for (t, r) in routes.iter().enumerate() {
            for (k, &(ex, w)) in r.iter().enumerate().filter(|(_, &(ex, _))| !self.bank.holds(l, ex) && !elsewhere(ex)) {
                away.push(ExpertItem { expert: ex as u32, row: t as u32, weight: w });
                away_of.push((t, k));
            }
        }
        if !away.is_empty() {
            remote.start(l, x, &away)?;
        }
        // Each held expert once, on the rows routed to it; then each row's parts in choice order.
        let mut parts: Vec<Vec<Vec<f32>>> = routes.iter().map(|r| vec![Vec::new(); r.len()]).collect();
        let mine: Vec<Vec<(usize, usize)>> = (0..e.n_expert).map(|ex| if held(ex) { routed_to(ex) } else { Vec::new() }).collect();
        let jobs: Vec<(usize, Vec<f32>)> = (0..e.n_expert)
            .filter(|&ex| !mine[ex].is_empty())
            .map(|ex| (ex, mine[ex].iter().flat_map(|&(t, _)| x[t * d..(t + 1) * d].iter().copied()).collect()))
            .collect();
        let outs = self.bank.mlp_each(l, &jobs).expect("the bank holds them");
        for ((ex, _), out) in jobs.iter().zip(outs) {
            for (&(t, k), o) in mine[*ex].iter().zip(out.chunks_exact(d)) {
                parts[t][k] = mlp::scaled(o, routes[t][k].1);
            }
        }
        if !away.is_empty() {
            let outs = remote.finish()?;
            if outs.len() != away.len() * d {
                return Err(GpuWorkerError::RemoteExperts { worker: None, what: format!("{} values back for {} items of {d}", outs.len(), away.len()) });
            }
            for (&(t, k), o) in away_of.iter().zip(outs.chunks_exact(d)) {
                parts[t][k] = o.to_vec();
            }
        }
        // Each row's parts in choice order (those of the experts elsewhere are empty).
        let mut y = vec![0f32; x.len()];
        for (row, p) in y.chunks_exact_mut(d).zip(&parts) {
            let mut mine = p.iter().filter(|part| !part.is_empty());
            if let Some(first) = mine.next() {
                row.copy_from_slice(first);
            }
            for more in mine {
                row.iter_mut().zip(more).for_each(|(a, b)| *a += b);
            }
        }
        Ok((y, theirs))
    }
}

/// The rows of a layer's batch routed to one expert, with the router's weights.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutedRows {
    pub expert: usize,
    /// (row, weight), in row order.
    pub rows: Vec<(usize, f32)>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::NoRemoteExperts;
    use rand::{Rng, SeedableRng};

    /// The experts a caller computes elsewhere (the CUDA device's hot experts) are left out
    /// of the sum and returned with their rows and weights: adding their outputs back gives
    /// the whole mixture.
    #[test]
    fn experts_computed_elsewhere_come_back_with_their_rows_and_weights() {
        let path = duet_model::testutil::workspace_root().join("testdata/tiny/arch/olmoe_q8_0.gguf");
        let file = Arc::new(GgufFile::open(&path).unwrap());
        let c = LlamaConfig::from_gguf(&file).unwrap();
        let tensors = ExpertTensors::find(&file, &c).unwrap().expect("a mixture");
        let experts = HostExperts::load(file.clone(), &c, tensors, true, &(0..c.n_layer), false).unwrap();
        let (n, d, n_expert) = (5, c.n_embd, c.experts.unwrap().n_expert);
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let x: Vec<f32> = (0..n * d).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let logits: Vec<f32> = (0..n * n_expert).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        let (whole, none) = experts.moe(1, logits.clone(), &x, &mut NoRemoteExperts, &|_| false).unwrap();
        assert!(none.is_empty());
        let elsewhere = |e: usize| e.is_multiple_of(2);
        let (mut y, routed) = experts.moe(1, logits, &x, &mut NoRemoteExperts, &elsewhere).unwrap();
        assert!(!routed.is_empty() && routed.iter().all(|r| elsewhere(r.expert) && !r.rows.is_empty()), "{routed:?}");
        for r in &routed {
            for &(t, w) in &r.rows {
                let out = experts.bank.mlp(1, r.expert, &x[t * d..(t + 1) * d]).unwrap();
                y[t * d..(t + 1) * d].iter_mut().zip(mlp::scaled(&out, w)).for_each(|(a, b)| *a += b);
            }
        }
        let worst = y.iter().zip(&whole).map(|(a, b)| (a - b).abs() / b.abs().max(1e-3)).fold(0f32, f32::max);
        assert!(worst < 1e-4, "the parts added back differ from the whole mixture by {worst:e} (relative)");
    }
}
