//! Which blocks of which cpu-worker hold which sequence's tokens: a [`KvPool`] of per-worker
//! block allocators and a per-sequence [`BlockTable`] (after TGI's `block_allocator.rs` and
//! vLLM's `KVCacheBlocks`).
//!
//! **Leaks are impossible by construction.** A worker's `BlockAllocator` (a free list over
//! its arena's `n_blocks`) is private to this module: the only way to take blocks out of a
//! pool is [`BlockTable::append_tokens`], and a table holds a clone of its pool's handle (an
//! `Arc<Mutex<..>>` over all the workers' allocators) and gives every block back to that
//! pool when it is truncated or dropped. A table cannot outlive its pool's state or return
//! blocks to another pool, and nothing needs to remember to call a `release`. The mutex is
//! held only for the few instructions of an allocation or a free, so the scheduler, the
//! session store and a disconnecting stream's task may all hold tables; the design's "one
//! task behind a cloneable handle" is this handle, with no async runtime in a pure crate.
//!
//! Token position `p` of a sequence lives in entry `p / block_size` of its table, at slot
//! `p % block_size` of that block; a table always holds exactly `ceil(len / block_size)`
//! blocks. Bookkeeping errors (a double free, a position past the end) panic: they are bugs
//! that would otherwise corrupt another sequence's KV.

use std::collections::BTreeSet;
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::KvError;

/// A block of one worker's arena; the same id names the block in every layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockId(pub u32);

/// A cpu-worker (one per NUMA node), numbered from 0 in the order given to [`KvPool::new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerId(pub u32);

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The free blocks of one arena.
#[derive(Debug)]
struct BlockAllocator {
    /// Free blocks, handed out lowest id first: a sequence's blocks then tend to be
    /// consecutive, so that each KV head of it is one span of the run-major arena (attention
    /// reads it as one stream). A stack (the block freed last reused first) scattered them once
    /// sessions had come and gone: a 4K-token decode after rounds of 32 sessions ran at 124–134
    /// tok/s against 139–153 lowest first (servers run back to back).
    free: BTreeSet<u32>,
    in_use: Vec<bool>,
}

impl BlockAllocator {
    fn new(n_blocks: u32) -> Self {
        BlockAllocator { free: (0..n_blocks).collect(), in_use: vec![false; n_blocks as usize] }
    }

    fn n_free(&self) -> usize {
        self.free.len()
    }

    fn n_used(&self) -> usize {
        self.in_use.len() - self.free.len()
    }

    /// The `n` lowest free blocks in ascending order, or none at all and
    /// [`KvError::OutOfBlocks`].
    fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>, KvError> {
        if n > self.free.len() {
            return Err(KvError::OutOfBlocks { wanted: n, free: self.free.len() });
        }
        let blocks: Vec<BlockId> = (0..n).filter_map(|_| self.free.pop_first()).map(BlockId).collect();
        for b in &blocks {
            let used = &mut self.in_use[b.0 as usize];
            assert!(!*used, "block {b} is on the free list and in use");
            *used = true;
        }
        Ok(blocks)
    }

    /// Panics if `block` is not allocated (a double free or a foreign id).
    fn free(&mut self, block: BlockId) {
        let used = self.in_use.get_mut(block.0 as usize);
        assert!(used.as_deref() == Some(&true), "freeing block {block}, which is not allocated");
        *used.unwrap() = false;
        self.free.insert(block.0);
    }
}

/// Where [`BlockTable::append_tokens`] puts the blocks it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Every new block on this worker (the balancer's choice); [`KvError::OutOfBlocks`] if it
    /// lacks them, whatever the other workers have free.
    Worker(WorkerId),
    /// Each new block on the worker with the most free blocks (the lowest id on a tie), so
    /// the workers fill evenly.
    MostFree,
}

/// A cloneable handle to the block allocators of all cpu-workers. Clones share the state.
#[derive(Debug, Clone)]
pub struct KvPool {
    workers: Arc<Mutex<Vec<BlockAllocator>>>,
    n_workers: usize,
    block_size: usize,
}

