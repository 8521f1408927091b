//! The matmuls of linear layers on cuBLAS: bf16 or f16 storage with f32 accumulation, or f32 with
//! f32 compute (no TF32, so f32 schedules come close to the host backend's results).
//!
//! Tensors are row-major; cuBLAS is column-major. A row-major `[r, c]` matrix is the
//! column-major `[c, r]` matrix with leading dimension `c`, its transpose, so each product
//! `Y = A B` below is issued as `Y^T = B^T A^T`, with the operands' storage read as their
//! transposes. Every case is written out in `forward_call` and `backward_calls`, which build
//! the GEMM descriptions without a GPU, so the tests below execute them with a host model of
//! cuBLAS's semantics and compare against the host kernels.
//!
//! A linear layer's forward with a bias, a GELU or a residual runs as one `cublasLtMatmul`
//! ([`Matmul`], built by [`forward_matmul`]): cuBLASLt's epilogues add the bias
//! (`CUBLASLT_EPILOGUE_BIAS`, one element per output feature), apply the tanh GELU with its
//! input kept for the backward (`CUBLASLT_EPILOGUE_GELU_AUX_BIAS`, or `_GELU_AUX` without a
//! bias) and add the residual (`beta = 1` with C the residual), in f32 before the one rounding
//! to the storage type. The GELU's input is kept only where its leading dimension is a
//! multiple of [`crate::dispatch::GELU_AUX_LD_MULTIPLE`] elements, as cuBLASLt requires;
//! elsewhere the GELU is the caller's separate pass.
//!
//! Workspace. Each handle pair (cuBLAS and cuBLASLt, one per stream) owns one device
//! workspace, allocated when the pair is made ([`workspace_bytes`]): cuBLAS is given it with
//! `cublasSetWorkspace` and every `cublasLtMatmul` with its arguments, so no GEMM allocates;
//! the hardware profile's reserved bytes cover it.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex};

use cudarc::cublas::result as blas;
use cudarc::cublas::sys as cublas_sys;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys as lt_sys;
use cudarc::cublaslt::sys::cublasLtEpilogue_t as LtEpilogue;
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::CudaStream;
use protrain_ir::{DType, WeightLayout};

use super::driver::DeviceMemory;
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

/// A cuBLAS handle and a cuBLASLt handle bound to one CUDA stream, with their workspace,
/// destroyed on drop without unwrapping: cudarc's `CudaBlas` unwraps `cublasDestroy`, which
/// fails after a sticky kernel error, and a panic while a panic unwinds aborts the process (a
/// test binary with it).
pub struct Gemm {
    handle: cublas_sys::cublasHandle_t,
    lt: lt_sys::cublasLtHandle_t,
    /// The workspace both handles use (their calls are ordered on the one stream); freed
    /// after the handles are destroyed (fields drop after `Drop::drop`).
    workspace: DeviceMemory,
    /// The cuBLASLt descriptors and algorithm of each distinct matmul shape, made on its first
    /// call and reused: a step's matmuls query no heuristic and create no descriptor.
    plans: Mutex<HashMap<LtKey, LtPlan>>,
    /// Kept alive as long as the handle issues on it.
    _stream: Arc<CudaStream>,
}

// SAFETY: a cuBLAS handle may be used from any thread, one at a time; `Gemm` is owned by one
// device stream, whose calls come from one thread at a time.
unsafe impl Send for Gemm {}
// SAFETY: as above; `&Gemm` issues on the handle only from the stream's thread.
unsafe impl Sync for Gemm {}

impl Drop for Gemm {
    fn drop(&mut self) {
        let (handle, light) = (self.handle, self.lt);
        let plans = std::mem::take(self.plans.get_mut().unwrap_or_else(|e| e.into_inner()));
        drop(plans);
        // SAFETY: created in `Gemm::new`, destroyed once, here.
        release(|| unsafe { blas::destroy_handle(handle) });
        if !light.is_null() {
            // SAFETY: as above.
            release(|| unsafe { lt::destroy_handle(light) });
        }
    }
}

/// Runs `destroy`, dropping its error: a resource that cannot be released (after a sticky
/// kernel error the context is gone anyway) must not panic from `Drop`.
fn release<E>(destroy: impl FnOnce() -> std::result::Result<(), E>) {
    let _ = destroy();
}

/// One column-major GEMM: `C [m, n] = op(A) [m, k] op(B) [k, n]` (+ `beta` C).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Call {
    /// How A is read (as stored, or transposed).
    pub ta: cublasOperation_t,
    /// How B is read.
    pub tb: cublasOperation_t,
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// A's device address.
    pub a: u64,
    /// A's leading dimension.
    pub lda: usize,
    /// B's device address.
    pub b: u64,
    /// B's leading dimension.
    pub ldb: usize,
    /// C's device address (overwritten).
    pub c: u64,
    /// C's leading dimension.
    pub ldc: usize,
}

/// A strided-batched GEMM (`cublasGemmStridedBatchedEx`): for `i in 0..batch`,
/// `C_i = alpha op(A_i) op(B_i) + beta C_i` with `X_i = X + i * stride_x` (elements of X's
/// type). Attention's products, one batch of KV heads at a time (`launch.rs`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Batched {
    /// The first product's description (addresses of `A_0`, `B_0`, `C_0`).
    pub first: Call,
    /// How many products.
    pub batch: usize,
    /// Elements between consecutive `A_i`.
    pub stride_a: usize,
    /// Elements between consecutive `B_i`.
    pub stride_b: usize,
    /// Elements between consecutive `C_i`.
    pub stride_c: usize,
    /// The product's factor.
    pub alpha: f32,
    /// C's factor: 0 (overwrite) or 1 (accumulate).
    pub beta: f32,
}

/// The GEMM computing `y = x W^T` (`OutIn`) or `y = x W` (`InOut`) from the addresses of `x`
/// `[rows, d_in]`, `w` and `y` `[rows, d_out]`. Builds the description only; issues nothing.
pub fn forward_call(layout: WeightLayout, d: LinearDims, x: u64, w: u64, y: u64) -> Call {
    // Column-major: Y^T [d_out, rows] = op(W) X^T, where X^T is x's storage (ld d_in).
    match layout {
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
    }
}

/// The two GEMMs of the backward of [`forward_call`]'s product, in issue order: the input
/// gradient `dx` `[rows, d_in]`, then the weight gradient `dw` (in `layout`), from the
/// addresses of `x`, `w` and `dy` `[rows, d_out]`. Builds the descriptions only; issues
/// nothing. The two are independent (neither reads what the other writes).
pub fn backward_calls(
    layout: WeightLayout,
    d: LinearDims,
    x: u64,
    w: u64,
    dy: u64,
    dx: u64,
    dw: u64,
) -> [Call; 2] {
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
    [dx_call, dw_call]
}

