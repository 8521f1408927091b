//! The movement invariants of a graph (see [`crate::op::Movement`]), checked by
//! [`verify_graph`](crate::verify::verify_graph) in program order (the order of the ops):
//!
//! - a copy in flight is read only by its done: every output of a [`OpKind::MoveStart`] is
//!   read by exactly one op, a [`OpKind::MoveDone`] of the same movement that reads exactly
//!   the start's outputs, in order;
//! - a chunk slot holds one chunk at a time: a gather into a slot starts only when the slot is
//!   free (empty, or released by its previous chunk), and a [`OpKind::Release`] names the
//!   chunk and slot of the gather whose copies it reads, all of them, in order, once;
//! - nothing reads a released copy: no op after a release reads the copies it released.

use crate::error::{IrError, Result};
use crate::graph::Graph;
use crate::ids::{ChunkId, OpId, ValueId};
use crate::op::{Movement, OpKind};
use std::collections::HashMap;

/// Checks the invariants in the module doc; the error names the op that breaks one.
pub fn verify_movement(graph: &Graph) -> Result<()> {
    let bad = |op: OpId, msg: String| {
        Err(IrError::Invalid(format!(
            "{op} ({}): {msg}",
            graph.op(op).kind.mnemonic()
        )))
    };
    // The op that started each copy in flight, and the gather that wrote each slot's copies.
    let mut in_flight: HashMap<ValueId, OpId> = HashMap::new();
    let mut gathered: HashMap<ValueId, OpId> = HashMap::new();
    let mut released: HashMap<ValueId, OpId> = HashMap::new();
    // Each slot's tenant: the chunk and the gather's start.
    let mut slots: HashMap<u32, (ChunkId, OpId)> = HashMap::new();
    for (id, op) in graph.ops() {
        for &v in &op.inputs {
            if let Some(&release) = released.get(&v) {
                return bad(
                    id,
                    format!(
                        "reads {} after {release} released it from its slot",
                        graph.value(v).name
                    ),
                );
            }
        }
        let done_of = matches!(op.kind, OpKind::MoveDone(_));
        for &v in &op.inputs {
            if let (Some(&start), false) = (in_flight.get(&v), done_of) {
                return bad(
                    id,
                    format!(
                        "reads {}, a copy {start} has in flight: only its done may read it",
                        graph.value(v).name
                    ),
                );
            }
        }
        match op.kind {
            OpKind::MoveStart(m) => {
                if let Movement::Gather { chunk, slot } = m {
                    if let Some(&(tenant, start)) = slots.get(&slot) {
                        return bad(
                            id,
                            format!(
                                "gathers chunk{} into slot{slot}, which chunk{} (gathered by \
                                 {start}) has not released",
                                chunk.0, tenant.0
                            ),
                        );
                    }
                    slots.insert(slot, (chunk, id));
                }
                for &v in &op.outputs {
                    in_flight.insert(v, id);
                }
            }
            OpKind::MoveDone(m) => {
                let start = op.inputs.first().and_then(|v| in_flight.get(v)).copied();
                let Some(start) = start else {
                    return bad(id, "reads no copy in flight".into());
                };
                let started = graph.op(start);
                if started.kind != OpKind::MoveStart(m) || started.outputs != op.inputs {
                    return bad(
                        id,
                        format!(
                            "does not complete {start} ({}): a done reads exactly its start's \
                             outputs, with the same movement",
                            started.kind.mnemonic()
                        ),
                    );
                }
                for v in &op.inputs {
                    in_flight.remove(v);
                }
                if let Movement::Gather { .. } = m {
                    for &v in &op.outputs {
                        gathered.insert(v, id);
                    }
                }
            }
            OpKind::Release { chunk, slot } => {
                let gather = op.inputs.first().and_then(|v| gathered.get(v)).copied();
                let Some(gather) = gather else {
                    return bad(id, "reads no gathered copy".into());
                };
                let g = graph.op(gather);
                let names_it = g.kind == OpKind::MoveDone(Movement::Gather { chunk, slot });
                if !names_it || g.outputs != op.inputs {
                    return bad(
                        id,
                        format!(
                            "releases chunk{} from slot{slot}, but reads the copies of {gather} \
                             ({} {}): a release reads all of its gather's copies, and names \
                             its chunk and slot",
                            chunk.0,
                            g.kind.mnemonic(),
                            g.kind
                                .attributes()
                                .iter()
                                .map(|(k, v)| format!("{k}={v}"))
                                .collect::<Vec<_>>()
                                .join(" ")
                        ),
                    );
                }
                if slots.get(&slot).map(|&(c, _)| c) != Some(chunk) {
                    return bad(
                        id,
                        format!("releases slot{slot}, which chunk{} does not hold", chunk.0),
                    );
                }
                slots.remove(&slot);
                for &v in &op.inputs {
                    gathered.remove(&v);
                    released.insert(v, id);
                }
            }
            _ => {}
        }
    }
    if let Some((_, &start)) = in_flight.iter().min_by_key(|(_, &s)| s) {
        return bad(start, "starts a copy that no done completes".into());
    }
    Ok(())
}
