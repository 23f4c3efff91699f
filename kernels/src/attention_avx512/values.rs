//! The V pass of [`super`]'s exact kernel: V · weights into ggml's 64 position lanes for
//! every head of the group at once (the tinyBLAS variant: 16 lanes), the lanes reduced by
//! ggml's trees, 64 dimensions at a time — a head of 128 as two of 64, in one pass over its
//! rows for groups of one or two heads and a pass per half for larger ones.

use std::arch::x86_64::*;

use super::{prefetch_row, widen_row, FastScratch, RowTable, WINDOW};

/// V · weights: positions below the last multiple of 64 of the padded length into ggml's 64
/// lanes (`p % 64`) for every head, the lanes reduced by `reduce64`'s tree, then the rest of
/// the positions added in f64.
///
/// The lanes are accumulated lane by lane rather than position by position: a pair of lanes'
/// accumulators (every head, every dimension) stays in registers while the positions of
/// those lanes are visited in order, window after window of [`WINDOW`] positions (whose V
/// rows are prefetched into L2 while the window before is summed). Each lane sees its
/// positions in the same order as position by position, so the sums are the same.
///
/// `G` sums of 64 dimensions ("heads" here), `H` of them from each V row: with `H` 1, head
/// `g` weighted by `weights[g]` over the 64 dimensions from the rows' `v_off`; with `H` 2,
/// a row's two halves are heads `2g` and `2g + 1`, both weighted by `weights[g]` (one head of
/// 128 each two of 64: the same sums as a pass per half, from one read of the rows).
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn value_pass<const G: usize, const H: usize>(
    start: usize,
    end: usize,
    n_padded: usize,
    stride: usize,
    weights: *const f32,
    out: &mut [f32],
    scratch: &mut FastScratch,
) {
    let simd_end = (n_padded & !63).min(end).max(start);
    let rows = &scratch.rows;
    let mut sums = [[_mm512_setzero_pd(); 8]; G];
    if simd_end > start && simd_end - start <= 64 {
        // One position per lane at most: the lanes folded straight from the V rows.
        fold_positions::<G, H>(start, simd_end, stride, weights, rows, &mut sums);
    } else if simd_end > start {
        grow(&mut scratch.lanes, G * 64 * 64);
        let lanes = scratch.lanes.as_mut_ptr();
        sum_lanes::<G, H, 64>(start, simd_end, stride, weights, rows, lanes);
        fold_lanes::<G>(lanes, &mut sums);
    }
    for p in simd_end..end {
        let i = p - start;
        let vx: [[__m512; 4]; H] = std::array::from_fn(|h| widen_row::<4>(rows.v(i).add(128 * h)));
        for (g, s) in sums.iter_mut().enumerate() {
            let w = _mm512_set1_ps(*weights.add(g / H * stride + i));
            for (j, &vj) in vx[g % H].iter().enumerate() {
                let prod = _mm512_mul_ps(vj, w);
                s[2 * j] = _mm512_add_pd(s[2 * j], _mm512_cvtps_pd(_mm512_castps512_ps256(prod)));
                s[2 * j + 1] = _mm512_add_pd(s[2 * j + 1], _mm512_cvtps_pd(_mm512_extractf32x8_ps::<1>(prod)));
            }
        }
    }
    for (o, s) in out.chunks_exact_mut(64).zip(&sums) {
        for (j, &sj) in s.iter().enumerate() {
            _mm256_storeu_ps(o.as_mut_ptr().add(8 * j), _mm512_cvtpd_ps(sj));
        }
    }
}

