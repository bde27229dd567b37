//! Compressed weights as the OpenVINO ports run them: INT4 symmetric with a group size along the input dimension,
//! INT8 symmetric per output channel as the backup precision, and plain f16; quantised and dequantised here exactly
//! as the exporter does it, so that a run of the reference on the same compressed weights separates device error from
//! quantisation error.
//!
//! # What NNCF does (read in `openvinotoolkit/nncf`, 2025–2026 sources, and in the nncf 3.4.0 wheel)
//!
//! Files: `src/nncf/quantization/algorithms/weight_compression/weight_lowering.py` (reference implementation),
//! `src/nncf/openvino/optimized_functions/models.py` (the OpenVINO-graph implementation NNCF uses for tensors of
//! 10 000 elements or more), `src/nncf/quantization/algorithms/weight_compression/openvino_backend.py` (how the result
//! becomes IR constants), `src/nncf/quantization/algorithms/weight_compression/algorithm.py` (which layer gets which
//! precision) and `src/nncf/quantization/advanced_parameters.py`.
//!
//! * **Scale.** Symmetric modes (`int4_sym`, `int8_sym`) use a *signed* scale, per group of `group` inputs (int4)
//!   or per output row (int8, group size −1): with `lo = min(w)` and `hi = max(w)` over the group, the scale is
//!   `|lo| / 2^(b−1)` when `|lo| ≥ hi` and `−hi / 2^(b−1)` otherwise (`b` = 4 or 8, so the divisor is 8 or 128 and
//!   the division is exact). The scale is negative when the largest magnitude is positive, so the extreme element
//!   maps to code `−2^(b−1)` (−8 or −128) — except when the positive extreme ties with `|lo|` (a constant positive
//!   group included): the scale is then positive and that element clips to `2^(b−1) − 1`. A scale whose magnitude is below f32 machine
//!   epsilon (2⁻²³) is replaced by +2⁻²³; an all-zero group thus gets scale 2⁻²³ and codes 0 (dequantised: exact
//!   zeros, never NaN).
//! * **Codes.** Everything is computed in f32 (weights are first converted to f32): `code = clamp(round(w / s), −2^(b−1),
//!   2^(b−1) − 1)` with a true IEEE division (the OpenVINO path marks the divide so it is not rewritten as a
//!   multiplication by the reciprocal) and round-half-to-even (numpy's `round` and OpenVINO's `Round` default mode).
//!   The codes are computed with the **f32** scale, not with the f16-rounded one.
//! * **Storage.** The codes become an `i4` or `i8` constant, the scale an **f16** constant (`scale_dtype = f16` in the
//!   OpenVINO backend; the f32 → f16 conversion rounds to nearest even). NNCF's own decompression subgraph converts
//!   codes to f16 and multiplies by the f16 scale; the graphs of this project instead compute `f32(code) · f32(scale)`,
//!   which is exact in f32 (an 8-bit integer times an 11-bit significand, well inside f32's range), and
//!   [`QuantizedMatrix::dequantize`] gives exactly those values. Because the codes were rounded against the unrounded
//!   scale, the dequantised error can exceed half a step by up to `|code| · |s_f32 − s_f16|`.
//! * **First and last layers.** With a 4-bit primary mode, the layers whose share is set by `ratio` are the MatMul
//!   weights *except the last MatMul* (the LM head) — unless `all_layers` is set — and embeddings are never among them
//!   (again unless `all_layers`). Every weight outside that set gets the backup mode (`--backup-precision int8_sym`:
//!   INT8 symmetric, per output channel). With `ratio 1.0` all the others are int4. So the claim holds: the token
//!   embedding and `lm_head` are int8_sym. With tied embeddings the LM head reuses the embedding constant, which NNCF
//!   compresses once (int8); the reference's tied LM head is the int8 embedding too.
//! * **Widths not divisible by the group.** NNCF's behaviour depends on `group_size_fallback_mode`. Its default is
//!   `ERROR`: nncf 3.4.0 raises `InvalidGroupSizeError` for a 64-wide MatMul under group 128 unless that MatMul is
//!   the last one (tried with `scripts/make_nncf_goldens.py`'s environment), and optimum-intel leaves it at the
//!   default unless `--group-size-fallback` is given. `IGNORE` keeps the weight in its float precision, and `ADJUST`
//!   picks the largest power of two dividing the width (at least `min_adjusted_group_size`, 32) and otherwise uses the
//!   backup mode. This module uses the backup
//!   precision (int8_sym) for such weights, as the project's rule. It arises on the tiny test models; for a real
//!   checkpoint [`WeightFormat::storage`] shows which projections, if any, fall back.
//! * **Other layers.** NNCF also compresses Convolution / GroupConvolution weights (to the backup precision) when
//!   the graph it compresses contains such an op. Under [`WeightFormat::Int4Sym`] conv weights, norm weights,
//!   `A_log` and `dt_bias` stay f32, as the project's rule (its graphs compute the short convolution without a
//!   convolution op). optimum-intel's export of Qwen3.5 holds the DeltaNet short convolution as a `GroupConvolution`
//!   (weight `[C, 1, 1, K]`), and NNCF gives it the INT8 backup, one scale per channel over its `K` taps (seen in
//!   `testdata/ir/tiny-int4`, made by `scripts/make_optimum_export.py`). [`WeightFormat::Int4Nncf`] is that rule:
//!   the same as `Int4Sym` plus INT8 conv weights, so the reference runs exactly the weights such an export holds
//!   (`npu/tests/all/external.rs` reads every code and scale back from the IR and compares them).
//! * **MoE experts** (read in `nncf/openvino/graph/layout.py` and `node_utils.py`, nncf 3.4.0, and seen in
//!   `testdata/ir/tiny-moe-int4`). optimum-intel 2.2.0 exports Qwen3.5-MoE (its `Qwen3_5MoeModelPatcher`) with every
//!   expert run on every token: per layer a batched MatMul (`transpose_b`) on each of three stacked constants, the
//!   gate and the up halves of `experts.gate_up_proj` (`[E, I, H]` each, OpenVINO folds the split) and
//!   `experts.down_proj` `[E, H, I]`. NNCF takes a MatMul weight of rank 3 with `transpose_b` as laid out
//!   `[batch, out, in]`: the channel axes are the first two, the one reduction axis is the last (the input axis),
//!   and the groups run along it; so each expert's matrix is compressed on its own, per row, exactly as the 2-D rule
//!   above does that expert's `[out, in]` tensor (scales `[E, out, in / group, 1]`). The router `mlp.gate` `[E, H]`,
//!   the shared expert and `shared_expert_gate` `[1, H]` (one row, one scale per group) are plain MatMul weights:
//!   INT4 like every other projection, not the backup. The rule here needs nothing for MoE: every one of them is a
//!   [`Role::Projection`](crate::schema::Role::Projection), and `npu/tests/all/external.rs` finds every expert's codes
//!   and scales in that export bit for bit equal to [`WeightFormat::Int4Nncf`]'s. tiny-moe's tensors are below
//!   NNCF's 10 000-element threshold, so they went through its numpy implementation. Above it the OpenVINO
//!   implementation does the same: `tests/all/nncf.rs` holds stacked experts `[4, 10, 256]` (INT4 group 128, NNCF
//!   reshaping them to `[4, 10, 2, 128]` and reducing over the last axis; and INT8_SYM, scales `[4, 10, 1]`),
//!   which both of NNCF's implementations quantise alike and which equal, expert by expert, what
//!   [`quantize_int4_sym`] and [`quantize_int8_sym`] give each expert's `[10, 256]` matrix.
//!
//! # Checked against NNCF itself
//!
//! `tests/all/nncf.rs` compares [`quantize_int4_sym`] and [`quantize_int8_sym`] with the codes and f16 scales that
//! nncf 3.4.0 (OpenVINO 2026.4.1) stored in a compressed model (`testdata/goldens/nncf.safetensors`, written by
//! `scripts/make_nncf_goldens.py`): real bf16 projections of `tiny-full` and synthetic rows built to tell the
//! conventions above apart (exact rounding ties, a positive extreme, `|min| == max`, scales below the floor, f16
//! subnormal scales, f32 scales exactly halfway between two f16 values), as matrices and as stacked MoE experts
//! (one expert at a time), from both of NNCF's implementations (numpy below 10 000 elements, the OpenVINO graph
//! above). Every code and every scale bit is the same. Each rule above is needed: rounding half away from zero, an
//! unsigned scale, codes divided by the f16-rounded scale, no floor, or a scale rounded to f16 with ties away from
//! zero each make that test fail. Exact ties are not rare: the bf16 weights of `tiny-full` alone have some in every
//! projection tried.
//!
//! # The f16 export (optimum-intel `--weight-format fp16`)
//!
//! optimum-intel (`optimum/exporters/openvino/convert.py`, `_save_model`) saves the IR with `compress_to_fp16` when the
//! weight format is fp16. OpenVINO's `compress_model_to_f16` then runs `CompressFloatConstants`
//! (`src/common/transformations/src/transformations/common_optimizations/compress_float_constants.cpp`) over **every**
//! f32/f64 constant — weights, norm weights, `A_log`, `dt_bias`, conv weights alike — except constants marked
//! precision-sensitive (shape computations), and skips the whole pass when the model already holds compressed weights.
//! Values beyond ±65504 are clamped to ±65504 (not infinity); other values round to nearest even. Two OpenVINO
//! heuristics are not modelled: a constant of which ≥ 75 % of the values are out of f16 range (overflowing, or nonzero
//! below the smallest f16 subnormal) is kept in f32, and recent versions also keep constants whose f16 rounding is too
//! lossy by their error thresholds; weights of ordinary magnitude do not trigger the first. Note that the exporter rounds constants *after* conversion-time
//! constant folding (e.g. a folded `1 + w` of a zero-centred norm), whereas [`WeightFormat::F16`] rounds the checkpoint
//! tensors themselves — what a graph storing the checkpoint tensors as f16 constants computes.
//!
//! # Packing
//!
//! [`pack_i4`] packs int4 codes as OpenVINO stores `i4` constants: two per byte, element `2k` in the low nibble and
//! `2k + 1` in the high nibble, each a two's complement nibble.

