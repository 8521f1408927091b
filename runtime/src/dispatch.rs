//! The one op dispatch the interpreter and the executor share: runs an op kind on slices.
//!
//! Callers find the operands (the interpreter in its per-value vectors, the host backend at
//! planned offsets in its arena) and this module calls the kernels, so every schedule computes
//! with the same code, in the same order, as the reference interpreter. It allocates nothing:
//! per-op constants come from [`Prepared`], made once before the first step; per-row norm
//! statistics go to the op's workspace slice.

use crate::error::Result;
use crate::kernels::{self, AttentionDims};
use protrain_ir::{
    Epilogue, Graph, Op, OpKind, QkvLayout, Scratch, TensorType, WeightLayout, WorkspaceLayout,
};

/// Where a kernel reads its inputs: input `i` of the op, as floats or as token ids.
///
/// The slices live for `'a`; the caller guarantees nothing writes them meanwhile.
pub trait Inputs<'a> {
    /// Input `i` as f32 values.
    fn f32(&self, i: usize) -> &'a [f32];
    /// Input `i` as i32 token ids.
    fn i32(&self, i: usize) -> &'a [i32];
}

/// Per-op constants computed once before any step: the inverse frequencies of RoPE kinds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Prepared {
    inv_freq: Vec<f32>,
}

impl Prepared {
    /// The constants an op of `kind` needs (none for most kinds).
    pub fn new(kind: &OpKind) -> Self {
        let inv_freq = match kind {
            OpKind::Rope {
                head_dim,
                theta,
                scaling,
            }
            | OpKind::RopeBackward {
                head_dim,
                theta,
                scaling,
            } => kernels::rope_inv_freq(*head_dim as usize, *theta, *scaling),
            _ => Vec::new(),
        };
        Self { inv_freq }
    }
}

/// What a kernel reports besides its outputs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Outcome {
    /// The loss, from a cross-entropy op.
    pub loss: Option<f32>,
    /// The global gradient norm before clipping, from a clip-coefficient op.
    pub grad_norm: Option<f32>,
}

impl Outcome {
    /// Keeps what either reports, `other` winning where both do.
    pub fn merge(self, other: Outcome) -> Outcome {
        Outcome {
            loss: other.loss.or(self.loss),
            grad_norm: other.grad_norm.or(self.grad_norm),
        }
    }
}

/// Elements of f32 scratch an op of this kind needs in its workspace:
/// [`OpKind::workspace_bytes`] in f32s.
pub fn workspace_len(graph: &Graph, op: &Op) -> usize {
    let types: Vec<&TensorType> = op.inputs.iter().map(|&v| &graph.value(v).ty).collect();
    (op.kind.workspace_bytes(&types) / 4) as usize
}

