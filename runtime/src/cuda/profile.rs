//! Measures a GPU through the CUDA backend for `protrain profile --backend cuda`: matmul
//! FLOP/s per dtype, device memory bandwidth, pinned host<->device bandwidth, launch overhead,
//! device and CPU Adam throughput, and the op table of a training graph, as a
//! [`HardwareProfile`].
//!
//! It follows [`crate::profiler`]'s structure (the same options, medians, matmul efficiency and
//! [`Profiled`] result) but times GPU work with CUDA events rather than the host clock, and
//! lays out operands in their own types, so a bf16 graph's op table has bf16 keys. Ops are
//! timed one by one on operands of their own (one arena sized for the largest op), which bounds
//! the memory to one op's for any model size.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{result, sys, CudaEvent, CudaStream};
use protrain_ir::{
    DType, Graph, HardwareProfile, MeasuredOp, PeakFlops, Space, StreamKind, WeightLayout,
};

use super::backend::{CudaBackend, CudaStreamHandle};
use super::blas::LinearDims;
use super::driver::{
    check_dtypes, driver_error, probe, simulator_counters, BF16_MIN_COMPUTE_CAPABILITY,
};
use super::launch::Arg;
use crate::backend::{Address, Backend, Launch};
use crate::dispatch::Prepared;
use crate::error::{Result, RuntimeError};
use crate::profiler::{
    adam_sizes, check_inputs, distinct_ops, measure_adam, measure_adam_op_seconds, measure_memcpy,
    median, OpTiming, Operands, ProfileOptions, Profiled,
};

/// Operands are placed at multiples of this many bytes, as the planner aligns buffers.
const ALIGN: u64 = 256;

/// The matmul efficiency the compiler's roofline assumes (`Efficiency::default().matmul`), as
/// in [`crate::profiler`]: the measured rate divided by it is written as the peak.
const ROOFLINE_MATMUL_EFFICIENCY: f64 = 0.7;

/// How large the device-wide measurements are: a GPU's sizes reach its sustained rates; the
/// CPU simulator's are small, since its rates say nothing of a GPU and its matmuls run on the
/// CPU (an 8192-cubed product would take it hours), so `protrain profile --backend cuda` runs
/// there in seconds and its every step can be tested.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Sizes {
    /// Square matmul size timed in the narrow type for the tensor cores' sustained rate.
    narrow_matmul: usize,
    /// Square matmul size timed in f32 for the vector units' rate.
    f32_matmul: usize,
    /// Bytes of the device-to-device copy timed for the memory bandwidth.
    device_copy: u64,
    /// Parameters of the timed device AdamW (narrow parameters with f32 master weights, as
    /// mixed-precision schedules update persistent chunks).
    gpu_adam: u64,
}

impl Sizes {
    /// The sizes for a GPU, or for the CPU simulator when `simulated`.
    fn new(simulated: bool) -> Self {
        match simulated {
            false => Self {
                narrow_matmul: 8192,
                f32_matmul: 4096,
                device_copy: 1 << 30,
                gpu_adam: 64 << 20,
            },
            true => Self {
                narrow_matmul: 128,
                f32_matmul: 128,
                device_copy: 16 << 20,
                gpu_adam: 1 << 20,
            },
        }
    }
}

/// What the profile times on a GPU: the narrow (16-bit) type of its tensor-core matmul, of its
/// device AdamW's parameters and of the op table's training graph, and what it leaves out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timed {
    /// bf16 from compute capability 8.0 ([`BF16_MIN_COMPUTE_CAPABILITY`]), f16 before, where
    /// the GPU has no bf16 tensor-core products and the backend refuses bf16 schedules.
    pub narrow: DType,
    /// For the user, when a type is not timed: which, why, and what the profile writes in its
    /// place. `None` when the GPU runs every type.
    pub skipped: Option<String>,
}

/// What the profile times on a GPU of `compute_capability` ([`Timed`]). Before 8.0, bf16 is not
/// timed: the profile measures f16 instead (the op table is the f16 training graph's) and
/// writes the f16 matmul rate as the bf16 peak too, since a profile holds a rate for every
/// type and no schedule uses that one on such a GPU (the backend refuses bf16 schedules,
/// [`check_dtypes`]).
pub fn timed_dtypes(compute_capability: (i32, i32)) -> Timed {
    if compute_capability >= BF16_MIN_COMPUTE_CAPABILITY {
        return Timed {
            narrow: DType::BF16,
            skipped: None,
        };
    }
    let (major, minor) = compute_capability;
    let (need_major, need_minor) = BF16_MIN_COMPUTE_CAPABILITY;
    Timed {
        narrow: DType::F16,
        skipped: Some(format!(
            "bf16 not timed: compute capability {major}.{minor} has no bf16 tensor-core \
             products ({need_major}.{need_minor} or newer has), and the CUDA backend refuses bf16 \
             schedules on it; the op table is the f16 training graph's, and the f16 matmul rate \
             is written as the bf16 peak too, which no schedule on this GPU uses (compile with \
             --dtype f16 or --dtype f32)"
        )),
    }
}

