//! AVX2 attention of one KV head's whole query group, straight from f16 or Q8_0 K/V rows of 64
//! or 128 dimensions, for CPUs without AVX-512. The one-pass kernel here is bit for bit
//! [`decode_attention_online`](super::attention::decode_attention_online) run once per query
//! head (the arithmetic of a Q8_0 cache, and of each chunk of a context longer than one
//! `DECODE_CHUNK`); the two-pass one in `two_pass` is the arithmetic of an f16 context within
//! one chunk, a decode token's or (tiled) a prompt token's. Before them, such CPUs widened every row into a buffer and ran the twin
//! head by head, reading each K and V row once per query head (15–25 % of the read bandwidth).
//!
//! The one-pass kernel, per block of 16 positions, as the twin:
//! * each K row is loaded and widened once for every head of the group; a head's Q·K keeps
//!   tinyBLAS's sixteen fused multiply-add lanes as two registers of eight, whose `reduce16`
//!   starts with their sum (its first step), and the rest of the tree is done for eight
//!   positions at once by a transposed reduction (the same pairings, so the same sums);
//! * ggml's `exp` eight lanes at a time, its `vscalefps` step as the twin's f64 product;
//! * each V row is widened once and fused-multiply-added into every head's accumulators,
//!   position after position, a few vectors of dimensions at a time (the group's
//!   accumulators for them and the weights in registers).

#![cfg(target_arch = "x86_64")]
// Heads, positions and vectors are indexed by number: the loops are unrolled by the compiler.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

pub use super::attention_rows::{supports_head_dim, MAX_GROUP};
use super::attention::{KvRows, KvRun, Q8_0_BLOCK_BYTES};
use super::attention_rows::{by_group, checked_group, RowTable};
use super::ggml_exact::expf;
use super::simd_x86::reduce16;

mod two_pass;
pub use two_pass::attend_group;

/// Reusable buffers of the kernels: the rows of the call; the one-pass kernel's accumulators;
/// the two-pass kernel's scores and V lanes.
#[derive(Debug, Default)]
pub struct Avx2Scratch {
    rows: RowTable,
    acc: Vec<f32>,
    scores: Vec<f32>,
    lanes: Vec<f32>,
}

// SAFETY: the row table points into the K/V slices of one call; it is rewritten before
// every use and never read after the call returns.
unsafe impl Send for Avx2Scratch {}

/// The group's one-pass attention over the `n` positions of `runs` (rows in position order,
/// all f16 or all Q8_0); `q`/`out` are `[group][head_dim]` (heads of 64 or 128), `lse` one per
/// head; `scale` multiplies each Q·K (no soft cap).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C. Panics (safely) if the slices disagree, the heads
/// are not of 64 or 128, the group is larger than [`MAX_GROUP`], or the runs mix types.
pub unsafe fn attend_group_online(runs: &[KvRun<'_>], n: usize, scale: f32, q: &[f32], out: &mut [f32], lse: &mut [f32], scratch: &mut Avx2Scratch) {
    let (group, hd) = checked_group(runs, n, q, out, lse);
    let q8 = matches!(runs[0].k, KvRows::Q8_0(_));
    scratch.rows.fill(runs, hd, q8);
    scratch.acc.clear();
    scratch.acc.resize(group * hd, 0.0);
    let rows = &scratch.rows;
    macro_rules! by_shape {
        ($nv:literal, $q8:literal) => {
            by_group!(group, kernel::<$nv, $q8>(rows, n, scale, q, out, lse, &mut scratch.acc))
        };
    }
    match (hd, q8) {
        (64, false) => by_shape!(8, false),
        (64, true) => by_shape!(8, true),
        (_, false) => by_shape!(16, false),
        (_, true) => by_shape!(16, true),
    }
}

/// Rows are prefetched this many positions ahead.
const AHEAD: usize = 16;

/// Eight values of a row from value `8 * j`, widened: f16, or with `Q8` Q8_0 blocks
/// dequantised (`d · q`, exact in f32, as `widen_q8_0`).
#[inline(always)]
unsafe fn load8<const Q8: bool>(row: *const u8, j: usize) -> __m256 {
    if Q8 {
        let block = row.add(j / 4 * Q8_0_BLOCK_BYTES);
        let d = _mm256_cvtph_ps(_mm_set1_epi16((block as *const i16).read_unaligned()));
        let q = _mm_loadl_epi64(block.add(2 + 8 * (j % 4)).cast());
        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d)
    } else {
        _mm256_cvtph_ps(_mm_loadu_si128(row.add(16 * j).cast()))
    }
}

