//! Command-line interface of duet-gateway: `serve` (the service) and `config` (its effective
//! configuration). The client commands are the `duet` binary's (crate duet-cli).

use std::ffi::OsString;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::serve::ServeArgs;

#[derive(Debug, Parser)]
#[command(name = "duet-gateway", version, about = "Duet's gateway: the public API, the scheduler and the worker supervisor")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the service: spawn the workers (or connect to given ones) and serve gRPC.
    Serve(ServeArgs),
    /// Show the effective `serve` configuration (flags, environment, config file, defaults).
    Config(ConfigArgs),
}

#[derive(Debug, Args)]
pub struct ConfigArgs {
    /// Print the effective configuration as TOML (usable as a --config file).
    #[arg(long)]
    pub print: bool,
    #[command(flatten)]
    pub serve: ServeArgs,
}


/// Parses `argv` (with the config file's values, see [`crate::config`]) and runs the command.
pub fn run(argv: Vec<OsString>) -> anyhow::Result<()> {
    let cmd = Cli::command();
    let argv = crate::config::apply(&cmd, argv).map_err(anyhow::Error::msg)?;
    let matches = cmd.clone().get_matches_from(argv);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    match cli.command {
        Command::Serve(args) => rt.block_on(crate::serve::serve(args)),
        Command::Config(args) => {
            let (name, sub) = matches.subcommand().expect("a subcommand was parsed");
            let text = crate::config::render(cmd.find_subcommand(name).expect("parsed from it"), sub);
            if args.print {
                print!("{text}");
            } else {
                eprintln!("duet-gateway config: pass --print to show the effective configuration");
            }
            Ok(())
        }
    }
}
