//! The range report: before any device runs, what of the reference's numbers an fp16 (or bf16) device cannot hold.
//!
//! From the reference's activations and states (with the DeltaNet output rescaling applied as the graphs apply it):
//! per tensor, the values beyond the format's largest finite value (65504 in fp16), the share of nonzero values
//! below its smallest normal (flushed to zero by a device that flushes), and the same for the squares the RMSNorms
//! and the l2 norms sum (`x²` of every norm's input: a hidden state of 300 squares to 9e4, past fp16's range). From
//! the weights and the constants: the values that do not survive the cast (`rms_norm_eps = 1e-6` is an fp16
//! subnormal: flushed, it is zero). The first overflow, in the order the decoder computes, is named.

use crate::metrics::{Measure, Why, values};
use crate::non_finite::NonFinite;
use anyhow::Result;
use candle_core::Tensor;
use npu::sim::numeric::Storage;
use reference::config::{Config, LayerKind};
use reference::linear_attn::L2_NORM_EPS;
use reference::model::state_names;
use reference::schema::Schema;
use reference::taps::names;
use reference::weights::WeightStore;
use serde::Serialize;
use std::collections::BTreeMap;

/// A storage format's limits.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Limits {
    /// Largest finite magnitude.
    pub max: f64,
    /// Smallest normal magnitude.
    pub min_normal: f64,
}

impl Limits {
    /// The limits of `storage`.
    pub fn of(storage: Storage) -> Self {
        match storage {
            Storage::F16 => Limits {
                max: 65504.0,
                min_normal: 6.103_515_625e-5,
            },
            Storage::Bf16 => Limits {
                max: 3.389_531_389_251_535_5e38,
                min_normal: f32::MIN_POSITIVE as f64,
            },
            Storage::F32 => Limits {
                max: f32::MAX as f64,
                min_normal: f32::MIN_POSITIVE as f64,
            },
        }
    }
}

/// What a tensor's values (or their squares) do in the format.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Range {
    /// Largest magnitude (undefined, `null`, over no value or when a value is NaN or infinite).
    pub max_abs: Measure,
    /// Values that are NaN or infinite already in the reference (a broken checkpoint: no format holds them).
    pub non_finite: usize,
    /// Values beyond the largest finite value.
    pub overflow: usize,
    /// Share of the nonzero values below the smallest normal.
    pub below_normal: f64,
    /// Values counted.
    pub count: usize,
}

impl Range {
    /// The range of `x` in `limits`.
    pub fn of(x: &[f64], limits: Limits) -> Self {
        let mut sum = RangeSum::default();
        sum.add(x, limits);
        sum.range()
    }
}

/// One tensor's row of the report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RangeRow {
    /// The tensor (a dump name, a weight's checkpoint name, or a constant).
    pub name: String,
    /// The layer, if any.
    pub layer: Option<usize>,
    /// Its values.
    pub values: Range,
    /// Its squares, for the inputs of the norms (`None` for other tensors).
    pub squares: Option<Range>,
}

impl RangeRow {
    /// Whether a value or a square overflows.
    pub fn overflows(&self) -> bool {
        self.values.overflow > 0 || self.squares.is_some_and(|s| s.overflow > 0)
    }
}

/// A constant of the graphs and what it becomes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConstantRow {
    /// What it is.
    pub name: String,
    /// Its value.
    pub value: f64,
    /// Its value in the format with subnormals kept.
    pub stored: f64,
    /// Whether it is a subnormal of the format (zero when flushed).
    pub subnormal: bool,
}

/// The range report.
#[derive(Debug, Clone, Serialize)]
pub struct RangeReport {
    /// The format (`f16`, `bf16`).
    pub storage: String,
    /// Its limits.
    pub limits: Limits,
    /// The DeltaNet output rescaling applied.
    pub output_scale: f64,
    /// Activations and states, in the order the decoder computes them.
    pub activations: Vec<RangeRow>,
    /// Weights.
    pub weights: Vec<RangeRow>,
    /// Scalar constants of the graphs.
    pub constants: Vec<ConstantRow>,
    /// The first activation (or square) that overflows, in compute order.
    pub first_overflow: Option<String>,
    /// The first activation or state that is NaN or infinite already in the reference, in compute order (`null`:
    /// none); the report then fails, since nothing after it is meaningful.
    pub first_non_finite: Option<NonFinite>,
    /// The checkpoint's tensors holding NaN or infinity.
    pub weights_non_finite: Vec<NonFinite>,
}

