//! The GPU's KV mirror (stage B): a pool of GPU pages within `--gpu-kv-bytes`, each holding
//! [`PAGE`] consecutive positions of one sequence for every layer the device holds (f16, see
//! `kernels/attention.cu`), and the device's attention on it. The arenas (or the runner's
//! cache) stay the truth: the mirror is a cache of them, keyed by the caller's sequence
//! identity ([`KvSource::seq_key`]). New K/V rows are written to both; a layer's positions
//! the mirror lacks (a sequence it evicted, or met after its prefill) are uploaded from the
//! host before the GPU attends them; room is made as `mirror_pages` says. A sequence that
//! does not fit even alone is attended on the host, as at stage A.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use duet_kernels::attention::{attn_scale, AttnShape};

use super::launch::Launcher;
use super::phases::{Phase, Phases};
pub use super::mirror_pages::PAGE;
use super::mirror_pages::Pages;
use super::CudaError;
use crate::device::{InPlaceRow, KvAccessError, KvSink, KvSource, KvUploadTime, Partial};
use crate::error::Result;

/// Threads per attention block, positions per tile and query heads per block (`ATT_*` in
/// attention.cu).
const ATT_THREADS: u32 = 128;
const ATT_TILE: usize = 128;
const ATT_HEADS: usize = 4;
/// The widest head the attention kernel takes.
pub const MAX_HEAD_DIM: usize = 256;
/// Query vectors, and their floats, one `attn_prefill` block takes (`PF_QUERIES`, `PF_ELEMS`).
const PF_QUERIES: usize = 32;
const PF_ELEMS: usize = 4096;

/// The most values a head may have for `attn_prefill_mma128` (`attn_prefill_mma64` takes up
/// to 64).
const PFM_MAX_HEAD_DIM: usize = 128;
/// Query vectors one `attn_prefill_mma*` block takes (`PFM_QUERIES`: 16 a warp).
const PFM_QUERIES: usize = 64;
/// Threads of an `attn_prefill_mma*` block (`PFM_WARPS` warps).
const PFM_THREADS: u32 = (PFM_QUERIES / 16 * 32) as u32;

/// Whether prefill tiles run on the tensor cores (`attn_prefill_mma*`, its queries and
/// probabilities rounded to f16): on sm_80 and later, for heads of a multiple of 16 values up
/// to [`PFM_MAX_HEAD_DIM`], unless `DUET_CUDA_PREFILL_MMA=0`; else `attn_prefill` in f32.
pub fn prefill_on_tensor_cores(arch: u32, head_dim: usize) -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let enabled = *ENABLED.get_or_init(|| std::env::var("DUET_CUDA_PREFILL_MMA").map_or(true, |v| v != "0"));
    enabled && arch >= 80 && head_dim.is_multiple_of(16) && head_dim <= PFM_MAX_HEAD_DIM
}

/// The kernel that attends a launch's prefill tiles, its threads a block, and the rows of a
/// sequence one tile takes (0: none fit, every row goes to `attn_partial`).
pub(super) struct PrefillKernel {
    pub entry: &'static str,
    pub threads: u32,
    pub rows_per_tile: usize,
}

pub(super) fn prefill_kernel(arch: u32, group: usize, head_dim: usize) -> PrefillKernel {
    if prefill_on_tensor_cores(arch, head_dim) {
        let entry = if head_dim <= 64 { "attn_prefill_mma64" } else { "attn_prefill_mma128" };
        PrefillKernel { entry, threads: PFM_THREADS, rows_per_tile: PFM_QUERIES / group }
    } else {
        PrefillKernel { entry: "attn_prefill", threads: ATT_THREADS, rows_per_tile: prefill_rows_per_tile(group, head_dim) }
    }
}

/// Rows of a sequence one `attn_prefill` block attends: as many as its query vectors (rows ×
/// the `group` query heads of a KV head) and their floats allow; 0 where not even one fits.
fn prefill_rows_per_tile(group: usize, head_dim: usize) -> usize {
    (PF_QUERIES / group).min(PF_ELEMS / (group * head_dim))
}