use crate::error::{Error, Result};
use half::f16;

mod format;

pub use format::{DEFAULT_GROUP, Storage, WeightFormat};

/// f32 machine epsilon, NNCF's floor for the magnitude of a scale.
const SCALE_FLOOR: f32 = f32::EPSILON;

/// The integer type and grouping of a [`QuantizedMatrix`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantKind {
    /// Codes in `[-8, 7]`, one scale per `group` consecutive inputs of a row.
    Int4Sym {
        /// Inputs sharing one scale.
        group: usize,
    },
    /// Codes in `[-128, 127]`, one scale per row.
    Int8Sym,
}

impl QuantKind {
    /// The smallest and largest code.
    pub fn code_range(&self) -> (i8, i8) {
        match self {
            QuantKind::Int4Sym { .. } => (-8, 7),
            QuantKind::Int8Sym => (i8::MIN, i8::MAX),
        }
    }

    /// Bits per code (4 or 8).
    pub fn bits(&self) -> u32 {
        match self {
            QuantKind::Int4Sym { .. } => 4,
            QuantKind::Int8Sym => 8,
        }
    }
}

/// A weight `[rows (out), cols (in)]` as integer codes and f16 scales, as the OpenVINO graphs store it.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedMatrix {
    kind: QuantKind,
    rows: usize,
    cols: usize,
    /// `[rows, cols]`, row-major.
    codes: Vec<i8>,
    /// `[rows, cols / group]` (int4) or `[rows, 1]` (int8), row-major.
    scales: Vec<f16>,
}

