//! The masks of the decoder, written once and shared by the reference and the OpenVINO graphs: the causal masks of
//! the chunked delta rule, the block band of the doubling inverse, and the attention bias over a (possibly static)
//! KV cache. Each is a row-major `Vec<f64>` of exact values (0, 1 or −inf), converted by the caller to its dtype
//! without rounding.

/// `[t, t]`: 1 where `j < i` (row `i`, column `j`), or `j <= i` when `inclusive`; 0 elsewhere.
pub fn causal(t: usize, inclusive: bool) -> Vec<f64> {
    (0..t * t)
        .map(|idx| {
            let (row, col) = (idx / t, idx % t);
            if col < row || (inclusive && col == row) {
                1.0
            } else {
                0.0
            }
        })
        .collect()
}

/// `[t, t]`: 1 where `i <= j`, the inclusive upper triangle. `g · U` is the cumulative sum of a row vector `g`.
pub fn cumsum_matrix(t: usize) -> Vec<f64> {
    (0..t * t)
        .map(|idx| if idx / t <= idx % t { 1.0 } else { 0.0 })
        .collect()
}

/// `[n, n]`: 1 on the entries below the diagonal that lie inside the diagonal blocks of size `2s` but outside those
/// of size `s`: the off-diagonal halves that one pass of the block-doubling inverse folds in.
pub fn block_band(n: usize, s: usize) -> Vec<f64> {
    (0..n * n)
        .map(|idx| {
            let (row, col) = (idx / n, idx % n);
            let same_2s = row / (2 * s) == col / (2 * s);
            let same_s = row / s == col / s;
            if same_2s && !same_s && row > col {
                1.0
            } else {
                0.0
            }
        })
        .collect()
}

/// `[t, capacity + t]`: the additive attention bias of `t` new queries at positions `past..past + t` over a KV cache
/// of `capacity` slots of which the first `past` are filled, followed by the `t` new keys. Query `i` sees the filled
/// cache slots and the new keys `0..=i`: 0 there, −inf elsewhere. The reference's growing cache is the case
/// `capacity == past`; a static graph's cache has `capacity` = its context.
pub fn attention_bias(t: usize, past: usize, capacity: usize) -> Vec<f64> {
    let mut bias = Vec::with_capacity(t * (capacity + t));
    for row in 0..t {
        bias.extend((0..capacity).map(|col| if col < past { 0.0 } else { f64::NEG_INFINITY }));
        bias.extend((0..t).map(|col| if col <= row { 0.0 } else { f64::NEG_INFINITY }));
    }
    bias
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_and_band_masks() {
        assert_eq!(causal(2, false), vec![0.0, 0.0, 1.0, 0.0]);
        assert_eq!(causal(2, true), vec![1.0, 0.0, 1.0, 1.0]);
        assert_eq!(cumsum_matrix(2), vec![1.0, 1.0, 0.0, 1.0]);
        // n = 4, s = 1: the entries (1,0) and (3,2); s = 2: the lower-left 2x2 block.
        let band1 = block_band(4, 1);
        let ones1: Vec<usize> = (0..16).filter(|&i| band1[i] == 1.0).collect();
        assert_eq!(ones1, vec![4, 14]);
        let band2 = block_band(4, 2);
        let ones2: Vec<usize> = (0..16).filter(|&i| band2[i] == 1.0).collect();
        assert_eq!(ones2, vec![8, 9, 12, 13]);
    }

    #[test]
    fn attention_bias_over_a_static_cache() {
        let ninf = f64::NEG_INFINITY;
        // 2 queries, 1 filled slot of a 3-slot cache.
        assert_eq!(
            attention_bias(2, 1, 3),
            vec![0.0, ninf, ninf, 0.0, ninf, 0.0, ninf, ninf, 0.0, 0.0]
        );
        // A growing cache: every past key, then causal.
        assert_eq!(attention_bias(2, 1, 1), vec![0.0, 0.0, ninf, 0.0, 0.0, 0.0]);
    }
}
