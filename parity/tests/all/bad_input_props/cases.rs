//! The mutations: one change drawn at a time, made into a case ready to run (its arguments, culprits and files).

use super::*;

/// One change, as drawn (indices are taken modulo the lists they index).
#[derive(Debug, Clone)]
pub(super) enum Mutation {
    Flag {
        base: usize,
        flag: usize,
        how: usize,
    },
    Config {
        key: usize,
        how: usize,
    },
    Manifest {
        key: usize,
        how: usize,
    },
    Tensor {
        tensor: usize,
        how: usize,
    },
    Truncated {
        what: usize,
        cut: f64,
    },
    Image {
        how: usize,
    },
    /// A file the run reads replaced by a FIFO or a folder.
    Special {
        what: usize,
        fifo: bool,
    },
}

pub(super) fn mutation() -> impl Strategy<Value = Mutation> {
    let i = || 0usize..1000;
    prop_oneof![
        9 => (i(), i(), i()).prop_map(|(base, flag, how)| Mutation::Flag { base, flag, how }),
        3 => (i(), i()).prop_map(|(key, how)| Mutation::Config { key, how }),
        2 => (i(), i()).prop_map(|(key, how)| Mutation::Manifest { key, how }),
        3 => (i(), i()).prop_map(|(tensor, how)| Mutation::Tensor { tensor, how }),
        1 => (i(), 0.0f64..1.0).prop_map(|(what, cut)| Mutation::Truncated { what, cut }),
        1 => i().prop_map(|how| Mutation::Image { how }),
        1 => (i(), any::<bool>()).prop_map(|(what, fifo)| Mutation::Special { what, fifo }),
    ]
}

/// A case ready to run.
pub(super) struct Case {
    pub(super) label: String,
    pub(super) args: Vec<String>,
    /// Any one of these in the message names the culprit.
    pub(super) culprits: Vec<String>,
    /// Exit 0 allowed (the change is harmless).
    pub(super) harmless: bool,
    /// Where outputs go (must hold only `outputs` after the run, nothing after an error).
    pub(super) out: PathBuf,
    pub(super) outputs: Vec<String>,
    /// The files the case made (hashed before and after).
    pub(super) inputs: PathBuf,
    /// Where the case's standard output and error go.
    pub(super) logs: PathBuf,
}

/// The value at `key` of `v`, mutable.
pub(super) fn at<'a>(v: &'a mut serde_json::Value, key: &[String]) -> &'a mut serde_json::Value {
    key.iter().fold(v, |v, k| match v {
        serde_json::Value::Array(a) => &mut a[k.parse::<usize>().unwrap()],
        _ => &mut v[k.as_str()],
    })
}

/// Applies JSON change `how` to the leaf `key` of the file `path`; returns its label.
pub(super) fn mutate_json(path: &Path, key: &[String], how: usize) -> String {
    let mut v = read_json(path);
    let label;
    let mut text = None;
    match how % 6 {
        0 => {
            let (last, parent) = key.split_last().unwrap();
            match at(&mut v, parent) {
                serde_json::Value::Object(m) => {
                    m.remove(last);
                }
                serde_json::Value::Array(a) => {
                    a.remove(last.parse::<usize>().unwrap());
                }
                _ => unreachable!(),
            }
            label = "removed";
        }
        1 => {
            let x = at(&mut v, key);
            *x = if x.is_string() {
                serde_json::json!([7])
            } else {
                "seven".into()
            };
            label = "wrong type";
        }
        2 => {
            *at(&mut v, key) = serde_json::json!(1_000_000_000_000_000u64);
            label = "huge";
        }
        3 => {
            *at(&mut v, key) = serde_json::json!(-3);
            label = "negative";
        }
        4 => {
            *at(&mut v, key) = "@NAN@".into();
            text = Some(
                serde_json::to_string_pretty(&v)
                    .unwrap()
                    .replace("\"@NAN@\"", "NaN"),
            );
            label = "NaN";
        }
        _ => {
            *at(&mut v, key) = serde_json::json!(0);
            label = "zero";
        }
    }
    let text = text.unwrap_or_else(|| serde_json::to_string_pretty(&v).unwrap());
    std::fs::write(path, text).unwrap();
    label.to_string()
}

