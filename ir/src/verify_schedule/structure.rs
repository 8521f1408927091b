//! The structure checks: ids in range, instructions that fit their ops and streams, optimizer
//! settings, every address inside its buffer and aligned, the budgets, every op run once.

use super::{Checker, InstrRef, Invariant, ScheduleError};
use crate::ids::{BufferId, OpId};
use crate::op::OpKind;
use crate::print_schedule::{copy_label, space_name, stream_kind_name};
use crate::schedule::{
    BufferKind, CopyKind, Instr, ShardPart, Space, StreamKind, TensorRef, FORMAT_VERSION,
};
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
        let (s, g) = (self.s, self.g);
        let bad = |msg: String| Err(self.fail(Invariant::Ids, None, msg));
        if s.header.format_version != FORMAT_VERSION {
            return bad(format!(
                "the header says format version {}, this build writes {FORMAT_VERSION}",
                s.header.format_version
            ));
        }
        if s.streams.is_empty() {
            return bad("the schedule has no stream".into());
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
                return bad(format!(
                    "the collective stream connects {gpus} GPUs x {nodes} nodes; a \
                     data-parallel schedule has at least 2 ranks"
                ))
            }
            _ => {
                return bad(format!(
                    "{} collective streams; a schedule has at most one",
                    collectives.len()
                ))
            }
        }
        let (n_buffers, n_chunks, n_values, n_ops, n_params) = (
            s.buffers.len(),
            s.chunks.len(),
            g.values().len(),
            g.op_count(),
            g.params().len(),
        );
        for (i, b) in s.buffers.iter().enumerate() {
            if let BufferKind::PersistentChunk { chunk }
            | BufferKind::HostChunk { chunk }
            | BufferKind::GradChunk { chunk }
            | BufferKind::HostGradChunk { chunk }
            | BufferKind::OptimizerState { chunk }
            | BufferKind::HostShard { chunk, .. } = b.kind
            {
                if chunk.index() >= n_chunks {
                    return bad(format!(
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
                    return bad(format!(
                        "{c} holds {}, but the graph has {n_params} parameters",
                        m.param
                    ));
                }
                let p = g.param(m.param);
                let want = g.value(p.value).ty.bytes();
                if m.bytes != want {
                    return bad(format!(
                        "{c} gives @{} {} bytes, its type takes {want}",
                        p.name, m.bytes
                    ));
                }
            }
        }
        let mut homed = vec![false; n_values];
        for &(v, t) in &s.homes {
            if v.index() >= n_values {
                return bad(format!(
                    "homes lists {v}, but the graph has {n_values} values"
                ));
            }
            if t.buffer.index() >= n_buffers {
                return bad(format!(
                    "the home of {} is in {}, but there are {n_buffers} buffers",
                    self.name(v),
                    t.buffer
                ));
            }
            if let Some(op) = g.value(v).producer {
                return bad(format!(
                    "homes lists {}, which {} computes: only inputs, parameters and optimizer \
                     state have homes",
                    self.name(v),
                    self.describe_op(op)
                ));
            }
            if std::mem::replace(&mut homed[v.index()], true) {
                return bad(format!("homes lists {} twice", self.name(v)));
            }
        }
        let mut mastered = vec![false; n_values];
        for &(v, t) in &s.masters {
            if v.index() >= n_values {
                return bad(format!(
                    "masters lists {v}, but the graph has {n_values} values"
                ));
            }
            let ty = &g.value(v).ty;
            if g.param_of(v).is_none() || ty.dtype == crate::DType::F32 {
                return bad(format!(
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
                    return bad(format!(
                        "the master weight of {} is in {} ({kind:?}), not an optimizer-state \
                         buffer",
                        self.name(v),
                        self.buf(t.buffer)
                    ))
                }
                None => {
                    return bad(format!(
                        "the master weight of {} is in {}, but there are {n_buffers} buffers",
                        self.name(v),
                        t.buffer
                    ))
                }
            }
            if std::mem::replace(&mut mastered[v.index()], true) {
                return bad(format!("masters lists {} twice", self.name(v)));
            }
        }
        for (_, op) in g.ops() {
            if let OpKind::AdamW { .. } = op.kind {
                let p = op.inputs[0];
                if g.value(p).ty.dtype != crate::DType::F32 && !mastered[p.index()] {
                    return bad(format!(
                        "AdamW updates {} ({}) but the schedule gives it no f32 master weight",
                        self.name(p),
                        g.value(p).ty
                    ));
                }
            }
        }
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
                    return bad(format!(
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
                return bad(format!(
                    "{} ({}, {}) has no home: every input, parameter and optimizer state needs one",
                    self.name(v),
                    value.name,
                    value.role.name()
                ));
            }
        }
        if g.outputs().is_empty() {
            return bad("the graph has no output for `loss` to hold".into());
        }
        if s.loss.buffer.index() >= n_buffers {
            return bad(format!(
                "`loss` is in {}, but there are {n_buffers} buffers",
                s.loss.buffer
            ));
        }
        for (r, instr) in self.instrs() {
            let kind = s.streams[r.stream.index()].kind;
            let bad = |msg: String| Err(self.fail(Invariant::Ids, Some(r), msg));
            match instr {
                Instr::Kernel {
                    op,
                    inputs,
                    outputs,
                    workspace,
                } => {
                    if op.index() >= n_ops {
                        return bad(format!("runs {op}, but the graph has {n_ops} ops"));
                    }
                    let o = g.op(*op);
                    let space = match kind {
                        StreamKind::Compute => Space::Device,
                        StreamKind::HostOptimizer => Space::Host,
                        // A micro-batch's gradient summed over the ranks into its
                        // accumulator, in the accumulator's memory (both operands there, but
                        // a sharded chunk's gradient, read where the backward pass left it).
                        StreamKind::Collective { .. }
                            if o.kind == crate::op::OpKind::AccumulateGrad =>
                        {
                            match inputs.first().and_then(|t| s.buffers.get(t.buffer.index())) {
                                Some(b) => b.space,
                                None => {
                                    return bad(
                                        "an accumulate_grad with no accumulator address".into()
                                    )
                                }
                            }
                        }
                        _ => {
                            return bad(format!(
                                "a kernel on a {} stream: kernels run on compute and host \
                                 optimizer streams (and accumulate_grad on the collective \
                                 stream)",
                                stream_kind_name(kind)
                            ))
                        }
                    };
                    if inputs.len() != o.inputs.len() || outputs.len() != o.outputs.len() {
                        return bad(format!(
                            "addresses {} inputs and {} outputs, its op has {} and {}",
                            inputs.len(),
                            outputs.len(),
                            o.inputs.len(),
                            o.outputs.len()
                        ));
                    }
                    // A sharded chunk's accumulator (in its gradient shard, or whole in host
                    // memory where the update reads the norm) sums gradients on the device.
                    let from_device = matches!(kind, StreamKind::Collective { .. })
                        && space == Space::Host
                        && s.sharded();
                    for (j, t) in inputs.iter().chain(outputs).chain(workspace).enumerate() {
                        if t.buffer.index() >= n_buffers {
                            return bad(format!(
                                "addresses {}, but there are {n_buffers} buffers",
                                t.buffer
                            ));
                        }
                        let b = s.buffer(t.buffer);
                        let device_grad = from_device && j == 1 && b.space == Space::Device;
                        if b.space != space && !device_grad {
                            return bad(format!(
                                "addresses {} ({}) in {} memory, but a kernel on a {} stream \
                                 works in {} memory",
                                self.buf(t.buffer),
                                b.name,
                                space_name(b.space),
                                stream_kind_name(kind),
                                space_name(space)
                            ));
                        }
                    }
                    let need = self.workspace_need(*op);
                    match (need, workspace) {
                        (0, Some(w)) => {
                            return bad(format!(
                                "has a workspace ({}) but {} needs none",
                                self.buf(w.buffer),
                                o.kind.mnemonic()
                            ))
                        }
                        (n, None) if n > 0 => {
                            return bad(format!(
                                "has no workspace but needs {} ({n} B)",
                                format_bytes(n)
                            ))
                        }
                        _ => {}
                    }
                }
                Instr::Copy {
                    what,
                    src,
                    dst,
                    bytes,
                } => {
                    let (from, to) = match kind {
                        StreamKind::HostToDevice => (Space::Host, Space::Device),
                        StreamKind::DeviceToHost => (Space::Device, Space::Host),
                        _ => {
                            return bad(format!(
                                "a copy on a {} stream: copies run on host-to-device and \
                                 device-to-host streams",
                                stream_kind_name(kind)
                            ))
                        }
                    };
                    for t in [src, dst] {
                        if t.buffer.index() >= n_buffers {
                            return bad(format!(
                                "copies via {}, but there are {n_buffers} buffers",
                                t.buffer
                            ));
                        }
                    }
                    let (sb, db) = (s.buffer(src.buffer), s.buffer(dst.buffer));
                    if sb.space != from || db.space != to {
                        return bad(format!(
                            "copies from {} ({}) to {} ({}) on a {} stream, which copies \
                             from {} to {}",
                            space_name(sb.space),
                            sb.name,
                            space_name(db.space),
                            db.name,
                            stream_kind_name(kind),
                            space_name(from),
                            space_name(to)
                        ));
                    }
                    // A scalar goes either way: the clip coefficient to the host optimizer, or,
                    // in an accumulating schedule's update, host squared norms to the device.
                    let inbound = match what {
                        CopyKind::FetchChunk { .. } | CopyKind::ReloadActivation { .. } => true,
                        CopyKind::Scalar { .. } => sb.space == Space::Host,
                        CopyKind::OffloadGrads { .. } | CopyKind::OffloadActivation { .. } => false,
                    };
                    if inbound != (kind == StreamKind::HostToDevice) {
                        return bad(format!(
                            "a {} copy goes the other way",
                            copy_label(*what, &self.names)
                        ));
                    }
                    match *what {
                        CopyKind::FetchChunk { chunk } | CopyKind::OffloadGrads { chunk } => {
                            if chunk.index() >= n_chunks {
                                return bad(format!(
                                    "copies {chunk}, but the chunk table has {n_chunks} chunks"
                                ));
                            }
                            if let CopyKind::FetchChunk { .. } = what {
                                let c = s.chunks.chunk(chunk);
                                if let Some(m) = c.members.iter().find(|m| {
                                    m.offset.checked_add(m.bytes).is_none_or(|e| e > *bytes)
                                }) {
                                    return bad(format!(
                                        "fetches {bytes} bytes of {chunk}, which leaves out \
                                         @{} at +{:#x}",
                                        g.param(m.param).name,
                                        m.offset
                                    ));
                                }
                            }
                        }
                        CopyKind::OffloadActivation { value }
                        | CopyKind::ReloadActivation { value }
                        | CopyKind::Scalar { value } => {
                            if value.index() >= n_values {
                                return bad(format!(
                                    "copies {value}, but the graph has {n_values} values"
                                ));
                            }
                            if *bytes != self.bytes(value) {
                                return bad(format!(
                                    "copies {bytes} bytes of {}, which has {}",
                                    self.name(value),
                                    self.bytes(value)
                                ));
                            }
                        }
                    }
                }
                Instr::CopyShard {
                    what,
                    src,
                    dst,
                    bytes,
                } => {
                    let (chunk, stream, part, from, to) = match *what {
                        CopyKind::FetchChunk { chunk } => (
                            chunk,
                            StreamKind::HostToDevice,
                            ShardPart::Params,
                            *src,
                            *dst,
                        ),
                        CopyKind::OffloadGrads { chunk } => (
                            chunk,
                            StreamKind::DeviceToHost,
                            ShardPart::Grads,
                            *dst,
                            *src,
                        ),
                        _ => {
                            return bad(format!(
                                "copies a shard of {}; only chunk fetches and gradient \
                                 offloads are sharded",
                                copy_label(*what, &self.names)
                            ))
                        }
                    };
                    if kind != stream {
                        return bad(format!(
                            "a {} shard copy on a {} stream",
                            copy_label(*what, &self.names),
                            stream_kind_name(kind)
                        ));
                    }
                    if s.ranks() < 2 {
                        return bad(
                            "copies a shard, but the schedule runs on one rank (it has no \
                             collective stream)"
                                .into(),
                        );
                    }
                    for t in [src, dst] {
                        if t.buffer.index() >= n_buffers {
                            return bad(format!(
                                "copies via {}, but there are {n_buffers} buffers",
                                t.buffer
                            ));
                        }
                    }
                    let (host, device) = (s.buffer(from.buffer), s.buffer(to.buffer));
                    // In the 14-byte layout an offload lands in the parameter shard (the data
                    // flow proves no upload reads it after).
                    let lean = part == ShardPart::Grads
                        && host.kind
                            == (BufferKind::HostShard {
                                chunk,
                                part: ShardPart::Params,
                            });
                    if host.kind != (BufferKind::HostShard { chunk, part }) && !lean {
                        return bad(format!(
                            "copies a shard of {chunk} through {} ({}), which is not its \
                             host shard of {}",
                            self.buf(from.buffer),
                            host.name,
                            match part {
                                ShardPart::Params => "parameters",
                                _ => "gradients (or parameters, in the 14-byte layout)",
                            }
                        ));
                    }
                    if device.space != Space::Device {
                        return bad(format!(
                            "copies a shard of {chunk} to or from {} ({}), which is not in the \
                             device arena",
                            self.buf(to.buffer),
                            device.name
                        ));
                    }
                    if *bytes != host.size || from.offset != 0 {
                        return bad(format!(
                            "copies {bytes} bytes of each rank's shard of {chunk} from +{:#x}, \
                             but each rank's shard is {} bytes from +0x0",
                            from.offset, host.size
                        ));
                    }
                }
                Instr::DiskRead {
                    chunk,
                    src,
                    dst,
                    bytes,
                }
                | Instr::DiskWrite {
                    chunk,
                    src,
                    dst,
                    bytes,
                } => {
                    let (name, disk, host) = match instr {
                        Instr::DiskRead { .. } => ("a disk read", src, dst),
                        _ => ("a disk write", dst, src),
                    };
                    if kind != StreamKind::DiskIo {
                        return bad(format!(
                            "{name} on a {} stream: disk reads and writes run on the disk i/o \
                             stream",
                            stream_kind_name(kind)
                        ));
                    }
                    if chunk.index() >= n_chunks {
                        return bad(format!(
                            "{name} of {chunk}, but the chunk table has {n_chunks} chunks"
                        ));
                    }
                    for t in [src, dst] {
                        if t.buffer.index() >= n_buffers {
                            return bad(format!(
                                "{name} via {}, but there are {n_buffers} buffers",
                                t.buffer
                            ));
                        }
                    }
                    let (d, h) = (s.buffer(disk.buffer), s.buffer(host.buffer));
                    if (d.space, d.kind)
                        != (Space::Disk, BufferKind::OptimizerState { chunk: *chunk })
                    {
                        return bad(format!(
                            "{name} of {chunk} on the disk side addresses {} ({}, {}), not \
                             {chunk}'s optimizer state on disk",
                            self.buf(disk.buffer),
                            d.name,
                            space_name(d.space)
                        ));
                    }
                    if disk.offset != 0 || *bytes != d.size {
                        return bad(format!(
                            "{name} of {chunk} moves {bytes} bytes from +{:#x} of its state, \
                             which is {} bytes: disk reads and writes move a chunk's whole \
                             state from its start",
                            disk.offset, d.size
                        ));
                    }
                    if !(h.space == Space::Host
                        && matches!(h.kind, BufferKind::DiskStaging { .. })
                        && host.offset == 0)
                    {
                        return bad(format!(
                            "{name} of {chunk} on the host side addresses {}+{:#x} ({}), not \
                             the start of a disk staging buffer in host memory",
                            self.buf(host.buffer),
                            host.offset,
                            h.name
                        ));
                    }
                }
                Instr::CastChunk {
                    chunk,
                    src,
                    dst,
                    bytes,
                } => {
                    if kind != StreamKind::HostCast {
                        return bad(format!(
                            "a cast on a {} stream: casts run on the host cast stream",
                            stream_kind_name(kind)
                        ));
                    }
                    if chunk.index() >= n_chunks {
                        return bad(format!(
                            "casts {chunk}, but the chunk table has {n_chunks} chunks"
                        ));
                    }
                    for t in [src, dst] {
                        if t.buffer.index() >= n_buffers {
                            return bad(format!(
                                "casts via {}, but there are {n_buffers} buffers",
                                t.buffer
                            ));
                        }
                    }
                    let (from, to) = (s.buffer(src.buffer), s.buffer(dst.buffer));
                    if (from.space, from.kind)
                        != (Space::Host, BufferKind::OptimizerState { chunk: *chunk })
                    {
                        return bad(format!(
                            "casts {chunk} from {} ({}, {}), not {chunk}'s optimizer state in \
                             host memory, where its master weights are",
                            self.buf(src.buffer),
                            from.name,
                            space_name(from.space)
                        ));
                    }
                    if !(to.space == Space::Host
                        && matches!(to.kind, BufferKind::ParamStaging { .. })
                        && dst.offset == 0)
                    {
                        return bad(format!(
                            "casts {chunk} into {}+{:#x} ({}), not the start of a parameter \
                             staging buffer in host memory",
                            self.buf(dst.buffer),
                            dst.offset,
                            to.name
                        ));
                    }
                    let used = s.chunks.chunk(*chunk).used_bytes;
                    if *bytes != used {
                        return bad(format!(
                            "casts {bytes} bytes of {chunk}, which uses {used}: a cast writes \
                             the whole chunk"
                        ));
                    }
                    let Some(pieces) = s.cast_pieces(*chunk, *src, *dst) else {
                        return bad(format!(
                            "casts {chunk}, whose parameters are not all bf16 or f16: only \
                             narrow parameters are cast from f32 master weights"
                        ));
                    };
                    for p in pieces {
                        if !s.masters.contains(&(p.value, p.master)) {
                            return bad(format!(
                                "casts {} from {}+{:#x}, which is not its master weight: the \
                                 chunk's master weights must be contiguous in member order \
                                 from the cast's source",
                                self.name(p.value),
                                self.buf(p.master.buffer),
                                p.master.offset
                            ));
                        }
                    }
                }
                Instr::AllGather { chunk, at, bytes }
                | Instr::ReduceScatter {
                    chunk, at, bytes, ..
                } => {
                    let (name, part) = match instr {
                        Instr::AllGather { .. } => ("an all-gather", ShardPart::Params),
                        _ => ("a reduce-scatter", ShardPart::Grads),
                    };
                    if !matches!(kind, StreamKind::Collective { .. }) {
                        return bad(format!(
                            "{name} on a {} stream: collectives run on the collective stream",
                            stream_kind_name(kind)
                        ));
                    }
                    if chunk.index() >= n_chunks {
                        return bad(format!(
                            "{name} of {chunk}, but the chunk table has {n_chunks} chunks"
                        ));
                    }
                    if at.buffer.index() >= n_buffers {
                        return bad(format!(
                            "{name} at {}, but there are {n_buffers} buffers",
                            at.buffer
                        ));
                    }
                    let shard_of = |part| {
                        s.buffers.iter().find(|b| {
                            b.kind
                                == BufferKind::HostShard {
                                    chunk: *chunk,
                                    part,
                                }
                        })
                    };
                    // In the 14-byte layout the gradients' shard is the parameters'.
                    let shard = shard_of(part).or_else(|| shard_of(ShardPart::Params));
                    let Some(shard) = shard else {
                        return bad(format!(
                            "{name} of {chunk}, which is not sharded (no host shard holds it)"
                        ));
                    };
                    if *bytes != shard.size {
                        return bad(format!(
                            "{name} of {chunk} moves {bytes} bytes per rank, but each rank's \
                             shard of it is {} bytes",
                            shard.size
                        ));
                    }
                    let target = s.buffer(at.buffer);
                    if target.space != Space::Device {
                        return bad(format!(
                            "{name} of {chunk} in {} ({}), which is not in the device arena",
                            self.buf(at.buffer),
                            target.name
                        ));
                    }
                    if let Instr::ReduceScatter { dtype, .. } = instr {
                        let param = s
                            .chunks
                            .chunk(*chunk)
                            .members
                            .first()
                            .map(|m| self.g.value(self.g.param(m.param).value).ty.dtype);
                        if let Some(param) = param.filter(|p| p != dtype) {
                            return bad(format!(
                                "reduce-scatters {chunk}'s gradients as {dtype}, but its \
                                 parameters (and gradients) are {param}"
                            ));
                        }
                    }
                }
                Instr::AllReduce { value, at } => {
                    if !matches!(kind, StreamKind::Collective { .. }) {
                        return bad(format!(
                            "an all-reduce on a {} stream: collectives run on the collective \
                             stream",
                            stream_kind_name(kind)
                        ));
                    }
                    if value.index() >= n_values {
                        return bad(format!("sums {value}, but the graph has {n_values} values"));
                    }
                    if at.buffer.index() >= n_buffers {
                        return bad(format!(
                            "sums at {}, but there are {n_buffers} buffers",
                            at.buffer
                        ));
                    }
                    let dtype = g.value(*value).ty.dtype;
                    if !matches!(
                        dtype,
                        crate::types::DType::F32
                            | crate::types::DType::BF16
                            | crate::types::DType::F16
                    ) {
                        return bad(format!(
                            "sums {}, a {dtype} value; collectives sum f32, bf16 and f16",
                            self.name(*value)
                        ));
                    }
                }
                // Checked before any part is (`Checker::phases`).
                Instr::EndMicroBatch { .. } => {}
                Instr::Record { event } | Instr::Wait { event } => {
                    if event.0 >= s.events {
                        return bad(format!(
                            "uses e{}, but events are numbered 0..{}",
                            event.0, s.events
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    // 3. optimizer ------------------------------------------------------------------------

    pub(super) fn optimizer(&self) -> Result<(), ScheduleError> {
        // (setting, value, whether it is valid, the range, the flag that sets it)
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
                    ("lr", lr, finite_at_least_0(lr), "finite and >= 0", "--lr"),
                    ("beta1", beta1, decay(beta1), "in [0, 1)", "--beta1"),
                    ("beta2", beta2, decay(beta2), "in [0, 1)", "--beta2"),
                    ("eps", eps, finite_above_0(eps), "finite and > 0", "--eps"),
                    (
                        "weight_decay",
                        weight_decay,
                        finite_at_least_0(weight_decay),
                        "finite and >= 0",
                        "--weight-decay",
                    ),
                ],
                OpKind::ClipCoef { max_norm } => vec![(
                    "max_norm",
                    max_norm,
                    finite_above_0(max_norm),
                    "finite and > 0",
                    "--grad-clip",
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
                        "--loss-scale-init",
                    )];
                    if let Some(max_norm) = max_norm {
                        v.push((
                            "max_norm",
                            max_norm,
                            finite_above_0(max_norm),
                            "finite and > 0",
                            "--grad-clip",
                        ));
                    }
                    v
                }
                OpKind::CrossEntropyBackwardLossScaled { loss_scale, .. } => vec![(
                    "loss_scale",
                    loss_scale,
                    finite_above_0(loss_scale),
                    "finite and > 0",
                    "--loss-scale-init",
                )],
                _ => continue,
            };
            if let Some(&(name, value, _, range, flag)) = settings.iter().find(|s| !s.2) {
                let at = self.instrs().find_map(|(r, instr)| match instr {
                    Instr::Kernel { op, .. } if *op == id => Some(r),
                    _ => None,
                });
                let msg = format!(
                    "{name} = {value:?}, but it must be {range}, or the step computes NaN or \
                     diverges; compile the schedule again with a valid {flag}"
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
            let (space, a) = match s.buffer(t.buffer).kind {
                BufferKind::HostShard { .. } => {
                    let b = s.buffer(t.buffer);
                    (b.space, b.offset + t.offset)
                }
                _ => s.address(t),
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
