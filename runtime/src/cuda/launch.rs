//! Op kinds on the CUDA backend as call plans: for one op, its operand types and addresses,
//! the list of kernel launches (of [`super::SOURCES`]) and cuBLAS GEMMs that compute it, as
//! plain data. [`calls`] issues nothing and needs no GPU; the backend executes the list in
//! order on the op's stream (`backend.rs`), and the tests below check, for every op kind, that
//! each entry point exists in the kernel sources and that each argument list matches the
//! kernel's declared parameters.
//!
//! Every kind has its own arm, without a wildcard, so a kind added to the IR is a compile error
//! here until it has kernels. The launch shapes follow the notes beside each entry point in
//! `kernels/*.cu`. Storage is f32, bf16 or f16 (the `_f32` / `_bf16` / `_f16` entry points,
//! chosen by [`Storage::pick`]); statistics, log-sum-exps and partial sums are f32 whatever the
//! storage.
//!
//! Scratch. Every kernel's scratch is the workspace the memory plan gives its op, split as
//! [`WorkspaceLayout`] says (norm statistics, column-sum partials, attention's `delta` and,
//! on the GEMM path, its score matrices, one batch of KV heads at a time; bf16 and f16
//! attention with heads of 64, 128 or 256 runs as flash attention and has no scores,
//! cross-entropy's per-row losses, the token embedding backward's spans, the gradient norm's
//! f64 partials, a fused linear's intermediate gradients), every part 16-byte aligned. Nothing
//! is allocated per launch, so the planned peak is the device's. The only other device memory a
//! plan refers to is a small constant table per stream ([`Arg::Table`]: RoPE frequencies, the
//! clip coefficient's pointer table, a merged AdamW's tensor table), which the backend uploads
//! on first use and reuses every step (the addresses in it are the plan's, fixed), and the
//! backend's gradient-norm slot ([`Arg::NormSlot`]).
//!
//! AdamW. One op is one `adamw_*` launch ([`calls`]); a run of adjacent AdamW ops
//! ([`super::runs`]) is one `adamw_multi_*` launch ([`adamw_multi`]) that updates each element
//! with the same operations.

use protrain_ir::{
    DType, Epilogue, OpKind, QkvLayout, Scratch, TensorType, WeightLayout, WorkspaceLayout,
};

use cudarc::cublas::sys::cublasOperation_t as CuOp;
use protrain_ir::workspace::{
    attention_head_batch, attention_runs_flash, FLASH_ATTENTION_HEAD_DIMS,
    FLASH_MIN_COMPUTE_CAPABILITY,
};

use super::blas::{
    backward_calls, forward_call, forward_matmul, gelu_fusable, Batched, Call as Gemm, Fused,
    LinearDims, Matmul,
};
use super::driver::ParamKind;
use super::{
    column_sum_chunks, grad_norm_partials, AdamWScalars, ATTN_FLASH_ROWS, ATTN_FLASH_THREADS,
    COLUMN_SUM_BLOCK, COLUMN_SUM_ROWS_PER_CHUNK,
};
use crate::dispatch::Pitches;
use crate::error::{Result, RuntimeError};
use crate::kernels::{self, AdamWConfig};

use Arg::{Ptr, F32, I32, I64};

/// Threads per block of the grid-stride and row kernels.
pub(super) const BLOCK: u32 = 256;

/// Most blocks along a grid's y or z, and along x for the row kernels.
const MAX_GRID_YZ: u64 = 65535;

/// A kernel argument, as the kernel's parameter list declares it.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Arg {
    /// A pointer (device address, or 0 for null).
    Ptr(u64),
    /// `i64`.
    I64(i64),
    /// `int`.
    I32(i32),
    /// `float`.
    F32(f32),
    /// A pointer to the device copy of a constant table, which the executing stream uploads
    /// on first use and keeps.
    Table(ConstKey),
    /// A pointer to the backend's gradient-norm slot (one f32), which the clip coefficient
    /// kernel writes and `step_outcome` reads.
    NormSlot,
}

impl Arg {
    /// The parameter kind it passes.
    pub(super) fn kind(&self) -> ParamKind {
        match self {
            Arg::Ptr(_) | Arg::Table(_) | Arg::NormSlot => ParamKind::Ptr,
            Arg::I64(_) => ParamKind::I64,
            Arg::I32(_) => ParamKind::I32,
            Arg::F32(_) => ParamKind::F32,
        }
    }
}

/// A constant table a kernel reads, named by what it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum ConstKey {
    /// RoPE inverse frequencies, as f32 bits.
    InvFreq(Vec<u32>),
    /// Device addresses (the clip coefficient's squared norms).
    Pointers(Vec<u64>),
    /// A merged AdamW's tensors, [`ADAMW_TABLE_WORDS`] words each (see [`adamw_multi`]).
    AdamWTensors(Vec<u64>),
}

impl ConstKey {
    /// The table's bytes, as the kernel reads them.
    pub(super) fn bytes(&self) -> Vec<u8> {
        match self {
            ConstKey::InvFreq(bits) => bits.iter().flat_map(|b| b.to_ne_bytes()).collect(),
            ConstKey::Pointers(words) | ConstKey::AdamWTensors(words) => {
                words.iter().flat_map(|w| w.to_ne_bytes()).collect()
            }
        }
    }
}

/// One kernel launch.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct KernelCall {
    /// The entry point, an `extern "C" __global__` function of [`super::SOURCES`].
    pub entry: &'static str,
    /// Grid dimensions (none zero: empty launches are left out of a plan).
    pub grid: (u32, u32, u32),
    /// Block dimensions.
    pub block: (u32, u32, u32),
    /// The arguments, in the kernel's parameter order.
    pub args: Vec<Arg>,
}

/// One GEMM on the stream's cuBLAS handle.
#[derive(Clone, Copy, Debug)]
pub(super) struct GemmCall {
    /// The storage type of every matrix (f32, bf16 or f16; compute is f32).
    pub dtype: DType,
    /// The column-major description ([`super::blas`]).
    pub gemm: Gemm,
    /// What it computes, for errors.
    pub what: &'static str,
}

/// One strided-batched GEMM on the stream's cuBLAS handle (attention's products).
#[derive(Clone, Copy, Debug)]
pub(super) struct BatchedCall {
    /// The storage type of A and B (compute is f32).
    pub ab: DType,
    /// The storage type of C.
    pub c: DType,
    /// The description ([`super::blas::Batched`]).
    pub gemm: Batched,
    /// What it computes, for errors.
    pub what: &'static str,
}

/// One cuBLASLt matmul with its epilogue on the stream's cuBLASLt handle (a linear layer's
/// product with its bias, GELU or residual).
#[derive(Clone, Copy, Debug)]
pub(super) struct MatmulCall {
    /// The storage type of every matrix and the bias (compute is f32).
    pub dtype: DType,
    /// The description ([`super::blas::Matmul`]).
    pub mm: Matmul,
    /// What it computes, for errors.
    pub what: &'static str,
}

/// One step of an op's plan.
#[derive(Clone, Debug)]
pub(super) enum Call {
    /// A kernel of the NVRTC-compiled sources.
    Kernel(KernelCall),
    /// A cuBLAS GEMM.
    Gemm(GemmCall),
    /// A cuBLASLt matmul with an epilogue.
    Matmul(MatmulCall),
    /// A cuBLAS strided-batched GEMM.
    Batched(BatchedCall),
}

/// An op's operand types.
#[derive(Clone, Copy, Debug)]
pub(super) struct Types<'a> {
    /// Input types, in the op's order.
    pub inputs: &'a [&'a TensorType],
    /// Output types, in the op's order.
    pub outputs: &'a [&'a TensorType],
}

/// Where an op's operands lie, as the GPU addresses them (pinned host memory is mapped).
#[derive(Clone, Debug, Default)]
pub(super) struct Addresses {
    /// Each input's address, checked by the caller to hold its type's bytes.
    pub inputs: Vec<u64>,
    /// Each output's address, likewise.
    pub outputs: Vec<u64>,
    /// The planned workspace's address and size in bytes.
    pub workspace: Option<(u64, u64)>,
    /// A bf16 or f16 AdamW's f32 master weight of its parameter.
    pub master: Option<u64>,
    /// Row pitches of operands stored in padded rows.
    pub pitches: Pitches,
}

/// What a plan depends on besides the op: the device's grid limit and the step.
#[derive(Clone, Copy, Debug)]
pub(super) struct Target {
    /// Most blocks of a grid-stride launch (enough to fill the GPU several times over).
    pub max_blocks: u32,
    /// The 1-based step number (AdamW's bias correction).
    pub step: u64,
    /// Whether the GPU runs the flash attention kernels (compute capability 8.0 and newer,
    /// [`protrain_ir::workspace::flash_attention_supported`]); without them attention runs
    /// as GEMMs, which needs the score workspace.
    pub flash: bool,
}

/// The storage type of a kernel's floating-point operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Storage {
    F32,
    Bf16,
    F16,
}

/// An entry point's three storage variants, `[base_f32, base_bf16, base_f16]`, for
/// [`Storage::pick`].
macro_rules! entry {
    ($base:literal) => {
        [
            concat!($base, "_f32"),
            concat!($base, "_bf16"),
            concat!($base, "_f16"),
        ]
    };
}

/// An entry point's variants by storage type, as [`entry!`] lists them.
type Entries = [&'static str; 3];

impl Storage {
    /// The entry point for this storage type.
    fn pick(self, [f32_name, bf16_name, f16_name]: Entries) -> &'static str {
        match self {
            Storage::F32 => f32_name,
            Storage::Bf16 => bf16_name,
            Storage::F16 => f16_name,
        }
    }

    /// The dtype it stores.
    fn dtype(self) -> DType {
        match self {
            Storage::F32 => DType::F32,
            Storage::Bf16 => DType::BF16,
            Storage::F16 => DType::F16,
        }
    }

    /// Bytes per element.
    fn size(self) -> u64 {
        match self {
            Storage::F32 => 4,
            Storage::Bf16 | Storage::F16 => 2,
        }
    }

    /// Elements in one 16-byte vector access (common.cuh's `VecWidth`).
    fn vector_width(self) -> u64 {
        16 / self.size()
    }
}

fn storage_of(dtype: DType) -> Option<Storage> {
    match dtype {
        DType::F32 => Some(Storage::F32),
        DType::BF16 => Some(Storage::Bf16),
        DType::F16 => Some(Storage::F16),
        DType::I32 => None,
    }
}

/// The plan of one op under construction.
struct Plan<'a> {
    kind: &'a OpKind,
    types: Types<'a>,
    at: &'a Addresses,
    target: Target,
    layout: WorkspaceLayout,
    calls: Vec<Call>,
}

impl Plan<'_> {
    fn bad(&self, why: impl std::fmt::Display) -> RuntimeError {
        RuntimeError::BadSchedule(format!("{}: {why}", self.kind.mnemonic()))
    }

    fn ty_in(&self, i: usize) -> &TensorType {
        self.types.inputs[i]
    }

    fn ty_out(&self, i: usize) -> &TensorType {
        self.types.outputs[i]
    }

    /// Input `i`'s device address.
    fn input(&self, i: usize) -> u64 {
        self.at.inputs[i]
    }

    /// Output `i`'s device address.
    fn output(&self, i: usize) -> u64 {
        self.at.outputs[i]
    }

    /// The address of `part` of the planned workspace, which must hold the whole layout.
    fn workspace(&self, part: Scratch) -> Result<u64> {
        let need = self.layout.bytes();
        let region = self.layout.get(part).ok_or_else(|| {
            self.bad(format!(
                "its workspace layout has no {part:?}; this is a bug in runtime/src/cuda/launch.rs"
            ))
        })?;
        let have = self.at.workspace.map_or(0, |(_, bytes)| bytes);
        match self.at.workspace {
            Some((at, have)) if have >= need => Ok(at + region.offset),
            // A GPU without the flash attention kernels, and a workspace planned for them.
            _ if !self.target.flash
                && WorkspaceLayout::of(self.kind, self.types.inputs).bytes() <= have =>
            {
                Err(self.bad(format!(
                    "this GPU is older than compute capability {}.{}, so attention runs as \
                     GEMMs instead of the flash attention kernels (their bf16 and f16 tensor \
                     core products need sm_80), and those need {need} bytes of workspace for \
                     the scores where the schedule planned {have} for flash attention; compile \
                     the schedule for this GPU (--hardware with a profile that states its \
                     compute capability, as `protrain profile --backend cuda` writes), train \
                     with --dtype f32, or use a GPU of compute capability 8.0 or newer",
                    FLASH_MIN_COMPUTE_CAPABILITY.0, FLASH_MIN_COMPUTE_CAPABILITY.1
                )))
            }
            Some(_) => Err(self.bad(format!(
                "the planned workspace of {have} bytes is smaller than the {need} the kernels \
                 need; recompile the schedule"
            ))),
            None => Err(self.bad(format!(
                "no workspace was planned but the kernels need {need} bytes; recompile the \
                 schedule"
            ))),
        }
    }

    /// The storage type of input `i`.
    fn storage(&self, i: usize) -> Result<Storage> {
        storage_of(self.ty_in(i).dtype).ok_or_else(|| {
            self.bad(format!(
                "input {i} is {}; the CUDA kernels store f32, bf16 or f16: compile with dtype \
                 f32, bf16 or f16",
                self.ty_in(i)
            ))
        })
    }

    /// Blocks of a grid-stride launch over `n` elements with [`BLOCK`] threads.
    fn grid_for(&self, n: u64) -> u32 {
        n.div_ceil(u64::from(BLOCK))
            .clamp(1, u64::from(self.target.max_blocks)) as u32
    }

    /// `name` with an explicit shape; left out when the grid is empty.
    fn shaped(
        &mut self,
        entry: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: Vec<Arg>,
    ) {
        if grid.0 != 0 && grid.1 != 0 && grid.2 != 0 {
            self.calls.push(Call::Kernel(KernelCall {
                entry,
                grid,
                block,
                args,
            }));
        }
    }

    /// `name` with a 1-D grid-stride shape over `n` elements.
    fn stride(&mut self, entry: &'static str, n: u64, args: Vec<Arg>) {
        if n > 0 {
            let grid = (self.grid_for(n), 1, 1);
            self.shaped(entry, grid, (BLOCK, 1, 1), args);
        }
    }

    /// A row kernel (one block per row, blocks striding over `rows`).
    fn rows(&mut self, entry: &'static str, rows: u64, args: Vec<Arg>) {
        let grid = (rows.min(MAX_GRID_YZ) as u32, 1, 1);
        self.shaped(entry, grid, (BLOCK, 1, 1), args);
    }

    /// `v` as a kernel's `int`.
    fn int(&self, v: u64, what: &str) -> Result<i32> {
        i32::try_from(v).map_err(|_| {
            self.bad(format!(
                "{what} = {v} is beyond the kernels' 32-bit sizes; use a smaller batch or \
                 sequence"
            ))
        })
    }

    /// `v` as a grid dimension along y or z.
    fn grid_yz(&self, v: u64, what: &str) -> Result<u32> {
        if v > MAX_GRID_YZ {
            return Err(self.bad(format!(
                "{what} = {v} exceeds CUDA's {MAX_GRID_YZ} blocks along a grid's y or z"
            )));
        }
        Ok(v as u32)
    }

    /// A strided-batched GEMM, A and B in `st`, C in `c`.
    fn batched(&mut self, st: Storage, c: DType, gemm: Batched, what: &'static str) {
        self.calls.push(Call::Batched(BatchedCall {
            ab: st.dtype(),
            c,
            gemm,
            what,
        }));
    }

    /// `y = x W^T` or `x W` on cuBLAS.
    fn linear_forward(
        &mut self,
        dtype: DType,
        layout: WeightLayout,
        d: LinearDims,
        x: u64,
        w: u64,
        y: u64,
    ) {
        self.calls.push(Call::Gemm(GemmCall {
            dtype,
            gemm: forward_call(layout, d, x, w, y),
            what: "linear forward",
        }));
    }

    /// `y = x W^T` or `x W`, plus the bias and what `fused` adds, as one cuBLASLt matmul.
    #[allow(clippy::too_many_arguments)]
    fn linear_matmul(
        &mut self,
        dtype: DType,
        layout: WeightLayout,
        d: LinearDims,
        (x, w, y): (u64, u64, u64),
        bias: Option<u64>,
        fused: Fused,
    ) {
        self.calls.push(Call::Matmul(MatmulCall {
            dtype,
            mm: forward_matmul(layout, d, (x, w, y), bias, fused),
            what: "linear forward with its epilogue",
        }));
    }

    /// Sets the leading dimension of every operand at `addr` in the GEMM calls planned for
    /// this op to `pitch`: a padded operand ([`protrain_ir::RowPitch`]), whose rows (the
    /// columns of its column-major view) are `pitch` elements apart.
    fn pitch_last_calls(&mut self, addr: u64, pitch: usize) {
        for call in &mut self.calls {
            let gemm = match call {
                Call::Gemm(g) => &mut g.gemm,
                Call::Matmul(m) => &mut m.mm.gemm,
                _ => continue,
            };
            if gemm.a == addr {
                gemm.lda = pitch;
            }
            if gemm.b == addr {
                gemm.ldb = pitch;
            }
            if gemm.c == addr {
                gemm.ldc = pitch;
            }
        }
    }

    /// `dx` and `dW` on cuBLAS.
    #[allow(clippy::too_many_arguments)]
    fn linear_backward(
        &mut self,
        dtype: DType,
        layout: WeightLayout,
        d: LinearDims,
        x: u64,
        w: u64,
        dy: u64,
        dx: u64,
        dw: u64,
    ) {
        let [dx_call, dw_call] = backward_calls(layout, d, x, w, dy, dx, dw);
        self.calls.push(Call::Gemm(GemmCall {
            dtype,
            gemm: dx_call,
            what: "linear backward (input gradient)",
        }));
        self.calls.push(Call::Gemm(GemmCall {
            dtype,
            gemm: dw_call,
            what: "linear backward (weight gradient)",
        }));
    }

    /// Column sums of `x [rows, cols]` into `dst [cols]` (overwritten): the bias gradient,
    /// through `partials` (`column_sum_chunks(rows) * cols` f32 of the planned workspace).
    fn column_sum(
        &mut self,
        st: Storage,
        dst: u64,
        x: u64,
        rows: u64,
        cols: u64,
        partials: u64,
    ) -> Result<()> {
        let chunks = column_sum_chunks(rows as usize) as u64;
        let (rows_i, cols_i) = (self.int(rows, "rows")?, self.int(cols, "columns")?);
        let per_chunk = COLUMN_SUM_ROWS_PER_CHUNK as i32;
        let grid = (
            cols.div_ceil(u64::from(COLUMN_SUM_BLOCK.0)) as u32,
            self.grid_yz(chunks, "row chunks")?,
            1,
        );
        let block = (COLUMN_SUM_BLOCK.0, COLUMN_SUM_BLOCK.1, 1);
        self.shaped(
            st.pick(entry!("column_sum_partial")),
            grid,
            block,
            vec![
                Ptr(partials),
                Ptr(x),
                I32(rows_i),
                I32(cols_i),
                I32(per_chunk),
            ],
        );
        self.stride(
            st.pick(entry!("column_sum_finish")),
            cols,
            vec![
                Ptr(dst),
                Ptr(partials),
                I32(chunks as i32),
                I32(cols_i),
                I32(0),
            ],
        );
        Ok(())
    }
}

/// Attention's dimensions from its output type `[B, T, H*D]`, and the kernels' strides.
struct AttnDims {
    b: i32,
    t: i32,
    h: i32,
    kv: i32,
    d: i32,
    window: i32,
    q_stride: i32,
    kv_stride: i32,
    /// Byte offsets of k and v from q (packed), or `None` (separate tensors).
    packed: Option<(u64, u64)>,
    /// The score scale (`D^-0.5` unless the op says otherwise).
    scale: f32,
    /// The scores' soft-cap; 0 for none.
    softcap: f32,
}

