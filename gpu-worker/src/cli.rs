//! Command-line interface of duet-gpu-worker: `serve` (worker mode, for the gateway) and the
//! standalone `run`, `tokenize` and `perplexity` commands over the single-process runner.

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use duet_model::chat::ChatMessage;
use duet_model::gguf::GgufFile;
use duet_model::tokenizer::Tokenizer;
use serde_json::json;

use crate::device::{AnyDevice, Device, DeviceChoice, GpuLayers, Placement};
use crate::runner::{Runner, GenerateRequest};
use crate::sampler::SamplingParams;

#[derive(Debug, Parser)]
#[command(name = "duet-gpu-worker", version, about = "Duet's model runner: worker mode for the gateway, or standalone commands")]
pub struct Cli {
    /// Worker threads for the CPU device (default: all cores).
    #[arg(long, global = true, env = "DUET_THREADS")]
    pub threads: Option<usize>,
    /// The device the model runs on: auto (CUDA where usable, else the CPU, saying why), cpu
    /// or cuda (fails if it cannot be used).
    #[arg(long, global = true, env = "DUET_DEVICE", value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    /// GPU memory the CUDA device may use, e.g. 16G (default: all that is free): a model
    /// over it does not load there (`auto` then takes the CPU, saying why).
    #[arg(long, global = true, env = "DUET_GPU_MEM_BYTES", value_parser = duet_kv::parse_bytes)]
    pub gpu_mem_bytes: Option<usize>,
    /// GPU memory for the KV mirror, on which the GPU's share of attention runs (default: what
    /// the weights leave of --gpu-mem-bytes, less 768 MiB for activations; 0: no mirror,
    /// attention on the host's cores).
    #[arg(long, global = true, env = "DUET_GPU_KV_BYTES", value_parser = duet_kv::parse_bytes)]
    pub gpu_kv_bytes: Option<usize>,
    /// Only the first N layers on the device, the rest on the CPU device (llama.cpp's
    /// `-ngl`), for dense models larger than the GPU; `auto`: as many as the GPU memory the
    /// device may use holds (default: all layers on the device; 0: all on the CPU). With
    /// --device cpu both parts run on the CPU (a check of the hand-off).
    #[arg(long, global = true, env = "DUET_GPU_LAYERS")]
    pub gpu_layers: Option<GpuLayers>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve steps to the gateway over gRPC (worker mode).
    Serve(ServeArgs),
    /// Generate text from a prompt in this process (no gateway, no other worker).
    Run(RunArgs),
    /// Print the token ids of a text as JSON: {"ids": [...]}.
    Tokenize(TokenizeArgs),
    /// Perplexity of a text file, computed as llama.cpp's llama-perplexity does.
    Perplexity(PerplexityArgs),
}

#[derive(Debug, Args)]
pub struct ModelArg {
    /// GGUF model file.
    #[arg(long, env = "DUET_MODEL", default_value = duet_model::DEFAULT_MODEL_PATH)]
    pub model: PathBuf,
}

/// The element type of the runner's KV cache.
#[derive(Debug, Args)]
pub struct CacheArg {
    /// KV cache type: f16, or q8_0 (ggml's 8-bit blocks: 53 % of the bytes, as llama.cpp's
    /// `-ctk q8_0 -ctv q8_0`; attended with the one-pass softmax).
    #[arg(long, env = "DUET_KV_TYPE", default_value = "f16", value_parser = duet_kv::parse_kv_type)]
    pub kv_type: duet_kv::KvDtype,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Address to serve on: unix:PATH (default for local processes) or HOST:PORT.
    #[arg(long, env = "DUET_GPU_LISTEN")]
    pub listen: duet_proto::Address,
    /// Longest wait, in milliseconds, for a cpu-worker's answer to one attention job before
    /// the step fails and the worker counts as down.
    #[arg(long, env = "DUET_JOB_TIMEOUT_MS", default_value_t = 10_000)]
    pub job_timeout_ms: u64,
    /// Where a mixture-of-experts model's routed experts run: on this device, or on the
    /// cpu-workers (each started with --experts-of I/N; the device then loads none of them).
    #[arg(long, env = "DUET_EXPERTS_ON", value_enum, default_value_t = ExpertsOn::Device)]
    pub experts_on: ExpertsOn,
    /// With --experts-on cpu-workers: the device also computes this many experts of each
    /// layer itself, the ones the router chose most (re-planned every 64 steps from its
    /// counts); 0: none.
    #[arg(long, env = "DUET_DEVICE_EXPERTS", default_value_t = 0)]
    pub device_experts: usize,
    /// Benchmarks only: compute only the last token of each prompt chunk and make up the
    /// others' K/V rows (pseudo-random values, written where computed ones would go), so that
    /// decode at a depth of 32K positions can be timed without prefilling it. Decode timings
    /// are the real system's; prefill timings and every generated text are meaningless.
    #[arg(long, env = "DUET_SYNTHETIC_PREFILL")]
    pub synthetic_prefill: bool,
    /// Stop, as on SIGTERM, when process PID (which must be this worker's parent) exits:
    /// `duet-gateway serve` passes its own, so that its workers never outlive it.
    #[arg(long)]
    pub parent_pid: Option<u32>,
}

