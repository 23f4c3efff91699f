//! AVX-512 matrix products for batches of activation rows (prefill, many sequences), for Q4_0,
//! Q4_1 and Q8_0 weights, bit-identical to one `vec_dot` per (weight row, activation row) —
//! ggml's arithmetic.
//!
//! Activation rows are regrouped once per product into pairs, so that one 512-bit register
//! holds two rows' quants of a block (row A in bytes 0–31, row B in bytes 32–63) next to their
//! scales (lanes 0–7 and 8–15). A weight block is unpacked once, put in both halves, and
//! multiplied with each pair by one `vpdpbusd` (or `maddubs` + `madd`): every lane computes
//! what a lane of the AVX2 kernel does for that (weight row, activation row). Full tiles of
//! sixteen rows (Q8_1 for Q4_1 weights; Q8_0 for Q4_0 and Q8_0 weights where the CPU has VNNI)
//! are also laid out lane-major — one register per ggml lane, one lane per activation row —
//! which saves the per-pair scale multiply.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::matvec_avx512::{dot_u8i8, hsum8};
use super::quant::GgmlType;

/// Activation rows per tile: eight pairs, whose accumulators stay in registers.
pub const TILE: usize = 16;

/// The activation rows of one product, regrouped for the kernels.
#[derive(Debug, Default)]
pub struct PairedActs {
    /// Blocks per row.
    nb: usize,
    /// Tiles of [`TILE`] rows (the last padded with zero rows).
    n_tiles: usize,
    /// Per tile, block and pair: 64 bytes of quants (A then B).
    qs: Vec<__m512i>,
    /// Per tile, block and pair: the two rows' scales `d`, 8 lanes each.
    d: Vec<__m512>,
    /// Per tile and block: each row's `s = d · sum(q)` (Q8_1 only), one lane per row.
    s: Vec<__m512>,
    /// Per full tile, block and ggml lane `l` (0–7): the four quants `4l..4l + 4` of every
    /// row of the tile, row `t` in bytes `4t..4t + 4` (the lane-major layout of
    /// `q4_1_rows_tile_lanes`, and of `q8_0_rows_tile_lanes` with VNNI).
    lanes: Vec<__m512i>,
    /// Per full tile, block and lane, for `q8_0_rows_tile_lanes`: −128 × the sum of each row's
    /// four quants of the lane, one i32 per row.
    corr: Vec<__m512i>,
    /// As `corr` for `q4_0_rows_tile_lanes`: −8 × the sum (`corr` / 16, exactly).
    corr8: Vec<__m512i>,
    /// Per full tile and block: each row's scale `d`, one lane per row.
    d16: Vec<__m512>,
}

// SAFETY: plain vectors of numbers.
unsafe impl Send for PairedActs {}
unsafe impl Sync for PairedActs {}

