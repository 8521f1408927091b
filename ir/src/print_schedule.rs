//! The canonical text form of a [`Schedule`]: header, chunk table, buffer table, streams; and
//! of a [`ChunkTable`] on its own.
//!
//! Buffers are numbered as the text first mentions them ([`BufferNumbering`]), not by their
//! ids in the schedule, so a schedule prints the same however the compiler happened to number
//! its buffers, and snapshots of it stay stable.

use crate::chunks::{ChunkMember, ChunkTable};
use crate::graph::Graph;
use crate::ids::{BufferId, OpId, ValueId};
use crate::schedule::{
    Buffer, BufferKind, CopyKind, Instr, Schedule, ShardPart, Space, StreamKind, TensorRef,
};
use crate::types::{format_bytes, format_count};
use std::fmt::Write;

impl Schedule {
    /// The canonical text form, search report included; see [`print_schedule`].
    pub fn to_text(&self) -> String {
        print_schedule(self)
    }

    /// The canonical text form with `options`; see [`print_schedule_with`].
    pub fn to_text_with(&self, options: PrintOptions) -> String {
        print_schedule_with(self, options)
    }
}

/// What the schedule printer includes beyond the schedule itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrintOptions {
    /// The header's search report (`; report:` and the lines under it): why this policy, and
    /// what fusion found. It describes how the schedule was chosen, not what it does.
    pub report: bool,
}

impl PrintOptions {
    /// Everything: what [`Schedule::to_text`] prints.
    pub const FULL: PrintOptions = PrintOptions { report: true };
    /// The schedule without its search report: for snapshots, which should change when the
    /// schedule does and not when the search's account of itself does.
    pub const WITHOUT_REPORT: PrintOptions = PrintOptions { report: false };
}

impl Default for PrintOptions {
    /// [`PrintOptions::FULL`].
    fn default() -> Self {
        PrintOptions::FULL
    }
}

/// The numbers the printer (and the verifier's messages) give a schedule's buffers: in the
/// order the printed schedule first mentions them (the homes, the master weights, `loss`,
/// then each stream's instructions in turn: a kernel's outputs, inputs and workspace, a
/// copy's source and destination), then the buffers nothing mentions, by space, offset, size
/// and name.
///
/// It depends on what the schedule says, not on the order its buffer table lists the
/// buffers in, so two schedules that differ only in that order print the same.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferNumbering {
    /// The printed number of each buffer, by [`BufferId`].
    numbers: Vec<BufferId>,
}

impl BufferNumbering {
    /// Numbers the buffers of `s`. Ids out of range (in a schedule that does not verify) are
    /// skipped; [`label`](Self::label) prints them as they are.
    pub fn of(s: &Schedule) -> Self {
        let n = s.buffers.len();
        // Buffer indices in the order they are numbered.
        let mut order: Vec<usize> = Vec::with_capacity(n);
        let mut seen = vec![false; n];
        let mut mention = |t: TensorRef| {
            if let Some(seen @ false) = seen.get_mut(t.buffer.index()) {
                *seen = true;
                order.push(t.buffer.index());
            }
        };
        for &(_, t) in s.homes.iter().chain(&s.masters) {
            mention(t);
        }
        mention(s.loss);
        for instr in s.streams.iter().flat_map(|stream| &stream.instrs) {
            match instr {
                Instr::Kernel {
                    inputs,
                    outputs,
                    workspace,
                    ..
                } => outputs
                    .iter()
                    .chain(inputs)
                    .chain(workspace)
                    .for_each(|&t| mention(t)),
                Instr::Copy { src, dst, .. } => {
                    mention(*src);
                    mention(*dst);
                }
                Instr::AllReduce { at, .. }
                | Instr::AllGather { at, .. }
                | Instr::ReduceScatter { at, .. } => mention(*at),
                Instr::CopyShard { src, dst, .. }
                | Instr::DiskRead { src, dst, .. }
                | Instr::DiskWrite { src, dst, .. }
                | Instr::CastChunk { src, dst, .. } => {
                    mention(*src);
                    mention(*dst);
                }
                Instr::Record { .. } | Instr::Wait { .. } | Instr::EndMicroBatch { .. } => {}
            }
        }
        let mut unmentioned: Vec<usize> = (0..n).filter(|&i| !seen[i]).collect();
        unmentioned.sort_by(|&i, &j| {
            let (a, b) = (&s.buffers[i], &s.buffers[j]);
            (a.space, a.offset, a.size, &a.name).cmp(&(b.space, b.offset, b.size, &b.name))
        });
        order.extend(unmentioned);
        let mut numbers = vec![BufferId(0); n];
        for (number, &i) in order.iter().enumerate() {
            numbers[i] = BufferId::new(number);
        }
        Self { numbers }
    }

