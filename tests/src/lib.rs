//! Harness of the multi-process tests: starts the real `duet-gateway serve` (which spawns
//! the real workers) on a free port with a unique instance name, streams generations from
//! it over gRPC, and runs the single-process reference to compare with.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use duet_proto::pb::inference_client::InferenceClient;
use duet_proto::{channel, pb, Address};
use duet_gpu_worker::runner::{Runner, GenerateRequest};
use duet_gpu_worker::sampler::SamplingParams;
use tonic::transport::Channel;

/// A binary of the workspace, built by `cargo build --workspace` (or `cargo test --workspace`).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target/<profile>/deps/..");
    let path = dir.join(name);
    assert!(path.exists(), "{} is missing: run `cargo build --workspace` (scripts/test.sh does)", path.display());
    path
}

/// A running gateway with its workers.
pub struct Gateway {
    child: Option<Child>,
    pub addr: String,
    /// The OpenAI-compatible HTTP address (host:port).
    pub http_addr: String,
    pub instance: String,
    pub runtime_dir: PathBuf,
    pub log: PathBuf,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

impl Gateway {
    /// Starts `duet-gateway serve` on the default model with `extra` flags and waits until it listens.
    pub fn start(extra: &[&str]) -> Gateway {
        Self::start_with_model(&duet_model::testutil::model_path(), extra)
    }

    /// Starts `duet-gateway serve` on `model` with `extra` flags and waits until it listens.
    pub fn start_with_model(model: &std::path::Path, extra: &[&str]) -> Gateway {
        let instance = format!("t{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed));
        let runtime_dir = std::env::temp_dir().join(format!("duet-test-{instance}"));
        let log = std::env::temp_dir().join(format!("duet-test-{instance}.log"));
        let log_file = std::fs::File::create(&log).expect("log file");
        let mut child = Command::new(bin("duet-gateway"))
            .args(["serve", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--instance", &instance])
            .args(if extra.contains(&"--kv-bytes") { &[][..] } else { &["--kv-bytes", "128M"][..] })
            .arg("--runtime-dir")
            .arg(&runtime_dir)
            .arg("--model")
            .arg(model)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file)
            .spawn()
            .expect("spawning duet-gateway");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(addr) = line.strip_prefix("duet-gateway http listening on ") {
                    let _ = tx.send((true, addr.to_string()));
                } else if let Some(addr) = line.strip_prefix("duet-gateway listening on ") {
                    let _ = tx.send((false, addr.to_string()));
                }
            }
        });
        let mut gw = Gateway { child: Some(child), addr: String::new(), http_addr: String::new(), instance, runtime_dir, log };
        while gw.addr.is_empty() {
            match rx.recv_timeout(Duration::from_secs(180)) {
                Ok((true, addr)) => gw.http_addr = addr,
                Ok((false, addr)) => gw.addr = addr,
                Err(_) => panic!("the gateway did not come up; its log:\n{}", gw.log_tail()),
            }
        }
        gw
    }

    /// The last lines of the gateway's (and its workers') log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    pub fn client(&self) -> InferenceClient<Channel> {
        let addr: Address = self.addr.parse().expect("gateway address");
        InferenceClient::new(channel(&addr).expect("channel"))
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// SIGTERM, then the exit status (SIGKILL after 60 s).
    pub fn stop(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                return status;
            }
            if start.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                panic!("the gateway did not stop within 60 s of SIGTERM; log:\n{}", self.log_tail());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.stop();
        }
    }
}

/// Processes whose command line contains all of `needles` (from /proc).
pub fn pids_with(needles: &[&str]) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else { continue };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if needles.iter().all(|n| cmd.contains(n)) {
            out.push(pid);
        }
    }
    out
}

/// What one generation returned.
#[derive(Debug, Clone, Default)]
pub struct Generated {
    pub prompt: pb::PromptInfo,
    pub ids: Vec<u32>,
    pub text: String,
    /// Per token: the top log-probabilities, when asked for.
    pub top: Vec<Vec<(u32, f32)>>,
    /// The prompt's tokens scored, when asked for (`prompt_logprobs`).
    pub prompt_logprobs: Vec<pb::GeneratedToken>,
    pub finished: Option<pb::Finished>,
}

