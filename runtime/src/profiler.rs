//! The profiler: measures a backend's op times, copy bandwidths and Adam rates as a `HardwareProfile`.
//!
//! It runs the real kernels through a [`Backend`], so what it measures is what the executor
//! will see: every distinct op of a training graph (by [`op_key`]) is launched a few times on
//! operands of its exact shapes and the median kept; copies are timed through
//! [`Backend::copy`] each way on large buffers; Adam through the AdamW kernel over a few
//! million parameters. Capacities (memory sizes) are not measured: they come from the base
//! profile the caller passes (`HardwareProfile::host()` for the host backend).
//!
//! It does not depend on the compiler: the caller builds the training graph, and the profile
//! it returns is what `--hardware FILE` reads.

use crate::backend::{Address, Backend, Launch};
use crate::dispatch::Prepared;
use crate::error::{Result, RuntimeError};
use crate::host::HostBackend;
use crate::kernels;
use protrain_ir::{
    op_key, DType, Graph, HardwareProfile, MeasuredOp, Op, OpKind, Space, StreamKind, TensorType,
};
use std::collections::BTreeMap;
use std::time::Instant;

/// Operands are placed at multiples of this many bytes, as the planner aligns buffers.
const ALIGN: u64 = 256;

/// The matmul efficiency the compiler's roofline assumes (`Efficiency::default().matmul`):
/// the measured matmul rate divided by it is written as the peak, so a roofline over the
/// profile predicts the measured rate for ops the table lacks.
const ROOFLINE_MATMUL_EFFICIENCY: f64 = 0.7;

/// What to measure and how hard.
#[derive(Clone, Debug, PartialEq)]
pub struct ProfileOptions {
    /// Timed runs of each op (after one untimed warm-up run); the median is kept.
    pub repeats: usize,
    /// Bytes of each timed copy; large, so per-copy overhead does not dominate.
    pub copy_bytes: u64,
    /// Timed copies in each direction (median kept).
    pub copy_repeats: usize,
    /// Parameters of the timed Adam step.
    pub adam_params: usize,
    /// The profile's name.
    pub name: String,
}

impl Default for ProfileOptions {
    /// 5 runs per op, 64 MiB copies 5 times each way, Adam over 4 Mi parameters, named `host`.
    fn default() -> Self {
        Self {
            repeats: 5,
            copy_bytes: 64 << 20,
            copy_repeats: 5,
            adam_params: 4 << 20,
            name: "host".to_string(),
        }
    }
}

/// One op of the table and how many ops of the graph share its key.
#[derive(Clone, Debug, PartialEq)]
pub struct OpTiming {
    /// The key and its median time.
    pub op: MeasuredOp,
    /// Ops of the graph with this key.
    pub count: usize,
}

/// Everything one profiling run measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Profiled {
    /// The profile: the base profile's capacities with every measured figure filled in.
    pub profile: HardwareProfile,
    /// The op table with the number of graph ops behind each key, by key.
    pub ops: Vec<OpTiming>,
    /// Sum over the graph's ops of their measured times: one serial step, in seconds.
    pub graph_seconds: f64,
    /// Seconds the profiling took.
    pub elapsed_seconds: f64,
}

/// Profiles the host backend for `graph` (a training graph), starting from
/// [`HardwareProfile::host`] for the capacities.
pub fn profile_host(graph: &Graph, options: &ProfileOptions) -> Result<Profiled> {
    profile::<HostBackend>(graph, HardwareProfile::host(), options)
}

