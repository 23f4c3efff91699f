//! AVX-512 decode attention of one KV head's whole query group, straight from f16 (or, in the
//! one-pass kernel, Q8_0) K/V rows of 64 or 128 dimensions (`NV`, the row's 16-lane vectors, is 4 or 8):
//! bit for bit [`decode_attention_range`](super::attention::decode_attention_range) run once
//! per query head over widened rows, in one pass over K and one over V; and, for the chunks
//! of contexts longer than one `DECODE_CHUNK`, bit for bit
//! [`decode_attention_online`](super::attention::decode_attention_online), in a single pass.
//!
//! What makes it fast while keeping ggml's exact arithmetic:
//! * each K and V row is loaded and widened once for every query head of the group (GQA);
//! * Q·K keeps `ggml_vec_dot_f16`'s 64 products and its `reduce64` tree, but the last
//!   16-lane step (`_mm512_reduce_add_ps`) is done for 16 positions at once by a transposed
//!   butterfly (the same pairings, so the same sums), and the tree's first two additions are
//!   fused into the products (a product of two f16 values is exact in f32);
//! * the softmax runs `ggml_v_expf` sixteen lanes at a time, as ggml does;
//! * V·weights accumulate into ggml's 64 position lanes for all heads of the group at once,
//!   64 dimensions at a time (each dimension's sum is its own: a head of 128 is two of 64,
//!   summed in one pass over its rows for groups of one or two heads, else a pass per half;
//!   `values`).

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

pub use super::attention_rows::{supports_head_dim, MAX_GROUP};
use super::attention::{KvRows, KvRun, Q8_0_BLOCK_BYTES};
use super::attention_rows::{by_group, checked_group, RowTable};

mod values;
use values::{tiled_value_pass, value_pass};

/// Reusable buffers of the kernel (scores, and the V lanes of every head of the group).
#[derive(Debug, Default)]
pub struct FastScratch {
    scores: Vec<f32>,
    lanes: Vec<f32>,
    rows: RowTable,
}

// SAFETY: `rows` only holds pointers into the K/V slices of one call; they are rewritten
// before every use and never read after the call returns.
unsafe impl Send for FastScratch {}

/// The group's attention over positions `start..end`, given as `runs` in position order (their
/// rows add up to `end - start`); `q`/`out` are `[group][head_dim]` (heads of 64 or 128),
/// `lse` one per head; `n_padded`
/// and `scale` as in `decode_attention_range`. `tiled` selects the arithmetic llama.cpp uses
/// for a batch of query tokens (tinyBLAS: Q·K as one fused multiply-add chain per lane of
/// 16, V·weights in 16 position lanes summed in f32) instead of the decode one.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/DQ, AVX2, FMA and F16C. Panics (safely) if the slices
/// disagree, the heads are not of 64 or 128, or the group is larger than [`MAX_GROUP`].
#[allow(clippy::too_many_arguments)] // the runs, the range and the group's three slices
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub unsafe fn attend_group(
    runs: &[KvRun<'_>],
    start: usize,
    end: usize,
    n_padded: usize,
    scale: f32,
    tiled: bool,
    q: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
    scratch: &mut FastScratch,
) {
    let (group, hd) = checked_group(runs, end - start, q, out, lse);
    macro_rules! by_shape {
        ($nv:literal, $t:literal) => {
            by_group!(group, group_kernel::<$nv, $t>(runs, start, end, n_padded, scale, q, out, lse, scratch))
        };
    }
    match (hd, tiled) {
        (64, true) => by_shape!(4, true),
        (64, false) => by_shape!(4, false),
        (_, true) => by_shape!(8, true),
        (_, false) => by_shape!(8, false),
    }
}

#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn group_kernel<const G: usize, const NV: usize, const TILED: bool>(
    runs: &[KvRun<'_>],
    start: usize,
    end: usize,
    n_padded: usize,
    scale: f32,
    q: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
    scratch: &mut FastScratch,
) {
    let n = end - start;
    let stride = n.next_multiple_of(16);
    scratch.scores.resize(G * stride, 0.0);
    let scores = scratch.scores.as_mut_ptr();
    let qv = rounded_q::<G, NV>(q);
    scratch.rows.fill(runs, 16 * NV, false);
    let max = scores_pass::<G, NV, TILED>(&scratch.rows, n, stride, scale, &qv, scores);
    for (g, l) in lse.iter_mut().enumerate() {
        *l = softmax_f16(std::slice::from_raw_parts_mut(scores.add(g * stride), n), max[g]);
    }
    // A group of one or two heads of 128 takes its rows whole in one V pass, each half of a
    // head's dimensions a head of 64 of its own (the same sums as a pass per half).
    if NV == 8 && !TILED && G <= 2 {
        match G {
            1 => value_pass::<2, 2>(start, end, n_padded, stride, scores, out, scratch),
            _ => value_pass::<4, 2>(start, end, n_padded, stride, scores, out, scratch),
        }
        return;
    }
    // Otherwise the V passes take 64 dimensions of every head at a time: the rows' halves in
    // turn.
    let mut half = [0f32; MAX_GROUP * 64];
    for h in 0..NV / 4 {
        scratch.rows.v_off = 64 * h;
        let half_out = &mut half[..G * 64];
        if TILED {
            tiled_value_pass::<G>(start, end, stride, scores, half_out, scratch);
        } else {
            value_pass::<G, 1>(start, end, n_padded, stride, scores, half_out, scratch);
        }
        for (o, x) in out.chunks_exact_mut(16 * NV).zip(half_out.chunks_exact(64)) {
            o[64 * h..64 * (h + 1)].copy_from_slice(x);
        }
    }
    scratch.rows.v_off = 0;
}

/// The group's queries rounded to f16 (ggml converts Q for the f16 dot product), widened.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn rounded_q<const G: usize, const NV: usize>(q: &[f32]) -> [[__m512; NV]; G] {
    let mut qv = [[_mm512_setzero_ps(); NV]; G];
    for (g, qg) in qv.iter_mut().enumerate() {
        for (j, v) in qg.iter_mut().enumerate() {
            let x = _mm512_loadu_ps(q.as_ptr().add(g * 16 * NV + 16 * j));
            *v = _mm512_cvtph_ps(_mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x));
        }
    }
    qv
}

