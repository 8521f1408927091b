//! The backend trait: the memory, streams, events and kernel launches a schedule runs on.
//!
//! A backend owns one device arena and one host region, allocated once when it is created
//! with the schedule's sizes; nothing is allocated per step. The executor drives it: one host
//! thread per stream issues that stream's instructions in order through `launch`, `copy`,
//! `record` and `wait`, each of which is "enqueue on this stream". The host backend
//! ([`crate::host::HostBackend`]) executes each call on the calling thread, so a stream's
//! work happens where it is issued; the CUDA backend (`crate::cuda::CudaBackend`, feature
//! `cuda`) enqueues it on a CUDA stream and reports what its kernels computed after the step
//! ([`Backend::step_outcome`]).

use crate::collective::Collective;
use crate::dispatch::{Outcome, Pitches, Prepared};
use crate::error::{Result, RuntimeError};
use crate::kernels::{self, AdamWStep};
use protrain_ir::{
    DType, EventId, Graph, Op, OpKind, Schedule, Space, StreamKind, TensorRef, ValueId,
};
use std::collections::HashMap;

/// A byte address in the device arena or the host region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Address {
    /// Which memory.
    pub space: Space,
    /// Byte offset from its start.
    pub offset: u64,
}

impl Address {
    /// Where the schedule keeps the tensor `t`.
    pub fn of(schedule: &Schedule, t: TensorRef) -> Self {
        let (space, offset) = schedule.address(t);
        Self { space, offset }
    }
}

/// The f32 master weight of a parameter stored in a narrower type (mixed precision), as the
/// schedule lists it ([`Schedule::masters`]), with the home of the parameter's Adam `m`, by
/// which a backend's AdamW kernel (which reads `m` as its third input) finds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MasterWeight {
    /// The parameter's value.
    pub param: ValueId,
    /// The home of its Adam `m`.
    pub m: Address,
    /// The home of its f32 master weight.
    pub master: Address,
}

/// The master weight of every parameter that an AdamW op updates and whose type is narrower
/// than f32, in graph order; empty for an f32 schedule. A verified schedule lists every one
/// ([`protrain_ir::verify_schedule`] checks it); this fails, naming the parameter, when one is
/// missing anyway.
pub fn master_weights(schedule: &Schedule) -> Result<Vec<MasterWeight>> {
    let graph = &schedule.graph;
    let homes: HashMap<ValueId, TensorRef> = schedule.homes.iter().copied().collect();
    let masters: HashMap<ValueId, TensorRef> = schedule.masters.iter().copied().collect();
    let mut out = Vec::new();
    for (_, op) in graph.ops() {
        let OpKind::AdamW { .. } = op.kind else {
            continue;
        };
        let (param, m) = (op.inputs[0], op.inputs[2]);
        let ty = &graph.value(param).ty;
        if ty.dtype == DType::F32 {
            continue;
        }
        let (Some(&mr), Some(&master)) = (homes.get(&m), masters.get(&param)) else {
            return Err(RuntimeError::BadSchedule(format!(
                "{} is {} but the schedule gives it no f32 master weight or Adam moment home; \
                 recompile the schedule with this protrain",
                graph.value(param).name,
                ty
            )));
        };
        out.push(MasterWeight {
            param,
            m: Address::of(schedule, mr),
            master: Address::of(schedule, master),
        });
    }
    Ok(out)
}