/// Profiles backend `B` for `graph`: the op table of its ops, copy bandwidth each way, the
/// Adam rate, host `memcpy` bandwidth, the launch overhead (median of a 256-byte copy), and
/// peak f32 FLOP/s and device bandwidth derived from the largest matmul and from `memcpy`.
/// Memory sizes and the reservation are kept from `base`; the same Adam rate is written for
/// the CPU and the "GPU" optimizer, which on the host backend run the same kernel.
///
/// Fails when the graph has no ops, an op's operands cannot be allocated, or a kernel fails.
pub fn profile<B: Backend>(
    graph: &Graph,
    base: HardwareProfile,
    options: &ProfileOptions,
) -> Result<Profiled> {
    let started = Instant::now();
    if graph.op_count() == 0 {
        return Err(RuntimeError::Profile(
            "the graph has no ops to measure; pass a training graph".into(),
        ));
    }
    if options.repeats == 0 || options.copy_repeats == 0 {
        return Err(RuntimeError::Profile(
            "repeats must be at least 1 to measure anything".into(),
        ));
    }
    let ops = measure_ops::<B>(graph, options.repeats)?;
    let graph_seconds = ops
        .iter()
        .map(|t| t.op.seconds * t.count as f64)
        .sum::<f64>();
    let (h2d, d2h, launch) = measure_copies::<B>(options.copy_bytes, options.copy_repeats)?;
    let memcpy = measure_memcpy(options.copy_bytes, options.copy_repeats);
    let adam = measure_adam(options.adam_params.max(1), options.repeats);
    let mut profile = base;
    profile.name = options.name.clone();
    if let Some(flops) = matmul_flops(graph, &ops) {
        let peak = flops / ROOFLINE_MATMUL_EFFICIENCY;
        profile.peak_flops.f32 = peak;
        profile.peak_flops.bf16 = peak;
        profile.peak_flops.f16 = peak;
    }
    // `memcpy` reads and writes every byte it copies.
    profile.device_bandwidth = 2.0 * memcpy;
    profile.h2d_bandwidth = h2d;
    profile.d2h_bandwidth = d2h;
    profile.host_memcpy_bandwidth = memcpy;
    profile.launch_overhead_s = launch;
    profile.cpu_adam_params_per_s = adam;
    profile.gpu_adam_params_per_s = adam;
    profile.measured_ops = ops.iter().map(|t| t.op.clone()).collect();
    profile.description = format!(
        "measured by `protrain profile` on {} threads: {} op timings, copies {:.1}/{:.1} GB/s \
         H2D/D2H, Adam {:.0} M params/s",
        rayon::current_num_threads(),
        profile.measured_ops.len(),
        h2d / 1e9,
        d2h / 1e9,
        adam / 1e6
    );
    profile
        .validate()
        .map_err(|e| RuntimeError::Profile(format!("the measured profile is not usable: {e}")))?;
    Ok(Profiled {
        profile,
        ops,
        graph_seconds,
        elapsed_seconds: started.elapsed().as_secs_f64(),
    })
}

/// The median time of each distinct [`op_key`] of `graph`, by key: each is launched on
/// backend `B` once untimed and `repeats` times timed, on operands of its exact types filled
/// with small positive values (token ids spread over the vocabulary the op indexes).
pub fn measure_ops<B: Backend>(graph: &Graph, repeats: usize) -> Result<Vec<OpTiming>> {
    let mut distinct: BTreeMap<String, (&Op, usize)> = BTreeMap::new();
    for (_, op) in graph.ops() {
        let types: Vec<&TensorType> = op.inputs.iter().map(|&v| &graph.value(v).ty).collect();
        distinct
            .entry(op_key(&op.kind, &types))
            .and_modify(|(_, n)| *n += 1)
            .or_insert((op, 1));
    }
    let largest = distinct
        .values()
        .map(|(op, _)| Operands::layout(graph, op).1)
        .max()
        .unwrap_or(0);
    let mut backend = B::new(largest, 0, 0)?;
    let mut stream = backend.create_stream(StreamKind::Compute)?;
    let mut out = Vec::with_capacity(distinct.len());
    for (key, (op, count)) in distinct {
        let operands = Operands::layout(graph, op).0;
        operands.fill(&mut backend, graph, op)?;
        let prepared = Prepared::new(&op.kind);
        let mut times = Vec::with_capacity(repeats);
        for run in 0..=repeats {
            let launch = Launch {
                graph,
                op,
                prepared: &prepared,
                inputs: &operands.inputs,
                outputs: &operands.outputs,
                workspace: operands.workspace,
                step: run as u64 + 1,
            };
            let began = Instant::now();
            // SAFETY: one stream, one thread: nothing else touches the arena, and the
            // operands were laid out apart from each other.
            unsafe { backend.launch(&mut stream, &launch)? };
            backend.synchronize(&mut stream)?;
            if run > 0 {
                times.push(began.elapsed().as_secs_f64());
            }
        }
        out.push(OpTiming {
            op: MeasuredOp {
                key,
                seconds: median(&mut times),
            },
            count,
        });
    }
    Ok(out)
}

