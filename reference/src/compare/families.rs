//! The worst figure per tensor family over many comparisons, for the output of tests and reports.

use std::collections::BTreeMap;

/// The worst figure per tensor family (a dump name with `layers.{i}.` dropped: `linear_attn.g`, `output`, …) over
/// the comparisons recorded, with where it was and what it is measured per.
#[derive(Debug, Default)]
pub struct WorstByFamily {
    /// Family → (figure, where, per what: `head`, `channel`, …, `tensor`, or `abs` for an absolute figure).
    families: BTreeMap<String, (f64, String, &'static str)>,
}

impl WorstByFamily {
    /// Records `value` for the tensor `name` (a dump name), found at `at`, measured per `per`.
    pub fn record(&mut self, name: &str, value: f64, at: &str, per: &'static str) {
        let family = match name.strip_prefix("layers.") {
            Some(rest) => rest.split_once('.').map_or(rest, |(_, t)| t),
            None => name,
        };
        let entry = self
            .families
            .entry(family.to_string())
            .or_insert((0.0, String::new(), per));
        if value >= entry.0 {
            *entry = (value, at.to_string(), per);
        }
    }

    /// The worst relative figure of any family but the absolute ones.
    pub fn overall(&self) -> f64 {
        self.families
            .values()
            .filter(|(_, _, per)| *per != "abs")
            .map(|(v, _, _)| *v)
            .fold(0.0, f64::max)
    }

    /// One line per family: `family  per head 1.2e-6 of its max (where)`.
    pub fn report(&self) -> String {
        self.families
            .iter()
            .map(|(family, (v, at, per))| match *per {
                "abs" => format!("  {family:<28} {v:.2e} abs"),
                _ => format!("  {family:<28} per {per} {v:.2e} of its max ({at})"),
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_worst_per_family() {
        let mut w = WorstByFamily::default();
        w.record("layers.0.linear_attn.g", 1e-6, "a", "head");
        w.record("layers.3.linear_attn.g", 3e-6, "b", "head");
        w.record("layers.1.linear_attn.g", 2e-6, "c", "head");
        w.record("logits", 5e-4, "d", "abs");
        assert_eq!(w.overall(), 3e-6);
        let r = w.report();
        assert!(
            r.contains("linear_attn.g") && r.contains("3.00e-6") && r.contains("(b)"),
            "{r}"
        );
        assert!(r.contains("logits") && r.contains("5.00e-4 abs"), "{r}");
    }
}
