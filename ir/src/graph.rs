//! The dataflow graph: ops in a petgraph container, SSA tensor values, parameters and blocks.

use crate::error::{IrError, Result};
use crate::ids::{BlockId, OpId, ParamId, ValueId};
use crate::op::{Op, OpKind, Phase};
use crate::types::{DType, TensorType};
use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::EdgeRef;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What a value is for. Roles decide what the memory planner and the printer call it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Fed in each step (token ids, targets).
    Input,
    /// A trainable parameter.
    Param,
    /// The gradient of a parameter.
    Grad,
    /// Optimizer state (master weights, Adam moments).
    OptimizerState,
    /// An intermediate tensor of the forward or backward pass.
    Activation,
    /// The training loss.
    Loss,
    /// Kernel scratch memory.
    Workspace,
    /// The running sum of a gradient over a step's micro-batches (gradient accumulation):
    /// zero at the start of each step, read by the optimizer at its end.
    Accumulator,
}

impl Role {
    /// The word the printer uses.
    pub fn name(self) -> &'static str {
        match self {
            Role::Input => "input",
            Role::Param => "param",
            Role::Grad => "grad",
            Role::OptimizerState => "state",
            Role::Activation => "act",
            Role::Loss => "loss",
            Role::Workspace => "workspace",
            Role::Accumulator => "accum",
        }
    }
}

/// Where a value lives once placement has decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Location {
    /// Device memory (the arena).
    Device,
    /// Pinned host memory.
    Host,
}

/// An SSA tensor value: written once (by its producer, or from outside for inputs and
/// parameters), read by any number of ops.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Value {
    /// A readable name (the Hugging Face name for parameters).
    pub name: String,
    /// Shape and element type.
    pub ty: TensorType,
    /// What it is for.
    pub role: Role,
    /// The op that writes it; `None` for inputs and parameters.
    pub producer: Option<OpId>,
}

/// How a parameter is initialised when no checkpoint is given (transformers' `_init_weights`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParamInit {
    /// Normal with mean 0 and this standard deviation.
    Normal {
        /// The standard deviation.
        std: f64,
    },
    /// All ones (norm scales).
    Ones,
    /// All zeros (biases).
    Zeros,
}

/// A trainable parameter, named as Hugging Face names it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Param {
    /// The canonical Hugging Face name, e.g. `model.layers.3.self_attn.q_proj.weight`.
    pub name: String,
    /// Other names the same tensor goes by: a tied `lm_head.weight`, or the unprefixed names
    /// of old checkpoints.
    pub aliases: Vec<String>,
    /// The value that holds it.
    pub value: ValueId,
    /// The block that owns it.
    pub block: BlockId,
    /// How it is initialised without a checkpoint.
    pub init: ParamInit,
}

/// What part of the model a block is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockKind {
    /// Token and position embeddings.
    Embedding,
    /// The `index`-th transformer layer.
    Layer(u32),
    /// Final norm, language-model head and loss.
    Head,
}

/// A block: a unit the compiler keeps, checkpoints or swaps as a whole.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Block {
    /// The Hugging Face module path, e.g. `transformer.h.3`.
    pub name: String,
    /// What part of the model it is.
    pub kind: BlockKind,
}

/// Batch geometry and provenance of a graph.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GraphInfo {
    /// The model's name (a preset or the config's path).
    pub model: String,
    /// Sequences per step.
    pub batch: u64,
    /// Tokens per sequence.
    pub seq: u64,
}

/// A dataflow graph of tensor ops.
///
/// Ops are the nodes of a petgraph `DiGraph`, in the order they were added, which is always a
/// topological order (an op can only read values that exist). An edge runs from the producer of
/// a value to each op that reads it and carries the value's id. Op `OpId(i)` is node `i`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Graph {
    /// Batch geometry and provenance.
    pub info: GraphInfo,
    /// Every value, indexed by [`ValueId`].
    values: Vec<Value>,
    /// Ops and their dataflow edges.
    dataflow: DiGraph<Op, ValueId>,
    /// Every parameter, indexed by [`ParamId`], in the order the model declares them.
    params: Vec<Param>,
    /// Every block, indexed by [`BlockId`], in forward order.
    blocks: Vec<Block>,
    /// Values fed in each step, in order.
    inputs: Vec<ValueId>,
    /// Values the step produces (the loss).
    outputs: Vec<ValueId>,
    /// Where values live, once placement has decided; absent means device.
    locations: BTreeMap<ValueId, Location>,
    /// The parameter each parameter value holds, built on first use so that
    /// [`Graph::param_of`] is a lookup; not serialised (a graph read back builds it again).
    #[serde(skip)]
    param_index: std::sync::OnceLock<std::collections::HashMap<ValueId, ParamId>>,
}

