//! Tool calls: the request's functions go into the prompt and the model's reply is read back
//! into OpenAI's `tool_calls`, in the model's own format when its chat template has a tools
//! section — Hermes/Qwen `<tool_call>{...}</tool_call>`, Llama 3.1+ `{"name", "parameters"}`,
//! Mistral `[TOOL_CALLS]` — and otherwise in one generic JSON format (llama.cpp's "generic"
//! tool calling: the functions described in a system message, the reply `{"tool_calls":
//! [{"name", "arguments"}]}` or `{"response": "..."}`). A call that must be made (`tool_choice`
//! "required" or a named function) is constrained by a grammar in that format whose arguments
//! follow the function's JSON schema, so even a small model emits a valid call; with "auto" a
//! native-format model chooses freely, and a generic-format one is constrained to the two
//! reply shapes.

use duet_model::chat::ChatTemplate;
use duet_model::grammar::Grammar;
use duet_model::tokenizer::Tokenizer;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// One entry of `tools`.
#[derive(Debug, Clone, Deserialize)]
pub struct ToolSpec {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionSpec,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FunctionSpec {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The arguments' JSON schema (absent: any object).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
}

/// The most calls one reply may hold (1 with `parallel_tool_calls: false`): a bound that keeps
/// a reply within a modest max_tokens.
pub const MAX_PARALLEL_CALLS: usize = 4;

/// How a model writes tool calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolSyntax {
    /// Duet's generic JSON reply, described in a system message (any model).
    Generic,
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call
    /// (Hermes 2/3, Qwen 2.5/3, SmolLM3 and others trained on Hermes' format).
    Hermes,
    /// One `{"name": ..., "parameters": {...}}` (Llama 3.1, 3.2, 3.3).
    Llama3,
    /// `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` (Mistral v3 tokenizers: 7B v0.3, Nemo),
    /// or with `args` set, `[TOOL_CALLS]name[ARGS]{...}` per call (Mistral Small 3.2,
    /// Magistral). The markers are the Lark terms of their control tokens.
    Mistral { calls: String, args: Option<String> },
}

impl ToolSyntax {
    /// The format the model's chat template writes tool calls in (Generic when it has no
    /// tools section or an unknown one).
    pub fn of_model(template: Option<&ChatTemplate>, tokenizer: &Tokenizer) -> ToolSyntax {
        template.map_or(ToolSyntax::Generic, |t| Self::of_template(t.source(), |text| tokenizer.token_id(text)))
    }

    /// The format of a template's source; `token_id` finds a control token's id.
    fn of_template(source: &str, token_id: impl Fn(&str) -> Option<u32>) -> ToolSyntax {
        if !source.contains("tools") {
            return ToolSyntax::Generic;
        }
        // A control token as a Lark term (by id: its text would be spelt in ordinary tokens).
        let marker = |text: &str| match token_id(text) {
            Some(id) => format!("<[{id}]>"),
            None => serde_json::to_string(text).unwrap_or_default(),
        };
        if source.contains("<tool_call>") {
            ToolSyntax::Hermes
        } else if source.contains("[TOOL_CALLS]") {
            ToolSyntax::Mistral { calls: marker("[TOOL_CALLS]"), args: source.contains("[ARGS]").then(|| marker("[ARGS]")) }
        } else if source.contains("<|start_header_id|>") && source.contains("\"parameters\": ") {
            ToolSyntax::Llama3
        } else {
            ToolSyntax::Generic
        }
    }

    /// Mistral's templates refuse call ids that are not 9 letters and digits.
    fn new_call_id(&self) -> String {
        match self {
            ToolSyntax::Mistral { .. } => {
                const ALNUM: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
                (0..9).map(|_| ALNUM[rand::random_range(0..ALNUM.len())] as char).collect()
            }
            _ => format!("call_{:016x}", rand::random::<u64>()),
        }
    }
}

