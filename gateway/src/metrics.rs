//! Prometheus metrics of the gateway: the recorder (installed once per process), the
//! metric names with their descriptions and histogram buckets, and one function per event
//! the scheduler reports, so that metric names live in this file only.

use std::time::Duration;

use duet_proto::pb;
use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::request::{StopReason, Usage};

const REQUESTS: &str = "duet_requests_total";
const REQUESTS_FINISHED: &str = "duet_requests_finished_total";
const PROMPT_TOKENS: &str = "duet_prompt_tokens_total";
const PREFILLED_TOKENS: &str = "duet_prefilled_tokens_total";
const GENERATED_TOKENS: &str = "duet_generated_tokens_total";
const TTFT: &str = "duet_time_to_first_token_seconds";
const TPOT: &str = "duet_time_per_output_token_seconds";
const QUEUE_DEPTH: &str = "duet_queue_depth";
const RUNNING: &str = "duet_running_requests";
const SESSIONS: &str = "duet_sessions";
const KV_BLOCKS: &str = "duet_kv_blocks";
const STEP_PHASE: &str = "duet_step_phase_seconds";
const STEPS: &str = "duet_steps_total";
const ATTENTION_POSITIONS: &str = "duet_attention_positions";
const ATTENTION_GPU_FRACTION: &str = "duet_attention_gpu_fraction";
const CPU_WORKER_UP: &str = "duet_cpu_worker_up";
const PREDICTED_STEP: &str = "duet_balancer_predicted_step_seconds";
const PREDICTION_ERROR: &str = "duet_balancer_prediction_error";
const EXPERT_ROUTED: &str = "duet_expert_routed_tokens_total";
const PREFIX_QUERIED: &str = "duet_prefix_cache_queried_tokens_total";
const PREFIX_HITS: &str = "duet_prefix_cache_hit_tokens_total";

/// Installs the process-wide recorder (the first call does; later calls return the same
/// handle) and describes every metric.
pub fn install() -> PrometheusHandle {
    static HANDLE: std::sync::OnceLock<PrometheusHandle> = std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let latency = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];
            let step = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5];
            let handle = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Full(TTFT.into()), &latency)
                .and_then(|b| b.set_buckets_for_metric(Matcher::Full(TPOT.into()), &latency))
                .and_then(|b| b.set_buckets_for_metric(Matcher::Full(STEP_PHASE.into()), &step))
                .expect("bucket lists are non-empty")
                .install_recorder()
                .expect("the gateway installs the only metrics recorder");
            describe();
            handle
        })
        .clone()
}

fn describe() {
    describe_counter!(REQUESTS, "Generation requests received (gRPC and HTTP).");
    describe_counter!(REQUESTS_FINISHED, "Generation requests ended, by reason (end_of_generation, max_tokens, stop_string, context_full, error, cancelled).");
    describe_counter!(PROMPT_TOKENS, "Prompt tokens of admitted requests (a session's whole conversation).");
    describe_counter!(PREFILLED_TOKENS, "Prompt tokens prefilled (a session's cached tokens are not).");
    describe_counter!(GENERATED_TOKENS, "Tokens generated.");
    describe_histogram!(TTFT, Unit::Seconds, "Time from a request's arrival to its first generated token.");
    describe_histogram!(TPOT, Unit::Seconds, "Mean time per generated token after the first, per request.");
    describe_gauge!(QUEUE_DEPTH, "Requests waiting to be admitted.");
    describe_gauge!(RUNNING, "Requests generating.");
    describe_gauge!(SESSIONS, "Open sessions (conversations whose KV is kept).");
    describe_gauge!(KV_BLOCKS, "KV blocks per cpu-worker: used (held by requests and sessions), cached (KV kept for the prefix cache, taken when needed) and free.");
    describe_counter!(PREFIX_QUERIED, "Prompt tokens of requests without a session looked up in the prefix cache.");
    describe_counter!(PREFIX_HITS, "Prompt tokens whose KV came from the prefix cache instead of being prefilled.");
    describe_histogram!(STEP_PHASE, Unit::Seconds, "Time of each step phase on each device.");
    describe_counter!(STEPS, "Steps run on the gpu-worker.");
    describe_gauge!(ATTENTION_POSITIONS, "KV positions attended for decode in the last step, per device (all layers counted once).");
    describe_gauge!(ATTENTION_GPU_FRACTION, "Share of the last step's decode attention positions done on the gpu-worker.");
    describe_gauge!(CPU_WORKER_UP, "1 while a cpu-worker serves, 0 while it is down.");
    describe_gauge!(PREDICTED_STEP, Unit::Seconds, "The balancer's predicted time of the last step.");
    describe_gauge!(PREDICTION_ERROR, "Quantiles of the balancer's recent relative step-time prediction error (decode steps, steady state).");
    describe_counter!(EXPERT_ROUTED, "Tokens the router of a mixture of experts sent to each expert of each layer (which experts are hot).");
}

pub fn request_received() {
    counter!(REQUESTS).increment(1);
}

