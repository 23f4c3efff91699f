//! Tiny random Llama models (`testdata/tiny/`) against float64 numpy reference logits: untied
//! output, RoPE divisors from `rope_freqs.weight` and from llama3 metadata, linear RoPE scaling,
//! GQA/MQA, head_dim 16, 24 and 32 (and a Q width different from n_embd), F32/F16/BF16/Q4_0/
//! Q4_1/Q5_0/Q5_1/Q8_0 weights; batched prefill, chunked prefill and one-token-at-a-time decode;
//! on the CPU device, and on the CUDA device where a GPU is (`check_cuda`).
//!
//! The models and references come from `scripts/gen_tiny_llama.py` (its docstring says what
//! each variant covers). Each model has two references, both float64 on the dequantised
//! weights:
//!
//! * `<name>.logits.bin`, the exact forward pass: Duet differs from it only by ggml's activation
//!   rounding: f16 Q, f16 KV cache and f16 softmax weights in attention (every variant), f16 /
//!   bf16 activations for F16 / BF16 weights, 8-bit block-quantised activations (Q8_0 / Q8_1)
//!   for the quantised weights.
//! * `<name>.rounded.bin`, the same pass with exactly that rounding applied (and nothing of
//!   Duet's code): Duet matches it to ~1e-7 of the logits' scale, up to the first value that
//!   sits on a rounding boundary: there an f32-ulp difference flips one rounding, and the change
//!   (up to ~1e-3 of the scale for f16, a few 1e-2 for 8-bit activations, which sharp attention
//!   amplifies) carries to later positions through the KV cache. So this reference cannot take
//!   a tight max tolerance; instead Duet must be clearly closer to it than to the exact pass (in
//!   rms): the deviation is the modelled rounding, not something else.
//!
//! Tolerances, per variant, follow from the size of the modelled rounding itself
//! (`rounding_dev_max` / `_rms` in the JSON: max and rms of rounded - exact, over the logits'
//! rms): Duet's max |Duet - exact| / rms(exact) must stay within 2.5 times that (observed: 1.0
//! times or less), i.e. ~8e-3 for F32, ~2e-2 for F16, ~0.26 for Q8_0, ~0.18 for the mixed
//! 4-/5-/8-bit and BF16 types; the rms error within 2.5 times the rounding's rms. Every tolerance is checked to be below 1/10 of the change each plausible
//! bug makes (the script's `ablations`: no RoPE, NeoX pairs, RoPE scaling ignored, divisors
//! multiplied instead of divided, tied instead of untied output, default eps, wrong GQA head
//! mapping), so no such bug can pass.

use std::path::PathBuf;

use duet_kernels::ops::llama3_freq_factors;
use duet_model::config::RopeScaling;
use duet_model::testutil::workspace_root;
use duet_gpu_worker::device::{Device, DeviceChoice};
use duet_gpu_worker::runner::{KvCache, Logits};
use duet_gpu_worker::runner::Runner;
use serde_json::Value;

#[path = "support/f64_forward.rs"]
mod f64_forward;

fn dir() -> PathBuf {
    workspace_root().join("testdata/tiny")
}

struct Reference {
    meta: Value,
    tokens: Vec<u32>,
    n_vocab: usize,
    logits: Vec<f32>,
}

fn reference(name: &str) -> Reference {
    let meta: Value = serde_json::from_str(&std::fs::read_to_string(dir().join(format!("{name}.json"))).unwrap()).unwrap();
    let tokens: Vec<u32> = meta["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
    let n_vocab = meta["n_vocab"].as_u64().unwrap() as usize;
    let logits = read_f32(&format!("{name}.logits.bin"));
    assert_eq!(logits.len(), tokens.len() * n_vocab, "{name}: reference logits shape");
    Reference { meta, tokens, n_vocab, logits }
}

fn read_f32(file: &str) -> Vec<f32> {
    let bytes = std::fs::read(dir().join(file)).unwrap();
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
}

fn row(x: &[f32], p: usize, n_vocab: usize) -> &[f32] {
    &x[p * n_vocab..(p + 1) * n_vocab]
}

fn rms(x: &[f32]) -> f64 {
    (x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / x.len() as f64).sqrt()
}

/// rms(a - b) / scale.
fn rel_rms(a: &[f32], b: &[f32], scale: f64) -> f64 {
    assert_eq!(a.len(), b.len());
    (a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum::<f64>() / a.len() as f64).sqrt() / scale
}

/// max |a - b| / scale.
fn rel_max(a: &[f32], b: &[f32], scale: f64) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).abs()).fold(0.0, f64::max) / scale
}

