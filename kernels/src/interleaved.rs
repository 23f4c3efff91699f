//! Q4_K, Q5_K, Q6_K, Q4_0, Q5_0 and Q5_1 weights repacked at load into groups of sixteen
//! interleaved rows, and the AVX-512 products of such a matrix with one to four Q8_K (Q8_0 for
//! Q4_0 and Q5_0, Q8_1 for Q5_1) activation rows
//! at a time: each of
//! a register's sixteen 32-bit lanes is one weight row, so a block's integer sums, its float
//! epilogue and the sum over blocks all run sixteen rows wide with no horizontal reduction.
//! The results are bit-identical to the scalar twin `dot::vec_dot_scalar` on the original
//! rows (the same integers, and the same float operations in the same order, lane by lane).
//!
//! llama.cpp's CPU "repack" buffers do the same for its AVX2/AVX-512 kernels (`block_q4_Kx8`:
//! eight rows); sixteen rows fill a 512-bit register's lanes.
//!
//! Layout: per group of sixteen rows, its blocks in order; in a group's block, every field of
//! the rows' ggml blocks cut into words (1, 2 or 4 bytes), word `i` of row `r` at
//! `at + 16·size·i + size·r`, so that one 64-byte line holds a 4-byte word of all sixteen rows
//! ([`Field`]; the tables [`Q4K_FIELDS`], [`Q5K_FIELDS`] and [`Q6K_FIELDS`]). A line of quants is then one
//! `vpdpbusd` operand against a broadcast word of activations.

use rayon::prelude::*;

use super::quant::{BlockQ8_0, BlockQ8_1, ByteBlock, GgmlType, QK_K};
use super::packed_slab::SlabBytes;

/// Rows per interleaved group: one per 32-bit lane of a 512-bit register.
pub const GROUP_ROWS: usize = 16;

/// One field of a ggml block in the interleaved layout: `len` bytes from `from` in the row's
/// block, in words of `size` bytes; word `i` of row `r` at `at + 16·size·i + size·r` in the
/// group's block.
#[derive(Clone, Copy)]
struct Field {
    from: usize,
    len: usize,
    size: usize,
    at: usize,
}

/// Q4_K (144-byte blocks; group block 2304 bytes): `d` and `dmin` (f16), the twelve bytes of
/// 6-bit scales and mins as three words, the 128 bytes of nibbles as 32 words (word `8p + c`:
/// low nibbles four quants of sub-block `2p`, high nibbles four of sub-block `2p + 1`).
const Q4K_FIELDS: [Field; 4] = [
    Field { from: 0, len: 2, size: 2, at: 0 },
    Field { from: 2, len: 2, size: 2, at: 32 },
    Field { from: 4, len: 12, size: 4, at: Q4K_SCALES_AT },
    Field { from: 16, len: 128, size: 4, at: Q4K_QS_AT },
];

/// Where a Q4_K group block's scales and nibbles start (see [`Q4K_FIELDS`]), and its bytes.
const Q4K_SCALES_AT: usize = 64;
const Q4K_QS_AT: usize = 256;
const Q4K_GROUP_BLOCK: usize = Q4K_QS_AT + 32 * 64;

/// Q5_K (176-byte blocks; group block 2816 bytes): Q4_K's fields, with the 32 bytes of fifth
/// bits as eight words between the scales and the nibbles (word `c`: the fifth bits of quants
/// `4c..4c + 4` of every pair of sub-blocks, bit `j` for sub-block `j`), so that the block is
/// read from start to end as Q4_K's is (its nibbles' word `8p + c` with its bits' word `c`).
const Q5K_FIELDS: [Field; 5] = [
    Field { from: 0, len: 2, size: 2, at: 0 },
    Field { from: 2, len: 2, size: 2, at: 32 },
    Field { from: 4, len: 12, size: 4, at: Q4K_SCALES_AT },
    Field { from: 16, len: 32, size: 4, at: Q5K_QH_AT },
    Field { from: 48, len: 128, size: 4, at: Q5K_QS_AT },
];

/// Where a Q5_K group block's fifth bits and nibbles start (see [`Q5K_FIELDS`]), and its bytes.
const Q5K_QH_AT: usize = Q4K_QS_AT;
const Q5K_QS_AT: usize = Q5K_QH_AT + 8 * 64;
const Q5K_GROUP_BLOCK: usize = Q5K_QS_AT + 32 * 64;

