//! The profiler: measures a backend's op times, copy bandwidths and Adam rate as a profile.

use crate::backend::{Address, Backend, Launch};
use crate::dispatch::Prepared;
use crate::error::{Result, RuntimeError};
use crate::host::HostBackend;
use crate::kernels;
use crate::params::init_params;
use protrain_ir::{
    op_key, DType, Graph, HardwareProfile, MeasuredOp, Op, OpKind, Space, StreamKind, TensorType,
};
use std::collections::BTreeMap;
use std::time::Instant;

mod adam_share;
pub use adam_share::{measure_adam_shares, MeasuredShares, MIN_SHARE};

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
    /// Parameters of the timed Adam step: by default enough that its state does not fit the
    /// last-level cache ([`adam_params_beyond_cache`]).
    pub adam_params: usize,
    /// Largest graph, in bytes of all its values, whose ops are timed in place (the whole
    /// graph run step after step, as the executor runs it, so each op meets its operands
    /// where the previous ops left them in the caches); a larger graph's ops are timed one
    /// by one on operands of their own, which the repeats keep hot in the caches.
    pub in_place_limit: u64,
    /// The profile's name.
    pub name: String,
}

impl Default for ProfileOptions {
    /// 5 runs per op, 64 MiB copies 5 times each way, Adam over state twice this machine's
    /// last-level cache ([`adam_params_beyond_cache`]), graphs up to 4 GiB timed in place,
    /// named `host`.
    fn default() -> Self {
        Self {
            repeats: 5,
            copy_bytes: 64 << 20,
            copy_repeats: 5,
            adam_params: adam_params_beyond_cache(last_level_cache_bytes()),
            in_place_limit: 4 << 30,
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

/// Profiles backend `B` for `graph` (a training graph; the runtime does not depend on the
/// compiler, so the caller builds it) and returns a `HardwareProfile` that `--hardware FILE`
/// reads. Everything runs through the backend's real kernels and copies, so it measures what
/// the executor will see.
///
/// Measured: the op table of the graph's ops (timed in place when the graph
/// fits [`ProfileOptions::in_place_limit`], else one by one), copy bandwidth each way, the
/// Adam rate, its cost per op ([`measure_adam_op_seconds`]) and, for a graph timed in place,
/// the shares of it kept beside the backward kernels, the copies and both
/// ([`measure_adam_shares`]), host
/// `memcpy` bandwidth, the launch overhead (median of a 256-byte copy), and peak f32 FLOP/s
/// and device bandwidth derived from the largest matmul and from `memcpy`.
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
    let ops = measure_op_table::<B>(graph, options)?;
    let in_place = graph_bytes(graph) <= options.in_place_limit;
    let graph_seconds = ops
        .iter()
        .map(|t| t.op.seconds * t.count as f64)
        .sum::<f64>();
    let (h2d, d2h, launch) = measure_copies::<B>(options.copy_bytes, options.copy_repeats)?;
    let memcpy = measure_memcpy(options.copy_bytes, options.copy_repeats);
    let adam = measure_adam(options.adam_params.max(1), options.repeats);
    // The per-op cost through this backend's own path for a run of AdamW ops.
    let backend = B::new(REGION_ALIGN_BYTES, 0, 0)?;
    let adam_op = measure_adam_op_seconds(
        &adam_sizes(graph),
        options.adam_params.max(1),
        options.repeats,
        &|steps, ended| backend.run_host_adamw(steps, ended),
    );
    // Beside the backward kernels, which need the graph in place, and the copies; over the
    // graph's own parameters (one step's updates), at most the Adam step's.
    let sizes = adam_sizes(graph);
    let shares = match in_place {
        true => measure_adam_shares::<B>(
            graph,
            &sizes,
            sizes
                .iter()
                .sum::<usize>()
                .clamp(1, options.adam_params.max(1)),
            options.copy_bytes,
            options.repeats,
            &|steps, ended| backend.run_host_adamw(steps, ended),
        )?,
        false => MeasuredShares::default(),
    };
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
    profile.cpu_adam_op_s = adam_op;
    profile.cpu_adam_compute_share = shares.compute;
    profile.cpu_adam_copy_share = shares.copy;
    profile.cpu_adam_compute_copy_share = shares.compute_and_copy;
    profile.gpu_adam_params_per_s = adam;
    profile.measured_ops = ops.iter().map(|t| t.op.clone()).collect();
    profile.description = format!(
        "measured by `protrain profile` on {} threads: {} op timings, copies {:.1}/{:.1} GB/s \
         H2D/D2H, Adam {:.0} M params/s{}",
        rayon::current_num_threads(),
        profile.measured_ops.len(),
        h2d / 1e9,
        d2h / 1e9,
        adam / 1e6,
        [
            ("compute", shares.compute),
            ("copies", shares.copy),
            ("both", shares.compute_and_copy)
        ]
        .iter()
        .filter_map(
            |(what, share)| share.map(|s| format!(", {:.0}% of it beside {what}", s * 100.0))
        )
        .collect::<String>()
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

/// The op table alone of a host profile of `graph` ([`profile_host`] measures it first): what
/// a second graph adds to a profile, as the unfused training graph beside the fused one, with
/// none of the rates measured again.
pub fn measure_host_ops(graph: &Graph, options: &ProfileOptions) -> Result<Vec<MeasuredOp>> {
    let ops = measure_op_table::<HostBackend>(graph, options)?;
    Ok(ops.into_iter().map(|t| t.op).collect())
}

/// The op table of [`profile`]: `graph`'s ops timed in place when it fits
/// [`ProfileOptions::in_place_limit`], else one by one. Fails on a graph without ops or no
/// repeats ([`check_inputs`]).
fn measure_op_table<B: Backend>(graph: &Graph, options: &ProfileOptions) -> Result<Vec<OpTiming>> {
    check_inputs(graph, options)?;
    if graph_bytes(graph) <= options.in_place_limit {
        measure_ops_in_place::<B>(graph, options.repeats)
    } else {
        measure_ops::<B>(graph, options.repeats)
    }
}

/// The median time of each distinct [`op_key`] of `graph`, by key, timed in place: every
/// value of the graph gets its own bytes in one arena of backend `B` (no reuse), parameters
/// their initial values ([`init_params`]) and inputs token ids below the vocabulary, then the
/// whole graph runs once untimed and `repeats` times timed, op after op in graph order, as
/// the executor runs a resident schedule, so the caches are as warm or cold as a real step
/// leaves them. A key's time is the median over the runs of the mean over its ops in that
/// run: the mean, because a step's total includes each op's occasional slow launch; the
/// median over runs, so that one disturbed run does not count.
pub fn measure_ops_in_place<B: Backend>(graph: &Graph, repeats: usize) -> Result<Vec<OpTiming>> {
    let mut keys: Vec<(String, usize)> = Vec::new();
    let mut index: BTreeMap<String, usize> = BTreeMap::new();
    let key_of: Vec<usize> = graph
        .ops()
        .map(|(_, op)| {
            let types: Vec<&TensorType> = op.inputs.iter().map(|&v| &graph.value(v).ty).collect();
            let name = op_key(&op.kind, &types);
            let key = *index.entry(name.clone()).or_insert_with(|| {
                keys.push((name, 0));
                keys.len() - 1
            });
            keys[key].1 += 1;
            key
        })
        .collect();
    let mut in_place = InPlaceGraph::<B>::new(graph)?;
    // Per key: the mean over its ops of each run, so that an op's occasional slow run counts
    // as it does in a step's total; then the median over the runs.
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); keys.len()];
    let mut this_run = vec![0.0f64; keys.len()];
    for run in 0..=repeats {
        this_run.fill(0.0);
        for (op, &key) in key_of.iter().enumerate() {
            let began = Instant::now();
            in_place.run(op, run as u64 + 1)?;
            this_run[key] += began.elapsed().as_secs_f64();
        }
        if run > 0 {
            for ((t, &sum), &(_, count)) in times.iter_mut().zip(&this_run).zip(&keys) {
                t.push(sum / count as f64);
            }
        }
    }
    let mut out: Vec<OpTiming> = keys
        .into_iter()
        .zip(times)
        .map(|((key, count), mut t)| OpTiming {
            op: MeasuredOp {
                key,
                seconds: median(&mut t),
            },
            count,
        })
        .collect();
    out.sort_by(|a, b| a.op.key.cmp(&b.op.key));
    Ok(out)
}

/// A graph laid out to run in place on backend `B`: every value with bytes of its own in one
/// arena (no reuse), parameters at their initial values ([`init_params`]), inputs token ids
/// below the vocabulary, one workspace as large as the largest op's, and one compute stream.
pub(crate) struct InPlaceGraph<'g, B: Backend> {
    graph: &'g Graph,
    backend: B,
    stream: B::Stream,
    ops: Vec<InPlace<'g>>,
}

impl<'g, B: Backend> InPlaceGraph<'g, B> {
    /// Lays out and fills `graph`'s values ([`graph_bytes`] of arena).
    pub(crate) fn new(graph: &'g Graph) -> Result<Self> {
        let mut end = 0u64;
        let homes: Vec<Address> = graph
            .values()
            .map(|(_, v)| {
                let at = Address {
                    space: Space::Device,
                    offset: end,
                };
                end += v.ty.bytes().max(1).next_multiple_of(ALIGN);
                at
            })
            .collect();
        let workspace_bytes = graph
            .ops()
            .map(|(_, op)| {
                let types: Vec<&TensorType> =
                    op.inputs.iter().map(|&v| &graph.value(v).ty).collect();
                op.kind.workspace_bytes(&types)
            })
            .max()
            .unwrap_or(0);
        let workspace_at = Address {
            space: Space::Device,
            offset: end,
        };
        let mut backend = B::new(end + workspace_bytes, 0, 0)?;
        for ((_, p), values) in graph.params().zip(init_params(graph, 0)) {
            backend.write_f32(homes[p.value.index()], &values)?;
        }
        for &input in graph.inputs() {
            let n = graph.value(input).ty.numel() as usize;
            let vocab = graph
                .users(input)
                .iter()
                .map(|&o| {
                    let op = graph.op(o);
                    let i = op.inputs.iter().position(|&v| v == input).unwrap_or(0);
                    token_bound(graph, op, i)
                })
                .filter(|&b| b > 1)
                .min()
                .unwrap_or(1);
            backend.write_i32(homes[input.index()], &token_ids(n, vocab))?;
        }
        let stream = backend.create_stream(StreamKind::Compute)?;
        let ops = graph
            .ops()
            .map(|(_, op)| {
                let types: Vec<&TensorType> =
                    op.inputs.iter().map(|&v| &graph.value(v).ty).collect();
                let workspace = match op.kind.workspace_bytes(&types) {
                    0 => None,
                    bytes => Some((workspace_at, bytes)),
                };
                InPlace {
                    op,
                    inputs: op.inputs.iter().map(|v| homes[v.index()]).collect(),
                    outputs: op.outputs.iter().map(|v| homes[v.index()]).collect(),
                    workspace,
                    prepared: Prepared::new(&op.kind),
                }
            })
            .collect();
        Ok(Self {
            graph,
            backend,
            stream,
            ops,
        })
    }

