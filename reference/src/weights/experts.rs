//! MoE experts stored fused, as transformers 5 keeps them in memory and a converted checkpoint may store them:
//! `layers.{i}.mlp.experts.gate_up_proj` `[E, 2·Im, H]` and `layers.{i}.mlp.experts.down_proj` `[E, H, Im]`
//! ([`crate::schema::FusedExpert`]). An expert's matrix is a run of whole rows of the fused tensor, so it is served
//! from the same bytes, in place, exactly as its own tensor would be: mapped, packed or converted alike.

use super::{Raw, WeightStore};
use crate::config::MoeConfig;
use crate::error::{Error, Result};
use crate::schema::FusedExpert;

/// The bytes of `full_name` (`[rows, cols]`), a tensor the checkpoint does not hold by that name: an expert's
/// matrix inside its layer's fused tensor when the checkpoint holds that, else the error that it is missing. A fused
/// tensor whose shape holds no such matrix is an error naming its file and key.
pub(super) fn fused_raw<'a>(
    store: &'a WeightStore,
    full_name: &'a str,
    shape: &[usize],
) -> Result<Raw<'a>> {
    let missing = || Error::Weights {
        file: store.location(),
        key: full_name.to_string(),
        message: "missing".into(),
    };
    let fused = full_name
        .strip_prefix(store.prefix)
        .and_then(FusedExpert::of)
        .ok_or_else(missing)?;
    let key = format!("{}{}", store.prefix, fused.name);
    let &file_idx = store.index.get(&key).ok_or_else(missing)?;
    let file = &store.files[file_idx];
    let err = |message: String| Error::Weights {
        file: file.path.display().to_string(),
        key: key.clone(),
        message,
    };
    let info = file
        .info(&key)
        .ok_or_else(|| err("missing from its shard".into()))?;
    let &[rows, cols] = shape else {
        return Err(err(format!("an expert's matrix is 2-D, not {shape:?}")));
    };
    let per_expert = if fused.name.ends_with("gate_up_proj") {
        2 * rows
    } else {
        rows
    };
    match *info.shape.as_slice() {
        [e, r, c] if r == per_expert && c == cols && fused.expert < e => {}
        _ => {
            return Err(err(format!(
                "shape {:?} holds no [{rows}, {cols}] matrix of expert {} (expected [E > {}, {per_expert}, {cols}]) \
                 for `{full_name}`",
                info.shape, fused.expert, fused.expert
            )));
        }
    }
    let bits = info.dtype.bitsize();
    let bytes = file.bytes(info);
    if bytes.len() * 8 != info.shape.iter().product::<usize>() * bits {
        return Err(err(format!(
            "holds {} bytes, not the {:?} {:?} its header gives",
            bytes.len(),
            info.dtype,
            info.shape
        )));
    }
    let row_bytes = cols * bits / 8;
    let first = fused.first_row(&info.shape);
    Ok(Raw {
        file,
        name: full_name,
        dtype: info.dtype,
        bytes: &bytes[first * row_bytes..(first + rows) * row_bytes],
    })
}

impl Raw<'_> {
    /// The bytes' offset in their shard's map (where a matrix read in place starts).
    pub(super) fn start(&self) -> usize {
        self.bytes.as_ptr() as usize - self.file.mmap.bytes().as_ptr() as usize
    }
}

impl WeightStore {
    /// Checks a layer's fused expert tensors, where the checkpoint holds them, against the config: `gate_up_proj`
    /// `[E, 2·Im, H]` and `down_proj` `[E, H, Im]`, so that a fused tensor of more experts than the config has is an
    /// error, not experts silently left out. An error names the file and the key.
    pub fn check_fused_experts(&self, layer: usize, moe: &MoeConfig, hidden: usize) -> Result<()> {
        for proj in ["gate_proj", "down_proj"] {
            let fused = FusedExpert::of(&format!("layers.{layer}.mlp.experts.0.{proj}.weight"))
                .expect("an expert's name");
            let key = format!("{}{}", self.prefix, fused.name);
            let Some(&file_idx) = self.index.get(&key) else {
                continue;
            };
            let file = &self.files[file_idx];
            let expected = fused.shape(moe, hidden);
            match file.info(&key) {
                Some(info) if info.shape == expected => {}
                found => {
                    return Err(Error::Weights {
                        file: file.path.display().to_string(),
                        key,
                        message: format!(
                            "shape {} does not match the config, which implies {expected:?} \
                             (num_experts {}, moe_intermediate_size {}, hidden_size {hidden})",
                            found.map_or("absent".into(), |i| format!("{:?}", i.shape)),
                            moe.num_experts,
                            moe.moe_intermediate_size
                        ),
                    });
                }
            }
        }
        Ok(())
    }
}
