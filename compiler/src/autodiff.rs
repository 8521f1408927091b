//! Reverse-mode differentiation: derives the backward pass and the optimizer from a forward
//! graph.
//!
//! Each forward op kind declares, in [`vjp_rule`], which forward values its backward op reads
//! (what the forward pass must keep alive, and so what activation memory is) and which forward
//! inputs receive gradients. The pass walks the forward ops in reverse, emits one backward op
//! per forward op that reaches the loss, and sums the gradient contributions a value receives
//! from several readers (residual streams, tied embeddings) with `add` ops, in a fixed order, as
//! soon as the last contribution exists. It then appends the optimizer: optional global
//! gradient-norm clipping and one AdamW op per parameter that has a gradient.
//!
//! A forward graph whose parameters are f16 is trained with dynamic loss scaling (f16's range
//! is too narrow for small gradients): the loss gradient is the loss scale
//! ([`OpKind::CrossEntropyBackwardLossScaled`]), and every AdamW reads one coefficient that
//! unscales (and clips) the gradients or, when one overflowed, skips the step
//! ([`OpKind::UnscaleCoef`]). The scale itself is the runtime's (GradScaler's rules).
//!
//! It does not decide placement, recomputation or the order the backward ops run in beyond
//! the reverse of the forward order: those are later passes.

use crate::error::{CompileError, Result};
use protrain_ir::{
    DType, Epilogue, Graph, OpId, OpKind, Phase, QkvLayout, Role, ValueId, LOSS_SCALE_INIT,
};
use std::collections::HashMap;

/// AdamW settings, as `torch.optim.AdamW` takes them, and optional gradient clipping as
/// `torch.nn.utils.clip_grad_norm_` does it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OptimizerConfig {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the root of the second moment.
    pub eps: f64,
    /// Decoupled weight decay, applied to every parameter.
    pub weight_decay: f64,
    /// The largest global gradient norm; gradients are scaled down to it when larger.
    pub grad_clip: Option<f64>,
}

impl Default for OptimizerConfig {
    /// PyTorch's AdamW defaults, without clipping.
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            grad_clip: None,
        }
    }
}

impl OptimizerConfig {
    /// Checks every setting is in the range AdamW accepts.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(CompileError::BadOptimizer(m));
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad(format!(
                "learning rate {} must be a finite number >= 0",
                self.lr
            ));
        }
        for (name, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return bad(format!("{name} {b} must be in [0, 1)"));
            }
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return bad(format!("eps {} must be a finite number >= 0", self.eps));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(format!(
                "weight decay {} must be a finite number >= 0",
                self.weight_decay
            ));
        }
        if let Some(c) = self.grad_clip {
            if !(c.is_finite() && c > 0.0) {
                return bad(format!("gradient clip {c} must be a finite number > 0"));
            }
        }
        Ok(())
    }
}

/// A forward value a backward op reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Saved {
    /// The forward op's `i`-th input.
    Input(usize),
    /// The forward op's `i`-th output.
    Output(usize),
}

/// How one forward op kind is differentiated.
#[derive(Clone, Debug, PartialEq)]
pub struct VjpRule {
    /// The backward kind; `None` when the gradient passes through unchanged (`add`).
    pub backward: Option<OpKind>,
    /// Forward values the backward op reads, before the output gradients.
    pub saves: Vec<Saved>,
    /// The forward outputs whose gradients the backward op reads, in order, after the saved
    /// values (none for the loss op: its gradient is 1).
    pub output_grads: Vec<usize>,
    /// For each backward output, the forward input it is the gradient of.
    pub grads_of: Vec<usize>,
    /// Forward inputs whose gradient is the (one) output gradient unchanged: both of `add`'s,
    /// a fused residual.
    pub passes: Vec<usize>,
}

