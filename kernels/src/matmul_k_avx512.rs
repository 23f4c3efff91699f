//! AVX-512 matrix products of Q4_K, Q5_K and Q6_K weights (most published GGUF models: Q4_K_M
//! mixes Q4_K and Q6_K, Q5_K_M Q5_K and Q6_K) with tiles of sixteen Q8_K activation rows
//! (prefill, batched decode), bit-identical to one `vec_dot` per (weight row, activation row):
//! the scalar twin's per-block integers and float epilogue, with the sixteen activation rows in
//! the sixteen lanes of every register.
//!
//! The activations are laid out lane-major once per product: for every block, sub-block of 32
//! and ggml lane of four quants, one register holding those four quants of all sixteen rows
//! (row `t` in bytes `4t..4t + 4`). A weight block's four quants of a lane are broadcast by a
//! load and multiplied with it by `vpdpbusd` (or `maddubs` + `madd`): each of the register's
//! lanes adds one row's four products, so a sub-block's dot product for the whole tile takes
//! eight instructions. Integers are the same in any order; the epilogue is the twin's.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::blockdot_avx2::k4_scales_mins;
use super::matmul_avx512::TILE;
use super::matvec_avx512::dot_u8i8;
use super::quant::{BlockQ8K, ByteBlock};

/// The fewest rows of a tile padded with zero rows: sixteen lanes' work for this many rows
/// beats one plain dot product per row at about six.
pub const MIN_PARTIAL: usize = 6;

/// Sub-blocks of 32 quants per Q4_K / Q8_K block.
const SUBS: usize = 8;

/// The tiles of sixteen Q8_K activation rows of one product, lane-major.
#[derive(Debug, Default)]
pub struct KTileActs {
    /// Blocks per row.
    nb: usize,
    /// Per tile, block, sub-block and lane `l` (0–7): quants `4l..4l + 4` of the sub-block of
    /// every row of the tile, row `t` in bytes `4t..4t + 4`.
    q: Vec<__m512i>,
    /// Per tile, block and pair `k` (0–3) of sub-blocks: each row's sums of the quants of
    /// sub-blocks `2k` (low 16 bits) and `2k + 1` (high 16 bits; each ggml's two `bsums` of 16
    /// added, at most 4096 in magnitude), for `vpdpwssd` against the mins.
    bsum_pairs: Vec<__m512i>,
    /// Per tile, block and sub-block of 16: −32 × each row's sum of the sub-block's quants
    /// (ggml's `bsums`), one i32 per row — for Q6_K, whose quants enter `vpdpbusd` plus 32.
    corr6: Vec<__m512i>,
    /// Per tile and block: each row's scale `d`, one lane per row.
    d: Vec<__m512>,
}

// SAFETY: plain vectors of numbers.
unsafe impl Send for KTileActs {}
unsafe impl Sync for KTileActs {}

