//! Prompt encoding: the checkpoint's `tokenizer.json` through the `tokenizers` crate, and its own chat template
//! rendered with `minijinja` (as transformers renders it: `trim_blocks`, `lstrip_blocks`, Python string methods).

use crate::error::{Error, Result};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl Message {
    /// A message with the given role.
    pub fn new(role: &str, content: &str) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A tokenizer with the chat template of its checkpoint.
pub struct ChatTokenizer {
    tokenizer: tokenizers::Tokenizer,
    tokenizer_path: PathBuf,
    template: Option<(String, PathBuf)>,
    eos_token: Option<String>,
    special_tokens: Vec<(String, String)>,
}

fn tok_err(path: &Path, message: impl Into<String>) -> Error {
    Error::Tokenizer {
        file: path.display().to_string(),
        message: message.into(),
    }
}

/// A token given in `tokenizer_config.json` either as a string or as `{"content": …}`.
fn token_text(v: &serde_json::Value) -> Option<String> {
    v.as_str().map(str::to_string).or_else(|| {
        v.get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string)
    })
}

impl ChatTokenizer {
    /// Loads `tokenizer.json`, and the chat template from `chat_template.jinja` or else `tokenizer_config.json`'s
    /// `chat_template` (the file wins, as in transformers), from a checkpoint directory. A GGUF model (a `.gguf` file,
    /// or a directory holding one: [`crate::gguf::find`]) with no `tokenizer.json` beside it gives the tokenizer and
    /// chat template its file carries ([`crate::gguf::tokenizer`]).
    pub fn load(dir: &Path) -> Result<Self> {
        let gguf = crate::gguf::find(dir)?;
        let dir = match &gguf {
            Some(file) if dir.is_file() => file.parent().unwrap_or(Path::new("")).to_path_buf(),
            _ => dir.to_path_buf(),
        };
        let tokenizer_path = dir.join("tokenizer.json");
        if let Some(file) = gguf.filter(|_| !tokenizer_path.exists()) {
            return Self::from_gguf(&file);
        }
        if !tokenizer_path.exists() {
            return Err(tok_err(
                &tokenizer_path,
                "missing: the checkpoint has no tokenizer",
            ));
        }
        let bytes =
            crate::inputs::read(&tokenizer_path).map_err(|e| Error::io(&tokenizer_path, e))?;
        let tokenizer = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| tok_err(&tokenizer_path, e.to_string()))?;
        let config_path = dir.join("tokenizer_config.json");
        let mut template = None;
        let mut eos_token = None;
        let mut special_tokens = Vec::new();
        if config_path.exists() {
            let text = crate::inputs::read_to_string(&config_path)
                .map_err(|e| Error::io(&config_path, e))?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| tok_err(&config_path, format!("not valid JSON: {e}")))?;
            match json.get("chat_template") {
                None | Some(serde_json::Value::Null) => {}
                Some(serde_json::Value::String(s)) => {
                    template = Some((s.clone(), config_path.clone()))
                }
                Some(serde_json::Value::Array(list)) => {
                    let default = list
                        .iter()
                        .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"));
                    let t = default
                        .and_then(|t| t.get("template"))
                        .and_then(|t| t.as_str())
                        .ok_or_else(|| {
                            tok_err(&config_path, "chat_template: no template named \"default\"")
                        })?;
                    template = Some((t.to_string(), config_path.clone()));
                }
                Some(other) => {
                    return Err(tok_err(
                        &config_path,
                        format!("chat_template: expected a string or a list, found {other}"),
                    ));
                }
            }
            for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
                if let Some(t) = json.get(key).and_then(token_text) {
                    special_tokens.push((key.to_string(), t));
                }
            }
            eos_token = json.get("eos_token").and_then(token_text);
        }
        // As transformers: a chat_template.jinja file takes precedence over the config's chat_template.
        let jinja = dir.join("chat_template.jinja");
        if jinja.exists() {
            let text = crate::inputs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?;
            template = Some((text, jinja));
        }
        Ok(ChatTokenizer {
            tokenizer,
            tokenizer_path,
            template,
            eos_token,
            special_tokens,
        })
    }

    /// The tokenizer and chat template a GGUF file carries.
    fn from_gguf(path: &Path) -> Result<Self> {
        let file = crate::gguf::file::GgufFile::open(path)?;
        let t = crate::gguf::tokenizer::load(&file)?;
        Ok(ChatTokenizer {
            tokenizer: t.tokenizer,
            tokenizer_path: path.to_path_buf(),
            template: t.chat_template.map(|s| (s, path.to_path_buf())),
            special_tokens: t
                .eos_token
                .iter()
                .map(|e| ("eos_token".to_string(), e.clone()))
                .collect(),
            eos_token: t.eos_token,
        })
    }

    /// Renders `messages` with the chat template, as `apply_chat_template(..., tokenize=False)` does.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        enable_thinking: bool,
    ) -> Result<String> {
        self.render_serde(messages, add_generation_prompt, enable_thinking)
    }

    /// [`ChatTokenizer::render`] of messages in any form the template takes (a content given as a list of parts).
    fn render_serde<M: Serialize + ?Sized>(
        &self,
        messages: &M,
        add_generation_prompt: bool,
        enable_thinking: bool,
    ) -> Result<String> {
        let (source, path) = self.template.as_ref().ok_or_else(|| {
            tok_err(
                &self.tokenizer_path.with_file_name("tokenizer_config.json"),
                "no chat template (neither `chat_template` in tokenizer_config.json nor chat_template.jinja)",
            )
        })?;
        let mut env = minijinja::Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| tok_err(path, e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template("chat", source)
            .map_err(|e| tok_err(path, format!("chat template does not parse: {e}")))?;
        let tmpl = env
            .get_template("chat")
            .map_err(|e| tok_err(path, e.to_string()))?;
        let mut ctx = std::collections::BTreeMap::new();
        ctx.insert(
            "messages".to_string(),
            minijinja::Value::from(minijinja::value::Serde(messages)),
        );
        ctx.insert(
            "add_generation_prompt".to_string(),
            add_generation_prompt.into(),
        );
        ctx.insert("enable_thinking".to_string(), enable_thinking.into());
        for (k, v) in &self.special_tokens {
            ctx.insert(k.clone(), v.clone().into());
        }
        tmpl.render(ctx)
            .map_err(|e| tok_err(path, format!("chat template failed to render: {e}")))
    }

    /// Token ids of `text`, special tokens recognised, nothing added (as for a rendered chat).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| tok_err(&self.tokenizer_path, e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Renders and encodes a chat prompt whose last user message shows `images` images before its text: its
    /// content is handed to the template as transformers' processors hand it, a list of `{"type": "image"}` parts
    /// and a `{"type": "text"}` part, and the template must write the image placeholder for each
    /// (`<|vision_start|><|image_pad|><|vision_end|>` in Qwen3.5's): a template that writes fewer is an error naming
    /// its file, never a prompt silently without its images.
    pub fn encode_chat_with_images(
        &self,
        messages: &[Message],
        images: usize,
        placeholder: &str,
        enable_thinking: bool,
    ) -> Result<Vec<u32>> {
        let last_user = messages.iter().rposition(|m| m.role == "user");
        let parts: Vec<serde_json::Value> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                if Some(i) == last_user && images > 0 {
                    let mut content: Vec<serde_json::Value> =
                        vec![serde_json::json!({"type": "image"}); images];
                    content.push(serde_json::json!({"type": "text", "text": m.content}));
                    serde_json::json!({"role": m.role, "content": content})
                } else {
                    serde_json::json!({"role": m.role, "content": m.content})
                }
            })
            .collect();
        let text = self.render_serde(&parts, true, enable_thinking)?;
        let written = text.matches(placeholder).count();
        if written != images {
            let path = self.template.as_ref().map_or_else(
                || self.tokenizer_path.with_file_name("tokenizer_config.json"),
                |(_, p)| p.clone(),
            );
            return Err(tok_err(
                &path,
                format!(
                    "the chat template wrote {written} image placeholder(s) `{placeholder}` for {images} image(s): it \
                     does not take images in a message's content; give the prompt as token ids holding the \
                     placeholders instead"
                ),
            ));
        }
        self.encode(&text)
    }

    /// Renders and encodes a chat prompt.
    pub fn encode_chat(&self, messages: &[Message], enable_thinking: bool) -> Result<Vec<u32>> {
        self.encode(&self.render(messages, true, enable_thinking)?)
    }

    /// Text of `ids`, special tokens skipped or kept.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.tokenizer
            .decode(ids, skip_special)
            .map_err(|e| tok_err(&self.tokenizer_path, e.to_string()))
    }

    /// The id of a token string, if it is in the vocabulary.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// Ids that end an assistant turn: the configured `eos_token` (and `<|im_end|>`, `<|endoftext|>` if present).
    pub fn stop_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self
            .eos_token
            .iter()
            .map(String::as_str)
            .chain(["<|im_end|>", "<|endoftext|>"])
            .filter_map(|t| self.token_id(t))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Size of the vocabulary including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bundled() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/models/tiny")
    }

    /// A checkpoint directory with the bundled tokenizer and the given tokenizer_config / chat_template.jinja.
    fn dir_with(config: Option<serde_json::Value>, jinja: Option<&str>) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(
            bundled().join("tokenizer.json"),
            dir.path().join("tokenizer.json"),
        )
        .unwrap();
        if let Some(c) = config {
            std::fs::write(dir.path().join("tokenizer_config.json"), c.to_string()).unwrap();
        }
        if let Some(j) = jinja {
            std::fs::write(dir.path().join("chat_template.jinja"), j).unwrap();
        }
        dir
    }

    const TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}\
