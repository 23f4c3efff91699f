//! `duet-gateway serve` and its flags: brings the service up (local workers or given ones),
//! serves the public API on the listeners it is given ([`run`]; tests bind port 0), and when
//! told to stop (SIGTERM or Ctrl-C for [`serve`]) drains the running streams, stops the
//! workers and removes their sockets and segments.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;

use duet_model::chat::ChatTemplate;
use duet_model::gguf::GgufFile;
use duet_model::grammar::Grammars;
use duet_model::tokenizer::Tokenizer;
use duet_proto::{pb, Address, Listener};
use tokio::sync::{oneshot, watch};

use crate::api::auth::ApiKey;
use crate::backend::SchedulerBackend;
use crate::balancer::{Overlap, Policy};
use crate::readiness::{Phase, Readiness};
use crate::request::TextModel;
use crate::scheduler::{self, Command, SchedulerConfig};
use crate::supervisor::{self, LocalWorkers};

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
    /// KV cache type of the spawned cpu-workers: f16, or q8_0 (ggml's 8-bit blocks: about
    /// 1.9 times the tokens in the same --kv-bytes, and half the bytes attention reads).
    #[arg(long, env = "DUET_KV_TYPE", default_value = "f16", value_parser = duet_kv::parse_kv_type)]
    pub kv_type: duet_kv::KvDtype,
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
    /// Only the first N layers on the spawned gpu-worker's device, the rest on its CPU device
    /// (llama.cpp's `-ngl`), for dense models larger than the GPU; `auto`: as many as the
    /// GPU's memory holds (default: all on the device).
    #[arg(long, env = "DUET_GPU_LAYERS", conflicts_with = "gpu_worker", value_parser = parse_gpu_layers)]
    pub gpu_layers: Option<String>,
    /// GPU memory the spawned gpu-worker's CUDA device may use, e.g. 16G (default: all that
    /// is free).
    #[arg(long, env = "DUET_GPU_MEM_BYTES", conflicts_with = "gpu_worker", value_parser = duet_kv::parse_bytes)]
    pub gpu_mem_bytes: Option<usize>,
    /// GPU memory for the CUDA device's KV mirror, on which its share of attention runs
    /// (default: what the weights leave of --gpu-mem-bytes, less 768 MiB; 0: attention on
    /// the host's cores). The balancer gives the GPU no more positions than it holds.
    #[arg(long, env = "DUET_GPU_KV_BYTES", conflicts_with = "gpu_worker", value_parser = duet_kv::parse_bytes)]
    pub gpu_kv_bytes: Option<usize>,
    /// Where a mixture-of-experts model's routed experts run: on the gpu-worker's device, or
    /// on the cpu-workers (each serving its share as expert jobs; KTransformers' split, for
    /// models whose experts do not fit the GPU).
    #[arg(long, env = "DUET_EXPERTS_ON", default_value = "device", value_parser = ["device", "cpu-workers"], conflicts_with = "gpu_worker")]
    pub experts_on: String,
    /// With --experts-on cpu-workers: the gpu-worker's device also computes this many experts
    /// of each layer, the ones the router chose most (re-planned every 64 steps); 0: none.
    #[arg(long, env = "DUET_DEVICE_EXPERTS", default_value_t = 0, conflicts_with = "gpu_worker")]
    pub device_experts: usize,
    /// Benchmarks only: the spawned gpu-worker computes only the last token of each prompt
    /// chunk and makes up the others' K/V (its `--synthetic-prefill`), so that decode at
    /// depths of 32K can be timed without prefilling them (`duet bench --context`). Decode
    /// timings are real; prefill timings and all text are noise.
    #[arg(long, env = "DUET_SYNTHETIC_PREFILL", conflicts_with = "gpu_worker")]
    pub synthetic_prefill: bool,
    /// Compute every request's prompt in full: without it a request starts from the KV
    /// cached from earlier ones whose prompts began the same way (whole KV blocks;
    /// `usage.prompt_tokens_details.cached_tokens` says how many), and a finished request's
    /// blocks keep their KV until the space is needed.
    #[arg(long, env = "DUET_NO_PREFIX_CACHE")]
    pub no_prefix_cache: bool,
    /// Connect to this running gpu-worker instead of spawning workers (with --cpu-worker).
    #[arg(long, env = "DUET_GPU_WORKER", requires = "cpu_worker")]
    pub gpu_worker: Option<Address>,
    /// A running cpu-worker's address, in worker order (repeat the flag; with --gpu-worker).
    #[arg(long = "cpu-worker", env = "DUET_CPU_WORKER_ADDRS", value_delimiter = ',', requires = "gpu_worker")]
    pub cpu_worker: Vec<Address>,
}