impl AttnDims {
    #[allow(clippy::too_many_arguments)]
    fn new(
        p: &Plan<'_>,
        out: &TensorType,
        heads: u64,
        kv_heads: u64,
        head_dim: u64,
        window: Option<u64>,
        qkv: QkvLayout,
        st: Storage,
    ) -> Result<Self> {
        if head_dim == 0 {
            return Err(p.bad("heads of 0 dimensions"));
        }
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) || out.shape.len() != 3 {
            return Err(p.bad(format!(
                "{heads} heads over {kv_heads} KV heads with output {out}"
            )));
        }
        let (q_stride, kv_stride, packed) = match qkv {
            QkvLayout::Separate => (heads * head_dim, kv_heads * head_dim, None),
            QkvLayout::Packed => {
                let w = (heads + 2 * kv_heads) * head_dim;
                let e = st.size();
                (
                    w,
                    w,
                    Some((heads * head_dim * e, (heads + kv_heads) * head_dim * e)),
                )
            }
        };
        Ok(Self {
            b: p.int(out.shape[0], "batch")?,
            t: p.int(out.shape[1], "sequence")?,
            h: p.int(heads, "heads")?,
            kv: p.int(kv_heads, "KV heads")?,
            d: head_dim as i32,
            // A window wider than i32 sees every earlier key, as no window does.
            window: window.map_or(0, |w| w.min(i32::MAX as u64) as i32),
            q_stride: p.int(q_stride, "q row width")?,
            kv_stride: p.int(kv_stride, "kv row width")?,
            packed,
            scale: 1.0 / (head_dim as f32).sqrt(),
            softcap: 0.0,
        })
    }

    /// These dimensions with the op's score scale and soft-cap.
    fn scored(self, scale: Option<f64>, softcap: Option<f64>) -> Self {
        Self {
            scale: scale.map_or(self.scale, |s| s as f32),
            softcap: softcap.map_or(0.0, |c| c as f32),
            ..self
        }
    }

    /// The GEMM batches, in issue order: for each batch element, each batch of up to
    /// [`attention_head_batch`] KV heads, each query head of their groups (`j`-th of each).
    fn head_batches(&self) -> Vec<HeadBatch> {
        let (kv, t) = (self.kv as u64, self.t as u64);
        let per = attention_head_batch(kv, t);
        let group = (self.h / self.kv) as u64;
        let mut out = Vec::new();
        for b in 0..self.b as u64 {
            for kv0 in (0..kv).step_by(per as usize) {
                for j in 0..group {
                    out.push(HeadBatch {
                        b,
                        kv0,
                        heads: per.min(kv - kv0),
                        j,
                    });
                }
            }
        }
        out
    }
}

