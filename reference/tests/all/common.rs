//! Shared strategies, generators and checks.

use candle_core::{DType, Tensor};
use proptest::prelude::*;
use reference::compare::diff;
use reference::deltanet::Inputs;
use reference::synthetic::delta_rule_inputs;

/// Sizes and settings of one random delta-rule case.
#[derive(Debug, Clone)]
pub struct KernelCase {
    pub seed: u64,
    pub heads: usize,
    pub tokens: usize,
    pub dk: usize,
    pub dv: usize,
    pub block: usize,
    /// Most negative per-token log-decay.
    pub g_min: f64,
}

/// Random cases: 1-4 heads, 1-80 tokens (across block boundaries), Dk ≠ Dv, blocks 1-33, decays down to −10.
pub fn kernel_case() -> impl Strategy<Value = KernelCase> {
    (
        any::<u64>(),
        1usize..=4,
        1usize..=80,
        distinct_dims(2, 9),
        1usize..=33,
        -10.0f64..=-0.01,
    )
        .prop_map(|(seed, heads, tokens, (dk, dv), block, g_min)| KernelCase {
            seed,
            heads,
            tokens,
            dk,
            dv,
            block,
            g_min,
        })
}

/// Key and value head dims `(Dk, Dv)`, each in `lo..=hi` and never equal (uniform over such pairs): with Dk = Dv
/// a transposed state or a key dim read as the value dim would go unnoticed.
pub fn distinct_dims(lo: usize, hi: usize) -> impl Strategy<Value = (usize, usize)> {
    (lo..=hi, lo..hi).prop_map(|(dk, dv)| (dk, if dv >= dk { dv + 1 } else { dv }))
}

/// Delta-rule inputs as the layer makes them for the case ([`reference::synthetic::delta_rule_inputs`]).
pub fn kernel_inputs(c: &KernelCase, dtype: DType) -> (Inputs, Tensor) {
    delta_rule_inputs(c.seed, [c.heads, c.tokens, c.dk, c.dv], c.g_min, dtype).unwrap()
}

/// Fails with a labelled report unless every element is finite and within `rtol` of the expected tensor's
/// largest magnitude.
pub fn assert_close(what: &str, actual: &Tensor, expected: &Tensor, rtol: f64) {
    let d = diff(actual, expected).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        d.within(0.0, rtol),
        "{what}: {d} (tolerance {rtol:.1e} of the max)"
    );
}

/// Same check, as a proptest failure instead of a panic.
pub fn prop_close(
    what: &str,
    actual: &Tensor,
    expected: &Tensor,
    rtol: f64,
) -> Result<(), TestCaseError> {
    let d = diff(actual, expected).map_err(|e| TestCaseError::fail(format!("{what}: {e}")))?;
    prop_assert!(
        d.within(0.0, rtol),
        "{}: {} (tolerance {:.1e} of the max)",
        what,
        d,
        rtol
    );
    Ok(())
}

/// `(I + N)^-1` of one strictly lower triangular `n × n` matrix by forward substitution in f64 on plain vectors.
pub fn exact_unit_lower_inverse(n: &[f64], size: usize) -> Vec<f64> {
    let mut x = vec![0.0; size * size];
    for i in 0..size {
        for col in 0..size {
            let mut v = if i == col { 1.0 } else { 0.0 };
            for j in 0..i {
                v -= n[i * size + j] * x[j * size + col];
            }
            x[i * size + col] = v;
        }
    }
    x
}

/// The bundled test data directory.
pub fn testdata() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata")
}

/// The sizes of one random model for the whole-model properties.
#[derive(Debug, Clone)]
pub struct ModelCase {
    /// Linear-attention key heads `Hk`.
    pub linear_key_heads: usize,
    /// Linear-attention value heads per key head, `Hv / Hk`.
    pub linear_ratio: usize,
    /// Attention key/value heads `Hkv`.
    pub kv_heads: usize,
    /// Attention query heads per key/value head, `Hq / Hkv`.
    pub group: usize,
    /// Linear-attention key head dimension `Dk`.
    pub dk: usize,
    /// Linear-attention value head dimension `Dv`.
    pub dv: usize,
    /// Causal convolution width `K`.
    pub conv: usize,
    /// The layer pattern, `true` for full attention; both kinds occur.
    pub full: Vec<bool>,
    /// Attention head dimension.
    pub head_dim: usize,
    /// `partial_rotary_factor`.
    pub partial: f64,
    /// The interleaved MRoPE section (a 3-split of `rotary_dim / 2`), or none.
    pub section: Option<[usize; 3]>,
}

