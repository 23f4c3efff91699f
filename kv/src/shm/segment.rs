//! Named shared-memory segments: files in `/dev/shm` mapped with memmap2, created 0600 and
//! exclusively, optionally `mlock`ed, removed by their creator unless persisted.
//!
//! # Safety rules for the memory of a segment
//!
//! The bytes are shared with other processes (and with other mappings of the same file in
//! this process), so Rust cannot prove anything about who else reads or writes them. This
//! type therefore never hands out plain references on its own account:
//! - [`Segment::atomic_u32`] / [`Segment::atomic_u64`] are safe: atomics may be shared with
//!   anyone, every bit pattern is a valid integer, and bounds and alignment are checked.
//! - [`Segment::slice`] / [`Segment::slice_mut`] are `unsafe`: the caller promises that,
//!   for as long as the reference lives, nobody (thread or process) writes the range (for
//!   `slice`) or touches it at all (for `slice_mut`) — in practice because a protocol of
//!   Release/Acquire atomics hands the range over, as the exchange ring does with its slots.
//!   Only [`Pod`] types are allowed: any bit pattern another process leaves is a valid value.
//! - [`Segment::as_ptr`] is the raw escape hatch under the same rules.
//!
//! The mapping is a memmap2 [`MmapRaw`] rather than an `MmapMut`: an `MmapMut` derefs to
//! `&mut [u8]`, a promise of exclusive access that shared memory cannot keep.

use std::fs::{File, OpenOptions, Permissions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64};

use memmap2::{MmapOptions, MmapRaw};

use super::ShmError;

/// Where segments live.
pub const SHM_DIR: &str = "/dev/shm";
/// Longest segment name (the file-name limit of tmpfs).
const NAME_MAX: usize = 255;

/// Plain-old-data: `Copy`, no padding, no pointers, and every bit pattern is a valid value,
/// so reading whatever another process wrote can never produce an invalid value.
///
/// # Safety
/// Implement only for types meeting all of the above.
pub unsafe trait Pod: Copy + Send + Sync + 'static {}

// SAFETY: primitive integers and floats have no padding and no invalid bit patterns; f16 and
// bf16 are `repr(transparent)` over `u16`; an array of Pod is Pod.
unsafe impl Pod for u8 {}
unsafe impl Pod for u16 {}
unsafe impl Pod for u32 {}
unsafe impl Pod for u64 {}
unsafe impl Pod for i8 {}
unsafe impl Pod for i16 {}
unsafe impl Pod for i32 {}
unsafe impl Pod for i64 {}
unsafe impl Pod for f32 {}
unsafe impl Pod for f64 {}
unsafe impl Pod for half::f16 {}
unsafe impl Pod for half::bf16 {}
unsafe impl<T: Pod, const N: usize> Pod for [T; N] {}

/// A named shared-memory segment mapped read-write into this process.
pub struct Segment {
    /// The mapping (unmapped on drop). `MmapRaw` only hands out raw pointers, and is Send
    /// and Sync, which makes `Segment` Send and Sync without an unsafe impl.
    map: MmapRaw,
    len: usize,
    name: String,
    path: PathBuf,
    /// The creator removes the file on drop unless [`Segment::persist`] was called.
    remove_on_drop: bool,
}