/// Kernel launches timed back to back for the launch overhead.
const LAUNCHES: usize = 1000;

/// Device memory held back from the profile's usable memory beyond what the context and
/// cuBLAS took when measured: the kernels' scratch and allocator slack.
const RESERVED_SLACK: u64 = 512 << 20;

/// Times GPU work on one stream with a pair of timing events.
struct Timer {
    start: CudaEvent,
    end: CudaEvent,
    stream: Arc<CudaStream>,
}

impl Timer {
    fn new(backend: &CudaBackend, stream: &CudaStreamHandle) -> Result<Self> {
        let stream = stream
            .cuda_stream()
            .ok_or_else(|| RuntimeError::Profile("timing needs a device stream".into()))?
            .clone();
        let event = || {
            backend
                .ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| driver_error("creating a timing event", e))
        };
        Ok(Self {
            start: event()?,
            end: event()?,
            stream,
        })
    }

    /// Seconds the GPU spent on the work `issue` enqueues (after it has been enqueued once
    /// untimed), divided by `per`: `issue` is called `per` times between the events.
    fn time(&self, per: usize, mut issue: impl FnMut() -> Result<()>) -> Result<f64> {
        issue()?;
        let fail = |e| driver_error("timing GPU work", e);
        self.start.record(&self.stream).map_err(fail)?;
        for _ in 0..per {
            issue()?;
        }
        self.end.record(&self.stream).map_err(fail)?;
        let ms = self.start.elapsed_ms(&self.end).map_err(fail)?;
        Ok(f64::from(ms) / 1e3 / per.max(1) as f64)
    }
}

/// A lowercase name for a device: `NVIDIA H200` becomes `nvidia-h200`.
fn device_name(name: &str) -> String {
    let mut out = String::new();
    for c in name.trim().chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.ends_with('-') && !out.is_empty() {
            out.push('-');
        }
    }
    out.trim_end_matches('-').to_string()
}

