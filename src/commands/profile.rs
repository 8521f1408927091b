//! `protrain profile`: measure this machine for a model and write a hardware profile JSON.

use super::{seq_or_default, write_output};
use indicatif::{ProgressBar, ProgressStyle};
use protrain::ir::{format_bytes, DType, Graph, HardwareProfile};
use protrain::runtime::profiler::{measure_host_ops, profile_host, ProfileOptions, Profiled};
use protrain::{Error, OptimizerConfig, Result};
use std::path::PathBuf;
use std::time::Instant;

/// Backends a profile can be measured on.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// The host CPU as the device: kernels on the CPU cores, copies as `memcpy`.
    Host,
    /// An NVIDIA GPU through CUDA (needs a build with the `cuda` feature): matmul rates,
    /// bandwidths, launch overhead and Adam rates measured on the GPU, the op table of the
    /// model's bf16 training graph timed with CUDA events (f16 on a GPU older than compute
    /// capability 8.0, which has no bf16; the profile says so).
    Cuda,
}

/// Arguments of `protrain profile`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A preset name, a path to a Hugging Face config.json, or a directory holding one. Its
    /// training graph's ops (at --batch x --seq; f32 on the host, bf16 on cuda, f16 on a GPU
    /// without bf16) make the measured op table.
    model: String,
    /// Where to measure.
    #[arg(long, value_enum, default_value_t = BackendKind::Host)]
    backend: BackendKind,
    /// Sequences per step [default: 8 on --backend host, 1 on cuda: what `compile` defaults
    /// to for that hardware, so its ops are the ones measured].
    #[arg(long)]
    batch: Option<u64>,
    /// Tokens per sequence [default: 64 on --backend host, 1024 on cuda; at most the model's
    /// position limit].
    #[arg(long)]
    seq: Option<u64>,
    /// Timed runs of each op; the median is kept.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Write the profile here [default: standard output]. `protrain compile --hardware FILE`
    /// reads it.
    #[arg(short, long, value_name = "FILE")]
    output: Option<PathBuf>,
    /// Also measure the disk tier's read and write bandwidth in this directory (a file of
    /// --disk-bytes written, synced and read back, then removed), with O_DIRECT as the runtime
    /// moves state (PROTRAIN_DISK_IO=buffered: through the page cache); the profile keeps the
    /// assumed NVMe rates without it.
    #[arg(long, value_name = "DIR")]
    disk_dir: Option<PathBuf>,
    /// Bytes of the file --disk-dir is measured with.
    #[arg(long, value_name = "SIZE", default_value = "256MiB")]
    disk_bytes: String,
}

/// Measures the disk tier in `dir` (see `--disk-dir`) into `profile`, and says what it found.
fn measure_disk(profile: &mut HardwareProfile, dir: &std::path::Path, bytes: &str) -> Result<()> {
    let bytes = protrain::size::parse_size(bytes)?;
    // Blocks of 64 MiB: about one large chunk's state, read and written whole.
    let bw = protrain::runtime::disk::measure(dir, bytes, 64 << 20)?;
    profile.disk.read_bandwidth = bw.read.round();
    profile.disk.write_bandwidth = bw.write.round();
    let io = match bw.io {
        protrain::runtime::disk::DiskIo::Direct => "O_DIRECT",
        protrain::runtime::disk::DiskIo::Buffered => "through the page cache",
    };
    eprintln!(
        "disk            {:.2} GB/s read, {:.2} GB/s write (synced) in {} with {}, {io}",
        bw.read / 1e9,
        bw.write / 1e9,
        dir.display(),
        format_bytes(bytes)
    );
    Ok(())
}

/// The most times `--repeats` may time each op.
const MAX_REPEATS: usize = 100_000;

