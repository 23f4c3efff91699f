//! The AVX2 kernels of the interleaved layout, for CPUs without AVX-512: a group's sixteen rows
//! as two halves of eight, one row per 32-bit lane of a 256-bit register (a half's words are
//! the first or second 32 bytes of each of the layout's lines), against one to four activation
//! rows. Bit-identical to the scalar twin, as the AVX-512 kernels are.
//!
//! AVX2 has no `vpdpbusd`: a line's byte products come from `maddubs` (unsigned quant × signed
//! activation, pairs added into 16 bits). The 16-bit sums of a few lines are added before
//! `madd` widens them, and that `madd` multiplies by the sub-block's scale at the same time (the
//! scale in both 16-bit halves of the row's lane), so a line costs two instructions per
//! activation row. How many lines fit 16 bits: a pair of products is at most 2 · 15 · 128 =
//! 3840 for quants of four bits (Q4_K: all eight lines of a sub-block pair, 30 720), 2 · 31 ·
//! 128 = 7936 for five (four lines: 31 744), 2 · 63 · 128 = 16 128 for Q6_K's six (two lines:
//! 32 256), below `i16::MAX`; the activations are ≥ −128.
//!
//! Each block's two halves are computed one after the other, the second from L1: in two passes
//! over a group, the second (from L2) left the DRAM idle, and one row from DRAM streamed at 77 %
//! of the read bandwidth.

// Lanes and activation rows are indexed by number: the loops are unrolled by the compiler.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::lanes::{lane_bytes, prefetch_line, prefetch_lines, BYTE_PAIR_OF_LANE, BYTE_SPREAD};
use super::{ActBlock, GgmlType, GroupKernel};
use crate::quant::{BlockQ8K, BlockQ8_0, BlockQ8_1, ByteBlock};

/// Byte `j` of every 32-bit lane, zero-extended into both of its 16-bit halves, j = 0..3: a
/// sub-block's scale as `madd` takes it against a lane's two 16-bit sums.
static BYTE_TWICE_OF_LANE: [[u8; 64]; 4] = [
    lane_bytes([0, 0x80, 0, 0x80]),
    lane_bytes([1, 0x80, 1, 0x80]),
    lane_bytes([2, 0x80, 2, 0x80]),
    lane_bytes([3, 0x80, 3, 0x80]),
];

/// A lane table's first 32 bytes (its pattern repeats every 16).
#[inline(always)]
unsafe fn table(t: &[u8; 64]) -> __m256i {
    _mm256_loadu_si256(t.as_ptr().cast())
}

/// Four activation bytes at `p` broadcast to every lane.
#[inline(always)]
unsafe fn word(p: *const u8) -> __m256i {
    _mm256_set1_epi32((p as *const i32).read_unaligned())
}

/// `acc` plus the lanes' byte products of `u` (unsigned) and `s` (signed), in 16-bit pairs.
#[inline(always)]
unsafe fn add_products(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s))
}

/// The half's 32 bytes of the line at `p`.
#[inline(always)]
unsafe fn half_line(p: *const u8, half: usize) -> __m256i {
    _mm256_loadu_si256(p.add(32 * half).cast())
}

/// The half's eight f16 of the 16-row field at `p`, as f32.
#[inline(always)]
unsafe fn half_f16(p: *const u8, half: usize) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p.add(16 * half).cast()))
}

/// `q` with 16 added to each byte whose bit `bit` (one bit set per byte) in `bits` is set: a
/// quant's fifth bit.
#[inline(always)]
unsafe fn add_fifth_bit(q: __m256i, bits: __m256i, bit: __m256i) -> __m256i {
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(bits, bit), bit);
    _mm256_add_epi8(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
}

/// Where the parts of a Q4_K and a Q5_K group block start, and their bytes.
use super::{Q4K_GROUP_BLOCK as Q4K_BLOCK, Q4K_QS_AT as Q4K_QS, Q4K_SCALES_AT as Q4K_SCALES};
use super::{Q5K_GROUP_BLOCK as Q5K_BLOCK, Q5K_QH_AT as Q5K_QH, Q5K_QS_AT as Q5K_QS};

