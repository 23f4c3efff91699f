//! The byte-level BPE pre-tokenizers a GGUF names in `tokenizer.ggml.pre`, as llama.cpp's
//! `llama-vocab.cpp` defines them: for each name, the regular expressions that cut the text
//! (each applied to the pieces the previous one left, matches and the text between them kept
//! as pieces) and whether a whole piece that is itself a token skips the merges
//! (`ignore_merges`, Llama 3's rule). Built as a `tokenizers` pre-tokenizer sequence.

use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;

use crate::error::{Error, Result};

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const DEEPSEEK_LLM: &[&str] = &[
    "[\r\n]",
    r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+",
    r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+",
    "\\s+$",
    r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+",
    "\\p{N}+",
];
const DEEPSEEK_CODER: &[&str] = &["[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+", "\\p{N}"];
const DEEPSEEK_V3: &[&str] = &[
    r"\p{N}{1,3}",
    r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];
const FALCON: &[&str] = &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"];
const DEFAULT: &[&str] = &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"];
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const SEED_CODER: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+";
const BAILINGMOE: &str = r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+";
const BLOOM: &str = r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+";
const MINICPM5: &[&str] = &[
    r"\p{N}{1,3}",
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

/// A pre-tokenizer: its regular expressions, in order, and whether whole-token pieces skip
/// the merges.
pub struct PreTokenizer {
    pub patterns: &'static [&'static str],
    pub ignore_merges: bool,
}

/// The names llama.cpp knows that Duet supports (byte-level BPE with regular expressions
/// only; llama.cpp's hand-written splitters — kimi-k2, afmoe, superbpe — and the SentencePiece-
/// style BPE of gemma4 are not among them).
pub const SUPPORTED: &[&str] = &[
    "default", "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "dbrx", "smaug-bpe",
    "deepseek-llm", "deepseek-coder", "deepseek-v3", "falcon", "mpt", "starcoder", "refact", "command-r", "smollm", "codeshell",
    "exaone", "minerva-7b", "mellum2", "gpt-2", "gpt2", "phi-2", "olmo", "jais", "trillion", "granite-docling", "exaone4", "gigachat",
    "mellum", "qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan", "kormo", "qwen35", "chatglm-bpe", "glm4", "glm5",
    "tekken", "gpt-4o", "llama4", "seed-coder", "bailingmoe", "bailingmoe2", "llada-moe", "poro-chat", "bloom", "gpt3-finnish",
    "viking", "minicpm5",
];

/// The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre = name` (absent: "default").
pub fn lookup(name: &str) -> Result<PreTokenizer> {
    let p = |patterns: &'static [&'static str], ignore_merges| Ok(PreTokenizer { patterns, ignore_merges });
    match name {
        "" | "default" => p(DEFAULT, false),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2" => p(&[LLAMA3], true),
        "dbrx" | "smaug-bpe" | "chatglm-bpe" => p(&[LLAMA3], false),
        "glm4" | "glm5" => p(&[LLAMA3], true),
        "deepseek-llm" => p(DEEPSEEK_LLM, false),
        "deepseek-coder" => p(DEEPSEEK_CODER, false),
        "deepseek-v3" => p(DEEPSEEK_V3, false),
        "falcon" => p(FALCON, false),
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => p(&[r"\p{N}", GPT2], false),
        // "gpt2": Duet's own spelling before it followed llama.cpp's names (older test models).
        "gpt-2" | "gpt2" | "phi-2" | "mpt" | "olmo" | "jais" | "trillion" | "granite-docling" | "exaone4" | "gigachat" | "mellum" => p(&[GPT2], false),
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" | "hunyuan" | "kormo" => p(&[QWEN2], false),
        "qwen35" => p(&[QWEN35], false),
        "tekken" => p(&[TEKKEN], true),
        "gpt-4o" | "llama4" => p(&[GPT4O], false),
        "seed-coder" => p(&[SEED_CODER], false),
        "bailingmoe" | "bailingmoe2" | "llada-moe" => p(&[BAILINGMOE], false),
        "poro-chat" | "bloom" | "gpt3-finnish" => p(&[BLOOM], false),
        "viking" => p(&[BLOOM, r"\p{N}"], false),
        "minicpm5" => p(MINICPM5, true),
        other => Err(Error::Tokenizer(format!(
            "pre-tokenizer {other:?} (tokenizer.ggml.pre) is not supported; supported: {}",
            SUPPORTED.join(", ")
        ))),
    }
}

impl PreTokenizer {
    /// The `tokenizers` pre-tokenizer: each pattern's split, then GPT-2's byte-to-character map.
    pub fn build(&self) -> Result<PreTokenizerWrapper> {
        let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(self.patterns.len() + 1);
        for pattern in self.patterns {
            let split = Split::new(SplitPattern::Regex((*pattern).into()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| Error::Tokenizer(format!("pre-tokenizer pattern {pattern:?}: {e}")))?;
            steps.push(split.into());
        }
        steps.push(ByteLevel::new(false, false, false).into());
        Ok(Sequence::new(steps).into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_supported_name_builds_and_unknown_ones_are_refused() {
        for name in SUPPORTED {
            lookup(name).and_then(|p| p.build()).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        let err = lookup("kimi-k2").err().expect("refused").to_string();
        assert!(err.contains("kimi-k2") && err.contains("qwen2"), "{err}");
    }
}
