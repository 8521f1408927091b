//! A compiled schedule: when, where and on which stream each op of a training graph runs,
//! with every tensor at a fixed offset in one device arena or one pinned host region.
//!
//! The [`Graph`] says what is computed; the streams say when. One step runs every stream's
//! instruction list once, in order, with events as the only order between streams; the runtime
//! puts a barrier between steps. Before the first step the runtime places every value listed in
//! [`Schedule::homes`] (parameters, optimizer state) at its home; before each step it writes the
//! step's inputs at theirs; after it, it reads the loss from [`Schedule::loss`].
//!
//! With gradient accumulation (`K` micro-batches per step) every stream ends its micro-batch
//! program with one [`Instr::EndMicroBatch`]: a step runs the instructions before it `K` times
//! (each run a micro-batch: its inputs written first, its loss read after, a barrier between
//! runs) and the instructions after it once (the update: clipping and the optimizer, reading
//! the gradients summed over the step). The runtime zeroes every
//! [`Role::Accumulator`](crate::Role::Accumulator) value at its home before each step. Without
//! accumulation no stream has the marker and a step runs every instruction once.
//!
//! A data-parallel schedule (several ranks, see [`StreamKind::Collective`]) is one program
//! that every rank runs (SPMD): the rank is a parameter of the run (which rows of the global
//! batch it reads), never a different instruction list. Its collective stream sums gradients
//! over the ranks ([`Instr::AllReduce`]) between their last contribution and their first
//! reader in the optimizer. With accumulation it runs each gradient's `accumulate_grad`
//! kernel instead, once per micro-batch: on the collective stream that op adds every rank's
//! gradient to the accumulator (the same on every rank) one by one in rank order, in the
//! accumulator's memory, so ranks whose micro-batches interleave (rank `r`'s micro-batch `m`
//! the global micro-batch `m * ranks + r`) make the sums one rank of all of them makes.
//!
//! A data-parallel schedule may also *shard* its offloaded chunks (ZeRO-3 style): every such
//! chunk's host state (parameters, gradients, Adam moments, master weights) is split into
//! `ranks` equal slices and rank `r` keeps only slice `r`, in [`BufferKind::HostShard`]
//! buffers, so each rank's host region holds `1/ranks` of it. Before the chunk is used each
//! rank uploads its slice into its part of a chunk slot ([`Instr::CopyShard`]) and the
//! collective stream all-gathers the rest ([`Instr::AllGather`]); after the chunk's last
//! backward use the collective stream reduce-scatters its gradients ([`Instr::ReduceScatter`])
//! and each rank offloads its slice and updates it with the CPU Adam, which on each rank
//! updates only the elements of each parameter inside its slice. With accumulation a sharded
//! chunk's gradients are neither reduce-scattered nor offloaded: its `accumulate_grad`
//! kernels on the collective stream read each gradient on the device and add every rank's,
//! in rank order, to the part of the accumulator (homed in the gradient shard) each rank
//! holds. Instructions address the
//! shards in the whole layout, so the instruction list is the same on every rank; the rank
//! picks its slice when it runs ([`Schedule::rank_slice`]).
//!
//! Single-rank schedules have no collective stream, so data parallelism changes nothing in
//! their encoding; the format version stays because a new variant only extends the layout
//! (an older protrain rejects a data-parallel schedule as undecodable).
//!
//! The disk tier (ZeRO-Infinity's NVMe offload): when host memory cannot hold every offloaded
//! chunk's optimizer state, the f32 master weights and Adam moments of some chunks live in
//! [`Space::Disk`], one preallocated file of [`Schedule::disk_bytes`] bytes, each chunk's
//! state at a fixed offset (its [`BufferKind::OptimizerState`] buffer is in that space, so
//! its homes and master weights are there). A [`StreamKind::DiskIo`] stream reads each such
//! chunk's state whole into one of two host staging buffers ([`BufferKind::DiskStaging`],
//! [`Instr::DiskRead`]) before the CPU Adam updates it there, and writes it back
//! ([`Instr::DiskWrite`]) after; the staging buffers alternate, so the next chunk's read
//! overlaps this chunk's update and the previous chunk's write. A staging buffer holds a
//! chunk's state at the same offsets as its disk buffer, so an AdamW that reads its moments
//! in a staging buffer finds the master weight there too, at its home's offset in the disk
//! buffer. Where that is not enough, a chunk's parameter storage ([`BufferKind::HostChunk`],
//! where the 14-byte layout's gradients land too) and separate gradient storage
//! ([`BufferKind::HostGradChunk`]) may live on disk as well: the disk stream reads the bytes
//! an upload copies into a staging buffer before it, writes the gradients an offload landed
//! in a staging buffer after it, and reads and writes the storage around the chunk's update
//! with its state. Every staging buffer holds what it stages at the disk buffer's offsets.
//! On sharded ranks the state of a sharded chunk moves as each rank's shards of its moments
//! and master weights ([`BufferKind::HostShard`] buffers in [`Space::Disk`]: each rank keeps
//! its slices in its own file, at the buffer's offset), staged in sharded staging buffers
//! ([`BufferKind::ShardStaging`], one ring per part); a disk read or write of a shard moves,
//! on rank `r`, `bytes` from `src + r * bytes` to `dst + r * bytes` of the whole layout, as
//! [`Instr::CopyShard`] does. Their parameter and gradient shards may move too, staged in
//! sharded staging buffers of their part: a shard upload copies the rank's shard from the
//! staging buffer the disk stream read it into, a shard offload lands in one before the write.
//!
//! Carried writes: the write-backs that end a step's disk program (after the last updates,
//! their staging buffers used by nothing after them in the step) may be *carried* across
//! the step boundary ([`Instr::DiskWrite`]'s `carried`): they come first in the disk
//! stream's program, without waits, and run at the start of the next step, writing what the
//! previous step's update left in the staging buffer while that step's forward pass runs;
//! the disk stream's reads after them in the same stream see the written state. The first
//! step of a run (and the first after the state is loaded, as on a resume) skips them, since
//! no update has left anything to write; before the state on disk is read (a checkpoint, the
//! weights, the end of a run) the runtime runs them once, so the disk holds the updated
//! state. With accumulation they run once a step, before the first micro-batch.
//!
//! The 12-byte host layout ([`HostLayout::Staged`](crate::HostLayout::Staged)): a staged
//! chunk has no host copy of its narrow parameters and no host gradient chunk. A
//! [`StreamKind::HostCast`] stream runs one [`Instr::CastChunk`] before each of its uploads,
//! rounding the chunk's f32 master weights into one of two host parameter staging buffers
//! ([`BufferKind::ParamStaging`], alternating in upload order); the upload copies from there.
//! Its gradient offload lands in one of two host gradient staging buffers
//! ([`BufferKind::GradStaging`], alternating in offload order), where the CPU Adam reads each
//! gradient and writes the rounded parameter over it (as in the 14-byte layout: the narrow
//! operand of the AdamW kernel is the gradient's address), a write nothing reads; the master
//! weight carries the update to the next step's casts. Events order every reuse: a cast
//! waits for the upload that last read its staging buffer, an upload for its cast, an offload
//! into a gradient staging buffer for the CPU Adam that last read it.

