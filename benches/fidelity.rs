//! Cost-model fidelity on the host: predicted versus measured step time of offloading schedules.
//
// Profiles the host for a GPT-2-shaped model (8 layers, hidden 256, vocab 8192, batch 4 x
// seq 256, f32; 8 layers because smaller models pack into one or two chunks, which leaves
// nothing to stream), compiles three policies: the search's under a device budget of 45% of
// the fully resident arena (so it must stream chunks and recompute blocks), and two fixed ones
// that stream every chunk (one checkpointing half the blocks, one swapping two and
// checkpointing two). Runs each with the executor, in `FIDELITY_RUNS` rounds (default 2), and
// prints predicted and measured step time and busy time per stream, with the errors; with
// `FIDELITY_BY_OP=1` also per op kind. Target: every step time within 5%.
//
// The prediction comes from profiles taken between the run's own steps: before each timed
// step the host is profiled once (one timed run per op and per copy direction), and the
// schedule's step is predicted from the median of those profiles. On a shared virtual machine
// the same op runs tens of percent faster or slower from one minute to the next, so a profile
// taken apart from the run measures the drift more than the model; profiles and steps that
// alternate see the machine alike. `FIDELITY_INTERLEAVE=0` profiles once per round instead,
// just before the round's runs. The prediction is the simulation's step, which on the host backend
// includes what the compute kernels lose to the copy threads and the CPU Adam on the same
// cores (`simulate::shared_core_seconds`, printed as "shared"). `FIDELITY_CONTENTION=N` first
// measures that loss directly (see `contention`), N times alternating.
//
// `cargo bench --bench fidelity`. Environment: `FIDELITY_LAYERS`, `FIDELITY_HIDDEN`,
// `FIDELITY_BATCH`, `FIDELITY_SEQ`, `FIDELITY_STEPS` (timed steps per run, default 9; the
// median is kept), `FIDELITY_REPEATS` (timed runs per op in each profile, default 9),
// `FIDELITY_BUDGET` (fraction of the resident arena), `FIDELITY_POLICIES` (`;`-separated,
// `auto` for the search's) override the defaults; `FIDELITY_ISOLATED=1` times each op alone
// (hot caches) instead of in place; `FIDELITY_ADAM_PROBE=N` first times the first schedule's
// host optimizer AdamW sizes outside the executor, N times (see `adam_probe`);
// `FIDELITY_ADAM_OPS=1` lists each host optimizer AdamW op of the median step (start, rate,
// share of it beside a compute kernel); `FIDELITY_SHARE_PROBE=N` measures the share of its rate
// the host optimizer keeps beside compute N times, for the graph's AdamW ops cut three ways
// (see `share_probe`); `FIDELITY_ADAM_AFTER=1` prints, for every step, the
// rate of its AdamW ops alone and beside compute and one Adam step over as many parameters
// timed right after it. The host is measured as it is: run it on an idle machine
// (other processes on the same cores inflate the measured times).

mod common;
use common::{env, median, model};
use protrain::compiler::cost::{cost_model, CostModel, Measured};
use protrain::compiler::simulate::{instr_seconds, shared_core_seconds, simulate};
use protrain::ir::verify_schedule::VerifiedSchedule;
use protrain::ir::Graph;
use protrain::ir::{format_bytes, BlockMode, DType, HardwareProfile, Instr, Schedule, StreamId};
use protrain::runtime::params::init_params;
use protrain::runtime::profiler::{measure_host_ops, profile_host, ProfileOptions, Profiled};
use protrain::runtime::Executor;
use protrain::{CompileOptions, OptimizerConfig, PolicyChoice};
use std::collections::BTreeMap;

/// What one schedule's run measured.
struct Run {
    /// Median step seconds.
    step: f64,
    /// Median busy seconds per stream.
    busy: Vec<f64>,
    /// Median seconds per (stream, op mnemonic or copy).
    by_kind: BTreeMap<(usize, String), f64>,
    /// The profiles taken between its steps, when interleaved.
    profiles: Vec<Profiled>,
    /// The host optimizer's AdamW work of the median step, split by whether each op ran
    /// beside a compute kernel.
    adam: AdamSplit,
}

/// Host optimizer AdamW seconds and parameters, apart for ops that overlapped a compute
/// kernel (by more than half their time) and ops that ran with the compute stream idle: the
/// in-schedule rate of each against the profile's isolated rate says how much of the stream's
/// excess is the cores it shares with compute.
#[derive(Clone, Default)]
struct AdamSplit {
    beside_seconds: f64,
    beside_params: f64,
    alone_seconds: f64,
    alone_params: f64,
    /// Seconds of the ops counted alone during which a compute kernel ran, and during which
    /// a copy (either direction) ran.
    alone_beside_compute: f64,
    alone_beside_copies: f64,
    /// Seconds of the ops counted beside compute during which a copy ran.
    beside_copies: f64,
    /// The host optimizer streams' busy seconds outside their spans: from the end of a run of
    /// AdamW ops' last op to the stream going on (its issuing thread woken).
    after_runs: f64,
    /// Each AdamW op of the step, in the order of its spans.
    ops: Vec<AdamOpSpan>,
}

