//! The CUDA device's GPU memory: what it may use (`--gpu-mem-bytes`), what its KV mirror
//! takes (`--gpu-kv-bytes`, by default what the weights, the workspace and the hot experts'
//! room leave), and the reserve kept for activations.

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaStream;
use duet_model::config::LlamaConfig;

use super::launch::WORKSPACE_ELEMS;
use super::mirror::{self, KvMirror};
use super::{CudaError, Gpu};
use crate::error::Result;

/// The GPU memory the device may use (`--gpu-mem-bytes`), set once for the process before a
/// model loads: a budget below the card's, e.g. to measure what fits a 16 GB card on a
/// bigger one, or to leave room to other programs. Stage A checks the weights and the
/// dequantisation workspace against it at load (activations take a few MiB more).
static MEMORY_BUDGET: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// Sets the process's GPU memory budget; false if one was already set.
pub fn set_memory_budget(bytes: usize) -> bool {
    MEMORY_BUDGET.set(bytes).is_ok()
}

/// The GPU memory the KV mirror may take (`--gpu-kv-bytes`), set once for the process.
static KV_BUDGET: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// Sets the process's KV mirror budget (0: no mirror, attention on the host as at stage A);
/// false if one was already set.
pub fn set_kv_budget(bytes: usize) -> bool {
    KV_BUDGET.set(bytes).is_ok()
}

/// GPU memory left for activations, cuBLAS and attention's partial results when the KV
/// mirror takes the rest by default.
const ACTIVATION_RESERVE: usize = 768 << 20;

/// GPU memory the device needs besides the weights: the dequantisation workspace (f16).
pub const WORKSPACE_BYTES: usize = WORKSPACE_ELEMS * 2;

/// The GPU memory the device may use on `gpu`: what is free, or less where
/// `--gpu-mem-bytes` says.
pub fn usable_bytes(gpu: &Gpu) -> Result<usize> {
    let (free, _) = gpu.ctx.mem_get_info().map_err(CudaError::from)?;
    Ok(MEMORY_BUDGET.get().map_or(free, |&b| b.min(free)))
}

/// Lets the device's default memory pool keep its activations' memory between steps.
/// cudarc allocates every buffer stream-ordered (`cuMemAllocAsync`) from that pool, whose
/// release threshold is 0 by default: at every synchronisation (each step has at least one)
/// it hands all unused memory back to the driver, so the next step's activations — tens of
/// buffers a step — are mapped anew, a driver call each. Kept, they are reused.
///
/// The threshold is compared with all the pool holds, in use or not, and the weights, the
/// workspace, the KV mirror and the hot experts come from the same pool: so it is set to what
/// the pool holds when this is called plus [`ACTIVATION_RESERVE`]. Call it once the device is
/// loaded and again whenever what it holds for good changes (hot experts placed). (It was
/// first written as the reserve alone, below the weights, which released everything at
/// every synchronisation as before; a review found that before any GPU ran it.)
/// `DUET_CUDA_POOL_KEEP=0` leaves the default (for comparison); a failure only costs speed.
pub fn keep_activation_memory(gpu: &Gpu) {
    // Without stream-ordered allocation cudarc allocates with `cuMemAlloc`: no pool.
    if std::env::var("DUET_CUDA_POOL_KEEP").is_ok_and(|v| v == "0") || !gpu.ctx.has_async_alloc() {
        return;
    }
    let kept = gpu.ctx.bind_to_thread().map_err(|e| e.to_string()).and_then(|()| {
        use cudarc::driver::sys::{self, CUmemPool_attribute, CUresult};
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: the context is current; `pool`, `held` and `threshold` outlive the calls.
        let r = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, gpu.ctx.cu_device()) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(format!("cuDeviceGetDefaultMemPool: {r:?}"));
        }
        let mut held: u64 = 0;
        let r = unsafe { sys::cuMemPoolGetAttribute(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, (&raw mut held).cast()) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemPoolGetAttribute: {r:?}"));
        }
        let mut threshold = held.saturating_add(ACTIVATION_RESERVE as u64);
        let r = unsafe { sys::cuMemPoolSetAttribute(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, (&raw mut threshold).cast()) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemPoolSetAttribute: {r:?}"));
        }
        Ok(threshold)
    });
    match kept {
        Ok(threshold) => tracing::debug!(mib = threshold >> 20, "the GPU's memory pool keeps up to this between steps"),
        Err(e) => tracing::warn!("the GPU's memory pool returns activations' memory at every step: {e}"),
    }
}

/// The budget `--gpu-mem-bytes` set, if any.
pub fn memory_budget() -> Option<usize> {
    MEMORY_BUDGET.get().copied()
}

/// The KV mirror: `--gpu-kv-bytes`, by default what the GPU memory the device may use
/// leaves after `used` bytes and a reserve for activations; none for 0, or heads the
/// attention kernel does not take.
pub fn mirror_within_budget(gpu: &Gpu, stream: &Arc<CudaStream>, config: &LlamaConfig, layers: usize, used: usize, reserved: usize) -> Result<Option<Mutex<KvMirror>>> {
    let shape = crate::device::attn_shape(config);
    if !KvMirror::supports(&shape) {
        tracing::info!(head_dim = shape.head_dim, "no KV mirror: the GPU's attention takes even heads of up to {} values; attention on the host", mirror::MAX_HEAD_DIM);
        return Ok(None);
    }
    // `used` is on the GPU already (out of `free`); `reserved`, the hot experts' room, is not yet.
    let free = gpu.ctx.mem_get_info().map_err(CudaError::from)?.0.saturating_sub(reserved);
    let left = MEMORY_BUDGET.get().map_or(free, |&b| b.saturating_sub(used + reserved).min(free)).saturating_sub(ACTIVATION_RESERVE);
    let bytes = match KV_BUDGET.get() {
        Some(&b) if b > left => {
            tracing::warn!("--gpu-kv-bytes {b} is over the {left} bytes of GPU memory left; the mirror takes those");
            left
        }
        Some(&b) => b,
        None => left,
    };
    let page = KvMirror::page_bytes(layers, &shape);
    if bytes < page {
        tracing::info!(bytes, "no KV mirror (under one page of {page} bytes): attention on the host");
        return Ok(None);
    }
    let sms = gpu.ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(CudaError::from)?;
    let mirror = KvMirror::new(stream, bytes, layers, shape, sms.max(1) as usize)?;
    tracing::info!(mib = bytes >> 20, positions = mirror.capacity(), "KV mirror on the GPU: attention there");
    Ok(Some(Mutex::new(mirror)))
}
