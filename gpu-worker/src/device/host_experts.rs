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
    /// while the held ones compute.
    pub fn moe(&self, l: usize, mut logits: Vec<f32>, x: &[f32], remote: &mut dyn RemoteExperts) -> Result<Vec<f32>> {
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
        let held = |ex: usize| self.bank.holds(l, ex);
        // (row, choice) of each item sent away, in the order sent.
        let (mut away, mut away_of) = (Vec::new(), Vec::new());
        for (t, r) in routes.iter().enumerate() {
            for (k, &(ex, w)) in r.iter().enumerate().filter(|(_, &(ex, _))| !held(ex)) {
                away.push(ExpertItem { expert: ex as u32, row: t as u32, weight: w });
                away_of.push((t, k));
            }
        }
        if !away.is_empty() {
            remote.start(l, x, &away)?;
        }
        // Each held expert once, on the rows routed to it; then each row's parts in choice order.
        let mut parts: Vec<Vec<Vec<f32>>> = routes.iter().map(|r| vec![Vec::new(); r.len()]).collect();
        for ex in (0..e.n_expert).filter(|&ex| held(ex)) {
            let rows: Vec<(usize, usize)> =
                routes.iter().enumerate().flat_map(|(t, r)| r.iter().position(|&(i, _)| i == ex).map(|k| (t, k))).collect();
            if rows.is_empty() {
                continue;
            }
            let xs: Vec<f32> = rows.iter().flat_map(|&(t, _)| x[t * d..(t + 1) * d].iter().copied()).collect();
            let out = self.bank.mlp(l, ex, &xs).expect("the bank holds it");
            for (&(t, k), o) in rows.iter().zip(out.chunks_exact(d)) {
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
        let mut y = vec![0f32; x.len()];
        for (row, p) in y.chunks_exact_mut(d).zip(&parts) {
            row.copy_from_slice(&p[0]);
            for more in &p[1..] {
                row.iter_mut().zip(more).for_each(|(a, b)| *a += b);
            }
        }
        Ok(y)
    }
}