/// The vector-Jacobian product of a forward op kind, given its input types' leading shapes
/// where the backward kind needs them (table rows). Backward and optimizer kinds have none.
pub fn vjp_rule(kind: &OpKind, input_rows: &[u64]) -> Option<VjpRule> {
    use Saved::{Input, Output};
    let rule = |backward: OpKind, saves: Vec<Saved>, grads_of: Vec<usize>| VjpRule {
        backward: Some(backward),
        saves,
        output_grads: vec![0],
        grads_of,
        passes: vec![],
    };
    Some(match kind.clone() {
        OpKind::Embedding { padding_idx } => rule(
            OpKind::EmbeddingBackward {
                rows: input_rows[1],
                padding_idx,
            },
            vec![Input(0)],
            vec![1],
        ),
        OpKind::PositionEmbedding { offset } => rule(
            OpKind::PositionEmbeddingBackward {
                rows: input_rows[1],
                offset,
            },
            vec![Input(0)],
            vec![1],
        ),
        OpKind::LayerNorm { eps } => rule(
            OpKind::LayerNormBackward { eps },
            vec![Input(0), Input(1)],
            vec![0, 1, 2],
        ),
        OpKind::RmsNorm {
            eps,
            head_dim,
            unit_offset,
        } => rule(
            OpKind::RmsNormBackward {
                eps,
                head_dim,
                unit_offset,
            },
            vec![Input(0), Input(1)],
            vec![0, 1],
        ),
        OpKind::Linear { bias, layout } => rule(
            OpKind::LinearBackward { bias, layout },
            vec![Input(0), Input(1)],
            if bias { vec![0, 1, 2] } else { vec![0, 1] },
        ),
        OpKind::Gelu => rule(OpKind::GeluBackward, vec![Input(0)], vec![0]),
        OpKind::Relu => rule(OpKind::ReluBackward, vec![Input(0)], vec![0]),
        OpKind::Silu => rule(OpKind::SiluBackward, vec![Input(0)], vec![0]),
        OpKind::Swiglu => rule(OpKind::SwigluBackward, vec![Input(0), Input(1)], vec![0, 1]),
        OpKind::Geglu => rule(OpKind::GegluBackward, vec![Input(0), Input(1)], vec![0, 1]),
        // From the output: the loss that reads the capped logits keeps them alive anyway.
        OpKind::Softcap { cap } => rule(OpKind::SoftcapBackward { cap }, vec![Output(0)], vec![0]),
        // Linear: the gradient is the output gradient scaled by the same factor.
        OpKind::Scale { factor } => rule(OpKind::Scale { factor }, vec![], vec![0]),
        OpKind::Add => VjpRule {
            backward: None,
            saves: vec![],
            output_grads: vec![0],
            grads_of: vec![],
            passes: vec![0, 1],
        },
        OpKind::Rope {
            head_dim,
            theta,
            scaling,
        } => rule(
            OpKind::RopeBackward {
                head_dim,
                theta,
                scaling,
            },
            vec![],
            vec![0],
        ),
        OpKind::PartialRope {
            head_dim,
            rotary_dim,
            heads,
            theta,
            scaling,
        } => rule(
            OpKind::PartialRopeBackward {
                head_dim,
                rotary_dim,
                heads,
                theta,
                scaling,
            },
            vec![],
            vec![0],
        ),
        OpKind::PackedSwiglu => rule(OpKind::PackedSwigluBackward, vec![Input(0)], vec![0]),
        OpKind::Attention {
            heads,
            kv_heads,
            head_dim,
            window,
            qkv,
            scale,
            softcap,
        } => {
            let backward = OpKind::AttentionBackward {
                heads,
                kv_heads,
                head_dim,
                window,
                qkv,
                scale,
                softcap,
            };
            match qkv {
                QkvLayout::Separate => rule(
                    backward,
                    vec![Input(0), Input(1), Input(2), Output(0), Output(1)],
                    vec![0, 1, 2],
                ),
                QkvLayout::Packed => rule(backward, vec![Input(0), Output(0), Output(1)], vec![0]),
            }
        }
        OpKind::CrossEntropy => VjpRule {
            backward: Some(OpKind::CrossEntropyBackward),
            saves: vec![Input(0), Input(1), Output(1)],
            output_grads: vec![],
            grads_of: vec![0],
            passes: vec![],
        },
        OpKind::FusedLinear {
            count,
            bias,
            layout,
            epilogue,
        } => {
            let n = count as usize;
            let kept = epilogue.has_output() && epilogue.keeps_projections();
            let mut saves: Vec<Saved> = (0..=n).map(Input).collect();
            if kept {
                saves.extend((0..n).map(Output));
            }
            let output_grads = match epilogue {
                Epilogue::None => (0..n).collect(),
                _ if kept => vec![n],
                _ => vec![0],
            };
            let weights_and_biases = n * (1 + usize::from(bias));
            VjpRule {
                backward: Some(OpKind::FusedLinearBackward {
                    count,
                    bias,
                    layout,
                    epilogue,
                }),
                saves,
                output_grads,
                grads_of: (0..=weights_and_biases).collect(),
                passes: if epilogue == Epilogue::Residual {
                    vec![1 + weights_and_biases]
                } else {
                    vec![]
                },
            }
        }
        // Mixture of experts: the gradient reaches the logits through the chosen weights only.
        OpKind::MoeRoute {
            experts,
            top_k,
            normalize,
        } => rule(
            OpKind::MoeRouteBackward {
                experts,
                top_k,
                normalize,
            },
            vec![Input(0), Output(1)],
            vec![0],
        ),
        OpKind::MoeDispatch { top_k } => rule(
            OpKind::MoeDispatchBackward { top_k },
            vec![Input(2)],
            vec![0],
        ),
        OpKind::GroupedLinear { experts } => {
            let e = experts as usize;
            rule(
                OpKind::GroupedLinearBackward { experts },
                (0..2 + e).map(Input).collect(),
                std::iter::once(0).chain(2..2 + e).collect(),
            )
        }
        OpKind::MoeCombine { top_k } => rule(
            OpKind::MoeCombineBackward { top_k },
            vec![Input(0), Input(1), Input(2)],
            vec![0, 1],
        ),
        // A loss: its gradient is the seed, as the cross-entropy's is. The cross-entropy input
        // is not differentiated here: the cross-entropy backward seeds itself.
        OpKind::MoeAuxLoss {
            experts,
            top_k,
            layers,
            coef,
        } => {
            let logits: Vec<usize> = (1..=layers as usize).collect();
            VjpRule {
                backward: Some(OpKind::MoeAuxLossBackward {
                    experts,
                    top_k,
                    layers,
                    coef,
                    micro_batches: 1,
                    loss_scale: None,
                }),
                saves: logits.iter().copied().map(Input).collect(),
                output_grads: vec![],
                grads_of: logits,
                passes: vec![],
            }
        }
        _ => return None,
    })
}

