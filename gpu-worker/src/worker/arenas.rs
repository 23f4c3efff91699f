//! The cpu-workers' KV arenas and exchange rings as the gpu-worker maps them: it writes new
//! K/V rows straight into arena slots, reads rows back for its own share of attention, and
//! posts attention jobs into each worker's ring.

use std::ops::Range;
use std::time::{Duration, Instant};

use duet_kernels::attention::{KvRows, KvRun};
use duet_kernels::dot::quantize_row;
use duet_kernels::GgmlType;
use duet_kv::{ArenaLayout, BlockId, KvDtype, KvShape};
use duet_kv::shm::{Producer, Ring, Segment};
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::StepError;
use crate::device::{HostMapping, InPlaceRow, KvAccessError};

/// The distinct made-up rows [`KvArenas::write_synthetic`] cycles through.
pub const SYNTHETIC_ROWS: usize = 16;

/// One attached cpu-worker.
#[derive(Debug)]
pub struct AttachedWorker {
    /// The device's mapping of the arena, where it stores K/V rows itself
    /// ([`Device::map_host`](crate::device::Device::map_host)): declared before `arena`, so
    /// it ends before the arena is unmapped.
    mapping: Option<HostMapping>,
    arena: Segment,
    pub layout: ArenaLayout,
    pub producer: Producer,
    /// The worker's process id, if known and on this machine.
    pub pid: Option<u32>,
}

/// How often a wait for a cpu-worker's answer checks that the worker is still alive.
const LIVENESS_CHECK: Duration = Duration::from_millis(50);

impl AttachedWorker {
    /// Waits until job `seqno` (attention or experts) is answered: fails once `timeout`
    /// passes or as soon as the worker's process is gone.
    pub fn wait_answer(&mut self, seqno: u64, timeout: Duration) -> Result<(), String> {
        let start = Instant::now();
        loop {
            match self.producer.wait_done_timeout(seqno, LIVENESS_CHECK.min(timeout)) {
                Ok(_) => return Ok(()),
                Err(duet_kv::shm::ShmError::TimedOut { .. }) => {}
                Err(e) => return Err(format!("no answer to its job ({e})")),
            }
            if !self.alive() {
                return Err(format!("its process {} is gone", self.pid.unwrap_or(0)));
            }
            if start.elapsed() >= timeout {
                return Err(format!("no answer to its job within {timeout:?}"));
            }
        }
    }

    /// Whether the worker's process still exists (true when its pid is unknown).
    pub fn alive(&self) -> bool {
        // SAFETY: kill with signal 0 only checks that the process exists.
        self.pid.is_none_or(|pid| unsafe { libc::kill(pid as libc::pid_t, 0) } == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
    }
}

/// The attached cpu-workers, by index.
#[derive(Debug)]
pub struct KvArenas {
    shape: KvShape,
    workers: Vec<Option<AttachedWorker>>,
    /// Whether the rings' waits sleep at once (the device computes on the host's cores,
    /// which local cpu-workers share, and the rings carry expert jobs: see
    /// `duet_kv::shm::ring`).
    no_spin: bool,
}

impl KvArenas {
    /// The arenas of a model of `shape`; `no_spin`: the rings' waits sleep at once.
    pub fn new(shape: KvShape, no_spin: bool) -> Self {
        KvArenas { shape, workers: Vec::new(), no_spin }
    }

