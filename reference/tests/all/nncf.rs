//! Our quantiser against NNCF itself: `goldens/nncf.safetensors` holds, per case, a weight and the integer codes and
//! f16 scales that `nncf.compress_weights` stored for it in the compressed OpenVINO model (made by
//! `scripts/make_nncf_goldens.py`; the metadata lists the cases, the calls and the versions). Every code and every
//! scale bit must be the same.
//!
//! A case with `experts` is one stacked constant `[experts, rows, cols]` read by a batched MatMul with `transpose_b`,
//! as optimum-intel exports an MoE layer's experts; each expert's slice must be what our quantiser gives that
//! expert's own `[rows, cols]` matrix.

use crate::common::testdata;
use half::f16;
use reference::quant::{QuantizedMatrix, quantize_int4_sym, quantize_int8_sym};
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;
use std::fmt::Write as _;

/// One entry of the golden's `cases` metadata.
#[derive(Debug, Deserialize)]
struct Case {
    case: String,
    /// `int4_sym` or `int8_sym`: what NNCF stored for this weight.
    kind: String,
    /// The int4 group size, −1 for int8 (per output row).
    group: i64,
    /// Rows and columns of the matrix, of each expert's matrix for stacked experts.
    rows: usize,
    cols: usize,
    /// The number of stacked experts (`[experts, rows, cols]`); absent for a matrix.
    #[serde(default)]
    experts: Option<usize>,
    role: String,
    /// `openvino` (NNCF's OpenVINO-graph implementation) or `numpy`.
    nncf_implementation: String,
}

/// How many first mismatches a case reports.
const SHOWN: usize = 8;

fn tensor<'a>(st: &'a SafeTensors, name: &str, dtype: Dtype, shape: &[usize]) -> &'a [u8] {
    let view = st
        .tensor(name)
        .unwrap_or_else(|e| panic!("nncf golden: {name}: {e}"));
    assert_eq!(view.dtype(), dtype, "nncf golden: {name} dtype");
    assert_eq!(view.shape(), shape, "nncf golden: {name} shape");
    view.data()
}

/// Situations the golden must contain for the comparison to mean something, counted over all cases.
#[derive(Debug, Default)]
struct Coverage {
    int4_cases: usize,
    int8_cases: usize,
    openvino_cases: usize,
    numpy_cases: usize,
    backup_cases: usize,
    /// Stacked-experts cases that NNCF's OpenVINO implementation made, int4 and int8.
    experts_int4_openvino: usize,
    experts_int8_openvino: usize,
    /// Scales < 0: the largest magnitude of the group was positive.
    negative_scales: usize,
    /// Scales at NNCF's floor, f32 machine epsilon.
    floor_scales: usize,
    /// f16 subnormal scales.
    subnormal_scales: usize,
    /// Elements whose `w / scale` is exactly `k + 1/2` (with the f16 scale, which equals the f32 one for those rows).
    rounding_ties: usize,
    /// Positive elements clipped to the largest code under a positive scale (`|min| == max`).
    clipped_positive: usize,
    /// Groups whose f32 scale lies exactly halfway between two f16 values (its rounding to f16 is a tie).
    f16_scale_ties: usize,
}