/// The functions a request lets the model call, whether it must call one, and the model's
/// format for calls.
#[derive(Debug, Clone)]
pub struct Tools {
    functions: Vec<FunctionSpec>,
    required: bool,
    max_calls: usize,
    syntax: ToolSyntax,
}

impl Tools {
    /// From `tools` and `tool_choice` ("none", "auto", "required" or a named function);
    /// `None` when no tool may be called.
    pub fn from_request(tools: Option<&[ToolSpec]>, choice: Option<&Value>, parallel: bool, syntax: ToolSyntax) -> Result<Option<Tools>, String> {
        // Llama 3's templates take one call per turn.
        let max_calls = if parallel && syntax != ToolSyntax::Llama3 { MAX_PARALLEL_CALLS } else { 1 };
        let tools = tools.unwrap_or_default();
        if let Some((i, t)) = tools.iter().enumerate().find(|(_, t)| t.kind != "function") {
            return Err(format!("tools[{i}].type is {:?}: only \"function\" tools are supported", t.kind));
        }
        let all = |required| Tools { functions: tools.iter().map(|t| t.function.clone()).collect(), required, max_calls, syntax: syntax.clone() };
        let mode = match choice {
            None | Some(Value::Null) => (!tools.is_empty()).then(|| all(false)),
            Some(Value::String(s)) => match s.as_str() {
                "none" => None,
                "auto" => (!tools.is_empty()).then(|| all(false)),
                "required" => Some(all(true)),
                other => return Err(format!("tool_choice {other:?}: expected \"none\", \"auto\", \"required\" or a function")),
            },
            Some(v) => {
                let name = v.pointer("/function/name").and_then(Value::as_str).ok_or("tool_choice: expected {\"type\": \"function\", \"function\": {\"name\": ...}}")?;
                let f = tools.iter().find(|t| t.function.name == name).ok_or_else(|| format!("tool_choice names {name:?}, which is not among the tools"))?;
                Some(Tools { functions: vec![f.function.clone()], required: true, max_calls, syntax: syntax.clone() })
            }
        };
        match mode {
            Some(t) if t.functions.is_empty() => Err("tool_choice \"required\" needs tools".into()),
            other => Ok(other),
        }
    }

    pub fn syntax(&self) -> &ToolSyntax {
        &self.syntax
    }

    /// The functions as the model's template takes them (`None` for the generic format,
    /// which describes them in a system message instead).
    pub fn template_tools(&self) -> Option<Vec<Value>> {
        (self.syntax != ToolSyntax::Generic).then(|| self.functions.iter().map(|f| json!({ "type": "function", "function": f })).collect())
    }

    /// One call's JSON schema: `{name_key: <a function's name>, args_key: <its arguments>}`.
    fn call_schema(&self, args_key: &str) -> Value {
        let calls: Vec<Value> = self
            .functions
            .iter()
            .map(|f| {
                json!({
                    "type": "object",
                    "properties": { "name": { "const": f.name }, args_key: f.parameters.clone().unwrap_or(json!({ "type": "object" })) },
                    "required": ["name", args_key],
                    "additionalProperties": false,
                })
            })
            .collect();
        json!({ "anyOf": calls })
    }

    /// What the reply is constrained to (`None`: the model answers freely).
    pub fn grammar(&self) -> Option<Grammar> {
        let more = self.max_calls - 1;
        match &self.syntax {
            ToolSyntax::Generic => Some(Grammar::JsonSchema(self.reply_schema().to_string())),
            _ if !self.required => None,
            ToolSyntax::Hermes => Some(Grammar::Lark(format!(
                "start: call (\"\\n\" call){{0,{more}}}\ncall: \"<tool_call>\\n\" %json {} \"\\n</tool_call>\"\n",
                self.call_schema("arguments")
            ))),
            ToolSyntax::Llama3 => Some(Grammar::JsonSchema(self.call_schema("parameters").to_string())),
            ToolSyntax::Mistral { calls, args: None } => {
                let array = json!({ "type": "array", "items": self.call_schema("arguments"), "minItems": 1, "maxItems": self.max_calls });
                Some(Grammar::Lark(format!("start: {calls} %json {array}\n")))
            }
            ToolSyntax::Mistral { calls, args: Some(args) } => {
                let one: Vec<String> = self
                    .functions
                    .iter()
                    .map(|f| {
                        let schema = f.parameters.clone().unwrap_or(json!({ "type": "object" }));
                        format!("{} {args} %json {schema}", serde_json::to_string(&f.name).unwrap_or_default())
                    })
                    .collect();
                Some(Grammar::Lark(format!("start: call{{1,{}}}\ncall: {calls} ({})\n", self.max_calls, one.join(" | "))))
            }
        }
    }