/// One host optimizer AdamW op in a traced step.
#[derive(Clone)]
struct AdamOpSpan {
    /// The parameter it updates.
    name: String,
    params: f64,
    /// Its span's start in the step and its seconds.
    start: f64,
    seconds: f64,
    /// Seconds of its span during which a compute kernel ran, and a copy (either direction).
    beside_compute: f64,
    beside_copies: f64,
}

impl AdamSplit {
    /// The split of one step's traced spans.
    fn of(schedule: &Schedule, spans: &[protrain::runtime::Span]) -> AdamSplit {
        use protrain::ir::StreamKind;
        let kind = |s: &protrain::runtime::Span| &schedule.streams[s.stream.index()];
        let of_kind = |k: &[StreamKind]| -> Vec<(f64, f64)> {
            spans
                .iter()
                .filter(|s| k.contains(&kind(s).kind))
                .map(|s| (s.start, s.end))
                .collect()
        };
        let compute = of_kind(&[StreamKind::Compute]);
        let copies = of_kind(&[StreamKind::HostToDevice, StreamKind::DeviceToHost]);
        let within = |set: &[(f64, f64)], start: f64, end: f64| -> f64 {
            set.iter()
                .map(|&(a, b)| (b.min(end) - a.max(start)).max(0.0))
                .sum()
        };
        let mut out = AdamSplit::default();
        for span in spans
            .iter()
            .filter(|s| kind(s).kind == StreamKind::HostOptimizer)
        {
            let Instr::Kernel { op, .. } = &kind(span).instrs[span.index as usize] else {
                continue;
            };
            let op = schedule.graph.op(*op);
            if op.kind.mnemonic() != "adamw" {
                continue;
            }
            let params = schedule.graph.value(op.inputs[0]).ty.numel() as f64;
            let seconds = span.end - span.start;
            let overlap = within(&compute, span.start, span.end);
            let beside_copies = within(&copies, span.start, span.end).min(seconds);
            out.ops.push(AdamOpSpan {
                name: schedule.graph.value(op.inputs[0]).name.clone(),
                params,
                start: span.start,
                seconds,
                beside_compute: overlap,
                beside_copies,
            });
            if overlap > 0.5 * seconds {
                out.beside_seconds += seconds;
                out.beside_params += params;
                out.beside_copies += beside_copies;
            } else {
                out.alone_seconds += seconds;
                out.alone_params += params;
                out.alone_beside_compute += overlap;
                out.alone_beside_copies += beside_copies;
            }
        }
        out
    }
}

/// Runs `steps` steps after one warm-up step; with `interleave`, profiles the host (one timed
/// run per op) before each timed step, so that the profiles and the steps see the machine at
/// the same moments.
fn run(
    schedule: &VerifiedSchedule,
    vocab: usize,
    steps: usize,
    interleave: Option<(&[Graph], &ProfileOptions)>,
) -> Run {
    let mut executor = Executor::new(schedule).expect("the schedule runs on the host");
    executor
        .load_params(&init_params(&schedule.graph, 1))
        .expect("parameters load");
    let n = (schedule.header.batch * schedule.header.seq) as usize;
    let tokens: Vec<i32> = (0..n + 1)
        .map(|i| ((i * 7919 + 13) % vocab) as i32)
        .collect();
    let (x, y) = (&tokens[..n], &tokens[1..]);
    let mut walls = Vec::new();
    let mut busy: Vec<Vec<f64>> = vec![Vec::new(); schedule.streams.len()];
    let mut kinds: BTreeMap<(usize, String), Vec<f64>> = BTreeMap::new();
    executor.set_tracing(true);
    let mut profiles = Vec::new();
    let mut adam: Vec<AdamSplit> = Vec::new();
    for step in 0..=steps {
        if let (Some((graphs, options)), true) = (interleave, step > 0) {
            profiles.push(profile_both(graphs, options));
        }
        executor.step(&[x, y]).expect("a step runs");
        if step == 0 {
            continue;
        }
        let timeline = executor.timeline();
        let split = AdamSplit::of(schedule, &timeline);
        if env("FIDELITY_ADAM_AFTER", 0) > 0 && split.alone_seconds > 0.0 {
            // The machine's Adam rate right after the step, over as many parameters: whether
            // a slow step's lone AdamW ops were the executor's or the moment's.
            let params = (split.alone_params + split.beside_params) as usize;
            let after = protrain::runtime::profiler::measure_adam(params, 3);
            // The ops beside compute, apart by whether a copy ran beside them too.
            let mut with = [(0.0, 0.0); 2];
            for op in &split.ops {
                if op.beside_compute > 0.5 * op.seconds {
                    let w = &mut with[usize::from(op.beside_copies > 0.5 * op.seconds)];
                    w.0 += op.params;
                    w.1 += op.seconds;
                }
            }
            let rate = |(p, s): (f64, f64)| match s > 0.0 {
                true => format!("{:.0}", p / s / 1e6),
                false => "-".into(),
            };
            println!(
                "  step {step}: lone AdamW {:.0} M params/s, beside compute {:.0} M/s ({} M/s \
                 without copies, {} M/s with); one step over {params} params right after \
                 {:.0} M/s",
                split.alone_params / split.alone_seconds / 1e6,
                split.beside_params / split.beside_seconds.max(1e-9) / 1e6,
                rate(with[0]),
                rate(with[1]),
                after / 1e6
            );
        }
        let mut split = split;
        let t = executor.timing();
        for (i, stream) in schedule.streams.iter().enumerate() {
            if stream.kind == protrain::ir::StreamKind::HostOptimizer {
                let spans: f64 = timeline
                    .iter()
                    .filter(|s| s.stream.index() == i)
                    .map(|s| s.end - s.start)
                    .sum();
                split.after_runs += (t.stream_busy_seconds[i] - spans).max(0.0);
            }
        }
        adam.push(split);
        let mut this: BTreeMap<(usize, String), f64> = BTreeMap::new();
        for span in timeline {
            let s = span.stream.index();
            let instr = &schedule.streams[s].instrs[span.index as usize];
            *this.entry((s, what(schedule, instr))).or_insert(0.0) += span.end - span.start;
        }
        for (k, v) in this {
            kinds.entry(k).or_default().push(v);
        }
        walls.push(t.wall_seconds);
        for (b, &s) in busy.iter_mut().zip(&t.stream_busy_seconds) {
            b.push(s);
        }
    }
    // The split of the step whose host optimizer time is the median.
    adam.sort_by(|a, b| {
        (a.beside_seconds + a.alone_seconds).total_cmp(&(b.beside_seconds + b.alone_seconds))
    });
    Run {
        adam: adam.get(adam.len() / 2).cloned().unwrap_or_default(),
        step: median(walls),
        busy: busy.into_iter().map(median).collect(),
        by_kind: kinds.into_iter().map(|(k, v)| (k, median(v))).collect(),
        profiles,
    }
}