/// Where a GELU epilogue keeps its input (the product plus the bias), for the backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Aux {
    /// Its device address, laid out as D (column-major, `ld` elements between columns).
    pub at: u64,
    /// Its leading dimension, a multiple of [`crate::dispatch::GELU_AUX_LD_MULTIPLE`] and at
    /// least D's rows.
    pub ld: usize,
}

/// One `cublasLtMatmul`: `D = op(A) op(B) + C + bias`, then the GELU where asked, with f32
/// compute and one rounding of each stored result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Matmul {
    /// The product, with D at `gemm.c` (leading dimension `gemm.ldc`).
    pub gemm: Call,
    /// C, added with `beta = 1` (laid out as D); `None` for `beta = 0`.
    pub residual: Option<u64>,
    /// The bias, one element per row of D (an output feature), in D's type.
    pub bias: Option<u64>,
    /// With a GELU: where its input is kept; D gets the GELU of it.
    pub gelu: Option<Aux>,
}

impl Matmul {
    /// The cuBLASLt epilogue that computes it.
    pub fn epilogue(&self) -> LtEpilogue {
        match (self.bias.is_some(), self.gelu.is_some()) {
            (false, false) => LtEpilogue::CUBLASLT_EPILOGUE_DEFAULT,
            (true, false) => LtEpilogue::CUBLASLT_EPILOGUE_BIAS,
            (false, true) => LtEpilogue::CUBLASLT_EPILOGUE_GELU_AUX,
            (true, true) => LtEpilogue::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
        }
    }
}

/// What a linear layer's forward adds to its product in the matmul's epilogue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fused {
    /// Nothing beyond the bias.
    Plain,
    /// The residual at this address (`y = x W + b + residual`).
    Residual(u64),
    /// The tanh GELU (`h = x W + b`, `y = gelu(h)`), its input `h` kept at this address.
    Gelu(u64),
}

/// Whether cuBLASLt can keep a GELU's input of `d_out` features per row (its leading
/// dimension): otherwise the GELU runs as its own pass after the matmul.
pub fn gelu_fusable(d_out: usize) -> bool {
    crate::dispatch::gelu_in_matmul(d_out)
}

/// The matmul of [`forward_call`]'s product into `y`, with the bias (`[d_out]`) and what
/// `fused` adds in its epilogue. Builds the description only; issues nothing. With
/// [`Fused::Gelu`], `gelu_fusable(d.d_out)` must hold (the caller's check): the kept input
/// `h [rows, d_out]` has leading dimension `d_out`.
pub fn forward_matmul(
    layout: WeightLayout,
    d: LinearDims,
    (x, w, y): (u64, u64, u64),
    bias: Option<u64>,
    fused: Fused,
) -> Matmul {
    let gemm = forward_call(layout, d, x, w, y);
    let (residual, gelu) = match fused {
        Fused::Plain => (None, None),
        Fused::Residual(r) => (Some(r), None),
        Fused::Gelu(h) => (None, Some(Aux { at: h, ld: d.d_out })),
    };
    Matmul {
        gemm,
        residual,
        bias,
        gelu,
    }
}

/// Bytes of the workspace each stream's handles get: NVIDIA's recommendation for
/// `cublasSetWorkspace` and cuBLASLt (cuBLAS documentation, "cublasSetWorkspace"): 32 MiB on
/// Hopper (compute capability 9) and later, 4 MiB before.
pub fn workspace_bytes(compute_major: i32) -> usize {
    if compute_major >= 9 {
        32 << 20
    } else {
        4 << 20
    }
}

/// The strictest alignment (a power of two up to 256 bytes, cuBLASLt's default requirement)
/// that `addr` has: the matmul's preferences tell cuBLASLt the operands' real alignment, so
/// its heuristic picks no kernel that needs more.
pub fn alignment(addr: u64) -> u32 {
    if addr == 0 {
        256
    } else {
        (1u64 << addr.trailing_zeros().min(8)) as u32
    }
}

/// What makes two matmuls share descriptors and an algorithm: everything but the addresses
/// (the alignments of A, B, C and D stand for them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct LtKey {
    dtype: DType,
    ta: cublasOperation_t,
    tb: cublasOperation_t,
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    ldc: usize,
    epilogue: LtEpilogue,
    aux_ld: usize,
    residual: bool,
    align: [u32; 4],
}

/// The descriptors and the chosen algorithm of one [`LtKey`], destroyed on drop.
struct LtPlan {
    desc: lt_sys::cublasLtMatmulDesc_t,
    layouts: [lt_sys::cublasLtMatrixLayout_t; 3],
    algo: lt_sys::cublasLtMatmulAlgo_t,
}

impl Drop for LtPlan {
    fn drop(&mut self) {
        for &layout in &self.layouts {
            if !layout.is_null() {
                // SAFETY: made in `LtPlan::new`, destroyed once, here.
                release(|| unsafe { lt::destroy_matrix_layout(layout) });
            }
        }
        if !self.desc.is_null() {
            let desc = self.desc;
            // SAFETY: as above.
            release(|| unsafe { lt::destroy_matmul_desc(desc) });
        }
    }
}

/// Sets one attribute of a matmul descriptor to `value`.
///
/// # Safety
///
/// `desc` is live and `T` is the attribute's documented type.
unsafe fn set_desc<T>(
    desc: lt_sys::cublasLtMatmulDesc_t,
    attr: lt_sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> std::result::Result<(), lt::CublasError> {
    // SAFETY: the caller's contract; `value` lives through the call, which copies it.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            attr,
            (value as *const T).cast::<c_void>(),
            std::mem::size_of::<T>(),
        )
    }
}