impl PairedActs {
    /// Regroups `n_rows` activation rows of `row_bytes` each (Q8_0 or Q8_1 blocks, `nb` per
    /// row) from `data`.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/DQ and F16C; `data` holds `n_rows * row_bytes` bytes of whole blocks
    /// of `act_ty`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub unsafe fn new(act_ty: GgmlType, data: &[u8], n_rows: usize, nb: usize) -> PairedActs {
        let (bb, qoff, has_s) = match act_ty {
            GgmlType::Q8_1 => (36, 4, true),
            GgmlType::Q8_0 => (34, 2, false),
            other => panic!("{other} is not a paired activation type"),
        };
        assert_eq!(data.len(), n_rows * nb * bb, "activation rows");
        let n_tiles = n_rows.div_ceil(TILE);
        let pairs = TILE / 2;
        let mut qs = vec![_mm512_setzero_si512(); n_tiles * nb * pairs];
        let mut d = vec![_mm512_setzero_ps(); n_tiles * nb * pairs];
        let mut s = vec![_mm512_setzero_ps(); if has_s { n_tiles * nb } else { 0 }];
        // Lane-major tiles: Q4_1's, and Q8_0's where the CPU has VNNI (`q8_0_rows_tile_lanes`).
        let q8_0_lanes = !has_s && super::has_vnni();
        let full_tiles = if has_s || q8_0_lanes { n_rows / TILE } else { 0 };
        let mut corr = vec![_mm512_setzero_si512(); if q8_0_lanes { full_tiles * nb * 8 } else { 0 }];
        let mut lanes = vec![_mm512_setzero_si512(); full_tiles * nb * 8];
        let mut d16 = vec![_mm512_setzero_ps(); full_tiles * nb];
        let block = |row: usize, b: usize| (row < n_rows).then(|| &data[(row * nb + b) * bb..(row * nb + b + 1) * bb]);
        let f16_at = |blk: &[u8], at: usize| half::f16::from_le_bytes([blk[at], blk[at + 1]]).to_f32();
        for tile in 0..n_tiles {
            for b in 0..nb {
                let mut s_lanes = [0f32; TILE];
                for p in 0..pairs {
                    let mut q = [0u8; 64];
                    let mut dl = [0f32; 16];
                    for half in 0..2 {
                        let row = tile * TILE + 2 * p + half;
                        if let Some(blk) = block(row, b) {
                            q[32 * half..32 * half + 32].copy_from_slice(&blk[qoff..qoff + 32]);
                            dl[8 * half..8 * half + 8].fill(f16_at(blk, 0));
                            if has_s {
                                s_lanes[2 * p + half] = f16_at(blk, 2);
                            }
                        }
                    }
                    let at = (tile * nb + b) * pairs + p;
                    qs[at] = _mm512_loadu_si512(q.as_ptr().cast());
                    d[at] = _mm512_loadu_ps(dl.as_ptr());
                }
                if has_s {
                    s[tile * nb + b] = _mm512_loadu_ps(s_lanes.as_ptr());
                }
                if tile < full_tiles {
                    let mut dl = [0f32; TILE];
                    // SAFETY: the registers of this block are plain bytes, 8 × 64 of them.
                    let bytes = std::slice::from_raw_parts_mut(lanes.as_mut_ptr().add((tile * nb + b) * 8).cast::<u8>(), 8 * 64);
                    for (t, dt) in dl.iter_mut().enumerate() {
                        let blk = block(tile * TILE + t, b).expect("a full tile's rows exist");
                        *dt = f16_at(blk, 0);
                        for l in 0..8 {
                            let quad = &blk[qoff + 4 * l..qoff + 4 * l + 4];
                            bytes[l * 64 + 4 * t..l * 64 + 4 * t + 4].copy_from_slice(quad);
                            if q8_0_lanes {
                                let c = -128 * quad.iter().map(|&q| q as i8 as i32).sum::<i32>();
                                // SAFETY: in bounds (full tile `tile`, block `b`, lane `l`, row `t`).
                                corr.as_mut_ptr().add((tile * nb + b) * 8 + l).cast::<i32>().add(t).write(c);
                            }
                        }
                    }
                    d16[tile * nb + b] = _mm512_loadu_ps(dl.as_ptr());
                }
            }
        }
        let corr8 = corr.iter().map(|&c| _mm512_srai_epi32::<4>(c)).collect();
        PairedActs { nb, n_tiles, qs, d, s, lanes, corr, corr8, d16 }
    }

    pub fn n_tiles(&self) -> usize {
        self.n_tiles
    }

    /// Whether tile `tile` holds [`TILE`] real rows (and so has the lane-major layout).
    pub fn is_full(&self, tile: usize) -> bool {
        tile < self.d16.len() / self.nb.max(1)
    }
}

#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    super::simd_x86::f16c_to_f32((p as *const [u8; 2]).read_unaligned())
}

/// The weight types of the tile kernels (a const parameter of theirs).
const Q8_0: u8 = 0;
const Q4_1: u8 = 1;
const Q4_0: u8 = 2;

