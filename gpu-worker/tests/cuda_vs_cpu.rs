//! The CUDA device against the CPU device on a model of a real shape (a random-weight GGUF in
//! Llama-3.2-1B's shape, made by `scripts/gen_random_model.py` on the GPU machine; its path in
//! `DUET_CUDA_TEST_MODEL`): the logits of a 48-token prefill at every position, and 16 greedy
//! tokens, identical up to near ties. The two devices round differently (see the CUDA
//! device's module documentation), so the logits agree within a tolerance: max |CUDA - CPU|
//! within 10 % of the CPU logits' standard deviation, and the rms of the difference within 2 %. Skipped
//! without a GPU or without the model (`DUET_REQUIRE_CUDA=1` makes either a failure).

use duet_gpu_worker::device::{Device, DeviceChoice};
use duet_gpu_worker::runner::{Runner, KvCache, Logits};

fn skip(why: &str) {
    if std::env::var("DUET_REQUIRE_CUDA").is_ok_and(|v| v == "1") {
        panic!("DUET_REQUIRE_CUDA=1: {why}");
    }
    eprintln!("skipped: {why}");
}

fn argmax(row: &[f32]) -> usize {
    (0..row.len()).fold(0, |best, i| if row[i] > row[best] { i } else { best })
}

/// The gap between the best and the second-best logit.
fn top2_gap(row: &[f32]) -> f32 {
    let best = argmax(row);
    row[best] - row.iter().enumerate().filter(|&(i, _)| i != best).map(|(_, &v)| v).fold(f32::NEG_INFINITY, f32::max)
}

/// `n` greedy tokens after `prompt`, each with the top-2 gap of the logits it came from.
fn greedy<D: Device>(e: &Runner<D>, prompt: &[u32], n: usize) -> Vec<(u32, f32)> {
    let mut kv = KvCache::new(e.device.config(), prompt.len() + n + 1);
    let mut logits = e.forward(prompt, &mut kv, Logits::Last).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let t = argmax(&logits) as u32;
        out.push((t, top2_gap(&logits)));
        logits = e.forward(&[t], &mut kv, Logits::Last).unwrap();
    }
    out
}

#[test]
fn cuda_logits_and_greedy_tokens_match_the_cpu_device_on_a_real_shape() {
    let Some(path) = std::env::var_os("DUET_CUDA_TEST_MODEL") else {
        return skip("DUET_CUDA_TEST_MODEL names no model (scripts/gpu-check.sh makes one on the GPU machine)");
    };
    let cuda = match Runner::load_on(std::path::Path::new(&path), DeviceChoice::Cuda) {
        Ok(e) => e,
        Err(e) => return skip(&format!("the CUDA device: {e}")),
    };
    let cpu = Runner::load(std::path::Path::new(&path)).unwrap();
    let c = cpu.device.config().clone();
    println!("{} vs {}", cuda.device.describe(), cpu.device.describe());
    let n = 48;
    let tokens: Vec<u32> = (0..n as u64).map(|i| ((i * 2_654_435_761 + 12_345) % c.n_vocab as u64) as u32).collect();

    // Prefill logits at every position.
    let got = cuda.forward(&tokens, &mut KvCache::new(&c, n + 32), Logits::From(0)).unwrap();
    let want = cpu.forward(&tokens, &mut KvCache::new(&c, n + 32), Logits::From(0)).unwrap();
    assert_eq!(got.len(), want.len());
    // The scale: the CPU logits' spread about their mean (a random model's logits sit on an offset).
    let mean = want.iter().map(|&v| v as f64).sum::<f64>() / want.len() as f64;
    let rms = (want.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / want.len() as f64).sqrt();
    let max_err = got.iter().zip(&want).map(|(&a, &b)| (a as f64 - b as f64).abs()).fold(0.0, f64::max) / rms;
    let rms_err = (got.iter().zip(&want).map(|(&a, &b)| (a as f64 - b as f64).powi(2)).sum::<f64>() / want.len() as f64).sqrt() / rms;
    println!("prefill logits, {n} positions: max |CUDA - CPU| {max_err:.2e} of sd {rms:.3}, rms difference {rms_err:.2e}");
    assert!(max_err <= 0.10 && rms_err <= 0.02, "prefill logits differ: max {max_err:.3e}, rms {rms_err:.3e} (of the CPU logits' sd)");

    // Greedy decoding: the same tokens until the CPU's choice is a near tie (a gap within
    // four times the observed rms difference).
    let near = 4.0 * rms_err * rms;
    let g = greedy(&cuda, &tokens, 16);
    let w = greedy(&cpu, &tokens, 16);
    let mut same = 0;
    for (i, (&(a, _), &(b, gap))) in g.iter().zip(&w).enumerate() {
        if (gap as f64) < near {
            println!("greedy: stopped comparing at token {i}, a near tie (gap {gap:.4})");
            break;
        }
        assert_eq!(a, b, "greedy token {i}: CUDA {a}, CPU {b} (CPU top-2 gap {gap:.4})");
        same += 1;
    }
    println!("greedy: {same}/16 tokens identical before any near tie");
    assert!(same >= 4, "only {same} greedy tokens compared");
}
