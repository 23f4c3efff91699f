//! Tool calls for any model, in one JSON format (llama.cpp's "generic" tool calling): the
//! request's tools are described in a system message, and the reply is constrained (a
//! structured-output grammar) to one JSON object — `{"tool_calls": [{"name", "arguments"}]}`
//! with each call's arguments valid under its function's schema, or, when the model may also
//! answer (`tool_choice` "auto"), `{"response": "..."}` — which is read back into OpenAI's
//! `tool_calls` or text. Earlier turns' calls and tool results go back into the conversation
//! in the same JSON, so the model sees its own format.

use serde::Deserialize;
use serde_json::{json, Value};

/// One entry of `tools`.
#[derive(Debug, Clone, Deserialize)]
pub struct ToolSpec {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionSpec,
}

#[derive(Debug, Clone, Deserialize)]
pub struct FunctionSpec {
    pub name: String,
    pub description: Option<String>,
    /// The arguments' JSON schema (absent: any object).
    pub parameters: Option<Value>,
}

/// The most calls one reply may hold (1 with `parallel_tool_calls: false`): a bound that keeps
/// a reply within a modest max_tokens.
pub const MAX_PARALLEL_CALLS: usize = 4;

/// The functions a request lets the model call, and whether it must call one.
#[derive(Debug, Clone)]
pub struct Tools {
    functions: Vec<FunctionSpec>,
    required: bool,
    max_calls: usize,
}

