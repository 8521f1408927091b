//! NCCL on a GPU, in a world of one rank (one H200 cannot host two NCCL ranks): the same path a
//! multi-GPU run takes (rendezvous, `ncclCommInitRank`, the collectives at raw device
//! addresses), where every collective must copy its input exactly.
//!
//! Every test needs a device and libnccl, so each is
//! `#[ignore = "needs a GPU or the CUDA simulator"]`: `cuda-sim/ci.sh` runs them on the
//! simulator (whose libnccl runs real processes' collectives through shared memory) and
//! `scripts/gpu-check.sh` on a GPU, both with `--include-ignored`. Where neither is, a test
//! fails naming what is missing; it never passes by returning early.

use cudarc::driver::{CudaContext, DevicePtr, DevicePtrMut};
use protrain_ir::DType;
use protrain_runtime::cuda::available;
use protrain_runtime::cuda::nccl::{probe, NcclCall, NcclComm, NcclOp};
use protrain_runtime::rendezvous::Launch;
use std::time::Duration;

/// Fails the test, naming what is missing, unless a device (a GPU or the simulator) and
/// libnccl are both here.
fn require_nccl() {
    if let Err(why) = available() {
        panic!("no CUDA device is available: {why}");
    }
    if let Err(e) = probe() {
        panic!("no NCCL: {e}");
    }
}

#[test]
#[ignore = "needs a GPU or the CUDA simulator"]
fn a_world_of_one_runs_every_collective() {
    require_nccl();
    let ctx = CudaContext::new(0).expect("available() found a GPU");
    ctx.bind_to_thread().unwrap();
    let stream = ctx.new_stream().unwrap();
    let mut comm = NcclComm::connect(&Launch::single(), Duration::from_secs(30)).unwrap();
    assert_eq!((comm.rank(), comm.world()), (0, 1));

    let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.25 - 7.0).collect();
    for op in [
        NcclOp::AllReduceSum,
        NcclOp::AllGather,
        NcclOp::ReduceScatterSum,
    ] {
        let call = NcclCall::plan(op, DType::F32, values.len(), 1).unwrap();
        let send = stream.clone_htod(&values).unwrap();
        let mut recv = stream.alloc_zeros::<f32>(values.len()).unwrap();
        {
            let (from, _a) = send.device_ptr(&stream);
            let (to, _b) = recv.device_ptr_mut(&stream);
            // SAFETY: both buffers hold `values.len()` f32 on this context, alive until the
            // stream is synchronised below.
            unsafe { comm.enqueue(&call, from, to, stream.cu_stream()) }.unwrap();
        }
        stream.synchronize().unwrap();
        assert_eq!(stream.clone_dtoh(&recv).unwrap(), values, "{op:?}");
    }
}

/// The CUDA backend's collectives (as a data-parallel schedule's collective stream issues
/// them) through a rank of one: in place at arena addresses on a collective stream, with the
/// rank's host collectives (the loss gather) staged through the GPU; each must leave its data
/// exactly as it was, since a world of one copies.
#[test]
#[ignore = "needs a GPU or the CUDA simulator"]
fn the_backend_runs_in_place_collectives_through_a_rank_of_one() {
    use protrain_ir::{Space, StreamKind};
    use protrain_runtime::backend::Address;
    use protrain_runtime::collective::Collective;
    use protrain_runtime::cuda::nccl::NcclRank;
    use protrain_runtime::cuda::CudaBackend;
    use protrain_runtime::Backend;
    require_nccl();
    let mut rank = NcclRank::connect(&Launch::single(), Duration::from_secs(30)).unwrap();
    assert_eq!((rank.rank(), rank.world()), (0, 1));
    let mut backend = CudaBackend::new(1 << 16, 0, 0).expect("the CUDA backend starts");
    let values: Vec<f32> = (0..1024).map(|i| (i as f32).sin() * 3.0).collect();
    let at = Address {
        space: Space::Device,
        offset: 4096,
    };
    backend.write_f32(at, &values).unwrap();
    let mut stream = backend
        .create_stream(StreamKind::Collective { gpus: 1, nodes: 1 })
        .expect("a collective stream");
    // SAFETY: nothing else touches the arena while the stream runs; synchronised below.
    unsafe {
        backend
            .all_reduce(&mut stream, at, DType::F32, values.len(), &mut rank)
            .unwrap();
        backend
            .all_gather(&mut stream, at, 4 * 1024, &mut rank)
            .unwrap();
        backend
            .reduce_scatter(&mut stream, at, DType::F32, values.len(), &mut rank)
            .unwrap();
        backend
            .all_reduce(&mut stream, at, DType::BF16, 2 * values.len(), &mut rank)
            .unwrap();
    }
    backend.synchronize(&mut stream).unwrap();
    let mut back = vec![0.0f32; values.len()];
    backend.read_f32(at, &mut back).unwrap();
    assert_eq!(back, values);
    // The host collectives the executor makes between steps.
    let losses: Vec<u8> = [1.5f32, -2.25]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let mut all = vec![0u8; losses.len()];
    rank.all_gather(&losses, &mut all).unwrap();
    assert_eq!(all, losses);
    let mut sums = [0.5f32, 7.0];
    rank.all_reduce(&mut sums).unwrap();
    assert_eq!(sums, [0.5, 7.0]);
    // Outside the arena: refused, naming the arena.
    let outside = Address {
        space: Space::Device,
        offset: 1 << 16,
    };
    // SAFETY: refused before anything is enqueued.
    let e = unsafe { backend.all_reduce(&mut stream, outside, DType::F32, 4, &mut rank) };
    assert!(e.unwrap_err().to_string().contains("device arena"));
}

