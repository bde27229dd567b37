//! One test per numeric convention a port got wrong (SPEC; the candle port's bug hunt): decay sign, conv
//! orientation, gate split, partial rotary, norm weight offset, head repeat order, eps source. Each recomputes the
//! convention by hand from the weights and compares with what the model did.

use crate::common::*;
use candle_core::{DType, Device, Tensor};
use reference::config::Config;
use reference::deltanet::{Inputs, sequential};
use reference::linear_attn::causal_conv;
use reference::model::{Model, RunOptions};
use reference::ops::{gated_rms_norm, l2_normalize, linear, repeat_interleave, rms_norm, sigmoid};
use reference::rope::{Positions, Rope};
use reference::synthetic::{random_weights, small_config_json, write_safetensors};
use reference::taps::Taps;
use std::collections::BTreeMap;

struct Checkpoint {
    _dir: tempfile::TempDir,
    weights: BTreeMap<String, Tensor>,
    model: Model,
    taps: Taps,
}

/// Writes a random f64 checkpoint for `config`, loads it, and runs `tokens` tokens with taps on.
fn run_random(config: serde_json::Value, seed: u64, tokens: usize) -> Checkpoint {
    let dir = tempfile::tempdir().unwrap();
    let text = config.to_string();
    std::fs::write(dir.path().join("config.json"), &text).unwrap();
    let parsed = Config::from_json_str(&text, "config.json").unwrap();
    let weights = random_weights(&parsed, "model.", seed).unwrap();
    write_safetensors(&dir.path().join("model.safetensors"), &weights, DType::F32).unwrap();
    let weights = weights
        .into_iter()
        .map(|(k, v)| (k, v.to_dtype(DType::F64).unwrap()))
        .collect();
    let model = Model::load(dir.path(), DType::F64).unwrap();
    let ids: Vec<u32> = (0..tokens as u32)
        .map(|i| (i * 7 + 3) % parsed.vocab_size as u32)
        .collect();
    let mut taps = Taps::on();
    model
        .prefill(
            &ids,
            &mut model.new_state().unwrap(),
            &RunOptions::default(),
            &mut taps,
        )
        .unwrap();
    Checkpoint {
        _dir: dir,
        weights,
        model,
        taps,
    }
}

/// Layer 0's input (`input_layernorm(embeddings)`).
fn layer0_input(c: &Checkpoint) -> Tensor {
    let eps = c.model.config().rms_norm_eps;
    rms_norm(
        c.taps.get("embeddings").unwrap(),
        &c.weights["model.layers.0.input_layernorm.weight"],
        eps,
    )
    .unwrap()
}

/// Decay sign: `g = −exp(A_log) · softplus(a + dt_bias)` is a log-decay, never positive, whatever the sign of
/// `A_log` (a port that negated it again turned decay into growth).
#[test]
fn decay_is_never_positive() {
    let mut config = small_config_json();
    config["layer_types"] = serde_json::json!(["linear_attention", "linear_attention"]);
    config["num_hidden_layers"] = 2.into();
    let c = run_random(config, 21, 30);
    let x = layer0_input(&c);
    let a = linear(
        &x,
        &c.weights["model.layers.0.linear_attn.in_proj_a.weight"],
    )
    .unwrap();
    let a_log = &c.weights["model.layers.0.linear_attn.A_log"];
    let dt_bias = &c.weights["model.layers.0.linear_attn.dt_bias"];
    let sp = (a.broadcast_add(dt_bias).unwrap().exp().unwrap() + 1.0)
        .unwrap()
        .log()
        .unwrap();
    let expected = a_log
        .exp()
        .unwrap()
        .neg()
        .unwrap()
        .unsqueeze(0)
        .unwrap()
        .broadcast_mul(&sp)
        .unwrap();
    let g = c.taps.get("layers.0.linear_attn.g").unwrap();
    assert_close("g", g, &expected, 1e-12);
    let values: Vec<f64> = g.flatten_all().unwrap().to_vec1().unwrap();
    assert!(values.iter().all(|&v| v <= 0.0), "a log-decay is positive");
    assert!(values.iter().any(|&v| v < -1e-3), "decays are degenerate");
}