/// How the placed items of a launch are attended: runs of consecutive items of one sequence
/// on consecutive rows (a prefill chunk's rows) in tiles of at most `per_tile` rows for
/// `attn_prefill` — per tile its first item, its items and the sequence's `table` (`keys[i]`:
/// item `i`'s sequence, table offset and row of Q) — and the rest one by one
/// (`attn_partial`), by index: decode rows, and shares of one row's context.
pub(super) fn prefill_tiles(keys: &[(u64, i32, i32)], per_tile: usize) -> (Vec<i32>, Vec<usize>) {
    let (mut tiles, mut singles) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < keys.len() {
        let run = keys[i..].iter().enumerate().take_while(|(j, k)| k.0 == keys[i].0 && k.2 == keys[i].2 + *j as i32).count();
        if run < 2 || per_tile == 0 {
            singles.extend(i..i + run);
        } else {
            for t in (i..i + run).step_by(per_tile) {
                tiles.extend([t as i32, per_tile.min(i + run - t) as i32, keys[i].1]);
            }
        }
        i += run;
    }
    (tiles, singles)
}

/// Launched attention: the outputs and log-sum-exps of the placed items (by index), in
/// their order, on the GPU.
struct Attended {
    out: CudaSlice<f32>,
    lse: CudaSlice<f32>,
    placed: Vec<usize>,
    /// Events just before the first attention kernel and just after the last, when asked.
    timed: Option<Timed>,
}

/// Events around a launch's kernels: its time on the GPU.
pub type Timed = (CudaEvent, CudaEvent);

/// An event recorded on `stream` now (one end of a [`Timed`]).
fn event(stream: &Arc<CudaStream>) -> Result<CudaEvent, CudaError> {
    stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(CudaError::from)
}

/// The GPU time of `timed` together, in nanoseconds; each is waited for.
pub fn elapsed_ns(timed: &[Timed]) -> Result<u64, CudaError> {
    let mut ms = 0f64;
    for (start, end) in timed {
        ms += f64::from(start.elapsed_ms(end)?);
    }
    Ok((ms * 1e6) as u64)
}

/// One row's attention on the GPU: the row of `q`, the positions attended and the sequence.
#[derive(Debug, Clone)]
pub struct MirrorItem {
    pub row: usize,
    pub range: Range<usize>,
    /// The caller's index of the sequence (for [`KvSource::runs`]) and its identity.
    pub seq: usize,
    pub key: u64,
}

/// The mirror: its pool on the GPU and which sequence holds which page.
pub struct KvMirror {
    pool: CudaSlice<u16>,
    page_elems: usize,
    shape: AttnShape,
    pages: Pages,
    /// Blocks the attention launch aims for (a few per multiprocessor).
    target_blocks: usize,
    /// The launches' small tables, kept on the GPU from one layer to the next.
    tables: Tables,
    /// Rows (a position of one layer each) brought in since [`Self::take_uploaded`], read by
    /// the GPU from the arenas or uploaded by the host: what the mirror lacked when asked to
    /// attend.
    uploaded: u64,
    /// The time of bringing those rows in since [`Self::take_upload_time`], in calls of
    /// [`Self::attend`] (index 1: the caller times them on the host) and in the others (0).
    upload_times: [UploadTimes; 2],
    /// Whether an [`Self::attend`] call is running.
    in_attend: bool,
    /// Rows the GPU is to read from the arenas, gathered over a call's sequences so that
    /// the call makes one launch for them all ([`KvMirror::flush_reads`]).
    reads: ArenaReads,
}

/// The time of bringing rows in: events around each read from the arenas, and the host's
/// wall time uploading the rest (arenas the GPU does not map; in a layer wholly on the GPU
/// that time may overlap the GPU's work).
#[derive(Default)]
struct UploadTimes {
    events: Vec<Timed>,
    host_ns: u64,
}

impl UploadTimes {
    fn take_ns(&mut self) -> Result<u64, CudaError> {
        Ok(elapsed_ns(&std::mem::take(&mut self.events))? + std::mem::take(&mut self.host_ns))
    }
}

/// Rows of one layer for `arena_to_mirror`: where each lies in an arena the GPU maps, and
/// its slot in the pool; all from arenas of one kind (`q8`).
#[derive(Default)]
struct ArenaReads {
    rows: Vec<u64>,
    strides: Vec<u64>,
    slots: Vec<i32>,
    layer: usize,
    q8: bool,
    /// Each sequence queued and the first position queued for it (its `filled` before).
    seqs: Vec<(u64, usize)>,
}

