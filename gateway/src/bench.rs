//! `duet-gateway bench`: load from a client's side against a running gateway. For each
//! concurrency level it starts that many greedy streams at once (distinct random prompts of
//! a fixed length, end-of-generation ignored so every stream generates exactly
//! `--max-tokens`) and reports time to first token, per-stream decode speed and the
//! aggregate generated tokens per second. One line per level, or JSON.

use std::time::{Duration, Instant};

use duet_common::rpc::pb::inference_client::InferenceClient;
use duet_common::rpc::{channel, pb};
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::cli::BenchArgs;

/// Token ids the random prompts draw from (ordinary vocabulary, no special tokens).
const PROMPT_IDS: std::ops::Range<u32> = 1000..40000;

/// What one stream measured.
struct StreamTiming {
    ttft: Duration,
    total: Duration,
    generated: u32,
}

/// One concurrency level's results.
#[derive(Debug, Serialize)]
pub struct LevelReport {
    pub concurrency: usize,
    pub prompt_tokens: usize,
    pub max_tokens: u32,
    pub wall_s: f64,
    pub generated_tokens: u64,
    /// All streams' generated tokens over the wall time.
    pub aggregate_tokens_per_s: f64,
    /// Median over streams of (generated - 1) / (total - time to first token).
    pub decode_tokens_per_s_per_stream: f64,
    pub ttft_median_ms: f64,
    pub ttft_max_ms: f64,
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let client = InferenceClient::new(channel(&args.addr)?);
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let mut reports = Vec::new();
    for &c in &args.concurrency {
        if c == 0 {
            anyhow::bail!("--concurrency: levels must be at least 1");
        }
        let prompts: Vec<Vec<u32>> = (0..c).map(|_| (0..args.prompt_tokens).map(|_| rng.random_range(PROMPT_IDS)).collect()).collect();
        let started = Instant::now();
        let tasks: Vec<_> = prompts
            .into_iter()
            .map(|ids| {
                let mut client = client.clone();
                let max_tokens = args.max_tokens;
                tokio::spawn(async move { one_stream(&mut client, ids, max_tokens).await })
            })
            .collect();
        let mut timings = Vec::with_capacity(c);
        for t in tasks {
            timings.push(t.await??);
        }
        let wall = started.elapsed().as_secs_f64();
        let r = report(c, args.prompt_tokens, args.max_tokens, wall, &timings);
        if !args.json {
            println!(
                "concurrency {:>3}: {:>4} prompt + {:>4} generated tokens each | aggregate {:>8.1} tok/s | per stream {:>7.1} tok/s | TTFT median {:>7.1} ms, max {:>7.1} ms | {:.1} s",
                r.concurrency, r.prompt_tokens, r.max_tokens, r.aggregate_tokens_per_s, r.decode_tokens_per_s_per_stream, r.ttft_median_ms, r.ttft_max_ms, r.wall_s
            );
        }
        reports.push(r);
    }
    if args.json {
        println!("{}", serde_json::to_string(&reports)?);
    }
    Ok(())
}

async fn one_stream(client: &mut InferenceClient<tonic::transport::Channel>, ids: Vec<u32>, max_tokens: u32) -> anyhow::Result<StreamTiming> {
    use pb::generate_response::Event;
    let req = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Tokens(pb::TokenIds { ids })),
        max_tokens: Some(max_tokens),
        sampling: Some(pb::SamplingParams { temperature: Some(0.0), ..Default::default() }),
        ignore_eos: true,
        ..Default::default()
    };
    let start = Instant::now();
    let mut stream = client.generate(req).await.map_err(|e| anyhow::anyhow!("Generate: {}", e.message()))?.into_inner();
    let (mut ttft, mut generated) = (None, 0u32);
    while let Some(msg) = stream.message().await.map_err(|e| anyhow::anyhow!("Generate stream: {}", e.message()))? {
        if let Some(Event::Token(_)) = msg.event {
            generated += 1;
            ttft.get_or_insert_with(|| start.elapsed());
        }
    }
    Ok(StreamTiming { ttft: ttft.unwrap_or_default(), total: start.elapsed(), generated })
}

fn report(c: usize, prompt_tokens: usize, max_tokens: u32, wall: f64, t: &[StreamTiming]) -> LevelReport {
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let generated: u64 = t.iter().map(|s| s.generated as u64).sum();
    let decode = t
        .iter()
        .filter(|s| s.generated > 1)
        .map(|s| (s.generated - 1) as f64 / (s.total - s.ttft).as_secs_f64().max(1e-9))
        .collect();
    let ttfts: Vec<f64> = t.iter().map(|s| s.ttft.as_secs_f64() * 1e3).collect();
    LevelReport {
        concurrency: c,
        prompt_tokens,
        max_tokens,
        wall_s: wall,
        generated_tokens: generated,
        aggregate_tokens_per_s: generated as f64 / wall.max(1e-9),
        decode_tokens_per_s_per_stream: median(decode),
        ttft_max_ms: ttfts.iter().copied().fold(0.0, f64::max),
        ttft_median_ms: median(ttfts),
    }
}
