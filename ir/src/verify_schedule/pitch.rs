//! The pitch check: every padded buffer ([`RowPitch`](crate::RowPitch)) holds one device
//! activation in rows of [`ROW_PITCH_ALIGN`]-byte multiples, and only kernels that take a row
//! pitch for that operand address it.

use super::{Checker, InstrRef, Invariant, ScheduleError};
use crate::ids::{BufferId, StreamId, ValueId};
use crate::schedule::{BufferKind, Instr, Space, TensorRef, ROW_PITCH_ALIGN};
use std::collections::HashMap;

/// The bytes of every pitched value, `rows x pitch x element size`, by value: what its
/// buffer holds. Values out of range are left out (the ids check names them).
pub(super) fn pitched_bytes(s: &crate::schedule::Schedule) -> HashMap<ValueId, u64> {
    s.buffers
        .iter()
        .filter_map(|b| b.pitch)
        .filter(|p| p.value.index() < s.graph.values().len())
        .map(|p| {
            let ty = &s.graph.value(p.value).ty;
            let bytes = ty
                .rows()
                .saturating_mul(p.pitch)
                .saturating_mul(ty.dtype.size());
            (p.value, bytes)
        })
        .collect()
}

impl Checker<'_> {
    // 3a. pitch ---------------------------------------------------------------------------

    pub(super) fn pitch(&self) -> Result<(), ScheduleError> {
        let s = self.s;
        let fail = |at: Option<InstrRef>, msg: String| self.fail(Invariant::Pitch, at, msg);
        let mut holder: HashMap<ValueId, BufferId> = HashMap::new();
        for (i, b) in s.buffers.iter().enumerate() {
            let Some(p) = b.pitch else { continue };
            let id = BufferId::new(i);
            let label = format!("{} ({})", self.buf(id), b.name);
            if b.space != Space::Device || b.kind != BufferKind::Activation {
                return Err(fail(
                    None,
                    format!("{label} is padded but is not a device activation buffer"),
                ));
            }
            if p.value.index() >= self.g.values().len() {
                return Err(fail(
                    None,
                    format!("{label} is padded for {}, not a value", p.value),
                ));
            }
            if let Some(other) = holder.insert(p.value, id) {
                return Err(fail(
                    None,
                    format!(
                        "{} is padded in both {} and {label}",
                        self.name(p.value),
                        self.buf(other)
                    ),
                ));
            }
            let ty = &self.g.value(p.value).ty;
            let (row, el) = (ty.last_dim(), ty.dtype.size());
            if p.pitch < row {
                return Err(fail(
                    None,
                    format!(
                        "{label}: pitch {} is shorter than {}'s rows of {row}",
                        p.pitch,
                        self.name(p.value)
                    ),
                ));
            }
            if !(p.pitch.saturating_mul(el)).is_multiple_of(ROW_PITCH_ALIGN) {
                return Err(fail(
                    None,
                    format!(
                        "{label}: pitch {} x {el} B is not a multiple of {ROW_PITCH_ALIGN} B",
                        p.pitch
                    ),
                ));
            }
            let want = ty
                .rows()
                .checked_mul(p.pitch)
                .and_then(|n| n.checked_mul(el));
            if want != Some(b.size) {
                return Err(fail(
                    None,
                    format!(
                        "{label} is {} B, not {} rows x pitch {} x {el} B",
                        b.size,
                        ty.rows(),
                        p.pitch
                    ),
                ));
            }
        }
        if holder.is_empty() {
            return Ok(());
        }
        let padded = |t: &TensorRef| {
            s.buffers
                .get(t.buffer.index())
                .and_then(|b| b.pitch)
                .map(|p| p.value)
        };
        let fixed = s
            .homes
            .iter()
            .chain(&s.masters)
            .map(|(_, t)| t)
            .chain([&s.loss])
            .chain(&s.micro_batch_losses);
        for t in fixed {
            if let Some(v) = padded(t) {
                return Err(fail(
                    None,
                    format!(
                        "{} is padded for {} but is a home, the loss or an output",
                        self.buf(t.buffer),
                        self.name(v)
                    ),
                ));
            }
        }
        for (si, stream) in s.streams.iter().enumerate() {
            for (i, instr) in stream.instrs.iter().enumerate() {
                let r = InstrRef {
                    stream: StreamId::new(si),
                    index: i as u32,
                };
                for t in instr.other_addresses() {
                    if let Some(v) = padded(&t) {
                        return Err(fail(
                            Some(r),
                            format!(
                                "addresses {}, padded for {}, which only kernels that take a \
                                 row pitch may",
                                self.buf(t.buffer),
                                self.name(v)
                            ),
                        ));
                    }
                }
                let Instr::Kernel {
                    op,
                    inputs,
                    outputs,
                    ..
                } = instr
                else {
                    continue;
                };
                let o = self.g.op(*op);
                let (ins, outs) = o.kind.pitched_operands();
                let sides = [
                    ("input", inputs, &o.inputs, ins),
                    ("output", outputs, &o.outputs, outs),
                ];
                for (side, refs, values, takes) in sides {
                    for (k, t) in refs.iter().enumerate() {
                        let Some(v) = padded(t) else { continue };
                        let why = if !takes.contains(&k) {
                            Some(format!(
                                "{} takes no row pitch for that operand",
                                o.kind.mnemonic()
                            ))
                        } else if values.get(k) != Some(&v) {
                            Some(format!("the operand is not {}", self.name(v)))
                        } else if t.offset != 0 {
                            Some(format!("at offset {:#x}, not the buffer's start", t.offset))
                        } else {
                            None
                        };
                        if let Some(why) = why {
                            return Err(fail(
                                Some(r),
                                format!(
                                    "{side} {k} is in {}, padded for {}: {why}",
                                    self.buf(t.buffer),
                                    self.name(v)
                                ),
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
