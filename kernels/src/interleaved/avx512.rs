//! The AVX-512 kernels of the interleaved layout: a group's sixteen rows, one per 32-bit lane
//! of a 512-bit register, against one to four activation rows.

// Lanes and activation rows are indexed by number: the loops are unrolled by the compiler.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::lanes::{bsum_pairs, prefetch_line, prefetch_lines, BYTE_OF_LANE, BYTE_PAIR_OF_LANE, BYTE_SPREAD};
use super::{ActBlock, GgmlType, GroupKernel};
use crate::quant::{BlockQ8K, BlockQ8_0, BlockQ8_1, ByteBlock};

/// `acc + Σ` of four products of unsigned bytes `u` and signed bytes `s` per lane.
#[inline(always)]
unsafe fn dpbusd<const VNNI: bool>(acc: __m512i, u: __m512i, s: __m512i) -> __m512i {
    if VNNI {
        _mm512_dpbusd_epi32(acc, u, s)
    } else {
        _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)))
    }
}

#[inline(always)]
unsafe fn table(t: &[u8; 64]) -> __m512i {
    _mm512_loadu_si512(t.as_ptr().cast())
}

/// Four activation bytes at `p` broadcast to every lane.
#[inline(always)]
unsafe fn word(p: *const u8) -> __m512i {
    _mm512_set1_epi32((p as *const i32).read_unaligned())
}

/// Where the parts of a Q4_K and a Q5_K group block start, and their bytes.
use super::{Q4K_GROUP_BLOCK as Q4K_BLOCK, Q4K_QS_AT as Q4K_QS, Q4K_SCALES_AT as Q4K_SCALES};
use super::{Q5K_GROUP_BLOCK as Q5K_BLOCK, Q5K_QH_AT as Q5K_QH, Q5K_QS_AT as Q5K_QS};

