//! The executor: runs a schedule's steps on a backend, one thread per stream.
//!
//! [`Executor::new`] takes a verified schedule, resolves each instruction's addresses once and has
//! the backend allocate the arena and the host region; a step then
//! writes the inputs at their homes, runs every stream's instruction list on its own thread
//! (events are the only order between them), and reads the loss. Parameters and optimizer
//! state stay at their homes across steps. Each step is timed per stream, and can be traced
//! instruction by instruction for a timeline.
//!
//! A schedule that accumulates gradients over `K` micro-batches
//! ([`Schedule::micro_batches`]) takes `K` times the tokens per step: its accumulators are
//! zeroed, then each micro-batch's rows are written at the inputs' homes and the streams run
//! their micro-batch programs (a barrier after each), and last the update programs run once.
//! The step's loss is the mean of the micro-batches' losses, each the mean over its
//! positions: the mean over all `K*B*T` positions. A chunk-major schedule
//! ([`Schedule::is_chunk_major`]) runs its `K` micro-batches in one program instead: each
//! micro-batch's rows are written at its own inputs' homes, the streams run once, and the
//! micro-batches' losses, read from [`Schedule::micro_batch_losses`], make the same mean.
//!
//! A schedule with carried disk writes (see [`protrain_ir::schedule`]) leaves the write-backs
//! of its last updates to the next step: a step runs them at the head of its disk stream's
//! program (in its first micro-batch) when the step before left them pending, and skips
//! them otherwise (a run's first step, the first after state was loaded). Anything that reads
//! or writes the state at its homes ([`Executor::params`], [`Executor::state`],
//! [`Executor::read_held`], the loads, so checkpoints and weight exports too) runs them first
//! ([`Executor::flush_disk`]), so the disk holds every update before it is read and a loaded
//! state is not overwritten by an older one. The host and CUDA backends run them alike.
//!
//! An f16 schedule is loss-scaled ([`Executor::loss_scaled`]): each step runs at a loss scale
//! the caller gives ([`Executor::step_with`]; the [`crate::loss_scale::LossScaler`] decides
//! it), and a step whose gradients overflowed is *skipped* by its own AdamW ops, which leave
//! weights and moments untouched. The executor tells which steps were skipped from the
//! gradient norm ([`StepReport::skipped`]) and counts AdamW's steps apart from the steps
//! run ([`Executor::updates_taken`]), so a skipped step does not advance the bias correction,
//! as torch's AdamW is not stepped when GradScaler skips.
//!
//! A data-parallel schedule ([`Schedule::ranks`] > 1) runs on every rank, each with its own
//! executor and its rank's [`Collective`] ([`Executor::set_collective`]): the collective
//! stream's thread issues the all-reduces through it, and after each step the executor
//! gathers every rank's micro-batch losses and returns their mean in global order (rank, then
//! micro-batch), summed in f64 exactly as one rank sums its micro-batches' losses. So `W`
//! ranks of `K` micro-batches report the loss one rank of `W*K` micro-batches reports over
//! the same rows, bit for bit. Where the schedule shards a chunk and accumulates, each
//! rank zeroes and sums into only the part of each accumulator it holds (the collective
//! stream's `accumulate_grad` of a sharded chunk, [`Backend::accumulate_into_shard`]).

use crate::backend::{
    master_weights, set_learning_rate, set_loss_scale, Address, Backend, CastLaunch, CastPart,
    Launch, ShardLaunch,
};
use crate::collective::Collective;
use crate::disk::DiskFile;
use crate::dispatch::{Outcome, Pitches, Prepared};
use crate::error::{Result, RuntimeError, Unsupported};
use crate::host::HostBackend;
use crate::interpreter::StepReport;
use crate::kernels;
use protrain_ir::verify_schedule::VerifiedSchedule;
use protrain_ir::{
    BufferKind, DType, EventId, Graph, Instr, Op, OpId, OpKind, Role, Schedule, Space, StreamId,
    StreamKind, TensorRef, ValueId,
};
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Instant;

/// How long the last step took.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepTiming {
    /// Wall-clock seconds from the first instruction issued to the last stream finished.
    pub wall_seconds: f64,
    /// Seconds each stream's thread spent in kernels and copies (not waiting), by
    /// [`StreamId`]. On the host backend that is the work itself; on an asynchronous backend
    /// it would be the time to issue it.
    pub stream_busy_seconds: Vec<f64>,
}

/// One kernel or copy of a traced step, for a timeline (a Chrome trace).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span {
    /// The stream it ran on.
    pub stream: StreamId,
    /// Its index in the stream's instruction list.
    pub index: u32,
    /// Seconds from the step's start.
    pub start: f64,
    /// Seconds from the step's start.
    pub end: f64,
}

/// An instruction with its addresses resolved and its constants made.
enum Planned {
    Kernel {
        op: OpId,
        /// For an AdamW op and the loss-scaled ops: a copy of the graph's op whose learning
        /// rate or loss scale is set to the step's before each step ([`Executor::step_with`])
        /// and launched in its place (boxed: the op is large and most kernels have none).
        launched: Option<Box<Op>>,
        inputs: Vec<Address>,
        outputs: Vec<Address>,
        workspace: Option<(Address, u64)>,
        prepared: Prepared,
        /// The rank's part of an AdamW op on a sharded chunk (boxed: rare, and the variant
        /// is the enum's largest).
        shard: Option<Box<ShardLaunch>>,
        /// Row pitches of operands stored in padded rows (boxed: rare, and large beside
        /// the other variants); `None` when every operand is dense.
        pitches: Option<Box<Pitches>>,
    },
    Copy {
        src: Address,
        dst: Address,
        bytes: u64,
    },
    Record(EventId),
    Wait(EventId),
    AllReduce {
        at: Address,
        dtype: DType,
        len: usize,
    },
    AllGather {
        at: Address,
        bytes: u64,
    },
    ReduceScatter {
        at: Address,
        dtype: DType,
        len: usize,
    },
    /// An `accumulate_grad` on the collective stream: the gradient summed over the ranks
    /// into the accumulator ([`Backend::all_reduce_into`]), or, where the backend sums the
    /// gradient in place instead, then added by `kernel` (the op planned as a kernel).
    AccumulateOverRanks {
        acc: Address,
        grad: Address,
        dtype: DType,
        len: usize,
        kernel: Box<Planned>,
    },
    /// A chunk-major gradient sum's `add` on the collective stream: the running sum at
    /// `from` copied to the new sum's place (where they differ), then the micro-batch's
    /// gradient summed over the ranks into it, as `sum` (an [`Planned::AccumulateOverRanks`]
    /// whose kernel is the `add`) does.
    AddOverRanks {
        from: Address,
        bytes: u64,
        sum: Box<Planned>,
    },
    /// An `accumulate_grad` of a sharded chunk's gradient on the collective stream: every
    /// rank's gradient at `grad` summed into the `part` of the accumulator this rank holds,
    /// at `acc` ([`Backend::accumulate_into_shard`]).
    AccumulateIntoShard {
        acc: Address,
        part: Range<usize>,
        grad: Address,
        dtype: DType,
        len: usize,
    },
    /// An AdamW op on a sharded chunk of which this rank holds none of the parameter.
    Skip,
    /// A staged chunk's cast (the 12-byte host layout).
    Cast(CastLaunch),
}

/// One stream: its handle, its program and what its last step measured.
struct StreamRun<S> {
    id: StreamId,
    handle: S,
    /// Every instruction, or with accumulation the micro-batch program.
    program: Vec<Planned>,
    /// The update program of an accumulating schedule (empty otherwise), and the index of
    /// its first instruction in the stream.
    update: Vec<Planned>,
    update_at: u32,
    /// Whether it is the collective stream.
    collective: bool,
    /// How many of `program`'s first instructions are carried disk writes: run as a step
    /// starts only when the step before left them to run ([`Carry`]).
    carried: usize,
    busy: f64,
    spans: Vec<Span>,
}

/// The carried disk writes of a schedule ([`protrain_ir::Instr::DiskWrite`]'s `carried`):
/// the write-backs a step leaves in its staging buffers for the start of the next step.
/// `pending` says that the last step left them there; they run at the head of the disk
/// stream's next step, or on their own ([`Executor::flush_disk`]) before anything reads or
/// writes the state at its homes. A stream of its own runs them then, so that the readers,
/// which take `&self`, can.
struct Carry<S> {
    /// The disk stream's index.
    stream: usize,
    /// The stream that runs them outside a step, and whether they are pending.
    state: Mutex<(S, bool)>,
}

/// A parameter's home, its element type, and the home of its f32 master weight when the
/// parameter is narrower (mixed precision). In a sharded chunk the homes are in the whole
/// layout of the ranks' shards; a rank reads and writes its part ([`held`]). A staged
/// parameter (the 12-byte host layout) has no home, only its master weight.
struct ParamHome {
    at: Option<TensorRef>,
    len: usize,
    dtype: DType,
    master: Option<TensorRef>,
}

impl ParamHome {
    /// Where the parameter's values are read and written whole, and its element size: its f32
    /// master weight when it has one, else its home (every parameter has one of the two,
    /// checked when the executor is made).
    fn source(&self) -> (TensorRef, u64) {
        match (self.master, self.at) {
            (Some(master), _) => (master, 4),
            (None, Some(at)) => (at, self.dtype.size()),
            (None, None) => unreachable!("a parameter without a home has a master weight"),
        }
    }
}

