//! What the AVX-512 and AVX2 kernels of the interleaved layout share: `vpshufb` tables that
//! pick bytes within each row's 32-bit lane, the activation blocks' sub-block sums in 16-bit
//! pairs, and the prefetches of a group's stream.

use std::arch::x86_64::{_mm_prefetch, _MM_HINT_NTA};

use crate::quant::BlockQ8K;

/// How far ahead of the block being read its group's stream is prefetched.
const AHEAD: usize = crate::matvec_avx512::LINEAR_AHEAD;

/// A `vpshufb` index picking, in every 32-bit lane, the lane's own bytes `spec` names
/// (one per output byte, 0–3; 0x80: zero). `vpshufb` indexes within 128-bit quarters, so
/// lane `i` of a quarter adds `4i`. Built at compile time: built at run time, the tables
/// cost a few thousand scalar instructions per kernel call (one per 16-row group).
pub const fn lane_bytes(spec: [u8; 4]) -> [u8; 64] {
    let mut idx = [0u8; 64];
    let mut k = 0;
    while k < 64 {
        let s = spec[k % 4];
        idx[k] = if s & 0x80 != 0 { 0x80 } else { s + 4 * ((k / 4) % 4) as u8 };
        k += 1;
    }
    idx
}

/// Byte `j` of every 32-bit lane, zero-extended, j = 0..3.
pub static BYTE_OF_LANE: [[u8; 64]; 4] = [
    lane_bytes([0, 0x80, 0x80, 0x80]),
    lane_bytes([1, 0x80, 0x80, 0x80]),
    lane_bytes([2, 0x80, 0x80, 0x80]),
    lane_bytes([3, 0x80, 0x80, 0x80]),
];

/// Bytes `2k` and `2k + 1` of every 32-bit lane as two zero-extended 16-bit halves, k = 0, 1.
pub static BYTE_PAIR_OF_LANE: [[u8; 64]; 2] = [lane_bytes([0, 0x80, 1, 0x80]), lane_bytes([2, 0x80, 3, 0x80])];

/// The activation block's sub-block sums (ggml's two `bsums` of 16 added) in 16-bit
/// pairs: word `k` = sums of sub-blocks `2k` (low half) and `2k + 1` (high half). Written
/// out: an array `map` here compiled to an out-of-line call per block.
#[inline(always)]
pub fn bsum_pairs(y: &BlockQ8K) -> [i32; 4] {
    let s = |j: usize| (y.bsum(2 * j) + y.bsum(2 * j + 1)) as u16 as u32;
    let pair = |k: usize| (s(2 * k) | (s(2 * k + 1) << 16)) as i32;
    [pair(0), pair(1), pair(2), pair(3)]
}

/// Prefetches the line `AHEAD` bytes past `p` as non-temporal (`prefetchnta`), where `p` is a
/// line the kernel is about to read: one prefetch per line read, spread through the block's
/// arithmetic, so that the stream's requests stay evenly in flight. Measured (2 threads,
/// alternating): the 1B-shape Q4_K_M model decoded 28.0–32.7 tok/s with each group block's
/// lines prefetched in one burst at its start against 33.3–35.0 this way; a lone 256 MiB Q6_K
/// matrix streamed 20.5–20.7 GB/s against 27.8–32.8 (the machine's sum: 32.8). With no
/// software prefetch the served OLMoE step took 1.55× as long; 4–32 KiB ahead about the same
/// from 8 KiB.
///
/// Non-temporal rather than into L2 (`prefetcht1`, the hint before 2026-11-30): a weight line
/// is read once a product, and a line not kept in L2 (nor, when L2 lets it go, in the L3 that
/// takes L2's victims on AMD's Zen) costs the caches nothing, while the other data (activations,
/// KV rows) stays. Measured on the project's AMD EPYC VM (48 KiB L1d and 1 MiB L2 a core), the
/// hint switched at run time on one server so that both meet the VM's phases
/// (docs/benchmarks.md): a lone 256 MiB Q4_K matrix 72.9–73.6 → 83.4–84.4 GB/s, past the
/// parallel f32 sum's 75–76, whose lines go through the caches; served batch-1 steps 6–7 %
/// shorter on the OLMoE shape (15 of 16 rounds), 6–9 % on the 1B shape, 12 % on the 8B shape,
/// 6 % on the 1B shape through the AVX2 kernels; 16 OLMoE sessions 2 % shorter; a 512-token
/// prefill the same.
#[inline(always)]
pub unsafe fn prefetch_line(p: *const u8) {
    _mm_prefetch::<_MM_HINT_NTA>(p.wrapping_add(AHEAD).cast());
}

/// [`prefetch_line`] for each line of `bytes` bytes from `p` (a block's non-quant fields).
#[inline(always)]
pub unsafe fn prefetch_lines(p: *const u8, bytes: usize) {
    for off in (0..bytes).step_by(64) {
        prefetch_line(p.wrapping_add(off));
    }
}

/// Byte `j` of every 32-bit lane in all four of its bytes, j = 0..3 (a lane's fifth-bit
/// byte beside each of its quants).
pub static BYTE_SPREAD: [[u8; 64]; 4] = [lane_bytes([0, 0, 0, 0]), lane_bytes([1, 1, 1, 1]), lane_bytes([2, 2, 2, 2]), lane_bytes([3, 3, 3, 3])];