impl LtPlan {
    /// The descriptors of `key` and the heuristic's first algorithm for them, within
    /// `workspace` bytes.
    fn new(
        light: lt_sys::cublasLtHandle_t,
        key: &LtKey,
        workspace: usize,
    ) -> std::result::Result<Self, lt::CublasError> {
        use lt_sys::cublasLtMatmulDescAttributes_t as D;
        use lt_sys::cublasLtMatmulPreferenceAttributes_t as P;
        let mut plan = LtPlan {
            desc: std::ptr::null_mut(),
            layouts: [std::ptr::null_mut(); 3],
            algo: lt_sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        let data = match key.dtype {
            DType::BF16 => lt_sys::cudaDataType::CUDA_R_16BF,
            DType::F16 => lt_sys::cudaDataType::CUDA_R_16F,
            _ => lt_sys::cudaDataType::CUDA_R_32F,
        };
        // TRANSA and TRANSB are `int32_t` holding `cublasOperation_t`'s values.
        let op = |o: cublasOperation_t| o as i32;
        plan.desc = lt::create_matmul_desc(
            lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lt_sys::cudaDataType::CUDA_R_32F,
        )?;
        let stored =
            |op, rows: usize, cols: usize| if op == N { (rows, cols) } else { (cols, rows) };
        let (a_rows, a_cols) = stored(key.ta, key.m, key.k);
        let (b_rows, b_cols) = stored(key.tb, key.k, key.n);
        for (slot, (rows, cols, ld)) in [
            (a_rows, a_cols, key.lda),
            (b_rows, b_cols, key.ldb),
            (key.m, key.n, key.ldc),
        ]
        .into_iter()
        .enumerate()
        {
            plan.layouts[slot] =
                lt::create_matrix_layout(data, rows as u64, cols as u64, ld as i64)?;
        }
        // SAFETY: a live descriptor; each value has its attribute's documented type.
        unsafe {
            set_desc(plan.desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &op(key.ta))?;
            set_desc(plan.desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &op(key.tb))?;
            set_desc(plan.desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE, &key.epilogue)?;
            if key.epilogue != LtEpilogue::CUBLASLT_EPILOGUE_DEFAULT {
                set_desc(plan.desc, D::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &data)?;
            }
            if key.aux_ld > 0 {
                set_desc(
                    plan.desc,
                    D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                    &(key.aux_ld as i64),
                )?;
                set_desc(
                    plan.desc,
                    D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE,
                    &data,
                )?;
            }
        }
        let pref = lt::create_matmul_pref()?;
        let chosen = (|| {
            let set = |attr, value: *const c_void, size| {
                // SAFETY: a live preference; the value has the attribute's type.
                unsafe { lt::set_matmul_pref_attribute(pref, attr, value, size) }
            };
            let bytes = workspace as u64;
            set(
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&bytes as *const u64).cast(),
                8,
            )?;
            for (attr, align) in [
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            ]
            .into_iter()
            .zip(key.align)
            {
                set(attr, (&align as *const u32).cast(), 4)?;
            }
            let [a, b, cd] = plan.layouts;
            // SAFETY: live descriptors of this handle; C and D share a layout.
            unsafe { lt::get_matmul_algo_heuristic(light, plan.desc, a, b, cd, cd, pref) }
        })();
        // SAFETY: made above, destroyed once.
        release(|| unsafe { lt::destroy_matmul_pref(pref) });
        plan.algo = chosen?.algo;
        Ok(plan)
    }
}