/// `R` weight rows (of kind `KIND`: [`Q8_0`], [`Q4_1`] or [`Q4_0`]) against the first `2 * P`
/// rows of one tile of activation rows: `out[r][i]` for weight row `r` and the tile's row `i`
/// (the rest left zero). The weight rows share each load of the tile's blocks, as in
/// [`q4_1_rows_tile_lanes`].
#[inline(always)]
#[allow(clippy::needless_range_loop)] // `p` and `r` index several arrays at once
unsafe fn row_tile<const KIND: u8, const VNNI: bool, const P: usize, const R: usize>(w: [&[u8]; R], acts: &PairedActs, tile: usize) -> [[f32; TILE]; R] {
    const PAIRS: usize = TILE / 2;
    let nb = acts.nb;
    let bb = match KIND {
        Q4_1 => 20,
        Q4_0 => 18,
        _ => 34,
    };
    let qs = acts.qs.as_ptr().add(tile * nb * PAIRS);
    let ds = acts.d.as_ptr().add(tile * nb * PAIRS);
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    let mut summs = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        // Each weight row's block unpacked to signed or unsigned bytes (in both halves), with
        // its scale.
        let mut wx = [_mm512_setzero_si512(); R];
        let mut dx = [_mm512_setzero_ps(); R];
        for r in 0..R {
            debug_assert_eq!(w[r].len(), nb * bb);
            let blk = w[r].as_ptr().add(b * bb);
            // The rows of a task are read one after another: one stream, prefetched far ahead.
            _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(super::matvec_avx512::LINEAR_AHEAD).cast());
            dx[r] = _mm512_set1_ps(f16_at(blk));
            wx[r] = match KIND {
                Q4_1 => {
                    summs[r] = _mm512_add_ps(summs[r], _mm512_mul_ps(_mm512_set1_ps(f16_at(blk.add(2))), *acts.s.as_ptr().add(tile * nb + b)));
                    _mm512_broadcast_i64x4(nibbles_32(blk.add(4)))
                }
                // ggml's bytes_from_nibbles_32: low nibbles, then high nibbles, each minus 8.
                Q4_0 => _mm512_broadcast_i64x4(_mm256_sub_epi8(nibbles_32(blk.add(2)), _mm256_set1_epi8(8))),
                _ => _mm512_broadcast_i64x4(_mm256_loadu_si256(blk.add(2).cast())),
            };
        }
        // Signed weights (Q4_0, Q8_0): |w| as the unsigned operand, the sign moved onto y.
        let neg: [__mmask64; R] = std::array::from_fn(|r| _mm512_movepi8_mask(wx[r]));
        let ux: [__m512i; R] = std::array::from_fn(|r| if KIND == Q4_1 { wx[r] } else { _mm512_abs_epi8(wx[r]) });
        let at = b * PAIRS;
        for p in 0..P {
            let (y, dy) = (*qs.add(at + p), *ds.add(at + p));
            for r in 0..R {
                let sy = if KIND == Q4_1 { y } else { _mm512_mask_sub_epi8(y, neg[r], _mm512_setzero_si512(), y) };
                let x = dot_u8i8::<VNNI>(ux[r], sy);
                acc[r][p] = _mm512_fmadd_ps(_mm512_mul_ps(dx[r], dy), _mm512_cvtepi32_ps(x), acc[r][p]);
            }
        }
    }
    let mut out = [[0f32; TILE]; R];
    for r in 0..R {
        let mut s = [0f32; TILE];
        _mm512_storeu_ps(s.as_mut_ptr(), summs[r]);
        for p in 0..P {
            out[r][2 * p] = hsum8(_mm512_castps512_ps256(acc[r][p])) + s[2 * p];
            out[r][2 * p + 1] = hsum8(_mm512_extractf32x8_ps::<1>(acc[r][p])) + s[2 * p + 1];
        }
    }
    out
}

/// The 32 nibbles of a 16-byte block as bytes: the low nibbles, then the high ones.
#[inline(always)]
unsafe fn nibbles_32(qs: *const u8) -> __m256i {
    let raw = _mm_loadu_si128(qs.cast());
    _mm256_and_si256(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(raw), _mm_srli_epi16::<4>(raw)), _mm256_set1_epi8(0x0F))
}

