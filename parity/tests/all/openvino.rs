//! `qwen35` with the OpenVINO backend on the CPU device: dumps against the goldens and the reference, devices,
//! exported IR, and clear errors.

use parity::dump::Dump;

use crate::common;
use common::{
    F32, check_dump, config, dump, expect_error_env as expect_error, golden_ids,
    qwen35_env as qwen35, same_dump, stderr, testdata,
};

#[test]
fn devices_lists_the_cpu() {
    let o = qwen35(&["devices", "--json"], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        v["openvino"].as_str().unwrap().starts_with("2026.4.1"),
        "{v}"
    );
    let devices = v["devices"].as_array().unwrap();
    assert!(
        devices
            .iter()
            .any(|d| d["name"] == "CPU" && !d["full_name"].as_str().unwrap().is_empty()),
        "{v}"
    );
    let o = qwen35(&["devices"], &[]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("CPU:"));
}

#[test]
fn openvino_dumps_match_the_goldens() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, block) in [("tiny", "16"), ("tiny-tied", "64"), ("tiny-full", "1")] {
        let golden = Dump::read(&testdata().join(format!("goldens/{name}.safetensors"))).unwrap();
        let out = tmp.path().join(format!("{name}.safetensors"));
        let model = testdata().join("models").join(name);
        let ids = common::ids_arg(&golden.tensors["token_ids"]);
        let o = qwen35(
            &[
                "dump",
                "--backend",
                "openvino",
                "--device",
                "CPU",
                "--block",
                block,
                "--context",
                "256",
                "--model",
                model.to_str().unwrap(),
                "--token-ids",
                &ids,
                "--generate",
                "16",
                "--out",
                out.to_str().unwrap(),
            ],
            &[],
        );
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let d = Dump::read(&out).unwrap();
        assert_eq!(d.metadata["backend"], "openvino");
        assert_eq!(
            d.metadata["precision"], "f32",
            "{name}: a reference run must have computed in f32"
        );
        assert_eq!(d.metadata["property.DYNAMIC_QUANTIZATION_GROUP_SIZE"], "0");
        let label = format!("{name} block {block}");
        let worst = check_dump(&label, &d, &golden, &config(name), F32);
        println!(
            "{label}: OpenVINO CPU dump vs transformers, worst {:.2e} of its head's (or tensor's) max\n{}",
            worst.overall(),
            worst.report()
        );
    }
}

#[test]
fn quantized_device_dump_equals_the_reference_on_the_same_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = (0..40)
        .map(|i| ((i * 53) % 500).to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut dumps = vec![];
    for backend in ["reference", "openvino"] {
        let out = tmp.path().join(format!("{backend}.safetensors"));
        let o = qwen35(
            &[
                "dump",
                "--backend",
                backend,
                "--weights",
                "int4:32",
                "--token-ids",
                &ids,
                "--generate",
                "8",
                "--out",
                out.to_str().unwrap(),
            ],
            &[],
        );
        assert!(o.status.success(), "{backend}: {}", stderr(&o));
        dumps.push(Dump::read(&out).unwrap());
    }
    assert_eq!(dumps[0].metadata["weights"], "int4:32");
    assert_eq!(dumps[1].metadata["weights"], "int4:32");
    assert_eq!(dumps[0].tensors.len(), dumps[1].tensors.len());
    // Every tensor, greedy tokens exactly, taps and states per head.
    let worst = check_dump("int4:32", &dumps[1], &dumps[0], &config("tiny"), F32);
    println!(
        "int4:32 OpenVINO CPU dump vs the reference on the same weights: worst {:.2e} of its head's (or tensor's) \
         max\n{}",
        worst.overall(),
        worst.report()
    );
}