/// The longest a drain waits for running streams at shutdown.
const DRAIN_DEADLINE: Duration = Duration::from_secs(30);

/// The tokenizer (a `tokenizer.json` beside the model wins over the GGUF's own) and the
/// chat template (the file `chat_template` if given, else the GGUF's own).
pub fn load_text_model(path: &std::path::Path, chat_template: Option<&std::path::Path>) -> anyhow::Result<TextModel> {
    let file = GgufFile::open(path).map_err(|e| anyhow::anyhow!("opening {}: {e}", path.display()))?;
    let tokenizer = match path.parent().map(|d| d.join("tokenizer.json")).filter(|p| p.exists()) {
        Some(json) => Tokenizer::from_file(&json)?,
        None => Tokenizer::from_gguf(&file)?,
    };
    let chat_template = match chat_template {
        Some(t) => {
            let source = std::fs::read_to_string(t).map_err(|e| anyhow::anyhow!("reading the chat template {}: {e}", t.display()))?;
            Some(ChatTemplate::with_gguf_tokens(&source, &file).map_err(|e| anyhow::anyhow!("the chat template {}: {e}", t.display()))?)
        }
        None => ChatTemplate::from_gguf(&file).inspect_err(|e| tracing::warn!("no usable chat template: {e}")).ok(),
    };
    let grammars = Grammars::new(&tokenizer).inspect_err(|e| tracing::warn!("no structured output: {e}")).ok();
    Ok(TextModel { tokenizer, chat_template, grammars })
}

/// The public API's listeners: gRPC and OpenAI HTTP.
pub struct Listeners {
    pub grpc: Listener,
    pub http: tokio::net::TcpListener,
}

impl Listeners {
    /// Binds the addresses of `--listen` and `--http-listen`.
    pub async fn bind(args: &ServeArgs) -> anyhow::Result<Listeners> {
        let grpc = Listener::bind(&args.listen).await.map_err(|e| anyhow::anyhow!("listening on {}: {e}", args.listen))?;
        let http = tokio::net::TcpListener::bind(args.http_listen).await.map_err(|e| anyhow::anyhow!("listening on {} (HTTP): {e}", args.http_listen))?;
        Ok(Listeners { grpc, http })
    }
}

/// `duet-gateway serve`: binds the flags' addresses and runs until SIGTERM or Ctrl-C (one
/// while the workers start stops them and exits).
pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    // Watched from here on: a signal's default action would kill the gateway and leave the
    // workers it spawned running.
    let shutdown = shutdown_signal();
    let listeners = Listeners::bind(&args).await?;
    run(args, listeners, shutdown).await
}

