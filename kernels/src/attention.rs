//! Attention's shapes and its scalar twins: one query head over a range of one KV head's
//! positions, computed as llama.cpp's CPU path does (non-flash): Q rounded to f16 and dotted
//! with K in ggml's lane order, softmax with ggml's `exp` over the KV length padded to 32,
//! weights rounded to f16 and dotted with V ([`decode_attention_range`]), or in one pass with
//! an online softmax ([`decode_attention_online`], each chunk of a context longer than
//! `decode_batch::DECODE_CHUNK`). The whole-sequence entry points are in `causal`, the
//! decode fan-out in `decode_batch`, the AVX-512 group kernels in `attention_avx512`.

use std::ops::Range;

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::ggml_exact::{dot_f16, dot_tiled, expf, reduce16, reduce64, softmax_in_place};
use super::{isa, Isa};

/// llama.cpp (without flash attention) pads the attended KV length to a multiple of this,
/// which decides which positions the V dot product sums in its SIMD lanes.
pub const KV_PADDING: usize = 32;

/// One KV head's cache: keys and values as `[position][head_dim]`.
#[derive(Debug, Clone, Copy)]
pub struct KvHead<'a> {
    pub k: KvRows<'a>,
    pub v: KvRows<'a>,
}

/// Bytes of a ggml Q8_0 block: an f16 scale and 32 signed bytes.
pub const Q8_0_BLOCK_BYTES: usize = 34;

/// Rows of cached K or V values (`[position][head_dim]`) in the cache's element type: f16, or
/// ggml Q8_0 blocks (`--kv-type q8_0`: 34 bytes per 32 values, 53 % of f16's bytes; a row is
/// `head_dim / 32` whole blocks). Q8_0 rows are attended with the one-pass arithmetic of
/// [`decode_attention_online`] over their dequantised values (`d · q`, exact in f32), as
/// llama.cpp attends a quantised cache only with flash attention.
#[derive(Debug, Clone, Copy)]
pub enum KvRows<'a> {
    F16(&'a [f16]),
    Q8_0(&'a [u8]),
}

impl<'a> KvRows<'a> {
    /// The number of values held.
    pub fn len(&self) -> usize {
        match self {
            KvRows::F16(x) => x.len(),
            KvRows::Q8_0(b) => b.len() / Q8_0_BLOCK_BYTES * 32,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The f16 values, if the rows are f16.
    pub fn f16(&self) -> Option<&'a [f16]> {
        match self {
            KvRows::F16(x) => Some(x),
            KvRows::Q8_0(_) => None,
        }
    }

    /// Values `values` as rows of the same type (Q8_0: the range covers whole blocks).
    /// Panics if the range is out of bounds or cuts a block.
    pub fn slice(&self, values: Range<usize>) -> KvRows<'a> {
        match self {
            KvRows::F16(x) => KvRows::F16(&x[values]),
            KvRows::Q8_0(b) => {
                assert!(values.start.is_multiple_of(32) && values.end.is_multiple_of(32), "Q8_0 rows cut at {values:?}");
                KvRows::Q8_0(&b[values.start / 32 * Q8_0_BLOCK_BYTES..values.end / 32 * Q8_0_BLOCK_BYTES])
            }
        }
    }

    /// The values widened to f32 into `out` (`len()` long): f16 exactly, Q8_0 as ggml
    /// dequantises it (`d · q`).
    pub fn widen_into(&self, out: &mut [f32]) {
        match self {
            KvRows::F16(x) => super::widen_f16(x, out),
            KvRows::Q8_0(b) => super::widen_q8_0(b, out),
        }
    }
}

/// Shape of an attention call, and its scores' soft-cap.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    /// Scores become `cap * tanh(score / cap)` before the softmax (Gemma 2).
    pub softcap: Option<f32>,
}

impl AttnShape {
    /// How this shape's Q·K products become softmax logits.
    pub fn scores(&self) -> Scores {
        Scores { scale: attn_scale(self.head_dim), softcap: self.softcap }
    }
}