/// The median of several profiles of one machine: every measured figure (op times by key,
/// bandwidths, rates, launch overhead, peaks) is the median of its values, the rest is the
/// first profile's.
fn median_profile(profiles: &[Profiled]) -> HardwareProfile {
    let figure = |f: &dyn Fn(&HardwareProfile) -> f64| {
        median(profiles.iter().map(|p| f(&p.profile)).collect())
    };
    let mut out = profiles[0].profile.clone();
    out.peak_flops.f32 = figure(&|p| p.peak_flops.f32);
    out.peak_flops.bf16 = figure(&|p| p.peak_flops.bf16);
    out.peak_flops.f16 = figure(&|p| p.peak_flops.f16);
    out.device_bandwidth = figure(&|p| p.device_bandwidth);
    out.h2d_bandwidth = figure(&|p| p.h2d_bandwidth);
    out.d2h_bandwidth = figure(&|p| p.d2h_bandwidth);
    out.host_memcpy_bandwidth = figure(&|p| p.host_memcpy_bandwidth);
    out.launch_overhead_s = figure(&|p| p.launch_overhead_s);
    out.cpu_adam_params_per_s = figure(&|p| p.cpu_adam_params_per_s);
    out.cpu_adam_op_s = figure(&|p| p.cpu_adam_op_s);
    let share = |f: &dyn Fn(&HardwareProfile) -> Option<f64>| {
        let shares: Vec<f64> = profiles.iter().filter_map(|p| f(&p.profile)).collect();
        (!shares.is_empty()).then(|| median(shares))
    };
    out.cpu_adam_compute_share = share(&|p| p.cpu_adam_compute_share);
    out.cpu_adam_copy_share = share(&|p| p.cpu_adam_copy_share);
    out.cpu_adam_compute_copy_share = share(&|p| p.cpu_adam_compute_copy_share);
    out.gpu_adam_params_per_s = figure(&|p| p.gpu_adam_params_per_s);
    for op in &mut out.measured_ops {
        op.seconds = median(
            profiles
                .iter()
                .filter_map(|p| p.profile.measured(&op.key))
                .collect(),
        );
    }
    out
}

/// An instruction's op mnemonic, or `copy`.
fn what(schedule: &Schedule, instr: &Instr) -> String {
    match instr {
        Instr::Kernel { op, .. } => {
            let op = schedule.graph.op(*op);
            format!("{} ({})", op.kind.mnemonic(), op.phase)
        }
        _ => "copy".into(),
    }
}

/// Predicted seconds per (stream, op mnemonic or copy).
fn predicted_by_kind(schedule: &Schedule, cost: &dyn CostModel) -> BTreeMap<(usize, String), f64> {
    let mut out = BTreeMap::new();
    for (s, stream) in schedule.streams.iter().enumerate() {
        for instr in &stream.instrs {
            if matches!(instr, Instr::Kernel { .. } | Instr::Copy { .. }) {
                let t = instr_seconds(schedule, StreamId::new(s), instr, cost);
                *out.entry((s, what(schedule, instr))).or_insert(0.0) += t;
            }
        }
    }
    out
}

/// A host profile with both sides of every fusion measured: the fused training graph's op
/// table, plus the unfused graph's ops (`graphs` is [`protrain::profiling_graphs`]'s pair).
fn profile_both(graphs: &[Graph], options: &ProfileOptions) -> Profiled {
    let mut profiled = profile_host(&graphs[1], options).expect("profiling");
    let unfused = measure_host_ops(&graphs[0], options).expect("profiling");
    profiled.profile.add_measured_ops(&unfused);
    profiled
}

