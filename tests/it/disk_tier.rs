//! The disk tier: the optimizer state of offloaded chunks that host memory
//! cannot hold lives in a file, read into staging buffers before the CPU Adam updates it and
//! written back after. On the host backend gpt2-tiny and llama-tiny train with every chunk's
//! state on disk bit for bit as the same policy fully in host memory and as every chunk
//! resident (bf16, clipped), and as the interpreter (f32); a checkpoint carries the state on
//! disk, and resuming from it gives the uninterrupted run's losses. The verifier refuses a
//! disk schedule that writes a chunk's state back before its update, or updates it before it
//! is read; the runtime refuses a disk schedule without a directory.

use crate::common;

use protrain::ir::verify_schedule::{verify, VerifiedSchedule};
use protrain::ir::{DType, HardwareProfile, Instr, Schedule, Space, StreamKind};
use protrain::runtime::checkpoint::{self, Progress};
use protrain::runtime::interpreter::Interpreter;
use protrain::runtime::params::init_params;
use protrain::runtime::{Backend, Executor};
use protrain::size::parse_size;
use protrain::{CompileOptions, OptimizerConfig, PolicyChoice};

const BATCH: u64 = 2;
const SEQ: u64 = 16;
const STEPS: usize = 4;
const SEED: u64 = 11;
/// Every chunk streamed and updated by the CPU Adam, one layer swapped and one recomputed.
pub(crate) const TIGHT: &str = "n_persist=0,n_buffer=2,n_swap=1,n_checkpoint=1";

/// `model` for the host under `policy`, with `host` bytes of host memory (the profile's when
/// `None`) and a disk tier of 64 MiB; clipped (the CPU Adam then waits for the clip
/// coefficient, which exists only after every gradient).
pub(crate) fn compile(
    model: &str,
    dtype: DType,
    policy: &str,
    host: Option<u64>,
) -> VerifiedSchedule {
    compile_k(model, dtype, policy, host, 1)
}

/// [`compile`] accumulating the gradients of `micro_batches` micro-batches per step.
fn compile_k(
    model: &str,
    dtype: DType,
    policy: &str,
    host: Option<u64>,
    micro_batches: u64,
) -> VerifiedSchedule {
    let config = protrain::models::load(model).unwrap();
    let mut hardware = HardwareProfile::preset("host").unwrap();
    if let Some(bytes) = host {
        hardware = hardware.with_host_memory(bytes);
    }
    let options = CompileOptions {
        batch: BATCH,
        seq: SEQ,
        dtype,
        policy: PolicyChoice::parse(policy).unwrap(),
        optimizer: OptimizerConfig {
            grad_clip: Some(1.0),
            ..Default::default()
        },
        micro_batches,
        ..CompileOptions::for_hardware(hardware.with_disk_memory(parse_size("64MiB").unwrap()))
    };
    protrain::compile(&config, &options)
        .unwrap_or_else(|e| panic!("{model} [{policy}]: {e}"))
        .schedule
}

/// `model`'s tight policy with every chunk's optimizer state on disk: the host budget is
/// what the host region needs with all of them moved, which moving fewer does not meet
/// (gpt2-tiny has four alike chunks, double-buffered; llama-tiny two, through one staging
/// buffer).
pub(crate) fn on_disk(model: &str, dtype: DType) -> VerifiedSchedule {
    on_disk_k(model, dtype, 1)
}

/// [`on_disk`] accumulating `micro_batches` micro-batches per step.
fn on_disk_k(model: &str, dtype: DType, micro_batches: u64) -> VerifiedSchedule {
    let host = compile_k(model, dtype, TIGHT, None, micro_batches);
    assert_eq!(
        host.disk_bytes, 0,
        "{model}: fits the host without the disk"
    );
    let state: u64 = host
        .buffers
        .iter()
        .filter(|b| matches!(b.kind, protrain::ir::BufferKind::OptimizerState { .. }))
        .map(|b| b.size)
        .sum();
    let largest = host
        .buffers
        .iter()
        .filter(|b| matches!(b.kind, protrain::ir::BufferKind::OptimizerState { .. }))
        .map(|b| b.size)
        .max()
        .unwrap();
    // Everything but the state, plus two staging buffers of the largest (one for two
    // chunks, where two would save nothing), and alignment.
    let chunks = host.chunks.len() as u64;
    let budget = host.host_bytes - state + 2.min(chunks - 1) * largest + 4096;
    let disk = compile_k(model, dtype, TIGHT, Some(budget), micro_batches);
    assert_eq!(
        disk.disk_chunks().len() as u64,
        chunks,
        "{model}: every chunk's state on disk"
    );
    assert!(disk.host_bytes <= budget && disk.host_bytes < host.host_bytes);
    disk
}

