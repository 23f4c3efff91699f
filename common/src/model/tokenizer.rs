//! Tokenizer built with the `tokenizers` crate from a GGUF's own `tokenizer.ggml.*` metadata
//! (byte-level BPE) or from a `tokenizer.json`, plus streaming detokenisation.

use std::collections::HashMap;
use std::path::Path;

use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use super::gguf::{GgufFile, Value};
use super::names::GeneralKey;
use crate::error::{Error, Result};

/// ggml token types (`tokenizer.ggml.token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Llama 3's pattern (`tokenizer.ggml.pre = "llama-bpe"`).
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A model's tokenizer: encoding with and without special-token parsing, and the raw bytes
/// of every token for exact detokenisation.
pub struct Tokenizer {
    with_special: tokenizers::Tokenizer,
    plain: tokenizers::Tokenizer,
    token_bytes: Vec<Vec<u8>>,
    /// Beginning-of-sequence token, and whether prompts start with it.
    pub bos: Option<u32>,
    pub add_bos: bool,
    /// Tokens that end generation (EOS, EOT, `<|im_end|>`-style control tokens named so).
    pub end_of_generation: Vec<u32>,
    /// Which tokens are special (control tokens: never text a grammar may produce).
    special: Vec<bool>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("vocab", &self.token_bytes.len()).field("bos", &self.bos).finish()
    }
}

fn tok_err(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(e.to_string())
}

/// GPT-2's byte-to-character map: printable bytes map to themselves, the rest to U+0100...
fn byte_to_char() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        map[b as usize] = if printable {
            b as char
        } else {
            n += 1;
            char::from_u32(255 + n).expect("valid code point")
        };
    }
    map
}

/// The bytes a byte-level BPE token string stands for (`None` if a char is outside the map).
fn byte_level_bytes(token: &str, char_to_byte: &HashMap<char, u8>) -> Option<Vec<u8>> {
    token.chars().map(|c| char_to_byte.get(&c).copied()).collect()
}

fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper> {
    let split = |pattern: &str| -> Result<PreTokenizerWrapper> {
        Ok(Split::new(SplitPattern::Regex(pattern.into()), SplitDelimiterBehavior::Isolated, false).map_err(tok_err)?.into())
    };
    let byte_level = |use_regex| PreTokenizerWrapper::from(ByteLevel::new(false, false, use_regex));
    Ok(match pre {
        // Digits are cut out one by one first, then GPT-2's pattern applies.
        "smollm" => Sequence::new(vec![split(r"\p{N}")?, byte_level(true)]).into(),
        "gpt2" | "default" | "gpt-2" => byte_level(true),
        "llama-bpe" | "llama3" | "smaug-bpe" => Sequence::new(vec![split(LLAMA3_PATTERN)?, byte_level(false)]).into(),
        other => return Err(Error::Tokenizer(format!("pre-tokenizer {other:?} is not supported (known: smollm, gpt2, llama-bpe)"))),
    })
}

fn string_array(g: &GgufFile, key: GeneralKey) -> Result<Vec<&str>> {
    let arr = g.get(key.key()).and_then(Value::as_array).ok_or_else(|| Error::Tokenizer(format!("{} missing", key.key())))?;
    arr.iter().map(|v| v.as_str().ok_or_else(|| Error::Tokenizer(format!("{} holds a non-string", key.key())))).collect()
}

fn token_id(g: &GgufFile, key: GeneralKey) -> Option<u32> {
    g.get(key.key()).and_then(Value::as_u64).and_then(|v| u32::try_from(v).ok())
}

