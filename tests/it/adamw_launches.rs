//! Device AdamW is one launch per run of adjacent AdamW ops: the runs the CUDA
//! backend merges (`protrain_runtime::cuda::adamw_runs`) are exactly the runs the simulator
//! prices as one launch each (`protrain_compiler::simulate::device_adamw_runs`), on GPT-2 and
//! LLaMA schedules under every policy, clipped or not, f32 and bf16; a resident GPT-2
//! schedule has one launch per run, not one per parameter; and a GPU's predicted step pays
//! one launch overhead per run.
//!
//! Both rules are plain data over a schedule, so this runs without a GPU or the `cuda`
//! feature. That each run's launch updates every tensor of the run as the per-tensor kernel
//! would, bit for bit, is checked by the CUDA emulation harness (`.ci/run`) and by the launch
//! plan's unit tests (`runtime/src/cuda/launch.rs`).

use crate::common::rtx3090;
use protrain::compiler::cost::cost_model;
use protrain::compiler::simulate::{device_adamw_runs, simulate, stream_seconds};
use protrain::ir::verify_schedule::VerifiedSchedule;
use protrain::ir::{DType, HardwareProfile, Instr, OpKind, Schedule, StreamId, StreamKind};
use protrain::runtime::cuda::adamw_runs;
use protrain::{CompileOptions, OptimizerConfig, PolicyChoice};

/// Every chunk persistent; every chunk streamed; one persistent, the rest streamed.
const POLICIES: [&str; 3] = [
    "",
    "n_persist=0,n_buffer=2,n_checkpoint=2",
    "n_persist=1,n_buffer=2,n_swap=1,n_checkpoint=1",
];

fn compile(model: &str, policy: &str, dtype: DType, grad_clip: Option<f64>) -> VerifiedSchedule {
    let config = protrain::models::load(model).expect("the test models load");
    let options = CompileOptions {
        batch: 2,
        seq: 16,
        dtype,
        hardware: rtx3090(),
        device_budget: None,
        policy: PolicyChoice::parse(policy).expect("the test policies parse"),
        optimizer: OptimizerConfig {
            grad_clip,
            ..OptimizerConfig::default()
        },
        fuse: true,
        forward_only: false,
        micro_batches: 1,
        topology: protrain::compiler::comm::Topology::SINGLE,
    };
    protrain::compile(&config, &options)
        .expect("the test policies compile")
        .schedule
}

/// Whether instruction `i` of stream `s` runs an AdamW op.
fn is_adamw(schedule: &Schedule, s: usize, i: usize) -> bool {
    matches!(
        &schedule.streams[s].instrs[i],
        Instr::Kernel { op, .. } if matches!(schedule.graph.op(*op).kind, OpKind::AdamW { .. })
    )
}

/// The device AdamW instructions of `schedule`, as (stream, index).
fn device_adamw(schedule: &Schedule) -> Vec<(usize, usize)> {
    schedule
        .streams
        .iter()
        .enumerate()
        .filter(|(_, s)| s.kind != StreamKind::HostOptimizer)
        .flat_map(|(s, stream)| (0..stream.instrs.len()).map(move |i| (s, i)))
        .filter(|&(s, i)| is_adamw(schedule, s, i))
        .collect()
}

#[test]
fn the_runtime_merges_the_runs_the_simulator_prices() {
    for model in ["gpt2-tiny", "llama-tiny"] {
        for policy in POLICIES {
            for dtype in [DType::F32, DType::BF16] {
                for clip in [None, Some(1.0)] {
                    let what = format!("{model} [{policy}] {dtype} clip {clip:?}");
                    let schedule = compile(model, policy, dtype, clip);
                    let runtime: Vec<(usize, std::ops::Range<usize>)> = adamw_runs(&schedule)
                        .into_iter()
                        .map(|r| (r.stream.index(), r.instrs))
                        .collect();
                    let simulator: Vec<(usize, std::ops::Range<usize>)> =
                        (0..schedule.streams.len())
                            .flat_map(|s| {
                                device_adamw_runs(&schedule, StreamId::new(s))
                                    .into_iter()
                                    .map(move |r| (s, r))
                            })
                            .collect();
                    assert_eq!(runtime, simulator, "{what}");
                    // The runs cover every device AdamW once, each run only AdamW.
                    let covered: Vec<(usize, usize)> = runtime
                        .iter()
                        .flat_map(|(s, r)| r.clone().map(move |i| (*s, i)))
                        .collect();
                    assert_eq!(covered, device_adamw(&schedule), "{what}");
                }
            }
        }
    }
}

