//! The whole system against the single-process reference on every golden prompt: greedy
//! `Generate` over gRPC, all prompts at once (20 concurrent streams, so each also shows it
//! gets what it gets alone), with attention on one cpu-worker, on the gpu-worker, on two
//! cpu-workers (each sequence on one, and long ones split across both), split between the
//! gpu-worker and two cpu-workers, and as the lp balancer decides (overlapped sub-batches
//! included), and with the gpu-worker's model split across two devices (`--gpu-layers`).

use duet_model::testutil::golden;
use duet_tests::{generate, greedy, same_up_to_near_tie, Gateway, Reference};
use serde_json::Value;

/// A split (log-sum-exp merged) attention rounds differently from the unsplit reference
/// (within 2^-10 of the values; kv/tests/paged_attention.rs). This model quantises its
/// activations to 8 bits per block of 32 and turns such last-bit differences into
/// log-probability shifts of 0.1-0.3 (see issue 2's note), so a split run may choose
/// differently only where the reference's two best tokens are this close. A wrong merge
/// or a misplaced range breaks far earlier, at confident positions.
const NEAR_TIE: f64 = 0.5;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_over_grpc_matches_the_single_process_reference() {
    let data: Value = serde_json::from_str(&std::fs::read_to_string(golden("greedy.json")).unwrap()).unwrap();
    let items: Vec<(String, Vec<u32>, usize)> = data["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|it| (it["name"].as_str().unwrap().to_string(), ids(&it["prompt_ids"]), ids(&it["generated_ids"]).len()))
        .collect();
    let want: Vec<_> = {
        let reference = Reference::load();
        items.iter().map(|(_, p, n)| reference.generate(p, *n)).collect()
    };

    // 24 MiB arenas hold 1088 tokens each: the two long prompts (1548 and 1976 tokens) must
    // spread over both cpu-workers, whose partial results are merged.
    let configs: [(&str, &[&str], bool); 8] = [
        ("attention on one cpu-worker", &["--cpu-workers", "1", "--policy", "cpu"], true),
        ("attention on the gpu-worker", &["--cpu-workers", "1", "--policy", "gpu"], true),
        ("attention on two cpu-workers, each sequence on one", &["--cpu-workers", "2", "--policy", "cpu"], true),
        ("attention split across two cpu-workers", &["--cpu-workers", "2", "--policy", "cpu", "--kv-bytes", "24M"], false),
        ("attention split between gpu-worker and cpu-workers", &["--cpu-workers", "2", "--policy", "ratio:0.5"], false),
        ("attention split by the lp balancer", &["--cpu-workers", "2", "--policy", "lp"], false),
        // Unsplit attention in two interleaved sub-batches: every row computes what it
        // would in one batch, so bit-identical.
        ("attention on cpu-workers, every decode step overlapped", &["--cpu-workers", "2", "--policy", "cpu", "--overlap", "always"], true),
        // Layers 0..12 on one device, 12..30 on another (`--gpu-layers` with both parts on
        // the CPU): each row computes what it would on one device.
        ("the model split across two devices at layer 12", &["--cpu-workers", "1", "--policy", "cpu", "--device", "cpu", "--gpu-layers", "12"], true),
    ];
    let mut failures = Vec::new();
    for (label, flags, exact) in configs {
        let mut gw = Gateway::start(flags);
        let started = std::time::Instant::now();
        let tasks: Vec<_> = items
            .iter()
            .map(|(_, prompt, n)| {
                let mut client = gw.client();
                let req = greedy(prompt.clone(), *n as u32);
                tokio::spawn(async move { generate(&mut client, req).await })
            })
            .collect();
        let (mut identical, mut parted) = (0, 0);
        for ((task, (name, _, _)), want) in tasks.into_iter().zip(&items).zip(&want) {
            let got = match task.await.unwrap() {
                Ok(g) => g,
                Err(e) => {
                    failures.push(format!("{label}: {name}: {e}"));
                    continue;
                }
            };
            let verdict = if exact {
                if got.ids == want.ids { Ok(true) } else { Err(format!("got {:?}, reference {:?}", got.ids, want.ids)) }
            } else {
                same_up_to_near_tie(&got.ids, want, NEAR_TIE)
            };
            match verdict {
                Ok(true) => identical += 1,
                Ok(false) => parted += 1,
                Err(e) => failures.push(format!("{label}: {name}: {e}")),
            }
        }
        println!(
            "{label}: {identical}/{} identical to the reference, {parted} parted at a near tie ({:.1} s for all {} streams at once)",
            items.len(),
            started.elapsed().as_secs_f64(),
            items.len()
        );
        let status = gw.stop();
        assert!(status.success(), "{label}: the gateway exited with {status}; log:\n{}", gw.log_tail());
        assert!(!gw.runtime_dir.exists(), "{label}: the runtime directory was not removed");
        let leftovers: Vec<_> = std::fs::read_dir("/dev/shm")
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().contains(&gw.instance))
            .map(|e| e.file_name())
            .collect();
        assert!(leftovers.is_empty(), "{label}: segments left behind: {leftovers:?}");
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

/// Decode past `DECODE_CHUNK` (2048) positions: the single process, the gpu-worker reading the
/// arenas in place and a cpu-worker each split the context into the same chunks and merge them
/// the same way, so whole-context attention on either worker still gives the reference's tokens
/// exactly (the golden prompts are all shorter than one chunk).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_past_one_attention_chunk_matches_the_single_process_reference() {
    let data: Value = serde_json::from_str(&std::fs::read_to_string(golden("greedy.json")).unwrap()).unwrap();
    let mut prompt: Vec<u32> = data["items"].as_array().unwrap().iter().flat_map(|it| ids(&it["prompt_ids"])).collect();
    assert!(prompt.len() > 2300, "the golden prompts hold {} tokens", prompt.len());
    prompt.truncate(2300);
    let want = Reference::load().generate(&prompt, 6);
    for (label, flags) in [("on one cpu-worker", ["--cpu-workers", "1", "--policy", "cpu"]), ("on the gpu-worker", ["--cpu-workers", "1", "--policy", "gpu"])] {
        let mut gw = Gateway::start(&flags);
        let got = generate(&mut gw.client(), greedy(prompt.clone(), 6)).await.unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_eq!(got.ids, want.ids, "{label}: a 2300-token context");
        let status = gw.stop();
        assert!(status.success(), "{label}: the gateway exited with {status}; log:\n{}", gw.log_tail());
    }
}

/// A prompt scored through the whole system (`prompt_logprobs`, OpenAI's `echo` with
/// `logprobs`): over three prefill chunks, each token's log-probability is what the single
/// process computes for it, bit for bit, and the first generated token comes after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_logprobs_match_the_single_process_reference() {
    let data: Value = serde_json::from_str(&std::fs::read_to_string(golden("greedy.json")).unwrap()).unwrap();
    let mut prompt: Vec<u32> = data["items"].as_array().unwrap().iter().flat_map(|it| ids(&it["prompt_ids"])).collect();
    prompt.truncate(1100);
    let want = Reference::load().prompt_logprobs(&prompt);
    let mut gw = Gateway::start(&["--cpu-workers", "1"]);
    let req = duet_proto::pb::GenerateRequest { prompt_logprobs: true, top_logprobs: 3, ..greedy(prompt.clone(), 2) };
    let got = generate(&mut gw.client(), req).await.unwrap();
    assert_eq!(got.prompt_logprobs.len(), prompt.len() - 1, "every prompt token after the first, once");
    for (i, (t, &w)) in got.prompt_logprobs.iter().zip(&want).enumerate() {
        assert_eq!(t.id, prompt[i + 1], "position {}", i + 1);
        // The same chunks through the same kernels: the same bits (sent as f32).
        assert_eq!(t.logprob, Some(w as f32), "position {}", i + 1);
        assert_eq!(t.top_logprobs.len(), 3, "position {}: the alternatives asked for", i + 1);
        assert!(t.top_logprobs[0].logprob >= w as f32, "position {}: the best alternative is at least as likely as the token", i + 1);
    }
    assert_eq!(got.ids.len(), 2);
    let status = gw.stop();
    assert!(status.success(), "the gateway exited with {status}; log:\n{}", gw.log_tail());
}

