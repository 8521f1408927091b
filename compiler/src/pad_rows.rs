//! Row padding: gives a device activation whose rows are not a multiple of 16 bytes a padded
//! row pitch, where every kernel that reads or writes it takes one.
//!
//! cuBLAS and cuBLASLt pick their vectorised, tensor-core kernels only when every leading
//! dimension (and every row's start) is a multiple of 16 bytes. The LM head's logits and
//! their gradient have rows of the vocabulary (GPT-2's 50257 is odd), so stored densely they
//! rule those kernels out for the head's three GEMMs. This pass pads such a value's buffer to
//! rows of `pitch` elements, the row length rounded up to
//! [`ROW_PITCH_ALIGN`] bytes, and records the pitch ([`RowPitch`]); the planner then places
//! the larger buffer, so the arena and peak memory include the padding exactly.
//!
//! A value is padded only when its buffer is a device activation holding it alone, and every
//! kernel operand that addresses the buffer is that value at the buffer's start in a position
//! its op kind reads or writes at a row pitch ([`OpKind::pitched_operands`]). A value a copy
//! moves (a swapped activation), a home, the loss, or a value any other kernel reads (a
//! logit soft-cap, say) keeps the dense layout. Parameters are never padded. It changes no
//! result: the padding elements are never read as data.

use crate::streams::Streamed;
use fnv::FnvHashMap as HashMap;
use protrain_ir::{BufferId, BufferKind, Instr, RowPitch, Space, ValueId, ROW_PITCH_ALIGN};

/// What the kernels do with one buffer: the value they address in it, or `None` once some
/// use rules padding out.
type Uses = HashMap<BufferId, Option<ValueId>>;

/// Pads the rows of every device activation that qualifies (see the module doc) and returns
/// the buffers it padded. It does not move anything: offsets are the planner's.
pub fn pad_rows(streamed: &mut Streamed) -> Vec<BufferId> {
    let graph = &streamed.placed.graph;
    let mut uses: Uses = HashMap::default();
    let refuse = |uses: &mut Uses, b: BufferId| {
        uses.insert(b, None);
    };
    let fixed = streamed
        .homes
        .iter()
        .chain(&streamed.masters)
        .map(|(_, t)| t)
        .chain([&streamed.loss])
        .chain(&streamed.outputs);
    for t in fixed {
        refuse(&mut uses, t.buffer);
    }
    for instr in streamed.streams.iter().flat_map(|s| &s.instrs) {
        for t in instr.other_addresses() {
            refuse(&mut uses, t.buffer);
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
        let o = graph.op(*op);
        let (takes_in, takes_out) = o.kind.pitched_operands();
        let sides = [
            (inputs, &o.inputs, takes_in),
            (outputs, &o.outputs, takes_out),
        ];
        for (refs, values, takes) in sides {
            for (k, t) in refs.iter().enumerate() {
                let v = values[k];
                let fits = t.offset == 0 && takes.contains(&k);
                let seen = uses.entry(t.buffer).or_insert(Some(v));
                if !fits || *seen != Some(v) {
                    *seen = None;
                }
            }
        }
    }
    let mut padded = Vec::new();
    for (i, pending) in streamed.buffers.iter_mut().enumerate() {
        let b = &mut pending.buffer;
        let id = BufferId::new(i);
        let Some(&Some(v)) = uses.get(&id) else {
            continue;
        };
        let ty = &graph.value(v).ty;
        if b.space != Space::Device
            || b.kind != BufferKind::Activation
            || b.size != ty.bytes()
            || ty.shape.len() < 2
        {
            continue;
        }
        let Some(pitch) = row_pitch(ty.last_dim(), ty.dtype.size()) else {
            continue;
        };
        b.size = ty.rows() * pitch * ty.dtype.size();
        b.pitch = Some(RowPitch { value: v, pitch });
        padded.push(id);
    }
    padded
}

/// The padded pitch, in elements, of rows of `row` elements of `element` bytes: the least
/// that is at least `row` and a multiple of [`ROW_PITCH_ALIGN`] bytes; `None` when the rows
/// are aligned already (or an element does not divide the alignment).
pub fn row_pitch(row: u64, element: u64) -> Option<u64> {
    if element == 0 || !ROW_PITCH_ALIGN.is_multiple_of(element) {
        return None;
    }
    let step = ROW_PITCH_ALIGN / element;
    match row.is_multiple_of(step) {
        true => None,
        false => Some(row.div_ceil(step) * step),
    }
}

#[cfg(test)]
mod tests {
    use super::row_pitch;

    #[test]
    fn the_pitch_rounds_rows_up_to_16_bytes() {
        assert_eq!(row_pitch(50257, 2), Some(50264));
        assert_eq!(row_pitch(50257, 4), Some(50260));
        assert_eq!(row_pitch(50264, 2), None);
        assert_eq!(row_pitch(768, 4), None);
        assert_eq!(row_pitch(3, 8), Some(4));
        assert_eq!(row_pitch(7, 3), None);
    }
}
