//! `qwen35 diff` of a dump llama.cpp's CPU back end wrote through its evaluation callback (`testdata/gguf/llamacpp/`,
//! `scripts/llama_dump.cpp`) against the reference's dump of the same 8 tokens on the same model: llama.cpp's names
//! are mapped on read (`parity/src/dump/llamacpp.rs`), layer by layer. Dense (tiny-tied, tiny-h128) and MoE
//! (tiny-moe-gguf: 8 experts, 3 a token, a gated shared expert) fixtures.

use crate::common::gguf::{self, diff_report};
use crate::common::{stderr, testdata};
use std::path::Path;

/// `diff` of llama.cpp's `file` against `reference`: the exit code and the JSON report.
fn diff(dir: &Path, file: &str, reference: &Path) -> (Option<i32>, serde_json::Value) {
    diff_report(
        &testdata().join("gguf/llamacpp").join(file),
        reference,
        &dir.join(format!("{file}.json")),
        // llama.cpp's context keeps K and V in f16 (its default): the logits carry that rounding (measured NMSE
        // 3.2e-7, mean KL 3.6e-6), above the f32 defaults made for two f32 runs. The layers keep the f32 default.
        &["--max-nmse", "1e-6", "--max-kl", "1e-5"],
    )
}

/// The output NRMSE of every layer of a report.
fn layers(v: &serde_json::Value) -> Vec<f64> {
    v["devices"][0]["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["output"]["nrmse"].as_f64().unwrap())
        .collect()
}

#[test]
fn llamacpp_dumps_diff_layer_by_layer() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("ref.safetensors");
    // The reference on llama.cpp's own f32 GGUF (`--model FILE.gguf`): the same weights llama.cpp ran.
    let model = testdata().join("gguf/llamacpp/tiny-tied.f32.gguf");
    let o = gguf::dump(&model, &reference, &[]);
    assert!(o.status.success(), "{}", stderr(&o));

    // f32 weights: every layer within the f32 layer tolerance (1e-4); layer 0 (linear attention, no KV cache) at
    // f32 rounding, the later ones carry the f16 KV cache of full-attention layer 1 (measured 5.5e-5 to 8.9e-5).
    let (code, v) = diff(tmp.path(), "tiny-tied.f32.dump.safetensors", &reference);
    let f32_layers = layers(&v);
    assert_eq!(f32_layers.len(), 4, "{v}");
    assert!(f32_layers[0] < 1e-6, "{f32_layers:?}");
    assert!(f32_layers.iter().all(|&e| e < 1e-4), "{f32_layers:?}");
    assert!(v["devices"][0]["logits"]["nmse"].as_f64().unwrap() < 1e-6);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(v["passed"], true);

    // Q8_0 weights: the error per layer shows (measured 5.0e-3 .. 1.7e-2), above the f32 tolerance: a failed check.
    let (code, v) = diff(tmp.path(), "tiny-tied.q8_0.dump.safetensors", &reference);
    let q8 = layers(&v);
    assert_eq!(q8.len(), 4, "{v}");
    assert!(q8.iter().all(|&e| (1e-3..1e-1).contains(&e)), "{q8:?}");
    assert!(q8.iter().zip(&f32_layers).all(|(q, f)| q > f), "{q8:?}");
    assert_eq!(code, Some(1), "{v}");

    // The MoE model, the reference on llama.cpp's own f32 GGUF: its linear-attention layers 0..2 at f32 rounding
    // (measured 4.9e-8 .. 1.1e-7), full-attention layer 3 with llama.cpp's f16 KV cache (5.5e-5), logits NMSE
    // 1.2e-7: the same check passes.
    let reference = tmp.path().join("moe.safetensors");
    let model = testdata().join("gguf/llamacpp/tiny-moe-gguf.f32.gguf");
    let o = gguf::dump(&model, &reference, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (code, v) = diff(tmp.path(), "tiny-moe-gguf.f32.dump.safetensors", &reference);
    let moe = layers(&v);
    assert_eq!(moe.len(), 4, "{v}");
    assert!(moe[..3].iter().all(|&e| e < 1e-6), "{moe:?}");
    assert!(moe[3] < 1e-4, "{moe:?}");
    assert!(v["devices"][0]["logits"]["nmse"].as_f64().unwrap() < 1e-6);
    assert_eq!(code, Some(0), "{v}");
}

/// The reference's dump of `fixture`'s GGUF (`testdata/gguf/llamacpp/{fixture}.gguf`) under `--arithmetic`.
fn reference_dump(dir: &Path, fixture: &str, arithmetic: &str) -> std::path::PathBuf {
    let out = dir.join(format!("{fixture}.{arithmetic}.safetensors"));
    let model = testdata().join(format!("gguf/llamacpp/{fixture}.gguf"));
    let o = gguf::dump(&model, &out, &["--arithmetic", arithmetic]);
    assert!(o.status.success(), "{fixture} {arithmetic}: {}", stderr(&o));
    out
}

/// The logits `[T, V]` of a dump, row by row.
fn logits(path: &Path) -> Vec<Vec<f32>> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("logits").unwrap();
    let values: Vec<f32> = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    values
        .chunks_exact(t.shape()[1])
        .map(<[f32]>::to_vec)
        .collect()
}

