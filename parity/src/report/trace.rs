//! Where a device leaves the reference, for the compare report (and validate's): the one line naming the first
//! layer, position and token out of tolerance (or the first non-finite value), and the Markdown sections of the
//! hidden states along the run and of the states after the prompt.

use crate::compare::DeviceReport;
use crate::metrics::nan_max;
use std::fmt::Write as _;

/// The Markdown sections of the hidden states along the run and the states after the prompt.
pub(super) fn hidden_sections(s: &mut String, d: &DeviceReport) {
    let _ = writeln!(
        s,
        "\n### Layers (hidden state along the run, worst prompt)\n"
    );
    let _ = writeln!(
        s,
        "| layer | kind | output NRMSE | output NMSE | output cosine | mixer NRMSE | MLP NRMSE | worst position NRMSE |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    for (l, trace) in d.layers.iter().enumerate() {
        let worst_pos = d
            .prompts
            .iter()
            .flat_map(|p| p.layers[l].nrmse_by_position.iter().copied());
        let worst_pos = nan_max(worst_pos);
        let _ = writeln!(
            s,
            "| {} | {} | {:.2e} | {:.2e} | {:.8} | {} | {} | {:.2e} |",
            trace.layer,
            trace.kind,
            trace.output.nrmse,
            trace.output.nmse,
            trace.output.cosine,
            trace
                .mixer
                .map_or("-".into(), |e| format!("{:.2e}", e.nrmse)),
            trace.mlp.map_or("-".into(), |e| format!("{:.2e}", e.nrmse)),
            worst_pos
        );
    }
    if let Some(f) = &d.final_norm {
        let _ = writeln!(
            s,
            "| final norm | | {:.2e} | {:.2e} | {:.8} | | | |",
            f.nrmse, f.nmse, f.cosine
        );
    }
    let _ = writeln!(s, "\n### States after the prompt (worst prompt)\n");
    let _ = writeln!(s, "| state | NRMSE | NMSE | max abs | NaN/Inf |");
    let _ = writeln!(s, "|---|---|---|---|---|");
    for st in &d.states {
        let _ = writeln!(
            s,
            "| `{}` | {:.2e} | {:.2e} | {:.2e} | {}/{} |",
            st.name, st.error.nrmse, st.error.nmse, st.error.max_abs, st.error.nan, st.error.inf
        );
    }
}

/// The line naming the first divergence at every level.
pub fn first_divergence_line(d: &DeviceReport) -> String {
    let f = &d.first_divergence;
    // Non-finite values come first: every measure after them is undefined.
    if let Some(n) = &d.first_non_finite {
        return format!(
            "NaN/Inf first in {} (prompt `{}`, {} tensor(s) affected)",
            n.first.describe(),
            n.prompt,
            n.tensors
        );
    }
    let layer = f.layer.map_or("no layer over threshold".into(), |(l, e)| {
        format!("first layer over threshold: {l} (NRMSE {e:.2e})")
    });
    let layer = match &f.tensor {
        Some((name, e)) => format!("{layer}; first tensor over threshold: {name} ({e:.2e})"),
        None => layer,
    };
    if d.layers.is_empty() {
        let token = f
            .token
            .as_ref()
            .map_or("no token differs".into(), |(label, i)| {
                format!("first differing token: {i} of prompt `{label}`")
            });
        let state = d
            .states
            .iter()
            .find(|r| r.error.nrmse.get() > d.thresholds.max_state_nrmse || !r.error.finite())
            .map_or(String::new(), |r| {
                format!(
                    "first state over threshold: {} (NRMSE {:.2e}); ",
                    r.name, r.error.nrmse
                )
            });
        return format!("layers not compared; {state}{token}");
    }
    let position = f
        .position
        .map_or("no position over threshold".into(), |(p, l)| {
            format!("first position over threshold: {p} (layer {l})")
        });
    let token = f
        .token
        .as_ref()
        .map_or("no token differs".into(), |(label, i)| {
            format!("first differing token: {i} of prompt `{label}`")
        });
    let routing = d
        .routing
        .as_ref()
        .and_then(super::routing::first_flip_clause)
        .map_or(String::new(), |c| format!("; {c}"));
    format!("{layer}; {position}; {token}{routing}")
}
