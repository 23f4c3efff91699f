//! The architectures beyond Llama through the whole multi-process system: the tiny qwen2
//! (Q/K/V biases, NeoX RoPE), qwen3 (Q/K norms, NeoX RoPE), phi3 (fused Q/K/V and gate/up;
//! and with LongRoPE), mistral3 (and with YaRN and attention temperature), gemma3 and gemma2 (sliding-window layers, whose attention jobs the gpu-worker
//! cuts to the window, with `ratio:0.5` the gpu-worker's prefix share lying wholly before it;
//! gemma2's soft-capped scores, whose cap the jobs carry to the cpu-worker) and the
//! mixture-of-experts mixtral, qwen3moe and olmoe (experts on the gpu-worker) models of
//! testdata/tiny/arch,
//! which match llama.cpp's logits exactly in the single-process runner
//! (gpu-worker/tests/tiny_arch_llamacpp.rs), give the runner's greedy tokens with decode
//! attention on the cpu-worker (K/V in its arena) and on the gpu-worker.

use duet_model::testutil::workspace_root;
use duet_proto::pb;
use duet_tests::{generate, greedy, Gateway, Reference};
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
