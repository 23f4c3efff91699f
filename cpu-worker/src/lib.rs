//! duet-cpu-worker: one per NUMA node. Holds a KV arena in node-bound, locked shared memory
//! (`/dev/shm/duet-<instance>-kv-<worker>`) and serves the decode-attention jobs the
//! gpu-worker posts into its exchange ring (`/dev/shm/duet-<instance>-xchg-<worker>`), on
//! threads pinned to its CPUs.
//!
//! [`run`] sets everything up, serves until shutdown and removes its segments. The exchange
//! ring is created last: once it exists (and attaches), the arena is ready for producers.
//! With `--listen`, the gRPC control plane (`control`) starts serving right after that, so
//! a successful Info or health check also means ready.

pub mod arena;
pub mod cli;
pub mod control;
pub mod experts;
pub mod numa;
pub mod serve;
pub mod owner_lock;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use duet_kv::{ArenaLayout, KvDtype, KvError, KvShape};
use duet_model::config::LlamaConfig;
use duet_model::gguf::GgufFile;
use duet_proto::pb::CpuInfoResponse;
use duet_proto::Address;
use duet_kv::shm::job::HEADER_BYTES as JOB_HEADER_BYTES;
use duet_kv::shm::{Ring, Segment, ShmError};

pub use serve::{JobCounters, ServeStats};

/// Everything that can stop a cpu-worker, named by the step that failed.
#[derive(Debug, thiserror::Error)]
pub enum CpuWorkerError {
    #[error("configuration: {0}")]
    Config(String),
    #[error("reading the model shape from {path}: {source}")]
    Model { path: PathBuf, source: duet_model::Error },
    #[error("KV arena layout: {0}")]
    Kv(#[from] KvError),
    #[error("shared memory: {0}")]
    Shm(#[from] ShmError),
    #[error("starting the worker threads: {0}")]
    ThreadPool(String),
    #[error("shared-memory segment {path} already exists and no running cpu-worker holds it: a previous worker of this --instance and --worker died without removing it; start with --replace to remove it")]
    StaleSegment { path: PathBuf },
    #[error("shared-memory segment {path} belongs to a running cpu-worker (it holds the arena's lock): stop that worker first, or give this one another --instance or --worker")]
    SegmentInUse { path: PathBuf },
    #[error("locking the arena segment {path}: {source}")]
    OwnerLock { path: PathBuf, source: std::io::Error },
    #[error("control plane: binding {address}: {source}")]
    Listen { address: Address, source: std::io::Error },
    #[error("control plane: starting its runtime or thread: {0}")]
    Runtime(std::io::Error),
    #[error("control plane: serving: {0}")]
    Serve(tonic::transport::Error),
    #[error("control plane: its thread panicked")]
    ControlPanic,
}

/// The names of a worker's segments, defined beside their owner lock.
pub use duet_kv::shm::owner::{arena_name, ring_name};

/// A model file's configuration (its GGUF metadata).
pub fn model_config(path: &Path) -> Result<LlamaConfig, CpuWorkerError> {
    let model_err = |source| CpuWorkerError::Model { path: path.to_path_buf(), source };
    let gguf = GgufFile::open(path).map_err(|e| model_err(e.into()))?;
    LlamaConfig::from_gguf(&gguf).map_err(model_err)
}

/// A model file's identity for the arena header: FNV-1a over its length and its first MiB
/// (the GGUF header, metadata and tensor table), so a restarted worker re-attaches only to an
/// arena filled by the same model.
pub fn model_identity(path: &Path) -> Result<u64, CpuWorkerError> {
    use std::io::Read;
    let io_err = |e: std::io::Error| CpuWorkerError::Model {
        path: path.to_path_buf(),
        source: duet_model::Error::Io { path: path.display().to_string(), source: e },
    };
    let mut file = std::fs::File::open(path).map_err(io_err)?;
    let len = file.metadata().map_err(io_err)?.len();
    let mut head = Vec::with_capacity(1 << 20);
    file.by_ref().take(1 << 20).read_to_end(&mut head).map_err(io_err)?;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in len.to_le_bytes().iter().chain(&head) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    Ok(h.max(1))
}

/// How large the arena is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvSize {
    /// Exactly this many blocks.
    Blocks(u32),
    /// As many blocks as fit in this many bytes, header included.
    Bytes(usize),
}

/// A cpu-worker's configuration (see `cli` for the flags that fill it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Instance name in the segment names.
    pub instance: String,
    /// This worker's index in the segment names.
    pub worker: u32,
    pub shape: KvShape,
    /// Tokens per KV block.
    pub block_size: u32,
    /// The arena's element type (f16 or q8_0).
    pub kv_type: KvDtype,
    pub kv_size: KvSize,
    /// CPUs to pin the worker's threads to (one each, round robin).
    pub cpus: Option<Vec<usize>>,
    /// NUMA node to bind the arena to (and, without `cpus`, to take the CPUs of).
    pub numa_node: Option<u32>,
    /// Worker threads (default: one per CPU pinned to, else all cores).
    pub threads: Option<usize>,
    /// Jobs in flight in the exchange ring.
    pub ring_slots: u32,
    /// Bytes per ring slot.
    pub slot_bytes: usize,
    /// Longest wait before the job loop checks for shutdown.
    pub poll: Duration,
    /// Where to serve the gRPC control plane (`duet.v1.CpuWorker` and health), if anywhere.
    pub listen: Option<Address>,
    /// Remove segments of the same names a dead previous worker left behind.
    pub replace: bool,
    /// Keep the arena a dead previous worker left behind, K/V and all, when its header says
    /// it has this configuration's layout and model (else rebuild it, saying why); its ring is
    /// rebuilt.
    pub reattach: bool,
    /// Identity of the model whose K/V the arena holds ([`model_identity`]; 0: unknown, never
    /// re-attached).
    pub model_id: u64,
    /// The share of a mixture's routed experts this worker serves, from `model`.
    pub experts: Option<(PathBuf, experts::ExpertShare)>,
}

