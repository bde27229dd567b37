//! The whole-decoder graphs on a device, as a [`Backend`]: padded prompt blocks, single-token decode, the caches
//! on the host.

use super::{BlockInputs, Collector, HostLayerState};
use crate::devices::CompileOptions;
use crate::error::{Error, Result};
use crate::graphs::{Builder, ports};
use crate::infer::{Executor, prepare};
use crate::ir::SharedBin;
use candle_core::{Device, Tensor};
use reference::backend::{Backend, Forward, RunRecord, Snapshot};
use reference::config::Config;
use reference::taps::names;
use std::collections::BTreeMap;

/// The whole-decoder graphs compiled on a device: one for prompt blocks of `block` tokens and one for single-token
/// decode, with every cache kept on the host and handed between calls.
pub struct DecoderEngine {
    prefill: Option<Box<dyn Executor>>,
    decode: Box<dyn Executor>,
    block: usize,
    context: usize,
    config: Config,
    states: Vec<HostLayerState>,
    position: usize,
    record: RunRecord,
}

impl DecoderEngine {
    /// Builds and compiles the decoder graphs (prompt blocks of `block` tokens, and 1 token) for `device`.
    pub fn new(
        builder: &Builder,
        block: usize,
        device: &str,
        opts: &CompileOptions,
    ) -> Result<Self> {
        if block == 0 {
            return Err(Error::Input(
                "a prompt block must hold at least 1 token".into(),
            ));
        }
        let start = std::time::Instant::now();
        // On an OpenVINO device both graphs stream their constants to one `.bin` and point into it: the weights are
        // compressed and written once, never held in memory, and while each graph compiles the file's pages (which
        // the CPU plugin reads once, copying the weights into its own layout) are handed back every 250 ms
        // (`crate::pages`). FP16SIM evaluates graphs held in memory.
        let shared = if crate::sim::NumericModel::is_sim(device) {
            None
        } else {
            let scratch = crate::devices::ScratchDir::new()?;
            let bin = SharedBin::create(&scratch.0.join("weights.bin"))?;
            Some((scratch, bin))
        };
        let session = |tokens: usize| -> Result<Box<dyn Executor>> {
            let bin = shared.as_ref().map(|(_, bin)| bin);
            let graph = builder.decoder_graph_on(tokens, bin)?;
            let releaser = match bin {
                Some(bin) => Some(crate::pages::Releaser::start(
                    vec![bin.path()?],
                    std::time::Duration::from_millis(250),
                )),
                None => None,
            };
            let executor = prepare(graph, device, opts)?;
            drop(releaser);
            Ok(executor)
        };
        let decode = session(1)?;
        let prefill = if block > 1 {
            Some(session(block)?)
        } else {
            None
        };
        drop(shared);
        let config = builder.config().clone();
        let graph = *builder.options();
        let context = graph.context;
        let states = (0..config.num_layers())
            .map(|l| HostLayerState::zeros(&config, l, context))
            .collect::<Result<_>>()?;
        let infos: Vec<_> = prefill.iter().chain([&decode]).map(|e| e.info()).collect();
        let record = RunRecord {
            compile_seconds: Some(start.elapsed().as_secs_f64()),
            ..record_of(&infos, builder, block, opts)?
        };
        Ok(DecoderEngine {
            prefill,
            decode,
            block,
            context,
            config,
            states,
            position: 0,
            record,
        })
    }

    /// What the graphs (prompt, decode) were prepared with.
    pub fn infos(&self) -> Vec<&crate::devices::ExecInfo> {
        self.prefill
            .iter()
            .chain(std::iter::once(&self.decode))
            .map(|e| e.info())
            .collect()
    }

    /// The static KV context.
    pub fn context(&self) -> usize {
        self.context
    }

    /// The per-layer states after the last call.
    pub fn states(&self) -> &[HostLayerState] {
        &self.states
    }

    /// Runs `ids` through the graph of `tokens` slots (`ids.len() <= tokens`), updating the states; returns the
    /// outputs of the valid rows.
    fn run_block(&mut self, ids: &[u32], tokens: usize) -> Result<BTreeMap<String, Tensor>> {
        let valid = ids.len();
        let b = BlockInputs::new(tokens, valid, self.position, self.position, self.context)?;
        let mut padded: Vec<i64> = ids.iter().map(|&x| x as i64).collect();
        padded.resize(tokens, 0);
        let mut inputs = vec![(
            ports::INPUT_IDS.to_string(),
            Tensor::from_vec(padded, tokens, &Device::Cpu)?,
        )];
        inputs.extend(b.named());
        for (i, s) in self.states.iter().enumerate() {
            inputs.extend(s.feed(&ports::layer_prefix(i)));
        }
        let session = if tokens == 1 {
            &mut self.decode
        } else {
            self.prefill
                .as_mut()
                .ok_or_else(|| Error::Interface("no prompt-block graph".into()))?
        };
        let mut r = session.run_declared(&inputs)?;
        for (i, s) in self.states.iter_mut().enumerate() {
            s.take_from(&mut r, &ports::layer_prefix(i), valid)?;
        }
        self.position += valid;
        r.into_iter()
            .map(|(k, v)| Ok((k, v.narrow(0, 0, valid)?)))
            .collect()
    }

