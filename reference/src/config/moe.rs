//! The MoE decoder's fields (transformers' `Qwen3_5MoeTextConfig`: `num_experts`, `num_experts_per_tok`,
//! `moe_intermediate_size`, `shared_expert_intermediate_size`), read from a `qwen3_5_moe` / `qwen3_5_moe_text` config.

use super::Fields;
use crate::error::Result;

/// The sparse MoE block of every layer (transformers' `Qwen3_5MoeSparseMoeBlock`): a router over `num_experts`
/// SiLU-gated experts, the top `num_experts_per_tok` of them run with their probabilities renormalised to sum 1
/// (transformers always renormalises: its config has no switch), plus a shared expert scaled by a sigmoid gate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeConfig {
    /// Routed experts per layer (`num_experts`, `E`).
    pub num_experts: usize,
    /// Experts run per token (`num_experts_per_tok`, `k`), at most `E`.
    pub num_experts_per_tok: usize,
    /// Each routed expert's inner width (`moe_intermediate_size`).
    pub moe_intermediate_size: usize,
    /// The shared expert's inner width (`shared_expert_intermediate_size`).
    pub shared_expert_intermediate_size: usize,
}

/// The dense MLP's `intermediate_size`: read in a dense decoder, 0 in an MoE one (which has no dense MLP; an
/// `intermediate_size` some exports carry there is read by no layer, here or in transformers).
pub(super) fn dense_width(f: &Fields, moe: Option<&MoeConfig>) -> Result<usize> {
    match moe {
        Some(_) => Ok(0),
        None => f.usize("intermediate_size"),
    }
}

/// Whether a nested config of outer `model_type` (`qwen3_5` or `qwen3_5_moe`) is the MoE decoder, after checking
/// that its `text_config.model_type`, when given, is the one that outer type takes.
pub(super) fn nested_text_type(inner: &Fields, model_type: &str) -> Result<bool> {
    let moe = model_type == "qwen3_5_moe";
    let text_type = if moe {
        "qwen3_5_moe_text"
    } else {
        "qwen3_5_text"
    };
    if let Some(t) = inner.map.get("model_type")
        && t.as_str() != Some(text_type)
    {
        return Err(inner.err(
            "model_type",
            format!("is {t} under a `{model_type}` config, which takes `{text_type}`"),
        ));
    }
    Ok(moe)
}

/// The MoE block's fields of an MoE decoder's config; in a dense one, any of them is an error (a config whose
/// `model_type` says dense but which describes experts has been edited wrongly).
pub(super) fn fields(f: &Fields, moe: bool) -> Result<Option<MoeConfig>> {
    const KEYS: [&str; 4] = [
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
    ];
    if !moe {
        if let Some(key) = KEYS.iter().find(|k| f.map.contains_key(**k)) {
            return Err(f.err(
                key,
                "describes MoE experts, but the model_type is a dense Qwen3.5 decoder (the MoE one is \
                 `qwen3_5_moe` or `qwen3_5_moe_text`)",
            ));
        }
        return Ok(None);
    }
    let m = MoeConfig {
        num_experts: f.usize("num_experts")?,
        num_experts_per_tok: f.usize("num_experts_per_tok")?,
        moe_intermediate_size: f.usize("moe_intermediate_size")?,
        shared_expert_intermediate_size: f.usize("shared_expert_intermediate_size")?,
    };
    if m.num_experts_per_tok > m.num_experts {
        return Err(f.err(
            "num_experts_per_tok",
            format!(
                "{} experts per token but only {} experts (num_experts)",
                m.num_experts_per_tok, m.num_experts
            ),
        ));
    }
    // transformers' Qwen3.5-MoE renormalises the top-k probabilities unconditionally and runs the sparse block
    // in every layer; a config asking otherwise describes another model.
    if let Some(v) = f.map.get("norm_topk_prob")
        && v.as_bool() != Some(true)
    {
        return Err(f.err(
            "norm_topk_prob",
            format!("is {v}: Qwen3.5-MoE always renormalises the chosen experts' weights"),
        ));
    }
    if let Some(v) = f.map.get("mlp_only_layers")
        && v.as_array().is_none_or(|a| !a.is_empty())
    {
        return Err(f.err(
            "mlp_only_layers",
            format!("is {v}: every Qwen3.5-MoE layer has the sparse block, none a dense MLP"),
        ));
    }
    if let Some(v) = f.map.get("decoder_sparse_step")
        && v.as_u64() != Some(1)
    {
        return Err(f.err(
            "decoder_sparse_step",
            format!("is {v}: every Qwen3.5-MoE layer has the sparse block (a step of 1)"),
        ));
    }
    // An `intermediate_size` some exports carry is read by no layer here (nor by transformers' MoE decoder).
    Ok(Some(m))
}