/// Gradient contributions collected for one forward value.
#[derive(Default)]
struct Pending {
    /// Contributions in the order they were made.
    parts: Vec<ValueId>,
    /// Readers whose backward ops have not been emitted yet.
    readers_left: usize,
    /// The summed gradient, once complete.
    total: Option<ValueId>,
}

/// Derives the training graph: the forward graph, then the backward pass, then the optimizer.
///
/// The loss is a graph output computed by a `cross_entropy` op, or by a `moe_aux_loss` op that
/// adds the load-balancing loss to a cross-entropy; each of the two seeds its own gradient.
///
/// Fails with [`CompileError::NoLoss`] when the forward graph has no such op whose loss is a
/// graph output.
pub fn autodiff(forward: &Graph, optimizer: &OptimizerConfig) -> Result<Graph> {
    optimizer.validate()?;
    let loss_op = forward
        .ops()
        .find(|(_, op)| {
            matches!(op.kind, OpKind::CrossEntropy | OpKind::MoeAuxLoss { .. })
                && forward.outputs().contains(&op.outputs[0])
        })
        .map(|(id, _)| id)
        .ok_or(CompileError::NoLoss)?;
    // The ops whose gradients are seeds: the loss op and, under an auxiliary loss, the
    // cross-entropy it adds to.
    let mut roots = vec![loss_op];
    if let OpKind::MoeAuxLoss { .. } = forward.op(loss_op).kind {
        let ce = forward
            .value(forward.op(loss_op).inputs[0])
            .producer
            .filter(|&p| forward.op(p).kind == OpKind::CrossEntropy)
            .ok_or(CompileError::NoLoss)?;
        roots.push(ce);
    }

    // fp16 parameters train with dynamic loss scaling (see the module doc).
    let loss_scaled = forward
        .params()
        .any(|(_, p)| forward.value(p.value).ty.dtype == DType::F16);
    let mut graph = forward.clone();
    let pending = backward(&mut graph, forward, &roots, loss_scaled)?;
    optimizer_ops(
        &mut graph,
        forward,
        &pending,
        loss_op,
        loss_scaled,
        optimizer,
    )?;
    Ok(graph)
}

