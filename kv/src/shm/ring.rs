//! The exchange ring: a single-producer/single-consumer ring of fixed-size job slots in a
//! shared-memory [`Segment`], with sequence numbers in atomics and spin-then-futex waiting.
//!
//! # Layout (all little-endian, offsets in bytes)
//!
//! | offset | what | written by |
//! |---|---|---|
//! | 0 | magic `u64` ([`RING_MAGIC`]), version `u32`, slot count `u32`, slot bytes `u64`, slots offset `u64`, closed flag `u32`, no-spin flag `u32` | creator (closed: either side; no-spin: the producer) |
//! | 64 | `posted: AtomicU64`: jobs posted so far (next job's sequence number) | producer |
//! | 128 | `done: AtomicU64`: jobs completed so far | consumer |
//! | 192 | job doorbell `AtomicU32` (futex word), consumer-sleeping flag `AtomicU32` | producer / consumer |
//! | 256 | done doorbell `AtomicU32` (futex word), producer-sleeping flag `AtomicU32` | consumer / producer |
//! | 4096 | slot 0, then slot 1, ... each `slot_bytes` rounded up to 64 | owner of the slot |
//!
//! Each counter has its own 64-byte cache line, so the two sides never false-share on the
//! fast path. Job `seq` lives in slot `seq % slots`.
//!
//! # Ownership and memory ordering
//!
//! Slot `seq % slots` belongs to the producer while it fills job `seq`, to the consumer from
//! the moment it observes `posted > seq` until it stores `done = seq + 1`, and to the
//! producer again afterwards (to read the result, then to reuse it for job `seq + slots`,
//! which `post` only does once `done > seq`). Every hand-over is a Release store of a
//! counter (after the slot writes) observed by an Acquire load (before the slot reads), so
//! the writes of the side giving up the slot happen-before the accesses of the side taking
//! it: no slot byte is ever accessed by both sides concurrently.
//!
//! Sleeping must not lose a wake-up. A waiter reads the doorbell, sets its sleeping flag,
//! issues a SeqCst fence and re-checks its condition before `futex_wait(doorbell, seen)`; a
//! publisher stores its counter, issues a SeqCst fence and reads the flag, bumping the
//! doorbell and calling `futex_wake` only if it is set. The two fences order the pairs
//! (flag store, counter load) and (counter store, flag load): at least one side sees the
//! other's store. Either the waiter sees the new counter and does not sleep, or the
//! publisher sees the flag and bumps the doorbell after the waiter read it, so the kernel's
//! atomic compare in `futex_wait` refuses to sleep or the wake finds the sleeper. While the
//! other side is awake (spinning), the fast path makes no system call.
//!
//! Where the producer computes on the consumer's cores (the gpu-worker's CPU device beside
//! local cpu-workers), a spinning waiter takes a core the other side is computing on, and in
//! a VM a `pause` loop may make the hypervisor deschedule the vCPU. The producer can raise
//! the no-spin flag ([`Producer::set_no_spin`]); both sides then sleep at once. The
//! gpu-worker raises it where the rings carry expert jobs (a millisecond or more of the
//! cpu-worker on every core while the device waits).
//!
//! Measured on this project's 2-core VM, in alternating runs (docs/benchmarks.md):
//! - The OLMoE shape's batch-1 decode, experts on the cpu-worker: from 34.6–35.6 to
//!   36.2–36.5 tok/s. Spinning only 256 checks (8 µs) was as slow as 2048.
//! - Attention jobs at depth (16 sessions at depth 1024) lost 4–7 % without spinning: the
//!   two sides' shares end close together, and a spinning waiter catches the other's end.
//!   So a dense model's rings keep spinning.

use std::hint::spin_loop;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::futex::{futex_wait, futex_wake};
use super::{Segment, ShmError};

/// `b"DUETXCHG"` read as a little-endian `u64`.
pub const RING_MAGIC: u64 = u64::from_le_bytes(*b"DUETXCHG");
/// Layout version; bump on any change to the layout above.
pub const RING_VERSION: u32 = 2;

const LINE: usize = 64;
const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_SLOTS: usize = 12;
const OFF_SLOT_BYTES: usize = 16;
const OFF_SLOTS_OFFSET: usize = 24;
const OFF_CLOSED: usize = 32;
const OFF_NO_SPIN: usize = 36;
const OFF_POSTED: usize = LINE;
const OFF_DONE: usize = 2 * LINE;
const OFF_JOB_BELL: usize = 3 * LINE;
const OFF_CONSUMER_SLEEPING: usize = 3 * LINE + 4;
const OFF_DONE_BELL: usize = 4 * LINE;
const OFF_PRODUCER_SLEEPING: usize = 4 * LINE + 4;
/// Slots start page-aligned.
const HEADER_BYTES: usize = 4096;