/// Sixteen Q4_K rows · `T` activation rows; with `FIVE`, sixteen Q5_K rows (each nibble
/// with its fifth bit).
#[inline(always)]
unsafe fn q4k<const T: usize, const VNNI: bool, const FIVE: bool>(
    packed: &[u8],
    nb: usize,
    acts: &[&[u8]],
    _act_blocks: &[&[ActBlock]],
    out: *mut f32,
    stride: usize,
) {
    let (block, qs_at) = if FIVE { (Q5K_BLOCK, Q5K_QS) } else { (Q4K_BLOCK, Q4K_QS) };
    debug_assert!(packed.len() == nb * block && acts.len() == T);
    // High nibbles kept in place (16 × the quant) only where a quant is four bits.
    let in_place = VNNI && !FIVE;
    let bit4 = _mm512_set1_epi8(0x10);
    let ys: [&[BlockQ8K]; T] = std::array::from_fn(|t| BlockQ8K::slice(acts[t]).expect("whole Q8_K blocks"));
    let low4 = _mm512_set1_epi8(0x0F);
    let high4 = _mm512_set1_epi8(0xF0u8 as i8);
    let (low6, low2) = (_mm512_set1_epi8(0x3F), _mm512_set1_epi8(0x03));
    let scale_idx = [table(&BYTE_OF_LANE[0]), table(&BYTE_OF_LANE[1]), table(&BYTE_OF_LANE[2]), table(&BYTE_OF_LANE[3])];
    let min_idx = [table(&BYTE_PAIR_OF_LANE[0]), table(&BYTE_PAIR_OF_LANE[1])];
    // The scalar twin's `.sum()` over blocks starts from −0.0.
    let mut total = [_mm512_set1_ps(-0.0); T];
    for b in 0..nb {
        let p = packed.as_ptr().add(b * block);
        prefetch_lines(p, qs_at);
        // The sixteen rows' 6-bit scales and mins, byte j of a lane for sub-block j mod 4
        // (ggml's `scale_min_k4`, as `k4_scales_mins` decodes one row).
        let u0 = _mm512_load_si512(p.add(Q4K_SCALES).cast());
        let u1 = _mm512_load_si512(p.add(Q4K_SCALES + 64).cast());
        let u2 = _mm512_load_si512(p.add(Q4K_SCALES + 128).cast());
        let sc_lo = _mm512_and_si512(u0, low6);
        let mn_lo = _mm512_and_si512(u1, low6);
        let sc_hi = _mm512_or_si512(_mm512_and_si512(u2, low4), _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(u0), low2)));
        let mn_hi =
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32::<4>(u2), low4), _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(u1), low2)));
        let y: [&BlockQ8K; T] = std::array::from_fn(|t| &ys[t][b]);
        let mut sum_sc = [_mm512_setzero_si512(); T];
        for pair in 0..4 {
            let scales = if pair < 2 { sc_lo } else { sc_hi };
            let sc_even = _mm512_shuffle_epi8(scales, scale_idx[2 * (pair % 2)]);
            let sc_odd = _mm512_shuffle_epi8(scales, scale_idx[2 * (pair % 2) + 1]);
            // Two accumulators per sum for one or two activation rows (odd and even
            // lines; integer sums, so the same bits): one chain of eight dependent
            // `vpdpbusd` per sum held the stream back. Measured (2 threads, alternating):
            // a lone 256 MiB matrix 26.3–28.0 → 30.0–32.8 GB/s, the 1B shape's layers
            // 76–83 → 83–100 % of the sum's bandwidth, the 1B-shape Q4_K_M model 30.6–37.4
            // (median 31.5) → 33.8–38.7 (34.5) tok/s.
            let mut lo = [[_mm512_setzero_si512(); T]; 2];
            let mut hi = [[_mm512_setzero_si512(); T]; 2];
            // Q5_K: sub-blocks 2·pair and 2·pair + 1 take these bits of their quants' bytes.
            let (bit_lo, bit_hi) = (_mm512_set1_epi8(1 << (2 * pair)), _mm512_set1_epi8((1u8 << (2 * pair + 1)) as i8));
            for c in 0..8 {
                let k = if T <= 2 { c % 2 } else { 0 };
                prefetch_line(p.add(qs_at + 64 * (8 * pair + c)));
                let raw = _mm512_load_si512(p.add(qs_at + 64 * (8 * pair + c)).cast());
                let mut ql = _mm512_and_si512(raw, low4);
                // With VNNI the high nibbles stay in place (16 × the quant): `vpdpbusd`
                // does not saturate, so the sum is 16 × the twin's, shifted back below
                // (exact) — one instruction per line fewer than shifting each line
                // (one row from L3, 2 threads: 62.9–67.8 → 71.3–71.9 GB/s).
                let mut qh = if in_place { _mm512_and_si512(raw, high4) } else { _mm512_and_si512(_mm512_srli_epi16::<4>(raw), low4) };
                if FIVE {
                    // 16 added where the quant's fifth bit is set (its line of bits: word c).
                    let bits = _mm512_load_si512(p.add(Q5K_QH + 64 * c).cast());
                    ql = _mm512_mask_add_epi8(ql, _mm512_test_epi8_mask(bits, bit_lo), ql, bit4);
                    qh = _mm512_mask_add_epi8(qh, _mm512_test_epi8_mask(bits, bit_hi), qh, bit4);
                }
                for t in 0..T {
                    let q = y[t].qs.as_ptr().add(64 * pair + 4 * c);
                    lo[k][t] = dpbusd::<VNNI>(lo[k][t], ql, word(q));
                    hi[k][t] = dpbusd::<VNNI>(hi[k][t], qh, word(q.add(32)));
                }
            }
            let lo: [__m512i; T] = std::array::from_fn(|t| _mm512_add_epi32(lo[0][t], lo[1][t]));
            let mut hi: [__m512i; T] = std::array::from_fn(|t| _mm512_add_epi32(hi[0][t], hi[1][t]));
            if in_place {
                // |Σ| ≤ 32 · 240 · 128 per lane: no overflow, and a multiple of 16.
                for h in &mut hi {
                    *h = _mm512_srai_epi32::<4>(*h);
                }
            }
            for t in 0..T {
                let s = _mm512_add_epi32(_mm512_mullo_epi32(lo[t], sc_even), _mm512_mullo_epi32(hi[t], sc_odd));
                sum_sc[t] = _mm512_add_epi32(sum_sc[t], s);
            }
        }
        let d = _mm512_cvtph_ps(_mm256_load_si256(p.cast()));
        let dmin = _mm512_cvtph_ps(_mm256_load_si256(p.add(32).cast()));
        // Mins of sub-blocks (2k, 2k + 1) as 16-bit halves of each lane, k = 0..3.
        let mins = [
            _mm512_shuffle_epi8(mn_lo, min_idx[0]),
            _mm512_shuffle_epi8(mn_lo, min_idx[1]),
            _mm512_shuffle_epi8(mn_hi, min_idx[0]),
            _mm512_shuffle_epi8(mn_hi, min_idx[1]),
        ];
        for t in 0..T {
            let pairs = bsum_pairs(y[t]);
            let mut sum_m = _mm512_setzero_si512();
            for k in 0..4 {
                sum_m = _mm512_add_epi32(sum_m, _mm512_madd_epi16(mins[k], _mm512_set1_epi32(pairs[k])));
            }
            // The twin: ys · (d · sum_sc) − ys · dmin · sum_m, then added to the total.
            let ys = _mm512_set1_ps(y[t].scale());
            let a = _mm512_mul_ps(ys, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sum_sc[t])));
            let m = _mm512_mul_ps(_mm512_mul_ps(ys, dmin), _mm512_cvtepi32_ps(sum_m));
            total[t] = _mm512_add_ps(total[t], _mm512_sub_ps(a, m));
        }
    }
    for (t, v) in total.iter().enumerate() {
        _mm512_storeu_ps(out.add(t * stride), *v);
    }
}

