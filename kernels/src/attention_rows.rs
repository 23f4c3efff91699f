//! What the AVX-512 and AVX2 group attention kernels share: their limits, the checks of their
//! arguments, the dispatch of a group's size to a kernel built for it, and the table of each
//! position's K and V row they read through.

#![cfg(target_arch = "x86_64")]

use super::attention::{KvRows, KvRun, Q8_0_BLOCK_BYTES};

/// Largest query group the kernels are built for (GQA ratios in use are 1 to 8).
pub const MAX_GROUP: usize = 8;

/// `$kernel::<G, $consts…>($args…)` with `G` the query group's size `$group` as a constant
/// (1 to [`MAX_GROUP`]; `checked_group` refuses larger groups before this is reached).
macro_rules! by_group {
    ($group:expr, $kernel:ident::<$($c:tt),*>($($arg:expr),* $(,)?)) => {
        match $group {
            1 => $kernel::<1, $($c),*>($($arg),*),
            2 => $kernel::<2, $($c),*>($($arg),*),
            3 => $kernel::<3, $($c),*>($($arg),*),
            4 => $kernel::<4, $($c),*>($($arg),*),
            5 => $kernel::<5, $($c),*>($($arg),*),
            6 => $kernel::<6, $($c),*>($($arg),*),
            7 => $kernel::<7, $($c),*>($($arg),*),
            _ => $kernel::<8, $($c),*>($($arg),*),
        }
    };
}
pub(crate) use by_group;

/// Whether the kernels take heads of `head_dim`.
pub fn supports_head_dim(head_dim: usize) -> bool {
    head_dim == 64 || head_dim == 128
}

/// The checks of both group kernels' arguments (panicking): a group of 1 to [`MAX_GROUP`]
/// heads of 64 or 128, whose size `q` and `out` agree with, and runs of K and V rows covering
/// `n > 0` positions. Returns the group's size and the heads' dimension.
pub(crate) fn checked_group(runs: &[KvRun<'_>], n: usize, q: &[f32], out: &[f32], lse: &[f32]) -> (usize, usize) {
    let group = lse.len();
    assert!((1..=MAX_GROUP).contains(&group), "query group of {group}");
    let hd = q.len() / group;
    assert!(supports_head_dim(hd) && q.len() == group * hd && out.len() == q.len(), "query group slice sizes");
    assert_eq!(runs.iter().map(|r| r.k.len()).sum::<usize>(), n * hd, "K rows cover the range");
    assert!(runs.iter().all(|r| r.v.len() == r.k.len()), "V rows match K rows");
    assert!(n > 0, "empty attention range");
    (group, hd)
}

/// The K and V row of every position of the range, from its start; V rows from dimension
/// `v_off` (the half of a row of 128 that a V pass of 64 dimensions reads).
#[derive(Debug, Default)]
pub(crate) struct RowTable {
    k: Vec<*const u8>,
    v: Vec<*const u8>,
    /// Dimensions skipped at the start of each V row (f16 rows only).
    pub(crate) v_off: usize,
}

impl RowTable {
    /// The rows of `runs` (heads of `hd`), all f16 or all Q8_0 as `q8` says (panics if not).
    pub(crate) fn fill(&mut self, runs: &[KvRun<'_>], hd: usize, q8: bool) {
        self.k.clear();
        self.v.clear();
        self.v_off = 0;
        let row_bytes = if q8 { hd / 32 * Q8_0_BLOCK_BYTES } else { 2 * hd };
        for run in runs {
            for (rows, table) in [(run.k, &mut self.k), (run.v, &mut self.v)] {
                let bytes: &[u8] = match (rows, q8) {
                    // SAFETY: f16 is two plain bytes.
                    (KvRows::F16(x), false) => unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), 2 * x.len()) },
                    (KvRows::Q8_0(b), true) => b,
                    _ => panic!("K/V rows of mixed types"),
                };
                table.extend(bytes.chunks_exact(row_bytes).map(|r| r.as_ptr()));
            }
        }
    }

    /// Safety: `i` is below the number of rows of the last fill.
    #[inline(always)]
    pub(crate) unsafe fn k(&self, i: usize) -> *const u8 {
        *self.k.get_unchecked(i)
    }

    /// Safety: as [`Self::k`].
    #[inline(always)]
    pub(crate) unsafe fn v(&self, i: usize) -> *const u8 {
        self.v.get_unchecked(i).add(2 * self.v_off)
    }
}
