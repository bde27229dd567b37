//! A dump written from llama.cpp's evaluation callback (`cb_eval`, e.g. by `scripts/llama_dump.cpp`) read as a dump
//! of this project: llama.cpp's graph names mapped to the dump's names, one place, on read (see `docs/llamacpp.md`).
//!
//! The map (llama.cpp name → dump name):
//!
//! | llama.cpp            | dump                  |
//! | -------------------- | --------------------- |
//! | `model.input_embed`  | `embeddings`          |
//! | `l_out-{i}`          | `layers.{i}.output`   |
//! | `result_norm`        | `final_norm`          |
//! | `logits`             | `logits`              |
//! | `result_output`      | `logits` (when `logits` is absent) |
//! | metadata `token_ids` | `token_ids` (i64)     |
//!
//! ggml's `ne` is innermost first (`ne = [H, T]`); the writer stores the reversed order, row-major, so the tensors
//! are already token-major `[T, H]`: their shape is checked, not transposed. Every other tensor of llama.cpp's graph
//! is dropped (its count is the metadata `llama_cpp_unmapped`): their meaning differs from the dump's taps.

use anyhow::{Result, bail};
use candle_core::Tensor;
use std::collections::BTreeMap;
use std::path::Path;

/// Whether the names are llama.cpp's: it holds `model.input_embed`, `result_norm` or an `l_out-{i}`.
pub fn is_llamacpp(tensors: &BTreeMap<String, Tensor>) -> bool {
    tensors.keys().any(|k| {
        k == "model.input_embed"
            || k == "result_norm"
            || k.strip_prefix("l_out-")
                .is_some_and(|i| i.parse::<u64>().is_ok())
    })
}

/// The dump name of llama.cpp's `name`, if it has one (`result_output` is handled by the caller).
pub(crate) fn mapped(name: &str) -> Option<String> {
    match name {
        "model.input_embed" => Some("embeddings".into()),
        "result_norm" => Some("final_norm".into()),
        "logits" => Some("logits".into()),
        _ => {
            let i: u64 = name.strip_prefix("l_out-")?.parse().ok()?;
            Some(format!("layers.{i}.output"))
        }
    }
}