/// `R` Q4_1 weight rows against a full tile of sixteen Q8_1 activation rows, lane-major: each
/// register holds one ggml lane (the integer sum of four quant products) for all sixteen rows,
/// so a block needs one `d_w · d_a` multiply for the whole tile instead of one per row pair
/// (16 rows: 167–176 → 211–214 G multiply-adds/s on 2 threads). Each lane's four weight quants
/// are broadcast by a load from the block rather than by shuffles from one unpacked register
/// (222–234 → 278–309 on 2 threads). The lanes are summed per row in `hsum8`'s order at the
/// end: the same numbers as [`row_tile`]. Two weight rows share each load of the tile's
/// blocks: a wide matrix's tile outgrows L1 (4096 columns: 40 KiB here, 128 KiB for the
/// Q8_0 and Q4_0 kernels below), and one row per pass read it from L2 once per weight row.
#[inline(always)]
unsafe fn q4_1_rows_tile_lanes<const VNNI: bool, const R: usize>(w: [&[u8]; R], acts: &PairedActs, tile: usize) -> [[f32; TILE]; R] {
    let nb = acts.nb;
    let lanes = acts.lanes.as_ptr().add(tile * nb * 8);
    let d16 = acts.d16.as_ptr().add(tile * nb);
    let sums = acts.s.as_ptr().add(tile * nb);
    let mut acc = [[_mm512_setzero_ps(); 8]; R];
    let mut summs = [_mm512_setzero_ps(); R];
    let nibbles = _mm512_set1_epi8(0x0F);
    for b in 0..nb {
        let mut d = [_mm512_setzero_ps(); R];
        for r in 0..R {
            debug_assert_eq!(w[r].len(), nb * 20);
            let blk = w[r].as_ptr().add(b * 20);
            _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(super::matvec_avx512::LINEAR_AHEAD).cast());
            d[r] = _mm512_mul_ps(_mm512_set1_ps(f16_at(blk)), *d16.add(b));
            summs[r] = _mm512_add_ps(summs[r], _mm512_mul_ps(_mm512_set1_ps(f16_at(blk.add(2))), *sums.add(b)));
        }
        // Lane l's four quants: the low nibbles of bytes 4l..4l + 4 (l < 4), or the high
        // nibbles of bytes 4(l - 4).. (l >= 4); each four-byte group is broadcast straight from
        // the block (a load, not a shuffle: shuffles were this loop's bottleneck).
        for k in 0..4 {
            let (a_lo, a_hi) = (*lanes.add(b * 8 + k), *lanes.add(b * 8 + 4 + k));
            for r in 0..R {
                let q = _mm512_set1_epi32((w[r].as_ptr().add(b * 20 + 4 + 4 * k) as *const i32).read_unaligned());
                let lo = _mm512_and_si512(q, nibbles);
                let hi = _mm512_and_si512(_mm512_srli_epi32::<4>(q), nibbles);
                acc[r][k] = _mm512_fmadd_ps(d[r], _mm512_cvtepi32_ps(dot_u8i8::<VNNI>(lo, a_lo)), acc[r][k]);
                acc[r][4 + k] = _mm512_fmadd_ps(d[r], _mm512_cvtepi32_ps(dot_u8i8::<VNNI>(hi, a_hi)), acc[r][4 + k]);
            }
        }
    }
    let mut out = [[0f32; TILE]; R];
    for r in 0..R {
        _mm512_storeu_ps(out[r].as_mut_ptr(), _mm512_add_ps(hsum8_lanes(&acc[r]), summs[r]));
    }
    out
}

/// `hsum8` of every row's eight lanes: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
#[inline(always)]
unsafe fn hsum8_lanes(acc: &[__m512; 8]) -> __m512 {
    let (a04, a26) = (_mm512_add_ps(acc[0], acc[4]), _mm512_add_ps(acc[2], acc[6]));
    let (a15, a37) = (_mm512_add_ps(acc[1], acc[5]), _mm512_add_ps(acc[3], acc[7]));
    _mm512_add_ps(_mm512_add_ps(a04, a26), _mm512_add_ps(a15, a37))
}

/// `R` Q8_0 weight rows against a full tile of sixteen Q8_0 activation rows, lane-major as
/// [`q4_1_rows_tile_lanes`], with `vpdpbusd` taking each lane's four weights plus 128 (broadcast
/// from the block) as its unsigned operand and the activations as its signed one: the
/// accumulator starts at −128 × each row's sum of the lane's activations, so every lane's
/// integer is exactly the sum of its four products, as the pairs' sign trick gives. No sign
/// handling per row pair, one scale multiply per block for the tile: 16 rows 215–219 → 274–280
/// G multiply-adds/s on 2 threads. (Sign handling per lane instead, 186–188; the weight sums
/// computed per block and read back from the stack, 197–204: a failed store forward.)
#[inline(always)]
unsafe fn q8_0_rows_tile_lanes<const R: usize>(w: [&[u8]; R], acts: &PairedActs, tile: usize) -> [[f32; TILE]; R] {
    signed_rows_tile_lanes::<Q8_0, 34, R>(w, acts.corr.as_ptr().add(tile * acts.nb * 8), acts, tile)
}

