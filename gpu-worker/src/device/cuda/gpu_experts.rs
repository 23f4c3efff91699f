//! Routed experts on the GPU. Hot experts (`--device-experts K` with `--experts-on
//! cpu-workers`), as KTransformers keeps a mixture's most-used experts there: the experts the
//! plan names (`worker::hot_experts`) are uploaded from the file, each as its own gate, up and
//! down matrices, and computed on the GPU on the rows routed to them, while the cpu-workers
//! serve the rest. The room they take is reserved before the KV mirror is sized
//! ([`set_expert_slots`]), so a plan of up to K experts a layer always fits. And streamed
//! experts: a batch of many rows (a prompt's chunk) has the GPU compute every expert its
//! rows use, each uploaded for the layer and let go after, as llama.cpp offloads a large
//! batch's experts: a layer's experts cross the host link in less time than the host's
//! cores take to compute them for that many rows ([`set_streamed_expert_rows`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use duet_model::config::FfnAct;
use duet_model::experts::ExpertTensors;
use duet_model::gguf::GgufFile;

use super::launch::{Acts, GpuWeight, Launcher};
use super::CudaError;
use crate::device::host_experts::RoutedRows;
use crate::device::model::Weight;
use crate::error::{GpuWorkerError, Result};

/// Experts a layer may hold on the GPU (`--device-experts`), set once for the process before
/// the device loads: their room is kept out of the KV mirror's.
static EXPERT_SLOTS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// Sets the process's hot-expert slots per layer; false if they were already set.
pub fn set_expert_slots(k: usize) -> bool {
    EXPERT_SLOTS.set(k).is_ok()
}

/// The default of [`set_streamed_expert_rows`]. A layer of the OLMoE shape's 64 experts is
/// 226 MB of Q4_K_M: at PCIe's ~10 GB/s from pageable memory (each expert's copy waits for
/// the kernels before it; not yet measured) ~25 ms; its experts take the host ~0.1 ms a row
/// (on the H200's 16 host cores a 2 048-row chunk spent 3.8 s in the cpu-worker's experts,
/// 16 layers).
const STREAMED_EXPERT_ROWS: usize = 256;

/// The largest expert (its three matrices) a batch streams: one at a time, it must fit the
/// memory kept for activations beside the batch's own (`budget::ACTIVATION_RESERVE`, 768 MiB).
const STREAMED_EXPERT_MAX_BYTES: usize = 192 << 20;

/// Rows from which a batch streams its experts ([`set_streamed_expert_rows`]).
static STREAMED_ROWS: AtomicUsize = AtomicUsize::new(STREAMED_EXPERT_ROWS);

/// Sets how many rows a batch needs for the GPU to compute every expert its rows use,
/// uploading the ones it does not hold for the layer (0: never); returns the setting before.
/// The default is 256 rows, or `DUET_CUDA_STREAMED_EXPERT_ROWS` where set when a device loads.
pub fn set_streamed_expert_rows(rows: usize) -> usize {
    STREAMED_ROWS.swap(rows, Ordering::Relaxed)
}

/// One expert's matrices on the GPU.
struct GpuExpert {
    gate: GpuWeight,
    up: GpuWeight,
    down: GpuWeight,
}

/// The routed experts the GPU holds, `[layer][expert]`, within the room reserved for them.
pub struct GpuExperts {
    file: Arc<GgufFile>,
    tensors: ExpertTensors,
    held: Vec<Vec<Option<GpuExpert>>>,
    /// Bytes reserved at load (the slots of every layer the device holds).
    reserved: usize,
    /// The host holds the experts (no hot experts: nothing to take from the cpu-workers).
    local: bool,
}