/// The parts `want` of an f32 workspace laid out as `layout` says (every part of a host op
/// is f32 and starts at a multiple of 16 bytes, so each is a whole number of f32s), in the
/// order asked; an empty slice for a part the layout does not have.
fn workspace_parts<'w, const N: usize>(
    workspace: &'w mut [f32],
    layout: &WorkspaceLayout,
    want: [Scratch; N],
) -> [&'w mut [f32]; N] {
    let mut found: Vec<(Scratch, &'w mut [f32])> = Vec::with_capacity(layout.parts().len());
    let (mut rest, mut at) = (workspace, 0usize);
    for &(what, r) in layout.parts() {
        let (start, len) = ((r.offset / 4) as usize, (r.bytes / 4) as usize);
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(start - at);
        let (part, tail) = tail.split_at_mut(len);
        (rest, at) = (tail, start + len);
        found.push((what, part));
    }
    want.map(|w| match found.iter().position(|(s, _)| *s == w) {
        Some(i) => std::mem::take(&mut found[i].1),
        None => &mut [],
    })
}

/// A fused linear op: each projection as [`OpKind::Linear`] computes it, then the epilogue as
/// its own kind would, so the bits equal the unfused ops'.
#[allow(clippy::too_many_arguments)]
fn fused_linear<'a>(
    ins: &impl Inputs<'a>,
    outputs: &mut [&mut [f32]],
    n: usize,
    bias: bool,
    layout: WeightLayout,
    epilogue: Epilogue,
    x: &TensorType,
) {
    let (rows, d_in) = (x.rows() as usize, x.last_dim() as usize);
    let project = |out: &mut [f32], i: usize| {
        let w = ins.f32(1 + i);
        kernels::linear_forward(
            out,
            ins.f32(0),
            w,
            bias.then(|| ins.f32(1 + n + i)),
            layout,
            rows,
            d_in,
            w.len() / d_in,
        );
    };
    match epilogue {
        Epilogue::None => {
            for (i, out) in outputs.iter_mut().enumerate() {
                project(out, i);
            }
        }
        Epilogue::Gelu | Epilogue::Relu => {
            let [h, y] = outputs else {
                unreachable!("a fused linear with an activation writes h and out")
            };
            project(h, 0);
            match epilogue {
                Epilogue::Gelu => kernels::gelu_forward(y, h),
                _ => kernels::relu_forward(y, h),
            }
        }
        Epilogue::Swiglu => {
            let [gate, up, y] = outputs else {
                unreachable!("a fused linear with swiglu writes gate, up and out")
            };
            project(gate, 0);
            project(up, 1);
            kernels::swiglu_forward(y, gate, up);
        }
        Epilogue::Residual => {
            let y = &mut *outputs[0];
            project(y, 0);
            kernels::add_assign(y, ins.f32(1 + n * (1 + usize::from(bias))));
        }
    }
}

/// The backward of a fused linear op, with the kernels the unfused ops' backward would run:
/// the epilogue's gradient into the workspace, then each projection's, last first, summing
/// the input gradient in that order as autodiff sums separate contributions.
#[allow(clippy::too_many_arguments)]
fn fused_linear_backward<'a>(
    ins: &impl Inputs<'a>,
    outputs: &mut [&mut [f32]],
    workspace: &mut [f32],
    parts: &WorkspaceLayout,
    n: usize,
    bias: bool,
    layout: WeightLayout,
    epilogue: Epilogue,
    x: &TensorType,
) {
    let (rows, d_in) = (x.rows() as usize, x.last_dim() as usize);
    let (dx, rest) = outputs
        .split_first_mut()
        .expect("fused_linear_backward writes dx");
    let (dweights, dbiases) = rest.split_at_mut(n);
    let kept = epilogue.has_output() && epilogue.keeps_projections();
    let dy = ins.f32(1 + n + if kept { n } else { 0 });
    // The gradients of the projections: in the workspace behind an epilogue with an output,
    // else the op's own output gradients; then the contributions after the first.
    let [dgrad0, dgrad1, contribution] = workspace_parts(
        workspace,
        parts,
        [
            Scratch::ProjectionGrad(0),
            Scratch::ProjectionGrad(1),
            Scratch::Contribution,
        ],
    );
    let mut projection_grads: Vec<&[f32]> = Vec::with_capacity(n);
    match epilogue {
        Epilogue::None => projection_grads.extend((0..n).map(|i| ins.f32(1 + n + i))),
        Epilogue::Residual => projection_grads.push(dy),
        Epilogue::Gelu | Epilogue::Relu => {
            let h = ins.f32(1 + n);
            let dh = &mut dgrad0[..h.len()];
            match epilogue {
                Epilogue::Gelu => kernels::gelu_backward(dh, dy, h),
                _ => kernels::relu_backward(dh, dy, h),
            }
            projection_grads.push(dh);
        }
        Epilogue::Swiglu => {
            let (gate, up) = (ins.f32(1 + n), ins.f32(2 + n));
            let (dgate, dup) = (&mut dgrad0[..gate.len()], &mut dgrad1[..up.len()]);
            kernels::swiglu_backward(dgate, dup, dy, gate, up);
            projection_grads.push(dgate);
            projection_grads.push(dup);
        }
    }
    let contribution = &mut contribution[..if n >= 2 { dx.len() } else { 0 }];
    for i in (0..n).rev() {
        let w = ins.f32(1 + i);
        let target: &mut [f32] = if i == n - 1 { dx } else { contribution };
        kernels::linear_backward(
            Some(target),
            dweights[i],
            if bias {
                dbiases.get_mut(i).map(|d| &mut **d)
            } else {
                None
            },
            projection_grads[i],
            ins.f32(0),
            w,
            layout,
            rows,
            d_in,
            w.len() / d_in,
            false,
        );
        if i != n - 1 {
            kernels::add_assign(dx, contribution);
        }
    }
}