/// A small host table's copy on the GPU, uploaded again only when it changes: a step's
/// slots, page tables and items are the same in each of its layers (but a sliding-window
/// layer's ranges), so a step uploads them once instead of once a layer.
#[derive(Default)]
struct Table(Option<(Vec<i32>, CudaSlice<i32>)>);

impl Table {
    fn get(&mut self, stream: &Arc<CudaStream>, host: Vec<i32>) -> Result<&CudaSlice<i32>, CudaError> {
        if self.0.as_ref().is_none_or(|(h, _)| *h != host) {
            let dev = stream.clone_htod(&host)?;
            self.0 = Some((host, dev));
        }
        Ok(&self.0.as_ref().expect("just set").1)
    }
}

/// The tables of [`KvMirror::store`] and [`KvMirror::launch`].
#[derive(Default)]
struct Tables {
    slots: Table,
    pages: Table,
    meta: Table,
    tiles: Table,
    singles: Table,
    dest: Table,
}

impl KvMirror {
    /// Bytes of one page for `layers` layers of `shape`'s KV heads.
    pub fn page_bytes(layers: usize, shape: &AttnShape) -> usize {
        layers * 2 * shape.n_kv_head * shape.head_dim * PAGE * 2
    }

    /// Whether the attention kernel takes heads of `shape` (even widths up to [`MAX_HEAD_DIM`]).
    pub fn supports(shape: &AttnShape) -> bool {
        shape.head_dim.is_multiple_of(2) && shape.head_dim <= MAX_HEAD_DIM && shape.n_head.is_multiple_of(shape.n_kv_head)
    }

    /// A mirror of `bytes` (whole pages) on `stream`'s GPU for `layers` layers.
    pub fn new(stream: &Arc<CudaStream>, bytes: usize, layers: usize, shape: AttnShape, sm_count: usize) -> Result<Self, CudaError> {
        let page_bytes = Self::page_bytes(layers, &shape);
        let n_pages = (bytes / page_bytes).min(i32::MAX as usize);
        let page_elems = page_bytes / 2;
        // SAFETY: a page is read only for the positions written into it (`filled`).
        let pool = unsafe { stream.alloc::<u16>((n_pages * page_elems).max(1)) }?;
        Ok(KvMirror {
            pool,
            page_elems,
            shape,
            pages: Pages::new(n_pages, layers),
            target_blocks: 4 * sm_count.max(1),
            tables: Tables::default(),
            uploaded: 0,
            upload_times: Default::default(),
            in_attend: false,
            reads: ArenaReads::default(),
        })
    }

    /// Rows uploaded from the host since the last call.
    pub fn take_uploaded(&mut self) -> u64 {
        std::mem::take(&mut self.uploaded)
    }

    /// The time spent bringing rows in (reading them from the arenas on the GPU, uploading
    /// them from the host) since the last call or [`Self::forget_upload_times`]; called when
    /// the GPU has done the work (after a step's last download).
    pub fn take_upload_time(&mut self) -> Result<KvUploadTime, CudaError> {
        let in_attention_calls_ns = self.upload_times[1].take_ns()?;
        Ok(KvUploadTime { total_ns: self.upload_times[0].take_ns()? + in_attention_calls_ns, in_attention_calls_ns })
    }

    /// Drops the upload times not taken (a batch nobody took them of).
    pub fn forget_upload_times(&mut self) {
        self.upload_times = Default::default();
        // Set only around `launch`; a panic there must not leave later uploads in its bucket.
        self.in_attend = false;
    }

    /// Positions the mirror holds, all sequences together.
    pub fn capacity(&self) -> usize {
        self.pages.capacity()
    }

    /// Writes rows of K and V (`[row][kv_dim]`, f32 on the GPU) into `slots`, one per row.
    fn store_rows(&mut self, k: &Launcher, layer: usize, rows: (&CudaSlice<f32>, &CudaSlice<f32>), slots: Vec<i32>) -> Result<(), CudaError> {
        let stream = &k.stream;
        let AttnShape { n_kv_head, head_dim, .. } = self.shape;
        let kv_dim = n_kv_head * head_dim;
        let n = slots.len();
        let (kd, vd, sd) = (rows.0, rows.1, self.tables.slots.get(stream, slots)?);
        let (n_i, kv_i, hd_i, page_elems, layer_i, page_i) = (n as i32, kv_dim as i32, head_dim as i32, self.page_elems as i64, layer as i32, PAGE as i32);
        let mut b = stream.launch_builder(k.kernels().get("kv_store")?);
        b.arg(kd).arg(vd).arg(sd).arg(&n_i).arg(&kv_i).arg(&hd_i).arg(&mut self.pool).arg(&page_elems).arg(&layer_i).arg(&page_i);
        // SAFETY: k and v hold n rows of kv_dim; every slot is a page of the pool (or -1).
        unsafe { b.launch(LaunchConfig::for_num_elems((n * kv_dim) as u32)) }?;
        Ok(())
    }