impl ModelCase {
    /// The `config.json` of this case (the small synthetic config, edited).
    pub fn config_json(&self) -> serde_json::Value {
        let mut c = reference::synthetic::small_config_json();
        c["linear_conv_kernel_dim"] = self.conv.into();
        c["linear_num_key_heads"] = self.linear_key_heads.into();
        c["linear_num_value_heads"] = (self.linear_key_heads * self.linear_ratio).into();
        c["linear_key_head_dim"] = self.dk.into();
        c["linear_value_head_dim"] = self.dv.into();
        c["num_key_value_heads"] = self.kv_heads.into();
        c["num_attention_heads"] = (self.kv_heads * self.group).into();
        c["head_dim"] = self.head_dim.into();
        c["num_hidden_layers"] = self.full.len().into();
        c["layer_types"] = self
            .full
            .iter()
            .map(|&full| {
                if full {
                    "full_attention"
                } else {
                    "linear_attention"
                }
            })
            .collect::<Vec<_>>()
            .into();
        let rope = c["rope_parameters"].as_object_mut().unwrap();
        rope.insert("partial_rotary_factor".into(), self.partial.into());
        match self.section {
            Some(s) => rope.insert("mrope_section".into(), s.to_vec().into()),
            None => rope.remove("mrope_section"),
        };
        c
    }
}

/// A 3-split `[t, h, w]` of `half` frequencies (any split, empty parts included), or none.
pub fn mrope_section(half: usize) -> impl Strategy<Value = Option<[usize; 3]>> {
    prop::option::weighted(
        0.7,
        (0..=half).prop_flat_map(move |h| (0..=half - h).prop_map(move |w| [half - h - w, h, w])),
    )
}

/// Random small models: linear Hv/Hk in {1, 2, 4} with Hk in {1, 2}; attention Hq/Hkv in {1, 2, 4} with Hkv in
/// {1, 2}; Dk ≠ Dv; conv widths 1 to 6; 2-4 layers of both kinds; head dims 8, 16, 24 with partial factors
/// 1/4, 1/2, 1 (rotary halves 1 to 12); with or without an MRoPE section.
pub fn model_case() -> impl Strategy<Value = ModelCase> {
    (
        (
            prop::sample::select(vec![1usize, 2]),
            prop::sample::select(vec![1usize, 2, 4]),
            prop::sample::select(vec![1usize, 2]),
            prop::sample::select(vec![1usize, 2, 4]),
        ),
        (distinct_dims(4, 12), 1usize..=6),
        (prop::collection::vec(any::<bool>(), 2..=4), 0usize..4),
        (
            prop::sample::select(vec![8usize, 16, 24]),
            prop::sample::select(vec![0.25f64, 0.5, 1.0]),
        ),
    )
        .prop_flat_map(
            |(
                (linear_key_heads, linear_ratio, kv_heads, group),
                ((dk, dv), conv),
                (mut full, flip),
                (head_dim, partial),
            )| {
                // Both layer kinds in every model: if the pattern has one kind only, flip one layer.
                if full.iter().all(|&f| f == full[0]) {
                    let i = flip % full.len();
                    full[i] = !full[i];
                }
                let half = (head_dim as f64 * partial) as usize / 2;
                mrope_section(half).prop_map(move |section| ModelCase {
                    linear_key_heads,
                    linear_ratio,
                    kv_heads,
                    group,
                    dk,
                    dv,
                    conv,
                    full: full.clone(),
                    head_dim,
                    partial,
                    section,
                })
            },
        )
}