impl Config {
    /// Default shutdown-check interval of the job loop.
    pub const DEFAULT_POLL: Duration = Duration::from_millis(100);

    /// The arena layout this configuration gives.
    pub fn layout(&self) -> Result<ArenaLayout, CpuWorkerError> {
        let KvShape { n_layer, n_kv_head, head_dim } = self.shape;
        let mut layout =
            ArenaLayout { n_layer, n_kv_head, head_dim, block_size: self.block_size, dtype: self.kv_type, n_blocks: 1 };
        layout.n_blocks = match self.kv_size {
            KvSize::Blocks(n) => n,
            KvSize::Bytes(bytes) => layout.n_blocks_for_bytes(bytes)?,
        };
        if layout.n_blocks == 0 {
            let block = layout.block_bytes()?;
            return Err(CpuWorkerError::Config(format!(
                "the KV arena holds no block: {:?} is less than the {} header bytes plus one block of {block}",
                self.kv_size,
                layout.header_bytes()
            )));
        }
        layout.validate()?;
        Ok(layout)
    }
}

/// Creates the arena and the exchange ring (after removing a dead predecessor's with
/// `replace`), serves the control plane when `listen` is set, serves jobs until `shutdown`
/// is set (or the producer closes the ring), then stops the control plane, closes the ring
/// and removes both segments.
pub fn run(config: Config, shutdown: &AtomicBool) -> Result<ServeStats, CpuWorkerError> {
    let layout = config.layout()?;
    if config.slot_bytes < JOB_HEADER_BYTES + 64 || config.ring_slots == 0 {
        return Err(CpuWorkerError::Config(format!(
            "{} ring slots of {} bytes: need at least one slot of {} bytes",
            config.ring_slots,
            config.slot_bytes,
            JOB_HEADER_BYTES + 64
        )));
    }
    // Bound first: a busy address fails before the expensive setup, and before `replace`
    // could remove the segments of a worker still serving on it.
    let control = config.listen.as_ref().map(control::ControlPlane::bind).transpose()?;
    let cpus = resolve_cpus(&config)?;
    let threads = config.threads.unwrap_or_else(|| match &cpus {
        Some(c) => c.len(),
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    });
    let pool = build_pool(threads, cpus.clone())?;
    // Loaded on the pool, so the repacked copies are first touched on the worker's node.
    let experts = match &config.experts {
        Some((path, share)) => Some(pool.install(|| experts::ServedExperts::load(path, *share))?),
        None => None,
    };
    if let Some(e) = &experts {
        let held = e.bank.held_in(0).len();
        tracing::info!(held, of = e.limits.n_expert, repacked = e.bank.repacked_matrices(), "serving routed experts (per layer)");
    }
    let arena_name = arena_name(&config.instance, config.worker);
    let ring_name = ring_name(&config.instance, config.worker);
    let kept = owner_lock::clear_leftovers(&arena_name, &ring_name, config.replace, config.reattach)?;
    let reattached = match kept {
        true => match arena::Arena::reattach(&arena_name, layout, config.model_id, config.numa_node)? {
            Ok(found) => Some(found),
            Err(why) => {
                tracing::warn!(arena = %arena_name, "not re-attaching to the arena a previous worker left: {why}; rebuilding it (its K/V is lost)");
                Segment::remove(&arena_name)?;
                None
            }
        },
        false => None,
    };
    let (arena, setup) = match reattached {
        Some(found) => found,
        None => arena::Arena::create(&arena_name, layout, config.model_id, config.numa_node, &pool)?,
    };
    let ring_bytes = Ring::bytes_needed(config.ring_slots, config.slot_bytes)
        .ok_or_else(|| CpuWorkerError::Config("exchange ring size overflows".into()))?;
    let ring_seg = Segment::create(&ring_name, ring_bytes)?;
    let ring_locked = ring_seg.lock().is_ok();
    let mut consumer = Ring::create(ring_seg, config.ring_slots, config.slot_bytes)?.consumer();
    let counters = Arc::new(JobCounters::default());
    let fixed = CpuInfoResponse {
        worker: config.worker,
        arena_segment: arena_name.clone(),
        ring_segment: ring_name.clone(),
        kv_blocks: layout.n_blocks,
        block_size: layout.block_size,
        pid: std::process::id(),
        jobs_served: 0,
        jobs_rejected: 0,
        threads: u32::try_from(pool.current_num_threads()).unwrap_or(u32::MAX),
        numa_node: config.numa_node.filter(|_| setup.numa_bound),
        arena_locked: setup.locked,
        arena_generation: arena.generation(),
        expert_share: config.experts.as_ref().map(|(_, s)| s.index),
        expert_shares: config.experts.as_ref().map(|(_, s)| s.of),
    };
    let listen = control.as_ref().map(|c| c.address().to_string());
    let result = std::thread::scope(|scope| {
        let serving = match control {
            Some(c) => Some(c.serve(scope, control::InfoService::new(fixed, counters.clone()), shutdown)?),
            None => None,
        };
        tracing::info!(
            arena = %arena_name,
            ring = %ring_name,
            n_blocks = layout.n_blocks,
            block_size = layout.block_size,
            arena_bytes = arena.segment().len(),
            threads,
            cpus = ?cpus,
            numa_node = ?config.numa_node,
            numa_bound = setup.numa_bound,
            arena_locked = setup.locked,
            arena_generation = arena.generation(),
            ring_locked,
            ring_slots = config.ring_slots,
            slot_bytes = config.slot_bytes,
            listen = listen.as_deref().unwrap_or("-"),
            "cpu-worker ready"
        );
        let served = pool.install(|| serve::serve(&mut consumer, &arena, experts.as_ref(), shutdown, config.poll, &counters));
        // The control plane goes first, so nobody is told "ready" about segments being removed.
        let stopped = serving.map_or(Ok(()), control::Serving::stop);
        served.and_then(|stats| stopped.map(|()| stats))
    });
    consumer.close();
    drop(consumer);
    drop(arena);
    match &result {
        Ok(stats) => tracing::info!(served = stats.served, rejected = stats.rejected, "cpu-worker stopped; segments removed"),
        Err(e) => tracing::error!("cpu-worker stopped: {e}"),
    }
    result
}