/// How a side waits: spin `spins` times (checking the condition, with
/// [`std::hint::spin_loop`] between checks), then sleep on the futex until woken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiter {
    /// Condition checks before sleeping. 0 sleeps at once; `u32::MAX` spins for minutes.
    pub spins: u32,
}

impl Waiter {
    /// The default spin count: about 65 µs on the project's AMD EPYC machine (32 ns per
    /// check; a `pause` costs 10 to 140 cycles depending on the CPU). Long enough to catch
    /// back-to-back jobs without a system call, short enough that a waiter on oversubscribed
    /// cores gives its core up quickly.
    pub const DEFAULT_SPINS: u32 = 2048;

    /// Spin `spins` checks, then sleep.
    pub const fn spin_then_sleep(spins: u32) -> Waiter {
        Waiter { spins }
    }
}

impl Default for Waiter {
    fn default() -> Waiter {
        Waiter { spins: Waiter::DEFAULT_SPINS }
    }
}

/// A ring laid out in a segment, not yet split into its producer or consumer side.
#[derive(Debug)]
pub struct Ring {
    seg: Segment,
    slots: u32,
    slot_bytes: usize,
    stride: usize,
    waiter: Waiter,
}

impl Ring {
    /// Bytes a segment needs for `slots` slots of `slot_bytes` each (`None` on overflow).
    pub fn bytes_needed(slots: u32, slot_bytes: usize) -> Option<usize> {
        let stride = slot_bytes.checked_next_multiple_of(LINE)?;
        stride.checked_mul(slots as usize)?.checked_add(HEADER_BYTES)
    }

    /// Lays out a fresh ring in `segment` (resetting any previous contents of its header).
    /// Nobody may be attached to the segment's ring while this runs.
    pub fn create(segment: Segment, slots: u32, slot_bytes: usize) -> Result<Ring, ShmError> {
        let bad = |reason: &str| ShmError::BadLayout { name: segment.name().to_string(), reason: reason.into() };
        if slots == 0 || slot_bytes == 0 {
            return Err(bad("slot count and slot size must be positive"));
        }
        let need = Ring::bytes_needed(slots, slot_bytes).ok_or_else(|| bad("size overflows"))?;
        if segment.len() < need {
            let what = format!("segment {} for {slots} slots of {slot_bytes} bytes", segment.name());
            return Err(ShmError::TooSmall { what, len: segment.len(), need });
        }
        let s = &segment;
        s.atomic_u64(OFF_MAGIC).store(0, Ordering::Relaxed);
        s.atomic_u32(OFF_VERSION).store(RING_VERSION, Ordering::Relaxed);
        s.atomic_u32(OFF_SLOTS).store(slots, Ordering::Relaxed);
        s.atomic_u64(OFF_SLOT_BYTES).store(slot_bytes as u64, Ordering::Relaxed);
        s.atomic_u64(OFF_SLOTS_OFFSET).store(HEADER_BYTES as u64, Ordering::Relaxed);
        for off in [OFF_CLOSED, OFF_NO_SPIN, OFF_JOB_BELL, OFF_CONSUMER_SLEEPING, OFF_DONE_BELL, OFF_PRODUCER_SLEEPING] {
            s.atomic_u32(off).store(0, Ordering::Relaxed);
        }
        s.atomic_u64(OFF_POSTED).store(0, Ordering::Relaxed);
        s.atomic_u64(OFF_DONE).store(0, Ordering::Relaxed);
        // Publish: whoever reads the magic with Acquire sees the whole header.
        s.atomic_u64(OFF_MAGIC).store(RING_MAGIC, Ordering::Release);
        Ok(Ring::new(segment, slots, slot_bytes))
    }

