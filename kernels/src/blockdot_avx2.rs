//! AVX2 dot products of one weight row with one activation row for the k-quants Q4_K, Q5_K,
//! Q6_K (with Q8_K activations: most published GGUF models), Q5_0, Q5_1 and the floats F32,
//! F16, BF16 (ggml's AVX-512 lane orders, as the twins), for CPUs without
//! AVX-512 (which otherwise ran the scalar twins: the OLMoE shape decoded at a third of
//! llama.cpp's rate on such a machine). Bit-identical to the scalar twins in `dot.rs`: each
//! block's integer sums come from `maddubs`/`madd` byte products — integers, exact in any
//! order (a pair of products stays below `i16::MAX`: quants ≤ 63, activations ≥ −128) — and
//! the float epilogue of each block and the sum over blocks are the scalar code's own.
//!
//! The k-quant helpers the AVX-512 kernels share (the scales' unpacking, the mins against the
//! activation sums, the epilogue, the prefetch) use only AVX2 and live here.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

// The kernels' f16 scales: no call, no false dependency.
use super::simd_x86::{f16c_to_f32 as f16_bytes, reduce16, reduce64};
use super::quant::{BlockQ4K, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, BlockQ8_1, ByteBlock};


/// Prefetches the weight block `LINEAR_AHEAD` bytes past `x` (every line it touches): a
/// matrix's rows are read one after another, one stream, as the quantised kernels read them.
#[inline(always)]
pub(super) unsafe fn prefetch_block<T>(x: &T) {
    let p = (x as *const T).cast::<u8>().wrapping_add(super::matvec_avx512::LINEAR_AHEAD);
    for off in (0..std::mem::size_of::<T>()).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off).cast());
    }
    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(std::mem::size_of::<T>() - 1).cast());
}

/// One Q4_K/Q5_K block's value as the scalar twin computes it: its 6-bit scales and mins
/// decoded, `sum_sc` (the scaled integer dot products, from the eight scales, byte `j` of its
/// argument) and the mins against the activation block sums, then the twin's float epilogue.
#[inline(always)]
pub(super) unsafe fn k4_block(d: [u8; 2], dmin: [u8; 2], scales: &[u8; 12], y: &BlockQ8K, sum_sc: impl FnOnce(u64) -> i32) -> f32 {
    let (sc, mins) = k4_scales_mins(scales);
    let sum_m = k4_sum_m(mins, y);
    k4_epilogue(d, dmin, y, sum_sc(sc), sum_m)
}

/// The scalar twin's float epilogue of a Q4_K/Q5_K block from its two integer sums.
#[inline(always)]
unsafe fn k4_epilogue(d: [u8; 2], dmin: [u8; 2], y: &BlockQ8K, sum_sc: i32, sum_m: i32) -> f32 {
    y.scale() * (f16_bytes(d) * sum_sc as f32) - y.scale() * f16_bytes(dmin) * sum_m as f32
}

/// `Σ_j m_j · (bsum_{2j} + bsum_{2j+1})`, the mins (byte `j` of `mins`) against the activation
/// block's sums of 16, in one `pmaddwd` (each min twice, next to its two sums) and a
/// horizontal add — exact integers, as the twin's loop (a scalar loop here was a third of the
/// block's instructions).
#[inline(always)]
pub(super) unsafe fn k4_sum_m(mins: u64, y: &BlockQ8K) -> i32 {
    let sums = _mm256_loadu_si256(y.bsums.as_ptr().cast());
    let m = _mm_cvtsi64_si128(mins as i64);
    let prod = _mm256_madd_epi16(sums, _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m)));
    hsum_epi32(prod)
}

/// The eight lanes of `v` added (exact integers).
#[inline(always)]
unsafe fn hsum_epi32(v: __m256i) -> i32 {
    let t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
    _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32::<0b01>(t)))
}

