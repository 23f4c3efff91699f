//! The CPU device: a Llama-family forward pass over weights memory-mapped from a GGUF file,
//! with ggml's numerics (8-bit quantised activations, f16 KV cache), threads from rayon.

use std::sync::Arc;

use duet_common::kernels::attention::{causal_attention, AttnShape, KvHead};
use duet_common::kernels::dot::vec_dot_type;
use duet_common::kernels::matmul::{matmul, matmul_many, QMatrix, QuantizedActs};
use duet_common::kernels::ops::{llama3_freq_factors, rms_norm, silu_mul, Rope};
use duet_common::kernels::quant::{dequantize, GgmlType};
use duet_common::model::config::{LlamaConfig, RopeScaling};
use duet_common::model::gguf::GgufFile;
use duet_common::model::names::TensorName;
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use crate::error::{Result, WorkerError};

/// A weight matrix: the tensor's name in the file and its checked shape.
#[derive(Debug, Clone)]
struct Weight {
    name: String,
    ty: GgmlType,
    rows: usize,
    cols: usize,
}

#[derive(Debug)]
struct Layer {
    attn_norm: Vec<f32>,
    wq: Weight,
    wk: Weight,
    wv: Weight,
    wo: Weight,
    ffn_norm: Vec<f32>,
    gate: Weight,
    up: Weight,
    down: Weight,
}

/// Which positions of a forward pass need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token (generation).
    Last,
    /// Tokens `from..` of the batch (perplexity scoring).
    From(usize),
}

/// The model's weights on the CPU device, borrowed from the memory-mapped file.
pub struct CpuModel {
    file: Arc<GgufFile>,
    pub config: LlamaConfig,
    token_embd: Weight,
    output: Weight,
    output_norm: Vec<f32>,
    layers: Vec<Layer>,
    rope: Rope,
}

impl std::fmt::Debug for CpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuModel").field("config", &self.config).finish_non_exhaustive()
    }
}

fn shape_err(name: &str, expected: String, found: String) -> WorkerError {
    WorkerError::Model(duet_common::Error::TensorShape { name: name.to_string(), expected, found })
}

/// Looks a matrix up and checks it is `cols` wide (ggml dim 0) and `rows` tall.
fn weight(file: &GgufFile, name: TensorName, cols: usize, rows: usize) -> Result<Weight> {
    let name = name.name();
    let info = file.tensor_info(&name).ok_or_else(|| WorkerError::Model(duet_common::model::gguf::GgufError::MissingTensor(name.clone()).into()))?;
    if info.dims != [cols as u64, rows as u64] {
        return Err(shape_err(&name, format!("[{cols}, {rows}]"), format!("{:?}", info.dims)));
    }
    Ok(Weight { name, ty: info.ty, rows, cols })
}

/// A 1-D tensor of `n` elements, dequantised to f32.
fn vector(file: &GgufFile, name: TensorName, n: usize) -> Result<Vec<f32>> {
    let name = name.name();
    let view = file.tensor(&name).map_err(|e| WorkerError::Model(e.into()))?;
    if view.info.dims != [n as u64] {
        return Err(shape_err(&name, format!("[{n}]"), format!("{:?}", view.info.dims)));
    }
    let mut out = vec![0f32; n];
    dequantize(view.info.ty, view.data, &mut out).map_err(|e| shape_err(&name, "a dequantisable vector".into(), e.to_string()))?;
    Ok(out)
}