/// How a Q·K dot product becomes a softmax logit: times `scale`, then with a soft-cap `c`
/// (Gemma 2) `tanh(s * (1/c)) * c` in f32, as ggml's scale, tanh, scale ops compute it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scores {
    pub scale: f32,
    pub softcap: Option<f32>,
}

impl Scores {
    #[inline(always)]
    fn of(self, dot: f32) -> f32 {
        let s = dot * self.scale;
        match self.softcap {
            None => s,
            Some(c) => (s * (1.0 / c)).tanh() * c,
        }
    }
}

/// A plain scale, without a soft-cap.
impl From<f32> for Scores {
    fn from(scale: f32) -> Scores {
        Scores { scale, softcap: None }
    }
}

/// The first position the token at `pos` attends: 0, or with a sliding `window` the oldest of
/// the last `window` positions (llama.cpp masks position `p0` when `pos - p0 >= window`).
pub fn window_start(pos: usize, window: Option<usize>) -> usize {
    window.map_or(0, |w| (pos + 1).saturating_sub(w))
}

/// The part of `range` (positions of a context of `n_ctx`) that the context's last token
/// sees through its sliding `window`: empty when the range lies wholly before the window.
pub fn windowed(range: Range<usize>, n_ctx: usize, window: Option<usize>) -> Range<usize> {
    range.start.max(window_start(n_ctx.saturating_sub(1), window))..range.end
}

/// Rows of several runs gathered into one buffer (a prompt's whole context over a paged cache).
#[derive(Debug, Clone)]
pub enum KvRowsBuf {
    F16(Vec<f16>),
    Q8_0(Vec<u8>),
}

impl KvRowsBuf {
    /// `parts` one after another; `None` if they are not all of one type.
    pub fn concat(parts: &[KvRows<'_>]) -> Option<Self> {
        match parts.first() {
            Some(KvRows::Q8_0(_)) => parts.iter().map(|p| match p { KvRows::Q8_0(b) => Some(*b), KvRows::F16(_) => None }).collect::<Option<Vec<_>>>().map(|b| KvRowsBuf::Q8_0(b.concat())),
            _ => parts.iter().map(|p| p.f16()).collect::<Option<Vec<_>>>().map(|x| KvRowsBuf::F16(x.concat())),
        }
    }

    pub fn rows(&self) -> KvRows<'_> {
        match self {
            KvRowsBuf::F16(x) => KvRows::F16(x),
            KvRowsBuf::Q8_0(b) => KvRows::Q8_0(b),
        }
    }
}

/// One run of consecutive positions of one KV head: `[rows][head_dim]` K and V rows.
#[derive(Debug, Clone, Copy)]
pub struct KvRun<'a> {
    pub k: KvRows<'a>,
    pub v: KvRows<'a>,
}

impl<'a> KvRun<'a> {
    /// A run of f16 rows.
    pub fn f16(k: &'a [f16], v: &'a [f16]) -> Self {
        KvRun { k: KvRows::F16(k), v: KvRows::F16(v) }
    }
}

/// The softmax scale of attention with heads of `head_dim`: `1 / sqrt(head_dim)` in f32.
pub fn attn_scale(head_dim: usize) -> f32 {
    1.0 / (head_dim as f32).sqrt()
}

/// The KV length llama.cpp attends over for a context of `n_ctx` positions: `n_ctx` rounded
/// up to a multiple of `padding` ([`KV_PADDING`]). It decides the V lanes of decode attention.
pub fn padded_len(n_ctx: usize, padding: usize) -> usize {
    n_ctx.div_ceil(padding) * padding
}

/// Single-token decode attention of one query head over positions `range` of one KV head,
/// exactly as `causal::causal_attention` computes it for one token when `range` is `0..n_ctx`:
/// `k` and `v` hold those positions only, widened to f32 (`[range.len()][head_dim]`);
/// `n_padded` is [`padded_len`] of the sequence's whole context (V lanes follow absolute
/// positions). Writes `out` (`head_dim` values) and returns the log-sum-exp of the scaled
/// scores of the range, `max + ln(sum exp(s - max))`, with which partial results over
/// disjoint ranges merge. Panics if a slice is shorter than the range needs.
pub fn decode_attention_range(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    range: Range<usize>,
    n_padded: usize,
    scores: impl Into<Scores>,
    out: &mut [f32],
) -> f32 {
    let hd = out.len();
    let n = range.end.saturating_sub(range.start);
    assert!(q.len() == hd && k.len() >= n * hd && v.len() >= n * hd, "decode attention slice sizes");
    let job = Job { q, k, v, start: range.start, end: range.end, n_padded, hd, scores: scores.into(), tiled: false };
    run(&job, out)
}

