//! The matmuls of linear layers on cuBLAS: bf16 storage with f32 accumulation, or f32 with
//! f32 compute (no TF32, so f32 schedules come close to the host backend's results).
//!
//! Tensors are row-major; cuBLAS is column-major. A row-major `[r, c]` matrix is the
//! column-major `[c, r]` matrix with leading dimension `c`, its transpose, so each product
//! `Y = A B` below is issued as `Y^T = B^T A^T`, with the operands' storage read as their
//! transposes. Every case is written out beside [`Gemm::linear_forward`] and
//! [`Gemm::linear_backward`].

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use cudarc::cublas::result as blas;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use cudarc::driver::CudaStream;
use protrain_ir::{DType, WeightLayout};

use crate::error::{Result, RuntimeError};

use cublasOperation_t::{CUBLAS_OP_N as N, CUBLAS_OP_T as T};

/// Shape of a linear layer: `x [rows, d_in]`, `y [rows, d_out]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearDims {
    /// Rows of `x` and `y` (batch times sequence).
    pub rows: usize,
    /// Input features.
    pub d_in: usize,
    /// Output features.
    pub d_out: usize,
}

/// A cuBLAS handle bound to one CUDA stream.
pub struct Gemm {
    blas: CudaBlas,
}

/// One column-major GEMM: `C [m, n] = op(A) [m, k] op(B) [k, n]` (+ `beta` C).
struct Call {
    ta: cublasOperation_t,
    tb: cublasOperation_t,
    m: usize,
    n: usize,
    k: usize,
    a: u64,
    lda: usize,
    b: u64,
    ldb: usize,
    c: u64,
    ldc: usize,
}