    /// Stores a batch's new K/V rows of `layer` (`k`, `v`: `[row][kv_dim]` on the GPU) for the
    /// rows `kv` can name; a row that would leave a gap in its sequence's mirrored prefix is
    /// left to the upload before attention.
    pub fn store(&mut self, kern: &Launcher, layer: usize, k: &CudaSlice<f32>, v: &CudaSlice<f32>, kv: &dyn KvSink) -> Result<(), CudaError> {
        self.pages.tick();
        let kv_dim = self.shape.n_kv_head * self.shape.head_dim;
        let slots: Vec<i32> = (0..k.len() / kv_dim)
            .map(|row| kv.position_of(row).and_then(|(key, pos)| self.pages.write_slot(key, layer, pos)).unwrap_or(-1))
            .collect();
        if slots.iter().any(|&s| s >= 0) {
            self.store_rows(kern, layer, (k, v), slots)?;
        }
        Ok(())
    }

    /// Makes positions `0..end` of `item`'s sequence of `layer` present, uploading what is
    /// missing from `kv`; false when the sequence cannot fit.
    fn ensure(&mut self, kern: &Launcher, layer: usize, key: u64, seq: usize, end: usize, kv: &dyn KvSource) -> Result<bool> {
        if !self.pages.reserve(key, end) {
            return Ok(false);
        }
        let from = self.pages.filled(key, layer);
        if from >= end {
            return Ok(true);
        }
        if !self.read_in_place(kern, layer, key, seq, from..end, kv)? {
            self.upload(kern, layer, key, seq, from..end, kv)?;
        }
        self.pages.set_filled(key, layer, end);
        self.uploaded += (end - from) as u64;
        Ok(true)
    }

    /// Positions `range` (reserved) of `layer` to be read by the GPU from the arenas it maps,
    /// where `kv` has them all there (one kind of arena): queued for [`Self::flush_reads`],
    /// which the call makes before its kernels; false where they are not all there.
    fn read_in_place(&mut self, kern: &Launcher, layer: usize, key: u64, seq: usize, range: Range<usize>, kv: &dyn KvSource) -> Result<bool> {
        let Some(places) = range.clone().map(|pos| kv.in_place_at(seq, pos)).collect::<Option<Vec<InPlaceRow>>>() else { return Ok(false) };
        let q8 = places[0].q8;
        if places.iter().any(|p| p.q8 != q8) {
            return Ok(false);
        }
        if self.reads.q8 != q8 || self.reads.layer != layer {
            self.flush_reads(kern)?;
            (self.reads.q8, self.reads.layer) = (q8, layer);
        }
        let reads = &mut self.reads;
        reads.seqs.push((key, range.start));
        reads.rows.extend(places.iter().map(|p| p.addr));
        reads.strides.extend(places.iter().map(|p| p.stride));
        reads.slots.extend(range.map(|pos| self.pages.slot(key, pos)));
        Ok(true)
    }

    /// The queued reads from the arenas, in one launch (their pages are the call's own until
    /// it ends: a call never takes room from what it used). A call that fails drops them
    /// instead ([`Self::calling`]).
    fn flush_reads(&mut self, kern: &Launcher) -> Result<()> {
        if self.reads.rows.is_empty() {
            return Ok(());
        }
        let ArenaReads { rows, strides, slots, layer, q8, .. } = std::mem::take(&mut self.reads);
        let stream = &kern.stream;
        let start = event(stream)?;
        let (rows, strides, slots) = (
            stream.clone_htod(&rows).map_err(CudaError::from)?,
            stream.clone_htod(&strides).map_err(CudaError::from)?,
            stream.clone_htod(&slots).map_err(CudaError::from)?,
        );
        let AttnShape { n_kv_head, head_dim, .. } = self.shape;
        kern.arena_to_mirror(&rows, &strides, &slots, (n_kv_head, head_dim, layer, q8), &mut self.pool, self.page_elems, PAGE)?;
        self.upload_times[usize::from(self.in_attend)].events.push((start, event(stream)?));
        Ok(())
    }