/// The flash attention kernels of `attention.cu` by storage (bf16, f16) and head dimension
/// ([`FLASH_ATTENTION_HEAD_DIMS`], in order).
type FlashEntries = [[&'static str; 3]; 2];

macro_rules! flash_entries {
    ($kernel:literal) => {
        [
            [
                concat!("flash_attention_", $kernel, "_bf16_d64"),
                concat!("flash_attention_", $kernel, "_bf16_d128"),
                concat!("flash_attention_", $kernel, "_bf16_d256"),
            ],
            [
                concat!("flash_attention_", $kernel, "_f16_d64"),
                concat!("flash_attention_", $kernel, "_f16_d128"),
                concat!("flash_attention_", $kernel, "_f16_d256"),
            ],
        ]
    };
}
const FLASH_FORWARD: FlashEntries = flash_entries!("forward");
const FLASH_BACKWARD_DQ: FlashEntries = flash_entries!("backward_dq");
const FLASH_BACKWARD_DKV: FlashEntries = flash_entries!("backward_dkv");

/// The flash attention kernel of `entries` for attention in `st` with heads of `head_dim`, when
/// the attention runs as flash attention ([`attention_runs_flash`], the rule the workspace
/// layout follows: such an op has no score workspace); `None` for the GEMM path.
fn flash_entry(
    p: &Plan<'_>,
    st: Storage,
    head_dim: u64,
    entries: FlashEntries,
) -> Option<&'static str> {
    if !p.target.flash || !attention_runs_flash(st.dtype(), head_dim) {
        return None;
    }
    let row = match st {
        Storage::Bf16 => 0,
        Storage::F16 => 1,
        Storage::F32 => return None,
    };
    let col = FLASH_ATTENTION_HEAD_DIMS
        .iter()
        .position(|&d| d == head_dim)?;
    Some(entries[row][col])
}

impl AttnDims {
    /// A flash attention grid: `ceil(T / ATTN_FLASH_ROWS)` row tiles by `heads` by B.
    fn flash_grid(&self, p: &Plan<'_>, heads: i32) -> Result<(u32, u32, u32)> {
        let tiles = (self.t as u64).div_ceil(ATTN_FLASH_ROWS as u64);
        let tiles = u32::try_from(tiles).map_err(|_| p.bad("sequence beyond 32 bits"))?;
        Ok((
            tiles,
            p.grid_yz(heads as u64, "attention heads")?,
            p.grid_yz(self.b as u64, "batch")?,
        ))
    }

    /// The flash kernels' arguments after their pointers: T, H, KV, window, the strides, the
    /// scale and the soft-cap.
    fn flash_args(&self) -> [Arg; 8] {
        [
            I32(self.t),
            I32(self.h),
            I32(self.kv),
            I32(self.window),
            I32(self.q_stride),
            I32(self.kv_stride),
            F32(self.scale),
            F32(self.softcap),
        ]
    }
}

/// One strided-batched step of attention: batch element `b`, KV heads `kv0..kv0 + heads`,
/// and of each one's group of query heads the `j`-th (query head `kv * group + j`).
#[derive(Clone, Copy, Debug)]
struct HeadBatch {
    b: u64,
    kv0: u64,
    heads: u64,
    j: u64,
}

/// The GEMM descriptions of one [`HeadBatch`] (see `kernels/attention.cu`'s notes on the
/// GEMM path). Row-major `[rows, cols]` matrices are read by cuBLAS as their column-major
/// transposes (as in `blas.rs`), so each product `X = A B` is issued as `X^T = B^T A^T`.
/// Element strides: a KV head is `D` along k, v, dk, dv; the batch's next query head is
/// `group * D` along q, dq, out, dout; a score matrix is `T * T` f32s, the probabilities
/// and score gradients written over it `T * ld_p` storage elements.
struct AttnGemms {
    t: usize,
    d: usize,
    group: usize,
    heads: usize,
    q_stride: usize,
    kv_stride: usize,
    /// Row width of out and dout (`H * D`).
    out_stride: usize,
    /// Storage bytes per element.
    e: u64,
    /// Leading dimension of P and dS written over the f32 rows: `T * 4 / e`.
    ld_p: usize,
    /// Element offset of the batch's first query head's row 0 in q-like tensors, per row width.
    q_row0: u64,
    q_col0: u64,
    kv_row0: u64,
    kv_col0: u64,
    /// The batch's first query head's row 0 in `lse` and `delta` (f32 `[B, H, T]`).
    lse_row0: u64,
    scale: f32,
    scores: u64,
    dprobs: u64,
    accumulate: bool,
}

impl AttnGemms {
    fn new(dims: &AttnDims, st: Storage, hb: HeadBatch, scores: u64, dprobs: u64) -> Self {
        let (t, d, h) = (dims.t as u64, dims.d as u64, dims.h as u64);
        let group = (dims.h / dims.kv) as u64;
        let e = st.size();
        Self {
            t: t as usize,
            d: d as usize,
            group: group as usize,
            heads: hb.heads as usize,
            q_stride: dims.q_stride as usize,
            kv_stride: dims.kv_stride as usize,
            out_stride: (h * d) as usize,
            e,
            ld_p: (t * 4 / e) as usize,
            q_row0: hb.b * t,
            q_col0: (hb.kv0 * group + hb.j) * d,
            kv_row0: hb.b * t,
            kv_col0: hb.kv0 * d,
            lse_row0: (hb.b * h + hb.kv0 * group + hb.j) * t,
            scale: dims.scale,
            scores,
            dprobs,
            accumulate: hb.j > 0,
        }
    }

    /// The batch's first query head in a tensor of row width `ld` at `base`.
    fn q_at(&self, base: u64, ld: usize) -> u64 {
        base + self.e * (self.q_row0 * ld as u64 + self.q_col0)
    }

    /// The batch's first KV head in a k-like tensor at `base`.
    fn kv_at(&self, base: u64) -> u64 {
        base + self.e * (self.kv_row0 * self.kv_stride as u64 + self.kv_col0)
    }

    /// f32s between the batch's query heads in `lse` and `delta`.
    fn lse_head_stride(&self) -> Result<i32> {
        i32::try_from(self.group * self.t).map_err(|_| {
            RuntimeError::BadSchedule(format!(
                "attention: {} query heads per KV head over {} positions exceed 32-bit sizes",
                self.group, self.t
            ))
        })
    }

    /// The row kernels' grid: one block per score row of each head.
    fn row_grid(&self, p: &Plan<'_>) -> Result<(u32, u32, u32)> {
        let rows = u32::try_from(self.t).map_err(|_| p.bad("sequence beyond 32 bits"))?;
        Ok((rows, p.grid_yz(self.heads as u64, "heads per batch")?, 1))
    }

    fn batched(&self, first: Gemm, stride: [usize; 3], alpha: f32, beta: f32) -> Batched {
        Batched {
            first,
            batch: self.heads,
            stride_a: stride[0],
            stride_b: stride[1],
            stride_c: stride[2],
            alpha,
            beta,
        }
    }

    fn qd(&self) -> usize {
        self.group * self.d
    }

    /// `S = scale Q K^T` (f32): `S^T [Tk, Tq] = K Q^T`.
    fn scores(&self, q: u64, k: u64) -> Batched {
        let first = Gemm {
            ta: CuOp::CUBLAS_OP_T,
            tb: CuOp::CUBLAS_OP_N,
            m: self.t,
            n: self.t,
            k: self.d,
            a: self.kv_at(k),
            lda: self.kv_stride,
            b: self.q_at(q, self.q_stride),
            ldb: self.q_stride,
            c: self.scores,
            ldc: self.t,
        };
        self.batched(first, [self.d, self.qd(), self.t * self.t], self.scale, 0.0)
    }

    /// `O = P V`: `O^T [D, Tq] = V^T P^T`.
    fn output(&self, v: u64, out: u64) -> Batched {
        let first = Gemm {
            ta: CuOp::CUBLAS_OP_N,
            tb: CuOp::CUBLAS_OP_N,
            m: self.d,
            n: self.t,
            k: self.t,
            a: self.kv_at(v),
            lda: self.kv_stride,
            b: self.scores,
            ldb: self.ld_p,
            c: self.q_at(out, self.out_stride),
            ldc: self.out_stride,
        };
        self.batched(first, [self.d, self.t * self.ld_p, self.qd()], 1.0, 0.0)
    }

    /// `dP = dO V^T` (f32): `dP^T [Tk, Tq] = V dO^T`.
    fn dprobs(&self, v: u64, dout: u64) -> Batched {
        let first = Gemm {
            ta: CuOp::CUBLAS_OP_T,
            tb: CuOp::CUBLAS_OP_N,
            m: self.t,
            n: self.t,
            k: self.d,
            a: self.kv_at(v),
            lda: self.kv_stride,
            b: self.q_at(dout, self.out_stride),
            ldb: self.out_stride,
            c: self.dprobs,
            ldc: self.t,
        };
        self.batched(first, [self.d, self.qd(), self.t * self.t], 1.0, 0.0)
    }

    /// `dV (+)= P^T dO`: `dV^T [D, Tk] = dO^T P`; the group's later query heads accumulate.
    fn dv(&self, dout: u64, dv: u64) -> Batched {
        let first = Gemm {
            ta: CuOp::CUBLAS_OP_N,
            tb: CuOp::CUBLAS_OP_T,
            m: self.d,
            n: self.t,
            k: self.t,
            a: self.q_at(dout, self.out_stride),
            lda: self.out_stride,
            b: self.scores,
            ldb: self.ld_p,
            c: self.kv_at(dv),
            ldc: self.kv_stride,
        };
        let beta = if self.accumulate { 1.0 } else { 0.0 };
        self.batched(first, [self.qd(), self.t * self.ld_p, self.d], 1.0, beta)
    }

    /// `dQ = dS K` (dS carries the scale): `dQ^T [D, Tq] = K^T dS^T`.
    fn dq(&self, k: u64, dq: u64) -> Batched {
        let first = Gemm {
            ta: CuOp::CUBLAS_OP_N,
            tb: CuOp::CUBLAS_OP_N,
            m: self.d,
            n: self.t,
            k: self.t,
            a: self.kv_at(k),
            lda: self.kv_stride,
            b: self.dprobs,
            ldb: self.ld_p,
            c: self.q_at(dq, self.q_stride),
            ldc: self.q_stride,
        };
        self.batched(first, [self.d, self.t * self.ld_p, self.qd()], 1.0, 0.0)
    }

    /// `dK (+)= dS^T Q`: `dK^T [D, Tk] = Q^T dS`; the group's later query heads accumulate.
    fn dk(&self, q: u64, dk: u64) -> Batched {
        let first = Gemm {
            ta: CuOp::CUBLAS_OP_N,
            tb: CuOp::CUBLAS_OP_T,
            m: self.d,
            n: self.t,
            k: self.t,
            a: self.q_at(q, self.q_stride),
            lda: self.q_stride,
            b: self.dprobs,
            ldb: self.ld_p,
            c: self.kv_at(dk),
            ldc: self.kv_stride,
        };
        let beta = if self.accumulate { 1.0 } else { 0.0 };
        self.batched(first, [self.qd(), self.t * self.ld_p, self.d], 1.0, beta)
    }
}

/// The calls that compute one op of `kind` on operands of `types` at `at`, in issue order.
/// Pure: builds the list and issues nothing. Fails on what the kernels cannot run (a dtype
/// other than f32, bf16 or f16, sizes beyond 32 bits, a workspace smaller than the layout) with
/// the way out.
pub(super) fn calls(
    kind: &OpKind,
    types: Types<'_>,
    at: &Addresses,
    target: Target,
) -> Result<Vec<Call>> {
    let mut p = Plan::new(kind, types, at, target)?;
    plan(&mut p)?;
    Ok(p.calls)
}

impl<'a> Plan<'a> {
    /// An empty plan for `kind`, its operand counts checked against the addresses and the
    /// kind's arity.
    fn new(kind: &'a OpKind, types: Types<'a>, at: &'a Addresses, target: Target) -> Result<Self> {
        let (n_in, n_out) = (types.inputs.len(), types.outputs.len());
        let p = Plan {
            kind,
            types,
            at,
            target,
            layout: WorkspaceLayout::for_device(kind, types.inputs, target.flash),
            calls: Vec::new(),
        };
        if at.inputs.len() != n_in || at.outputs.len() != n_out {
            return Err(p.bad(format!(
                "the op has {n_in} inputs and {n_out} outputs but the kernel was given {} and \
                 {} addresses",
                at.inputs.len(),
                at.outputs.len()
            )));
        }
        if let Some(arity) = kind.arity().filter(|&a| a != n_in) {
            return Err(p.bad(format!("takes {arity} inputs but has {n_in}")));
        }
        Ok(p)
    }
}

/// Fills `p.calls` for its op.
fn plan(p: &mut Plan<'_>) -> Result<()> {
    let (n_in, n_out) = (p.types.inputs.len(), p.types.outputs.len());
    match p.kind {
        OpKind::MoeRoute {
            experts,
            top_k,
            normalize,
        } => moe_route(p, *experts, *top_k, *normalize, false)?,
        OpKind::MoeRouteBackward {
            experts,
            top_k,
            normalize,
        } => moe_route(p, *experts, *top_k, *normalize, true)?,
        OpKind::MoeDispatch { top_k } => {
            let st = p.storage(0)?;
            let (n_rows, c) = (p.ty_out(0).rows(), p.ty_out(0).last_dim());
            let args = vec![
                Ptr(p.output(0)),
                Ptr(p.input(0)),
                Ptr(p.input(1)),
                I32(p.int(n_rows, "packed rows")?),
                I32(p.int(c, "channels")?),
                I32(p.int(*top_k, "top_k")?),
            ];
            p.stride(st.pick(entry!("moe_dispatch")), n_rows * c, args);
        }
        OpKind::MoeDispatchBackward { top_k } => {
            let st = p.storage(1)?;
            let (tokens, c) = (p.ty_out(0).rows(), p.ty_out(0).last_dim());
            let args = vec![
                Ptr(p.output(0)),
                Ptr(p.input(1)),
                Ptr(p.input(0)),
                I32(p.int(tokens, "tokens")?),
                I32(p.int(c, "channels")?),
                I32(p.int(*top_k, "top_k")?),
            ];
            p.stride(st.pick(entry!("moe_dispatch_backward")), tokens * c, args);
        }
        OpKind::GroupedLinear { experts } => grouped_linear(p, *experts, false)?,
        OpKind::GroupedLinearBackward { experts } => grouped_linear(p, *experts, true)?,
        OpKind::MoeCombine { top_k } => {
            let st = p.storage(0)?;
            let (tokens, c) = (p.ty_out(0).rows(), p.ty_out(0).last_dim());
            let args = vec![
                Ptr(p.output(0)),
                Ptr(p.input(0)),
                Ptr(p.input(1)),
                Ptr(p.input(2)),
                I32(p.int(tokens, "tokens")?),
                I32(p.int(c, "channels")?),
                I32(p.int(*top_k, "top_k")?),
            ];
            p.stride(st.pick(entry!("moe_combine")), tokens * c, args);
        }
        OpKind::MoeCombineBackward { top_k } => {
            let st = p.storage(0)?;
            if p.ty_in(3).dtype != p.ty_in(0).dtype {
                return Err(p.bad(format!(
                    "the output gradient {} and the expert outputs {} differ in type",
                    p.ty_in(3),
                    p.ty_in(0)
                )));
            }
            let (n_slots, c) = (p.ty_in(0).rows(), p.ty_in(0).last_dim());
            let (n_i, c_i, k_i) = (
                p.int(n_slots, "packed rows")?,
                p.int(c, "channels")?,
                p.int(*top_k, "top_k")?,
            );
            let (ys, weights, slots, dout) = (p.input(0), p.input(1), p.input(2), p.input(3));
            let args = vec![
                Ptr(p.output(0)),
                Ptr(dout),
                Ptr(weights),
                Ptr(slots),
                I32(n_i),
                I32(c_i),
                I32(k_i),
            ];
            p.stride(
                st.pick(entry!("moe_combine_backward_dys")),
                n_slots * c,
                args,
            );
            let args = vec![
                Ptr(p.output(1)),
                Ptr(dout),
                Ptr(ys),
                Ptr(slots),
                I32(n_i),
                I32(c_i),
                I32(k_i),
            ];
            p.stride(
                st.pick(entry!("moe_combine_backward_weights")),
                n_slots,
                args,
            );
        }
        OpKind::MoeAuxLoss {
            experts,
            top_k,
            layers,
            coef,
        } => moe_aux_loss(p, *experts, *top_k, *layers, *coef)?,
        OpKind::MoeAuxLossBackward {
            experts,
            top_k,
            layers,
            coef,
            ..
        } => moe_aux_loss_backward(p, *experts, *top_k, *layers, *coef)?,
        OpKind::MoveStart(_) | OpKind::MoveDone(_) | OpKind::Release { .. } => {
            return Err(p.bad(
                "is a movement op, which no kernel runs: a schedule's copies are copy \
                 instructions (the schedule verifier refuses movement ops in its graph)",
            ));
        }
        OpKind::PartialRope {
            head_dim,
            rotary_dim,
            heads,
            theta,
            scaling,
        } => {
            let part = Some((*rotary_dim, *heads));
            rope(p, *head_dim, part, *theta, scaling, false)?
        }
        OpKind::PartialRopeBackward {
            head_dim,
            rotary_dim,
            heads,
            theta,
            scaling,
        } => {
            let part = Some((*rotary_dim, *heads));
            rope(p, *head_dim, part, *theta, scaling, true)?
        }
        OpKind::PackedSwiglu => packed_swiglu(p, false)?,
        OpKind::PackedSwigluBackward => packed_swiglu(p, true)?,
        OpKind::Embedding { .. } => {
            let st = p.storage(1)?;
            let table = p.ty_in(1);
            let (vocab, ch) = (table.shape[0], table.shape[1]);
            let tokens = p.ty_in(0).numel();
            let args = vec![
                Ptr(p.output(0)),
                Ptr(p.input(0)),
                Ptr(p.input(1)),
                I32(p.int(tokens, "tokens")?),
                I32(p.int(vocab, "vocabulary")?),
                I32(p.int(ch, "channels")?),
            ];
            p.stride(st.pick(entry!("embedding_forward")), tokens * ch, args);
        }
        OpKind::PositionEmbedding { offset } => {
            let st = p.storage(1)?;
            let t = p.ty_in(0).clone();
            let ch = p.ty_in(1).shape[1];
            let args = vec![
                Ptr(p.output(0)),
                Ptr(p.input(1)),
                I32(p.int(t.shape[0], "batch")?),
                I32(p.int(t.shape[1], "sequence")?),
                I32(p.int(ch, "channels")?),
                I32(p.int(*offset, "offset")?),
            ];
            p.stride(
                st.pick(entry!("position_embedding_forward")),
                t.numel() * ch,
                args,
            );
        }
        OpKind::LayerNorm { eps } => {
            let st = p.storage(0)?;
            let (rows, c) = (p.ty_in(0).rows(), p.ty_in(0).last_dim());
            let (mean, rstd) = (p.workspace(Scratch::Mean)?, p.workspace(Scratch::Rstd)?);
            let args = vec![
                Ptr(p.output(0)),
                Ptr(mean),
                Ptr(rstd),
                Ptr(p.input(0)),
                Ptr(p.input(1)),
                Ptr(p.input(2)),
                I32(p.int(rows, "rows")?),
                I32(p.int(c, "channels")?),
                F32(*eps as f32),
            ];
            p.rows(st.pick(entry!("layer_norm_forward")), rows, args);
        }
        OpKind::RmsNorm {
            eps,
            head_dim,
            unit_offset,
        } => {
            let st = p.storage(0)?;
            let (rows, c) = rms_norm_groups(p.ty_in(0), *head_dim);
            let args = vec![
                Ptr(p.output(0)),
                Ptr(p.workspace(Scratch::Rstd)?),
                Ptr(p.input(0)),
                Ptr(p.input(1)),
                I32(p.int(rows, "rows")?),
                I32(p.int(c, "channels")?),
                F32(*eps as f32),
                I32(i32::from(*unit_offset)),
            ];
            p.rows(st.pick(entry!("rms_norm_forward")), rows, args);
        }
        OpKind::Linear { bias, layout } => {
            // Refuses storage the kernels do not have.
            p.storage(0)?;
            let dtype = p.ty_in(0).dtype;
            if p.ty_in(1).dtype != dtype {
                return Err(p.bad(format!(
                    "input {} and weight {} differ in type",
                    p.ty_in(0),
                    p.ty_in(1)
                )));
            }
            let d = LinearDims {
                rows: p.ty_in(0).rows() as usize,
                d_in: p.ty_in(0).last_dim() as usize,
                d_out: p.ty_out(0).last_dim() as usize,
            };
            let (x, w, y) = (p.input(0), p.input(1), p.output(0));
            match bias {
                // The bias in the matmul's epilogue.
                true => {
                    let b = p.input(2);
                    p.linear_matmul(dtype, *layout, d, (x, w, y), Some(b), Fused::Plain)
                }
                false => p.linear_forward(dtype, *layout, d, x, w, y),
            }
            // A padded output: its rows are the pitch apart (C's leading dimension).
            if let Some(pitch) = p.at.pitches.output(0) {
                p.pitch_last_calls(y, pitch);
            }
        }
        OpKind::Gelu => unary(p, entry!("gelu_forward"))?,
        OpKind::Relu => unary(p, entry!("relu_forward"))?,
        OpKind::Silu => unary(p, entry!("silu_forward"))?,
        OpKind::Swiglu => binary(p, entry!("swiglu_forward"))?,
        OpKind::Geglu => binary(p, entry!("geglu_forward"))?,
        OpKind::Softcap { cap } => {
            let st = p.storage(0)?;
            let n = p.ty_in(0).numel();
            let args = vec![
                Ptr(p.output(0)),
                Ptr(p.input(0)),
                F32(*cap as f32),
                I64(n as i64),
            ];
            p.stride(st.pick(entry!("softcap_forward")), n, args);
        }
        OpKind::Scale { factor } => {
            let st = p.storage(0)?;
            let n = p.ty_in(0).numel();
            // A tensor of the storage type in transformers: rounded before the product.
            let factor = crate::kernels::Rounding::of(p.ty_in(0).dtype).round(*factor as f32);
            let args = vec![
                Ptr(p.output(0)),
                Ptr(p.input(0)),
                F32(factor),
                I64(n as i64),
            ];
            p.stride(st.pick(entry!("scale_forward")), n, args);
        }
        OpKind::SoftcapBackward { cap } => {
            let st = p.storage(0)?;
            let n = p.ty_in(0).numel();
            let args = vec![
                Ptr(p.output(0)),
                Ptr(p.input(1)),
                Ptr(p.input(0)),
                F32(*cap as f32),
                I64(n as i64),
            ];
            p.stride(st.pick(entry!("softcap_backward")), n, args);
        }
        OpKind::Add => binary(p, entry!("add_forward"))?,
        OpKind::Rope {
            head_dim,
            theta,
            scaling,
        } => rope(p, *head_dim, None, *theta, scaling, false)?,
        OpKind::Attention {
            heads,
            kv_heads,
            head_dim,
            window,
            qkv,
            scale,
            softcap,
        } => {
            let st = p.storage(0)?;
            let out = p.ty_out(0).clone();
            let dims = AttnDims::new(p, &out, *heads, *kv_heads, *head_dim, *window, *qkv, st)?
                .scored(*scale, *softcap);
            let (q, k, v) = match dims.packed {
                Some((k_off, v_off)) => {
                    let qkv = p.input(0);
                    (qkv, qkv + k_off, qkv + v_off)
                }
                None => (p.input(0), p.input(1), p.input(2)),
            };
            let (o, lse) = (p.output(0), p.output(1));
            if let Some(entry) = flash_entry(p, st, *head_dim, FLASH_FORWARD) {
                let grid = dims.flash_grid(p, dims.h)?;
                let mut args = vec![Ptr(o), Ptr(lse), Ptr(q), Ptr(k), Ptr(v)];
                args.extend(dims.flash_args());
                p.shaped(entry, grid, (ATTN_FLASH_THREADS, 1, 1), args);
                return Ok(());
            }
            let scores = p.workspace(Scratch::Scores)?;
            for hb in dims.head_batches() {
                let g = AttnGemms::new(&dims, st, hb, scores, 0);
                p.batched(st, DType::F32, g.scores(q, k), "attention scores (Q K^T)");
                p.shaped(
                    st.pick(entry!("attention_softmax")),
                    g.row_grid(p)?,
                    (BLOCK, 1, 1),
                    vec![
                        Ptr(scores),
                        Ptr(lse),
                        I64(g.lse_row0 as i64),
                        I32(dims.t),
                        I32(dims.window),
                        I32(g.lse_head_stride()?),
                        F32(dims.softcap),
                    ],
                );
                p.batched(st, st.dtype(), g.output(v, o), "attention output (P V)");
            }
        }
        OpKind::CrossEntropy => {
            let st = p.storage(0)?;
            let (rows, vocab) = (p.ty_in(0).rows(), p.ty_in(0).last_dim());
            let row_loss = p.workspace(Scratch::RowLoss)?;
            let rows_i = p.int(rows, "rows")?;
            let pitch = p.at.pitches.input(0).map_or(vocab, |x| x as u64);
            let args = vec![
                Ptr(p.output(1)),
                Ptr(row_loss),
                Ptr(p.input(0)),
                Ptr(p.input(1)),
                I32(rows_i),
                I32(p.int(vocab, "vocabulary")?),
                I32(p.int(pitch, "row pitch")?),
            ];
            p.rows(st.pick(entry!("cross_entropy_forward")), rows, args);
            let args = vec![Ptr(p.output(0)), Ptr(row_loss), I32(rows_i)];
            p.shaped("cross_entropy_loss", (1, 1, 1), (1024, 1, 1), args);
        }
        OpKind::EmbeddingBackward { rows, padding_idx } => {
            let st = p.storage(1)?;
            let (vocab, ch) = (*rows, p.ty_in(1).last_dim());
            let tokens = p.ty_in(0).numel();
            let span = p.workspace(Scratch::TokenSpan)?;
            let (tok, vocab_i) = (p.input(0), p.int(vocab, "vocabulary")?);
            let tokens_i = p.int(tokens, "tokens")?;
            for phase in [0, 1] {
                p.stride(
                    "embedding_backward_span",
                    vocab.max(tokens),
                    vec![Ptr(span), Ptr(tok), I32(tokens_i), I32(vocab_i), I32(phase)],
                );
            }
            let pad = padding_idx.filter(|&i| i < vocab).map_or(-1, |i| i as i32);
            // Each thread takes 16 bytes of columns on the kernel's vector path; on its scalar
            // path (a width that is not a multiple, offset pointers) the column groups stride
            // over grid.y, so this grid covers every column either way.
            let per_block = u64::from(BLOCK) * (16 / st.size());
            let grid = (
                vocab.min(MAX_GRID_YZ) as u32,
                p.grid_yz(ch.div_ceil(per_block), "channel blocks")?,
                1,
            );
            let args = vec![
                Ptr(p.output(0)),
                Ptr(p.input(1)),
                Ptr(tok),
                Ptr(span),
                I32(tokens_i),
                I32(vocab_i),
                I32(p.int(ch, "channels")?),
                I32(0),
                I32(pad),
            ];
            p.shaped(
                st.pick(entry!("embedding_backward")),
                grid,
                (BLOCK, 1, 1),
                args,
            );
        }
        OpKind::PositionEmbeddingBackward { rows, offset } => {
            let st = p.storage(1)?;
            let t = p.ty_in(0).clone();
            let ch = p.ty_in(1).last_dim();
            let args = vec![
                Ptr(p.output(0)),
                Ptr(p.input(1)),
                I32(p.int(t.shape[0], "batch")?),
                I32(p.int(t.shape[1], "sequence")?),
                I32(p.int(ch, "channels")?),
                I32(p.int(*offset, "offset")?),
                I32(p.int(*rows, "positions")?),
                I32(0),
            ];
            p.stride(
                st.pick(entry!("position_embedding_backward")),
                rows * ch,
                args,
            );
        }
        OpKind::LayerNormBackward { eps } => norm_backward(p, *eps, None)?,
        OpKind::RmsNormBackward {
            eps,
            head_dim,
            unit_offset,
        } => norm_backward(p, *eps, Some((*head_dim, *unit_offset)))?,
        OpKind::LinearBackward { bias, layout } => {
            let st = p.storage(0)?;
            let dtype = p.ty_in(0).dtype;
            if p.ty_in(1).dtype != dtype || p.ty_in(2).dtype != dtype {
                return Err(p.bad(format!(
                    "x {}, weight {} and dy {} differ in type",
                    p.ty_in(0),
                    p.ty_in(1),
                    p.ty_in(2)
                )));
            }
            if *bias && n_out < 3 {
                return Err(p.bad("a linear layer with a bias writes dx, dweight and dbias"));
            }
            let d = LinearDims {
                rows: p.ty_in(0).rows() as usize,
                d_in: p.ty_in(0).last_dim() as usize,
                d_out: p.ty_in(2).last_dim() as usize,
            };
            let (x, w, dy) = (p.input(0), p.input(1), p.input(2));
            let (dx, dw) = (p.output(0), p.output(1));
            p.linear_backward(dtype, *layout, d, x, w, dy, dx, dw);
            if let Some(pitch) = p.at.pitches.input(2) {
                if *bias {
                    return Err(p.bad("a padded dy with a bias: its column sum reads dense rows"));
                }
                // A padded dy: its rows are the pitch apart (its operand's leading dimension).
                p.pitch_last_calls(dy, pitch);
            }
            if *bias {
                let partials = p.workspace(Scratch::BiasPartials)?;
                let db = p.output(2);
                p.column_sum(st, db, dy, d.rows as u64, d.d_out as u64, partials)?;
            }
        }
        OpKind::FusedLinear {
            count,
            bias,
            layout,
            epilogue,
        } => fused_linear(p, *count as usize, *bias, *layout, *epilogue)?,
        OpKind::FusedLinearBackward {
            count,
            bias,
            layout,
            epilogue,
        } => fused_linear_backward(p, *count as usize, *bias, *layout, *epilogue)?,
        OpKind::GeluBackward => unary_backward(p, entry!("gelu_backward"))?,
        OpKind::ReluBackward => unary_backward(p, entry!("relu_backward"))?,
        OpKind::SiluBackward => unary_backward(p, entry!("silu_backward"))?,
        OpKind::SwigluBackward | OpKind::GegluBackward => {
            let entries = match p.kind {
                OpKind::GegluBackward => entry!("geglu_backward"),
                _ => entry!("swiglu_backward"),
            };
            let st = p.storage(0)?;
            let n = p.ty_in(0).numel();
            let args = vec![
                Ptr(p.output(0)),
                Ptr(p.output(1)),
                Ptr(p.input(2)),
                Ptr(p.input(0)),
                Ptr(p.input(1)),
                I64(n as i64),
            ];
            p.stride(st.pick(entries), n, args);
        }
        OpKind::RopeBackward {
            head_dim,
            theta,
            scaling,
        } => rope(p, *head_dim, None, *theta, scaling, true)?,
        OpKind::AttentionBackward {
            heads,
            kv_heads,
            head_dim,
            window,
            qkv,
            scale,
            softcap,
        } => {
            let scores = (*scale, *softcap);
            attention_backward(p, *heads, *kv_heads, *head_dim, *window, *qkv, scores)?
        }
        OpKind::AccumulateGrad => accumulate(p)?,
        OpKind::CrossEntropyBackward
        | OpKind::CrossEntropyBackwardScaled { .. }
        | OpKind::CrossEntropyBackwardLossScaled { .. } => {
            // The loss gradient's seed, the host kernel's.
            let dloss = crate::dispatch::loss_seed(p.kind).expect("a cross-entropy backward kind");
            let st = p.storage(0)?;
            let (rows, vocab) = (p.ty_in(0).rows(), p.ty_in(0).last_dim());
            let pitch = p.at.pitches.input(0).map_or(vocab, |x| x as u64);
            if p.at.pitches.output(0).map_or(vocab, |x| x as u64) != pitch {
                return Err(p.bad("logits and their gradient are stored at different pitches"));
            }
            let args = vec![
                Ptr(p.output(0)),
                Ptr(p.input(0)),
                Ptr(p.input(2)),
                Ptr(p.input(1)),
                I32(p.int(rows, "rows")?),
                I32(p.int(vocab, "vocabulary")?),
                I32(p.int(pitch, "row pitch")?),
                F32(dloss),
            ];
            p.stride(
                st.pick(entry!("cross_entropy_backward")),
                rows * vocab,
                args,
            );
        }
        OpKind::GradNormSq => {
            let st = p.storage(0)?;
            let n = p.ty_in(0).numel();
            let count = grad_norm_partials(n as usize) as u64;
            let partials = p.workspace(Scratch::NormPartials)?;
            let args = vec![Ptr(partials), Ptr(p.input(0)), I64(n as i64)];
            p.shaped(
                st.pick(entry!("grad_norm_sq_partial")),
                (count as u32, 1, 1),
                (BLOCK, 1, 1),
                args,
            );
            let args = vec![Ptr(p.output(0)), Ptr(partials), I32(count as i32)];
            p.shaped("grad_norm_sq_finish", (1, 1, 1), (BLOCK, 1, 1), args);
        }
        OpKind::ClipCoef { max_norm } => {
            let norms: Vec<u64> = (0..n_in).map(|i| p.input(i)).collect();
            let args = vec![
                Ptr(p.output(0)),
                Arg::NormSlot,
                Arg::Table(ConstKey::Pointers(norms)),
                I32(p.int(n_in as u64, "gradients")?),
                F32(*max_norm as f32),
            ];
            p.shaped("clip_coef", (1, 1, 1), (1, 1, 1), args);
        }
        OpKind::UnscaleCoef {
            max_norm,
            loss_scale,
        } => {
            let norms: Vec<u64> = (0..n_in).map(|i| p.input(i)).collect();
            // f32(1 / S), rounded as the host's `kernels::unscale_coef` rounds it.
            let inv_scale = (1.0 / *loss_scale) as f32;
            let args = vec![
                Ptr(p.output(0)),
                Arg::NormSlot,
                Arg::Table(ConstKey::Pointers(norms)),
                I32(p.int(n_in as u64, "gradients")?),
                F32(inv_scale),
                F32(max_norm.unwrap_or(0.0) as f32),
                I32(i32::from(max_norm.is_some())),
            ];
            p.shaped("unscale_coef", (1, 1, 1), (1, 1, 1), args);
        }
        OpKind::AdamW { .. } => {
            let a = adamw_operands(p)?;
            let mut args = Vec::with_capacity(14);
            args.push(Ptr(a.master));
            if a.st != Storage::F32 {
                args.push(Ptr(a.low));
            }
            args.extend([
                Ptr(a.grad),
                Ptr(a.m),
                Ptr(a.v),
                I64(a.n as i64),
                Ptr(a.scale),
            ]);
            args.extend(a.scalars.map(F32));
            p.stride(a.st.pick(entry!("adamw")), a.n, args);
        }
    }
    Ok(())
}

/// One AdamW's operands and step scalars, checked: what its per-tensor kernel and a merged
/// launch ([`adamw_multi`]) pass.
struct AdamWOperands {
    st: Storage,
    /// The f32 parameter, or the f32 master weight of a bf16 or f16 one.
    master: u64,
    /// The bf16 or f16 parameter (0 in f32).
    low: u64,
    grad: u64,
    m: u64,
    v: u64,
    n: u64,
    /// The clip coefficient (0: unclipped).
    scale: u64,
    /// [`AdamWScalars`] in the kernels' parameter order.
    scalars: [f32; ADAMW_SCALARS],
}

/// The operands of the AdamW op `p` plans, with the way out when the kernels cannot update it.
fn adamw_operands(p: &Plan<'_>) -> Result<AdamWOperands> {
    let OpKind::AdamW { clipped, .. } = *p.kind else {
        return Err(p.bad(
            "is not AdamW but was planned as one; this is a bug in runtime/src/cuda/launch.rs",
        ));
    };
    let n_in = p.types.inputs.len();
    if n_in < 4 + usize::from(clipped) {
        return Err(p.bad(format!(
            "takes param, grad, m, v{}",
            match clipped {
                true => " and the clip coefficient",
                false => "",
            }
        )));
    }
    let param = p.ty_in(0).clone();
    if p.ty_in(1).dtype != param.dtype
        || p.ty_in(2).dtype != DType::F32
        || p.ty_in(3).dtype != DType::F32
    {
        return Err(p.bad(format!(
            "param {param}, grad {}, m {}, v {}: the kernels update a param with a gradient of \
             its type and f32 moments",
            p.ty_in(1),
            p.ty_in(2),
            p.ty_in(3)
        )));
    }
    let scalars = adamw_step_scalars(p.kind, p.target.step).ok_or_else(|| {
        p.bad("is not AdamW but was planned as one; this is a bug in runtime/src/cuda/launch.rs")
    })?;
    let st = p.storage(0)?;
    let (master, low) = match st {
        Storage::F32 => (p.input(0), 0),
        Storage::Bf16 | Storage::F16 => {
            let master = p.at.master.ok_or_else(|| {
                p.bad(format!(
                    "a {} parameter needs the address of its f32 master weight",
                    param.dtype
                ))
            })?;
            (master, p.input(0))
        }
    };
    Ok(AdamWOperands {
        st,
        master,
        low,
        grad: p.input(1),
        m: p.input(2),
        v: p.input(3),
        n: param.numel(),
        scale: match clipped {
            true => p.input(4),
            false => 0,
        },
        scalars,
    })
}

/// How many step scalars an AdamW launch (`adamw_*`, `adamw_multi_*`) passes: its last
/// arguments, [`AdamWScalars`] in field order.
pub(super) const ADAMW_SCALARS: usize = 7;

/// The step scalars of an AdamW op of `kind` at step `step` ([`AdamWScalars`] in the kernels'
/// parameter order, the last [`ADAMW_SCALARS`] arguments of its launch); `None` for another
/// kind. The only part of an AdamW's plan that changes from step to step (the learning rate
/// and the bias corrections), so a prepared launch is patched with them rather than planned
/// again.
pub(super) fn adamw_step_scalars(kind: &OpKind, step: u64) -> Option<[f32; ADAMW_SCALARS]> {
    let OpKind::AdamW {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        ..
    } = *kind
    else {
        return None;
    };
    let s = AdamWScalars::new(
        &AdamWConfig {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        },
        step,
    );
    Some([
        s.decay,
        s.lerp_w,
        s.beta2,
        s.one_minus_beta2,
        s.bc2_sqrt,
        s.eps,
        s.neg_step_size,
    ])
}

/// Words per tensor of an `adamw_multi_*` table: `master, low, grad, exp_avg, exp_avg_sq, n,
/// first_block`, as `AdamWTensor` in `kernels/adamw.cu` lays them out.
pub(super) const ADAMW_TABLE_WORDS: usize = 7;

/// One AdamW op of a run that one launch updates: what [`calls`] takes for it.
#[derive(Clone, Copy, Debug)]
pub(super) struct AdamWMember<'a> {
    /// The op's kind (with the step's learning rate).
    pub kind: &'a OpKind,
    /// Its operand types.
    pub types: Types<'a>,
    /// Where its operands are.
    pub at: &'a Addresses,
}

