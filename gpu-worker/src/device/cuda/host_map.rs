//! Host memory the GPU writes in place (stage B): a cpu-worker's KV arena is registered with
//! `cuMemHostRegister` and mapped into the GPU's address space ([`map`]), and a step wholly on
//! the GPU stores its layers' K/V rows there with `kv_to_arena` ([`store_in_place`]), where
//! they were downloaded and written into the arena by the host. `DUET_CUDA_ARENA_WRITES=0`
//! keeps the host's writes (for comparing the two).

use std::sync::Arc;

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, CudaSlice};

use super::launch::Launcher;
use super::CudaError;
use crate::device::{HostMapping, InPlaceRow};

/// A registration, ended when dropped.
struct Registered {
    ctx: Arc<CudaContext>,
    ptr: usize,
}

impl Drop for Registered {
    fn drop(&mut self) {
        let ended = self.ctx.bind_to_thread().map_err(|e| e.to_string()).and_then(|()| {
            // SAFETY: `ptr` was registered by `map` and not unregistered since.
            let r = unsafe { sys::cuMemHostUnregister(self.ptr as *mut std::ffi::c_void) };
            if r == CUresult::CUDA_SUCCESS { Ok(()) } else { Err(format!("{r:?}")) }
        });
        if let Err(e) = ended {
            tracing::warn!(ptr = self.ptr, "cannot unregister a KV arena from the GPU: {e}");
        }
    }
}

/// Whether arenas are mapped for the GPU (`DUET_CUDA_ARENA_WRITES=0` says no).
fn enabled() -> bool {
    std::env::var("DUET_CUDA_ARENA_WRITES").map_or(true, |v| v != "0")
}

/// `len` bytes at `ptr` registered with the GPU and mapped into its address space; `None`
/// (logged) where registration fails or is turned off.
///
/// # Safety
/// The memory stays mapped until the mapping is dropped.
pub unsafe fn map(ctx: &Arc<CudaContext>, ptr: *mut u8, len: usize) -> Option<HostMapping> {
    if !enabled() {
        tracing::info!("DUET_CUDA_ARENA_WRITES=0: the host writes the K/V rows into the arenas");
        return None;
    }
    let started = std::time::Instant::now();
    let registered = (|| -> Result<HostMapping, String> {
        ctx.bind_to_thread().map_err(|e| e.to_string())?;
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: the caller keeps the memory mapped until the registration ends (`Registered`).
        let r = unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, flags) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemHostRegister: {r:?}"));
        }
        let guard = Registered { ctx: ctx.clone(), ptr: ptr as usize };
        let mut addr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is registered with DEVICEMAP just above.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut addr, ptr.cast(), 0) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemHostGetDevicePointer: {r:?}"));
        }
        Ok(HostMapping::new(addr, guard))
    })();
    match registered {
        Ok(m) => {
            tracing::info!(mib = len >> 20, ms = started.elapsed().as_millis() as u64, "KV arena mapped for the GPU: it writes the K/V rows in place");
            Some(m)
        }
        Err(e) => {
            tracing::warn!(mib = len >> 20, "KV arena not mapped for the GPU ({e}): the host writes its K/V rows");
            None
        }
    }
}

/// Stores `layers`' K/V rows (each `(layer, k, v)`, `[row][n_kv_head · head_dim]`) at
/// `places`, one per row, straight into the mapped arenas, and waits for them there: the
/// step's rows must be in the arenas before anyone is told the step is done.
pub fn store_in_place(k: &Launcher, layers: &[(usize, CudaSlice<f32>, CudaSlice<f32>)], places: &[InPlaceRow], n_kv_head: usize, head_dim: usize) -> Result<(), CudaError> {
    let Some(q8) = places.first().map(|p| p.q8) else { return Ok(()) };
    let rows: Vec<u64> = places.iter().map(|p| p.addr).collect();
    let strides: Vec<u64> = places.iter().map(|p| p.stride).collect();
    let (rows, strides) = (k.stream.clone_htod(&rows)?, k.stream.clone_htod(&strides)?);
    let launched = layers.iter().try_for_each(|(layer, kk, vv)| k.kv_to_arena(kk, vv, &rows, &strides, n_kv_head, head_dim, *layer, q8));
    // Waited for even when a launch failed: the launched ones write into the arenas, which
    // must not be unmapped under them.
    let waited = k.stream.synchronize();
    launched?;
    Ok(waited?)
}
