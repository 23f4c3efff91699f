//! The scheduler without processes: a fake gpu-worker ([`FakeGpu`], a deterministic "model"
//! whose next token is a hash of the sequence's whole history as its KV blocks hold it, so any
//! mistake in what the scheduler feeds or where its KV goes shows in the tokens) behind
//! [`StepRunner`], and the tiny test model's tokenizer. Admission and completion, sessions
//! reusing their KV, eviction that says so, a lost step resumed, a gpu-worker restart that
//! takes sequences up from the arenas, and prompts started from the prefix cache.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use duet_proto::pb;
use futures_util::future::BoxFuture;
use tokio::sync::{mpsc, Notify};

use super::{spawn, Command, SchedulerConfig, StepRunner};
use crate::backend::{Backend, SchedulerBackend};
use crate::request::{Event, GenerateParams, Prompt, Sampling, SessionMode, TextModel};
use crate::balancer::{Overlap, Policy};
use crate::error::GatewayError;
use crate::readiness::{Phase, Readiness};

/// The fake model: the token after `history`, never the end-of-generation "\n" (10).
fn next_token(history: &[u32]) -> u32 {
    let h = history.iter().fold(7u32, |h, &t| h.wrapping_mul(31).wrapping_add(t));
    32 + h % 90
}

/// A prompt token on which the fake gpu-worker cannot sample (as a grammar that allows no
/// token): the sequence fails alone. The fake model never generates it.
const POISON: u32 = 250;

/// What the fake model generates after `prompt`, `n` tokens.
fn expected(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut history = prompt.to_vec();
    (0..n)
        .map(|_| {
            let t = next_token(&history);
            history.push(t);
            t
        })
        .collect()
}

/// The fake's KV block size (the harness's).
const BS: usize = 16;

#[derive(Default)]
struct FakeState {
    /// Each sequence's tokens at positions 0.. (what its KV would hold).
    seqs: HashMap<u64, Vec<u32>>,
    /// Each sequence's blocks, as the steps' `new_blocks` gave them.
    blocks: HashMap<u64, Vec<(u32, u32)>>,
    /// The cpu-workers' arenas: the token whose K/V each (worker, block, slot) holds.
    arena: HashMap<(u32, u32, usize), u32>,
    last_sampled: HashMap<u64, u32>,
    done: HashSet<u64>,
    /// Steps to fail as if the gpu-worker had died during them.
    fail: HashSet<u64>,
    /// Sequences taken up from `held_tokens`.
    taken_up: Vec<u64>,
    steps: u64,
    /// Steps sent while the one before ran (`after_step` set): the two-steps-in-flight pipeline.
    pipelined: u64,
    /// How long each step takes.
    step_time: Duration,
    /// Per step: pages of the GPU's KV mirror (of `GPU_KV_PAGE` positions) its prompt
    /// chunks and its decode rows' GPU shares take, and whether it had both.
    mirror_pages: Vec<(usize, bool)>,
    /// Per step: the prompt rows it scored (`prompt_logprobs`).
    scored_rows: Vec<usize>,
}

/// A gpu-worker with the fake model and the real step protocol: steps run in `after_step`
/// order, `start_pos` truncates, `feed_sampled` feeds the last sample, `held_tokens` takes
/// up an unknown sequence.
#[derive(Default)]
struct FakeGpu {
    state: Mutex<FakeState>,
    finished: Notify,
}

