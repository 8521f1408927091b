//! The host backend: the arena and the host region in host memory, streams as threads.
//!
//! The device arena is one 256-byte-aligned allocation of exactly the planned size, the host
//! region another; every tensor is read and written in place at its planned offset. A stream's
//! work runs on the thread that issues it (the executor gives each stream its own thread),
//! kernels use rayon inside (every stream thread shares the global pool, which is how rayon is
//! meant to be called from several threads), copies are `memcpy` on the issuing thread, and
//! events are real synchronisation: a flag per event under one mutex, with a condition
//! variable that wakes waiters.
//!
//! Mixed precision: a bf16 schedule runs as on the CUDA backend, and an f16 one alike (f16
//! storage rounded to nearest even, overflowing to infinity; its loss scaling is the
//! schedule's ops and the executor's scale). bf16 values are stored as
//! bf16 in the arena and the host region; each kernel widens its bf16 inputs, computes in f32
//! and rounds its bf16 outputs to nearest even as it writes them, with the CUDA kernels'
//! intermediate rounding points ([`dispatch::run_stored`], through per-stream staging buffers
//! that grow in the first step and are reused after). AdamW updates each bf16 parameter's f32
//! master weight (found by its Adam `m`, as [`Backend::prepare`] records them) with f32
//! moments and rewrites the bf16 parameter from it, with the CPU Adam's code and bits.

use crate::affinity;
use crate::backend::master_weights;
use crate::backend::{Address, Backend, Launch};
use crate::collective::Collective;
use crate::disk::DiskFile;
use crate::dispatch::{self, Outcome, Staging, Stored, StoredMut, MAX_OUTPUTS};
use crate::error::{Result, RuntimeError};
use crate::kernels::{self, bf16, f16, AdamWStep, Grad, Low};
use crate::memory::{check_host_memory, memory_available, HostRegion, MemoryNeed};
use bytemuck::Pod;
use protrain_ir::{DType, EventId, OpKind, Schedule, Space, StreamKind, TensorType};
use std::alloc::Layout;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

/// Alignment of the arena and the host region, as the planner aligns buffers.
pub const REGION_ALIGN: usize = 256;

/// One zeroed, aligned allocation of an exact size.
struct Region {
    ptr: NonNull<u8>,
    len: usize,
    /// `None` for an empty region, which allocates nothing.
    layout: Option<Layout>,
    /// For error messages.
    name: &'static str,
}

/// The alignment an empty region's dangling pointer has.
#[repr(C, align(256))]
struct Aligned([u8; REGION_ALIGN]);

// SAFETY: a `Region` owns its bytes like a `Box<[u8]>` does; it hands out raw pointers only
// through `HostBackend`, whose users uphold the schedule's ordering contract (see
// `HostBackend::slice`), so sharing and sending it between threads is sound.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    fn new(bytes: u64, name: &'static str) -> Result<Self> {
        let too_big = || {
            RuntimeError::BadSchedule(format!(
                "the {name} of {bytes} bytes cannot be allocated on this machine"
            ))
        };
        let len = usize::try_from(bytes).map_err(|_| too_big())?;
        if len == 0 {
            return Ok(Self {
                ptr: NonNull::<Aligned>::dangling().cast(),
                len,
                layout: None,
                name,
            });
        }
        let layout = Layout::from_size_align(len, REGION_ALIGN).map_err(|_| too_big())?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(too_big)?;
        Ok(Self {
            ptr,
            len,
            layout: Some(layout),
            name,
        })
    }

    /// The pointer to `bytes` bytes at `offset`, aligned to `align`, or why there is none.
    fn at(&self, offset: u64, bytes: u64, align: usize) -> Result<*mut u8> {
        let end = offset.checked_add(bytes);
        if end.is_none_or(|end| end > self.len as u64) {
            return Err(RuntimeError::BadSchedule(format!(
                "{bytes} bytes at offset {offset} lie outside the {} of {} bytes",
                self.name, self.len
            )));
        }
        if !offset.is_multiple_of(align as u64) {
            return Err(RuntimeError::BadSchedule(format!(
                "offset {offset} in the {} is not aligned to {align} bytes",
                self.name
            )));
        }
        // SAFETY: `offset + bytes <= len`, so the result is inside the allocation or one past
        // its end.
        Ok(unsafe { self.ptr.as_ptr().add(offset as usize) })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if let Some(layout) = self.layout {
            // SAFETY: allocated in `Region::new` with this layout, freed once.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
        }
    }
}

/// Which events are recorded this step, and whether the step was abandoned.
struct EventState {
    recorded: Vec<bool>,
    aborted: bool,
}

/// The host backend. See the module doc.
pub struct HostBackend {
    arena: Region,
    host: Region,
    events: Mutex<EventState>,
    event_recorded: Condvar,
    /// The f32 master weight of each bf16 parameter, by the home of its Adam `m`.
    masters: HashMap<(Space, u64), Address>,
    /// The disk region's file, for a schedule with a disk tier.
    disk: Option<DiskFile>,
}

/// A host stream: its work runs on the thread that issues it.
#[derive(Debug)]
pub struct HostStream {
    kind: StreamKind,
    /// f32 copies of a bf16 op's operands (see [`dispatch::Staging`]).
    staging: Staging,
}

impl HostStream {
    /// What the stream is for.
    pub fn kind(&self) -> StreamKind {
        self.kind
    }
}

impl HostBackend {
    /// Records that the f32 master weight of the bf16 parameter whose Adam `m` is at `m`
    /// lives at `master`. [`Backend::prepare`] does this for every parameter of a schedule; a
    /// caller that launches a bf16 AdamW outside a schedule (a test) does it itself.
    pub fn set_master_weight(&mut self, m: Address, master: Address) {
        self.masters.insert((m.space, m.offset), master);
    }

    /// The master weight of the parameter whose `m` is at `m`.
    fn master_weight(&self, m: Address) -> Result<Address> {
        self.masters
            .get(&(m.space, m.offset))
            .copied()
            .ok_or_else(|| {
                RuntimeError::BadSchedule(format!(
                    "a bf16 AdamW reads its moment at {:?}+{} but no f32 master weight is \
                     known for it; run mixed-precision schedules through the executor, which \
                     finds them",
                    m.space, m.offset
                ))
            })
    }

    fn region(&self, space: Space) -> Result<&Region> {
        match space {
            Space::Device => Ok(&self.arena),
            Space::Host => Ok(&self.host),
            Space::Disk => Err(RuntimeError::BadSchedule(
                "a kernel addresses the disk region, which only disk reads and writes touch".into(),
            )),
        }
    }

