//! `qwen35 diff A.safetensors B.safetensors`: two dumps in the documented format (from any backend or program)
//! compared with the metrics and reports of compare-devices, `B` being the reference. A dump needs only the tensors
//! it has: whatever both hold is compared, and what one side lacks is listed. An MoE model's chosen experts are
//! indices, not values: they are scored as routing agreement ([`crate::routing`]), never by NRMSE.

use super::Outcome;
use super::args::{ReportArgs, ThresholdArgs};
use crate::compare::{DeviceReport, Row, Side, Thresholds, compare_runs};
use crate::dump::Dump;
use crate::metrics::{TensorError, exceeds};
use crate::outputs::Paths;
use crate::report::{CompareReport, Inputs, Machine, Report as _};
use crate::routing::chosen_name;
use anyhow::{Context, Result, bail};
use npu::graphset::StateKind;
use reference::backend::RunRecord;
use reference::config::{Config, LayerKind};
use reference::taps::names;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Arguments of `qwen35 diff`.
#[derive(clap::Args)]
pub struct DiffArgs {
    /// The dump under test.
    actual: PathBuf,
    /// The reference dump.
    reference: PathBuf,
    /// The checkpoint the dumps were made from: the layers' kinds when neither dump's names tell them.
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    #[command(flatten)]
    thresholds: ThresholdArgs,
    #[command(flatten)]
    report: ReportArgs,
}

/// The token ids of a dump's integer tensor `name` (one axis), each checked to be below `vocab` (the logits' width).
fn ids(d: &Dump, name: &str, path: &Path, vocab: usize) -> Result<Vec<u32>> {
    let t = d.get(name).with_context(|| path.display().to_string())?;
    let at = || format!("{}: `{name}`", path.display());
    if t.rank() != 1 || t.dtype().is_float() {
        bail!(
            "{}: token ids are integers along one axis; this one is {:?} {:?}",
            at(),
            t.dtype(),
            t.dims()
        );
    }
    let raw = t.to_dtype(candle_core::DType::I64)?.to_vec1::<i64>()?;
    if let Some((i, x)) = raw
        .iter()
        .enumerate()
        .find(|(_, x)| !(0..vocab as i64).contains(x))
    {
        bail!(
            "{}: id {x} at index {i} is outside the vocabulary of {vocab} (the logits' width)",
            at()
        );
    }
    Ok(raw.into_iter().map(|x| x as u32).collect())
}