fn argmax(row: &[f32]) -> usize {
    (0..row.len()).fold(0, |best, i| if row[i] > row[best] { i } else { best })
}

/// Runs one tiny model three ways on the CPU device and checks each against the references.
/// `tol_paths`: max |diff| / rms between batched prefill, chunked prefill and one-token
/// decode, which differ only in attention's f16 lane order (llama.cpp's tinyBLAS for batches,
/// `ggml_vec_dot_f16` for one token), i.e. at f32-ulp level until a rounding flips.
fn check(name: &str, tol_paths: f64) {
    let engine = Runner::load(&dir().join(format!("{name}.gguf"))).unwrap();
    check_engine(name, &engine, Some(tol_paths));
}

/// The same on the CUDA device, where a GPU is (else the test says it was skipped, or fails
/// under `DUET_REQUIRE_CUDA=1`). The GPU rounds differently from ggml (Q8_1 activations with
/// f32 scales for the matrix-vector kernels, f16 activations for cuBLAS on batches over 8
/// rows), so its logits are held to the same tolerances against the exact reference but not
/// to ggml's modelled rounding, and its paths (batched: cuBLAS; decode: mat-vec) may differ
/// by as much as that tolerance.
fn check_cuda(name: &str) {
    let path = dir().join(format!("{name}.gguf"));
    // A KV mirror of 256 MiB (by default it takes what the GPU has free), so that the test's
    // other devices find room.
    duet_gpu_worker::device::cuda::set_kv_budget(256 << 20);
    let engine = match Runner::load_on(&path, DeviceChoice::Cuda) {
        Ok(engine) => engine,
        Err(e) => {
            if std::env::var("DUET_REQUIRE_CUDA").is_ok_and(|v| v == "1") {
                panic!("{name} on the CUDA device: {e}");
            }
            return eprintln!("skipped: {name} on the CUDA device: {e}");
        }
    };
    check_engine(name, &engine, None);
}