/// One-pass decode attention of a KV head's query group over the `n` positions of `runs`
/// (rows in position order): bit for bit
/// [`decode_attention_online`](super::attention::decode_attention_online) run once per query
/// head. K and V stream together, a block of 16 positions at a time (the block's scores and
/// online softmax step, then the block before's V rows, software-pipelined), so the reads of
/// the two overlap the arithmetic of both; `q`/`out` are `[group][head_dim]` (heads of 64 or
/// 128), `lse` one per head. The runs are all f16 or all Q8_0 (the Q8_0 rows dequantised as
/// they are loaded, so bit for bit the twin over `widen_q8_0`'s values).
///
/// # Safety
/// As [`attend_group`]; panics (safely) under the same conditions, and on runs of mixed types.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub unsafe fn attend_group_online(runs: &[KvRun<'_>], n: usize, scale: f32, q: &[f32], out: &mut [f32], lse: &mut [f32], scratch: &mut FastScratch) {
    let (group, hd) = checked_group(runs, n, q, out, lse);
    let q8 = matches!(runs[0].k, KvRows::Q8_0(_));
    scratch.rows.fill(runs, hd, q8);
    let rows = &scratch.rows;
    macro_rules! by_shape {
        ($nv:literal, $q8:literal) => {
            by_group!(group, online_kernel::<$nv, $q8>(rows, n, scale, q, out, lse))
        };
    }
    match (hd, q8) {
        (64, false) => by_shape!(4, false),
        (64, true) => by_shape!(4, true),
        (_, false) => by_shape!(8, false),
        (_, true) => by_shape!(8, true),
    }
}