    /// Runs the graph's `op`-th op (in the order of [`Graph::ops`]) as step `step` and waits
    /// for it.
    pub(crate) fn run(&mut self, op: usize, step: u64) -> Result<()> {
        let p = &self.ops[op];
        let launch = Launch {
            graph: self.graph,
            op: p.op,
            prepared: &p.prepared,
            inputs: &p.inputs,
            outputs: &p.outputs,
            workspace: p.workspace,
            step,
            shard: None,
            pitches: crate::dispatch::Pitches::DENSE,
        };
        // SAFETY: one stream on one thread, one op at a time; every value has bytes of its
        // own, so no output overlaps an input (AdamW's in-place operands are distinct values)
        // and the one workspace serves one op at a time.
        unsafe { self.backend.launch(&mut self.stream, &launch)? };
        self.backend.synchronize(&mut self.stream)
    }
}

/// An op of the graph ready to launch in place.
struct InPlace<'g> {
    op: &'g Op,
    inputs: Vec<Address>,
    outputs: Vec<Address>,
    workspace: Option<(Address, u64)>,
    prepared: Prepared,
}

/// Bytes of every value of `graph`, each aligned as [`measure_ops_in_place`] lays them out.
pub fn graph_bytes(graph: &Graph) -> u64 {
    graph
        .values()
        .map(|(_, v)| v.ty.bytes().max(1).next_multiple_of(ALIGN))
        .sum()
}

