//! The continuous-batching scheduler: one task that owns the waiting and running requests,
//! the KV block tables and the sessions, and drives the gpu-worker one step at a time.
//! Requests join and leave between steps; prompts are prefilled in chunks under a per-step
//! token budget next to the running sequences' decode tokens.
//!
//! Admission reserves a request's worst case (prompt plus max_tokens) in KV blocks, so a
//! running request never runs out of KV; one that can never fit is refused with
//! RESOURCE_EXHAUSTED, one that cannot fit yet waits (idle sessions are evicted for it,
//! least recently used first).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use duet_kv::{KvPool, WorkerId};
use duet_model::chat::ChatMessage;
use tokio::sync::{mpsc, oneshot};

use crate::request::{CpuWorkerStatus, GenerateParams, Prompt, ServerInfo, SessionMode, TextModel};
use crate::error::GatewayError;
use crate::metrics;
use crate::balancer::stats::StepStats;
use crate::balancer::{Overlap, Policy};
use crate::sequence::{Events, Seq, Session};

mod admit;
mod gpu;
mod lost;
mod step;
#[cfg(test)]
mod tests;

pub use gpu::StepRunner;

/// What the scheduler task is asked to do.
#[derive(Debug)]
pub enum Command {
    /// The parameters boxed: they hold the sampling's logit bias and stop strings, and the
    /// other commands are small.
    Generate { params: Box<GenerateParams>, events: Events, arrived: Instant },
    CloseSession { session_id: String, reply: oneshot::Sender<Result<u32, GatewayError>> },
    Info { reply: oneshot::Sender<ServerInfo> },
    /// Switch the balancer's policy from the next step on.
    SetPolicy { policy: Policy },
    /// A cpu-worker died: the requests running on it fail; idle sessions with KV on it wait
    /// for [`Command::WorkerUp`] to learn whether its arena (their KV) was kept.
    WorkerDown { worker: u32, reason: String },
    /// A cpu-worker is (again) serving and attached to the gpu-worker; `kv_kept`: it re-attached
    /// to its predecessor's arena, or is the same process after a stall (`restarted` false), so
    /// the KV of the sessions on it is intact.
    WorkerUp { worker: u32, kv_kept: bool, restarted: bool },
    /// The gpu-worker died: every sequence is gone.
    GpuDown { reason: String },
    GpuUp,
    /// Refuse new requests, finish the running ones (until the deadline), then reply.
    Drain { deadline: Instant, reply: oneshot::Sender<()> },
}

/// The scheduler's settings.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Tokens per step (decode tokens plus prefill chunks).
    pub max_step_tokens: usize,
    /// Longest prefill chunk (the single-process runner's, so chunks match it).
    pub prefill_chunk: usize,
    /// Requests running at once; more wait.
    pub max_running: usize,
    /// The balancer's policy at start.
    pub policy: Policy,
    /// When decode steps run as two interleaved sub-batches.
    pub overlap: Overlap,
    /// Sessions idle this long are closed.
    pub session_idle: Duration,
    pub block_size: usize,
    pub blocks_per_worker: Vec<u32>,
    /// The model's context length.
    pub n_ctx: usize,
    pub model_name: String,
    pub vocab_size: u32,
    pub gpu_device: String,
    /// This node's name: session ids are `key@node`.
    pub node_name: String,
    /// The gpu-worker computes on the CPU cores the cpu-workers use (local mode without a
    /// GPU): the balancer plans their attention as taking turns, not running side by side.
    pub shared_cores: bool,
    /// Positions of KV the gpu-worker's GPU mirror holds (0: none, it attends on the host).
    pub gpu_kv_positions: usize,
    /// The gpu-worker makes up prompts' K/V (benchmarks only: `--synthetic-prefill`).
    pub synthetic_prefill: bool,
    /// Requests start from the cached KV of earlier ones with the same prompt prefix
    /// (`duet_kv::KvPool::table_with_prefix`).
    pub prefix_cache: bool,
}

/// The scheduler's command channel (made before the scheduler, so that the front ends can
/// be up while the workers start).
pub fn commands() -> (mpsc::Sender<Command>, mpsc::Receiver<Command>) {
    mpsc::channel(1024)
}

