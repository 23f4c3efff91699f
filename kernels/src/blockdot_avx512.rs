//! AVX-512 dot products of one weight row with one activation row for the block types whose
//! AVX2 kernels (`blockdot_avx2`, or none) are slower — the k-quants Q4_K, Q5_K, Q6_K (with Q8_K activations;
//! most published GGUF models), Q5_0, Q5_1, and F32 / F16 / BF16 (ggml's x86 lane orders) — bit-identical to
//! the scalar twins in `dot.rs`:
//! each block's integer sums are computed with vector byte products (VNNI's `vpdpbusd` where
//! present) — integers, the same in any order — and the float epilogue of each block and the
//! sum over blocks are the scalar code's own.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::blockdot_avx2::{k4_block, prefetch_block};
use super::matvec_avx512::dot_u8i8;
// The kernels' f16 scales: no call, no false dependency.
use super::simd_x86::f16c_to_f32 as f16_bytes;
use super::quant::{BlockQ4K, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, BlockQ8_1, ByteBlock};

#[inline(always)]
unsafe fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}


/// `Σ_j sc_j · Σ_l q_j[l] · y_j[l]` of one Q4_K block (the scalar twin's `sum_sc`).
#[inline(always)]
unsafe fn q4k_sum_sc<const VNNI: bool>(x: &BlockQ4K, y: &BlockQ8K, sc: u64) -> i32 {
    let mask = _mm256_set1_epi8(0x0F);
    let scv = _mm_cvtsi64_si128(sc as i64);
    let mut acc = _mm512_setzero_si512();
    for i in 0..4 {
        let raw = _mm256_loadu_si256(x.qs.as_ptr().add(32 * i).cast());
        let u = join(_mm256_and_si256(raw, mask), _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask));
        let yv = _mm512_loadu_si512(y.qs.as_ptr().add(64 * i).cast());
        // Lanes 0–7: sub-block 2i, lanes 8–15: sub-block 2i + 1.
        let idx = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        let s = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(scv, _mm_add_epi8(idx, _mm_set1_epi8(2 * i as i8))));
        acc = _mm512_add_epi32(acc, _mm512_mullo_epi32(dot_u8i8::<VNNI>(u, yv), s));
    }
    _mm512_reduce_add_epi32(acc)
}

#[inline(always)]
unsafe fn dot_q4k_body<const VNNI: bool>(w: &[u8], a: &[u8]) -> f32 {
    k_blocks_sum(w, a, |x: &BlockQ4K, y| k4_block(x.d, x.dmin, &x.scales, y, |sc| q4k_sum_sc::<VNNI>(x, y, sc)))
}

/// `Σ block(x, y)` over the weight blocks `x` of `w` and the Q8_K blocks `y` of `a`, in order
/// (the twin's `sum()`), each weight block prefetched ahead ([`prefetch_block`]).
#[inline(always)]
unsafe fn k_blocks_sum<B: ByteBlock>(w: &[u8], a: &[u8], block: impl Fn(&B, &BlockQ8K) -> f32) -> f32 {
    let (xs, ys) = (B::slice(w).unwrap(), BlockQ8K::slice(a).unwrap());
    xs.iter()
        .zip(ys)
        .map(|(x, y)| {
            prefetch_block(x);
            block(x, y)
        })
        .sum()
}

/// `Σ_j sc_j · Σ_l q_j[l] · y_j[l]` of one Q5_K block: Q4_K's nibbles with a fifth bit,
/// bit `j` of `qh[l]` for sub-block `j`.
#[inline(always)]
unsafe fn q5k_sum_sc<const VNNI: bool>(x: &BlockQ5K, y: &BlockQ8K, sc: u64) -> i32 {
    let mask = _mm256_set1_epi8(0x0F);
    let bit4 = _mm256_set1_epi8(0x10);
    let qh = _mm256_loadu_si256(x.qh.as_ptr().cast());
    let scv = _mm_cvtsi64_si128(sc as i64);
    let mut acc = _mm512_setzero_si512();
    for i in 0..4 {
        let raw = _mm256_loadu_si256(x.qs.as_ptr().add(32 * i).cast());
        let h_lo = _mm256_maskz_mov_epi8(_mm256_test_epi8_mask(qh, _mm256_set1_epi8((1u8 << (2 * i)) as i8)), bit4);
        let h_hi = _mm256_maskz_mov_epi8(_mm256_test_epi8_mask(qh, _mm256_set1_epi8((1u8 << (2 * i + 1)) as i8)), bit4);
        let lo = _mm256_or_si256(_mm256_and_si256(raw, mask), h_lo);
        let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask), h_hi);
        let yv = _mm512_loadu_si512(y.qs.as_ptr().add(64 * i).cast());
        let idx = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        let s = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(scv, _mm_add_epi8(idx, _mm_set1_epi8(2 * i as i8))));
        acc = _mm512_add_epi32(acc, _mm512_mullo_epi32(dot_u8i8::<VNNI>(join(lo, hi), yv), s));
    }
    _mm512_reduce_add_epi32(acc)
}

