//! Chat templates: the model's own `tokenizer.chat_template` (Jinja) rendered with minijinja
//! as Hugging Face's `apply_chat_template` renders them: trim_blocks and lstrip_blocks,
//! Python-compatible string and dict methods, Python's `json.dumps` for `tojson`,
//! `raise_exception` and `strftime_now`; tools and tool calls passed as Hugging Face passes them.

use minijinja::{context, Environment, ErrorKind};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use super::gguf::{GgufFile, Value};
use super::names::GeneralKey;
use crate::error::{Error, Result};

/// One message of a conversation. Absent fields are absent in the template too
/// (`'tool_calls' in message` is false), as in Hugging Face's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's calls: `[{"id", "type": "function", "function": {"name",
    /// "arguments": <object>}}]` (arguments as JSON, not text, as templates expect).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Json>>,
    /// A tool result's call id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into(), tool_calls: None, tool_call_id: None }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

const TEMPLATE_NAME: &str = "chat";

/// The most instructions one rendering may run (minijinja's fuel).
const TEMPLATE_FUEL: u64 = 20_000_000;

impl ChatTemplate {
    /// Compiles `source`; `bos_token` / `eos_token` are the strings templates may reference.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        // Hugging Face's environment: ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).
        let syntax = minijinja::syntax::SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build();
        env.set_syntax(syntax.map_err(|e| Error::Template(e.to_string()))?);
        // A template is untrusted input (it comes with the model file): a bound on the work
        // one rendering may do, far above what real templates need for long conversations.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |format: String| strftime_now(&format));
        env.add_filter("tojson", python_tojson);
        // As in jinja2: None is not iterable (minijinja's test says it is); undefined is (empty).
        env.add_test("iterable", |v: minijinja::Value| !v.is_none() && v.try_iter().is_ok());
        // Templates are text, not HTML: never escape.
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.add_template_owned(TEMPLATE_NAME, source.to_string()).map_err(|e| Error::Template(e.to_string()))?;
        Ok(ChatTemplate { env, source: source.to_string(), bos_token: bos_token.into(), eos_token: eos_token.into() })
    }

    /// The template stored in a GGUF file, with its BOS/EOS token strings.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let source = g
            .get(GeneralKey::ChatTemplate.key())
            .and_then(Value::as_str)
            .ok_or_else(|| Error::Template(format!("the model has no {}", GeneralKey::ChatTemplate.key())))?;
        Self::with_gguf_tokens(source, g)
    }

    /// Compiles `source` with the BOS/EOS token strings of the model in `g`.
    pub fn with_gguf_tokens(source: &str, g: &GgufFile) -> Result<Self> {
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

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation; `add_generation_prompt` opens the assistant's turn.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// Renders a conversation with the functions the model may call (`tools`: OpenAI's list,
    /// `[{"type": "function", "function": {...}}]`; `none` in the template when `None`, as
    /// Hugging Face passes it).
    pub fn render_with_tools(&self, messages: &[ChatMessage], tools: Option<&[Json]>, add_generation_prompt: bool) -> Result<String> {
        if messages.is_empty() {
            return Err(Error::Template("a chat needs at least one message".into()));
        }
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(|e| Error::Template(e.to_string()))?;
        tmpl.render(context! {
            messages => minijinja::value::Serde(messages),
            tools => minijinja::value::Serde(tools),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        })
        .map_err(|e| Error::Template(e.to_string()))
    }
}

/// The `tojson` filter of Hugging Face's environment: Python's `json.dumps(x, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)`, those four overridable — `", "` and `": "`
/// between items by default (`","` and `": "` with an indent), keys in their order, no HTML
/// escaping (minijinja's own filter escapes `<`, `>`, `&`, `'`).
fn python_tojson(value: minijinja::Value, kwargs: minijinja::value::Kwargs) -> std::result::Result<String, minijinja::Error> {
    let bad = |what: String| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {what}"));
    let indent: Option<usize> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let style = JsonStyle {
        indent,
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        separators: match separators.as_deref() {
            None => (if indent.is_some() { "," } else { ", " }.to_string(), ": ".to_string()),
            Some([item, key]) => (item.clone(), key.clone()),
            Some(other) => return Err(bad(format!("separators must be two strings, got {}", other.len()))),
        },
    };
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value).map_err(|e| bad(e.to_string()))?;
    let mut out = String::new();
    style.write(&json, 0, &mut out);
    Ok(out)
}

/// How Python's `json.dumps` was asked to write.
struct JsonStyle {
    indent: Option<usize>,
    ensure_ascii: bool,
    sort_keys: bool,
    /// Between items, and between a key and its value.
    separators: (String, String),
}

impl JsonStyle {
    fn write(&self, v: &Json, depth: usize, out: &mut String) {
        let newline = |out: &mut String, depth: usize| {
            if let Some(n) = self.indent {
                out.push('\n');
                out.extend(std::iter::repeat_n(' ', n * depth));
            }
        };
        match v {
            Json::Array(items) if !items.is_empty() => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.separators.0);
                    }
                    newline(out, depth + 1);
                    self.write(item, depth + 1, out);
                }
                newline(out, depth);
                out.push(']');
            }
            Json::Object(map) if !map.is_empty() => {
                let mut entries: Vec<(&String, &Json)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, item)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.separators.0);
                    }
                    newline(out, depth + 1);
                    self.write_string(k, out);
                    out.push_str(&self.separators.1);
                    self.write(item, depth + 1, out);
                }
                newline(out, depth);
                out.push('}');
            }
            Json::String(s) => self.write_string(s, out),
            // Numbers, booleans, null, [] and {} print alike in both.
            other => out.push_str(&other.to_string()),
        }
    }

    /// A string as Python escapes it: quotes, backslashes and control characters, and with
    /// `ensure_ascii` every non-ASCII character as `\uXXXX` (UTF-16 surrogate pairs above U+FFFF).
    fn write_string(&self, s: &str, out: &mut String) {
        let escaped = Json::String(s.to_string()).to_string();
        if !self.ensure_ascii {
            out.push_str(&escaped);
            return;
        }
        for c in escaped.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
    }
}

/// `strftime_now(format)`: the local time now, formatted by the C library's `strftime`, as
/// Python's `datetime.now().strftime` does.
fn strftime_now(format: &str) -> std::result::Result<String, minijinja::Error> {
    let bad = |what: &str| minijinja::Error::new(ErrorKind::InvalidOperation, format!("strftime_now({format:?}): {what}"));
    let c_format = std::ffi::CString::new(format).map_err(|_| bad("the format holds a NUL"))?;
    // SAFETY: time(NULL) and localtime_r write only into `tm`, which outlives the calls;
    // strftime writes at most buf.len() bytes into buf and returns how many it wrote.
    unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&now, &mut tm).is_null() {
            return Err(bad("no local time"));
        }
        let mut buf = vec![0u8; 256 + 8 * format.len()];
        let n = libc::strftime(buf.as_mut_ptr().cast(), buf.len(), c_format.as_ptr(), &tm);
        if n == 0 && !format.is_empty() {
            return Err(bad("the formatted time is too long or empty"));
        }
        buf.truncate(n);
        String::from_utf8(buf).map_err(|_| bad("the formatted time is not UTF-8"))
    }
}
