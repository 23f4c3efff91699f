//! Tokenizer built with the `tokenizers` crate from a GGUF's own `tokenizer.ggml.*` metadata
//! — byte-level BPE (`gpt2`, with llama.cpp's pre-tokenizer for `tokenizer.ggml.pre`) or
//! SentencePiece (`llama`: the merges derived from the pieces' scores as Hugging Face's
//! converter derives them, `▁` for spaces, byte fallback) — or from a `tokenizer.json`, plus
//! streaming detokenisation.

use std::collections::HashMap;
use std::path::Path;

use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::AddedToken;

use super::gguf::{GgufFile, Value};
use super::names::GeneralKey;
use super::pretokenizers;
use crate::error::{Error, Result};

/// ggml token types (`tokenizer.ggml.token_type`).
const TOKEN_TYPE_UNKNOWN: i64 = 2;
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;
const TOKEN_TYPE_BYTE: i64 = 6;

/// SentencePiece's space.
const SPM_SPACE: char = '\u{2581}';

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

/// The byte a SentencePiece byte token (`<0x0A>`) stands for.
fn spm_byte(token: &str) -> Option<u8> {
    u8::from_str_radix(token.strip_prefix("<0x")?.strip_suffix('>')?, 16).ok()
}

fn string_array(g: &GgufFile, key: GeneralKey) -> Result<Vec<&str>> {
    let arr = g.get(key.key()).and_then(Value::as_array).ok_or_else(|| Error::Tokenizer(format!("{} missing", key.key())))?;
    arr.iter().map(|v| v.as_str().ok_or_else(|| Error::Tokenizer(format!("{} holds a non-string", key.key())))).collect()
}

fn token_id(g: &GgufFile, key: GeneralKey) -> Option<u32> {
    g.get(key.key()).and_then(Value::as_u64).and_then(|v| u32::try_from(v).ok())
}

/// The vocabulary of a GGUF: token strings and their ggml types.
struct Vocabulary<'a> {
    tokens: Vec<&'a str>,
    types: Vec<i64>,
}

impl<'a> Vocabulary<'a> {
    fn read(g: &'a GgufFile) -> Result<Self> {
        let tokens = string_array(g, GeneralKey::TokenizerTokens)?;
        let types: Vec<i64> = match g.get(GeneralKey::TokenizerTokenType.key()).and_then(Value::as_array) {
            Some(a) => a.iter().map(|v| v.as_f64().unwrap_or(1.0) as i64).collect(),
            None => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(Error::Tokenizer(format!("{} tokens but {} token types", tokens.len(), types.len())));
        }
        Ok(Vocabulary { tokens, types })
    }

    /// Control, unknown and user-defined tokens are matched whole in the text before the
    /// model sees it (control and unknown ones only when special tokens are parsed).
    fn added_tokens(&self) -> Vec<AddedToken> {
        self.tokens
            .iter()
            .zip(&self.types)
            .filter(|(_, &t)| matches!(t, TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED | TOKEN_TYPE_UNKNOWN))
            .map(|(s, &t)| AddedToken::from(s.to_string(), t != TOKEN_TYPE_USER_DEFINED).normalized(false))
            .collect()
    }

    fn ids(&self) -> tokenizers::models::bpe::Vocab {
        self.tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect()
    }
}

