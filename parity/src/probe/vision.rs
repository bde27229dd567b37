//! The vision tower's blocks as the probe's units: each block's own static graph on the device, fed the reference's
//! input (isolated) or the device's own output of the block before (chained), against the reference's output.
//! One block graph is compiled at a time.

use crate::images::Pixels;
use crate::metrics::TensorError;
use anyhow::{Context, Result};
use npu::devices::CompileOptions;
use npu::graphs::vision::{BLOCK_INPUT, vision_block_graph};
use reference::taps::Taps;
use reference::vision::{VisionConfig, VisionTower, names};
use reference::weights::WeightStore;
use serde::Serialize;

/// One vision block on the device.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VisionBlockProbe {
    /// The block.
    pub block: usize,
    /// Its output fed the reference's input.
    pub isolated: TensorError,
    /// Its output fed the device's own output of the block before (block 0: the reference's input).
    pub chained: TensorError,
    /// Whether the isolated error is over the threshold.
    pub over: bool,
}

/// Probes every block of the tower on `device` for `pixels`, judged by `max_nrmse` (isolated).
pub fn probe_vision(
    vc: &VisionConfig,
    store: &WeightStore,
    pixels: &Pixels,
    device: &str,
    compile: &CompileOptions,
    max_nrmse: f64,
) -> Result<Vec<VisionBlockProbe>> {
    let tower = VisionTower::load(vc.clone(), store)?;
    let mut taps = Taps::on();
    tower.forward(&pixels.values, &pixels.grids, &mut taps)?;
    let tap = |name: &str| {
        taps.get(name)
            .cloned()
            .with_context(|| format!("the reference tower recorded no `{name}`"))
    };
    // The first block's input: the patch embedding plus the resampled position table.
    let first = (tap(names::PATCH_EMBED)? + tap(names::POS_EMBED)?)?;
    let mut chained_input = first.clone();
    let mut out = Vec::with_capacity(vc.depth);
    for i in 0..vc.depth {
        let input = if i == 0 {
            first.clone()
        } else {
            tap(&names::block(i - 1))?
        };
        let expected = tap(&names::block(i))?;
        let graph = vision_block_graph(vc, store, &pixels.grids, i)?;
        let mut exec = npu::infer::prepare(graph, device, compile)
            .with_context(|| format!("vision block {i} on {device}"))?;
        let mut run = |x: &candle_core::Tensor| -> Result<candle_core::Tensor> {
            exec.run(&[(BLOCK_INPUT, x)])?
                .remove(&names::block(i))
                .with_context(|| format!("vision block {i} gave no output"))
        };
        let isolated = TensorError::of(&run(&input)?, &expected)?;
        let own = run(&chained_input)?;
        let chained = TensorError::of(&own, &expected)?;
        chained_input = own;
        out.push(VisionBlockProbe {
            block: i,
            // NaN is over.
            over: isolated.nrmse.get().is_nan() || isolated.nrmse.get() > max_nrmse,
            isolated,
            chained,
        });
    }
    Ok(out)
}
