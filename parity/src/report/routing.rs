//! The routing section of a report (an MoE model; [`crate::routing`]): per layer the share of tokens that chose the
//! reference's experts, the flips by class, the first flip and what to look at next. One screen on the terminal,
//! every layer and flip in Markdown.

use crate::routing::{ErrorSource, Flip, FlipClass, LayerRouting, RoutingReport};
use std::fmt::Write as _;

/// Layer rows the terminal shows at most (the Markdown report has every layer).
const TERMINAL_LAYERS: usize = 12;

/// Flips the Markdown table lists at most (the JSON has every one).
const MARKDOWN_FLIPS: usize = 50;

/// A number or `-`.
fn num<T: std::fmt::LowerExp>(x: Option<T>) -> String {
    x.map_or("-".into(), |x| format!("{x:.2e}"))
}

/// `[1, 2]`.
fn list(x: &[usize]) -> String {
    format!("{x:?}")
}

/// The first line: agreement over every pair and the flips by class.
pub fn summary_line(r: &RoutingReport) -> String {
    let layers = r.layers.len();
    if r.flip_count() == 0 {
        return format!(
            "routing: every token chose the reference's {} experts at every one of {layers} layer(s) ({} token-layer \
             pairs; {})",
            r.top_k,
            r.pairs,
            if r.order_only() == 0 {
                "in the same order".to_string()
            } else {
                format!("{} in another order", r.order_only())
            }
        );
    }
    let order = match r.order_only() {
        0 => String::new(),
        n => format!("; {n} of them in another order"),
    };
    format!(
        "routing: {}/{} token-layer pairs chose the reference's experts ({:.1}{order}); {} flip(s): {} near tie, \
         {} confident, {} unclassified ({} after an earlier flip, {} with the router off)",
        r.same_set,
        r.pairs,
        r.set_agreement.percent(),
        r.flip_count(),
        r.near_tie_flips,
        r.confident_flips,
        r.unclassified_flips,
        r.downstream_flips,
        r.router_off_flips
    )
}

/// How a flip was judged, in words.
fn judged(f: &Flip) -> String {
    let source = match f.router_error_source {
        Some(ErrorSource::Measured) => "measured",
        Some(ErrorSource::Stated) => "stated",
        Some(ErrorSource::MeasuredPlusStated) => "measured + stated",
        None => "unknown",
    };
    let gap = num(f.gap);
    let error = num(f.router_error);
    let rule = match f.class {
        _ if f.repeated => "the device chose one expert twice".to_string(),
        FlipClass::NearTie => format!("gap {gap} ≤ 2 × router error {error} ({source})"),
        FlipClass::Confident => format!("gap {gap} > 2 × router error {error} ({source})"),
        FlipClass::Unclassified if f.gap.is_none() => {
            "the reference's router logits are not in its taps".to_string()
        }
        FlipClass::Unclassified => {
            format!("gap {gap}, the device's router error unknown")
        }
    };
    let off = if f.router_off {
        "; router off: its error there exceeds the reference's median margin"
    } else {
        ""
    };
    format!(
        "{}: {rule}{off}; reference margin p_k − p_k+1 {}",
        f.class.name(),
        num(f.reference_margin)
    )
}

/// One flip in a line: where, which experts, how it was judged, what it cost and whether it follows another.
pub fn flip_line(f: &Flip, layer: Option<&LayerRouting>) -> String {
    let mut s = format!(
        "layer {} token {} of `{}`: experts in {} out {}; {}",
        f.layer,
        f.token,
        f.prompt,
        list(&f.experts_in),
        list(&f.experts_out),
        judged(f)
    );
    if let Some(e) = f.mlp_nrmse {
        let _ = write!(s, "; MLP output NRMSE there {e:.2e}");
        if let Some(a) = layer.and_then(|l| l.mlp_nrmse_agreeing) {
            let _ = write!(s, " against {a:.2e} at most where the set agreed");
        }
    }
    match f.upstream {
        Some(u) => {
            let _ = write!(s, "; after the flip at layer {} token {}", u.layer, u.token);
        }
        None => s.push_str("; no earlier flip reaches it"),
    }
    match (f.input_nrmse, f.mixer_nrmse) {
        (Some(i), Some(m)) => {
            let _ = write!(s, " (input NRMSE there {i:.2e}, mixer output {m:.2e})");
        }
        (Some(i), None) => {
            let _ = write!(s, " (input NRMSE there {i:.2e})");
        }
        _ => {}
    }
    s
}