/// Bytes of a Q6_K group block, and where its parts start (see `Q6K_FIELDS`).
use super::{Q6K_D_AT, Q6K_GROUP_BLOCK as Q6K_BLOCK, Q6K_QUANTS_AT, Q6K_SCALES_AT};

/// Sixteen Q6_K rows · `T` activation rows: the quants offset to 0..63 for the unsigned
/// byte product, each group of sixteen's sum started at −32 × its activation sum (ggml's
/// `bsums`) to take the offset back, then scaled — the twin's integer `sumi`.
#[inline(always)]
unsafe fn q6k<const T: usize, const VNNI: bool>(packed: &[u8], nb: usize, acts: &[&[u8]], _act_blocks: &[&[ActBlock]], out: *mut f32, stride: usize) {
    debug_assert!(packed.len() == nb * Q6K_BLOCK && acts.len() == T);
    let ys: [&[BlockQ8K]; T] = std::array::from_fn(|t| BlockQ8K::slice(acts[t]).expect("whole Q8_K blocks"));
    let low4 = _mm512_set1_epi8(0x0F);
    let bits45 = _mm512_set1_epi8(0x30);
    let mut total = [_mm512_set1_ps(-0.0); T];
    for b in 0..nb {
        let p = packed.as_ptr().add(b * Q6K_BLOCK);
        prefetch_lines(p, Q6K_QUANTS_AT);
        let y: [&BlockQ8K; T] = std::array::from_fn(|t| &ys[t][b]);
        let mut sumi = [_mm512_setzero_si512(); T];
        // Half n of the block (128 quants), quarter h of each 32 (the scale groups
        // 8n + 2m + h, m = 0..3).
        for n in 0..2 {
            for h in 0..2 {
                let mut acc = [[_mm512_setzero_si512(); 4]; T];
                for t in 0..T {
                    for m in 0..4 {
                        acc[t][m] = _mm512_set1_epi32(-32 * y[t].bsum(8 * n + 2 * m + h));
                    }
                }
                for c in 4 * h..4 * h + 4 {
                    // The three lines of word `8n + c`, one after the other.
                    let line = p.add(Q6K_QUANTS_AT + 64 * 3 * (8 * n + c));
                    prefetch_line(line);
                    prefetch_line(line.add(64));
                    prefetch_line(line.add(128));
                    let a = _mm512_load_si512(line.cast());
                    let bq = _mm512_load_si512(line.add(64).cast());
                    let hb = _mm512_load_si512(line.add(128).cast());
                    let q = [
                        _mm512_or_si512(_mm512_and_si512(a, low4), _mm512_and_si512(_mm512_slli_epi16::<4>(hb), bits45)),
                        _mm512_or_si512(_mm512_and_si512(bq, low4), _mm512_and_si512(_mm512_slli_epi16::<2>(hb), bits45)),
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(a), low4), _mm512_and_si512(hb, bits45)),
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(bq), low4), _mm512_and_si512(_mm512_srli_epi16::<2>(hb), bits45)),
                    ];
                    for t in 0..T {
                        let yq = y[t].qs.as_ptr().add(128 * n + 4 * c);
                        for m in 0..4 {
                            acc[t][m] = dpbusd::<VNNI>(acc[t][m], q[m], word(yq.add(32 * m)));
                        }
                    }
                }
                for m in 0..4 {
                    let j = 8 * n + 2 * m + h;
                    let sc = _mm512_cvtepi8_epi32(_mm_load_si128(p.add(Q6K_SCALES_AT + 16 * j).cast()));
                    for t in 0..T {
                        sumi[t] = _mm512_add_epi32(sumi[t], _mm512_mullo_epi32(acc[t][m], sc));
                    }
                }
            }
        }
        // The twin: d · ys · sumi, then added to the total.
        let d = _mm512_cvtph_ps(_mm256_load_si256(p.add(Q6K_D_AT).cast()));
        for t in 0..T {
            let v = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(y[t].scale())), _mm512_cvtepi32_ps(sumi[t]));
            total[t] = _mm512_add_ps(total[t], v);
        }
    }
    for (t, v) in total.iter().enumerate() {
        _mm512_storeu_ps(out.add(t * stride), *v);
    }
}

