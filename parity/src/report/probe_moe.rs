//! The MoE part of the `probe` report: each probed layer's routing (rendered by [`super::routing`]), its block fed the
//! reference's routing beside the MLP on its own, the blame, and what to look at next ([`crate::probe::moe`]).

use super::e2;
use super::routing as routing_report;
use crate::metrics::Measure;
use crate::probe::LayerProbe;
use crate::probe::moe::{Blame, FedRouting};
use crate::routing::RoutingReport;
use std::fmt::Write as _;

/// The MoE part of a probe report, all that its lines read: the probed layers, the routing, and why the blocks
/// were not fed the reference's routing.
pub(super) struct MoeParts<'a> {
    pub layers: &'a [LayerProbe],
    pub routing: Option<&'a RoutingReport>,
    pub fed_routing_note: Option<&'a str>,
}

/// The layers whose block was fed the reference's routing.
fn fed_layers<'a>(r: &MoeParts<'a>) -> impl Iterator<Item = (&'a LayerProbe, &'a FedRouting)> {
    r.layers
        .iter()
        .filter_map(|l| Some((l, l.fed_routing.as_ref()?)))
}

/// An MoE model's terminal lines: the routing, each block fed the reference's routing beside the MLP on its
/// own, and what to look at next (none for a dense model).
pub(super) fn terminal_lines(r: &MoeParts) -> Vec<String> {
    let mut lines = Vec::new();
    if let Some(r) = r.routing {
        lines.extend(routing_report::body_lines(r));
    }
    if fed_layers(r).next().is_some() {
        lines.push(
            "MoE blocks fed the reference's routing: MLP NRMSE on the device's own input and routing (own), on its \
             own input (its residual stream after the mixer) with the reference's routing, on the reference's \
             input and routing (the experts' arithmetic alone):"
                .into(),
        );
        lines.push(format!(
            "  {:>5} {:>10} {:>10} {:>12} {:>10}  {:<32}  blame",
            "layer",
            "own",
            "own input",
            "reference's",
            "shared",
            "at flipped tokens (the same three)"
        ));
        for (l, f) in fed_layers(r) {
            lines.push(format!(
                "  {:>5} {:>10} {:>10} {:>12} {:>10}  {:<32}  {}",
                l.layer,
                e2(l.mlp),
                e2(f.mlp_own_input),
                format!("{:.2e}", f.mlp.nrmse),
                e2(f.shared),
                flipped_figures(l, f),
                blame_name(l.blame)
            ));
        }
    }
    if let Some(n) = r.fed_routing_note {
        lines.push(format!("note: {n}"));
    }
    if let Some(next) = next(r) {
        lines.push(format!("next: {next}"));
    }
    lines
}

/// What to look at next in an MoE model: the first layer whose MLP error has a culprit (the experts, what the
/// block reads, or the routing), else where the MLP error comes from within the threshold, with the routing's
/// own next step where it flipped; `None` for a dense model.
fn next(r: &MoeParts) -> Option<String> {
    let routing_next = r
        .routing
        .filter(|r| r.flip_count() > 0)
        .map(routing_report::next_step);
    let culprit = r
        .layers
        .iter()
        .find(|l| matches!(l.blame, Some(b) if b != Blame::Neither));
    let Some(l) = culprit else {
        let worst = |f: &dyn Fn(&LayerProbe) -> Option<f64>| {
            r.layers
                .iter()
                .filter_map(|l| Some((l.layer, f(l)?)))
                .max_by(|a, b| a.1.total_cmp(&b.1))
        };
        let fed = worst(&|l| Some(l.fed_routing.as_ref()?.mlp.nrmse.get()));
        let own_input = worst(&|l| Some(l.fed_routing.as_ref()?.mlp_own_input?.nrmse.get()));
        let own = worst(&|l| Some(l.fed_routing.as_ref().and(l.mlp)?.nrmse.get()));
        let at = |w: Option<(usize, f64)>| {
            w.map_or("-".to_string(), |(l, e)| format!("{e:.2e} (layer {l})"))
        };
        let mut s = match fed {
            Some(_) => format!(
                "every MoE block's MLP within threshold: worst NRMSE fed the reference's input and routing {}, \
                 fed its own input and the reference's routing {}, on its own input and routing {}",
                at(fed),
                at(own_input),
                at(own)
            ),
            None => String::new(),
        };
        // Where the MLP on its own is worst, which step adds the most: the experts, the input, the routing.
        let split = own.and_then(|(layer, o)| {
            let l = r.layers.iter().find(|l| l.layer == layer)?;
            let f = l.fed_routing.as_ref()?;
            let i = f.mlp_own_input?.nrmse.get();
            let steps = [
                ("the experts' arithmetic", f.mlp.nrmse.get()),
                ("what the block reads", i - f.mlp.nrmse.get()),
                ("the routing", o - i),
            ];
            let most = steps.iter().max_by(|a, b| a.1.total_cmp(&b.1))?.0;
            Some(format!(
                "; at layer {layer} the experts give {:.2e}, its own input brings it to {i:.2e}, its own routing \
                 to {o:.2e}: most of it comes with {most}",
                f.mlp.nrmse
            ))
        });
        s.push_str(&split.unwrap_or_default());
        if let Some(n) = routing_next {
            if !s.is_empty() {
                s.push_str("; routing: ");
            }
            s.push_str(&n);
        }
        return (!s.is_empty()).then_some(s);
    };
    let f = l.fed_routing.as_ref()?;
    let max = l.thresholds.max_nrmse;
    let layer = l.layer;
    Some(match l.blame? {
        Blame::Experts => format!(
            "layer {layer}'s MoE block is over threshold fed the reference's input and routing (MLP NRMSE {:.2e} \
             > {max:.1e}; the shared expert's output {}): its experts' arithmetic is wrong whatever the routing; \
             look at `layers.{layer}.mlp.experts.*`, the post-attention norm and `layers.{layer}.mlp.shared_output`",
            f.mlp.nrmse,
            e2(f.shared)
        ),
        Blame::Input => format!(
            "layer {layer}'s MoE block computes within threshold fed the reference's input and routing (MLP NRMSE \
             {:.2e}) but not fed its own input with the reference's routing ({}): the error comes in with what \
             the block reads (the mixer output's NRMSE {}, the layer input's at most the layer before's; the \
             drill-down names the op){}",
            f.mlp.nrmse,
            e2(f.mlp_own_input),
            e2(l.mixer),
            routing_next.map_or(String::new(), |n| format!("; routing: {n}"))
        ),
        Blame::Routing => {
            let flips = l.routing.as_ref().map_or(0, |r| {
                r.near_tie_flips + r.confident_flips + r.unclassified_flips
            });
            format!(
                "layer {layer}'s MLP error is its routing's: MLP NRMSE {:.2e} fed the reference's input and \
                 routing, {} fed its own input and the reference's routing, {} on its own routing ({flips} \
                 flipped token(s): {}); routing: {}",
                f.mlp.nrmse,
                e2(f.mlp_own_input),
                e2(l.mlp),
                flipped_figures(l, f),
                routing_next.unwrap_or_else(|| {
                    "no flip: the weights of the experts it chose differ".into()
                })
            )
        }
        Blame::Neither => return None,
    })
}