    /// The printed number of buffer `b`, if it exists.
    pub fn get(&self, b: BufferId) -> Option<BufferId> {
        self.numbers.get(b.index()).copied()
    }

    /// `buf7`, as the printer names buffer `b`; `<undefined buf99>` for one that does not
    /// exist.
    pub fn label(&self, b: BufferId) -> String {
        match self.get(b) {
            Some(n) => n.to_string(),
            None => format!("<undefined {b}>"),
        }
    }
}

/// The word for a space: `device` or `host`.
pub fn space_name(space: Space) -> &'static str {
    match space {
        Space::Device => "device",
        Space::Host => "host",
        Space::Disk => "disk",
    }
}

/// The words for a stream kind: `compute`, `host-to-device`, `device-to-host`,
/// `host optimizer`, `collective`, `disk i/o`, `host cast`.
pub fn stream_kind_name(kind: StreamKind) -> &'static str {
    match kind {
        StreamKind::Compute => "compute",
        StreamKind::HostToDevice => "host-to-device",
        StreamKind::DeviceToHost => "device-to-host",
        StreamKind::HostOptimizer => "host optimizer",
        StreamKind::Collective { .. } => "collective",
        StreamKind::DiskIo => "disk i/o",
        StreamKind::HostCast => "host cast",
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
        BufferKind::Accumulators => "accumulators".into(),
        BufferKind::HostScratch => "host scratch".into(),
        BufferKind::HostShard { chunk, part } => format!("shard {chunk} {}", part_name(part)),
        BufferKind::ShardStaging { slot, part } => {
            format!("disk staging {} shard{slot}", part_name(part))
        }
        BufferKind::DiskStaging { slot } => format!("disk staging{slot}"),
        BufferKind::ParamStaging { slot } => format!("param staging{slot}"),
        BufferKind::GradStaging { slot } => format!("grad staging{slot}"),
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

/// Prints a schedule in its canonical text form, search report included:
/// [`print_schedule_with`] and [`PrintOptions::FULL`].
pub fn print_schedule(s: &Schedule) -> String {
    print_schedule_with(s, PrintOptions::FULL)
}

/// Prints a schedule in its canonical text form.
///
/// Values are named as [`print_graph`](crate::print::print_graph) names them (see
/// [`value_names`](crate::print::value_names)), buffers are numbered as [`BufferNumbering`]
/// says and listed by space and offset, and each stream's instructions follow one per line
/// with their index (`#12`); the verifier's errors cite both. It prints schedules that do not
/// verify too, marking ids that are out of range, so that a broken schedule can be dumped and
/// read.
pub fn print_schedule_with(s: &Schedule, options: PrintOptions) -> String {
    let cx = Cx {
        s,
        names: crate::print::value_names(&s.graph),
        buffers: BufferNumbering::of(s),
    };
    let mut out = String::new();
    header(s, options, &mut out);
    chunk_table(&s.chunks, &s.graph, &mut out);
    buffer_table(&cx, &mut out);
    homes(&cx, &mut out);
    for (i, stream) in s.streams.iter().enumerate() {
        let _ = writeln!(
            out,
            "\nstream{i} {} ({}): {} instructions{}",
            stream.name,
            stream_kind_name(stream.kind),
            stream.instrs.len(),
            match stream.carried_writes() {
                0 => String::new(),
                n => format!(", the first {n} carried from the previous step"),
            }
        );
        for (k, instr) in stream.instrs.iter().enumerate() {
            let _ = writeln!(out, "  #{k:<4} {}", instr_text(&cx, instr));
        }
    }
    out
}

/// What a disk read or write moves, by the disk buffer it addresses: a chunk's optimizer
/// state, parameters or gradients.
fn disk_part(cx: &Cx, t: TensorRef) -> &'static str {
    match cx.s.buffers.get(t.buffer.index()).map(|b| b.kind) {
        Some(BufferKind::HostChunk { .. }) => "params",
        Some(BufferKind::HostGradChunk { .. }) => "grads",
        Some(BufferKind::HostShard { part, .. }) => match part {
            ShardPart::Params => "params shard",
            ShardPart::Grads => "grads shard",
            _ => "state shard",
        },
        _ => "state",
    }
}

/// The note on a disk transfer of a shard (`t` its disk side): each rank moves its own
/// slice, in its own file; empty for a whole buffer.
fn per_rank(cx: &Cx, t: TensorRef) -> &'static str {
    match cx.s.buffers.get(t.buffer.index()) {
        Some(b) if b.kind.is_sharded() => " per rank  ; rank r: its slice, in its own file",
        _ => "",
    }
}

/// A schedule being printed, with the names its text gives values and buffers.
struct Cx<'a> {
    s: &'a Schedule,
    names: Vec<String>,
    buffers: BufferNumbering,
}