/// Sixteen Q4_K rows · `T` activation rows; with `FIVE`, sixteen Q5_K rows (each nibble
/// with its fifth bit).
#[inline(always)]
unsafe fn q4k<const T: usize, const FIVE: bool>(packed: &[u8], nb: usize, acts: &[&[u8]], _act_blocks: &[&[ActBlock]], out: *mut f32, stride: usize) {
    let (block, qs_at) = if FIVE { (Q5K_BLOCK, Q5K_QS) } else { (Q4K_BLOCK, Q4K_QS) };
    debug_assert!(packed.len() == nb * block && acts.len() == T);
    let ys: [&[BlockQ8K]; T] = std::array::from_fn(|t| BlockQ8K::slice(acts[t]).expect("whole Q8_K blocks"));
    // The scalar twin's `.sum()` over blocks starts from −0.0.
    let mut total = [[_mm256_set1_ps(-0.0); T]; 2];
    for b in 0..nb {
        let p = packed.as_ptr().add(b * block);
        prefetch_lines(p, qs_at);
        let y: [&BlockQ8K; T] = std::array::from_fn(|t| &ys[t][b]);
        q4k_half::<T, FIVE, 0>(p, &y, &mut total[0]);
        q4k_half::<T, FIVE, 1>(p, &y, &mut total[1]);
    }
    for (half, total) in total.iter().enumerate() {
        for (t, v) in total.iter().enumerate() {
            _mm256_storeu_ps(out.add(t * stride + 8 * half), *v);
        }
    }
}

/// One half (eight rows) of a Q4_K (`FIVE`: Q5_K) group block at `p` against the `T`
/// activation blocks `y`, added to `total`. The first half prefetches the group's stream
/// (the second reads the same lines from L1). `HALF` is a constant and each sub-block
/// pair's lines go in runs of four (a loop the compiler unrolls), so that the line loop has
/// no branches and keeps the activation rows' pointers in registers: compiled as a loop over
/// a run-time half, the kernel ran at half the rate of its line loop written out by hand.
#[inline(always)]
unsafe fn q4k_half<const T: usize, const FIVE: bool, const HALF: usize>(p: *const u8, y: &[&BlockQ8K; T], total: &mut [__m256; T]) {
    let qs_at = if FIVE { Q5K_QS } else { Q4K_QS };
    let low4 = _mm256_set1_epi8(0x0F);
    let (low6, low2) = (_mm256_set1_epi8(0x3F), _mm256_set1_epi8(0x03));
    // The eight rows' 6-bit scales and mins, byte j of a lane for sub-block j mod 4.
    let u0 = half_line(p.add(Q4K_SCALES), HALF);
    let u1 = half_line(p.add(Q4K_SCALES + 64), HALF);
    let u2 = half_line(p.add(Q4K_SCALES + 128), HALF);
    let sc_lo = _mm256_and_si256(u0, low6);
    let mn_lo = _mm256_and_si256(u1, low6);
    let sc_hi = _mm256_or_si256(_mm256_and_si256(u2, low4), _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srli_epi32::<6>(u0), low2)));
    let mn_hi = _mm256_or_si256(
        _mm256_and_si256(_mm256_srli_epi32::<4>(u2), low4),
        _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srli_epi32::<6>(u1), low2)),
    );
    let mut sum_sc = [_mm256_setzero_si256(); T];
    for pair in 0..4 {
        let scales = if pair < 2 { sc_lo } else { sc_hi };
        let sc_even = _mm256_shuffle_epi8(scales, table(&BYTE_TWICE_OF_LANE[2 * (pair % 2)]));
        let sc_odd = _mm256_shuffle_epi8(scales, table(&BYTE_TWICE_OF_LANE[2 * (pair % 2) + 1]));
        // Q5_K: sub-blocks 2·pair and 2·pair + 1 take these bits of their quants' bytes.
        let (bit_lo, bit_hi) = (_mm256_set1_epi8(1 << (2 * pair)), _mm256_set1_epi8((1u8 << (2 * pair + 1)) as i8));
        let q: [*const u8; T] = std::array::from_fn(|t| y[t].qs.as_ptr().add(64 * pair));
        let lines = p.add(qs_at + 64 * 8 * pair);
        // As many lines at a time in 16 bits as fit (see the module's note).
        let run_lines = if FIVE { 4 } else { 8 };
        for run in 0..8 / run_lines {
            let mut lo = [_mm256_setzero_si256(); T];
            let mut hi = [_mm256_setzero_si256(); T];
            for first in (run_lines * run..run_lines * (run + 1)).step_by(4) {
                for c in first..first + 4 {
                    q4k_line::<T, FIVE, HALF>(p, lines.add(64 * c), c, &q, bit_lo, bit_hi, &mut lo, &mut hi);
                }
            }
            for t in 0..T {
                let s = _mm256_add_epi32(_mm256_madd_epi16(lo[t], sc_even), _mm256_madd_epi16(hi[t], sc_odd));
                sum_sc[t] = _mm256_add_epi32(sum_sc[t], s);
            }
        }
    }
    let d = half_f16(p, HALF);
    let dmin = half_f16(p.add(32), HALF);
    // Mins of sub-blocks (2k, 2k + 1) as 16-bit halves of each lane, k = 0..3.
    let mins = [
        _mm256_shuffle_epi8(mn_lo, table(&BYTE_PAIR_OF_LANE[0])),
        _mm256_shuffle_epi8(mn_lo, table(&BYTE_PAIR_OF_LANE[1])),
        _mm256_shuffle_epi8(mn_hi, table(&BYTE_PAIR_OF_LANE[0])),
        _mm256_shuffle_epi8(mn_hi, table(&BYTE_PAIR_OF_LANE[1])),
    ];
    for t in 0..T {
        let pairs = bsum_pair_words(y[t]);
        let mut sum_m = _mm256_setzero_si256();
        for k in 0..4 {
            sum_m = _mm256_add_epi32(sum_m, _mm256_madd_epi16(mins[k], pairs[k]));
        }
        // The twin: ys · (d · sum_sc) − ys · dmin · sum_m, then added to the total.
        let ys = _mm256_set1_ps(y[t].scale());
        let a = _mm256_mul_ps(ys, _mm256_mul_ps(d, _mm256_cvtepi32_ps(sum_sc[t])));
        let m = _mm256_mul_ps(_mm256_mul_ps(ys, dmin), _mm256_cvtepi32_ps(sum_m));
        total[t] = _mm256_add_ps(total[t], _mm256_sub_ps(a, m));
    }
}