/// Appends the backward pass of `forward` (whose gradients start at the ops `roots`: the loss
/// op and, under an auxiliary loss, the cross-entropy it adds to) to `graph`, a copy of it: walks the forward ops in reverse, emits each reached op's backward op, and sums each
/// value's gradient contributions once its last reader is done. Returns every value's
/// gradient state (its summed gradient in `total`, `None` where it does not reach the loss).
fn backward(
    graph: &mut Graph,
    forward: &Graph,
    roots: &[OpId],
    loss_scaled: bool,
) -> Result<HashMap<ValueId, Pending>> {
    let forward_ops: Vec<_> = forward.ops().map(|(id, op)| (id, op.clone())).collect();

    // Every float input of a differentiable op is one reader that will contribute a gradient.
    let mut pending: HashMap<ValueId, Pending> = HashMap::new();
    for (_, op) in &forward_ops {
        let rows: Vec<u64> = op
            .inputs
            .iter()
            .map(|v| forward.value(*v).ty.shape.first().copied().unwrap_or(1))
            .collect();
        if let Some(rule) = vjp_rule(&op.kind, &rows) {
            for &i in rule.grads_of.iter().chain(&rule.passes) {
                pending.entry(op.inputs[i]).or_default().readers_left += 1;
            }
        }
    }

    for (op_id, op) in forward_ops.iter().rev() {
        let rows: Vec<u64> = op
            .inputs
            .iter()
            .map(|v| forward.value(*v).ty.shape.first().copied().unwrap_or(1))
            .collect();
        let Some(rule) = vjp_rule(&op.kind, &rows) else {
            continue;
        };
        // The gradients of the outputs the backward op reads; none when the op does not reach
        // the loss. The loss op reads none and starts the pass.
        let output_grads: Vec<Option<ValueId>> = rule
            .output_grads
            .iter()
            .map(|&o| pending.get(&op.outputs[o]).and_then(|p| p.total))
            .collect();
        let reached = if rule.output_grads.is_empty() {
            roots.contains(op_id)
        } else if output_grads.iter().all(Option::is_some) {
            true
        } else if output_grads.iter().any(Option::is_some) {
            return Err(CompileError::Ir(protrain_ir::IrError::Invalid(format!(
                "{} has outputs that reach the loss and outputs that do not; only ops whose \
                 gradients are all present or all absent can be differentiated",
                op.kind.mnemonic()
            ))));
        } else {
            false
        };
        let mut contributions: Vec<(usize, ValueId)> = Vec::new();
        if reached {
            let dys: Vec<ValueId> = output_grads.into_iter().flatten().collect();
            if let Some(&dy) = dys.first() {
                contributions.extend(rule.passes.iter().map(|&i| (i, dy)));
            }
            if let Some(kind) = &rule.backward {
                let mut inputs: Vec<ValueId> = rule
                    .saves
                    .iter()
                    .map(|s| match *s {
                        Saved::Input(i) => op.inputs[i],
                        Saved::Output(i) => op.outputs[i],
                    })
                    .collect();
                inputs.extend(&dys);
                let names: Vec<(String, Role)> = rule
                    .grads_of
                    .iter()
                    .map(|&i| grad_name_and_role(graph, op.inputs[i]))
                    .collect();
                let kind = match kind {
                    OpKind::CrossEntropyBackward if loss_scaled => {
                        OpKind::CrossEntropyBackwardLossScaled {
                            micro_batches: 1,
                            loss_scale: LOSS_SCALE_INIT,
                        }
                    }
                    OpKind::MoeAuxLossBackward {
                        experts,
                        top_k,
                        layers,
                        coef,
                        micro_batches,
                        ..
                    } if loss_scaled => OpKind::MoeAuxLossBackward {
                        experts: *experts,
                        top_k: *top_k,
                        layers: *layers,
                        coef: *coef,
                        micro_batches: *micro_batches,
                        loss_scale: Some(LOSS_SCALE_INIT),
                    },
                    kind => kind.clone(),
                };
                let outs = graph.add_op_multi(kind, &inputs, &names, op.block, Phase::Backward)?;
                contributions.extend(rule.grads_of.iter().copied().zip(outs));
            }
        }
        // Readers are counted whether or not this op reached the loss, so a value's sum is
        // emitted exactly when its last reader is done.
        for &i in rule.grads_of.iter().chain(&rule.passes) {
            let value = op.inputs[i];
            let part = contributions.iter().find(|(j, _)| *j == i).map(|(_, g)| *g);
            let entry = pending.get_mut(&value).expect("every reader was counted");
            if let Some(part) = part {
                entry.parts.push(part);
            }
            entry.readers_left -= 1;
            if entry.readers_left == 0 {
                let parts = std::mem::take(&mut entry.parts);
                let total = sum_parts(graph, value, &parts, op.block)?;
                pending.get_mut(&value).expect("present").total = total;
            }
        }
    }

    Ok(pending)
}