/// Each step's loss and gradient norm bits, then every final weight's bits and every
/// optimizer state's bits, in order.
pub(crate) type Trace = (Vec<u32>, Vec<Vec<u32>>, Vec<Vec<u32>>);

/// An executor of `schedule` with its disk file in `dir`. Every file in these tests moves its
/// bulk with `O_DIRECT` (where the file system takes it), the runtime's choice for a state
/// the page cache cannot hold, so that path runs through whole schedules; the runtime's unit
/// tests cover buffered I/O and every alignment against a plain byte vector.
fn executor<'s>(schedule: &'s VerifiedSchedule, dir: &std::path::Path) -> Executor<'s> {
    executor_on(schedule, dir)
}

/// [`executor`] on backend `B`.
fn executor_on<'s, B: Backend>(
    schedule: &'s VerifiedSchedule,
    dir: &std::path::Path,
) -> Executor<'s, B> {
    static DIRECT: std::sync::Once = std::sync::Once::new();
    DIRECT.call_once(|| std::env::set_var(protrain::runtime::disk::IO_ENV, "direct"));
    let mut exec = Executor::<B>::with_backend(schedule).unwrap();
    exec.set_disk_dir(dir).unwrap();
    exec
}

fn finish<B: Backend>(exec: &Executor<'_, B>, trace: Vec<u32>) -> Trace {
    let bits = |v: &Vec<f32>| v.iter().map(|x| x.to_bits()).collect();
    let params = exec.params().unwrap().iter().map(bits).collect();
    let state = exec.state().unwrap().iter().map(|(_, v)| bits(v)).collect();
    (trace, params, state)
}

fn train(schedule: &VerifiedSchedule, model: &str) -> Trace {
    train_on::<protrain::runtime::HostBackend>(schedule, model)
}

