//! `reference::synth`: the 9B and 35B-A3B plans against their real figures (planned only: no big writes), byte-identical
//! files for a seed whatever the thread count, the real layouts (dense and MoE) loaded and run by the reference, and
//! the scales it promises.

use candle_core::DType;
use reference::Config;
use reference::config::LayerKind;
use reference::model::{Model, RunOptions};
use reference::schema::Schema;
use reference::synth::{
    Arch, DEFAULT_SHARD_BYTES, SynthOptions, config_json, plan, shards, write_checkpoint,
};
use reference::taps::Taps;
use std::collections::BTreeMap;
use std::path::Path;

fn tiny(seed: u64, shard_bytes: u64) -> SynthOptions {
    SynthOptions {
        arch: Arch::Tiny,
        layers: 5,
        seed,
        shard_bytes,
    }
}

fn write(dir: &Path, opts: &SynthOptions) {
    write_checkpoint(dir, opts, &mut |_, _| {}).unwrap();
}

fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

#[test]
fn the_9b_plan_has_specs_dimensions_and_layout() {
    let value = config_json(Arch::Qwen35_9b, 32, 0).unwrap();
    assert_eq!(value["model_type"], "qwen3_5");
    let c = Config::from_json_str(&value.to_string(), "synth").unwrap();
    assert!(c.nested);
    assert_eq!(
        (c.hidden_size, c.intermediate_size, c.vocab_size),
        (4096, 12288, 248320)
    );
    assert_eq!(
        (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
        (16, 4, 256)
    );
    assert_eq!(c.rotary_dim(), 64);
    assert_eq!(
        (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim
        ),
        (16, 32, 128, 128)
    );
    assert_eq!((c.linear_conv_kernel_dim, c.rms_norm_eps), (4, 1e-6));
    assert!(!c.tie_word_embeddings);
    let pattern: Vec<LayerKind> = (0..32)
        .map(|i| {
            if i % 4 == 3 {
                LayerKind::Full
            } else {
                LayerKind::Linear
            }
        })
        .collect();
    assert_eq!(c.layer_types, pattern);

    let p = plan(Arch::Qwen35_9b, 32).unwrap();
    let by_name: BTreeMap<&str, &Vec<usize>> =
        p.iter().map(|t| (t.name.as_str(), &t.shape)).collect();
    assert_eq!(by_name.len(), p.len(), "a name appears twice");
    // Every decoder tensor the reference reads is there, under the full checkpoint's prefix, with its shape.
    let mut decoder = 0u64;
    for spec in Schema::new(&c).tensors() {
        let name = spec.full_name("model.language_model.");
        assert_eq!(by_name.get(name.as_str()), Some(&&spec.shape), "{name}");
        decoder += spec.shape.iter().product::<usize>() as u64;
    }
    // 8 × (3 linear layers of 218.4 M + one attention layer of 209.7 M) + embedding and LM head 2 × 1017.1 M.
    let linear: u64 = 8192 * 4096 + 2 * 4096 * 4096 + 2 * 32 * 4096 + 8192 * 4 + 2 * 32 + 128;
    let attention = 8192 * 4096 + 2 * 1024 * 4096 + 4096 * 4096 + 2 * 256;
    let block = 3 * 4096 * 12288 + 2 * 4096;
    let expected = 8 * (3 * (linear + block) + attention + block) + 2 * 248320 * 4096 + 4096;
    assert_eq!(decoder, expected);
    assert!(
        p.iter()
            .any(|t| t.name.starts_with("model.visual.blocks.26."))
    );
    assert!(by_name.contains_key("mtp.layers.0.self_attn.q_proj.weight"));

    let s = shards(&p, DEFAULT_SHARD_BYTES);
    assert!(s.len() >= 4, "{} shards", s.len());
    let mut seen = 0;
    for (i, shard) in s.iter().enumerate() {
        assert_eq!(
            shard.file,
            format!("model-{:05}-of-{:05}.safetensors", i + 1, s.len())
        );
        assert!(shard.bytes <= DEFAULT_SHARD_BYTES, "{}", shard.file);
        seen += shard.tensors.len();
    }
    assert_eq!(seen, p.len());
}

#[test]
fn same_seed_same_bytes_whatever_the_thread_count() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, c) = (
        tmp.path().join("a"),
        tmp.path().join("b"),
        tmp.path().join("c"),
    );
    // Shards of 100 kB: several files, and tensors larger than the generator's block (64 Ki values) split in blocks.
    write(&a, &tiny(7, 100_000));
    let one_thread = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    one_thread.install(|| write(&b, &tiny(7, 100_000)));
    write(&c, &tiny(8, 100_000));
    let (fa, fb, fc) = (files(&a), files(&b), files(&c));
    assert!(fa.len() > 4, "{:?}", fa.keys());
    assert_eq!(fa.keys().collect::<Vec<_>>(), fb.keys().collect::<Vec<_>>());
    for (name, bytes) in &fa {
        assert!(fb[name] == *bytes, "{name} differs between two runs");
    }
    let differing = fa
        .iter()
        .filter(|(n, bytes)| n.ends_with(".safetensors") && fc[*n] != **bytes)
        .count();
    assert_eq!(
        differing,
        fa.len() - 2,
        "another seed must change every shard"
    );
}