/// Starts the scheduler task on the receiving end of [`commands`].
pub fn spawn(rx: mpsc::Receiver<Command>, cfg: SchedulerConfig, text: Arc<TextModel>, gpu: Arc<dyn StepRunner>) -> tokio::task::JoinHandle<()> {
    let n_workers = cfg.blocks_per_worker.len();
    let pool = KvPool::new(cfg.block_size, &cfg.blocks_per_worker);
    let s = Scheduler {
        pool,
        text,
        gpu,
        waiting: VecDeque::new(),
        running: Vec::new(),
        sessions: HashMap::new(),
        lost_sessions: lost::LostSessions::default(),
        released: Vec::new(),
        in_flight: VecDeque::new(),
        next_seq: 1,
        next_serial: 1,
        step: 0,
        worker_up: vec![true; n_workers],
        restarts: vec![0; n_workers],
        gpu_up: true,
        gpu_generation: 0,
        gpu_pause_until: None,
        prefilled_total: 0,
        generated_total: 0,
        drain: None,
        kv_full: false,
        policy: cfg.policy,
        stats: StepStats::new(n_workers, cfg.shared_cores),
        cfg,
    };
    tokio::spawn(s.run(rx))
}

/// A request's whole conversation: its tokens, the session it keeps its KV in, and the
/// session's chat messages once this request's are added.
type Resolved = (Vec<u32>, SessionUse, Vec<ChatMessage>);

/// Which session a request keeps its KV in.
#[derive(Debug, Clone, PartialEq)]
enum SessionUse {
    None,
    /// One this node holds.
    Existing(String),
    /// A new one, by this name.
    New(String),
}

impl SessionUse {
    fn existing(&self) -> Option<&str> {
        match self {
            SessionUse::Existing(id) => Some(id),
            _ => None,
        }
    }
}

struct Waiting {
    params: GenerateParams,
    events: Events,
    arrived: Instant,
    /// The prompt's tokens once computed (it waited before), where they depend on the prompt
    /// alone (not on a session's history).
    prompt_ids: Option<Vec<u32>>,
}

struct Scheduler {
    cfg: SchedulerConfig,
    pool: KvPool,
    text: Arc<TextModel>,
    gpu: Arc<dyn StepRunner>,
    waiting: VecDeque<Waiting>,
    running: Vec<Seq>,
    sessions: HashMap<String, Session>,
    /// Sessions dropped with a failed worker, so that continuing one says so.
    lost_sessions: lost::LostSessions,
    /// Sequence ids the gpu-worker may forget (sent with the next step).
    released: Vec<u64>,
    /// Steps sent whose results are not applied yet, oldest first (at most two: the one
    /// running and the next, sent so that the gpu-worker never waits for the round trip).
    in_flight: VecDeque<step::InFlight>,
    next_seq: u64,
    next_serial: u64,
    step: u64,
    worker_up: Vec<bool>,
    restarts: Vec<u32>,
    gpu_up: bool,
    /// Counts gpu-worker restarts: a session sent to an older one is taken up again.
    gpu_generation: u64,
    /// A step could not reach the gpu-worker: admissions wait until then, long enough for the
    /// supervisor's watch to see whether it died (new requests then wait for it to be back
    /// instead of failing one after another against a dead address).
    gpu_pause_until: Option<Instant>,
    prefilled_total: u64,
    generated_total: u64,
    drain: Option<(Instant, oneshot::Sender<()>)>,
    /// The first waiting request waits for KV space (not for a running slot).
    kv_full: bool,
    /// The balancer's policy now.
    policy: Policy,
    /// Cost fits from the steps' timings.
    stats: StepStats,
}

/// How long an idle scheduler sleeps before checking session timeouts.
const IDLE_TICK: Duration = Duration::from_millis(500);

/// How long a request whose steps were lost with a worker waits for it to come back.
const RESUME_WAIT: Duration = Duration::from_secs(60);
/// How many times one request may be resumed after worker failures.
const MAX_RESUMES: u32 = 3;

/// How long a scheduler that could send no step waits for a command before trying again.
const STALL_TICK: Duration = Duration::from_millis(10);

