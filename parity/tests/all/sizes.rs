//! Every size a flag or a file sets is checked against the memory available before anything of that size is
//! allocated: image sizes and grids from flags, the pixel bounds of `preprocessor_config.json`, the sizes in an
//! image's header (a grey image counted as the RGB it becomes), `--context`, and the layer indices of a dump's names.
//! Each class is generated from a table of sizes over and under the limit, run on the real binary under a small
//! address-space limit (`ulimit -v`) so that a regression fails fast instead of eating the machine; a size over the
//! limit is an error (exit 2) naming the flag or the file and the bytes, never an abort or an out-of-memory kill.

use crate::common;

use common::testdata;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The address space a case may take, in KiB (4 GB): far below what any refused size would allocate.
const ULIMIT_KIB: u64 = 4_000_000;

/// Runs `qwen35 args` under [`ULIMIT_KIB`] and a time limit, with the memory available set to `gib` GiB.
fn limited(args: &[&str], gib: &str) -> Output {
    Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v {ULIMIT_KIB}; exec timeout 120 \"$0\" \"$@\""
        ))
        .arg(env!("CARGO_BIN_EXE_qwen35"))
        .args(args)
        .env("QWEN35_MEMORY_GIB", gib)
        .env_remove("QWEN35_DEVICE_CONFIG")
        .env_remove("OPENVINO_LIB")
        .output()
        .expect("the binary runs")
}

/// Asserts that `o` is a refusal before work (exit 2) that names every `needle` and the memory it needs.
fn refused(what: &str, o: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(
        o.status.code(),
        Some(2),
        "{what}: exit 2 expected; stderr: {err}"
    );
    assert!(
        err.contains("would need") || err.contains("would hold"),
        "{what}: no size named: {err}"
    );
    assert!(
        err.contains("available"),
        "{what}: no memory available named: {err}"
    );
    for n in needles {
        assert!(
            err.contains(n),
            "{what}: the error does not name `{n}`: {err}"
        );
    }
    assert!(!err.contains("panicked"), "{what}: {err}");
}

/// Asserts that `o` was not refused for its size (whatever else it did, it did not crash).
fn not_refused_for_size(what: &str, o: &Output) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !err.contains("would need") && !err.contains("would hold"),
        "{what}: refused for its size under the limit: {err}"
    );
    assert!(
        matches!(o.status.code(), Some(0..=2)),
        "{what}: {:?} {err}",
        o.status
    );
}