    /// [`Backend::forward`]: the graph calls over `ids` and their outputs, token-major.
    fn forward_blocks(&mut self, ids: &[u32], all_logits: bool) -> Result<Forward> {
        if ids.is_empty() {
            return Err(Error::Input("no tokens to run".into()));
        }
        self.config.check_token_ids(ids)?;
        let tokens = if ids.len() == 1 { 1 } else { self.block };
        let mut collected = Collector::default();
        for piece in ids.chunks(tokens) {
            let r = self.run_block(piece, tokens)?;
            for (name, t) in &r {
                collected.push(name, t, piece.len())?;
            }
        }
        let mut taps = collected.finish()?;
        let logits = taps.remove(names::LOGITS).ok_or_else(|| {
            Error::Interface(format!("the graph has no output `{}`", names::LOGITS))
        })?;
        let logits = if all_logits {
            logits
        } else {
            logits.narrow(0, logits.dim(0)? - 1, 1)?
        };
        Ok(Forward { logits, taps })
    }
}

impl Backend for DecoderEngine {
    fn config(&self) -> &Config {
        &self.config
    }

    fn record(&self) -> &RunRecord {
        &self.record
    }

    fn reset(&mut self) -> reference::Result<()> {
        self.states = (0..self.config.num_layers())
            .map(|l| HostLayerState::zeros(&self.config, l, self.context))
            .collect::<Result<_>>()
            .map_err(into_reference)?;
        self.position = 0;
        Ok(())
    }

    /// One token runs through the single-token graph; more run in padded blocks of the prompt graph (or token by
    /// token when the prompt block is 1).
    fn forward(&mut self, ids: &[u32], all_logits: bool) -> reference::Result<Forward> {
        self.forward_blocks(ids, all_logits).map_err(into_reference)
    }

    fn snapshot(&self) -> reference::Result<Snapshot> {
        let mut tensors = BTreeMap::new();
        for (i, s) in self.states.iter().enumerate() {
            tensors.extend(s.dump_tensors(i).map_err(into_reference)?);
        }
        Ok(Snapshot {
            position: self.position,
            tensors,
        })
    }

    fn restore(&mut self, snapshot: &Snapshot) -> reference::Result<()> {
        let states = (0..self.config.num_layers())
            .map(|i| HostLayerState::from_snapshot(&self.config, i, self.context, snapshot))
            .collect::<Result<Vec<_>>>()
            .map_err(into_reference)?;
        self.states = states;
        self.position = snapshot.position;
        Ok(())
    }
}

/// What a device ran, from what its graphs were prepared with (`infos`, the first one standing for all but the
/// model cache, which is recorded per graph): the device's own name and driver (OpenVINO devices), the precision
/// that took effect, every property, the graph options, the weight format and the model cache.
pub fn record_of(
    infos: &[&crate::devices::ExecInfo],
    builder: &Builder,
    block: usize,
    opts: &CompileOptions,
) -> Result<RunRecord> {
    let info = *infos
        .first()
        .ok_or_else(|| Error::Interface("no compiled graph to describe".into()))?;
    let sim = crate::sim::NumericModel::is_sim(&info.device);
    let (runtime, device_name, driver) = if sim {
        (
            Some(format!("FP16SIM (qwen35 {})", env!("CARGO_PKG_VERSION"))),
            info.execution_devices.clone(),
            None,
        )
    } else {
        let d = crate::devices::describe(&crate::runtime::core()?, &info.device);
        (
            Some(crate::runtime::load()?.version.clone()),
            Some(d.full_name),
            d.driver_version,
        )
    };
    let graph = builder.options();
    Ok(RunRecord {
        backend: if sim { "fp16sim" } else { "openvino" }.into(),
        device: Some(info.device.clone()),
        runtime,
        device_name,
        driver,
        dtype: "f32".into(),
        precision_requested: Some(if sim {
            info.precision.clone()
        } else {
            opts.precision.hint().into()
        }),
        precision: Some(info.precision.clone()),
        execution_devices: info.execution_devices.clone(),
        properties: info.properties.clone(),
        weights: builder.weight_format().name(),
        deltanet_prefill: graph.form.describe_block(block),
        deltanet_decode: "matrix".into(),
        output_scale: graph.output_scale as f64,
        prefill_block: None,
        block: Some(block),
        context: Some(graph.context),
        taps: graph.taps,
        compile_seconds: Some(info.compile_seconds),
        cache_dir: info.cache_dir.as_ref().map(|d| d.display().to_string()),
        from_cache: infos
            .iter()
            .filter_map(|i| Some((i.graph.clone(), i.loaded_from_cache?)))
            .collect(),
    })
}

/// An error of this crate as the backend interface's error (which is the reference's).
fn into_reference(e: Error) -> reference::Error {
    match e {
        Error::Reference(e) => e,
        Error::Input(m) => reference::Error::Input(m),
        other => reference::Error::Backend(other.to_string()),
    }
}