fn header(s: &Schedule, options: PrintOptions, out: &mut String) {
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
    if s.graph.is_forward_only() {
        let _ = writeln!(
            out,
            "; forward only: the loss and nothing else (no backward pass, no optimizer)"
        );
    }
    let k = s.micro_batches_per_step();
    if s.is_chunk_major() {
        let _ = writeln!(
            out,
            "; gradient accumulation, chunk-major: {k} micro-batches of batch {} per step \
             (tokens from (step*{k} + m)*batch*seq) run through each layer in turn in one \
             program; the update runs once after them",
            h.batch
        );
    } else if k > 1 {
        let _ = writeln!(
            out,
            "; gradient accumulation: {k} micro-batches of batch {} per step (tokens from \
             (step*{k} + m)*batch*seq); the update runs once after them",
            h.batch
        );
    }
    let (gpus, nodes) = s.topology();
    if gpus * nodes > 1 {
        let _ = writeln!(
            out,
            "; data parallel: {w} ranks ({gpus} GPUs x {nodes} nodes) run this schedule, \
             each on its own rows (rank r, micro-batch m reads tokens from \
             ((step*{w} + r)*{k} + m)*batch*seq); gradients are summed over the ranks on the \
             collective stream{}",
            match s.sharded() {
                true =>
                    "; offloaded chunks are sharded: each rank holds 1/ranks of their host \
                         state, all-gathers them before use and reduce-scatters their gradients",
                false => "",
            },
            w = gpus * nodes
        );
    }
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
    if s.disk_bytes > 0 {
        let _ = writeln!(
            out,
            "; disk: region {} of {} budget, the optimizer state of {} chunk(s)",
            format_bytes(s.disk_bytes),
            format_bytes(s.header.disk_budget_bytes),
            s.disk_chunks().len()
        );
    }
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
    if options.report && !h.report.trim().is_empty() {
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

fn buffer_table(cx: &Cx, out: &mut String) {
    let s = cx.s;
    let _ = writeln!(
        out,
        "\nbuffers: {}, arena {}, host region {}",
        s.buffers.len(),
        format_bytes(s.arena_bytes),
        format_bytes(s.host_bytes)
    );
    let mut order: Vec<(BufferId, &Buffer)> = s
        .buffers
        .iter()
        .enumerate()
        .map(|(i, b)| (cx.buffers.get(BufferId::new(i)).expect("in range"), b))
        .collect();
    order.sort_by_key(|&(n, b)| (b.space, b.offset, n));
    for (n, b) in order {
        // A padded buffer shows its row pitch beside its value's row length.
        let pitch = match b.pitch {
            Some(p) => {
                let row = match p.value.index() < s.graph.values().len() {
                    true => s.graph.value(p.value).ty.last_dim().to_string(),
                    false => "?".into(),
                };
                format!("  pitch {} (row {row})", p.pitch)
            }
            None => String::new(),
        };
        let _ = writeln!(
            out,
            "  {:<7} {:<6} {:>12} {:>10}  {:<18} {}{pitch}",
            n.to_string(),
            space_name(b.space),
            format!("{:#x}", b.offset),
            format_bytes(b.size),
            buffer_kind_label(b.kind),
            b.name
        );
    }
}

fn homes(cx: &Cx, out: &mut String) {
    let s = cx.s;
    let _ = writeln!(out, "\nhomes: {}", s.homes.len());
    for &(v, t) in &s.homes {
        let name = value_name(&cx.names, v);
        let readable = if v.index() < s.graph.values().len() && !name.starts_with('@') {
            format!(" ({})", s.graph.value(v).name)
        } else {
            String::new()
        };
        let _ = writeln!(out, "  {name}{readable} at {}", place(cx, t));
    }
    if !s.masters.is_empty() {
        let _ = writeln!(out, "f32 master weights: {}", s.masters.len());
        for &(v, t) in &s.masters {
            let _ = writeln!(out, "  {} at {}", value_name(&cx.names, v), place(cx, t));
        }
    }
    let _ = writeln!(out, "loss at {}", place(cx, s.loss));
}

fn value_name(names: &[String], v: ValueId) -> String {
    names
        .get(v.index())
        .cloned()
        .unwrap_or_else(|| format!("<undefined {v}>"))
}

/// `buf3` or `buf3+0x40`, the buffer numbered as the printer numbers it.
fn tensor_ref(cx: &Cx, t: TensorRef) -> String {
    let buffer = cx.buffers.label(t.buffer);
    if t.offset == 0 {
        buffer
    } else {
        format!("{buffer}+{:#x}", t.offset)
    }
}

/// `device[+0x40]`: the absolute address of a tensor in its space; `host[+0x40 shard +0x8]`
/// for a tensor in a host shard: the buffer's start on every rank, and the offset in the
/// whole layout the ranks' shards make.
fn address(cx: &Cx, t: TensorRef) -> String {
    match cx.s.buffers.get(t.buffer.index()) {
        Some(b) if b.kind.is_sharded() => format!(
            "{}[+{:#x} shard +{:#x}]",
            space_name(b.space),
            b.offset,
            t.offset
        ),
        Some(b) => format!(
            "{}[+{:#x}]",
            space_name(b.space),
            b.offset.saturating_add(t.offset)
        ),
        None => format!("<undefined {}>", t.buffer),
    }
}

/// `buf3+0x8 = device[+0x48]`.
fn place(cx: &Cx, t: TensorRef) -> String {
    format!("{} = {}", tensor_ref(cx, t), address(cx, t))
}

fn instr_text(cx: &Cx, instr: &Instr) -> String {
    match instr {
        Instr::Kernel {
            op,
            inputs,
            outputs,
            workspace,
        } => kernel_text(cx, *op, inputs, outputs, *workspace),
        Instr::Copy {
            what,
            src,
            dst,
            bytes,
        } => format!(
            "copy {} {} -> {} {}",
            copy_label(*what, &cx.names),
            address(cx, *src),
            address(cx, *dst),
            format_bytes(*bytes)
        ),
        Instr::EndMicroBatch { micro_batches } => {
            format!(
                "end_micro_batch x{micro_batches}  ; above: each micro-batch, below: the update"
            )
        }
        Instr::CopyShard {
            what,
            src,
            dst,
            bytes,
        } => format!(
            "copy_shard {} {} -> {} {} per rank  ; rank r: +r*{}",
            copy_label(*what, &cx.names),
            address(cx, *src),
            address(cx, *dst),
            format_bytes(*bytes),
            format_bytes(*bytes)
        ),
        Instr::AllGather { chunk, at, bytes } => format!(
            "all_gather {chunk} at {} = {} {} per rank  ; every rank's slice to every rank",
            tensor_ref(cx, *at),
            address(cx, *at),
            format_bytes(*bytes)
        ),
        Instr::ReduceScatter {
            chunk,
            at,
            bytes,
            dtype,
        } => format!(
            "reduce_scatter {chunk} {dtype} at {} = {} {} per rank  ; rank r's slice summed over the ranks",
            tensor_ref(cx, *at),
            address(cx, *at),
            format_bytes(*bytes)
        ),
        Instr::AllReduce { value, at } => {
            let g = &cx.s.graph;
            let bytes = match value.index() < g.values().len() {
                true => g.value(*value).ty.bytes(),
                false => 0,
            };
            format!(
                "all_reduce {} at {} = {} {}  ; sum over the ranks, in place",
                value_name(&cx.names, *value),
                tensor_ref(cx, *at),
                address(cx, *at),
                format_bytes(bytes)
            )
        }
        Instr::DiskRead {
            chunk,
            src,
            dst,
            bytes,
        } => format!(
            "disk_read {chunk} {} {} -> {} {}{}",
            disk_part(cx, *src),
            address(cx, *src),
            address(cx, *dst),
            format_bytes(*bytes),
            per_rank(cx, *src)
        ),
        Instr::DiskWrite {
            chunk,
            src,
            dst,
            bytes,
            carried,
        } => {
            let rank = per_rank(cx, *dst);
            let carried = match (carried, rank.is_empty()) {
                (false, _) => "",
                (true, true) => "  ; carried: the previous step's update, written as this step starts",
                (true, false) => "; carried: the previous step's update, written as this step starts",
            };
            format!(
                "disk_write {chunk} {} {} -> {} {}{rank}{carried}",
                disk_part(cx, *dst),
                address(cx, *src),
                address(cx, *dst),
                format_bytes(*bytes),
            )
        }
        Instr::CastChunk {
            chunk,
            src,
            dst,
            bytes,
        } => format!(
            "cast {chunk} master {} -> {} {}  ; f32 master rounded into its parameters",
            address(cx, *src),
            address(cx, *dst),
            format_bytes(*bytes)
        ),
        Instr::Record { event } => format!("record e{}", event.0),
        Instr::Wait { event } => format!("wait e{}", event.0),
    }
}

fn kernel_text(
    cx: &Cx,
    op: OpId,
    inputs: &[TensorRef],
    outputs: &[TensorRef],
    workspace: Option<TensorRef>,
) -> String {
    let (s, names) = (cx.s, &cx.names);
    let refs = |ts: &[TensorRef]| -> String {
        ts.iter()
            .map(|t| tensor_ref(cx, *t))
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
        let _ = write!(text, "; workspace {}", tensor_ref(cx, w));
    }
    text
}

/// A part of a sharded chunk's state, in words.
fn part_name(part: ShardPart) -> &'static str {
    match part {
        ShardPart::Params => "params",
        ShardPart::Grads => "grads",
        ShardPart::AdamM => "adam m",
        ShardPart::AdamV => "adam v",
        ShardPart::Master => "master",
    }
}
