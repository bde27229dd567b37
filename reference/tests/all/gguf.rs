//! GGUF checkpoints made by llama.cpp's converter (f32: `scripts/make_gguf_models.py`, and
//! `scripts/make_gguf_fixtures.py` for the MoE model of llama.cpp's fixtures) from the tiny testdata models: the
//! reference on the GGUF gives the checkpoint's config, logits and greedy tokens.

use crate::common::testdata;
use candle_core::DType;
use reference::taps::Taps;
use reference::{Model, RunOptions};

/// The logits' largest absolute difference allowed between the reference on the f32 GGUF and on its checkpoint.
/// Every tensor the converter moves, squeezes or splits carries the checkpoint's bits; the norm weights come back as
/// the same `1 + w`; only `A_log` comes back as the f32 whose `-exp` is the GGUF's `ssm_a`, which may differ in the
/// last bit from torch's `-exp(A_log)`. Measured: 0 on tiny, tiny-moe and tiny-moe-gguf (bit-identical logits).
const LOGITS_ATOL: f32 = 1e-5;

fn run(model: &Model, prompt: &[u32], new: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut state = model.new_state().unwrap();
    let opts = RunOptions::default();
    let mut taps = Taps::off();
    let mut logits = vec![];
    let mut tokens = vec![];
    let mut ids = prompt.to_vec();
    for _ in 0..new {
        let out = model.forward(&ids, &mut state, &opts, &mut taps).unwrap();
        let row: Vec<f32> = out.to_vec1().unwrap();
        let next = row
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .unwrap();
        logits.push(row);
        tokens.push(next);
        ids = vec![next];
    }
    (logits, tokens)
}

#[test]
fn the_f32_gguf_runs_as_its_checkpoint() {
    let prompt: Vec<u32> = vec![3, 71, 200, 9, 411, 17, 5, 88, 301, 42, 7, 150];
    for (name, gguf) in [
        ("tiny", "gguf/models/tiny-f32.gguf"),
        ("tiny-moe", "gguf/models/tiny-moe-f32.gguf"),
        // The f32 file of llama.cpp's MoE fixtures (the one llama.cpp itself ran).
        ("tiny-moe-gguf", "gguf/llamacpp/tiny-moe-gguf.f32.gguf"),
    ] {
        let checkpoint = testdata().join("models").join(name);
        let gguf = testdata().join(gguf);
        let original = Model::load(&checkpoint, DType::F32).unwrap();
        let converted = Model::load(&gguf, DType::F32).unwrap();
        let mut expected = original.config().clone();
        let mut got = converted.config().clone();
        // The converter writes llama.cpp's end-of-generation token, not the config's list.
        expected.eos_token_ids.clear();
        got.eos_token_ids.clear();
        assert_eq!(got, expected, "{name}: the config from the GGUF's metadata");
        let (a, ta) = run(&original, &prompt, 8);
        let (b, tb) = run(&converted, &prompt, 8);
        assert_eq!(ta, tb, "{name}: greedy tokens");
        let worst = a
            .iter()
            .flatten()
            .zip(b.iter().flatten())
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        eprintln!("{name}: max |Δlogit| GGUF f32 vs checkpoint over 8 steps: {worst:e}");
        assert!(worst <= LOGITS_ATOL, "{name}: max |Δlogit| {worst:e}");
    }
}
