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

#[cfg(test)]
mod tests {
    use super::*;
    use protrain_ir::{
        BlockKind, Buffer, BufferId, BufferKind, ChunkTable, EventId, Graph, GraphInfo, Header,
        OpId, Phase, Policy, Prediction, Space, Stream, TensorType, FORMAT_VERSION,
    };

    /// AdamW ops on eight 16-element f32 parameters: four alike, the fifth with another weight
    /// decay, the last three clipped (reading a coefficient).
    fn graph() -> (Graph, Vec<OpId>) {
        let mut g = Graph::new(GraphInfo {
            model: "tiny".into(),
            batch: 1,
            seq: 1,
        });
        let block = g.add_block("lm_head", BlockKind::Head);
        let coef = g.add_state("coef", TensorType::new([], DType::F32));
        let mut ops = Vec::new();
        for (i, (weight_decay, clipped)) in [
            (0.0, false),
            (0.0, false),
            (0.0, false),
            (0.0, false),
            (0.1, false),
            (0.0, true),
            (0.0, true),
            (0.0, true),
        ]
        .into_iter()
        .enumerate()
        {
            let name = format!("p{i}");
            let p = g.add_param(&name, [16], DType::F32, block);
            let p = g.param(p).value;
            let ty = TensorType::new([16], DType::F32);
            let mut inputs = vec![
                p,
                g.add_state(format!("{name}.grad"), ty.clone()),
                g.add_state(format!("{name}.m"), ty.clone()),
                g.add_state(format!("{name}.v"), ty),
            ];
            if clipped {
                inputs.push(coef);
            }
            let kind = OpKind::AdamW {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay,
                clipped,
            };
            g.add_op_multi(kind, &inputs, &[], block, Phase::Optimizer)
                .unwrap();
            ops.push(OpId(g.op_count() as u32 - 1));
        }
        (g, ops)
    }

    fn kernel(op: OpId, coef_at: u64) -> Instr {
        let at = |offset| TensorRef {
            buffer: BufferId(0),
            offset,
        };
        Instr::Kernel {
            op,
            inputs: vec![at(0), at(64), at(128), at(192), at(coef_at)],
            outputs: Vec::new(),
            workspace: None,
        }
    }

    fn schedule(graph: Graph, streams: Vec<(StreamKind, Vec<Instr>)>) -> Schedule {
        Schedule {
            header: Header {
                format_version: FORMAT_VERSION,
                model: "tiny".into(),
                batch: 1,
                seq: 1,
                dtype: DType::F32,
                param_count: graph.param_count(),
                hardware: "stub".into(),
                device_budget_bytes: 1 << 20,
                host_budget_bytes: 1 << 20,
                disk_budget_bytes: 0,
                policy: Policy::resident(1, 0),
                prediction: Prediction::default(),
                report: String::new(),
            },
            graph,
            chunks: ChunkTable {
                chunk_bytes: 0,
                chunks: Vec::new(),
                world_size: 1,
                param_chunk: Vec::new(),
                trials: Vec::new(),
            },
            buffers: vec![Buffer {
                name: "device".into(),
                space: Space::Device,
                offset: 0,
                size: 1 << 20,
                kind: BufferKind::Workspace,
                pitch: None,
            }],
            streams: streams
                .into_iter()
                .map(|(kind, instrs)| Stream {
                    name: format!("{kind:?}"),
                    kind,
                    instrs,
                })
                .collect(),
            events: 1,
            arena_bytes: 1 << 20,
            host_bytes: 1 << 20,
            disk_bytes: 0,
            homes: Vec::new(),
            masters: Vec::new(),
            loss: TensorRef {
                buffer: BufferId(0),
                offset: 0,
            },
            micro_batch_losses: Vec::new(),
        }
    }

    /// A record splits a run; another weight decay starts a new one; a clipped op merges with
    /// clipped ops that read the same coefficient only; the host optimizer stream (here
    /// updating two of the same parameters, which no schedule does) has no runs; the slots
    /// number each op of a run of two or more, by parameter.
    #[test]
    fn runs_are_adjacent_device_adamw_ops_of_one_kind() {
        let (g, ops) = graph();
        let compute = vec![
            kernel(ops[0], 0),
            kernel(ops[1], 0),
            Instr::Record { event: EventId(0) },
            kernel(ops[2], 0),
            kernel(ops[3], 0),
            kernel(ops[4], 0),
            kernel(ops[5], 256),
            kernel(ops[6], 256),
            kernel(ops[7], 320),
        ];
        let host = vec![kernel(ops[0], 0), kernel(ops[1], 0)];
        let s = schedule(
            g,
            vec![
                (StreamKind::Compute, compute),
                (StreamKind::HostOptimizer, host),
            ],
        );
        let runs: Vec<Range<usize>> = adamw_runs(&s).into_iter().map(|r| r.instrs).collect();
        assert_eq!(runs, vec![0..2, 3..5, 5..6, 6..8, 8..9]);
        assert!(adamw_runs(&s).iter().all(|r| r.stream == StreamId(0)));
        #[cfg(feature = "cuda")]
        {
            let params: Vec<_> = ops.iter().map(|&o| s.graph.op(o).inputs[0]).collect();
            let slots = run_slots(&s);
            for (p, index) in [(0, 0), (1, 1), (2, 0), (3, 1), (5, 0), (6, 1)] {
                assert_eq!(slots[&params[p]], RunSlot { index, len: 2 }, "param {p}");
            }
            for p in [4, 7] {
                assert!(
                    !slots.contains_key(&params[p]),
                    "a run of one is launched alone"
                );
            }
        }
    }
}