/// What to look at next, from the flips there are.
pub fn next_step(r: &RoutingReport) -> String {
    if let Some(f) = &r.first_confident {
        let l = f.layer;
        return match f.router_error_source {
            Some(ErrorSource::Stated) => format!(
                "the first confident flip (layer {l} token {}) overturns a gap larger than twice the stated router \
                 error: the router there is wrong, or the bound too tight; expose `layers.{l}.mlp.router_logits` so \
                 the error is measured",
                f.token
            ),
            _ => format!(
                "the first confident flip (layer {l} token {}) is not what the device's own router output allows: \
                 check its top-k selection and expert indices there (`layers.{l}.mlp.experts_chosen` against \
                 `layers.{l}.mlp.router_logits`)",
                f.token
            ),
        };
    }
    if r.unclassified_flips > 0 {
        return format!(
            "{} flip(s) unclassified: classifying needs both sides' `mlp.router_logits`; expose the device's, or \
             state its router error with --router-tolerance P",
            r.unclassified_flips
        );
    }
    let Some(first) = &r.first_flip else {
        return "nothing: the experts are the reference's, so any error is in what they compute"
            .into();
    };
    let mut s = format!(
        "every flip is a near tie by the rule, the first at layer {} token {}; {} of {} follow an earlier flip",
        first.layer,
        first.token,
        r.downstream_flips,
        r.flip_count()
    );
    // A near tie by the rule only because the router is far off there, where no earlier flip reaches.
    let off = r
        .flips
        .iter()
        .filter(|f| f.router_off && !f.downstream())
        .min_by_key(|f| (f.layer, f.token));
    let median = |f: &Flip| {
        r.layers
            .iter()
            .find(|l| l.layer == f.layer)
            .and_then(|l| l.margin_median)
    };
    match off {
        Some(f) => {
            let _ = write!(
                s,
                ". But at layer {} token {}, where no earlier flip reaches, the router is off by {}, more than the \
                 reference's median margin there ({}): that is no rounding of a near tie; the router's output is off \
                 there (its weights, its arithmetic, or its input: the layer's input NRMSE there {}, its mixer \
                 output's {}; `layers.{}.mlp.router_logits`, `layers.{}.mixer_output`)",
                f.layer,
                f.token,
                num(f.router_error),
                num(median(f)),
                num(f.input_nrmse),
                num(f.mixer_nrmse),
                f.layer,
                f.layer
            );
        }
        None => s.push_str(
            ". Where no earlier flip reaches, no flip's router error exceeds the reference's median margin: \
             rounding decided them, and what they cost is the MLP output error at the flipped tokens",
        ),
    }
    s
}

/// The terminal lines: the summary, the layers that did not agree throughout, the first flip and the next step.
pub fn terminal_lines(r: &RoutingReport) -> Vec<String> {
    let mut lines = body_lines(r);
    if r.flip_count() > 0 || r.order_only() > 0 {
        lines.push(format!("  next: {}", next_step(r)));
    }
    lines
}

/// [`terminal_lines`] but the next step (a report that gives its own).
pub fn body_lines(r: &RoutingReport) -> Vec<String> {
    let mut lines = vec![summary_line(r)];
    if r.flip_count() == 0 && r.order_only() == 0 {
        return lines;
    }
    let off: Vec<&LayerRouting> = r
        .layers
        .iter()
        .filter(|l| l.same_order < l.tokens)
        .collect();
    lines.push(format!(
        "  {:>5} {:>14} {:>10} {:>8} {:>9} {:>12} {:>20} {:>13}  MLP NRMSE flipped / agreeing",
        "layer",
        "same set",
        "order only",
        "near tie",
        "confident",
        "unclassified",
        "router error all / own",
        "median margin"
    ));
    for l in off.iter().take(TERMINAL_LAYERS) {
        lines.push(format!(
            "  {:>5} {:>14} {:>10} {:>8} {:>9} {:>12} {:>20} {:>13}  {} / {}",
            l.layer,
            format!(
                "{}/{} {:.1}",
                l.same_set,
                l.tokens,
                l.set_agreement.percent()
            ),
            l.same_set - l.same_order,
            l.near_tie_flips,
            l.confident_flips,
            l.unclassified_flips,
            format!(
                "{} / {}",
                num(l.router_error_max),
                num(l.router_error_independent)
            ),
            num(l.margin_median),
            num(l.mlp_nrmse_flipped),
            num(l.mlp_nrmse_agreeing)
        ));
    }
    if off.len() > TERMINAL_LAYERS {
        lines.push(format!(
            "  … {} more layer(s) (every layer in the Markdown report)",
            off.len() - TERMINAL_LAYERS
        ));
    }
    let rest = r.layers.len() - off.len();
    if rest > 0 {
        lines.push(format!(
            "  the other {rest} layer(s): every token the reference's experts in its order"
        ));
    }
    if let Some(f) = &r.first_flip {
        let layer = r.layers.iter().find(|l| l.layer == f.layer);
        lines.push(format!("  first flip: {}", flip_line(f, layer)));
    }
    lines
}

