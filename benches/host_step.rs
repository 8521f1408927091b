//! One training step of a small GPT-2 on the host backend, in tokens per second.
//!
//! The model is GPT-2-shaped (4 layers, hidden 256, 4 heads, vocabulary 8192, 256 positions;
//! f32), the batch 8 sequences of 256 tokens: the shape `benches/compare_pytorch.py` times in
//! PyTorch. Three ways to run the same step are measured:
//!
//! - `interpreter`: the reference interpreter (every value its own vector, ops in graph order);
//! - `executor/resident`: a compiled schedule with every chunk persistent and every block kept;
//! - `executor/offload`: a schedule for a device budget half the resident one: every chunk on
//!   the host, streamed through two buffers and updated by the host Adam, two blocks swapped and
//!   two checkpointed (ProTrain's layout).
//!
//! Every schedule trains bit-identically to the interpreter (`tests/it/equivalence.rs`), so the
//! three differ only in speed: what placement costs on the host, and how close the executor's
//! overhead is to none. Run with `cargo bench --bench host_step`; the rayon pool (and so the
//! gemm threads) follows `RAYON_NUM_THREADS`, all cores by default.

use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use protrain_compiler::emit::HeaderInputs;
use protrain_compiler::pipeline::{chunked, compile_policy, training_graph};
use protrain_compiler::OptimizerConfig;
use protrain_ir::verify_schedule::{verify, VerifiedSchedule};
use protrain_ir::{BlockKind, DType, Graph, Instr, Policy, Schedule};
use protrain_models::{BuildOptions, ConfigSource, ModelConfig};
use protrain_runtime::interpreter::Interpreter;
use protrain_runtime::params::init_params;
use protrain_runtime::synthetic::SyntheticCorpus;
use protrain_runtime::Executor;
use std::hint::black_box;
use std::time::Duration;

const BATCH: u64 = 8;
const SEQ: u64 = 256;
const SEED: u64 = 0;

/// The model, as a Hugging Face `config.json` would give it (the same fields
/// `compare_pytorch.py` hands `GPT2Config`).
const CONFIG: &str = r#"{
  "model_type": "gpt2",
  "architectures": ["GPT2LMHeadModel"],
  "vocab_size": 8192,
  "n_positions": 256,
  "n_embd": 256,
  "n_layer": 4,
  "n_head": 4,
  "n_inner": null,
  "activation_function": "gelu_new",
  "layer_norm_epsilon": 1e-05,
  "tie_word_embeddings": true
}"#;

fn header(device_budget_bytes: u64) -> HeaderInputs {
    HeaderInputs {
        model: "gpt2-4x256".into(),
        hardware: "host".into(),
        device_budget_bytes,
        host_budget_bytes: u64::MAX,
        report: String::new(),
        flash_attention: true,
    }
}

/// The training graph (forward, backward, AdamW with PyTorch's defaults).
fn training() -> Graph {
    let config = ModelConfig::from_json(CONFIG, ConfigSource::Text("host_step config".into()))
        .expect("the benchmark's config parses");
    let forward = protrain_models::build_forward(
        &config,
        &BuildOptions::new(BATCH, SEQ).with_dtype(DType::F32),
    )
    .expect("the benchmark's model builds");
    training_graph(&forward, &OptimizerConfig::default()).expect("autodiff succeeds")
}

/// One batch from the synthetic corpus: tokens and targets (shifted by one), `[B, T]`.
fn batch(vocab: usize) -> [Vec<i32>; 2] {
    let n = (BATCH * SEQ) as usize;
    let stream: Vec<i32> = SyntheticCorpus::new(vocab, SEED)
        .expect("the vocabulary is large enough")
        .tokens(n + 1)
        .into_iter()
        .map(|t| t as i32)
        .collect();
    [stream[..n].to_vec(), stream[1..].to_vec()]
}

/// An executor for `schedule` with the seeded initial parameters loaded.
fn executor<'s>(schedule: &'s VerifiedSchedule, init: &[Vec<f32>], graph: &Graph) -> Executor<'s> {
    // Parameters in the placed graph's order, matched by name.
    let by_name: std::collections::HashMap<&str, &Vec<f32>> = graph
        .params()
        .map(|(_, p)| p.name.as_str())
        .zip(init)
        .collect();
    let placed: Vec<Vec<f32>> = schedule
        .graph
        .params()
        .map(|(_, p)| by_name[p.name.as_str()].clone())
        .collect();
    let mut exec = Executor::new(schedule).expect("the schedule verifies");
    exec.load_params(&placed).expect("the parameters fit");
    exec
}

