//! Random checkpoints and tensors, deterministic from a seed: for property tests, error-path tests and benches.
//! (The golden models under `testdata/` come from transformers, not from here.)

use crate::config::Config;
use crate::error::{Error, Result};
use crate::io::save_safetensors;
use crate::schema::{Param, Role, Schema};
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

/// A small deterministic generator (SplitMix64).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `[lo, hi)`.
    pub fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.uniform()
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// A tensor of `N(0, std²)` values.
    pub fn normal_tensor(&mut self, shape: &[usize], std: f64, dtype: DType) -> Result<Tensor> {
        let n = shape.iter().product();
        let data: Vec<f64> = (0..n).map(|_| std * self.normal()).collect();
        Ok(Tensor::from_vec(data, shape, &Device::Cpu)?.to_dtype(dtype)?)
    }

    /// A tensor of values uniform in `[lo, hi)`.
    pub fn uniform_tensor(
        &mut self,
        shape: &[usize],
        lo: f64,
        hi: f64,
        dtype: DType,
    ) -> Result<Tensor> {
        let n = shape.iter().product();
        let data: Vec<f64> = (0..n).map(|_| self.range(lo, hi)).collect();
        Ok(Tensor::from_vec(data, shape, &Device::Cpu)?.to_dtype(dtype)?)
    }
}

/// Delta-rule inputs `[H, T, ·]` as the layer makes them, from `seed`: l2-normalised keys, l2-normalised queries
/// scaled by `Dk^-0.5` (both drawn and normalised in f64), values `N(0, 1)`, decays uniform in `[g_min, 0]`, beta
/// uniform in `[0.01, 0.99)`; and a non-zero incoming state `[H, Dk, Dv]` (`N(0, 0.25)`), all in `dtype`.
pub fn delta_rule_inputs(
    seed: u64,
    [h, t, dk, dv]: [usize; 4],
    g_min: f64,
    dtype: DType,
) -> Result<(crate::deltanet::Inputs, Tensor)> {
    use crate::ops::l2_normalize;
    let mut rng = Rng::new(seed);
    let q = rng.normal_tensor(&[h, t, dk], 1.0, DType::F64)?;
    let k = rng.normal_tensor(&[h, t, dk], 1.0, DType::F64)?;
    let q = (l2_normalize(&q, 1e-6)? * (dk as f64).powf(-0.5))?;
    let k = l2_normalize(&k, 1e-6)?;
    let inputs = crate::deltanet::Inputs {
        q: q.to_dtype(dtype)?,
        k: k.to_dtype(dtype)?,
        v: rng.normal_tensor(&[h, t, dv], 1.0, dtype)?,
        g: rng.uniform_tensor(&[h, t], g_min, 0.0, dtype)?,
        beta: rng.uniform_tensor(&[h, t], 0.01, 0.99, dtype)?,
    };
    let state = rng.normal_tensor(&[h, dk, dv], 0.5, dtype)?;
    Ok((inputs, state))
}

/// A flat (`qwen3_5_text`) config of a small model; edit the JSON to vary it.
pub fn small_config_json() -> serde_json::Value {
    serde_json::json!({
        "model_type": "qwen3_5_text",
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6, "vocab_size": 97, "tie_word_embeddings": false,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": true}
    })
}

/// The name, shape and initial values of every decoder tensor of `config` ([`Schema::tensors`]), under `prefix`
/// (`model.`), plus `lm_head.weight` unless the embeddings are tied. Weights are random but well-conditioned: per-token
/// decays spread over `0.01..1`, non-trivial norm weights, projections that move the residual stream.
pub fn random_weights(
    config: &Config,
    prefix: &str,
    seed: u64,
) -> Result<BTreeMap<String, Tensor>> {
    let mut rng = Rng::new(seed);
    let f = DType::F32;
    let proj = 0.6 / (config.hidden_size as f64).sqrt();
    let mut out = BTreeMap::new();
    for spec in Schema::new(config).tensors() {
        let shape = spec.shape.as_slice();
        let value = match spec.param {
            Param::EmbedTokens | Param::LmHead => rng.normal_tensor(shape, 1.0, f)?,
            Param::Conv1d => rng.normal_tensor(shape, 0.5, f)?,
            Param::ALog => rng.uniform_tensor(shape, -3.0, 1.5, f)?,
            Param::DtBias => rng.uniform_tensor(shape, -2.0, 2.0, f)?,
            Param::LinearNorm => (rng.normal_tensor(shape, 0.2, f)? + 1.0)?,
            p => match p.role() {
                Role::Norm => rng.normal_tensor(shape, 0.2, f)?,
                _ => rng.normal_tensor(shape, proj, f)?,
            },
        };
        out.insert(spec.full_name(prefix), value);
    }
    Ok(out)
}

/// Writes `tensors` to a safetensors file, converted to `dtype` (F32, F64, F16 or BF16).
pub fn write_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, Tensor>,
    dtype: DType,
) -> Result<()> {
    let converted = tensors
        .iter()
        .map(|(k, v)| Ok((k.clone(), v.to_dtype(dtype)?)))
        .collect::<Result<BTreeMap<_, _>>>()?;
    save_safetensors(path, &converted, &BTreeMap::new())
}

/// Writes a random checkpoint (`config.json` + `model.safetensors`, f32, `model.` names) for `config_json`.
pub fn write_checkpoint(dir: &Path, config_json: &serde_json::Value, seed: u64) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let text =
        serde_json::to_string_pretty(config_json).map_err(|e| Error::Input(e.to_string()))?;
    let config_path = dir.join("config.json");
    std::fs::write(&config_path, &text).map_err(|e| Error::io(&config_path, e))?;
    let config = Config::from_json_str(&text, &config_path.display().to_string())?;
    let tensors = random_weights(&config, "model.", seed)?;
    write_safetensors(&dir.join("model.safetensors"), &tensors, DType::F32)
}
