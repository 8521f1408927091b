//! The one op dispatch the interpreter and the executor share: runs an op kind on slices.
//!
//! Callers find the operands (the interpreter in its per-value vectors, the host backend at
//! planned offsets in its arena) and this module calls the kernels, so every schedule computes
//! with the same code, in the same order, as the reference interpreter. Per-op constants come
//! from [`Prepared`], made once before the first step; per-row norm statistics go to the op's
//! workspace slice.
//!
//! Mixed precision. The kernels compute in f32. An op whose operands are stored in bf16
//! (a `--dtype bf16` schedule) runs through [`run_stored`]: its bf16 inputs are widened into
//! [`Staging`] buffers, [`run`] computes in f32, and its bf16 outputs are rounded to nearest
//! even as they are written: the CUDA backend's contract (its kernels load bf16, compute in
//! f32 and round each store). Where a CUDA op stores an intermediate in bf16 between two of
//! its kernels, [`run`] rounds at the same point ([`kernels::Rounding`]): a fused linear's
//! projections before a ReLU, SwiGLU or unfusable GELU reads them, its epilogue gradients and
//! each projection's input gradient before they are summed, and attention's probabilities and
//! score gradients (see `kernels/attention.rs`). A linear layer's bias, a fused linear's GELU
//! ([`gelu_in_matmul`]) and residual are the CUDA matmul's epilogue: added (or applied) in f32
//! to the unrounded product, each stored value rounded once. Master
//! weights and Adam moments stay f32 ([`adamw_mixed`]).

use crate::error::{Result, RuntimeError};
use crate::kernels::{self, bf16, AttentionDims, Rounding};
use protrain_ir::{
    DType, Epilogue, Graph, Op, OpKind, QkvLayout, Scratch, TensorType, WeightLayout,
    WorkspaceLayout,
};

/// Most outputs an op kind writes: a fused linear's backward with the most projections
/// ([`protrain_ir::op::MAX_PROJECTIONS`], each with a bias) writes `1 + 2 * 15`; a grouped
/// matmul's backward with the most experts ([`protrain_ir::op::MAX_EXPERTS`]) writes
/// `1 + 256`.
/// A grouped matmul's backward with the most experts writes `1 + MAX_EXPERTS`, more.
pub const MAX_OUTPUTS: usize = 1 + protrain_ir::op::MAX_EXPERTS as usize;

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
            } => kernels::rope_inv_freq(*head_dim as usize, *theta, scaling),
            OpKind::PartialRope {
                rotary_dim,
                theta,
                scaling,
                ..
            }
            | OpKind::PartialRopeBackward {
                rotary_dim,
                theta,
                scaling,
                ..
            } => kernels::rope_inv_freq(*rotary_dim as usize, *theta, scaling),
            _ => Vec::new(),
        };
        Self { inv_freq }
    }
}

/// The geometry of a [`OpKind::PartialRope`] over `x [B,T,N*head_dim]`.
fn partial_rope_dims(
    x: &TensorType,
    head_dim: u64,
    rotary_dim: u64,
    heads: u64,
) -> kernels::RopeDims {
    kernels::RopeDims {
        batch: x.shape[0] as usize,
        seq: x.shape[1] as usize,
        heads: (x.last_dim() / head_dim) as usize,
        head_dim: head_dim as usize,
        rotary_dim: rotary_dim as usize,
        rotated_heads: heads as usize,
    }
}

/// How many leading inputs and outputs of an op may be stored with padded rows: the most
/// positions any kind lists in [`OpKind::pitched_operands`].
const PITCHED: usize = 3;

/// The row pitches, in elements, of a launch's operands stored with padded rows
/// ([`protrain_ir::RowPitch`]); an operand without one is dense. Only the operands an op kind
/// lists in [`OpKind::pitched_operands`] can have one (the verifier checks the schedule), and
/// such an operand's view holds `rows x pitch` elements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pitches {
    inputs: [Option<usize>; PITCHED],
    outputs: [Option<usize>; PITCHED],
}

impl Pitches {
    /// Every operand dense.
    pub const DENSE: Pitches = Pitches {
        inputs: [None; PITCHED],
        outputs: [None; PITCHED],
    };

    /// The pitches of a kernel whose operands are at `inputs` and `outputs` in `schedule`:
    /// each operand in a padded buffer gets its buffer's pitch.
    pub fn of(
        schedule: &protrain_ir::Schedule,
        inputs: &[protrain_ir::TensorRef],
        outputs: &[protrain_ir::TensorRef],
    ) -> Pitches {
        let pitch = |t: &protrain_ir::TensorRef| {
            schedule
                .buffers
                .get(t.buffer.index())
                .and_then(|b| b.pitch)
                .map(|p| p.pitch as usize)
        };
        let mut out = Pitches::DENSE;
        for (slot, t) in out.inputs.iter_mut().zip(inputs) {
            *slot = pitch(t);
        }
        for (slot, t) in out.outputs.iter_mut().zip(outputs) {
            *slot = pitch(t);
        }
        out
    }

