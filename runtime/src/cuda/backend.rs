//! The CUDA backend: a schedule's arena in one device allocation, its host region in one
//! pinned allocation, its device streams on CUDA streams, its host optimizer on host threads.
//!
//! Every tensor is a raw device address at its planned offset: nothing is allocated per step.
//! An op on a device stream is the call plan [`super::launch::calls`] makes of it (kernels and
//! GEMMs, as data), executed here in order; kernel scratch is the op's planned workspace. A run
//! of adjacent AdamW ops ([`super::runs`]) is one launch ([`super::launch::adamw_multi`]):
//! each op of the run is held until the last arrives, whose launch updates them all.
//! Besides the arena, each CUDA stream keeps only the constant tables its kernels read (RoPE
//! frequencies, the clip coefficient's operand table, each merged AdamW's tensor table:
//! kilobytes, uploaded on that stream during the first step) and cuBLAS its own workspace per
//! handle; the hardware profile's reserved bytes cover both. Writes outside kernels are ordered as [`super::driver::write_steps`] says
//! (the streams are non-blocking, so nothing on the default stream orders them), and the
//! context blocks rather than spins while a thread waits for the GPU.
//!
//! Work issued on a device stream ([`StreamKind::Compute`], [`StreamKind::HostToDevice`],
//! [`StreamKind::DeviceToHost`]) is enqueued on that stream's CUDA stream and runs
//! asynchronously. The [`StreamKind::HostOptimizer`] stream runs on its issuing thread with the
//! host backend's code (CPU Adam on the pinned region), as the host backend would, and so does
//! the [`StreamKind::HostCast`] stream (the 12-byte layout's casts, the same code). The disk
//! tier's [`StreamKind::DiskIo`] stream is such a host stream too: its reads and writes move
//! bytes between the schedule's disk file ([`crate::disk::DiskFile`], made, locked and swept
//! as for the host backend) and the pinned region, on its issuing thread, whatever buffer the
//! bytes belong to.
//!
//! Events cross between the two worlds, and a CUDA event has a pitfall: `cuStreamWaitEvent` on
//! an event not yet recorded returns at once, waiting for nothing. So every event also has a
//! host-side mark, set by [`Backend::record`] once the event is recorded, under a mutex with a
//! condition variable as in the host backend. [`Backend::wait`] first blocks the issuing thread
//! until the mark is set (or the step is aborted), then orders the GPU work: a device stream
//! waiting on an event recorded on a device stream enqueues `cuStreamWaitEvent`; the host
//! stream waiting on one calls `cuEventSynchronize`; an event recorded by the host stream marks
//! work already done, so waiting on it needs nothing more.
//!
//! A data-parallel schedule's [`StreamKind::Collective`] stream is a device stream too: its
//! all-reduces, all-gathers and reduce-scatters are enqueued on its CUDA stream through the
//! rank's NCCL communicator ([`super::nccl::NcclRank`], one process per GPU), in place at
//! their arena addresses ([`super::nccl::InPlace`]), and ordered by the schedule's events like
//! any other device work. The rank's slice copies ([`protrain_ir::Instr::CopyShard`]) are
//! plain copies at the addresses the executor shifted to the rank, and the CPU Adam of a
//! sharded chunk updates the rank's part of each parameter ([`crate::backend::ShardLaunch`]).
//! The process runs on the GPU [`super::use_gpu`] chose (`LOCAL_RANK`), GPU 0 unless told.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};

use cudarc::driver::{result, sys, CudaContext, CudaStream, LaunchConfig, PushKernelArg};
use protrain_ir::workspace::flash_attention_supported;
use protrain_ir::{DType, EventId, OpKind, Schedule, Space, StreamKind, TensorType, ValueId};

use super::blas::Gemm;
use super::driver::{
    self, driver_error, gpu, open_context, probe, write_device, DeviceInfo, DeviceMemory, Event,
    Fill, Kernels, ParamKind, PinnedMemory, WriteKind,
};
use super::launch::{self, AdamWMember, Addresses, Arg, Call, ConstKey, Target, Types, BLOCK};
use super::nccl::{gather_words, poll_until, InPlace, NcclComm, NcclOp, NcclWatch};
use super::replay::{self, ReadyCall, ReadyKernel, ReadyOp};
use super::runs::{run_slots, RunSlot};
use crate::backend::master_weights;
use crate::backend::{Address, Backend, Launch};
use crate::collective::Collective;
use crate::disk::DiskFile;
use crate::dispatch::{self, Outcome};
use crate::error::{Result, RuntimeError};

/// How far each event has come this step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mark {
    /// Not recorded yet.
    Pending,
    /// Recorded on a CUDA stream: its work may still be running.
    Device,
    /// Recorded by the host stream: its work is done.
    Host,
}

/// Every event's mark, and whether the step was abandoned.
struct EventState {
    marks: Vec<Mark>,
    aborted: bool,
}

/// What a device stream owns besides its CUDA stream.
pub(super) struct DeviceStream {
    pub(super) stream: Arc<CudaStream>,
    gemm: Option<Gemm>,
    constants: Vec<(ConstKey, DeviceMemory)>,
    /// The prepared launches of every op issued on the stream ([`super::replay`]), by the
    /// address of the executor's constants of its instruction.
    ready: HashMap<usize, ReadyOp>,
    /// The merged AdamW run being issued.
    run: HeldRun,
}

/// The AdamW ops of a merged run issued so far, held until its last one arrives.
#[derive(Default)]
struct HeldRun {
    /// Their keys in [`DeviceStream::ready`], in issue order (the capacity is kept from step
    /// to step).
    keys: Vec<usize>,
    /// Whether one of them was planned again this step, so the run's launch must be too.
    fresh: bool,
}

impl DeviceStream {
    fn new(stream: Arc<CudaStream>, gemm: Option<Gemm>) -> Self {
        Self {
            stream,
            gemm,
            constants: Vec::new(),
            ready: HashMap::new(),
            run: HeldRun::default(),
        }
    }
}

/// What the host optimizer stream owns.
pub(super) struct HostStream {
    /// For the rare copy between the host region and the arena issued on this stream.
    copier: Arc<CudaStream>,
}

/// Boxed on the device side: a device stream holds its handles, constants and replay table.
enum Exec {
    Device(Box<DeviceStream>),
    Host(HostStream),
}

/// A stream of the CUDA backend: a CUDA stream, or the issuing host thread.
pub struct CudaStreamHandle {
    kind: StreamKind,
    exec: Exec,
}

impl CudaStreamHandle {
    /// What the stream is for.
    pub fn kind(&self) -> StreamKind {
        self.kind
    }

    /// What a device stream owns (`None` for the host optimizer stream).
    pub(super) fn device_stream(&mut self) -> Option<&mut DeviceStream> {
        match &mut self.exec {
            Exec::Device(d) => Some(d),
            Exec::Host(_) => None,
        }
    }

    /// The CUDA stream of a device stream (`None` for the host optimizer stream).
    pub fn cuda_stream(&self) -> Option<&Arc<CudaStream>> {
        match &self.exec {
            Exec::Device(d) => Some(&d.stream),
            Exec::Host(_) => None,
        }
    }
}

/// The CUDA backend. See the module doc.
pub struct CudaBackend {
    pub(super) ctx: Arc<CudaContext>,
    info: DeviceInfo,
    kernels: Kernels,
    arena: DeviceMemory,
    host: PinnedMemory,
    events: Vec<Event>,
    state: Mutex<EventState>,
    marked: Condvar,
    /// The f32 master weight of each bf16 or f16 parameter, by the home of its Adam `m`.
    masters: HashMap<(Space, u64), Address>,
    /// Where the clip coefficient kernel writes the gradient norm (one f32).
    norm: DeviceMemory,
    /// Whether a clip coefficient was launched this step.
    norm_written: AtomicBool,
    /// Most blocks of a grid-stride launch: enough to fill the GPU several times over.
    max_blocks: u32,
    /// The AdamW ops updated in one launch with their neighbours ([`super::runs`]), by
    /// parameter: set by [`Backend::prepare`].
    runs: HashMap<ValueId, RunSlot>,
    /// The backend's own handle on this process's NCCL communicator ([`super::nccl::joined`]:
    /// the one its [`super::nccl::NcclRank`] made), taken at the first collective; the
    /// collective streams enqueue through it.
    nccl: Mutex<Option<NcclComm>>,
    /// The communicator's health, once a collective was issued through it: from then on
    /// every host wait for device work polls it for asynchronous errors and gives up after
    /// its timeout ([`CudaBackend::finish`]), since a peer that dies mid-collective would
    /// leave a blocking wait hanging.
    watch: OnceLock<NcclWatch>,
    /// The test hook [`DROP_WAIT_VAR`]: which wait of the host optimizer stream for device
    /// work, in each step (counting from 1), is skipped; `None` normally.
    drop_wait: Option<usize>,
    /// Waits of the host optimizer stream for device work so far this step, for `drop_wait`.
    host_waits: AtomicUsize,
    /// The disk region's file, for a schedule with a disk tier ([`Backend::attach_disk`]).
    disk: Option<DiskFile>,
}