impl KTileActs {
    /// Regroups `n_rows` Q8_K activation rows of `nb` blocks each (from `data`) into tiles:
    /// every whole tile, and the rest as a last tile padded with zero rows if there are at
    /// least [`MIN_PARTIAL`] of them (fewer are left out: the plain dot products are as fast).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/DQ. Panics if `data` is not `n_rows` rows of `nb` Q8_K blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub unsafe fn new(data: &[u8], n_rows: usize, nb: usize) -> KTileActs {
        let blocks = BlockQ8K::slice(data).expect("whole Q8_K blocks");
        assert_eq!(blocks.len(), n_rows * nb, "activation rows");
        let tiles = n_rows / TILE + usize::from(n_rows % TILE >= MIN_PARTIAL);
        let mut q = vec![_mm512_setzero_si512(); tiles * nb * SUBS * 8];
        let mut bsum_pairs = vec![_mm512_setzero_si512(); tiles * nb * SUBS / 2];
        let mut corr6 = vec![_mm512_setzero_si512(); tiles * nb * 2 * SUBS];
        let mut d = vec![_mm512_setzero_ps(); tiles * nb];
        for tile in 0..tiles {
            for b in 0..nb {
                let mut dl = [0f32; TILE];
                let mut sums = [[0u32; TILE]; SUBS / 2];
                let mut corr = [[0i32; TILE]; 2 * SUBS];
                let at = (tile * nb + b) * SUBS;
                // SAFETY: the registers of this block are plain bytes, SUBS × 8 × 64 of them.
                let bytes = std::slice::from_raw_parts_mut(q.as_mut_ptr().add(at * 8).cast::<u8>(), SUBS * 8 * 64);
                for t in (0..TILE).take_while(|t| tile * TILE + t < n_rows) {
                    let y = &blocks[(tile * TILE + t) * nb + b];
                    dl[t] = y.scale();
                    for (j, c) in corr.iter_mut().enumerate() {
                        c[t] = -32 * y.bsum(j);
                    }
                    for s in 0..SUBS {
                        let sum = (y.bsum(2 * s) + y.bsum(2 * s + 1)) as i16 as u16 as u32;
                        sums[s / 2][t] |= sum << (16 * (s % 2));
                        for l in 0..8 {
                            let at = (s * 8 + l) * 64 + 4 * t;
                            bytes[at..at + 4].copy_from_slice(&y.qs[32 * s + 4 * l..32 * s + 4 * l + 4]);
                        }
                    }
                }
                d[tile * nb + b] = _mm512_loadu_ps(dl.as_ptr());
                for (k, sum) in sums.iter().enumerate() {
                    bsum_pairs[at / 2 + k] = _mm512_loadu_si512(sum.as_ptr().cast());
                }
                for (j, c) in corr.iter().enumerate() {
                    corr6[2 * at + j] = _mm512_loadu_si512(c.as_ptr().cast());
                }
            }
        }
        KTileActs { nb, q, bsum_pairs, corr6, d }
    }

    /// Tiles held (the last one may be padded).
    pub fn n_tiles(&self) -> usize {
        self.d.len() / self.nb.max(1)
    }
}

