//! What a token reads of the weights: the decoder parameters one token runs through, and the parameters and bytes
//! of the matrices a decode step multiplies (of an MoE layer's routed experts, the `k` a token runs).

use super::flops;
use anyhow::Result;
use reference::config::Config;
use reference::schema::{Param, Role, Schema, TensorSpec};
use reference::weights::WeightStore;

/// Parameters a decode step reads from memory: every projection (of an MoE layer's routed experts, the `k` a token
/// runs) and the LM head (one row of the embedding aside).
pub fn decode_weight_parameters(c: &Config) -> u64 {
    token_reads(c, decode_matrices(c).iter().map(|t| (t.param, elements(t))))
}

/// The decoder parameters one token runs through (`k` of the `E` routed experts of an MoE layer).
pub fn active_parameters(c: &Config) -> u64 {
    token_reads(
        c,
        Schema::new(c)
            .tensors()
            .iter()
            .map(|t| (t.param, elements(t))),
    )
}

/// The bytes of weights a reference decode step reads, as the store holds them (stored bf16, packed INT4/INT8
/// codes and scales, f16, or the run's dtype): of an MoE layer's routed experts, the `k` it runs.
pub fn decode_weight_bytes(c: &Config, store: &WeightStore) -> Result<u64> {
    let bytes = decode_matrices(c)
        .iter()
        .map(|t| Ok((t.param, store.linear_bytes(t)?)))
        .collect::<Result<Vec<_>>>()?;
    Ok(token_reads(c, bytes))
}

/// Of an amount per tensor (parameters or bytes), what a token reads: every tensor whole, but of the routed experts
/// (summed over every expert) `k` of the `E` of each layer, all of one size.
fn token_reads(c: &Config, amounts: impl IntoIterator<Item = (Param, u64)>) -> u64 {
    let (mut all, mut experts) = (0, 0);
    for (param, n) in amounts {
        if flops::token_share(c, param) == 1.0 {
            all += n;
        } else {
            experts += n;
        }
    }
    all + c.moe.as_ref().map_or(0, |m| {
        experts * m.num_experts_per_tok as u64 / m.num_experts as u64
    })
}

/// The elements of a tensor.
fn elements(t: &TensorSpec) -> u64 {
    t.shape.iter().product::<usize>() as u64
}

/// The matrices a decode step multiplies: every projection of every layer (every routed expert's: a step reads `k`
/// of them, [`token_reads`]), then the LM head (the embedding when they are tied).
fn decode_matrices(c: &Config) -> Vec<TensorSpec> {
    let s = Schema::new(c);
    let mut specs: Vec<TensorSpec> = (0..c.num_layers())
        .flat_map(|i| s.layer_tensors(i))
        .filter(|t| t.role() == Role::Projection)
        .collect();
    specs.push(s.global(if c.tie_word_embeddings {
        Param::EmbedTokens
    } else {
        Param::LmHead
    }));
    specs
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;
    use std::path::Path;

    fn tiny_moe() -> (Config, WeightStore) {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/models/tiny-moe");
        let c = Config::from_file(&dir.join("config.json")).unwrap();
        (c, WeightStore::open(&dir, DType::F32).unwrap())
    }

    #[test]
    fn an_moe_decode_step_reads_k_of_the_e_experts() {
        let (c, store) = tiny_moe();
        // tiny-moe (f32, hidden 32, vocabulary 512): per layer the router 8 · 32, the shared expert 3 · 24 · 32 and
        // its gate 32, and 3 of its 8 experts of 3 · 16 · 32 (the mixers as in flops' test), then the LM head.
        let linear = (96 + 32 + 4 + 4 + 32) * 32;
        let attention = (128 + 32 + 32 + 64) * 32;
        let moe = 8 * 32 + 3 * 24 * 32 + 32 + 3 * 3 * 16 * 32;
        let expected = 3 * linear + attention + 4 * moe + 512 * 32;
        assert_eq!(decode_weight_parameters(&c), expected as u64);
        assert_eq!(
            decode_weight_bytes(&c, &store).unwrap(),
            4 * expected as u64
        );
        assert_eq!(
            2 * (decode_weight_parameters(&c) - 512 * 32),
            flops::projections_per_token(&c) as u64
        );
        // Every parameter but 5 of each layer's 8 experts (and the embedding, read a row at a time, counted whole).
        let all: u64 = Schema::new(&c)
            .tensors()
            .iter()
            .map(|t| t.shape.iter().product::<usize>() as u64)
            .sum();
        assert_eq!(active_parameters(&c), all - 4 * 5 * 3 * 16 * 32);
    }
}