/// Median seconds of host-to-device and device-to-host copies of `bytes` through backend
/// `B`, as bandwidths (bytes per second), and the median time of a 256-byte copy (the fixed
/// cost of issuing one).
pub fn measure_copies<B: Backend>(bytes: u64, repeats: usize) -> Result<(f64, f64, f64)> {
    let bytes = bytes.max(ALIGN);
    let mut backend = B::new(bytes, bytes, 0)?;
    let mut stream = backend.create_stream(StreamKind::HostToDevice)?;
    let device = Address {
        space: Space::Device,
        offset: 0,
    };
    let host = Address {
        space: Space::Host,
        offset: 0,
    };
    // Touch every page first, so the timed copies do not pay for first-touch faults.
    backend.fill_zero(device, bytes)?;
    backend.fill_zero(host, bytes)?;
    let mut time = |src: Address, dst: Address, n: u64| -> Result<f64> {
        let mut times = Vec::with_capacity(repeats);
        for run in 0..=repeats {
            let began = Instant::now();
            // SAFETY: one stream, one thread; source and destination are distinct regions.
            unsafe { backend.copy(&mut stream, src, dst, n)? };
            backend.synchronize(&mut stream)?;
            if run > 0 {
                times.push(began.elapsed().as_secs_f64());
            }
        }
        Ok(median(&mut times))
    };
    let h2d = bytes as f64 / time(host, device, bytes)?;
    let d2h = bytes as f64 / time(device, host, bytes)?;
    let launch = time(host, device, ALIGN)?;
    Ok((h2d, d2h, launch))
}

/// Host `memcpy` bandwidth: bytes copied per second between two buffers of `bytes`, median
/// of `repeats` copies.
pub fn measure_memcpy(bytes: u64, repeats: usize) -> f64 {
    let n = (bytes as usize).max(4096);
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    let mut times = Vec::with_capacity(repeats);
    for run in 0..=repeats.max(1) {
        let began = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        if run > 0 {
            times.push(began.elapsed().as_secs_f64());
        }
    }
    n as f64 / median(&mut times)
}

/// Parameters per second one [`kernels::adamw_step`] updates over `params` parameters,
/// median of `repeats` steps.
pub fn measure_adam(params: usize, repeats: usize) -> f64 {
    let mut p = vec![0.1f32; params];
    let g = vec![0.01f32; params];
    let mut m = vec![0.0f32; params];
    let mut v = vec![0.0f32; params];
    let config = kernels::AdamWConfig::default();
    let mut times = Vec::with_capacity(repeats);
    for step in 1..=repeats.max(1) as u64 + 1 {
        let began = Instant::now();
        kernels::adamw_step(&mut p, &g, &mut m, &mut v, step, &config);
        if step > 1 {
            times.push(began.elapsed().as_secs_f64());
        }
    }
    params as f64 / median(&mut times)
}