/// One tensor of the training state and the elements each rank holds of it
/// ([`Executor::state_tensors`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateTensor {
    /// The parameter's name, or the optimizer-state value's (`adam.m.NAME`).
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its elements.
    pub len: usize,
    /// The elements rank `q` holds, at index `q` (empty when it holds none).
    pub held: Vec<Range<usize>>,
}

/// A step input's home and the vocabulary its ids must fall in.
struct InputHome {
    value: ValueId,
    at: Address,
    len: usize,
    /// The smallest table or logit width any op indexes with these ids.
    vocab: Option<usize>,
}

/// Runs a compiled schedule step after step. Parameters and optimizer state live at their
/// homes in the backend's memory; [`Executor::load_params`] sets them and
/// [`Executor::params`] reads them back.
///
/// Only a verified schedule runs: the host backend reads and writes tensors in place from
/// several threads, which is sound because the verifier proves that every pair of accesses to
/// the same bytes is ordered. [`Executor::new`] takes that proof, a [`VerifiedSchedule`], so
/// an executor always holds a verified schedule and never verifies one again.
pub struct Executor<'s, B: Backend = HostBackend> {
    schedule: &'s Schedule,
    backend: B,
    streams: Vec<StreamRun<B::Stream>>,
    inputs: Vec<InputHome>,
    /// Each parameter's home, in parameter order.
    params: Vec<ParamHome>,
    /// Each optimizer-state value (Adam m and v), its home and its length, in graph order.
    state: Vec<(ValueId, TensorRef, usize)>,
    loss: Address,
    /// With chunk-major accumulation, each micro-batch's loss, in order (empty otherwise).
    micro_batch_losses: Vec<Address>,
    /// Micro-batches per step (1 without accumulation).
    micro_batches: u32,
    /// Whether the micro-batches run interleaved in one program (chunk-major): then
    /// `inputs` holds every micro-batch's homes, micro-batch after micro-batch.
    interleaved: bool,
    /// Each gradient accumulator's home and bytes, zeroed before each step (the rank's part of
    /// a sharded one).
    accumulators: Vec<(TensorRef, u64)>,
    /// Whether the schedule is loss-scaled (f16): its steps can be skipped.
    loss_scaled: bool,
    step: u64,
    /// AdamW steps applied: `step` less the skipped ones.
    updates: u64,
    timing: StepTiming,
    tracing: bool,
    /// This rank's collective, for a data-parallel schedule (behind a lock so that reading
    /// the weights of a sharded schedule, which gathers them, takes `&self`).
    comm: Mutex<Option<Box<dyn Collective>>>,
    /// This rank (0 without a collective): which slice of each sharded chunk it holds.
    rank: u32,
    /// Each narrow parameter's f32 master weight home, for planning sharded AdamW ops.
    masters: HashMap<ValueId, TensorRef>,
    /// The disk tier's file, once given ([`Executor::set_disk_dir`]).
    disk_path: Option<PathBuf>,
    /// The carried disk writes, where the schedule has any.
    carry: Option<Carry<B::Stream>>,
}

impl<'s> Executor<'s, HostBackend> {
    /// An executor for a verified `schedule` on the host backend: allocates the arena and the
    /// host region (zeroed: every parameter and optimizer state zero). Fails when the
    /// schedule has a dtype other than f32, bf16 and i32.
    pub fn new(schedule: &'s VerifiedSchedule) -> Result<Self> {
        Self::with_backend(schedule)
    }
}

impl<'s, B: Backend> Executor<'s, B> {
    /// An executor for `schedule` on backend `B`; see [`Executor::new`]. A backend that
    /// [runs bf16](Backend::RUNS_BF16) also takes mixed-precision schedules, whose parameters
    /// it keeps in bf16 with an f32 master weight (see [`master_weights`]).
    pub fn with_backend(schedule: &'s VerifiedSchedule) -> Result<Self> {
        let schedule: &'s Schedule = schedule;
        let graph = &schedule.graph;
        for (id, value) in graph.values() {
            let runs = match value.ty.dtype {
                DType::F32 | DType::I32 => true,
                DType::BF16 => B::RUNS_BF16,
                DType::F16 => B::RUNS_F16,
            };
            if !runs {
                let (runs, dtypes) = match (B::RUNS_BF16, B::RUNS_F16) {
                    (true, true) => ("f32, bf16 and f16 schedules", "f16, bf16 or f32"),
                    (true, false) => ("f32 and bf16 schedules", "bf16 or f32"),
                    _ => ("f32 schedules", "f32"),
                };
                return Err(RuntimeError::BadSchedule(format!(
                    "{id} ({}) is {}, but the executor runs {runs}; compile with dtype {dtypes}",
                    value.name, value.ty
                )));
            }
        }
        let ranks = schedule.ranks();
        if let (true, Some(missing)) = (ranks > 1, B::MISSING_COLLECTIVES) {
            return Err(RuntimeError::Unsupported(Unsupported::Collectives {
                ranks: ranks as usize,
                missing,
            }));
        }
        if let (true, Some(missing)) = (schedule.disk_bytes > 0, B::MISSING_DISK) {
            return Err(RuntimeError::Unsupported(Unsupported::DiskTier {
                chunks: schedule.disk_chunks().len(),
                missing,
            }));
        }
        // Checks that every narrow parameter has its master weight.
        master_weights(schedule)?;
        let masters: HashMap<ValueId, TensorRef> = schedule.masters.iter().copied().collect();
        let mut backend = B::new(schedule.arena_bytes, schedule.host_bytes, schedule.events)?;
        backend.prepare(schedule)?;
        let mut streams = Vec::with_capacity(schedule.streams.len());
        for (s, (stream, (micro, update))) in
            schedule.streams.iter().zip(schedule.phases()).enumerate()
        {
            let collective = matches!(stream.kind, StreamKind::Collective { .. });
            streams.push(StreamRun {
                id: StreamId::new(s),
                handle: backend.create_stream(stream.kind)?,
                program: micro
                    .iter()
                    .map(|i| plan(schedule, i, 0, &masters, collective))
                    .collect(),
                update: update
                    .iter()
                    .map(|i| plan(schedule, i, 0, &masters, collective))
                    .collect(),
                update_at: (stream.instrs.len() - update.len()) as u32,
                collective,
                carried: stream.carried_writes(),
                busy: 0.0,
                spans: Vec::new(),
            });
        }
        // The verifier checked that every value without a producer has exactly one home,
        // but a staged parameter, which has a master weight instead.
        let homes: HashMap<ValueId, TensorRef> = schedule.homes.iter().copied().collect();
        let home = |v: ValueId| homes[&v];
        let mut inputs = Vec::new();
        for &v in graph.inputs() {
            let vocab = graph
                .ops()
                .filter_map(|(_, op)| match op.kind {
                    OpKind::Embedding { .. } if op.inputs[0] == v => {
                        Some(graph.value(op.inputs[1]).ty.shape[0])
                    }
                    OpKind::EmbeddingBackward { rows, .. } if op.inputs[0] == v => Some(rows),
                    OpKind::CrossEntropy if op.inputs[1] == v => {
                        Some(graph.value(op.inputs[0]).ty.last_dim())
                    }
                    _ => None,
                })
                .min()
                .map(|n| n as usize);
            inputs.push(InputHome {
                value: v,
                at: address(schedule, home(v)),
                len: graph.value(v).ty.numel() as usize,
                vocab,
            });
        }
        let params = graph
            .params()
            .map(|(_, p)| {
                let ty = &graph.value(p.value).ty;
                let home = ParamHome {
                    at: homes.get(&p.value).copied(),
                    len: ty.numel() as usize,
                    dtype: ty.dtype,
                    master: masters.get(&p.value).copied(),
                };
                match home.at.is_some() || home.master.is_some() {
                    true => Ok(home),
                    false => Err(RuntimeError::BadSchedule(format!(
                        "parameter {} has neither a home nor a master weight; recompile the \
                         schedule with this protrain",
                        p.name
                    ))),
                }
            })
            .collect::<Result<_>>()?;
        let state = graph
            .values()
            .filter(|(_, v)| v.role == Role::OptimizerState && v.producer.is_none())
            .map(|(id, v)| (id, home(id), v.ty.numel() as usize))
            .collect();
        let loss = address(schedule, schedule.loss);
        let micro_batch_losses = schedule
            .micro_batch_losses
            .iter()
            .map(|&at| address(schedule, at))
            .collect();
        let interleaved = schedule.is_chunk_major();
        if interleaved
            && !graph
                .inputs()
                .len()
                .is_multiple_of(schedule.micro_batch_losses.len())
        {
            return Err(RuntimeError::BadSchedule(format!(
                "a chunk-major schedule of {} micro-batches has {} step inputs, not inputs for \
                 each micro-batch; recompile the schedule with this protrain",
                schedule.micro_batch_losses.len(),
                graph.inputs().len()
            )));
        }
        let accumulators = graph
            .values()
            .filter(|(_, v)| v.role == Role::Accumulator && v.producer.is_none())
            .map(|(id, v)| (home(id), v.ty.bytes()))
            .collect();
        let carry = match streams.iter().position(|s| s.carried > 0) {
            Some(stream) => Some(Carry {
                stream,
                state: Mutex::new((backend.create_stream(StreamKind::DiskIo)?, false)),
            }),
            None => None,
        };
        Ok(Self {
            schedule,
            backend,
            timing: StepTiming {
                wall_seconds: 0.0,
                stream_busy_seconds: vec![0.0; streams.len()],
            },
            streams,
            inputs,
            params,
            state,
            loss,
            micro_batch_losses,
            micro_batches: schedule.micro_batches_per_step(),
            interleaved,
            accumulators,
            loss_scaled: graph
                .ops()
                .any(|(_, op)| matches!(op.kind, OpKind::UnscaleCoef { .. })),
            step: 0,
            updates: 0,
            tracing: false,
            comm: Mutex::new(None),
            rank: 0,
            masters,
            disk_path: None,
            carry,
        })
    }