#[test]
fn export_ir_writes_a_graph_set_that_reads_back() {
    let tmp = tempfile::tempdir().unwrap();
    let export = |out: &std::path::Path| {
        let o = qwen35(
            &[
                "export-ir",
                "--out",
                out.to_str().unwrap(),
                "--parts",
                "decoder,layers",
                "--blocks",
                "16",
                "--weights",
                "int4:32",
                "--context",
                "64",
            ],
            &[],
        );
        assert!(o.status.success(), "{}", stderr(&o));
    };
    let out = tmp.path().join("ir");
    export(&out);
    let set = npu::graphset::manifest::open(&out).unwrap();
    assert_eq!(set.context, Some(64));
    assert_eq!(set.reference_weights.as_deref(), Some("int4:32"));
    assert_eq!(set.decoder_blocks(), vec![1, 16]);
    let layers = set.layer_blocks();
    assert_eq!(layers.len(), 4);
    assert!(layers.values().all(|b| b == &vec![1, 16]));
    // One weights file for every graph, and every graph's ports what the manifest says (checked when loading).
    let files: Vec<_> = set
        .decoder
        .iter()
        .chain(&set.layers)
        .flat_map(|p| &p.graphs)
        .collect();
    assert_eq!(files.len(), 2 + 8);
    assert!(files.iter().all(|g| g.bin == out.join("weights.bin")));
    let config =
        reference::config::Config::from_file(&common::testdata().join("models/tiny/config.json"))
            .unwrap();
    let opts = npu::devices::CompileOptions::default();
    npu::engine::DecoderEngine::open(&set, config.clone(), "CPU", &opts, None).unwrap();
    for g in set.layers.as_ref().unwrap().graphs.iter() {
        npu::engine::LayerRunner::open(&set, g, config.clone(), "CPU", &opts).unwrap();
    }
    // Deterministic: the same export twice gives the same bytes.
    let again = tmp.path().join("again");
    export(&again);
    for entry in std::fs::read_dir(&out).unwrap() {
        let name = entry.unwrap().file_name();
        if name == "manifest.json" {
            continue; // it names its own directory's way to the model
        }
        assert_eq!(
            std::fs::read(out.join(&name)).unwrap(),
            std::fs::read(again.join(&name)).unwrap(),
            "{name:?}"
        );
    }
}

