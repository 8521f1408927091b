//! The order checks: every event recorded once and waited for, and no deadlock.

use super::{Checker, InstrRef, Invariant, ScheduleError};
use crate::ids::StreamId;
use crate::schedule::Instr;

impl Checker<'_> {
    // 8. events ---------------------------------------------------------------------------

    fn records(&self) -> Vec<Option<InstrRef>> {
        let mut records = vec![None; self.s.events as usize];
        for (r, instr) in self.instrs() {
            if let Instr::Record { event } = instr {
                records[event.index()].get_or_insert(r);
            }
        }
        records
    }

    pub(super) fn events(&self) -> Result<(), ScheduleError> {
        let n = self.s.events as usize;
        let mut records: Vec<Option<InstrRef>> = vec![None; n];
        let mut first_wait: Vec<Option<InstrRef>> = vec![None; n];
        for (r, instr) in self.instrs() {
            match instr {
                Instr::Record { event } => {
                    if let Some(first) = records[event.index()].replace(r) {
                        return Err(self.fail(
                            Invariant::Events,
                            Some(r),
                            format!(
                                "records e{} a second time (first at {})",
                                event.0,
                                self.at(first)
                            ),
                        ));
                    }
                }
                Instr::Wait { event } => {
                    first_wait[event.index()].get_or_insert(r);
                }
                _ => {}
            }
        }
        for e in 0..n {
            match (records[e], first_wait[e]) {
                (None, Some(w)) => {
                    return Err(self.fail(
                        Invariant::Events,
                        Some(w),
                        format!("waits for e{e}, which no stream records"),
                    ))
                }
                // One part of an accumulating schedule uses only its own events.
                (None, None) if self.part != super::Part::Whole => {}
                (None, None) => {
                    return Err(self.fail(
                        Invariant::Events,
                        None,
                        format!(
                            "e{e} is never recorded nor waited for: events are numbered \
                             0..{n}, all used",
                        ),
                    ))
                }
                (Some(rec), None) => {
                    return Err(self.fail(
                        Invariant::Events,
                        Some(rec),
                        format!("records e{e}, which no stream waits for"),
                    ))
                }
                (Some(_), Some(_)) => {}
            }
        }
        for (r, instr) in self.instrs() {
            if let Instr::Wait { event } = instr {
                let rec = records[event.index()].expect("checked above");
                if rec.stream == r.stream && rec.index > r.index {
                    return Err(self.fail(
                        Invariant::Events,
                        Some(r),
                        format!(
                            "waits for e{}, which this stream records later (#{}): it would \
                             wait forever",
                            event.0, rec.index
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    // 9. deadlock -------------------------------------------------------------------------

    pub(super) fn deadlock(&self) -> Result<(), ScheduleError> {
        let s = self.s;
        let records = self.records();
        let mut recorded = vec![false; s.events as usize];
        let mut pc = vec![0usize; s.streams.len()];
        loop {
            let mut progress = false;
            for (si, stream) in s.streams.iter().enumerate() {
                while let Some(instr) = stream.instrs.get(pc[si]) {
                    match instr {
                        Instr::Wait { event } if !recorded[event.index()] => break,
                        Instr::Record { event } => recorded[event.index()] = true,
                        _ => {}
                    }
                    pc[si] += 1;
                    progress = true;
                }
            }
            if !progress {
                break;
            }
        }
        let mut blocked = Vec::new();
        let mut first = None;
        for (si, stream) in s.streams.iter().enumerate() {
            if let Some(Instr::Wait { event }) = stream.instrs.get(pc[si]) {
                let r = InstrRef {
                    stream: StreamId::new(si),
                    index: pc[si] as u32,
                };
                first.get_or_insert(r);
                let rec = records[event.index()].expect("events checked");
                blocked.push(format!(
                    "stream {} #{} waits for e{}, which stream {} records at #{}",
                    stream.name,
                    pc[si],
                    event.0,
                    s.streams[rec.stream.index()].name,
                    rec.index
                ));
            }
        }
        match first {
            None => Ok(()),
            Some(r) => Err(ScheduleError {
                invariant: Invariant::Deadlock,
                at: Some(r),
                message: format!("deadlock: no stream can go on: {}", blocked.join("; ")),
            }),
        }
    }
}
