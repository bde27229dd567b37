//! llama.cpp as a device under test (`--devices llama.cpp[:NAME]`): the GGUF file the reference runs (`--model
//! FILE.gguf`), run by llama.cpp in a worker process of its own (`qwen35-llama-worker`, built with the `llama-cpp`
//! feature; the protocol is [`crate::worker`]'s). Each forward call returns every position's logits and the tensors
//! llama.cpp's evaluation callback yields under the dump's names (the embeddings, each layer's output, the final
//! norm): hidden states are compared layer by layer; llama.cpp keeps its caches and recurrent states inside, so
//! states are reported as not exposed. `NAME` is ggml's device (`CPU` by default; another back end, e.g. an OpenVINO
//! build of ggml, loaded from `QWEN35_GGML_BACKENDS`).
//!
//! A worker that dies (llama.cpp's CPU back end segfaults on some CPUs and files) is an error naming the signal, the
//! call and llama.cpp's last messages: the harness goes on to report it instead of dying with it.

use super::fault::{Fault, Faulty};
use super::pieces::Pieces;
use super::{Capabilities, DeviceUnderTest, GraphInfo, LayerDevice};
use crate::worker::{Hello, Request, read_frame};
use anyhow::{Context, Result, anyhow, bail};
use candle_core::{Device, Tensor};
use reference::backend::{Backend, Forward, Precision, RunRecord, Snapshot};
use reference::config::Config;
use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};

/// The device's name on the command line.
pub const NAME: &str = "llama.cpp";

/// Why llama.cpp's states are not compared, as reports say it.
pub const STATE_NOT_EXPOSED: &str = "not exposed: llama.cpp keeps its KV caches and recurrent states inside its \
     context (its API saves them only as an opaque sequence file)";

/// The worker program's name.
pub const WORKER: &str = "qwen35-llama-worker";

/// Whether `device` names llama.cpp (`llama.cpp` or `llama.cpp:NAME`).
pub fn is_llamacpp(device: &str) -> bool {
    let d = device.trim();
    d.eq_ignore_ascii_case(NAME)
        || d.get(..NAME.len() + 1)
            .is_some_and(|p| p.eq_ignore_ascii_case("llama.cpp:"))
}

/// ggml's device `device` names (`llama.cpp:NAME`), if any.
fn ggml_device(device: &str) -> Option<&str> {
    device
        .trim()
        .get(NAME.len() + 1..)
        .map(str::trim)
        .filter(|s| !s.is_empty())
}

/// The worker program: `QWEN35_LLAMA_WORKER`, else `qwen35-llama-worker` beside this program (or one folder up, as
/// a test binary in `target/release/deps` finds the binaries of `target/release`).
pub fn worker_program() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("QWEN35_LLAMA_WORKER") {
        let p = PathBuf::from(p);
        if !p.is_file() {
            bail!("QWEN35_LLAMA_WORKER={}: no such program", p.display());
        }
        return Ok(p);
    }
    let exe = std::env::current_exe().context("where this program is")?;
    let dir = exe.parent().context("this program's folder")?;
    for d in [Some(dir), dir.parent()].into_iter().flatten() {
        let p = d.join(WORKER);
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!(
        "--devices {NAME}: no {WORKER} beside {}: build it with `cargo build --release -p parity --features \
         llama-cpp` (docs/llamacpp.md)",
        exe.display()
    )
}

/// The last lines a worker wrote on standard error.
type Tail = Arc<Mutex<VecDeque<String>>>;

const TAIL_LINES: usize = 12;

/// A worker process and its pipes.
struct Worker {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: ChildStdout,
    tail: Tail,
    what: String,
}

