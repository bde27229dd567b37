//! Named intermediate tensors recorded during a run (the parity harness's view inside the model).
//!
//! Every tap is token-major (`[T, …]`); when a prompt is fed in several forward calls the pieces are concatenated
//! along the token axis, so a tap always covers every token seen since the recorder was created.

use crate::error::Result;
use candle_core::Tensor;
use std::collections::BTreeMap;

/// A recorder of named intermediates; a disabled recorder costs nothing.
#[derive(Debug, Default)]
pub struct Taps {
    enabled: bool,
    tensors: BTreeMap<String, Tensor>,
}

impl Taps {
    /// A recorder that keeps nothing.
    pub fn off() -> Self {
        Taps::default()
    }

    /// A recorder that keeps every tap.
    pub fn on() -> Self {
        Taps {
            enabled: true,
            tensors: BTreeMap::new(),
        }
    }

    /// Whether taps are being recorded.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Records `tensor` under `name`, appending along the token axis if the name was recorded before.
    pub fn record(&mut self, name: impl FnOnce() -> String, tensor: &Tensor) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        let name = name();
        let merged = match self.tensors.remove(&name) {
            Some(prev) => Tensor::cat(&[&prev, tensor], 0)?,
            None => tensor.clone(),
        };
        self.tensors.insert(name, merged);
        Ok(())
    }

    /// The tap recorded under `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name)
    }

    /// All taps, by name.
    pub fn tensors(&self) -> &BTreeMap<String, Tensor> {
        &self.tensors
    }

    /// Takes the recorded taps, leaving the recorder empty.
    pub fn take(&mut self) -> BTreeMap<String, Tensor> {
        std::mem::take(&mut self.tensors)
    }
}