/// What the compute kernels lose to the other streams' threads on the same cores: the serial
/// compute of `graph` timed in place alone, beside a loop of host AdamW steps
/// (`FIDELITY_ADAM_PARAMS` parameters each), beside a loop of 64 MiB copies, and beside a
/// thread that only wakes (every 200 us, for 20 us of work), `rounds` times each, alternating
/// so that the machine's drift falls on all four alike. Prints, per neighbour, the compute's
/// slowdown, and its cost per second of the neighbour's own work (at its isolated rate) that
/// overlapped it: the factor that the simulator's sharing term
/// (`simulate::shared_core_seconds`) takes as 1 for the Adam, and for a copy as 1 / cores (a
/// measured profile) or 1 (the host preset). The waking thread's cost is per wake-up: what a
/// kernel split over every core loses when a thread takes one of them for a moment.
fn contention(graph: &Graph, rounds: usize) {
    use protrain::runtime::kernels::{adamw_step, AdamWConfig};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::time::{Duration, Instant};
    const NEIGHBOURS: [&str; 4] = [
        "alone",
        "beside CPU Adam",
        "beside memcpy",
        "beside wake-ups",
    ];
    let params = env("FIDELITY_ADAM_PARAMS", 4usize << 20);
    let copy_bytes = 64usize << 20;
    let (nap, work) = (Duration::from_micros(200), Duration::from_micros(20));
    let options = ProfileOptions {
        repeats: 1,
        copy_repeats: 1,
        ..ProfileOptions::default()
    };
    // Isolated seconds of one unit of each neighbour's work: an Adam step, a copy, a wake-up.
    let unit_seconds = [
        0.0,
        params as f64 / protrain::runtime::profiler::measure_adam(params, 5),
        copy_bytes as f64 / protrain::runtime::profiler::measure_memcpy(copy_bytes as u64, 5),
        work.as_secs_f64(),
    ];
    // The neighbours' operands, allocated and touched once, outside the timed windows.
    let (mut p, g) = (vec![0.1f32; params], vec![0.01f32; params]);
    let (mut m, mut v) = (vec![0.0f32; params], vec![0.0f32; params]);
    let (src, mut dst) = (vec![1u8; copy_bytes], vec![0u8; copy_bytes]);
    let config = AdamWConfig::default();
    let mut step = 0;
    // Serial compute seconds, and the neighbour's units of work per wall second.
    let mut timed = |neighbour: usize| -> (f64, f64) {
        let stop = AtomicBool::new(false);
        let done = AtomicU64::new(0);
        std::thread::scope(|scope| {
            if neighbour > 0 {
                scope.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        match neighbour {
                            1 => {
                                step += 1;
                                adamw_step(&mut p, &g, &mut m, &mut v, step, &config)
                            }
                            2 => dst.copy_from_slice(std::hint::black_box(&src)),
                            _ => {
                                std::thread::sleep(nap);
                                let woke = Instant::now();
                                while woke.elapsed() < work {
                                    std::hint::spin_loop();
                                }
                            }
                        }
                        std::hint::black_box(&mut dst);
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
            let began = Instant::now();
            let profiled = profile_host(graph, &options).expect("profiling");
            let wall = began.elapsed().as_secs_f64();
            stop.store(true, Ordering::Relaxed);
            (
                profiled.graph_seconds,
                done.load(Ordering::Relaxed) as f64 / wall,
            )
        })
    };
    let mut samples: [Vec<(f64, f64)>; 4] = Default::default();
    for _ in 0..rounds {
        for (neighbour, s) in samples.iter_mut().enumerate() {
            s.push(timed(neighbour));
        }
    }
    let alone = median(samples[0].iter().map(|s| s.0).collect());
    println!(
        "contention: serial compute alone {alone:.4} s (median of {rounds}); Adam {:.0} M \
         params/s, memcpy {:.1} GB/s alone",
        params as f64 / unit_seconds[1] / 1e6,
        copy_bytes as f64 / unit_seconds[2] / 1e9
    );
    for (neighbour, s) in samples.iter().enumerate().skip(1) {
        let shared = median(s.iter().map(|s| s.0).collect());
        let per_second = median(s.iter().map(|s| s.1).collect());
        let lost = shared - alone;
        // The neighbour's isolated work that overlapped the timed compute.
        let units = per_second * shared;
        println!(
            "  {:<16} {shared:.4} s ({:+.1}%): {units:.0} units of work beside it, {:.2} s \
             of its isolated work per second; compute loses {:.2} s per second of it, {:.1} us \
             per unit",
            NEIGHBOURS[neighbour],
            error_pct(shared, alone),
            per_second * unit_seconds[neighbour],
            lost / (units * unit_seconds[neighbour]),
            lost / units * 1e6,
        );
    }
}

/// The shares of its rate the host optimizer keeps beside the graph's backward kernels, the
/// copies and both (`FIDELITY_SHARE_PROBE=N`, `rounds` times; `profile`'s measurement,
/// `measure_adam_shares`), over the graph's parameters cut three ways: as its AdamW ops, as
/// one op, and as its ops of more than one block alone. Where the host backend waited for
/// each op's last block, the first measured far below the second.
fn share_probe(graph: &Graph, copy_bytes: u64, rounds: usize) {
    use protrain::runtime::profiler::{adam_sizes, measure_adam_shares, RunAdamW};
    use protrain::runtime::{Backend, HostBackend};
    let backend = HostBackend::new(256, 0, 0).expect("a backend");
    let sizes = adam_sizes(graph);
    let total: usize = sizes.iter().sum();
    let large: Vec<usize> = sizes
        .iter()
        .copied()
        .filter(|&n| n > protrain::runtime::kernels::ADAMW_BLOCK)
        .collect();
    let run: &RunAdamW<'_> = &|steps, ended| backend.run_host_adamw(steps, ended);
    let share = |sizes: &[usize]| {
        let params = sizes.iter().sum();
        let shares = measure_adam_shares::<HostBackend>(graph, sizes, params, copy_bytes, 9, run)
            .expect("the shares are measured");
        let show = |s: Option<f64>| s.map_or("-".to_string(), |s| format!("{s:.2}"));
        format!(
            "{}/{}/{}",
            show(shares.compute),
            show(shares.copy),
            show(shares.compute_and_copy)
        )
    };
    for _ in 0..rounds {
        println!(
            "share probe (beside compute/copies/both): as its {} ops {}; as one op {}; its {} \
             ops of several blocks {}",
            sizes.len(),
            share(&sizes),
            share(&[total]),
            large.len(),
            share(&large),
        );
    }
}

/// What the host optimizer stream's AdamW work costs outside the executor, `rounds` times
/// alternating (`FIDELITY_ADAM_PROBE=N`): the profile's hot 4 Mi-parameter step; one step over
/// 64 Mi parameters (1 GiB of state, beyond the last-level cache); and the schedule's own
/// parameters (their sizes, in their runs of adjacent AdamW ops) updated one after the other
/// from a thread outside the pools: each op's blocks handed to the global pool, each run one
/// job of a pool of its own (as the host backend's `run_host_adamw`), the same after a 1 GiB
/// sweep evicts the caches, beside `graph`'s profiling (its ops, copies and Adam) running in
/// a loop, and with 20 ms idle before each run (its pool's threads asleep, as between a
/// schedule's runs; the idle time not counted).
fn adam_probe(schedule: &Schedule, graph: &Graph, rounds: usize) {
    use protrain::ir::StreamKind;
    use protrain::runtime::kernels::{adamw_step, AdamWConfig};
    use protrain::runtime::profiler::measure_adam;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;
    let mut runs: Vec<Vec<usize>> = Vec::new();
    for stream in schedule
        .streams
        .iter()
        .filter(|s| s.kind == StreamKind::HostOptimizer)
    {
        let mut run: Vec<usize> = Vec::new();
        for instr in &stream.instrs {
            match instr {
                Instr::Kernel { op, .. } if schedule.graph.op(*op).kind.mnemonic() == "adamw" => {
                    let op = schedule.graph.op(*op);
                    run.push(schedule.graph.value(op.inputs[0]).ty.numel() as usize);
                }
                _ if !run.is_empty() => runs.push(std::mem::take(&mut run)),
                _ => {}
            }
        }
        if !run.is_empty() {
            runs.push(run);
        }
    }
    let total: usize = runs.iter().flatten().sum();
    let ops = runs.iter().map(Vec::len).sum::<usize>();
    let small = runs
        .iter()
        .flatten()
        .filter(|&&n| n <= protrain::runtime::kernels::ADAMW_BLOCK)
        .count();
    println!(
        "adam probe: {total} params in {ops} AdamW ops ({small} of one block), {} runs; load {}",
        runs.len(),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    // Each parameter's value, gradient and moments.
    type State = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);
    let mut state: Vec<Vec<State>> = runs
        .iter()
        .map(|r| {
            r.iter()
                .map(|&n| {
                    (
                        vec![0.1f32; n],
                        vec![0.01f32; n],
                        vec![0.0f32; n],
                        vec![0.0f32; n],
                    )
                })
                .collect()
        })
        .collect();
    let config = AdamWConfig::default();
    let optimizer_pool = rayon::ThreadPoolBuilder::new()
        .num_threads(rayon::current_num_threads())
        .build()
        .expect("a pool");
    let mut step = 1u64;
    let mut sweep = vec![0u8; 1 << 30];
    // Seconds of one pass over the schedule's parameters.
    let mut pass = |per_run: bool, cold: bool, idle: bool| -> f64 {
        if cold {
            for (i, b) in sweep.iter_mut().enumerate().step_by(64) {
                *b = b.wrapping_add(i as u8);
            }
            std::hint::black_box(&mut sweep);
        }
        step += 1;
        let mut idled = std::time::Duration::ZERO;
        let began = Instant::now();
        for run in state.iter_mut() {
            if idle {
                // The pools' threads fall asleep, as between a schedule's runs.
                let at = Instant::now();
                std::thread::sleep(std::time::Duration::from_millis(20));
                idled += at.elapsed();
            }
            let mut each = || {
                for (p, g, m, v) in run.iter_mut() {
                    adamw_step(p, g, m, v, step, &config);
                }
            };
            match per_run {
                true => optimizer_pool.install(each),
                false => each(),
            }
        }
        (began.elapsed() - idled).as_secs_f64()
    };
    pass(true, false, false);
    let names = [
        "profile's 4 Mi, hot",
        "64 Mi (1 GiB of state)",
        "schedule's, a hand-off per op",
        "schedule's, a hand-off per run",
        "schedule's, per run, caches swept",
        "schedule's, per run, beside compute",
        "schedule's, per run, 20 ms idle before each",
    ];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    let options = ProfileOptions {
        repeats: 1,
        copy_repeats: 1,
        ..ProfileOptions::default()
    };
    for _ in 0..rounds {
        rates[0].push(measure_adam(4 << 20, 3));
        rates[1].push(measure_adam(64 << 20, 2));
        rates[2].push(total as f64 / pass(false, false, false));
        rates[3].push(total as f64 / pass(true, false, false));
        rates[4].push(total as f64 / pass(true, true, false));
        rates[6].push(total as f64 / pass(true, false, true));
        let stop = AtomicBool::new(false);
        let beside = std::thread::scope(|scope| {
            scope.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    profile_host(graph, &options).expect("profiling");
                }
            });
            std::thread::sleep(std::time::Duration::from_millis(300));
            let mut t = Vec::new();
            for _ in 0..5 {
                t.push(pass(true, false, false));
                std::thread::sleep(std::time::Duration::from_millis(7));
            }
            stop.store(true, Ordering::Relaxed);
            median(t)
        });
        rates[5].push(total as f64 / beside);
    }
    let hot = median(rates[0].clone());
    for (name, r) in names.iter().zip(rates) {
        let (lo, hi) = r
            .iter()
            .fold((f64::INFINITY, 0.0f64), |(a, b), &x| (a.min(x), b.max(x)));
        let med = median(r);
        println!(
            "  {name:<38} {:>6.0} M params/s ({:.0}-{:.0}), {:.2}x the hot 4 Mi",
            med / 1e6,
            lo / 1e6,
            hi / 1e6,
            med / hot
        );
    }
    println!(
        "  load after {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
}