/// `n` token ids spread over `0..vocab`.
fn token_ids(n: usize, vocab: u64) -> Vec<i32> {
    (0..n)
        .map(|k| ((k as u64 * 7919) % vocab.max(1)) as i32)
        .collect()
}

/// The median time of each distinct [`op_key`] of `graph`, by key, timed one by one: each is
/// launched on backend `B` once untimed and `repeats` times timed, on operands of its exact
/// types filled with small positive values (token ids spread over the vocabulary the op
/// indexes). Needs memory for the largest op only, but the repeats find the operands hot in
/// the caches, so bandwidth-bound ops come out faster than in a step.
pub fn measure_ops<B: Backend>(graph: &Graph, repeats: usize) -> Result<Vec<OpTiming>> {
    let (distinct, largest) = distinct_ops(graph);
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
                shard: None,
                pitches: crate::dispatch::Pitches::DENSE,
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

/// Bytes of Adam state per f32 parameter the profile's step streams: the parameter, its
/// gradient and its two moments.
const ADAM_STATE_BYTES: u64 = 16;

/// The last-level cache assumed where the machine does not say (not Linux, or no sysfs): 256
/// MiB, beyond the caches of most CPUs, so its Adam state is measured beyond them too.
const ASSUMED_CACHE_BYTES: u64 = 256 << 20;

/// Bytes of the largest cache of CPU 0 (Linux's `/sys/devices/system/cpu/cpu0/cache`), or
/// `None` where it cannot be read.
pub fn last_level_cache_bytes() -> Option<u64> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|entry| {
        let size = std::fs::read_to_string(entry.ok()?.path().join("size")).ok()?;
        parse_cache_size(&size)
    })
    .max()
}

