//! The device under test, whoever built its graphs: one interface that says what it exposes and hands out the
//! backends each check drives, so that compare-devices, the probe and every validate check are written once.
//!
//! Two implementations: [`own::OwnGraphs`], this project's graphs built from the checkpoint (any block size compiles,
//! hidden states come from a second set of graphs with every tap, per-layer graphs are built on demand), and
//! [`set::SetGraphs`], a graph set made elsewhere and read from files (`--ir DIR`: explicit-cache decoder graphs
//! keyed by tokens per call, a per-layer set chained into a decoder, a stateful export), whose capabilities are
//! what its manifest maps. A check asks [`DeviceUnderTest::capabilities`] whether it can run, and says in the
//! report which port it would need when it cannot.

pub mod fault;
pub mod layers;
pub mod llamacpp;
pub mod own;
mod pieces;
pub mod set;
pub mod settings;
pub mod target;

pub use layers::{DeviceLayers, LayerDevice};
pub use settings::DeviceSettings;

use anyhow::{Result, bail};
use npu::sim::NumericModel;
use reference::backend::{Backend, ReferenceBackend, RunRecord};
use reference::config::Config;
use reference::model::{Model, RunOptions};
use reference::weights::WeightStore;
use serde::Serialize;

/// What a device under test exposes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Capabilities {
    /// What kind of graphs: `this project's graphs`, `decoder set`, `per-layer set`, `stateful IR`.
    pub kind: &'static str,
    /// Every state is a port: compared with the reference's, snapshot and restored on the host.
    pub states: bool,
    /// Why the states are not compared when they are not (`not exposed: …`; empty when they are).
    pub states_note: &'static str,
    /// Hidden states come out (taps: every layer's output at least).
    pub hidden: bool,
    /// A prompt block can be padded (`token_valid`).
    pub token_valid: bool,
    /// A call of one token runs by itself (a 1-token graph, or a graph of any tokens per call), so a prompt can be
    /// fed without padding.
    pub single_token: bool,
    /// Each layer has its own graph (the probe's unit).
    pub layer_graphs: bool,
    /// An MoE layer's block can run on a routing given to it (the probe's fed routing): graphs built from the
    /// checkpoint, which can build the block alone.
    pub fed_routing: bool,
    /// Any block size can be compiled (this project's graphs); otherwise only [`Capabilities::blocks`].
    pub any_block: bool,
    /// The block sizes the graphs have (empty: any number of tokens per call).
    pub blocks: Vec<usize>,
    /// The deployed prompt block (`None`: a whole call at once).
    pub block: Option<usize>,
    /// The static context, if any.
    pub context: Option<usize>,
    /// Where the context comes from, as messages name it (`--context`, or the manifest).
    pub context_source: String,
}

/// One graph prepared for the device, as it reads back.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GraphInfo {
    /// What it was compiled for (`deployed`, `taps`, `block 1`, `probe layers`, …).
    pub purpose: String,
    /// The graph's name.
    pub graph: String,
    /// The inference precision read back.
    pub precision: String,
    /// `EXECUTION_DEVICES` read back after compiling.
    pub execution_devices: Option<String>,
    /// Seconds spent compiling it.
    pub compile_seconds: f64,
    /// Whether OpenVINO loaded the graph from its on-disk model cache (`--cache-dir`; on by default for NPU); null
    /// without a cache, or for several graphs of which only some came from it.
    pub loaded_from_cache: Option<bool>,
}

impl GraphInfo {
    /// The graph `info` describes, compiled for `purpose`.
    pub fn of(purpose: &str, info: &npu::devices::ExecInfo) -> Self {
        GraphInfo {
            purpose: purpose.to_string(),
            graph: info.graph.clone(),
            precision: info.precision.clone(),
            execution_devices: info.execution_devices.clone(),
            compile_seconds: info.compile_seconds,
            loaded_from_cache: info.loaded_from_cache,
        }
    }
}

/// Every graph a device compiled, in order, with what it was compiled for.
#[derive(Debug, Default)]
pub struct GraphLog(std::cell::RefCell<Vec<GraphInfo>>);

impl GraphLog {
    /// Logs the graphs `infos` describe as compiled for `purpose`.
    pub fn add<'i>(
        &self,
        purpose: &str,
        infos: impl IntoIterator<Item = &'i npu::devices::ExecInfo>,
    ) {
        self.0
            .borrow_mut()
            .extend(infos.into_iter().map(|i| GraphInfo::of(purpose, i)));
    }

    /// Every graph logged.
    pub fn all(&self) -> Vec<GraphInfo> {
        self.0.borrow().clone()
    }
}

/// A device under test: its deployed graphs and whatever else it exposes.
pub trait DeviceUnderTest {
    /// How reports name it (`CPU`, `CPU IR tiny-stateless`).
    fn label(&self) -> &str;

    /// The device it runs on.
    fn device(&self) -> &str;

    /// What it exposes.
    fn capabilities(&self) -> &Capabilities;

    /// What the deployed graphs ran (compiling them if no check has yet).
    fn record(&mut self) -> Result<RunRecord>;

    /// The graphs as deployed (this project's are compiled on first use: a probe through per-layer graphs never
    /// compiles the whole decoder, which an NPU may not manage).
    fn deployed(&mut self) -> Result<&mut dyn Backend>;

    /// Graphs with hidden outputs when they are other graphs than the deployed ones (this project's, compiled with
    /// every tap on first use); `None` when the deployed graphs carry whatever hidden outputs there are.
    fn tapped(&mut self) -> Result<Option<&mut dyn Backend>>;

    /// The deployed graphs with every call fed in pieces of at most `block` tokens: this project's graphs compile
    /// that block size; a set's calls are cut into pieces its host rule runs.
    fn with_block(&mut self, block: usize) -> Result<Box<dyn Backend + '_>>;

