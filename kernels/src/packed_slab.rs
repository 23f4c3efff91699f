//! Memory for the repacked weights ([`crate::interleaved::Interleaved`]): large anonymous
//! mappings advised into transparent huge pages, handed out in order, so that every matrix —
//! an expert's 1 MiB ones too — is streamed from 2 MiB pages.
//!
//! A mapping of its own per matrix got huge pages only where a whole aligned 2 MiB range fell
//! inside it: on the OLMoE-1B-7B shape 108 MiB of 4.1 GiB, the experts (1.2–1.7 MiB a matrix)
//! none. From one slab they are 3.8 GiB of it, and batch-1 decode (`duet-gpu-worker run`, 2
//! threads, four alternating runs) went from 28.8–35.1 to 35.6–37.5 tok/s. A slab is 1 GiB of address
//! space (more for a larger matrix); only what is written is backed. A matrix let go (an
//! expert moved elsewhere) gives its whole pages back to the kernel; its range is not reused,
//! and a slab is unmapped when nothing in it is left.

use std::sync::{Arc, Mutex};

/// Address space reserved per slab.
const SLAB_BYTES: usize = 1 << 30;
/// Every range starts on its own cache line (the kernels' group blocks are whole lines).
const ALIGN: usize = 64;
const PAGE: usize = 4096;

/// One anonymous mapping that ranges are carved from.
struct Slab {
    map: memmap2::MmapMut,
}

// SAFETY: the mapping is only read or written through `SlabBytes`, each the sole owner of a
// disjoint range of it.
unsafe impl Send for Slab {}
unsafe impl Sync for Slab {}

/// The slab being carved and its next free offset.
static CURRENT: Mutex<Option<(Arc<Slab>, usize)>> = Mutex::new(None);

/// A range of a slab, owned: zeroed when made, its whole pages returned when dropped.
pub struct SlabBytes {
    slab: Arc<Slab>,
    off: usize,
    len: usize,
}

impl SlabBytes {
    /// `len` zeroed bytes from the current slab (a new one when it has no room); `None` if no
    /// mapping can be made.
    pub fn alloc(len: usize) -> Option<SlabBytes> {
        let mut current = CURRENT.lock().unwrap_or_else(|p| p.into_inner());
        let fits = |(slab, next): &(Arc<Slab>, usize)| next.next_multiple_of(ALIGN) + len <= slab.map.len();
        if !current.as_ref().is_some_and(fits) {
            let map = memmap2::MmapMut::map_anon(SLAB_BYTES.max(len)).ok()?;
            // Advice only: without it the ranges are ordinary pages.
            #[cfg(target_os = "linux")]
            let _ = map.advise(memmap2::Advice::HugePage);
            *current = Some((Arc::new(Slab { map }), 0));
        }
        let (slab, next) = current.as_mut().expect("a slab with room");
        let off = next.next_multiple_of(ALIGN);
        *next = off + len;
        Some(SlabBytes { slab: Arc::clone(slab), off, len })
    }

}

impl Drop for SlabBytes {
    fn drop(&mut self) {
        // The pages wholly inside the range go back to the kernel (a neighbour's may share the
        // first and last); the slab itself is unmapped with its last range.
        let (start, end) = (self.off.next_multiple_of(PAGE), (self.off + self.len) / PAGE * PAGE);
        if end > start {
            // SAFETY: no reference into the range outlives `self`, and the pages are this
            // range's alone; zero-filled pages come back if the range were read again.
            #[cfg(unix)]
            let _ = unsafe { self.slab.map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start) };
        }
    }
}

impl std::ops::Deref for SlabBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `off..off + len` lies in the mapping (checked when carved), which lives as
        // long as `self.slab`; no other `SlabBytes` overlaps it.
        unsafe { std::slice::from_raw_parts(self.slab.map.as_ptr().add(self.off), self.len) }
    }
}

impl std::ops::DerefMut for SlabBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` makes this the only reference to the range.
        unsafe { std::slice::from_raw_parts_mut(self.slab.map.as_ptr().cast_mut().add(self.off), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_disjoint_aligned_zeroed_and_writable() {
        let mut a = SlabBytes::alloc(5000).expect("mapping");
        let mut b = SlabBytes::alloc(100).expect("mapping");
        assert!(a.iter().chain(b.iter()).all(|&x| x == 0));
        a.fill(1);
        b.fill(2);
        assert!(a.iter().all(|&x| x == 1) && b.iter().all(|&x| x == 2));
        assert_eq!(a.as_ptr() as usize % ALIGN, 0);
        assert_eq!(b.as_ptr() as usize % ALIGN, 0);
        drop(a);
        assert!(b.iter().all(|&x| x == 2), "dropping a neighbour leaves a range's bytes");
        let big = SlabBytes::alloc(SLAB_BYTES + 1).expect("a slab of its own");
        assert_eq!(big.len(), SLAB_BYTES + 1);
    }
}