/// [`train`] on backend `B`: each step's loss and gradient norm bits, then the final weights'
/// and optimizer state's bits. A schedule with a disk tier gets its file in a new directory,
/// which must be empty again once the executor is dropped.
pub(crate) fn train_on<B: Backend>(schedule: &VerifiedSchedule, model: &str) -> Trace {
    let config = protrain::models::load(model).unwrap();
    let rows = BATCH * u64::from(schedule.micro_batches());
    let data = common::batches(config.vocab_size as usize, rows, SEQ, STEPS, SEED);
    let dir = tempfile::tempdir().unwrap();
    let mut exec = executor_on::<B>(schedule, dir.path());
    exec.load_params(&init_params(&schedule.graph, SEED))
        .unwrap();
    let mut trace = Vec::new();
    for [x, y] in &data {
        let report = exec.step(&[x, y]).unwrap();
        trace.push(report.loss.to_bits());
        trace.push(report.grad_norm.expect("clipped").to_bits());
    }
    let out = finish(&exec, trace);
    if schedule.disk_bytes > 0 {
        let path = exec.disk_path().unwrap().to_path_buf();
        assert!(path.starts_with(dir.path()) && path.exists());
        drop(exec);
        assert!(!path.exists(), "the file is removed with the executor");
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    out
}

fn check_bf16(model: &str) {
    let disk = on_disk(model, DType::BF16);
    let host = compile(model, DType::BF16, TIGHT, None);
    let resident = compile(model, DType::BF16, "", None);
    let want = train(&resident, model);
    assert_eq!(train(&host, model), want, "{model}: host vs resident");
    assert_eq!(
        train(&disk, model),
        want,
        "{model}: the state on disk trains differently from the resident schedule"
    );
}

#[test]
fn gpt2_with_its_state_on_disk_trains_bit_identically() {
    check_bf16("gpt2-tiny");
}

#[test]
fn llama_with_its_state_on_disk_trains_bit_identically() {
    check_bf16("llama-tiny");
}

/// f32: the disk schedule's losses and weights are the interpreter's, step by step.
/// Accumulation composes with the disk tier: two micro-batches per step, every chunk's
/// state on disk (read and written once a step, after the last micro-batch), train bit for
/// bit as the same policy with the state in host memory and as every chunk resident.
#[test]
fn accumulating_with_the_state_on_disk_trains_bit_identically() {
    for model in ["gpt2-tiny", "llama-tiny"] {
        let disk = on_disk_k(model, DType::BF16, 2);
        assert_eq!(disk.micro_batches(), 2);
        let host = compile_k(model, DType::BF16, TIGHT, None, 2);
        let resident = compile_k(model, DType::BF16, "", None, 2);
        let want = train(&resident, model);
        assert_eq!(train(&host, model), want, "{model}: host vs resident");
        assert_eq!(
            train(&disk, model),
            want,
            "{model}: accumulating with the state on disk trains differently"
        );
    }
}

#[test]
fn f32_state_on_disk_matches_the_interpreter() {
    for model in ["gpt2-tiny", "llama-tiny"] {
        let disk = on_disk(model, DType::F32);
        let config = protrain::models::load(model).unwrap();
        let data = common::batches(config.vocab_size as usize, BATCH, SEQ, STEPS, SEED);
        let init = init_params(&disk.graph, SEED);
        let dir = tempfile::tempdir().unwrap();
        let mut exec = executor(&disk, dir.path());
        exec.load_params(&init).unwrap();
        let mut interp = Interpreter::new(&disk.graph);
        for ((id, _), values) in disk.graph.params().zip(&init) {
            interp.set_param(id, values).unwrap();
        }
        for [x, y] in &data {
            let got = exec.step(&[x, y]).unwrap();
            let want = interp.step(&[x, y]).unwrap();
            assert_eq!(got.loss.to_bits(), want.loss.to_bits(), "{model}");
        }
        let got = exec.params().unwrap();
        for ((id, _), values) in disk.graph.params().zip(&got) {
            let want = interp.param(id);
            assert!(
                values
                    .iter()
                    .zip(want.iter())
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{model}: {} differs from the interpreter's",
                disk.graph.param(id).name
            );
        }
    }
}

/// `schedule` trained as [`train`] does, but saved after step 2, dropped, and restored into a
/// new executor (a new disk file) for the steps after it.
fn train_resumed_after_step_2(schedule: &VerifiedSchedule, model: &str) -> Trace {
    let config = protrain::models::load(model).unwrap();
    let data = common::batches(config.vocab_size as usize, BATCH, SEQ, STEPS, SEED);
    let (dir, ckpt) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut first = executor(schedule, dir.path());
    first
        .load_params(&init_params(&schedule.graph, SEED))
        .unwrap();
    let mut trace = Vec::new();
    for [x, y] in &data[..2] {
        let report = first.step(&[x, y]).unwrap();
        trace.push(report.loss.to_bits());
        trace.push(report.grad_norm.unwrap().to_bits());
    }
    let progress = Progress {
        step: 2,
        data_step: 2,
        data_tokens: 0,
        scaler: None,
    };
    checkpoint::save(ckpt.path(), &first, &progress).unwrap();
    drop(first);
    let (saved, _) = checkpoint::load_latest(ckpt.path(), schedule).unwrap();
    let mut resumed = executor(schedule, dir.path());
    saved.restore(&mut resumed).unwrap();
    for [x, y] in &data[2..] {
        let report = resumed.step(&[x, y]).unwrap();
        trace.push(report.loss.to_bits());
        trace.push(report.grad_norm.unwrap().to_bits());
    }
    finish(&resumed, trace)
}

/// A checkpoint after step 2 of 4 holds the state on disk: restored into a new executor (a
/// new file), the last two steps give the uninterrupted run's losses, weights and state.
#[test]
fn a_checkpoint_carries_the_state_on_disk() {
    let model = "gpt2-tiny";
    let disk = on_disk(model, DType::BF16);
    let want = train(&disk, model);
    assert_eq!(
        train_resumed_after_step_2(&disk, model),
        want,
        "resumed vs uninterrupted"
    );
}

/// The disk i/o stream of a verified disk schedule, and the index of its first write that
/// is not carried (one after an update in the same step).
fn first_write(s: &Schedule) -> (usize, usize) {
    let io = disk_stream(s);
    let at = s.streams[io]
        .instrs
        .iter()
        .position(|i| matches!(i, Instr::DiskWrite { carried: false, .. }))
        .unwrap();
    (io, at)
}

/// The disk i/o stream of a disk schedule.
fn disk_stream(s: &Schedule) -> usize {
    s.streams
        .iter()
        .position(|st| st.kind == StreamKind::DiskIo)
        .unwrap()
}

/// Mutations the verifier refuses: a write back that no longer waits for the update (the
/// update would be lost, or race the write), and an update that no longer waits for its
/// read (it would read moments not there yet).
#[test]
fn the_verifier_refuses_a_write_before_the_update_and_an_update_before_the_read() {
    let schedule: Schedule = (*on_disk("gpt2-tiny", DType::BF16)).clone();
    let (io, at) = first_write(&schedule);
    let mut early = schedule.clone();
    // The wait for the update moves after the write.
    let wait = early.streams[io].instrs.remove(at - 1);
    assert!(matches!(wait, Instr::Wait { .. }));
    early.streams[io].instrs.insert(at, wait);
    let err = verify(early)
        .expect_err("a write before its update")
        .to_string();
    assert!(
        err.contains("data flow") && err.contains("disk_write"),
        "{err}"
    );

    let mut unread = schedule.clone();
    let opt = unread
        .streams
        .iter()
        .position(|st| st.kind == StreamKind::HostOptimizer)
        .unwrap();
    let first_read = unread.streams[io]
        .instrs
        .iter()
        .position(|i| matches!(i, Instr::DiskRead { .. }))
        .unwrap();
    let Some(Instr::Record { event }) = unread.streams[io].instrs.get(first_read + 1).cloned()
    else {
        panic!("the first read records its event")
    };
    let wait = unread.streams[opt]
        .instrs
        .iter()
        .position(|i| *i == Instr::Wait { event })
        .unwrap();
    unread.streams[opt].instrs.remove(wait);
    // The event must still be waited for somewhere: the compute stream waits at its end.
    unread.streams[0].instrs.push(Instr::Wait { event });
    let err = verify(unread)
        .expect_err("an update before its read")
        .to_string();
    assert!(err.contains("data flow") && err.contains("adamw"), "{err}");
    verify(schedule).unwrap();
}

/// Without a directory the executor refuses to run a disk schedule; a missing directory is
/// named with the way out.
#[test]
fn a_disk_schedule_needs_a_directory() {
    let schedule = on_disk("gpt2-tiny", DType::BF16);
    assert!(schedule.buffers.iter().any(|b| b.space == Space::Disk));
    let mut exec = Executor::new(&schedule).unwrap();
    let err = exec
        .load_params(&init_params(&schedule.graph, SEED))
        .unwrap_err()
        .to_string();
    // The library names the setting (the CLI words it as --disk-dir).
    assert!(
        err.contains("(disk_dir DIR") && !err.contains("--"),
        "{err}"
    );
    let missing = std::env::temp_dir().join("protrain-disk-tier-test-missing");
    let err = exec.set_disk_dir(&missing).unwrap_err().to_string();
    assert!(
        err.contains("protrain-disk-tier-test-missing") && err.contains("mkdir"),
        "{err}"
    );
}

/// A disk tier larger than the free space is refused with the figures before its file exists
/// (it was written with zeros until the disk was full); one that fits is allocated whole.
#[test]
fn a_disk_too_small_is_refused_before_anything_is_written() {
    use protrain::runtime::disk::{DiskFile, DiskIo};
    let dir = tempfile::tempdir().unwrap();
    // What `df` says is free (the runtime asks statvfs, as df does).
    let df = std::process::Command::new("df")
        .args(["-B1", "--output=avail"])
        .arg(dir.path())
        .output()
        .expect("df runs");
    let free: u64 = String::from_utf8_lossy(&df.stdout)
        .lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .expect("df prints the bytes available");
    for io in [DiskIo::Direct, DiskIo::Buffered] {
        let want = free.saturating_add(1 << 40);
        let err = DiskFile::create_with(dir.path(), want, io)
            .unwrap_err()
            .to_string();
        // The library names the setting; the CLI words it as --disk-dir (src/error.rs).
        assert!(
            err.contains("free") && err.contains("a disk_dir on a larger disk"),
            "{err}"
        );
        assert!(
            err.contains(&protrain::ir::format_bytes(want)),
            "names what the schedule needs: {err}"
        );
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "{err}");
    }
    let file = DiskFile::create_with(dir.path(), 8 << 20, DiskIo::Direct).unwrap();
    let meta = std::fs::metadata(file.path()).unwrap();
    assert_eq!(meta.len(), 8 << 20);
    use std::os::unix::fs::MetadataExt;
    assert!(meta.blocks() * 512 >= 8 << 20, "the blocks are reserved");
    let mut back = vec![1u8; 1 << 20];
    file.read(3 << 20, &mut back).unwrap();
    assert!(
        back.iter().all(|&b| b == 0),
        "an allocated file reads as zeros"
    );
}