/// [`super::lanes::bsum_pairs`] of `y` as four vectors, word `k` in every lane of the `k`th: the sums of
/// pairs of `bsums` by `madd`, packed to 16 bits (each at most 32 · 128 in magnitude, so the
/// saturating pack keeps it), all in registers; the scalar `bsum_pairs` and its broadcasts
/// were some fifty instructions per activation row and half block.
#[inline(always)]
unsafe fn bsum_pair_words(y: &BlockQ8K) -> [__m256i; 4] {
    let sums = _mm256_madd_epi16(_mm256_loadu_si256(y.bsums.as_ptr().cast()), _mm256_set1_epi16(1));
    let packed = _mm_packs_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256::<1>(sums));
    let both = _mm256_broadcastsi128_si256(packed);
    [
        _mm256_shuffle_epi32::<0x00>(both),
        _mm256_shuffle_epi32::<0x55>(both),
        _mm256_shuffle_epi32::<0xAA>(both),
        _mm256_shuffle_epi32::<0xFF>(both),
    ]
}

/// Line `c` of a sub-block pair (at `line`, in the group block at `p`) against the activation
/// quants `q` (the pair's 64 of each row) into the rows' 16-bit sums `lo` and `hi`. A function,
/// not a closure: closures do not inherit the kernel's target features, so their intrinsics
/// were calls.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn q4k_line<const T: usize, const FIVE: bool, const HALF: usize>(
    p: *const u8,
    line: *const u8,
    c: usize,
    q: &[*const u8; T],
    bit_lo: __m256i,
    bit_hi: __m256i,
    lo: &mut [__m256i; T],
    hi: &mut [__m256i; T],
) {
    let low4 = _mm256_set1_epi8(0x0F);
    if HALF == 0 {
        prefetch_line(line);
    }
    let raw = half_line(line, HALF);
    let mut ql = _mm256_and_si256(raw, low4);
    let mut qh = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low4);
    if FIVE {
        let bits = half_line(p.add(Q5K_QH + 64 * c), HALF);
        ql = add_fifth_bit(ql, bits, bit_lo);
        qh = add_fifth_bit(qh, bits, bit_hi);
    }
    for t in 0..T {
        lo[t] = add_products(lo[t], ql, word(q[t].add(4 * c)));
        hi[t] = add_products(hi[t], qh, word(q[t].add(32 + 4 * c)));
    }
}

