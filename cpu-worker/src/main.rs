//! duet-cpu-worker binary: parse flags, start tracing, stop on SIGTERM or Ctrl-C (or when the
//! gateway that started it exits), run.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::Parser;

/// Set by the signal handler; the job loop checks it at least every 100 ms.
static SHUTDOWN: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_signal: libc::c_int) {
    // Async-signal-safe: one atomic store.
    SHUTDOWN.store(true, Ordering::SeqCst);
}

fn main() -> anyhow::Result<()> {
    // Before any other thread: the forward passes' buffers are reused, not faulted in anew.
    let heap_set = duet_kernels::heap::keep_freed_memory();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    tracing::debug!(heap_set, "heap thresholds for reused buffers");
    let args = duet_cpu_worker::cli::Args::parse();
    let parent = args.parent_pid;
    let config = args.into_config()?;
    for signal in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        if unsafe { libc::signal(signal, on_signal as *const () as libc::sighandler_t) } == libc::SIG_ERR {
            anyhow::bail!("installing the handler of signal {signal}: {}", std::io::Error::last_os_error());
        }
    }
    if let Some(pid) = parent {
        duet_proto::lifeline::stop_with_parent(pid)?;
    }
    duet_cpu_worker::run(config, &SHUTDOWN)?;
    Ok(())
}