use crate::chunks::ChunkTable;
use crate::graph::Graph;
use crate::ids::{BufferId, ChunkId, EventId, OpId, StreamId, ValueId};
use crate::policy::Policy;
use crate::types::DType;
use serde::{Deserialize, Serialize};

/// The version of the schedule layout this build writes and reads. 3: the header's policy
/// carries its host layout ([`HostLayout`](crate::HostLayout)). 4: the disk tier (the
/// header's disk budget, the schedule's disk region). 5: the 12-byte host layout (the staged
/// layout in the policy, staging buffers, the host cast stream and its casts). 6: Gemma's ops
/// (attention's score scale and soft-cap, RMSNorm's group width and unit offset, and the
/// scale, softcap and geglu kinds). 7: chunk-major accumulation (the policy's micro-batch
/// order, the schedule's per-micro-batch losses, [`Schedule::micro_batch_losses`]). 8: padded
/// rows (a buffer's [`RowPitch`]). 9: carried disk writes ([`Instr::DiskWrite`]'s `carried`).
pub const FORMAT_VERSION: u32 = 9;

/// A padded buffer's row pitch in bytes is a multiple of this: the alignment cuBLAS and
/// cuBLASLt need of a leading dimension (and of each row's start) to pick their vectorised,
/// tensor-core kernels, and that 16-byte loads of a row need.
pub const ROW_PITCH_ALIGN: u64 = 16;

/// Which memory a buffer lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Space {
    /// The device arena.
    Device,
    /// The pinned host region.
    Host,
    /// The disk region: one preallocated file (optimizer state that host memory cannot
    /// hold). Only [`Instr::DiskRead`] and [`Instr::DiskWrite`] touch it.
    Disk,
}