/// The cache lines of a row of `8 * NV` values (f16: two lines per 64; Q8_0: 34-byte blocks,
/// not line-aligned, every line from its first byte to its last).
#[inline(always)]
unsafe fn prefetch_row<const NV: usize, const Q8: bool>(row: *const u8) {
    let bytes = if Q8 { NV / 4 * Q8_0_BLOCK_BYTES } else { 16 * NV };
    let mut off = 0;
    while off < bytes {
        _mm_prefetch::<_MM_HINT_T0>(row.add(off).cast());
        off += 64;
    }
    _mm_prefetch::<_MM_HINT_T0>(row.add(bytes - 1).cast());
}

/// `G` heads of `8 * NV` dimensions (see [`attend_group_online`]); `acc` holds `G * 8 * NV`
/// zeros.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kernel<const G: usize, const NV: usize, const Q8: bool>(rows: &RowTable, n: usize, scale: f32, q: &[f32], out: &mut [f32], lse: &mut [f32], acc: &mut [f32]) {
    let hd = 8 * NV;
    let qv = rounded_q::<G, NV>(q);
    let vscale = _mm256_set1_ps(scale);
    let mut max = [f32::NEG_INFINITY; G];
    let mut sum = [0f32; G];
    let acc = acc.as_mut_ptr();
    for b in (0..n).step_by(16) {
        let len = (n - b).min(16);
        // The block's scores, positions b.. in order; past the range −∞.
        let mut s = [[f32::NEG_INFINITY; 16]; G];
        for half in 0..2 {
            let from = b + 8 * half;
            if from >= b + len {
                break;
            }
            let mut t8 = [[_mm256_setzero_ps(); 8]; G];
            for i in 0..8.min(b + len - from) {
                let p = from + i;
                if p + AHEAD < n {
                    prefetch_row::<NV, Q8>(rows.k(p + AHEAD));
                    prefetch_row::<NV, Q8>(rows.v(p + AHEAD));
                }
                let k = rows.k(p);
                let mut lo = [_mm256_setzero_ps(); G];
                let mut hi = [_mm256_setzero_ps(); G];
                // tinyBLAS: lane l of 16 chains k·q over the 16-value chunks.
                for c in 0..NV / 2 {
                    let (k_lo, k_hi) = (load8::<Q8>(k, 2 * c), load8::<Q8>(k, 2 * c + 1));
                    for g in 0..G {
                        lo[g] = _mm256_fmadd_ps(qv[g][2 * c], k_lo, lo[g]);
                        hi[g] = _mm256_fmadd_ps(qv[g][2 * c + 1], k_hi, hi[g]);
                    }
                }
                for g in 0..G {
                    // reduce16's first step: lanes l + 8 and l.
                    t8[g][i] = _mm256_add_ps(hi[g], lo[g]);
                }
            }
            for g in 0..G {
                let scores = _mm256_mul_ps(finish8(&t8[g]), vscale);
                let mut tmp = [0f32; 8];
                _mm256_storeu_ps(tmp.as_mut_ptr(), scores);
                let valid = 8.min(b + len - from);
                s[g][8 * half..8 * half + valid].copy_from_slice(&tmp[..valid]);
            }
        }
        // Each head's online softmax step, as the twin.
        let mut p = [[0f32; 16]; G];
        for g in 0..G {
            let block_max = s[g].iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            if block_max > max[g] {
                if max[g] != f32::NEG_INFINITY {
                    let c = expf(max[g] - block_max);
                    for j in 0..NV {
                        let a = acc.add(g * hd + 8 * j);
                        _mm256_storeu_ps(a, _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_set1_ps(c)));
                    }
                    sum[g] *= c;
                }
                max[g] = block_max;
            }
            let m = _mm256_set1_ps(max[g]);
            for h in 0..2 {
                let e = expf8(_mm256_sub_ps(_mm256_loadu_ps(s[g].as_ptr().add(8 * h)), m));
                _mm256_storeu_ps(p[g].as_mut_ptr().add(8 * h), e);
            }
            p[g][len..].fill(0.0);
            sum[g] += reduce16(_mm256_loadu_ps(p[g].as_ptr()), _mm256_loadu_ps(p[g].as_ptr().add(8)));
        }
        // The block's V rows into every head's accumulators, `W` vectors of dimensions at a
        // time (as many as keep the group's accumulators and weights in registers).
        const fn width(g: usize, nv: usize) -> usize {
            let w = if g == 1 { 8 } else if g == 2 { 4 } else if g <= 4 { 2 } else { 1 };
            if w < nv { w } else { nv }
        }
        let w_vecs = const { width(G, NV) };
        for chunk in 0..NV / w_vecs {
            let at = |g: usize, c: usize| acc.add(g * hd + 8 * (chunk * w_vecs + c));
            let mut a = [[_mm256_setzero_ps(); 8]; G];
            for g in 0..G {
                for c in 0..w_vecs {
                    a[g][c] = _mm256_loadu_ps(at(g, c));
                }
            }
            for i in 0..len {
                let row = rows.v(b + i);
                let w: [__m256; G] = std::array::from_fn(|g| _mm256_set1_ps(p[g][i]));
                for c in 0..w_vecs {
                    let v = load8::<Q8>(row, chunk * w_vecs + c);
                    for g in 0..G {
                        a[g][c] = _mm256_fmadd_ps(v, w[g], a[g][c]);
                    }
                }
            }
            for g in 0..G {
                for c in 0..w_vecs {
                    _mm256_storeu_ps(at(g, c), a[g][c]);
                }
            }
        }
    }
    for g in 0..G {
        let inv = _mm256_set1_ps(1.0 / sum[g]);
        for j in 0..NV {
            _mm256_storeu_ps(out.as_mut_ptr().add(g * hd + 8 * j), _mm256_mul_ps(_mm256_loadu_ps(acc.add(g * hd + 8 * j)), inv));
        }
        lse[g] = (max[g] as f64 + (sum[g] as f64).ln()) as f32;
    }
}

