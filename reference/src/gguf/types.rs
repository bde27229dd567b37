//! The ggml tensor types a GGUF file may name: every id current ggml defines (`enum ggml_type` in `ggml.h`, and
//! `GGMLQuantizationType` / `GGML_QUANT_SIZES` in the `gguf` Python package), with its name, the elements of one
//! block and the bytes one block takes. The ids ggml removed (4 and 5, the old `Q4_2`/`Q4_3`; 31 to 33 and 36 to
//! 38, the repacked `Q4_0_x_y` / `IQ4_NL_x_y` layouts that GGUF files no longer hold) are known by name and refused
//! as unsupported; any other id is unknown. Both refusals are errors naming the id, never a panic.
//!
//! A tensor of `n` elements along its fastest dimension (`ne[0]`) takes `n / block_elems` blocks per row, so `ne[0]`
//! must be a multiple of [`GgmlType::block_elems`]: [`GgmlType::row_bytes`] checks it.

use std::fmt;

/// The number of elements in one super-block of the K-quants and most IQ types (`QK_K`).
pub const QK_K: usize = 256;

/// A ggml tensor type that this crate knows how to size (every type current ggml writes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// 4-bit, blocks of 32 with an f16 scale.
    Q4_0,
    /// 4-bit, blocks of 32 with an f16 scale and minimum.
    Q4_1,
    /// 5-bit, blocks of 32 with an f16 scale.
    Q5_0,
    /// 5-bit, blocks of 32 with an f16 scale and minimum.
    Q5_1,
    /// 8-bit, blocks of 32 with an f16 scale.
    Q8_0,
    /// 8-bit, blocks of 32 with an f16 scale and the block's sum (an activation type).
    Q8_1,
    /// 2-bit K-quant (super-blocks of 256).
    Q2_K,
    /// 3-bit K-quant.
    Q3_K,
    /// 4-bit K-quant.
    Q4_K,
    /// 5-bit K-quant.
    Q5_K,
    /// 6-bit K-quant.
    Q6_K,
    /// 8-bit K-quant with an f32 scale and partial sums (an activation type).
    Q8_K,
    /// 2.06 bits per weight, lattice codebook.
    IQ2_XXS,
    /// 2.31 bits per weight, lattice codebook.
    IQ2_XS,
    /// 3.06 bits per weight, lattice codebook.
    IQ3_XXS,
    /// 1.56 bits per weight.
    IQ1_S,
    /// 4-bit non-linear, blocks of 32.
    IQ4_NL,
    /// 3.44 bits per weight.
    IQ3_S,
    /// 2.5 bits per weight.
    IQ2_S,
    /// 4.25 bits per weight, non-linear, super-blocks of 256.
    IQ4_XS,
    /// 8-bit integer.
    I8,
    /// 16-bit integer.
    I16,
    /// 32-bit integer.
    I32,
    /// 64-bit integer.
    I64,
    /// 64-bit IEEE float.
    F64,
    /// 1.75 bits per weight.
    IQ1_M,
    /// bfloat16.
    BF16,
    /// Ternary, 1.69 bits per weight.
    TQ1_0,
    /// Ternary, 2.06 bits per weight.
    TQ2_0,
    /// Microscaling FP4 (E2M1 values, one E8M0 scale per 32).
    MXFP4,
    /// NVIDIA FP4 (E2M1 values, one E4M3 scale per 16; blocks of 64).
    NVFP4,
    /// 1-bit, blocks of 128 with an f16 scale.
    Q1_0,
    /// 2-bit, blocks of 64 with an f16 scale.
    Q2_0,
}

/// Every type of [`GgmlType`], in the order of their ids.
pub const ALL: [GgmlType; 35] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q8_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_K,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ3_XXS,
    GgmlType::IQ1_S,
    GgmlType::IQ4_NL,
    GgmlType::IQ3_S,
    GgmlType::IQ2_S,
    GgmlType::IQ4_XS,
    GgmlType::I8,
    GgmlType::I16,
    GgmlType::I32,
    GgmlType::I64,
    GgmlType::F64,
    GgmlType::IQ1_M,
    GgmlType::BF16,
    GgmlType::TQ1_0,
    GgmlType::TQ2_0,
    GgmlType::MXFP4,
    GgmlType::NVFP4,
    GgmlType::Q1_0,
    GgmlType::Q2_0,
];

/// Why a type id read from a file is not a [`GgmlType`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TypeIdError {
    /// An id ggml once defined and removed (its name given).
    Removed {
        /// The id.
        id: u32,
        /// ggml's old name for it.
        name: &'static str,
    },
    /// An id no ggml version this crate knows defines.
    Unknown(u32),
}

