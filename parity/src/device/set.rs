//! A graph set made elsewhere (`--ir DIR`) as the device under test: its decoder graphs, or its per-layer graphs
//! chained into a decoder, with the capabilities its description maps.

use super::fault::{Fault, Faulty};
use super::pieces::Pieces;
use super::{Capabilities, DeviceLayers, DeviceUnderTest, GraphInfo, GraphLog, LayerDevice};
use anyhow::{Context, Result, bail};
use npu::devices::CompileOptions;
use npu::engine::{DecoderEngine, LayerChain};
use npu::graphset::vision::{VisionGraph, grid_text};
use npu::graphset::{GraphSet, PromptRule};
use npu::sim::NumericModel;
use reference::backend::{Backend, EmbeddedPrompt, Forward, RunRecord, Snapshot};
use reference::config::Config;
use reference::model::{Model, TokenTable};
use reference::quant::WeightFormat;
use reference::vision::Grid;
use reference::weights::WeightStore;
use std::path::{Path, PathBuf};

/// A set's directory as a command opens it: its description, and the checkpoint and weights the reference runs
/// against it.
pub struct SetSource {
    /// The directory given.
    pub dir: PathBuf,
    /// Its description (its manifest, or the convention its port names follow).
    pub set: GraphSet,
    /// The checkpoint directory.
    pub checkpoint: PathBuf,
    /// Its config.
    pub config: Config,
    /// The weights the reference runs.
    pub store: WeightStore,
    /// Set when the manifest says the graphs hold other weights than the reference runs.
    pub weights_warning: Option<String>,
}

impl SetSource {
    /// The set of `dir` against the checkpoint `checkpoint` (its `config` and `store`).
    pub fn new(
        dir: &Path,
        set: GraphSet,
        checkpoint: PathBuf,
        config: Config,
        store: WeightStore,
    ) -> Self {
        let weights_warning = set.reference_weights.as_ref().and_then(|w| {
            (WeightFormat::parse(w).ok() != Some(store.format())).then(|| {
                format!(
                    "{} says the graphs hold the weights of `--weights {w}`; the reference runs `--weights {}`",
                    set.source,
                    store.format()
                )
            })
        });
        SetSource {
            dir: dir.to_path_buf(),
            set,
            checkpoint,
            config,
            store,
            weights_warning,
        }
    }

    /// The directory's own name, for labels.
    pub fn name(&self) -> String {
        self.dir.file_name().map_or_else(
            || self.dir.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        )
    }

    /// The static context, and where it comes from.
    pub fn context(&self) -> (Option<usize>, String) {
        (
            self.set.context,
            format!("the `context` of {}", self.set.source),
        )
    }

    /// The set's own static vision graphs (its manifest's `vision`).
    pub fn vision(&self) -> &[VisionGraph] {
        &self.set.vision
    }

    /// Checks, before any work, that the set runs a prompt with images of `grids` and videos of `videos` (`name(i)`
    /// names image `i`): it brings vision graphs, its decoder takes embeddings (the image rows), and each image has a
    /// graph of its grid. The refusals name the manifest.
    pub fn check_images(
        &self,
        grids: &[Grid],
        videos: &[Grid],
        name: impl Fn(usize) -> String,
    ) -> Result<()> {
        let set = &self.set;
        if set.vision.is_empty() {
            bail!(
                "--ir {}: {} has no `vision` graph, so the set cannot make the image rows of a prompt with images \
                 (export-ir --image-grid HxW writes one; without --ir, this project's graphs build theirs from the \
                 checkpoint)",
                self.dir.display(),
                set.source
            );
        }
        if let Some(d) = &set.decoder
            && !d.interface.has("embeddings")
        {
            bail!(
                "--ir {}: {}'s decoder takes `input_ids`, not `embeddings`: a prompt with images needs decoder \
                 graphs that take the image rows (export-ir --image-grid writes such a set)",
                self.dir.display(),
                set.source
            );
        }
        let refuse = |list: &[Grid], name: &dyn Fn(usize) -> String| -> Result<()> {
            let Err(i) = npu::graphset::vision::plan(&set.vision, list) else {
                return Ok(());
            };
            let has: Vec<String> = set.vision.iter().map(VisionGraph::grids_text).collect();
            // The resize that makes an image of the set's first one-image grid.
            let resize = match (set.vision[0].grids.as_slice(), self.patch_size()) {
                ([g], Some(p)) if g.t == 1 => format!(
                    " (its {} patches: --image-size {}x{})",
                    grid_text(g),
                    g.w * p,
                    g.h * p
                ),
                _ => String::new(),
            };
            bail!(
                "--ir {}: {} of {} patches has no vision graph in {}, whose graphs take {} {}: give --image-size \
                 WxH to resize the images to a grid the set has{resize}",
                self.dir.display(),
                name(i),
                grid_text(&list[i]),
                set.source,
                if has.len() == 1 {
                    "the grid"
                } else {
                    "the grids"
                },
                has.join(", "),
            );
        };
        refuse(grids, &name)?;
        refuse(videos, &|i| format!("video {}", i + 1))
    }

