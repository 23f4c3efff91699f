//! AVX2 (+FMA) dot products for the weight types of the default model (Q4_0, Q4_1, Q8_0),
//! and the F16C widening of f16 KV rows.
//!
//! Same arithmetic as ggml's AVX2 path: integer products per block with `maddubs`, scaled and
//! accumulated in f32 lanes. Each is tested against its scalar twin in `dot.rs`.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::quant::{BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1, ByteBlock};

/// f16 bytes to f32 with F16C, for the kernels' per-block scales (every f16 is exact in f32).
///
/// Written in `asm!` so that the register is written whole (`vmovd`): from intrinsics
/// (`_mm_cvtsi32_si128`, `_mm_set1_epi16`) LLVM, seeing one 16-bit lane used, made a
/// `vpinsrw` into whatever register it liked — the loop's accumulator — which chained every
/// block of a dot product to the one before (4.9 ns a Q4_0 block); `half`'s conversion is a
/// call through a pointer in a kernel's loop (every vector register spilled around it).
///
/// # Safety
/// The CPU must have F16C.
#[inline(always)]
pub(crate) unsafe fn f16c_to_f32(b: [u8; 2]) -> f32 {
    let out: f32;
    std::arch::asm!(
        "vmovd {v}, {x:e}",
        "vcvtph2ps {v}, {v}",
        x = in(reg) u16::from_le_bytes(b) as u32,
        v = out(xmm_reg) out,
        options(pure, nomem, nostack, preserves_flags),
    );
    out
}