impl Worker {
    /// Starts the worker with `args`.
    fn spawn(args: &[String], what: &str) -> Result<Self> {
        let program = worker_program()?;
        let mut child = Command::new(&program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("{what}: starting {}", program.display()))?;
        let tail: Tail = Arc::default();
        let stderr = child.stderr.take().context("the worker's standard error")?;
        let t = Arc::clone(&tail);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(|l| l.ok()) {
                let mut t = t.lock().unwrap_or_else(|p| p.into_inner());
                if t.len() == TAIL_LINES {
                    t.pop_front();
                }
                t.push_back(line);
            }
        });
        Ok(Worker {
            stdin: child.stdin.take(),
            stdout: child
                .stdout
                .take()
                .context("the worker's standard output")?,
            child,
            tail,
            what: what.to_string(),
        })
    }

    /// The worker's last messages, for an error.
    fn messages(&self) -> String {
        // The reader thread may still be taking the last lines of a worker that just ended.
        std::thread::sleep(std::time::Duration::from_millis(50));
        let t = self.tail.lock().unwrap_or_else(|p| p.into_inner());
        if t.is_empty() {
            String::new()
        } else {
            format!(
                "; its last messages:\n  {}",
                t.iter().cloned().collect::<Vec<_>>().join("\n  ")
            )
        }
    }

    /// Why the worker stopped answering, in words: the signal or exit code it ended with, and its messages.
    fn died(&mut self, during: &str) -> anyhow::Error {
        drop(self.stdin.take());
        let (status, crashed) = match self.child.wait() {
            Ok(s) => (describe_exit(s), s.code().is_none()),
            Err(e) => (format!("could not be waited for ({e})"), false),
        };
        let finding = if crashed {
            ": the device crashed (a finding about llama.cpp on this machine and file, not about the model)"
        } else {
            ""
        };
        anyhow!(
            "{}: its worker process {status} during {during}{finding}{}",
            self.what,
            self.messages()
        )
    }

    /// The next frame, or why there is none.
    fn frame(&mut self, during: &str) -> Result<(u8, Vec<u8>)> {
        match read_frame(&mut self.stdout) {
            Ok(Some(f)) => Ok(f),
            Ok(None) | Err(_) => Err(self.died(during)),
        }
    }

    /// A JSON frame: `{"error": …}` is the worker's error, anything else the value.
    fn json(&mut self, during: &str) -> Result<serde_json::Value> {
        let (tag, bytes) = self.frame(during)?;
        if tag != b'J' {
            bail!(
                "{}: the worker answered {during} with a frame `{}`",
                self.what,
                tag as char
            );
        }
        let v: serde_json::Value = serde_json::from_slice(&bytes)
            .with_context(|| format!("{}: the worker's answer to {during}", self.what))?;
        if let Some(e) = v.get("error").and_then(|e| e.as_str()) {
            bail!("{}: {e}{}", self.what, self.messages());
        }
        Ok(v)
    }

    /// Sends `req`.
    fn send(&mut self, req: &Request, during: &str) -> Result<()> {
        let line = serde_json::to_string(req)? + "\n";
        let sent = match self.stdin.as_mut() {
            Some(i) => i.write_all(line.as_bytes()).and_then(|()| i.flush()),
            None => Err(std::io::Error::other("closed")),
        };
        if sent.is_err() {
            return Err(self.died(during));
        }
        Ok(())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        drop(self.stdin.take());
        // The worker ends when its input does; one that does not is ended.
        for _ in 0..100 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An exit status in words: `ended with signal 11 (SIGSEGV)`, `exited with code 3`.
fn describe_exit(s: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt as _;
    if let Some(sig) = s.signal() {
        let name = match sig {
            libc::SIGSEGV => " (SIGSEGV)",
            libc::SIGABRT => " (SIGABRT)",
            libc::SIGILL => " (SIGILL)",
            libc::SIGBUS => " (SIGBUS)",
            libc::SIGFPE => " (SIGFPE)",
            libc::SIGKILL => " (SIGKILL)",
            _ => "",
        };
        format!("ended with signal {sig}{name}")
    } else {
        match s.code() {
            Some(c) => format!("exited with code {c}"),
            None => "ended".into(),
        }
    }
}

/// The devices llama.cpp has here (`name: description`), asked of a worker.
pub fn devices() -> Result<Vec<String>> {
    let mut w = Worker::spawn(&["--list-devices".into()], NAME)?;
    let v = w.json("listing its devices")?;
    Ok(v.get("devices")
        .and_then(|d| d.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default())
}

/// Fails unless `device` (`llama.cpp[:NAME]`) can run here: the worker is built with llama.cpp, and has `NAME`.
pub fn check(device: &str) -> Result<()> {
    let have = devices()?;
    if let Some(want) = ggml_device(device) {
        let names: Vec<&str> = have
            .iter()
            .map(|d| d.split(':').next().unwrap_or(d))
            .collect();
        if !names.iter().any(|n| n.eq_ignore_ascii_case(want)) {
            bail!(
                "{device}: llama.cpp has no device `{want}` here; it has: {}",
                names.join(", ")
            );
        }
    }
    Ok(())
}

/// The GGUF file llama.cpp runs for `model` (the file, or the one a directory holds), or an error naming `--model`.
pub fn gguf_of(model: &Path) -> Result<PathBuf> {
    match reference::gguf::find(model)? {
        Some(p) => Ok(p),
        None => bail!(
            "--devices {NAME} runs a GGUF file: --model {} holds none (convert the checkpoint with llama.cpp's \
             convert_hf_to_gguf.py, docs/llamacpp.md)",
            model.display()
        ),
    }
}

/// llama.cpp's forward calls, through a worker.
pub struct LlamaCppBackend {
    worker: Worker,
    config: Config,
    record: RunRecord,
    position: usize,
}

impl LlamaCppBackend {
    /// Starts a worker on `gguf` with `config` (the reference's, checked against what llama.cpp loaded).
    pub fn open(
        gguf: &Path,
        config: &Config,
        device: &str,
        context: usize,
    ) -> Result<(Self, Hello)> {
        let mut args = vec![
            "--model".to_string(),
            gguf.display().to_string(),
            "--context".into(),
            context.to_string(),
        ];
        if let Some(d) = ggml_device(device) {
            args.extend(["--device".into(), d.to_string()]);
        }
        let mut worker = Worker::spawn(&args, &format!("--devices {device}"))?;
        let v = worker.json("loading the model")?;
        let hello: Hello = serde_json::from_value(v).context("the worker's hello")?;
        let expect = (config.vocab_size, config.num_layers(), config.hidden_size);
        let got = (hello.n_vocab, hello.n_layer, hello.n_embd);
        if got != expect {
            bail!(
                "{device}: llama.cpp loaded {} as {} tokens, {} layers of {} values; the reference reads {} tokens, \
                 {} layers of {}",
                gguf.display(),
                got.0,
                got.1,
                got.2,
                expect.0,
                expect.1,
                expect.2
            );
        }
        let mut properties = hello.settings.clone();
        properties.insert("load_seconds".into(), format!("{:.2}", hello.load_seconds));
        let record = RunRecord {
            backend: hello.engine.clone(),
            device: Some(hello.device.clone()),
            runtime: Some(hello.version.clone()),
            device_name: Some(hello.device_description.clone()),
            dtype: "f32".into(),
            precision_requested: None,
            // Activations are f32 (its caches f16, its products in the weights' types: `--arithmetic llama-cpp`
            // models them on the reference).
            precision: Some(Precision::F32),
            execution_devices: Some(hello.device.clone()),
            properties,
            weights: "gguf".into(),
            context: Some(hello.n_ctx),
            taps: true,
            compile_seconds: Some(hello.load_seconds),
            ..RunRecord::default()
        };
        Ok((
            LlamaCppBackend {
                worker,
                config: config.clone(),
                record,
                position: 0,
            },
            hello,
        ))
    }
}

impl Backend for LlamaCppBackend {
    fn config(&self) -> &Config {
        &self.config
    }

    fn record(&self) -> &RunRecord {
        &self.record
    }

    fn reset(&mut self) -> reference::Result<()> {
        self.worker
            .send(&Request::Reset, "a reset")
            .and_then(|()| self.worker.json("a reset").map(drop))
            .map_err(device_error)?;
        self.position = 0;
        Ok(())
    }

    fn forward(&mut self, ids: &[u32], all_logits: bool) -> reference::Result<Forward> {
        let during = format!(
            "a call of {} token(s) at position {}",
            ids.len(),
            self.position
        );
        let req = Request::Forward { ids: ids.to_vec() };
        let (tag, bytes) = self
            .worker
            .send(&req, &during)
            .and_then(|()| self.worker.frame(&during))
            .map_err(device_error)?;
        if tag == b'J' {
            let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
            let e = v
                .get("error")
                .and_then(|e| e.as_str())
                .unwrap_or("an unreadable answer");
            return Err(device_error(anyhow!("{}: {during}: {e}", self.worker.what)));
        }
        let mut tensors = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)?;
        let logits = tensors.remove("logits").ok_or_else(|| {
            device_error(anyhow!(
                "{}: {during}: no logits in the answer",
                self.worker.what
            ))
        })?;
        let rows = logits.dim(0)?;
        if rows != ids.len() {
            return Err(device_error(anyhow!(
                "{}: {during}: {rows} rows of logits",
                self.worker.what
            )));
        }
        self.position += ids.len();
        let logits = if all_logits {
            logits
        } else {
            logits.narrow(0, rows - 1, 1)?
        };
        Ok(Forward {
            logits,
            taps: tensors.into_iter().collect::<BTreeMap<String, Tensor>>(),
        })
    }

    fn state_hidden(&self) -> Option<&'static str> {
        Some(STATE_NOT_EXPOSED)
    }

    fn position(&self) -> reference::Result<usize> {
        Ok(self.position)
    }

    fn snapshot(&self) -> reference::Result<Snapshot> {
        Err(reference::Error::Input(
            "llama.cpp keeps its states inside its context: they cannot be read out".into(),
        ))
    }

    fn restore(&mut self, _: &Snapshot) -> reference::Result<()> {
        Err(reference::Error::Input(
            "llama.cpp keeps its states inside its context: they cannot be restored".into(),
        ))
    }
}