/// An MoE model's Markdown: the routing, each block fed the reference's routing, and the next step.
pub(super) fn markdown(s: &mut String, r: &MoeParts) {
    if r.routing.is_none() && fed_layers(r).next().is_none() && r.fed_routing_note.is_none() {
        return;
    }
    let _ = writeln!(s, "\n## MoE\n");
    if let Some(r) = r.routing {
        routing_report::markdown_body(s, r);
    }
    if fed_layers(r).next().is_some() {
        let _ = writeln!(s, "\n### Fed the reference's routing\n");
        let _ = writeln!(
            s,
            "MLP output NRMSE of each MoE block on the device: on its own input and routing (its layer's graph); \
             fed its own residual stream after the mixer (its layer input plus mixer output) and the reference's \
             chosen experts and weights; fed the reference's residual stream and routing, which leaves the \
             experts' arithmetic alone (with the post-attention norm and the shared expert). Blame: the first of \
             the reference's input and routing (experts), the own input (input), the own routing (routing) over \
             threshold.\n"
        );
        let _ = writeln!(
            s,
            "| layer | own input and routing | own input, reference's routing | reference's input and routing | shared expert (reference's) | at flipped tokens: own / own input / reference's | blame |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|");
        for (l, f) in fed_layers(r) {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.2e} | {} | {} | {} |",
                l.layer,
                e2(l.mlp),
                e2(f.mlp_own_input),
                f.mlp.nrmse,
                e2(f.shared),
                flipped_figures(l, f),
                blame_name(l.blame)
            );
        }
    }
    if let Some(n) = r.fed_routing_note {
        let _ = writeln!(s, "\nNote: {n}.");
    }
    if let Some(next) = next(r) {
        let _ = writeln!(s, "\nNext: {next}.");
    }
}

/// A figure in the tables' notation, `-` where there is none.
fn opt(x: Option<Measure>) -> String {
    x.map_or_else(|| "-".into(), |x| format!("{x:.2e}"))
}

/// At an MoE layer's flipped tokens, its worst per-token MLP NRMSE on its own input and routing / its own input with
/// the reference's routing / the reference's input and routing; `no flip` without one.
fn flipped_figures(l: &LayerProbe, f: &FedRouting) -> String {
    let own = l.routing.as_ref().and_then(|r| r.mlp_nrmse_flipped);
    if own.is_none() && f.mlp_nrmse_flipped.is_none() {
        return "no flip".into();
    }
    format!(
        "{} / {} / {}",
        opt(own),
        opt(f.own_input_nrmse_flipped),
        opt(f.mlp_nrmse_flipped)
    )
}

/// What an MoE layer's MLP error comes from, as the tables write it.
fn blame_name(b: Option<Blame>) -> &'static str {
    match b {
        None => "-",
        Some(Blame::Neither) => "neither",
        Some(Blame::Experts) => "experts",
        Some(Blame::Routing) => "routing",
        Some(Blame::Input) => "input",
    }
}
