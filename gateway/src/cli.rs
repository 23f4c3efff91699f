//! Command-line interface of duet-gateway: `serve` (the service) and `config` (its effective
//! configuration). The client commands are the `duet` binary's (crate duet-cli).

use std::path::PathBuf;

use std::ffi::OsString;
use std::net::SocketAddr;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use duet_proto::Address;

use crate::balancer::{Overlap, Policy};

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

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// TOML configuration file whose keys are these flags' names with `_` for `-`
    /// (flags and environment variables override it).
    #[arg(long, env = "DUET_CONFIG")]
    pub config: Option<PathBuf>,
    /// GGUF model file (the gateway reads its tokenizer and chat template; local workers load it).
    #[arg(long, env = "DUET_MODEL", default_value = duet_model::DEFAULT_MODEL_PATH)]
    pub model: PathBuf,
    /// A Jinja chat template file used instead of the model's own (e.g. a model's tool-use
    /// template, or one for a GGUF that has none).
    #[arg(long, env = "DUET_CHAT_TEMPLATE")]
    pub chat_template: Option<PathBuf>,
    /// Public gRPC address.
    #[arg(long, env = "DUET_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: Address,
    /// OpenAI-compatible HTTP address (/v1/completions, /v1/chat/completions, /v1/models,
    /// /health, /metrics).
    #[arg(long, env = "DUET_HTTP_LISTEN", default_value = "127.0.0.1:8000")]
    pub http_listen: SocketAddr,
    /// Require this bearer token on the HTTP /v1 endpoints and on gRPC Inference calls.
    #[arg(long, env = "DUET_API_KEY", hide_env_values = true, conflicts_with = "api_key_file")]
    pub api_key: Option<String>,
    /// Read the API key from the first line of this file.
    #[arg(long, env = "DUET_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// cpu-workers to spawn (default: one per NUMA node).
    #[arg(long, env = "DUET_CPU_WORKERS")]
    pub cpu_workers: Option<u32>,
    /// KV arena size of each spawned cpu-worker, e.g. 512M or 8G.
    #[arg(long, env = "DUET_KV_BYTES", default_value = "1G")]
    pub kv_bytes: String,
    /// Where decode attention runs: lp (the split that minimises the predicted step time,
    /// from measured costs), cpu (the cpu-workers holding the KV), gpu, or ratio:R (that
    /// fraction of each context on the gpu-worker). Changeable at run time (SetPolicy).
    #[arg(long, env = "DUET_POLICY", default_value = "lp")]
    pub policy: Policy,
    /// When a decode step runs as two interleaved sub-batches (the gpu-worker's linear
    /// layers for one while the cpu-workers attend the other): auto (when lp predicts it
    /// faster), always, never.
    #[arg(long, env = "DUET_OVERLAP", default_value = "auto")]
    pub overlap: Overlap,
    /// Tokens per step: decode tokens plus prompt chunks.
    #[arg(long, env = "DUET_MAX_STEP_TOKENS", default_value_t = 2048)]
    pub max_step_tokens: usize,
    /// Requests generating at once; more wait in line.
    #[arg(long, env = "DUET_MAX_RUNNING", default_value_t = 64)]
    pub max_running: usize,
    /// Seconds an HTTP client may take to send a request's head (or leave a keep-alive
    /// connection idle), and may let a request body stall, before the connection is closed.
    #[arg(long, env = "DUET_HTTP_TIMEOUT_SECS", default_value_t = 30, value_parser = clap::builder::RangedU64ValueParser::<u64>::new().range(1..))]
    pub http_timeout_secs: u64,
    /// Seconds a session may sit idle before it is closed and its KV freed.
    #[arg(long, env = "DUET_SESSION_IDLE_SECS", default_value_t = 600)]
    pub session_idle_secs: u64,
    /// This node's name, in the ids of its sessions (`key@node`), so that another node a
    /// balancer sends one of them to can say where it is (default: the host name).
    #[arg(long, env = "DUET_NODE_NAME", value_parser = parse_node_name)]
    pub node_name: Option<String>,
    /// Seconds between SIGTERM and closing the listeners: /health and gRPC health already
    /// report NOT_SERVING (draining) while requests are still served, so that a balancer's
    /// health checks or Kubernetes' endpoints see the drain before connections close.
    #[arg(long, env = "DUET_DRAIN_GRACE_SECS", default_value_t = 0)]
    pub drain_grace_secs: u64,
    /// Instance name in the shared-memory segment names (default: duet-<pid>).
    #[arg(long, env = "DUET_INSTANCE")]
    pub instance: Option<String>,
    /// Private directory for the worker sockets (default: $XDG_RUNTIME_DIR/duet-<instance>, else /tmp).
    #[arg(long, env = "DUET_RUNTIME_DIR")]
    pub runtime_dir: Option<PathBuf>,
    /// Threads of the spawned gpu-worker's CPU device (default: all cores).
    #[arg(long, env = "DUET_GPU_THREADS")]
    pub gpu_threads: Option<usize>,
    /// The spawned gpu-worker's device: auto (CUDA where usable, else the CPU, saying why),
    /// cpu, or cuda (fails if it cannot be used). The gpu-worker's own `--device` values.
    #[arg(long, env = "DUET_DEVICE", default_value = "auto", value_parser = ["auto", "cpu", "cuda"], conflicts_with = "gpu_worker")]
    pub device: String,
    /// Connect to this running gpu-worker instead of spawning workers (with --cpu-worker).
    #[arg(long, env = "DUET_GPU_WORKER", requires = "cpu_worker")]
    pub gpu_worker: Option<Address>,
    /// A running cpu-worker's address, in worker order (repeat the flag; with --gpu-worker).
    #[arg(long = "cpu-worker", env = "DUET_CPU_WORKER_ADDRS", value_delimiter = ',', requires = "gpu_worker")]
    pub cpu_worker: Vec<Address>,
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

/// A node name: 1 to 64 letters, digits, `.`, `_` or `-`.
pub fn parse_node_name(s: &str) -> Result<String, String> {
    if s.is_empty() || s.len() > 64 || !s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) {
        return Err(format!("a node name is 1 to 64 letters, digits, '.', '_' or '-', got {s:?}"));
    }
    Ok(s.to_string())
}

/// The host name as a node name (characters a node name cannot hold become `-`).
pub fn host_node_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let name: String = host.trim().chars().take(64).map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c } else { '-' }).collect();
    if name.is_empty() { "duet".into() } else { name }
}
