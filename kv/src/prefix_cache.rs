//! Automatic prefix caching: full KV blocks named by their content — their tokens and, by a
//! chain of ids, every token before them — so that a request whose prompt begins as an earlier
//! one did reuses that KV instead of computing it again (vLLM's automatic prefix caching).
//!
//! A block is *registered* once every position of it holds applied KV
//! ([`crate::BlockTable::register_full`]); a registered block is never written again (a table
//! that must write into one either holds it alone and unregisters it, or lets go of it:
//! [`crate::BlockTable::truncate`]). A registered block no table holds is *evictable*: it keeps
//! its KV and counts as free, and an allocation that finds no plain free block takes the
//! least recently released one. Names are exact: a key is the parent block's id and the
//! block's tokens themselves (no hash that could collide), and ids are never reused, so a
//! block whose parent was evicted is no longer found — unless a table held a copy of the
//! parent (it computed the same block again), which then takes the parent's id over.

use std::collections::{BTreeMap, HashMap};

use super::ids::{BlockId, WorkerId};

/// The id of the chain's start: the parent of a sequence's first block.
pub(crate) const ROOT: u64 = 0;

/// What names a block's KV: the id of the block before it in the sequence and its tokens.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    parent: u64,
    tokens: Box<[u32]>,
}

/// A registered block's id and key.
#[derive(Debug)]
struct Registered {
    id: u64,
    key: Key,
}

/// The index of registered blocks and the order in which evictable ones go.
#[derive(Debug)]
pub(crate) struct PrefixCache {
    index: HashMap<Key, (u64, WorkerId, BlockId)>,
    by_block: HashMap<(WorkerId, BlockId), Registered>,
    /// Per worker, the evictable blocks by the tick they were released at (oldest first).
    evictable: Vec<BTreeMap<u64, BlockId>>,
    /// The tick each evictable block was released at.
    released_at: HashMap<(WorkerId, BlockId), u64>,
    /// Blocks a table holds with a registered block's content (it computed it again), by that
    /// block's id: one takes the id over when the registered block goes, so that the blocks
    /// chained after it are still found.
    copies: HashMap<u64, Vec<(WorkerId, BlockId)>>,
    copy_of: HashMap<(WorkerId, BlockId), u64>,
    next_id: u64,
    tick: u64,
}

impl PrefixCache {
    pub(crate) fn new(n_workers: usize) -> Self {
        PrefixCache {
            index: HashMap::new(),
            by_block: HashMap::new(),
            evictable: vec![BTreeMap::new(); n_workers],
            released_at: HashMap::new(),
            copies: HashMap::new(),
            copy_of: HashMap::new(),
            next_id: ROOT + 1,
            tick: 0,
        }
    }

