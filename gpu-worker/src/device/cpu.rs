//! The CPU device: a Llama-shaped forward pass (Qwen 2's biases, Qwen 3's Q/K norms, NeoX
//! RoPE, Gemma 3's embedding scale, GeGLU, post norms and sliding-window layers) over weights
//! memory-mapped from a GGUF file
//! (Q4_K, Q5_K, Q6_K, Q4_0, Q5_0 and Q5_1 matrices, and with AVX2 Q4_1, repacked at load into interleaved rows where the CPU has the kernels for
//! them), with ggml's numerics (8-bit quantised activations, f16 KV cache), threads from
//! rayon; attention on the host kernels (`host_attention`).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use duet_kernels::interleaved::{self, Interleaved};
use duet_kernels::matmul::QMatrix;
use duet_kernels::mlp::{self, GateAct};
use duet_kernels::ops::{rms_norm, Rope};
use duet_kernels::quant::dequantize;
use duet_model::config::LlamaConfig;
use duet_model::experts::gate_act;
use duet_model::gguf::GgufFile;
use duet_proto::pb;
use rayon::prelude::*;

use super::expert_usage::RoutedTokens;
use super::host_experts::HostExperts;
use super::model::{check_batch, check_hidden, Ffn, ModelTensors, Weight};
use super::{host_attention, Device, DecodeItem, KvSink, KvSource, Partial, PrefillItem, Qkv, RemoteExperts};
use crate::error::{GpuWorkerError, Result};

/// The CPU device: the model's weights, borrowed from the memory-mapped file, and the
/// repacked copies the products read instead (by tensor name).
pub struct CpuDevice {
    file: Arc<GgufFile>,
    m: ModelTensors,
    /// The layers it computes: all, or its part of a model split across devices.
    layers: Range<usize>,
    interleaved: HashMap<String, Interleaved>,
    /// A mixture's routed experts: all of them, or, when the cpu-workers serve them, the
    /// hot ones placed here (none at first).
    experts: Option<HostExperts>,
    act: GateAct,
}

impl std::fmt::Debug for CpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuDevice").field("config", &self.m.config).finish_non_exhaustive()
    }
}

impl CpuDevice {
    /// Checks every tensor the forward pass needs and faults the mapped weights in; repacks
    /// the matrices the interleaved kernels take unless `DUET_REPACK=0`. A mixture's routed
    /// experts are loaded only with `local_experts` (else the cpu-workers serve them).
    pub fn load(file: Arc<GgufFile>, local_experts: bool) -> Result<Self> {
        Self::load_with(file, repack_default(), local_experts)
    }

    /// [`Self::load`] with the repacking chosen by the caller (`false`: every matrix in the
    /// file's own layout).
    pub fn load_with(file: Arc<GgufFile>, repack: bool, local_experts: bool) -> Result<Self> {
        let n_layer = LlamaConfig::from_gguf(&file).map_err(GpuWorkerError::Model)?.n_layer;
        Self::load_layers(file, repack, local_experts, 0..n_layer)
    }

    /// [`Self::load_with`] for the part `layers` of a model split across devices: only their
    /// weights (with the embedding where the part starts at layer 0, the LM head where it
    /// ends at the last) are read in and repacked; the device refuses the other layers.
    pub fn load_layers(file: Arc<GgufFile>, repack: bool, local_experts: bool, layers: Range<usize>) -> Result<Self> {
        let m = ModelTensors::load(&file)?;
        let n_layer = m.config.n_layer;
        if layers.is_empty() || layers.end > n_layer {
            return Err(GpuWorkerError::InvalidRequest(format!("layers {layers:?} of a model of {n_layer}")));
        }
        let remote = m.experts.as_ref().filter(|_| !local_experts);
        super::page_in::page_in_weights(&file, |name| !m.tensor_in(name, &layers) || remote.is_some_and(|t| t.is_expert_tensor(name)));
        let interleaved = if repack {
            repack_matrices(&file, &m, &layers)
        } else {
            tracing::info!("weights not repacked (DUET_REPACK=0)");
            HashMap::new()
        };
        let experts = match m.experts.clone() {
            Some(t) => Some(HostExperts::load(file.clone(), &m.config, t, local_experts, &layers, repack)?),
            None => None,
        };
        let act = gate_act(m.config.ffn_act);
        Ok(CpuDevice { file, m, layers, interleaved, experts, act })
    }

