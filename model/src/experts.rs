//! The routed experts of a mixture-of-experts model (Mixtral, Qwen3-MoE, OLMoE), as one bank
//! both sides of Duet compute from: the CPU device for the experts it keeps, a cpu-worker for
//! the experts it serves over the exchange ring. Each layer's `ffn_{gate,up,down}_exps` tensors
//! stack `n_expert` matrices; a bank holds a chosen set of experts per layer
//! ([`ExpertBank::holds`], changed at run time by [`ExpertBank::set_held`]),
//! checked against the hyper-parameters, their Q4_K/Q6_K/Q4_0 matrices repacked into interleaved
//! rows where this CPU has the kernels, and computes an expert's gated MLP with the same
//! kernels (`duet_kernels::mlp`) wherever it runs, so a row's output is the same bits on
//! either side.

use std::sync::Arc;

use duet_kernels::interleaved::{self, Interleaved};
use duet_kernels::matmul::QMatrix;
use duet_kernels::mlp::{gated_mlp, GateAct};
use duet_kernels::ops::{gelu_mul, silu_mul};
use duet_kernels::quant::GgmlType;
use rayon::prelude::*;

use crate::config::{FfnAct, LlamaConfig};
use crate::gguf::{GgufError, GgufFile};
use crate::names::TensorName;
use crate::{Error, Result};

/// The gate activation kernel of an MLP of activation `act` (times up, in place).
pub fn gate_act(act: FfnAct) -> GateAct {
    match act {
        FfnAct::Silu => silu_mul,
        FfnAct::Gelu => gelu_mul,
    }
}

/// One stacked expert tensor: `n` matrices of `rows` outputs by `cols` inputs (ggml dims
/// `[cols, rows, n]`), checked.
#[derive(Debug, Clone)]
pub struct Stacked {
    pub name: String,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
}

impl Stacked {
    fn find(file: &GgufFile, name: TensorName, cols: usize, rows: usize, n: usize) -> Result<Self> {
        let name = name.name();
        let info = file.tensor_info(&name).ok_or_else(|| Error::from(GgufError::MissingTensor(name.clone())))?;
        if info.dims != [cols as u64, rows as u64, n as u64] {
            return Err(Error::TensorShape { name, expected: format!("[{cols}, {rows}, {n}]"), found: format!("{:?}", info.dims) });
        }
        Ok(Stacked { name, ty: info.ty, rows, cols })
    }

    /// Expert `e`'s bytes in the tensor's data.
    pub fn expert_bytes<'a>(&self, data: &'a [u8], e: usize) -> &'a [u8] {
        let len = self.rows * self.ty.row_bytes(self.cols);
        &data[e * len..(e + 1) * len]
    }
}

/// Every MoE layer's stacked gate, up and down tensors, checked against the model's
/// hyper-parameters (`None` from [`ExpertTensors::find`] for a dense model).
#[derive(Debug, Clone)]
pub struct ExpertTensors {
    pub n_expert: usize,
    pub n_ff: usize,
    pub n_embd: usize,
    pub layers: Vec<[Stacked; 3]>,
}

impl ExpertTensors {
    pub fn find(file: &GgufFile, c: &LlamaConfig) -> Result<Option<Self>> {
        let Some(e) = c.experts else { return Ok(None) };
        let layers = (0..c.n_layer)
            .map(|l| {
                Ok([
                    Stacked::find(file, TensorName::FfnGateExps(l), c.n_embd, e.n_ff, e.n_expert)?,
                    Stacked::find(file, TensorName::FfnUpExps(l), c.n_embd, e.n_ff, e.n_expert)?,
                    Stacked::find(file, TensorName::FfnDownExps(l), e.n_ff, c.n_embd, e.n_expert)?,
                ])
            })
            .collect::<Result<_>>()?;
        Ok(Some(ExpertTensors { n_expert: e.n_expert, n_ff: e.n_ff, n_embd: c.n_embd, layers }))
    }

    /// Whether `name` is one of the stacked expert tensors.
    pub fn is_expert_tensor(&self, name: &str) -> bool {
        self.layers.iter().flatten().any(|s| s.name == name)
    }
}

/// The experts `held` of every MoE layer: their matrices mapped from the file, with
/// interleaved copies where the kernels take them.
pub struct ExpertBank {
    file: Arc<GgufFile>,
    tensors: ExpertTensors,
    /// `[layer][expert]`.
    held: Vec<Vec<bool>>,
    act: GateAct,
    /// Whether held Q4_K/Q6_K experts get interleaved copies.
    repack: bool,
    /// `[layer][gate, up, down][expert]`: the repacked copy, if any.
    packed: Vec<[Vec<Option<Interleaved>>; 3]>,
}

impl std::fmt::Debug for ExpertBank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertBank").field("n_expert", &self.tensors.n_expert).field("held", &self.held_count()).finish_non_exhaustive()
    }
}

