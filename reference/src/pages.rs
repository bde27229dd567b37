//! What a forward call does with the checkpoint pages it reads in place.
//!
//! A matrix read in place ([`crate::linear::MappedMatrix`]: the checkpoint's bf16, f16 or f32 bytes in a read-only
//! file map) is paged into the process by its first read, a page fault per few pages, and stays resident until it is
//! handed back (`MADV_DONTNEED`: the pages leave the process, not the page cache, so a later read faults them in
//! again and finds the same bytes). Neither policy below changes a value.
//!
//! Under both, a routed expert's pages are handed back right after its product (a token runs `k` of a layer's `E`
//! experts, mostly other ones at the next step), and an untied embedding table's after the lookup (a row per token).
//! The weights every token reads ([`always_read`]: the mixers' projections, a dense MLP, an MoE block's router,
//! shared expert and its gate, the LM head; [`InPlace`]) go as the policy says:
//!
//! - [`Pages::Release`]: a layer's after the layer, the LM head's after it. The resident figure stays at about one
//!   layer and the LM head whatever the checkpoint's size, so a model larger than memory runs (the 9B's 18 GB of
//!   bf16, the whole 35B-A3B's 72 GB); every decode step faults them in again.
//! - [`Pages::KeepAlwaysRead`]: they stay mapped from one call to the next; the resident figure is their bytes
//!   ([`InPlace::bytes`]) plus an expert and a few rows.
//!
//! The rule a model starts with ([`Pages::auto`]): [`Pages::KeepAlwaysRead`] when those bytes are at most half of
//! the memory available at load (`MemAvailable`), [`Pages::Release`] otherwise or when the figure is unknown. A
//! decode step reads them whole every time, so a run at memory speed needs them in the page cache anyway; keeping
//! them mapped as well saves faulting them in again, and half leaves the other half of the available memory to
//! everything else.

use crate::config::Config;
use crate::error::Result;
use crate::linear::{Linear, MappedMatrix};
use crate::schema::{Param, Role, Schema};
use crate::weights::WeightStore;

/// What a forward call does with the pages of the weights every token reads (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pages {
    /// Hands a layer's back after the layer, the LM head's after it.
    Release,
    /// Keeps them mapped.
    KeepAlwaysRead,
}

impl Pages {
    /// The rule: [`Pages::KeepAlwaysRead`] when `always_read` bytes are at most half of `available` (none known:
    /// [`Pages::Release`]).
    pub fn auto(always_read: u64, available: Option<u64>) -> Pages {
        match available {
            Some(a) if always_read <= a / 2 => Pages::KeepAlwaysRead,
            _ => Pages::Release,
        }
    }

    /// The policy's name: `release` or `keep-always-read`.
    pub fn name(self) -> &'static str {
        match self {
            Pages::Release => "release",
            Pages::KeepAlwaysRead => "keep-always-read",
        }
    }
}

/// Whether every token reads the whole matrix of `param`: not a routed expert's projection (a token runs `k` of
/// them), not an untied embedding table (a row per token).
pub fn always_read(config: &Config, param: Param) -> bool {
    match param {
        Param::ExpertGateProj(_) | Param::ExpertUpProj(_) | Param::ExpertDownProj(_) => false,
        Param::EmbedTokens => config.tie_word_embeddings,
        _ => true,
    }
}

/// The always-read matrices ([`always_read`]) a model on a store reads in place from the checkpoint's map, by where
/// a forward call reads them: each layer's, then the LM head. Packed, rounded or converted weights hold their own
/// memory and are not among them.
#[derive(Debug, Clone, Default)]
pub struct InPlace {
    layers: Vec<Vec<MappedMatrix>>,
    head: Vec<MappedMatrix>,
}

impl InPlace {
    /// Those of the model of `config` on `store`.
    pub fn of(config: &Config, store: &WeightStore) -> Result<Self> {
        let s = Schema::new(config);
        let mapped = |specs: Vec<crate::schema::TensorSpec>| -> Result<Vec<MappedMatrix>> {
            let mut out = Vec::new();
            for spec in specs {
                let matrix = matches!(
                    spec.role(),
                    Role::Projection | Role::LmHead | Role::Embedding
                );
                if matrix
                    && always_read(config, spec.param)
                    && store.held(&spec)?.mapped > 0
                    && let Linear::Mapped(m) = store.linear(&spec)?.weight().clone()
                {
                    out.push(m);
                }
            }
            Ok(out)
        };
        Ok(InPlace {
            layers: (0..config.num_layers())
                .map(|i| mapped(s.layer_tensors(i)))
                .collect::<Result<_>>()?,
            head: mapped(vec![s.lm_head()])?,
        })
    }

    /// Their bytes: what [`Pages::KeepAlwaysRead`] keeps resident.
    pub fn bytes(&self) -> u64 {
        self.layers
            .iter()
            .flatten()
            .chain(&self.head)
            .map(|m| m.byte_len() as u64)
            .sum()
    }

    /// Hands back the pages of layer `layer`'s.
    pub fn release_layer(&self, layer: usize) {
        for m in self.layers.get(layer).into_iter().flatten() {
            m.release_pages();
        }
    }

    /// Hands back the pages of the LM head.
    pub fn release_head(&self) {
        for m in &self.head {
            m.release_pages();
        }
    }
}

/// `MemAvailable` from `/proc/meminfo`, in bytes (`None` elsewhere than Linux or when it cannot be read).
pub fn mem_available() -> Option<u64> {
    #[allow(clippy::disallowed_methods)] // the kernel's figures, not an input of the run
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule_keeps_what_fits_in_half_the_available_memory() {
        assert_eq!(Pages::auto(5, Some(10)), Pages::KeepAlwaysRead);
        assert_eq!(Pages::auto(6, Some(10)), Pages::Release);
        assert_eq!(Pages::auto(0, None), Pages::Release);
    }
}