    /// The JSON schema of every generic-format reply.
    fn reply_schema(&self) -> Value {
        let call = json!({
            "type": "object",
            "properties": { "tool_calls": { "type": "array", "items": self.call_schema("arguments"), "minItems": 1, "maxItems": self.max_calls } },
            "required": ["tool_calls"],
            "additionalProperties": false,
        });
        if self.required {
            return call;
        }
        let answer = json!({
            "type": "object",
            "properties": { "response": { "type": "string" } },
            "required": ["response"],
            "additionalProperties": false,
        });
        json!({ "anyOf": [call, answer] })
    }

    /// The generic format's system message, which describes the functions and the reply
    /// format (`None` when the model's template describes them).
    pub fn system_prompt(&self) -> Option<String> {
        if self.syntax != ToolSyntax::Generic {
            return None;
        }
        let list: Vec<Value> =
            self.functions.iter().map(|f| json!({ "name": f.name, "description": f.description, "parameters": f.parameters })).collect();
        let listing = serde_json::to_string_pretty(&list).unwrap_or_default();
        let calls = r#"{"tool_calls": [{"name": <function name>, "arguments": <its arguments>}]}"#;
        Some(if self.required {
            format!("You can call these functions:\n{listing}\nReply with one JSON object that calls one or more of them: {calls}.")
        } else {
            format!(
                "You can call these functions:\n{listing}\nReply with one JSON object: {calls} to call functions, or {{\"response\": <your answer>}} to answer without calling any."
            )
        })
    }

    /// Reads the model's reply: tool calls (OpenAI's `tool_calls` entries, ids fresh,
    /// arguments as JSON text) with any text before them, or — when it calls nothing, or the
    /// calls are cut short (max_tokens) or malformed — the text as it is.
    pub fn read_reply(&self, text: &str) -> Reply {
        let calls = match &self.syntax {
            ToolSyntax::Generic => return self.read_generic(text),
            ToolSyntax::Hermes => read_hermes(text),
            ToolSyntax::Llama3 => read_llama3(text),
            ToolSyntax::Mistral { .. } => read_mistral(text),
        };
        match calls {
            Some((content, calls)) if !calls.is_empty() => Reply::Calls { content, calls: calls.into_iter().map(|(n, a)| self.openai_call(n, a)).collect() },
            _ => Reply::Text(text.to_string()),
        }
    }

    fn read_generic(&self, text: &str) -> Reply {
        let Ok(v) = serde_json::from_str::<Value>(text) else { return Reply::Text(text.to_string()) };
        if let Some(calls) = v.get("tool_calls").and_then(Value::as_array) {
            let calls = calls.iter().map(|c| self.openai_call(c["name"].clone(), c["arguments"].clone())).collect();
            return Reply::Calls { content: None, calls };
        }
        match v.get("response").and_then(Value::as_str) {
            Some(r) => Reply::Text(r.to_string()),
            None => Reply::Text(text.to_string()),
        }
    }

    fn openai_call(&self, name: Value, arguments: Value) -> Value {
        json!({ "id": self.syntax.new_call_id(), "type": "function", "function": { "name": name, "arguments": arguments.to_string() } })
    }
}

/// A call read from the model's text: its name and arguments (JSON).
type Call = (Value, Value);