#[inline(always)]
unsafe fn dot_q5k_body<const VNNI: bool>(w: &[u8], a: &[u8]) -> f32 {
    k_blocks_sum(w, a, |x: &BlockQ5K, y| k4_block(x.d, x.dmin, &x.scales, y, |sc| q5k_sum_sc::<VNNI>(x, y, sc)))
}

/// The 32 five-bit quants of a Q5_0/Q5_1 block (0..31, `q5_values`' order: low nibbles, then
/// high nibbles, bit `k` of `qh` on quant `k`).
#[inline(always)]
unsafe fn q5_bytes(qh: [u8; 4], qs: &[u8; 16]) -> __m256i {
    let raw = _mm_loadu_si128(qs.as_ptr().cast());
    let nib = _mm256_and_si256(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(raw), _mm_srli_epi16::<4>(raw)), _mm256_set1_epi8(0x0F));
    _mm256_or_si256(nib, _mm256_maskz_mov_epi8(u32::from_le_bytes(qh), _mm256_set1_epi8(0x10)))
}

/// Sum of products of unsigned bytes `u` and signed bytes `s` (32 of each).
#[inline(always)]
unsafe fn sum_u8i8_256<const VNNI: bool>(u: __m256i, s: __m256i) -> i32 {
    let v = if VNNI {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
    } else {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
    };
    let v = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b01_00_11_10>(v));
    _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32::<0b10_11_00_01>(v)))
}

/// `Σ u·s` of the 32 bytes of two blocks at once, `u` unsigned and `s` signed, block A in
/// the low halves: one 512-bit product, its halves reduced together (integers: any order).
#[inline(always)]
unsafe fn sums_u8i8_pair(v: __m512i) -> (i32, i32) {
    // Each 128-bit quarter summed into all its lanes; A is quarters 0 + 1, B quarters 2 + 3.
    let t = _mm512_add_epi32(v, _mm512_shuffle_epi32::<0b0100_1110>(v));
    let t = _mm512_add_epi32(t, _mm512_shuffle_epi32::<0b1011_0001>(t));
    let lo = _mm_add_epi32(_mm512_castsi512_si128(t), _mm512_extracti32x4_epi32::<1>(t));
    let hi = _mm_add_epi32(_mm512_extracti32x4_epi32::<2>(t), _mm512_extracti32x4_epi32::<3>(t));
    (_mm_cvtsi128_si32(lo), _mm_cvtsi128_si32(hi))
}

