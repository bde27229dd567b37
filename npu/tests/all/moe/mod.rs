//! The MoE decoder's graphs (`npu::graphs::moe`) on tiny-moe: the decoder and per-layer graphs on the CPU device
//! against the reference and transformers' goldens, in both forms (gathered and masked experts) and through decode
//! steps after a prompt; INT4/INT8 experts against the reference on the same packed weights; FP16SIM's routing
//! against the reference's, every flip reported with the reference's margin. A module per topic.

/// The MoE block graph fed a routing.
mod block;
/// FP16SIM's routing against the reference's.
mod fp16sim;
/// Experts stored fused build the same graphs.
mod fused;
/// The decoder and per-layer graphs, and quantized experts, on the CPU device against the reference.
mod graphs;
/// tiny-moe, its goldens, and the runs the tests share.
mod support;
