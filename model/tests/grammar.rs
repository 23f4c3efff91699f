//! Structured-output grammars on the real vocabulary (SmolLM2's): text valid under a grammar
//! is allowed token by token and ends in an accepting state where end of generation is
//! allowed; text that breaks it is refused at the first token that does; bad grammars are
//! errors, not panics.

use duet_model::gguf::GgufFile;
use duet_model::grammar::{allowed, Grammar, GrammarError, Grammars};
use duet_model::tokenizer::Tokenizer;
use duet_model::testutil::model_path;

fn setup() -> (Tokenizer, Grammars) {
    let file = GgufFile::open(model_path()).unwrap();
    let tok = Tokenizer::from_gguf(&file).unwrap();
    let grammars = Grammars::new(&tok).unwrap();
    (tok, grammars)
}

/// Feeds `text`'s tokens; returns how many were allowed before the first refused one, and
/// whether end of generation was allowed after all of them.
fn follow(tok: &Tokenizer, grammars: &Grammars, g: &Grammar, text: &str) -> (usize, usize, bool) {
    let ids = tok.encode(text, false).unwrap();
    let mut m = grammars.matcher(g).unwrap();
    for (i, &id) in ids.iter().enumerate() {
        if !allowed(&mut m).unwrap().is_allowed(id) {
            return (i, ids.len(), false);
        }
        m.consume_token(id).unwrap();
    }
    let eos = tok.end_of_generation[0];
    (ids.len(), ids.len(), allowed(&mut m).unwrap().is_allowed(eos))
}

#[test]
fn valid_text_is_allowed_to_the_end_and_invalid_text_is_refused() {
    let (tok, grammars) = setup();
    let schema = Grammar::JsonSchema(r#"{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},"required":["name","age"],"additionalProperties":false}"#.into());
    let (ok, n, end) = follow(&tok, &grammars, &schema, r#"{"name": "Ada", "age": 36}"#);
    assert!(ok == n && end, "valid JSON: {ok}/{n} tokens allowed, end allowed: {end}");
    // A string where the schema wants an integer: refused inside the value.
    let (ok, n, _) = follow(&tok, &grammars, &schema, r#"{"name": "Ada", "age": "old"}"#);
    assert!(ok < n, "a string for an integer was allowed");
    // Missing a required property: the text is allowed but cannot end there.
    let (ok, n, end) = follow(&tok, &grammars, &schema, r#"{"name": "Ada""#);
    assert!(ok == n && !end, "an unfinished object could end");

    let (ok, n, end) = follow(&tok, &grammars, &Grammar::JsonObject, r#"{"x": [1, 2, {"y": null}]}"#);
    assert!(ok == n && end);
    assert!(follow(&tok, &grammars, &Grammar::JsonObject, "hello").0 == 0, "plain text as a JSON object");

    let digits = Grammar::Regex("[0-9]{3}-[a-z]+".into());
    let (ok, n, end) = follow(&tok, &grammars, &digits, "123-abc");
    assert!(ok == n && end);
    assert!(follow(&tok, &grammars, &digits, "12a-abc").0 < tok.encode("12a-abc", false).unwrap().len());

    let lark = Grammar::Lark("start: \"yes\" | \"no\"".into());
    assert!(follow(&tok, &grammars, &lark, "no").2);
    assert!(follow(&tok, &grammars, &lark, "maybe").0 == 0);
}

#[test]
fn control_tokens_are_never_allowed_inside_a_grammar() {
    let (tok, grammars) = setup();
    let mut m = grammars.matcher(&Grammar::JsonObject).unwrap();
    let mask = allowed(&mut m).unwrap();
    let im_start = tok.encode("<|im_start|>", true).unwrap();
    assert_eq!(im_start.len(), 1);
    assert!(tok.is_special(im_start[0]));
    assert!(!mask.is_allowed(im_start[0]));
}

#[test]
fn bad_grammars_are_errors() {
    let (_, grammars) = setup();
    assert!(matches!(grammars.matcher(&Grammar::JsonSchema("{not json".into())), Err(GrammarError::SchemaNotJson(_))));
    assert!(matches!(grammars.matcher(&Grammar::JsonSchema(r#"{"type": "no-such-type"}"#.into())), Err(GrammarError::Compile(_))));
    assert!(matches!(grammars.matcher(&Grammar::Lark("start: (".into())), Err(GrammarError::Compile(_))));
    assert!(matches!(grammars.matcher(&Grammar::Regex("(unclosed".into())), Err(GrammarError::Compile(_))));
    // Compiles, but matches no text: refused before it runs, with a short message.
    for empty in ["[a&&b]", "ab[a&&b]", "[^\\x00-\\x{10FFFF}]"] {
        let g = Grammar::Regex(empty.into());
        match grammars.check(&g) {
            Err(GrammarError::NoText(e)) => assert!(e.chars().count() <= 250 && !e.contains('\n'), "{empty}: {e}"),
            other => panic!("{empty}: {other:?}"),
        }
    }
    for fine in [Grammar::JsonObject, Grammar::Regex("a+".into()), Grammar::Lark("start: \"yes\" | \"no\"".into())] {
        assert_eq!(grammars.check(&fine), Ok(()), "{fine:?}");
    }
}