    /// The vision tower's patch side in pixels, when the checkpoint has a tower.
    fn patch_size(&self) -> Option<usize> {
        crate::images::vision_config(&self.checkpoint)
            .ok()
            .map(|vc| vc.patch_size)
    }
}

/// The set's decoder, or its per-layer graphs chained.
enum Graphs {
    Decoder(DecoderEngine),
    Chain(LayerChain),
}

impl Graphs {
    fn backend(&self) -> &dyn Backend {
        match self {
            Graphs::Decoder(d) => d,
            Graphs::Chain(c) => c,
        }
    }

    fn backend_mut(&mut self) -> &mut dyn Backend {
        match self {
            Graphs::Decoder(d) => d,
            Graphs::Chain(c) => c,
        }
    }

    fn infos(&self) -> Vec<&npu::devices::ExecInfo> {
        match self {
            Graphs::Decoder(d) => d.infos(),
            Graphs::Chain(c) => c.infos(),
        }
    }
}

impl Backend for Graphs {
    fn config(&self) -> &Config {
        self.backend().config()
    }

    fn record(&self) -> &RunRecord {
        self.backend().record()
    }

    fn reset(&mut self) -> reference::Result<()> {
        self.backend_mut().reset()
    }

    fn forward(&mut self, ids: &[u32], all_logits: bool) -> reference::Result<Forward> {
        self.backend_mut().forward(ids, all_logits)
    }

    fn forward_embedded(
        &mut self,
        prompt: &EmbeddedPrompt,
        all_logits: bool,
    ) -> reference::Result<Forward> {
        self.backend_mut().forward_embedded(prompt, all_logits)
    }

    fn state_hidden(&self) -> Option<&'static str> {
        self.backend().state_hidden()
    }

    fn position(&self) -> reference::Result<usize> {
        self.backend().position()
    }

    fn snapshot(&self) -> reference::Result<Snapshot> {
        self.backend().snapshot()
    }

    fn restore(&mut self, snapshot: &Snapshot) -> reference::Result<()> {
        self.backend_mut().restore(snapshot)
    }
}

/// What the host holds for a set's graphs: the reference model where per-layer graphs are chained (the host embeds
/// the prompt and applies the final norm and the head), only the embedding table where a decoder takes embeddings
/// (the host looks the text rows up), nothing where it takes token ids.
enum Host {
    /// The whole reference.
    Model(Model),
    /// The embedding table, if the decoder takes embeddings.
    Table(Option<TokenTable>),
}

impl Host {
    /// What `source`'s graphs need of the reference.
    fn of(source: &SetSource) -> Result<Self> {
        Ok(match &source.set.decoder {
            Some(part) if part.interface.has("embeddings") => {
                Host::Table(Some(TokenTable::load(&source.config, &source.store)?))
            }
            Some(_) => Host::Table(None),
            None => Host::Model(Model::from_weights(source.config.clone(), &source.store)?),
        })
    }
}

/// A graph set made elsewhere on a device.
pub struct SetGraphs<'a> {
    source: &'a SetSource,
    host: Host,
    device: String,
    compile: CompileOptions,
    fault: Option<Fault>,
    deployed: Faulty<Graphs>,
    caps: Capabilities,
    label: String,
    log: GraphLog,
}

