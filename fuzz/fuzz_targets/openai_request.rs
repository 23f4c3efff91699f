//! Fuzz target: arbitrary bytes as the body of `POST /v1/chat/completions` and
//! `/v1/completions`, parsed into the OpenAI wire types and turned into generation parameters
//! (messages, tools in the model's own format, response formats, stop strings, sampling) with a
//! real tokenizer and chat template (testdata/tiny/arch/qwen2_q4_1.gguf with Qwen 2.5's
//! template, which has a tools section); the chat is then rendered and tokenised, as the server
//! does. Every path must answer Ok or a GatewayError, never panic.

#![no_main]

use std::sync::OnceLock;

use duet_gateway::api::openai::{ChatRequest, CompletionRequest};
use duet_gateway::backend::TextModel;
use libfuzzer_sys::fuzz_target;

fn text_model() -> &'static TextModel {
    static MODEL: OnceLock<TextModel> = OnceLock::new();
    MODEL.get_or_init(|| {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        duet_gateway::serve::load_text_model(
            &root.join("testdata/tiny/arch/qwen2_q4_1.gguf"),
            Some(&root.join("testdata/templates/Qwen-Qwen2.5-7B-Instruct.jinja")),
        )
        .expect("the fuzz model loads")
    })
}

fuzz_target!(|data: &[u8]| {
    let text = text_model();
    if let Ok(req) = serde_json::from_slice::<ChatRequest>(data) {
        if let Ok(params) = req.params(text) {
            let _ = params.validate();
            let _ = text.prompt_ids(&params.prompt);
        }
        let _ = req.tools(text);
    }
    if let Ok(req) = serde_json::from_slice::<CompletionRequest>(data) {
        if let Ok(params) = req.params() {
            let _ = params.validate();
            let _ = text.prompt_ids(&params.prompt);
        }
    }
});
