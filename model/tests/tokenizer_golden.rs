//! The GGUF-built tokenizer against llama.cpp's tokenisation of `testdata/golden/tokenize.json`.

use duet_model::gguf::GgufFile;
use duet_model::tokenizer::{StreamDecoder, Tokenizer};
use duet_model::testutil::{golden, model_path};
use serde_json::Value;

fn tokenizer() -> Tokenizer {
    Tokenizer::from_gguf(&GgufFile::open(model_path()).unwrap()).unwrap()
}

#[test]
fn every_golden_case_matches_llama_cpp() {
    let tk = tokenizer();
    let cases: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(golden("tokenize.json")).unwrap()).unwrap();
    let mut failures = Vec::new();
    for c in &cases {
        let text = c["text"].as_str().unwrap();
        let special = c["parse_special"].as_bool().unwrap();
        let want: Vec<u32> = c["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let got = tk.encode(text, special).unwrap();
        if got != want {
            failures.push(format!("{} (special={special}): got {got:?}, want {want:?}", c["name"]));
            continue;
        }
        let detok = tk.decode(&got).unwrap();
        if detok != c["detokenized"].as_str().unwrap() {
            failures.push(format!("{}: decoded {detok:?}", c["name"]));
        }
        for (id, piece) in got.iter().zip(c["pieces"].as_array().unwrap()) {
            let want_bytes: Vec<u8> = match piece {
                Value::String(s) => s.as_bytes().to_vec(),
                Value::Array(a) => a.iter().map(|b| b.as_u64().unwrap() as u8).collect(),
                _ => panic!("bad piece"),
            };
            if tk.token_bytes(*id).unwrap() != want_bytes {
                failures.push(format!("{}: piece of {id}", c["name"]));
            }
        }
    }
    assert!(failures.is_empty(), "{} of {} cases differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
    assert!(cases.len() >= 48);
}

#[test]
fn a_tokenizer_json_gives_the_same_tokens_and_bytes() {
    let tk = tokenizer();
    let path = std::env::temp_dir().join(format!("duet-tokenizer-{}.json", std::process::id()));
    std::fs::write(&path, tk.to_json().unwrap()).unwrap();
    let from_json = Tokenizer::from_file(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(from_json.vocab_size(), tk.vocab_size());
    for id in 0..tk.vocab_size() as u32 {
        assert_eq!(from_json.token_bytes(id).unwrap(), tk.token_bytes(id).unwrap(), "bytes of token {id}");
    }
    let cases: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(golden("tokenize.json")).unwrap()).unwrap();
    for c in &cases {
        let (text, special) = (c["text"].as_str().unwrap(), c["parse_special"].as_bool().unwrap());
        assert_eq!(from_json.encode(text, special).unwrap(), tk.encode(text, special).unwrap(), "{}", c["name"]);
    }
    let sorted = |v: &[u32]| {
        let mut v = v.to_vec();
        v.sort();
        v
    };
    assert_eq!(sorted(&from_json.end_of_generation), sorted(&tk.end_of_generation));
    assert!(Tokenizer::from_file(std::path::Path::new("/nonexistent/tokenizer.json")).is_err());
}

#[test]
fn streaming_never_splits_a_character() {
    let tk = tokenizer();
    let text = "Emoji 🎉 and 中文 and café — done";
    let ids = tk.encode(text, false).unwrap();
    let mut dec = StreamDecoder::default();
    let mut out = String::new();
    for &id in &ids {
        let piece = dec.push(tk.token_bytes(id).unwrap());
        assert!(!piece.contains(char::REPLACEMENT_CHARACTER), "emitted a broken character at token {id}");
        out.push_str(&piece);
    }
    out.push_str(&dec.finish());
    assert_eq!(out, text);
}

#[test]
fn stream_decoder_holds_partial_and_replaces_invalid() {
    let mut dec = StreamDecoder::default();
    let euro = "€".as_bytes();
    assert_eq!(dec.push(&euro[..1]), "");
    assert_eq!(dec.push(&euro[1..2]), "");
    assert_eq!(dec.push(&euro[2..]), "€");
    assert_eq!(dec.push(&[0xFF, b'a']), "\u{FFFD}a");
    assert_eq!(dec.push(&euro[..2]), "");
    assert_eq!(dec.finish(), "\u{FFFD}");
}

#[test]
fn out_of_vocabulary_ids_are_errors() {
    let tk = tokenizer();
    assert!(matches!(tk.decode(&[1, 999_999]), Err(duet_model::Error::TokenOutOfRange { id: 999_999, .. })));
}
