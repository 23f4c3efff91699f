//! AVX-512 activation quantisation to Q8_0 / Q8_1 (a block of 32 in two registers): bit for
//! bit [`quantize_row_scalar`](super::dot::quantize_row_scalar) for finite inputs.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use half::f16;

/// `x` (a multiple of 32 values) as Q8_0 blocks (`d`, 32 quants) or, with `Q8_1`, Q8_1
/// blocks (`d`, `s = d · Σq`, 32 quants) into `out`: ggml's `id = 127 / amax`, products
/// rounded half to even, as the scalar code does.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/DQ. Panics if `out` is not the row's size.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
pub unsafe fn quantize_row_q8<const Q8_1: bool>(x: &[f32], out: &mut [u8]) {
    let block_bytes = if Q8_1 { 36 } else { 34 };
    assert!(x.len().is_multiple_of(32) && out.len() == x.len() / 32 * block_bytes, "quantize_row_q8: sizes");
    for (b, x) in out.chunks_exact_mut(block_bytes).zip(x.chunks_exact(32)) {
        let lo = _mm512_loadu_ps(x.as_ptr());
        let hi = _mm512_loadu_ps(x.as_ptr().add(16));
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        let d = amax / 127.0;
        let id = _mm512_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
        // Round half to even first (as `round_ties_even`), so the conversion is exact.
        let q = |v: __m512| _mm512_cvtps_epi32(_mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(v, id)));
        let (qlo, qhi) = (q(lo), q(hi));
        let qs = if Q8_1 { &mut b[4..] } else { &mut b[2..] };
        _mm_storeu_si128(qs.as_mut_ptr().cast(), _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128(qs.as_mut_ptr().add(16).cast(), _mm512_cvtsepi32_epi8(qhi));
        b[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
        if Q8_1 {
            let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
            b[2..4].copy_from_slice(&f16::from_f32(d * sum as f32).to_le_bytes());
        }
    }
}