/// A greedy request for token ids.
pub fn greedy(prompt_ids: Vec<u32>, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Tokens(pb::TokenIds { ids: prompt_ids })),
        max_tokens: Some(max_tokens),
        ..Default::default()
    }
}

/// Streams a generation to its end.
pub async fn generate(client: &mut InferenceClient<Channel>, req: pb::GenerateRequest) -> Result<Generated, tonic::Status> {
    use pb::generate_response::Event;
    let mut stream = client.generate(req).await?.into_inner();
    let mut g = Generated::default();
    let mut first = true;
    while let Some(msg) = stream.message().await? {
        match msg.event {
            Some(Event::Prompt(p)) => {
                assert!(first, "the prompt event comes first");
                g.prompt = p;
            }
            Some(Event::Token(t)) => {
                g.ids.push(t.id);
                g.text.push_str(&t.text);
                g.top.push(t.top_logprobs.iter().map(|l| (l.id, l.logprob)).collect());
            }
            Some(Event::PromptLogprobs(p)) => {
                assert!(g.ids.is_empty(), "the prompt is scored before the first token");
                g.prompt_logprobs.extend(p.tokens);
            }
            Some(Event::Finished(f)) => {
                g.text.push_str(&f.text);
                g.finished = Some(f);
            }
            None => panic!("an empty event"),
        }
        first = false;
    }
    assert!(g.finished.is_some(), "the stream ended without a Finished event");
    Ok(g)
}

/// The single-process reference's greedy generation with the top-2 log-probabilities.
pub struct Reference {
    engine: Runner,
}

/// One reference generation: ids and, per position, the margin between the two most likely tokens.
#[derive(Debug, Clone)]
pub struct RefGeneration {
    pub ids: Vec<u32>,
    pub margins: Vec<f64>,
}

impl Reference {
    pub fn load() -> Reference {
        Self::load_model(&duet_model::testutil::model_path())
    }

    pub fn load_model(model: &std::path::Path) -> Reference {
        Reference { engine: Runner::load(model).expect("loading the model") }
    }

    /// The reference with its cache in `kv_type` (f16 unless set).
    pub fn with_kv_type(mut self, kv_type: duet_kv::KvDtype) -> Reference {
        self.engine.kv_type = kv_type;
        self
    }

    /// Each prompt token's log-probability after the first (`Runner::prompt_logprobs`).
    pub fn prompt_logprobs(&self, prompt_ids: &[u32]) -> Vec<f64> {
        self.engine.prompt_logprobs(prompt_ids).expect("reference prompt log-probabilities")
    }

    pub fn generate(&self, prompt_ids: &[u32], max_tokens: usize) -> RefGeneration {
        let req = GenerateRequest { prompt_ids: prompt_ids.to_vec(), max_tokens, sampling: SamplingParams::default(), top_n: 2 };
        let g = self.engine.generate(&req, |_| {}).expect("reference generation");
        RefGeneration { margins: g.top.iter().map(|t| t[0].1 - t[1].1).collect(), ids: g.generated_ids }
    }
}

/// Compares a generation with the reference: `Ok(true)` if identical, `Ok(false)` if they
/// part only where the reference's two best tokens were within `near_tie` (rounding may
/// flip such a choice), `Err` with the position otherwise.
pub fn same_up_to_near_tie(got: &[u32], want: &RefGeneration, near_tie: f64) -> Result<bool, String> {
    for (pos, &w) in want.ids.iter().enumerate() {
        match got.get(pos) {
            Some(&g) if g == w => continue,
            other => {
                if want.margins[pos] < near_tie {
                    return Ok(false);
                }
                return Err(format!("position {pos}: got {other:?}, reference {w} (top-2 margin {:.3})", want.margins[pos]));
            }
        }
    }
    if got.len() != want.ids.len() {
        return Err(format!("{} tokens, reference {}", got.len(), want.ids.len()));
    }
    Ok(true)
}