/// The index of the largest value.
fn top1(row: &[f32]) -> usize {
    (0..row.len())
        .max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)))
        .unwrap()
}

/// Every committed llama.cpp fixture, and the bound of its worst layer output NRMSE and of its logits NMSE against
/// the reference with `--arithmetic llama-cpp`.
///
/// The bounds are f32 rounding: measured 9.4e-9 to 6.1e-7 per layer and 6.9e-15 to 7.9e-15 on the logits (AMD EPYC
/// Zen 4, and Zen 5 for the MoE rows; the products' f32 sums run in another order than ggml's), so 1e-6 and 1e-12.
/// Three fixtures carry rounding decisions that the f32 difference of their inputs tips the other way, stated
/// apart: the f32 files, one f16 ulp of the flash-attention accumulator at the last token of tiny-tied's layer 1
/// (its f32 products differ from ggml's tinyBLAS in the last bits, where the quantized files' integer dots agree
/// exactly; measured 5.5e-6 .. 8.1e-6, logits 2.7e-9), and in tiny-moe-gguf's layer 3 the f16 rounding of four
/// elements of the cache and the query (a key of token 0, the query of tokens 3 and 7, a value of token 7; layers
/// 0..2 at 4.9e-8 .. 1.1e-7, layer 3 5.3e-6, nearly all of it token 3's, logits 1.0e-9); tiny-h128.q6_k, the Q8_K scale of one token's 256 inputs to layer 3's Q6_K `o_proj`
/// (layers 0..2 at 2e-8, layer 3 1.3e-4, logits 8.5e-6). The plain reference on the same weights is 1.3e-3 to
/// 1.3e-2 per layer away (the activations' 8-bit quantization it does not model): three orders of magnitude above
/// the bound.
const FIXTURES: [(&str, f64, f64); 16] = [
    ("tiny-tied.f32", 2e-5, 1e-8),
    ("tiny-tied.q8_0", 1e-6, 1e-12),
    ("tiny-tied.q4_0", 1e-6, 1e-12),
    ("tiny-tied.q4_k_m", 1e-6, 1e-12),
    ("tiny-tied.q6_k", 1e-6, 1e-12),
    ("tiny-tied.iq4_nl", 1e-6, 1e-12),
    ("tiny-h128.q8_0", 1e-6, 1e-12),
    ("tiny-h128.q4_k_m", 1e-6, 1e-12),
    ("tiny-h128.q6_k", 5e-4, 1e-4),
    ("tiny-h128.iq4_nl", 1e-6, 1e-12),
    ("tiny-moe-gguf.f32", 2e-5, 1e-8),
    ("tiny-moe-gguf.q8_0", 1e-6, 1e-12),
    ("tiny-moe-gguf.q4_0", 1e-6, 1e-12),
    ("tiny-moe-gguf.q4_k_m", 1e-6, 1e-12),
    ("tiny-moe-gguf.q6_k", 1e-6, 1e-12),
    ("tiny-moe-gguf.iq4_nl", 1e-6, 1e-12),
];

#[test]
fn llama_cpp_arithmetic_agrees_with_llama_cpp_to_f32_rounding() {
    let tmp = tempfile::tempdir().unwrap();
    for (fixture, layer_bound, logits_bound) in FIXTURES {
        let llama = format!("{fixture}.dump.safetensors");
        let modelled = reference_dump(tmp.path(), fixture, "llama-cpp");
        let (_, v) = diff(tmp.path(), &llama, &modelled);
        let ls = layers(&v);
        assert_eq!(ls.len(), 4, "{fixture}: {v}");
        let nmse = v["devices"][0]["logits"]["nmse"].as_f64().unwrap();
        assert!(ls.iter().all(|&e| e < layer_bound), "{fixture}: {ls:?}");
        assert!(nmse < logits_bound, "{fixture}: logits NMSE {nmse}");
        if fixture == "tiny-h128.q6_k" || fixture == "tiny-moe-gguf.f32" {
            // The one Q8_K decision, and the query's f16 roundings, are in layer 3; the layers before it are at f32
            // rounding.
            assert!(ls[..3].iter().all(|&e| e < 1e-6), "{fixture}: {ls:?}");
        }
        // The same greedy token at every position (teacher-forced over the 8 prompt tokens).
        let ours = logits(&modelled);
        let theirs = logits(&testdata().join("gguf/llamacpp").join(&llama));
        assert_eq!(ours.len(), 8, "{fixture}");
        for (t, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert_eq!(top1(a), top1(b), "{fixture}: position {t}");
        }

        // Without the option, a quantized file's layers are far outside the bound and ten times further from
        // llama.cpp than with it (the test can fail).
        if !fixture.ends_with(".f32") {
            let plain = reference_dump(tmp.path(), fixture, "reference");
            let (_, v) = diff(tmp.path(), &llama, &plain);
            let worst = layers(&v).into_iter().fold(0f64, f64::max);
            let modelled = ls.iter().copied().fold(0f64, f64::max);
            assert!(
                worst > 1e-3 && worst > layer_bound && worst > 10.0 * modelled,
                "{fixture}: {worst} without, {modelled} with"
            );
        }
    }
}

