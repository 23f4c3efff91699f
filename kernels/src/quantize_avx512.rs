//! AVX-512 activation quantisation to Q8_0 / Q8_1 (a block of 32 in two registers) and Q8_K
//! (a block of 256 in sixteen): bit for bit [`quantize_row_scalar`](super::dot::quantize_row_scalar)
//! for finite inputs.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use half::f16;

use crate::quant::{BlockQ8K, ByteBlock, QK_K};

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

/// `x` (a multiple of 256 values) as Q8_K blocks (`d`, 256 quants, sixteen sums of 16) into
/// `out`, bit for bit the scalar `quantize_row_q8_K_ref` twin: the block's value of largest
/// magnitude (the first of equals) sets `iscale = −127 / max`, products rounded half to even
/// and capped at 127. The scalar finds that value with a compare per element in order, one
/// long dependent chain (4.5 % of a cpu-worker's samples serving OLMoE's experts at 16
/// sessions); here a vector maximum, then the first lane equal to it.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/DQ. Panics if `out` is not the row's size.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
pub unsafe fn quantize_row_q8_k(x: &[f32], out: &mut [u8]) {
    let blocks = BlockQ8K::slice_mut(out).filter(|b| x.len().is_multiple_of(QK_K) && b.len() == x.len() / QK_K);
    let blocks = blocks.expect("quantize_row_q8_k: sizes");
    for (b, x) in blocks.iter_mut().zip(x.chunks_exact(QK_K)) {
        let v: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(x.as_ptr().add(16 * i)));
        // `max_ps` returns its second operand where either is NaN: NaN values are passed
        // over, as the scalar's `>` passes them over.
        let m = v.iter().fold(_mm512_setzero_ps(), |m, &v| _mm512_max_ps(_mm512_abs_ps(v), m));
        let amax = _mm512_reduce_max_ps(m);
        if amax == 0.0 {
            *b = BlockQ8K { d: [0; 4], qs: [0; QK_K], bsums: [0; 32] };
            continue;
        }
        let wanted = _mm512_set1_ps(amax);
        let first = v
            .iter()
            .enumerate()
            .find_map(|(i, &v)| {
                let hit = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_abs_ps(v), wanted);
                (hit != 0).then(|| 16 * i + hit.trailing_zeros() as usize)
            })
            .expect("the maximum is one of the values");
        let iscale = -127.0 / x[first];
        let scale = _mm512_set1_ps(iscale);
        let cap = _mm512_set1_epi32(127);
        for (i, &v) in v.iter().enumerate() {
            // Round half to even first (as `round_ties_even`), so the conversion is exact.
            let r = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(scale, v));
            let q8 = _mm512_cvtepi32_epi8(_mm512_min_epi32(_mm512_cvtps_epi32(r), cap));
            _mm_storeu_si128(b.qs.as_mut_ptr().add(16 * i).cast(), q8);
            // The group's sum from the stored bytes, as the scalar sums them.
            let sum = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(q8));
            b.bsums[2 * i..2 * i + 2].copy_from_slice(&(sum as i16).to_le_bytes());
        }
        b.d = (1.0 / iscale).to_le_bytes();
    }
}
