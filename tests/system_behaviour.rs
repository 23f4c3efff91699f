//! The service as a client meets it, on one gateway with one cpu-worker: info and
//! tokenisation, bad input getting the right status while another stream carries on, a
//! client that disconnects (its KV blocks come back), stop strings, sessions (a second turn
//! prefills only the new tokens and generates what a fresh request would), the cpu-worker and
//! then the gpu-worker killed mid-generation (the streams resume and complete with the tokens
//! of an uninterrupted run, sessions go on from the KV kept in the arena), a clean stop, and
//! prompts that start from the KV cached from an earlier one with the same prefix.

use std::time::{Duration, Instant};

use duet_proto::pb;
use duet_tests::{generate, greedy, pids_with, same_up_to_near_tie, Gateway, RefGeneration, Reference};
use tonic::Code;

async fn info(gw: &Gateway) -> pb::InfoResponse {
    gw.client().info(pb::InfoRequest {}).await.expect("Info").into_inner()
}

async fn tokenize(gw: &Gateway, text: &str) -> Vec<u32> {
    let req = pb::TokenizeRequest { text: text.into(), ..Default::default() };
    gw.client().tokenize(req).await.expect("Tokenize").into_inner().ids
}

fn text_req(text: &str, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest { prompt: Some(pb::generate_request::Prompt::Text(text.into())), max_tokens: Some(max_tokens), ..Default::default() }
}

async fn expect_code(gw: &Gateway, what: &str, req: pb::GenerateRequest, code: Code) -> tonic::Status {
    match generate(&mut gw.client(), req).await {
        Ok(g) => panic!("{what}: expected {code:?}, got a generation of {} tokens", g.ids.len()),
        Err(s) => {
            assert_eq!(s.code(), code, "{what}: {}", s.message());
            println!("{what}: {code:?}: {}", s.message());
            s
        }
    }
}