/// What a buffer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BufferKind {
    /// A step input (token ids, targets), written by the runtime before the step.
    Input,
    /// A persistent chunk's parameters, on the device all step.
    PersistentChunk {
        /// The chunk.
        chunk: ChunkId,
    },
    /// A device buffer that non-persistent chunks are fetched into, in turn.
    ChunkSlot {
        /// Which of the `n_buffer` slots.
        slot: u32,
    },
    /// A non-persistent chunk's parameters, at home in host memory.
    HostChunk {
        /// The chunk.
        chunk: ChunkId,
    },
    /// A non-persistent chunk's gradients, on the device from the first one computed until
    /// they are offloaded.
    GradChunk {
        /// The chunk.
        chunk: ChunkId,
    },
    /// A non-persistent chunk's gradients in host memory, read by the CPU optimizer.
    HostGradChunk {
        /// The chunk.
        chunk: ChunkId,
    },
    /// Optimizer state (Adam moments) of a chunk, on the device for persistent chunks, on the
    /// host for the others.
    OptimizerState {
        /// The chunk.
        chunk: ChunkId,
    },
    /// A forward or backward intermediate, or a persistent chunk's gradients.
    Activation,
    /// A swapped activation's host copy.
    HostActivation,
    /// Kernel scratch memory.
    Workspace,
    /// Gradient accumulators (the sums over a step's micro-batches), on the device for
    /// persistent chunks and on the host for the others; they live the whole step.
    Accumulators,
    /// Scratch the update program uses on the host (squared norms of host accumulators).
    HostScratch,
    /// One rank's shard of a sharded chunk's host state (ZeRO-3 style: see the module doc).
    /// The buffer's `size` is what each rank holds; tensor addresses in it are offsets in
    /// the *whole* layout of `ranks x size` bytes, of which rank `r` holds
    /// `[r*size, (r+1)*size)` ([`Schedule::rank_slice`]).
    HostShard {
        /// The chunk.
        chunk: ChunkId,
        /// Which part of the chunk's state.
        part: ShardPart,
    },
    /// A host buffer a disk-resident chunk's state is read into, updated in and written back
    /// from; two of them alternate (see the module doc).
    DiskStaging {
        /// Which of the two.
        slot: u32,
    },
    /// A host buffer a staged chunk's narrow parameters are cast into from its f32 master
    /// weights and uploaded from (the 12-byte layout, see the module doc); two alternate.
    ParamStaging {
        /// Which of the two.
        slot: u32,
    },
    /// A host buffer a staged chunk's gradients are offloaded into and the CPU Adam reads
    /// them from (the 12-byte layout, see the module doc); two alternate.
    GradStaging {
        /// Which of the two.
        slot: u32,
    },
    /// A host buffer the disk tier stages one part of sharded chunks' state in (see the
    /// module doc): sharded as a [`BufferKind::HostShard`] is (each rank holds `size` bytes
    /// of the whole `ranks x size` layout, addressed in the whole layout), so that it holds
    /// what it stages at the offsets the disk buffer has. The staging buffers of a ring are
    /// used in turn; the master weights of the chunk whose moments are in the
    /// [`ShardPart::AdamM`] buffer of slot `s` are in the [`ShardPart::Master`] buffer of
    /// slot `s` ([`Schedule::shard_master_staging`]).
    ShardStaging {
        /// Which buffer of its ring.
        slot: u32,
        /// The part of the chunks' state it stages.
        part: ShardPart,
    },
}

impl BufferKind {
    /// Whether the buffer is sharded over the ranks (each rank holds its slice of a whole
    /// layout, see [`BufferKind::HostShard`]): a host shard, on the host or on disk, or a
    /// disk staging buffer of sharded state.
    pub fn is_sharded(&self) -> bool {
        matches!(
            self,
            BufferKind::HostShard { .. } | BufferKind::ShardStaging { .. }
        )
    }
}

/// Which part of a sharded chunk's host state a [`BufferKind::HostShard`] holds. Parameters
/// and gradients keep the chunk's byte layout; the f32 parts mirror it element for element
/// (a parameter at byte `o` of the chunk has its moments at `4 * o / element size`), so
/// every part splits at the same element boundaries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardPart {
    /// The parameters, in their own type.
    Params,
    /// The gradients, reduce-scattered and offloaded.
    Grads,
    /// Adam's first moments (f32).
    AdamM,
    /// Adam's second moments (f32).
    AdamV,
    /// f32 master weights of parameters narrower than f32.
    Master,
}

/// A buffer: a byte range at a fixed offset in the device arena or the host region.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Buffer {
    /// A readable name.
    pub name: String,
    /// Device arena or host region.
    pub space: Space,
    /// Byte offset in its space.
    pub offset: u64,
    /// Bytes.
    pub size: u64,
    /// What it holds.
    pub kind: BufferKind,
    /// Set when the buffer holds one value with its rows padded: row `r` starts at element
    /// `r * pitch` and the elements after the row's length are never read as data. `None`
    /// for the dense layout every other buffer has.
    pub pitch: Option<RowPitch>,
}

/// A padded row layout: the buffer holds `value` (rows of its last dimension) with each row
/// starting `pitch` elements after the previous one, so that every row starts at a multiple
/// of [`ROW_PITCH_ALIGN`] bytes. Only a device activation whose every reader and writer takes
/// a row pitch for that operand ([`OpKind::pitched_operands`](crate::OpKind::pitched_operands))
/// is padded; parameters never are. The buffer is `rows x pitch` elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RowPitch {
    /// The value the buffer holds.
    pub value: ValueId,
    /// Elements from the start of one row to the start of the next (at least the row's
    /// length).
    pub pitch: u64,
}

