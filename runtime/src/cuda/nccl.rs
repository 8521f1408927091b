//! NCCL collectives for the CUDA backend: a communicator made through the rendezvous, and the
//! all-reduce, all-gather and reduce-scatter a data-parallel schedule issues, on device memory.
//!
//! A collective is first planned as data ([`NcclCall::plan`]: NCCL's count argument and the
//! bytes each side touches, checked against the world size), which CPU-only builds test; the
//! feature-gated [`NcclComm`] only hands a plan to NCCL with the buffers' device addresses and
//! a CUDA stream. One process drives one GPU and one rank (NCCL's "one device per process"
//! mode): rank 0 makes the 128-byte unique id, [`crate::rendezvous::share_blob`] hands it to
//! every rank, and each calls `ncclCommInitRank` with its rank. A world of one rank takes the
//! same path (the rendezvous then exchanges nothing), so one GPU checks it.
//!
//! **Reduction order.** NCCL sums bf16 and f16 natively and picks its algorithm (ring, tree,
//! NVLS) and channel count from the topology and the message size, so the order in which the
//! ranks' values are added differs from the host backend's rank order (`((x0 + x1) + x2)...`,
//! see [`crate::collective`]). CUDA data parallelism is therefore deterministic for a given NCCL
//! version, topology and configuration (fix `NCCL_ALGO` and `NCCL_PROTO` to pin it), but not
//! bit-identical to the host backend's data parallelism; a world of one rank is exact (NCCL
//! copies). bf16 and f16 sums are rounded per NCCL step, not once from f32 as the host does.
//! Ranks that accumulate micro-batches sum each one's gradients over the ranks into their
//! accumulators: the host backend adds every rank's gradient to the accumulator one by one
//! (`((acc + g0) + g1) + ...`, one rank's accumulation order); NCCL cannot start a sum from
//! a destination's value, so the CUDA backend all-reduces the gradient in place and its
//! `accumulate_grad` kernel adds the sum to the accumulator (`acc + (g0 + g1 + ...)`, the
//! [`Backend::all_reduce_into`](crate::Backend::all_reduce_into) default), and
//! [`NcclRank`]'s host `all_reduce_into` is the trait's default, an all-reduce into a
//! temporary added to the destination: neither promises a single rank's bits.
//!
//! **Failures.** A peer that dies mid-collective on another node leaves this rank's NCCL
//! kernels waiting for data that never comes. So once a rank has issued a collective, the
//! CUDA backend's host waits poll ([`poll_until`]) and ask NCCL for asynchronous errors
//! between polls ([`NcclWatch`]): an error, or a wait longer than [`TIMEOUT_VAR`], aborts
//! the communicator (its kernels exit) and fails the step with what was seen.
//!
//! **Loading libnccl.** cudarc loads NCCL at run time, trying `libnccl.so`, `libnccl64.so`,
//! `libnccl64_13.so` and similar, then `libnccl.so.13`, `.12`, `.11`, `.10`, `.9` and `.1`
//! ([`LIBRARY_NAMES`]), but never `libnccl.so.2`, NCCL's real soname, which is the only file
//! the `nvidia-nccl-cu13` wheel installs (in `site-packages/nvidia/nccl/lib`). So after
//! `pip install nvidia-nccl-cu13`, link `libnccl.so` to `libnccl.so.2` in a folder of your own
//! and put that folder on `LD_LIBRARY_PATH` (`scripts/gpu-check.sh` shows how). A system NCCL
//! (the `libnccl2` and `libnccl-dev` packages) provides `libnccl.so` itself.

use crate::error::{Result, RuntimeError};
use protrain_ir::DType;
use std::time::{Duration, Instant};

/// The file names cudarc 0.19 tries, in order, when it loads NCCL (`get_lib_name_candidates`
/// for "nccl" on 64-bit Linux with CUDA 13.0).
pub const LIBRARY_NAMES: &[&str] = &[
    "libnccl.so",
    "libnccl64.so",
    "libnccl64_13.so",
    "libnccl64_130.so",
    "libnccl64_130_0.so",
    "libnccl64_130_0.so",
    "libnccl64_10.so",
    "libnccl64_11.so",
    "libnccl64_12.so",
    "libnccl64_130_0.so",
    "libnccl64_9.so",
    "libnccl.so.13",
    "libnccl.so.12",
    "libnccl.so.11",
    "libnccl.so.10",
    "libnccl.so.9",
    "libnccl.so.1",
];

/// What to do when libnccl cannot be loaded.
pub const SETUP_HINT: &str = "install NCCL with `pip install nvidia-nccl-cu13`, then, since \
    the wheel ships only libnccl.so.2 and cudarc looks for libnccl.so, run `ln -s \
    <site-packages>/nvidia/nccl/lib/libnccl.so.2 <dir>/libnccl.so` and put <dir> on \
    LD_LIBRARY_PATH (or install the system packages libnccl2 and libnccl-dev); or run on one \
    GPU, or use --backend host";

