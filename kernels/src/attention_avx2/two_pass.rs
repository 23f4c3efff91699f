//! AVX2 two-pass attention of one KV head's query group straight from f16 K/V rows: bit for
//! bit [`decode_attention_range`](crate::attention::decode_attention_range) run once per query
//! head (ggml's decode arithmetic, which a context within one `DECODE_CHUNK` takes), or with
//! `tiled` the arithmetic llama.cpp gives a prompt's tokens (tinyBLAS's). Before it, CPUs
//! without AVX-512 widened every row into a buffer and ran the twin head by head (4–40 % of
//! the read bandwidth at 1024 positions).
//!
//! * Q·K: each K row is widened once for every head of the group; a head's product keeps
//!   `ggml_vec_dot_f16`'s 64 lanes as eight registers and `reduce64`'s tree down to eight
//!   lanes (tinyBLAS: its 16 lanes as two registers, and `reduce16`'s first step), and the
//!   rest of the tree runs for eight positions at once (`finish8`, the same pairings as the
//!   twin's).
//! * The softmax: ggml's `exp` eight lanes at a time, each 16 positions' sum by `reduce16`'s
//!   tree (in registers) into an f64 sum, the weights scaled and rounded to f16 eight at a time.
//! * V·weights: position `p` into ggml's lane `p % 64` of every dimension, as the twin. Each
//!   V row is widened once for the group; the lanes live in a buffer (`G × 64 × head_dim`
//!   floats, in L1/L2), the first 64 positions writing theirs from zero so that the buffer
//!   needs no clearing, then each lane taking its four positions of a window of 256 one after
//!   another (its accumulators loaded and stored once for them; `accumulate_window`); then
//!   `reduce64`'s tree across the lanes, eight dimensions at a time, and the positions past
//!   the last multiple of 64 of the padded length in f64. tinyBLAS: every position into 16
//!   lanes (`p % 16`, windows of 64), reduced by `reduce16`'s tree.

use std::arch::x86_64::*;

use super::{finish8, load8, prefetch_row, rounded_q, Avx2Scratch, AHEAD};
use crate::attention::KvRun;
use crate::attention_rows::{by_group, checked_group, RowTable};
use crate::simd_x86::reduce16;

/// The position lanes of the V pass: ggml's 64, or tinyBLAS's 16 when `tiled`.
const fn lane_count(tiled: bool) -> usize {
    if tiled {
        16
    } else {
        64
    }
}

/// The group's attention over positions `start..end`, given as f16 `runs` in position order
/// (their rows add up to `end - start`); `q`/`out` are `[group][head_dim]` (heads of 64 or
/// 128), `lse` one per head; `n_padded` and `scale` as in `decode_attention_range` (no soft
/// cap); `tiled` as in `attention_avx512::attend_group`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C. Panics (safely) if the slices disagree, the heads
/// are not of 64 or 128, the group is larger than `MAX_GROUP`, or a run is not f16.
#[allow(clippy::too_many_arguments)] // the runs, the range and the group's three slices
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
    scratch: &mut Avx2Scratch,
) {
    let (group, hd) = checked_group(runs, end.saturating_sub(start), q, out, lse);
    scratch.rows.fill(runs, hd, false);
    let Avx2Scratch { rows, scores, lanes, .. } = scratch;
    macro_rules! by_shape {
        ($nv:literal, $t:literal) => {
            by_group!(group, kernel::<$nv, $t>(rows, start, end, n_padded, scale, q, out, lse, scores, lanes))
        };
    }
    match (hd, tiled) {
        (64, false) => by_shape!(8, false),
        (64, true) => by_shape!(8, true),
        (_, false) => by_shape!(16, false),
        (_, true) => by_shape!(16, true),
    }
}