/// [`attend_group_online`] for a group of `G` heads of `16 * NV`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn online_kernel<const G: usize, const NV: usize, const Q8: bool>(rows: &RowTable, n: usize, scale: f32, q: &[f32], out: &mut [f32], lse: &mut [f32]) {
    // Q and the accumulators are each in registers in their phase of a block only (both at
    // once do not fit for a group of three): `black_box` makes the compiler reload them per
    // block rather than spill them for the whole loop and reload one per multiply-add.
    let q_mem = rounded_q::<G, NV>(q);
    let vscale = _mm512_set1_ps(scale);
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut max = [f32::NEG_INFINITY; G];
    let mut sum = [0f32; G];
    let mut acc = [[_mm512_setzero_ps(); NV]; G];
    // The block whose V rows are still to be accumulated (start, length) and its weights,
    // stored a block before they are read (broadcast from memory: no shuffle per position).
    let mut pending: Option<(usize, usize)> = None;
    let mut weights = [[0f32; 16]; G];
    for b in (0..n).step_by(16) {
        let qv = *std::hint::black_box(&q_mem);
        let len = (n - b).min(16);
        let keep = if len == 16 { 0xFFFF } else { ((1u32 << len) - 1) as __mmask16 };
        // The block's scores in tinyBLAS's order (no V prefetch: V is read right after).
        let quads = if len == 16 {
            block_quads::<G, NV, true, false, Q8>(rows, b, n, usize::MAX, &qv)
        } else {
            block_quads::<G, NV, true, true, Q8>(rows, b, n, usize::MAX, &qv)
        };
        // The online softmax step of each head: the block's weights `p[g]`, and the factor
        // that rescales what is accumulated so far if the block raised the maximum.
        let mut p = [_mm512_setzero_ps(); G];
        let mut rescale = [None; G];
        for g in 0..G {
            let s = _mm512_mask_mul_ps(ninf, keep, finish16(&quads[g]), vscale);
            let block_max = _mm512_reduce_max_ps(s);
            if block_max > max[g] {
                if max[g] != f32::NEG_INFINITY {
                    rescale[g] = Some(_mm512_cvtss_f32(expf16(_mm512_set1_ps(max[g] - block_max))));
                }
                max[g] = block_max;
            }
            p[g] = _mm512_maskz_mov_ps(keep, expf16(_mm512_sub_ps(s, _mm512_set1_ps(max[g]))));
        }
        // The V rows of the block before (software pipelining: its weights have long been
        // ready, while this block's still wait on its maximum and exp), then the rescale.
        if let Some((pb, plen)) = pending {
            accumulate_block::<G, NV, Q8>(rows, pb, plen, n, &weights, &mut acc);
        }
        for g in 0..G {
            if let Some(c) = rescale[g] {
                let vc = _mm512_set1_ps(c);
                for a in acc[g].iter_mut() {
                    *a = _mm512_mul_ps(*a, vc);
                }
                sum[g] *= c;
            }
            sum[g] += reduce16(p[g]);
            _mm512_storeu_ps(weights[g].as_mut_ptr(), p[g]);
        }
        pending = Some((b, len));
    }
    if let Some((pb, plen)) = pending {
        accumulate_block::<G, NV, Q8>(rows, pb, plen, n, &weights, &mut acc);
    }
    for (g, o) in out.chunks_exact_mut(16 * NV).enumerate() {
        let inv = _mm512_set1_ps(1.0 / sum[g]);
        for (j, a) in acc[g].iter().enumerate() {
            _mm512_storeu_ps(o.as_mut_ptr().add(16 * j), _mm512_mul_ps(*a, inv));
        }
        lse[g] = (max[g] as f64 + (sum[g] as f64).ln()) as f32;
    }
}

/// The V rows of positions `b..b + len` times their weights (`p[g][i]` for position `b + i`)
/// into the accumulators, in position order, held in registers for the block.
#[inline(always)]
unsafe fn accumulate_block<const G: usize, const NV: usize, const Q8: bool>(rows: &RowTable, b: usize, len: usize, n: usize, p: &[[f32; 16]; G], acc: &mut [[__m512; NV]; G]) {
    let mut a = *std::hint::black_box(&*acc);
    for i in 0..len {
        if b + i + V_AHEAD < n {
            prefetch_row::<_MM_HINT_T0, NV, Q8>(rows.v(b + i + V_AHEAD));
        }
        let vx = load_row::<NV, Q8>(rows.v(b + i));
        for (a_g, p_g) in a.iter_mut().zip(p) {
            let w = _mm512_set1_ps(p_g[i]);
            for (x, &vj) in a_g.iter_mut().zip(&vx) {
                *x = _mm512_fmadd_ps(vj, w, *x);
            }
        }
    }
    *acc = a;
}

/// V rows are prefetched this many positions ahead in the one-pass kernel.
const V_AHEAD: usize = 32;

