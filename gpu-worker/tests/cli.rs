//! The `duet-gpu-worker` binary end to end: `run`, `tokenize` and `perplexity` outputs against
//! llama.cpp's reference data, and bad input rejected with a helpful message, never a panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use duet_model::gguf::GgufFile;
use duet_model::tokenizer::Tokenizer;
use duet_model::testutil::{golden, model_path};
use serde_json::Value;

/// The model's training context (`llama.context_length`).
const N_CTX: usize = 8192;

fn worker(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_duet-gpu-worker"))
        .arg("--threads")
        .arg("2")
        .args(args)
        .env_remove("DUET_MODEL")
        .env_remove("DUET_THREADS")
        .env_remove("DUET_DEVICE")
        .env_remove("RUST_LOG")
        .output()
        .expect("starting duet-gpu-worker")
}

fn model_arg() -> String {
    model_path().to_str().unwrap().to_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs a command that must succeed and print exactly one JSON object on stdout.
fn json_of(args: &[&str]) -> Value {
    let out = worker(args);
    assert!(out.status.success(), "{args:?} failed: {}", stderr(&out));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.trim_end().lines().count(), 1, "expected one line of JSON, got {stdout:?}");
    let v: Value = serde_json::from_str(stdout.trim_end()).unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {stdout:?}"));
    assert!(v.is_object(), "{v}");
    v
}