    /// Runs the carried disk writes the last step left pending, if any, so that the disk holds
    /// every chunk's updated state: before the state at its homes is read (the weights, a
    /// checkpoint) or written (loading one). Running them again later is not needed: the
    /// next step skips them. A no-op where nothing is pending (the first step has not run,
    /// or they ran).
    pub fn flush_disk(&self) -> Result<()> {
        let Some(carry) = &self.carry else {
            return Ok(());
        };
        let mut state = carry.state.lock().unwrap_or_else(PoisonError::into_inner);
        let (stream, pending) = &mut *state;
        if !*pending {
            return Ok(());
        }
        let run = &self.streams[carry.stream];
        for planned in &run.program[..run.carried] {
            if let Planned::Copy { src, dst, bytes } = planned {
                // SAFETY: no step runs (steps take `&mut self`), so nothing else touches the
                // staging buffers or the disk; the copy is synchronous on a disk stream.
                unsafe { self.backend.copy(stream, *src, *dst, *bytes)? };
            }
        }
        self.backend.synchronize(stream)?;
        *pending = false;
        Ok(())
    }

    /// Whether the last step left carried disk writes to run, taking them: the next step's
    /// first micro-batch runs them.
    fn take_carried(&self) -> bool {
        self.carry.as_ref().is_some_and(|c| {
            let mut state = c.state.lock().unwrap_or_else(PoisonError::into_inner);
            std::mem::replace(&mut state.1, false)
        })
    }

    /// Marks the carried disk writes pending after a step's update.
    fn leave_carried(&self) {
        if let Some(c) = &self.carry {
            c.state.lock().unwrap_or_else(PoisonError::into_inner).1 = true;
        }
    }

    /// Makes the file of the schedule's disk region (its optimizer state that host memory
    /// cannot hold) in `dir`, preallocated and zeroed ([`DiskFile::create`]), and gives it to
    /// the backend; the file is removed when the executor is dropped. A schedule with a disk
    /// region needs this before its state is loaded or a step runs; one without ignores it.
    /// On several ranks, give the collective first ([`Executor::set_collective`]): the file
    /// is named for the rank, which holds its own shards there. Returns the files of killed runs that making it removed from `dir`
    /// ([`crate::disk::sweep`]), for the caller to report.
    pub fn set_disk_dir(&mut self, dir: &Path) -> Result<Vec<PathBuf>> {
        let bytes = self.schedule.disk_bytes;
        if bytes == 0 {
            return Ok(Vec::new());
        }
        // On several ranks each keeps its own shards in a file named for it.
        let rank = (self.schedule.ranks() > 1).then_some(self.rank);
        let file = DiskFile::create_for_rank(dir, bytes, rank)?;
        let path = file.path().to_path_buf();
        let swept = file.swept().to_vec();
        self.backend.attach_disk(file)?;
        self.disk_path = Some(path);
        Ok(swept)
    }

    /// The disk tier's file, once made ([`Executor::set_disk_dir`]).
    pub fn disk_path(&self) -> Option<&Path> {
        self.disk_path.as_deref()
    }

    /// Fails when the schedule has a disk region but no file, or its file vanished.
    fn check_disk(&self) -> Result<()> {
        if self.schedule.disk_bytes == 0 {
            return Ok(());
        }
        match &self.disk_path {
            Some(path) => crate::disk::check(path),
            None => Err(RuntimeError::Unsupported(Unsupported::NoDiskDir {
                held: Some((self.schedule.disk_chunks().len(), self.schedule.disk_bytes)),
            })),
        }
    }

    /// The collective, locked (a rank that panicked while holding it left it whole).
    fn comm(&self) -> MutexGuard<'_, Option<Box<dyn Collective>>> {
        self.comm.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What this rank holds of the `len` elements of `size` bytes at `t` ([`held`]).
    fn held(&self, t: TensorRef, len: usize, size: u64) -> Option<(Address, Range<usize>)> {
        held(self.schedule, t, len, size, self.rank)
    }

    /// Completes `out`, of which this rank filled the part it holds of the `len` elements of
    /// `size` bytes at `t`, with the other ranks' parts when `t` is in a sharded chunk (every
    /// rank must call it for the same tensors in the same order); one tensor at a time, so
    /// no rank ever holds more than one whole tensor beyond its shards.
    fn gather_parts(&self, t: TensorRef, size: u64, out: &mut [f32]) -> Result<()> {
        let schedule = self.schedule;
        if !matches!(schedule.buffer(t.buffer).kind, BufferKind::HostShard { .. }) {
            return Ok(());
        }
        let len = out.len();
        let world = schedule.ranks();
        let parts: Vec<Range<usize>> = (0..world)
            .map(|q| held(schedule, t, len, size, q).map_or(0..0, |(_, r)| r))
            .collect();
        let widest = parts.iter().map(Range::len).max().unwrap_or(0);
        let mut send = vec![0u8; 4 * widest];
        for (bytes, x) in send
            .chunks_exact_mut(4)
            .zip(&out[parts[self.rank as usize].clone()])
        {
            bytes.copy_from_slice(&x.to_le_bytes());
        }
        let mut recv = vec![0u8; send.len() * world as usize];
        let mut comm = self.comm();
        let comm = comm.as_deref_mut().ok_or_else(|| RuntimeError::Collective {
            rank: self.rank as usize,
            problem: "reading the weights of a sharded schedule gathers them from every rank,                       but this executor has no collective; give it one                       (Executor::set_collective)"
                .into(),
        })?;
        comm.all_gather(&send, &mut recv)?;
        for (q, part) in parts.iter().enumerate() {
            for (k, i) in part.clone().enumerate() {
                let at = 4 * (q * widest + k);
                out[i] = f32::from_le_bytes([recv[at], recv[at + 1], recv[at + 2], recv[at + 3]]);
            }
        }
        Ok(())
    }

    /// Gives the executor its rank's collective, for a data-parallel schedule: the group must
    /// have as many ranks as the schedule runs on.
    pub fn set_collective(&mut self, comm: Box<dyn Collective>) -> Result<()> {
        let ranks = self.schedule.ranks() as usize;
        if comm.world() != ranks {
            return Err(RuntimeError::GroupSize {
                rank: comm.rank(),
                world: comm.world(),
                ranks,
            });
        }
        // Sharded chunks: the rank picks its slices, so its instructions are planned again.
        let rank = comm.rank() as u32;
        *self.comm.get_mut().unwrap_or_else(PoisonError::into_inner) = Some(comm);
        if rank != self.rank {
            self.rank = rank;
            let schedule = self.schedule;
            for (s, (micro, update)) in self.streams.iter_mut().zip(schedule.phases()) {
                s.program = micro
                    .iter()
                    .map(|i| plan(schedule, i, rank, &self.masters, s.collective))
                    .collect();
                s.update = update
                    .iter()
                    .map(|i| plan(schedule, i, rank, &self.masters, s.collective))
                    .collect();
            }
        }
        Ok(())
    }

    /// Drops this rank's collective: the other ranks' next collective fails, naming this one,
    /// instead of waiting for it (after a failure here). Its steps fail from now on.
    pub fn leave_group(&mut self) {
        *self.comm.get_mut().unwrap_or_else(PoisonError::into_inner) = None;
    }

    /// This rank and the number of ranks: `(0, 1)` without a collective.
    pub fn rank(&self) -> (usize, usize) {
        self.comm()
            .as_ref()
            .map_or((0, 1), |c| (c.rank(), c.world()))
    }

    /// Micro-batches per optimizer step: a step takes this many times the tokens of one
    /// micro-batch (the schedule's batch) per input.
    pub fn micro_batches(&self) -> u32 {
        self.micro_batches
    }