/// Scaled Q·K scores of every head for the `n` positions, into `scores[g * stride + i]`;
/// returns each head's largest score (the softmax's maximum, taken here rather than in a
/// pass of its own). Prefetches K a few rows ahead, and into L2 the V rows of the value
/// pass's first window during the last [`WINDOW`] positions.
///
/// Positions go four at a time: their partial sums are folded at once by the first two
/// steps of [`reduce16_x16`]'s butterfly ([`fold4`]), so each head keeps four vectors per 16
/// positions instead of sixteen (the loads and stores of spilled partials bounded the pass).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn scores_pass<const G: usize, const NV: usize, const TILED: bool>(rows: &RowTable, n: usize, stride: usize, scale: f32, qv: &[[__m512; NV]; G], scores: *mut f32) -> [f32; G] {
    let qv = *qv;
    let scale = _mm512_set1_ps(scale);
    let mut max = [_mm512_set1_ps(f32::NEG_INFINITY); G];
    let v_from = n.saturating_sub(WINDOW);
    for b in (0..n).step_by(16) {
        let quads = if b + 16 <= n {
            block_quads::<G, NV, TILED, false, false>(rows, b, n, v_from, &qv)
        } else {
            block_quads::<G, NV, TILED, true, false>(rows, b, n, v_from, &qv)
        };
        for (g, quad) in quads.iter().enumerate() {
            let s = _mm512_mul_ps(finish16(quad), scale);
            let at = scores.add(g * stride + b);
            if b + 16 <= n {
                max[g] = _mm512_max_ps(max[g], s);
                _mm512_storeu_ps(at, s);
            } else {
                let keep = ((1u32 << (n - b)) - 1) as __mmask16;
                max[g] = _mm512_mask_max_ps(max[g], keep, max[g], s);
                _mm512_mask_storeu_ps(at, keep, s);
            }
        }
    }
    let mut out = [0f32; G];
    for (o, m) in out.iter_mut().zip(max) {
        *o = _mm512_reduce_max_ps(m);
    }
    out
}

/// The 16 positions from `b` of every head folded by [`fold4`]: `quads[g][m]` holds positions
/// `b + 4m .. b + 4m + 4` after two butterfly steps, ready for [`finish16`]. `PARTIAL`: the
/// block may reach past `n` (those positions count as zero).
#[inline(always)]
unsafe fn block_quads<const G: usize, const NV: usize, const TILED: bool, const PARTIAL: bool, const Q8: bool>(rows: &RowTable, b: usize, n: usize, v_from: usize, qv: &[[__m512; NV]; G]) -> [[__m512; 4]; G] {
    let mut quads = [[_mm512_setzero_ps(); 4]; G];
    for m in 0..4 {
        let i = b + 4 * m;
        let h = [
            position_partials::<G, NV, TILED, PARTIAL, Q8>(rows, i, n, v_from, qv),
            position_partials::<G, NV, TILED, PARTIAL, Q8>(rows, i + 1, n, v_from, qv),
            position_partials::<G, NV, TILED, PARTIAL, Q8>(rows, i + 2, n, v_from, qv),
            position_partials::<G, NV, TILED, PARTIAL, Q8>(rows, i + 3, n, v_from, qv),
        ];
        for (g, quad) in quads.iter_mut().enumerate() {
            quad[m] = fold4(h[0][g], h[1][g], h[2][g], h[3][g]);
        }
    }
    quads
}

/// Position `i`'s 16-lane partial sums of every head (`reduce64` before its last step, or
/// tinyBLAS's fused chain), zero past the range if `PARTIAL` (those lanes are never stored);
/// issues the pass's prefetches for `i`.
#[inline(always)]
unsafe fn position_partials<const G: usize, const NV: usize, const TILED: bool, const PARTIAL: bool, const Q8: bool>(rows: &RowTable, i: usize, n: usize, v_from: usize, qv: &[[__m512; NV]; G]) -> [__m512; G] {
    let zero = _mm512_setzero_ps();
    if PARTIAL && i >= n {
        return [zero; G];
    }
    if i + K_AHEAD < n {
        prefetch_row::<_MM_HINT_T0, NV, Q8>(rows.k(i + K_AHEAD));
    }
    if i >= v_from {
        prefetch_row::<_MM_HINT_T1, NV, Q8>(rows.v(i - v_from));
    }
    let kx = load_row::<NV, Q8>(rows.k(i));
    let mut h = [zero; G];
    for (hg, q) in h.iter_mut().zip(qv) {
        *hg = if TILED {
            // tinyBLAS: one fused multiply-add chain per lane over the 16-element chunks.
            let mut acc = zero;
            for j in 0..NV {
                acc = _mm512_fmadd_ps(q[j], kx[j], acc);
            }
            acc
        } else if NV == 8 {
            // Two of ggml's steps of 64: lane l's accumulator is p[l] then fma(p[l + 64]),
            // p[l] fused onto +0; then reduce64 as below. (The sums are no longer single
            // products, so the fusing trick of heads of 64 does not apply.)
            let mut s = [zero; 4];
            for (j, sj) in s.iter_mut().enumerate() {
                *sj = _mm512_fmadd_ps(kx[j + 4], q[j + 4], _mm512_fmadd_ps(kx[j], q[j], zero));
            }
            _mm512_add_ps(_mm512_add_ps(s[0], s[2]), _mm512_add_ps(s[1], s[3]))
        } else {
            // reduce64: h[l] = (p[l] + p[l + 32]) + (p[l + 16] + p[l + 48]), each product p
            // a fused multiply-add onto +0 as ggml's accumulators take it. A product of two
            // f16 values (Q is rounded to f16) is exact in f32, so p0 + p2 is the fused
            // multiply-add of k0·q0 onto p2: the same sum in one instruction fewer.
            let p2 = _mm512_fmadd_ps(kx[2], q[2], zero);
            let p3 = _mm512_fmadd_ps(kx[3], q[3], zero);
            _mm512_add_ps(_mm512_fmadd_ps(kx[0], q[0], p2), _mm512_fmadd_ps(kx[1], q[1], p3))
        };
    }
    h
}