fn error_pct(predicted: f64, measured: f64) -> f64 {
    (predicted - measured) / measured * 100.0
}

/// A measured share as `0.93x`, `-` where none was measured.
fn show_share(share: Option<f64>) -> String {
    share.map_or("-".into(), |s| format!("{s:.2}x"))
}

/// One line on the profile that predicts the next run: its serial compute (the median of
/// `profiles`' and their range when several) against the first profile's, copies and Adam.
fn print_profile(label: &str, profile: &HardwareProfile, profiles: &[&Profiled], first: f64) {
    let serial: Vec<f64> = profiles.iter().map(|p| p.graph_seconds).collect();
    let (lo, hi) = serial.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &s| {
        (lo.min(s), hi.max(s))
    });
    let serial = median(serial);
    let range = if profiles.len() > 1 {
        format!(" (median of {}, {lo:.4}-{hi:.4})", profiles.len())
    } else {
        String::new()
    };
    println!(
        "{label}: {serial:.4} s serial compute{range}, {:+.1}% against the first; copies \
         {:.1}/{:.1} GB/s, Adam {:.0} M params/s + {:.1} us per op, {}/{}/{} beside \
         compute/copies/both",
        error_pct(serial, first),
        profile.h2d_bandwidth / 1e9,
        profile.d2h_bandwidth / 1e9,
        profile.cpu_adam_params_per_s / 1e6,
        profile.cpu_adam_op_s * 1e6,
        show_share(profile.cpu_adam_compute_share),
        show_share(profile.cpu_adam_copy_share),
        show_share(profile.cpu_adam_compute_copy_share),
    );
}