/// The eight 6-bit scales and the eight mins of a Q4_K/Q5_K block (sub-block `j` in byte `j`),
/// unpacked in registers as ggml's x86 kernels do (the values of `scale_min_k4`). Built one
/// byte at a time in memory and reloaded as a whole, they stalled every block on a failed
/// store-to-load forward.
#[inline(always)]
pub(super) fn k4_scales_mins(q: &[u8; 12]) -> (u64, u64) {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let word = |i: usize| u32::from_le_bytes([q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]]);
    let (u0, u1, u2) = (word(0), word(1), word(2));
    let scales_hi = (u2 & LOW4) | (((u0 >> 6) & LOW2) << 4);
    let mins_hi = ((u2 >> 4) & LOW4) | (((u1 >> 6) & LOW2) << 4);
    (((scales_hi as u64) << 32) | (u0 & LOW6) as u64, ((mins_hi as u64) << 32) | (u1 & LOW6) as u64)
}

/// `Σ_l u[l]·s[l]` over 32 unsigned bytes `u` (each below 64) and signed bytes `s`, summed in
/// pairs (16 × i16) and then `scale` times each pair sum (8 × i32): every value exact.
#[inline(always)]
unsafe fn scaled_products(u: __m256i, s: __m256i, scale: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale)
}

/// A Q4_K or Q5_K block: the fields the kernels read (a Q5_K block's fifth bits in `qh`).
trait K4Block: ByteBlock {
    fn d(&self) -> [u8; 2];
    fn dmin(&self) -> [u8; 2];
    fn scales(&self) -> &[u8; 12];
    fn qs(&self) -> &[u8; 128];
    fn qh(&self) -> Option<&[u8; 32]>;
}

impl K4Block for BlockQ4K {
    #[inline(always)]
    fn d(&self) -> [u8; 2] {
        self.d
    }
    #[inline(always)]
    fn dmin(&self) -> [u8; 2] {
        self.dmin
    }
    #[inline(always)]
    fn scales(&self) -> &[u8; 12] {
        &self.scales
    }
    #[inline(always)]
    fn qs(&self) -> &[u8; 128] {
        &self.qs
    }
    #[inline(always)]
    fn qh(&self) -> Option<&[u8; 32]> {
        None
    }
}

impl K4Block for BlockQ5K {
    #[inline(always)]
    fn d(&self) -> [u8; 2] {
        self.d
    }
    #[inline(always)]
    fn dmin(&self) -> [u8; 2] {
        self.dmin
    }
    #[inline(always)]
    fn scales(&self) -> &[u8; 12] {
        &self.scales
    }
    #[inline(always)]
    fn qs(&self) -> &[u8; 128] {
        &self.qs
    }
    #[inline(always)]
    fn qh(&self) -> Option<&[u8; 32]> {
        Some(&self.qh)
    }
}

/// Sub-blocks `2i` and `2i + 1` of a Q4_K/Q5_K block as unsigned bytes (with their fifth bits
/// where `x` has them), and their scales (`sc`'s bytes `2i`, `2i + 1`) as i16 in every lane.
#[inline(always)]
unsafe fn k4_sub_blocks<B: K4Block>(x: &B, sc: u64, i: usize) -> (__m256i, __m256i, __m256i, __m256i) {
    let mask = _mm256_set1_epi8(0x0F);
    let raw = _mm256_loadu_si256(x.qs().as_ptr().add(32 * i).cast());
    let mut lo = _mm256_and_si256(raw, mask);
    let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask);
    if let Some(qh) = x.qh() {
        let high = _mm256_loadu_si256(qh.as_ptr().cast());
        lo = _mm256_or_si256(lo, fifth_bits(high, 2 * i));
        hi = _mm256_or_si256(hi, fifth_bits(high, 2 * i + 1));
    }
    // The eight scales as i16 in both halves; sub-block j's broadcast by a byte shuffle.
    let scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
    let s_lo = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(0x0100 + 0x0202 * 2 * i as i16));
    let s_hi = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(0x0100 + 0x0202 * (2 * i as i16 + 1)));
    (lo, hi, s_lo, s_hi)
}