/// Builds the training graph, measures the backend and writes the profile.
pub fn run(args: Args) -> Result<()> {
    // The GPU's narrow type (bf16, or f16 where it has none), said before minutes of work.
    let narrow = match args.backend {
        BackendKind::Cuda => {
            cuda::ready()?;
            let (narrow, skipped) = cuda::narrow()?;
            if let Some(why) = skipped {
                eprintln!("note            {why}");
            }
            narrow
        }
        BackendKind::Host => DType::F32,
    };
    check_args(&args)?;
    let mut inputs = super::paths::Inputs::new();
    inputs.model(&args.model);
    if let Some(path) = &args.output {
        super::paths::check_outputs(&[("-o", path)], &inputs)?;
    }
    let config = protrain::models::load(&args.model)?;
    let options = ProfileOptions {
        repeats: args.repeats,
        ..ProfileOptions::default()
    };
    // The fused training graph (what `compile` schedules), then the unfused one, whose ops
    // are measured too so that fusion weighs both sides of each fusion by measurement.
    let (dtype, base) = match args.backend {
        BackendKind::Host => (DType::F32, HardwareProfile::host()),
        // Which fusions a GPU's estimates take; the measured profile then prices both sides.
        BackendKind::Cuda => (
            narrow,
            HardwareProfile::preset("h100").expect("h100 is a preset"),
        ),
    };
    let (default_batch, default_seq, _) = protrain::default_shape(&base);
    let batch = args.batch.unwrap_or(default_batch);
    let seq = seq_or_default(&config, args.seq, default_seq);
    let started = Instant::now();
    // Profiling a model's two training graphs takes minutes on a CPU: show what runs.
    let spinner = ProgressBar::new_spinner();
    spinner.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{elapsed_precise}]")
            .expect("the template is valid"),
    );
    spinner.enable_steady_tick(std::time::Duration::from_millis(200));
    spinner.set_message(format!(
        "building {}'s training graphs (batch {batch} x seq {seq})",
        config.name
    ));
    let mut graphs = protrain::profiling_graphs(
        &config,
        batch,
        seq,
        dtype,
        &OptimizerConfig::default(),
        &base,
    )?;
    let unfused = graphs.remove(0);
    let graph = graphs.remove(0);
    let (profiled, graph) = match args.backend {
        BackendKind::Host => {
            spinner.set_message(format!(
                "measuring the fused graph's {} ops, copies and Adam (1 of 2)",
                graph.op_count()
            ));
            let mut profiled = profile_host(&graph, &options)?;
            spinner.set_message(format!(
                "measuring the unfused graph's {} ops (2 of 2)",
                unfused.op_count()
            ));
            let extra = measure_host_ops(&unfused, &options)?;
            spinner.finish_and_clear();
            profiled.profile.add_measured_ops(&extra);
            if let Some(dir) = &args.disk_dir {
                measure_disk(&mut profiled.profile, dir, &args.disk_bytes)?;
            }
            // Both graphs' time, not only the first's.
            profiled.elapsed_seconds = started.elapsed().as_secs_f64();
            (profiled, graph)
        }
        BackendKind::Cuda => {
            spinner.set_message("measuring the GPU with the fused and the unfused graph");
            let mut profiled = cuda::profile(&graph, &unfused, &options)?;
            spinner.finish_and_clear();
            if let Some(dir) = &args.disk_dir {
                measure_disk(&mut profiled.profile, dir, &args.disk_bytes)?;
            }
            profiled.elapsed_seconds = started.elapsed().as_secs_f64();
            if let Some(path) = &args.output {
                print_cuda(&profiled, &graph, &config.name, (batch, seq, narrow), path);
            }
            let text = profiled.profile.to_json()?;
            write_output(
                args.output.as_deref(),
                &inputs.paths(),
                &format!("{text}\n"),
            )?;
            return Ok(());
        }
    };
    let text = profiled.profile.to_json()?;
    write_output(
        args.output.as_deref(),
        &inputs.paths(),
        &format!("{text}\n"),
    )?;
    if let Some(path) = &args.output {
        print_host(&profiled, &graph, &config.name, batch, seq, path);
    }
    Ok(())
}

