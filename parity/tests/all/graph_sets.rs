//! Graph sets made elsewhere (`testdata/sets/`, written by `scripts/make_graph_sets.py`) through the command line, on
//! the CPU device: compare-devices and validate on each set pass with its states compared; each graph broken on
//! purpose fails, the report naming that layer and that state; `export-ir`'s output validated as a set made
//! elsewhere gives the verdicts and figures of validate on the project's own graphs.

use serde_json::Value;
use std::path::{Path, PathBuf};

use crate::common;
use common::{qwen35, stderr, testdata};

fn set(name: &str) -> PathBuf {
    testdata().join("sets").join(name)
}

/// Two prompts, 4 tokens each, lengths up to 64.
fn small(dir: &Path) -> Vec<String> {
    let prompts = common::two_prompts(dir);
    [
        "--device",
        "CPU",
        "--tokens",
        "4",
        "--max-length",
        "64",
        "--lookup-tokens",
        "12",
        "--prompts",
        prompts.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec()
}

/// Runs `qwen35 command args --json dir/name.json`: the exit code and the report.
fn run(dir: &Path, name: &str, command: &str, args: &[String]) -> (Option<i32>, Value) {
    let j = dir.join(format!("{name}.json"));
    let mut all = vec![command];
    all.extend(args.iter().map(String::as_str));
    all.extend(["--json", j.to_str().unwrap()]);
    let o = qwen35(&all);
    let err = stderr(&o);
    assert!(j.exists(), "{all:?} wrote no report:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
    let v = serde_json::from_str(&std::fs::read_to_string(&j).unwrap()).unwrap();
    (o.status.code(), v)
}

fn check<'a>(v: &'a Value, id: &str) -> &'a Value {
    v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id)
        .unwrap_or_else(|| panic!("no check `{id}`"))
}

fn with_ir(ir: &Path, args: &[String]) -> Vec<String> {
    let mut all = vec!["--ir".to_string(), ir.display().to_string()];
    all.extend(args.iter().cloned());
    all
}

#[test]
fn every_set_agrees_with_the_reference_state_by_state() {
    let tmp = tempfile::tempdir().unwrap();
    let small = small(tmp.path());
    // (set, what it exposes: hidden outputs, per-layer graphs; the checks it cannot have)
    let cases: [(&str, bool, &[&str]); 6] = [
        ("tiny-decoder", true, &[]),
        ("tiny-layers", true, &[]),
        // Dynamic graphs with no static context: nothing is padded, nothing is over-long.
        ("tiny-stateless", false, &["padding", "over-long"]),
        ("tiny-renamed", false, &["padding", "over-long"]),
        // Embeddings looked up on the host from the checkpoint, in place of token ids.
        ("tiny-embeds", false, &["padding", "over-long"]),
        // The last token's logits only: every prompt position's are had one token per call.
        ("tiny-last-logits", false, &["padding", "over-long"]),
    ];
    for (name, hidden, skipped) in cases {
        // compare-devices takes the run's options, not validate's (--max-length, --lookup-tokens).
        let args: Vec<String> = with_ir(&set(name), &small[..4])
            .into_iter()
            .chain(small[8..].iter().cloned())
            .collect();
        let (code, v) = run(tmp.path(), &format!("{name}-cmp"), "compare-devices", &args);
        assert_eq!(code, Some(0), "{name}: {}", v["devices"][0]["failures"]);
        let d = &v["devices"][0];
        assert_eq!(d["greedy_matched"], d["greedy_total"], "{name}");
        let nmse = d["logits"]["nmse"].as_f64().unwrap();
        println!("{name}: logits NMSE {nmse:.2e}");
        // Measured 1.1e-12 (this project's sets) and 1.6e-12 (optimum's export and the sets made from it).
        assert!(nmse < 1e-11, "{name}: logits NMSE {nmse:.2e}");
        // Every layer's states, the KV cache over its valid rows: 3 DeltaNet layers × 2 + 1 attention layer × 2.
        let states = d["states"].as_array().unwrap();
        assert_eq!(states.len(), 8, "{name}: {states:?}");
        for s in states {
            println!(
                "{name}: {} NRMSE {:.2e}",
                s["name"],
                s["error"]["nrmse"].as_f64().unwrap()
            );
            // Measured at most 1.6e-7 (the attention layer's value cache).
            assert!(s["error"]["nrmse"].as_f64().unwrap() < 1e-6, "{name}: {s}");
        }
        assert_eq!(
            d["layers"].as_array().unwrap().is_empty(),
            !hidden,
            "{name}"
        );

        let (code, v) = run(
            tmp.path(),
            &format!("{name}-val"),
            "validate",
            &with_ir(&set(name), &small),
        );
        assert_eq!(code, Some(0), "{name}: {v}");
        for c in v["checks"].as_array().unwrap() {
            let id = c["id"].as_str().unwrap();
            // The tiny model has no vision tower: the images check is skipped on every set.
            if skipped.contains(&id) || id == "images" {
                assert!(c["passed"].is_null(), "{name}: {c}");
            } else {
                assert_eq!(c["passed"], true, "{name}: {c}");
            }
        }
        assert_eq!(v["inputs"]["capabilities"]["states"], true, "{name}");
        // The probe ran, through per-layer graphs or the decoder's states, and compared every layer's states.
        let probe = &v["probe"]["layers"];
        assert_eq!(probe.as_array().unwrap().len(), 4, "{name}");
        for l in probe.as_array().unwrap() {
            assert_eq!(l["states"].as_array().unwrap().len(), 2, "{name}: {l}");
            assert!(
                !l["state_heads"].as_array().unwrap().is_empty(),
                "{name}: {l}"
            );
            assert_eq!(l["output"].is_null(), !hidden, "{name}: {l}");
        }
        let via = v["probe"]["inputs"]["via"].as_str().unwrap();
        let expected = if name == "tiny-layers" {
            "per-layer graphs"
        } else {
            "the decoder's states"
        };
        assert!(via.starts_with(expected), "{name}: {via}");
        // Prefix reuse and prompt lookup snapshot and restore the explicit states on the host.
        assert_eq!(
            check(&v, "prefix-reuse")["details"]["restored"],
            true,
            "{name}"
        );
        assert!(
            check(&v, "back-to-back")["details"]["state"]["max_abs"] == 0.0,
            "{name}"
        );
    }
}

