//! Q4_K, Q5_K, Q6_K, Q4_0, Q5_0 and Q5_1 (and with AVX2, Q4_1) weights repacked at load into
//! groups of sixteen interleaved rows, and the products of such a matrix with one to four Q8_K
//! (Q8_0 for Q4_0 and Q5_0, Q8_1 for Q4_1 and Q5_1) activation rows at a time (`avx512`; `avx2`, eight rows a
//! register): each of a register's 32-bit lanes is one weight row, so a block's integer sums,
//! its float epilogue and the sum over blocks all run a register's rows wide with no
//! horizontal reduction.
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

/// Q4_1 (20-byte blocks of 32), two ggml blocks per group block (640 bytes): the blocks' `d`,
/// then their `m` (a line each pair), then each block's 16 bytes of nibbles as 4 lines, as
/// Q4_0's. Fields count from the start of the row's two consecutive blocks (40 bytes). AVX2
/// only: AVX-512 multiplies Q4_1 in ggml's layout on its paired tiles (`matmul_avx512`).
const Q41_FIELDS: [Field; 6] = [
    Field { from: 0, len: 2, size: 2, at: 0 },
    Field { from: 20, len: 2, size: 2, at: 32 },
    Field { from: 2, len: 2, size: 2, at: Q41_M_AT },
    Field { from: 22, len: 2, size: 2, at: Q41_M_AT + 32 },
    Field { from: 4, len: 16, size: 4, at: Q41_QS_AT },
    Field { from: 24, len: 16, size: 4, at: Q41_QS_AT + 4 * 64 },
];

/// Where a Q4_1 group block's `m` and nibbles start (see [`Q41_FIELDS`]), and its bytes.
const Q41_M_AT: usize = 64;
const Q41_QS_AT: usize = Q41_M_AT + 64;
const Q41_GROUP_BLOCK: usize = Q41_QS_AT + 2 * 4 * 64;

/// Where a Q5_1 group block's `m`, fifth bits and nibbles start (see [`Q51_FIELDS`]), and its
/// bytes.
const Q51_M_AT: usize = 64;
const Q51_QH_AT: usize = Q51_M_AT + 64;
const Q51_QS_AT: usize = Q51_QH_AT + 2 * 64;
const Q51_GROUP_BLOCK: usize = Q51_QS_AT + 2 * 4 * 64;

// Every group block is its sixteen rows' units, nothing more (Q6_K's 32 bytes of padding aside).
const _: () = assert!(Q4K_GROUP_BLOCK == 16 * 144 && Q5K_GROUP_BLOCK == 16 * 176 && Q6K_GROUP_BLOCK == 16 * 210 + 32);
const _: () = assert!(Q40_GROUP_BLOCK == 16 * 36 && Q41_GROUP_BLOCK == 16 * 40 && Q50_GROUP_BLOCK == 16 * 44 && Q51_GROUP_BLOCK == 16 * 48);

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
        GgmlType::Q4_1 => (&Q41_FIELDS, Q41_GROUP_BLOCK, 64),
        GgmlType::Q5_0 => (&Q50_FIELDS, Q50_GROUP_BLOCK, 64),
        GgmlType::Q5_1 => (&Q51_FIELDS, Q51_GROUP_BLOCK, 64),
        _ => return None,
    };
    Some(Layout { fields, group_block, unit_cols, unit_bytes: ty.row_bytes(unit_cols) })
}

/// Whether matrices of type `ty` are repacked on this machine (the types its interleaved
/// kernels take; where it has none, [`available`] says so).
pub fn packs(ty: GgmlType) -> bool {
    layout(ty).is_some() && !(ty == GgmlType::Q4_1 && super::isa() == super::Isa::Avx512)
}

/// A Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0 or Q5_1 matrix repacked into groups of [`GROUP_ROWS`] interleaved rows.
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
    /// block of Q4_K, Q5_K or Q6_K, two blocks of Q4_0, Q4_1, Q5_0 or Q5_1 ([`Self::unit_cols`] columns).
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