    /// Pads a prompt's last block (`true`, the deployed rule where `token_valid` is mapped) or feeds it unpadded:
    /// full blocks, then single tokens.
    fn set_padding(&mut self, padded: bool) -> Result<()>;

    /// Hands back the memory of the graphs compiled so far, for a check that is done with them before the next one
    /// compiles others: one copy of the weights is resident at a time. This project's deployed and tapped graphs
    /// compile again on their next use (what the deployed ones recorded, and how they pad, are kept); a set read
    /// from files keeps its one set.
    fn release(&mut self);

    /// A freshly compiled copy of the deployed graphs.
    fn fresh(&self) -> Result<Box<dyn Backend>>;

    /// Per-layer graphs of `layers` for blocks of `block` tokens, when the device has per-layer graphs (this
    /// project's are compiled a layer at a time as they are run).
    fn layers(&self, layers: &[usize], block: usize) -> Result<Option<Box<dyn LayerDevice + '_>>>;

    /// Every graph compiled so far, with what it was compiled for.
    fn graphs(&self) -> Vec<GraphInfo>;
}

/// Fails unless `device` can run here: the FP16SIM pseudo-device with valid options, llama.cpp with the device asked
/// of it, or an OpenVINO device that is present (the error names the ones that are).
pub fn check_device(device: &str) -> Result<()> {
    if llamacpp::is_llamacpp(device) {
        return llamacpp::check(device);
    }
    if NumericModel::is_sim(device) {
        npu::sim::parse_device(device, &[])?;
        return Ok(());
    }
    let core = npu::runtime::core()?;
    npu::devices::require(&core, device)?;
    Ok(())
}

/// Every OpenVINO device present (the FP16SIM pseudo-device is compared only when named).
pub fn available_devices() -> Result<Vec<String>> {
    let core = npu::runtime::core().map_err(|e| {
        anyhow::anyhow!(
            "{e} (FP16SIM needs no runtime: pass --devices FP16SIM to compare with it alone)"
        )
    })?;
    Ok(npu::devices::available(&core)?)
}

/// Splits `CPU,FP16SIM:store=f32,ftz=off,NPU` at the commas between devices (an item `key=value` continues the
/// options of the FP16SIM before it).
pub fn split_devices(list: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match out.last_mut() {
            Some(prev) if item.contains('=') && !item.contains(':') && prev.contains(':') => {
                prev.push(',');
                prev.push_str(item);
            }
            _ => out.push(item.to_string()),
        }
    }
    out
}

/// The reference on the store's weights (the very weights a device runs, dequantized exactly).
pub fn open_reference(
    config: &Config,
    store: &WeightStore,
    opts: RunOptions,
    taps: bool,
) -> Result<ReferenceBackend> {
    let model = Model::from_weights(config.clone(), store)?;
    reference_on(model, store, opts, taps)
}

/// The run record's property naming the arithmetic the reference modelled (`--arithmetic`), when not its own.
pub const ARITHMETIC: &str = "arithmetic";

/// The reference running `model` (built from `store`): a second backend on a model already built shares its
/// weights (a model's clone holds the same packed codes and mapped pages, not a copy).
pub fn reference_on(
    model: Model,
    store: &WeightStore,
    opts: RunOptions,
    taps: bool,
) -> Result<ReferenceBackend> {
    let backend = ReferenceBackend::new(model, opts, taps, &store.format().name())?;
    // How the products compute on a GGUF's weights, when not the reference's own f32: reports and dumps say it.
    Ok(match store.arithmetic() {
        reference::gguf::arith::Arithmetic::Reference => backend,
        a => backend.with_property(ARITHMETIC, a.name()),
    })
}

/// Fails unless `prompt` tokens and `generate` greedy tokens fit a static context of `context` slots (the last
/// generated token is never fed back, so it needs no slot); `source` (a flag, or a manifest) is named: a long
/// prompt is refused, never cut.
pub fn check_context(prompt: usize, generate: usize, context: usize, source: &str) -> Result<()> {
    let needed = prompt.saturating_add(generate.saturating_sub(1));
    if needed > context {
        bail!(
            "{prompt} prompt tokens and {generate} generated need {needed} cache slots, but the static context holds \
             {context} ({source})"
        );
    }
    Ok(())
}

/// Fails unless `prompt` tokens and `generate` greedy tokens fit the model's positions (`max_position_embeddings` of
/// its config.json), naming `flag`, the option that asked for the tokens: a count past what any run can hold is
/// refused before work, never left to an allocation to fail.
pub fn check_positions(prompt: usize, generate: usize, config: &Config, flag: &str) -> Result<()> {
    let needed = prompt.saturating_add(generate.saturating_sub(1));
    let limit = config.max_position_embeddings;
    if needed > limit {
        let asked = if generate == 0 {
            format!("{prompt} prompt tokens need")
        } else {
            format!("{prompt} prompt tokens and {generate} generated need")
        };
        bail!(
            "{flag}: {asked} {needed} positions, but the model holds {limit} (max_position_embeddings in its \
             config.json)"
        );
    }
    Ok(())
}

/// Warns when the deployed graphs computed in another precision than asked (FP16SIM's is its options').
pub fn warn_precision(dut: &mut dyn DeviceUnderTest) -> Result<()> {
    if NumericModel::is_sim(dut.device()) {
        return Ok(());
    }
    let r = dut.record()?;
    if let Some(asked) = &r.precision_requested
        && r.precision.as_ref() != Some(asked)
    {
        crate::errln!(
            "warning: {} computed in {} although {asked} was requested (the device has no such arithmetic); \
             recorded as `precision`",
            dut.label(),
            r.precision_text()
        );
    }
    Ok(())
}