/// `R` Q4_0 weight rows against a full tile of sixteen Q8_0 activation rows, lane-major with
/// `vpdpbusd`: each lane's four nibbles (0–15, broadcast by a load from the block as in
/// [`q4_1_rows_tile_lanes`]) are the unsigned operand, and the accumulator starts at −8 × each
/// row's sum of the lane's activations, so every lane's integer is exactly ggml's
/// `Σ (q − 8) · a` of that lane.
#[inline(always)]
unsafe fn q4_0_rows_tile_lanes<const R: usize>(w: [&[u8]; R], acts: &PairedActs, tile: usize) -> [[f32; TILE]; R] {
    signed_rows_tile_lanes::<Q4_0, 18, R>(w, acts.corr8.as_ptr().add(tile * acts.nb * 8), acts, tile)
}

/// Lanes `k` and `k + 4`'s four weights each of a [`Q8_0`] block (plus 128) or a [`Q4_0`]
/// block (the nibbles, 0–15: one load for both) as unsigned bytes, in every i32 lane.
#[inline(always)]
unsafe fn lane_weights<const KIND: u8>(blk: *const u8, k: usize) -> [__m512i; 2] {
    #[inline(always)]
    unsafe fn at(blk: *const u8, i: usize) -> __m512i {
        _mm512_set1_epi32((blk.add(2 + 4 * i) as *const i32).read_unaligned())
    }
    if KIND == Q4_0 {
        let (q, nibbles) = (at(blk, k), _mm512_set1_epi8(0x0F));
        [_mm512_and_si512(q, nibbles), _mm512_and_si512(_mm512_srli_epi32::<4>(q), nibbles)]
    } else {
        let flip = _mm512_set1_epi8(-128);
        [_mm512_xor_si512(at(blk, k), flip), _mm512_xor_si512(at(blk, k + 4), flip)]
    }
}

/// The loop of the lane-major kernels with `vpdpbusd` and a per-lane correction `corr` (the
/// tile's, per block and lane): `R` weight rows of `KIND` with `BB`-byte blocks (an f16 scale
/// first).
#[inline(always)]
unsafe fn signed_rows_tile_lanes<const KIND: u8, const BB: usize, const R: usize>(
    w: [&[u8]; R],
    corr: *const __m512i,
    acts: &PairedActs,
    tile: usize,
) -> [[f32; TILE]; R] {
    let nb = acts.nb;
    let lanes = acts.lanes.as_ptr().add(tile * nb * 8);
    let d16 = acts.d16.as_ptr().add(tile * nb);
    let mut acc = [[_mm512_setzero_ps(); 8]; R];
    for b in 0..nb {
        let mut d = [_mm512_setzero_ps(); R];
        for r in 0..R {
            debug_assert_eq!(w[r].len(), nb * BB);
            let blk = w[r].as_ptr().add(b * BB);
            _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(super::matvec_avx512::LINEAR_AHEAD).cast());
            d[r] = _mm512_mul_ps(_mm512_set1_ps(f16_at(blk)), *d16.add(b));
        }
        for k in 0..4 {
            for r in 0..R {
                let wk = lane_weights::<KIND>(w[r].as_ptr().add(b * BB), k);
                for (h, &wl) in wk.iter().enumerate() {
                    let l = k + 4 * h;
                    let x = _mm512_dpbusd_epi32(*corr.add(b * 8 + l), wl, *lanes.add(b * 8 + l));
                    acc[r][l] = _mm512_fmadd_ps(d[r], _mm512_cvtepi32_ps(x), acc[r][l]);
                }
            }
        }
    }
    let mut out = [[0f32; TILE]; R];
    for r in 0..R {
        _mm512_storeu_ps(out[r].as_mut_ptr(), hsum8_lanes(&acc[r]));
    }
    out
}

/// The signature of the tile kernels below (weight rows, row bytes, acts, tile, rows of the
/// tile, one result vector per weight row).
pub type RowsTileKernel = unsafe fn(&[u8], usize, &PairedActs, usize, usize, &mut [[f32; TILE]]);