/// Marks a child process of the multi-process tests below; its value names what the child does.
const CHILD: &str = "PROTRAIN_NCCL_TEST_CHILD";

/// A port nothing listens on now.
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind to port 0");
    listener.local_addr().unwrap().port()
}

/// Starts rank `rank` of `world` as a child running `test` as `role`, as the launcher starts
/// a worker (torchrun's variables), its stdout piped.
fn spawn_rank(test: &str, role: &str, rank: usize, world: usize, port: u16) -> std::process::Child {
    std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args([
            test,
            "--exact",
            "--nocapture",
            "--include-ignored",
            "--test-threads=1",
        ])
        .env(CHILD, role)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("PROTRAIN_NCCL_TIMEOUT", "120")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("re-execute the test binary")
}

/// In a child: this process's rank, its NCCL rank and a CUDA backend on its GPU.
fn child_rank() -> (
    protrain_runtime::cuda::nccl::NcclRank,
    protrain_runtime::cuda::CudaBackend,
) {
    use protrain_runtime::cuda::nccl::NcclRank;
    use protrain_runtime::Backend;
    let launch = Launch::from_env()
        .unwrap()
        .expect("the test sets RANK and WORLD_SIZE");
    let rank = NcclRank::connect(&launch, Duration::from_secs(60)).unwrap();
    let backend = protrain_runtime::cuda::CudaBackend::new(8 << 20, 0, 0).unwrap();
    (rank, backend)
}

/// What each rank of the two-process test contributes: distinct per rank and element, with
/// values whose sums are exact in every type.
fn contribution(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i % 61) as f32 - 30.0) * 0.25 + rank as f32 * 64.0)
        .collect()
}

/// In a child of the two-process test: the backend's in-place collectives at arena addresses
/// on a collective stream (f32, bf16, a gather, a scatter), then the host collectives, each
/// checked against the sum or concatenation computed here from every rank's contribution.
fn two_rank_child() {
    use protrain_ir::{Space, StreamKind};
    use protrain_runtime::backend::Address;
    use protrain_runtime::collective::Collective;
    use protrain_runtime::Backend;
    let (mut rank, mut backend) = child_rank();
    let (me, world) = (rank.rank(), rank.world());
    // Longer than one of the simulator's 4 MiB slots, so the data moves in several pieces.
    let n = (3 << 20) / 2 + 10;
    let at = Address {
        space: Space::Device,
        offset: 0,
    };
    let all: Vec<Vec<f32>> = (0..world).map(|r| contribution(r, n)).collect();
    let sum: Vec<f32> = (0..n).map(|i| all.iter().map(|v| v[i]).sum()).collect();
    let mut stream = backend
        .create_stream(StreamKind::Collective { gpus: 2, nodes: 1 })
        .unwrap();
    let mut back = vec![0.0f32; n];
    // All-reduce of f32.
    backend.write_f32(at, &all[me]).unwrap();
    // SAFETY: nothing else touches the arena; synchronised before it is read.
    unsafe { backend.all_reduce(&mut stream, at, DType::F32, n, &mut rank) }.unwrap();
    backend.synchronize(&mut stream).unwrap();
    backend.read_f32(at, &mut back).unwrap();
    assert_eq!(back, sum, "all-reduce on rank {me}");
    // All-gather: each rank's half in place.
    let half = n / 2;
    let mut mine = back.clone();
    let gathered: Vec<f32> = (0..n).map(|i| all[i / half][i]).collect();
    mine[me * half..(me + 1) * half].copy_from_slice(&all[me][me * half..(me + 1) * half]);
    backend.write_f32(at, &mine).unwrap();
    // SAFETY: as above.
    unsafe { backend.all_gather(&mut stream, at, 4 * half as u64, &mut rank) }.unwrap();
    backend.synchronize(&mut stream).unwrap();
    backend.read_f32(at, &mut back).unwrap();
    assert_eq!(back, gathered, "all-gather on rank {me}");
    // Reduce-scatter: rank r keeps the sum of slice r, in place.
    backend.write_f32(at, &all[me]).unwrap();
    // SAFETY: as above.
    unsafe { backend.reduce_scatter(&mut stream, at, DType::F32, half, &mut rank) }.unwrap();
    backend.synchronize(&mut stream).unwrap();
    backend.read_f32(at, &mut back).unwrap();
    assert_eq!(
        back[me * half..(me + 1) * half],
        sum[me * half..(me + 1) * half],
        "reduce-scatter on rank {me}"
    );
    // Host values between steps: the losses gathered, partial norms summed.
    let loss = [me as f32 + 0.5];
    let mut losses = vec![0u8; 4 * world];
    rank.all_gather(&loss[0].to_le_bytes(), &mut losses)
        .unwrap();
    let losses: Vec<f32> = losses
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(losses, [0.5, 1.5]);
    let mut norms = [me as f32 * 2.0 + 1.0, -3.0];
    rank.all_reduce(&mut norms).unwrap();
    assert_eq!(norms, [4.0, -6.0]);
    println!("\nRANK {me} OK");
}