/// The group's queries (`[G][8 * NV]`) rounded to f16 (ggml converts Q for the product), widened.
#[inline(always)]
unsafe fn rounded_q<const G: usize, const NV: usize>(q: &[f32]) -> [[__m256; NV]; G] {
    let mut qv = [[_mm256_setzero_ps(); NV]; G];
    for (g, qg) in qv.iter_mut().enumerate() {
        for (j, v) in qg.iter_mut().enumerate() {
            let x = _mm256_loadu_ps(q.as_ptr().add(g * 8 * NV + 8 * j));
            *v = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
        }
    }
    qv
}

/// The rest of `reduce16` for eight positions, from each one's first step (`t[i]`, eight
/// lanes): lane `i` of the result is `(t4[0] + t4[2]) + (t4[1] + t4[3])` of position `i`, where
/// `t4[l] = t[i][l + 4] + t[i][l]`.
#[inline(always)]
unsafe fn finish8(t: &[__m256; 8]) -> __m256 {
    // t4 of positions i (low half) and i + 4 (high half).
    let t4 = |i: usize| _mm256_add_ps(_mm256_permute2f128_ps::<0x31>(t[i], t[i + 4]), _mm256_permute2f128_ps::<0x20>(t[i], t[i + 4]));
    let (a, b, c, d) = (t4(0), t4(1), t4(2), t4(3));
    // Per half: [x0 + x2, x1 + x3] of two positions.
    let ab = _mm256_add_ps(_mm256_shuffle_ps::<0b0100_0100>(a, b), _mm256_shuffle_ps::<0b1110_1110>(a, b));
    let cd = _mm256_add_ps(_mm256_shuffle_ps::<0b0100_0100>(c, d), _mm256_shuffle_ps::<0b1110_1110>(c, d));
    // Per half: (x0 + x2) + (x1 + x3) of positions 0–3 (or 4–7).
    _mm256_add_ps(_mm256_shuffle_ps::<0b1000_1000>(ab, cd), _mm256_shuffle_ps::<0b1101_1101>(ab, cd))
}

