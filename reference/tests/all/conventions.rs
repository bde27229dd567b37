//! One test per numeric convention a port got wrong (SPEC; the candle port's bug hunt): decay sign, conv
//! orientation, gate split, partial rotary, norm weight offset, head repeat order, eps source. Each recomputes the
//! convention by hand from the weights and compares with what the model did.

use crate::common::*;
use candle_core::{DType, Device, Tensor};
use reference::config::Config;
use reference::deltanet::{Inputs, sequential};
use reference::linear_attn::causal_conv;
use reference::model::{Model, RunOptions};
use reference::ops::{l2_normalize, linear, repeat_interleave, rms_norm, sigmoid};
use reference::rope::{Positions, Rope};
use reference::synthetic::{random_weights, small_config_json, write_safetensors};
use reference::taps::Taps;
use std::collections::BTreeMap;

struct Checkpoint {
    _dir: tempfile::TempDir,
    weights: BTreeMap<String, Tensor>,
    model: Model,
    ids: Vec<u32>,
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
        ids,
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
/// Recomputed by hand for layer 0's input norm and gated norm (through its mixer output), its post-attention norm
/// (through its MLP output) and the final norm.
#[test]
fn norm_weight_conventions() {
    let mut config = small_config_json();
    config["layer_types"] = serde_json::json!(["linear_attention"]);
    config["num_hidden_layers"] = 1.into();
    let eps = 1e-6;
    config["rms_norm_eps"] = eps.into();
    let c = run_random(config, 9, 12);
    let w = |name: &str| values(&c.weights[&format!("model.{name}")]);
    let tap = |name: &str| values(c.taps.get(name).unwrap());
    let h = c.model.config().hidden_size;

    let expected = rms_norm_by_hand(&tap("layers.0.output"), &w("norm.weight"), eps);
    assert_close_by_hand(
        "final norm",
        c.taps.get("final_norm").unwrap(),
        &expected,
        1e-12,
    );

    // The MLP's input is the post-attention norm of the residual stream after the mixer.
    let residual: Vec<f64> = tap("embeddings")
        .iter()
        .zip(tap("layers.0.mixer_output"))
        .map(|(e, m)| e + m)
        .collect();
    let x = rms_norm_by_hand(
        &residual,
        &w("layers.0.post_attention_layernorm.weight"),
        eps,
    );
    let gate = linear_by_hand(&x, &w("layers.0.mlp.gate_proj.weight"), h);
    let up = linear_by_hand(&x, &w("layers.0.mlp.up_proj.weight"), h);
    let inner: Vec<f64> = gate.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect();
    let expected = linear_by_hand(
        &inner,
        &w("layers.0.mlp.down_proj.weight"),
        c.model.config().intermediate_size,
    );
    assert_close_by_hand(
        "mlp output",
        c.taps.get("layers.0.mlp_output").unwrap(),
        &expected,
        1e-12,
    );
    check_gated_norm(&c, eps);
}

/// A tensor's values as f64, flat in row-major order.
fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Compares a tensor with values computed by hand (same element order).
fn assert_close_by_hand(what: &str, actual: &Tensor, expected: &[f64], rtol: f64) {
    let expected = Tensor::from_vec(expected.to_vec(), actual.dims(), &Device::Cpu).unwrap();
    assert_close(what, actual, &expected, rtol);
}

/// `x Wᵀ` with loops: `x` `[T, n_in]`, `w` `[n_out, n_in]` → `[T, n_out]`.
fn linear_by_hand(x: &[f64], w: &[f64], n_in: usize) -> Vec<f64> {
    let n_out = w.len() / n_in;
    let mut out = Vec::with_capacity(x.len() / n_in * n_out);
    for row in x.chunks(n_in) {
        for o in 0..n_out {
            out.push((0..n_in).map(|j| row[j] * w[o * n_in + j]).sum());
        }
    }
    out
}

/// The zero-centred RMSNorm with loops, per row of `x` (rows as long as `w`):
/// `x[d] / sqrt(mean(x²) + eps) · (1 + w[d])`.
fn rms_norm_by_hand(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let n = w.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(n) {
        let mean_sq = row.iter().map(|v| v * v).sum::<f64>() / n as f64;
        let rms = (mean_sq + eps).sqrt();
        out.extend((0..n).map(|d| row[d] / rms * (1.0 + w[d])));
    }
    out
}

/// `x · sigmoid(x)`.
fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// Layer 0's mixer output recomputed with loops from the weights, the token ids and the recurrence's output `core`
/// `[T, Hv, Dv]`: the embeddings, the input norm with `1 + w`, `z = in_proj_z(x)`, then per token and value head
/// `w[d] · (S·o[d]) / sqrt(mean_d((S·o)²) + eps·S²) · silu(z[d])` with the plain weight `w` shared by the heads (the
/// output scale `S` cancels), then out_proj.
fn linear_mixer_by_hand(c: &Checkpoint, core: &[f64], eps: f64, scale: f64) -> Vec<f64> {
    let cfg = c.model.config();
    let (h, hv, dv) = (
        cfg.hidden_size,
        cfg.linear_num_value_heads,
        cfg.linear_value_head_dim,
    );
    let w = |name: &str| values(&c.weights[&format!("model.{name}")]);
    let embed = w("embed_tokens.weight");
    let embeddings: Vec<f64> = c
        .ids
        .iter()
        .flat_map(|&id| embed[id as usize * h..(id as usize + 1) * h].to_vec())
        .collect();
    let x = rms_norm_by_hand(&embeddings, &w("layers.0.input_layernorm.weight"), eps);
    let z = linear_by_hand(&x, &w("layers.0.linear_attn.in_proj_z.weight"), h);
    let norm_weight = w("layers.0.linear_attn.norm.weight");
    let mut normed = vec![0.0; core.len()];
    for (head, (o, z)) in core.chunks(dv).zip(z.chunks(dv)).enumerate() {
        let o: Vec<f64> = o.iter().map(|v| scale * v).collect();
        let mean_sq = o.iter().map(|v| v * v).sum::<f64>() / dv as f64;
        let rms = (mean_sq + eps * scale * scale).sqrt();
        for d in 0..dv {
            normed[head * dv + d] = norm_weight[d] * (o[d] / rms) * silu(z[d]);
        }
    }
    linear_by_hand(&normed, &w("layers.0.linear_attn.out_proj.weight"), hv * dv)
}

/// Holds layer 0's mixer output to [`linear_mixer_by_hand`] with the config's `eps`, in the checkpoint's run and in
/// a run with the fp16 output scale `S = 1024` (the gated norm's eps then `eps · S²`).
fn check_gated_norm(c: &Checkpoint, eps: f64) {
    let core = values(c.taps.get("layers.0.linear_attn.core_output").unwrap());
    let expected = linear_mixer_by_hand(c, &core, eps, 1.0);
    let actual = c.taps.get("layers.0.mixer_output").unwrap();
    assert_close_by_hand("mixer output", actual, &expected, 1e-12);

    let scale = 1024.0;
    let opts = RunOptions {
        output_scale: scale,
        ..RunOptions::default()
    };
    let mut taps = Taps::on();
    c.model
        .prefill(&c.ids, &mut c.model.new_state().unwrap(), &opts, &mut taps)
        .unwrap();
    // The tap is reported without the scale; in f64 scaling by a power of two is exact.
    let core = values(taps.get("layers.0.linear_attn.core_output").unwrap());
    let expected = linear_mixer_by_hand(c, &core, eps, scale);
    let actual = taps.get("layers.0.mixer_output").unwrap();
    assert_close_by_hand("mixer output, output scale 1024", actual, &expected, 1e-12);
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
    check_gated_norm(&c, 0.05);
}
