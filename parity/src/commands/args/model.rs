//! Which model, in which precision, with which weights (`--model`, `--dtype`, `--weights`): the checkpoint opened,
//! or a set made elsewhere and the checkpoint it runs against.

use anyhow::{Result, bail};
use candle_core::DType;
use clap::{Args, ValueEnum};
use reference::config::Config;
use reference::model::Model;
use reference::quant::WeightFormat;
use reference::weights::WeightStore;
use std::path::{Path, PathBuf};

/// The dtype a reference run computes in (`--dtype`). (Not a device's inference precision, which is `--precision`.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Dtype {
    /// 32-bit floats (the default).
    F32,
    /// 64-bit floats: the high-precision ground truth.
    F64,
}

impl Dtype {
    /// The tensor dtype.
    pub fn dtype(self) -> DType {
        match self {
            Dtype::F32 => DType::F32,
            Dtype::F64 => DType::F64,
        }
    }
}

/// Which model, in which precision, with which weights.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// Checkpoint directory (config.json, safetensors, tokenizer), or a GGUF file (or a directory holding one).
    /// Default: the bundled tiny model.
    #[arg(long, value_name = "DIR|FILE.gguf")]
    pub model: Option<PathBuf>,
    /// Precision of the reference run.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: Dtype,
    /// Weights as stored: f32 (as in the checkpoint), f16, or int4 (symmetric, group 128, int8 backup; `int4:G` for
    /// another group); `int4-nncf[:G]` also gives the DeltaNet conv weights the int8 backup, as NNCF does to an
    /// optimum-intel export. The reference runs the same quantized weights, dequantized exactly.
    #[arg(long, default_value = "f32", value_parser = parse_weights, value_name = "f32|f16|int4[:G]|int4-nncf[:G]")]
    pub weights: WeightFormat,
}

fn parse_weights(s: &str) -> std::result::Result<WeightFormat, String> {
    WeightFormat::parse(s).map_err(|e| e.to_string())
}

impl ModelArgs {
    /// Reads the config and opens the weights in the chosen format.
    pub fn open(&self) -> Result<(PathBuf, Config, WeightStore)> {
        let dir = self.dir()?;
        let config = reference::gguf::model_config(&dir)?;
        let store = WeightStore::open_with_format(&dir, self.dtype.dtype(), self.weights)?;
        Ok((dir, config, store))
    }

    /// [`ModelArgs::open`] for a command whose graphs take `form`: the one step that reads the config and checks the
    /// form's flags against it (`--moe-form` on a dense model is refused, naming both), before any work.
    pub fn open_for(&self, form: &super::FormArgs) -> Result<(PathBuf, Config, WeightStore)> {
        let (dir, config, store) = self.open()?;
        form.check_model(&dir, &config)?;
        Ok((dir, config, store))
    }

    /// [`ModelArgs::open`], and the reference model on those weights.
    pub fn load(&self) -> Result<(PathBuf, Config, WeightStore, Model)> {
        let (dir, config, store) = self.open()?;
        let model = Model::from_weights(config.clone(), &store)?;
        Ok((dir, config, store, model))
    }

    /// The model directory, checked to hold a config (or the GGUF file, or a directory holding one: see
    /// [`reference::gguf::find`]): `--model`, or the bundled tiny model.
    pub fn dir(&self) -> Result<PathBuf> {
        match &self.model {
            Some(d) if reference::gguf::find(d)?.is_some() => Ok(d.clone()),
            Some(d) if d.join("config.json").is_file() => Ok(d.clone()),
            Some(d) if !d.exists() => bail!("--model {}: no such directory", d.display()),
            Some(d) if !d.is_dir() => bail!(
                "--model {}: a file that is not a .gguf; --model takes the checkpoint's directory (the one holding \
                 config.json) or a GGUF file",
                d.display()
            ),
            Some(d) => bail!("--model {}: no config.json in this directory", d.display()),
            None => crate::bundled::model_dir(),
        }
    }
}

impl ModelArgs {
    /// A set made elsewhere (`--ir DIR`) and the checkpoint the reference runs against it: `--model`, else the one
    /// the set's manifest names, else the bundled model.
    pub fn open_set(&self, dir: &Path) -> Result<crate::device::set::SetSource> {
        let set = npu::graphset::manifest::open(dir)
            .map_err(|e| anyhow::Error::new(e).context(format!("--ir {}", dir.display())))?;
        if self.model.is_none()
            && let Some(m) = &set.model
            && !m.join("config.json").is_file()
        {
            bail!(
                "--ir {}: {}'s `model` is {}, which holds no config.json; fix it or give --model",
                dir.display(),
                set.source,
                m.display()
            );
        }
        // A set made for another model would run against --model with no word: refused unless the manifest's
        // model is --model (one directory) or the same model elsewhere (the same config.json).
        if let (Some(given), Some(named)) = (&self.model, &set.model)
            && named.join("config.json").is_file()
            && !same_model(given, named)
        {
            bail!(
                "--ir {}: {}'s `model` is {}, another model than --model {}; give the set's model or a set made \
                 for --model",
                dir.display(),
                set.source,
                named.display(),
                given.display()
            );
        }
        let model = ModelArgs {
            model: self.model.clone().or(set.model.clone()),
            ..self.clone()
        };
        let (checkpoint, config, store) = model.open()?;
        set.check_layers(config.num_layers())
            .map_err(|e| anyhow::Error::new(e).context(format!("--ir {}", dir.display())))?;
        Ok(crate::device::set::SetSource::new(
            dir, set, checkpoint, config, store,
        ))
    }
}

/// Whether two checkpoint directories hold the same model: one directory (canonical paths), or the same
/// `config.json` byte for byte (a copy).
fn same_model(a: &Path, b: &Path) -> bool {
    if let (Ok(ca), Ok(cb)) = (a.canonicalize(), b.canonicalize())
        && ca == cb
    {
        return true;
    }
    match (
        reference::inputs::read(&a.join("config.json")),
        reference::inputs::read(&b.join("config.json")),
    ) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}