/// A tensor's address: a buffer and a byte offset inside it. Its size is its value's type's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorRef {
    /// The buffer.
    pub buffer: BufferId,
    /// Byte offset inside the buffer.
    pub offset: u64,
}

/// One instruction of a stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Instr {
    /// Run an op of the graph. `inputs[i]` and `outputs[i]` address the op's `i`-th input and
    /// output; `workspace` is its scratch memory when its kind needs some.
    Kernel {
        /// The op.
        op: OpId,
        /// Where each input is read.
        inputs: Vec<TensorRef>,
        /// Where each output is written.
        outputs: Vec<TensorRef>,
        /// Scratch memory.
        workspace: Option<TensorRef>,
    },
    /// Copy bytes between spaces or within one.
    Copy {
        /// What is copied, for people and the verifier.
        what: CopyKind,
        /// Source.
        src: TensorRef,
        /// Destination.
        dst: TensorRef,
        /// Bytes.
        bytes: u64,
    },
    /// Mark this point of the stream.
    Record {
        /// The event.
        event: EventId,
    },
    /// Wait until another stream has passed the point that recorded the event.
    Wait {
        /// The event.
        event: EventId,
    },
    /// The end of the micro-batch program (gradient accumulation): what precedes it runs
    /// `micro_batches` times per step, what follows it once, after all of them. Every stream
    /// of an accumulating schedule has exactly one, with the same count; see the module doc.
    EndMicroBatch {
        /// Micro-batches per step (at least 2).
        micro_batches: u32,
    },
    /// Sum a value over the ranks of a data-parallel run, in place: every rank holds the same
    /// value (its gradient over its own rows) at the same address, and afterwards every rank
    /// holds the sum over all ranks. Runs on the [`StreamKind::Collective`] stream, whose
    /// ranks it sums over. The schedule is SPMD: every rank runs this same instruction list,
    /// so every rank issues the same collectives in the same order with the same sizes.
    AllReduce {
        /// The value summed (f32 or bf16); its type gives the bytes.
        value: ValueId,
        /// Where it is, on every rank.
        at: TensorRef,
    },
    /// Copy this rank's slice of a sharded chunk: `bytes` from `src + rank * bytes` to
    /// `dst + rank * bytes`, where `rank` is the rank running the schedule. A fetch uploads
    /// the rank's parameter shard into its slice of a chunk slot (an [`Instr::AllGather`]
    /// fills the rest); an offload moves the rank's slice of the reduce-scattered gradients
    /// to its host shard. The addresses are the whole layout's (see
    /// [`BufferKind::HostShard`]), so the instruction is the same on every rank.
    CopyShard {
        /// What is copied: [`CopyKind::FetchChunk`] or [`CopyKind::OffloadGrads`].
        what: CopyKind,
        /// Source of rank 0's slice.
        src: TensorRef,
        /// Destination of rank 0's slice.
        dst: TensorRef,
        /// Bytes of one slice (the chunk's bytes over the ranks).
        bytes: u64,
    },
    /// All-gather a chunk in place on the collective stream: before it, each rank `r` holds
    /// its slice `[at + r*bytes, at + (r+1)*bytes)`; after it, every rank holds every slice.
    AllGather {
        /// The chunk gathered.
        chunk: ChunkId,
        /// The start of the chunk's buffer (a chunk slot).
        at: TensorRef,
        /// Bytes of one slice.
        bytes: u64,
    },
    /// Reduce-scatter a chunk's gradients in place on the collective stream: every rank
    /// holds `ranks * bytes` bytes of gradients at `at`; afterwards rank `r`'s slice
    /// `[at + r*bytes, at + (r+1)*bytes)` holds the sum over the ranks, added in rank order
    /// (`((g0 + g1) + g2) + ...` in f32, rounded once to `dtype`), and the other slices are
    /// undefined.
    ReduceScatter {
        /// The chunk whose gradients are summed.
        chunk: ChunkId,
        /// The start of the chunk's device gradient buffer.
        at: TensorRef,
        /// Bytes of one slice.
        bytes: u64,
        /// The gradients' element type.
        dtype: DType,
    },
    /// Read a disk-resident chunk's optimizer state (its whole [`BufferKind::OptimizerState`]
    /// buffer in [`Space::Disk`]), or bytes of its parameter or gradient storage there, into
    /// a host staging buffer at the same offset, on the [`StreamKind::DiskIo`] stream.
    DiskRead {
        /// The chunk whose state is read.
        chunk: ChunkId,
        /// Its state on disk.
        src: TensorRef,
        /// The host staging buffer.
        dst: TensorRef,
        /// Bytes.
        bytes: u64,
    },
    /// Write a disk-resident chunk's updated optimizer state, or bytes of its parameter or
    /// gradient storage, from a host staging buffer back to the same offset of its place on
    /// disk, on the [`StreamKind::DiskIo`] stream.
    DiskWrite {
        /// The chunk whose state is written.
        chunk: ChunkId,
        /// The host staging buffer.
        src: TensorRef,
        /// Its state on disk.
        dst: TensorRef,
        /// Bytes.
        bytes: u64,
        /// Carried across the step boundary: the write runs at the start of the next step,
        /// writing what this step's update left in the staging buffer (see the module doc,
        /// "carried writes"). Carried writes come first in their disk stream.
        carried: bool,
    },
    /// Round a staged chunk's f32 master weights into its narrow parameter layout at `dst`
    /// (the start of a [`BufferKind::ParamStaging`] buffer), on the [`StreamKind::HostCast`]
    /// stream: member `k` of the chunk, of `n` elements, is read at `src + 4 * e` (`e` the
    /// elements of the members before it: the chunk's master weights are contiguous, in
    /// member order) and written at `dst + offset of k`; the bytes of `dst .. dst + bytes`
    /// between members are zeroed. [`Schedule::cast_pieces`] lists the pieces.
    CastChunk {
        /// The chunk.
        chunk: ChunkId,
        /// The master weight of the chunk's first member.
        src: TensorRef,
        /// The staging buffer.
        dst: TensorRef,
        /// Bytes written: the chunk's used bytes.
        bytes: u64,
    },
}

