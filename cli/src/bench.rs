//! `duet bench`: load from a client's side against a running gateway. For each
//! concurrency level it starts that many greedy streams at once (distinct random prompts of
//! a fixed length, end-of-generation ignored so every stream generates exactly
//! `--max-tokens`) and reports time to first token, per-stream decode speed and the
//! aggregate generated tokens per second. One line per level, or JSON. An untimed warm-up
//! stream goes first (`--no-warmup` skips it).
//!
//! With `--context N` it measures decode at depth instead: it first opens one session per
//! stream with an N-token prompt (prefilled once), then every measured run continues those
//! sessions, so only decode is timed. With `--policies` it runs once per balancer policy
//! (switched with SetPolicy, side by side on the same sessions) and reports the planner's
//! step-time prediction error for each.

use std::time::{Duration, Instant};

use duet_proto::pb::inference_client::InferenceClient;
use duet_proto::{channel, pb};
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::args::BenchArgs;

/// Token ids the random prompts draw from (ordinary vocabulary, no special tokens).
const PROMPT_IDS: std::ops::Range<u32> = 1000..40000;

/// What one stream measured.
struct StreamTiming {
    ttft: Duration,
    total: Duration,
    generated: u32,
    /// The time between each token and the one before it.
    gaps: Vec<Duration>,
}

