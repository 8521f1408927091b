//! Op kinds on the CUDA backend: which kernels of [`super::SOURCES`] (or cuBLAS) each kind
//! launches, on what shapes, with which scratch.
//!
//! Every kind has its own arm, without a wildcard, so a kind added to the IR is a compile error
//! here until it has kernels. The launch shapes follow the notes beside each entry point in
//! `kernels/*.cu`. Storage is f32 or bf16 (the `_f32` / `_bf16` entry points); statistics,
//! log-sum-exps and partial sums are f32 whatever the storage.
//!
//! Scratch. Every kernel's scratch is the workspace the memory plan gives its op, laid out as
//! [`protrain_ir::OpKind::workspace_bytes`] says: the norms' per-row statistics and the
//! column-sum partials of bias and norm-weight gradients (`ceil(rows / 256)` f32 rows per
//! summed parameter), attention's backward `delta` (f32 `[B, H, T]`), cross-entropy's per-row
//! losses (f32 `[B*T]`), the token embedding backward's first/last positions (i32 `[V, 2]`),
//! the gradient norm's f64 partials, a fused linear's intermediate gradients. Nothing is
//! allocated per launch, so the planned peak is the device's.
//!
//! The host optimizer stream ([`host`]) runs the host backend's code on the pinned region: the
//! CPU Adam for offloaded chunks, widening bf16 gradients to f32 and rounding the updated f32
//! master weight back to the bf16 parameter.

use protrain_ir::{DType, Epilogue, OpKind, QkvLayout, TensorType};
use rayon::prelude::*;

use super::backend::{Arg, ConstKey, CudaBackend, DeviceStream, HostStream, BLOCK};
use super::blas::LinearDims;
use super::{
    column_sum_chunks, grad_norm_partials, AdamWScalars, ATTN_DKV_ROWS, ATTN_DQ_ROWS,
    ATTN_FWD_ROWS, ATTN_MAX_HEAD_DIM, ATTN_THREADS, COLUMN_SUM_BLOCK, COLUMN_SUM_ROWS_PER_CHUNK,
};
use crate::backend::Launch;
use crate::dispatch::{self, Outcome};
use crate::error::{Result, RuntimeError};
use crate::kernels::{self, AdamWConfig};

use Arg::{Ptr, F32, I32, I64};

/// Most blocks along a grid's y or z, and along x for the row kernels.
const MAX_GRID_YZ: u64 = 65535;

/// The storage type of a kernel's floating-point operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Storage {
    F32,
    Bf16,
}

impl Storage {
    /// The entry point for this storage type.
    fn pick(self, f32_name: &'static str, bf16_name: &'static str) -> &'static str {
        match self {
            Storage::F32 => f32_name,
            Storage::Bf16 => bf16_name,
        }
    }

    /// Bytes per element.
    fn size(self) -> u64 {
        match self {
            Storage::F32 => 4,
            Storage::Bf16 => 2,
        }
    }
}

/// One launch on a device stream: the op, its operands, and where to issue.
struct Op<'a, 'l> {
    b: &'a CudaBackend,
    s: &'a mut DeviceStream,
    l: &'a Launch<'l>,
}

impl Op<'_, '_> {
    fn name(&self) -> &'static str {
        self.l.op.kind.mnemonic()
    }

    fn bad(&self, why: impl std::fmt::Display) -> RuntimeError {
        RuntimeError::BadSchedule(format!("{}: {why}", self.name()))
    }

    fn ty_in(&self, i: usize) -> &TensorType {
        &self.l.graph.value(self.l.op.inputs[i]).ty
    }

    fn ty_out(&self, i: usize) -> &TensorType {
        &self.l.graph.value(self.l.op.outputs[i]).ty
    }

    /// Input `i`'s device address.
    fn input(&self, i: usize) -> Result<u64> {
        self.b.gpu_addr(self.l.inputs[i], self.ty_in(i).bytes())
    }

    /// Output `i`'s device address.
    fn output(&self, i: usize) -> Result<u64> {
        self.b.gpu_addr(self.l.outputs[i], self.ty_out(i).bytes())
    }

    /// The planned workspace, which must hold `bytes`.
    fn workspace(&self, bytes: u64) -> Result<u64> {
        match self.l.workspace {
            Some((at, have)) if have >= bytes => self.b.gpu_addr(at, bytes),
            Some((_, have)) => Err(self.bad(format!(
                "the planned workspace of {have} bytes is smaller than the {bytes} the kernel \
                 needs; recompile the schedule"
            ))),
            None => Err(self.bad(format!(
                "no workspace was planned but the kernel needs {bytes} bytes; recompile the \
                 schedule"
            ))),
        }
    }

    /// The storage type of input `i`.
    fn storage(&self, i: usize) -> Result<Storage> {
        storage_of(self.ty_in(i).dtype).ok_or_else(|| {
            self.bad(format!(
                "input {i} is {}; the CUDA kernels store f32 or bf16: compile with dtype bf16 \
                 or f32",
                self.ty_in(i)
            ))
        })
    }

    /// Launches `name` with a 1-D grid-stride shape over `n` elements.
    fn stride(&self, name: &'static str, n: u64, args: &[Arg]) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let grid = (self.b.grid_for(n), 1, 1);
        self.b
            .launch_kernel(&self.s.stream, name, grid, (BLOCK, 1, 1), args)
    }

    /// Launches a row kernel (one block per row, blocks striding over `rows`).
    fn rows(&self, name: &'static str, rows: u64, args: &[Arg]) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let grid = (rows.min(MAX_GRID_YZ) as u32, 1, 1);
        self.b
            .launch_kernel(&self.s.stream, name, grid, (BLOCK, 1, 1), args)
    }

    /// Launches `name` with an explicit shape.
    fn shaped(
        &self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &[Arg],
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        self.b
            .launch_kernel(&self.s.stream, name, grid, block, args)
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
            st.pick("column_sum_partial_f32", "column_sum_partial_bf16"),
            grid,
            block,
            &[
                Ptr(partials),
                Ptr(x),
                I32(rows_i),
                I32(cols_i),
                I32(per_chunk),
            ],
        )?;
        self.stride(
            st.pick("column_sum_finish_f32", "column_sum_finish_bf16"),
            cols,
            &[
                Ptr(dst),
                Ptr(partials),
                I32(chunks as i32),
                I32(cols_i),
                I32(0),
            ],
        )
    }

    /// The device table of RoPE inverse frequencies for this op.
    fn inv_freq(
        &mut self,
        head_dim: u64,
        theta: f64,
        scaling: protrain_ir::RopeScaling,
    ) -> Result<u64> {
        let table = kernels::rope_inv_freq(head_dim as usize, theta, scaling);
        let bits: Vec<u32> = table.iter().map(|x| x.to_bits()).collect();
        let bytes: Vec<u8> = table.iter().flat_map(|x| x.to_ne_bytes()).collect();
        self.s
            .constant(&self.b.ctx, ConstKey::InvFreq(bits), &bytes)
    }
}

