//! The MoE decoder against transformers' `Qwen3_5MoeForCausalLM` on `tiny-moe` (scripts/make_moe_goldens.py):
//! every golden tensor within the dense goldens' tolerances (f32 and f64), the same experts chosen at every token
//! and layer, the same greedy tokens, the constructed near tie decided as transformers decides it; the fused expert
//! form read as the per-expert one, bit for bit; a missing expert or a bad config field named. The same in f32 on
//! `tiny-moe-gguf` (equal linear key and value head dims and 32-wide experts: the MoE model llama.cpp's fixtures are
//! made of, `testdata/gguf/llamacpp/`).

use crate::common::testdata;
use crate::goldens::{
    F64_LOGITS_ATOL, F64_RTOL, Golden, LAYER_RTOL, LOGITS_ATOL, check_prompt, compare_all, ids_of,
    load_golden, run_prompt,
};
use candle_core::{DType, Tensor};
use reference::model::{Model, RunOptions};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

fn model_dir() -> PathBuf {
    testdata().join("models/tiny-moe")
}

/// The MoE model made for llama.cpp's fixtures; its golden is f32 only.
const GGUF_MODEL: &str = "tiny-moe-gguf";

fn chosen(t: &Tensor) -> Vec<Vec<i64>> {
    t.to_vec2::<i64>().unwrap()
}

/// Holds the run's chosen experts to the golden's at every token of every layer (the same experts in the same
/// order); returns the (token, layer) pairs compared.
fn same_experts(
    label: &str,
    run: &HashMap<String, Tensor>,
    golden: &Golden,
    layers: usize,
) -> usize {
    let mut compared = 0;
    for i in 0..layers {
        let name = format!("layers.{i}.mlp.experts_chosen");
        let ours = chosen(&run[&name]);
        let theirs = chosen(&golden.tensors[&name]);
        assert_eq!(ours.len(), theirs.len(), "{label} {name}");
        for (t, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert_eq!(
                a, b,
                "{label} {name}: token {t} chose {a:?}, transformers {b:?}"
            );
        }
        compared += ours.len();
    }
    compared
}

fn check(name: &str, dtype: DType) {
    let dir = testdata().join("models").join(name);
    let suffix = if dtype == DType::F64 { ".f64" } else { "" };
    let golden = load_golden(&testdata().join(format!("goldens/{name}{suffix}.safetensors")));
    let ids = if dtype == DType::F64 {
        ids_of(&golden.tensors["token_ids"])
    } else {
        check_prompt(&dir, &golden)
    };
    let model = Model::load(&dir, dtype).unwrap();
    let moe = model
        .config()
        .moe
        .clone()
        .unwrap_or_else(|| panic!("{name} is an MoE decoder"));
    let layers = model.config().num_layers();
    let (rtol, atol) = match dtype {
        DType::F64 => (F64_RTOL, F64_LOGITS_ATOL),
        _ => (LAYER_RTOL, LOGITS_ATOL),
    };
    // The whole prompt in one call (the experts' products as GEMMs), and in calls of 5 tokens (matrix-vector
    // products, as decode runs them).
    let mut forms = vec![RunOptions::default()];
    if dtype == DType::F32 {
        forms.push(RunOptions {
            prefill_block: Some(5),
            ..RunOptions::default()
        });
    }
    let mut kept = None;
    for opts in forms {
        let (run, generated) = run_prompt(&model, &ids, &opts);
        let label = format!("{name} {dtype:?} prefill block {:?}", opts.prefill_block);
        let worst = compare_all(&label, &golden, &run, model.config(), atol, rtol);
        let pairs = same_experts(&label, &run, &golden, layers);
        assert_eq!(
            generated,
            ids_of(&golden.tensors["generated"]),
            "{label}: greedy tokens differ"
        );
        println!(
            "{label}: the same {} experts at all {pairs} (token, layer) pairs; 16 greedy tokens identical",
            moe.num_experts_per_tok
        );
        for w in worst {
            w.print();
        }
        kept.get_or_insert(run);
    }
    let run = kept.unwrap();
    let label = format!("{name} {dtype:?}");

    // The near tie: two experts' probabilities within 1e-4 at one token of one layer, the k-th chosen and the next
    // left out, as transformers chose.
    let tie: serde_json::Value = serde_json::from_str(&golden.metadata["near_tie"]).unwrap();
    let (layer, token) = (
        tie["layer"].as_u64().unwrap() as usize,
        tie["token"].as_u64().unwrap() as usize,
    );
    let (kth, next) = (
        tie["kth_expert"].as_u64().unwrap() as i64,
        tie["next_expert"].as_u64().unwrap() as i64,
    );
    let logits = run[&format!("layers.{layer}.mlp.router_logits")]
        .get(token)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap();
    let p: Vec<f64> = reference::ops::softmax_last_dim(&logits.unsqueeze(0).unwrap())
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec1()
        .unwrap();
    let gap = p[kth as usize] - p[next as usize];
    assert!(
        gap > 0.0 && gap < 1e-4,
        "{label}: the near tie's gap is {gap:.3e}"
    );
    let row = &chosen(&run[&format!("layers.{layer}.mlp.experts_chosen")])[token];
    assert_eq!(
        row[moe.num_experts_per_tok - 1],
        kth,
        "{label}: near tie {row:?}"
    );
    assert!(!row.contains(&next), "{label}: near tie {row:?}");
    println!(
        "{label}: near tie at layer {layer} token {token}: experts {kth} and {next} {gap:.3e} apart (transformers \
         {}), {kth} chosen as transformers chose",
        tie[if dtype == DType::F64 {
            "gap_f64"
        } else {
            "gap_f32"
        }]
    );
}

