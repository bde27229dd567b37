//! Compiling an IR from its path, through OpenVINO's C API.
//!
//! OpenVINO keys its model cache by a hash of what it is given. Given a model read into memory (all the `openvino`
//! crate can compile), that hash covers every constant: at the 9B's scale a cached start reads and hashes the
//! whole 5.2 GB `.bin` before the plugin imports its blob (measured: the `.bin` entirely in the page cache after a
//! start that found it evicted, and the process's peak 15.0 GB against 9.5 GB). Given the `.xml`'s path, the hash
//! covers the path and the options alone, and a cached start never opens the `.bin`. That is only sound where the
//! path names its contents: the IR cache's entries ([`crate::engine`]'s `ir_cache`), whose directory is the hash of
//! everything their bytes depend on, written whole or not at all.
//!
//! The crate exposes neither the compile from a path nor a way to hand it a compiled model made elsewhere, so
//! [`PathSession`] is the one [`Executor`] written against `openvino-sys` directly: a core, the compiled model and
//! its infer request, each freed when it is dropped. The C API's `.xml` reader looks for the weights beside it with
//! the same stem (`decoder_t16.bin`), which the IR cache links to its shared `weights.bin`.

use crate::devices::{
    CompileOptions, ExecInfo, compile_settings, lock_cache, openvino_message, read_back,
    requested_properties,
};
use crate::error::{Error, Result};
use crate::infer::{Executor, HostElem, host_bytes, host_tensor};
use candle_core::Tensor;
use openvino_sys as sys;
use std::collections::BTreeMap;
use std::ffi::{CStr, CString, c_char, c_void};
use std::path::Path;

/// A graph compiled from its `.xml`'s path on an OpenVINO device, with its infer request.
pub struct PathSession {
    info: ExecInfo,
    core: *mut sys::ov_core_t,
    model: *mut sys::ov_compiled_model_t,
    request: *mut sys::ov_infer_request_t,
}

/// OpenVINO's last error message on this thread, without its source locations.
fn last_error(status: sys::ov_status_e) -> String {
    // SAFETY: the C API returns a NUL-terminated string it owns (or null), valid until its next call.
    let text = unsafe {
        let p = sys::ov_get_last_err_msg();
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    if text.trim().is_empty() {
        format!("{status:?}")
    } else {
        openvino_message(&text)
    }
}

/// A C string for OpenVINO, or an error naming what held a NUL byte.
fn c_string(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::Config(format!("{what} `{s}` holds a NUL byte")))
}

/// Takes a string the C API allocated, freeing it.
///
/// # Safety
/// `p` is null or a NUL-terminated string allocated by the C API and not freed yet.
unsafe fn take_string(p: *mut c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the caller's guarantee.
    unsafe {
        let s = CStr::from_ptr(p).to_string_lossy().into_owned();
        sys::ov_free(p);
        s
    }
}

