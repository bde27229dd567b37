//! The reference behind the worker's protocol (tests only, `QWEN35_WORKER_ENGINE=reference`): the taps llama.cpp's
//! callback yields (the embeddings, each layer's output, the final norm) and every token's logits, so that the
//! device's side of the protocol, its errors and a worker that dies are tested on any machine, without llama.cpp.

use super::{Engine, Hello, Out};
use anyhow::Result;
use candle_core::{DType, Tensor};
use reference::backend::{Backend, ReferenceBackend};
use reference::model::{Model, RunOptions};
use reference::taps::names;
use reference::weights::WeightStore;
use std::path::Path;
use std::time::Instant;

/// The one device of the test engine, as the worker lists it.
pub const DEVICE: &str = "CPU: the reference (test engine)";

/// The reference on a checkpoint (any format `--model` reads).
pub struct ReferenceEngine {
    backend: ReferenceBackend,
    hello: Hello,
}

impl ReferenceEngine {
    /// Loads `model`, to run in a context of `context` tokens.
    pub fn open(model: &str, context: usize) -> Result<Self> {
        let start = Instant::now();
        let path = Path::new(model);
        let config = reference::gguf::model_config(path)?;
        let store = WeightStore::open(path, DType::F32)?;
        let m = Model::from_weights(config.clone(), &store)?;
        let backend =
            ReferenceBackend::new(m, RunOptions::default(), true, &store.format().name())?;
        let hello = Hello {
            engine: "reference".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            device: "CPU".into(),
            device_description: "the reference (test engine)".into(),
            devices: vec![DEVICE.into()],
            n_vocab: config.vocab_size,
            n_layer: config.num_layers(),
            n_embd: config.hidden_size,
            n_ctx: context,
            settings: Default::default(),
            load_seconds: start.elapsed().as_secs_f64(),
        };
        Ok(ReferenceEngine { backend, hello })
    }
}

/// Whether llama.cpp's callback has a tensor of this dump name.
fn yielded(name: &str) -> bool {
    name == names::EMBEDDINGS
        || name == names::FINAL_NORM
        || name
            .strip_prefix("layers.")
            .and_then(|r| r.strip_suffix(".output"))
            .is_some_and(|i| i.parse::<usize>().is_ok())
}

fn out(name: &str, t: &Tensor) -> Result<Out> {
    let t = t.to_dtype(DType::F32)?;
    Ok(Out {
        name: name.to_string(),
        shape: t.dims().to_vec(),
        data: t.flatten_all()?.to_vec1()?,
    })
}

impl Engine for ReferenceEngine {
    fn hello(&self) -> Hello {
        self.hello.clone()
    }

    fn reset(&mut self) -> Result<()> {
        Ok(self.backend.reset()?)
    }

    fn forward(&mut self, ids: &[u32]) -> Result<Vec<Out>> {
        let position = self.backend.position()?;
        if position + ids.len() > self.hello.n_ctx {
            anyhow::bail!(
                "{} tokens from position {position} exceed the context of {} (--context)",
                ids.len(),
                self.hello.n_ctx
            );
        }
        let f = self.backend.forward(ids, true)?;
        let mut outs = vec![out(names::LOGITS, &f.logits)?];
        for (name, t) in &f.taps {
            if yielded(name) {
                outs.push(out(name, t)?);
            }
        }
        Ok(outs)
    }
}
