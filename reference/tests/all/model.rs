//! Whole-model properties on random checkpoints: the ways of feeding a prompt all give the same numbers.

use crate::common::*;
use candle_core::{DType, Tensor};
use proptest::prelude::*;
use reference::deltanet::{Form, Inverse};
use reference::model::{LayerState, Model, RunOptions, State};
use reference::rope::Positions;
use reference::synthetic::{Rng, small_config_json, write_checkpoint};
use reference::taps::Taps;
use std::ops::Range;

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

/// Every state tensor of two runs agrees (the DeltaNet conv and recurrent states within `rtol` of their max, the
/// attention KV caches within `kv_rtol`), and so do their positions.
fn prop_states_close(
    what: &str,
    a: &State,
    b: &State,
    rtol: f64,
    kv_rtol: f64,
) -> Result<(), TestCaseError> {
    prop_assert_eq!(a.position, b.position, "{}: state positions", what);
    for (i, (x, y)) in a.layers.iter().zip(&b.layers).enumerate() {
        match (x, y) {
            (LayerState::Linear(x), LayerState::Linear(y)) => {
                prop_close(
                    &format!("{what}: layer {i} conv state"),
                    &x.conv,
                    &y.conv,
                    rtol,
                )?;
                prop_close(
                    &format!("{what}: layer {i} recurrent state"),
                    &x.recurrent,
                    &y.recurrent,
                    rtol,
                )?;
            }
            (LayerState::Attention(x), LayerState::Attention(y)) => {
                let (Some(xk), Some(xv), Some(yk), Some(yv)) =
                    (&x.keys, &x.values, &y.keys, &y.values)
                else {
                    return Err(TestCaseError::fail(format!(
                        "{what}: layer {i}: an empty KV cache"
                    )));
                };
                prop_close(&format!("{what}: layer {i} keys"), xk, yk, kv_rtol)?;
                prop_close(&format!("{what}: layer {i} values"), xv, yv, kv_rtol)?;
            }
            _ => {
                return Err(TestCaseError::fail(format!(
                    "{what}: layer {i}: state kinds differ"
                )));
            }
        }
    }
    Ok(())
}

/// A prompt with its (possibly multimodal) positions.
struct Prompt {
    ids: Vec<u32>,
    positions: Positions,
    is_image: Vec<bool>,
}

impl Prompt {
    fn new(case: &PromptCase, vocab: usize) -> Self {
        let (positions, is_image) = prompt_positions(case.tokens, case.image);
        Prompt {
            ids: random_ids(case.seed, case.tokens, vocab),
            positions,
            is_image,
        }
    }

    /// Feeds tokens `range` in one forward call: a piece holding image tokens with its explicit positions
    /// ([`Model::forward_at`]), a text piece with the positions the state continues from ([`Model::forward`]).
    fn feed(
        &self,
        model: &Model,
        range: Range<usize>,
        state: &mut State,
        opts: &RunOptions,
        taps: &mut Taps,
    ) {
        let ids = &self.ids[range.clone()];
        if self.is_image[range.clone()].iter().any(|&x| x) {
            let rows = self
                .positions
                .0
                .clone()
                .map(|row| row[range.clone()].to_vec());
            model
                .forward_at(ids, &Positions(rows), state, opts, taps)
                .unwrap();
        } else {
            model.forward(ids, state, opts, taps).unwrap();
        }
    }

    /// Logits `[T, V]` and state after feeding the prompt in forward calls of the given lengths, in order.
    fn run(&self, model: &Model, pieces: &[usize], opts: &RunOptions) -> (Tensor, State) {
        assert_eq!(pieces.iter().sum::<usize>(), self.ids.len());
        let mut state = model.new_state().unwrap();
        let mut taps = Taps::on();
        let mut start = 0;
        for &len in pieces {
            self.feed(model, start..start + len, &mut state, opts, &mut taps);
            start += len;
        }
        (taps.get("logits").unwrap().clone(), state)
    }
}

/// Lengths of forward calls of at most `block` tokens covering `tokens`.
fn blocks(tokens: usize, block: usize) -> Vec<usize> {
    (0..tokens)
        .step_by(block)
        .map(|start| block.min(tokens - start))
        .collect()
}