/// `model` with every model state on disk ([`every_state`](protrain::compiler::disk::every_state)):
/// the optimizer state, the parameter storage and (without accumulation, where the host
/// gradients are summed each micro-batch and stay) the gradient storage of every chunk,
/// under `model`'s tight policy in `layout` (`14`: the gradients land in the parameter
/// storage; `16`: beside it), through rings of `slots` staging buffers.
fn all_on_disk(
    model: &str,
    dtype: DType,
    layout: u32,
    micro_batches: u64,
    slots: usize,
) -> VerifiedSchedule {
    let policy = format!("{TIGHT},host_layout={layout}");
    let host = compile_k(model, dtype, &policy, None, micro_batches);
    assert_eq!(
        host.disk_bytes, 0,
        "{model}: fits the host without the disk"
    );
    let disk = protrain::compiler::disk::every_state((*host).clone(), slots).unwrap();
    let disk = verify(disk).unwrap_or_else(|e| panic!("{model}: {e}"));
    // (Tiny chunks' staging buffers outweigh what they leave: the host region need not
    // shrink here.)
    assert_every_state_on_disk(&disk, model, layout == 16 && micro_batches == 1);
    disk
}

/// Asserts that `disk` keeps every chunk's optimizer state and parameters on disk, and its
/// separate gradients where `grads`.
fn assert_every_state_on_disk(disk: &Schedule, model: &str, grads: bool) {
    use protrain::ir::BufferKind;
    let on_disk = |kind: fn(&BufferKind) -> bool| {
        let of_kind: Vec<_> = disk.buffers.iter().filter(|b| kind(&b.kind)).collect();
        !of_kind.is_empty() && of_kind.iter().all(|b| b.space == Space::Disk)
    };
    assert!(on_disk(|k| matches!(k, BufferKind::OptimizerState { .. })));
    assert!(
        on_disk(|k| matches!(k, BufferKind::HostChunk { .. })),
        "{model}: every chunk's parameters on disk"
    );
    if grads {
        assert!(
            on_disk(|k| matches!(k, BufferKind::HostGradChunk { .. })),
            "{model}: every chunk's gradients on disk"
        );
    }
}

