#!/usr/bin/env python3
"""An independent oracle of FP16SIM's arithmetic: numpy float16, rounded where FP16SIM rounds, on three small graphs
(a matrix product, an RMS norm, a few single-token delta-rule steps) under several NumericModel settings, so that
npu/tests/fp16sim_oracle.rs can hold FP16SIM's `acc` and `state` options (and `ftz`, `norm`) to numbers it did not
compute itself.

Run with the interpreter of a venv that has numpy and safetensors (scripts/requirements-fp16sim.txt; the graphs venv
of scripts/requirements-graphs.txt has both too):

    scripts/.venv-fp16sim/bin/python scripts/make_fp16sim_goldens.py

It writes testdata/goldens/fp16sim.safetensors and adds its entry to testdata/manifest.json (`files`, and an
`fp16sim_goldens` section). Deterministic: one fixed seed, no threads, safetensors header with sorted metadata.

The rounding points, read from npu/src/sim/ (eval.rs, dispatch.rs, consts.rs, numeric.rs, norms.rs), are those of
`Arith` below:

- R(x), "store": round to nearest even fp16 (numpy's float32 -> float16 cast) then, under ftz=on, flush every fp16
  subnormal (|y| < 2^-14) to a zero of its sign. Every graph input (but a state input under state=f32), every
  constant and every op result is stored.
- element-wise ops compute on stored values and store the result. Where both operands are fp16 this uses numpy's own
  float16 arithmetic (one correctly rounded fp16 result, which is what f32 arithmetic rounded to fp16 gives: 24 >=
  2*11 + 2 bits, so the double rounding is innocuous for + - * / and sqrt); an f32 operand (a state kept in f32)
  makes it an f32 operation rounded once to fp16. exp runs in f32 and is stored; the script checks that every exp it
  rounds is at least 1e-6 (relative) from an fp16 rounding boundary, so no f32 exp within a few ulps can round
  differently.
- matrix product: every term a_ik*b_kj is stored (R, with ftz), then summed over k in index order: acc=f32 keeps the
  partial sums in f32 and stores the sum once; acc=f16 stores every partial sum.
- ReduceSum / ReduceMean: the same sum (no term rounding: the terms are stored values), in index order; the mean
  divides the sum by the count in f32; the result is stored.
- norm=fused: the RMS norm's statistic (x*x, the mean, + eps, sqrt) stays in f32 with an exact f32 eps; only the
  quotient x / sqrt(...) is stored (then the weight product, as ever).
- state=f32: the state input is not rounded on entry and the op producing the state output (the final add) is not
  stored: S' = f32(R(S*d) + R(k delta^T)); every other value is stored as ever.

Each setting's outputs come from the same seeded inputs; `f64.*` are the same graphs in float64 from the inputs as
stored in fp16 (no flush) and the f32 initial state, for measuring each setting's error.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform

import numpy as np
from safetensors.numpy import load_file, save_file
from testdata_files import REPO, TESTDATA, add_golden, canonicalize_safetensors_header, sha256

OUT = TESTDATA / "goldens" / "fp16sim.safetensors"
SEED = 1616
MAX_BYTES = 200_000

# The settings, by golden name: the FP16SIM device name and its options.
SETTINGS = [
    ("default", "FP16SIM", dict(ftz=True, acc="f32", state="f16", norm="ops")),
    ("acc_f16", "FP16SIM:acc=f16", dict(ftz=True, acc="f16", state="f16", norm="ops")),
    ("state_f32", "FP16SIM:state=f32", dict(ftz=True, acc="f32", state="f32", norm="ops")),
    ("ftz_off", "FP16SIM:ftz=off", dict(ftz=False, acc="f32", state="f16", norm="ops")),
    ("norm_fused", "FP16SIM:norm=fused", dict(ftz=True, acc="f32", state="f16", norm="fused")),
]

# Shapes. The product has many terms (K) so that accumulating in fp16 costs measurably more than in f32.
M, K, N = 4, 512, 8
MATMUL_ROW_SCALES = [1.0, 1.0, 1e-4, 1e-4]  # rows 2, 3: products below fp16's smallest normal (ftz matters)
ROWS, D = 4, 128
NORM_ROW_SCALES = [1.0, 0.05, 1.2e-2, 8.0]  # row 2: half its squares below 2^-14; row 3: sums near fp16 range
EPS = 1e-6
STEPS, HV, DK, DV = 8, 2, 32, 32

F16_MIN_NORMAL = np.float32(2.0**-14)


class Arith:
    """FP16SIM's arithmetic under one setting, on numpy arrays: stored values are float16 arrays, a state kept in
    f32 is a float32 array."""

    def __init__(self, ftz: bool, acc: str, state: str, norm: str):
        self.ftz, self.acc16, self.state32, self.fused = ftz, acc == "f16", state == "f32", norm == "fused"

    def flush(self, y: np.ndarray) -> np.ndarray:
        assert y.dtype == np.float16
        if not self.ftz:
            return y
        sub = (y != 0) & (np.abs(y.astype(np.float32)) < F16_MIN_NORMAL)
        return np.where(sub, np.copysign(np.float16(0), y), y).astype(np.float16)

    def store(self, x: np.ndarray) -> np.ndarray:
        """R: an f32 value as the device stores it."""
        x = np.asarray(x)
        assert x.dtype in (np.float32, np.float16), x.dtype
        return self.flush(x.astype(np.float16))

    def binary(self, op, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if a.dtype == np.float16 and b.dtype == np.float16:
            return self.flush(op(a, b))  # numpy's float16 arithmetic
        return self.store(op(a.astype(np.float32), b.astype(np.float32)))

    def mul(self, a, b):
        return self.binary(np.multiply, a, b)

    def add(self, a, b):
        return self.binary(np.add, a, b)

    def sub(self, a, b):
        return self.binary(np.subtract, a, b)

    def div(self, a, b):
        return self.binary(np.divide, a, b)

    def exp(self, x: np.ndarray) -> np.ndarray:
        y = self.store(np.exp(x.astype(np.float32)))
        exact = np.exp(x.astype(np.float64))
        for rel in (1 + 1e-6, 1 - 1e-6):
            moved = self.store((exact * rel).astype(np.float32))
            assert np.array_equal(moved, y), "an exp within 1e-6 of an fp16 rounding boundary"
        return y

    def matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """a [..., m, k] @ b [..., k, n]: every term stored, summed in index order as `acc` says, stored."""
        k = a.shape[-1]
        assert b.shape[-2] == k
        acc = None
        for kk in range(k):
            term = self.mul(a[..., :, kk : kk + 1], b[..., kk : kk + 1, :])
            if acc is None:
                acc = term if self.acc16 else term.astype(np.float32)
            elif self.acc16:
                acc = self.add(acc, term)
            else:
                acc = acc + term.astype(np.float32)  # f32 partial sums
        return self.store(acc)

    def reduce_sum(self, x: np.ndarray, mean: bool = False, f32: bool = False) -> np.ndarray:
        """Over the last axis, keeping it; `f32`: a fused norm's statistic (f32 sum, result not stored)."""
        acc16 = self.acc16 and not f32
        acc = x[..., 0:1] if acc16 else x[..., 0:1].astype(np.float32)
        for i in range(1, x.shape[-1]):
            acc = self.add(acc, x[..., i : i + 1]) if acc16 else acc + x[..., i : i + 1].astype(np.float32)
        acc = acc.astype(np.float32)
        if mean:
            acc = acc / np.float32(x.shape[-1])
        return acc if f32 else self.store(acc)

    # ---- the graphs, op for op as npu/src/graphs builds them ----

    def linear(self, x, w):
        """ops::linear: x W^T (MatMul transpose_b)."""
        return self.matmul(self.store(x), self.store(w).T)

    def rms_norm(self, x, one_plus_w, eps):
        """ops::rms_norm: x / sqrt(mean(x*x) + eps) * (1 + w)."""
        x, w = self.store(x), self.store(one_plus_w)
        if self.fused:
            x32 = x.astype(np.float32)
            mean = self.reduce_sum(x32 * x32, mean=True, f32=True)
            root = np.sqrt(mean + np.float32(eps))
            normed = self.store(x32 / root)
        else:
            sq = self.mul(x, x)
            mean = self.reduce_sum(sq, mean=True)
            var = self.add(mean, self.store(np.float32(eps)))
            root = self.store(np.sqrt(var.astype(np.float32)))
            normed = self.div(x, root)
        return self.mul(normed, w)

    def step(self, q, k, v, g, beta, state):
        """deltanet::step on stored inputs; `state` as the call receives it."""
        q, k, v, g, beta = (self.store(t) for t in (q, k, v, g, beta))
        s = state if self.state32 else self.store(state)
        hv = q.shape[0]
        read = self.matmul(np.concatenate([q, k], axis=1), s)
        q_s, k_s = read[:, 0:1], read[:, 1:2]
        d = self.exp(g).reshape(hv, 1, 1)
        beta = beta.reshape(hv, 1, 1)
        delta = self.mul(self.sub(v, self.mul(k_s, d)), beta)
        qk_dot = self.reduce_sum(self.mul(q, k))
        o = self.add(self.mul(q_s, d), self.mul(delta, qk_dot))
        decayed = self.mul(s, d)
        outer = self.matmul(np.swapaxes(k, 1, 2), delta)
        if self.state32:
            s_next = decayed.astype(np.float32) + outer.astype(np.float32)  # the state's producer: not stored
        else:
            s_next = self.add(decayed, outer)
        return o, s_next


