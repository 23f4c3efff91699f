//! Who owns an instance's segments. A cpu-worker's segments are named after its instance
//! and number ([`arena_name`], [`ring_name`]), and the worker holds an exclusive `flock` on
//! its arena file for its whole life ([`lock_owner`]). The kernel drops the lock when its
//! holder exits, SIGKILL included, so an arena nobody locks ([`probe`]) is a dead worker's:
//! what a new worker of the same name (`--replace`) or a gateway's start-up sweep may remove.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Name of worker `worker`'s KV arena segment in instance `instance`.
pub fn arena_name(instance: &str, worker: u32) -> String {
    format!("duet-{instance}-kv-{worker}")
}

/// Name of worker `worker`'s exchange-ring segment in instance `instance`.
pub fn ring_name(instance: &str, worker: u32) -> String {
    format!("duet-{instance}-xchg-{worker}")
}

/// Which of a worker's segments a name is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentKind {
    Arena,
    Ring,
}

/// The instance, worker and kind a segment name ([`arena_name`], [`ring_name`]) stands for;
/// `None` for any other name.
pub fn parse_segment_name(name: &str) -> Option<(&str, u32, SegmentKind)> {
    let rest = name.strip_prefix("duet-")?;
    let (head, worker) = rest.rsplit_once('-')?;
    let worker: u32 = worker.parse().ok().filter(|_| worker.bytes().all(|b| b.is_ascii_digit()))?;
    let (instance, kind) = match (head.strip_suffix("-kv"), head.strip_suffix("-xchg")) {
        (Some(i), _) => (i, SegmentKind::Arena),
        (_, Some(i)) => (i, SegmentKind::Ring),
        _ => return None,
    };
    (!instance.is_empty()).then_some((instance, worker, kind))
}

/// The owner lock on a worker's arena file; released when this drops.
#[derive(Debug)]
pub struct OwnerLock {
    _file: File,
}

/// Takes the owner lock on the segment file at `path`: `Ok(None)` when another open file
/// holds it.
pub fn lock_owner(path: &Path) -> io::Result<Option<OwnerLock>> {
    let file = open_no_follow(path)?;
    Ok(try_lock(&file)?.then_some(OwnerLock { _file: file }))
}

/// What is at a segment's path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    Nothing,
    /// A file nobody holds the owner lock on (or one not ours to open: no worker of this
    /// user serves from it).
    Nobody,
    /// A file a running worker holds the owner lock on.
    Live,
}

/// Who holds the segment file at `path`.
pub fn probe(path: &Path) -> io::Result<Holder> {
    let file = match open_no_follow(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Holder::Nothing),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM | libc::ELOOP)) => return Ok(Holder::Nobody),
        Err(e) => return Err(e),
    };
    // Our probe's lock, if taken, is released when `file` closes at the end of this call.
    Ok(if try_lock(&file)? { Holder::Nobody } else { Holder::Live })
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
    use crate::shm::{Segment, SHM_DIR};

    #[test]
    fn segment_names_round_trip_and_others_are_not_ours() {
        for (instance, worker) in [("duet-1234", 0), ("t9-2", 17), ("a-kv-3", 1)] {
            assert_eq!(parse_segment_name(&arena_name(instance, worker)), Some((instance, worker, SegmentKind::Arena)));
            assert_eq!(parse_segment_name(&ring_name(instance, worker)), Some((instance, worker, SegmentKind::Ring)));
        }
        for other in ["duet-kv-0", "duet-x-kv-", "duet-x-kv-+1", "duet-x-kv-1a", "other-x-kv-0", "duet-x-arena-0", "duet--xchg-0"] {
            assert_eq!(parse_segment_name(other), None, "{other}");
        }
    }

    #[test]
    fn a_lock_tells_a_live_owner_from_a_dead_one() {
        let name = format!("duet-owner-unit-{}", std::process::id());
        let path = Path::new(SHM_DIR).join(&name);
        assert_eq!(probe(&path).unwrap(), Holder::Nothing);
        let mut seg = Segment::create(&name, 4096).unwrap();
        let lock = lock_owner(seg.path()).unwrap().expect("nobody else holds it");
        assert_eq!(probe(&path).unwrap(), Holder::Live);
        assert!(lock_owner(&path).unwrap().is_none(), "a second owner is refused");
        drop(lock);
        assert_eq!(probe(&path).unwrap(), Holder::Nobody);
        seg.persist();
        drop(seg);
        assert!(Segment::remove(&name).unwrap());
    }
}