    /// Positions `range` (reserved) of `layer` gathered and widened on the host from `kv`'s
    /// runs, uploaded and stored.
    fn upload(&mut self, kern: &Launcher, layer: usize, key: u64, seq: usize, range: Range<usize>, kv: &dyn KvSource) -> Result<()> {
        // Outside an attention call (a whole layer on the GPU filling a prefix) the stream may
        // still run the step's queued layers, and the pageable copies below wait for them
        // first: drained before the clock starts, so that the wait is not timed as the upload
        // (whose time comes out of the step's linear layers).
        if !self.in_attend {
            kern.stream.synchronize().map_err(CudaError::from)?;
        }
        let t = Instant::now();
        let (from, end) = (range.start, range.end);
        let AttnShape { n_kv_head, head_dim, .. } = self.shape;
        let kv_dim = n_kv_head * head_dim;
        let n = end - from;
        let (mut k, mut v) = (vec![0f32; n * kv_dim], vec![0f32; n * kv_dim]);
        let mut widened = Vec::new();
        for h in 0..n_kv_head {
            let mut p = 0;
            for run in kv.runs(seq, layer, h, from..end)? {
                let rows = run.k.len() / head_dim;
                for (src, dst) in [(run.k, &mut k), (run.v, &mut v)] {
                    widened.resize(src.len(), 0.0);
                    src.widen_into(&mut widened);
                    for (r, x) in widened.chunks_exact(head_dim).enumerate() {
                        dst[(p + r) * kv_dim + h * head_dim..][..head_dim].copy_from_slice(x);
                    }
                }
                p += rows;
            }
            if p != n {
                return Err(KvAccessError::NoBlock { position: from + p }.into());
            }
        }
        let slots: Vec<i32> = (from..end).map(|pos| self.pages.slot(key, pos)).collect();
        let (k, v) = (kern.stream.clone_htod(&k).map_err(CudaError::from)?, kern.stream.clone_htod(&v).map_err(CudaError::from)?);
        self.store_rows(kern, layer, (&k, &v), slots)?;
        self.upload_times[usize::from(self.in_attend)].host_ns += t.elapsed().as_nanos() as u64;
        Ok(())
    }

    /// Attention of `items` on layer `layer` (`q`: the batch's rows on the GPU) over the
    /// mirror: per item its output (`[n_head][head_dim]`) and per-head log-sum-exp, or
    /// `None` for an item whose sequence does not fit (the caller attends it on the host).
    pub fn attend(&mut self, kern: &Launcher, layer: usize, q: &CudaSlice<f32>, items: &[MirrorItem], kv: &dyn KvSource, phases: &Phases) -> Result<Vec<Option<Partial>>> {
        let t = Instant::now();
        let q_dim = self.shape.n_head * self.shape.head_dim;
        let n_head = self.shape.n_head;
        let mut results = vec![None; items.len()];
        self.in_attend = true;
        let launched = self.launch(kern, layer, q, items, kv, false);
        self.in_attend = false;
        let Some(Attended { out, lse, placed, .. }) = launched? else { return Ok(results) };
        let stream = &kern.stream;
        let t = phases.add(Phase::AttendPrepare, t);
        let out = stream.clone_dtoh(&out).map_err(CudaError::from)?;
        let lse = stream.clone_dtoh(&lse).map_err(CudaError::from)?;
        stream.synchronize().map_err(CudaError::from)?;
        phases.add(Phase::AttendWait, t);
        for (j, &i) in placed.iter().enumerate() {
            results[i] = Some((out[j * q_dim..(j + 1) * q_dim].to_vec(), lse[j * n_head..(j + 1) * n_head].to_vec()));
        }
        Ok(results)
    }

