//! Grouped-query causal attention over an f16 KV cache, with llama.cpp's rounding: the query
//! is rounded to f16 before Q·K (ggml converts it to K's type) and the softmax weights are
//! rounded to f16 before they multiply V.

use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::ops::softmax;

/// One KV head's cache: keys and values as `[position][head_dim]`, f16.
#[derive(Debug, Clone, Copy)]
pub struct KvHead<'a> {
    pub k: &'a [f16],
    pub v: &'a [f16],
}

/// Shape of an attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
}

/// Attention of `n_tok` query tokens at positions `pos0..pos0 + n_tok` over the cache, each
/// token seeing positions `0..=its own` (causal). `q` and `out` are `[token][head][head_dim]`;
/// `kv[h]` must hold at least `pos0 + n_tok` positions already written.
pub fn causal_attention(q: &[f32], kv: &[KvHead<'_>], shape: AttnShape, pos0: usize, out: &mut [f32]) {
    let AttnShape { n_head, n_kv_head, head_dim: hd } = shape;
    let n_tok = q.len() / (n_head * hd);
    let n_ctx = pos0 + n_tok;
    assert_eq!(kv.len(), n_kv_head, "one KvHead per KV head");
    assert_eq!(out.len(), q.len(), "attention output size");
    let group = n_head / n_kv_head;
    let scale = 1.0 / (hd as f32).sqrt();
    // Widen each KV head once for all query tokens.
    let widened: Vec<(Vec<f32>, Vec<f32>)> = kv
        .par_iter()
        .map(|h| {
            let (mut k, mut v) = (vec![0f32; n_ctx * hd], vec![0f32; n_ctx * hd]);
            h.k[..n_ctx * hd].convert_to_f32_slice(&mut k);
            h.v[..n_ctx * hd].convert_to_f32_slice(&mut v);
            (k, v)
        })
        .collect();
    out.par_chunks_mut(hd).enumerate().for_each(|(i, o)| {
        let (t, head) = (i / n_head, i % n_head);
        let (k, v) = &widened[head / group];
        let qh: Vec<f32> = q[i * hd..(i + 1) * hd].iter().map(|&x| f16::from_f32(x).to_f32()).collect();
        let n = pos0 + t + 1;
        let mut scores: Vec<f32> = (0..n).map(|p| dot_f32(&qh, &k[p * hd..(p + 1) * hd]) * scale).collect();
        softmax(&mut scores);
        o.fill(0.0);
        for (p, &w) in scores.iter().enumerate() {
            let w = f16::from_f32(w).to_f32();
            for (o, &vv) in o.iter_mut().zip(&v[p * hd..(p + 1) * hd]) {
                *o += w * vv;
            }
        }
    });
}

/// f32 dot product with eight independent accumulators (vectorises).
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}
