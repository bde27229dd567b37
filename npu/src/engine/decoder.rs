//! A decoder graph set on a device, as a [`Backend`]: this project's graphs built from the checkpoint, or a set's
//! files made elsewhere, run through the one interface description ([`crate::graphset`]): prompts in blocks by the
//! set's host rule, every explicit state kept on the host in the dump's layout and handed between calls (so it can be
//! compared, snapshot and restored), a stateful set's caches left inside OpenVINO.

mod backend;

pub(crate) use backend::into_reference;

use super::record::{record_of, set_record};
use super::{HostLayerState, SetGraph};
use crate::devices::{CompileOptions, ExecInfo, compile_ir, read_ports};
use crate::error::{Error, Result};
use crate::graphs::Builder;
use crate::graphset::check::{Subject, resolve};
use crate::graphset::layout::{self, Call, CallPositions};
use crate::graphset::{GraphSet, InputRole, Interface, LogitRows, PromptRule, own};
use crate::infer::Session;
use candle_core::{DType, Tensor};
use reference::backend::{EmbeddedPrompt, Forward, RunRecord};
use reference::config::Config;
use reference::model::TokenTable;
use reference::taps::{SharedTapSink, names};
use std::collections::BTreeMap;

/// The backend's name in run records of a set read from files.
pub const SET_BACKEND: &str = "graph-set";

/// Why a stateful set's state cannot be compared, as reports say it.
pub const STATE_NOT_EXPOSED: &str = "not exposed: a stateful IR keeps its caches inside OpenVINO, whose C API \
     cannot read them; a stateless form (explicit state ports) exposes them";

/// The decoder graphs of a set compiled on a device.
pub struct DecoderEngine {
    graphs: Vec<SetGraph>,
    interface: Interface,
    rule: PromptRule,
    context: Option<usize>,
    context_source: String,
    config: Config,
    states: Vec<HostLayerState>,
    position: usize,
    rope_delta: i64,
    embeddings: Option<Box<TokenTable>>,
    sink: Option<SharedTapSink>,
    record: RunRecord,
}

impl DecoderEngine {
    /// Builds and compiles this project's decoder graphs (prompt blocks of `block` tokens, and 1 token) for
    /// `device`.
    pub fn new(
        builder: &Builder,
        block: usize,
        device: &str,
        opts: &CompileOptions,
    ) -> Result<Self> {
        Self::build(builder, block, true, device, opts)
    }

    /// [`DecoderEngine::new`] without the 1-token graph: every call, a single token too, runs padded in the
    /// prompt-block graph, so the weights are compiled into one graph, not two (the hidden-state graphs of a check,
    /// which need not be the deployed decode graph). On FP16SIM, whose graphs share one copy of the weights, the
    /// 1-token graph is kept.
    pub fn padded_only(
        builder: &Builder,
        block: usize,
        device: &str,
        opts: &CompileOptions,
    ) -> Result<Self> {
        Self::build(builder, block, false, device, opts)
    }

    fn build(
        builder: &Builder,
        block: usize,
        single: bool,
        device: &str,
        opts: &CompileOptions,
    ) -> Result<Self> {
        if block == 0 {
            return Err(Error::Input(
                "a prompt block must hold at least 1 token".into(),
            ));
        }
        let start = std::time::Instant::now();
        let config = builder.config().clone();
        let interface = own::decoder(
            &config,
            builder.options().taps,
            builder.options().embeddings_input,
        );
        let context = builder.options().context;
        // FP16SIM's graphs share one mapped `.bin`: the 1-token graph costs no second copy of the weights, and
        // saves a padded block's work per step.
        let single = single || crate::sim::NumericModel::is_sim(device);
        let mut sizes = if single || block == 1 {
            vec![1]
        } else {
            vec![]
        };
        if block > 1 {
            sizes.push(block);
        }
        let (mut graphs, ir_reused) =
            super::own::decoder_graphs(builder, &sizes, device, opts, &interface)?;
        // The prompt-block graph first, as the record describes it.
        graphs.reverse();
        let infos: Vec<&ExecInfo> = graphs.iter().map(|g| g.exec.info()).collect();
        let record = RunRecord {
            compile_seconds: Some(start.elapsed().as_secs_f64()),
            ir_reused,
            ..record_of(&infos, builder, block, opts)?
        };
        Self::assemble(
            graphs,
            interface,
            Some(context),
            "--context".into(),
            config,
            None,
            record,
        )
    }

