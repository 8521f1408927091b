//! Which device AdamW ops of a schedule the CUDA backend updates in one launch.
//!
//! A run is a maximal sequence of adjacent [`Instr::Kernel`] instructions of one device stream
//! (any stream but [`StreamKind::HostOptimizer`], whose CPU Adam updates one tensor at a time)
//! whose ops are AdamW with the same kind (hyper-parameters and whether they are clipped), the
//! same parameter type and the same clip coefficient. The CUDA backend updates a run of two or
//! more with one `adamw_multi_*` launch (multi-tensor apply, as apex's FusedAdam), issued when
//! the run's last op is: nothing else of the stream lies between its ops, so no AdamW moves
//! across a record, a wait or any other instruction. The compiler's simulator prices device
//! AdamW by the same rule (`protrain_compiler::simulate::device_adamw_runs`), so predictions
//! count the launches the backend makes; a test of the root package holds the two to the same
//! runs.
//!
//! Plain data over a schedule, available without the `cuda` feature.

#[cfg(feature = "cuda")]
use std::collections::HashMap;
use std::ops::Range;

#[cfg(feature = "cuda")]
use protrain_ir::ValueId;
use protrain_ir::{DType, Instr, OpKind, Schedule, StreamId, StreamKind, TensorRef};

/// A run of adjacent AdamW instructions on one device stream: one launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdamWRun {
    /// The stream.
    pub stream: StreamId,
    /// The instructions' indices in the stream (at least one).
    pub instrs: Range<usize>,
}

impl AdamWRun {
    /// How many AdamW ops the run updates.
    pub fn len(&self) -> usize {
        self.instrs.len()
    }

    /// Whether the run is empty (never, for a run [`adamw_runs`] returns).
    pub fn is_empty(&self) -> bool {
        self.instrs.is_empty()
    }
}

/// What must be equal for two adjacent AdamW instructions to share a launch: the op kind
/// (every hyper-parameter, and whether the gradient is clipped), the parameter's type, and
/// where the clip coefficient is read.
#[derive(Clone, Copy, Debug, PartialEq)]
struct MergeKey<'a> {
    kind: &'a OpKind,
    dtype: DType,
    coefficient: Option<TensorRef>,
}

/// The merge key of an instruction: `None` unless it runs an AdamW op that names its
/// parameter (a malformed op gets its own launch, and the launch plan's error).
fn merge_key<'a>(schedule: &'a Schedule, instr: &'a Instr) -> Option<MergeKey<'a>> {
    let Instr::Kernel { op, inputs, .. } = instr else {
        return None;
    };
    let graph = &schedule.graph;
    if op.index() >= graph.op_count() {
        return None;
    }
    let op = graph.op(*op);
    let OpKind::AdamW { clipped, .. } = op.kind else {
        return None;
    };
    let param = *op.inputs.first()?;
    if param.index() >= graph.values().len() {
        return None;
    }
    Some(MergeKey {
        kind: &op.kind,
        dtype: graph.value(param).ty.dtype,
        coefficient: match clipped {
            true => Some(*inputs.get(4)?),
            false => None,
        },
    })
}

/// Every run of device AdamW instructions in `schedule`, by stream, then by position; runs of
/// one instruction included, so there is one run per launch the CUDA backend makes for AdamW.
pub fn adamw_runs(schedule: &Schedule) -> Vec<AdamWRun> {
    let mut runs = Vec::new();
    for (s, stream) in schedule.streams.iter().enumerate() {
        if stream.kind == StreamKind::HostOptimizer {
            continue;
        }
        let mut current: Option<(usize, MergeKey<'_>)> = None;
        for (i, instr) in stream.instrs.iter().enumerate() {
            let key = merge_key(schedule, instr);
            match (current, key) {
                (Some((_, open)), Some(key)) if open == key => continue,
                _ => {}
            }
            if let Some((start, _)) = current.take() {
                runs.push(AdamWRun {
                    stream: StreamId::new(s),
                    instrs: start..i,
                });
            }
            current = key.map(|key| (i, key));
        }
        if let Some((start, _)) = current {
            runs.push(AdamWRun {
                stream: StreamId::new(s),
                instrs: start..stream.instrs.len(),
            });
        }
    }
    runs
}

/// Where an AdamW op stands in its merged run.
#[cfg(feature = "cuda")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RunSlot {
    /// Its position in the run, from 0.
    pub index: usize,
    /// The run's length (at least 2).
    pub len: usize,
}

/// The slot of every AdamW op in a run of two or more, by the parameter it updates (each
/// AdamW op updates its own parameter, and a launch names its op's values, not its id).
#[cfg(feature = "cuda")]
pub(crate) fn run_slots(schedule: &Schedule) -> HashMap<ValueId, RunSlot> {
    let mut slots = HashMap::new();
    for run in adamw_runs(schedule).into_iter().filter(|r| r.len() >= 2) {
        let stream = &schedule.streams[run.stream.index()];
        for (index, i) in run.instrs.clone().enumerate() {
            if let Instr::Kernel { op, .. } = &stream.instrs[i] {
                slots.insert(
                    schedule.graph.op(*op).inputs[0],
                    RunSlot {
                        index,
                        len: run.len(),
                    },
                );
            }
        }
    }
    slots
}