/// [`attend_group`] for `G` heads of `8 * NV` dimensions, `TILED` as its `tiled`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kernel<const G: usize, const NV: usize, const TILED: bool>(
    rows: &RowTable,
    start: usize,
    end: usize,
    n_padded: usize,
    scale: f32,
    q: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
    scores: &mut Vec<f32>,
    lanes: &mut Vec<f32>,
) {
    let n = end - start;
    // Each head's scores (then weights) from `g * stride`; whole 16-position chunks.
    let stride = n.next_multiple_of(16);
    if scores.len() < G * stride {
        scores.resize(G * stride, 0.0);
    }
    let s = scores.as_mut_ptr();
    let qv = rounded_q::<G, NV>(q);
    let max = scores_pass::<G, NV, TILED>(rows, n, stride, scale, &qv, s);
    for (g, l) in lse.iter_mut().enumerate() {
        *l = softmax_weights(s.add(g * stride), n, max[g]);
    }
    value_pass::<G, NV, TILED>(rows, start, end, n_padded, stride, s, out, lanes);
}

/// The scaled Q·K score of every head at each of the `n` positions, into `s[g * stride + i]`
/// (whole groups of eight: the slots past `n` get zeros); returns each head's largest score.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_pass<const G: usize, const NV: usize, const TILED: bool>(rows: &RowTable, n: usize, stride: usize, scale: f32, qv: &[[__m256; NV]; G], s: *mut f32) -> [f32; G] {
    let zero = _mm256_setzero_ps();
    let vscale = _mm256_set1_ps(scale);
    let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut vmax = [ninf; G];
    for b in (0..n).step_by(8) {
        let len = (n - b).min(8);
        let mut t8 = [[zero; 8]; G];
        for i in 0..len {
            let p = b + i;
            if p + AHEAD < n {
                prefetch_row::<NV, false>(rows.k(p + AHEAD));
            }
            let k = rows.k(p);
            let kx: [__m256; NV] = std::array::from_fn(|j| load8::<false>(k, j));
            for (t, q) in t8.iter_mut().zip(qv) {
                if TILED {
                    // tinyBLAS: lane l of 16 chains q·k over the 16-value chunks, then
                    // reduce16's first step (lanes l + 8 and l).
                    let (mut lo, mut hi) = (zero, zero);
                    for c in 0..NV / 2 {
                        lo = _mm256_fmadd_ps(q[2 * c], kx[2 * c], lo);
                        hi = _mm256_fmadd_ps(q[2 * c + 1], kx[2 * c + 1], hi);
                    }
                    t[i] = _mm256_add_ps(hi, lo);
                    continue;
                }
                // ggml_vec_dot_f16's 64 lanes (register j holds lanes 8j..8j + 8): from +0,
                // one fused multiply-add per 64 values.
                let y: [__m256; 8] = std::array::from_fn(|j| {
                    let first = _mm256_fmadd_ps(kx[j], q[j], zero);
                    if NV == 16 {
                        _mm256_fmadd_ps(kx[j + 8], q[j + 8], first)
                    } else {
                        first
                    }
                });
                // reduce64: h[i] = (l[i] + l[i + 32]) + (l[i + 16] + l[i + 48]) for lanes
                // 0–7 and 8–15, then reduce16's first step h[i + 8] + h[i].
                let h_lo = _mm256_add_ps(_mm256_add_ps(y[0], y[4]), _mm256_add_ps(y[2], y[6]));
                let h_hi = _mm256_add_ps(_mm256_add_ps(y[1], y[5]), _mm256_add_ps(y[3], y[7]));
                t[i] = _mm256_add_ps(h_hi, h_lo);
            }
        }
        let valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(len as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        for (g, (t, m)) in t8.iter().zip(vmax.iter_mut()).enumerate() {
            let sc = _mm256_mul_ps(finish8(t), vscale);
            _mm256_storeu_ps(s.add(g * stride + b), sc);
            // `max` with the new value first ignores a NaN score, as the twin's fold does.
            *m = _mm256_max_ps(_mm256_blendv_ps(ninf, sc, _mm256_castsi256_ps(valid)), *m);
        }
    }
    vmax.map(|m| {
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        lanes.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x))
    })
}

