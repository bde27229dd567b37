//! llama.cpp through its maintained Rust binding (`llama-cpp-sys-2`, which builds the llama.cpp it vendors; ggml's
//! CPU back end in every variant, the one for this CPU chosen at run time, as llama.cpp's releases do). A forward
//! call decodes the tokens as one batch with every position's logits, and llama.cpp's evaluation callback
//! (`cb_eval`) copies out the tensors the dump maps (`model.input_embed`, `l_out-{i}`, `result_norm`: the one map,
//! [`crate::dump::llamacpp::mapped`]).
//!
//! Other back ends (an OpenVINO build of ggml, say) are loaded from `QWEN35_GGML_BACKENDS` (paths of back-end
//! libraries, `:`-separated) and chosen by name (`--devices llama.cpp:NAME`).

use super::{Engine, Hello, Out};
use anyhow::{Context, Result, bail};
use llama_cpp_sys_2 as sys;
use std::collections::BTreeMap;
use std::ffi::{CStr, CString, c_char, c_void};
use std::sync::Once;
use std::time::Instant;

/// What the callback gathers during one decode: per dump name, its width and the rows seen so far.
#[derive(Default)]
struct Gathered {
    tensors: BTreeMap<String, (usize, Vec<f32>)>,
    error: Option<String>,
}

/// The dump name of a graph tensor the harness compares, if any.
fn wanted(name: &str) -> Option<String> {
    crate::dump::llamacpp::mapped(name).filter(|n| n != "logits")
}

/// # Safety
/// Called by ggml's scheduler with a valid tensor and the `Gathered` the context was created with.
unsafe extern "C" fn on_tensor(t: *mut sys::ggml_tensor, ask: bool, user: *mut c_void) -> bool {
    // SAFETY: ggml hands a valid tensor whose name is a NUL-terminated string.
    let name = unsafe { CStr::from_ptr(sys::ggml_get_name(t)) }.to_string_lossy();
    let Some(to) = wanted(&name) else {
        return !ask;
    };
    if ask {
        return true;
    }
    // SAFETY: `user` is the `Gathered` the context was created with, alive for the context's life.
    let gathered = unsafe { &mut *user.cast::<Gathered>() };
    // SAFETY: the tensor is computed (ask is false) and valid for the call.
    match unsafe { copy_out(t) } {
        Ok((width, rows)) => {
            let entry = gathered.tensors.entry(to).or_insert((width, Vec::new()));
            if entry.0 != width {
                gathered.error = Some(format!(
                    "`{name}` changed width from {} to {width}",
                    entry.0
                ));
            }
            entry.1.extend_from_slice(&rows);
        }
        Err(e) => gathered.error = Some(format!("`{name}`: {e}")),
    }
    true
}

/// A computed 2-axis tensor's values, row-major over its `ne[1]` rows of `ne[0]` values (strided views followed
/// through `nb`), widened to f32.
///
/// # Safety
/// `t` must be a valid, computed tensor.
unsafe fn copy_out(t: *mut sys::ggml_tensor) -> Result<(usize, Vec<f32>)> {
    // SAFETY: valid tensor, per the caller.
    let tensor = unsafe { &*t };
    if tensor.ne[2] != 1 || tensor.ne[3] != 1 {
        bail!("expected two axes, ne = {:?}", tensor.ne);
    }
    let (width, rows) = (tensor.ne[0] as usize, tensor.ne[1] as usize);
    // SAFETY: valid tensor.
    let bytes = unsafe { sys::ggml_nbytes(t) };
    let mut host = vec![0u8; bytes];
    // SAFETY: `host` holds the `bytes` the tensor spans.
    unsafe {
        if sys::ggml_backend_buffer_is_host(tensor.buffer) {
            std::ptr::copy_nonoverlapping(tensor.data.cast::<u8>(), host.as_mut_ptr(), bytes);
        } else {
            sys::ggml_backend_tensor_get(t, host.as_mut_ptr().cast(), 0, bytes);
        }
    }
    let ty = tensor.type_;
    let size = match ty {
        sys::GGML_TYPE_F32 => 4,
        sys::GGML_TYPE_F16 | sys::GGML_TYPE_BF16 => 2,
        other => bail!("ggml type {other} (not a float type)"),
    };
    let mut out = Vec::with_capacity(width * rows);
    for r in 0..rows {
        for c in 0..width {
            let at = r * tensor.nb[1] + c * tensor.nb[0];
            let b = &host[at..at + size];
            out.push(match ty {
                sys::GGML_TYPE_F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                sys::GGML_TYPE_F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
                _ => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
            });
        }
    }
    Ok((width, out))
}

/// llama.cpp's messages go to standard error, warnings and errors only (the harness keeps the last of them).
unsafe extern "C" fn on_log(level: sys::ggml_log_level, text: *const c_char, _: *mut c_void) {
    if level >= sys::GGML_LOG_LEVEL_WARN && level != sys::GGML_LOG_LEVEL_CONT {
        // SAFETY: llama.cpp hands a NUL-terminated message.
        let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
        crate::console::write(crate::console::Stream::Err, format_args!("{text}"));
    }
}