    /// The schedule being run.
    pub fn schedule(&self) -> &'s Schedule {
        self.schedule
    }

    /// Steps taken since the parameters were loaded.
    pub fn steps_taken(&self) -> u64 {
        self.step
    }

    /// AdamW steps applied since the parameters were loaded: [`Executor::steps_taken`] less
    /// the skipped ones (a loss-scaled step whose gradients overflowed). The next step is
    /// AdamW's step `updates_taken() + 1` (its bias correction).
    pub fn updates_taken(&self) -> u64 {
        self.updates
    }

    /// Whether the schedule is loss-scaled (an f16 schedule): each step runs at a loss scale
    /// ([`Executor::step_with`]) and is skipped when its gradients overflow.
    pub fn loss_scaled(&self) -> bool {
        self.loss_scaled
    }

    /// Sets every parameter, in parameter order (as [`crate::params::init_params`] returns
    /// them), at its home; zeroes the optimizer state and restarts the step count, so the next
    /// step is AdamW's first.
    pub fn load_params(&mut self, values: &[Vec<f32>]) -> Result<()> {
        self.flush_disk()?;
        let graph = &self.schedule.graph;
        if values.len() != self.params.len() {
            return Err(RuntimeError::Shape(format!(
                "the model has {} parameters, {} were given",
                self.params.len(),
                values.len()
            )));
        }
        for (((_, p), home), data) in graph.params().zip(&self.params).zip(values) {
            let len = home.len;
            if data.len() != len {
                let ty = &graph.value(p.value).ty;
                return Err(RuntimeError::TensorSizeMismatch {
                    name: p.name.clone(),
                    shape: ty.shape.iter().map(|&d| d as usize).collect(),
                    expected: len,
                    got: data.len(),
                });
            }
        }
        // Each rank writes the part of each parameter it holds (all of it, unless sharded).
        for (home, data) in self.params.iter().zip(values) {
            let narrow = home
                .at
                .and_then(|t| self.held(t, home.len, home.dtype.size()));
            if let Some((at, part)) = narrow {
                let data = &data[part];
                match home.dtype {
                    DType::BF16 => {
                        let narrow: Vec<half::bf16> =
                            data.iter().map(|&x| half::bf16::from_f32(x)).collect();
                        self.backend.write_bf16(at, &narrow)?;
                    }
                    DType::F16 => {
                        let narrow: Vec<half::f16> =
                            data.iter().map(|&x| half::f16::from_f32(x)).collect();
                        self.backend.write_f16(at, &narrow)?;
                    }
                    _ => self.backend.write_f32(at, data)?,
                }
            }
            if let Some((at, part)) = home.master.and_then(|m| self.held(m, home.len, 4)) {
                self.backend.write_f32(at, &data[part])?;
            }
        }
        for &(_, t, len) in &self.state {
            if let Some((at, part)) = self.held(t, len, 4) {
                self.backend
                    .fill_zero(at, (part.len() * std::mem::size_of::<f32>()) as u64)?;
            }
        }
        self.step = 0;
        self.updates = 0;
        Ok(())
    }

    /// Every optimizer-state value (Adam's m and v, f32) by its value name (`adam.m.NAME`,
    /// `adam.v.NAME`), in graph order, read from their homes. With [`Executor::params`] and
    /// [`Executor::steps_taken`] this is the whole training state.
    ///
    /// With a sharded schedule every rank must call it (it gathers the ranks' shards, one
    /// value at a time) and every rank gets the whole state.
    pub fn state(&self) -> Result<Vec<(String, Vec<f32>)>> {
        self.flush_disk()?;
        let graph = &self.schedule.graph;
        self.state
            .iter()
            .map(|&(id, t, len)| {
                let mut out = vec![0.0; len];
                if let Some((at, part)) = self.held(t, len, 4) {
                    self.backend.read_f32(at, &mut out[part])?;
                }
                self.gather_parts(t, 4, &mut out)?;
                Ok((graph.value(id).name.clone(), out))
            })
            .collect()
    }

    /// Sets every optimizer-state value from `(name, values)` pairs, as [`Executor::state`]
    /// returns them (in any order). Fails, writing nothing, unless every state value is given
    /// exactly once with its length and no other name is. Does not touch the step count (see
    /// [`Executor::set_step`]).
    pub fn load_state(&mut self, values: &[(String, Vec<f32>)]) -> Result<()> {
        self.flush_disk()?;
        let graph = &self.schedule.graph;
        let mut given: HashMap<&str, &[f32]> = HashMap::with_capacity(values.len());
        for (name, data) in values {
            if given.insert(name.as_str(), data).is_some() {
                return Err(RuntimeError::Shape(format!(
                    "optimizer state `{name}` is given twice; give each state value once"
                )));
            }
        }
        let mut ordered = Vec::with_capacity(self.state.len());
        for &(id, at, len) in &self.state {
            let value = graph.value(id);
            let Some(data) = given.remove(value.name.as_str()) else {
                return Err(RuntimeError::Shape(format!(
                    "no values for optimizer state `{}`; give every state value the schedule has",
                    value.name
                )));
            };
            if data.len() != len {
                return Err(RuntimeError::TensorSizeMismatch {
                    name: value.name.clone(),
                    shape: value.ty.shape.iter().map(|&d| d as usize).collect(),
                    expected: len,
                    got: data.len(),
                });
            }
            ordered.push((at, len, data));
        }
        if let Some(name) = given.keys().min() {
            return Err(RuntimeError::Shape(format!(
                "the schedule has no optimizer state `{name}`; the state is from another model"
            )));
        }
        for (t, len, data) in ordered {
            if let Some((at, part)) = self.held(t, len, 4) {
                self.backend.write_f32(at, &data[part])?;
            }
        }
        Ok(())
    }

    /// Sets the number of steps taken, so the next step is AdamW's step `steps + 1` (its bias
    /// correction); for resuming from a checkpoint after [`Executor::load_params`] and
    /// [`Executor::load_state`].
    pub fn set_step(&mut self, steps: u64) {
        self.step = steps;
        self.updates = steps;
    }

    /// Sets the steps taken and, apart, the AdamW steps applied (fewer when loss-scaled
    /// steps were skipped): [`Executor::set_step`] for a loss-scaled run.
    pub fn set_steps(&mut self, steps: u64, updates: u64) {
        self.step = steps;
        self.updates = updates.min(steps);
    }

    /// Every parameter's current values, in parameter order, read from their homes (from
    /// the f32 master weight of a bf16 parameter).
    ///
    /// With a sharded schedule every rank must call it (it gathers the ranks' shards, one
    /// parameter at a time) and every rank gets the whole weights.
    pub fn params(&self) -> Result<Vec<Vec<f32>>> {
        (0..self.params.len()).map(|i| self.param(i)).collect()
    }

    /// Parameter `index`'s current values (in parameter order), as [`Executor::params`]
    /// reads them: one tensor, so a caller writing the weights out holds one whole tensor
    /// beyond the rank's shards at a time. With a sharded schedule every rank must call it
    /// for the same parameters in the same order.
    pub fn param(&self, index: usize) -> Result<Vec<f32>> {
        self.flush_disk()?;
        let home = self.params.get(index).ok_or_else(|| {
            RuntimeError::Shape(format!(
                "the model has {} parameters, there is no parameter {index}",
                self.params.len()
            ))
        })?;
        let mut out = vec![0.0; home.len];
        let (t, size) = home.source();
        if let Some((at, part)) = self.held(t, home.len, size) {
            self.read_param_part(home, at, &mut out[part])?;
        }
        self.gather_parts(t, size, &mut out)?;
        Ok(out)
    }

    /// Reads the `out.len()` elements of parameter `home` held at `at` as f32: from its f32
    /// master weight when it has one, else widened from its own type.
    fn read_param_part(&self, home: &ParamHome, at: Address, out: &mut [f32]) -> Result<()> {
        match (home.master, home.dtype) {
            (Some(_), _) => self.backend.read_f32(at, out)?,
            (None, DType::BF16) => {
                let mut narrow = vec![half::bf16::ZERO; out.len()];
                self.backend.read_bf16(at, &mut narrow)?;
                for (o, x) in out.iter_mut().zip(narrow) {
                    *o = x.to_f32();
                }
            }
            (None, DType::F16) => {
                let mut narrow = vec![half::f16::ZERO; out.len()];
                self.backend.read_f16(at, &mut narrow)?;
                for (o, x) in out.iter_mut().zip(narrow) {
                    *o = x.to_f32();
                }
            }
            (None, _) => self.backend.read_f32(at, out)?,
        }
        Ok(())
    }

    /// The training state tensor by tensor, as the ranks hold it: every parameter (its f32
    /// values, read from its master weight when it has one), then every optimizer-state value
    /// in graph order (the order of [`Executor::params`] and [`Executor::state`]), each with
    /// the elements every rank holds. Rank `q`'s part of a tensor in a sharded chunk is its
    /// slice of the chunk; every rank holds all of any other tensor. A pure function of the
    /// schedule: every rank computes every rank's parts without a collective.
    pub fn state_tensors(&self) -> Vec<StateTensor> {
        let graph = &self.schedule.graph;
        let ranks = self.schedule.ranks();
        let parts = |t: TensorRef, len: usize, size: u64| -> Vec<Range<usize>> {
            (0..ranks)
                .map(|q| held(self.schedule, t, len, size, q).map_or(0..0, |(_, r)| r))
                .collect()
        };
        let shape = |id: ValueId| {
            graph
                .value(id)
                .ty
                .shape
                .iter()
                .map(|&d| d as usize)
                .collect()
        };
        let params = graph.params().zip(&self.params).map(|((_, p), home)| {
            let (t, size) = home.source();
            StateTensor {
                name: p.name.clone(),
                shape: shape(p.value),
                len: home.len,
                held: parts(t, home.len, size),
            }
        });
        let state = self.state.iter().map(|&(id, t, len)| StateTensor {
            name: graph.value(id).name.clone(),
            shape: shape(id),
            len,
            held: parts(t, len, 4),
        });
        params.chain(state).collect()
    }

    /// This rank's part of state tensor `index` ([`Executor::state_tensors`]: its
    /// `held[rank]` elements), read from its home without any collective.
    pub fn read_held(&self, index: usize) -> Result<Vec<f32>> {
        self.flush_disk()?;
        match index.checked_sub(self.params.len()) {
            None => {
                let home = &self.params[index];
                let (t, size) = home.source();
                let Some((at, part)) = self.held(t, home.len, size) else {
                    return Ok(Vec::new());
                };
                let mut out = vec![0.0; part.len()];
                self.read_param_part(home, at, &mut out)?;
                Ok(out)
            }
            Some(s) => {
                let &(_, t, len) = self.state.get(s).ok_or_else(|| {
                    RuntimeError::Shape(format!(
                        "the training state has {} tensors, there is no tensor {index}",
                        self.params.len() + self.state.len()
                    ))
                })?;
                let Some((at, part)) = self.held(t, len, 4) else {
                    return Ok(Vec::new());
                };
                let mut out = vec![0.0; part.len()];
                self.backend.read_f32(at, &mut out)?;
                Ok(out)
            }
        }
    }

    /// Writes this rank's part of state tensor `index` ([`Executor::state_tensors`]) from
    /// `read`, which is given the elements this rank needs (one range: for a parameter the
    /// span of its own home's part and its master weight's) and returns their values. The
    /// range is empty, and `read` not called, when the rank holds none of the tensor. A
    /// parameter is written at its home (narrowed to its type) and at its master weight; the
    /// step count is left alone ([`Executor::set_step`]).
    pub fn load_held(
        &mut self,
        index: usize,
        read: &mut dyn FnMut(Range<usize>) -> Result<Vec<f32>>,
    ) -> Result<()> {
        self.flush_disk()?;
        let wrong_length = |name: String, len: usize, got: usize| {
            RuntimeError::Shape(format!(
                "{got} values were read for {len} elements of {name}; the checkpoint is damaged"
            ))
        };
        match index.checked_sub(self.params.len()) {
            None => {
                let home = &self.params[index];
                let (len, dtype) = (home.len, home.dtype);
                let mine = home.at.and_then(|at| self.held(at, len, dtype.size()));
                let master = home.master.and_then(|m| self.held(m, len, 4));
                let ranges: Vec<&Range<usize>> =
                    mine.iter().chain(&master).map(|(_, r)| r).collect();
                let (Some(lo), Some(hi)) = (
                    ranges.iter().map(|r| r.start).min(),
                    ranges.iter().map(|r| r.end).max(),
                ) else {
                    return Ok(());
                };
                let data = read(lo..hi)?;
                if data.len() != hi - lo {
                    let name = self
                        .schedule
                        .graph
                        .params()
                        .nth(index)
                        .map(|(_, p)| p.name.clone());
                    return Err(wrong_length(name.unwrap_or_default(), hi - lo, data.len()));
                }
                if let Some((at, part)) = mine {
                    let data = &data[part.start - lo..part.end - lo];
                    match dtype {
                        DType::BF16 => {
                            let narrow: Vec<half::bf16> =
                                data.iter().map(|&x| half::bf16::from_f32(x)).collect();
                            self.backend.write_bf16(at, &narrow)?;
                        }
                        DType::F16 => {
                            let narrow: Vec<half::f16> =
                                data.iter().map(|&x| half::f16::from_f32(x)).collect();
                            self.backend.write_f16(at, &narrow)?;
                        }
                        _ => self.backend.write_f32(at, data)?,
                    }
                }
                if let Some((at, part)) = master {
                    self.backend
                        .write_f32(at, &data[part.start - lo..part.end - lo])?;
                }
                Ok(())
            }
            Some(s) => {
                let &(id, t, len) = self.state.get(s).ok_or_else(|| {
                    RuntimeError::Shape(format!(
                        "the training state has {} tensors, there is no tensor {index}",
                        self.params.len() + self.state.len()
                    ))
                })?;
                let Some((at, part)) = self.held(t, len, 4) else {
                    return Ok(());
                };
                let data = read(part.clone())?;
                if data.len() != part.len() {
                    let name = self.schedule.graph.value(id).name.clone();
                    return Err(wrong_length(name, part.len(), data.len()));
                }
                self.backend.write_f32(at, &data)
            }
        }
    }

    /// Every rank's `send` (all of the same length), in rank order: `send` alone without a
    /// collective. Every rank of a data-parallel schedule must call it at the same point;
    /// what the ranks agree on between steps (a checkpoint's shards) goes through it.
    pub fn exchange(&self, send: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mut comm = self.comm();
        let Some(comm) = comm.as_deref_mut() else {
            return Ok(vec![send.to_vec()]);
        };
        let world = comm.world();
        let mut recv = vec![0u8; send.len() * world];
        comm.all_gather(send, &mut recv)?;
        Ok(recv
            .chunks(send.len().max(1))
            .take(world)
            .map(<[u8]>::to_vec)
            .collect())
    }

    /// Records a [`Span`] for every kernel and copy of the following steps (or stops).
    pub fn set_tracing(&mut self, on: bool) {
        self.tracing = on;
        for s in &mut self.streams {
            if on {
                s.spans.reserve_exact(s.program.len());
            } else {
                s.spans = Vec::new();
            }
        }
    }

    /// How long the last step took, per stream.
    pub fn timing(&self) -> &StepTiming {
        &self.timing
    }

    /// The kernels and copies of the last step, by start time, when tracing is on.
    pub fn timeline(&self) -> Vec<Span> {
        let mut spans: Vec<Span> = self
            .streams
            .iter()
            .flat_map(|s| s.spans.iter().copied())
            .collect();
        spans.sort_by(|a, b| a.start.total_cmp(&b.start));
        spans
    }

    /// Runs one step on a batch: `inputs[i]` feeds the graph's `i`-th input (token ids and
    /// targets, row-major `[B,T]`; `[K*B,T]` with `K` [micro-batches](Self::micro_batches),
    /// micro-batch `m` taking rows `m*B..(m+1)*B`). Returns the loss (the mean over every
    /// position of the step) and, when clipping, the gradient norm.
    /// AdamW updates at the learning rate compiled into the schedule; see
    /// [`Executor::step_at_lr`] for a step at another.
    ///
    /// Inputs are checked before anything runs. If a stream fails mid-step, every other
    /// stream stops at its next wait and the first error is returned; parameters and
    /// optimizer state are then partly updated and should be loaded again.
    pub fn step(&mut self, inputs: &[&[i32]]) -> Result<StepReport> {
        self.run_step(inputs, None, None)
    }

    /// [`Executor::step`] with every AdamW op updating at learning rate `lr` instead of the
    /// one compiled into it: a learning-rate schedule's value for this step (the compiled one
    /// is its peak). Fails, running nothing, unless `lr` is finite and at least 0.
    pub fn step_at_lr(&mut self, inputs: &[&[i32]], lr: f64) -> Result<StepReport> {
        self.step_with(inputs, Some(lr), None)
    }

    /// [`Executor::step`] at learning rate `lr` and, for a [loss-scaled](Self::loss_scaled)
    /// schedule, loss scale `loss_scale` (`None`: the compiled ones). Fails, running nothing,
    /// unless `lr` is finite and at least 0 and `loss_scale` finite and above 0.
    pub fn step_with(
        &mut self,
        inputs: &[&[i32]],
        lr: Option<f64>,
        loss_scale: Option<f64>,
    ) -> Result<StepReport> {
        if let Some(lr) = lr.filter(|lr| !(lr.is_finite() && *lr >= 0.0)) {
            return Err(RuntimeError::InvalidLearningRate {
                lr,
                step: self.step + 1,
            });
        }
        if let Some(scale) = loss_scale.filter(|s| !(s.is_finite() && *s > 0.0)) {
            return Err(RuntimeError::InvalidLossScale(
                crate::error::LossScaleProblem::Scale {
                    step: self.step + 1,
                    scale,
                },
            ));
        }
        self.run_step(inputs, lr, loss_scale)
    }

    /// Sets the learning rate of every AdamW op to `lr` and the loss scale of the loss-scaled
    /// ops to `loss_scale`, or back to the compiled ones.
    fn set_hyperparameters(&mut self, lr: Option<f64>, loss_scale: Option<f64>) {
        let graph = &self.schedule.graph;
        for planned in self
            .streams
            .iter_mut()
            .flat_map(|s| s.program.iter_mut().chain(s.update.iter_mut()))
        {
            if let Planned::Kernel {
                op,
                launched: Some(launched),
                ..
            } = planned
            {
                match graph.op(*op).kind {
                    OpKind::AdamW { lr: compiled, .. } => {
                        set_learning_rate(&mut launched.kind, lr.unwrap_or(compiled))
                    }
                    OpKind::CrossEntropyBackwardLossScaled {
                        loss_scale: compiled,
                        ..
                    }
                    | OpKind::UnscaleCoef {
                        loss_scale: compiled,
                        ..
                    }
                    | OpKind::MoeAuxLossBackward {
                        loss_scale: Some(compiled),
                        ..
                    } => set_loss_scale(&mut launched.kind, loss_scale.unwrap_or(compiled)),
                    _ => {}
                }
            }
        }
    }

    /// A step at learning rate `lr` and loss scale `loss_scale` (`None`: the compiled ones).
    fn run_step(
        &mut self,
        inputs: &[&[i32]],
        lr: Option<f64>,
        loss_scale: Option<f64>,
    ) -> Result<StepReport> {
        let schedule: &'s Schedule = self.schedule;
        let graph = &schedule.graph;
        self.check_disk()?;
        let k = self.micro_batches as usize;
        // A chunk-major schedule's homes are every micro-batch's: the first micro-batch's
        // are the inputs a step is given.
        let per_micro_batch = match self.interleaved {
            true => self.inputs.len() / k,
            false => self.inputs.len(),
        };
        if inputs.len() != per_micro_batch {
            return Err(RuntimeError::Shape(format!(
                "the schedule takes {} inputs, {} were given",
                per_micro_batch,
                inputs.len()
            )));
        }
        for (home, data) in self.inputs.iter().zip(inputs) {
            if data.len() != home.len * k {
                let per = match k {
                    1 => String::new(),
                    _ => format!(" ({k} micro-batches of {})", home.len),
                };
                return Err(RuntimeError::Shape(format!(
                    "input {} needs {} tokens{per}, {} were given",
                    graph.value(home.value).name,
                    home.len * k,
                    data.len()
                )));
            }
            if let Some(vocab) = home.vocab {
                kernels::check_tokens(data, vocab)?;
            }
        }
        let ranks = self.schedule.ranks() as usize;
        if self.comm().is_none() && ranks > 1 {
            return Err(RuntimeError::NoCollective { ranks });
        }
        self.set_hyperparameters(lr, loss_scale);
        // A sharded chunk's accumulator: the rank zeroes the part it holds.
        for &(home, bytes) in &self.accumulators {
            if let Some((space, offset, _, len)) = self.schedule.rank_slice(home, bytes, self.rank)
            {
                self.backend.fill_zero(Address { space, offset }, len)?;
            }
        }
        for s in &mut self.streams {
            s.busy = 0.0;
            s.spans.clear();
        }
        let step = self.step + 1;
        // AdamW's step number (bias correction): skipped steps do not count.
        let update = self.updates + 1;
        let start = Instant::now();
        let mut outcome = Outcome::default();
        // The write-backs the last step carried over run in this step's first micro-batch.
        let mut carried = self.take_carried();
        // The micro-batches' losses, in order; their mean (summed in f64) is the step's.
        let mut losses: Vec<f32> = Vec::with_capacity(k);
        if self.interleaved {
            // One program runs every micro-batch: micro-batch `m`'s rows go to its inputs.
            for (i, home) in self.inputs.iter().enumerate() {
                let (m, data) = (i / per_micro_batch, inputs[i % per_micro_batch]);
                self.backend
                    .write_i32(home.at, &data[m * home.len..(m + 1) * home.len])?;
            }
            outcome = outcome.merge(self.run_phase(false, carried, update, start)?);
            for &at in &self.micro_batch_losses {
                let mut loss = [0.0f32];
                self.backend.read_f32(at, &mut loss)?;
                losses.push(loss[0]);
            }
        }
        let sequential = if self.interleaved { 0 } else { k };
        for m in 0..sequential {
            for (home, data) in self.inputs.iter().zip(inputs) {
                self.backend
                    .write_i32(home.at, &data[m * home.len..(m + 1) * home.len])?;
            }
            outcome = outcome.merge(self.run_phase(false, carried, update, start)?);
            carried = false;
            let mut loss = [0.0f32];
            self.backend.read_f32(self.loss, &mut loss)?;
            losses.push(loss[0]);
        }
        if k > 1 && !self.interleaved {
            outcome = outcome.merge(self.run_phase(true, false, update, start)?);
        }
        // This step's last write-backs are left to the next step's start.
        self.leave_carried();
        // The loss-scaled ops report the unscaled norm, infinite or NaN when a gradient
        // overflowed: then every AdamW read the skip coefficient and changed nothing.
        let skipped = self.loss_scaled && !outcome.grad_norm.is_some_and(f32::is_finite);
        // Every rank's losses: the global batch's micro-batches in order.
        if let Some(comm) = self
            .comm
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .as_deref_mut()
        {
            let send: Vec<u8> = losses.iter().flat_map(|l| l.to_le_bytes()).collect();
            let world = comm.world();
            let mut all = vec![0u8; send.len() * world];
            comm.all_gather(&send, &mut all)?;
            let gathered: Vec<f32> = all
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            // Rank `r`'s micro-batch `m` is the global batch's micro-batch `m * W + r`
            // ([`crate::data::rank_rows`]): the losses in that order, one rank's order.
            losses = (0..gathered.len())
                .map(|g| gathered[(g % world) * k + g / world])
                .collect();
        }
        let n = losses.len();
        let losses: f64 = losses.iter().map(|&l| f64::from(l)).sum();
        self.step = step;
        if !skipped {
            self.updates = update;
        }
        self.timing.wall_seconds = start.elapsed().as_secs_f64();
        for (t, s) in self
            .timing
            .stream_busy_seconds
            .iter_mut()
            .zip(&self.streams)
        {
            *t = s.busy;
        }
        Ok(StepReport {
            loss: match n {
                1 => losses as f32,
                _ => (losses / n as f64) as f32,
            },
            grad_norm: outcome.grad_norm,
            skipped,
        })
    }

    /// Runs every stream's micro-batch program (or, with `update`, its update program) on
    /// its own thread until all are done: one barrier-delimited part of step `step`. The
    /// micro-batch program's carried disk writes run only with `carried`.
    fn run_phase(
        &mut self,
        update: bool,
        carried: bool,
        step: u64,
        start: Instant,
    ) -> Result<Outcome> {
        let graph = &self.schedule.graph;
        self.backend.begin_step();
        let (backend, tracing) = (&self.backend, self.tracing);
        // The collective stream (at most one) issues through this rank's collective.
        let mut comm: Option<&mut (dyn Collective + 'static)> = self
            .comm
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .as_deref_mut();
        let results: Vec<std::thread::Result<Result<Outcome>>> = std::thread::scope(|scope| {
            let running: Vec<_> = self
                .streams
                .iter_mut()
                .map(|s| {
                    let empty = match update {
                        false => s.program.len() == if carried { 0 } else { s.carried },
                        true => s.update.is_empty(),
                    };
                    if empty {
                        return None;
                    }
                    let comm = match s.collective {
                        true => comm.take(),
                        false => None,
                    };
                    Some(scope.spawn(move || {
                        run_stream(
                            backend, graph, s, update, carried, step, start, tracing, comm,
                        )
                    }))
                })
                .collect();
            running.into_iter().flatten().map(|h| h.join()).collect()
        });
        let mut outcome = Outcome::default();
        let mut failure: Option<RuntimeError> = None;
        for result in results {
            match result {
                Err(panic) => std::panic::resume_unwind(panic),
                Ok(Ok(o)) => outcome = outcome.merge(o),
                Ok(Err(e)) => match (&failure, &e) {
                    (None, _) | (Some(RuntimeError::StepAborted), _) => failure = Some(e),
                    _ => {}
                },
            }
        }
        if let Some(e) = failure {
            return Err(e);
        }
        Ok(outcome.merge(self.backend.step_outcome()?))
    }
}