    /// The registered blocks that hold `blocks` (each of the block size) one after another
    /// from the sequence's start, with their ids, while `usable` accepts their worker.
    pub(crate) fn lookup<'t>(
        &self,
        blocks: impl Iterator<Item = &'t [u32]>,
        usable: impl Fn(WorkerId) -> bool,
    ) -> Vec<(u64, WorkerId, BlockId)> {
        let mut parent = ROOT;
        let mut found = Vec::new();
        for tokens in blocks {
            let key = Key { parent, tokens: tokens.into() };
            match self.index.get(&key) {
                Some(&(id, w, b)) if usable(w) => {
                    found.push((id, w, b));
                    parent = id;
                }
                _ => break,
            }
        }
        found
    }

    /// Registers `block` as holding `tokens` after the block of id `parent`; returns the id
    /// its successors chain from. Where another block already holds that content, that one's
    /// id (this block is kept as a copy: the first serves while it lasts); where `block` is
    /// already registered or a copy, its id.
    pub(crate) fn register(&mut self, parent: u64, tokens: &[u32], worker: WorkerId, block: BlockId) -> u64 {
        let key = Key { parent, tokens: tokens.into() };
        if let Some(r) = self.by_block.get(&(worker, block)) {
            debug_assert_eq!(r.key, key, "block {block} of worker {worker} registered with other content");
            return r.id;
        }
        if let Some(&id) = self.copy_of.get(&(worker, block)) {
            return id;
        }
        if let Some(&(id, ..)) = self.index.get(&key) {
            self.copies.entry(id).or_default().push((worker, block));
            self.copy_of.insert((worker, block), id);
            return id;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.index.insert(key.clone(), (id, worker, block));
        self.by_block.insert((worker, block), Registered { id, key });
        id
    }

    pub(crate) fn is_registered(&self, worker: WorkerId, block: BlockId) -> bool {
        self.by_block.contains_key(&(worker, block))
    }

    /// Forgets `block`'s registration or copy (it is about to be written, or its KV is gone);
    /// a copy of a registered block takes its id over.
    pub(crate) fn unregister(&mut self, worker: WorkerId, block: BlockId) {
        self.drop_copy((worker, block));
        if let Some(r) = self.by_block.remove(&(worker, block)) {
            self.index.remove(&r.key);
            self.promote_copy(r);
        }
        if let Some(t) = self.released_at.remove(&(worker, block)) {
            self.evictable[worker.0 as usize].remove(&t);
        }
    }

    /// A copy of the registered block `gone` had, registered in its place.
    fn promote_copy(&mut self, gone: Registered) {
        let Some(copies) = self.copies.get_mut(&gone.id) else { return };
        let copy = copies.pop().expect("no empty list of copies is kept");
        if copies.is_empty() {
            self.copies.remove(&gone.id);
        }
        self.copy_of.remove(&copy);
        self.index.insert(gone.key.clone(), (gone.id, copy.0, copy.1));
        self.by_block.insert(copy, gone);
    }

    /// `wb` is no longer a copy (let go of, or about to be written).
    fn drop_copy(&mut self, wb: (WorkerId, BlockId)) {
        let Some(id) = self.copy_of.remove(&wb) else { return };
        let copies = self.copies.get_mut(&id).expect("a copy is listed under its id");
        copies.retain(|&c| c != wb);
        if copies.is_empty() {
            self.copies.remove(&id);
        }
    }

    /// A block no table holds any more: a registered one becomes evictable (true), another
    /// must go back to the free list (false).
    pub(crate) fn park(&mut self, worker: WorkerId, block: BlockId) -> bool {
        self.drop_copy((worker, block));
        if !self.is_registered(worker, block) {
            return false;
        }
        self.tick += 1;
        self.evictable[worker.0 as usize].insert(self.tick, block);
        self.released_at.insert((worker, block), self.tick);
        true
    }

    /// An evictable block taken by a table again: no longer evictable.
    pub(crate) fn revive(&mut self, worker: WorkerId, block: BlockId) {
        let t = self.released_at.remove(&(worker, block)).expect("a revived block is evictable");
        self.evictable[worker.0 as usize].remove(&t);
    }

    /// Evictable blocks of `worker`.
    pub(crate) fn n_evictable(&self, worker: WorkerId) -> usize {
        self.evictable[worker.0 as usize].len()
    }

    /// Unregisters `worker`'s least recently released evictable block and returns it.
    pub(crate) fn evict(&mut self, worker: WorkerId) -> Option<BlockId> {
        let (_, block) = self.evictable[worker.0 as usize].pop_first()?;
        self.unregister(worker, block);
        Some(block)
    }

    /// Forgets every registration on `worker` (its arena's KV is gone); returns its evictable
    /// blocks, which go back to the free list.
    pub(crate) fn forget_worker(&mut self, worker: WorkerId) -> Vec<BlockId> {
        let evictable: Vec<BlockId> = std::mem::take(&mut self.evictable[worker.0 as usize]).into_values().collect();
        self.released_at.retain(|(w, _), _| *w != worker);
        // Its copies first, so that none takes over a registration the worker loses.
        let copies: Vec<(WorkerId, BlockId)> = self.copy_of.keys().filter(|(w, _)| *w == worker).copied().collect();
        for c in copies {
            self.drop_copy(c);
        }
        let gone: Vec<(WorkerId, BlockId)> = self.by_block.keys().filter(|(w, _)| *w == worker).copied().collect();
        for k in gone {
            self.unregister(k.0, k.1);
        }
        evictable
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W0: WorkerId = WorkerId(0);
    const W1: WorkerId = WorkerId(1);

    fn chunks(tokens: &[u32]) -> impl Iterator<Item = &[u32]> {
        tokens.chunks_exact(2)
    }

    #[test]
    fn a_chain_is_found_as_far_as_it_matches() {
        let mut c = PrefixCache::new(2);
        let a = c.register(ROOT, &[1, 2], W0, BlockId(5));
        let b = c.register(a, &[3, 4], W1, BlockId(7));
        let found = c.lookup(chunks(&[1, 2, 3, 4, 5, 6]), |_| true);
        assert_eq!(found, [(a, W0, BlockId(5)), (b, W1, BlockId(7))]);
        // The same tokens after another prefix are another block's.
        assert!(c.lookup(chunks(&[3, 4]), |_| true).is_empty());
        assert_eq!(c.lookup(chunks(&[1, 2, 3, 9]), |_| true).len(), 1);
        // Blocks on a worker that is down are not used.
        assert_eq!(c.lookup(chunks(&[1, 2, 3, 4]), |w| w != W1).len(), 1);
    }

    #[test]
    fn the_first_copy_of_a_content_serves() {
        let mut c = PrefixCache::new(1);
        let a = c.register(ROOT, &[1, 2], W0, BlockId(0));
        assert_eq!(c.register(ROOT, &[1, 2], W0, BlockId(1)), a);
        assert!(c.is_registered(W0, BlockId(0)) && !c.is_registered(W0, BlockId(1)));
        assert_eq!(c.register(ROOT, &[1, 2], W0, BlockId(1)), a, "a copy registered again");
        // Registering a registered block again keeps its id.
        assert_eq!(c.register(ROOT, &[1, 2], W0, BlockId(0)), a);
    }

    #[test]
    fn a_copy_takes_over_when_the_registered_block_goes() {
        let mut c = PrefixCache::new(2);
        let a = c.register(ROOT, &[1, 2], W0, BlockId(0));
        // Another table computed the same block again, and one after it.
        assert_eq!(c.register(ROOT, &[1, 2], W1, BlockId(3)), a);
        let b = c.register(a, &[3, 4], W1, BlockId(4));
        // The first is let go of and evicted: the copy serves, and the chain after it too.
        assert!(c.park(W0, BlockId(0)));
        assert_eq!(c.evict(W0), Some(BlockId(0)));
        assert_eq!(c.lookup(chunks(&[1, 2, 3, 4]), |_| true), [(a, W1, BlockId(3)), (b, W1, BlockId(4))]);
        // A copy let go of, or written, is no copy any more.
        c.register(ROOT, &[1, 2], W0, BlockId(1));
        assert!(!c.park(W0, BlockId(1)));
        c.register(ROOT, &[1, 2], W0, BlockId(2));
        c.unregister(W0, BlockId(2));
        c.unregister(W1, BlockId(3));
        assert!(c.lookup(chunks(&[1, 2]), |_| true).is_empty());
        assert!(c.copies.is_empty() && c.copy_of.is_empty());
        // A lost worker's copies take nothing over.
        let a = c.register(ROOT, &[5, 6], W0, BlockId(5));
        c.register(ROOT, &[5, 6], W1, BlockId(6));
        c.register(ROOT, &[5, 6], W0, BlockId(7));
        c.forget_worker(W0);
        assert_eq!(c.lookup(chunks(&[5, 6]), |_| true), [(a, W1, BlockId(6))]);
    }

    #[test]
    fn evictable_blocks_go_least_recently_released_first() {
        let mut c = PrefixCache::new(1);
        let a = c.register(ROOT, &[1, 2], W0, BlockId(0));
        c.register(a, &[3, 4], W0, BlockId(1));
        assert!(!c.park(W0, BlockId(2)), "an unregistered block is not kept");
        assert!(c.park(W0, BlockId(1)) && c.park(W0, BlockId(0)));
        assert_eq!(c.n_evictable(W0), 2);
        c.revive(W0, BlockId(1));
        assert!(c.park(W0, BlockId(1)));
        assert_eq!(c.evict(W0), Some(BlockId(0)));
        // Its child is registered still but no longer found.
        assert!(c.lookup(chunks(&[1, 2, 3, 4]), |_| true).is_empty());
        assert_eq!(c.evict(W0), Some(BlockId(1)));
        assert_eq!((c.evict(W0), c.n_evictable(W0)), (None, 0));
        assert!(c.index.is_empty() && c.by_block.is_empty() && c.released_at.is_empty());
    }

    #[test]
    fn a_lost_worker_is_forgotten() {
        let mut c = PrefixCache::new(2);
        let a = c.register(ROOT, &[1, 2], W1, BlockId(0));
        c.register(a, &[3, 4], W1, BlockId(1));
        c.register(ROOT, &[5, 6], W0, BlockId(0));
        c.park(W1, BlockId(1));
        assert_eq!(c.forget_worker(W1), [BlockId(1)]);
        assert!(c.lookup(chunks(&[1, 2]), |_| true).is_empty());
        assert_eq!(c.lookup(chunks(&[5, 6]), |_| true).len(), 1);
        assert_eq!(c.n_evictable(W1), 0);
    }
}