/// A sysfs cache size (`48K`, `2048K`, `480M`) in bytes.
fn parse_cache_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((at, _)) => text.split_at(at),
        None => (text, ""),
    };
    let shift = match unit {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        _ => return None,
    };
    digits.parse::<u64>().ok()?.checked_mul(1 << shift)
}

/// Parameters of the profile's Adam step: enough that its state (16 bytes a parameter) is
/// twice the last-level cache `cache_bytes` ([`ASSUMED_CACHE_BYTES`] when unknown), between 4
/// Mi and 32 Mi parameters (64 and 512 MiB of state). The host optimizer updates each chunk
/// once a step and the compute kernels and copies stream other memory between two updates, so
/// in a schedule its state comes from memory; a step over state that the cache holds (4 Mi
/// parameters are 64 MiB, which a large server cache keeps) measures the cache instead, up to
/// twice as fast and as variable as the neighbours sharing that cache.
pub fn adam_params_beyond_cache(cache_bytes: Option<u64>) -> usize {
    let state = cache_bytes.unwrap_or(ASSUMED_CACHE_BYTES).saturating_mul(2);
    let params = (state / ADAM_STATE_BYTES).clamp(4 << 20, 32 << 20);
    usize::try_from(params).unwrap_or(32 << 20)
}

/// Parameters per second one [`kernels::adamw_step`] (the fused, vectorised host CPU Adam every
/// backend's host optimizer runs) updates over `params` f32 parameters with f32 gradients,
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

/// Bytes of the arena of the backend [`profile`] makes only to run AdamW steps through its
/// [`Backend::run_host_adamw`] (the steps' state is the profiler's own).
const REGION_ALIGN_BYTES: u64 = 256;

/// The parameters of each of `graph`'s AdamW ops, in the graph's order: the ops a host
/// optimizer stream issues one after another.
pub fn adam_sizes(graph: &Graph) -> Vec<usize> {
    graph
        .ops()
        .filter(|(_, op)| matches!(op.kind, OpKind::AdamW { .. }))
        .filter_map(|(_, op)| op.inputs.first())
        .map(|&p| graph.value(p).ty.numel() as usize)
        .collect()
}