    /// Maps worker `worker`'s arena and ring (replacing an earlier attachment, e.g. after
    /// the worker restarted) and returns its block count. The arena must fit the model and
    /// use the block size of the arenas already attached. `map` maps the arena's memory for
    /// the device ([`Device::map_host`](crate::device::Device::map_host)); the mapping is
    /// dropped before the arena is unmapped.
    pub fn attach(&mut self, worker: u32, arena_name: &str, ring_name: &str, pid: Option<u32>, map: impl FnOnce(*mut u8, usize) -> Option<HostMapping>) -> Result<u32, StepError> {
        let attach_err = |what: String| StepError::Attach { worker, what };
        let arena = Segment::open(arena_name).map_err(|e| attach_err(e.to_string()))?;
        let header_len = duet_kv::layout::HEADER_BYTES.min(arena.len());
        // SAFETY: the header is written once by the worker before its ring exists and never
        // changes; the slice lives only for this call.
        let header = unsafe { arena.slice::<u8>(0, header_len) };
        let layout = ArenaLayout::decode_header(header).map_err(|e| attach_err(e.to_string()))?;
        let need = layout.total_bytes().map_err(|e| attach_err(e.to_string()))?;
        if arena.len() < need {
            return Err(attach_err(format!("arena of {} bytes, its layout needs {need}", arena.len())));
        }
        let KvShape { n_layer, n_kv_head, head_dim } = self.shape;
        if layout.kv_shape() != self.shape || !layout.dtype.attended() {
            return Err(attach_err(format!(
                "arena layout {layout:?} does not fit the model ({n_layer} layers, {n_kv_head} KV heads of {head_dim}, f16 or q8_0)"
            )));
        }
        if let Some(other) = self.workers.iter().flatten().find(|w| w.layout.dtype != layout.dtype) {
            return Err(attach_err(format!("KV type {} differs from the other workers' {}", layout.dtype, other.layout.dtype)));
        }
        if let Some(other) = self.workers.iter().flatten().find(|w| w.layout.block_size != layout.block_size) {
            return Err(attach_err(format!(
                "block size {} differs from the other workers' {}",
                layout.block_size, other.layout.block_size
            )));
        }
        let ring = Segment::open(ring_name).and_then(Ring::attach).map_err(|e| attach_err(e.to_string()))?;
        let idx = worker as usize;
        if self.workers.len() <= idx {
            self.workers.resize_with(idx + 1, || None);
        }
        let producer = ring.producer();
        producer.set_no_spin(self.no_spin);
        // The worker this replaces (and its mapping) goes first: its memory may be mapped again.
        self.workers[idx] = None;
        let mapping = map(arena.as_ptr(), arena.len());
        self.workers[idx] = Some(AttachedWorker { mapping, arena, layout, producer, pid });
        Ok(layout.n_blocks)
    }

    /// Forgets a worker whose ring stopped answering; steps naming it fail until it is
    /// attached again.
    pub fn detach(&mut self, worker: u32) {
        if let Some(w) = self.workers.get_mut(worker as usize) {
            *w = None;
        }
    }

    /// Worker indices attached so far, 0.. (a detached worker keeps its index): the expert
    /// shares the workers serve.
    pub fn worker_slots(&self) -> usize {
        self.workers.len()
    }

    /// Tokens per block (`None` before the first attachment).
    pub fn block_size(&self) -> Option<usize> {
        self.workers.iter().flatten().next().map(|w| w.layout.block_size as usize)
    }

    pub fn worker(&self, worker: u32) -> Result<&AttachedWorker, KvAccessError> {
        self.workers.get(worker as usize).and_then(Option::as_ref).ok_or(KvAccessError::WorkerNotAttached(worker))
    }

    pub fn worker_mut(&mut self, worker: u32) -> Result<&mut AttachedWorker, KvAccessError> {
        self.workers.get_mut(worker as usize).and_then(Option::as_mut).ok_or(KvAccessError::WorkerNotAttached(worker))
    }

    /// Checks that `block` of `worker` exists.
    pub fn check_block(&self, worker: u32, block: BlockId) -> Result<(), StepError> {
        let n_blocks = self.worker(worker)?.layout.n_blocks;
        if block.0 >= n_blocks {
            return Err(StepError::BlockOutOfRange { worker, block, n_blocks });
        }
        Ok(())
    }

    /// Stores one token's K and V rows (`[kv_head][head_dim]` each, rounded to the arena's
    /// f16 or quantised to its Q8_0) of `layer` in `slot` of `block` on `worker`. The block
    /// must have been checked.
    pub fn write_token(&self, worker: u32, block: BlockId, slot: usize, layer: u32, k: &[f32], v: &[f32]) -> Result<(), KvAccessError> {
        let w = self.worker(worker)?;
        let hd = w.layout.head_dim as usize;
        let row = w.layout.row_bytes().expect("a validated layout");
        for (h, (kh, vh)) in k.chunks_exact(hd).zip(v.chunks_exact(hd)).enumerate() {
            for (offset, src) in [(w.layout.k_offset(block, layer, h as u32), kh), (w.layout.v_offset(block, layer, h as u32), vh)] {
                // SAFETY (both arms): the offset lies inside the arena (block checked, layout
                // validated against the segment's length). Nobody reads this slot while it is
                // written: the plan gives each token position to one sequence, and its
                // attention jobs are posted after this write (the ring's release/acquire
                // orders them). Nobody else writes it either, though rows are written in
                // parallel (`PlanSlots::write_rows`): the executor refuses a step whose new
                // rows of two places land in one block (`StepError::SharedBlock`).
                if w.layout.dtype == KvDtype::Q8_0 {
                    quantize_row(GgmlType::Q8_0, src, unsafe { w.arena.slice_mut::<u8>(offset + slot * row, row) });
                } else {
                    // Eight at a time with F16C where present (the same rounding).
                    unsafe { w.arena.slice_mut::<f16>(offset + slot * row, hd) }.convert_from_f32_slice(src);
                }
            }
        }
        Ok(())
    }