/// Where a mixture's routed experts run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ExpertsOn {
    /// The gpu-worker's device, with the rest of the layer.
    #[default]
    Device,
    /// The cpu-workers, as expert jobs in their exchange rings (KTransformers' split).
    CpuWorkers,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArg,
    #[command(flatten)]
    pub cache: CacheArg,
    /// Prompt text (control tokens such as <|im_start|> written in it are parsed).
    #[arg(long, conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
    pub prompt: Option<String>,
    /// Prompt as comma-separated token ids, used as given.
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Treat --prompt as a user message and render it with the model's chat template.
    #[arg(long, requires = "prompt")]
    pub chat: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches P (1: off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Drop tokens less likely than P times the most likely one (0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Penalise tokens seen in the last 64 (1: off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub repetition_penalty: f32,
    /// Take P off a token's logit per time it occurs in the last 64, in [-2, 2] (0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Take P off the logit of each token seen in the last 64, in [-2, 2] (0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Random seed for sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print one JSON object (prompt_ids, generated_ids, text, top5) instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Generate once, untimed and unprinted, before the timed generation: the speeds then
    /// leave out first-use costs (on a GPU: cuBLAS's choice of algorithms, the memory pool's
    /// growth; on the CPU: the thread pool's start, first touches of the weights' pages).
    #[arg(long)]
    pub warmup: bool,
}

#[derive(Debug, Args)]
pub struct TokenizeArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Parse control tokens written in the text (e.g. <|im_start|>).
    #[arg(long)]
    pub special: bool,
    /// Text to tokenize.
    pub text: String,
}

#[derive(Debug, Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArg,
    #[command(flatten)]
    pub cache: CacheArg,
    /// Text file to score.
    #[arg(long)]
    pub file: PathBuf,
    /// Tokens per chunk.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    if let Some(bytes) = cli.gpu_mem_bytes {
        crate::device::cuda::set_memory_budget(bytes);
    }
    if let Some(bytes) = cli.gpu_kv_bytes {
        crate::device::cuda::set_kv_budget(bytes);
    }
    if let Some(n) = cli.threads {
        rayon::ThreadPoolBuilder::new().num_threads(n).build_global()?;
    }
    let device = Placement { choice: cli.device, gpu_layers: cli.gpu_layers };
    match cli.command {
        Command::Serve(args) => serve(args, device),
        // Inside the pool (see `worker::service`): forward passes' parallel loops are cheap there.
        Command::Run(args) => rayon::scope(move |_| run_generate(args, device)),
        Command::Tokenize(args) => {
            // Only the vocabulary: works on a vocabulary-only GGUF, and on any architecture.
            let path = &args.model.model;
            let file = GgufFile::open(path).map_err(|e| anyhow::anyhow!("opening {}: {e}", path.display()))?;
            let tokenizer = Tokenizer::from_gguf(&file).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            let ids = tokenizer.encode_prompt(&args.text, args.special)?;
            println!("{}", json!({ "ids": ids }));
            Ok(())
        }
        Command::Perplexity(args) => {
            let engine = load(&args.model, &args.cache, device)?;
            let text = std::fs::read_to_string(&args.file).map_err(|e| anyhow::anyhow!("reading {}: {e}", args.file.display()))?;
            let tokens = engine.tokenizer.encode_prompt(&text, false)?;
            let start = std::time::Instant::now();
            let result = rayon::scope(|_| {
                engine.perplexity(&tokens, args.ctx, |done, total, ppl| {
                    eprintln!("[{done}/{total}] running perplexity {ppl:.4}");
                })
            })?;
            let secs = start.elapsed().as_secs_f64();
            tracing::info!(tokens_per_s = (result.chunks * args.ctx) as f64 / secs, "perplexity done in {secs:.1}s");
            println!("{}", json!({ "ppl": result.ppl, "tokens_scored": result.tokens_scored }));
            Ok(())
        }
    }
}