/// How a backend's host optimizer runs a run of AdamW steps ([`Backend::run_host_adamw`]).
pub type RunAdamW<'a> = dyn Fn(Vec<kernels::AdamWStep<'_>>, &(dyn Fn(usize) + Sync)) + 'a;

/// Seconds each AdamW op of a run costs beyond its parameters at the bulk rate
/// (`HardwareProfile::cpu_adam_op_s`): over one f32 state of `params` parameters, alternately
/// `repeats` times each, one [`kernels::adamw_step`] over the whole state and a run of ops over
/// consecutive parts of it sized as `sizes` (a graph's AdamW ops, [`adam_sizes`]; repeated in
/// order until they cover the state, the last cut to fit), each handed to `run` as the
/// executor's run of AdamW kernels reaches its backend's host optimizer
/// ([`Backend::run_host_adamw`]: on the host backend one parallel pass in the optimizer's own
/// pool). The medians' difference per op of the run, never below 0: the work of cutting a
/// run into its ops' blocks, and what the backend pays per op (on a backend that updates them
/// one after another, a hand-over of blocks and a wait for the last one per op). The state is as
/// large as [`measure_adam`]'s, beyond the last-level cache, as a schedule's is; the same
/// bytes in both, so only the split into ops differs. 0 when `sizes` has no op.
pub fn measure_adam_op_seconds(
    sizes: &[usize],
    params: usize,
    repeats: usize,
    run: &RunAdamW<'_>,
) -> f64 {
    let mut state = AdamOps::cut(sizes, params);
    if state.parts.is_empty() {
        return 0.0;
    }
    let (mut whole, mut split) = (Vec::new(), Vec::new());
    for step in 1..=repeats.max(1) as u64 + 1 {
        let one = state.time(run, step, true);
        let ops = state.time(run, step, false);
        // The first of each warms the pages and the pool's threads.
        if step > 1 {
            whole.push(one);
            split.push(ops);
        }
    }
    let extra = median(&mut split) - median(&mut whole);
    (extra / state.parts.len() as f64).max(0.0)
}

/// One f32 Adam state (parameters, gradients, moments) cut into consecutive parts as a
/// graph's AdamW ops: what [`measure_adam_op_seconds`] and [`measure_adam_shares`] run.
pub(crate) struct AdamOps {
    /// The parts' parameters, in order.
    pub(crate) parts: Vec<usize>,
    p: Vec<f32>,
    g: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
}

impl AdamOps {
    /// `params` parameters cut as `sizes` (repeated in order until they cover them, the last
    /// cut to fit; sizes of 0 skipped): no part where `sizes` has no op.
    pub(crate) fn cut(sizes: &[usize], params: usize) -> Self {
        let mut parts = Vec::new();
        let mut covered = 0;
        for &n in sizes.iter().filter(|&&n| n > 0).cycle() {
            if covered >= params {
                break;
            }
            let n = n.min(params - covered);
            parts.push(n);
            covered += n;
        }
        Self {
            parts,
            p: vec![0.1f32; covered],
            g: vec![0.01f32; covered],
            m: vec![0.0f32; covered],
            v: vec![0.0f32; covered],
        }
    }