macro_rules! row_tile_fn {
    ($name:ident, $kind:expr, $vnni:expr, $features:literal, $doc:literal) => {
        #[doc = $doc]
        /// `w` holds `out.len()` weight rows of `row_bytes` each; `out[r]` gets row `r`'s
        /// products with the tile (one call for a run of rows: the kernel is chosen once and
        /// inlined into the loop). Only the tile's first `rows` rows are computed (the others
        /// are zero rows or beyond the batch): in pairs, rounded up to 1, 2, 4 or 8 pairs.
        ///
        /// # Safety
        /// The CPU features named in `target_feature`; every weight row has `acts`' block
        /// count, `tile < acts.n_tiles()`. Panics if `w` is shorter than `out` needs.
        #[target_feature(enable = $features)]
        pub unsafe fn $name(w: &[u8], row_bytes: usize, acts: &PairedActs, tile: usize, rows: usize, out: &mut [[f32; TILE]]) {
            assert!(w.len() >= out.len() * row_bytes, "weight rows for every output");
            if rows == TILE && acts.is_full(tile) && ($kind == Q4_1 || $vnni) {
                // Lane-major, two weight rows at a time (see `q4_1_rows_tile_lanes`), then
                // the odd one.
                macro_rules! lanes_kernel {
                    ($r:literal, $rows:expr) => {
                        match $kind {
                            Q4_1 => q4_1_rows_tile_lanes::<$vnni, $r>($rows, acts, tile),
                            Q4_0 => q4_0_rows_tile_lanes::<$r>($rows, acts, tile),
                            _ => q8_0_rows_tile_lanes::<$r>($rows, acts, tile),
                        }
                    };
                }
                let n = out.len();
                for (pair, o) in w.chunks_exact(2 * row_bytes).zip(out.chunks_exact_mut(2)) {
                    let [a, b] = lanes_kernel!(2, [&pair[..row_bytes], &pair[row_bytes..]]);
                    (o[0], o[1]) = (a, b);
                }
                if n % 2 == 1 {
                    [out[n - 1]] = lanes_kernel!(1, [&w[(n - 1) * row_bytes..n * row_bytes]]);
                }
                return;
            }
            // Two weight rows at a time, then the odd one, with pairs enough for `rows`.
            macro_rules! pairs_kernel {
                ($p:literal) => {{
                    let n = out.len();
                    for (pair, o) in w.chunks_exact(2 * row_bytes).zip(out.chunks_exact_mut(2)) {
                        let [a, b] = row_tile::<$kind, $vnni, $p, 2>([&pair[..row_bytes], &pair[row_bytes..]], acts, tile);
                        (o[0], o[1]) = (a, b);
                    }
                    if n % 2 == 1 {
                        [out[n - 1]] = row_tile::<$kind, $vnni, $p, 1>([&w[(n - 1) * row_bytes..n * row_bytes]], acts, tile);
                    }
                }};
            }
            match rows.div_ceil(2) {
                0 | 1 => pairs_kernel!(1),
                2 => pairs_kernel!(2),
                3 | 4 => pairs_kernel!(4),
                _ => pairs_kernel!(8),
            }
        }
    };
}

row_tile_fn!(q4_1_rows_tile, Q4_1, false, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c", "Q4_1 weight rows · a tile of Q8_1 rows.");
row_tile_fn!(q4_1_rows_tile_vnni, Q4_1, true, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", "Q4_1 weight rows · a tile of Q8_1 rows, with `vpdpbusd`.");
row_tile_fn!(q8_0_rows_tile, Q8_0, false, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c", "Q8_0 weight rows · a tile of Q8_0 rows.");
row_tile_fn!(q8_0_rows_tile_vnni, Q8_0, true, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", "Q8_0 weight rows · a tile of Q8_0 rows, with `vpdpbusd`.");
row_tile_fn!(q4_0_rows_tile, Q4_0, false, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c", "Q4_0 weight rows · a tile of Q8_0 rows.");
row_tile_fn!(q4_0_rows_tile_vnni, Q4_0, true, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", "Q4_0 weight rows · a tile of Q8_0 rows, with `vpdpbusd`.");