/// `Σ_j sc_j · Σ_l q_j[l] · y_j[l]` of one Q4_K/Q5_K block (the scalar twin's `sum_sc`).
#[inline(always)]
unsafe fn k4_sum_sc<B: K4Block>(x: &B, y: &BlockQ8K, sc: u64) -> i32 {
    let mut acc = _mm256_setzero_si256();
    for i in 0..4 {
        let (lo, hi, s_lo, s_hi) = k4_sub_blocks(x, sc, i);
        let yp = y.qs.as_ptr().add(64 * i).cast::<__m256i>();
        acc = _mm256_add_epi32(acc, scaled_products(lo, _mm256_loadu_si256(yp), s_lo));
        acc = _mm256_add_epi32(acc, scaled_products(hi, _mm256_loadu_si256(yp.add(1)), s_hi));
    }
    hsum_epi32(acc)
}

/// Bit `bit` of each byte of `qh` as 16 (a Q5_K quant's fifth bit), else 0.
#[inline(always)]
unsafe fn fifth_bits(qh: __m256i, bit: usize) -> __m256i {
    let b = _mm256_set1_epi8((1u8 << bit) as i8);
    _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b), b), _mm256_set1_epi8(0x10))
}

// The bodies below are plain loops of `#[inline(always)]` helpers, no closures: a closure
// LLVM does not inline runs without the kernel's target features (see `blockdot_avx512`).
// Their sums start where the twins' `.sum()` does.

/// Q4_K or Q5_K · Q8_K.
#[inline(always)]
unsafe fn dot_k4_body<B: K4Block>(w: &[u8], a: &[u8]) -> f32 {
    let (xs, ys) = (B::slice(w).unwrap(), BlockQ8K::slice(a).unwrap());
    let mut total: f32 = std::iter::empty::<f32>().sum();
    for (x, y) in xs.iter().zip(ys) {
        prefetch_block(x);
        let (sc, mins) = k4_scales_mins(x.scales());
        total += k4_epilogue(x.d(), x.dmin(), y, k4_sum_sc(x, y, sc), k4_sum_m(mins, y));
    }
    total
}

/// `Σ_j scales_j · Σ_l q_j[l] · y_j[l]` of one Q6_K block (the scalar twin's `sumi`), with
/// the quants offset to 0..63 for the unsigned byte product and the offset taken back through
/// the activation block sums.
#[inline(always)]
unsafe fn q6k_sumi(x: &BlockQ6K, y: &BlockQ8K) -> i32 {
    let scv = _mm_loadu_si128(x.scales.as_ptr().cast());
    let mut acc = _mm256_setzero_si256();
    for n in 0..2 {
        let ql0 = _mm256_loadu_si256(x.ql.as_ptr().add(64 * n).cast());
        let ql1 = _mm256_loadu_si256(x.ql.as_ptr().add(64 * n + 32).cast());
        let qh = _mm256_loadu_si256(x.qh.as_ptr().add(32 * n).cast());
        let yp = y.qs.as_ptr().add(128 * n).cast::<__m256i>();
        for k in 0..4 {
            let s = scale_pair(scv, (8 * n + 2 * k) as i8);
            acc = _mm256_add_epi32(acc, scaled_products(q6_quarter(ql0, ql1, qh, k), _mm256_loadu_si256(yp.add(k)), s));
        }
    }
    let offset = hsum_epi32(scaled_bsums(y, _mm256_cvtepi8_epi16(scv)));
    hsum_epi32(acc) - 32 * offset
}

/// `Σ_j scales_j · bsum_j` of a Q6_K block's 16 scales (`wide`, as i16) and an activation
/// block's 16 sums, in one `pmaddwd` (eight lanes to add).
#[inline(always)]
unsafe fn scaled_bsums(y: &BlockQ8K, wide: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_loadu_si256(y.bsums.as_ptr().cast()), wide)
}