/// The achieved FLOP/s of the graph's costliest matmul, from its measured time.
fn matmul_flops(graph: &Graph, ops: &[OpTiming]) -> Option<f64> {
    let seconds: BTreeMap<&str, f64> = ops
        .iter()
        .map(|t| (t.op.key.as_str(), t.op.seconds))
        .collect();
    graph
        .ops()
        .filter(|(_, op)| matches!(op.kind, OpKind::Linear { .. }))
        .filter_map(|(_, op)| {
            let types: Vec<&TensorType> = op.inputs.iter().map(|&v| &graph.value(v).ty).collect();
            let outputs: Vec<&TensorType> =
                op.outputs.iter().map(|&v| &graph.value(v).ty).collect();
            let flops = op.kind.flops(&types, &outputs) as f64;
            let time = *seconds.get(op_key(&op.kind, &types).as_str())?;
            (time > 0.0).then_some((flops, flops / time))
        })
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, rate)| rate)
}

/// The median of some times (0 for none).
fn median(times: &mut [f64]) -> f64 {
    if times.is_empty() {
        return 0.0;
    }
    times.sort_by(f64::total_cmp);
    let mid = times.len() / 2;
    if times.len() % 2 == 1 {
        times[mid]
    } else {
        (times[mid - 1] + times[mid]) / 2.0
    }
}

/// Where one op's operands lie in a profiling arena: inputs, outputs, workspace, in order,
/// each at an aligned offset of its own.
struct Operands {
    inputs: Vec<Address>,
    outputs: Vec<Address>,
    workspace: Option<(Address, u64)>,
}

impl Operands {
    /// The layout and the arena bytes it needs.
    fn layout(graph: &Graph, op: &Op) -> (Self, u64) {
        let mut end = 0u64;
        let mut place = |bytes: u64| {
            let at = Address {
                space: Space::Device,
                offset: end,
            };
            end += bytes.max(1).next_multiple_of(ALIGN);
            at
        };
        let inputs = op
            .inputs
            .iter()
            .map(|&v| place(graph.value(v).ty.bytes()))
            .collect();
        let outputs = op
            .outputs
            .iter()
            .map(|&v| place(graph.value(v).ty.bytes()))
            .collect();
        let types: Vec<&TensorType> = op.inputs.iter().map(|&v| &graph.value(v).ty).collect();
        let workspace = match op.kind.workspace_bytes(&types) {
            0 => None,
            bytes => Some((place(bytes), bytes)),
        };
        (
            Self {
                inputs,
                outputs,
                workspace,
            },
            end,
        )
    }

    /// Writes every input: small positive floats, or token ids below the vocabulary the op
    /// indexes with them.
    fn fill<B: Backend>(&self, backend: &mut B, graph: &Graph, op: &Op) -> Result<()> {
        for (i, (&v, &at)) in op.inputs.iter().zip(&self.inputs).enumerate() {
            let ty = &graph.value(v).ty;
            let n = ty.numel() as usize;
            if ty.dtype == DType::I32 {
                let vocab = token_bound(graph, op, i).max(1);
                let ids: Vec<i32> = (0..n).map(|k| ((k as u64 * 7919) % vocab) as i32).collect();
                backend.write_i32(at, &ids)?;
            } else {
                // In [0.01, 0.51): no zeros, no denormals, square roots of moments defined.
                let values: Vec<f32> = (0..n)
                    .map(|k| 0.01 + ((k as u64 * 2_654_435_761) % 1000) as f32 / 2000.0)
                    .collect();
                backend.write_f32(at, &values)?;
            }
        }
        Ok(())
    }
}

/// The vocabulary the `i`-th (integer) input of `op` indexes: the embedding table's rows, the
/// logits' width; 1 where the ids are not used as indices.
fn token_bound(graph: &Graph, op: &Op, i: usize) -> u64 {
    let ty = |k: usize| &graph.value(op.inputs[k]).ty;
    match op.kind {
        OpKind::Embedding { .. } if i == 0 => ty(1).shape[0],
        OpKind::EmbeddingBackward { rows, .. } if i == 0 => rows,
        OpKind::CrossEntropy | OpKind::CrossEntropyBackward if i == 1 => ty(0).last_dim(),
        _ => 1,
    }
}