/// GPT-2 tiny, resident: 28 parameters, each updated right after its gradient is complete.
/// Unclipped, the AdamW ops come in 13 weight and bias pairs (a layer's backward produces
/// both) and 2 alone (the position and token embeddings), so 15 launches instead of 28;
/// clipped, every AdamW waits for the clip coefficient, after the backward pass, and all 28
/// are one launch.
#[test]
fn a_resident_gpt2_schedule_launches_adamw_once_per_run() {
    for (clip, launches, longest) in [(None, 15, 2), (Some(1.0), 1, 28)] {
        let schedule = compile("gpt2-tiny", "", DType::F32, clip);
        assert_eq!(device_adamw(&schedule).len(), 28, "clip {clip:?}");
        let runs = adamw_runs(&schedule);
        assert_eq!(runs.len(), launches, "clip {clip:?}: {runs:?}");
        assert_eq!(runs.iter().map(|r| r.len()).max(), Some(longest));
        assert!(runs
            .iter()
            .all(|r| schedule.streams[r.stream.index()].kind == StreamKind::Compute));
    }
}

/// On a GPU, the simulation prices each run as one launch over all its parameters: the first
/// AdamW of a run carries the run, the others cost nothing, so the step is shorter than with
/// one launch per parameter by a launch overhead per merged op.
#[test]
fn a_gpu_step_pays_one_adamw_launch_per_run() {
    let profile = rtx3090();
    let cost = cost_model(&profile);
    assert!(cost.multi_tensor_adamw());
    for clip in [None, Some(1.0)] {
        let schedule = compile("gpt2-tiny", "", DType::F32, clip);
        let runs = adamw_runs(&schedule);
        let compute = StreamId::new(0);
        assert_eq!(schedule.streams[0].kind, StreamKind::Compute);
        let seconds = stream_seconds(&schedule, compute, cost.as_ref());
        let adamw: Vec<f64> = device_adamw(&schedule)
            .into_iter()
            .map(|(_, i)| seconds[i])
            .collect();
        let priced = adamw.iter().filter(|&&t| t > 0.0).count();
        assert_eq!(priced, runs.len(), "clip {clip:?}: {adamw:?}");
        let alone: f64 = device_adamw(&schedule)
            .into_iter()
            .map(|(_, i)| {
                let Instr::Kernel { op, .. } = &schedule.streams[0].instrs[i] else {
                    unreachable!("device_adamw lists kernels")
                };
                let p = schedule.graph.op(*op).inputs[0];
                cost.gpu_adam_seconds(schedule.graph.value(p).ty.numel())
            })
            .sum();
        let merged: f64 = adamw.iter().sum();
        let saved = (28 - runs.len()) as f64 * profile.launch_overhead_s;
        assert!(
            (alone - merged - saved).abs() <= 1e-9 * alone,
            "clip {clip:?}: {alone} alone, {merged} merged, {saved} saved"
        );
        let sim = simulate(&schedule, cost.as_ref()).expect("a verified schedule simulates");
        let spans = sim
            .timeline
            .iter()
            .filter(|s| s.stream == compute && s.end > s.start)
            .filter(|s| is_adamw(&schedule, 0, s.index))
            .count();
        assert_eq!(spans, runs.len(), "clip {clip:?}: one span per launch");
    }
}

/// The host backend launches one AdamW per parameter, and its profile says so: host
/// predictions price every AdamW alone.
#[test]
fn the_host_prices_every_adamw_alone() {
    let host = HardwareProfile::preset("host").expect("host is a preset");
    let cost = cost_model(&host);
    assert!(!cost.multi_tensor_adamw());
    let schedule = compile("gpt2-tiny", "", DType::F32, Some(1.0));
    let seconds = stream_seconds(&schedule, StreamId::new(0), cost.as_ref());
    for (_, i) in device_adamw(&schedule) {
        assert!(seconds[i] > 0.0, "instruction {i}");
    }
}
