//! Communication costs: what a collective among the ranks of a data-parallel run costs on a
//! hardware profile's [`Interconnect`].
//!
//! Inside a node the collectives are rings, as NCCL runs them: an all-gather or a
//! reduce-scatter of `S` bytes over `G` GPUs moves `(G - 1) / G * S` bytes through each GPU's
//! link in `G - 1` steps (the bound of Thakur, Rabenseifner and Gropp, "Optimization of
//! collective communication operations in MPICH", 2005), and an all-reduce is a
//! reduce-scatter followed by an all-gather. Across `M` nodes they are hierarchical: a ring
//! inside each node over the whole buffer, then a ring across the nodes in which each of a
//! node's `G` GPUs carries its `S / G` share over its share of the node's network, which costs
//! `(M - 1) / M * S` bytes over the node's network bandwidth.

use crate::error::{CompileError, Result};
use protrain_ir::{HardwareProfile, Interconnect};

/// A collective the schedule issues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CollectiveKind {
    /// Every rank's shard into every rank's whole buffer (parameters before use).
    AllGather,
    /// A sum over ranks, each rank keeping its shard (gradients after the backward pass).
    ReduceScatter,
    /// A sum over ranks that every rank keeps (partial norms, whole persistent chunks).
    AllReduce,
}

/// The ranks of a run: `gpus` per node on `nodes` nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Topology {
    /// GPUs per node (`--gpus`).
    pub gpus: u32,
    /// Nodes (`--nodes`).
    pub nodes: u32,
}

impl Topology {
    /// One GPU.
    pub const SINGLE: Topology = Topology { gpus: 1, nodes: 1 };

    /// The number of ranks.
    pub fn ranks(&self) -> u32 {
        self.gpus * self.nodes
    }

    /// The interconnect this topology runs on, checked against the profile: `None` for one
    /// rank. Fails when the profile has no interconnect figures, a node is asked for more GPUs
    /// than it has, or a count is zero.
    pub fn interconnect(&self, hardware: &HardwareProfile) -> Result<Option<Interconnect>> {
        let bad = |why: String| Err(CompileError::BadTopology(why));
        if self.gpus == 0 || self.nodes == 0 {
            return Err(CompileError::NoRanks {
                gpus: self.gpus,
                nodes: self.nodes,
            });
        }
        if self.ranks() == 1 {
            return Ok(None);
        }
        let Some(link) = hardware.interconnect else {
            return bad(format!(
                "the hardware profile {} says nothing of how its GPUs are linked, so it runs on \
                 one GPU only; use a preset that does ({}) or add an \"interconnect\" to the \
                 profile",
                hardware.name,
                linked_presets().join(", ")
            ));
        };
        if self.gpus > link.gpus_per_node {
            return Err(CompileError::TooManyGpus {
                gpus: self.gpus,
                per_node: link.gpus_per_node,
                hardware: hardware.name.clone(),
            });
        }
        Ok(Some(link))
    }
}

/// The presets that have interconnect figures.
fn linked_presets() -> Vec<&'static str> {
    HardwareProfile::presets()
        .iter()
        .copied()
        .filter(|name| HardwareProfile::preset(name).is_some_and(|p| p.interconnect.is_some()))
        .collect()
}