    /// Fails unless the device computes layer `l`.
    fn check_layer(&self, l: usize) -> Result<()> {
        if self.layers.contains(&l) {
            Ok(())
        } else {
            Err(GpuWorkerError::InvalidRequest(format!("layer {l} is not on this device (it holds layers {:?})", self.layers)))
        }
    }

    /// A batch of hidden rows `x` (`[row][n_embd]`) at `positions`.
    fn batch(&self, x: Vec<f32>, positions: &[usize], logit_rows: &[usize]) -> CpuBatch {
        let tables = positions.iter().map(|&p| self.m.rope.table(p)).collect();
        let tables_swa = self.m.rope_swa.as_ref().map(|r| positions.iter().map(|&p| r.table(p)).collect());
        CpuBatch { xn: vec![0f32; x.len()], x, tables, tables_swa, positions: positions.to_vec(), logit_rows: logit_rows.to_vec() }
    }

    /// How many routed experts the device computes itself, summed over the layers.
    pub fn held_experts(&self) -> usize {
        self.experts.as_ref().map_or(0, HostExperts::held_count)
    }

    /// How many weight matrices were repacked into interleaved rows (experts' included).
    pub fn repacked_matrices(&self) -> usize {
        self.interleaved.len() + self.experts.as_ref().map_or(0, HostExperts::repacked_matrices)
    }

    fn mat(&self, w: &Weight) -> QMatrix<'_> {
        let view = self.file.tensor(&w.name).expect("tensor checked at load");
        let mat = QMatrix::new(w.ty, w.rows, w.cols, w.bytes(view.data));
        match self.interleaved.get(&w.key()) {
            Some(packed) => mat.with_interleaved(packed),
            None => mat,
        }
    }

    /// `x` (rows of `w.cols`) times `w`: rows of `w.rows`.
    fn linear(&self, w: &Weight, x: &[f32]) -> Vec<f32> {
        mlp::linear(&self.mat(w), x)
    }

    /// `x` times each of `ws` (same input width), the input quantised once where it can be.
    fn linear_many<const N: usize>(&self, ws: [&Weight; N], x: &[f32]) -> [Vec<f32>; N] {
        let mats = ws.map(|w| self.mat(w));
        mlp::linear_many(std::array::from_fn(|i| &mats[i]), x)
    }
}

/// Whether matrices are repacked at load: yes, unless `DUET_REPACK=0`.
pub fn repack_default() -> bool {
    !std::env::var("DUET_REPACK").is_ok_and(|v| v == "0")
}

/// The longest prompt slice of one forward pass on the CPU device.
pub const PREFILL_CHUNK: usize = 512;

/// A batch on its way through the CPU device's layers: the hidden rows, a scratch of their
/// size, the rows' RoPE tables (and those of the sliding-window layers, whose RoPE differs)
/// and the rows whose logits are wanted.
pub struct CpuBatch {
    x: Vec<f32>,
    xn: Vec<f32>,
    tables: Vec<Vec<(f32, f32)>>,
    tables_swa: Option<Vec<Vec<(f32, f32)>>>,
    positions: Vec<usize>,
    logit_rows: Vec<usize>,
}

impl Device for CpuDevice {
    type Batch = CpuBatch;

    fn kind(&self) -> pb::DeviceKind {
        pb::DeviceKind::Cpu
    }

    fn describe(&self) -> String {
        format!("cpu ({:?})", duet_kernels::isa()).to_lowercase()
    }

    fn config(&self) -> &LlamaConfig {
        &self.m.config
    }

    fn prefill_chunk(&self) -> usize {
        PREFILL_CHUNK
    }

    fn holds_all_experts(&self) -> bool {
        self.experts.as_ref().is_none_or(HostExperts::holds_all)
    }

    fn place_experts(&mut self, held: &[Vec<usize>]) -> Result<usize> {
        match &mut self.experts {
            Some(e) => e.place(held),
            None => Err(GpuWorkerError::InvalidRequest("placing routed experts needs a mixture with its experts on the cpu-workers".into())),
        }
    }

    fn take_expert_usage(&self) -> Vec<RoutedTokens> {
        self.experts.as_ref().map_or_else(Vec::new, HostExperts::take_usage)
    }

    fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    fn start_batch(&self, tokens: &[u32], positions: &[usize], logit_rows: &[usize]) -> Result<CpuBatch> {
        let c = &self.m.config;
        check_batch(c, tokens, positions, logit_rows)?;
        self.check_layer(0)?;
        let n = tokens.len();
        let d = c.n_embd;
        let mut x = vec![0f32; n * d];
        let embd = self.mat(&self.m.token_embd);
        let scale = c.embedding_scale;
        x.par_chunks_mut(d).zip(tokens).for_each(|(row, &t)| {
            dequantize(embd.ty, embd.row(t as usize), row).expect("embedding row");
            if scale != 1.0 {
                row.iter_mut().for_each(|v| *v *= scale);
            }
        });
        Ok(self.batch(x, positions, logit_rows))
    }

    fn hidden(&self, b: &CpuBatch) -> Result<Vec<f32>> {
        Ok(b.x.clone())
    }

    fn resume_batch(&self, hidden: Vec<f32>, positions: &[usize], logit_rows: &[usize]) -> Result<CpuBatch> {
        check_hidden(&self.m.config, &hidden, positions, logit_rows)?;
        self.check_layer(self.layers.start)?;
        Ok(self.batch(hidden, positions, logit_rows))
    }

    fn qkv(&self, l: usize, b: &mut CpuBatch) -> Result<Qkv> {
        self.check_layer(l)?;
        let c = &self.m.config;
        let (layer, hd, n_rot) = (&self.m.layers[l], c.head_dim, c.n_rot);
        norm_rows(&b.x, &layer.attn_norm, c.rms_eps, &mut b.xn);
        let [mut q, mut k, mut v] = self.linear_many([&layer.wq, &layer.wk, &layer.wv], &b.xn);
        if let Some([bq, bk, bv]) = &layer.qkv_bias {
            add_rows(&mut q, bq);
            add_rows(&mut k, bk);
            add_rows(&mut v, bv);
        }
        let rope = if c.rope_neox { Rope::apply_neox } else { Rope::apply };
        let (q_norm, k_norm) = match &layer.qk_norm {
            Some([qn, kn]) => (Some(qn), Some(kn)),
            None => (None, None),
        };
        let tables = match &b.tables_swa {
            Some(t) if c.window(l).is_some() => t,
            _ => &b.tables,
        };
        let heads = |x: &mut [f32], width: usize, norm: Option<&Vec<f32>>, scale: f32| {
            x.par_chunks_mut(width).zip(tables).for_each(|(row, t)| {
                // A norm as wide as the row (OLMoE) normalises it whole, before the heads.
                if let Some(w) = norm.filter(|w| w.len() == width && width != hd) {
                    let raw = row.to_vec();
                    rms_norm(&raw, w, c.rms_eps, row);
                }
                row.chunks_exact_mut(hd).for_each(|h| {
                    if let Some(w) = norm.filter(|w| w.len() == hd) {
                        let raw = h.to_vec();
                        rms_norm(&raw, w, c.rms_eps, h);
                    }
                    rope(t, &mut h[..n_rot]);
                    if scale != 1.0 {
                        h.iter_mut().for_each(|v| *v *= scale);
                    }
                })
            });
        };
        heads(&mut q, c.q_dim(), q_norm, c.q_prescale);
        heads(&mut k, c.kv_dim(), k_norm, 1.0);
        if let Some(t) = c.attn_temperature {
            q.par_chunks_mut(c.q_dim()).zip(&b.positions).for_each(|(row, &p)| {
                let f = t.at(p);
                row.iter_mut().for_each(|v| *v *= f);
            });
        }
        Ok(Qkv { q, k, v, on_device: None })
    }

    fn store_kv(&self, layer: usize, qkv: &Qkv, kv: &mut dyn KvSink) -> Result<()> {
        host_attention::store(&self.m.config, layer, &qkv.k, &qkv.v, kv)
    }

    fn prefill_attention(&self, layer: usize, qkv: &Qkv, items: &[PrefillItem], kv: &dyn KvSource, out: &mut [f32]) -> Result<()> {
        host_attention::prefill(&self.m.config, layer, &qkv.q, items, kv, out)
    }

    fn decode_attention(&self, layer: usize, qkv: &Qkv, items: &[DecodeItem], kv: &dyn KvSource) -> Result<Vec<Partial>> {
        host_attention::decode(&self.m.config, layer, &qkv.q, items, kv)
    }