    /// Input `i`'s pitch, `None` when dense.
    pub fn input(&self, i: usize) -> Option<usize> {
        self.inputs.get(i).copied().flatten()
    }

    /// Output `i`'s pitch, `None` when dense.
    pub fn output(&self, i: usize) -> Option<usize> {
        self.outputs.get(i).copied().flatten()
    }

    /// Whether some operand has a pitch.
    pub fn any(&self) -> bool {
        *self != Pitches::DENSE
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

/// Elements of f32 scratch an op of this kind needs in its workspace: the bytes of its
/// [`compute_layout`] in f32s ([`OpKind::workspace_bytes`] for an f32 op).
pub fn workspace_len(graph: &Graph, op: &Op) -> usize {
    (compute_layout(graph, op).bytes() / 4) as usize
}

/// The workspace layout the host kernels use for `op`: its inputs' [`WorkspaceLayout`] with
/// every bf16 type widened to f32, since every part the kernels write is f32 (an f32 op's is
/// its planned layout). Only a fused linear backward's parts depend on the dtype.
pub fn compute_layout(graph: &Graph, op: &Op) -> WorkspaceLayout {
    let types: Vec<&TensorType> = op.inputs.iter().map(|&v| &graph.value(v).ty).collect();
    let narrow = |t: &TensorType| matches!(t.dtype, DType::BF16 | DType::F16);
    if !types.iter().any(|t| narrow(t)) {
        return WorkspaceLayout::of(&op.kind, &types);
    }
    let wide: Vec<TensorType> = types
        .iter()
        .map(|t| match t.dtype {
            DType::BF16 | DType::F16 => TensorType::new(t.shape.clone(), DType::F32),
            _ => (*t).clone(),
        })
        .collect();
    WorkspaceLayout::of(&op.kind, &wide.iter().collect::<Vec<_>>())
}

/// The storage rounding of `op`'s intermediates: bf16's or f16's when its first input (the
/// activation or parameter that sets its kernels' storage type, as on the CUDA backend) is
/// stored so.
pub fn rounding_of(graph: &Graph, op: &Op) -> Rounding {
    let first = op.inputs.first().map(|&v| graph.value(v).ty.dtype);
    first.map_or(Rounding::Exact, Rounding::of)
}

/// cuBLASLt keeps a GELU epilogue's input only with a leading dimension that is a multiple
/// of this many elements (`CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD`).
pub const GELU_AUX_LD_MULTIPLE: usize = 8;

/// Whether the CUDA backend applies a fused linear's GELU in its matmul's epilogue (in f32,
/// before rounding) for `d_out` output features: where cuBLASLt can keep the GELU's input
/// (`d_out` a multiple of [`GELU_AUX_LD_MULTIPLE`]). Otherwise the GELU is a pass of its own
/// over the stored (rounded) projection.
pub fn gelu_in_matmul(d_out: usize) -> bool {
    d_out.is_multiple_of(GELU_AUX_LD_MULTIPLE)
}

/// One projection `y = x W (+ bias)` as the CUDA backend computes it: the product with the
/// bias in the matmul's epilogue, in f32, stored (rounded) once. The bias is the product's
/// starting value, as [`kernels::linear_forward`] adds it.
#[allow(clippy::too_many_arguments)]
fn project(
    y: &mut [f32],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    layout: WeightLayout,
    (rows, d_in, d_out): (usize, usize, usize),
    rounding: Rounding,
) {
    kernels::linear_forward(y, x, w, bias, layout, rows, d_in, d_out);
    rounding.apply(y);
}

/// The rows and columns an RMS norm of input `x` normalises: `x`'s rows and last dimension, or
/// with `head_dim` every group of `head_dim` elements of each row as a row of its own.
fn norm_groups(x: &TensorType, head_dim: Option<u64>) -> (usize, usize) {
    let (rows, cols) = (x.rows(), x.last_dim());
    (
        protrain_ir::norm_rows(rows, cols, head_dim) as usize,
        head_dim.unwrap_or(cols) as usize,
    )
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

/// A fused linear op as the CUDA backend computes it: a GELU (where [`gelu_in_matmul`]) and
/// the residual applied to the projection in f32, with one rounding of each stored result
/// (the matmul's epilogue); a ReLU, SwiGLU or other GELU applied to each projection as
/// [`OpKind::Linear`] stores it (rounded under bf16 storage), as its own kind would.
#[allow(clippy::too_many_arguments)]
fn fused_linear<'a>(
    ins: &impl Inputs<'a>,
    outputs: &mut [&mut [f32]],
    n: usize,
    bias: bool,
    layout: WeightLayout,
    epilogue: Epilogue,
    x: &TensorType,
    rounding: Rounding,
) {
    let (rows, d_in) = (x.rows() as usize, x.last_dim() as usize);
    let project_as = |out: &mut [f32], i: usize, rounding: Rounding| {
        let w = ins.f32(1 + i);
        let dims = (rows, d_in, w.len() / d_in);
        let b = bias.then(|| ins.f32(1 + n + i));
        project(out, ins.f32(0), w, b, layout, dims, rounding);
    };
    let project = |out: &mut [f32], i: usize| project_as(out, i, rounding);
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
            match epilogue {
                Epilogue::Gelu if gelu_in_matmul(h.len() / rows.max(1)) => {
                    project_as(h, 0, Rounding::Exact);
                    kernels::gelu_forward(y, h);
                    rounding.apply(h);
                }
                Epilogue::Gelu => {
                    project(h, 0);
                    kernels::gelu_forward(y, h);
                }
                _ => {
                    project(h, 0);
                    kernels::relu_forward(y, h);
                }
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
            project_as(y, 0, Rounding::Exact);
            kernels::add_assign(y, ins.f32(1 + n * (1 + usize::from(bias))));
        }
    }
}

/// The backward of a fused linear op, with the kernels the unfused ops' backward would run:
/// the epilogue's gradient into the workspace, then each projection's, last first, summing
/// the input gradient in that order as autodiff sums separate contributions. Under bf16
/// storage the epilogue's gradients, each projection's input gradient and each partial sum
/// are rounded where the CUDA backend stores them.
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
    rounding: Rounding,
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
            rounding.apply(dh);
            projection_grads.push(dh);
        }
        Epilogue::Swiglu => {
            let (gate, up) = (ins.f32(1 + n), ins.f32(2 + n));
            let (dgate, dup) = (&mut dgrad0[..gate.len()], &mut dgrad1[..up.len()]);
            kernels::swiglu_backward(dgate, dup, dy, gate, up);
            rounding.apply(dgate);
            rounding.apply(dup);
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
        rounding.apply(target);
        if i != n - 1 {
            kernels::add_assign(dx, contribution);
            rounding.apply(dx);
        }
    }
}

