//! The canonical text form of a [`Graph`]: stable, with values renumbered in definition order,
//! so dumps diff cleanly and make good snapshots.

use crate::graph::{BlockKind, Graph, Role};
use crate::ids::{BlockId, ValueId};
use crate::op::{Op, OpKind, Phase};
use crate::types::{format_bytes, format_count};
use std::fmt::Write;

/// The canonical name of every value, indexed by [`ValueId`], as [`print_graph`] numbers them:
/// `%0, %1, ..` for inputs, then optimizer state without a producer, then op outputs in op
/// order; parameters print as `@hf.name`.
///
pub fn value_names(graph: &Graph) -> Vec<String> {
    let mut names: Vec<Option<String>> = vec![None; graph.values().len()];
    let mut next = 0usize;
    let mut number = |names: &mut Vec<Option<String>>, v: ValueId| {
        if let Some(slot) = names.get_mut(v.index()) {
            *slot = Some(format!("%{next}"));
        }
        next += 1;
    };
    for &v in graph.inputs() {
        number(&mut names, v);
    }
    for (_, p) in graph.params() {
        if let Some(slot) = names.get_mut(p.value.index()) {
            *slot = Some(format!("@{}", p.name));
        }
    }
    for (id, v) in graph.values() {
        if v.role == Role::OptimizerState && v.producer.is_none() {
            number(&mut names, id);
        }
    }
    for (_, op) in graph.ops() {
        for &v in &op.outputs {
            number(&mut names, v);
        }
    }
    names
        .into_iter()
        .enumerate()
        .map(|(i, n)| n.unwrap_or_else(|| format!("<undefined {}>", ValueId::new(i))))
        .collect()
}

/// A movement op's line: `%57, %58 = gather chunk3 -> slot1 (@w, @b)  ; 130.5 KiB`, its
/// outputs, mnemonic, chunk and slot, what it reads, and the bytes it moves (`release chunk3
/// slot1 (%57, %58)` for a release); `None` for a compute op.
fn movement_line(graph: &Graph, op: &Op, name: &dyn Fn(&ValueId) -> String) -> Option<String> {
    let (operands, bytes) = match op.kind {
        OpKind::MoveStart(m) | OpKind::MoveDone(m) => (m.operands(), true),
        OpKind::Release { chunk, slot } => (format!("chunk{} slot{slot}", chunk.0), false),
        _ => return None,
    };
    let list = |values: &[ValueId]| values.iter().map(name).collect::<Vec<_>>().join(", ");
    let mut line = String::new();
    if !op.outputs.is_empty() {
        let _ = write!(line, "{} = ", list(&op.outputs));
    }
    line.push_str(op.kind.mnemonic());
    if !operands.is_empty() {
        let _ = write!(line, " {operands}");
    }
    let _ = write!(line, " ({})", list(&op.inputs));
    if bytes {
        let moved: u64 = op.inputs.iter().map(|v| graph.value(*v).ty.bytes()).sum();
        let _ = write!(line, "  ; {}", format_bytes(moved));
    }
    Some(line)
}

/// Prints a graph in its canonical text form.
///
/// Values are numbered `%0, %1, ..` in the order they are defined (inputs, then op outputs);
/// parameters print as `@hf.name`. Ops are grouped into sections, one per run of ops with the
/// same phase and block. Each op line ends with the role and size of what it writes.
pub fn print_graph(graph: &Graph) -> String {
    let names = value_names(graph);
    let name = |v: &ValueId| {
        names
            .get(v.index())
            .cloned()
            .unwrap_or_else(|| format!("<undefined {v}>"))
    };
    let states: Vec<ValueId> = graph
        .values()
        .filter(|(_, v)| v.role == Role::OptimizerState && v.producer.is_none())
        .map(|(id, _)| id)
        .collect();

    let mut out = String::new();
    let param_count = graph.param_count();
    let param_bytes: u64 = graph
        .params()
        .map(|(_, p)| graph.value(p.value).ty.bytes())
        .sum();
    let _ = writeln!(
        out,
        "; graph {}  batch {}  seq {}",
        graph.info.model, graph.info.batch, graph.info.seq
    );
    let _ = writeln!(
        out,
        "; {} parameters ({}), {} ops",
        format_count(param_count),
        format_bytes(param_bytes),
        graph.op_count()
    );

    out.push_str("\ninputs:\n");
    for &v in graph.inputs() {
        let value = graph.value(v);
        let _ = writeln!(out, "  {}: {}  ; {}", name(&v), value.ty, value.name);
    }

    out.push_str("\nparams:\n");
    for (_, p) in graph.params() {
        let ty = &graph.value(p.value).ty;
        let _ = write!(out, "  @{}: {}  ; {}", p.name, ty, format_bytes(ty.bytes()));
        if !p.aliases.is_empty() {
            let _ = write!(out, ", also {}", p.aliases.join(", "));
        }
        out.push('\n');
    }

    if !states.is_empty() {
        out.push_str("\nstate:\n");
        for &v in &states {
            let value = graph.value(v);
            let _ = writeln!(
                out,
                "  {}: {}  ; {} {}",
                name(&v),
                value.ty,
                value.name,
                format_bytes(value.ty.bytes())
            );
        }
    }

    let mut section: Option<(Phase, BlockId)> = None;
    for (_, op) in graph.ops() {
        if section != Some((op.phase, op.block)) {
            section = Some((op.phase, op.block));
            let block = graph.block(op.block);
            let what = match block.kind {
                BlockKind::Embedding => "embeddings".to_string(),
                BlockKind::Layer(i) => format!("layer {i}"),
                BlockKind::Head => "head".to_string(),
            };
            let _ = writeln!(out, "\n{} {} ({}):", op.phase, what, block.name);
        }
        if let Some(line) = movement_line(graph, op, &name) {
            let _ = writeln!(out, "  {line}");
            continue;
        }
        let outputs: Vec<String> = op
            .outputs
            .iter()
            .map(|v| format!("{}: {}", name(v), graph.value(*v).ty))
            .collect();
        let attrs = op.kind.attributes();
        let mut kind = op.kind.mnemonic().to_string();
        if !attrs.is_empty() {
            let list: Vec<String> = attrs.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let _ = write!(kind, "[{}]", list.join(", "));
        }
        let inputs: Vec<String> = op.inputs.iter().map(name).collect();
        if outputs.is_empty() {
            let _ = write!(out, "  {} {}", kind, inputs.join(", "));
        } else {
            let _ = write!(
                out,
                "  {} = {} {}",
                outputs.join(", "),
                kind,
                inputs.join(", ")
            );
        }
        if let Some(&first) = op.outputs.first() {
            let value = graph.value(first);
            let bytes: u64 = op.outputs.iter().map(|v| graph.value(*v).ty.bytes()).sum();
            match value.role {
                Role::Loss => out.push_str("  ; loss"),
                role => {
                    let _ = write!(out, "  ; {} {}", role.name(), format_bytes(bytes));
                }
            }
        }
        out.push('\n');
    }

    if !graph.outputs().is_empty() {
        let list: Vec<String> = graph.outputs().iter().map(name).collect();
        let _ = writeln!(out, "\noutputs: {}", list.join(", "));
    }
    out
}
