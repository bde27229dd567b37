//! A long prompt against transformers: 1000 tokens of plain text on the tiny model (`goldens/tiny.long.safetensors`,
//! `scripts/make_long_golden.py`), far past the chat prompts' 100 to 160. In blocks of 64 (15 full and a padded one
//! of 40), sequentially, and in blocks of 64 with the prompt fed in pieces of 100 (prefill across calls): every layer
//! output, every state after the prompt and the logits at all 1000 positions within the chat goldens' tolerances,
//! and the same 16 greedy tokens.

use crate::common::testdata;
use crate::goldens::{f32_run_matches, ids_of, load_golden};
use candle_core::DType;
use reference::deltanet::{Form, Inverse};
use reference::model::{Model, RunOptions};

#[test]
fn a_thousand_token_prompt_matches_transformers() {
    let golden = load_golden(&testdata().join("goldens/tiny.long.safetensors"));
    let ids = ids_of(&golden.tensors["token_ids"]);
    assert_eq!(ids.len(), 1000);
    let model = Model::load(&testdata().join("models/tiny"), DType::F32).unwrap();
    let chunked = |block| Form::Chunked {
        block,
        inverse: Inverse::Substitution,
    };
    let forms = [
        RunOptions {
            prefill: chunked(64),
            ..RunOptions::default()
        },
        RunOptions {
            prefill: Form::Sequential,
            decode: Form::Sequential,
            ..RunOptions::default()
        },
        RunOptions {
            prefill: chunked(64),
            prefill_block: Some(100),
            ..RunOptions::default()
        },
    ];
    for opts in forms {
        let label = format!(
            "tiny, 1000 tokens, prefill {} in pieces of {:?}",
            opts.prefill.describe(),
            opts.prefill_block
        );
        f32_run_matches(&label, &model, &ids, &opts, &golden);
    }
}