/// Fails on arguments that cannot profile, before minutes of profiling: `--repeats` out of
/// range, a `--disk-bytes` that does not parse, a `--disk-dir` that is not a directory.
fn check_args(args: &Args) -> Result<()> {
    if args.repeats == 0 {
        return Err(Error::Usage(
            "--repeats must be at least 1; each op is timed that many times".into(),
        ));
    }
    // The profiler keeps every time it measures (for the median): bound what it allocates.
    if args.repeats > MAX_REPEATS {
        return Err(Error::Usage(format!(
            "--repeats {} is more than {MAX_REPEATS}; the median of that many timings is as \
             good as of more, and each op would take that many runs",
            args.repeats
        )));
    }
    // A bad disk directory or size fails now, not after minutes of profiling.
    if let Some(dir) = &args.disk_dir {
        protrain::size::parse_size(&args.disk_bytes)?;
        if !dir.is_dir() {
            return Err(Error::Usage(format!(
                "--disk-dir {} is not a directory; create it (mkdir -p) or give another",
                dir.display()
            )));
        }
    }
    Ok(())
}

/// The summary of a host profile written to `path`.
fn print_host(
    profiled: &Profiled,
    graph: &Graph,
    model: &str,
    batch: u64,
    seq: u64,
    path: &std::path::Path,
) {
    let p = &profiled.profile;
    outln!(
        "profiled {} (batch {} x seq {}, f32) on the host in {:.1} s",
        model,
        batch,
        seq,
        profiled.elapsed_seconds
    );
    outln!(
        "ops             {} distinct of {}, {:.4} s per serial step",
        p.measured_ops.len(),
        graph.op_count(),
        profiled.graph_seconds
    );
    outln!(
        "copies          {:.2} GB/s host->device, {:.2} GB/s device->host, {:.1} us launch",
        p.h2d_bandwidth / 1e9,
        p.d2h_bandwidth / 1e9,
        p.launch_overhead_s * 1e6
    );
    outln!(
        "host            {:.2} GB/s memcpy, {:.1} GFLOP/s f32 peak",
        p.host_memcpy_bandwidth / 1e9,
        p.peak_flops.f32 / 1e9
    );
    let share = |share: Option<f64>, unmeasured: &str| match share {
        Some(share) => format!("{:.0}% of that rate", share * 100.0),
        None => format!("not measured ({unmeasured})"),
    };
    outln!(
        "cpu adam        {:.1} M params/s, {:.1} us more per op; {} beside the compute \
         kernels, {} beside a copy, {} beside both",
        p.cpu_adam_params_per_s / 1e6,
        p.cpu_adam_op_s * 1e6,
        share(p.cpu_adam_compute_share, "priced at half the rate"),
        share(p.cpu_adam_copy_share, "priced at the whole rate"),
        share(
            p.cpu_adam_compute_copy_share,
            "priced as beside the compute kernels"
        ),
    );
    outln!(
        "memory          {} device, {} host (from the host preset)",
        format_bytes(p.device_memory_bytes),
        format_bytes(p.host_memory_bytes)
    );
    outln!("profile         {}", path.display());
}