    /// Seconds of Adam step `step` over the whole state handed to `run` as one run: one
    /// step over all of it (`whole`), or one per part.
    pub(crate) fn time(&mut self, run: &RunAdamW<'_>, step: u64, whole: bool) -> f64 {
        let config = kernels::AdamWConfig::default();
        let one = |p, g, m, v| kernels::AdamWStep {
            master: p,
            grad: kernels::Grad::F32(g),
            grad_scale: None,
            exp_avg: m,
            exp_avg_sq: v,
            low: None,
            step,
            config,
        };
        let (mut p, mut g, mut m, mut v) = (
            &mut self.p[..],
            &self.g[..],
            &mut self.m[..],
            &mut self.v[..],
        );
        let mut steps = Vec::with_capacity(self.parts.len());
        match whole {
            true => steps.push(one(p, g, m, v)),
            false => {
                for &n in &self.parts {
                    let (p0, p1) = std::mem::take(&mut p).split_at_mut(n);
                    let (g0, g1) = g.split_at(n);
                    let (m0, m1) = std::mem::take(&mut m).split_at_mut(n);
                    let (v0, v1) = std::mem::take(&mut v).split_at_mut(n);
                    steps.push(one(p0, g0, m0, v0));
                    (p, g, m, v) = (p1, g1, m1, v1);
                }
            }
        }
        let began = Instant::now();
        run(steps, &|_| {});
        began.elapsed().as_secs_f64()
    }
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

/// Fails when there is nothing to measure: a graph without ops, or no repeats.
pub(crate) fn check_inputs(graph: &Graph, options: &ProfileOptions) -> Result<()> {
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
    Ok(())
}

/// The median of some times (0 for none).
pub(crate) fn median(times: &mut [f64]) -> f64 {
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

/// One op of each distinct [`op_key`] of `graph`, with how many ops share the key, by key;
/// and the arena bytes the largest one's [`Operands`] need.
pub(crate) fn distinct_ops(graph: &Graph) -> (BTreeMap<String, (&Op, usize)>, u64) {
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
    (distinct, largest)
}

/// Where one op's operands lie in a profiling arena: inputs, outputs, workspace and (for an
/// AdamW of a parameter narrower than f32) the f32 master weight, each at an aligned offset of
/// its own.
pub(crate) struct Operands {
    pub(crate) inputs: Vec<Address>,
    pub(crate) outputs: Vec<Address>,
    pub(crate) workspace: Option<(Address, u64)>,
    pub(crate) master: Option<Address>,
}

impl Operands {
    /// The layout and the arena bytes it needs.
    pub(crate) fn layout(graph: &Graph, op: &Op) -> (Self, u64) {
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
        let param = op.inputs.first().map(|&v| &graph.value(v).ty);
        let master = match (&op.kind, param) {
            (OpKind::AdamW { .. }, Some(p)) if p.dtype != DType::F32 => Some(place(4 * p.numel())),
            _ => None,
        };
        (
            Self {
                inputs,
                outputs,
                workspace,
                master,
            },
            end,
        )
    }

    /// Writes every input in its type (small positive floats, or token ids below the
    /// vocabulary the op indexes with them) and zeroes the master weight, if any.
    pub(crate) fn fill<B: Backend>(&self, backend: &mut B, graph: &Graph, op: &Op) -> Result<()> {
        for (i, (&v, &at)) in op.inputs.iter().zip(&self.inputs).enumerate() {
            let ty = &graph.value(v).ty;
            let n = ty.numel() as usize;
            // In [0.01, 0.51): no zeros, no denormals, square roots of moments defined.
            let values = || -> Vec<f32> {
                (0..n)
                    .map(|k| 0.01 + ((k as u64 * 2_654_435_761) % 1000) as f32 / 2000.0)
                    .collect()
            };
            match ty.dtype {
                DType::I32 => backend.write_i32(at, &token_ids(n, token_bound(graph, op, i)))?,
                DType::BF16 => {
                    let narrow: Vec<half::bf16> =
                        values().into_iter().map(half::bf16::from_f32).collect();
                    backend.write_bf16(at, &narrow)?;
                }
                DType::F32 | DType::F16 => backend.write_f32(at, &values())?,
            }
        }
        if let Some(master) = self.master {
            let n = graph.value(op.inputs[0]).ty.numel();
            backend.fill_zero(master, 4 * n)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use protrain_ir::{BlockKind, GraphInfo, Phase, Role, WeightLayout};
    use std::collections::BTreeSet;

    /// Embedding, layer norm, a linear head and cross-entropy: i32 and f32 inputs, an op with
    /// a workspace and one with two outputs.
    fn tiny_graph() -> Graph {
        let mut g = Graph::new(GraphInfo {
            model: "profiler-test".into(),
            batch: 2,
            seq: 4,
        });
        let block = g.add_block("model", BlockKind::Embedding);
        let tokens = g.add_input("tokens", TensorType::new([2, 4], DType::I32));
        let targets = g.add_input("targets", TensorType::new([2, 4], DType::I32));
        let p = |g: &mut Graph, name: &str, shape: &[u64]| {
            let id = g.add_param(name, shape.to_vec(), DType::F32, block);
            g.param(id).value
        };
        let wte = p(&mut g, "wte", &[16, 8]);
        let ln_w = p(&mut g, "ln.weight", &[8]);
        let ln_b = p(&mut g, "ln.bias", &[8]);
        let fc_w = p(&mut g, "fc.weight", &[8, 16]);
        let fc_b = p(&mut g, "fc.bias", &[16]);
        let act = Role::Activation;
        let op = |g: &mut Graph, kind: OpKind, inputs: &[_], name: &str| {
            g.add_op(kind, inputs, name, act, block, Phase::Forward)
                .unwrap()
        };
        let h = op(
            &mut g,
            OpKind::Embedding { padding_idx: None },
            &[tokens, wte],
            "h",
        );
        let n = op(
            &mut g,
            OpKind::LayerNorm { eps: 1e-5 },
            &[h, ln_w, ln_b],
            "n",
        );
        let logits = op(
            &mut g,
            OpKind::Linear {
                bias: true,
                layout: WeightLayout::InOut,
            },
            &[n, fc_w, fc_b],
            "logits",
        );
        op(&mut g, OpKind::CrossEntropy, &[logits, targets], "loss");
        g
    }

    fn keys(graph: &Graph) -> BTreeSet<String> {
        graph
            .ops()
            .map(|(_, op)| {
                let t: Vec<&TensorType> = op.inputs.iter().map(|&v| &graph.value(v).ty).collect();
                op_key(&op.kind, &t)
            })
            .collect()
    }

    /// The Adam step's state is twice the last-level cache, within 4 to 32 Mi parameters;
    /// a machine that does not say gets 256 MiB assumed (32 Mi parameters).
    #[test]
    fn the_adam_step_measures_state_beyond_the_last_level_cache() {
        let mib = |n: u64| n << 20;
        assert_eq!(adam_params_beyond_cache(Some(mib(32))), 4 << 20);
        assert_eq!(adam_params_beyond_cache(Some(mib(48))), 6 << 20);
        assert_eq!(adam_params_beyond_cache(Some(mib(480))), 32 << 20);
        assert_eq!(adam_params_beyond_cache(Some(mib(1))), 4 << 20);
        assert_eq!(adam_params_beyond_cache(Some(u64::MAX)), 32 << 20);
        assert_eq!(adam_params_beyond_cache(None), 32 << 20);
        assert_eq!(parse_cache_size("491520K\n"), Some(mib(480)));
        assert_eq!(parse_cache_size("48K"), Some(48 << 10));
        assert_eq!(parse_cache_size("2M"), Some(mib(2)));
        assert_eq!(parse_cache_size("64"), Some(64));
        assert_eq!(parse_cache_size("big"), None);
        assert_eq!(parse_cache_size("99999999999999999999G"), None);
        // The default options follow this machine's cache: 16 bytes a parameter, at least
        // twice the cache where it is under 256 MiB.
        let params = ProfileOptions::default().adam_params;
        assert_eq!(params, adam_params_beyond_cache(last_level_cache_bytes()));
        if let Some(cache) = last_level_cache_bytes().filter(|&c| c <= mib(256)) {
            assert!(
                16 * params as u64 >= 2 * cache,
                "{params} parameters, {cache} bytes"
            );
        }
    }

    /// The per-op CPU Adam cost: each of the `repeats + 1` rounds hands the whole step and
    /// the run of ops to the backend's run path once each (the first round warms up and is
    /// dropped), and the result is a per-op figure, finite, never
    /// negative and far below a millisecond for ops of a few parameters; a graph without AdamW
    /// ops costs nothing per op and runs nothing. Whether a run of tiny ops measures above
    /// one step is left to the clock: under a loaded test run the two medians can cross.
    #[test]
    fn the_per_op_adam_cost_runs_both_forms_through_the_run_path() {
        let backend = HostBackend::new(256, 0, 0).unwrap();
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let run: &RunAdamW<'_> = &|steps, ended| {
            calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            backend.run_host_adamw(steps, ended)
        };
        let per_op = measure_adam_op_seconds(&[3, 5], 1 << 14, 5, run);
        assert!(
            per_op.is_finite() && (0.0..1e-3).contains(&per_op),
            "{per_op}"
        );
        assert_eq!(
            calls.load(std::sync::atomic::Ordering::Relaxed),
            2 * (5 + 1)
        );
        calls.store(0, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(measure_adam_op_seconds(&[], 1 << 14, 5, run), 0.0);
        assert_eq!(measure_adam_op_seconds(&[0], 1 << 14, 5, run), 0.0);
        assert_eq!(calls.load(std::sync::atomic::Ordering::Relaxed), 0);
        // A forward graph has no AdamW op.
        assert!(adam_sizes(&tiny_graph()).is_empty());
    }
    fn small() -> ProfileOptions {
        ProfileOptions {
            repeats: 2,
            copy_bytes: 1 << 20,
            copy_repeats: 2,
            adam_params: 1 << 16,
            ..ProfileOptions::default()
        }
    }

    #[test]
    fn both_ways_of_timing_ops_cover_every_key_of_the_graph() {
        let g = tiny_graph();
        for ops in [
            measure_ops::<HostBackend>(&g, 2).unwrap(),
            measure_ops_in_place::<HostBackend>(&g, 2).unwrap(),
        ] {
            let got: BTreeSet<String> = ops.iter().map(|t| t.op.key.clone()).collect();
            assert_eq!(got, keys(&g));
            assert_eq!(ops.len(), got.len(), "one entry per key");
            assert_eq!(ops.iter().map(|t| t.count).sum::<usize>(), g.op_count());
            assert!(ops.iter().all(|t| t.op.seconds > 0.0), "{ops:?}");
        }
    }

    #[test]
    fn a_profile_keeps_capacities_and_fills_in_the_measurements() {
        let g = tiny_graph();
        let base = HardwareProfile::host();
        let p = profile::<HostBackend>(&g, base.clone(), &small()).unwrap();
        assert_eq!(p.profile.device_memory_bytes, base.device_memory_bytes);
        assert_eq!(p.profile.host_memory_bytes, base.host_memory_bytes);
        assert_eq!(p.profile.measured_ops.len(), keys(&g).len());
        assert_eq!(
            p.profile.cpu_adam_params_per_s,
            p.profile.gpu_adam_params_per_s
        );
        assert!(p.graph_seconds > 0.0);
        p.profile.validate().unwrap();
        // Forced one by one, the same keys come out.
        let one_by_one = ProfileOptions {
            in_place_limit: 0,
            ..small()
        };
        let q = profile::<HostBackend>(&g, base, &one_by_one).unwrap();
        let names = |p: &HardwareProfile| -> Vec<String> {
            p.measured_ops.iter().map(|m| m.key.clone()).collect()
        };
        assert_eq!(names(&p.profile), names(&q.profile));
    }

    /// The op table alone: one entry per key of the graph, in place or one by one, and the
    /// same refusal as a whole profile for a graph without ops.
    #[test]
    fn the_op_table_alone_covers_every_key_of_the_graph() {
        let g = tiny_graph();
        for in_place_limit in [u64::MAX, 0] {
            let options = ProfileOptions {
                in_place_limit,
                ..small()
            };
            let ops = measure_host_ops(&g, &options).unwrap();
            let got: BTreeSet<String> = ops.iter().map(|m| m.key.clone()).collect();
            assert_eq!(got, keys(&g));
            assert_eq!(ops.len(), got.len(), "one entry per key");
        }
        let empty = Graph::new(GraphInfo {
            model: "empty".into(),
            batch: 1,
            seq: 1,
        });
        let err = measure_host_ops(&empty, &small()).unwrap_err().to_string();
        assert!(err.contains("no ops to measure"), "{err}");
    }

    #[test]
    fn nothing_to_measure_is_an_error() {
        let empty = Graph::new(GraphInfo {
            model: "empty".into(),
            batch: 1,
            seq: 1,
        });
        let err = profile_host(&empty, &small()).unwrap_err().to_string();
        assert!(err.contains("no ops to measure"), "{err}");
        let none = ProfileOptions {
            repeats: 0,
            ..small()
        };
        let err = profile_host(&tiny_graph(), &none).unwrap_err().to_string();
        assert!(err.contains("repeats must be at least 1"), "{err}");
    }

    #[test]
    fn medians_are_medians() {
        assert_eq!(median(&mut []), 0.0);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