/// Q5_0 · Q8_0, the integer sums `Σ (q − 16)·y` two blocks at a time (one 512-bit product
/// each for `Σ q·y` and `Σ y`, their halves reduced together), the blocks' values added in
/// order from the start value of the scalar twin's `.sum()`. (Q5_1 has one product per block
/// and pairing its blocks measured slower: 22.7–22.9 → 14.5–16.1 GB/s.)
#[inline(always)]
unsafe fn dot_q5_0_body<const VNNI: bool>(w: &[u8], a: &[u8]) -> f32 {
    // No closures here: a closure LLVM does not inline runs without the kernel's target
    // features, and its intrinsics become calls (a version with two closures ran at 13 GB/s).
    // `#[inline(always)]` helpers are inlined for sure (the F16/BF16 kernels use them too).
    let (xs, ys) = (BlockQ5_0::slice(w).unwrap(), BlockQ8_0::slice(a).unwrap());
    let n = xs.len().min(ys.len());
    let ones = _mm256_set1_epi8(1);
    let mut total: f32 = std::iter::empty::<f32>().sum();
    let mut i = 0;
    while i + 1 < n {
        let (x0, x1, y0, y1) = (&xs[i], &xs[i + 1], &ys[i], &ys[i + 1]);
        let y = join(_mm256_loadu_si256(y0.qs.as_ptr().cast()), _mm256_loadu_si256(y1.qs.as_ptr().cast()));
        let qy = dot_u8i8::<VNNI>(join(q5_bytes(x0.qh, &x0.qs), q5_bytes(x1.qh, &x1.qs)), y);
        let (s0, s1) = sums_u8i8_pair(_mm512_sub_epi32(qy, _mm512_slli_epi32::<4>(dot_u8i8::<VNNI>(join(ones, ones), y))));
        total += s0 as f32 * (f16_bytes(x0.d) * f16_bytes(y0.d));
        total += s1 as f32 * (f16_bytes(x1.d) * f16_bytes(y1.d));
        i += 2;
    }
    if i < n {
        let (x, y) = (&xs[i], &ys[i]);
        let yv = _mm256_loadu_si256(y.qs.as_ptr().cast());
        let sumi = sum_u8i8_256::<VNNI>(q5_bytes(x.qh, &x.qs), yv) - 16 * sum_u8i8_256::<VNNI>(ones, yv);
        total += sumi as f32 * (f16_bytes(x.d) * f16_bytes(y.d));
    }
    total
}

#[inline(always)]
unsafe fn dot_q5_1_body<const VNNI: bool>(w: &[u8], a: &[u8]) -> f32 {
    let (xs, ys) = (BlockQ5_1::slice(w).unwrap(), BlockQ8_1::slice(a).unwrap());
    xs.iter()
        .zip(ys)
        .map(|(x, y)| {
            let sumi = sum_u8i8_256::<VNNI>(q5_bytes(x.qh, &x.qs), _mm256_loadu_si256(y.qs.as_ptr().cast()));
            (f16_bytes(x.d) * f16_bytes(y.d)) * sumi as f32 + f16_bytes(x.m) * f16_bytes(y.s)
        })
        .sum()
}

/// `Σ_j scales_j · Σ_l q_j[l] · y_j[l]` of one Q6_K block (the scalar twin's `sumi`), with
/// the quants offset to 0..63 for the unsigned byte product and the offset taken back through
/// the activation block sums.
#[inline(always)]
unsafe fn q6k_sumi<const VNNI: bool>(x: &BlockQ6K, y: &BlockQ8K) -> i32 {
    let m4 = _mm256_set1_epi8(0x0F);
    let scv = _mm_loadu_si128(x.scales.as_ptr().cast());
    let mut acc = _mm512_setzero_si512();
    for n in 0..2 {
        let ql0 = _mm256_loadu_si256(x.ql.as_ptr().add(64 * n).cast());
        let ql1 = _mm256_loadu_si256(x.ql.as_ptr().add(64 * n + 32).cast());
        let qh = _mm256_loadu_si256(x.qh.as_ptr().add(32 * n).cast());
        let a = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16::<4>(_mm256_and_si256(qh, _mm256_set1_epi8(0x03))));
        let b = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_slli_epi16::<2>(_mm256_and_si256(qh, _mm256_set1_epi8(0x0C))));
        let c = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4), _mm256_and_si256(qh, _mm256_set1_epi8(0x30)));
        let d = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
            _mm256_srli_epi16::<2>(_mm256_and_si256(qh, _mm256_set1_epi8(0xC0u8 as i8))),
        );
        let y1 = _mm512_loadu_si512(y.qs.as_ptr().add(128 * n).cast());
        let y2 = _mm512_loadu_si512(y.qs.as_ptr().add(128 * n + 64).cast());
        // Four lanes per group of 16 positions: groups 8n..8n+3, then 8n+4..8n+7.
        let base = 8 * n as i8;
        let idx1 = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        let s1 = _mm512_cvtepi8_epi32(_mm_shuffle_epi8(scv, _mm_add_epi8(idx1, _mm_set1_epi8(base))));
        let s2 = _mm512_cvtepi8_epi32(_mm_shuffle_epi8(scv, _mm_add_epi8(idx1, _mm_set1_epi8(base + 4))));
        acc = _mm512_add_epi32(acc, _mm512_mullo_epi32(dot_u8i8::<VNNI>(join(a, b), y1), s1));
        acc = _mm512_add_epi32(acc, _mm512_mullo_epi32(dot_u8i8::<VNNI>(join(c, d), y2), s2));
    }
    let offset: i32 = (0..16).map(|j| x.scales[j] as i8 as i32 * y.bsum(j)).sum();
    _mm512_reduce_add_epi32(acc) - 32 * offset
}

