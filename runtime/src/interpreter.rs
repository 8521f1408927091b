//! The reference interpreter: runs a training graph op by op with every value resident.
//!
//! It is the oracle compiled schedules are held against, so it is deliberately plain: each
//! value is its own heap vector, ops run one at a time in graph order, nothing is reused or
//! overlapped. Everything is f32 whatever the graph's dtypes say.

use crate::error::{Result, RuntimeError};
use crate::kernels::{self, AttentionDims};
use protrain_ir::{Graph, OpKind, ParamId, QkvLayout, Role, TensorType, ValueId};

/// A value's storage.
#[derive(Clone, Debug, Default)]
enum Slot {
    /// Not computed (yet, or in this step).
    #[default]
    Empty,
    /// Floating-point data, held as f32.
    F32(Vec<f32>),
    /// Token ids.
    I32(Vec<i32>),
}

/// What one training step reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// The mean cross-entropy of the step's batch, before the update.
    pub loss: f32,
    /// The global gradient norm before clipping, when the graph clips.
    pub grad_norm: Option<f32>,
}

/// Runs a training graph: parameters and optimizer state persist across steps; activations
/// and gradients are recomputed every step and stay readable until the next one.
pub struct Interpreter<'g> {
    graph: &'g Graph,
    slots: Vec<Slot>,
    step: u64,
}

impl<'g> Interpreter<'g> {
    /// An interpreter for `graph` with every parameter and optimizer state zero. Set the
    /// parameters with [`Interpreter::set_param`] before the first step.
    pub fn new(graph: &'g Graph) -> Self {
        let mut slots = vec![Slot::Empty; graph.values().len()];
        for (id, value) in graph.values() {
            if matches!(value.role, Role::Param | Role::OptimizerState) && value.producer.is_none()
            {
                slots[id.index()] = Slot::F32(vec![0.0; value.ty.numel() as usize]);
            }
        }
        Self {
            graph,
            slots,
            step: 0,
        }
    }