#[inline(always)]
unsafe fn hsum_ps(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// 16 bytes of packed nibbles to 32 bytes: low nibbles first, then high nibbles.
#[inline(always)]
unsafe fn nibbles_to_bytes(qs: &[u8; 16]) -> __m256i {
    let tmp = _mm_loadu_si128(qs.as_ptr().cast());
    let both = _mm256_insertf128_si256(_mm256_castsi128_si256(tmp), _mm_srli_epi16(tmp, 4), 1);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

/// Sum of products of unsigned bytes `ux` and signed bytes `sy`, as 8 f32 lanes.
#[inline(always)]
unsafe fn mul_sum_us8_pairs(ux: __m256i, sy: __m256i) -> __m256 {
    let dot16 = _mm256_maddubs_epi16(ux, sy);
    _mm256_cvtepi32_ps(_mm256_madd_epi16(dot16, _mm256_set1_epi16(1)))
}

/// Sum of products of two signed byte vectors, as 8 f32 lanes.
#[inline(always)]
unsafe fn mul_sum_i8_pairs(x: __m256i, y: __m256i) -> __m256 {
    let ax = _mm256_sign_epi8(x, x);
    let sy = _mm256_sign_epi8(y, x);
    mul_sum_us8_pairs(ax, sy)
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` and `a` whole blocks of the same count.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let (x, y) = (BlockQ4_0::slice(w).unwrap(), BlockQ8_0::slice(a).unwrap());
    let mut acc = _mm256_setzero_ps();
    for (x, y) in x.iter().zip(y) {
        let d = _mm256_set1_ps(f16c_to_f32(x.d) * f16c_to_f32(y.d));
        let qx = _mm256_sub_epi8(nibbles_to_bytes(&x.qs), _mm256_set1_epi8(8));
        let qy = _mm256_loadu_si256(y.qs.as_ptr().cast());
        acc = _mm256_fmadd_ps(d, mul_sum_i8_pairs(qx, qy), acc);
    }
    hsum_ps(acc)
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` and `a` whole blocks of the same count.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_1_q8_1(w: &[u8], a: &[u8]) -> f32 {
    let (x, y) = (BlockQ4_1::slice(w).unwrap(), BlockQ8_1::slice(a).unwrap());
    let mut acc = _mm256_setzero_ps();
    let mut summs = 0f32;
    for (x, y) in x.iter().zip(y) {
        summs += f16c_to_f32(x.m) * f16c_to_f32(y.s);
        let d = _mm256_set1_ps(f16c_to_f32(x.d) * f16c_to_f32(y.d));
        let qx = nibbles_to_bytes(&x.qs);
        let qy = _mm256_loadu_si256(y.qs.as_ptr().cast());
        acc = _mm256_fmadd_ps(d, mul_sum_us8_pairs(qx, qy), acc);
    }
    hsum_ps(acc) + summs
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` and `a` whole blocks of the same count.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q8_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let (x, y) = (BlockQ8_0::slice(w).unwrap(), BlockQ8_0::slice(a).unwrap());
    let mut acc = _mm256_setzero_ps();
    for (x, y) in x.iter().zip(y) {
        let d = _mm256_set1_ps(f16c_to_f32(x.d) * f16c_to_f32(y.d));
        let qx = _mm256_loadu_si256(x.qs.as_ptr().cast());
        let qy = _mm256_loadu_si256(y.qs.as_ptr().cast());
        acc = _mm256_fmadd_ps(d, mul_sum_i8_pairs(qx, qy), acc);
    }
    hsum_ps(acc)
}

/// Four activation rows against one Q4_1 weight row, each with exactly the arithmetic of
/// [`dot_q4_1_q8_1`]; the weight block is unpacked once for all four.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; every row whole blocks of the same count.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_1_q8_1_x4(w: &[u8], a: [&[u8]; 4]) -> [f32; 4] {
    let x = BlockQ4_1::slice(w).unwrap();
    let y = [0, 1, 2, 3].map(|r| BlockQ8_1::slice(a[r]).unwrap());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut summs = [0f32; 4];
    for (b, x) in x.iter().enumerate() {
        let (dx, mx) = (f16c_to_f32(x.d), f16c_to_f32(x.m));
        let qx = nibbles_to_bytes(&x.qs);
        for r in 0..4 {
            let y = &y[r][b];
            summs[r] += mx * f16c_to_f32(y.s);
            let d = _mm256_set1_ps(dx * f16c_to_f32(y.d));
            let qy = _mm256_loadu_si256(y.qs.as_ptr().cast());
            acc[r] = _mm256_fmadd_ps(d, mul_sum_us8_pairs(qx, qy), acc[r]);
        }
    }
    [hsum_ps(acc[0]) + summs[0], hsum_ps(acc[1]) + summs[1], hsum_ps(acc[2]) + summs[2], hsum_ps(acc[3]) + summs[3]]
}

/// Four activation rows against one Q8_0 weight row, each exactly as [`dot_q8_0_q8_0`].
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; every row whole blocks of the same count.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q8_0_q8_0_x4(w: &[u8], a: [&[u8]; 4]) -> [f32; 4] {
    let x = BlockQ8_0::slice(w).unwrap();
    let y = [0, 1, 2, 3].map(|r| BlockQ8_0::slice(a[r]).unwrap());
    let mut acc = [_mm256_setzero_ps(); 4];
    for (b, x) in x.iter().enumerate() {
        let dx = f16c_to_f32(x.d);
        let qx = _mm256_loadu_si256(x.qs.as_ptr().cast());
        let ax = _mm256_sign_epi8(qx, qx);
        for r in 0..4 {
            let y = &y[r][b];
            let d = _mm256_set1_ps(dx * f16c_to_f32(y.d));
            let qy = _mm256_loadu_si256(y.qs.as_ptr().cast());
            acc[r] = _mm256_fmadd_ps(d, mul_sum_us8_pairs(ax, _mm256_sign_epi8(qy, qx)), acc[r]);
        }
    }
    [hsum_ps(acc[0]), hsum_ps(acc[1]), hsum_ps(acc[2]), hsum_ps(acc[3])]
}

/// `dst[i] = src[i]` widened from f16 (exact), eight at a time with F16C; the tail one by one.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn widen_f16(src: &[half::f16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n keeps both 8-element accesses in bounds; f16 is 2 bytes.
        let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
        _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        i += 8;
    }
    for j in i..n {
        dst[j] = src[j].to_f32();
    }
}

/// `widen_q8_0`'s AVX2 path: each block's 32 bytes widened to f32 eight at a time and
/// multiplied by its scale (exact: an f16 times a byte fits f32's mantissa).
///
/// # Safety
/// AVX2 and F16C; `src` whole 34-byte blocks and `dst` 32 values per block.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn widen_q8_0(src: &[u8], dst: &mut [f32]) {
    for (b, out) in src.chunks_exact(34).zip(dst.chunks_exact_mut(32)) {
        let d = _mm256_set1_ps(half::f16::from_le_bytes([b[0], b[1]]).to_f32());
        for j in 0..4 {
            // SAFETY: bytes 2 + 8j .. 10 + 8j of a 34-byte block; out holds 32 values.
            let q = _mm_loadl_epi64(b.as_ptr().add(2 + 8 * j) as *const __m128i);
            let x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
            _mm256_storeu_ps(out.as_mut_ptr().add(8 * j), _mm256_mul_ps(x, d));
        }
    }
}

/// `ggml_exact::dot_f16` for exactly `N` elements (a multiple of 64: heads of 64 and 128), in
/// registers: the fused products into 64 lanes (from zero, as ggml's accumulators start), then
/// `reduce64`'s tree — the same operations in the same order, so the same bits.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f16_lanes<const N: usize>(x: &[f32; N], y: &[f32; N]) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 8];
    for c in (0..N).step_by(64) {
        for (i, a) in acc.iter_mut().enumerate() {
            // SAFETY: both arrays hold N f32, N a multiple of 64.
            *a = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr().add(c + 8 * i)), _mm256_loadu_ps(y.as_ptr().add(c + 8 * i)), *a);
        }
    }
    reduce64(&acc)
}

/// `ggml_exact::dot_tiled` (tinyBLAS's order) for exactly `N` elements (a multiple of 16):
/// sixteen lanes of fused multiply-adds over the 16-element chunks in order, then
/// `reduce16`'s tree — the same operations in the same order, so the same bits.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_tiled_lanes<const N: usize>(x: &[f32; N], y: &[f32; N]) -> f32 {
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for c in (0..N).step_by(16) {
        // SAFETY: both arrays hold N f32, N a multiple of 16.
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr().add(c)), _mm256_loadu_ps(y.as_ptr().add(c)), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr().add(c + 8)), _mm256_loadu_ps(y.as_ptr().add(c + 8)), hi);
    }
    reduce16(lo, hi)
}

/// `ggml_exact::reduce64` of 64 lanes held as eight registers (lanes 8j..8j + 8 in `acc[j]`):
/// h[i] = (acc[i] + acc[i + 32]) + (acc[i + 16] + acc[i + 48]) for i < 16, then [`reduce16`].
#[inline(always)]
pub(crate) unsafe fn reduce64(acc: &[__m256; 8]) -> f32 {
    let h_lo = _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6]));
    let h_hi = _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7]));
    reduce16(h_lo, h_hi)
}

/// `ggml_exact::reduce16` of 16 lanes held as two registers (lanes 0–7, 8–15):
/// t8[i] = h[i + 8] + h[i]; t4[i] = t8[i + 4] + t8[i]; (t4[0] + t4[2]) + (t4[1] + t4[3]).
#[inline(always)]
pub(crate) unsafe fn reduce16(lo: __m256, hi: __m256) -> f32 {
    let t8 = _mm256_add_ps(hi, lo);
    let t4 = _mm_add_ps(_mm256_extractf128_ps(t8, 1), _mm256_castps256_ps128(t8));
    let u = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
    _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)))
}