/// Bytes of a Q6_K group block, and where its parts start (see `Q6K_FIELDS`).
use super::{Q6K_D_AT, Q6K_GROUP_BLOCK as Q6K_BLOCK, Q6K_QUANTS_AT, Q6K_SCALES_AT};

/// Sixteen Q6_K rows · `T` activation rows: the quants offset to 0..63 for the unsigned
/// byte product, and `32 Σ_j scale_j · bsum_j` (ggml's `bsums`) taken from the scaled sum to
/// take the offset back — the twin's integer `sumi`.
#[inline(always)]
unsafe fn q6k<const T: usize>(packed: &[u8], nb: usize, acts: &[&[u8]], _act_blocks: &[&[ActBlock]], out: *mut f32, stride: usize) {
    debug_assert!(packed.len() == nb * Q6K_BLOCK && acts.len() == T);
    let ys: [&[BlockQ8K]; T] = std::array::from_fn(|t| BlockQ8K::slice(acts[t]).expect("whole Q8_K blocks"));
    let low4 = _mm256_set1_epi8(0x0F);
    let bits45 = _mm256_set1_epi8(0x30);
    let mut total = [[_mm256_set1_ps(-0.0); T]; 2];
    for b in 0..nb {
        let p = packed.as_ptr().add(b * Q6K_BLOCK);
        for half in 0..2 {
            if half == 0 {
                prefetch_lines(p, Q6K_QUANTS_AT);
            }
            let y: [&BlockQ8K; T] = std::array::from_fn(|t| &ys[t][b]);
            // The half's eight signed scales of group j.
            let scales = |j: usize| _mm_loadl_epi64(p.add(Q6K_SCALES_AT + 16 * j + 8 * half).cast());
            // Σ_j scale_j · bsum_j, two groups a `madd`.
            let mut offset = [_mm256_setzero_si256(); T];
            for k in 0..8 {
                let sc = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(scales(2 * k), scales(2 * k + 1)));
                for t in 0..T {
                    let bsums = (y[t].bsum(2 * k) as u16 as u32) | ((y[t].bsum(2 * k + 1) as u16 as u32) << 16);
                    offset[t] = _mm256_add_epi32(offset[t], _mm256_madd_epi16(sc, _mm256_set1_epi32(bsums as i32)));
                }
            }
            let mut sumi: [__m256i; T] = std::array::from_fn(|t| _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32::<5>(offset[t])));
            // Half n of the block (128 quants), quarter h of each 32 (the scale groups
            // 8n + 2m + h, m = 0..3), two lines at a time in 16 bits.
            for n in 0..2 {
                for h in 0..2 {
                    for two in 0..2 {
                        let mut acc = [[_mm256_setzero_si256(); 4]; T];
                        for c in 4 * h + 2 * two..4 * h + 2 * two + 2 {
                            // The three lines of word `8n + c`, one after the other.
                            let line = p.add(Q6K_QUANTS_AT + 64 * 3 * (8 * n + c));
                            if half == 0 {
                                prefetch_line(line);
                                prefetch_line(line.add(64));
                                prefetch_line(line.add(128));
                            }
                            let a = half_line(line, half);
                            let bq = half_line(line.add(64), half);
                            let hb = half_line(line.add(128), half);
                            let q = [
                                _mm256_or_si256(_mm256_and_si256(a, low4), _mm256_and_si256(_mm256_slli_epi16::<4>(hb), bits45)),
                                _mm256_or_si256(_mm256_and_si256(bq, low4), _mm256_and_si256(_mm256_slli_epi16::<2>(hb), bits45)),
                                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(a), low4), _mm256_and_si256(hb, bits45)),
                                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(bq), low4), _mm256_and_si256(_mm256_srli_epi16::<2>(hb), bits45)),
                            ];
                            for t in 0..T {
                                let yq = y[t].qs.as_ptr().add(128 * n + 4 * c);
                                for m in 0..4 {
                                    acc[t][m] = add_products(acc[t][m], q[m], word(yq.add(32 * m)));
                                }
                            }
                        }
                        for m in 0..4 {
                            let s = scales(8 * n + 2 * m + h);
                            let sc = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s, s));
                            for t in 0..T {
                                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(acc[t][m], sc));
                            }
                        }
                    }
                }
            }
            // The twin: d · ys · sumi, then added to the total.
            let d = half_f16(p.add(Q6K_D_AT), half);
            for t in 0..T {
                let v = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(y[t].scale())), _mm256_cvtepi32_ps(sumi[t]));
                total[half][t] = _mm256_add_ps(total[half][t], v);
            }
        }
    }
    for (half, total) in total.iter().enumerate() {
        for (t, v) in total.iter().enumerate() {
            _mm256_storeu_ps(out.add(t * stride + 8 * half), *v);
        }
    }
}