/// A kernel to launch: an op of the schedule's graph and where its operands are.
///
/// Operand `i` is the op's `i`-th input or output value, with that value's type; the
/// workspace is `workspace_bytes` of scratch. An AdamW op updates inputs 0, 2 and 3 in place.
///
/// The op is the graph's, except that an AdamW op carries the learning rate of the step
/// being run: the executor launches a copy of it with the rate a learning-rate schedule gives
/// ([`set_learning_rate`]), so every backend's AdamW (the host's, the CUDA kernels and the
/// CUDA backend's CPU Adam) reads this step's rate where it reads the others, from the op.
#[derive(Clone, Copy, Debug)]
pub struct Launch<'a> {
    /// The graph the op belongs to (for operand types).
    pub graph: &'a Graph,
    /// The op; an AdamW op with this step's learning rate.
    pub op: &'a Op,
    /// Its constants, made once before the first step.
    pub prepared: &'a Prepared,
    /// Where each input is read.
    pub inputs: &'a [Address],
    /// Where each output is written.
    pub outputs: &'a [Address],
    /// Scratch memory and its size in bytes, when the op's kind needs some.
    pub workspace: Option<(Address, u64)>,
    /// The 1-based step number (AdamW's bias correction).
    pub step: u64,
    /// For an AdamW op on a sharded chunk: the rank's part of the parameter (see
    /// [`ShardLaunch`]); `None` for every other launch.
    pub shard: Option<ShardLaunch>,
    /// The row pitches of operands stored in padded rows ([`protrain_ir::RowPitch`]);
    /// [`Pitches::DENSE`] for most launches.
    pub pitches: Pitches,
}

/// A rank's part of an AdamW op on a sharded chunk (see
/// [`protrain_ir::BufferKind::HostShard`]): the launch's addresses point at the first element
/// of the parameter (and of its gradient and moments) that the rank holds, and it updates
/// `elements` of them; a narrow parameter's f32 master weight part is at `master`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardLaunch {
    /// Elements the rank updates.
    pub elements: usize,
    /// The rank's part of the f32 master weight, for a parameter narrower than f32.
    pub master: Option<Address>,
}

/// One member of a staged chunk's cast ([`protrain_ir::Instr::CastChunk`]): `len` f32 master
/// weights at `master` rounded into `len` elements of `dtype` (bf16 or f16) at `narrow`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CastPart {
    /// The f32 master weights.
    pub master: Address,
    /// Where the narrow parameters go.
    pub narrow: Address,
    /// Elements.
    pub len: usize,
    /// The narrow type.
    pub dtype: DType,
}

/// A staged chunk's cast (the 12-byte host layout) as data: its members' parts, and the
/// `bytes` at `dst` (the staging buffer) it fills, the bytes between parts zeroed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CastLaunch {
    /// The members, in chunk order.
    pub parts: Vec<CastPart>,
    /// The start of the staging buffer.
    pub dst: Address,
    /// Bytes it fills.
    pub bytes: u64,
}

impl CastLaunch {
    /// The byte ranges of `dst .. dst + bytes` no part writes (padding between members), as
    /// `(offset from dst, bytes)`.
    pub fn gaps(&self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut pos = 0;
        for p in &self.parts {
            let at = p.narrow.offset - self.dst.offset;
            if at > pos {
                out.push((pos, at - pos));
            }
            pos = pos.max(at + p.len as u64 * p.dtype.size());
        }
        if pos < self.bytes {
            out.push((pos, self.bytes - pos));
        }
        out
    }

    /// Runs the cast on the host, with `at(address, bytes, align)` giving a pointer to
    /// `bytes` bytes of host memory at `address` aligned to `align` (or failing): the one
    /// code path of every backend whose host stream runs CPU work.
    ///
    /// # Safety
    ///
    /// The backend's ordering contract holds for the master weights and the staging bytes,
    /// and `at` returns pointers to memory that stays allocated for the call.
    pub unsafe fn run_on_host(
        &self,
        at: impl Fn(Address, u64, usize) -> Result<*mut u8>,
    ) -> Result<()> {
        for (off, len) in self.gaps() {
            let to = at(
                Address {
                    space: self.dst.space,
                    offset: self.dst.offset + off,
                },
                len,
                1,
            )?;
            // SAFETY: `at` checked the range; the ordering contract keeps other work away.
            unsafe { std::ptr::write_bytes(to, 0, len as usize) };
        }
        for p in &self.parts {
            let size = p.dtype.size();
            let master = at(p.master, 4 * p.len as u64, 4)?;
            let narrow = at(p.narrow, size * p.len as u64, size as usize)?;
            // SAFETY: both ranges in bounds and aligned (checked by `at`); a verified cast's
            // master weights and staging bytes do not overlap and nothing else touches them
            // meanwhile (the ordering contract).
            let master = unsafe { std::slice::from_raw_parts(master.cast::<f32>(), p.len) };
            match p.dtype {
                DType::BF16 => crate::kernels::cast_bf16(master, unsafe {
                    std::slice::from_raw_parts_mut(narrow.cast::<half::bf16>(), p.len)
                }),
                DType::F16 => crate::kernels::cast_f16(master, unsafe {
                    std::slice::from_raw_parts_mut(narrow.cast::<half::f16>(), p.len)
                }),
                other => {
                    return Err(RuntimeError::BadSchedule(format!(
                        "a cast into {other} parameters: only bf16 and f16 parameters are \
                         cast from f32 master weights (host_layout=12); recompile the schedule"
                    )))
                }
            }
        }
        Ok(())
    }
}

