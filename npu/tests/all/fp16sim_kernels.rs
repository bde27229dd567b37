//! FP16SIM's tiled kernels (vectorised parallel products, checkpoint matrices decoded a tile at a time from the
//! `.bin`) against its plain evaluator (every op as written, one term at a time): the same numbers to the last bit,
//! every tap, state, logit and greedy token, on every testdata model, in every weight format, under every option
//! of the numeric model, through every DeltaNet graph form. Nothing is compared with a tolerance: a kernel that
//! summed in another order or rounded once too few would differ here in the last bit.

use candle_core::{DType, Tensor};
use npu::devices::CompileOptions;
use npu::engine::DecoderEngine;
use npu::graphs::{Builder, DeltaNetGraphForm, GraphOptions, MoeGraphForm};
use reference::config::Config;
use reference::deltanet::Inverse;
use reference::quant::WeightFormat;
use reference::weights::WeightStore;
use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::common;
use common::{ids_of, run};

fn testdata() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata")
}

/// Every output of a run (taps, logits, states) and its greedy tokens.
fn outputs(
    config: &Config,
    weights: &WeightStore,
    opts: GraphOptions,
    block: usize,
    device: &str,
    ids: &[u32],
) -> (BTreeMap<String, Tensor>, Vec<u32>) {
    let builder = Builder::new(config, weights, opts).unwrap();
    let mut engine = DecoderEngine::new(&builder, block, device, &CompileOptions::default())
        .unwrap_or_else(|e| panic!("{device}: {e}"));
    let r = run(&mut engine, ids, 3).unwrap_or_else(|e| panic!("{device}: {e}"));
    let mut out = r.taps;
    out.extend(r.states);
    (out, r.generated)
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        // Every NaN is one NaN (the plain rounding and the tiled one may quiet it with other payloads).
        .map(|x| {
            if x.is_nan() {
                f32::NAN.to_bits()
            } else {
                x.to_bits()
            }
        })
        .collect()
}

fn assert_same(label: &str, tiled: &BTreeMap<String, Tensor>, plain: &BTreeMap<String, Tensor>) {
    assert_eq!(
        tiled.keys().collect::<Vec<_>>(),
        plain.keys().collect::<Vec<_>>(),
        "{label}: outputs"
    );
    for (name, t) in tiled {
        let (a, b) = (bits(t), bits(&plain[name]));
        let first = a.iter().zip(&b).position(|(x, y)| x != y);
        assert!(
            first.is_none() && a.len() == b.len(),
            "{label} {name}: element {:?} differs: tiled {:e}, plain {:e}",
            first,
            first.map_or(0.0, |i| f32::from_bits(a[i])),
            first.map_or(0.0, |i| f32::from_bits(b[i]))
        );
    }
}

/// One model, format, graph form and option set: the tiled run equals the plain one bit for bit.
fn check(name: &str, format: &str, form: DeltaNetGraphForm, block: usize, options: &str) {
    check_moe(name, format, form, block, options, MoeGraphForm::default());
}

/// [`check`] with the MoE block's experts computed in `moe`.
fn check_moe(
    name: &str,
    format: &str,
    form: DeltaNetGraphForm,
    block: usize,
    options: &str,
    moe: MoeGraphForm,
) {
    let dir = testdata().join("models").join(name);
    let config = Config::from_file(&dir.join("config.json")).unwrap();
    let weights =
        WeightStore::open_with_format(&dir, DType::F32, WeightFormat::parse(format).unwrap())
            .unwrap();
    let golden = candle_core::safetensors::load(
        testdata().join(format!("goldens/{name}.safetensors")),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    // A prefix of the golden prompt: two and a half prompt blocks, then single tokens.
    let ids: Vec<u32> = ids_of(&golden["token_ids"])[..20].to_vec();
    let opts = GraphOptions {
        form,
        context: 32,
        taps: true,
        moe,
        ..GraphOptions::default()
    };
    let sep = if options.is_empty() { "" } else { "," };
    let tiled = format!("FP16SIM:kernels=tiled{sep}{options}");
    let plain = format!("FP16SIM:kernels=plain{sep}{options}");
    let (t, t_tokens) = outputs(&config, &weights, opts, block, &tiled, &ids);
    let (p, p_tokens) = outputs(&config, &weights, opts, block, &plain, &ids);
    let label = format!(
        "{name} {format} {form:?} block {block} `{options}` {}",
        moe.name()
    );
    assert_eq!(t_tokens, p_tokens, "{label}: greedy tokens");
    assert_same(&label, &t, &p);
    assert!(t.len() > 10, "{label}: only {} outputs", t.len());
}

#[test]
fn tiled_kernels_equal_the_plain_evaluator_under_every_option() {
    for options in [
        "",
        "acc=f16",
        "state=f32",
        "ftz=off",
        "norm=fused",
        "store=bf16",
        "store=bf16,acc=bf16,ftz=off",
        "store=f32,ftz=off",
        "store=f32",
    ] {
        for format in ["f32", "int4:32"] {
            check(
                "tiny",
                format,
                DeltaNetGraphForm::Chunked(Inverse::Doubling),
                8,
                options,
            );
        }
    }
}

#[test]
fn tiled_kernels_equal_the_plain_evaluator_on_every_model_format_and_form() {
    for name in common::models() {
        for format in ["f32", "f16", "int4:16", "int4-nncf:16"] {
            check(
                &name,
                format,
                DeltaNetGraphForm::Chunked(Inverse::Doubling),
                8,
                "",
            );
        }
    }
    for form in [
        DeltaNetGraphForm::Matrix,
        DeltaNetGraphForm::Loop,
        DeltaNetGraphForm::Chunked(Inverse::Substitution),
    ] {
        check("tiny", "int4:32", form, 5, "");
    }
}

/// The MoE block (tiny-moe): its router's TopK on fp16 probabilities, its stacked experts gathered (the tiled
/// evaluator's products read each chosen expert from the stack, the plain one the gathered copies) or masked, in f32
/// and INT4/INT8 (gate and up INT4, down INT8), with f32 and fp16 accumulation, tiled equal to plain bit for bit.
#[test]
fn tiled_kernels_equal_the_plain_evaluator_on_the_moe_block() {
    for moe in [MoeGraphForm::Gather, MoeGraphForm::Masked] {
        for (format, options) in [("f32", ""), ("int4:32", ""), ("int4:32", "acc=f16")] {
            check_moe(
                "tiny-moe",
                format,
                DeltaNetGraphForm::Chunked(Inverse::Doubling),
                8,
                options,
                moe,
            );
        }
    }
}
