//! Emission: assembles the [`Schedule`] and its header from the streamed, planned passes.

use crate::plan::Planned;
use crate::streams::Streamed;
use protrain_ir::{Header, Prediction, Schedule, FORMAT_VERSION};

/// What the header records about the compilation, beyond what the passes produced.
#[derive(Clone, Debug)]
pub struct HeaderInputs {
    /// The model's name.
    pub model: String,
    /// The hardware profile's summary line.
    pub hardware: String,
    /// Device bytes allowed.
    pub device_budget_bytes: u64,
    /// Host bytes allowed.
    pub host_budget_bytes: u64,
    /// Why this policy, as text.
    pub report: String,
}

/// Builds the schedule. Its predicted step time and per-stream busy time are zero until the
/// simulator fills them in.
pub fn emit(streamed: Streamed, planned: &Planned, inputs: HeaderInputs) -> Schedule {
    let graph = streamed.placed.graph;
    let dtype = graph
        .params()
        .next()
        .map_or(protrain_ir::DType::F32, |(_, p)| {
            graph.value(p.value).ty.dtype
        });
    let flops = graph
        .ops()
        .map(|(_, op)| {
            let ins: Vec<_> = op.inputs.iter().map(|&v| &graph.value(v).ty).collect();
            let outs: Vec<_> = op.outputs.iter().map(|&v| &graph.value(v).ty).collect();
            op.kind.flops(&ins, &outs)
        })
        .sum();
    let header = Header {
        format_version: FORMAT_VERSION,
        model: inputs.model,
        batch: graph.info.batch,
        seq: graph.info.seq,
        dtype,
        param_count: graph.param_count(),
        hardware: inputs.hardware,
        device_budget_bytes: inputs.device_budget_bytes,
        host_budget_bytes: inputs.host_budget_bytes,
        policy: streamed.placed.policy,
        prediction: Prediction {
            step_seconds: 0.0,
            stream_busy_seconds: vec![0.0; streamed.streams.len()],
            flops,
            peak_device_bytes: planned.arena_bytes,
            lower_bound_bytes: planned.lower_bound_bytes,
            host_bytes: planned.host_bytes,
            memory: planned.memory,
        },
        report: inputs.report,
    };
    Schedule {
        header,
        graph,
        chunks: streamed.placed.chunks,
        buffers: streamed.buffers.into_iter().map(|p| p.buffer).collect(),
        streams: streamed.streams,
        events: streamed.events,
        arena_bytes: planned.arena_bytes,
        host_bytes: planned.host_bytes,
        homes: streamed.homes,
        masters: streamed.masters,
        loss: streamed.loss,
    }
}
