//! A worker that a gateway started stops when that gateway dies, however it died: SIGKILL
//! and the OOM killer run no clean-up, so the gateway cannot stop its workers itself. The
//! worker is told its parent's pid (`--parent-pid`) and watches for being re-parented; then
//! it sends itself SIGTERM, so it stops the way SIGTERM always stops it (the cpu-worker
//! removing its shared-memory segments on the way out).

use std::time::Duration;

/// How often the watch looks at the parent: a dead gateway's workers are gone within this.
pub const WATCH_INTERVAL: Duration = Duration::from_millis(200);

/// Why a worker cannot watch its parent.
#[derive(Debug, thiserror::Error)]
pub enum LifelineError {
    #[error("--parent-pid {expected}: this process's parent is {actual} (the process that started it has already exited)")]
    ParentGone { expected: u32, actual: u32 },
    #[error("starting the thread that watches the parent process: {0}")]
    Thread(#[from] std::io::Error),
}

/// Checks that `parent` is this process's parent, then watches on a thread of its own and
/// raises SIGTERM in this process once it is not (install the SIGTERM handling first).
pub fn stop_with_parent(parent: u32) -> Result<(), LifelineError> {
    let actual = parent_pid();
    if actual != parent {
        return Err(LifelineError::ParentGone { expected: parent, actual });
    }
    std::thread::Builder::new().name("parent-watch".into()).spawn(move || {
        while parent_pid() == parent {
            std::thread::sleep(WATCH_INTERVAL);
        }
        tracing::warn!(parent, "the process that started this worker exited: stopping as on SIGTERM");
        // SAFETY: kill only sends a signal, to this process.
        unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
    })?;
    Ok(())
}

fn parent_pid() -> u32 {
    // SAFETY: getppid has no preconditions and cannot fail.
    unsafe { libc::getppid() as u32 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wrong_parent_is_refused_at_once() {
        let e = stop_with_parent(parent_pid().wrapping_add(1)).unwrap_err();
        assert!(matches!(e, LifelineError::ParentGone { .. }), "{e}");
        assert!(e.to_string().contains("already exited"), "{e}");
    }
}