/// Runs `op` of `graph` (any kind but AdamW, which updates its inputs: see [`adamw`]).
///
/// `outputs[i]` receives output `i` and is overwritten whole; `workspace` holds
/// [`workspace_len`] f32s of scratch laid out as [`WorkspaceLayout`] says, of which the host
/// kernels use some parts (the per-row statistics of norms, a fused linear's intermediate
/// gradients). Fails only on
/// data-dependent errors (token ids out of range); shapes that do not match the graph's types
/// panic in the kernels, which a verified schedule rules out.
pub fn run<'a>(
    graph: &Graph,
    op: &Op,
    prepared: &Prepared,
    ins: &impl Inputs<'a>,
    outputs: &mut [&mut [f32]],
    workspace: &mut [f32],
) -> Result<Outcome> {
    let ty = |i: usize| -> &TensorType { &graph.value(op.inputs[i]).ty };
    let out_ty = |i: usize| -> &TensorType { &graph.value(op.outputs[i]).ty };
    let ws_layout = || {
        let types: Vec<&TensorType> = op.inputs.iter().map(|&v| &graph.value(v).ty).collect();
        WorkspaceLayout::of(&op.kind, &types)
    };
    let mut outcome = Outcome::default();
    match &op.kind {
        OpKind::Embedding { .. } => {
            let table = ty(1);
            let (vocab, channels) = (table.shape[0] as usize, table.shape[1] as usize);
            kernels::embedding_forward(outputs[0], ins.i32(0), ins.f32(1), vocab, channels)?;
        }
        OpKind::PositionEmbedding { offset } => {
            let t = ty(0);
            kernels::position_embedding_forward(
                outputs[0],
                ins.f32(1),
                t.shape[0] as usize,
                t.shape[1] as usize,
                ty(1).shape[1] as usize,
                *offset as usize,
            );
        }
        OpKind::LayerNorm { eps } => {
            let (rows, c) = (ty(0).rows() as usize, ty(0).last_dim() as usize);
            let [mean, rstd] =
                workspace_parts(workspace, &ws_layout(), [Scratch::Mean, Scratch::Rstd]);
            kernels::layer_norm_forward(
                outputs[0],
                mean,
                rstd,
                ins.f32(0),
                ins.f32(1),
                Some(ins.f32(2)),
                rows,
                c,
                *eps as f32,
            );
        }
        OpKind::RmsNorm { eps } => {
            let (rows, c) = (ty(0).rows() as usize, ty(0).last_dim() as usize);
            kernels::rms_norm_forward(
                outputs[0],
                workspace_parts(workspace, &ws_layout(), [Scratch::Rstd])[0],
                ins.f32(0),
                ins.f32(1),
                rows,
                c,
                *eps as f32,
            );
        }
        OpKind::Linear { bias, layout } => {
            let (rows, d_in) = (ty(0).rows() as usize, ty(0).last_dim() as usize);
            let d_out = out_ty(0).last_dim() as usize;
            kernels::linear_forward(
                outputs[0],
                ins.f32(0),
                ins.f32(1),
                bias.then(|| ins.f32(2)),
                *layout,
                rows,
                d_in,
                d_out,
            );
        }
        OpKind::Gelu => kernels::gelu_forward(outputs[0], ins.f32(0)),
        OpKind::Relu => kernels::relu_forward(outputs[0], ins.f32(0)),
        OpKind::Silu => kernels::silu_forward(outputs[0], ins.f32(0)),
        OpKind::Swiglu => kernels::swiglu_forward(outputs[0], ins.f32(0), ins.f32(1)),
        OpKind::Add => kernels::add_forward(outputs[0], ins.f32(0), ins.f32(1)),
        OpKind::Rope { head_dim, .. } => {
            let x = ty(0);
            kernels::rope_forward(
                outputs[0],
                ins.f32(0),
                &prepared.inv_freq,
                x.shape[0] as usize,
                x.shape[1] as usize,
                (x.last_dim() / head_dim) as usize,
                *head_dim as usize,
            );
        }
        OpKind::Attention {
            heads,
            kv_heads,
            head_dim,
            window,
            qkv,
        } => {
            let dims = attention_dims(out_ty(0), *heads, *kv_heads, *head_dim, *window);
            let [o, lse] = outputs else {
                unreachable!("attention writes out and lse")
            };
            match qkv {
                QkvLayout::Separate => {
                    kernels::attention_forward(o, lse, ins.f32(0), ins.f32(1), ins.f32(2), dims)
                }
                QkvLayout::Packed => kernels::attention_forward_packed(o, lse, ins.f32(0), dims),
            }
        }
        OpKind::CrossEntropy => {
            let vocab = ty(0).last_dim() as usize;
            let [loss, lse] = outputs else {
                unreachable!("cross_entropy writes loss and lse")
            };
            loss[0] = kernels::cross_entropy_forward(lse, ins.f32(0), ins.i32(1), vocab)?;
            outcome.loss = Some(loss[0]);
        }
        OpKind::EmbeddingBackward { padding_idx, .. } => {
            let dtable = &mut *outputs[0];
            let channels = ty(1).last_dim() as usize;
            let vocab = dtable.len() / channels;
            kernels::embedding_backward(dtable, ins.f32(1), ins.i32(0), vocab, channels, false);
            // PyTorch's padding_idx: lookups of the pad row contribute no gradient. This
            // output holds only lookup contributions, so the pad row is cleared whole.
            if let Some(pad) = padding_idx.map(|p| p as usize).filter(|&p| p < vocab) {
                dtable[pad * channels..(pad + 1) * channels].fill(0.0);
            }
        }
        OpKind::PositionEmbeddingBackward { offset, .. } => {
            let t = ty(0);
            kernels::position_embedding_backward(
                outputs[0],
                ins.f32(1),
                t.shape[0] as usize,
                t.shape[1] as usize,
                ty(1).last_dim() as usize,
                *offset as usize,
                false,
            );
        }
        OpKind::LayerNormBackward { eps } => {
            let (rows, c) = (ty(0).rows() as usize, ty(0).last_dim() as usize);
            let [mean, rstd] =
                workspace_parts(workspace, &ws_layout(), [Scratch::Mean, Scratch::Rstd]);
            let [dx, dw, db] = outputs else {
                unreachable!("layer_norm_backward writes dx, dweight and dbias")
            };
            // Recompute the forward's statistics; the normalised rows the forward kernel also
            // writes land in dx, which the backward kernel then overwrites.
            kernels::layer_norm_forward(
                dx,
                mean,
                rstd,
                ins.f32(0),
                ins.f32(1),
                None,
                rows,
                c,
                *eps as f32,
            );
            kernels::layer_norm_backward(
                dx,
                dw,
                Some(db),
                ins.f32(2),
                ins.f32(0),
                ins.f32(1),
                mean,
                rstd,
                rows,
                c,
                false,
            );
        }
        OpKind::RmsNormBackward { eps } => {
            let (rows, c) = (ty(0).rows() as usize, ty(0).last_dim() as usize);
            let [dx, dw] = outputs else {
                unreachable!("rms_norm_backward writes dx and dweight")
            };
            // As for layer norm: the statistics into the workspace, the rows into dx.
            let [workspace] = workspace_parts(workspace, &ws_layout(), [Scratch::Rstd]);
            kernels::rms_norm_forward(dx, workspace, ins.f32(0), ins.f32(1), rows, c, *eps as f32);
            kernels::rms_norm_backward(
                dx,
                dw,
                ins.f32(2),
                ins.f32(0),
                ins.f32(1),
                workspace,
                rows,
                c,
                false,
            );
        }
        OpKind::LinearBackward { bias, layout } => {
            let (rows, d_in) = (ty(0).rows() as usize, ty(0).last_dim() as usize);
            let d_out = ty(2).last_dim() as usize;
            let (dx, rest) = outputs
                .split_first_mut()
                .expect("linear_backward writes dx");
            let (dw, rest) = rest
                .split_first_mut()
                .expect("linear_backward writes dweight");
            let db = if *bias {
                rest.first_mut().map(|d| &mut **d)
            } else {
                None
            };
            kernels::linear_backward(
                Some(dx),
                dw,
                db,
                ins.f32(2),
                ins.f32(0),
                ins.f32(1),
                *layout,
                rows,
                d_in,
                d_out,
                false,
            );
        }
        OpKind::FusedLinear {
            count,
            bias,
            layout,
            epilogue,
        } => fused_linear(
            ins,
            outputs,
            *count as usize,
            *bias,
            *layout,
            *epilogue,
            ty(0),
        ),
        OpKind::FusedLinearBackward {
            count,
            bias,
            layout,
            epilogue,
        } => fused_linear_backward(
            ins,
            outputs,
            workspace,
            &ws_layout(),
            *count as usize,
            *bias,
            *layout,
            *epilogue,
            ty(0),
        ),
        OpKind::GeluBackward => kernels::gelu_backward(outputs[0], ins.f32(1), ins.f32(0)),
        OpKind::ReluBackward => kernels::relu_backward(outputs[0], ins.f32(1), ins.f32(0)),
        OpKind::SiluBackward => kernels::silu_backward(outputs[0], ins.f32(1), ins.f32(0)),
        OpKind::SwigluBackward => {
            let [dgate, dup] = outputs else {
                unreachable!("swiglu_backward writes dgate and dup")
            };
            kernels::swiglu_backward(dgate, dup, ins.f32(2), ins.f32(0), ins.f32(1));
        }
        OpKind::RopeBackward { head_dim, .. } => {
            let x = ty(0);
            kernels::rope_backward(
                outputs[0],
                ins.f32(0),
                &prepared.inv_freq,
                x.shape[0] as usize,
                x.shape[1] as usize,
                (x.last_dim() / head_dim) as usize,
                *head_dim as usize,
            );
        }
        OpKind::AttentionBackward {
            heads,
            kv_heads,
            head_dim,
            window,
            qkv,
        } => match qkv {
            QkvLayout::Separate => {
                let dims = attention_dims(ty(3), *heads, *kv_heads, *head_dim, *window);
                let [dq, dk, dv] = outputs else {
                    unreachable!("attention_backward writes dq, dk and dv")
                };
                kernels::attention_backward(
                    dq,
                    dk,
                    dv,
                    ins.f32(5),
                    ins.f32(0),
                    ins.f32(1),
                    ins.f32(2),
                    ins.f32(3),
                    ins.f32(4),
                    dims,
                );
            }
            QkvLayout::Packed => {
                let dims = attention_dims(ty(1), *heads, *kv_heads, *head_dim, *window);
                kernels::attention_backward_packed(
                    outputs[0],
                    ins.f32(3),
                    ins.f32(0),
                    ins.f32(1),
                    ins.f32(2),
                    dims,
                );
            }
        },
        OpKind::CrossEntropyBackward => {
            let vocab = ty(0).last_dim() as usize;
            kernels::cross_entropy_backward(
                outputs[0],
                ins.f32(0),
                ins.f32(2),
                ins.i32(1),
                vocab,
                1.0,
            );
        }
        OpKind::GradNormSq => outputs[0][0] = kernels::grad_norm_sq(ins.f32(0)) as f32,
        OpKind::ClipCoef { max_norm } => {
            // The partial sums in f64, in input order.
            let total: f64 = (0..op.inputs.len()).map(|i| f64::from(ins.f32(i)[0])).sum();
            outputs[0][0] = kernels::clip_coef(total.sqrt() as f32, *max_norm);
            outcome.grad_norm = Some(total.sqrt() as f32);
        }
        OpKind::AdamW { .. } => {
            unreachable!("AdamW updates its inputs in place: call dispatch::adamw")
        }
        OpKind::MoveStart(_) | OpKind::MoveDone(_) | OpKind::Release { .. } => {
            return Err(crate::error::RuntimeError::BadSchedule(format!(
                "{} marks a copy in the placed graph and has no kernel; run a schedule the \
                 compiler emitted, whose copies are instructions",
                op.kind.mnemonic()
            )))
        }
    }
    Ok(outcome)
}

