//! The KV mirror's bookkeeping, apart from the GPU (and so tested on every machine): which
//! of the pool's pages hold which sequence's positions, how many of each layer's first
//! positions are mirrored, and how room is made. Room comes first from sequences holding
//! more than the GPU last attended of them (the balancer gives the GPU a prefix of each
//! context, and the mirror keeps whole prompts after their prefill); then from the
//! sequences of the running step beyond what the step attends of them; then from the least
//! recently used sequences not in the step — each time only the pages needed, from the end
//! of the victim's positions, so that it keeps the longest prefix it can. A call never takes room
//! from a sequence it used itself, and a step never evicts its own sequences (it once did:
//! over the mirror's capacity, each layer's items evicted one another and uploaded their
//! whole contexts again, layer after layer).

use std::collections::HashMap;

/// Positions per page.
pub const PAGE: usize = duet_kv::GPU_KV_PAGE;

/// A sequence's pages, per layer how many of its first positions the mirror holds, when it
/// was last used, and how far the GPU last attended it.
struct Mirrored {
    pages: Vec<i32>,
    filled: Vec<usize>,
    used: u64,
    attended: usize,
}

/// The pool's pages and the sequences holding them.
pub struct Pages {
    n_pages: usize,
    layers: usize,
    free: Vec<i32>,
    seqs: HashMap<u64, Mirrored>,
    /// Ticks once per call.
    clock: u64,
    /// The running step's sequences and how far the step may attend each (positions
    /// `0..end`): kept for the whole step, trimmed to no less than that.
    step: HashMap<u64, usize>,
}

impl Pages {
    /// `n_pages` pages, each holding [`PAGE`] positions of `layers` layers.
    pub fn new(n_pages: usize, layers: usize) -> Self {
        Pages { n_pages, layers, free: (0..n_pages as i32).rev().collect(), seqs: HashMap::new(), clock: 0, step: HashMap::new() }
    }

    /// A step begins: its sequences (`(key, end)`: it may attend positions `0..end` of each)
    /// get pages for those positions where there is room, taken first from what others hold
    /// past what they attend (the step's own past its ends: a share the gateway made
    /// smaller), and keep them until the next step begins. One that does not fit is attended
    /// elsewhere this step: what it holds is room for the others. Uploads are left to the
    /// step's calls.
    pub fn begin_step(&mut self, step: &[(u64, usize)]) {
        self.step.clear();
        for &(key, end) in step {
            let e = self.step.entry(key).or_default();
            *e = (*e).max(end);
        }
        self.tick();
        // Only those short of pages reserve: a reservation marks its sequence used, which
        // would keep what it holds past its end from the others.
        for &(key, _) in step {
            let end = self.step[&key];
            if end.div_ceil(PAGE) > self.seqs.get(&key).map_or(0, |m| m.pages.len()) && !self.reserve(key, end) {
                self.step.insert(key, 0);
            }
        }
    }

    /// Sequences gone (released, or lost with a failed step): their pages are free.
    pub fn release(&mut self, keys: &[u64]) {
        for key in keys {
            if let Some(m) = self.seqs.remove(key) {
                self.free.extend(m.pages);
            }
        }
    }

    /// Pages of `m` (sequence `key`) that room may come from in a call at `clock`: none if
    /// the call used it, those past the step's end if the step runs it, else all.
    fn spare_pages(&self, key: u64, m: &Mirrored, clock: u64) -> usize {
        match self.step.get(&key) {
            _ if m.used >= clock => 0,
            Some(&end) => m.pages.len().saturating_sub(end.div_ceil(PAGE)),
            None => m.pages.len(),
        }
    }

    /// Positions the pool holds, all sequences together.
    pub fn capacity(&self) -> usize {
        self.n_pages * PAGE
    }

    /// Starts a call (a store or an attention): what it uses is safe from it.
    pub fn tick(&mut self) {
        self.clock += 1;
    }

    /// Pages for positions `0..end` of `key`, making room from other sequences; false
    /// (nothing taken from others) when even all the room they give is not enough.
    pub fn reserve(&mut self, key: u64, end: usize) -> bool {
        let need = end.div_ceil(PAGE);
        let have = self.seqs.get(&key).map_or(0, |m| m.pages.len());
        let clock = self.clock;
        if need > have {
            let spare: usize = self.seqs.iter().filter(|&(&k, _)| k != key).map(|(&k, m)| self.spare_pages(k, m, clock)).sum();
            if self.free.len() + spare < need - have {
                return false;
            }
        }
        while self.free.len() < need.saturating_sub(have) {
            self.make_room(key, need - have - self.free.len());
        }
        let layers = self.layers;
        let m = self.seqs.entry(key).or_insert_with(|| Mirrored { pages: Vec::new(), filled: vec![0; layers], used: clock, attended: 0 });
        m.used = clock;
        while m.pages.len() < need {
            m.pages.push(self.free.pop().expect("made room above"));
        }
        true
    }