#[test]
fn llama_cpp_arithmetic_is_refused_for_a_safetensors_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x.safetensors");
    let model = testdata().join("models/tiny-tied");
    let o = gguf::dump(&model, &out, &["--arithmetic", "llama-cpp"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains("--arithmetic llama-cpp") && e.contains("not a GGUF"),
        "{e}"
    );
    assert!(!out.exists());
}

/// A dump's f32 tensor `name` as rows of its last dimension.
fn rows_f32(st: &safetensors::SafeTensors, name: &str) -> Vec<Vec<f32>> {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    let last = *t.shape().last().unwrap();
    t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect::<Vec<_>>()
        .chunks_exact(last)
        .map(<[f32]>::to_vec)
        .collect()
}

/// The routing of the MoE fixtures: the experts llama.cpp's router chose at each token of each layer (the router's
/// probabilities `ffn_moe_probs-{i}` it gathered into `ffn_moe_weights-{i}`, matched by their bits) and their
/// renormalised weights (`ffn_moe_weights_norm-{i}`), from the full dumps (f32 and Q4_K_M), against the reference's
/// (`layers.{i}.mlp.experts_chosen`, `expert_weights`) on the same GGUF. With `--arithmetic llama-cpp` the same
/// experts at all 32 (token, layer) pairs and the weights within 2e-6 (measured 4.8e-7 on Q4_K_M; on the f32 file
/// 6.6e-5 at layer 3, after the attention's f16 rounding decisions, so layers 0..2 only there); without it, the
/// same experts, the Q4_K_M weights 7.6e-2 away (the activations' quantization).
#[test]
fn the_moe_fixtures_route_as_llama_cpp_routed() {
    let tmp = tempfile::tempdir().unwrap();
    for (fixture, arithmetic, layers_held, bound) in [
        ("tiny-moe-gguf.f32", "llama-cpp", 3, 2e-6),
        ("tiny-moe-gguf.q4_k_m", "llama-cpp", 4, 2e-6),
        ("tiny-moe-gguf.q4_k_m", "reference", 0, 0.0),
    ] {
        let ours_path = reference_dump(tmp.path(), fixture, arithmetic);
        let ours_bytes = std::fs::read(&ours_path).unwrap();
        let ours = safetensors::SafeTensors::deserialize(&ours_bytes).unwrap();
        let theirs_bytes =
            std::fs::read(testdata().join(format!("gguf/llamacpp/{fixture}.dump.safetensors")))
                .unwrap();
        let theirs = safetensors::SafeTensors::deserialize(&theirs_bytes).unwrap();
        let mut worst = vec![0f32; 4];
        for (layer, worst) in worst.iter_mut().enumerate() {
            let probs = rows_f32(&theirs, &format!("ffn_moe_probs-{layer}"));
            let picked = rows_f32(&theirs, &format!("ffn_moe_weights-{layer}"));
            let norm = rows_f32(&theirs, &format!("ffn_moe_weights_norm-{layer}"));
            let chosen = ours
                .tensor(&format!("layers.{layer}.mlp.experts_chosen"))
                .unwrap();
            let k = chosen.shape()[1];
            let chosen: Vec<usize> = chosen
                .data()
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as usize)
                .collect();
            let weights = rows_f32(&ours, &format!("layers.{layer}.mlp.expert_weights"));
            for t in 0..8 {
                // `ffn_moe_weights` is [T, k, 1]: k rows of one value each.
                let theirs_experts: Vec<usize> = (0..k)
                    .map(|j| {
                        let w = picked[t * k + j][0];
                        let hits: Vec<usize> = (0..probs[t].len())
                            .filter(|&e| probs[t][e].to_bits() == w.to_bits())
                            .collect();
                        assert_eq!(hits.len(), 1, "{fixture} layer {layer} token {t}: {hits:?}");
                        hits[0]
                    })
                    .collect();
                let ours_experts = &chosen[t * k..(t + 1) * k];
                let mut a = theirs_experts.clone();
                let mut b = ours_experts.to_vec();
                a.sort();
                b.sort();
                assert_eq!(
                    a, b,
                    "{fixture} {arithmetic}: layer {layer} token {t}: llama.cpp chose {theirs_experts:?}, the \
                     reference {ours_experts:?}"
                );
                for (j, e) in theirs_experts.iter().enumerate() {
                    let r = ours_experts.iter().position(|x| x == e).unwrap();
                    *worst = worst.max((norm[t][j] - weights[t][r]).abs());
                }
            }
        }
        println!(
            "{fixture} {arithmetic}: the same experts at all 32 (token, layer) pairs; |Δweight| per layer {worst:?}"
        );
        if layers_held > 0 {
            assert!(
                worst[..layers_held].iter().all(|&w| w < bound),
                "{fixture}: {worst:?}"
            );
        } else {
            assert!(
                worst.iter().fold(0f32, |a, &b| a.max(b)) > 1e-3,
                "{fixture}: {worst:?}"
            );
        }
    }
}