fn store(x: f64, storage: Storage) -> f64 {
    match storage {
        Storage::F16 => half::f16::from_f64(x).to_f64(),
        Storage::Bf16 => half::bf16::from_f64(x).to_f64(),
        Storage::F32 => x as f32 as f64,
    }
}

/// What a [`Range`] sums over the pieces of a tensor seen so far (one block of the prompt at a time).
#[derive(Debug, Clone, Copy, Default)]
struct RangeSum {
    max_abs: f64,
    nan: usize,
    non_finite: usize,
    overflow: usize,
    below_normal: usize,
    nonzero: usize,
    count: usize,
}

impl RangeSum {
    fn add(&mut self, x: &[f64], limits: Limits) {
        for &v in x {
            if !v.is_finite() {
                self.non_finite += 1;
                self.nan += usize::from(v.is_nan());
                continue;
            }
            let a = v.abs();
            self.max_abs = self.max_abs.max(a);
            self.overflow += usize::from(a > limits.max);
            if v != 0.0 {
                self.nonzero += 1;
                self.below_normal += usize::from(a < limits.min_normal);
            }
        }
        self.count += x.len();
    }

    fn range(&self) -> Range {
        Range {
            max_abs: Measure::of(
                self.max_abs,
                if self.non_finite > 0 {
                    Some(Why::Values {
                        nan: self.nan,
                        inf: self.non_finite - self.nan,
                    })
                } else {
                    (self.count == 0).then_some(Why::Empty)
                },
            ),
            non_finite: self.non_finite,
            overflow: self.overflow,
            below_normal: self.below_normal as f64 / self.nonzero.max(1) as f64,
            count: self.count,
        }
    }
}

/// One activation or state of the report and how its values are read.
struct Tracked {
    name: String,
    layer: Option<usize>,
    /// The factor the graphs apply before storing it (the DeltaNet output rescaling).
    scale: f64,
    /// Whether a norm sums its squares.
    norm_input: bool,
    /// A state after the prompt (not a token-major tap).
    state: bool,
    values: RangeSum,
    squares: RangeSum,
    seen: bool,
}

/// The range report built as the prompt runs, one block of taps at a time, so its memory does not grow with the
/// prompt's length: [`RangeScan::add_taps`] for each forward call, [`RangeScan::add_states`] after the prompt, then
/// [`RangeScan::finish`].
pub struct RangeScan {
    limits: Limits,
    storage: Storage,
    output_scale: f64,
    tracked: Vec<Tracked>,
    first_non_finite: Option<NonFinite>,
}

impl RangeScan {
    /// A scan of the activations and states of `config`, in the order the decoder computes them.
    pub fn new(config: &Config, storage: Storage, output_scale: f64) -> Self {
        let mut tracked = Vec::new();
        let mut track =
            |name: String, layer: Option<usize>, scale: f64, norm_input: bool, state: bool| {
                tracked.push(Tracked {
                    name,
                    layer,
                    scale,
                    norm_input,
                    state,
                    values: RangeSum::default(),
                    squares: RangeSum::default(),
                    seen: false,
                })
            };
        track(names::EMBEDDINGS.into(), None, 1.0, true, false);
        for (layer, kind) in config.layer_types.iter().enumerate() {
            let (mixer, mixer_taps): (&str, &[&str]) = match kind {
                LayerKind::Linear => (names::LINEAR_ATTN, &names::LINEAR_ATTN_TAPS),
                LayerKind::Full => (names::SELF_ATTN, &names::SELF_ATTN_TAPS),
            };
            for tap in mixer_taps {
                // The graphs compute the DeltaNet output scaled (q × S) and normalise it; the l2 norms and the
                // gated norm sum squares.
                let (scale, norm_input) = match (*kind, *tap) {
                    (LayerKind::Linear, names::CORE_OUTPUT) => (output_scale, true),
                    (LayerKind::Linear, names::QUERY | names::KEY) => (1.0, true),
                    _ => (1.0, false),
                };
                let name = names::layer(layer, &names::mixer(mixer, tap));
                track(name, Some(layer), scale, norm_input, false);
            }
            for (tap, norm_input) in [
                (names::MIXER_OUTPUT, false),
                (names::MLP_OUTPUT, false),
                (names::OUTPUT, true),
            ] {
                track(
                    names::layer(layer, tap),
                    Some(layer),
                    1.0,
                    norm_input,
                    false,
                );
            }
            for name in state_names(layer, *kind) {
                track(name, Some(layer), 1.0, false, true);
            }
        }
        track(names::FINAL_NORM.into(), None, 1.0, false, false);
        track(names::LOGITS.into(), None, 1.0, false, false);
        RangeScan {
            limits: Limits::of(storage),
            storage,
            output_scale,
            tracked,
            first_non_finite: None,
        }
    }