/// Logits `[T, V]` and state of one text prompt fed by [`Model::prefill`].
fn run_prefill(model: &Model, ids: &[u32], opts: &RunOptions) -> (Tensor, State) {
    let mut state = model.new_state().unwrap();
    let mut taps = Taps::on();
    model.prefill(ids, &mut state, opts, &mut taps).unwrap();
    (taps.get("logits").unwrap().clone(), state)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// One forward call over the whole prompt (chunked, chunk boundaries inside the call) equals: the prompt in
    /// prefill blocks that are not multiples of the chunk; and a split run (blocks up to `cut1`, then one call from
    /// the carried non-zero state, then token-by-token decode). Logits of every token and every state tensor, and
    /// with an image in the prompt, the text after it continuing from the state's position.
    #[test]
    fn prefill_then_decode_equals_one_prefill((m, p) in model_and_prompt(), seed in any::<u64>()) {
        let (_dir, model) = random_model(&m.config_json(), seed, DType::F64);
        let prompt = Prompt::new(&p, model.config().vocab_size);
        let t = p.tokens;
        let opts = RunOptions {
            prefill: Form::Chunked { block: p.chunk, inverse: Inverse::Substitution },
            ..RunOptions::default()
        };
        let (whole, whole_state) = prompt.run(&model, &[t], &opts);
        if p.image.is_some() {
            let last = prompt.positions.0.iter().flatten().max().unwrap();
            prop_assert_eq!(whole_state.next_position() as i64, last + 1, "the position after the prompt");
            prop_assert_eq!(whole_state.position, t, "the tokens the caches hold");
        }

        let (blocked, blocked_state) = if p.image.is_none() {
            run_prefill(&model, &prompt.ids, &RunOptions { prefill_block: Some(p.prefill_block), ..opts })
        } else {
            prompt.run(&model, &blocks(t, p.prefill_block), &opts)
        };
        prop_close("logits, prefill in blocks", &blocked, &whole, 1e-9)?;
        prop_states_close("prefill in blocks", &blocked_state, &whole_state, 1e-9, 1e-9)?;

        let mut pieces = blocks(p.cut1, p.prefill_block);
        pieces.push(p.cut2 - p.cut1);
        pieces.extend(std::iter::repeat_n(1, t - p.cut2));
        let (split, split_state) = prompt.run(&model, &pieces, &opts);
        prop_close("logits, split run", &split, &whole, 1e-9)?;
        prop_states_close("split run", &split_state, &whole_state, 1e-9, 1e-9)?;
    }

    /// Every delta-rule form gives the logits and states of the sequential one (f64), over the whole prompt in one
    /// call and split in two calls (the second from the carried state), chunk boundaries inside the calls.
    #[test]
    fn all_deltanet_forms_agree((m, p) in model_and_prompt(), seed in any::<u64>()) {
        let (_dir, model) = random_model(&m.config_json(), seed, DType::F64);
        let prompt = Prompt::new(&p, model.config().vocab_size);
        let t = p.tokens;
        let sequential = RunOptions { prefill: Form::Sequential, decode: Form::Sequential, ..RunOptions::default() };
        let (expected, expected_state) = prompt.run(&model, &[t], &sequential);
        let mut forms = vec![Form::Matrix];
        forms.extend(Inverse::ALL.map(|inverse| Form::Chunked { block: p.chunk, inverse }));
        for form in forms {
            let opts = RunOptions { prefill: form, decode: form, ..sequential };
            let (logits, state) = prompt.run(&model, &[t], &opts);
            prop_close(&form.describe(), &logits, &expected, 1e-9)?;
            prop_states_close(&form.describe(), &state, &expected_state, 1e-9, 1e-9)?;
            let (logits, state) = prompt.run(&model, &[p.cut1, t - p.cut1], &opts);
            prop_close(&format!("{}, split", form.describe()), &logits, &expected, 1e-9)?;
            prop_states_close(&format!("{}, split", form.describe()), &state, &expected_state, 1e-9, 1e-9)?;
        }
    }
}

/// One text prompt for the f32 properties: its seed and length, the delta-rule chunk, and the split run's pieces
/// (`..cut` in one call, then one call, then the last `decoded` tokens one by one).
#[derive(Debug, Clone)]
struct F32Prompt {
    seed: u64,
    tokens: usize,
    chunk: usize,
    cut: usize,
    decoded: usize,
}