/// Quantises `w` (`[rows, cols]`, row-major) to INT4 symmetric in groups of `group` inputs, as NNCF's `int4_sym`.
///
/// Fails (never panics) when `w` does not hold `rows · cols` values, `group` does not divide `cols`, a weight is not
/// finite, or a scale exceeds the f16 range (a group magnitude above 8 · 65504; NNCF would store infinity).
pub fn quantize_int4_sym(
    w: &[f32],
    rows: usize,
    cols: usize,
    group: usize,
) -> Result<QuantizedMatrix> {
    if group == 0 || !cols.is_multiple_of(group) {
        return Err(Error::Input(format!(
            "int4 group size {group} does not divide the input width {cols}"
        )));
    }
    quantize(w, rows, cols, QuantKind::Int4Sym { group })
}

/// Quantises `w` (`[rows, cols]`, row-major) to INT8 symmetric with one scale per row, as NNCF's `int8_sym`.
///
/// Fails like [`quantize_int4_sym`] (a row magnitude above 128 · 65504 overflows the f16 scale).
pub fn quantize_int8_sym(w: &[f32], rows: usize, cols: usize) -> Result<QuantizedMatrix> {
    quantize(w, rows, cols, QuantKind::Int8Sym)
}

/// [`quantize_int4_sym`] or [`quantize_int8_sym`], as `kind` says.
pub fn quantize_as(
    w: &[f32],
    rows: usize,
    cols: usize,
    kind: QuantKind,
) -> Result<QuantizedMatrix> {
    match kind {
        QuantKind::Int4Sym { group } => quantize_int4_sym(w, rows, cols, group),
        QuantKind::Int8Sym => quantize_int8_sym(w, rows, cols),
    }
}