impl Gemm {
    /// A handle issuing on `stream`.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self> {
        let blas = CudaBlas::new(stream).map_err(|e| blas_error("creating a cuBLAS handle", e))?;
        Ok(Self { blas })
    }

    /// `y = x W^T` (`OutIn`, `W [d_out, d_in]`) or `y = x W` (`InOut`, `W [d_in, d_out]`);
    /// `y` overwritten. The bias, if any, is the caller's.
    ///
    /// # Safety
    ///
    /// `x`, `w` and `y` are device addresses of tensors of the given shape and dtype, `y`
    /// overlaps neither, and nothing else touches them until the stream's work is done.
    pub unsafe fn linear_forward(
        &self,
        dtype: DType,
        layout: WeightLayout,
        d: LinearDims,
        x: u64,
        w: u64,
        y: u64,
    ) -> Result<()> {
        // Column-major: Y^T [d_out, rows] = op(W) X^T, where X^T is x's storage (ld d_in).
        let call = match layout {
            // W's storage read column-major is W^T [d_in, d_out] (ld d_in): transpose it.
            WeightLayout::OutIn => Call {
                ta: T,
                tb: N,
                m: d.d_out,
                n: d.rows,
                k: d.d_in,
                a: w,
                lda: d.d_in,
                b: x,
                ldb: d.d_in,
                c: y,
                ldc: d.d_out,
            },
            // W's storage read column-major is W^T [d_out, d_in] (ld d_out): as it is.
            WeightLayout::InOut => Call {
                ta: N,
                tb: N,
                m: d.d_out,
                n: d.rows,
                k: d.d_in,
                a: w,
                lda: d.d_out,
                b: x,
                ldb: d.d_in,
                c: y,
                ldc: d.d_out,
            },
        };
        // SAFETY: the caller's contract.
        unsafe { self.run(dtype, &call, "linear forward") }
    }

    /// `dx = dy W` (`OutIn`) or `dy W^T` (`InOut`), and `dW = dy^T x` (`OutIn`, `[d_out,
    /// d_in]`) or `x^T dy` (`InOut`, `[d_in, d_out]`); both overwritten. The bias gradient is
    /// the caller's.
    ///
    /// # Safety
    ///
    /// As [`Gemm::linear_forward`], for `x`, `w`, `dy` (read) and `dx`, `dw` (written).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn linear_backward(
        &self,
        dtype: DType,
        layout: WeightLayout,
        d: LinearDims,
        x: u64,
        w: u64,
        dy: u64,
        dx: u64,
        dw: u64,
    ) -> Result<()> {
        // dX^T [d_in, rows] = op(W) dY^T, dY^T being dy's storage (ld d_out).
        let dx_call = match layout {
            // W's storage is W^T [d_in, d_out] column-major (ld d_in); dX^T = W^T dY^T.
            WeightLayout::OutIn => Call {
                ta: N,
                tb: N,
                m: d.d_in,
                n: d.rows,
                k: d.d_out,
                a: w,
                lda: d.d_in,
                b: dy,
                ldb: d.d_out,
                c: dx,
                ldc: d.d_in,
            },
            // W's storage is W^T [d_out, d_in] column-major (ld d_out); dX^T = W dY^T.
            WeightLayout::InOut => Call {
                ta: T,
                tb: N,
                m: d.d_in,
                n: d.rows,
                k: d.d_out,
                a: w,
                lda: d.d_out,
                b: dy,
                ldb: d.d_out,
                c: dx,
                ldc: d.d_in,
            },
        };
        let dw_call = match layout {
            // dW [d_out, d_in] row-major is dW^T [d_in, d_out] column-major (ld d_in):
            // dW^T = X^T dY, with X^T x's storage and dY the transpose of dy's storage.
            WeightLayout::OutIn => Call {
                ta: N,
                tb: T,
                m: d.d_in,
                n: d.d_out,
                k: d.rows,
                a: x,
                lda: d.d_in,
                b: dy,
                ldb: d.d_out,
                c: dw,
                ldc: d.d_in,
            },
            // dW [d_in, d_out] row-major is dW^T [d_out, d_in] column-major (ld d_out):
            // dW^T = dY^T X, with dY^T dy's storage and X the transpose of x's storage.
            WeightLayout::InOut => Call {
                ta: N,
                tb: T,
                m: d.d_out,
                n: d.d_in,
                k: d.rows,
                a: dy,
                lda: d.d_out,
                b: x,
                ldb: d.d_in,
                c: dw,
                ldc: d.d_out,
            },
        };
        // SAFETY: the caller's contract.
        unsafe {
            self.run(dtype, &dx_call, "linear backward (input gradient)")?;
            self.run(dtype, &dw_call, "linear backward (weight gradient)")
        }
    }

    /// Issues one GEMM with `beta = 0`.
    ///
    /// # Safety
    ///
    /// The addresses hold matrices of the call's shapes and leading dimensions in `dtype`.
    unsafe fn run(&self, dtype: DType, c: &Call, what: &str) -> Result<()> {
        let data = match dtype {
            DType::F32 => cudaDataType::CUDA_R_32F,
            DType::BF16 => cudaDataType::CUDA_R_16BF,
            other => {
                return Err(RuntimeError::BadSchedule(format!(
                    "{what}: the CUDA backend runs matmuls in f32 and bf16, not {other}; compile \
                     with dtype bf16 or f32"
                )))
            }
        };
        let int = |v: usize, name: &str| {
            c_int::try_from(v).map_err(|_| {
                RuntimeError::BadSchedule(format!(
                    "{what}: {name} = {v} is beyond cuBLAS's 32-bit sizes; use a smaller batch"
                ))
            })
        };
        let (m, n, k) = (int(c.m, "m")?, int(c.n, "n")?, int(c.k, "k")?);
        let (lda, ldb, ldc) = (int(c.lda, "lda")?, int(c.ldb, "ldb")?, int(c.ldc, "ldc")?);
        if m == 0 || n == 0 {
            return Ok(());
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the handle is live and bound to the stream; alpha and beta are host f32s
        // (the default pointer mode) matching the f32 compute type; the operands are the
        // caller's contract. k = 0 writes beta * C = 0, as the product of empty matrices.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                c.ta,
                c.tb,
                m,
                n,
                k,
                (&alpha as *const f32).cast::<c_void>(),
                c.a as *const c_void,
                data,
                lda,
                c.b as *const c_void,
                data,
                ldb,
                (&beta as *const f32).cast::<c_void>(),
                c.c as *mut c_void,
                data,
                ldc,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| blas_error(what, e))
    }
}

/// A failed cuBLAS call.
fn blas_error(during: &str, e: blas::CublasError) -> RuntimeError {
    RuntimeError::Cuda {
        during: during.to_string(),
        detail: format!("{:?}", e.0),
        hint: "check that the GPU is not out of memory (`nvidia-smi`) and that libcublas.so.13 \
               matches the driver; rerun with CUDA_LAUNCH_BLOCKING=1 to find the failing call"
            .into(),
    }
}
