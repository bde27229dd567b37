//! The decoder's blocks at Qwen3.5-9B's real sizes: a Gated DeltaNet mixer (16 key / 32 value heads of 128, conv
//! kernel 4), a gated full-attention mixer (16 query / 4 KV heads of 256, rotary dim 64) and the SwiGLU MLP (4096 →
//! 12288 → 4096), each on `T` tokens of a prompt (`T{T}`), and one decode step (`T1_ctx{P}`, after P tokens: the KV
//! cache holds P tokens, the DeltaNet state is the one they left).
//!
//! The weights come from a random two-layer checkpoint (a linear-attention then a full-attention layer, a
//! 256-token vocabulary), written to a temporary directory in bf16 and loaded in f32 as the reference loads a real one.
//! Names are `block/{linear_attn|attention|mlp}/T{T}`; the mixers run in their default forms (chunks of 64 with
//! forward substitution for prompts, the matrix form for decode steps).
//!
//! `cargo bench -p reference --bench blocks [-- FILTER]`.
#![allow(clippy::disallowed_methods)] // tests read their fixtures with std::fs; inputs::open is the library's rule

use candle_core::{DType, Device, Tensor};
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use reference::attention::{Attention, KvCache};
use reference::config::Config;
use reference::linear_attn::{DeltaNetOptions, GatedDeltaNet, LinearState};
use reference::mlp::Mlp;
use reference::model::RunOptions;
use reference::rope::{Positions, Rope};
use reference::synthetic::{random_weights, small_config_json, write_safetensors};
use reference::taps::Taps;
use reference::weights::WeightStore;
use std::time::Duration;

fn config_json() -> serde_json::Value {
    let mut c = small_config_json();
    for (k, v) in [
        ("hidden_size", 4096),
        ("intermediate_size", 12288),
        ("num_hidden_layers", 2),
        ("num_attention_heads", 16),
        ("num_key_value_heads", 4),
        ("head_dim", 256),
        ("linear_num_key_heads", 16),
        ("linear_num_value_heads", 32),
        ("linear_key_head_dim", 128),
        ("linear_value_head_dim", 128),
        ("linear_conv_kernel_dim", 4),
        ("vocab_size", 256),
    ] {
        c[k] = v.into();
    }
    c["layer_types"] = serde_json::json!(["linear_attention", "full_attention"]);
    c["rope_parameters"]["partial_rotary_factor"] = 0.25.into();
    c["rope_parameters"]["mrope_section"] = serde_json::json!([11, 11, 10]);
    c
}

struct Blocks {
    config: Config,
    linear: GatedDeltaNet,
    attention: Attention,
    mlp: Mlp,
}

fn blocks() -> Blocks {
    let dir = tempfile::tempdir().unwrap();
    let value = config_json();
    let text = value.to_string();
    std::fs::write(dir.path().join("config.json"), &text).unwrap();
    let config = Config::from_json_str(&text, "bench config").unwrap();
    let weights = random_weights(&config, "model.", 3).unwrap();
    write_safetensors(&dir.path().join("model.safetensors"), &weights, DType::BF16).unwrap();
    drop(weights);
    let store = WeightStore::open(dir.path(), DType::F32).unwrap();
    Blocks {
        linear: GatedDeltaNet::load(&store, 0, &config).unwrap(),
        attention: Attention::load(&store, 1, &config).unwrap(),
        mlp: Mlp::load(&store, 0, &config).unwrap(),
        config,
    }
}

fn input(t: usize) -> Tensor {
    Tensor::randn(0f32, 1.0, (t, 4096), &Device::Cpu).unwrap()
}

fn bench_blocks(c: &mut Criterion) {
    let b = blocks();
    let opts = RunOptions::default();
    let prefill = DeltaNetOptions {
        form: opts.prefill,
        output_scale: 1.0,
    };
    let decode = DeltaNetOptions {
        form: opts.decode,
        output_scale: 1.0,
    };
    let rope = Rope::new(&b.config);
    let tables = |start: usize, t: usize| {
        rope.tables(&Positions::text(start, t), DType::F32, &Device::Cpu)
            .unwrap()
    };
    let mut group = c.benchmark_group("block");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    for t in [16, 256, 1024, 4096] {
        let x = input(t);
        group.bench_with_input(
            BenchmarkId::new("linear_attn", format!("T{t}")),
            &t,
            |bn, _| {
                bn.iter(|| {
                    let mut state = b.linear.zero_state(DType::F32).unwrap();
                    b.linear
                        .forward(&x, &mut state, &prefill, &mut Taps::off(), "l")
                        .unwrap()
                })
            },
        );
        group.bench_with_input(BenchmarkId::new("mlp", format!("T{t}")), &t, |bn, _| {
            bn.iter(|| b.mlp.forward(&x).unwrap())
        });
        if t <= 1024 {
            let rot = tables(0, t);
            group.bench_with_input(
                BenchmarkId::new("attention", format!("T{t}")),
                &t,
                |bn, _| {
                    bn.iter(|| {
                        let mut cache = KvCache::default();
                        b.attention
                            .forward(&x, &mut cache, &rot, &mut Taps::off(), "a")
                            .unwrap()
                    })
                },
            );
        }
    }
    // Decode steps after a prompt of P tokens.
    for p in [256, 1024] {
        let prompt = input(p);
        let mut state: LinearState = b.linear.zero_state(DType::F32).unwrap();
        b.linear
            .forward(&prompt, &mut state, &prefill, &mut Taps::off(), "l")
            .unwrap();
        let mut cache = KvCache::default();
        b.attention
            .forward(&prompt, &mut cache, &tables(0, p), &mut Taps::off(), "a")
            .unwrap();
        let x = input(1);
        let rot = tables(p, 1);
        let id = format!("T1_ctx{p}");
        group.bench_with_input(BenchmarkId::new("linear_attn", &id), &p, |bn, _| {
            bn.iter(|| {
                let mut s = state.clone();
                b.linear
                    .forward(&x, &mut s, &decode, &mut Taps::off(), "l")
                    .unwrap()
            })
        });
        group.bench_with_input(BenchmarkId::new("attention", &id), &p, |bn, _| {
            bn.iter(|| {
                let mut kv = cache.clone();
                b.attention
                    .forward(&x, &mut kv, &rot, &mut Taps::off(), "a")
                    .unwrap()
            })
        });
    }
    let x = input(1);
    group.bench_with_input(BenchmarkId::new("mlp", "T1"), &1, |bn, _| {
        bn.iter(|| b.mlp.forward(&x).unwrap())
    });
    group.finish();
}

criterion_group!(benches, bench_blocks);
criterion_main!(benches);
