//! The data plane's shared-memory primitives: named segments in `/dev/shm`, cross-process
//! futexes, the single-producer/single-consumer exchange ring built on them, and the
//! attention job format carried in its slots ([`job`]), and who owns a worker's segments
//! ([`owner`]).
//!
//! Memory rules for everything in here: a segment is shared with other processes, which
//! Rust's borrow checker cannot see. Only atomics and plain-old-data ([`Pod`]) are ever
//! accessed through it, and non-atomic bytes are touched only by the side that currently
//! owns them under a protocol whose hand-overs are Release/Acquire atomics (the ring's
//! sequence numbers).

pub mod expert_job;
mod futex;
pub mod job;
pub mod owner;
mod ring;
mod segment;

pub use futex::{futex_wait, futex_wake, FutexWait};
pub use ring::{Consumer, Producer, Ring, Waiter, RING_MAGIC, RING_VERSION};
pub use segment::{MemlockWarning, Pod, Segment, SHM_DIR};

use std::path::PathBuf;

/// Errors of the shared-memory layer, one variant per way it fails.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error("shared-memory segment {path} already exists (another instance with this name is running, or a stale segment was left behind: remove it)")]
    AlreadyExists { path: PathBuf },
    #[error("shared-memory segment {path} not found")]
    NotFound { path: PathBuf },
    #[error("permission denied on shared-memory segment {path}: {reason}")]
    Permission { path: PathBuf, reason: String },
    #[error("bad shared-memory segment name {name:?}: {reason}")]
    BadName { name: String, reason: &'static str },
    #[error("{what} is {len} bytes, too small: needs at least {need}")]
    TooSmall { what: String, len: usize, need: usize },
    #[error("{op} {path}: {source}")]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },
    #[error("exchange ring in {name}: {reason}")]
    BadLayout { name: String, reason: String },
    #[error("exchange ring in {name} was closed")]
    Closed { name: String },
    #[error("exchange ring in {name}: timed out after {waited_us} µs waiting for {what}")]
    TimedOut { name: String, what: &'static str, waited_us: u128 },
}