/// The resident schedule (no budget), the device budget the search gets (`fraction` of the
/// resident arena) and the schedules of `FIDELITY_POLICIES` under it.
fn compile_policies(
    config: &protrain::models::ModelConfig,
    profile: &HardwareProfile,
    optimizer: &OptimizerConfig,
    (batch, seq): (u64, u64),
    fraction: f64,
) -> (protrain::Compiled, u64, Vec<protrain::Compiled>) {
    let options = |budget: Option<u64>, policy: PolicyChoice| CompileOptions {
        batch,
        seq,
        dtype: DType::F32,
        hardware: profile.clone(),
        device_budget: budget,
        policy,
        optimizer: optimizer.clone(),
        fuse: true,
        forward_only: false,
        micro_batches: 1,
        topology: protrain::compiler::comm::Topology::SINGLE,
    };
    let resident = protrain::compile(
        config,
        &options(None, PolicyChoice::Fixed(Default::default())),
    )
    .expect("the resident schedule compiles");
    let budget = (resident.schedule.arena_bytes as f64 * fraction) as u64;
    let specs: String = env(
        "FIDELITY_POLICIES",
        "auto;n_persist=0 n_buffer=2 n_checkpoint=4;n_persist=0 n_buffer=2 n_swap=2 n_checkpoint=2"
            .to_string(),
    );
    let compiled = specs
        .split(';')
        .map(|spec| match spec.trim() {
            "auto" => protrain::compile(config, &options(Some(budget), PolicyChoice::Auto))
                .expect("a schedule fits the budget"),
            spec => {
                let spec = spec.parse().expect("FIDELITY_POLICIES holds policies");
                protrain::compile(config, &options(None, PolicyChoice::Fixed(spec)))
                    .expect("the policy compiles")
            }
        })
        .collect();
    (resident, budget, compiled)
}