/// A test hook, never for real runs: `PROTRAIN_CUDA_DROP_WAIT=N` makes the backend skip the
/// N-th wait of every step in which the host optimizer stream waits for device work (an
/// event recorded on a CUDA stream, `cuEventSynchronize`): one stream issues those, so the
/// N-th is the same wait in every run (the disk stream's waits, on a thread of their own, are
/// not counted). A test shows with it that the simulator's chaos mode
/// (`PROTRAIN_CUDA_SIM_CHAOS`) turns a missing wait into wrong results (docs/cuda-sim.md).
pub const DROP_WAIT_VAR: &str = "PROTRAIN_CUDA_DROP_WAIT";

/// The wait [`DROP_WAIT_VAR`]'s value names (`None`: unset).
fn drop_wait(value: Option<&str>) -> Result<Option<usize>> {
    let Some(text) = value else {
        return Ok(None);
    };
    match text.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(Some(n)),
        _ => Err(RuntimeError::Launch(format!(
            "{DROP_WAIT_VAR}={text:?} is not a positive whole number; it is a test hook that \
             skips the N-th event wait of each step: unset it"
        ))),
    }
}

/// Element types that views of the pinned region can have: every bit pattern is a value.
pub(super) trait Plain: Copy {}
impl Plain for f32 {}
impl Plain for i32 {}
impl Plain for half::bf16 {}
impl Plain for half::f16 {}

impl CudaBackend {
    /// The device the backend runs on.
    pub fn device(&self) -> &DeviceInfo {
        &self.info
    }

    /// Records that the f32 master weight of the bf16 parameter whose Adam `m` is at `m` lives
    /// at `master`. [`Backend::prepare`] does this for every parameter of a schedule; a caller
    /// that launches a bf16 AdamW outside a schedule (a test, the profiler) does it itself.
    pub fn set_master_weight(&mut self, m: Address, master: Address) {
        self.masters.insert((m.space, m.offset), master);
    }

    /// The master weight of the parameter whose `m` is at `m`.
    pub(super) fn master_weight(&self, m: Address) -> Result<Address> {
        self.masters
            .get(&(m.space, m.offset))
            .copied()
            .ok_or_else(|| {
                RuntimeError::BadSchedule(format!(
                "a bf16 or f16 AdamW reads its moment at {:?}+{} but no f32 master weight is known for \
                 it; run mixed-precision schedules through the executor, which finds them",
                m.space, m.offset
            ))
            })
    }