#[test]
fn each_broken_graph_fails_naming_its_layer_and_state() {
    let tmp = tempfile::tempdir().unwrap();
    let small = small(tmp.path());
    for (name, layer, state) in [
        ("broken-conv-shift", 1, "conv_state"),
        ("broken-kv-late", 3, "key_cache"),
        ("broken-ssm-scaled", 2, "recurrent_state"),
    ] {
        let (code, v) = run(tmp.path(), name, "validate", &with_ir(&set(name), &small));
        assert_eq!(code, Some(1), "{name}");
        let full = format!("layers.{layer}.{state}");
        // compare-devices holds the state over its threshold.
        let compare = check(&v, "compare");
        assert_eq!(compare["passed"], false, "{name}");
        assert!(
            compare["failures"]
                .as_array()
                .unwrap()
                .iter()
                .any(|f| f.as_str().unwrap().starts_with(&full)),
            "{name}: {compare}"
        );
        // The probe flags that layer first and names the state where the error starts.
        let probe = check(&v, "probe");
        assert_eq!(probe["passed"], false, "{name}");
        let failures: Vec<&str> = probe["failures"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_str().unwrap())
            .collect();
        assert!(
            failures[0].starts_with(&format!("layer {layer} ")) && failures[0].contains(&full),
            "{name}: {failures:?}"
        );
        assert!(
            failures
                .iter()
                .any(|f| *f == format!("the error starts at layer {layer}'s {state}")),
            "{name}: {failures:?}"
        );
        let drill = &v["probe"]["drill_down"];
        assert_eq!(drill["layer"], layer, "{name}");
        assert_eq!(drill["first_over"], state, "{name}");
    }
}