    /// Attaches to the ring another handle created in `segment`, validating its header.
    pub fn attach(segment: Segment) -> Result<Ring, ShmError> {
        let bad = |reason: String| Err(ShmError::BadLayout { name: segment.name().to_string(), reason });
        if segment.len() < HEADER_BYTES {
            let what = format!("segment {} for a ring header", segment.name());
            return Err(ShmError::TooSmall { what, len: segment.len(), need: HEADER_BYTES });
        }
        let s = &segment;
        let magic = s.atomic_u64(OFF_MAGIC).load(Ordering::Acquire);
        if magic != RING_MAGIC {
            return bad(format!("no ring header (magic {magic:#018x}, expected {RING_MAGIC:#018x})"));
        }
        let version = s.atomic_u32(OFF_VERSION).load(Ordering::Relaxed);
        if version != RING_VERSION {
            return bad(format!("layout version {version}, this build speaks {RING_VERSION}"));
        }
        let slots = s.atomic_u32(OFF_SLOTS).load(Ordering::Relaxed);
        let slot_bytes = usize::try_from(s.atomic_u64(OFF_SLOT_BYTES).load(Ordering::Relaxed)).unwrap_or(0);
        let slots_offset = s.atomic_u64(OFF_SLOTS_OFFSET).load(Ordering::Relaxed);
        if slots == 0 || slot_bytes == 0 || slots_offset != HEADER_BYTES as u64 {
            return bad(format!("bad geometry: {slots} slots of {slot_bytes} bytes at offset {slots_offset}"));
        }
        let need = match Ring::bytes_needed(slots, slot_bytes) {
            Some(n) => n,
            None => return bad("size overflows".into()),
        };
        if s.len() < need {
            let what = format!("segment {} for {slots} slots of {slot_bytes} bytes", s.name());
            return Err(ShmError::TooSmall { what, len: s.len(), need });
        }
        let posted = s.atomic_u64(OFF_POSTED).load(Ordering::Acquire);
        let done = s.atomic_u64(OFF_DONE).load(Ordering::Acquire);
        if done > posted || posted - done > slots as u64 {
            return bad(format!("corrupt sequence numbers: posted {posted}, done {done}"));
        }
        Ok(Ring::new(segment, slots, slot_bytes))
    }

    fn new(seg: Segment, slots: u32, slot_bytes: usize) -> Ring {
        let stride = slot_bytes.next_multiple_of(LINE);
        Ring { seg, slots, slot_bytes, stride, waiter: Waiter::default() }
    }

    /// Sets how this handle waits.
    pub fn with_waiter(mut self, waiter: Waiter) -> Ring {
        self.waiter = waiter;
        self
    }

    /// Number of slots (jobs that can be in flight at once).
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Usable bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// The segment holding the ring.
    pub fn segment(&self) -> &Segment {
        &self.seg
    }

    /// This handle becomes the ring's producer. Exactly one producer may exist per ring
    /// across all processes. It continues from the ring's current sequence numbers.
    pub fn producer(self) -> Producer {
        let posted = self.posted().load(Ordering::Acquire);
        let done = self.done().load(Ordering::Acquire);
        Producer { ring: self, posted, done }
    }

    /// This handle becomes the ring's consumer. Exactly one consumer may exist per ring
    /// across all processes. Jobs posted but not completed are served (again) by it.
    pub fn consumer(self) -> Consumer {
        let done = self.done().load(Ordering::Acquire);
        let posted = self.posted().load(Ordering::Acquire);
        Consumer { ring: self, done, posted }
    }

    /// Marks the ring closed and wakes both sides: waits then fail with [`ShmError::Closed`]
    /// (a wait whose condition already holds still succeeds).
    fn close(&self) {
        self.seg.atomic_u32(OFF_CLOSED).store(1, Ordering::SeqCst);
        for bell in [OFF_JOB_BELL, OFF_DONE_BELL] {
            let bell = self.seg.atomic_u32(bell);
            bell.fetch_add(1, Ordering::SeqCst);
            futex_wake(bell, u32::MAX);
        }
    }

    fn is_closed(&self) -> bool {
        self.seg.atomic_u32(OFF_CLOSED).load(Ordering::Acquire) != 0
    }

    fn posted(&self) -> &AtomicU64 {
        self.seg.atomic_u64(OFF_POSTED)
    }

    fn done(&self) -> &AtomicU64 {
        self.seg.atomic_u64(OFF_DONE)
    }

    /// The bytes of job `seq`'s slot.
    ///
    /// # Safety
    /// The caller must own the slot (see the module docs) for the slice's lifetime.
    #[allow(clippy::mut_from_ref)] // exclusivity comes from the ring protocol
    unsafe fn slot(&self, seq: u64) -> &mut [u8] {
        let offset = HEADER_BYTES + (seq % self.slots as u64) as usize * self.stride;
        // SAFETY: the caller owns the slot; u8 is Pod; bounds were validated at create/attach.
        unsafe { self.seg.slice_mut::<u8>(offset, self.slot_bytes) }
    }