#[test]
fn openvino_errors_are_clear() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x.safetensors");
    let out = out.to_str().unwrap();
    let ov = ["dump", "--backend", "openvino"];
    fn with<'a>(ov: &[&'a str], extra: &[&'a str], out: &'a str) -> Vec<&'a str> {
        let mut v: Vec<&str> = ov.to_vec();
        v.extend_from_slice(extra);
        v.extend_from_slice(&["--out", out]);
        v
    }
    // A device no machine has (whether an NPU is present or not).
    expect_error(
        &with(
            &ov,
            &["--device", "NO_SUCH_DEVICE", "--token-ids", "1,2"],
            out,
        ),
        &[],
        &["NO_SUCH_DEVICE", "not available", "CPU"],
    );
    expect_error(
        &with(&ov, &["--token-ids", "1,2"], out),
        &[("OPENVINO_LIB", "/no/such/libopenvino_c.so")],
        &["OPENVINO_LIB", "/no/such/libopenvino_c.so"],
    );
    expect_error(
        &with(
            &ov,
            &["--token-ids", "1,2", "--deltanet-form", "sequential"],
            out,
        ),
        &[],
        &["--deltanet-form", "matrix, chunked or loop"],
    );
    expect_error(
        &with(&ov, &["--token-ids", "1,2", "--dtype", "f64"], out),
        &[],
        &["--dtype"],
    );
    expect_error(
        &with(
            &ov,
            &["--token-ids", "1,2,3,4,5,6,7,8,9,10", "--context", "8"],
            out,
        ),
        &[],
        &["static context", "--context"],
    );
    expect_error(
        &with(&ov, &["--token-ids", "1,2", "--block", "0"], out),
        &[],
        &["--block"],
    );
    expect_error(
        &with(&ov, &["--token-ids", "1,2", "--weights", "int3"], out),
        &[],
        &["--weights", "int3"],
    );
    let cfg = tmp.path().join("cfg.json");
    let cfg_path = cfg.to_str().unwrap().to_string();
    let cfg_str = cfg_path.as_str();
    std::fs::write(&cfg, r#"{"NOT_A_PROPERTY": "1"}"#).unwrap();
    expect_error(
        &with(
            &ov,
            &["--token-ids", "1,2", "--device-config", cfg_str],
            out,
        ),
        &[],
        &["NOT_A_PROPERTY", "CPU"],
    );
    std::fs::write(&cfg, r#"["not", "an", "object"]"#).unwrap();
    expect_error(
        &with(
            &ov,
            &["--token-ids", "1,2", "--device-config", cfg_str],
            out,
        ),
        &[],
        &["cfg.json", "JSON object"],
    );
    expect_error(
        &with(&ov, &["--token-ids", "1,2"], out),
        &[("QWEN35_DEVICE_CONFIG", "{oops")],
        &["QWEN35_DEVICE_CONFIG", "JSON"],
    );
    expect_error(
        &[
            "dump",
            "--device",
            "CPU",
            "--token-ids",
            "1,2",
            "--out",
            out,
        ],
        &[],
        &["--device", "--backend openvino"],
    );
    expect_error(
        &["devices"],
        &[("OPENVINO_LIB", "/no/such/dir")],
        &["OPENVINO_LIB"],
    );
    expect_error(
        &with(&ov, &["--token-ids", "1,2", "--chunk", "8"], out),
        &[],
        &["--chunk", "--block"],
    );
    expect_error(
        &[
            "dump",
            "--deltanet-form",
            "loop",
            "--token-ids",
            "1,2",
            "--out",
            out,
        ],
        &[],
        &["loop", "sequential"],
    );
    // Options that would be ignored are refused; the output scale must keep the math exact.
    expect_error(
        &with(
            &ov,
            &["--token-ids", "1,2", "--decode-form", "sequential"],
            out,
        ),
        &[],
        &["--decode-form", "matrix"],
    );
    expect_error(
        &with(
            &ov,
            &[
                "--token-ids",
                "1,2",
                "--deltanet-form",
                "matrix",
                "--inverse",
                "series",
            ],
            out,
        ),
        &[],
        &["--inverse", "chunked"],
    );
    for scale in ["1000", "1e20", "0.5"] {
        expect_error(
            &with(&ov, &["--token-ids", "1,2", "--output-scale", scale], out),
            &[],
            &["--output-scale", "power of two"],
        );
        expect_error(
            &[
                "dump",
                "--token-ids",
                "1,2",
                "--output-scale",
                scale,
                "--out",
                out,
            ],
            &[],
            &["--output-scale", "power of two"],
        );
    }
}

/// The graphs stream their taps into the dump call by call (blocks of 4 tokens, then single tokens): the file equals
/// the dump collected in memory on the same graphs, tensor for tensor.
#[test]
fn a_streamed_openvino_dump_equals_the_one_collected_in_memory() {
    use parity::device::{DeviceSettings, own::engine};
    let tmp = tempfile::tempdir().unwrap();
    let dir = testdata().join("models/tiny");
    let store = reference::weights::WeightStore::open(&dir, candle_core::DType::F32).unwrap();
    let settings = DeviceSettings {
        device: "CPU".into(),
        block: 4,
        graph: npu::graphs::GraphOptions::default(),
        compile: npu::devices::CompileOptions::default(),
    };
    let mut backend = engine(&config("tiny"), &store, &settings, true).unwrap();
    let ids: Vec<u32> = (7..18).collect();
    let out = tmp.path().join("ov.safetensors");
    let w = parity::dump::write_dump(&mut backend, &ids, 5, Default::default(), &out).unwrap();
    assert!(w.streamed);
    let memory = parity::dump::run_dump(&mut backend, &ids, 5).unwrap();
    same_dump("OpenVINO CPU", &Dump::read(&out).unwrap(), &memory);
}

/// The Loop form (one OpenVINO `Loop` op per DeltaNet layer, as the optimum-intel export) computes what the reference
/// computes: the golden prompt in blocks of 16 (the last one padded), every tap and state, and 8 greedy tokens.
#[test]
fn loop_form_dump_matches_the_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = golden_ids("tiny");
    let reference = dump(tmp.path(), "reference.safetensors", &ids, 8, &[]);
    let looped = dump(
        tmp.path(),
        "loop.safetensors",
        &ids,
        8,
        &[
            "--backend",
            "openvino",
            "--deltanet-form",
            "loop",
            "--block",
            "16",
        ],
    );
    assert_eq!(looped.metadata["deltanet_prefill"], "loop");
    assert_eq!(looped.metadata["precision"], "f32");
    assert_eq!(looped.tensors.len(), reference.tensors.len());
    let worst = check_dump("loop", &looped, &reference, &config("tiny"), F32);
    println!(
        "Loop form vs the reference: 8 greedy tokens identical, worst {:.2e} of its head's (or tensor's) max\n{}",
        worst.overall(),
        worst.report()
    );
}

