//! Properties of the delta-rule forms: every form equals the sequential oracle.

use crate::common::*;
use candle_core::{DType, Tensor};
use proptest::prelude::*;
use reference::deltanet::{self, Form, Inverse, chunk, chunked, run, sequential, tri_inverse};
use reference::synthetic::Rng;

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// In f64 every chunked form, any block size, equals the sequential recurrence to rounding.
    #[test]
    fn chunked_forms_equal_sequential_f64(c in kernel_case()) {
        let (x, s0) = kernel_inputs(&c, DType::F64);
        let (o_ref, s_ref) = sequential(&x, &s0).unwrap();
        for inverse in Inverse::ALL {
            let (o, s) = chunked(&x, &s0, c.block, inverse).unwrap();
            prop_close(&format!("o, {}", inverse.name()), &o, &o_ref, 1e-9)?;
            prop_close(&format!("state, {}", inverse.name()), &s, &s_ref, 1e-9)?;
        }
        let (o, s) = run(Form::Matrix, &x, &s0).unwrap();
        prop_close("o, matrix", &o, &o_ref, 1e-12)?;
        prop_close("state, matrix", &s, &s_ref, 1e-12)?;
    }

    /// In f32, with decays down to −10 per token (where an unmasked exp overflows), the chunked forms stay finite and
    /// within f32 rounding of the sequential recurrence. The series inverse is held to the same bound only for
    /// blocks up to 16: its terms grow combinatorially with the block size (see the precision module).
    #[test]
    fn chunked_forms_equal_sequential_f32(c in kernel_case()) {
        let (x, s0) = kernel_inputs(&c, DType::F32);
        let (o_ref, s_ref) = sequential(&x, &s0).unwrap();
        for inverse in [Inverse::Substitution, Inverse::Doubling] {
            let (o, s) = chunked(&x, &s0, c.block, inverse).unwrap();
            prop_close(&format!("o, {}", inverse.name()), &o, &o_ref, 2e-5)?;
            prop_close(&format!("state, {}", inverse.name()), &s, &s_ref, 2e-5)?;
        }
        if c.block <= 16 {
            let (o, s) = chunked(&x, &s0, c.block, Inverse::Series).unwrap();
            prop_close("o, series", &o, &o_ref, 2e-5)?;
            prop_close("state, series", &s, &s_ref, 2e-5)?;
        }
    }

    /// Running a sequence in two parts, the state carried between them (and the second part in another form),
    /// equals running it whole.
    #[test]
    fn split_and_carry_equals_whole(c in kernel_case(), cut_frac in 0.0f64..1.0) {
        let (x, s0) = kernel_inputs(&c, DType::F64);
        let t = c.tokens;
        let cut = ((t as f64) * cut_frac) as usize;
        prop_assume!(cut > 0 && cut < t);
        let (o_ref, s_ref) = sequential(&x, &s0).unwrap();
        let (o1, s1) = chunked(&x.narrow(0, cut).unwrap(), &s0, c.block, Inverse::Doubling).unwrap();
        let (o2, s2) = run(Form::Matrix, &x.narrow(cut, t - cut).unwrap(), &s1).unwrap();
        prop_close("o", &Tensor::cat(&[&o1, &o2], 1).unwrap(), &o_ref, 1e-9)?;
        prop_close("state", &s2, &s_ref, 1e-9)?;
    }

    /// A block padded with arbitrary garbage, masked by `token_valid`, gives the unpadded block's outputs and leaves
    /// the state exactly as after its last real token.
    #[test]
    fn padded_block_equals_unpadded(c in kernel_case(), pad in 1usize..20) {
        let (x, s0) = kernel_inputs(&c, DType::F64);
        let garbage_case = KernelCase { seed: c.seed ^ 0xdead, tokens: pad, ..c.clone() };
        let (junk, _) = kernel_inputs(&garbage_case, DType::F64);
        let cat = |a: &Tensor, b: &Tensor| Tensor::cat(&[a, b], 1).unwrap();
        let padded = deltanet::Inputs {
            q: cat(&x.q, &junk.q), k: cat(&x.k, &junk.k), v: cat(&x.v, &junk.v),
            g: cat(&x.g, &junk.g), beta: cat(&x.beta, &junk.beta),
        };
        let mut valid = vec![1f64; c.tokens];
        valid.resize(c.tokens + pad, 0.0);
        let valid = Tensor::new(valid, &candle_core::Device::Cpu).unwrap();
        for inverse in Inverse::ALL {
            let (o, s) = chunk(&padded, &s0, inverse, Some(&valid)).unwrap();
            let (o_ref, s_ref) = chunk(&x, &s0, inverse, None).unwrap();
            prop_close("o", &o.narrow(1, 0, c.tokens).unwrap(), &o_ref, 1e-10)?;
            prop_close("state", &s, &s_ref, 1e-10)?;
        }
    }

    /// With beta = 0 nothing is written: the state only decays, `S_T = exp(Σ g) S0`, and `o_t = S_tᵀ q_t`.
    #[test]
    fn zero_beta_only_decays(c in kernel_case()) {
        let (mut x, s0) = kernel_inputs(&c, DType::F64);
        x.beta = x.beta.zeros_like().unwrap();
        let total = x.g.sum_keepdim(1).unwrap().exp().unwrap().unsqueeze(2).unwrap();
        let expected = s0.broadcast_mul(&total).unwrap();
        for form in [Form::Sequential, Form::Matrix, Form::Chunked { block: c.block, inverse: Inverse::Doubling }] {
            let (o, s) = run(form, &x, &s0).unwrap();
            prop_close(&format!("state, {}", form.describe()), &s, &expected, 1e-12)?;
            let t = c.tokens - 1;
            let g_to_t = x.g.sum_keepdim(1).unwrap().exp().unwrap().unsqueeze(2).unwrap();
            let last = x.q.narrow(1, t, 1).unwrap().matmul(&s0.broadcast_mul(&g_to_t).unwrap()).unwrap();
            prop_close("last output", &o.narrow(1, t, 1).unwrap(), &last, 1e-12)?;
        }
    }

    /// All three triangular inverses equal an exact inverse of `I + N` (f64).
    #[test]
    fn triangular_inverses_are_exact(seed in any::<u64>(), size in 1usize..=70, heads in 1usize..=3, scale in 0.1f64..2.0) {
        let mut rng = Rng::new(seed);
        let mut data = vec![0f64; heads * size * size];
        for h in 0..heads {
            for i in 0..size {
                for j in 0..i {
                    data[(h * size + i) * size + j] = scale * rng.range(-1.0, 1.0) / (size as f64).sqrt();
                }
            }
        }
        let n = Tensor::from_vec(data.clone(), (heads, size, size), &candle_core::Device::Cpu).unwrap();
        let exact: Vec<f64> = (0..heads)
            .flat_map(|h| exact_unit_lower_inverse(&data[h * size * size..(h + 1) * size * size], size))
            .collect();
        let exact = Tensor::from_vec(exact, (heads, size, size), &candle_core::Device::Cpu).unwrap();
        for inverse in Inverse::ALL {
            let x = tri_inverse(&n, inverse).unwrap();
            prop_close(inverse.name(), &x, &exact, 1e-9)?;
        }
    }
}