/// Where the host budget is the least the disk tier can leave, the compiler moves every
/// chunk's parameters (and the gradients that land in them) to disk after their optimizer
/// state, and the schedule trains bit for bit as in host memory.
#[test]
fn the_compiler_moves_the_parameters_where_the_state_is_not_enough() {
    let model = "gpt2-tiny";
    let policy = format!("{TIGHT},host_layout=14");
    let host = compile(model, DType::BF16, &policy, None);
    let (least, _) = protrain::compiler::disk::least_host(&host).unwrap();
    let disk = compile(model, DType::BF16, &policy, Some(least));
    assert!(disk.host_bytes <= least);
    assert_every_state_on_disk(&disk, model, false);
    assert_eq!(train(&disk, model), train(&host, model));
}

/// Every model state on disk (parameters, gradients, master weights, moments), read into
/// staging buffers before each upload and update and written back after, trains bit for bit
/// as the same policy in host memory: bf16 in the 14-byte layout, f32 in the 16-byte one.
#[test]
fn every_state_on_disk_trains_bit_identically() {
    for model in ["gpt2-tiny", "llama-tiny"] {
        for (dtype, layout) in [(DType::BF16, 14), (DType::F32, 16)] {
            let disk = all_on_disk(model, dtype, layout, 1, 2);
            let policy = format!("{TIGHT},host_layout={layout}");
            let host = compile(model, dtype, &policy, None);
            assert_eq!(
                train(&disk, model),
                train(&host, model),
                "{model} {dtype}: every state on disk trains differently from host memory"
            );
        }
    }
}

/// Accumulation with the parameters and optimizer state on disk: the uploads of each
/// micro-batch read the parameters from disk, the update reads and writes them once.
#[test]
fn accumulating_with_every_state_on_disk_trains_bit_identically() {
    for model in ["gpt2-tiny", "llama-tiny"] {
        let disk = all_on_disk(model, DType::BF16, 14, 2, 2);
        assert_eq!(disk.micro_batches(), 2);
        let host = compile_k(
            model,
            DType::BF16,
            &format!("{TIGHT},host_layout=14"),
            None,
            2,
        );
        assert_eq!(
            train(&disk, model),
            train(&host, model),
            "{model}: accumulating with every state on disk trains differently"
        );
    }
}

/// A checkpoint of a run with every state on disk, restored into a new executor (a new
/// file), continues as the uninterrupted run.
#[test]
fn a_checkpoint_carries_every_state_on_disk() {
    let model = "llama-tiny";
    let disk = all_on_disk(model, DType::BF16, 14, 1, 1);
    let want = train(&disk, model);
    assert_eq!(
        train_resumed_after_step_2(&disk, model),
        want,
        "resumed vs uninterrupted"
    );
}