impl Segment {
    /// Creates `/dev/shm/<name>` of `len` bytes (zero-filled), failing with
    /// [`ShmError::AlreadyExists`] if it exists. The file is mode 0600 (owner only). The
    /// segment is not locked: call [`Segment::lock`] after any NUMA binding, since locking
    /// faults every page in. The file is removed when this handle drops, unless persisted.
    pub fn create(name: &str, len: usize) -> Result<Segment, ShmError> {
        let path = path_for(name)?;
        if len == 0 {
            return Err(ShmError::TooSmall { what: format!("segment {name}"), len, need: 1 });
        }
        check_free_space(len)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| classify(e, "creating", &path))?;
        // The file is ours from here on: remove it again if sizing or mapping fails.
        let io = |op, e| ShmError::Io { op, path: path.clone(), source: e };
        let result = file
            .set_permissions(Permissions::from_mode(0o600)) // the umask may only have cleared bits
            .map_err(|e| io("chmod", e))
            .and_then(|()| file.set_len(len as u64).map_err(|e| io("sizing", e)))
            .and_then(|()| map(&file, len, &path));
        match result {
            Ok(map) => Ok(Segment::new(map, len, name, path, true)),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// Opens an existing segment (the other process's side, or a re-attach after a restart).
    /// Its length is the file's. Refuses files that are not regular files, not owned by this
    /// user, or readable by others. An opener never removes the file.
    pub fn open(name: &str) -> Result<Segment, ShmError> {
        let path = path_for(name)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| classify(e, "opening", &path))?;
        let meta = file.metadata().map_err(|e| ShmError::Io { op: "stat", path: path.clone(), source: e })?;
        let deny = |reason: String| Err(ShmError::Permission { path: path.clone(), reason });
        if !meta.file_type().is_file() {
            return deny("not a regular file".into());
        }
        // SAFETY: geteuid has no preconditions and cannot fail.
        let euid = unsafe { libc::geteuid() };
        if meta.uid() != euid {
            return deny(format!("owned by uid {}, not by this process's uid {euid}", meta.uid()));
        }
        if meta.mode() & 0o077 != 0 {
            return deny(format!("mode {:o} lets other users in; segments must be 0600", meta.mode() & 0o777));
        }
        let len = usize::try_from(meta.len()).unwrap_or(usize::MAX);
        if len == 0 {
            return Err(ShmError::TooSmall { what: format!("segment {name}"), len, need: 1 });
        }
        let map = map(&file, len, &path)?;
        Ok(Segment::new(map, len, name, path, false))
    }