impl FakeGpu {
    fn run(&self, req: &pb::StepRequest) -> Result<pb::StepResponse, tonic::Status> {
        let mut st = self.state.lock().unwrap();
        st.steps += 1;
        st.pipelined += u64::from(req.after_step != 0);
        if st.fail.remove(&req.step) {
            // As the gpu-worker does: a failed step's sequences are forgotten.
            for s in &req.sequences {
                st.seqs.remove(&s.seq_id);
                st.blocks.remove(&s.seq_id);
            }
            return Err(tonic::Status::unavailable("injected: a worker died during this step"));
        }
        for id in &req.released {
            st.seqs.remove(id);
            st.blocks.remove(id);
            st.last_sampled.remove(id);
        }
        // Positions the GPU attends: the whole context without shares, else to its share's end.
        let on_gpu = |s: &pb::SequenceStep| {
            if s.attention.is_empty() {
                return s.start_pos as usize + s.tokens.len().max(1);
            }
            s.attention.iter().filter(|a| a.cpu_worker.is_none()).map(|a| a.end as usize).max().unwrap_or(0)
        };
        let pages = req.sequences.iter().map(|s| on_gpu(s).div_ceil(duet_kv::GPU_KV_PAGE)).sum();
        let mixed = req.sequences.iter().any(|s| s.tokens.len() > 1) && req.sequences.iter().any(|s| s.tokens.len() <= 1);
        st.mirror_pages.push((pages, mixed));
        let mut sampled = Vec::new();
        let mut failed = Vec::new();
        let mut prompt_logprobs = Vec::new();
        st.scored_rows.push(req.sequences.iter().filter(|s| s.prompt_logprobs).map(|s| s.tokens.len()).sum());
        for s in &req.sequences {
            if s.prompt_logprobs {
                // Each input after the first, then the next chunk's first token: a made-up
                // log-probability that names the position it scores.
                let scored = s.tokens.iter().skip(1).copied().chain(s.next_prompt_token);
                let tokens = scored
                    .enumerate()
                    .map(|(i, id)| pb::ScoredToken { token: Some(pb::TokenProb { id, logprob: -((s.start_pos as usize + i + 1) as f32) }), top: vec![] })
                    .collect();
                prompt_logprobs.push(pb::ScoredPrompt { seq_id: s.seq_id, tokens });
            }
            let start = s.start_pos as usize;
            if !s.held_tokens.is_empty() && s.held_tokens.len() == start {
                st.seqs.insert(s.seq_id, s.held_tokens.clone());
                st.taken_up.push(s.seq_id);
            } else if !st.seqs.contains_key(&s.seq_id) && start != 0 {
                if req.after_step != 0 {
                    continue;
                } else {
                    return Err(tonic::Status::failed_precondition(format!("sequence {} is unknown to the gpu-worker (it starts with start_pos 0)", s.seq_id)));
                }
            }
            let input = if s.feed_sampled { vec![st.last_sampled[&s.seq_id]] } else { s.tokens.clone() };
            let taken_up = !s.held_tokens.is_empty() && s.held_tokens.len() == start;
            let st = &mut *st;
            let seq = st.seqs.entry(s.seq_id).or_default();
            if seq.len() < start {
                return Err(tonic::Status::invalid_argument(format!("sequence {}: start {start} past {}", s.seq_id, seq.len())));
            }
            seq.truncate(start);
            seq.extend(&input);
            let blocks = st.blocks.entry(s.seq_id).or_default();
            if taken_up {
                blocks.clear();
            }
            blocks.truncate(start.div_ceil(BS));
            blocks.extend(s.new_blocks.iter().map(|b| (b.worker, b.block)));
            for (i, &t) in input.iter().enumerate() {
                let (w, b) = blocks[(start + i) / BS];
                st.arena.insert((w, b, (start + i) % BS), t);
            }
            if s.sample {
                // The model reads its history from the KV blocks, as attention does.
                let kv: Vec<u32> = (0..seq.len()).map(|p| st.arena.get(&(blocks[p / BS].0, blocks[p / BS].1, p % BS)).copied().unwrap_or(u32::MAX)).collect();
                if kv.contains(&POISON) {
                    // As the gpu-worker does: the sequence is forgotten, the step goes on.
                    st.seqs.remove(&s.seq_id);
                    st.blocks.remove(&s.seq_id);
                    st.last_sampled.remove(&s.seq_id);
                    failed.push(pb::FailedSequence { seq_id: s.seq_id, reason: "injected: the grammar allows no token here".into() });
                    continue;
                }
                let t = next_token(&kv);
                st.last_sampled.insert(s.seq_id, t);
                sampled.push(pb::Sampled { seq_id: s.seq_id, token: Some(pb::TokenProb { id: t, logprob: -0.1 }), top: vec![] });
            }
        }
        Ok(pb::StepResponse { sampled, timings: Some(pb::StepTimings { total_ns: 1_000_000, ..Default::default() }), prompt_logprobs, failed })
    }

    /// The process restarted: it knows no sequence.
    fn restart(&self) {
        let mut st = self.state.lock().unwrap();
        st.seqs.clear();
        st.blocks.clear();
        st.last_sampled.clear();
    }
}

struct Runner(Arc<FakeGpu>);

impl StepRunner for Runner {
    fn step(&self, req: pb::StepRequest) -> BoxFuture<'static, Result<pb::StepResponse, tonic::Status>> {
        let gpu = self.0.clone();
        Box::pin(async move {
            while req.after_step != 0 && !gpu.state.lock().unwrap().done.contains(&req.after_step) {
                let wait = gpu.finished.notified();
                if gpu.state.lock().unwrap().done.contains(&req.after_step) {
                    break;
                }
                let _ = tokio::time::timeout(Duration::from_millis(50), wait).await;
            }
            let step_time = gpu.state.lock().unwrap().step_time;
            tokio::time::sleep(step_time).await;
            let out = gpu.run(&req);
            gpu.state.lock().unwrap().done.insert(req.step);
            gpu.finished.notify_waiters();
            out
        })
    }
}

struct Harness {
    gpu: Arc<FakeGpu>,
    commands: mpsc::Sender<Command>,
    backend: SchedulerBackend,
}

fn harness(blocks: u32) -> Harness {
    harness_with(blocks, 0)
}

