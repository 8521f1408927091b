//! The canonical text form of a [`Schedule`]: header, chunk table, buffer table, streams; and
//! of a [`ChunkTable`] on its own.

use crate::chunks::{ChunkMember, ChunkTable};
use crate::graph::Graph;
use crate::ids::{BufferId, OpId, ValueId};
use crate::schedule::{
    Buffer, BufferKind, CopyKind, Instr, Schedule, Space, StreamKind, TensorRef,
};
use crate::types::{format_bytes, format_count};
use std::fmt::Write;

impl Schedule {
    /// The canonical text form; see [`print_schedule`].
    pub fn to_text(&self) -> String {
        print_schedule(self)
    }
}

/// The word for a space: `device` or `host`.
pub fn space_name(space: Space) -> &'static str {
    match space {
        Space::Device => "device",
        Space::Host => "host",
    }
}

/// The words for a stream kind: `compute`, `host-to-device`, `device-to-host`,
/// `host optimizer`.
pub fn stream_kind_name(kind: StreamKind) -> &'static str {
    match kind {
        StreamKind::Compute => "compute",
        StreamKind::HostToDevice => "host-to-device",
        StreamKind::DeviceToHost => "device-to-host",
        StreamKind::HostOptimizer => "host optimizer",
    }
}

/// What a buffer holds, in a few words: `slot1`, `host chunk3`, `activation`.
pub fn buffer_kind_label(kind: BufferKind) -> String {
    match kind {
        BufferKind::Input => "input".into(),
        BufferKind::PersistentChunk { chunk } => format!("persistent {chunk}"),
        BufferKind::ChunkSlot { slot } => format!("slot{slot}"),
        BufferKind::HostChunk { chunk } => format!("host {chunk}"),
        BufferKind::GradChunk { chunk } => format!("grads {chunk}"),
        BufferKind::HostGradChunk { chunk } => format!("host grads {chunk}"),
        BufferKind::OptimizerState { chunk } => format!("state {chunk}"),
        BufferKind::Activation => "activation".into(),
        BufferKind::HostActivation => "host activation".into(),
        BufferKind::Workspace => "workspace".into(),
    }
}

/// What a copy moves: `fetch chunk3`, `offload %41`, `reload %41`, `offload_grads chunk3`,
/// `scalar %90`.
pub fn copy_label(what: CopyKind, names: &[String]) -> String {
    let name = |v: ValueId| {
        names
            .get(v.index())
            .cloned()
            .unwrap_or_else(|| format!("<undefined {v}>"))
    };
    match what {
        CopyKind::FetchChunk { chunk } => format!("fetch {chunk}"),
        CopyKind::OffloadGrads { chunk } => format!("offload_grads {chunk}"),
        CopyKind::OffloadActivation { value } => format!("offload {}", name(value)),
        CopyKind::ReloadActivation { value } => format!("reload {}", name(value)),
        CopyKind::Scalar { value } => format!("scalar {}", name(value)),
    }
}

/// Prints a schedule in its canonical text form.
///
/// Values are named as [`print_graph`](crate::print::print_graph) names them (see
/// [`value_names`]), buffers are listed by space and offset, and each stream's instructions
/// follow one per line with their index (`#12`), which the verifier's errors cite. It prints
/// schedules that do not verify too, marking ids that are out of range, so that a broken
/// schedule can be dumped and read.
pub fn print_schedule(s: &Schedule) -> String {
    let names = crate::print::value_names(&s.graph);
    let mut out = String::new();
    header(s, &mut out);
    chunk_table(&s.chunks, &s.graph, &mut out);
    buffer_table(s, &mut out);
    homes(s, &names, &mut out);
    for (i, stream) in s.streams.iter().enumerate() {
        let _ = writeln!(
            out,
            "\nstream{i} {} ({}): {} instructions",
            stream.name,
            stream_kind_name(stream.kind),
            stream.instrs.len()
        );
        for (k, instr) in stream.instrs.iter().enumerate() {
            let _ = writeln!(out, "  #{k:<4} {}", instr_text(s, &names, instr));
        }
    }
    out
}