/// In the killed-rank test: rank 1 joins and then waits to be killed; rank 0 starts an
/// all-reduce that rank 1 never joins and prints how it ended.
fn killed_rank_child() {
    use protrain_runtime::collective::Collective;
    let (mut rank, _backend) = child_rank();
    println!("\nJOINED {}", rank.rank());
    if rank.rank() == 1 {
        std::thread::sleep(Duration::from_secs(300));
        return;
    }
    let started = std::time::Instant::now();
    let mut values = [1.0f32; 64];
    match rank.all_reduce(&mut values) {
        Ok(()) => println!("\nUNEXPECTED the all-reduce finished without rank 1"),
        Err(e) => println!(
            "\nFAILED after {:.1} s: {}",
            started.elapsed().as_secs_f64(),
            e.to_string().replace('\n', " ")
        ),
    }
}

/// Runs the child's part when this process is one (then exits); nothing in the test process.
fn run_child_if_asked() {
    let Ok(role) = std::env::var(CHILD) else {
        return;
    };
    match role.as_str() {
        "two" => two_rank_child(),
        "killed" => killed_rank_child(),
        other => panic!("unknown child role {other}"),
    }
    std::process::exit(0);
}

/// Two real processes, as `protrain train --backend cuda --gpus 2` starts them: the
/// rendezvous, NCCL's communicator, and every collective the CUDA backend issues (in place on
/// device memory, several of the simulator's staging pieces long) and the executor's host
/// collectives, each rank checking the exact sums and concatenations of both ranks' data.
#[test]
#[ignore = "needs a GPU or the CUDA simulator"]
fn two_processes_run_every_collective_of_the_backend() {
    run_child_if_asked();
    require_nccl();
    let test = "nccl::two_processes_run_every_collective_of_the_backend";
    let port = free_port();
    let children: Vec<_> = (0..2)
        .map(|r| spawn_rank(test, "two", r, 2, port))
        .collect();
    for (r, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains(&format!("RANK {r} OK")),
            "rank {r} ({}): {stdout}",
            out.status
        );
    }
}

/// A rank killed (SIGKILL) while the other waits in a collective: the survivor's wait ends
/// with NCCL's remote error (`ncclRemoteError`, through `ncclCommGetAsyncError`) within
/// seconds, not at its timeout and not never.
#[test]
#[ignore = "needs a GPU or the CUDA simulator"]
fn a_rank_killed_mid_collective_fails_the_other_with_nccls_error() {
    use std::io::{BufRead, BufReader};
    run_child_if_asked();
    require_nccl();
    let test = "nccl::a_rank_killed_mid_collective_fails_the_other_with_nccls_error";
    let port = free_port();
    let mut zero = spawn_rank(test, "killed", 0, 2, port);
    let mut one = spawn_rank(test, "killed", 1, 2, port);
    // Rank 1 is killed once it has joined the communicator.
    let mut lines = BufReader::new(one.stdout.take().unwrap()).lines();
    assert!(
        lines.any(|l| l.is_ok_and(|l| l.starts_with("JOINED"))),
        "rank 1 never joined"
    );
    std::thread::sleep(Duration::from_millis(500));
    one.kill().unwrap();
    let started = std::time::Instant::now();
    let mut stdout = String::new();
    std::io::Read::read_to_string(&mut zero.stdout.take().unwrap(), &mut stdout).unwrap();
    zero.wait().unwrap();
    one.wait().unwrap();
    assert!(
        stdout.contains("FAILED") && stdout.contains("ncclRemoteError"),
        "rank 0: {stdout}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "rank 0 took {:?} to notice",
        started.elapsed()
    );
}