/// With a KV mirror of `gpu_kv_positions` on the gpu-worker.
fn harness_with(blocks: u32, gpu_kv_positions: usize) -> Harness {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    // (A chat template for chat sessions: the tiny model has none.)
    let template = root.join("testdata/templates/Qwen-Qwen2.5-7B-Instruct.jinja");
    let text: Arc<TextModel> = Arc::new(crate::serve::load_text_model(&root.join("testdata/tiny/arch/qwen2_q4_1.gguf"), Some(&template)).unwrap());
    let cfg = SchedulerConfig {
        max_step_tokens: 256,
        prefill_chunk: 64,
        max_running: 8,
        policy: Policy::Gpu,
        overlap: Overlap::Never,
        session_idle: Duration::from_secs(300),
        block_size: BS,
        blocks_per_worker: vec![blocks],
        n_ctx: 1024,
        model_name: "fake".into(),
        vocab_size: 256,
        gpu_device: "fake".into(),
        node_name: "here".into(),
        shared_cores: false,
        gpu_kv_positions,
        synthetic_prefill: false,
        prefix_cache: true,
    };
    let gpu = Arc::new(FakeGpu::default());
    let (commands, rx) = super::commands();
    spawn(rx, cfg, text.clone(), Arc::new(Runner(gpu.clone())));
    let readiness = Readiness::new("here");
    readiness.set(Phase::Serving);
    Harness { gpu, backend: SchedulerBackend::new(commands.clone(), text, readiness), commands }
}

fn request(prompt: &[u32], max_tokens: u32, session: SessionMode) -> GenerateParams {
    GenerateParams {
        prompt: Prompt::Tokens(prompt.to_vec()),
        max_tokens: Some(max_tokens),
        sampling: Sampling::default(),
        stop: vec![],
        top_logprobs: 0,
        session,
        ignore_eos: false,
        prompt_logprobs: false,
    }
}

/// A generation's tokens, its session and cached tokens, or its error.
struct Outcome {
    ids: Vec<u32>,
    session: Option<String>,
    cached: u32,
}

async fn run(backend: &SchedulerBackend, params: GenerateParams) -> Result<Outcome, GatewayError> {
    let mut rx = backend.generate(params).await?;
    let mut out = Outcome { ids: vec![], session: None, cached: 0 };
    while let Some(ev) = rx.recv().await {
        match ev? {
            Event::Prompt { session_id, cached_tokens, .. } => (out.session, out.cached) = (session_id, cached_tokens),
            Event::Token { id, .. } => out.ids.push(id),
            Event::PromptLogprobs { .. } => {}
            Event::Finished { .. } => return Ok(out),
        }
    }
    Err(GatewayError::Internal("the events ended without Finished".into()))
}

/// Reads a generation's tokens into `ids` until it holds `n` (`None`: to the end).
async fn tokens(rx: &mut crate::backend::EventStream, ids: &mut Vec<u32>, n: Option<usize>) {
    while n.is_none_or(|n| ids.len() < n) {
        match rx.recv().await.map(Result::unwrap) {
            Some(Event::Token { id, .. }) => ids.push(id),
            Some(Event::Finished { .. }) | None => return,
            Some(Event::Prompt { .. } | Event::PromptLogprobs { .. }) => {}
        }
    }
}

#[tokio::test]
async fn concurrent_requests_complete_with_the_models_tokens_and_free_their_kv() {
    let h = harness(64);
    let prompts: Vec<Vec<u32>> = (0..5).map(|i| (0..(3 + i * 7)).map(|j| 40 + (i * 5 + j) as u32 % 60).collect()).collect();
    let runs = prompts.iter().map(|p| run(&h.backend, request(p, 20, SessionMode::None)));
    for (p, got) in prompts.iter().zip(futures_util::future::join_all(runs).await) {
        assert_eq!(got.unwrap().ids, expected(p, 20));
    }
    let info = h.backend.info().await.unwrap();
    assert_eq!(info.cpu_workers[0].kv_blocks_free, 64, "every block back");
    let st = h.gpu.state.lock().unwrap();
    assert!(st.pipelined * 2 > st.steps, "most steps went out while the one before ran: {} of {}", st.pipelined, st.steps);
}

