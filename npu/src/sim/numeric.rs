//! The arithmetic of an accelerator, as options: what values are stored in, whether subnormals survive, how matrix
//! products accumulate, what the state keeps between calls.

use crate::error::{Error, Result};
use half::{bf16, f16};
use std::fmt;

/// The format values are stored in: every constant, input and op result is rounded to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// IEEE half precision: 11 significant bits, largest finite 65504, smallest normal 2⁻¹⁴ (NPU-like).
    F16,
    /// bfloat16: 8 significant bits, f32's range.
    Bf16,
    /// f32, nothing rounded.
    F32,
}

/// How the terms of a matrix product (and of a reduction) are summed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accumulation {
    /// In f32 (the NPU-like default): each product term is rounded to the storage format, the sum is kept in f32
    /// and rounded once at the end.
    F32,
    /// In the storage format: every partial sum is rounded too.
    Storage,
}

/// The numeric model of the FP16SIM pseudo-device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NumericModel {
    /// What values are stored in.
    pub storage: Storage,
    /// Whether subnormal values of the storage format are flushed to zero (the NPU-like default).
    pub flush_subnormals: bool,
    /// How products and reductions accumulate.
    pub accumulation: Accumulation,
    /// Whether the states handed between calls are kept in f32 (the ops producing them compute in f32 and their
    /// inputs are not rounded) instead of the storage format.
    pub f32_state: bool,
    /// Whether normalizations (`x / sqrt(mean(x²) + eps)` and the L2 form) run as one fused kernel that keeps its
    /// statistic in f32 (squares, sum, eps and root unrounded; only the normalized output is stored), as NPU
    /// compilers fuse RMSNorm and NormalizeL2; otherwise op by op, every intermediate stored.
    pub fused_norm: bool,
}

impl Default for NumericModel {
    /// fp16 storage, subnormals flushed, f32 accumulation, fp16 states: an fp16 NPU.
    fn default() -> Self {
        NumericModel {
            storage: Storage::F16,
            flush_subnormals: true,
            accumulation: Accumulation::F32,
            f32_state: false,
            fused_norm: false,
        }
    }
}

/// The pseudo-device's name.
pub const DEVICE: &str = "FP16SIM";

impl NumericModel {
    /// Whether `device` names the pseudo-device (`FP16SIM` or `FP16SIM:options`).
    pub fn is_sim(device: &str) -> bool {
        device == DEVICE || device.starts_with(&format!("{DEVICE}:"))
    }

    /// Parses `FP16SIM[:key=value,…]` with the options of a device config (`store`, `ftz`, `acc`, `state`,
    /// `norm`) applied on top. Keys: `store=f16|bf16|f32`, `ftz=on|off`, `acc=f32|f16|bf16` (`f16`/`bf16`: in the
    /// storage format), `state=f16|f32`, `norm=ops|fused`.
    pub fn parse(device: &str, config: &[(String, String)]) -> Result<Self> {
        let rest = device.strip_prefix(DEVICE).ok_or_else(|| {
            Error::Config(format!("`{device}` is not the {DEVICE} pseudo-device"))
        })?;
        let mut pairs: Vec<(String, String)> = Vec::new();
        match rest.strip_prefix(':') {
            Some(opts) => {
                for item in opts.split(',').filter(|s| !s.is_empty()) {
                    let (k, v) = item.split_once('=').ok_or_else(|| {
                        Error::Config(format!(
                            "{device}: `{item}` is not key=value (keys: store, ftz, acc, state, norm)"
                        ))
                    })?;
                    pairs.push((k.trim().to_string(), v.trim().to_string()));
                }
            }
            None if rest.is_empty() => {}
            None => {
                return Err(Error::Config(format!(
                    "`{device}`: expected {DEVICE}:key=value,…"
                )));
            }
        }
        let from_name = pairs.len();
        pairs.extend(config.iter().cloned());
        // Each option is given once: a second value (in the name, or a device config overriding the name) is
        // refused naming both, never decided by order.
        let mut seen: std::collections::BTreeMap<String, (usize, String)> = Default::default();
        for (i, (k, v)) in pairs.iter().enumerate() {
            let where_ = |i: usize| {
                if i < from_name {
                    "the device name"
                } else {
                    "the device config"
                }
            };
            if let Some((j, first)) = seen.insert(k.to_ascii_lowercase(), (i, v.clone())) {
                return Err(Error::Config(format!(
                    "{DEVICE} option `{k}` given twice: {k}={first} in {} and {k}={v} in {}",
                    where_(j),
                    where_(i)
                )));
            }
        }
        let mut m = NumericModel::default();
        for (k, v) in pairs {
            let bad = || {
                Error::Config(format!(
                    "{DEVICE} option {k}={v}: {}",
                    match k.as_str() {
                        "store" => "store is f16, bf16 or f32",
                        "ftz" => "ftz is on or off",
                        "acc" => "acc is f32, or the storage format (f16, bf16)",
                        "state" => "state is f16 or f32",
                        "norm" => "norm is ops or fused",
                        _ => "unknown option (store, ftz, acc, state, norm)",
                    }
                ))
            };
            match (
                k.to_ascii_lowercase().as_str(),
                v.to_ascii_lowercase().as_str(),
            ) {
                ("store", "f16" | "fp16") => m.storage = Storage::F16,
                ("store", "bf16") => m.storage = Storage::Bf16,
                ("store", "f32" | "fp32") => m.storage = Storage::F32,
                ("ftz", "on" | "yes" | "true") => m.flush_subnormals = true,
                ("ftz", "off" | "no" | "false") => m.flush_subnormals = false,
                ("acc", "f32" | "fp32") => m.accumulation = Accumulation::F32,
                ("acc", "f16" | "fp16" | "bf16" | "storage") => {
                    m.accumulation = Accumulation::Storage
                }
                ("state", "f16" | "fp16" | "storage") => m.f32_state = false,
                ("state", "f32" | "fp32") => m.f32_state = true,
                ("norm", "ops") => m.fused_norm = false,
                ("norm", "fused") => m.fused_norm = true,
                _ => return Err(bad()),
            }
        }
        Ok(m)
    }