    /// The graph being run.
    pub fn graph(&self) -> &'g Graph {
        self.graph
    }

    /// Steps taken so far.
    pub fn steps_taken(&self) -> u64 {
        self.step
    }

    /// Sets a parameter's values; fails when the length is not the parameter's size.
    pub fn set_param(&mut self, param: ParamId, data: &[f32]) -> Result<()> {
        let p = self.graph.param(param);
        let expected = self.graph.value(p.value).ty.numel() as usize;
        if data.len() != expected {
            return Err(RuntimeError::Shape(format!(
                "parameter {} has {expected} elements, {} were given",
                p.name,
                data.len()
            )));
        }
        self.slots[p.value.index()] = Slot::F32(data.to_vec());
        Ok(())
    }

    /// A parameter's current values.
    pub fn param(&self, param: ParamId) -> &[f32] {
        self.f32(self.graph.param(param).value)
    }

    /// A float value computed by the last step (or a parameter or state), if it exists.
    pub fn value(&self, value: ValueId) -> Option<&[f32]> {
        match &self.slots[value.index()] {
            Slot::F32(v) => Some(v),
            _ => None,
        }
    }

    /// The gradient the last step computed for a parameter (before clipping), if it has one.
    pub fn param_grad(&self, param: ParamId) -> Option<&[f32]> {
        let value = self.graph.param(param).value;
        self.graph
            .ops()
            .find(|(_, op)| matches!(op.kind, OpKind::AdamW { .. }) && op.inputs[0] == value)
            .and_then(|(_, op)| self.value(op.inputs[1]))
    }

    fn f32(&self, value: ValueId) -> &[f32] {
        match &self.slots[value.index()] {
            Slot::F32(v) => v,
            _ => panic!(
                "{value} ({}) read before it was computed",
                self.graph.value(value).name
            ),
        }
    }

    fn i32(&self, value: ValueId) -> &[i32] {
        match &self.slots[value.index()] {
            Slot::I32(v) => v,
            _ => panic!(
                "{value} ({}) is not a token tensor",
                self.graph.value(value).name
            ),
        }
    }

    fn ty(&self, value: ValueId) -> &'g TensorType {
        &self.graph.value(value).ty
    }

    /// Runs one step on a batch: `inputs[i]` feeds the graph's `i`-th input (token ids and
    /// targets, row-major `[B,T]`). Returns the loss and, when clipping, the gradient norm.
    pub fn step(&mut self, inputs: &[&[i32]]) -> Result<StepReport> {
        let graph = self.graph;
        if inputs.len() != graph.inputs().len() {
            return Err(RuntimeError::Shape(format!(
                "the graph takes {} inputs, {} were given",
                graph.inputs().len(),
                inputs.len()
            )));
        }
        for (&id, data) in graph.inputs().iter().zip(inputs) {
            let expected = self.ty(id).numel() as usize;
            if data.len() != expected {
                return Err(RuntimeError::Shape(format!(
                    "input {} needs {expected} tokens, {} were given",
                    graph.value(id).name,
                    data.len()
                )));
            }
            self.slots[id.index()] = Slot::I32(data.to_vec());
        }
        for (id, value) in graph.values() {
            if value.producer.is_some() {
                self.slots[id.index()] = Slot::Empty;
            }
        }
        self.step += 1;
        let mut report = StepReport {
            loss: f32::NAN,
            grad_norm: None,
        };
        for (_, op) in graph.ops() {
            self.run(&op.kind, &op.inputs, &op.outputs, &mut report)?;
        }
        Ok(report)
    }

    fn run(
        &mut self,
        kind: &OpKind,
        ins: &[ValueId],
        outs: &[ValueId],
        report: &mut StepReport,
    ) -> Result<()> {
        let mut out: Vec<Vec<f32>> = outs
            .iter()
            .map(|&v| vec![0.0; self.ty(v).numel() as usize])
            .collect();
        let x = ins.first().map(|&v| self.ty(v));
        match kind {
            OpKind::Embedding { .. } => {
                let table = self.ty(ins[1]);
                let (vocab, channels) = (table.shape[0] as usize, table.shape[1] as usize);
                kernels::embedding_forward(
                    &mut out[0],
                    self.i32(ins[0]),
                    self.f32(ins[1]),
                    vocab,
                    channels,
                )?;
            }
            OpKind::PositionEmbedding { offset } => {
                let t = self.ty(ins[0]);
                let channels = self.ty(ins[1]).shape[1] as usize;
                kernels::position_embedding_forward(
                    &mut out[0],
                    self.f32(ins[1]),
                    t.shape[0] as usize,
                    t.shape[1] as usize,
                    channels,
                    *offset as usize,
                );
            }
            OpKind::LayerNorm { eps } => {
                let x = x.expect("arity checked");
                let (rows, c) = (x.rows() as usize, x.last_dim() as usize);
                let (mut mean, mut rstd) = (vec![0.0; rows], vec![0.0; rows]);
                let [y] = &mut out[..] else { unreachable!() };
                kernels::layer_norm_forward(
                    y,
                    &mut mean,
                    &mut rstd,
                    self.f32(ins[0]),
                    self.f32(ins[1]),
                    Some(self.f32(ins[2])),
                    rows,
                    c,
                    *eps as f32,
                );
            }
            OpKind::RmsNorm { eps } => {
                let x = x.expect("arity checked");
                let (rows, c) = (x.rows() as usize, x.last_dim() as usize);
                let mut rstd = vec![0.0; rows];
                kernels::rms_norm_forward(
                    &mut out[0],
                    &mut rstd,
                    self.f32(ins[0]),
                    self.f32(ins[1]),
                    rows,
                    c,
                    *eps as f32,
                );
            }
            OpKind::Linear { bias, layout } => {
                let (rows, d_in) = (
                    x.expect("arity").rows() as usize,
                    x.expect("arity").last_dim() as usize,
                );
                let d_out = self.ty(outs[0]).last_dim() as usize;
                let b = bias.then(|| self.f32(ins[2]));
                kernels::linear_forward(
                    &mut out[0],
                    self.f32(ins[0]),
                    self.f32(ins[1]),
                    b,
                    layout_of(*layout),
                    rows,
                    d_in,
                    d_out,
                );
            }
            OpKind::Gelu => kernels::gelu_forward(&mut out[0], self.f32(ins[0])),
            OpKind::Relu => kernels::relu_forward(&mut out[0], self.f32(ins[0])),
            OpKind::Silu => kernels::silu_forward(&mut out[0], self.f32(ins[0])),
            OpKind::Swiglu => {
                kernels::swiglu_forward(&mut out[0], self.f32(ins[0]), self.f32(ins[1]))
            }
            OpKind::Add => kernels::add_forward(&mut out[0], self.f32(ins[0]), self.f32(ins[1])),
            OpKind::Rope {
                head_dim,
                theta,
                scaling,
            } => {
                let x = x.expect("arity");
                let inv_freq =
                    kernels::rope_inv_freq(*head_dim as usize, *theta, rope_scaling_of(scaling));
                kernels::rope_forward(
                    &mut out[0],
                    self.f32(ins[0]),
                    &inv_freq,
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
                let dims = attention_dims(self.ty(outs[0]), *heads, *kv_heads, *head_dim, *window);
                let [o, lse] = &mut out[..] else {
                    unreachable!()
                };
                match qkv {
                    QkvLayout::Separate => kernels::attention_forward(
                        o,
                        lse,
                        self.f32(ins[0]),
                        self.f32(ins[1]),
                        self.f32(ins[2]),
                        dims,
                    ),
                    QkvLayout::Packed => {
                        kernels::attention_forward_packed(o, lse, self.f32(ins[0]), dims)
                    }
                }
            }
            OpKind::CrossEntropy => {
                let vocab = x.expect("arity").last_dim() as usize;
                let [loss, lse] = &mut out[..] else {
                    unreachable!()
                };
                loss[0] =
                    kernels::cross_entropy_forward(lse, self.f32(ins[0]), self.i32(ins[1]), vocab)?;
                report.loss = loss[0];
            }
            OpKind::EmbeddingBackward { padding_idx, .. } => {
                let [dtable] = &mut out[..] else {
                    unreachable!()
                };
                let channels = self.ty(ins[1]).last_dim() as usize;
                let vocab = dtable.len() / channels;
                kernels::embedding_backward(
                    dtable,
                    self.f32(ins[1]),
                    self.i32(ins[0]),
                    vocab,
                    channels,
                    false,
                );
                // PyTorch's padding_idx: lookups of the pad row contribute no gradient. This
                // output holds only lookup contributions, so the pad row is cleared whole.
                if let Some(pad) = padding_idx.map(|p| p as usize).filter(|&p| p < vocab) {
                    dtable[pad * channels..(pad + 1) * channels].fill(0.0);
                }
            }
            OpKind::PositionEmbeddingBackward { offset, .. } => {
                let t = self.ty(ins[0]);
                let channels = self.ty(ins[1]).last_dim() as usize;
                kernels::position_embedding_backward(
                    &mut out[0],
                    self.f32(ins[1]),
                    t.shape[0] as usize,
                    t.shape[1] as usize,
                    channels,
                    *offset as usize,
                    false,
                );
            }
            OpKind::LayerNormBackward { eps } => {
                let x = x.expect("arity");
                let (rows, c) = (x.rows() as usize, x.last_dim() as usize);
                let (mut mean, mut rstd, mut y) =
                    (vec![0.0; rows], vec![0.0; rows], vec![0.0; rows * c]);
                kernels::layer_norm_forward(
                    &mut y,
                    &mut mean,
                    &mut rstd,
                    self.f32(ins[0]),
                    self.f32(ins[1]),
                    None,
                    rows,
                    c,
                    *eps as f32,
                );
                let [dx, dw, db] = &mut out[..] else {
                    unreachable!()
                };
                kernels::layer_norm_backward(
                    dx,
                    dw,
                    Some(db),
                    self.f32(ins[2]),
                    self.f32(ins[0]),
                    self.f32(ins[1]),
                    &mean,
                    &rstd,
                    rows,
                    c,
                    false,
                );
            }
            OpKind::RmsNormBackward { eps } => {
                let x = x.expect("arity");
                let (rows, c) = (x.rows() as usize, x.last_dim() as usize);
                let (mut rstd, mut y) = (vec![0.0; rows], vec![0.0; rows * c]);
                kernels::rms_norm_forward(
                    &mut y,
                    &mut rstd,
                    self.f32(ins[0]),
                    self.f32(ins[1]),
                    rows,
                    c,
                    *eps as f32,
                );
                let [dx, dw] = &mut out[..] else {
                    unreachable!()
                };
                kernels::rms_norm_backward(
                    dx,
                    dw,
                    self.f32(ins[2]),
                    self.f32(ins[0]),
                    self.f32(ins[1]),
                    &rstd,
                    rows,
                    c,
                    false,
                );
            }
            OpKind::LinearBackward { bias, layout } => {
                let x = x.expect("arity");
                let (rows, d_in) = (x.rows() as usize, x.last_dim() as usize);
                let d_out = self.ty(ins[2]).last_dim() as usize;
                let (dx, rest) = out.split_first_mut().expect("at least dx");
                let (dw, rest) = rest.split_first_mut().expect("dweight");
                let db = if *bias {
                    rest.first_mut().map(|v| v.as_mut_slice())
                } else {
                    None
                };
                kernels::linear_backward(
                    Some(dx),
                    dw,
                    db,
                    self.f32(ins[2]),
                    self.f32(ins[0]),
                    self.f32(ins[1]),
                    layout_of(*layout),
                    rows,
                    d_in,
                    d_out,
                    false,
                );
            }
            OpKind::GeluBackward => {
                kernels::gelu_backward(&mut out[0], self.f32(ins[1]), self.f32(ins[0]))
            }
            OpKind::ReluBackward => {
                kernels::relu_backward(&mut out[0], self.f32(ins[1]), self.f32(ins[0]))
            }
            OpKind::SiluBackward => {
                kernels::silu_backward(&mut out[0], self.f32(ins[1]), self.f32(ins[0]))
            }
            OpKind::SwigluBackward => {
                let [dgate, dup] = &mut out[..] else {
                    unreachable!()
                };
                kernels::swiglu_backward(
                    dgate,
                    dup,
                    self.f32(ins[2]),
                    self.f32(ins[0]),
                    self.f32(ins[1]),
                );
            }
            OpKind::RopeBackward {
                head_dim,
                theta,
                scaling,
            } => {
                let x = x.expect("arity");
                let inv_freq =
                    kernels::rope_inv_freq(*head_dim as usize, *theta, rope_scaling_of(scaling));
                kernels::rope_backward(
                    &mut out[0],
                    self.f32(ins[0]),
                    &inv_freq,
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
                    let dims =
                        attention_dims(self.ty(ins[3]), *heads, *kv_heads, *head_dim, *window);
                    let [dq, dk, dv] = &mut out[..] else {
                        unreachable!()
                    };
                    kernels::attention_backward(
                        dq,
                        dk,
                        dv,
                        self.f32(ins[5]),
                        self.f32(ins[0]),
                        self.f32(ins[1]),
                        self.f32(ins[2]),
                        self.f32(ins[3]),
                        self.f32(ins[4]),
                        dims,
                    );
                }
                QkvLayout::Packed => {
                    let dims =
                        attention_dims(self.ty(ins[1]), *heads, *kv_heads, *head_dim, *window);
                    kernels::attention_backward_packed(
                        &mut out[0],
                        self.f32(ins[3]),
                        self.f32(ins[0]),
                        self.f32(ins[1]),
                        self.f32(ins[2]),
                        dims,
                    );
                }
            },
            OpKind::CrossEntropyBackward => {
                let vocab = x.expect("arity").last_dim() as usize;
                kernels::cross_entropy_backward(
                    &mut out[0],
                    self.f32(ins[0]),
                    self.f32(ins[2]),
                    self.i32(ins[1]),
                    vocab,
                    1.0,
                );
            }
            OpKind::GradNormSq => {
                out[0][0] = kernels::grad_norm_sq(self.f32(ins[0])) as f32;
            }
            OpKind::ClipCoef { max_norm } => {
                let total: f64 = ins.iter().map(|&p| f64::from(self.f32(p)[0])).sum();
                out[0][0] = kernels::clip_coef(total.sqrt() as f32, *max_norm);
                report.grad_norm = Some(total.sqrt() as f32);
            }
            OpKind::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                clipped,
            } => {
                let mut grad = self.f32(ins[1]).to_vec();
                if *clipped {
                    kernels::scale(&mut grad, self.f32(ins[4])[0]);
                }
                let config = kernels::AdamWConfig {
                    lr: *lr,
                    beta1: *beta1,
                    beta2: *beta2,
                    eps: *eps,
                    weight_decay: *weight_decay,
                };
                let mut take = |v: ValueId| match std::mem::take(&mut self.slots[v.index()]) {
                    Slot::F32(data) => data,
                    _ => panic!("optimizer operand {v} is not resident"),
                };
                let (mut p, mut m, mut v) = (take(ins[0]), take(ins[2]), take(ins[3]));
                kernels::adamw_step(&mut p, &grad, &mut m, &mut v, self.step, &config);
                self.slots[ins[0].index()] = Slot::F32(p);
                self.slots[ins[2].index()] = Slot::F32(m);
                self.slots[ins[3].index()] = Slot::F32(v);
            }
        }
        for (&v, data) in outs.iter().zip(out) {
            self.slots[v.index()] = Slot::F32(data);
        }
        Ok(())
    }
}

/// The kernels' name for an IR weight layout.
fn layout_of(layout: protrain_ir::WeightLayout) -> kernels::WeightLayout {
    match layout {
        protrain_ir::WeightLayout::OutIn => kernels::WeightLayout::OutIn,
        protrain_ir::WeightLayout::InOut => kernels::WeightLayout::InOut,
    }
}

/// The kernels' name for an IR RoPE scaling.
fn rope_scaling_of(scaling: &protrain_ir::RopeScaling) -> kernels::RopeScaling {
    match *scaling {
        protrain_ir::RopeScaling::None => kernels::RopeScaling::None,
        protrain_ir::RopeScaling::Linear { factor } => kernels::RopeScaling::Linear { factor },
        protrain_ir::RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => kernels::RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: original_max_position_embeddings as usize,
        },
    }
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