impl Instr {
    /// Every tensor address the instruction holds besides a kernel's inputs and outputs:
    /// a kernel's workspace, both ends of a copy, disk transfer or cast, a collective's
    /// address. (A cast's members are addressed inside its source and destination.)
    pub fn other_addresses(&self) -> Vec<TensorRef> {
        match self {
            Instr::Kernel { workspace, .. } => workspace.iter().copied().collect(),
            Instr::Copy { src, dst, .. }
            | Instr::CopyShard { src, dst, .. }
            | Instr::DiskRead { src, dst, .. }
            | Instr::DiskWrite { src, dst, .. }
            | Instr::CastChunk { src, dst, .. } => vec![*src, *dst],
            Instr::AllReduce { at, .. }
            | Instr::AllGather { at, .. }
            | Instr::ReduceScatter { at, .. } => vec![*at],
            Instr::Record { .. } | Instr::Wait { .. } | Instr::EndMicroBatch { .. } => Vec::new(),
        }
    }
}

/// One member of a [`Instr::CastChunk`]: `len` f32 master weights at `master` rounded into
/// `len` narrow elements of `dtype` at `narrow`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CastPiece {
    /// The parameter.
    pub value: ValueId,
    /// Its f32 master weight.
    pub master: TensorRef,
    /// Where its narrow copy goes.
    pub narrow: TensorRef,
    /// Elements.
    pub len: u64,
    /// The narrow type.
    pub dtype: DType,
}

/// Why a copy happens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CopyKind {
    /// A chunk's parameters from the host into a chunk slot.
    FetchChunk {
        /// The chunk.
        chunk: ChunkId,
    },
    /// A chunk's gradients from the device to the host.
    OffloadGrads {
        /// The chunk.
        chunk: ChunkId,
    },
    /// An activation to its host copy.
    OffloadActivation {
        /// The activation.
        value: ValueId,
    },
    /// An activation back from its host copy.
    ReloadActivation {
        /// The activation.
        value: ValueId,
    },
    /// A scalar the host optimizer needs (the clip coefficient).
    Scalar {
        /// The value.
        value: ValueId,
    },
}

/// What a stream is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamKind {
    /// Device kernels.
    Compute,
    /// Host-to-device copies.
    HostToDevice,
    /// Device-to-host copies.
    DeviceToHost,
    /// The CPU optimizer for offloaded chunks.
    HostOptimizer,
    /// Collectives among the ranks of a data-parallel run of `gpus` GPUs on each of `nodes`
    /// nodes (at least 2 ranks). A schedule has at most one such stream; a single-rank
    /// schedule has none.
    Collective {
        /// GPUs (ranks) per node.
        gpus: u32,
        /// Nodes.
        nodes: u32,
    },
    /// Disk reads and writes of disk-resident optimizer state ([`Instr::DiskRead`],
    /// [`Instr::DiskWrite`]); a schedule without a disk region has none. Its own stream, not
    /// the host optimizer's, so that the disk works while the CPU Adam does.
    DiskIo,
    /// CPU work that makes staged chunks' uploads ([`Instr::CastChunk`], the 12-byte
    /// layout); a schedule without staged chunks has none. Its own stream, so that casts
    /// overlap the uploads and the CPU Adam.
    HostCast,
}

/// An in-order instruction list.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stream {
    /// A readable name.
    pub name: String,
    /// What it is for.
    pub kind: StreamKind,
    /// Its instructions, in order.
    pub instrs: Vec<Instr>,
}

