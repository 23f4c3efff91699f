//! duet-gpu-worker binary: parse flags, start tracing, run the command.

use std::io::IsTerminal;

use clap::Parser;

fn main() -> anyhow::Result<()> {
    // Before any other thread: the forward passes' buffers are reused, not faulted in anew.
    let heap_set = duet_kernels::heap::keep_freed_memory();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    tracing::debug!(heap_set, "heap thresholds for reused buffers");
    duet_gpu_worker::cli::run(duet_gpu_worker::cli::Cli::parse())
}