#[inline(always)]
unsafe fn dot_q6k_body<const VNNI: bool>(w: &[u8], a: &[u8]) -> f32 {
    let (xs, ys) = (BlockQ6K::slice(w).unwrap(), BlockQ8K::slice(a).unwrap());
    xs.iter().zip(ys).map(|(x, y)| f16_bytes(x.d) * y.scale() * q6k_sumi::<VNNI>(x, y) as f32).sum()
}

/// F16 · F16 as ggml's x86 `ggml_vec_dot_f16` ([`ggml_exact::dot_f16`](super::ggml_exact::dot_f16),
/// the dot product of attention's Q·K too): [`fma_lanes64`], then the rest added in f64.
/// (`VNNI` is unused here and in the F32 and BF16 bodies: no byte products.)
#[inline(always)]
unsafe fn dot_f16_body<const VNNI: bool>(w: &[u8], a: &[u8]) -> f32 {
    let n = w.len().min(a.len()) / 2;
    let mut sum = fma_lanes64::<false>(w.as_ptr(), a.as_ptr(), n & !63) as f64;
    for i in n & !63..n {
        sum += (f16_bytes([w[2 * i], w[2 * i + 1]]) * f16_bytes([a[2 * i], a[2 * i + 1]])) as f64;
    }
    sum as f32
}

/// F32 · F32 as ggml's x86 `ggml_vec_dot_f32` ([`ggml_exact::dot_f32`](super::ggml_exact::dot_f32)):
/// [`fma_lanes64`], then the rest added in f32.
#[inline(always)]
unsafe fn dot_f32_body<const VNNI: bool>(w: &[u8], a: &[u8]) -> f32 {
    let n = w.len().min(a.len()) / 4;
    let mut sum = fma_lanes64::<true>(w.as_ptr(), a.as_ptr(), n & !63);
    let (wp, ap) = (w.as_ptr() as *const f32, a.as_ptr() as *const f32);
    for i in n & !63..n {
        sum += wp.add(i).read_unaligned() * ap.add(i).read_unaligned();
    }
    sum
}

/// The first `np` (a multiple of 64) elements of two F32 (`F32`) or F16 rows: fused
/// multiply-adds into 64 lanes (four registers), reduced by `reduce64`'s tree (0 if `np` is 0).
#[inline(always)]
unsafe fn fma_lanes64<const F32: bool>(w: *const u8, a: *const u8, np: usize) -> f32 {
    let elem = if F32 { 4 } else { 2 };
    let mut acc = [_mm512_setzero_ps(); 4];
    for i in (0..np).step_by(64) {
        // One stream per row, prefetched as the quantised kernels do.
        _mm_prefetch::<_MM_HINT_T0>(w.add(i * elem).wrapping_add(super::matvec_avx512::LINEAR_AHEAD).cast());
        _mm_prefetch::<_MM_HINT_T0>(w.add((i + 32) * elem).wrapping_add(super::matvec_avx512::LINEAR_AHEAD).cast());
        for (j, acc_j) in acc.iter_mut().enumerate() {
            let at = (i + 16 * j) * elem;
            *acc_j = _mm512_fmadd_ps(load16::<F32>(w.add(at)), load16::<F32>(a.add(at)), *acc_j);
        }
    }
    if np == 0 {
        return 0.0;
    }
    // reduce64: h[l] = (acc[l] + acc[l + 32]) + (acc[l + 16] + acc[l + 48]).
    super::attention_avx512::reduce16(_mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3])))
}

