//! The DeltaNet output against fp16's range (SPEC "fp16 precision of the DeltaNet output"), measured with the
//! reference on each testdata model's golden prompt: per layer and value head, the RMS of `core_output` over the
//! prompt's tokens and Dv, and the share of the products `S_ij·q_i` of `o_t = S_tᵀq_t` (every token, after its state
//! update) whose magnitude is below fp16's smallest normal 2⁻¹⁴ and below its smallest subnormal 2⁻²⁴. (The port's
//! rescaling multiplies q by 2¹⁰, so the second share is also the share still below 2⁻¹⁴ with it.)
//!
//! `tiny-h128` exists for this: the real head dims (Dk = Dv = 128) and the real model's per-head RMS of 1e-3..2e-2.
//! The figures must agree with those `make_testdata.py` computed from the goldens and recorded in the manifest.

use crate::common::testdata;
use crate::goldens::load_golden;
use crate::manifest::models;
use candle_core::{DType, Tensor};
use reference::config::LayerKind;
use reference::deltanet::{self, Inputs};
use reference::model::{Model, RunOptions};
use reference::ops::repeat_interleave;
use reference::taps::Taps;

const FP16_MIN_NORMAL: f64 = 6.103_515_625e-5; // 2^-14
const FP16_MIN_SUBNORMAL: f64 = 5.960_464_477_539_063e-8; // 2^-24

/// What the real model shows (SPEC) and what tiny-h128 must show: every head's RMS in this range ...
const REAL_RMS_RANGE: (f64, f64) = (1e-3, 2e-2);
/// ... with some heads near 1e-3 and some near 1e-2.
const SMALLEST_AT_MOST: f64 = 2e-3;
const LARGEST_AT_LEAST: f64 = 1e-2;

/// Per value head of one DeltaNet layer.
struct HeadFigures {
    rms: Vec<f64>,
    below_normal: Vec<f64>,
    below_subnormal: Vec<f64>,
    /// What flushing those products (and nothing else) does after the gated norm: `‖N − N'‖ / ‖N‖` over tokens and
    /// Dv, where `N` holds each token's `o_t / sqrt(mean(o_t²) + eps)` (the norm without its gate and weight) and `N'`
    /// the same from `o_t'`, which sums only the products at or above 2⁻¹⁴.
    flush_error: Vec<f64>,
    /// The same with the port's rescaling (q × 2¹⁰ and eps × 2²⁰, so the products below 2⁻²⁴ are the ones flushed).
    flush_error_scaled: Vec<f64>,
}

/// One token's products `[Hv, Dk, Dv]`: per head, `‖n(o) − n(o')‖²` into `num` and `‖n(o)‖²` into `den`, where `o'`
/// drops the products below `threshold` and `n(x) = x / sqrt(mean(x²) + eps)` over Dv.
fn flush_error_sq(products: &Tensor, threshold: f64, eps: f64, num: &mut [f64], den: &mut [f64]) {
    let kept = products
        .abs()
        .unwrap()
        .ge(threshold)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap();
    let normed = |o: Tensor| {
        let rms = (o.sqr().unwrap().mean_keepdim(1).unwrap() + eps)
            .unwrap()
            .sqrt()
            .unwrap();
        o.broadcast_div(&rms).unwrap()
    };
    let n = normed(products.sum(1).unwrap()); // [Hv, Dv]
    let n_flushed = normed((products * kept).unwrap().sum(1).unwrap());
    let sq = |x: &Tensor| x.sqr().unwrap().sum(1).unwrap().to_vec1::<f64>().unwrap();
    for (h, (a, b)) in sq(&(&n - n_flushed).unwrap())
        .into_iter()
        .zip(sq(&n))
        .enumerate()
    {
        num[h] += a;
        den[h] += b;
    }
}

/// Shares per head `[Hv]` of `|x| < threshold` in `x [Hv, ..]`, summed into `acc`.
fn count_below(x: &Tensor, threshold: f64, acc: &mut [f64]) {
    let below = x
        .abs()
        .unwrap()
        .lt(threshold)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .flatten_from(1)
        .unwrap()
        .sum(1)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    for (a, b) in acc.iter_mut().zip(below) {
        *a += b;
    }
}