/// Conv orientation: `weight[:, K−1]` multiplies the current token, `weight[:, 0]` the oldest (PyTorch's
/// left-padded Conv1d); and the carried state hands over exactly.
#[test]
fn conv_kernel_orientation() {
    let dev = Device::Cpu;
    let x = Tensor::new(&[[1.0f64], [0.0], [0.0], [0.0], [0.0]], &dev).unwrap(); // an impulse, one channel
    let w = Tensor::new(&[[10.0f64, 20.0, 30.0, 40.0]], &dev).unwrap();
    let zero = Tensor::zeros((1, 4), DType::F64, &dev).unwrap();
    let (out, state) = causal_conv(&x, &zero, &w).unwrap();
    let out: Vec<f64> = out.flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(out, vec![40.0, 30.0, 20.0, 10.0, 0.0]);
    assert_eq!(
        state.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
        vec![0.0, 0.0, 0.0, 0.0]
    );
    // Split in two with the state carried.
    let (a, s) = causal_conv(&x.narrow(0, 0, 2).unwrap(), &zero, &w).unwrap();
    assert_eq!(
        s.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
        vec![0.0, 0.0, 1.0, 0.0]
    );
    let (b, _) = causal_conv(&x.narrow(0, 2, 3).unwrap(), &s, &w).unwrap();
    let joined: Vec<f64> = Tensor::cat(&[a, b], 0)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(joined, out);
}

/// Gate split and GQA head order: `q_proj` is `[H, 2D]` per head (query then gate), and query head `h` reads kv
/// head `h / (H / Hkv)`. With one token the attention output is the value itself, so the o_proj input must be
/// `v[h / G] · sigmoid(gate_h)`.
#[test]
fn gate_split_and_kv_head_order() {
    let mut config = small_config_json();
    config["layer_types"] = serde_json::json!(["full_attention"]);
    config["num_hidden_layers"] = 1.into();
    config["num_attention_heads"] = 4.into();
    config["num_key_value_heads"] = 2.into();
    let c = run_random(config, 5, 1);
    let cfg = c.model.config();
    let (nh, nkv, d) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let x = layer0_input(&c);
    let qg = linear(&x, &c.weights["model.layers.0.self_attn.q_proj.weight"])
        .unwrap()
        .reshape((nh, 2 * d))
        .unwrap();
    let v = linear(&x, &c.weights["model.layers.0.self_attn.v_proj.weight"])
        .unwrap()
        .reshape((nkv, d))
        .unwrap();
    let expected: Vec<Tensor> = (0..nh)
        .map(|h| {
            let gate = qg.get(h).unwrap().narrow(0, d, d).unwrap();
            (v.get(h / (nh / nkv)).unwrap() * sigmoid(&gate).unwrap()).unwrap()
        })
        .collect();
    let expected = Tensor::cat(&expected, 0).unwrap().unsqueeze(0).unwrap();
    assert_close(
        "o_proj input",
        c.taps.get("layers.0.self_attn.gated_output").unwrap(),
        &expected,
        1e-12,
    );
}

