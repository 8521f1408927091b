//! The reference interpreter: runs a training graph op by op with every value resident.
//!
//! It is the oracle compiled schedules are held against, so it is deliberately plain: each
//! value is its own heap vector, ops run one at a time in graph order, nothing is reused or
//! overlapped. Everything is f32 whatever the graph's dtypes say.

use crate::backend::set_learning_rate;
use crate::dispatch;
use crate::error::{Result, RuntimeError};
use protrain_ir::{Graph, Op, OpKind, ParamId, Role, TensorType, ValueId};

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
    /// The global gradient norm before clipping, when the graph clips (unscaled, when it is
    /// loss-scaled).
    pub grad_norm: Option<f32>,
    /// Whether the optimizer step was skipped: a loss-scaled (f16) step whose gradients
    /// overflowed, which changed no weight, moment or AdamW step count.
    pub skipped: bool,
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
            // Routing's i32 outputs, written as bits through an f32 view.
            Slot::F32(v) if self.graph.value(value).ty.dtype == protrain_ir::DType::I32 => {
                bytemuck::cast_slice(v)
            }
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
    /// AdamW updates at the learning rate compiled into the graph.
    pub fn step(&mut self, inputs: &[&[i32]]) -> Result<StepReport> {
        self.run_step(inputs, None)
    }

    /// [`Interpreter::step`] with every AdamW op updating at learning rate `lr` instead of
    /// the graph's, as [`crate::Executor::step_at_lr`] does. Fails, running nothing, unless
    /// `lr` is finite and at least 0.
    pub fn step_at_lr(&mut self, inputs: &[&[i32]], lr: f64) -> Result<StepReport> {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(RuntimeError::InvalidLearningRate {
                lr,
                step: self.step + 1,
            });
        }
        self.run_step(inputs, Some(lr))
    }

    /// A step at learning rate `lr` (`None`: the graph's).
    fn run_step(&mut self, inputs: &[&[i32]], lr: Option<f64>) -> Result<StepReport> {
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
            skipped: false,
        };
        for (_, op) in graph.ops() {
            self.run(op, &mut report, lr)?;
        }
        Ok(report)
    }

    fn run(&mut self, op: &Op, report: &mut StepReport, lr: Option<f64>) -> Result<()> {
        if let OpKind::AdamW { clipped, .. } = op.kind {
            let mut kind = op.kind.clone();
            if let Some(lr) = lr {
                set_learning_rate(&mut kind, lr);
            }
            let mut take = |v: ValueId| match std::mem::take(&mut self.slots[v.index()]) {
                Slot::F32(data) => data,
                _ => panic!("optimizer operand {v} is not resident"),
            };
            let (mut p, mut m, mut v) =
                (take(op.inputs[0]), take(op.inputs[2]), take(op.inputs[3]));
            let coef = clipped.then(|| self.f32(op.inputs[4])[0]);
            let grad = self.f32(op.inputs[1]);
            dispatch::adamw(&kind, &mut p, grad, &mut m, &mut v, coef, self.step);
            self.slots[op.inputs[0].index()] = Slot::F32(p);
            self.slots[op.inputs[2].index()] = Slot::F32(m);
            self.slots[op.inputs[3].index()] = Slot::F32(v);
            return Ok(());
        }
        let mut out: Vec<Vec<f32>> = op
            .outputs
            .iter()
            .map(|&v| vec![0.0; self.ty(v).numel() as usize])
            .collect();
        let mut workspace = vec![0.0; dispatch::workspace_len(self.graph, op)];
        let mut views: Vec<&mut [f32]> = out.iter_mut().map(Vec::as_mut_slice).collect();
        let inputs = SlotInputs {
            interpreter: self,
            inputs: &op.inputs,
        };
        let prepared = dispatch::Prepared::new(&op.kind);
        let outcome = dispatch::run(
            self.graph,
            op,
            &prepared,
            &inputs,
            &mut views,
            &mut workspace,
        )?;
        report.loss = outcome.loss.unwrap_or(report.loss);
        report.grad_norm = outcome.grad_norm.or(report.grad_norm);
        for (&v, data) in op.outputs.iter().zip(out) {
            self.slots[v.index()] = Slot::F32(data);
        }
        Ok(())
    }
}

/// An op's inputs, read from the interpreter's slots.
struct SlotInputs<'a, 'g> {
    interpreter: &'a Interpreter<'g>,
    inputs: &'a [ValueId],
}

impl<'a> dispatch::Inputs<'a> for SlotInputs<'a, '_> {
    fn f32(&self, i: usize) -> &'a [f32] {
        self.interpreter.f32(self.inputs[i])
    }

    fn i32(&self, i: usize) -> &'a [i32] {
        self.interpreter.i32(self.inputs[i])
    }
}