/// Q6_K (210-byte blocks; group block 3392 bytes): the sixteen 8-bit scales one byte each
/// (scale `j` of the sixteen rows in 16 bytes, widened by one `vpmovsxbd`), `d` (f16) and 32
/// bytes of padding, then the quants' 48 lines in the order the kernel reads them: for each
/// `k = 8n + c` (half `n` of the block, word `c`), the low four bits `ql` of words `16n + c`
/// and `16n + 8 + c`, then the high two bits `qh` of word `8n + c`. Read in that order the
/// block is one sequential stream; with `ql` and `qh` each in their own part of the block
/// (ggml's order) the kernel's reads hopped between three places in it and a 256 MiB Q6_K
/// matrix streamed at ~72 % of the machine's read bandwidth where Q4_K reached all of it.
const Q6K_FIELDS: [Field; 50] = q6k_fields();

/// Where the kernel finds a Q6_K group block's parts (see [`Q6K_FIELDS`]).
const Q6K_SCALES_AT: usize = 0;
const Q6K_D_AT: usize = 256;
const Q6K_QUANTS_AT: usize = 320;
/// A Q6_K group block's bytes: its quants are 16 words of three lines each.
const Q6K_GROUP_BLOCK: usize = Q6K_QUANTS_AT + 16 * 3 * 64;

const fn q6k_fields() -> [Field; 50] {
    let mut f = [Field { from: 0, len: 0, size: 1, at: 0 }; 50];
    f[0] = Field { from: 192, len: 16, size: 1, at: Q6K_SCALES_AT };
    f[1] = Field { from: 208, len: 2, size: 2, at: Q6K_D_AT };
    let mut k = 0;
    while k < 16 {
        let (n, c) = (k / 8, k % 8);
        let line = Q6K_QUANTS_AT + 64 * 3 * k;
        f[2 + 3 * k] = Field { from: 4 * (16 * n + c), len: 4, size: 4, at: line };
        f[3 + 3 * k] = Field { from: 4 * (16 * n + 8 + c), len: 4, size: 4, at: line + 64 };
        f[4 + 3 * k] = Field { from: 128 + 4 * (8 * n + c), len: 4, size: 4, at: line + 128 };
        k += 1;
    }
    f
}

/// Q4_0 (18-byte blocks of 32), two ggml blocks per group block (576 bytes, no padding: one
/// line of the 32 rows-and-blocks' `d`, then each block's 16 bytes of nibbles as 4 words: word
/// `i` holds quants `4i..4i + 4` in its low nibbles and `16 + 4i..` in its high ones). Fields
/// count from the start of the row's two consecutive blocks (36 bytes).
const Q40_FIELDS: [Field; 4] = [
    Field { from: 0, len: 2, size: 2, at: 0 },
    Field { from: 18, len: 2, size: 2, at: 32 },
    Field { from: 2, len: 16, size: 4, at: Q40_QS_AT },
    Field { from: 20, len: 16, size: 4, at: Q40_QS_AT + 4 * 64 },
];

/// Where a Q4_0 group block's nibbles start (see [`Q40_FIELDS`]: each block's 4 lines), and its
/// bytes.
const Q40_QS_AT: usize = 64;
const Q40_GROUP_BLOCK: usize = Q40_QS_AT + 2 * 4 * 64;

/// Q5_0 (22-byte blocks of 32), two ggml blocks per group block (704 bytes): the 32 rows-and-
/// blocks' `d` in one line, each block's 32 bits of fifth bits in a line (a 4-byte word per row:
/// bit `j` for quant `j`), then each block's 16 bytes of nibbles as 4 lines, as Q4_0's. Fields
/// count from the start of the row's two consecutive blocks (44 bytes).
const Q50_FIELDS: [Field; 6] = [
    Field { from: 0, len: 2, size: 2, at: 0 },
    Field { from: 22, len: 2, size: 2, at: 32 },
    Field { from: 2, len: 4, size: 4, at: Q50_QH_AT },
    Field { from: 24, len: 4, size: 4, at: Q50_QH_AT + 64 },
    Field { from: 6, len: 16, size: 4, at: Q50_QS_AT },
    Field { from: 28, len: 16, size: 4, at: Q50_QS_AT + 4 * 64 },
];

