//! The routing report from two sides' taps under the dump's names: per layer `mlp.experts_chosen` `[T, k]` (integers,
//! any dtype holding them exactly), `mlp.router_logits` `[T, E]` where a side has it, and the per-token errors of
//! `mlp_output`, `output`, `mixer_output` and the layer's input.

use super::{LayerSides, Reach, Router, RoutingReport, compare_with, probabilities};
use crate::metrics::{Measure, per_slice, values};
use anyhow::{Context, Result, bail};
use candle_core::Tensor;
use reference::taps::names;
use std::collections::BTreeMap;

/// The dump's name of layer `layer`'s chosen experts.
pub fn chosen_name(layer: usize) -> String {
    names::layer(layer, &names::mixer(names::MLP, names::EXPERTS_CHOSEN))
}

/// The dump's name of layer `layer`'s router logits.
fn logits_name(layer: usize) -> String {
    names::layer(layer, &names::mixer(names::MLP, names::ROUTER_LOGITS))
}

/// The rows of a `[T, n]` tap as f64 vectors, naming it and the side on a bad shape.
fn rows_of(t: &Tensor, name: &str, side: &str) -> Result<Vec<Vec<f64>>> {
    let &[rows, n] = t.dims() else {
        bail!(
            "{side}'s `{name}` is {:?}; it must be [tokens, n]",
            t.dims()
        );
    };
    let flat = values(t).with_context(|| format!("{side}'s `{name}`"))?;
    Ok((0..rows)
        .map(|i| flat[i * n..(i + 1) * n].to_vec())
        .collect())
}

/// A side's chosen experts: whole numbers in `0..experts` (when known), naming the tap and the side otherwise.
fn chosen_of(
    t: &Tensor,
    name: &str,
    side: &str,
    experts: Option<usize>,
) -> Result<Vec<Vec<usize>>> {
    rows_of(t, name, side)?
        .into_iter()
        .enumerate()
        .map(|(token, row)| {
            row.into_iter()
                .map(|x| {
                    let whole = x.fract() == 0.0 && x >= 0.0;
                    if !whole || experts.is_some_and(|e| x >= e as f64) {
                        bail!(
                            "{side}'s `{name}` holds {x} at token {token}: an expert index is a whole number{}",
                            experts.map_or(String::new(), |e| format!(" below {e} (the router's width)"))
                        );
                    }
                    Ok(x as usize)
                })
                .collect()
        })
        .collect()
}

/// The per-token NRMSE of tap `name` when both sides hold it.
fn per_token(
    name: &str,
    reference: &BTreeMap<String, Tensor>,
    device: &BTreeMap<String, Tensor>,
) -> Result<Option<Vec<Measure>>> {
    let (Some(d), Some(r)) = (device.get(name), reference.get(name)) else {
        return Ok(None);
    };
    let errors = per_slice(d, r, 0).with_context(|| format!("`{name}`"))?;
    Ok(Some(errors.iter().map(|e| e.nrmse).collect()))
}

/// The routing of layers `0..layers` of one prompt from both sides' taps (`reference` first), over the layers where
/// both hold the chosen experts; `None` when no layer has them on both sides (a dense model, or a device that does
/// not expose them). Flips are judged against the measured router error ([`RoutingReport::classify`] adds a
/// stated one). Fails, naming the tap, on taps that cannot be routing: other shapes, token counts or widths on the
/// two sides, an index that is not an expert's. The run is a decoder's ([`Reach::Chained`]).
pub fn from_taps(
    prompt: &str,
    layers: usize,
    reference: &BTreeMap<String, Tensor>,
    device: &BTreeMap<String, Tensor>,
) -> Result<Option<RoutingReport>> {
    from_taps_with(prompt, layers, reference, device, &Reach::Chained)
}

/// [`from_taps`] of a run whose earlier flips reach later tokens as `reach` says (the probe's isolated modes).
pub fn from_taps_with(
    prompt: &str,
    layers: usize,
    reference: &BTreeMap<String, Tensor>,
    device: &BTreeMap<String, Tensor>,
    reach: &Reach,
) -> Result<Option<RoutingReport>> {
    let mut sides = Vec::new();
    for layer in 0..layers {
        let chosen = chosen_name(layer);
        let (Some(rc), Some(dc)) = (reference.get(&chosen), device.get(&chosen)) else {
            continue;
        };
        if rc.dims() != dc.dims() {
            bail!(
                "`{chosen}` is {:?} against the reference's {:?}: the sides route different tokens or numbers of \
                 experts",
                dc.dims(),
                rc.dims()
            );
        }
        let logits = logits_name(layer);
        let router =
            |map: &BTreeMap<String, Tensor>, side: &str| -> Result<Option<Vec<Vec<f64>>>> {
                let Some(t) = map.get(&logits) else {
                    return Ok(None);
                };
                let rows = rows_of(t, &logits, side)?;
                if rows.len() != rc.dim(0)? {
                    bail!(
                        "{side}'s `{logits}` has {} rows against {} tokens of `{chosen}`",
                        rows.len(),
                        rc.dim(0)?
                    );
                }
                Ok(Some(rows.iter().map(|r| probabilities(r)).collect()))
            };
        let (rp, dp) = (
            router(reference, "the reference")?,
            router(device, "the device")?,
        );
        let width = |p: &Option<Vec<Vec<f64>>>| p.as_ref().and_then(|p| p.first()).map(Vec::len);
        if let (Some(a), Some(b)) = (width(&rp), width(&dp))
            && a != b
        {
            bail!("`{logits}` routes among {b} experts against the reference's {a}");
        }
        let experts = width(&rp).or(width(&dp));
        let input = match layer {
            0 => names::EMBEDDINGS.to_string(),
            l => names::layer(l - 1, names::OUTPUT),
        };
        sides.push(LayerSides {
            layer,
            reference: Router {
                chosen: chosen_of(rc, &chosen, "the reference", experts)?,
                probabilities: rp,
            },
            device: Router {
                chosen: chosen_of(dc, &chosen, "the device", experts)?,
                probabilities: dp,
            },
            mlp_nrmse: per_token(&names::layer(layer, names::MLP_OUTPUT), reference, device)?,
            output_nrmse: per_token(&names::layer(layer, names::OUTPUT), reference, device)?,
            input_nrmse: per_token(&input, reference, device)?,
            mixer_nrmse: per_token(&names::layer(layer, names::MIXER_OUTPUT), reference, device)?,
        });
    }
    if sides.is_empty() {
        return Ok(None);
    }
    compare_with(prompt, &sides, reach).map(Some)
}