/// The CRC-32 of PNG chunks.
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 == 1 {
                (c >> 1) ^ 0xEDB8_8320
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// A PNG file of `width × height` whose header says `colour` (0 grey, 2 RGB, 6 RGBA), with no image data (an empty data chunk): what
/// its header promises is all a size check may read.
fn png_header(path: &Path, width: u32, height: u32, colour: u8) {
    let mut ihdr = b"IHDR".to_vec();
    ihdr.extend(width.to_be_bytes());
    ihdr.extend(height.to_be_bytes());
    ihdr.extend([8, colour, 0, 0, 0]);
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    out.extend(13u32.to_be_bytes());
    out.extend(&ihdr);
    out.extend(crc32(&ihdr).to_be_bytes());
    // An empty data chunk and the end: the header is read through to the first data chunk.
    for chunk in [&b"IDAT"[..], b"IEND"] {
        out.extend(0u32.to_be_bytes());
        out.extend(chunk);
        out.extend(crc32(chunk).to_be_bytes());
    }
    std::fs::write(path, out).unwrap();
}

fn vl() -> String {
    testdata().join("models/tiny-vl").display().to_string()
}

fn small_image() -> String {
    testdata().join("images/small.png").display().to_string()
}

#[test]
fn image_sizes_from_the_flag_over_the_memory_are_refused_naming_it() {
    let (model, image) = (vl(), small_image());
    // (size, GiB available, refused)
    let table = [
        ("100000x100000", "20", true),
        ("65536x65536", "20", true),
        ("65536x8", "1", true),
        ("4096x4096", "0.5", true),
        ("2048x2048", "0.1", true),
        ("64x64", "1", false),
        ("32x48", "0.5", false),
    ];
    for (size, gib, over) in table {
        let o = limited(
            &[
                "run",
                "--model",
                &model,
                "--image",
                &image,
                "--image-size",
                size,
                "--token-ids",
                "1",
            ],
            gib,
        );
        let what = format!("--image-size {size} with {gib} GiB");
        if over {
            refused(&what, &o, &[&format!("--image-size {size}"), "small.png"]);
        } else {
            not_refused_for_size(&what, &o);
        }
    }
}

#[test]
fn pixel_bounds_of_the_preprocessor_config_over_the_memory_are_refused_naming_the_file() {
    let image = small_image();
    for (shortest, longest, over) in [
        (1e12 as u64, 1e12 as u64, true),
        (1u64 << 40, 1u64 << 41, true),
        (1u64 << 28, 1u64 << 30, true),
        (64, 1e12 as u64, false),
        (64, 4096, false),
    ] {
        let dir = tempfile::tempdir().unwrap();
        common::copy_dir(&testdata().join("models/tiny-vl"), dir.path());
        let path = dir.path().join("preprocessor_config.json");
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        v["size"] = serde_json::json!({"shortest_edge": shortest, "longest_edge": longest});
        std::fs::write(&path, v.to_string()).unwrap();
        let o = limited(
            &[
                "run",
                "--model",
                dir.path().to_str().unwrap(),
                "--image",
                &image,
                "--token-ids",
                "1",
            ],
            "2",
        );
        let what = format!("size {shortest}..{longest}");
        if over {
            refused(&what, &o, &["preprocessor_config.json", "small.png"]);
        } else {
            not_refused_for_size(&what, &o);
        }
    }
}

#[test]
fn image_headers_over_the_memory_are_refused_before_decoding_grey_as_rgb() {
    let dir = tempfile::tempdir().unwrap();
    let model = vl();
    // Grey, RGB and RGBA headers of the same sizes are refused alike: a grey image is converted to RGB.
    for colour in [0u8, 2, 6] {
        // (side, GiB available, refused): 8000x8000 decodes to 6 bytes a pixel (the image and its RGB copy),
        // 384 MB, whatever its colour type.
        for (side, gib, over) in [
            (20000u32, "1", true),
            (60000, "1", true),
            (8000, "0.3", true),
            (8000, "1", false),
        ] {
            let path = dir.path().join(format!("c{colour}-{side}.png"));
            png_header(&path, side, side, colour);
            let p = path.display().to_string();
            let o = limited(
                &["run", "--model", &model, "--image", &p, "--token-ids", "1"],
                gib,
            );
            let what = format!("{side}x{side} colour {colour} with {gib} GiB");
            if over {
                refused(&what, &o, &[&p, &format!("{side}x{side}")]);
            } else {
                not_refused_for_size(&what, &o);
            }
        }
    }
    // Under the limit the header passes and the (absent) data is what is refused.
    let path = dir.path().join("small-grey.png");
    png_header(&path, 64, 64, 0);
    let o = limited(
        &[
            "run",
            "--model",
            &model,
            "--image",
            path.to_str().unwrap(),
            "--token-ids",
            "1",
        ],
        "1",
    );
    not_refused_for_size("64x64 grey", &o);
}

#[test]
fn image_grids_of_export_ir_and_bench_over_the_memory_are_refused_naming_the_flag() {
    let model = vl();
    let out = tempfile::tempdir().unwrap();
    let set = out.path().join("set").display().to_string();
    for grid in ["100000x100000", "4096x4096", "1024x1024"] {
        for args in [
            vec![
                "export-ir",
                "--model",
                &model,
                "--image-grid",
                grid,
                "--out",
                &set,
            ],
            vec!["bench", "--model", &model, "--image-grid", grid],
        ] {
            let o = limited(&args, "1");
            refused(
                &format!("{} --image-grid {grid}", args[0]),
                &o,
                &[&format!("--image-grid {grid}")],
            );
            assert!(!Path::new(&set).exists(), "{grid}: an output was left");
        }
    }
}

#[test]
fn contexts_over_the_memory_are_refused_naming_the_flag() {
    let model = testdata().join("models/tiny").display().to_string();
    let out = tempfile::tempdir().unwrap();
    let dump = out.path().join("d.safetensors").display().to_string();
    for context in ["100000000", "30000000", "4000000"] {
        let cases: [Vec<&str>; 2] = [
            vec![
                "validate",
                "--model",
                &model,
                "--device",
                "CPU",
                "--context",
                context,
                "--tokens",
                "2",
            ],
            vec![
                "dump",
                "--model",
                &model,
                "--backend",
                "openvino",
                "--device",
                "FP16SIM",
                "--context",
                context,
                "--token-ids",
                "1,2",
                "--out",
                &dump,
            ],
        ];
        for args in cases {
            let o = limited(&args, "2");
            refused(
                &format!("{} --context {context}", args[0]),
                &o,
                &[&format!("--context {context}")],
            );
            assert!(!Path::new(&dump).exists());
        }
    }
}

/// A dump of the tiny model on the reference, written into `dir`.
fn tiny_dump(dir: &Path) -> PathBuf {
    let path = dir.join("ref.safetensors");
    let o = common::qwen35(&[
        "dump",
        "--model",
        testdata().join("models/tiny").to_str().unwrap(),
        "--token-ids",
        "1,2,3",
        "--out",
        path.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", common::stderr(&o));
    path
}

#[test]
fn layer_indices_of_dump_names_beyond_the_memory_are_refused_before_the_walk() {
    let dir = tempfile::tempdir().unwrap();
    let clean = tiny_dump(dir.path());
    let d = parity::dump::Dump::read(&clean).unwrap();
    let row = d.tensors["layers.0.output"].clone();
    for layer in ["4000000000", "18446744073709551614", "100000000000"] {
        for (part, side) in [("output", 0), ("mlp_output", 1)] {
            let mut tensors = d.tensors.clone();
            let name = format!("layers.{layer}.{part}");
            tensors.insert(name.clone(), row.clone());
            let path = dir.path().join(format!("l{layer}-{part}.safetensors"));
            parity::dump::Dump {
                tensors,
                metadata: d.metadata.clone(),
            }
            .write(&path)
            .unwrap();
            let (p, c) = (path.display().to_string(), clean.display().to_string());
            let args = if side == 0 {
                ["diff", &p, &c]
            } else {
                ["diff", &c, &p]
            };
            let o = limited(&args, "2");
            refused(&format!("{name} in {p}"), &o, &[&name, &p]);
        }
    }
}

/// `d` with `edit` applied to its tensors, written as `name` in `dir`.
fn edited(
    d: &parity::dump::Dump,
    dir: &Path,
    name: &str,
    edit: impl FnOnce(&mut std::collections::BTreeMap<String, candle_core::Tensor>),
) -> String {
    let mut tensors = d.tensors.clone();
    edit(&mut tensors);
    let path = dir.join(name);
    parity::dump::Dump {
        tensors,
        metadata: d.metadata.clone(),
    }
    .write(&path)
    .unwrap();
    path.display().to_string()
}

#[test]
fn a_dump_and_a_model_that_do_not_belong_together_are_refused_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let clean = tiny_dump(dir.path());
    let c = clean.display().to_string();
    let d = parity::dump::Dump::read(&clean).unwrap();
    let row = d.tensors["layers.0.output"].clone();
    let tiny = testdata().join("models/tiny").display().to_string();
    // A layer the model (4 layers) does not have, with and without --model: refused when the model is named.
    for layer in [4u64, 5, 7, 63, 1000] {
        for part in ["output", "mlp_output", "linear_attn.qkv"] {
            let name = format!("layers.{layer}.{part}");
            let p = edited(&d, dir.path(), &format!("extra-{layer}.safetensors"), |t| {
                t.insert(name.clone(), row.clone());
            });
            let o = limited(&["diff", &p, &c, "--model", &tiny], "8");
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(2), "{name}: {err}");
            assert!(
                err.contains(&name) && err.contains(&tiny) && err.contains(&p),
                "{name}: {err}"
            );
        }
    }
    // --model of another layer count or vocabulary than the dumps': refused naming the model and the dump.
    for other in ["tiny-full", "tiny-vl", "tiny-moe"] {
        let model = testdata().join("models").join(other).display().to_string();
        let o = limited(&["diff", &c, &c, "--model", &model], "8");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "--model {other}: {err}");
        assert!(
            err.contains(&model) && err.contains(&c),
            "--model {other}: {err}"
        );
    }
    // A residual stream of another hidden size than the model's.
    for width in [32usize, 63, 65, 128] {
        let name = "layers.1.output";
        let p = edited(&d, dir.path(), &format!("w{width}.safetensors"), |t| {
            let rows = t[name].dim(0).unwrap();
            t.insert(
                name.into(),
                candle_core::Tensor::zeros(
                    (rows, width),
                    candle_core::DType::F32,
                    &candle_core::Device::Cpu,
                )
                .unwrap(),
            );
        });
        let o = limited(&["diff", &p, &c, "--model", &tiny], "8");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "width {width}: {err}");
        assert!(
            err.contains(name) && err.contains(&tiny),
            "width {width}: {err}"
        );
    }
    // Integer values where a dump holds floats: never cast and compared.
    for name in [
        "logits",
        "layers.0.output",
        "layers.2.mlp_output",
        "final_norm",
        "layers.0.recurrent_state",
    ] {
        for dtype in [candle_core::DType::I64, candle_core::DType::U32] {
            if !d.tensors.contains_key(name) {
                continue;
            }
            let p = edited(&d, dir.path(), &format!("int-{dtype:?}.safetensors"), |t| {
                let v = t[name].abs().unwrap().to_dtype(dtype).unwrap();
                t.insert(name.into(), v);
            });
            for args in [["diff", &p, &c], ["diff", &c, &p]] {
                let o = limited(&args, "8");
                let err = String::from_utf8_lossy(&o.stderr);
                assert_eq!(o.status.code(), Some(2), "{name} as {dtype:?}: {err}");
                assert!(
                    err.contains(name) && err.contains(&p),
                    "{name} as {dtype:?}: {err}"
                );
            }
        }
    }
}