/// The threads the kernels use: rayon's global pool follows `RAYON_NUM_THREADS`, else takes
/// every core.
fn threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|n| n.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Runs one traced step and prints where the compute stream's time went, by op kind: the
/// breakdown that says which kernel to look at first.
fn print_breakdown(exec: &mut Executor<'_>, schedule: &Schedule, inputs: &[&[i32]]) {
    exec.set_tracing(true);
    exec.step(inputs).expect("the step runs");
    let mut by_kind: std::collections::BTreeMap<&str, (f64, usize)> = Default::default();
    let mut total = 0.0;
    for span in exec.timeline() {
        let instr = &schedule.streams[span.stream.index()].instrs[span.index as usize];
        let kind = match instr {
            Instr::Kernel { op, .. } => schedule.graph.op(*op).kind.mnemonic(),
            Instr::Copy { .. } => "copy",
            _ => continue,
        };
        let entry = by_kind.entry(kind).or_default();
        entry.0 += span.end - span.start;
        entry.1 += 1;
        total += span.end - span.start;
    }
    exec.set_tracing(false);
    let mut rows: Vec<_> = by_kind.into_iter().collect();
    rows.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
    eprintln!(
        "host_step: one resident step, {:.3} s wall, {total:.3} s in kernels and copies:",
        exec.timing().wall_seconds
    );
    for (kind, (seconds, count)) in rows {
        eprintln!(
            "  {kind:<28} {seconds:7.3} s  {:5.1}%  x{count}",
            100.0 * seconds / total
        );
    }
}

fn host_step(c: &mut Criterion) {
    let graph = training();
    let chunks = chunked(&graph);
    let layers = graph
        .blocks()
        .filter(|(_, b)| matches!(b.kind, BlockKind::Layer(_)))
        .count();
    let init = init_params(&graph, SEED);
    let [x, y] = batch(8192);
    let tokens = BATCH * SEQ;

    let resident = compile_policy(
        &graph,
        &chunks,
        &Policy::resident(chunks.len() as u32, layers),
        header(u64::MAX),
    )
    .expect("the resident policy compiles");
    let resident = verify(resident).expect("the resident schedule verifies");
    // No chunk persistent, two chunk buffers, two blocks swapped and two checkpointed.
    let offload_policy = Policy::protrain(0, 2, 2, 2, layers);
    let offload = compile_policy(&graph, &chunks, &offload_policy, header(u64::MAX))
        .expect("the offloading policy compiles");
    let offload = verify(offload).expect("the offloading schedule verifies");
    eprintln!(
        "host_step: {} parameters, {} chunks, {} threads; device arena {:.1} MiB resident, \
         {:.1} MiB under [{offload_policy}] (host region {:.1} MiB)",
        graph.param_count(),
        chunks.len(),
        threads(),
        resident.arena_bytes as f64 / (1 << 20) as f64,
        offload.arena_bytes as f64 / (1 << 20) as f64,
        offload.host_bytes as f64 / (1 << 20) as f64,
    );

    print_breakdown(
        &mut executor(&resident, &init, &graph),
        &resident,
        &[&x, &y],
    );

    let mut group = c.benchmark_group("host_step");
    group
        .throughput(Throughput::Elements(tokens))
        // A step takes about a second: ten samples of one or a few steps each, not criterion's
        // default ramp of 1, 2, ..., 10 steps (55 steps per benchmark).
        .sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(15));

    let mut interp = Interpreter::new(&graph);
    for ((id, _), values) in graph.params().zip(&init) {
        interp.set_param(id, values).expect("the parameters fit");
    }
    group.bench_function("interpreter", |b| {
        b.iter(|| black_box(interp.step(&[&x, &y]).expect("the step runs")))
    });
    drop(interp);

    for (name, schedule) in [("resident", &resident), ("offload", &offload)] {
        let mut exec = executor(schedule, &init, &graph);
        group.bench_function(BenchmarkId::new("executor", name), |b| {
            b.iter(|| black_box(exec.step(&[&x, &y]).expect("the step runs")))
        });
    }
    group.finish();
}

criterion_group!(benches, host_step);
criterion_main!(benches);
