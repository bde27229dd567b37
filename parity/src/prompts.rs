//! The prompts a run compares on: chat messages through the checkpoint's template, token ids, a prompt set (JSON
//! lines), the set shipped with the project, and the end-of-sequence ids.

use anyhow::{Context, Result, bail};
use reference::config::Config;
use reference::tokenizer::{ChatTokenizer, Message};
use std::path::{Path, PathBuf};

/// The prompt set shipped with the project (JSON lines), used when no prompt is given.
pub const DEFAULT_PROMPTS: &str = include_str!("../prompts/default.jsonl");

/// One prompt of a set.
#[derive(Debug, Clone, PartialEq)]
pub struct LabelledPrompt {
    /// Its label in reports.
    pub label: String,
    /// Its tokens.
    pub ids: Vec<u32>,
}

/// One chat prompt: the user message, an optional system message, thinking mode.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
pub struct ChatPrompt {
    /// The user message.
    pub prompt: String,
    /// An optional system message.
    #[serde(default)]
    pub system: Option<String>,
    /// Thinking mode (the template's `enable_thinking`).
    #[serde(default)]
    pub think: bool,
}

impl ChatPrompt {
    /// The messages, system first.
    pub fn messages(&self) -> Vec<Message> {
        let mut m = Vec::new();
        if let Some(s) = &self.system {
            m.push(Message::new("system", s));
        }
        m.push(Message::new("user", &self.prompt));
        m
    }

    /// The token ids through the checkpoint's tokenizer and chat template.
    pub fn encode(&self, dir: &Path) -> Result<Vec<u32>> {
        let tok = ChatTokenizer::load(dir)?;
        Ok(tok.encode_chat(&self.messages(), self.think)?)
    }
}

/// Where a run's prompts come from.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptSource {
    /// Token ids (`--token-ids`).
    Ids(Vec<u32>),
    /// A chat message (`--prompt`, `--system`, `--think`).
    Chat(ChatPrompt),
    /// A prompt set file (`--prompts FILE.jsonl`).
    File(PathBuf),
    /// The set shipped with the project.
    Default,
}

impl PromptSource {
    /// The prompts, each checked against the vocabulary of `config`; `dir` is the checkpoint (its tokenizer).
    pub fn load(&self, dir: &Path, config: &Config) -> Result<Vec<LabelledPrompt>> {
        let set = match self {
            PromptSource::Ids(ids) => vec![LabelledPrompt {
                label: "token ids".into(),
                ids: ids.clone(),
            }],
            PromptSource::Chat(chat) => vec![LabelledPrompt {
                label: truncate(&chat.prompt, 32),
                ids: chat.encode(dir)?,
            }],
            PromptSource::File(path) => {
                let text = reference::inputs::read_to_string(path)
                    .with_context(|| format!("--prompts {}", path.display()))?;
                read_prompt_set(&text, &path.display().to_string(), dir)?
            }
            PromptSource::Default => {
                read_prompt_set(DEFAULT_PROMPTS, "the default prompt set", dir)?
            }
        };
        for p in &set {
            config
                .check_token_ids(&p.ids)
                .with_context(|| format!("prompt `{}`", p.label))?;
        }
        Ok(set)
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PromptLine {
    label: Option<String>,
    prompt: Option<String>,
    system: Option<String>,
    #[serde(default)]
    think: bool,
    token_ids: Option<Vec<u32>>,
}

/// Reads a prompt set (JSON lines); `source` names it in errors, `model` is the checkpoint (its tokenizer).
pub fn read_prompt_set(text: &str, source: &str, model: &Path) -> Result<Vec<LabelledPrompt>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = || format!("{source}:{}", i + 1);
        let p: PromptLine = serde_json::from_str(line).with_context(at)?;
        let label = p
            .label
            .clone()
            .unwrap_or_else(|| format!("#{}", out.len() + 1));
        let ids = match (p.prompt, p.token_ids) {
            (Some(prompt), None) => ChatPrompt {
                prompt,
                system: p.system,
                think: p.think,
            }
            .encode(model)
            .with_context(at)?,
            (None, Some(ids)) if p.system.is_none() && !p.think => ids,
            _ => bail!(
                "{}: give either \"prompt\" (with optional \"system\", \"think\") or \"token_ids\"",
                at()
            ),
        };
        if ids.is_empty() {
            bail!("{}: the prompt has no tokens", at());
        }
        out.push(LabelledPrompt { label, ids });
    }
    if out.is_empty() {
        bail!("{source}: no prompts");
    }
    Ok(out)
}

/// `s` cut to `n` characters (with an ellipsis when cut).
pub fn truncate(s: &str, n: usize) -> String {
    match s.char_indices().nth(n) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// Parses a list of token ids, `1,2,3`; `flag` names it in errors.
pub fn parse_token_ids(text: &str, flag: &str) -> Result<Vec<u32>> {
    let ids = text
        .split(',')
        .map(str::trim)
        .map(|s| {
            s.parse::<u32>()
                .map_err(|_| anyhow::anyhow!("{flag}: `{s}` is not a token id"))
        })
        .collect::<Result<Vec<_>>>()?;
    if ids.is_empty() {
        bail!("{flag}: no ids given");
    }
    Ok(ids)
}

/// The end-of-sequence ids: the config's and the tokenizer's stop tokens (when the checkpoint has a tokenizer).
pub fn eos_ids(dir: &Path, config: &Config) -> Vec<u32> {
    let mut eos = config.eos_token_ids.clone();
    if let Ok(tok) = ChatTokenizer::load(dir) {
        eos.extend(tok.stop_ids());
    }
    eos.sort_unstable();
    eos.dedup();
    eos
}

/// A prompt that repeats itself, on which prompt lookup's drafts hit: a chat message that says one thing four
/// times (the first prompt's first tokens four times when the checkpoint has no tokenizer).
pub fn repeated_prompt(dir: &Path, set: &[LabelledPrompt]) -> Result<LabelledPrompt> {
    let ids = match ChatTokenizer::load(dir) {
        Ok(tok) => {
            let text = "the cat sat on the mat. ".repeat(4);
            tok.encode_chat(&[Message::new("user", text.trim())], false)?
        }
        Err(_) => {
            let head = &set[0].ids[..set[0].ids.len().min(8)];
            head.repeat(4)
        }
    };
    Ok(LabelledPrompt {
        label: "repeated".into(),
        ids,
    })
}