/// Runs an AdamW op in place: `param`, `m` and `v` are updated from `grad`, scaled by the
/// clip coefficient `coef` when the op is clipped. `step` is the 1-based step number.
///
/// Panics when `kind` is not AdamW, or when a clipped op gets no coefficient.
#[allow(clippy::too_many_arguments)]
pub fn adamw(
    kind: &OpKind,
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    coef: Option<f32>,
    step: u64,
) {
    adamw_mixed(
        kind,
        param,
        kernels::Grad::F32(grad),
        m,
        v,
        None,
        coef,
        step,
    );
}

/// Runs an AdamW op in one pass over memory for any parameter the CPU Adam updates: the f32
/// `master` (the parameter itself when it is f32), `m` and `v` are updated from `grad` (f32,
/// or bf16 widened as it is read), scaled by the clip coefficient `coef` when the op is
/// clipped; when `low` is given (a bf16 parameter), the new master rounded to bf16 is written
/// there in the same pass. [`adamw`] is this with an f32 gradient and no bf16 copy; the
/// interpreter, the host executor and the CUDA backend's host optimizer all come here, so
/// they share one kernel ([`kernels::adamw_step_fused`]) and its bits.
///
/// Panics when `kind` is not AdamW, or when a clipped op gets no coefficient.
#[allow(clippy::too_many_arguments)]
pub fn adamw_mixed(
    kind: &OpKind,
    master: &mut [f32],
    grad: kernels::Grad<'_>,
    m: &mut [f32],
    v: &mut [f32],
    low: Option<&mut [kernels::bf16]>,
    coef: Option<f32>,
    step: u64,
) {
    let OpKind::AdamW {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        clipped,
    } = *kind
    else {
        panic!("dispatch::adamw runs AdamW ops, not {}", kind.mnemonic());
    };
    let config = kernels::AdamWConfig {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
    };
    let scale = match clipped {
        true => Some(coef.expect("a clipped AdamW reads the clip coefficient")),
        false => None,
    };
    kernels::adamw_step_fused(master, grad, scale, m, v, low, step, &config);
}