static INIT: Once = Once::new();

/// Loads ggml's back ends (the CPU variants built beside this binary's llama.cpp, and any in
/// `QWEN35_GGML_BACKENDS`) once.
fn init() {
    INIT.call_once(|| {
        // SAFETY: plain initialisation calls of the library, made once, with valid NUL-terminated paths.
        unsafe {
            sys::llama_log_set(Some(on_log), std::ptr::null_mut());
            if let Some(dir) = sys::BACKENDS_DIR
                && let Ok(dir) = CString::new(dir)
            {
                sys::ggml_backend_load_all_from_path(dir.as_ptr());
            }
            if let Ok(extra) = std::env::var("QWEN35_GGML_BACKENDS") {
                for p in extra.split(':').filter(|p| !p.is_empty()) {
                    if let Ok(c) = CString::new(p)
                        && sys::ggml_backend_load(c.as_ptr()).is_null()
                    {
                        crate::errln!(
                            "QWEN35_GGML_BACKENDS: {p}: ggml could not load this back end"
                        );
                    }
                }
            }
            sys::llama_backend_init();
        }
    });
}

/// A NUL-terminated C string as text (empty for a null pointer).
fn text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: ggml returns NUL-terminated strings that live as long as the library.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Every ggml device: its handle, name and description.
fn all_devices() -> Vec<(sys::ggml_backend_dev_t, String, String)> {
    init();
    // SAFETY: index within the count the library gives.
    unsafe {
        (0..sys::ggml_backend_dev_count())
            .map(|i| {
                let d = sys::ggml_backend_dev_get(i);
                (
                    d,
                    text(sys::ggml_backend_dev_name(d)),
                    text(sys::ggml_backend_dev_description(d)),
                )
            })
            .collect()
    }
}

/// The devices llama.cpp has here, `name: description` each.
pub fn devices() -> Result<Vec<String>> {
    Ok(all_devices()
        .into_iter()
        .map(|(_, n, d)| format!("{n}: {d}"))
        .collect())
}

/// llama.cpp on a GGUF file.
pub struct LlamaEngine {
    model: *mut sys::llama_model,
    ctx: *mut sys::llama_context,
    gathered: Box<Gathered>,
    position: usize,
    n_vocab: usize,
    hello: Hello,
}

impl Drop for LlamaEngine {
    fn drop(&mut self) {
        // SAFETY: both were made by llama.cpp and are freed once, the context first.
        unsafe {
            sys::llama_free(self.ctx);
            sys::llama_model_free(self.model);
        }
    }
}

impl LlamaEngine {
    /// Loads `model` on `device` (ggml's name, `CPU` by default) with a context of `context` tokens.
    pub fn open(model: &str, device: Option<&str>, context: usize, threads: usize) -> Result<Self> {
        init();
        let start = Instant::now();
        let devices = all_devices();
        let want = device.unwrap_or("CPU");
        let Some((dev, dev_name, dev_desc)) = devices
            .iter()
            .find(|(_, n, _)| n.eq_ignore_ascii_case(want))
            .cloned()
        else {
            let names: Vec<&str> = devices.iter().map(|(_, n, _)| n.as_str()).collect();
            bail!(
                "llama.cpp has no device `{want}` here; it has: {}",
                names.join(", ")
            );
        };
        let is_cpu = dev_name.eq_ignore_ascii_case("CPU");
        let path = CString::new(model).context("the model path holds a NUL byte")?;
        let mut chosen = [dev, std::ptr::null_mut()];
        // SAFETY: default parameters, then fields set to valid values; `chosen` outlives the load call.
        let model_ptr = unsafe {
            let mut p = sys::llama_model_default_params();
            if is_cpu {
                p.n_gpu_layers = 0;
            } else {
                p.devices = chosen.as_mut_ptr();
                p.n_gpu_layers = -1;
            }
            sys::llama_model_load_from_file(path.as_ptr(), p)
        };
        if model_ptr.is_null() {
            bail!("{model}: llama.cpp could not load this model (its messages above say why)");
        }
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        let mut gathered = Box::<Gathered>::default();
        // SAFETY: default parameters with valid fields; `gathered` is boxed so its address stays put for the
        // context's life (it is dropped after the context, in `Drop`).
        let (ctx, cparams) = unsafe {
            let mut c = sys::llama_context_default_params();
            c.n_ctx = context as u32;
            c.n_batch = context as u32;
            c.n_ubatch = context as u32;
            c.n_seq_max = 1;
            c.n_threads = threads as i32;
            c.n_threads_batch = threads as i32;
            c.cb_eval = Some(on_tensor);
            c.cb_eval_user_data = std::ptr::addr_of_mut!(*gathered).cast();
            c.no_perf = true;
            (sys::llama_init_from_model(model_ptr, c), c)
        };
        if ctx.is_null() {
            // SAFETY: loaded above, freed once.
            unsafe { sys::llama_model_free(model_ptr) };
            bail!("llama.cpp could not create a context of {context} tokens for {model}");
        }
        // SAFETY: valid model and context.
        let (n_vocab, n_layer, n_embd, n_ctx) = unsafe {
            (
                sys::llama_vocab_n_tokens(sys::llama_model_get_vocab(model_ptr)) as usize,
                sys::llama_model_n_layer(model_ptr) as usize,
                sys::llama_model_n_embd(model_ptr) as usize,
                sys::llama_n_ctx(ctx) as usize,
            )
        };
        let mut settings = BTreeMap::new();
        settings.insert("threads".into(), threads.to_string());
        settings.insert(
            "flash_attn".into(),
            // SAFETY: returns a static string.
            text(unsafe { sys::llama_flash_attn_type_name(cparams.flash_attn_type) }),
        );
        settings.insert("type_k".into(), ggml_type_name(cparams.type_k));
        settings.insert("type_v".into(), ggml_type_name(cparams.type_v));
        // SAFETY: returns a static string.
        settings.insert(
            "system_info".into(),
            text(unsafe { sys::llama_print_system_info() }),
        );
        let hello = Hello {
            engine: "llama.cpp".into(),
            version: format!("llama-cpp-sys-2 {}", LLAMA_CPP_SYS_VERSION),
            device: dev_name,
            device_description: dev_desc,
            devices: devices
                .iter()
                .map(|(_, n, d)| format!("{n}: {d}"))
                .collect(),
            n_vocab,
            n_layer,
            n_embd,
            n_ctx,
            settings,
            load_seconds: start.elapsed().as_secs_f64(),
        };
        Ok(LlamaEngine {
            model: model_ptr,
            ctx,
            gathered,
            position: 0,
            n_vocab,
            hello,
        })
    }
}