    /// Tracks the vision tower's `depth` blocks too, ahead of the decoder (computed first): the patch embedding, the
    /// position table, per block the attention scores, the GELU's input and the output (whose squares the next
    /// LayerNorm sums), and the merger.
    pub fn with_vision(mut self, depth: usize) -> Self {
        use reference::vision::names as v;
        let row = |name: String, norm_input: bool| Tracked {
            name,
            layer: None,
            scale: 1.0,
            norm_input,
            state: false,
            values: RangeSum::default(),
            squares: RangeSum::default(),
            seen: false,
        };
        let mut vision = vec![
            row(v::PATCH_EMBED.into(), false),
            row(v::POS_EMBED.into(), false),
        ];
        for i in 0..depth {
            vision.push(row(v::attention_scores(i), false));
            vision.push(row(v::gelu_input(i), false));
            vision.push(row(v::block(i), true));
        }
        vision.push(row(v::MERGER.into(), false));
        vision.append(&mut self.tracked);
        self.tracked = vision;
        self
    }

    /// Adds the taps (and logits) of one forward call whose first token is at `position`.
    pub fn add_taps(&mut self, taps: &BTreeMap<String, Tensor>, position: usize) -> Result<()> {
        self.add(taps, false, position)
    }

    /// Adds the states after the prompt.
    pub fn add_states(&mut self, states: &BTreeMap<String, Tensor>) -> Result<()> {
        self.add(states, true, 0)
    }

    fn add(
        &mut self,
        tensors: &BTreeMap<String, Tensor>,
        states: bool,
        position: usize,
    ) -> Result<()> {
        let limits = self.limits;
        for t in self.tracked.iter_mut().filter(|t| t.state == states) {
            let Some(x) = tensors.get(&t.name) else {
                continue;
            };
            let v: Vec<f64> = values(x)?.into_iter().map(|v| v * t.scale).collect();
            // The first non-finite value in time: the earliest forward call, then the computation order.
            if self.first_non_finite.is_none()
                && let Some(mut f) = NonFinite::of_values(&t.name, x.dims(), &v)
            {
                if !states && let Some(p) = f.first.first_mut() {
                    *p += position;
                }
                self.first_non_finite = Some(f);
            }
            t.values.add(&v, limits);
            if t.norm_input {
                let sq: Vec<f64> = v.iter().map(|x| x * x).collect();
                t.squares.add(&sq, limits);
            }
            t.seen = true;
        }
        Ok(())
    }