    /// Benchmarks only (`--synthetic-prefill`): made-up K and V rows of every layer in the
    /// slots of positions `range` of the sequence whose blocks are `blocks`, in parallel —
    /// one of [`SYNTHETIC_ROWS`] fixed pseudo-random rows a position, values in ±0.5, stored
    /// as [`write_token`](Self::write_token) stores computed ones (so attention reads real
    /// bytes). The blocks must have been checked.
    pub fn write_synthetic(&self, blocks: &[(u32, BlockId)], range: Range<usize>) -> Result<(), KvAccessError> {
        let bs = self.block_size().ok_or(KvAccessError::WorkerNotAttached(0))?;
        let kv_dim = (self.shape.n_kv_head * self.shape.head_dim) as usize;
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let rows: Vec<f32> = (0..2 * SYNTHETIC_ROWS * kv_dim)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect();
        range.into_par_iter().try_for_each(|pos| {
            let (worker, block) = *blocks.get(pos / bs).ok_or(KvAccessError::NoBlock { position: pos })?;
            let pair = &rows[(pos % SYNTHETIC_ROWS) * 2 * kv_dim..][..2 * kv_dim];
            let (k, v) = pair.split_at(kv_dim);
            (0..self.shape.n_layer).try_for_each(|layer| self.write_token(worker, block, pos % bs, layer, k, v))
        })
    }

    /// Where slot `slot` of `block` on `worker` lies for a device that mapped the arena
    /// (see [`InPlaceRow`]); `None` where it did not, or the block does not exist.
    pub fn in_place(&self, worker: u32, block: BlockId, slot: usize) -> Option<InPlaceRow> {
        let w = self.worker(worker).ok()?;
        let addr = w.mapping.as_ref()?.addr;
        if block.0 >= w.layout.n_blocks || slot >= w.layout.block_size as usize {
            return None;
        }
        let (offset, stride) = w.layout.slot_runs(block, slot);
        Some(InPlaceRow { addr: addr + offset as u64, stride: stride as u64, q8: w.layout.dtype == KvDtype::Q8_0 })
    }

    /// The K/V rows of positions `range` of one KV head of `layer`, in place in the arenas:
    /// one run per block, in position order (`blocks[i]` holds positions `i * block_size..`).
    pub fn runs(&self, blocks: &[(u32, BlockId)], layer: u32, kv_head: u32, range: Range<usize>) -> Result<Vec<KvRun<'_>>, KvAccessError> {
        let bs = self.block_size().ok_or(KvAccessError::WorkerNotAttached(0))?;
        let hd = self.shape.head_dim as usize;
        let mut runs = Vec::with_capacity(range.len().div_ceil(bs) + 1);
        let mut pos = range.start;
        while pos < range.end {
            let (worker, block) = *blocks.get(pos / bs).ok_or(KvAccessError::NoBlock { position: pos })?;
            let w = self.worker(worker)?;
            let slot = pos % bs;
            let n = (bs - slot).min(range.end - pos);
            // SAFETY: inside the arena (blocks checked when the step was accepted); these
            // rows were written by this process in this or an earlier step, and no one
            // writes them while the step reads them.
            let row = w.layout.row_bytes().expect("a validated layout");
            let rows = |offset: usize| match w.layout.dtype {
                KvDtype::Q8_0 => KvRows::Q8_0(unsafe { w.arena.slice::<u8>(offset + slot * row, n * row) }),
                _ => KvRows::F16(unsafe { w.arena.slice::<f16>(offset + slot * row, n * hd) }),
            };
            runs.push(KvRun { k: rows(w.layout.k_offset(block, layer, kv_head)), v: rows(w.layout.v_offset(block, layer, kv_head)) });
            pos += n;
        }
        Ok(runs)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// An arena of `layout` and its ring, made here (removed when dropped).
    fn segments(tag: &str, layout: &ArenaLayout) -> (String, String, Segment, Ring) {
        let (arena_name, ring_name) = (format!("duet-arenas-{tag}-{}-arena", std::process::id()), format!("duet-arenas-{tag}-{}-ring", std::process::id()));
        let arena = Segment::create(&arena_name, layout.total_bytes().unwrap()).unwrap();
        let header = layout.encode_header().unwrap();
        // SAFETY: just created here; nothing else maps it yet.
        unsafe { arena.slice_mut::<u8>(0, header.len()) }.copy_from_slice(&header);
        let ring = Segment::create(&ring_name, Ring::bytes_needed(4, 4096).unwrap()).unwrap();
        let ring = Ring::create(ring, 4, 4096).unwrap();
        (arena_name, ring_name, arena, ring)
    }

