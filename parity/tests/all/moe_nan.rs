//! A NaN in an MoE weight (the router, an expert, the shared expert or its gate) is named as a dense weight's NaN is:
//! the run fails (exit 1) and its message names the checkpoint's tensor, never an input error (exit 2) about a router
//! probability. One case per weight kind of an MoE layer of tiny-moe, generated from the checkpoint's own names.

use candle_core::Tensor;
use std::collections::HashMap;
use std::path::Path;

use crate::common;
use common::{copy_dir, qwen35, stderr, testdata};

/// A copy of tiny-moe in `dir` whose tensors matching `hit` each hold a NaN.
fn planted(dir: &Path, hit: &dyn Fn(&str) -> bool) {
    copy_dir(&testdata().join("models/tiny-moe"), dir);
    let file = dir.join("model.safetensors");
    let mut tensors: HashMap<String, Tensor> =
        candle_core::safetensors::load(&file, &candle_core::Device::Cpu)
            .unwrap()
            .into_iter()
            .collect();
    for (name, t) in tensors.iter_mut() {
        if hit(name) {
            let mut v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            v[3] = f32::NAN;
            *t = Tensor::from_vec(v, t.dims(), t.device()).unwrap();
        }
    }
    candle_core::safetensors::save(&tensors, &file).unwrap();
}

#[test]
fn a_nan_in_any_moe_weight_fails_the_run_naming_the_weight() {
    let tmp = tempfile::tempdir().unwrap();
    // Every kind of weight of layer 1's MoE block; an expert's kind is planted in every expert, so that the
    // experts the prompt chooses hold it.
    let kinds = [
        "mlp.gate.weight",
        "mlp.shared_expert_gate.weight",
        "mlp.shared_expert.gate_proj.weight",
        "mlp.shared_expert.up_proj.weight",
        "mlp.shared_expert.down_proj.weight",
        "down_proj.weight",
        "gate_proj.weight",
        "up_proj.weight",
    ];
    for (i, kind) in kinds.iter().enumerate() {
        let experts = !kind.starts_with("mlp.");
        let dir = tmp.path().join(format!("m{i}"));
        planted(&dir, &|name| {
            if experts {
                name.starts_with("model.layers.1.mlp.experts.") && name.ends_with(kind)
            } else {
                name == format!("model.layers.1.{kind}")
            }
        });
        let named = if experts {
            format!("model.layers.1.mlp.experts.0.{kind}")
        } else {
            format!("model.layers.1.{kind}")
        };
        let model = dir.to_str().unwrap();
        for args in [
            vec![
                "run",
                "--model",
                model,
                "--prompt",
                "hi",
                "--max-tokens",
                "2",
            ],
            vec!["ranges", "--model", model, "--prompt", "hi"],
        ] {
            let o = qwen35(&args);
            // `run` says it on standard error, `ranges` in its report.
            let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), stderr(&o));
            assert_eq!(o.status.code(), Some(1), "{kind}: {args:?}: {text}");
            assert!(!text.contains("panicked"), "{kind}: {args:?}: {text}");
            assert!(
                text.contains(&named),
                "{kind}: {args:?} does not name {named}: {text}"
            );
        }
    }
}