/// The rank's collective, which `what` (a collective instruction) needs: only the collective
/// stream's thread has it.
fn rank_collective<'c>(
    comm: &'c mut Option<&mut (dyn Collective + 'static)>,
    what: &str,
) -> Result<&'c mut (dyn Collective + 'static)> {
    comm.as_deref_mut().ok_or_else(|| {
        RuntimeError::BadSchedule(format!("{what} on a stream without the rank's collective"))
    })
}

/// Aborts the step when a stream thread unwinds, so the others stop waiting for it.
struct AbortOnPanic<'a, B: Backend>(&'a B);

impl<B: Backend> Drop for AbortOnPanic<'_, B> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.abort();
        }
    }
}

/// Issues one stream's program (its update program with `update`; the program's carried disk
/// writes only with `carried`) for step `step`, timing its kernels, copies and collectives
/// (issued through `comm`, the collective stream's); its busy time and spans add to the
/// step's.
#[allow(clippy::too_many_arguments)]
fn run_stream<B: Backend>(
    backend: &B,
    graph: &Graph,
    s: &mut StreamRun<B::Stream>,
    update: bool,
    carried: bool,
    step: u64,
    start: Instant,
    tracing: bool,
    mut comm: Option<&mut (dyn Collective + 'static)>,
) -> Result<Outcome> {
    let _abort = AbortOnPanic(backend);
    let mut outcome = Outcome::default();
    let (program, first) = match update {
        false => (&s.program, 0),
        true => (&s.update, s.update_at as usize),
    };
    let skip = match (update, carried) {
        (false, false) => s.carried,
        _ => 0,
    };
    let mut issue = || -> Result<()> {
        let mut at = skip;
        while at < program.len() {
            let (index, instr) = (first + at, &program[at]);
            at += 1;
            let began = start.elapsed().as_secs_f64();
            let group = adamw_run(graph, &program[at - 1..]);
            if !group.is_empty() {
                // A run of AdamW kernels (one included) goes to the backend whole. Each kernel
                // is timed as it ends; in the order they end, each span runs from the end of
                // the one before (the first from the run's start, so a wait for the backend's
                // workers counts), so the spans tile the run.
                at += group.len() - 1;
                let launches = group
                    .iter()
                    .map(|planned| launch_of(graph, planned, step))
                    .collect::<Result<Vec<_>>>()?;
                let ends: Vec<AtomicU64> = group.iter().map(|_| AtomicU64::new(0)).collect();
                let ended = |i: usize| {
                    let t = start.elapsed().as_secs_f64();
                    ends[i].store(t.to_bits(), Ordering::Release);
                };
                // SAFETY: as for kernels below; the AdamW ops of a run update distinct
                // parameters, moments and gradients.
                let done = unsafe { backend.launch_adamw_run(&mut s.handle, &launches, &ended)? };
                let finished = start.elapsed().as_secs_f64();
                let mut order: Vec<(f64, usize)> = ends
                    .iter()
                    .map(|e| match f64::from_bits(e.load(Ordering::Acquire)) {
                        t if t > 0.0 => t.clamp(began, finished),
                        _ => finished,
                    })
                    .zip(0..)
                    .collect();
                order.sort_by(|a, b| a.0.total_cmp(&b.0));
                let mut last = began;
                for (ended, k) in order {
                    if tracing {
                        s.spans.push(Span {
                            stream: s.id,
                            index: (index + k) as u32,
                            start: last,
                            end: ended,
                        });
                    }
                    last = ended;
                }
                s.busy += finished - began;
                outcome = outcome.merge(done);
                continue;
            }
            match instr {
                Planned::Wait(event) => {
                    backend.wait(&mut s.handle, *event)?;
                    continue;
                }
                Planned::Record(event) => {
                    backend.record(&mut s.handle, *event)?;
                    continue;
                }
                Planned::Skip => continue,
                Planned::Cast(cast) => {
                    // SAFETY: as for kernels.
                    unsafe { backend.cast(&mut s.handle, cast)? };
                }
                Planned::Kernel { .. } => {
                    // SAFETY: the schedule was verified when the executor was made, and its
                    // instructions are issued in stream order with its events: the verifier
                    // proves that no two threads then touch overlapping bytes unordered and
                    // that a kernel's outputs overlap none of its inputs.
                    let done =
                        unsafe { launch_kernel(backend, &mut s.handle, graph, instr, step)? };
                    outcome = outcome.merge(done);
                }
                Planned::Copy { src, dst, bytes } => {
                    // SAFETY: as for kernels.
                    unsafe { backend.copy(&mut s.handle, *src, *dst, *bytes)? };
                }
                Planned::AllReduce { at, dtype, len } => {
                    let comm = rank_collective(&mut comm, "an all-reduce")?;
                    // SAFETY: as for kernels.
                    unsafe { backend.all_reduce(&mut s.handle, *at, *dtype, *len, comm)? };
                }
                Planned::AllGather { at, bytes } => {
                    let comm = rank_collective(&mut comm, "an all-gather")?;
                    // SAFETY: as for kernels.
                    unsafe { backend.all_gather(&mut s.handle, *at, *bytes, comm)? };
                }
                Planned::ReduceScatter { at, dtype, len } => {
                    let comm = rank_collective(&mut comm, "a reduce-scatter")?;
                    // SAFETY: as for kernels.
                    unsafe { backend.reduce_scatter(&mut s.handle, *at, *dtype, *len, comm)? };
                }
                Planned::AccumulateIntoShard {
                    acc,
                    part,
                    grad,
                    dtype,
                    len,
                } => {
                    let comm = rank_collective(&mut comm, "an accumulation over the ranks")?;
                    if part.end > *len {
                        return Err(RuntimeError::BadSchedule(format!(
                            "a rank's part {part:?} of a sharded accumulator of {len} \
                             elements; this is a bug in the executor"
                        )));
                    }
                    // SAFETY: as for kernels.
                    unsafe {
                        backend.accumulate_into_shard(
                            &mut s.handle,
                            *acc,
                            part.clone(),
                            *grad,
                            *dtype,
                            *len,
                            comm,
                        )?
                    };
                }
                Planned::AddOverRanks { from, bytes, sum } => {
                    let Planned::AccumulateOverRanks {
                        acc,
                        grad,
                        dtype,
                        len,
                        kernel,
                    } = sum.as_ref()
                    else {
                        return Err(RuntimeError::BadSchedule(
                            "a gradient sum's add over the ranks planned without its \
                             accumulation; this is a bug in the executor"
                                .into(),
                        ));
                    };
                    let comm = rank_collective(&mut comm, "a gradient sum over the ranks")?;
                    // SAFETY: as for kernels; the verifier proved the sum's bytes apart
                    // from its inputs'.
                    let summed = unsafe {
                        if from != acc {
                            backend.copy(&mut s.handle, *from, *acc, *bytes)?;
                        }
                        backend.all_reduce_into(&mut s.handle, *acc, *grad, *dtype, *len, comm)?
                    };
                    // A backend that summed the gradient over the ranks in place (NCCL) adds
                    // the running sum to it with the add's own kernel.
                    if !summed {
                        // SAFETY: as for kernels.
                        let done =
                            unsafe { launch_kernel(backend, &mut s.handle, graph, kernel, step)? };
                        outcome = outcome.merge(done);
                    }
                }
                Planned::AccumulateOverRanks {
                    acc,
                    grad,
                    dtype,
                    len,
                    kernel,
                } => {
                    let comm = rank_collective(&mut comm, "an accumulation over the ranks")?;
                    // SAFETY: as for kernels.
                    let summed = unsafe {
                        backend.all_reduce_into(&mut s.handle, *acc, *grad, *dtype, *len, comm)?
                    };
                    // A backend that summed the gradient over the ranks in place (NCCL) leaves
                    // the accumulation to the op's kernel, after the sum on this stream.
                    if !summed {
                        // SAFETY: as for kernels; the sum wrote only the gradient's bytes.
                        let done =
                            unsafe { launch_kernel(backend, &mut s.handle, graph, kernel, step)? };
                        outcome = outcome.merge(done);
                    }
                }
            }
            let ended = start.elapsed().as_secs_f64();
            s.busy += ended - began;
            if tracing {
                s.spans.push(Span {
                    stream: s.id,
                    index: index as u32,
                    start: began,
                    end: ended,
                });
            }
        }
        backend.synchronize(&mut s.handle)
    };
    match issue() {
        Ok(()) => Ok(outcome),
        Err(e) => {
            backend.abort();
            Err(e)
        }
    }
}

/// The run of adjacent AdamW kernels that `program` starts with (empty when its first
/// instruction is not one): a backend may run them as one piece of work
/// ([`Backend::launch_adamw_run`]). Any other instruction, an event included, ends the run.
fn adamw_run<'p>(graph: &Graph, program: &'p [Planned]) -> &'p [Planned] {
    let len = program
        .iter()
        .take_while(|planned| match planned {
            Planned::Kernel { op, launched, .. } => matches!(
                launched.as_deref().unwrap_or_else(|| graph.op(*op)).kind,
                OpKind::AdamW { .. }
            ),
            _ => false,
        })
        .count();
    &program[..len]
}

