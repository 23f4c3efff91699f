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