/// `schedule` with the wait at `(stream, at)` moved to the end of the compute stream (so the
/// event is still waited for), verified: the error, as text.
fn without_wait(schedule: &Schedule, stream: usize, at: usize) -> String {
    let mut s = schedule.clone();
    let wait = s.streams[stream].instrs.remove(at);
    assert!(matches!(wait, Instr::Wait { .. }), "{wait:?}");
    s.streams[0].instrs.push(wait);
    verify(s).expect_err("a missing wait").to_string()
}

/// The stream that records `event`, and the instruction before the record.
fn recorded_after(s: &Schedule, event: protrain::ir::EventId) -> (usize, Instr) {
    s.streams
        .iter()
        .enumerate()
        .find_map(|(i, st)| {
            let at = st
                .instrs
                .iter()
                .position(|x| *x == Instr::Record { event })?;
            Some((i, st.instrs[at - 1].clone()))
        })
        .expect("recorded")
}

/// Mutations of a schedule with every state on disk that the verifier refuses: a write to
/// disk of offloaded gradients that no longer waits for the offload (it would write what
/// the staging buffer held before), an upload that no longer waits for the read of its
/// parameters from disk (it would upload what the staging buffer held before), and an
/// offload into a staging buffer that no longer waits for the write of the gradients it held
/// (the offload would overwrite them while the write reads them).
#[test]
fn the_verifier_refuses_missing_waits_around_parameters_and_gradients_on_disk() {
    use protrain::ir::{BufferKind, CopyKind};
    let schedule: Schedule = (*all_on_disk("gpt2-tiny", DType::BF16, 14, 1, 2)).clone();
    let stream_of = |kind: StreamKind| {
        schedule
            .streams
            .iter()
            .position(|st| st.kind == kind)
            .unwrap()
    };
    let (io, h2d, d2h) = (
        stream_of(StreamKind::DiskIo),
        stream_of(StreamKind::HostToDevice),
        stream_of(StreamKind::DeviceToHost),
    );
    let kind = |t: protrain::ir::TensorRef| schedule.buffers[t.buffer.index()].kind;
    // The first write of gradients to disk, after its wait for the offload.
    let write = schedule.streams[io]
        .instrs
        .iter()
        .position(|i| {
            matches!(i, Instr::DiskWrite { dst, .. } if matches!(kind(*dst), BufferKind::HostChunk { .. }))
        })
        .unwrap();
    let err = without_wait(&schedule, io, write - 1);
    assert!(
        err.contains("data flow") && err.contains("disk_write"),
        "{err}"
    );
    // The first upload, after its wait for the read.
    let upload = schedule.streams[h2d]
        .instrs
        .iter()
        .position(|i| {
            matches!(
                i,
                Instr::Copy {
                    what: CopyKind::FetchChunk { .. },
                    ..
                }
            )
        })
        .unwrap();
    let Instr::Wait { event } = schedule.streams[h2d].instrs[upload - 1] else {
        panic!("an upload from disk waits for its read")
    };
    assert!(matches!(recorded_after(&schedule, event), (s, Instr::DiskRead { .. }) if s == io));
    let err = without_wait(&schedule, h2d, upload - 1);
    assert!(err.contains("data flow") && err.contains("fetch"), "{err}");
    // The first offload that reuses a staging buffer waits for the write of the one
    // before it there.
    let reuse = schedule.streams[d2h]
        .instrs
        .iter()
        .enumerate()
        .position(|(at, i)| {
            matches!(i, Instr::Wait { event }
                if matches!(recorded_after(&schedule, *event), (s, Instr::DiskWrite { .. }) if s == io))
                && at + 1 < schedule.streams[d2h].instrs.len()
        })
        .unwrap();
    let err = without_wait(&schedule, d2h, reuse);
    assert!(err.contains("data flow"), "{err}");
    verify(schedule).unwrap();
}

/// `schedule` with the write-backs that end its disk program carried into the next step
/// ([`protrain::compiler::carry::carried`], whether or not that shortens the step),
/// verified: at least one write is carried.
fn carry(schedule: &Schedule) -> VerifiedSchedule {
    let out = protrain::compiler::carry::carried(schedule).expect("write-backs to carry");
    let out = verify(out).unwrap_or_else(|e| panic!("the carried schedule: {e}"));
    assert!(out.carried_writes() > 0);
    out
}