#[tokio::test]
async fn every_step_fits_the_gpus_kv_mirror_prompt_chunks_first() {
    // A mirror of 6 pages (96 positions): one request decodes (a context of 60 to 90, 4 to
    // 6 pages) while another's 48-token prompt is prefilled, which needs 3 pages; the
    // decoder's GPU share makes room for it.
    let h = harness_with(64, 96);
    h.gpu.state.lock().unwrap().step_time = Duration::from_millis(2);
    let (long, late): (Vec<u32>, Vec<u32>) = ((40..100).collect(), (50..98).collect());
    let first = run(&h.backend, request(&long, 30, SessionMode::None));
    let second = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        run(&h.backend, request(&late, 4, SessionMode::None)).await
    };
    let (a, b) = tokio::join!(first, second);
    assert_eq!(a.unwrap().ids, expected(&long, 30));
    assert_eq!(b.unwrap().ids, expected(&late, 4));
    let st = h.gpu.state.lock().unwrap();
    assert!(st.mirror_pages.iter().any(|&(_, mixed)| mixed), "a step had a prompt chunk and a decode row");
    assert!(st.mirror_pages.iter().all(|&(pages, _)| pages <= 6), "steps mirror pages: {:?}", st.mirror_pages);
}

#[tokio::test]
async fn scored_prompts_come_back_whole_in_order_one_chunk_a_step() {
    let h = harness(64);
    let prompts: Vec<Vec<u32>> = (0..3).map(|r| (0..150).map(|i| 3 + (i * 7 + r * 11) % 200).collect()).collect();
    let runs = prompts.iter().map(|p| {
        let backend = h.backend.clone();
        let params = GenerateParams { prompt_logprobs: true, ..request(p, 3, SessionMode::None) };
        async move {
            let mut rx = backend.generate(params).await.unwrap();
            let (mut scored, mut ids) = (Vec::new(), Vec::new());
            while let Some(ev) = rx.recv().await {
                match ev.unwrap() {
                    Event::PromptLogprobs { tokens } => {
                        assert!(ids.is_empty(), "scores come before the first token");
                        scored.extend(tokens);
                    }
                    Event::Token { id, .. } => ids.push(id),
                    Event::Prompt { .. } => {}
                    Event::Finished { .. } => break,
                }
            }
            (scored, ids)
        }
    });
    let got = futures_util::future::join_all(runs).await;
    for (p, (scored, ids)) in prompts.iter().zip(got) {
        // Every token after the first, in order, across the 64-token chunks.
        assert_eq!(scored.iter().map(|t| t.id).collect::<Vec<_>>(), p[1..]);
        assert_eq!(scored.iter().map(|t| t.logprob).collect::<Vec<_>>(), (1..p.len()).map(|i| -(i as f32)).collect::<Vec<_>>());
        assert_eq!(ids, expected(p, 3));
    }
    let st = h.gpu.state.lock().unwrap();
    assert!(st.scored_rows.iter().all(|&n| n <= 64), "at most one chunk's rows scored a step: {:?}", st.scored_rows);
    assert!(st.scored_rows.iter().sum::<usize>() == 3 * 150);
}

#[tokio::test]
async fn a_session_turn_reuses_its_kv() {
    let h = harness(64);
    let p1: Vec<u32> = (50..70).collect();
    let t1 = run(&h.backend, request(&p1, 6, SessionMode::Create(None))).await.unwrap();
    assert_eq!(t1.ids, expected(&p1, 6));
    let session = t1.session.unwrap();
    let p2 = vec![33, 34, 35];
    let t2 = run(&h.backend, request(&p2, 6, SessionMode::Continue(session))).await.unwrap();
    assert_eq!(t2.cached as usize, p1.len() + 6 - 1, "the conversation's KV is reused");
    let mut whole = p1.clone();
    whole.extend(&t1.ids);
    whole.extend(&p2);
    assert_eq!(t2.ids, expected(&whole, 6), "the second turn continues the whole conversation");
}

#[tokio::test]
async fn a_session_keeps_the_kind_of_prompt_it_began_with() {
    let h = harness(64);
    let s = run(&h.backend, request(&[40, 41, 42], 3, SessionMode::Create(None))).await.unwrap().session.unwrap();
    let messages = vec![duet_model::chat::ChatMessage::new("user", "hi")];
    let chat = GenerateParams { prompt: Prompt::Chat { messages, tools: None }, ..request(&[], 3, SessionMode::Continue(s.clone())) };
    match run(&h.backend, chat).await {
        Err(GatewayError::InvalidArgument(m)) => assert!(m.contains("text conversation") && m.contains("text or token ids"), "{m}"),
        other => panic!("expected InvalidArgument, got {:?}", other.map(|o| o.ids)),
    }
    // Refused before it ran: the session goes on as it was.
    let next = run(&h.backend, request(&[43], 3, SessionMode::Continue(s))).await.unwrap();
    assert_eq!(next.cached, 5, "the whole conversation's KV is still there");
    // And the reverse: text on a chat session.
    let messages = vec![duet_model::chat::ChatMessage::new("user", "hi")];
    let chat = GenerateParams { prompt: Prompt::Chat { messages, tools: None }, ..request(&[], 3, SessionMode::Create(None)) };
    let s = run(&h.backend, chat).await.unwrap().session.unwrap();
    match run(&h.backend, request(&[43], 3, SessionMode::Continue(s))).await {
        Err(GatewayError::InvalidArgument(m)) => assert!(m.contains("chat conversation") && m.contains("chat messages"), "{m}"),
        other => panic!("expected InvalidArgument, got {:?}", other.map(|o| o.ids)),
    }
}

