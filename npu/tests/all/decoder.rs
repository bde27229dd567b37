//! Whole-decoder graphs on the CPU device against the reference: greedy tokens, logits, every tap and state.

use candle_core::{DType, Tensor};
use npu::devices::CompileOptions;
use npu::engine::DecoderEngine;
use npu::graphs::{Builder, DeltaNetGraphForm, GraphOptions};
use reference::backend::ReferenceBackend;
use reference::compare::{diff, diff_sliced};
use reference::config::Config;
use reference::deltanet::Inverse;
use reference::model::{Model, RunOptions};
use reference::taps::Taps;
use reference::weights::WeightStore;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::common;
use common::{Worst, ids_of, run};

fn testdata() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata")
}

fn golden(name: &str) -> BTreeMap<String, Tensor> {
    candle_core::safetensors::load(
        testdata().join(format!("goldens/{name}.safetensors")),
        &candle_core::Device::Cpu,
    )
    .unwrap()
    .into_iter()
    .collect()
}

/// The reference's taps, states after the prompt, and greedy continuation.
fn reference_dump(
    dir: &Path,
    ids: &[u32],
    generate: usize,
) -> (BTreeMap<String, Tensor>, Vec<u32>) {
    let model = Model::load(dir, DType::F32).unwrap();
    let mut backend = ReferenceBackend::new(model, RunOptions::default(), true, "f32").unwrap();
    let r = run(&mut backend, ids, generate).unwrap();
    let mut out = r.taps;
    out.extend(r.states);
    (out, r.generated)
}

#[test]
fn decoder_graphs_match_the_reference() {
    for name in common::models() {
        let name = name.as_str();
        let dir = testdata().join("models").join(name);
        let g = golden(name);
        let ids: Vec<u32> = ids_of(&g["token_ids"]);
        let expected_tokens: Vec<u32> = ids_of(&g["generated"]);
        let (reference, ref_tokens) = reference_dump(&dir, &ids, 16);
        assert_eq!(ref_tokens, expected_tokens);
        let config = Config::from_file(&dir.join("config.json")).unwrap();
        let weights = WeightStore::open(&dir, DType::F32).unwrap();
        for (block, form) in [
            (1, DeltaNetGraphForm::Matrix),
            (16, DeltaNetGraphForm::Chunked(Inverse::Doubling)),
            (64, DeltaNetGraphForm::Chunked(Inverse::Doubling)),
            (16, DeltaNetGraphForm::Loop),
        ] {
            let opts = GraphOptions {
                form,
                context: 160,
                ..GraphOptions::default()
            };
            let builder = Builder::new(&config, &weights, opts).unwrap();
            let start = std::time::Instant::now();
            let mut engine =
                DecoderEngine::new(&builder, block, "CPU", &CompileOptions::default()).unwrap();
            let compile_s = start.elapsed().as_secs_f64();
            let start = std::time::Instant::now();
            let run = run(&mut engine, &ids, 16).unwrap();
            let run_s = start.elapsed().as_secs_f64();
            let label = format!("{name} block {block} {form:?}");
            assert_eq!(run.generated, expected_tokens, "{label}: greedy tokens");
            let mut worst = Worst::default();
            for (tensor, t) in run.taps.iter().chain(&run.states) {
                let r = reference
                    .get(tensor)
                    .unwrap_or_else(|| panic!("{label}: the reference has no {tensor}"));
                worst.check(&label, tensor, t, r, &config);
            }
            for tensor in reference.keys() {
                assert!(
                    run.taps.contains_key(tensor) || run.states.contains_key(tensor),
                    "{label}: the device run has no {tensor}"
                );
            }
            let logits = diff(&run.taps["logits"], &reference["logits"]).unwrap();
            println!(
                "{label}: 16 greedy tokens identical; logits max abs {:.2e}; worst tensor {:.2e} of its head's (or \
                 tensor's) max; compile {compile_s:.2} s, run {run_s:.2} s\n{}",
                logits.max_abs,
                worst.overall(),
                worst.report()
            );
        }
    }
}

/// The bundled tiny model's config and f32 weights.
fn tiny() -> (Config, WeightStore) {
    let dir = testdata().join("models/tiny");
    let config = Config::from_file(&dir.join("config.json")).unwrap();
    (config, WeightStore::open(&dir, DType::F32).unwrap())
}