/// `model`'s tight policy with every chunk's optimizer state on disk (as [`on_disk_k`]), in
/// the plain order (the disk pass alone) and with its last write-backs carried.
fn plain_and_carried(
    model: &str,
    dtype: DType,
    micro_batches: u64,
) -> (VerifiedSchedule, VerifiedSchedule) {
    let host = compile_k(model, dtype, TIGHT, None, micro_batches);
    let budget = on_disk_k(model, dtype, micro_batches).host_bytes;
    let disk = parse_size("64MiB").unwrap();
    let plain = protrain::compiler::disk::disk((*host).clone(), budget, disk).unwrap();
    let plain = verify(plain).unwrap();
    assert_eq!(plain.carried_writes(), 0);
    assert_eq!(plain.disk_chunks().len(), plain.chunks.len());
    let carried = carry(&plain);
    (plain, carried)
}

/// Carried write-backs (the last chunks' state written as the next step starts, beside its
/// forward pass) train bit for bit as the plain order and as every chunk resident, over
/// several steps: the first step skips them (nothing to write yet), every later one runs
/// them first, and reading the weights and state after the last step runs them once. With
/// every state on disk (the uploads' parameters too) as well.
#[test]
fn carried_write_backs_train_bit_identically() {
    for model in ["gpt2-tiny", "llama-tiny"] {
        let (plain, carried) = plain_and_carried(model, DType::BF16, 1);
        let want = train(&compile(model, DType::BF16, "", None), model);
        assert_eq!(train(&plain, model), want, "{model}: plain vs resident");
        assert_eq!(
            train(&carried, model),
            want,
            "{model}: carried write-backs train differently"
        );
        for (dtype, layout) in [(DType::BF16, 14), (DType::F32, 16)] {
            let every = carry(&all_on_disk(model, dtype, layout, 1, 2));
            let host = compile(model, dtype, &format!("{TIGHT},host_layout={layout}"), None);
            assert_eq!(
                train(&every, model),
                train(&host, model),
                "{model} {dtype}: every state on disk, carried, trains differently"
            );
        }
    }
}

/// With accumulation the carried write-backs run once a step, before its first
/// micro-batch: two micro-batches per step train bit for bit as the plain order and as
/// every chunk resident, the state alone or every state on disk.
#[test]
fn accumulating_with_carried_write_backs_trains_bit_identically() {
    for model in ["gpt2-tiny", "llama-tiny"] {
        let (plain, carried) = plain_and_carried(model, DType::BF16, 2);
        assert_eq!(carried.micro_batches(), 2);
        let want = train(&compile_k(model, DType::BF16, "", None, 2), model);
        assert_eq!(train(&plain, model), want, "{model}: plain vs resident");
        assert_eq!(
            train(&carried, model),
            want,
            "{model}: accumulating with carried write-backs trains differently"
        );
        let every = carry(&all_on_disk(model, DType::BF16, 14, 2, 2));
        let host = compile_k(
            model,
            DType::BF16,
            &format!("{TIGHT},host_layout=14"),
            None,
            2,
        );
        assert_eq!(
            train(&every, model),
            train(&host, model),
            "{model}: every state"
        );
    }
}

/// A checkpoint taken while write-backs are carried holds the updated state (saving runs
/// them first), and the resumed run, whose first step has nothing to write back, gives the
/// uninterrupted run's losses, weights and state.
#[test]
fn a_checkpoint_with_write_backs_carried_resumes_bit_identically() {
    for model in ["gpt2-tiny", "llama-tiny"] {
        let (plain, carried) = plain_and_carried(model, DType::BF16, 1);
        let want = train(&plain, model);
        assert_eq!(train(&carried, model), want);
        assert_eq!(
            train_resumed_after_step_2(&carried, model),
            want,
            "{model}: resumed vs uninterrupted"
        );
    }
}