/// Launches `planned`, a planned kernel, on `stream` for step `step`; anything else is a bug.
///
/// # Safety
///
/// The ordering contract of [`Backend::launch`] holds for its operands.
unsafe fn launch_kernel<B: Backend>(
    backend: &B,
    stream: &mut B::Stream,
    graph: &Graph,
    planned: &Planned,
    step: u64,
) -> Result<Outcome> {
    let launch = launch_of(graph, planned, step)?;
    // SAFETY: the caller's contract.
    unsafe { backend.launch(stream, &launch) }
}

/// The launch of `planned`, a planned kernel, for step `step`; anything else is a bug.
fn launch_of<'a>(graph: &'a Graph, planned: &'a Planned, step: u64) -> Result<Launch<'a>> {
    let Planned::Kernel {
        op,
        launched,
        inputs,
        outputs,
        workspace,
        prepared,
        shard,
        pitches,
    } = planned
    else {
        return Err(RuntimeError::BadSchedule(
            "an instruction planned as a kernel is not one; this is a bug in the executor".into(),
        ));
    };
    Ok(Launch {
        graph,
        op: launched.as_deref().unwrap_or_else(|| graph.op(*op)),
        prepared,
        inputs,
        outputs,
        workspace: *workspace,
        step,
        shard: shard.as_deref().copied(),
        pitches: pitches.as_deref().copied().unwrap_or(Pitches::DENSE),
    })
}

