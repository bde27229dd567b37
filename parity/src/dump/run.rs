//! A dump's run: the prompt with taps on a backend, then a greedy continuation, written to its file as the run goes
//! ([`write_dump`], what `qwen35 dump` does) or collected in memory ([`run_dump`]).

use super::layout::{Planned, planned};
use super::stream::{GENERATED, StreamWriter};
use super::{Dump, id_tensor};
use crate::images::PromptInput;
use crate::non_finite::NonFinite;
use anyhow::{Context, Result, anyhow, bail};
use candle_core::{DType, Tensor};
use reference::backend::{Backend, EmbeddedPrompt, Generation, greedy};
use reference::taps::{SharedTapSink, names};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// The dump's name for a prompt's MRoPE positions `[3, T]` (written for a prompt with images).
pub const POSITIONS: &str = "positions";

/// What [`write_dump`] wrote.
#[derive(Debug, Clone)]
pub struct Written {
    /// Tensors in the file.
    pub tensors: usize,
    /// Tokens generated (fewer than asked when a NaN stopped the generation: `nan_at`).
    pub generated: usize,
    /// Whether the backend streamed its taps to the file (else they were written from its prompt call).
    pub streamed: bool,
    /// The dump's metadata.
    pub metadata: BTreeMap<String, String>,
    /// Every tensor of the dump holding NaN or infinity, in computation order (the first is where the fault shows
    /// first).
    pub non_finite: Vec<NonFinite>,
}

/// Runs `ids` on a backend with taps, then up to `generate` greedy tokens, writing the dump to `out` as the run
/// goes (see [`super::stream`]): a backend that streams its taps ([`Backend::stream_taps`]) hands them to the file
/// as they are computed (the reference each layer's, OpenVINO each graph call's), so that what the run holds does
/// not grow with layers × tokens; another backend's taps are written from its prompt call. `metadata` is added to
/// the backend's record. The file appears at `out` only when complete; on an error nothing is left there.
pub fn write_dump(
    backend: &mut dyn Backend,
    ids: &[u32],
    generate: usize,
    metadata: BTreeMap<String, String>,
    out: &Path,
) -> Result<Written> {
    write(backend, ids, None, generate, metadata, out)
}

/// A prompt with images as a dump records it: the prompt the decoder runs, and the vision tower's taps that made
/// its image rows.
#[derive(Debug, Clone, Copy)]
pub struct ImageDump<'a> {
    /// The decoder's prompt (ids, embeddings, positions).
    pub prompt: &'a EmbeddedPrompt,
    /// `vision.*` taps.
    pub vision: &'a BTreeMap<String, Tensor>,
}

/// [`write_dump`] of a prompt with images: the vision taps and the prompt's `positions` `[3, T]` (i64) are written
/// beside the decoder's tensors.
pub fn write_image_dump(
    backend: &mut dyn Backend,
    images: ImageDump,
    generate: usize,
    metadata: BTreeMap<String, String>,
    out: &Path,
) -> Result<Written> {
    write(
        backend,
        &images.prompt.ids,
        Some(images),
        generate,
        metadata,
        out,
    )
}

fn write(
    backend: &mut dyn Backend,
    ids: &[u32],
    images: Option<ImageDump>,
    generate: usize,
    metadata: BTreeMap<String, String>,
    out: &Path,
) -> Result<Written> {
    let dtype = match backend.record().dtype.as_str() {
        "f32" => DType::F32,
        "f64" => DType::F64,
        other => bail!("a dump holds f32 or f64 tensors; the backend computes in `{other}`"),
    };
    // The caller's keys win over the record's.
    let mut metadata: BTreeMap<String, String> = backend
        .record()
        .to_metadata()
        .into_iter()
        .chain(metadata)
        .collect();
    let mut layout = planned(backend.config(), ids.len(), dtype, backend.exposes_state());
    let mut extra: Vec<(String, Tensor)> = Vec::new();
    if let Some(images) = images {
        for (name, t) in images.vision {
            extra.push((name.clone(), t.to_dtype(dtype)?));
        }
        let rows: Vec<i64> = images.prompt.positions.0.concat();
        extra.push((
            POSITIONS.to_string(),
            Tensor::from_vec(rows, (3, ids.len()), &candle_core::Device::Cpu)?,
        ));
    }
    layout.extend(extra.iter().map(|(name, t)| Planned {
        name: name.clone(),
        dtype: t.dtype(),
        shape: t.dims().to_vec(),
    }));
    let writer = Arc::new(Mutex::new(StreamWriter::create(
        out, layout, generate, &metadata,
    )?));
    let lock = || {
        writer
            .lock()
            .map_err(|_| anyhow!("writing the dump {}: poisoned", out.display()))
    };
    {
        let mut w = lock()?;
        w.write("token_ids", &id_tensor(ids)?)?;
        for (name, t) in &extra {
            w.write(name, t)?;
        }
    }
    let sink: SharedTapSink = writer.clone();
    let streaming = backend.stream_taps(Some(sink));
    let input = match images {
        Some(images) => PromptInput::Images(images.prompt.clone()),
        None => PromptInput::Ids(ids.to_vec()),
    };
    let generation = input.greedy(backend, generate, true);
    backend.stream_taps(None);
    let generation = generation.with_context(|| format!("running the dump {}", out.display()))?;
    {
        let mut w = lock()?;
        if !streaming {
            for (name, t) in &generation.prompt.taps {
                w.write_rows(name, 0, t)?;
            }
            w.write_rows(names::LOGITS, 0, &generation.prompt.logits)?;
        }
        for (name, t) in &generation.after_prompt.tensors {
            w.write(name, t)?;
        }
    }
    add_run(&mut metadata, &generation);
    let writer = Arc::try_unwrap(writer)
        .map_err(|_| {
            anyhow!(
                "writing the dump {}: the backend kept its writer",
                out.display()
            )
        })?
        .into_inner()
        .map_err(|_| anyhow!("writing the dump {}: poisoned", out.display()))?;
    let non_finite = writer.non_finite();
    let tensors = writer.finish(&generation.tokens, &metadata)?;
    Ok(Written {
        tensors,
        generated: generation.tokens.len(),
        streamed: streaming,
        metadata,
        non_finite,
    })
}

/// Runs `ids` on a backend (with taps), then up to `generate` greedy tokens, and collects the dump in memory, every
/// tap held until the end (for short runs and tests; [`write_dump`] writes a dump as the run goes).
pub fn run_dump(backend: &mut dyn Backend, ids: &[u32], generate: usize) -> Result<Dump> {
    let generation = greedy(backend, ids, generate, &[], true, |_| Ok(()))?;
    let mut tensors = generation.prompt.taps.clone();
    tensors.insert(names::LOGITS.into(), generation.prompt.logits.clone());
    tensors.extend(generation.after_prompt.tensors.clone());
    tensors.insert("token_ids".into(), id_tensor(ids)?);
    tensors.insert(GENERATED.into(), id_tensor(&generation.tokens)?);
    let mut metadata = backend.record().to_metadata();
    add_run(&mut metadata, &generation);
    Ok(Dump { tensors, metadata })
}

/// The run's times and, when a NaN stopped the generation, `nan_at` (with a warning).
fn add_run(metadata: &mut BTreeMap<String, String>, generation: &Generation) {
    metadata.insert(
        "prompt_seconds".into(),
        format!("{:.3}", generation.prompt_seconds),
    );
    metadata.insert(
        "decode_seconds".into(),
        format!("{:.3}", generation.decode_seconds),
    );
    if let Some(i) = generation.nan_at {
        metadata.insert("nan_at".into(), i.to_string());
    }
}