    /// Makes the context current on the calling thread.
    pub(super) fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error("making the CUDA context current", e))
    }

    /// The address of `bytes` bytes at `at` as the GPU sees it (pinned host memory is mapped
    /// into the device's address space), checked to lie inside its region.
    pub(super) fn gpu_addr(&self, at: Address, bytes: u64) -> Result<u64> {
        let (base, len, name) = match at.space {
            Space::Device => (self.arena.ptr(), self.arena.len(), "device arena"),
            Space::Host => (self.host.ptr() as u64, self.host.len(), "host region"),
            Space::Disk => {
                return Err(RuntimeError::BadSchedule(format!(
                    "a kernel or a device copy addresses the disk region (offset {}), which \
                     only disk reads and writes on the disk stream touch: recompile the schedule",
                    at.offset
                )))
            }
        };
        let end = at.offset.checked_add(bytes);
        if end.is_none_or(|end| end > len as u64) {
            return Err(RuntimeError::BadSchedule(format!(
                "{bytes} bytes at offset {} lie outside the {name} of {len} bytes",
                at.offset
            )));
        }
        Ok(base + at.offset)
    }

    /// A host pointer to `bytes` bytes at `at` in the pinned region, aligned to `align`.
    fn host_ptr(&self, at: Address, bytes: u64, align: usize) -> Result<*mut u8> {
        if at.space != Space::Host {
            return Err(RuntimeError::BadSchedule(format!(
                "the host optimizer stream reads or writes device memory (offset {}); only \
                 device streams touch the arena: recompile the schedule",
                at.offset
            )));
        }
        let addr = self.gpu_addr(at, bytes)?;
        if !at.offset.is_multiple_of(align as u64) {
            return Err(RuntimeError::BadSchedule(format!(
                "offset {} in the host region is not aligned to {align} bytes",
                at.offset
            )));
        }
        Ok(addr as *mut u8)
    }

    /// A shared view of `len` elements at `at` in the pinned region.
    ///
    /// # Safety
    ///
    /// While the view lives, nothing writes its bytes: the backend's ordering contract.
    pub(super) unsafe fn host_slice<T: Plain>(&self, at: Address, len: usize) -> Result<&[T]> {
        let size = std::mem::size_of::<T>();
        let ptr = self.host_ptr(at, (len * size) as u64, std::mem::align_of::<T>())?;
        // SAFETY: in bounds and aligned (checked above), initialised (zeroed at allocation),
        // every bit pattern a `T`; unaliased by writers per the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts(ptr.cast::<T>(), len) })
    }

    /// An exclusive view of `len` elements at `at` in the pinned region.
    ///
    /// # Safety
    ///
    /// While the view lives, no other view of its bytes exists and no copy touches them.
    #[allow(clippy::mut_from_ref)] // Interior mutability through raw memory; see the contract.
    pub(super) unsafe fn host_slice_mut<T: Plain>(
        &self,
        at: Address,
        len: usize,
    ) -> Result<&mut [T]> {
        let size = std::mem::size_of::<T>();
        let ptr = self.host_ptr(at, (len * size) as u64, std::mem::align_of::<T>())?;
        // SAFETY: as in `host_slice`, and exclusive per the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr.cast::<T>(), len) })
    }

    /// Launches kernel `name` on `stream` with `args`, which must be resolved (no
    /// [`Arg::Table`] or [`Arg::NormSlot`]: `run_device` resolves them).
    pub(super) fn launch_kernel(
        &self,
        stream: &CudaStream,
        name: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &[Arg],
    ) -> Result<()> {
        let (f, params) = self.kernels.get(name)?;
        let kinds: Vec<ParamKind> = args.iter().map(Arg::kind).collect();
        if kinds != params {
            return Err(RuntimeError::BadSchedule(format!(
                "kernel {name} takes {params:?} but the launch passes {kinds:?}; this is a bug \
                 in runtime/src/cuda/launch.rs"
            )));
        }
        let mut b = stream.launch_builder(f);
        for a in args {
            match a {
                Arg::Ptr(v) => b.arg(v),
                Arg::I64(v) => b.arg(v),
                Arg::I32(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
                Arg::Table(_) | Arg::NormSlot => {
                    return Err(RuntimeError::BadSchedule(format!(
                        "kernel {name} was launched with an unresolved {a:?}; this is a bug in \
                         runtime/src/cuda/backend.rs"
                    )))
                }
            };
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: block,
            shared_mem_bytes: 0,
        };
        // SAFETY: `args` match the kernel's parameter list (checked above against the
        // declaration in the `.cu` file); the addresses are checked to lie in their regions,
        // and the ordering contract the launch was issued under keeps other streams away.
        unsafe { b.launch(cfg) }
            .map(|_| replay::count_kernel())
            .map_err(|e| driver_error(format!("launching {name}"), e))
    }

    /// Enqueues one op on a device stream: its prepared launches ([`super::replay`]),
    /// replayed when the stream issued the same op before with the same kind, types and
    /// addresses (an AdamW's step scalars patched), else planned ([`launch::calls`]) and
    /// resolved now. An AdamW op of a merged run ([`super::runs`]) is held until the run's
    /// last, whose one launch updates them all.
    ///
    /// # Safety
    ///
    /// The backend's ordering contract holds for the op's operands.
    unsafe fn run_device(&self, d: &mut DeviceStream, l: &Launch<'_>) -> Result<()> {
        let op = l.op;
        if l.shard.is_some() {
            return Err(RuntimeError::BadSchedule(format!(
                "{}: an AdamW on a sharded chunk issued on a device stream; the CUDA backend \
                 updates sharded chunks with the CPU Adam on the host optimizer stream, where \
                 the compiler places them: recompile the schedule",
                op.kind.mnemonic()
            )));
        }
        let slot = match op.kind {
            OpKind::AdamW { .. } => op.inputs.first().and_then(|p| self.runs.get(p)).copied(),
            _ => None,
        };
        // The executor's constants of this instruction: one per instruction, living as long
        // as its plan of the schedule; `ReadyOp::matches` checks the rest.
        let key = std::ptr::from_ref(l.prepared) as usize;
        let fresh = !d.ready.get(&key).is_some_and(|r| r.matches(l));
        replay::count_op(fresh);
        if fresh {
            let ready = self.prepare_op(d, l, slot.is_none())?;
            d.ready.insert(key, ready);
        }
        let scalars = launch::adamw_step_scalars(&op.kind, l.step);
        let DeviceStream {
            stream,
            gemm,
            ready,
            run,
            ..
        } = d;
        let entry = ready.get_mut(&key).expect("inserted above");
        entry.scalars = scalars;
        let Some(slot) = slot else {
            if let Some(s) = &scalars {
                entry.patch_adamw(s);
            }
            if entry.writes_norm {
                self.norm_written.store(true, Ordering::Release);
            }
            // SAFETY: the caller's contract.
            return unsafe { issue(stream, gemm, &entry.calls) };
        };
        if slot.index == 0 {
            run.keys.clear();
            run.fresh = false;
        }
        if run.keys.len() != slot.index {
            let held = run.keys.len();
            run.keys.clear();
            return Err(RuntimeError::BadSchedule(format!(
                "adamw: op {} of a merged run of {} was issued after {held} ops of its run; \
                 issue a schedule's instructions in stream order, as the executor does",
                slot.index + 1,
                slot.len
            )));
        }
        run.keys.push(key);
        run.fresh |= fresh;
        if run.keys.len() < slot.len {
            // Launched with the run's last op, which the executor issues on this stream with
            // nothing between (see `super::runs`).
            return Ok(());
        }
        // Members whose scalars differ cannot share the launch: planning the run again
        // refuses them with the reason.
        let same_scalars = run
            .keys
            .iter()
            .all(|k| ready.get(k).is_some_and(|m| m.scalars == scalars));
        if run.fresh || !same_scalars {
            let calls = self.plan_run(d, l.step)?;
            let (resolved, _) = self.resolve(d, calls)?;
            d.ready.get_mut(&key).expect("inserted above").calls = resolved;
        }
        let DeviceStream {
            stream,
            gemm,
            ready,
            run,
            ..
        } = d;
        run.keys.clear();
        let entry = ready.get_mut(&key).expect("inserted above");
        if let Some(s) = &scalars {
            entry.patch_adamw(s);
        }
        // SAFETY: the caller's contract, for every member's operands.
        unsafe { issue(stream, gemm, &entry.calls) }
    }

    /// The prepared launches of `l` on `d`: its operands' addresses (each checked to hold its
    /// type), its plan ([`launch::calls`]) when `plan` (an AdamW op held for its merged run has
    /// none of its own), resolved ([`CudaBackend::resolve`]).
    fn prepare_op(&self, d: &mut DeviceStream, l: &Launch<'_>, plan: bool) -> Result<ReadyOp> {
        let (graph, op) = (l.graph, l.op);
        let inputs: Vec<&TensorType> = op.inputs.iter().map(|&v| &graph.value(v).ty).collect();
        let outputs: Vec<&TensorType> = op.outputs.iter().map(|&v| &graph.value(v).ty).collect();
        if l.inputs.len() != inputs.len() || l.outputs.len() != outputs.len() {
            return Err(RuntimeError::BadSchedule(format!(
                "{}: the op has {} inputs and {} outputs but the kernel was given {} and {} \
                 addresses",
                op.kind.mnemonic(),
                inputs.len(),
                outputs.len(),
                l.inputs.len(),
                l.outputs.len()
            )));
        }
        // A padded operand holds `rows x pitch` elements.
        let addrs =
            |at: &[Address], types: &[&TensorType], pitch: &dyn Fn(usize) -> Option<usize>| {
                at.iter()
                    .zip(types)
                    .enumerate()
                    .map(|(i, (&a, t))| {
                        let bytes = match pitch(i) {
                            Some(p) => t.rows() * p as u64 * t.dtype.size(),
                            None => t.bytes(),
                        };
                        self.gpu_addr(a, bytes)
                    })
                    .collect::<Result<Vec<u64>>>()
            };
        let workspace = match l.workspace {
            Some((at, bytes)) => Some((self.gpu_addr(at, bytes)?, bytes)),
            None => None,
        };
        let master = match (&op.kind, inputs.first()) {
            (OpKind::AdamW { .. }, Some(p))
                if matches!(p.dtype, DType::BF16 | DType::F16) && l.inputs.len() > 2 =>
            {
                Some(self.gpu_addr(self.master_weight(l.inputs[2])?, 4 * p.numel())?)
            }
            _ => None,
        };
        let at = Addresses {
            inputs: addrs(l.inputs, &inputs, &|i| l.pitches.input(i))?,
            outputs: addrs(l.outputs, &outputs, &|i| l.pitches.output(i))?,
            workspace,
            master,
            pitches: l.pitches,
        };
        let types = Types {
            inputs: &inputs,
            outputs: &outputs,
        };
        let (calls, writes_norm) = match plan {
            true => self.resolve(d, launch::calls(&op.kind, types, &at, self.target(l.step))?)?,
            false => (Vec::new(), false),
        };
        Ok(ReadyOp::new(l, &inputs, &outputs, at, calls, writes_norm))
    }

    /// The one launch of the merged AdamW run whose members `d` holds ([`launch::adamw_multi`]),
    /// from each member's kind, types and addresses as last issued.
    fn plan_run(&self, d: &DeviceStream, step: u64) -> Result<Vec<Call>> {
        let members: Vec<&ReadyOp> = d
            .run
            .keys
            .iter()
            .map(|k| d.ready.get(k).expect("every held member is prepared"))
            .collect();
        let refs: Vec<(Vec<&TensorType>, Vec<&TensorType>)> = members
            .iter()
            .map(|m| {
                let (inputs, outputs) = m.types();
                (inputs.iter().collect(), outputs.iter().collect())
            })
            .collect();
        let members: Vec<AdamWMember<'_>> = members
            .iter()
            .zip(&refs)
            .map(|(m, (inputs, outputs))| AdamWMember {
                kind: m.kind(),
                types: Types { inputs, outputs },
                at: &m.addresses,
            })
            .collect();
        launch::adamw_multi(&members, self.target(step))
    }

    /// What a plan depends on besides the op: this GPU's grid limit and flash attention, and
    /// the step.
    fn target(&self, step: u64) -> Target {
        Target {
            max_blocks: self.max_blocks,
            step,
            flash: flash_attention_supported(self.info.compute_capability),
        }
    }

    /// `plan` resolved for replay on `d`: each kernel's function and argument bytes (constant
    /// tables uploaded on `d`, the gradient-norm slot's address), and whether a kernel writes
    /// that slot.
    fn resolve(&self, d: &mut DeviceStream, plan: Vec<Call>) -> Result<(Vec<ReadyCall>, bool)> {
        let mut writes_norm = false;
        let mut out = Vec::with_capacity(plan.len());
        for call in plan {
            out.push(match call {
                Call::Kernel(k) => {
                    let mut args = Vec::with_capacity(k.args.len());
                    for a in k.args {
                        args.push(match a {
                            Arg::Table(key) => Arg::Ptr(d.constant(&self.ctx, &key)?),
                            Arg::NormSlot => {
                                writes_norm = true;
                                Arg::Ptr(self.norm.ptr())
                            }
                            a => a,
                        });
                    }
                    let (f, params) = self.kernels.get(k.entry)?;
                    ReadyCall::Kernel(ReadyKernel::new(
                        k.entry, f, params, k.grid, k.block, &args,
                    )?)
                }
                call => ReadyCall::Library(call),
            });
        }
        Ok((out, writes_norm))
    }

    /// Enqueues `op` over the `elements` of `dtype` at `at` in place on `stream`, through
    /// the rank's NCCL communicator.
    ///
    /// # Safety
    ///
    /// The backend's ordering contract holds for the whole range.
    unsafe fn collective(
        &self,
        stream: &mut CudaStreamHandle,
        op: NcclOp,
        dtype: DType,
        elements: usize,
        at: Address,
        comm: &mut dyn Collective,
    ) -> Result<()> {
        let (rank, world) = (comm.rank(), comm.world());
        if at.space != Space::Device {
            return Err(RuntimeError::BadSchedule(format!(
                "a {op:?} on the host region (offset {}); the CUDA backend runs collectives on \
                 the device arena only: recompile the schedule",
                at.offset
            )));
        }
        let bytes = (elements as u64).saturating_mul(dtype.size());
        let base = self.gpu_addr(at, bytes)?;
        let placed = InPlace::plan(op, dtype, elements, world, rank, base)?;
        let mut held = self.nccl.lock().unwrap_or_else(PoisonError::into_inner);
        if held.is_none() {
            *held = super::nccl::joined();
        }
        let Some(nccl) = held.as_mut() else {
            return Err(RuntimeError::Collective {
                rank,
                problem: format!(
                    "the CUDA backend runs a {op:?} with NCCL on device memory, but this process \
                     has joined no NCCL communicator; run one process per GPU (protrain train \
                     --backend cuda --gpus N starts them), or use --backend host"
                ),
            });
        };
        if (nccl.rank(), nccl.world()) != (rank, world) {
            return Err(RuntimeError::Collective {
                rank,
                problem: format!(
                    "the executor's collective is rank {rank} of {world}, but this process's \
                     NCCL communicator is rank {} of {}; this is a bug in how the run's \
                     ranks were set up",
                    nccl.rank(),
                    nccl.world()
                ),
            });
        }
        let Some(d) = stream.device_stream() else {
            return Err(RuntimeError::BadSchedule(format!(
                "a {op:?} on the host optimizer stream; collectives run on the collective \
                 stream: recompile the schedule"
            )));
        };
        self.bind()?;
        self.watch.get_or_init(|| nccl.watch());
        // SAFETY: both addresses lie in the arena (checked above for the whole buffer); the
        // caller's ordering contract keeps other work away until the stream passes it.
        unsafe { nccl.enqueue(&placed.call, placed.send, placed.recv, d.stream.cu_stream()) }
    }

    /// Waits until `done` says the device work awaited (`what`) has finished. Without
    /// collectives in flight that is `block`, CUDA's own blocking wait; with them it polls
    /// `done` and the communicator's health ([`poll_until`]) and aborts the communicator if
    /// the wait fails, so that no later wait of this rank hangs on it either.
    fn finish(
        &self,
        what: &str,
        done: impl FnMut() -> Result<bool>,
        block: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let Some(watch) = self.watch.get() else {
            return block();
        };
        poll_until(watch.rank(), what, watch.timeout(), done, || {
            watch.check(what)
        })
        .inspect_err(|_| watch.abort())
    }

    /// Blocks of a grid-stride launch over `n` elements with [`BLOCK`] threads.
    pub(super) fn grid_for(&self, n: u64) -> u32 {
        n.div_ceil(u64::from(BLOCK))
            .clamp(1, u64::from(self.max_blocks)) as u32
    }

    /// Waits for all work of every stream (so a host access between steps sees its results,
    /// even after a failed step left some running).
    fn settle(&self) -> Result<()> {
        self.bind()?;
        replay::count_sync();
        self.ctx
            .synchronize()
            .map_err(|e| driver_error("waiting for the GPU to finish its work", e))
    }

    /// Copies `data` to `at`, between steps: the device write is ordered before every stream's
    /// later work ([`WriteKind::BetweenSteps`]).
    fn write_bytes(&self, at: Address, fill: Fill<'_>) -> Result<()> {
        if at.space == Space::Disk {
            // No device work touches the file: only the disk stream, whose work is done
            // when it is issued, and no step runs (`&mut self` upstream).
            let disk = self.disk()?;
            return match fill {
                Fill::Bytes(b) => disk.write(at.offset, b),
                Fill::Zero(n) => disk.write(at.offset, &vec![0u8; n]),
            };
        }
        let addr = self.gpu_addr(at, fill.len() as u64)?;
        match at.space {
            // SAFETY: `addr` has room for the bytes (checked); the steps wait for the device
            // to be idle first, and `&mut self` upstream keeps new work away.
            Space::Device => unsafe {
                write_device(&self.ctx, WriteKind::BetweenSteps, addr, fill, None)
            },
            Space::Host => {
                self.settle()?;
                let n = fill.len();
                // SAFETY: in bounds (checked); nothing runs (settled, and `&mut self` upstream).
                unsafe {
                    match fill {
                        Fill::Zero(_) => std::ptr::write_bytes(addr as *mut u8, 0, n),
                        Fill::Bytes(b) => {
                            std::ptr::copy_nonoverlapping(b.as_ptr(), addr as *mut u8, n)
                        }
                    }
                };
                Ok(())
            }
            Space::Disk => unreachable!("written to the file above"),
        }
    }

    /// Copies the bytes at `at` into `out`, between steps.
    fn read_bytes(&self, at: Address, out: &mut [u8]) -> Result<()> {
        if at.space == Space::Disk {
            return self.disk()?.read(at.offset, out);
        }
        self.settle()?;
        let addr = self.gpu_addr(at, out.len() as u64)?;
        match at.space {
            // SAFETY: `addr` holds `out.len()` bytes (checked); the device is idle.
            Space::Device => unsafe { result::memcpy_dtoh_sync(out, addr) }
                .map_err(|e| driver_error("reading from the device arena", e)),
            Space::Host => {
                // SAFETY: in bounds (checked); nothing writes it: settled, between steps.
                unsafe {
                    std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), out.len())
                };
                Ok(())
            }
            Space::Disk => unreachable!("read from the file above"),
        }
    }

    /// The disk region's file.
    fn disk(&self) -> Result<&DiskFile> {
        self.disk.as_ref().ok_or(RuntimeError::Unsupported(
            crate::error::Unsupported::NoDiskDir { held: None },
        ))
    }

    /// A disk read into, or a disk write from, the pinned region, done on the calling thread
    /// (the disk stream's): the transfer is finished when this returns, as host stream work
    /// is. Either side may be any buffer; only the spaces matter.
    ///
    /// # Safety
    ///
    /// The backend's ordering contract holds for the pinned range.
    unsafe fn disk_copy(&self, src: Address, dst: Address, bytes: u64) -> Result<()> {
        let disk = self.disk()?;
        let n = usize::try_from(bytes).map_err(|_| {
            RuntimeError::BadSchedule(format!("{bytes} bytes cannot be addressed here"))
        })?;
        match (src.space, dst.space) {
            (Space::Disk, Space::Host) => {
                let to = self.host_ptr(dst, bytes, 1)?;
                // SAFETY: in the pinned region and in bounds (checked); the ordering contract
                // keeps every other reader and writer away while the file fills it.
                disk.read(src.offset, unsafe { std::slice::from_raw_parts_mut(to, n) })
            }
            (Space::Host, Space::Disk) => {
                let from = self.host_ptr(src, bytes, 1)?;
                // SAFETY: as above; nothing writes the range while it is written out.
                disk.write(dst.offset, unsafe { std::slice::from_raw_parts(from, n) })
            }
            (from, to) => Err(RuntimeError::BadSchedule(format!(
                "a copy of {bytes} bytes {from:?} -> {to:?}: the disk tier moves bytes \
                 between the disk file and the host region only; recompile the schedule"
            ))),
        }
    }

    fn lock(&self) -> MutexGuard<'_, EventState> {
        // A thread that panicked while holding the lock left only marks behind: still valid.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn event(&self, event: EventId) -> Result<&Event> {
        self.events
            .get(event.index())
            .ok_or_else(|| RuntimeError::BadSchedule(format!("event {} does not exist", event.0)))
    }

    /// Runs one op on the host optimizer stream, on the pinned region, with the host backend's
    /// code: AdamW (f32, or bf16 or f16 with its f32 master weight), or any other kind through
    /// [`dispatch::run`] when every operand is f32 (or i32) in the host region.
    ///
    /// # Safety
    ///
    /// The backend's ordering contract holds for the op's operands.
    unsafe fn run_host(&self, l: &Launch<'_>) -> Result<Outcome> {
        let op = l.op;
        let bad = |why: String| RuntimeError::BadSchedule(format!("{}: {why}", op.kind.mnemonic()));
        if l.inputs.len() != op.inputs.len() || l.outputs.len() != op.outputs.len() {
            return Err(bad(
                "the kernel was given the wrong number of addresses".into()
            ));
        }
        match op.kind {
            OpKind::AdamW { clipped, .. } => unsafe { self.host_adamw(l, clipped) },
            OpKind::AccumulateGrad => unsafe { self.host_accumulate(l) },
            _ => unsafe { self.host_kernel(l) },
        }
    }

    /// [`CudaBackend::run_host`] of an AdamW op: f32, or bf16 or f16 with its f32 master
    /// weight (a sharded chunk's rank updates its part of each operand).
    ///
    /// # Safety
    ///
    /// As [`CudaBackend::run_host`].
    unsafe fn host_adamw(&self, l: &Launch<'_>, clipped: bool) -> Result<Outcome> {
        let (graph, op) = (l.graph, l.op);
        let bad = |why: String| RuntimeError::BadSchedule(format!("{}: {why}", op.kind.mnemonic()));
        let ty = |v: protrain_ir::ValueId| &graph.value(v).ty;
        if op.inputs.len() < 4 + usize::from(clipped) {
            return Err(bad(
                "takes param, grad, m, v and, when clipped, the coefficient".into(),
            ));
        }
        let param = ty(op.inputs[0]);
        // A sharded chunk's rank updates its part of each operand, and of the master
        // weight the launch names (the host backend's `ShardLaunch` semantics).
        let n = l
            .shard
            .map_or(param.numel() as usize, |shard| shard.elements);
        let master_at = || match l.shard {
            Some(shard) => shard.master.ok_or_else(|| {
                bad(format!(
                    "a sharded {param} AdamW without its f32 master weight part"
                ))
            }),
            None => self.master_weight(l.inputs[2]),
        };
        // SAFETY (for every view below): the ordering contract gives this op its operands
        // alone while it runs; param, grad, m, v, the coefficient and the master weight are
        // distinct values at distinct homes, so the views do not overlap.
        let m = unsafe { self.host_slice_mut::<f32>(l.inputs[2], n)? };
        let v = unsafe { self.host_slice_mut::<f32>(l.inputs[3], n)? };
        let coef = match clipped {
            true => Some(unsafe { self.host_slice::<f32>(l.inputs[4], 1)? }[0]),
            false => None,
        };
        match (param.dtype, ty(op.inputs[1]).dtype) {
            (DType::F32, DType::F32) => {
                let p = unsafe { self.host_slice_mut::<f32>(l.inputs[0], n)? };
                let g = unsafe { self.host_slice::<f32>(l.inputs[1], n)? };
                dispatch::adamw(&op.kind, p, g, m, v, coef, l.step);
            }
            (DType::BF16, DType::BF16) => {
                let master_at = master_at()?;
                let master = unsafe { self.host_slice_mut::<f32>(master_at, n)? };
                let p = unsafe { self.host_slice_mut::<half::bf16>(l.inputs[0], n)? };
                // The 14-byte host layout puts the gradient in the parameter's storage:
                // then it is read from there (`Grad::InLow`), never viewed apart.
                let g = match l.inputs[0] == l.inputs[1] {
                    true => crate::kernels::Grad::InLow,
                    false => crate::kernels::Grad::Bf16(unsafe {
                        self.host_slice::<half::bf16>(l.inputs[1], n)?
                    }),
                };
                // One pass: the bf16 gradient is widened as it is read and the new bf16
                // parameter written beside the f32 master, the same bits as the host
                // executor's CPU Adam.
                dispatch::adamw_mixed(
                    &op.kind,
                    master,
                    g,
                    m,
                    v,
                    Some(crate::kernels::Low::Bf16(p)),
                    coef,
                    l.step,
                );
            }
            (DType::F16, DType::F16) => {
                let master_at = master_at()?;
                let master = unsafe { self.host_slice_mut::<f32>(master_at, n)? };
                let p = unsafe { self.host_slice_mut::<half::f16>(l.inputs[0], n)? };
                let g = match l.inputs[0] == l.inputs[1] {
                    true => crate::kernels::Grad::InLow,
                    false => crate::kernels::Grad::F16(unsafe {
                        self.host_slice::<half::f16>(l.inputs[1], n)?
                    }),
                };
                // As bf16; a negative coefficient (an overflowed loss-scaled step) makes
                // `adamw_mixed` change nothing, as on the host backend.
                dispatch::adamw_mixed(
                    &op.kind,
                    master,
                    g,
                    m,
                    v,
                    Some(crate::kernels::Low::F16(p)),
                    coef,
                    l.step,
                );
            }
            (p, g) => {
                return Err(bad(format!(
                    "a {p} parameter with a {g} gradient; the CPU Adam updates f32, bf16 or \
                     f16 parameters from gradients of their own type"
                )))
            }
        }
        Ok(Outcome::default())
    }

    /// [`CudaBackend::run_host`] of a host accumulator: the offloaded gradient summed into it
    /// in place, in f32 or in bf16 or f16 through f32 (the host backend's arithmetic).
    ///
    /// # Safety
    ///
    /// As [`CudaBackend::run_host`].
    unsafe fn host_accumulate(&self, l: &Launch<'_>) -> Result<Outcome> {
        let (graph, op) = (l.graph, l.op);
        let bad = |why: String| RuntimeError::BadSchedule(format!("{}: {why}", op.kind.mnemonic()));
        let ty = |v: protrain_ir::ValueId| &graph.value(v).ty;
        if op.inputs.len() != 2 {
            return Err(bad(format!(
                "takes the accumulator and the gradient, not {} inputs",
                op.inputs.len()
            )));
        }
        let n = ty(op.inputs[0]).numel() as usize;
        // SAFETY: the ordering contract gives this op its accumulator and gradient alone
        // while it runs; they are distinct values at distinct homes in the pinned region.
        match (ty(op.inputs[0]).dtype, ty(op.inputs[1]).dtype) {
            (DType::F32, DType::F32) => {
                let acc = unsafe { self.host_slice_mut::<f32>(l.inputs[0], n)? };
                let g = unsafe { self.host_slice::<f32>(l.inputs[1], n)? };
                crate::kernels::add_assign(acc, g);
            }
            (DType::BF16, DType::BF16) => {
                let acc = unsafe { self.host_slice_mut::<half::bf16>(l.inputs[0], n)? };
                let g = unsafe { self.host_slice::<half::bf16>(l.inputs[1], n)? };
                crate::kernels::add_assign_bf16(acc, g);
            }
            (DType::F16, DType::F16) => {
                let acc = unsafe { self.host_slice_mut::<half::f16>(l.inputs[0], n)? };
                let g = unsafe { self.host_slice::<half::f16>(l.inputs[1], n)? };
                crate::kernels::add_assign_f16(acc, g);
            }
            (a, g) => {
                return Err(bad(format!(
                    "a {g} gradient into a {a} accumulator; gradients are summed into \
                     accumulators of their own type"
                )))
            }
        }
        Ok(Outcome::default())
    }

    /// [`CudaBackend::run_host`] of any other kind: the host kernels through
    /// [`dispatch::run`], on operands in the pinned region.
    ///
    /// # Safety
    ///
    /// As [`CudaBackend::run_host`].
    unsafe fn host_kernel(&self, l: &Launch<'_>) -> Result<Outcome> {
        let (graph, op) = (l.graph, l.op);
        let bad = |why: String| RuntimeError::BadSchedule(format!("{}: {why}", op.kind.mnemonic()));
        let ty = |v: protrain_ir::ValueId| &graph.value(v).ty;
        // Any other kind: the host kernels, on operands in the pinned region, bf16 and f16
        // inputs (the squared norm of a narrow host accumulator) widened to f32 first, as the
        // host backend widens them.
        let mut wide: Vec<Option<Vec<f32>>> = Vec::with_capacity(op.inputs.len());
        for (i, &v) in op.inputs.iter().enumerate() {
            let t = ty(v);
            if !matches!(t.dtype, DType::F32 | DType::I32 | DType::BF16 | DType::F16) {
                return Err(bad(format!(
                    "input {i} is {t}; the host optimizer stream reads f32, i32, bf16 and f16"
                )));
            }
            self.gpu_addr(l.inputs[i], t.bytes())?;
            if l.inputs[i].space != protrain_ir::Space::Host {
                return Err(bad(format!(
                    "input {i} is in the device arena, which the host optimizer stream cannot read"
                )));
            }
            wide.push(match t.dtype {
                // SAFETY: in the pinned region and in bounds (checked above); the ordering
                // contract keeps writers away while this op reads.
                DType::BF16 => Some(
                    unsafe { self.host_slice::<half::bf16>(l.inputs[i], t.numel() as usize)? }
                        .iter()
                        .map(|x| x.to_f32())
                        .collect(),
                ),
                // SAFETY: as for bf16.
                DType::F16 => Some(
                    unsafe { self.host_slice::<half::f16>(l.inputs[i], t.numel() as usize)? }
                        .iter()
                        .map(|x| x.to_f32())
                        .collect(),
                ),
                _ => None,
            });
        }
        let mut outputs: Vec<&mut [f32]> = Vec::with_capacity(op.outputs.len());
        for (i, &v) in op.outputs.iter().enumerate() {
            let t = ty(v);
            if t.dtype != DType::F32 {
                return Err(bad(format!(
                    "output {i} is {t}; the host kernels write f32"
                )));
            }
            // SAFETY: the ordering contract: outputs overlap no input, each other or the
            // workspace, and nothing else touches them meanwhile.
            outputs.push(unsafe { self.host_slice_mut::<f32>(l.outputs[i], t.numel() as usize)? });
        }
        let workspace: &mut [f32] = match l.workspace {
            // SAFETY: as for the outputs.
            Some((at, bytes)) => unsafe { self.host_slice_mut::<f32>(at, (bytes / 4) as usize)? },
            None => &mut [],
        };
        let inputs = HostInputs {
            b: self,
            l,
            wide: &wide,
        };
        dispatch::run(graph, op, l.prepared, &inputs, &mut outputs, workspace)
    }
}