/// `softmax_in_place` of one head's `n` scores at `s` (whose largest is `max`), the results
/// rounded to f16 in place as the twin's weights; returns the log-sum-exp.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn softmax_weights(s: *mut f32, n: usize, max: f32) -> f32 {
    let vmax = _mm256_set1_ps(max);
    let index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let mut sum = 0f64;
    for c in (0..n).step_by(16) {
        let e: [__m256; 2] = std::array::from_fn(|h| {
            let x = expf8_at(s.add(c + 8 * h), vmax);
            // Past the range the twin's lanes are zero.
            let valid = _mm256_cmpgt_epi32(_mm256_set1_epi32((n - c) as i32 - 8 * h as i32), index);
            _mm256_and_ps(x, _mm256_castsi256_ps(valid))
        });
        _mm256_storeu_ps(s.add(c), e[0]);
        _mm256_storeu_ps(s.add(c + 8), e[1]);
        sum += reduce16(e[0], e[1]) as f64;
    }
    let inv = _mm256_set1_ps((1.0 / sum) as f32);
    for c in (0..n).step_by(8) {
        let w = _mm256_mul_ps(_mm256_loadu_ps(s.add(c)), inv);
        _mm256_storeu_ps(s.add(c), _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(w)));
    }
    (max as f64 + sum.ln()) as f32
}

/// ggml's `exp` of the eight scores at `s`, less `max`.
#[inline(always)]
unsafe fn expf8_at(s: *const f32, max: __m256) -> __m256 {
    super::expf8(_mm256_sub_ps(_mm256_loadu_ps(s), max))
}

/// V · weights (`w[g * stride + i]` for position `start + i`): positions below the last
/// multiple of 64 of the padded length into ggml's 64 lanes (`p % 64`), reduced by
/// `reduce64`'s tree, then the rest in f64; the sums into `out` as f32. `TILED`: every
/// position into 16 lanes (`p % 16`), reduced by `reduce16`'s (f32, exact through f64).
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn value_pass<const G: usize, const NV: usize, const TILED: bool>(
    rows: &RowTable,
    start: usize,
    end: usize,
    n_padded: usize,
    stride: usize,
    w: *const f32,
    out: &mut [f32],
    lanes: &mut Vec<f32>,
) {
    let hd = 8 * NV;
    let n = end - start;
    let n_lanes = lane_count(TILED);
    let simd_end = if TILED { end } else { (n_padded & !63).min(end).max(start) };
    let zero = _mm256_setzero_pd();
    // Per head, dimensions 4j..4j + 4 in sums[g][j].
    let mut sums = [[zero; 32]; G];
    if simd_end > start {
        if lanes.len() < G * n_lanes * hd {
            lanes.resize(G * n_lanes * hd, 0.0);
        }
        let l = lanes.as_mut_ptr();
        let lanes_end = simd_end - start;
        // The first positions of each lane start it from zero (a fused multiply-add onto +0,
        // as the twin's lanes take them); lanes no position reaches are cleared.
        let first = lanes_end.min(n_lanes);
        accumulate::<G, NV, TILED, true>(rows, start, 0..first, n, stride, w, l);
        let mut at = first;
        while at + STEPS * n_lanes <= lanes_end {
            accumulate_window::<G, NV, TILED>(rows, start, at, n, stride, w, l);
            at += STEPS * n_lanes;
        }
        accumulate::<G, NV, TILED, false>(rows, start, at..lanes_end, n, stride, w, l);
        for p in start + first..start + n_lanes {
            for g in 0..G {
                std::ptr::write_bytes(l.add((g * n_lanes + p % n_lanes) * hd), 0, hd);
            }
        }
        for (g, sg) in sums.iter_mut().enumerate() {
            for j in 0..NV {
                let at = |lane: usize| _mm256_loadu_ps(l.add((g * n_lanes + lane) * hd + 8 * j));
                let h: [__m256; 16] = std::array::from_fn(|i| if TILED { at(i) } else { _mm256_add_ps(_mm256_add_ps(at(i), at(i + 32)), _mm256_add_ps(at(i + 16), at(i + 48))) });
                let t8: [__m256; 8] = std::array::from_fn(|i| _mm256_add_ps(h[i + 8], h[i]));
                let t4: [__m256; 4] = std::array::from_fn(|i| _mm256_add_ps(t8[i + 4], t8[i]));
                let r = _mm256_add_ps(_mm256_add_ps(t4[0], t4[2]), _mm256_add_ps(t4[1], t4[3]));
                sg[2 * j] = _mm256_cvtps_pd(_mm256_castps256_ps128(r));
                sg[2 * j + 1] = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(r));
            }
        }
    }
    for i in simd_end - start..n {
        let row = rows.v(i);
        for j in 0..NV {
            let v = load8::<false>(row, j);
            for (g, sg) in sums.iter_mut().enumerate() {
                let prod = _mm256_mul_ps(v, _mm256_set1_ps(*w.add(g * stride + i)));
                sg[2 * j] = _mm256_add_pd(sg[2 * j], _mm256_cvtps_pd(_mm256_castps256_ps128(prod)));
                sg[2 * j + 1] = _mm256_add_pd(sg[2 * j + 1], _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(prod)));
            }
        }
    }
    for (o, sg) in out.chunks_exact_mut(hd).zip(&sums) {
        for j in 0..NV {
            _mm256_storeu_ps(o.as_mut_ptr().add(8 * j), _mm256_set_m128(_mm256_cvtpd_ps(sg[2 * j + 1]), _mm256_cvtpd_ps(sg[2 * j])));
        }
    }
}