/// `R` Q4_K weight rows (Q5_K with `FIVE`: a fifth bit per quant, bit `j` of `qh[l]` for
/// sub-block `j`) against tile `tile`: lane `t` of row `r`'s result is its product with
/// the tile's row `t`, as the twin computes it — per block `yd · (d · Σ_j sc_j · dot_j) −
/// yd · dmin · Σ_j m_j · bsum_j`, the blocks summed in order from −0 (the twin's `sum()`).
/// Two weight rows share each load of the tile (64 KiB a row at 4096 columns: L2, not L1)
/// and give the `vpdpbusd` chains twice the independent work.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // `r` indexes several arrays at once
unsafe fn q4k_rows_tile_r<const VNNI: bool, const FIVE: bool, const R: usize>(w: [&[u8]; R], acts: &KTileActs, tile: usize) -> [[f32; TILE]; R] {
    let nb = acts.nb;
    // Block bytes and where the quants start (Q5_K has qh before them).
    let (bb, qs_at) = if FIVE { (176, 48) } else { (144, 16) };
    let bit4 = _mm512_set1_epi8(0x10);
    let q = acts.q.as_ptr().add(tile * nb * SUBS * 8);
    let bsum_pairs = acts.bsum_pairs.as_ptr().add(tile * nb * SUBS / 2);
    // Broadcast of 32-bit lane `j` of a register (a scale, or a pair of 16-bit mins).
    let lane: [__m512i; SUBS] = std::array::from_fn(|j| _mm512_set1_epi32(j as i32));
    let yd = acts.d.as_ptr().add(tile * nb);
    let nibbles = _mm512_set1_epi8(0x0F);
    let mut total = [_mm512_set1_ps(-0.0); R];
    for b in 0..nb {
        let mut blk = [std::ptr::null::<u8>(); R];
        for r in 0..R {
            debug_assert_eq!(w[r].len(), nb * bb);
            blk[r] = w[r].as_ptr().add(b * bb);
            _mm_prefetch::<_MM_HINT_T0>(blk[r].wrapping_add(super::matvec_avx512::LINEAR_AHEAD).cast());
        }
        let (qb, sb) = (q.add(b * SUBS * 8), bsum_pairs.add(b * SUBS / 2));
        let mut sum_sc = [_mm512_setzero_si512(); R];
        // Each row's eight scales (32-bit lanes 0–7) and its mins as 16-bit pairs (lanes 0–3);
        // Σ_j m_j · bsum_j by four `vpdpwssd` (or `pmaddwd` + add), exact integers.
        let mut scv = [_mm512_setzero_si512(); R];
        let mut sum_m = [_mm512_setzero_si512(); R];
        for r in 0..R {
            let (sc, mins) = k4_scales_mins(&*blk[r].add(4).cast());
            scv[r] = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128(sc as i64));
            let mv = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(mins as i64)));
            for k in 0..SUBS / 2 {
                sum_m[r] = dot_pairs_add::<VNNI>(sum_m[r], *sb.add(k), _mm512_permutexvar_epi32(lane[k], mv));
            }
        }
        for i in 0..4 {
            // Chunk i of 32 bytes: sub-block 2i in the low nibbles, 2i + 1 in the high ones.
            let mut lo = [_mm512_setzero_si512(); R];
            let mut hi = [_mm512_setzero_si512(); R];
            for l in 0..8 {
                let (a_lo, a_hi) = (*qb.add(2 * i * 8 + l), *qb.add((2 * i + 1) * 8 + l));
                for r in 0..R {
                    let x = _mm512_set1_epi32((blk[r].add(qs_at + 32 * i + 4 * l) as *const i32).read_unaligned());
                    let (mut u_lo, mut u_hi) = (_mm512_and_si512(x, nibbles), _mm512_and_si512(_mm512_srli_epi32::<4>(x), nibbles));
                    if FIVE {
                        // Bits 2i and 2i + 1 of qh[4l..4l + 4] moved to bit 4 of each byte.
                        let h = _mm512_set1_epi32((blk[r].add(16 + 4 * l) as *const i32).read_unaligned());
                        u_lo = _mm512_or_si512(u_lo, bit_to_4(h, 2 * i, bit4));
                        u_hi = _mm512_or_si512(u_hi, bit_to_4(h, 2 * i + 1, bit4));
                    }
                    lo[r] = dot_add::<VNNI>(lo[r], u_lo, a_lo);
                    hi[r] = dot_add::<VNNI>(hi[r], u_hi, a_hi);
                }
            }
            for r in 0..R {
                for (j, dot) in [(2 * i, lo[r]), (2 * i + 1, hi[r])] {
                    sum_sc[r] = _mm512_add_epi32(sum_sc[r], _mm512_mullo_epi32(dot, _mm512_permutexvar_epi32(lane[j], scv[r])));
                }
            }
        }
        let y = *yd.add(b);
        for r in 0..R {
            let (d, dmin) = (f16_at(blk[r]), f16_at(blk[r].add(2)));
            let a = _mm512_mul_ps(y, _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(sum_sc[r])));
            let m = _mm512_mul_ps(_mm512_mul_ps(y, _mm512_set1_ps(dmin)), _mm512_cvtepi32_ps(sum_m[r]));
            total[r] = _mm512_add_ps(total[r], _mm512_sub_ps(a, m));
        }
    }
    let mut out = [[0f32; TILE]; R];
    for r in 0..R {
        _mm512_storeu_ps(out[r].as_mut_ptr(), total[r]);
    }
    out
}