    /// Pages for positions `0..end` of every `(key, end)` of a batch in one call, none of them
    /// taking room from another (each is marked used before any reserves); false when they
    /// do not all fit (what was reserved stays).
    pub fn reserve_all(&mut self, items: &[(u64, usize)]) -> bool {
        self.tick();
        let clock = self.clock;
        for (key, _) in items {
            if let Some(m) = self.seqs.get_mut(key) {
                m.used = clock;
            }
        }
        items.iter().all(|&(key, end)| self.reserve(key, end))
    }

    /// Frees up to `want` pages (at least one where it can) of a sequence other than `key`
    /// not used in this call, from the end of its positions, the least recently used first:
    /// one outside the step holding pages past what the GPU last attended, down to that; else
    /// one of the step holding pages past the step's end, down to that; else one outside the
    /// step, down to nothing.
    fn make_room(&mut self, key: u64, want: usize) {
        let (clock, step) = (self.clock, &self.step);
        // ((rank, last used), key, pages kept) of each sequence room may come from.
        let (_, victim, keep) = self
            .seqs
            .iter()
            .filter(|&(&k, m)| k != key && m.used < clock)
            .filter_map(|(&k, m)| {
                let (rank, keep) = match step.get(&k) {
                    None if m.pages.len() > m.attended.div_ceil(PAGE) => (0, m.attended.div_ceil(PAGE)),
                    Some(&end) if m.pages.len() > end.div_ceil(PAGE) => (1, end.div_ceil(PAGE)),
                    None => (2, 0),
                    Some(_) => return None,
                };
                Some(((rank, m.used), k, keep))
            })
            .min_by_key(|&(order, ..)| order)
            .expect("reserve counted the room");
        let m = self.seqs.get_mut(&victim).expect("found above");
        let keep = keep.max(m.pages.len().saturating_sub(want));
        self.free.extend(m.pages.drain(keep..));
        if keep == 0 {
            self.seqs.remove(&victim);
        } else {
            m.filled.iter_mut().for_each(|f| *f = (*f).min(keep * PAGE));
            m.attended = m.attended.min(keep * PAGE);
        }
    }

    /// Where a new row of `key` at `pos` of `layer` goes: its slot (page · [`PAGE`] +
    /// offset), or `None` when it would leave a gap after the mirrored prefix (the GPU attends
    /// a prefix; the rest is uploaded when it is needed) or there is no room. A row before
    /// the prefix's end (a sequence taken back) drops the positions after it.
    /// A row past what the running step attends of its sequence takes only free pages: no
    /// attention of the step reads it, and it would be the first thing trimmed.
    pub fn write_slot(&mut self, key: u64, layer: usize, pos: usize) -> Option<i32> {
        if pos > self.filled(key, layer) {
            return None;
        }
        let past_step = self.step.get(&key).is_some_and(|&end| pos >= end);
        let short = (pos + 1).div_ceil(PAGE).saturating_sub(self.seqs.get(&key).map_or(0, |m| m.pages.len()));
        if (past_step && short > self.free.len()) || !self.reserve(key, pos + 1) {
            return None;
        }
        self.set_filled(key, layer, pos + 1);
        Some(self.slot(key, pos))
    }

    /// How many of `key`'s first positions of `layer` are mirrored.
    pub fn filled(&self, key: u64, layer: usize) -> usize {
        self.seqs.get(&key).map_or(0, |m| m.filled[layer])
    }

    /// Records that positions `0..n` of `key`'s `layer` are mirrored (reserved).
    pub fn set_filled(&mut self, key: u64, layer: usize, n: usize) {
        if let Some(m) = self.seqs.get_mut(&key) {
            m.filled[layer] = n;
        }
    }

    /// The slot of position `pos` of `key` (reserved).
    pub fn slot(&self, key: u64, pos: usize) -> i32 {
        self.seqs[&key].pages[pos / PAGE] * PAGE as i32 + (pos % PAGE) as i32
    }

    /// `key`'s pages in position order (reserved).
    pub fn table(&self, key: u64) -> &[i32] {
        &self.seqs[&key].pages
    }

