//! The verifier: checks the invariants of a [`Graph`].
//!
//! Invariants of a graph:
//! - every id (value, op, block, parameter) is in range;
//! - every value is written exactly once: by its producer op, or from outside when it is an
//!   input, a parameter, optimizer state or a gradient accumulator, and the producer lists it
//!   as an output (the
//!   optimizer's in-place updates are not writes in this sense: they happen after every read);
//! - ops are in a topological order: an op reads only inputs, parameters, and outputs of earlier
//!   ops;
//! - each op has as many inputs as its kind takes, and its output's type is the one its kind
//!   infers from its inputs' types;
//! - each parameter's value has the role `param` and no producer;
//! - the graph's outputs exist;
//! - movement ops pair up and chunk slots hold one chunk at a time
//!   ([`crate::verify_movement`]).

use crate::error::{IrError, Result};
use crate::graph::{Graph, Role};
use crate::ids::OpId;
use crate::types::TensorType;

/// Checks every invariant in the module doc; the error names the first broken one.
pub fn verify_graph(graph: &Graph) -> Result<()> {
    let values = graph.values().len();
    let bad = |msg: String| Err(IrError::Invalid(msg));
    let mut written = vec![false; values];
    for (id, value) in graph.values() {
        match value.producer {
            None => {
                if !matches!(
                    value.role,
                    Role::Input | Role::Param | Role::OptimizerState | Role::Accumulator
                ) {
                    return bad(format!(
                        "{id} ({}) has no producer but is not an input, parameter, optimizer \
                         state or gradient accumulator",
                        value.name
                    ));
                }
                written[id.index()] = true;
            }
            Some(op) if op.index() >= graph.op_count() => {
                return bad(format!(
                    "{id} ({}) names producer {op}, which does not exist",
                    value.name
                ));
            }
            Some(_) => {}
        }
    }
    for (op_id, op) in graph.ops() {
        if op.block.index() >= graph.blocks().len() {
            return bad(format!(
                "{op_id} ({}) is in block {}, which does not exist",
                op.kind.mnemonic(),
                op.block
            ));
        }
        let mut types: Vec<&TensorType> = Vec::with_capacity(op.inputs.len());
        for &input in &op.inputs {
            if input.index() >= values || !written[input.index()] {
                return bad(format!(
                    "{op_id} ({}) reads {input} before it is written",
                    op.kind.mnemonic()
                ));
            }
            types.push(&graph.value(input).ty);
        }
        let inferred = op.kind.infer(&types)?;
        for &output in &op.outputs {
            if output.index() >= values {
                return bad(format!("{op_id} writes {output}, which does not exist"));
            }
            let value = graph.value(output);
            if value.producer != Some(op_id) {
                return bad(format!(
                    "{op_id} writes {output}, whose producer is {:?}",
                    value.producer.map(OpId::index)
                ));
            }
            if written[output.index()] {
                return bad(format!("{output} ({}) is written twice", value.name));
            }
            written[output.index()] = true;
        }
        if inferred.len() != op.outputs.len() {
            return bad(format!(
                "{op_id} ({}) has {} outputs, its kind writes {}",
                op.kind.mnemonic(),
                op.outputs.len(),
                inferred.len()
            ));
        }
        for (&output, ty) in op.outputs.iter().zip(&inferred) {
            let value = graph.value(output);
            if &value.ty != ty {
                return bad(format!(
                    "{op_id} ({}) writes {} as {} but its inputs give {ty}",
                    op.kind.mnemonic(),
                    value.name,
                    value.ty
                ));
            }
        }
    }
    for (id, param) in graph.params() {
        if param.value.index() >= values {
            return bad(format!(
                "{id} ({}) holds {}, which does not exist",
                param.name, param.value
            ));
        }
        let value = graph.value(param.value);
        if value.role != Role::Param || value.producer.is_some() {
            return bad(format!(
                "{id} ({}) holds {}, which is not a parameter value",
                param.name, param.value
            ));
        }
    }
    for &output in graph.outputs() {
        if output.index() >= values {
            return bad(format!("graph output {output} does not exist"));
        }
    }
    crate::verify_movement::verify_movement(graph)
}