/// The schema lists exactly the checkpoint's tensors: per layer the router, every expert's three matrices, the
/// shared expert and its gate, and no dense MLP.
#[test]
fn the_schema_lists_the_moe_checkpoints_tensors() {
    use reference::schema::{FusedExpert, Schema};
    let config = reference::Config::from_file(&model_dir().join("config.json")).unwrap();
    let ours: std::collections::BTreeSet<String> = Schema::new(&config)
        .tensors()
        .iter()
        .map(|t| t.full_name("model."))
        .collect();
    let stored: std::collections::BTreeSet<String> = checkpoint().keys().cloned().collect();
    assert_eq!(ours, stored);
    let f = FusedExpert::of("layers.3.mlp.experts.7.up_proj.weight").unwrap();
    assert_eq!(
        (f.name.as_str(), f.expert, f.half),
        ("layers.3.mlp.experts.gate_up_proj", 7, 1)
    );
    assert_eq!(f.first_row(&[8, 32, 32]), 7 * 32 + 16);
    let d = FusedExpert::of("layers.0.mlp.experts.2.down_proj.weight").unwrap();
    assert_eq!(d.first_row(&[8, 32, 16]), 2 * 32);
    assert_eq!(
        FusedExpert::of("layers.0.mlp.shared_expert.down_proj.weight"),
        None
    );
    println!("{} tensors, as stored", ours.len());
}

#[test]
fn f32_run_matches_transformers_and_routes_the_same() {
    check("tiny-moe", DType::F32);
}

#[test]
fn f64_run_matches_transformers_float64_and_routes_the_same() {
    check("tiny-moe", DType::F64);
}

#[test]
fn the_model_of_the_llama_cpp_fixtures_matches_transformers_and_routes_the_same() {
    let config = reference::Config::from_file(
        &testdata()
            .join("models")
            .join(GGUF_MODEL)
            .join("config.json"),
    )
    .unwrap();
    // What llama.cpp needs of it: equal linear key and value head dims, experts whose rows are 32-value blocks.
    assert_eq!(config.linear_key_head_dim, config.linear_value_head_dim);
    let moe = config.moe.as_ref().unwrap();
    assert_eq!(
        (
            moe.moe_intermediate_size % 32,
            moe.shared_expert_intermediate_size % 32
        ),
        (0, 0)
    );
    check(GGUF_MODEL, DType::F32);
}

/// The checkpoint's tensors, by name.
fn checkpoint() -> BTreeMap<String, Tensor> {
    let path = model_dir().join("model.safetensors");
    candle_core::safetensors::load(&path, &candle_core::Device::Cpu)
        .unwrap()
        .into_iter()
        .collect()
}

/// A copy of tiny-moe in `dir` with these tensors (and its config edited by `edit`).
fn write_copy(
    dir: &Path,
    tensors: &BTreeMap<String, Tensor>,
    edit: impl FnOnce(&mut serde_json::Value),
) {
    let src = model_dir();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    reference::io::save_safetensors(&dir.join("model.safetensors"), tensors, &BTreeMap::new())
        .unwrap();
}