/// The mismatches of one case (of one expert of it, `expert`) as a labelled report (empty when ours equals NNCF's).
fn compare(
    c: &Case,
    expert: Option<usize>,
    w: &[f32],
    codes: &[i8],
    scales: &[f16],
    ours: &QuantizedMatrix,
) -> String {
    let mut report = String::new();
    let group = ours.group_size();
    let per_row = ours.scale_shape()[1];
    let scale_bad: Vec<usize> = (0..scales.len())
        .filter(|&i| scales[i].to_bits() != ours.scales()[i].to_bits())
        .collect();
    let code_bad: Vec<usize> = (0..codes.len())
        .filter(|&i| codes[i] != ours.codes()[i])
        .collect();
    if scale_bad.is_empty() && code_bad.is_empty() {
        return report;
    }
    let _ = writeln!(
        report,
        "{}{} ({} {}, [{}, {}], {}, NNCF {}): {} of {} scales and {} of {} codes differ",
        c.case,
        expert.map_or(String::new(), |e| format!(
            " expert {e} of {}",
            c.experts.unwrap_or(0)
        )),
        c.kind,
        if c.group > 0 {
            format!("group {}", c.group)
        } else {
            "per row".into()
        },
        c.rows,
        c.cols,
        c.role,
        c.nncf_implementation,
        scale_bad.len(),
        scales.len(),
        code_bad.len(),
        codes.len()
    );
    for &i in scale_bad.iter().take(SHOWN) {
        let (row, g) = (i / per_row, i % per_row);
        let chunk = &w[row * c.cols + g * group..row * c.cols + (g + 1) * group];
        let min = chunk.iter().copied().fold(f32::INFINITY, f32::min);
        let max = chunk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let _ = writeln!(
            report,
            "  scale [{row}, {g}]: NNCF {:e} ({:#06x}), ours {:e} ({:#06x}); group min {min:e}, max {max:e}",
            f32::from(scales[i]),
            scales[i].to_bits(),
            f32::from(ours.scales()[i]),
            ours.scales()[i].to_bits()
        );
    }
    for &i in code_bad.iter().take(SHOWN) {
        let (row, col) = (i / c.cols, i % c.cols);
        let s = scales[row * per_row + col / group];
        let _ = writeln!(
            report,
            "  code [{row}, {col}]: w {:e} ({:#010x}), NNCF {}, ours {}; NNCF scale {:e}, w / scale {:?}",
            w[i],
            w[i].to_bits(),
            codes[i],
            ours.codes()[i],
            f32::from(s),
            w[i] / f32::from(s)
        );
    }
    report
}