/// `tol_paths`: `None` for a device that does not round as ggml does (see [`check_cuda`]).
fn check_engine<D: Device>(name: &str, engine: &Runner<D>, tol_paths: Option<f64>) {
    let r = reference(name);
    let rounded = read_f32(&format!("{name}.rounded.bin"));
    assert_eq!(rounded.len(), r.logits.len());
    let model = engine;
    let c = engine.device.config();
    let m = &r.meta;
    let n = r.tokens.len();
    let f = |key: &str| m[key].as_f64().unwrap_or_else(|| panic!("{name}: {key} missing"));

    // The loader read the hyper-parameters this variant is about.
    assert_eq!(c.n_vocab, r.n_vocab);
    assert_eq!(c.n_layer as u64, m["n_layer"].as_u64().unwrap());
    assert_eq!(c.n_head as u64, m["n_head"].as_u64().unwrap());
    assert_eq!(c.n_kv_head as u64, m["n_kv_head"].as_u64().unwrap());
    assert_eq!(c.head_dim as u64, m["head_dim"].as_u64().unwrap());
    assert_eq!(c.rms_eps, f("rms_eps") as f32);
    assert_eq!(c.rope_freq_base, f("rope_freq_base") as f32);
    let rope = &m["rope"];
    match (rope["kind"].as_str().unwrap(), &c.rope_scaling) {
        ("none", RopeScaling::None) | ("freqs_tensor", RopeScaling::FreqFactors) => {}
        ("linear", RopeScaling::Linear { factor }) => assert_eq!(*factor as f64, rope["factor"].as_f64().unwrap()),
        ("llama3", &RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_context }) => {
            assert_eq!(factor as f64, rope["factor"].as_f64().unwrap());
            assert_eq!(low_freq_factor as f64, rope["low_freq_factor"].as_f64().unwrap());
            assert_eq!(high_freq_factor as f64, rope["high_freq_factor"].as_f64().unwrap());
            assert_eq!(original_context as f64, rope["original_context"].as_f64().unwrap());
            // Duet's divisors against the script's (llama.cpp's converter's formula, in f64).
            let ours = llama3_freq_factors(c.n_rot, c.rope_freq_base, factor, low_freq_factor, high_freq_factor, original_context);
            let want: Vec<f64> = m["rope_divisors"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
            assert_eq!(ours.len(), want.len());
            assert!(want.iter().any(|&w| w > 1.0 && w < factor as f64), "{name}: no divisor in the smooth band");
            for (i, (&a, &b)) in ours.iter().zip(&want).enumerate() {
                assert!((a as f64 - b).abs() <= 1e-5 * b, "{name}: llama3 divisor {i}: Duet {a}, reference {b}");
            }
        }
        (kind, got) => panic!("{name}: the reference uses RoPE scaling {kind:?}, Duet read {got:?}"),
    }

    // Tolerances from the size of the rounding Duet is expected to do (see the module docs),
    // far below what any plausible bug changes.
    let tol = 2.5 * f("rounding_dev_max");
    let tol_rms = 2.5 * f("rounding_dev_rms");
    for (what, change) in m["ablations"].as_object().unwrap() {
        let change = change.as_f64().unwrap();
        assert!(tol * 10.0 < change, "{name}: tolerance {tol} cannot tell a correct model from {what:?} ({change})");
    }
    let ggml_rounding = tol_paths.is_some();
    let tol_paths = tol_paths.unwrap_or(tol);
    assert!(tol_paths <= tol);

    let scale = rms(&r.logits);

    // (a) the whole sequence as one prefill, logits at every position.
    let mut kv = KvCache::new(c, n);
    let batched = model.forward(&r.tokens, &mut kv, Logits::From(0)).unwrap();
    assert_eq!(batched.len(), n * r.n_vocab);
    assert_eq!(kv.len(), n);

    // (b) one token at a time.
    let mut kv = KvCache::new(c, n);
    let mut decode = Vec::with_capacity(n * r.n_vocab);
    for &t in &r.tokens {
        decode.extend(model.forward(&[t], &mut kv, Logits::Last).unwrap());
    }

    // (c) prefill in uneven chunks (batches starting at non-zero positions, a batch of one,
    // the KV length crossing attention's padding of 32 inside a batch).
    let mut kv = KvCache::new(c, n);
    let mut chunked = Vec::with_capacity(n * r.n_vocab);
    for range in [0..13, 13..14, 14..n] {
        chunked.extend(model.forward(&r.tokens[range], &mut kv, Logits::From(0)).unwrap());
    }

    let runs = [("batched", &batched), ("decode", &decode), ("chunked", &chunked)];
    let mut report = format!("{name} on {}: rms(logits) {scale:.3}, tolerance max {tol:.2e} rms {tol_rms:.2e}\n", engine.device.describe());
    for (how, got) in runs {
        let err = rel_max(got, &r.logits, scale);
        let err_rms = rel_rms(got, &r.logits, scale);
        let vs_rounded = rel_rms(got, &rounded, scale);
        let exact_positions = (0..n).filter(|&p| rel_max(row(got, p, r.n_vocab), row(&rounded, p, r.n_vocab), scale) <= 1e-5).count();
        report += &format!(
            "  {how:8} vs exact: max {err:.2e} rms {err_rms:.2e}; vs rounded: rms {vs_rounded:.2e}, \
             {exact_positions}/{n} positions within 1e-5\n"
        );
        assert!(err <= tol, "{name}: {how}: max |err|/rms {err:.3e} > {tol:.3e}");
        assert!(err_rms <= tol_rms, "{name}: {how}: rms err/rms {err_rms:.3e} > {tol_rms:.3e}");
        assert!(
            !ggml_rounding || vs_rounded <= 0.7 * err_rms,
            "{name}: {how}: not explained by the modelled rounding: rms vs rounded {vs_rounded:.3e}, vs exact {err_rms:.3e}"
        );
    }
    let err_paths = rel_max(&batched, &decode, scale).max(rel_max(&batched, &chunked, scale));
    report += &format!("  batched vs decode/chunked: max {err_paths:.2e} (tolerance {tol_paths:.0e})\n");
    assert!(err_paths <= tol_paths, "{name}: batched vs decode/chunked max |diff|/rms {err_paths:.3e} > {tol_paths:.0e}");

    // Greedy choice per position wherever the reference's top-2 gap is 10 times the typical
    // rounding error (or more).
    let min_gap = 10.0 * f("rounding_dev_rms") * scale;
    let mut compared = 0;
    for p in 0..n {
        let want = row(&r.logits, p, r.n_vocab);
        let best = argmax(want);
        let second = want.iter().enumerate().filter(|&(i, _)| i != best).map(|(_, &v)| v).fold(f32::NEG_INFINITY, f32::max);
        if ((want[best] - second) as f64) <= min_gap {
            continue;
        }
        compared += 1;
        for (how, got) in runs {
            assert_eq!(argmax(row(got, p, r.n_vocab)), best, "{name}: {how}: argmax at position {p}");
        }
    }
    report += &format!("  argmax equal at the {compared}/{n} positions with a top-2 gap over {min_gap:.3}");
    println!("{report}");
    assert!(compared >= n / 4, "{name}: only {compared}/{n} positions have a clear argmax");
}