/// Worker mode: load the model, serve until SIGTERM or Ctrl-C (or the --parent-pid's exit).
fn serve(args: ServeArgs, device: Placement) -> anyhow::Result<()> {
    if let Some(pid) = args.parent_pid {
        duet_proto::lifeline::stop_with_parent(pid)?;
    }
    let start = std::time::Instant::now();
    let timeout = std::time::Duration::from_millis(args.job_timeout_ms);
    let local_experts = args.experts_on == ExpertsOn::Device;
    // The CUDA device keeps the hot experts' room out of its KV mirror's.
    crate::device::cuda::set_expert_slots(args.device_experts);
    let options = crate::worker::service::ServiceOptions { job_timeout: timeout, hot_experts: args.device_experts, synthetic_prefill: args.synthetic_prefill };
    let service = crate::worker::service::GpuWorkerService::load(&args.model.model, device, local_experts, options)
        .map_err(|e| anyhow::anyhow!("loading {}: {e}", args.model.model.display()))?;
    tracing::info!(model = %args.model.model.display(), device = %service.device(), ms = start.elapsed().as_millis() as u64, "model loaded");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    rt.block_on(async {
        let listener = duet_proto::Listener::bind(&args.listen)
            .await
            .map_err(|e| anyhow::anyhow!("listening on {}: {e}", args.listen))?;
        tracing::info!(listen = %args.listen, "gpu-worker serving");
        crate::worker::service::serve(service, listener, shutdown_signal()).await?;
        tracing::info!("gpu-worker stopped");
        anyhow::Ok(())
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

fn load(model: &ModelArg, cache: &CacheArg, device: Placement) -> anyhow::Result<Runner<AnyDevice>> {
    let start = std::time::Instant::now();
    let mut engine = Runner::load_on(&model.model, device).map_err(|e| anyhow::anyhow!("loading {}: {e}", model.model.display()))?;
    engine.kv_type = cache.kv_type;
    tracing::info!(model = %model.model.display(), device = %engine.device.describe(), ms = start.elapsed().as_millis() as u64, "model loaded");
    Ok(engine)
}

fn run_generate(args: RunArgs, device: Placement) -> anyhow::Result<()> {
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        frequency_penalty: args.frequency_penalty,
        presence_penalty: args.presence_penalty,
        seed: args.seed,
    };
    // Reject bad flags before spending time on loading the model.
    sampling.validate()?;
    let engine = load(&args.model, &args.cache, device)?;
    let prompt_ids = match (&args.prompt, &args.prompt_ids) {
        (_, Some(ids)) => ids.clone(),
        (Some(text), None) if args.chat => {
            let template = engine.chat_template.as_ref().ok_or_else(|| anyhow::anyhow!("--chat: the model has no chat template"))?;
            let rendered = template.render(&[ChatMessage::new("user", text.as_str())], true)?;
            engine.tokenizer.encode_prompt(&rendered, true)?
        }
        (Some(text), None) => engine.tokenizer.encode_prompt(text, true)?,
        (None, None) => anyhow::bail!("give --prompt or --prompt-ids"),
    };
    let req = GenerateRequest {
        prompt_ids: prompt_ids.clone(),
        max_tokens: args.max_tokens,
        sampling,
        top_n: if args.json { 5 } else { 0 },
    };
    if args.warmup {
        let started = std::time::Instant::now();
        engine.generate(&req, |_| {})?;
        tracing::info!(ms = started.elapsed().as_millis() as u64, "warm-up generation done (untimed)");
    }
    let stdout = std::io::stdout();
    let gen = engine.generate(&req, |piece| {
        if !args.json {
            let mut out = stdout.lock();
            let _ = out.write_all(piece.as_bytes());
            let _ = out.flush();
        }
    })?;
    let (n_prompt, n_gen) = (prompt_ids.len(), gen.generated_ids.len());
    let prefill_tps = n_prompt as f64 / gen.prefill_time.as_secs_f64();
    let decode_tps = n_gen.saturating_sub(1) as f64 / gen.decode_time.as_secs_f64();
    if args.json {
        let top5: Vec<Vec<serde_json::Value>> =
            gen.top.iter().map(|pos| pos.iter().map(|&(id, lp)| json!({ "id": id, "logprob": lp })).collect()).collect();
        println!(
            "{}",
            json!({
                "prompt_ids": prompt_ids,
                "generated_ids": gen.generated_ids,
                "text": gen.text,
                "top5": top5,
                "stop": gen.stop,
                "timings": { "prompt_tokens": n_prompt, "prefill_tokens_per_s": prefill_tps,
                             "generated_tokens": n_gen, "decode_tokens_per_s": decode_tps,
                             "prefill_device_us": phases_us(&gen.device_phases[0]),
                             "decode_device_us": phases_us(&gen.device_phases[1]) },
            })
        );
    } else {
        println!();
        eprintln!("[{n_prompt} prompt tokens at {prefill_tps:.1} tok/s, {n_gen} generated at {decode_tps:.1} tok/s, stop: {:?}]", gen.stop);
    }
    Ok(())
}

/// A device's phase times (nanoseconds) as a JSON object of microseconds, in phase order.
fn phases_us(phases: &[(&'static str, u64)]) -> serde_json::Value {
    serde_json::Value::Object(phases.iter().map(|&(name, ns)| (name.to_string(), json!(ns / 1000))).collect())
}