/// Sixteen f32 (`F32`) or f16 values at `p`, as f32.
#[inline(always)]
unsafe fn load16<const F32: bool>(p: *const u8) -> __m512 {
    if F32 {
        _mm512_loadu_ps(p.cast())
    } else {
        widen_f16(p.cast())
    }
}

/// Sixteen f16 values at `p` widened to f32.
#[inline(always)]
unsafe fn widen_f16(p: *const __m256i) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p))
}

/// Sixteen bf16 values at `p` widened to f32 (a shift: bf16 is f32's upper half).
#[inline(always)]
unsafe fn widen_bf16(p: *const u8) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()))))
}

/// BF16 · BF16 as ggml's AVX-512F `ggml_vec_dot_bf16` (the scalar twin's order): two 16-lane
/// accumulators over steps of 32 elements (widened by a shift, multiplied, then added), each
/// reduced by `_mm512_reduce_add_ps`'s tree into an f64 sum, the rest added in f64.
#[inline(always)]
unsafe fn dot_bf16_body<const VNNI: bool>(w: &[u8], a: &[u8]) -> f32 {
    let n = w.len().min(a.len()) / 2;
    let n32 = n & !31;
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let (mut c1, mut c2) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    for i in (0..n32).step_by(32) {
        _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(2 * i + super::matvec_avx512::LINEAR_AHEAD).cast());
        c1 = _mm512_add_ps(_mm512_mul_ps(widen_bf16(wp.add(2 * i)), widen_bf16(ap.add(2 * i))), c1);
        c2 = _mm512_add_ps(_mm512_mul_ps(widen_bf16(wp.add(2 * i + 32)), widen_bf16(ap.add(2 * i + 32))), c2);
    }
    let mut sum = super::attention_avx512::reduce16(c1) as f64;
    sum += super::attention_avx512::reduce16(c2) as f64;
    let bf = |b: &[u8], i: usize| half::bf16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32();
    for i in n32..n {
        sum += (bf(w, i) * bf(a, i)) as f64;
    }
    sum as f32
}

macro_rules! block_fn {
    ($name:ident, $body:ident, $vnni:expr, $features:literal, $doc:literal) => {
        #[doc = $doc]
        ///
        /// # Safety
        /// The CPU features named in `target_feature`; `w` and `a` whole blocks of the same count.
        #[target_feature(enable = $features)]
        pub unsafe fn $name(w: &[u8], a: &[u8]) -> f32 {
            $body::<$vnni>(w, a)
        }
    };
}

block_fn!(dot_q4k_q8k, dot_q4k_body, false, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c", "Q4_K · Q8_K.");
block_fn!(dot_q4k_q8k_vnni, dot_q4k_body, true, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", "Q4_K · Q8_K with `vpdpbusd`.");
block_fn!(dot_q6k_q8k, dot_q6k_body, false, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c", "Q6_K · Q8_K.");
block_fn!(dot_q6k_q8k_vnni, dot_q6k_body, true, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", "Q6_K · Q8_K with `vpdpbusd`.");
block_fn!(dot_q5k_q8k, dot_q5k_body, false, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c", "Q5_K · Q8_K.");
block_fn!(dot_q5k_q8k_vnni, dot_q5k_body, true, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", "Q5_K · Q8_K with `vpdpbusd`.");
block_fn!(dot_q5_0_q8_0, dot_q5_0_body, false, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c", "Q5_0 · Q8_0.");
block_fn!(dot_q5_0_q8_0_vnni, dot_q5_0_body, true, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", "Q5_0 · Q8_0 with `vpdpbusd`.");
block_fn!(dot_q5_1_q8_1, dot_q5_1_body, false, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c", "Q5_1 · Q8_1.");
block_fn!(dot_q5_1_q8_1_vnni, dot_q5_1_body, true, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", "Q5_1 · Q8_1 with `vpdpbusd`.");
block_fn!(dot_f32_f32, dot_f32_body, false, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c", "F32 · F32.");
block_fn!(dot_f16_f16, dot_f16_body, false, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c", "F16 · F16.");
block_fn!(dot_bf16_bf16, dot_bf16_body, false, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c", "BF16 · BF16.");