    /// Publishes a counter store to the other side: wakes it only if it said it sleeps.
    fn notify(&self, bell: usize, sleeping: usize) {
        fence(Ordering::SeqCst);
        if self.seg.atomic_u32(sleeping).load(Ordering::SeqCst) != 0 {
            let bell = self.seg.atomic_u32(bell);
            bell.fetch_add(1, Ordering::SeqCst);
            futex_wake(bell, 1);
        }
    }

    /// Waits until `ready()`: spins, then sleeps on `bell` with `sleeping` raised.
    fn wait_for(
        &self,
        ready: impl Fn() -> bool,
        bell: usize,
        sleeping: usize,
        timeout: Option<Duration>,
        what: &'static str,
    ) -> Result<(), ShmError> {
        if ready() {
            return Ok(());
        }
        let start = Instant::now();
        let expired = || timeout.is_some_and(|t| start.elapsed() >= t);
        let spins = if self.seg.atomic_u32(OFF_NO_SPIN).load(Ordering::Relaxed) != 0 { 0 } else { self.waiter.spins };
        for i in 0..spins {
            if ready() {
                return Ok(());
            }
            // Long spins still notice a close or a timeout.
            if i % 1024 == 1023 && (self.is_closed() || expired()) {
                break;
            }
            spin_loop();
        }
        let (bell, sleeping) = (self.seg.atomic_u32(bell), self.seg.atomic_u32(sleeping));
        loop {
            if ready() {
                return Ok(());
            }
            let remaining = match timeout {
                None => None,
                Some(t) if start.elapsed() >= t => {
                    let (name, waited_us) = (self.seg.name().to_string(), start.elapsed().as_micros());
                    return Err(ShmError::TimedOut { name, what, waited_us });
                }
                Some(t) => Some(t.saturating_sub(start.elapsed())),
            };
            let seen = bell.load(Ordering::SeqCst);
            sleeping.store(1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            if ready() {
                sleeping.store(0, Ordering::Relaxed);
                return Ok(());
            }
            if self.is_closed() {
                sleeping.store(0, Ordering::Relaxed);
                return Err(ShmError::Closed { name: self.seg.name().to_string() });
            }
            futex_wait(bell, seen, remaining);
            sleeping.store(0, Ordering::Relaxed);
        }
    }
}

/// The producing side (the gpu-worker): posts jobs and waits for their results.
#[derive(Debug)]
pub struct Producer {
    ring: Ring,
    /// Jobs posted (mirror of the shared counter, which only this side writes).
    posted: u64,
    /// Last value of the shared `done` counter seen.
    done: u64,
}

impl Producer {
    /// Posts a job: waits for a free slot (the oldest job's completion) if all are in flight,
    /// lets `fill` write the slot, publishes it and returns its sequence number. Fails only
    /// if the ring is closed.
    pub fn post(&mut self, fill: impl FnOnce(&mut [u8])) -> Result<u64, ShmError> {
        let seq = self.posted;
        let slots = self.ring.slots as u64;
        if self.ring.is_closed() {
            return Err(ShmError::Closed { name: self.ring.seg.name().to_string() });
        }
        if seq - self.done >= slots {
            let done = self.ring.done();
            let ready = || done.load(Ordering::Acquire) + slots > seq;
            self.ring.wait_for(ready, OFF_DONE_BELL, OFF_PRODUCER_SLEEPING, None, "a free slot")?;
            self.done = done.load(Ordering::Acquire);
        }
        // SAFETY: `done + slots > seq`, observed with Acquire, means the consumer completed
        // job `seq - slots` (this slot's previous job) and will not touch the slot until it
        // observes `posted > seq`, which is published only after `fill` returns.
        fill(unsafe { self.ring.slot(seq) });
        self.ring.posted().store(seq + 1, Ordering::Release);
        self.posted = seq + 1;
        self.ring.notify(OFF_JOB_BELL, OFF_CONSUMER_SLEEPING);
        Ok(seq)
    }

    /// Waits until job `seq` is complete and returns its slot (the result the consumer wrote).
    /// Panics if `seq` was not posted or its slot was already reused by a later post.
    pub fn wait_done(&mut self, seq: u64) -> Result<&[u8], ShmError> {
        self.wait_done_inner(seq, None)
    }