fn storage_of(dtype: DType) -> Option<Storage> {
    match dtype {
        DType::F32 => Some(Storage::F32),
        DType::BF16 => Some(Storage::Bf16),
        DType::F16 | DType::I32 => None,
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
}

impl AttnDims {
    #[allow(clippy::too_many_arguments)]
    fn new(
        op: &Op<'_, '_>,
        out: &TensorType,
        heads: u64,
        kv_heads: u64,
        head_dim: u64,
        window: Option<u64>,
        qkv: QkvLayout,
        st: Storage,
    ) -> Result<Self> {
        if head_dim as usize > ATTN_MAX_HEAD_DIM || head_dim == 0 {
            return Err(op.bad(format!(
                "heads of {head_dim} dimensions; the attention kernels take 1 to \
                 {ATTN_MAX_HEAD_DIM}"
            )));
        }
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) || out.shape.len() != 3 {
            return Err(op.bad(format!(
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
            b: op.int(out.shape[0], "batch")?,
            t: op.int(out.shape[1], "sequence")?,
            h: op.int(heads, "heads")?,
            kv: op.int(kv_heads, "KV heads")?,
            d: head_dim as i32,
            // A window wider than i32 sees every earlier key, as no window does.
            window: window.map_or(0, |w| w.min(i32::MAX as u64) as i32),
            q_stride: op.int(q_stride, "q row width")?,
            kv_stride: op.int(kv_stride, "kv row width")?,
            packed,
        })
    }

    /// The trailing `B, T, H, KV, D, window, q_stride, kv_stride` arguments.
    fn tail(&self) -> [Arg; 8] {
        [
            I32(self.b),
            I32(self.t),
            I32(self.h),
            I32(self.kv),
            I32(self.d),
            I32(self.window),
            I32(self.q_stride),
            I32(self.kv_stride),
        ]
    }

    /// Grid `(ceil(T / rows), heads, B)`.
    fn grid(&self, rows: usize, heads: i32) -> (u32, u32, u32) {
        (
            (self.t as u32).div_ceil(rows as u32),
            heads as u32,
            self.b as u32,
        )
    }
}

/// Enqueues the kernels of one op on a device stream.
pub(super) fn device(b: &CudaBackend, s: &mut DeviceStream, l: &Launch<'_>) -> Result<()> {
    let mut op = Op { b, s, l };
    let (o, n_in, n_out) = (l.op, l.op.inputs.len(), l.op.outputs.len());
    if l.inputs.len() != n_in || l.outputs.len() != n_out {
        return Err(op.bad(format!(
            "the op has {n_in} inputs and {n_out} outputs but the kernel was given {} and {} \
             addresses",
            l.inputs.len(),
            l.outputs.len()
        )));
    }
    match &o.kind {
        OpKind::Embedding { .. } => {
            let st = op.storage(1)?;
            let table = op.ty_in(1);
            let (vocab, ch) = (table.shape[0], table.shape[1]);
            let tokens = op.ty_in(0).numel();
            op.stride(
                st.pick("embedding_forward_f32", "embedding_forward_bf16"),
                tokens * ch,
                &[
                    Ptr(op.output(0)?),
                    Ptr(op.input(0)?),
                    Ptr(op.input(1)?),
                    I32(op.int(tokens, "tokens")?),
                    I32(op.int(vocab, "vocabulary")?),
                    I32(op.int(ch, "channels")?),
                ],
            )
        }
        OpKind::PositionEmbedding { offset } => {
            let st = op.storage(1)?;
            let t = op.ty_in(0).clone();
            let ch = op.ty_in(1).shape[1];
            op.stride(
                st.pick(
                    "position_embedding_forward_f32",
                    "position_embedding_forward_bf16",
                ),
                t.numel() * ch,
                &[
                    Ptr(op.output(0)?),
                    Ptr(op.input(1)?),
                    I32(op.int(t.shape[0], "batch")?),
                    I32(op.int(t.shape[1], "sequence")?),
                    I32(op.int(ch, "channels")?),
                    I32(op.int(*offset, "offset")?),
                ],
            )
        }
        OpKind::LayerNorm { eps } => {
            let st = op.storage(0)?;
            let (rows, c) = (op.ty_in(0).rows(), op.ty_in(0).last_dim());
            let ws = op.workspace(8 * rows)?;
            op.rows(
                st.pick("layer_norm_forward_f32", "layer_norm_forward_bf16"),
                rows,
                &[
                    Ptr(op.output(0)?),
                    Ptr(ws),
                    Ptr(ws + 4 * rows),
                    Ptr(op.input(0)?),
                    Ptr(op.input(1)?),
                    Ptr(op.input(2)?),
                    I32(op.int(rows, "rows")?),
                    I32(op.int(c, "channels")?),
                    F32(*eps as f32),
                ],
            )
        }
        OpKind::RmsNorm { eps } => {
            let st = op.storage(0)?;
            let (rows, c) = (op.ty_in(0).rows(), op.ty_in(0).last_dim());
            let ws = op.workspace(4 * rows)?;
            op.rows(
                st.pick("rms_norm_forward_f32", "rms_norm_forward_bf16"),
                rows,
                &[
                    Ptr(op.output(0)?),
                    Ptr(ws),
                    Ptr(op.input(0)?),
                    Ptr(op.input(1)?),
                    I32(op.int(rows, "rows")?),
                    I32(op.int(c, "channels")?),
                    F32(*eps as f32),
                ],
            )
        }
        OpKind::Linear { bias, layout } => {
            let st = op.storage(0)?;
            let dtype = op.ty_in(0).dtype;
            if op.ty_in(1).dtype != dtype {
                return Err(op.bad(format!(
                    "input {} and weight {} differ in type",
                    op.ty_in(0),
                    op.ty_in(1)
                )));
            }
            let d = LinearDims {
                rows: op.ty_in(0).rows() as usize,
                d_in: op.ty_in(0).last_dim() as usize,
                d_out: op.ty_out(0).last_dim() as usize,
            };
            let (x, w, y) = (op.input(0)?, op.input(1)?, op.output(0)?);
            let gemm = op.s.gemm()?;
            // SAFETY: x, w and y hold tensors of these shapes (checked by `gpu_addr` against
            // their types); y overlaps neither input (the ordering contract).
            unsafe { gemm.linear_forward(dtype, *layout, d, x, w, y)? };
            if *bias {
                let n = (d.rows * d.d_out) as u64;
                op.stride(
                    st.pick("bias_add_f32", "bias_add_bf16"),
                    n,
                    &[
                        Ptr(y),
                        Ptr(y),
                        Ptr(op.input(2)?),
                        I64(d.rows as i64),
                        I32(op.int(d.d_out as u64, "output features")?),
                    ],
                )?;
            }
            Ok(())
        }
        OpKind::Gelu => unary(&op, "gelu_forward_f32", "gelu_forward_bf16"),
        OpKind::Relu => unary(&op, "relu_forward_f32", "relu_forward_bf16"),
        OpKind::Silu => unary(&op, "silu_forward_f32", "silu_forward_bf16"),
        OpKind::Swiglu => binary(&op, "swiglu_forward_f32", "swiglu_forward_bf16"),
        OpKind::Add => binary(&op, "add_forward_f32", "add_forward_bf16"),
        OpKind::Rope {
            head_dim,
            theta,
            scaling,
        } => rope(&mut op, *head_dim, *theta, *scaling, false),
        OpKind::Attention {
            heads,
            kv_heads,
            head_dim,
            window,
            qkv,
        } => {
            let st = op.storage(0)?;
            let out = op.ty_out(0).clone();
            let dims = AttnDims::new(&op, &out, *heads, *kv_heads, *head_dim, *window, *qkv, st)?;
            let (q, k, v) = match dims.packed {
                Some((k_off, v_off)) => {
                    let qkv = op.input(0)?;
                    (qkv, qkv + k_off, qkv + v_off)
                }
                None => (op.input(0)?, op.input(1)?, op.input(2)?),
            };
            let mut args = vec![
                Ptr(op.output(0)?),
                Ptr(op.output(1)?),
                Ptr(q),
                Ptr(k),
                Ptr(v),
            ];
            args.extend(dims.tail());
            op.shaped(
                st.pick("attention_forward_f32", "attention_forward_bf16"),
                dims.grid(ATTN_FWD_ROWS, dims.h),
                (ATTN_THREADS, 1, 1),
                &args,
            )
        }
        OpKind::CrossEntropy => {
            let st = op.storage(0)?;
            let (rows, vocab) = (op.ty_in(0).rows(), op.ty_in(0).last_dim());
            let row_loss = op.workspace(4 * rows)?;
            let rows_i = op.int(rows, "rows")?;
            op.rows(
                st.pick("cross_entropy_forward_f32", "cross_entropy_forward_bf16"),
                rows,
                &[
                    Ptr(op.output(1)?),
                    Ptr(row_loss),
                    Ptr(op.input(0)?),
                    Ptr(op.input(1)?),
                    I32(rows_i),
                    I32(op.int(vocab, "vocabulary")?),
                ],
            )?;
            op.shaped(
                "cross_entropy_loss",
                (1, 1, 1),
                (1024, 1, 1),
                &[Ptr(op.output(0)?), Ptr(row_loss), I32(rows_i)],
            )
        }
        OpKind::EmbeddingBackward { rows, padding_idx } => {
            let st = op.storage(1)?;
            let (vocab, ch) = (*rows, op.ty_in(1).last_dim());
            let tokens = op.ty_in(0).numel();
            let span = op.workspace(8 * vocab)?;
            let (tok, vocab_i) = (op.input(0)?, op.int(vocab, "vocabulary")?);
            let tokens_i = op.int(tokens, "tokens")?;
            for phase in [0, 1] {
                op.stride(
                    "embedding_backward_span",
                    vocab.max(tokens),
                    &[Ptr(span), Ptr(tok), I32(tokens_i), I32(vocab_i), I32(phase)],
                )?;
            }
            let pad = padding_idx.filter(|&p| p < vocab).map_or(-1, |p| p as i32);
            let grid = (
                vocab.min(MAX_GRID_YZ) as u32,
                op.grid_yz(ch.div_ceil(u64::from(BLOCK)), "channel blocks")?,
                1,
            );
            op.shaped(
                st.pick("embedding_backward_f32", "embedding_backward_bf16"),
                grid,
                (BLOCK, 1, 1),
                &[
                    Ptr(op.output(0)?),
                    Ptr(op.input(1)?),
                    Ptr(tok),
                    Ptr(span),
                    I32(tokens_i),
                    I32(vocab_i),
                    I32(op.int(ch, "channels")?),
                    I32(0),
                    I32(pad),
                ],
            )
        }
        OpKind::PositionEmbeddingBackward { rows, offset } => {
            let st = op.storage(1)?;
            let t = op.ty_in(0).clone();
            let ch = op.ty_in(1).last_dim();
            op.stride(
                st.pick(
                    "position_embedding_backward_f32",
                    "position_embedding_backward_bf16",
                ),
                rows * ch,
                &[
                    Ptr(op.output(0)?),
                    Ptr(op.input(1)?),
                    I32(op.int(t.shape[0], "batch")?),
                    I32(op.int(t.shape[1], "sequence")?),
                    I32(op.int(ch, "channels")?),
                    I32(op.int(*offset, "offset")?),
                    I32(op.int(*rows, "positions")?),
                    I32(0),
                ],
            )
        }
        OpKind::LayerNormBackward { eps } => norm_backward(&mut op, *eps, true),
        OpKind::RmsNormBackward { eps } => norm_backward(&mut op, *eps, false),
        OpKind::LinearBackward { bias, layout } => {
            let st = op.storage(0)?;
            let dtype = op.ty_in(0).dtype;
            if op.ty_in(1).dtype != dtype || op.ty_in(2).dtype != dtype {
                return Err(op.bad(format!(
                    "x {}, weight {} and dy {} differ in type",
                    op.ty_in(0),
                    op.ty_in(1),
                    op.ty_in(2)
                )));
            }
            if *bias && n_out < 3 {
                return Err(op.bad("a linear layer with a bias writes dx, dweight and dbias"));
            }
            let d = LinearDims {
                rows: op.ty_in(0).rows() as usize,
                d_in: op.ty_in(0).last_dim() as usize,
                d_out: op.ty_in(2).last_dim() as usize,
            };
            let (x, w, dy) = (op.input(0)?, op.input(1)?, op.input(2)?);
            let (dx, dw) = (op.output(0)?, op.output(1)?);
            let gemm = op.s.gemm()?;
            // SAFETY: every operand holds a tensor of these shapes (checked against their
            // types); the outputs overlap no input or each other (the ordering contract).
            unsafe { gemm.linear_backward(dtype, *layout, d, x, w, dy, dx, dw)? };
            if *bias {
                let db = op.output(2)?;
                let (rows, cols) = (d.rows as u64, d.d_out as u64);
                let partials = op.workspace(4 * column_sum_chunks(d.rows) as u64 * cols)?;
                op.column_sum(st, db, dy, rows, cols, partials)?;
            }
            Ok(())
        }
        OpKind::FusedLinear {
            count,
            bias,
            layout,
            epilogue,
        } => fused_linear(&mut op, *count as usize, *bias, *layout, *epilogue),
        OpKind::FusedLinearBackward {
            count,
            bias,
            layout,
            epilogue,
        } => fused_linear_backward(&mut op, *count as usize, *bias, *layout, *epilogue),
        OpKind::GeluBackward => unary_backward(&op, "gelu_backward_f32", "gelu_backward_bf16"),
        OpKind::ReluBackward => unary_backward(&op, "relu_backward_f32", "relu_backward_bf16"),
        OpKind::SiluBackward => unary_backward(&op, "silu_backward_f32", "silu_backward_bf16"),
        OpKind::SwigluBackward => {
            let st = op.storage(0)?;
            let n = op.ty_in(0).numel();
            op.stride(
                st.pick("swiglu_backward_f32", "swiglu_backward_bf16"),
                n,
                &[
                    Ptr(op.output(0)?),
                    Ptr(op.output(1)?),
                    Ptr(op.input(2)?),
                    Ptr(op.input(0)?),
                    Ptr(op.input(1)?),
                    I64(n as i64),
                ],
            )
        }
        OpKind::RopeBackward {
            head_dim,
            theta,
            scaling,
        } => rope(&mut op, *head_dim, *theta, *scaling, true),
        OpKind::AttentionBackward {
            heads,
            kv_heads,
            head_dim,
            window,
            qkv,
        } => {
            let st = op.storage(0)?;
            // Inputs: q, k, v (or qkv), then out, lse, dout.
            let first = match qkv {
                QkvLayout::Separate => 3,
                QkvLayout::Packed => 1,
            };
            let out_ty = op.ty_in(first).clone();
            let dims = AttnDims::new(
                &op, &out_ty, *heads, *kv_heads, *head_dim, *window, *qkv, st,
            )?;
            let (out, lse, dout) = (op.input(first)?, op.input(first + 1)?, op.input(first + 2)?);
            let ((q, k, v), (dq, dk, dv)) = match dims.packed {
                Some((k_off, v_off)) => {
                    let (qkv, dqkv) = (op.input(0)?, op.output(0)?);
                    (
                        (qkv, qkv + k_off, qkv + v_off),
                        (dqkv, dqkv + k_off, dqkv + v_off),
                    )
                }
                None => (
                    (op.input(0)?, op.input(1)?, op.input(2)?),
                    (op.output(0)?, op.output(1)?, op.output(2)?),
                ),
            };
            let rows =
                u64::from(dims.b as u32) * u64::from(dims.t as u32) * u64::from(dims.h as u32);
            let delta = op.workspace(4 * rows)?;
            // One warp per (b, t, h) row.
            let warps_per_block = u64::from(BLOCK / 32);
            let grid = (
                rows.div_ceil(warps_per_block)
                    .clamp(1, u64::from(b.max_blocks())) as u32,
                1,
                1,
            );
            op.shaped(
                st.pick(
                    "attention_backward_delta_f32",
                    "attention_backward_delta_bf16",
                ),
                grid,
                (BLOCK, 1, 1),
                &[
                    Ptr(delta),
                    Ptr(out),
                    Ptr(dout),
                    I32(dims.b),
                    I32(dims.t),
                    I32(dims.h),
                    I32(dims.d),
                ],
            )?;
            let operands = [Ptr(dout), Ptr(q), Ptr(k), Ptr(v), Ptr(lse), Ptr(delta)];
            let mut args = vec![Ptr(dq)];
            args.extend(operands);
            args.extend(dims.tail());
            op.shaped(
                st.pick("attention_backward_dq_f32", "attention_backward_dq_bf16"),
                dims.grid(ATTN_DQ_ROWS, dims.h),
                (ATTN_THREADS, 1, 1),
                &args,
            )?;
            let mut args = vec![Ptr(dk), Ptr(dv)];
            args.extend(operands);
            args.extend(dims.tail());
            op.shaped(
                st.pick("attention_backward_dkv_f32", "attention_backward_dkv_bf16"),
                dims.grid(ATTN_DKV_ROWS, dims.kv),
                (ATTN_THREADS, 1, 1),
                &args,
            )
        }
        OpKind::CrossEntropyBackward => {
            let st = op.storage(0)?;
            let (rows, vocab) = (op.ty_in(0).rows(), op.ty_in(0).last_dim());
            op.stride(
                st.pick("cross_entropy_backward_f32", "cross_entropy_backward_bf16"),
                rows * vocab,
                &[
                    Ptr(op.output(0)?),
                    Ptr(op.input(0)?),
                    Ptr(op.input(2)?),
                    Ptr(op.input(1)?),
                    I32(op.int(rows, "rows")?),
                    I32(op.int(vocab, "vocabulary")?),
                    F32(1.0),
                ],
            )
        }
        OpKind::GradNormSq => {
            let st = op.storage(0)?;
            let n = op.ty_in(0).numel();
            let count = grad_norm_partials(n as usize) as u64;
            let partials = op.workspace(8 * count)?;
            op.shaped(
                st.pick("grad_norm_sq_partial_f32", "grad_norm_sq_partial_bf16"),
                (count as u32, 1, 1),
                (BLOCK, 1, 1),
                &[Ptr(partials), Ptr(op.input(0)?), I64(n as i64)],
            )?;
            op.shaped(
                "grad_norm_sq_finish",
                (1, 1, 1),
                (BLOCK, 1, 1),
                &[Ptr(op.output(0)?), Ptr(partials), I32(count as i32)],
            )
        }
        OpKind::ClipCoef { max_norm } => {
            let norms = (0..n_in)
                .map(|i| op.input(i))
                .collect::<Result<Vec<u64>>>()?;
            let bytes: Vec<u8> = norms.iter().flat_map(|p| p.to_ne_bytes()).collect();
            let table =
                op.s.constant(&b.ctx, ConstKey::Pointers(norms.clone()), &bytes)?;
            let coef = op.output(0)?;
            op.shaped(
                "clip_coef",
                (1, 1, 1),
                (1, 1, 1),
                &[
                    Ptr(coef),
                    Ptr(b.norm_slot()),
                    Ptr(table),
                    I32(op.int(n_in as u64, "gradients")?),
                    F32(*max_norm as f32),
                ],
            )
        }
        OpKind::AdamW {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            clipped,
        } => {
            if n_in < 4 + usize::from(*clipped) {
                return Err(op.bad(format!(
                    "takes param, grad, m, v{}",
                    match clipped {
                        true => " and the clip coefficient",
                        false => "",
                    }
                )));
            }
            let param = op.ty_in(0).clone();
            let n = param.numel();
            if op.ty_in(1).dtype != param.dtype
                || op.ty_in(2).dtype != DType::F32
                || op.ty_in(3).dtype != DType::F32
            {
                return Err(op.bad(format!(
                    "param {param}, grad {}, m {}, v {}: the kernels update a param with a \
                     gradient of its type and f32 moments",
                    op.ty_in(1),
                    op.ty_in(2),
                    op.ty_in(3)
                )));
            }
            let s = AdamWScalars::new(
                &AdamWConfig {
                    lr: *lr,
                    beta1: *beta1,
                    beta2: *beta2,
                    eps: *eps,
                    weight_decay: *weight_decay,
                },
                l.step,
            );
            let scale = match clipped {
                true => op.input(4)?,
                false => 0,
            };
            let tail = [
                I64(n as i64),
                Ptr(scale),
                F32(s.decay),
                F32(s.lerp_w),
                F32(s.beta2),
                F32(s.one_minus_beta2),
                F32(s.bc2_sqrt),
                F32(s.eps),
                F32(s.neg_step_size),
            ];
            let moments = [Ptr(op.input(1)?), Ptr(op.input(2)?), Ptr(op.input(3)?)];
            let mut args = Vec::with_capacity(14);
            let name = match op.storage(0)? {
                Storage::F32 => {
                    args.push(Ptr(op.input(0)?));
                    "adamw_f32"
                }
                Storage::Bf16 => {
                    let master = b.master_weight(l.inputs[2])?;
                    args.push(Ptr(b.gpu_addr(master, 4 * n)?));
                    args.push(Ptr(op.input(0)?));
                    "adamw_bf16"
                }
            };
            args.extend(moments);
            args.extend(tail);
            op.stride(name, n, &args)
        }
    }
}

/// Checks that every floating-point input of a fused linear op has input 0's dtype, and
/// returns it with its storage.
fn same_dtype(op: &Op<'_, '_>, inputs: usize) -> Result<(DType, Storage)> {
    let st = op.storage(0)?;
    let dtype = op.ty_in(0).dtype;
    if let Some(i) = (1..inputs).find(|&i| op.ty_in(i).dtype != dtype) {
        return Err(op.bad(format!(
            "input {i} is {} but x is {}; the operands must share one dtype",
            op.ty_in(i),
            op.ty_in(0)
        )));
    }
    Ok((dtype, st))
}

/// Projection `i` of a fused linear op into `y`: the matmul and the bias, as `linear` runs
/// them.
#[allow(clippy::too_many_arguments)]
fn fused_projection(
    op: &mut Op<'_, '_>,
    dtype: DType,
    st: Storage,
    layout: protrain_ir::WeightLayout,
    n: usize,
    bias: bool,
    i: usize,
    y: u64,
) -> Result<()> {
    let (rows, d_in) = (op.ty_in(0).rows(), op.ty_in(0).last_dim());
    let d_out = op.ty_in(1 + i).numel() / d_in.max(1);
    let d = LinearDims {
        rows: rows as usize,
        d_in: d_in as usize,
        d_out: d_out as usize,
    };
    let (x, w) = (op.input(0)?, op.input(1 + i)?);
    let gemm = op.s.gemm()?;
    // SAFETY: x, w and y hold tensors of these shapes (checked by `gpu_addr` against their
    // types); y overlaps neither input (the ordering contract).
    unsafe { gemm.linear_forward(dtype, layout, d, x, w, y)? };
    if bias {
        op.stride(
            st.pick("bias_add_f32", "bias_add_bf16"),
            rows * d_out,
            &[
                Ptr(y),
                Ptr(y),
                Ptr(op.input(1 + n + i)?),
                I64(rows as i64),
                I32(op.int(d_out, "output features")?),
            ],
        )?;
    }
    Ok(())
}

/// A fused linear op: each projection as `linear` computes it, then the epilogue with the
/// elementwise kernel its own kind runs (in place for the residual).
fn fused_linear(
    op: &mut Op<'_, '_>,
    n: usize,
    bias: bool,
    layout: protrain_ir::WeightLayout,
    epilogue: Epilogue,
) -> Result<()> {
    let (dtype, st) = same_dtype(op, op.l.op.inputs.len())?;
    let out = |op: &Op<'_, '_>, i: usize| op.output(i);
    match epilogue {
        Epilogue::None => {
            for i in 0..n {
                let y = out(op, i)?;
                fused_projection(op, dtype, st, layout, n, bias, i, y)?;
            }
            Ok(())
        }
        Epilogue::Gelu | Epilogue::Relu => {
            let (h, y) = (out(op, 0)?, out(op, 1)?);
            fused_projection(op, dtype, st, layout, n, bias, 0, h)?;
            let name = match epilogue {
                Epilogue::Gelu => st.pick("gelu_forward_f32", "gelu_forward_bf16"),
                _ => st.pick("relu_forward_f32", "relu_forward_bf16"),
            };
            let len = op.ty_out(0).numel();
            op.stride(name, len, &[Ptr(y), Ptr(h), I64(len as i64)])
        }
        Epilogue::Swiglu => {
            let (gate, up, y) = (out(op, 0)?, out(op, 1)?, out(op, 2)?);
            fused_projection(op, dtype, st, layout, n, bias, 0, gate)?;
            fused_projection(op, dtype, st, layout, n, bias, 1, up)?;
            let len = op.ty_out(2).numel();
            op.stride(
                st.pick("swiglu_forward_f32", "swiglu_forward_bf16"),
                len,
                &[Ptr(y), Ptr(gate), Ptr(up), I64(len as i64)],
            )
        }
        Epilogue::Residual => {
            let y = out(op, 0)?;
            fused_projection(op, dtype, st, layout, n, bias, 0, y)?;
            let residual = op.input(op.l.op.inputs.len() - 1)?;
            let len = op.ty_out(0).numel();
            op.stride(
                st.pick("add_forward_f32", "add_forward_bf16"),
                len,
                &[Ptr(y), Ptr(y), Ptr(residual), I64(len as i64)],
            )
        }
    }
}

/// The backward of a fused linear op, in the planned workspace laid out as
/// [`OpKind::workspace_bytes`] says: the epilogue's gradients, then each projection's matmul
/// (and bias column sum), last first, the input gradient summed in that order.
fn fused_linear_backward(
    op: &mut Op<'_, '_>,
    n: usize,
    bias: bool,
    layout: protrain_ir::WeightLayout,
    epilogue: Epilogue,
) -> Result<()> {
    let (dtype, st) = same_dtype(op, op.l.op.inputs.len())?;
    let types: Vec<TensorType> = (0..op.l.op.inputs.len())
        .map(|i| op.ty_in(i).clone())
        .collect();
    let refs: Vec<&TensorType> = types.iter().collect();
    let ws_bytes = op.l.op.kind.workspace_bytes(&refs);
    let ws = if ws_bytes > 0 {
        op.workspace(ws_bytes)?
    } else {
        0
    };
    let (rows, d_in) = (types[0].rows(), types[0].last_dim());
    let x_bytes = types[0].bytes();
    let kept = epilogue.has_output() && epilogue.keeps_projections();
    let kept_bytes: u64 = if kept {
        types[1 + n..1 + 2 * n].iter().map(TensorType::bytes).sum()
    } else {
        0
    };
    let contribution = ws + kept_bytes;
    let partials = contribution + if n >= 2 { x_bytes } else { 0 };
    let dy_index = 1 + n + if kept { n } else { 0 };
    // The gradient of each projection's result.
    let mut grads: Vec<u64> = Vec::with_capacity(n);
    match epilogue {
        Epilogue::None => {
            for i in 0..n {
                grads.push(op.input(1 + n + i)?);
            }
        }
        Epilogue::Residual => grads.push(op.input(dy_index)?),
        Epilogue::Gelu | Epilogue::Relu => {
            let (h, dy) = (op.input(1 + n)?, op.input(dy_index)?);
            let len = types[1 + n].numel();
            let name = match epilogue {
                Epilogue::Gelu => st.pick("gelu_backward_f32", "gelu_backward_bf16"),
                _ => st.pick("relu_backward_f32", "relu_backward_bf16"),
            };
            op.stride(name, len, &[Ptr(ws), Ptr(dy), Ptr(h), I64(len as i64)])?;
            grads.push(ws);
        }
        Epilogue::Swiglu => {
            let (gate, up, dy) = (op.input(1 + n)?, op.input(2 + n)?, op.input(dy_index)?);
            let len = types[1 + n].numel();
            let dup = ws + types[1 + n].bytes();
            op.stride(
                st.pick("swiglu_backward_f32", "swiglu_backward_bf16"),
                len,
                &[
                    Ptr(ws),
                    Ptr(dup),
                    Ptr(dy),
                    Ptr(gate),
                    Ptr(up),
                    I64(len as i64),
                ],
            )?;
            grads.extend([ws, dup]);
        }
    }
    let (x, dx) = (op.input(0)?, op.output(0)?);
    for i in (0..n).rev() {
        let d_out = types[1 + i].numel() / d_in.max(1);
        let d = LinearDims {
            rows: rows as usize,
            d_in: d_in as usize,
            d_out: d_out as usize,
        };
        let target = if i == n - 1 { dx } else { contribution };
        let (w, dw) = (op.input(1 + i)?, op.output(1 + i)?);
        let gemm = op.s.gemm()?;
        // SAFETY: every operand holds a tensor of these shapes (checked against their types,
        // the workspace against its planned size); the outputs and the workspace overlap no
        // input or each other (the ordering contract).
        unsafe { gemm.linear_backward(dtype, layout, d, x, w, grads[i], target, dw)? };
        if bias {
            let db = op.output(1 + n + i)?;
            op.column_sum(st, db, grads[i], rows, d_out, partials)?;
        }
        if i != n - 1 {
            let len = types[0].numel();
            op.stride(
                st.pick("add_forward_f32", "add_forward_bf16"),
                len,
                &[Ptr(dx), Ptr(dx), Ptr(contribution), I64(len as i64)],
            )?;
        }
    }
    Ok(())
}

/// `out = f(x)`, elementwise.
fn unary(op: &Op<'_, '_>, f32_name: &'static str, bf16_name: &'static str) -> Result<()> {
    let st = op.storage(0)?;
    let n = op.ty_in(0).numel();
    op.stride(
        st.pick(f32_name, bf16_name),
        n,
        &[Ptr(op.output(0)?), Ptr(op.input(0)?), I64(n as i64)],
    )
}

/// `out = f(a, b)`, elementwise.
fn binary(op: &Op<'_, '_>, f32_name: &'static str, bf16_name: &'static str) -> Result<()> {
    let st = op.storage(0)?;
    let n = op.ty_in(0).numel();
    op.stride(
        st.pick(f32_name, bf16_name),
        n,
        &[
            Ptr(op.output(0)?),
            Ptr(op.input(0)?),
            Ptr(op.input(1)?),
            I64(n as i64),
        ],
    )
}

/// `dx = dy * f'(x)` from inputs `x`, `dy`.
fn unary_backward(op: &Op<'_, '_>, f32_name: &'static str, bf16_name: &'static str) -> Result<()> {
    let st = op.storage(0)?;
    let n = op.ty_in(0).numel();
    op.stride(
        st.pick(f32_name, bf16_name),
        n,
        &[
            Ptr(op.output(0)?),
            Ptr(op.input(1)?),
            Ptr(op.input(0)?),
            I64(n as i64),
        ],
    )
}

/// RoPE forward, or its transpose for the backward, of input 0 `[B, T, heads * head_dim]`.
fn rope(
    op: &mut Op<'_, '_>,
    head_dim: u64,
    theta: f64,
    scaling: protrain_ir::RopeScaling,
    backward: bool,
) -> Result<()> {
    let st = op.storage(0)?;
    let x = op.ty_in(0).clone();
    if x.shape.len() != 3 || head_dim == 0 || !x.last_dim().is_multiple_of(head_dim) {
        return Err(op.bad(format!("{x} is not [B, T, heads * {head_dim}]")));
    }
    let heads = x.last_dim() / head_dim;
    let inv = op.inv_freq(head_dim, theta, scaling)?;
    let name = match backward {
        false => st.pick("rope_forward_f32", "rope_forward_bf16"),
        true => st.pick("rope_backward_f32", "rope_backward_bf16"),
    };
    op.stride(
        name,
        x.numel() / 2,
        &[
            Ptr(op.output(0)?),
            Ptr(op.input(0)?),
            Ptr(inv),
            I32(op.int(x.shape[0], "batch")?),
            I32(op.int(x.shape[1], "sequence")?),
            I32(op.int(heads, "heads")?),
            I32(op.int(head_dim, "head_dim")?),
        ],
    )
}

/// Layer norm's (`layer`) or RMS norm's backward from inputs `x`, `weight`, `dy`: recompute
/// the forward statistics into the planned workspace (the normalised rows the forward kernel
/// also writes land in `dx`, which the last kernel overwrites), sum the weight (and bias)
/// gradients over rows, then write `dx`.
fn norm_backward(op: &mut Op<'_, '_>, eps: f64, layer: bool) -> Result<()> {
    let st = op.storage(0)?;
    let wst = op.storage(1)?;
    let eps = eps as f32;
    let (rows, c) = (op.ty_in(0).rows(), op.ty_in(0).last_dim());
    let (rows_i, c_i) = (op.int(rows, "rows")?, op.int(c, "channels")?);
    let (x, w, dy) = (op.input(0)?, op.input(1)?, op.input(2)?);
    let dx = op.output(0)?;
    let dw = op.output(1)?;
    let chunks = column_sum_chunks(rows as usize) as u64;
    let sums = if layer { 2 } else { 1 };
    // The planned workspace: the statistics, then the partials of each summed parameter.
    let stats = if layer { 8 * rows } else { 4 * rows };
    let ws = op.workspace(stats + 4 * chunks * c * sums)?;
    let (mean, rstd) = match layer {
        true => (ws, ws + 4 * rows),
        false => (0, ws),
    };
    let (pw, pb) = (ws + stats, ws + stats + 4 * chunks * c);
    // 1. The forward statistics (and throwaway normalised rows in dx).
    match layer {
        true => op.rows(
            st.pick("layer_norm_forward_f32", "layer_norm_forward_bf16"),
            rows,
            &[
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
        )?,
        false => op.rows(
            st.pick("rms_norm_forward_f32", "rms_norm_forward_bf16"),
            rows,
            &[
                Ptr(dx),
                Ptr(rstd),
                Ptr(x),
                Ptr(w),
                I32(rows_i),
                I32(c_i),
                F32(eps),
            ],
        )?,
    }
    // 2. Per-chunk partial sums of dy * n (and dy), then their sums in chunk order.
    let grid = (
        c.div_ceil(u64::from(COLUMN_SUM_BLOCK.0)) as u32,
        op.grid_yz(chunks, "row chunks")?,
        1,
    );
    op.shaped(
        st.pick(
            "norm_backward_params_partial_f32",
            "norm_backward_params_partial_bf16",
        ),
        grid,
        (COLUMN_SUM_BLOCK.0, COLUMN_SUM_BLOCK.1, 1),
        &[
            Ptr(pw),
            Ptr(if layer { pb } else { 0 }),
            Ptr(dy),
            Ptr(x),
            Ptr(mean),
            Ptr(rstd),
            I32(rows_i),
            I32(c_i),
            I32(COLUMN_SUM_ROWS_PER_CHUNK as i32),
        ],
    )?;
    let finish = wst.pick("column_sum_finish_f32", "column_sum_finish_bf16");
    let mut sums = vec![(dw, pw)];
    if layer {
        sums.push((op.output(2)?, pb));
    }
    for (dst, part) in sums {
        op.stride(
            finish,
            c,
            &[Ptr(dst), Ptr(part), I32(chunks as i32), I32(c_i), I32(0)],
        )?;
    }
    // 3. dx.
    match layer {
        true => op.rows(
            st.pick("layer_norm_backward_f32", "layer_norm_backward_bf16"),
            rows,
            &[
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
        false => op.rows(
            st.pick("rms_norm_backward_f32", "rms_norm_backward_bf16"),
            rows,
            &[
                Ptr(dx),
                Ptr(dy),
                Ptr(x),
                Ptr(w),
                Ptr(rstd),
                I32(rows_i),
                I32(c_i),
            ],
        ),
    }
}

/// Runs one op on the host optimizer stream, on the pinned region, with the host backend's
/// code: AdamW (f32, or bf16 with its f32 master weight), or any other kind through
/// [`dispatch::run`] when every operand is f32 (or i32) in the host region.
///
/// # Safety
///
/// The backend's ordering contract holds for the op's operands.
pub(super) unsafe fn host(b: &CudaBackend, h: &mut HostStream, l: &Launch<'_>) -> Result<Outcome> {
    let (graph, op) = (l.graph, l.op);
    let bad = |why: String| RuntimeError::BadSchedule(format!("{}: {why}", op.kind.mnemonic()));
    if l.inputs.len() != op.inputs.len() || l.outputs.len() != op.outputs.len() {
        return Err(bad(
            "the kernel was given the wrong number of addresses".into()
        ));
    }
    let ty = |v: protrain_ir::ValueId| &graph.value(v).ty;
    if let OpKind::AdamW { clipped, .. } = op.kind {
        if op.inputs.len() < 4 + usize::from(clipped) {
            return Err(bad(
                "takes param, grad, m, v and, when clipped, the coefficient".into(),
            ));
        }
        let param = ty(op.inputs[0]);
        let n = param.numel() as usize;
        // SAFETY (for every view below): the ordering contract gives this op its operands
        // alone while it runs; param, grad, m, v, the coefficient and the master weight are
        // distinct values at distinct homes, so the views do not overlap.
        let m = unsafe { b.host_slice_mut::<f32>(l.inputs[2], n)? };
        let v = unsafe { b.host_slice_mut::<f32>(l.inputs[3], n)? };
        let coef = match clipped {
            true => Some(unsafe { b.host_slice::<f32>(l.inputs[4], 1)? }[0]),
            false => None,
        };
        match (param.dtype, ty(op.inputs[1]).dtype) {
            (DType::F32, DType::F32) => {
                let p = unsafe { b.host_slice_mut::<f32>(l.inputs[0], n)? };
                let g = unsafe { b.host_slice::<f32>(l.inputs[1], n)? };
                dispatch::adamw(&op.kind, p, g, m, v, coef, l.step);
            }
            (DType::BF16, DType::BF16) => {
                let master_at = b.master_weight(l.inputs[2])?;
                let master = unsafe { b.host_slice_mut::<f32>(master_at, n)? };
                let p = unsafe { b.host_slice_mut::<half::bf16>(l.inputs[0], n)? };
                let g = unsafe { b.host_slice::<half::bf16>(l.inputs[1], n)? };
                // The widened gradient buffer grows to the largest parameter in the first
                // step and is reused after.
                h.widened.resize(n, 0.0);
                h.widened
                    .par_chunks_mut(1 << 16)
                    .zip(g.par_chunks(1 << 16))
                    .for_each(|(w, g)| {
                        for (w, g) in w.iter_mut().zip(g) {
                            *w = g.to_f32();
                        }
                    });
                dispatch::adamw(&op.kind, master, &h.widened, m, v, coef, l.step);
                p.par_chunks_mut(1 << 16)
                    .zip(master.par_chunks(1 << 16))
                    .for_each(|(p, m)| {
                        for (p, &m) in p.iter_mut().zip(m) {
                            *p = half::bf16::from_f32(m);
                        }
                    });
            }
            (p, g) => {
                return Err(bad(format!(
                    "a {p} parameter with a {g} gradient; the CPU Adam updates f32 or bf16 \
                     parameters from gradients of their own type"
                )))
            }
        }
        return Ok(Outcome::default());
    }
    // Any other kind: the host kernels, on f32 operands in the pinned region.
    for (i, &v) in op.inputs.iter().enumerate() {
        let t = ty(v);
        if !matches!(t.dtype, DType::F32 | DType::I32) {
            return Err(bad(format!(
                "input {i} is {t}; on the host optimizer stream only AdamW takes bf16"
            )));
        }
        b.gpu_addr(l.inputs[i], t.bytes())?;
        if l.inputs[i].space != protrain_ir::Space::Host {
            return Err(bad(format!(
                "input {i} is in the device arena, which the host optimizer stream cannot read"
            )));
        }
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
        outputs.push(unsafe { b.host_slice_mut::<f32>(l.outputs[i], t.numel() as usize)? });
    }
    let workspace: &mut [f32] = match l.workspace {
        // SAFETY: as for the outputs.
        Some((at, bytes)) => unsafe { b.host_slice_mut::<f32>(at, (bytes / 4) as usize)? },
        None => &mut [],
    };
    let inputs = HostInputs { b, l };
    dispatch::run(graph, op, l.prepared, &inputs, &mut outputs, workspace)
}

/// The inputs of a host-stream kernel, in the pinned region (checked before the kernel runs).
struct HostInputs<'a> {
    b: &'a CudaBackend,
    l: &'a Launch<'a>,
}

impl HostInputs<'_> {
    fn len(&self, i: usize) -> usize {
        self.l.graph.value(self.l.op.inputs[i]).ty.numel() as usize
    }
}

impl<'a> dispatch::Inputs<'a> for HostInputs<'a> {
    fn f32(&self, i: usize) -> &'a [f32] {
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
