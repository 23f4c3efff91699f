//! Finding a usable GPU without ever panicking: the CUDA libraries are opened at run time
//! (cudarc's dynamic loading), so each is checked for before its first call, then the driver,
//! the device and its architecture. Every failure is a sentence for `--device auto`'s log line
//! and `--device cuda`'s error.

use std::sync::Arc;

use cudarc::driver::CudaContext;

/// A GPU that can run the CUDA device.
#[derive(Debug, Clone)]
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub name: String,
    /// Compute capability as `major * 10 + minor`, e.g. 90 for an H100.
    pub arch: u32,
    pub total_mem: usize,
    /// The driver's CUDA version, e.g. (13, 0).
    pub driver: (i32, i32),
    pub nvrtc: (i32, i32),
}

/// The oldest architecture the kernels are compiled for: CUDA 13's NVRTC starts at Turing
/// (sm_75, the T4); `__dp4a` itself needs 6.1.
pub const MIN_ARCH: u32 = 75;

/// Opens GPU `ordinal`, or says why the CUDA device cannot run here.
pub fn probe(ordinal: usize) -> Result<Gpu, String> {
    // SAFETY: these only try to open the libraries (dlopen) and close them again.
    let (driver_lib, nvrtc_lib, blas_lib) =
        unsafe { (cudarc::driver::sys::is_culib_present(), cudarc::nvrtc::sys::is_culib_present(), cudarc::cublas::sys::is_culib_present()) };
    if !driver_lib {
        return Err("no NVIDIA driver: libcuda.so was not found".into());
    }
    let count = CudaContext::device_count().map_err(|e| format!("the NVIDIA driver found no usable GPU ({e})"))?;
    if ordinal >= count.max(0) as usize {
        return Err(format!("GPU {ordinal} does not exist (the driver sees {count})"));
    }
    if !nvrtc_lib {
        return Err("NVRTC (libnvrtc.so.13) was not found: install the CUDA 13 toolkit's runtime compiler, or pip's nvidia-cuda-nvrtc and put its lib folder on LD_LIBRARY_PATH".into());
    }
    if !blas_lib {
        return Err("cuBLAS (libcublas.so.13) was not found: install CUDA 13's cuBLAS, or pip's nvidia-cublas and put its lib folder on LD_LIBRARY_PATH".into());
    }
    let driver = driver_version()?;
    let nvrtc = super::kernels::nvrtc_version().map_err(|e| e.to_string())?;
    if nvrtc > driver {
        return Err(format!(
            "NVRTC {}.{} is newer than the driver's CUDA {}.{}: its PTX would not load; use an NVRTC no newer than the driver",
            nvrtc.0, nvrtc.1, driver.0, driver.1
        ));
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| format!("GPU {ordinal} cannot be opened ({e})"))?;
    let name = ctx.name().unwrap_or_else(|_| "an unnamed GPU".into());
    let (major, minor) = ctx.compute_capability().map_err(|e| format!("{name}: no compute capability ({e})"))?;
    let arch = (major * 10 + minor) as u32;
    if arch < MIN_ARCH {
        return Err(format!("{name} has compute capability {major}.{minor}; the kernels need {}.{} or newer", MIN_ARCH / 10, MIN_ARCH % 10));
    }
    let total_mem = ctx.total_mem().map_err(|e| format!("{name}: memory size unknown ({e})"))?;
    Ok(Gpu { ctx, name, arch, total_mem, driver, nvrtc })
}

fn driver_version() -> Result<(i32, i32), String> {
    let mut v = 0;
    // SAFETY: an out-parameter; libcuda was found above.
    let status = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    if status != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return Err(format!("the driver does not say its version ({status:?})"));
    }
    Ok((v / 1000, (v % 1000) / 10))
}
