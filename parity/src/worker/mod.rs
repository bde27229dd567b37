//! A runtime run in a process of its own and driven through pipes: `qwen35-llama-worker` serves llama.cpp (built
//! with the `llama-cpp` feature) to [`crate::device::llamacpp`], so that a runtime that crashes (llama.cpp's CPU back
//! end segfaults on some CPUs and files) is a finding the report states, never the end of the harness.
//!
//! The protocol, one request at a time:
//! - the harness writes a request as one JSON line on the worker's standard input ([`Request`]);
//! - the worker answers with one frame on its standard output: a tag byte, the length as a little-endian `u64`, then
//!   the bytes. Tag `J`: a JSON object ([`Hello`] first, after loading; then `{"ok": true}` or `{"error": "…"}`).
//!   Tag `S`: a forward call's result, a safetensors file of f32 tensors, `logits` `[T, V]` and the taps under the
//!   dump's names (`embeddings`, `layers.{i}.output`, `final_norm`), each `[T, H]`.
//!
//! The worker's standard error carries the runtime's own messages; the harness keeps the last of them for its error
//! when the worker fails.

#[cfg(feature = "llama-cpp")]
mod llama;
mod reference_engine;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{BufRead, Read, Write};

/// A request of the harness.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Run `ids` at the positions following the state's; answer with every token's logits and the taps.
    Forward {
        /// The token ids.
        ids: Vec<u32>,
    },
    /// Forget the state: the next forward call starts at position 0.
    Reset,
}

/// What the worker says once its model is loaded.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Hello {
    /// The engine (`llama.cpp`).
    pub engine: String,
    /// The runtime's version (the binding crate's version and llama.cpp's build).
    pub version: String,
    /// The device the model runs on, as the runtime names it (`CPU`, …), and its description.
    pub device: String,
    /// The device's own description.
    pub device_description: String,
    /// Every device the runtime has, `name: description`.
    pub devices: Vec<String>,
    /// The vocabulary size (logits per token).
    pub n_vocab: usize,
    /// Decoder layers.
    pub n_layer: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// The context the model runs in (tokens).
    pub n_ctx: usize,
    /// The runtime's settings as it reports them (`flash_attn`, `type_k`, `threads`, `system_info`, …).
    pub settings: BTreeMap<String, String>,
    /// Seconds spent loading.
    pub load_seconds: f64,
}

/// A tensor a forward call produced: its dump name, shape and values.
pub struct Out {
    /// The dump name.
    pub name: String,
    /// Its shape (`[T, width]`).
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Vec<f32>,
}

/// A runtime behind the protocol.
pub trait Engine {
    /// What the worker says after loading.
    fn hello(&self) -> Hello;
    /// Forgets the state.
    fn reset(&mut self) -> Result<()>;
    /// Runs `ids`; every token's logits (`logits` `[T, V]`) and the taps.
    fn forward(&mut self, ids: &[u32]) -> Result<Vec<Out>>;
}

/// Writes one frame.
pub fn write_frame(out: &mut impl Write, tag: u8, bytes: &[u8]) -> std::io::Result<()> {
    out.write_all(&[tag])?;
    out.write_all(&(bytes.len() as u64).to_le_bytes())?;
    out.write_all(bytes)?;
    out.flush()
}

/// The largest frame read: a forward call of a 248,320-token vocabulary over 4,096 tokens is 4 GB of logits.
pub const MAX_FRAME: u64 = 1 << 34;

/// Reads one frame: its tag and bytes; `None` at the end of the stream before a frame starts.
pub fn read_frame(input: &mut impl Read) -> std::io::Result<Option<(u8, Vec<u8>)>> {
    let mut tag = [0u8; 1];
    if input.read(&mut tag)? == 0 {
        return Ok(None);
    }
    let mut len = [0u8; 8];
    input.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len);
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes (more than {MAX_FRAME})"),
        ));
    }
    let mut bytes = vec![0u8; len as usize];
    input.read_exact(&mut bytes)?;
    Ok(Some((tag[0], bytes)))
}

