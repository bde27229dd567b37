//! Which weights a run compresses, and how: the [`WeightFormat`] a run asks for (`--weights`) and the [`Storage`]
//! it gives each tensor by its role and shape (the NNCF rules the parent module documents).

use crate::error::{Error, Result};
use crate::schema::Role;
use std::fmt;

/// The default INT4 group size of the OpenVINO exports (`--group-size 128`).
pub const DEFAULT_GROUP: usize = 128;

/// How the weights of a run are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// The checkpoint's values, unchanged.
    F32,
    /// Every tensor rounded to f16 (optimum-intel `--weight-format fp16`).
    F16,
    /// Projections INT4 symmetric in groups of `group` inputs, embedding and LM head INT8 symmetric per row
    /// (optimum-intel `--weight-format int4 --sym --group-size G --ratio 1.0 --backup-precision int8_sym`).
    Int4Sym {
        /// Inputs sharing one scale (128 in the exports).
        group: usize,
    },
    /// [`WeightFormat::Int4Sym`] as NNCF applies it to an optimum-intel export, where the DeltaNet short
    /// convolution is a `GroupConvolution`: its weights get the INT8 backup too (per channel, over the `K` taps).
    Int4Nncf {
        /// Inputs sharing one scale.
        group: usize,
    },
}

impl Default for WeightFormat {
    /// [`WeightFormat::F32`].
    fn default() -> Self {
        WeightFormat::F32
    }
}

impl WeightFormat {
    /// `f32`, `f16`, `int4` (group 128), `int4:G`, `int4-nncf` (group 128) or `int4-nncf:G`: the form
    /// [`WeightFormat::parse`] reads.
    pub fn name(&self) -> String {
        match self {
            WeightFormat::F32 => "f32".into(),
            WeightFormat::F16 => "f16".into(),
            WeightFormat::Int4Sym { group } if *group == DEFAULT_GROUP => "int4".into(),
            WeightFormat::Int4Sym { group } => format!("int4:{group}"),
            WeightFormat::Int4Nncf { group } if *group == DEFAULT_GROUP => "int4-nncf".into(),
            WeightFormat::Int4Nncf { group } => format!("int4-nncf:{group}"),
        }
    }

    /// Reads `f32`, `f16`, `int4` (INT4 symmetric, group 128), `int4:G` (group `G` ≥ 1), or `int4-nncf` /
    /// `int4-nncf:G` (the same with INT8 conv weights, as NNCF compresses an optimum-intel export).
    pub fn parse(text: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::Input(format!(
                "weight format `{text}`: {why} (expected f32, f16, int4, int4:GROUP, int4-nncf or \
                 int4-nncf:GROUP)"
            ))
        };
        let group_of = |g: Option<&str>| -> Result<usize> {
            let Some(g) = g else {
                return Ok(DEFAULT_GROUP);
            };
            let group: usize = g
                .parse()
                .map_err(|_| bad("the group size is not a whole number"))?;
            if group == 0 {
                return Err(bad("the group size must be at least 1"));
            }
            Ok(group)
        };
        let text = text.trim();
        let (kind, group) = match text.split_once(':') {
            Some((kind, group)) => (kind, Some(group)),
            None => (text, None),
        };
        match (kind, group) {
            ("f32", None) => Ok(WeightFormat::F32),
            ("f16", None) => Ok(WeightFormat::F16),
            ("int4", g) => Ok(WeightFormat::Int4Sym {
                group: group_of(g)?,
            }),
            ("int4-nncf", g) => Ok(WeightFormat::Int4Nncf {
                group: group_of(g)?,
            }),
            _ => Err(bad("unknown format")),
        }
    }

    /// Checks the parameters (an INT4 group size of at least 1).
    pub fn validate(&self) -> Result<()> {
        match self {
            WeightFormat::Int4Sym { group: 0 } | WeightFormat::Int4Nncf { group: 0 } => {
                Err(Error::Input(format!(
                    "weight format {}: the group size must be at least 1",
                    self.name()
                )))
            }
            _ => Ok(()),
        }
    }

    /// How a tensor of this role and shape is stored in this format.
    ///
    /// Under [`WeightFormat::Int4Sym`]: projections (`[out, in]`) are INT4 when their input width is a multiple of
    /// the group, INT8 otherwise; the token embedding and the LM head are INT8; everything else (norm weights,
    /// `A_log`, `dt_bias`, conv weights) stays float. [`WeightFormat::Int4Nncf`] is the same except that the conv
    /// weights `[C, 1, K]` are INT8 (one scale per channel). Under [`WeightFormat::F16`] every tensor is rounded to
    /// f16; under [`WeightFormat::F32`] nothing changes.
    pub fn storage(&self, role: Role, shape: &[usize]) -> Storage {
        match self {
            WeightFormat::F32 => Storage::Float,
            WeightFormat::F16 => Storage::F16,
            WeightFormat::Int4Nncf { .. } if matches!((role, shape), (Role::Conv, [_, 1, _])) => {
                Storage::Int8Sym
            }
            WeightFormat::Int4Sym { group } | WeightFormat::Int4Nncf { group } => {
                match (role, shape) {
                    (Role::Embedding | Role::LmHead, [_, _]) => Storage::Int8Sym,
                    (Role::Projection, [_, cols]) if *group > 0 && cols.is_multiple_of(*group) => {
                        Storage::Int4Sym { group: *group }
                    }
                    (Role::Projection, [_, _]) => Storage::Int8Sym,
                    _ => Storage::Float,
                }
            }
        }
    }
}

impl fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

impl std::str::FromStr for WeightFormat {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        WeightFormat::parse(s)
    }
}

/// How one tensor is stored under a [`WeightFormat`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Storage {
    /// The checkpoint's values, unchanged.
    Float,
    /// Rounded to f16 (to nearest even, magnitudes beyond 65504 clamped to 65504).
    F16,
    /// INT4 symmetric, one f16 scale per `group` consecutive inputs of a row.
    Int4Sym {
        /// Inputs sharing one scale.
        group: usize,
    },
    /// INT8 symmetric, one f16 scale per output row.
    Int8Sym,
}

impl Storage {
    /// The bytes a tensor of `shape` takes stored this way, `float` bytes per value when it keeps the checkpoint's
    /// values (4 in an f32 graph or run): INT4 codes two to a byte (a row starting on a byte) and INT8 codes one,
    /// with their f16 scales (a matrix's rows are its first axis, its inputs the last).
    pub fn bytes(&self, shape: &[usize], float: u64) -> u64 {
        let numel: u64 = shape.iter().map(|&d| d as u64).product();
        let cols = shape.last().map_or(1, |&c| c as u64).max(1);
        let rows = numel / cols;
        match self {
            Storage::Float => numel * float,
            Storage::F16 => numel * 2,
            Storage::Int4Sym { group } => {
                rows * cols.div_ceil(2) + 2 * rows * cols.div_ceil((*group).max(1) as u64)
            }
            Storage::Int8Sym => rows * cols + 2 * rows,
        }
    }
}

impl Storage {
    /// Whether the tensor is stored as integer codes and scales.
    pub fn is_quantized(&self) -> bool {
        matches!(self, Storage::Int4Sym { .. } | Storage::Int8Sym)
    }
}
