//! Every check's default thresholds, in one place: those of `compare-devices`, `validate` and `diff`
//! ([`crate::compare::Thresholds`]), the probe's ([`crate::probe::ProbeThresholds`]), the help texts of their flags
//! and the sentence of the docs that quotes them (a test holds the docs to it).

use reference::backend::Precision;

/// The default thresholds for the precision a device computed in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Defaults {
    /// Largest NMSE of the teacher-forced logits.
    pub logits_nmse: f64,
    /// Largest mean `KL(P_ref ‖ P_device)` over the teacher-forced positions, in nats.
    pub mean_kl: f64,
    /// Smallest share of teacher-forced positions where both choose the same top token.
    pub min_top1: f64,
    /// Most teacher-forced disagreements at confident positions.
    pub confident_flips: usize,
    /// Largest NRMSE of a layer's output (and of the probe's outputs and intermediates).
    pub layer_nrmse: f64,
    /// Largest NRMSE of a state.
    pub state_nrmse: f64,
}

/// At f32: tight, rounding only.
pub const FULL: Defaults = Defaults {
    logits_nmse: 1e-8,
    mean_kl: 1e-6,
    min_top1: 1.0,
    confident_flips: 0,
    layer_nrmse: 1e-4,
    state_nrmse: 1e-4,
};

/// At f16 and bf16: the levels a working fp16 port shows (hidden states within a few percent, the same greedy
/// tokens).
pub const REDUCED: Defaults = Defaults {
    logits_nmse: 1e-2,
    mean_kl: 5e-2,
    min_top1: 0.9,
    confident_flips: 0,
    layer_nrmse: 5e-2,
    state_nrmse: 5e-2,
};

// The f32 defaults are the tighter ones, or the build fails.
const _: () = {
    assert!(FULL.logits_nmse < REDUCED.logits_nmse);
    assert!(FULL.mean_kl < REDUCED.mean_kl);
    assert!(FULL.min_top1 > REDUCED.min_top1);
    assert!(FULL.layer_nrmse < REDUCED.layer_nrmse);
    assert!(FULL.state_nrmse < REDUCED.state_nrmse);
};

/// The defaults for a device that computed in `precision` (as read back).
pub fn for_precision(precision: &Precision) -> &'static Defaults {
    if precision.is_full() { &FULL } else { &REDUCED }
}

/// A threshold as help texts and docs write it: `1e-8`, `5e-2`, `0.9`, `1`.
pub fn show(x: f64) -> String {
    if x == 0.0 || x.abs() >= 0.1 {
        format!("{x}")
    } else {
        format!("{x:e}")
    }
}

/// A flag's help: `what`, then its defaults at f32 and at f16/bf16 (one default when they agree).
pub fn help(what: &str, of: fn(&Defaults) -> f64) -> String {
    let (full, reduced) = (show(of(&FULL)), show(of(&REDUCED)));
    if full == reduced {
        format!("{what} (default {full})")
    } else {
        format!("{what} (default {full} at f32, {reduced} at f16/bf16)")
    }
}

/// The docs' sentence on the defaults (`docs/fp16sim.md`).
pub fn docs_sentence() -> String {
    format!(
        "f32: logits NMSE ≤ {}, mean KL ≤ {}, every top-1 equal, layer and state NRMSE ≤ {}; f16/bf16: {}, {}, {}%, {}",
        show(FULL.logits_nmse),
        show(FULL.mean_kl),
        show(FULL.layer_nrmse),
        show(REDUCED.logits_nmse),
        show(REDUCED.mean_kl),
        REDUCED.min_top1 * 100.0,
        show(REDUCED.layer_nrmse),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_docs_quote_the_defaults_as_defined_here() {
        let docs = include_str!("../../docs/fp16sim.md");
        let flat: String = docs.split_whitespace().collect::<Vec<_>>().join(" ");
        let sentence = docs_sentence();
        assert!(
            flat.contains(&sentence),
            "docs/fp16sim.md does not say: {sentence}"
        );
    }

    #[test]
    fn help_texts_carry_both_defaults_or_the_one_they_share() {
        assert_eq!(
            help("Largest NMSE", |d| d.logits_nmse),
            "Largest NMSE (default 1e-8 at f32, 1e-2 at f16/bf16)"
        );
        assert_eq!(
            help("Most flips", |d| d.confident_flips as f64),
            "Most flips (default 0)"
        );
        assert_eq!(show(0.9), "0.9");
        assert_eq!(show(1.0), "1");
        assert_eq!(show(5e-2), "5e-2");
    }
}