/// Prints each compiled schedule's policy, its fusions, and how many of its ops the profile
/// does not cover.
fn describe(
    compiled: &[protrain::Compiled],
    resident: &protrain::Compiled,
    budget: u64,
    fraction: f64,
    profile: &HardwareProfile,
) {
    let table = Measured::new(profile.clone());
    for c in compiled {
        let schedule = &c.schedule;
        let policy = &schedule.header.policy;
        println!(
            "policy {policy}: {} of {} chunks persistent, {} checkpointed, {} swapped, arena {} \
             (budget for the search: {}, {:.0}% of the resident {})",
            policy.n_persist,
            schedule.chunks.len(),
            policy.count(BlockMode::Checkpoint),
            policy.count(BlockMode::Swap),
            format_bytes(schedule.arena_bytes),
            format_bytes(budget),
            fraction * 100.0,
            format_bytes(resident.schedule.arena_bytes),
        );
        if let Some(fusion) = &c.fusion {
            // Fused forms are kept only where the measured op times say they are faster.
            print!("{}", fusion.to_text());
        }
        let missing = schedule
            .graph
            .ops()
            .filter(|(_, op)| {
                let types: Vec<_> = op
                    .inputs
                    .iter()
                    .map(|&v| &schedule.graph.value(v).ty)
                    .collect();
                table.lookup(&op.kind, &types).is_none()
            })
            .count();
        if missing > 0 {
            println!("warning: {missing} ops of the schedule are not in the op table (roofline)");
        }
    }
}

/// Which run of which schedule [`compare`] reports on.
struct Label {
    round: usize,
    steps: usize,
    is_resident: bool,
    by_op: bool,
    first_serial: f64,
}

/// Prints one schedule's predicted and measured step and busy time per stream (and per op
/// kind with `by_op`); the prediction uses `round_profile`, or else the median of the profiles
/// taken between the run's steps. Returns the step's error in percent.
fn compare(
    schedule: &VerifiedSchedule,
    measured_run: Run,
    round_profile: Option<&HardwareProfile>,
    label: Label,
) -> f64 {
    let Label {
        round,
        steps,
        is_resident,
        by_op,
        first_serial,
    } = label;
    let profile = match round_profile {
        Some(profile) => profile.clone(),
        None => {
            let profile = median_profile(&measured_run.profiles);
            let all: Vec<&Profiled> = measured_run.profiles.iter().collect();
            print_profile(
                &format!("run {round} profiles between its steps"),
                &profile,
                &all,
                first_serial,
            );
            profile
        }
    };
    let cost = cost_model(&profile);
    let cores = cost.host_cores().unwrap_or(f64::INFINITY);
    let simulation = simulate(schedule, cost.as_ref()).expect("a verified schedule");
    let Run {
        step: measured,
        busy,
        by_kind: measured_kinds,
        adam,
        ..
    } = measured_run;
    let predicted = simulation.step_seconds;
    // Overlap arithmetic can leave -0.0 where nothing overlaps.
    let shared = shared_core_seconds(&simulation.timeline, cores).max(0.0);
    let err = error_pct(predicted, measured);
    println!(
        "run {round} {}{}: predicted {predicted:.4} s (shared {shared:.4} s), measured \
         {measured:.4} s (median of {steps}), error {err:+.1}%",
        if is_resident { "(resident) " } else { "" },
        schedule.header.policy
    );
    for (i, stream) in schedule.streams.iter().enumerate() {
        let p = simulation.stream_busy_seconds[i];
        let m = busy[i];
        let err = if m > 0.0 {
            format!("{:+.1}%", error_pct(p, m))
        } else {
            "-".into()
        };
        println!(
            "  {:<14} busy predicted {p:.4} s, measured {m:.4} s, error {err}",
            stream.name
        );
    }
    if adam.beside_params + adam.alone_params > 0.0 {
        let rate = |params: f64, seconds: f64| match seconds > 0.0 {
            true => format!(
                "{:.0} M params/s ({:.2}x the profile's)",
                params / seconds / 1e6,
                params / seconds / profile.cpu_adam_params_per_s
            ),
            false => "-".into(),
        };
        println!(
            "  host optimizer AdamW beside compute {:.4} s, {} (of it {:.4} s beside copies); \
             alone {:.4} s, {} (of it {:.4} s beside compute, {:.4} s beside copies); {:.4} s \
             after its runs",
            adam.beside_seconds,
            rate(adam.beside_params, adam.beside_seconds),
            adam.beside_copies,
            adam.alone_seconds,
            rate(adam.alone_params, adam.alone_seconds),
            adam.alone_beside_compute,
            adam.alone_beside_copies,
            adam.after_runs,
        );
    }
    if env("FIDELITY_ADAM_OPS", 0) > 0 {
        println!(
            "  host optimizer AdamW ops of the median step: start, params, us, M/s, beside \
             compute, beside copies"
        );
        for op in &adam.ops {
            println!(
                "    {:>8.4} s {:>9.0} {:>8.1} us {:>6.0} M/s {:>4.0}% {:>4.0}%  {}",
                op.start,
                op.params,
                op.seconds * 1e6,
                op.params / op.seconds / 1e6,
                100.0 * op.beside_compute / op.seconds,
                100.0 * op.beside_copies / op.seconds,
                op.name
            );
        }
    }
    if by_op {
        let predicted_kinds = predicted_by_kind(schedule, cost.as_ref());
        println!("  by op (median step)        predicted   measured");
        for (key, p) in &predicted_kinds {
            let m = measured_kinds.get(key).copied().unwrap_or(0.0);
            println!(
                "    {:<14} {:<28} {p:>8.4} s {m:>8.4} s {:+6.1}%",
                schedule.streams[key.0].name,
                key.1,
                error_pct(*p, m)
            );
        }
    }
    err
}