/// Runs a command that must fail with a message containing every one of `needles`.
fn fails_with(args: &[&str], needles: &[&str]) -> String {
    let out = worker(args);
    let err = stderr(&out);
    assert!(!out.status.success(), "{args:?} succeeded; stdout {:?}", String::from_utf8_lossy(&out.stdout));
    assert_ne!(out.status.code(), Some(101), "{args:?} exited with Rust's panic status: {err}");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    for needle in needles {
        assert!(err.contains(needle), "{args:?}: stderr does not mention {needle:?}: {err}");
    }
    err
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap_or_else(|| panic!("not an array: {v}")).iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn golden_item(name: &str) -> Value {
    let data: Value = serde_json::from_str(&std::fs::read_to_string(golden("greedy.json")).unwrap()).unwrap();
    data["items"].as_array().unwrap().iter().find(|it| it["name"] == name).unwrap_or_else(|| panic!("no golden item {name}")).clone()
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_gguf(&GgufFile::open(model_path()).unwrap()).unwrap()
}

/// A scratch file for one test, under Cargo's temporary directory for integration tests.
fn scratch(name: &str, contents: &[u8]) -> PathBuf {
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cli-{}-{name}", std::process::id()));
    std::fs::write(&path, contents).unwrap();
    path
}

fn csv(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

#[test]
fn run_json_from_prompt_ids_matches_llama_cpp() {
    let item = golden_item("raw_capital");
    let prompt = ids(&item["prompt_ids"]);
    assert_eq!(prompt, [504, 3575, 282, 4649, 314]);
    let v = json_of(&["run", "--model", &model_arg(), "--prompt-ids", "504,3575,282,4649,314", "--max-tokens", "8", "--json"]);
    for key in ["prompt_ids", "generated_ids", "text", "top5"] {
        assert!(v.get(key).is_some(), "no {key:?} in {v}");
    }
    assert_eq!(ids(&v["prompt_ids"]), prompt);
    let generated = ids(&v["generated_ids"]);
    assert_eq!(generated, ids(&item["generated_ids"])[..8]);
    assert_eq!(v["text"].as_str().unwrap(), tokenizer().decode(&generated).unwrap());

    let top5 = v["top5"].as_array().unwrap();
    assert_eq!(top5.len(), 8, "one top-5 list per generated token");
    for (pos, entries) in top5.iter().enumerate() {
        let entries = entries.as_array().unwrap();
        assert_eq!(entries.len(), 5, "position {pos}");
        let lps: Vec<f64> = entries
            .iter()
            .map(|e| {
                assert!(e["id"].is_u64(), "position {pos}: {e}");
                e["logprob"].as_f64().unwrap_or_else(|| panic!("position {pos}: {e}"))
            })
            .collect();
        assert!(lps.iter().all(|&lp| lp <= 0.0 && lp.is_finite()), "position {pos}: {lps:?}");
        assert!(lps.windows(2).all(|w| w[0] >= w[1]), "position {pos} not sorted descending: {lps:?}");
        // Greedy: the chosen token is the most likely one, with llama.cpp's log-probability.
        assert_eq!(entries[0]["id"].as_u64().unwrap() as u32, generated[pos], "position {pos}");
        let want = item["top5"][pos]["logprob"].as_f64().unwrap();
        assert!((lps[0] - want).abs() < 0.05, "position {pos}: logprob {} vs llama.cpp {want}", lps[0]);
    }
}

/// `--warmup` generates once before the timed run: the printed generation is the timed one
/// alone (one JSON object, the same greedy tokens), and the log says the warm-up ran.
#[test]
fn run_with_a_warmup_prints_only_the_timed_generation() {
    let out = worker(&["run", "--model", &model_arg(), "--prompt-ids", "504,3575,282,4649,314", "--max-tokens", "6", "--json", "--warmup"]);
    assert!(out.status.success() && stderr(&out).contains("warm-up generation done"), "{}", stderr(&out));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.trim_end().lines().count(), 1, "one JSON object: {stdout:?}");
    let v: Value = serde_json::from_str(stdout.trim_end()).unwrap();
    assert_eq!(ids(&v["generated_ids"]), ids(&golden_item("raw_capital")["generated_ids"])[..6]);
    assert!(v["timings"]["decode_tokens_per_s"].as_f64().is_some_and(|t| t > 0.0), "{v}");
}

#[test]
fn run_json_from_prompt_text_tokenizes_like_llama_cpp() {
    let item = golden_item("raw_capital");
    let v = json_of(&["run", "--model", &model_arg(), "--prompt", item["prompt"].as_str().unwrap(), "--max-tokens", "4", "--json"]);
    assert_eq!(ids(&v["prompt_ids"]), ids(&item["prompt_ids"]));
    assert_eq!(ids(&v["generated_ids"]), ids(&item["generated_ids"])[..4]);
}

#[test]
fn run_chat_renders_the_template_like_the_golden_chat_prompt() {
    let item = golden_item("chat_capital");
    assert_eq!(item["messages"][0]["content"], "What is the capital of France?");
    let v = json_of(&["run", "--model", &model_arg(), "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "8", "--json"]);
    assert_eq!(ids(&v["prompt_ids"]), ids(&item["prompt_ids"]));
    assert_eq!(ids(&v["generated_ids"]), ids(&item["generated_ids"])[..8]);
}

#[test]
fn tokenize_parses_control_tokens_only_with_special() {
    let v = json_of(&["tokenize", "--model", &model_arg(), "--special", "<|im_start|>user"]);
    let special = ids(&v["ids"]);
    assert_eq!(special[0], 1, "{v}");
    assert!(special.len() > 1, "{v}");
    assert_eq!(special, tokenizer().encode("<|im_start|>user", true).unwrap());

    let v = json_of(&["tokenize", "--model", &model_arg(), "<|im_start|>user"]);
    let plain = ids(&v["ids"]);
    assert!(!plain.contains(&1), "without --special <|im_start|> must stay text: {v}");
    assert!(plain.len() > special.len());
}

#[test]
fn perplexity_scores_the_second_half_of_each_chunk() {
    let text: String = std::fs::read_to_string(golden("ppl.txt")).unwrap().chars().take(800).collect();
    let n_tokens = tokenizer().encode_prompt(&text, false).unwrap().len();
    let chunks = n_tokens / 64;
    assert!(chunks >= 2, "the text is too short for two chunks: {n_tokens} tokens");
    let file = scratch("ppl.txt", text.as_bytes());
    let out = worker(&["perplexity", "--model", &model_arg(), "--file", file.to_str().unwrap(), "--ctx", "64"]);
    std::fs::remove_file(&file).ok();
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(!stdout.contains("running perplexity"), "progress belongs on stderr: {stdout:?}");
    assert!(err.contains(&format!("[1/{chunks}]")) && err.contains(&format!("[{chunks}/{chunks}]")), "no progress lines: {err}");
    let v: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {stdout:?}"));
    // Logits at positions 32..=62 predict tokens 33..=63: 31 per chunk of 64.
    assert_eq!(v["tokens_scored"].as_u64().unwrap() as usize, chunks * 31, "{v}");
    let ppl = v["ppl"].as_f64().unwrap();
    assert!(ppl.is_finite() && ppl > 1.0, "{v}");
}

#[test]
fn a_missing_model_file_is_named() {
    let missing = Path::new(env!("CARGO_TARGET_TMPDIR")).join("no-such-model.gguf");
    let path = missing.to_str().unwrap();
    fails_with(&["run", "--model", path, "--prompt-ids", "1"], &[path]);
}

#[test]
fn a_file_that_is_not_gguf_is_rejected_by_its_magic() {
    let file = scratch("garbage.gguf", &[0x5a; 4096]);
    let err = fails_with(&["run", "--model", file.to_str().unwrap(), "--prompt-ids", "1"], &["magic"]);
    std::fs::remove_file(&file).ok();
    assert!(err.contains("GGUF"), "{err}");
}

#[test]
fn a_token_outside_the_vocabulary_is_rejected() {
    fails_with(&["run", "--model", &model_arg(), "--prompt-ids", "1,999999", "--max-tokens", "1"], &["999999", "vocabulary"]);
}

#[test]
fn bad_sampling_flags_are_rejected() {
    let err = fails_with(&["run", "--model", &model_arg(), "--prompt-ids", "1", "--temperature", "-1"], &["temperature", "-1"]);
    assert!(!err.contains("unexpected argument"), "a negative number must reach validation: {err}");
    fails_with(&["run", "--model", &model_arg(), "--prompt-ids", "1", "--top-p", "0"], &["top_p"]);
    fails_with(&["run", "--model", &model_arg(), "--prompt-ids", "1", "--max-tokens", "0"], &["max_tokens", "at least 1"]);
}

#[test]
fn bad_perplexity_inputs_are_rejected() {
    let file = scratch("short.txt", b"Only a handful of tokens here.");
    let f = file.to_str().unwrap();
    fails_with(&["perplexity", "--model", &model_arg(), "--file", f, "--ctx", "2"], &["ctx", "got 2"]);
    fails_with(&["perplexity", "--model", &model_arg(), "--file", f, "--ctx", "64"], &["fewer than one chunk of 64"]);
    std::fs::remove_file(&file).ok();
}

#[test]
fn a_prompt_longer_than_the_context_is_rejected() {
    let prompt = csv(&vec![504; 9000]);
    let err = fails_with(&["run", "--model", &model_arg(), "--prompt-ids", &prompt, "--max-tokens", "1"], &["context"]);
    assert!(err.contains(&N_CTX.to_string()), "the message should give the context size: {err}");
}

#[test]
fn device_cuda_fails_with_the_probes_reason_and_auto_picks_the_cpu_saying_why() {
    let model = model_arg();
    fails_with(&["--device", "tpu", "tokenize", "--model", &model, "Hi"], &["invalid value 'tpu'", "auto, cpu, cuda"]);
    let why = match duet_gpu_worker::device::cuda::probe(0) {
        Ok(gpu) => {
            // A GPU machine: `cuda` runs, and `auto` picks it, saying so.
            eprintln!("a usable GPU ({}): checking that auto and cuda run on it", gpu.name);
            drop(gpu);
            let out = worker(&["--device", "cuda", "run", "--model", &model, "--prompt", "Hi", "--max-tokens", "1", "--json"]);
            assert!(out.status.success(), "{}", stderr(&out));
            let out = worker(&["run", "--model", &model, "--prompt", "Hi", "--max-tokens", "1", "--json"]);
            assert_eq!(stderr(&out).matches("device auto: the CUDA device").count(), 1, "{}", stderr(&out));
            // Over the GPU memory budget: `cuda` fails naming it, `auto` takes the CPU.
            fails_with(&["--device", "cuda", "--gpu-mem-bytes", "1M", "run", "--model", &model, "--prompt", "Hi", "--max-tokens", "1"], &["--gpu-mem-bytes allows"]);
            let out = worker(&["--gpu-mem-bytes", "1M", "run", "--model", &model, "--prompt", "Hi", "--max-tokens", "1", "--json"]);
            assert!(out.status.success() && stderr(&out).contains("device auto: the CPU device"), "{}", stderr(&out));
            return;
        }
        Err(why) => why,
    };
    // No usable GPU: `cuda` is refused before anything runs, with the probe's reason.
    fails_with(&["--device", "cuda", "run", "--model", &model, "--prompt", "Hi", "--max-tokens", "1"], &["cuda device cannot be used", &why]);
    // `auto` (the default) runs on the CPU and says so, and why, in one log line.
    let out = worker(&["run", "--model", &model, "--prompt", "Hi", "--max-tokens", "1", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let log = stderr(&out);
    assert_eq!(log.matches("device auto: the CPU device").count(), 1, "{log}");
    assert!(log.contains(&why), "{log}");
    let out = worker(&["--device", "cpu", "run", "--model", &model, "--prompt", "Hi", "--max-tokens", "1", "--json"]);
    assert!(out.status.success() && !stderr(&out).contains("device auto"), "{}", stderr(&out));
    // A GPU memory budget is a byte count (it only matters where a GPU is).
    fails_with(&["--gpu-mem-bytes", "16Q", "tokenize", "--model", &model, "Hi"], &["--gpu-mem-bytes", "unknown unit"]);
    let out = worker(&["--device", "cpu", "--gpu-mem-bytes", "16G", "run", "--model", &model, "--prompt", "Hi", "--max-tokens", "1", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
}