/// The seed of a loss gradient (a cross-entropy backward's or a load-balancing loss
/// backward's), for both backends: 1; with `K`
/// micro-batches per step `1 / K` in f32, as PyTorch's `(loss / K).backward()` seeds it; and,
/// loss-scaled (fp16), `loss_scale / K` in f32, GradScaler's `scale(loss / K)` (exact when
/// the scale is a power of two and `K` is one). `None` for any other kind.
pub fn loss_seed(kind: &OpKind) -> Option<f32> {
    match *kind {
        OpKind::CrossEntropyBackward => Some(1.0),
        OpKind::CrossEntropyBackwardScaled { micro_batches } => {
            Some(1.0 / micro_batches.max(1) as f32)
        }
        OpKind::CrossEntropyBackwardLossScaled {
            micro_batches,
            loss_scale,
        } => Some((loss_scale / micro_batches.max(1) as f64) as f32),
        OpKind::MoeAuxLossBackward {
            micro_batches,
            loss_scale,
            ..
        } => Some((loss_scale.unwrap_or(1.0) / micro_batches.max(1) as f64) as f32),
        _ => None,
    }
}

/// Runs `op` of `graph` (any kind but AdamW, which updates its inputs: see [`adamw`]) on f32
/// views of its operands.
///
/// `outputs[i]` receives output `i` and is overwritten whole; `workspace` holds
/// [`workspace_len`] f32s of scratch laid out as [`compute_layout`] says, of which the host
/// kernels use some parts (the per-row statistics of norms, a fused linear's intermediate
/// gradients). When the graph types an operand bf16 its view holds the widened values, and
/// each bf16 output receives its value as stored (rounded to bf16), with the intermediates
/// rounded as the module doc says; [`run_stored`] does the widening and narrowing. Fails only
/// on data-dependent errors (token ids out of range) and on kinds no schedule holds; shapes
/// that do not match the graph's types panic in the kernels, which a verified schedule rules
/// out.
pub fn run<'a>(
    graph: &Graph,
    op: &Op,
    prepared: &Prepared,
    ins: &impl Inputs<'a>,
    outputs: &mut [&mut [f32]],
    workspace: &mut [f32],
) -> Result<Outcome> {
    run_pitched(
        graph,
        op,
        prepared,
        ins,
        outputs,
        workspace,
        &Pitches::DENSE,
    )
}