impl CpuModel {
    /// Checks every tensor the forward pass needs against the hyper-parameters.
    pub fn load(file: Arc<GgufFile>) -> Result<Self> {
        let config = LlamaConfig::from_gguf(&file)?;
        let c = &config;
        let f = &*file;
        let token_embd = weight(f, TensorName::TokenEmbd, c.n_embd, c.n_vocab)?;
        let output = if f.tensor_info(&TensorName::Output.name()).is_some() {
            weight(f, TensorName::Output, c.n_embd, c.n_vocab)?
        } else {
            token_embd.clone()
        };
        let layers = (0..c.n_layer)
            .map(|l| {
                Ok(Layer {
                    attn_norm: vector(f, TensorName::AttnNorm(l), c.n_embd)?,
                    wq: weight(f, TensorName::AttnQ(l), c.n_embd, c.q_dim())?,
                    wk: weight(f, TensorName::AttnK(l), c.n_embd, c.kv_dim())?,
                    wv: weight(f, TensorName::AttnV(l), c.n_embd, c.kv_dim())?,
                    wo: weight(f, TensorName::AttnOutput(l), c.q_dim(), c.n_embd)?,
                    ffn_norm: vector(f, TensorName::FfnNorm(l), c.n_embd)?,
                    gate: weight(f, TensorName::FfnGate(l), c.n_embd, c.n_ff)?,
                    up: weight(f, TensorName::FfnUp(l), c.n_embd, c.n_ff)?,
                    down: weight(f, TensorName::FfnDown(l), c.n_ff, c.n_embd)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let (freq_scale, factors) = match c.rope_scaling {
            RopeScaling::None => (1.0, None),
            RopeScaling::Linear { factor } => (1.0 / factor, None),
            RopeScaling::FreqFactors => (1.0, Some(vector(f, TensorName::RopeFreqs, c.n_rot / 2)?)),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_context } => (
                1.0,
                Some(llama3_freq_factors(c.n_rot, c.rope_freq_base, factor, low_freq_factor, high_freq_factor, original_context)),
            ),
        };
        let rope = Rope::new(c.n_rot, c.rope_freq_base, freq_scale, factors);
        let output_norm = vector(f, TensorName::OutputNorm, c.n_embd)?;
        super::warm::warm_weights(f);
        Ok(CpuModel { config, token_embd, output, output_norm, layers, rope, file })
    }

    fn mat(&self, w: &Weight) -> QMatrix<'_> {
        let view = self.file.tensor(&w.name).expect("tensor checked at load");
        QMatrix::new(w.ty, w.rows, w.cols, view.data)
    }

    /// `x` (rows of `w.cols`) times `w`: rows of `w.rows`.
    fn linear(&self, w: &Weight, x: &[f32]) -> Vec<f32> {
        let acts = QuantizedActs::new(w.ty, x, w.cols);
        let mut out = vec![0f32; acts.n_rows * w.rows];
        matmul(&self.mat(w), &acts, &mut out);
        out
    }

    /// `x` times each of `ws` (same input width): the input quantised once and one parallel
    /// loop for all when the weights share an activation type, else one [`Self::linear`]
    /// each. Same results either way.
    fn linear_many<const N: usize>(&self, ws: [&Weight; N], x: &[f32]) -> [Vec<f32>; N] {
        let act_ty = vec_dot_type(ws[0].ty);
        if ws.iter().any(|w| vec_dot_type(w.ty) != act_ty) {
            return ws.map(|w| self.linear(w, x));
        }
        let acts = QuantizedActs::new(ws[0].ty, x, ws[0].cols);
        let mut outs = ws.map(|w| vec![0f32; acts.n_rows * w.rows]);
        let mats = ws.map(|w| self.mat(w));
        let mut views: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
        matmul_many(&mats, &acts, &mut views);
        outs
    }

    /// Runs `tokens` at positions `kv.len()..` through the model, appending their K/V to the
    /// cache, and returns the logits asked for (`[row][vocab]`).
    pub fn forward(&self, tokens: &[u32], kv: &mut KvCache, logits: Logits) -> Result<Vec<f32>> {
        let n = tokens.len();
        let pos0 = kv.len;
        if n == 0 {
            return Err(WorkerError::InvalidRequest("empty batch".into()));
        }
        if pos0 + n > kv.capacity {
            return Err(WorkerError::ContextFull { needed: pos0 + n, capacity: kv.capacity });
        }
        let positions: Vec<usize> = (pos0..pos0 + n).collect();
        let rows: Vec<usize> = match logits {
            Logits::Last => vec![n - 1],
            Logits::From(i) => (i.min(n - 1)..n).collect(),
        };
        let out = self.forward_rows(tokens, &positions, &mut KvCacheAttention { kv: &mut *kv, pos0 }, &rows)?;
        kv.len = pos0 + n;
        Ok(out)
    }

    /// Runs a batch of rows through the model: `tokens[i]` at position `positions[i]`, with
    /// attention (and the K/V it stores) left to `attention`; returns the logits of
    /// `logit_rows` (`[row][vocab]`). Every row is computed on its own in the linear layers
    /// (quantised per row), so a row's result does not depend on the batch it rides in.
    pub fn forward_rows(
        &self,
        tokens: &[u32],
        positions: &[usize],
        attention: &mut dyn Attention,
        logit_rows: &[usize],
    ) -> Result<Vec<f32>> {
        let mut batch = self.start_batch(tokens, positions, logit_rows)?;
        for l in 0..self.config.n_layer {
            let (q, k, v) = self.attention_inputs(l, &mut batch);
            let mut attn = vec![0f32; tokens.len() * self.config.q_dim()];
            attention.attend(l, &q, &k, &v, &mut attn)?;
            self.finish_layer(l, &mut batch, &attn);
        }
        Ok(self.logits(&batch, logit_rows))
    }

    /// Checks a batch and embeds its tokens: the state [`Self::attention_inputs`] and
    /// [`Self::finish_layer`] carry through the layers.
    pub fn start_batch(&self, tokens: &[u32], positions: &[usize], logit_rows: &[usize]) -> Result<Batch> {
        let c = &self.config;
        let n = tokens.len();
        if n == 0 || positions.len() != n {
            return Err(WorkerError::InvalidRequest(format!("a batch of {n} tokens with {} positions", positions.len())));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.n_vocab) {
            return Err(WorkerError::Model(duet_common::Error::TokenOutOfRange { id: bad, n_vocab: c.n_vocab }));
        }
        if let Some(&bad) = logit_rows.iter().find(|&&r| r >= n) {
            return Err(WorkerError::InvalidRequest(format!("logits of row {bad} of a batch of {n}")));
        }
        let d = c.n_embd;
        let mut x = vec![0f32; n * d];
        let embd = self.mat(&self.token_embd);
        x.par_chunks_mut(d).zip(tokens).for_each(|(row, &t)| {
            dequantize(embd.ty, embd.row(t as usize), row).expect("embedding row");
        });
        let tables = positions.iter().map(|&p| self.rope.table(p)).collect();
        Ok(Batch { x, xn: vec![0f32; n * d], tables })
    }

    /// Layer `l` up to attention: the rows' queries, keys and values, RoPE applied
    /// (`[row][head][head_dim]`).
    pub fn attention_inputs(&self, l: usize, b: &mut Batch) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let c = &self.config;
        let (layer, hd, n_rot) = (&self.layers[l], c.head_dim, c.n_rot);
        norm_rows(&b.x, &layer.attn_norm, c.rms_eps, &mut b.xn);
        let [mut q, mut k, v] = self.linear_many([&layer.wq, &layer.wk, &layer.wv], &b.xn);
        q.par_chunks_mut(c.q_dim()).zip(&b.tables).for_each(|(row, t)| {
            row.chunks_exact_mut(hd).for_each(|h| Rope::apply(t, &mut h[..n_rot]));
        });
        k.par_chunks_mut(c.kv_dim()).zip(&b.tables).for_each(|(row, t)| {
            row.chunks_exact_mut(hd).for_each(|h| Rope::apply(t, &mut h[..n_rot]));
        });
        (q, k, v)
    }

    /// Layer `l` after attention (`attn`, `[row][head][head_dim]`): output projection,
    /// residual, MLP, residual.
    pub fn finish_layer(&self, l: usize, b: &mut Batch, attn: &[f32]) {
        let c = &self.config;
        let layer = &self.layers[l];
        let o = self.linear(&layer.wo, attn);
        add(&mut b.x, &o);
        norm_rows(&b.x, &layer.ffn_norm, c.rms_eps, &mut b.xn);
        let [mut g, u] = self.linear_many([&layer.gate, &layer.up], &b.xn);
        g.par_chunks_mut(c.n_ff).zip(u.par_chunks(c.n_ff)).for_each(|(g, u)| silu_mul(g, u));
        let down = self.linear(&layer.down, &g);
        add(&mut b.x, &down);
    }

    /// The logits of `rows` of a batch that went through every layer (`[row][vocab]`).
    pub fn logits(&self, b: &Batch, rows: &[usize]) -> Vec<f32> {
        let d = self.config.n_embd;
        let picked: Vec<f32> = rows.iter().flat_map(|&r| b.x[r * d..(r + 1) * d].iter().copied()).collect();
        let mut normed = vec![0f32; picked.len()];
        norm_rows(&picked, &self.output_norm, self.config.rms_eps, &mut normed);
        self.linear(&self.output, &normed)
    }

    /// The shape of one attention call of this model.
    pub fn attn_shape(&self) -> AttnShape {
        AttnShape { n_head: self.config.n_head, n_kv_head: self.config.n_kv_head, head_dim: self.config.head_dim }
    }
}

/// A batch on its way through the layers: the hidden rows, a scratch of their size, and
/// the rows' RoPE tables.
pub struct Batch {
    x: Vec<f32>,
    xn: Vec<f32>,
    tables: Vec<Vec<(f32, f32)>>,
}

/// Where a forward pass's attention happens: stores the batch's new K/V rows and computes
/// attention for every row. `q` and `out` are `[row][n_head][head_dim]`, `k` and `v`
/// `[row][n_kv_head][head_dim]`.
pub trait Attention {
    fn attend(&mut self, layer: usize, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) -> Result<()>;
}

/// Single-process attention: one sequence whose batch continues its [`KvCache`] at `pos0`.
struct KvCacheAttention<'a> {
    kv: &'a mut KvCache,
    pos0: usize,
}