/// The binding's version this worker was built with.
const LLAMA_CPP_SYS_VERSION: &str = "0.1.161";

fn ggml_type_name(t: sys::ggml_type) -> String {
    // SAFETY: returns a static string for any type.
    text(unsafe { sys::ggml_type_name(t) })
}

impl Engine for LlamaEngine {
    fn hello(&self) -> Hello {
        self.hello.clone()
    }

    fn reset(&mut self) -> Result<()> {
        // SAFETY: valid context.
        unsafe { sys::llama_memory_clear(sys::llama_get_memory(self.ctx), true) };
        self.position = 0;
        Ok(())
    }

    fn forward(&mut self, ids: &[u32]) -> Result<Vec<Out>> {
        let n = ids.len();
        if n == 0 {
            bail!("a forward call of no tokens");
        }
        if self.position + n > self.hello.n_ctx {
            bail!(
                "{} tokens from position {} exceed llama.cpp's context of {} (--context)",
                n,
                self.position,
                self.hello.n_ctx
            );
        }
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.n_vocab) {
            bail!(
                "token id {id} is out of the vocabulary ({} tokens)",
                self.n_vocab
            );
        }
        self.gathered.tensors.clear();
        self.gathered.error = None;
        // SAFETY: a batch of `n` tokens for one sequence, filled within its size, freed below.
        let status = unsafe {
            let batch = sys::llama_batch_init(n as i32, 0, 1);
            for (i, &id) in ids.iter().enumerate() {
                *batch.token.add(i) = id as i32;
                *batch.pos.add(i) = (self.position + i) as i32;
                *batch.n_seq_id.add(i) = 1;
                *(*batch.seq_id.add(i)) = 0;
                *batch.logits.add(i) = 1;
            }
            let mut b = batch;
            b.n_tokens = n as i32;
            let status = sys::llama_decode(self.ctx, b);
            sys::llama_batch_free(batch);
            status
        };
        if status != 0 {
            bail!(
                "llama_decode returned {status} on {n} tokens at position {}",
                self.position
            );
        }
        self.position += n;
        if let Some(e) = self.gathered.error.take() {
            bail!("llama.cpp's callback: {e}");
        }
        let mut logits = Vec::with_capacity(n * self.n_vocab);
        for i in 0..n {
            // SAFETY: every position asked for logits; the row holds n_vocab values.
            let row = unsafe { sys::llama_get_logits_ith(self.ctx, i as i32) };
            if row.is_null() {
                bail!("llama.cpp gave no logits for position {i} of the call");
            }
            // SAFETY: as above.
            logits.extend_from_slice(unsafe { std::slice::from_raw_parts(row, self.n_vocab) });
        }
        let mut outs = vec![Out {
            name: "logits".into(),
            shape: vec![n, self.n_vocab],
            data: logits,
        }];
        for (name, (width, data)) in std::mem::take(&mut self.gathered.tensors) {
            if data.len() != n * width {
                bail!(
                    "llama.cpp's `{name}` holds {} rows of {width} for a call of {n} tokens",
                    data.len() / width.max(1)
                );
            }
            outs.push(Out {
                name,
                shape: vec![n, width],
                data,
            });
        }
        Ok(outs)
    }
}