/// Profiles the GPU for `graph` (a training graph, f32 or bf16; the runtime does not depend
/// on the compiler, so the caller builds it) and returns a `HardwareProfile` that
/// `--hardware FILE` reads. The name is the device's (`nvidia-h200`) unless `options.name`
/// is set to something other than `host`.
///
/// Measured: the op table (each distinct op once untimed, then `repeats` times, the median
/// kept), square matmuls in the GPU's narrow type ([`timed_dtypes`]: bf16, or f16 before
/// compute capability 8.0) and in f32 for the peak rates, a 1 GiB device copy for the memory
/// bandwidth, pinned copies of `copy_bytes` each way, the cost of one small kernel launch,
/// the device AdamW (narrow parameters with f32 master weights) and the CPU Adam rate, host
/// `memcpy` bandwidth. Device memory is the GPU's; what the context and cuBLAS take, plus a
/// margin for the kernels' scratch, is the reserved memory; host memory is this machine's.
///
/// Fails before timing anything when `graph` stores a type the GPU cannot run (bf16 before
/// compute capability 8.0, [`check_dtypes`]): its kernels would time what no schedule runs.
pub fn profile_cuda(graph: &Graph, options: &ProfileOptions) -> Result<Profiled> {
    let started = Instant::now();
    check_inputs(graph, options)?;
    let info = probe()?;
    check_dtypes(graph.values().map(|(_, v)| v.ty.dtype), &info)?;
    let timed = timed_dtypes(info.compute_capability);
    let ops = measure_ops(graph, options.repeats)?;
    let graph_seconds = ops
        .iter()
        .map(|t| t.op.seconds * t.count as f64)
        .sum::<f64>();
    let sizes = Sizes::new(simulator_counters().is_some());
    let rates = measure_device(options, timed.narrow, sizes)?;
    let memcpy = measure_memcpy(options.copy_bytes, options.copy_repeats);
    let cpu_adam = measure_adam(options.adam_params.max(1), options.repeats);
    // The CUDA backend's host optimizer runs each AdamW op as it comes, on its stream's thread
    // (the default `Backend::launch_adamw_run` and `Backend::run_host_adamw`).
    let cpu_adam_op = measure_adam_op_seconds(
        &adam_sizes(graph),
        options.adam_params.max(1),
        options.repeats,
        &|steps, ended| crate::kernels::adamw_steps_in_turn(steps, ended),
    );
    let host = HardwareProfile::host();
    let name = match options.name.as_str() {
        "host" => device_name(&rates.device),
        other => other.to_string(),
    };
    let skipped = match &timed.skipped {
        Some(why) => format!("; {why}"),
        None => String::new(),
    };
    let profile = HardwareProfile {
        name,
        description: format!(
            "{} measured by `protrain profile --backend cuda`: {:.0} TFLOP/s {} and {:.1} \
             f32 matmul, {:.0} GB/s device copy, {:.1}/{:.1} GB/s H2D/D2H pinned, {} op \
             timings; host: {} threads{skipped}",
            rates.device,
            rates.narrow_flops / 1e12,
            timed.narrow,
            rates.f32_flops / 1e12,
            rates.device_bandwidth / 1e9,
            rates.h2d / 1e9,
            rates.d2h / 1e9,
            ops.len(),
            rayon::current_num_threads()
        ),
        device_memory_bytes: rates.memory_bytes,
        host_memory_bytes: host.host_memory_bytes,
        reserved_device_bytes: rates.reserved_bytes,
        peak_flops: PeakFlops {
            f32: rates.f32_flops / ROOFLINE_MATMUL_EFFICIENCY,
            // The tensor cores' rate, measured in the narrow type the GPU runs, for both:
            // from 8.0 bf16 and f16 products run at the same rate; before it, the bf16
            // figure is f16's and unused ([`timed_dtypes`]).
            bf16: rates.narrow_flops / ROOFLINE_MATMUL_EFFICIENCY,
            f16: rates.narrow_flops / ROOFLINE_MATMUL_EFFICIENCY,
        },
        device_bandwidth: rates.device_bandwidth,
        h2d_bandwidth: rates.h2d,
        d2h_bandwidth: rates.d2h,
        host_memcpy_bandwidth: memcpy,
        launch_overhead_s: rates.launch_s,
        cpu_adam_params_per_s: cpu_adam,
        cpu_adam_op_s: cpu_adam_op,
        // Its host optimizer shares no cores with the compute kernels, which run on the GPU,
        // nor with the copies, which its DMA engines make.
        cpu_adam_compute_share: None,
        cpu_adam_copy_share: None,
        cpu_adam_compute_copy_share: None,
        gpu_adam_params_per_s: rates.gpu_adam,
        measured_ops: ops.iter().map(|t| t.op.clone()).collect(),
        // One GPU measured: how it links to others is not known.
        interconnect: None,
        disk: protrain_ir::Disk::default(),
        // What the compiler plans attention for (flash attention needs 8.0).
        compute_capability: Some(rates.compute_capability),
    };
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

/// What [`measure_device`] found.
struct DeviceRates {
    device: String,
    compute_capability: (i32, i32),
    memory_bytes: u64,
    reserved_bytes: u64,
    /// FLOP/s of the tensor-core matmul in the GPU's narrow type ([`Timed::narrow`]).
    narrow_flops: f64,
    f32_flops: f64,
    device_bandwidth: f64,
    h2d: f64,
    d2h: f64,
    launch_s: f64,
    gpu_adam: f64,
}

/// The device-wide figures: matmul rates (the tensor cores' in `narrow`), bandwidths, launch
/// overhead, device Adam (with `narrow` parameters), measured at `sizes`.
fn measure_device(options: &ProfileOptions, narrow: DType, sizes: Sizes) -> Result<DeviceRates> {
    let copy = options.copy_bytes.max(ALIGN);
    let narrow_mat = (sizes.narrow_matmul * sizes.narrow_matmul * 2) as u64;
    let f32_mat = (sizes.f32_matmul * sizes.f32_matmul * 4) as u64;
    let adam = sizes.gpu_adam * (4 + 2 + 2 + 4 + 4);
    let device_copy = sizes.device_copy;
    // One arena for every measurement, regions laid out one after the other.
    let arena = (3 * narrow_mat)
        .max(3 * f32_mat)
        .max(2 * device_copy)
        .max(adam)
        .max(copy);
    let mut backend = CudaBackend::new(arena, copy, 0)?;
    let mut stream = backend.create_stream(StreamKind::Compute)?;
    let timer = Timer::new(&backend, &stream)?;
    let repeats = options.copy_repeats;
    let narrow_flops = matmul_flops(
        &mut backend,
        &mut stream,
        &timer,
        repeats,
        narrow,
        sizes.narrow_matmul,
    )?;
    let f32_flops = matmul_flops(
        &mut backend,
        &mut stream,
        &timer,
        repeats,
        DType::F32,
        sizes.f32_matmul,
    )?;

    // Device bandwidth: a copy reads and writes every byte.
    let (src, dst) = (
        backend.gpu_addr(device(0), device_copy)?,
        backend.gpu_addr(device(device_copy), device_copy)?,
    );
    let cu = timer.stream.cu_stream();
    let dtod = median_time(repeats, &mut || {
        timer.time(2, || {
            // SAFETY: two disjoint ranges of the arena; nothing else runs.
            unsafe { result::memcpy_dtod_async(dst, src, device_copy as usize, cu) }
                .map_err(|e| driver_error("timing a device copy", e))
        })
    })?;
    let device_bandwidth = 2.0 * device_copy as f64 / dtod;

    // Pinned copies each way, through the backend's own copy path.
    let host = Address {
        space: Space::Host,
        offset: 0,
    };
    let mut pinned = |src: Address, dst: Address| -> Result<f64> {
        let s = median_time(repeats, &mut || {
            timer.time(2, || {
                // SAFETY: the host region and the start of the arena; nothing else runs.
                unsafe { backend.copy(&mut stream, src, dst, copy) }
            })
        })?;
        Ok(copy as f64 / s)
    };
    let h2d = pinned(host, device(0))?;
    let d2h = pinned(device(0), host)?;

    // Launch overhead: back-to-back launches of a kernel with nothing to do, GPU time each.
    let x = backend.gpu_addr(device(0), 4)?;
    let launch_s = median_time(repeats, &mut || {
        timer.time(LAUNCHES, || {
            backend.launch_kernel(
                &timer.stream,
                "scale_f32",
                (1, 1, 1),
                (32, 1, 1),
                &[Arg::Ptr(x), Arg::I64(1), Arg::F32(1.0)],
            )
        })
    })?;
    let gpu_adam = adam_rate(&mut backend, &timer, repeats, narrow, sizes.gpu_adam)?;
    let reserved_bytes = reserved_bytes(&backend, arena)?;
    Ok(DeviceRates {
        device: backend.device().name.clone(),
        compute_capability: backend.device().compute_capability,
        memory_bytes: backend.device().memory_bytes,
        reserved_bytes,
        narrow_flops,
        f32_flops,
        device_bandwidth,
        h2d,
        d2h,
        launch_s,
        gpu_adam,
    })
}

/// The arena address `offset` bytes in.
fn device(offset: u64) -> Address {
    Address {
        space: Space::Device,
        offset,
    }
}

/// The median of `repeats` timings by `time`.
fn median_time(repeats: usize, time: &mut dyn FnMut() -> Result<f64>) -> Result<f64> {
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        times.push(time()?);
    }
    Ok(median(&mut times))
}

