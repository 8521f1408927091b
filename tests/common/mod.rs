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
