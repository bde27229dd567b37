//! `reference::synth` for the MoE decoder: the 35B-A3B plan against the real model's dimensions, parameter count and
//! layout (planned only: no big writes), and the tiny MoE architecture written, read back as an MoE config with its
//! fused experts, run greedily by the reference, and byte-identical for a seed.

use candle_core::DType;
use reference::Config;
use reference::config::{LayerKind, MoeConfig};
use reference::model::{Model, RunOptions};
use reference::schema::{FusedExpert, Schema};
use reference::synth::{
    Arch, DEFAULT_SHARD_BYTES, SynthOptions, config_json, plan, planned_bytes, shards,
    write_checkpoint,
};
use reference::taps::Taps;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

const PREFIX: &str = "model.language_model.";

fn config(arch: Arch, layers: usize) -> Config {
    let value = config_json(arch, layers, 0).unwrap();
    Config::from_json_str(&value.to_string(), "synth").unwrap()
}

#[test]
fn the_35b_a3b_plan_has_the_real_dimensions_and_layout() {
    let value = config_json(Arch::Qwen35_35bA3b, 40, 0).unwrap();
    assert_eq!(value["model_type"], "qwen3_5_moe");
    assert_eq!(
        value["architectures"][0],
        "Qwen3_5MoeForConditionalGeneration"
    );
    assert_eq!(value["text_config"]["model_type"], "qwen3_5_moe_text");
    assert!(value["text_config"].get("intermediate_size").is_none());
    assert_eq!(value["vision_config"]["out_hidden_size"], 2048);
    let c = config(Arch::Qwen35_35bA3b, 40);
    assert!(c.nested);
    assert_eq!(
        c.moe,
        Some(MoeConfig {
            num_experts: 256,
            num_experts_per_tok: 8,
            moe_intermediate_size: 512,
            shared_expert_intermediate_size: 512,
        })
    );
    assert_eq!((c.hidden_size, c.vocab_size), (2048, 248320));
    assert_eq!(
        (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
        (16, 2, 256)
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
    let full: Vec<usize> = (0..40)
        .filter(|&i| c.layer_types[i] == LayerKind::Full)
        .collect();
    assert_eq!(full, (0..10).map(|i| 4 * i + 3).collect::<Vec<_>>());

    let p = plan(Arch::Qwen35_35bA3b, 40).unwrap();
    let by_name: BTreeMap<&str, &Vec<usize>> =
        p.iter().map(|t| (t.name.as_str(), &t.shape)).collect();
    assert_eq!(by_name.len(), p.len(), "a name appears twice");
    // Every decoder tensor the reference reads is there under the real prefix: an expert's matrix inside its layer's
    // fused tensor, everything else by its own name and shape.
    let moe = c.moe.as_ref().unwrap();
    let mut fused = BTreeSet::new();
    for spec in Schema::new(&c).tensors() {
        if let Some(f) = FusedExpert::of(&spec.name) {
            let name = format!("{PREFIX}{}", f.name);
            assert_eq!(by_name.get(name.as_str()), Some(&&f.shape(moe, 2048)));
            assert!(!by_name.contains_key(spec.full_name(PREFIX).as_str()));
            fused.insert(name);
        } else {
            let name = spec.full_name(PREFIX);
            assert_eq!(by_name.get(name.as_str()), Some(&&spec.shape), "{name}");
        }
    }
    assert_eq!(fused.len(), 80);
    assert_eq!(
        by_name[&*format!("{PREFIX}layers.39.mlp.experts.gate_up_proj")],
        &vec![256, 1024, 2048]
    );
    assert_eq!(
        by_name[&*format!("{PREFIX}layers.0.mlp.experts.down_proj")],
        &vec![256, 2048, 512]
    );
    // The decoder's parameters, from the real model's dimensions: 34.66 B, 32.21 B of them in the routed experts.
    let decoder: u64 = p
        .iter()
        .filter(|t| t.name.starts_with(PREFIX) || t.name == "lm_head.weight")
        .map(|t| t.numel() as u64)
        .sum();
    let experts: u64 = p
        .iter()
        .filter(|t| t.name.contains(".mlp.experts.") && t.name.starts_with(PREFIX))
        .map(|t| t.numel() as u64)
        .sum();
    let h = 2048u64;
    let linear = 8192 * h + 4096 * h + 2 * 32 * h + 8192 * 4 + 2 * 32 + 128 + h * 4096;
    let attention = 8192 * h + 2 * 512 * h + h * 4096 + 2 * 256;
    let block = 256 * h + 256 * 3 * 512 * h + 3 * 512 * h + h + 2 * h;
    let expected = 30 * (linear + block) + 10 * (attention + block) + 2 * 248320 * h + h;
    assert_eq!(decoder, expected);
    assert_eq!(decoder, 34_660_610_688);
    assert_eq!(experts, 40 * 256 * 3 * 512 * h);
    // The MTP layer: full attention and the MoE block, its experts one by one; the vision tower out to 2048.
    assert_eq!(
        by_name["mtp.layers.0.mlp.experts.255.down_proj.weight"],
        &vec![2048, 512]
    );
    assert_eq!(by_name["mtp.layers.0.mlp.gate.weight"], &vec![256, 2048]);
    assert_eq!(
        by_name["mtp.layers.0.mlp.shared_expert_gate.weight"],
        &vec![1, 2048]
    );
    assert!(!by_name.contains_key("mtp.layers.0.mlp.gate_proj.weight"));
    assert_eq!(
        p.iter()
            .filter(|t| t.name.starts_with("mtp.layers.0.mlp.experts."))
            .count(),
        3 * 256
    );
    assert_eq!(
        by_name["model.visual.merger.linear_fc2.weight"],
        &vec![2048, 4608]
    );

    let s = shards(&p, DEFAULT_SHARD_BYTES);
    assert!(s.iter().all(|s| s.bytes <= DEFAULT_SHARD_BYTES));
    assert_eq!(s.iter().map(|s| s.tensors.len()).sum::<usize>(), p.len());

    // The 4-layer slice on disk: its tensors in bf16 plus the headers, config and index (a few MB).
    let opts = SynthOptions {
        arch: Arch::Qwen35_35bA3b,
        layers: 4,
        seed: 0,
        shard_bytes: DEFAULT_SHARD_BYTES,
    };
    let slice = plan(Arch::Qwen35_35bA3b, 4).unwrap();
    let tensors: u64 = slice.iter().map(|t| t.bytes()).sum();
    let planned = planned_bytes(&opts).unwrap();
    assert!(
        planned > tensors && planned < tensors + (16 << 20),
        "{planned} {tensors}"
    );
    // 4 layers of experts (6.44 GB), embedding and LM head (2.03 GB), the MTP layer (1.68 GB), the vision tower.
    assert!((11.0e9..12.0e9).contains(&(tensors as f64)), "{tensors}");
}

fn tiny(seed: u64) -> SynthOptions {
    SynthOptions {
        arch: Arch::TinyMoe,
        layers: 4,
        seed,
        shard_bytes: 200_000,
    }
}

fn write(dir: &Path, opts: &SynthOptions) {
    write_checkpoint(dir, opts, &mut |_, _| {}).unwrap();
}

/// Every file of a directory, by name.
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

/// Every tensor's shape, from the shards' headers.
fn shapes(dir: &Path) -> BTreeMap<String, Vec<usize>> {
    let mut out = BTreeMap::new();
    for (name, bytes) in files(dir) {
        if name.ends_with(".safetensors") {
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (key, view) in st.tensors() {
                assert_eq!(view.dtype(), safetensors::Dtype::BF16, "{key}");
                out.insert(key, view.shape().to_vec());
            }
        }
    }
    out
}

#[test]
fn the_tiny_moe_arch_is_read_as_moe_and_runs_greedily() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    write(dir, &tiny(4));
    let c = Config::from_file(&dir.join("config.json")).unwrap();
    assert_eq!(
        c.moe,
        Some(MoeConfig {
            num_experts: 8,
            num_experts_per_tok: 2,
            moe_intermediate_size: 32,
            shared_expert_intermediate_size: 48,
        })
    );
    let shapes = shapes(dir);
    for i in 0..4 {
        let key = |k: &str| format!("{PREFIX}layers.{i}.mlp.{k}");
        assert_eq!(shapes[&key("experts.gate_up_proj")], [8, 64, 64]);
        assert_eq!(shapes[&key("experts.down_proj")], [8, 64, 32]);
        assert_eq!(shapes[&key("gate.weight")], [8, 64]);
        assert_eq!(shapes[&key("shared_expert.up_proj.weight")], [48, 64]);
        assert_eq!(shapes[&key("shared_expert.down_proj.weight")], [64, 48]);
        assert_eq!(shapes[&key("shared_expert_gate.weight")], [1, 64]);
        assert!(!shapes.contains_key(&key("experts.0.gate_proj.weight")));
        assert!(!shapes.contains_key(&key("gate_proj.weight")));
    }
    assert_eq!(
        shapes["mtp.layers.0.mlp.experts.7.up_proj.weight"],
        [32, 64]
    );
    assert_eq!(shapes["lm_head.weight"], [512, 64]);
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(
        map.keys().cloned().collect::<BTreeSet<_>>(),
        shapes.keys().cloned().collect()
    );

    // A greedy run of a prompt and 8 single-token steps: finite logits of sane spread, the router spreading the
    // tokens over the experts.
    let model = Model::load(dir, DType::F32).unwrap();
    let mut state = model.new_state().unwrap();
    let ids: Vec<u32> = (0..24).map(|i| (i * 37 % 512) as u32).collect();
    let mut taps = Taps::on();
    let mut logits = model
        .forward(&ids, &mut state, &RunOptions::default(), &mut taps)
        .unwrap();
    let chosen: Vec<Vec<i64>> = taps.tensors()["layers.1.mlp.experts_chosen"]
        .to_vec2()
        .unwrap();
    let hit: BTreeSet<i64> = chosen.iter().flatten().copied().collect();
    assert!(hit.len() >= 6, "the prompt reached only experts {hit:?}");
    let mut generated = Vec::new();
    for _ in 0..8 {
        let v: Vec<f32> = logits.to_vec1().unwrap();
        assert_eq!(v.len(), 512);
        assert!(v.iter().all(|x| x.is_finite()));
        let rms = (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
        assert!((0.2..5.0).contains(&rms), "logit RMS {rms}");
        let next = v
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32;
        generated.push(next);
        logits = model
            .forward(
                &[next],
                &mut state,
                &RunOptions::default(),
                &mut Taps::off(),
            )
            .unwrap();
    }
    assert_eq!(generated.len(), 8);
}

#[test]
fn the_tiny_moe_arch_is_byte_identical_for_a_seed() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, c) = (
        tmp.path().join("a"),
        tmp.path().join("b"),
        tmp.path().join("c"),
    );
    write(&a, &tiny(7));
    let one_thread = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    one_thread.install(|| write(&b, &tiny(7)));
    write(&c, &tiny(8));
    let (fa, fb, fc) = (files(&a), files(&b), files(&c));
    assert!(fa.len() > 3, "{:?}", fa.keys());
    assert_eq!(fa.keys().collect::<Vec<_>>(), fb.keys().collect::<Vec<_>>());
    for (name, bytes) in &fa {
        assert!(fb[name] == *bytes, "{name} differs between two runs");
        if name.ends_with(".safetensors") {
            assert!(fc[name] != *bytes, "{name}: another seed, the same bytes");
        }
    }
}