/// The calls that update a run of AdamW ops (see [`super::adamw_runs`]) with one
/// `adamw_multi_*` launch: a table of every non-empty tensor ([`ConstKey::AdamWTensors`]) and
/// a grid that gives each tensor the blocks its own launch would have had, so each element is
/// updated with the same operations as [`calls`] would update it, by another thread. No call
/// when every tensor is empty. Pure, as [`calls`].
///
/// Fails, with what is wrong, on an operand [`calls`] would refuse, and on members that differ
/// in storage type, step scalars (hyper-parameters, learning rate, step) or clip coefficient,
/// which one launch cannot pass.
pub(super) fn adamw_multi(members: &[AdamWMember<'_>], target: Target) -> Result<Vec<Call>> {
    let mut table = Vec::with_capacity(members.len() * ADAMW_TABLE_WORDS);
    let mut first: Option<AdamWOperands> = None;
    let mut blocks: u64 = 0;
    let mut count: u64 = 0;
    for member in members {
        let p = Plan::new(member.kind, member.types, member.at, target)?;
        let a = adamw_operands(&p)?;
        if let Some(f) = &first {
            if (f.st, f.scale, f.scalars) != (a.st, a.scale, a.scalars) {
                return Err(p.bad(
                    "cannot share a launch with the AdamW ops before it: their storage type, \
                     step scalars or clip coefficient differ; this is a bug in \
                     runtime/src/cuda/runs.rs, which merged them",
                ));
            }
        }
        if a.n > 0 {
            table.extend([a.master, a.low, a.grad, a.m, a.v, a.n, blocks]);
            blocks += u64::from(p.grid_for(a.n));
            count += 1;
        }
        first.get_or_insert(a);
    }
    let Some(f) = first.filter(|_| count > 0) else {
        return Ok(Vec::new());
    };
    let too_many = |what: &str, v: u64| {
        RuntimeError::BadSchedule(format!(
            "adamw: a merged launch of {} tensors needs {v} {what}, more than one launch \
             takes; this is a bug in runtime/src/cuda/runs.rs, which should split the run",
            members.len()
        ))
    };
    let grid = u32::try_from(blocks)
        .ok()
        .filter(|&g| g <= i32::MAX as u32)
        .ok_or_else(|| too_many("blocks", blocks))?;
    let count = i32::try_from(count).map_err(|_| too_many("table entries", count))?;
    let mut args = vec![
        Arg::Table(ConstKey::AdamWTensors(table)),
        I32(count),
        Ptr(f.scale),
    ];
    args.extend(f.scalars.map(F32));
    Ok(vec![Call::Kernel(KernelCall {
        entry: f.st.pick(entry!("adamw_multi")),
        grid: (grid, 1, 1),
        block: (BLOCK, 1, 1),
        args,
    })])
}

/// `out = f(x)`, elementwise.
fn unary(p: &mut Plan<'_>, entries: Entries) -> Result<()> {
    let st = p.storage(0)?;
    let n = p.ty_in(0).numel();
    let args = vec![Ptr(p.output(0)), Ptr(p.input(0)), I64(n as i64)];
    p.stride(st.pick(entries), n, args);
    Ok(())
}

/// `out = f(a, b)`, elementwise.
fn binary(p: &mut Plan<'_>, entries: Entries) -> Result<()> {
    let st = p.storage(0)?;
    let n = p.ty_in(0).numel();
    let args = vec![
        Ptr(p.output(0)),
        Ptr(p.input(0)),
        Ptr(p.input(1)),
        I64(n as i64),
    ];
    p.stride(st.pick(entries), n, args);
    Ok(())
}

/// The kernel that adds one `dtype` buffer into another in place (`add_forward` with its output
/// on its first input, as [`accumulate`] launches it): for sums the backend issues itself.
pub(super) fn accumulate_entry(dtype: DType) -> Result<&'static str> {
    let st = storage_of(dtype).ok_or_else(|| {
        RuntimeError::BadSchedule(format!(
            "an accumulation of {dtype} values; the CUDA kernels sum f32, bf16 or f16: \
             recompile the schedule"
        ))
    })?;
    Ok(st.pick(entry!("add_forward")))
}

/// `acc += grad` in place, from inputs `acc`, `grad`: `add_forward` with its output on its first
/// input (the kernel allows it; each element is read before it is written, by the same
/// thread), so a bf16 accumulator is summed in f32 and rounded once per micro-batch, as the host
/// backend does.
fn accumulate(p: &mut Plan<'_>) -> Result<()> {
    if p.ty_in(0) != p.ty_in(1) {
        return Err(
            p.bad("sums a gradient into an accumulator of another type; both must be the same")
        );
    }
    let st = p.storage(0)?;
    let n = p.ty_in(0).numel();
    let args = vec![
        Ptr(p.input(0)),
        Ptr(p.input(0)),
        Ptr(p.input(1)),
        I64(n as i64),
    ];
    p.stride(st.pick(entry!("add_forward")), n, args);
    Ok(())
}

/// `dx = dy * f'(x)` from inputs `x`, `dy`.
fn unary_backward(p: &mut Plan<'_>, entries: Entries) -> Result<()> {
    let st = p.storage(0)?;
    let n = p.ty_in(0).numel();
    let args = vec![
        Ptr(p.output(0)),
        Ptr(p.input(1)),
        Ptr(p.input(0)),
        I64(n as i64),
    ];
    p.stride(st.pick(entries), n, args);
    Ok(())
}

/// RoPE forward, or its transpose for the backward, of input 0 `[B, T, heads * head_dim]`:
/// of whole heads, or with `part = (rotary_dim, rotated heads)` of the first `rotary_dim`
/// elements of the first heads (the rest copied), cos and sin scaled by the scaling's attention
/// factor.
fn rope(
    p: &mut Plan<'_>,
    head_dim: u64,
    part: Option<(u64, u64)>,
    theta: f64,
    scaling: &protrain_ir::RopeScaling,
    backward: bool,
) -> Result<()> {
    let st = p.storage(0)?;
    let x = p.ty_in(0).clone();
    if x.shape.len() != 3 || head_dim == 0 || !x.last_dim().is_multiple_of(head_dim) {
        return Err(p.bad(format!("{x} is not [B, T, heads * {head_dim}]")));
    }
    let heads = x.last_dim() / head_dim;
    // The type rules hold the rotated width even and within the head, the heads within x's.
    let (rotary_dim, rotated) = part.unwrap_or((head_dim, heads));
    let table = kernels::rope_inv_freq(rotary_dim as usize, theta, scaling);
    let inv = ConstKey::InvFreq(table.iter().map(|x| x.to_bits()).collect());
    let entry = match backward {
        false => st.pick(entry!("rope_forward")),
        true => st.pick(entry!("rope_backward")),
    };
    let args = vec![
        Ptr(p.output(0)),
        Ptr(p.input(0)),
        Arg::Table(inv),
        I32(p.int(x.shape[0], "batch")?),
        I32(p.int(x.shape[1], "sequence")?),
        I32(p.int(heads, "heads")?),
        I32(p.int(head_dim, "head_dim")?),
        I32(p.int(rotary_dim, "rotary_dim")?),
        I32(p.int(rotated, "rotated heads")?),
        F32(scaling.attention_factor() as f32),
    ];
    // One thread per rotation pair or copied element: `head_dim - rotary_dim / 2` per head.
    let units = x.numel() / head_dim * (head_dim - rotary_dim / 2);
    p.stride(entry, units, args);
    Ok(())
}

/// Phi-3's SwiGLU over packed `[gate | up]` rows of input 0 `[.., 2 width]`: forward to
/// `[.., width]`, or backward from `x`, `dy` to `dx [.., 2 width]`.
fn packed_swiglu(p: &mut Plan<'_>, backward: bool) -> Result<()> {
    let st = p.storage(0)?;
    let x = p.ty_in(0);
    if x.shape.is_empty() || !x.last_dim().is_multiple_of(2) || x.last_dim() == 0 {
        return Err(p.bad(format!("{x} is not [.., 2 * width]")));
    }
    let width = x.last_dim() / 2;
    let n = x.numel() / 2;
    let width = I32(p.int(width, "width")?);
    let (entry, args) = match backward {
        false => (
            st.pick(entry!("packed_swiglu_forward")),
            vec![Ptr(p.output(0)), Ptr(p.input(0)), width, I64(n as i64)],
        ),
        true => (
            st.pick(entry!("packed_swiglu_backward")),
            vec![
                Ptr(p.output(0)),
                Ptr(p.input(1)),
                Ptr(p.input(0)),
                width,
                I64(n as i64),
            ],
        ),
    };
    p.stride(entry, n, args);
    Ok(())
}

/// The rows and columns an RMS norm's kernels see: the input's rows and last dimension, or
/// with `head_dim` each group of `head_dim` elements of a row as a row of its own.
fn rms_norm_groups(x: &TensorType, head_dim: Option<u64>) -> (u64, u64) {
    let (rows, cols) = (x.rows(), x.last_dim());
    (
        protrain_ir::norm_rows(rows, cols, head_dim),
        head_dim.unwrap_or(cols),
    )
}

/// Layer norm's (`layer`) or RMS norm's backward from inputs `x`, `weight`, `dy`: recompute
/// the forward statistics into the planned workspace (the normalised rows the forward kernel
/// also writes land in `dx`, which the last kernel overwrites), sum the weight (and bias)
/// gradients over rows, then write `dx`.
fn norm_backward(p: &mut Plan<'_>, eps: f64, rms: Option<(Option<u64>, bool)>) -> Result<()> {
    let st = p.storage(0)?;
    let wst = p.storage(1)?;
    let eps = eps as f32;
    let layer = rms.is_none();
    let (head_dim, unit_offset) = rms.unwrap_or((None, false));
    let unit_offset = I32(i32::from(unit_offset));
    let (rows, c) = rms_norm_groups(p.ty_in(0), head_dim);
    let (rows_i, c_i) = (p.int(rows, "rows")?, p.int(c, "channels")?);
    let (x, w, dy) = (p.input(0), p.input(1), p.input(2));
    let (dx, dw) = (p.output(0), p.output(1));
    let chunks = column_sum_chunks(rows as usize) as u64;
    let rstd = p.workspace(Scratch::Rstd)?;
    let pw = p.workspace(Scratch::WeightPartials)?;
    let (mean, pb) = match layer {
        true => (
            p.workspace(Scratch::Mean)?,
            p.workspace(Scratch::BiasPartials)?,
        ),
        false => (0, 0),
    };
    // 1. The forward statistics (and throwaway normalised rows in dx).
    match layer {
        true => p.rows(
            st.pick(entry!("layer_norm_forward")),
            rows,
            vec![
                Ptr(dx),
                Ptr(mean),
                Ptr(rstd),
                Ptr(x),
                Ptr(w),
                Ptr(0),
                I32(rows_i),
                I32(c_i),
                F32(eps),
            ],
        ),
        false => p.rows(
            st.pick(entry!("rms_norm_forward")),
            rows,
            vec![
                Ptr(dx),
                Ptr(rstd),
                Ptr(x),
                Ptr(w),
                I32(rows_i),
                I32(c_i),
                F32(eps),
                unit_offset.clone(),
            ],
        ),
    }
    // 2. Per-chunk partial sums of dy * n (and dy), then their sums in chunk order. Each
    // thread sums a part of 16 bytes of columns (`st.vector_width()` elements), so a block
    // covers that many times 32 columns.
    let grid = (
        c.div_ceil(u64::from(COLUMN_SUM_BLOCK.0) * st.vector_width()) as u32,
        p.grid_yz(chunks, "row chunks")?,
        1,
    );
    p.shaped(
        st.pick(entry!("norm_backward_params_partial")),
        grid,
        (COLUMN_SUM_BLOCK.0, COLUMN_SUM_BLOCK.1, 1),
        vec![
            Ptr(pw),
            Ptr(pb),
            Ptr(dy),
            Ptr(x),
            Ptr(mean),
            Ptr(rstd),
            I32(rows_i),
            I32(c_i),
            I32(COLUMN_SUM_ROWS_PER_CHUNK as i32),
        ],
    );
    let finish = wst.pick(entry!("column_sum_finish"));
    let mut sums = vec![(dw, pw)];
    if layer {
        sums.push((p.output(2), pb));
    }
    for (dst, part) in sums {
        p.stride(
            finish,
            c,
            vec![Ptr(dst), Ptr(part), I32(chunks as i32), I32(c_i), I32(0)],
        );
    }
    // 3. dx.
    match layer {
        true => p.rows(
            st.pick(entry!("layer_norm_backward")),
            rows,
            vec![
                Ptr(dx),
                Ptr(dy),
                Ptr(x),
                Ptr(w),
                Ptr(mean),
                Ptr(rstd),
                I32(rows_i),
                I32(c_i),
            ],
        ),
        false => p.rows(
            st.pick(entry!("rms_norm_backward")),
            rows,
            vec![
                Ptr(dx),
                Ptr(dy),
                Ptr(x),
                Ptr(w),
                Ptr(rstd),
                I32(rows_i),
                I32(c_i),
                unit_offset,
            ],
        ),
    }
    Ok(())
}

/// Threads of `moe_route_pack`'s one block (`MOE_PACK_THREADS` in `kernels/moe.cu`), and the
/// most experts it packs.
const MOE_PACK_THREADS: u32 = 256;

/// Rows and columns of a grouped-matmul tile (`MOE_TILE` in `kernels/moe.cu`); its kernels run
/// `MOE_TILE x MOE_TILE` threads.
const MOE_TILE: u64 = 16;

/// Top-k routing (`backward`: its gradient) of `logits [B,T,E]`. The forward is two launches:
/// the per-token softmax and top-k, then `moe_route_pack`, which computes the packed layout
/// (rows, slots, group offsets) on the device, so the step never waits for the routing.
fn moe_route(
    p: &mut Plan<'_>,
    experts: u64,
    top_k: u64,
    normalize: bool,
    backward: bool,
) -> Result<()> {
    let st = p.storage(0)?;
    if experts > u64::from(MOE_PACK_THREADS) {
        return Err(p.bad(format!(
            "{experts} experts: the CUDA routing kernel packs at most {MOE_PACK_THREADS}"
        )));
    }
    let tokens = p.ty_in(0).rows();
    let (n, e, k) = (
        p.int(tokens, "tokens")?,
        p.int(experts, "experts")?,
        p.int(top_k, "top_k")?,
    );
    let slots = p.int(tokens * top_k, "packed rows")?;
    let norm = I32(i32::from(normalize));
    if backward {
        let args = vec![
            Ptr(p.output(0)),
            Ptr(p.input(2)),
            Ptr(p.input(0)),
            Ptr(p.input(1)),
            I32(n),
            I32(e),
            I32(k),
            norm,
        ];
        p.stride(st.pick(entry!("moe_route_backward")), tokens, args);
        return Ok(());
    }
    let args = vec![
        Ptr(p.output(0)),
        Ptr(p.output(1)),
        Ptr(p.input(0)),
        I32(n),
        I32(e),
        I32(k),
        norm,
    ];
    p.stride(st.pick(entry!("moe_route_softmax")), tokens, args);
    let args = vec![
        Ptr(p.output(2)),
        Ptr(p.output(3)),
        Ptr(p.output(4)),
        Ptr(p.output(1)),
        I32(slots),
        I32(e),
    ];
    p.shaped("moe_route_pack", (1, 1, 1), (MOE_PACK_THREADS, 1, 1), args);
    Ok(())
}

/// Threads of the load-balancing loss's one-block kernels (`MOE_AUX_THREADS` in
/// `kernels/moe.cu`): one per partial sum of the host kernel's order, and the most experts.
const MOE_AUX_THREADS: u32 = crate::kernels::moe::AUX_PARTIALS as u32;

/// The shape the load-balancing loss's kernels take: tokens per layer and the checked
/// integers, refusing more experts than their one block has threads.
fn moe_aux_shape(
    p: &Plan<'_>,
    logits: u64,
    experts: u64,
    top_k: u64,
    layers: u64,
) -> Result<[i32; 4]> {
    if experts > u64::from(MOE_AUX_THREADS) {
        return Err(p.bad(format!(
            "{experts} experts: the CUDA load-balancing loss kernels take at most \
             {MOE_AUX_THREADS}"
        )));
    }
    Ok([
        p.int(layers, "sparse layers")?,
        p.int(p.ty_in(logits as usize).rows(), "tokens")?,
        p.int(experts, "experts")?,
        p.int(top_k, "top_k")?,
    ])
}

/// The load-balancing loss (input 0 the cross-entropy loss, then each sparse layer's router
/// logits): one block that counts and sums every layer's rows in the host kernel's order and
/// writes `loss + coef * aux`.
fn moe_aux_loss(p: &mut Plan<'_>, experts: u64, top_k: u64, layers: u64, coef: f64) -> Result<()> {
    let st = p.storage(1)?;
    let [l, n, e, k] = moe_aux_shape(p, 1, experts, top_k, layers)?;
    let logits: Vec<u64> = (1..=layers as usize).map(|i| p.input(i)).collect();
    let args = vec![
        Ptr(p.output(0)),
        Ptr(p.input(0)),
        Arg::Table(ConstKey::Pointers(logits)),
        I32(l),
        I32(n),
        I32(e),
        I32(k),
        I64(coef.to_bits() as i64),
    ];
    p.shaped(
        st.pick(entry!("moe_aux_loss")),
        (1, 1, 1),
        (MOE_AUX_THREADS, 1, 1),
        args,
    );
    Ok(())
}

/// The load-balancing loss's gradient with respect to each layer's router logits: one block
/// computes each expert's coefficient from the counts (into the workspace), then one thread
/// per row of every layer takes it back through the row's softmax. The seed is the host
/// kernel's (`1 / K`, times the loss scale).
fn moe_aux_loss_backward(
    p: &mut Plan<'_>,
    experts: u64,
    top_k: u64,
    layers: u64,
    coef: f64,
) -> Result<()> {
    let st = p.storage(0)?;
    let [l, n, e, k] = moe_aux_shape(p, 0, experts, top_k, layers)?;
    let seed = crate::dispatch::loss_seed(p.kind).expect("a load-balancing loss backward kind");
    let rows = (layers * p.ty_in(0).rows()) as f64;
    // The host kernel's coefficient, in its order of operations.
    let scale = f64::from(seed) * coef * experts as f64 / (rows * rows);
    let grads = p.workspace(Scratch::AuxGrads)?;
    let logits: Vec<u64> = (0..layers as usize).map(|i| p.input(i)).collect();
    let dlogits: Vec<u64> = (0..layers as usize).map(|i| p.output(i)).collect();
    let args = vec![
        Ptr(grads),
        Arg::Table(ConstKey::Pointers(logits.clone())),
        I32(l),
        I32(n),
        I32(e),
        I32(k),
        I64(scale.to_bits() as i64),
    ];
    p.shaped(
        st.pick(entry!("moe_aux_grads")),
        (1, 1, 1),
        (MOE_AUX_THREADS, 1, 1),
        args,
    );
    let args = vec![
        Arg::Table(ConstKey::Pointers(dlogits)),
        Arg::Table(ConstKey::Pointers(logits)),
        Ptr(grads),
        I32(l),
        I32(n),
        I32(e),
    ];
    p.stride(
        st.pick(entry!("moe_aux_loss_backward")),
        layers * p.ty_in(0).rows(),
        args,
    );
    Ok(())
}

/// The grouped matmul over the packed rows (`backward`: its input and weight gradients). The
/// kernels read the group boundaries from the route's `offsets` on the device; the weights
/// (and the weight gradients) are passed as a table of the experts' addresses. A row-tile grid
/// of `ceil(R / MOE_TILE) + E` blocks covers every group whatever the boundaries (each group
/// adds at most one partial tile).
fn grouped_linear(p: &mut Plan<'_>, experts: u64, backward: bool) -> Result<()> {
    let st = p.storage(0)?;
    let e = experts as usize;
    let xs = p.ty_in(0).clone();
    if let Some(w) = (2..2 + e).map(|i| p.ty_in(i)).find(|w| w.dtype != xs.dtype) {
        return Err(p.bad(format!(
            "the packed input {xs} and the expert weight {w} differ in type"
        )));
    }
    let (rows, d_in) = (xs.rows(), xs.last_dim());
    let d_out = p.ty_in(2).shape[0];
    let (e_i, in_i, out_i) = (
        p.int(experts, "experts")?,
        p.int(d_in, "input features")?,
        p.int(d_out, "output features")?,
    );
    let row_tiles = rows.div_ceil(MOE_TILE) + experts;
    let row_tiles = u32::try_from(row_tiles).map_err(|_| p.bad("packed rows beyond 32 bits"))?;
    let weights = Arg::Table(ConstKey::Pointers((2..2 + e).map(|i| p.input(i)).collect()));
    let block = (MOE_TILE as u32, MOE_TILE as u32, 1);
    let (xs_at, offsets) = (p.input(0), p.input(1));
    if !backward {
        let grid = (
            row_tiles,
            p.grid_yz(d_out.div_ceil(MOE_TILE), "output tiles")?,
            1,
        );
        let args = vec![
            Ptr(p.output(0)),
            Ptr(xs_at),
            Ptr(offsets),
            weights,
            I32(e_i),
            I32(in_i),
            I32(out_i),
        ];
        p.shaped(st.pick(entry!("grouped_linear_forward")), grid, block, args);
        return Ok(());
    }
    let dys = p.input(2 + e);
    if p.ty_in(2 + e).dtype != xs.dtype {
        return Err(p.bad(format!(
            "the output gradient {} and the packed input {xs} differ in type",
            p.ty_in(2 + e)
        )));
    }
    let grid = (
        row_tiles,
        p.grid_yz(d_in.div_ceil(MOE_TILE), "input tiles")?,
        1,
    );
    let args = vec![
        Ptr(p.output(0)),
        Ptr(dys),
        Ptr(offsets),
        weights,
        I32(e_i),
        I32(in_i),
        I32(out_i),
    ];
    p.shaped(
        st.pick(entry!("grouped_linear_backward_dx")),
        grid,
        block,
        args,
    );
    let dweights = Arg::Table(ConstKey::Pointers((1..=e).map(|i| p.output(i)).collect()));
    let grid = (
        u32::try_from(d_in.div_ceil(MOE_TILE)).map_err(|_| p.bad("input tiles beyond 32 bits"))?,
        p.grid_yz(d_out.div_ceil(MOE_TILE), "output tiles")?,
        p.grid_yz(experts, "experts")?,
    );
    let args = vec![
        dweights,
        Ptr(dys),
        Ptr(xs_at),
        Ptr(offsets),
        I32(in_i),
        I32(out_i),
    ];
    p.shaped(
        st.pick(entry!("grouped_linear_backward_dw")),
        grid,
        block,
        args,
    );
    Ok(())
}