    /// Records how far this call's attention reached into `key` (positions `0..end`).
    pub fn attended(&mut self, key: u64, end: usize) {
        if let Some(m) = self.seqs.get_mut(&key) {
            m.attended = end;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reserves `0..end` of `key` in a call of its own, marking it all filled and attended.
    fn hold(p: &mut Pages, key: u64, end: usize, attended: usize) -> bool {
        p.tick();
        let ok = p.reserve(key, end);
        if ok {
            p.set_filled(key, 0, end);
            p.attended(key, attended);
        }
        ok
    }

    fn pages_of(p: &Pages, key: u64) -> usize {
        p.seqs.get(&key).map_or(0, |m| m.pages.len())
    }

    #[test]
    fn room_comes_from_what_the_gpu_did_not_attend_before_whole_sequences() {
        // 10 pages. Sequence 1 holds 6 pages of its prompt but the GPU attended only 2 pages'
        // worth; sequence 2 holds 3, all attended.
        let mut p = Pages::new(10, 1);
        assert!(hold(&mut p, 1, 6 * PAGE, 2 * PAGE));
        assert!(hold(&mut p, 2, 3 * PAGE, 3 * PAGE));
        // Sequence 3 needs 4: one is free, and 1 gives the three it needs from its end (its
        // filled prefix with it), not all past what was attended.
        assert!(hold(&mut p, 3, 4 * PAGE, 4 * PAGE));
        assert_eq!((pages_of(&p, 1), pages_of(&p, 2), pages_of(&p, 3)), (3, 3, 4));
        assert_eq!(p.filled(1, 0), 3 * PAGE);
        // Sequence 4 needs 2: 1 gives its last unattended page, then, nothing being left to
        // trim, the least recently used (1 again) gives one more from its end.
        assert!(hold(&mut p, 4, 2 * PAGE, 2 * PAGE));
        assert_eq!((pages_of(&p, 1), pages_of(&p, 2), pages_of(&p, 3), pages_of(&p, 4)), (1, 3, 4, 2));
        assert_eq!(p.filled(1, 0), PAGE);
        // More than all the others give: refused, and nobody loses anything.
        assert!(!hold(&mut p, 5, 11 * PAGE, 0));
        assert_eq!((pages_of(&p, 1), pages_of(&p, 2), pages_of(&p, 3), pages_of(&p, 4)), (1, 3, 4, 2));
        assert!(p.free.is_empty());
    }

    #[test]
    fn a_call_never_takes_room_from_what_it_uses() {
        let mut p = Pages::new(4, 1);
        p.tick();
        assert!(p.reserve(1, 2 * PAGE));
        // In the same call, sequence 2 can have the 2 free pages but not sequence 1's.
        assert!(p.reserve(2, 2 * PAGE));
        assert!(!p.reserve(3, PAGE));
        assert_eq!((pages_of(&p, 1), pages_of(&p, 2)), (2, 2));
        // In the next call, 3 takes a page of the least recently used: both were used in the
        // last call (equal clocks) — either way exactly one page is lost.
        p.tick();
        assert!(p.reserve(3, PAGE));
        assert_eq!(pages_of(&p, 1) + pages_of(&p, 2), 3);
    }

    #[test]
    fn a_batch_reserved_together_takes_no_room_from_its_own_sequences() {
        // 6 pages: sequence 1 holds 2 (attended), sequence 2 holds 4 of which the GPU
        // attended 1 page's worth — the first to be trimmed, were it not in the batch.
        let mut p = Pages::new(6, 1);
        assert!(hold(&mut p, 1, 2 * PAGE, 2 * PAGE));
        assert!(hold(&mut p, 2, 4 * PAGE, PAGE));
        // A batch of 1 (growing to 3 pages) and 2: 1's extra page cannot come from 2.
        assert!(!p.reserve_all(&[(1, 3 * PAGE), (2, 4 * PAGE)]));
        assert_eq!((pages_of(&p, 2), p.filled(2, 0)), (4, 4 * PAGE));
        // Sequence 1 alone takes it from 2 (the last of what the GPU did not attend).
        assert!(p.reserve_all(&[(1, 3 * PAGE)]));
        assert_eq!((pages_of(&p, 1), pages_of(&p, 2), p.filled(2, 0)), (3, 3, 3 * PAGE));
    }

    /// One layer's attention call over `items` (`(key, end)`): each reserved in turn (as the
    /// mirror's launch does) and, where it fits, its layer `layer` filled (uploaded) to its
    /// end; the positions uploaded.
    fn attend_layer(p: &mut Pages, layer: usize, items: &[(u64, usize)]) -> usize {
        p.tick();
        let mut uploaded = 0;
        for &(key, end) in items {
            if p.reserve(key, end) {
                uploaded += end.saturating_sub(p.filled(key, layer));
                p.set_filled(key, layer, end);
                p.attended(key, end);
            }
        }
        uploaded
    }

    #[test]
    fn a_step_over_the_mirror_keeps_what_fits_and_evicts_none_of_its_own() {
        // 10 pages, 2 layers: decoding sequences 1 and 2 hold 4 pages each, all mirrored.
        let mut p = Pages::new(10, 2);
        for key in [1, 2] {
            assert!(hold(&mut p, key, 4 * PAGE, 4 * PAGE));
            p.set_filled(key, 1, 4 * PAGE);
        }
        // A step with them and a prompt chunk of 3 (4 pages, 12 in all): each layer
        // attends the chunk in one call and the decode rows in another.
        let (decode, chunk) = ([(1, 4 * PAGE), (2, 4 * PAGE)], [(3, 4 * PAGE)]);
        p.begin_step(&[decode[0], decode[1], chunk[0]]);
        let mut uploaded = 0;
        for layer in 0..2 {
            uploaded += attend_layer(&mut p, layer, &chunk) + attend_layer(&mut p, layer, &decode);
        }
        // The chunk does not fit; nothing is uploaded or evicted. Without the step's
        // protection the chunk evicted 1 (the least recently used), 1 then evicted 2, 2 the
        // chunk, and so on, each layer uploading again what it lost (16 pages' worth here).
        assert_eq!(uploaded, 0);
        for layer in 0..2 {
            assert_eq!((p.filled(1, layer), p.filled(2, layer), p.filled(3, layer)), (4 * PAGE, 4 * PAGE, 0));
        }
    }

    #[test]
    fn a_step_takes_room_from_its_sequences_past_their_share_before_evicting_others() {
        // 10 pages: sequence 1 holds 6 (all attended), 9 (not in the step) holds 4.
        let mut p = Pages::new(10, 1);
        assert!(hold(&mut p, 9, 4 * PAGE, 4 * PAGE));
        assert!(hold(&mut p, 1, 6 * PAGE, 6 * PAGE));
        // The step shares the mirror anew: 1 may attend 2 pages' worth, newcomer 2 needs 4.
        p.begin_step(&[(1, 2 * PAGE), (2, 4 * PAGE)]);
        assert_eq!(attend_layer(&mut p, 0, &[(1, 2 * PAGE), (2, 4 * PAGE)]), 4 * PAGE);
        // 1 was trimmed to its share; 9, a session between turns, kept everything.
        assert_eq!((pages_of(&p, 1), pages_of(&p, 2), pages_of(&p, 9)), (2, 4, 4));
        assert_eq!(p.filled(1, 0), 2 * PAGE);
        // A released sequence's pages are free at once.
        p.release(&[9]);
        assert_eq!((pages_of(&p, 9), p.free.len()), (0, 4));
    }

    #[test]
    fn a_step_sequence_that_cannot_fit_gives_its_pages_to_the_others() {
        // 4 pages: 5 holds 3 of them from earlier steps.
        let mut p = Pages::new(4, 1);
        assert!(hold(&mut p, 5, 3 * PAGE, 3 * PAGE));
        // The step wants 12 pages of 5 (it will be attended on the host) and 2 of 6: 6 takes
        // the free one and one of 5's last, 5 keeps the rest of its prefix.
        p.begin_step(&[(5, 12 * PAGE), (6, 2 * PAGE)]);
        assert_eq!((pages_of(&p, 5), pages_of(&p, 6)), (2, 2));
        assert_eq!(p.filled(5, 0), 2 * PAGE);
    }

    #[test]
    fn a_row_past_the_steps_share_takes_only_free_pages() {
        // 3 pages: 1 holds 1 (full, all mirrored), 9 (a session between turns) 2.
        let mut p = Pages::new(3, 1);
        assert!(hold(&mut p, 9, 2 * PAGE, 2 * PAGE));
        assert!(hold(&mut p, 1, PAGE, PAGE));
        // The step attends 1's first page only: its new row would need a page, none is free.
        p.begin_step(&[(1, PAGE)]);
        p.tick();
        assert_eq!(p.write_slot(1, 0, PAGE), None);
        assert_eq!((pages_of(&p, 1), pages_of(&p, 9)), (1, 2));
    }

    #[test]
    fn rows_extend_the_prefix_rewrite_it_or_wait_for_an_upload() {
        let mut p = Pages::new(8, 2);
        p.tick();
        // Rows 0..20 of layer 1 in order: slots on two pages.
        let slots: Vec<_> = (0..20).map(|pos| p.write_slot(7, 1, pos).unwrap()).collect();
        assert_eq!(slots[16] / PAGE as i32, p.table(7)[1]);
        assert_eq!(p.filled(7, 1), 20);
        assert_eq!(p.filled(7, 0), 0);
        // Past the prefix: a gap, not written (layer 0 holds nothing yet).
        assert_eq!(p.write_slot(7, 0, 5), None);
        assert_eq!(p.write_slot(7, 1, 25), None);
        // Taken back to 10: the positions after it are no longer mirrored.
        assert!(p.write_slot(7, 1, 10).is_some());
        assert_eq!(p.filled(7, 1), 11);
    }
}
