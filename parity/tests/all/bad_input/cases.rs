//! The bad-input table: each case's command, the environment it runs in, the exit code it must end with and the
//! words its message must hold.

/// One case: what is run, and what must come of it.
pub struct Case {
    /// What the case is about (shown when it fails).
    pub what: &'static str,
    /// The arguments, `{fixture}` placeholders substituted.
    pub args: &'static str,
    /// Environment variables set for the run (`{fixture}` substituted too).
    pub env: &'static [(&'static str, &'static str)],
    /// The exit code expected.
    pub code: i32,
    /// Words the standard error (or output) must hold.
    pub needles: &'static [&'static str],
}

/// The table. Arguments are split on spaces (no case needs a space inside one argument); `{long}` is a prompt of
/// 3000 token ids, past the tiny model's 2048 positions.
pub fn cases() -> Vec<Case> {
    let c = |what, args, code, needles| Case {
        what,
        args,
        env: &[],
        code,
        needles,
    };
    let e = |what, args, env, code, needles| Case {
        what,
        args,
        env,
        code,
        needles,
    };
    vec![
        // A device's faults, planted in dumps and checkpoints: findings (exit 1), named.
        c(
            "diff: scattered NaN logits",
            "diff {nan_logits} {clean}",
            1,
            &["logits", "NaN"],
        ),
        c(
            "diff: one NaN in an intermediate",
            "diff {nan_core} {clean}",
            1,
            &["layers.0.linear_attn.core_output", "position"],
        ),
        c(
            "diff: all-NaN logits",
            "diff {all_nan} {clean}",
            1,
            &["non-finite"],
        ),
        c(
            "diff: infinity in a state",
            "diff {inf_state} {clean}",
            1,
            &["layers.0.recurrent_state", "infinite"],
        ),
        c(
            "diff: the reference dump holds NaN",
            "diff {clean} {nan_core}",
            1,
            &["reference's side"],
        ),
        c(
            "run: a NaN norm weight",
            "run --model {nan_model} --prompt hi --max-tokens 4",
            1,
            &["NaN", "model.layers.1.input_layernorm.weight"],
        ),
        c(
            "ranges: a NaN norm weight",
            "ranges --model {nan_model} --prompt hi",
            1,
            &["first non-finite value", "layers.1."],
        ),
        c(
            "dump: a NaN norm weight (the file kept, exit 1)",
            "dump --model {nan_model} --prompt hi --generate 3 --out {tmp}/nan.safetensors",
            1,
            &[
                "NaN at generated token 0",
                "0 of the 3 tokens",
                "`layers.1.",
            ],
        ),
        c(
            "validate: a device whose logits turn NaN",
            "validate --device CPU --token-ids 1,2,3,4,5,6 --tokens 3 --inject-fault nan-from=4",
            1,
            &["NaN"],
        ),
        // Outputs that would overwrite an input or each other, or cannot be written: refused before work.
        c(
            "dump: --out onto the checkpoint it reads",
            "dump --model {model_copy} --token-ids 1 --out {model_copy}/model.safetensors",
            2,
            &["--out", "model.safetensors"],
        ),
        c(
            "diff: --json onto an input",
            "diff {clean} {clean} --json {clean}",
            2,
            &["--json", "clean.safetensors"],
        ),
        c(
            "diff: --json equal to --report",
            "diff {clean} {clean} --json {tmp}/r.txt --report {tmp}/r.txt",
            2,
            &["--json", "--report"],
        ),
        c(
            "validate: --json /proc/x",
            "validate --device CPU --json /proc/x/report.json",
            2,
            &["--json", "/proc/x"],
        ),
        c(
            "export-ir: --blocks 16,16",
            "export-ir --blocks 16,16 --out {tmp}/ir16",
            2,
            &["--blocks", "twice"],
        ),
        c(
            "export-ir: a block past --context",
            "export-ir --blocks 2000 --context 1024 --out {tmp}/ir2000",
            2,
            &["--blocks 2000", "--context"],
        ),
        c(
            "export-ir: --out not empty",
            "export-ir --out {tmp}",
            2,
            &["--out", "empty"],
        ),
        c(
            "synth: more than the disk holds",
            "synth --layers 100000 --out {tmp}/huge",
            2,
            &["--out", "free"],
        ),
        // Counts beyond what any run can hold: refused before work, naming the flag.
        c(
            "run: --max-tokens u64::MAX",
            "run --prompt hi --max-tokens {u64max}",
            2,
            &["--max-tokens", "max_position_embeddings"],
        ),
        c(
            "dump: --generate 10^12",
            "dump --token-ids 1,2 --generate 1000000000000 --out {tmp}/g.safetensors",
            2,
            &["--generate", "max_position_embeddings"],
        ),
        c(
            "compare-devices: --tokens u64::MAX",
            "compare-devices --tokens {u64max}",
            2,
            &["--tokens", "positions"],
        ),
        c(
            "validate: --tokens u64::MAX",
            "validate --device CPU --tokens {u64max}",
            2,
            &["--tokens", "positions"],
        ),
        c(
            "bench: --decode-tokens u64::MAX",
            "bench --decode-tokens {u64max} --no-machine",
            2,
            &["--decode-tokens", "positions"],
        ),
        c(
            "bench: --prompt-tokens u64::MAX",
            "bench --prompt-tokens {u64max} --no-machine",
            2,
            &["--prompt-tokens", "positions"],
        ),
        c(
            "dump: a prompt past max_position_embeddings",
            "dump --token-ids {long} --out {tmp}/l.safetensors",
            2,
            &["3000 prompt tokens", "2048"],
        ),
        c(
            "ranges: a prompt past max_position_embeddings",
            "ranges --token-ids {long}",
            2,
            &["3000 prompt tokens", "2048"],
        ),
        c(
            "compare-devices: a prompt past max_position_embeddings",
            "compare-devices --token-ids {long} --tokens 1",
            2,
            &["3000 prompt tokens", "2048"],
        ),
        c(
            "compare-devices: --block past --context",
            "compare-devices --block 2000 --tokens 1",
            2,
            &["--block 2000", "--context"],
        ),
        c(
            "dump: --block past --context",
            "dump --backend openvino --block 64 --context 32 --token-ids 1 --out {tmp}/b.safetensors",
            2,
            &["--block 64", "32"],
        ),
        // Loading.
        e(
            "OPENVINO_LIB: the C++ library",
            "devices",
            &[("OPENVINO_LIB", "{cpp_lib}")],
            2,
            &["OPENVINO_LIB", "C API", "libopenvino_c"],
        ),
        e(
            "OPENVINO_LIB: not a library",
            "devices",
            &[("OPENVINO_LIB", "{clean}")],
            2,
            &["OPENVINO_LIB", "cannot be loaded"],
        ),
        c(
            "index: a shard outside the model's folder",
            "dump --model {traversal} --token-ids 1 --out {tmp}/t.safetensors",
            2,
            &["model.safetensors.index.json", "../", "weight_map"],
        ),
        c(
            "index: weight_map not an object",
            "dump --model {no_weight_map} --token-ids 1 --out {tmp}/t.safetensors",
            2,
            &["model.safetensors.index.json", "`weight_map` is missing"],
        ),
        c(
            "diff: a generated id outside the vocabulary",
            "diff {big_id} {clean}",
            2,
            &["`generated`", "outside the vocabulary"],
        ),
        c(
            "diff: a prompt id outside the vocabulary",
            "diff {big_prompt_id} {clean}",
            2,
            &["`token_ids`", "outside the vocabulary"],
        ),
        c(
            "diff: a 2-D generated",
            "diff {gen_2d} {clean}",
            2,
            &["`generated`", "one axis"],
        ),
        c(
            "diff: 1-D logits",
            "diff {logits_1d} {clean}",
            2,
            &["`logits`", "[T, V]"],
        ),
        c(
            "config: max_position_embeddings missing",
            "dump --model {no_positions} --token-ids 1 --out {tmp}/p.safetensors",
            2,
            &["config.json", "max_position_embeddings", "missing"],
        ),
        // Conflicts, refused naming both sides.
        c(
            "--device-config precision against --precision",
            "dump --backend openvino --device-config {f16_config} --precision f32 --token-ids 1 --out {tmp}/c.safetensors",
            2,
            &["INFERENCE_PRECISION_HINT", "--precision"],
        ),
        c(
            "--device-config precision against the default",
            "dump --backend openvino --device-config {f16_config} --token-ids 1 --out {tmp}/c.safetensors",
            2,
            &["INFERENCE_PRECISION_HINT", "default --precision"],
        ),
        c(
            "FP16SIM: an option twice in the name",
            "compare-devices --device FP16SIM:store=f16,store=f32 --tokens 1",
            2,
            &["`store` given twice", "store=f16", "store=f32"],
        ),
        e(
            "FP16SIM: a config overriding the name",
            "compare-devices --device FP16SIM:store=f16 --tokens 1",
            &[("QWEN35_DEVICE_CONFIG", "{\"store\":\"f32\"}")],
            2,
            &["`store` given twice", "device config"],
        ),
        c(
            "--system with --token-ids",
            "dump --token-ids 1,2 --system hello --out {tmp}/s.safetensors",
            2,
            &["--system", "--token-ids"],
        ),
        c(
            "--think with --prompts",
            "compare-devices --prompts {prompts} --think",
            2,
            &["--think"],
        ),
        c(
            "--allow-precision bogus",
            "validate --device CPU --allow-precision bogus",
            2,
            &["--allow-precision bogus"],
        ),
        c(
            "manifest: version 99",
            "compare-devices --ir {version99} --tokens 1",
            2,
            &["manifest.json", "version", "99"],
        ),
        c(
            "manifest: v1 format, version 99",
            "compare-devices --ir {v1_version99} --tokens 1",
            2,
            &["version", "99"],
        ),
        c(
            "manifest: reference_weights int9",
            "compare-devices --ir {int9} --tokens 1",
            2,
            &["reference_weights", "int9"],
        ),
        c(
            "manifest: a model that does not exist",
            "compare-devices --ir {no_model} --tokens 1",
            2,
            &["`model`", "no config.json"],
        ),
        // Messages that name what is wrong.
        c(
            "--device empty",
            "validate --device ",
            2,
            &["no device named"],
        ),
        c(
            "--model a file",
            "dump --model {clean} --token-ids 1 --out {tmp}/m.safetensors",
            2,
            &["--model", "a file"],
        ),
        c(
            "--model a missing folder",
            "dump --model {tmp}/nowhere --token-ids 1 --out {tmp}/m.safetensors",
            2,
            &["--model", "no such directory"],
        ),
        e(
            "QWEN35_DEVICE_CONFIG: a missing path",
            "dump --backend openvino --token-ids 1 --out {tmp}/e.safetensors",
            &[("QWEN35_DEVICE_CONFIG", "{tmp}/no-such.json")],
            2,
            &["QWEN35_DEVICE_CONFIG", "JSON object", "path"],
        ),
        c(
            "ranges: --store bogus",
            "ranges --prompt hi --store f8",
            2,
            &["--store f8"],
        ),
        c(
            "diff: not a dump",
            "diff {config_file} {clean}",
            2,
            &["not a safetensors dump"],
        ),
        c(
            "diff: dumps of different prompts",
            "diff {other_prompt} {clean}",
            2,
            &["different prompts"],
        ),
        c(
            "a token id outside the vocabulary",
            "dump --token-ids 1,99999 --out {tmp}/v.safetensors",
            2,
            &["--token-ids", "99999"],
        ),
        c(
            "--inject-fault bogus",
            "validate --device CPU --inject-fault nan-from=x",
            2,
            &["--inject-fault", "nan-from=POSITION"],
        ),
        c("--block 0", "compare-devices --block 0", 2, &["--block"]),
        c(
            "--max-kl negative",
            "compare-devices --max-kl=-1",
            2,
            &["--max-kl"],
        ),
    ]
}
