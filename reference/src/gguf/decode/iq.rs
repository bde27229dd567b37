//! The IQ types' block decoders, from ggml's formulas (`dequantize_row_iq*` in `ggml-quants.c`): each takes one
//! block's bytes (ggml's `block_iq*` layout, little-endian) and writes its `QK_K` (IQ4_NL: 32) values. The products
//! are ggml's, in ggml's order (`db * grid[j] * sign`: float multiplications do not associate), so the bits agree.
//!
//! Layouts (bytes): IQ2_XXS `d | qs u16[32]`; IQ2_XS `d | qs u16[32] | scales[8]`; IQ2_S `d | qs[32] | signs[32] |
//! qh[8] | scales[8]`; IQ3_XXS `d | qs[64] | scales_and_signs[32]`; IQ3_S `d | qs[64] | qh[8] | signs[32] |
//! scales[4]`; IQ1_S `d | qs[32] | qh u16[8]`; IQ1_M `qs[32] | qh[16] | scales[8]` (the f16 scale in the top nibbles
//! of the four u16 scale words); IQ4_NL `d | qs[16]`; IQ4_XS `d | scales_h u16 | scales_l[4] | qs[128]`.

use super::f16_at;
use super::grids::{IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID};

/// ggml's `kvalues_iq4nl`: the 16 non-linear levels of IQ4_NL and IQ4_XS.
const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The shift added to every IQ1 grid value, by the sign of its group (`IQ1S_DELTA`).
const IQ1S_DELTA: f32 = 0.125;

/// ggml's `ksigns_iq2xs`: 7 stored sign bits and an eighth that makes the count of minus signs even.
fn ksigns(index: u32) -> u8 {
    let low = (index & 0x7f) as u8;
    low | (((low.count_ones() & 1) as u8) << 7)
}

/// `-1.0` where bit `j` of `signs` is set, `1.0` elsewhere.
fn sign(signs: u8, j: usize) -> f32 {
    if signs & (1 << j) != 0 { -1.0 } else { 1.0 }
}

fn u32_at(block: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]])
}

fn u16_at(block: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([block[at], block[at + 1]])
}

/// Element `j` of an 8-byte grid entry, as an unsigned byte.
fn byte(entry: u64, j: usize) -> f32 {
    f32::from((entry >> (8 * j)) as u8)
}

/// IQ2_XXS: 2.06 bits per weight.
pub(crate) fn iq2_xxs(block: &[u8], y: &mut [f32]) {
    let d = f16_at(block, 0);
    for ib32 in 0..8 {
        let at = 2 + 8 * ib32;
        let indices = &block[at..at + 4];
        let aux = u32_at(block, at + 4);
        let db = d * (0.5 + (aux >> 28) as f32) * 0.25;
        for l in 0..4 {
            let grid = IQ2XXS_GRID[indices[l] as usize];
            let signs = ksigns(aux >> (7 * l));
            let out = &mut y[32 * ib32 + 8 * l..][..8];
            for (j, value) in out.iter_mut().enumerate() {
                *value = db * byte(grid, j) * sign(signs, j);
            }
        }
    }
}

/// IQ2_XS: 2.31 bits per weight.
pub(crate) fn iq2_xs(block: &[u8], y: &mut [f32]) {
    let d = f16_at(block, 0);
    for ib32 in 0..8 {
        let scale = block[66 + ib32];
        let db = [
            d * (0.5 + (scale & 0xf) as f32) * 0.25,
            d * (0.5 + (scale >> 4) as f32) * 0.25,
        ];
        for l in 0..4 {
            let q = u16_at(block, 2 + 2 * (4 * ib32 + l));
            let grid = IQ2XS_GRID[(q & 511) as usize];
            let signs = ksigns(u32::from(q >> 9));
            let out = &mut y[32 * ib32 + 8 * l..][..8];
            for (j, value) in out.iter_mut().enumerate() {
                *value = db[l / 2] * byte(grid, j) * sign(signs, j);
            }
        }
    }
}

