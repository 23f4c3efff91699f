//! The CPU device: a Llama-family forward pass over weights memory-mapped from a GGUF file,
//! with ggml's numerics (8-bit quantised activations, f16 KV cache), threads from rayon. Decode
//! attention reads the KV in place through the one fan-out of the kernels (`decode_batch`);
//! prefill attention (`causal_attention`) reads each KV head's context in place when it is one
//! run, else gathered into one slice per head.

use std::borrow::Cow;
use std::sync::Arc;

use duet_common::kernels::attention::{causal_attention, AttnShape, KvHead, KV_PADDING};
use duet_common::kernels::decode_batch::{decode_batch, DecodeQuery};
use duet_common::kernels::dot::vec_dot_type;
use duet_common::kernels::matmul::{matmul, matmul_many, QMatrix, QuantizedActs};
use duet_common::kernels::ops::{llama3_freq_factors, rms_norm, silu_mul, Rope};
use duet_common::kernels::quant::{dequantize, GgmlType};
use duet_common::model::config::{LlamaConfig, RopeScaling};
use duet_common::model::gguf::GgufFile;
use duet_common::model::names::TensorName;
use duet_common::rpc::pb;
use half::f16;
use rayon::prelude::*;

use super::{Device, DecodeItem, KvAccessError, KvSink, KvSource, Partial, PrefillItem, Qkv};
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

/// The CPU device: the model's weights, borrowed from the memory-mapped file.
pub struct CpuDevice {
    file: Arc<GgufFile>,
    pub config: LlamaConfig,
    token_embd: Weight,
    output: Weight,
    output_norm: Vec<f32>,
    layers: Vec<Layer>,
    rope: Rope,
}

impl std::fmt::Debug for CpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuDevice").field("config", &self.config).finish_non_exhaustive()
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

impl CpuDevice {
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
        Ok(CpuDevice { config, token_embd, output, output_norm, layers, rope, file })
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

    fn attn_shape(&self) -> AttnShape {
        super::attn_shape(&self.config)
    }
}

/// The longest prompt slice of one forward pass on the CPU device.
pub const PREFILL_CHUNK: usize = 512;

/// A batch on its way through the CPU device's layers: the hidden rows, a scratch of their
/// size, the rows' RoPE tables and the rows whose logits are wanted.
pub struct CpuBatch {
    x: Vec<f32>,
    xn: Vec<f32>,
    tables: Vec<Vec<(f32, f32)>>,
    logit_rows: Vec<usize>,
}

impl Device for CpuDevice {
    type Batch = CpuBatch;

    fn kind(&self) -> pb::DeviceKind {
        pb::DeviceKind::Cpu
    }

    fn describe(&self) -> String {
        format!("cpu ({:?})", duet_common::kernels::isa()).to_lowercase()
    }

    fn config(&self) -> &LlamaConfig {
        &self.config
    }

    fn prefill_chunk(&self) -> usize {
        PREFILL_CHUNK
    }

    fn start_batch(&self, tokens: &[u32], positions: &[usize], logit_rows: &[usize]) -> Result<CpuBatch> {
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
        Ok(CpuBatch { x, xn: vec![0f32; n * d], tables, logit_rows: logit_rows.to_vec() })
    }

    fn qkv(&self, l: usize, b: &mut CpuBatch) -> Result<Qkv> {
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
        Ok(Qkv { q, k, v })
    }

    fn store_kv(&self, layer: usize, qkv: &Qkv, kv: &mut dyn KvSink) -> Result<()> {
        let kv_dim = self.config.kv_dim();
        for (row, (k, v)) in qkv.k.chunks_exact(kv_dim).zip(qkv.v.chunks_exact(kv_dim)).enumerate() {
            kv.write(layer, row, k, v)?;
        }
        Ok(())
    }

    fn prefill_attention(&self, layer: usize, q: &[f32], items: &[PrefillItem], kv: &dyn KvSource, out: &mut [f32]) -> Result<()> {
        let shape = self.attn_shape();
        let q_dim = self.config.q_dim();
        for it in items {
            // Each KV head's context as one slice: in place when it is one run, else gathered.
            let heads = (0..shape.n_kv_head)
                .map(|h| {
                    Ok(match kv.runs(it.seq, layer, h, 0..it.start + it.n)?.as_slice() {
                        [one] => (Cow::Borrowed(one.k), Cow::Borrowed(one.v)),
                        runs => (Cow::Owned(runs.iter().map(|r| r.k).collect::<Vec<_>>().concat()), Cow::Owned(runs.iter().map(|r| r.v).collect::<Vec<_>>().concat())),
                    })
                })
                .collect::<Result<Vec<(Cow<'_, [f16]>, Cow<'_, [f16]>)>, KvAccessError>>()?;
            let views: Vec<KvHead<'_>> = heads.iter().map(|(k, v)| KvHead { k, v }).collect();
            let rows = it.row0 * q_dim..(it.row0 + it.n) * q_dim;
            causal_attention(&q[rows.clone()], &views, shape, it.start, &mut out[rows]);
        }
        Ok(())
    }

    fn decode_attention(&self, layer: usize, q: &[f32], items: &[DecodeItem], kv: &dyn KvSource) -> Result<Vec<Partial>> {
        let q_dim = self.config.q_dim();
        let queries: Vec<DecodeQuery<'_>> =
            items.iter().map(|it| DecodeQuery { q: &q[it.row * q_dim..(it.row + 1) * q_dim], range: it.range.clone(), n_ctx: it.n_ctx }).collect();
        let rows = |i: usize, h: usize, chunk| kv.runs(items[i].seq, layer, h, chunk);
        Ok(decode_batch::<KvAccessError>(&queries, self.attn_shape(), KV_PADDING, 0, rows)?)
    }

    fn finish_layer(&self, l: usize, b: &mut CpuBatch, attn: &[f32]) -> Result<()> {
        let c = &self.config;
        let layer = &self.layers[l];
        let o = self.linear(&layer.wo, attn);
        add(&mut b.x, &o);
        norm_rows(&b.x, &layer.ffn_norm, c.rms_eps, &mut b.xn);
        let [mut g, u] = self.linear_many([&layer.gate, &layer.up], &b.xn);
        g.par_chunks_mut(c.n_ff).zip(u.par_chunks(c.n_ff)).for_each(|(g, u)| silu_mul(g, u));
        let down = self.linear(&layer.down, &g);
        add(&mut b.x, &down);
        Ok(())
    }

    fn logits(&self, b: &CpuBatch) -> Result<Vec<f32>> {
        let d = self.config.n_embd;
        let picked: Vec<f32> = b.logit_rows.iter().flat_map(|&r| b.x[r * d..(r + 1) * d].iter().copied()).collect();
        let mut normed = vec![0f32; picked.len()];
        norm_rows(&picked, &self.output_norm, self.config.rms_eps, &mut normed);
        Ok(self.linear(&self.output, &normed))
    }
}

fn norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    out.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(|(o, x)| rms_norm(x, w, eps, o));
}

fn add(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}
