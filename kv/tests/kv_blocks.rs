//! Randomised test of the KV block tables through the public API: many sequences append,
//! truncate and drop on three workers; after every operation each worker's used count equals
//! the blocks the live tables hold, no block is held twice, and a failed append changed nothing.

use std::collections::HashSet;

use duet_kv::{BlockTable, KvError, KvPool, Placement, WorkerId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const BLOCK_SIZE: usize = 4;
const BLOCKS_PER_WORKER: [u32; 3] = [37, 23, 11];

/// The invariants of the pool and its live tables.
fn check(pool: &KvPool, tables: &[BlockTable]) {
    let mut held = HashSet::new();
    let mut per_worker = [0usize; BLOCKS_PER_WORKER.len()];
    for t in tables {
        assert_eq!(t.blocks().len(), t.len().div_ceil(BLOCK_SIZE));
        for &(w, b) in t.blocks() {
            assert!(held.insert((w, b)), "block {b} of worker {w} is held twice");
            assert!(b.0 < BLOCKS_PER_WORKER[w.0 as usize]);
            per_worker[w.0 as usize] += 1;
        }
        // The worker ranges tile 0..len in order and agree with slot().
        let mut next = 0;
        for (w, range) in t.token_ranges_per_worker() {
            assert_eq!(range.start, next);
            assert!(range.end > range.start);
            assert!(range.clone().all(|p| t.slot(p).worker == w));
            next = range.end;
        }
        assert_eq!(next, t.len());
    }
    for (i, &used) in per_worker.iter().enumerate() {
        let w = WorkerId(i as u32);
        assert_eq!(pool.n_used(w), used, "worker {w}");
        assert_eq!(pool.n_used(w) + pool.n_free(w), BLOCKS_PER_WORKER[i] as usize);
    }
}

#[test]
fn random_appends_truncates_and_drops_keep_the_books() {
    let pool = KvPool::new(BLOCK_SIZE, &BLOCKS_PER_WORKER);
    let mut rng = StdRng::seed_from_u64(0x5eed_d0e7);
    let mut tables: Vec<BlockTable> = Vec::new();
    let (mut appended, mut refused, mut truncated, mut dropped) = (0, 0, 0, 0);
    for _ in 0..20_000 {
        match rng.random_range(0..20) {
            0..=13 => {
                if tables.is_empty() || rng.random_bool(0.1) {
                    tables.push(pool.new_table());
                }
                let i = rng.random_range(0..tables.len());
                let t = &mut tables[i];
                let n = rng.random_range(0..=32);
                let placement = if rng.random_bool(0.3) {
                    Placement::MostFree
                } else {
                    Placement::Worker(WorkerId(rng.random_range(0..3)))
                };
                let (len, before) = (t.len(), t.blocks().to_vec());
                match t.append_tokens(n, placement) {
                    Ok(()) => {
                        appended += 1;
                        assert_eq!(t.len(), len + n);
                        assert_eq!(&t.blocks()[..before.len()], &before[..]);
                        if let Placement::Worker(w) = placement {
                            assert!(t.blocks()[before.len()..].iter().all(|&(bw, _)| bw == w));
                        }
                    }
                    Err(KvError::OutOfBlocks { wanted, free }) => {
                        refused += 1;
                        assert!(wanted > free);
                        assert_eq!((t.len(), t.blocks()), (len, &before[..]));
                    }
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
            14..=17 if !tables.is_empty() => {
                let i = rng.random_range(0..tables.len());
                let len = rng.random_range(0..=tables[i].len() + 2);
                tables[i].truncate(len);
                truncated += 1;
            }
            _ if !tables.is_empty() => {
                tables.swap_remove(rng.random_range(0..tables.len()));
                dropped += 1;
            }
            _ => {}
        }
        check(&pool, &tables);
    }
    // Every path was taken many times, exhaustion included.
    for count in [appended, refused, truncated, dropped] {
        assert!(
            count > 1000,
            "{appended} appended, {refused} refused, {truncated} truncated, {dropped} dropped"
        );
    }
    drop(tables);
    for w in 0..BLOCKS_PER_WORKER.len() {
        assert_eq!(pool.n_used(WorkerId(w as u32)), 0);
    }
}