/// Per head of `x [T, Hv, Dv]`: the largest magnitude.
fn head_max_abs(x: &Tensor) -> Vec<f64> {
    x.abs()
        .unwrap()
        .transpose(0, 1)
        .unwrap()
        .flatten_from(1)
        .unwrap()
        .max(1)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

fn measure(name: &str) -> Vec<(usize, HeadFigures)> {
    let dir = testdata().join("models").join(name);
    let golden = load_golden(&testdata().join(format!("goldens/{name}.safetensors")));
    let ids: Vec<u32> = golden.tensors["token_ids"]
        .to_vec1::<i64>()
        .unwrap()
        .into_iter()
        .map(|x| x as u32)
        .collect();
    let model = Model::load(&dir, DType::F32).unwrap();
    let c = model.config().clone();
    let mut state = model.new_state().unwrap();
    let mut taps = Taps::on();
    model
        .forward(&ids, &mut state, &RunOptions::default(), &mut taps)
        .unwrap();
    let (hk, hv, dk) = (
        c.linear_num_key_heads,
        c.linear_num_value_heads,
        c.linear_key_head_dim,
    );
    let mut out = Vec::new();
    for (i, kind) in c.layer_types.iter().enumerate() {
        if *kind != LayerKind::Linear {
            continue;
        }
        // The kernel's inputs from the run's taps, in f64 and heads first.
        let tap = |n: &str| {
            taps.get(&format!("layers.{i}.linear_attn.{n}"))
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
        };
        let heads_first = |x: Tensor| x.transpose(0, 1).unwrap().contiguous().unwrap();
        let x = Inputs {
            q: repeat_interleave(
                &heads_first((tap("query_normed") * (dk as f64).powf(-0.5)).unwrap()),
                hv / hk,
                0,
            )
            .unwrap(),
            k: repeat_interleave(&heads_first(tap("key_normed")), hv / hk, 0).unwrap(),
            v: heads_first(tap("value")),
            g: heads_first(tap("g")),
            beta: heads_first(tap("beta")),
        };
        let core = tap("core_output"); // [T, Hv, Dv]
        let rms = core
            .sqr()
            .unwrap()
            .mean(2)
            .unwrap()
            .mean(0)
            .unwrap()
            .sqrt()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        let (_, t, _) = x.q.dims3().unwrap();
        let dv = c.linear_value_head_dim;
        let mut s = Tensor::zeros((hv, dk, dv), DType::F64, core.device()).unwrap();
        let mut below_normal = vec![0.0; hv];
        let mut below_subnormal = vec![0.0; hv];
        let (mut flush, mut flush_scaled, mut norm_sq) =
            (vec![0.0; hv], vec![0.0; hv], vec![0.0; hv]);
        let mut norm_sq_scaled = vec![0.0; hv]; // the same sums as norm_sq
        let eps = c.rms_norm_eps;
        let mut outs = Vec::with_capacity(t);
        for step in 0..t {
            let (o, next) = deltanet::sequential(&x.narrow(step, 1).unwrap(), &s).unwrap();
            s = next;
            let q =
                x.q.narrow(1, step, 1)
                    .unwrap()
                    .reshape((hv, dk, 1))
                    .unwrap();
            let products = s.broadcast_mul(&q).unwrap(); // [Hv, Dk, Dv]: S_ij q_i, summed over i into o_j
            count_below(&products, FP16_MIN_NORMAL, &mut below_normal);
            count_below(&products, FP16_MIN_SUBNORMAL, &mut below_subnormal);
            flush_error_sq(&products, FP16_MIN_NORMAL, eps, &mut flush, &mut norm_sq);
            flush_error_sq(
                &products,
                FP16_MIN_SUBNORMAL,
                eps,
                &mut flush_scaled,
                &mut norm_sq_scaled,
            );
            outs.push(o);
        }
        // The stepped recurrence is the run's own: its outputs are the core_output tap (per head, 1e-4 of its max).
        let stepped = Tensor::cat(&outs, 1).unwrap().transpose(0, 1).unwrap();
        let err = head_max_abs(&(stepped - &core).unwrap());
        for (h, (e, m)) in err.iter().zip(head_max_abs(&core)).enumerate() {
            assert!(
                *e <= 1e-4 * m,
                "{name} layer {i} head {h}: stepped output off by {e:.2e} (max {m:.2e})"
            );
        }
        let total = (t * dk * dv) as f64;
        out.push((
            i,
            HeadFigures {
                rms,
                below_normal: below_normal.iter().map(|n| n / total).collect(),
                below_subnormal: below_subnormal.iter().map(|n| n / total).collect(),
                flush_error: flush
                    .iter()
                    .zip(&norm_sq)
                    .map(|(e, n)| (e / n).sqrt())
                    .collect(),
                flush_error_scaled: flush_scaled
                    .iter()
                    .zip(&norm_sq_scaled)
                    .map(|(e, n)| (e / n).sqrt())
                    .collect(),
            },
        ));
    }
    out
}

fn manifest_rows(name: &str, section: &str, key: &str) -> Vec<(usize, Vec<f64>)> {
    let text = std::fs::read_to_string(testdata().join("manifest.json")).unwrap();
    let manifest: serde_json::Value = serde_json::from_str(&text).unwrap();
    manifest["models"][name][section]
        .as_array()
        .unwrap_or_else(|| panic!("manifest: models.{name}.{section} missing"))
        .iter()
        .map(|row| {
            let layer = row["layer"].as_u64().unwrap() as usize;
            let values = row[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect();
            (layer, values)
        })
        .collect()
}

fn fmt(values: &[f64], f: impl Fn(f64) -> String) -> String {
    values.iter().map(|&v| f(v)).collect::<Vec<_>>().join(" ")
}

#[test]
fn deltanet_output_against_fp16_range() {
    for name in models() {
        let name = name.as_str();
        let figures = measure(name);
        let rms_m = manifest_rows(name, "core_output_rms", "rms");
        let normal_m = manifest_rows(name, "fp16_product_shares", "below_min_normal");
        let sub_m = manifest_rows(name, "fp16_product_shares", "below_min_subnormal");
        assert_eq!(figures.len(), rms_m.len(), "{name}: DeltaNet layers");
        println!(
            "{name}: per value head, core_output RMS | share of |S_ij q_i| < 2^-14 | < 2^-24 | gated-norm error from \
             flushing those | with q x 1024"
        );
        for (j, (layer, f)) in figures.iter().enumerate() {
            println!(
                "  layer {layer}: {} | {} | {} | {} | {}",
                fmt(&f.rms, |v| format!("{v:.3e}")),
                fmt(&f.below_normal, |v| format!("{:.1}%", 100.0 * v)),
                fmt(&f.below_subnormal, |v| format!("{:.2}%", 100.0 * v)),
                fmt(&f.flush_error, |v| format!("{:.2}%", 100.0 * v)),
                fmt(&f.flush_error_scaled, |v| format!("{:.3}%", 100.0 * v)),
            );
            // make_testdata.py measured the same in float64 from transformers' tensors.
            for (ours, (l, theirs), what, tol) in [
                (&f.rms, &rms_m[j], "RMS (relative)", 1e-4),
                (&f.below_normal, &normal_m[j], "share below 2^-14", 2e-3),
                (&f.below_subnormal, &sub_m[j], "share below 2^-24", 2e-3),
            ] {
                assert_eq!(l, layer, "{name}: manifest layer order");
                for (h, (a, b)) in ours.iter().zip(theirs).enumerate() {
                    let gap = if what.starts_with("RMS") {
                        (a / b - 1.0).abs()
                    } else {
                        (a - b).abs()
                    };
                    assert!(
                        gap <= tol,
                        "{name} layer {layer} head {h}: {what} {a:.6e} here, {b:.6e} in the manifest"
                    );
                }
            }
        }
        if name == "tiny-h128" {
            let all: Vec<f64> = figures.iter().flat_map(|(_, f)| f.rms.clone()).collect();
            let (lo, hi) = all.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &x| {
                (lo.min(x), hi.max(x))
            });
            assert!(
                lo >= REAL_RMS_RANGE.0 && hi <= REAL_RMS_RANGE.1,
                "{name}: core_output RMS {lo:.3e}..{hi:.3e} outside the real model's range"
            );
            assert!(
                lo <= SMALLEST_AT_MOST && hi >= LARGEST_AT_LEAST,
                "{name}: core_output RMS {lo:.3e}..{hi:.3e} does not span the real model's range"
            );
        }
    }
}