impl Graph {
    /// An empty graph.
    pub fn new(info: GraphInfo) -> Self {
        Self {
            info,
            values: Vec::new(),
            dataflow: DiGraph::new(),
            params: Vec::new(),
            param_index: std::sync::OnceLock::new(),
            blocks: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            locations: BTreeMap::new(),
        }
    }

    /// A graph with this one's info, blocks, step inputs and parameters (names, aliases and
    /// initialisation), in the same order, and no ops, outputs or optimizer state; with the new
    /// id of each value copied. Passes that rebuild a graph start from it.
    pub fn skeleton(&self) -> (Graph, std::collections::HashMap<ValueId, ValueId>) {
        let mut graph = Graph::new(self.info.clone());
        for block in &self.blocks {
            graph.add_block(block.name.clone(), block.kind);
        }
        let mut map = std::collections::HashMap::new();
        for &v in &self.inputs {
            let value = self.value(v);
            map.insert(v, graph.add_input(value.name.clone(), value.ty.clone()));
        }
        for p in &self.params {
            let value = self.value(p.value);
            let id = graph.add_param(
                p.name.clone(),
                value.ty.shape.clone(),
                value.ty.dtype,
                p.block,
            );
            for alias in &p.aliases {
                graph.add_param_alias(id, alias.clone());
            }
            graph.set_param_init(id, p.init);
            map.insert(p.value, graph.param(id).value);
        }
        (graph, map)
    }

    /// Adds a block.
    pub fn add_block(&mut self, name: impl Into<String>, kind: BlockKind) -> BlockId {
        self.blocks.push(Block {
            name: name.into(),
            kind,
        });
        BlockId::new(self.blocks.len() - 1)
    }

    fn add_value(
        &mut self,
        name: String,
        ty: TensorType,
        role: Role,
        producer: Option<OpId>,
    ) -> ValueId {
        self.values.push(Value {
            name,
            ty,
            role,
            producer,
        });
        ValueId::new(self.values.len() - 1)
    }

    /// Adds a step input (token ids, targets).
    pub fn add_input(&mut self, name: impl Into<String>, ty: TensorType) -> ValueId {
        let id = self.add_value(name.into(), ty, Role::Input, None);
        self.inputs.push(id);
        id
    }

    /// Adds a parameter with its Hugging Face name.
    pub fn add_param(
        &mut self,
        name: impl Into<String>,
        shape: impl Into<Vec<u64>>,
        dtype: DType,
        block: BlockId,
    ) -> ParamId {
        let name = name.into();
        let value = self.add_value(
            name.clone(),
            TensorType::new(shape, dtype),
            Role::Param,
            None,
        );
        self.param_index = std::sync::OnceLock::new();
        self.params.push(Param {
            name,
            aliases: Vec::new(),
            value,
            block,
            init: ParamInit::Normal { std: 0.02 },
        });
        ParamId::new(self.params.len() - 1)
    }

    /// Sets how a parameter is initialised (the default is normal with std 0.02).
    pub fn set_param_init(&mut self, param: ParamId, init: ParamInit) {
        self.params[param.index()].init = init;
    }

    /// Records another name the parameter goes by.
    pub fn add_param_alias(&mut self, param: ParamId, alias: impl Into<String>) {
        self.params[param.index()].aliases.push(alias.into());
    }

    /// Adds an op whose output types the kind infers from the inputs, and returns its first
    /// output (the loss of a cross-entropy, the output of an attention). Extra outputs are
    /// named `{name}.{label}` after [`OpKind::output_labels`] and are activations.
    pub fn add_op(
        &mut self,
        kind: OpKind,
        inputs: &[ValueId],
        name: impl Into<String>,
        role: Role,
        block: BlockId,
        phase: Phase,
    ) -> Result<ValueId> {
        let name = name.into();
        let labels = kind.output_labels();
        let outputs: Vec<(String, Role)> = labels
            .iter()
            .enumerate()
            .map(|(i, label)| match i {
                0 => (name.clone(), role),
                _ => (format!("{name}.{label}"), Role::Activation),
            })
            .collect();
        let values = self.add_op_multi(kind, inputs, &outputs, block, phase)?;
        values.first().copied().ok_or_else(|| {
            IrError::Invalid(format!(
                "{name}: an op without outputs has no value to return"
            ))
        })
    }

