//! Helpers the integration tests share: the repository's paths and JSON fixtures, relative
//! errors, schedule headers without budgets, and the batches the data loader would cut from
//! the synthetic corpus.

pub mod bf16;
pub mod fixture_run;

use protrain::ir::{HardwareProfile, PeakFlops};
use protrain_compiler::emit::HeaderInputs;
use protrain_runtime::synthetic::SyntheticCorpus;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// The repository's root (the `protrain` crate's directory).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `tests/fixtures`: the fixture models and what PyTorch and transformers computed for them.
pub fn fixtures() -> PathBuf {
    root().join("tests/fixtures")
}

/// The JSON file at `path`; fails the test naming the file if it cannot be read.
pub fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("fixture JSON")
}

/// A JSON array of numbers.
pub fn numbers(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|x| x.as_f64().expect("a number"))
        .collect()
}

/// The relative error of `got` against `want`.
pub fn relative(got: f64, want: f64) -> f64 {
    (got - want).abs() / want.abs()
}

/// The relative error of `a` against `b`, with `b` held at least 1e-12 away from zero.
pub fn relative_f32(a: f32, b: f32) -> f64 {
    (f64::from(a) - f64::from(b)).abs() / f64::from(b).abs().max(1e-12)
}

/// The rtx3090 preset.
pub fn rtx3090() -> HardwareProfile {
    HardwareProfile::preset("rtx3090").expect("rtx3090 is a preset")
}

/// The `host` preset as it reads on a 2-core machine with 16 GiB of memory. `host` describes
/// the machine the test runs on (its cores set the peak rates, its memory the budgets), and a
/// snapshot must not depend on that.
pub fn pinned_host() -> HardwareProfile {
    const GIB: u64 = 1 << 30;
    let mut p = HardwareProfile::preset("host").expect("host is a preset");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let two_cores = |rate: f64| (rate / cores * 2.0).round();
    p.description = "the host preset as on 2 cores and 16 GiB (pinned for snapshots)".into();
    p.device_memory_bytes = 8 * GIB;
    p.host_memory_bytes = 8 * GIB;
    p.peak_flops = PeakFlops {
        f32: two_cores(p.peak_flops.f32),
        bf16: two_cores(p.peak_flops.bf16),
        f16: two_cores(p.peak_flops.f16),
    };
    p.device_bandwidth = two_cores(p.device_bandwidth);
    p.h2d_bandwidth = two_cores(p.h2d_bandwidth);
    p.d2h_bandwidth = two_cores(p.d2h_bandwidth);
    p.host_memcpy_bandwidth = two_cores(p.host_memcpy_bandwidth);
    p.cpu_adam_params_per_s = two_cores(p.cpu_adam_params_per_s);
    p.gpu_adam_params_per_s = two_cores(p.gpu_adam_params_per_s);
    p
}

/// A header for a schedule compiled in a test: no budgets, no report.
pub fn header(model: &str, hardware: &str) -> HeaderInputs {
    HeaderInputs {
        model: model.into(),
        hardware: hardware.into(),
        device_budget_bytes: u64::MAX,
        host_budget_bytes: u64::MAX,
        report: String::new(),
        flash_attention: true,
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