impl DeviceStream {
    /// The stream's cuBLAS handle, made on first use.
    pub(super) fn gemm(&mut self) -> Result<&Gemm> {
        gemm_handle(&mut self.gemm, &self.stream)
    }

    /// The device copy of a constant table, uploaded on first use: enqueued on this stream,
    /// ahead of the kernels that read it (see [`super::driver::write_steps`]).
    pub(super) fn constant(&mut self, ctx: &Arc<CudaContext>, key: &ConstKey) -> Result<u64> {
        if let Some((_, m)) = self.constants.iter().find(|(k, _)| k == key) {
            return Ok(m.ptr());
        }
        let bytes = key.bytes();
        let m = DeviceMemory::uninit(ctx, bytes.len(), "kernel constants")?;
        // SAFETY: `m` holds `bytes.len()` bytes; it is new, so nothing else uses it.
        unsafe { m.write(WriteKind::Constant, Fill::Bytes(&bytes), Some(&self.stream)) }?;
        let ptr = m.ptr();
        self.constants.push((key.clone(), m));
        Ok(ptr)
    }
}

/// The cuBLAS handle `slot` keeps for `stream`, made on first use.
fn gemm_handle<'a>(slot: &'a mut Option<Gemm>, stream: &Arc<CudaStream>) -> Result<&'a Gemm> {
    if slot.is_none() {
        *slot = Some(Gemm::new(stream.clone())?);
    }
    Ok(slot.as_ref().expect("made above"))
}