/// A forward call's tensors as the bytes of a safetensors file.
pub fn encode(outs: &[Out]) -> Result<Vec<u8>> {
    let views = outs
        .iter()
        .map(|o| {
            let bytes: &[u8] = bytemuck_f32(&o.data);
            let view = safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                o.shape.clone(),
                bytes,
            )?;
            Ok((o.name.clone(), view))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(safetensors::serialize(views, None)?)
}

/// The bytes of f32 values (little-endian, as every target this runs on).
fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern is a valid u8; the slice covers exactly the values.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// The worker's command line: `--model FILE.gguf [--device NAME] [--context N] [--threads N]`, or
/// `--list-devices`.
#[derive(Debug, Default)]
pub struct WorkerArgs {
    /// The GGUF file.
    pub model: Option<String>,
    /// The runtime's device (`CPU` by default).
    pub device: Option<String>,
    /// The context in tokens.
    pub context: usize,
    /// Threads (0: the machine's).
    pub threads: usize,
    /// Only list the devices (one `name: description` a line) and exit.
    pub list_devices: bool,
}

impl WorkerArgs {
    /// Parses the worker's arguments.
    pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Self> {
        let mut out = WorkerArgs {
            context: 4096,
            ..Default::default()
        };
        let mut it = args.into_iter();
        while let Some(a) = it.next() {
            let mut value = |flag: &str| it.next().with_context(|| format!("{flag}: no value"));
            match a.as_str() {
                "--model" => out.model = Some(value("--model")?),
                "--device" => out.device = Some(value("--device")?),
                "--context" => {
                    out.context = value("--context")?
                        .parse()
                        .context("--context: not a number")?
                }
                "--threads" => {
                    out.threads = value("--threads")?
                        .parse()
                        .context("--threads: not a number")?
                }
                "--list-devices" => out.list_devices = true,
                other => bail!("unknown argument `{other}`"),
            }
        }
        if out.context == 0 {
            bail!("--context must be at least 1");
        }
        Ok(out)
    }
}

/// The engine a worker serves: llama.cpp, or (tests only: `QWEN35_WORKER_ENGINE=reference`) the reference itself
/// behind the same protocol, on `QWEN35_WORKER_MODEL` if set (a model with a planted bug) else on `--model`.
fn open_engine(args: &WorkerArgs) -> Result<Box<dyn Engine>> {
    let model = args
        .model
        .as_deref()
        .context("--model: no GGUF file given")?;
    if std::env::var("QWEN35_WORKER_ENGINE").as_deref() == Ok("reference") {
        let model = std::env::var("QWEN35_WORKER_MODEL").unwrap_or_else(|_| model.to_string());
        return Ok(Box::new(reference_engine::ReferenceEngine::open(
            &model,
            args.context,
        )?));
    }
    open_llama(model, args)
}

#[cfg(feature = "llama-cpp")]
fn open_llama(model: &str, args: &WorkerArgs) -> Result<Box<dyn Engine>> {
    Ok(Box::new(llama::LlamaEngine::open(
        model,
        args.device.as_deref(),
        args.context,
        args.threads,
    )?))
}

#[cfg(not(feature = "llama-cpp"))]
fn open_llama(_model: &str, _args: &WorkerArgs) -> Result<Box<dyn Engine>> {
    bail!("{}", NOT_BUILT)
}

/// Why a worker built without llama.cpp cannot serve it.
pub const NOT_BUILT: &str = "this qwen35-llama-worker was built without llama.cpp: build it with `cargo build \
                             --release -p parity --features llama-cpp` (docs/llamacpp.md)";

/// The devices the engine has here, `name: description` each.
fn list_devices() -> Result<Vec<String>> {
    if std::env::var("QWEN35_WORKER_ENGINE").as_deref() == Ok("reference") {
        return Ok(vec![reference_engine::DEVICE.to_string()]);
    }
    llama_devices()
}

#[cfg(feature = "llama-cpp")]
fn llama_devices() -> Result<Vec<String>> {
    llama::devices()
}

#[cfg(not(feature = "llama-cpp"))]
fn llama_devices() -> Result<Vec<String>> {
    bail!("{}", NOT_BUILT)
}

/// A planted fault of the worker (tests only, `QWEN35_WORKER_FAULT`): `abort-at:N` aborts the process on the N-th
/// forward call (counted from 1), as a runtime that crashes does.
fn abort_at() -> Option<usize> {
    std::env::var("QWEN35_WORKER_FAULT")
        .ok()?
        .strip_prefix("abort-at:")?
        .parse()
        .ok()
}

/// The worker's main loop: loads the engine, says [`Hello`], then answers requests until its input ends. Errors of
/// a request are answered (`{"error": …}`) and the loop goes on; an error before the hello is returned.
pub fn serve(args: WorkerArgs) -> Result<()> {
    // The protocol's frames are bytes on standard output, not text: the one place that writes them.
    #[allow(clippy::disallowed_methods)]
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if args.list_devices {
        let json = match list_devices() {
            Ok(devices) => serde_json::json!({ "devices": devices }),
            Err(e) => serde_json::json!({ "error": format!("{e:#}") }),
        };
        write_frame(&mut out, b'J', json.to_string().as_bytes())?;
        return Ok(());
    }
    let mut engine = match open_engine(&args) {
        Ok(e) => e,
        Err(e) => {
            let json = serde_json::json!({ "error": format!("{e:#}") });
            write_frame(&mut out, b'J', json.to_string().as_bytes())?;
            return Ok(());
        }
    };
    write_frame(
        &mut out,
        b'J',
        serde_json::to_string(&engine.hello())?.as_bytes(),
    )?;
    let abort = abort_at();
    let mut calls = 0usize;
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let answer = match serde_json::from_str::<Request>(&line) {
            Err(e) => Err(anyhow::anyhow!("a request that is not one: {e}")),
            Ok(Request::Reset) => engine.reset().map(|()| None),
            Ok(Request::Forward { ids }) => {
                calls += 1;
                if abort == Some(calls) {
                    std::process::abort();
                }
                engine.forward(&ids).and_then(|o| encode(&o)).map(Some)
            }
        };
        match answer {
            Ok(Some(bytes)) => write_frame(&mut out, b'S', &bytes)?,
            Ok(None) => write_frame(&mut out, b'J', br#"{"ok":true}"#)?,
            Err(e) => {
                let json = serde_json::json!({ "error": format!("{e:#}") });
                write_frame(&mut out, b'J', json.to_string().as_bytes())?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_an_oversized_length_is_refused() {
        let mut buf = Vec::new();
        write_frame(&mut buf, b'J', b"{\"ok\":true}").unwrap();
        write_frame(&mut buf, b'S', &[1, 2, 3]).unwrap();
        let mut r = &buf[..];
        assert_eq!(
            read_frame(&mut r).unwrap(),
            Some((b'J', b"{\"ok\":true}".to_vec()))
        );
        assert_eq!(read_frame(&mut r).unwrap(), Some((b'S', vec![1, 2, 3])));
        assert_eq!(read_frame(&mut r).unwrap(), None);
        let mut big = vec![b'S'];
        big.extend_from_slice(&(MAX_FRAME + 1).to_le_bytes());
        assert!(read_frame(&mut &big[..]).is_err());
        // A frame cut short is an error, not a short frame.
        assert!(read_frame(&mut &buf[..5]).is_err());
    }

    #[test]
    fn the_worker_arguments_are_checked() {
        let a = |s: &str| WorkerArgs::parse(s.split_whitespace().map(String::from));
        let ok = a("--model m.gguf --device CPU --context 64 --threads 2").unwrap();
        assert_eq!(ok.model.as_deref(), Some("m.gguf"));
        assert_eq!((ok.context, ok.threads), (64, 2));
        for bad in ["--context 0", "--context x", "--model", "--frobnicate"] {
            assert!(a(bad).is_err(), "{bad}");
        }
    }
}