/// tinyBLAS's V · weights: every position into 16 lanes (`p % 16`), each head's lanes summed
/// by `reduce16` per dimension, in f32. Lane pairs and windows as in [`value_pass`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn tiled_value_pass<const G: usize>(start: usize, end: usize, stride: usize, weights: *const f32, out: &mut [f32], scratch: &mut FastScratch) {
    let rows = &scratch.rows;
    grow(&mut scratch.lanes, G * 16 * 64);
    let lanes = scratch.lanes.as_mut_ptr();
    sum_lanes::<G, 1, 16>(start, end, stride, weights, rows, lanes);
    for (g, o) in out.chunks_exact_mut(64).enumerate() {
        let l = lanes.add(g * 16 * 64);
        for j in 0..4 {
            let at = |lane: usize| _mm512_loadu_ps(l.add(lane * 64 + 16 * j));
            let t8: [__m512; 8] = std::array::from_fn(|i| _mm512_add_ps(at(i + 8), at(i)));
            let t4: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(t8[i + 4], t8[i]));
            let r = _mm512_add_ps(_mm512_add_ps(t4[0], t4[2]), _mm512_add_ps(t4[1], t4[3]));
            _mm512_storeu_ps(o.as_mut_ptr().add(16 * j), r);
        }
    }
}

/// Makes `v` at least `len` long. The lane buffers are not cleared between tasks: the first
/// window of [`sum_lanes`] writes every lane from zero (clearing 48 KiB per task cost as much
/// as reading a 150-position context).
fn grow(v: &mut Vec<f32>, len: usize) {
    if v.len() < len {
        v.resize(len, 0.0);
    }
}

/// Positions `start..end` into `LANES` position lanes (`p % LANES`) of every head, a lane
/// pair at a time, window after window of [`WINDOW`] positions; the next window's V rows are
/// prefetched into L2 while this one is summed (a slice per lane pair). Every lane of
/// `lanes[..G * LANES * 64]` is written (from zero in the first window, whatever it held).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn sum_lanes<const G: usize, const H: usize, const LANES: usize>(start: usize, end: usize, stride: usize, weights: *const f32, rows: &RowTable, lanes: *mut f32) {
    let pairs = LANES / 2;
    let mut w0 = start;
    while w0 < end {
        let w1 = (w0 - w0 % 64 + WINDOW).min(end);
        let next = (w1 - start)..(w1 - w1 % 64 + WINDOW).min(end) - start;
        let per_pair = next.len().div_ceil(pairs);
        for pair in 0..pairs {
            for i in next.clone().skip(pair * per_pair).take(per_pair) {
                for h in 0..H {
                    prefetch_row::<_MM_HINT_T1, 4, false>(rows.v(i).add(128 * h));
                }
            }
            lane_pair::<G, H, LANES>(2 * pair, w0, w1, start, stride, weights, rows, lanes);
        }
        w0 = w1;
    }
}


/// Lanes `lane` and `lane + 1` (of `LANES`) over the positions `w0..w1`: their accumulators
/// loaded from `lanes[g][lane][..]` (zero in the first window, `w0 == start`), the positions
/// `p ≡ lane (mod LANES)` added in order, stored back.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn lane_pair<const G: usize, const H: usize, const LANES: usize>(
    lane: usize,
    w0: usize,
    w1: usize,
    start: usize,
    stride: usize,
    weights: *const f32,
    rows: &RowTable,
    lanes: *mut f32,
) {
    let at = |g: usize, l: usize, j: usize| lanes.add((g * LANES + lane + l) * 64 + 16 * j);
    let mut acc = [[[_mm512_setzero_ps(); 4]; G]; 2];
    if w0 != start {
        for (l, acc_l) in acc.iter_mut().enumerate() {
            for (g, acc_g) in acc_l.iter_mut().enumerate() {
                for (j, a) in acc_g.iter_mut().enumerate() {
                    *a = _mm512_loadu_ps(at(g, l, j));
                }
            }
        }
    }
    // First position of lane `lane` at or after the start of w0's chunk of LANES positions.
    let mut p = w0 - w0 % LANES + lane;
    while p < w1 {
        for (l, acc_l) in acc.iter_mut().enumerate() {
            let q = p + l;
            if q < w0 || q >= w1 {
                continue;
            }
            let i = q - start;
            let vx: [[__m512; 4]; H] = std::array::from_fn(|h| widen_row::<4>(rows.v(i).add(128 * h)));
            for (g, acc_g) in acc_l.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*weights.add(g / H * stride + i));
                for (a, &vj) in acc_g.iter_mut().zip(&vx[g % H]) {
                    *a = _mm512_fmadd_ps(vj, w, *a);
                }
            }
        }
        p += LANES;
    }
    for (l, acc_l) in acc.iter().enumerate() {
        for (g, acc_g) in acc_l.iter().enumerate() {
            for (j, a) in acc_g.iter().enumerate() {
                _mm512_storeu_ps(at(g, l, j), *a);
            }
        }
    }
}