/// A request without a session looked `prompt_tokens` up in the prefix cache and found the
/// KV of the first `hit`.
pub fn prefix_cache_lookup(prompt_tokens: usize, hit: usize) {
    counter!(PREFIX_QUERIED).increment(prompt_tokens as u64);
    counter!(PREFIX_HITS).increment(hit as u64);
}

/// A request admitted with `prompt_tokens` in its conversation.
pub fn request_admitted(prompt_tokens: usize) {
    counter!(PROMPT_TOKENS).increment(prompt_tokens as u64);
}

pub fn tokens_prefilled(n: usize) {
    counter!(PREFILLED_TOKENS).increment(n as u64);
}

pub fn token_generated() {
    counter!(GENERATED_TOKENS).increment(1);
}

/// A request that finished normally, with its usage.
pub fn request_finished(reason: StopReason, usage: &Usage) {
    let reason = match reason {
        StopReason::EndOfGeneration => "end_of_generation",
        StopReason::MaxTokens => "max_tokens",
        StopReason::StopString => "stop_string",
        StopReason::ContextFull => "context_full",
    };
    counter!(REQUESTS_FINISHED, "reason" => reason).increment(1);
    if usage.generated_tokens > 0 {
        histogram!(TTFT).record(usage.time_to_first_token.as_secs_f64());
    }
    if usage.generated_tokens > 1 {
        let after_first = usage.total_time.saturating_sub(usage.time_to_first_token);
        histogram!(TPOT).record(after_first.as_secs_f64() / (usage.generated_tokens - 1) as f64);
    }
}

/// A request that failed (`cancelled`: its client went away).
pub fn request_failed(cancelled: bool) {
    counter!(REQUESTS_FINISHED, "reason" => if cancelled { "cancelled" } else { "error" }).increment(1);
}

/// The scheduler's queues and sessions.
pub fn queues(waiting: usize, running: usize, sessions: usize) {
    gauge!(QUEUE_DEPTH).set(waiting as f64);
    gauge!(RUNNING).set(running as f64);
    gauge!(SESSIONS).set(sessions as f64);
}

/// One cpu-worker's KV blocks and state.
/// `free_blocks` counts the `cached` ones (KV kept for the prefix cache, no request holding it).
pub fn cpu_worker(worker: u32, total_blocks: u32, free_blocks: usize, cached: usize, up: bool) {
    let w = worker.to_string();
    gauge!(KV_BLOCKS, "worker" => w.clone(), "state" => "free").set((free_blocks - cached) as f64);
    gauge!(KV_BLOCKS, "worker" => w.clone(), "state" => "cached").set(cached as f64);
    gauge!(KV_BLOCKS, "worker" => w.clone(), "state" => "used").set(total_blocks as f64 - free_blocks as f64);
    gauge!(CPU_WORKER_UP, "worker" => w).set(if up { 1.0 } else { 0.0 });
}

/// A step's phases as the gpu-worker and the cpu-workers timed them (the wait for the
/// cpu-workers' partial results is their attention time not hidden behind the gpu-worker's
/// work), what the planner predicted, and its recent error.
pub fn step(t: &pb::StepTimings, predicted_s: f64, error: Option<(f64, f64)>) {
    counter!(STEPS).increment(1);
    gauge!(PREDICTED_STEP).set(predicted_s);
    if let Some((p50, p90)) = error {
        gauge!(PREDICTION_ERROR, "quantile" => "0.5").set(p50);
        gauge!(PREDICTION_ERROR, "quantile" => "0.9").set(p90);
    }
    for r in &t.expert_routed {
        counter!(EXPERT_ROUTED, "layer" => r.layer.to_string(), "expert" => r.expert.to_string()).increment(u64::from(r.tokens));
    }
    for w in &t.cpu_workers {
        histogram!(STEP_PHASE, "device" => format!("cpu-worker-{}", w.worker), "phase" => "attention").record(w.busy_ns as f64 * 1e-9);
    }
    let ns = |v: u64| Duration::from_nanos(v).as_secs_f64();
    let phases = [
        ("gpu-worker", "total", t.total_ns),
        ("gpu-worker", "linear", t.linear_ns),
        ("gpu-worker", "kv_write", t.kv_write_ns),
        ("gpu-worker", "attention", t.attention_gpu_ns),
        ("gpu-worker", "kv_upload", t.gpu_kv_upload_ns),
        ("gpu-worker", "merge", t.merge_ns),
        ("gpu-worker", "sample", t.sample_ns),
        ("cpu-workers", "attention_wait", t.attention_wait_ns),
    ];
    for (device, phase, v) in phases {
        histogram!(STEP_PHASE, "device" => device, "phase" => phase).record(ns(v));
    }
    if t.decode_tokens > 0 {
        gauge!(ATTENTION_POSITIONS, "device" => "gpu-worker").set(t.gpu_attention_positions as f64);
        gauge!(ATTENTION_POSITIONS, "device" => "cpu-workers").set(t.cpu_attention_positions as f64);
        let all = (t.gpu_attention_positions + t.cpu_attention_positions).max(1) as f64;
        gauge!(ATTENTION_GPU_FRACTION).set(t.gpu_attention_positions as f64 / all);
    }
}