fn device_error(e: anyhow::Error) -> reference::Error {
    reference::Error::Input(format!("{e:#}"))
}

/// llama.cpp on a GGUF file, as a device under test.
pub struct LlamaCppDevice {
    label: String,
    device: String,
    caps: Capabilities,
    gguf: PathBuf,
    config: Config,
    context: usize,
    deployed: Faulty<LlamaCppBackend>,
    fault: Option<Fault>,
    graphs: Vec<GraphInfo>,
}

impl LlamaCppDevice {
    /// Starts llama.cpp on `gguf` (the model the reference runs, `config` its config) for `device`, with a context
    /// of `context` tokens; misbehaving as `fault` says (tests only).
    pub fn open(
        gguf: &Path,
        config: &Config,
        device: &str,
        context: usize,
        fault: Option<Fault>,
    ) -> Result<Self> {
        let (backend, hello) = LlamaCppBackend::open(gguf, config, device, context)?;
        let label = format!("{NAME} {}", hello.device);
        let graphs = vec![GraphInfo {
            purpose: "deployed".into(),
            graph: gguf
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
            // The activations' (the products take the file's types, the KV cache is `type_k`: the run record's
            // properties say both).
            precision: "f32".into(),
            execution_devices: Some(hello.device.clone()),
            compile_seconds: hello.load_seconds,
            loaded_from_cache: None,
        }];
        let deployed = Faulty::new(backend, fault).with_context(Some(hello.n_ctx));
        Ok(LlamaCppDevice {
            label,
            // The ggml device it runs on, named: what the execution-devices check holds the graph to.
            device: format!("{NAME}:{}", hello.device),
            caps: Capabilities {
                kind: "llama.cpp",
                states: false,
                states_note: STATE_NOT_EXPOSED,
                hidden: true,
                token_valid: false,
                single_token: true,
                layer_graphs: false,
                fed_routing: false,
                any_block: false,
                blocks: Vec::new(),
                block: None,
                context: Some(hello.n_ctx),
                context_source: "--context".into(),
            },
            gguf: gguf.to_path_buf(),
            config: config.clone(),
            context,
            deployed,
            fault,
            graphs,
        })
    }
}

