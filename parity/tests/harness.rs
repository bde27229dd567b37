//! The parity harness on the CPU device: compare-devices, probe and diff agree with the reference at f32 and exit 0,
//! fail (exit 1) when a threshold is set tighter than the measured error, write every report, and name exactly the
//! layer, state or op a fault was injected into.

use candle_core::{DType, Tensor};
use npu::devices::CompileOptions;
use npu::engine::HostLayerState;
use npu::graphs::{Builder, GraphOptions};
use parity::probe::{
    LayerDevice, Mode, OpenVinoLayers, ProbeThresholds, ReferenceTrace, drill_down, probe,
};
use reference::backend::{ReferenceBackend, RunRecord};
use reference::config::Config;
use reference::model::{Model, RunOptions};
use reference::schema::{Param, Schema};
use reference::weights::WeightStore;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

mod common;
use common::{expect_error, qwen35, stderr, testdata};

fn tiny() -> PathBuf {
    testdata().join("models/tiny")
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Every key the JSON documentation of `report::compare` promises.
fn assert_compare_keys(v: &serde_json::Value) {
    for k in [
        "schema_version",
        "tool",
        "passed",
        "machine",
        "inputs",
        "quantization",
        "devices",
    ] {
        assert!(v.get(k).is_some(), "no `{k}` in {v}");
    }
    assert_eq!(v["schema_version"], 1);
    let d = &v["devices"][0];
    for k in [
        "device",
        "record",
        "thresholds",
        "passed",
        "failures",
        "greedy_matched",
        "greedy_total",
        "all",
        "prompt_positions",
        "generated_positions",
        "near_ties",
        "confident",
        "logits",
        "final_norm",
        "layers",
        "states",
        "tapped_vs_deployed",
        "first_divergence",
        "prompt_tokens_per_s",
        "decode_tokens_per_s",
        "prompts",
    ] {
        assert!(d.get(k).is_some(), "no `devices[0].{k}`");
    }
    for k in [
        "positions",
        "same_top1",
        "top5_overlap",
        "kl_mean",
        "kl_p99",
        "kl_max",
        "delta_p_mean",
        "delta_p_rms",
        "near_tie_flips",
        "confident_flips",
        "eos_drift_max",
        "eos_drift_mean",
    ] {
        assert!(d["all"].get(k).is_some(), "no `all.{k}`");
    }
    for k in [
        "max_abs", "nmse", "nrmse", "rel_l2", "cosine", "nan", "inf", "count",
    ] {
        assert!(d["logits"].get(k).is_some(), "no `logits.{k}`");
    }
    for k in [
        "layer",
        "kind",
        "output",
        "mixer",
        "mlp",
        "nrmse_by_position",
    ] {
        assert!(d["layers"][0].get(k).is_some(), "no `layers[0].{k}`");
    }
    assert!(d["record"]["precision"].is_string());
}

#[test]
fn compare_devices_agrees_at_f32_and_writes_every_report() {
    let tmp = tempfile::tempdir().unwrap();
    let (j, md, svg) = (
        tmp.path().join("r.json"),
        tmp.path().join("r.md"),
        tmp.path().join("r.svg"),
    );
    let o = qwen35(&[
        "compare-devices",
        "--devices",
        "CPU",
        "--context",
        "160",
        "--json",
        j.to_str().unwrap(),
        "--report",
        md.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{out}\n{}", stderr(&o));
    assert!(out.contains("PASS"), "{out}");
    let v = json(&j);
    assert_compare_keys(&v);
    let d = &v["devices"][0];
    assert_eq!(v["passed"], true);
    assert_eq!(d["record"]["precision"], "f32");
    // The default prompt set: four prompts, 12 greedy tokens each, all identical at f32.
    assert_eq!(v["inputs"]["prompts"].as_array().unwrap().len(), 4);
    assert_eq!(d["greedy_matched"], 48);
    assert_eq!(d["greedy_total"], 48);
    assert_eq!(d["all"]["same_top1"], 1.0);
    assert!(d["logits"]["nmse"].as_f64().unwrap() < 1e-8);
    for l in d["layers"].as_array().unwrap() {
        assert!(l["output"]["nrmse"].as_f64().unwrap() < 1e-5, "{l}");
    }
    // Hidden states come from graphs with taps; at f32 on the CPU they give the deployed graphs' logits.
    assert!(d["tapped_vs_deployed"].as_f64().unwrap() < 1e-3);
    let report = std::fs::read_to_string(&md).unwrap();
    for needle in [
        "# qwen35 compare-devices report",
        "INFERENCE_PRECISION_HINT",
        "| layer |",
        "KL(P_ref",
    ] {
        assert!(report.contains(needle), "the Markdown has no `{needle}`");
    }
    let chart = std::fs::read_to_string(&svg).unwrap();
    assert!(chart.starts_with("<svg") && chart.contains("<polyline") && chart.contains("layer"));
}

#[test]
fn thresholds_tighter_than_the_measured_error_exit_1() {
    let tmp = tempfile::tempdir().unwrap();
    let j = tmp.path().join("r.json");
    let o = qwen35(&[
        "compare-devices",
        "--devices",
        "CPU",
        "--context",
        "160",
        "--prompt",
        "Why does the river rise?",
        "--tokens",
        "4",
        "--max-nmse",
        "0",
        "--max-layer-nrmse",
        "1e-12",
        "--json",
        j.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let v = json(&j);
    assert_eq!(v["passed"], false);
    let failures: Vec<String> = v["devices"][0]["failures"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_string())
        .collect();
    assert!(
        failures.iter().any(|f| f.contains("--max-nmse")),
        "{failures:?}"
    );
    assert!(
        failures.iter().any(|f| f.contains("--max-layer-nrmse")),
        "{failures:?}"
    );
    // The layer line names layer 0 first: every layer is over a threshold of 1e-12.
    assert_eq!(v["devices"][0]["first_divergence"]["layer"][0], 0);

    let o = qwen35(&[
        "probe",
        "--device",
        "CPU",
        "--context",
        "160",
        "--token-ids",
        "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20",
        "--max-nrmse",
        "1e-12",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
}

#[test]
fn probe_agrees_at_f32_in_both_modes() {
    let tmp = tempfile::tempdir().unwrap();
    for mode in ["isolated", "chained"] {
        let (j, md, svg) = (
            tmp.path().join(format!("{mode}.json")),
            tmp.path().join(format!("{mode}.md")),
            tmp.path().join(format!("{mode}.svg")),
        );
        let o = qwen35(&[
            "probe",
            "--device",
            "CPU",
            "--mode",
            mode,
            "--context",
            "160",
            "--prompt",
            "Why does the river rise in spring?",
            "--json",
            j.to_str().unwrap(),
            "--report",
            md.to_str().unwrap(),
            "--plot",
            svg.to_str().unwrap(),
        ]);
        assert_eq!(o.status.code(), Some(0), "{mode}: {}", stderr(&o));
        let v = json(&j);
        for k in [
            "schema_version",
            "tool",
            "passed",
            "machine",
            "inputs",
            "record",
            "thresholds",
            "layers",
            "drill_down",
        ] {
            assert!(v.get(k).is_some(), "{mode}: no `{k}`");
        }
        assert_eq!(v["inputs"]["mode"], mode);
        let layers = v["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 4);
        for l in layers {
            for k in [
                "output",
                "mixer",
                "mlp",
                "states",
                "state_drift",
                "block_ends",
                "intermediates",
                "magnitudes",
                "over",
            ] {
                assert!(l.get(k).is_some(), "{mode}: no `layers[].{k}`");
            }
            assert_eq!(l["over"], false);
            assert!(l["output"]["nrmse"].as_f64().unwrap() < 1e-5, "{mode}: {l}");
            // 35 prompt tokens in blocks of 16: the state is compared after each of the three blocks.
            assert_eq!(l["state_drift"].as_array().unwrap().len(), 3);
        }
        assert!(v["drill_down"].is_null());
        assert!(std::fs::read_to_string(&md).unwrap().contains("## Layers"));
        assert!(std::fs::read_to_string(&svg).unwrap().contains("<polyline"));
    }
}

#[test]
fn diff_of_a_dump_with_itself_is_zero_and_a_device_dump_is_close() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, j) = (
        tmp.path().join("ref.safetensors"),
        tmp.path().join("ov.safetensors"),
        tmp.path().join("d.json"),
    );
    let ids = "5,17,33,2,99,140,7,7,301,12,45,6";
    for (out, extra) in [
        (&a, vec![]),
        (&b, vec!["--backend", "openvino", "--context", "64"]),
    ] {
        let mut args = vec![
            "dump",
            "--token-ids",
            ids,
            "--generate",
            "5",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend(extra);
        let o = qwen35(&args);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let o = qwen35(&[
        "diff",
        a.to_str().unwrap(),
        a.to_str().unwrap(),
        "--json",
        j.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = json(&j);
    let d = &v["devices"][0];
    let tensors = d["tensors"].as_array().unwrap();
    assert!(tensors.len() > 50, "{} tensors compared", tensors.len());
    for t in tensors {
        assert_eq!(t["error"]["max_abs"], 0.0, "{t}");
    }
    assert_eq!(d["logits"]["max_abs"], 0.0);
    assert_eq!(d["greedy_matched"], 5);

    let o = qwen35(&[
        "diff",
        b.to_str().unwrap(),
        a.to_str().unwrap(),
        "--json",
        j.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = json(&j);
    assert_eq!(v["devices"][0]["record"]["backend"], "openvino");
    assert!(v["devices"][0]["logits"]["nmse"].as_f64().unwrap() < 1e-8);
    // Dumps of different prompts are not comparable.
    let c = tmp.path().join("other.safetensors");
    let o = qwen35(&["dump", "--token-ids", "1,2,3", "--out", c.to_str().unwrap()]);
    assert!(o.status.success());
    expect_error(
        &["diff", c.to_str().unwrap(), a.to_str().unwrap()],
        &["different prompts"],
    );
}

#[test]
fn harness_errors_are_clear() {
    expect_error(
        &["compare-devices", "--devices", "NO_SUCH_DEVICE"],
        &["--devices", "NO_SUCH_DEVICE", "available"],
    );
    expect_error(&["compare-devices", "--tokens", "0"], &["--tokens"]);
    expect_error(&["compare-devices", "--max-kl=-1"], &["--max-kl"]);
    expect_error(
        &["compare-devices", "--min-token-agreement", "2"],
        &["--min-token-agreement"],
    );
    expect_error(
        &["compare-devices", "--context", "16"],
        &["static context", "--context"],
    );
    expect_error(
        &["compare-devices", "--token-ids", "1,2,900"],
        &["900", "vocabulary"],
    );
    expect_error(
        &[
            "compare-devices",
            "--json",
            "/no/such/dir/r.json",
            "--token-ids",
            "1",
        ],
        &["--json", "/no/such/dir"],
    );
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("p.jsonl");
    std::fs::write(&bad, "{\"prompt\": \"hi\"}\n{\"promt\": \"typo\"}\n").unwrap();
    expect_error(
        &["compare-devices", "--prompts", bad.to_str().unwrap()],
        &["p.jsonl:2", "promt"],
    );
    expect_error(
        &[
            "probe",
            "--device",
            "CPU",
            "--token-ids",
            "1,2",
            "--layers",
            "9",
        ],
        &["--layers", "9"],
    );
    expect_error(
        &["probe", "--device", "NO_SUCH_DEVICE", "--token-ids", "1,2"],
        &["NO_SUCH_DEVICE"],
    );
    expect_error(
        &[
            "probe",
            "--device",
            "CPU",
            "--token-ids",
            "1,2",
            "--mode",
            "sideways",
        ],
        &["--mode"],
    );
    expect_error(
        &["diff", "/no/such/a.safetensors", "/no/such/b.safetensors"],
        &["/no/such/a.safetensors"],
    );
}

// ---- fault injection: a device that is wrong in one known place ----

/// A copy of the tiny model whose tensor `spec` is replaced by `edit(tensor)`.
fn corrupted_copy(dir: &Path, param: Param, layer: usize, edit: impl Fn(&Tensor) -> Tensor) {
    let src = tiny();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let config = Config::from_file(&src.join("config.json")).unwrap();
    let name = Schema::new(&config).layer(layer, param).full_name("model.");
    let mut tensors: BTreeMap<String, Tensor> =
        candle_core::safetensors::load(src.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap()
            .into_iter()
            .collect();
    let t = tensors.get(&name).unwrap().clone();
    tensors.insert(name, edit(&t));
    reference::io::save_safetensors(&dir.join("model.safetensors"), &tensors, &BTreeMap::new())
        .unwrap();
}

/// The reference's trace of a 40-token prompt in blocks of 16.
fn reference_trace(config: &Config) -> ReferenceTrace {
    let store = WeightStore::open(&tiny(), DType::F32).unwrap();
    let model = Model::from_weights(config.clone(), &store).unwrap();
    let mut reference = ReferenceBackend::new(model, RunOptions::default(), true, "f32").unwrap();
    let ids: Vec<u32> = (0..40).map(|i| (i * 29 + 3) % 500).collect();
    ReferenceTrace::new(&mut reference, &ids, 16).unwrap()
}

/// The per-layer graphs of the checkpoint in `dir`, every layer compiled.
fn device_layers(dir: &Path, config: &Config) -> OpenVinoLayers {
    let store = WeightStore::open(dir, DType::F32).unwrap();
    let builder = Builder::new(
        config,
        &store,
        GraphOptions {
            context: 64,
            ..GraphOptions::default()
        },
    )
    .unwrap();
    let all: Vec<usize> = (0..config.num_layers()).collect();
    OpenVinoLayers::new(&builder, &all, 16, "CPU", &CompileOptions::default()).unwrap()
}

fn flagged(layers: &[parity::probe::LayerProbe]) -> Vec<usize> {
    layers.iter().filter(|l| l.over).map(|l| l.layer).collect()
}

const F32: ProbeThresholds = ProbeThresholds {
    max_nrmse: 1e-4,
    max_state_nrmse: 1e-4,
};

#[test]
fn a_scaled_weight_is_flagged_in_exactly_its_layer() {
    let config = Config::from_file(&tiny().join("config.json")).unwrap();
    let trace = reference_trace(&config);
    let tmp = tempfile::tempdir().unwrap();
    // Layer 1's DeltaNet output projection 3% too large.
    corrupted_copy(tmp.path(), Param::OutProj, 1, |t| (t * 1.03).unwrap());
    let mut device = device_layers(tmp.path(), &config);
    let all: Vec<usize> = (0..config.num_layers()).collect();
    let isolated = probe(&config, &trace, &mut device, &all, Mode::Isolated, F32).unwrap();
    assert_eq!(
        flagged(&isolated),
        vec![1],
        "isolated mode flags the corrupted layer and no other"
    );
    let d = drill_down(&isolated, F32.max_nrmse).unwrap();
    assert_eq!(d.layer, 1);
    // Everything before out_proj agrees; the error starts at the mixer output.
    assert_eq!(
        d.first_over.as_deref(),
        Some("mixer_output"),
        "{:?}",
        d.intermediates
    );
    let chained = probe(&config, &trace, &mut device, &all, Mode::Chained, F32).unwrap();
    let flagged_chained = flagged(&chained);
    assert_eq!(
        flagged_chained.first(),
        Some(&1),
        "chained: {flagged_chained:?}"
    );
    assert!(!flagged_chained.contains(&0));
}

#[test]
fn a_swapped_gate_is_flagged_at_the_attention_layer_and_its_query() {
    let config = Config::from_file(&tiny().join("config.json")).unwrap();
    let trace = reference_trace(&config);
    let tmp = tempfile::tempdir().unwrap();
    // q_proj rows per head are [query D | gate D]: swap the halves of every head.
    let (heads, d) = (config.num_attention_heads, config.head_dim);
    corrupted_copy(tmp.path(), Param::QProj, 3, |t| {
        let (rows, cols) = t.dims2().unwrap();
        let per_head = t.reshape((heads, 2, d, cols)).unwrap();
        let swapped = Tensor::cat(
            &[
                per_head.narrow(1, 1, 1).unwrap(),
                per_head.narrow(1, 0, 1).unwrap(),
            ],
            1,
        )
        .unwrap();
        swapped.reshape((rows, cols)).unwrap()
    });
    let mut device = device_layers(tmp.path(), &config);
    let all: Vec<usize> = (0..config.num_layers()).collect();
    let isolated = probe(&config, &trace, &mut device, &all, Mode::Isolated, F32).unwrap();
    assert_eq!(flagged(&isolated), vec![3]);
    let d = drill_down(&isolated, F32.max_nrmse).unwrap();
    assert_eq!(
        d.first_over.as_deref(),
        Some("self_attn.query"),
        "{:?}",
        d.intermediates
    );
}

/// A device whose state hand-off is corrupted: the recurrent state it returns is 1% too large.
struct LeakyState(OpenVinoLayers);

impl LayerDevice for LeakyState {
    fn run(
        &mut self,
        layer: usize,
        hidden: &Tensor,
        start: usize,
        state: &mut HostLayerState,
    ) -> anyhow::Result<BTreeMap<String, Tensor>> {
        let out = self.0.run(layer, hidden, start, state)?;
        if let HostLayerState::Linear { recurrent, .. } = state {
            *recurrent = (&*recurrent * 1.01)?;
        }
        Ok(out)
    }

    fn block(&self) -> usize {
        self.0.block()
    }

    fn context(&self) -> usize {
        self.0.context()
    }

    fn record(&self) -> RunRecord {
        self.0.record()
    }
}

#[test]
fn a_corrupted_state_hand_off_fails_the_state_rows() {
    let config = Config::from_file(&tiny().join("config.json")).unwrap();
    let trace = reference_trace(&config);
    let mut device = LeakyState(device_layers(&tiny(), &config));
    let all: Vec<usize> = (0..config.num_layers()).collect();
    let layers = probe(&config, &trace, &mut device, &all, Mode::Isolated, F32).unwrap();
    for l in &layers {
        let recurrent = l
            .states
            .iter()
            .find(|s| s.name.ends_with("recurrent_state"));
        if l.kind == "linear_attention" {
            assert!(l.over, "layer {}", l.layer);
            assert!(
                recurrent.unwrap().error.nrmse > F32.max_state_nrmse,
                "layer {}",
                l.layer
            );
            assert!(
                l.state_drift.iter().all(|&e| e > F32.max_state_nrmse),
                "layer {}: {:?}",
                l.layer,
                l.state_drift
            );
            // Isolated: each block starts from the reference's state, so the outputs of the first block are exact;
            // only the hand-off is wrong.
            assert!(l.output.nrmse < 1e-5, "layer {}", l.layer);
        } else {
            assert!(
                !l.over,
                "the attention layer {} has no recurrent state",
                l.layer
            );
        }
    }
}
