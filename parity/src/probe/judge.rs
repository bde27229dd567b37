//! Judging probed layers: the thresholds (by precision, or from a baseline device's errors), whether a layer is over
//! them, its worst errors, and the drill-down into the first layer over threshold.

use super::{LayerProbe, Named, moe};
use crate::metrics::{TensorError, exceeds, nan_max};
use reference::backend::Precision;
use serde::Serialize;
use std::collections::BTreeMap;

/// The thresholds of the probe.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ProbeThresholds {
    /// Largest NRMSE of a layer's outputs and intermediates.
    pub max_nrmse: f64,
    /// Largest NRMSE of a state (after the prompt, and after every block).
    pub max_state_nrmse: f64,
}

impl ProbeThresholds {
    /// The defaults for a device that computed in `precision`: [`crate::thresholds`]'s layer and state NRMSE.
    pub fn for_precision(precision: &Precision) -> Self {
        let d = crate::thresholds::for_precision(precision);
        ProbeThresholds {
            max_nrmse: d.layer_nrmse,
            max_state_nrmse: d.state_nrmse,
        }
    }
}

/// Where the error starts inside the first layer over threshold.
#[derive(Debug, Clone, Serialize)]
pub struct DrillDown {
    /// The layer.
    pub layer: usize,
    /// The first intermediate over threshold, in the order the layer computes them, else the first state over
    /// threshold.
    pub first_over: Option<String>,
    /// Every intermediate both sides expose, in that order.
    pub intermediates: Vec<Named>,
}

impl LayerProbe {
    /// Decides `over` under `t`: an output (an MoE block's fed the reference's routing included), a state after
    /// the prompt or after any block over its threshold, or not finite; and what an MoE layer's MLP error comes from.
    pub fn judge(&mut self, t: ProbeThresholds) {
        let over_nrmse = |e: &TensorError, max: f64| !e.finite() || exceeds(e.nrmse.get(), max);
        self.thresholds = t;
        self.blame = moe::blame(self.mlp.as_ref(), self.fed_routing.as_ref(), |e| {
            over_nrmse(e, t.max_nrmse)
        });
        self.over = [self.output, self.mixer, self.mlp]
            .iter()
            .flatten()
            .chain(self.fed_routing.as_ref().map(|f| &f.mlp))
            .any(|e| over_nrmse(e, t.max_nrmse))
            || self
                .states
                .iter()
                .any(|s| over_nrmse(&s.error, t.max_state_nrmse))
            || self
                .state_drift
                .iter()
                .any(|&e| exceeds(e, t.max_state_nrmse));
    }

    /// The largest NRMSE of its outputs, and of its states (after the prompt and after any block).
    pub fn worst(&self) -> (f64, f64) {
        let outputs = [self.output, self.mixer, self.mlp]
            .into_iter()
            .flatten()
            .chain(self.fed_routing.as_ref().map(|f| f.mlp))
            .map(|e| e.nrmse.get());
        let states = self
            .states
            .iter()
            .map(|s| s.error.nrmse.get())
            .chain(self.state_drift.iter().copied());
        (nan_max(outputs), nan_max(states))
    }

    /// The worst state after the prompt: its name and NRMSE.
    pub fn worst_state(&self) -> Option<&Named> {
        self.states
            .iter()
            .max_by(|a, b| a.error.nrmse.get().total_cmp(&b.error.nrmse.get()))
    }
}

/// Thresholds from a baseline device (FP16SIM): layer `l` may be `factor` times as far from the reference as the
/// baseline's layer `l`, and never held tighter than `floor` (so an exact baseline does not demand exactness).
pub fn thresholds_from(
    baseline: &[LayerProbe],
    factor: f64,
    floor: ProbeThresholds,
) -> BTreeMap<usize, ProbeThresholds> {
    baseline
        .iter()
        .map(|b| {
            let (outputs, states) = b.worst();
            (
                b.layer,
                ProbeThresholds {
                    max_nrmse: (factor * outputs).max(floor.max_nrmse),
                    max_state_nrmse: (factor * states).max(floor.max_state_nrmse),
                },
            )
        })
        .collect()
}

/// The drill-down of the first layer over threshold (`None` when every layer holds), judged by that layer's own
/// threshold: the first intermediate over it in computation order, else the first state over it.
pub fn drill_down(layers: &[LayerProbe]) -> Option<DrillDown> {
    let first = layers.iter().find(|l| l.over)?;
    let t = first.thresholds;
    let over = |e: &TensorError, max: f64| !e.finite() || exceeds(e.nrmse.get(), max);
    Some(DrillDown {
        layer: first.layer,
        first_over: first
            .intermediates
            .iter()
            .find(|n| over(&n.error, t.max_nrmse))
            .map(|n| n.name.clone())
            .or_else(|| {
                let prefix = format!("layers.{}.", first.layer);
                first
                    .states
                    .iter()
                    .find(|n| over(&n.error, t.max_state_nrmse))
                    .map(|n| n.name.strip_prefix(&prefix).unwrap_or(&n.name).to_string())
            }),
        intermediates: first.intermediates.clone(),
    })
}