/// [`kernels::adamw_step`] on `grad * grad_scale`, without allocating: bit-identical to
/// [`kernels::scale`] on a copy of the gradient followed by [`kernels::adamw_step`].
///
/// Each element's update depends only on its own values, the step and the configuration, and
/// the fused kernel scales each gradient element as it reads it; `g * s` rounds exactly as
/// `scale`'s `*g *= s`.
pub fn adamw_step_scaled(
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    step: u64,
    config: &kernels::AdamWConfig,
    grad_scale: f32,
) {
    let grad = kernels::Grad::F32(grad);
    kernels::adamw_step_fused(param, grad, Some(grad_scale), m, v, None, step, config);
}

/// Attention dimensions from the output type `[B,T,H*D]`.
fn attention_dims(
    out: &TensorType,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    window: Option<u64>,
) -> AttentionDims {
    AttentionDims {
        batch: out.shape[0] as usize,
        seq: out.shape[1] as usize,
        n_heads: heads as usize,
        n_kv_heads: kv_heads as usize,
        head_dim: head_dim as usize,
        window: window.map(|w| w as usize),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host takes each part where the layout puts it, padding between parts included: 3
    /// rows give parts whose sizes are not multiples of 16 bytes.
    #[test]
    fn workspace_parts_follow_the_aligned_layout_with_odd_rows() {
        let x = TensorType::new([1, 3, 5], protrain_ir::DType::F32);
        let w = TensorType::new([7, 5], protrain_ir::DType::F32);
        let h = TensorType::new([1, 3, 7], protrain_ir::DType::F32);
        let kind = OpKind::FusedLinearBackward {
            count: 2,
            bias: true,
            layout: WeightLayout::OutIn,
            epilogue: Epilogue::Swiglu,
        };
        let layout = WorkspaceLayout::of(&kind, &[&x, &w, &w, &h, &h, &h]);
        let want = [
            Scratch::ProjectionGrad(0),
            Scratch::ProjectionGrad(1),
            Scratch::Contribution,
            Scratch::BiasPartials,
        ];
        let mut ws = vec![0.0f32; (layout.bytes() / 4) as usize];
        let parts = workspace_parts(&mut ws, &layout, want);
        let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
        assert_eq!(lens, [21, 21, 15, 7]);
        for (i, part) in parts.into_iter().enumerate() {
            part.fill(i as f32 + 1.0);
        }
        for (i, what) in want.iter().enumerate() {
            let r = layout.get(*what).unwrap();
            let at = (r.offset / 4) as usize;
            let n = (r.bytes / 4) as usize;
            assert!(
                ws[at..at + n].iter().all(|&v| v == i as f32 + 1.0),
                "{what:?}"
            );
        }
        assert_eq!(
            ws.iter().filter(|&&v| v == 0.0).count(),
            3 + 3 + 1,
            "the padding"
        );
    }

    #[test]
    fn scaled_adamw_matches_scale_then_step_to_the_bit() {
        // Longer than one block and not a multiple of it, with an awkward scale.
        let n = 3 * kernels::ADAMW_BLOCK + 17;
        let wave = |k: f32| -> Vec<f32> { (0..n).map(|i| ((i as f32) * k).sin()).collect() };
        let (p0, g, m0, v0) = (wave(0.37), wave(1.3), wave(0.11), wave(0.07));
        let v0: Vec<f32> = v0.iter().map(|x| x.abs()).collect();
        let config = kernels::AdamWConfig::default();
        let s = 0.318_309_87_f32;
        for step in [1, 7] {
            let (mut p1, mut m1, mut v1) = (p0.clone(), m0.clone(), v0.clone());
            let mut scaled = g.clone();
            kernels::scale(&mut scaled, s);
            kernels::adamw_step(&mut p1, &scaled, &mut m1, &mut v1, step, &config);
            let (mut p2, mut m2, mut v2) = (p0.clone(), m0.clone(), v0.clone());
            adamw_step_scaled(&mut p2, &g, &mut m2, &mut v2, step, &config, s);
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&p1), bits(&p2), "param at step {step}");
            assert_eq!(bits(&m1), bits(&m2), "m at step {step}");
            assert_eq!(bits(&v1), bits(&v2), "v at step {step}");
        }
    }
}
