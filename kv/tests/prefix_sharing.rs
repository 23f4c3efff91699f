//! Block tables sharing KV through the prefix cache: a prompt starts from the cached blocks of
//! an earlier one, released blocks stay cached until an allocation needs them, a shared block
//! is never written, a lost worker's cache is forgotten.

use duet_kv::{BlockTable, KvError, KvPool, Placement, WorkerId};

const W0: WorkerId = WorkerId(0);
const W1: WorkerId = WorkerId(1);

/// A table of `tokens` with their KV applied and offered to the cache.
fn computed(pool: &KvPool, tokens: &[u32], placement: Placement) -> BlockTable {
    let mut t = pool.new_table();
    t.append_tokens(tokens.len(), placement).unwrap();
    t.register_full(tokens);
    t
}

#[test]
fn a_prompt_starts_from_the_cached_blocks_of_an_earlier_one() {
    let pool = KvPool::new(4, &[8, 8]);
    let prompt: Vec<u32> = (0..11).collect();
    let a = computed(&pool, &prompt, Placement::MostFree);
    // Two whole blocks are named; the third (3 tokens) is not.
    let mut longer = prompt.clone();
    longer.extend([50, 51, 52]);
    let b = pool.table_with_prefix(&longer, |_| true);
    assert_eq!((b.len(), b.blocks()), (8, &a.blocks()[..2]));
    assert_eq!(pool.n_used(W0) + pool.n_used(W1), 3, "shared, not copied");
    // Another prompt shares the first block only; one that differs at once, none.
    let mut other = prompt[..4].to_vec();
    other.extend([9, 9, 9, 9, 9]);
    assert_eq!(pool.table_with_prefix(&other, |_| true).len(), 4);
    assert!(pool.table_with_prefix(&[7; 9], |_| true).is_empty());
    // At least the last token is left to compute: 8 tokens match one block, not two.
    assert_eq!(pool.table_with_prefix(&prompt[..8], |_| true).len(), 4);
    assert_eq!(pool.table_with_prefix(&prompt[..9], |_| true).len(), 8);
    // Blocks on a worker that is down are not used.
    let down = a.blocks()[1].0;
    assert_eq!(pool.table_with_prefix(&longer, |w| w != down).len(), 4);
}

#[test]
fn released_blocks_stay_cached_until_an_allocation_needs_them() {
    let pool = KvPool::new(4, &[4]);
    let prompt: Vec<u32> = (0..9).collect();
    drop(computed(&pool, &prompt, Placement::Worker(W0)));
    // Two blocks keep their KV (the partial third is free); all four may be taken.
    assert_eq!((pool.n_used(W0), pool.n_cached(W0), pool.n_free(W0)), (0, 2, 4));
    let again = pool.table_with_prefix(&prompt, |_| true);
    assert_eq!((again.len(), pool.n_cached(W0), pool.n_free(W0)), (8, 0, 2));
    drop(again);
    // A table needing every block evicts the cached ones: the later block first.
    let mut big = pool.new_table();
    big.append_tokens(12, Placement::Worker(W0)).unwrap();
    assert_eq!(pool.n_cached(W0), 1);
    assert_eq!(pool.table_with_prefix(&prompt, |_| true).len(), 4, "the first block is still cached");
    big.append_tokens(4, Placement::Worker(W0)).unwrap();
    assert_eq!((pool.n_cached(W0), pool.n_free(W0)), (0, 0));
    assert!(pool.table_with_prefix(&prompt, |_| true).is_empty());
    assert_eq!(big.append_tokens(1, Placement::Worker(W0)), Err(KvError::OutOfBlocks { wanted: 1, free: 0 }));
}

#[test]
fn most_free_takes_free_blocks_before_cached_ones() {
    let pool = KvPool::new(4, &[4, 4]);
    drop(computed(&pool, &[1; 16], Placement::Worker(W0)));
    assert_eq!((pool.n_cached(W0), pool.n_free(W0)), (4, 4));
    let mut t = pool.new_table();
    t.append_tokens(16, Placement::MostFree).unwrap();
    assert!(t.blocks().iter().all(|&(w, _)| w == W1), "{:?}", t.blocks());
    assert_eq!(pool.n_cached(W0), 4);
}

#[test]
fn a_shared_block_is_never_written() {
    let pool = KvPool::new(4, &[8]);
    let prompt: Vec<u32> = (0..12).collect();
    let mut a = computed(&pool, &prompt, Placement::Worker(W0));
    let b = pool.table_with_prefix(&[prompt.as_slice(), &[99]].concat(), |_| true);
    assert_eq!(b.len(), 12);
    // Cut inside its second block, which `b` holds too: the table lets go of it.
    assert_eq!(a.truncate(6), 4);
    assert_eq!((a.len(), a.blocks()), (4, &b.blocks()[..1]));
    a.append_tokens(2, Placement::Worker(W0)).unwrap();
    assert_ne!(a.blocks()[1], b.blocks()[1], "positions 4.. go to a new block");
    // Cut inside a block no other table holds: kept, and no longer named in the cache.
    drop(b);
    let mut c = computed(&pool, &[1, 1, 1, 1, 2, 2, 2, 2], Placement::Worker(W0));
    assert_eq!(c.truncate(5), 5);
    assert_eq!(pool.table_with_prefix(&[1, 1, 1, 1, 2, 2, 2, 2, 3], |_| true).len(), 4);
    // The same content registered again chains on.
    c.append_tokens(3, Placement::Worker(W0)).unwrap();
    c.register_full(&[1, 1, 1, 1, 2, 2, 2, 2]);
    assert_eq!(pool.table_with_prefix(&[1, 1, 1, 1, 2, 2, 2, 2, 3], |_| true).len(), 8);
}

#[test]
fn a_truncate_counts_only_the_blocks_it_gives_back() {
    let pool = KvPool::new(4, &[8]);
    let prompt: Vec<u32> = (0..12).collect();
    let a = computed(&pool, &prompt, Placement::Worker(W0));
    assert_eq!((a.blocks_reusable_after_truncate(12), a.blocks_reusable_after_truncate(6)), (3, 3));
    // Another table shares the first two blocks: cut in the second, `a` keeps one and
    // gives back only the third.
    let b = pool.table_with_prefix(&[&prompt[..8], &[99]].concat(), |_| true);
    assert_eq!(b.len(), 8);
    assert_eq!((a.blocks_reusable_after_truncate(6), a.blocks_reusable_after_truncate(4), a.blocks_reusable_after_truncate(0)), (2, 2, 1));
    let mut a = a;
    let free = pool.n_free(W0);
    assert_eq!(a.truncate(6), 4);
    assert_eq!(pool.n_free(W0), free + 1);
}

#[test]
fn a_lost_workers_cache_is_forgotten() {
    let pool = KvPool::new(4, &[8, 8]);
    let prompt: Vec<u32> = (0..9).collect();
    let held = computed(&pool, &prompt, Placement::Worker(W1));
    drop(computed(&pool, &[5; 9], Placement::Worker(W1)));
    assert_eq!(pool.n_cached(W1), 2);
    pool.forget_cached(W1);
    assert_eq!((pool.n_cached(W1), pool.n_free(W1), pool.n_used(W1)), (0, 5, 3));
    assert!(pool.table_with_prefix(&prompt, |_| true).is_empty());
    drop(held);
    assert_eq!((pool.n_cached(W1), pool.n_free(W1)), (0, 8));
}