/// Where the parts of a Q4_0, a Q5_0 and a Q5_1 group block (two ggml blocks of sixteen
/// rows) start, and their bytes.
use super::{Q40_GROUP_BLOCK as Q40_BLOCK, Q40_QS_AT as Q40_QS};
use super::{Q50_GROUP_BLOCK as Q50_BLOCK, Q50_QH_AT as Q50_QH, Q50_QS_AT as Q50_QS};
use super::{Q51_GROUP_BLOCK as Q51_BLOCK, Q51_M_AT as Q51_M, Q51_QH_AT as Q51_QH, Q51_QS_AT as Q51_QS};

/// Sixteen Q4_0 rows · `T` Q8_0 activation rows (`act_blocks`: each activation block's sum and
/// scale): per block the twin's integer `Σ (q − 8)·a` as `Σ q·a − 8 Σ a`, then
/// `sumi · (dx · dy)` added to the total, block after block; with `FIVE`, sixteen Q5_0
/// rows (each nibble with its fifth bit, `Σ (q − 16)·a` as `Σ q·a − 16 Σ a`); with `FIVE`
/// and `MIN`, sixteen Q5_1 rows · Q8_1 activations (`Σ q·a`, then the twin's
/// `(dx · dy) · sumi + mx · sy`). The rows are
/// read through raw pointers: indexed per block, their bounds checks kept the compiler
/// from unrolling the float epilogue over the rows, whose sums then went through the stack.
#[inline(always)]
unsafe fn q40<const T: usize, const VNNI: bool, const FIVE: bool, const MIN: bool>(
    packed: &[u8],
    nb: usize,
    acts: &[&[u8]],
    act_blocks: &[&[ActBlock]],
    out: *mut f32,
    stride: usize,
) {
    let (block, qh_at, qs_at, offset) = match (FIVE, MIN) {
        (true, true) => (Q51_BLOCK, Q51_QH, Q51_QS, 0),
        (true, false) => (Q50_BLOCK, Q50_QH, Q50_QS, 16),
        _ => (Q40_BLOCK, 0, Q40_QS, 8),
    };
    // An activation block: Q8_1's (d, s, 32 quants) or Q8_0's (d, 32 quants).
    let (act_bytes, act_qs) = if MIN { (BlockQ8_1::BYTES, 4) } else { (BlockQ8_0::BYTES, 2) };
    // High nibbles kept in place (16 × the quant) only where a quant is four bits.
    let in_place = VNNI && !FIVE;
    let bit4 = _mm512_set1_epi8(0x10);
    // Q5_0: the bits of quants 4i..4i + 4 (and 16 + 4i..) are bits 4(i mod 2)..+4 of the
    // lane's byte i / 2 (and 2 + i / 2) of its fifth bits, one per byte.
    let bit_of = [_mm512_set1_epi32(0x0804_0201), _mm512_set1_epi32(0x8040_2010u32 as i32)];
    debug_assert!(packed.len() == nb * block && acts.len() == T && act_blocks.len() == T);
    debug_assert!((0..T).all(|t| acts[t].len() == 2 * nb * act_bytes && act_blocks[t].len() == 2 * nb));
    let ys: [*const u8; T] = std::array::from_fn(|t| acts[t].as_ptr());
    let ex: [*const ActBlock; T] = std::array::from_fn(|t| act_blocks[t].as_ptr());
    let low4 = _mm512_set1_epi8(0x0F);
    let high4 = _mm512_set1_epi8(0xF0u8 as i8);
    let mut total = [_mm512_set1_ps(-0.0); T];
    for u in 0..nb {
        let p = packed.as_ptr().add(u * block);
        prefetch_lines(p, qs_at);
        for k in 0..2 {
            let blk = 2 * u + k;
            let e: [ActBlock; T] = std::array::from_fn(|t| *ex[t].add(blk));
            // The quants of activation block `blk` (after its scale, and Q8_1's sum).
            let qs: [*const u8; T] = std::array::from_fn(|t| ys[t].add(act_bytes * blk + act_qs));
            let mut lo: [__m512i; T] = std::array::from_fn(|t| _mm512_set1_epi32(-offset * e[t].sum));
            let mut hi = [_mm512_setzero_si512(); T];
            let bits = if FIVE { _mm512_load_si512(p.add(qh_at + 64 * k).cast()) } else { _mm512_setzero_si512() };
            for i in 0..4 {
                prefetch_line(p.add(qs_at + 256 * k + 64 * i));
                let raw = _mm512_load_si512(p.add(qs_at + 256 * k + 64 * i).cast());
                let mut ql = _mm512_and_si512(raw, low4);
                // With VNNI the high nibbles stay in place (16 × the quant), shifted back
                // below, as in `q4k`.
                let mut qh = if in_place { _mm512_and_si512(raw, high4) } else { _mm512_and_si512(_mm512_srli_epi16::<4>(raw), low4) };
                if FIVE {
                    // 16 added where the quant's fifth bit is set.
                    let lo_bits = _mm512_shuffle_epi8(bits, table(&BYTE_SPREAD[i / 2]));
                    let hi_bits = _mm512_shuffle_epi8(bits, table(&BYTE_SPREAD[2 + i / 2]));
                    ql = _mm512_mask_add_epi8(ql, _mm512_test_epi8_mask(lo_bits, bit_of[i % 2]), ql, bit4);
                    qh = _mm512_mask_add_epi8(qh, _mm512_test_epi8_mask(hi_bits, bit_of[i % 2]), qh, bit4);
                }
                for t in 0..T {
                    lo[t] = dpbusd::<VNNI>(lo[t], ql, word(qs[t].add(4 * i)));
                    hi[t] = dpbusd::<VNNI>(hi[t], qh, word(qs[t].add(16 + 4 * i)));
                }
            }
            let dx = _mm512_cvtph_ps(_mm256_load_si256(p.add(32 * k).cast()));
            for t in 0..T {
                // |Σ| ≤ 16 · 240 · 128 per lane: no overflow, and a multiple of 16.
                let h = if in_place { _mm512_srai_epi32::<4>(hi[t]) } else { hi[t] };
                let sumi = _mm512_add_epi32(lo[t], h);
                // The twin: sumi · (dx · dy) (Q5_1: plus mx · sy), then added to the total.
                let mut v = _mm512_mul_ps(_mm512_cvtepi32_ps(sumi), _mm512_mul_ps(dx, _mm512_set1_ps(e[t].d)));
                if MIN {
                    let mx = _mm512_cvtph_ps(_mm256_load_si256(p.add(Q51_M + 32 * k).cast()));
                    v = _mm512_add_ps(v, _mm512_mul_ps(mx, _mm512_set1_ps(e[t].s)));
                }
                total[t] = _mm512_add_ps(total[t], v);
            }
        }
    }
    for (t, v) in total.iter().enumerate() {
        _mm512_storeu_ps(out.add(t * stride), *v);
    }
}