/// Where a Q5_0 group block's fifth bits and nibbles start (see [`Q50_FIELDS`]: a line of bits
/// and 4 of nibbles per block), and its bytes.
const Q50_QH_AT: usize = 64;
const Q50_QS_AT: usize = Q50_QH_AT + 2 * 64;
const Q50_GROUP_BLOCK: usize = Q50_QS_AT + 2 * 4 * 64;

/// Q5_1 (24-byte blocks of 32), two ggml blocks per group block (768 bytes): the blocks' `d`,
/// then their `m` (a line each pair), then Q5_0's fifth bits and nibbles. Fields count from the
/// start of the row's two consecutive blocks (48 bytes).
const Q51_FIELDS: [Field; 8] = [
    Field { from: 0, len: 2, size: 2, at: 0 },
    Field { from: 24, len: 2, size: 2, at: 32 },
    Field { from: 2, len: 2, size: 2, at: Q51_M_AT },
    Field { from: 26, len: 2, size: 2, at: Q51_M_AT + 32 },
    Field { from: 4, len: 4, size: 4, at: Q51_QH_AT },
    Field { from: 28, len: 4, size: 4, at: Q51_QH_AT + 64 },
    Field { from: 8, len: 16, size: 4, at: Q51_QS_AT },
    Field { from: 32, len: 16, size: 4, at: Q51_QS_AT + 4 * 64 },
];

/// Where a Q5_1 group block's `m`, fifth bits and nibbles start (see [`Q51_FIELDS`]), and its
/// bytes.
const Q51_M_AT: usize = 64;
const Q51_QH_AT: usize = Q51_M_AT + 64;
const Q51_QS_AT: usize = Q51_QH_AT + 2 * 64;
const Q51_GROUP_BLOCK: usize = Q51_QS_AT + 2 * 4 * 64;

// Every group block is its sixteen rows' units, nothing more (Q6_K's 32 bytes of padding aside).
const _: () = assert!(Q4K_GROUP_BLOCK == 16 * 144 && Q5K_GROUP_BLOCK == 16 * 176 && Q6K_GROUP_BLOCK == 16 * 210 + 32);
const _: () = assert!(Q40_GROUP_BLOCK == 16 * 36 && Q50_GROUP_BLOCK == 16 * 44 && Q51_GROUP_BLOCK == 16 * 48);

/// The layout of a type: how a row's unit (a run of whole ggml blocks) lies in a group's
/// block — its fields, the bytes of the group's block, and the unit's columns and bytes.
struct Layout {
    fields: &'static [Field],
    group_block: usize,
    unit_cols: usize,
    unit_bytes: usize,
}

fn layout(ty: GgmlType) -> Option<Layout> {
    let (fields, group_block, unit_cols): (&'static [Field], usize, usize) = match ty {
        GgmlType::Q4K => (&Q4K_FIELDS, Q4K_GROUP_BLOCK, QK_K),
        GgmlType::Q5K => (&Q5K_FIELDS, Q5K_GROUP_BLOCK, QK_K),
        GgmlType::Q6K => (&Q6K_FIELDS, Q6K_GROUP_BLOCK, QK_K),
        GgmlType::Q4_0 => (&Q40_FIELDS, Q40_GROUP_BLOCK, 64),
        GgmlType::Q5_0 => (&Q50_FIELDS, Q50_GROUP_BLOCK, 64),
        GgmlType::Q5_1 => (&Q51_FIELDS, Q51_GROUP_BLOCK, 64),
        _ => return None,
    };
    Some(Layout { fields, group_block, unit_cols, unit_bytes: ty.row_bytes(unit_cols) })
}

/// Whether matrices of type `ty` are repacked (the types with interleaved kernels).
pub fn packs(ty: GgmlType) -> bool {
    layout(ty).is_some()
}

/// A Q4_K, Q5_K, Q6_K, Q4_0, Q5_0 or Q5_1 matrix repacked into groups of [`GROUP_ROWS`] interleaved rows.
pub struct Interleaved {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    /// In a slab of huge pages where the kernel allows (every group block starts on a cache
    /// line).
    bytes: SlabBytes,
}

impl std::fmt::Debug for Interleaved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interleaved").field("ty", &self.ty).field("rows", &self.rows).field("cols", &self.cols).finish_non_exhaustive()
    }
}