impl DeviceUnderTest for LlamaCppDevice {
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

    /// The deployed calls carry the hidden states.
    fn tapped(&mut self) -> Result<Option<&mut dyn Backend>> {
        Ok(None)
    }

    fn with_block(&mut self, block: usize) -> Result<Box<dyn Backend + '_>> {
        Ok(Box::new(Pieces {
            inner: &mut self.deployed,
            block,
        }))
    }

    /// llama.cpp takes any number of tokens a call: there is no padding to turn on.
    fn set_padding(&mut self, padded: bool) -> Result<()> {
        self.deployed.set_padded(padded);
        Ok(())
    }

    /// One process holds the model; nothing is compiled again.
    fn release(&mut self) {}

    fn fresh(&self) -> Result<Box<dyn Backend>> {
        let (backend, _) =
            LlamaCppBackend::open(&self.gguf, &self.config, &self.device, self.context)?;
        Ok(Box::new(
            Faulty::new(backend, self.fault).with_context(Some(self.context)),
        ))
    }

    fn layers(&self, _: &[usize], _: usize) -> Result<Option<Box<dyn LayerDevice + '_>>> {
        Ok(None)
    }

    fn graphs(&self) -> Vec<GraphInfo> {
        self.graphs.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_cpp_device_names_are_recognised_and_split() {
        for (name, yes, dev) in [
            ("llama.cpp", true, None),
            ("LLAMA.CPP", true, None),
            ("llama.cpp:CPU", true, Some("CPU")),
            ("llama.cpp: OPENVINO ", true, Some("OPENVINO")),
            ("llama.cpp:", true, None),
            ("llama.cppx", false, None),
            ("CPU", false, None),
            ("FP16SIM", false, None),
        ] {
            assert_eq!(is_llamacpp(name), yes, "{name}");
            if yes {
                assert_eq!(ggml_device(name), dev, "{name}");
            }
        }
    }
}
