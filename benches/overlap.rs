//! Overlap on the host: throughput under a 40% device budget versus fully resident.
//
// Step throughput of one model fully resident versus under a device budget of 40% of its
// resident arena, compiled by the search (f32) for a profile measured first. Streaming
// chunks and swapping or recomputing blocks costs copies and compute; this measures how much
// of it the schedule hides. Prints tokens/s of both and the ratio. Target: >= 0.85x.
//
// The default model is GPT-2-shaped, 12 layers of hidden 256, vocab 8192, batch 2 x seq 256:
// at 40% its activations fit swapped. With fewer layers or a larger batch (8 layers, batch 4)
// every block must be recomputed to fit, and recomputation is compute the host cannot hide.
//
// `cargo bench --bench overlap`. Environment: `OVERLAP_LAYERS`, `OVERLAP_HIDDEN`,
// `OVERLAP_BATCH`, `OVERLAP_SEQ`, `OVERLAP_ROUNDS` (alternations of the two schedules),
// `OVERLAP_STEPS` (timed steps per round), `OVERLAP_BUDGET` (fraction of the resident arena)
// override the defaults. Run it on an idle machine.

mod common;
use common::{env, median, model};
use protrain::ir::verify_schedule::VerifiedSchedule;
use protrain::ir::{format_bytes, BlockMode, DType, HardwareProfile};
use protrain::runtime::params::init_params;
use protrain::runtime::profiler::{measure_host_ops, profile_host, ProfileOptions};
use protrain::runtime::Executor;
use protrain::{CompileOptions, Compiled, OptimizerConfig, PolicyChoice};

/// Step seconds of each schedule, by round and schedule: in each of `rounds` rounds every
/// schedule in turn takes one untimed step (to find its memory in the caches again) and then
/// `steps` timed ones, of which the median is kept. Rounds alternate the schedules so that
/// both see the machine in the same state even when its speed drifts.
fn step_seconds(
    schedules: &[&VerifiedSchedule],
    vocab: usize,
    rounds: usize,
    steps: usize,
) -> Vec<Vec<f64>> {
    let mut executors: Vec<Executor> = schedules
        .iter()
        .map(|s| {
            let mut e = Executor::new(s).expect("the schedule runs on the host");
            e.load_params(&init_params(&s.graph, 1))
                .expect("parameters load");
            e
        })
        .collect();
    let n = (schedules[0].header.batch * schedules[0].header.seq) as usize;
    let tokens: Vec<i32> = (0..n + 1)
        .map(|i| ((i * 7919 + 13) % vocab) as i32)
        .collect();
    let (x, y) = (&tokens[..n], &tokens[1..]);
    (0..rounds)
        .map(|_| {
            executors
                .iter_mut()
                .map(|e| {
                    let mut walls = Vec::with_capacity(steps);
                    for step in 0..=steps {
                        e.step(&[x, y]).expect("a step runs");
                        if step > 0 {
                            walls.push(e.timing().wall_seconds);
                        }
                    }
                    median(walls)
                })
                .collect()
        })
        .collect()
}

fn describe(what: &str, c: &Compiled) {
    let s = &c.schedule;
    let p = &s.header.policy;
    println!(
        "{what:<10} policy {p} ({} of {} chunks persistent, {} checkpointed, {} swapped), \
         arena {}, predicted {:.4} s",
        p.n_persist,
        s.chunks.len(),
        p.count(BlockMode::Checkpoint),
        p.count(BlockMode::Swap),
        format_bytes(s.arena_bytes),
        c.simulation.step_seconds
    );
}

fn main() {
    let layers = env("OVERLAP_LAYERS", 12u64);
    let hidden = env("OVERLAP_HIDDEN", 256u64);
    let batch = env("OVERLAP_BATCH", 2u64);
    let seq = env("OVERLAP_SEQ", 256u64);
    let rounds = env("OVERLAP_ROUNDS", 4usize);
    let steps = env("OVERLAP_STEPS", 3usize);
    let fraction = env("OVERLAP_BUDGET", 0.40f64);
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
    let mut profile = profile_host(&graphs[1], &ProfileOptions::default())
        .expect("profiling")
        .profile;
    let unfused = measure_host_ops(&graphs[0], &ProfileOptions::default()).expect("profiling");
    profile.add_measured_ops(&unfused);
    let compile = |budget: Option<u64>| {
        protrain::compile(
            &config,
            &CompileOptions {
                batch,
                seq,
                dtype: DType::F32,
                hardware: profile.clone(),
                device_budget: budget,
                policy: PolicyChoice::Auto,
                optimizer: optimizer.clone(),
                fuse: true,
                forward_only: false,
                micro_batches: 1,
                topology: protrain::compiler::comm::Topology::SINGLE,
            },
        )
    };
    let resident = protrain::compile(
        &config,
        &CompileOptions {
            batch,
            seq,
            dtype: DType::F32,
            hardware: profile.clone(),
            device_budget: None,
            policy: PolicyChoice::Fixed(Default::default()),
            optimizer: optimizer.clone(),
            fuse: true,
            forward_only: false,
            micro_batches: 1,
            topology: protrain::compiler::comm::Topology::SINGLE,
        },
    )
    .expect("the resident schedule compiles");
    let budget = (resident.schedule.arena_bytes as f64 * fraction) as u64;
    let offloaded = compile(Some(budget)).expect("a schedule fits the budget");
    println!(
        "model {} ({} params), batch {batch} x seq {seq}, f32; budget {} = {:.0}% of the \
         resident arena",
        config.name,
        graphs[1].param_count(),
        format_bytes(budget),
        fraction * 100.0
    );
    describe("resident", &resident);
    describe("offloaded", &offloaded);
    let vocab = config.vocab_size as usize;
    let tokens = (batch * seq) as f64;
    let rounds = step_seconds(
        &[&resident.schedule, &offloaded.schedule],
        vocab,
        rounds,
        steps,
    );
    let of = |i: usize| median(rounds.iter().map(|r| r[i]).collect());
    let (full, limited) = (tokens / of(0), tokens / of(1));
    // The median over rounds of each round's ratio: robust to the machine's speed drifting.
    let ratio = median(rounds.iter().map(|r| r[0] / r[1]).collect());
    println!("resident   {full:.0} tokens/s");
    println!("offloaded  {limited:.0} tokens/s");
    let predicted = resident.simulation.step_seconds / offloaded.simulation.step_seconds;
    println!(
        "ratio      {ratio:.3}x measured, {predicted:.3}x predicted ({}; target >= 0.85x)",
        if ratio >= 0.85 { "ok" } else { "MISSED" }
    );
}