    /// Rounds an f32 to the storage format (to nearest even), flushing its subnormals when the model flushes.
    #[inline]
    pub fn round(&self, x: f32) -> f32 {
        let y = match self.storage {
            Storage::F16 => f16::from_f32(x).to_f32(),
            Storage::Bf16 => bf16::from_f32(x).to_f32(),
            Storage::F32 => x,
        };
        if self.flush_subnormals && y != 0.0 && y.abs() < self.min_normal() {
            0.0f32.copysign(y)
        } else {
            y
        }
    }

    /// The storage format's smallest normal magnitude.
    pub fn min_normal(&self) -> f32 {
        match self.storage {
            Storage::F16 => 6.103_515_6e-5,
            Storage::Bf16 | Storage::F32 => f32::MIN_POSITIVE,
        }
    }

    /// Whether nothing is rounded (f32 storage, subnormals kept): the model is then plain f32 arithmetic.
    pub fn is_exact_f32(&self) -> bool {
        self.storage == Storage::F32 && !self.flush_subnormals
    }

    /// The precision a report states (`f16`, `bf16`, `f32`), for thresholds.
    pub fn precision(&self) -> &'static str {
        match self.storage {
            Storage::F16 => "f16",
            Storage::Bf16 => "bf16",
            Storage::F32 => "f32",
        }
    }

    /// The options as `(key, value)` pairs, as a report lists device properties.
    pub fn properties(&self) -> Vec<(String, String)> {
        vec![
            ("store".into(), self.precision().into()),
            (
                "ftz".into(),
                if self.flush_subnormals { "on" } else { "off" }.into(),
            ),
            (
                "acc".into(),
                match self.accumulation {
                    Accumulation::F32 => "f32".into(),
                    Accumulation::Storage => self.precision().into(),
                },
            ),
            (
                "state".into(),
                if self.f32_state {
                    "f32"
                } else {
                    self.precision()
                }
                .into(),
            ),
            (
                "norm".into(),
                if self.fused_norm { "fused" } else { "ops" }.into(),
            ),
        ]
    }
}

impl fmt::Display for NumericModel {
    /// `FP16SIM:store=f16,ftz=on,acc=f32,state=f16`: the name that reproduces it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let opts: Vec<String> = self
            .properties()
            .into_iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        write!(f, "{DEVICE}:{}", opts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse_and_print_back() {
        let d = NumericModel::parse("FP16SIM", &[]).unwrap();
        assert_eq!(d, NumericModel::default());
        assert_eq!(
            d.to_string(),
            "FP16SIM:store=f16,ftz=on,acc=f32,state=f16,norm=ops"
        );
        let m = NumericModel::parse(
            "FP16SIM:ftz=off,acc=f16,norm=fused",
            &[("state".into(), "f32".into())],
        )
        .unwrap();
        assert!(!m.flush_subnormals && m.accumulation == Accumulation::Storage && m.f32_state);
        assert!(m.fused_norm);
        assert_eq!(NumericModel::parse(&m.to_string(), &[]).unwrap(), m);
        for bad in [
            "FP16SIM:ftz=maybe",
            "FP16SIM:speed=fast",
            "FP16SIM:ftz",
            "FP16SIM:norm=maybe",
            "FP16SIMX",
        ] {
            assert!(NumericModel::parse(bad, &[]).is_err(), "{bad}");
        }
        assert!(NumericModel::is_sim("FP16SIM:store=bf16") && !NumericModel::is_sim("NPU"));
    }

    #[test]
    fn rounding_flushes_fp16_subnormals() {
        let m = NumericModel::default();
        assert_eq!(m.round(1e-6), 0.0); // rms_norm_eps: an fp16 subnormal, flushed
        assert_eq!(m.round(6.2e-5), f16::from_f32(6.2e-5).to_f32());
        assert_eq!(m.round(1.0 + 1.0 / 4096.0), 1.0); // below half an ulp
        assert!(m.round(70000.0).is_infinite()); // beyond 65504
        let kept = NumericModel {
            flush_subnormals: false,
            ..m
        };
        assert_eq!(kept.round(1e-6), f16::from_f32(1e-6).to_f32());
        assert!(kept.round(1e-6) > 0.0);
        let f32m = NumericModel {
            storage: Storage::F32,
            flush_subnormals: false,
            ..m
        };
        assert!(f32m.is_exact_f32());
        assert_eq!(f32m.round(1.000_000_1), 1.000_000_1);
    }
}