/// The matrix step is the recurrence written differently; on a hand-checked single token it gives the same numbers.
#[test]
fn single_token_matrix_form_by_hand() {
    let dev = candle_core::Device::Cpu;
    // One head, Dk = 2, Dv = 1.
    let x = deltanet::Inputs {
        q: Tensor::new(&[[[1.0f64, 0.0]]], &dev).unwrap(),
        k: Tensor::new(&[[[0.6f64, 0.8]]], &dev).unwrap(),
        v: Tensor::new(&[[[2.0f64]]], &dev).unwrap(),
        g: Tensor::new(&[[0.5f64.ln()]], &dev).unwrap(),
        beta: Tensor::new(&[[0.5f64]], &dev).unwrap(),
    };
    let s0 = Tensor::new(&[[[1.0f64], [1.0]]], &dev).unwrap();
    // S = 0.5·S0 = [.5, .5]; kᵀS = .7; delta = .5·(2 − .7) = .65; S' = [.5 + .39, .5 + .52]; o = qᵀS' = .89.
    let (o, s) = deltanet::step(&x, &s0).unwrap();
    assert!((o.flatten_all().unwrap().to_vec1::<f64>().unwrap()[0] - 0.89).abs() < 1e-15);
    let s = s.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    assert!(
        (s[0] - 0.89).abs() < 1e-15 && (s[1] - 1.02).abs() < 1e-15,
        "{s:?}"
    );
    let (o2, _) = sequential(&x, &s0).unwrap();
    assert_close("sequential", &o2, &o, 1e-15);
}