impl GpuExperts {
    /// Room for the slots [`set_expert_slots`] set (none without, nor where the host holds
    /// the experts, `local`) in each of the device's first `layers` layers, nothing uploaded
    /// yet; `None` for a model without experts, or experts of a type the GPU has no kernels
    /// for (mixtures often store their experts in types the dense layers do not use): no
    /// room is then taken from the KV mirror for experts that could never be placed.
    pub fn new(file: Arc<GgufFile>, tensors: Option<ExpertTensors>, local: bool, layers: usize) -> Option<Self> {
        if let Ok(v) = std::env::var("DUET_CUDA_STREAMED_EXPERT_ROWS") {
            match v.parse() {
                Ok(rows) => {
                    set_streamed_expert_rows(rows);
                }
                Err(_) => tracing::warn!(value = %v, "DUET_CUDA_STREAMED_EXPERT_ROWS is not a number of rows; ignored"),
            }
        }
        let tensors = tensors?;
        if let Some(s) = tensors.layers.iter().take(layers).flatten().find(|s| !GpuWeight::takes(s.ty)) {
            if EXPERT_SLOTS.get().is_some_and(|&k| k > 0) {
                tracing::warn!(tensor = %s.name, ty = %s.ty, "no routed experts on the GPU: it has no kernels for this type; the host or the cpu-workers compute every expert");
            }
            return None;
        }
        let reserved = room(Some(&tensors), local, layers);
        let held = (0..layers).map(|_| (0..tensors.n_expert).map(|_| None).collect()).collect();
        Some(GpuExperts { file, tensors, held, reserved, local })
    }

    /// GPU memory kept for the experts.
    pub fn reserved(&self) -> usize {
        self.reserved
    }

    /// Whether every expert of every layer the device holds is on the GPU (then no step
    /// needs the cpu-workers' expert jobs).
    pub fn holds_all(&self) -> bool {
        self.held.iter().all(|l| l.iter().all(Option::is_some))
    }

    /// Whether a batch of `rows` rows streams its experts ([`set_streamed_expert_rows`]), in
    /// layer `l`: not where an expert is too large to upload beside the batch.
    pub fn streams(&self, l: usize, rows: usize) -> bool {
        let from = STREAMED_ROWS.load(Ordering::Relaxed);
        from > 0 && rows >= from && l < self.tensors.layers.len() && expert_bytes(&self.tensors, l) <= STREAMED_EXPERT_MAX_BYTES
    }

    /// Whether expert `e` of layer `l` is on the GPU.
    pub fn holds(&self, l: usize, e: usize) -> bool {
        self.held.get(l).and_then(|h| h.get(e)).is_some_and(Option::is_some)
    }

    /// Holds the experts `held[l]` of each of the device's layers from now on (of the
    /// model's `n_layer`; layers past the device's are another device's), uploading those
    /// that come and freeing those that go; how many came or went. A plan over the reserved
    /// room, or of an architecture whose experts are not SiLU-gated, is refused whole.
    pub fn place(&mut self, stream: &Arc<CudaStream>, act: FfnAct, held: &[Vec<usize>]) -> Result<usize> {
        if self.local {
            return Err(GpuWorkerError::InvalidRequest("placing routed experts on the GPU needs a mixture with its experts on the cpu-workers".into()));
        }
        let (n_layer, n_expert) = (self.tensors.layers.len(), self.tensors.n_expert);
        if held.len() != n_layer || held.iter().flatten().any(|&e| e >= n_expert) {
            return Err(GpuWorkerError::InvalidRequest(format!("an expert placement names {} layers of {n_layer}, or an expert past {n_expert}", held.len())));
        }
        if act != FfnAct::Silu {
            return Err(GpuWorkerError::InvalidRequest(format!("experts on the GPU take SiLU-gated experts, not {act:?} ones")));
        }
        let want: usize = held.iter().take(self.held.len()).enumerate().map(|(l, es)| es.len() * expert_bytes(&self.tensors, l)).sum();
        if want > self.reserved {
            return Err(GpuWorkerError::InvalidRequest(format!(
                "a plan of {want} bytes of experts on the GPU, over the {} bytes --device-experts reserved",
                self.reserved
            )));
        }
        // Those that go first, so that the plan never needs more than its room.
        let mut moved = 0;
        for (l, es) in held.iter().enumerate().take(self.held.len()) {
            for e in (0..n_expert).filter(|e| !es.contains(e)) {
                moved += usize::from(self.held[l][e].take().is_some());
            }
        }
        for (l, es) in held.iter().enumerate().take(self.held.len()) {
            for &e in es {
                if self.held[l][e].is_none() {
                    self.held[l][e] = Some(self.upload(stream, l, e)?);
                    moved += 1;
                }
            }
        }
        stream.synchronize().map_err(CudaError::from)?;
        Ok(moved)
    }

