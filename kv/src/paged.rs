//! One sequence's position range in a paged KV arena, as attention jobs name it: which
//! blocks hold it ([`PagedRange`], checked against an [`ArenaLayout`] by [`PagedRange::fits`])
//! and its K/V rows (f16 or Q8_0) read in place, one run per block ([`rows`]). Slices and
//! offsets only: the attention kernels take those rows and know nothing of the layout.

use duet_kernels::attention::{KvRows, KvRun};
use half::f16;

use super::{ArenaLayout, BlockId};

/// Read access to the K/V rows of a KV arena (a byte arena described by an
/// [`ArenaLayout`]; a shared-memory segment in the cpu-worker, a plain slice in tests).
pub trait ArenaRows: Sync {
    /// `count` f16 values starting at byte `offset` of the arena (`offset` is even). May
    /// panic if the range is outside the arena; callers check [`PagedRange::fits`] first.
    fn f16s(&self, offset: usize, count: usize) -> &[f16];
    /// `len` bytes starting at byte `offset`; may panic as [`Self::f16s`].
    fn bytes(&self, offset: usize, len: usize) -> &[u8];
}

/// An arena held as f16 values from byte 0 (header included), e.g. in tests.
impl ArenaRows for [f16] {
    fn f16s(&self, offset: usize, count: usize) -> &[f16] {
        assert!(offset.is_multiple_of(2), "f16 rows at odd byte offset {offset}");
        &self[offset / 2..offset / 2 + count]
    }

    fn bytes(&self, offset: usize, len: usize) -> &[u8] {
        // SAFETY: f16 is two plain bytes; the slice is bounds-checked below.
        let all = unsafe { std::slice::from_raw_parts(self.as_ptr().cast::<u8>(), 2 * self.len()) };
        &all[offset..offset + len]
    }
}

/// Where one sequence's K/V for the positions `start..end` lie in one layer, and the context
/// it belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedRange<'a> {
    pub layer: u32,
    /// Blocks in position order: `blocks[i]` holds positions `first_pos + i * block_size`
    /// onwards, position `p` at slot `(p - first_pos) % block_size`.
    pub blocks: &'a [BlockId],
    /// Position of slot 0 of `blocks[0]`.
    pub first_pos: usize,
    /// First position attended here.
    pub start: usize,
    /// One past the last position attended here.
    pub end: usize,
    /// Length of the sequence's whole context (all ranges, wherever they run): with
    /// `kv_padding` it decides the V lanes, as in single-process decode.
    pub n_ctx: usize,
    /// The KV padding unit (`duet_kernels::attention::KV_PADDING`).
    pub kv_padding: usize,
}

impl PagedRange<'_> {
    /// Whether this range can be attended in an arena of `layout`: an f16 or q8_0 arena, `layer` in
    /// range, `start < end <= n_ctx`, a non-zero padding, every block id in the arena and
    /// `first_pos <= start`, `end <= first_pos + blocks.len() * block_size`. The functions
    /// below assume it (and panic otherwise); job decoding checks each rule with its own error.
    pub fn fits(&self, layout: &ArenaLayout) -> bool {
        let bs = layout.block_size as usize;
        let covered = self.blocks.len().checked_mul(bs).and_then(|n| n.checked_add(self.first_pos));
        layout.validate().is_ok()
            && layout.dtype.attended()
            && self.layer < layout.n_layer
            && self.start < self.end
            && self.end <= self.n_ctx
            && self.kv_padding > 0
            && self.n_ctx.checked_next_multiple_of(self.kv_padding).is_some()
            && self.first_pos <= self.start
            && covered.is_some_and(|c| self.end <= c)
            && self.blocks.iter().all(|b| b.0 < layout.n_blocks)
    }
}

/// The K/V rows of `kv_head` for `r`'s positions, in place in `arena`: one run of
/// `[rows][head_dim]` per block, in position order, of the arena's type. Callers check `r.fits(layout)`
/// once per range (job decoding does), not once per call: this runs per task of every job.
/// Panics if it does not fit (the arena's `f16s` checks every slice) or `kv_head` is out of
/// range.
pub fn rows<'a, 'r, 'b, A: ArenaRows + ?Sized>(
    arena: &'a A,
    layout: &'r ArenaLayout,
    r: &'r PagedRange<'b>,
    kv_head: u32,
) -> impl Iterator<Item = KvRun<'a>> + use<'a, 'r, 'b, A> {
    debug_assert!(r.fits(layout), "paged range {r:?} does not fit arena {layout:?}");
    assert!(kv_head < layout.n_kv_head && r.start < r.end && r.first_pos <= r.start, "kv head {kv_head} of {}, range {r:?}", layout.n_kv_head);
    let hd = layout.head_dim as usize;
    let row = layout.row_bytes().expect("a validated layout");
    let q8 = layout.dtype == super::KvDtype::Q8_0;
    let rows = move |offset: usize, n: usize| match q8 {
        true => KvRows::Q8_0(arena.bytes(offset, n * row)),
        false => KvRows::F16(arena.f16s(offset, n * hd)),
    };
    block_runs(layout, r).map(move |(block, lo, n)| KvRun {
        k: rows(layout.k_offset(block, r.layer, kv_head) + lo * row, n),
        v: rows(layout.v_offset(block, r.layer, kv_head) + lo * row, n),
    })
}

/// The blocks of `r` in position order, each with the first slot attended in it and the
/// number of slots: `(block, lo, rows)`.
fn block_runs<'a>(layout: &ArenaLayout, r: &'a PagedRange<'_>) -> impl Iterator<Item = (BlockId, usize, usize)> + 'a {
    let bs = layout.block_size as usize;
    let first = (r.start - r.first_pos) / bs;
    let last = (r.end - 1 - r.first_pos) / bs;
    r.blocks.iter().enumerate().take(last + 1).skip(first).map(move |(i, &block)| {
        let block_pos = r.first_pos + i * bs;
        let lo = r.start.max(block_pos) - block_pos;
        let hi = r.end.min(block_pos + bs) - block_pos;
        (block, lo, hi - lo)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KvDtype;

    #[test]
    fn fits_checks_every_rule() {
        let layout = ArenaLayout {
            n_layer: 2,
            n_kv_head: 1,
            head_dim: 4,
            block_size: 4,
            dtype: KvDtype::F16,
            n_blocks: 8,
        };
        let blocks = [BlockId(3), BlockId(5)];
        let good = PagedRange { layer: 1, blocks: &blocks, first_pos: 4, start: 5, end: 12, n_ctx: 12, kv_padding: 32 };
        assert!(good.fits(&layout));
        let bad_blocks = [BlockId(3), BlockId(8)];
        for bad in [
            PagedRange { layer: 2, ..good },
            PagedRange { start: 12, ..good },
            PagedRange { n_ctx: 11, ..good },
            PagedRange { kv_padding: 0, ..good },
            PagedRange { first_pos: 6, ..good },
            PagedRange { end: 13, n_ctx: 13, ..good },
            PagedRange { blocks: &bad_blocks, ..good },
        ] {
            assert!(!bad.fits(&layout), "{bad:?}");
        }
        assert!(!good.fits(&ArenaLayout { dtype: KvDtype::BF16, ..layout }));
    }
}