/// A tensor's address.
fn address(schedule: &Schedule, t: TensorRef) -> Address {
    Address::of(schedule, t)
}

/// What rank `rank` holds of the `len` elements of `size` bytes at `t`: the address of the
/// first element it holds and which elements; all of them unless `t` is in a sharded chunk
/// ([`Schedule::rank_slice`]), `None` when it holds none.
fn held(
    schedule: &Schedule,
    t: TensorRef,
    len: usize,
    size: u64,
    rank: u32,
) -> Option<(Address, Range<usize>)> {
    let (space, offset, skip, bytes) = schedule.rank_slice(t, len as u64 * size, rank)?;
    let first = (skip / size) as usize;
    Some((
        Address { space, offset },
        first..first + (bytes / size) as usize,
    ))
}

/// Where rank `rank` holds element `first` (of `size` bytes) of the tensor at `t`: its part
/// of a sharded chunk's operand, whose parts split at the same elements.
fn element_address(
    schedule: &Schedule,
    t: TensorRef,
    first: usize,
    size: u64,
    rank: u32,
) -> Address {
    let at = TensorRef {
        buffer: t.buffer,
        offset: t.offset + first as u64 * size,
    };
    held(schedule, at, 1, size, rank).map_or_else(|| address(schedule, at), |(a, _)| a)
}