<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}";

    #[test]
    fn template_from_jinja_file_and_from_named_list() {
        let msgs = [Message::new("user", "hi")];
        let a = dir_with(None, Some(TEMPLATE));
        let tok = ChatTokenizer::load(a.path()).unwrap();
        assert_eq!(
            tok.render(&msgs, true, false).unwrap(),
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        );
        assert!(
            tok.render(&msgs, true, true)
                .unwrap()
                .ends_with("assistant\n<think>\n")
        );
        let b = dir_with(
            Some(
                serde_json::json!({"chat_template": [{"name": "tool_use", "template": "x"},
                                                       {"name": "default", "template": TEMPLATE}]}),
            ),
            None,
        );
        let tok_b = ChatTokenizer::load(b.path()).unwrap();
        assert_eq!(
            tok_b.render(&msgs, true, true).unwrap(),
            tok.render(&msgs, true, true).unwrap()
        );
    }

    #[test]
    fn python_string_methods_and_missing_template() {
        let a = dir_with(None, Some("{{ messages[0].content.strip().upper() }}"));
        let tok = ChatTokenizer::load(a.path()).unwrap();
        assert_eq!(
            tok.render(&[Message::new("user", "  hi ")], false, false)
                .unwrap(),
            "HI"
        );
        let none = dir_with(None, None);
        let err = ChatTokenizer::load(none.path())
            .unwrap()
            .render(&[], true, false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("chat_template"), "{err}");
    }
}
