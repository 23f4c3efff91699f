//! Structured output: grammars — a JSON schema, any JSON object, a regular expression or a
//! Lark grammar — compiled by llguidance against a model's vocabulary, and per generation a
//! matcher that gives the tokens allowed next (a mask applied to the logits before sampling)
//! and follows the tokens sampled. The gateway compiles a request's grammar once to refuse a
//! bad one before it runs; the gpu-worker matches it while sampling.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

use super::tokenizer::Tokenizer;
use duet_proto::pb;

/// What a generation's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// A JSON value valid under this JSON schema (the schema as JSON text).
    JsonSchema(String),
    /// Any JSON object.
    JsonObject,
    /// Text matching this regular expression, whole.
    Regex(String),
    /// Text in the language of this Lark grammar (llguidance's Lark dialect).
    Lark(String),
}

impl TryFrom<&pb::OutputConstraint> for Grammar {
    type Error = GrammarError;

    /// The grammar an API or sampler constraint names.
    fn try_from(c: &pb::OutputConstraint) -> Result<Self, GrammarError> {
        use pb::output_constraint::Kind;
        match &c.kind {
            Some(Kind::JsonSchema(s)) => Ok(Grammar::JsonSchema(s.clone())),
            Some(Kind::JsonObject(_)) => Ok(Grammar::JsonObject),
            Some(Kind::Regex(r)) => Ok(Grammar::Regex(r.clone())),
            Some(Kind::Lark(l)) => Ok(Grammar::Lark(l.clone())),
            None => Err(GrammarError::Unset),
        }
    }
}

impl From<&Grammar> for pb::OutputConstraint {
    fn from(g: &Grammar) -> Self {
        use pb::output_constraint::Kind;
        let kind = match g {
            Grammar::JsonSchema(s) => Kind::JsonSchema(s.clone()),
            Grammar::JsonObject => Kind::JsonObject(true),
            Grammar::Regex(r) => Kind::Regex(r.clone()),
            Grammar::Lark(l) => Kind::Lark(l.clone()),
        };
        pb::OutputConstraint { kind: Some(kind) }
    }
}

/// Why a grammar cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    #[error("the JSON schema is not JSON: {0}")]
    SchemaNotJson(String),
    #[error("the grammar does not compile: {0}")]
    Compile(String),
    #[error("the model's vocabulary cannot be used for structured output: {0}")]
    Vocabulary(String),
    #[error("constraint: set one of json_schema, json_object, regex, lark")]
    Unset,
    #[error("the grammar matches no text: {0}")]
    NoText(String),
    #[error("the grammar allows no token after the text so far: {0}")]
    DeadEnd(String),
    #[error("the grammar refused the sampled token: {0}")]
    Refused(String),
}

/// The model's vocabulary prepared for llguidance; makes a [`Matcher`] per generation.
pub struct Grammars {
    factory: ParserFactory,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").finish_non_exhaustive()
    }
}

impl Grammars {
    /// Builds the token trie of `tok`'s vocabulary (control tokens marked special, so no
    /// grammar produces them; the first end-of-generation token is what ends a finished match).
    pub fn new(tok: &Tokenizer) -> Result<Self, GrammarError> {
        let n = tok.vocab_size();
        let eos = *tok.end_of_generation.first().ok_or_else(|| GrammarError::Vocabulary("it names no end-of-generation token".into()))?;
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| {
                let bytes = tok.token_bytes(id).unwrap_or(&[]);
                if tok.is_special(id) {
                    // toktrie's mark of a special token: a leading 0xFF (never in UTF-8 text).
                    [&[TokTrie::SPECIAL_TOKEN_MARKER][..], bytes].concat()
                } else {
                    bytes.to_vec()
                }
            })
            .collect();
        let mut info = TokRxInfo::new(n as u32, eos);
        info.tok_bos = tok.bos;
        let trie = TokTrie::from(&info, &words);
        let env: llguidance::toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// A matcher of `g` at the start of a generation, or why `g` cannot be used.
    pub fn matcher(&self, g: &Grammar) -> Result<Matcher, GrammarError> {
        let grammar = match g {
            Grammar::JsonSchema(s) => TopLevelGrammar::from_json_schema(compact(serde_json::from_str(s).map_err(|e| GrammarError::SchemaNotJson(e.to_string()))?)),
            Grammar::JsonObject => TopLevelGrammar::from_json_schema(compact(serde_json::json!({ "type": "object" }))),
            Grammar::Regex(r) => TopLevelGrammar::from_regex(r),
            Grammar::Lark(l) => TopLevelGrammar::from_lark(l.clone()),
        };
        let parser = self.factory.create_parser(grammar).map_err(|e| GrammarError::Compile(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        match matcher.get_error() {
            Some(e) => Err(GrammarError::Compile(e)),
            None => Ok(matcher),
        }
    }

    /// Whether `g` can be used: it compiles and allows a first token (a regular expression
    /// such as `[a&&b]` compiles to a language with no text in it, and would fail its
    /// generation's first step).
    pub fn check(&self, g: &Grammar) -> Result<(), GrammarError> {
        // (llguidance answers a mask that would allow nothing with an error.)
        allowed(&mut self.matcher(g)?).map(drop).map_err(|e| match e {
            GrammarError::DeadEnd(why) => GrammarError::NoText(format!("no token can start it ({why})")),
            e => e,
        })
    }
}

/// The first line of an llguidance error, at most 200 characters (some carry the parser's
/// whole state, which tells a client nothing).
fn first_line(e: &str) -> String {
    e.lines().next().unwrap_or("").chars().take(200).collect()
}

/// A schema's JSON written with single spaces after `,` and `:` and no other whitespace
/// (llguidance's `x-guidance` options), unless the schema sets its own: free whitespace lets a
/// model run on in newlines until max_tokens, and then the output does not parse.
fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance").or_insert_with(|| serde_json::json!({ "whitespace_flexible": false, "item_separator": ", ", "key_separator": ": " }));
    }
    schema
}

/// The tokens `matcher` allows next (end of generation only, once the grammar is complete).
pub fn allowed(matcher: &mut Matcher) -> Result<SimpleVob, GrammarError> {
    matcher.compute_mask_or_eos().map_err(|e| GrammarError::DeadEnd(first_line(&e.to_string())))
}

/// Follows a sampled token.
pub fn consume(matcher: &mut Matcher, token: u32) -> Result<(), GrammarError> {
    matcher.consume_token(token).map_err(|e| GrammarError::Refused(first_line(&e.to_string())))
}

/// Sets the logits of the tokens `mask` forbids (and of any past the vocabulary it covers) to
/// minus infinity, a 32-token word of the mask at a time.
pub fn apply_mask(mask: &SimpleVob, logits: &mut [f32]) {
    mask.iter_unset_entries(|id| {
        if let Some(l) = logits.get_mut(id) {
            *l = f32::NEG_INFINITY;
        }
    });
    logits.iter_mut().skip(mask.len()).for_each(|l| *l = f32::NEG_INFINITY);
}