/// An instruction of a verified schedule with its addresses resolved, for rank `rank`, and
/// its constants made; `collective` when it is on the collective stream, where an
/// `accumulate_grad` sums the gradient over the ranks into the accumulator.
fn plan(
    schedule: &Schedule,
    instr: &Instr,
    rank: u32,
    masters: &HashMap<ValueId, TensorRef>,
    collective: bool,
) -> Planned {
    let graph = &schedule.graph;
    match instr {
        Instr::Kernel { op, inputs, .. }
            if collective && graph.op(*op).kind == OpKind::AccumulateGrad =>
        {
            plan_accumulate(schedule, instr, *op, inputs, rank, masters)
        }
        Instr::Kernel {
            op,
            inputs,
            outputs,
            ..
        } if collective && graph.op(*op).kind == OpKind::Add => {
            let ty = &graph.value(graph.op(*op).outputs[0]).ty;
            Planned::AddOverRanks {
                from: address(schedule, inputs[0]),
                bytes: ty.bytes(),
                sum: Box::new(Planned::AccumulateOverRanks {
                    acc: address(schedule, outputs[0]),
                    grad: address(schedule, inputs[1]),
                    dtype: ty.dtype,
                    len: ty.numel() as usize,
                    kernel: Box::new(plan(schedule, instr, rank, masters, false)),
                }),
            }
        }
        Instr::Kernel {
            op,
            inputs,
            outputs,
            workspace,
        } => plan_kernel(schedule, *op, inputs, outputs, *workspace, rank, masters),
        Instr::Copy {
            src, dst, bytes, ..
        } => Planned::Copy {
            src: address(schedule, *src),
            dst: address(schedule, *dst),
            bytes: *bytes,
        },
        // This rank's slice, `rank * bytes` into both sides of the whole layout.
        Instr::CopyShard {
            src, dst, bytes, ..
        } => {
            let shift = |t: TensorRef| element_address(schedule, t, rank as usize, *bytes, rank);
            Planned::Copy {
                src: shift(*src),
                dst: shift(*dst),
                bytes: *bytes,
            }
        }
        // The backend reads and writes the disk file at disk addresses. A shard moves whole
        // between the rank's own file and its slice of a sharded staging buffer: `rank *
        // bytes` into both sides of the whole layout, as a shard copy.
        Instr::DiskRead {
            src, dst, bytes, ..
        }
        | Instr::DiskWrite {
            src, dst, bytes, ..
        } => {
            let shift = |t: TensorRef| match schedule.buffer(t.buffer).kind.is_sharded() {
                true => element_address(schedule, t, rank as usize, *bytes, rank),
                false => address(schedule, t),
            };
            Planned::Copy {
                src: shift(*src),
                dst: shift(*dst),
                bytes: *bytes,
            }
        }
        Instr::AllGather { at, bytes, .. } => Planned::AllGather {
            at: address(schedule, *at),
            bytes: *bytes,
        },
        Instr::ReduceScatter {
            at, bytes, dtype, ..
        } => Planned::ReduceScatter {
            at: address(schedule, *at),
            dtype: *dtype,
            len: (*bytes / dtype.size()) as usize,
        },
        Instr::CastChunk {
            chunk,
            src,
            dst,
            bytes,
        } => Planned::Cast(CastLaunch {
            // The verifier checked that every member is a narrow parameter.
            parts: schedule
                .cast_pieces(*chunk, *src, *dst)
                .unwrap_or_default()
                .into_iter()
                .map(|p| CastPart {
                    master: address(schedule, p.master),
                    narrow: address(schedule, p.narrow),
                    len: p.len as usize,
                    dtype: p.dtype,
                })
                .collect(),
            dst: address(schedule, *dst),
            bytes: *bytes,
        }),
        Instr::Record { event } => Planned::Record(*event),
        Instr::Wait { event } => Planned::Wait(*event),
        Instr::AllReduce { value, at } => {
            let ty = &graph.value(*value).ty;
            Planned::AllReduce {
                at: address(schedule, *at),
                dtype: ty.dtype,
                len: ty.numel() as usize,
            }
        }
        // `Schedule::phases` splits the streams at their markers: none reaches here.
        Instr::EndMicroBatch { .. } => unreachable!("streams are planned without their markers"),
    }
}

/// [`plan`] of an `AccumulateGrad` kernel of a run with a collective: into a sharded chunk's
/// accumulator, the rank adds the ranks' gradients to its part; elsewhere every rank adds
/// the all-reduced gradient after its own kernel `instr`.
fn plan_accumulate(
    schedule: &Schedule,
    instr: &Instr,
    op: OpId,
    inputs: &[TensorRef],
    rank: u32,
    masters: &HashMap<ValueId, TensorRef>,
) -> Planned {
    let graph = &schedule.graph;
    let ty = &graph.value(graph.op(op).inputs[0]).ty;
    let len = ty.numel() as usize;
    // A sharded chunk's accumulator: the rank adds the ranks' gradients to its part.
    if matches!(
        schedule.buffer(inputs[0].buffer).kind,
        BufferKind::HostShard { .. }
    ) {
        let (acc, part) = held(schedule, inputs[0], len, ty.dtype.size(), rank)
            .unwrap_or_else(|| (address(schedule, inputs[0]), 0..0));
        return Planned::AccumulateIntoShard {
            acc,
            part,
            grad: address(schedule, inputs[1]),
            dtype: ty.dtype,
            len,
        };
    }
    Planned::AccumulateOverRanks {
        acc: address(schedule, inputs[0]),
        grad: address(schedule, inputs[1]),
        dtype: ty.dtype,
        len,
        kernel: Box::new(plan(schedule, instr, rank, masters, false)),
    }
}

/// [`plan`] of a kernel `op` over the tensors `inputs` and `outputs` (and `workspace`): its
/// operands' addresses, and for AdamW on a sharded or disk-resident chunk, the elements and
/// master weight the rank updates ([`ShardLaunch`]); [`Planned::Skip`] when the rank holds
/// none of a sharded parameter.
fn plan_kernel(
    schedule: &Schedule,
    op: OpId,
    inputs: &[TensorRef],
    outputs: &[TensorRef],
    workspace: Option<TensorRef>,
    rank: u32,
    masters: &HashMap<ValueId, TensorRef>,
) -> Planned {
    let graph = &schedule.graph;
    let o = graph.op(op);
    let types: Vec<_> = o.inputs.iter().map(|&v| &graph.value(v).ty).collect();
    let mut addresses: Vec<Address> = inputs.iter().map(|&t| address(schedule, t)).collect();
    // AdamW on a sharded chunk: the rank's part of the parameter, its gradient, its
    // moments and its master weight (the verifier checked the operands' homes).
    let sharded = |t: &TensorRef| schedule.buffer(t.buffer).kind.is_sharded();
    let mut shard = None;
    // AdamW on a disk-resident chunk: its moments are in a staging buffer, which
    // holds the chunk's state as its disk buffer does, so the master weight is at its
    // home's offset there (the verifier checked both).
    if let (OpKind::AdamW { .. }, Some(m)) = (&o.kind, inputs.get(2)) {
        let b = schedule.buffer(m.buffer);
        if matches!(b.kind, BufferKind::DiskStaging { .. }) {
            if let Some(master) = masters.get(&o.inputs[0]) {
                shard = Some(Box::new(ShardLaunch {
                    elements: types[0].numel() as usize,
                    master: Some(Address {
                        space: b.space,
                        offset: b.offset + master.offset,
                    }),
                }));
            }
        }
    }
    if let (OpKind::AdamW { .. }, Some(param)) = (&o.kind, inputs.first()) {
        if sharded(param) {
            let ty = types[0];
            let Some((at, part)) =
                held(schedule, *param, ty.numel() as usize, ty.dtype.size(), rank)
            else {
                return Planned::Skip;
            };
            addresses[0] = at;
            // The gradient and both moments.
            for ((a, &t), ty) in addresses.iter_mut().zip(inputs).zip(&types).take(4).skip(1) {
                *a = element_address(schedule, t, part.start, ty.dtype.size(), rank);
            }
            // A master weight on disk is updated where the disk tier staged it: the master
            // staging buffer paired with the moments' (at its home's offset there).
            let staged_master = inputs
                .get(2)
                .and_then(|m| schedule.shard_master_staging(m.buffer));
            shard = Some(Box::new(ShardLaunch {
                elements: part.len(),
                master: masters.get(&o.inputs[0]).map(|&m| {
                    let m = match (schedule.buffer(m.buffer).space, staged_master) {
                        (Space::Disk, Some(buffer)) => TensorRef {
                            buffer,
                            offset: m.offset,
                        },
                        _ => m,
                    };
                    element_address(schedule, m, part.start, 4, rank)
                }),
            }));
        }
    }
    Planned::Kernel {
        shard,
        pitches: Some(Pitches::of(schedule, inputs, outputs))
            .filter(Pitches::any)
            .map(Box::new),
        op,
        launched: matches!(
            o.kind,
            OpKind::AdamW { .. }
                | OpKind::CrossEntropyBackwardLossScaled { .. }
                | OpKind::UnscaleCoef { .. }
                | OpKind::MoeAuxLossBackward {
                    loss_scale: Some(_),
                    ..
                }
        )
        .then(|| Box::new(o.clone())),
        inputs: addresses,
        outputs: outputs.iter().map(|&t| address(schedule, t)).collect(),
        // The verifier checked that a kernel has a workspace exactly when its kind
        // needs one, with room for what it needs.
        workspace: workspace.map(|t| (address(schedule, t), o.kind.workspace_bytes(&types))),
        prepared: Prepared::new(&o.kind),
    }
}
