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
//!
//! **Blocks are shared by reference count** where the prefix cache (`prefix_cache.rs`) finds
//! a new sequence's leading blocks already computed: [`KvPool::table_with_prefix`] starts a
//! table with them. A block is free when no table holds it and it holds no registered KV; a
//! registered block no table holds stays cached until an allocation needs it.

use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

pub use super::ids::{BlockId, WorkerId};
use super::prefix_cache::{PrefixCache, ROOT};
use super::KvError;

/// The free blocks of one arena, and how many tables hold each block.
#[derive(Debug)]
struct BlockAllocator {
    /// Free blocks, handed out lowest id first: a sequence's blocks then tend to be
    /// consecutive, so that each KV head of it is one span of the run-major arena (attention
    /// reads it as one stream). A stack (the block freed last reused first) scattered them once
    /// sessions had come and gone: a 4K-token decode after rounds of 32 sessions ran at 124–134
    /// tok/s against 139–153 lowest first (servers run back to back).
    free: BTreeSet<u32>,
    /// Tables holding each block (0: free, or cached and evictable).
    refs: Vec<u32>,
}

impl BlockAllocator {
    fn new(n_blocks: u32) -> Self {
        BlockAllocator { free: (0..n_blocks).collect(), refs: vec![0; n_blocks as usize] }
    }

    /// Blocks on the free list (cached ones not counted).
    fn n_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks some table holds.
    fn n_used(&self) -> usize {
        self.refs.iter().filter(|&&r| r > 0).count()
    }

    /// The `n` lowest free blocks in ascending order, or none at all and
    /// [`KvError::OutOfBlocks`].
    fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>, KvError> {
        if n > self.free.len() {
            return Err(KvError::OutOfBlocks { wanted: n, free: self.free.len() });
        }
        let blocks: Vec<BlockId> = (0..n).filter_map(|_| self.free.pop_first()).map(BlockId).collect();
        for b in &blocks {
            self.hold_new(*b);
        }
        Ok(blocks)
    }

    /// A block no table held (just off the free list, or evicted from the cache) taken.
    fn hold_new(&mut self, block: BlockId) {
        let refs = &mut self.refs[block.0 as usize];
        assert_eq!(*refs, 0, "block {block} is handed out and in use");
        *refs = 1;
    }

    /// One more table holds `block`; returns how many held it before.
    fn hold(&mut self, block: BlockId) -> u32 {
        let refs = &mut self.refs[block.0 as usize];
        *refs += 1;
        *refs - 1
    }

    /// How many tables hold `block`.
    fn holders(&self, block: BlockId) -> u32 {
        self.refs.get(block.0 as usize).copied().unwrap_or(0)
    }

    /// One table lets go of `block`; returns whether none holds it now. Panics if none held
    /// it (a double free or a foreign id).
    fn release(&mut self, block: BlockId) -> bool {
        let refs = self.refs.get_mut(block.0 as usize);
        assert!(refs.as_deref().is_some_and(|&r| r > 0), "freeing block {block}, which is not allocated");
        let refs = refs.unwrap();
        *refs -= 1;
        *refs == 0
    }