/// Scale `g` of `scales` (16 signed bytes) in the low eight i16 lanes, scale `g + 1` in the
/// high eight: the scales of the two groups of 16 one 32-byte product covers.
#[inline(always)]
unsafe fn scale_pair(scales: __m128i, g: i8) -> __m256i {
    let idx = _mm_setr_epi8(g, g, g, g, g, g, g, g, g + 1, g + 1, g + 1, g + 1, g + 1, g + 1, g + 1, g + 1);
    _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, idx))
}

#[inline(always)]
unsafe fn dot_q6k_body(w: &[u8], a: &[u8]) -> f32 {
    let (xs, ys) = (BlockQ6K::slice(w).unwrap(), BlockQ8K::slice(a).unwrap());
    let mut total: f32 = std::iter::empty::<f32>().sum();
    for (x, y) in xs.iter().zip(ys) {
        prefetch_block(x);
        total += f16_bytes(x.d) * y.scale() * q6k_sumi(x, y) as f32;
    }
    total
}

/// The 32 five-bit quants of a Q5_0/Q5_1 block (0..31, `q5_values`' order: low nibbles, then
/// high nibbles, bit `k` of `qh` on quant `k`).
#[inline(always)]
unsafe fn q5_bytes(qh: [u8; 4], qs: &[u8; 16]) -> __m256i {
    let raw = _mm_loadu_si128(qs.as_ptr().cast());
    let nib = _mm256_and_si256(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(raw), _mm_srli_epi16::<4>(raw)), _mm256_set1_epi8(0x0F));
    // Byte k gets byte k / 8 of qh, then its bit k % 8 tested.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(u32::from_le_bytes(qh) as i32),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3),
    );
    let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits);
    _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
}

/// `Σ u·s` of 32 unsigned bytes `u` (each below 64) and signed bytes `s`.
#[inline(always)]
unsafe fn sum_u8i8(u: __m256i, s: __m256i) -> i32 {
    hsum_epi32(scaled_products(u, s, _mm256_set1_epi16(1)))
}

#[inline(always)]
unsafe fn dot_q5_0_body(w: &[u8], a: &[u8]) -> f32 {
    let (xs, ys) = (BlockQ5_0::slice(w).unwrap(), BlockQ8_0::slice(a).unwrap());
    let ones = _mm256_set1_epi8(1);
    let mut total: f32 = std::iter::empty::<f32>().sum();
    for (x, y) in xs.iter().zip(ys) {
        let yv = _mm256_loadu_si256(y.qs.as_ptr().cast());
        let sumi = sum_u8i8(q5_bytes(x.qh, &x.qs), yv) - 16 * sum_u8i8(ones, yv);
        total += sumi as f32 * (f16_bytes(x.d) * f16_bytes(y.d));
    }
    total
}

#[inline(always)]
unsafe fn dot_q5_1_body(w: &[u8], a: &[u8]) -> f32 {
    let (xs, ys) = (BlockQ5_1::slice(w).unwrap(), BlockQ8_1::slice(a).unwrap());
    let mut total: f32 = std::iter::empty::<f32>().sum();
    for (x, y) in xs.iter().zip(ys) {
        let sumi = sum_u8i8(q5_bytes(x.qh, &x.qs), _mm256_loadu_si256(y.qs.as_ptr().cast()));
        total += (f16_bytes(x.d) * f16_bytes(y.d)) * sumi as f32 + f16_bytes(x.m) * f16_bytes(y.s);
    }
    total
}

/// The four lanes' sums of four vectors of eight i32 lanes each (exact integers).
#[inline(always)]
unsafe fn hsum4_epi32(v: [__m256i; 4]) -> [i32; 4] {
    let t = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    let s = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
    [_mm_extract_epi32::<0>(s), _mm_extract_epi32::<1>(s), _mm_extract_epi32::<2>(s), _mm_extract_epi32::<3>(s)]
}

