//! The valid commands a case starts from, the flags it may change, and the bad values each kind of flag takes.

use super::*;

/// What a flag takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Kind {
    /// A count: zero is harmless when `zero_ok`.
    Count { zero_ok: bool },
    /// A real number (a threshold, a scale).
    Real,
    /// Free text with a syntax (token ids, a format).
    Text,
    /// A file or folder the run reads.
    Input,
    /// A file the run writes.
    Output,
}

/// A command's arguments, from the fixtures and a path.
pub(super) type Args = fn(&Fixtures, &Path) -> Vec<String>;

/// A valid command and the flags a case may change (or add).
pub(super) struct Base {
    pub(super) name: &'static str,
    pub(super) args: Args,
    pub(super) flags: &'static [(&'static str, Kind)],
    /// Whether a valid value runs the whole thing (then only values refused before any work are drawn).
    pub(super) costly: bool,
}

pub(super) const COUNT: Kind = Kind::Count { zero_ok: false };
pub(super) const COUNT0: Kind = Kind::Count { zero_ok: true };

pub(super) fn bases() -> Vec<Base> {
    vec![
        Base {
            name: "diff",
            args: |f, _| s(&["diff", &p(&f.clean), &p(&f.clean)]),
            flags: &[
                ("--max-nmse", Kind::Real),
                ("--max-kl", Kind::Real),
                ("--min-token-agreement", Kind::Real),
                ("--max-confident-flips", COUNT0),
                ("--max-layer-nrmse", Kind::Real),
                ("--max-state-nrmse", Kind::Real),
                ("--router-tolerance", Kind::Real),
                ("--model", Kind::Input),
                ("--json", Kind::Output),
                ("--report", Kind::Output),
                ("--plot", Kind::Output),
            ],
            costly: false,
        },
        Base {
            name: "dump",
            args: |f, out| {
                s(&[
                    "dump",
                    "--model",
                    &p(&f.model),
                    "--token-ids",
                    "1,2,3",
                    "--generate",
                    "2",
                    "--out",
                    &p(&out.join("d.safetensors")),
                ])
            },
            flags: &[
                ("--generate", COUNT0),
                ("--token-ids", Kind::Text),
                ("--prefill-block", COUNT),
                ("--output-scale", Kind::Real),
                ("--weights", Kind::Text),
                ("--model", Kind::Input),
                ("--out", Kind::Output),
            ],
            costly: false,
        },
        Base {
            name: "run (vision)",
            args: |f, _| {
                s(&[
                    "run",
                    "--model",
                    &p(&f.vl_model),
                    "--image",
                    &p(&f.image),
                    "--prompt",
                    "hi",
                    "--max-tokens",
                    "1",
                ])
            },
            flags: &[
                ("--image", Kind::Input),
                ("--pixel-values", Kind::Input),
                ("--image-size", Kind::Text),
            ],
            costly: false,
        },
        Base {
            name: "run",
            args: |f, _| {
                s(&[
                    "run",
                    "--model",
                    &p(&f.model),
                    "--prompt",
                    "hi",
                    "--max-tokens",
                    "2",
                ])
            },
            flags: &[
                ("--max-tokens", COUNT0),
                ("--output-scale", Kind::Real),
                ("--model", Kind::Input),
            ],
            costly: false,
        },
        Base {
            name: "ranges",
            args: |f, _| s(&["ranges", "--model", &p(&f.model), "--token-ids", "1,2,3"]),
            flags: &[
                ("--store", Kind::Text),
                ("--output-scale", Kind::Real),
                ("--model", Kind::Input),
                ("--json", Kind::Output),
            ],
            costly: false,
        },
        Base {
            name: "validate",
            args: |f, _| s(&["validate", "--model", &p(&f.model), "--device", "CPU"]),
            flags: &[
                ("--tokens", COUNT),
                ("--context", COUNT),
                ("--lookup-tokens", COUNT),
                ("--blocks", Kind::Text),
                ("--prompts", Kind::Input),
            ],
            costly: true,
        },
        Base {
            name: "compare-devices",
            args: |f, _| s(&["compare-devices", "--model", &p(&f.model)]),
            flags: &[
                ("--tokens", COUNT),
                ("--max-kl", Kind::Real),
                ("--ir", Kind::Input),
            ],
            costly: true,
        },
        Base {
            name: "compare-devices (set)",
            args: |f, _| s(&["compare-devices", "--ir", &p(&f.set), "--device", "CPU"]),
            flags: &[
                ("--tokens", COUNT),
                ("--json", Kind::Output),
                ("--report", Kind::Output),
            ],
            costly: true,
        },
        Base {
            name: "bench",
            args: |f, _| s(&["bench", "--model", &p(&f.model), "--no-machine"]),
            flags: &[("--decode-tokens", COUNT), ("--prompt-tokens", COUNT)],
            costly: true,
        },
        Base {
            name: "synth",
            args: |_, out| s(&["synth", "--out", &p(&out.join("synth"))]),
            flags: &[("--layers", COUNT), ("--seed", Kind::Text)],
            costly: true,
        },
    ]
}

/// The bad values of a flag of `kind`, some only for cheap commands.
pub(super) fn bad_values(
    kind: Kind,
    costly: bool,
    dir: &Path,
    f: &Fixtures,
) -> Vec<(String, bool)> {
    let huge = "99999999999999999999999".to_string();
    let v = |x: &str| (x.to_string(), false);
    match kind {
        Kind::Count { zero_ok } => {
            let mut all = vec![v("-1"), v("abc"), v(""), v("1.5"), (huge, false)];
            if !costly {
                all.push(("0".into(), zero_ok));
            }
            all
        }
        Kind::Real => vec![v("-1"), v("NaN"), v("abc"), v(""), v("-inf")],
        Kind::Text => vec![v(""), v("x,y"), v("-1"), (huge, false)],
        Kind::Input => {
            let dir_in = dir.join("a-folder");
            std::fs::create_dir_all(&dir_in).unwrap();
            let empty = dir.join("empty.safetensors");
            std::fs::write(&empty, b"").unwrap();
            // A FIFO would block a run that opened it until something wrote to it: refused unread.
            let fifo = dir.join("a-fifo");
            mkfifo(&fifo);
            vec![
                (p(&dir.join("missing")), false),
                (p(&dir_in), false),
                (p(&fifo), false),
                (p(&empty), false),
                (p(&f.clean), false),
            ]
        }
        // The command's own inputs among them: `make` keeps only those the base reads.
        Kind::Output => vec![
            (p(&dir.join("no-such-folder/x.json")), false),
            (p(dir), false),
            (p(&f.model.join("config.json")), false),
            (p(&f.clean), false),
            // Read by OpenVINO as the manifest says, not opened by a flag.
            (p(&f.set.join("weights.bin")), false),
        ],
    }
}