    /// Records when a mapping ends.
    struct Ends(Arc<Mutex<Vec<&'static str>>>, &'static str);

    impl Drop for Ends {
        fn drop(&mut self) {
            self.0.lock().unwrap().push(self.1);
        }
    }

    /// A device that maps an arena where it lies in this process (its address, the host's):
    /// every row `write_token` writes is where `in_place` says, in each layer, K and V and
    /// KV head; and a worker attached again ends its old mapping before the new one is made.
    #[test]
    fn in_place_rows_are_where_the_host_writes_them() {
        for dtype in [KvDtype::F16, KvDtype::Q8_0] {
            let shape = KvShape { n_layer: 3, n_kv_head: 2, head_dim: 64 };
            let layout = ArenaLayout { n_layer: 3, n_kv_head: 2, head_dim: 64, block_size: 4, dtype, n_blocks: 5 };
            let (arena_name, ring_name, _arena, _ring) = segments(&format!("{dtype}"), &layout);
            let log = Arc::new(Mutex::new(Vec::new()));
            let mut arenas = KvArenas::new(shape, true);
            let first = log.clone();
            arenas.attach(0, &arena_name, &ring_name, None, |ptr, _| Some(HostMapping::new(ptr as u64, Ends(first, "first ended")))).unwrap();
            let row = layout.row_bytes().unwrap();
            let kv_dim = 2 * 64;
            for (b, slot, layer) in [(4u32, 3usize, 2u32), (0, 0, 0), (2, 1, 1)] {
                let k: Vec<f32> = (0..kv_dim).map(|i| (i as f32 * 0.37 + b as f32).sin()).collect();
                let v: Vec<f32> = k.iter().map(|x| -2.0 * x).collect();
                arenas.write_token(0, BlockId(b), slot, layer, &k, &v).unwrap();
                let p = arenas.in_place(0, BlockId(b), slot).expect("a mapped arena");
                assert_eq!(p.q8, dtype == KvDtype::Q8_0);
                for h in 0..2u64 {
                    for (is_v, offset) in [(0u64, layout.k_offset(BlockId(b), layer, h as u32)), (1, layout.v_offset(BlockId(b), layer, h as u32))] {
                        let at = p.addr + ((u64::from(layer) * 2 + is_v) * 2 + h) * p.stride;
                        let w = arenas.worker(0).unwrap();
                        // SAFETY (both): inside the arena, which this process maps, at the
                        // address the mapping gave; nothing writes it meanwhile.
                        let written = unsafe { w.arena.slice::<u8>(offset + slot * row, row) };
                        let found = unsafe { std::slice::from_raw_parts(at as *const u8, row) };
                        assert_eq!(found, written, "{dtype} block {b} slot {slot} layer {layer} head {h} {}", ["K", "V"][is_v as usize]);
                    }
                }
            }
            assert_eq!(arenas.in_place(0, BlockId(5), 0), None, "a block past the arena");
            assert_eq!(arenas.in_place(0, BlockId(0), 4), None, "a slot past the block");
            assert_eq!(arenas.in_place(1, BlockId(0), 0), None, "a worker not attached");
            let second = log.clone();
            let order = log.clone();
            arenas
                .attach(0, &arena_name, &ring_name, None, move |ptr, _| {
                    order.lock().unwrap().push("second made");
                    Some(HostMapping::new(ptr as u64, Ends(second, "second ended")))
                })
                .unwrap();
            arenas.detach(0);
            assert_eq!(*log.lock().unwrap(), ["first ended", "second made", "second ended"]);
            // Without a mapping, rows go through `write_token` only.
            arenas.attach(0, &arena_name, &ring_name, None, |_, _| None).unwrap();
            assert_eq!(arenas.in_place(0, BlockId(0), 0), None);
        }
    }
}