fn check_len(len: usize, rows: usize, cols: usize, what: &str) -> Result<()> {
    match rows.checked_mul(cols) {
        Some(n) if n == len => Ok(()),
        _ => Err(Error::Input(format!(
            "{len} {what} for a [{rows}, {cols}] matrix"
        ))),
    }
}

fn quantize(w: &[f32], rows: usize, cols: usize, kind: QuantKind) -> Result<QuantizedMatrix> {
    check_len(w.len(), rows, cols, "values")?;
    if cols == 0 {
        return Err(Error::Input(format!(
            "cannot quantise a [{rows}, 0] matrix: it has no inputs"
        )));
    }
    if let Some(i) = w.iter().position(|x| !x.is_finite()) {
        return Err(Error::Input(format!(
            "element [{}, {}] is {}: cannot quantise a non-finite weight",
            i / cols,
            i % cols,
            w[i]
        )));
    }
    let group = match kind {
        QuantKind::Int4Sym { group } => group,
        QuantKind::Int8Sym => cols,
    };
    let mut codes = Vec::with_capacity(w.len());
    let mut scales = Vec::with_capacity(w.len() / group);
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        unsafe { quantize_groups_avx2(w, group, cols, kind, &mut codes, &mut scales) }?;
        return Ok(QuantizedMatrix {
            kind,
            rows,
            cols,
            codes,
            scales,
        });
    }
    quantize_groups(w, group, cols, kind, &mut codes, &mut scales)?;
    Ok(QuantizedMatrix {
        kind,
        rows,
        cols,
        codes,
        scales,
    })
}

/// [`quantize_groups`] compiled for AVX2 (rounding and division vectorised; every operation is the same IEEE one,
/// so the codes and scales are the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn quantize_groups_avx2(
    w: &[f32],
    group: usize,
    cols: usize,
    kind: QuantKind,
    codes: &mut Vec<i8>,
    scales: &mut Vec<f16>,
) -> Result<()> {
    quantize_groups(w, group, cols, kind, codes, scales)
}

/// The codes and scales of every group of `group` consecutive values of `w` (finite), appended to `codes` and
/// `scales` (the rules in the module docs).
#[inline(always)]
fn quantize_groups(
    w: &[f32],
    group: usize,
    cols: usize,
    kind: QuantKind,
    codes: &mut Vec<i8>,
    scales: &mut Vec<f16>,
) -> Result<()> {
    let (lo, hi) = kind.code_range();
    let divisor = -(lo as f32); // 8 or 128: exact
    for (g, chunk) in w.chunks_exact(group).enumerate() {
        let min = chunk.iter().copied().fold(f32::INFINITY, f32::min);
        let max = chunk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let signed = if min.abs() >= max { min.abs() } else { -max };
        let mut scale = signed / divisor;
        if scale.abs() < SCALE_FLOOR {
            scale = SCALE_FLOOR;
        }
        let stored = f16::from_f32(scale);
        if !stored.is_finite() {
            let row = g * group / cols;
            return Err(Error::Input(format!(
                "row {row}: the scale {scale:e} (largest magnitude {:e}) overflows f16",
                signed.abs()
            )));
        }
        scales.push(stored);
        let base = codes.len();
        codes.resize(base + chunk.len(), 0);
        for (c, &x) in codes[base..].iter_mut().zip(chunk) {
            *c = (x / scale).round_ties_even().clamp(lo as f32, hi as f32) as i8;
        }
    }
    Ok(())
}