    /// The disk region's file.
    fn disk(&self) -> Result<&DiskFile> {
        self.disk.as_ref().ok_or(RuntimeError::Unsupported(
            crate::error::Unsupported::NoDiskDir { held: None },
        ))
    }

    /// Writes `data` at `at`, in memory or in the disk file.
    fn put<T: Pod>(&mut self, at: Address, data: &[T]) -> Result<()> {
        if at.space == Space::Disk {
            return self.disk()?.write(at.offset, bytemuck::cast_slice(data));
        }
        // SAFETY: `&mut self`: no step is running, so no other view exists.
        unsafe { self.slice_mut(at, data.len())? }.copy_from_slice(data);
        Ok(())
    }

    /// Reads `out.len()` elements at `at`, from memory or from the disk file.
    fn get<T: Pod>(&self, at: Address, out: &mut [T]) -> Result<()> {
        if at.space == Space::Disk {
            return self.disk()?.read(at.offset, bytemuck::cast_slice_mut(out));
        }
        // SAFETY: nothing writes these bytes meanwhile: a `launch` or `copy` writing them
        // concurrently would break the ordering contract its caller promised.
        out.copy_from_slice(unsafe { self.slice(at, out.len())? });
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, EventState> {
        // A thread that panicked while holding the lock left only flags behind: still valid.
        self.events.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A shared view of `len` elements at `at`.
    ///
    /// # Safety
    ///
    /// While the view lives, no thread may write any of its bytes: the backend's ordering
    /// contract (see [`Backend`]). For a verified schedule (`protrain_ir::verify_schedule`)
    /// the verifier proves it: no two instructions on different streams touch overlapping
    /// bytes unless an event orders them, and a kernel's outputs overlap none of its inputs.
    unsafe fn slice<T: Pod>(&self, at: Address, len: usize) -> Result<&[T]> {
        let size = std::mem::size_of::<T>();
        let ptr =
            self.region(at.space)?
                .at(at.offset, (len * size) as u64, std::mem::align_of::<T>())?;
        // SAFETY: in bounds and aligned (checked above); zero-initialised at allocation and
        // every bit pattern is a `T` (`Pod`); unaliased by writers per the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts(ptr.cast::<T>(), len) })
    }

    /// An exclusive view of `len` elements at `at`.
    ///
    /// # Safety
    ///
    /// While the view lives, no other view of any of its bytes may exist on any thread: the
    /// contract of [`HostBackend::slice`], which a verified schedule satisfies, including that
    /// a kernel's outputs, workspace and in-place operands overlap nothing else it touches.
    #[allow(clippy::mut_from_ref)] // Interior mutability through raw memory; see the contract.
    unsafe fn slice_mut<T: Pod>(&self, at: Address, len: usize) -> Result<&mut [T]> {
        let size = std::mem::size_of::<T>();
        let ptr =
            self.region(at.space)?
                .at(at.offset, (len * size) as u64, std::mem::align_of::<T>())?;
        // SAFETY: as in `slice`, and no other view exists per the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr.cast::<T>(), len) })
    }

    /// Where AdamW launch `l`'s operands are, checked against its op; nothing is viewed yet.
    /// An f32 parameter is its own master weight; a bf16 (f16) one has an f32 master weight
    /// ([`HostBackend::master_weight`], or its part in a sharded chunk's launch) and a bf16
    /// (f16) gradient, which the 14-byte host layout keeps in the parameter's storage.
    fn adamw_operands<'l>(&self, l: &'l Launch<'_>) -> Result<AdamWOperands<'l>> {
        let (graph, op) = (l.graph, l.op);
        let OpKind::AdamW { clipped, .. } = op.kind else {
            return Err(RuntimeError::BadSchedule(format!(
                "{} launched as an AdamW kernel of the optimizer's run",
                op.kind.mnemonic()
            )));
        };
        if l.inputs.len() != op.inputs.len() || op.inputs.len() < 4 + usize::from(clipped) {
            return Err(RuntimeError::BadSchedule(format!(
                "adamw has {} inputs but its kernel gives {} addresses",
                op.inputs.len(),
                l.inputs.len()
            )));
        }
        let ty = |i: usize| &graph.value(op.inputs[i]).ty;
        let (param, grad) = (ty(0), ty(1));
        // A sharded chunk's rank updates its part of every operand.
        let n = l
            .shard
            .map_or(param.numel() as usize, |shard| shard.elements);
        let coef = clipped.then(|| l.inputs[4]);
        let (m, v) = (l.inputs[2], l.inputs[3]);
        if param.dtype == DType::F32 {
            return Ok(AdamWOperands {
                kind: &op.kind,
                n,
                master: l.inputs[0],
                low: None,
                grad: Some((l.inputs[1], grad.dtype)),
                m,
                v,
                coef,
                step: l.step,
            });
        }
        let narrow = matches!(param.dtype, DType::BF16 | DType::F16);
        if !narrow
            || (grad.dtype, ty(2).dtype, ty(3).dtype) != (param.dtype, DType::F32, DType::F32)
        {
            return Err(RuntimeError::BadSchedule(format!(
                "adamw of a {param} parameter with a {grad} gradient and {} moments; the host \
                 updates f32 parameters, or bf16 (f16) ones from bf16 (f16) gradients with f32 \
                 moments",
                ty(2)
            )));
        }
        // A sharded chunk's rank updates its part, whose master weight the launch gives.
        let master = match l.shard {
            Some(shard) => shard.master.ok_or_else(|| {
                RuntimeError::BadSchedule(format!(
                    "a sharded {param} AdamW without its f32 master weight part"
                ))
            })?,
            None => self.master_weight(l.inputs[2])?,
        };
        // The 14-byte host layout: the gradient sits in the parameter's own storage (the
        // verifier allows exactly that overlap and no partial one).
        let in_low = l.inputs[0] == l.inputs[1];
        Ok(AdamWOperands {
            kind: &op.kind,
            n,
            master,
            low: Some((l.inputs[0], param.dtype)),
            grad: (!in_low).then_some((l.inputs[1], grad.dtype)),
            m,
            v,
            coef,
            step: l.step,
        })
    }

    /// The AdamW step of `o`'s operands, viewed where they are; `None` for a loss-scaled step
    /// that is skipped.
    ///
    /// # Safety
    ///
    /// The backend's ordering contract holds for the operands while the step lives: param,
    /// grad, m, v, the coefficient and the master weight are distinct values at distinct
    /// homes, so the views do not overlap, but for a gradient in the parameter's storage,
    /// which is then not viewed apart (`Grad::InLow`).
    unsafe fn adamw_step_of(&self, o: &AdamWOperands<'_>) -> Result<Option<AdamWStep<'_>>> {
        let n = o.n;
        // SAFETY (every view): the caller's contract.
        unsafe {
            let coef = match o.coef {
                Some(at) => Some(self.slice::<f32>(at, 1)?[0]),
                None => None,
            };
            let master = self.slice_mut::<f32>(o.master, n)?;
            let low = match o.low {
                None => None,
                Some((at, DType::BF16)) => Some(Low::Bf16(self.slice_mut::<bf16>(at, n)?)),
                Some((at, _)) => Some(Low::F16(self.slice_mut::<f16>(at, n)?)),
            };
            let grad = match o.grad {
                None => Grad::InLow,
                Some((at, DType::F32)) => Grad::F32(self.slice::<f32>(at, n)?),
                Some((at, DType::BF16)) => Grad::Bf16(self.slice::<bf16>(at, n)?),
                Some((at, _)) => Grad::F16(self.slice::<f16>(at, n)?),
            };
            let m = self.slice_mut::<f32>(o.m, n)?;
            let v = self.slice_mut::<f32>(o.v, n)?;
            Ok(dispatch::adamw_step(
                o.kind, master, grad, m, v, low, coef, o.step,
            ))
        }
    }
}

/// Where an AdamW launch's operands are ([`HostBackend::adamw_operands`]).
struct AdamWOperands<'l> {
    kind: &'l OpKind,
    /// Elements the launch updates.
    n: usize,
    /// The f32 master weight: the parameter itself when it is f32.
    master: Address,
    /// A bf16 (f16) parameter's own storage, and its type.
    low: Option<(Address, DType)>,
    /// The gradient and its type; `None` when it is in the parameter's storage.
    grad: Option<(Address, DType)>,
    m: Address,
    v: Address,
    /// The clip coefficient, read before the step.
    coef: Option<Address>,
    step: u64,
}

impl AdamWOperands<'_> {
    /// The bytes the step reads or writes, as (space, first byte, end): the coefficient,
    /// read before the step and only read, left out.
    fn ranges(&self) -> impl Iterator<Item = (Space, u64, u64)> + '_ {
        let n = self.n as u64;
        let wide = [self.master, self.m, self.v].map(|at| (at, DType::F32));
        wide.into_iter()
            .chain(self.low)
            .chain(self.grad)
            .map(move |(at, dtype)| (at.space, at.offset, at.offset + n * dtype.size()))
    }
}