/// One concurrency level's results.
#[derive(Debug, Serialize)]
pub struct LevelReport {
    /// The balancer's policy during the run.
    pub policy: String,
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
    /// Inter-token latency over every stream's tokens after its first: median and 99th
    /// percentile (nearest rank), what a reader of a stream waits between tokens.
    pub itl_p50_ms: f64,
    pub itl_p99_ms: f64,
    pub prediction_error_p50: Option<f64>,
    pub prediction_error_p90: Option<f64>,
    /// The gateway made up prompts' K/V (`--synthetic-prefill`): prefill figures mean nothing.
    pub synthetic_prefill: bool,
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let mut client = InferenceClient::new(channel(&args.addr)?);
    let seed = args.seed.unwrap_or_else(|| rand::rng().random());
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    if args.shared_prefix >= args.prompt_tokens.max(1) {
        anyhow::bail!("--shared-prefix {} must be shorter than --prompt-tokens {}", args.shared_prefix, args.prompt_tokens);
    }
    let shared: Vec<u32> = (0..args.shared_prefix).map(|_| rng.random_range(PROMPT_IDS)).collect();
    // A prompt of `n` tokens: the shared prefix, then random ones.
    let prompt = |rng: &mut rand::rngs::StdRng, n: usize| -> Vec<u32> {
        shared.iter().copied().chain((shared.len()..n).map(|_| rng.random_range(PROMPT_IDS))).collect()
    };
    let mut reports = Vec::new();
    if args.concurrency.contains(&0) {
        anyhow::bail!("--concurrency: levels must be at least 1");
    }
    let policies: Vec<Option<String>> = if args.policies.is_empty() { vec![None] } else { args.policies.iter().cloned().map(Some).collect() };
    wait_until_serving(&mut client, &args.addr.to_string(), args.json).await?;
    let synthetic = client.info(pb::InfoRequest {}).await.is_ok_and(|r| r.into_inner().synthetic_prefill);
    if synthetic {
        eprintln!(
            "note: the gateway's prefill is synthetic (--synthetic-prefill): prompts' K/V are made up, so decode at depth is timed truly but time to first token{} means nothing",
            if args.context.is_some() { " when opening sessions" } else { " (every prompt is prefilled in the timed streams)" }
        );
    }
    if !args.no_warmup {
        // One stream with the levels' prompt length (with --context a short one: the
        // sessions' long prompts are prefilled untimed anyway), untimed.
        let started = Instant::now();
        let n = if args.context.is_some() { WARMUP_CONTEXT_PROMPT } else { args.prompt_tokens.max(1) };
        // Its own random prompt: the levels' prompts stay what `--seed` gives with or without it.
        let mut own = rand::rngs::StdRng::seed_from_u64(seed ^ WARMUP_SEED);
        let mut req = stream_request(prompt(&mut own, n.max(args.shared_prefix + 1)), &args, None);
        req.max_tokens = Some(args.max_tokens.min(WARMUP_TOKENS));
        one_stream(&mut client, req).await.map_err(|e| anyhow::anyhow!("the warm-up stream failed: {e}"))?;
        if !args.json {
            println!("warmed up in {:.1} s (untimed)", started.elapsed().as_secs_f64());
        }
    }
    if !args.json {
        println!("random prompts of --seed {seed}");
    }
    for &c in &args.concurrency {
        // At depth: open the sessions once (their prefill is not timed).
        let sessions = match args.context {
            Some(n) => {
                let started = Instant::now();
                let s = open_sessions(&client, c, n, &mut rng).await?;
                if !args.json {
                    println!("opened {c} sessions of {n} tokens in {:.1} s", started.elapsed().as_secs_f64());
                }
                Some(s)
            }
            None => None,
        };
        for policy in &policies {
            // Setting a policy (the server's own where none is asked for) restarts its
            // step-time prediction errors: each level reports its own steps' errors.
            let p = match policy {
                Some(p) => p.clone(),
                None => client.info(pb::InfoRequest {}).await.map_err(|e| anyhow::anyhow!("Info: {}", e.message()))?.into_inner().policy,
            };
            client.set_policy(pb::SetPolicyRequest { policy: p.clone() }).await.map_err(|e| anyhow::anyhow!("SetPolicy {p}: {}", e.message()))?;
            let requests: Vec<pb::GenerateRequest> = (0..c)
                .map(|i| match &sessions {
                    Some(ids) => stream_request(vec![rng.random_range(PROMPT_IDS)], &args, Some(ids[i].clone())),
                    None => stream_request(prompt(&mut rng, args.prompt_tokens), &args, None),
                })
                .collect();
            let started = Instant::now();
            let tasks: Vec<_> = requests
                .into_iter()
                .map(|req| {
                    let mut client = client.clone();
                    tokio::spawn(async move { one_stream(&mut client, req).await })
                })
                .collect();
            let mut timings = Vec::with_capacity(c);
            for t in tasks {
                timings.push(t.await??);
            }
            let wall = started.elapsed().as_secs_f64();
            let info = client.info(pb::InfoRequest {}).await.map_err(|e| anyhow::anyhow!("Info: {}", e.message()))?.into_inner();
            let depth = args.context.unwrap_or(args.prompt_tokens);
            let mut r = report(c, depth, args.max_tokens, wall, &timings);
            r.policy = info.policy.clone();
            r.prediction_error_p50 = info.step_prediction_error_p50;
            r.prediction_error_p90 = info.step_prediction_error_p90;
            r.synthetic_prefill = info.synthetic_prefill;
            if !args.json {
                let err = match (r.prediction_error_p50, r.prediction_error_p90) {
                    (Some(a), Some(b)) => format!(" | step prediction error p50 {:.1}% p90 {:.1}%", a * 100.0, b * 100.0),
                    _ => String::new(),
                };
                println!(
                    "{:<10} concurrency {:>3}: depth {:>5} + {:>4} generated each | aggregate {:>8.1} tok/s | per stream {:>7.1} tok/s | TTFT median {:>7.1} ms, max {:>7.1} ms | between tokens p50 {:.1} ms, p99 {:.1} ms | {:.1} s{err}",
                    r.policy, r.concurrency, r.prompt_tokens, r.max_tokens, r.aggregate_tokens_per_s, r.decode_tokens_per_s_per_stream, r.ttft_median_ms, r.ttft_max_ms, r.itl_p50_ms, r.itl_p99_ms, r.wall_s
                );
            }
            reports.push(r);
        }
        for id in sessions.into_iter().flatten() {
            let _ = client.close_session(pb::CloseSessionRequest { session_id: id }).await;
        }
    }
    if args.json {
        println!("{}", serde_json::to_string(&reports)?);
    }
    Ok(())
}

/// One timed stream: greedy, end of generation ignored, constrained by `--json-schema`.
fn stream_request(ids: Vec<u32>, args: &BenchArgs, session_id: Option<String>) -> pb::GenerateRequest {
    let constraint = args.json_schema.clone().map(|s| pb::OutputConstraint { kind: Some(pb::output_constraint::Kind::JsonSchema(s)) });
    pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Tokens(pb::TokenIds { ids })),
        max_tokens: Some(args.max_tokens),
        sampling: Some(pb::SamplingParams { temperature: Some(0.0), constraint, ..Default::default() }),
        ignore_eos: true,
        session_id,
        ..Default::default()
    }
}