/// K rows are prefetched this many positions ahead (blocks need not be contiguous).
const K_AHEAD: usize = 32;

/// The cache lines of a row of `16 * NV` elements: f16 (two lines per 64), or with `Q8` Q8_0
/// blocks (34 bytes per 32, not line-aligned: every line from its first byte to its last).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn prefetch_row<const HINT: i32, const NV: usize, const Q8: bool>(row: *const u8) {
    if Q8 {
        let last = row.add(NV / 2 * Q8_0_BLOCK_BYTES - 1);
        let mut line = row;
        while line <= last {
            _mm_prefetch::<HINT>(line as *const i8);
            line = line.add(64);
        }
        _mm_prefetch::<HINT>(last as *const i8);
    } else {
        for line in 0..NV / 2 {
            _mm_prefetch::<HINT>((row as *const i8).add(64 * line));
        }
    }
}

/// A row of `16 * NV` values, widened: f16, or with `Q8` Q8_0 blocks dequantised (`d · q`,
/// exact in f32, as `widen_q8_0`).
#[inline(always)]
unsafe fn load_row<const NV: usize, const Q8: bool>(row: *const u8) -> [__m512; NV] {
    if !Q8 {
        return widen_row::<NV>(row);
    }
    let mut x = [_mm512_setzero_ps(); NV];
    for (j, xj) in x.iter_mut().enumerate() {
        let block = row.add(j / 2 * Q8_0_BLOCK_BYTES);
        let d = _mm512_cvtph_ps(_mm256_set1_epi16((block as *const i16).read_unaligned()));
        let q = _mm_loadu_si128(block.add(2 + 16 * (j % 2)) as *const __m128i);
        *xj = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
    }
    x
}


/// The first two steps of `_mm512_reduce_add_ps` (or tinyBLAS's `reduce16`, the same tree)
/// for four positions' vectors `a`–`d`: quarter `k` of the result holds position `k`'s four
/// lanes after (lo8 + hi8) then (lo4 + hi4). [`finish16`] takes four of these to the sums.
#[inline(always)]
unsafe fn fold4(a: __m512, b: __m512, c: __m512, d: __m512) -> __m512 {
    // Step 1: [a lo8 + hi8 | b lo8 + hi8], as [a0 a1 b2 b3] + [a2 a3 b0 b1] (quarters; one
    // shuffle and a blend instead of two shuffles).
    let t0 = _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, a, b), _mm512_shuffle_f32x4::<0b0100_1110>(a, b));
    let t1 = _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, c, d), _mm512_shuffle_f32x4::<0b0100_1110>(c, d));
    // Step 2: quarter k = the 4-lane lo4 + hi4 of position k.
    _mm512_add_ps(_mm512_shuffle_f32x4::<0b1000_1000>(t0, t1), _mm512_shuffle_f32x4::<0b1101_1101>(t0, t1))
}