/// [`fold_lanes`] of the lanes [`sum_lanes`] would build from positions `start..end`, at
/// most 64 of them (so at most one per lane; a lane's sum is then its position's product, or
/// zero), computed straight from the V rows without the lane buffer: short contexts
/// otherwise spend more on clearing, storing and reloading 64 lanes than on their rows.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn fold_positions<const G: usize, const H: usize>(start: usize, end: usize, stride: usize, weights: *const f32, rows: &RowTable, sums: &mut [[__m512d; 8]; G]) {
    let zero = _mm512_setzero_ps();
    for j in 0..4 {
        let mut h = [[zero; 16]; G];
        for i in 0..16 {
            // The positions of lanes i, i + 16, i + 32 and i + 48 (if in the range), each
            // part of their rows.
            let x: [[Option<(usize, __m512)>; 4]; H] = std::array::from_fn(|part| {
                std::array::from_fn(|k| {
                    let lane = i + 16 * k;
                    let off = (lane + 64 - start % 64) % 64;
                    (start + off < end).then(|| (off, _mm512_cvtph_ps(_mm256_loadu_si256((rows.v(off).add(128 * part) as *const __m256i).add(j)))))
                })
            });
            for (g, hg) in h.iter_mut().enumerate() {
                // The lane's one accumulation from zero, as `lane_pair` does it (a fused
                // multiply-add onto +0, so a −0 product becomes +0 there and here alike).
                let lane = |k: usize| match x[g % H][k] {
                    Some((off, v)) => _mm512_fmadd_ps(v, _mm512_set1_ps(*weights.add(g / H * stride + off)), zero),
                    None => zero,
                };
                // As `fold_lanes`: (l_i + l_{i+32}) + (l_{i+16} + l_{i+48}).
                hg[i] = _mm512_add_ps(_mm512_add_ps(lane(0), lane(2)), _mm512_add_ps(lane(1), lane(3)));
            }
        }
        for (s, hg) in sums.iter_mut().zip(&h) {
            [s[2 * j], s[2 * j + 1]] = fold16(hg);
        }
    }
}

/// The rest of `reduce64` for sixteen dimensions, from `h[i] = (l_i + l_{i+32}) + (l_{i+16} +
/// l_{i+48})`: `(h_i + h_{i+8})`, then `+4`, then `(0 + 2) + (1 + 3)`, widened to f64.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn fold16(h: &[__m512; 16]) -> [__m512d; 2] {
    let t8: [__m512; 8] = std::array::from_fn(|i| _mm512_add_ps(h[i + 8], h[i]));
    let t4: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(t8[i + 4], t8[i]));
    let r = _mm512_add_ps(_mm512_add_ps(t4[0], t4[2]), _mm512_add_ps(t4[1], t4[3]));
    [_mm512_cvtps_pd(_mm512_castps512_ps256(r)), _mm512_cvtps_pd(_mm512_extractf32x8_ps::<1>(r))]
}

/// `sums[g][d] = reduce64(lanes[g][..][d])` in f64, for every dimension at once.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn fold_lanes<const G: usize>(lanes: *const f32, sums: &mut [[__m512d; 8]; G]) {
    for (g, s) in sums.iter_mut().enumerate() {
        let l = lanes.add(g * 64 * 64);
        for j in 0..4 {
            let at = |lane: usize| _mm512_loadu_ps(l.add(lane * 64 + 16 * j));
            let mut h = [_mm512_setzero_ps(); 16];
            for (i, hi) in h.iter_mut().enumerate() {
                *hi = _mm512_add_ps(_mm512_add_ps(at(i), at(i + 32)), _mm512_add_ps(at(i + 16), at(i + 48)));
            }
            [s[2 * j], s[2 * j + 1]] = fold16(&h);
        }
    }
}