/// [`k4_sum_sc`] of one weight block against four activation blocks, the block unpacked once.
#[inline(always)]
unsafe fn k4_sum_sc_x4<B: K4Block>(x: &B, ys: [&BlockQ8K; 4], sc: u64) -> [i32; 4] {
    let mut acc = [_mm256_setzero_si256(); 4];
    for i in 0..4 {
        let (lo, hi, s_lo, s_hi) = k4_sub_blocks(x, sc, i);
        for r in 0..4 {
            let y = ys[r].qs.as_ptr().add(64 * i).cast::<__m256i>();
            acc[r] = _mm256_add_epi32(acc[r], scaled_products(lo, _mm256_loadu_si256(y), s_lo));
            acc[r] = _mm256_add_epi32(acc[r], scaled_products(hi, _mm256_loadu_si256(y.add(1)), s_hi));
        }
    }
    hsum4_epi32(acc)
}

/// The four activation rows' Q8_K blocks, and the totals' start (the twins' `.sum()`'s).
#[inline(always)]
fn q8k_rows(a: [&[u8]; 4]) -> ([&[BlockQ8K]; 4], [f32; 4]) {
    let start: f32 = std::iter::empty::<f32>().sum();
    (a.map(|a| BlockQ8K::slice(a).unwrap()), [start; 4])
}

/// Q4_K or Q5_K · Q8_K of one weight row against four activation rows.
#[inline(always)]
unsafe fn dot_k4_x4_body<B: K4Block>(w: &[u8], a: [&[u8]; 4]) -> [f32; 4] {
    let (ys, mut totals) = q8k_rows(a);
    for (b, x) in B::slice(w).unwrap().iter().enumerate() {
        prefetch_block(x);
        let y = [&ys[0][b], &ys[1][b], &ys[2][b], &ys[3][b]];
        let (sc, mins) = k4_scales_mins(x.scales());
        let sums = k4_sum_sc_x4(x, y, sc);
        for r in 0..4 {
            totals[r] += k4_epilogue(x.d(), x.dmin(), y[r], sums[r], k4_sum_m(mins, y[r]));
        }
    }
    totals
}

/// Quants 32k..32k + 32 (0..63) of half `(ql0, ql1, qh)` of a Q6_K block (`q6k_values`' order).
#[inline(always)]
unsafe fn q6_quarter(ql0: __m256i, ql1: __m256i, qh: __m256i, k: usize) -> __m256i {
    let m4 = _mm256_set1_epi8(0x0F);
    match k {
        0 => _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16::<4>(_mm256_and_si256(qh, _mm256_set1_epi8(0x03)))),
        1 => _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_slli_epi16::<2>(_mm256_and_si256(qh, _mm256_set1_epi8(0x0C)))),
        2 => _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4), _mm256_and_si256(qh, _mm256_set1_epi8(0x30))),
        _ => _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4), _mm256_srli_epi16::<2>(_mm256_and_si256(qh, _mm256_set1_epi8(0xC0u8 as i8)))),
    }
}

