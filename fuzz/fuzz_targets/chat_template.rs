//! Fuzz target: a chat template (the GGUF's `tokenizer.chat_template` is untrusted input) and a
//! conversation, both from the fuzzer: the bytes up to the first NUL are the template source,
//! the rest a JSON list of messages (and tools); compiling and rendering must return a result
//! or a template error, within the renderer's fuel, never panic.

#![no_main]

use duet_model::chat::{ChatMessage, ChatTemplate};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (source, rest) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Ok(source) = std::str::from_utf8(source) else { return };
    let Ok(template) = ChatTemplate::new(source, "<s>", "</s>") else { return };
    let (messages, tools): (Vec<ChatMessage>, Option<Vec<serde_json::Value>>) = match serde_json::from_slice::<serde_json::Value>(rest) {
        Ok(v) => (
            serde_json::from_value(v.get("messages").cloned().unwrap_or(v.clone())).unwrap_or_else(|_| vec![ChatMessage::new("user", "hi")]),
            v.get("tools").and_then(|t| serde_json::from_value(t.clone()).ok()),
        ),
        Err(_) => (vec![ChatMessage::new("user", String::from_utf8_lossy(rest))], None),
    };
    let _ = template.render_with_tools(&messages, tools.as_deref(), true);
});