impl fmt::Display for TypeIdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TypeIdError::Removed { id, name } => write!(
                f,
                "ggml type {id} ({name}) is unsupported: ggml removed it and no current GGUF file holds it"
            ),
            TypeIdError::Unknown(id) => write!(
                f,
                "ggml type {id} is unknown (the types known are 0 to 42 but for the removed 4, 5, 31-33 and 36-38)"
            ),
        }
    }
}

/// The ids ggml removed, with their old names.
const REMOVED: [(u32, &str); 8] = [
    (4, "Q4_2"),
    (5, "Q4_3"),
    (31, "Q4_0_4_4"),
    (32, "Q4_0_4_8"),
    (33, "Q4_0_8_8"),
    (36, "IQ4_NL_4_4"),
    (37, "IQ4_NL_4_8"),
    (38, "IQ4_NL_8_8"),
];

impl GgmlType {
    /// The type of a ggml id, or why there is none.
    pub fn from_id(id: u32) -> Result<Self, TypeIdError> {
        if let Some(ty) = ALL.iter().find(|ty| ty.id() == id) {
            return Ok(*ty);
        }
        match REMOVED.iter().find(|(removed, _)| *removed == id) {
            Some(&(id, name)) => Err(TypeIdError::Removed { id, name }),
            None => Err(TypeIdError::Unknown(id)),
        }
    }