/// Sets the learning rate of an AdamW op's `kind` to `lr`, the one hyper-parameter that
/// changes from step to step (see [`Launch`]); any other kind is left as it is.
pub fn set_learning_rate(kind: &mut OpKind, lr: f64) {
    if let OpKind::AdamW { lr: rate, .. } = kind {
        *rate = lr;
    }
}

/// Sets the loss scale of a loss-scaled op's `kind` (fp16's loss gradient and unscale
/// coefficient) to `scale`, which the runtime's loss scaler changes from step to step as a
/// learning-rate schedule changes AdamW's rate; any other kind is left as it is.
pub fn set_loss_scale(kind: &mut OpKind, scale: f64) {
    match kind {
        OpKind::CrossEntropyBackwardLossScaled { loss_scale, .. }
        | OpKind::UnscaleCoef { loss_scale, .. } => *loss_scale = scale,
        OpKind::MoeAuxLossBackward {
            loss_scale: Some(loss_scale),
            ..
        } => *loss_scale = scale,
        _ => {}
    }
}

/// Memory, streams and events for executing schedules.
///
/// Every method that issues work takes the stream it is issued on; calls for one stream come
/// from one thread at a time, in the stream's order, while other streams' calls run
/// concurrently from other threads (hence `Sync`).
///
/// # The ordering contract
///
/// [`Backend::launch`] and [`Backend::copy`] read and write memory in place, so they are
/// `unsafe`: the caller guarantees that nothing else (another stream's work, a
/// [`Backend::read_f32`]) touches bytes they write, or writes bytes they read, unless an event
/// or the end of the step orders the two; and that a kernel's outputs and workspace
/// overlap none of its inputs or each other (AdamW's in-place operands aside). A schedule that
/// passes `protrain_ir::verify_schedule` satisfies both when its instructions are issued
/// in stream order with its events, which is what the executor does.
pub trait Backend: Sync + Sized {
    /// One stream's handle, owned by the thread that issues its work.
    type Stream: Send;

    /// Whether the backend executes bf16 values (mixed precision: bf16 parameters,
    /// gradients and activations, f32 master weights and moments).
    const RUNS_BF16: bool = false;

    /// Whether the backend executes f16 values (mixed precision as bf16's, with dynamic loss
    /// scaling).
    const RUNS_F16: bool = false;

    /// Whether the backend runs collectives ([`Backend::all_reduce`]), and so data-parallel
    /// schedules. When it does not, this names what is missing, for the executor's refusal.
    const MISSING_COLLECTIVES: Option<&'static str> = Some("collectives");

    /// Whether the backend runs schedules with a disk tier ([`Backend::attach_disk`]). When
    /// it does not, this names what is missing, for the executor's refusal.
    const MISSING_DISK: Option<&'static str> = Some("disk tier");

    /// Gives the backend the file of a schedule's disk region: copies from and to
    /// [`Space::Disk`](protrain_ir::Space::Disk) addresses read and write it, as do the
    /// `read_*` and `write_*` methods. A backend without a disk tier refuses it.
    fn attach_disk(&mut self, disk: crate::disk::DiskFile) -> Result<()> {
        Err(RuntimeError::Unsupported(
            crate::error::Unsupported::DiskFile {
                path: disk.path().to_path_buf(),
                missing: Self::MISSING_DISK.unwrap_or("disk tier"),
            },
        ))
    }