/// Appends the optimizer to `graph`: for every parameter with a gradient in `pending`, in
/// declaration order, its clipping or unscaling norm (when `optimizer` clips or the graph is
/// `loss_scaled`), then one coefficient, then its AdamW update with fresh moment states.
fn optimizer_ops(
    graph: &mut Graph,
    forward: &Graph,
    pending: &HashMap<ValueId, Pending>,
    loss_op: OpId,
    loss_scaled: bool,
    optimizer: &OptimizerConfig,
) -> Result<()> {
    // The optimizer: parameters in declaration order.
    let params: Vec<(String, ValueId, protrain_ir::BlockId)> = graph
        .params()
        .map(|(_, p)| (p.name.clone(), p.value, p.block))
        .collect();
    let with_grads: Vec<(String, ValueId, ValueId, protrain_ir::BlockId)> = params
        .into_iter()
        .filter_map(|(name, value, block)| {
            pending
                .get(&value)
                .and_then(|p| p.total)
                .map(|g| (name, value, g, block))
        })
        .collect();
    // Clipping: one squared norm per gradient, computed where the gradient is complete, then
    // one coefficient from all of them in parameter order.
    // With loss scaling the coefficient always exists: it unscales, and skips an overflowed
    // step.
    let clip = match (optimizer.grad_clip, loss_scaled) {
        (None, false) => None,
        (max_norm, _) => {
            let mut partials = Vec::with_capacity(with_grads.len());
            for (name, _, grad, block) in &with_grads {
                let kind = OpKind::GradNormSq;
                partials.push(graph.add_op(
                    kind,
                    &[*grad],
                    format!("norm_sq.{name}"),
                    Role::Activation,
                    *block,
                    Phase::Optimizer,
                )?);
            }
            let head = forward.op(loss_op).block;
            let (kind, name) = match (max_norm, loss_scaled) {
                (max_norm, true) => (
                    OpKind::UnscaleCoef {
                        max_norm,
                        loss_scale: LOSS_SCALE_INIT,
                    },
                    "unscale_coef",
                ),
                (Some(max_norm), false) => (OpKind::ClipCoef { max_norm }, "clip_coef"),
                (None, false) => unreachable!("no coefficient without clipping or loss scaling"),
            };
            Some(graph.add_op(
                kind,
                &partials,
                name,
                Role::Activation,
                head,
                Phase::Optimizer,
            )?)
        }
    };
    for (name, value, grad, block) in with_grads {
        let ty = protrain_ir::TensorType::new(graph.value(value).ty.shape.clone(), DType::F32);
        let m = graph.add_state(format!("adam.m.{name}"), ty.clone());
        let v = graph.add_state(format!("adam.v.{name}"), ty);
        let mut inputs = vec![value, grad, m, v];
        inputs.extend(clip);
        let kind = OpKind::AdamW {
            lr: optimizer.lr,
            beta1: optimizer.beta1,
            beta2: optimizer.beta2,
            eps: optimizer.eps,
            weight_decay: optimizer.weight_decay,
            clipped: clip.is_some(),
        };
        graph.add_op_multi(kind, &inputs, &[], block, Phase::Optimizer)?;
    }
    Ok(())
}

/// The name and role of the gradient of `value`: parameter gradients are `grad`s, the rest
/// are activations of the backward pass.
fn grad_name_and_role(graph: &Graph, value: ValueId) -> (String, Role) {
    let v = graph.value(value);
    let role = if v.role == Role::Param {
        Role::Grad
    } else {
        Role::Activation
    };
    (format!("d.{}", v.name), role)
}

/// Sums gradient contributions left to right; returns the total, or `None` without any.
fn sum_parts(
    graph: &mut Graph,
    value: ValueId,
    parts: &[ValueId],
    block: protrain_ir::BlockId,
) -> Result<Option<ValueId>> {
    let Some((&first, rest)) = parts.split_first() else {
        return Ok(None);
    };
    let (name, role) = grad_name_and_role(graph, value);
    let mut total = first;
    for &part in rest {
        total = graph.add_op(
            OpKind::Add,
            &[total, part],
            name.clone(),
            role,
            block,
            Phase::Backward,
        )?;
    }
    Ok(Some(total))
}