impl Interleaved {
    /// Repacks `rows` rows of `cols` columns of type `ty` (`data`, ggml's layout), in
    /// parallel; `None` for another type, rows that do not fill whole groups, `data` that is
    /// not that matrix, or no memory for the copy.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Option<Self> {
        let Layout { fields, group_block, unit_cols, unit_bytes: block } = layout(ty)?;
        if rows == 0 || !rows.is_multiple_of(GROUP_ROWS) || !cols.is_multiple_of(unit_cols) || data.len() != rows * ty.row_bytes(cols) {
            return None;
        }
        let nb = cols / unit_cols;
        // Streamed once per token: from 4 KiB pages, a TLB miss every 4 KiB.
        let mut bytes = SlabBytes::alloc(rows / GROUP_ROWS * nb * group_block)?;
        let row_bytes = ty.row_bytes(cols);
        bytes.par_chunks_mut(nb * group_block).zip(data.par_chunks(GROUP_ROWS * row_bytes)).for_each(|(out, rows)| {
            for (b, out) in out.chunks_exact_mut(group_block).enumerate() {
                for r in 0..GROUP_ROWS {
                    let x = &rows[r * row_bytes + b * block..][..block];
                    for f in fields {
                        for i in 0..f.len / f.size {
                            out[f.at + 16 * f.size * i + f.size * r..][..f.size].copy_from_slice(&x[f.from + f.size * i..][..f.size]);
                        }
                    }
                }
            }
        });
        Some(Interleaved { ty, rows, cols, bytes })
    }

    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The columns of one unit of a row in a group's block (see [`Self::block`]).
    pub fn unit_cols(&self) -> usize {
        layout(self.ty).expect("a packed type").unit_cols
    }

    /// The packed bytes of group `g` (all its blocks).
    fn group(&self, g: usize) -> &[u8] {
        let l = layout(self.ty).expect("a packed type");
        let group_bytes = self.cols / l.unit_cols * l.group_block;
        &self.bytes[g * group_bytes..(g + 1) * group_bytes]
    }

    /// Row `r`'s unit `b` as ggml lays it out (the inverse of the packing; for tests): a
    /// block of Q4_K, Q5_K or Q6_K, two blocks of Q4_0, Q5_0 or Q5_1 ([`Self::unit_cols`] columns).
    pub fn block(&self, r: usize, b: usize) -> Vec<u8> {
        let Layout { fields, group_block, unit_bytes, .. } = layout(self.ty).expect("a packed type");
        let p = &self.group(r / GROUP_ROWS)[b * group_block..(b + 1) * group_block];
        let l = r % GROUP_ROWS;
        let mut out = vec![0u8; unit_bytes];
        for f in fields {
            for i in 0..f.len / f.size {
                out[f.from + f.size * i..][..f.size].copy_from_slice(&p[f.at + 16 * f.size * i + f.size * l..][..f.size]);
            }
        }
        out
    }
}

/// Whether this machine runs the interleaved kernels (AVX-512 F/BW/VL/DQ): elsewhere a
/// repacked copy would only cost memory. Where it does, they serve every batch size — a row
/// computes the same bits in any batch — and they are the faster kernels at each. Measured
/// (`cargo bench -p duet-cpu-worker --bench kernels -- --only Q`, 4096 columns, 2 threads):
/// Q4_K 23.6 → 29.8 GB/s at one row (the row kernel's per-block horizontal sums and scalar
/// epilogue were the limit), 115 → 232 G multiply-adds/s at 8 rows; Q6_K 35 → 77 GB/s at one
/// row from L3 (from DRAM about the same as the row kernel, both near the bandwidth, once the
/// prefetches were spread through the block), 65 → 143 at 8 rows, 133 → 193 at 16; Q4_0 14–23
/// → 49–78 GB/s at one row from L3, 87–95 → 159–184 at 8 rows, 139–144 → 164 at 16.
pub fn available() -> bool {
    super::isa() == super::Isa::Avx512
}

/// A product's activation rows as the interleaved kernels take them, made once per product
/// (not per task): the rows' bytes and, for Q8_0 and Q8_1 rows (Q4_0's, Q5_0's and Q5_1's
/// kernels), each block's [`ActBlock`].
pub struct GroupActs<'a> {
    ty: GgmlType,
    rows: Vec<&'a [u8]>,
    act_blocks: Vec<Vec<ActBlock>>,
}