/// The ways a `PathSession` call can fail: the stage and the message.
type Failure = (&'static str, String);

/// `Ok` for `OK`, else the stage and OpenVINO's message.
fn check(stage: &'static str, status: sys::ov_status_e) -> std::result::Result<(), Failure> {
    if status == sys::ov_status_e::OK {
        Ok(())
    } else {
        Err((stage, last_error(status)))
    }
}

impl PathSession {
    /// Compiles the IR at `xml` (its weights in the `.bin` of the same stem beside it) for `device` with `opts`
    /// (this project's properties, the user's device config and the model cache, set on a core of its own), as
    /// [`crate::devices::compile_ir`] does from a read model; `name` names the graph in errors and reports.
    pub fn compile(xml: &Path, name: &str, device: &str, opts: &CompileOptions) -> Result<Self> {
        crate::runtime::load()?;
        let start = std::time::Instant::now();
        let requested = requested_properties(device, opts);
        let settings = compile_settings(device, &requested, opts)?;
        let _lock = lock_cache(opts)?;
        let keys: Vec<CString> = settings
            .iter()
            .map(|(k, _)| c_string("property", k))
            .collect::<Result<_>>()?;
        let values: Vec<CString> = settings
            .iter()
            .map(|(k, v)| c_string(k, v))
            .collect::<Result<_>>()?;
        let c_xml = c_string("IR path", &xml.to_string_lossy())?;
        let c_device = c_string("device", device)?;
        let mut session = PathSession {
            // Filled in once compiled.
            info: read_back(name, device, opts, &requested, |_| None),
            core: std::ptr::null_mut(),
            model: std::ptr::null_mut(),
            request: std::ptr::null_mut(),
        };
        let fail = |(stage, message): Failure| Error::OpenVino {
            stage,
            graph: name.to_string(),
            device: device.to_string(),
            message,
        };
        // SAFETY: every pointer handed to the C API is valid for the call: the C strings and the property array
        // outlive it, the out-pointers are fields of `session`, whose `Drop` frees whatever was created.
        unsafe {
            check("creating the core", sys::ov_core_create(&mut session.core)).map_err(fail)?;
            // The device's plugin loaded before its properties are set, as `compile_ir`'s `require` loads it: the
            // CPU plugin resolves an INFERENCE_PRECISION_HINT of f16 it cannot compute to f32 when set before it
            // is loaded and to bf16 after, so the same request gave f32 decoders here and bf16 graphs there.
            let mut name: *mut c_char = std::ptr::null_mut();
            let status = sys::ov_core_get_property(
                session.core,
                c_device.as_ptr(),
                c"FULL_DEVICE_NAME".as_ptr(),
                &mut name,
            );
            take_string(name);
            check("loading the device", status).map_err(fail)?;
            for ((k, v), (key, value)) in keys.iter().zip(&values).zip(&settings) {
                check(
                    "compiling",
                    sys::ov_core_set_property(
                        session.core,
                        c_device.as_ptr(),
                        k.as_ptr(),
                        v.as_ptr(),
                    ),
                )
                .map_err(|(_, m)| Error::Device {
                    device: device.to_string(),
                    message: format!("refused {key}={value}: {m}"),
                })?;
            }
            // No properties passed with the call (they are set on the core above, as `compile_ir` sets them):
            // the variadic C function then reads no further arguments.
            check(
                "compiling",
                sys::ov_core_compile_model_from_file(
                    session.core,
                    c_xml.as_ptr(),
                    c_device.as_ptr(),
                    0,
                    &mut session.model,
                ),
            )
            .map_err(fail)?;
        }
        session.info = read_back(name, device, opts, &requested, |key| session.property(key));
        session.info.inputs = session.port_names(true).map_err(fail)?;
        session.info.outputs = session.port_names(false).map_err(fail)?;
        session.new_request().map_err(fail)?;
        session.info.compile_seconds = start.elapsed().as_secs_f64();
        Ok(session)
    }

    /// A property of the compiled model as it reads it back, or `None` where it does not report it.
    fn property(&self, key: &str) -> Option<String> {
        let c_key = CString::new(key).ok()?;
        let mut value: *mut c_char = std::ptr::null_mut();
        // SAFETY: `self.model` is a compiled model; the key is a C string; the value, when set, is a string the
        // C API allocated, freed by `take_string`.
        unsafe {
            let status =
                sys::ov_compiled_model_get_property(self.model, c_key.as_ptr(), &mut value);
            let s = take_string(value);
            (status == sys::ov_status_e::OK).then_some(s)
        }
    }

    /// The names of the compiled model's inputs (or outputs), in order.
    fn port_names(&self, inputs: bool) -> std::result::Result<Vec<String>, Failure> {
        let mut count = 0usize;
        // SAFETY: `self.model` is a compiled model; each port made is freed after its name is read.
        unsafe {
            check(
                "compiling",
                if inputs {
                    sys::ov_compiled_model_inputs_size(self.model, &mut count)
                } else {
                    sys::ov_compiled_model_outputs_size(self.model, &mut count)
                },
            )?;
            (0..count)
                .map(|i| {
                    let mut port = std::ptr::null_mut();
                    check(
                        "compiling",
                        if inputs {
                            sys::ov_compiled_model_input_by_index(self.model, i, &mut port)
                        } else {
                            sys::ov_compiled_model_output_by_index(self.model, i, &mut port)
                        },
                    )?;
                    let mut name: *mut c_char = std::ptr::null_mut();
                    let status = sys::ov_port_get_any_name(port, &mut name);
                    sys::ov_output_const_port_free(port);
                    check("compiling", status)?;
                    Ok(take_string(name))
                })
                .collect()
        }
    }

    /// Replaces the infer request with a fresh one.
    fn new_request(&mut self) -> std::result::Result<(), Failure> {
        // SAFETY: the old request (if any) is ours and freed once; `self.model` is a compiled model.
        unsafe {
            if !self.request.is_null() {
                sys::ov_infer_request_free(self.request);
                self.request = std::ptr::null_mut();
            }
            check(
                "inference",
                sys::ov_compiled_model_create_infer_request(self.model, &mut self.request),
            )
        }
    }

    fn err(&self, message: String) -> Error {
        self.info.inference_error(message)
    }

    /// Sets input `name` to a copy of `t`.
    fn set_input(&mut self, name: &str, t: &Tensor) -> std::result::Result<(), String> {
        let (elem, bytes) = host_bytes(t)?;
        let ty = match elem {
            HostElem::F32 => sys::ov_element_type_e::F32,
            HostElem::F16 => sys::ov_element_type_e::F16,
            HostElem::I64 => sys::ov_element_type_e::I64,
            HostElem::I32 => sys::ov_element_type_e::I32,
            HostElem::Boolean => sys::ov_element_type_e::OV_BOOLEAN,
        };
        let dims: Vec<i64> = t.dims().iter().map(|&d| d as i64).collect();
        let c_name = CString::new(name).map_err(|_| "a NUL byte in the name".to_string())?;
        // SAFETY: the shape is made from `dims` (which it copies) and freed after the tensor is made; the tensor
        // owns its `bytes.len()` bytes (OpenVINO allocates them for the shape and type, which `host_bytes` wrote
        // for the same), and our handle is freed once the request holds its own reference.
        unsafe {
            let mut shape = std::mem::zeroed::<sys::ov_shape_t>();
            check(
                "inference",
                sys::ov_shape_create(dims.len() as i64, dims.as_ptr(), &mut shape),
            )
            .map_err(|(_, m)| m)?;
            let mut tensor = std::ptr::null_mut();
            let made = sys::ov_tensor_create(ty, shape, &mut tensor);
            sys::ov_shape_free(&mut shape);
            check("inference", made).map_err(|(_, m)| m)?;
            let result = (|| {
                let mut size = 0usize;
                check("inference", sys::ov_tensor_get_byte_size(tensor, &mut size))
                    .map_err(|(_, m)| m)?;
                if size != bytes.len() {
                    return Err(format!(
                        "{} bytes for a tensor of {size} bytes",
                        bytes.len()
                    ));
                }
                if size > 0 {
                    let mut data: *mut c_void = std::ptr::null_mut();
                    check("inference", sys::ov_tensor_data(tensor, &mut data))
                        .map_err(|(_, m)| m)?;
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), data as *mut u8, size);
                }
                check(
                    "inference",
                    sys::ov_infer_request_set_tensor(self.request, c_name.as_ptr(), tensor),
                )
                .map_err(|(_, m)| m)
            })();
            sys::ov_tensor_free(tensor);
            result
        }
    }

    /// A host copy of output `name`.
    fn output(&self, name: &str) -> std::result::Result<Tensor, String> {
        let c_name = CString::new(name).map_err(|_| "a NUL byte in the name".to_string())?;
        // SAFETY: the tensor handle the request gives is ours to free, after its bytes are copied out; the shape
        // it fills is freed by `ov_shape_free`; `data` holds `size` bytes.
        unsafe {
            let mut tensor = std::ptr::null_mut();
            check(
                "inference",
                sys::ov_infer_request_get_tensor(self.request, c_name.as_ptr(), &mut tensor),
            )
            .map_err(|(_, m)| m)?;
            let result = (|| {
                let mut shape = std::mem::zeroed::<sys::ov_shape_t>();
                check("inference", sys::ov_tensor_get_shape(tensor, &mut shape))
                    .map_err(|(_, m)| m)?;
                let dims: Vec<usize> = (0..shape.rank.max(0) as usize)
                    .map(|i| *shape.dims.add(i) as usize)
                    .collect();
                sys::ov_shape_free(&mut shape);
                let mut ty = sys::ov_element_type_e::DYNAMIC;
                check(
                    "inference",
                    sys::ov_tensor_get_element_type(tensor, &mut ty),
                )
                .map_err(|(_, m)| m)?;
                let elem = match ty {
                    sys::ov_element_type_e::F32 => HostElem::F32,
                    sys::ov_element_type_e::F16 => HostElem::F16,
                    sys::ov_element_type_e::I64 => HostElem::I64,
                    sys::ov_element_type_e::I32 => HostElem::I32,
                    other => return Err(format!("unsupported output element type {other:?}")),
                };
                if dims.contains(&0) {
                    return host_tensor(elem, dims, &[]);
                }
                let mut size = 0usize;
                check("inference", sys::ov_tensor_get_byte_size(tensor, &mut size))
                    .map_err(|(_, m)| m)?;
                let mut data: *mut c_void = std::ptr::null_mut();
                check("inference", sys::ov_tensor_data(tensor, &mut data)).map_err(|(_, m)| m)?;
                let raw = std::slice::from_raw_parts(data as *const u8, size);
                host_tensor(elem, dims, raw)
            })();
            sys::ov_tensor_free(tensor);
            result
        }
    }
}

