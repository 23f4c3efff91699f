//! Grouped-query causal attention over an f16 KV cache, computed as llama.cpp's CPU path does
//! (non-flash): Q rounded to f16 and dotted with K in ggml's lane order, softmax with ggml's
//! `exp` over the KV length padded to 32, weights rounded to f16 and dotted with V.

use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::ggml_exact::{dot_f16, reduce16, reduce64, softmax_in_place};
use super::{isa, Isa};

/// llama.cpp (without flash attention) pads the attended KV length to a multiple of this,
/// which decides which positions the V dot product sums in its SIMD lanes.
pub const KV_PADDING: usize = 32;

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
    let n_padded = n_ctx.div_ceil(KV_PADDING) * KV_PADDING;
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
    let use_fma = isa() == Isa::Avx2;
    out.par_chunks_mut(hd).enumerate().for_each(|(i, o)| {
        let (t, head) = (i / n_head, i % n_head);
        let (k, v) = &widened[head / group];
        let q_row = &q[i * hd..(i + 1) * hd];
        let job = Job { q: q_row, k, v, n: pos0 + t + 1, n_padded, hd, scale, tiled: n_tok >= 2 };
        #[cfg(target_arch = "x86_64")]
        if use_fma {
            // SAFETY: AVX2 and FMA were detected by `isa()`.
            return unsafe { attend_fma(&job, o) };
        }
        let _ = use_fma;
        attend(&job, o);
    });
}

/// One query head against positions `0..n` of one KV head.
struct Job<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    n: usize,
    n_padded: usize,
    hd: usize,
    scale: f32,
    /// llama.cpp multiplies batches of two or more tokens with llamafile's tinyBLAS, whose
    /// lanes differ from `ggml_vec_dot_f16`'s.
    tiled: bool,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_fma(job: &Job<'_>, out: &mut [f32]) {
    attend(job, out)
}

#[inline(always)]
fn attend(job: &Job<'_>, out: &mut [f32]) {
    let Job { q, k, v, n, n_padded, hd, scale, tiled } = *job;
    // Plain loops, no closures: closures would not inherit the caller's FMA target feature.
    let mut q16 = vec![0f32; hd];
    for (d, &x) in q16.iter_mut().zip(q) {
        *d = f16::from_f32(x).to_f32();
    }
    let mut w = vec![0f32; n];
    for (p, s) in w.iter_mut().enumerate() {
        let key = &k[p * hd..(p + 1) * hd];
        // tinyBLAS needs the inner length to be a multiple of 16; otherwise llama.cpp falls
        // back to `ggml_vec_dot_f16` for Q·K (V·weights runs over the KV length, padded to 32).
        *s = if tiled && hd % 16 == 0 { dot_tiled(&q16, key) } else { dot_f16(&q16, key) } * scale;
    }
    softmax_in_place(&mut w);
    for x in w.iter_mut() {
        *x = f16::from_f32(*x).to_f32();
    }
    if tiled {
        let mut lanes = vec![0f32; 16 * hd];
        for p in 0..n {
            let lane = &mut lanes[(p % 16) * hd..(p % 16 + 1) * hd];
            for (acc, &vv) in lane.iter_mut().zip(&v[p * hd..(p + 1) * hd]) {
                *acc = vv.mul_add(w[p], *acc);
            }
        }
        for (d, o) in out.iter_mut().enumerate() {
            let mut acc = [0f32; 16];
            for (l, a) in acc.iter_mut().enumerate() {
                *a = lanes[l * hd + d];
            }
            *o = reduce16(&acc);
        }
        return;
    }
    // V · weights per output dimension, in ggml's lanes: position p adds into lane p % 64
    // for p below the last multiple of 64 of the padded length, the rest in f64 afterwards.
    let simd_end = (n_padded & !63).min(n);
    let mut lanes = vec![0f32; 64 * hd];
    for p in 0..simd_end {
        let lane = &mut lanes[(p % 64) * hd..(p % 64 + 1) * hd];
        for (acc, &vv) in lane.iter_mut().zip(&v[p * hd..(p + 1) * hd]) {
            *acc = vv.mul_add(w[p], *acc);
        }
    }
    for (d, o) in out.iter_mut().enumerate() {
        let mut sum = if simd_end > 0 {
            let mut acc = [0f32; 64];
            for (l, a) in acc.iter_mut().enumerate() {
                *a = lanes[l * hd + d];
            }
            reduce64(&acc) as f64
        } else {
            0.0
        };
        for p in simd_end..n {
            sum += (v[p * hd + d] * w[p]) as f64;
        }
        *o = sum as f32;
    }
}

/// tinyBLAS's dot product: 16 lanes of fused multiply-adds in order, then `reduce16`.
#[inline(always)]
fn dot_tiled(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    for (cx, cy) in x.chunks_exact(16).zip(y.chunks_exact(16)) {
        for l in 0..16 {
            acc[l] = cx[l].mul_add(cy[l], acc[l]);
        }
    }
    reduce16(&acc)
}