impl ExpertBank {
    /// The bank of the experts `e` of each layer `l` with `held(l, e)`, checked; `repack`
    /// makes the interleaved copies (where this CPU has their kernels) and then lets go of
    /// the file's pages of a stacked tensor whose held experts were all repacked.
    pub fn load(file: Arc<GgufFile>, c: &LlamaConfig, tensors: ExpertTensors, held: impl Fn(usize, usize) -> bool, repack: bool) -> Result<Self> {
        let act = gate_act(c.ffn_act);
        let held: Vec<Vec<bool>> = (0..tensors.layers.len()).map(|l| (0..tensors.n_expert).map(|e| held(l, e)).collect()).collect();
        let repack = repack && interleaved::available();
        let mut packed = Vec::with_capacity(tensors.layers.len());
        for (layer, held) in tensors.layers.iter().zip(&held) {
            let mut per = [Vec::new(), Vec::new(), Vec::new()];
            for (s, out) in layer.iter().zip(per.iter_mut()) {
                let data = file.tensor(&s.name)?.data;
                *out = (0..tensors.n_expert).map(|e| if held[e] { packed_copy(repack, s, data, e) } else { None }).collect();
                let all_packed = (0..tensors.n_expert).all(|e| !held[e] || out[e].is_some());
                if all_packed {
                    // Every held expert is read from its interleaved copy (at every batch
                    // size). Advice only: pages not released just stay mapped (and come back
                    // from the file if an expert is held later).
                    let _ = file.release_tensor_pages(&s.name);
                }
            }
            packed.push(per);
        }
        Ok(ExpertBank { file, tensors, held, act, repack, packed })
    }

    /// Holds expert `e` of `layer` (repacking it where the bank repacks) or lets it go.
    /// Returns whether that changed anything; false for a layer or expert out of range.
    pub fn set_held(&mut self, layer: usize, e: usize, hold: bool) -> Result<bool> {
        let (Some(stacks), Some(now)) = (self.tensors.layers.get(layer), self.held.get(layer).and_then(|h| h.get(e).copied())) else {
            return Ok(false);
        };
        if now == hold {
            return Ok(false);
        }
        for (s, out) in stacks.iter().zip(self.packed[layer].iter_mut()) {
            out[e] = if hold { packed_copy(self.repack, s, self.file.tensor(&s.name)?.data, e) } else { None };
        }
        self.held[layer][e] = hold;
        Ok(true)
    }

    /// Whether this bank computes expert `e` of `layer`.
    pub fn holds(&self, layer: usize, e: usize) -> bool {
        self.held.get(layer).and_then(|h| h.get(e)).copied().unwrap_or(false)
    }

    /// The experts of `layer` this bank computes.
    pub fn held_in(&self, layer: usize) -> Vec<usize> {
        self.held.get(layer).map_or_else(Vec::new, |h| (0..h.len()).filter(|&e| h[e]).collect())
    }

    /// How many experts this bank computes, summed over the layers.
    pub fn held_count(&self) -> usize {
        self.held.iter().flatten().filter(|&&h| h).count()
    }

    /// Whether this bank computes every expert of every layer.
    pub fn holds_all(&self) -> bool {
        self.held.iter().flatten().all(|&h| h)
    }

    /// The model's expert tensors.
    pub fn tensors(&self) -> &ExpertTensors {
        &self.tensors
    }

    /// How many matrices were repacked into interleaved rows.
    pub fn repacked_matrices(&self) -> usize {
        self.packed.iter().flatten().flatten().filter(|p| p.is_some()).count()
    }

    /// Expert `e` of `layer`'s gated MLP of rows `x` (`[row][n_embd]`): rows of `n_embd`.
    /// `None` if the bank does not hold it or the layer does not exist.
    pub fn mlp(&self, layer: usize, e: usize, x: &[f32]) -> Option<Vec<f32>> {
        if !self.holds(layer, e) {
            return None;
        }
        let (stacks, packed) = (self.tensors.layers.get(layer)?, &self.packed[layer]);
        let mats: [QMatrix<'_>; 3] = std::array::from_fn(|i| {
            let s = &stacks[i];
            let data = self.file.tensor(&s.name).expect("tensor checked at load").data;
            let m = QMatrix::new(s.ty, s.rows, s.cols, s.expert_bytes(data, e));
            match &packed[i][e] {
                Some(p) => m.with_interleaved(p),
                None => m,
            }
        });
        Some(gated_mlp([&mats[0], &mats[1], &mats[2]], self.act, x))
    }

    /// [`ExpertBank::mlp`] of each `(expert, rows)` of `layer`, the experts in parallel (each
    /// product parallel inside, so a lone expert still takes every thread): one layer's
    /// routed experts. At batch 1 a layer's eight experts of a few MiB each, one after
    /// another, left threads waiting at every product's end: the OLMoE shape's experts
    /// streamed at 36 GB/s one by one against 44 in parallel (kernel bench, same run).
    /// `None` if the bank does not hold one of them.
    pub fn mlp_each(&self, layer: usize, jobs: &[(usize, Vec<f32>)]) -> Option<Vec<Vec<f32>>> {
        jobs.par_iter().map(|(e, x)| self.mlp(layer, *e, x)).collect()
    }
}

/// Expert `e`'s interleaved copy of stack `s` (whose data is `data`), where `repack` asks for
/// one and the kernels take its type.
fn packed_copy(repack: bool, s: &Stacked, data: &[u8], e: usize) -> Option<Interleaved> {
    match repack && interleaved::packs(s.ty) {
        true => Interleaved::new(s.ty, s.rows, s.cols, s.expert_bytes(data, e)),
        false => None,
    }
}