/// A collective a data-parallel schedule issues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NcclOp {
    /// Every rank's buffer replaced by the sum over ranks (in place).
    AllReduceSum,
    /// Every rank's shard, concatenated in rank order into every rank's whole buffer.
    AllGather,
    /// The sum over ranks of every rank's whole buffer, rank `r` keeping shard `r`.
    ReduceScatterSum,
}

/// One NCCL call as data: what [`NcclComm`] passes to NCCL, and the bytes each buffer must
/// hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NcclCall {
    /// The collective.
    pub op: NcclOp,
    /// The element type.
    pub dtype: DType,
    /// NCCL's count argument: all elements for an all-reduce, one shard's for an all-gather
    /// (`sendcount`) and a reduce-scatter (`recvcount`).
    pub count: usize,
    /// Bytes read from the send buffer.
    pub send_bytes: usize,
    /// Bytes written to the receive buffer.
    pub recv_bytes: usize,
}

impl NcclCall {
    /// The call for `op` over a whole (unsharded) buffer of `elements` elements of `dtype`,
    /// among `world` ranks. Sums take f32, bf16 or f16; gathers any type. A sharded collective
    /// needs `elements` to be a multiple of `world` (the compiler pads chunks to one).
    pub fn plan(op: NcclOp, dtype: DType, elements: usize, world: usize) -> Result<NcclCall> {
        let bad = |problem: String| RuntimeError::BadSchedule(problem);
        if world == 0 {
            return Err(bad(
                "a collective among 0 ranks; a run has at least one rank".into(),
            ));
        }
        if elements == 0 {
            return Err(bad(format!(
                "a {op:?} of 0 elements; the schedule is malformed, recompile it"
            )));
        }
        if op != NcclOp::AllGather && dtype == DType::I32 {
            return Err(bad(format!(
                "a {op:?} over i32 values; sums run over f32, bf16 or f16 gradients only, so \
                 the schedule is malformed: recompile it"
            )));
        }
        let size = dtype.size() as usize;
        let whole = elements.checked_mul(size).ok_or_else(|| {
            bad(format!(
                "a {op:?} of {elements} elements overflows; recompile the schedule"
            ))
        })?;
        if op != NcclOp::AllReduceSum && !elements.is_multiple_of(world) {
            return Err(bad(format!(
                "a {op:?} of {elements} elements does not split into {world} equal shards; \
                 the schedule was compiled for another number of ranks: recompile it with \
                 --gpus and --nodes matching this run"
            )));
        }
        let shard = elements / world;
        let (count, send_bytes, recv_bytes) = match op {
            NcclOp::AllReduceSum => (elements, whole, whole),
            NcclOp::AllGather => (shard, shard * size, whole),
            NcclOp::ReduceScatterSum => (shard, whole, shard * size),
        };
        Ok(NcclCall {
            op,
            dtype,
            count,
            send_bytes,
            recv_bytes,
        })
    }
}

/// An in-place collective on one rank, as NCCL takes it: the call, and the device addresses
/// it reads and writes. The CUDA backend runs every collective of a schedule in place, at the
/// schedule's address of the whole buffer, with NCCL's in-place conventions: an all-reduce
/// reads and writes the whole buffer; an all-gather sends this rank's slice from inside the
/// receive buffer (`recv + rank * slice`); a reduce-scatter receives this rank's slice inside
/// the send buffer (`send + rank * slice`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InPlace {
    /// What NCCL is asked to do.
    pub call: NcclCall,
    /// The address NCCL reads.
    pub send: u64,
    /// The address NCCL writes.
    pub recv: u64,
}

impl InPlace {
    /// `op` over the whole buffer of `elements` elements of `dtype` at device address `base`,
    /// on rank `rank` of `world` (see [`NcclCall::plan`] for what is refused).
    pub fn plan(
        op: NcclOp,
        dtype: DType,
        elements: usize,
        world: usize,
        rank: usize,
        base: u64,
    ) -> Result<InPlace> {
        if rank >= world {
            return Err(RuntimeError::BadSchedule(format!(
                "rank {rank} in a world of {world} ranks; ranks count from 0, so RANK must be \
                 below WORLD_SIZE"
            )));
        }
        let call = NcclCall::plan(op, dtype, elements, world)?;
        let slice = |bytes: usize| base + (rank * bytes) as u64;
        let (send, recv) = match op {
            NcclOp::AllReduceSum => (base, base),
            NcclOp::AllGather => (slice(call.send_bytes), base),
            NcclOp::ReduceScatterSum => (base, slice(call.recv_bytes)),
        };
        Ok(InPlace { call, send, recv })
    }
}

/// The element type and count in which to all-gather `bytes` bytes per rank: a gather only
/// moves bits, so the widest of i32 (4 bytes) and bf16 (2 bytes) that divides the slice.
/// Schedules gather chunk slices of whole 2- or 4-byte elements; an odd slice is refused.
pub fn gather_words(bytes: u64) -> Result<(DType, usize)> {
    let dtype = match bytes {
        0 => {
            return Err(RuntimeError::BadSchedule(
                "an all-gather of 0 bytes per rank; the schedule is malformed, recompile it".into(),
            ))
        }
        b if b % 4 == 0 => DType::I32,
        b if b % 2 == 0 => DType::BF16,
        b => {
            return Err(RuntimeError::BadSchedule(format!(
                "an all-gather of {b} bytes per rank, not a whole number of 2-byte elements; \
                 the schedule is malformed, recompile it"
            )))
        }
    };
    let count = usize::try_from(bytes / dtype.size()).map_err(|_| {
        RuntimeError::BadSchedule(format!(
            "an all-gather of {bytes} bytes per rank cannot be addressed on this machine"
        ))
    })?;
    Ok((dtype, count))
}

