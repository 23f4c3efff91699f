//! The GGUF's chat template, rendered by `ChatTemplate`, against the chat prompts in
//! `testdata/golden/greedy.json` (text and token ids), plus the template's error cases.

use duet_model::chat::{ChatMessage, ChatTemplate};
use duet_model::gguf::GgufFile;
use duet_model::tokenizer::Tokenizer;
use duet_model::testutil::{golden, model_path};
use duet_model::Error;
use serde_json::Value;

/// The BOS string of this model, which llama-server strips from the front of a rendered template.
const BOS_TEXT: &str = "<|im_start|>";
const BOS_ID: u32 = 1;
const DEFAULT_SYSTEM: &str = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";

fn golden_data() -> Value {
    serde_json::from_str(&std::fs::read_to_string(golden("greedy.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn messages(item: &Value) -> Vec<ChatMessage> {
    item["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect()
}

fn model() -> (ChatTemplate, Tokenizer) {
    let g = GgufFile::open(model_path()).unwrap();
    (ChatTemplate::from_gguf(&g).unwrap(), Tokenizer::from_gguf(&g).unwrap())
}

fn template_err(r: duet_model::Result<impl std::fmt::Debug>) -> String {
    match r {
        Err(Error::Template(msg)) => msg,
        other => panic!("expected Error::Template, got {other:?}"),
    }
}

#[test]
fn every_golden_chat_prompt_renders_and_tokenizes_exactly() {
    let (template, tk) = model();
    let data = golden_data();
    let items: Vec<&Value> =
        data["items"].as_array().unwrap().iter().filter(|it| matches!(it["kind"].as_str(), Some("chat" | "chat_long"))).collect();
    assert!(items.len() >= 7, "expected the 6 chat items and the long one, found {}", items.len());
    let mut failures = Vec::new();
    for item in &items {
        let name = item["name"].as_str().unwrap();
        let rendered = template.render(&messages(item), true).unwrap();
        let want = item["prompt"].as_str().unwrap();
        if rendered != want {
            let at = rendered.bytes().zip(want.bytes()).take_while(|(a, b)| a == b).count();
            failures.push(format!("{name}: rendering differs from byte {at}: got {:?}, want {:?}", &rendered[at..], &want[at..]));
            continue;
        }
        let got = tk.encode(&rendered, true).unwrap();
        if got != ids(&item["prompt_ids"]) {
            failures.push(format!("{name}: prompt ids differ: got {got:?}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The `*__llamacpp_jinja` items are the same conversations as llama-server fed them to the
/// model: it renders the same template, then strips a leading BOS *string* from the result
/// (common/chat.cpp), and this GGUF declares `<|im_start|>` (id 1) as BOS while
/// `add_bos_token` is false — so the text lacks its leading `<|im_start|>` and the ids are
/// the correct chat prompt's ids without the first token. Duet renders the correct form.
#[test]
fn llamacpp_jinja_items_are_the_chat_prompts_without_their_leading_bos() {
    let data = golden_data();
    let items = data["items"].as_array().unwrap();
    let jinja: Vec<&Value> = items.iter().filter(|it| it["name"].as_str().unwrap().ends_with("__llamacpp_jinja")).collect();
    assert!(!jinja.is_empty());
    for j in jinja {
        let name = j["name"].as_str().unwrap();
        assert_eq!(j["kind"], "chat_llamacpp_jinja", "{name}");
        let base = name.strip_suffix("__llamacpp_jinja").unwrap();
        let chat = items.iter().find(|it| it["name"] == base).unwrap_or_else(|| panic!("{name}: no chat item named {base}"));
        assert_eq!(chat["kind"], "chat", "{base}");
        assert_eq!(chat["messages"], j["messages"], "{name}: not the same conversation");
        let (chat_ids, jinja_ids) = (ids(&chat["prompt_ids"]), ids(&j["prompt_ids"]));
        assert_eq!(chat_ids[0], BOS_ID, "{base}");
        assert_eq!(&chat_ids[1..], &jinja_ids[..], "{name}: ids are not {base}'s without the first");
        let chat_text = chat["prompt"].as_str().unwrap();
        assert_eq!(chat_text.strip_prefix(BOS_TEXT), j["prompt"].as_str(), "{name}: text is not {base}'s without {BOS_TEXT}");
    }
}

#[test]
fn the_gguf_holds_the_template_the_golden_data_was_rendered_with() {
    let g = GgufFile::open(model_path()).unwrap();
    let source = g.get("tokenizer.chat_template").and_then(|v| v.as_str()).unwrap();
    assert_eq!(source, golden_data()["chat_template"].as_str().unwrap());
}

#[test]
fn default_system_prompt_only_when_the_first_message_is_not_system() {
    let (template, _) = model();
    let user = template.render(&[ChatMessage::new("user", "Hi")], true).unwrap();
    assert_eq!(user, format!("{DEFAULT_SYSTEM}<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"));

    let system = template.render(&[ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi")], false).unwrap();
    assert_eq!(system, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
    assert!(!system.contains("SmolLM"));

    // A system message later in the conversation does not suppress the default one.
    let later = template.render(&[ChatMessage::new("user", "Hi"), ChatMessage::new("system", "Be brief.")], false).unwrap();
    assert!(later.starts_with(DEFAULT_SYSTEM), "{later:?}");
    assert_eq!(later.matches("<|im_start|>system").count(), 2);
}

#[test]
fn an_empty_conversation_is_a_template_error() {
    let (template, _) = model();
    let msg = template_err(template.render(&[], true));
    assert!(msg.contains("at least one message"), "{msg}");
}

#[test]
fn raise_exception_in_a_template_is_a_template_error_with_its_message() {
    let source = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('Conversations must start with a system message') }}{% endif %}ok";
    let template = ChatTemplate::new(source, "<s>", "</s>").unwrap();
    let msg = template_err(template.render(&[ChatMessage::new("user", "Hi")], true));
    assert!(msg.contains("Conversations must start with a system message"), "{msg}");
    assert_eq!(template.render(&[ChatMessage::new("system", "S")], true).unwrap(), "ok");
}

#[test]
fn a_broken_template_is_a_template_error_at_construction() {
    for source in ["{% for m in messages %}{{ m.content }}", "{{ messages[0]['content' }}", "{% if %}x{% endif %}"] {
        let msg = template_err(ChatTemplate::new(source, "<s>", "</s>"));
        assert!(!msg.is_empty(), "{source}");
    }
}