/// Models as [`model_case`] draws them, but with DeltaNet head dims from 4-12 and the real 128 (Dk ≠ Dv, so 128
/// meets a small dim on the other side); prompts of 20-140 tokens in chunks of 1-8, 16 or the default 64 (so a chunk
/// boundary of 64 falls inside the longer prompts), split at any token with up to 6 tokens decoded one by one.
fn f32_case() -> impl Strategy<Value = (ModelCase, F32Prompt)> {
    let dim = || prop_oneof![4usize..=12, Just(128usize)];
    let dims = (dim(), dim()).prop_filter("Dk = Dv", |(dk, dv)| dk != dv);
    let prompt = (
        any::<u64>(),
        20usize..=140,
        prop::sample::select(vec![1usize, 2, 3, 5, 7, 8, 16, 64]),
    )
        .prop_flat_map(|(seed, tokens, chunk)| {
            (1..tokens).prop_flat_map(move |cut| {
                (0..=(tokens - cut - 1).min(6)).prop_map(move |decoded| F32Prompt {
                    seed,
                    tokens,
                    chunk,
                    cut,
                    decoded,
                })
            })
        });
    (model_case(), dims, prompt).prop_map(|(m, (dk, dv), p)| (ModelCase { dk, dv, ..m }, p))
}

/// f32's unit roundoff, 2^-24: the relative error of one rounding.
const F32_U: f64 = 1.0 / (1u64 << 24) as f64;

/// How far an f32 run may be from the f64 run of the same case, relative to each tensor's max: the DeltaNet layers'
/// conv and recurrent states within 512 u (measured over 512 drawn cases: at most 24 u for the conv states, 52 u for
/// the recurrent states, whatever the form), so about ten times what the f32 kernels lose.
const F32_STATE_RTOL: f64 = 512.0 * F32_U;

/// The logits and the attention KV caches within 4096 u (measured over the same 512 cases: at most 581 u on the
/// logits, 242 u on the KV caches). Their error grows with the position: RoPE's angle `position · θ_i` is rounded
/// to `position · u` of itself (140 u at position 140) before attention and the layers above amplify it, which is
/// why they are held to a larger multiple of u than the states.
const F32_OUTPUT_RTOL: f64 = 4096.0 * F32_U;

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// The same drawn model and prompt in f32 (so the DeltaNet layers take the f32 kernels: the chunked form with
    /// forward substitution, the matrix form over a prompt, the single-token step) and in f64: the f32 logits and
    /// states of the whole prompt in one call, of the matrix form over it, and of a split run (a call, a call from the
    /// carried state, then tokens one by one) are within [`F32_OUTPUT_RTOL`] (logits, KV caches) and
    /// [`F32_STATE_RTOL`] (DeltaNet states) of the f64 run's, relative to each tensor's max. The decays are the
    /// random checkpoint's, `−exp(A_log)·softplus(a + dt_bias)` with `A_log` up to 1.5 and `dt_bias` up to 2, so they
    /// pass −10 per token (4.5 · softplus(2 + a)): the kernels hold that (see `deltanet_kernel`), the tensor form of
    /// the chunked rule (the doubling and series inverses in f32) is not held to this bound there, so it is not run
    /// here.
    #[test]
    fn f32_runs_track_f64((m, p) in f32_case(), seed in any::<u64>()) {
        let (dir, model64) = random_model(&m.config_json(), seed, DType::F64);
        let model32 = Model::load(dir.path(), DType::F32).unwrap();
        let t = p.tokens;
        let (positions, is_image) = prompt_positions(t, None);
        let prompt = Prompt { ids: random_ids(p.seed, t, model64.config().vocab_size), positions, is_image };
        let chunked = RunOptions {
            prefill: Form::Chunked { block: p.chunk, inverse: Inverse::Substitution },
            decode: Form::Matrix,
            ..RunOptions::default()
        };
        let matrix = RunOptions { prefill: Form::Matrix, ..chunked };
        let (expected, expected_state) = prompt.run(&model64, &[t], &chunked);
        let mut pieces = vec![p.cut, t - p.cut - p.decoded];
        pieces.extend(std::iter::repeat_n(1, p.decoded));
        for (what, opts, pieces) in [
            ("chunked", chunked, vec![t]),
            ("matrix", matrix, vec![t]),
            ("split", chunked, pieces),
        ] {
            let (logits, state) = prompt.run(&model32, &pieces, &opts);
            prop_assert_eq!(logits.dtype(), DType::F32);
            prop_close(&format!("f32 {what} logits"), &logits, &expected, F32_OUTPUT_RTOL)?;
            prop_states_close(&format!("f32 {what}"), &state, &expected_state, F32_STATE_RTOL, F32_OUTPUT_RTOL)?;
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
    let (l64, _) = run_prefill(&model64, &ids, &RunOptions::default());
    let (l32, _) = run_prefill(&model32, &ids, &RunOptions::default());
    assert_eq!(l32.dtype(), DType::F32);
    assert_close("f32 logits vs f64", &l32, &l64, 1e-5);
}