/// `{"name": ..., <args_key>: ...}` with a string name, else `None`.
fn call_object(v: &Value, args_keys: &[&str]) -> Option<Call> {
    let name = v.get("name").filter(|n| n.is_string())?.clone();
    let args = args_keys.iter().find_map(|k| v.get(*k)).cloned().unwrap_or(json!({}));
    Some((name, args))
}

/// The text before the calls, `None` when it is only white space.
fn leading_text(text: &str) -> Option<String> {
    let t = text.trim();
    (!t.is_empty()).then(|| t.to_string())
}

fn read_hermes(text: &str) -> Option<(Option<String>, Vec<Call>)> {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let first = text.find(OPEN)?;
    let mut calls = Vec::new();
    for block in text[first..].split(OPEN).skip(1) {
        let body = block.split(CLOSE).next().unwrap_or(block);
        calls.push(call_object(&serde_json::from_str(body.trim()).ok()?, &["arguments", "parameters"])?);
    }
    Some((leading_text(&text[..first]), calls))
}

fn read_llama3(text: &str) -> Option<(Option<String>, Vec<Call>)> {
    let t = text.trim_start();
    let t = t.strip_prefix("<|python_tag|>").unwrap_or(t);
    let v: Value = serde_json::from_str(t.trim()).ok()?;
    Some((None, vec![call_object(&v, &["parameters", "arguments"])?]))
}

fn read_mistral(text: &str) -> Option<(Option<String>, Vec<Call>)> {
    const CALLS: &str = "[TOOL_CALLS]";
    const ARGS: &str = "[ARGS]";
    let first = text.find(CALLS)?;
    let after = text[first + CALLS.len()..].trim_start();
    let calls = if after.starts_with('[') {
        // v3: one JSON array.
        let list: Vec<Value> = serde_json::from_str(after.trim()).ok()?;
        list.iter().map(|c| call_object(c, &["arguments"])).collect::<Option<Vec<_>>>()?
    } else {
        // v11: name[ARGS]{...}, each call opened by [TOOL_CALLS].
        let mut calls = Vec::new();
        for part in text[first..].split(CALLS).skip(1) {
            let (name, args) = part.split_once(ARGS)?;
            let name = name.split("[CALL_ID]").next().unwrap_or(name).trim();
            calls.push((json!(name), serde_json::from_str(args.trim()).ok()?));
        }
        calls
    };
    Some((leading_text(&text[..first]), calls))
}

/// The model's reply, read back.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// OpenAI `tool_calls` entries, and any text the model wrote before them.
    Calls { content: Option<String>, calls: Vec<Value> },
    Text(String),
}

/// An earlier assistant turn's OpenAI `tool_calls` (arguments as JSON text), as the model's
/// template takes them: arguments as JSON (text that is not JSON stays text).
pub fn calls_for_template(calls: &[Value]) -> Vec<Value> {
    calls
        .iter()
        .map(|c| {
            let mut c = c.clone();
            if let Some(args) = c.pointer_mut("/function/arguments") {
                if let Some(parsed) = args.as_str().and_then(|s| serde_json::from_str::<Value>(s).ok()) {
                    *args = parsed;
                }
            }
            c
        })
        .collect()
}

/// An earlier assistant turn's `tool_calls`, as the generic format writes them.
pub fn calls_as_text(calls: &[Value]) -> String {
    let calls: Vec<Value> = calls_for_template(calls)
        .iter()
        .map(|c| json!({ "name": c.pointer("/function/name").cloned().unwrap_or(Value::Null), "arguments": c.pointer("/function/arguments").cloned().unwrap_or(Value::Null) }))
        .collect();
    json!({ "tool_calls": calls }).to_string()
}