impl Stream {
    /// How many carried disk writes ([`Instr::DiskWrite`]'s `carried`) the stream has: the
    /// verifier checks that they are its first instructions.
    pub fn carried_writes(&self) -> usize {
        self.instrs
            .iter()
            .filter(|i| matches!(i, Instr::DiskWrite { carried: true, .. }))
            .count()
    }
}

/// Device memory by purpose, at the peak.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryBreakdown {
    /// Persistent chunks, their gradients and optimizer state.
    pub persistent: u64,
    /// Chunk slots and the gradient chunks of streamed chunks.
    pub chunk_buffers: u64,
    /// Activations and intermediates.
    pub activations: u64,
    /// Kernel workspaces.
    pub workspace: u64,
    /// Inputs.
    pub inputs: u64,
}

/// What the compiler predicts for one step.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Predicted step time in seconds.
    pub step_seconds: f64,
    /// Busy seconds of each stream, by [`StreamId`].
    pub stream_busy_seconds: Vec<f64>,
    /// Floating-point operations of one step.
    pub flops: u64,
    /// Device bytes the step needs: the arena.
    pub peak_device_bytes: u64,
    /// No placement of these buffers in this order needs fewer: the peak of live bytes.
    pub lower_bound_bytes: u64,
    /// Pinned host bytes.
    pub host_bytes: u64,
    /// Device bytes by purpose, at the peak of live bytes.
    pub memory: MemoryBreakdown,
}

/// What a schedule was compiled for, and what the compiler expects of it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Header {
    /// [`FORMAT_VERSION`] of the layout.
    pub format_version: u32,
    /// The model's name.
    pub model: String,
    /// Sequences per step.
    pub batch: u64,
    /// Tokens per sequence.
    pub seq: u64,
    /// Element type of parameters and activations.
    pub dtype: DType,
    /// Trainable parameters.
    pub param_count: u64,
    /// The hardware profile's one-line summary.
    pub hardware: String,
    /// Device bytes the schedule was allowed.
    pub device_budget_bytes: u64,
    /// Host bytes the schedule was allowed.
    pub host_budget_bytes: u64,
    /// Disk bytes the schedule was allowed (0: no disk tier).
    pub disk_budget_bytes: u64,
    /// The placement policy.
    pub policy: Policy,
    /// Predicted time and memory.
    pub prediction: Prediction,
    /// Why this policy: the search report, as text.
    pub report: String,
}

/// A compiled training step.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Schedule {
    /// What it is for and what to expect.
    pub header: Header,
    /// The placed training graph: forward, backward with recomputation, optimizer.
    pub graph: Graph,
    /// The parameter chunks.
    pub chunks: ChunkTable,
    /// Every buffer, by [`BufferId`].
    pub buffers: Vec<Buffer>,
    /// Every stream, by [`StreamId`].
    pub streams: Vec<Stream>,
    /// Events used, numbered `0..events`.
    pub events: u32,
    /// Bytes of the device arena.
    pub arena_bytes: u64,
    /// Bytes of the pinned host region.
    pub host_bytes: u64,
    /// Bytes of the disk region (0: nothing lives on disk).
    pub disk_bytes: u64,
    /// Where each value that lives across steps (parameters, optimizer state) and each step
    /// input is at the start of a step.
    pub homes: Vec<(ValueId, TensorRef)>,
    /// The f32 master weight of each parameter stored in a narrower type (mixed precision), in
    /// its chunk's optimizer-state buffer: what AdamW updates in f32 and rounds into the
    /// parameter. Empty in an f32 schedule.
    pub masters: Vec<(ValueId, TensorRef)>,
    /// Where the loss is after the step.
    pub loss: TensorRef,
    /// With chunk-major accumulation ([`MicroBatchOrder::ChunkMajor`](crate::MicroBatchOrder)),
    /// where each micro-batch's loss is after the step, in micro-batch order: one program runs
    /// every micro-batch, and the graph's step inputs are the model's inputs once per
    /// micro-batch, micro-batch after micro-batch (micro-batch `m`'s `i`-th input is the
    /// graph's input `m * n + i` of `n` per micro-batch). Empty otherwise.
    #[serde(default)]
    pub micro_batch_losses: Vec<TensorRef>,
}

impl Schedule {
    /// A buffer.
    pub fn buffer(&self, id: BufferId) -> &Buffer {
        &self.buffers[id.index()]
    }

    /// A stream.
    pub fn stream(&self, id: StreamId) -> &Stream {
        &self.streams[id.index()]
    }

    /// Times a step runs the micro-batch program: the count of the streams' [`Instr::EndMicroBatch`]
    /// markers, 1 without them. (The verifier checks that every stream agrees.)
    pub fn micro_batches(&self) -> u32 {
        self.streams
            .iter()
            .flat_map(|s| s.instrs.iter().rev())
            .find_map(|i| match i {
                Instr::EndMicroBatch { micro_batches } => Some(*micro_batches),
                _ => None,
            })
            .unwrap_or(1)
    }