    /// Adds an op with a name and role for each output, and returns the outputs.
    pub fn add_op_multi(
        &mut self,
        kind: OpKind,
        inputs: &[ValueId],
        outputs: &[(String, Role)],
        block: BlockId,
        phase: Phase,
    ) -> Result<Vec<ValueId>> {
        self.check_operands(&kind, inputs, block)?;
        let types: Vec<&TensorType> = inputs.iter().map(|v| &self.values[v.index()].ty).collect();
        let inferred = kind.infer(&types)?;
        if inferred.len() != outputs.len() {
            return Err(IrError::Invalid(format!(
                "{} writes {} outputs, {} were named",
                kind.mnemonic(),
                inferred.len(),
                outputs.len()
            )));
        }
        let outputs = inferred
            .into_iter()
            .zip(outputs)
            .map(|(ty, (name, role))| (name.clone(), *role, ty));
        Ok(self.push_op(kind, inputs, outputs, block, phase))
    }

    /// Fails when an input of a new `kind` op or its block is undefined.
    fn check_operands(&self, kind: &OpKind, inputs: &[ValueId], block: BlockId) -> Result<()> {
        if let Some(v) = inputs.iter().find(|v| v.index() >= self.values.len()) {
            return Err(IrError::Invalid(format!(
                "{} reads undefined value {v}",
                kind.mnemonic()
            )));
        }
        if block.index() >= self.blocks.len() {
            return Err(IrError::Invalid(format!(
                "{} is in undefined {block}",
                kind.mnemonic()
            )));
        }
        Ok(())
    }

    /// Adds an op whose outputs' names, roles and types the caller gives, as a pass that
    /// copies ops from another graph does, without inferring the types again: the graph
    /// verifier ([`crate::verify::verify_graph`]), which runs after every pass, checks them.
    ///
    /// Fails when an input or the block is undefined.
    pub fn add_op_typed(
        &mut self,
        kind: OpKind,
        inputs: &[ValueId],
        outputs: Vec<(String, Role, TensorType)>,
        block: BlockId,
        phase: Phase,
    ) -> Result<Vec<ValueId>> {
        self.check_operands(&kind, inputs, block)?;
        Ok(self.push_op(kind, inputs, outputs, block, phase))
    }

    /// Appends an op with its outputs, and its dataflow edges; the inputs and block exist.
    fn push_op(
        &mut self,
        kind: OpKind,
        inputs: &[ValueId],
        outputs: impl IntoIterator<Item = (String, Role, TensorType)>,
        block: BlockId,
        phase: Phase,
    ) -> Vec<ValueId> {
        let op = OpId::new(self.dataflow.node_count());
        let out: Vec<ValueId> = outputs
            .into_iter()
            .map(|(name, role, ty)| self.add_value(name, ty, role, Some(op)))
            .collect();
        let node = self.dataflow.add_node(Op {
            kind,
            inputs: inputs.to_vec(),
            outputs: out.clone(),
            block,
            phase,
        });
        debug_assert_eq!(node.index(), op.index());
        for &v in inputs {
            if let Some(producer) = self.values[v.index()].producer {
                self.dataflow
                    .add_edge(NodeIndex::new(producer.index()), node, v);
            }
        }
        out
    }

    /// Makes room for `ops` more ops (with about two dataflow edges each) and `values` more
    /// values, so that a pass rebuilding a graph of known size does not grow its vectors by
    /// doubling (copying every op and value as it goes). Changes nothing else.
    pub fn reserve(&mut self, ops: usize, values: usize) {
        self.dataflow.reserve_nodes(ops);
        self.dataflow.reserve_edges(ops.saturating_mul(2));
        self.values.reserve(values);
    }

    /// Adds a value that is set from outside the step and persists across steps (optimizer
    /// state such as Adam moments).
    pub fn add_state(&mut self, name: impl Into<String>, ty: TensorType) -> ValueId {
        self.add_value(name.into(), ty, Role::OptimizerState, None)
    }

    /// Adds a gradient accumulator: a value set from outside each step (to zero), summed into
    /// by [`OpKind::AccumulateGrad`] ops and read by the optimizer.
    pub fn add_accumulator(&mut self, name: impl Into<String>, ty: TensorType) -> ValueId {
        self.add_value(name.into(), ty, Role::Accumulator, None)
    }