#[test]
fn pixel_values_that_are_integers_or_not_finite_are_the_files_error() {
    let g = common::vl::golden();
    let dir = tempfile::tempdir().unwrap();
    let model = vl();
    let ids = common::vl::ids_text(&g["images.token_ids"]);
    let values = g["images.pixel_values"]
        .to_dtype(candle_core::DType::F32)
        .unwrap();
    let n = values.elem_count();
    let write = |name: &str, v: candle_core::Tensor| {
        let path = dir.path().join(name);
        let t: std::collections::HashMap<String, candle_core::Tensor> = [
            ("pixel_values".to_string(), v),
            (
                "image_grid_thw".to_string(),
                g["images.image_grid_thw"].clone(),
            ),
        ]
        .into();
        candle_core::safetensors::save(&t, &path).unwrap();
        path.display().to_string()
    };
    let run = |p: &str| {
        limited(
            &[
                "run",
                "--model",
                &model,
                "--pixel-values",
                p,
                "--token-ids",
                &ids,
            ],
            "8",
        )
    };
    // A NaN or an Inf anywhere among the values: exit 2 naming the file and the key, never the checkpoint.
    for (k, bad) in [0, n / 3, n - 1]
        .into_iter()
        .flat_map(|i| [(i, f32::NAN), (i, f32::INFINITY), (i, f32::NEG_INFINITY)])
    {
        let mut v = values.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        v[k] = bad;
        let t = candle_core::Tensor::from_vec(v, values.dims(), &candle_core::Device::Cpu).unwrap();
        let p = write(&format!("bad-{k}.safetensors"), t);
        let o = run(&p);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{bad} at {k}: {err}");
        assert!(
            err.contains(&p) && err.contains("pixel_values"),
            "{bad} at {k}: {err}"
        );
        assert!(
            !err.contains("checkpoint"),
            "{bad} at {k} blames the checkpoint: {err}"
        );
    }
    // Raw 0-255 pixels as integers: refused, not cast and run.
    for dtype in [
        candle_core::DType::I64,
        candle_core::DType::U32,
        candle_core::DType::U8,
    ] {
        let raw = ((values.clone() + 1.0).unwrap() * 127.0)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let p = write(&format!("int-{dtype:?}.safetensors"), raw);
        let o = run(&p);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{dtype:?}: {err}");
        assert!(
            err.contains(&p) && err.contains("pixel_values"),
            "{dtype:?}: {err}"
        );
    }
}

#[test]
fn an_image_of_an_aspect_ratio_over_200_names_its_file() {
    let dir = tempfile::tempdir().unwrap();
    let model = vl();
    for (w, h) in [(1000u32, 1u32), (1, 1000), (402, 2), (3, 700)] {
        let path = dir.path().join(format!("{w}x{h}.png"));
        png_header(&path, w, h, 2);
        let p = path.display().to_string();
        let o = limited(
            &["run", "--model", &model, "--image", &p, "--token-ids", "1"],
            "8",
        );
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{w}x{h}: {err}");
        assert!(
            err.contains(&p) && err.contains("aspect ratio"),
            "{w}x{h}: {err}"
        );
    }
}