impl Tools {
    /// From `tools` and `tool_choice` ("none", "auto", "required" or a named function);
    /// `None` when no tool may be called.
    pub fn from_request(tools: Option<&[ToolSpec]>, choice: Option<&Value>, parallel: bool) -> Result<Option<Tools>, String> {
        let max_calls = if parallel { MAX_PARALLEL_CALLS } else { 1 };
        let tools = tools.unwrap_or_default();
        if let Some((i, t)) = tools.iter().enumerate().find(|(_, t)| t.kind != "function") {
            return Err(format!("tools[{i}].type is {:?}: only \"function\" tools are supported", t.kind));
        }
        let all = |required| Tools { functions: tools.iter().map(|t| t.function.clone()).collect(), required, max_calls };
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
                Some(Tools { functions: vec![f.function.clone()], required: true, max_calls })
            }
        };
        match mode {
            Some(t) if t.functions.is_empty() => Err("tool_choice \"required\" needs tools".into()),
            other => Ok(other),
        }
    }

    /// The JSON schema of every reply the model may give.
    pub fn reply_schema(&self) -> Value {
        let calls: Vec<Value> = self
            .functions
            .iter()
            .map(|f| {
                json!({
                    "type": "object",
                    "properties": { "name": { "const": f.name }, "arguments": f.parameters.clone().unwrap_or(json!({ "type": "object" })) },
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let call = json!({
            "type": "object",
            "properties": { "tool_calls": { "type": "array", "items": { "anyOf": calls }, "minItems": 1, "maxItems": self.max_calls } },
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

    /// The system message that describes the functions and the reply format.
    pub fn system_prompt(&self) -> String {
        let list: Vec<Value> =
            self.functions.iter().map(|f| json!({ "name": f.name, "description": f.description, "parameters": f.parameters })).collect();
        let listing = serde_json::to_string_pretty(&list).unwrap_or_default();
        let calls = r#"{"tool_calls": [{"name": <function name>, "arguments": <its arguments>}]}"#;
        if self.required {
            format!("You can call these functions:\n{listing}\nReply with one JSON object that calls one or more of them: {calls}.")
        } else {
            format!(
                "You can call these functions:\n{listing}\nReply with one JSON object: {calls} to call functions, or {{\"response\": <your answer>}} to answer without calling any."
            )
        }
    }
}

/// The model's reply, read back.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// OpenAI `tool_calls` entries (ids fresh, arguments as JSON text).
    Calls(Vec<Value>),
    Text(String),
}

/// Reads the constrained reply `text`: tool calls, the response's text, or — if the reply was
/// cut short (max_tokens) and is not whole JSON — the text as it is.
pub fn read_reply(text: &str) -> Reply {
    let Ok(v) = serde_json::from_str::<Value>(text) else { return Reply::Text(text.to_string()) };
    if let Some(calls) = v.get("tool_calls").and_then(Value::as_array) {
        let calls = calls
            .iter()
            .map(|c| {
                let id = format!("call_{:016x}", rand::random::<u64>());
                json!({ "id": id, "type": "function", "function": { "name": c["name"], "arguments": c["arguments"].to_string() } })
            })
            .collect();
        return Reply::Calls(calls);
    }
    match v.get("response").and_then(Value::as_str) {
        Some(r) => Reply::Text(r.to_string()),
        None => Reply::Text(text.to_string()),
    }
}

/// An earlier assistant turn's `tool_calls`, as the model writes them.
pub fn calls_as_text(calls: &[Value]) -> String {
    let calls: Vec<Value> = calls
        .iter()
        .map(|c| {
            let args = c.pointer("/function/arguments").cloned().unwrap_or(Value::Null);
            // OpenAI sends arguments as JSON text; the model wrote them as JSON.
            let args = args.as_str().and_then(|s| serde_json::from_str(s).ok()).unwrap_or(args);
            json!({ "name": c.pointer("/function/name").cloned().unwrap_or(Value::Null), "arguments": args })
        })
        .collect();
    json!({ "tool_calls": calls }).to_string()
}

/// A tool's result, as the conversation shows it to the model.
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

    #[test]
    fn tool_choice_decides_the_reply_schema() {
        let tools = [weather()];
        assert!(Tools::from_request(Some(&tools), Some(&json!("none")), true).unwrap().is_none());
        assert!(Tools::from_request(None, None, true).unwrap().is_none());
        let auto = Tools::from_request(Some(&tools), None, true).unwrap().unwrap();
        assert!(auto.reply_schema()["anyOf"].as_array().is_some_and(|a| a.len() == 2));
        let required = Tools::from_request(Some(&tools), Some(&json!("required")), false).unwrap().unwrap();
        assert_eq!(required.reply_schema()["required"], json!(["tool_calls"]));
        assert_eq!(required.reply_schema()["properties"]["tool_calls"]["maxItems"], json!(1));
        let named = Tools::from_request(Some(&tools), Some(&json!({ "type": "function", "function": { "name": "get_weather" } })), true).unwrap().unwrap();
        assert!(named.required);
        assert!(Tools::from_request(Some(&tools), Some(&json!({ "type": "function", "function": { "name": "nope" } })), true).is_err());
        assert!(Tools::from_request(None, Some(&json!("required")), true).is_err());
        assert!(Tools::from_request(Some(&tools), Some(&json!("sometimes")), true).is_err());
    }

    #[test]
    fn replies_read_back_as_calls_or_text() {
        match read_reply(r#"{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}"#) {
            Reply::Calls(c) => {
                assert_eq!(c[0]["function"]["name"], "get_weather");
                assert_eq!(serde_json::from_str::<Value>(c[0]["function"]["arguments"].as_str().unwrap()).unwrap(), json!({ "city": "Paris" }));
                assert!(c[0]["id"].as_str().unwrap().starts_with("call_"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(read_reply(r#"{"response": "Hi"}"#), Reply::Text("Hi".into()));
        assert_eq!(read_reply(r#"{"tool_calls": [{"na"#), Reply::Text(r#"{"tool_calls": [{"na"#.into()));
        let past = json!([{ "id": "c1", "type": "function", "function": { "name": "f", "arguments": "{\"x\": 1}" } }]);
        let text: Value = serde_json::from_str(&calls_as_text(past.as_array().unwrap())).unwrap();
        assert_eq!(text, json!({ "tool_calls": [{ "name": "f", "arguments": { "x": 1 } }] }));
    }
}