/// Tokens the untimed warm-up stream generates.
const WARMUP_TOKENS: u32 = 4;

/// The warm-up stream's prompt with `--context`.
const WARMUP_CONTEXT_PROMPT: usize = 16;

/// Mixed into `--seed` for the warm-up stream's prompt.
const WARMUP_SEED: u64 = 0x5741_524d;

/// The longest a bench waits for a gateway still loading its model.
const LOAD_WAIT: Duration = Duration::from_secs(600);

/// Returns once the gateway answers `Info`, waiting (and saying so, unless `quiet`) while it
/// is still loading its model (`UNAVAILABLE`, "…loading the model…"), up to [`LOAD_WAIT`];
/// other errors (no gateway there) at once.
async fn wait_until_serving(client: &mut InferenceClient<tonic::transport::Channel>, addr: &str, quiet: bool) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut said = false;
    loop {
        match client.info(pb::InfoRequest {}).await {
            Ok(_) => return Ok(()),
            Err(e) if e.code() == tonic::Code::Unavailable && e.message().contains("loading") && started.elapsed() < LOAD_WAIT => {
                if !said && !quiet {
                    eprintln!("waiting for the gateway: {}", e.message());
                    said = true;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => anyhow::bail!("the gateway at {addr}: {}", e.message()),
        }
    }
}

/// Opens `c` sessions, each with a random `n`-token prompt prefilled (all at once).
async fn open_sessions(client: &InferenceClient<tonic::transport::Channel>, c: usize, n: usize, rng: &mut rand::rngs::StdRng) -> anyhow::Result<Vec<String>> {
    use pb::generate_response::Event;
    let tasks: Vec<_> = (0..c)
        .map(|_| {
            let req = pb::GenerateRequest {
                prompt: Some(pb::generate_request::Prompt::Tokens(pb::TokenIds { ids: (0..n).map(|_| rng.random_range(PROMPT_IDS)).collect() })),
                max_tokens: Some(1),
                sampling: Some(pb::SamplingParams { temperature: Some(0.0), ..Default::default() }),
                ignore_eos: true,
                create_session: true,
                ..Default::default()
            };
            let mut client = client.clone();
            tokio::spawn(async move {
                let mut stream = client.generate(req).await.map_err(|e| anyhow::anyhow!("opening a session: {}", e.message()))?.into_inner();
                let mut id = String::new();
                while let Some(msg) = stream.message().await.map_err(|e| anyhow::anyhow!("opening a session: {}", e.message()))? {
                    if let Some(Event::Prompt(p)) = msg.event {
                        id = p.session_id;
                    }
                }
                anyhow::Ok(id)
            })
        })
        .collect();
    let all = async move {
        let mut ids = Vec::with_capacity(c);
        for t in tasks {
            ids.push(t.await??);
        }
        anyhow::Ok(ids)
    };
    tokio::pin!(all);
    // Long prefills (16 × 4096 tokens of an 8B model: 40 minutes on 2 cores) say how far
    // they are, on stderr, from the server's count of prefilled tokens.
    let mut info = client.clone();
    let base = prefilled_tokens(&mut info).await;
    let started = Instant::now();
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + PROGRESS_EVERY, PROGRESS_EVERY);
    loop {
        tokio::select! {
            ids = &mut all => return ids,
            _ = tick.tick() => {
                if let (Some(base), Some(now)) = (base, prefilled_tokens(&mut info).await) {
                    eprintln!("{}", progress_line(c, n, now.saturating_sub(base), started.elapsed()));
                }
            }
        }
    }
}

/// How often [`open_sessions`] reports its progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(30);

/// The server's count of prompt tokens prefilled since it started (`None` if Info fails).
async fn prefilled_tokens(client: &mut InferenceClient<tonic::transport::Channel>) -> Option<u64> {
    client.info(pb::InfoRequest {}).await.ok().map(|r| r.into_inner().prefilled_tokens_total)
}

/// One progress line of opening `c` sessions of `n` tokens, `done` tokens prefilled after `elapsed`.
fn progress_line(c: usize, n: usize, done: u64, elapsed: Duration) -> String {
    let total = (c * n) as u64;
    let secs = elapsed.as_secs_f64();
    let rate = done as f64 / secs.max(1e-9);
    let left = if done > 0 && done < total { format!(", about {:.0} s left", total.saturating_sub(done) as f64 / rate) } else { String::new() };
    format!("opening {c} sessions of {n} tokens: {done} of {total} prompt tokens prefilled in {secs:.0} s ({rate:.1} tok/s{left})")
}

