//! K/V stores and attention on the host with the CPU kernels, over KV the caller hands in: the CPU
//! device's whole attention, and the CUDA device's own share until its attention kernels run
//! on the GPU (stage A of the CUDA device: Q/K/V come to the host each layer anyway).

use duet_kernels::attention::{windowed, KvHead, KvRows, KvRowsBuf, KvRun, KV_PADDING};
use duet_kernels::causal::causal_attention_windowed;
use duet_kernels::decode_batch::{decode_batch, DecodeQuery};
use duet_model::config::LlamaConfig;

use super::{attn_shape, DecodeItem, KvAccessError, KvSink, KvSource, Partial, PrefillItem};
use crate::error::Result;

/// Stores a batch's new K/V rows of `layer` (`k` and `v` on the host, `[row][kv_dim]`) where
/// `kv` says, row by row.
pub fn store(config: &LlamaConfig, layer: usize, k: &[f32], v: &[f32], kv: &mut dyn KvSink) -> Result<()> {
    Ok(kv.write_rows(layer, config.kv_dim(), k, v)?)
}

/// Prefill attention of `items` (rows of `q`, `[row][n_head][head_dim]`) over their causal
/// prefixes in `kv` (within the layer's sliding window, if it has one), into their rows of
/// `out`. Each KV head's context is one slice: in place when it is one run, else gathered.
pub fn prefill(config: &LlamaConfig, layer: usize, q: &[f32], items: &[PrefillItem], kv: &dyn KvSource, out: &mut [f32]) -> Result<()> {
    let shape = attn_shape(config);
    let q_dim = config.q_dim();
    for it in items {
        let heads = (0..shape.n_kv_head)
            .map(|h| {
                Ok(match kv.runs(it.seq, layer, h, 0..it.start + it.n)?.as_slice() {
                    [one] => Heads::Borrowed(*one),
                    runs => {
                        let gather = |rows: Vec<KvRows<'_>>| KvRowsBuf::concat(&rows).ok_or(KvAccessError::MixedRowTypes);
                        Heads::Gathered(gather(runs.iter().map(|r| r.k).collect())?, gather(runs.iter().map(|r| r.v).collect())?)
                    }
                })
            })
            .collect::<Result<Vec<Heads<'_>>, KvAccessError>>()?;
        let views: Vec<KvHead<'_>> = heads
            .iter()
            .map(|h| match h {
                Heads::Borrowed(run) => KvHead { k: run.k, v: run.v },
                Heads::Gathered(k, v) => KvHead { k: k.rows(), v: v.rows() },
            })
            .collect();
        let rows = it.row0 * q_dim..(it.row0 + it.n) * q_dim;
        causal_attention_windowed(&q[rows.clone()], &views, shape, it.start, config.window(layer), &mut out[rows]);
    }
    Ok(())
}

/// One KV head's context for a prompt: in place when it is one run, else gathered.
enum Heads<'a> {
    Borrowed(KvRun<'a>),
    Gathered(KvRowsBuf, KvRowsBuf),
}

/// Decode attention of `items`, one row of `q` each, over their ranges in `kv` (the part
/// within the layer's sliding window, if it has one): outputs and per-head log-sum-exps,
/// through the kernels' one decode fan-out. A range wholly outside the window gives zeros
/// and log-sum-exps of minus infinity, which merges as nothing.
///
/// Always spread over the pool, however few the positions: the pool's other thread then
/// stays awake for the output projection that follows. Measured on the 2-core VM, batch 1,
/// serial below 8 192 (position, KV head) pairs against always parallel, alternating runs
/// in the same phase (the step log's medians): the OLMoE shape at depths 1–128 attended in
/// 550–610 µs a step against 640–680 and its steps took ~0.35 ms less; the 1B shape at
/// depths 1–256 in 357–394 µs against 469–588, its steps the same within noise.
pub fn decode(config: &LlamaConfig, layer: usize, q: &[f32], items: &[DecodeItem], kv: &dyn KvSource) -> Result<Vec<Partial>> {
    let q_dim = config.q_dim();
    let window = config.window(layer);
    let ranges: Vec<_> = items.iter().map(|it| windowed(it.range.clone(), it.n_ctx, window)).collect();
    let live: Vec<usize> = (0..items.len()).filter(|&i| !ranges[i].is_empty()).collect();
    let queries: Vec<DecodeQuery<'_>> = live
        .iter()
        .map(|&i| DecodeQuery { q: &q[items[i].row * q_dim..(items[i].row + 1) * q_dim], range: ranges[i].clone(), n_ctx: items[i].n_ctx })
        .collect();
    let rows = |j: usize, h: usize, chunk| kv.runs(items[live[j]].seq, layer, h, chunk);
    let mut done = decode_batch::<KvAccessError>(&queries, attn_shape(config), KV_PADDING, 0, rows)?.into_iter();
    Ok(ranges
        .iter()
        .map(|r| match r.is_empty() {
            true => (vec![0.0; q_dim], vec![f32::NEG_INFINITY; config.n_head]),
            false => done.next().expect("one result per live item"),
        })
        .collect())
}