/// The summary of a GPU profile of `graph`, at (batch, seq, narrow type).
fn print_cuda(
    p: &Profiled,
    graph: &Graph,
    model: &str,
    (batch, seq, narrow): (u64, u64, DType),
    path: &std::path::Path,
) {
    let h = &p.profile;
    outln!(
        "profiled {model} (batch {batch} x seq {seq}, {narrow}) on {} in {:.1} s",
        h.name,
        p.elapsed_seconds
    );
    outln!(
        "ops             {} distinct of {}, {:.4} s per serial step",
        h.measured_ops.len(),
        graph.op_count(),
        p.graph_seconds
    );
    outln!(
        "matmul          {:.0} TFLOP/s {narrow}, {:.1} TFLOP/s f32 (written as peaks of {:.0} \
         and {:.1}, the roofline's 0.7 efficiency undone)",
        h.peak_flops.bf16 * 0.7 / 1e12,
        h.peak_flops.f32 * 0.7 / 1e12,
        h.peak_flops.bf16 / 1e12,
        h.peak_flops.f32 / 1e12
    );
    outln!(
        "memory          {:.0} GB/s device, {:.2} GB/s host->device, {:.2} GB/s device->host \
         (pinned), {:.1} us launch",
        h.device_bandwidth / 1e9,
        h.h2d_bandwidth / 1e9,
        h.d2h_bandwidth / 1e9,
        h.launch_overhead_s * 1e6
    );
    outln!(
        "adam            {:.0} M params/s on the GPU, {:.1} M params/s on the CPU",
        h.gpu_adam_params_per_s / 1e6,
        h.cpu_adam_params_per_s / 1e6
    );
    outln!(
        "capacity        {} device ({} reserved), {} host",
        format_bytes(h.device_memory_bytes),
        format_bytes(h.reserved_device_bytes),
        format_bytes(h.host_memory_bytes)
    );
    outln!("profile         {}", path.display());
}

/// The CUDA side of `profile`, or why there is none in this build.
mod cuda {
    use protrain::ir::{DType, Graph};
    use protrain::runtime::profiler::{ProfileOptions, Profiled};
    use protrain::{Error, Result};

    /// Fails unless the CUDA backend is built in and can run here.
    #[cfg(feature = "cuda")]
    pub fn ready() -> Result<()> {
        protrain::runtime::cuda::available()
            .map_err(|why| Error::Usage(format!("no CUDA device is available: {why}")))
    }

    /// Fails: the CUDA backend is not built in.
    #[cfg(not(feature = "cuda"))]
    pub fn ready() -> Result<()> {
        Err(not_built())
    }

    /// What `profile --backend cuda` says in a build without the CUDA backend.
    #[cfg(not(feature = "cuda"))]
    fn not_built() -> Error {
        Error::Usage(
            "the cuda backend is not built into this protrain; rebuild with `cargo build \
             --release --features cuda` on a machine with CUDA, or profile with --backend host"
                .into(),
        )
    }

    /// The GPU's narrow type the profile times, and what it leaves out and why
    /// (`protrain::runtime::cuda::profile::timed_dtypes`).
    #[cfg(feature = "cuda")]
    pub fn narrow() -> Result<(DType, Option<String>)> {
        let info = protrain::runtime::cuda::device()
            .map_err(|why| Error::Usage(format!("no CUDA device is available: {why}")))?;
        let timed = protrain::runtime::cuda::profile::timed_dtypes(info.compute_capability);
        Ok((timed.narrow, timed.skipped))
    }

    /// Fails: the CUDA backend is not built in ([`ready`] says so first).
    #[cfg(not(feature = "cuda"))]
    pub fn narrow() -> Result<(DType, Option<String>)> {
        Err(not_built())
    }

    /// Measures the GPU for `graph`, and the ops of `unfused` it lacks.
    #[cfg(feature = "cuda")]
    pub fn profile(graph: &Graph, unfused: &Graph, options: &ProfileOptions) -> Result<Profiled> {
        use protrain::runtime::cuda::profile::profile_cuda;
        let mut profiled = profile_cuda(graph, options)?;
        let extra = profile_cuda(unfused, options)?;
        profiled
            .profile
            .add_measured_ops(&extra.profile.measured_ops);
        Ok(profiled)
    }

    /// Fails: the CUDA backend is not built in ([`ready`] says so first).
    #[cfg(not(feature = "cuda"))]
    pub fn profile(
        _graph: &Graph,
        _unfused: &Graph,
        _options: &ProfileOptions,
    ) -> Result<Profiled> {
        Err(not_built())
    }
}