async fn one_stream(client: &mut InferenceClient<tonic::transport::Channel>, req: pb::GenerateRequest) -> anyhow::Result<StreamTiming> {
    use pb::generate_response::Event;
    let start = Instant::now();
    let mut stream = client.generate(req).await.map_err(|e| {
        // --context's sessions wait, idle, while the others are prefilled: a long setup
        // outlasts the server's session idle time.
        let hint = if e.code() == tonic::Code::NotFound && e.message().contains("session") {
            " (a --context session sat idle while the others were prefilled longer than the server keeps idle sessions: start it with a larger --session-idle-secs)"
        } else {
            ""
        };
        anyhow::anyhow!("Generate: {}{hint}", e.message())
    })?
    .into_inner();
    let (mut ttft, mut generated, mut last, mut gaps) = (None, 0u32, None, Vec::new());
    while let Some(msg) = stream.message().await.map_err(|e| anyhow::anyhow!("Generate stream: {}", e.message()))? {
        if let Some(Event::Token(_)) = msg.event {
            let now = Instant::now();
            generated += 1;
            ttft.get_or_insert_with(|| now - start);
            if let Some(before) = last.replace(now) {
                gaps.push(now - before);
            }
        }
    }
    Ok(StreamTiming { ttft: ttft.unwrap_or_default(), total: start.elapsed(), generated, gaps })
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
    let mut gaps: Vec<f64> = t.iter().flat_map(|s| &s.gaps).map(|g| g.as_secs_f64() * 1e3).collect();
    gaps.sort_by(f64::total_cmp);
    LevelReport {
        policy: String::new(),
        concurrency: c,
        prompt_tokens,
        max_tokens,
        wall_s: wall,
        generated_tokens: generated,
        aggregate_tokens_per_s: generated as f64 / wall.max(1e-9),
        decode_tokens_per_s_per_stream: median(decode),
        ttft_max_ms: ttfts.iter().copied().fold(0.0, f64::max),
        ttft_median_ms: median(ttfts),
        itl_p50_ms: nearest_rank(&gaps, 0.50),
        itl_p99_ms: nearest_rank(&gaps, 0.99),
        prediction_error_p50: None,
        prediction_error_p90: None,
        synthetic_prefill: false,
    }
}

/// The `q` quantile of sorted `v` by nearest rank (0 for none).
fn nearest_rank(v: &[f64], q: f64) -> f64 {
    let rank = (q * v.len() as f64).ceil() as usize;
    v.get(rank.max(1) - 1).copied().unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inter_token_latency_pools_every_streams_gaps() {
        let ms = Duration::from_millis;
        let stream = |gaps: std::ops::RangeInclusive<u64>| StreamTiming {
            ttft: ms(10),
            total: ms(1000),
            generated: *gaps.end() as u32 + 1,
            gaps: gaps.map(ms).collect(),
        };
        // Gaps of 1..=50 ms and 51..=100 ms: 100 in all.
        let r = report(2, 8, 51, 1.0, &[stream(1..=50), stream(51..=100)]);
        assert_eq!((r.itl_p50_ms, r.itl_p99_ms), (50.0, 99.0));
        // A one-token stream has no gaps.
        let one = StreamTiming { ttft: ms(5), total: ms(5), generated: 1, gaps: Vec::new() };
        assert_eq!(report(1, 8, 1, 1.0, &[one]).itl_p99_ms, 0.0);
    }

    #[test]
    fn progress_lines_say_how_far_and_how_long_is_left() {
        let line = progress_line(16, 4096, 16384, Duration::from_secs(600));
        assert_eq!(line, "opening 16 sessions of 4096 tokens: 16384 of 65536 prompt tokens prefilled in 600 s (27.3 tok/s, about 1800 s left)");
        // Nothing counted yet, or all of it: no estimate.
        assert!(!progress_line(16, 4096, 0, Duration::from_secs(30)).contains("left"));
        assert!(!progress_line(1, 8, 8, Duration::from_secs(30)).contains("left"));
    }
}