/// Where the parts of a Q4_0, a Q5_0 and a Q5_1 group block (two ggml blocks of sixteen
/// rows) start, and their bytes.
use super::{Q40_GROUP_BLOCK as Q40_BLOCK, Q40_QS_AT as Q40_QS};
use super::{Q50_GROUP_BLOCK as Q50_BLOCK, Q50_QH_AT as Q50_QH, Q50_QS_AT as Q50_QS};
use super::{Q41_GROUP_BLOCK as Q41_BLOCK, Q41_M_AT as Q41_M, Q41_QS_AT as Q41_QS};
use super::{Q51_GROUP_BLOCK as Q51_BLOCK, Q51_M_AT as Q51_M, Q51_QH_AT as Q51_QH, Q51_QS_AT as Q51_QS};

/// Sixteen Q4_0 rows · `T` Q8_0 activation rows (`act_blocks`: each activation block's sum and
/// scale): per block the twin's integer `Σ (q − 8)·a` as `Σ q·a − 8 Σ a`, then
/// `sumi · (dx · dy)` added to the total, block after block; with `FIVE`, sixteen Q5_0
/// rows (`Σ q·a − 16 Σ a`); with `FIVE` and `MIN`, sixteen Q5_1 rows · Q8_1 activations
/// (`Σ q·a`, then the twin's `(dx · dy) · sumi + mx · sy`). The rows are read through raw
/// pointers, as the AVX-512 kernel's are.
#[inline(always)]
unsafe fn q40<const T: usize, const FIVE: bool, const MIN: bool>(
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
    // Q5_0: the bits of quants 4i..4i + 4 (and 16 + 4i..) are bits 4(i mod 2)..+4 of the
    // lane's byte i / 2 (and 2 + i / 2) of its fifth bits, one per byte.
    let bit_of = [_mm256_set1_epi32(0x0804_0201), _mm256_set1_epi32(0x8040_2010u32 as i32)];
    debug_assert!(packed.len() == nb * block && acts.len() == T && act_blocks.len() == T);
    debug_assert!((0..T).all(|t| acts[t].len() == 2 * nb * act_bytes && act_blocks[t].len() == 2 * nb));
    let ys: [*const u8; T] = std::array::from_fn(|t| acts[t].as_ptr());
    let ex: [*const ActBlock; T] = std::array::from_fn(|t| act_blocks[t].as_ptr());
    let low4 = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut total = [[_mm256_set1_ps(-0.0); T]; 2];
    for u in 0..nb {
        let p = packed.as_ptr().add(u * block);
        for half in 0..2 {
            if half == 0 {
                prefetch_lines(p, qs_at);
            }
            for k in 0..2 {
                let blk = 2 * u + k;
                let e: [ActBlock; T] = std::array::from_fn(|t| *ex[t].add(blk));
                // The quants of activation block `blk` (after its scale, and Q8_1's sum).
                let qs: [*const u8; T] = std::array::from_fn(|t| ys[t].add(act_bytes * blk + act_qs));
                let mut lo = [_mm256_setzero_si256(); T];
                let mut hi = [_mm256_setzero_si256(); T];
                let bits = if FIVE { half_line(p.add(qh_at + 64 * k), half) } else { _mm256_setzero_si256() };
                for i in 0..4 {
                    let line = p.add(qs_at + 256 * k + 64 * i);
                    if half == 0 {
                        prefetch_line(line);
                    }
                    let raw = half_line(line, half);
                    let mut ql = _mm256_and_si256(raw, low4);
                    let mut qh = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low4);
                    if FIVE {
                        let lo_bits = _mm256_shuffle_epi8(bits, table(&BYTE_SPREAD[i / 2]));
                        let hi_bits = _mm256_shuffle_epi8(bits, table(&BYTE_SPREAD[2 + i / 2]));
                        ql = add_fifth_bit(ql, lo_bits, bit_of[i % 2]);
                        qh = add_fifth_bit(qh, hi_bits, bit_of[i % 2]);
                    }
                    for t in 0..T {
                        lo[t] = add_products(lo[t], ql, word(qs[t].add(4 * i)));
                        // Q4_0: all eight lines' products fit one 16-bit sum.
                        let acc = if FIVE { &mut hi[t] } else { &mut lo[t] };
                        *acc = add_products(*acc, qh, word(qs[t].add(16 + 4 * i)));
                    }
                }
                let dx = half_f16(p.add(32 * k), half);
                for t in 0..T {
                    let mut sumi = _mm256_madd_epi16(lo[t], ones);
                    if FIVE {
                        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(hi[t], ones));
                    }
                    let sumi = _mm256_add_epi32(sumi, _mm256_set1_epi32(-offset * e[t].sum));
                    // The twin: sumi · (dx · dy) (Q5_1: plus mx · sy), then added to the total.
                    let mut v = _mm256_mul_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(dx, _mm256_set1_ps(e[t].d)));
                    if MIN {
                        let mx = half_f16(p.add(Q51_M + 32 * k), half);
                        v = _mm256_add_ps(v, _mm256_mul_ps(mx, _mm256_set1_ps(e[t].s)));
                    }
                    total[half][t] = _mm256_add_ps(total[half][t], v);
                }
            }
        }
    }
    for (half, total) in total.iter().enumerate() {
        for (t, v) in total.iter().enumerate() {
            _mm256_storeu_ps(out.add(t * stride + 8 * half), *v);
        }
    }
}

