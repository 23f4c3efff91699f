//! The architectures beyond Llama through the whole multi-process system: the tiny qwen2
//! (Q/K/V biases, NeoX RoPE), qwen3 (Q/K norms, NeoX RoPE), phi3 (fused Q/K/V and gate/up),
//! mistral3 and gemma3 (sliding-window layers, whose attention jobs the gpu-worker cuts to
//! the window; with `ratio:0.5` the gpu-worker's prefix share lies wholly before it) models
//! of testdata/tiny/arch,
//! which match llama.cpp's logits exactly in the single-process runner
//! (gpu-worker/tests/tiny_arch_llamacpp.rs), give the runner's greedy tokens with decode
//! attention on the cpu-worker (K/V in its arena) and on the gpu-worker.

use duet_common::testutil::workspace_root;
use duet_tests::{generate, greedy, Gateway, Reference};
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen_models_decode_in_the_system_as_in_the_single_process_runner() {
    for name in ["qwen2_q4_1", "qwen3_q8_0", "phi3_q8_0", "mistral3_q8_0", "gemma3_q8_0"] {
        let dir = workspace_root().join("testdata/tiny/arch");
        let meta: Value = serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap()).unwrap();
        let prompt: Vec<u32> = meta["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
        let model = dir.join(format!("{name}.gguf"));
        let want = Reference::load_model(&model).generate(&prompt, 24);
        assert!(want.ids.len() > 4, "{name}: the reference stopped after {} tokens", want.ids.len());
        let policies: &[&str] = if name.starts_with("gemma3") { &["cpu", "gpu", "ratio:0.5"] } else { &["cpu", "gpu"] };
        for &policy in policies {
            let mut gw = Gateway::start_with_model(&model, &["--cpu-workers", "1", "--policy", policy]);
            let got = generate(&mut gw.client(), greedy(prompt.clone(), 24)).await.unwrap_or_else(|e| panic!("{name}, policy {policy}: {e}"));
            assert_eq!(got.ids, want.ids, "{name}: decode attention by policy {policy}");
            let status = gw.stop();
            assert!(status.success(), "{name}: the gateway exited with {status}; log:\n{}", gw.log_tail());
        }
    }
}