    /// Compiles the decoder graphs of a set read from files for `device` (an OpenVINO device), each checked against
    /// the set's description first. `config` is the checkpoint's the set was made from; `embeddings`, the checkpoint's
    /// table the host looks rows up in, is needed when the set takes host-side embeddings.
    pub fn open(
        set: &GraphSet,
        config: Config,
        device: &str,
        opts: &CompileOptions,
        embeddings: Option<TokenTable>,
    ) -> Result<Self> {
        if crate::sim::NumericModel::is_sim(device) {
            return Err(Error::Config(format!(
                "{device} evaluates this project's own graphs; {} runs on an OpenVINO device",
                set.source
            )));
        }
        crate::runtime::load()?;
        let start = std::time::Instant::now();
        let part = set.decoder()?;
        let interface = part.interface.clone();
        if interface.has("embeddings") && embeddings.is_none() {
            return Err(Error::Config(format!(
                "{}: the set takes host-side embeddings; give the checkpoint (its embedding table)",
                set.source
            )));
        }
        let mut opts = opts.clone();
        if interface.stateful && device.starts_with("CPU") {
            opts.device_config
                .entry("KV_CACHE_PRECISION".into())
                .or_insert_with(|| opts.precision.hint().to_string());
        }
        let mut core = crate::runtime::core()?;
        let mut graphs = Vec::new();
        for g in &part.graphs {
            let file = g.xml.display().to_string();
            let ports = resolve(
                &Subject {
                    source: &set.source,
                    part: &part.key,
                    file: &file,
                    tokens: g.tokens,
                    layer: None,
                    context: set.context,
                },
                &config,
                &interface,
                &read_ports(&g.xml, &g.bin)?,
            )?;
            let name = g
                .xml
                .file_stem()
                .map_or_else(|| file.clone(), |s| s.to_string_lossy().into_owned());
            let compiled = compile_ir(&mut core, &g.xml, &g.bin, &name, device, &opts)?;
            graphs.push(SetGraph {
                tokens: g.tokens,
                exec: Box::new(Session::new(compiled)?),
                ports,
            });
        }
        graphs.sort_by_key(|g| std::cmp::Reverse(g.tokens.unwrap_or(usize::MAX)));
        let infos: Vec<&ExecInfo> = graphs.iter().map(|g| g.exec.info()).collect();
        let record = set_record(set, &infos, device, &opts, start.elapsed().as_secs_f64())?;
        Self::assemble(
            graphs,
            interface,
            set.context,
            format!("the `context` of {}", set.source),
            config,
            embeddings,
            record,
        )
    }

    fn assemble(
        graphs: Vec<SetGraph>,
        interface: Interface,
        context: Option<usize>,
        context_source: String,
        config: Config,
        embeddings: Option<TokenTable>,
        record: RunRecord,
    ) -> Result<Self> {
        let states = if interface.stateful {
            Vec::new()
        } else {
            (0..config.num_layers())
                .map(|l| HostLayerState::zeros(&config, l))
                .collect::<Result<_>>()?
        };
        if interface.logit_rows == LogitRows::Last && interface.prompt == PromptRule::Padded {
            return Err(Error::Config(
                "a set whose logits are the last slot's only cannot pad its prompt blocks (the last slot would be a \
                 padded one): give `\"prompt\": \"blocks\"`"
                    .into(),
            ));
        }
        Ok(DecoderEngine {
            rule: interface.prompt,
            graphs,
            interface,
            context,
            context_source,
            config,
            states,
            position: 0,
            rope_delta: 0,
            embeddings: embeddings.map(Box::new),
            sink: None,
            record,
        })
    }

    /// Gives this project's graphs built with an `embeddings` input ([`crate::graphs::GraphOptions`]) the host's
    /// table the text tokens' rows are looked up in.
    pub fn set_host_embeddings(&mut self, host: TokenTable) {
        self.embeddings = Some(Box::new(host));
    }

    /// What the graphs were prepared with, the largest block first.
    pub fn infos(&self) -> Vec<&ExecInfo> {
        self.graphs.iter().map(|g| g.exec.info()).collect()
    }

    /// The static KV context, if the set has one.
    pub fn context(&self) -> Option<usize> {
        self.context
    }

    /// The interface the graphs are run through.
    pub fn interface(&self) -> &Interface {
        &self.interface
    }

    /// The per-layer states after the last call (none for a stateful set).
    pub fn states(&self) -> &[HostLayerState] {
        &self.states
    }

    /// The token counts of the static graphs, smallest first (empty for a dynamic set).
    pub fn blocks(&self) -> Vec<usize> {
        let mut b: Vec<usize> = self.graphs.iter().filter_map(|g| g.tokens).collect();
        b.sort_unstable();
        b
    }

    /// Whether the graphs take `token_valid` (so a prompt block can be padded).
    pub fn takes_token_valid(&self) -> bool {
        self.interface.has("token_valid")
    }

    /// Whether hidden states come out of the graphs (taps).
    pub fn has_taps(&self) -> bool {
        self.graphs.iter().any(|g| !g.ports.taps.is_empty())
    }