/// Polls `Info` until `ok` holds.
async fn wait_info(gw: &Gateway, what: &str, timeout: Duration, ok: impl Fn(&pb::InfoResponse) -> bool) -> pb::InfoResponse {
    let start = Instant::now();
    loop {
        let i = info(gw).await;
        if ok(&i) {
            return i;
        }
        assert!(start.elapsed() < timeout, "{what}: not within {timeout:?}; last Info: {i:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `serve --device cuda` on a machine without a usable GPU stops at once, passing on the
/// gpu-worker's reason (the probe's), and leaves no worker behind.
#[test]
fn serve_with_an_unusable_device_fails_with_the_reason() {
    let why = match duet_gpu_worker::device::cuda::probe(0) {
        Ok(gpu) => return eprintln!("skipped: {} is a usable GPU (the GPU tests serve on it)", gpu.name),
        Err(why) => why,
    };
    let instance = format!("device-test-{}", std::process::id());
    let out = std::process::Command::new(duet_tests::bin("duet-gateway"))
        .args(["serve", "--device", "cuda", "--cpu-workers", "1", "--kv-bytes", "64M", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"])
        .args(["--instance", &instance, "--model"])
        .arg(duet_model::testutil::model_path())
        .env_remove("DUET_DEVICE")
        .output()
        .expect("starting duet-gateway");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "serve --device cuda started: {err}");
    assert!(err.contains("the cuda device cannot be used") && err.contains(&why) && err.contains("exited before it was ready"), "{err}");
    assert!(pids_with(&[&instance]).is_empty(), "workers of {instance} left running");
}

/// SIGTERM while the workers start (health "loading"): the gateway stops the workers it
/// spawned, removes their shared memory and exits cleanly, as it does once serving.
#[test]
fn a_signal_while_the_workers_start_stops_them() {
    let instance = format!("start-signal-{}", std::process::id());
    let runtime_dir = std::env::temp_dir().join(format!("duet-test-{instance}"));
    let log_path = std::env::temp_dir().join(format!("duet-test-{instance}.log"));
    let mut gw = std::process::Command::new(duet_tests::bin("duet-gateway"))
        .args(["serve", "--cpu-workers", "1", "--kv-bytes", "64M", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"])
        .args(["--instance", &instance, "--runtime-dir"])
        .arg(&runtime_dir)
        .arg("--model")
        .arg(duet_model::testutil::model_path())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log_path).expect("log file"))
        .spawn()
        .expect("starting duet-gateway");
    // Both workers spawned: the gateway is waiting for them to load the model.
    let start = Instant::now();
    while pids_with(&["duet-gpu-worker", &runtime_dir.to_string_lossy()]).is_empty() || pids_with(&["duet-cpu-worker", &instance]).is_empty() {
        assert!(start.elapsed() < Duration::from_secs(30), "the workers of {instance} did not start");
        std::thread::sleep(Duration::from_millis(5));
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(gw.id() as libc::pid_t, libc::SIGTERM) };
    let status = wait_exit(&mut gw, Duration::from_secs(60));
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(status.success(), "exit {status}: {log}");
    if !log.contains("stopped while starting") {
        // A machine fast enough to load the model before the signal lands: the usual stop.
        println!("the workers were ready before the signal; the gateway stopped as when serving");
    }
    assert!(pids_with(&[&instance]).is_empty(), "workers of {instance} left running; log:\n{log}");
    let shm: Vec<_> = std::fs::read_dir("/dev/shm").unwrap().flatten().filter(|e| e.file_name().to_string_lossy().contains(&instance)).collect();
    assert!(shm.is_empty(), "segments of {instance} left in /dev/shm: {shm:?}");
    assert!(!runtime_dir.exists(), "{} left behind", runtime_dir.display());
    let _ = std::fs::remove_file(&log_path);
}

/// Waits for `child` to exit (killing it after `timeout`).
fn wait_exit(child: &mut std::process::Child, timeout: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            panic!("the gateway did not stop within {timeout:?} of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_behaves_as_a_client_expects() {
    // Without the prefix cache: the "fresh" requests below compute their whole prompts.
    let mut gw = Gateway::start(&["--cpu-workers", "1", "--no-prefix-cache"]);
    let i = info(&gw).await;
    assert_eq!((i.context_length, i.vocab_size, i.cpu_workers.len()), (8192, 49152, 1));
    assert!(i.kv_capacity_tokens > 1000 && i.kv_free_tokens == i.kv_capacity_tokens, "{i:?}");
    // The default `--device auto` runs the gpu-worker's CPU device (no CUDA in this build).
    assert!(i.gpu_device.starts_with("cpu ("), "{i:?}");
    let ids = tokenize(&gw, "Hello world").await;
    let text = gw.client().detokenize(pb::DetokenizeRequest { ids: ids.clone() }).await.unwrap().into_inner().text;
    assert_eq!(text, "Hello world");

    // Bad input while a good stream runs: each gets its status, the stream is untouched.
    let counting = "1, 2, 3, 4, 5, 6, 7,";
    let mut c = gw.client();
    let long = tokio::spawn(async move { generate(&mut c, text_req(counting, 96)).await });
    expect_code(&gw, "empty prompt", text_req("", 8), Code::InvalidArgument).await;
    expect_code(&gw, "no prompt", pb::GenerateRequest::default(), Code::InvalidArgument).await;
    expect_code(&gw, "prompt longer than the context", greedy(vec![28; 9000], 8), Code::InvalidArgument).await;
    expect_code(&gw, "token id out of the vocabulary", greedy(vec![999_999], 8), Code::InvalidArgument).await;
    for (what, s) in [
        ("negative temperature", pb::SamplingParams { temperature: Some(-1.0), ..Default::default() }),
        ("top_p 0", pb::SamplingParams { top_p: Some(0.0), ..Default::default() }),
        ("min_p 1.5", pb::SamplingParams { min_p: Some(1.5), ..Default::default() }),
        ("repetition_penalty 0", pb::SamplingParams { repetition_penalty: Some(0.0), ..Default::default() }),
    ] {
        expect_code(&gw, what, pb::GenerateRequest { sampling: Some(s), ..text_req("Hi", 4) }, Code::InvalidArgument).await;
    }
    expect_code(&gw, "top_logprobs 50", pb::GenerateRequest { top_logprobs: 50, ..text_req("Hi", 4) }, Code::InvalidArgument).await;
    expect_code(&gw, "max_tokens 0", text_req("Hi", 0), Code::InvalidArgument).await;
    expect_code(&gw, "unknown session", pb::GenerateRequest { session_id: Some("nope".into()), ..text_req("Hi", 4) }, Code::NotFound).await;
    expect_code(&gw, "more KV than the cpu-workers hold", text_req("Hi", 8000), Code::ResourceExhausted).await;
    // Prompt and max_tokens beyond the context (8192) are refused, not shortened.
    let status = expect_code(&gw, "max_tokens past the context", text_req("Hi", 8192), Code::InvalidArgument).await;
    assert!(status.message().contains("context holds 8192 tokens"), "{}", status.message());
    let long = long.await.unwrap().expect("the good stream survives the bad requests");
    assert_eq!(long.ids.len(), 96, "{:?}", long.finished);
    assert!(long.text.starts_with(" 8, 9, 10"), "{:?}", long.text);

    // Stop strings cut the text and end the generation.
    let g = generate(&mut gw.client(), pb::GenerateRequest { stop: vec![" 11".into()], ..text_req(counting, 64) }).await.unwrap();
    let f = g.finished.unwrap();
    assert_eq!(f.reason, pb::StopReason::StopString as i32);
    assert_eq!(g.text, " 8, 9, 10,");

    // A client that goes away: its KV blocks come back.
    {
        let mut stream = gw.client().generate(text_req(counting, 400)).await.unwrap().into_inner();
        for _ in 0..6 {
            stream.message().await.unwrap().unwrap();
        }
        let busy = info(&gw).await;
        assert!(busy.kv_free_tokens < busy.kv_capacity_tokens, "blocks in use while streaming: {busy:?}");
        println!("streaming: {} of {} KV tokens free", busy.kv_free_tokens, busy.kv_capacity_tokens);
    }
    let i = wait_info(&gw, "KV freed after the client left", Duration::from_secs(20), |i| {
        i.kv_free_tokens == i.kv_capacity_tokens && i.active_requests == 0
    })
    .await;
    println!("client gone: {} of {} KV tokens free", i.kv_free_tokens, i.kv_capacity_tokens);

    // Sessions: the second turn prefills only what is new and generates what a fresh
    // request with the whole conversation generates.
    let p1 = tokenize(&gw, "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n").await;
    let t1 = generate(&mut gw.client(), pb::GenerateRequest { create_session: true, ..greedy(p1.clone(), 24) }).await.unwrap();
    let session = t1.prompt.session_id.clone();
    assert!(!session.is_empty(), "a session id comes in the first message");
    assert_eq!(info(&gw).await.sessions, 1);
    let p2 = tokenize(&gw, "\n<|im_start|>user\nAnd three animals?<|im_end|>\n<|im_start|>assistant\n").await;
    let before = info(&gw).await.prefilled_tokens_total;
    let t2 = generate(&mut gw.client(), pb::GenerateRequest { session_id: Some(session.clone()), top_logprobs: 2, ..greedy(p2.clone(), 24) })
        .await
        .unwrap();
    let after = info(&gw).await.prefilled_tokens_total;
    let kept = p1.len() + t1.ids.len() - 1; // the last sampled token was never fed
    assert_eq!(t2.prompt.cached_tokens as usize, kept);
    let usage = t2.finished.clone().unwrap().usage.unwrap();
    assert_eq!(usage.prefilled_tokens as usize, p2.len() + 1, "only the new tokens (and turn 1's last) are prefilled");
    assert_eq!((after - before) as usize, p2.len() + 1);
    assert_eq!(usage.prompt_tokens as usize, p1.len() + t1.ids.len() + p2.len());
    let mut whole = p1.clone();
    whole.extend(&t1.ids);
    whole.extend(&p2);
    let fresh = generate(&mut gw.client(), pb::GenerateRequest { top_logprobs: 2, ..greedy(whole, 24) }).await.unwrap();
    let fresh_ref = RefGeneration { margins: fresh.top.iter().map(|t| (t[0].1 - t[1].1) as f64).collect(), ids: fresh.ids.clone() };
    let same = same_up_to_near_tie(&t2.ids, &fresh_ref, 0.5).unwrap_or_else(|e| panic!("second turn vs fresh request: {e}"));
    println!("session turn 2: {} tokens prefilled instead of {}; identical to the fresh request: {same}", p2.len() + 1, usage.prompt_tokens);
    let freed = gw.client().close_session(pb::CloseSessionRequest { session_id: session.clone() }).await.unwrap().into_inner().freed_blocks;
    assert!(freed > 0);
    let again = gw.client().close_session(pb::CloseSessionRequest { session_id: session }).await.unwrap_err();
    assert_eq!(again.code(), Code::NotFound);
    wait_info(&gw, "KV free after closing the session", Duration::from_secs(5), |i| i.kv_free_tokens == i.kv_capacity_tokens && i.sessions == 0).await;

    // A turn that ends on a stop string: the scheduler had already sent the next decode step
    // (each step goes out while the one before runs), so the gpu-worker computed a position
    // the turn does not keep. The session holds exactly the conversation: the next turn
    // generates what a fresh request with the whole conversation does, and every KV block
    // comes back when the session closes.
    let c1 = tokenize(&gw, counting).await;
    let s1 = generate(&mut gw.client(), pb::GenerateRequest { create_session: true, stop: vec![" 11".into()], ..greedy(c1.clone(), 64) })
        .await
        .unwrap();
    assert_eq!(s1.finished.as_ref().unwrap().reason, pb::StopReason::StopString as i32);
    assert_eq!(s1.text, " 8, 9, 10,");
    let session = s1.prompt.session_id.clone();
    let c2 = tokenize(&gw, " 20, 21,").await;
    let s2 = generate(&mut gw.client(), pb::GenerateRequest { session_id: Some(session.clone()), top_logprobs: 2, ..greedy(c2.clone(), 12) })
        .await
        .unwrap();
    assert_eq!(s2.prompt.cached_tokens as usize, c1.len() + s1.ids.len() - 1);
    let mut whole = c1.clone();
    whole.extend(&s1.ids);
    whole.extend(&c2);
    let fresh = generate(&mut gw.client(), pb::GenerateRequest { top_logprobs: 2, ..greedy(whole, 12) }).await.unwrap();
    let fresh_ref = RefGeneration { margins: fresh.top.iter().map(|t| (t[0].1 - t[1].1) as f64).collect(), ids: fresh.ids.clone() };
    same_up_to_near_tie(&s2.ids, &fresh_ref, 0.5).unwrap_or_else(|e| panic!("turn after a stop string vs fresh request: {e}"));
    gw.client().close_session(pb::CloseSessionRequest { session_id: session }).await.unwrap();
    wait_info(&gw, "KV free after a stopped session closed", Duration::from_secs(5), |i| i.kv_free_tokens == i.kv_capacity_tokens && i.sessions == 0).await;

    // A cpu-worker killed mid-generation: the supervisor restarts it, it re-attaches to its
    // arena (--reattach), and the request goes on from its last applied step: the stream
    // completes with the tokens of an uninterrupted run. An idle session with KV on it goes on
    // from its cached KV, giving what a fresh request with the whole conversation gives.
    let idle = generate(&mut gw.client(), pb::GenerateRequest { create_session: true, ..text_req("Hi", 4) }).await.unwrap();
    let idle_session = idle.prompt.session_id.clone();
    let pids = pids_with(&["duet-cpu-worker", &gw.instance]);
    assert_eq!(pids.len(), 1, "one cpu-worker of this instance: {pids:?}");
    let long = pb::GenerateRequest { top_logprobs: 2, ..text_req(counting, 200) };
    let uninterrupted = generate(&mut gw.client(), long.clone()).await.unwrap();
    let mut stream = gw.client().generate(long).await.unwrap().into_inner();
    let mut resumed: Vec<u32> = Vec::new();
    while resumed.len() < 8 {
        if let Some(pb::generate_response::Event::Token(t)) = stream.message().await.unwrap().unwrap().event {
            resumed.push(t.id);
        }
    }
    // SAFETY: killing the test's own grandchild.
    unsafe { libc::kill(pids[0] as libc::pid_t, libc::SIGKILL) };
    let mut finished = None;
    while let Some(msg) = stream.message().await.unwrap_or_else(|e| panic!("the stream failed after its cpu-worker was killed: {e}")) {
        match msg.event {
            Some(pb::generate_response::Event::Token(t)) => resumed.push(t.id),
            Some(pb::generate_response::Event::Finished(f)) => finished = Some(f),
            _ => {}
        }
    }
    assert!(finished.is_some(), "the resumed stream finished");
    let reference = RefGeneration { margins: uninterrupted.top.iter().map(|t| (t[0].1 - t[1].1) as f64).collect(), ids: uninterrupted.ids.clone() };
    same_up_to_near_tie(&resumed, &reference, 0.5).unwrap_or_else(|e| panic!("a stream resumed after its cpu-worker was killed vs uninterrupted: {e}"));
    println!("killed cpu-worker mid-stream: {} tokens, resumed", resumed.len());
    let i = wait_info(&gw, "cpu-worker restarted", Duration::from_secs(60), |i| i.cpu_workers[0].ready && i.cpu_workers[0].restarts >= 1).await;
    assert_eq!(i.sessions, 1, "the idle session is kept");
    assert!(i.kv_free_tokens < i.kv_capacity_tokens, "its KV blocks stay allocated");
    let again = tokenize(&gw, " again").await;
    let next = generate(&mut gw.client(), pb::GenerateRequest { session_id: Some(idle_session.clone()), top_logprobs: 2, ..greedy(again.clone(), 4) })
        .await
        .expect("the idle session continues after its cpu-worker was killed and restarted");
    assert_eq!(next.prompt.cached_tokens as usize, idle.prompt.prompt_ids.len() + idle.ids.len() - 1, "the KV kept in the arena is used");
    let mut whole = idle.prompt.prompt_ids.clone();
    whole.extend(&idle.ids);
    whole.extend(&again);
    let fresh = generate(&mut gw.client(), pb::GenerateRequest { top_logprobs: 2, ..greedy(whole, 4) }).await.unwrap();
    let fresh_ref = RefGeneration { margins: fresh.top.iter().map(|t| (t[0].1 - t[1].1) as f64).collect(), ids: fresh.ids.clone() };
    same_up_to_near_tie(&next.ids, &fresh_ref, 0.5).unwrap_or_else(|e| panic!("a session turn after its cpu-worker restarted vs a fresh request: {e}"));
    gw.client().close_session(pb::CloseSessionRequest { session_id: idle_session }).await.unwrap();
    let g = generate(&mut gw.client(), text_req(counting, 12)).await.expect("a request after the restart");
    assert!(g.text.starts_with(" 8, 9, 10,"), "{:?}", g.text);
    assert_ne!(pids_with(&["duet-cpu-worker", &gw.instance]), pids);

    // The gpu-worker killed under an idle session: its KV is in the cpu-worker's arena, so
    // the restarted gpu-worker takes the session up from it (the gateway sends the blocks
    // and the tokens held), and the next turn matches a fresh request.
    let idle = generate(&mut gw.client(), pb::GenerateRequest { create_session: true, ..text_req("Hello there", 4) }).await.unwrap();
    let idle_session = idle.prompt.session_id.clone();
    let gpu_pids = pids_with(&["duet-gpu-worker", &gw.runtime_dir.to_string_lossy()]);
    assert_eq!(gpu_pids.len(), 1, "one gpu-worker of this instance: {gpu_pids:?}");
    // A stream running when the gpu-worker dies resumes on the next one, from the KV in the
    // arena (greedy: the same tokens as uninterrupted).
    let mut stream = gw.client().generate(pb::GenerateRequest { top_logprobs: 2, ..text_req(counting, 200) }).await.unwrap().into_inner();
    let mut resumed: Vec<u32> = Vec::new();
    while resumed.len() < 8 {
        if let Some(pb::generate_response::Event::Token(t)) = stream.message().await.unwrap().unwrap().event {
            resumed.push(t.id);
        }
    }
    // SAFETY: killing the test's own grandchild.
    unsafe { libc::kill(gpu_pids[0] as libc::pid_t, libc::SIGKILL) };
    while let Some(msg) = stream.message().await.unwrap_or_else(|e| panic!("the stream failed after its gpu-worker was killed: {e}")) {
        if let Some(pb::generate_response::Event::Token(t)) = msg.event {
            resumed.push(t.id);
        }
    }
    same_up_to_near_tie(&resumed, &reference, 0.5).unwrap_or_else(|e| panic!("a stream resumed after its gpu-worker was killed vs uninterrupted: {e}"));
    let again = tokenize(&gw, " again").await;
    let turn = pb::GenerateRequest { session_id: Some(idle_session.clone()), top_logprobs: 2, ..greedy(again.clone(), 4) };
    let started = std::time::Instant::now();
    let next = loop {
        // UNAVAILABLE while the gpu-worker is down or not yet attached again.
        match generate(&mut gw.client(), turn.clone()).await {
            Ok(g) => break g,
            Err(e) if e.code() == Code::Unavailable && started.elapsed() < Duration::from_secs(90) => tokio::time::sleep(Duration::from_millis(200)).await,
            Err(e) => panic!("the idle session after a gpu-worker restart: {e}"),
        }
    };
    assert_ne!(pids_with(&["duet-gpu-worker", &gw.runtime_dir.to_string_lossy()]), gpu_pids, "the gpu-worker was restarted");
    assert_eq!(next.prompt.cached_tokens as usize, idle.prompt.prompt_ids.len() + idle.ids.len() - 1, "the KV in the arena is used");
    let mut whole = idle.prompt.prompt_ids.clone();
    whole.extend(&idle.ids);
    whole.extend(&again);
    let fresh = generate(&mut gw.client(), pb::GenerateRequest { top_logprobs: 2, ..greedy(whole, 4) }).await.unwrap();
    let fresh_ref = RefGeneration { margins: fresh.top.iter().map(|t| (t[0].1 - t[1].1) as f64).collect(), ids: fresh.ids.clone() };
    same_up_to_near_tie(&next.ids, &fresh_ref, 0.5).unwrap_or_else(|e| panic!("a session turn after a gpu-worker restart vs a fresh request: {e}"));
    gw.client().close_session(pb::CloseSessionRequest { session_id: idle_session }).await.unwrap();

    // `duet bench` against it: an untimed warm-up stream first (said in text mode), then each
    // level's streams, every one generating exactly --max-tokens.
    let bench = |extra: &[&str]| {
        let out = std::process::Command::new(duet_tests::bin("duet"))
            .args(["bench", "--addr", &gw.addr, "--concurrency", "1,2", "--prompt-tokens", "8", "--max-tokens", "5"])
            .args(extra)
            .output()
            .expect("starting duet bench");
        assert!(out.status.success(), "duet bench {extra:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let text = bench(&[]);
    assert!(text.lines().next().is_some_and(|l| l.starts_with("warmed up in")), "{text}");
    assert_eq!(text.lines().filter(|l| l.contains("concurrency")).count(), 2, "{text}");
    let cold = bench(&["--no-warmup"]);
    assert!(!cold.contains("warmed up") && cold.lines().filter(|l| l.contains("concurrency")).count() == 2, "{cold}");
    // JSON (what scripts/bench.py reads), warm or not: nothing but the levels' reports, the
    // warm-up's tokens in none of them.
    for extra in [&["--json"][..], &["--json", "--no-warmup"]] {
        let levels: serde_json::Value = serde_json::from_str(&bench(extra)).unwrap_or_else(|e| panic!("duet bench {extra:?} prints JSON: {e}"));
        let levels = levels.as_array().expect("one report per level");
        assert_eq!(levels.iter().map(|l| (l["concurrency"].as_u64(), l["generated_tokens"].as_u64())).collect::<Vec<_>>(), [(Some(1), Some(5)), (Some(2), Some(10))]);
        assert!(levels.iter().all(|l| l["aggregate_tokens_per_s"].as_f64().is_some_and(|t| t > 0.0)), "{levels:?}");
    }
    // A shared prefix as long as the prompt is refused (one that is shorter: the prefix
    // cache's test).
    let out = std::process::Command::new(duet_tests::bin("duet"))
        .args(["bench", "--addr", &gw.addr, "--prompt-tokens", "8", "--shared-prefix", "8"])
        .output()
        .unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--shared-prefix 8 must be shorter than --prompt-tokens 8"));

    let status = gw.stop();
    assert!(status.success(), "gateway exit {status}; log:\n{}", gw.log_tail());
    assert!(!gw.runtime_dir.exists(), "runtime directory removed");
    assert!(pids_with(&["duet-cpu-worker", &gw.instance]).is_empty() && pids_with(&["duet-gpu-worker", &gw.runtime_dir.to_string_lossy()]).is_empty());
    let leftovers: Vec<_> =
        std::fs::read_dir("/dev/shm").unwrap().flatten().filter(|e| e.file_name().to_string_lossy().contains(&gw.instance)).collect();
    assert!(leftovers.is_empty(), "segments left: {leftovers:?}");
}

/// Workers started elsewhere (as systemd would): the gateway connects to their sockets,
/// serves, and leaves them running when it stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_serves_with_workers_started_elsewhere() {
    use std::process::{Command, Stdio};
    let instance = format!("ext{}", std::process::id());
    let dir = std::env::temp_dir().join(format!("duet-test-{instance}"));
    std::fs::create_dir_all(&dir).unwrap();
    let model = duet_model::testutil::model_path();
    let (cpu_sock, gpu_sock) = (format!("unix:{}/cpu0.sock", dir.display()), format!("unix:{}/gpu.sock", dir.display()));
    let cpu = Command::new(duet_tests::bin("duet-cpu-worker"))
        .args(["--instance", &instance, "--worker", "0", "--kv-bytes", "64M", "--listen", &cpu_sock])
        .arg("--model")
        .arg(&model)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let gpu = Command::new(duet_tests::bin("duet-gpu-worker"))
        .args(["serve", "--listen", &gpu_sock])
        .arg("--model")
        .arg(&model)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut workers = KillOnDrop(vec![cpu, gpu]);
    let mut gw = Gateway::start(&["--gpu-worker", &gpu_sock, "--cpu-worker", &cpu_sock]);
    let g = generate(&mut gw.client(), text_req("1, 2, 3, 4, 5, 6, 7,", 12)).await.expect("generation");
    assert!(g.text.starts_with(" 8, 9, 10,"), "{:?}", g.text);
    assert!(gw.stop().success(), "log:\n{}", gw.log_tail());
    assert!(workers.0.iter_mut().all(|c| c.try_wait().unwrap().is_none()), "the workers outlive the gateway");
    for child in &mut workers.0 {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        assert!(child.wait().unwrap().success());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Child processes killed when dropped: a failing test does not leave its workers running
/// (holding the test runner's pipes open).
struct KillOnDrop(Vec<std::process::Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for child in &mut self.0 {
            if child.try_wait().ok().flatten().is_none() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// Automatic prefix caching: a prompt that begins as an earlier one did starts from the KV
/// computed for it (whole blocks, the last prompt token always computed), prefills only the
/// rest, and generates what the single-process reference generates from scratch; blocks
/// kept for the cache count as free KV.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_starts_from_the_kv_of_an_earlier_one_with_the_same_prefix() {
    // Two cpu-workers: a prompt's blocks, cached and new, may lie in either arena.
    let gw = Gateway::start(&["--cpu-workers", "2"]);
    let reference = Reference::load();
    let bs = info(&gw).await.kv_block_size as usize;
    let system = tokenize(
        &gw,
        "<|im_start|>system\nYou are a careful assistant for a small public library. Answer in one short sentence, name \
         your sources where you can, and say so plainly when you do not know. Readers ask about opening hours (nine to \
         five on weekdays, ten to two on Saturdays, closed on Sundays and public holidays), about borrowing (up to twelve \
         items for three weeks, renewable twice online or at the desk unless another reader has reserved them), about \
         late returns (no fines for children's books; ten cents a day for the others, at most two euros an item), about \
         the reading room, the printers and the wireless network (the password is at the desk), and about everything \
         else under the sun, which you answer as well as a well-read librarian would.<|im_end|>\n",
    )
    .await;
    let ask = |q: &str| format!("<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n");
    let mut shared = 0;
    for (i, q) in ["What is the capital of France?", "Name a primary colour.", "What is the capital of France?"].iter().enumerate() {
        let mut prompt = system.clone();
        prompt.extend(tokenize(&gw, &ask(q)).await);
        let before = info(&gw).await.prefilled_tokens_total;
        let g = generate(&mut gw.client(), greedy(prompt.clone(), 16)).await.unwrap();
        let prefilled = info(&gw).await.prefilled_tokens_total - before;
        let cached = g.prompt.cached_tokens as usize;
        let usage = g.finished.clone().unwrap().usage.unwrap();
        assert_eq!((usage.prompt_tokens as usize, prefilled as usize, usage.prefilled_tokens as usize), (prompt.len(), prompt.len() - cached, prompt.len() - cached));
        match i {
            0 => assert_eq!(cached, 0, "nothing cached yet"),
            // The system prompt's whole blocks.
            1 => assert_eq!(cached, system.len() / bs * bs),
            // The whole first prompt's blocks, up to its last token.
            _ => assert_eq!(cached, (prompt.len() - 1) / bs * bs),
        }
        shared = shared.max(cached);
        let want = reference.generate(&prompt, 16);
        let same = same_up_to_near_tie(&g.ids, &want, 0.5).unwrap_or_else(|e| panic!("prompt {i} ({cached} tokens cached) vs the reference: {e}"));
        println!("prompt {i}: {cached} of {} tokens from the cache; identical to the reference: {same}", prompt.len());
    }
    assert!(shared > bs, "a prompt shared more than one block");
    // `duet bench --shared-prefix`: the warm-up computes the prefix's whole blocks, the timed
    // streams (1 + 2) only the rest of their prompts.
    let before = info(&gw).await.prefilled_tokens_total;
    let out = std::process::Command::new(duet_tests::bin("duet"))
        .args(["bench", "--addr", &gw.addr, "--json", "--concurrency", "1,2", "--max-tokens", "2", "--prompt-tokens", "150", "--shared-prefix", "140"])
        .output()
        .unwrap();
    assert!(out.status.success(), "duet bench --shared-prefix: {}", String::from_utf8_lossy(&out.stderr));
    let cached = 140 / bs * bs;
    assert_eq!((info(&gw).await.prefilled_tokens_total - before) as usize, 150 + 3 * (150 - cached));
    let i = wait_info(&gw, "KV free after the requests", Duration::from_secs(5), |i| i.active_requests == 0).await;
    assert_eq!(i.cpu_workers.len(), 2);
    assert_eq!(i.kv_free_tokens, i.kv_capacity_tokens, "cached blocks count as free");
}
