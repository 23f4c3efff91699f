//! The architectures beyond Llama through the whole multi-process system: the tiny qwen2
//! (Q/K/V biases, NeoX RoPE), qwen3 (Q/K norms, NeoX RoPE), phi3 (fused Q/K/V and gate/up;
//! and with LongRoPE), mistral3 (and with YaRN and attention temperature), gemma3 and gemma2 (sliding-window layers, whose attention jobs the gpu-worker
//! cuts to the window, with `ratio:0.5` the gpu-worker's prefix share lying wholly before it;
//! gemma2's soft-capped scores, whose cap the jobs carry to the cpu-worker) and the
//! mixture-of-experts mixtral, qwen3moe and olmoe models of testdata/tiny/arch (their experts
//! on the gpu-worker, and on two cpu-workers, also with the gpu-worker's model split across
//! two devices by `--gpu-layers`, bit for bit the same),
//! which match llama.cpp's logits exactly in the single-process runner
//! (gpu-worker/tests/tiny_arch_llamacpp.rs), give the runner's greedy tokens with decode
//! attention on the cpu-worker (K/V in its arena) and on the gpu-worker.

use duet_model::testutil::workspace_root;
use duet_proto::pb;
use duet_tests::{generate, greedy, pids_with, same_up_to_near_tie, Gateway, Reference};
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen_models_decode_in_the_system_as_in_the_single_process_runner() {
    let models = [
        "qwen2_q4_1",
        "qwen3_q8_0",
        "phi3_q8_0",
        "phi3_longrope_q8_0",
        "mistral3_q8_0",
        "mistral3_yarn_q8_0",
        "gemma3_q8_0",
        "gemma2_q8_0",
        "mixtral_q8_0",
        "qwen3moe_q8_0",
        "olmoe_q8_0",
    ];
    for name in models {
        let dir = workspace_root().join("testdata/tiny/arch");
        let meta: Value = serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap()).unwrap();
        let prompt: Vec<u32> = meta["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
        let model = dir.join(format!("{name}.gguf"));
        let want = Reference::load_model(&model).generate(&prompt, 24);
        assert!(want.ids.len() > 4, "{name}: the reference stopped after {} tokens", want.ids.len());
        let policies: &[&str] = if name.starts_with("gemma") { &["cpu", "gpu", "ratio:0.5"] } else { &["cpu", "gpu"] };
        for &policy in policies {
            let mut gw = Gateway::start_with_model(&model, &["--cpu-workers", "1", "--policy", policy]);
            let req = pb::GenerateRequest { top_logprobs: 2, ..greedy(prompt.clone(), 24) };
            let got = generate(&mut gw.client(), req).await.unwrap_or_else(|e| panic!("{name}, policy {policy}: {e}"));
            assert_eq!(got.ids, want.ids, "{name}: decode attention by policy {policy}");
            // Not only the argmax: the top-2 margins are the runner's (a cap or window the
            // cpu-worker ignored would move them). A sequence split between the workers is
            // merged by log-sum-exp, whose rounding differs from one pass: close, not equal.
            let tol = if policy.starts_with("ratio") { 0.2 } else { 1e-4 };
            for (i, (top, margin)) in got.top.iter().zip(&want.margins).enumerate() {
                let m = (top[0].1 - top[1].1) as f64;
                assert!((m - margin).abs() < tol, "{name}, policy {policy}, token {i}: top-2 margin {m}, the runner's {margin}");
            }
            let status = gw.stop();
            assert!(status.success(), "{name}: the gateway exited with {status}; log:\n{}", gw.log_tail());
        }
    }
}

