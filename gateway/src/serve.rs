//! `duet-gateway serve`: brings the service up (local workers or given ones), serves the
//! public API, and on SIGTERM or Ctrl-C drains the running streams, stops the workers and
//! removes their sockets and segments.

use std::sync::Arc;
use std::time::{Duration, Instant};

use duet_model::chat::ChatTemplate;
use duet_model::gguf::GgufFile;
use duet_model::grammar::Grammars;
use duet_model::tokenizer::Tokenizer;
use duet_proto::{pb, Listener};
use tokio::sync::{oneshot, watch};

use crate::api::auth::ApiKey;
use crate::backend::{Backend, TextModel};
use crate::readiness::{Phase, Readiness};
use crate::cli::ServeArgs;
use crate::scheduler::{self, Command, SchedulerConfig};
use crate::supervisor::{self, LocalWorkers};

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

pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let api_key = match (&args.api_key, &args.api_key_file) {
        (Some(k), _) => Some(ApiKey::new(k).map_err(anyhow::Error::msg)?),
        (None, Some(path)) => Some(ApiKey::from_file(path).map_err(anyhow::Error::msg)?),
        (None, None) => None,
    };
    let metrics = crate::metrics::install();
    let text = Arc::new(load_text_model(&args.model, args.chat_template.as_deref())?);
    let readiness = Readiness::new(&args.node_name.clone().unwrap_or_else(crate::cli::host_node_name));
    let (commands, commands_rx) = scheduler::commands();
    let backend = Backend::new(commands.clone(), text.clone(), readiness.clone());

    // The front ends first, answering health with "loading" (and requests with 503) while
    // the workers start; they stop taking connections when `closing` is set.
    let listener = Listener::bind(&args.listen).await.map_err(|e| anyhow::anyhow!("listening on {}: {e}", args.listen))?;
    let addr = listener.local_address()?;
    let http_listener =
        tokio::net::TcpListener::bind(args.http_listen).await.map_err(|e| anyhow::anyhow!("listening on {} (HTTP): {e}", args.http_listen))?;
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
    let local = args.gpu_worker.is_none();
    let instance = args.instance.clone().unwrap_or_else(|| format!("duet-{}", std::process::id()));
    let mut keeper = None;
    let connected = if let Some(gpu) = &args.gpu_worker {
        supervisor::connect(gpu, &args.cpu_worker, None, false).await
    } else {
        let n = args.cpu_workers.unwrap_or_else(|| supervisor::cpu_nodes() as u32).max(1);
        let cfg = LocalWorkers {
            model: args.model.clone(),
            cpu_workers: n,
            kv_bytes: args.kv_bytes.clone(),
            runtime_dir: args.runtime_dir.clone().unwrap_or_else(|| supervisor::default_runtime_dir(&instance)),
            instance: instance.clone(),
            gpu_threads: args.gpu_threads,
            device: args.device.clone(),
        };
        tracing::info!(instance = %cfg.instance, runtime_dir = %cfg.runtime_dir.display(), cpu_workers = n, "starting local workers");
        match supervisor::spawn_local(&cfg) {
            Ok(mut children) => {
                let cpu_addrs: Vec<_> = (0..n).map(|w| cfg.cpu_address(w)).collect();
                let connected = supervisor::connect(&cfg.gpu_address(), &cpu_addrs, Some(&mut children), true).await;
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
        kv_tokens = cfg.blocks_per_worker.iter().map(|&b| b as usize).sum::<usize>() * cfg.block_size,
        policy = %cfg.policy,
        %http_addr,
        node = %cfg.node_name,
        api_key = api_key.is_some(),
        "duet-gateway serving"
    );
    // Tests and scripts read the addresses from these lines on stdout (printed once serving).
    println!("duet-gateway http listening on {http_addr}");
    println!("duet-gateway listening on {addr}");
    // On SIGTERM or Ctrl-C: health says "draining" at once; after the grace period the
    // listeners close, and the requests taken in finish (those left after a deadline fail).
    let deadline_commands = commands.clone();
    let grace = Duration::from_secs(args.drain_grace_secs);
    let signals = tokio::spawn(async move {
        shutdown_signal().await;
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
        // Local workers share the machine's cores; a gpu-worker on the CPU competes for them.
        shared_cores: local && device_kind == pb::DeviceKind::Cpu,
    })
}

/// Resolves on SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(e) => {
            tracing::warn!("cannot watch SIGTERM ({e}); stopping on Ctrl-C only");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
