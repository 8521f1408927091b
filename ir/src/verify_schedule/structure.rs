//! The structure checks: ids in range, instructions that fit their ops and streams, optimizer
//! settings, every address inside its buffer and aligned, the budgets, every op run once.

use super::{Checker, InstrRef, Invariant, ScheduleError};
use crate::ids::{BufferId, OpId};
use crate::op::OpKind;
use crate::print_schedule::space_name;
use crate::schedule::{BufferKind, Instr, ShardPart, Space, StreamKind, TensorRef, FORMAT_VERSION};
use crate::types::format_bytes;
use crate::workspace::WORKSPACE_ALIGN;

/// `320 B`, or `1.50 GiB (1610612736 B)` where the rounded figure hides the exact one.
fn exact_bytes(n: u64) -> String {
    if n < 1024 {
        format_bytes(n)
    } else {
        format!("{} ({n} B)", format_bytes(n))
    }
}

impl Checker<'_> {
    // 2. ids ------------------------------------------------------------------------------

    pub(super) fn ids(&self) -> Result<(), ScheduleError> {
        let table = |msg: String| self.fail(Invariant::Ids, None, msg);
        self.stream_ids().map_err(table)?;
        self.chunk_ids().map_err(table)?;
        let homed = self.home_ids().map_err(table)?;
        let mastered = self.master_ids().map_err(table)?;
        self.staged_ids(&homed, &mastered).map_err(table)?;
        self.loss_ids().map_err(table)?;
        for (r, instr) in self.instrs() {
            let kind = self.s.streams[r.stream.index()].kind;
            self.instr_ids(kind, instr)
                .map_err(|msg| self.fail(Invariant::Ids, Some(r), msg))?;
            self.carried_ids(r, instr)
                .map_err(|msg| self.fail(Invariant::Ids, Some(r), msg))?;
        }
        Ok(())
    }

    /// A carried disk write comes before every other instruction of its stream (before the
    /// micro-batch program's, with accumulation): it runs as the next step starts, before
    /// the disk stream's reads, and waits for nothing (the runtime's barrier between steps
    /// orders it after the update it writes back).
    fn carried_ids(&self, r: InstrRef, instr: &Instr) -> Result<(), String> {
        if !matches!(instr, Instr::DiskWrite { carried: true, .. }) {
            return Ok(());
        }
        let stream = &self.s.streams[r.stream.index()];
        let first = self.part != super::Part::Update
            && stream.instrs[..r.index as usize]
                .iter()
                .all(|i| matches!(i, Instr::DiskWrite { carried: true, .. }));
        match first {
            true => Ok(()),
            false => Err(
                "a carried disk write after other instructions of its stream: carried \
                          writes run first as the next step starts, so they must lead the \
                          disk stream's program (recompile the schedule)"
                    .into(),
            ),
        }
    }

    /// The format version, and at most one collective stream, of at least two ranks.
    fn stream_ids(&self) -> Result<(), String> {
        let s = self.s;
        if s.header.format_version != FORMAT_VERSION {
            return Err(format!(
                "the header says format version {}, this build writes {FORMAT_VERSION}",
                s.header.format_version
            ));
        }
        if s.streams.is_empty() {
            return Err("the schedule has no stream".into());
        }
        let collectives: Vec<(u32, u32)> = s
            .streams
            .iter()
            .filter_map(|st| match st.kind {
                StreamKind::Collective { gpus, nodes } => Some((gpus, nodes)),
                _ => None,
            })
            .collect();
        match collectives[..] {
            [] => {}
            [(gpus, nodes)] if gpus >= 1 && nodes >= 1 && gpus.saturating_mul(nodes) >= 2 => {}
            [(gpus, nodes)] => {
                return Err(format!(
                    "the collective stream connects {gpus} GPUs x {nodes} nodes; a \
                     data-parallel schedule has at least 2 ranks"
                ))
            }
            _ => {
                return Err(format!(
                    "{} collective streams; a schedule has at most one",
                    collectives.len()
                ))
            }
        }
        Ok(())
    }

    /// Every buffer's chunk is in the chunk table; every chunk member's parameter is in the
    /// graph, with its type's bytes.
    fn chunk_ids(&self) -> Result<(), String> {
        let (s, g) = (self.s, self.g);
        let n_chunks = s.chunks.len();
        let n_params = g.params().len();
        for (i, b) in s.buffers.iter().enumerate() {
            if let BufferKind::PersistentChunk { chunk }
            | BufferKind::HostChunk { chunk }
            | BufferKind::GradChunk { chunk }
            | BufferKind::HostGradChunk { chunk }
            | BufferKind::OptimizerState { chunk }
            | BufferKind::HostShard { chunk, .. } = b.kind
            {
                if chunk.index() >= n_chunks {
                    return Err(format!(
                        "{} ({}) belongs to {chunk}, but the chunk table has {n_chunks} chunks",
                        self.buf(BufferId::new(i)),
                        b.name
                    ));
                }
            }
        }
        for (c, chunk) in s.chunks.iter() {
            for m in &chunk.members {
                if m.param.index() >= n_params {
                    return Err(format!(
                        "{c} holds {}, but the graph has {n_params} parameters",
                        m.param
                    ));
                }
                let p = g.param(m.param);
                let want = g.value(p.value).ty.bytes();
                if m.bytes != want {
                    return Err(format!(
                        "{c} gives @{} {} bytes, its type takes {want}",
                        p.name, m.bytes
                    ));
                }
            }
        }
        Ok(())
    }

    /// `homes` lists values without a producer, once each, in buffers that exist. Returns which
    /// values have a home.
    fn home_ids(&self) -> Result<Vec<bool>, String> {
        let (s, g) = (self.s, self.g);
        let n_buffers = s.buffers.len();
        let n_values = g.values().len();
        let mut homed = vec![false; n_values];
        for &(v, t) in &s.homes {
            if v.index() >= n_values {
                return Err(format!(
                    "homes lists {v}, but the graph has {n_values} values"
                ));
            }
            if t.buffer.index() >= n_buffers {
                return Err(format!(
                    "the home of {} is in {}, but there are {n_buffers} buffers",
                    self.name(v),
                    t.buffer
                ));
            }
            if let Some(op) = g.value(v).producer {
                return Err(format!(
                    "homes lists {}, which {} computes: only inputs, parameters and optimizer \
                     state have homes",
                    self.name(v),
                    self.describe_op(op)
                ));
            }
            if std::mem::replace(&mut homed[v.index()], true) {
                return Err(format!("homes lists {} twice", self.name(v)));
            }
        }
        Ok(homed)
    }

    /// `masters` lists narrow parameters, once each, in optimizer-state buffers, and every narrow
    /// parameter AdamW updates has one. Returns which values have a master weight.
    fn master_ids(&self) -> Result<Vec<bool>, String> {
        let (s, g) = (self.s, self.g);
        let n_buffers = s.buffers.len();
        let n_values = g.values().len();
        let mut mastered = vec![false; n_values];
        for &(v, t) in &s.masters {
            if v.index() >= n_values {
                return Err(format!(
                    "masters lists {v}, but the graph has {n_values} values"
                ));
            }
            let ty = &g.value(v).ty;
            if g.param_of(v).is_none() || ty.dtype == crate::DType::F32 {
                return Err(format!(
                    "masters lists {} ({ty}): only parameters narrower than f32 have an f32 \
                     master weight",
                    self.name(v)
                ));
            }
            match s.buffers.get(t.buffer.index()).map(|b| b.kind) {
                Some(
                    BufferKind::OptimizerState { .. }
                    | BufferKind::HostShard {
                        part: ShardPart::Master,
                        ..
                    },
                ) => {}
                Some(kind) => {
                    return Err(format!(
                        "the master weight of {} is in {} ({kind:?}), not an optimizer-state \
                         buffer",
                        self.name(v),
                        self.buf(t.buffer)
                    ))
                }
                None => {
                    return Err(format!(
                        "the master weight of {} is in {}, but there are {n_buffers} buffers",
                        self.name(v),
                        t.buffer
                    ))
                }
            }
            if std::mem::replace(&mut mastered[v.index()], true) {
                return Err(format!("masters lists {} twice", self.name(v)));
            }
        }
        for (_, op) in g.ops() {
            if let OpKind::AdamW { .. } = op.kind {
                let p = op.inputs[0];
                if g.value(p).ty.dtype != crate::DType::F32 && !mastered[p.index()] {
                    return Err(format!(
                        "AdamW updates {} ({}) but the schedule gives it no f32 master weight",
                        self.name(p),
                        g.value(p).ty
                    ));
                }
            }
        }
        Ok(mastered)
    }

    /// Every value without a producer has a home, but a staged chunk's parameters, which have a
    /// master weight instead.
    fn staged_ids(&self, homed: &[bool], mastered: &[bool]) -> Result<(), String> {
        let (s, g) = (self.s, self.g);
        let n_chunks = s.chunks.len();
        let n_values = g.values().len();
        let n_params = g.params().len();
        // The 12-byte layout: a staged chunk keeps no narrow copy of its parameters (each
        // upload is cast from the master weights), so they have master weights and no home.
        let mut staged = vec![false; n_values];
        for c in s.staged_chunks() {
            if c.index() >= n_chunks {
                continue;
            }
            for m in &s.chunks.chunk(c).members {
                if m.param.index() < n_params {
                    staged[g.param(m.param).value.index()] = true;
                }
            }
        }
        for (v, value) in g.values() {
            if staged[v.index()] {
                if homed[v.index()] || !mastered[v.index()] {
                    return Err(format!(
                        "{} ({}) belongs to a chunk whose uploads are cast from its master \
                         weights (the 12-byte layout), so it needs a master weight and no home; \
                         it has {}",
                        self.name(v),
                        value.name,
                        match homed[v.index()] {
                            true => "a home",
                            false => "no master weight",
                        }
                    ));
                }
                continue;
            }
            if value.producer.is_none() && !homed[v.index()] {
                return Err(format!(
                    "{} ({}, {}) has no home: every input, parameter and optimizer state needs one",
                    self.name(v),
                    value.name,
                    value.role.name()
                ));
            }
        }
        Ok(())
    }

    /// The graph has an output, and `loss` is in a buffer that exists.
    fn loss_ids(&self) -> Result<(), String> {
        let (s, g) = (self.s, self.g);
        let n_buffers = s.buffers.len();
        if g.outputs().is_empty() {
            return Err("the graph has no output for `loss` to hold".into());
        }
        if s.loss.buffer.index() >= n_buffers {
            return Err(format!(
                "`loss` is in {}, but there are {n_buffers} buffers",
                s.loss.buffer
            ));
        }
        Ok(())
    }

    pub(super) fn optimizer(&self) -> Result<(), ScheduleError> {
        // (setting, value, whether it is valid, the range, what the setting is to a user)
        type Setting = (&'static str, f64, bool, &'static str, &'static str);
        let finite_at_least_0 = |x: f64| x.is_finite() && x >= 0.0;
        let finite_above_0 = |x: f64| x.is_finite() && x > 0.0;
        let decay = |x: f64| (0.0..1.0).contains(&x);
        for (id, op) in self.g.ops() {
            let settings: Vec<Setting> = match op.kind {
                OpKind::AdamW {
                    lr,
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                    ..
                } => vec![
                    (
                        "lr",
                        lr,
                        finite_at_least_0(lr),
                        "finite and >= 0",
                        "learning rate",
                    ),
                    ("beta1", beta1, decay(beta1), "in [0, 1)", "AdamW beta1"),
                    ("beta2", beta2, decay(beta2), "in [0, 1)", "AdamW beta2"),
                    (
                        "eps",
                        eps,
                        finite_above_0(eps),
                        "finite and > 0",
                        "AdamW epsilon",
                    ),
                    (
                        "weight_decay",
                        weight_decay,
                        finite_at_least_0(weight_decay),
                        "finite and >= 0",
                        "weight decay",
                    ),
                ],
                OpKind::ClipCoef { max_norm } => vec![(
                    "max_norm",
                    max_norm,
                    finite_above_0(max_norm),
                    "finite and > 0",
                    "gradient clipping norm",
                )],
                OpKind::UnscaleCoef {
                    max_norm,
                    loss_scale,
                } => {
                    let mut v = vec![(
                        "loss_scale",
                        loss_scale,
                        finite_above_0(loss_scale),
                        "finite and > 0",
                        "initial loss scale",
                    )];
                    if let Some(max_norm) = max_norm {
                        v.push((
                            "max_norm",
                            max_norm,
                            finite_above_0(max_norm),
                            "finite and > 0",
                            "gradient clipping norm",
                        ));
                    }
                    v
                }
                OpKind::CrossEntropyBackwardLossScaled { loss_scale, .. } => vec![(
                    "loss_scale",
                    loss_scale,
                    finite_above_0(loss_scale),
                    "finite and > 0",
                    "initial loss scale",
                )],
                _ => continue,
            };
            if let Some(&(name, value, _, range, what)) = settings.iter().find(|s| !s.2) {
                let at = self.instrs().find_map(|(r, instr)| match instr {
                    Instr::Kernel { op, .. } if *op == id => Some(r),
                    _ => None,
                });
                let msg = format!(
                    "{name} = {value:?}, but it must be {range}, or the step computes NaN or \
                     diverges; compile the schedule again with a valid {what}"
                );
                let msg = match at {
                    Some(_) => msg,
                    None => format!("{id} ({}): {msg}", self.describe_op(id)),
                };
                return Err(self.fail(Invariant::Optimizer, at, msg));
            }
        }
        Ok(())
    }

    // 4. bounds ---------------------------------------------------------------------------

    pub(super) fn bounds(&self) -> Result<(), ScheduleError> {
        let s = self.s;
        for (i, b) in s.buffers.iter().enumerate() {
            let (limit, what) = match b.space {
                Space::Device => (s.arena_bytes, "the arena"),
                Space::Host => (s.host_bytes, "the host region"),
                Space::Disk => (s.disk_bytes, "the disk region"),
            };
            if b.offset.checked_add(b.size).is_none_or(|end| end > limit) {
                return Err(self.fail(
                    Invariant::Bounds,
                    None,
                    format!(
                        "{} ({}) at {} {:#x} + {} B ends past {what} ({limit} B)",
                        self.buf(BufferId::new(i)),
                        b.name,
                        space_name(b.space),
                        b.offset,
                        b.size
                    ),
                ));
            }
        }
        // Whether `bytes` at `t` fit in its buffer; else a description of the overrun.
        let fits = |t: TensorRef, bytes: u64| -> Result<(), String> {
            let b = s.buffer(t.buffer);
            match t.offset.checked_add(bytes) {
                Some(end) if end <= s.extent(t.buffer) => Ok(()),
                _ => Err(format!(
                    "{} B at {}+{:#x} end past {} ({}, {} B)",
                    bytes,
                    self.buf(t.buffer),
                    t.offset,
                    self.buf(t.buffer),
                    b.name,
                    s.extent(t.buffer)
                )),
            }
        };
        for &(v, t) in &s.homes {
            fits(t, self.bytes(v)).map_err(|e| {
                self.fail(
                    Invariant::Bounds,
                    None,
                    format!("the home of {}: {e}", self.name(v)),
                )
            })?;
        }
        for &(v, t) in &s.masters {
            fits(t, 4 * self.g.value(v).ty.numel()).map_err(|e| {
                self.fail(
                    Invariant::Bounds,
                    None,
                    format!("the master weight of {}: {e}", self.name(v)),
                )
            })?;
        }
        let loss = self.loss_value();
        fits(s.loss, self.bytes(loss)).map_err(|e| {
            self.fail(
                Invariant::Bounds,
                None,
                format!("`loss` ({}): {e}", self.name(loss)),
            )
        })?;
        for (r, instr) in self.instrs() {
            let bad = |e: String| self.fail(Invariant::Bounds, Some(r), e);
            match instr {
                Instr::Kernel {
                    op,
                    inputs,
                    outputs,
                    workspace,
                } => {
                    let o = self.g.op(*op);
                    for (what, vs, ts) in [
                        ("reads", &o.inputs, inputs),
                        ("writes", &o.outputs, outputs),
                    ] {
                        for (&v, &t) in vs.iter().zip(ts.iter()) {
                            fits(t, self.bytes(v))
                                .map_err(|e| bad(format!("{what} {}: {e}", self.name(v))))?;
                        }
                    }
                    if let Some(w) = workspace {
                        fits(*w, self.workspace_need(*op))
                            .map_err(|e| bad(format!("workspace: {e}")))?;
                    }
                }
                Instr::Copy {
                    src, dst, bytes, ..
                } => {
                    fits(*src, *bytes).map_err(|e| bad(format!("source: {e}")))?;
                    fits(*dst, *bytes).map_err(|e| bad(format!("destination: {e}")))?;
                }
                Instr::AllReduce { value, at } => {
                    fits(*at, self.bytes(*value))
                        .map_err(|e| bad(format!("sums {}: {e}", self.name(*value))))?;
                }
                Instr::CopyShard {
                    src, dst, bytes, ..
                } => {
                    let all = bytes.saturating_mul(u64::from(s.ranks()));
                    fits(*src, all).map_err(|e| bad(format!("every rank's source: {e}")))?;
                    fits(*dst, all).map_err(|e| bad(format!("every rank's destination: {e}")))?;
                }
                Instr::AllGather { at, bytes, .. } | Instr::ReduceScatter { at, bytes, .. } => {
                    let all = bytes.saturating_mul(u64::from(s.ranks()));
                    fits(*at, all).map_err(|e| bad(format!("every rank's slices: {e}")))?;
                }
                Instr::DiskRead {
                    src, dst, bytes, ..
                }
                | Instr::DiskWrite {
                    src, dst, bytes, ..
                } => {
                    fits(*src, *bytes).map_err(|e| bad(format!("source: {e}")))?;
                    fits(*dst, *bytes).map_err(|e| bad(format!("destination: {e}")))?;
                }
                Instr::CastChunk {
                    chunk,
                    src,
                    dst,
                    bytes,
                } => {
                    let elems: u64 = s
                        .chunks
                        .chunk(*chunk)
                        .members
                        .iter()
                        .map(|m| self.g.value(self.g.param(m.param).value).ty.numel())
                        .sum();
                    fits(*src, 4 * elems).map_err(|e| bad(format!("master weights: {e}")))?;
                    fits(*dst, *bytes).map_err(|e| bad(format!("destination: {e}")))?;
                }
                Instr::Record { .. } | Instr::Wait { .. } | Instr::EndMicroBatch { .. } => {}
            }
        }
        Ok(())
    }

    // 5. alignment ------------------------------------------------------------------------

    pub(super) fn alignment(&self) -> Result<(), ScheduleError> {
        let s = self.s;
        // Whether `t` is aligned to `align`; else a description of where it is. `what` names
        // what lies there, `parts` what would be misaligned: both made only on a failure, since
        // this runs for every home and operand of every schedule verified.
        type Text<'t> = &'t dyn Fn() -> String;
        let aligned = |t: TensorRef, align: u64, what: Text, parts: Text| -> Result<(), String> {
            // A shard's address on every rank is its buffer's start plus the offset inside
            // the rank's slice, aligned as the whole layout's offset when the slices are.
            let (space, a) = match s.buffer(t.buffer).kind.is_sharded() {
                true => {
                    let b = s.buffer(t.buffer);
                    (b.space, b.offset + t.offset)
                }
                false => s.address(t),
            };
            if a.is_multiple_of(align) {
                return Ok(());
            }
            let at = match t.offset {
                0 => self.buf(t.buffer),
                off => format!("{}+{off:#x}", self.buf(t.buffer)),
            };
            Err(format!(
                "{} at {} {a:#x} ({at}), which is not a multiple of {align} bytes ({} \
                 would be misaligned)",
                what(),
                space_name(space),
                parts()
            ))
        };
        let value = |v, t: TensorRef, what: &str| {
            let ty = &self.g.value(v).ty;
            aligned(
                t,
                ty.dtype.size(),
                &|| format!("{what}{} ({ty})", self.name(v)),
                &|| format!("its {} elements", ty.dtype),
            )
        };
        let whole = |e: String| self.fail(Invariant::Alignment, None, e);
        for &(v, t) in &s.homes {
            value(v, t, "the home of ").map_err(whole)?;
        }
        for &(v, t) in &s.masters {
            let what = || format!("the f32 master weight of {}", self.name(v));
            aligned(t, 4, &what, &|| "its elements".into()).map_err(whole)?;
        }
        value(self.loss_value(), s.loss, "`loss` ").map_err(whole)?;
        for (r, instr) in self.instrs() {
            if let Instr::AllReduce { value: v, at } = instr {
                value(*v, *at, "sums ").map_err(|e| self.fail(Invariant::Alignment, Some(r), e))?;
                continue;
            }
            if let Instr::CastChunk {
                chunk, src, dst, ..
            } = instr
            {
                for p in s.cast_pieces(*chunk, *src, *dst).unwrap_or_default() {
                    value(p.value, p.narrow, "casts ")
                        .map_err(|e| self.fail(Invariant::Alignment, Some(r), e))?;
                }
                continue;
            }
            let Instr::Kernel {
                op,
                inputs,
                outputs,
                workspace,
            } = instr
            else {
                continue;
            };
            let bad = |e: String| self.fail(Invariant::Alignment, Some(r), e);
            let o = self.g.op(*op);
            for (v, t) in o.inputs.iter().zip(inputs) {
                value(*v, *t, "reads ").map_err(bad)?;
            }
            for (v, t) in o.outputs.iter().zip(outputs) {
                value(*v, *t, "writes ").map_err(bad)?;
            }
            if let Some(w) = workspace {
                let (what, parts) = (|| "has its workspace".into(), || "its parts".into());
                aligned(*w, WORKSPACE_ALIGN, &what, &parts).map_err(bad)?;
            }
        }
        Ok(())
    }

    // 6. budget ---------------------------------------------------------------------------

    pub(super) fn budget(&self) -> Result<(), ScheduleError> {
        let (s, h) = (self.s, &self.s.header);
        for (what, used, budget) in [
            ("device arena", s.arena_bytes, h.device_budget_bytes),
            ("host region", s.host_bytes, h.host_budget_bytes),
            ("disk region", s.disk_bytes, h.disk_budget_bytes),
        ] {
            if used > budget {
                return Err(self.fail(
                    Invariant::Budget,
                    None,
                    format!(
                        "the {what} takes {}, over its budget of {}",
                        exact_bytes(used),
                        exact_bytes(budget)
                    ),
                ));
            }
        }
        Ok(())
    }

    // 7. coverage -------------------------------------------------------------------------

    pub(super) fn coverage(&self) -> Result<(), ScheduleError> {
        if let Some((op, o)) = self.g.ops().find(|(_, o)| o.kind.is_movement()) {
            return Err(self.fail(
                Invariant::Coverage,
                None,
                format!(
                    "{op} is a {} op: a schedule's graph holds compute ops only, its movement \
                     is copy instructions (the compiler's emit pass lowers it)",
                    o.kind.mnemonic()
                ),
            ));
        }
        let mut ran: Vec<Option<InstrRef>> = vec![None; self.g.op_count()];
        for (r, instr) in self.instrs() {
            if let Instr::Kernel { op, .. } = instr {
                if let Some(first) = ran[op.index()].replace(r) {
                    return Err(self.fail(
                        Invariant::Coverage,
                        Some(r),
                        format!("runs {op} a second time (first at {})", self.at(first)),
                    ));
                }
            }
        }
        if let Some(i) = ran.iter().position(Option::is_none) {
            let op = OpId::new(i);
            return Err(self.fail(
                Invariant::Coverage,
                None,
                format!(
                    "{op} ({}, {} phase) never runs: every op of the graph runs exactly once",
                    self.describe_op(op),
                    self.g.op(op).phase
                ),
            ));
        }
        Ok(())
    }
}