impl QuantizedMatrix {
    /// A matrix from its parts (e.g. read back from a graph), checked: lengths, codes inside the kind's range,
    /// finite scales.
    pub fn from_parts(
        kind: QuantKind,
        rows: usize,
        cols: usize,
        codes: Vec<i8>,
        scales: Vec<f16>,
    ) -> Result<Self> {
        check_len(codes.len(), rows, cols, "codes")?;
        let per_row = match kind {
            QuantKind::Int4Sym { group } if group > 0 && cols.is_multiple_of(group) => cols / group,
            QuantKind::Int4Sym { group } => {
                return Err(Error::Input(format!(
                    "int4 group size {group} does not divide the input width {cols}"
                )));
            }
            QuantKind::Int8Sym => 1,
        };
        check_len(scales.len(), rows, per_row, "scales")?;
        let (lo, hi) = kind.code_range();
        if let Some(i) = codes.iter().position(|c| !(lo..=hi).contains(c)) {
            return Err(Error::Input(format!(
                "code {} at [{}, {}] is outside [{lo}, {hi}]",
                codes[i],
                i / cols,
                i % cols
            )));
        }
        if let Some(i) = scales.iter().position(|s| !s.is_finite()) {
            return Err(Error::Input(format!(
                "scale {i} is {}: scales must be finite",
                scales[i]
            )));
        }
        Ok(QuantizedMatrix {
            kind,
            rows,
            cols,
            codes,
            scales,
        })
    }

    /// INT4 (with its group) or INT8.
    pub fn kind(&self) -> QuantKind {
        self.kind
    }

    /// Output rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// `[rows, cols]`.
    pub fn shape(&self) -> [usize; 2] {
        [self.rows, self.cols]
    }

    /// Inputs sharing one scale (`cols` for INT8).
    pub fn group_size(&self) -> usize {
        match self.kind {
            QuantKind::Int4Sym { group } => group,
            QuantKind::Int8Sym => self.cols,
        }
    }

    /// The codes, `[rows, cols]` row-major (int4 codes in `[-8, 7]`, int8 in `[-128, 127]`).
    pub fn codes(&self) -> &[i8] {
        &self.codes
    }

    /// The scales, row-major in [`QuantizedMatrix::scale_shape`].
    pub fn scales(&self) -> &[f16] {
        &self.scales
    }

    /// `[rows, cols / group]` (int4) or `[rows, 1]` (int8).
    pub fn scale_shape(&self) -> [usize; 2] {
        match self.kind {
            QuantKind::Int4Sym { group } => [self.rows, self.cols / group.max(1)],
            QuantKind::Int8Sym => [self.rows, 1],
        }
    }

    /// The scale of element `[row, col]`.
    pub fn scale_at(&self, row: usize, col: usize) -> Option<f16> {
        if row >= self.rows || col >= self.cols {
            return None;
        }
        let per_row = self.scale_shape()[1];
        self.scales
            .get(row * per_row + col / self.group_size().max(1))
            .copied()
    }

    /// `f32(code) · f32(scale)` per element, `[rows, cols]` row-major: the exact values the OpenVINO graph
    /// computes from the same constants (the product is exact in f32).
    pub fn dequantize(&self) -> Vec<f32> {
        let group = self.group_size();
        if group == 0 {
            return Vec::new();
        }
        self.codes
            .chunks_exact(group)
            .zip(&self.scales)
            .flat_map(|(codes, &scale)| {
                let s = f32::from(scale);
                codes.iter().map(move |&c| c as f32 * s)
            })
            .collect()
    }

    /// The codes as OpenVINO stores the constant: [`pack_i4`] for INT4, one two's complement byte each for INT8.
    pub fn packed_codes(&self) -> Vec<u8> {
        match self.kind {
            QuantKind::Int4Sym { .. } => pack_nibbles(&self.codes),
            QuantKind::Int8Sym => self.codes.iter().map(|&c| c as u8).collect(),
        }
    }
}

fn pack_nibbles(codes: &[i8]) -> Vec<u8> {
    codes
        .chunks(2)
        .map(|pair| {
            let low = pair[0] as u8 & 0x0F;
            let high = pair.get(1).map_or(0, |&c| c as u8 & 0x0F);
            low | (high << 4)
        })
        .collect()
}

