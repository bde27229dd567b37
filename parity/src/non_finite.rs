//! NaN and infinity as findings: a device (or a dump, or a checkpoint) that produces them has failed, and the report
//! says where they first appear, in the order the decoder computes, so that the search starts at the right layer.

use crate::device::open_reference;
use crate::metrics::values;
use anyhow::Result;
use candle_core::Tensor;
use reference::backend::Backend;
use reference::config::Config;
use reference::model::RunOptions;
use reference::schema::Schema;
use reference::taps::names::{self, computation_order};
use reference::weights::WeightStore;
use serde::Serialize;
use std::collections::BTreeMap;

/// The non-finite values of one tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NonFinite {
    /// The tensor's dump name (or a checkpoint's tensor name).
    pub name: String,
    /// Elements that are NaN.
    pub nan: usize,
    /// Elements that are +∞ or −∞.
    pub inf: usize,
    /// Elements in the tensor.
    pub count: usize,
    /// The tensor's shape.
    pub shape: Vec<usize>,
    /// The index of the first non-finite element (row-major): for a token-major tap its first entry is the first
    /// position that holds one.
    pub first: Vec<usize>,
}

impl NonFinite {
    /// The non-finite values of `t`, or `None` when every element is finite (integer tensors are always finite).
    pub fn scan(name: &str, t: &Tensor) -> Result<Option<Self>> {
        if !t.dtype().is_float() {
            return Ok(None);
        }
        Ok(Self::of_values(name, t.dims(), &values(t)?))
    }

    /// [`NonFinite::scan`] on flat row-major values of a tensor of `shape`.
    pub fn of_values(name: &str, shape: &[usize], flat: &[f64]) -> Option<Self> {
        let (mut nan, mut inf, mut first) = (0, 0, None);
        for (i, x) in flat.iter().enumerate() {
            if x.is_nan() {
                nan += 1;
            } else if x.is_infinite() {
                inf += 1;
            } else {
                continue;
            }
            first.get_or_insert(i);
        }
        let first = first?;
        Some(NonFinite {
            name: name.to_string(),
            nan,
            inf,
            count: flat.len(),
            shape: shape.to_vec(),
            first: unravel(first, shape),
        })
    }

    /// One line: the name, the counts and where the first is.
    pub fn describe(&self) -> String {
        let what = match (self.nan, self.inf) {
            (n, 0) => format!("{n} NaN"),
            (0, i) => format!("{i} infinite"),
            (n, i) => format!("{n} NaN and {i} infinite"),
        };
        let at = match self.position() {
            Some(p) => format!("position {p} (index {:?})", self.first),
            None => format!("index {:?}", self.first),
        };
        format!(
            "`{}` {:?}: {what} of {} values, the first at {at}",
            self.name, self.shape, self.count
        )
    }

    /// The token position of the first non-finite value when the tensor is a token-major dump tensor (an
    /// embedding, a tap, the final norm, the logits; not a state nor a checkpoint's tensor).
    pub fn position(&self) -> Option<usize> {
        let (stage, _, step) = computation_order(&self.name);
        // A layer's states come after its output (steps 130.. in `computation_order`).
        let token_major = stage <= 3 && !(stage == 1 && (130..200).contains(&step));
        token_major.then(|| self.first.first().copied()).flatten()
    }
}

/// The multi-index of flat position `i` in a row-major tensor of `shape`.
fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut index = vec![0; shape.len()];
    for (axis, &d) in shape.iter().enumerate().rev() {
        if d > 0 {
            index[axis] = i % d;
            i /= d;
        }
    }
    index
}

/// Every tensor of `tensors` holding a non-finite value, in the order the decoder computes them (the first is where
/// the fault shows first).
pub fn scan_all<'a>(
    tensors: impl IntoIterator<Item = (&'a String, &'a Tensor)>,
) -> Result<Vec<NonFinite>> {
    let mut found = Vec::new();
    for (name, t) in tensors {
        if let Some(f) = NonFinite::scan(name, t)? {
            found.push(f);
        }
    }
    sort(&mut found);
    Ok(found)
}

/// Sorts findings in the order the decoder computes the tensors (then by name).
pub fn sort(found: &mut [NonFinite]) {
    found.sort_by(|a, b| {
        computation_order(&a.name)
            .cmp(&computation_order(&b.name))
            .then_with(|| a.name.cmp(&b.name))
    });
}