/// The mixture-of-experts models with their routed experts on the cpu-workers (KTransformers'
/// split: `--experts-on cpu-workers`, two cpu-workers each serving half the experts as expert
/// jobs in their exchange rings): the same greedy tokens as the single-process runner, and
/// the same logits bit for bit as the system with the experts on the gpu-worker's device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moe_models_with_experts_on_the_cpu_workers_decode_bit_for_bit_as_on_the_device() {
    for name in ["mixtral_q8_0", "qwen3moe_q8_0", "olmoe_q8_0"] {
        let dir = workspace_root().join("testdata/tiny/arch");
        let meta: Value = serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap()).unwrap();
        let prompt: Vec<u32> = meta["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
        let model = dir.join(format!("{name}.gguf"));
        let want = Reference::load_model(&model).generate(&prompt, 24);
        let mut runs = Vec::new();
        // The third run also holds hot experts on the device (--device-experts: the flag
        // reaches the gpu-worker; tests/expert_jobs.rs moves experts mid-run); the fourth
        // splits the gpu-worker's model after its first layer across two devices
        // (`--gpu-layers 1`, both CPU devices), each part sending its layers' experts away.
        let split: &[&str] = &["--device", "cpu", "--gpu-layers", "1"];
        for (experts_on, hot, more) in [("device", "0", &[][..]), ("cpu-workers", "0", &[]), ("cpu-workers", "2", &[]), ("cpu-workers", "0", split)] {
            let flags = [&["--cpu-workers", "2", "--policy", "cpu", "--experts-on", experts_on, "--device-experts", hot][..], more].concat();
            let mut gw = Gateway::start_with_model(&model, &flags);
            let req = pb::GenerateRequest { top_logprobs: 4, ..greedy(prompt.clone(), 24) };
            let got = generate(&mut gw.client(), req).await.unwrap_or_else(|e| panic!("{name}, experts on {experts_on}: {e}"));
            assert_eq!(got.ids, want.ids, "{name}: experts on {experts_on}");
            // The router's statistics reach the gateway's metrics: every prompt row and every
            // decode step's row, in every layer, to the experts it uses.
            let c = duet_model::config::LlamaConfig::from_gguf(&duet_model::gguf::GgufFile::open(&model).unwrap()).unwrap();
            let rows = (prompt.len() + 24 - 1) as u64;
            let routed = metric_total(&gw.http_addr, "duet_expert_routed_tokens_total");
            assert_eq!(routed, rows * c.experts.unwrap().n_used as u64 * c.n_layer as u64, "{name}: routed tokens in /metrics");
            let status = gw.stop();
            assert!(status.success(), "{name}: the gateway exited with {status}; log:\n{}", gw.log_tail());
            runs.push(got.top);
        }
        assert_eq!(runs[0], runs[1], "{name}: top log-probabilities with the experts on the device and on the cpu-workers");
        assert_eq!(runs[0], runs[2], "{name}: top log-probabilities with hot experts on the device too");
        assert_eq!(runs[0], runs[3], "{name}: top log-probabilities with the model split across two devices");
    }
}

/// The sum of a metric's series in the gateway's `/metrics` (plain HTTP/1.1).
fn metric_total(http_addr: &str, name: &str) -> u64 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(http_addr).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {http_addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    body.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64)
        .sum()
}

/// A cpu-worker serving routed experts killed with SIGKILL mid-stream: the gateway restarts
/// it (its share of the experts loaded again), and every stream completes with the tokens of
/// the uninterrupted single-process run (up to near ties).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_survive_the_death_of_a_cpu_worker_serving_experts() {
    const STREAMS: u32 = 4;
    const TOKENS: usize = 100;
    let model = workspace_root().join("testdata/tiny/arch/olmoe_q8_0.gguf");
    let reference = Reference::load_model(&model);
    let prompt = |i: u32| vec![1, 17 + 11 * i, 90, 33 + i, 200];
    let mut gw = Gateway::start_with_model(&model, &["--cpu-workers", "1", "--experts-on", "cpu-workers"]);
    let (tx, mut started) = tokio::sync::mpsc::channel(STREAMS as usize);
    let mut tasks = Vec::new();
    for i in 0..STREAMS {
        let (mut client, tx) = (gw.client(), tx.clone());
        tasks.push(tokio::spawn(async move {
            let mut stream = client.generate(greedy(prompt(i), TOKENS as u32)).await?.into_inner();
            let mut ids = Vec::new();
            while let Some(msg) = stream.message().await? {
                if let Some(pb::generate_response::Event::Token(t)) = msg.event {
                    ids.push(t.id);
                    if ids.len() == 2 {
                        let _ = tx.send(()).await;
                    }
                }
            }
            Ok::<_, tonic::Status>(ids)
        }));
    }
    for _ in 0..STREAMS {
        started.recv().await.expect("every stream starts");
    }
    let victim = ["duet-cpu-worker", gw.instance.as_str()];
    let pids = pids_with(&victim);
    assert_eq!(pids.len(), 1, "one cpu-worker: {pids:?}");
    // SAFETY: killing the test's own grandchild.
    unsafe { libc::kill(pids[0] as libc::pid_t, libc::SIGKILL) };
    for (i, t) in tasks.into_iter().enumerate() {
        let ids = t.await.unwrap().unwrap_or_else(|e| panic!("stream {i} failed after the cpu-worker was killed: {e}"));
        let want = reference.generate(&prompt(i as u32), TOKENS);
        same_up_to_near_tie(&ids, &want, 0.5).unwrap_or_else(|e| panic!("stream {i} vs uninterrupted: {e}"));
    }
    assert_ne!(pids_with(&victim), pids, "the cpu-worker was restarted");
    let log = std::fs::read_to_string(&gw.log).unwrap_or_default();
    assert!(log.contains("wait to resume"), "the kill interrupted no step (the streams ended first?); log:\n{}", gw.log_tail());
    let status = gw.stop();
    assert!(status.success(), "gateway exit {status}; log:\n{}", gw.log_tail());
}
