//! The architectures a synthetic checkpoint can have, and the dimensions behind each.

use crate::error::{Error, Result};

/// The architecture (and so the dimensions and layout) of a synthetic checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Qwen3.5-9B's real dimensions (SPEC), with the vision tower transformers' `Qwen3_5VisionConfig` defaults to
    /// (27 blocks of width 1152).
    Qwen35_9b,
    /// Qwen3.5-35B-A3B's real dimensions (transformers' `Qwen3_5MoeTextConfig` defaults, which the released config
    /// repeats): hidden 2048, 16 query / 2 KV heads of 256, DeltaNet 16 key / 32 value heads of 128, vocabulary
    /// 248320, and in every layer 256 routed experts of width 512 (8 per token) and a shared expert of width 512; the
    /// same vision tower as the 9B's, its merger out to 2048.
    Qwen35_35bA3b,
    /// The 9B's structure at toy sizes (hidden 64, vocabulary 512), for tests.
    Tiny,
    /// The 35B-A3B's structure at toy sizes (hidden 64, 8 experts, 2 per token), for tests.
    TinyMoe,
}

/// Every architecture with its command-line names, the first being the one [`Arch::name`] gives.
const NAMES: [(Arch, &[&str]); 4] = [
    (Arch::Qwen35_9b, &["qwen3.5-9b", "9b"]),
    (Arch::Qwen35_35bA3b, &["35b-a3b", "qwen3.5-35b-a3b"]),
    (Arch::Tiny, &["tiny"]),
    (Arch::TinyMoe, &["tiny-moe"]),
];

/// The sizes behind an [`Arch`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Dims {
    pub hidden: usize,
    /// The dense MLP's width (unused by an MoE decoder, whose config has none).
    pub intermediate: usize,
    pub vocab: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub linear_key_heads: usize,
    pub linear_value_heads: usize,
    pub linear_key_dim: usize,
    pub linear_value_dim: usize,
    pub conv_kernel: usize,
    pub mrope_section: [usize; 3],
    pub eos: usize,
    pub moe: Option<MoeDims>,
    pub vision: VisionDims,
}

/// The MoE block's sizes.
#[derive(Debug, Clone, Copy)]
pub(super) struct MoeDims {
    pub experts: usize,
    pub per_token: usize,
    pub expert_width: usize,
    pub shared_width: usize,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct VisionDims {
    pub depth: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub patch: usize,
    pub temporal_patch: usize,
    pub merge: usize,
    pub in_channels: usize,
    pub positions: usize,
}

/// The vision tower of both real models.
const REAL_VISION: VisionDims = VisionDims {
    depth: 27,
    hidden: 1152,
    intermediate: 4304,
    heads: 16,
    patch: 16,
    temporal_patch: 2,
    merge: 2,
    in_channels: 3,
    positions: 2304,
};

const TINY_VISION: VisionDims = VisionDims {
    depth: 1,
    hidden: 32,
    intermediate: 64,
    heads: 2,
    patch: 4,
    temporal_patch: 2,
    merge: 2,
    in_channels: 3,
    positions: 16,
};

impl Arch {
    /// The command-line name.
    pub fn name(self) -> &'static str {
        NAMES
            .iter()
            .find(|(a, _)| *a == self)
            .map(|(_, names)| names[0])
            .expect("every architecture is named")
    }

    /// The architecture of a command-line name.
    pub fn parse(name: &str) -> Result<Self> {
        NAMES
            .iter()
            .find(|(_, names)| names.contains(&name))
            .map(|(a, _)| *a)
            .ok_or_else(|| {
                let choices: Vec<String> = NAMES
                    .iter()
                    .map(|(_, names)| format!("`{}`", names[0]))
                    .collect();
                Error::Input(format!(
                    "unknown architecture `{name}` (the choices: {}; the tiny ones are for tests)",
                    choices.join(", ")
                ))
            })
    }

    /// Whether the decoder has the sparse MoE block in place of the dense MLP.
    pub fn is_moe(self) -> bool {
        self.dims().moe.is_some()
    }

    /// The layers of the real model (for the tiny architectures, those of the model they shrink).
    pub fn real_layers(self) -> usize {
        match self {
            Arch::Qwen35_9b | Arch::Tiny => 32,
            Arch::Qwen35_35bA3b | Arch::TinyMoe => 40,
        }
    }

    pub(super) fn dims(self) -> Dims {
        let real = Dims {
            hidden: 4096,
            intermediate: 12288,
            vocab: 248320,
            heads: 16,
            kv_heads: 4,
            head_dim: 256,
            linear_key_heads: 16,
            linear_value_heads: 32,
            linear_key_dim: 128,
            linear_value_dim: 128,
            conv_kernel: 4,
            mrope_section: [11, 11, 10],
            eos: 248044,
            moe: None,
            vision: REAL_VISION,
        };
        let tiny = Dims {
            hidden: 64,
            intermediate: 128,
            vocab: 512,
            heads: 4,
            kv_heads: 1,
            head_dim: 32,
            linear_key_heads: 2,
            linear_value_heads: 4,
            linear_key_dim: 16,
            linear_value_dim: 16,
            conv_kernel: 4,
            mrope_section: [2, 1, 1],
            eos: 511,
            moe: None,
            vision: TINY_VISION,
        };
        match self {
            Arch::Qwen35_9b => real,
            Arch::Qwen35_35bA3b => Dims {
                hidden: 2048,
                intermediate: 0,
                kv_heads: 2,
                moe: Some(MoeDims {
                    experts: 256,
                    per_token: 8,
                    expert_width: 512,
                    shared_width: 512,
                }),
                ..real
            },
            Arch::Tiny => tiny,
            Arch::TinyMoe => Dims {
                intermediate: 0,
                moe: Some(MoeDims {
                    experts: 8,
                    per_token: 2,
                    expert_width: 32,
                    shared_width: 48,
                }),
                ..tiny
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_list_the_choices() {
        for (arch, names) in NAMES {
            for name in names {
                assert_eq!(Arch::parse(name).unwrap(), arch);
            }
            assert_eq!(Arch::parse(arch.name()).unwrap(), arch);
        }
        let e = Arch::parse("huge").unwrap_err().to_string();
        for needle in [
            "`huge`",
            "`qwen3.5-9b`",
            "`35b-a3b`",
            "`tiny`",
            "`tiny-moe`",
        ] {
            assert!(e.contains(needle), "{e}");
        }
        assert!(Arch::Qwen35_35bA3b.is_moe() && Arch::TinyMoe.is_moe());
        assert!(!Arch::Qwen35_9b.is_moe() && !Arch::Tiny.is_moe());
    }
}