impl Attention for KvCacheAttention<'_> {
    fn attend(&mut self, layer: usize, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) -> Result<()> {
        self.kv.write(layer, self.pos0, k, v);
        let shape = AttnShape { n_head: self.kv.n_head, n_kv_head: self.kv.k[layer].len(), head_dim: self.kv.head_dim };
        causal_attention(q, &self.kv.heads(layer), shape, self.pos0, out);
        Ok(())
    }
}

fn norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    out.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(|(o, x)| rms_norm(x, w, eps, o));
}

fn add(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

/// One sequence's KV cache: per layer and KV head, `[position][head_dim]` in f16.
#[derive(Debug)]
pub struct KvCache {
    /// `k[layer][kv_head]`, `capacity * head_dim` each.
    k: Vec<Vec<Vec<f16>>>,
    v: Vec<Vec<Vec<f16>>>,
    head_dim: usize,
    n_head: usize,
    capacity: usize,
    len: usize,
}

impl KvCache {
    pub fn new(config: &LlamaConfig, capacity: usize) -> Self {
        let make = || vec![vec![vec![f16::ZERO; capacity * config.head_dim]; config.n_kv_head]; config.n_layer];
        KvCache { k: make(), v: make(), head_dim: config.head_dim, n_head: config.n_head, capacity, len: 0 }
    }

    /// Positions already cached.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets every position (the memory is reused).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Stores rows `[token][kv_head][head_dim]` of K and V at positions `pos0..`.
    fn write(&mut self, layer: usize, pos0: usize, k: &[f32], v: &[f32]) {
        let hd = self.head_dim;
        let n_kv = self.k[layer].len();
        for (src, dst) in [(k, &mut self.k[layer]), (v, &mut self.v[layer])] {
            for (t, row) in src.chunks_exact(n_kv * hd).enumerate() {
                for (h, head) in row.chunks_exact(hd).enumerate() {
                    let p = pos0 + t;
                    dst[h][p * hd..(p + 1) * hd].convert_from_f32_slice(head);
                }
            }
        }
    }

    fn heads(&self, layer: usize) -> Vec<KvHead<'_>> {
        self.k[layer].iter().zip(&self.v[layer]).map(|(k, v)| KvHead { k, v }).collect()
    }
}
