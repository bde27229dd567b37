//! The `qwen35` binary end to end: dumps against the transformers goldens, and clear errors on bad input.

use candle_core::{DType, Tensor};
use parity::dump::Dump;
use reference::synthetic::{random_weights, small_config_json, write_safetensors};
use std::collections::BTreeMap;
use std::path::Path;

use crate::common;
use common::{F32, Tolerance, check_dump, config, expect_error, ids_arg, qwen35, stderr, testdata};

fn golden(name: &str) -> Dump {
    Dump::read(&testdata().join(format!("goldens/{name}.safetensors"))).unwrap()
}

#[test]
fn dump_matches_transformers_goldens() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, extra) in [
        ("tiny", vec![]),
        (
            "tiny-tied",
            vec![
                "--deltanet-form",
                "chunked",
                "--chunk",
                "16",
                "--inverse",
                "doubling",
                "--output-scale",
                "1024",
            ],
        ),
        (
            "tiny-full",
            vec!["--prefill-block", "10", "--decode-form", "sequential"],
        ),
    ] {
        let g = golden(name);
        let out = tmp.path().join(format!("{name}.safetensors"));
        let model = testdata().join("models").join(name);
        let ids = ids_arg(&g.tensors["token_ids"]);
        let mut args = vec![
            "dump",
            "--model",
            model.to_str().unwrap(),
            "--token-ids",
            &ids,
            "--generate",
            "16",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend(extra);
        let o = qwen35(&args);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let d = Dump::read(&out).unwrap();
        let worst = check_dump(name, &d, &g, &config(name), F32);
        println!(
            "{name}: dump vs transformers, worst {:.2e} of its head's (or tensor's) max\n{}",
            worst.overall(),
            worst.report()
        );
        assert_eq!(d.metadata["backend"], "reference");
        assert_eq!(d.metadata["dtype"], "f32");
    }
}