/// Sixteen Q4_1 rows · `T` Q8_1 activation rows with the arithmetic of the ggml-order AVX2 row
/// kernel (`simd_x86::dot_q4_1_q8_1`, which gives llama.cpp's results), not the scalar twin's:
/// per row eight f32 lanes, lane `j` the fused multiply-add over blocks of `dx · dy` and the
/// block's integer sum over quants `4j..4j + 4` (`j` < 4: low nibbles of bytes `4j..`; else high
/// nibbles of bytes `4(j − 4)..`), the `mx · sy` of the blocks summed apart, then the lanes
/// added as `hsum_ps` adds them and the sum of mins after. A line of the layout is one lane's
/// word in its low nibbles and lane `4 + i`'s in its high ones, so each row's lane is a
/// register of eight rows.
#[inline(always)]
unsafe fn q41<const T: usize>(packed: &[u8], nb: usize, acts: &[&[u8]], act_blocks: &[&[ActBlock]], out: *mut f32, stride: usize) {
    debug_assert!(packed.len() == nb * Q41_BLOCK && acts.len() == T && act_blocks.len() == T);
    debug_assert!((0..T).all(|t| acts[t].len() == 2 * nb * BlockQ8_1::BYTES && act_blocks[t].len() == 2 * nb));
    let ys: [*const u8; T] = std::array::from_fn(|t| acts[t].as_ptr());
    let ex: [*const ActBlock; T] = std::array::from_fn(|t| act_blocks[t].as_ptr());
    let low4 = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    for half in 0..2 {
        let mut acc = [[_mm256_setzero_ps(); 8]; T];
        let mut summs = [_mm256_setzero_ps(); T];
        for u in 0..nb {
            let p = packed.as_ptr().add(u * Q41_BLOCK);
            if half == 0 {
                prefetch_lines(p, Q41_QS);
            }
            for k in 0..2 {
                let blk = 2 * u + k;
                let (dx, mx) = (half_f16(p.add(32 * k), half), half_f16(p.add(Q41_M + 32 * k), half));
                // Activation block `blk`: its quants (after its f16 `d` and `s`, which its
                // `ActBlock` holds as f32).
                let y: [*const u8; T] = std::array::from_fn(|t| ys[t].add(BlockQ8_1::BYTES * blk));
                for t in 0..T {
                    let e = *ex[t].add(blk);
                    summs[t] = _mm256_add_ps(summs[t], _mm256_mul_ps(mx, _mm256_set1_ps(e.s)));
                    let d = _mm256_mul_ps(dx, _mm256_set1_ps(e.d));
                    for i in 0..4 {
                        let line = p.add(Q41_QS + 256 * k + 64 * i);
                        if half == 0 && t == 0 {
                            prefetch_line(line);
                        }
                        let raw = half_line(line, half);
                        let ql = _mm256_and_si256(raw, low4);
                        let qh = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low4);
                        let lo = _mm256_madd_epi16(_mm256_maddubs_epi16(ql, word(y[t].add(4 + 4 * i))), ones);
                        let hi = _mm256_madd_epi16(_mm256_maddubs_epi16(qh, word(y[t].add(4 + 16 + 4 * i))), ones);
                        acc[t][i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lo), acc[t][i]);
                        acc[t][4 + i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(hi), acc[t][4 + i]);
                    }
                }
            }
        }
        for t in 0..T {
            let a = &acc[t];
            // `hsum_ps`: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)).
            let even = _mm256_add_ps(_mm256_add_ps(a[0], a[4]), _mm256_add_ps(a[2], a[6]));
            let odd = _mm256_add_ps(_mm256_add_ps(a[1], a[5]), _mm256_add_ps(a[3], a[7]));
            _mm256_storeu_ps(out.add(t * stride + 8 * half), _mm256_add_ps(_mm256_add_ps(even, odd), summs[t]));
        }
    }
}