    /// ggml's id of the type (`GGML_TYPE_*`).
    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2_K => 10,
            Q3_K => 11,
            Q4_K => 12,
            Q5_K => 13,
            Q6_K => 14,
            Q8_K => 15,
            IQ2_XXS => 16,
            IQ2_XS => 17,
            IQ3_XXS => 18,
            IQ1_S => 19,
            IQ4_NL => 20,
            IQ3_S => 21,
            IQ2_S => 22,
            IQ4_XS => 23,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            IQ1_M => 29,
            BF16 => 30,
            TQ1_0 => 34,
            TQ2_0 => 35,
            MXFP4 => 39,
            NVFP4 => 40,
            Q1_0 => 41,
            Q2_0 => 42,
        }
    }

    /// ggml's name of the type (`ggml_type_name`: `f32`, `q4_K`, `iq2_xxs`, ...).
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "f32",
            F16 => "f16",
            Q4_0 => "q4_0",
            Q4_1 => "q4_1",
            Q5_0 => "q5_0",
            Q5_1 => "q5_1",
            Q8_0 => "q8_0",
            Q8_1 => "q8_1",
            Q2_K => "q2_K",
            Q3_K => "q3_K",
            Q4_K => "q4_K",
            Q5_K => "q5_K",
            Q6_K => "q6_K",
            Q8_K => "q8_K",
            IQ2_XXS => "iq2_xxs",
            IQ2_XS => "iq2_xs",
            IQ3_XXS => "iq3_xxs",
            IQ1_S => "iq1_s",
            IQ4_NL => "iq4_nl",
            IQ3_S => "iq3_s",
            IQ2_S => "iq2_s",
            IQ4_XS => "iq4_xs",
            I8 => "i8",
            I16 => "i16",
            I32 => "i32",
            I64 => "i64",
            F64 => "f64",
            IQ1_M => "iq1_m",
            BF16 => "bf16",
            TQ1_0 => "tq1_0",
            TQ2_0 => "tq2_0",
            MXFP4 => "mxfp4",
            NVFP4 => "nvfp4",
            Q1_0 => "q1_0",
            Q2_0 => "q2_0",
        }
    }

    /// The elements one block holds (1 for the plain float and integer types).
    pub fn block_elems(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | F64 | I8 | I16 | I32 | I64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | IQ4_NL | MXFP4 => 32,
            NVFP4 | Q2_0 => 64,
            Q1_0 => 128,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S
            | IQ3_S | IQ2_S | IQ4_XS | IQ1_M | TQ1_0 | TQ2_0 => QK_K,
        }
    }

    /// The bytes one block takes (`sizeof(block_*)` in `ggml-common.h`).
    pub fn block_bytes(self) -> usize {
        use GgmlType::*;
        match self {
            F32 => 4,
            F16 | BF16 => 2,
            F64 => 8,
            I8 => 1,
            I16 => 2,
            I32 => 4,
            I64 => 8,
            Q4_0 => 2 + 16,
            Q4_1 => 2 + 2 + 16,
            Q5_0 => 2 + 4 + 16,
            Q5_1 => 2 + 2 + 4 + 16,
            Q8_0 => 2 + 32,
            Q8_1 => 2 + 2 + 32,
            Q2_K => 2 + 2 + QK_K / 16 + QK_K / 4,
            Q3_K => 2 + QK_K / 4 + QK_K / 8 + 12,
            Q4_K => 2 + 2 + QK_K / 2 + 12,
            Q5_K => 2 + 2 + QK_K / 2 + QK_K / 8 + 12,
            Q6_K => 2 + QK_K / 2 + QK_K / 4 + QK_K / 16,
            Q8_K => 4 + QK_K + QK_K / 8,
            IQ2_XXS => 2 + QK_K / 4,
            IQ2_XS => 2 + QK_K / 4 + QK_K / 32,
            IQ3_XXS => 2 + QK_K / 4 + QK_K / 8,
            IQ1_S => 2 + QK_K / 8 + QK_K / 16,
            IQ4_NL => 2 + 16,
            IQ3_S => 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4,
            IQ2_S => 2 + QK_K / 4 + QK_K / 16,
            IQ4_XS => 2 + 2 + QK_K / 2 + QK_K / 64,
            IQ1_M => QK_K / 8 + QK_K / 16 + QK_K / 32,
            TQ1_0 => 2 + 4 * 13,
            TQ2_0 => 2 + 64,
            MXFP4 => 1 + 16,
            NVFP4 => 4 + 32,
            Q1_0 => 2 + 16,
            Q2_0 => 2 + 16,
        }
    }

    /// Whether the type is a plain float (F32, F16, BF16, F64): one element per block, no scale.
    pub fn is_float(self) -> bool {
        matches!(
            self,
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::F64
        )
    }

    /// The bytes of a row of `elems` elements, or why it has none: `elems` must be a whole number of blocks.
    pub fn row_bytes(self, elems: u64) -> Result<u64, String> {
        let block = self.block_elems() as u64;
        if !elems.is_multiple_of(block) {
            return Err(format!(
                "a row of {elems} elements is not a whole number of {} blocks of {block}",
                self.name()
            ));
        }
        (elems / block)
            .checked_mul(self.block_bytes() as u64)
            .ok_or_else(|| {
                format!(
                    "a row of {elems} {} elements overflows the byte count",
                    self.name()
                )
            })
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_id_round_trips_and_the_gaps_are_the_removed_ones() {
        for id in 0..64u32 {
            match GgmlType::from_id(id) {
                Ok(ty) => assert_eq!(ty.id(), id),
                Err(TypeIdError::Removed { id: removed, .. }) => {
                    assert_eq!(removed, id);
                    assert!([4, 5, 31, 32, 33, 36, 37, 38].contains(&id));
                }
                Err(TypeIdError::Unknown(unknown)) => assert!(unknown >= 43, "{unknown}"),
            }
        }
        let mut ids: Vec<u32> = ALL.iter().map(|ty| ty.id()).collect();
        ids.dedup();
        assert_eq!(ids.len(), ALL.len());
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn block_sizes_are_ggmls() {
        // The `sizeof(block_*)` values ggml's static asserts hold, written out.
        let expected = [
            (GgmlType::Q4_0, 32, 18),
            (GgmlType::Q8_0, 32, 34),
            (GgmlType::Q2_K, 256, 84),
            (GgmlType::Q3_K, 256, 110),
            (GgmlType::Q4_K, 256, 144),
            (GgmlType::Q5_K, 256, 176),
            (GgmlType::Q6_K, 256, 210),
            (GgmlType::Q8_K, 256, 292),
            (GgmlType::IQ2_XXS, 256, 66),
            (GgmlType::IQ2_XS, 256, 74),
            (GgmlType::IQ3_XXS, 256, 98),
            (GgmlType::IQ1_S, 256, 50),
            (GgmlType::IQ3_S, 256, 110),
            (GgmlType::IQ2_S, 256, 82),
            (GgmlType::IQ4_XS, 256, 136),
            (GgmlType::IQ1_M, 256, 56),
            (GgmlType::TQ1_0, 256, 54),
            (GgmlType::TQ2_0, 256, 66),
            (GgmlType::MXFP4, 32, 17),
            (GgmlType::NVFP4, 64, 36),
            (GgmlType::Q1_0, 128, 18),
            (GgmlType::Q2_0, 64, 18),
        ];
        for (ty, elems, bytes) in expected {
            assert_eq!((ty.block_elems(), ty.block_bytes()), (elems, bytes), "{ty}");
        }
    }

    #[test]
    fn a_row_must_be_whole_blocks() {
        assert_eq!(GgmlType::Q4_K.row_bytes(512), Ok(288));
        assert!(GgmlType::Q4_K.row_bytes(100).unwrap_err().contains("q4_K"));
        assert_eq!(GgmlType::F16.row_bytes(3), Ok(6));
    }
}