/// Partial rotary: only the first `rd` dims rotate, dim `i` pairs with `i + rd/2` (rotate-half), the rest pass
/// through, and norms are preserved.
#[test]
fn partial_rotary_pairs_and_passthrough() {
    let mut config = small_config_json();
    config["rope_parameters"]["partial_rotary_factor"] = 0.25.into(); // head_dim 16 → rd 4
    config["rope_parameters"]["mrope_section"] = serde_json::json!([1, 1, 0]);
    let cfg = Config::from_json_str(&config.to_string(), "config.json").unwrap();
    let rope = Rope::new(&cfg);
    let (d, rd) = (cfg.head_dim, cfg.rotary_dim());
    assert_eq!(rd, 4);
    let pos = 3usize;
    // inv_freq as the checkpoint defines it (transformers' f32 buffer): 1 / theta^(2i/rd), rounded to f32.
    let inv_freq =
        |i: usize| (1.0f32 / (cfg.rope.theta.powf(2.0 * i as f64 / rd as f64) as f32)) as f64;
    let tables = rope
        .tables(&Positions::text(pos, 1), DType::F64, &Device::Cpu)
        .unwrap();
    for i in 0..d {
        let mut e = vec![0.0f64; d];
        e[i] = 1.0;
        let x = Tensor::from_vec(e, (1, 1, d), &Device::Cpu).unwrap();
        let y: Vec<f64> = tables
            .apply(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        if i < rd / 2 {
            let angle = pos as f64 * inv_freq(i);
            assert!(
                (y[i] - angle.cos()).abs() < 1e-15 && (y[i + rd / 2] - angle.sin()).abs() < 1e-15,
                "dim {i}: {y:?}"
            );
        } else if i < rd {
            let j = i - rd / 2;
            let angle = pos as f64 * inv_freq(j);
            assert!(
                (y[i] - angle.cos()).abs() < 1e-15 && (y[j] + angle.sin()).abs() < 1e-15,
                "dim {i}: {y:?}"
            );
        } else {
            let mut e = vec![0.0f64; d];
            e[i] = 1.0;
            assert_eq!(y, e, "dim {i} beyond the rotary slice moved");
        }
    }
}

/// Norm weight offset: the RMSNorms scale by `1 + w` (zero-centred weights), the gated norm by the plain `w`.
/// Recomputed for the final norm and for layer 0's gated norm (through its mixer output).
#[test]
fn norm_weight_conventions() {
    let mut config = small_config_json();
    config["layer_types"] = serde_json::json!(["linear_attention"]);
    config["num_hidden_layers"] = 1.into();
    let c = run_random(config, 9, 12);
    let eps = c.model.config().rms_norm_eps;
    let h = c.taps.get("layers.0.output").unwrap();
    let w = &c.weights["model.norm.weight"];
    let rms = h
        .sqr()
        .unwrap()
        .mean_keepdim(1)
        .unwrap()
        .affine(1.0, eps)
        .unwrap()
        .sqrt()
        .unwrap();
    let expected = h
        .broadcast_div(&rms)
        .unwrap()
        .broadcast_mul(&(w + 1.0).unwrap())
        .unwrap();
    assert_close(
        "final norm",
        c.taps.get("final_norm").unwrap(),
        &expected,
        1e-12,
    );
    check_gated_norm(&c, eps);
}

/// Recomputes layer 0's mixer output from its `core_output` tap: `out_proj(w · norm(o) · silu(z))` with the
/// config's eps.
fn check_gated_norm(c: &Checkpoint, eps: f64) {
    let cfg = c.model.config();
    let (hv, dv) = (cfg.linear_num_value_heads, cfg.linear_value_head_dim);
    let x = layer0_input(c);
    let t = x.dim(0).unwrap();
    let z = linear(
        &x,
        &c.weights["model.layers.0.linear_attn.in_proj_z.weight"],
    )
    .unwrap()
    .reshape((t, hv, dv))
    .unwrap();
    let core = c.taps.get("layers.0.linear_attn.core_output").unwrap();
    let normed = gated_rms_norm(
        core,
        &z,
        &c.weights["model.layers.0.linear_attn.norm.weight"],
        eps,
    )
    .unwrap();
    let out = linear(
        &normed.reshape((t, hv * dv)).unwrap(),
        &c.weights["model.layers.0.linear_attn.out_proj.weight"],
    )
    .unwrap();
    assert_close(
        "mixer output",
        c.taps.get("layers.0.mixer_output").unwrap(),
        &out,
        1e-10,
    );
}

/// Head repeat order and eps source: value head `j` uses key head `j / (Hv/Hk)` (repeat-interleave, not tile); the
/// q/k l2 norm uses a fixed 1e-6 while the gated norm uses `rms_norm_eps` (set large here so a mix-up shows).
#[test]
fn head_repeat_order_and_eps_sources() {
    let mut config = small_config_json();
    config["layer_types"] = serde_json::json!(["linear_attention"]);
    config["num_hidden_layers"] = 1.into();
    config["linear_num_key_heads"] = 2.into();
    config["linear_num_value_heads"] = 4.into();
    config["rms_norm_eps"] = 0.05.into();
    let c = run_random(config, 13, 20);
    let cfg = c.model.config();
    let group = cfg.linear_num_value_heads / cfg.linear_num_key_heads;
    let tap = |n: &str| {
        c.taps
            .get(&format!("layers.0.linear_attn.{n}"))
            .unwrap()
            .clone()
    };
    let heads_first = |x: Tensor| x.transpose(0, 1).unwrap().contiguous().unwrap();
    let q = (l2_normalize(&tap("query"), 1e-6).unwrap()
        * (cfg.linear_key_head_dim as f64).powf(-0.5))
    .unwrap();
    let k = l2_normalize(&tap("key"), 1e-6).unwrap();
    let core_with = |repeat: &dyn Fn(&Tensor) -> Tensor| {
        let x = Inputs {
            q: repeat(&heads_first(q.clone())),
            k: repeat(&heads_first(k.clone())),
            v: heads_first(tap("value")),
            g: heads_first(tap("g")),
            beta: heads_first(tap("beta")),
        };
        let zero = Tensor::zeros(
            (
                cfg.linear_num_value_heads,
                cfg.linear_key_head_dim,
                cfg.linear_value_head_dim,
            ),
            DType::F64,
            &Device::Cpu,
        )
        .unwrap();
        sequential(&x, &zero).unwrap().0.transpose(0, 1).unwrap()
    };
    let interleaved = core_with(&|x: &Tensor| repeat_interleave(x, group, 0).unwrap());
    let tiled = core_with(&|x: &Tensor| Tensor::cat(&vec![x.clone(); group], 0).unwrap());
    assert_close("core output", &tap("core_output"), &interleaved, 1e-10);
    let d = reference::compare::diff(&tap("core_output"), &tiled).unwrap();
    assert!(
        d.relative() > 1e-3,
        "tiled heads give the same output: the test cannot tell the orders apart"
    );
    check_gated_norm(&c, cfg.rms_norm_eps);
}
