//! FLOPs of a run, counted from the config: the useful work of the model under the DeltaNet form that ran.
//!
//! Matrix products only (as the usual "2 × parameters per token" counts): a product of an `m×k` and a `k×n` matrix
//! is `2·m·k·n` FLOPs; norms, activations, the convolution, softmax and element-wise updates are left out (each is
//! linear in the width and under 1% of the total at the 9B's sizes).
//!
//! Per token, every layer's projections: `2·in·out` for each weight of the projection role (`in_proj_qkv`,
//! `in_proj_z`, `in_proj_b`, `in_proj_a`, `out_proj`; `q_proj` (query and gate), `k_proj`, `v_proj`, `o_proj`;
//! `gate_proj`, `up_proj`, `down_proj`; in an MoE layer the router, the shared expert and its gate, and `k` of the
//! `E` routed experts: each expert's projections count `k/E` of a token, [`token_share`]). The LM head, `2·H·V`, once per forward call (only the last position's
//! logits are computed). Full attention, for a query that sees `L` keys (itself and every earlier token):
//! `4·Hq·D·L` (scores and the weighted sum of values; the causal half only). DeltaNet, per value head (`Dk`, `Dv`):
//! - sequential and matrix forms: `6·Dk·Dv` per token (`Sᵀk`, `k·deltaᵀ`, `Sᵀq`);
//! - chunked, per chunk of `C` tokens (the last chunk padded to `C`, as it runs):
//!   `4·C²·Dk` (`KKᵀ`, `QKᵀ`) + `4·C²·Dv` (the inverse applied, the intra-chunk output) + `6·C·Dk·Dv` (`K·S0`,
//!   `Q·S0`, the state update), plus the triangular inverse: `C²·(C−1)` by forward substitution, `4·C³` per
//!   doubling pass (`⌈log2 C⌉` passes), `4·C³` per series pass (`⌈log2 C⌉ − 1` passes).

use reference::config::{Config, LayerKind};
use reference::deltanet::{Form, Inverse};
use reference::schema::{Param, Role, Schema};

/// FLOPs by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Flops {
    /// The layers' projections.
    pub projections: f64,
    /// The LM head.
    pub lm_head: f64,
    /// Full attention's scores and weighted values.
    pub attention: f64,
    /// The DeltaNet recurrence.
    pub deltanet: f64,
}

impl Flops {
    /// Every kind together.
    pub fn total(&self) -> f64 {
        self.projections + self.lm_head + self.attention + self.deltanet
    }

    fn add(&mut self, other: Flops) {
        self.projections += other.projections;
        self.lm_head += other.lm_head;
        self.attention += other.attention;
        self.deltanet += other.deltanet;
    }
}

/// How a backend runs a sequence: the DeltaNet forms and how the prompt is cut into forward calls.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunShape {
    /// The form of forward calls of more than one token.
    pub prefill: Form,
    /// The form of single-token calls.
    pub decode: Form,
    /// The prompt runs in forward calls of at most this many tokens (`None`: one call).
    pub piece: Option<usize>,
}

/// The share of a token's work a parameter's product takes: `k/E` for a routed expert's projections (a token runs
/// `k` of the `E` experts of its layer), 1 for every other parameter.
pub fn token_share(c: &Config, param: Param) -> f64 {
    match (param, &c.moe) {
        (Param::ExpertGateProj(_) | Param::ExpertUpProj(_) | Param::ExpertDownProj(_), Some(m)) => {
            m.num_experts_per_tok as f64 / m.num_experts as f64
        }
        _ => 1.0,
    }
}

/// Projection FLOPs of one token through every layer (an MoE layer's `k` routed experts, not all `E`).
pub fn projections_per_token(c: &Config) -> f64 {
    let schema = Schema::new(c);
    (0..c.num_layers())
        .flat_map(|i| schema.layer_tensors(i))
        .filter(|t| t.role() == Role::Projection)
        .map(|t| 2.0 * t.shape.iter().product::<usize>() as f64 * token_share(c, t.param))
        .sum()
}

/// DeltaNet FLOPs of one value head over `t` tokens in `form`.
fn deltanet_head(form: Form, t: usize, dk: f64, dv: f64) -> f64 {
    match form {
        Form::Sequential | Form::Matrix => 6.0 * dk * dv * t as f64,
        Form::Chunked { block, inverse } => {
            let chunks = t.div_ceil(block) as f64;
            let c = block as f64;
            let passes = (block.max(1) as f64).log2().ceil();
            let inverse = match inverse {
                Inverse::Substitution => c * c * (c - 1.0),
                Inverse::Doubling => 4.0 * c * c * c * passes,
                Inverse::Series => 4.0 * c * c * c * (passes - 1.0).max(0.0),
            };
            chunks * (4.0 * c * c * (dk + dv) + 6.0 * c * dk * dv + inverse)
        }
    }
}

/// FLOPs of one forward call of `t` tokens after `past` tokens, in `form` (the LM head on its last position).
pub fn forward(c: &Config, form: Form, past: usize, t: usize) -> Flops {
    let linear = c
        .layer_types
        .iter()
        .filter(|k| **k == LayerKind::Linear)
        .count() as f64;
    let full = c.num_layers() as f64 - linear;
    let (dk, dv) = (c.linear_key_head_dim as f64, c.linear_value_head_dim as f64);
    // Σ over the call's queries of the keys each sees: past + 1, …, past + t.
    let keys = (t * past) as f64 + (t * (t + 1) / 2) as f64;
    Flops {
        projections: projections_per_token(c) * t as f64,
        lm_head: 2.0 * (c.hidden_size * c.vocab_size) as f64,
        attention: full * 4.0 * (c.num_attention_heads * c.head_dim) as f64 * keys,
        deltanet: linear * c.linear_num_value_heads as f64 * deltanet_head(form, t, dk, dv),
    }
}

