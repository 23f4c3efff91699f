//! AVX-512 decode attention of one KV head's whole query group, straight from f16 K/V rows:
//! bit for bit [`decode_attention_range`](super::attention::decode_attention_range) run once
//! per query head over widened rows, in one pass over K and one over V.
//!
//! What makes it fast while keeping ggml's exact arithmetic:
//! * each K and V row is loaded and widened once for every query head of the group (GQA);
//! * Q·K keeps `ggml_vec_dot_f16`'s 64 products and its `reduce64` tree, but the last
//!   16-lane step (`_mm512_reduce_add_ps`) is done for 16 positions at once by a transposed
//!   butterfly (the same pairings, so the same sums);
//! * the softmax runs `ggml_v_expf` sixteen lanes at a time, as ggml does;
//! * V·weights accumulate into ggml's 64 position lanes for all heads of the group at once.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use half::f16;

/// Largest query group the kernel is built for (GQA ratios in use are 1 to 8).
pub const MAX_GROUP: usize = 8;

/// One run of consecutive positions: `[rows][64]` f16 K and V rows.
#[derive(Debug, Clone, Copy)]
pub struct KvRun<'a> {
    pub k: &'a [f16],
    pub v: &'a [f16],
}

/// Reusable buffers of the kernel (scores, and the V lanes of every head of the group).
#[derive(Debug, Default)]
pub struct GroupScratch {
    scores: Vec<f32>,
    lanes: Vec<f32>,
}

/// The group's attention over positions `start..end`, given as `runs` in position order (their
/// rows add up to `end - start`); `q`/`out` are `[group][64]`, `lse` one per head; `n_padded`
/// and `scale` as in `decode_attention_range`.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/DQ, AVX2, FMA and F16C. Panics (safely) if the slices
/// disagree or the group is larger than [`MAX_GROUP`].
#[allow(clippy::too_many_arguments)] // the runs, the range and the group's three slices
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub unsafe fn attend_group_hd64(
    runs: &[KvRun<'_>],
    start: usize,
    end: usize,
    n_padded: usize,
    scale: f32,
    q: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
    scratch: &mut GroupScratch,
) {
    let group = lse.len();
    let n = end - start;
    assert!(group >= 1 && group <= MAX_GROUP, "query group of {group}");
    assert!(q.len() == group * 64 && out.len() == group * 64, "query group slice sizes");
    assert_eq!(runs.iter().map(|r| r.k.len()).sum::<usize>(), n * 64, "K rows cover the range");
    assert!(runs.iter().all(|r| r.v.len() == r.k.len()), "V rows match K rows");
    assert!(n > 0, "empty attention range");
    match group {
        1 => group_kernel::<1>(runs, start, end, n_padded, scale, q, out, lse, scratch),
        2 => group_kernel::<2>(runs, start, end, n_padded, scale, q, out, lse, scratch),
        3 => group_kernel::<3>(runs, start, end, n_padded, scale, q, out, lse, scratch),
        4 => group_kernel::<4>(runs, start, end, n_padded, scale, q, out, lse, scratch),
        5 => group_kernel::<5>(runs, start, end, n_padded, scale, q, out, lse, scratch),
        6 => group_kernel::<6>(runs, start, end, n_padded, scale, q, out, lse, scratch),
        7 => group_kernel::<7>(runs, start, end, n_padded, scale, q, out, lse, scratch),
        _ => group_kernel::<8>(runs, start, end, n_padded, scale, q, out, lse, scratch),
    }
}

#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn group_kernel<const G: usize>(
    runs: &[KvRun<'_>],
    start: usize,
    end: usize,
    n_padded: usize,
    scale: f32,
    q: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
    scratch: &mut GroupScratch,
) {
    let n = end - start;
    let stride = n.next_multiple_of(16);
    scratch.scores.resize(G * stride, 0.0);
    let scores = scratch.scores.as_mut_ptr();
    // Q rounded to f16 (ggml converts it for the f16 dot product).
    let mut qv = [[_mm512_setzero_ps(); 4]; G];
    for (g, qg) in qv.iter_mut().enumerate() {
        for (j, v) in qg.iter_mut().enumerate() {
            let x = _mm512_loadu_ps(q.as_ptr().add(g * 64 + 16 * j));
            *v = _mm512_cvtph_ps(_mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x));
        }
    }
    scores_pass::<G>(runs, n, stride, scale, &qv, scores);
    for (g, l) in lse.iter_mut().enumerate() {
        *l = softmax_f16(std::slice::from_raw_parts_mut(scores.add(g * stride), n));
    }
    value_pass::<G>(runs, start, end, n_padded, stride, scores, out, &mut scratch.lanes);
}