/// The layers a dump's names mention (`layers.{i}.…`): how many there are.
fn layer_count(d: &Dump) -> usize {
    d.tensors
        .keys()
        .filter_map(|k| {
            k.strip_prefix("layers.")?
                .split('.')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .map(|l| l + 1)
        .max()
        .unwrap_or(0)
}

/// The kind a dump's names imply for `layer`: `linear_attn` taps or a conv/recurrent state mean linear attention,
/// `self_attn` taps or a KV cache full attention; `None` when the dump holds nothing of either.
fn kind_in(d: &Dump, layer: usize) -> Option<LayerKind> {
    let has = |part: &str| {
        let prefix = names::layer(layer, part);
        d.tensors.keys().any(|k| k.starts_with(&prefix))
    };
    if has(names::LINEAR_ATTN) || has(names::CONV_STATE) || has(names::RECURRENT_STATE) {
        Some(LayerKind::Linear)
    } else if has(names::SELF_ATTN) || has(names::KEY_CACHE) || has(names::VALUE_CACHE) {
        Some(LayerKind::Full)
    } else {
        None
    }
}

/// Every layer's kind: from whichever dump tells it, else from `config`, else unknown. Fails when the two dumps
/// (or a dump and the config) disagree: they are of different models.
fn kinds(
    a: (&Dump, &Path),
    b: (&Dump, &Path),
    config: Option<&Config>,
) -> Result<Vec<Option<LayerKind>>> {
    let n = layer_count(a.0)
        .max(layer_count(b.0))
        .max(config.map_or(0, |c| c.num_layers()));
    let mut out = Vec::with_capacity(n);
    for layer in 0..n {
        let from_config = config.and_then(|c| c.layer_types.get(layer).copied());
        let seen = [
            (kind_in(a.0, layer), a.1.display().to_string()),
            (kind_in(b.0, layer), b.1.display().to_string()),
            (from_config, "--model".to_string()),
        ];
        let mut kind: Option<(LayerKind, &str)> = None;
        for (k, source) in &seen {
            match (kind, k) {
                (None, Some(k)) => kind = Some((*k, source)),
                (Some((have, first)), Some(k)) if have != *k => bail!(
                    "layer {layer} is {} in {first} but {} in {source}: the dumps are of different models",
                    have.name(),
                    k.name()
                ),
                _ => {}
            }
        }
        out.push(kind.map(|(k, _)| k));
    }
    Ok(out)
}

/// Tensors by name.
type Tensors = BTreeMap<String, candle_core::Tensor>;

/// A dump's hidden states (every tensor but the ids, the logits and the states) and its states (integers among them
/// were refused by [`refuse_integer_values`]).
fn split(d: &Dump) -> (Tensors, Tensors) {
    let is_state = |k: &str| StateKind::ALL.iter().any(|s| k.ends_with(s.key()));
    let mut taps = BTreeMap::new();
    let mut states = BTreeMap::new();
    for (k, v) in &d.tensors {
        if k.as_str() == "token_ids" || k.as_str() == "generated" || k.as_str() == names::LOGITS {
            continue;
        }
        let side = if is_state(k) { &mut states } else { &mut taps };
        side.insert(k.clone(), v.clone());
    }
    (taps, states)
}

/// The generated ids a dump holds (none when it has no `generated`).
fn generated(d: &Dump, p: &Path, vocab: usize) -> Result<Vec<u32>> {
    if d.tensors.contains_key("generated") {
        ids(d, "generated", p, vocab)
    } else {
        Ok(vec![])
    }
}

/// What ran, from a dump's metadata; a value that does not parse names the dump and its key.
fn record_of(d: &Dump, p: &Path) -> Result<RunRecord> {
    RunRecord::from_metadata(&d.metadata).with_context(|| p.display().to_string())
}

/// Fails on a tensor of values (a hidden state, a state, the logits) stored as integers in `d`: a cast would compare
/// numbers no model wrote. Ids and chosen experts are the integers a dump holds.
fn refuse_integer_values(d: &Dump, p: &Path) -> Result<()> {
    let is_index = |k: &str| {
        k == "token_ids"
            || k == "generated"
            || k == crate::dump::POSITIONS
            || k.ends_with(names::EXPERTS_CHOSEN)
    };
    if let Some((k, t)) = d
        .tensors
        .iter()
        .find(|(k, t)| !is_index(k) && !t.dtype().is_float())
    {
        bail!(
            "{}: `{k}` holds {:?} integers; hidden states, states and logits are floats (an integer tensor is never \
             cast and compared)",
            p.display(),
            t.dtype()
        );
    }
    Ok(())
}

/// Fails unless the dump `d` (at `p`) is of the model `config` (at `dir`, `--model`): its layers within the model's,
/// its logits over the model's vocabulary (`vocab`: the dumps' width), its residual stream of the model's hidden
/// size; naming both sides.
fn belongs(d: &Dump, p: &Path, config: &Config, dir: &Path, vocab: usize) -> Result<()> {
    let model = || format!("--model {}", dir.display());
    if vocab != config.vocab_size {
        bail!(
            "{} has logits over {vocab} tokens, and {} has a vocabulary of {}: the dumps are not of this model",
            p.display(),
            model(),
            config.vocab_size
        );
    }
    let layers = config.num_layers() as u64;
    let named = d
        .tensors
        .keys()
        .filter_map(|k| crate::dump::layer_of(k))
        .max();
    if let Some(last) = named
        && last + 1 < layers
    {
        bail!(
            "{} names layers up to {last}, and {} has {layers} layers: the dump is not of this model",
            p.display(),
            model()
        );
    }
    for (k, t) in &d.tensors {
        let Some(layer) = crate::dump::layer_of(k) else {
            continue;
        };
        if layer >= layers {
            bail!(
                "{}: `{k}` is of layer {layer}, and {} has {layers} layers: the dump is not of this model",
                p.display(),
                model()
            );
        }
        let stream = [names::OUTPUT, names::MIXER_OUTPUT, names::MLP_OUTPUT];
        if stream.iter().any(|s| k.ends_with(&format!(".{s}")))
            && t.dims().last() != Some(&config.hidden_size)
        {
            bail!(
                "{}: `{k}` is {:?}, and {} has a hidden size of {}: the dump is not of this model",
                p.display(),
                t.dims(),
                model(),
                config.hidden_size
            );
        }
    }
    Ok(())
}

/// The first of `rows` in the order the decoder computes them that leaves tolerance (see
/// [`crate::compare::FirstDivergence::tensor`]), with the measure that does.
fn first_tensor_over(rows: &[Row], t: &Thresholds) -> Option<(String, f64)> {
    let mut ordered: Vec<&Row> = rows.iter().collect();
    ordered.sort_by(|a, b| {
        (names::computation_order(&a.name), &a.name)
            .cmp(&(names::computation_order(&b.name), &b.name))
    });
    ordered.into_iter().find_map(|r| {
        let is_state = StateKind::ALL.iter().any(|s| r.name.ends_with(s.key()));
        let (measure, max) = if r.name == names::LOGITS {
            (r.error.nmse.get(), t.max_logits_nmse)
        } else if is_state {
            (r.error.nrmse.get(), t.max_state_nrmse)
        } else {
            (r.error.nrmse.get(), t.max_layer_nrmse)
        };
        (exceeds(measure, max) || !r.error.finite()).then(|| (r.name.clone(), measure))
    })
}

/// Runs `qwen35 diff`.
pub fn exec(args: DiffArgs) -> Result<Outcome> {
    Paths::new()
        .input("ACTUAL", Some(&args.actual))
        .input("REFERENCE", Some(&args.reference))
        .input("--model", args.model.as_ref())
        .with(&args.report)
        .check()?;
    let thresholds = args.thresholds.overrides()?;
    let outputs = args.report.outputs()?;
    let config = match &args.model {
        Some(dir) => Some(
            reference::gguf::model_config(dir)
                .with_context(|| format!("--model {}", dir.display()))?,
        ),
        None => None,
    };
    let a = Dump::read(&args.actual)?;
    let b = Dump::read(&args.reference)?;
    let logits = |d: &Dump, p: &Path| -> Result<candle_core::Tensor> {
        let t = d.get(names::LOGITS).with_context(|| {
            format!(
                "{}: logits are what every comparison starts from",
                p.display()
            )
        })?;
        if t.rank() != 2 || !t.dtype().is_float() {
            bail!(
                "{}: `logits` must be floats [T, V]; this one is {:?} {:?}",
                p.display(),
                t.dtype(),
                t.dims()
            );
        }
        Ok(t.clone())
    };
    let (logits_a, logits_b) = (logits(&a, &args.actual)?, logits(&b, &args.reference)?);
    let vocab = logits_b.dim(1)?;
    if logits_a.dim(1)? != vocab {
        bail!(
            "{} has logits over {} tokens, {} over {vocab}: the dumps are of different models",
            args.actual.display(),
            logits_a.dim(1)?,
            args.reference.display()
        );
    }
    let (ids_a, ids_b) = (
        ids(&a, "token_ids", &args.actual, vocab)?,
        ids(&b, "token_ids", &args.reference, vocab)?,
    );
    if ids_a != ids_b {
        bail!(
            "{} and {} ran different prompts ({} and {} tokens, first difference at {})",
            args.actual.display(),
            args.reference.display(),
            ids_a.len(),
            ids_b.len(),
            ids_a
                .iter()
                .zip(&ids_b)
                .position(|(x, y)| x != y)
                .unwrap_or(ids_a.len().min(ids_b.len()))
        );
    }
    for (d, p) in [(&a, &args.actual), (&b, &args.reference)] {
        refuse_integer_values(d, p)?;
        if let (Some(c), Some(dir)) = (&config, &args.model) {
            belongs(d, p, c, dir, vocab)?;
        }
    }
    let kinds = kinds((&a, &args.actual), (&b, &args.reference), config.as_ref())?;
    // Greedy tokens are compared when both dumps hold them.
    let (mut gen_a, mut gen_b) = (
        generated(&a, &args.actual, vocab)?,
        generated(&b, &args.reference, vocab)?,
    );
    if gen_a.is_empty() || gen_b.is_empty() {
        gen_a.clear();
        gen_b.clear();
    }
    let ((taps_a, states_a), (taps_b, states_b)) = (split(&a), split(&b));
    let label = args
        .actual
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("actual")
        .to_string();
    let mut comparison = compare_runs(
        &label,
        &kinds,
        Side {
            prompt_tokens: ids_b.len(),
            tokens: &gen_b,
            logits: &logits_b,
            taps: &taps_b,
            states: &states_b,
        },
        Side {
            prompt_tokens: ids_a.len(),
            tokens: &gen_a,
            logits: &logits_a,
            taps: &taps_a,
            states: &states_a,
        },
        &[],
    )?;
    let record = record_of(&a, &args.actual)?;
    let thresholds = thresholds.resolve(&record.judged_precision());
    let only = |x: &Dump, y: &Dump| -> Vec<String> {
        x.tensors
            .keys()
            .filter(|k| !y.tensors.contains_key(*k))
            .cloned()
            .collect()
    };
    let (only_a, only_b) = (only(&a, &b), only(&b, &a));
    if !only_a.is_empty() || !only_b.is_empty() {
        comparison.not_available = Some(format!(
            "{} tensor(s) only in {}, {} only in {} (listed below)",
            only_a.len(),
            args.actual.display(),
            only_b.len(),
            args.reference.display()
        ));
    }
    let mut device = DeviceReport::new(&label, record, thresholds, vec![comparison]);
    // Every tensor both dumps hold (the chosen experts in `routing`), and those only one has.
    let chosen: BTreeSet<String> = (0..kinds.len()).map(chosen_name).collect();
    for (name, ta) in &a.tensors {
        if let Some(tb) = b.tensors.get(name)
            && name != "token_ids"
            && name != "generated"
            && !chosen.contains(name)
        {
            device.tensors.push(Row {
                name: name.clone(),
                layer: None,
                error: TensorError::of(ta, tb).with_context(|| format!("`{name}`"))?,
            });
        }
    }
    device.first_divergence.tensor = first_tensor_over(&device.tensors, &device.thresholds);
    device.only_in_actual = only_a;
    device.only_in_reference = only_b;
    let report = CompareReport {
        command: "diff".into(),
        machine: Machine::detect(),
        inputs: Inputs {
            model: b
                .metadata
                .get("model")
                .cloned()
                .unwrap_or_else(|| args.reference.display().to_string()),
            weights: b.metadata.get("weights").cloned().unwrap_or_default(),
            prompts: vec![(label, ids_a.len())],
            tokens: gen_b.len(),
            reference: record_of(&b, &args.reference)?,
        },
        quantization: None,
        devices: vec![device],
        memory: None,
    };
    report.emit(&outputs)?;
    Ok(if report.passed() {
        Outcome::Pass
    } else {
        Outcome::Fail
    })
}
