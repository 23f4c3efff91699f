//! Segments a dead worker left behind: an exclusive `flock` on the arena file, held for the
//! whole life of the worker that created it, tells them apart from a live worker's, and
//! `--replace` removes them. The kernel drops the lock when its holder exits, SIGKILL
//! included, so a lock that is free means nobody serves from those segments any more.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use duet_kv::shm::{Segment, SHM_DIR};

use crate::CpuWorkerError;

/// The owner lock on a worker's arena file; released when this drops (after the segment
/// was removed, see `Arena`).
#[derive(Debug)]
pub struct OwnerLock {
    _file: File,
}

/// Takes the owner lock on the arena segment this process has just created at `path`.
pub fn lock_owner(path: &Path) -> Result<OwnerLock, CpuWorkerError> {
    let lock_err = |source| CpuWorkerError::OwnerLock { path: path.to_path_buf(), source };
    let file = open_no_follow(path).map_err(lock_err)?;
    match try_lock(&file) {
        Ok(true) => Ok(OwnerLock { _file: file }),
        // Another worker of the same name locked it between our creating and locking it.
        Ok(false) => Err(CpuWorkerError::SegmentInUse { path: path.to_path_buf() }),
        Err(e) => Err(lock_err(e)),
    }
}

/// What is at a segment's name before this worker creates it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Found {
    Nothing,
    /// A file nobody holds the owner lock on.
    Stale,
    /// A file a running worker holds the owner lock on.
    Live,
}

/// Makes sure the worker can create `ring`, and `arena` unless it is kept. A live worker's
/// arena is always an error (`SegmentInUse`). With `keep_arena`, a dead worker's arena stays
/// (`Ok(true)`: the caller re-attaches to it or removes it) and its ring is removed; otherwise
/// a dead worker's leftovers are removed when `replace` is set, with a warning naming each,
/// and are a `StaleSegment` error suggesting `--replace` when not. The ring has no lock of its
/// own: it goes with the arena's owner.
pub fn clear_leftovers(arena: &str, ring: &str, replace: bool, keep_arena: bool) -> Result<bool, CpuWorkerError> {
    let arena_path = Path::new(SHM_DIR).join(arena);
    let ring_path = Path::new(SHM_DIR).join(ring);
    let arena_found = probe(&arena_path)?;
    if arena_found == Found::Live {
        return Err(CpuWorkerError::SegmentInUse { path: arena_path });
    }
    let kept = keep_arena && arena_found == Found::Stale;
    let mut leftovers: Vec<(&str, PathBuf)> = Vec::new();
    if arena_found != Found::Nothing && !kept {
        leftovers.push((arena, arena_path));
    }
    if exists(&ring_path) {
        leftovers.push((ring, ring_path));
    }
    if let Some((_, path)) = leftovers.first().filter(|_| !replace && !keep_arena) {
        return Err(CpuWorkerError::StaleSegment { path: path.clone() });
    }
    let flag = if replace { "--replace" } else { "--reattach" };
    for (name, path) in leftovers {
        if Segment::remove(name)? {
            tracing::warn!(
                segment = %path.display(),
                "{flag}: removed a segment that a previous cpu-worker of this name left behind (no running worker holds it)"
            );
        }
    }
    Ok(kept)
}

/// Whether `path` exists (a dangling link counts: creating over it fails too).
fn exists(path: &Path) -> bool {
    path.symlink_metadata().is_ok()
}

/// What is at `path`: nothing, a file nobody holds the owner lock on, or a live worker's.
fn probe(path: &Path) -> Result<Found, CpuWorkerError> {
    let file = match open_no_follow(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Found::Nothing),
        // Not ours to open (another user's file, or a link): no worker of this user serves
        // from it, and removing it is up to `--replace` (which may fail in turn).
        Err(e) if matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM | libc::ELOOP)) => {
            return Ok(Found::Stale)
        }
        Err(e) => return Err(CpuWorkerError::OwnerLock { path: path.to_path_buf(), source: e }),
    };
    // Our probe's lock, if taken, is released when `file` closes at the end of this call.
    match try_lock(&file) {
        Ok(true) => Ok(Found::Stale),
        Ok(false) => Ok(Found::Live),
        Err(e) => Err(CpuWorkerError::OwnerLock { path: path.to_path_buf(), source: e }),
    }
}

fn open_no_follow(path: &Path) -> io::Result<File> {
    OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(path)
}

/// `flock(LOCK_EX | LOCK_NB)`: `Ok(false)` when another open file holds a lock.
fn try_lock(file: &File) -> io::Result<bool> {
    // SAFETY: flock only takes a lock on the open file; the fd is valid while `file` lives.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        return Ok(false);
    }
    Err(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(tag: &str) -> String {
        format!("duet-stale-unit-{}-{tag}", std::process::id())
    }

    #[test]
    fn leftovers_are_told_from_live_segments() {
        let (arena, ring) = (name("kv"), name("xchg"));
        assert!(clear_leftovers(&arena, &ring, false, false).is_ok(), "nothing there");

        // A live owner: refused with or without --replace, and left alone.
        let seg = Segment::create(&arena, 4096).unwrap();
        let lock = lock_owner(seg.path()).unwrap();
        for replace in [false, true] {
            let e = clear_leftovers(&arena, &ring, replace, false).unwrap_err();
            assert!(matches!(e, CpuWorkerError::SegmentInUse { .. }), "{e}");
        }
        assert!(seg.path().exists());
        assert!(matches!(lock_owner(seg.path()), Err(CpuWorkerError::SegmentInUse { .. })));

        // The owner is gone but the files stay (as after SIGKILL).
        drop(lock);
        let mut seg = seg;
        seg.persist();
        drop(seg);
        let mut ring_seg = Segment::create(&ring, 4096).unwrap();
        ring_seg.persist();
        drop(ring_seg);
        let e = clear_leftovers(&arena, &ring, false, false).unwrap_err();
        assert!(matches!(e, CpuWorkerError::StaleSegment { .. }) && e.to_string().contains("--replace"), "{e}");
        clear_leftovers(&arena, &ring, true, false).unwrap();
        for n in [&arena, &ring] {
            assert!(!Path::new(SHM_DIR).join(n).exists(), "{n} was not removed");
        }

        // A ring alone (its worker died while removing its segments) is a leftover too.
        let mut ring_seg = Segment::create(&ring, 4096).unwrap();
        ring_seg.persist();
        drop(ring_seg);
        assert!(matches!(clear_leftovers(&arena, &ring, false, false), Err(CpuWorkerError::StaleSegment { .. })));
        clear_leftovers(&arena, &ring, true, false).unwrap();
        assert!(!Path::new(SHM_DIR).join(&ring).exists());
    }
}