/// Whether any two of the runs' operands share a byte: the steps then cannot be updated
/// together. A schedule's optimizer stream never issues such a run (each AdamW op updates
/// its own parameter, moments and gradient, all live at once); the check keeps the pass
/// sound for any schedule.
fn any_overlap(run: &[AdamWOperands<'_>]) -> bool {
    let mut ranges: Vec<(Space, u64, u64)> = run.iter().flat_map(AdamWOperands::ranges).collect();
    ranges.sort_by_key(|&(space, start, _)| (space, start));
    ranges
        .windows(2)
        .any(|w| w[0].0 == w[1].0 && w[1].1 < w[0].2)
}

/// Bytes per element of a dtype the host stores, or why it stores no such values.
fn element_bytes(ty: &TensorType) -> Result<u64> {
    match ty.dtype {
        DType::F32 | DType::I32 => Ok(4),
        DType::BF16 | DType::F16 => {
            let _ = ty;
            Ok(2)
        }
    }
}

/// A kernel's inputs at their planned addresses, each in its graph type, checked in bounds
/// and aligned before the kernel runs.
struct ArenaInputs<'a> {
    backend: &'a HostBackend,
    launch: &'a Launch<'a>,
}

impl ArenaInputs<'_> {
    fn ty(&self, i: usize) -> &TensorType {
        &self.launch.graph.value(self.launch.op.inputs[i]).ty
    }

    /// Elements of input `i`'s view: its type's, or `rows x pitch` in padded rows.
    fn len(&self, i: usize) -> u64 {
        let ty = self.ty(i);
        match self.launch.pitches.input(i) {
            Some(pitch) => ty.rows() * pitch as u64,
            None => ty.numel(),
        }
    }

    /// Checks every input's type, range and alignment, so the views below cannot fail.
    fn check(&self) -> Result<()> {
        if self.launch.inputs.len() != self.launch.op.inputs.len() {
            return Err(RuntimeError::BadSchedule(format!(
                "{} has {} inputs but its kernel gives {} addresses",
                self.launch.op.kind.mnemonic(),
                self.launch.op.inputs.len(),
                self.launch.inputs.len()
            )));
        }
        for (i, at) in self.launch.inputs.iter().enumerate() {
            let ty = self.ty(i);
            let size = element_bytes(ty)?;
            self.backend
                .region(at.space)?
                .at(at.offset, size * self.len(i), size as usize)?;
        }
        Ok(())
    }
}

impl<'a> dispatch::StoredInputs<'a> for ArenaInputs<'a> {
    fn stored(&self, i: usize) -> Stored<'a> {
        let (at, ty) = (self.launch.inputs[i], self.ty(i));
        let n = self.len(i) as usize;
        // SAFETY: in bounds and aligned for its type (checked in `check`); the ordering
        // contract `launch` was called under keeps writers away while the kernel reads.
        let stored = unsafe {
            match ty.dtype {
                DType::BF16 => self.backend.slice(at, n).map(Stored::Bf16),
                DType::F16 => self.backend.slice(at, n).map(Stored::F16),
                DType::I32 => self.backend.slice(at, n).map(Stored::I32),
                _ => self.backend.slice(at, n).map(Stored::F32),
            }
        };
        stored.expect("inputs were checked before the kernel ran")
    }
}