    /// Allocates the device arena and the host region, zeroed, and `events` events.
    fn new(arena_bytes: u64, host_bytes: u64, events: u32) -> Result<Self>;

    /// Sees the verified schedule once, after [`Backend::new`] and before any stream is
    /// created, to learn what the addresses of a launch do not say (where the f32 master
    /// weight of a bf16 parameter is). The host backend needs nothing.
    fn prepare(&mut self, schedule: &Schedule) -> Result<()> {
        let _ = schedule;
        Ok(())
    }

    /// Creates a stream for work of `kind`.
    fn create_stream(&self, kind: StreamKind) -> Result<Self::Stream>;

    /// Marks every event unrecorded, before a step's work is issued.
    fn begin_step(&mut self);

    /// Runs (or enqueues) a kernel on `stream`. What it reports (loss, gradient norm) may be
    /// absent on a backend that runs kernels asynchronously.
    ///
    /// # Safety
    ///
    /// The ordering contract (see the trait doc) holds for the kernel's operands.
    unsafe fn launch(&self, stream: &mut Self::Stream, launch: &Launch<'_>) -> Result<Outcome>;

    /// Copies `bytes` from `src` to `dst` on `stream`.
    ///
    /// # Safety
    ///
    /// The ordering contract (see the trait doc) holds for both ranges.
    unsafe fn copy(
        &self,
        stream: &mut Self::Stream,
        src: Address,
        dst: Address,
        bytes: u64,
    ) -> Result<()>;

    /// Sums `len` elements of `dtype` (f32 or bf16) at `at` over the ranks of `comm`, in place,
    /// on `stream`: every rank calls it with the same arguments, in the same order.
    ///
    /// # Safety
    ///
    /// The ordering contract (see the trait doc) holds for the range.
    unsafe fn all_reduce(
        &self,
        stream: &mut Self::Stream,
        at: Address,
        dtype: DType,
        len: usize,
        comm: &mut dyn Collective,
    ) -> Result<()> {
        let _ = (stream, at, dtype, len, comm);
        Err(RuntimeError::BadSchedule(format!(
            "this backend has no {}; run data-parallel schedules on the host backend",
            Self::MISSING_COLLECTIVES.unwrap_or("collectives")
        )))
    }

    /// All-gathers a sharded chunk in place on `stream`: rank `r` holds `bytes` at
    /// `at + r * bytes`, and afterwards every rank holds every rank's `bytes` there (the
    /// ranks of `comm`, each calling it with the same arguments, in the same order).
    ///
    /// # Safety
    ///
    /// The ordering contract (see the trait doc) holds for the `ranks * bytes` at `at`.
    unsafe fn all_gather(
        &self,
        stream: &mut Self::Stream,
        at: Address,
        bytes: u64,
        comm: &mut dyn Collective,
    ) -> Result<()> {
        let _ = (stream, at, bytes, comm);
        Err(RuntimeError::BadSchedule(format!(
            "this backend has no {}; run data-parallel schedules on the host backend",
            Self::MISSING_COLLECTIVES.unwrap_or("collectives")
        )))
    }

    /// Reduce-scatters `ranks * len` elements of `dtype` at `at` in place on `stream`: rank
    /// `r`'s slice of `len` elements at `at + r * len` becomes the sum over the ranks of their
    /// slice `r`, added in rank order (narrow values rounded after each add, as
    /// [`Backend::all_reduce`] does); the other slices are left undefined.
    ///
    /// # Safety
    ///
    /// The ordering contract (see the trait doc) holds for the whole range.
    unsafe fn reduce_scatter(
        &self,
        stream: &mut Self::Stream,
        at: Address,
        dtype: DType,
        len: usize,
        comm: &mut dyn Collective,
    ) -> Result<()> {
        let _ = (stream, at, dtype, len, comm);
        Err(RuntimeError::BadSchedule(format!(
            "this backend has no {}; run data-parallel schedules on the host backend",
            Self::MISSING_COLLECTIVES.unwrap_or("collectives")
        )))
    }

    /// Sums `len` elements of `dtype` at `grad` over the ranks into the accumulator of as
    /// many at `acc` on `stream`, the same on every rank; returns whether it did.
    ///
    /// A backend that can starts from the accumulator's value and adds every rank's gradient
    /// in rank order, `((acc + g0) + g1) + ...` (narrow values rounded after each add): the
    /// sums one rank makes accumulating the ranks' gradients one micro-batch after another
    /// ([`Collective::all_reduce_into`]), and returns `true`. This default sums the gradient
    /// over the ranks in place ([`Backend::all_reduce`]) and returns `false`, for the caller
    /// to add it to the accumulator with the `accumulate_grad` kernel after it on `stream`:
    /// `acc + (g0 + g1 + ...)`, which is NCCL's way and not one rank's bits. Either way the
    /// gradient's bytes are its last reader's to overwrite.
    ///
    /// # Safety
    ///
    /// The ordering contract (see the trait doc) holds for both ranges.
    unsafe fn all_reduce_into(
        &self,
        stream: &mut Self::Stream,
        acc: Address,
        grad: Address,
        dtype: DType,
        len: usize,
        comm: &mut dyn Collective,
    ) -> Result<bool> {
        let _ = acc;
        // SAFETY: the caller's contract covers the gradient's range.
        unsafe { self.all_reduce(stream, grad, dtype, len, comm)? };
        Ok(false)
    }

    /// Sums `len` elements of `dtype` at `grad` (each rank's gradient of a sharded chunk's
    /// parameter, where the backward pass left it) over the ranks into the part of the
    /// parameter's accumulator this rank holds, elements `part` of the `len`, at `acc`, on
    /// `stream`; every rank calls it with the same `grad`, `dtype` and `len`, in the same
    /// order, a rank holding none of the accumulator with an empty `part` (and `acc`
    /// unused). Element `i` becomes `((acc[i] + g0[i]) + g1[i]) + ...` in rank order,
    /// narrow values rounded after each add: the sums one rank makes accumulating the ranks'
    /// gradients one micro-batch after another, kept only where this rank holds them (a
    /// reduce-scatter into the accumulator shards).
    ///
    /// # Safety
    ///
    /// The ordering contract (see the trait doc) holds for both ranges.
    #[allow(clippy::too_many_arguments)]
    unsafe fn accumulate_into_shard(
        &self,
        stream: &mut Self::Stream,
        acc: Address,
        part: std::ops::Range<usize>,
        grad: Address,
        dtype: DType,
        len: usize,
        comm: &mut dyn Collective,
    ) -> Result<()>;

    /// Runs a staged chunk's cast (the 12-byte host layout, [`CastLaunch`]) on `stream`, a
    /// host cast stream. A backend whose host streams cannot run CPU work refuses it.
    ///
    /// # Safety
    ///
    /// The ordering contract (see the trait doc) holds for the master weights and the
    /// staging bytes.
    unsafe fn cast(&self, stream: &mut Self::Stream, cast: &CastLaunch) -> Result<()> {
        let _ = (stream, cast);
        Err(RuntimeError::BadSchedule(
            "the schedule stages chunks (host_layout=12: uploads cast from the f32 master \
             weights on the host), which this backend cannot run; compile with host_layout=14 \
             in the policy, or run it on the host backend"
                .into(),
        ))
    }

    /// Launches a run of adjacent AdamW kernels of one stream (no event between them; a run
    /// may be one kernel), calling `ended(i)` as soon as `launches[i]` is done: by default each
    /// as [`Backend::launch`], one after another. The host backend resolves them all and
    /// updates them in one parallel pass ([`Backend::run_host_adamw`]).
    ///
    /// # Safety
    ///
    /// The ordering contract (see the trait doc) holds for every kernel's operands, and no
    /// kernel of the run reads or writes what another writes (each updates its own parameter,
    /// moments and gradient, as a schedule's optimizer stream issues them).
    unsafe fn launch_adamw_run(
        &self,
        stream: &mut Self::Stream,
        launches: &[Launch<'_>],
        ended: &(dyn Fn(usize) + Sync),
    ) -> Result<Outcome> {
        let mut outcome = Outcome::default();
        for (i, launch) in launches.iter().enumerate() {
            // SAFETY: the caller's contract.
            outcome = outcome.merge(unsafe { self.launch(stream, launch)? });
            ended(i);
        }
        Ok(outcome)
    }

    /// Updates a run of AdamW steps whose state is in host memory as this backend's host
    /// optimizer updates a run of AdamW kernels ([`Backend::launch_adamw_run`]), calling
    /// `ended(i)` as soon as `steps[i]` is done: by default one after another on the calling
    /// thread. The profiler times the host optimizer through it.
    fn run_host_adamw(&self, steps: Vec<AdamWStep<'_>>, ended: &(dyn Fn(usize) + Sync)) {
        kernels::adamw_steps_in_turn(steps, ended);
    }

    /// Records `event` once the work issued on `stream` so far is done.
    fn record(&self, stream: &mut Self::Stream, event: EventId) -> Result<()>;

    /// Makes the work issued on `stream` from now on wait until `event` is recorded. Fails if
    /// the step is aborted meanwhile.
    fn wait(&self, stream: &mut Self::Stream, event: EventId) -> Result<()>;

    /// Blocks until the work issued on `stream` is done.
    fn synchronize(&self, stream: &mut Self::Stream) -> Result<()>;

    /// Abandons the step after a stream failed: every current and future `wait` fails until
    /// the next [`Backend::begin_step`], so no stream waits forever for a failed one.
    fn abort(&self);

    /// Writes f32 values at `at`, between steps.
    fn write_f32(&mut self, at: Address, data: &[f32]) -> Result<()>;

    /// Writes i32 values at `at`, between steps.
    fn write_i32(&mut self, at: Address, data: &[i32]) -> Result<()>;

    /// Zeroes `bytes` bytes at `at`, between steps.
    fn fill_zero(&mut self, at: Address, bytes: u64) -> Result<()>;

    /// Reads f32 values at `at` into `out`, between steps.
    fn read_f32(&self, at: Address, out: &mut [f32]) -> Result<()>;

    /// Writes bf16 values at `at`, between steps. Only a backend that
    /// [runs bf16](Backend::RUNS_BF16) has any.
    fn write_bf16(&mut self, at: Address, data: &[half::bf16]) -> Result<()> {
        let _ = (at, data);
        Err(no_bf16())
    }

    /// Reads bf16 values at `at` into `out`, between steps; see [`Backend::write_bf16`].
    fn read_bf16(&self, at: Address, out: &mut [half::bf16]) -> Result<()> {
        let _ = (at, out);
        Err(no_bf16())
    }

    /// Writes f16 values at `at`, between steps. Only a backend that
    /// [runs f16](Backend::RUNS_F16) has any.
    fn write_f16(&mut self, at: Address, data: &[half::f16]) -> Result<()> {
        let _ = (at, data);
        Err(no_bf16())
    }

    /// Reads f16 values at `at` into `out`, between steps; see [`Backend::write_f16`].
    fn read_f16(&self, at: Address, out: &mut [half::f16]) -> Result<()> {
        let _ = (at, out);
        Err(no_bf16())
    }

    /// What the step's kernels reported that [`Backend::launch`] could not return because
    /// they ran asynchronously (the gradient norm), read once every stream is synchronized.
    /// The loss is read from its home by the executor, whatever the backend.
    fn step_outcome(&mut self) -> Result<Outcome> {
        Ok(Outcome::default())
    }
}

/// Why a backend without bf16 kernels cannot hold bf16 values.
fn no_bf16() -> RuntimeError {
    RuntimeError::BadSchedule(
        "this backend executes f32 values only; compile the schedule with dtype f32".into(),
    )
}