    /// Removes `/dev/shm/<name>` (a stale segment of a dead instance); `Ok(false)` if absent.
    /// Processes that still map it keep their memory.
    pub fn remove(name: &str) -> Result<bool, ShmError> {
        let path = path_for(name)?;
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(classify(e, "removing", &path)),
        }
    }

    fn new(map: MmapRaw, len: usize, name: &str, path: PathBuf, remove_on_drop: bool) -> Segment {
        Segment { map, len, name: name.to_string(), path, remove_on_drop }
    }

    /// Makes this handle remove the file when it drops, as its creator's would have: a
    /// process that re-attached to the segment of a creator that died owns it now.
    pub fn take_over(&mut self) {
        self.remove_on_drop = true;
    }

    /// Keeps the file after this (creating) handle drops, so a restarted process can re-attach.
    pub fn persist(&mut self) {
        self.remove_on_drop = false;
    }

    /// Locks the segment's pages in RAM (`mlock`), faulting them in. When the memlock limit
    /// refuses, the segment stays usable (unlocked, so swappable): the returned warning names
    /// RLIMIT_MEMLOCK, its current value and the size needed, and is also logged.
    pub fn lock(&self) -> Result<(), MemlockWarning> {
        // SAFETY: ptr/len describe this handle's live mapping; mlock only changes how the
        // kernel pages it and never reads or writes the bytes.
        let rc = unsafe { libc::mlock(self.as_ptr().cast(), self.len) };
        if rc == 0 {
            return Ok(());
        }
        let warning = MemlockWarning::new(&self.name, self.len, std::io::Error::last_os_error());
        tracing::warn!("{warning}");
        Err(warning)
    }

    /// The segment's name (its file name in `/dev/shm`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The segment's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a segment has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start of the mapping (page-aligned). Dereferencing it follows the module's safety rules.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// The `AtomicU32` at byte `offset`. Panics if out of bounds or not 4-byte aligned.
    pub fn atomic_u32(&self, offset: usize) -> &AtomicU32 {
        let p = self.checked_ptr::<u32>(offset, 1);
        // SAFETY: in bounds and aligned (checked), valid for the lifetime of &self (the
        // mapping lives as long as the handle); every bit pattern is a valid u32 and atomic
        // accesses may race with other processes by design (AtomicU32 is lock-free).
        unsafe { AtomicU32::from_ptr(p.cast()) }
    }

    /// The `AtomicU64` at byte `offset`. Panics if out of bounds or not 8-byte aligned.
    pub fn atomic_u64(&self, offset: usize) -> &AtomicU64 {
        let p = self.checked_ptr::<u64>(offset, 1);
        // SAFETY: as for `atomic_u32`; 64-bit atomics are lock-free on the targets Duet runs
        // on (x86_64, aarch64), which is what makes them work across processes.
        unsafe { AtomicU64::from_ptr(p.cast()) }
    }

    /// `count` values of `T` starting at byte `offset`. Panics if out of bounds or misaligned.
    ///
    /// # Safety
    /// For as long as the slice lives, nobody (another thread, process or mapping) may write
    /// the range: ownership of it must have been handed over by an Acquire load.
    pub unsafe fn slice<T: Pod>(&self, offset: usize, count: usize) -> &[T] {
        let p = self.checked_ptr::<T>(offset, count);
        // SAFETY: bounds/alignment checked, T is Pod (any bytes are valid), and the caller
        // guarantees the range is not written while the slice lives.
        unsafe { std::slice::from_raw_parts(p.cast::<T>(), count) }
    }

    /// `count` values of `T` starting at byte `offset`, writable. Panics if out of bounds or
    /// misaligned.
    ///
    /// # Safety
    /// For as long as the slice lives, nobody else (another thread, process or mapping, or
    /// another slice from this handle) may read or write the range.
    #[allow(clippy::mut_from_ref)] // exclusivity is the caller's documented obligation
    pub unsafe fn slice_mut<T: Pod>(&self, offset: usize, count: usize) -> &mut [T] {
        let p = self.checked_ptr::<T>(offset, count);
        // SAFETY: bounds/alignment checked, T is Pod, and the caller guarantees exclusive
        // access to the range while the slice lives.
        unsafe { std::slice::from_raw_parts_mut(p.cast::<T>(), count) }
    }

    fn checked_ptr<T>(&self, offset: usize, count: usize) -> *mut u8 {
        let size = std::mem::size_of::<T>().checked_mul(count);
        let end = size.and_then(|s| offset.checked_add(s));
        assert!(
            end.is_some_and(|end| end <= self.len),
            "segment {}: {count} x {} at offset {offset} is outside its {} bytes",
            self.name,
            std::any::type_name::<T>(),
            self.len
        );
        assert!(
            offset.is_multiple_of(std::mem::align_of::<T>()),
            "segment {}: offset {offset} is not aligned for {}",
            self.name,
            std::any::type_name::<T>()
        );
        // SAFETY: offset <= len (checked above), so the result is within or one past the map.
        unsafe { self.as_ptr().add(offset) }
    }
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("name", &self.name)
            .field("len", &self.len)
            .field("remove_on_drop", &self.remove_on_drop)
            .finish()
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.remove_on_drop {
            if let Err(e) = std::fs::remove_file(&self.path) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(path = %self.path.display(), "removing shared-memory segment: {e}");
                }
            }
        }
        // `map` unmaps when the fields drop, after the unlink: the memory lives until the
        // last mapping in any process goes.
    }
}

/// Why a segment could not be locked in RAM; the segment stays usable, unlocked.
#[derive(Debug, Clone)]
pub struct MemlockWarning {
    /// The segment's name.
    pub segment: String,
    /// The bytes the lock needed (the whole segment).
    pub needed_bytes: usize,
    /// RLIMIT_MEMLOCK's soft limit in bytes; `None` is unlimited.
    pub soft_limit_bytes: Option<u64>,
    /// RLIMIT_MEMLOCK's hard limit in bytes; `None` is unlimited.
    pub hard_limit_bytes: Option<u64>,
    /// What mlock said.
    pub error: String,
}