/// Scaled Q·K scores of every head for the `n` positions, into `scores[g * stride + i]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn scores_pass<const G: usize>(runs: &[KvRun<'_>], n: usize, stride: usize, scale: f32, qv: &[[__m512; 4]; G], scores: *mut f32) {
    let zero = _mm512_setzero_ps();
    let scale = _mm512_set1_ps(scale);
    // h[g][i]: position i (of 16)'s 16-lane partial sums (`reduce64` before its last step).
    let mut h = [[zero; 16]; G];
    let mut i = 0; // position index from the range start
    for run in runs {
        let rows = run.k.len() / 64;
        let k = run.k.as_ptr() as *const __m256i;
        for r in 0..rows {
            let row = k.add(4 * r);
            let kx = [
                _mm512_cvtph_ps(_mm256_loadu_si256(row)),
                _mm512_cvtph_ps(_mm256_loadu_si256(row.add(1))),
                _mm512_cvtph_ps(_mm256_loadu_si256(row.add(2))),
                _mm512_cvtph_ps(_mm256_loadu_si256(row.add(3))),
            ];
            for g in 0..G {
                let p = |j: usize| _mm512_fmadd_ps(kx[j], qv[g][j], zero);
                // reduce64: h[l] = (acc[l] + acc[l + 32]) + (acc[l + 16] + acc[l + 48]).
                h[g][i % 16] = _mm512_add_ps(_mm512_add_ps(p(0), p(2)), _mm512_add_ps(p(1), p(3)));
            }
            i += 1;
            if i % 16 == 0 {
                for g in 0..G {
                    let s = _mm512_mul_ps(reduce16_x16(&h[g]), scale);
                    _mm512_storeu_ps(scores.add(g * stride + i - 16), s);
                }
            }
        }
    }
    if i % 16 != 0 {
        let keep = (1u32 << (i % 16)) - 1;
        for g in 0..G {
            let s = _mm512_mul_ps(reduce16_x16(&h[g]), scale);
            _mm512_mask_storeu_ps(scores.add(g * stride + i - i % 16), keep as __mmask16, s);
        }
    }
    debug_assert_eq!(i, n);
}

/// `_mm512_reduce_add_ps` of each of 16 vectors, lane `p` of the result being `h[p]`'s sum:
/// the halves added pairwise (8, 4, then (0+2)+(1+3)) by a butterfly over the vectors.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn reduce16_x16(h: &[__m512; 16]) -> __m512 {
    // Step 1: t[j] = [h[2j] lo8 + hi8 | h[2j+1] lo8 + hi8].
    let mut t = [_mm512_setzero_ps(); 8];
    for j in 0..8 {
        let (a, b) = (h[2 * j], h[2 * j + 1]);
        t[j] = _mm512_add_ps(_mm512_shuffle_f32x4::<0b0100_0100>(a, b), _mm512_shuffle_f32x4::<0b1110_1110>(a, b));
    }
    // Step 2: u[j] quarter k = the 4-lane t4 of position 4j + k.
    let mut u = [_mm512_setzero_ps(); 4];
    for j in 0..4 {
        let (a, b) = (t[2 * j], t[2 * j + 1]);
        u[j] = _mm512_add_ps(_mm512_shuffle_f32x4::<0b1000_1000>(a, b), _mm512_shuffle_f32x4::<0b1101_1101>(a, b));
    }
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
/// (0 + 2) + (1 + 3).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn reduce16(v: __m512) -> f32 {
    let t8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps::<1>(v));
    let t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps::<1>(t8));
    let u = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
    _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)))
}

/// `ggml_v_expf`, AVX-512 variant (the one `ggml_exact::expf` mirrors lane by lane).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn expf16(x: __m512) -> __m512 {
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