impl KvPool {
    /// A pool of `blocks_per_worker.len()` workers, worker `i` with `blocks_per_worker[i]`
    /// blocks of `block_size` tokens. Panics if `block_size` is zero or there is no worker.
    pub fn new(block_size: usize, blocks_per_worker: &[u32]) -> Self {
        assert!(block_size > 0, "KV block size must be positive");
        assert!(!blocks_per_worker.is_empty(), "a KV pool needs at least one worker");
        let workers = blocks_per_worker.iter().map(|&n| BlockAllocator::new(n)).collect();
        KvPool {
            workers: Arc::new(Mutex::new(workers)),
            n_workers: blocks_per_worker.len(),
            block_size,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn n_workers(&self) -> usize {
        self.n_workers
    }

    /// Free blocks of `worker`. Panics if there is no such worker.
    pub fn n_free(&self, worker: WorkerId) -> usize {
        self.lock()[worker.0 as usize].n_free()
    }

    /// Blocks of `worker` held by tables. Panics if there is no such worker.
    pub fn n_used(&self, worker: WorkerId) -> usize {
        self.lock()[worker.0 as usize].n_used()
    }

    /// An empty table whose blocks come from, and go back to, this pool.
    pub fn new_table(&self) -> BlockTable {
        BlockTable { pool: self.clone(), blocks: Vec::new(), len: 0 }
    }

    /// The allocators. Only a bookkeeping assertion (a bug) can panic while the lock is
    /// held; poison is ignored so that the tables dropped while unwinding still give their
    /// blocks back instead of panicking a second time.
    fn lock(&self) -> MutexGuard<'_, Vec<BlockAllocator>> {
        self.workers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Up to `n` new blocks placed as `placement` says: all of them or none.
    fn allocate(
        &self,
        n: usize,
        placement: Placement,
    ) -> Result<Vec<(WorkerId, BlockId)>, KvError> {
        let mut workers = self.lock();
        match placement {
            Placement::Worker(w) => {
                // The table checked that the worker exists.
                Ok(workers[w.0 as usize].allocate(n)?.into_iter().map(|b| (w, b)).collect())
            }
            Placement::MostFree => {
                let free: usize = workers.iter().map(BlockAllocator::n_free).sum();
                if n > free {
                    return Err(KvError::OutOfBlocks { wanted: n, free });
                }
                let mut out = Vec::with_capacity(n);
                for _ in 0..n {
                    // max_by_key returns the last maximum; reverse to prefer the lowest id.
                    let (i, alloc) = workers
                        .iter_mut()
                        .enumerate()
                        .rev()
                        .max_by_key(|(_, a)| a.n_free())
                        .expect("at least one worker");
                    let block = alloc.allocate(1).expect("counted as free")[0];
                    out.push((WorkerId(i as u32), block));
                }
                Ok(out)
            }
        }
    }

    fn free(&self, blocks: impl IntoIterator<Item = (WorkerId, BlockId)>) {
        let mut workers = self.lock();
        for (w, b) in blocks {
            workers[w.0 as usize].free(b);
        }
    }
}

/// Where one token position's K and V live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenSlot {
    pub worker: WorkerId,
    pub block: BlockId,
    /// Token index within the block, below the block size.
    pub slot: usize,
}

/// The blocks holding one sequence's KV for positions `0..len`, in position order. Its
/// blocks go back to the pool when it is truncated or dropped.
#[derive(Debug)]
pub struct BlockTable {
    pool: KvPool,
    blocks: Vec<(WorkerId, BlockId)>,
    len: usize,
}

impl BlockTable {
    /// Token positions covered.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Entry `i` holds positions `i * block_size ..` of the sequence.
    pub fn blocks(&self) -> &[(WorkerId, BlockId)] {
        &self.blocks
    }

    /// Extends the sequence by `n` positions, allocating blocks only once the last block is
    /// full. On error nothing changes (no block is taken, `len` stays).
    pub fn append_tokens(&mut self, n: usize, placement: Placement) -> Result<(), KvError> {
        if let Placement::Worker(w) = placement {
            if w.0 as usize >= self.pool.n_workers {
                return Err(KvError::UnknownWorker { worker: w, n_workers: self.pool.n_workers });
            }
        }
        let new_len = self.len.checked_add(n).expect("sequence length overflows usize");
        let wanted = new_len.div_ceil(self.pool.block_size) - self.blocks.len();
        if wanted > 0 {
            let new = self.pool.allocate(wanted, placement)?;
            self.blocks.extend(new);
        }
        self.len = new_len;
        self.check();
        Ok(())
    }