#[test]
fn padded_and_unpadded_prompts_agree() {
    let (config, weights) = tiny();
    let builder = Builder::new(
        &config,
        &weights,
        GraphOptions {
            context: 64,
            ..GraphOptions::default()
        },
    )
    .unwrap();
    let ids: Vec<u32> = (0..32).map(|i| (i * 37 % 500) as u32).collect();
    let mut exact = DecoderEngine::new(&builder, 16, "CPU", &CompileOptions::default()).unwrap();
    let full = run(&mut exact, &ids, 4).unwrap(); // two full blocks
    let mut padded = DecoderEngine::new(&builder, 24, "CPU", &CompileOptions::default()).unwrap();
    let part = run(&mut padded, &ids, 4).unwrap(); // one full block and one with 16 padded slots
    assert_eq!(full.generated, part.generated);
    let mut worst = 0f64;
    for (name, t) in full.taps.iter().chain(&full.states) {
        let other = part
            .taps
            .get(name)
            .or_else(|| part.states.get(name))
            .unwrap();
        let d = diff(other, t).unwrap();
        assert!(d.within(0.0, 1e-5), "{name}: {d}");
        if let Some(h) = diff_sliced(name, other, t, &config).unwrap() {
            assert!(h.within(1e-5), "{name}: {h}");
            worst = worst.max(h.relative());
        }
    }
    println!("padded vs unpadded prompt: worst head {worst:.2e} of its max");
}

#[test]
fn prompt_longer_than_the_static_context_is_refused() {
    let (config, weights) = tiny();
    let builder = Builder::new(
        &config,
        &weights,
        GraphOptions {
            context: 8,
            ..GraphOptions::default()
        },
    )
    .unwrap();
    let mut engine = DecoderEngine::new(&builder, 4, "CPU", &CompileOptions::default()).unwrap();
    let err = run(&mut engine, &[1; 9], 0).err().unwrap().to_string();
    assert!(
        err.contains("static context") && err.contains("--context"),
        "{err}"
    );
    let err = run(&mut engine, &[600], 0).err().unwrap().to_string();
    assert!(err.contains("600") && err.contains("vocabulary"), "{err}");
}

/// Graphs holding f16, INT8 or INT4 weights equal the reference run on the same quantized weights: device error
/// and quantization error are told apart.
#[test]
fn quantized_graphs_equal_the_reference_on_the_same_weights() {
    use reference::quant::WeightFormat;
    for (name, format) in [
        ("tiny", "f16"),
        ("tiny", "int4:32"),
        ("tiny-full", "int4"),
        ("tiny-tied", "int4:16"),
    ] {
        let dir = testdata().join("models").join(name);
        let format = WeightFormat::parse(format).unwrap();
        let config = Config::from_file(&dir.join("config.json")).unwrap();
        let weights = WeightStore::open_with_format(&dir, DType::F32, format).unwrap();
        let model = Model::from_weights(config.clone(), &weights).unwrap();
        let ids: Vec<u32> = ids_of(&golden(name)["token_ids"]);
        let opts = RunOptions::default();
        let mut backend = ReferenceBackend::new(model, opts, true, &format.name()).unwrap();
        let reference = run(&mut backend, &ids, 8).unwrap();
        let (taps, reference_states, tokens) =
            (reference.taps, reference.states, reference.generated);
        let builder = Builder::new(
            &config,
            &weights,
            GraphOptions {
                context: 128,
                ..GraphOptions::default()
            },
        )
        .unwrap();
        let mut engine =
            DecoderEngine::new(&builder, 16, "CPU", &CompileOptions::default()).unwrap();
        let run = run(&mut engine, &ids, 8).unwrap();
        let label = format!("{name} {}", format.name());
        assert_eq!(run.generated, tokens, "{label}: greedy tokens");
        let mut worst = Worst::default();
        for (tensor, t) in &run.taps {
            worst.check(&label, tensor, t, &taps[tensor], &config);
        }
        for (tensor, t) in &run.states {
            worst.check(&label, tensor, t, &reference_states[tensor], &config);
        }
        let f32_model = Model::load(&dir, DType::F32).unwrap();
        let mut f32_taps = Taps::on();
        f32_model
            .prefill(
                &ids,
                &mut f32_model.new_state().unwrap(),
                &opts,
                &mut f32_taps,
            )
            .unwrap();
        let quant_error = diff(&run.taps["logits"], f32_taps.get("logits").unwrap()).unwrap();
        let device_error = diff(&run.taps["logits"], taps.get("logits").unwrap()).unwrap();
        println!(
            "{label}: device vs reference on the same weights: logits {:.2e}, worst tap or state {:.2e} of its \
             head's (or tensor's) max; vs the f32 weights: logits {:.2e}",
            device_error.max_abs,
            worst.overall(),
            quant_error.max_abs
        );
        assert!(
            quant_error.max_abs > 10.0 * device_error.max_abs.max(1e-6),
            "{label}: quantization changed nothing?"
        );
    }
}