/// The environment variable that bounds, in seconds, how long a rank waits for device work
/// while collectives are in flight (see [`poll_until`]).
pub const TIMEOUT_VAR: &str = "PROTRAIN_NCCL_TIMEOUT";

/// The bound when [`TIMEOUT_VAR`] is unset: longer than any step protrain plans (an offloaded
/// 70B step on one GPU with its states on disk is about six minutes), shorter than a human's
/// patience with a hung job.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1800);

/// The wait bound [`TIMEOUT_VAR`]'s value gives (`None`: unset): seconds, a positive number.
pub fn collective_timeout(value: Option<&str>) -> Result<Duration> {
    let Some(text) = value else {
        return Ok(DEFAULT_TIMEOUT);
    };
    match text.trim().parse::<f64>() {
        Ok(secs) if secs.is_finite() && secs > 0.0 && secs <= 1e9 => {
            Ok(Duration::from_secs_f64(secs))
        }
        _ => Err(RuntimeError::Launch(format!(
            "{TIMEOUT_VAR}={text:?} is not a number of seconds; set it to how long a rank may \
             wait for a collective (a positive number, {} by default), or unset it",
            DEFAULT_TIMEOUT.as_secs()
        ))),
    }
}

/// Waits until `done` says the awaited device work has finished, asking `health` between
/// polls whether the communicator is still sound, for at most `timeout`.
///
/// A blocking `cuStreamSynchronize` would never return when a peer dies in the middle of a
/// collective on another node: the NCCL kernel on this GPU waits for data that never comes,
/// and no launcher on this node sees the death. NCCL notices the broken connection itself and
/// reports it through `ncclCommGetAsyncError`, which is what `health` asks; a peer that hangs
/// without dying is caught by `timeout`. So every host wait of a rank with collectives in
/// flight polls: first by yielding (a step's last kernels usually finish within
/// microseconds), then by sleeps that double up to a quarter of a millisecond. A finished
/// wait is seen at most that late (the host optimizer waits once per offloaded chunk, so a
/// step of a hundred chunks loses at most 25 ms), and a waiting thread stays nearly idle (a
/// query costs microseconds).
///
/// `rank` and `what` (what is being waited for, as "finishing the collective stream") name the
/// wait in the errors: `health`'s own, or the timeout's, which names [`TIMEOUT_VAR`].
pub fn poll_until(
    rank: usize,
    what: &str,
    timeout: Duration,
    mut done: impl FnMut() -> Result<bool>,
    mut health: impl FnMut() -> Result<()>,
) -> Result<()> {
    const SPINS: u32 = 64;
    const LONGEST_SLEEP: Duration = Duration::from_micros(250);
    let start = Instant::now();
    let mut sleep = Duration::from_micros(20);
    let mut spins = 0;
    loop {
        if done()? {
            return Ok(());
        }
        health()?;
        if start.elapsed() >= timeout {
            return Err(RuntimeError::Collective {
                rank,
                problem: format!(
                    "{what} took longer than {:.0} s while collectives were in flight: another \
                     rank is probably hung or unreachable (see its output; NCCL_DEBUG=INFO \
                     gives NCCL's account). If the steps really are this long, raise \
                     {TIMEOUT_VAR} (seconds)",
                    timeout.as_secs_f64()
                ),
            });
        }
        if spins < SPINS {
            spins += 1;
            std::thread::yield_now();
        } else {
            std::thread::sleep(sleep.min(timeout.saturating_sub(start.elapsed())));
            sleep = (sleep * 2).min(LONGEST_SLEEP);
        }
    }
}

#[cfg(feature = "cuda")]
pub use comm::{joined, probe, NcclComm, NcclRank, NcclWatch};