/// IQ2_S: 2.5 bits per weight.
pub(crate) fn iq2_s(block: &[u8], y: &mut [f32]) {
    let d = f16_at(block, 0);
    let (qs, signs, qh, scales) = (
        &block[2..34],
        &block[34..66],
        &block[66..74],
        &block[74..82],
    );
    for ib32 in 0..8 {
        let db = [
            d * (0.5 + (scales[ib32] & 0xf) as f32) * 0.25,
            d * (0.5 + (scales[ib32] >> 4) as f32) * 0.25,
        ];
        for l in 0..4 {
            let index =
                usize::from(qs[4 * ib32 + l]) | ((usize::from(qh[ib32]) << (8 - 2 * l)) & 0x300);
            let grid = IQ2S_GRID[index];
            let s = signs[4 * ib32 + l];
            let out = &mut y[32 * ib32 + 8 * l..][..8];
            for (j, value) in out.iter_mut().enumerate() {
                *value = db[l / 2] * byte(grid, j) * sign(s, j);
            }
        }
    }
}

/// IQ3_XXS: 3.06 bits per weight.
pub(crate) fn iq3_xxs(block: &[u8], y: &mut [f32]) {
    let d = f16_at(block, 0);
    let qs = &block[2..66];
    for ib32 in 0..8 {
        let aux = u32_at(block, 66 + 4 * ib32);
        let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
        for l in 0..4 {
            let signs = ksigns(aux >> (7 * l));
            let grid1 = IQ3XXS_GRID[qs[8 * ib32 + 2 * l] as usize];
            let grid2 = IQ3XXS_GRID[qs[8 * ib32 + 2 * l + 1] as usize];
            let out = &mut y[32 * ib32 + 8 * l..][..8];
            for j in 0..4 {
                out[j] = db * f32::from((grid1 >> (8 * j)) as u8) * sign(signs, j);
                out[j + 4] = db * f32::from((grid2 >> (8 * j)) as u8) * sign(signs, j + 4);
            }
        }
    }
}

/// IQ3_S: 3.44 bits per weight.
pub(crate) fn iq3_s(block: &[u8], y: &mut [f32]) {
    let d = f16_at(block, 0);
    let (qs, qh, signs, scales) = (
        &block[2..66],
        &block[66..74],
        &block[74..106],
        &block[106..110],
    );
    for ib32 in 0..8 {
        let scale = scales[ib32 / 2] >> (4 * (ib32 % 2)) & 0xf;
        let db = d * (1 + 2 * i32::from(scale)) as f32;
        let high = usize::from(qh[ib32]);
        for l in 0..4 {
            let q = &qs[8 * ib32 + 2 * l..];
            let grid1 = IQ3S_GRID[usize::from(q[0]) | ((high << (8 - 2 * l)) & 256)];
            let grid2 = IQ3S_GRID[usize::from(q[1]) | ((high << (7 - 2 * l)) & 256)];
            let s = signs[4 * ib32 + l];
            let out = &mut y[32 * ib32 + 8 * l..][..8];
            for j in 0..4 {
                out[j] = db * f32::from((grid1 >> (8 * j)) as u8) * sign(s, j);
                out[j + 4] = db * f32::from((grid2 >> (8 * j)) as u8) * sign(s, j + 4);
            }
        }
    }
}

/// Element `j` of an IQ1 grid entry (-1, 0 or 1).
fn ternary(entry: u64, j: usize) -> f32 {
    f32::from((entry >> (8 * j)) as u8 as i8)
}

/// IQ1_S: 1.56 bits per weight.
pub(crate) fn iq1_s(block: &[u8], y: &mut [f32]) {
    let d = f16_at(block, 0);
    let qs = &block[2..34];
    for ib in 0..8 {
        let qh = u16_at(block, 34 + 2 * ib);
        let dl = d * (2 * ((qh >> 12) & 7) + 1) as f32;
        let delta = if qh & 0x8000 != 0 {
            -IQ1S_DELTA
        } else {
            IQ1S_DELTA
        };
        for l in 0..4 {
            let index = usize::from(qs[4 * ib + l]) | (usize::from((qh >> (3 * l)) & 7) << 8);
            let grid = IQ1S_GRID[index];
            let out = &mut y[32 * ib + 8 * l..][..8];
            for (j, value) in out.iter_mut().enumerate() {
                *value = dl * (ternary(grid, j) + delta);
            }
        }
    }
}