#[cfg(test)]
mod tests {
    use super::super::tests::{expect_err, flat, parse};
    use super::*;
    use serde_json::Value;

    /// The MoE decoder's flat config: the dense one's fields without `intermediate_size`, with the experts'.
    fn moe_flat() -> Value {
        let mut v = flat();
        let m = v.as_object_mut().unwrap();
        m.remove("intermediate_size");
        m.insert("model_type".into(), "qwen3_5_moe_text".into());
        m.insert("num_experts".into(), 8.into());
        m.insert("num_experts_per_tok".into(), 3.into());
        m.insert("moe_intermediate_size".into(), 24.into());
        m.insert("shared_expert_intermediate_size".into(), 40.into());
        v
    }

    #[test]
    fn moe_configs_are_read_in_both_forms() {
        let a = parse(&moe_flat()).unwrap();
        assert_eq!(
            a.moe,
            Some(MoeConfig {
                num_experts: 8,
                num_experts_per_tok: 3,
                moe_intermediate_size: 24,
                shared_expert_intermediate_size: 40,
            })
        );
        assert_eq!(a.intermediate_size, 0);
        let nested = serde_json::json!({
            "model_type": "qwen3_5_moe", "tie_word_embeddings": false, "text_config": moe_flat()
        });
        let mut b = parse(&nested).unwrap();
        b.nested = false;
        assert_eq!(a, b);
        // What some exports add and transformers' MoE decoder reads nowhere, or holds at what it does anyway.
        let mut v = moe_flat();
        v["intermediate_size"] = 5120.into();
        v["norm_topk_prob"] = true.into();
        v["decoder_sparse_step"] = 1.into();
        v["mlp_only_layers"] = serde_json::json!([]);
        assert_eq!(parse(&v).unwrap(), a);
        assert_eq!(parse(&flat()).unwrap().moe, None);
    }

    #[test]
    fn missing_and_inconsistent_moe_fields_are_named() {
        for key in [
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
        ] {
            let mut v = moe_flat();
            v.as_object_mut().unwrap().remove(key);
            expect_err(v, key);
            let mut v = moe_flat();
            v[key] = 0.into();
            expect_err(v, key);
        }
        let mut v = moe_flat();
        v["num_experts_per_tok"] = 9.into();
        expect_err(v, "num_experts_per_tok");
        let mut v = moe_flat();
        v["norm_topk_prob"] = false.into();
        expect_err(v, "norm_topk_prob");
        let mut v = moe_flat();
        v["mlp_only_layers"] = serde_json::json!([1]);
        expect_err(v, "mlp_only_layers");
        let mut v = moe_flat();
        v["decoder_sparse_step"] = 2.into();
        expect_err(v, "decoder_sparse_step");
        // A dense model_type with experts, and an MoE outer config over a dense text config.
        let mut v = moe_flat();
        v["model_type"] = "qwen3_5_text".into();
        expect_err(v, "num_experts");
        let nested = serde_json::json!({
            "model_type": "qwen3_5_moe", "tie_word_embeddings": false,
            "text_config": dict_with(moe_flat(), "model_type", "qwen3_5_text")
        });
        expect_err(nested, "text_config.model_type");
    }

    fn dict_with(mut v: Value, key: &str, value: &str) -> Value {
        v[key] = value.into();
        v
    }
}