/// The rest of `_mm512_reduce_add_ps` for 16 positions from their [`fold4`]s (`u[j]` of
/// positions 4j..4j + 4): lane `p` of the result is position `p`'s sum, the last steps
/// (0 + 2) + (1 + 3) done by in-lane shuffles.
#[inline(always)]
unsafe fn finish16(u: &[__m512; 4]) -> __m512 {
    // Step 3: per quarter [a0 + a2, a1 + a3, b0 + b2, b1 + b3].
    let v0 = _mm512_add_ps(_mm512_shuffle_ps::<0b0100_0100>(u[0], u[1]), _mm512_shuffle_ps::<0b1110_1110>(u[0], u[1]));
    let v1 = _mm512_add_ps(_mm512_shuffle_ps::<0b0100_0100>(u[2], u[3]), _mm512_shuffle_ps::<0b1110_1110>(u[2], u[3]));
    // Step 4: per quarter k, lane m = (x0 + x2) + (x1 + x3) of position 4m + k.
    let w = _mm512_add_ps(_mm512_shuffle_ps::<0b1000_1000>(v0, v1), _mm512_shuffle_ps::<0b1101_1101>(v0, v1));
    // Lane p of the result is lane 4 (p % 4) + p / 4 of w.
    let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(idx, w)
}

/// `_mm512_reduce_add_ps` in its exact order: (lo8 + hi8), then (lo4 + hi4), then
/// (0 + 2) + (1 + 3) — `ggml_exact::reduce16`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn reduce16(v: __m512) -> f32 {
    let t8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps::<1>(v));
    let t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps::<1>(t8));
    let u = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
    _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)))
}

/// `ggml_v_expf`, AVX-512 variant (the one `ggml_exact::expf` mirrors lane by lane): the
/// softmax's exponential here, and SiLU's (`ops::silu_mul`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn expf16(x: __m512) -> __m512 {
    let c = |bits: u32| _mm512_set1_ps(f32::from_bits(bits));
    let r = c(0x4b40_0000);
    let z = _mm512_fmadd_ps(x, c(0x3fb8_aa3b), r);
    let n = _mm512_sub_ps(z, r);
    let b = _mm512_fnmadd_ps(n, c(0x35bf_be8e), _mm512_fnmadd_ps(n, c(0x3f31_7200), x));
    let big = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
    let u = _mm512_mul_ps(b, b);
    let j = _mm512_fmadd_ps(
        _mm512_fmadd_ps(_mm512_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)), u, _mm512_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb))),
        u,
        _mm512_fmadd_ps(c(0x3f7f_fff6), b, _mm512_set1_ps(1.0)),
    );
    let res = _mm512_scalef_ps(j, n);
    if big == 0 {
        return res;
    }
    let alt = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, _mm512_setzero_ps()), _mm512_set1_ps(f32::INFINITY), _mm512_setzero_ps());
    _mm512_mask_blend_ps(big, res, alt)
}

/// `ggml_exact::softmax_in_place` sixteen lanes at a time given the scores' maximum `max`,
/// then the weights rounded to f16 (as ggml converts them for the V product). Returns the
/// log-sum-exp.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn softmax_f16(x: &mut [f32], max: f32) -> f32 {
    let n = x.len();
    let p = x.as_mut_ptr();
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let tail_mask = |i: usize| -> __mmask16 { if i + 16 <= n { 0xFFFF } else { ((1u32 << (n - i)) - 1) as __mmask16 } };
    let vmax = _mm512_set1_ps(max);
    let mut sum = 0f64;
    for i in (0..n).step_by(16) {
        let k = tail_mask(i);
        let e = expf16(_mm512_sub_ps(_mm512_mask_loadu_ps(ninf, k, p.add(i)), vmax));
        _mm512_mask_storeu_ps(p.add(i), k, e);
        sum += reduce16(e) as f64;
    }
    let inv = _mm512_set1_ps((1.0 / sum) as f32);
    for i in (0..n).step_by(16) {
        let k = tail_mask(i);
        let w = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, p.add(i)), inv);
        let w = _mm512_cvtph_ps(_mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(w));
        _mm512_mask_storeu_ps(p.add(i), k, w);
    }
    (max as f64 + sum.ln()) as f32
}

/// Positions per window of the V pass (256 KiB of f16 V rows of 64).
const WINDOW: usize = 2048;

/// The first `16 * NV` elements of an f16 row widened to `NV` vectors.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn widen_row<const NV: usize>(row: *const u8) -> [__m512; NV] {
    let r = row as *const __m256i;
    let mut x = [_mm512_setzero_ps(); NV];
    for (j, xj) in x.iter_mut().enumerate() {
        *xj = _mm512_cvtph_ps(_mm256_loadu_si256(r.add(j)));
    }
    x
}
