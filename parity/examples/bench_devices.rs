//! Times the reference and the OpenVINO graphs (compile, prompt, decode) on a random checkpoint of a chosen size.
//!
//! `cargo run --release -p parity --example bench_devices -- [hidden] [layers] [prompt] [decode] [block]`
//! (defaults 1024 4 256 16 64; the layer pattern is L L L F repeated, heads scaled from Qwen3.5-9B's).
//! Prints figures only: timings are benchmark results, never test assertions.
#![allow(clippy::disallowed_methods)] // an example reads its files with std::fs; inputs::open is the library's rule

use candle_core::DType;
use npu::devices::CompileOptions;
use npu::engine::DecoderEngine;
use npu::graphs::{Builder, GraphOptions};
use reference::backend::{ReferenceBackend, greedy};
use reference::model::{Model, RunOptions};
use reference::synthetic::{Rng, small_config_json, write_checkpoint};
use reference::weights::WeightStore;
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    let get = |i: usize, d: usize| args.get(i).copied().unwrap_or(d);
    let (hidden, layers, prompt, decode, block) =
        (get(0, 1024), get(1, 4), get(2, 256), get(3, 16), get(4, 64));
    let mut c = small_config_json();
    let heads = (hidden / 256).max(1);
    c["hidden_size"] = hidden.into();
    c["intermediate_size"] = (hidden * 3).into();
    c["num_hidden_layers"] = layers.into();
    c["layer_types"] = (0..layers)
        .map(|i| {
            if (i + 1) % 4 == 0 {
                "full_attention"
            } else {
                "linear_attention"
            }
        })
        .collect::<Vec<_>>()
        .into();
    c["num_attention_heads"] = (4 * heads).into();
    c["num_key_value_heads"] = heads.into();
    c["head_dim"] = 256.into();
    c["linear_num_key_heads"] = (4 * heads).into();
    c["linear_num_value_heads"] = (8 * heads).into();
    c["linear_key_head_dim"] = 128.into();
    c["linear_value_head_dim"] = 128.into();
    c["vocab_size"] = 8192.into();
    c["rope_parameters"]["partial_rotary_factor"] = 0.25.into();
    c["rope_parameters"]["mrope_section"] = serde_json::json!([11, 11, 10]);
    let dir = tempfile::tempdir()?;
    write_checkpoint(dir.path(), &c, 1)?;
    if let Ok(keep) = std::env::var("BENCH_KEEP") {
        // Keep a copy of the checkpoint for other tools (e.g. `qwen35 export-ir --model`).
        std::fs::create_dir_all(&keep)?;
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(dir.path().join(f), std::path::Path::new(&keep).join(f))?;
        }
        return Ok(());
    }
    let mut rng = Rng::new(2);
    let ids: Vec<u32> = (0..prompt)
        .map(|_| (rng.next_u64() % 8192) as u32)
        .collect();
    println!(
        "random checkpoint: hidden {hidden}, {layers} layers, vocab 8192; prompt {prompt}, decode {decode}"
    );

    let model = Model::load(dir.path(), DType::F32)?;
    let config = model.config().clone();
    let mut reference = ReferenceBackend::new(model, RunOptions::default(), false, "f32")?;
    let r = greedy(&mut reference, &ids, decode + 1, &[], false, |_| Ok(()))?;
    println!(
        "reference f32:         prompt {:.1} tok/s ({:.2} s), decode {:.1} tok/s",
        prompt as f64 / r.prompt_seconds,
        r.prompt_seconds,
        decode as f64 / r.decode_seconds
    );

    let store = WeightStore::open(dir.path(), DType::F32)?;
    let builder = Builder::new(
        &config,
        &store,
        GraphOptions {
            context: prompt + decode,
            taps: false,
            ..GraphOptions::default()
        },
    )?;
    let t = Instant::now();
    let mut engine = DecoderEngine::new(&builder, block, "CPU", &CompileOptions::default())?;
    let compile = t.elapsed().as_secs_f64();
    let d = greedy(&mut engine, &ids, decode + 1, &[], false, |_| Ok(()))?;
    println!(
        "OpenVINO CPU f32 (block {block}): compile {compile:.2} s (graphs for {block} and 1 tokens), prompt {:.1} tok/s \
         ({:.2} s), decode {:.1} tok/s (logits and states only, as deployed)",
        prompt as f64 / d.prompt_seconds,
        d.prompt_seconds,
        decode as f64 / d.decode_seconds.max(1e-9)
    );
    Ok(())
}