#[test]
fn the_model_cache_serves_the_second_run_and_reports_it() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("ov-cache");
    let run = |n: usize| {
        let json = tmp.path().join(format!("run{n}.json"));
        let md = tmp.path().join(format!("run{n}.md"));
        let o = qwen35(
            &[
                "compare-devices",
                "--devices",
                "CPU",
                "--token-ids",
                "1,2,3,4,5",
                "--tokens",
                "2",
                "--context",
                "32",
                "--cache-dir",
                cache.to_str().unwrap(),
                "--json",
                json.to_str().unwrap(),
                "--report",
                md.to_str().unwrap(),
            ],
            &[],
        );
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let record = v["devices"][0]["record"].clone();
        assert_eq!(record["cache_dir"], cache.to_str().unwrap());
        let flags: Vec<bool> = record["from_cache"]
            .as_object()
            .unwrap()
            .values()
            .map(|b| b.as_bool().unwrap())
            .collect();
        (flags, std::fs::read_to_string(&md).unwrap())
    };
    // Deployed and tapped graphs, prompt block and decode each: four graphs, all compiled on the first run. The
    // record holds the deployed pair.
    let (first, _) = run(1);
    assert_eq!(first, [false, false]);
    let (second, md) = run(2);
    assert_eq!(second, [true, true]);
    assert!(md.contains("2 of 2 graphs loaded from the cache"), "{md}");

    let o = qwen35(
        &[
            "compare-devices",
            "--devices",
            "FP16SIM",
            "--token-ids",
            "1,2",
            "--cache-dir",
            cache.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--cache-dir"), "{}", stderr(&o));
}

#[test]
fn runs_sharing_a_fresh_cache_directory_all_pass() {
    // All build and compile the same graphs at once into one cache: OpenVINO writes each `.blob` read-only and
    // without a lock ("cannot set permissions … .blob"), and a second writer of an IR cache entry removed the one
    // the first had just put in place ("Directory not empty"). Four runs: without the lock, two of five rounds failed.
    let tmp = tempfile::tempdir().unwrap();
    for round in 0..3 {
        let cache = tmp.path().join(format!("cache{round}"));
        let children: Vec<_> = (0..4)
            .map(|n| {
                let json = tmp.path().join(format!("r{round}-{n}.json"));
                std::process::Command::new(env!("CARGO_BIN_EXE_qwen35"))
                    .args([
                        "compare-devices",
                        "--devices",
                        "CPU",
                        "--token-ids",
                        "1,2,3,4,5",
                        "--tokens",
                        "2",
                        "--context",
                        "32",
                        "--cache-dir",
                        cache.to_str().unwrap(),
                        "--json",
                        json.to_str().unwrap(),
                    ])
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for child in children {
            let o = child.wait_with_output().unwrap();
            assert_eq!(o.status.code(), Some(0), "round {round}: {}", stderr(&o));
        }
    }
}