/// Runs the service on `listeners` until `shutdown` resolves, then drains (health says
/// "draining" at once; after `--drain-grace-secs` the listeners close and the requests taken
/// in finish) and stops the workers it started. `shutdown` resolving while the workers
/// start stops them and returns.
pub async fn run(args: ServeArgs, listeners: Listeners, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
    if args.device_experts > 0 && args.experts_on != "cpu-workers" {
        anyhow::bail!("--device-experts {} needs --experts-on cpu-workers (with the experts on the device it holds them all)", args.device_experts);
    }
    let api_key = match (&args.api_key, &args.api_key_file) {
        (Some(k), _) => Some(ApiKey::new(k).map_err(anyhow::Error::msg)?),
        (None, Some(path)) => Some(ApiKey::from_file(path).map_err(anyhow::Error::msg)?),
        (None, None) => None,
    };
    let metrics = crate::metrics::install();
    let text = Arc::new(load_text_model(&args.model, args.chat_template.as_deref())?);
    let readiness = Readiness::new(&args.node_name.clone().unwrap_or_else(host_node_name));
    let (commands, commands_rx) = scheduler::commands();
    let backend: Arc<dyn crate::backend::Backend> = Arc::new(SchedulerBackend::new(commands.clone(), text.clone(), readiness.clone()));

    // The front ends first, answering health with "loading" (and requests with 503) while
    // the workers start; they stop taking connections when `closing` is set.
    let Listeners { grpc: listener, http: http_listener } = listeners;
    let addr = listener.local_address()?;
    let http_addr = http_listener.local_addr()?;
    let (closing_tx, closing_rx) = watch::channel(false);
    let closing = move || {
        let mut rx = closing_rx.clone();
        async move {
            let _ = rx.wait_for(|&c| c).await;
        }
    };
    // The HTTP API names the model by its file (what users pass as `model`).
    let model_id = args.model.file_stem().map_or_else(|| "model".to_string(), |s| s.to_string_lossy().into_owned());
    let app = crate::api::http::router(backend.clone(), model_id, api_key.clone(), metrics);
    let http = tokio::spawn(crate::api::http_server::serve(http_listener, app, Duration::from_secs(args.http_timeout_secs), closing()));
    let grpc = tokio::spawn(crate::api::grpc::serve(backend.clone(), listener, api_key.clone(), closing()));

    let (stop_tx, stop_rx) = watch::channel(false);
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = shutdown_tx.send(true);
    });
    let stopped_while_starting = || {
        let mut rx = shutdown_rx.clone();
        async move {
            let _ = rx.wait_for(|&s| s).await;
            anyhow::anyhow!("stopped by a signal while the workers were starting")
        }
    };
    let local = args.gpu_worker.is_none();
    let instance = args.instance.clone().unwrap_or_else(|| crate::leftovers::default_instance(std::process::id()));
    let mut keeper = None;
    let connected = if let Some(gpu) = &args.gpu_worker {
        tokio::select! {
            c = supervisor::connect(gpu, &args.cpu_worker, None, false) => c,
            e = stopped_while_starting() => Err(e),
        }
    } else {
        // Before this instance's workers create theirs: each removal is logged.
        crate::leftovers::sweep_dead_instances();
        let n = args.cpu_workers.unwrap_or_else(|| supervisor::cpu_nodes() as u32).max(1);
        let cfg = LocalWorkers {
            model: args.model.clone(),
            cpu_workers: n,
            kv_bytes: args.kv_bytes.clone(),
            kv_type: args.kv_type,
            runtime_dir: args.runtime_dir.clone().unwrap_or_else(|| supervisor::default_runtime_dir(&instance)),
            instance: instance.clone(),
            gpu_threads: args.gpu_threads,
            device: args.device.clone(),
            gpu_layers: args.gpu_layers.clone(),
            gpu_mem_bytes: args.gpu_mem_bytes,
            gpu_kv_bytes: args.gpu_kv_bytes,
            max_running: args.max_running.max(1),
            experts_on_cpu_workers: args.experts_on == "cpu-workers",
            device_experts: args.device_experts,
            synthetic_prefill: args.synthetic_prefill,
        };
        tracing::info!(instance = %cfg.instance, runtime_dir = %cfg.runtime_dir.display(), cpu_workers = n, "starting local workers");
        match supervisor::spawn_local(&cfg) {
            Ok(mut children) => {
                let (gpu_addr, cpu_addrs): (_, Vec<_>) = (cfg.gpu_address(), (0..n).map(|w| cfg.cpu_address(w)).collect());
                let connected = tokio::select! {
                    c = supervisor::connect(&gpu_addr, &cpu_addrs, Some(&mut children), true) => c,
                    e = stopped_while_starting() => Err(e),
                };
                let dir = cfg.runtime_dir.clone();
                keeper = Some(supervisor::keep_running(cfg, children, stop_rx.clone()));
                if connected.is_err() {
                    let _ = stop_tx.send(true);
                    if let Some(k) = keeper.take() {
                        let _ = k.await;
                    }
                    let _ = std::fs::remove_dir_all(dir);
                }
                connected
            }
            Err(e) => Err(e),
        }
    };
    let cfg = match connected.and_then(|w| scheduler_config(&args, &w, &readiness, &text, local).map(|cfg| (w, cfg))) {
        Ok(x) => x,
        Err(e) => {
            let _ = stop_tx.send(true);
            if let Some(k) = keeper {
                let _ = k.await;
            }
            let _ = closing_tx.send(true);
            let _ = tokio::join!(http, grpc);
            if *shutdown_rx.borrow() {
                tracing::info!("duet-gateway stopped while starting: the workers it started are stopped");
                return Ok(());
            }
            return Err(e);
        }
    };
    let (workers, cfg) = cfg;
    let scheduler_task = scheduler::spawn(commands_rx, cfg.clone(), text, Arc::new(workers.gpu.clone()));
    let watcher = supervisor::watch(workers, local, commands.clone(), stop_rx.clone());
    readiness.set(Phase::Serving);
    readiness.wait_reported(Phase::Serving, Duration::from_secs(5)).await;
    tracing::info!(
        %addr,
        model = %cfg.model_name,
        device = %cfg.gpu_device,
        cpu_workers = cfg.blocks_per_worker.len(),
        // The KV the system holds (the cpu-workers' arenas) against what the GPU alone
        // attends (its mirror; 0 without one): the most batch × context each serves.
        kv_tokens = cfg.blocks_per_worker.iter().map(|&b| b as usize).sum::<usize>() * cfg.block_size,
        gpu_kv_tokens = cfg.gpu_kv_positions,
        policy = %cfg.policy,
        %http_addr,
        node = %cfg.node_name,
        api_key = api_key.is_some(),
        "duet-gateway serving"
    );
    if cfg.synthetic_prefill {
        tracing::warn!("the gpu-worker's prefill is synthetic (benchmarks only): prompts' K/V are made up, every text is noise");
    }
    // Tests and scripts read the addresses from these lines on stdout (printed once serving).
    println!("duet-gateway http listening on {http_addr}");
    println!("duet-gateway listening on {addr}");
    // On SIGTERM or Ctrl-C: health says "draining" at once; after the grace period the
    // listeners close, and the requests taken in finish (those left after a deadline fail).
    let deadline_commands = commands.clone();
    let grace = Duration::from_secs(args.drain_grace_secs);
    let mut shutdown = shutdown_rx.clone();
    let signals = tokio::spawn(async move {
        let _ = shutdown.wait_for(|&s| s).await;
        readiness.set(Phase::Draining);
        if !grace.is_zero() {
            tracing::info!("stopping: health reports draining; the listeners close in {grace:?}");
            tokio::time::sleep(grace).await;
        }
        tracing::info!("stopping: listeners closed; finishing the requests taken in (up to {DRAIN_DEADLINE:?})");
        let _ = closing_tx.send(true);
        tokio::time::sleep(DRAIN_DEADLINE).await;
        tracing::warn!("requests still running {DRAIN_DEADLINE:?} after the listeners closed: failing them");
        let _ = deadline_commands.send(Command::Drain { deadline: Instant::now(), reply: oneshot::channel().0 }).await;
    });
    // The front ends end once their listeners are closed and their connections done.
    let (http, grpc) = tokio::join!(http, grpc);
    signals.abort();
    let (tx, rx) = oneshot::channel();
    if commands.send(Command::Drain { deadline: Instant::now(), reply: tx }).await.is_ok() {
        let _ = rx.await;
    }
    drop(commands);
    let _ = stop_tx.send(true);
    let _ = watcher.await;
    let _ = scheduler_task.await;
    if let Some(k) = keeper {
        let _ = k.await;
        crate::leftovers::sweep_own_instance(&instance);
    }
    tracing::info!("duet-gateway stopped");
    http?;
    Ok(grpc??)
}