/// Single-token decode attention of one query head over `n` positions in one pass (online
/// softmax), the arithmetic of every chunk of a context longer than `DECODE_CHUNK`: `k` and
/// `v` hold those positions widened to f32 (`[n][head_dim]`). Q rounded to f16, each score
/// tinyBLAS's dot product (16 lanes of fused multiply-adds, `reduce16`) times `scale`; then,
/// per block of 16 positions: the running maximum raised to the block's (the accumulators and
/// the sum scaled by ggml's `exp` of the difference), the block's weights `exp(score - max)`
/// (f32, not rounded to f16) summed by `reduce16` into an f32 sum, and each position's V row
/// fused-multiply-added into one f32 accumulator per dimension, in position order. The output
/// is the accumulators times `1 / sum`; returns the log-sum-exp. The AVX-512 kernel
/// (`attend_group_online`) matches it bit for bit.
pub fn decode_attention_online(q: &[f32], k: &[f32], v: &[f32], n: usize, scores: impl Into<Scores>, out: &mut [f32]) -> f32 {
    let scores = scores.into();
    let hd = out.len();
    assert!(q.len() == hd && k.len() >= n * hd && v.len() >= n * hd, "decode attention slice sizes");
    #[cfg(target_arch = "x86_64")]
    if isa() >= Isa::Avx2 {
        // SAFETY: AVX2, FMA and F16C were detected by `isa()`.
        return unsafe { attend_online_fma(q, k, v, n, scores, out, HeadDot::of(hd, true)) };
    }
    attend_online(q, k, v, n, scores, out, None)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_online_fma(q: &[f32], k: &[f32], v: &[f32], n: usize, scores: Scores, out: &mut [f32], head: Option<HeadDot>) -> f32 {
    attend_online(q, k, v, n, scores, out, head)
}

/// Safety: `head`'s function (tinyBLAS's dot product here) as in [`attend`].
#[inline(always)]
fn attend_online(q: &[f32], k: &[f32], v: &[f32], n: usize, scores: Scores, out: &mut [f32], head: Option<HeadDot>) -> f32 {
    let hd = out.len();
    let mut q16 = vec![0f32; hd];
    round_to_f16(&q[..hd], &mut q16);
    let mut acc = vec![0f32; hd];
    let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
    for b in (0..n).step_by(16) {
        let len = (n - b).min(16);
        let mut s = [f32::NEG_INFINITY; 16];
        for (i, si) in s.iter_mut().enumerate().take(len) {
            // tinyBLAS's order (llama.cpp's for prompt batches): one fused multiply-add chain
            // per lane, which the AVX-512 kernel computes with fewer instructions than ggml's.
            *si = scores.of(score(&q16, &k[(b + i) * hd..(b + i + 1) * hd], true, head));
        }
        let block_max = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        if block_max > max {
            if max != f32::NEG_INFINITY {
                let c = expf(max - block_max);
                for a in acc.iter_mut() {
                    *a *= c;
                }
                sum *= c;
            }
            max = block_max;
        }
        let mut p = [0f32; 16];
        for (pi, &si) in p.iter_mut().zip(&s).take(len) {
            *pi = expf(si - max);
        }
        sum += reduce16(&p);
        let rows = &v[b * hd..(b + len) * hd];
        if let Ok(acc64) = <&mut [f32; 64]>::try_from(&mut acc[..]) {
            // Heads of 64: the accumulators as a local array the compiler keeps in registers
            // for the block (through memory, each position's multiply-adds would wait on the
            // previous position's stores).
            let mut a = *acc64;
            for (row, &pi) in rows.chunks_exact(64).zip(&p) {
                for (x, &vv) in a.iter_mut().zip(row) {
                    *x = vv.mul_add(pi, *x);
                }
            }
            *acc64 = a;
        } else {
            for (row, &pi) in rows.chunks_exact(hd).zip(&p) {
                for (x, &vv) in acc.iter_mut().zip(row) {
                    *x = vv.mul_add(pi, *x);
                }
            }
        }
    }
    let inv = 1.0 / sum;
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = a * inv;
    }
    (max as f64 + (sum as f64).ln()) as f32
}