#[test]
fn the_reference_loads_it_and_runs() {
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), &tiny(3, 100_000));
    let index: serde_json::Value = serde_json::from_slice(
        &std::fs::read(tmp.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let map = index["weight_map"].as_object().unwrap();
    assert!(map.contains_key("model.language_model.layers.4.linear_attn.A_log"));
    assert!(map.contains_key("model.visual.merger.linear_fc2.weight"));
    let model = Model::load(tmp.path(), DType::F32).unwrap();
    assert!(model.config().nested);
    let mut state = model.new_state().unwrap();
    let ids: Vec<u32> = (0..40).map(|i| (i * 37 % 512) as u32).collect();
    let logits = model
        .forward(&ids, &mut state, &RunOptions::default(), &mut Taps::off())
        .unwrap();
    let v: Vec<f32> = logits.to_vec1().unwrap();
    assert_eq!(v.len(), 512);
    assert!(v.iter().all(|x| x.is_finite()));
    let std = (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
    assert!((0.2..5.0).contains(&std), "logit RMS {std}");
}

fn tensor(dir: &Path, name: &str) -> Vec<f32> {
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let file = dir.join(index["weight_map"][name].as_str().unwrap());
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let view = st.tensor(name).unwrap();
    assert_eq!(view.dtype(), safetensors::Dtype::BF16, "{name}");
    view.data()
        .chunks_exact(2)
        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect()
}

fn mean_std(v: &[f32]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

#[test]
fn values_have_the_promised_scales_and_decays() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    write(dir, &tiny(11, DEFAULT_SHARD_BYTES));
    let p = "model.language_model.";
    // Embedding N(0, 1) over 32768 values (two blocks of the generator).
    let (mean, std) = mean_std(&tensor(dir, &format!("{p}embed_tokens.weight")));
    assert!(
        mean.abs() < 0.03 && (std - 1.0).abs() < 0.03,
        "{mean} {std}"
    );
    // gate_proj [128, 64]: N(0, 1/64).
    let (mean, std) = mean_std(&tensor(dir, &format!("{p}layers.0.mlp.gate_proj.weight")));
    assert!(
        mean.abs() < 0.01 && (std - 0.125).abs() < 0.006,
        "{mean} {std}"
    );
    // Zero-centred norms near 0, the gated norm near 1.
    let (mean, std) = mean_std(&tensor(dir, &format!("{p}norm.weight")));
    assert!(mean.abs() < 0.05 && std < 0.2, "{mean} {std}");
    let (mean, _) = mean_std(&tensor(
        dir,
        &format!("{p}layers.1.linear_attn.norm.weight"),
    ));
    assert!((mean - 1.0).abs() < 0.08, "{mean}");
    // Decays: A = exp(A_log) in [1, 16], dt = softplus(dt_bias) in [1e-3, 1e-1] (bf16 rounding aside).
    for layer in [0, 1, 2, 4] {
        let a_log = tensor(dir, &format!("{p}layers.{layer}.linear_attn.A_log"));
        let dt_bias = tensor(dir, &format!("{p}layers.{layer}.linear_attn.dt_bias"));
        for (&al, &db) in a_log.iter().zip(&dt_bias) {
            let a = (al as f64).exp();
            let dt = (db as f64).exp().ln_1p();
            assert!((0.99..16.2).contains(&a), "A {a}");
            assert!((0.99e-3..1.01e-1).contains(&dt), "dt {dt}");
        }
    }
    // Conv kernel [C, 1, 4]: N(0, 1/4).
    let conv = tensor(dir, &format!("{p}layers.0.linear_attn.conv1d.weight"));
    assert_eq!(conv.len(), 128 * 4);
    let (_, std) = mean_std(&conv);
    assert!((std - 0.5).abs() < 0.05, "{std}");
}