#[tokio::test]
async fn an_evicted_session_says_so() {
    // 6 blocks of 16: a session of 40 positions (3 blocks) and a request that needs 4.
    let h = harness(6);
    let p: Vec<u32> = (40..75).collect();
    let s = run(&h.backend, request(&p, 5, SessionMode::Create(None))).await.unwrap().session.unwrap();
    let big: Vec<u32> = (33..83).collect();
    assert_eq!(run(&h.backend, request(&big, 5, SessionMode::None)).await.unwrap().ids, expected(&big, 5));
    match run(&h.backend, request(&[40], 3, SessionMode::Continue(s))).await {
        Err(GatewayError::SessionLost { reason, .. }) => assert!(reason.contains("evicted"), "{reason}"),
        other => panic!("expected SessionLost, got {:?}", other.map(|o| o.ids)),
    }
}

#[tokio::test]
async fn a_step_lost_with_the_gpu_worker_is_run_again() {
    let h = harness(64);
    h.gpu.state.lock().unwrap().fail.extend([3, 9]);
    let p: Vec<u32> = (60..90).collect();
    let got = run(&h.backend, request(&p, 24, SessionMode::None)).await.unwrap();
    assert_eq!(got.ids, expected(&p, 24), "the lost steps' tokens are computed again, nothing skipped or repeated");
    assert!(h.gpu.state.lock().unwrap().fail.is_empty(), "both failures were injected");
}

#[tokio::test]
async fn prompts_whose_steps_failed_mid_prefill_go_on_from_their_computed_kv() {
    // Six 150-token prompts in 64-token chunks, 256 tokens a step: after a failed step some
    // are left out of the next one and sent in the one pipelined after it. Each is taken up
    // again (the failed step's sequences are forgotten), never skipped as if computed.
    let h = harness(64);
    h.gpu.state.lock().unwrap().fail.extend([2, 4, 7]);
    let prompts: Vec<Vec<u32>> = (0..6).map(|r| (0..150).map(|i| 3 + (i * 13 + r * 7) % 200).collect()).collect();
    let runs = prompts.iter().map(|p| run(&h.backend, request(p, 8, SessionMode::None)));
    for (p, got) in prompts.iter().zip(futures_util::future::join_all(runs).await) {
        assert_eq!(got.unwrap().ids, expected(p, 8));
    }
    assert!(h.gpu.state.lock().unwrap().fail.is_empty(), "every failure was injected");
}

#[tokio::test]
async fn a_restarted_gpu_worker_takes_up_running_requests_and_idle_sessions() {
    let h = harness(64);
    let ps: Vec<u32> = (45..60).collect();
    let session = run(&h.backend, request(&ps, 4, SessionMode::Create(None))).await.unwrap();
    let p: Vec<u32> = (70..80).collect();
    let mut rx = h.backend.generate(request(&p, 60, SessionMode::None)).await.unwrap();
    let mut ids = Vec::new();
    tokens(&mut rx, &mut ids, Some(5)).await;
    // The gpu-worker dies and comes back empty; the watch reports both.
    h.gpu.restart();
    h.commands.send(Command::GpuDown { reason: "killed".into() }).await.unwrap();
    h.commands.send(Command::GpuUp).await.unwrap();
    tokens(&mut rx, &mut ids, None).await;
    assert_eq!(ids, expected(&p, 60), "the request goes on from its KV on the new gpu-worker");
    let next = run(&h.backend, request(&[36, 37], 4, SessionMode::Continue(session.session.clone().unwrap()))).await.unwrap();
    let mut whole = ps.clone();
    whole.extend(&session.ids);
    whole.extend([36, 37]);
    assert_eq!(next.ids, expected(&whole, 4), "the idle session goes on");
    assert!(h.gpu.state.lock().unwrap().taken_up.len() >= 2, "both sequences were taken up from held tokens");
}

#[tokio::test]
async fn a_sequence_that_cannot_sample_fails_alone() {
    let h = harness(64);
    let good: Vec<Vec<u32>> = (0..3).map(|r| (40 + r..60 + r).collect()).collect();
    let bad: Vec<u32> = (40..50).chain([POISON]).collect();
    let goods = futures_util::future::join_all(good.iter().map(|p| run(&h.backend, request(p, 12, SessionMode::None))));
    let (goods, bad) = tokio::join!(goods, run(&h.backend, request(&bad, 12, SessionMode::None)));
    match bad {
        Err(GatewayError::InvalidArgument(m)) => assert!(m.contains("structured output") && m.contains("allows no token"), "{m}"),
        other => panic!("expected InvalidArgument, got {:?}", other.map(|o| o.ids)),
    }
    for (p, got) in good.iter().zip(goods) {
        assert_eq!(got.unwrap().ids, expected(p, 12));
    }
    assert!(h.gpu.state.lock().unwrap().taken_up.is_empty(), "no other sequence was taken up again");
}

