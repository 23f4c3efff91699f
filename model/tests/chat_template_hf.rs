//! Real chat templates (Qwen 2.5/3, Hermes 3, Llama 3.1/3.2, Mistral Nemo/Small 3.2, Phi 3.5,
//! Gemma 2, DeepSeek R1, SmolLM3, Granite 3.3; testdata/templates/) render byte for byte as
//! Hugging Face's `apply_chat_template` renders them (testdata/templates/golden.json, written
//! by scripts/gen_template_golden.py with Python's jinja2 in Hugging Face's settings), with and
//! without tools, tool calls and tool results; a template that raises is refused with its message.

use std::path::{Path, PathBuf};

use duet_model::chat::{ChatMessage, ChatTemplate};
use duet_model::Error;
use serde_json::Value;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/templates")
}

fn messages(case: &Value) -> Vec<ChatMessage> {
    serde_json::from_value(case["messages"].clone()).expect("the golden messages are ChatMessages")
}

/// Renders every template of `dir`'s golden.json on every case; returns the cases checked and
/// the differences (a template that jinja2 could not compile is refused too, or a difference).
fn check_golden(dir: &Path) -> (usize, Vec<String>) {
    let golden: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let cases = golden["cases"].as_array().unwrap();
    // strftime_now: the golden holds the dates of the day it was written; put today's in their place.
    let dates: Vec<(String, String)> = golden["dates"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(format, then)| {
            let now = ChatTemplate::new(&format!("{{{{ strftime_now({format:?}) }}}}"), "", "").unwrap();
            (then.as_str().unwrap().to_string(), now.render(&[ChatMessage::new("user", "")], false).unwrap())
        })
        .collect();
    let (mut checked, mut failures) = (0, Vec::new());
    for t in golden["templates"].as_array().unwrap() {
        let file = t["file"].as_str().unwrap();
        let source = std::fs::read_to_string(dir.join(file)).unwrap();
        let template = match (ChatTemplate::new(&source, t["bos_token"].as_str().unwrap(), t["eos_token"].as_str().unwrap()), t.get("compile_error")) {
            (Ok(template), None) => template,
            (Err(_), Some(_)) => continue,
            (got, _) => {
                failures.push(format!("{file}: compiles: {:?}; jinja2: {}", got.map(drop), t.get("compile_error").unwrap_or(&Value::Null)));
                continue;
            }
        };
        for case in cases {
            let name = case["name"].as_str().unwrap();
            let tools = case.get("tools").and_then(Value::as_array).map(Vec::as_slice);
            let got = template.render_with_tools(&messages(case), tools, case["add_generation_prompt"].as_bool().unwrap());
            let want = &t["results"][name];
            checked += 1;
            match (got, want.get("text").and_then(Value::as_str), want.get("error").and_then(Value::as_str)) {
                (Ok(text), Some(expected), _) => {
                    let expected = dates.iter().fold(expected.to_string(), |text, (then, now)| text.replace(then, now));
                    if text != expected {
                        let at = text.bytes().zip(expected.bytes()).take_while(|(a, b)| a == b).count();
                        let end = |s: &str| s.get(at..(at + 80).min(s.len())).unwrap_or("").to_string();
                        failures.push(format!("{file} / {name}: differs from byte {at}: got {:?}, want {:?}", end(&text), end(&expected)));
                    }
                }
                (Err(Error::Template(msg)), None, Some(raised)) => {
                    if !msg.contains(raised) {
                        failures.push(format!("{file} / {name}: refused with {msg:?}, which does not carry the template's message {raised:?}"));
                    }
                }
                // jinja2 refused (e.g. an undefined attribute): so must Duet, in its own words.
                (Err(Error::Template(_)), None, None) if want.get("jinja_error").is_some() => {}
                // Python itself refused (e.g. iterating None); refusing or rendering are both fine.
                (_, None, None) if want.get("python_error").is_some() => checked -= 1,
                (got, _, _) => failures.push(format!("{file} / {name}: got {got:?}, want {want}")),
            }
        }
    }
    (checked, failures)
}

#[test]
fn real_templates_render_as_hugging_face_renders_them() {
    let (checked, failures) = check_golden(&dir());
    assert!(checked >= 60, "only {checked} cases checked");
    assert!(failures.is_empty(), "{} of {checked} renderings differ from Hugging Face's:\n{}", failures.len(), failures.join("\n"));
}

/// Every template of llama.cpp's models/templates (scripts/fetch-llama-cpp-src.sh; golden.json
/// written there by scripts/gen_template_golden.py, as scripts/test.sh does), except those listed
/// in KNOWN_DIFFERENCES with the reason.
#[test]
fn every_llama_cpp_template_renders_as_jinja2_renders_it() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/llama.cpp/templates");
    if !dir.join("golden.json").exists() {
        assert!(std::env::var_os("DUET_REQUIRE_LLAMA_CPP_SRC").is_none(), "{}/golden.json is missing: run scripts/fetch-llama-cpp-src.sh and scripts/gen_template_golden.py {}", dir.display(), dir.display());
        eprintln!("skipped: {}/golden.json is missing", dir.display());
        return;
    }
    let (checked, failures) = check_golden(&dir);
    let (known, unknown): (Vec<String>, Vec<String>) =
        failures.into_iter().partition(|f| KNOWN_DIFFERENCES.iter().any(|(file, _)| f.starts_with(file)));
    for (file, why) in KNOWN_DIFFERENCES {
        eprintln!("known difference: {file}: {why}");
    }
    eprintln!("{checked} renderings checked, {} known differences", known.len());
    assert!(checked >= 300, "only {checked} cases checked");
    assert!(unknown.is_empty(), "{} of {checked} renderings differ from jinja2's:\n{}", unknown.len(), unknown.join("\n"));
}

/// Templates minijinja renders differently from jinja2, and why.
const KNOWN_DIFFERENCES: &[(&str, &str)] = &[(
    "meetkai-functionary-medium-v3.1.jinja",
    "`\"...\"|safe + text` makes jinja2 HTML-escape the text added to the safe string (its output holds &#34; for every quote); minijinja adds plain text, which is what the template means",
)];

#[test]
fn tojson_writes_what_pythons_json_dumps_writes() {
    let t = ChatTemplate::new(r#"{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ [] | tojson }}"#, "", "").unwrap();
    let x = ChatMessage { tool_calls: Some(vec![serde_json::json!({ "b": "<&'>", "a": [1, 2.5, null, true], "c": {} })]), ..ChatMessage::new("user", "") };
    let template = ChatTemplate::new(&t.source().replace('x', "messages[0].tool_calls[0]"), "", "").unwrap();
    let got = template.render(&[x], false).unwrap();
    assert_eq!(got, "{\"b\": \"<&'>\", \"a\": [1, 2.5, null, true], \"c\": {}}|{\n  \"b\": \"<&'>\",\n  \"a\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"c\": {}\n}|[]");
}

/// A template is untrusted input: one that would run for ages is stopped (minijinja's fuel)
/// with a template error.
#[test]
fn a_runaway_template_is_stopped_with_an_error() {
    let t = ChatTemplate::new("{% for i in range(10000) %}{% for j in range(10000) %}x{% endfor %}{% endfor %}", "", "").unwrap();
    let started = std::time::Instant::now();
    match t.render(&[ChatMessage::new("user", "hi")], true) {
        Err(Error::Template(msg)) => assert!(msg.contains("fuel"), "{msg}"),
        other => panic!("expected a template error, got {:?}", other.map(|s| s.len())),
    }
    eprintln!("stopped after {:?}", started.elapsed());
}