impl HostBackend {
    /// `acc += grad` in place (an `accumulate_grad` op), in the accumulator's type: f32, or
    /// bf16 summed in f32 and rounded to nearest even.
    ///
    /// # Safety
    ///
    /// As [`Backend::launch`]: nothing else touches the accumulator or the gradient meanwhile.
    unsafe fn accumulate(&self, l: &Launch<'_>) -> Result<Outcome> {
        let (graph, op) = (l.graph, l.op);
        if l.inputs.len() != 2 || op.inputs.len() != 2 {
            return Err(RuntimeError::BadSchedule(format!(
                "accumulate_grad has {} inputs but its kernel gives {} addresses; it takes 2",
                op.inputs.len(),
                l.inputs.len()
            )));
        }
        let ty = &graph.value(op.inputs[0]).ty;
        let len = ty.numel() as usize;
        // SAFETY: the caller's contract.
        unsafe {
            match (ty.dtype, graph.value(op.inputs[1]).ty.dtype) {
                (DType::F32, DType::F32) => {
                    let acc = self.slice_mut::<f32>(l.inputs[0], len)?;
                    crate::kernels::add_assign(acc, self.slice::<f32>(l.inputs[1], len)?);
                }
                (DType::BF16, DType::BF16) => {
                    let acc = self.slice_mut::<half::bf16>(l.inputs[0], len)?;
                    crate::kernels::add_assign_bf16(
                        acc,
                        self.slice::<half::bf16>(l.inputs[1], len)?,
                    );
                }
                (DType::F16, DType::F16) => {
                    let acc = self.slice_mut::<f16>(l.inputs[0], len)?;
                    crate::kernels::add_assign_f16(acc, self.slice::<f16>(l.inputs[1], len)?);
                }
                (a, g) => {
                    return Err(RuntimeError::BadSchedule(format!(
                        "accumulate_grad sums a {g} gradient into a {a} accumulator; the host \
                         kernels sum f32 into f32, bf16 into bf16 and f16 into f16"
                    )))
                }
            }
        }
        Ok(Outcome::default())
    }
}

/// Sums 2-byte values over the ranks in rank order, `add` rounding after each one: every rank
/// gathers every rank's values and sums them alike, so all end with the same bits (the
/// reduce-scatter of the whole range).
fn all_reduce_narrow<T: Copy>(
    values: &mut [T],
    comm: &mut dyn Collective,
    to_bits: fn(T) -> u16,
    from_bits: fn(u16) -> T,
    add: fn(T, T) -> T,
) -> Result<()> {
    let all = 0..values.len();
    reduce_scatter_narrow(values, all, comm, to_bits, from_bits, add)
}

/// `acc[k]` plus every rank's `grad[part.start + k]`, each rank's whole gradient gathered
/// from every rank and added to the accumulator one by one in rank order (`add` rounds as
/// the element type does): the rank's part of a sharded accumulator. Every rank gathers,
/// whatever its part, so that every rank issues the same collective.
fn reduce_part_into<T: Copy, const N: usize>(
    acc: &mut [T],
    part: std::ops::Range<usize>,
    grad: &[T],
    comm: &mut dyn Collective,
    to_le: fn(T) -> [u8; N],
    from_le: fn([u8; N]) -> T,
    add: fn(T, T) -> T,
) -> Result<()> {
    let send: Vec<u8> = grad.iter().flat_map(|&v| to_le(v)).collect();
    let mut all = vec![0u8; send.len() * comm.world()];
    comm.all_gather(&send, &mut all)?;
    let len = grad.len();
    for (a, i) in acc.iter_mut().zip(part) {
        *a = (0..comm.world()).fold(*a, |sum, r| {
            let at = (r * len + i) * N;
            let mut bytes = [0u8; N];
            bytes.copy_from_slice(&all[at..at + N]);
            add(sum, from_le(bytes))
        });
    }
    Ok(())
}

/// `values[mine]` = the sum over the ranks of each one's `values[mine]`, gathered from every
/// rank and added in rank order from a zero (as into a zeroed accumulator), rounded after
/// each add.
fn reduce_scatter_narrow<T: Copy>(
    values: &mut [T],
    mine: std::ops::Range<usize>,
    comm: &mut dyn Collective,
    to_bits: fn(T) -> u16,
    from_bits: fn(u16) -> T,
    add: fn(T, T) -> T,
) -> Result<()> {
    let send: Vec<u8> = values
        .iter()
        .flat_map(|&v| to_bits(v).to_le_bytes())
        .collect();
    let mut all = vec![0u8; send.len() * comm.world()];
    comm.all_gather(&send, &mut all)?;
    let len = values.len();
    let rank = |r: usize, i: usize| {
        let at = (r * len + i) * 2;
        from_bits(u16::from_le_bytes([all[at], all[at + 1]]))
    };
    let zero = from_bits(0);
    for i in mine {
        values[i] = (0..comm.world()).fold(zero, |sum, r| add(sum, rank(r, i)));
    }
    Ok(())
}

/// The thread pool the host optimizer's AdamW runs run on ([`Backend::run_host_adamw`]):
/// as many threads as the global pool the compute kernels use, made on first use and kept for
/// the process. `None` when its threads cannot be made; the runs then go to the global pool.
///
/// Its thread `i` is pinned to the `i`-th CPU the process may use ([`affinity::cpu_for`]),
/// so a run's blocks are spread over every core. Unpinned, the scheduler woke both threads
/// onto one core for some of a run's few milliseconds, and the run went at one core's rate
/// with the other core idle (`benches/RESULTS.md`, the fidelity bench's lone AdamW runs).
/// The compute pool's threads stay unpinned, so the scheduler still balances them around.
fn optimizer_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let allowed = affinity::allowed_cpus();
        rayon::ThreadPoolBuilder::new()
            .num_threads(rayon::current_num_threads())
            .thread_name(|i| format!("protrain-adam-{i}"))
            .start_handler(move |i| {
                if let Some(cpu) = affinity::cpu_for(i, &allowed) {
                    affinity::pin_current_thread(cpu);
                }
            })
            .build()
            .ok()
    })
    .as_ref()
}

impl Backend for HostBackend {
    type Stream = HostStream;