    /// Attention of `items` on layer `layer`, left on the GPU: the output rows
    /// (`[row][n_head][head_dim]`) when every item is placed and item `j` is batch row `j`
    /// (a layer wholly on the device), with events around its kernels (for the balancer:
    /// the host cannot time them), else `None` (the caller attends them another way).
    pub fn attend_rows(
        &mut self,
        kern: &Launcher,
        layer: usize,
        q: &CudaSlice<f32>,
        items: &[MirrorItem],
        kv: &dyn KvSource,
    ) -> Result<Option<(CudaSlice<f32>, Timed)>> {
        if items.iter().enumerate().any(|(j, it)| it.row != j) {
            return Ok(None);
        }
        Ok(match self.launch(kern, layer, q, items, kv, true)? {
            Some(Attended { out, placed, timed: Some(timed), .. }) if placed.len() == items.len() => Some((out, timed)),
            _ => None,
        })
    }

    /// A step begins (`Pages::begin_step`).
    pub fn begin_step(&mut self, step: &[(u64, usize)]) {
        self.pages.begin_step(step);
    }

    /// Sequences gone: their pages are free.
    pub fn release(&mut self, keys: &[u64]) {
        self.pages.release(keys);
    }

    /// Room for the sequences of `items`, positions `0..end` each, before anything of a
    /// layer is computed, none taking room from another; false when the mirror cannot hold
    /// them all.
    pub fn reserve_all(&mut self, items: &[(u64, usize)]) -> bool {
        self.pages.reserve_all(items)
    }

    /// Positions `0..start` of `layer` of each `(key, seq, start)` (reserved) mirrored,
    /// uploaded from `kv` where the mirror lacks them (a sequence it trimmed or evicted):
    /// rows from earlier steps, which `kv` holds. The whole-layer path calls it before
    /// storing a step's new rows, whose K/V reach `kv` only after the step's last layer, so
    /// that they extend a whole prefix and nothing uploads them from `kv` before they are
    /// there. False when a sequence does not fit after all.
    pub fn fill_prefixes(&mut self, kern: &Launcher, layer: usize, prefixes: &[(u64, usize, usize)], kv: &dyn KvSource) -> Result<bool> {
        self.pages.tick();
        self.calling(|m| {
            let mut all = true;
            for &(key, seq, start) in prefixes {
                if start > 0 && !m.ensure(kern, layer, key, seq, start, kv)? {
                    all = false;
                    break;
                }
            }
            m.flush_reads(kern)?;
            Ok(all)
        })
    }

    /// Runs a call's body; if it fails, the reads it queued are dropped, and so are any a
    /// call left queued by panicking (nothing may write into pages whose owners may have
    /// changed since).
    fn calling<T>(&mut self, body: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        self.drop_reads();
        let r = body(self);
        if r.is_err() {
            self.drop_reads();
        }
        r
    }

    /// Forgets the queued reads: their sequences' layer is mirrored only up to where they
    /// began.
    fn drop_reads(&mut self) {
        let reads = std::mem::take(&mut self.reads);
        for (key, from) in reads.seqs {
            let filled = self.pages.filled(key, reads.layer);
            self.pages.set_filled(key, reads.layer, filled.min(from));
        }
    }

    /// Uploads what the mirror lacks and launches the attention of the items whose sequences
    /// fit; `None` when none does.
    fn launch(&mut self, kern: &Launcher, layer: usize, q: &CudaSlice<f32>, items: &[MirrorItem], kv: &dyn KvSource, timed: bool) -> Result<Option<Attended>> {
        self.pages.tick();
        self.calling(|m| m.launch_call(kern, layer, q, items, kv, timed))
    }