/// Attention's backward: `delta` into the workspace, then dq, then dk and dv.
fn attention_backward(
    p: &mut Plan<'_>,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    window: Option<u64>,
    qkv: QkvLayout,
    (scale, softcap): (Option<f64>, Option<f64>),
) -> Result<()> {
    let st = p.storage(0)?;
    // Inputs: q, k, v (or qkv), then out, lse, dout.
    let first = match qkv {
        QkvLayout::Separate => 3,
        QkvLayout::Packed => 1,
    };
    let out_ty = p.ty_in(first).clone();
    let dims = AttnDims::new(p, &out_ty, heads, kv_heads, head_dim, window, qkv, st)?
        .scored(scale, softcap);
    let (out, lse, dout) = (p.input(first), p.input(first + 1), p.input(first + 2));
    let ((q, k, v), (dq, dk, dv)) = match dims.packed {
        Some((k_off, v_off)) => {
            let (qkv, dqkv) = (p.input(0), p.output(0));
            (
                (qkv, qkv + k_off, qkv + v_off),
                (dqkv, dqkv + k_off, dqkv + v_off),
            )
        }
        None => (
            (p.input(0), p.input(1), p.input(2)),
            (p.output(0), p.output(1), p.output(2)),
        ),
    };
    let rows = u64::from(dims.b as u32) * u64::from(dims.t as u32) * u64::from(dims.h as u32);
    let delta = p.workspace(Scratch::Delta)?;
    // One warp per (b, t, h) row.
    let warps_per_block = u64::from(BLOCK / 32);
    let grid = (
        rows.div_ceil(warps_per_block)
            .clamp(1, u64::from(p.target.max_blocks)) as u32,
        1,
        1,
    );
    p.shaped(
        st.pick(entry!("attention_backward_delta")),
        grid,
        (BLOCK, 1, 1),
        vec![
            Ptr(delta),
            Ptr(out),
            Ptr(dout),
            I32(dims.b),
            I32(dims.t),
            I32(dims.h),
            I32(dims.d),
        ],
    );
    if let (Some(dq_entry), Some(dkv_entry)) = (
        flash_entry(p, st, head_dim, FLASH_BACKWARD_DQ),
        flash_entry(p, st, head_dim, FLASH_BACKWARD_DKV),
    ) {
        let mut args = vec![
            Ptr(dq),
            Ptr(dout),
            Ptr(q),
            Ptr(k),
            Ptr(v),
            Ptr(lse),
            Ptr(delta),
        ];
        args.extend(dims.flash_args());
        let grid = dims.flash_grid(p, dims.h)?;
        p.shaped(dq_entry, grid, (ATTN_FLASH_THREADS, 1, 1), args);
        let mut args = vec![
            Ptr(dk),
            Ptr(dv),
            Ptr(dout),
            Ptr(q),
            Ptr(k),
            Ptr(v),
            Ptr(lse),
            Ptr(delta),
        ];
        args.extend(dims.flash_args());
        let grid = dims.flash_grid(p, dims.kv)?;
        p.shaped(dkv_entry, grid, (ATTN_FLASH_THREADS, 1, 1), args);
        return Ok(());
    }
    let scores = p.workspace(Scratch::Scores)?;
    let dprobs = p.workspace(Scratch::ScoreGrads)?;
    for hb in dims.head_batches() {
        let g = AttnGemms::new(&dims, st, hb, scores, dprobs);
        p.batched(
            st,
            DType::F32,
            g.scores(q, k),
            "attention backward scores (Q K^T)",
        );
        p.batched(
            st,
            DType::F32,
            g.dprobs(v, dout),
            "attention backward dP (dO V^T)",
        );
        p.shaped(
            st.pick(entry!("attention_backward_ds")),
            g.row_grid(p)?,
            (BLOCK, 1, 1),
            vec![
                Ptr(scores),
                Ptr(dprobs),
                Ptr(lse),
                Ptr(delta),
                I64(g.lse_row0 as i64),
                I32(dims.t),
                I32(dims.window),
                I32(g.lse_head_stride()?),
                F32(dims.scale),
                F32(dims.softcap),
            ],
        );
        p.batched(
            st,
            st.dtype(),
            g.dv(dout, dv),
            "attention backward dV (P^T dO)",
        );
        p.batched(st, st.dtype(), g.dq(k, dq), "attention backward dQ (dS K)");
        p.batched(
            st,
            st.dtype(),
            g.dk(q, dk),
            "attention backward dK (dS^T Q)",
        );
    }
    Ok(())
}

/// Checks that every floating-point input of a fused linear op has input 0's dtype, and
/// returns it with its storage.
fn same_dtype(p: &Plan<'_>, inputs: usize) -> Result<(DType, Storage)> {
    let st = p.storage(0)?;
    let dtype = p.ty_in(0).dtype;
    if let Some(i) = (1..inputs).find(|&i| p.ty_in(i).dtype != dtype) {
        return Err(p.bad(format!(
            "input {i} is {} but x is {}; the operands must share one dtype",
            p.ty_in(i),
            p.ty_in(0)
        )));
    }
    Ok((dtype, st))
}

/// The shape of projection `i` of a fused linear op.
fn projection_dims(p: &Plan<'_>, i: usize) -> LinearDims {
    let (rows, d_in) = (p.ty_in(0).rows(), p.ty_in(0).last_dim());
    let d_out = p.ty_in(1 + i).numel() / d_in.max(1);
    LinearDims {
        rows: rows as usize,
        d_in: d_in as usize,
        d_out: d_out as usize,
    }
}

/// Projection `i` of a fused linear op into `y`, as `linear` runs it: the matmul, with the
/// bias in its epilogue, and what `fused` adds there.
#[allow(clippy::too_many_arguments)]
fn fused_projection(
    p: &mut Plan<'_>,
    dtype: DType,
    layout: WeightLayout,
    n: usize,
    bias: bool,
    i: usize,
    y: u64,
    fused: Fused,
) {
    let d = projection_dims(p, i);
    let (x, w) = (p.input(0), p.input(1 + i));
    match (bias, fused) {
        (false, Fused::Plain) => p.linear_forward(dtype, layout, d, x, w, y),
        _ => {
            let b = bias.then(|| p.input(1 + n + i));
            p.linear_matmul(dtype, layout, d, (x, w, y), b, fused)
        }
    }
}

/// A fused linear op: each projection as one cuBLASLt matmul with the bias, the GELU (its
/// input kept) or the residual in its epilogue; ReLU and SwiGLU, and a GELU whose input
/// cuBLASLt cannot keep ([`gelu_fusable`]), then run the elementwise kernel of their own kind.
fn fused_linear(
    p: &mut Plan<'_>,
    n: usize,
    bias: bool,
    layout: WeightLayout,
    epilogue: Epilogue,
) -> Result<()> {
    let n_in = p.types.inputs.len();
    let (dtype, st) = same_dtype(p, n_in)?;
    match epilogue {
        Epilogue::None => {
            for i in 0..n {
                let y = p.output(i);
                fused_projection(p, dtype, layout, n, bias, i, y, Fused::Plain);
            }
        }
        Epilogue::Gelu if gelu_fusable(projection_dims(p, 0).d_out) => {
            let (h, y) = (p.output(0), p.output(1));
            fused_projection(p, dtype, layout, n, bias, 0, y, Fused::Gelu(h));
        }
        Epilogue::Gelu | Epilogue::Relu => {
            let (h, y) = (p.output(0), p.output(1));
            fused_projection(p, dtype, layout, n, bias, 0, h, Fused::Plain);
            let entry = match epilogue {
                Epilogue::Gelu => st.pick(entry!("gelu_forward")),
                _ => st.pick(entry!("relu_forward")),
            };
            let len = p.ty_out(0).numel();
            p.stride(entry, len, vec![Ptr(y), Ptr(h), I64(len as i64)]);
        }
        Epilogue::Swiglu => {
            let (gate, up, y) = (p.output(0), p.output(1), p.output(2));
            fused_projection(p, dtype, layout, n, bias, 0, gate, Fused::Plain);
            fused_projection(p, dtype, layout, n, bias, 1, up, Fused::Plain);
            let len = p.ty_out(2).numel();
            p.stride(
                st.pick(entry!("swiglu_forward")),
                len,
                vec![Ptr(y), Ptr(gate), Ptr(up), I64(len as i64)],
            );
        }
        Epilogue::Residual => {
            let (y, residual) = (p.output(0), p.input(n_in - 1));
            fused_projection(p, dtype, layout, n, bias, 0, y, Fused::Residual(residual));
        }
    }
    Ok(())
}