    /// Where position `pos` lives. Panics if `pos >= len()`.
    pub fn slot(&self, pos: usize) -> TokenSlot {
        assert!(pos < self.len, "position {pos} is past the sequence's {} tokens", self.len);
        let bs = self.pool.block_size;
        let (worker, block) = self.blocks[pos / bs];
        TokenSlot { worker, block, slot: pos % bs }
    }

    /// The maximal runs of consecutive positions held by one worker, in position order:
    /// together they cover `0..len` exactly once. Attention is split along these ranges.
    pub fn token_ranges_per_worker(&self) -> Vec<(WorkerId, Range<usize>)> {
        let bs = self.pool.block_size;
        let mut runs: Vec<(WorkerId, Range<usize>)> = Vec::new();
        for (i, &(w, _)) in self.blocks.iter().enumerate() {
            let end = ((i + 1) * bs).min(self.len);
            match runs.last_mut() {
                Some((last, range)) if *last == w => range.end = end,
                _ => runs.push((w, i * bs..end)),
            }
        }
        runs
    }

    /// Shortens the sequence to `len` positions and gives back the blocks wholly past it;
    /// does nothing if `len >= self.len()`, as `Vec::truncate`.
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len {
            return;
        }
        let keep = len.div_ceil(self.pool.block_size);
        self.pool.free(self.blocks.drain(keep..));
        self.len = len;
        self.check();
    }