/// llama.cpp's tensors and metadata as a dump's (the map above). `path` names the file in errors.
pub fn convert(
    path: &Path,
    tensors: BTreeMap<String, Tensor>,
    mut metadata: BTreeMap<String, String>,
) -> Result<(BTreeMap<String, Tensor>, BTreeMap<String, String>)> {
    let at = path.display();
    if let Some(k) = tensors
        .keys()
        .find(|k| k.as_str() == "embeddings" || k.starts_with("layers.") || k == &"final_norm")
    {
        bail!(
            "{at}: holds both llama.cpp's names and this project's (`{k}`): which is which is ambiguous"
        );
    }
    let mut out = BTreeMap::new();
    let mut unmapped = 0usize;
    let has_logits = tensors.contains_key("logits");
    for (name, t) in tensors {
        let to = match mapped(&name) {
            Some(to) => to,
            None if name == "result_output" && !has_logits => "logits".into(),
            None => {
                unmapped += 1;
                continue;
            }
        };
        if t.rank() != 2 {
            bail!(
                "{at}: llama.cpp's `{name}` (for `{to}`) should be token-major [T, width]; it is {:?}",
                t.dims()
            );
        }
        out.insert(to, t);
    }
    if let Some(ids) = metadata.get("token_ids") {
        let ids = crate::prompts::parse_token_ids(
            ids.trim().trim_start_matches('[').trim_end_matches(']'),
            "the metadata `token_ids`",
        )
        .map_err(|e| anyhow::anyhow!("{at}: {e:#}"))?;
        if let Some((name, t)) = out.iter().next()
            && t.dims()[0] != ids.len()
        {
            bail!(
                "{at}: the metadata `token_ids` has {} ids, `{name}` {} tokens",
                ids.len(),
                t.dims()[0]
            );
        }
        out.insert("token_ids".into(), super::id_tensor(&ids)?);
    }
    let tokens: BTreeMap<usize, &String> = out
        .iter()
        .filter(|(_, t)| t.rank() == 2)
        .map(|(n, t)| (t.dims()[0], n))
        .collect();
    if tokens.len() > 1 {
        bail!("{at}: llama.cpp's tensors disagree on the token count: {tokens:?}");
    }
    metadata
        .entry("backend".into())
        .or_insert_with(|| "llama.cpp".into());
    metadata.insert("llama_cpp_unmapped".into(), unmapped.to_string());
    Ok((out, metadata))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use proptest::prelude::*;

    fn t(rows: usize, cols: usize) -> Tensor {
        Tensor::zeros((rows, cols), candle_core::DType::F32, &Device::Cpu).unwrap()
    }

    proptest! {
        /// Any number of layers and tokens: every `l_out-{i}` becomes `layers.{i}.output`, the rest as the map says,
        /// nothing else kept, and the ids come from the metadata.
        #[test]
        fn names_map(layers in 1usize..40, tokens in 1usize..6, extra in 0usize..5) {
            let mut m = BTreeMap::new();
            m.insert("model.input_embed".to_string(), t(tokens, 4));
            m.insert("result_norm".to_string(), t(tokens, 4));
            m.insert("result_output".to_string(), t(tokens, 7));
            for i in 0..layers {
                m.insert(format!("l_out-{i}"), t(tokens, 4));
            }
            for i in 0..extra {
                m.insert(format!("attn_norm-{i}"), t(tokens, 4));
            }
            prop_assert!(is_llamacpp(&m));
            let ids: Vec<String> = (0..tokens).map(|i| i.to_string()).collect();
            let meta = BTreeMap::from([("token_ids".to_string(), format!("[{}]", ids.join(", ")))]);
            let (out, meta) = convert(Path::new("x"), m, meta).unwrap();
            prop_assert_eq!(out.len(), layers + 4);
            for i in 0..layers {
                let name = format!("layers.{i}.output");
                prop_assert!(out.contains_key(&name), "{}", name);
            }
            for n in ["embeddings", "final_norm", "logits", "token_ids"] {
                prop_assert!(out.contains_key(n), "{}", n);
            }
            prop_assert_eq!(out["token_ids"].dims(), &[tokens]);
            prop_assert_eq!(meta["llama_cpp_unmapped"].clone(), extra.to_string());
        }

        /// A mapped tensor of another token count than the rest, or than the ids, is refused naming the file.
        #[test]
        fn token_counts_agree(tokens in 1usize..6, other in 1usize..6) {
            prop_assume!(tokens != other);
            let m = BTreeMap::from([
                ("l_out-0".to_string(), t(tokens, 4)),
                ("l_out-1".to_string(), t(other, 4)),
            ]);
            let e = convert(Path::new("l.safetensors"), m, BTreeMap::new()).unwrap_err().to_string();
            prop_assert!(e.contains("l.safetensors") && e.contains("token count"), "{}", e);
            let m = BTreeMap::from([("l_out-0".to_string(), t(tokens, 4))]);
            let ids: Vec<String> = (0..other).map(|i| i.to_string()).collect();
            let meta = BTreeMap::from([("token_ids".to_string(), format!("[{}]", ids.join(",")))]);
            let e = convert(Path::new("l.safetensors"), m, meta).unwrap_err().to_string();
            prop_assert!(e.contains("l.safetensors") && e.contains("token_ids"), "{}", e);
        }
    }

    #[test]
    fn mixed_names_and_bad_ids_refused() {
        let m = BTreeMap::from([
            ("l_out-0".to_string(), t(2, 4)),
            ("layers.0.output".to_string(), t(2, 4)),
        ]);
        let e = convert(Path::new("m.st"), m, BTreeMap::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains("m.st") && e.contains("layers.0.output"), "{e}");
        let m = BTreeMap::from([("l_out-0".to_string(), t(2, 4))]);
        let meta = BTreeMap::from([("token_ids".to_string(), "[1, x]".to_string())]);
        let e = format!("{:#}", convert(Path::new("m.st"), m, meta).unwrap_err());
        assert!(e.contains("m.st") && e.contains("`x`"), "{e}");
        let m = BTreeMap::from([("l_out-0".to_string(), t(2, 4).reshape((2, 2, 2)).unwrap())]);
        let e = convert(Path::new("m.st"), m, BTreeMap::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains("l_out-0") && e.contains("[T, width]"), "{e}");
        assert!(!is_llamacpp(&BTreeMap::from([(
            "layers.0.output".to_string(),
            t(2, 4)
        )])));
    }
}