#[test]
fn quantiser_matches_nncf_codes_and_scales() {
    let path = testdata().join("goldens/nncf.safetensors");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let metadata = meta.metadata().clone().unwrap_or_default();
    let cases: Vec<Case> = serde_json::from_str(&metadata["cases"]).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(
        st.names().len(),
        3 * cases.len(),
        "nncf golden: tensors other than the listed cases' weight, codes and scales"
    );

    let floor = f16::from_f32(f32::EPSILON);
    let mut coverage = Coverage::default();
    let mut report = String::new();
    for c in &cases {
        // A matrix is `[rows, cols]`; stacked experts are `[experts, rows, cols]`, compared expert by expert.
        let experts = c.experts.unwrap_or(1);
        let shape =
            |last: usize| -> Vec<usize> { c.experts.into_iter().chain([c.rows, last]).collect() };
        let w: Vec<f32> = tensor(
            &st,
            &format!("{}.weight", c.case),
            Dtype::F32,
            &shape(c.cols),
        )
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
        let codes: Vec<i8> = tensor(&st, &format!("{}.codes", c.case), Dtype::I8, &shape(c.cols))
            .iter()
            .map(|&b| b as i8)
            .collect();
        let per_row = match (c.kind.as_str(), c.group) {
            ("int4_sym", g) if g > 0 => c.cols / g as usize,
            ("int8_sym", -1) => 1,
            (kind, group) => panic!("{}: unknown kind {kind} with group {group}", c.case),
        };
        let scales: Vec<f16> = tensor(
            &st,
            &format!("{}.scales", c.case),
            Dtype::F16,
            &shape(per_row),
        )
        .chunks_exact(2)
        .map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]])))
        .collect();
        // Each expert's matrix quantised on its own, as the reference and this project's graphs store experts.
        let (size, scale_size) = (c.rows * c.cols, c.rows * per_row);
        let mut quantised = Vec::with_capacity(experts);
        for e in 0..experts {
            let w_e = &w[e * size..(e + 1) * size];
            let ours = match c.kind.as_str() {
                "int4_sym" => quantize_int4_sym(w_e, c.rows, c.cols, c.group as usize),
                _ => quantize_int8_sym(w_e, c.rows, c.cols),
            }
            .unwrap_or_else(|err| {
                panic!("{} (expert {e}): our quantiser refused it: {err}", c.case)
            });
            assert_eq!(ours.scale_shape(), [c.rows, per_row], "{}", c.case);
            report.push_str(&compare(
                c,
                c.experts.map(|_| e),
                w_e,
                &codes[e * size..(e + 1) * size],
                &scales[e * scale_size..(e + 1) * scale_size],
                &ours,
            ));
            quantised.push(ours);
        }
        let ours = &quantised[0];
        if c.experts.is_some() && c.nncf_implementation == "openvino" {
            match c.kind.as_str() {
                "int4_sym" => coverage.experts_int4_openvino += 1,
                _ => coverage.experts_int8_openvino += 1,
            }
        }

        match c.kind.as_str() {
            "int4_sym" => coverage.int4_cases += 1,
            _ => coverage.int8_cases += 1,
        }
        match c.nncf_implementation.as_str() {
            "openvino" => coverage.openvino_cases += 1,
            _ => coverage.numpy_cases += 1,
        }
        coverage.backup_cases += usize::from(c.role.contains("backup"));
        coverage.negative_scales += scales.iter().filter(|s| s.is_sign_negative()).count();
        coverage.floor_scales += scales.iter().filter(|&&s| s == floor).count();
        coverage.subnormal_scales += scales
            .iter()
            .filter(|s| s.to_bits() & 0x7c00 == 0 && s.to_bits() & 0x03ff != 0)
            .count();
        let hi = ours.kind().code_range().1;
        let group = ours.group_size();
        for (i, (&x, &code)) in w.iter().zip(&codes).enumerate() {
            let s = f32::from(scales[i / c.cols * per_row + i % c.cols / group]);
            let ratio = x / s;
            coverage.rounding_ties += usize::from((ratio - ratio.trunc()).abs() == 0.5);
            coverage.clipped_positive +=
                usize::from(code == hi && s > 0.0 && ratio.round_ties_even() > f32::from(hi));
        }
        // The f32 scale of each group, `±max|w| / 2^(b-1)`, for the count of f16 ties (the sign does not matter).
        let divisor = -f32::from(ours.kind().code_range().0);
        for chunk in w.chunks_exact(group) {
            let s = chunk.iter().fold(0f32, |m, x| m.max(x.abs())) / divisor;
            let r = f16::from_f32(s);
            let below = f16::from_bits(r.to_bits().wrapping_sub(1));
            let above = f16::from_bits(r.to_bits() + 1);
            let tie = [below, above]
                .iter()
                .any(|n| f64::from(s) == (f64::from(r) + f64::from(*n)) / 2.0);
            coverage.f16_scale_ties += usize::from(r.is_normal() && tie);
        }
    }
    println!(
        "NNCF golden (versions {}): {} cases; {coverage:?}",
        metadata.get("versions").map_or("?", String::as_str),
        cases.len()
    );
    assert!(
        report.is_empty(),
        "our quantiser differs from NNCF:\n{report}"
    );
    // What the comparison covered: both kinds, both of NNCF's implementations, the backup precision, stacked experts
    // above NNCF's threshold in both kinds, and the rows built to tell rounding, sign, floor and f16 conventions apart.
    let Coverage {
        int4_cases,
        int8_cases,
        openvino_cases,
        numpy_cases,
        backup_cases,
        experts_int4_openvino,
        experts_int8_openvino,
        negative_scales,
        floor_scales,
        subnormal_scales,
        rounding_ties,
        clipped_positive,
        f16_scale_ties,
    } = coverage;
    for (what, n) in [
        ("int4 cases", int4_cases),
        ("int8 cases", int8_cases),
        ("cases from NNCF's OpenVINO implementation", openvino_cases),
        ("cases from NNCF's numpy implementation", numpy_cases),
        ("backup-precision cases", backup_cases),
        (
            "int4 stacked-experts cases from NNCF's OpenVINO implementation",
            experts_int4_openvino,
        ),
        (
            "int8 stacked-experts cases from NNCF's OpenVINO implementation",
            experts_int8_openvino,
        ),
        ("negative scales", negative_scales),
        ("scales at the floor", floor_scales),
        ("f16 subnormal scales", subnormal_scales),
        ("exact rounding ties", rounding_ties),
        ("clipped positive extremes", clipped_positive),
        ("scales halfway between two f16 values", f16_scale_ties),
    ] {
        assert!(n > 0, "the NNCF golden has no {what}");
    }
}
