//! The process heap set up for the products' large temporary buffers: freed memory kept for
//! the next layer instead of returned to the kernel.
//!
//! A prefill chunk's activations, quantised rows and products are tens of MiB per layer, freed
//! at the layer's end. glibc serves blocks over its mmap threshold (128 KiB to 32 MiB, moving)
//! with fresh mappings and unmaps them when freed, and trims the heap's free top, so every
//! layer faulted in and zeroed its buffers again. Measured (the 1B-shape Q4_K_M model, a
//! 512-token prompt in `duet-gpu-worker run`, 2 threads, alternating runs): 179–193 tok/s
//! before, 217–238 with the thresholds below.

/// Blocks up to this size come from the heap and are reused once freed.
const MMAP_THRESHOLD: usize = 256 << 20;
/// The heap's free top is returned to the kernel only past this.
const TRIM_THRESHOLD: usize = 1 << 30;

/// Sets the heap's thresholds (glibc's `mallopt`; a no-op elsewhere). Call once, first thing in
/// `main`, before other threads start. Returns whether they were set.
pub fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` only changes allocator parameters; both values are in its range.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD as libc::c_int) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}