    /// The run's steps resolved, then updated in one parallel pass ([`Backend::run_host_adamw`]).
    /// Were any two to share a byte (no schedule issues such a run), one after another.
    unsafe fn launch_adamw_run(
        &self,
        _stream: &mut HostStream,
        launches: &[Launch<'_>],
        ended: &(dyn Fn(usize) + Sync),
    ) -> Result<Outcome> {
        let run = launches
            .iter()
            .map(|l| self.adamw_operands(l))
            .collect::<Result<Vec<_>>>()?;
        if any_overlap(&run) {
            for (i, operands) in run.iter().enumerate() {
                // SAFETY: the caller's ordering contract; one step's views at a time.
                if let Some(step) = unsafe { self.adamw_step_of(operands)? } {
                    self.run_host_adamw(vec![step], &|_| {});
                }
                ended(i);
            }
            return Ok(Outcome::default());
        }
        let (mut steps, mut which) = (Vec::new(), Vec::new());
        for (i, operands) in run.iter().enumerate() {
            // SAFETY: the caller's ordering contract, and no two steps' operands overlap
            // (checked above).
            match unsafe { self.adamw_step_of(operands)? } {
                Some(step) => {
                    steps.push(step);
                    which.push(i);
                }
                None => ended(i),
            }
        }
        self.run_host_adamw(steps, &|k| ended(which[k]));
        Ok(Outcome::default())
    }

    /// One parallel pass over every block of every step, worked on by the calling thread (the
    /// optimizer stream's) and the threads of a pool of its own ([`optimizer_pool`]), not the
    /// pool the compute kernels share ([`kernels::adamw_steps_beside`]). In the shared pool
    /// the run waited until a worker was free, which is after the compute kernel the workers
    /// are on ends, and then shared the workers with the compute stream's next kernels by work
    /// stealing, in a proportion that depends on where the kernels' boundaries fall. With a
    /// pool of its own its threads share the cores with the compute pool's by the operating
    /// system's scheduler: while both run, each pool gets about half the machine (both have
    /// one thread per core), which is what the simulator charges each of them where the
    /// profile measured no other share (`protrain_compiler::simulate::shared_core_seconds`).
    /// In one pass a thread that the scheduler takes off its core holds up only its own block,
    /// not every tensor after it; and the stream's thread works on the run itself, so it goes
    /// on as soon as the last block is done instead of sleeping until a pool thread that got a
    /// core takes the run and then until it gets a core back itself.
    fn run_host_adamw(&self, steps: Vec<AdamWStep<'_>>, ended: &(dyn Fn(usize) + Sync)) {
        match optimizer_pool() {
            Some(pool) => kernels::adamw_steps_beside(steps, ended, pool),
            None => kernels::adamw_steps_fused(steps, ended),
        }
    }

    const RUNS_BF16: bool = true;
    const RUNS_F16: bool = true;

    const MISSING_COLLECTIVES: Option<&'static str> = None;

    const MISSING_DISK: Option<&'static str> = None;

    /// f32 through [`Collective::all_reduce`]; bf16 gathered from every rank and summed here
    /// in rank order in f32, rounded to nearest even after each addition: the rounding a
    /// single rank's `accumulate_grad` makes, micro-batch after micro-batch.
    unsafe fn all_reduce(
        &self,
        _stream: &mut HostStream,
        at: Address,
        dtype: DType,
        len: usize,
        comm: &mut dyn Collective,
    ) -> Result<()> {
        // SAFETY: the caller's contract: nothing else touches the range meanwhile.
        unsafe {
            match dtype {
                DType::F32 => comm.all_reduce(self.slice_mut::<f32>(at, len)?),
                // Narrow values are summed in rank order, rounded after each add, as one rank
                // sums its micro-batches' gradients into a narrow accumulator.
                DType::BF16 => all_reduce_narrow(
                    self.slice_mut::<bf16>(at, len)?,
                    comm,
                    bf16::to_bits,
                    bf16::from_bits,
                    |a, b| bf16::from_f32(a.to_f32() + b.to_f32()),
                ),
                DType::F16 => all_reduce_narrow(
                    self.slice_mut::<f16>(at, len)?,
                    comm,
                    f16::to_bits,
                    f16::from_bits,
                    |a, b| f16::from_f32(a.to_f32() + b.to_f32()),
                ),
                other => Err(RuntimeError::BadSchedule(format!(
                    "an all-reduce of {other} values; collectives sum f32, bf16 and f16"
                ))),
            }
        }
    }

    fn new(arena_bytes: u64, host_bytes: u64, events: u32) -> Result<Self> {
        let regions = [
            MemoryNeed {
                region: HostRegion::DeviceArena,
                bytes: arena_bytes,
            },
            MemoryNeed {
                region: HostRegion::HostRegion,
                bytes: host_bytes,
            },
        ];
        check_host_memory(&regions, memory_available())?;
        Ok(Self {
            arena: Region::new(arena_bytes, "device arena")?,
            host: Region::new(host_bytes, "host region")?,
            events: Mutex::new(EventState {
                recorded: vec![false; events as usize],
                aborted: false,
            }),
            event_recorded: Condvar::new(),
            masters: HashMap::new(),
            disk: None,
        })
    }

    fn attach_disk(&mut self, disk: DiskFile) -> Result<()> {
        self.disk = Some(disk);
        Ok(())
    }

    fn prepare(&mut self, schedule: &Schedule) -> Result<()> {
        for m in master_weights(schedule)? {
            self.set_master_weight(m.m, m.master);
        }
        Ok(())
    }

    fn create_stream(&self, kind: StreamKind) -> Result<HostStream> {
        Ok(HostStream {
            kind,
            staging: Staging::default(),
        })
    }

    fn begin_step(&mut self) {
        let state = self
            .events
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        state.recorded.fill(false);
        state.aborted = false;
    }

    unsafe fn launch(&self, stream: &mut HostStream, l: &Launch<'_>) -> Result<Outcome> {
        let (graph, op) = (l.graph, l.op);
        if let OpKind::AdamW { .. } = op.kind {
            let operands = self.adamw_operands(l)?;
            // SAFETY: the caller's ordering contract.
            if let Some(step) = unsafe { self.adamw_step_of(&operands)? } {
                kernels::adamw_steps_fused(vec![step], &|_| {});
            }
            return Ok(Outcome::default());
        }
        if op.kind == OpKind::AccumulateGrad {
            // SAFETY: as for AdamW: the accumulator and the gradient are the caller's alone
            // meanwhile and do not overlap.
            return unsafe { self.accumulate(l) };
        }
        let inputs = ArenaInputs {
            backend: self,
            launch: l,
        };
        inputs.check()?;
        let n = op.outputs.len();
        if n > MAX_OUTPUTS {
            return Err(RuntimeError::BadSchedule(format!(
                "{} writes {n} outputs; kernels write at most {MAX_OUTPUTS}",
                op.kind.mnemonic()
            )));
        }
        if l.outputs.len() != n {
            return Err(RuntimeError::BadSchedule(format!(
                "{} writes {n} outputs but its kernel gives {} addresses",
                op.kind.mnemonic(),
                l.outputs.len()
            )));
        }
        let mut outputs: [StoredMut<'_>; MAX_OUTPUTS] =
            std::array::from_fn(|_| StoredMut::F32(&mut []));
        for (i, out) in outputs.iter_mut().enumerate().take(n) {
            let (at, ty) = (l.outputs[i], &graph.value(op.outputs[i]).ty);
            let len = match l.pitches.output(i) {
                Some(pitch) => (ty.rows() as usize) * pitch,
                None => ty.numel() as usize,
            };
            // SAFETY: the caller upholds the ordering contract: outputs overlap no input, no
            // other output and the workspace, and no other stream touches them meanwhile.
            *out = unsafe {
                match ty.dtype {
                    // Routing's i32 outputs: the kernels write their bits through an f32 view.
                    DType::F32 | DType::I32 => StoredMut::F32(self.slice_mut(at, len)?),
                    DType::BF16 => StoredMut::Bf16(self.slice_mut(at, len)?),
                    DType::F16 => StoredMut::F16(self.slice_mut(at, len)?),
                }
            };
        }
        let workspace: &mut [f32] = match l.workspace {
            // SAFETY: as for the outputs.
            Some((at, bytes)) => unsafe { self.slice_mut(at, (bytes / 4) as usize)? },
            None => &mut [],
        };
        dispatch::run_stored(
            graph,
            op,
            l.prepared,
            &inputs,
            &mut outputs[..n],
            workspace,
            &mut stream.staging,
            &l.pitches,
        )
    }

    unsafe fn cast(
        &self,
        _stream: &mut HostStream,
        cast: &crate::backend::CastLaunch,
    ) -> Result<()> {
        // SAFETY: the caller's ordering contract; `at` checks bounds and alignment.
        unsafe {
            cast.run_on_host(|at, bytes, align| self.region(at.space)?.at(at.offset, bytes, align))
        }
    }

    unsafe fn copy(
        &self,
        _stream: &mut HostStream,
        src: Address,
        dst: Address,
        bytes: u64,
    ) -> Result<()> {
        // The disk tier: a read into, or a write from, host memory.
        if src.space == Space::Disk || dst.space == Space::Disk {
            let disk = self.disk()?;
            // SAFETY (both arms): the caller upholds the ordering contract for the memory side.
            return match src.space == Space::Disk {
                true => disk.read(src.offset, unsafe {
                    self.slice_mut::<u8>(dst, bytes as usize)?
                }),
                false => disk.write(dst.offset, unsafe {
                    self.slice::<u8>(src, bytes as usize)?
                }),
            };
        }
        let from = self.region(src.space)?.at(src.offset, bytes, 1)?;
        let to = self.region(dst.space)?.at(dst.offset, bytes, 1)?;
        // SAFETY: both ranges are inside their regions (checked above); the caller upholds the
        // ordering contract for them. `copy` (memmove): nothing here rules out that they
        // overlap each other.
        unsafe { std::ptr::copy(from, to, bytes as usize) };
        Ok(())
    }

    /// Every rank's slice through [`Collective::all_gather`], written back in rank order.
    unsafe fn all_gather(
        &self,
        _stream: &mut HostStream,
        at: Address,
        bytes: u64,
        comm: &mut dyn Collective,
    ) -> Result<()> {
        let (rank, world) = (comm.rank(), comm.world());
        let bytes = bytes as usize;
        // SAFETY: the caller's contract: nothing else touches the range meanwhile.
        let all = unsafe { self.slice_mut::<u8>(at, world * bytes)? };
        let send = all[rank * bytes..(rank + 1) * bytes].to_vec();
        comm.all_gather(&send, all)
    }

    /// f32 through [`Collective::reduce_scatter`]; narrow values gathered from every rank and
    /// this rank's slice summed here in rank order, rounded after each add (as
    /// [`Backend::all_reduce`] sums them).
    unsafe fn reduce_scatter(
        &self,
        _stream: &mut HostStream,
        at: Address,
        dtype: DType,
        len: usize,
        comm: &mut dyn Collective,
    ) -> Result<()> {
        let (rank, world) = (comm.rank(), comm.world());
        let mine = rank * len..(rank + 1) * len;
        // SAFETY (each arm): the caller's contract: nothing else touches the range meanwhile.
        match dtype {
            DType::F32 => {
                let all = unsafe { self.slice_mut::<f32>(at, world * len)? };
                let send = all.to_vec();
                comm.reduce_scatter(&send, &mut all[mine])
            }
            DType::BF16 => {
                let all = unsafe { self.slice_mut::<bf16>(at, world * len)? };
                reduce_scatter_narrow(all, mine, comm, bf16::to_bits, bf16::from_bits, |a, b| {
                    bf16::from_f32(a.to_f32() + b.to_f32())
                })
            }
            DType::F16 => {
                let all = unsafe { self.slice_mut::<f16>(at, world * len)? };
                reduce_scatter_narrow(all, mine, comm, f16::to_bits, f16::from_bits, |a, b| {
                    f16::from_f32(a.to_f32() + b.to_f32())
                })
            }
            other => Err(RuntimeError::BadSchedule(format!(
                "a reduce-scatter of {other} values; collectives sum f32, bf16 and f16"
            ))),
        }
    }

    /// f32 through [`Collective::all_reduce_into`]; bf16 and f16 gathered from every rank
    /// and added to the accumulator here in rank order in f32, rounded after each add: what
    /// one rank's `accumulate_grad` does micro-batch after micro-batch.
    unsafe fn all_reduce_into(
        &self,
        stream: &mut HostStream,
        acc: Address,
        grad: Address,
        dtype: DType,
        len: usize,
        comm: &mut dyn Collective,
    ) -> Result<bool> {
        // SAFETY (each arm): the caller's contract: nothing else touches either range
        // meanwhile, and the accumulator and the gradient are distinct values at distinct
        // homes.
        let summed = unsafe {
            match dtype {
                DType::F32 => {
                    let send = self.slice::<f32>(grad, len)?.to_vec();
                    comm.all_reduce_into(&send, self.slice_mut::<f32>(acc, len)?)
                }
                // Narrow values: the whole accumulator is this rank's part.
                _ => self.accumulate_into_shard(stream, acc, 0..len, grad, dtype, len, comm),
            }
        };
        summed.map(|()| true)
    }

    /// Every rank's whole gradient gathered ([`Collective::all_gather`]) and added to this
    /// rank's part of the accumulator here, in rank order, rounded after each add as the
    /// element type rounds: what one rank's `accumulate_grad` does micro-batch after
    /// micro-batch, on the elements the rank holds.
    unsafe fn accumulate_into_shard(
        &self,
        _stream: &mut HostStream,
        acc: Address,
        part: std::ops::Range<usize>,
        grad: Address,
        dtype: DType,
        len: usize,
        comm: &mut dyn Collective,
    ) -> Result<()> {
        let held = part.len();
        // SAFETY (each arm): the caller's contract: nothing else touches either range
        // meanwhile; the accumulator shard is host memory apart from the device gradient. A
        // rank holding none of the accumulator reads no accumulator memory.
        unsafe {
            match dtype {
                DType::F32 => reduce_part_into(
                    match held {
                        0 => &mut [][..],
                        n => self.slice_mut::<f32>(acc, n)?,
                    },
                    part,
                    self.slice::<f32>(grad, len)?,
                    comm,
                    f32::to_le_bytes,
                    f32::from_le_bytes,
                    |a, b| a + b,
                ),
                DType::BF16 => reduce_part_into(
                    match held {
                        0 => &mut [][..],
                        n => self.slice_mut::<bf16>(acc, n)?,
                    },
                    part,
                    self.slice::<bf16>(grad, len)?,
                    comm,
                    |v| v.to_bits().to_le_bytes(),
                    |b| bf16::from_bits(u16::from_le_bytes(b)),
                    |a, b| bf16::from_f32(a.to_f32() + b.to_f32()),
                ),
                DType::F16 => reduce_part_into(
                    match held {
                        0 => &mut [][..],
                        n => self.slice_mut::<f16>(acc, n)?,
                    },
                    part,
                    self.slice::<f16>(grad, len)?,
                    comm,
                    |v| v.to_bits().to_le_bytes(),
                    |b| f16::from_bits(u16::from_le_bytes(b)),
                    |a, b| f16::from_f32(a.to_f32() + b.to_f32()),
                ),
                other => Err(RuntimeError::BadSchedule(format!(
                    "an accumulation over the ranks of {other} values; collectives sum f32, \
                     bf16 and f16"
                ))),
            }
        }
    }

    fn record(&self, _stream: &mut HostStream, event: EventId) -> Result<()> {
        let mut state = self.lock();
        let slot = state.recorded.get_mut(event.index()).ok_or_else(|| {
            RuntimeError::BadSchedule(format!("event {} does not exist", event.0))
        })?;
        *slot = true;
        drop(state);
        self.event_recorded.notify_all();
        Ok(())
    }

    fn wait(&self, _stream: &mut HostStream, event: EventId) -> Result<()> {
        let mut state = self.lock();
        loop {
            if state.aborted {
                return Err(RuntimeError::StepAborted);
            }
            match state.recorded.get(event.index()) {
                None => {
                    return Err(RuntimeError::BadSchedule(format!(
                        "event {} does not exist",
                        event.0
                    )))
                }
                Some(true) => return Ok(()),
                Some(false) => {
                    state = self
                        .event_recorded
                        .wait(state)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            }
        }
    }

    fn synchronize(&self, _stream: &mut HostStream) -> Result<()> {
        // Work runs when it is issued: nothing is outstanding.
        Ok(())
    }

    fn abort(&self) {
        self.lock().aborted = true;
        self.event_recorded.notify_all();
    }

    fn write_f32(&mut self, at: Address, data: &[f32]) -> Result<()> {
        self.put(at, data)
    }

    fn write_i32(&mut self, at: Address, data: &[i32]) -> Result<()> {
        self.put(at, data)
    }

    fn fill_zero(&mut self, at: Address, bytes: u64) -> Result<()> {
        if at.space == Space::Disk {
            return self.put(at, &vec![0u8; bytes as usize]);
        }
        let ptr = self.region(at.space)?.at(at.offset, bytes, 1)?;
        // SAFETY: in bounds (checked above); `&mut self`: no step is running.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes as usize) };
        Ok(())
    }

    fn read_f32(&self, at: Address, out: &mut [f32]) -> Result<()> {
        self.get(at, out)
    }

    fn write_bf16(&mut self, at: Address, data: &[bf16]) -> Result<()> {
        self.put(at, data)
    }

    fn read_bf16(&self, at: Address, out: &mut [bf16]) -> Result<()> {
        self.get(at, out)
    }

    fn write_f16(&mut self, at: Address, data: &[f16]) -> Result<()> {
        self.put(at, data)
    }

    fn read_f16(&self, at: Address, out: &mut [f16]) -> Result<()> {
        self.get(at, out)
    }
}

#[cfg(test)]
mod tests {

    /// A run of AdamW steps is worked on by the calling thread and the host optimizer's own
    /// pool, not the global pool the compute kernels use (so it neither waits for a compute
    /// kernel to free a worker nor splits its blocks among the compute kernels' workers):
    /// every step ends once, on one of those threads, and the pool's threads are pinned one
    /// to a CPU.
    #[test]
    fn a_run_of_adamw_steps_is_worked_on_by_its_caller_and_the_optimizer_pool() {
        use super::{optimizer_pool, Backend, HostBackend};
        use crate::kernels::{AdamWConfig, AdamWStep, Grad, ADAMW_BLOCK};
        let backend = HostBackend::new(1 << 20, 1 << 20, 0).expect("a small backend");
        let pool = optimizer_pool().expect("the optimizer pool's threads start");
        let lens = [1, 3 * ADAMW_BLOCK + 5, 5];
        let mut state: Vec<[Vec<f32>; 4]> = lens
            .iter()
            .map(|&n| std::array::from_fn(|_| vec![0.5; n]))
            .collect();
        let steps = state
            .iter_mut()
            .map(|[p, g, m, v]| AdamWStep {
                master: p,
                grad: Grad::F32(g),
                grad_scale: None,
                exp_avg: m,
                exp_avg_sq: v,
                low: None,
                step: 1,
                config: AdamWConfig::default(),
            })
            .collect();
        let ended = std::sync::Mutex::new(Vec::new());
        backend.run_host_adamw(steps, &|i| {
            let name = std::thread::current().name().map(str::to_string);
            ended
                .lock()
                .unwrap()
                .push((i, pool.current_thread_index(), name));
        });
        let mut ended = ended.into_inner().unwrap();
        ended.sort();
        assert_eq!(ended.iter().map(|e| e.0).collect::<Vec<_>>(), [0, 1, 2]);
        let caller = std::thread::current().name().map(str::to_string);
        assert!(
            ended.iter().all(|(_, index, name)| *name == caller
                || (index.is_some()
                    && name
                        .as_deref()
                        .is_some_and(|n| n.starts_with("protrain-adam-")))),
            "ended outside the caller and the optimizer pool: {ended:?}"
        );
        assert!(
            state.iter().all(|[p, ..]| p.iter().all(|&x| x != 0.5)),
            "every step ran"
        );
        assert_eq!(pool.current_num_threads(), rayon::current_num_threads());
        // Each thread runs on one CPU of those the process may use, thread i on the i-th.
        let allowed = crate::affinity::allowed_cpus();
        let pinned = pool.broadcast(|ctx| (ctx.index(), crate::affinity::allowed_cpus()));
        for (index, cpus) in pinned {
            let expected = crate::affinity::cpu_for(index, &allowed);
            assert_eq!(
                cpus,
                Vec::from_iter(expected),
                "thread {index} of {allowed:?}"
            );
        }
    }

    /// Steps whose operands share a byte in one space are not updated together; the same
    /// offsets in different spaces, or ranges that only touch, share nothing.
    #[test]
    fn a_run_whose_steps_share_bytes_is_found() {
        use super::{any_overlap, AdamWOperands};
        let kind = OpKind::AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            clipped: false,
        };
        let at = |space, offset| Address { space, offset };
        // 10 f32 elements: 40 bytes each of master, m, v and the gradient.
        let op = |space, base: u64| AdamWOperands {
            kind: &kind,
            n: 10,
            master: at(space, base),
            low: None,
            grad: Some((at(space, base + 40), DType::F32)),
            m: at(space, base + 80),
            v: at(space, base + 120),
            coef: None,
            step: 1,
        };
        assert!(!any_overlap(&[op(Space::Host, 0), op(Space::Host, 160)]));
        assert!(!any_overlap(&[op(Space::Host, 0), op(Space::Device, 0)]));
        assert!(any_overlap(&[op(Space::Host, 0), op(Space::Host, 156)]));
        assert!(any_overlap(&[op(Space::Host, 0), op(Space::Host, 0)]));
        let mut narrow = op(Space::Host, 1000);
        narrow.low = Some((at(Space::Host, 150), DType::BF16));
        assert!(
            any_overlap(&[op(Space::Host, 0), narrow]),
            "the narrow copy's bytes count"
        );
    }

    #[test]
    fn more_than_the_available_memory_is_refused_up_front() {
        let Some(available) = memory_available() else {
            return; // no /proc/meminfo: nothing to check against
        };
        // More than is available: the lazy allocation would succeed and the run be killed when
        // it touched the pages.
        let e = HostBackend::new(available / 2 + (64 << 20), available / 2, 0)
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("available") && e.contains("missing"), "{e}");
    }

    /// The CUDA backend pins its host region and zeroes it page by page: a region larger than
    /// the available memory must be refused before anything is pinned, as the host backend's
    /// regions are, not found by the kernel's OOM killer part way through the zeroing. The
    /// check comes before the device probe, so it holds on a machine without a GPU too.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_cuda_backend_refuses_a_pinned_region_larger_than_the_available_memory() {
        let Some(available) = memory_available() else {
            return; // no /proc/meminfo: nothing to check against
        };
        let e = crate::cuda::CudaBackend::new(1 << 20, available + (1 << 30), 2)
            .err()
            .expect("refused")
            .to_string();
        assert!(
            e.contains("pinned host region")
                && e.contains("available")
                && e.ends_with("compile the schedule for less with host memory"),
            "{e}"
        );
        assert!(!e.contains("device"), "the arena is on the GPU: {e}");
        assert!(
            !e.contains("--"),
            "the CLI names the flags, not the runtime: {e}"
        );
    }

