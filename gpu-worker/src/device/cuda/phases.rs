//! Where the CUDA device's time goes: host wall-clock per phase of its calls, summed until
//! taken (`Device::phase_times`; the runner's `--json` timings print them). Launches return
//! at once and the GPU's work shows up in the phase that next waits for it (the downloads),
//! so the split tells queueing, transfers and waits apart, not kernel from kernel.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// A phase of the device's calls.
#[derive(Debug, Clone, Copy)]
pub enum Phase {
    /// Embedding rows, RoPE tables (start of a batch).
    Embed,
    /// Norm, Q/K/V products, biases, Q/K norms, RoPE: queued.
    QkvLaunch,
    /// Q, K and V to the host, or on the whole-layer path the step's K/V once (waits for the GPU).
    QkvDownload,
    /// K/V rows into the arenas or the runner's cache (host).
    StoreArena,
    /// K/V rows written by the GPU into the arenas in place (`host_map`), waited for.
    StoreInPlace,
    /// K/V rows into the KV mirror.
    StoreMirror,
    /// The mirror's attention: room, uploads of missing positions, tables, launches.
    AttendPrepare,
    /// The attention's outputs to the host (waits for the GPU).
    AttendWait,
    /// Attention on the host (no mirror, or a sequence over it).
    AttendHost,
    /// The attention output to the GPU.
    FinishUpload,
    /// Output projection, MLP, residuals: queued (a mixture's experts run on the host here).
    FinishLaunch,
    /// LM head and the logits or greedy tokens to the host.
    Logits,
}

const NAMES: [&str; 12] = [
    "embed",
    "qkv_launch",
    "qkv_download",
    "store_arena",
    "store_in_place",
    "store_mirror",
    "attend_prepare",
    "attend_wait",
    "attend_host",
    "finish_upload",
    "finish_launch",
    "logits",
];

/// The phases' summed nanoseconds.
#[derive(Debug, Default)]
pub struct Phases {
    ns: [AtomicU64; 12],
}

impl Phases {
    /// Adds the time since `since` to `phase`, and returns now (the next phase's start).
    pub fn add(&self, phase: Phase, since: Instant) -> Instant {
        let now = Instant::now();
        self.ns[phase as usize].fetch_add(now.duration_since(since).as_nanos() as u64, Ordering::Relaxed);
        now
    }

    /// Each phase's nanoseconds since the last call, zeroed.
    pub fn take(&self) -> Vec<(&'static str, u64)> {
        NAMES.iter().zip(&self.ns).map(|(&name, ns)| (name, ns.swap(0, Ordering::Relaxed))).collect()
    }
}