impl Gemm {
    /// A handle issuing on `stream`.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self> {
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| super::driver::driver_error("making the CUDA context current", e))?;
        let ctx = stream.context().clone();
        let major = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .map_err(|e| super::driver::driver_error("reading the compute capability", e))?;
        let workspace = DeviceMemory::uninit(&ctx, workspace_bytes(major), "cuBLAS workspace")?;
        let handle =
            blas::create_handle().map_err(|e| blas_error("creating a cuBLAS handle", e))?;
        let mut gemm = Self {
            handle,
            lt: std::ptr::null_mut(),
            workspace,
            plans: Mutex::new(HashMap::new()),
            _stream: stream,
        };
        // SAFETY: a live handle and a live stream of the current context.
        unsafe { blas::set_stream(handle, gemm._stream.cu_stream() as _) }
            .map_err(|e| blas_error("binding a cuBLAS handle to its stream", e))?;
        // SAFETY: a live handle; the workspace is a device allocation of the handle's context
        // that outlives it, used only by work on the handle's stream.
        unsafe {
            cublas_sys::cublasSetWorkspace_v2(
                handle,
                gemm.workspace.ptr() as *mut c_void,
                gemm.workspace.len(),
            )
        }
        .result()
        .map_err(|e| blas_error("giving cuBLAS its workspace", e))?;
        gemm.lt = lt::create_handle().map_err(|e| lt_error("creating a cuBLASLt handle", e))?;
        Ok(gemm)
    }

    /// Issues one cuBLASLt matmul with its epilogue on the stream, with the handle's
    /// workspace.
    ///
    /// # Safety
    ///
    /// The addresses hold matrices (and the bias vector) of the matmul's shapes and leading
    /// dimensions in `dtype`; D and the GELU's kept input overlap no input or each other.
    pub unsafe fn run_matmul(&self, dtype: DType, mm: &Matmul, what: &str) -> Result<()> {
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(RuntimeError::BadSchedule(format!(
                "{what}: the CUDA backend runs matmuls in f32, bf16 and f16, not {dtype}; \
                 compile with dtype f32, bf16 or f16"
            )));
        }
        let c = &mm.gemm;
        for (v, name) in [
            (c.m, "m"),
            (c.n, "n"),
            (c.k, "k"),
            (c.lda, "lda"),
            (c.ldb, "ldb"),
            (c.ldc, "ldc"),
        ] {
            if c_int::try_from(v).is_err() {
                return Err(RuntimeError::BadSchedule(format!(
                    "{what}: {name} = {v} is beyond cuBLAS's 32-bit sizes; use a smaller batch"
                )));
            }
        }
        if c.m == 0 || c.n == 0 {
            return Ok(());
        }
        let input_c = mm.residual.unwrap_or(c.c);
        let key = LtKey {
            dtype,
            ta: c.ta,
            tb: c.tb,
            m: c.m,
            n: c.n,
            k: c.k,
            lda: c.lda,
            ldb: c.ldb,
            ldc: c.ldc,
            epilogue: mm.epilogue(),
            aux_ld: mm.gelu.map_or(0, |g| g.ld),
            residual: mm.residual.is_some(),
            align: [
                alignment(c.a),
                alignment(c.b),
                alignment(input_c),
                alignment(c.c),
            ],
        };
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        let plan = match plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => v.insert(
                LtPlan::new(self.lt, &key, self.workspace.len())
                    .map_err(|e| lt_error(&format!("{what}: choosing a cuBLASLt algorithm"), e))?,
            ),
        };
        use lt_sys::cublasLtMatmulDescAttributes_t as D;
        // SAFETY: a live descriptor of this handle, used by one thread at a time (the lock);
        // pointer attributes are `void*`. The call below reads them when it is made.
        unsafe {
            if let Some(bias) = mm.bias {
                set_desc(
                    plan.desc,
                    D::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    &(bias as *const c_void),
                )
                .map_err(|e| lt_error(what, e))?;
            }
            if let Some(aux) = mm.gelu {
                set_desc(
                    plan.desc,
                    D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                    &(aux.at as *const c_void),
                )
                .map_err(|e| lt_error(what, e))?;
            }
        }
        let alpha = 1.0f32;
        let beta = if mm.residual.is_some() { 1.0f32 } else { 0.0 };
        let [a, b, cd] = plan.layouts;
        // SAFETY: the handle, descriptors and algorithm are live; alpha and beta are host f32s
        // (the default pointer mode) of the f32 scale type; the workspace is the handle's, on
        // its stream; the operands are the caller's contract.
        unsafe {
            lt::matmul(
                self.lt,
                plan.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                c.a as *const c_void,
                a,
                c.b as *const c_void,
                b,
                input_c as *const c_void,
                cd,
                c.c as *mut c_void,
                cd,
                &plan.algo,
                self.workspace.ptr() as *mut c_void,
                self.workspace.len(),
                self._stream.cu_stream() as _,
            )
        }
        .map_err(|e| lt_error(what, e))
    }

    /// `y = x W^T` (`OutIn`, `W [d_out, d_in]`) or `y = x W` (`InOut`, `W [d_in, d_out]`);
    /// `y` overwritten. The bias, if any, is the caller's. The GEMM is `forward_call`'s.
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
        let call = forward_call(layout, d, x, w, y);
        // SAFETY: the caller's contract.
        unsafe { self.run(dtype, &call, "linear forward") }
    }

    /// Issues one GEMM with `beta = 0`.
    ///
    /// # Safety
    ///
    /// The addresses hold matrices of the call's shapes and leading dimensions in `dtype`.
    pub unsafe fn run(&self, dtype: DType, c: &Call, what: &str) -> Result<()> {
        let data = match dtype {
            DType::F32 => cudaDataType::CUDA_R_32F,
            DType::BF16 => cudaDataType::CUDA_R_16BF,
            DType::F16 => cudaDataType::CUDA_R_16F,
            other => {
                return Err(RuntimeError::BadSchedule(format!(
                    "{what}: the CUDA backend runs matmuls in f32, bf16 and f16, not {other}; \
                     compile with dtype f32, bf16 or f16"
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
                self.handle,
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

impl Gemm {
    /// Issues a strided-batched GEMM with A and B in `ab`, C in `c_type`, f32 compute (no
    /// TF32), the default algorithm (tensor cores for bf16 and f16).
    ///
    /// # Safety
    ///
    /// Every `A_i`, `B_i`, `C_i` holds a matrix of the call's shape and leading dimension in
    /// its type; no `C_i` overlaps another or an input.
    pub unsafe fn run_batched(
        &self,
        ab: DType,
        c_type: DType,
        g: &Batched,
        what: &str,
    ) -> Result<()> {
        let data = |dtype: DType| match dtype {
            DType::F32 => Ok(cudaDataType::CUDA_R_32F),
            DType::BF16 => Ok(cudaDataType::CUDA_R_16BF),
            DType::F16 => Ok(cudaDataType::CUDA_R_16F),
            other => Err(RuntimeError::BadSchedule(format!(
                "{what}: the CUDA backend runs attention in f32, bf16 and f16, not {other}; \
                 compile with dtype f32, bf16 or f16"
            ))),
        };
        let (ab_type, c_data) = (data(ab)?, data(c_type)?);
        let int = |v: usize, name: &str| {
            c_int::try_from(v).map_err(|_| {
                RuntimeError::BadSchedule(format!(
                    "{what}: {name} = {v} is beyond cuBLAS's 32-bit sizes; use a smaller batch"
                ))
            })
        };
        let c = &g.first;
        let (m, n, k) = (int(c.m, "m")?, int(c.n, "n")?, int(c.k, "k")?);
        let (lda, ldb, ldc) = (int(c.lda, "lda")?, int(c.ldb, "ldb")?, int(c.ldc, "ldc")?);
        let batch = int(g.batch, "batch")?;
        if m == 0 || n == 0 || batch == 0 {
            return Ok(());
        }
        let stride = |v: usize| v as std::ffi::c_longlong;
        // SAFETY: the handle is live and bound to the stream; alpha and beta are host f32s
        // matching the f32 compute type; the operands are the caller's contract.
        unsafe {
            blas::gemm_strided_batched_ex(
                self.handle,
                c.ta,
                c.tb,
                m,
                n,
                k,
                (&g.alpha as *const f32).cast::<c_void>(),
                c.a as *const c_void,
                ab_type,
                lda,
                stride(g.stride_a),
                c.b as *const c_void,
                ab_type,
                ldb,
                stride(g.stride_b),
                (&g.beta as *const f32).cast::<c_void>(),
                c.c as *mut c_void,
                c_data,
                ldc,
                stride(g.stride_c),
                batch,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| blas_error(what, e))
    }
}

/// A failed cuBLASLt call.
fn lt_error(during: &str, e: lt::CublasError) -> RuntimeError {
    RuntimeError::Cuda {
        during: during.to_string(),
        detail: format!("{:?}", e.0),
        hint: "check that libcublasLt.so.13 matches the driver and that the GPU is not out of \
               memory (`nvidia-smi`); rerun with CUDA_LAUNCH_BLOCKING=1 to find the failing call"
            .into(),
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

#[cfg(test)]
mod tests {
    //! The GEMM descriptions executed by a host model of `cublasGemmEx`, against the host
    //! kernels: a wrong transpose flag, size, leading dimension or operand gives wrong numbers,
    //! reads past a buffer, or breaks one of cuBLAS's argument checks.

    use super::*;
    use crate::kernels;

    /// A release that fails while a panic unwinds (cuBLAS after a sticky kernel error) must
    /// not panic again: that aborts the test binary instead of failing one test. With
    /// cudarc's unwrapping `Drop` this test takes the whole binary down.
    #[test]
    fn a_failed_release_during_unwinding_does_not_abort() {
        struct Handle;
        impl Drop for Handle {
            fn drop(&mut self) {
                release(|| Err::<(), _>("CUBLAS_STATUS_INTERNAL_ERROR"));
            }
        }
        let unwound = std::panic::catch_unwind(|| {
            let _handle = Handle;
            panic!("a kernel failed");
        });
        assert!(unwound.is_err());
    }

    /// Host buffers standing in for device memory; an address names one whole buffer.
    #[derive(Default)]
    struct Memory(Vec<(u64, Vec<f32>)>);

    impl Memory {
        fn alloc(&mut self, data: Vec<f32>) -> u64 {
            // Far apart and unlike any size, so an address is never mistaken for a length.
            let addr = 0x10_0000 * (self.0.len() as u64 + 1);
            self.0.push((addr, data));
            addr
        }

        fn get(&self, addr: u64) -> std::result::Result<&[f32], String> {
            self.0
                .iter()
                .find(|(a, _)| *a == addr)
                .map(|(_, v)| &v[..])
                .ok_or_else(|| format!("no buffer at {addr:#x}"))
        }
    }

    /// Checks what `cublasGemmEx` checks of a stored operand of `rows x cols` (column-major,
    /// leading dimension `ld`), and that the operand lies inside its buffer.
    fn operand(
        name: &str,
        buf: &[f32],
        rows: usize,
        cols: usize,
        ld: usize,
    ) -> std::result::Result<(), String> {
        if ld < rows.max(1) {
            return Err(format!(
                "ld{name} = {ld} < max(1, {rows}): CUBLAS_STATUS_INVALID_VALUE"
            ));
        }
        let extent = if rows == 0 || cols == 0 {
            0
        } else {
            (cols - 1) * ld + rows
        };
        if extent > buf.len() {
            return Err(format!(
                "{name} [{rows} x {cols}] with ld {ld} reaches element {extent}, past its \
                 buffer of {}",
                buf.len()
            ));
        }
        Ok(())
    }

    /// Element `(i, j)` of `op(X)`, `X` stored column-major with leading dimension `ld`.
    fn at(buf: &[f32], op: cublasOperation_t, ld: usize, i: usize, j: usize) -> f32 {
        match op {
            N => buf[i + j * ld],
            _ => buf[j + i * ld],
        }
    }

    /// `cublasGemmEx` with `alpha = 1`, `beta = 0` on host f32 buffers (BLAS `sgemm`
    /// semantics): `C [m, n] = op(A) [m, k] op(B) [k, n]`, every matrix column-major, `A`
    /// stored `m x k` if `ta` is N else `k x m`, `B` stored `k x n` if `tb` is N else `n x k`.
    /// Writes only the `m x n` of `C` (so `k = 0` writes zeros). `Err` says which argument
    /// cuBLAS would reject or which operand reaches past its buffer.
    fn gemm(mem: &mut Memory, c: &Call) -> std::result::Result<(), String> {
        let stored = |op, rows, cols| if op == N { (rows, cols) } else { (cols, rows) };
        let (a, b) = (mem.get(c.a)?, mem.get(c.b)?);
        let (ar, ac) = stored(c.ta, c.m, c.k);
        operand("a", a, ar, ac, c.lda)?;
        let (br, bc) = stored(c.tb, c.k, c.n);
        operand("b", b, br, bc, c.ldb)?;
        operand("c", mem.get(c.c)?, c.m, c.n, c.ldc)?;
        if c.c == c.a || c.c == c.b {
            return Err("C aliases an input".into());
        }
        let mut out = Vec::with_capacity(c.m * c.n);
        for j in 0..c.n {
            for i in 0..c.m {
                let sum: f64 = (0..c.k)
                    .map(|p| at(a, c.ta, c.lda, i, p) as f64 * at(b, c.tb, c.ldb, p, j) as f64)
                    .sum();
                out.push((i, j, sum as f32));
            }
        }
        let dst = &mut mem.0.iter_mut().find(|(a, _)| *a == c.c).unwrap().1;
        for (i, j, v) in out {
            dst[i + j * c.ldc] = v;
        }
        Ok(())
    }

    /// Values in [-1, 1), reproducible from `seed`.
    fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    fn assert_near(what: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{what}: element {i} is {g}, the host kernel gives {w}"
            );
        }
    }

    /// One A, B pair run through the model, against a product worked out by hand.
    fn check_model(call: Call, a: &[f32], b: &[f32], c_len: usize, want: &[f32]) {
        let mut mem = Memory::default();
        let call = Call {
            a: mem.alloc(a.to_vec()),
            b: mem.alloc(b.to_vec()),
            c: mem.alloc(vec![f32::NAN; c_len]),
            ..call
        };
        gemm(&mut mem, &call).unwrap_or_else(|e| panic!("{call:?}: {e}"));
        let got = mem.get(call.c).unwrap();
        assert_eq!(got.len(), want.len(), "{call:?}: C's length");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            // NaN in `want` marks padding the GEMM must leave alone.
            assert!(
                g == w || (g.is_nan() && w.is_nan()),
                "{call:?}: C[{i}] is {g}, want {w}"
            );
        }
    }

    #[test]
    fn model_reads_operands_as_cublas_does() {
        // A = [[1, 3, 5], [2, 4, 6]], B = [[7, 10], [8, 11], [9, 12]],
        // A B = [[76, 103], [100, 136]], column-major [76, 100, 103, 136].
        let nn = Call {
            ta: N,
            tb: N,
            m: 2,
            n: 2,
            k: 3,
            a: 0,
            lda: 2,
            b: 0,
            ldb: 3,
            c: 0,
            ldc: 2,
        };
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = [7.0, 8.0, 9.0, 10.0, 11.0, 12.0];
        let ab = [76.0, 100.0, 103.0, 136.0];
        check_model(nn, &a, &b, 4, &ab);
        // A stored as A^T [3, 2] with ld 4 (padding NaN, never read); C with ld 3.
        let nan = f32::NAN;
        let a_t = [1.0, 3.0, 5.0, nan, 2.0, 4.0, 6.0, nan];
        let ab_ld3 = [76.0, 100.0, nan, 103.0, 136.0, nan];
        check_model(
            Call {
                ta: T,
                lda: 4,
                ldc: 3,
                ..nn
            },
            &a_t,
            &b,
            6,
            &ab_ld3,
        );
        // B stored as B^T [2, 3] with ld 2.
        let bt = [7.0, 10.0, 8.0, 11.0, 9.0, 12.0];
        check_model(
            Call {
                tb: T,
                ldb: 2,
                ..nn
            },
            &a,
            &bt,
            4,
            &ab,
        );
        check_model(
            Call {
                ta: T,
                lda: 4,
                tb: T,
                ldb: 2,
                ..nn
            },
            &a_t,
            &bt,
            4,
            &ab,
        );
    }

    #[test]
    fn model_rejects_what_cublas_rejects() {
        let mut mem = Memory::default();
        let (a, b, c) = (
            mem.alloc(vec![0.0; 6]),
            mem.alloc(vec![0.0; 6]),
            mem.alloc(vec![0.0; 4]),
        );
        let good = Call {
            ta: N,
            tb: N,
            m: 2,
            n: 2,
            k: 3,
            a,
            lda: 2,
            b,
            ldb: 3,
            c,
            ldc: 2,
        };
        assert_eq!(gemm(&mut mem, &good), Ok(()));
        let cases = [
            // op(A) = A [2, 3] needs lda >= m = 2.
            (Call { lda: 1, ..good }, "lda = 1 < max(1, 2)"),
            // op(A) = A^T: A is stored [3, 2], so lda >= k = 3.
            (Call { ta: T, ..good }, "lda = 2 < max(1, 3)"),
            // op(B) = B^T: B is stored [2, 3], so ldb >= n = 2 is valid, but ld 3 over 3
            // columns needs 8 elements.
            (
                Call { tb: T, ..good },
                "b [2 x 3] with ld 3 reaches element 8",
            ),
            (Call { ldc: 1, ..good }, "ldc = 1 < max(1, 2)"),
            (Call { c: a, ..good }, "C aliases an input"),
        ];
        for (call, want) in cases {
            let got = gemm(&mut mem, &call);
            assert!(
                got.as_ref().is_err_and(|e| e.contains(want)),
                "{call:?}: got {got:?}, want an error containing {want:?}"
            );
        }
    }

    /// Runs the forward and backward GEMMs of a linear layer of shape `d` in the model and
    /// compares `y`, `dx` and `dw` with the host kernels'.
    fn check_linear(layout: WeightLayout, d: LinearDims) {
        let what = format!("{layout:?} {d:?}");
        let (x, w, dy) = (
            values(1, d.rows * d.d_in),
            values(2, d.d_in * d.d_out),
            values(3, d.rows * d.d_out),
        );
        let mut y = vec![0.0; d.rows * d.d_out];
        kernels::linear_forward(&mut y, &x, &w, None, layout, d.rows, d.d_in, d.d_out);
        let (mut dx, mut dw) = (vec![0.0; d.rows * d.d_in], vec![0.0; d.d_in * d.d_out]);
        kernels::linear_backward(
            Some(&mut dx),
            &mut dw,
            None,
            &dy,
            &x,
            &w,
            layout,
            d.rows,
            d.d_in,
            d.d_out,
            false,
        );

        let mut mem = Memory::default();
        let (xa, wa, dya) = (mem.alloc(x), mem.alloc(w), mem.alloc(dy));
        let ya = mem.alloc(vec![f32::NAN; y.len()]);
        let dxa = mem.alloc(vec![f32::NAN; dx.len()]);
        let dwa = mem.alloc(vec![f32::NAN; dw.len()]);

        let call = forward_call(layout, d, xa, wa, ya);
        gemm(&mut mem, &call).unwrap_or_else(|e| panic!("{what} forward {call:?}: {e}"));
        assert_near(&format!("{what} y"), mem.get(ya).unwrap(), &y);

        let calls = backward_calls(layout, d, xa, wa, dya, dxa, dwa);
        for (call, name) in calls.iter().zip(["dx", "dw"]) {
            gemm(&mut mem, call).unwrap_or_else(|e| panic!("{what} {name} {call:?}: {e}"));
        }
        assert_near(&format!("{what} dx"), mem.get(dxa).unwrap(), &dx);
        assert_near(&format!("{what} dw"), mem.get(dwa).unwrap(), &dw);
    }

    #[test]
    fn calls_match_host_kernels_for_both_layouts() {
        let shapes = [
            (1, 1, 1),
            (1, 3, 5),
            (1, 5, 3),
            (4, 3, 5),
            (5, 7, 2),
            (3, 4, 4),
            (7, 1, 6),
            (2, 6, 1),
            (16, 9, 13),
        ];
        for (rows, d_in, d_out) in shapes {
            let d = LinearDims { rows, d_in, d_out };
            for layout in [WeightLayout::OutIn, WeightLayout::InOut] {
                check_linear(layout, d);
            }
        }
    }
}

/// A host model of `cublasGemmStridedBatchedEx` over byte-addressed memory, for the call
/// plans' tests (`launch.rs`): operands are addresses inside buffers, as on the device, in
/// f32, bf16 or f16.
#[cfg(test)]
pub(super) mod model {
    use super::*;
    use std::collections::HashSet;

    /// Device memory as host byte buffers, each at its own base address.
    #[derive(Default)]
    pub struct Bytes(Vec<(u64, Vec<u8>)>);

    fn size(dtype: DType) -> u64 {
        match dtype {
            DType::BF16 | DType::F16 => 2,
            _ => 4,
        }
    }

    impl Bytes {
        /// A buffer of `len` bytes at `base` (filled with NaN patterns, 0xff).
        pub fn alloc(&mut self, base: u64, len: u64) {
            self.0.push((base, vec![0xff; len as usize]));
        }

        fn locate(&self, addr: u64, len: u64) -> std::result::Result<(usize, usize), String> {
            self.0
                .iter()
                .position(|(b, v)| addr >= *b && addr + len <= b + v.len() as u64)
                .map(|i| (i, (addr - self.0[i].0) as usize))
                .ok_or_else(|| format!("{addr:#x} (+{len} bytes) lies in no buffer"))
        }

        /// The element of `dtype` at `addr`.
        pub fn read(&self, dtype: DType, addr: u64) -> std::result::Result<f32, String> {
            let n = size(dtype);
            let (i, at) = self.locate(addr, n)?;
            let b = &self.0[i].1[at..at + n as usize];
            Ok(match dtype {
                DType::BF16 => half::bf16::from_bits(u16::from_ne_bytes([b[0], b[1]])).to_f32(),
                DType::F16 => half::f16::from_bits(u16::from_ne_bytes([b[0], b[1]])).to_f32(),
                _ => f32::from_ne_bytes([b[0], b[1], b[2], b[3]]),
            })
        }

        /// Writes `v` as `dtype` (bf16 or f16 rounded to nearest even) at `addr`.
        pub fn write(
            &mut self,
            dtype: DType,
            addr: u64,
            v: f32,
        ) -> std::result::Result<(), String> {
            let n = size(dtype);
            let (i, at) = self.locate(addr, n)?;
            let dst = &mut self.0[i].1[at..at + n as usize];
            match dtype {
                DType::BF16 => {
                    dst.copy_from_slice(&half::bf16::from_f32(v).to_bits().to_ne_bytes())
                }
                DType::F16 => dst.copy_from_slice(&half::f16::from_f32(v).to_bits().to_ne_bytes()),
                _ => dst.copy_from_slice(&v.to_ne_bytes()),
            }
            Ok(())
        }

        /// `values` as `dtype` from `addr` on.
        pub fn store(&mut self, dtype: DType, addr: u64, values: &[f32]) {
            for (i, &v) in values.iter().enumerate() {
                self.write(dtype, addr + size(dtype) * i as u64, v).unwrap();
            }
        }

        /// `n` elements of `dtype` from `addr` on.
        pub fn load(&self, dtype: DType, addr: u64, n: usize) -> Vec<f32> {
            (0..n as u64)
                .map(|i| self.read(dtype, addr + size(dtype) * i).unwrap())
                .collect()
        }
    }

    /// `cublasGemmStridedBatchedEx` with A and B in `ab`, C in `c`, f32 compute: checks the
    /// leading dimensions as cuBLAS does, that every element read or written lies in a
    /// buffer, and that no product writes an element any product of the call reads.
    pub fn gemm_batched(
        mem: &mut Bytes,
        g: &Batched,
        ab: DType,
        c: DType,
    ) -> std::result::Result<(), String> {
        let f = &g.first;
        let stored =
            |op, rows: usize, cols: usize| if op == N { (rows, cols) } else { (cols, rows) };
        for (name, op, rows, cols, ld) in [
            ("a", f.ta, f.m, f.k, f.lda),
            ("b", f.tb, f.k, f.n, f.ldb),
            ("c", N, f.m, f.n, f.ldc),
        ] {
            let (r, _) = stored(op, rows, cols);
            if ld < r.max(1) {
                return Err(format!(
                    "ld{name} = {ld} < max(1, {r}): CUBLAS_STATUS_INVALID_VALUE"
                ));
            }
        }
        // Element (i, j) of op(X), X at `base` with leading dimension `ld`.
        let addr = |base: u64, dtype, op, ld: usize, i: usize, j: usize| {
            let idx = if op == N { i + j * ld } else { j + i * ld };
            base + size(dtype) * idx as u64
        };
        let (mut reads, mut writes) = (HashSet::new(), Vec::new());
        for x in 0..g.batch {
            let a0 = f.a + size(ab) * (x * g.stride_a) as u64;
            let b0 = f.b + size(ab) * (x * g.stride_b) as u64;
            let c0 = f.c + size(c) * (x * g.stride_c) as u64;
            for j in 0..f.n {
                for i in 0..f.m {
                    let mut sum = 0.0f64;
                    for p in 0..f.k {
                        let (pa, pb) = (
                            addr(a0, ab, f.ta, f.lda, i, p),
                            addr(b0, ab, f.tb, f.ldb, p, j),
                        );
                        reads.insert(pa);
                        reads.insert(pb);
                        sum += f64::from(mem.read(ab, pa)?) * f64::from(mem.read(ab, pb)?);
                    }
                    let pc = addr(c0, c, N, f.ldc, i, j);
                    let mut v = g.alpha as f64 * sum;
                    if g.beta != 0.0 {
                        v += g.beta as f64 * f64::from(mem.read(c, pc)?);
                    }
                    writes.push((pc, v as f32));
                }
            }
        }
        let mut written = HashSet::new();
        for &(pc, _) in &writes {
            if reads.contains(&pc) {
                return Err(format!("C element {pc:#x} is also read by the call"));
            }
            if !written.insert(pc) {
                return Err(format!("C element {pc:#x} is written twice"));
            }
        }
        for (pc, v) in writes {
            mem.write(c, pc, v)?;
        }
        Ok(())
    }

    /// `cublasLtMatmul` as [`super::Gemm::run_matmul`] issues it, over `dtype` storage:
    /// checks the leading dimensions (the GELU input's too: at least D's rows and a multiple
    /// of [`crate::dispatch::GELU_AUX_LD_MULTIPLE`]), that every element read or written lies
    /// in a buffer and that no output element is an input's; then sums each product in f64,
    /// rounds it to f32 with the residual added, adds the bias in f32, keeps that as the
    /// GELU's input, applies the GELU and rounds each stored value once, as the simulator
    /// does (`cuda-sim/src/cublas.cpp`).
    pub fn matmul(mem: &mut Bytes, mm: &Matmul, dtype: DType) -> std::result::Result<(), String> {
        let f = &mm.gemm;
        let stored =
            |op, rows: usize, cols: usize| if op == N { (rows, cols) } else { (cols, rows) };
        for (name, op, rows, cols, ld) in [
            ("a", f.ta, f.m, f.k, f.lda),
            ("b", f.tb, f.k, f.n, f.ldb),
            ("c", N, f.m, f.n, f.ldc),
        ] {
            let (r, _) = stored(op, rows, cols);
            if ld < r.max(1) {
                return Err(format!(
                    "ld{name} = {ld} < max(1, {r}): CUBLAS_STATUS_INVALID_VALUE"
                ));
            }
        }
        if let Some(aux) = mm.gelu {
            let multiple = crate::dispatch::GELU_AUX_LD_MULTIPLE;
            if aux.ld < f.m || !aux.ld.is_multiple_of(multiple) {
                return Err(format!(
                    "aux ld = {} is below m = {} or not a multiple of {multiple}: \
                     CUBLAS_STATUS_NOT_SUPPORTED",
                    aux.ld, f.m
                ));
            }
        }
        let e = size(dtype);
        let addr = |base: u64, op, ld: usize, i: usize, j: usize| {
            let idx = if op == N { i + j * ld } else { j + i * ld };
            base + e * idx as u64
        };
        let (mut reads, mut writes) = (HashSet::new(), Vec::new());
        for j in 0..f.n {
            for i in 0..f.m {
                let mut sum = 0.0f64;
                for p in 0..f.k {
                    let (pa, pb) = (addr(f.a, f.ta, f.lda, i, p), addr(f.b, f.tb, f.ldb, p, j));
                    reads.insert(pa);
                    reads.insert(pb);
                    sum += f64::from(mem.read(dtype, pa)?) * f64::from(mem.read(dtype, pb)?);
                }
                if let Some(r) = mm.residual {
                    let pr = addr(r, N, f.ldc, i, j);
                    reads.insert(pr);
                    sum += f64::from(mem.read(dtype, pr)?);
                }
                let mut v = sum as f32;
                if let Some(b) = mm.bias {
                    let pb = b + e * i as u64;
                    reads.insert(pb);
                    v += mem.read(dtype, pb)?;
                }
                if let Some(aux) = mm.gelu {
                    writes.push((addr(aux.at, N, aux.ld, i, j), v));
                    let mut out = [0.0f32];
                    crate::kernels::gelu_forward(&mut out, &[v]);
                    v = out[0];
                }
                writes.push((addr(f.c, N, f.ldc, i, j), v));
            }
        }
        let mut written = HashSet::new();
        for &(pc, _) in &writes {
            // D may be C itself (in place), element for element.
            if reads.contains(&pc) && mm.residual.map(|r| addr(r, N, f.ldc, 0, 0)) != Some(f.c) {
                return Err(format!("output element {pc:#x} is also read by the call"));
            }
            if !written.insert(pc) {
                return Err(format!("output element {pc:#x} is written twice"));
            }
        }
        for (pc, v) in writes {
            mem.write(dtype, pc, v)?;
        }
        Ok(())
    }

    /// Every fused forward [`forward_matmul`] describes, run by [`matmul`] on odd shapes in
    /// both layouts, f32 and bf16, against the host kernels (product with the bias, then the
    /// GELU or the residual add, rounded once to the storage type).
    #[test]
    fn fused_matmuls_match_host_kernels() {
        let (xa, wa, ba, ra, ya, ha) = (
            0x1000_0000u64,
            0x2000_0000,
            0x3000_0000,
            0x4000_0000,
            0x5000_0000,
            0x6000_0000,
        );
        for dtype in [DType::F32, DType::BF16] {
            for (rows, d_in, d_out) in [(3, 5, 8), (5, 7, 16), (1, 3, 8), (7, 9, 3), (4, 2, 13)] {
                let d = LinearDims { rows, d_in, d_out };
                let round = |v: Vec<f32>| -> Vec<f32> {
                    match dtype {
                        DType::BF16 => v
                            .iter()
                            .map(|&x| half::bf16::from_f32(x).to_f32())
                            .collect(),
                        _ => v,
                    }
                };
                let seed = (rows * 100 + d_in * 10 + d_out) as u64;
                let x = round(values(seed, rows * d_in));
                let w = round(values(seed + 1, d_in * d_out));
                let b = round(values(seed + 2, d_out));
                let r = round(values(seed + 3, rows * d_out));
                for layout in [WeightLayout::OutIn, WeightLayout::InOut] {
                    for bias in [false, true] {
                        let mut fused = vec![Fused::Plain, Fused::Residual(ra)];
                        if gelu_fusable(d_out) {
                            fused.push(Fused::Gelu(ha));
                        }
                        for f in fused {
                            let what = format!("{dtype} {layout:?} {d:?} bias {bias} {f:?}");
                            let mut mem = Bytes::default();
                            let e = size(dtype);
                            for (at, vals) in [(xa, &x), (wa, &w), (ba, &b), (ra, &r)] {
                                mem.alloc(at, e * vals.len() as u64);
                                mem.store(dtype, at, vals);
                            }
                            mem.alloc(ya, e * (rows * d_out) as u64);
                            mem.alloc(ha, e * (rows * d_out) as u64);
                            let mm = forward_matmul(layout, d, (xa, wa, ya), bias.then_some(ba), f);
                            matmul(&mut mem, &mm, dtype).unwrap_or_else(|e| panic!("{what}: {e}"));
                            let mut h = vec![0.0; rows * d_out];
                            crate::kernels::linear_forward(
                                &mut h,
                                &x,
                                &w,
                                bias.then_some(&b[..]),
                                layout,
                                rows,
                                d_in,
                                d_out,
                            );
                            let want = match f {
                                Fused::Plain => h.clone(),
                                Fused::Residual(_) => {
                                    h.iter().zip(&r).map(|(a, b)| a + b).collect()
                                }
                                Fused::Gelu(_) => {
                                    let mut y = vec![0.0; h.len()];
                                    crate::kernels::gelu_forward(&mut y, &h);
                                    y
                                }
                            };
                            let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
                            let close = |name: &str, got: Vec<f32>, want: Vec<f32>| {
                                for (i, (g, w)) in got.iter().zip(round(want)).enumerate() {
                                    assert!(
                                        (g - w).abs() <= tol * (1.0 + w.abs()),
                                        "{what}: {name}[{i}] is {g}, the host kernels give {w}"
                                    );
                                }
                            };
                            close("y", mem.load(dtype, ya, rows * d_out), want);
                            if let Fused::Gelu(_) = f {
                                close("h", mem.load(dtype, ha, rows * d_out), h);
                            }
                        }
                    }
                }
            }
        }
    }

    /// The model refuses what cuBLASLt refuses: a GELU input whose leading dimension is not a
    /// multiple of 8, a bias past its buffer, an output that is an input.
    #[test]
    fn matmul_model_rejects_what_cublaslt_rejects() {
        let d = LinearDims {
            rows: 2,
            d_in: 3,
            d_out: 5,
        };
        let mut mem = Bytes::default();
        for at in [0x1000u64, 0x2000, 0x3000, 0x4000, 0x5000] {
            mem.alloc(at, 4 * 15);
            mem.store(DType::F32, at, &[0.5; 15]);
        }
        let ops = (0x1000, 0x2000, 0x3000);
        let ok = forward_matmul(WeightLayout::OutIn, d, ops, Some(0x4000), Fused::Plain);
        assert_eq!(matmul(&mut mem, &ok, DType::F32), Ok(()));
        let gelu = forward_matmul(WeightLayout::OutIn, d, ops, None, Fused::Gelu(0x5000));
        assert!(matmul(&mut mem, &gelu, DType::F32).is_err_and(|e| e.contains("multiple of 8")));
        let past = forward_matmul(
            WeightLayout::OutIn,
            d,
            ops,
            Some(0x4000 + 4 * 12),
            Fused::Plain,
        );
        assert!(matmul(&mut mem, &past, DType::F32).is_err_and(|e| e.contains("in no buffer")));
        let alias = forward_matmul(
            WeightLayout::OutIn,
            d,
            (0x1000, 0x2000, 0x2000),
            None,
            Fused::Plain,
        );
        assert!(matmul(&mut mem, &alias, DType::F32).is_err_and(|e| e.contains("also read")));
    }

    /// Values in [-1, 1), reproducible from `seed`.
    fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    #[test]
    fn batched_model_reads_strided_operands_and_refuses_overlap() {
        // Two products of [2 x 1] [1 x 2], A and B strided, C strided by 4.
        let mut mem = Bytes::default();
        mem.alloc(0x1000, 16);
        mem.alloc(0x2000, 16);
        mem.alloc(0x3000, 32);
        mem.store(DType::F32, 0x1000, &[1.0, 2.0, 3.0, 4.0]);
        mem.store(DType::F32, 0x2000, &[5.0, 6.0, 7.0, 8.0]);
        let g = Batched {
            first: Call {
                ta: N,
                tb: N,
                m: 2,
                n: 2,
                k: 1,
                a: 0x1000,
                lda: 2,
                b: 0x2000,
                ldb: 1,
                c: 0x3000,
                ldc: 2,
            },
            batch: 2,
            stride_a: 2,
            stride_b: 2,
            stride_c: 4,
            alpha: 2.0,
            beta: 0.0,
        };
        gemm_batched(&mut mem, &g, DType::F32, DType::F32).unwrap();
        assert_eq!(
            mem.load(DType::F32, 0x3000, 8),
            [10.0, 20.0, 12.0, 24.0, 42.0, 56.0, 48.0, 64.0]
        );
        // Accumulating doubles it; a C stride of 2 would write the same elements twice; a
        // third product reads past A.
        gemm_batched(
            &mut mem,
            &Batched { beta: 1.0, ..g },
            DType::F32,
            DType::F32,
        )
        .unwrap();
        assert_eq!(mem.load(DType::F32, 0x3000, 2), [20.0, 40.0]);
        let twice = gemm_batched(
            &mut mem,
            &Batched { stride_c: 2, ..g },
            DType::F32,
            DType::F32,
        );
        assert!(twice.is_err_and(|e| e.contains("written twice")));
        let past = gemm_batched(&mut mem, &Batched { batch: 3, ..g }, DType::F32, DType::F32);
        assert!(past.is_err_and(|e| e.contains("in no buffer")));
        let alias = Batched {
            first: Call {
                c: 0x1000,
                ldc: 2,
                ..g.first
            },
            batch: 1,
            ..g
        };
        let alias = gemm_batched(&mut mem, &alias, DType::F32, DType::F32);
        assert!(alias.is_err_and(|e| e.contains("also read")));
    }
}