/// What Q4_0's, Q5_0's and Q5_1's kernels take from a Q8_0 or Q8_1 activation block besides its
/// quants, computed once per product rather than once per group of weight rows: `Σ (q − 8)·a`
/// is taken as `Σ q·a − 8 Σ a` (Q5_0: `− 16 Σ a`), so `sum` = Σ a; `d` is the block's f16
/// scale as f32, and `s` a Q8_1 block's f16 `d · Σ a` as f32 (0 for Q8_0).
#[derive(Clone, Copy, Debug)]
pub struct ActBlock {
    sum: i32,
    d: f32,
    s: f32,
}

impl<'a> GroupActs<'a> {
    /// `rows` quantised to `ty` (Q8_K, or Q8_0). Panics on rows of partial blocks (a caller bug).
    pub fn new(ty: GgmlType, rows: Vec<&'a [u8]>) -> Self {
        let sum = |qs: &[u8]| qs.iter().map(|&q| i32::from(q as i8)).sum::<i32>();
        let act_blocks = match ty {
            GgmlType::Q8_0 => rows
                .iter()
                .map(|r| {
                    let blocks = BlockQ8_0::slice(r).expect("whole Q8_0 blocks");
                    blocks.iter().map(|b| ActBlock { sum: sum(&b.qs), d: super::quant::f16_bytes(b.d), s: 0.0 }).collect()
                })
                .collect(),
            GgmlType::Q8_1 => rows
                .iter()
                .map(|r| {
                    let blocks = BlockQ8_1::slice(r).expect("whole Q8_1 blocks");
                    blocks.iter().map(|b| ActBlock { sum: sum(&b.qs), d: super::quant::f16_bytes(b.d), s: super::quant::f16_bytes(b.s) }).collect()
                })
                .collect(),
            _ => Vec::new(),
        };
        GroupActs { ty, rows, act_blocks }
    }
}

/// `out[t * out_stride + r] = row r · acts[t]` for the rows of groups `groups` of `w` and
/// every activation row (Q8_K, or Q8_0 for Q4_0 and Q5_0, Q8_1 for Q5_1; `w.cols()` columns), four activation rows at
/// a time. Panics if the kernels are not [`available`] or the sizes disagree (caller bugs).
///
/// # Safety
/// `out` is valid for writes of as many rows of `out_stride` floats as `acts` has.
#[cfg(target_arch = "x86_64")]
pub unsafe fn matmul_groups(w: &Interleaved, groups: std::ops::Range<usize>, acts: &GroupActs<'_>, out: *mut f32, out_stride: usize) {
    assert!(available(), "the interleaved kernels need AVX-512");
    assert!(groups.end * GROUP_ROWS <= w.rows && out_stride >= w.rows);
    let nb = w.cols / w.unit_cols();
    assert!(acts.ty == super::dot::vec_dot_type(w.ty) && acts.rows.iter().all(|a| a.len() == acts.ty.row_bytes(w.cols)));
    let act_blocks: Vec<&[ActBlock]> = acts.act_blocks.iter().map(Vec::as_slice).collect();
    let kernel = avx512::kernel(w.ty, super::has_vnni());
    for g in groups {
        let packed = w.group(g);
        for (c, chunk) in acts.rows.chunks(4).enumerate() {
            let chunk_act_blocks = act_blocks.get(4 * c..4 * c + chunk.len()).unwrap_or(&[]);
            // SAFETY: the kernel's CPU features were detected; `packed` is `nb` group blocks
            // of `w.ty`, every activation row `nb` units of its type (asserted), with its
            // blocks' `ActBlock`s for Q4_0, Q5_0 and Q5_1; the caller's `out` holds a row of `out_stride` floats per
            // activation row, of which this writes group `g`'s.
            unsafe { kernel[chunk.len() - 1](packed, nb, chunk, chunk_act_blocks, out.add(4 * c * out_stride + g * GROUP_ROWS), out_stride) }
        }
    }
}

