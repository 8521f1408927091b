//! The byte model the data-flow check runs on: each space as disjoint ranges tagged with what
//! they hold, who wrote them and who has read them since.

use super::InstrRef;
use crate::ids::ValueId;
use crate::schedule::Space;
use std::collections::BTreeMap;

/// What a byte range holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Content {
    /// Bytes of a value whose first byte is at `base` in the same space.
    Value {
        value: ValueId,
        base: u64,
        /// Written in place by an op that updates its inputs (AdamW).
        updated: bool,
    },
    /// A kernel's workspace.
    Scratch,
    /// Bytes a copy moved from memory nothing had written (chunk padding).
    Undefined,
}

/// Who last wrote a byte range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Writer {
    /// The runtime, before the step (a home).
    Home,
    /// An instruction.
    Instr(InstrRef),
}

/// A tagged byte range `[start, end)` (the start is its key in [`Memory`]).
#[derive(Clone, Debug)]
pub(super) struct Segment {
    pub(super) end: u64,
    pub(super) content: Content,
    pub(super) writer: Writer,
    /// For each stream, 1 + the index of its last instruction that read these bytes since
    /// they were written, or 0. Stream order is total, so the last read stands for all.
    pub(super) readers: Box<[u32]>,
}

/// One space's bytes as disjoint tagged ranges; untagged bytes were never written.
pub(super) struct Memory {
    pub(super) segments: BTreeMap<u64, Segment>,
    streams: usize,
}

impl Memory {
    pub(super) fn new(streams: usize) -> Self {
        Self {
            segments: BTreeMap::new(),
            streams,
        }
    }

    /// Splits the segment that straddles `at`, if any, so that `at` starts a segment.
    fn split(&mut self, at: u64) {
        let Some((_, seg)) = self.segments.range_mut(..at).next_back() else {
            return;
        };
        if seg.end <= at {
            return;
        }
        // Both halves keep the content and its base: bases are absolute addresses.
        let tail = seg.clone();
        seg.end = at;
        self.segments.insert(at, tail);
    }

    /// Splits so that `[a, b)` is covered by whole segments (and gaps).
    pub(super) fn isolate(&mut self, a: u64, b: u64) {
        self.split(a);
        self.split(b);
    }

    /// The segments inside `[a, b)`, which must have been isolated.
    pub(super) fn within(&self, a: u64, b: u64) -> impl Iterator<Item = (u64, &Segment)> {
        self.segments.range(a..b).map(|(&start, seg)| (start, seg))
    }

    /// Records that `reader` read `[a, b)` (isolated).
    pub(super) fn read(&mut self, a: u64, b: u64, reader: InstrRef) {
        for (_, seg) in self.segments.range_mut(a..b) {
            seg.readers[reader.stream.index()] = reader.index + 1;
        }
    }

    /// Replaces whatever `[a, b)` (isolated) held by `pieces`, given as offsets from `a`.
    pub(super) fn write(
        &mut self,
        a: u64,
        b: u64,
        pieces: &[(u64, u64, Content)],
        writer: InstrRef,
    ) {
        let keys: Vec<u64> = self.segments.range(a..b).map(|(&k, _)| k).collect();
        for k in keys {
            self.segments.remove(&k);
        }
        for &(start, end, content) in pieces {
            if end > start {
                self.segments.insert(
                    a + start,
                    Segment {
                        end: a + end,
                        content,
                        writer: Writer::Instr(writer),
                        readers: vec![0; self.streams].into_boxed_slice(),
                    },
                );
            }
        }
    }
}

/// Whether `w` happens before the instruction whose vector clock is `clock` (component `s`:
/// how many of stream `s`'s instructions happen before it or are it).
pub(super) fn hb(w: InstrRef, clock: &[u32]) -> bool {
    w.index < clock[w.stream.index()]
}

/// The index of a space's [`Memory`].
pub(super) fn space_index(space: Space) -> usize {
    match space {
        Space::Device => 0,
        Space::Host => 1,
        Space::Disk => 2,
    }
}
