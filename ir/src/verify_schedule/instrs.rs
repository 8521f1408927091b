//! The ids check of each instruction kind: the ids it names are in range, it runs on a
//! stream of its kind, and its operands are in the memory and buffers its kind reads and
//! writes. One checker per kind; [`Checker::instr_ids`] dispatches to them.

use super::Checker;
use crate::ids::{ChunkId, OpId, ValueId};
use crate::print_schedule::{copy_label, space_name, stream_kind_name};
use crate::schedule::{BufferKind, CopyKind, Instr, ShardPart, Space, StreamKind, TensorRef};
use crate::types::format_bytes;

impl Checker<'_> {
    /// The ids check of `instr`, on a stream of `kind`: the message of the first problem.
    pub(super) fn instr_ids(&self, kind: StreamKind, instr: &Instr) -> Result<(), String> {
        match instr {
            Instr::Kernel {
                op,
                inputs,
                outputs,
                workspace,
            } => self.kernel_ids(kind, op, inputs, outputs, workspace),
            Instr::Copy {
                what,
                src,
                dst,
                bytes,
            } => self.copy_ids(kind, what, src, dst, bytes),
            Instr::CopyShard {
                what,
                src,
                dst,
                bytes,
            } => self.copy_shard_ids(kind, what, src, dst, bytes),
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
                ..
            } => self.disk_ids(kind, instr, chunk, src, dst, bytes),
            Instr::CastChunk {
                chunk,
                src,
                dst,
                bytes,
            } => self.cast_ids(kind, chunk, src, dst, bytes),
            Instr::AllGather { chunk, at, bytes }
            | Instr::ReduceScatter {
                chunk, at, bytes, ..
            } => self.collective_ids(kind, instr, chunk, at, bytes),
            Instr::AllReduce { value, at } => self.all_reduce_ids(kind, value, at),
            // Checked before any part is (`Checker::phases`).
            Instr::EndMicroBatch { .. } => Ok(()),
            Instr::Record { event } | Instr::Wait { event } => {
                if event.0 >= self.s.events {
                    return Err(format!(
                        "uses e{}, but events are numbered 0..{}",
                        event.0, self.s.events
                    ));
                }
                Ok(())
            }
        }
    }

    /// Fails unless each of `refs` is in a buffer that exists; `what` says how the instruction
    /// uses them (`copies via`), as the message's start.
    fn buffers_exist(&self, what: &str, refs: &[&TensorRef]) -> Result<(), String> {
        let n_buffers = self.s.buffers.len();
        match refs.iter().find(|t| t.buffer.index() >= n_buffers) {
            Some(t) => Err(format!(
                "{what} {}, but there are {n_buffers} buffers",
                t.buffer
            )),
            None => Ok(()),
        }
    }

    /// A kernel: its op exists and has as many operands as it addresses, all in the memory of
    /// its stream, with a workspace exactly when its op needs one.
    fn kernel_ids(
        &self,
        kind: StreamKind,
        op: &OpId,
        inputs: &[TensorRef],
        outputs: &[TensorRef],
        workspace: &Option<TensorRef>,
    ) -> Result<(), String> {
        let (s, g) = (self.s, self.g);
        let n_buffers = s.buffers.len();
        let n_ops = g.op_count();
        if op.index() >= n_ops {
            return Err(format!("runs {op}, but the graph has {n_ops} ops"));
        }
        let o = g.op(*op);
        let space = match kind {
            StreamKind::Compute => Space::Device,
            StreamKind::HostOptimizer => Space::Host,
            // A micro-batch's gradient summed over the ranks into its
            // accumulator, in the accumulator's memory (both operands there, but
            // a sharded chunk's gradient, read where the backward pass left it).
            StreamKind::Collective { .. } if o.kind == crate::op::OpKind::AccumulateGrad => {
                match inputs.first().and_then(|t| s.buffers.get(t.buffer.index())) {
                    Some(b) => b.space,
                    None => return Err("an accumulate_grad with no accumulator address".into()),
                }
            }
            // A chunk-major schedule's running gradient sum plus a micro-batch's gradient
            // summed over the ranks, on the device.
            StreamKind::Collective { .. } if o.kind == crate::op::OpKind::Add => Space::Device,
            _ => {
                return Err(format!(
                    "a kernel on a {} stream: kernels run on compute and host \
                     optimizer streams (and accumulate_grad on the collective \
                     stream)",
                    stream_kind_name(kind)
                ))
            }
        };
        if inputs.len() != o.inputs.len() || outputs.len() != o.outputs.len() {
            return Err(format!(
                "addresses {} inputs and {} outputs, its op has {} and {}",
                inputs.len(),
                outputs.len(),
                o.inputs.len(),
                o.outputs.len()
            ));
        }
        // A sharded chunk's accumulator (in its gradient shard, or whole in host
        // memory where the update reads the norm) sums gradients on the device.
        let from_device =
            matches!(kind, StreamKind::Collective { .. }) && space == Space::Host && s.sharded();
        for (j, t) in inputs.iter().chain(outputs).chain(workspace).enumerate() {
            if t.buffer.index() >= n_buffers {
                return Err(format!(
                    "addresses {}, but there are {n_buffers} buffers",
                    t.buffer
                ));
            }
            let b = s.buffer(t.buffer);
            let device_grad = from_device && j == 1 && b.space == Space::Device;
            if b.space != space && !device_grad {
                return Err(format!(
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
            // Attention on a GPU without flash attention needs a workspace where it needs none
            // with it.
            (0, Some(w)) if self.workspace_need_without_flash(*op) == 0 => {
                return Err(format!(
                    "has a workspace ({}) but {} needs none",
                    self.buf(w.buffer),
                    o.kind.mnemonic()
                ))
            }
            (n, None) if n > 0 => {
                return Err(format!(
                    "has no workspace but needs {} ({n} B)",
                    format_bytes(n)
                ))
            }
            _ => {}
        }
        Ok(())
    }

    /// A copy: on the stream of its direction, from and to buffers of those spaces, moving a
    /// value's bytes or a whole chunk's members.
    fn copy_ids(
        &self,
        kind: StreamKind,
        what: &CopyKind,
        src: &TensorRef,
        dst: &TensorRef,
        bytes: &u64,
    ) -> Result<(), String> {
        let (s, g) = (self.s, self.g);
        let n_chunks = s.chunks.len();
        let n_values = g.values().len();
        let (from, to) = match kind {
            StreamKind::HostToDevice => (Space::Host, Space::Device),
            StreamKind::DeviceToHost => (Space::Device, Space::Host),
            _ => {
                return Err(format!(
                    "a copy on a {} stream: copies run on host-to-device and \
                     device-to-host streams",
                    stream_kind_name(kind)
                ))
            }
        };
        self.buffers_exist("copies via", &[src, dst])?;
        let (sb, db) = (s.buffer(src.buffer), s.buffer(dst.buffer));
        if sb.space != from || db.space != to {
            return Err(format!(
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
            return Err(format!(
                "a {} copy goes the other way",
                copy_label(*what, &self.names)
            ));
        }
        match *what {
            CopyKind::FetchChunk { chunk } | CopyKind::OffloadGrads { chunk } => {
                if chunk.index() >= n_chunks {
                    return Err(format!(
                        "copies {chunk}, but the chunk table has {n_chunks} chunks"
                    ));
                }
                if let CopyKind::FetchChunk { .. } = what {
                    let c = s.chunks.chunk(chunk);
                    if let Some(m) = c
                        .members
                        .iter()
                        .find(|m| m.offset.checked_add(m.bytes).is_none_or(|e| e > *bytes))
                    {
                        return Err(format!(
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
                    return Err(format!(
                        "copies {value}, but the graph has {n_values} values"
                    ));
                }
                if *bytes != self.bytes(value) {
                    return Err(format!(
                        "copies {bytes} bytes of {}, which has {}",
                        self.name(value),
                        self.bytes(value)
                    ));
                }
            }
        }
        Ok(())
    }

    /// A shard copy: a chunk fetch or gradient offload of a sharded schedule, between the
    /// chunk's host shard and the device arena, moving the whole shard.
    fn copy_shard_ids(
        &self,
        kind: StreamKind,
        what: &CopyKind,
        src: &TensorRef,
        dst: &TensorRef,
        bytes: &u64,
    ) -> Result<(), String> {
        let s = self.s;
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
                return Err(format!(
                    "copies a shard of {}; only chunk fetches and gradient \
                     offloads are sharded",
                    copy_label(*what, &self.names)
                ))
            }
        };
        if kind != stream {
            return Err(format!(
                "a {} shard copy on a {} stream",
                copy_label(*what, &self.names),
                stream_kind_name(kind)
            ));
        }
        if s.ranks() < 2 {
            return Err(
                "copies a shard, but the schedule runs on one rank (it has no \
                 collective stream)"
                    .into(),
            );
        }
        self.buffers_exist("copies via", &[src, dst])?;
        let (host, device) = (s.buffer(from.buffer), s.buffer(to.buffer));
        // In the 14-byte layout an offload lands in the parameter shard (the data
        // flow proves no upload reads it after).
        let lean = part == ShardPart::Grads
            && host.kind
                == (BufferKind::HostShard {
                    chunk,
                    part: ShardPart::Params,
                });
        // The disk tier: a shard on disk is copied through a sharded staging buffer of its
        // part in host memory, which the disk stream reads it into or writes it from (data
        // flow proves that the staging buffer holds this chunk's shard).
        let staged = host.space == Space::Host
            && match host.kind {
                BufferKind::ShardStaging { part: p, .. } => {
                    p == part || (part == ShardPart::Grads && p == ShardPart::Params)
                }
                _ => false,
            };
        if host.kind != (BufferKind::HostShard { chunk, part }) && !lean && !staged {
            return Err(format!(
                "copies a shard of {chunk} through {} ({}), which is not its \
                 host shard of {} (nor a sharded disk staging buffer of that part)",
                self.buf(from.buffer),
                host.name,
                match part {
                    ShardPart::Params => "parameters",
                    _ => "gradients (or parameters, in the 14-byte layout)",
                }
            ));
        }
        if device.space != Space::Device {
            return Err(format!(
                "copies a shard of {chunk} to or from {} ({}), which is not in the \
                 device arena",
                self.buf(to.buffer),
                device.name
            ));
        }
        if *bytes != host.size || from.offset != 0 {
            return Err(format!(
                "copies {bytes} bytes of each rank's shard of {chunk} from +{:#x}, \
                 but each rank's shard is {} bytes from +0x0",
                from.offset, host.size
            ));
        }
        Ok(())
    }

    /// A disk read or write: on the disk i/o stream, a chunk's whole optimizer state, or a
    /// range of its parameter or gradient storage, on disk, to or from the same offsets of a
    /// disk staging buffer.
    fn disk_ids(
        &self,
        kind: StreamKind,
        instr: &Instr,
        chunk: &ChunkId,
        src: &TensorRef,
        dst: &TensorRef,
        bytes: &u64,
    ) -> Result<(), String> {
        let s = self.s;
        let n_chunks = s.chunks.len();
        let (name, disk, host) = match instr {
            Instr::DiskRead { .. } => ("a disk read", src, dst),
            _ => ("a disk write", dst, src),
        };
        if kind != StreamKind::DiskIo {
            return Err(format!(
                "{name} on a {} stream: disk reads and writes run on the disk i/o \
                 stream",
                stream_kind_name(kind)
            ));
        }
        if chunk.index() >= n_chunks {
            return Err(format!(
                "{name} of {chunk}, but the chunk table has {n_chunks} chunks"
            ));
        }
        self.buffers_exist(&format!("{name} via"), &[src, dst])?;
        let (d, h) = (s.buffer(disk.buffer), s.buffer(host.buffer));
        let owned = match d.kind {
            BufferKind::OptimizerState { chunk: c }
            | BufferKind::HostChunk { chunk: c }
            | BufferKind::HostGradChunk { chunk: c }
            | BufferKind::HostShard { chunk: c, .. } => c == *chunk,
            _ => false,
        };
        if d.space != Space::Disk || !owned {
            return Err(format!(
                "{name} of {chunk} on the disk side addresses {} ({}, {}), not \
                 {chunk}'s optimizer state, parameters or gradients on disk",
                self.buf(disk.buffer),
                d.name,
                space_name(d.space)
            ));
        }
        if disk.offset.checked_add(*bytes).is_none_or(|e| e > d.size) {
            return Err(format!(
                "{name} of {chunk} moves {bytes} bytes from +{:#x} of {}, which is {} \
                 bytes",
                disk.offset, d.name, d.size
            ));
        }
        // A shard moves whole: each rank its own slice, `bytes` from `+rank * bytes` of the
        // whole layout, as a shard copy does.
        if let BufferKind::HostShard { part, .. } = d.kind {
            if disk.offset != 0 || *bytes != d.size {
                return Err(format!(
                    "{name} of {chunk} moves {bytes} bytes from +{:#x} of its shard {}, \
                     which is {} bytes a rank: disk reads and writes move each rank's whole \
                     shard from its start",
                    disk.offset, d.name, d.size
                ));
            }
            let staged = h.space == Space::Host
                && h.kind.is_sharded()
                && matches!(h.kind, BufferKind::ShardStaging { part: p, .. } if p == part)
                && host.offset == 0
                && *bytes <= h.size;
            if !staged {
                return Err(format!(
                    "{name} of {chunk}'s shard {} on the host side addresses {}+{:#x} ({}), \
                     not a sharded disk staging buffer of the same part in host memory, from \
                     its start, with room for {bytes} bytes a rank",
                    d.name,
                    self.buf(host.buffer),
                    host.offset,
                    h.name
                ));
            }
            return Ok(());
        }
        if matches!(d.kind, BufferKind::OptimizerState { .. })
            && (disk.offset != 0 || *bytes != d.size)
        {
            return Err(format!(
                "{name} of {chunk} moves {bytes} bytes from +{:#x} of its state, \
                 which is {} bytes: disk reads and writes move a chunk's whole \
                 state from its start",
                disk.offset, d.size
            ));
        }
        // A staging buffer mirrors the disk buffer it stages: the same bytes at the same
        // offsets, so that every address moves to it unchanged but for its buffer.
        if !(h.space == Space::Host
            && matches!(h.kind, BufferKind::DiskStaging { .. })
            && host.offset == disk.offset
            && host.offset.saturating_add(*bytes) <= h.size)
        {
            return Err(format!(
                "{name} of {chunk} on the host side addresses {}+{:#x} ({}), not \
                 a disk staging buffer in host memory at the disk side's offset (+{:#x}) \
                 with room for {bytes} bytes",
                self.buf(host.buffer),
                host.offset,
                h.name,
                disk.offset
            ));
        }
        Ok(())
    }

    /// A cast: on the host cast stream, a chunk's master weights cast whole into the start of
    /// a parameter staging buffer.
    fn cast_ids(
        &self,
        kind: StreamKind,
        chunk: &ChunkId,
        src: &TensorRef,
        dst: &TensorRef,
        bytes: &u64,
    ) -> Result<(), String> {
        let s = self.s;
        let n_chunks = s.chunks.len();
        if kind != StreamKind::HostCast {
            return Err(format!(
                "a cast on a {} stream: casts run on the host cast stream",
                stream_kind_name(kind)
            ));
        }
        if chunk.index() >= n_chunks {
            return Err(format!(
                "casts {chunk}, but the chunk table has {n_chunks} chunks"
            ));
        }
        self.buffers_exist("casts via", &[src, dst])?;
        let (from, to) = (s.buffer(src.buffer), s.buffer(dst.buffer));
        if (from.space, from.kind) != (Space::Host, BufferKind::OptimizerState { chunk: *chunk }) {
            return Err(format!(
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
            return Err(format!(
                "casts {chunk} into {}+{:#x} ({}), not the start of a parameter \
                 staging buffer in host memory",
                self.buf(dst.buffer),
                dst.offset,
                to.name
            ));
        }
        let used = s.chunks.chunk(*chunk).used_bytes;
        if *bytes != used {
            return Err(format!(
                "casts {bytes} bytes of {chunk}, which uses {used}: a cast writes \
                 the whole chunk"
            ));
        }
        let Some(pieces) = s.cast_pieces(*chunk, *src, *dst) else {
            return Err(format!(
                "casts {chunk}, whose parameters are not all bf16 or f16: only \
                 narrow parameters are cast from f32 master weights"
            ));
        };
        for p in pieces {
            if !s.masters.contains(&(p.value, p.master)) {
                return Err(format!(
                    "casts {} from {}+{:#x}, which is not its master weight: the \
                     chunk's master weights must be contiguous in member order \
                     from the cast's source",
                    self.name(p.value),
                    self.buf(p.master.buffer),
                    p.master.offset
                ));
            }
        }
        Ok(())
    }

    /// An all-gather or reduce-scatter: on the collective stream, a sharded chunk's shard
    /// bytes per rank, in the device arena, in the parameters' dtype.
    fn collective_ids(
        &self,
        kind: StreamKind,
        instr: &Instr,
        chunk: &ChunkId,
        at: &TensorRef,
        bytes: &u64,
    ) -> Result<(), String> {
        let s = self.s;
        let n_chunks = s.chunks.len();
        let (name, part) = match instr {
            Instr::AllGather { .. } => ("an all-gather", ShardPart::Params),
            _ => ("a reduce-scatter", ShardPart::Grads),
        };
        if !matches!(kind, StreamKind::Collective { .. }) {
            return Err(format!(
                "{name} on a {} stream: collectives run on the collective stream",
                stream_kind_name(kind)
            ));
        }
        if chunk.index() >= n_chunks {
            return Err(format!(
                "{name} of {chunk}, but the chunk table has {n_chunks} chunks"
            ));
        }
        self.buffers_exist(&format!("{name} at"), &[at])?;
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
            return Err(format!(
                "{name} of {chunk}, which is not sharded (no host shard holds it)"
            ));
        };
        if *bytes != shard.size {
            return Err(format!(
                "{name} of {chunk} moves {bytes} bytes per rank, but each rank's \
                 shard of it is {} bytes",
                shard.size
            ));
        }
        let target = s.buffer(at.buffer);
        if target.space != Space::Device {
            return Err(format!(
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
                return Err(format!(
                    "reduce-scatters {chunk}'s gradients as {dtype}, but its \
                     parameters (and gradients) are {param}"
                ));
            }
        }
        Ok(())
    }

    /// An all-reduce: on the collective stream, of an f32, bf16 or f16 value.
    fn all_reduce_ids(
        &self,
        kind: StreamKind,
        value: &ValueId,
        at: &TensorRef,
    ) -> Result<(), String> {
        let g = self.g;
        let n_values = g.values().len();
        if !matches!(kind, StreamKind::Collective { .. }) {
            return Err(format!(
                "an all-reduce on a {} stream: collectives run on the collective \
                 stream",
                stream_kind_name(kind)
            ));
        }
        if value.index() >= n_values {
            return Err(format!("sums {value}, but the graph has {n_values} values"));
        }
        self.buffers_exist("sums at", &[at])?;
        let dtype = g.value(*value).ty.dtype;
        if !matches!(
            dtype,
            crate::types::DType::F32 | crate::types::DType::BF16 | crate::types::DType::F16
        ) {
            return Err(format!(
                "sums {}, a {dtype} value; collectives sum f32, bf16 and f16",
                self.name(*value)
            ));
        }
        Ok(())
    }
}