/// The experts fused as transformers 5 holds them: `gate_up_proj` `[E, 2·Im, H]` (gate rows, then up rows) and
/// `down_proj` `[E, H, Im]`.
fn fused(
    tensors: &BTreeMap<String, Tensor>,
    layers: usize,
    experts: usize,
) -> BTreeMap<String, Tensor> {
    let mut out = tensors.clone();
    for i in 0..layers {
        let p = format!("model.layers.{i}.mlp.experts");
        let take = |out: &mut BTreeMap<String, Tensor>, e: usize, proj: &str| {
            out.remove(&format!("{p}.{e}.{proj}.weight")).unwrap()
        };
        let mut gate_up = Vec::new();
        let mut down = Vec::new();
        for e in 0..experts {
            let g = take(&mut out, e, "gate_proj");
            let u = take(&mut out, e, "up_proj");
            gate_up.push(Tensor::cat(&[g, u], 0).unwrap());
            down.push(take(&mut out, e, "down_proj"));
        }
        out.insert(
            format!("{p}.gate_up_proj"),
            Tensor::stack(&gate_up, 0).unwrap(),
        );
        out.insert(format!("{p}.down_proj"), Tensor::stack(&down, 0).unwrap());
    }
    out
}

fn last_logits(dir: &Path, dtype: DType, ids: &[u32]) -> Vec<f64> {
    let model = Model::load(dir, dtype).unwrap();
    let (run, _) = run_prompt(&model, ids, &RunOptions::default());
    run["logits"]
        .to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn fused_experts_are_read_as_the_experts_one_by_one() {
    let golden = load_golden(&testdata().join("goldens/tiny-moe.safetensors"));
    let ids = ids_of(&golden.tensors["token_ids"]);
    let config = reference::Config::from_file(&model_dir().join("config.json")).unwrap();
    let moe = config.moe.clone().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let f = fused(&checkpoint(), config.num_layers(), moe.num_experts);
    assert!(!f.keys().any(|k| k.contains(".experts.0.")));
    write_copy(tmp.path(), &f, |_| {});
    for dtype in [DType::F32, DType::F64] {
        let a = last_logits(&model_dir(), dtype, &ids);
        let b = last_logits(tmp.path(), dtype, &ids);
        assert!(a == b, "{dtype:?}: the fused checkpoint's logits differ");
    }
    // A fused tensor of more experts than the config has is named, not partly read.
    let mut wrong = f.clone();
    let key = "model.layers.2.mlp.experts.down_proj";
    let extra = Tensor::cat(&[&wrong[key], &wrong[key].narrow(0, 0, 1).unwrap()], 0).unwrap();
    wrong.insert(key.into(), extra);
    let bad = tempfile::tempdir().unwrap();
    write_copy(bad.path(), &wrong, |_| {});
    let e = Model::load(bad.path(), DType::F32).unwrap_err().to_string();
    assert!(e.contains(key) && e.contains("model.safetensors"), "{e}");
    println!("fused experts: logits identical at f32 and f64; a fused tensor of 9 experts: {e}");
}

#[test]
fn a_missing_expert_and_bad_moe_config_fields_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let mut t = checkpoint();
    let key = "model.layers.1.mlp.experts.5.up_proj.weight";
    t.remove(key).unwrap();
    write_copy(tmp.path(), &t, |_| {});
    let e = Model::load(tmp.path(), DType::F32).unwrap_err().to_string();
    assert!(e.contains(key) && e.contains("missing"), "{e}");

    let all = checkpoint();
    for (field, value, needle) in [
        (
            "num_experts_per_tok",
            serde_json::json!(9),
            "num_experts_per_tok",
        ),
        ("num_experts", serde_json::Value::Null, "num_experts"),
        (
            "moe_intermediate_size",
            serde_json::json!(0),
            "moe_intermediate_size",
        ),
        ("num_experts", serde_json::json!(7), "mlp.gate.weight"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        write_copy(dir.path(), &all, |c| {
            if value.is_null() {
                c.as_object_mut().unwrap().remove(field);
            } else {
                c[field] = value.clone();
            }
        });
        let e = Model::load(dir.path(), DType::F32).unwrap_err().to_string();
        assert!(e.contains(needle), "{field} = {value}: {e}");
        println!("{field} = {value}: {e}");
    }
}

/// The MoE block on INT4 and INT8 weights: the experts stay packed in an f32 run and give the values of the same
/// weights dequantised in an f64 run (the packed kernels are checked bit for bit elsewhere; here the routing and
/// the sum over experts on top of them).
#[test]
fn packed_experts_run_as_their_dequantised_weights() {
    use reference::quant::WeightFormat;
    use reference::weights::WeightStore;
    let golden = load_golden(&testdata().join("goldens/tiny-moe.safetensors"));
    let ids = ids_of(&golden.tensors["token_ids"]);
    let config = reference::Config::from_file(&model_dir().join("config.json")).unwrap();
    // Groups of 16: every matrix INT4; of 32: the experts' down projections (16 columns) and the shared one's (24) INT8.
    for format in [
        WeightFormat::Int4Sym { group: 16 },
        WeightFormat::Int4Sym { group: 32 },
    ] {
        let run = |dtype| {
            let w = WeightStore::open_with_format(&model_dir(), dtype, format).unwrap();
            let model = Model::from_weights(config.clone(), &w).unwrap();
            run_prompt(&model, &ids, &RunOptions::default()).0
        };
        let (a, b) = (run(DType::F32), run(DType::F64));
        let d = reference::compare::diff(&a["logits"], &b["logits"]).unwrap();
        assert!(
            d.within(LOGITS_ATOL, 0.0),
            "{format}: f32 packed vs f64: {d}"
        );
        for i in 0..config.num_layers() {
            let name = format!("layers.{i}.mlp.experts_chosen");
            assert_eq!(chosen(&a[&name]), chosen(&b[&name]), "{format} {name}");
        }
        println!(
            "{format}: packed f32 run within {:.2e} of the f64 run, same experts",
            d.max_abs
        );
    }
}

/// The pages policy hands back other pages and changes no value: tiny-moe with its experts fused, the whole prompt
/// in one call and in calls of 5 tokens, then 16 greedy tokens, gives every tap bit for bit under both policies;
/// the always-read weights are the mixers, routers, shared experts and the LM head, not the routed experts nor the
/// untied embedding.
#[test]
fn the_pages_policy_changes_no_value() {
    use reference::pages::Pages;
    let golden = load_golden(&testdata().join("goldens/tiny-moe.safetensors"));
    let ids = ids_of(&golden.tensors["token_ids"]);
    let config = reference::Config::from_file(&model_dir().join("config.json")).unwrap();
    let moe = config.moe.clone().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write_copy(
        tmp.path(),
        &fused(&checkpoint(), config.num_layers(), moe.num_experts),
        |_| {},
    );
    let mut model = Model::load(tmp.path(), DType::F32).unwrap();
    // f32 weights, hidden 32: per linear-attention layer (96 + 32 + 4 + 4 + 32) · 32, the attention layer
    // (128 + 32 + 32 + 64) · 32, per layer the router 8 · 32, the shared expert 3 · 24 · 32 and its gate 32, then
    // the LM head 512 · 32.
    let params = 3 * (96 + 32 + 4 + 4 + 32) * 32
        + (128 + 32 + 32 + 64) * 32
        + 4 * (8 * 32 + 3 * 24 * 32 + 32)
        + 512 * 32;
    assert_eq!(model.always_read_bytes(), 4 * params as u64);
    for opts in [
        RunOptions::default(),
        RunOptions {
            prefill_block: Some(5),
            ..RunOptions::default()
        },
    ] {
        let mut runs = Vec::new();
        for pages in [Pages::Release, Pages::KeepAlwaysRead] {
            model.set_pages(pages);
            runs.push(run_prompt(&model, &ids, &opts));
        }
        let [(a, ga), (b, gb)] = <[_; 2]>::try_from(runs).ok().unwrap();
        assert_eq!(ga, gb, "block {:?}: greedy tokens", opts.prefill_block);
        assert_eq!(a.len(), b.len());
        for (name, x) in &a {
            let bits = |t: &Tensor| -> Vec<u64> {
                t.to_dtype(DType::F64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            assert!(
                bits(x) == bits(&b[name]),
                "block {:?}: {name} differs between the policies",
                opts.prefill_block
            );
        }
        println!(
            "block {:?}: {} tensors and {} greedy tokens identical under release and keep-always-read",
            opts.prefill_block,
            a.len(),
            ga.len()
        );
    }
}