/// With `--kv-type q8_0` the arenas hold Q8_0 rows, which the gpu-worker writes and both
/// workers attend with the one-pass arithmetic: a 2300-token context (two attention chunks)
/// on one cpu-worker and on the gpu-worker gives exactly the single process's tokens over its
/// own Q8_0 cache; and the Q8_0 cache changes the logits (it is not ignored) while keeping
/// the f16 cache's confident tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q8_0_kv_matches_the_single_process_q8_0_reference() {
    let data: Value = serde_json::from_str(&std::fs::read_to_string(golden("greedy.json")).unwrap()).unwrap();
    let mut prompt: Vec<u32> = data["items"].as_array().unwrap().iter().flat_map(|it| ids(&it["prompt_ids"])).collect();
    prompt.truncate(2300);
    let want = Reference::load().with_kv_type(duet_kv::KvDtype::Q8_0).generate(&prompt, 6);
    let f16 = Reference::load().generate(&prompt, 6);
    assert_ne!(want.margins, f16.margins, "the Q8_0 cache gives the f16 cache's log-probabilities exactly");
    assert!(same_up_to_near_tie(&want.ids, &f16, NEAR_TIE).is_ok(), "Q8_0 {:?} against f16 {:?}", want.ids, f16.ids);
    // The arena holds as many blocks as Q8_0 rows of the model fit in the test's 128M.
    let gguf = duet_model::gguf::GgufFile::open(duet_model::testutil::model_path()).unwrap();
    let shape = duet_model::config::LlamaConfig::from_gguf(&gguf).unwrap().kv_shape().unwrap();
    let layout = duet_kv::ArenaLayout {
        n_layer: shape.n_layer,
        n_kv_head: shape.n_kv_head,
        head_dim: shape.head_dim,
        block_size: duet_kv::layout::DEFAULT_BLOCK_SIZE,
        dtype: duet_kv::KvDtype::Q8_0,
        n_blocks: 1,
    };
    let q8_tokens = layout.n_blocks_for_bytes(128 << 20).unwrap() as u64 * layout.block_size as u64;
    for (label, policy) in [("on one cpu-worker", "cpu"), ("on the gpu-worker", "gpu")] {
        let mut gw = Gateway::start(&["--cpu-workers", "1", "--policy", policy, "--kv-type", "q8_0"]);
        let info = gw.client().info(duet_proto::pb::InfoRequest {}).await.expect("Info").into_inner();
        assert_eq!(info.kv_capacity_tokens, q8_tokens, "{label}: the capacity of a Q8_0 arena of 128M");
        let got = generate(&mut gw.client(), greedy(prompt.clone(), 6)).await.unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_eq!(got.ids, want.ids, "{label}: a 2300-token context over a Q8_0 cache");
        let status = gw.stop();
        assert!(status.success(), "{label}: the gateway exited with {status}; log:\n{}", gw.log_tail());
    }
}