/// One query head against positions `start..end` of one KV head (`k`, `v` from `start`).
pub(crate) struct Job<'a> {
    pub(crate) q: &'a [f32],
    pub(crate) k: &'a [f32],
    pub(crate) v: &'a [f32],
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) n_padded: usize,
    pub(crate) hd: usize,
    pub(crate) scores: Scores,
    /// llama.cpp multiplies batches of two or more tokens with llamafile's tinyBLAS, whose
    /// lanes differ from `ggml_vec_dot_f16`'s.
    pub(crate) tiled: bool,
}

/// The register dot product of a head of 64 or 128 on AVX2 (bit-identical to `dot_f16`, or
/// to `dot_tiled` in tinyBLAS's order), chosen once per call rather than per position.
#[derive(Clone, Copy)]
struct HeadDot {
    dot: unsafe fn(&[f32], &[f32]) -> f32,
}

impl HeadDot {
    /// The register dot product in `ggml_vec_dot_f16`'s order, or tinyBLAS's if `tiled`, for
    /// heads of 64 and 128. Only for callers that checked AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    fn of(hd: usize, tiled: bool) -> Option<HeadDot> {
        let dot: unsafe fn(&[f32], &[f32]) -> f32 = match (hd, tiled) {
            (64, false) => head_dot::<64, false>,
            (64, true) => head_dot::<64, true>,
            (128, false) => head_dot::<128, false>,
            (128, true) => head_dot::<128, true>,
            _ => return None,
        };
        Some(HeadDot { dot })
    }
}

/// [`HeadDot`]'s functions: `x` and `y` of `N` values each (the head's width, checked by
/// `HeadDot::of`'s caller's slices; others fall back to the plain dot products in `score`).
/// Safety: AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn head_dot<const N: usize, const TILED: bool>(x: &[f32], y: &[f32]) -> f32 {
    match (<&[f32; N]>::try_from(x), <&[f32; N]>::try_from(y)) {
        (Ok(x), Ok(y)) if TILED => super::simd_x86::dot_tiled_lanes(x, y),
        (Ok(x), Ok(y)) => super::simd_x86::dot_f16_lanes(x, y),
        _ if TILED && x.len().is_multiple_of(16) => dot_tiled(x, y),
        _ => dot_f16(x, y),
    }
}

/// One Q·K product: in tinyBLAS's order if `tiled` (which needs the length to be a multiple of
/// 16; otherwise llama.cpp falls back to `ggml_vec_dot_f16`), else in `ggml_vec_dot_f16`'s;
/// in registers where `head` (made by [`HeadDot::of`] with the same `tiled`) is given.
/// Safety: as [`attend`].
#[inline(always)]
fn score(q16: &[f32], key: &[f32], tiled: bool, head: Option<HeadDot>) -> f32 {
    if let Some(h) = head {
        // SAFETY: see `attend`.
        unsafe { (h.dot)(q16, key) }
    } else if tiled && q16.len().is_multiple_of(16) {
        dot_tiled(q16, key)
    } else {
        dot_f16(q16, key)
    }
}

/// Runs `attend` on the fastest instruction set of this machine; returns the log-sum-exp.
#[inline]
pub(crate) fn run(job: &Job<'_>, out: &mut [f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa() >= Isa::Avx2 {
        // SAFETY: AVX2, FMA and F16C were detected by `isa()`.
        return unsafe { attend_fma(job, out, HeadDot::of(job.hd, job.tiled)) };
    }
    attend(job, out, None)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_fma(job: &Job<'_>, out: &mut [f32], head: Option<HeadDot>) -> f32 {
    attend(job, out, head)
}