    use super::*;

    #[test]
    fn regions_are_aligned_zeroed_and_exactly_sized() {
        let mut b = HostBackend::new(1000, 0, 2).unwrap();
        assert_eq!(b.arena.len, 1000);
        assert_eq!(b.arena.ptr.as_ptr() as usize % REGION_ALIGN, 0);
        let at = Address {
            space: Space::Device,
            offset: 996,
        };
        let mut x = [1.0f32];
        b.read_f32(at, &mut x).unwrap();
        assert_eq!(x, [0.0]);
        b.write_f32(at, &[2.5]).unwrap();
        b.read_f32(at, &mut x).unwrap();
        assert_eq!(x, [2.5]);
        // Past the end, misaligned, or in the empty host region: errors, not UB.
        let past = Address {
            space: Space::Device,
            offset: 1000,
        };
        assert!(matches!(
            b.write_f32(past, &[1.0]),
            Err(RuntimeError::BadSchedule(_))
        ));
        let odd = Address {
            space: Space::Device,
            offset: 2,
        };
        assert!(b.read_f32(odd, &mut x).is_err());
        let host = Address {
            space: Space::Host,
            offset: 0,
        };
        assert!(b.read_f32(host, &mut x).is_err());
        assert!(b.read_f32(host, &mut []).is_ok());
    }