#[cfg(feature = "cuda")]
mod comm {
    use super::{NcclCall, NcclOp, SETUP_HINT};
    use crate::collective::Collective;
    use crate::error::{Result, RuntimeError};
    use crate::rendezvous::{share_blob, Launch};
    use cudarc::driver::sys::{CUdeviceptr, CUstream};
    use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
    use cudarc::nccl::{result, sys};
    use protrain_ir::DType;
    use std::ffi::c_void;
    use std::mem::MaybeUninit;
    use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard, Weak};
    use std::time::Duration;

    /// This process's rank in an NCCL communicator over every rank of the run.
    pub struct NcclComm {
        shared: Arc<Shared>,
        rank: usize,
        world: usize,
    }

    /// The communicator itself, shared by the rank's [`NcclComm`] (which issues collectives)
    /// and the [`NcclWatch`]es that ask it for asynchronous errors while the rank waits.
    struct Shared {
        comm: sys::ncclComm_t,
        rank: usize,
        world: usize,
        /// Whether the communicator was aborted (after a failure, or when dropped). Calls into
        /// NCCL hold the read lock and the abort takes the write lock, so no call uses a
        /// communicator that is being freed.
        aborted: RwLock<bool>,
        /// How long a wait for device work may take while collectives are in flight.
        timeout: Duration,
    }

    // SAFETY: NCCL lets one thread issue a communicator's collectives while others call
    // `ncclCommGetAsyncError` and `ncclCommAbort` on it (PyTorch's watchdog thread does
    // exactly this); collectives go through `&mut NcclComm`, one at a time, and the lock
    // orders the abort after any call in progress and before none.
    unsafe impl Send for Shared {}
    // SAFETY: as above.
    unsafe impl Sync for Shared {}

    impl Shared {
        /// Aborts the communicator once: its kernels still running on the GPU exit, so waits
        /// on streams behind them end, and later calls are refused.
        fn abort(&self) {
            let mut aborted = self.aborted.write().unwrap_or_else(PoisonError::into_inner);
            if !*aborted {
                *aborted = true;
                // SAFETY: the communicator is live (not aborted yet) and no call is in
                // progress (the write lock). Abort rather than destroy: destroy waits for
                // outstanding work, which a dead peer never finishes.
                let _ = unsafe { result::comm_abort(self.comm) };
            }
        }

        /// The read lock that keeps the communicator live for a call into NCCL; an error when
        /// it was aborted already.
        fn live(&self) -> Result<RwLockReadGuard<'_, bool>> {
            let aborted = self.aborted.read().unwrap_or_else(PoisonError::into_inner);
            if *aborted {
                return Err(RuntimeError::Collective {
                    rank: self.rank,
                    problem: "the NCCL communicator was aborted after an earlier failure of \
                              this run (see the error before this one)"
                        .into(),
                });
            }
            Ok(aborted)
        }
    }

    impl Drop for Shared {
        fn drop(&mut self) {
            self.abort();
        }
    }

    /// A handle on a rank's communicator for the waits of the CUDA backend: asks NCCL whether
    /// a collective failed asynchronously (a peer died, a connection dropped), and aborts the
    /// communicator when one did or a wait timed out, so that nothing waits for it forever.
    #[derive(Clone)]
    pub struct NcclWatch {
        shared: Arc<Shared>,
    }

    impl NcclWatch {
        /// This rank.
        pub fn rank(&self) -> usize {
            self.shared.rank
        }

        /// How long a wait may take ([`super::TIMEOUT_VAR`]).
        pub fn timeout(&self) -> Duration {
            self.shared.timeout
        }

        /// `Ok` while NCCL reports no asynchronous error. On one, aborts the communicator (the
        /// NCCL kernels this rank's streams wait for then exit) and says what NCCL saw, and
        /// that it was seen while `what`.
        pub fn check(&self, what: &str) -> Result<()> {
            let live = self.shared.live()?;
            let mut seen = sys::ncclResult_t::ncclSuccess;
            // SAFETY: a live communicator (not aborted, under the read lock) and a valid
            // out-pointer; NCCL allows this call beside collectives issued by another thread.
            let asked = unsafe { sys::ncclCommGetAsyncError(self.shared.comm, &mut seen) };
            drop(live);
            let problem = match (asked, seen) {
                (
                    sys::ncclResult_t::ncclSuccess,
                    sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress,
                ) => return Ok(()),
                (sys::ncclResult_t::ncclSuccess, error) => describe(error),
                (failed, _) => format!("that it cannot report its errors ({failed:?})"),
            };
            self.shared.abort();
            Err(RuntimeError::Collective {
                rank: self.shared.rank,
                problem: format!(
                    "while {what}, NCCL reported {problem}; this rank stopped and aborted its \
                     communicator. See the other ranks' errors for the first failure, or set \
                     NCCL_DEBUG=INFO for NCCL's account"
                ),
            })
        }

        /// Aborts the communicator (after a wait gave up), so that nothing else waits for it.
        pub fn abort(&self) {
            self.shared.abort();
        }
    }

    /// What an asynchronous NCCL error means for a run.
    fn describe(error: sys::ncclResult_t) -> String {
        match error {
            sys::ncclResult_t::ncclRemoteError => "a remote error (ncclRemoteError): another \
                rank died, or the network connection to it dropped"
                .into(),
            sys::ncclResult_t::ncclSystemError => "a system error (ncclSystemError): a \
                network or system call failed, as when another rank dies mid-collective"
                .into(),
            sys::ncclResult_t::ncclUnhandledCudaError => {
                "a CUDA error inside NCCL (ncclUnhandledCudaError)".into()
            }
            other => format!("an error ({other:?})"),
        }
    }

    /// Whether libnccl loads, and its version (`22703` for 2.27.3); the error names the
    /// library and how to install it.
    pub fn probe() -> Result<i32> {
        // SAFETY: only tries to dlopen the library under its candidate names.
        if !unsafe { sys::is_culib_present() } {
            return Err(RuntimeError::CudaUnavailable(format!(
                "NCCL (libnccl.so), which a run on several GPUs needs, cannot be loaded: \
                 {SETUP_HINT}"
            )));
        }
        result::get_nccl_version().map_err(|e| {
            RuntimeError::CudaUnavailable(format!(
                "NCCL loaded but does not answer ({e:?}): {SETUP_HINT}"
            ))
        })
    }

    /// This process's communicator, the one [`NcclRank::connect`] made: one process drives one
    /// GPU and one rank, so every CUDA backend of the process takes its collectives' NCCL
    /// communicator from here ([`joined`]). Weak, so that the communicator is still aborted
    /// when the last handle of its rank goes.
    static JOINED: Mutex<Weak<Shared>> = Mutex::new(Weak::new());

    /// A handle on this process's NCCL communicator, if [`NcclRank::connect`] made one that is
    /// still alive: what the CUDA backend issues a schedule's collectives through.
    pub fn joined() -> Option<NcclComm> {
        let shared = JOINED
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .upgrade()?;
        let (rank, world) = (shared.rank, shared.world);
        Some(NcclComm {
            shared,
            rank,
            world,
        })
    }

    impl NcclComm {
        /// Joins the communicator of `launch`'s run: rank 0 makes NCCL's unique id, the
        /// rendezvous hands it to every rank within `timeout`, and `ncclCommInitRank` connects
        /// them. Call it with the CUDA context of this rank's GPU (`LOCAL_RANK`) current on
        /// this thread: NCCL binds the communicator to the current device. The rendezvous
        /// bounds every wait before NCCL's; `ncclCommInitRank` itself waits for all ranks, which
        /// the rendezvous has just seen alive.
        pub fn connect(launch: &Launch, timeout: Duration) -> Result<NcclComm> {
            let rank = launch.rank;
            let waits =
                super::collective_timeout(std::env::var(super::TIMEOUT_VAR).ok().as_deref())?;
            let fail = |what: &str, e: result::NcclError| RuntimeError::Collective {
                rank,
                problem: format!(
                    "NCCL's {what} failed ({e:?}); set NCCL_DEBUG=INFO for NCCL's own \
                     account, and check that every rank runs the same NCCL version"
                ),
            };
            probe()?;
            let blob = share_blob(launch, timeout, || {
                let id = result::get_uniqueid().map_err(|e| fail("ncclGetUniqueId", e))?;
                Ok(id.internal.iter().map(|&c| c as u8).collect())
            })?;
            let mut internal = [0 as std::ffi::c_char; 128];
            if blob.len() != internal.len() {
                return Err(RuntimeError::Rendezvous {
                    rank,
                    problem: format!(
                        "rank 0 sent a {}-byte NCCL id, not 128 bytes; run the same protrain \
                         build on every node",
                        blob.len()
                    ),
                });
            }
            for (c, b) in internal.iter_mut().zip(&blob) {
                *c = *b as std::ffi::c_char;
            }
            let id = sys::ncclUniqueId { internal };
            let world = launch.world_size;
            let (Ok(nranks), Ok(me)) = (i32::try_from(world), i32::try_from(rank)) else {
                return Err(RuntimeError::Launch(format!(
                    "a world of {world} ranks is more than NCCL can count; pass the real \
                     number of GPUs"
                )));
            };
            let mut comm = MaybeUninit::uninit();
            // SAFETY: a valid out-pointer; the id is rank 0's, the same on every rank.
            unsafe { result::comm_init_rank(comm.as_mut_ptr(), nranks, id, me) }
                .map_err(|e| fail("ncclCommInitRank", e))?;
            // SAFETY: initialised by the successful call above.
            let comm = unsafe { comm.assume_init() };
            let shared = Arc::new(Shared {
                comm,
                rank,
                world,
                aborted: RwLock::new(false),
                timeout: waits,
            });
            Ok(NcclComm {
                shared,
                rank,
                world,
            })
        }

        /// A handle for the waits of device work behind this communicator's collectives.
        pub fn watch(&self) -> NcclWatch {
            NcclWatch {
                shared: self.shared.clone(),
            }
        }

        /// This rank.
        pub fn rank(&self) -> usize {
            self.rank
        }

        /// The number of ranks.
        pub fn world(&self) -> usize {
            self.world
        }

        /// Enqueues `call` on `stream`: reads `call.send_bytes` at `send`, writes
        /// `call.recv_bytes` at `recv` (the same address for an in-place all-reduce). Returns
        /// once NCCL has enqueued the work; order it with events like any other work on
        /// `stream`.
        ///
        /// # Safety
        /// `send` and `recv` must be device addresses of this communicator's GPU, valid for
        /// those sizes until the work completes, and `stream` a live stream of the context
        /// NCCL was initialised under.
        pub unsafe fn enqueue(
            &mut self,
            call: &NcclCall,
            send: CUdeviceptr,
            recv: CUdeviceptr,
            stream: CUstream,
        ) -> Result<()> {
            let dtype = match call.dtype {
                DType::F32 => sys::ncclDataType_t::ncclFloat32,
                DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
                DType::F16 => sys::ncclDataType_t::ncclFloat16,
                DType::I32 => sys::ncclDataType_t::ncclInt32,
            };
            let sum = sys::ncclRedOp_t::ncclSum;
            let send = send as *const c_void;
            let recv = recv as *mut c_void;
            let stream = stream as sys::cudaStream_t;
            let _live = self.shared.live()?;
            let comm = self.shared.comm;
            // SAFETY: the caller's contract for the buffers and the stream; the communicator
            // is live (not aborted, and the read lock keeps it so until the call returns).
            let done = match call.op {
                NcclOp::AllReduceSum => unsafe {
                    result::all_reduce(send, recv, call.count, dtype, sum, comm, stream)
                },
                NcclOp::AllGather => unsafe {
                    result::all_gather(send, recv, call.count, dtype, comm, stream)
                },
                NcclOp::ReduceScatterSum => unsafe {
                    result::reduce_scatter(send, recv, call.count, dtype, sum, comm, stream)
                },
            };
            done.map(|_| ()).map_err(|e| RuntimeError::Collective {
                rank: self.rank,
                problem: format!(
                    "NCCL {:?} of {} {:?} elements failed ({e:?}); another rank may have \
                     failed (see its output), or set NCCL_DEBUG=INFO for NCCL's account",
                    call.op, call.count, call.dtype
                ),
            })
        }
    }

    /// This process's rank of a multi-process run as a [`Collective`]: the executor hands it
    /// to the CUDA backend with each collective, for the rank and the world; the backend
    /// enqueues the schedule's collectives on device memory through its own handle on the
    /// same communicator ([`joined`]); the few collectives of host values between steps (the ranks'
    /// losses, the shards of the weights a sharded run reads) are staged through device
    /// memory on a stream of their own and finished before they return.
    pub struct NcclRank {
        comm: NcclComm,
        stream: Arc<CudaStream>,
    }

    impl NcclRank {
        /// Joins the run of `launch` on its GPU (`LOCAL_RANK`, which every CUDA backend of
        /// this process then opens: [`crate::cuda::use_gpu`]): the rendezvous and
        /// `ncclCommInitRank` of [`NcclComm::connect`], with that GPU's context current.
        pub fn connect(launch: &Launch, timeout: Duration) -> Result<Self> {
            crate::cuda::use_gpu(launch.local_rank);
            let ctx = crate::cuda::driver::open_context(launch.local_rank)?;
            let stream = ctx.new_stream().map_err(|e| {
                crate::cuda::driver::driver_error("creating the stream of host collectives", e)
            })?;
            let comm = NcclComm::connect(launch, timeout)?;
            *JOINED.lock().unwrap_or_else(PoisonError::into_inner) = Arc::downgrade(&comm.shared);
            Ok(NcclRank { comm, stream })
        }

        /// Runs `op` over host bytes: `send` uploaded, the collective, the result downloaded
        /// into `recv`, all finished before this returns.
        fn staged(&mut self, op: NcclOp, dtype: DType, send: &[u8], recv: &mut [u8]) -> Result<()> {
            let rank = self.comm.rank;
            let size = dtype.size() as usize;
            let elements = match op {
                NcclOp::AllGather => send.len() * self.comm.world / size,
                _ => send.len() / size,
            };
            let call = NcclCall::plan(op, dtype, elements, self.comm.world)?;
            if (call.send_bytes, call.recv_bytes) != (send.len(), recv.len()) {
                return Err(RuntimeError::Collective {
                    rank,
                    problem: format!(
                        "a {op:?} of {} bytes into {} bytes, where NCCL moves {} into {}; this \
                         is a bug in the executor's collective calls",
                        send.len(),
                        recv.len(),
                        call.send_bytes,
                        call.recv_bytes
                    ),
                });
            }
            let cuda = |e: cudarc::driver::DriverError| RuntimeError::Collective {
                rank,
                problem: format!(
                    "staging a {op:?} of host values through the GPU failed ({e:?}); see \
                     the other ranks' errors, or set NCCL_DEBUG=INFO"
                ),
            };
            let stream = self.stream.clone();
            let from = stream.clone_htod(send).map_err(cuda)?;
            let mut to = stream.alloc_zeros::<u8>(recv.len()).map_err(cuda)?;
            {
                let (src, _a) = from.device_ptr(&stream);
                let (dst, _b) = to.device_ptr_mut(&stream);
                // SAFETY: both buffers are this context's and hold the planned bytes (checked
                // above); they live until the stream is synchronised below.
                unsafe { self.comm.enqueue(&call, src, dst, stream.cu_stream())? };
            }
            // Wait for the collective by polling, not inside the download: a peer that died
            // would leave a blocking wait hanging.
            let watch = self.comm.watch();
            let what = format!("exchanging host values ({op:?})");
            super::poll_until(
                rank,
                &what,
                watch.timeout(),
                // SAFETY: the rank's live stream, with its context current (`connect`).
                || unsafe { crate::cuda::driver::stream_done(stream.cu_stream(), &what) },
                || watch.check(&what),
            )
            .inspect_err(|_| watch.abort())?;
            stream.memcpy_dtoh(&to, recv).map_err(cuda)?;
            stream.synchronize().map_err(cuda)
        }
    }

    impl Collective for NcclRank {
        fn rank(&self) -> usize {
            self.comm.rank
        }

        fn world(&self) -> usize {
            self.comm.world
        }

        fn all_gather(&mut self, send: &[u8], recv: &mut [u8]) -> Result<()> {
            if send.is_empty() && recv.is_empty() {
                return Ok(());
            }
            let (dtype, _) = super::gather_words(send.len() as u64)?;
            self.staged(NcclOp::AllGather, dtype, send, recv)
        }

        fn reduce_scatter(&mut self, send: &[f32], recv: &mut [f32]) -> Result<()> {
            let send: Vec<u8> = send.iter().flat_map(|x| x.to_ne_bytes()).collect();
            let mut out = vec![0u8; 4 * recv.len()];
            self.staged(NcclOp::ReduceScatterSum, DType::F32, &send, &mut out)?;
            for (x, b) in recv.iter_mut().zip(out.chunks_exact(4)) {
                *x = f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
            }
            Ok(())
        }

        fn all_reduce(&mut self, values: &mut [f32]) -> Result<()> {
            let send: Vec<u8> = values.iter().flat_map(|x| x.to_ne_bytes()).collect();
            let mut out = vec![0u8; send.len()];
            self.staged(NcclOp::AllReduceSum, DType::F32, &send, &mut out)?;
            for (x, b) in values.iter_mut().zip(out.chunks_exact(4)) {
                *x = f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_bytes_follow_nccls_conventions() {
        let call = |op, dtype, elements, world| NcclCall::plan(op, dtype, elements, world).unwrap();
        // All-reduce: the whole buffer, in place.
        let c = call(NcclOp::AllReduceSum, DType::BF16, 1000, 4);
        assert_eq!((c.count, c.send_bytes, c.recv_bytes), (1000, 2000, 2000));
        // All-gather: count is one shard; the receive buffer holds them all.
        let c = call(NcclOp::AllGather, DType::F32, 1000, 4);
        assert_eq!((c.count, c.send_bytes, c.recv_bytes), (250, 1000, 4000));
        // Reduce-scatter: count is the shard received.
        let c = call(NcclOp::ReduceScatterSum, DType::F16, 1000, 4);
        assert_eq!((c.count, c.send_bytes, c.recv_bytes), (250, 2000, 500));
        // A world of one: every collective is a copy of the whole buffer.
        for op in [
            NcclOp::AllReduceSum,
            NcclOp::AllGather,
            NcclOp::ReduceScatterSum,
        ] {
            let c = call(op, DType::F32, 7, 1);
            assert_eq!((c.count, c.send_bytes, c.recv_bytes), (7, 28, 28));
        }
        // Gathers move any type; token ids too.
        assert_eq!(call(NcclOp::AllGather, DType::I32, 8, 2).count, 4);
    }

    #[test]
    fn malformed_collectives_are_refused_with_the_way_out() {
        let cases = [
            (NcclOp::AllGather, DType::F32, 10, 4, "equal shards"),
            (
                NcclOp::ReduceScatterSum,
                DType::BF16,
                6,
                4,
                "--gpus and --nodes",
            ),
            (NcclOp::AllReduceSum, DType::I32, 8, 2, "over i32"),
            (NcclOp::ReduceScatterSum, DType::I32, 8, 2, "over i32"),
            (NcclOp::AllReduceSum, DType::F32, 0, 2, "0 elements"),
            (NcclOp::AllReduceSum, DType::F32, usize::MAX, 2, "overflows"),
            (NcclOp::AllGather, DType::F32, 8, 0, "0 ranks"),
        ];
        for (op, dtype, elements, world, expected) in cases {
            let message = NcclCall::plan(op, dtype, elements, world)
                .unwrap_err()
                .to_string();
            assert!(message.contains(expected), "{op:?}: `{message}`");
        }
    }

    #[test]
    fn in_place_collectives_follow_nccls_in_place_conventions() {
        let base = 0x7000_0000u64;
        let at = |op, dtype, elements, world, rank| {
            let p = InPlace::plan(op, dtype, elements, world, rank, base).unwrap();
            (p.call.count, p.send - base, p.recv - base)
        };
        // All-reduce: the whole buffer read and written where it is, on every rank.
        assert_eq!(at(NcclOp::AllReduceSum, DType::F32, 12, 4, 3), (12, 0, 0));
        // All-gather (4 ranks of 3 i32 words): rank 2 sends its slice from inside the buffer
        // (`recv + rank * sendcount * size`) and receives the whole buffer.
        assert_eq!(at(NcclOp::AllGather, DType::I32, 12, 4, 2), (3, 24, 0));
        assert_eq!(at(NcclOp::AllGather, DType::I32, 12, 4, 0), (3, 0, 0));
        // Reduce-scatter (bf16): rank 3 receives its slice inside the buffer it sends.
        assert_eq!(
            at(NcclOp::ReduceScatterSum, DType::BF16, 12, 4, 3),
            (3, 0, 18)
        );
        assert_eq!(
            at(NcclOp::ReduceScatterSum, DType::BF16, 12, 4, 1),
            (3, 0, 6)
        );
        // The slices a world's ranks touch tile the buffer exactly.
        let mut covered = vec![0u32; 48];
        for rank in 0..4 {
            let p = InPlace::plan(NcclOp::AllGather, DType::I32, 12, 4, rank, 0).unwrap();
            let start = p.send as usize;
            for b in &mut covered[start..start + p.call.send_bytes] {
                *b += 1;
            }
        }
        assert!(covered.iter().all(|&c| c == 1), "{covered:?}");
        let e = InPlace::plan(NcclOp::AllGather, DType::I32, 12, 4, 4, base).unwrap_err();
        assert!(e.to_string().contains("below WORLD_SIZE"), "{e}");
    }

    #[test]
    fn gathers_move_whole_words_and_refuse_odd_slices() {
        assert_eq!(gather_words(8).unwrap(), (DType::I32, 2));
        assert_eq!(gather_words(6).unwrap(), (DType::BF16, 3));
        assert_eq!(gather_words(2).unwrap(), (DType::BF16, 1));
        for (bytes, expected) in [(0, "0 bytes"), (7, "2-byte elements")] {
            let e = gather_words(bytes).unwrap_err().to_string();
            assert!(
                e.contains(expected) && e.contains("recompile"),
                "{bytes}: {e}"
            );
        }
    }

    #[test]
    fn a_wait_ends_when_the_work_is_done_and_polls_health_meanwhile() {
        let (mut polls, mut checks) = (0, 0);
        let waited = poll_until(
            1,
            "finishing the collective stream",
            Duration::from_secs(60),
            || {
                polls += 1;
                Ok(polls == 200)
            },
            || {
                checks += 1;
                Ok(())
            },
        );
        assert!(waited.is_ok(), "{waited:?}");
        // Every unfinished poll asked the communicator; the finished one did not need to.
        assert_eq!((polls, checks), (200, 199));
    }

    #[test]
    fn a_failed_communicator_ends_the_wait_with_its_error() {
        let mut checks = 0;
        let started = Instant::now();
        let e = poll_until(
            2,
            "waiting on event 7",
            Duration::from_secs(60),
            || Ok(false),
            || {
                checks += 1;
                if checks < 5 {
                    Ok(())
                } else {
                    Err(RuntimeError::Collective {
                        rank: 2,
                        problem: "NCCL reported a remote error".into(),
                    })
                }
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("remote error"), "{e}");
        assert_eq!(checks, 5);
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn work_that_never_finishes_times_out_naming_the_wait_and_the_setting() {
        let timeout = Duration::from_millis(150);
        let started = Instant::now();
        let e = poll_until(
            3,
            "waiting for the compute stream",
            timeout,
            || Ok(false),
            || Ok(()),
        )
        .unwrap_err();
        let waited = started.elapsed();
        assert!(
            waited >= timeout && waited < Duration::from_secs(30),
            "{waited:?}"
        );
        let message = e.to_string();
        for expected in ["rank 3", "waiting for the compute stream", TIMEOUT_VAR] {
            assert!(message.contains(expected), "`{expected}` in `{message}`");
        }
        // A query that fails ends the wait with its own error.
        let e = poll_until(
            0,
            "x",
            timeout,
            || Err(RuntimeError::Launch("the query failed".into())),
            || Ok(()),
        )
        .unwrap_err();
        assert!(e.to_string().contains("the query failed"), "{e}");
    }

    #[test]
    fn the_timeout_setting_is_seconds_or_a_clear_error() {
        assert_eq!(collective_timeout(None).unwrap(), DEFAULT_TIMEOUT);
        assert_eq!(
            collective_timeout(Some("90")).unwrap(),
            Duration::from_secs(90)
        );
        assert_eq!(
            collective_timeout(Some(" 0.5 ")).unwrap(),
            Duration::from_millis(500)
        );
        for bad in ["", "ten", "0", "-3", "nan", "inf", "1e300"] {
            let e = collective_timeout(Some(bad)).unwrap_err().to_string();
            assert!(
                e.contains(TIMEOUT_VAR) && e.contains("seconds"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn the_library_names_are_cudarcs_and_exclude_the_wheels_soname() {
        // The setup hint exists because of this: the wheel installs libnccl.so.2 only.
        assert_eq!(LIBRARY_NAMES[0], "libnccl.so");
        assert!(!LIBRARY_NAMES.contains(&"libnccl.so.2"));
        assert!(SETUP_HINT.contains("nvidia-nccl-cu13"));
        assert!(SETUP_HINT.contains("LD_LIBRARY_PATH"));
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn the_library_names_are_the_ones_cudarc_tries() {
        assert_eq!(cudarc::get_lib_name_candidates("nccl"), LIBRARY_NAMES);
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn probing_nccl_names_the_library_and_the_wheel_or_finds_it() {
        match probe() {
            Ok(version) => assert!(version >= 21800, "NCCL {version} is older than 2.18"),
            Err(e) => {
                let message = e.to_string();
                assert!(message.contains("libnccl.so"), "{message}");
                assert!(message.contains("nvidia-nccl-cu13"), "{message}");
            }
        }
    }
}
