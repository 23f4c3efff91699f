//! duet-cli: the `duet` command, Duet's client tools apart from the service: `generate` and
//! `chat` against a running gateway, `bench` (load from a client's side) and `simulate` (the
//! balancer's cost model replayed for machines we do not have).

pub mod args;
pub mod bench;
pub mod client;
pub mod simulator;

use std::ffi::OsString;

use clap::Parser;

use args::{Cli, Command};

/// Parses `argv` and runs the command.
pub fn run(argv: Vec<OsString>) -> anyhow::Result<()> {
    let cli = Cli::parse_from(argv);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    match cli.command {
        Command::Generate(args) => rt.block_on(client::generate(args)),
        Command::Chat(args) => rt.block_on(client::chat(args)),
        Command::Bench(args) => rt.block_on(bench::run(args)),
        Command::Simulate(args) => simulator::run(args),
    }
}