/// Packs int4 codes (each in `[-8, 7]`) two per byte as OpenVINO `i4` constants: element `2k` in the low nibble,
/// `2k + 1` in the high nibble, two's complement; an odd count leaves the last high nibble zero.
pub fn pack_i4(codes: &[i8]) -> Result<Vec<u8>> {
    if let Some(i) = codes.iter().position(|c| !(-8..=7).contains(c)) {
        return Err(Error::Input(format!(
            "int4 code {} at index {i} is outside [-8, 7]",
            codes[i]
        )));
    }
    Ok(pack_nibbles(codes))
}

/// The inverse of [`pack_i4`]: the first `len` int4 codes of `packed`.
pub fn unpack_i4(packed: &[u8], len: usize) -> Result<Vec<i8>> {
    if packed.len() < len.div_ceil(2) {
        return Err(Error::Input(format!(
            "{} bytes hold at most {} int4 codes, {len} requested",
            packed.len(),
            packed.len() * 2
        )));
    }
    let nibble = |n: u8| ((n << 4) as i8) >> 4;
    Ok((0..len)
        .map(|i| {
            let byte = packed[i / 2];
            nibble(if i % 2 == 0 { byte & 0x0F } else { byte >> 4 })
        })
        .collect())
}

/// Rounds to f16 as OpenVINO's fp16 compression does: to nearest even, magnitudes beyond 65504 clamped to ±65504
/// (NaN stays NaN).
pub fn round_f16(x: f64) -> f16 {
    if x > f64::from(f16::MAX) {
        f16::MAX
    } else if x < f64::from(f16::MIN) {
        f16::MIN
    } else {
        f16::from_f64(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signed_scale_maps_the_largest_magnitude_to_the_lowest_code() {
        // max (1.0) beats |min| (0.5): negative scale -1/8, so 1.0 -> -8 and -0.5 -> 4.
        let q = quantize_int4_sym(&[1.0, -0.5, 0.0, 0.25], 1, 4, 4).unwrap();
        assert_eq!(f32::from(q.scales()[0]), -0.125);
        assert_eq!(q.codes(), &[-8, 4, 0, -2]);
        // |min| == max: the positive scale, the positive extreme clips to 7.
        let q = quantize_int8_sym(&[-2.0, 2.0], 1, 2).unwrap();
        assert_eq!(f32::from(q.scales()[0]), 2.0 / 128.0);
        assert_eq!(q.codes(), &[-128, 127]);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx2_build_of_the_quantiser_gives_the_same_codes_and_scales() {
        if !is_x86_feature_detected!("avx2") {
            return;
        }
        // Values on a grid of halves and quarters of the scales give exact rounding ties; others are arbitrary.
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        let w: Vec<f32> = (0..64 * 96)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                if i % 3 == 0 {
                    (u * 32.0).round() / 4.0
                } else {
                    u * 3.0
                }
            })
            .collect();
        for kind in [
            QuantKind::Int4Sym { group: 32 },
            QuantKind::Int4Sym { group: 3 },
            QuantKind::Int8Sym,
        ] {
            let group = match kind {
                QuantKind::Int4Sym { group } => group,
                QuantKind::Int8Sym => 96,
            };
            let (mut c1, mut s1, mut c2, mut s2) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            quantize_groups(&w, group, 96, kind, &mut c1, &mut s1).unwrap();
            // SAFETY: AVX2 is present (checked above).
            unsafe { quantize_groups_avx2(&w, group, 96, kind, &mut c2, &mut s2) }.unwrap();
            assert_eq!(c1, c2, "{kind:?}");
            assert_eq!(
                s1.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                s2.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn round_f16_clamps_instead_of_overflowing() {
        assert_eq!(round_f16(1e6), f16::MAX);
        assert_eq!(round_f16(-1e6), f16::MIN);
        assert_eq!(round_f16(1.0 + 1.0 / 2048.0), f16::ONE); // a tie goes to the even neighbour
        assert_eq!(f64::from(round_f16(1.0 + 3.0 / 2048.0)), 1.0 + 2.0 / 1024.0);
        assert!(round_f16(f64::NAN).is_nan());
    }
}