    /// Makes op `op` read `value` as its `index`-th input instead of what it read, keeping
    /// the dataflow edges in step. Fails, changing nothing, when either id or the index is out
    /// of range or the new value's type differs from the old one's.
    pub fn set_input(&mut self, op: OpId, index: usize, value: ValueId) -> Result<()> {
        if op.index() >= self.dataflow.node_count() || value.index() >= self.values.len() {
            return Err(IrError::Invalid(format!(
                "set_input: {op} or {value} is not in the graph"
            )));
        }
        let node = NodeIndex::new(op.index());
        let Some(&old) = self.dataflow[node].inputs.get(index) else {
            return Err(IrError::Invalid(format!(
                "set_input: {} has no input {index}",
                self.dataflow[node].kind.mnemonic()
            )));
        };
        if self.values[old.index()].ty != self.values[value.index()].ty {
            return Err(IrError::Invalid(format!(
                "set_input: {} is {}, but input {index} of {} is {}",
                self.values[value.index()].name,
                self.values[value.index()].ty,
                self.dataflow[node].kind.mnemonic(),
                self.values[old.index()].ty
            )));
        }
        if let Some(producer) = self.values[old.index()].producer {
            let from = NodeIndex::new(producer.index());
            if let Some(edge) = self
                .dataflow
                .edges_connecting(from, node)
                .find(|e| *e.weight() == old)
                .map(|e| e.id())
            {
                self.dataflow.remove_edge(edge);
            }
        }
        self.dataflow[node].inputs[index] = value;
        if let Some(producer) = self.values[value.index()].producer {
            self.dataflow
                .add_edge(NodeIndex::new(producer.index()), node, value);
        }
        Ok(())
    }

    /// Replaces op `op`'s kind with `kind`, which must infer the same output types from the
    /// op's inputs (a rescaled loss gradient, say). Fails, changing nothing, otherwise.
    pub fn set_kind(&mut self, op: OpId, kind: OpKind) -> Result<()> {
        if op.index() >= self.dataflow.node_count() {
            return Err(IrError::Invalid(format!(
                "set_kind: {op} is not in the graph"
            )));
        }
        let node = NodeIndex::new(op.index());
        let o = &self.dataflow[node];
        let types: Vec<&TensorType> = o
            .inputs
            .iter()
            .map(|v| &self.values[v.index()].ty)
            .collect();
        let inferred = kind.infer(&types)?;
        let outputs: Vec<&TensorType> = o
            .outputs
            .iter()
            .map(|v| &self.values[v.index()].ty)
            .collect();
        if inferred.iter().collect::<Vec<_>>() != outputs {
            return Err(IrError::Invalid(format!(
                "set_kind: {} does not write what {} writes",
                kind.mnemonic(),
                o.kind.mnemonic()
            )));
        }
        self.dataflow[node].kind = kind;
        Ok(())
    }

    /// Marks a value as a result of the step.
    pub fn add_output(&mut self, value: ValueId) {
        self.outputs.push(value);
    }

    /// Records where a value lives.
    pub fn set_location(&mut self, value: ValueId, location: Location) {
        self.locations.insert(value, location);
    }

    /// Where a value lives: device unless placement said otherwise.
    pub fn location(&self, value: ValueId) -> Location {
        self.locations
            .get(&value)
            .copied()
            .unwrap_or(Location::Device)
    }

    /// A value.
    pub fn value(&self, id: ValueId) -> &Value {
        &self.values[id.index()]
    }

    /// An op.
    pub fn op(&self, id: OpId) -> &Op {
        &self.dataflow[NodeIndex::new(id.index())]
    }

    /// A parameter.
    pub fn param(&self, id: ParamId) -> &Param {
        &self.params[id.index()]
    }

    /// A block.
    pub fn block(&self, id: BlockId) -> &Block {
        &self.blocks[id.index()]
    }

    /// Every value with its id.
    pub fn values(&self) -> impl ExactSizeIterator<Item = (ValueId, &Value)> {
        self.values
            .iter()
            .enumerate()
            .map(|(i, v)| (ValueId::new(i), v))
    }

    /// Every op with its id, in order.
    pub fn ops(&self) -> impl ExactSizeIterator<Item = (OpId, &Op)> {
        self.dataflow
            .raw_nodes()
            .iter()
            .enumerate()
            .map(|(i, node)| (OpId::new(i), &node.weight))
    }

    /// Every parameter with its id, in declaration order.
    pub fn params(&self) -> impl ExactSizeIterator<Item = (ParamId, &Param)> {
        self.params
            .iter()
            .enumerate()
            .map(|(i, p)| (ParamId::new(i), p))
    }

    /// Every block with its id, in forward order.
    pub fn blocks(&self) -> impl ExactSizeIterator<Item = (BlockId, &Block)> {
        self.blocks
            .iter()
            .enumerate()
            .map(|(i, b)| (BlockId::new(i), b))
    }