impl Scheduler {
    async fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        // Nothing could be sent and nothing is in flight (no sequence fits the step budget).
        let mut stalled = false;
        loop {
            let idle = self.running.is_empty() && (self.waiting.is_empty() || !self.can_serve()) && self.released.is_empty();
            if idle && self.in_flight.is_empty() || stalled {
                match tokio::time::timeout(if stalled { STALL_TICK } else { IDLE_TICK }, rx.recv()).await {
                    Ok(Some(cmd)) => self.handle(cmd),
                    Ok(None) => return,
                    Err(_) => {}
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) if self.running.is_empty() && self.waiting.is_empty() => return,
                    Err(mpsc::error::TryRecvError::Disconnected) => break,
                }
            }
            self.expire_sessions();
            self.cancel_abandoned();
            self.fail_unresumable(None);
            if self.can_serve() {
                self.admit();
            }
            if let Some((deadline, _)) = &self.drain {
                if self.running.is_empty() && self.waiting.is_empty() || Instant::now() >= *deadline {
                    for seq in std::mem::take(&mut self.running) {
                        metrics::request_failed(false);
                        let _ = seq.events.send(Err(GatewayError::ShuttingDown));
                    }
                    for w in std::mem::take(&mut self.waiting) {
                        metrics::request_failed(false);
                        let _ = w.events.send(Err(GatewayError::ShuttingDown));
                    }
                    if let Some((_, reply)) = self.drain.take() {
                        let _ = reply.send(());
                    }
                    return;
                }
            }
            // Send the next step while one runs; then apply the oldest step's results.
            let mut sent = false;
            let gpu_reachable = self.gpu_up && self.gpu_pause_until.is_none_or(|t| Instant::now() >= t);
            if (!self.running.is_empty() || !self.released.is_empty()) && gpu_reachable && self.in_flight.len() < 2 {
                if let Some(f) = self.send_step() {
                    self.in_flight.push_back(f);
                    sent = true;
                }
            }
            let finish = self.in_flight.len() >= 2 || (!sent && !self.in_flight.is_empty());
            if finish {
                let f = self.in_flight.pop_front().expect("a step in flight");
                self.finish_step(f).await;
            }
            stalled = !sent && !finish && !self.running.is_empty();
            self.publish_metrics();
        }
    }

    fn can_serve(&self) -> bool {
        self.gpu_up && self.worker_up.iter().any(|&u| u) && self.gpu_pause_until.is_none_or(|t| Instant::now() >= t)
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Generate { params, events, arrived } => {
                // During a drain too: the listeners are closed by then, so a request that
                // still arrives was sent on a connection taken in before (the deadline bounds it).
                metrics::request_received();
                self.waiting.push_back(Waiting { params: *params, events, arrived, prompt_ids: None });
            }
            Command::CloseSession { session_id, reply } => {
                let result = match self.sessions.get(&session_id) {
                    None => Err(self.lost_sessions.missing(&session_id)),
                    Some(s) if s.table.is_none() => Err(GatewayError::SessionBusy(session_id)),
                    Some(_) => {
                        let s = self.sessions.remove(&session_id).expect("present");
                        self.released.push(s.seq_id);
                        Ok(s.table.map_or(0, |t| t.blocks().len() as u32))
                    }
                };
                let _ = reply.send(result);
            }
            Command::Info { reply } => {
                let _ = reply.send(self.info());
            }
            Command::SetPolicy { policy } => {
                tracing::info!(from = %self.policy, to = %policy, "balancer policy changed");
                self.policy = policy;
                self.stats.reset_errors();
            }
            Command::WorkerDown { worker, reason } => self.worker_down(worker, &reason),
            Command::WorkerUp { worker, kv_kept, restarted } => {
                let Some(&was_up) = self.worker_up.get(worker as usize) else { return };
                if !was_up {
                    // (Not restarted: the same process answers again, after a stall.)
                    self.restarts[worker as usize] += u32::from(restarted);
                    if !kv_kept {
                        self.pool.forget_cached(WorkerId(worker));
                        self.fail_unresumable(Some(worker));
                        self.drop_sessions_on(worker, &format!("its KV was on cpu-worker {worker}, which restarted without it"));
                    }
                }
                self.worker_up[worker as usize] = true;
                tracing::info!(worker, kv_kept, "cpu-worker is serving again");
            }
            Command::GpuDown { reason } => {
                self.gpu_up = false;
                // Their results are errors; the next gpu-worker has not seen them.
                for f in std::mem::take(&mut self.in_flight) {
                    f.abort();
                }
                // Requests and sessions stay: their KV is in the cpu-workers' arenas, and the
                // next gpu-worker takes each sequence up from it (`Seq::restore`); running
                // requests wait for it (up to RESUME_WAIT) and go on from their last applied step.
                self.rewind_all(&format!("the gpu-worker failed ({reason})"));
                self.released.clear();
            }
            Command::GpuUp => {
                if !self.gpu_up {
                    self.gpu_generation += 1;
                    // The new gpu-worker knows no sequence: each running one is taken up again.
                    self.running.iter_mut().for_each(Seq::take_up_again);
                }
                self.gpu_up = true;
            }
            // The requests taken in (running, waiting, and any still arriving on connections
            // open before the listeners closed) finish, up to the deadline.
            Command::Drain { deadline, reply } => {
                self.drain = Some((deadline, reply));
            }
        }
    }

    /// Fails the requests with KV on a dead cpu-worker; their sessions go back to where the
    /// requests found them, and like every idle session with KV on the worker they wait until
    /// it is back ([`Command::WorkerUp`] says whether its KV was kept).
    fn worker_down(&mut self, worker: u32, reason: &str) {
        if let Some(up) = self.worker_up.get_mut(worker as usize) {
            *up = false;
        }
        // The steps in flight are lost; requests with KV on the worker wait for it (steps
        // skip them meanwhile), the others go on at once.
        self.rewind_all(&format!("cpu-worker {worker} failed ({reason})"));
    }

    /// Every running request back to its last applied step (the steps in flight are lost):
    /// it goes on from there once its workers serve, except one that cannot be resumed (a
    /// grammar's matcher cannot be rewound; resumed too often), which fails with `why`.
    fn rewind_all(&mut self, why: &str) {
        for f in std::mem::take(&mut self.in_flight) {
            f.abort();
        }
        let mut failed = Vec::new();
        for (i, seq) in self.running.iter_mut().enumerate() {
            // One outage is one resume, however many failures it brings (the gpu-worker and
            // each cpu-worker going down, the step in flight failing): a request counts
            // again only once it has run since.
            if seq.paused_since.is_none() {
                seq.resumes += 1;
            }
            seq.rewind();
            if seq.sampling.grammar.is_some() || seq.resumes > MAX_RESUMES {
                failed.push((i, Err(GatewayError::Unavailable(format!("{why}; the request could not be resumed")))));
            }
        }
        tracing::warn!(requests = self.running.len(), failed = failed.len(), "{why}: running requests wait to resume");
        self.conclude(failed);
    }

    /// The gpu-worker answered without knowing sequences it should (it restarted and the
    /// step reached the new process): every running request goes back to its last applied
    /// step and is taken up again from the arenas (held tokens and every block replace what
    /// the worker holds of it, so taking up a sequence it knows is harmless).
    fn gpu_lost_sequences(&mut self) {
        self.rewind_all("the gpu-worker lost its sequences (it restarted)");
    }

    /// Fails the requests that waited for a worker longer than RESUME_WAIT, or whose KV was on
    /// a cpu-worker that came back without it.
    fn fail_unresumable(&mut self, lost_worker: Option<u32>) {
        let now = Instant::now();
        // The workers a request waited for: the gpu-worker, or those of its KV that are down.
        let waited_for = |s: &Seq| {
            let mut down: Vec<String> = (!self.gpu_up).then(|| "the gpu-worker".to_string()).into_iter().collect();
            let mut workers: Vec<u32> = self.workers_down(&s.table).collect();
            workers.sort_unstable();
            workers.dedup();
            down.extend(workers.into_iter().map(|w| format!("cpu-worker {w}")));
            if down.is_empty() {
                "its workers".to_string()
            } else {
                down.join(" and ")
            }
        };
        let outcomes: Vec<_> = self
            .running
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let on_lost = lost_worker.is_some_and(|w| s.table.blocks().iter().any(|b| b.0 == WorkerId(w)));
                let waited = s.paused_since.is_some_and(|t| now.duration_since(t) > RESUME_WAIT);
                (on_lost || waited).then(|| {
                    let why = match lost_worker.filter(|_| on_lost) {
                        Some(w) => format!("cpu-worker {w} restarted without the request's KV"),
                        None => format!("{} did not come back within {} s to resume it", waited_for(s), RESUME_WAIT.as_secs()),
                    };
                    (i, Err(GatewayError::Unavailable(why)))
                })
            })
            .collect();
        if !outcomes.is_empty() {
            self.conclude(outcomes);
        }
    }

    /// Drops the idle sessions with KV on `worker` (its arena was not kept), recording why.
    fn drop_sessions_on(&mut self, worker: u32, why: &str) {
        let on_worker = |t: &duet_kv::BlockTable| t.blocks().iter().any(|b| b.0 == WorkerId(worker));
        let dead: Vec<String> =
            self.sessions.iter().filter(|(_, s)| s.table.as_ref().is_some_and(on_worker)).map(|(k, _)| k.clone()).collect();
        for id in dead {
            // Dropping the table gives its blocks back to the pool.
            let s = self.sessions.remove(&id).expect("listed");
            self.released.push(s.seq_id);
            self.lost_sessions.record(id, why);
        }
    }

    fn info(&self) -> ServerInfo {
        let cpu_workers = (0..self.pool.n_workers())
            .map(|w| {
                let id = WorkerId(w as u32);
                CpuWorkerStatus {
                    worker: w as u32,
                    kv_blocks: self.cfg.blocks_per_worker[w],
                    kv_blocks_free: self.pool.n_free(id) as u32,
                    ready: self.worker_up[w],
                    restarts: self.restarts[w],
                }
            })
            .collect();
        ServerInfo {
            model: self.cfg.model_name.clone(),
            context_length: self.cfg.n_ctx as u32,
            vocab_size: self.cfg.vocab_size,
            gpu_device: self.cfg.gpu_device.clone(),
            cpu_workers,
            kv_block_size: self.cfg.block_size as u32,
            sessions: self.sessions.len() as u32,
            active_requests: (self.running.len() + self.waiting.len()) as u32,
            kv_full: self.kv_full,
            policy: self.policy.to_string(),
            prediction_error: self.stats.prediction_error(),
            prefilled_tokens_total: self.prefilled_total,
            generated_tokens_total: self.generated_total,
            synthetic_prefill: self.cfg.synthetic_prefill,
        }
    }

    /// Queue, session and KV gauges.
    pub(super) fn publish_metrics(&self) {
        metrics::queues(self.waiting.len(), self.running.len(), self.sessions.len());
        for w in 0..self.pool.n_workers() {
            let id = WorkerId(w as u32);
            metrics::cpu_worker(w as u32, self.cfg.blocks_per_worker[w], self.pool.n_free(id), self.pool.n_cached(id), self.worker_up[w]);
        }
    }

    fn expire_sessions(&mut self) {
        let now = Instant::now();
        let idle = self.cfg.session_idle;
        let expired: Vec<String> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.table.is_some() && now.duration_since(s.last_used) >= idle)
            .map(|(k, _)| k.clone())
            .collect();
        for id in expired {
            let s = self.sessions.remove(&id).expect("listed");
            tracing::info!(session = %id, "session closed after {idle:?} idle");
            self.released.push(s.seq_id);
        }
    }

    /// Frees the KV of requests whose client went away.
    fn cancel_abandoned(&mut self) {
        self.waiting.retain(|w| {
            let gone = w.events.is_closed();
            if gone {
                metrics::request_failed(true);
            }
            !gone
        });
        let (gone, kept): (Vec<Seq>, Vec<Seq>) = std::mem::take(&mut self.running).into_iter().partition(Seq::cancelled);
        self.running = kept;
        for seq in gone {
            tracing::info!(seq = seq.id, blocks = seq.table.blocks().len(), "client went away: request cancelled, KV blocks freed");
            metrics::request_failed(true);
            if let Some((id, _)) = &seq.session {
                self.sessions.remove(id);
            }
            self.released.push(seq.id);
        }
    }

    fn free_blocks(&self) -> usize {
        (0..self.pool.n_workers()).filter(|&w| self.worker_up[w]).map(|w| self.pool.n_free(WorkerId(w as u32))).sum()
    }

    fn total_blocks(&self) -> usize {
        self.cfg.blocks_per_worker.iter().map(|&b| b as usize).sum()
    }

    /// The whole conversation's tokens for a request, the session it keeps its KV in, and
    /// the session's chat messages once this request's are added.
    /// `known`: the prompt's tokens, if computed before.
    fn resolve(&self, p: &GenerateParams, known: Option<Vec<u32>>) -> Result<Resolved, GatewayError> {
        let whole = |session: SessionUse, known: Option<Vec<u32>>| -> Result<Resolved, GatewayError> {
            let messages = match &p.prompt {
                Prompt::Chat { messages, .. } => messages.clone(),
                _ => Vec::new(),
            };
            let ids = match known {
                Some(ids) => ids,
                None => self.text.prompt_ids(&p.prompt)?,
            };
            Ok((ids, session, messages))
        };
        let id = match &p.session {
            SessionMode::None => return whole(SessionUse::None, known),
            SessionMode::Create(key) => {
                let name = match key {
                    Some(key) => self.session_name(key)?,
                    None => format!("{}@{}", new_session_key(), self.cfg.node_name),
                };
                if self.sessions.contains_key(&name) {
                    return Err(GatewayError::SessionExists(name));
                }
                return whole(SessionUse::New(name), known);
            }
            SessionMode::Conversation(id) => {
                let name = self.session_name(id)?;
                if !self.sessions.contains_key(&name) {
                    // The request carries the whole conversation: nothing is lost by
                    // starting the session afresh (after it expired or was evicted).
                    return whole(SessionUse::New(name), known);
                }
                self.check_session(&name)?;
                return whole(SessionUse::Existing(name), known);
            }
            SessionMode::Continue(id) => id,
        };
        if !self.sessions.contains_key(id) {
            if let Some((_, node)) = id.split_once('@').filter(|(_, node)| *node != self.cfg.node_name) {
                return Err(self.elsewhere(id, node));
            }
        }
        self.check_session(id)?;
        let s = &self.sessions[id];
        let mut full = s.history.clone();
        let mut messages = s.messages.clone();
        // A chat turn is rendered from the session's messages, which text turns do not add
        // to: mixing the two would silently drop turns from the conversation.
        let chat_turn = matches!(p.prompt, Prompt::Chat { .. });
        if !s.history.is_empty() && chat_turn == messages.is_empty() {
            let (was, send) = if chat_turn { ("text", "text or token ids") } else { ("chat", "chat messages") };
            return Err(GatewayError::InvalidArgument(format!("session {id} holds a {was} conversation: continue it with {send}")));
        }
        if let Prompt::Chat { messages: new, .. } = &p.prompt {
            messages.extend(new.iter().cloned());
        }
        if let Some(ids) = known {
            // Resolved when it first tried and waited for KV: nothing was admitted before it
            // meanwhile, so the session is as it was (and rendering a long conversation again
            // on every try would hold up the scheduler's steps).
            return Ok((ids, SessionUse::Existing(id.clone()), messages));
        }
        match &p.prompt {
            Prompt::Chat { tools, .. } => {
                full = self.text.prompt_ids(&Prompt::Chat { messages: messages.clone(), tools: tools.clone() })?;
            }
            Prompt::Text(t) => full.extend(self.text.tokenizer.encode(t, true)?),
            Prompt::Tokens(ids) => {
                self.text.tokenizer.check_ids(ids)?;
                full.extend_from_slice(ids);
            }
        }
        Ok((full, SessionUse::Existing(id.clone()), messages))
    }

    /// The full name of a session from a client's key or id: `key@node` for a key; an id
    /// naming another node is an error that names the node.
    fn session_name(&self, key_or_id: &str) -> Result<String, GatewayError> {
        match key_or_id.split_once('@') {
            None => Ok(format!("{key_or_id}@{}", self.cfg.node_name)),
            Some((_, node)) if node == self.cfg.node_name => Ok(key_or_id.to_string()),
            Some((_, node)) => Err(self.elsewhere(key_or_id, node)),
        }
    }

    fn elsewhere(&self, session: &str, node: &str) -> GatewayError {
        GatewayError::SessionElsewhere { session: session.to_string(), node: node.to_string(), here: self.cfg.node_name.clone() }
    }

    /// The cpu-workers that hold blocks of `table` and are down (once per block).
    fn workers_down<'a>(&'a self, table: &'a duet_kv::BlockTable) -> impl Iterator<Item = u32> + 'a {
        table.blocks().iter().map(|b| b.0 .0).filter(|&w| !self.worker_up.get(w as usize).copied().unwrap_or(true))
    }

    /// A session this node holds can take a request now: it is idle and its KV's workers serve.
    fn check_session(&self, id: &str) -> Result<(), GatewayError> {
        let s = self.sessions.get(id).ok_or_else(|| self.lost_sessions.missing(id))?;
        let Some(table) = &s.table else { return Err(GatewayError::SessionBusy(id.to_string())) };
        if let Some(down) = self.workers_down(table).next() {
            return Err(GatewayError::Unavailable(format!(
                "session {id}: its KV is on cpu-worker {down}, which is restarting; retry shortly (the session is kept if the worker's arena is)"
            )));
        }
        Ok(())
    }
}

/// A random session key (for sessions created without one).
fn new_session_key() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    let a = h.finish();
    let mut h2 = std::collections::hash_map::RandomState::new().build_hasher();
    h2.write_u64(a);
    format!("{a:016x}{:016x}", h2.finish())
}