#[cfg(target_arch = "x86_64")]
// Lanes and activation rows are indexed by number: the loops are unrolled by the compiler.
#[allow(clippy::needless_range_loop)]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{GgmlType, ActBlock};
    use crate::quant::{BlockQ8K, BlockQ8_0, BlockQ8_1, ByteBlock};

    /// How far ahead of the block being read its group's stream is prefetched.
    const AHEAD: usize = crate::matvec_avx512::LINEAR_AHEAD;

    /// `acc + Σ` of four products of unsigned bytes `u` and signed bytes `s` per lane.
    #[inline(always)]
    unsafe fn dpbusd<const VNNI: bool>(acc: __m512i, u: __m512i, s: __m512i) -> __m512i {
        if VNNI {
            _mm512_dpbusd_epi32(acc, u, s)
        } else {
            _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)))
        }
    }

    /// A `vpshufb` index picking, in every 32-bit lane, the lane's own bytes `spec` names
    /// (one per output byte, 0–3; 0x80: zero). `vpshufb` indexes within 128-bit quarters, so
    /// lane `i` of a quarter adds `4i`. Built at compile time: built at run time, the tables
    /// cost a few thousand scalar instructions per kernel call (one per 16-row group).
    const fn lane_bytes(spec: [u8; 4]) -> [u8; 64] {
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
    static BYTE_OF_LANE: [[u8; 64]; 4] = [
        lane_bytes([0, 0x80, 0x80, 0x80]),
        lane_bytes([1, 0x80, 0x80, 0x80]),
        lane_bytes([2, 0x80, 0x80, 0x80]),
        lane_bytes([3, 0x80, 0x80, 0x80]),
    ];

    /// Bytes `2k` and `2k + 1` of every 32-bit lane as two zero-extended 16-bit halves, k = 0, 1.
    static BYTE_PAIR_OF_LANE: [[u8; 64]; 2] = [lane_bytes([0, 0x80, 1, 0x80]), lane_bytes([2, 0x80, 3, 0x80])];

    #[inline(always)]
    unsafe fn table(t: &[u8; 64]) -> __m512i {
        _mm512_loadu_si512(t.as_ptr().cast())
    }

    /// The activation block's sub-block sums (ggml's two `bsums` of 16 added) in 16-bit
    /// pairs: word `k` = sums of sub-blocks `2k` (low half) and `2k + 1` (high half). Written
    /// out: an array `map` here compiled to an out-of-line call per block.
    #[inline(always)]
    fn bsum_pairs(y: &BlockQ8K) -> [i32; 4] {
        let s = |j: usize| (y.bsum(2 * j) + y.bsum(2 * j + 1)) as u16 as u32;
        let pair = |k: usize| (s(2 * k) | (s(2 * k + 1) << 16)) as i32;
        [pair(0), pair(1), pair(2), pair(3)]
    }

    /// Four activation bytes at `p` broadcast to every lane.
    #[inline(always)]
    unsafe fn word(p: *const u8) -> __m512i {
        _mm512_set1_epi32((p as *const i32).read_unaligned())
    }

    /// Prefetches the line `AHEAD` bytes past `p` into L2, where `p` is a line the kernel is
    /// about to read: one prefetch per line read, spread through the block's arithmetic, so
    /// that the stream's requests stay evenly in flight. Measured (2 threads, alternating): the
    /// 1B-shape Q4_K_M model decoded 28.0–32.7 tok/s with each group block's lines prefetched
    /// in one burst at its start against 33.3–35.0 this way; a lone 256 MiB Q6_K matrix streamed
    /// 20.5–20.7 GB/s against 27.8–32.8 (the machine's sum: 32.8). Into L1 (17.5–17.9) or with
    /// no software prefetch (13.6–16.0) was slower; 4–32 KiB ahead about the same from 8 KiB.
    #[inline(always)]
    unsafe fn prefetch_line(p: *const u8) {
        _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(AHEAD).cast());
    }

    /// [`prefetch_line`] for each line of `bytes` bytes from `p` (a block's non-quant fields).
    #[inline(always)]
    unsafe fn prefetch_lines(p: *const u8, bytes: usize) {
        for off in (0..bytes).step_by(64) {
            prefetch_line(p.wrapping_add(off));
        }
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

    /// Byte `j` of every 32-bit lane in all four of its bytes, j = 0..3 (a lane's fifth-bit
    /// byte beside each of its quants).
    static BYTE_SPREAD: [[u8; 64]; 4] = [lane_bytes([0, 0, 0, 0]), lane_bytes([1, 1, 1, 1]), lane_bytes([2, 2, 2, 2]), lane_bytes([3, 3, 3, 3])];

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

    /// A kernel for one group against 1–4 activation rows (with their blocks' `ActBlock`s for
    /// Q4_0, Q5_0 and Q5_1).
    pub type GroupKernel = unsafe fn(&[u8], usize, &[&[u8]], &[&[ActBlock]], *mut f32, usize);

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
}