/// The pipeline carries write-backs where the step is shorter for it: gpt2-tiny's step with
/// every chunk's state on disk ends with the disk writing the last updates back (the disk
/// bounds its end), so its schedule has carried writes, and its simulated step is shorter
/// than the same schedule's in the plain order.
#[test]
fn the_pipeline_carries_write_backs_where_the_step_is_shorter() {
    let model = "gpt2-tiny";
    let budget = on_disk(model, DType::BF16).host_bytes;
    let config = protrain::models::load(model).unwrap();
    let hardware = HardwareProfile::preset("host")
        .unwrap()
        .with_host_memory(budget);
    let options = CompileOptions {
        batch: BATCH,
        seq: SEQ,
        dtype: DType::BF16,
        policy: PolicyChoice::parse(TIGHT).unwrap(),
        optimizer: OptimizerConfig {
            grad_clip: Some(1.0),
            ..Default::default()
        },
        ..CompileOptions::for_hardware(hardware.clone().with_disk_memory(1 << 26))
    };
    let compiled = protrain::compile(&config, &options).unwrap().schedule;
    assert!(
        compiled.carried_writes() > 0,
        "the disk-bound schedule carries"
    );
    let cost = protrain::compiler::cost::cost_model(&hardware);
    let step = |s: &Schedule| {
        protrain::compiler::simulate::simulate_unverified(s, cost.as_ref())
            .unwrap()
            .step_seconds
    };
    let host = compile(model, DType::BF16, TIGHT, None);
    let plain = protrain::compiler::disk::disk((*host).clone(), budget, 1 << 26).unwrap();
    let (with, without) = (step(&compiled), step(&plain));
    assert!(
        with < without,
        "carried {with} s, plain {without} s: carrying shortens the disk-bound step"
    );
    assert_eq!(compiled.header.prediction.step_seconds, with);
}

/// Mutations of carried writes the verifier refuses: a write carried although its staging
/// buffer is used again later in the step (the next chunk is read into it: the write would
/// put that chunk's state on this chunk's place on disk), and a carried write moved after
/// a read of the same chunk (it would run after the read, which would find the state not
/// yet written back).
#[test]
fn the_verifier_refuses_malformed_carried_writes() {
    let (plain, carried) = plain_and_carried("gpt2-tiny", DType::BF16, 1);
    let (io, at) = first_write(&plain);
    let mut reused: Schedule = (*plain).clone();
    let Instr::DiskWrite {
        chunk,
        src,
        dst,
        bytes,
        ..
    } = reused.streams[io].instrs.remove(at)
    else {
        unreachable!()
    };
    let later_read = reused.streams[io].instrs[at..]
        .iter()
        .any(|i| matches!(i, Instr::DiskRead { dst: d, .. } if d.buffer == src.buffer));
    assert!(
        later_read,
        "the staging buffer is read into again later in the step"
    );
    reused.streams[io].instrs.insert(
        0,
        Instr::DiskWrite {
            chunk,
            src,
            dst,
            bytes,
            carried: true,
        },
    );
    let err = verify(reused)
        .expect_err("a reused staging buffer")
        .to_string();
    assert!(
        (err.contains("end of step") || err.contains("data flow")) && err.contains("carried"),
        "{err}"
    );

    let mut late: Schedule = (*carried).clone();
    let io = disk_stream(&late);
    let write = late.streams[io].instrs.remove(0);
    let Instr::DiskWrite { chunk, .. } = write else {
        unreachable!()
    };
    let read = late.streams[io]
        .instrs
        .iter()
        .position(|i| matches!(i, Instr::DiskRead { chunk: c, .. } if *c == chunk))
        .expect("the chunk is read in the step");
    late.streams[io].instrs.insert(read + 1, write);
    let err = verify(late)
        .expect_err("a carried write after a read")
        .to_string();
    assert!(err.contains("ids") && err.contains("carried"), "{err}");
    verify((*carried).clone()).unwrap();
}

/// The printed disk stream of a schedule with carried writes: the stream says how many it
/// carries, and each carried write says what it writes when, at the head of the stream.
#[test]
fn carried_writes_print_at_the_head_of_the_disk_stream() {
    let (_, carried) = plain_and_carried("gpt2-tiny", DType::BF16, 1);
    let text = protrain::ir::print_schedule::print_schedule(&carried);
    let disk: Vec<&str> = text
        .lines()
        .skip_while(|l| !(l.starts_with("stream") && l.contains("(disk i/o)")))
        .take_while(|l| !l.is_empty())
        .collect();
    insta::assert_snapshot!("carried_disk_stream", disk.join("\n"));
}

/// On the CUDA backend (its disk stream a host thread, as the host backend's), carried
/// write-backs train bit for bit as the plain order does there: losses, gradient norms,
/// final weights and optimizer state.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU or the CUDA simulator"]
fn carried_write_backs_train_on_the_device_as_the_plain_order() {
    use protrain_runtime::cuda::CudaBackend;
    if let Err(why) = protrain_runtime::cuda::available() {
        panic!("no CUDA device is available: {why}; scripts/gpu-check.sh runs this on one");
    }
    for model in ["gpt2-tiny", "llama-tiny"] {
        let (plain, carried) = plain_and_carried(model, DType::BF16, 1);
        assert_eq!(
            train_on::<CudaBackend>(&carried, model),
            train_on::<CudaBackend>(&plain, model),
            "{model}: carried write-backs train differently on the device"
        );
    }
}