    /// Micro-batches per optimizer step, in either order: [`Schedule::micro_batches`] for
    /// sequential accumulation, the count of [`Schedule::micro_batch_losses`] for chunk-major
    /// accumulation, 1 without accumulation. A step reads this many times the schedule's batch.
    pub fn micro_batches_per_step(&self) -> u32 {
        let interleaved = u32::try_from(self.micro_batch_losses.len()).unwrap_or(u32::MAX);
        self.micro_batches().max(interleaved)
    }

    /// Whether the step's micro-batches run interleaved in one program (chunk-major
    /// accumulation).
    pub fn is_chunk_major(&self) -> bool {
        self.micro_batch_losses.len() > 1
    }

    /// Each stream's instructions split at its [`Instr::EndMicroBatch`]: the micro-batch
    /// program and the update program (all of a stream's instructions and none without the
    /// marker).
    pub fn phases(&self) -> Vec<(&[Instr], &[Instr])> {
        self.streams
            .iter()
            .map(|s| {
                match s
                    .instrs
                    .iter()
                    .position(|i| matches!(i, Instr::EndMicroBatch { .. }))
                {
                    Some(at) => (&s.instrs[..at], &s.instrs[at + 1..]),
                    None => (&s.instrs[..], &[][..]),
                }
            })
            .collect()
    }

    /// The ranks the schedule runs on, as `(gpus per node, nodes)`: its
    /// [`StreamKind::Collective`] stream's, `(1, 1)` without one.
    pub fn topology(&self) -> (u32, u32) {
        self.streams
            .iter()
            .find_map(|s| match s.kind {
                StreamKind::Collective { gpus, nodes } => Some((gpus, nodes)),
                _ => None,
            })
            .unwrap_or((1, 1))
    }

    /// The number of ranks every one of which runs this schedule (1 for a single GPU).
    pub fn ranks(&self) -> u32 {
        let (gpus, nodes) = self.topology();
        gpus * nodes
    }

    /// The absolute byte address of a tensor in its space. For a tensor in a sharded buffer
    /// ([`BufferKind::is_sharded`]) it is the address in the *whole view*: the addresses
    /// from the end of its space (`host_bytes`, or `disk_bytes` for a shard on disk) on,
    /// where each sharded buffer at offset `o` spans `[end + ranks*o, end + ranks*(o +
    /// size))` as if one rank held every shard. The verifier checks data flow in that view (every rank does the same, so the
    /// union of their shards behaves as one buffer); a rank reads and writes its own slice
    /// ([`Schedule::rank_slice`]).
    pub fn address(&self, t: TensorRef) -> (Space, u64) {
        let b = self.buffer(t.buffer);
        let end = match b.space {
            Space::Device => self.arena_bytes,
            Space::Host => self.host_bytes,
            Space::Disk => self.disk_bytes,
        };
        match b.kind.is_sharded() {
            true => (b.space, end + u64::from(self.ranks()) * b.offset + t.offset),
            false => (b.space, b.offset + t.offset),
        }
    }

    /// Bytes a tensor address may reach in its buffer: its size, or for a
    /// [`BufferKind::HostShard`] the whole layout's `ranks * size`.
    pub fn extent(&self, b: BufferId) -> u64 {
        let buffer = self.buffer(b);
        match buffer.kind.is_sharded() {
            true => u64::from(self.ranks()) * buffer.size,
            false => buffer.size,
        }
    }

    /// What rank `rank` holds of the `bytes` bytes at `t`: `(space, address, skip, len)`,
    /// the `len` bytes starting `skip` bytes into the tensor, at `address` in `space`. For a
    /// tensor in a [`BufferKind::HostShard`] that is its overlap with the rank's slice
    /// (`None` when they do not overlap); for any other, all of it at
    /// [`Schedule::address`].
    pub fn rank_slice(
        &self,
        t: TensorRef,
        bytes: u64,
        rank: u32,
    ) -> Option<(Space, u64, u64, u64)> {
        let b = self.buffer(t.buffer);
        match b.kind.is_sharded() {
            true => {
                let (lo, hi) = (u64::from(rank) * b.size, u64::from(rank + 1) * b.size);
                let (a, z) = (t.offset.max(lo), (t.offset + bytes).min(hi));
                (a < z).then(|| (b.space, b.offset + a - lo, a - t.offset, z - a))
            }
            false => Some((b.space, b.offset + t.offset, 0, bytes)),
        }
    }

    /// The chunks whose optimizer state lives on disk (whole, or each rank's shard of it),
    /// in buffer order.
    pub fn disk_chunks(&self) -> Vec<ChunkId> {
        self.buffers
            .iter()
            .filter_map(|b| match (b.space, b.kind) {
                (Space::Disk, BufferKind::OptimizerState { chunk })
                | (
                    Space::Disk,
                    BufferKind::HostShard {
                        chunk,
                        part: ShardPart::AdamM,
                    },
                ) => Some(chunk),
                _ => None,
            })
            .collect()
    }