/// `R` Q6_K weight rows against tile `tile`, as the twin computes them — per block
/// `(d · yd) · Σ_j sc_j · dot_j` over its sixteen sub-blocks of 16, the blocks summed in order
/// from −0. Each lane's four quants enter `vpdpbusd` plus 32 (0–63: the low four bits from
/// `ql`, the top two from `qh`), the chain of a sub-block starting at −32 × its activation sum.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // `r` indexes several arrays at once
unsafe fn q6k_rows_tile_r<const VNNI: bool, const R: usize>(w: [&[u8]; R], acts: &KTileActs, tile: usize) -> [[f32; TILE]; R] {
    let nb = acts.nb;
    let q = acts.q.as_ptr().add(tile * nb * SUBS * 8);
    let corr = acts.corr6.as_ptr().add(tile * nb * 2 * SUBS);
    let yd = acts.d.as_ptr().add(tile * nb);
    let (low4, top2) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
    let mut total = [_mm512_set1_ps(-0.0); R];
    for b in 0..nb {
        let mut blk = [std::ptr::null::<u8>(); R];
        for r in 0..R {
            debug_assert_eq!(w[r].len(), nb * 210);
            blk[r] = w[r].as_ptr().add(b * 210);
            _mm_prefetch::<_MM_HINT_T0>(blk[r].wrapping_add(super::matvec_avx512::LINEAR_AHEAD).cast());
            _mm_prefetch::<_MM_HINT_T0>(blk[r].wrapping_add(super::matvec_avx512::LINEAR_AHEAD + 64).cast());
        }
        let (qb, cb) = (q.add(b * SUBS * 8), corr.add(b * 2 * SUBS));
        let mut sumi = [_mm512_setzero_si512(); R];
        // Each row's sixteen scales, one per 32-bit lane (a permute broadcasts one).
        let scv: [__m512i; R] = std::array::from_fn(|r| _mm512_cvtepi8_epi32(_mm_loadu_si128(blk[r].add(192).cast())));
        // Sub-block of 32 `s` = 4n + g: quants from ql[64n + 32 (g % 2)..] (low nibbles for
        // g < 2, high ones after) and bits 2g, 2g + 1 of qh[32n..]. The four g of one (n, k)
        // share their three broadcast loads.
        for n in 0..2 {
            for half in 0..2 {
                // Sub-block of 16 `j` = 2s + half: lanes k = 4 half..4 half + 4 of sub-block s.
                let mut dot = [[_mm512_setzero_si512(); R]; 4];
                for (g, dg) in dot.iter_mut().enumerate() {
                    *dg = [*cb.add(2 * (4 * n + g) + half); R];
                }
                for k in 4 * half..4 * half + 4 {
                    for r in 0..R {
                        let (ql0, ql1, qh) = (bcast4(blk[r].add(64 * n + 4 * k)), bcast4(blk[r].add(64 * n + 32 + 4 * k)), bcast4(blk[r].add(128 + 32 * n + 4 * k)));
                        for (g, dg) in dot.iter_mut().enumerate() {
                            let ql = if g % 2 == 0 { ql0 } else { ql1 };
                            let lo = if g < 2 { ql } else { _mm512_srli_epi32::<4>(ql) };
                            // Bits 2g, 2g + 1 of each qh byte moved to bits 4, 5.
                            let hi = match g {
                                0 => _mm512_slli_epi32::<4>(qh),
                                1 => _mm512_slli_epi32::<2>(qh),
                                2 => qh,
                                _ => _mm512_srli_epi32::<2>(qh),
                            };
                            let u = _mm512_or_si512(_mm512_and_si512(lo, low4), _mm512_and_si512(hi, top2));
                            dg[r] = dot_add::<VNNI>(dg[r], u, *qb.add((4 * n + g) * 8 + k));
                        }
                    }
                }
                for (g, dg) in dot.iter().enumerate() {
                    let j = 2 * (4 * n + g) + half;
                    for r in 0..R {
                        let sc = _mm512_permutexvar_epi32(_mm512_set1_epi32(j as i32), scv[r]);
                        sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(dg[r], sc));
                    }
                }
            }
        }
        let y = *yd.add(b);
        for r in 0..R {
            let dy = _mm512_mul_ps(_mm512_set1_ps(f16_at(blk[r].add(208))), y);
            total[r] = _mm512_add_ps(total[r], _mm512_mul_ps(dy, _mm512_cvtepi32_ps(sumi[r])));
        }
    }
    let mut out = [[0f32; TILE]; R];
    for r in 0..R {
        _mm512_storeu_ps(out[r].as_mut_ptr(), total[r]);
    }
    out
}

/// `acc` plus each i32 lane's two products of signed 16-bit halves of `a` and `b`.
#[inline(always)]
unsafe fn dot_pairs_add<const VNNI: bool>(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
    if VNNI {
        _mm512_dpwssd_epi32(acc, a, b)
    } else {
        _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
    }
}