#[test]
fn export_ir_round_trip_gives_the_same_verdicts_and_figures() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("exported");
    let o = qwen35(&[
        "export-ir",
        "--out",
        out.to_str().unwrap(),
        "--parts",
        "decoder,layers",
        "--blocks",
        "16",
        "--context",
        "128",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut args = small(tmp.path());
    args.extend(["--blocks".into(), "1,16".into()]);
    let mut own_args = args.clone();
    own_args.extend(["--context".into(), "128".into()]);
    let (code, own) = run(tmp.path(), "own", "validate", &own_args);
    assert_eq!(code, Some(0), "{own}");
    let (code, exported) = run(tmp.path(), "exported", "validate", &with_ir(&out, &args));
    assert_eq!(code, Some(0), "{exported}");
    for c in own["checks"].as_array().unwrap() {
        let id = c["id"].as_str().unwrap();
        let e = check(&exported, id);
        assert_eq!(c["passed"], e["passed"], "{id}");
        // What ran where is counted over other graphs (the set compiles no separate tapped graphs), and prompt
        // lookup's speed-up is a timing; every other figure is the same.
        if !["execution-devices", "precision", "prompt-lookup"].contains(&id) {
            assert_eq!(c["figure"], e["figure"], "{id}");
        }
    }
    let cmp = |v: &Value| {
        v["compare"]["devices"][0]["logits"]["nmse"]
            .as_f64()
            .unwrap()
    };
    assert_eq!(cmp(&own), cmp(&exported));
}

#[test]
fn diff_compares_what_a_partial_dump_holds_and_names_a_planted_divergence() {
    let tmp = tempfile::tempdir().unwrap();
    let full = tmp.path().join("full.safetensors");
    let o = qwen35(&[
        "dump",
        "--token-ids",
        "5,17,100,3,250,42,7,9",
        "--generate",
        "4",
        "--out",
        full.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let dump = parity::dump::Dump::read(&full).unwrap();
    // What a porter's script naturally writes: no mixer taps, no states, no metadata.
    let keep = |k: &str| {
        [
            "token_ids",
            "embeddings",
            "final_norm",
            "logits",
            "generated",
        ]
        .contains(&k)
            || (k.starts_with("layers.") && k.ends_with(".output"))
    };
    let partial =
        |edit: &dyn Fn(&str, candle_core::Tensor) -> candle_core::Tensor| parity::dump::Dump {
            tensors: dump
                .tensors
                .iter()
                .filter(|(k, _)| keep(k))
                .map(|(k, v)| (k.clone(), edit(k, v.clone())))
                .collect(),
            metadata: Default::default(),
        };
    let theirs = tmp.path().join("theirs.safetensors");
    partial(&|_, t| t).write(&theirs).unwrap();
    let (code, v) = run(
        tmp.path(),
        "partial",
        "diff",
        &[theirs.display().to_string(), full.display().to_string()],
    );
    assert_eq!(code, Some(0), "{v}");
    let d = &v["devices"][0];
    assert_eq!(d["layers"].as_array().unwrap().len(), 4);
    assert!(d["layers"][0]["mixer"].is_null());
    assert_eq!(
        d["layers"][0]["kind"], "linear_attention",
        "kinds from the reference dump"
    );
    assert!(
        d["only_in_reference"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n == "layers.0.recurrent_state")
    );
    assert!(d.get("only_in_actual").is_none(), "absent when empty");

    // Neither side telling the kinds: --model does.
    let bare = tmp.path().join("bare.safetensors");
    parity::dump::Dump {
        tensors: dump
            .tensors
            .iter()
            .filter(|(k, _)| keep(k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        metadata: Default::default(),
    }
    .write(&bare)
    .unwrap();
    let model = testdata().join("models/tiny");
    let (code, v) = run(
        tmp.path(),
        "bare",
        "diff",
        &[
            theirs.display().to_string(),
            bare.display().to_string(),
            "--model".into(),
            model.display().to_string(),
        ],
    );
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(v["devices"][0]["layers"][3]["kind"], "full_attention");

    // A divergence planted in layer 2 (and the layers after it, as a real one would run on) exits 1 naming layer 2.
    let planted = tmp.path().join("planted.safetensors");
    partial(&|k, t| {
        let late = ["layers.2.output", "layers.3.output"].contains(&k);
        if late { (t * 1.01).unwrap() } else { t }
    })
    .write(&planted)
    .unwrap();
    let (code, v) = run(
        tmp.path(),
        "planted",
        "diff",
        &[planted.display().to_string(), full.display().to_string()],
    );
    assert_eq!(code, Some(1), "{v}");
    let failures = v["devices"][0]["failures"].as_array().unwrap();
    assert!(
        failures[0]
            .as_str()
            .unwrap()
            .starts_with("layer 2 output NRMSE"),
        "{failures:?}"
    );
    assert_eq!(v["devices"][0]["first_divergence"]["layer"][0], 2);
}

#[test]
fn a_short_weights_file_is_named_not_its_graph() {
    // Every set whose weights sit in its folder, its `.bin` emptied or cut at several points: the error names the
    // `.bin` and how short it is, before OpenVINO reads it (which would blame the `.xml` in its own words).
    let mut cases = 0;
    for name in ["tiny-decoder", "tiny-layers", "tiny-stateless"] {
        let bins: Vec<String> = std::fs::read_dir(set(name))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".bin"))
            .collect();
        assert!(!bins.is_empty(), "{name}");
        for bin in bins {
            let len = std::fs::metadata(set(name).join(&bin)).unwrap().len();
            for keep in [0, 1, len / 3, len / 2] {
                let tmp = tempfile::tempdir().unwrap();
                let dir = tmp.path().join(name);
                common::copy_dir(&set(name), &dir);
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(dir.join(&bin))
                    .unwrap();
                f.set_len(keep).unwrap();
                let model = testdata().join("models/tiny");
                let o = qwen35(&[
                    "compare-devices",
                    "--model",
                    model.to_str().unwrap(),
                    "--ir",
                    dir.to_str().unwrap(),
                ]);
                let err = stderr(&o);
                assert_eq!(
                    o.status.code(),
                    Some(2),
                    "{name}/{bin} cut to {keep}: {err}"
                );
                let says = if keep == 0 { "empty" } else { "truncated" };
                assert!(
                    err.contains(&bin)
                        && err.contains(&format!("{keep} bytes"))
                        && err.contains(says),
                    "{name}/{bin} cut to {keep}: {err}"
                );
                cases += 1;
            }
        }
    }
    assert!(cases >= 12);
}