impl Tokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata (byte-level BPE models).
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let model = g.get(GeneralKey::TokenizerModel.key()).and_then(Value::as_str).unwrap_or("");
        if model != "gpt2" {
            return Err(Error::Tokenizer(format!("tokenizer model {model:?} is not supported (only byte-level BPE, \"gpt2\")")));
        }
        let tokens = string_array(g, GeneralKey::TokenizerTokens)?;
        let merges = string_array(g, GeneralKey::TokenizerMerges)?;
        let types: Vec<i64> = match g.get(GeneralKey::TokenizerTokenType.key()).and_then(Value::as_array) {
            Some(a) => a.iter().map(|v| v.as_f64().unwrap_or(1.0) as i64).collect(),
            None => vec![1; tokens.len()],
        };
        let pre = g.get(GeneralKey::TokenizerPre.key()).and_then(Value::as_str).unwrap_or("default");

        let vocab: tokenizers::models::bpe::Vocab = tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect();
        let merges: Vec<(String, String)> = merges
            .iter()
            .map(|m| m.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())))
            .collect::<Option<_>>()
            .ok_or_else(|| Error::Tokenizer("a merge is not two tokens separated by a space".into()))?;
        let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(tok_err)?;
        let mut tk = tokenizers::Tokenizer::new(bpe);
        tk.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
        let added: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_USER_DEFINED)
            .map(|(s, &t)| AddedToken::from(s.to_string(), t == TOKEN_TYPE_CONTROL).normalized(false))
            .collect();
        tk.add_tokens(added).map_err(tok_err)?;

        let char_to_byte: HashMap<char, u8> = byte_to_char().iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
        let token_bytes = tokens
            .iter()
            .zip(&types)
            .map(|(s, &t)| match t {
                TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED => s.as_bytes().to_vec(),
                _ => byte_level_bytes(s, &char_to_byte).unwrap_or_else(|| s.as_bytes().to_vec()),
            })
            .collect();

        let eos = token_id(g, GeneralKey::TokenizerEos);
        let eot = token_id(g, GeneralKey::TokenizerEot);
        let mut end_of_generation: Vec<u32> = eos.into_iter().chain(eot).collect();
        // Chat models end turns with a control token the metadata may not name as EOS.
        for name in ["<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>"] {
            if let Some(&id) = tokens.iter().position(|t| *t == name).map(|i| i as u32).as_ref() {
                if types.get(id as usize) == Some(&TOKEN_TYPE_CONTROL) && !end_of_generation.contains(&id) {
                    end_of_generation.push(id);
                }
            }
        }
        Self::finish(tk, token_bytes, token_id(g, GeneralKey::TokenizerBos), g.get(GeneralKey::TokenizerAddBos.key()).and_then(Value::as_bool).unwrap_or(false), end_of_generation)
    }

    /// Loads a Hugging Face `tokenizer.json` (byte-level BPE vocabularies get exact bytes).
    pub fn from_file(path: &Path) -> Result<Self> {
        let tk = tokenizers::Tokenizer::from_file(path).map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        let char_to_byte: HashMap<char, u8> = byte_to_char().iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
        let added = tk.get_added_tokens_decoder();
        let n = tk.get_vocab_size(true);
        let token_bytes = (0..n as u32)
            .map(|id| {
                let s = tk.id_to_token(id).unwrap_or_default();
                if added.contains_key(&id) {
                    s.into_bytes()
                } else {
                    byte_level_bytes(&s, &char_to_byte).unwrap_or_else(|| s.into_bytes())
                }
            })
            .collect();
        let find = |names: &[&str]| names.iter().find_map(|n| tk.token_to_id(n));
        let bos = find(&["<|begin_of_text|>", "<s>", "<|im_start|>"]);
        let end_of_generation =
            ["<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>"].iter().filter_map(|n| tk.token_to_id(n)).collect();
        Self::finish(tk, token_bytes, bos, false, end_of_generation)
    }

    fn finish(with_special: tokenizers::Tokenizer, token_bytes: Vec<Vec<u8>>, bos: Option<u32>, add_bos: bool, end_of_generation: Vec<u32>) -> Result<Self> {
        let mut plain = with_special.clone();
        plain.set_encode_special_tokens(true);
        let mut special = vec![false; token_bytes.len()];
        for (id, t) in with_special.get_added_tokens_decoder() {
            if t.special {
                if let Some(s) = special.get_mut(id as usize) {
                    *s = true;
                }
            }
        }
        Ok(Tokenizer { with_special, plain, token_bytes, bos, add_bos, end_of_generation, special })
    }

    /// The tokenizer as a Hugging Face `tokenizer.json` document.
    pub fn to_json(&self) -> Result<String> {
        self.with_special.to_string(true).map_err(tok_err)
    }

    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    /// Token ids of `text`; with `parse_special`, control tokens written in the text (e.g.
    /// `<|im_start|>`) become their ids. Never adds BOS.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let tk = if parse_special { &self.with_special } else { &self.plain };
        Ok(tk.encode(text, false).map_err(|e| Error::Encode(e.to_string()))?.get_ids().to_vec())
    }

    /// Ids of a prompt: BOS first when the model asks for it.
    pub fn encode_prompt(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if let (true, Some(bos)) = (self.add_bos, self.bos) {
            ids.push(bos);
        }
        ids.extend(self.encode(text, parse_special)?);
        Ok(ids)
    }

    /// The id of the token whose text is exactly `text` (e.g. a control token's name).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.with_special.token_to_id(text)
    }

    /// Whether token `id` is special (a control token).
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// The raw bytes of one token (control tokens as their text).
    pub fn token_bytes(&self, id: u32) -> Result<&[u8]> {
        self.token_bytes.get(id as usize).map(Vec::as_slice).ok_or(Error::TokenOutOfRange { id, n_vocab: self.token_bytes.len() })
    }

    /// Text of a token sequence; invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.token_bytes(id)?);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Checks that every id is inside the vocabulary.
    pub fn check_ids(&self, ids: &[u32]) -> Result<()> {
        match ids.iter().find(|&&id| id as usize >= self.token_bytes.len()) {
            Some(&id) => Err(Error::TokenOutOfRange { id, n_vocab: self.token_bytes.len() }),
            None => Ok(()),
        }
    }
}

/// Turns a stream of token bytes into text without ever emitting half a UTF-8 character:
/// an incomplete sequence at the end is held until the next token completes it.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// Adds a token's bytes; returns the text that is now complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).expect("valid prefix"));
                    match e.error_len() {
                        // Incomplete at the end: keep it for the next token.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Ends the stream: bytes still held (a character never completed) become U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = if self.pending.is_empty() { String::new() } else { String::from_utf8_lossy(&self.pending).into_owned() };
        self.pending.clear();
        out
    }
}