/// Enqueues prepared `calls` on `stream` in order, the GEMMs on the handle in `gemm`.
///
/// # Safety
///
/// The context is current; the ordering contract the calls' op was issued under holds.
unsafe fn issue(
    stream: &Arc<CudaStream>,
    gemm: &mut Option<Gemm>,
    calls: &[ReadyCall],
) -> Result<()> {
    for call in calls {
        match call {
            // SAFETY: the caller's contract; the arguments were checked against the kernel's
            // declaration and its addresses against their regions when it was prepared.
            ReadyCall::Kernel(k) => unsafe { k.launch(stream.cu_stream())? },
            ReadyCall::Library(call) => {
                replay::count_library_call();
                let d = gemm_handle(gemm, stream)?;
                match call {
                    // SAFETY: the plan's operands hold matrices of its shapes (checked against
                    // their types, the workspace against its planned size); outputs and the
                    // workspace overlap no input or each other: the caller's ordering contract.
                    Call::Gemm(g) => unsafe { d.run(g.dtype, &g.gemm, g.what)? },
                    // SAFETY: as above, for the bias, the GELU's kept input and the residual.
                    Call::Matmul(g) => unsafe { d.run_matmul(g.dtype, &g.mm, g.what)? },
                    // SAFETY: as above, for every matrix of the batch (the plan's strides stay
                    // inside the operands and the planned workspace).
                    Call::Batched(g) => unsafe { d.run_batched(g.ab, g.c, &g.gemm, g.what)? },
                    Call::Kernel(k) => {
                        return Err(RuntimeError::BadSchedule(format!(
                            "kernel {} was prepared as a library call; this is a bug in \
                             runtime/src/cuda/backend.rs",
                            k.entry
                        )))
                    }
                }
            }
        }
    }
    Ok(())
}