    /// The report: the activations and states seen, the weights of `store` and the graphs' constants.
    pub fn finish(self, config: &Config, store_: &WeightStore) -> Result<RangeReport> {
        let limits = self.limits;
        let activations: Vec<RangeRow> = self
            .tracked
            .iter()
            .filter(|t| t.seen)
            .map(|t| RangeRow {
                name: t.name.clone(),
                layer: t.layer,
                values: t.values.range(),
                squares: t.norm_input.then(|| t.squares.range()),
            })
            .collect();
        let first_overflow = activations.iter().find(|r| r.overflows()).map(|r| {
            if r.values.overflow > 0 {
                format!(
                    "{} ({} values beyond {:.0})",
                    r.name, r.values.overflow, limits.max
                )
            } else {
                format!(
                    "{} squared, as its norm sums it ({} squares beyond {:.0})",
                    r.name,
                    r.squares.map_or(0, |s| s.overflow),
                    limits.max
                )
            }
        });
        let mut weights = Vec::new();
        let mut weights_non_finite = Vec::new();
        for spec in Schema::new(config).tensors() {
            let t = store_.load(&spec)?;
            let v = values(&t)?;
            let name = store_.full_name(&spec);
            weights_non_finite.extend(NonFinite::of_values(&name, t.dims(), &v));
            weights.push(RangeRow {
                name,
                layer: spec.layer,
                values: Range::of(&v, limits),
                squares: None,
            });
        }
        let (eps, output_scale, storage) = (config.rms_norm_eps, self.output_scale, self.storage);
        let constants = [
            ("rms_norm_eps (the RMSNorms)".to_string(), eps),
            ("l2 norm eps (q and k)".to_string(), L2_NORM_EPS),
            (
                format!("gated norm eps × output scale² ({eps:e} × {output_scale}²)"),
                eps * output_scale * output_scale,
            ),
        ]
        .into_iter()
        .map(|(name, value)| {
            let stored = store(value, storage);
            ConstantRow {
                name,
                value,
                stored,
                subnormal: stored != 0.0 && stored.abs() < limits.min_normal,
            }
        })
        .collect();
        Ok(RangeReport {
            storage: match storage {
                Storage::F16 => "f16",
                Storage::Bf16 => "bf16",
                Storage::F32 => "f32",
            }
            .into(),
            limits,
            output_scale,
            activations,
            weights,
            constants,
            first_overflow,
            first_non_finite: self.first_non_finite,
            weights_non_finite,
        })
    }
}

impl RangeReport {
    /// The one-screen summary: the constants that do not survive, the tensors that overflow or lose most to the
    /// format's subnormals, and the first overflow.
    pub fn terminal(&self) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "range report for {} (largest {:.0}, smallest normal {:.2e}), output scale {}",
            self.storage, self.limits.max, self.limits.min_normal, self.output_scale
        );
        for c in &self.constants {
            let fate = if c.stored == 0.0 {
                "becomes 0".to_string()
            } else if c.subnormal {
                format!("is a subnormal ({:.3e}): flushed, it is 0", c.stored)
            } else {
                format!("is stored as {:.6e}", c.stored)
            };
            let _ = writeln!(s, "  constant {}: {:e} {fate}", c.name, c.value);
        }
        let mut over: Vec<&RangeRow> = self.activations.iter().filter(|r| r.overflows()).collect();
        over.truncate(8);
        for r in over {
            let _ = writeln!(
                s,
                "  overflow: {} max |x| {:.3e}{}",
                r.name,
                r.values.max_abs,
                r.squares.map_or(String::new(), |q| format!(
                    ", {} squares beyond the range",
                    q.overflow
                ))
            );
        }
        let mut small: Vec<&RangeRow> = self
            .activations
            .iter()
            .filter(|r| r.values.below_normal > 0.0)
            .collect();
        small.sort_by(|a, b| b.values.below_normal.total_cmp(&a.values.below_normal));
        for r in small.iter().take(6) {
            let _ = writeln!(
                s,
                "  below the smallest normal: {:>6.2}% of {}",
                100.0 * r.values.below_normal,
                r.name
            );
        }
        let weights_small: usize = self
            .weights
            .iter()
            .filter(|w| w.values.below_normal > 0.0)
            .count();
        let weights_over: usize = self
            .weights
            .iter()
            .filter(|w| w.values.overflow > 0)
            .count();
        let _ = writeln!(
            s,
            "  weights: {weights_over} tensors with values beyond the range, {weights_small} with values below the smallest normal"
        );
        for w in self.weights_non_finite.iter().take(4) {
            let _ = writeln!(s, "  non-finite weight: {}", w.describe());
        }
        let _ = writeln!(
            s,
            "first overflow: {}",
            self.first_overflow.as_deref().unwrap_or("none")
        );
        if let Some(n) = &self.first_non_finite {
            let _ = writeln!(
                s,
                "first non-finite value: {} (already in the reference: the checkpoint or the prompt is broken)",
                n.describe()
            );
        }
        s
    }

    /// Whether the reference itself produced (or the checkpoint holds) NaN or infinity: the report then fails.
    pub fn non_finite(&self) -> bool {
        self.first_non_finite.is_some() || !self.weights_non_finite.is_empty()
    }
}