/// Whether this machine runs the interleaved kernels (AVX-512 F/BW/VL/DQ, or AVX2 + FMA +
/// F16C): elsewhere a repacked copy would only cost memory. Where it does, they serve every
/// batch size — a row computes the same bits in any batch — and they are the faster kernels at
/// each. Measured (`cargo bench -p duet-cpu-worker --bench kernels -- --only Q`, 4096 columns,
/// 2 threads), AVX-512: Q4_K 23.6 → 29.8 GB/s at one row (the row kernel's per-block
/// horizontal sums and scalar epilogue were the limit), 115 → 232 G multiply-adds/s at 8 rows;
/// Q6_K 35 → 77 GB/s at one row from L3 (from DRAM about the same as the row kernel, both near
/// the bandwidth, once the prefetches were spread through the block), 65 → 143 at 8 rows, 133
/// → 193 at 16; Q4_0 14–23 → 49–78 GB/s at one row from L3, 87–95 → 159–184 at 8 rows,
/// 139–144 → 164 at 16. AVX2: see docs/kernels.md ("Without AVX-512").
pub fn available() -> bool {
    matches!(super::isa(), super::Isa::Avx512 | super::Isa::Avx2)
}

/// A kernel for one group against 1–4 activation rows (with their blocks' `ActBlock`s for
/// Q4_0, Q4_1, Q5_0 and Q5_1).
type GroupKernel = unsafe fn(&[u8], usize, &[&[u8]], &[&[ActBlock]], *mut f32, usize);

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
/// every activation row (Q8_K, or Q8_0 for Q4_0 and Q5_0, Q8_1 for Q4_1 and Q5_1; `w.cols()` columns), four activation rows at
/// a time, with the kernels of this machine's [`super::isa`]. Panics if the kernels are not
/// [`available`] or the sizes disagree (caller bugs).
///
/// # Safety
/// `out` is valid for writes of as many rows of `out_stride` floats as `acts` has.
#[cfg(target_arch = "x86_64")]
pub unsafe fn matmul_groups(w: &Interleaved, groups: std::ops::Range<usize>, acts: &GroupActs<'_>, out: *mut f32, out_stride: usize) {
    // SAFETY: the caller's.
    unsafe { matmul_groups_with(super::isa(), w, groups, acts, out, out_stride) }
}

/// [`matmul_groups`] with the kernels of `isa` (AVX-512 or AVX2; for tests, which run the AVX2
/// kernels on AVX-512 machines too). Panics if this CPU lacks `isa`'s features.
///
/// # Safety
/// As [`matmul_groups`].
#[cfg(target_arch = "x86_64")]
pub unsafe fn matmul_groups_with(isa: super::Isa, w: &Interleaved, groups: std::ops::Range<usize>, acts: &GroupActs<'_>, out: *mut f32, out_stride: usize) {
    let kernel = match isa {
        super::Isa::Avx512 if super::isa() == super::Isa::Avx512 => avx512::kernel(w.ty, super::has_vnni()),
        super::Isa::Avx2 if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") => avx2::kernel(w.ty),
        _ => panic!("the interleaved kernels need AVX2 or AVX-512, and {isa:?} on this CPU"),
    };
    assert!(groups.end * GROUP_ROWS <= w.rows && out_stride >= w.rows);
    let nb = w.cols / w.unit_cols();
    assert!(acts.ty == super::dot::vec_dot_type(w.ty) && acts.rows.iter().all(|a| a.len() == acts.ty.row_bytes(w.cols)));
    let act_blocks: Vec<&[ActBlock]> = acts.act_blocks.iter().map(Vec::as_slice).collect();
    for g in groups {
        let packed = w.group(g);
        for (c, chunk) in acts.rows.chunks(4).enumerate() {
            let chunk_act_blocks = act_blocks.get(4 * c..4 * c + chunk.len()).unwrap_or(&[]);
            // SAFETY: the kernel's CPU features were detected; `packed` is `nb` group blocks
            // of `w.ty`, every activation row `nb` units of its type (asserted), with its
            // blocks' `ActBlock`s for Q4_0, Q4_1, Q5_0 and Q5_1; the caller's `out` holds a row of `out_stride` floats per
            // activation row, of which this writes group `g`'s.
            unsafe { kernel[chunk.len() - 1](packed, nb, chunk, chunk_act_blocks, out.add(4 * c * out_stride + g * GROUP_ROWS), out_stride) }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod lanes;