    /// Changes the host rule for prompts (padded blocks need `token_valid`).
    pub fn set_prompt_rule(&mut self, rule: PromptRule) -> Result<()> {
        if rule == PromptRule::Padded && !self.takes_token_valid() && !self.blocks().is_empty() {
            return Err(Error::Config(
                "padded prompt blocks need a `token_valid` input, which the set does not map"
                    .into(),
            ));
        }
        self.rule = rule;
        Ok(())
    }

    /// The calls a run of `n` tokens makes: (graph index, tokens of the call).
    fn plan(&self, n: usize) -> Result<Vec<(usize, usize)>> {
        if let Some(i) = self.graphs.iter().position(|g| g.tokens.is_none()) {
            return Ok(vec![(i, n)]);
        }
        let index = |t: usize| self.graphs.iter().position(|g| g.tokens == Some(t));
        let single = index(1);
        let mut blocks: Vec<usize> = self.blocks().into_iter().filter(|&b| b > 1).collect();
        blocks.sort_unstable();
        let no_single = |rest: usize| {
            Error::Config(format!(
                "a call of {rest} token(s) needs a 1-token graph or padding, and the set has neither (graphs of {} \
                 tokens, prompt rule `{}`)",
                self.blocks()
                    .iter()
                    .map(|b| b.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                self.rule.name()
            ))
        };
        let padded = self.rule == PromptRule::Padded && self.takes_token_valid();
        if n == 1 {
            return match (single, blocks.first()) {
                (Some(i), _) => Ok(vec![(i, 1)]),
                (None, Some(&b)) if padded => Ok(vec![(index(b).unwrap_or(0), 1)]),
                _ => Err(no_single(1)),
            };
        }
        let Some(&largest) = blocks.last() else {
            let i = single.ok_or_else(|| no_single(n))?;
            return Ok(vec![(i, 1); n]);
        };
        let mut calls = Vec::new();
        let mut rest = n;
        if padded {
            while rest >= largest {
                calls.push((index(largest).unwrap_or(0), largest));
                rest -= largest;
            }
            if rest > 0 {
                let b = *blocks.iter().find(|&&b| b >= rest).unwrap_or(&largest);
                calls.push((index(b).unwrap_or(0), rest));
            }
        } else {
            for &b in blocks.iter().rev() {
                while rest >= b {
                    calls.push((index(b).unwrap_or(0), b));
                    rest -= b;
                }
            }
            if rest > 0 {
                let i = single.ok_or_else(|| no_single(rest))?;
                calls.extend(std::iter::repeat_n((i, 1), rest));
            }
        }
        Ok(calls)
    }

    /// One call of graph `g` on `ids` (at most its tokens), updating the states; the logits of its real rows and
    /// its taps. `given` holds the call's embeddings and positions when they are a prompt's with images.
    fn call(
        &mut self,
        g: usize,
        ids: &[u32],
        given: Option<(Tensor, CallPositions)>,
    ) -> Result<(Tensor, BTreeMap<String, Tensor>)> {
        let graph = &mut self.graphs[g];
        let tokens = graph.tokens.unwrap_or(ids.len());
        let (rows, positions) = match given {
            Some((rows, positions)) => (Some(rows), positions),
            None => (
                None,
                CallPositions::Text {
                    delta: self.rope_delta,
                },
            ),
        };
        if rows.is_some()
            && !graph
                .ports
                .inputs
                .iter()
                .any(|(r, _)| *r == InputRole::Embeddings)
        {
            return Err(Error::Input(format!(
                "{} takes token ids, not embeddings: a prompt with images needs decoder graphs with an \
                 `embeddings` input",
                graph.exec.info().graph
            )));
        }
        let call = Call {
            ids,
            tokens,
            past: self.position,
            context: self.context,
            positions,
        };
        let config = &self.config;
        let graph_name = graph.exec.info().graph.clone();
        let at = |key: &str| format!("{graph_name} `{key}`");
        let mut inputs: Vec<(String, Tensor)> = Vec::new();
        for (role, port) in &graph.ports.inputs {
            let t = match (role, &rows) {
                // A prompt with images brings its rows; text looks them up in the host's table.
                (InputRole::Embeddings, Some(given)) => {
                    layout::rows(config, &port.spec(), given, &call, &at(&port.key))?
                }
                (InputRole::Embeddings, None) => {
                    let host = self.embeddings.as_ref().ok_or_else(|| {
                        Error::Interface("the set takes embeddings, and none were given".into())
                    })?;
                    let mut padded: Vec<u32> = ids.to_vec();
                    padded.resize(tokens, 0);
                    let rows = host.embed(&padded)?.to_dtype(DType::F32)?;
                    layout::rows(config, &port.spec(), &rows, &call, &at(&port.key))?
                }
                (other, _) => layout::fill(config, *other, &port.spec(), &call, &at(&port.key))?,
            };
            inputs.push((port.name.clone(), t));
        }
        let states = &self.states;
        inputs.extend(super::state_inputs(
            config,
            &graph.ports.states,
            |l| &states[l],
            &call,
            &graph_name,
        )?);
        let refs: Vec<(&str, &Tensor)> = inputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let mut out = graph.exec.run(&refs)?;
        let valid = ids.len();
        super::take_states(
            &graph.ports.states,
            &mut out,
            &mut self.states,
            |l| l,
            &call,
            &graph_name,
        )?;
        let port = &graph.ports.output;
        let raw = out
            .remove(&port.name)
            .ok_or_else(|| Error::Interface(format!("the graph gave no output `{}`", port.name)))?;
        let logits = match self.interface.logit_rows {
            LogitRows::All => {
                let l = layout::from_port(
                    &raw,
                    &port.shape,
                    &[crate::graphset::Axis::Tokens, crate::graphset::Axis::Vocab],
                    &at(&port.key),
                )?;
                l.narrow(0, 0, valid)?
            }
            LogitRows::Last => {
                if valid < tokens {
                    return Err(Error::Interface(
                        "the last slot of a padded call is not a token: its logits mean nothing"
                            .into(),
                    ));
                }
                layout::from_port(
                    &raw,
                    &port.shape,
                    &[crate::graphset::Axis::Vocab],
                    &at(&port.key),
                )?
                .unsqueeze(0)?
            }
        };
        let mut taps = BTreeMap::new();
        for (dump, name) in &graph.ports.taps {
            if let Some(t) = out.remove(name) {
                // Indices (an MoE block's chosen experts) stay i64; values are read as f32 whatever the port holds.
                let t = match t.dtype() {
                    DType::I64 => t,
                    _ => t.to_dtype(DType::F32)?,
                };
                taps.insert(dump.clone(), t.narrow(0, 0, valid.min(t.dim(0)?))?);
            }
        }
        self.position += valid;
        Ok((logits, taps))
    }

    /// [`Backend::forward`]: the graph calls over `ids` and their outputs, token-major; with `given`, the
    /// embeddings and positions of a prompt with images ([`Backend::forward_embedded`]).
    fn forward_calls(
        &mut self,
        ids: &[u32],
        given: Option<&EmbeddedPrompt>,
        all_logits: bool,
    ) -> Result<Forward> {
        if ids.is_empty() {
            return Err(Error::Input("no tokens to run".into()));
        }
        self.config.check_token_ids(ids)?;
        if let Some(context) = self.context
            && self.position + ids.len() > context
        {
            return Err(Error::Input(format!(
                "{} tokens after {} need {} cache slots, but the static context holds {context} ({})",
                ids.len(),
                self.position,
                self.position + ids.len(),
                self.context_source
            )));
        }
        // Logits of every position from a set that gives the last one's only: one token per call.
        let plan = if all_logits && self.interface.logit_rows == LogitRows::Last && ids.len() > 1 {
            let single = self
                .graphs
                .iter()
                .position(|g| g.tokens.is_none_or(|t| t == 1))
                .ok_or_else(|| {
                    Error::Config(
                        "the logits of every position need a 1-token graph when the set gives the last slot's \
                         only"
                            .into(),
                    )
                })?;
            vec![(single, 1); ids.len()]
        } else {
            self.plan(ids.len())?
        };
        let mut logits = Vec::with_capacity(plan.len());
        let mut taps: BTreeMap<String, Vec<Tensor>> = BTreeMap::new();
        let mut done = 0;
        let rows = given.map(|p| p.positions.0.each_ref().map(|r| r.as_slice()));
        for (g, n) in plan {
            let position = self.position;
            let piece = match (given, rows) {
                (Some(p), Some(rows)) => Some((
                    p.embeddings.narrow(0, done, n)?,
                    CallPositions::Rows(rows).slice(done, n),
                )),
                _ => None,
            };
            let (l, t) = self.call(g, &ids[done..done + n], piece)?;
            if let Some(sink) = &self.sink {
                super::stream(sink, position, n, &l, t)?;
                logits = vec![l];
            } else {
                logits.push(l);
                for (k, v) in t {
                    taps.entry(k).or_default().push(v);
                }
            }
            done += n;
        }
        let logits = Tensor::cat(&logits, 0)?;
        let logits = if all_logits && self.sink.is_none() {
            logits
        } else {
            logits.narrow(0, logits.dim(0)? - 1, 1)?
        };
        let mut taps: BTreeMap<String, Tensor> = taps
            .into_iter()
            .map(|(k, v)| Ok((k, Tensor::cat(&v, 0)?)))
            .collect::<Result<_>>()?;
        taps.remove(names::LOGITS);
        if let Some(p) = given {
            self.rope_delta = p.positions.next_text() - self.position as i64;
        }
        Ok(Forward { logits, taps })
    }
}