#[tokio::test]
async fn a_failed_turn_leaves_its_session_to_go_on_and_others_alone() {
    let h = harness(64);
    let p1: Vec<u32> = (50..70).collect();
    let t1 = run(&h.backend, request(&p1, 6, SessionMode::Create(None))).await.unwrap();
    let session = t1.session.clone().unwrap();
    let failed = run(&h.backend, request(&[33, POISON], 6, SessionMode::Continue(session.clone()))).await;
    assert!(matches!(failed, Err(GatewayError::InvalidArgument(_))), "{:?}", failed.map(|o| o.ids));
    // The next turn runs beside another request, already decoding: the gpu-worker forgot
    // the session's sequence, which is taken up again from its KV, and nothing else is.
    let other: Vec<u32> = (70..90).collect();
    let mut rx = h.backend.generate(request(&other, 40, SessionMode::None)).await.unwrap();
    let mut ids = Vec::new();
    tokens(&mut rx, &mut ids, Some(5)).await;
    let p3 = vec![34, 35];
    let t3 = run(&h.backend, request(&p3, 6, SessionMode::Continue(session))).await;
    tokens(&mut rx, &mut ids, None).await;
    assert_eq!(ids, expected(&other, 40));
    let whole: Vec<u32> = p1.iter().chain(&t1.ids).chain(&p3).copied().collect();
    assert_eq!(t3.unwrap().ids, expected(&whole, 6), "the turn continues the conversation before the failed one");
    let taken_up = h.gpu.state.lock().unwrap().taken_up.clone();
    assert_eq!(taken_up.len(), 1, "only the session's sequence is taken up again: {taken_up:?}");
}

#[tokio::test]
async fn one_outage_is_one_resume_however_many_failures_report_it() {
    // Twice, the gpu-worker and the cpu-worker go down together, and the step in flight
    // fails: three reports of one outage each time. Counted as six resumes, the request
    // would fail (at most 3).
    let h = harness(64);
    let p: Vec<u32> = (70..80).collect();
    let mut rx = h.backend.generate(request(&p, 60, SessionMode::None)).await.unwrap();
    let mut ids = Vec::new();
    for outage in 1..=2 {
        tokens(&mut rx, &mut ids, Some(10 * outage)).await;
        h.gpu.restart();
        let step = h.gpu.state.lock().unwrap().steps + 1;
        h.gpu.state.lock().unwrap().fail.insert(step);
        h.commands.send(Command::GpuDown { reason: "killed".into() }).await.unwrap();
        h.commands.send(Command::WorkerDown { worker: 0, reason: "killed".into() }).await.unwrap();
        h.commands.send(Command::GpuUp).await.unwrap();
        h.commands.send(Command::WorkerUp { worker: 0, kv_kept: true, restarted: true }).await.unwrap();
    }
    tokens(&mut rx, &mut ids, None).await;
    assert_eq!(ids, expected(&p, 60), "the request goes on from its KV after both outages");
}

#[tokio::test]
async fn sessions_are_named_key_at_node_and_other_nodes_sessions_are_refused_by_name() {
    let h = harness(64);
    let p: Vec<u32> = (50..60).collect();
    let s = run(&h.backend, request(&p, 3, SessionMode::Create(Some("k1".into())))).await.unwrap().session.unwrap();
    assert_eq!(s, "k1@here", "named by the client's key and this node");
    match run(&h.backend, request(&p, 3, SessionMode::Create(Some("k1".into())))).await {
        Err(GatewayError::SessionExists(id)) => assert_eq!(id, "k1@here"),
        other => panic!("expected SessionExists, got {:?}", other.map(|o| o.ids)),
    }
    let random = run(&h.backend, request(&p, 3, SessionMode::Create(None))).await.unwrap().session.unwrap();
    assert!(random.ends_with("@here") && random.len() > 20, "{random}");
    for mode in [SessionMode::Continue("k1@there".into()), SessionMode::Conversation("k1@there".into())] {
        match run(&h.backend, request(&[40], 3, mode)).await {
            Err(GatewayError::SessionElsewhere { session, node, here }) => {
                assert_eq!((session.as_str(), node.as_str(), here.as_str()), ("k1@there", "there", "here"))
            }
            other => panic!("expected SessionElsewhere, got {:?}", other.map(|o| o.ids)),
        }
    }
    assert!(matches!(run(&h.backend, request(&[40], 3, SessionMode::Continue("k9@here".into()))).await, Err(GatewayError::UnknownSession(_))));
}