/// Positions a lane takes in a row in [`accumulate_window`].
const STEPS: usize = 4;

/// Positions `start + i` for `i` in `base..base + STEPS * lanes` into their lanes, as
/// [`accumulate`] but a lane's `STEPS` positions of the window one after another (the same
/// order within each lane), so that its accumulators are loaded and stored once for them:
/// a position-by-position pass is bound by the lanes' loads and stores. The window after this
/// one is prefetched.
#[inline(always)]
unsafe fn accumulate_window<const G: usize, const NV: usize, const TILED: bool>(rows: &RowTable, start: usize, base: usize, n: usize, stride: usize, w: *const f32, l: *mut f32) {
    let (hd, n_lanes) = (8 * NV, lane_count(TILED));
    for o in 0..n_lanes {
        let i0 = base + o;
        let lane = (start + i0) % n_lanes;
        let row: [*const u8; STEPS] = std::array::from_fn(|k| rows.v(i0 + k * n_lanes));
        for k in 0..STEPS {
            let ahead = i0 + (k + STEPS) * n_lanes;
            if ahead < n {
                prefetch_row::<NV, false>(rows.v(ahead));
            }
        }
        for j in 0..NV {
            let v: [__m256; STEPS] = std::array::from_fn(|k| load8::<false>(row[k], j));
            for g in 0..G {
                let at = l.add((g * n_lanes + lane) * hd + 8 * j);
                let mut acc = _mm256_loadu_ps(at);
                for (k, &vk) in v.iter().enumerate() {
                    acc = _mm256_fmadd_ps(vk, _mm256_set1_ps(*w.add(g * stride + i0 + k * n_lanes)), acc);
                }
                _mm256_storeu_ps(at, acc);
            }
        }
    }
}

/// Positions `start + i` for `i` in `range` into their lanes (`(start + i) % 64`, `TILED`
/// `% 16`) of every head: `lane = fma(v, w, lane)`, or with `FIRST` `fma(v, w, +0)` stored
/// over the lane.
#[inline(always)]
unsafe fn accumulate<const G: usize, const NV: usize, const TILED: bool, const FIRST: bool>(rows: &RowTable, start: usize, range: std::ops::Range<usize>, n: usize, stride: usize, w: *const f32, l: *mut f32) {
    let (hd, n_lanes) = (8 * NV, lane_count(TILED));
    for i in range {
        if i + AHEAD < n {
            prefetch_row::<NV, false>(rows.v(i + AHEAD));
        }
        let lane = (start + i) % n_lanes;
        let row = rows.v(i);
        let wg: [__m256; G] = std::array::from_fn(|g| _mm256_set1_ps(*w.add(g * stride + i)));
        for j in 0..NV {
            let v = load8::<false>(row, j);
            for (g, &wv) in wg.iter().enumerate() {
                let at = l.add((g * n_lanes + lane) * hd + 8 * j);
                let acc = if FIRST { _mm256_setzero_ps() } else { _mm256_loadu_ps(at) };
                _mm256_storeu_ps(at, _mm256_fmadd_ps(v, wv, acc));
            }
        }
    }
}