impl<'a> SetGraphs<'a> {
    /// Compiles the set's decoder graphs (or its per-layer graphs, chained) on `device`, an OpenVINO device.
    pub fn open(
        source: &'a SetSource,
        device: &str,
        compile: &CompileOptions,
        fault: Option<Fault>,
    ) -> Result<Self> {
        if NumericModel::is_sim(device) {
            bail!(
                "{device} evaluates this project's own graphs; a set made elsewhere runs on an OpenVINO device \
                 (--ir {})",
                source.dir.display()
            );
        }
        let host = Host::of(source)?;
        let log = GraphLog::default();
        let graphs = open_graphs(source, &host, device, compile, &log, "deployed")?;
        let set = &source.set;
        let (context, context_source) = source.context();
        let caps = match &graphs {
            Graphs::Decoder(d) => {
                let blocks = d.blocks();
                Capabilities {
                    kind: if d.interface().stateful {
                        "stateful IR"
                    } else {
                        "decoder set"
                    },
                    states: !d.interface().stateful,
                    states_note: if d.interface().stateful {
                        npu::engine::STATE_NOT_EXPOSED
                    } else {
                        ""
                    },
                    hidden: d.has_taps(),
                    token_valid: d.takes_token_valid(),
                    single_token: blocks.is_empty() || blocks.contains(&1),
                    layer_graphs: set.layers.is_some(),
                    fed_routing: false,
                    any_block: false,
                    block: blocks.last().copied(),
                    blocks,
                    context,
                    context_source,
                }
            }
            Graphs::Chain(c) => {
                let blocks = c.blocks();
                Capabilities {
                    kind: "per-layer set",
                    states: true,
                    states_note: "",
                    hidden: true,
                    token_valid: set
                        .layers
                        .as_ref()
                        .is_some_and(|p| p.interface.has("token_valid")),
                    single_token: blocks.contains(&1),
                    layer_graphs: true,
                    fed_routing: false,
                    any_block: false,
                    block: blocks.last().copied(),
                    blocks,
                    context,
                    context_source,
                }
            }
        };
        Ok(SetGraphs {
            label: format!("{device} IR {}", source.name()),
            source,
            host,
            device: device.to_string(),
            compile: compile.clone(),
            fault,
            deployed: Faulty::new(graphs, fault),
            caps,
            log,
        })
    }
}

/// The set's decoder graphs, or its per-layer graphs chained, compiled and logged as `purpose`.
fn open_graphs(
    source: &SetSource,
    host: &Host,
    device: &str,
    compile: &CompileOptions,
    log: &GraphLog,
    purpose: &str,
) -> Result<Graphs> {
    let set = &source.set;
    let at = || format!("--ir {}", source.dir.display());
    let graphs = match (&set.decoder, host) {
        (Some(_), Host::Table(table)) => Graphs::Decoder(
            DecoderEngine::open(set, source.config.clone(), device, compile, table.clone())
                .with_context(at)?,
        ),
        (None, Host::Model(model)) => {
            Graphs::Chain(LayerChain::open(set, model.clone(), device, compile).with_context(at)?)
        }
        _ => bail!(
            "{}: the host was prepared for another kind of set",
            set.source
        ),
    };
    log.add(purpose, graphs.infos());
    Ok(graphs)
}

impl DeviceUnderTest for SetGraphs<'_> {
    fn label(&self) -> &str {
        &self.label
    }

    fn device(&self) -> &str {
        &self.device
    }

    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    fn record(&mut self) -> Result<RunRecord> {
        Ok(self.deployed.record().clone())
    }

    fn deployed(&mut self) -> Result<&mut dyn Backend> {
        Ok(&mut self.deployed)
    }

    /// The deployed graphs carry whatever hidden outputs the set maps.
    fn tapped(&mut self) -> Result<Option<&mut dyn Backend>> {
        Ok(None)
    }

    fn with_block(&mut self, block: usize) -> Result<Box<dyn Backend + '_>> {
        Ok(Box::new(Pieces {
            inner: &mut self.deployed,
            block,
        }))
    }

    fn set_padding(&mut self, padded: bool) -> Result<()> {
        let rule = if padded {
            PromptRule::Padded
        } else {
            PromptRule::Blocks
        };
        self.deployed.set_padded(padded);
        match self.deployed.inner_mut() {
            Graphs::Decoder(d) => d.set_prompt_rule(rule)?,
            Graphs::Chain(c) => c.set_prompt_rule(rule)?,
        }
        Ok(())
    }

    /// A set's graphs are its deployed ones, and there are no others to make room for.
    fn release(&mut self) {}

    fn fresh(&self) -> Result<Box<dyn Backend>> {
        let graphs = open_graphs(
            self.source,
            &self.host,
            &self.device,
            &self.compile,
            &self.log,
            "fresh (back-to-back)",
        )?;
        Ok(Box::new(Faulty::new(graphs, self.fault)))
    }

    fn layers(&self, layers: &[usize], block: usize) -> Result<Option<Box<dyn LayerDevice + '_>>> {
        if self.source.set.layers.is_none() {
            return Ok(None);
        }
        let d = DeviceLayers::open(
            &self.source.set,
            &self.source.config,
            layers,
            block,
            &self.device,
            &self.compile,
            self.deployed.record(),
        )?;
        self.log.add("probe layers", d.infos());
        Ok(Some(Box::new(d)))
    }

    fn graphs(&self) -> Vec<GraphInfo> {
        self.log.all()
    }
}
