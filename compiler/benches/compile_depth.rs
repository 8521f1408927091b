//! Compile time against depth: a GPT-2 with tiny dimensions (64 wide, 2 heads, 256 tokens,
//! 64 positions) at 64 to 1,024 layers, compiled end to end on the host preset under a device
//! budget that forces swapping (5/8 MiB per layer, a quarter of what keeping every
//! activation takes). Cost should grow near-linearly with depth: compare the per-layer times
//! the groups print.
//!
//! `compile` is the whole pipeline (fuse, autodiff, chunk, search with its compiled
//! candidates, verify, simulate); `search` is the policy search alone on a prepared training
//! graph, and `one_policy` compiles the policy the search picks, once: the work the search
//! repeats per candidate. `compile_llama` is the same compile of a LLaMA of the same size
//! (4 heads over 2 KV heads, intermediate 176), where the memory planner's best fit by
//! size x lifetime still runs at every depth and so dominates the growth.
//!
//!   cargo bench -p protrain-compiler --bench compile_depth [-- FILTER]
//!
//! This bench links the compiler with the system allocator; the release binary users run
//! uses mimalloc, so time it too (`benches/README.md` gives the command). Measured figures
//! are in `benches/RESULTS.md`.

use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, Throughput,
};
use protrain_compiler::cost::cost_model;
use protrain_compiler::emit::HeaderInputs;
use protrain_compiler::pipeline::{
    chunked, compile, compile_policy, training_graph, CompileOptions,
};
use protrain_compiler::search::{search, SearchOptions};
use protrain_compiler::OptimizerConfig;
use protrain_ir::{ChunkTable, Graph};
use protrain_models::{build_forward, BuildOptions, ConfigSource, ModelConfig};
use std::time::Duration;

const DEPTHS: [u64; 5] = [64, 128, 256, 512, 1024];

/// The tiny GPT-2 at `layers` layers.
fn config(layers: u64) -> ModelConfig {
    let json = format!(
        r#"{{"model_type": "gpt2", "n_embd": 64, "n_head": 2, "n_layer": {layers},
            "n_positions": 64, "vocab_size": 256, "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5, "tie_word_embeddings": true}}"#
    );
    ModelConfig::from_json(&json, ConfigSource::Text(format!("gpt2-{layers}-layers")))
        .expect("a valid config")
}

/// A LLaMA of the same size at `layers` layers: hidden 64, 4 heads over 2 KV heads,
/// intermediate 176, vocabulary 256. Under the same budget its planner still runs best fit by
/// size x lifetime (the better of the other two orders ends outside the lower bound's granule
/// and `plan::OPTIMALITY_GAP`), whose cost grows faster than depth: the `compile_llama` group
/// measures it.
fn llama_config(layers: u64) -> ModelConfig {
    let json = format!(
        r#"{{"model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": {layers},
            "vocab_size": 256, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": false}}"#
    );
    ModelConfig::from_json(&json, ConfigSource::Text(format!("llama-{layers}-layers")))
        .expect("a valid config")
}

/// Host preset defaults with a budget of 5/8 MiB per layer.
fn options(layers: u64) -> CompileOptions {
    CompileOptions {
        device_budget: Some(layers * (640 << 10)),
        ..CompileOptions::default()
    }
}

/// The training graph and chunk table the search starts from.
fn prepared(layers: u64) -> (Graph, ChunkTable) {
    let options = options(layers);
    let build = BuildOptions::new(options.batch, options.seq).with_dtype(options.dtype);
    let forward = build_forward(&config(layers), &build).expect("builds");
    let training = training_graph(&forward, &OptimizerConfig::default()).expect("autodiff");
    let chunks = chunked(&training);
    (training, chunks)
}

fn search_options(layers: u64) -> SearchOptions {
    let options = options(layers);
    SearchOptions {
        device_budget: options.device_budget(),
        disk_budget: 0,
        host_budget: options.hardware.host_memory_bytes,
        max_compiled: 64,
        hardware: options.hardware.summary(),
        model: format!("gpt2-{layers}-layers"),
        topology: options.topology,
    }
}

/// A group of ten samples, each as long as it takes (a deep compile is seconds).
fn new_group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut group = c.benchmark_group(name);
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_secs(5));
    group
}

/// The whole compile of `config`'s model at every depth.
fn compile_group(c: &mut Criterion, name: &str, config: fn(u64) -> ModelConfig) {
    let mut group = new_group(c, name);
    for layers in DEPTHS {
        group.throughput(Throughput::Elements(layers));
        let config = config(layers);
        let options = options(layers);
        group.bench_with_input(BenchmarkId::from_parameter(layers), &layers, |b, _| {
            b.iter(|| compile(&config, &options).expect("compiles"))
        });
    }
    group.finish();
}

fn depth(c: &mut Criterion) {
    compile_group(c, "compile", config);
    compile_group(c, "compile_llama", llama_config);

    let mut group = new_group(c, "search");
    let cost = cost_model(&options(1).hardware);
    for layers in DEPTHS {
        group.throughput(Throughput::Elements(layers));
        let (training, chunks) = prepared(layers);
        let search_options = search_options(layers);
        group.bench_with_input(BenchmarkId::from_parameter(layers), &layers, |b, _| {
            b.iter(|| search(&training, &chunks, cost.as_ref(), &search_options).expect("fits"))
        });
    }
    group.finish();

    let mut group = new_group(c, "one_policy");
    for layers in DEPTHS {
        group.throughput(Throughput::Elements(layers));
        let (training, chunks) = prepared(layers);
        let (schedule, _) =
            search(&training, &chunks, cost.as_ref(), &search_options(layers)).expect("fits");
        let policy = schedule.header.policy.clone();
        group.bench_with_input(BenchmarkId::from_parameter(layers), &layers, |b, _| {
            b.iter(|| {
                let header = HeaderInputs {
                    model: String::new(),
                    hardware: String::new(),
                    device_budget_bytes: u64::MAX,
                    host_budget_bytes: u64::MAX,
                    report: String::new(),
                    flash_attention: true,
                };
                compile_policy(&training, &chunks, &policy, header).expect("compiles")
            })
        });
    }
    group.finish();
}

criterion_group!(benches, depth);
criterion_main!(benches);