/// How one random prompt is fed.
#[derive(Debug, Clone)]
pub struct PromptCase {
    /// Seed of the token ids.
    pub seed: u64,
    /// Prompt length.
    pub tokens: usize,
    /// Tokens per block of the chunked delta rule.
    pub chunk: usize,
    /// Tokens per forward call of a blocked prefill: more than `chunk` and not a multiple of it, so chunk
    /// boundaries fall inside calls and call boundaries inside chunks.
    pub prefill_block: usize,
    /// Split runs: `..cut1` prefilled in blocks, `cut1..cut2` one call from the carried state, `cut2..` decoded token
    /// by token.
    pub cut1: usize,
    /// See `cut1`.
    pub cut2: usize,
    /// An image: its first token and its grid `[temporal, height, width]` (at least two tokens).
    pub image: Option<(usize, [usize; 3])>,
}

/// Prompts of 30-59 tokens, chunks of 2-8, prefill blocks of up to 17 (never a multiple of the chunk), two cuts, and
/// (when `multimodal`, two times in three) an image of 2-32 tokens somewhere inside.
pub fn prompt_case(multimodal: bool) -> impl Strategy<Value = PromptCase> {
    (any::<u64>(), 30usize..60, 2usize..=8)
        .prop_flat_map(|(seed, tokens, chunk)| {
            (
                Just((seed, tokens, chunk)),
                (chunk + 1..=17).prop_filter("a multiple of the chunk", move |b| b % chunk != 0),
                (1..tokens).prop_flat_map(move |cut1| (Just(cut1), cut1 + 1..=tokens)),
            )
        })
        .prop_flat_map(
            move |((seed, tokens, chunk), prefill_block, (cut1, cut2))| {
                let grid = (1usize..=2, 1usize..=4, 1usize..=4)
                    .prop_filter(
                        "an image of one token or longer than the prompt",
                        move |&(t, h, w)| (2..=tokens).contains(&(t * h * w)),
                    )
                    .prop_flat_map(move |(t, h, w)| {
                        (0..=tokens - t * h * w).prop_map(move |start| (start, [t, h, w]))
                    });
                let image = if multimodal {
                    prop::option::weighted(0.67, grid).boxed()
                } else {
                    Just(None).boxed()
                };
                image.prop_map(move |image| PromptCase {
                    seed,
                    tokens,
                    chunk,
                    prefill_block,
                    cut1,
                    cut2,
                    image,
                })
            },
        )
}

/// A model case with a prompt for it (an image only when the model has an MRoPE section).
pub fn model_and_prompt() -> impl Strategy<Value = (ModelCase, PromptCase)> {
    model_case().prop_flat_map(|m| {
        let multimodal = m.section.is_some();
        (Just(m), prompt_case(multimodal))
    })
}

/// The positions of a prompt as transformers' `get_rope_index` lays them out: text at `0, 1, …`; an image starting
/// at `s` (the position after the text before it) at `s + [t, h, w]` of each grid cell, temporal-major; the text
/// after it continuing at the largest position so far plus one. Also whether each token is an image token.
pub fn prompt_positions(
    tokens: usize,
    image: Option<(usize, [usize; 3])>,
) -> (reference::rope::Positions, Vec<bool>) {
    let mut rows: [Vec<i64>; 3] = [vec![], vec![], vec![]];
    let mut is_image = vec![false; tokens];
    let mut next = 0i64;
    let mut i = 0;
    while i < tokens {
        match image {
            Some((start, [gt, gh, gw])) if i == start => {
                for t in 0..gt {
                    for h in 0..gh {
                        for w in 0..gw {
                            for (row, offset) in rows.iter_mut().zip([t, h, w]) {
                                row.push(next + offset as i64);
                            }
                        }
                    }
                }
                let n = gt * gh * gw;
                is_image[i..i + n].fill(true);
                i += n;
                next += gt.max(gh).max(gw) as i64;
            }
            _ => {
                for row in rows.iter_mut() {
                    row.push(next);
                }
                next += 1;
                i += 1;
            }
        }
    }
    (reference::rope::Positions(rows), is_image)
}

/// One random rotary embedding and the positions it rotates.
#[derive(Debug, Clone)]
pub struct RopeCase {
    /// Seed of the input values.
    pub seed: u64,
    /// Attention heads of the input.
    pub heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// `partial_rotary_factor`, in eighths (exact in binary, so `head_dim * factor` is exact).
    pub eighths: usize,
    /// The base.
    pub theta: f64,
    /// The MRoPE section, or none.
    pub section: Option<[usize; 3]>,
    /// Temporal, height and width rows (equal for text).
    pub rows: [Vec<i64>; 3],
}