/// [`q6k_sumi`] of one weight block against four activation blocks, the block unpacked once
/// (a quarter of a half at a time, so that the four rows' sums stay in registers).
#[inline(always)]
unsafe fn q6k_sumi_x4(x: &BlockQ6K, ys: [&BlockQ8K; 4]) -> [i32; 4] {
    let scv = _mm_loadu_si128(x.scales.as_ptr().cast());
    let mut acc = [_mm256_setzero_si256(); 4];
    for n in 0..2 {
        let ql0 = _mm256_loadu_si256(x.ql.as_ptr().add(64 * n).cast());
        let ql1 = _mm256_loadu_si256(x.ql.as_ptr().add(64 * n + 32).cast());
        let qh = _mm256_loadu_si256(x.qh.as_ptr().add(32 * n).cast());
        for k in 0..4 {
            let q = q6_quarter(ql0, ql1, qh, k);
            let s = scale_pair(scv, (8 * n + 2 * k) as i8);
            for r in 0..4 {
                let y = _mm256_loadu_si256(ys[r].qs.as_ptr().add(128 * n + 32 * k).cast());
                acc[r] = _mm256_add_epi32(acc[r], scaled_products(q, y, s));
            }
        }
    }
    let wide = _mm256_cvtepi8_epi16(scv);
    let offsets = hsum4_epi32([scaled_bsums(ys[0], wide), scaled_bsums(ys[1], wide), scaled_bsums(ys[2], wide), scaled_bsums(ys[3], wide)]);
    let sums = hsum4_epi32(acc);
    [sums[0] - 32 * offsets[0], sums[1] - 32 * offsets[1], sums[2] - 32 * offsets[2], sums[3] - 32 * offsets[3]]
}

#[inline(always)]
unsafe fn dot_q6k_x4_body(w: &[u8], a: [&[u8]; 4]) -> [f32; 4] {
    let (ys, mut totals) = q8k_rows(a);
    for (b, x) in BlockQ6K::slice(w).unwrap().iter().enumerate() {
        prefetch_block(x);
        let sums = q6k_sumi_x4(x, [&ys[0][b], &ys[1][b], &ys[2][b], &ys[3][b]]);
        let d = f16_bytes(x.d);
        for r in 0..4 {
            totals[r] += d * ys[r][b].scale() * sums[r] as f32;
        }
    }
    totals
}

/// Eight f32 (`F32`) or f16 values at `p`, as f32.
#[inline(always)]
unsafe fn load8<const F32: bool>(p: *const u8) -> __m256 {
    if F32 {
        _mm256_loadu_ps(p.cast())
    } else {
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }
}

/// `ggml_exact`'s `fma_lanes64` of the first `np` (a multiple of 64) elements of two F32
/// (`F32`) or F16 rows: fused multiply-adds into 64 lanes (eight registers), reduced by
/// `reduce64`'s tree (0 if `np` is 0).
#[inline(always)]
unsafe fn fma_lanes64<const F32: bool>(w: *const u8, a: *const u8, np: usize) -> f32 {
    let elem = if F32 { 4 } else { 2 };
    let mut acc = [_mm256_setzero_ps(); 8];
    for i in (0..np).step_by(64) {
        for line in (0..64 * elem).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(w.add(i * elem + line).wrapping_add(super::matvec_avx512::LINEAR_AHEAD).cast());
        }
        for (j, acc_j) in acc.iter_mut().enumerate() {
            let at = (i + 8 * j) * elem;
            *acc_j = _mm256_fmadd_ps(load8::<F32>(w.add(at)), load8::<F32>(a.add(at)), *acc_j);
        }
    }
    if np == 0 {
        return 0.0;
    }
    reduce64(&acc)
}

/// F16 · F16 as `ggml_exact::dot_f16`: [`fma_lanes64`], then the rest added in f64.
#[inline(always)]
unsafe fn dot_f16_body(w: &[u8], a: &[u8]) -> f32 {
    let n = w.len().min(a.len()) / 2;
    let mut sum = fma_lanes64::<false>(w.as_ptr(), a.as_ptr(), n & !63) as f64;
    for i in n & !63..n {
        sum += (f16_bytes([w[2 * i], w[2 * i + 1]]) * f16_bytes([a[2 * i], a[2 * i + 1]])) as f64;
    }
    sum as f32
}

/// F32 · F32 as `ggml_exact::dot_f32`: [`fma_lanes64`], then the rest added in f32.
#[inline(always)]
unsafe fn dot_f32_body(w: &[u8], a: &[u8]) -> f32 {
    let n = w.len().min(a.len()) / 4;
    let mut sum = fma_lanes64::<true>(w.as_ptr(), a.as_ptr(), n & !63);
    let (wp, ap) = (w.as_ptr() as *const f32, a.as_ptr() as *const f32);
    for i in n & !63..n {
        sum += wp.add(i).read_unaligned() * ap.add(i).read_unaligned();
    }
    sum
}

