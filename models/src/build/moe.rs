//! A mixture-of-experts MLP (Mixtral's `block_sparse_moe`, Qwen3-MoE's sparse `mlp`): the
//! router linear, top-k routing, dispatch into the packed buffer, the SwiGLU experts as
//! grouped matmuls, and the weighted combine.
//!
//! Each expert's three weights are parameters of their own, with the Hub checkpoints'
//! per-expert names, so each is a chunk member like any other weight and the offloading
//! machinery handles experts unchanged.

use super::{AuxLoss, Builder, Linear, Weight};
use crate::config::MoeLayout;
use crate::error::Result;
use protrain_ir::{BlockId, OpKind, Role, ValueId, WeightLayout};

/// How a family names a sparse block and its experts' projections.
#[derive(Clone, Copy)]
pub(super) struct Names {
    /// The block, under `model.layers.{i}`.
    block: &'static str,
    /// The gate, up and down projections of one expert.
    gate: &'static str,
    up: &'static str,
    down: &'static str,
}

impl Names {
    /// Mixtral's Hub names: `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down).
    pub(super) const MIXTRAL: Names = Names {
        block: "block_sparse_moe",
        gate: "w1",
        up: "w3",
        down: "w2",
    };
    /// Qwen3-MoE's: `mlp.experts.{e}.gate_proj`, `up_proj`, `down_proj`.
    pub(super) const QWEN: Names = Names {
        block: "mlp",
        gate: "gate_proj",
        up: "up_proj",
        down: "down_proj",
    };
}

/// A sparse block's parameters and routing settings.
pub(super) struct Experts {
    router: Linear,
    /// Every expert's gate, then every expert's up, then every expert's down weight.
    gate: Vec<ValueId>,
    up: Vec<ValueId>,
    down: Vec<ValueId>,
    top_k: u64,
    normalize: bool,
}

/// Declares `{prefix}.{block}.gate.weight` (`[E, C]`) and then each expert's gate, up and
/// down weights (`[I, C]`, `[I, C]`, `[C, I]`), in the order the Hub's per-expert modules list
/// them.
pub(super) fn expert_params(
    b: &mut Builder,
    prefix: &str,
    names: Names,
    c: u64,
    moe: &MoeLayout,
    block: BlockId,
) -> Experts {
    let p = format!("{prefix}.{}", names.block);
    let router = b.linear_params(
        &format!("{p}.gate"),
        c,
        moe.experts,
        false,
        WeightLayout::OutIn,
        block,
    );
    let inner = moe.expert_intermediate_size;
    let (mut gate, mut up, mut down) = (Vec::new(), Vec::new(), Vec::new());
    for e in 0..moe.experts {
        let mut param = |name: &str, shape: &[u64]| -> Weight {
            b.param(format!("{p}.experts.{e}.{name}.weight"), shape, block)
        };
        // Hub order: Mixtral's w1, w2, w3; Qwen's gate_proj, up_proj, down_proj.
        let (g, u, d) = if names.gate == "w1" {
            let g = param(names.gate, &[inner, c]);
            let d = param(names.down, &[c, inner]);
            let u = param(names.up, &[inner, c]);
            (g, u, d)
        } else {
            let g = param(names.gate, &[inner, c]);
            let u = param(names.up, &[inner, c]);
            let d = param(names.down, &[c, inner]);
            (g, u, d)
        };
        gate.push(g.value);
        up.push(u.value);
        down.push(d.value);
    }
    Experts {
        router,
        gate,
        up,
        down,
        top_k: moe.top_k,
        normalize: moe.normalize,
    }
}

/// Arms the load-balancing loss when `moe` has one: each sparse block then hands its router
/// logits to the head, which adds the loss to the cross-entropy.
pub(super) fn start_aux_loss(b: &mut Builder, moe: &MoeLayout) {
    b.aux_loss = moe.aux_loss_coef.map(|coef| AuxLoss {
        logits: Vec::new(),
        experts: moe.experts,
        top_k: moe.top_k,
        coef,
    });
}

/// Emits the sparse block on the normalised stream `h` (`[B,T,C]`); returns its output.
pub(super) fn forward(
    b: &mut Builder,
    experts: &Experts,
    h: ValueId,
    name: &str,
) -> Result<ValueId> {
    let n = |what: &str| format!("{name}.{what}");
    let count = experts.gate.len() as u64;
    let logits = b.linear(h, &experts.router, n("router"))?;
    if let Some(aux) = &mut b.aux_loss {
        aux.logits.push(logits);
    }
    let block = b.block.ok_or_else(|| {
        crate::error::ModelError::InvalidOptions(
            "internal error: a sparse block was emitted outside any layer".into(),
        )
    })?;
    let labels = ["weights", "experts", "rows", "slots", "offsets"];
    let outputs: Vec<(String, Role)> = labels
        .iter()
        .map(|l| (n(&format!("route.{l}")), Role::Activation))
        .collect();
    let routed = b.graph.add_op_multi(
        OpKind::MoeRoute {
            experts: count,
            top_k: experts.top_k,
            normalize: experts.normalize,
        },
        &[logits],
        &outputs,
        block,
        protrain_ir::Phase::Forward,
    )?;
    let [weights, _, rows, slots, offsets] = routed[..] else {
        unreachable!("moe_route writes five outputs")
    };
    let top_k = experts.top_k;
    let xs = b.op(
        OpKind::MoeDispatch { top_k },
        &[h, rows, slots],
        n("dispatch"),
    )?;
    let grouped = |b: &mut Builder, x: ValueId, weights: &[ValueId], what: &str| {
        let mut inputs = vec![x, offsets];
        inputs.extend(weights);
        b.op(OpKind::GroupedLinear { experts: count }, &inputs, n(what))
    };
    let gate = grouped(b, xs, &experts.gate, "experts.gate")?;
    let up = grouped(b, xs, &experts.up, "experts.up")?;
    let act = b.op(OpKind::Swiglu, &[gate, up], n("experts.act"))?;
    let ys = grouped(b, act, &experts.down, "experts.down")?;
    b.op(
        OpKind::MoeCombine { top_k },
        &[ys, weights, slots],
        n("combine"),
    )
}