#[tokio::test]
async fn a_conversation_session_keeps_the_shared_prefix_of_each_whole_conversation() {
    let h = harness(64);
    let p1: Vec<u32> = (50..70).collect();
    let t1 = run(&h.backend, request(&p1, 6, SessionMode::Conversation("chat".into()))).await.unwrap();
    assert_eq!((t1.session.as_deref(), t1.cached), (Some("chat@here"), 0), "created on first use");
    assert_eq!(t1.ids, expected(&p1, 6));
    // The client sends the whole conversation again, as OpenAI clients do.
    let mut whole = p1.clone();
    whole.extend(&t1.ids);
    whole.extend([33, 34, 35]);
    let t2 = run(&h.backend, request(&whole, 6, SessionMode::Conversation("chat@here".into()))).await.unwrap();
    assert_eq!(t2.cached as usize, p1.len() + 6 - 1, "the conversation's KV is reused");
    assert_eq!(t2.ids, expected(&whole, 6));
    // An edited conversation (a different second turn) keeps only the shared prefix.
    let mut edited = p1.clone();
    edited.extend([90, 91]);
    let t3 = run(&h.backend, request(&edited, 4, SessionMode::Conversation("chat".into()))).await.unwrap();
    assert_eq!(t3.cached as usize, p1.len());
    assert_eq!(t3.ids, expected(&edited, 4), "what followed the shared prefix is not kept");
}