/// The backward of a fused linear op, in the planned workspace laid out as
/// [`WorkspaceLayout`] says: the epilogue's gradients, then each projection's matmul (and bias
/// column sum), last first, the input gradient summed in that order.
fn fused_linear_backward(
    p: &mut Plan<'_>,
    n: usize,
    bias: bool,
    layout: WeightLayout,
    epilogue: Epilogue,
) -> Result<()> {
    let n_in = p.types.inputs.len();
    let (dtype, st) = same_dtype(p, n_in)?;
    let (rows, d_in) = (p.ty_in(0).rows(), p.ty_in(0).last_dim());
    let kept = epilogue.has_output() && epilogue.keeps_projections();
    let contribution = match n >= 2 {
        true => p.workspace(Scratch::Contribution)?,
        false => 0,
    };
    let partials = match bias {
        true => p.workspace(Scratch::BiasPartials)?,
        false => 0,
    };
    let dy_index = 1 + n + if kept { n } else { 0 };
    // The gradient of each projection's result.
    let mut grads: Vec<u64> = Vec::with_capacity(n);
    match epilogue {
        Epilogue::None => grads.extend((0..n).map(|i| p.input(1 + n + i))),
        Epilogue::Residual => grads.push(p.input(dy_index)),
        Epilogue::Gelu | Epilogue::Relu => {
            let (h, dy) = (p.input(1 + n), p.input(dy_index));
            let dh = p.workspace(Scratch::ProjectionGrad(0))?;
            let len = p.ty_in(1 + n).numel();
            let entry = match epilogue {
                Epilogue::Gelu => st.pick(entry!("gelu_backward")),
                _ => st.pick(entry!("relu_backward")),
            };
            p.stride(entry, len, vec![Ptr(dh), Ptr(dy), Ptr(h), I64(len as i64)]);
            grads.push(dh);
        }
        Epilogue::Swiglu => {
            let (gate, up, dy) = (p.input(1 + n), p.input(2 + n), p.input(dy_index));
            let dgate = p.workspace(Scratch::ProjectionGrad(0))?;
            let dup = p.workspace(Scratch::ProjectionGrad(1))?;
            let len = p.ty_in(1 + n).numel();
            p.stride(
                st.pick(entry!("swiglu_backward")),
                len,
                vec![
                    Ptr(dgate),
                    Ptr(dup),
                    Ptr(dy),
                    Ptr(gate),
                    Ptr(up),
                    I64(len as i64),
                ],
            );
            grads.extend([dgate, dup]);
        }
    }
    let (x, dx) = (p.input(0), p.output(0));
    for i in (0..n).rev() {
        let d_out = p.ty_in(1 + i).numel() / d_in.max(1);
        let d = LinearDims {
            rows: rows as usize,
            d_in: d_in as usize,
            d_out: d_out as usize,
        };
        let target = if i == n - 1 { dx } else { contribution };
        let (w, dw) = (p.input(1 + i), p.output(1 + i));
        p.linear_backward(dtype, layout, d, x, w, grads[i], target, dw);
        if bias {
            let db = p.output(1 + n + i);
            p.column_sum(st, db, grads[i], rows, d_out, partials)?;
        }
        if i != n - 1 {
            let len = p.ty_in(0).numel();
            p.stride(
                st.pick(entry!("add_forward")),
                len,
                vec![Ptr(dx), Ptr(dx), Ptr(contribution), I64(len as i64)],
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! Every op kind's plan against the kernel sources: each entry point exists, each argument
    //! list has the arity and the argument kinds of the kernel's declaration, every pointer
    //! lies inside an operand, the workspace or the master weight, and every workspace
    //! pointer is 16-byte aligned. Shapes have odd row counts (3 rows) so that a layout packed
    //! end to end would misalign the f32 parts behind bf16 ones.

    use super::*;
    use crate::cuda::blas::model::{gemm_batched, Bytes};
    use crate::cuda::driver::signatures;
    use crate::cuda::source_of;
    use protrain_ir::{RopeScaling, WORKSPACE_ALIGN};

    const B: u64 = 1;
    const T: u64 = 3;
    const C: u64 = 8;
    const V: u64 = 11;
    const H: u64 = 2;
    const KV: u64 = 1;
    const D: u64 = 4;
    /// Experts, and experts per token, of the mixture-of-experts examples.
    const E: u64 = 3;
    const K: u64 = 2;
    const WS: u64 = 0x7000_0000;
    const MASTER: u64 = 0x7800_0000;

    /// Which variant `kind` is, without a wildcard: a kind added to the IR fails to compile
    /// here until the examples below cover it.
    fn variant(kind: &OpKind) -> usize {
        match kind {
            OpKind::Embedding { .. } => 0,
            OpKind::PositionEmbedding { .. } => 1,
            OpKind::LayerNorm { .. } => 2,
            OpKind::RmsNorm { .. } => 3,
            OpKind::Linear { .. } => 4,
            OpKind::Gelu => 5,
            OpKind::Relu => 6,
            OpKind::Silu => 7,
            OpKind::Swiglu => 8,
            OpKind::Add => 9,
            OpKind::Rope { .. } => 10,
            OpKind::Attention { .. } => 11,
            OpKind::CrossEntropy => 12,
            OpKind::FusedLinear { .. } => 13,
            OpKind::EmbeddingBackward { .. } => 14,
            OpKind::PositionEmbeddingBackward { .. } => 15,
            OpKind::LayerNormBackward { .. } => 16,
            OpKind::RmsNormBackward { .. } => 17,
            OpKind::LinearBackward { .. } => 18,
            OpKind::GeluBackward => 19,
            OpKind::ReluBackward => 20,
            OpKind::SiluBackward => 21,
            OpKind::SwigluBackward => 22,
            OpKind::RopeBackward { .. } => 23,
            OpKind::AttentionBackward { .. } => 24,
            OpKind::CrossEntropyBackward => 25,
            OpKind::FusedLinearBackward { .. } => 26,
            OpKind::GradNormSq => 27,
            OpKind::ClipCoef { .. } => 28,
            OpKind::AdamW { .. } => 29,
            // Movement never reaches a backend: see `movement_ops_have_no_plan`.
            OpKind::MoveStart(_) => VARIANTS,
            OpKind::MoveDone(_) => VARIANTS + 1,
            OpKind::Release { .. } => VARIANTS + 2,
            OpKind::CrossEntropyBackwardScaled { .. } => 30,
            OpKind::AccumulateGrad => 31,
            OpKind::CrossEntropyBackwardLossScaled { .. } => 32,
            OpKind::UnscaleCoef { .. } => 33,
            OpKind::Scale { .. } => 34,
            OpKind::Softcap { .. } => 35,
            OpKind::Geglu => 36,
            OpKind::SoftcapBackward { .. } => 37,
            OpKind::GegluBackward => 38,
            OpKind::MoeRoute { .. } => 39,
            OpKind::MoeDispatch { .. } => 40,
            OpKind::GroupedLinear { .. } => 41,
            OpKind::MoeCombine { .. } => 42,
            OpKind::MoeRouteBackward { .. } => 43,
            OpKind::MoeDispatchBackward { .. } => 44,
            OpKind::GroupedLinearBackward { .. } => 45,
            OpKind::MoeCombineBackward { .. } => 46,
            OpKind::PartialRope { .. } => 47,
            OpKind::PartialRopeBackward { .. } => 48,
            OpKind::PackedSwiglu => 49,
            OpKind::PackedSwigluBackward => 50,
            OpKind::MoeAuxLoss { .. } => 51,
            OpKind::MoeAuxLossBackward { .. } => 52,
        }
    }
    const VARIANTS: usize = 53;

    fn t(shape: &[u64], dtype: DType) -> TensorType {
        TensorType::new(shape.to_vec(), dtype)
    }

    /// Every kind (several forms of some) with input types in storage `dt`.
    fn examples(dt: DType) -> Vec<(OpKind, Vec<TensorType>)> {
        let f = |s: &[u64]| t(s, dt);
        let tokens = t(&[B, T], DType::I32);
        let x = f(&[B, T, C]);
        let vec_c = f(&[C]);
        let w = f(&[6, C]);
        let lse_attn = t(&[B, H, T], DType::F32);
        let logits = f(&[B, T, V]);
        let moments = t(&[6, C], DType::F32);
        let scalar = t(&[], DType::F32);
        let (q, kv) = (f(&[B, T, H * D]), f(&[B, T, KV * D]));
        let qkv = f(&[B, T, (H + 2 * KV) * D]);
        let attn = |qkv_layout, window| OpKind::Attention {
            heads: H,
            kv_heads: KV,
            head_dim: D,
            window,
            qkv: qkv_layout,
            scale: None,
            softcap: None,
        };
        let attn_bwd = |qkv_layout, window| OpKind::AttentionBackward {
            heads: H,
            kv_heads: KV,
            head_dim: D,
            window,
            qkv: qkv_layout,
            scale: None,
            softcap: None,
        };
        let rope = RopeScaling::None;
        let yarn = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 64,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attention_factor: 1.1386,
        };
        // Phi-3's: q's and k's heads of a packed qkv, half of each head, LongRoPE.
        let partial_rope = |backward| {
            let (head_dim, rotary_dim, heads, theta) = (D, D / 2, H + KV, 10000.0);
            let scaling = RopeScaling::LongRope {
                factors: vec![1.5],
                attention_factor: 1.25,
            };
            match backward {
                false => OpKind::PartialRope {
                    head_dim,
                    rotary_dim,
                    heads,
                    theta,
                    scaling,
                },
                true => OpKind::PartialRopeBackward {
                    head_dim,
                    rotary_dim,
                    heads,
                    theta,
                    scaling,
                },
            }
        };
        let fused = |count, bias, epilogue| OpKind::FusedLinear {
            count,
            bias,
            layout: WeightLayout::OutIn,
            epilogue,
        };
        let fused_bwd = |count, bias, epilogue| OpKind::FusedLinearBackward {
            count,
            bias,
            layout: WeightLayout::InOut,
            epilogue,
        };
        let w_in_out = f(&[C, 6]);
        let h = f(&[B, T, 6]);
        let b6 = f(&[6]);
        let route = |normalize| OpKind::MoeRoute {
            experts: E,
            top_k: K,
            normalize,
        };
        let routed_i32 = t(&[B, T, K], DType::I32);
        let routed_f32 = t(&[B, T, K], DType::F32);
        let packed_i32 = t(&[B * T * K], DType::I32);
        let mut grouped = vec![f(&[B * T * K, C]), t(&[E + 1], DType::I32)];
        grouped.extend((0..E).map(|_| w.clone()));
        let adamw = |clipped| OpKind::AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            clipped,
        };
        vec![
            (
                OpKind::Embedding { padding_idx: None },
                vec![tokens.clone(), f(&[V, C])],
            ),
            (
                OpKind::PositionEmbedding { offset: 2 },
                vec![tokens.clone(), f(&[16, C])],
            ),
            (
                OpKind::LayerNorm { eps: 1e-5 },
                vec![x.clone(), vec_c.clone(), vec_c.clone()],
            ),
            (
                OpKind::RmsNorm {
                    eps: 1e-6,
                    head_dim: None,
                    unit_offset: false,
                },
                vec![x.clone(), vec_c.clone()],
            ),
            (
                OpKind::RmsNorm {
                    eps: 1e-6,
                    head_dim: Some(2),
                    unit_offset: true,
                },
                vec![x.clone(), f(&[2])],
            ),
            (
                OpKind::Linear {
                    bias: true,
                    layout: WeightLayout::OutIn,
                },
                vec![x.clone(), w.clone(), b6.clone()],
            ),
            (
                OpKind::Linear {
                    bias: false,
                    layout: WeightLayout::InOut,
                },
                vec![x.clone(), w_in_out.clone()],
            ),
            (OpKind::Gelu, vec![x.clone()]),
            (OpKind::Relu, vec![x.clone()]),
            (OpKind::Silu, vec![x.clone()]),
            (OpKind::Swiglu, vec![x.clone(), x.clone()]),
            (OpKind::Geglu, vec![x.clone(), x.clone()]),
            (OpKind::Softcap { cap: 30.0 }, vec![x.clone()]),
            (OpKind::Scale { factor: 48.0 }, vec![x.clone()]),
            (
                OpKind::SoftcapBackward { cap: 30.0 },
                vec![x.clone(), x.clone()],
            ),
            (OpKind::GegluBackward, vec![x.clone(), x.clone(), x.clone()]),
            (
                OpKind::Attention {
                    heads: H,
                    kv_heads: KV,
                    head_dim: D,
                    window: Some(3),
                    qkv: QkvLayout::Separate,
                    scale: Some(0.1),
                    softcap: Some(50.0),
                },
                vec![q.clone(), kv.clone(), kv.clone()],
            ),
            (OpKind::Add, vec![x.clone(), x.clone()]),
            (
                OpKind::Rope {
                    head_dim: D,
                    theta: 10000.0,
                    scaling: rope,
                },
                vec![q.clone()],
            ),
            (
                OpKind::Rope {
                    head_dim: D,
                    theta: 10000.0,
                    scaling: yarn.clone(),
                },
                vec![q.clone()],
            ),
            (partial_rope(false), vec![qkv.clone()]),
            (partial_rope(true), vec![qkv.clone()]),
            (OpKind::PackedSwiglu, vec![f(&[B, T, 12])]),
            (
                OpKind::PackedSwigluBackward,
                vec![f(&[B, T, 12]), h.clone()],
            ),
            (
                attn(QkvLayout::Separate, None),
                vec![q.clone(), kv.clone(), kv.clone()],
            ),
            (attn(QkvLayout::Packed, Some(2)), vec![qkv.clone()]),
            (OpKind::CrossEntropy, vec![logits.clone(), tokens.clone()]),
            (
                fused(2, true, Epilogue::None),
                vec![x.clone(), w.clone(), w.clone(), b6.clone(), b6.clone()],
            ),
            (fused(1, false, Epilogue::Gelu), vec![x.clone(), w.clone()]),
            (
                fused(1, true, Epilogue::Relu),
                vec![x.clone(), w.clone(), b6.clone()],
            ),
            (
                fused(2, false, Epilogue::Swiglu),
                vec![x.clone(), w.clone(), w.clone()],
            ),
            (
                fused(1, true, Epilogue::Residual),
                vec![x.clone(), w.clone(), b6.clone(), h.clone()],
            ),
            (
                OpKind::EmbeddingBackward {
                    rows: V,
                    padding_idx: Some(0),
                },
                vec![tokens.clone(), x.clone()],
            ),
            (
                OpKind::PositionEmbeddingBackward {
                    rows: 16,
                    offset: 2,
                },
                vec![tokens.clone(), x.clone()],
            ),
            (
                OpKind::LayerNormBackward { eps: 1e-5 },
                vec![x.clone(), vec_c.clone(), x.clone()],
            ),
            (
                OpKind::RmsNormBackward {
                    eps: 1e-6,
                    head_dim: None,
                    unit_offset: false,
                },
                vec![x.clone(), vec_c.clone(), x.clone()],
            ),
            (
                OpKind::RmsNormBackward {
                    eps: 1e-6,
                    head_dim: Some(2),
                    unit_offset: true,
                },
                vec![x.clone(), f(&[2]), x.clone()],
            ),
            (
                OpKind::LinearBackward {
                    bias: true,
                    layout: WeightLayout::OutIn,
                },
                vec![x.clone(), w.clone(), h.clone()],
            ),
            (
                OpKind::LinearBackward {
                    bias: false,
                    layout: WeightLayout::InOut,
                },
                vec![x.clone(), w_in_out.clone(), h.clone()],
            ),
            (OpKind::GeluBackward, vec![x.clone(), x.clone()]),
            (OpKind::ReluBackward, vec![x.clone(), x.clone()]),
            (OpKind::SiluBackward, vec![x.clone(), x.clone()]),
            (
                OpKind::SwigluBackward,
                vec![x.clone(), x.clone(), x.clone()],
            ),
            (
                OpKind::RopeBackward {
                    head_dim: D,
                    theta: 10000.0,
                    scaling: RopeScaling::Linear { factor: 2.0 },
                },
                vec![q.clone()],
            ),
            (
                attn_bwd(QkvLayout::Separate, None),
                vec![
                    q.clone(),
                    kv.clone(),
                    kv.clone(),
                    q.clone(),
                    lse_attn.clone(),
                    q.clone(),
                ],
            ),
            (
                attn_bwd(QkvLayout::Packed, Some(2)),
                vec![qkv.clone(), q.clone(), lse_attn.clone(), q.clone()],
            ),
            (
                OpKind::CrossEntropyBackward,
                vec![logits.clone(), tokens.clone(), t(&[B, T], DType::F32)],
            ),
            (
                OpKind::CrossEntropyBackwardScaled { micro_batches: 4 },
                vec![logits.clone(), tokens.clone(), t(&[B, T], DType::F32)],
            ),
            (OpKind::AccumulateGrad, vec![x.clone(), x.clone()]),
            (
                fused_bwd(2, true, Epilogue::None),
                vec![
                    x.clone(),
                    w_in_out.clone(),
                    w_in_out.clone(),
                    h.clone(),
                    h.clone(),
                ],
            ),
            (
                fused_bwd(1, true, Epilogue::Gelu),
                vec![x.clone(), w_in_out.clone(), h.clone(), h.clone()],
            ),
            (
                fused_bwd(1, false, Epilogue::Relu),
                vec![x.clone(), w_in_out.clone(), h.clone(), h.clone()],
            ),
            (
                fused_bwd(2, true, Epilogue::Swiglu),
                vec![
                    x.clone(),
                    w_in_out.clone(),
                    w_in_out.clone(),
                    h.clone(),
                    h.clone(),
                    h.clone(),
                ],
            ),
            (
                fused_bwd(1, true, Epilogue::Residual),
                vec![x.clone(), w_in_out.clone(), h.clone()],
            ),
            (OpKind::GradNormSq, vec![w.clone()]),
            (
                OpKind::ClipCoef { max_norm: 1.0 },
                vec![scalar.clone(), scalar.clone(), scalar.clone()],
            ),
            (
                OpKind::CrossEntropyBackwardLossScaled {
                    micro_batches: 2,
                    loss_scale: 65536.0,
                },
                vec![logits.clone(), tokens.clone(), t(&[B, T], DType::F32)],
            ),
            (
                OpKind::UnscaleCoef {
                    max_norm: Some(1.0),
                    loss_scale: 65536.0,
                },
                vec![scalar.clone(), scalar.clone()],
            ),
            (
                OpKind::UnscaleCoef {
                    max_norm: None,
                    loss_scale: 1024.0,
                },
                vec![scalar.clone()],
            ),
            (
                adamw(false),
                vec![w.clone(), w.clone(), moments.clone(), moments.clone()],
            ),
            (route(true), vec![f(&[B, T, E])]),
            (
                OpKind::MoeRouteBackward {
                    experts: E,
                    top_k: K,
                    normalize: false,
                },
                vec![f(&[B, T, E]), routed_i32.clone(), routed_f32.clone()],
            ),
            (
                OpKind::MoeDispatch { top_k: K },
                vec![x.clone(), packed_i32.clone(), routed_i32.clone()],
            ),
            (
                OpKind::MoeDispatchBackward { top_k: K },
                vec![routed_i32.clone(), f(&[B * T * K, C])],
            ),
            (OpKind::GroupedLinear { experts: E }, grouped.clone()),
            (OpKind::GroupedLinearBackward { experts: E }, {
                let mut ins = grouped.clone();
                ins.push(f(&[B * T * K, 6]));
                ins
            }),
            (
                OpKind::MoeCombine { top_k: K },
                vec![f(&[B * T * K, C]), routed_f32.clone(), routed_i32.clone()],
            ),
            (
                OpKind::MoeCombineBackward { top_k: K },
                vec![
                    f(&[B * T * K, C]),
                    routed_f32.clone(),
                    routed_i32.clone(),
                    x.clone(),
                ],
            ),
            (
                OpKind::MoeAuxLoss {
                    experts: E,
                    top_k: K,
                    layers: 2,
                    coef: 0.01,
                },
                vec![scalar.clone(), f(&[B, T, E]), f(&[B, T, E])],
            ),
            (
                OpKind::MoeAuxLossBackward {
                    experts: E,
                    top_k: K,
                    layers: 2,
                    coef: 0.01,
                    micro_batches: 2,
                    loss_scale: None,
                },
                vec![f(&[B, T, E]), f(&[B, T, E])],
            ),
            (
                adamw(true),
                vec![
                    w.clone(),
                    w.clone(),
                    moments.clone(),
                    moments.clone(),
                    scalar.clone(),
                ],
            ),
        ]
    }

    /// The plan of `kind` on `inputs`, with every operand at its own address, and the spans
    /// `(start, bytes)` a pointer may fall in.
    fn plan_of(kind: &OpKind, inputs: &[TensorType]) -> (Vec<Call>, Vec<(u64, u64)>) {
        let ins: Vec<&TensorType> = inputs.iter().collect();
        let outputs = kind
            .infer(&ins)
            .unwrap_or_else(|e| panic!("{kind:?}: the example's types are wrong: {e}"));
        let outs: Vec<&TensorType> = outputs.iter().collect();
        let addr = |i: usize| 0x1000_0000 * (i as u64 + 1);
        let ws = kind.workspace_bytes(&ins);
        let at = Addresses {
            inputs: (0..ins.len()).map(addr).collect(),
            outputs: (0..outs.len()).map(|i| addr(ins.len() + i)).collect(),
            workspace: (ws > 0).then_some((WS, ws)),
            master: Some(MASTER),
            pitches: Pitches::DENSE,
        };
        let mut spans: Vec<(u64, u64)> = ins
            .iter()
            .chain(&outs)
            .enumerate()
            .map(|(i, t)| (addr(i), t.bytes()))
            .collect();
        spans.push((WS, ws));
        spans.push((MASTER, 4 * ins[0].numel()));
        let types = Types {
            inputs: &ins,
            outputs: &outs,
        };
        let target = Target {
            max_blocks: 132 * 32,
            step: 1,
            flash: true,
        };
        let calls =
            calls(kind, types, &at, target).unwrap_or_else(|e| panic!("{kind:?}: no plan: {e}"));
        (calls, spans)
    }

    fn inside(spans: &[(u64, u64)], p: u64) -> bool {
        spans.iter().any(|&(s, n)| p >= s && p < s + n.max(1))
    }

    /// What each plan issues, in order: `K` a kernel, `G` a cuBLAS GEMM, `B` a batched GEMM,
    /// and a cuBLASLt matmul by its epilogue (`M` none, `Mb` bias, `Mg` GELU, `Mgb` GELU and
    /// bias, `+r` with the residual).
    fn shape_of(plan: &[Call]) -> Vec<String> {
        use cudarc::cublaslt::sys::cublasLtEpilogue_t as E;
        plan.iter()
            .map(|c| match c {
                Call::Kernel(_) => "K".to_string(),
                Call::Gemm(_) => "G".to_string(),
                Call::Batched(_) => "B".to_string(),
                Call::Matmul(m) => {
                    let e = match m.mm.epilogue() {
                        E::CUBLASLT_EPILOGUE_DEFAULT => "M",
                        E::CUBLASLT_EPILOGUE_BIAS => "Mb",
                        E::CUBLASLT_EPILOGUE_GELU_AUX => "Mg",
                        E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS => "Mgb",
                        other => panic!("an epilogue the backend does not use: {other:?}"),
                    };
                    format!("{e}{}", if m.mm.residual.is_some() { "+r" } else { "" })
                }
            })
            .collect()
    }

    /// The fusions the compiler chose run as one cuBLASLt call each: a linear layer's bias,
    /// a fused linear's bias, bias + GELU and residual (+ bias) are one matmul with no kernel
    /// after it; ReLU and SwiGLU keep their kernel, and so does a GELU over output features
    /// that are not a multiple of 8 (cuBLASLt cannot keep its input).
    #[test]
    fn fused_linear_epilogues_are_one_library_call() {
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let f = |s: &[u64]| t(s, dt);
            let x = f(&[B, T, C]);
            let fused = |count, bias, epilogue| OpKind::FusedLinear {
                count,
                bias,
                layout: WeightLayout::OutIn,
                epilogue,
            };
            let (w16, w6) = (f(&[16, C]), f(&[6, C]));
            let (b16, b6) = (f(&[16]), f(&[6]));
            let cases: Vec<(OpKind, Vec<TensorType>, &[&str])> = vec![
                (
                    OpKind::Linear {
                        bias: true,
                        layout: WeightLayout::OutIn,
                    },
                    vec![x.clone(), w6.clone(), b6.clone()],
                    &["Mb"],
                ),
                (
                    OpKind::Linear {
                        bias: false,
                        layout: WeightLayout::OutIn,
                    },
                    vec![x.clone(), w6.clone()],
                    &["G"],
                ),
                (
                    fused(1, true, Epilogue::Gelu),
                    vec![x.clone(), w16.clone(), b16.clone()],
                    &["Mgb"],
                ),
                (
                    fused(1, false, Epilogue::Gelu),
                    vec![x.clone(), w16.clone()],
                    &["Mg"],
                ),
                (
                    fused(1, true, Epilogue::Gelu),
                    vec![x.clone(), w6.clone(), b6.clone()],
                    &["Mb", "K"],
                ),
                (
                    fused(1, true, Epilogue::Relu),
                    vec![x.clone(), w16.clone(), b16.clone()],
                    &["Mb", "K"],
                ),
                (
                    fused(1, true, Epilogue::Residual),
                    vec![x.clone(), f(&[C, C]), f(&[C]), x.clone()],
                    &["Mb+r"],
                ),
                (
                    fused(1, false, Epilogue::Residual),
                    vec![x.clone(), f(&[C, C]), x.clone()],
                    &["M+r"],
                ),
                (
                    fused(2, true, Epilogue::None),
                    vec![x.clone(), w6.clone(), w16.clone(), b6.clone(), b16.clone()],
                    &["Mb", "Mb"],
                ),
                (
                    fused(2, false, Epilogue::Swiglu),
                    vec![x.clone(), w16.clone(), w16.clone()],
                    &["G", "G", "K"],
                ),
            ];
            for (kind, inputs, want) in cases {
                let (plan, _) = plan_of(&kind, &inputs);
                assert_eq!(shape_of(&plan), want, "{kind:?} in {dt}");
            }
        }
    }

    /// The GELU's kept input is the fused op's first output (`h`), the GELU's result its
    /// second, and the residual the op's last input; the bias is the op's bias input.
    #[test]
    fn fused_matmul_operands_are_the_ops() {
        let x = t(&[B, T, C], DType::BF16);
        let kind = OpKind::FusedLinear {
            count: 1,
            bias: true,
            layout: WeightLayout::InOut,
            epilogue: Epilogue::Gelu,
        };
        let (plan, _) = plan_of(
            &kind,
            &[x.clone(), t(&[C, 16], DType::BF16), t(&[16], DType::BF16)],
        );
        let [Call::Matmul(m)] = plan.as_slice() else {
            panic!("{plan:?}")
        };
        let addr = |i: u64| 0x1000_0000 * (i + 1);
        assert_eq!(
            (m.mm.gemm.a, m.mm.gemm.b, m.mm.gemm.c),
            (addr(1), addr(0), addr(4))
        );
        assert_eq!(m.mm.bias, Some(addr(2)));
        assert_eq!(m.mm.gelu.map(|a| (a.at, a.ld)), Some((addr(3), 16)));
        assert_eq!(m.mm.residual, None);
        let res = OpKind::FusedLinear {
            count: 1,
            bias: false,
            layout: WeightLayout::OutIn,
            epilogue: Epilogue::Residual,
        };
        let (plan, _) = plan_of(&res, &[x.clone(), t(&[C, C], DType::BF16), x.clone()]);
        let [Call::Matmul(m)] = plan.as_slice() else {
            panic!("{plan:?}")
        };
        assert_eq!(
            (m.mm.residual, m.mm.bias, m.mm.gemm.c),
            (Some(addr(2)), None, addr(3))
        );
    }

    #[test]
    fn movement_ops_have_no_plan() {
        let x = TensorType::new(vec![4, 8], DType::F32);
        let ins = [&x];
        let chunk = protrain_ir::ChunkId(0);
        for kind in [
            OpKind::MoveStart(protrain_ir::Movement::Gather { chunk, slot: 0 }),
            OpKind::MoveDone(protrain_ir::Movement::Reload),
            OpKind::Release { chunk, slot: 0 },
        ] {
            assert!(variant(&kind) >= VARIANTS);
            let outputs = kind.infer(&ins).expect("movement types");
            let outs: Vec<&TensorType> = outputs.iter().collect();
            let at = Addresses {
                inputs: vec![0x1000],
                outputs: (0..outs.len()).map(|i| 0x2000 * (i as u64 + 1)).collect(),
                workspace: None,
                master: None,
                pitches: Pitches::DENSE,
            };
            let types = Types {
                inputs: &ins,
                outputs: &outs,
            };
            let target = Target {
                max_blocks: 132 * 32,
                step: 1,
                flash: true,
            };
            let err = calls(&kind, types, &at, target)
                .expect_err("no plan")
                .to_string();
            assert!(err.contains("movement op"), "{kind:?}: {err}");
        }
    }

    /// The routing packs on the device (one block of `MOE_PACK_THREADS` after the per-token
    /// kernel, writing rows, slots and offsets from the chosen experts); the grouped matmuls
    /// get the experts' weights (and weight gradients) as a table in expert order and a row-tile
    /// grid of `ceil(R / MOE_TILE) + E` blocks, enough for any split of the rows.
    #[test]
    fn moe_plans_pack_on_the_device_and_cover_every_group() {
        let addr = |i: usize| 0x1000_0000 * (i as u64 + 1);
        let route = OpKind::MoeRoute {
            experts: E,
            top_k: K,
            normalize: true,
        };
        let (plan, _) = plan_of(&route, &[t(&[B, T, E], DType::BF16)]);
        let [Call::Kernel(soft), Call::Kernel(pack)] = &plan[..] else {
            panic!("two kernels, not {plan:?}");
        };
        assert_eq!(soft.entry, "moe_route_softmax_bf16");
        assert_eq!(pack.entry, "moe_route_pack");
        assert_eq!((pack.grid, pack.block), ((1, 1, 1), (256, 1, 1)));
        // Outputs follow the one input: weights, experts, rows, slots, offsets.
        let (experts, rows, slots, offsets) = (addr(2), addr(3), addr(4), addr(5));
        assert_eq!(
            pack.args,
            [
                Ptr(rows),
                Ptr(slots),
                Ptr(offsets),
                Ptr(experts),
                I32((B * T * K) as i32),
                I32(E as i32),
            ]
        );
        // 40 packed rows: two full tiles and a partial one, plus one per expert.
        let rows = 40;
        let mut ins = vec![t(&[rows, C], DType::F32), t(&[E + 1], DType::I32)];
        ins.extend((0..E).map(|_| t(&[6, C], DType::F32)));
        let weights = ConstKey::Pointers((2..2 + E as usize).map(addr).collect());
        let (plan, _) = plan_of(&OpKind::GroupedLinear { experts: E }, &ins);
        let [Call::Kernel(fwd)] = &plan[..] else {
            panic!("one kernel, not {plan:?}");
        };
        assert_eq!(fwd.grid, (3 + E as u32, 1, 1));
        assert_eq!(fwd.args[3], Arg::Table(weights.clone()));
        ins.push(t(&[rows, 6], DType::F32));
        let (plan, _) = plan_of(&OpKind::GroupedLinearBackward { experts: E }, &ins);
        let [Call::Kernel(dx), Call::Kernel(dw)] = &plan[..] else {
            panic!("two kernels, not {plan:?}");
        };
        assert_eq!(dx.grid, (3 + E as u32, 1, 1));
        assert_eq!(dx.args[3], Arg::Table(weights));
        // dxs is the first output (after the 2 + E + 1 inputs), the weight gradients follow.
        let first_out = 3 + E as usize;
        assert_eq!(dx.args[0], Ptr(addr(first_out)));
        let dweights =
            ConstKey::Pointers((first_out + 1..=first_out + E as usize).map(addr).collect());
        assert_eq!(dw.args[0], Arg::Table(dweights));
        assert_eq!(dw.grid, (1, 1, E as u32));
    }

    /// The rope kernels' arguments after the table: batch, sequence, heads, head_dim, rotated
    /// width, rotated heads, attention factor; and one thread per rotation pair or copied
    /// element.
    #[test]
    fn rope_launches_pass_the_rotated_part_and_the_attention_factor() {
        let qkv = TensorType::new(vec![2, 3, 4 * 6], DType::F32);
        let longrope = RopeScaling::LongRope {
            factors: vec![1.5, 3.0],
            attention_factor: 1.25,
        };
        let yarn = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 64,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attention_factor: 1.1386,
        };
        let cases = [
            (
                OpKind::PartialRope {
                    head_dim: 6,
                    rotary_dim: 4,
                    heads: 3,
                    theta: 10000.0,
                    scaling: longrope.clone(),
                },
                "rope_forward_f32",
                [2, 3, 4, 6, 4, 3],
                1.25,
                2 * 3 * 4 * (6 - 2),
            ),
            (
                OpKind::PartialRopeBackward {
                    head_dim: 6,
                    rotary_dim: 4,
                    heads: 3,
                    theta: 10000.0,
                    scaling: longrope,
                },
                "rope_backward_f32",
                [2, 3, 4, 6, 4, 3],
                1.25,
                2 * 3 * 4 * (6 - 2),
            ),
            (
                OpKind::Rope {
                    head_dim: 6,
                    theta: 10000.0,
                    scaling: yarn,
                },
                "rope_forward_f32",
                [2, 3, 4, 6, 6, 4],
                1.1386,
                2 * 3 * 4 * 3,
            ),
        ];
        for (kind, entry, ints, factor, units) in cases {
            let (plan, _) = plan_of(&kind, std::slice::from_ref(&qkv));
            let [Call::Kernel(k)] = &plan[..] else {
                panic!("{kind:?}: one kernel, not {plan:?}");
            };
            assert_eq!(k.entry, entry);
            let tail: Vec<Arg> = ints.iter().map(|&v| Arg::I32(v)).collect();
            assert_eq!(&k.args[3..9], &tail[..], "{kind:?}");
            assert_eq!(k.args[9], Arg::F32(factor), "{kind:?}");
            assert!(
                u64::from(k.grid.0) * u64::from(k.block.0) >= units,
                "{kind:?}: {:?} x {:?} threads for {units} units",
                k.grid,
                k.block
            );
        }
    }

    /// Phi-3's packed SwiGLU reads `[gate | up]` rows of width 2I: forward from `x` to `out`,
    /// backward from `dy` (input 1) and `x` (input 0) to `dx`, one thread per output element.
    #[test]
    fn packed_swiglu_launches_read_both_halves_of_each_row() {
        let x = TensorType::new(vec![2, 3, 10], DType::BF16);
        let dy = TensorType::new(vec![2, 3, 5], DType::BF16);
        let (plan, _) = plan_of(&OpKind::PackedSwiglu, std::slice::from_ref(&x));
        let [Call::Kernel(k)] = &plan[..] else {
            panic!("one kernel, not {plan:?}");
        };
        assert_eq!(k.entry, "packed_swiglu_forward_bf16");
        assert_eq!(
            k.args,
            [
                Arg::Ptr(0x2000_0000),
                Arg::Ptr(0x1000_0000),
                Arg::I32(5),
                Arg::I64(30)
            ]
        );
        let (plan, _) = plan_of(&OpKind::PackedSwigluBackward, &[x, dy]);
        let [Call::Kernel(k)] = &plan[..] else {
            panic!("one kernel, not {plan:?}");
        };
        assert_eq!(k.entry, "packed_swiglu_backward_bf16");
        assert_eq!(
            k.args,
            [
                Arg::Ptr(0x3000_0000),
                Arg::Ptr(0x2000_0000),
                Arg::Ptr(0x1000_0000),
                Arg::I32(5),
                Arg::I64(30)
            ]
        );
    }

    #[test]
    fn accumulation_adds_in_place() {
        for (dt, entry) in [
            (DType::F32, "add_forward_f32"),
            (DType::BF16, "add_forward_bf16"),
            (DType::F16, "add_forward_f16"),
        ] {
            let g = TensorType::new(vec![4, 8], dt);
            let (plan, _) = plan_of(&OpKind::AccumulateGrad, &[g.clone(), g.clone()]);
            let [Call::Kernel(k)] = &plan[..] else {
                panic!("{dt}: one kernel, not {plan:?}");
            };
            assert_eq!(k.entry, entry);
            // out = acc + grad with out at acc: the accumulator (input 0, at plan_of's first
            // address) is both the output and the first summand, the gradient the second.
            let (acc, grad) = (0x1000_0000, 0x2000_0000);
            assert!(
                matches!(
                    k.args[..],
                    [Arg::Ptr(o), Arg::Ptr(a), Arg::Ptr(b), Arg::I64(32)]
                        if o == acc && a == acc && b == grad
                ),
                "{dt}: {:?}",
                k.args
            );
        }
        let mixed = [
            TensorType::new(vec![4, 8], DType::BF16),
            TensorType::new(vec![4, 8], DType::F32),
        ];
        let ins: Vec<&TensorType> = mixed.iter().collect();
        let at = Addresses {
            inputs: vec![0x1000, 0x2000],
            outputs: vec![],
            workspace: None,
            master: None,
            pitches: Pitches::DENSE,
        };
        let types = Types {
            inputs: &ins,
            outputs: &[],
        };
        let target = Target {
            max_blocks: 132 * 32,
            step: 1,
            flash: true,
        };
        let err = calls(&OpKind::AccumulateGrad, types, &at, target)
            .expect_err("types differ")
            .to_string();
        assert!(err.contains("another type"), "{err}");
    }

    /// fp16 loss scaling's ops seed the loss gradient and unscale as dispatch.rs does for the
    /// host kernels: dloss = S / K, and the unscale kernel gets f32(1 / S), the clip flag and
    /// the norm slot (which the executor reads to tell a skipped step).
    #[test]
    fn loss_scaling_passes_the_hosts_scalars() {
        let dt = DType::F16;
        let logits = TensorType::new(vec![B, T, V], dt);
        let tokens = TensorType::new(vec![B, T], DType::I32);
        let lse = TensorType::new(vec![B, T], DType::F32);
        let kind = OpKind::CrossEntropyBackwardLossScaled {
            micro_batches: 4,
            loss_scale: 1024.0,
        };
        let (plan, _) = plan_of(&kind, &[logits, tokens, lse]);
        let [Call::Kernel(k)] = &plan[..] else {
            panic!("one kernel, not {plan:?}");
        };
        assert_eq!(k.entry, "cross_entropy_backward_f16");
        assert!(
            matches!(k.args.last(), Some(Arg::F32(v)) if *v == 256.0),
            "{:?}",
            k.args
        );

        let scalar = TensorType::new(vec![], DType::F32);
        for (max_norm, clip) in [(Some(0.5), 1), (None, 0)] {
            let kind = OpKind::UnscaleCoef {
                max_norm,
                loss_scale: 3.0,
            };
            let (plan, _) = plan_of(&kind, &[scalar.clone(), scalar.clone()]);
            let [Call::Kernel(k)] = &plan[..] else {
                panic!("one kernel, not {plan:?}");
            };
            assert_eq!(k.entry, "unscale_coef");
            let inv = (1.0f64 / 3.0) as f32;
            assert!(
                matches!(
                    k.args[..],
                    [Arg::Ptr(_), Arg::NormSlot, Arg::Table(_), Arg::I32(2), Arg::F32(i), Arg::F32(m), Arg::I32(c)]
                        if i == inv && m == max_norm.unwrap_or(0.0) as f32 && c == clip
                ),
                "{max_norm:?}: {:?}",
                k.args
            );
        }
    }

    /// Before compute capability 8.0 (no bf16 `mma.sync`) attention that would run as flash
    /// attention runs as GEMMs, in a workspace with room for the scores
    /// ([`WorkspaceLayout::for_device`]); a workspace planned for flash attention is refused
    /// with the reason and the way out.
    #[test]
    fn before_sm80_flash_attention_falls_back_to_gemms() {
        let (b, t, h, d) = (2u64, 40u64, 4u64, 64u64);
        let q = t_of(&[b, t, h * d], DType::BF16);
        let lse = t_of(&[b, h, t], DType::F32);
        let attention = |backward: bool| {
            let (heads, kv_heads, head_dim, window, qkv) = (h, h, d, None, QkvLayout::Separate);
            let (scale, softcap) = (None, None);
            match backward {
                false => OpKind::Attention {
                    heads,
                    kv_heads,
                    head_dim,
                    window,
                    qkv,
                    scale,
                    softcap,
                },
                true => OpKind::AttentionBackward {
                    heads,
                    kv_heads,
                    head_dim,
                    window,
                    qkv,
                    scale,
                    softcap,
                },
            }
        };
        for backward in [false, true] {
            let kind = attention(backward);
            let inputs: Vec<TensorType> = match backward {
                false => vec![q.clone(), q.clone(), q.clone()],
                true => vec![
                    q.clone(),
                    q.clone(),
                    q.clone(),
                    q.clone(),
                    lse.clone(),
                    q.clone(),
                ],
            };
            let ins: Vec<&TensorType> = inputs.iter().collect();
            let outputs = kind.infer(&ins).unwrap();
            let outs: Vec<&TensorType> = outputs.iter().collect();
            let types = Types {
                inputs: &ins,
                outputs: &outs,
            };
            let planned = kind.workspace_bytes(&ins);
            let gemm_path = WorkspaceLayout::for_device(&kind, &ins, false).bytes();
            assert!(gemm_path > planned, "the GEMM path needs the scores");
            let at = |ws: u64| Addresses {
                inputs: (0..ins.len() as u64)
                    .map(|i| 0x1000_0000 * (i + 1))
                    .collect(),
                outputs: (0..outs.len() as u64)
                    .map(|i| 0x4000_0000 * (i + 1))
                    .collect(),
                workspace: (ws > 0).then_some((WS, ws)),
                master: None,
                pitches: Pitches::DENSE,
            };
            let target = |flash| Target {
                max_blocks: 132 * 32,
                step: 1,
                flash,
            };
            let kernels = |plan: &[Call]| -> Vec<&'static str> {
                plan.iter()
                    .filter_map(|c| match c {
                        Call::Kernel(k) => Some(k.entry),
                        _ => None,
                    })
                    .collect()
            };
            let flash = calls(&kind, types, &at(planned), target(true)).unwrap();
            assert!(kernels(&flash).iter().any(|k| k.starts_with("flash_")));
            let old = calls(&kind, types, &at(gemm_path), target(false)).unwrap();
            assert!(
                kernels(&old).iter().all(|k| !k.starts_with("flash_")),
                "{:?}",
                kernels(&old)
            );
            assert!(old.iter().any(|c| matches!(c, Call::Batched(_))));
            let err = calls(&kind, types, &at(planned), target(false))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("compute capability 8.0") && err.contains("--dtype f32"),
                "{err}"
            );
        }
    }

    #[test]
    fn bf16_and_f16_attention_with_a_flash_head_dim_runs_the_flash_kernels() {
        let (b, t, h, kv) = (2u64, 100u64, 4u64, 2u64);
        for (dt, d, flash) in [
            (DType::BF16, 64, true),
            (DType::F16, 128, true),
            (DType::BF16, 256, true),
            (DType::F32, 64, false),
            (DType::BF16, 80, false),
        ] {
            let (q, kvt, lse) = (
                t_of(&[b, t, h * d], dt),
                t_of(&[b, t, kv * d], dt),
                t_of(&[b, h, t], DType::F32),
            );
            let (window, scale, softcap) = (Some(5), Some(0.3), Some(20.0));
            let fwd = OpKind::Attention {
                heads: h,
                kv_heads: kv,
                head_dim: d,
                window,
                qkv: QkvLayout::Separate,
                scale,
                softcap,
            };
            let bwd = OpKind::AttentionBackward {
                heads: h,
                kv_heads: kv,
                head_dim: d,
                window,
                qkv: QkvLayout::Separate,
                scale,
                softcap,
            };
            let (fplan, _) = plan_of(&fwd, &[q.clone(), kvt.clone(), kvt.clone()]);
            let (bplan, _) = plan_of(&bwd, &[q.clone(), kvt.clone(), kvt, q.clone(), lse, q]);
            let kernels = |plan: &[Call]| -> Vec<Launch> {
                plan.iter()
                    .filter_map(|c| match c {
                        Call::Kernel(k) => Some((k.entry.to_string(), k.grid, k.args.clone())),
                        _ => None,
                    })
                    .collect()
            };
            let (fk, bk) = (kernels(&fplan), kernels(&bplan));
            if !flash {
                assert!(
                    fplan.iter().any(|c| matches!(c, Call::Batched(_))),
                    "{dt} {d}"
                );
                assert!(fk.iter().chain(&bk).all(|k| !k.0.starts_with("flash")));
                continue;
            }
            // One launch forward; backward the delta, dq, then dk and dv; no GEMM.
            assert_eq!(fplan.len(), 1, "{dt} {d}");
            assert_eq!(bplan.len(), 3, "{dt} {d}");
            let names: Vec<&str> = fk.iter().chain(&bk).map(|k| k.0.as_str()).collect();
            assert_eq!(
                names,
                [
                    format!("flash_attention_forward_{dt}_d{d}"),
                    format!("attention_backward_delta_{dt}"),
                    format!("flash_attention_backward_dq_{dt}_d{d}"),
                    format!("flash_attention_backward_dkv_{dt}_d{d}"),
                ]
            );
            assert_eq!(fk[0].1, (2, 4, 2), "query tiles of 64, H, B");
            assert_eq!(bk[1].1, (2, 4, 2), "dq: query tiles, H, B");
            assert_eq!(bk[2].1, (2, 2, 2), "dk/dv: key tiles, KV, B");
            for (entry, _, args) in fk.iter().chain(&bk[1..]) {
                let src = source_of(entry).expect("a kernel in SOURCES");
                let sigs = signatures(src.source).expect("passable parameters");
                let (_, params) = sigs.iter().find(|(n, _)| n == entry).expect("declared");
                let kinds: Vec<ParamKind> = args.iter().map(Arg::kind).collect();
                assert_eq!(&kinds, params, "{entry}: arguments");
                let tail = &args[args.len() - 8..];
                assert!(
                    matches!(
                        tail,
                        [I32(100), I32(4), I32(2), I32(5), I32(qs), I32(ks), F32(sc), F32(cap)]
                            if *qs == (h * d) as i32 && *ks == (kv * d) as i32 && *sc == 0.3 && *cap == 20.0
                    ),
                    "{dt} {d}: {tail:?}"
                );
            }
        }
    }

    /// A kernel launch of a plan: entry point, grid, arguments.
    type Launch = (String, (u32, u32, u32), Vec<Arg>);

    fn t_of(shape: &[u64], dtype: DType) -> TensorType {
        TensorType::new(shape.to_vec(), dtype)
    }

    #[test]
    fn every_kind_launches_declared_kernels_with_matching_arguments() {
        let mut covered = [false; VARIANTS];
        for dt in [DType::F32, DType::BF16, DType::F16] {
            for (kind, inputs) in examples(dt) {
                covered[variant(&kind)] = true;
                let (plan, spans) = plan_of(&kind, &inputs);
                assert!(!plan.is_empty(), "{kind:?} in {dt}: an empty plan");
                for call in &plan {
                    match call {
                        Call::Kernel(k) => {
                            let what = format!("{kind:?} in {dt}: {}", k.entry);
                            let src = source_of(k.entry)
                                .unwrap_or_else(|| panic!("{what}: no such kernel in SOURCES"));
                            let sigs = signatures(src.source).expect("passable parameters");
                            let (_, params) = sigs
                                .iter()
                                .find(|(n, _)| *n == k.entry)
                                .unwrap_or_else(|| panic!("{what}: not declared"));
                            let kinds: Vec<ParamKind> = k.args.iter().map(Arg::kind).collect();
                            assert_eq!(&kinds, params, "{what}: arguments");
                            assert!(k.grid.0 * k.grid.1 * k.grid.2 > 0, "{what}: empty grid");
                            let threads = k.block.0 * k.block.1 * k.block.2;
                            assert!((1..=1024).contains(&threads), "{what}: block {:?}", k.block);
                            for other in [DType::F32, DType::BF16, DType::F16] {
                                let suffix = format!("_{other}");
                                assert!(
                                    other == dt || !k.entry.ends_with(&suffix),
                                    "{what}: {other} kernel"
                                );
                            }
                            for a in &k.args {
                                match a {
                                    Arg::Ptr(0) | Arg::NormSlot => {}
                                    Arg::Ptr(p) => {
                                        assert!(inside(&spans, *p), "{what}: {p:#x} is no operand");
                                        if (WS..MASTER).contains(p) {
                                            assert_eq!(
                                                (p - WS) % WORKSPACE_ALIGN,
                                                0,
                                                "{what}: a misaligned workspace part"
                                            );
                                        }
                                    }
                                    Arg::Table(ConstKey::InvFreq(bits)) => {
                                        let rotated = match &kind {
                                            OpKind::PartialRope { rotary_dim, .. }
                                            | OpKind::PartialRopeBackward { rotary_dim, .. } => {
                                                *rotary_dim
                                            }
                                            _ => D,
                                        };
                                        assert_eq!(bits.len() as u64, rotated / 2, "{what}")
                                    }
                                    Arg::Table(ConstKey::Pointers(ptrs)) => {
                                        // The clip coefficient's squared norms (its inputs), or
                                        // the grouped matmul's weights or weight gradients.
                                        assert!(ptrs.len() <= inputs.len(), "{what}");
                                        assert!(ptrs.iter().all(|&p| inside(&spans, p)));
                                    }
                                    Arg::Table(ConstKey::AdamWTensors(_)) => {
                                        panic!("{what}: only a merged run has an AdamW table")
                                    }
                                    Arg::I64(_) | Arg::I32(_) | Arg::F32(_) => {}
                                }
                            }
                        }
                        Call::Gemm(g) => {
                            assert_eq!(g.dtype, dt, "{kind:?}: {}", g.what);
                            for p in [g.gemm.a, g.gemm.b, g.gemm.c] {
                                assert!(inside(&spans, p), "{kind:?}: {}: {p:#x}", g.what);
                            }
                        }
                        Call::Matmul(g) => {
                            assert_eq!(g.dtype, dt, "{kind:?}: {}", g.what);
                            let mm = &g.mm;
                            let extra = [mm.residual, mm.bias, mm.gelu.map(|a| a.at)];
                            for p in [mm.gemm.a, mm.gemm.b, mm.gemm.c]
                                .into_iter()
                                .chain(extra.into_iter().flatten())
                            {
                                assert!(inside(&spans, p), "{kind:?}: {}: {p:#x}", g.what);
                            }
                        }
                        Call::Batched(g) => {
                            assert_eq!(g.ab, dt, "{kind:?}: {}", g.what);
                            assert!(g.c == dt || g.c == DType::F32, "{kind:?}: {}", g.what);
                            let f = &g.gemm.first;
                            for p in [f.a, f.b, f.c] {
                                assert!(inside(&spans, p), "{kind:?}: {}: {p:#x}", g.what);
                            }
                        }
                    }
                }
            }
        }
        let missing: Vec<usize> = (0..VARIANTS).filter(|&v| !covered[v]).collect();
        assert!(missing.is_empty(), "kinds without an example: {missing:?}");
    }

    /// The attention row kernels of `attention.cu` transcribed (each row read whole before
    /// it is written over), and its delta kernel, on the model's memory.
    fn run_kernel(mem: &mut Bytes, k: &KernelCall) {
        let st = if k.entry.ends_with("_bf16") {
            DType::BF16
        } else if k.entry.ends_with("_f16") {
            DType::F16
        } else {
            DType::F32
        };
        let e = if st == DType::F32 { 4 } else { 2 };
        let ptr = |i: usize| match k.args[i] {
            Arg::Ptr(p) => p,
            ref a => panic!("{}: argument {i} is {a:?}", k.entry),
        };
        let int = |i: usize| match k.args[i] {
            Arg::I32(v) => v as i64,
            ref a => panic!("{}: argument {i} is {a:?}", k.entry),
        };
        let f32_at = |mem: &Bytes, a: u64| mem.read(DType::F32, a).unwrap();
        if k.entry.starts_with("attention_backward_delta") {
            let (delta, out, dout) = (ptr(0), ptr(1), ptr(2));
            let (b, t, h, d) = (int(3) as u64, int(4) as u64, int(5) as u64, int(6) as u64);
            for row in 0..b * t * h {
                let o = mem.load(st, out + e * row * d, d as usize);
                let g = mem.load(st, dout + e * row * d, d as usize);
                let acc: f32 = o.iter().zip(&g).map(|(x, y)| x * y).sum();
                let (bt, hh) = (row / h, row % h);
                let (bb, tt) = (bt / t, bt % t);
                mem.write(DType::F32, delta + 4 * ((bb * h + hh) * t + tt), acc)
                    .unwrap();
            }
            return;
        }
        let softmax = k.entry.starts_with("attention_softmax");
        let first = |i: usize| match k.args[i] {
            Arg::I64(v) => v as u64,
            ref a => panic!("{}: argument {i} is {a:?}", k.entry),
        };
        let row0 = first(if softmax { 2 } else { 4 });
        let t_len = int(if softmax { 3 } else { 5 }) as u64;
        let window = int(if softmax { 4 } else { 6 });
        let hs = int(if softmax { 5 } else { 7 }) as u64;
        assert!(
            softmax || k.entry.starts_with("attention_backward_ds"),
            "{}",
            k.entry
        );
        for i in 0..u64::from(k.grid.1) {
            for t in 0..t_len {
                let lo = if window > 0 {
                    (t as i64 + 1 - window).max(0) as u64
                } else {
                    0
                };
                let row = 4 * (i * t_len + t) * t_len;
                let visible = |c: u64| c >= lo && c <= t;
                let s: Vec<f32> = (0..t_len)
                    .map(|c| f32_at(mem, ptr(0) + row + 4 * c))
                    .collect();
                if softmax {
                    let m = (lo..=t)
                        .map(|c| s[c as usize])
                        .fold(f32::NEG_INFINITY, f32::max);
                    let l: f32 = (lo..=t).map(|c| (s[c as usize] - m).exp()).sum();
                    for c in 0..t_len {
                        let v = if visible(c) {
                            (s[c as usize] - m).exp() / l
                        } else {
                            0.0
                        };
                        mem.write(st, ptr(0) + row + e * c, v).unwrap();
                    }
                    mem.write(DType::F32, ptr(1) + 4 * (row0 + i * hs + t), m + l.ln())
                        .unwrap();
                } else {
                    let scale = match k.args[8] {
                        Arg::F32(v) => v,
                        ref a => panic!("scale is {a:?}"),
                    };
                    let lse = f32_at(mem, ptr(2) + 4 * (row0 + i * hs + t));
                    let delta = f32_at(mem, ptr(3) + 4 * (row0 + i * hs + t));
                    let dp: Vec<f32> = (0..t_len)
                        .map(|c| f32_at(mem, ptr(1) + row + 4 * c))
                        .collect();
                    for c in 0..t_len {
                        let (pv, ds) = if visible(c) {
                            let pv = (s[c as usize] - lse).exp();
                            (pv, pv * (dp[c as usize] - delta) * scale)
                        } else {
                            (0.0, 0.0)
                        };
                        mem.write(st, ptr(0) + row + e * c, pv).unwrap();
                        mem.write(st, ptr(1) + row + e * c, ds).unwrap();
                    }
                }
            }
        }
    }

    /// Runs `kind`'s plan on the model's memory with `inputs` (values, as f32) and returns
    /// its outputs, as f32.
    fn execute(kind: &OpKind, types: &[TensorType], inputs: &[Vec<f32>]) -> Vec<Vec<f32>> {
        let ins: Vec<&TensorType> = types.iter().collect();
        let outputs = kind.infer(&ins).unwrap();
        let outs: Vec<&TensorType> = outputs.iter().collect();
        let addr = |i: usize| 0x1000_0000 * (i as u64 + 1);
        let mut mem = Bytes::default();
        for (i, t) in ins.iter().chain(&outs).enumerate() {
            mem.alloc(addr(i), t.bytes());
        }
        for (i, (t, v)) in ins.iter().zip(inputs).enumerate() {
            mem.store(t.dtype, addr(i), v);
        }
        let ws = kind.workspace_bytes(&ins);
        // Above every operand (WS would overlap the backward's outputs).
        let ws_at = 0x10_0000_0000;
        mem.alloc(ws_at, ws);
        let at = Addresses {
            inputs: (0..ins.len()).map(addr).collect(),
            outputs: (0..outs.len()).map(|i| addr(ins.len() + i)).collect(),
            workspace: Some((ws_at, ws)),
            master: None,
            pitches: Pitches::DENSE,
        };
        let target = Target {
            max_blocks: 8,
            step: 1,
            flash: true,
        };
        let types = Types {
            inputs: &ins,
            outputs: &outs,
        };
        for call in calls(kind, types, &at, target).unwrap() {
            match call {
                Call::Kernel(k) => run_kernel(&mut mem, &k),
                Call::Batched(g) => gemm_batched(&mut mem, &g.gemm, g.ab, g.c)
                    .unwrap_or_else(|e| panic!("{kind:?}: {}: {e}", g.what)),
                Call::Gemm(g) => panic!("{kind:?}: an unbatched GEMM {}", g.what),
                Call::Matmul(g) => panic!("{kind:?}: a cuBLASLt matmul {}", g.what),
            }
        }
        outs.iter()
            .enumerate()
            .map(|(i, t)| mem.load(t.dtype, at.outputs[i], t.numel() as usize))
            .collect()
    }

    /// Values in [-2, 2), reproducible from `seed`, representable in bf16 so both storage
    /// types start from the same numbers.
    fn values(seed: u64, n: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let v = (s >> 40) as f32 / (1u64 << 22) as f32 - 2.0;
                half::bf16::from_f32(v).to_f32()
            })
            .collect()
    }

    fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= tol * (1.0 + w.abs()),
                "{what}: element {i} is {g}, the host kernel gives {w}"
            );
        }
    }

    /// Attention's call plan (strided-batched GEMMs and the row kernels) executed in the
    /// cuBLAS model, forward and backward, against the host kernels: causal and windowed,
    /// grouped KV heads, packed and separate q/k/v, odd sizes, f32, bf16 and f16 storage. A wrong
    /// transpose, leading dimension, stride, head offset or accumulation flag fails it (a
    /// `beta` of 0 for the group's later heads drops their dK and dV; swapping `stride_a`
    /// and `stride_b` of the scores reads the wrong heads).
    #[test]
    fn attention_plans_compute_the_host_kernels_results() {
        let cases = [
            (1, 3, 2, 1, 4, None, QkvLayout::Separate),
            (2, 7, 4, 2, 3, Some(3), QkvLayout::Separate),
            (2, 5, 3, 3, 5, None, QkvLayout::Packed),
            (1, 9, 6, 2, 8, Some(1), QkvLayout::Packed),
            (1, 1, 2, 2, 2, None, QkvLayout::Separate),
            (1, 6, 4, 1, 7, Some(40), QkvLayout::Separate),
        ];
        for (b, t, h, kv, d, window, qkv) in cases {
            let dims = kernels::AttentionDims {
                batch: b as usize,
                seq: t as usize,
                n_heads: h as usize,
                n_kv_heads: kv as usize,
                head_dim: d as usize,
                window: window.map(|w| w as usize),
                scale: None,
                softcap: None,
            };
            let q_len = b * t * h * d;
            let kv_len = b * t * kv * d;
            let packed_len = b * t * (h + 2 * kv) * d;
            let lse_len = b * h * t;
            let dout = values(9, q_len);
            // The host's results in f32.
            let (mut out, mut lse) = (vec![0.0; q_len as usize], vec![0.0; lse_len as usize]);
            let (qv, kvv, vv, qkvv) = (
                values(1, q_len),
                values(2, kv_len),
                values(3, kv_len),
                values(4, packed_len),
            );
            let grads = match qkv {
                QkvLayout::Separate => {
                    kernels::attention_forward(&mut out, &mut lse, &qv, &kvv, &vv, dims);
                    let mut dq = vec![0.0; q_len as usize];
                    let (mut dk, mut dv) = (vec![0.0; kv_len as usize], vec![0.0; kv_len as usize]);
                    kernels::attention_backward(
                        &mut dq, &mut dk, &mut dv, &dout, &qv, &kvv, &vv, &out, &lse, dims,
                    );
                    vec![dq, dk, dv]
                }
                QkvLayout::Packed => {
                    kernels::attention_forward_packed(&mut out, &mut lse, &qkvv, dims);
                    let mut dqkv = vec![0.0; packed_len as usize];
                    kernels::attention_backward_packed(&mut dqkv, &dout, &qkvv, &out, &lse, dims);
                    vec![dqkv]
                }
            };
            for dt in [DType::F32, DType::BF16, DType::F16] {
                let what = format!("B{b} T{t} H{h} KV{kv} D{d} W{window:?} {qkv:?} {dt}");
                // f16 keeps 3 more mantissa bits than bf16.
                let tol = match dt {
                    DType::F32 => 2e-5,
                    DType::F16 => 1e-2,
                    _ => 4e-2,
                };
                let f = |shape: &[u64]| TensorType::new(shape.to_vec(), dt);
                let lse_ty = TensorType::new(vec![b, h, t], DType::F32);
                let (fwd_types, fwd_inputs) = match qkv {
                    QkvLayout::Separate => (
                        vec![f(&[b, t, h * d]), f(&[b, t, kv * d]), f(&[b, t, kv * d])],
                        vec![qv.clone(), kvv.clone(), vv.clone()],
                    ),
                    QkvLayout::Packed => (vec![f(&[b, t, (h + 2 * kv) * d])], vec![qkvv.clone()]),
                };
                let fwd = OpKind::Attention {
                    heads: h,
                    kv_heads: kv,
                    head_dim: d,
                    window,
                    qkv,
                    scale: None,
                    softcap: None,
                };
                let got = execute(&fwd, &fwd_types, &fwd_inputs);
                assert_close(&format!("{what} out"), &got[0], &out, tol);
                assert_close(&format!("{what} lse"), &got[1], &lse, tol);
                // The backward from the host's out and lse (rounded as the storage holds them).
                let bwd = OpKind::AttentionBackward {
                    heads: h,
                    kv_heads: kv,
                    head_dim: d,
                    window,
                    qkv,
                    scale: None,
                    softcap: None,
                };
                let mut types = fwd_types.clone();
                types.extend([f(&[b, t, h * d]), lse_ty, f(&[b, t, h * d])]);
                let mut inputs = fwd_inputs.clone();
                inputs.extend([out.clone(), lse.clone(), dout.clone()]);
                let got = execute(&bwd, &types, &inputs);
                for (i, (g, w)) in got.iter().zip(&grads).enumerate() {
                    assert_close(&format!("{what} gradient {i}"), g, w, tol);
                }
            }
        }
    }

    #[test]
    fn head_batches_cover_every_head_once_with_a_group_s_first_head_first() {
        // T = 2048: 16 MiB of scores per head, so 4 KV heads per batch of the 64 MiB cap.
        let dims = AttnDims {
            b: 2,
            t: 2048,
            h: 10,
            kv: 5,
            d: 8,
            window: 0,
            q_stride: 80,
            kv_stride: 40,
            packed: None,
            scale: 0.35,
            softcap: 0.0,
        };
        assert_eq!(attention_head_batch(5, 2048), 4);
        let batches = dims.head_batches();
        let mut seen = std::collections::BTreeSet::new();
        for hb in &batches {
            assert!(hb.heads >= 1 && hb.heads <= 4, "{hb:?}");
            for kvh in hb.kv0..hb.kv0 + hb.heads {
                assert!(seen.insert((hb.b, kvh * 2 + hb.j)), "{hb:?} twice");
                // dK and dV accumulate over j > 0: the group's head 0 must come first.
                if hb.j > 0 {
                    assert!(seen.contains(&(hb.b, kvh * 2)), "{hb:?} before j = 0");
                }
            }
        }
        assert_eq!(seen.len(), 2 * 10);
        // The workspace holds one batch of scores (and, backward, of their gradients).
        let q = TensorType::new(vec![2, 2048, 80], DType::BF16);
        let kv = TensorType::new(vec![2, 2048, 40], DType::BF16);
        let kind = OpKind::Attention {
            heads: 10,
            kv_heads: 5,
            head_dim: 8,
            window: None,
            qkv: QkvLayout::Separate,
            scale: None,
            softcap: None,
        };
        let l = WorkspaceLayout::of(&kind, &[&q, &kv, &kv]);
        assert_eq!(l.get(Scratch::Scores).unwrap().bytes, 4 * 4 * 2048 * 2048);
    }

    #[test]
    fn a_workspace_smaller_than_the_layout_is_refused() {
        let x = t(&[B, T, C], DType::F32);
        let w = t(&[C], DType::F32);
        let kind = OpKind::LayerNorm { eps: 1e-5 };
        let ins = [&x, &w, &w];
        let outs = [&x];
        let at = Addresses {
            inputs: vec![1, 2, 3],
            outputs: vec![4],
            workspace: Some((WS, kind.workspace_bytes(&ins) - 4)),
            master: None,
            pitches: Pitches::DENSE,
        };
        let types = Types {
            inputs: &ins,
            outputs: &outs,
        };
        let target = Target {
            max_blocks: 1,
            step: 1,
            flash: true,
        };
        let err = calls(&kind, types, &at, target).unwrap_err().to_string();
        assert!(err.contains("recompile the schedule"), "{err}");
    }

    /// An AdamW op's operands for [`adamw_multi`] tests: a parameter of `n` elements in `dt`
    /// (its moments f32), every operand of op `k` at its own address, and the clip coefficient,
    /// when `clipped`, at one address all ops share.
    struct AdamWCase {
        kind: OpKind,
        inputs: Vec<TensorType>,
        outputs: Vec<TensorType>,
        at: Addresses,
    }

    const COEF: u64 = 0x6000_0000;

    fn adamw_case(k: u64, n: u64, dt: DType, clipped: bool, lr: f64) -> AdamWCase {
        let kind = OpKind::AdamW {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            clipped,
        };
        let mut inputs = vec![
            t(&[n], dt),
            t(&[n], dt),
            t(&[n], DType::F32),
            t(&[n], DType::F32),
        ];
        let mut addrs: Vec<u64> = (0..4)
            .map(|i| 0x1000_0000 * (k + 1) + 0x100_0000 * i)
            .collect();
        if clipped {
            inputs.push(t(&[], DType::F32));
            addrs.push(COEF);
        }
        AdamWCase {
            kind,
            inputs,
            outputs: Vec::new(),
            at: Addresses {
                inputs: addrs,
                outputs: Vec::new(),
                workspace: None,
                master: Some(0x1000_0000 * (k + 1) + 0x800_0000),
                pitches: Pitches::DENSE,
            },
        }
    }

    fn target() -> Target {
        Target {
            max_blocks: 3,
            step: 7,
            flash: true,
        }
    }

    /// The merged plan of `cases`, and each case's own (per-tensor) plan.
    fn merged_and_alone(cases: &[AdamWCase]) -> (Result<Vec<Call>>, Vec<Vec<Call>>) {
        let refs: Vec<(Vec<&TensorType>, Vec<&TensorType>)> = cases
            .iter()
            .map(|c| (c.inputs.iter().collect(), c.outputs.iter().collect()))
            .collect();
        let members: Vec<AdamWMember<'_>> = cases
            .iter()
            .zip(&refs)
            .map(|(c, (inputs, outputs))| AdamWMember {
                kind: &c.kind,
                types: Types { inputs, outputs },
                at: &c.at,
            })
            .collect();
        let alone = members
            .iter()
            .map(|m| calls(m.kind, m.types, m.at, target()).unwrap())
            .collect();
        (adamw_multi(&members, target()), alone)
    }

    fn ptr(a: &Arg) -> u64 {
        match a {
            Arg::Ptr(p) => *p,
            a => panic!("{a:?} is no pointer"),
        }
    }

    /// A run of AdamW ops of odd sizes (one element, less than a block, a block and one, more
    /// than `max_blocks` blocks' worth, and an empty one, which gets no entry) is one launch of
    /// `adamw_multi_*`, clipped or not, in every storage type. Its table holds, for each
    /// tensor, exactly the pointers and size the tensor's own `adamw_*` launch passes, its
    /// scalars and coefficient are theirs, its arguments match the kernel's declaration, and
    /// the kernel's block-to-tensor mapping (transcribed from `adamw.cu`) over its grid
    /// visits every element of every tensor once, with each tensor's blocks as its own launch
    /// would have them.
    #[test]
    fn a_run_of_adamw_is_one_launch_covering_every_element_once() {
        let sizes = [1u64, 255, 0, 257, 1000];
        for dt in [DType::F32, DType::BF16, DType::F16] {
            for clipped in [false, true] {
                let what = format!("{dt} clipped {clipped}");
                let cases: Vec<AdamWCase> = sizes
                    .iter()
                    .enumerate()
                    .map(|(k, &n)| adamw_case(k as u64, n, dt, clipped, 1e-3))
                    .collect();
                let (merged, alone) = merged_and_alone(&cases);
                let merged = merged.unwrap();
                let [Call::Kernel(k)] = &merged[..] else {
                    panic!("{what}: one launch, not {merged:?}");
                };
                assert_eq!(k.entry, format!("adamw_multi_{dt}"), "{what}");
                let src = source_of(k.entry).expect("declared");
                let sigs = signatures(src.source).expect("passable parameters");
                let (_, params) = sigs.iter().find(|(n, _)| *n == k.entry).unwrap();
                let kinds: Vec<ParamKind> = k.args.iter().map(Arg::kind).collect();
                assert_eq!(&kinds, params, "{what}");
                let Arg::Table(ConstKey::AdamWTensors(table)) = &k.args[0] else {
                    panic!("{what}: {:?}", k.args[0]);
                };
                assert_eq!(k.args[1], I32(4), "{what}: the empty tensor has no entry");
                assert_eq!(table.len(), 4 * ADAMW_TABLE_WORDS, "{what}");
                assert_eq!(k.block, (BLOCK, 1, 1));
                let mut entries = table.chunks(ADAMW_TABLE_WORDS);
                let mut next_block = 0;
                for (n, own) in sizes.iter().zip(&alone) {
                    if *n == 0 {
                        assert!(own.is_empty(), "{what}: an empty tensor launches nothing");
                        continue;
                    }
                    let [Call::Kernel(own)] = &own[..] else {
                        panic!("{what}: {own:?}")
                    };
                    let e = entries.next().unwrap();
                    // The per-tensor arguments: [master,] param, grad, m, v, n, scale, scalars.
                    let a = &own.args;
                    let (master, low, rest) = match dt {
                        DType::F32 => (ptr(&a[0]), 0, &a[1..]),
                        _ => (ptr(&a[0]), ptr(&a[1]), &a[2..]),
                    };
                    assert_eq!(
                        e[..6],
                        [master, low, ptr(&rest[0]), ptr(&rest[1]), ptr(&rest[2]), *n],
                        "{what}"
                    );
                    assert_eq!(rest[3], I64(*n as i64));
                    assert_eq!(k.args[2..], rest[4..], "{what}: coefficient and scalars");
                    assert_eq!(e[6], next_block, "{what}: first block");
                    next_block += u64::from(own.grid.0);
                }
                assert_eq!(u64::from(k.grid.0), next_block, "{what}: grid");
                // adamw.cu's mapping: block b works on the last tensor whose first block is at
                // most b, striding with that tensor's blocks.
                let first: Vec<u64> = table.chunks(ADAMW_TABLE_WORDS).map(|e| e[6]).collect();
                let count = first.len();
                let mut visits: Vec<Vec<u32>> = table
                    .chunks(ADAMW_TABLE_WORDS)
                    .map(|e| vec![0; e[5] as usize])
                    .collect();
                for b in 0..u64::from(k.grid.0) {
                    let (mut lo, mut hi) = (0, count - 1);
                    while lo < hi {
                        let mid = (lo + hi).div_ceil(2);
                        if first[mid] <= b {
                            lo = mid;
                        } else {
                            hi = mid - 1;
                        }
                    }
                    let end = first.get(lo + 1).copied().unwrap_or(u64::from(k.grid.0));
                    let blocks = end - first[lo];
                    for thread in 0..u64::from(BLOCK) {
                        let mut i = (b - first[lo]) * u64::from(BLOCK) + thread;
                        while i < visits[lo].len() as u64 {
                            visits[lo][i as usize] += 1;
                            i += blocks * u64::from(BLOCK);
                        }
                    }
                }
                for (t, v) in visits.iter().enumerate() {
                    assert!(v.iter().all(|&c| c == 1), "{what}: tensor {t} visits {v:?}");
                }
            }
        }
    }

    /// One launch passes one set of scalars and one coefficient: members that differ in their
    /// learning rate, storage type or coefficient are refused (the run rule never merges
    /// them), and so is a member the per-tensor plan refuses. A run of empty tensors launches
    /// nothing.
    #[test]
    fn a_merged_launch_refuses_members_it_cannot_share() {
        let base = || adamw_case(0, 10, DType::BF16, true, 1e-3);
        let differ = [
            ("learning rate", adamw_case(1, 10, DType::BF16, true, 2e-3)),
            ("storage", adamw_case(1, 10, DType::F16, true, 1e-3)),
            ("unclipped", adamw_case(1, 10, DType::BF16, false, 1e-3)),
            ("coefficient", {
                let mut c = adamw_case(1, 10, DType::BF16, true, 1e-3);
                c.at.inputs[4] = COEF + 64;
                c
            }),
        ];
        for (what, other) in differ {
            let (merged, _) = merged_and_alone(&[base(), other]);
            let err = merged.expect_err(what).to_string();
            assert!(err.contains("cannot share a launch"), "{what}: {err}");
        }
        let mut no_master = adamw_case(1, 10, DType::BF16, true, 1e-3);
        no_master.at.master = None;
        let refs: Vec<&TensorType> = no_master.inputs.iter().collect();
        let member = AdamWMember {
            kind: &no_master.kind,
            types: Types {
                inputs: &refs,
                outputs: &[],
            },
            at: &no_master.at,
        };
        let err = adamw_multi(&[member], target()).unwrap_err().to_string();
        assert!(err.contains("master weight"), "{err}");
        let empty = [
            adamw_case(0, 0, DType::F32, false, 1e-3),
            adamw_case(1, 0, DType::F32, false, 1e-3),
        ];
        assert!(merged_and_alone(&empty).0.unwrap().is_empty());
    }
}