/// IQ1_M: 1.75 bits per weight.
pub(crate) fn iq1_m(block: &[u8], y: &mut [f32]) {
    let (qs, qh) = (&block[0..32], &block[32..48]);
    let sc = [0, 1, 2, 3].map(|k| u16_at(block, 48 + 2 * k));
    let scale_bits =
        (sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000);
    let d = super::f16_bits(scale_bits);
    for ib in 0..8 {
        let word = sc[ib / 2] >> (6 * (ib % 2));
        let dl = [
            d * (2 * (word & 0x7) + 1) as f32,
            d * (2 * ((word >> 3) & 0x7) + 1) as f32,
        ];
        let (h0, h1) = (usize::from(qh[2 * ib]), usize::from(qh[2 * ib + 1]));
        let q = &qs[4 * ib..4 * ib + 4];
        let index = [
            usize::from(q[0]) | ((h0 << 8) & 0x700),
            usize::from(q[1]) | ((h0 << 4) & 0x700),
            usize::from(q[2]) | ((h1 << 8) & 0x700),
            usize::from(q[3]) | ((h1 << 4) & 0x700),
        ];
        let delta = [h0 & 0x08, h0 & 0x80, h1 & 0x08, h1 & 0x80]
            .map(|bit| if bit != 0 { -IQ1S_DELTA } else { IQ1S_DELTA });
        for l in 0..4 {
            let grid = IQ1S_GRID[index[l]];
            let out = &mut y[32 * ib + 8 * l..][..8];
            for (j, value) in out.iter_mut().enumerate() {
                *value = dl[l / 2] * (ternary(grid, j) + delta[l]);
            }
        }
    }
}

/// IQ4_NL: 4-bit non-linear, blocks of 32.
pub(crate) fn iq4_nl(block: &[u8], y: &mut [f32]) {
    let d = f16_at(block, 0);
    for (j, &q) in block[2..18].iter().enumerate() {
        y[j] = d * f32::from(KVALUES_IQ4NL[usize::from(q & 0xf)]);
        y[j + 16] = d * f32::from(KVALUES_IQ4NL[usize::from(q >> 4)]);
    }
}

/// IQ4_XS: 4.25 bits per weight, non-linear, super-blocks of 256.
pub(crate) fn iq4_xs(block: &[u8], y: &mut [f32]) {
    let d = f16_at(block, 0);
    let scales_h = u16_at(block, 2);
    let (scales_l, qs) = (&block[4..8], &block[8..136]);
    for ib in 0..8 {
        let low = (scales_l[ib / 2] >> (4 * (ib % 2))) & 0xf;
        let high = ((scales_h >> (2 * ib)) & 3) as u8;
        let ls = i32::from(low | (high << 4));
        let dl = d * (ls - 32) as f32;
        let out = &mut y[32 * ib..][..32];
        for (j, &q) in qs[16 * ib..16 * ib + 16].iter().enumerate() {
            out[j] = dl * f32::from(KVALUES_IQ4NL[usize::from(q & 0xf)]);
            out[j + 16] = dl * f32::from(KVALUES_IQ4NL[usize::from(q >> 4)]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sign_table_is_ggmls() {
        // ggml's ksigns_iq2xs begins 0, 129, 130, 3, 132, 5, 6, 135 and ends 255.
        let table: Vec<u8> = (0..128).map(ksigns).collect();
        assert_eq!(&table[..8], &[0, 129, 130, 3, 132, 5, 6, 135]);
        assert_eq!(table[127], 255);
        assert!(table.iter().all(|s| s.count_ones() % 2 == 0));
    }

    #[test]
    fn the_grids_hold_ggmls_levels() {
        let levels = |grid: &[u64], allowed: &[u8]| {
            grid.iter()
                .all(|e| e.to_le_bytes().iter().all(|b| allowed.contains(b)))
        };
        assert!(levels(&IQ2XXS_GRID, &[0x08, 0x19, 0x2b]));
        assert!(levels(&IQ2XS_GRID, &[0x08, 0x19, 0x2b]));
        assert!(levels(&IQ2S_GRID, &[0x08, 0x19, 0x2b]));
        assert!(levels(&IQ1S_GRID, &[0xff, 0x00, 0x01]));
        let levels4 = |grid: &[u32], allowed: &[u8]| {
            grid.iter()
                .all(|e| e.to_le_bytes().iter().all(|b| allowed.contains(b)))
        };
        assert!(levels4(
            &IQ3XXS_GRID,
            &[0x04, 0x0c, 0x14, 0x1c, 0x24, 0x2c, 0x34, 0x3e]
        ));
        assert!(levels4(&IQ3S_GRID, &[1, 3, 5, 7, 9, 11, 13, 15]));
        // Every entry distinct: a codebook, not a repeated row.
        let mut sorted = IQ1S_GRID.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), IQ1S_GRID.len());
    }
}