    fn finish_layer(&self, l: usize, b: &mut CpuBatch, attn: &[f32], remote: &mut dyn RemoteExperts) -> Result<()> {
        self.check_layer(l)?;
        let c = &self.m.config;
        let layer = &self.m.layers[l];
        let mut o = self.linear(&layer.wo, attn);
        if let Some([post_attn, _]) = &layer.post_norms {
            o = normed(&o, post_attn, c.rms_eps);
        }
        add(&mut b.x, &o);
        norm_rows(&b.x, &layer.ffn_norm, c.rms_eps, &mut b.xn);
        let mut down = match &layer.ffn {
            Ffn::Dense { gate, up, down } => mlp::gated_mlp([&self.mat(gate), &self.mat(up), &self.mat(down)], self.act, &b.xn),
            Ffn::Moe { router } => {
                let experts = self.experts.as_ref().expect("an MoE model has its experts");
                experts.moe(l, self.linear(router, &b.xn), &b.xn, remote, &|_| false)?.0
            }
        };
        if let Some([_, post_ffn]) = &layer.post_norms {
            down = normed(&down, post_ffn, c.rms_eps);
        }
        add(&mut b.x, &down);
        Ok(())
    }

    fn logits(&self, b: &CpuBatch) -> Result<Vec<f32>> {
        self.check_layer(self.m.config.n_layer - 1)?;
        let d = self.m.config.n_embd;
        let picked: Vec<f32> = b.logit_rows.iter().flat_map(|&r| b.x[r * d..(r + 1) * d].iter().copied()).collect();
        let mut normed = vec![0f32; picked.len()];
        norm_rows(&picked, &self.m.output_norm, self.m.config.rms_eps, &mut normed);
        let mut logits = self.linear(&self.m.output, &normed);
        if let Some(cap) = self.m.config.final_logit_softcap {
            // ggml: scale by 1/cap, tanh, scale by cap, each in f32.
            logits.par_iter_mut().for_each(|v| *v = (*v * (1.0 / cap)).tanh() * cap);
        }
        Ok(logits)
    }
}

/// Repacks every Q4_K, Q5_K, Q6_K, Q4_0, Q5_0 and Q5_1 (with AVX2, Q4_1) matrix the products of `layers` read (those layers', and
/// the LM head where they end at the last; not an untied embedding, whose rows are only
/// looked up) whose rows fill whole groups into interleaved rows (llama.cpp's CPU "repack"
/// buffers do the same), when this CPU has the kernels; the file's pages of a repacked matrix
/// are then released, except a tied embedding's (whose rows each step reads one by one).
fn repack_matrices(file: &GgufFile, m: &ModelTensors, layers: &Range<usize>) -> HashMap<String, Interleaved> {
    let mut out = HashMap::new();
    if !interleaved::available() {
        tracing::info!("weights not repacked: the interleaved kernels need AVX2 or AVX-512");
        return out;
    }
    let started = Instant::now();
    let mut bytes = 0usize;
    // The LM head where the device computes logits (a tied one too), and its layers' matrices.
    let last = layers.end == m.config.n_layer;
    let products = m.weights().filter(|w| if w.name == m.output.name { last } else { w.name != m.token_embd.name && m.tensor_in(&w.name, layers) });
    for w in products.filter(|w| interleaved::packs(w.ty)) {
        let data = w.bytes(file.tensor(&w.name).expect("tensor checked at load").data);
        if let Some(packed) = Interleaved::new(w.ty, w.rows, w.cols, data) {
            bytes += data.len();
            out.insert(w.key(), packed);
            // The pages of a part of a fused matrix stay: its other parts may not be repacked.
            let whole = file.tensor_info(&w.name).is_some_and(|t| t.dims == [w.cols as u64, w.rows as u64]);
            if w.name != m.token_embd.name && whole {
                if let Err(e) = file.release_tensor_pages(&w.name) {
                    tracing::debug!(tensor = %w.name, error = %e, "could not release the file's pages");
                }
            }
        }
    }
    if !out.is_empty() {
        tracing::info!(
            matrices = out.len(),
            mib = bytes >> 20,
            secs = started.elapsed().as_secs_f32(),
            "weights repacked into interleaved rows"
        );
    }
    out
}

fn normed(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    norm_rows(x, w, eps, &mut out);
    out
}

fn norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    out.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(|(o, x)| rms_norm(x, w, eps, o));
}

/// Adds `bias` to every row of `x`.
fn add_rows(x: &mut [f32], bias: &[f32]) {
    x.par_chunks_mut(bias.len()).for_each(|row| add(row, bias));
}

fn add(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}