    /// [`Self::launch`]'s body.
    fn launch_call(&mut self, kern: &Launcher, layer: usize, q: &CudaSlice<f32>, items: &[MirrorItem], kv: &dyn KvSource, timed: bool) -> Result<Option<Attended>> {
        let stream = &kern.stream;
        let AttnShape { n_head, n_kv_head, head_dim, softcap } = self.shape;
        let q_dim = n_head * head_dim;
        // Each sequence's table once; the items of a sequence (a prefill's rows) share it.
        let mut ends: HashMap<u64, usize> = HashMap::new();
        for it in items {
            let e = ends.entry(it.key).or_default();
            *e = (*e).max(it.range.end);
        }
        // Per sequence: the offset of its table in `pages`, or `None` if it does not fit.
        let mut tables: HashMap<u64, Option<i32>> = HashMap::new();
        let (mut pages, mut meta, mut placed) = (Vec::new(), Vec::new(), Vec::new());
        for (i, it) in items.iter().enumerate() {
            let table = match tables.get(&it.key) {
                Some(&t) => t,
                None => {
                    let t = match self.ensure(kern, layer, it.key, it.seq, ends[&it.key], kv)? {
                        true => {
                            self.pages.attended(it.key, ends[&it.key]);
                            let at = pages.len() as i32;
                            pages.extend_from_slice(self.pages.table(it.key));
                            Some(at)
                        }
                        false => None,
                    };
                    tables.insert(it.key, t);
                    t
                }
            };
            let Some(table) = table else { continue };
            meta.extend([it.row as i32, it.range.start as i32, it.range.end as i32, table]);
            placed.push(i);
        }
        self.flush_reads(kern)?;
        if placed.is_empty() {
            return Ok(None);
        }
        let n = placed.len();
        let group = n_head / n_kv_head;
        let keys: Vec<(u64, i32, i32)> = placed.iter().zip(meta.chunks_exact(4)).map(|(&i, m)| (items[i].key, m[3], m[0])).collect();
        let prefill = prefill_kernel(kern.kernels().arch, group, head_dim);
        let (tiles, singles) = prefill_tiles(&keys, prefill.rows_per_tile);
        // SAFETY: the tiles' rows and attn_merge (for the rest) write every output and lse.
        let (mut out, mut lse) = unsafe { (stream.alloc::<f32>(n * q_dim).map_err(CudaError::from)?, stream.alloc::<f32>(n * n_head).map_err(CudaError::from)?) };
        let (page_elems, layer_i, nkv, hd, grp, page_i) = (self.page_elems as i64, layer as i32, n_kv_head as i32, head_dim as i32, group as i32, PAGE as i32);
        let (scale, cap) = (attn_scale(head_dim), softcap.unwrap_or(0.0));
        let tables = &mut self.tables;
        let pd = tables.pages.get(stream, pages)?;
        // The tables above are uploaded (host to device) before the first kernel, so the
        // events time the kernels only.
        let start = if timed { Some(event(stream)?) } else { None };
        if !tiles.is_empty() {
            let n_tiles = tiles.len() / 3;
            let (md, td) = (tables.meta.get(stream, meta.clone())?, tables.tiles.get(stream, tiles)?);
            let mut b = stream.launch_builder(kern.kernels().get(prefill.entry)?);
            b.arg(q).arg(&self.pool).arg(&page_elems).arg(&layer_i).arg(pd).arg(md).arg(td).arg(&nkv).arg(&hd).arg(&grp).arg(&page_i).arg(&scale).arg(&cap);
            b.arg(&mut out).arg(&mut lse);
            let cfg = LaunchConfig { grid_dim: (n_tiles as u32, n_kv_head as u32, 1), block_dim: (prefill.threads, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: every tile's rows are items of one sequence whose positions up to the
            // largest end are mirrored in the pages of its table; out and lse hold n items.
            unsafe { b.launch(cfg) }.map_err(CudaError::from)?;
        }
        if !singles.is_empty() {
            let m = singles.len();
            let meta_s: Vec<i32> = singles.iter().flat_map(|&j| meta[4 * j..4 * j + 4].iter().copied()).collect();
            let dest: Vec<i32> = singles.iter().map(|&j| j as i32).collect();
            let hgroups = group.div_ceil(ATT_HEADS);
            let base = m * n_kv_head * hgroups;
            let longest = singles.iter().map(|&j| items[placed[j]].range.len()).max().unwrap_or(0);
            let n_split = self.target_blocks.div_ceil(base).clamp(1, longest.div_ceil(ATT_TILE).max(1));
            let (md, dd) = (tables.singles.get(stream, meta_s)?, tables.dest.get(stream, dest)?);
            let parts = m * n_head * n_split;
            // SAFETY: attn_partial writes every partial.
            let (mut pm, mut pl, mut po) = unsafe {
                (
                    stream.alloc::<f32>(parts).map_err(CudaError::from)?,
                    stream.alloc::<f32>(parts).map_err(CudaError::from)?,
                    stream.alloc::<f32>(parts * head_dim).map_err(CudaError::from)?,
                )
            };
            let ns = n_split as i32;
            let mut b = stream.launch_builder(kern.kernels().get("attn_partial")?);
            b.arg(q).arg(&self.pool).arg(&page_elems).arg(&layer_i).arg(pd).arg(md).arg(&nkv).arg(&hd).arg(&grp).arg(&page_i).arg(&ns).arg(&scale).arg(&cap);
            b.arg(&mut pm).arg(&mut pl).arg(&mut po);
            let cfg = LaunchConfig { grid_dim: (m as u32, (n_kv_head * hgroups) as u32, n_split as u32), block_dim: (ATT_THREADS, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: q holds the rows the items name; every item's positions are mirrored in
            // pages its table lists; the partials hold m * n_head * n_split entries.
            unsafe { b.launch(cfg) }.map_err(CudaError::from)?;
            let nh = n_head as i32;
            let mut b = stream.launch_builder(kern.kernels().get("attn_merge")?);
            b.arg(&pm).arg(&pl).arg(&po).arg(&ns).arg(&hd).arg(&nh).arg(dd).arg(&mut out).arg(&mut lse);
            let cfg = LaunchConfig { grid_dim: ((m * n_head) as u32, 1, 1), block_dim: (head_dim.min(128) as u32, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: as above; dest names slots below n, out holds n * q_dim, lse n * n_head.
            unsafe { b.launch(cfg) }.map_err(CudaError::from)?;
        }
        let timed = match start {
            Some(start) => Some((start, event(stream)?)),
            None => None,
        };
        Ok(Some(Attended { out, lse, placed, timed }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_rows_go_in_tiles_and_lone_rows_one_by_one() {
        // Sequence 1: a lone decode row; 2: five prefill rows; 3: one row; 4: two rows; 5:
        // two shares of one decode row.
        let keys = [(1, 0, 0), (2, 4, 1), (2, 4, 2), (2, 4, 3), (2, 4, 4), (2, 4, 5), (3, 9, 6), (4, 11, 7), (4, 11, 8), (5, 13, 9), (5, 13, 9)];
        let (tiles, singles) = prefill_tiles(&keys, 2);
        assert_eq!(tiles, vec![1, 2, 4, 3, 2, 4, 5, 1, 4, 7, 2, 11]);
        assert_eq!(singles, vec![0, 6, 9, 10]);
        // Heads too many for a tile: every item alone.
        let (tiles, singles) = prefill_tiles(&keys, 0);
        assert!(tiles.is_empty());
        assert_eq!(singles, (0..keys.len()).collect::<Vec<_>>());
    }

    #[test]
    fn a_tile_holds_what_the_prefill_kernels_shared_memory_does() {
        // Llama-3.2-1B: 4 query heads per KV head of 64; Llama-3.1-8B: 4 of 128; 256-wide heads.
        assert_eq!(prefill_rows_per_tile(4, 64), 8);
        assert_eq!(prefill_rows_per_tile(4, 128), 8);
        assert_eq!(prefill_rows_per_tile(1, 128), 32);
        assert_eq!(prefill_rows_per_tile(2, 256), 8);
        assert_eq!(prefill_rows_per_tile(64, 64), 0);
        for (g, hd) in [(1, 32), (3, 64), (8, 128), (2, 256)] {
            let r = prefill_rows_per_tile(g, hd);
            assert!(r * g <= PF_QUERIES && r * g * hd <= PF_ELEMS && r >= 1);
        }
    }

    #[test]
    fn prefill_tiles_go_to_the_tensor_cores_where_their_heads_fit() {
        let pick = |arch, g, hd| {
            let k = prefill_kernel(arch, g, hd);
            (k.entry, k.threads, k.rows_per_tile)
        };
        // Llama-3.2-1B and 3.1-8B on a Hopper GPU: 16 rows of 4 query heads a tile.
        assert_eq!(pick(90, 4, 64), ("attn_prefill_mma64", PFM_THREADS, 16));
        assert_eq!(pick(90, 4, 128), ("attn_prefill_mma128", PFM_THREADS, 16));
        // Phi-2's 80 values take the 128-wide body; one query head per KV head, 64 rows.
        assert_eq!(pick(90, 1, 80), ("attn_prefill_mma128", PFM_THREADS, 64));
        // More query heads per KV head than a block's query vectors: no tile.
        assert_eq!(pick(90, 128, 64).2, 0);
        // 256-wide heads, and GPUs before sm_80 (a T4), take attn_prefill in f32.
        assert_eq!(pick(90, 2, 256), ("attn_prefill", ATT_THREADS, 8));
        assert_eq!(pick(75, 4, 64), ("attn_prefill", ATT_THREADS, 8));
    }
}