fn header(s: &Schedule, out: &mut String) {
    let h = &s.header;
    let p = &h.prediction;
    let _ = writeln!(
        out,
        "; schedule {}  batch {}  seq {}  dtype {}  (format {})",
        h.model, h.batch, h.seq, h.dtype, h.format_version
    );
    let _ = writeln!(
        out,
        "; {} parameters, {} ops, {} streams, {} events",
        format_count(h.param_count),
        s.graph.op_count(),
        s.streams.len(),
        s.events
    );
    let _ = writeln!(out, "; hardware: {}", h.hardware);
    let _ = writeln!(
        out,
        "; budget: device {}, host {}",
        format_bytes(h.device_budget_bytes),
        format_bytes(h.host_budget_bytes)
    );
    let _ = writeln!(out, "; policy: {}", h.policy);
    let busy: Vec<String> = p
        .stream_busy_seconds
        .iter()
        .enumerate()
        .map(|(i, secs)| {
            let name = s
                .streams
                .get(i)
                .map_or_else(|| format!("stream{i}"), |st| st.name.clone());
            format!("{name} {}", format_seconds(*secs))
        })
        .collect();
    let _ = write!(out, "; predicted step: {}", format_seconds(p.step_seconds));
    if !busy.is_empty() {
        let _ = write!(out, " (busy: {})", busy.join(", "));
    }
    let _ = writeln!(out, ", {} FLOP", format_count(p.flops));
    let gap = p.peak_device_bytes.saturating_sub(p.lower_bound_bytes);
    let pct = if p.lower_bound_bytes == 0 {
        0.0
    } else {
        100.0 * gap as f64 / p.lower_bound_bytes as f64
    };
    let _ = writeln!(
        out,
        "; device: arena {}, peak {}, lower bound {} (gap {}, {pct:.1}%)",
        format_bytes(s.arena_bytes),
        format_bytes(p.peak_device_bytes),
        format_bytes(p.lower_bound_bytes),
        format_bytes(gap)
    );
    let _ = writeln!(
        out,
        "; host: region {}, predicted {}",
        format_bytes(s.host_bytes),
        format_bytes(p.host_bytes)
    );
    let m = &p.memory;
    let _ = writeln!(
        out,
        "; device at peak: persistent {}, chunk buffers {}, activations {}, workspace {}, inputs {}",
        format_bytes(m.persistent),
        format_bytes(m.chunk_buffers),
        format_bytes(m.activations),
        format_bytes(m.workspace),
        format_bytes(m.inputs)
    );
    if !h.report.trim().is_empty() {
        out.push_str("; report:\n");
        for line in h.report.trim_end().lines() {
            let _ = writeln!(out, ";   {line}");
        }
    }
}

fn format_seconds(secs: f64) -> String {
    if secs >= 1.0 {
        format!("{secs:.3} s")
    } else if secs >= 1e-3 {
        format!("{:.3} ms", secs * 1e3)
    } else {
        format!("{:.3} us", secs * 1e6)
    }
}

/// Prints a chunk table: the chunk size, each chunk's used bytes and parameters (each with
/// its offset and size), and the chunk sizes the search tried, best first. `graph` names the
/// parameters; a parameter it does not have prints as `<undefined param3>`.
///
/// The schedule printer shows the same table in short form (first and last parameter of
/// each chunk); `protrain dump --stage chunked` prints this one.
pub fn print_chunk_table(chunks: &ChunkTable, graph: &Graph) -> String {
    let mut out = String::new();
    chunk_table(chunks, graph, &mut out);
    let _ = writeln!(out, "\nchunk members:");
    for (id, c) in chunks.iter() {
        let _ = writeln!(
            out,
            "  {id}: {} params, {} of {}",
            c.members.len(),
            format_bytes(c.used_bytes),
            format_bytes(chunks.chunk_bytes)
        );
        for m in &c.members {
            let _ = writeln!(
                out,
                "    {:>12} {:>10}  {}",
                format!("{:#x}", m.offset),
                format_bytes(m.bytes),
                param_name(graph, m)
            );
        }
    }
    let _ = writeln!(
        out,
        "\nchunk sizes tried: {} (best first)",
        chunks.trials.len()
    );
    for t in &chunks.trials {
        let _ = writeln!(
            out,
            "  {:>10}  {:>5} chunks  waste {}",
            format_bytes(t.chunk_bytes),
            t.chunks,
            format_bytes(t.waste_bytes)
        );
    }
    out
}

/// `@h.0.attn.c_attn.weight`, or `<undefined param3>` for a parameter the graph lacks.
fn param_name(graph: &Graph, m: &ChunkMember) -> String {
    if m.param.index() < graph.params().len() {
        format!("@{}", graph.param(m.param).name)
    } else {
        format!("<undefined {}>", m.param)
    }
}

/// The chunk table in short form: a summary line, then one line per chunk with its used
/// bytes, parameter count and first and last parameter.
fn chunk_table(t: &ChunkTable, graph: &Graph, out: &mut String) {
    let used: u64 = t.chunks.iter().map(|c| c.used_bytes).sum();
    let _ = writeln!(
        out,
        "\nchunks: {} x {}, {} used, waste {}, world size {}",
        t.len(),
        format_bytes(t.chunk_bytes),
        format_bytes(used),
        format_bytes(
            t.chunks
                .iter()
                .map(|c| t.chunk_bytes.saturating_sub(c.used_bytes))
                .sum()
        ),
        t.world_size
    );
    for (id, c) in t.iter() {
        let params = match (c.members.first(), c.members.last()) {
            (Some(first), Some(last)) if c.members.len() > 1 => {
                format!(
                    "{} .. {}",
                    param_name(graph, first),
                    param_name(graph, last)
                )
            }
            (Some(only), _) => param_name(graph, only),
            _ => "-".into(),
        };
        let _ = writeln!(
            out,
            "  {:<8} {:>10}  {:>4} params  {}",
            id.to_string(),
            format_bytes(c.used_bytes),
            c.members.len(),
            params
        );
    }
}