macro_rules! kernels {
    ($($name:ident: $body:ident::<$($param:literal),*>;)*) => {$(
        /// # Safety
        /// AVX2, FMA and F16C; `packed` the group's `nb` blocks, every row of `acts` `nb`
        /// units of its type (and for Q4_0, Q5_0 and Q5_1 `act_blocks` its blocks'
        /// `ActBlock`s), `out` `T` rows of 16 floats `stride` apart.
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $name(packed: &[u8], nb: usize, acts: &[&[u8]], act_blocks: &[&[ActBlock]], out: *mut f32, stride: usize) {
            $body::<$($param),*>(packed, nb, acts, act_blocks, out, stride)
        }
    )*};
}

kernels! {
    q4k_1: q4k::<1, false>;
    q4k_2: q4k::<2, false>;
    q4k_3: q4k::<3, false>;
    q4k_4: q4k::<4, false>;
    q5k_1: q4k::<1, true>;
    q5k_2: q4k::<2, true>;
    q5k_3: q4k::<3, true>;
    q5k_4: q4k::<4, true>;
    q6k_1: q6k::<1>;
    q6k_2: q6k::<2>;
    q6k_3: q6k::<3>;
    q6k_4: q6k::<4>;
    q40_1: q40::<1, false, false>;
    q40_2: q40::<2, false, false>;
    q40_3: q40::<3, false, false>;
    q40_4: q40::<4, false, false>;
    q41_1: q41::<1>;
    q41_2: q41::<2>;
    q41_3: q41::<3>;
    q41_4: q41::<4>;
    q50_1: q40::<1, true, false>;
    q50_2: q40::<2, true, false>;
    q50_3: q40::<3, true, false>;
    q50_4: q40::<4, true, false>;
    q51_1: q40::<1, true, true>;
    q51_2: q40::<2, true, true>;
    q51_3: q40::<3, true, true>;
    q51_4: q40::<4, true, true>;
}

/// The kernels for 1, 2, 3 and 4 activation rows of a packed type.
pub fn kernel(ty: GgmlType) -> [GroupKernel; 4] {
    match ty {
        GgmlType::Q4K => [q4k_1, q4k_2, q4k_3, q4k_4],
        GgmlType::Q5K => [q5k_1, q5k_2, q5k_3, q5k_4],
        GgmlType::Q6K => [q6k_1, q6k_2, q6k_3, q6k_4],
        GgmlType::Q4_0 => [q40_1, q40_2, q40_3, q40_4],
        GgmlType::Q4_1 => [q41_1, q41_2, q41_3, q41_4],
        GgmlType::Q5_0 => [q50_1, q50_2, q50_3, q50_4],
        GgmlType::Q5_1 => [q51_1, q51_2, q51_3, q51_4],
        other => panic!("{other} is never interleaved"),
    }
}