/// `dump --system --prompt` renders the chat template as transformers did for the golden, in f64.
#[test]
fn dump_prompt_with_the_chat_template_and_f64() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("d.safetensors");
    let g = golden("tiny");
    let messages: serde_json::Value = serde_json::from_str(&g.metadata["messages"]).unwrap();
    let (system, user) = (
        messages[0]["content"].as_str().unwrap(),
        messages[1]["content"].as_str().unwrap(),
    );
    let o = qwen35(&[
        "dump",
        "--system",
        system,
        "--prompt",
        user,
        "--think",
        "--generate",
        "3",
        "--dtype",
        "f64",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let d = Dump::read(&out).unwrap();
    assert_eq!(d.metadata["dtype"], "f64");
    assert_eq!(
        d.get("token_ids").unwrap().to_vec1::<i64>().unwrap(),
        g.tensors["token_ids"].to_vec1::<i64>().unwrap()
    );
    assert_eq!(d.get("logits").unwrap().dtype(), DType::F64);
    let expected: Vec<i64> = g.tensors["generated"].to_vec1::<i64>().unwrap()[..3].to_vec();
    assert_eq!(
        d.get("generated").unwrap().to_vec1::<i64>().unwrap(),
        expected
    );
    let t = d.get("token_ids").unwrap().dims()[0];
    assert_eq!(d.get("layers.3.key_cache").unwrap().dims(), &[2, t, 32]);
    assert_eq!(
        d.get("layers.0.recurrent_state").unwrap().dims(),
        &[4, 16, 24]
    );
    assert_eq!(d.get("layers.0.conv_state").unwrap().dims(), &[160, 4]);
    // And it is the float64 run transformers made (our f64 logits are within 2.3e-13 of transformers').
    let mut g64 = golden("tiny.f64");
    let expected: Vec<i64> = g64.tensors["generated"].to_vec1::<i64>().unwrap()[..3].to_vec();
    assert_eq!(
        d.get("generated").unwrap().to_vec1::<i64>().unwrap(),
        expected
    );
    g64.tensors.remove("generated");
    let f64_tolerance = Tolerance {
        logits_atol: 1e-12,
        rtol: 1e-12,
        epsilon: None,
    };
    let worst = check_dump("tiny f64", &d, &g64, &config("tiny"), f64_tolerance);
    println!(
        "tiny f64 dump vs transformers' float64 run: worst {:.2e} of max\n{}",
        worst.overall(),
        worst.report()
    );
}

/// `qwen35 run` prints the greedy continuation of the chat prompt (thinking off) as the library computes it, and
/// reports the prompt and generated token counts.
#[test]
fn run_generates_on_the_bundled_model() {
    use reference::model::{Model, RunOptions, argmax};
    use reference::taps::Taps;
    use reference::tokenizer::{ChatTokenizer, Message};
    let prompt = "Why does the river rise?";
    let max_tokens = 8;
    let o = qwen35(&[
        "run",
        "--prompt",
        prompt,
        "--max-tokens",
        &max_tokens.to_string(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));

    let dir = testdata().join("models/tiny");
    let model = Model::load(&dir, DType::F32).unwrap();
    let tok = ChatTokenizer::load(&dir).unwrap();
    let ids = tok
        .encode_chat(&[Message::new("user", prompt)], false)
        .unwrap();
    let mut stop = tok.stop_ids();
    stop.extend(model.config().eos_token_ids.iter().copied());
    let opts = RunOptions::default();
    let mut state = model.new_state().unwrap();
    let logits = model
        .prefill(&ids, &mut state, &opts, &mut Taps::off())
        .unwrap();
    // Greedy by hand (argmax, feed back, stop after a stop token), independent of the binary's loop.
    let (mut tokens, mut logits) = (vec![], logits);
    while tokens.len() < max_tokens {
        let next = argmax(&logits).unwrap();
        tokens.push(next);
        if stop.contains(&next) {
            break;
        }
        logits = model
            .forward(&[next], &mut state, &opts, &mut Taps::off())
            .unwrap();
    }
    assert!(!tokens.is_empty());
    let text = tok.decode(&tokens, true).unwrap();
    assert!(
        !text.trim().is_empty(),
        "the expected continuation {tokens:?} prints nothing: the test would not see a missing token"
    );
    let stdout = String::from_utf8(o.stdout.clone()).unwrap();
    assert_eq!(
        stdout,
        format!("{text}\n"),
        "greedy tokens {tokens:?} (prompt {} tokens)",
        ids.len()
    );
    let err = stderr(&o);
    let summary = format!("prompt {} tokens in", ids.len());
    assert!(err.contains(&summary), "expected `{summary}` in:\n{err}");
    let summary = format!("generated {} tokens in", tokens.len());
    assert!(err.contains(&summary), "expected `{summary}` in:\n{err}");
    println!(
        "run: {} prompt tokens, {} generated ({tokens:?}{}): {text:?}",
        ids.len(),
        tokens.len(),
        if tokens.last().is_some_and(|t| stop.contains(t)) {
            ", ending on a stop token"
        } else {
            ""
        }
    );
}

/// A change to the tensors of a checkpoint.
type Edit = Box<dyn FnOnce(&mut BTreeMap<String, Tensor>)>;

/// A random checkpoint with one tensor changed by `edit`.
fn broken_checkpoint(dir: &Path, edit: impl FnOnce(&mut BTreeMap<String, Tensor>)) {
    let config = small_config_json();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let parsed = reference::Config::from_json_str(&config.to_string(), "config.json").unwrap();
    let mut tensors = random_weights(&parsed, "model.", 1).unwrap();
    edit(&mut tensors);
    write_safetensors(&dir.join("model.safetensors"), &tensors, DType::F32).unwrap();
}

#[test]
fn bad_input_gives_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.safetensors");
    let out = out.to_str().unwrap();

    expect_error(
        &["dump", "--token-ids", "1,2,600", "--out", out],
        &["--token-ids", "600", "vocabulary"],
    );
    expect_error(
        &["dump", "--token-ids", "1,x", "--out", out],
        &["--token-ids", "`x`"],
    );
    expect_error(
        &[
            "dump",
            "--model",
            "/no/such/dir",
            "--token-ids",
            "1",
            "--out",
            out,
        ],
        &["--model", "no such directory"],
    );
    expect_error(
        &["dump", "--token-ids", "1", "--chunk", "0", "--out", out],
        &["--chunk"],
    );
    expect_error(
        &[
            "dump",
            "--token-ids",
            "1",
            "--output-scale=-3",
            "--out",
            out,
        ],
        &["--output-scale"],
    );
    expect_error(
        &[
            "dump",
            "--token-ids",
            "1",
            "--inverse",
            "cholesky",
            "--out",
            out,
        ],
        &["--inverse"],
    );
    expect_error(&["dump", "--out", out], &["--token-ids", "--prompt"]);

    let cases: Vec<(&str, Edit, Vec<&str>)> = vec![
        (
            "missing",
            Box::new(|t| {
                t.remove("model.layers.1.self_attn.k_norm.weight");
            }),
            vec!["model.layers.1.self_attn.k_norm.weight", "missing"],
        ),
        (
            "misshaped",
            Box::new(|t| {
                t.insert(
                    "model.layers.0.linear_attn.A_log".into(),
                    Tensor::zeros(3, DType::F32, &candle_core::Device::Cpu).unwrap(),
                );
            }),
            vec!["model.layers.0.linear_attn.A_log", "shape"],
        ),
        (
            "no-lm-head",
            Box::new(|t| {
                t.remove("lm_head.weight");
            }),
            vec!["lm_head.weight"],
        ),
    ];
    for (label, edit, needles) in cases {
        let dir = tmp.path().join(label);
        std::fs::create_dir_all(&dir).unwrap();
        broken_checkpoint(&dir, edit);
        let mut needles = needles;
        needles.push("model.safetensors");
        expect_error(
            &[
                "dump",
                "--model",
                dir.to_str().unwrap(),
                "--token-ids",
                "1,2",
                "--out",
                out,
            ],
            &needles,
        );
    }

    // A tensor of a dtype the reference cannot read.
    let dir = tmp.path().join("int-weights");
    std::fs::create_dir_all(&dir).unwrap();
    broken_checkpoint(&dir, |_| {});
    let parsed =
        reference::Config::from_json_str(&small_config_json().to_string(), "config.json").unwrap();
    let mut tensors = random_weights(&parsed, "model.", 1).unwrap();
    tensors.insert(
        "model.norm.weight".into(),
        Tensor::zeros(32, DType::U32, &candle_core::Device::Cpu).unwrap(),
    );
    reference::io::save_safetensors(&dir.join("model.safetensors"), &tensors, &BTreeMap::new())
        .unwrap();
    expect_error(
        &[
            "dump",
            "--model",
            dir.to_str().unwrap(),
            "--token-ids",
            "1",
            "--out",
            out,
        ],
        &["model.norm.weight", "U32"],
    );

    // A config with a field missing, and one that is inconsistent.
    let dir = tmp.path().join("bad-config");
    std::fs::create_dir_all(&dir).unwrap();
    broken_checkpoint(&dir, |_| {});
    let mut config = small_config_json();
    config
        .as_object_mut()
        .unwrap()
        .remove("linear_conv_kernel_dim");
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    expect_error(
        &[
            "dump",
            "--model",
            dir.to_str().unwrap(),
            "--token-ids",
            "1",
            "--out",
            out,
        ],
        &["config.json", "linear_conv_kernel_dim"],
    );
    let mut config = small_config_json();
    config["num_key_value_heads"] = 3.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    expect_error(
        &[
            "dump",
            "--model",
            dir.to_str().unwrap(),
            "--token-ids",
            "1",
            "--out",
            out,
        ],
        &["config.json", "num_key_value_heads"],
    );

    // --prompt needs a tokenizer.
    let dir = tmp.path().join("no-tokenizer");
    std::fs::create_dir_all(&dir).unwrap();
    broken_checkpoint(&dir, |_| {});
    expect_error(
        &[
            "dump",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            "hi",
            "--out",
            out,
        ],
        &["tokenizer.json"],
    );

    // A sharded index naming a shard that is not there.
    let dir = tmp.path().join("sharded");
    std::fs::create_dir_all(&dir).unwrap();
    broken_checkpoint(&dir, |_| {});
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    expect_error(
        &[
            "dump",
            "--model",
            dir.to_str().unwrap(),
            "--token-ids",
            "1",
            "--out",
            out,
        ],
        &["model-00002-of-00002.safetensors"],
    );
}
