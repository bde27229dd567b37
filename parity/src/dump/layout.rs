//! The tensors of a dump, known before the run: their names, dtypes and shapes follow from the config, the prompt's
//! length and the run's dtype (see [`super::FORMAT`]), so a dump can be laid out on disk before the first forward
//! call. Only `generated` is left out: how many tokens a run generates is known at its end.

use candle_core::DType;
use reference::config::{Config, LayerKind};
use reference::model::state_names;
use reference::taps::names;

/// One tensor of a dump, as planned before the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    /// The dump's name for it.
    pub name: String,
    /// Its dtype.
    pub dtype: DType,
    /// Its shape (token-major for the taps and the logits: `[T, …]`).
    pub shape: Vec<usize>,
}

/// Every tensor of a dump of `tokens` prompt tokens on `config` but `generated`: `token_ids` (i64), every tap and
/// the logits in `dtype` (an MoE block's `experts_chosen` in i64), and, when `states` (a backend that exposes its
/// state), the states after the prompt in `dtype`.
pub fn planned(config: &Config, tokens: usize, dtype: DType, states: bool) -> Vec<Planned> {
    let c = config;
    let (h, t) = (c.hidden_size, tokens);
    let (hk, dk) = (c.linear_num_key_heads, c.linear_key_head_dim);
    let (hv, dv) = (c.linear_num_value_heads, c.linear_value_head_dim);
    let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let conv = c.linear_conv_dim();
    let mut out = vec![Planned {
        name: "token_ids".into(),
        dtype: DType::I64,
        shape: vec![t],
    }];
    let mut indices = Vec::new();
    let mut put = |name: String, shape: Vec<usize>| {
        out.push(Planned { name, dtype, shape });
    };
    put(names::EMBEDDINGS.into(), vec![t, h]);
    for (i, kind) in c.layer_types.iter().enumerate() {
        for tap in [names::OUTPUT, names::MIXER_OUTPUT, names::MLP_OUTPUT] {
            put(names::layer(i, tap), vec![t, h]);
        }
        let (mixer, taps): (&str, &[&str]) = match kind {
            LayerKind::Linear => (names::LINEAR_ATTN, &names::LINEAR_ATTN_TAPS),
            LayerKind::Full => (names::SELF_ATTN, &names::SELF_ATTN_TAPS),
        };
        for &tap in taps {
            let row = match (kind, tap) {
                (LayerKind::Linear, names::QKV | names::CONV_OUTPUT) => vec![conv],
                (LayerKind::Linear, names::B | names::A | names::G | names::BETA) => vec![hv],
                (
                    LayerKind::Linear,
                    names::QUERY | names::KEY | names::QUERY_NORMED | names::KEY_NORMED,
                ) => vec![hk, dk],
                (LayerKind::Linear, _) => vec![hv, dv],
                (LayerKind::Full, names::QUERY) => vec![hq, d],
                (LayerKind::Full, names::KEY | names::VALUE) => vec![hkv, d],
                (LayerKind::Full, _) => vec![hq * d],
            };
            let mut shape = vec![t];
            shape.extend(row);
            put(names::layer(i, &names::mixer(mixer, tap)), shape);
        }
        if let Some(moe) = &c.moe {
            // The MoE block's taps: the router's logits, the chosen experts (i64), their weights, the shared output.
            let (e, k) = (moe.num_experts, moe.num_experts_per_tok);
            let mlp = |tap| names::layer(i, &names::mixer(names::MLP, tap));
            put(mlp(names::ROUTER_LOGITS), vec![t, e]);
            put(mlp(names::EXPERT_WEIGHTS), vec![t, k]);
            put(mlp(names::SHARED_OUTPUT), vec![t, h]);
            indices.push(Planned {
                name: mlp(names::EXPERTS_CHOSEN),
                dtype: DType::I64,
                shape: vec![t, k],
            });
        }
        if states {
            let [a, b] = state_names(i, *kind);
            let (sa, sb) = match kind {
                LayerKind::Linear => (vec![conv, c.linear_conv_kernel_dim], vec![hv, dk, dv]),
                LayerKind::Full => (vec![hkv, t, d], vec![hkv, t, d]),
            };
            put(a, sa);
            put(b, sb);
        }
    }
    put(names::FINAL_NORM.into(), vec![t, h]);
    put(names::LOGITS.into(), vec![t, c.vocab_size]);
    out.extend(indices);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tiny_models_dump_is_planned_with_the_formats_names_and_shapes() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/models/tiny");
        let config = Config::from_file(&dir.join("config.json")).unwrap();
        let plan = planned(&config, 5, DType::F32, true);
        let get = |n: &str| plan.iter().find(|p| p.name == n).unwrap();
        assert_eq!(get("token_ids").dtype, DType::I64);
        assert_eq!(get("layers.0.linear_attn.qkv").shape, [5, 160]);
        assert_eq!(get("layers.0.linear_attn.z").shape, [5, 4, 24]);
        assert_eq!(get("layers.0.recurrent_state").shape, [4, 16, 24]);
        assert_eq!(get("layers.0.conv_state").shape, [160, 4]);
        assert_eq!(get("layers.3.key_cache").shape, [2, 5, 32]);
        let without = planned(&config, 5, DType::F32, false);
        assert_eq!(plan.len() - without.len(), 2 * config.num_layers());
    }

    #[test]
    fn an_moe_models_dump_holds_its_routing() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/models/tiny-moe");
        let config = Config::from_file(&dir.join("config.json")).unwrap();
        let plan = planned(&config, 5, DType::F64, false);
        let get = |n: &str| plan.iter().find(|p| p.name == n).unwrap();
        assert_eq!(get("layers.3.mlp.router_logits").shape, [5, 8]);
        assert_eq!(get("layers.3.mlp.router_logits").dtype, DType::F64);
        assert_eq!(get("layers.0.mlp.experts_chosen").shape, [5, 3]);
        assert_eq!(get("layers.0.mlp.experts_chosen").dtype, DType::I64);
        assert_eq!(get("layers.1.mlp.expert_weights").shape, [5, 3]);
        assert_eq!(get("layers.2.mlp.shared_output").shape, [5, 32]);
    }
}