impl RopeCase {
    /// Rotated dimensions per head.
    pub fn rotary_dim(&self) -> usize {
        self.head_dim * self.eighths / 8
    }

    /// The `config.json` of a model with this rotary embedding.
    pub fn config_json(&self) -> serde_json::Value {
        let mut c = reference::synthetic::small_config_json();
        c["head_dim"] = self.head_dim.into();
        let rope = c["rope_parameters"].as_object_mut().unwrap();
        rope.insert("rope_theta".into(), self.theta.into());
        rope.insert(
            "partial_rotary_factor".into(),
            (self.eighths as f64 / 8.0).into(),
        );
        match self.section {
            Some(s) => rope.insert("mrope_section".into(), s.to_vec().into()),
            None => rope.remove("mrope_section"),
        };
        c
    }
}

/// Positions of `tokens` tokens: text from near 0, text far out (up to 300000), or (with a section) three rows of
/// independent positions, near or far.
pub fn rope_rows(tokens: usize, multimodal: bool) -> impl Strategy<Value = [Vec<i64>; 3]> {
    let text = |lo: i64, hi: i64| {
        (lo..hi).prop_map(move |start| {
            let row: Vec<i64> = (start..start + tokens as i64).collect();
            [row.clone(), row.clone(), row]
        })
    };
    let rows = |hi: i64| {
        (
            prop::collection::vec(0..=hi, tokens),
            prop::collection::vec(0..=hi, tokens),
            prop::collection::vec(0..=hi, tokens),
        )
            .prop_map(|(t, h, w)| [t, h, w])
    };
    if multimodal {
        prop_oneof![
            text(0, 5000),
            text(250_000, 300_000),
            rows(64),
            rows(300_000)
        ]
        .boxed()
    } else {
        prop_oneof![text(0, 5000), text(250_000, 300_000)].boxed()
    }
}

/// Random rotary embeddings: head dims 16 to 256, partial factors 1/8 to 1 (rotary halves 1 to 128, odd ones
/// included), theta from 2 to 3e7, any MRoPE section or none; 1-4 heads, 1-12 tokens.
pub fn rope_case() -> impl Strategy<Value = RopeCase> {
    (
        any::<u64>(),
        1usize..=4,
        1usize..=16,
        1usize..=8,
        0.3f64..7.5,
        1usize..=12,
    )
        .prop_flat_map(|(seed, heads, sixteens, eighths, log_theta, tokens)| {
            let head_dim = 16 * sixteens;
            let half = head_dim * eighths / 16;
            mrope_section(half).prop_flat_map(move |section| {
                rope_rows(tokens, section.is_some()).prop_map(move |rows| RopeCase {
                    seed,
                    heads,
                    head_dim,
                    eighths,
                    theta: 10f64.powf(log_theta),
                    section,
                    rows,
                })
            })
        })
}

/// Random codes over the kind's whole range and f16 scales of every sort (a fifth negative, some zero, some
/// subnormal, magnitudes from 1e-6 to 1e3).
pub fn random_quantized(
    kind: reference::quant::QuantKind,
    rows: usize,
    cols: usize,
    seed: u64,
) -> reference::quant::QuantizedMatrix {
    let mut rng = reference::synthetic::Rng::new(seed);
    let (lo, hi) = kind.code_range();
    let span = (hi as i64 - lo as i64 + 1) as u64;
    let codes = (0..rows * cols)
        .map(|_| (lo as i64 + (rng.next_u64() % span) as i64) as i8)
        .collect();
    let per_row = match kind {
        reference::quant::QuantKind::Int4Sym { group } => cols / group,
        reference::quant::QuantKind::Int8Sym => 1,
    };
    let scales = (0..rows * per_row)
        .map(|_| {
            let v = match rng.next_u64() % 10 {
                0 => 0.0,
                1 => 3e-7 * rng.normal(),
                _ => 10f64.powf(rng.range(-6.0, 3.0)),
            };
            let sign = if rng.next_u64().is_multiple_of(5) {
                -1.0
            } else {
                1.0
            };
            half::f16::from_f64(sign * v)
        })
        .collect();
    reference::quant::QuantizedMatrix::from_parts(kind, rows, cols, codes, scales).unwrap()
}