/// Safety: `head`'s functions need AVX2, FMA and F16C (given only when detected).
#[inline(always)]
fn attend(job: &Job<'_>, out: &mut [f32], head: Option<HeadDot>) -> f32 {
    let Job { q, k, v, start, end, n_padded, hd, scores, tiled } = *job;
    let n = end.saturating_sub(start);
    // Plain loops, no closures: closures would not inherit the caller's FMA target feature.
    let mut q16 = vec![0f32; hd];
    round_to_f16(&q[..hd], &mut q16);
    // w[i] is position start + i.
    let mut w = vec![0f32; n];
    for (i, s) in w.iter_mut().enumerate() {
        *s = scores.of(score(&q16, &k[i * hd..(i + 1) * hd], tiled, head));
    }
    let lse = softmax_in_place(&mut w);
    let probs = w.clone();
    round_to_f16(&probs, &mut w);
    if tiled {
        let mut lanes = vec![0f32; 16 * hd];
        for p in start..end {
            let i = p - start;
            let lane = &mut lanes[(p % 16) * hd..(p % 16 + 1) * hd];
            for (acc, &vv) in lane.iter_mut().zip(&v[i * hd..(i + 1) * hd]) {
                *acc = vv.mul_add(w[i], *acc);
            }
        }
        for (d, o) in out.iter_mut().enumerate() {
            let mut acc = [0f32; 16];
            for (l, a) in acc.iter_mut().enumerate() {
                *a = lanes[l * hd + d];
            }
            *o = reduce16(&acc);
        }
        return lse;
    }
    // V · weights per output dimension, in ggml's lanes: position p adds into lane p % 64
    // for p below the last multiple of 64 of the padded length, the rest in f64 afterwards.
    let simd_end = (n_padded & !63).min(end).max(start);
    let mut lanes = if simd_end > start { vec![0f32; 64 * hd] } else { Vec::new() };
    for p in start..simd_end {
        let i = p - start;
        let lane = &mut lanes[(p % 64) * hd..(p % 64 + 1) * hd];
        for (acc, &vv) in lane.iter_mut().zip(&v[i * hd..(i + 1) * hd]) {
            *acc = vv.mul_add(w[i], *acc);
        }
    }
    // Per dimension: the lanes' sum, then the remaining positions in order, in f64. The
    // position loop is outside so that the dimensions' independent sums vectorise.
    let mut sums = vec![0f64; hd];
    if simd_end > start {
        for (d, sum) in sums.iter_mut().enumerate() {
            let mut acc = [0f32; 64];
            for (l, a) in acc.iter_mut().enumerate() {
                *a = lanes[l * hd + d];
            }
            *sum = reduce64(&acc) as f64;
        }
    }
    for p in simd_end..end {
        let i = p - start;
        let wi = w[i];
        for (sum, &vv) in sums.iter_mut().zip(&v[i * hd..(i + 1) * hd]) {
            *sum += (vv * wi) as f64;
        }
    }
    for (o, sum) in out.iter_mut().zip(&sums) {
        *o = *sum as f32;
    }
    lse
}

/// `out[i] = x[i]` rounded to f16 (to nearest, ties to even) and widened back, eight at a
/// time with F16C where present (the same rounding as one at a time).
fn round_to_f16(x: &[f32], out: &mut [f32]) {
    let mut buf = vec![f16::ZERO; x.len()];
    buf.convert_from_f32_slice(x);
    buf.convert_to_f32_slice(out);
}


#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sliding_window_keeps_the_last_positions_up_to_the_token() {
        assert_eq!(window_start(10, None), 0);
        assert_eq!(window_start(10, Some(4)), 7, "positions 7..=10: pos - p0 < 4");
        assert_eq!(window_start(2, Some(4)), 0);
        assert_eq!(windowed(0..20, 20, Some(8)), 12..20);
        assert_eq!(windowed(16..20, 20, Some(8)), 16..20);
        assert!(windowed(0..10, 20, Some(8)).is_empty(), "a share wholly before the window");
        assert_eq!(windowed(0..10, 20, None), 0..10);
    }
}