def f64_step(q, k, v, g, beta, s):
    read = np.concatenate([q, k], axis=1) @ s
    d = np.exp(g).reshape(-1, 1, 1)
    delta = (v - read[:, 1:2] * d) * beta.reshape(-1, 1, 1)
    o = read[:, 0:1] * d + delta * np.sum(q * k, axis=-1, keepdims=True)
    return o, s * d + np.swapaxes(k, 1, 2) @ delta


def inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    f32 = np.float32
    x = rng.standard_normal((M, K)) * np.array(MATMUL_ROW_SCALES)[:, None]
    w = rng.standard_normal((N, K))
    nx = rng.standard_normal((ROWS, D)) * np.array(NORM_ROW_SCALES)[:, None]
    one_plus_w = 1.0 + 0.2 * rng.standard_normal(D)

    def unit(shape):
        u = rng.standard_normal(shape)
        return u / np.linalg.norm(u, axis=-1, keepdims=True)

    q = unit((STEPS, HV, 1, DK)) * DK**-0.5
    k = unit((STEPS, HV, 1, DK))
    v = rng.standard_normal((STEPS, HV, 1, DV))
    g = np.stack([rng.uniform(-0.1, -0.01, STEPS), rng.uniform(-2.0, -0.5, STEPS)], axis=1)[:, :, None]
    beta = rng.uniform(0.2, 0.9, (STEPS, HV, 1))
    s0 = 0.3 * rng.standard_normal((HV, DK, DV))
    return {
        "inputs.matmul.x": x.astype(f32),
        "inputs.matmul.w": w.astype(f32),
        "inputs.rms_norm.x": nx.astype(f32),
        "inputs.rms_norm.one_plus_w": one_plus_w.astype(f32),
        "inputs.deltanet.q": q.astype(f32),
        "inputs.deltanet.k": k.astype(f32),
        "inputs.deltanet.v": v.astype(f32),
        "inputs.deltanet.g": g.astype(f32),
        "inputs.deltanet.beta": beta.astype(f32),
        "inputs.deltanet.state": s0.astype(f32),
    }


