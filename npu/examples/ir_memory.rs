//! Where the memory of the OpenVINO decoder graphs goes, phase by phase: building each graph, writing its IR,
//! OpenVINO reading it, compiling it, and one inference.
//!
//! `cargo run --release -p npu --example ir_memory -- MODEL_DIR [int4|f16|f32] [block] [shared|memory]`
//!
//! `shared` (the default, as `DecoderEngine` does on OpenVINO devices): both graphs stream their constants to one
//! `.bin` they share, and the file's pages are handed back while each graph compiles. `memory`: each graph holds its
//! constants in memory and writes its own `.bin`.
//!
//! Prints, after each phase, its wall time, the process's anonymous resident memory (`RssAnon`), its resident pages
//! of mapped files (`RssFile`) and the peak resident set so far (`VmHWM`), plus the largest `RssAnon` sampled every
//! 10 ms during the phase. Figures only: nothing here is a test.
#![allow(clippy::disallowed_methods)] // an example reads its files with std::fs; inputs::open is the library's rule

use candle_core::DType;
use npu::devices::{CompileOptions, compile_ir};
use npu::graphs::{Builder, GraphOptions};
use npu::ir::SharedBin;
use reference::config::Config;
use reference::quant::WeightFormat;
use reference::weights::WeightStore;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// `(RssAnon, RssFile, VmHWM)` in MiB.
fn status() -> (u64, u64, u64) {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |key: &str| {
        text.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| {
                l[key.len()..]
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .map_or(0, |kb| kb / 1024)
    };
    (field("RssAnon:"), field("RssFile:"), field("VmHWM:"))
}

/// Samples `RssAnon` every 10 ms and keeps the peak since the last [`Phases::mark`].
struct Phases {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    last: Instant,
}

impl Phases {
    fn start() -> Self {
        let peak = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (peak.clone(), stop.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                p.fetch_max(status().0, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        Phases {
            peak,
            stop,
            last: Instant::now(),
        }
    }

    fn mark(&mut self, what: &str) {
        let (anon, file, hwm) = status();
        let peak = self.peak.swap(0, Ordering::Relaxed).max(anon);
        println!(
            "{what:<34} {:>8.2} s  anon {anon:>6} MiB (peak {peak:>6})  file {file:>6} MiB  VmHWM {hwm:>6} MiB",
            self.last.elapsed().as_secs_f64()
        );
        self.last = Instant::now();
    }
}

impl Drop for Phases {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = std::path::PathBuf::from(
        args.first()
            .ok_or("usage: ir_memory MODEL_DIR [int4|f16|f32] [block]")?,
    );
    let format = WeightFormat::parse(args.get(1).map_or("int4", String::as_str))?;
    let block: usize = args.get(2).map_or(Ok(16), |s| s.parse())?;
    let shared = match args.get(3).map_or("shared", String::as_str) {
        "shared" => true,
        "memory" => false,
        other => return Err(format!("mode `{other}`: expected shared or memory").into()),
    };
    let mut phases = Phases::start();
    npu::runtime::load()?;
    let config = Config::from_file(&dir.join("config.json"))?;
    let store = WeightStore::open_with_format(&dir, DType::F32, format)?;
    let opts = GraphOptions {
        taps: false,
        ..GraphOptions::default()
    };
    let builder = Builder::new(&config, &store, opts)?;
    let scratch = tempfile::tempdir()?;
    let mut core = npu::runtime::core()?;
    phases.mark("open");
    let bin = if shared {
        Some(SharedBin::create(&scratch.path().join("weights.bin"))?)
    } else {
        None
    };
    let mut compiled = Vec::new();
    for tokens in [1, block] {
        let graph = builder.decoder_graph_on(tokens, bin.as_ref())?;
        phases.mark(&format!("build t{tokens}"));
        let xml = scratch.path().join(format!("t{tokens}.xml"));
        graph.save(&xml)?;
        let bin_path = graph.bin_path(&xml)?;
        drop(graph);
        let size = std::fs::metadata(&bin_path)?.len();
        phases.mark(&format!(
            "write t{tokens} (bin {:.2} GB)",
            size as f64 / 1e9
        ));
        let releaser = shared.then(|| {
            npu::pages::Releaser::start(vec![bin_path.clone()], Duration::from_millis(250))
        });
        let c = compile_ir(
            &mut core,
            &xml,
            &bin_path,
            &format!("t{tokens}"),
            "CPU",
            &CompileOptions::default(),
        )?;
        drop(releaser);
        phases.mark(&format!("read+compile t{tokens}"));
        compiled.push(c);
    }
    drop(compiled);
    phases.mark("dropped");
    Ok(())
}
