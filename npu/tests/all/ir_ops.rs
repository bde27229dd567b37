//! The IR writer checked by OpenVINO's own reader and CPU plugin: every op the graphs use, against candle.

use candle_core::{DType, Device, Tensor};
use npu::devices::{CompileOptions, compile, compile_file};
use npu::infer::{Executor, Session, SimSession};
use npu::ir::{ElemType, GeluMode, Graph, Unary};
use npu::sim::NumericModel;
use reference::compare::diff;
use reference::synthetic::Rng;

/// Runs `g` on OpenVINO's CPU device at f32, and on FP16SIM with nothing rounded (an evaluator sharing no code
/// with OpenVINO): both must agree within 1e-6 of each output's largest value. Returns OpenVINO's outputs.
fn run(g: &Graph, inputs: &[(&str, &Tensor)]) -> std::collections::BTreeMap<String, Tensor> {
    let mut core = npu::runtime::core().expect("OpenVINO runtime (run scripts/fetch-openvino.sh)");
    let compiled = compile(&mut core, g.clone(), "CPU", &CompileOptions::default()).unwrap();
    assert_eq!(
        compiled.info.precision, "f32",
        "a reference run must compute in f32"
    );
    assert_eq!(
        compiled.info.outputs,
        g.outputs()
            .into_iter()
            .map(|(n, _, _)| n)
            .collect::<Vec<_>>(),
        "the compiled model reports the graph's outputs, in order"
    );
    let ov = Session::new(compiled).unwrap().run(inputs).unwrap();
    let exact = NumericModel::parse("FP16SIM:store=f32,ftz=off", &[]).unwrap();
    let sim = SimSession::new(g.clone(), "FP16SIM", exact)
        .unwrap()
        .run(inputs)
        .unwrap();
    assert_eq!(
        sim.keys().collect::<Vec<_>>(),
        ov.keys().collect::<Vec<_>>()
    );
    for (name, t) in &ov {
        if t.dtype() == DType::F32 {
            close(
                &format!("FP16SIM f32 vs OpenVINO: {name}"),
                &sim[name],
                t,
                1e-6,
            );
        } else {
            assert_eq!(
                sim[name]
                    .to_dtype(DType::F64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap(),
                t.to_dtype(DType::F64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap(),
                "{name}"
            );
        }
    }
    ov
}

fn close(what: &str, a: &Tensor, b: &Tensor, rtol: f64) {
    let d = diff(a, b).unwrap();
    assert!(d.within(0.0, rtol), "{what}: {d}");
}

#[test]
fn elementwise_matmul_and_shape_ops_match_candle() {
    let mut rng = Rng::new(1);
    let x = rng.normal_tensor(&[3, 4, 5], 1.0, DType::F32).unwrap();
    let wdata = rng.normal_tensor(&[6, 5], 1.0, DType::F32).unwrap();

    let mut g = Graph::new("ops");
    let xi = g.parameter("x", ElemType::F32, &[3, 4, 5]);
    let w = g
        .const_f32(
            &wdata.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            &[6, 5],
        )
        .unwrap();
    let mm = g.matmul(xi, w, false, true).unwrap();
    g.result(mm, "matmul").unwrap();
    for (op, name) in [
        (Unary::Exp, "exp"),
        (Unary::Sigmoid, "sigmoid"),
        (Unary::SoftPlus, "softplus"),
        (Unary::Swish, "swish"),
        (Unary::Sin, "sin"),
        (Unary::Cos, "cos"),
    ] {
        let y = g.unary(op, xi).unwrap();
        g.result(y, name).unwrap();
    }
    for (mode, name) in [(GeluMode::Erf, "gelu_erf"), (GeluMode::Tanh, "gelu_tanh")] {
        let y = g.gelu(xi, mode).unwrap();
        g.result(y, name).unwrap();
    }
    let mean = g.reduce_mean(xi, &[2], true).unwrap();
    let centred = g.sub(xi, mean).unwrap();
    g.result(centred, "centred").unwrap();
    let t = g.transpose(xi, &[2, 0, 1]).unwrap();
    let r = g.reshape(t, &[5, 12]).unwrap();
    g.result(r, "transposed").unwrap();
    let s = g.slice(xi, 1, 1, 2).unwrap();
    let c = g.concat(&[s, s], 1).unwrap();
    g.result(c, "sliced").unwrap();
    let sm = g.softmax(xi, 2).unwrap();
    g.result(sm, "softmax").unwrap();
    let idx = g.const_i64(&[2, 0], &[2]).unwrap();
    let ga = g.gather(xi, idx, 1).unwrap();
    g.result(ga, "gather").unwrap();

    let out = run(&g, &[("x", &x)]);
    close(
        "matmul",
        &out["matmul"],
        &x.broadcast_matmul(&wdata.t().unwrap()).unwrap(),
        1e-6,
    );
    close("exp", &out["exp"], &x.exp().unwrap(), 1e-6);
    close(
        "sigmoid",
        &out["sigmoid"],
        &reference::ops::sigmoid(&x).unwrap(),
        1e-6,
    );
    close(
        "softplus",
        &out["softplus"],
        &reference::ops::softplus(&x).unwrap(),
        1e-6,
    );
    close("swish", &out["swish"], &x.silu().unwrap(), 1e-6);
    close("gelu_erf", &out["gelu_erf"], &x.gelu_erf().unwrap(), 1e-6);
    close("gelu_tanh", &out["gelu_tanh"], &x.gelu().unwrap(), 1e-6);
    close("sin", &out["sin"], &x.sin().unwrap(), 1e-6);
    close("cos", &out["cos"], &x.cos().unwrap(), 1e-6);
    close(
        "centred",
        &out["centred"],
        &x.broadcast_sub(&x.mean_keepdim(2).unwrap()).unwrap(),
        1e-6,
    );
    close(
        "transposed",
        &out["transposed"],
        &x.permute((2, 0, 1)).unwrap().reshape((5, 12)).unwrap(),
        0.0,
    );
    let s = x.narrow(1, 1, 2).unwrap();
    close(
        "sliced",
        &out["sliced"],
        &Tensor::cat(&[&s, &s], 1).unwrap(),
        0.0,
    );
    close(
        "softmax",
        &out["softmax"],
        &reference::ops::softmax_last_dim(&x).unwrap(),
        1e-6,
    );
    let gathered =
        Tensor::cat(&[x.narrow(1, 2, 1).unwrap(), x.narrow(1, 0, 1).unwrap()], 1).unwrap();
    close("gather", &out["gather"], &gathered, 0.0);
}

/// The MoE router's ops: `TopK` (max, sorted by value, stable, i64 indices) with exact ties taken lower index first,
/// `OneHot` of its indices, a `Gather` of whole matrices from a stacked constant and a batched product over it, on
/// OpenVINO and FP16SIM alike.
#[test]
fn topk_one_hot_and_stacked_gathers_match_candle() {
    // Rows with exact ties: 0.3 three times (top 2 must be experts 1 and 2), and a row of equal values.
    let p: Vec<f32> = vec![
        0.1, 0.3, 0.3, 0.3, 0.2, //
        0.5, 0.5, 0.5, 0.5, 0.5, //
        -1.0, 2.0, 0.0, 7.0, 2.0,
    ];
    let mut g = Graph::new("topk");
    let x = g.parameter("p", ElemType::F32, &[3, 5]);
    let (values, indices) = g.topk(x, 2, 1).unwrap();
    g.result(values, "values").unwrap();
    g.result(indices, "indices").unwrap();
    let hot = g.one_hot(indices, 5).unwrap();
    g.result(hot, "one_hot").unwrap();
    // A stack of four [2, 3] matrices; matrices 3 and 0 gathered, each times its own row of `v`.
    let stack: Vec<f32> = (0..24).map(|i| i as f32 * 0.25 - 3.0).collect();
    let w = g.const_f32(&stack, &[4, 2, 3]).unwrap();
    let idx = g.const_i64(&[3, 0], &[2]).unwrap();
    let picked = g.gather(w, idx, 0).unwrap();
    let v = g.parameter("v", ElemType::F32, &[2, 1, 3]);
    let y = g.matmul(v, picked, false, true).unwrap();
    g.result(y, "batched").unwrap();
    let pt = Tensor::from_vec(p, (3, 5), &Device::Cpu).unwrap();
    let vt = Tensor::new(&[[[1.0f32, -2.0, 0.5]], [[0.25, 1.0, -1.0]]], &Device::Cpu).unwrap();
    let out = run(&g, &[("p", &pt), ("v", &vt)]);
    assert_eq!(out["indices"].dtype(), DType::I64);
    assert_eq!(
        out["indices"].to_vec2::<i64>().unwrap(),
        [[1, 2], [0, 1], [3, 1]]
    );
    assert_eq!(
        out["values"].to_vec2::<f32>().unwrap(),
        [[0.3, 0.3], [0.5, 0.5], [7.0, 2.0]]
    );
    let hot = out["one_hot"].to_vec3::<f32>().unwrap();
    assert_eq!(
        hot[0],
        [[0.0, 1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]]
    );
    assert_eq!(
        hot[2],
        [[0.0, 0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0]]
    );
    let st = Tensor::from_vec(stack, (4, 2, 3), &Device::Cpu).unwrap();
    let picked = Tensor::cat(
        &[st.narrow(0, 3, 1).unwrap(), st.narrow(0, 0, 1).unwrap()],
        0,
    )
    .unwrap();
    let expected = vt.matmul(&picked.transpose(1, 2).unwrap()).unwrap();
    close("batched", &out["batched"], &expected, 1e-6);
}

#[test]
fn f16_constants_convert_exactly() {
    let mut g = Graph::new("f16");
    let x = g.parameter("x", ElemType::F32, &[4]);
    let h: Vec<half::f16> = [0.1f32, -2.5, 3.0, 1e-3]
        .iter()
        .map(|&v| half::f16::from_f32(v))
        .collect();
    let c = g.const_f16(&h, &[4]).unwrap();
    let c = g.convert(c, ElemType::F32).unwrap();
    let y = g.add(x, c).unwrap();
    g.result(y, "y").unwrap();
    let x = Tensor::new(&[0.0f32, -0.0, 0.0, 0.0], &Device::Cpu).unwrap();
    let out = run(&g, &[("x", &x)]);
    let expected: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
    assert_eq!(out["y"].to_vec1::<f32>().unwrap(), expected);
}

#[test]
fn a_graph_openvino_rejects_is_a_clear_error() {
    // A valid graph's IR with its op renamed to one OpenVINO does not know.
    let mut g = Graph::new("broken");
    let x = g.parameter("x", ElemType::F32, &[4]);
    let y = g.unary(Unary::Exp, x).unwrap();
    g.result(y, "y").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let xml = dir.path().join("broken.xml");
    g.save(&xml).unwrap();
    let text = std::fs::read_to_string(&xml).unwrap();
    assert!(text.contains("type=\"Exp\""));
    std::fs::write(
        &xml,
        text.replace("type=\"Exp\"", "type=\"NoSuchOperation\""),
    )
    .unwrap();
    let mut core = npu::runtime::core().unwrap();
    let err = compile_file(&mut core, &xml, "broken", "CPU", &CompileOptions::default())
        .err()
        .expect("must fail")
        .to_string();
    assert!(
        err.contains("broken") && err.contains("CPU") && err.contains("NoSuchOperation"),
        "{err}"
    );
    assert!(!err.contains("Exception from src"), "{err}");
}

#[test]
fn an_absent_device_is_named_with_the_available_ones() {
    let mut g = Graph::new("tiny");
    let x = g.parameter("x", ElemType::F32, &[2]);
    g.result(x, "x_out").unwrap_or(());
    let mut core = npu::runtime::core().unwrap();
    let err = compile(&mut core, g, "NO_SUCH_DEVICE", &CompileOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("NO_SUCH_DEVICE") && err.contains("available: CPU"),
        "{err}"
    );
}

#[test]
fn a_cached_graph_is_loaded_from_the_cache_and_computes_the_same() {
    let graph = |scale: f32| {
        let mut g = Graph::new("cached");
        let x = g.parameter("x", ElemType::F32, &[8]);
        let c = g.const_f32(&[scale; 8], &[8]).unwrap();
        let y = g.mul(x, c).unwrap();
        let y = g.unary(Unary::Exp, y).unwrap();
        g.result(y, "y").unwrap();
        g
    };
    let dir = tempfile::tempdir().unwrap();
    let opts = CompileOptions {
        cache_dir: Some(dir.path().join("ov-cache")),
        ..CompileOptions::default()
    };
    let x = Tensor::arange(0f32, 8.0, &Device::Cpu).unwrap();
    let mut outputs = Vec::new();
    let mut flags = Vec::new();
    for scale in [0.5, 0.5, 0.25] {
        let mut core = npu::runtime::core().unwrap();
        let compiled = compile(&mut core, graph(scale), "CPU", &opts).unwrap();
        assert_eq!(compiled.info.cache_dir, opts.cache_dir);
        flags.push(compiled.info.loaded_from_cache);
        let mut s = Session::new(compiled).unwrap();
        outputs.push(s.run(&[("x", &x)]).unwrap().remove("y").unwrap());
    }
    // The first compile fills the cache, the same graph then comes from it; other weights are another graph.
    assert_eq!(flags, [Some(false), Some(true), Some(false)]);
    assert_eq!(diff(&outputs[0], &outputs[1]).unwrap().max_abs, 0.0);
    assert!(diff(&outputs[0], &outputs[2]).unwrap().max_abs > 0.0);
    assert!(
        std::fs::read_dir(dir.path().join("ov-cache"))
            .unwrap()
            .count()
            >= 2
    );
    // Without a cache directory nothing is claimed.
    let mut core = npu::runtime::core().unwrap();
    let plain = compile(&mut core, graph(0.5), "CPU", &CompileOptions::default()).unwrap();
    assert_eq!(plain.info.loaded_from_cache, None);
}
