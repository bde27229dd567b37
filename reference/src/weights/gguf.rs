//! A GGUF file as the store's checkpoint. In an f32 run of the checkpoint's own values ([`WeightFormat::F32`]) its
//! weight matrices stay packed in the mapped file ([`Linear::Gguf`], see [`crate::gguf::model::packed`]) and only
//! the small tensors are decoded into an f32 image; otherwise (f64 and compressed runs, and
//! [`WeightStore::open_expanded`]) every tensor is decoded into the image ([`crate::gguf::checkpoint_image`]), as
//! the compressors and the f64 conversion read checkpoint bytes.

use super::{Held, ShardFile, WeightStore};
use crate::error::{Error, Result};
use crate::gguf::GgmlType;
use crate::linear::{GgufMatrix, Linear, SharedMap};
use crate::quant::WeightFormat;
use crate::schema::TensorSpec;
use candle_core::DType;
use std::collections::HashMap;
use std::path::Path;

/// The matrices of a GGUF kept packed, by checkpoint name, and every tensor's ggml type.
pub(super) struct GgufWeights {
    map: SharedMap,
    matrices: HashMap<String, GgufMatrix>,
    types: HashMap<String, GgmlType>,
}

impl GgufWeights {
    pub(super) fn has(&self, name: &str) -> bool {
        self.matrices.contains_key(name)
    }

    pub(super) fn map(&self) -> &SharedMap {
        &self.map
    }
}

/// Whether a store of `dtype` and `format` keeps a GGUF's matrices packed.
pub(super) fn keeps_packed(dtype: DType, format: WeightFormat) -> bool {
    dtype == DType::F32 && format == WeightFormat::F32
}

/// Opens the GGUF at `path`: the image of its decoded tensors (all of them unless `pack`) and, when `pack`, its
/// packed matrices.
pub(super) fn open(path: &Path, pack: bool) -> Result<(ShardFile, Option<GgufWeights>)> {
    if !pack {
        let (_, image) = crate::gguf::checkpoint_image(path)?;
        return Ok((ShardFile::from_image(path, image)?, None));
    }
    let p = crate::gguf::packed_image(path)?;
    let map = SharedMap::from_mmap(p.map);
    let mut matrices = HashMap::new();
    for t in p.packed {
        let m = GgufMatrix::new(
            &map,
            t.start,
            t.ty,
            (t.rows, t.cols),
            t.row_order,
            t.col_order,
        )
        .map_err(|e| Error::Weights {
            file: path.display().to_string(),
            key: t.gguf_name.clone(),
            message: e.to_string(),
        })?;
        matrices.insert(t.name, m);
    }
    let weights = GgufWeights {
        map,
        matrices,
        types: p.types.into_iter().collect(),
    };
    Ok((ShardFile::from_image(path, p.image)?, Some(weights)))
}

impl ShardFile {
    /// A GGUF's decoded tensors, under the checkpoint's names, shapes and layouts, in f32, held in memory.
    fn from_image(path: &Path, image: Vec<u8>) -> Result<Self> {
        let (header_len, metadata) =
            safetensors::SafeTensors::read_metadata(&image[..]).map_err(|e| Error::File {
                file: path.display().to_string(),
                message: format!("its tensors as a checkpoint are not valid safetensors: {e}"),
            })?;
        Ok(ShardFile {
            path: path.to_path_buf(),
            mmap: SharedMap::from_vec(image),
            header_len,
            metadata,
        })
    }
}

impl WeightStore {
    /// [`WeightStore::open`] with every tensor of a GGUF decoded to f32 in memory (four bytes a weight), as before
    /// its matrices were kept packed: the path the packed one is held to bit for bit, and the speed comparison's
    /// other side. The same as [`WeightStore::open`] for a safetensors checkpoint.
    pub fn open_expanded(dir: &Path, dtype: DType) -> Result<Self> {
        Self::open_inner(dir, dtype, WeightFormat::F32, false)
    }

    /// The packed GGUF matrix of `spec`, when the store keeps one, its shape checked against the spec's.
    pub(super) fn gguf_matrix(&self, spec: &TensorSpec) -> Result<Option<&GgufMatrix>> {
        let Some(g) = &self.gguf else { return Ok(None) };
        let name = self.full_name(spec);
        let Some(m) = g.matrices.get(&name) else {
            return Ok(None);
        };
        let found = [m.rows(), m.cols()];
        if found != spec.shape.as_slice() {
            return Err(Error::Weights {
                file: self.location(),
                key: name,
                message: format!(
                    "shape {found:?} does not match the config, which implies {:?}: {}",
                    spec.shape,
                    crate::schema::shape_disagreement(
                        &spec.param.shape_keys(),
                        &found,
                        &spec.shape
                    )
                ),
            });
        }
        Ok(Some(m))
    }

    /// [`WeightStore::linear`] of a packed GGUF matrix.
    pub(super) fn gguf_linear(&self, spec: &TensorSpec) -> Result<Option<Linear>> {
        Ok(self.gguf_matrix(spec)?.cloned().map(Linear::Gguf))
    }

    /// [`WeightStore::held`] of a packed GGUF matrix: its blocks, mapped.
    pub(super) fn gguf_held(&self, spec: &TensorSpec) -> Result<Option<Held>> {
        Ok(self.gguf_matrix(spec)?.map(|m| Held {
            owned: 0,
            mapped: m.byte_len() as u64,
        }))
    }

    /// The ggml type a GGUF stores `spec`'s tensor as (whether the store keeps it packed or decoded it); `None` for
    /// a safetensors checkpoint, a tensor the GGUF does not hold, or a store that decoded the whole GGUF
    /// ([`WeightStore::open_expanded`], f64 and compressed runs). See also [`Linear::ggml_type`].
    pub fn ggml_type(&self, spec: &TensorSpec) -> Option<GgmlType> {
        self.gguf
            .as_ref()
            .and_then(|g| g.types.get(&self.full_name(spec)).copied())
    }
}
