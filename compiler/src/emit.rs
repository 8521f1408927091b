//! Emission: assembles the [`Schedule`] and its header from the streamed, planned passes.
//!
//! The streams pass lowered every movement op of the placed graph to a copy instruction, so
//! the schedule's graph is the compute graph, the placed graph without its movement ops, in
//! which each op that read a copy reads the value it was copied from (`use(gather(p))` is
//! `use(p)`). Placement kept that graph and where each placed op and value is in it
//! ([`crate::movement::Lowering`]); emission renumbers the instructions, homes and copies that
//! name placed ids.

use crate::error::Result;
use crate::plan::Planned;
use crate::streams::Streamed;
use protrain_ir::{
    CopyKind, Header, Instr, MicroBatchOrder, Prediction, Schedule, ValueId, FORMAT_VERSION,
};

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
    /// Whether the target GPU runs the CUDA backend's flash attention kernels
    /// ([`crate::cost::flash_attention_on`]): attention's workspace is planned for them, or
    /// for the GEMM path and its score matrices on an older GPU.
    pub flash_attention: bool,
}

/// Builds the schedule. Its predicted step time and per-stream busy time are zero until the
/// simulator fills them in.
pub fn emit(streamed: Streamed, planned: &Planned, inputs: HeaderInputs) -> Result<Schedule> {
    let placed = streamed.placed;
    let (graph, lowering) = (placed.compute, placed.lowering);
    let value = |v: ValueId| lowering.values[v.index()];
    let mut streams = streamed.streams;
    for instr in streams.iter_mut().flat_map(|s| s.instrs.iter_mut()) {
        match instr {
            Instr::Kernel { op, .. } => {
                *op = lowering.ops[op.index()].expect("a kernel runs a compute op")
            }
            Instr::Copy { what, .. } => match what {
                CopyKind::OffloadActivation { value: v }
                | CopyKind::ReloadActivation { value: v }
                | CopyKind::Scalar { value: v } => *v = value(*v),
                CopyKind::FetchChunk { .. } | CopyKind::OffloadGrads { .. } => {}
            },
            _ => {}
        }
    }
    // Chunk-major accumulation: the interleaved graph's outputs start with the micro-batches'
    // losses, one per micro-batch of a rank (the loss gradient is scaled for every rank's,
    // and the chunk table of several ranks is sharded over them).
    let k = (graph.micro_batches() / u64::from(placed.chunks.world_size.max(1))) as usize;
    let micro_batch_losses = match placed.policy.order {
        MicroBatchOrder::ChunkMajor if k > 1 => {
            streamed.outputs[..k.min(streamed.outputs.len())].to_vec()
        }
        _ => Vec::new(),
    };
    let homes = streamed.homes.iter().map(|&(v, r)| (value(v), r)).collect();
    let masters = streamed
        .masters
        .iter()
        .map(|&(v, r)| (value(v), r))
        .collect();
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
        disk_budget_bytes: 0,
        policy: placed.policy,
        prediction: Prediction {
            step_seconds: 0.0,
            stream_busy_seconds: vec![0.0; streams.len()],
            flops,
            peak_device_bytes: planned.arena_bytes,
            lower_bound_bytes: planned.lower_bound_bytes,
            host_bytes: planned.host_bytes,
            memory: planned.memory,
        },
        report: inputs.report,
    };
    Ok(Schedule {
        header,
        graph,
        chunks: placed.chunks,
        buffers: streamed
            .buffers
            .into_iter()
            .map(|p| {
                // A padded buffer names its value in the schedule's graph.
                let mut buffer = p.buffer;
                if let Some(pitch) = &mut buffer.pitch {
                    pitch.value = value(pitch.value);
                }
                buffer
            })
            .collect(),
        streams,
        events: streamed.events,
        arena_bytes: planned.arena_bytes,
        host_bytes: planned.host_bytes,
        disk_bytes: 0,
        homes,
        masters,
        loss: streamed.loss,
        micro_batch_losses,
    })
}