def run_setting(a: Arith, x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    mm = a.linear(x["inputs.matmul.x"], x["inputs.matmul.w"])
    rms = a.rms_norm(x["inputs.rms_norm.x"], x["inputs.rms_norm.one_plus_w"], EPS)
    s = x["inputs.deltanet.state"]
    outs = []
    for t in range(STEPS):
        o, s = a.step(*(x[f"inputs.deltanet.{n}"][t] for n in ("q", "k", "v", "g", "beta")), s)
        outs.append(o)
    return {
        "matmul": mm.astype(np.float32),
        "rms_norm": rms.astype(np.float32),
        "deltanet.o": np.stack(outs).astype(np.float32),
        "deltanet.state": s.astype(np.float32),
    }


def run_f64(x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    def st(name):  # as stored in fp16, nothing flushed
        return x[name].astype(np.float16).astype(np.float64)

    mm = st("inputs.matmul.x") @ st("inputs.matmul.w").T
    nx = st("inputs.rms_norm.x")
    rms = nx / np.sqrt(np.mean(nx * nx, axis=-1, keepdims=True) + EPS) * st("inputs.rms_norm.one_plus_w")
    s = x["inputs.deltanet.state"].astype(np.float64)
    outs = []
    for t in range(STEPS):
        o, s = f64_step(*(st(f"inputs.deltanet.{n}")[t] for n in ("q", "k", "v", "g", "beta")), s)
        outs.append(o)
    return {"matmul": mm, "rms_norm": rms, "deltanet.o": np.stack(outs), "deltanet.state": s}


def rel_err(y: np.ndarray, truth: np.ndarray, rows=None) -> float:
    if rows is not None:
        y, truth = y[rows], truth[rows]
    return float(np.max(np.abs(y.astype(np.float64) - truth)) / np.max(np.abs(truth)))


def main() -> None:
    rng = np.random.default_rng(SEED)
    x = inputs(rng)
    truth = run_f64(x)
    tensors = dict(x)
    tensors.update({f"f64.{k}": v.astype(np.float64) for k, v in truth.items()})
    errors = {}
    results = {}
    for name, _, opts in SETTINGS:
        out = run_setting(Arith(**opts), x)
        results[name] = out
        tensors.update({f"{name}.{k}": v for k, v in out.items()})
        errors[name] = {
            "matmul_rows_0_1": rel_err(out["matmul"], truth["matmul"], slice(0, 2)),
            "matmul_rows_2_3": rel_err(out["matmul"], truth["matmul"], slice(2, 4)),
            "rms_norm_row_2": rel_err(out["rms_norm"], truth["rms_norm"], 2),
            "deltanet.o": rel_err(out["deltanet.o"], truth["deltanet.o"]),
            "deltanet.state": rel_err(out["deltanet.state"], truth["deltanet.state"]),
        }
        errors[name] = {k: float(f"{v:.3e}") for k, v in errors[name].items()}

    # The goldens must tell the options apart, or a test against them could not catch an ignored option.
    d, r = results["default"], results
    differ = lambda a, b, key: not np.array_equal(r[a][key], r[b][key])  # noqa: E731
    assert differ("default", "acc_f16", "matmul") and differ("default", "acc_f16", "deltanet.state")
    assert errors["acc_f16"]["matmul_rows_0_1"] > 5 * errors["default"]["matmul_rows_0_1"], errors
    assert differ("default", "state_f32", "deltanet.state") and differ("default", "state_f32", "deltanet.o")
    assert all(np.array_equal(d[k], r["state_f32"][k]) for k in ("matmul", "rms_norm"))
    f16_exact = lambda t: np.array_equal(t.astype(np.float16).astype(np.float32), t)  # noqa: E731
    assert not f16_exact(r["state_f32"]["deltanet.state"]) and f16_exact(d["deltanet.state"])
    assert differ("default", "ftz_off", "matmul") and differ("default", "ftz_off", "rms_norm")
    assert differ("default", "norm_fused", "rms_norm")
    assert all(np.array_equal(d[k], r["norm_fused"][k]) for k in ("matmul", "deltanet.o", "deltanet.state"))
    assert all(np.isfinite(v).all() for v in tensors.values())

    versions = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "safetensors": importlib.metadata.version("safetensors"),
    }
    settings = [{"name": n, "device": dev, **opts} for n, dev, opts in SETTINGS]
    rounding = __doc__.split("are those of `Arith` below:\n\n", 1)[1].split("\n\nEach setting", 1)[0]
    metadata = {
        "producer": "scripts/make_fp16sim_goldens.py (numpy float16)",
        "seed": str(SEED),
        "settings": json.dumps(settings),
        "rounding_points": rounding,
        "shapes": json.dumps({"matmul": [M, K, N], "rms_norm": [ROWS, D], "deltanet": [STEPS, HV, DK, DV]}),
        "matmul": "inputs.matmul.x [M,K] @ inputs.matmul.w [N,K]^T (ops::linear); row scales "
        + json.dumps(MATMUL_ROW_SCALES),
        "rms_norm": f"ops::rms_norm(x, one_plus_w, eps={EPS}) over the last axis; row scales "
        + json.dumps(NORM_ROW_SCALES),
        "deltanet": "deltanet::step (the single-token matrix form) applied STEPS times, its recurrent_state_out fed "
        "back as the next call's recurrent_state; inputs.deltanet.{q,k,v,g,beta}[t] is call t's [Hv,1,*] input "
        "(q l2-normalised and scaled by Dk^-0.5, k l2-normalised); deltanet.o stacks the calls' o, deltanet.state is "
        "the last state",
        "f64": "f64.*: the same graphs in float64 from the inputs rounded to fp16 (no flush) and the f32 initial state",
        "errors": json.dumps(errors),
        "versions": json.dumps(versions),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(OUT), metadata=metadata)
    canonicalize_safetensors_header(OUT)
    back = load_file(str(OUT))
    assert back.keys() == tensors.keys() and all(np.array_equal(back[k], tensors[k]) for k in tensors)
    size = OUT.stat().st_size
    assert size < MAX_BYTES, f"{OUT} is {size} bytes"
    add_golden(OUT, "fp16sim_goldens", {
        "generator": "scripts/make_fp16sim_goldens.py",
        "requirements": "scripts/requirements-fp16sim.txt",
        "versions": versions,
        "seed": SEED,
        "settings": settings,
        "errors_vs_f64": errors,
    })
    print(f"wrote {OUT.relative_to(REPO)} ({size} bytes, sha256 {sha256(OUT)})")
    for name, e in errors.items():
        print(f"  {name:10s} " + "  ".join(f"{k} {v:.2e}" for k, v in e.items()))


if __name__ == "__main__":
    main()