impl Tokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let model = g.get(GeneralKey::TokenizerModel.key()).and_then(Value::as_str).unwrap_or("");
        let vocab = Vocabulary::read(g)?;
        let (tk, token_bytes) = match model {
            "gpt2" => Self::byte_level_bpe(g, &vocab)?,
            "llama" => Self::sentencepiece(g, &vocab)?,
            other => {
                return Err(Error::Tokenizer(format!(
                    "tokenizer model {other:?} (tokenizer.ggml.model) is not supported: only \"gpt2\" (byte-level BPE) and \"llama\" (SentencePiece)"
                )))
            }
        };
        let eos = token_id(g, GeneralKey::TokenizerEos);
        let eot = token_id(g, GeneralKey::TokenizerEot);
        let mut end_of_generation: Vec<u32> = eos.into_iter().chain(eot).collect();
        // Chat models end turns with a control token the metadata may not name as EOS.
        for name in ["<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<end_of_turn>"] {
            if let Some(id) = vocab.tokens.iter().position(|t| *t == name).map(|i| i as u32) {
                if vocab.types.get(id as usize) == Some(&TOKEN_TYPE_CONTROL) && !end_of_generation.contains(&id) {
                    end_of_generation.push(id);
                }
            }
        }
        // SentencePiece models start with BOS unless the file says otherwise (llama.cpp's default).
        let add_bos = g.get(GeneralKey::TokenizerAddBos.key()).and_then(Value::as_bool).unwrap_or(model == "llama");
        Self::finish(tk, token_bytes, token_id(g, GeneralKey::TokenizerBos), add_bos, end_of_generation)
    }

    fn byte_level_bpe(g: &GgufFile, vocab: &Vocabulary) -> Result<(tokenizers::Tokenizer, Vec<Vec<u8>>)> {
        let merges = string_array(g, GeneralKey::TokenizerMerges)?;
        let pre = pretokenizers::lookup(g.get(GeneralKey::TokenizerPre.key()).and_then(Value::as_str).unwrap_or("default"))?;
        let merges: Vec<(String, String)> = merges
            .iter()
            .map(|m| m.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())))
            .collect::<Option<_>>()
            .ok_or_else(|| Error::Tokenizer("a merge is not two tokens separated by a space".into()))?;
        let bpe = BPE::builder().vocab_and_merges(vocab.ids(), merges).ignore_merges(pre.ignore_merges).build().map_err(tok_err)?;
        let mut tk = tokenizers::Tokenizer::new(bpe);
        tk.with_pre_tokenizer(Some(pre.build()?));
        tk.add_tokens(vocab.added_tokens()).map_err(tok_err)?;
        let char_to_byte: HashMap<char, u8> = byte_to_char().iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
        let token_bytes = vocab
            .tokens
            .iter()
            .zip(&vocab.types)
            .map(|(s, &t)| match t {
                TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED => s.as_bytes().to_vec(),
                _ => byte_level_bytes(s, &char_to_byte).unwrap_or_else(|| s.as_bytes().to_vec()),
            })
            .collect();
        Ok((tk, token_bytes))
    }

    /// SentencePiece as Hugging Face's converter builds it: a BPE whose merges are every
    /// split of a piece into two pieces, ordered by the whole piece's score (best first);
    /// characters outside the vocabulary fall back to `<0xXX>` byte tokens; spaces are `▁`,
    /// and a space starts the text and each piece of text after a control token (llama.cpp's
    /// `add_space_prefix`, on unless the file turns it off).
    fn sentencepiece(g: &GgufFile, vocab: &Vocabulary) -> Result<(tokenizers::Tokenizer, Vec<Vec<u8>>)> {
        let scores: Vec<f32> = g
            .get(GeneralKey::TokenizerScores.key())
            .and_then(Value::as_array)
            .ok_or_else(|| Error::Tokenizer(format!("{} missing (a SentencePiece vocabulary needs its scores)", GeneralKey::TokenizerScores.key())))?
            .iter()
            .map(|v| v.as_f64().map(|f| f as f32))
            .collect::<Option<_>>()
            .ok_or_else(|| Error::Tokenizer("a token score is not a number".into()))?;
        if scores.len() != vocab.tokens.len() {
            return Err(Error::Tokenizer(format!("{} tokens but {} scores", vocab.tokens.len(), scores.len())));
        }
        let ids: HashMap<&str, usize> = vocab.tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
        let mut merges: Vec<(usize, usize, f32)> = Vec::new();
        for (id, piece) in vocab.tokens.iter().enumerate() {
            if vocab.types[id] != 1 {
                continue;
            }
            let mut local: Vec<(usize, usize, f32)> = piece
                .char_indices()
                .skip(1)
                .filter_map(|(at, _)| Some((*ids.get(&piece[..at])?, *ids.get(&piece[at..])?, scores[id])))
                .collect();
            local.sort_by_key(|&(l, r, _)| (l, r));
            merges.extend(local);
        }
        // Stable: equal scores keep the vocabulary's order, as Python's sort does.
        merges.sort_by(|a, b| b.2.total_cmp(&a.2));
        let merges = merges.into_iter().map(|(l, r, _)| (vocab.tokens[l].to_string(), vocab.tokens[r].to_string())).collect();
        let mut builder = BPE::builder().vocab_and_merges(vocab.ids(), merges).byte_fallback(true).fuse_unk(true);
        if let Some(unk) = vocab.types.iter().position(|&t| t == TOKEN_TYPE_UNKNOWN) {
            builder = builder.unk_token(vocab.tokens[unk].to_string());
        }
        let mut tk = tokenizers::Tokenizer::new(builder.build().map_err(tok_err)?);
        let space = SPM_SPACE.to_string();
        let replace = Replace::new(" ", space.as_str()).map_err(tok_err)?;
        let add_space_prefix = g.get(GeneralKey::TokenizerAddSpacePrefix.key()).and_then(Value::as_bool).unwrap_or(true);
        let normalizer: tokenizers::NormalizerWrapper = if add_space_prefix { NormalizerSequence::new(vec![Prepend::new(space.clone()).into(), replace.into()]).into() } else { replace.into() };
        tk.with_normalizer(Some(normalizer)).map_err(tok_err)?;
        tk.add_tokens(vocab.added_tokens()).map_err(tok_err)?;
        let token_bytes = vocab
            .tokens
            .iter()
            .zip(&vocab.types)
            .map(|(s, &t)| match (t, spm_byte(s)) {
                (TOKEN_TYPE_BYTE, Some(b)) => vec![b],
                (TOKEN_TYPE_CONTROL | TOKEN_TYPE_UNKNOWN, _) => s.as_bytes().to_vec(),
                _ => s.replace(SPM_SPACE, " ").into_bytes(),
            })
            .collect();
        Ok((tk, token_bytes))
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