    #[test]
    fn bf16_values_round_trip_and_an_unknown_master_weight_is_an_error() {
        let mut b = HostBackend::new(64, 0, 0).unwrap();
        let at = Address {
            space: Space::Device,
            offset: 2,
        };
        let values = [bf16::from_f32(1.5), bf16::from_f32(-2.25), bf16::MAX];
        b.write_bf16(at, &values).unwrap();
        let mut back = [bf16::ZERO; 3];
        b.read_bf16(at, &mut back).unwrap();
        assert_eq!(back, values);
        // Stored as bf16: the f32 at offset 0 holds the first value's bits in its high half.
        let mut word = [0.0f32];
        b.read_f32(Address { offset: 0, ..at }, &mut word).unwrap();
        assert_eq!(word[0].to_bits() >> 16, u32::from(values[0].to_bits()));
        let odd = Address { offset: 1, ..at };
        assert!(b.write_bf16(odd, &values).is_err(), "misaligned");
        let e = b.master_weight(at).unwrap_err().to_string();
        assert!(e.contains("master weight") && e.contains("executor"), "{e}");
        let master = Address { offset: 32, ..at };
        b.set_master_weight(at, master);
        assert_eq!(b.master_weight(at).unwrap(), master);
    }

    #[test]
    fn wait_blocks_until_record_and_fails_once_aborted() {
        let mut b = HostBackend::new(0, 0, 2).unwrap();
        let mut s0 = b.create_stream(StreamKind::Compute).unwrap();
        let mut s1 = b.create_stream(StreamKind::HostToDevice).unwrap();
        std::thread::scope(|scope| {
            let b = &b;
            let waiter = scope.spawn(move || b.wait(&mut s1, EventId(1)));
            std::thread::sleep(std::time::Duration::from_millis(10));
            b.record(&mut s0, EventId(1)).unwrap();
            waiter.join().unwrap().unwrap();
        });
        let mut s1 = b.create_stream(StreamKind::HostToDevice).unwrap();
        std::thread::scope(|scope| {
            let b = &b;
            let waiter = scope.spawn(move || b.wait(&mut s1, EventId(0)));
            b.abort();
            assert!(matches!(
                waiter.join().unwrap(),
                Err(RuntimeError::StepAborted)
            ));
        });
        b.begin_step();
        let mut s0 = b.create_stream(StreamKind::Compute).unwrap();
        assert!(b.wait(&mut s0, EventId(7)).is_err());
    }
}