/// `t` cast to another type, given another shape, or given a NaN.
pub(super) fn mutate_tensor(t: &Tensor, how: usize) -> (Tensor, &'static str) {
    let dev = t.device();
    match how % 3 {
        0 => {
            let to = if t.dtype().is_float() {
                DType::I64
            } else {
                DType::F32
            };
            (t.to_dtype(to).unwrap(), "wrong dtype")
        }
        1 => {
            let n = t.elem_count();
            let flat = t.flatten_all().unwrap();
            let wrong = if t.rank() == 1 {
                flat.unsqueeze(0).unwrap()
            } else if n > 1 {
                flat.narrow(0, 0, n - 1).unwrap()
            } else {
                Tensor::cat(&[&flat, &flat], 0).unwrap()
            };
            (wrong, "wrong shape")
        }
        _ => {
            let mut v = t
                .to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let i = how % v.len().max(1);
            if let Some(x) = v.get_mut(i) {
                *x = f32::NAN;
            }
            let back = Tensor::from_vec(v, t.dims(), dev).unwrap();
            (back, "NaN")
        }
    }
}

/// The CRC-32 of PNG chunks.
pub(super) fn crc32(bytes: &[u8]) -> u32 {
    let mut c = 0xffff_ffffu32;
    for &b in bytes {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xedb8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// The PNG `png` with its header's width and height set (and the header's checksum made right again).
pub(super) fn png_size(png: &[u8], w: u32, h: u32) -> Vec<u8> {
    let mut b = png.to_vec();
    // Signature (8), IHDR length (4) and type (4), then width and height.
    b[16..20].copy_from_slice(&w.to_be_bytes());
    b[20..24].copy_from_slice(&h.to_be_bytes());
    let crc = crc32(&b[12..29]);
    b[29..33].copy_from_slice(&crc.to_be_bytes());
    b
}

/// Makes case `n` of mutation `m` in `dir`.
pub(super) fn make(n: usize, m: &Mutation, f: &Fixtures, bases: &[Base]) -> Case {
    let dir = f.root.path().join(format!("case{n}"));
    let inputs = dir.join("in");
    let out = dir.join("out");
    std::fs::create_dir_all(&inputs).unwrap();
    std::fs::create_dir_all(&out).unwrap();
    let mut case = Case {
        label: String::new(),
        args: Vec::new(),
        culprits: Vec::new(),
        harmless: false,
        out: out.clone(),
        outputs: Vec::new(),
        inputs: inputs.clone(),
        logs: dir.clone(),
    };
    match *m {
        Mutation::Flag { base, flag, how } => {
            let b = &bases[base % bases.len()];
            let (name, kind) = b.flags[flag % b.flags.len()];
            // The case's own copies of the inputs, so an output written over one is seen in this case.
            let model = inputs.join("model");
            link_dir(&f.model, &model, "config.json");
            let clean = inputs.join("clean.safetensors");
            std::fs::copy(&f.clean, &clean).unwrap();
            let own = |a: String| {
                for (shared, copy) in [(p(&f.model), p(&model)), (p(&f.clean), p(&clean))] {
                    if a == shared {
                        return copy;
                    }
                    if let Some(rest) = a.strip_prefix(&format!("{shared}/")) {
                        return format!("{copy}/{rest}");
                    }
                }
                a
            };
            let mut args: Vec<String> = (b.args)(f, &out).into_iter().map(own).collect();
            let mut values = bad_values(kind, b.costly, &inputs, f);
            // An output onto a file is refused when the command reads that file (else it is a plain output).
            let reads = |v: &str| {
                let v = own(v.to_string());
                args.iter()
                    .any(|a| v == *a || Path::new(&v).parent() == Some(Path::new(a)))
            };
            if kind == Kind::Output {
                values.retain(|(v, _)| {
                    !v.starts_with(&p(&f.root.path().join("fixtures"))) || reads(v)
                });
            }
            let (value, harmless) = values[how % values.len()].clone();
            let value = own(value);
            // A flag the base already gives is replaced; a flag given twice is another case.
            if let Some(i) = args.iter().position(|a| a == name) {
                args.drain(i..i + 2);
            }
            args.push(format!("{name}={value}"));
            let shown = value.replace(inputs.to_str().unwrap(), "IN");
            case.label = format!("flag {} {name}={shown}", b.name);
            case.culprits = vec![name.to_string()];
            if let Some(file) = Path::new(&value)
                .file_name()
                .filter(|_| value.contains('/'))
            {
                case.culprits.push(file.to_str().unwrap().to_string());
            }
            case.harmless = harmless;
            case.outputs = vec!["d.safetensors".into(), "synth".into()];
            case.args = args;
        }
        Mutation::Config { key, how } => {
            let key = &f.config_keys[key % f.config_keys.len()];
            let model = inputs.join("model");
            link_dir(&f.model, &model, "config.json");
            let what = mutate_json(&model.join("config.json"), key, how);
            case.label = format!("config.json {} {what}", key.join("."));
            case.culprits = vec![key.last().unwrap().clone(), "config.json".into()];
            case.harmless = IGNORED_CONFIG_KEYS.contains(&key[0].as_str())
                || HARMLESS.contains(&case.label.as_str());
            case.args = s(&["ranges", "--model", &p(&model), "--token-ids", "1,2,3"]);
        }
        Mutation::Manifest { key, how } => {
            let key = &f.manifest_keys[key % f.manifest_keys.len()];
            let set = inputs.join("set");
            link_dir(&f.set, &set, "manifest.json");
            let what = mutate_json(&set.join("manifest.json"), key, how);
            case.label = format!("manifest.json {} {what}", key.join("."));
            case.culprits = vec![key.last().unwrap().clone(), "manifest.json".into()];
            let removed = how % 6 == 0;
            case.harmless = key[0] == "export"
                || (removed && OPTIONAL_MANIFEST_KEYS.contains(&key.last().unwrap().as_str()));
            case.args = s(&[
                "dump",
                "--backend",
                "openvino",
                "--ir",
                &p(&set),
                "--token-ids",
                "1,2",
                "--out",
                &p(&out.join("d.safetensors")),
            ]);
            case.outputs = vec!["d.safetensors".into()];
        }
        Mutation::Tensor { tensor, how } => {
            let name = &f.tensors[tensor % f.tensors.len()];
            let mut d = Dump::read(&f.clean).unwrap();
            let (t, what) = mutate_tensor(&d.tensors[name], how);
            d.tensors.insert(name.clone(), t);
            let path = inputs.join("bad.safetensors");
            d.write(&path).unwrap();
            case.label = format!("dump tensor {name} {what}");
            case.culprits = vec![name.clone(), "bad.safetensors".into()];
            case.args = s(&["diff", &p(&path), &p(&f.clean)]);
        }
        Mutation::Truncated { what, cut } => {
            let set_bin = f.set.join("weights.bin");
            let (src, run): (&Path, Args) = match what % 4 {
                0 => (&f.clean, |f, x| s(&["diff", &p(x), &p(&f.clean)])),
                1 => (&f.image, |f, x| {
                    s(&[
                        "run",
                        "--model",
                        &p(&f.vl_model),
                        "--image",
                        &p(x),
                        "--prompt",
                        "hi",
                        "--max-tokens",
                        "1",
                    ])
                }),
                3 => (&set_bin, |f, x| {
                    let set = x.parent().unwrap();
                    link_dir(&f.set, set, "weights.bin");
                    // `IN/m/weights.bin`: the case's outputs go to `IN/../out`.
                    let out = set.parent().unwrap().parent().unwrap().join("out");
                    s(&[
                        "dump",
                        "--backend",
                        "openvino",
                        "--ir",
                        &p(set),
                        "--token-ids",
                        "1,2",
                        "--out",
                        &p(&out.join("d.safetensors")),
                    ])
                }),
                _ => (&f.model.join("model.safetensors"), |f, x| {
                    let model = x.parent().unwrap();
                    link_dir(&f.model, model, "model.safetensors");
                    s(&["ranges", "--model", &p(model), "--token-ids", "1,2,3"])
                }),
            };
            let file = src.file_name().unwrap().to_str().unwrap().to_string();
            let bytes = std::fs::read(src).unwrap();
            // At most 90%: the last bytes of a file may be padding nothing reads.
            let keep = ((bytes.len() as f64) * cut * 0.9) as usize;
            let folder = inputs.join("m");
            let x = folder.join(&file);
            // The model's other files are linked by `run` (which skips the edited one); write the cut file last.
            let args = {
                std::fs::create_dir_all(&folder).unwrap();
                let a = run(f, &x);
                std::fs::write(&x, &bytes[..keep.min(bytes.len() - 1)]).unwrap();
                a
            };
            case.label = format!("truncated {file} at {keep} of {} bytes", bytes.len());
            case.culprits = vec![file];
            case.args = args;
        }
        Mutation::Special { what, fifo } => {
            let files = ["config.json", "tokenizer.json", "model.safetensors"];
            let file = files[what % (files.len() + 1)..].first().copied();
            let (x, args) = match file {
                Some(file) => {
                    let model = inputs.join("model");
                    link_dir(&f.model, &model, file);
                    let run = s(&[
                        "run",
                        "--model",
                        &p(&model),
                        "--prompt",
                        "hi",
                        "--max-tokens",
                        "1",
                    ]);
                    (model.join(file), run)
                }
                None => {
                    let x = inputs.join("d.safetensors");
                    (x.clone(), s(&["diff", &p(&x), &p(&f.clean)]))
                }
            };
            // The copy `link_dir` made of the file is replaced.
            let _ = std::fs::remove_file(&x);
            if fifo {
                mkfifo(&x);
            } else {
                std::fs::create_dir(&x).unwrap();
            }
            let name = x.file_name().unwrap().to_str().unwrap().to_string();
            let kind = if fifo { "a FIFO" } else { "a folder" };
            case.label = format!("special {name} is {kind}");
            case.culprits = vec![name];
            case.args = args;
        }
        Mutation::Image { how } => {
            let png = std::fs::read(&f.image).unwrap();
            let (bytes, what) = match how % 4 {
                0 => (Vec::new(), "empty"),
                1 => (png_size(&png, 0, 16), "zero width"),
                2 => (png_size(&png, 1_000_000, 1_000_000), "huge header size"),
                _ => (png_size(&png, 65536, 8), "65536x8 header"),
            };
            let x = inputs.join("picture.png");
            std::fs::write(&x, bytes).unwrap();
            case.label = format!("image {what}");
            case.culprits = vec!["picture.png".into()];
            case.args = s(&[
                "run",
                "--model",
                &p(&f.vl_model),
                "--image",
                &p(&x),
                "--prompt",
                "hi",
                "--max-tokens",
                "1",
            ]);
        }
    }
    case
}

/// Keys of `config.json` the decoder does not read (transformers' bookkeeping): changing them is harmless.
pub(super) const IGNORED_CONFIG_KEYS: &[&str] = &[
    "architectures",
    "attention_bias",
    "attention_dropout",
    "bos_token_id",
    "dtype",
    "initializer_range",
    "pad_token_id",
    "transformers_version",
    "use_cache",
];

/// Keys of a graph-set manifest whose absence the format gives a meaning (`npu::graphset::manifest`: a port's type
/// and shape by its role, a graph's `.bin` beside its `.xml`, any token count, a padded prompt, no taps, the
/// context from the graphs), and `export` (how the set was made, not read).
pub(super) const OPTIONAL_MANIFEST_KEYS: &[&str] = &[
    "type",
    "shape",
    "output_shape",
    "bin",
    "prompt",
    "taps",
    "context",
];

/// Changes that leave a valid input: a rope base of 10^18 is a number the model can use.
pub(super) const HARMLESS: &[&str] = &[
    "config.json rope_parameters.rope_theta huge",
    // transformers interleaves Qwen3.5's MRoPE sections whether or not the key says so.
    "config.json rope_parameters.mrope_interleaved removed",
];
