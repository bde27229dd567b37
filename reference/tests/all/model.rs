//! Whole-model properties on random checkpoints: the ways of feeding a prompt all give the same numbers.

use crate::common::*;
use candle_core::{DType, Tensor};
use proptest::prelude::*;
use reference::deltanet::{Form, Inverse};
use reference::model::{LayerState, Model, RunOptions, State};
use reference::synthetic::{Rng, small_config_json, write_checkpoint};
use reference::taps::Taps;

/// A random checkpoint written to a temporary directory and loaded in `dtype`.
pub fn random_model(
    config: &serde_json::Value,
    seed: u64,
    dtype: DType,
) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), config, seed).unwrap();
    let model = Model::load(dir.path(), dtype).unwrap();
    (dir, model)
}

fn random_ids(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

/// Every state tensor of two runs agrees.
fn assert_states_close(a: &State, b: &State, rtol: f64) {
    assert_eq!(a.position, b.position);
    for (i, (x, y)) in a.layers.iter().zip(&b.layers).enumerate() {
        match (x, y) {
            (LayerState::Linear(x), LayerState::Linear(y)) => {
                assert_close(&format!("layer {i} conv state"), &x.conv, &y.conv, rtol);
                assert_close(
                    &format!("layer {i} recurrent state"),
                    &x.recurrent,
                    &y.recurrent,
                    rtol,
                );
            }
            (LayerState::Attention(x), LayerState::Attention(y)) => {
                assert_close(
                    &format!("layer {i} keys"),
                    x.keys.as_ref().unwrap(),
                    y.keys.as_ref().unwrap(),
                    rtol,
                );
                assert_close(
                    &format!("layer {i} values"),
                    x.values.as_ref().unwrap(),
                    y.values.as_ref().unwrap(),
                    rtol,
                );
            }
            _ => panic!("layer {i}: state kinds differ"),
        }
    }
}

/// Logits `[T, V]` and state of one run of `ids` fed in pieces of `block` tokens.
fn run_blocks(model: &Model, ids: &[u32], opts: &RunOptions) -> (Tensor, State) {
    let mut state = model.new_state().unwrap();
    let mut taps = Taps::on();
    model.prefill(ids, &mut state, opts, &mut taps).unwrap();
    (taps.get("logits").unwrap().clone(), state)
}

/// A random small config: Hv/Hk and H/Hkv in {1, 2, 4}, Dk ≠ Dv, conv widths 1 to 6, any layer pattern.
fn config_strategy() -> impl Strategy<Value = serde_json::Value> {
    (
        (
            prop::sample::select(vec![1usize, 2, 4]),
            prop::sample::select(vec![1usize, 2]),
            prop::sample::select(vec![1usize, 2, 4]),
        ),
        4usize..=12,
        4usize..=12,
        prop::collection::vec(any::<bool>(), 2..=4),
        prop::sample::select(vec![0.25f64, 0.5, 1.0]),
        1usize..=6,
    )
        .prop_map(|((ratio, hk, group), dk, dv, kinds, partial, conv)| {
            let mut c = small_config_json();
            c["linear_conv_kernel_dim"] = conv.into();
            c["linear_num_key_heads"] = hk.into();
            c["linear_num_value_heads"] = (hk * ratio).into();
            c["linear_key_head_dim"] = dk.into();
            c["linear_value_head_dim"] = dv.into();
            c["num_key_value_heads"] = 1.into();
            c["num_attention_heads"] = group.into();
            c["num_hidden_layers"] = kinds.len().into();
            c["layer_types"] = kinds
                .iter()
                .map(|&full| {
                    if full {
                        "full_attention"
                    } else {
                        "linear_attention"
                    }
                })
                .collect::<Vec<_>>()
                .into();
            c["rope_parameters"]["partial_rotary_factor"] = partial.into();
            c["rope_parameters"]
                .as_object_mut()
                .unwrap()
                .remove("mrope_section");
            c
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Prefill of the first part then single-token decode of the rest equals one prefill of everything, logits
    /// and states; and any prefill block size gives the same as the whole prompt at once.
    #[test]
    fn prefill_then_decode_equals_one_prefill(config in config_strategy(), seed in any::<u64>(), t in 2usize..40, split in 1usize..40, block in 1usize..17) {
        let (_dir, model) = random_model(&config, seed, DType::F64);
        let ids = random_ids(seed, t, model.config().vocab_size);
        let split = split.min(t - 1);
        let opts = RunOptions::default();
        let (whole, whole_state) = run_blocks(&model, &ids, &opts);

        let mut state = model.new_state().unwrap();
        let mut taps = Taps::on();
        model.prefill(&ids[..split], &mut state, &opts, &mut taps).unwrap();
        for &id in &ids[split..] {
            model.forward(&[id], &mut state, &opts, &mut taps).unwrap();
        }
        prop_close("logits, prefill + decode", taps.get("logits").unwrap(), &whole, 1e-9)?;
        assert_states_close(&state, &whole_state, 1e-9);

        let blocked = RunOptions { prefill_block: Some(block), ..opts };
        let (logits, state) = run_blocks(&model, &ids, &blocked);
        prop_close("logits, prefill in blocks", &logits, &whole, 1e-9)?;
        assert_states_close(&state, &whole_state, 1e-9);
    }

    /// Every delta-rule form gives the same logits (f64), whatever the chunk size.
    #[test]
    fn all_deltanet_forms_agree(config in config_strategy(), seed in any::<u64>(), t in 2usize..50, chunk in 1usize..20) {
        let (_dir, model) = random_model(&config, seed, DType::F64);
        let ids = random_ids(seed ^ 1, t, model.config().vocab_size);
        let sequential = RunOptions { prefill: Form::Sequential, decode: Form::Sequential, ..RunOptions::default() };
        let (expected, _) = run_blocks(&model, &ids, &sequential);
        let mut forms = vec![Form::Matrix];
        forms.extend(Inverse::ALL.map(|inverse| Form::Chunked { block: chunk, inverse }));
        for form in forms {
            let (logits, _) = run_blocks(&model, &ids, &RunOptions { prefill: form, ..sequential });
            prop_close(&form.describe(), &logits, &expected, 1e-9)?;
        }
    }
}

/// The fp16 rescaling (q ×1024 inside the recurrence, gated-norm eps ×1024²) is invariant in f32, bit for bit:
/// 1024 is a power of two, so every product and sum scales exactly and the norm cancels it.
#[test]
fn output_rescaling_is_invariant_in_f32() {
    let (_dir, model) = random_model(&small_config_json(), 7, DType::F32);
    let ids = random_ids(3, 37, model.config().vocab_size);
    for form in [
        Form::Sequential,
        Form::Matrix,
        Form::Chunked {
            block: 16,
            inverse: Inverse::Doubling,
        },
    ] {
        let plain = RunOptions {
            prefill: form,
            ..RunOptions::default()
        };
        let scaled = RunOptions {
            output_scale: 1024.0,
            ..plain
        };
        let mut taps_plain = Taps::on();
        let mut taps_scaled = Taps::on();
        model
            .prefill(
                &ids,
                &mut model.new_state().unwrap(),
                &plain,
                &mut taps_plain,
            )
            .unwrap();
        model
            .prefill(
                &ids,
                &mut model.new_state().unwrap(),
                &scaled,
                &mut taps_scaled,
            )
            .unwrap();
        for (name, t) in taps_plain.tensors() {
            // Bitwise: scaling by a power of two never rounds differently.
            assert_close(
                &format!("{} {name}", form.describe()),
                taps_scaled.get(name).unwrap(),
                t,
                0.0,
            );
        }
    }
}

/// f32 runs stay close to the f64 ground truth.
#[test]
fn f32_tracks_f64() {
    let (dir, model64) = random_model(&small_config_json(), 11, DType::F64);
    let model32 = Model::load(dir.path(), DType::F32).unwrap();
    let ids = random_ids(5, 64, model64.config().vocab_size);
    let (l64, _) = run_blocks(&model64, &ids, &RunOptions::default());
    let (l32, _) = run_blocks(&model32, &ids, &RunOptions::default());
    assert_eq!(l32.dtype(), DType::F32);
    assert_close("f32 logits vs f64", &l32, &l64, 1e-5);
}
