//! What a forward call does with the checkpoint pages it reads in place.
//!
//! A matrix read in place ([`crate::linear::MappedMatrix`]: the checkpoint's bf16, f16 or f32 bytes in a read-only
//! file map) is paged into the process by its first read, one page fault per few pages, and stays resident until
//! it is handed back (`MADV_DONTNEED`: the pages leave the process, not the page cache, so a later read faults them
//! in again and finds the same bytes). Which pages a forward call hands back, and when, is its [`Pages`] policy;
//! neither policy changes a value.
//!
//! - [`Pages::Release`]: every page of the checkpoint after each layer and after the LM head. The resident figure
//!   stays at about one layer and the LM head whatever the checkpoint's size, so a model larger than memory runs (the
//!   9B's 18 GB of bf16, the whole 35B-A3B's 72 GB); every read of a decode step faults its pages in again.
//! - [`Pages::KeepAlwaysRead`]: the weights every token reads (the mixers' projections, a dense MLP, an MoE block's
//!   router, shared expert and its gate, the LM head) stay mapped from one call to the next; a routed expert's
//!   pages are handed back after its product (a token runs `k` of a layer's `E`, mostly other ones at the next
//!   step), and an untied embedding table's after the lookup (a row per token). The resident figure is the
//!   always-read weights ([`always_read_bytes`]) plus an expert and a few rows.
//!
//! The rule a model starts with ([`Pages::auto`]): [`Pages::KeepAlwaysRead`] when the always-read weights mapped in
//! place take at most half of the memory available at load (`MemAvailable`), [`Pages::Release`] otherwise or when
//! the figure is unknown. A decode step reads those weights whole every time, so a run at memory speed needs them
//! in the page cache anyway; keeping them mapped as well only saves faulting them in again, and half leaves the
//! other half of the available memory to everything else. Routed experts are handed back under both policies.

use crate::config::Config;
use crate::error::Result;
use crate::schema::{Param, Role, Schema};
use crate::weights::WeightStore;

/// Which checkpoint pages a forward call hands back (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pages {
    /// Every page, after each layer and after the LM head.
    Release,
    /// Only a routed expert's (after its product) and an untied embedding table's (after the lookup).
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

/// The bytes of the always-read matrices ([`always_read`]) that a model on `store` reads in place from the map:
/// what [`Pages::KeepAlwaysRead`] keeps resident. Packed, rounded or converted weights hold their own memory and
/// count nothing here.
pub fn always_read_bytes(config: &Config, store: &WeightStore) -> Result<u64> {
    let mut total = 0;
    for spec in Schema::new(config).tensors() {
        let matrix = matches!(
            spec.role(),
            Role::Projection | Role::LmHead | Role::Embedding
        );
        if matrix && always_read(config, spec.param) {
            total += store.held(&spec)?.mapped;
        }
    }
    Ok(total)
}

/// `MemAvailable` from `/proc/meminfo`, in bytes (`None` elsewhere than Linux or when it cannot be read).
pub fn mem_available() -> Option<u64> {
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
