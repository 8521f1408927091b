//! NCCL on a GPU, in a world of one rank (one H200 cannot host two NCCL ranks): the same path a
//! multi-GPU run takes (rendezvous, `ncclCommInitRank`, the collectives at raw device
//! addresses), where every collective must copy its input exactly. Without a GPU or without
//! libnccl it checks that the refusal names what is missing, as `cuda_probe.rs` does.

use cudarc::driver::{CudaContext, DevicePtr, DevicePtrMut};
use protrain_ir::DType;
use protrain_runtime::cuda::available;
use protrain_runtime::cuda::nccl::{probe, NcclCall, NcclComm, NcclOp};
use protrain_runtime::rendezvous::Launch;
use std::time::Duration;

#[test]
fn a_world_of_one_runs_every_collective_or_names_what_is_missing() {
    if let Err(why) = available() {
        assert!(
            why.contains("--backend host") || why.contains("nvrtc-env.sh"),
            "{why}"
        );
        return;
    }
    if let Err(e) = probe() {
        let message = e.to_string();
        assert!(message.contains("nvidia-nccl-cu13"), "{message}");
        return;
    }
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
/// exactly as it was, since a world of one copies. Without a GPU or libnccl it checks the
/// refusal, as the test above does.
#[test]
fn the_backend_runs_in_place_collectives_through_a_rank_of_one() {
    use protrain_ir::{Space, StreamKind};
    use protrain_runtime::backend::Address;
    use protrain_runtime::collective::Collective;
    use protrain_runtime::cuda::nccl::NcclRank;
    use protrain_runtime::cuda::CudaBackend;
    use protrain_runtime::Backend;
    if available().is_err() || probe().is_err() {
        // What is missing was named by the test above.
        return;
    }
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