impl MemlockWarning {
    fn new(segment: &str, needed_bytes: usize, error: std::io::Error) -> MemlockWarning {
        let (soft, hard) = memlock_limit();
        MemlockWarning {
            segment: segment.to_string(),
            needed_bytes,
            soft_limit_bytes: soft,
            hard_limit_bytes: hard,
            error: error.to_string(),
        }
    }
}

impl std::fmt::Display for MemlockWarning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "mlock of shared-memory segment {} refused ({}): RLIMIT_MEMLOCK is {} (hard limit {}) \
             and locking this segment needs {} on top of what the process has locked already; continuing unlocked, so its pages may be swapped out. \
             Raise the limit with `ulimit -l`, LimitMEMLOCK= in the systemd unit, or memlock in \
             /etc/security/limits.conf",
            self.segment,
            self.error,
            fmt_limit(self.soft_limit_bytes),
            fmt_limit(self.hard_limit_bytes),
            fmt_bytes(self.needed_bytes as u64),
        )
    }
}

impl std::error::Error for MemlockWarning {}

/// RLIMIT_MEMLOCK (soft, hard) in bytes, `None` meaning unlimited.
fn memlock_limit() -> (Option<u64>, Option<u64>) {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: rl is a valid, writable rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) } != 0 {
        return (None, None);
    }
    let conv = |v: libc::rlim_t| (v != libc::RLIM_INFINITY).then_some(v);
    (conv(rl.rlim_cur), conv(rl.rlim_max))
}

fn fmt_limit(v: Option<u64>) -> String {
    v.map_or_else(|| "unlimited".to_string(), fmt_bytes)
}

fn fmt_bytes(v: u64) -> String {
    format!("{v} bytes ({:.1} MiB)", v as f64 / (1024.0 * 1024.0))
}

/// `/dev/shm/<name>` after checking the name: 1 to 255 bytes of `[A-Za-z0-9._-]`, not
/// starting with a dot (so never `.`, `..` or a path).
fn path_for(name: &str) -> Result<PathBuf, ShmError> {
    let bad = |reason| Err(ShmError::BadName { name: name.to_string(), reason });
    if name.is_empty() {
        return bad("empty");
    }
    if name.len() > NAME_MAX {
        return bad("longer than 255 bytes");
    }
    if name.contains('/') {
        return bad("contains '/'");
    }
    if name.starts_with('.') {
        return bad("starts with '.'");
    }
    if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.') {
        return bad("only ASCII letters, digits, '-', '_' and '.' are allowed");
    }
    Ok(Path::new(SHM_DIR).join(name))
}

/// Maps a segment's file, advised into huge pages: where `/dev/shm` is mounted with
/// `huge=advise` the arena then takes 2 MiB pages, and the K/V rows that decode attention
/// reads and every step stores miss the TLB far less (OLMoE batch 1 on the 2-core VM: the
/// stores 182–195 → 117–123 µs and the attention 991–1 055 → 865–931 µs a step). Elsewhere
/// the advice changes nothing.
fn map(file: &File, len: usize, path: &Path) -> Result<MmapRaw, ShmError> {
    let map = MmapOptions::new().len(len).map_raw(file).map_err(|e| ShmError::Io {
        op: "mapping",
        path: path.to_path_buf(),
        source: e,
    })?;
    if let Err(e) = map.advise(memmap2::Advice::HugePage) {
        tracing::debug!(segment = %path.display(), error = %e, "huge pages not advised");
    }
    Ok(map)
}