#[test]
fn f32_untied_output_rope_freqs_tensor() {
    check("f32_untied_freqs", 1e-3);
}

#[test]
fn f16_llama3_scaling_from_metadata() {
    check("f16_llama3_meta", 1e-2);
}

#[test]
fn q8_0_linear_scaling_tied_output() {
    check("q8_0_linear_tied", 1e-1);
}

#[test]
fn mixed_quant_types_mqa() {
    check("mixed_quant", 1e-1);
}

/// Head size 24, not a multiple of 16: batched prefill must not take tinyBLAS's 16-lane Q·K
/// (llama.cpp's tinyBLAS declines an inner dimension that is not a multiple of 16 and ggml falls
/// back to `ggml_vec_dot_f16`). This caught `dot_tiled` dropping the last `head_dim % 16`
/// elements of every Q·K (max error ~4 x rms before the fix).
#[test]
fn f16_head_dim_not_a_multiple_of_16() {
    check("f16_head_dim_24", 1e-2);
}

#[test]
fn cuda_device_on_every_tiny_model() {
    for name in ["f32_untied_freqs", "f16_llama3_meta", "q8_0_linear_tied", "mixed_quant", "f16_head_dim_24"] {
        check_cuda(name);
    }
}

/// The float64 forward that judges devices on models too big for stored references
/// (`cuda_vs_cpu.rs`) is itself exact: it gives every tiny model's numpy reference logits.
#[test]
fn the_f64_forward_gives_the_numpy_references() {
    for name in ["f32_untied_freqs", "f16_llama3_meta", "q8_0_linear_tied", "mixed_quant", "f16_head_dim_24"] {
        let r = reference(name);
        let (got, n_vocab) = f64_forward::logits(&dir().join(format!("{name}.gguf")), &r.tokens);
        assert_eq!(n_vocab, r.n_vocab);
        let got: Vec<f32> = got.into_iter().map(|v| v as f32).collect();
        let err = rel_max(&got, &r.logits, rms(&r.logits));
        println!("{name}: f64 forward vs numpy reference: max {err:.2e} of rms");
        assert!(err <= 1e-5, "{name}: the f64 forward differs from the numpy reference by {err:.3e} (max, of the logits' rms)");
    }
}
