//! The tokenizer a GGUF file carries (`tokenizer.ggml.*`), as the `tokenizers` crate's byte-level BPE: the
//! vocabulary (`tokens`), the merges, the added tokens (`token_type` 3, control: special; 4, user-defined: not
//! special), the pre-tokenizer's split regex by its llama.cpp name (`tokenizer.ggml.pre`), and the chat template
//! (`tokenizer.chat_template`). Used where no `tokenizer.json` is given beside the model.
//!
//! Only the `gpt2` tokenizer model (byte-level BPE) with the pre-tokenizers of the Qwen family (`qwen2`, `qwen35`)
//! is read; any other is an error naming the key, never a tokenizer that would split text differently.

use super::file::{GgufFile, Value};
use crate::error::{Error, Result};
use serde_json::json;

/// The split regexes of the pre-tokenizers read, by llama.cpp's name (the regexes of the Qwen tokenizers'
/// `tokenizer.json`).
const SPLITS: [(&str, &str); 2] = [
    (
        "qwen35",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    (
        "qwen2",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
];

/// A GGUF's tokenizer: the `tokenizers` tokenizer, its chat template, and the end-of-sequence token's text.
pub struct GgufTokenizer {
    /// The byte-level BPE tokenizer.
    pub tokenizer: tokenizers::Tokenizer,
    /// `tokenizer.chat_template`, when the file has one.
    pub chat_template: Option<String>,
    /// The text of `tokenizer.ggml.eos_token_id`'s token.
    pub eos_token: Option<String>,
}

fn err(file: &GgufFile, key: &str, message: String) -> Error {
    Error::Tokenizer {
        file: file.path().display().to_string(),
        message: format!("{key}: {message}"),
    }
}

fn strings<'a>(file: &'a GgufFile, key: &str) -> Result<Vec<&'a str>> {
    match file.get(key) {
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.as_str()),
                other => Err(err(
                    file,
                    key,
                    format!("holds a {}, not strings", other.type_name()),
                )),
            })
            .collect(),
        Some(v) => Err(err(file, key, format!("a {}, not an array", v.type_name()))),
        None => Err(err(file, key, "missing".into())),
    }
}

fn string<'a>(file: &'a GgufFile, key: &str) -> Result<&'a str> {
    match file.get(key) {
        Some(Value::String(s)) => Ok(s),
        Some(v) => Err(err(file, key, format!("a {}, not a string", v.type_name()))),
        None => Err(err(file, key, "missing".into())),
    }
}

/// The tokenizer of a GGUF file.
pub fn load(file: &GgufFile) -> Result<GgufTokenizer> {
    let model = string(file, "tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(err(
            file,
            "tokenizer.ggml.model",
            format!("`{model}` is not read (only `gpt2`, byte-level BPE)"),
        ));
    }
    let pre = string(file, "tokenizer.ggml.pre")?;
    let split = SPLITS
        .iter()
        .find(|(name, _)| *name == pre)
        .map(|(_, regex)| *regex)
        .ok_or_else(|| {
            err(
                file,
                "tokenizer.ggml.pre",
                format!("`{pre}` is not a pre-tokenizer this reader knows (qwen35, qwen2)"),
            )
        })?;
    let tokens = strings(file, "tokenizer.ggml.tokens")?;
    let merges = strings(file, "tokenizer.ggml.merges")?;
    let types: Vec<u64> = match file.get("tokenizer.ggml.token_type") {
        Some(Value::Array(items)) => items.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
        _ => vec![1; tokens.len()],
    };
    if types.len() != tokens.len() {
        return Err(err(
            file,
            "tokenizer.ggml.token_type",
            format!("lists {} types for {} tokens", types.len(), tokens.len()),
        ));
    }
    let mut vocab = serde_json::Map::new();
    let mut added = vec![];
    for (id, (&text, &ty)) in tokens.iter().zip(&types).enumerate() {
        vocab.insert(text.to_string(), json!(id));
        if ty == 3 || ty == 4 {
            added.push(json!({
                "id": id, "content": text, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": ty == 3,
            }));
        }
    }
    let merges: Vec<serde_json::Value> = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| json!([a, b]))
                .ok_or_else(|| {
                    err(
                        file,
                        "tokenizer.ggml.merges",
                        format!("`{m}` is not two tokens"),
                    )
                })
        })
        .collect::<Result<_>>()?;
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        ]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges},
    });
    let tokenizer: tokenizers::Tokenizer = spec.to_string().parse().map_err(|e| {
        err(
            file,
            "tokenizer.ggml.tokens",
            format!("not a BPE tokenizer: {e}"),
        )
    })?;
    let chat_template = match file.get("tokenizer.chat_template") {
        Some(Value::String(s)) => Some(s.clone()),
        _ => None,
    };
    let eos_token = file
        .get("tokenizer.ggml.eos_token_id")
        .and_then(Value::as_u64)
        .and_then(|id| tokens.get(id as usize))
        .map(|s| s.to_string());
    Ok(GgufTokenizer {
        tokenizer,
        chat_template,
        eos_token,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn testdata() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata")
    }

    #[test]
    fn the_gguf_tokenizer_encodes_as_the_checkpoints() {
        let file = GgufFile::open(&testdata().join("gguf/models/tiny-f32.gguf")).unwrap();
        let ours = load(&file).unwrap();
        let theirs =
            tokenizers::Tokenizer::from_file(testdata().join("models/tiny/tokenizer.json"))
                .unwrap();
        for text in [
            "Hello, world! The quick brown fox jumps over the lazy dog.",
            "<|im_start|>user\nWhat's 12345 + 678?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
            "  spaces\t\ttabs\r\nnewlines\n\n\nÉtoile café naïve 日本語 😀 don't I'LL",
        ] {
            let a = ours.tokenizer.encode(text, false).unwrap();
            let b = theirs.encode(text, false).unwrap();
            assert_eq!(a.get_ids(), b.get_ids(), "{text:?}");
            assert_eq!(ours.tokenizer.decode(a.get_ids(), false).unwrap(), text);
        }
        assert!(ours.chat_template.unwrap().contains("<|im_start|>"));
        assert_eq!(ours.eos_token.as_deref(), Some("<|im_end|>"));
    }
}