/// The long prompt (`goldens/tiny.long.safetensors`: 1000 tokens of plain text, from transformers) through the
/// decoder graphs at the default static context of 1024 with prompt blocks of 64: 15 full blocks, a padded one of 40
/// (`token_valid`), then 16 single-token steps to position 1015 of 1024. The greedy tokens are transformers', the
/// logits at every prompt position and every state after the prompt are the reference's within f32 noise.
#[test]
fn a_thousand_token_prompt_at_the_default_context() {
    let dir = testdata().join("models/tiny");
    let g = golden("tiny.long");
    let ids: Vec<u32> = ids_of(&g["token_ids"]);
    assert_eq!(ids.len(), 1000);
    let expected: Vec<u32> = ids_of(&g["generated"]);
    let (reference, ref_tokens) = reference_dump(&dir, &ids, 16);
    assert_eq!(ref_tokens, expected, "the reference's greedy tokens");
    let config = Config::from_file(&dir.join("config.json")).unwrap();
    let weights = WeightStore::open(&dir, DType::F32).unwrap();
    let opts = GraphOptions {
        form: DeltaNetGraphForm::Chunked(Inverse::Doubling),
        ..GraphOptions::default()
    };
    assert_eq!(opts.context, 1024, "the default static context");
    let builder = Builder::new(&config, &weights, opts).unwrap();
    let mut engine = DecoderEngine::new(&builder, 64, "CPU", &CompileOptions::default()).unwrap();
    let run = run(&mut engine, &ids, 16).unwrap();
    assert_eq!(run.generated, expected, "greedy tokens on the graphs");
    let mut worst = Worst::default();
    for (tensor, t) in run.taps.iter().chain(&run.states) {
        worst.check("tiny, 1000 tokens", tensor, t, &reference[tensor], &config);
    }
    let logits = diff(&run.taps["logits"], &g["logits"]).unwrap();
    println!(
        "tiny, 1000 tokens, blocks of 64, context 1024: 16 greedy tokens identical; logits max abs {:.2e} from \
         transformers; worst tensor {:.2e} of its max from the reference\n{}",
        logits.max_abs,
        worst.overall(),
        worst.report()
    );
    assert!(logits.max_abs < 1e-3, "logits vs transformers: {logits}");
}

#[test]
fn a_padded_only_engine_runs_single_tokens_in_its_block_graph() {
    // The graphs with taps of a check hold one compiled copy of the weights: single tokens run padded in the
    // prompt-block graph. Same tokens, and the logits of every position, decode steps included, as the engine
    // that decodes in its 1-token graph.
    let (config, weights) = tiny();
    let builder = Builder::new(
        &config,
        &weights,
        GraphOptions {
            context: 64,
            ..GraphOptions::default()
        },
    )
    .unwrap();
    let ids: Vec<u32> = (0..20).map(|i| (i * 53 % 500) as u32).collect();
    let opts = CompileOptions::default();
    let mut both = DecoderEngine::new(&builder, 16, "CPU", &opts).unwrap();
    let mut padded = DecoderEngine::padded_only(&builder, 16, "CPU", &opts).unwrap();
    assert_eq!(both.blocks(), vec![1, 16]);
    assert_eq!(padded.blocks(), vec![16], "no 1-token graph");
    let a = run(&mut both, &ids, 6).unwrap();
    let b = run(&mut padded, &ids, 6).unwrap();
    assert_eq!(a.generated, b.generated);
    let cont = &a.generated[..a.generated.len() - 1];
    let fa = reference::backend::teacher_forced(&mut both, &ids, cont).unwrap();
    let fb = reference::backend::teacher_forced(&mut padded, &ids, cont).unwrap();
    assert_eq!(fa.run.logits.dims(), fb.run.logits.dims());
    let d = diff(&fb.run.logits, &fa.run.logits).unwrap();
    assert!(d.within(0.0, 1e-5), "teacher-forced logits: {d}");
    for (name, t) in &fa.run.taps {
        let d = diff(&fb.run.taps[name], t).unwrap();
        assert!(d.within(0.0, 1e-5), "{name}: {d}");
    }
}
