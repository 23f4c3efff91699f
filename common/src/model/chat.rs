//! Chat templates: the model's own `tokenizer.chat_template` (Jinja) rendered with minijinja,
//! with Python-compatible string and dict methods as Hugging Face templates expect.

use minijinja::{context, Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use super::gguf::{GgufFile, Value};
use super::names::GeneralKey;
use crate::error::{Error, Result};

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

const TEMPLATE_NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source`; `bos_token` / `eos_token` are the strings templates may reference.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        // Templates are text, not HTML: never escape.
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.add_template_owned(TEMPLATE_NAME, source.to_string()).map_err(|e| Error::Template(e.to_string()))?;
        Ok(ChatTemplate { env, bos_token: bos_token.into(), eos_token: eos_token.into() })
    }

    /// The template stored in a GGUF file, with its BOS/EOS token strings.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let source = g
            .get(GeneralKey::ChatTemplate.key())
            .and_then(Value::as_str)
            .ok_or_else(|| Error::Template(format!("the model has no {}", GeneralKey::ChatTemplate.key())))?;
        let tokens = g.get(GeneralKey::TokenizerTokens.key()).and_then(Value::as_array);
        let token_text = |key: GeneralKey| {
            let id = g.get(key.key()).and_then(Value::as_u64)?;
            tokens?.get(id as usize)?.as_str().map(str::to_owned)
        };
        Self::new(
            source,
            &token_text(GeneralKey::TokenizerBos).unwrap_or_default(),
            &token_text(GeneralKey::TokenizerEos).unwrap_or_default(),
        )
    }

    /// Renders a conversation; `add_generation_prompt` opens the assistant's turn.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        if messages.is_empty() {
            return Err(Error::Template("a chat needs at least one message".into()));
        }
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(|e| Error::Template(e.to_string()))?;
        tmpl.render(context! {
            messages => minijinja::value::Serde(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        })
        .map_err(|e| Error::Template(e.to_string()))
    }
}