/// Fills the first two `bytes`-byte matrices of the arena with `n` small values each of
/// `dtype`: random-looking data draws more power than zeros, which the tensor cores run
/// faster; these are neither, but close to real weights.
fn fill_matrices(backend: &mut CudaBackend, dtype: DType, n: usize, bytes: u64) -> Result<()> {
    let values: Vec<f32> = (0..n)
        .map(|k| ((k as u64 * 2_654_435_761) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    for i in 0..2u64 {
        match dtype {
            DType::BF16 => {
                let narrow: Vec<half::bf16> =
                    values.iter().map(|&x| half::bf16::from_f32(x)).collect();
                backend.write_bf16(device(i * bytes), &narrow)?
            }
            _ => backend.write_f32(device(i * bytes), &values)?,
        }
    }
    Ok(())
}

/// The FLOP/s of a `size` x `size` x `size` matmul in `dtype` on `stream`, the median of
/// `repeats` timings.
fn matmul_flops(
    backend: &mut CudaBackend,
    stream: &mut CudaStreamHandle,
    timer: &Timer,
    repeats: usize,
    dtype: DType,
    size: usize,
) -> Result<f64> {
    let bytes = (size * size) as u64 * dtype.size();
    fill_matrices(backend, dtype, size * size, bytes)?;
    let (a, w, y) = (
        backend.gpu_addr(device(0), bytes)?,
        backend.gpu_addr(device(bytes), bytes)?,
        backend.gpu_addr(device(2 * bytes), bytes)?,
    );
    let dims = LinearDims {
        rows: size,
        d_in: size,
        d_out: size,
    };
    let d = stream
        .device_stream()
        .ok_or_else(|| RuntimeError::Profile("a compute stream is a device stream".into()))?;
    let gemm = d.gemm()?;
    let seconds = median_time(repeats, &mut || {
        timer.time(4, || {
            // SAFETY: a, w, y are three disjoint size x size matrices in the arena;
            // nothing else runs on the device.
            unsafe { gemm.linear_forward(dtype, WeightLayout::OutIn, dims, a, w, y) }
        })
    })?;
    Ok(2.0 * (size as f64).powi(3) / seconds)
}

/// Parameters a second of the device AdamW in mixed precision (master f32, param and grad
/// `narrow`, m and v f32) over `n` parameters, the median of `repeats` timings.
fn adam_rate(
    backend: &mut CudaBackend,
    timer: &Timer,
    repeats: usize,
    narrow: DType,
    n: u64,
) -> Result<f64> {
    let kernel = match narrow {
        DType::F16 => "adamw_f16",
        _ => "adamw_bf16",
    };
    let at = |k: u64| backend.gpu_addr(device(k), 1);
    let (master, param, grad, m, v) = (at(0)?, at(4 * n)?, at(6 * n)?, at(8 * n)?, at(12 * n)?);
    backend.fill_zero(device(0), 16 * n)?;
    let s = super::AdamWScalars::new(&crate::kernels::AdamWConfig::default(), 1);
    let args = [
        Arg::Ptr(master),
        Arg::Ptr(param),
        Arg::Ptr(grad),
        Arg::Ptr(m),
        Arg::Ptr(v),
        Arg::I64(n as i64),
        Arg::Ptr(0),
        Arg::F32(s.decay),
        Arg::F32(s.lerp_w),
        Arg::F32(s.beta2),
        Arg::F32(s.one_minus_beta2),
        Arg::F32(s.bc2_sqrt),
        Arg::F32(s.eps),
        Arg::F32(s.neg_step_size),
    ];
    let blocks = backend.grid_for(n);
    let adam_s = median_time(repeats, &mut || {
        timer.time(2, || {
            backend.launch_kernel(&timer.stream, kernel, (blocks, 1, 1), (256, 1, 1), &args)
        })
    })?;
    Ok(n as f64 / adam_s)
}

/// The device memory the context, the modules and cuBLAS hold (less this profile's own
/// `arena`), with slack, in whole MiB.
fn reserved_bytes(backend: &CudaBackend, arena: u64) -> Result<u64> {
    backend.bind()?;
    let (free, total) = backend
        .ctx
        .mem_get_info()
        .map_err(|e| driver_error("asking how much device memory is free", e))?;
    let held = (total as u64)
        .saturating_sub(free as u64)
        .saturating_sub(arena);
    Ok((held + RESERVED_SLACK).next_multiple_of(1 << 20))
}

/// The median GPU time of each distinct [`op_key`] of `graph`, by key, each op launched on
/// operands of its own types once untimed and `repeats` times timed with CUDA events.
fn measure_ops(graph: &Graph, repeats: usize) -> Result<Vec<OpTiming>> {
    let (distinct, largest) = distinct_ops(graph);
    let mut backend = CudaBackend::new(largest, 0, 0)?;
    let mut stream = backend.create_stream(StreamKind::Compute)?;
    let timer = Timer::new(&backend, &stream)?;
    let mut out = Vec::with_capacity(distinct.len());
    for (key, (op, count)) in distinct {
        let operands = Operands::layout(graph, op).0;
        operands.fill(&mut backend, graph, op)?;
        if let Some(master) = operands.master {
            backend.set_master_weight(operands.inputs[2], master);
        }
        let prepared = Prepared::new(&op.kind);
        let mut times = Vec::with_capacity(repeats);
        for run in 0..repeats {
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
            times.push(timer.time(1, || {
                // SAFETY: one stream, one thread: nothing else touches the arena, and the
                // operands were laid out apart from each other.
                unsafe { backend.launch(&mut stream, &launch) }.map(|_| ())
            })?);
        }
        backend.synchronize(&mut stream)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_become_profile_names() {
        assert_eq!(device_name("NVIDIA H200"), "nvidia-h200");
        assert_eq!(
            device_name(" NVIDIA A100-SXM4-80GB "),
            "nvidia-a100-sxm4-80gb"
        );
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
    }
}