    /// Where the disk tier stages the master weights of the chunk whose Adam moments an
    /// update reads in the sharded staging buffer `m` ([`BufferKind::ShardStaging`] of
    /// [`ShardPart::AdamM`]): the [`ShardPart::Master`] staging buffer of the same slot.
    /// `None` where `m` is no such buffer or the schedule has no such master buffer (an f32
    /// schedule has no master weights).
    pub fn shard_master_staging(&self, m: BufferId) -> Option<BufferId> {
        let BufferKind::ShardStaging {
            slot,
            part: ShardPart::AdamM,
        } = self.buffers.get(m.index())?.kind
        else {
            return None;
        };
        self.buffers
            .iter()
            .position(|b| {
                b.kind
                    == BufferKind::ShardStaging {
                        slot,
                        part: ShardPart::Master,
                    }
            })
            .map(BufferId::new)
    }

    /// The chunks whose parameter storage ([`BufferKind::HostChunk`], or on sharded ranks
    /// each rank's [`ShardPart::Params`] shard) lives on disk, in buffer order, and whether
    /// any chunk's separate gradient storage ([`BufferKind::HostGradChunk`], or its
    /// [`ShardPart::Grads`] shards) does too.
    pub fn disk_storage_chunks(&self) -> (Vec<ChunkId>, bool) {
        let params = self
            .buffers
            .iter()
            .filter_map(|b| match (b.space, b.kind) {
                (Space::Disk, BufferKind::HostChunk { chunk })
                | (
                    Space::Disk,
                    BufferKind::HostShard {
                        chunk,
                        part: ShardPart::Params,
                    },
                ) => Some(chunk),
                _ => None,
            })
            .collect();
        let grads = self.buffers.iter().any(|b| {
            b.space == Space::Disk
                && matches!(
                    b.kind,
                    BufferKind::HostGradChunk { .. }
                        | BufferKind::HostShard {
                            part: ShardPart::Grads,
                            ..
                        }
                )
        });
        (params, grads)
    }

    /// What the disk region holds, in words: `the optimizer state of N of M chunks`, and
    /// where their storage moved too, `and the parameters (and gradients) of K`.
    pub fn disk_holds(&self) -> String {
        let mut out = format!(
            "the optimizer state of {} of {} chunks",
            self.disk_chunks().len(),
            self.chunks.len()
        );
        let (params, grads) = self.disk_storage_chunks();
        if !params.is_empty() {
            let what = match grads {
                true => "parameters and gradients",
                false => "parameters",
            };
            out.push_str(&format!(" and the {what} of {}", params.len()));
        }
        out
    }

    /// The carried disk writes of every stream (see the module doc): how many write-backs a
    /// step leaves to the start of the next.
    pub fn carried_writes(&self) -> usize {
        self.streams.iter().map(Stream::carried_writes).sum()
    }

    /// The pieces of a [`Instr::CastChunk`] of `chunk` from `src` to `dst`: one per member of
    /// the chunk, in member order (see the instruction's doc). `None` when the chunk is out of
    /// range or a member is not a narrow parameter (an unverified schedule).
    pub fn cast_pieces(
        &self,
        chunk: ChunkId,
        src: TensorRef,
        dst: TensorRef,
    ) -> Option<Vec<CastPiece>> {
        if chunk.index() >= self.chunks.len() {
            return None;
        }
        let mut out = Vec::new();
        let mut elem = 0u64;
        for m in &self.chunks.chunk(chunk).members {
            if m.param.index() >= self.graph.params().len() {
                return None;
            }
            let value = self.graph.param(m.param).value;
            let ty = &self.graph.value(value).ty;
            if !matches!(ty.dtype, DType::BF16 | DType::F16) {
                return None;
            }
            let len = ty.numel();
            out.push(CastPiece {
                value,
                master: TensorRef {
                    buffer: src.buffer,
                    offset: src.offset + 4 * elem,
                },
                narrow: TensorRef {
                    buffer: dst.buffer,
                    offset: dst.offset + m.offset,
                },
                len,
                dtype: ty.dtype,
            });
            elem += len;
        }
        Some(out)
    }

    /// The chunks a [`Instr::CastChunk`] makes uploads of (the 12-byte layout), in order.
    pub fn staged_chunks(&self) -> Vec<ChunkId> {
        let mut out: Vec<ChunkId> = self
            .streams
            .iter()
            .flat_map(|s| &s.instrs)
            .filter_map(|i| match i {
                Instr::CastChunk { chunk, .. } => Some(*chunk),
                _ => None,
            })
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Whether any buffer holds a shard of a sharded chunk.
    pub fn sharded(&self) -> bool {
        self.buffers
            .iter()
            .any(|b| matches!(b.kind, BufferKind::HostShard { .. }))
    }
}
