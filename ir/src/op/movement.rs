//! Movement between memories: the op kinds placement inserts into the training graph, so that
//! where every tensor is, and when it moves, is part of the dataflow.
//!
//! Every copy is a pair of ops, as XLA's `copy-start` / `copy-done`: [`OpKind::MoveStart`]
//! is its issue point and [`OpKind::MoveDone`] its completion. Both map each input to an
//! output of the same type: the start's outputs are the copies in flight, the done's the
//! copies a reader may use; so `done(start(x))` is `x` wherever it now lives, an identity the
//! translation validator proves placement by. Between the two, the copy overlaps whatever the
//! program runs. A start is placed where the copy may begin (its source is written, its
//! destination free); a done where the copy must have finished (before its first reader, or
//! before its source's memory is reused). [`OpKind::Release`] ends a chunk slot's tenancy: no
//! op reads the gathered copies after it, and the slot may take the next chunk.
//!
//! New kinds of movement (disk reads and writes, all-gather and reduce-scatter across ranks)
//! are more [`Movement`] variants with the same pairing, not a new mechanism.

use super::*;
use crate::ids::ChunkId;

/// What a movement pair copies, and between which memories.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Movement {
    /// A parameter chunk from its host home into a device chunk slot (host to device). Reads
    /// the chunk's parameters; writes their copies in the slot, in member order.
    Gather {
        /// The chunk.
        chunk: ChunkId,
        /// The device slot it is copied into.
        slot: u32,
    },
    /// A streamed chunk's gradients from its device gradient chunk to the host (device to
    /// host), for the host optimizer. Reads the chunk's gradients, in member order.
    OffloadGrads {
        /// The chunk.
        chunk: ChunkId,
    },
    /// An activation of a swapped block to the host after the forward pass reads it.
    Offload,
    /// A swapped activation back to the device for the backward pass.
    Reload,
    /// A scalar the host optimizer reads (the clip coefficient), to the host.
    ToHost,
}

impl Movement {
    /// The mnemonics of the start and the done.
    pub fn mnemonics(self) -> (&'static str, &'static str) {
        match self {
            Movement::Gather { .. } => ("prefetch", "gather"),
            Movement::OffloadGrads { .. } => ("offload_grads_start", "offload_grads"),
            Movement::Offload => ("offload_start", "offload"),
            Movement::Reload => ("reload_start", "reload"),
            Movement::ToHost => ("to_host_start", "to_host"),
        }
    }

    /// Whether the copy goes from the host to the device (else from the device to the host).
    pub fn to_device(self) -> bool {
        matches!(self, Movement::Gather { .. } | Movement::Reload)
    }

    /// The chunk it moves, for chunk movements.
    pub fn chunk(self) -> Option<ChunkId> {
        match self {
            Movement::Gather { chunk, .. } | Movement::OffloadGrads { chunk } => Some(chunk),
            Movement::Offload | Movement::Reload | Movement::ToHost => None,
        }
    }

    /// How many tensors one copy moves: `None` for a chunk (its members), else one.
    pub fn arity(self) -> Option<usize> {
        match self.chunk() {
            Some(_) => None,
            None => Some(1),
        }
    }

    /// The printed operands after the mnemonic: `chunk3 -> slot1`, `chunk3`, or nothing.
    pub fn operands(self) -> String {
        match self {
            Movement::Gather { chunk, slot } => format!("chunk{} -> slot{slot}", chunk.0),
            Movement::OffloadGrads { chunk } => format!("chunk{}", chunk.0),
            Movement::Offload | Movement::Reload | Movement::ToHost => String::new(),
        }
    }

    /// Attributes as `key=value` pairs, for the printers that list them.
    pub fn attributes(self) -> Vec<(&'static str, String)> {
        match self {
            Movement::Gather { chunk, slot } => {
                vec![("chunk", chunk.0.to_string()), ("slot", slot.to_string())]
            }
            Movement::OffloadGrads { chunk } => vec![("chunk", chunk.0.to_string())],
            Movement::Offload | Movement::Reload | Movement::ToHost => Vec::new(),
        }
    }
}

impl OpKind {
    /// Whether the op moves data between memories (or releases a slot) rather than computing.
    pub fn is_movement(&self) -> bool {
        matches!(
            self,
            OpKind::MoveStart(_) | OpKind::MoveDone(_) | OpKind::Release { .. }
        )
    }

    /// The type rule of a movement op: a start or a done writes one output of each input's
    /// type; a release writes nothing.
    pub(super) fn infer_movement(&self, inputs: &[&TensorType]) -> Result<Vec<TensorType>> {
        Ok(match self {
            OpKind::MoveStart(_) | OpKind::MoveDone(_) => {
                inputs.iter().map(|&t| t.clone()).collect()
            }
            _ => Vec::new(),
        })
    }
}