/// The Markdown section.
pub fn markdown(s: &mut String, r: &RoutingReport) {
    markdown_body(s, r);
    let _ = writeln!(s, "\nNext: {}.", next_step(r));
}

/// [`markdown`] but the next step (a report that gives its own).
pub fn markdown_body(s: &mut String, r: &RoutingReport) {
    let _ = writeln!(s, "\n### Routing (MoE)\n");
    let _ = writeln!(s, "{}.\n", summary_line(r));
    let _ = writeln!(
        s,
        "A flip is a token whose chosen expert set differs from the reference's. It is a near tie when the \
         reference's gap between the experts the device swapped (max p(out) − min p(in); for a swap of the k-th and \
         (k+1)-th, the margin p_k − p_k+1) is within twice the device's router error at that token (max |p_dev − \
         p_ref| over the experts, measured from its router logits, plus --router-tolerance if stated); confident \
         beyond it. A flip is downstream when an earlier layer flipped at the same or an earlier token; the router's \
         own error is its largest over the tokens no earlier flip reaches; a flip is router-off when its router error \
         exceeds the reference's median margin (a near tie only because the router is far off there).\n"
    );
    let _ = writeln!(
        s,
        "| layer | tokens | same set | same order | near tie | confident | unclassified | downstream | router error max | own (no earlier flip) | median margin | router off | MLP NRMSE flipped | MLP NRMSE agreeing |"
    );
    let _ = writeln!(
        s,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for l in &r.layers {
        let _ = writeln!(
            s,
            "| {} | {} | {} ({:.1}) | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            l.layer,
            l.tokens,
            l.same_set,
            l.set_agreement.percent(),
            l.same_order,
            l.near_tie_flips,
            l.confident_flips,
            l.unclassified_flips,
            l.downstream_flips,
            num(l.router_error_max),
            num(l.router_error_independent),
            num(l.margin_median),
            l.router_off_flips,
            num(l.mlp_nrmse_flipped),
            num(l.mlp_nrmse_agreeing)
        );
    }
    if !r.flips.is_empty() {
        let _ = writeln!(
            s,
            "\n| prompt | layer | token | reference | device | margin | gap | router error | class | MLP NRMSE | input NRMSE | after |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|");
        for f in r.flips.iter().take(MARKDOWN_FLIPS) {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                f.prompt,
                f.layer,
                f.token,
                list(&f.reference),
                list(&f.device),
                num(f.reference_margin),
                num(f.gap),
                num(f.router_error),
                if f.router_off {
                    format!("{} (router off)", f.class.name())
                } else {
                    f.class.name().to_string()
                },
                num(f.mlp_nrmse),
                num(f.input_nrmse),
                f.upstream
                    .map_or("-".into(), |u| format!("L{} t{}", u.layer, u.token))
            );
        }
        if r.flips.len() > MARKDOWN_FLIPS {
            let _ = writeln!(
                s,
                "\n{} more flip(s) in the JSON (`routing.flips`).",
                r.flips.len() - MARKDOWN_FLIPS
            );
        }
    }
    if let Some(f) = &r.first_flip {
        let layer = r.layers.iter().find(|l| l.layer == f.layer);
        let _ = writeln!(s, "\nFirst flip: {}.", flip_line(f, layer));
    }
}

/// The clause of the one-line verdict: the first flip and its class, or `None` without routing or flips.
pub fn first_flip_clause(r: &RoutingReport) -> Option<String> {
    let f = r.first_flip.as_ref()?;
    Some(format!(
        "first routing flip: layer {} token {} ({})",
        f.layer,
        f.token,
        f.class.name()
    ))
}
