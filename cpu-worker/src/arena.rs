//! The worker's KV arena: a named shared-memory segment laid out by [`ArenaLayout`], bound
//! to the worker's NUMA node, first-touched by its pinned threads, locked in RAM, and read
//! by the attention kernels.

use std::sync::atomic::Ordering;

use duet_kv::layout::{HEADER_BYTES, OFF_GENERATION, OFF_MODEL_ID};
use duet_kv::paged::ArenaRows;
use duet_kv::ArenaLayout;
use duet_kv::shm::owner::OwnerLock;
use duet_kv::shm::Segment;
use half::f16;
use rayon::prelude::*;

use crate::numa::{self, NodeInfo};
use crate::owner_lock::lock_owner;
use crate::CpuWorkerError;

/// A created KV arena; its segment is removed when this drops, and only then is its owner
/// lock released (fields drop in declaration order), so a `--replace` that finds the lock
/// free never races the removal.
#[derive(Debug)]
pub struct Arena {
    seg: Segment,
    layout: ArenaLayout,
    _owner: OwnerLock,
}

/// How arena setup went where the worker carries on regardless (reported in the ready log).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ArenaSetup {
    /// Bound to the requested NUMA node.
    pub numa_bound: bool,
    /// Locked in RAM (mlock).
    pub locked: bool,
}

impl Arena {
    /// Creates `/dev/shm/<name>` for `layout`, takes its owner lock (see `owner_lock`), binds it
    /// to `numa_node` when given and present (else warns), first-touches every page from
    /// `pool`'s (pinned) threads, writes the header and locks the segment (warning if the
    /// memlock limit refuses).
    pub fn create(
        name: &str,
        layout: ArenaLayout,
        model_id: u64,
        numa_node: Option<u32>,
        pool: &rayon::ThreadPool,
    ) -> Result<(Arena, ArenaSetup), CpuWorkerError> {
        let header = layout.encode_header()?;
        let len = layout.total_bytes()?;
        let seg = Segment::create(name, len)?;
        let owner = lock_owner(seg.path())?;
        let mut setup = ArenaSetup::default();
        if let Some(node) = numa_node {
            setup.numa_bound = bind(&seg, node);
        }
        first_touch(&seg, pool);
        // SAFETY: the segment was created (exclusively) just now and producers attach only
        // once the worker's exchange ring exists, which is created after this returns; no
        // other slice of the header range exists.
        unsafe { seg.slice_mut::<u8>(0, header.len()) }.copy_from_slice(&header);
        seg.atomic_u64(OFF_MODEL_ID).store(model_id, Ordering::Release);
        seg.atomic_u64(OFF_GENERATION).store(1, Ordering::Release);
        setup.locked = seg.lock().is_ok();
        Ok((Arena { seg, layout, _owner: owner }, setup))
    }

    /// Takes over the arena a dead worker of this name left at `/dev/shm/<name>`, K/V and
    /// all, when its header has `layout` and `model_id` (not 0): takes the owner lock (a live
    /// worker's is `SegmentInUse`), counts one more generation, binds and locks it as
    /// [`Arena::create`] does. `Ok(Err(why))` when the arena cannot be kept.
    pub fn reattach(
        name: &str,
        layout: ArenaLayout,
        model_id: u64,
        numa_node: Option<u32>,
    ) -> Result<Result<(Arena, ArenaSetup), String>, CpuWorkerError> {
        let mut seg = Segment::open(name)?;
        let owner = lock_owner(seg.path())?;
        let total = layout.total_bytes()?;
        if seg.len() != total {
            return Ok(Err(format!("it is {} bytes, this worker's layout {total}", seg.len())));
        }
        // SAFETY: the owner lock is ours, so no worker serves from the segment, and producers
        // attach only once this worker's ring exists (it is rebuilt after this returns).
        let found = match ArenaLayout::decode_header(unsafe { seg.slice::<u8>(0, HEADER_BYTES) }) {
            Ok(found) => found,
            Err(e) => return Ok(Err(format!("its header does not read: {e}"))),
        };
        if found != layout {
            return Ok(Err(format!("its layout is {found:?}, this worker's {layout:?}")));
        }
        let stored = seg.atomic_u64(OFF_MODEL_ID).load(Ordering::Acquire);
        if model_id == 0 || stored != model_id {
            return Ok(Err(format!("it holds the K/V of model {stored:#x}, this worker serves {model_id:#x}")));
        }
        let generation = seg.atomic_u64(OFF_GENERATION).fetch_add(1, Ordering::AcqRel) + 1;
        seg.take_over();
        let mut setup = ArenaSetup::default();
        if let Some(node) = numa_node {
            setup.numa_bound = bind(&seg, node);
        }
        setup.locked = seg.lock().is_ok();
        tracing::info!(arena = name, generation, "re-attached to the KV arena a previous worker left: its K/V is kept");
        Ok(Ok((Arena { seg, layout, _owner: owner }, setup)))
    }

