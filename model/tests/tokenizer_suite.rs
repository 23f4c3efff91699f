//! llama.cpp's tokenizer test suite (`models/ggml-vocab-*.gguf` with `.inp`/`.out`, vocabulary-
//! only GGUFs of many families and the ids Hugging Face's tokenizers give; fetched by
//! scripts/fetch-llama-cpp-src.sh into models/llama.cpp/vocab): every vocabulary Duet supports
//! gives exactly those ids on every input, and every other one is refused with an error naming
//! what is unsupported (never tokenized wrongly). Skipped with a note when the files are absent,
//! unless DUET_REQUIRE_LLAMA_CPP_SRC is set (scripts/test.sh sets it after fetching them).

use std::path::PathBuf;

use duet_model::gguf::GgufFile;
use duet_model::tokenizer::Tokenizer;

/// The suite's vocabularies Duet tokenizes, and those it refuses (with a word the error names).
const SUPPORTED: &[&str] = &[
    "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gpt-2", "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35",
    "refact", "starcoder",
];
const REFUSED: &[(&str, &str)] = &[("bert-bge", "\"bert\""), ("gemma-4", "\"gemma4\""), ("nomic-bert-moe", "\"t5\"")];

fn dir() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/llama.cpp/vocab");
    if dir.is_dir() {
        return Some(dir);
    }
    assert!(std::env::var_os("DUET_REQUIRE_LLAMA_CPP_SRC").is_none(), "{} is missing: run scripts/fetch-llama-cpp-src.sh", dir.display());
    eprintln!("skipped: {} is missing (scripts/fetch-llama-cpp-src.sh fetches it)", dir.display());
    None
}

/// The suite's cases: inputs separated as test-tokenizer-0.cpp separates them, one line of ids each.
fn cases(dir: &std::path::Path, name: &str) -> Vec<(String, Vec<u32>)> {
    let path = dir.join(format!("ggml-vocab-{name}.gguf"));
    let inp = std::fs::read_to_string(path.with_extension("gguf.inp")).unwrap();
    let out = std::fs::read_to_string(path.with_extension("gguf.out")).unwrap();
    const SEP: &str = "\n__ggml_vocab_test__\n";
    // As test-tokenizer-0.cpp reads it: a separator at the very end opens no case.
    let inputs: Vec<String> = inp.strip_suffix(SEP).unwrap_or(&inp).split(SEP).map(str::to_string).collect();
    let outputs: Vec<Vec<u32>> = out.lines().map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect()).collect();
    assert_eq!(inputs.len(), outputs.len(), "{name}: inputs and outputs differ in number");
    inputs.into_iter().zip(outputs).collect()
}

#[test]
fn every_supported_vocabulary_tokenizes_every_case_as_llama_cpp_expects() {
    let Some(dir) = dir() else { return };
    let (mut checked, mut failures) = (0, Vec::new());
    for name in SUPPORTED {
        let g = GgufFile::open(dir.join(format!("ggml-vocab-{name}.gguf"))).unwrap_or_else(|e| panic!("{name}: {e}"));
        let tk = Tokenizer::from_gguf(&g).unwrap_or_else(|e| panic!("{name}: {e}"));
        for (input, want) in cases(&dir, name) {
            checked += 1;
            let got = tk.encode(&input, false).unwrap();
            if got != want {
                failures.push(format!("{name}: {input:?}\n   got  {got:?}\n   want {want:?}"));
            }
        }
    }
    assert!(checked > 300, "only {checked} cases");
    assert!(failures.is_empty(), "{} of {checked} cases differ:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn unsupported_vocabularies_are_refused_by_name() {
    let Some(dir) = dir() else { return };
    for (name, says) in REFUSED {
        let g = GgufFile::open(dir.join(format!("ggml-vocab-{name}.gguf"))).unwrap();
        match Tokenizer::from_gguf(&g) {
            Err(e) => assert!(e.to_string().contains(says), "{name}: {e}"),
            Ok(_) => panic!("{name} was accepted"),
        }
    }
}