/// tmpfs files are sparse: a segment larger than the free space would map fine and then
/// SIGBUS on first touch, so refuse it up front with a clear error.
fn check_free_space(len: usize) -> Result<(), ShmError> {
    let dir = std::ffi::CString::new(SHM_DIR).expect("no NUL in SHM_DIR");
    // SAFETY: statvfs is plain data, so all-zero is a valid value to be overwritten.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: dir is NUL-terminated and st is a valid, writable statvfs.
    if unsafe { libc::statvfs(dir.as_ptr(), &mut st) } != 0 {
        return Ok(()); // no information: let the kernel decide
    }
    let free = (st.f_bavail as u64).saturating_mul(st.f_frsize as u64);
    if len as u64 > free {
        let free = usize::try_from(free).unwrap_or(usize::MAX);
        return Err(ShmError::TooSmall { what: format!("free space in {SHM_DIR}"), len: free, need: len });
    }
    Ok(())
}

fn classify(e: std::io::Error, op: &'static str, path: &Path) -> ShmError {
    use std::io::ErrorKind;
    let path = path.to_path_buf();
    match e.kind() {
        ErrorKind::AlreadyExists => ShmError::AlreadyExists { path },
        ErrorKind::NotFound => ShmError::NotFound { path },
        ErrorKind::PermissionDenied => {
            ShmError::Permission { path, reason: "not accessible by this user (segments are 0600)".into() }
        }
        _ if e.raw_os_error() == Some(libc::ELOOP) => {
            ShmError::Permission { path, reason: "is a symbolic link".into() }
        }
        _ => ShmError::Io { op, path, source: e },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn unique(tag: &str) -> String {
        static N: AtomicUsize = AtomicUsize::new(0);
        format!("duet-test-{}-{tag}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
    }

    #[test]
    fn second_handle_sees_the_same_bytes() {
        let name = unique("share");
        let a = Segment::create(&name, 8192).unwrap();
        let b = Segment::open(&name).unwrap();
        assert_eq!(b.len(), 8192);
        a.atomic_u64(4096).store(0xDEAD_BEEF_F00D, Ordering::Release);
        assert_eq!(b.atomic_u64(4096).load(Ordering::Acquire), 0xDEAD_BEEF_F00D);
        // SAFETY: this test is the only user of bytes 0..16 and the two slices do not overlap
        // in time.
        unsafe { a.slice_mut::<u32>(0, 4).copy_from_slice(&[1, 2, 3, 4]) };
        assert_eq!(unsafe { b.slice::<u32>(0, 4) }, &[1, 2, 3, 4]);
        assert_ne!(a.as_ptr(), b.as_ptr(), "two separate mappings");
    }

    #[test]
    fn created_0600_and_exclusive() {
        let name = unique("excl");
        let a = Segment::create(&name, 100).unwrap();
        let mode = std::fs::metadata(a.path()).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600);
        match Segment::create(&name, 100) {
            Err(ShmError::AlreadyExists { path }) => assert_eq!(path, a.path()),
            other => panic!("expected AlreadyExists, got {other:?}"),
        }
        // The refused second create must not have removed the first one's file.
        assert!(a.path().exists());
    }

    #[test]
    fn creator_removes_on_drop_unless_persisted_and_opener_never_does() {
        let name = unique("drop");
        let path = Segment::create(&name, 64).unwrap().path().to_path_buf();
        assert!(!path.exists());

        let mut kept = Segment::create(&name, 64).unwrap();
        kept.persist();
        drop(kept);
        assert!(path.exists());
        drop(Segment::open(&name).unwrap());
        assert!(path.exists(), "an opener never removes");
        assert!(Segment::remove(&name).unwrap());
        assert!(!Segment::remove(&name).unwrap());
    }

    #[test]
    fn missing_name_is_not_found() {
        assert!(matches!(Segment::open(&unique("none")), Err(ShmError::NotFound { .. })));
    }

    #[test]
    fn memlock_warning_names_the_limit_and_the_size() {
        let w = MemlockWarning::new("duet-x-kv-0", 64 << 20, std::io::Error::from_raw_os_error(libc::ENOMEM));
        let text = w.to_string();
        assert!(text.contains("RLIMIT_MEMLOCK") && text.contains("67108864 bytes (64.0 MiB)"), "{text}");
        assert!(text.contains("duet-x-kv-0"), "{text}");
    }
}
