//! Perplexity of the default model on `testdata/golden/ppl.txt` at ctx 512, against
//! llama.cpp's llama-perplexity (PPL 18.3541 over 14 chunks).

use duet_model::testutil::{golden, model_path};
use duet_gpu_worker::runner::Runner;

const LLAMA_CPP_PPL: f64 = 18.3541;

#[test]
fn perplexity_matches_llama_cpp_within_half_a_percent() {
    let engine = Runner::load(&model_path()).unwrap();
    let text = std::fs::read_to_string(golden("ppl.txt")).unwrap();
    let tokens = engine.tokenizer.encode_prompt(&text, false).unwrap();
    assert_eq!(tokens.len(), 7639, "llama.cpp tokenises ppl.txt to 7,639 tokens");
    let mut seen = Vec::new();
    let result = engine.perplexity(&tokens, 512, |done, total, _| seen.push((done, total))).unwrap();
    println!("ppl {:.4} over {} tokens in {} chunks (llama.cpp {LLAMA_CPP_PPL})", result.ppl, result.tokens_scored, result.chunks);
    assert_eq!(result.chunks, 14);
    assert_eq!(result.tokens_scored, 14 * 255);
    assert_eq!(seen.last(), Some(&(14, 14)), "progress reported per chunk");
    let rel = (result.ppl - LLAMA_CPP_PPL).abs() / LLAMA_CPP_PPL;
    assert!(rel < 0.005, "ppl {} is {:.3}% from llama.cpp's {LLAMA_CPP_PPL}", result.ppl, rel * 100.0);
}

/// llama.cpp's perplexity with `-ctk q8_0 -ctv q8_0` (and the flash attention it needs) on the
/// same text: `scripts/llama_cpp_perplexity.py --kv-type q8_0` with llama-cpp-python 0.3.36.
const LLAMA_CPP_PPL_Q8_0: f64 = 18.3843;

/// With a Q8_0 cache the perplexity moves, by less than 1 % (18.4340 against f16's 18.3541 on
/// this build; llama.cpp's moves to 18.3843): the cache is quantised, and not wrecked.
#[test]
fn q8_0_cache_perplexity_is_within_one_percent_of_f16() {
    let mut engine = Runner::load(&model_path()).unwrap();
    engine.kv_type = duet_kv::KvDtype::Q8_0;
    let text = std::fs::read_to_string(golden("ppl.txt")).unwrap();
    let tokens = engine.tokenizer.encode_prompt(&text, false).unwrap();
    let result = engine.perplexity(&tokens, 512, |_, _, _| {}).unwrap();
    println!("q8_0 cache: ppl {:.4} (llama.cpp's with a q8_0 cache {LLAMA_CPP_PPL_Q8_0}, f16 {LLAMA_CPP_PPL})", result.ppl);
    let rel = (result.ppl - LLAMA_CPP_PPL) / LLAMA_CPP_PPL;
    // The f16 cache scores 18.35407 here: a Q8_0 cache that was not used would too.
    assert!(rel.abs() > 1e-4, "ppl {} is the f16 cache's: the q8_0 cache was not used", result.ppl);
    assert!(rel.abs() < 0.01, "ppl {} is {:.3}% from the f16 cache's {LLAMA_CPP_PPL}", result.ppl, rel * 100.0);
}
