//! K/V stores and attention on the host with the CPU kernels, over KV the caller hands in: the CPU
//! device's whole attention, and the CUDA device's own share until its attention kernels run
//! on the GPU (stage A of the CUDA device: Q/K/V come to the host each layer anyway).

use std::borrow::Cow;

use duet_common::kernels::attention::{causal_attention, KvHead, KV_PADDING};
use duet_common::kernels::decode_batch::{decode_batch, DecodeQuery};
use duet_common::model::config::LlamaConfig;
use half::f16;

use super::{attn_shape, DecodeItem, KvAccessError, KvSink, KvSource, Partial, PrefillItem, Qkv};
use crate::error::Result;

/// Stores a batch's new K/V rows (from the host's `qkv`) where `kv` says, row by row.
pub fn store(config: &LlamaConfig, layer: usize, qkv: &Qkv, kv: &mut dyn KvSink) -> Result<()> {
    let kv_dim = config.kv_dim();
    for (row, (k, v)) in qkv.k.chunks_exact(kv_dim).zip(qkv.v.chunks_exact(kv_dim)).enumerate() {
        kv.write(layer, row, k, v)?;
    }
    Ok(())
}

/// Prefill attention of `items` (rows of `q`, `[row][n_head][head_dim]`) over their causal
/// prefixes in `kv`, into their rows of `out`. Each KV head's context is one slice: in place
/// when it is one run, else gathered.
pub fn prefill(config: &LlamaConfig, layer: usize, q: &[f32], items: &[PrefillItem], kv: &dyn KvSource, out: &mut [f32]) -> Result<()> {
    let shape = attn_shape(config);
    let q_dim = config.q_dim();
    for it in items {
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

/// Decode attention of `items`, one row of `q` each, over their ranges in `kv`: outputs and
/// per-head log-sum-exps, through the kernels' one decode fan-out.
pub fn decode(config: &LlamaConfig, layer: usize, q: &[f32], items: &[DecodeItem], kv: &dyn KvSource) -> Result<Vec<Partial>> {
    let q_dim = config.q_dim();
    let queries: Vec<DecodeQuery<'_>> =
        items.iter().map(|it| DecodeQuery { q: &q[it.row * q_dim..(it.row + 1) * q_dim], range: it.range.clone(), n_ctx: it.n_ctx }).collect();
    let rows = |i: usize, h: usize, chunk| kv.runs(items[i].seq, layer, h, chunk);
    Ok(decode_batch::<KvAccessError>(&queries, attn_shape(config), KV_PADDING, 0, rows)?)
}