/// The CPUs to pin to: `--cpus` (each must be allowed to this process), else the CPUs of
/// `--numa-node` this process may use, else none (no pinning).
fn resolve_cpus(config: &Config) -> Result<Option<Vec<usize>>, CpuWorkerError> {
    let allowed = numa::allowed_cpus();
    if let Some(cpus) = &config.cpus {
        if cpus.is_empty() {
            return Err(CpuWorkerError::Config("empty CPU list".into()));
        }
        if let Some(allowed) = &allowed {
            let denied: Vec<usize> = cpus.iter().copied().filter(|c| !allowed.contains(c)).collect();
            if !denied.is_empty() {
                return Err(CpuWorkerError::Config(format!(
                    "CPUs {denied:?} are not available to this process (allowed: {allowed:?})"
                )));
            }
        }
        return Ok(Some(cpus.clone()));
    }
    let Some(node) = config.numa_node else { return Ok(None) };
    match numa::node_info(node) {
        numa::NodeInfo::Present { cpus } => {
            let usable: Vec<usize> =
                cpus.into_iter().filter(|c| allowed.as_ref().is_none_or(|a| a.contains(c))).collect();
            if usable.is_empty() {
                tracing::warn!(node, "NUMA node {node} has no CPU this process may use: threads are not pinned");
                return Ok(None);
            }
            Ok(Some(usable))
        }
        // `Arena::create` warns about the missing node.
        _ => Ok(None),
    }
}

/// The worker's thread pool; thread `i` is pinned to `cpus[i % len]` when CPUs are given.
fn build_pool(threads: usize, cpus: Option<Vec<usize>>) -> Result<rayon::ThreadPool, CpuWorkerError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .thread_name(|i| format!("duet-cpu-{i}"))
        .start_handler(move |i| {
            if let Some(cpus) = &cpus {
                let cpu = cpus[i % cpus.len()];
                if let Err(e) = numa::pin_current_thread(&[cpu]) {
                    tracing::warn!(thread = i, cpu, "pinning worker thread failed: {e}");
                }
            }
        })
        .build()
        .map_err(|e| CpuWorkerError::ThreadPool(e.to_string()))
}
