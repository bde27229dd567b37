//! Graphs whose constants stream to a shared `.bin`: the IR is the in-memory writer's byte for byte, and two graphs
//! pointing into one file compute exactly what the same graphs written separately compute (CPU and FP16SIM).

use candle_core::{DType, Device, Tensor};
use npu::devices::CompileOptions;
use npu::graphs::{Builder, GraphOptions};
use npu::infer::{Executor, prepare};
use npu::ir::{ElemType, Graph, SharedBin};
use reference::config::Config;
use reference::quant::WeightFormat;
use reference::synthetic::Rng;
use reference::weights::WeightStore;
use std::collections::BTreeMap;
use std::path::PathBuf;

fn model(name: &str, format: &str) -> (Config, WeightStore) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/models")
        .join(name);
    let config = Config::from_file(&dir.join("config.json")).unwrap();
    let format = WeightFormat::parse(format).unwrap();
    let store = WeightStore::open_with_format(&dir, DType::F32, format).unwrap();
    (config, store)
}

fn options() -> GraphOptions {
    GraphOptions {
        context: 32,
        taps: false,
        ..GraphOptions::default()
    }
}

#[test]
fn a_streamed_ir_is_the_in_memory_ir_byte_for_byte() {
    for (name, format) in [
        ("tiny", "int4:32"),
        ("tiny-tied", "int4:16"),
        ("tiny-h128", "int4-nncf:32"),
        ("tiny", "f16"),
        ("tiny", "f32"),
        // The MoE block's stacked experts: INT4 gate and up, INT8 down (16 wide); f16.
        ("tiny-moe", "int4:32"),
        ("tiny-moe", "f16"),
    ] {
        let (config, store) = model(name, format);
        // Blocks of 3 rows (and of 1 value: one row): matrices are compressed in many pieces, whose bytes must
        // join up.
        let blocks: &[usize] = if format == "int4:32" {
            &[3 * 64, 1]
        } else {
            &[3 * 64]
        };
        for &block in blocks {
            let builder = Builder::new(&config, &store, options())
                .unwrap()
                .with_stream_block(block);
            let dir = tempfile::tempdir().unwrap();
            for tokens in [1, 5] {
                let label = format!("{name} {format} t{tokens} block {block}");
                let memory = builder.decoder_graph(tokens).unwrap();
                let (xml, bin) = memory.serialize();
                let shared = SharedBin::create(&dir.path().join(format!("t{tokens}.bin"))).unwrap();
                let streamed = builder.decoder_graph_on(tokens, Some(&shared)).unwrap();
                let xml_path = dir.path().join(format!("t{tokens}.xml"));
                streamed.save(&xml_path).unwrap();
                assert_eq!(
                    streamed.bin_path(&xml_path).unwrap(),
                    shared.path().unwrap()
                );
                assert_eq!(
                    std::fs::read_to_string(&xml_path).unwrap(),
                    xml,
                    "{label}: XML"
                );
                let file = std::fs::read(shared.path().unwrap()).unwrap();
                assert_eq!(file.len(), bin.len(), "{label}: .bin size");
                assert!(file == bin, "{label}: .bin bytes differ");
                assert!(streamed.serialize().1.is_empty());
            }
        }
    }
}

/// Every input of `graph` filled deterministically: ids and positions in range, masks open, states random.
fn inputs(graph: &Graph, vocab: usize, seed: u64) -> Vec<(String, Tensor)> {
    let mut rng = Rng::new(seed);
    let dev = &Device::Cpu;
    graph
        .inputs()
        .into_iter()
        .map(|(name, ty, shape)| {
            let n: usize = shape.iter().product();
            let t = match (ty, name.as_str()) {
                (ElemType::I64, "input_ids") => {
                    let v: Vec<i64> = (0..n)
                        .map(|_| (rng.next_u64() % vocab as u64) as i64)
                        .collect();
                    Tensor::from_vec(v, shape.as_slice(), dev)
                }
                (ElemType::I64, _) => {
                    let v: Vec<i64> = (0..n)
                        .map(|i| (i % shape[shape.len() - 1]) as i64)
                        .collect();
                    Tensor::from_vec(v, shape.as_slice(), dev)
                }
                (_, "token_valid") => Tensor::ones(shape.as_slice(), DType::F32, dev),
                (_, "attention_mask") => Tensor::zeros(shape.as_slice(), DType::F32, dev),
                _ => {
                    let v: Vec<f32> = (0..n)
                        .map(|_| (rng.next_u64() % 2001) as f32 / 1000.0 - 1.0)
                        .map(|x| 0.1 * x)
                        .collect();
                    Tensor::from_vec(v, shape.as_slice(), dev)
                }
            };
            (name, t.unwrap())
        })
        .collect()
}