fn main() {
    let layers = env("FIDELITY_LAYERS", 8u64);
    let hidden = env("FIDELITY_HIDDEN", 256u64);
    let batch = env("FIDELITY_BATCH", 4u64);
    let seq = env("FIDELITY_SEQ", 256u64);
    let steps = env("FIDELITY_STEPS", 9usize);
    let fraction = env("FIDELITY_BUDGET", 0.45f64);
    let config = model(layers, hidden);
    let optimizer = OptimizerConfig::default();
    // The unfused and the fused training graph, so both sides of every fusion are measured.
    let graphs = protrain::profiling_graphs(
        &config,
        batch,
        seq,
        DType::F32,
        &optimizer,
        &HardwareProfile::host(),
    )
    .expect("the model builds");
    let graph = &graphs[1];
    // FIDELITY_ISOLATED=1 times each op alone on hot operands instead of in place.
    let isolated = env("FIDELITY_ISOLATED", 0u8) == 1;
    let profile_options = ProfileOptions {
        in_place_limit: if isolated { 0 } else { u64::MAX },
        repeats: env("FIDELITY_REPEATS", 9usize),
        ..ProfileOptions::default()
    };
    let profiled = profile_both(&graphs, &profile_options);
    let profile = profiled.profile.clone();
    let first_serial = profiled.graph_seconds;
    println!(
        "model {} ({} params), batch {batch} x seq {seq}, f32; profiled in {:.1} s ({}): {} \
         ops, {:.3} s serial compute, copies {:.1}/{:.1} GB/s, Adam {:.0} M params/s",
        config.name,
        graph.param_count(),
        profiled.elapsed_seconds,
        if isolated {
            "ops one by one"
        } else {
            "ops in place"
        },
        profile.measured_ops.len(),
        profiled.graph_seconds,
        profile.h2d_bandwidth / 1e9,
        profile.d2h_bandwidth / 1e9,
        profile.cpu_adam_params_per_s / 1e6,
    );

    let (resident, budget, compiled) =
        compile_policies(&config, &profile, &optimizer, (batch, seq), fraction);
    describe(&compiled, &resident, budget, fraction, &profile);
    if env("FIDELITY_CONTENTION", 0usize) > 0 {
        contention(graph, env("FIDELITY_CONTENTION", 0usize));
    }
    if env("FIDELITY_ADAM_PROBE", 0usize) > 0 {
        if let Some(c) = compiled.first() {
            adam_probe(&c.schedule, graph, env("FIDELITY_ADAM_PROBE", 0usize));
        }
    }
    if env("FIDELITY_SHARE_PROBE", 0usize) > 0 {
        share_probe(
            graph,
            profile_options.copy_bytes,
            env("FIDELITY_SHARE_PROBE", 0usize),
        );
    }
    let runs = env("FIDELITY_RUNS", 2usize);
    let by_op = env("FIDELITY_BY_OP", 0u8) == 1;
    let interleave = env("FIDELITY_INTERLEAVE", 1u8) == 1;
    // Between steps: one timed run per op and per copy direction, the median over the steps.
    let step_options = ProfileOptions {
        repeats: 1,
        copy_repeats: 1,
        ..profile_options.clone()
    };
    let mut worst: f64 = 0.0;
    for round in 1..=runs {
        // Not interleaved: this round's profile, taken now, predicts this round's steps.
        let round_profile = (!interleave).then(|| {
            let profiled = profile_both(&graphs, &profile_options);
            print_profile(
                &format!("run {round} profile"),
                &profiled.profile,
                &[&profiled],
                first_serial,
            );
            profiled.profile
        });
        for schedule in compiled
            .iter()
            .map(|c| &c.schedule)
            .chain([&resident.schedule])
        {
            let is_resident = std::ptr::eq(schedule, &resident.schedule);
            let measured_run = run(
                schedule,
                config.vocab_size as usize,
                steps,
                interleave.then_some((&graphs[..], &step_options)),
            );
            let err = compare(
                schedule,
                measured_run,
                round_profile.as_ref(),
                Label {
                    round,
                    steps,
                    is_resident,
                    by_op,
                    first_serial,
                },
            );
            if !is_resident {
                worst = worst.max(err.abs());
            }
        }
    }
    println!(
        "fidelity        {} (worst {worst:.1}% over {} policies x {runs} runs; target: within 5%)",
        if worst <= 5.0 { "ok" } else { "MISSED" },
        compiled.len()
    );
}