/// FLOPs of a prompt of `t` tokens from position 0, in forward calls as `run` cuts it.
pub fn prompt(c: &Config, run: &RunShape, t: usize) -> Flops {
    let piece = run.piece.unwrap_or(t).max(1);
    let mut total = Flops::default();
    let mut past = 0;
    while past < t {
        let n = piece.min(t - past);
        let form = if n == 1 { run.decode } else { run.prefill };
        total.add(forward(c, form, past, n));
        past += n;
    }
    total
}

/// FLOPs of `n` single-token decode calls after a prompt of `prompt` tokens.
pub fn decode(c: &Config, run: &RunShape, prompt: usize, n: usize) -> Flops {
    let mut total = Flops::default();
    for i in 0..n {
        total.add(forward(c, run.decode, prompt + i, 1));
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;
    use reference::synthetic::small_config_json;

    fn config() -> Config {
        Config::from_json_str(&small_config_json().to_string(), "small").unwrap()
    }

    #[test]
    fn projections_count_two_flops_per_weight() {
        let c = config();
        // hidden 32, FFN 48; linear layers: qkv (2·2·8 + 4·12 = 80), z 48, b 4, a 4, out 48 (all × 32);
        // attention layers: q 4·16·2 = 128, k 32, v 32, o 64 (× 32); MLP 3 · 48 · 32 per layer.
        let linear = (80 + 48 + 4 + 4 + 48) * 32;
        let attention = (128 + 32 + 32 + 64) * 32;
        let mlp = 3 * 48 * 32;
        let expected = 2 * (2 * linear + 2 * attention + 4 * mlp);
        assert_eq!(projections_per_token(&c), expected as f64);
    }

    #[test]
    fn an_moe_token_counts_k_of_the_e_experts() {
        let c = Config::from_file(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../testdata/models/tiny-moe/config.json"),
        )
        .unwrap();
        // hidden 32; linear layers: qkv (2·2·16 + 4·8 = 96), z 32, b 4, a 4, out 32 (all × 32); the attention layer:
        // q 2·32·2 = 128, k 32, v 32, o 64 (× 32); per layer the router 8 × 32, the shared expert 3 · 24 · 32 and
        // its gate 32, and 3 of the 8 experts of 3 · 16 · 32.
        let linear = (96 + 32 + 4 + 4 + 32) * 32;
        let attention = (128 + 32 + 32 + 64) * 32;
        let moe = 8 * 32 + 3 * 24 * 32 + 32;
        let experts = 3.0 / 8.0 * (8 * 3 * 16 * 32) as f64;
        let expected = 2.0 * ((3 * linear + attention + 4 * moe) as f64 + 4.0 * experts);
        assert_eq!(projections_per_token(&c), expected);
        assert_eq!(token_share(&c, Param::ExpertUpProj(7)), 3.0 / 8.0);
        assert_eq!(token_share(&c, Param::SharedUpProj), 1.0);
    }

    #[test]
    fn attention_counts_the_causal_keys() {
        let c = config();
        let f = forward(&c, Form::Matrix, 3, 2);
        // Two full-attention layers, 4 heads of 16; the queries see 4 and 5 keys.
        assert_eq!(f.attention, 2.0 * 4.0 * 64.0 * 9.0);
        // One call, one LM head.
        assert_eq!(f.lm_head, 2.0 * 32.0 * 97.0);
    }

    #[test]
    fn chunked_counts_padded_chunks_and_the_inverse() {
        let (dk, dv) = (8.0, 12.0);
        let sub = |block| Form::Chunked {
            block,
            inverse: Inverse::Substitution,
        };
        // 10 tokens in chunks of 4: three chunks, the last padded.
        let per_chunk = 4.0 * 16.0 * 20.0 + 6.0 * 4.0 * 96.0 + 16.0 * 3.0;
        assert_eq!(deltanet_head(sub(4), 10, dk, dv), 3.0 * per_chunk);
        let doubling = Form::Chunked {
            block: 4,
            inverse: Inverse::Doubling,
        };
        let series = Form::Chunked {
            block: 4,
            inverse: Inverse::Series,
        };
        let base = 4.0 * 16.0 * 20.0 + 6.0 * 4.0 * 96.0;
        assert_eq!(deltanet_head(doubling, 4, dk, dv), base + 2.0 * 4.0 * 64.0);
        assert_eq!(deltanet_head(series, 4, dk, dv), base + 4.0 * 64.0);
        assert_eq!(
            deltanet_head(Form::Sequential, 10, dk, dv),
            10.0 * 6.0 * 96.0
        );
    }

    #[test]
    fn a_prompt_in_pieces_pays_the_lm_head_per_piece() {
        let c = config();
        let whole = RunShape {
            prefill: Form::Sequential,
            decode: Form::Matrix,
            piece: None,
        };
        let pieces = RunShape {
            piece: Some(4),
            ..whole
        };
        let a = prompt(&c, &whole, 10);
        let b = prompt(&c, &pieces, 10);
        assert_eq!(a.projections, b.projections);
        assert_eq!(a.attention, b.attention);
        assert_eq!(a.deltanet, b.deltanet);
        assert_eq!(b.lm_head, 3.0 * a.lm_head);
        let d = decode(&c, &whole, 10, 2);
        assert_eq!(d.lm_head, 2.0 * a.lm_head);
        assert_eq!(d.attention, 2.0 * 4.0 * 64.0 * (11.0 + 12.0));
    }
}