#[tokio::test]
async fn kv_full_is_reported_while_a_request_waits_for_kv_and_a_drain_finishes_it() {
    // 4 blocks of 16: one request of 40 positions (3 blocks) at a time.
    let h = harness(4);
    h.gpu.state.lock().unwrap().step_time = Duration::from_millis(5);
    let a: Vec<u32> = (40..70).collect();
    let b: Vec<u32> = (41..71).collect();
    let mut rx_a = h.backend.generate(request(&a, 10, SessionMode::None)).await.unwrap();
    let _ = rx_a.recv().await.unwrap().unwrap();
    let run_b = tokio::spawn({
        let (backend, b) = (h.backend.clone(), b.clone());
        async move { run(&backend, request(&b, 10, SessionMode::None)).await }
    });
    let mut saw_full = false;
    for _ in 0..200 {
        if h.backend.info().await.unwrap().kv_full {
            saw_full = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(saw_full, "the waiting request is reported");
    // A drain now lets both the running and the waiting request finish.
    let (tx, drained) = tokio::sync::oneshot::channel();
    h.commands.send(Command::Drain { deadline: std::time::Instant::now() + Duration::from_secs(30), reply: tx }).await.unwrap();
    let mut ids = Vec::new();
    while let Some(ev) = rx_a.recv().await {
        if let Event::Token { id, .. } = ev.unwrap() {
            ids.push(id);
        }
    }
    assert_eq!(ids, expected(&a, 10));
    assert_eq!(run_b.await.unwrap().unwrap().ids, expected(&b, 10), "the waiting request ran during the drain");
    drained.await.unwrap();
}

#[tokio::test]
async fn a_session_turn_that_waits_for_kv_continues_the_conversation() {
    // 6 blocks of 16: the session holds 2 (24 positions), a running request 4 (50), and the
    // session's next turn needs 2 more (54): it waits, resolved once, until they are free.
    let h = harness(6);
    h.gpu.state.lock().unwrap().step_time = Duration::from_millis(5);
    let p1: Vec<u32> = (50..70).collect();
    let t1 = run(&h.backend, request(&p1, 4, SessionMode::Create(None))).await.unwrap();
    let big: Vec<u32> = (33..73).collect();
    let mut rx = h.backend.generate(request(&big, 10, SessionMode::None)).await.unwrap();
    let _ = rx.recv().await.unwrap().unwrap();
    let p2: Vec<u32> = (80..100).collect();
    let turn = tokio::spawn({
        let (backend, p2, session) = (h.backend.clone(), p2.clone(), t1.session.clone().unwrap());
        async move { run(&backend, request(&p2, 10, SessionMode::Continue(session))).await }
    });
    let mut saw_full = false;
    for _ in 0..200 {
        if h.backend.info().await.unwrap().kv_full {
            saw_full = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(saw_full, "the turn waits for KV");
    let mut ids = Vec::new();
    tokens(&mut rx, &mut ids, None).await;
    assert_eq!(ids, expected(&big, 10));
    let whole: Vec<u32> = p1.iter().chain(&t1.ids).chain(&p2).copied().collect();
    let got = turn.await.unwrap().unwrap();
    assert_eq!((got.ids, got.cached as usize), (expected(&whole, 10), p1.len() + 3));
}

#[tokio::test]
async fn a_prompt_starts_from_the_kv_cached_from_an_earlier_one() {
    let h = harness(64);
    let system: Vec<u32> = (40..90).collect();
    let with = |tail: &[u32]| [system.as_slice(), tail].concat();
    let a = run(&h.backend, request(&with(&[7, 8, 9]), 20, SessionMode::None)).await.unwrap();
    assert_eq!((a.ids, a.cached), (expected(&with(&[7, 8, 9]), 20), 0));
    // The system prompt's three whole blocks (48 of its 50 tokens) are not computed again,
    // by requests one after another or at once.
    let b = run(&h.backend, request(&with(&[11, 12]), 20, SessionMode::None)).await.unwrap();
    assert_eq!((b.ids, b.cached), (expected(&with(&[11, 12]), 20), 48));
    let tails: Vec<Vec<u32>> = (0..4).map(|i| vec![20 + i, 21, 22 + i]).collect();
    let runs = tails.iter().map(|t| run(&h.backend, request(&with(t), 30, SessionMode::None)));
    for (t, got) in tails.iter().zip(futures_util::future::join_all(runs).await) {
        let got = got.unwrap();
        assert_eq!((got.ids, got.cached), (expected(&with(t), 30), 48));
    }
    // Generated tokens' blocks are cached too: the first answer, sent back as a prompt.
    let mut again = with(&[7, 8, 9]);
    again.extend(expected(&again.clone(), 20));
    again.push(5);
    let c = run(&h.backend, request(&again, 5, SessionMode::None)).await.unwrap();
    assert_eq!((c.ids, c.cached), (expected(&again, 5), 64));
    // Shorter than a block past what is cached: nothing to share; every token scored: none used.
    assert_eq!(run(&h.backend, request(&system[..16], 3, SessionMode::None)).await.unwrap().cached, 0);
    let scored = GenerateParams { prompt_logprobs: true, ..request(&with(&[1]), 3, SessionMode::None) };
    assert_eq!(run(&h.backend, scored).await.unwrap().cached, 0);
    assert_eq!(h.backend.info().await.unwrap().cpu_workers[0].kv_blocks_free, 64, "cached blocks count as free");
    assert!(!h.gpu.state.lock().unwrap().taken_up.is_empty(), "cached KV reached the gpu-worker as held tokens");
}

#[tokio::test]
async fn a_session_never_writes_into_a_block_another_request_shares() {
    let h = harness(64);
    h.gpu.state.lock().unwrap().step_time = Duration::from_millis(2);
    // A conversation of 49 positions: its first three blocks are cached.
    let p1: Vec<u32> = (50..90).collect();
    let t1 = run(&h.backend, request(&p1, 10, SessionMode::Conversation("chat".into()))).await.unwrap();
    let mut history = p1.clone();
    history.extend(&t1.ids);
    // Another request shares those three blocks while the conversation is edited at
    // position 40, inside the third: the session must let go of that block, not rewrite it.
    let other = [&history[..48], &[3, 4, 5]].concat();
    let mut rx = h.backend.generate(request(&other, 40, SessionMode::None)).await.unwrap();
    let mut ids = Vec::new();
    while ids.is_empty() {
        match rx.recv().await.unwrap().unwrap() {
            Event::Prompt { cached_tokens, .. } => assert_eq!(cached_tokens, 48),
            Event::Token { id, .. } => ids.push(id),
            _ => {}
        }
    }
    let edited = [&p1[..], &[90, 91]].concat();
    let t2 = run(&h.backend, request(&edited, 8, SessionMode::Conversation("chat".into()))).await.unwrap();
    tokens(&mut rx, &mut ids, None).await;
    assert_eq!(ids, expected(&other, 40), "the shared blocks kept the conversation's first KV");
    assert_eq!((t2.ids, t2.cached), (expected(&edited, 8), 32), "the edit is computed from the block's start");
}

#[tokio::test]
async fn prompts_sent_at_once_compute_their_shared_blocks_once() {
    let h = harness(64);
    h.gpu.state.lock().unwrap().step_time = Duration::from_millis(1);
    // 70 shared tokens: four whole blocks, which one request computes and the others wait for.
    let system: Vec<u32> = (40..110).collect();
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| [system.as_slice(), &[20 + i, 21]].concat()).collect();
    let runs = prompts.iter().map(|p| run(&h.backend, request(p, 10, SessionMode::None)));
    let mut cached = Vec::new();
    for (p, got) in prompts.iter().zip(futures_util::future::join_all(runs).await) {
        let got = got.unwrap();
        assert_eq!(got.ids, expected(p, 10));
        cached.push(got.cached);
    }
    cached.sort_unstable();
    assert_eq!(cached, [0, 64, 64, 64]);
    // A request that shares nothing is not held up by them.
    let (a, b) = tokio::join!(run(&h.backend, request(&system, 30, SessionMode::None)), async {
        tokio::time::sleep(Duration::from_millis(5)).await;
        run(&h.backend, request(&[7; 40], 3, SessionMode::None)).await
    });
    assert_eq!((a.unwrap().cached, b.unwrap().cached), (64, 0));
}