/// The bytes of a slice of plain values.
fn as_bytes<T: Plain>(data: &[T]) -> &[u8] {
    // SAFETY: `T` is plain data without padding (f32, i32, bf16, f16); any byte view is valid.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data)) }
}

/// The bytes of a mutable slice of plain values.
fn as_bytes_mut<T: Plain>(data: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`, and every byte pattern written back is a valid `T`.
    unsafe {
        std::slice::from_raw_parts_mut(data.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(data))
    }
}

/// Enqueues a copy of `bytes` from `src` to `dst` (GPU-visible addresses in `from`, `to`) on
/// `stream`.
///
/// # Safety
///
/// Both ranges are inside their regions, and the ordering contract holds for them.
unsafe fn enqueue_copy(
    stream: sys::CUstream,
    from: Space,
    to: Space,
    src: u64,
    dst: u64,
    bytes: u64,
) -> Result<()> {
    let n = bytes as usize;
    // SAFETY: the caller's contract; pinned host memory is page-locked, so the copies are
    // truly asynchronous, and mapped, so its address works as a `CUdeviceptr` too.
    let status = unsafe {
        match (from, to) {
            (Space::Host, Space::Device) => {
                sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, n, stream)
            }
            (Space::Device, Space::Host) => {
                sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, n, stream)
            }
            (Space::Device, Space::Device) => sys::cuMemcpyDtoDAsync_v2(dst, src, n, stream),
            (Space::Host, Space::Host) => sys::cuMemcpyAsync(dst, src, n, stream),
            (Space::Disk, _) | (_, Space::Disk) => {
                return Err(RuntimeError::BadSchedule(format!(
                    "a copy of {bytes} bytes {from:?} -> {to:?} on a CUDA stream: disk reads \
                     and writes run on the disk stream; recompile the schedule"
                )))
            }
        }
    };
    status
        .result()
        .map_err(|e| driver_error(format!("copying {bytes} bytes {from:?} -> {to:?}"), e))
}

impl Backend for CudaBackend {
    type Stream = CudaStreamHandle;

    const RUNS_BF16: bool = true;

    const RUNS_F16: bool = true;

    const MISSING_COLLECTIVES: Option<&'static str> = None;

    const MISSING_DISK: Option<&'static str> = None;

    /// NCCL's all-reduce sum in place (f32, bf16 or f16). NCCL picks its own reduction order
    /// (see [`super::nccl`]): deterministic for a topology, not the host backend's rank order.
    unsafe fn all_reduce(
        &self,
        stream: &mut CudaStreamHandle,
        at: Address,
        dtype: DType,
        len: usize,
        comm: &mut dyn Collective,
    ) -> Result<()> {
        // SAFETY: the caller's ordering contract for the range.
        unsafe { self.collective(stream, NcclOp::AllReduceSum, dtype, len, at, comm) }
    }

    /// NCCL's all-gather in place: rank `r`'s slice at `at + r * bytes` sent from there.
    unsafe fn all_gather(
        &self,
        stream: &mut CudaStreamHandle,
        at: Address,
        bytes: u64,
        comm: &mut dyn Collective,
    ) -> Result<()> {
        let (dtype, words) = gather_words(bytes)?;
        let elements = words * comm.world();
        // SAFETY: the caller's ordering contract for the `ranks * bytes` at `at`.
        unsafe { self.collective(stream, NcclOp::AllGather, dtype, elements, at, comm) }
    }

    /// NCCL's reduce-scatter sum in place: rank `r` receives its slice at `at + r * len`.
    unsafe fn reduce_scatter(
        &self,
        stream: &mut CudaStreamHandle,
        at: Address,
        dtype: DType,
        len: usize,
        comm: &mut dyn Collective,
    ) -> Result<()> {
        let elements = len * comm.world();
        // SAFETY: the caller's ordering contract for the whole range.
        unsafe { self.collective(stream, NcclOp::ReduceScatterSum, dtype, elements, at, comm) }
    }

    /// A sharded chunk's micro-batch gradient summed over the ranks into the part of its
    /// accumulator this rank holds. NCCL's reduce-scatter splits a buffer into equal slices,
    /// one per rank, but a rank's part of one parameter is where the parameter crosses the
    /// rank's slice of the chunk, of any length: so the whole gradient is all-reduced in place
    /// (as an unsharded accumulation does, twice a reduce-scatter's traffic), then the
    /// `add_forward` kernel adds the rank's part into its accumulator, which lies in the mapped
    /// host region, over the bus. The sum is `acc + (g0 + g1 + ...)` in NCCL's order, as the
    /// CUDA backend's other accumulations over ranks are (see [`super::nccl`]), not the host
    /// backend's rank order.
    unsafe fn accumulate_into_shard(
        &self,
        stream: &mut CudaStreamHandle,
        acc: Address,
        part: std::ops::Range<usize>,
        grad: Address,
        dtype: DType,
        len: usize,
        comm: &mut dyn Collective,
    ) -> Result<()> {
        // SAFETY: the caller's ordering contract for the gradient's whole range.
        unsafe { self.collective(stream, NcclOp::AllReduceSum, dtype, len, grad, comm)? };
        if part.is_empty() {
            return Ok(());
        }
        let size = dtype.size();
        let n = part.len() as u64;
        let from = Address {
            space: grad.space,
            offset: grad.offset + part.start as u64 * size,
        };
        let g = self.gpu_addr(from, n * size)?;
        let a = self.gpu_addr(acc, n * size)?;
        let entry = launch::accumulate_entry(dtype)?;
        let grid = (self.grid_for(n), 1, 1);
        let Some(d) = stream.device_stream() else {
            return Err(RuntimeError::BadSchedule(
                "an accumulation over the ranks on the host optimizer stream; it runs on the \
                 collective stream: recompile the schedule"
                    .into(),
            ));
        };
        let args = [Arg::Ptr(a), Arg::Ptr(a), Arg::Ptr(g), Arg::I64(n as i64)];
        self.launch_kernel(&d.stream, entry, grid, (BLOCK, 1, 1), &args)
    }

    fn new(arena_bytes: u64, host_bytes: u64, events: u32) -> Result<Self> {
        // The pinned region is host memory, zeroed page by page below: check it fits first.
        let pinned = crate::memory::MemoryNeed {
            region: crate::memory::HostRegion::PinnedHostRegion,
            bytes: host_bytes,
        };
        crate::memory::check_host_memory(&[pinned], crate::memory::memory_available())?;
        let info = probe()?;
        let ctx = open_context(gpu())?;
        let kernels = Kernels::load(&ctx, info.compute_capability)?;
        let too_big = |what: &str, bytes: u64| {
            RuntimeError::BadSchedule(format!(
                "the {what} of {bytes} bytes cannot be addressed on this machine"
            ))
        };
        let arena_len = usize::try_from(arena_bytes).map_err(|_| too_big("arena", arena_bytes))?;
        let host_len =
            usize::try_from(host_bytes).map_err(|_| too_big("host region", host_bytes))?;
        let (free, total) = ctx
            .mem_get_info()
            .map_err(|e| driver_error("asking how much device memory is free", e))?;
        if arena_len > free {
            return Err(RuntimeError::Cuda {
                during: "allocating the device arena".into(),
                detail: format!(
                    "the schedule's arena needs {} but {} of {} are free on {}",
                    protrain_ir::format_bytes(arena_bytes),
                    protrain_ir::format_bytes(free as u64),
                    protrain_ir::format_bytes(total as u64),
                    info.name
                ),
                hint: "compile for a smaller --gpu-memory (the free memory less about 1 GiB \
                       for the CUDA context and cuBLAS), or end the other processes \
                       `nvidia-smi` lists"
                    .into(),
            });
        }
        let arena = DeviceMemory::zeroed(&ctx, arena_len, "device arena")?;
        let host = PinnedMemory::zeroed(&ctx, host_len, "host region")?;
        let events = (0..events)
            .map(|_| Event::new(&ctx))
            .collect::<Result<Vec<_>>>()?;
        let norm = DeviceMemory::zeroed(&ctx, 4, "gradient-norm slot")?;
        let max_blocks = info.multiprocessors * 32;
        Ok(Self {
            state: Mutex::new(EventState {
                marks: vec![Mark::Pending; events.len()],
                aborted: false,
            }),
            marked: Condvar::new(),
            ctx,
            info,
            kernels,
            arena,
            host,
            events,
            masters: HashMap::new(),
            norm,
            norm_written: AtomicBool::new(false),
            max_blocks,
            runs: HashMap::new(),
            nccl: Mutex::new(None),
            watch: OnceLock::new(),
            drop_wait: drop_wait(std::env::var(DROP_WAIT_VAR).ok().as_deref())?,
            host_waits: AtomicUsize::new(0),
            disk: None,
        })
    }

    fn attach_disk(&mut self, disk: DiskFile) -> Result<()> {
        self.disk = Some(disk);
        Ok(())
    }

    fn prepare(&mut self, schedule: &Schedule) -> Result<()> {
        // A bf16 schedule on a GPU without bf16 tensor cores is refused before any stream
        // exists, with the types it runs instead.
        super::driver::check_dtypes(schedule.graph.values().map(|(_, v)| v.ty.dtype), &self.info)?;
        for m in master_weights(schedule)? {
            self.set_master_weight(m.m, m.master);
        }
        self.runs = run_slots(schedule);
        Ok(())
    }

    fn create_stream(&self, kind: StreamKind) -> Result<CudaStreamHandle> {
        self.bind()?;
        let stream = self
            .ctx
            .new_stream()
            .map_err(|e| driver_error("creating a CUDA stream", e))?;
        let exec = match kind {
            StreamKind::Compute | StreamKind::HostToDevice | StreamKind::DeviceToHost => {
                // The compute stream runs the matmuls: its cuBLAS handle is made now rather
                // than in the first step.
                let gemm = match kind {
                    StreamKind::Compute => Some(Gemm::new(stream.clone())?),
                    _ => None,
                };
                Exec::Device(Box::new(DeviceStream::new(stream, gemm)))
            }
            // NCCL enqueues on the collective stream as kernels do on the others.
            StreamKind::Collective { .. } => {
                Exec::Device(Box::new(DeviceStream::new(stream, None)))
            }
            // The host cast stream (the 12-byte layout) runs CPU work as the host optimizer,
            // and the disk stream its file I/O.
            StreamKind::HostOptimizer | StreamKind::HostCast | StreamKind::DiskIo => {
                Exec::Host(HostStream { copier: stream })
            }
        };
        Ok(CudaStreamHandle { kind, exec })
    }

    fn begin_step(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        state.marks.fill(Mark::Pending);
        state.aborted = false;
        self.norm_written.store(false, Ordering::Release);
        self.host_waits.store(0, Ordering::Relaxed);
    }

    unsafe fn launch(&self, stream: &mut CudaStreamHandle, l: &Launch<'_>) -> Result<Outcome> {
        self.bind()?;
        match &mut stream.exec {
            Exec::Device(d) => {
                // SAFETY: the caller's ordering contract.
                unsafe { self.run_device(d, l)? };
                // The kernels run later: the gradient norm comes from `step_outcome`, the loss
                // from its home once the step is over.
                Ok(Outcome::default())
            }
            // SAFETY: the caller's ordering contract.
            Exec::Host(_) => unsafe { self.run_host(l) },
        }
    }

    unsafe fn cast(
        &self,
        stream: &mut CudaStreamHandle,
        cast: &crate::backend::CastLaunch,
    ) -> Result<()> {
        match &stream.exec {
            // SAFETY: the caller's ordering contract; `host_ptr` checks that every range is
            // in the pinned region, in bounds and aligned. The host backend's code path.
            Exec::Host(_) => unsafe {
                cast.run_on_host(|at, bytes, align| self.host_ptr(at, bytes, align))
            },
            Exec::Device(_) => Err(RuntimeError::BadSchedule(format!(
                "a cast (host_layout=12) on the {:?} stream: casts run on the host cast \
                 stream; recompile the schedule",
                stream.kind
            ))),
        }
    }

    unsafe fn copy(
        &self,
        stream: &mut CudaStreamHandle,
        src: Address,
        dst: Address,
        bytes: u64,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        if src.space == Space::Disk || dst.space == Space::Disk {
            return match &stream.exec {
                // SAFETY: the caller's ordering contract.
                Exec::Host(_) => unsafe { self.disk_copy(src, dst, bytes) },
                Exec::Device(_) => Err(RuntimeError::BadSchedule(format!(
                    "a disk transfer of {bytes} bytes on the {:?} stream: disk reads and \
                     writes run on the disk stream; recompile the schedule",
                    stream.kind
                ))),
            };
        }
        self.bind()?;
        let (from, to) = (self.gpu_addr(src, bytes)?, self.gpu_addr(dst, bytes)?);
        match &mut stream.exec {
            // SAFETY: both ranges checked; the caller's ordering contract.
            Exec::Device(d) => unsafe {
                enqueue_copy(d.stream.cu_stream(), src.space, dst.space, from, to, bytes)
            },
            Exec::Host(h) => match (src.space, dst.space) {
                (Space::Host, Space::Host) => {
                    // SAFETY: both ranges are in the pinned region (checked); the caller's
                    // contract keeps other work away. `copy` (memmove): nothing rules out
                    // that they overlap.
                    unsafe { std::ptr::copy(from as *const u8, to as *mut u8, bytes as usize) };
                    Ok(())
                }
                _ => {
                    // SAFETY: as above; the copy is finished before this returns, as host
                    // stream work is.
                    unsafe {
                        enqueue_copy(h.copier.cu_stream(), src.space, dst.space, from, to, bytes)?
                    };
                    let what = "finishing a copy on the host stream";
                    replay::count_sync();
                    self.finish(
                        what,
                        // SAFETY: the host stream's live copier, its context bound.
                        || unsafe { driver::stream_done(h.copier.cu_stream(), what) },
                        || h.copier.synchronize().map_err(|e| driver_error(what, e)),
                    )
                }
            },
        }
    }

    fn record(&self, stream: &mut CudaStreamHandle, event: EventId) -> Result<()> {
        let ev = self.event(event)?;
        let mark = match &stream.exec {
            Exec::Device(d) => {
                self.bind()?;
                // SAFETY: a live event and a live stream of this context.
                unsafe { result::event::record(ev.raw(), d.stream.cu_stream()) }
                    .map_err(|e| driver_error(format!("recording event {}", event.0), e))?;
                Mark::Device
            }
            Exec::Host(_) => Mark::Host,
        };
        let mut state = self.lock();
        state.marks[event.index()] = mark;
        drop(state);
        self.marked.notify_all();
        Ok(())
    }

    fn wait(&self, stream: &mut CudaStreamHandle, event: EventId) -> Result<()> {
        let ev = self.event(event)?;
        let mut state = self.lock();
        let mark = loop {
            if state.aborted {
                return Err(RuntimeError::StepAborted);
            }
            match state.marks[event.index()] {
                Mark::Pending => {
                    state = self
                        .marked
                        .wait(state)
                        .unwrap_or_else(PoisonError::into_inner)
                }
                mark => break mark,
            }
        };
        drop(state);
        match (&stream.exec, mark) {
            (_, Mark::Host) | (_, Mark::Pending) => Ok(()),
            (Exec::Device(d), Mark::Device) => {
                self.bind()?;
                // SAFETY: a live event, recorded this step, and a live stream.
                unsafe {
                    result::stream::wait_event(
                        d.stream.cu_stream(),
                        ev.raw(),
                        sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                    )
                }
                .map_err(|e| driver_error(format!("waiting on event {}", event.0), e))
            }
            (Exec::Host(_), Mark::Device) => {
                // The disk stream's waits run on a thread of their own, in an order of their
                // own: counting them would make the hook's N-th wait differ between runs.
                if stream.kind != StreamKind::DiskIo {
                    let nth = self.host_waits.fetch_add(1, Ordering::Relaxed) + 1;
                    if self.drop_wait == Some(nth) {
                        return Ok(());
                    }
                }
                self.bind()?;
                replay::count_sync();
                let what = format!("waiting on event {}", event.0);
                self.finish(
                    &what,
                    // SAFETY: a live event, recorded this step.
                    || unsafe { driver::event_done(ev.raw(), &what) },
                    // SAFETY: as above.
                    || {
                        unsafe { result::event::synchronize(ev.raw()) }
                            .map_err(|e| driver_error(&what, e))
                    },
                )
            }
        }
    }

    fn synchronize(&self, stream: &mut CudaStreamHandle) -> Result<()> {
        match &stream.exec {
            Exec::Device(d) => {
                // The wait may poll the stream with a raw query (with collectives in flight),
                // which needs the context current on this thread like any driver call.
                self.bind()?;
                replay::count_sync();
                let what = format!("waiting for the {:?} stream to finish", stream.kind);
                self.finish(
                    &what,
                    // SAFETY: a live stream of this backend's context.
                    || unsafe { driver::stream_done(d.stream.cu_stream(), &what) },
                    || d.stream.synchronize().map_err(|e| driver_error(&what, e)),
                )
            }
            // Its work ran when it was issued; its copies were waited for one by one.
            Exec::Host(_) => Ok(()),
        }
    }

    fn abort(&self) {
        self.lock().aborted = true;
        self.marked.notify_all();
        // A step abandoned midway leaves the ranks' sequences of collectives out of step, so
        // the communicator cannot serve another; aborting it also ends this rank's NCCL
        // kernels, so the waits that settle the device after a failure cannot hang on them.
        if let Some(watch) = self.watch.get() {
            watch.abort();
        }
    }

    fn write_f32(&mut self, at: Address, data: &[f32]) -> Result<()> {
        self.write_bytes(at, Fill::Bytes(as_bytes(data)))
    }

    fn write_i32(&mut self, at: Address, data: &[i32]) -> Result<()> {
        self.write_bytes(at, Fill::Bytes(as_bytes(data)))
    }

    fn fill_zero(&mut self, at: Address, bytes: u64) -> Result<()> {
        let n = usize::try_from(bytes).map_err(|_| {
            RuntimeError::BadSchedule(format!("{bytes} bytes cannot be addressed here"))
        })?;
        self.write_bytes(at, Fill::Zero(n))
    }

    fn read_f32(&self, at: Address, out: &mut [f32]) -> Result<()> {
        self.read_bytes(at, as_bytes_mut(out))
    }

    fn write_bf16(&mut self, at: Address, data: &[half::bf16]) -> Result<()> {
        self.write_bytes(at, Fill::Bytes(as_bytes(data)))
    }

    fn read_bf16(&self, at: Address, out: &mut [half::bf16]) -> Result<()> {
        self.read_bytes(at, as_bytes_mut(out))
    }

    fn write_f16(&mut self, at: Address, data: &[half::f16]) -> Result<()> {
        self.write_bytes(at, Fill::Bytes(as_bytes(data)))
    }

    fn read_f16(&self, at: Address, out: &mut [half::f16]) -> Result<()> {
        self.read_bytes(at, as_bytes_mut(out))
    }

    fn step_outcome(&mut self) -> Result<Outcome> {
        if !self.norm_written.load(Ordering::Acquire) {
            return Ok(Outcome::default());
        }
        let mut norm = [0u8; 4];
        self.settle()?;
        // SAFETY: the slot holds 4 bytes; the device is idle.
        unsafe { result::memcpy_dtoh_sync(&mut norm[..], self.norm.ptr()) }
            .map_err(|e| driver_error("reading the gradient norm", e))?;
        Ok(Outcome {
            loss: None,
            grad_norm: Some(f32::from_ne_bytes(norm)),
        })
    }
}

/// The inputs of a host-stream kernel, in the pinned region (checked before the kernel runs).
struct HostInputs<'a> {
    b: &'a CudaBackend,
    l: &'a Launch<'a>,
    /// Per input, its f32 widening when it is stored as bf16 or f16.
    wide: &'a [Option<Vec<f32>>],
}

impl HostInputs<'_> {
    fn len(&self, i: usize) -> usize {
        self.l.graph.value(self.l.op.inputs[i]).ty.numel() as usize
    }
}

impl<'a> dispatch::Inputs<'a> for HostInputs<'a> {
    fn f32(&self, i: usize) -> &'a [f32] {
        if let Some(Some(wide)) = self.wide.get(i) {
            return wide;
        }
        // SAFETY: in the host region and in bounds (checked in `host`); the ordering contract
        // keeps writers away while the kernel reads.
        unsafe { self.b.host_slice(self.l.inputs[i], self.len(i)) }
            .expect("inputs were checked before the kernel ran")
    }

    fn i32(&self, i: usize) -> &'a [i32] {
        // SAFETY: as for `f32`.
        unsafe { self.b.host_slice(self.l.inputs[i], self.len(i)) }
            .expect("inputs were checked before the kernel ran")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_drop_wait_hook_takes_a_positive_count_or_says_to_unset_it() {
        assert_eq!(drop_wait(None).unwrap(), None);
        assert_eq!(drop_wait(Some("3")).unwrap(), Some(3));
        for bad in ["0", "-1", "two", ""] {
            let e = drop_wait(Some(bad)).unwrap_err().to_string();
            assert!(
                e.contains(DROP_WAIT_VAR) && e.contains("unset"),
                "{bad}: {e}"
            );
        }
    }
}