fn outputs(executor: &mut dyn Executor, inputs: &[(String, Tensor)]) -> BTreeMap<String, Vec<f32>> {
    executor
        .run_declared(inputs)
        .unwrap()
        .into_iter()
        .map(|(k, v)| (k, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

#[test]
fn graphs_sharing_one_bin_compute_what_separately_written_graphs_compute() {
    npu::runtime::load().unwrap();
    for name in ["tiny", "tiny-moe"] {
        sharing_one_bin(name);
    }
}

fn sharing_one_bin(name: &str) {
    let (config, store) = model(name, "int4:32");
    let builder = Builder::new(&config, &store, options())
        .unwrap()
        .with_stream_block(100);
    let dir = tempfile::tempdir().unwrap();
    let shared = SharedBin::create(&dir.path().join("weights.bin")).unwrap();
    let decode = builder.decoder_graph_on(1, Some(&shared)).unwrap();
    let after_decode = shared.len().unwrap();
    let block = builder.decoder_graph_on(8, Some(&shared)).unwrap();
    let separate = [
        builder.decoder_graph(1).unwrap(),
        builder.decoder_graph(8).unwrap(),
    ];
    // The second graph adds only its own small constants: the weights are written once.
    let added = shared.len().unwrap() - after_decode;
    let (_, block_bin) = separate[1].serialize();
    assert!(
        added < block_bin.len() / 4,
        "{name}: the block graph added {added} bytes to the shared .bin; written alone its .bin has {}",
        block_bin.len()
    );
    for device in ["CPU", "FP16SIM"] {
        for (shared_graph, alone) in [&decode, &block].into_iter().zip(&separate) {
            let feed = inputs(alone, config.vocab_size, 7);
            let opts = CompileOptions::default();
            let mut a = prepare(shared_graph.clone(), device, &opts).unwrap();
            let mut b = prepare(alone.clone(), device, &opts).unwrap();
            let (x, y) = (outputs(a.as_mut(), &feed), outputs(b.as_mut(), &feed));
            assert_eq!(x.keys().collect::<Vec<_>>(), y.keys().collect::<Vec<_>>());
            for (k, v) in &x {
                assert!(v.iter().all(|z| z.is_finite()), "{device} {k}: not finite");
                assert!(v == &y[k], "{name} {device} {}: {k} differs", alone.name());
            }
            npu::pages::release(&[&shared.path().unwrap()]);
        }
    }
}

#[test]
fn a_key_reused_for_another_shape_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let shared = SharedBin::create(&dir.path().join("w.bin")).unwrap();
    let mut g = Graph::with_shared_bin("k", &shared);
    let write = |sink: &mut dyn FnMut(&[u8]) -> npu::error::Result<()>| sink(&[0u8; 16]);
    let a = g
        .constant_streamed(Some("w"), ElemType::F32, &[4], write)
        .unwrap();
    let b = g
        .constant_streamed(Some("w"), ElemType::F32, &[4], |_| {
            panic!("a written key is not written again")
        })
        .unwrap();
    assert_ne!(a, b);
    assert_eq!(shared.len().unwrap(), 16);
    let e = g
        .constant_streamed(Some("w"), ElemType::F32, &[2, 2], write)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`w`") && e.contains("[2, 2]"), "{e}");
    let e = g
        .constant_streamed(None, ElemType::F32, &[3], write)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("16 bytes written") && e.contains("12 expected"),
        "{e}"
    );
}