    /// Workers that attached to this arena: 1 when this one created it.
    pub fn generation(&self) -> u64 {
        self.seg.atomic_u64(OFF_GENERATION).load(Ordering::Acquire)
    }

    /// The arena's layout.
    pub fn layout(&self) -> &ArenaLayout {
        &self.layout
    }

    /// The arena's segment.
    pub fn segment(&self) -> &Segment {
        &self.seg
    }

    /// Read access to K/V rows for the attention kernels.
    ///
    /// # Safety
    /// While the returned view (and any slice it gave out) lives, no process may write the
    /// rows it is asked for. The data-plane protocol provides this for the rows of a posted
    /// job: the gpu-worker writes a position's K/V before posting a job that reads it and
    /// does not rewrite the rows of a job's ranges until the job is complete.
    pub unsafe fn rows_of_posted_job(&self) -> ArenaView<'_> {
        ArenaView { seg: &self.seg }
    }
}

/// K/V rows of an arena during one job (see [`Arena::rows_of_posted_job`]).
pub struct ArenaView<'a> {
    seg: &'a Segment,
}

impl ArenaRows for ArenaView<'_> {
    fn f16s(&self, offset: usize, count: usize) -> &[f16] {
        // SAFETY: the creator of this view promised that the rows of the current job are
        // not written while it lives; `slice` checks bounds and alignment (and panics,
        // never reads out of bounds, if a caller skipped `PagedRange::fits`).
        unsafe { self.seg.slice::<f16>(offset, count) }
    }

    fn bytes(&self, offset: usize, len: usize) -> &[u8] {
        // SAFETY: as `f16s`.
        unsafe { self.seg.slice::<u8>(offset, len) }
    }
}

/// mbind to `node` if the machine has it; `false` (after a warning) otherwise.
fn bind(seg: &Segment, node: u32) -> bool {
    match numa::node_info(node) {
        NodeInfo::Present { .. } => match numa::bind_to_node(seg, node) {
            Ok(()) => {
                tracing::info!(node, segment = seg.name(), "KV arena bound to NUMA node (mbind MPOL_BIND)");
                true
            }
            Err(e) => {
                tracing::warn!(node, "binding the KV arena to NUMA node {node} failed ({e}); its pages come from wherever they are first touched");
                false
            }
        },
        NodeInfo::Absent { nodes } => {
            tracing::warn!(node, ?nodes, "this machine has no NUMA node {node}: the KV arena is not bound (pages come from wherever they are first touched)");
            false
        }
        NodeInfo::Unknown => {
            tracing::warn!(node, "no NUMA information on this machine (/sys/devices/system/node is missing): the KV arena is not bound to node {node}");
            false
        }
    }
}

/// Faults every page of `seg` in from the pool's threads (one write per page), so that
/// without a binding the pages come from the node the pinned threads run on.
fn first_touch(seg: &Segment, pool: &rayon::ThreadPool) {
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(64);
    let n_pages = seg.len().div_ceil(page);
    pool.install(|| {
        (0..n_pages).into_par_iter().with_min_len(64).for_each(|p| {
            // The segment is fresh (all zero), so storing zero changes nothing but faults
            // the page in; an atomic store needs no exclusivity promise.
            seg.atomic_u32(p * page).store(0, Ordering::Relaxed);
        });
    });
}
