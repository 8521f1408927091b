//! Helpers the integration tests that train share: schedule headers without budgets, and the
//! batches the data loader would cut from the synthetic corpus.

use protrain_compiler::emit::HeaderInputs;
use protrain_runtime::synthetic::SyntheticCorpus;

/// A header for a schedule compiled in a test: no budgets, no report.
pub fn header(model: &str, hardware: &str) -> HeaderInputs {
    HeaderInputs {
        model: model.into(),
        hardware: hardware.into(),
        device_budget_bytes: u64::MAX,
        host_budget_bytes: u64::MAX,
        report: String::new(),
    }
}

/// The tokens and targets (the same stream shifted by one) of each of `steps` steps of
/// `batch x seq`, as the data loader cuts them from the synthetic corpus of `vocab` ids
/// seeded with `seed`.
pub fn batches(vocab: usize, batch: u64, seq: u64, steps: usize, seed: u64) -> Vec<[Vec<i32>; 2]> {
    let n = (batch * seq) as usize;
    let stream = SyntheticCorpus::new(vocab, seed)
        .expect("the test vocabularies are valid")
        .tokens(steps * n + 1);
    (0..steps)
        .map(|s| {
            let window: Vec<i32> = stream[s * n..=(s + 1) * n]
                .iter()
                .map(|&t| t as i32)
                .collect();
            [window[..n].to_vec(), window[1..].to_vec()]
        })
        .collect()
}

/// `schedule` with chunk 0 uploaded once more at the end of the step, after its gradient
/// offload (the host-to-device stream waits for an event recorded right after it): in the
/// 14-byte layout, an upload that reads gradients where parameters must be. Whole chunks'
/// copies and shard copies alike.
#[allow(dead_code)] // used by the tests of the 14-byte layout, not by every file sharing this module
pub fn upload_chunk0_after_its_gradient_offload(
    schedule: &protrain_ir::Schedule,
) -> protrain_ir::Schedule {
    use protrain_ir::{CopyKind, EventId, Instr, StreamKind};
    let mut mutated = schedule.clone();
    let find = |kind: StreamKind| {
        mutated
            .streams
            .iter()
            .position(|s| s.kind == kind)
            .expect("a copy stream")
    };
    let (h2d, d2h) = (
        find(StreamKind::HostToDevice),
        find(StreamKind::DeviceToHost),
    );
    let of_chunk0 = |i: &Instr, fetch: bool| match i {
        Instr::Copy { what, .. } | Instr::CopyShard { what, .. } => match what {
            CopyKind::FetchChunk { chunk } => fetch && chunk.0 == 0,
            CopyKind::OffloadGrads { chunk } => !fetch && chunk.0 == 0,
            _ => false,
        },
        _ => false,
    };
    let fetch = mutated.streams[h2d]
        .instrs
        .iter()
        .find(|i| of_chunk0(i, true))
        .cloned()
        .expect("chunk 0's upload");
    let offload = mutated.streams[d2h]
        .instrs
        .iter()
        .position(|i| of_chunk0(i, false))
        .expect("chunk 0's gradient offload");
    let event = EventId(mutated.events);
    mutated.events += 1;
    mutated.streams[d2h]
        .instrs
        .insert(offload + 1, Instr::Record { event });
    mutated.streams[h2d].instrs.push(Instr::Wait { event });
    mutated.streams[h2d].instrs.push(fetch);
    mutated
}
