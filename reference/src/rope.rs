//! Partial rotary position embedding with interleaved MRoPE sections.
//!
//! Only the first `rotary_dim` dimensions of each head rotate (rotate-half on that slice); the rest pass through.
//! Frequency `i` (of `rotary_dim / 2`) takes its position from the temporal row, except that indices `i ≡ 1 (mod 3)`
//! below `3 · section[1]` take the height row and `i ≡ 2 (mod 3)` below `3 · section[2]` the width row. For text the
//! three rows are equal and this is plain RoPE at the token's absolute position.

use crate::config::Config;
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};

/// Positions of the tokens of one forward call: temporal, height and width rows (equal for text).
#[derive(Debug, Clone, PartialEq)]
pub struct Positions(pub [Vec<i64>; 3]);

impl Positions {
    /// Text positions `start, start + 1, …` for `len` tokens.
    pub fn text(start: usize, len: usize) -> Self {
        let row: Vec<i64> = (start..start + len).map(|p| p as i64).collect();
        Positions([row.clone(), row.clone(), row])
    }

    /// The text position after these (the largest on any row, plus 1), where the following text continues.
    pub fn next_text(&self) -> i64 {
        self.0
            .iter()
            .flat_map(|r| r.iter())
            .copied()
            .max()
            .unwrap_or(-1)
            + 1
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.0[0].len()
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The rotary embedding of the full-attention layers.
#[derive(Debug, Clone)]
pub struct Rope {
    /// `theta^(-2i / rotary_dim)`, rounded to f32 as the checkpoint defines it (exact in f32 and f64).
    inv_freq: Vec<f64>,
    rotary_dim: usize,
    section: Option<[usize; 3]>,
}

impl Rope {
    /// Builds the embedding from the config's `rope_parameters`.
    pub fn new(config: &Config) -> Self {
        let rd = config.rotary_dim();
        // The checkpoint's convention (transformers' buffer): exponent, power and reciprocal rounded to f32.
        let inv_freq = (0..rd / 2)
            .map(|i| {
                let exponent = (2 * i) as f32 / rd as f32;
                let power = config.rope.theta.powf(exponent as f64) as f32;
                (1.0f32 / power) as f64
            })
            .collect();
        Rope {
            inv_freq,
            rotary_dim: rd,
            section: config.rope.mrope_section,
        }
    }

    /// Rotated dimensions per head.
    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    /// `inv_freq` of frequency `i` (of `rotary_dim / 2`).
    pub fn inv_freq(&self, i: usize) -> f64 {
        self.inv_freq[i]
    }

    /// Which position row (0 temporal, 1 height, 2 width) frequency `i` reads.
    pub fn row_of(&self, i: usize) -> usize {
        match self.section {
            Some(s) if i % 3 == 1 && i < 3 * s[1] => 1,
            Some(s) if i % 3 == 2 && i < 3 * s[2] => 2,
            _ => 0,
        }
    }

    /// The cos/sin tables `[T, rotary_dim]` of these positions, in `dtype`.
    pub fn tables(
        &self,
        positions: &Positions,
        dtype: DType,
        dev: &Device,
    ) -> Result<RotaryTables> {
        let rows = &positions.0;
        let t = rows[0].len();
        if rows[1].len() != t || rows[2].len() != t {
            return Err(Error::Input("position rows have different lengths".into()));
        }
        if self.section.is_none() && (rows[1] != rows[0] || rows[2] != rows[0]) {
            return Err(Error::Input(
                "multimodal positions (rows differ) need rope_parameters.mrope_section in the config".into(),
            ));
        }
        // angle[t, i] = position[row(i)][t] · inv_freq[i], multiplied in the run's dtype: in f32 that is exactly
        // transformers' f32 product (positions below 2^24 and the f32 inv_freq are exact in any float dtype).
        let half = self.rotary_dim / 2;
        let selected: Vec<f64> = (0..t * half)
            .map(|idx| rows[self.row_of(idx % half)][idx / half] as f64)
            .collect();
        let pos = Tensor::from_vec(selected, (t, half), dev)?.to_dtype(dtype)?;
        let inv = Tensor::from_vec(self.inv_freq.clone(), half, dev)?.to_dtype(dtype)?;
        let angles = pos.broadcast_mul(&inv)?;
        let angles = Tensor::cat(&[&angles, &angles], 1)?;
        Ok(RotaryTables {
            rotary_dim: self.rotary_dim,
            cos: angles.cos()?,
            sin: angles.sin()?,
        })
    }
}

/// The rotation of one forward call's tokens.
#[derive(Debug, Clone)]
pub struct RotaryTables {
    rotary_dim: usize,
    /// `cos` of every angle, `[T, rotary_dim]` (each frequency twice, rotate-half layout).
    pub cos: Tensor,
    /// `sin` of every angle, `[T, rotary_dim]`.
    pub sin: Tensor,
}

impl RotaryTables {
    /// Rotates the first `rotary_dim` dimensions of `x` `[T, heads, D]`; the rest pass through unchanged.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let (t, _, d) = x.dims3()?;
        let rd = self.rotary_dim;
        let (cos, sin) = (&self.cos, &self.sin);
        let x_rot = x.narrow(2, 0, rd)?;
        let x1 = x_rot.narrow(2, 0, rd / 2)?;
        let x2 = x_rot.narrow(2, rd / 2, rd / 2)?;
        let rotated_half = Tensor::cat(&[&x2.neg()?, &x1], 2)?;
        let cos = cos.reshape((t, 1, rd))?;
        let sin = sin.reshape((t, 1, rd))?;
        let out = (x_rot.broadcast_mul(&cos)? + rotated_half.broadcast_mul(&sin)?)?;
        if rd == d {
            Ok(out)
        } else {
            Ok(Tensor::cat(&[&out, &x.narrow(2, rd, d - rd)?], 2)?)
        }
    }
}