    /// [`Producer::wait_done`] giving up after `timeout` with [`ShmError::TimedOut`] (e.g. the
    /// consumer process died).
    pub fn wait_done_timeout(&mut self, seq: u64, timeout: Duration) -> Result<&[u8], ShmError> {
        self.wait_done_inner(seq, Some(timeout))
    }

    fn wait_done_inner(&mut self, seq: u64, timeout: Option<Duration>) -> Result<&[u8], ShmError> {
        assert!(seq < self.posted, "job {seq} was never posted (posted: {})", self.posted);
        let slots = self.ring.slots as u64;
        assert!(seq + slots >= self.posted, "job {seq}'s slot was reused by job {}", seq + slots);
        if self.done <= seq {
            let done = self.ring.done();
            let ready = || done.load(Ordering::Acquire) > seq;
            self.ring.wait_for(ready, OFF_DONE_BELL, OFF_PRODUCER_SLEEPING, timeout, "a job's completion")?;
            self.done = done.load(Ordering::Acquire);
        }
        // SAFETY: `done > seq` was observed with Acquire, so the consumer finished writing
        // the slot and never touches it again; the producer reuses it only in `post`, which
        // needs `&mut self` and so cannot run while the returned slice borrows `self`.
        Ok(unsafe { self.ring.slot(seq) })
    }

    /// Asks both sides to sleep at once when they wait, never spinning (`true`: the producer
    /// computes on the consumer's cores; see the module's notes), or to spin first again.
    pub fn set_no_spin(&self, no_spin: bool) {
        self.ring.seg.atomic_u32(OFF_NO_SPIN).store(u32::from(no_spin), Ordering::Relaxed);
    }

    /// Whether job `seq` is complete (no waiting).
    pub fn is_done(&self, seq: u64) -> bool {
        self.ring.done().load(Ordering::Acquire) > seq
    }

    /// Closes the ring for both sides (shutdown).
    pub fn close(&self) {
        self.ring.close();
    }

    /// The ring this side works on.
    pub fn ring(&self) -> &Ring {
        &self.ring
    }
}

/// The consuming side (a cpu-worker): takes jobs in order and completes them in place.
#[derive(Debug)]
pub struct Consumer {
    ring: Ring,
    /// Jobs completed (mirror of the shared counter, which only this side writes).
    done: u64,
    /// Last value of the shared `posted` counter seen.
    posted: u64,
}

impl Consumer {
    /// Waits for the oldest job not yet completed and returns its sequence number and slot,
    /// in which the result is written before [`Consumer::complete`]. Calling it again before
    /// completing returns the same job. Fails only if the ring is closed while waiting.
    pub fn next_job(&mut self) -> Result<(u64, &mut [u8]), ShmError> {
        self.next_job_inner(None)
    }

    /// [`Consumer::next_job`] giving up after `timeout` with [`ShmError::TimedOut`], so a
    /// worker loop can check for shutdown.
    pub fn next_job_timeout(&mut self, timeout: Duration) -> Result<(u64, &mut [u8]), ShmError> {
        self.next_job_inner(Some(timeout))
    }

    fn next_job_inner(&mut self, timeout: Option<Duration>) -> Result<(u64, &mut [u8]), ShmError> {
        let seq = self.done;
        if self.posted <= seq {
            let posted = self.ring.posted();
            let ready = || posted.load(Ordering::Acquire) > seq;
            self.ring.wait_for(ready, OFF_JOB_BELL, OFF_CONSUMER_SLEEPING, timeout, "a job")?;
            self.posted = posted.load(Ordering::Acquire);
        }
        // SAFETY: `posted > seq` was observed with Acquire, so the producer finished writing
        // the slot and will not touch it until it observes `done > seq`, which only
        // `complete` publishes, and `complete` needs `&mut self`, which the slice borrows.
        Ok((seq, unsafe { self.ring.slot(seq) }))
    }

    /// Publishes job `seq`'s result (written into its slot) to the producer. Jobs complete
    /// in order: panics unless `seq` is the job [`Consumer::next_job`] returned.
    pub fn complete(&mut self, seq: u64) {
        assert!(seq == self.done && seq < self.posted, "complete({seq}): the current job is {}", self.done);
        self.ring.done().store(seq + 1, Ordering::Release);
        self.done = seq + 1;
        self.ring.notify(OFF_DONE_BELL, OFF_PRODUCER_SLEEPING);
    }

    /// Closes the ring for both sides (shutdown).
    pub fn close(&self) {
        self.ring.close();
    }

    /// The ring this side works on.
    pub fn ring(&self) -> &Ring {
        &self.ring
    }
}
