//! Segments a dead worker of this name left behind: the owner lock on the arena file
//! (`duet_kv::shm::owner`, held for the whole life of the worker that created it) tells them
//! apart from a live worker's, and `--replace` removes them.

use std::path::{Path, PathBuf};

use duet_kv::shm::owner::{self, Holder, OwnerLock};
use duet_kv::shm::{Segment, SHM_DIR};

use crate::CpuWorkerError;

/// Takes the owner lock on the arena segment this process has just created at `path`,
/// held until the worker exits (after its segment was removed, see `Arena`).
pub fn lock_owner(path: &Path) -> Result<OwnerLock, CpuWorkerError> {
    match owner::lock_owner(path) {
        Ok(Some(lock)) => Ok(lock),
        // Another worker of the same name locked it between our creating and locking it.
        Ok(None) => Err(CpuWorkerError::SegmentInUse { path: path.to_path_buf() }),
        Err(source) => Err(CpuWorkerError::OwnerLock { path: path.to_path_buf(), source }),
    }
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
    let arena_found = owner::probe(&arena_path).map_err(|source| CpuWorkerError::OwnerLock { path: arena_path.clone(), source })?;
    if arena_found == Holder::Live {
        return Err(CpuWorkerError::SegmentInUse { path: arena_path });
    }
    let kept = keep_arena && arena_found == Holder::Nobody;
    let mut leftovers: Vec<(&str, PathBuf)> = Vec::new();
    if arena_found != Holder::Nothing && !kept {
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
