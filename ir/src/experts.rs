//! Where a schedule keeps its experts' weights: the parameters grouped matmuls read, by the
//! chunks that hold them (persistent on the device, or streamed from host memory).

use crate::op::OpKind;
use crate::schedule::Schedule;
use std::collections::BTreeSet;

/// The bytes of a mixture-of-experts schedule's expert weights, by where their chunks live.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ExpertPlacement {
    /// Expert weight tensors (three per expert per sparse layer).
    pub tensors: u64,
    /// Chunks holding at least one of them.
    pub chunks: u64,
    /// Their bytes in chunks that stay on the device all step.
    pub persistent_bytes: u64,
    /// Their bytes in chunks that live in host memory and are fetched before use.
    pub streamed_bytes: u64,
}

impl Schedule {
    /// Where the expert weights (every weight a grouped matmul reads) live; `None` for a
    /// schedule without experts. A chunk is persistent when its index is below the policy's
    /// `n_persist`.
    pub fn expert_placement(&self) -> Option<ExpertPlacement> {
        let experts: BTreeSet<_> = self
            .graph
            .ops()
            .filter(|(_, op)| matches!(op.kind, OpKind::GroupedLinear { .. }))
            .flat_map(|(_, op)| op.inputs[2..].iter().copied())
            .collect();
        if experts.is_empty() {
            return None;
        }
        let mut placement = ExpertPlacement::default();
        let mut chunks = BTreeSet::new();
        for (id, param) in self.graph.params() {
            if !experts.contains(&param.value) {
                continue;
            }
            let (chunk, _) = self.chunks.locate(id);
            chunks.insert(chunk);
            let bytes = self.graph.value(param.value).ty.bytes();
            placement.tensors += 1;
            if chunk.0 < self.header.policy.n_persist {
                placement.persistent_bytes += bytes;
            } else {
                placement.streamed_bytes += bytes;
            }
        }
        placement.chunks = chunks.len() as u64;
        Some(placement)
    }
}