/// `ggml_exact::softmax_in_place` sixteen lanes at a time, then the weights rounded to f16
/// (as ggml converts them for the V product). Returns the log-sum-exp.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn softmax_f16(x: &mut [f32]) -> f32 {
    let n = x.len();
    let p = x.as_mut_ptr();
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let tail_mask = |i: usize| -> __mmask16 { if i + 16 <= n { 0xFFFF } else { ((1u32 << (n - i)) - 1) as __mmask16 } };
    let mut m = ninf;
    for i in (0..n).step_by(16) {
        m = _mm512_max_ps(m, _mm512_mask_loadu_ps(ninf, tail_mask(i), p.add(i)));
    }
    let max = _mm512_reduce_max_ps(m);
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

/// V · weights: positions below the last multiple of 64 of the padded length into ggml's 64
/// lanes (`p % 64`) for every head, the lanes reduced by `reduce64`'s tree, then the rest of
/// the positions added in f64.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn value_pass<const G: usize>(
    runs: &[KvRun<'_>],
    start: usize,
    end: usize,
    n_padded: usize,
    stride: usize,
    weights: *const f32,
    out: &mut [f32],
    lanes: &mut Vec<f32>,
) {
    let simd_end = (n_padded & !63).min(end).max(start);
    let use_lanes = simd_end > start;
    if use_lanes {
        lanes.clear();
        lanes.resize(G * 64 * 64, 0.0);
    }
    let lanes = lanes.as_mut_ptr();
    let mut sums = [[_mm512_setzero_pd(); 8]; G];
    let mut p = start;
    for run in runs {
        let rows = run.v.len() / 64;
        let v = run.v.as_ptr() as *const __m256i;
        for r in 0..rows {
            let row = v.add(4 * r);
            let vx = [
                _mm512_cvtph_ps(_mm256_loadu_si256(row)),
                _mm512_cvtph_ps(_mm256_loadu_si256(row.add(1))),
                _mm512_cvtph_ps(_mm256_loadu_si256(row.add(2))),
                _mm512_cvtph_ps(_mm256_loadu_si256(row.add(3))),
            ];
            let i = p - start;
            if p < simd_end {
                let lane = lanes.add((p % 64) * 64);
                for g in 0..G {
                    let w = _mm512_set1_ps(*weights.add(g * stride + i));
                    let acc = lane.add(g * 64 * 64);
                    for (j, &vj) in vx.iter().enumerate() {
                        _mm512_storeu_ps(acc.add(16 * j), _mm512_fmadd_ps(vj, w, _mm512_loadu_ps(acc.add(16 * j))));
                    }
                }
            } else {
                for g in 0..G {
                    let w = _mm512_set1_ps(*weights.add(g * stride + i));
                    for (j, &vj) in vx.iter().enumerate() {
                        let prod = _mm512_mul_ps(vj, w);
                        let s = &mut sums[g];
                        s[2 * j] = _mm512_add_pd(s[2 * j], _mm512_cvtps_pd(_mm512_castps512_ps256(prod)));
                        s[2 * j + 1] = _mm512_add_pd(s[2 * j + 1], _mm512_cvtps_pd(_mm512_extractf32x8_ps::<1>(prod)));
                    }
                }
            }
            p += 1;
            // The lanes' sum comes first in every dimension's f64 sum: fold it in as soon as
            // the SIMD part is done (the f64 sums are still zero then).
            if p == simd_end && use_lanes {
                fold_lanes::<G>(lanes, &mut sums);
            }
        }
    }
    for (g, o) in out.chunks_exact_mut(64).enumerate() {
        for j in 0..8 {
            _mm256_storeu_ps(o.as_mut_ptr().add(8 * j), _mm512_cvtpd_ps(sums[g][j]));
        }
    }
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
            let t8: [__m512; 8] = std::array::from_fn(|i| _mm512_add_ps(h[i + 8], h[i]));
            let t4: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(t8[i + 4], t8[i]));
            let r = _mm512_add_ps(_mm512_add_ps(t4[0], t4[2]), _mm512_add_ps(t4[1], t4[3]));
            s[2 * j] = _mm512_cvtps_pd(_mm512_castps512_ps256(r));
            s[2 * j + 1] = _mm512_cvtps_pd(_mm512_extractf32x8_ps::<1>(r));
        }
    }
}