/// Bit `k` (0–7) of every byte of `h` moved to bit 4 (`bit4`: 0x10 in every byte), the other
/// bits cleared.
#[inline(always)]
unsafe fn bit_to_4(h: __m512i, k: usize, bit4: __m512i) -> __m512i {
    let moved = if k <= 4 { _mm512_sllv_epi32(h, _mm512_set1_epi32(4 - k as i32)) } else { _mm512_srlv_epi32(h, _mm512_set1_epi32(k as i32 - 4)) };
    _mm512_and_si512(moved, bit4)
}

/// `acc` plus each i32 lane's four products of unsigned `u` and signed `s` bytes.
#[inline(always)]
unsafe fn dot_add<const VNNI: bool>(acc: __m512i, u: __m512i, s: __m512i) -> __m512i {
    if VNNI {
        _mm512_dpbusd_epi32(acc, u, s)
    } else {
        _mm512_add_epi32(acc, dot_u8i8::<false>(u, s))
    }
}

/// The four bytes at `p` in every 32-bit lane.
#[inline(always)]
unsafe fn bcast4(p: *const u8) -> __m512i {
    _mm512_set1_epi32((p as *const i32).read_unaligned())
}

#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    super::simd_x86::f16c_to_f32((p as *const [u8; 2]).read_unaligned())
}

/// The signature of the tile kernels below (weight rows, row bytes, acts, tile, one result
/// vector per weight row).
pub type KTileKernel = unsafe fn(&[u8], usize, &KTileActs, usize, &mut [[f32; TILE]]);

macro_rules! k_tile_fn {
    ($name:ident, $kernel:ident::<$($g:tt),*>, $features:literal, $doc:literal) => {
        #[doc = $doc]
        /// `w` holds `out.len()` weight rows of `row_bytes` each; `out[r]` gets row `r`'s
        /// products with the sixteen rows of tile `tile`.
        ///
        /// # Safety
        /// The CPU features named in `target_feature`; every weight row has `acts`' block
        /// count, `tile < acts.n_tiles()`. Panics if `w` is shorter than `out` needs.
        #[target_feature(enable = $features)]
        pub unsafe fn $name(w: &[u8], row_bytes: usize, acts: &KTileActs, tile: usize, out: &mut [[f32; TILE]]) {
            assert!(w.len() >= out.len() * row_bytes, "weight rows for every output");
            assert!(tile < acts.n_tiles(), "tile {tile} of {}", acts.n_tiles());
            // Two weight rows at a time, then the odd one.
            let n = out.len();
            for (pair, o) in w.chunks_exact(2 * row_bytes).zip(out.chunks_exact_mut(2)) {
                let [a, b] = $kernel::<$($g,)* 2>([&pair[..row_bytes], &pair[row_bytes..]], acts, tile);
                (o[0], o[1]) = (a, b);
            }
            if n % 2 == 1 {
                [out[n - 1]] = $kernel::<$($g,)* 1>([&w[(n - 1) * row_bytes..n * row_bytes]], acts, tile);
            }
        }
    };
}

k_tile_fn!(q4k_rows_tile, q4k_rows_tile_r::<false, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c", "Q4_K weight rows · a tile of Q8_K rows.");
k_tile_fn!(q4k_rows_tile_vnni, q4k_rows_tile_r::<true, false>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", "Q4_K weight rows · a tile of Q8_K rows, with `vpdpbusd`.");
k_tile_fn!(q6k_rows_tile, q6k_rows_tile_r::<false>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c", "Q6_K weight rows · a tile of Q8_K rows.");
k_tile_fn!(q6k_rows_tile_vnni, q6k_rows_tile_r::<true>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", "Q6_K weight rows · a tile of Q8_K rows, with `vpdpbusd`.");
k_tile_fn!(q5k_rows_tile, q4k_rows_tile_r::<false, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c", "Q5_K weight rows · a tile of Q8_K rows.");
k_tile_fn!(q5k_rows_tile_vnni, q4k_rows_tile_r::<true, true>, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", "Q5_K weight rows · a tile of Q8_K rows, with `vpdpbusd`.");