/// A tool's result, as the generic format shows it to the model.
pub fn result_as_text(tool_call_id: Option<&str>, content: &str) -> String {
    json!({ "tool_result": { "tool_call_id": tool_call_id, "content": content } }).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> ToolSpec {
        serde_json::from_value(json!({ "type": "function", "function": { "name": "get_weather", "parameters": {
            "type": "object", "properties": { "city": { "type": "string" } }, "required": ["city"] } } }))
        .unwrap()
    }

    fn tools(choice: Value, syntax: ToolSyntax) -> Tools {
        Tools::from_request(Some(&[weather()]), Some(&choice), true, syntax).unwrap().unwrap()
    }

    fn template(file: &str) -> String {
        std::fs::read_to_string(format!("{}/../testdata/templates/{file}", env!("CARGO_MANIFEST_DIR"))).unwrap()
    }

    #[test]
    fn tool_choice_decides_the_reply_schema() {
        let tools = [weather()];
        let generic = || ToolSyntax::Generic;
        assert!(Tools::from_request(Some(&tools), Some(&json!("none")), true, generic()).unwrap().is_none());
        assert!(Tools::from_request(None, None, true, generic()).unwrap().is_none());
        let auto = Tools::from_request(Some(&tools), None, true, generic()).unwrap().unwrap();
        assert!(auto.reply_schema()["anyOf"].as_array().is_some_and(|a| a.len() == 2));
        let required = Tools::from_request(Some(&tools), Some(&json!("required")), false, generic()).unwrap().unwrap();
        assert_eq!(required.reply_schema()["required"], json!(["tool_calls"]));
        assert_eq!(required.reply_schema()["properties"]["tool_calls"]["maxItems"], json!(1));
        let named = Tools::from_request(Some(&tools), Some(&json!({ "type": "function", "function": { "name": "get_weather" } })), true, generic()).unwrap().unwrap();
        assert!(named.required);
        assert!(Tools::from_request(Some(&tools), Some(&json!({ "type": "function", "function": { "name": "nope" } })), true, generic()).is_err());
        assert!(Tools::from_request(None, Some(&json!("required")), true, generic()).is_err());
        assert!(Tools::from_request(Some(&tools), Some(&json!("sometimes")), true, generic()).is_err());
    }

    #[test]
    fn generic_replies_read_back_as_calls_or_text() {
        let t = tools(json!("auto"), ToolSyntax::Generic);
        match t.read_reply(r#"{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}"#) {
            Reply::Calls { content: None, calls } => {
                assert_eq!(calls[0]["function"]["name"], "get_weather");
                assert_eq!(serde_json::from_str::<Value>(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap(), json!({ "city": "Paris" }));
                assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(t.read_reply(r#"{"response": "Hi"}"#), Reply::Text("Hi".into()));
        assert_eq!(t.read_reply(r#"{"tool_calls": [{"na"#), Reply::Text(r#"{"tool_calls": [{"na"#.into()));
        let past = json!([{ "id": "c1", "type": "function", "function": { "name": "f", "arguments": "{\"x\": 1}" } }]);
        let text: Value = serde_json::from_str(&calls_as_text(past.as_array().unwrap())).unwrap();
        assert_eq!(text, json!({ "tool_calls": [{ "name": "f", "arguments": { "x": 1 } }] }));
        assert!(t.system_prompt().is_some() && t.template_tools().is_none());
    }

    #[test]
    fn real_templates_name_their_format() {
        let ids = |text: &str| match text {
            "[TOOL_CALLS]" => Some(5),
            "[ARGS]" => Some(32),
            _ => None,
        };
        let of = |file: &str| ToolSyntax::of_template(&template(file), ids);
        assert_eq!(of("Qwen-Qwen2.5-7B-Instruct.jinja"), ToolSyntax::Hermes);
        assert_eq!(of("Qwen-Qwen3-0.6B.jinja"), ToolSyntax::Hermes);
        assert_eq!(of("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja"), ToolSyntax::Hermes);
        assert_eq!(of("meta-llama-Llama-3.1-8B-Instruct.jinja"), ToolSyntax::Llama3);
        assert_eq!(of("meta-llama-Llama-3.2-3B-Instruct.jinja"), ToolSyntax::Llama3);
        assert_eq!(of("mistralai-Mistral-Nemo-Instruct-2407.jinja"), ToolSyntax::Mistral { calls: "<[5]>".into(), args: None });
        assert_eq!(of("Mistral-Small-3.2-24B-Instruct-2506.jinja"), ToolSyntax::Mistral { calls: "<[5]>".into(), args: Some("<[32]>".into()) });
        assert_eq!(of("google-gemma-2-2b-it.jinja"), ToolSyntax::Generic);
        assert_eq!(of("microsoft-Phi-3.5-mini-instruct.jinja"), ToolSyntax::Generic);
        let no_ids = ToolSyntax::of_template(&template("mistralai-Mistral-Nemo-Instruct-2407.jinja"), |_| None);
        assert_eq!(no_ids, ToolSyntax::Mistral { calls: "\"[TOOL_CALLS]\"".into(), args: None });
    }

    #[test]
    fn native_replies_read_back_as_calls_with_the_text_before_them() {
        let hermes = tools(json!("auto"), ToolSyntax::Hermes);
        let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>";
        match hermes.read_reply(text) {
            Reply::Calls { content, calls } => {
                assert_eq!(content.as_deref(), Some("Let me look."));
                assert_eq!(calls.len(), 2);
                assert_eq!(calls[1]["function"]["arguments"], json!("{\"city\":\"Rome\"}"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(hermes.read_reply("Sunny."), Reply::Text("Sunny.".into()));
        // Cut short: the text as it is.
        assert_eq!(hermes.read_reply("<tool_call>\n{\"name\": \"get_w"), Reply::Text("<tool_call>\n{\"name\": \"get_w".into()));

        let llama = tools(json!("auto"), ToolSyntax::Llama3);
        assert!(matches!(llama.read_reply("<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}"), Reply::Calls { calls, .. } if calls.len() == 1));
        assert_eq!(llama.read_reply("It is sunny."), Reply::Text("It is sunny.".into()));
        assert_eq!(llama.max_calls, 1, "Llama 3 takes one call per turn");

        let nemo = tools(json!("auto"), ToolSyntax::Mistral { calls: "<[5]>".into(), args: None });
        match nemo.read_reply("[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Bern\"}}]") {
            Reply::Calls { content: None, calls } => {
                let id = calls[0]["id"].as_str().unwrap();
                assert!(id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric()), "Mistral needs 9-character ids: {id}");
            }
            other => panic!("{other:?}"),
        }
        let small = tools(json!("auto"), ToolSyntax::Mistral { calls: "<[5]>".into(), args: Some("<[32]>".into()) });
        match small.read_reply("[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Bern\"}[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Chur\"}") {
            Reply::Calls { calls, .. } => assert_eq!(calls[1]["function"]["arguments"], json!("{\"city\":\"Chur\"}")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn native_calls_are_constrained_only_when_required() {
        assert_eq!(tools(json!("auto"), ToolSyntax::Hermes).grammar(), None);
        match tools(json!("required"), ToolSyntax::Hermes).grammar() {
            Some(Grammar::Lark(g)) => assert!(g.contains("\"<tool_call>\\n\" %json {") && g.contains("{0,3}"), "{g}"),
            other => panic!("{other:?}"),
        }
        match tools(json!("required"), ToolSyntax::Llama3).grammar() {
            Some(Grammar::JsonSchema(s)) => assert!(s.contains("\"parameters\"")),
            other => panic!("{other:?}"),
        }
        match tools(json!("required"), ToolSyntax::Mistral { calls: "<[5]>".into(), args: Some("<[32]>".into()) }).grammar() {
            Some(Grammar::Lark(g)) => assert!(g.contains("call: <[5]> (\"get_weather\" <[32]> %json {"), "{g}"),
            other => panic!("{other:?}"),
        }
        let hermes = tools(json!("required"), ToolSyntax::Hermes);
        assert!(hermes.system_prompt().is_none());
        assert_eq!(hermes.template_tools().unwrap()[0]["function"]["name"], "get_weather");
    }
}