macro_rules! kernels {
    ($($name:ident: $body:ident::<$($param:literal),*>, $features:literal;)*) => {$(
        /// # Safety
        /// The CPU features named; `packed` the group's `nb` blocks (64-byte aligned),
        /// every row of `acts` `nb` units of its type (and for Q4_0, Q5_0 and Q5_1 `act_blocks` its blocks'
        /// `ActBlock`s), `out` `T` rows of 16 floats `stride` apart.
        #[target_feature(enable = $features)]
        unsafe fn $name(packed: &[u8], nb: usize, acts: &[&[u8]], act_blocks: &[&[ActBlock]], out: *mut f32, stride: usize) {
            $body::<$($param),*>(packed, nb, acts, act_blocks, out, stride)
        }
    )*};
}

kernels! {
    q4k_1_vnni: q4k::<1, true, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q4k_2_vnni: q4k::<2, true, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q4k_3_vnni: q4k::<3, true, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q4k_4_vnni: q4k::<4, true, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q4k_1: q4k::<1, false, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q4k_2: q4k::<2, false, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q4k_3: q4k::<3, false, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q4k_4: q4k::<4, false, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q5k_1_vnni: q4k::<1, true, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q5k_2_vnni: q4k::<2, true, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q5k_3_vnni: q4k::<3, true, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q5k_4_vnni: q4k::<4, true, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q5k_1: q4k::<1, false, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q5k_2: q4k::<2, false, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q5k_3: q4k::<3, false, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q5k_4: q4k::<4, false, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q6k_1_vnni: q6k::<1, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q6k_2_vnni: q6k::<2, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q6k_3_vnni: q6k::<3, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q6k_4_vnni: q6k::<4, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q6k_1: q6k::<1, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q6k_2: q6k::<2, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q6k_3: q6k::<3, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q6k_4: q6k::<4, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q40_1_vnni: q40::<1, true, false, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q40_2_vnni: q40::<2, true, false, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q40_3_vnni: q40::<3, true, false, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q40_4_vnni: q40::<4, true, false, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q40_1: q40::<1, false, false, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q40_2: q40::<2, false, false, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q40_3: q40::<3, false, false, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q40_4: q40::<4, false, false, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q50_1_vnni: q40::<1, true, true, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q50_2_vnni: q40::<2, true, true, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q50_3_vnni: q40::<3, true, true, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q50_4_vnni: q40::<4, true, true, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q50_1: q40::<1, false, true, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q50_2: q40::<2, false, true, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q50_3: q40::<3, false, true, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q50_4: q40::<4, false, true, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q51_1_vnni: q40::<1, true, true, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q51_2_vnni: q40::<2, true, true, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q51_3_vnni: q40::<3, true, true, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q51_4_vnni: q40::<4, true, true, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    q51_1: q40::<1, false, true, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q51_2: q40::<2, false, true, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q51_3: q40::<3, false, true, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
    q51_4: q40::<4, false, true, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c";
}