/// Seconds one ring collective over `bytes` (the whole buffer: the gathered chunk, or the
/// buffer summed) takes among `topology`'s ranks on `link`; 0 for one rank.
pub fn collective_seconds(
    kind: CollectiveKind,
    bytes: u64,
    topology: Topology,
    link: &Interconnect,
) -> f64 {
    let bytes = bytes as f64;
    let one_way = |ranks: u32, bandwidth: f64| -> f64 {
        match ranks {
            0 | 1 => 0.0,
            n => {
                let n = f64::from(n);
                (n - 1.0) / n * bytes / bandwidth + (n - 1.0) * link.step_latency_s
            }
        }
    };
    let pass = one_way(topology.gpus, link.intra_node_bandwidth)
        + one_way(topology.nodes, link.inter_node_bandwidth);
    match kind {
        CollectiveKind::AllGather | CollectiveKind::ReduceScatter => pass,
        CollectiveKind::AllReduce => 2.0 * pass,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(name: &str) -> Interconnect {
        HardwareProfile::preset(name)
            .and_then(|p| p.interconnect)
            .expect("a linked preset")
    }

    #[test]
    fn one_rank_communicates_nothing() {
        let h200 = link("h200");
        for kind in [
            CollectiveKind::AllGather,
            CollectiveKind::ReduceScatter,
            CollectiveKind::AllReduce,
        ] {
            assert_eq!(
                collective_seconds(kind, 1 << 30, Topology::SINGLE, &h200),
                0.0
            );
        }
    }

    #[test]
    fn a_ring_moves_its_share_of_the_buffer_through_each_link() {
        // 8 H200s on NVLink 4 (360 GB/s bus bandwidth): 7/8 of 1 GB, plus 7 hops of 5 us.
        let t = collective_seconds(
            CollectiveKind::AllGather,
            1_000_000_000,
            Topology { gpus: 8, nodes: 1 },
            &link("h200"),
        );
        let expected = 7.0 / 8.0 * 1e9 / 360e9 + 7.0 * 5e-6;
        assert!((t - expected).abs() < 1e-12, "{t} vs {expected}");
        // An all-reduce is a reduce-scatter then an all-gather.
        let reduce = collective_seconds(
            CollectiveKind::AllReduce,
            1_000_000_000,
            Topology { gpus: 8, nodes: 1 },
            &link("h200"),
        );
        assert!((reduce - 2.0 * expected).abs() < 1e-12);
    }

    #[test]
    fn crossing_nodes_adds_the_network_and_pcie_boxes_are_slower_than_nvlink() {
        let gib = 1u64 << 30;
        let a100 = link("a100-80gb");
        let one_node = Topology { gpus: 8, nodes: 1 };
        let four_nodes = Topology { gpus: 8, nodes: 4 };
        let inside = collective_seconds(CollectiveKind::ReduceScatter, gib, one_node, &a100);
        let across = collective_seconds(CollectiveKind::ReduceScatter, gib, four_nodes, &a100);
        let network = 3.0 / 4.0 * gib as f64 / a100.inter_node_bandwidth + 3.0 * 5e-6;
        assert!((across - inside - network).abs() < 1e-12);
        let pcie = collective_seconds(
            CollectiveKind::AllGather,
            gib,
            Topology { gpus: 4, nodes: 1 },
            &link("rtx3090"),
        );
        let nvlink = collective_seconds(
            CollectiveKind::AllGather,
            gib,
            Topology { gpus: 4, nodes: 1 },
            &a100,
        );
        assert!(pcie > 10.0 * nvlink, "{pcie} vs {nvlink}");
    }

    #[test]
    fn topologies_the_hardware_cannot_hold_are_refused_with_the_way_out() {
        let rtx = HardwareProfile::preset("rtx3090").unwrap();
        let err = Topology { gpus: 8, nodes: 1 }
            .interconnect(&rtx)
            .unwrap_err();
        assert!(
            matches!(&err, CompileError::TooManyGpus { gpus: 8, per_node: 4, hardware }
                if hardware == "rtx3090"),
            "{err}"
        );
        let host = HardwareProfile::preset("host").unwrap();
        let err = Topology { gpus: 2, nodes: 1 }
            .interconnect(&host)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("h200") && err.contains("interconnect"),
            "{err}"
        );
        let err = Topology { gpus: 0, nodes: 1 }
            .interconnect(&rtx)
            .unwrap_err();
        assert!(
            matches!(err, CompileError::NoRanks { gpus: 0, nodes: 1 }),
            "{err}"
        );
        assert_eq!(Topology::SINGLE.interconnect(&host).unwrap(), None);
        assert!(Topology { gpus: 4, nodes: 2 }
            .interconnect(&rtx)
            .unwrap()
            .is_some());
    }
}