    /// The step's inputs.
    pub fn inputs(&self) -> &[ValueId] {
        &self.inputs
    }

    /// The step's outputs.
    pub fn outputs(&self) -> &[ValueId] {
        &self.outputs
    }

    /// Number of ops.
    pub fn op_count(&self) -> usize {
        self.dataflow.node_count()
    }

    /// The dataflow graph itself, for petgraph's algorithms: node `i` is `OpId(i)`.
    pub fn dataflow(&self) -> &DiGraph<Op, ValueId> {
        &self.dataflow
    }

    /// The ops that read a value, in order.
    pub fn users(&self, value: ValueId) -> Vec<OpId> {
        self.ops()
            .filter(|(_, op)| op.inputs.contains(&value))
            .map(|(id, _)| id)
            .collect()
    }

    /// Total trainable parameters (tied tensors counted once).
    pub fn param_count(&self) -> u64 {
        self.params
            .iter()
            .map(|p| self.value(p.value).ty.numel())
            .sum()
    }

    /// Whether the graph is a forward pass alone (an evaluation graph): it has no backward,
    /// recompute or optimizer op.
    pub fn is_forward_only(&self) -> bool {
        self.ops().all(|(_, op)| op.phase == Phase::Forward)
    }

    /// The micro-batches the loss gradient is scaled for: `K` when the cross-entropy backward
    /// is [`OpKind::CrossEntropyBackwardScaled`] (or its loss-scaled form), else 1. The
    /// compiler's accumulation pass and the search learn `K` from it.
    pub fn micro_batches(&self) -> u64 {
        self.ops()
            .find_map(|(_, op)| match op.kind {
                OpKind::CrossEntropyBackwardScaled { micro_batches }
                | OpKind::CrossEntropyBackwardLossScaled { micro_batches, .. } => {
                    Some(micro_batches)
                }
                _ => None,
            })
            .unwrap_or(1)
    }

    /// The parameter that a value holds, if it is one.
    pub fn param_of(&self, value: ValueId) -> Option<ParamId> {
        let index = self.param_index.get_or_init(|| {
            self.params
                .iter()
                .enumerate()
                .map(|(i, p)| (p.value, ParamId::new(i)))
                .collect()
        });
        index.get(&value).copied()
    }

    /// Serialises the graph as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a graph always serialises")
    }

    /// Reads a graph written by [`Graph::to_json`] and checks it with the verifier.
    pub fn from_json(text: &str) -> Result<Self> {
        let graph: Graph = serde_json::from_str(text)?;
        crate::verify::verify_graph(&graph)?;
        Ok(graph)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verify::verify_graph;
    use crate::DType;

    /// A graph with one op added by [`Graph::add_op_typed`], whose output has `ty`.
    fn copied_add(ty: TensorType) -> Graph {
        let mut g = Graph::new(GraphInfo {
            model: "typed".into(),
            batch: 1,
            seq: 4,
        });
        let block = g.add_block("body", BlockKind::Head);
        let x = g.add_input("x", TensorType::new([4, 8], DType::F32));
        let y = g.add_input("y", TensorType::new([4, 8], DType::F32));
        g.add_op_typed(
            OpKind::Add,
            &[x, y],
            vec![("sum".into(), Role::Activation, ty)],
            block,
            Phase::Forward,
        )
        .expect("inputs and block exist");
        g
    }

    #[test]
    fn a_typed_op_with_its_inferred_type_verifies() {
        let g = copied_add(TensorType::new([4, 8], DType::F32));
        verify_graph(&g).expect("the given type is the inferred one");
    }

    #[test]
    fn the_verifier_refuses_a_typed_op_whose_given_type_is_wrong() {
        let g = copied_add(TensorType::new([4, 9], DType::F32));
        let err = verify_graph(&g).expect_err("add of [4, 8] and [4, 8] is not [4, 9]");
        assert!(err.to_string().contains("sum"), "{err}");
    }

    #[test]
    fn a_typed_op_reading_an_undefined_value_is_refused() {
        let mut g = copied_add(TensorType::new([4, 8], DType::F32));
        let err = g
            .add_op_typed(
                OpKind::Add,
                &[ValueId::new(99), ValueId::new(0)],
                vec![(
                    "bad".into(),
                    Role::Activation,
                    TensorType::new([4, 8], DType::F32),
                )],
                BlockId::new(0),
                Phase::Forward,
            )
            .expect_err("value 99 does not exist");
        assert!(err.to_string().contains("undefined value"), "{err}");
    }
}
