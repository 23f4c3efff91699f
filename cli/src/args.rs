//! The `duet` command line: `generate` and `chat` against a running gateway, `bench` (load
//! from a client's side) and `simulate` (the balancer's cost model on machines we do not have).

use clap::{Args, Parser, Subcommand};
use duet_proto::Address;

#[derive(Debug, Parser)]
#[command(name = "duet", version, about = "Duet's client tools: generate, chat, bench a running gateway; simulate machines we do not have")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Stream a generation from a running gateway.
    Generate(GenerateArgs),
    /// Chat interactively with a running gateway (a session keeps the conversation's KV).
    Chat(ChatArgs),
    /// Measure a running gateway: concurrent greedy streams, time to first token, tokens/s.
    Bench(BenchArgs),
    /// Replay the balancer's cost model for a machine we do not have (GPU, CPU sockets,
    /// model shape): step time, tokens/s and the largest context and batch per policy.
    Simulate(SimulateArgs),
}

#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// The GPU: t4, a10, h100 (PCIe) or h100-sxm (required unless --sweep).
    #[arg(long, value_enum, required_unless_present = "sweep")]
    pub gpu: Option<crate::simulator::machines::GpuPreset>,
    /// CPU sockets (NUMA nodes), one cpu-worker each.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=8))]
    pub sockets: u32,
    /// Peak memory bandwidth of one socket, GB/s.
    #[arg(long, default_value_t = 150.0)]
    pub socket_bandwidth_gbs: f64,
    /// Cores of one socket.
    #[arg(long, default_value_t = 32)]
    pub cores: u32,
    /// Effective decode-attention GFLOP/s of one core.
    #[arg(long, default_value_t = 30.0)]
    pub core_gflops: f64,
    /// Host memory of one socket for the KV arena, GiB.
    #[arg(long, default_value_t = 96.0)]
    pub host_kv_gib: f64,
    /// The model shape.
    #[arg(long, value_enum, default_value = "llama-3.1-8b")]
    pub model: crate::simulator::machines::ModelPreset,
    /// Weight format on the GPU (ignored by --sweep, which shows fp16 and int8).
    #[arg(long, value_enum, default_value = "fp16")]
    pub weights: crate::simulator::machines::WeightDtype,
    /// Sequences decoding at once.
    #[arg(long, default_value_t = 32, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub batch: usize,
    /// Context of every sequence: KV positions each decode token attends.
    #[arg(long, default_value_t = 4096, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub context: usize,
    /// The GPU's share of each context in the ratio policy's row.
    #[arg(long, default_value_t = 0.5)]
    pub ratio: f64,
    /// Replace the preset's GPU memory, GiB.
    #[arg(long)]
    pub gpu_mem_gib: Option<f64>,
    /// Replace the preset's GPU memory bandwidth, GB/s.
    #[arg(long)]
    pub gpu_bandwidth_gbs: Option<f64>,
    /// Replace the preset's dense fp16 TFLOP/s.
    #[arg(long)]
    pub gpu_tflops: Option<f64>,
    /// Replace the preset's effective host-link (PCIe) bandwidth, GB/s.
    #[arg(long)]
    pub pcie_gbs: Option<f64>,
    /// Print the comparison of T4, A10 and H100 with fp16 and int8 weights (Markdown).
    #[arg(long)]
    pub sweep: bool,
    /// Print the capacity of clusters of this many nodes (e.g. 1,4,16) behind a balancer
    /// hashing sessions onto them: sessions, tokens/s and KV held at --context.
    #[arg(long, value_delimiter = ',', conflicts_with = "sweep", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=4096))]
    pub nodes: Vec<usize>,
    /// With --nodes: the decode speed each generating session should keep, tokens/s.
    #[arg(long, default_value_t = 10.0)]
    pub session_tokens_per_s: f64,
    /// Print the results as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// The gateway's address.
    #[arg(long, env = "DUET_ADDR", default_value = "127.0.0.1:50051")]
    pub addr: Address,
    /// Concurrent streams, one run per level (e.g. 1,16).
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub concurrency: Vec<usize>,
    /// Tokens of each (random) prompt.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Every prompt (the warm-up's too) begins with the same this many tokens, as prompts
    /// sharing a system prompt do: with the gateway's prefix cache, only the rest is prefilled.
    #[arg(long, default_value_t = 0, conflicts_with = "context")]
    pub shared_prefix: usize,
    /// Tokens each stream generates (end-of-generation is ignored).
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u32,
    /// Seed of the random prompts (default: a new one each run, printed, so that a second
    /// run against the same server does not find its prompts in the prefix cache).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Decode at this depth: open one session per stream with a prompt this long (prefilled
    /// once, untimed), then time continuing them.
    #[arg(long)]
    pub context: Option<usize>,
    /// Run once per balancer policy (e.g. lp,cpu,gpu,ratio:0.5), switched with SetPolicy.
    #[arg(long, value_delimiter = ',')]
    pub policies: Vec<String>,
    /// Constrain every stream's output to this JSON schema (structured output's cost; pick
    /// one the streams cannot finish within --max-tokens, e.g. an array of strings).
    #[arg(long)]
    pub json_schema: Option<String>,
    /// Print the results as JSON.
    #[arg(long)]
    pub json: bool,
    /// Skip the untimed warm-up stream sent before the first level: one stream of the levels'
    /// prompt length (16 tokens with --context), 4 tokens generated. It takes a single
    /// stream's first-use costs (on a GPU: kernels chosen for its shapes, memory growth) out
    /// of the first level; larger batches' shapes still meet theirs in their own level.
    #[arg(long)]
    pub no_warmup: bool,
}

/// Sampling and length flags shared by the client commands.
#[derive(Debug, Args, Clone)]
pub struct ClientArgs {
    /// The gateway's address.
    #[arg(long, env = "DUET_ADDR", default_value = "127.0.0.1:50051")]
    pub addr: Address,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: u32,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
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
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop when the text contains this (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// The prompt.
    pub prompt: String,
    /// Send the prompt as a user chat message (rendered with the model's chat template).
    #[arg(long)]
    pub chat: bool,
    /// Print token ids, usage and timings after the text.
    #[arg(long)]
    pub verbose: bool,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, Args)]
pub struct ChatArgs {
    /// A system message to start the conversation with.
    #[arg(long)]
    pub system: Option<String>,
    #[command(flatten)]
    pub client: ClientArgs,
}