    /// Puts a block no table holds back on the free list.
    fn free(&mut self, block: BlockId) {
        assert_eq!(self.holders(block), 0, "block {block} is freed while held");
        assert!(self.free.insert(block.0), "block {block} freed twice");
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

/// The allocators and the prefix cache, under one lock.
#[derive(Debug)]
struct PoolState {
    workers: Vec<BlockAllocator>,
    cache: PrefixCache,
}

impl PoolState {
    /// Blocks `worker` can hand out: free ones and cached ones no table holds.
    fn available(&self, w: usize) -> usize {
        self.workers[w].n_free() + self.cache.n_evictable(WorkerId(w as u32))
    }

    /// `n` blocks of worker `w`: free ones first (lowest ids), then the cached ones released
    /// longest ago; all of them or none.
    fn allocate_on(&mut self, w: usize, n: usize) -> Result<Vec<BlockId>, KvError> {
        let available = self.available(w);
        if n > available {
            return Err(KvError::OutOfBlocks { wanted: n, free: available });
        }
        let from_free = n.min(self.workers[w].n_free());
        let mut blocks = self.workers[w].allocate(from_free)?;
        while blocks.len() < n {
            let b = self.cache.evict(WorkerId(w as u32)).expect("counted as available");
            self.workers[w].hold_new(b);
            blocks.push(b);
        }
        Ok(blocks)
    }

    /// One table lets go of `block`: with no holder left it stays cached if registered, else
    /// it is free.
    fn release(&mut self, (w, b): (WorkerId, BlockId)) {
        if self.workers[w.0 as usize].release(b) && !self.cache.park(w, b) {
            self.workers[w.0 as usize].free(b);
        }
    }
}

/// A cloneable handle to the block allocators of all cpu-workers and their prefix cache.
/// Clones share the state.
#[derive(Debug, Clone)]
pub struct KvPool {
    state: Arc<Mutex<PoolState>>,
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
            state: Arc::new(Mutex::new(PoolState { workers, cache: PrefixCache::new(blocks_per_worker.len()) })),
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

    /// Blocks of `worker` a table may take: free ones and cached ones no table holds. Panics
    /// if there is no such worker.
    pub fn n_free(&self, worker: WorkerId) -> usize {
        self.lock().available(worker.0 as usize)
    }

    /// Blocks of `worker` held by tables. Panics if there is no such worker.
    pub fn n_used(&self, worker: WorkerId) -> usize {
        self.lock().workers[worker.0 as usize].n_used()
    }

    /// Blocks of `worker` no table holds that keep their KV for the prefix cache (counted in
    /// [`KvPool::n_free`]). Panics if there is no such worker.
    pub fn n_cached(&self, worker: WorkerId) -> usize {
        self.lock().cache.n_evictable(worker)
    }

    /// An empty table whose blocks come from, and go back to, this pool.
    pub fn new_table(&self) -> BlockTable {
        BlockTable { pool: self.clone(), blocks: Vec::new(), len: 0, chain: Vec::new() }
    }

    /// A table holding the longest run of cached blocks that begins `tokens` (whole blocks on
    /// workers `usable` accepts), always leaving at least the last token to compute; its
    /// length is the positions it covers (0 where nothing is cached).
    pub fn table_with_prefix(&self, tokens: &[u32], usable: impl Fn(WorkerId) -> bool) -> BlockTable {
        let mut table = self.new_table();
        let whole = tokens.len().saturating_sub(1) / self.block_size;
        let mut state = self.lock();
        let found = state.cache.lookup(tokens[..whole * self.block_size].chunks_exact(self.block_size), usable);
        for &(id, w, b) in &found {
            if state.workers[w.0 as usize].hold(b) == 0 {
                state.cache.revive(w, b);
            }
            table.blocks.push((w, b));
            table.chain.push(id);
        }
        table.len = found.len() * self.block_size;
        drop(state);
        table.check();
        table
    }

    /// Forgets the cached KV of `worker` (its arena came back without it): no table will be
    /// started from it, and the blocks no table holds are free again.
    pub fn forget_cached(&self, worker: WorkerId) {
        let mut state = self.lock();
        for b in state.cache.forget_worker(worker) {
            state.workers[worker.0 as usize].free(b);
        }
    }

    /// The allocators and the cache. Only a bookkeeping assertion (a bug) can panic while the
    /// lock is held; poison is ignored so that the tables dropped while unwinding still give
    /// their blocks back instead of panicking a second time.
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Up to `n` new blocks placed as `placement` says: all of them or none.
    fn allocate(
        &self,
        n: usize,
        placement: Placement,
    ) -> Result<Vec<(WorkerId, BlockId)>, KvError> {
        let mut state = self.lock();
        match placement {
            Placement::Worker(w) => {
                // The table checked that the worker exists.
                Ok(state.allocate_on(w.0 as usize, n)?.into_iter().map(|b| (w, b)).collect())
            }
            Placement::MostFree => {
                let free: usize = (0..self.n_workers).map(|w| state.available(w)).sum();
                if n > free {
                    return Err(KvError::OutOfBlocks { wanted: n, free });
                }
                let mut out = Vec::with_capacity(n);
                for _ in 0..n {
                    // The most plain free blocks first (cached KV is taken only where no worker
                    // has a free block), then the most available; max_by_key returns the last
                    // maximum, so reverse to prefer the lowest id.
                    let w = (0..self.n_workers).rev().max_by_key(|&w| (state.workers[w].n_free(), state.available(w))).expect("at least one worker");
                    let block = state.allocate_on(w, 1).expect("counted as free")[0];
                    out.push((WorkerId(w as u32), block));
                }
                Ok(out)
            }
        }
    }

    /// The blocks let go of, the last first: of a sequence's cached blocks, the later ones
    /// (shared by fewer prompts) are then evicted first.
    fn release(&self, blocks: impl DoubleEndedIterator<Item = (WorkerId, BlockId)>) {
        let mut state = self.lock();
        for wb in blocks.rev() {
            state.release(wb);
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
    /// The prefix cache's ids of the leading blocks whose content is named (registered here
    /// or found there): the next block registered chains from the last.
    chain: Vec<u64>,
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

    /// Offers the prefix cache every whole block of `tokens` not offered yet: `tokens` are
    /// the sequence's first tokens (at most `len()`), every one's KV applied in its block, so
    /// those blocks are never written again. A block whose content another block holds
    /// already is not registered (the first copy serves).
    pub fn register_full(&mut self, tokens: &[u32]) {
        let bs = self.pool.block_size;
        assert!(tokens.len() <= self.len, "registering {} tokens of a {}-token table", tokens.len(), self.len);
        let whole = tokens.len() / bs;
        if whole <= self.chain.len() {
            return;
        }
        let mut state = self.pool.lock();
        for i in self.chain.len()..whole {
            let parent = self.chain.last().copied().unwrap_or(ROOT);
            let (w, b) = self.blocks[i];
            let id = state.cache.register(parent, &tokens[i * bs..(i + 1) * bs], w, b);
            self.chain.push(id);
        }
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

    /// Shortens the sequence to at most `len` positions, as `Vec::truncate` (nothing if it
    /// holds no more), and gives back the blocks wholly past it; returns the length kept.
    /// The positions after it will be written, so a block cut in two is kept only if no other
    /// table holds it (its cache entry, if any, is dropped); one shared is let go too, and the
    /// length kept is where it began.
    pub fn truncate(&mut self, len: usize) -> usize {
        if len >= self.len {
            return self.len;
        }
        let bs = self.pool.block_size;
        let mut state = self.pool.lock();
        let keep = self.blocks_kept(&state, len);
        let len = len.min(keep * bs);
        if !len.is_multiple_of(bs) {
            // Cut in two and held by this table alone: it will be written, so it no longer
            // holds what the cache names it by.
            let (w, b) = self.blocks[keep - 1];
            state.cache.unregister(w, b);
        }
        self.chain.truncate(len / bs);
        for wb in self.blocks.drain(keep..).rev() {
            state.release(wb);
        }
        drop(state);
        self.len = len;
        self.check();
        len
    }

    /// How many blocks a request that keeps `len` positions of this table can count on:
    /// those [`BlockTable::truncate`] would keep, and those it would give back to the pool (no
    /// other table holding them). Blocks another table shares past the cut stay taken.
    pub fn blocks_reusable_after_truncate(&self, len: usize) -> usize {
        if len >= self.len {
            return self.blocks.len();
        }
        let state = self.pool.lock();
        let keep = self.blocks_kept(&state, len);
        keep + self.blocks[keep..].iter().filter(|&&(w, b)| state.workers[w.0 as usize].holders(b) == 1).count()
    }

    /// How many leading blocks a cut at `len` (below `len()`) keeps: those holding positions
    /// before `len`, less a block cut in two that another table holds (it must not be written).
    fn blocks_kept(&self, state: &PoolState, len: usize) -> usize {
        let bs = self.pool.block_size;
        let keep = len.div_ceil(bs);
        let shared_cut = !len.is_multiple_of(bs) && {
            let (w, b) = self.blocks[keep - 1];
            state.workers[w.0 as usize].holders(b) > 1
        };
        keep - usize::from(shared_cut)
    }

    fn check(&self) {
        debug_assert_eq!(self.blocks.len(), self.len.div_ceil(self.pool.block_size));
        debug_assert!(self.chain.len() <= self.len / self.pool.block_size);
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        self.pool.release(self.blocks.drain(..));
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
            assert!(a.release(b));
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
        a.release(blocks[1]);
        a.release(blocks[1]);
    }

    #[test]
    #[should_panic(expected = "freeing block 9, which is not allocated")]
    fn allocator_foreign_block_panics() {
        BlockAllocator::new(2).release(BlockId(9));
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