/// The scheduler's settings from the flags and what the workers report; refuses workers
/// that do not fit together or with the gateway's tokenizer.
fn scheduler_config(args: &ServeArgs, workers: &supervisor::Workers, readiness: &Readiness, text: &TextModel, local: bool) -> anyhow::Result<SchedulerConfig> {
    let g = &workers.gpu_info;
    let block_size = workers.cpu_infos.first().map_or(duet_kv::layout::DEFAULT_BLOCK_SIZE as usize, |i| i.block_size as usize);
    if workers.cpu_infos.iter().any(|i| i.block_size as usize != block_size) {
        anyhow::bail!("the cpu-workers use different KV block sizes");
    }
    // Prefill chunks of the gpu-worker's own size, so that it computes what its
    // single-process runner computes.
    let prefill_chunk = g.prefill_chunk_tokens as usize;
    if prefill_chunk == 0 {
        anyhow::bail!("the gpu-worker reports no prefill chunk size (is it an older version than the gateway?)");
    }
    let device_kind = pb::DeviceKind::try_from(g.device_kind).unwrap_or(pb::DeviceKind::Unspecified);
    if device_kind == pb::DeviceKind::Unspecified {
        anyhow::bail!("the gpu-worker reports no device kind (is it an older version than the gateway?)");
    }
    if text.tokenizer.vocab_size() != g.n_vocab as usize {
        anyhow::bail!("the tokenizer has {} tokens, the gpu-worker's model {}", text.tokenizer.vocab_size(), g.n_vocab);
    }
    Ok(SchedulerConfig {
        max_step_tokens: args.max_step_tokens.max(prefill_chunk),
        prefill_chunk,
        max_running: args.max_running.max(1),
        policy: args.policy,
        overlap: args.overlap,
        session_idle: Duration::from_secs(args.session_idle_secs),
        block_size,
        blocks_per_worker: workers.cpu_infos.iter().map(|i| i.kv_blocks).collect(),
        n_ctx: g.context_length as usize,
        model_name: g.model.clone(),
        vocab_size: g.n_vocab,
        gpu_device: g.device.clone(),
        node_name: readiness.node.to_string(),
        // Local workers share the machine's cores; a gpu-worker computing layers on the CPU
        // (its CPU device, or the layers --gpu-layers leaves to it) competes for them.
        shared_cores: local && g.host_layers > 0,
        gpu_kv_positions: g.gpu_kv_positions as usize,
        synthetic_prefill: g.synthetic_prefill,
        // Made-up K/V must not stand in for another request's.
        prefix_cache: !args.no_prefix_cache && !g.synthetic_prefill,
    })
}

/// Watches SIGTERM and SIGINT (Ctrl-C) from the call on (no longer killing the process):
/// the future resolves on the first.
fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{signal, SignalKind};
    let watch = |kind, name: &str| signal(kind).map_err(|e| tracing::warn!("cannot watch {name} ({e}): it will not stop the gateway cleanly")).ok();
    let (term, int) = (watch(SignalKind::terminate(), "SIGTERM"), watch(SignalKind::interrupt(), "SIGINT"));
    async move {
        let recv = |s: Option<tokio::signal::unix::Signal>| async move {
            match s {
                Some(mut s) => {
                    s.recv().await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = recv(term) => {}
            _ = recv(int) => {}
        }
    }
}

/// `--gpu-layers`: a layer count or `auto` (the gpu-worker's own values, passed on).
fn parse_gpu_layers(s: &str) -> Result<String, String> {
    if s == "auto" || s.parse::<usize>().is_ok() {
        Ok(s.to_string())
    } else {
        Err(format!("a layer count or auto, got {s:?}"))
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