/// Eight bf16 values at `p` widened to f32 (a shift: bf16 is f32's upper half).
#[inline(always)]
unsafe fn widen_bf16(p: *const u8) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()))))
}

/// BF16 · BF16 as the scalar twin (ggml's AVX-512F order): two 16-lane sums (here two
/// registers each) over steps of 32 elements, multiplied then added, each reduced by
/// `reduce16` into an f64 sum, the rest added in f64.
#[inline(always)]
unsafe fn dot_bf16_body(w: &[u8], a: &[u8]) -> f32 {
    let n = w.len().min(a.len()) / 2;
    let n32 = n & !31;
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let mut c = [_mm256_setzero_ps(); 4];
    for i in (0..n32).step_by(32) {
        _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(2 * i + super::matvec_avx512::LINEAR_AHEAD).cast());
        for (j, c_j) in c.iter_mut().enumerate() {
            let at = 2 * (i + 8 * j);
            *c_j = _mm256_add_ps(_mm256_mul_ps(widen_bf16(wp.add(at)), widen_bf16(ap.add(at))), *c_j);
        }
    }
    let mut sum = reduce16(c[0], c[1]) as f64;
    sum += reduce16(c[2], c[3]) as f64;
    let bf = |b: &[u8], i: usize| f32::from_bits((u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as u32) << 16);
    for i in n32..n {
        sum += (bf(w, i) * bf(a, i)) as f64;
    }
    sum as f32
}

macro_rules! block_fn {
    ($name:ident, $body:expr, $doc:literal) => {
        #[doc = $doc]
        ///
        /// # Safety
        /// The CPU must have AVX2, FMA and F16C; `w` and `a` whole blocks of the same count.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn $name(w: &[u8], a: &[u8]) -> f32 {
            $body(w, a)
        }
    };
}

block_fn!(dot_q4k_q8k, dot_k4_body::<BlockQ4K>, "Q4_K · Q8_K.");
block_fn!(dot_q5k_q8k, dot_k4_body::<BlockQ5K>, "Q5_K · Q8_K.");
block_fn!(dot_q6k_q8k, dot_q6k_body, "Q6_K · Q8_K.");
block_fn!(dot_q5_0_q8_0, dot_q5_0_body, "Q5_0 · Q8_0.");
block_fn!(dot_q5_1_q8_1, dot_q5_1_body, "Q5_1 · Q8_1.");
block_fn!(dot_f32_f32, dot_f32_body, "F32 · F32.");
block_fn!(dot_f16_f16, dot_f16_body, "F16 · F16.");
block_fn!(dot_bf16_bf16, dot_bf16_body, "BF16 · BF16.");

macro_rules! block_fn_x4 {
    ($name:ident, $body:expr, $doc:literal) => {
        #[doc = $doc]
        ///
        /// # Safety
        /// The CPU must have AVX2, FMA and F16C; `w` and every row of `a` whole blocks of the
        /// same count.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn $name(w: &[u8], a: [&[u8]; 4]) -> [f32; 4] {
            $body(w, a)
        }
    };
}

block_fn_x4!(dot_q4k_q8k_x4, dot_k4_x4_body::<BlockQ4K>, "Q4_K · Q8_K of one weight row against four activation rows (each as [`dot_q4k_q8k`]).");
block_fn_x4!(dot_q5k_q8k_x4, dot_k4_x4_body::<BlockQ5K>, "Q5_K · Q8_K of one weight row against four activation rows (each as [`dot_q5k_q8k`]).");
block_fn_x4!(dot_q6k_q8k_x4, dot_q6k_x4_body, "Q6_K · Q8_K of one weight row against four activation rows (each as [`dot_q6k_q8k`]).");