fn buffer_table(s: &Schedule, out: &mut String) {
    let _ = writeln!(
        out,
        "\nbuffers: {}, arena {}, host region {}",
        s.buffers.len(),
        format_bytes(s.arena_bytes),
        format_bytes(s.host_bytes)
    );
    let mut order: Vec<(usize, &Buffer)> = s.buffers.iter().enumerate().collect();
    order.sort_by_key(|(i, b)| (b.space, b.offset, *i));
    for (i, b) in order {
        let _ = writeln!(
            out,
            "  {:<7} {:<6} {:>12} {:>10}  {:<18} {}",
            BufferId::new(i).to_string(),
            space_name(b.space),
            format!("{:#x}", b.offset),
            format_bytes(b.size),
            buffer_kind_label(b.kind),
            b.name
        );
    }
}

fn homes(s: &Schedule, names: &[String], out: &mut String) {
    let _ = writeln!(out, "\nhomes: {}", s.homes.len());
    for &(v, t) in &s.homes {
        let name = value_name(names, v);
        let readable = if v.index() < s.graph.values().len() && !name.starts_with('@') {
            format!(" ({})", s.graph.value(v).name)
        } else {
            String::new()
        };
        let _ = writeln!(out, "  {name}{readable} at {}", place(s, t));
    }
    if !s.masters.is_empty() {
        let _ = writeln!(out, "f32 master weights: {}", s.masters.len());
        for &(v, t) in &s.masters {
            let _ = writeln!(out, "  {} at {}", value_name(names, v), place(s, t));
        }
    }
    let _ = writeln!(out, "loss at {}", place(s, s.loss));
}

fn value_name(names: &[String], v: ValueId) -> String {
    names
        .get(v.index())
        .cloned()
        .unwrap_or_else(|| format!("<undefined {v}>"))
}

/// `buf3` or `buf3+0x40`.
fn tensor_ref(t: TensorRef) -> String {
    if t.offset == 0 {
        t.buffer.to_string()
    } else {
        format!("{}+{:#x}", t.buffer, t.offset)
    }
}

/// `device[+0x40]`: the absolute address of a tensor in its space.
fn address(s: &Schedule, t: TensorRef) -> String {
    match s.buffers.get(t.buffer.index()) {
        Some(b) => format!(
            "{}[+{:#x}]",
            space_name(b.space),
            b.offset.saturating_add(t.offset)
        ),
        None => format!("<undefined {}>", t.buffer),
    }
}

/// `buf3+0x8 = device[+0x48]`.
fn place(s: &Schedule, t: TensorRef) -> String {
    format!("{} = {}", tensor_ref(t), address(s, t))
}

fn instr_text(s: &Schedule, names: &[String], instr: &Instr) -> String {
    match instr {
        Instr::Kernel {
            op,
            inputs,
            outputs,
            workspace,
        } => kernel_text(s, names, *op, inputs, outputs, *workspace),
        Instr::Copy {
            what,
            src,
            dst,
            bytes,
        } => format!(
            "copy {} {} -> {} {}",
            copy_label(*what, names),
            address(s, *src),
            address(s, *dst),
            format_bytes(*bytes)
        ),
        Instr::Record { event } => format!("record e{}", event.0),
        Instr::Wait { event } => format!("wait e{}", event.0),
    }
}

fn kernel_text(
    s: &Schedule,
    names: &[String],
    op: OpId,
    inputs: &[TensorRef],
    outputs: &[TensorRef],
    workspace: Option<TensorRef>,
) -> String {
    let refs = |ts: &[TensorRef]| -> String {
        ts.iter()
            .map(|t| tensor_ref(*t))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut text = if op.index() < s.graph.op_count() {
        let o = s.graph.op(op);
        let list = |vs: &[ValueId]| -> String {
            vs.iter()
                .map(|v| value_name(names, *v))
                .collect::<Vec<_>>()
                .join(", ")
        };
        if o.outputs.is_empty() {
            format!("kernel {} {}", o.kind.mnemonic(), list(&o.inputs))
        } else {
            format!(
                "kernel {} {} <- {}",
                o.kind.mnemonic(),
                list(&o.outputs),
                list(&o.inputs)
            )
        }
    } else {
        format!("kernel <undefined {op}>")
    };
    let _ = write!(text, "  ; ");
    if !outputs.is_empty() {
        let _ = write!(text, "{} <- ", refs(outputs));
    }
    text.push_str(&refs(inputs));
    if let Some(w) = workspace {
        let _ = write!(text, "; workspace {}", tensor_ref(w));
    }
    text
}