    /// Expert `e` of layer `l`, its three matrices from the file.
    fn upload(&self, stream: &Arc<CudaStream>, l: usize, e: usize) -> Result<GpuExpert> {
        let up = |i: usize| -> Result<GpuWeight> {
            let s = &self.tensors.layers[l][i];
            let data = self.file.tensor(&s.name).map_err(|e| GpuWorkerError::Model(e.into()))?.data;
            let w = Weight { name: format!("{} (expert {e})", s.name), ty: s.ty, rows: s.rows, cols: s.cols, first_row: 0 };
            Ok(GpuWeight::upload(stream, &w, s.expert_bytes(data, e))?)
        };
        Ok(GpuExpert { gate: up(0)?, up: up(1)?, down: up(2)? })
    }

    /// Adds to `y` (the layer's rows) each routed expert's output on the rows routed to it,
    /// times the router's weight: the rows gathered from `xn` (the layer's normed rows), the
    /// expert's SiLU-gated MLP, the outputs scattered back. An expert the GPU does not hold is
    /// uploaded for the call where `stream` says so (and let go after), else refused.
    pub fn add_outputs(&self, k: &Launcher, l: usize, xn: &CudaSlice<f32>, routed: &[RoutedRows], y: &mut CudaSlice<f32>, stream: bool) -> Result<()> {
        let (d, ff) = (self.tensors.n_embd, self.tensors.n_ff);
        // Every expert's rows and weights in one copy each (a copy costs more than the
        // kernels of an expert's one or two rows), each expert's its span of them.
        let (mut rows, mut weights, mut spans) = (Vec::new(), Vec::new(), Vec::new());
        for r in routed.iter().filter(|r| !r.rows.is_empty()) {
            if !stream && !self.holds(l, r.expert) {
                return Err(GpuWorkerError::InvalidRequest(format!("expert {} of layer {l} is not on the GPU", r.expert)));
            }
            let from = rows.len();
            rows.extend(r.rows.iter().map(|&(t, _)| t as u32));
            weights.extend(r.rows.iter().map(|&(_, w)| w));
            spans.push((r.expert, from..rows.len()));
        }
        if spans.is_empty() {
            return Ok(());
        }
        let (rows, weights) = (k.stream.clone_htod(&rows).map_err(CudaError::from)?, k.stream.clone_htod(&weights).map_err(CudaError::from)?);
        for (e, span) in spans {
            let streamed;
            let ex = match self.held.get(l).and_then(|h| h.get(e)).and_then(Option::as_ref) {
                Some(ex) => ex,
                None => {
                    // Freed when it goes out of scope: after its kernels, in stream order.
                    streamed = self.upload(&k.stream, l, e)?;
                    &streamed
                }
            };
            let (at, w) = (rows.slice(span.clone()), weights.slice(span.clone()));
            let xs = k.gather_rows_at(xn, &at, d)?;
            let out = k.silu_mlp(&ex.gate, &ex.up, &ex.down, &mut Acts::new(&xs, span.len(), d), ff)?;
            k.scatter_add_scaled(&out, &at, &w, d, y)?;
        }
        Ok(())
    }
}

/// The GPU memory the hot experts' slots ([`set_expert_slots`]) take in the first `layers`
/// layers of a model with experts `tensors`: none without experts, or when the host holds
/// them (`local`).
pub fn room(tensors: Option<&ExpertTensors>, local: bool, layers: usize) -> usize {
    let Some(t) = tensors.filter(|_| !local) else { return 0 };
    let slots = EXPERT_SLOTS.get().copied().unwrap_or(0).min(t.n_expert);
    slots * (0..layers.min(t.layers.len())).map(|l| expert_bytes(t, l)).sum::<usize>()
}

/// Bytes of one expert of layer `l` (its gate, up and down matrices).
fn expert_bytes(t: &ExpertTensors, l: usize) -> usize {
    t.layers[l].iter().map(|s| s.rows * s.ty.row_bytes(s.cols)).sum()
}