    fn check(&self) {
        debug_assert_eq!(self.blocks.len(), self.len.div_ceil(self.pool.block_size));
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        self.pool.free(self.blocks.drain(..));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W0: WorkerId = WorkerId(0);
    const W1: WorkerId = WorkerId(1);

    fn ids(blocks: &[(WorkerId, BlockId)]) -> Vec<u32> {
        blocks.iter().map(|(_, b)| b.0).collect()
    }

    #[test]
    fn allocator_hands_out_each_block_once() {
        let mut a = BlockAllocator::new(4);
        assert_eq!((a.n_free(), a.n_used()), (4, 0));
        assert_eq!(a.allocate(3), Ok(vec![BlockId(0), BlockId(1), BlockId(2)]));
        assert_eq!((a.n_free(), a.n_used()), (1, 3));
        assert_eq!(a.allocate(0), Ok(vec![]));
        assert_eq!(a.allocate(1), Ok(vec![BlockId(3)]));
        assert_eq!((a.n_free(), a.n_used()), (0, 4));
    }

    #[test]
    fn allocator_exhaustion_allocates_nothing() {
        let mut a = BlockAllocator::new(4);
        a.allocate(3).unwrap();
        assert_eq!(a.allocate(2), Err(KvError::OutOfBlocks { wanted: 2, free: 1 }));
        assert_eq!((a.n_free(), a.n_used()), (1, 3));
        assert_eq!(a.allocate(1).map(|v| v.len()), Ok(1));
    }

    #[test]
    fn allocator_hands_out_the_lowest_free_blocks_in_order() {
        let mut a = BlockAllocator::new(8);
        let blocks = a.allocate(5).unwrap();
        assert_eq!(blocks, (0..5).map(BlockId).collect::<Vec<_>>());
        // Freed out of order, they come back ascending and consecutive.
        for b in [blocks[3], blocks[1], blocks[2]] {
            a.free(b);
        }
        assert_eq!((a.n_free(), a.n_used()), (6, 2));
        assert_eq!(a.allocate(4), Ok([1, 2, 3, 5].map(BlockId).to_vec()));
    }

    #[test]
    #[should_panic(expected = "freeing block 1, which is not allocated")]
    fn allocator_double_free_panics() {
        let mut a = BlockAllocator::new(2);
        let blocks = a.allocate(2).unwrap();
        a.free(blocks[1]);
        a.free(blocks[1]);
    }

    #[test]
    #[should_panic(expected = "freeing block 9, which is not allocated")]
    fn allocator_foreign_block_panics() {
        BlockAllocator::new(2).free(BlockId(9));
    }

    #[test]
    fn append_allocates_only_when_the_last_block_is_full() {
        let pool = KvPool::new(4, &[10]);
        let mut t = pool.new_table();
        assert!(t.is_empty() && t.blocks().is_empty());
        t.append_tokens(0, Placement::Worker(W0)).unwrap();
        assert_eq!(pool.n_used(W0), 0);
        t.append_tokens(1, Placement::Worker(W0)).unwrap();
        assert_eq!((t.len(), t.blocks().len(), pool.n_used(W0)), (1, 1, 1));
        t.append_tokens(3, Placement::Worker(W0)).unwrap();
        assert_eq!((t.len(), t.blocks().len()), (4, 1));
        t.append_tokens(1, Placement::Worker(W0)).unwrap();
        assert_eq!((t.len(), t.blocks().len()), (5, 2));
        t.append_tokens(12, Placement::Worker(W0)).unwrap();
        assert_eq!((t.len(), t.blocks().len(), pool.n_used(W0), pool.n_free(W0)), (17, 5, 5, 5));
    }

    #[test]
    fn table_exhaustion_changes_nothing() {
        let pool = KvPool::new(4, &[3, 2]);
        let mut t = pool.new_table();
        t.append_tokens(6, Placement::Worker(W0)).unwrap();
        // 6 + 7 = 13 tokens need 4 blocks: 2 more, but worker 0 has 1 free.
        assert_eq!(
            t.append_tokens(7, Placement::Worker(W0)),
            Err(KvError::OutOfBlocks { wanted: 2, free: 1 })
        );
        assert_eq!((t.len(), t.blocks().len(), pool.n_used(W0)), (6, 2, 2));
        // 6 + 17 = 23 tokens need 6 blocks: 4 more, but the two workers have 3 free together.
        assert_eq!(
            t.append_tokens(17, Placement::MostFree),
            Err(KvError::OutOfBlocks { wanted: 4, free: 3 })
        );
        assert_eq!((t.len(), pool.n_used(W0), pool.n_used(W1)), (6, 2, 0));
        assert_eq!(
            t.append_tokens(1, Placement::Worker(WorkerId(2))),
            Err(KvError::UnknownWorker { worker: WorkerId(2), n_workers: 2 })
        );
        assert_eq!(t.len(), 6);
        // Filling within the last block needs no free block at all.
        let mut full = pool.new_table();
        full.append_tokens(12, Placement::MostFree).unwrap();
        assert_eq!((pool.n_free(W0), pool.n_free(W1)), (0, 0));
        t.append_tokens(2, Placement::Worker(W0)).unwrap();
        assert_eq!(
            t.append_tokens(1, Placement::Worker(W1)),
            Err(KvError::OutOfBlocks { wanted: 1, free: 0 })
        );
    }

    #[test]
    fn most_free_fills_the_workers_evenly() {
        let pool = KvPool::new(2, &[3, 5]);
        let mut t = pool.new_table();
        t.append_tokens(2 * 6, Placement::MostFree).unwrap();
        let workers: Vec<u32> = t.blocks().iter().map(|(w, _)| w.0).collect();
        // 3/5 free: worker 1 until they tie, then alternate from the lowest id.
        assert_eq!(workers, [1, 1, 0, 1, 0, 1]);
        assert_eq!((pool.n_free(W0), pool.n_free(W1)), (1, 1));
    }

    #[test]
    fn dropped_and_truncated_tables_return_their_blocks() {
        let pool = KvPool::new(16, &[8, 8]);
        let mut a = pool.new_table();
        a.append_tokens(40, Placement::Worker(W1)).unwrap();
        let mut b = pool.new_table();
        b.append_tokens(16, Placement::Worker(W1)).unwrap();
        assert_eq!(pool.n_used(W1), 4);
        let a_blocks = ids(a.blocks());
        drop(a);
        assert_eq!((pool.n_used(W1), pool.n_free(W1)), (1, 7));
        // The blocks of the dropped table are reused: the last freed first.
        let mut c = pool.new_table();
        c.append_tokens(48, Placement::Worker(W1)).unwrap();
        let mut reused = ids(c.blocks());
        reused.sort_unstable();
        assert_eq!(reused, a_blocks);
        b.truncate(0);
        assert_eq!(pool.n_used(W1), 3);
        // A clone of the pool is the same pool; the tables keep its state alive.
        let clone = pool.clone();
        drop(pool);
        assert_eq!(clone.n_used(W1), 3);
        drop((b, c));
        assert_eq!((clone.n_used(W0), clone.n_used(W1)), (0, 0));
    }

    #[test]
    fn a_table_dropped_on_another_thread_frees_its_blocks() {
        let pool = KvPool::new(16, &[8]);
        let mut t = pool.new_table();
        t.append_tokens(20, Placement::Worker(W0)).unwrap();
        std::thread::spawn(move || drop(t)).join().unwrap();
        assert_eq!(pool.n_used(W0), 0);
    }

    #[test]
    fn slots_across_block_boundaries() {
        let pool = KvPool::new(4, &[16, 16]);
        let mut t = pool.new_table();
        t.append_tokens(4, Placement::Worker(W0)).unwrap();
        t.append_tokens(5, Placement::Worker(W1)).unwrap();
        let (b0, b1, b2) = (t.blocks()[0], t.blocks()[1], t.blocks()[2]);
        assert_eq!((b0.0, b1.0, b2.0), (W0, W1, W1));
        let slot = |p| {
            let s = t.slot(p);
            ((s.worker, s.block), s.slot)
        };
        assert_eq!(slot(0), (b0, 0));
        assert_eq!(slot(3), (b0, 3));
        assert_eq!(slot(4), (b1, 0));
        assert_eq!(slot(7), (b1, 3));
        assert_eq!(slot(8), (b2, 0));
    }

    #[test]
    #[should_panic(expected = "position 9 is past the sequence's 9 tokens")]
    fn slot_past_the_end_panics() {
        let pool = KvPool::new(4, &[16]);
        let mut t = pool.new_table();
        t.append_tokens(9, Placement::Worker(W0)).unwrap();
        t.slot(9);
    }

    #[test]
    fn token_ranges_when_blocks_alternate_workers() {
        let pool = KvPool::new(4, &[16, 16]);
        let mut t = pool.new_table();
        assert_eq!(t.token_ranges_per_worker(), []);
        t.append_tokens(6, Placement::Worker(W0)).unwrap(); // blocks 0, 1 on worker 0
        t.append_tokens(6, Placement::Worker(W1)).unwrap(); // fills block 1, block 2 on worker 1
        t.append_tokens(2, Placement::Worker(W0)).unwrap(); // block 3 on worker 0
        t.append_tokens(1, Placement::Worker(W1)).unwrap(); // fits in block 3
        assert_eq!(t.token_ranges_per_worker(), [(W0, 0..8), (W1, 8..12), (W0, 12..15)]);
        t.append_tokens(5, Placement::Worker(W1)).unwrap(); // fills block 3, block 4 on worker 1
        assert_eq!(
            t.token_ranges_per_worker(),
            [(W0, 0..8), (W1, 8..12), (W0, 12..16), (W1, 16..20)]
        );
        let mut even = pool.new_table();
        even.append_tokens(4 * 5 - 1, Placement::MostFree).unwrap();
        assert_eq!(
            even.token_ranges_per_worker(),
            [(W1, 0..4), (W0, 4..8), (W1, 8..12), (W0, 12..16), (W1, 16..19)]
        );
    }

    #[test]
    fn truncate_frees_exactly_the_blocks_past_the_new_length() {
        let pool = KvPool::new(4, &[16, 16]);
        let mut t = pool.new_table();
        t.append_tokens(8, Placement::Worker(W0)).unwrap();
        t.append_tokens(10, Placement::Worker(W1)).unwrap();
        let before = t.blocks().to_vec();
        assert_eq!((before.len(), pool.n_used(W0), pool.n_used(W1)), (5, 2, 3));
        t.truncate(18);
        t.truncate(100);
        assert_eq!((t.len(), t.blocks(), pool.n_used(W1)), (18, &before[..], 3));
        t.truncate(13); // positions 12..13 keep block 3; block 4 goes
        assert_eq!((t.len(), t.blocks(), pool.n_used(W1)), (13, &before[..4], 2));
        t.truncate(12); // block 3 now holds nothing
        assert_eq!((t.len(), t.blocks(), pool.n_used(W1)), (12, &before[..3], 1));
        t.truncate(5);
        assert_eq!(
            (t.len(), t.blocks(), pool.n_used(W0), pool.n_used(W1)),
            (5, &before[..2], 2, 0)
        );
        assert_eq!(t.token_ranges_per_worker(), [(W0, 0..5)]);
        // Appending after a truncate fills the kept block before taking a new one.
        t.append_tokens(3, Placement::Worker(W1)).unwrap();
        assert_eq!((t.blocks(), pool.n_used(W1)), (&before[..2], 0));
        t.truncate(0);
        assert!(t.is_empty() && t.blocks().is_empty());
        assert_eq!((pool.n_used(W0), pool.n_used(W1)), (0, 0));
    }
}
