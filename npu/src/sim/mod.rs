//! FP16SIM: an accelerator's arithmetic applied to this project's own graphs, for everyone without an NPU.
//!
//! The graphs an NPU gets are evaluated by [`eval::Evaluator`] under a [`NumericModel`] (by default: values stored
//! in fp16, subnormals flushed to zero, matrix-product terms rounded to fp16 and summed in f32, states kept in fp16),
//! wherever a device is named: `--device FP16SIM`, or `FP16SIM:store=bf16,ftz=off,acc=f16,state=f32`. With
//! `store=f32,ftz=off` nothing is rounded and it is a second executor of the graphs, independent of OpenVINO.
//!
//! How it computes is not part of the arithmetic: `kernels=tiled` (the default) tiles, vectorises and spreads the
//! matrix products over the cores and reads the checkpoint's matrices where the `.bin` stores them; `kernels=plain`
//! evaluates every op as written, one term at a time (the specification, which the tiled kernels equal to the
//! last bit).

mod consts;
mod dispatch;
pub mod eval;
mod kernel;
mod norms;
pub mod numeric;
mod ops;
mod products;
mod value;
mod weights;

pub use numeric::{DEVICE, NumericModel};

use crate::error::{Error, Result};

/// How the evaluator computes: every op as written (the specification), or with the products tiled and
/// vectorised and the checkpoint matrices read where they lie (the same numbers to the last bit, the default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernels {
    /// Every op as written, one term at a time.
    Plain,
    /// Tiled, vectorised and parallel products; checkpoint matrices decoded a tile at a time by their reader.
    Tiled,
}

impl Kernels {
    /// The `kernels=` option's value.
    pub fn name(self) -> &'static str {
        match self {
            Kernels::Plain => "plain",
            Kernels::Tiled => "tiled",
        }
    }
}

/// The numeric model and the kernels a device name (`FP16SIM[:options]`) and its device config ask for: the
/// `kernels=tiled|plain` option read here, every other one by [`NumericModel::parse`].
pub fn parse_device(device: &str, config: &[(String, String)]) -> Result<(NumericModel, Kernels)> {
    let mut kernels = Vec::new();
    let mut keep = |k: &str, v: &str| {
        if k.trim().eq_ignore_ascii_case("kernels") {
            kernels.push(v.trim().to_ascii_lowercase());
            false
        } else {
            true
        }
    };
    let (name, opts) = device.split_once(':').unwrap_or((device, ""));
    let opts: Vec<&str> = opts
        .split(',')
        .filter(|item| {
            let (k, v) = item.split_once('=').unwrap_or((item, ""));
            keep(k, v)
        })
        .collect();
    let config: Vec<(String, String)> =
        config.iter().filter(|(k, v)| keep(k, v)).cloned().collect();
    let name = if opts.iter().all(|o| o.is_empty()) {
        name.to_string()
    } else {
        format!("{name}:{}", opts.join(","))
    };
    let model = NumericModel::parse(&name, &config)?;
    let kernels = match kernels.as_slice() {
        [] => Kernels::Tiled,
        [k] if k == "tiled" => Kernels::Tiled,
        [k] if k == "plain" => Kernels::Plain,
        [k] => {
            return Err(Error::Config(format!(
                "{DEVICE} option kernels={k}: kernels is tiled or plain"
            )));
        }
        _ => {
            return Err(Error::Config(format!(
                "{DEVICE} option `kernels` given twice ({})",
                kernels.join(", ")
            )));
        }
    };
    Ok((model, kernels))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_option_is_read_beside_the_numeric_ones() {
        let (m, k) = parse_device("FP16SIM", &[]).unwrap();
        assert_eq!((m, k), (NumericModel::default(), Kernels::Tiled));
        let (m, k) = parse_device("FP16SIM:kernels=plain,acc=f16", &[]).unwrap();
        assert_eq!(k, Kernels::Plain);
        assert_eq!(m, NumericModel::parse("FP16SIM:acc=f16", &[]).unwrap());
        let config = [("KERNELS".to_string(), "Plain".to_string())];
        let (m, k) = parse_device("FP16SIM:store=bf16", &config).unwrap();
        assert_eq!(k, Kernels::Plain);
        assert_eq!(m, NumericModel::parse("FP16SIM:store=bf16", &[]).unwrap());
        for (device, config, says) in [
            ("FP16SIM:kernels=fast", vec![], "kernels is tiled or plain"),
            (
                "FP16SIM:kernels=plain",
                vec![("kernels".to_string(), "tiled".to_string())],
                "given twice",
            ),
            ("FP16SIM:kernels=plain,speed=fast", vec![], "unknown option"),
        ] {
            let e = parse_device(device, &config).unwrap_err().to_string();
            assert!(e.contains(says), "{device}: {e}");
        }
        assert_eq!(Kernels::Plain.name(), "plain");
    }
}