/// The findings of several maps of tensors together (the logits, the taps, the states of one run), in computation
/// order.
pub fn scan_maps(maps: &[&BTreeMap<String, Tensor>]) -> Result<Vec<NonFinite>> {
    scan_all(maps.iter().flat_map(|m| m.iter()))
}

/// A sentence for a report: how many tensors hold non-finite values and the first of them, or `None`.
pub fn summary(found: &[NonFinite]) -> Option<String> {
    let first = found.first()?;
    Some(if found.len() == 1 {
        format!("non-finite values in 1 tensor: {}", first.describe())
    } else {
        format!(
            "non-finite values in {} tensors, first (in computation order) {}",
            found.len(),
            first.describe()
        )
    })
}

/// Every tensor of the checkpoint holding a non-finite value, under its checkpoint name, in the schema's order.
pub fn scan_weights(config: &Config, store: &WeightStore) -> Result<Vec<NonFinite>> {
    let mut found = Vec::new();
    for spec in Schema::new(config).tensors() {
        let name = store.full_name(&spec);
        if let Some(f) = NonFinite::scan(&name, &store.load(&spec)?)? {
            found.push(f);
        }
    }
    Ok(found)
}

/// Why a reference run's logits held NaN: the prompt run again with every tap, and the checkpoint scanned, so the
/// message names the first tensor (in computation order) and the weights that hold non-finite values.
pub fn explain_reference(
    config: &Config,
    store: &WeightStore,
    opts: RunOptions,
    ids: &[u32],
) -> Result<String> {
    let mut backend = open_reference(config, store, opts, true)?;
    backend.reset()?;
    let run = backend.forward(ids, true)?;
    let mut taps = run.taps;
    taps.insert(names::LOGITS.into(), run.logits);
    let found = scan_maps(&[&taps])?;
    let mut why = match found.first() {
        Some(first) => format!(
            "the first non-finite value over the prompt is in {} ({} tensor(s) affected)",
            first.describe(),
            found.len()
        ),
        None => {
            "the prompt's tensors are finite (the fault is in a later single-token step)".into()
        }
    };
    let weights = scan_weights(config, store)?;
    if weights.is_empty() {
        why.push_str("; every weight of the checkpoint is finite");
    } else {
        let listed: Vec<String> = weights.iter().take(4).map(NonFinite::describe).collect();
        why.push_str(&format!(
            "; {} tensor(s) of the checkpoint hold non-finite values: {}",
            weights.len(),
            listed.join("; ")
        ));
    }
    Ok(why)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_is_found_in_computation_order() {
        let t = |v: Vec<f32>| Tensor::from_vec(v, (2, 2), &candle_core::Device::Cpu).unwrap();
        let mut m = BTreeMap::new();
        m.insert("logits".to_string(), t(vec![f32::NAN; 4]));
        m.insert(
            "layers.1.output".to_string(),
            t(vec![0.0, 0.0, f32::INFINITY, f32::NAN]),
        );
        m.insert(
            "layers.1.linear_attn.core_output".to_string(),
            t(vec![0.0, 0.0, 0.0, f32::NAN]),
        );
        m.insert("layers.0.output".to_string(), t(vec![1.0; 4]));
        m.insert("layers.10.output".to_string(), t(vec![f32::NAN; 4]));
        let found = scan_maps(&[&m]).unwrap();
        let names: Vec<&str> = found.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "layers.1.linear_attn.core_output",
                "layers.1.output",
                "layers.10.output",
                "logits"
            ]
        );
        assert_eq!(
            (found[0].nan, found[0].inf, found[0].first.clone()),
            (1, 0, vec![1, 1])
        );
        assert_eq!(
            (found[1].nan, found[1].inf, found[1].first.clone()),
            (1, 1, vec![1, 0])
        );
        assert!(summary(&found).unwrap().contains("4 tensors"));
        assert_eq!(found[0].position(), Some(1));
        let state =
            NonFinite::of_values("layers.0.recurrent_state", &[2], &[0.0, f64::NAN]).unwrap();
        assert_eq!((state.position(), state.first.clone()), (None, vec![1]));
        assert!(summary(&[]).is_none());
        let ids = Tensor::new(&[1i64, 2], &candle_core::Device::Cpu).unwrap();
        assert!(NonFinite::scan("token_ids", &ids).unwrap().is_none());
    }
}