/// [`run`] with some operands stored in padded rows, as `pitches` says: each such view holds
/// `rows x pitch` elements, of which the kernels read and write each row's first
/// `last_dim` (the padding is neither read nor written as data).
#[allow(clippy::too_many_arguments)]
pub fn run_pitched<'a>(
    graph: &Graph,
    op: &Op,
    prepared: &Prepared,
    ins: &impl Inputs<'a>,
    outputs: &mut [&mut [f32]],
    workspace: &mut [f32],
    pitches: &Pitches,
) -> Result<Outcome> {
    let ty = |i: usize| -> &TensorType { &graph.value(op.inputs[i]).ty };
    let out_ty = |i: usize| -> &TensorType { &graph.value(op.outputs[i]).ty };
    let ws_layout = || compute_layout(graph, op);
    let rounding = rounding_of(graph, op);
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
        OpKind::RmsNorm {
            eps,
            head_dim,
            unit_offset,
        } => {
            let (rows, c) = norm_groups(ty(0), *head_dim);
            kernels::rms_norm_forward(
                outputs[0],
                workspace_parts(workspace, &ws_layout(), [Scratch::Rstd])[0],
                ins.f32(0),
                ins.f32(1),
                rows,
                c,
                *eps as f32,
                *unit_offset,
            );
        }
        OpKind::Linear { bias, layout } => {
            let (rows, d_in) = (ty(0).rows() as usize, ty(0).last_dim() as usize);
            let d_out = out_ty(0).last_dim() as usize;
            match pitches.output(0) {
                None => project(
                    outputs[0],
                    ins.f32(0),
                    ins.f32(1),
                    bias.then(|| ins.f32(2)),
                    *layout,
                    (rows, d_in, d_out),
                    rounding,
                ),
                Some(pitch) => {
                    kernels::linear_forward_pitched(
                        outputs[0],
                        pitch,
                        ins.f32(0),
                        ins.f32(1),
                        bias.then(|| ins.f32(2)),
                        *layout,
                        rows,
                        d_in,
                        d_out,
                    );
                    rounding.apply(outputs[0]);
                }
            }
        }
        OpKind::Gelu => kernels::gelu_forward(outputs[0], ins.f32(0)),
        OpKind::Relu => kernels::relu_forward(outputs[0], ins.f32(0)),
        OpKind::Silu => kernels::silu_forward(outputs[0], ins.f32(0)),
        OpKind::Swiglu => kernels::swiglu_forward(outputs[0], ins.f32(0), ins.f32(1)),
        OpKind::Geglu => kernels::geglu_forward(outputs[0], ins.f32(0), ins.f32(1)),
        OpKind::Softcap { cap } => kernels::softcap_forward(outputs[0], ins.f32(0), *cap as f32),
        OpKind::Scale { factor } => {
            // The factor is a tensor of the input's dtype in transformers: rounded first.
            let factor = Rounding::of(ty(0).dtype).round(*factor as f32);
            kernels::scale_forward(outputs[0], ins.f32(0), factor)
        }
        OpKind::Add => kernels::add_forward(outputs[0], ins.f32(0), ins.f32(1)),
        OpKind::Rope {
            head_dim, scaling, ..
        } => kernels::partial_rope_forward(
            outputs[0],
            ins.f32(0),
            &prepared.inv_freq,
            scaling.attention_factor() as f32,
            partial_rope_dims(ty(0), *head_dim, *head_dim, ty(0).last_dim() / head_dim),
        ),
        OpKind::PartialRope {
            head_dim,
            rotary_dim,
            heads,
            scaling,
            ..
        } => kernels::partial_rope_forward(
            outputs[0],
            ins.f32(0),
            &prepared.inv_freq,
            scaling.attention_factor() as f32,
            partial_rope_dims(ty(0), *head_dim, *rotary_dim, *heads),
        ),
        OpKind::PackedSwiglu => {
            let width = (ty(0).last_dim() / 2) as usize;
            kernels::packed_swiglu_forward(outputs[0], ins.f32(0), width)
        }
        OpKind::Attention {
            heads,
            kv_heads,
            head_dim,
            window,
            qkv,
            scale,
            softcap,
        } => {
            let dims = attention_dims(out_ty(0), *heads, *kv_heads, *head_dim, *window)
                .scored(*scale, *softcap);
            let [o, lse] = outputs else {
                unreachable!("attention writes out and lse")
            };
            match qkv {
                QkvLayout::Separate => kernels::attention_forward_rounded(
                    o,
                    lse,
                    ins.f32(0),
                    ins.f32(1),
                    ins.f32(2),
                    dims,
                    rounding,
                ),
                QkvLayout::Packed => {
                    kernels::attention_forward_packed_rounded(o, lse, ins.f32(0), dims, rounding)
                }
            }
        }
        OpKind::CrossEntropy => {
            let vocab = ty(0).last_dim() as usize;
            let [loss, lse] = outputs else {
                unreachable!("cross_entropy writes loss and lse")
            };
            let pitch = pitches.input(0).unwrap_or(vocab);
            loss[0] =
                kernels::cross_entropy_forward_pitched(lse, ins.f32(0), pitch, ins.i32(1), vocab)?;
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
        OpKind::RmsNormBackward {
            eps,
            head_dim,
            unit_offset,
        } => {
            let (rows, c) = norm_groups(ty(0), *head_dim);
            let [dx, dw] = outputs else {
                unreachable!("rms_norm_backward writes dx and dweight")
            };
            // As for layer norm: the statistics into the workspace, the rows into dx.
            let [workspace] = workspace_parts(workspace, &ws_layout(), [Scratch::Rstd]);
            kernels::rms_norm_forward(
                dx,
                workspace,
                ins.f32(0),
                ins.f32(1),
                rows,
                c,
                *eps as f32,
                *unit_offset,
            );
            kernels::rms_norm_backward(
                dx,
                dw,
                ins.f32(2),
                ins.f32(0),
                ins.f32(1),
                workspace,
                rows,
                c,
                *unit_offset,
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
            kernels::linear_backward_pitched(
                Some(dx),
                dw,
                db,
                ins.f32(2),
                pitches.input(2).unwrap_or(d_out),
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
            rounding,
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
            rounding,
        ),
        OpKind::GeluBackward => kernels::gelu_backward(outputs[0], ins.f32(1), ins.f32(0)),
        OpKind::ReluBackward => kernels::relu_backward(outputs[0], ins.f32(1), ins.f32(0)),
        OpKind::SiluBackward => kernels::silu_backward(outputs[0], ins.f32(1), ins.f32(0)),
        OpKind::SoftcapBackward { cap } => {
            kernels::softcap_backward(outputs[0], ins.f32(1), ins.f32(0), *cap as f32)
        }
        OpKind::MoeRoute {
            experts,
            top_k,
            normalize,
        } => {
            let [weights, chosen, rows, slots, offsets] = outputs else {
                unreachable!("moe_route writes weights, experts, rows, slots and offsets")
            };
            kernels::moe_route(
                weights,
                bytemuck::cast_slice_mut(chosen),
                bytemuck::cast_slice_mut(rows),
                bytemuck::cast_slice_mut(slots),
                bytemuck::cast_slice_mut(offsets),
                ins.f32(0),
                *experts as usize,
                *top_k as usize,
                *normalize,
            );
        }
        OpKind::MoeRouteBackward {
            experts,
            top_k,
            normalize,
        } => kernels::moe_route_backward(
            outputs[0],
            ins.f32(2),
            ins.f32(0),
            ins.i32(1),
            *experts as usize,
            *top_k as usize,
            *normalize,
        ),
        OpKind::MoeDispatch { top_k } => kernels::moe_dispatch(
            outputs[0],
            ins.f32(0),
            ins.i32(1),
            ty(0).last_dim() as usize,
            *top_k as usize,
        ),
        OpKind::MoeDispatchBackward { top_k } => kernels::moe_dispatch_backward(
            outputs[0],
            ins.f32(1),
            ins.i32(0),
            ty(1).last_dim() as usize,
            *top_k as usize,
        ),
        OpKind::GroupedLinear { experts } => {
            let weights: Vec<&[f32]> = (0..*experts as usize).map(|e| ins.f32(2 + e)).collect();
            kernels::grouped_linear_forward(
                outputs[0],
                ins.f32(0),
                ins.i32(1),
                &weights,
                ty(0).last_dim() as usize,
                out_ty(0).last_dim() as usize,
            );
        }
        OpKind::GroupedLinearBackward { experts } => {
            let e = *experts as usize;
            let weights: Vec<&[f32]> = (0..e).map(|i| ins.f32(2 + i)).collect();
            let (dxs, dweights) = outputs
                .split_first_mut()
                .expect("grouped_linear_backward writes dxs");
            kernels::grouped_linear_backward(
                dxs,
                dweights,
                ins.f32(2 + e),
                ins.f32(0),
                ins.i32(1),
                &weights,
                ty(0).last_dim() as usize,
                ty(2 + e).last_dim() as usize,
            );
        }
        OpKind::MoeCombine { top_k } => kernels::moe_combine(
            outputs[0],
            ins.f32(0),
            ins.f32(1),
            ins.i32(2),
            ty(0).last_dim() as usize,
            *top_k as usize,
        ),
        OpKind::MoeCombineBackward { top_k } => {
            let [dys, dweights] = outputs else {
                unreachable!("moe_combine_backward writes dys and dweights")
            };
            kernels::moe_combine_backward(
                dys,
                dweights,
                ins.f32(3),
                ins.f32(0),
                ins.f32(1),
                ins.i32(2),
                ty(0).last_dim() as usize,
                *top_k as usize,
            );
        }
        OpKind::MoeAuxLoss {
            experts,
            top_k,
            layers,
            coef,
        } => {
            let logits: Vec<&[f32]> = (1..=*layers as usize).map(|i| ins.f32(i)).collect();
            outputs[0][0] = kernels::moe_aux_loss(
                ins.f32(0)[0],
                &logits,
                *experts as usize,
                *top_k as usize,
                *coef,
            );
            // The step's loss is this sum, not the cross-entropy before it.
            outcome.loss = Some(outputs[0][0]);
        }
        OpKind::MoeAuxLossBackward {
            experts,
            top_k,
            layers,
            coef,
            ..
        } => {
            let logits: Vec<&[f32]> = (0..*layers as usize).map(|i| ins.f32(i)).collect();
            kernels::moe_aux_loss_backward(
                outputs,
                &logits,
                *experts as usize,
                *top_k as usize,
                *coef,
                loss_seed(&op.kind).expect("a load-balancing loss backward kind"),
            );
        }
        OpKind::GegluBackward => {
            let [dgate, dup] = outputs else {
                unreachable!("geglu_backward writes dgate and dup")
            };
            kernels::geglu_backward(dgate, dup, ins.f32(2), ins.f32(0), ins.f32(1));
        }
        OpKind::SwigluBackward => {
            let [dgate, dup] = outputs else {
                unreachable!("swiglu_backward writes dgate and dup")
            };
            kernels::swiglu_backward(dgate, dup, ins.f32(2), ins.f32(0), ins.f32(1));
        }
        OpKind::RopeBackward {
            head_dim, scaling, ..
        } => kernels::partial_rope_backward(
            outputs[0],
            ins.f32(0),
            &prepared.inv_freq,
            scaling.attention_factor() as f32,
            partial_rope_dims(ty(0), *head_dim, *head_dim, ty(0).last_dim() / head_dim),
        ),
        OpKind::PartialRopeBackward {
            head_dim,
            rotary_dim,
            heads,
            scaling,
            ..
        } => kernels::partial_rope_backward(
            outputs[0],
            ins.f32(0),
            &prepared.inv_freq,
            scaling.attention_factor() as f32,
            partial_rope_dims(ty(0), *head_dim, *rotary_dim, *heads),
        ),
        OpKind::PackedSwigluBackward => {
            let width = (ty(0).last_dim() / 2) as usize;
            kernels::packed_swiglu_backward(outputs[0], ins.f32(1), ins.f32(0), width)
        }
        OpKind::AttentionBackward {
            heads,
            kv_heads,
            head_dim,
            window,
            qkv,
            scale,
            softcap,
        } => match qkv {
            QkvLayout::Separate => {
                let dims = attention_dims(ty(3), *heads, *kv_heads, *head_dim, *window)
                    .scored(*scale, *softcap);
                let [dq, dk, dv] = outputs else {
                    unreachable!("attention_backward writes dq, dk and dv")
                };
                kernels::attention_backward_rounded(
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
                    rounding,
                );
            }
            QkvLayout::Packed => {
                let dims = attention_dims(ty(1), *heads, *kv_heads, *head_dim, *window)
                    .scored(*scale, *softcap);
                kernels::attention_backward_packed_rounded(
                    outputs[0],
                    ins.f32(3),
                    ins.f32(0),
                    ins.f32(1),
                    ins.f32(2),
                    dims,
                    rounding,
                );
            }
        },
        OpKind::CrossEntropyBackward
        | OpKind::CrossEntropyBackwardScaled { .. }
        | OpKind::CrossEntropyBackwardLossScaled { .. } => {
            let vocab = ty(0).last_dim() as usize;
            let pitch = pitches.input(0).unwrap_or(vocab);
            assert_eq!(
                pitches.output(0).unwrap_or(vocab),
                pitch,
                "cross_entropy_backward: logits and dlogits at different pitches"
            );
            kernels::cross_entropy_backward_pitched(
                outputs[0],
                ins.f32(0),
                pitch,
                ins.f32(2),
                ins.i32(1),
                vocab,
                loss_seed(&op.kind).expect("a cross-entropy backward kind"),
            );
        }
        OpKind::UnscaleCoef {
            max_norm,
            loss_scale,
        } => {
            let total: f64 = (0..op.inputs.len()).map(|i| f64::from(ins.f32(i)[0])).sum();
            let (coef, norm) = kernels::unscale_coef(total, *loss_scale, *max_norm);
            outputs[0][0] = coef;
            outcome.grad_norm = Some(norm);
        }
        OpKind::AccumulateGrad => {
            return Err(RuntimeError::BadSchedule(
                "accumulate_grad updates its accumulator in place and has no out-of-place \
                 kernel; run it through a backend's launch"
                    .into(),
            ))
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
            return Err(RuntimeError::BadSchedule(format!(
                "{} marks a copy in the placed graph and has no kernel; run a schedule the \
                 compiler emitted, whose copies are instructions",
                op.kind.mnemonic()
            )))
        }
    }
    // Every bf16 or f16 output as stored.
    for (out, &v) in outputs.iter_mut().zip(&op.outputs) {
        Rounding::of(graph.value(v).ty.dtype).apply(out);
    }
    Ok(outcome)
}

/// An operand as stored: f32 or bf16 values, or i32 token ids.
#[derive(Clone, Copy, Debug)]
pub enum Stored<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// bf16 values.
    Bf16(&'a [bf16]),
    /// f16 values.
    F16(&'a [kernels::f16]),
    /// Token ids.
    I32(&'a [i32]),
}

/// An output as stored: f32 or bf16 values.
#[derive(Debug)]
pub enum StoredMut<'a> {
    /// f32 values.
    F32(&'a mut [f32]),
    /// bf16 values.
    Bf16(&'a mut [bf16]),
    /// f16 values.
    F16(&'a mut [kernels::f16]),
}

/// Where [`run_stored`] reads an op's inputs as stored: input `i` of the op, in its type.
///
/// The slices live for `'a`; the caller guarantees nothing writes them meanwhile.
pub trait StoredInputs<'a> {
    /// Input `i` as stored.
    fn stored(&self, i: usize) -> Stored<'a>;
}

/// Reusable f32 buffers for [`run_stored`]: the widened bf16 inputs, the f32 results of bf16
/// outputs and, where the planned workspace is laid out for bf16 parts, an f32 workspace.
/// They grow to the largest op they serve and are kept, so a schedule allocates in its first
/// step only; one per thread that runs ops (the host backend keeps one per stream).
#[derive(Debug, Default)]
pub struct Staging {
    wide: Vec<f32>,
    /// Where each input's widened copy lies in `wide`, if it has one.
    spans: Vec<Option<(usize, usize)>>,
}

/// The inputs [`run`] reads for [`run_stored`]: f32 and i32 inputs in place, bf16 ones
/// widened into the staging buffer.
struct Widened<'w, I> {
    raw: &'w I,
    wide: &'w [f32],
    spans: &'w [Option<(usize, usize)>],
}

impl<'w, 'a: 'w, I: StoredInputs<'a>> Inputs<'w> for Widened<'w, I> {
    fn f32(&self, i: usize) -> &'w [f32] {
        match (self.spans[i], self.raw.stored(i)) {
            (Some((at, len)), _) => &self.wide[at..at + len],
            (None, Stored::F32(x)) => x,
            (None, other) => panic!("input {i} is read as f32 but is stored as {other:?}"),
        }
    }

    fn i32(&self, i: usize) -> &'w [i32] {
        match self.raw.stored(i) {
            Stored::I32(x) => x,
            other => panic!("input {i} is read as token ids but is stored as {other:?}"),
        }
    }
}

/// Runs `op` (any kind but AdamW) on operands as stored: [`run`] on f32 views, bf16 inputs
/// widened into `staging` and bf16 outputs rounded to nearest even into their storage.
/// `workspace` is the op's planned workspace (`workspace_bytes` of its graph types, as f32s);
/// where the f32 kernels need another layout ([`compute_layout`]: a bf16 fused linear
/// backward's parts), an f32 workspace from `staging` is used instead. An op whose operands
/// are all f32 and i32 runs on them directly, as [`run`] does.
///
/// `outputs` holds one view per output of the op's types; there are at most [`MAX_OUTPUTS`].
/// Panics when an operand is not stored as the graph types it (a verified schedule rules that
/// out); errors are [`run`]'s. Operands stored in padded rows, as `pitches` says, are views of
/// `rows x pitch` elements and run through [`run_pitched`].
#[allow(clippy::too_many_arguments)]
pub fn run_stored<'a>(
    graph: &Graph,
    op: &Op,
    prepared: &Prepared,
    ins: &impl StoredInputs<'a>,
    outputs: &mut [StoredMut<'_>],
    workspace: &mut [f32],
    staging: &mut Staging,
    pitches: &Pitches,
) -> Result<Outcome> {
    assert!(
        outputs.len() == op.outputs.len() && outputs.len() <= MAX_OUTPUTS,
        "{} writes {} outputs but was given {} views",
        op.kind.mnemonic(),
        op.outputs.len(),
        outputs.len()
    );
    let n_out = outputs.len();
    let Staging { wide, spans } = staging;
    spans.clear();
    let mut widened = 0;
    for i in 0..op.inputs.len() {
        spans.push(match ins.stored(i) {
            Stored::Bf16(x) => {
                widened += x.len();
                Some((widened - x.len(), x.len()))
            }
            Stored::F16(x) => {
                widened += x.len();
                Some((widened - x.len(), x.len()))
            }
            Stored::F32(_) | Stored::I32(_) => None,
        });
    }
    let narrowed: usize = outputs
        .iter()
        .map(|o| match o {
            StoredMut::Bf16(x) => x.len(),
            StoredMut::F16(x) => x.len(),
            StoredMut::F32(_) => 0,
        })
        .sum();
    // With f32 operands only, the planned layout is the kernels' (and nothing is staged).
    let ws_len = match widened + narrowed {
        0 => 0,
        _ => {
            let types: Vec<&TensorType> = op.inputs.iter().map(|&v| &graph.value(v).ty).collect();
            let layout = compute_layout(graph, op);
            match layout != WorkspaceLayout::of(&op.kind, &types) {
                true => (layout.bytes() / 4) as usize,
                false => 0,
            }
        }
    };
    let own_workspace = ws_len > 0;
    let need = widened + narrowed + ws_len;
    if wide.len() < need {
        wide.resize(need, 0.0);
    }
    let (inputs_part, rest) = wide.split_at_mut(widened);
    let (outputs_part, rest) = rest.split_at_mut(narrowed);
    for (i, span) in spans.iter().enumerate() {
        match (*span, ins.stored(i)) {
            (Some((at, len)), Stored::Bf16(x)) => kernels::widen(&mut inputs_part[at..at + len], x),
            (Some((at, len)), Stored::F16(x)) => {
                kernels::widen_f16(&mut inputs_part[at..at + len], x)
            }
            _ => {}
        }
    }
    let workspace: &mut [f32] = match own_workspace {
        true => &mut rest[..ws_len],
        false => workspace,
    };
    let outcome = {
        let mut views: [&mut [f32]; MAX_OUTPUTS] = std::array::from_fn(|_| Default::default());
        let mut free = &mut *outputs_part;
        for (view, out) in views.iter_mut().zip(outputs.iter_mut()) {
            *view = match out {
                StoredMut::F32(x) => x,
                StoredMut::Bf16(x) => {
                    let (part, tail) = std::mem::take(&mut free).split_at_mut(x.len());
                    free = tail;
                    part
                }
                StoredMut::F16(x) => {
                    let (part, tail) = std::mem::take(&mut free).split_at_mut(x.len());
                    free = tail;
                    part
                }
            };
        }
        let inputs = Widened {
            raw: ins,
            wide: inputs_part,
            spans,
        };
        run_pitched(
            graph,
            op,
            prepared,
            &inputs,
            &mut views[..n_out],
            workspace,
            pitches,
        )?
    };
    let mut at = 0;
    for out in outputs.iter_mut() {
        // `run` stored every narrow output rounded: narrowing is exact.
        match out {
            StoredMut::Bf16(x) => {
                kernels::narrow(x, &outputs_part[at..at + x.len()]);
                at += x.len();
            }
            StoredMut::F16(x) => {
                kernels::narrow_f16(x, &outputs_part[at..at + x.len()]);
                at += x.len();
            }
            StoredMut::F32(_) => {}
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
/// interpreter, the host executor and the CUDA backend's host optimizer all come here or to
/// [`adamw_step`], so they share one kernel ([`kernels::adamw_step_fused`]) and its bits.
///
/// Panics when `kind` is not AdamW, or when a clipped op gets no coefficient.
#[allow(clippy::too_many_arguments)]
pub fn adamw_mixed(
    kind: &OpKind,
    master: &mut [f32],
    grad: kernels::Grad<'_>,
    m: &mut [f32],
    v: &mut [f32],
    low: Option<kernels::Low<'_>>,
    coef: Option<f32>,
    step: u64,
) {
    if let Some(step) = adamw_step(kind, master, grad, m, v, low, coef, step) {
        kernels::adamw_steps_fused(vec![step], &|_| {});
    }
}

/// The step an AdamW op of kind `kind` makes on its operands (as [`adamw_mixed`] takes
/// them), for a run of steps updated together ([`kernels::adamw_steps_fused`]); `None` for a
/// loss-scaled step whose gradients overflowed, which is skipped: nothing changes.
///
/// Panics when `kind` is not AdamW, or when a clipped op gets no coefficient.
#[allow(clippy::too_many_arguments)]
pub fn adamw_step<'a>(
    kind: &OpKind,
    master: &'a mut [f32],
    grad: kernels::Grad<'a>,
    m: &'a mut [f32],
    v: &'a mut [f32],
    low: Option<kernels::Low<'a>>,
    coef: Option<f32>,
    step: u64,
) -> Option<kernels::AdamWStep<'a>> {
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
    let grad_scale = match clipped {
        true => Some(coef.expect("a clipped AdamW reads the clip coefficient")),
        false => None,
    };
    if grad_scale.is_some_and(kernels::skips_step) {
        return None;
    }
    Some(kernels::AdamWStep {
        master,
        grad,
        grad_scale,
        exp_avg: m,
        exp_avg_sq: v,
        low,
        step,
        config,
    })
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
        scale: None,
        softcap: None,
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