/// `ggml_exact::expf` eight lanes at a time (ggml's AVX-512 `ggml_v_expf`; its `vscalefps`,
/// `j · 2^n` rounded once, as the twin's f64 product).
#[inline(always)]
pub(crate) unsafe fn expf8(x: __m256) -> __m256 {
    let c = |bits: u32| _mm256_set1_ps(f32::from_bits(bits));
    let r = c(0x4b40_0000);
    let z = _mm256_fmadd_ps(x, c(0x3fb8_aa3b), r);
    let n = _mm256_sub_ps(z, r);
    let b = _mm256_fnmadd_ps(n, c(0x35bf_be8e), _mm256_fnmadd_ps(n, c(0x3f31_7200), x));
    let u = _mm256_mul_ps(b, b);
    let j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(_mm256_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)), u, _mm256_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb))),
        u,
        _mm256_fmadd_ps(c(0x3f7f_fff6), b, _mm256_set1_ps(1.0)),
    );
    let ni = _mm256_cvtps_epi32(n);
    // Where every lane's n is in −125..=127 (a softmax's weights down to e^−86), j · 2^n is
    // a normal f32: the product with 2^n is exact, as the twin's f64 product rounded once.
    let in_range = _mm256_and_si256(_mm256_cmpgt_epi32(ni, _mm256_set1_epi32(-126)), _mm256_cmpgt_epi32(_mm256_set1_epi32(128), ni));
    if _mm256_movemask_ps(_mm256_castsi256_ps(in_range)) == 0xFF {
        return _mm256_mul_ps(j, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(ni, _mm256_set1_epi32(127)))));
    }
    // Else j · 2^n in f64 (exact), rounded to f32 once; n is integral and, where used, |n| ≤ 192.
    let pow2 = |i: __m128i| _mm256_castsi256_pd(_mm256_slli_epi64::<52>(_mm256_add_epi64(_mm256_cvtepi32_epi64(i), _mm256_set1_epi64x(1023))));
    let lo = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(j)), pow2(_mm256_castsi256_si128(ni)));
    let hi = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(j)), pow2(_mm256_extracti128_si256::<1>(ni)));
    let res = _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo));
    let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
    let big = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(192.0));
    if _mm256_movemask_ps(big) == 0 {
        return res;
    }
    // Beyond: 0 where n ≤ 0, else infinity.
    let alt = _mm256_blendv_ps(_mm256_set1_ps(f32::INFINITY), _mm256_setzero_ps(), _mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps()));
    _mm256_blendv_ps(res, alt, big)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `expf8` is `ggml_exact::expf` lane by lane, bit for bit: across the range, where the
    /// results are subnormal or overflow, and at ±∞ and NaN.
    #[test]
    fn expf8_equals_the_scalar_twin() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")) {
            return println!("SKIPPED: this CPU has no AVX2");
        }
        let mut xs: Vec<f32> = (-2_000_000..2_000_000).map(|i| i as f32 * 6.0e-5).collect();
        xs.extend((0..100_000).map(|i| -87.0 - i as f32 * 2.0e-4));
        xs.extend([f32::NEG_INFINITY, f32::INFINITY, f32::NAN, -0.0, 0.0, 88.72, 88.73, -103.97, -104.0, 1e30, -1e30]);
        while !xs.len().is_multiple_of(8) {
            xs.push(0.5);
        }
        for x in xs.chunks_exact(8) {
            let mut got = [0f32; 8];
            // SAFETY: AVX2, FMA and F16C were detected.
            unsafe {
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn run(x: &[f32], out: &mut [f32; 8]) {
                    _mm256_storeu_ps(out.as_mut_ptr(), expf8(_mm256_loadu_ps(x.as_ptr())));
                }
                run(x, &mut got)
            };
            for (&x, g) in x.iter().zip(got) {
                let want = expf(x);
                assert!(g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()), "expf8({x:e}) = {g:e}, twin {want:e}");
            }
        }
    }
}