/// The kernels for 1, 2, 3 and 4 activation rows of a packed type, with `vpdpbusd` or
/// with `maddubs` + `madd` (no quant product pair saturates: 2 · 63 · 128 < 32768).
pub fn kernel(ty: GgmlType, vnni: bool) -> [GroupKernel; 4] {
    match (ty, vnni) {
        (GgmlType::Q4K, true) => [q4k_1_vnni, q4k_2_vnni, q4k_3_vnni, q4k_4_vnni],
        (GgmlType::Q4K, false) => [q4k_1, q4k_2, q4k_3, q4k_4],
        (GgmlType::Q5K, true) => [q5k_1_vnni, q5k_2_vnni, q5k_3_vnni, q5k_4_vnni],
        (GgmlType::Q5K, false) => [q5k_1, q5k_2, q5k_3, q5k_4],
        (GgmlType::Q6K, true) => [q6k_1_vnni, q6k_2_vnni, q6k_3_vnni, q6k_4_vnni],
        (GgmlType::Q6K, false) => [q6k_1, q6k_2, q6k_3, q6k_4],
        (GgmlType::Q4_0, true) => [q40_1_vnni, q40_2_vnni, q40_3_vnni, q40_4_vnni],
        (GgmlType::Q4_0, false) => [q40_1, q40_2, q40_3, q40_4],
        (GgmlType::Q5_0, true) => [q50_1_vnni, q50_2_vnni, q50_3_vnni, q50_4_vnni],
        (GgmlType::Q5_0, false) => [q50_1, q50_2, q50_3, q50_4],
        (GgmlType::Q5_1, true) => [q51_1_vnni, q51_2_vnni, q51_3_vnni, q51_4_vnni],
        (GgmlType::Q5_1, false) => [q51_1, q51_2, q51_3, q51_4],
        (other, _) => panic!("{other} is never interleaved"),
    }
}
