//! NCCL on a GPU, in a world of one rank (one H200 cannot host two NCCL ranks): the same path a
//! multi-GPU run takes (rendezvous, `ncclCommInitRank`, the collectives at raw device
//! addresses), where every collective must copy its input exactly. Without a GPU or without
//! libnccl it checks that the refusal names what is missing, as `cuda_probe.rs` does.
#![cfg(feature = "cuda")]

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