impl Executor for PathSession {
    fn info(&self) -> &ExecInfo {
        &self.info
    }

    fn run(&mut self, inputs: &[(&str, &Tensor)]) -> Result<BTreeMap<String, Tensor>> {
        for (name, t) in inputs {
            self.set_input(name, t)
                .map_err(|e| self.err(format!("input `{name}` {:?}: {e}", t.dims())))?;
        }
        // SAFETY: `self.request` is a live infer request whose inputs are set.
        let status = unsafe { sys::ov_infer_request_infer(self.request) };
        check("inference", status).map_err(|(_, m)| self.err(m))?;
        let mut out = BTreeMap::new();
        for name in self.info.outputs.clone() {
            let t = self
                .output(&name)
                .map_err(|e| self.err(format!("output `{name}`: {e}")))?;
            out.insert(name, t);
        }
        Ok(out)
    }

    /// A fresh infer request: a stateful IR's variables start from their initial values.
    fn reset(&mut self) -> Result<()> {
        self.new_request()
            .map_err(|(_, m)| self.err(format!("creating the request: {m}")))
    }
}

impl Drop for PathSession {
    fn drop(&mut self) {
        // SAFETY: each handle is null or ours, freed once, the request before its model before its core.
        unsafe {
            if !self.request.is_null() {
                sys::ov_infer_request_free(self.request);
            }
            if !self.model.is_null() {
                sys::ov_compiled_model_free(self.model);
            }
            if !self.core.is_null() {
                sys::ov_core_free(self.core);
            }
        }
    }
}
