//! Owners of CUDA driver resources (device memory, pinned host memory, events), the probe
//! that says whether the backend can run here, and the compiled kernel modules.
//!
//! cudarc loads libcuda, libcublas and libnvrtc at run time and panics on the first call into
//! a library it cannot find, so [`probe`] checks each with `is_culib_present()` before anything
//! calls into it; every constructor of the backend goes through it.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{result, sys, CudaContext, CudaFunction, CudaStream};

use super::nvrtc::{self, Compiled};
use crate::error::{Result, RuntimeError, Unsupported};
use protrain_ir::DType;

/// The oldest CUDA version the driver must support: the kernels are compiled by the CUDA 13
/// NVRTC, and cudarc is built against the CUDA 13.0 API.
const MIN_DRIVER_VERSION: i32 = 13000;

/// What the CUDA simulator (`cuda-sim/`) has counted in this process so far: the performance
/// proxy its tests compare with a schedule's plan. Read with [`simulator_counters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimCounters {
    /// Kernel launches (`cuLaunchKernel`).
    pub launches: u64,
    /// Host waits for device work: stream and event synchronisations, synchronous copies,
    /// frees.
    pub syncs: u64,
    /// Bytes copied from host to device memory.
    pub htod_bytes: u64,
    /// Bytes copied from device to host memory.
    pub dtoh_bytes: u64,
    /// cuBLAS GEMMs (each batched call counts once).
    pub gemms: u64,
    /// Pinned host allocations (`cuMemHostAlloc`).
    pub host_allocs: u64,
    /// cuBLASLt matmuls (`cublasLtMatmul`, each with its epilogue).
    pub lt_matmuls: u64,
    /// GEMMs and matmuls issued without a workspace of the backend's (a cuBLAS handle with
    /// none set, a cuBLASLt matmul given none), where the libraries would allocate their own
    /// or fall back to kernels that need none.
    pub unplanned_workspaces: u64,
}

impl std::ops::Sub for SimCounters {
    type Output = SimCounters;

    /// What was counted between two readings (`later - earlier`).
    fn sub(self, earlier: SimCounters) -> SimCounters {
        SimCounters {
            launches: self.launches - earlier.launches,
            syncs: self.syncs - earlier.syncs,
            htod_bytes: self.htod_bytes - earlier.htod_bytes,
            dtoh_bytes: self.dtoh_bytes - earlier.dtoh_bytes,
            gemms: self.gemms - earlier.gemms,
            host_allocs: self.host_allocs - earlier.host_allocs,
            lt_matmuls: self.lt_matmuls - earlier.lt_matmuls,
            unplanned_workspaces: self.unplanned_workspaces - earlier.unplanned_workspaces,
        }
    }
}

/// The simulator's counters, when the driver loaded is the CUDA simulator (which exports
/// `protrain_cuda_sim_counters`, no CUDA entry point); `None` on a real driver or none.
pub fn simulator_counters() -> Option<SimCounters> {
    // SAFETY: only tries to dlopen the library under its candidate names.
    if !unsafe { sys::is_culib_present() } {
        return None;
    }
    // SAFETY: the library is present; the symbol, where it exists, is the simulator's
    // `void protrain_cuda_sim_counters(uint64_t out[8])`.
    let read = unsafe {
        sys::culib()
            .get::<unsafe extern "C" fn(*mut u64)>(b"protrain_cuda_sim_counters\0")
            .ok()?
    };
    let mut out = [0u64; 8];
    // SAFETY: `out` holds the eight counters the function writes.
    unsafe { read(out.as_mut_ptr()) };
    let [launches, syncs, htod_bytes, dtoh_bytes, gemms, host_allocs, lt_matmuls, unplanned_workspaces] =
        out;
    Some(SimCounters {
        launches,
        syncs,
        htod_bytes,
        dtoh_bytes,
        gemms,
        host_allocs,
        lt_matmuls,
        unplanned_workspaces,
    })
}

/// What a device can be asked, learnt once by [`probe`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device's name (`NVIDIA H200`).
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Total device memory in bytes.
    pub memory_bytes: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// The CUDA version the driver supports, as `major * 1000 + minor * 10`.
    pub driver_version: i32,
}

/// The oldest compute capability the backend runs on: 7.5 (Turing), the oldest that CUDA
/// 13's NVRTC compiles for and its cuBLAS has kernels for. Before 8.0 it runs f32 and f16
/// schedules, with attention as GEMMs ([`protrain_ir::workspace::flash_attention_supported`]),
/// and refuses bf16 ones ([`check_dtypes`]).
pub const MIN_COMPUTE_CAPABILITY: (i32, i32) = (7, 5);

/// The oldest compute capability with bf16 tensor-core products (Ampere); the flash attention
/// kernels need it too ([`protrain_ir::workspace::FLASH_MIN_COMPUTE_CAPABILITY`]).
pub const BF16_MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

/// Refuses a schedule that stores a tensor in a type `device` lacks: bf16 before compute
/// capability 8.0 ([`BF16_MIN_COMPUTE_CAPABILITY`]), whose GPUs have no bf16 tensor cores
/// for cuBLAS's products. The error names the GPU, its capability, the type and the types it
/// runs instead. f32 and f16 run on every GPU the backend accepts.
pub fn check_dtypes(dtypes: impl IntoIterator<Item = DType>, device: &DeviceInfo) -> Result<()> {
    if device.compute_capability >= BF16_MIN_COMPUTE_CAPABILITY
        || !dtypes.into_iter().any(|d| d == DType::BF16)
    {
        return Ok(());
    }
    Err(RuntimeError::Unsupported(Unsupported::DtypeOnGpu {
        dtype: DType::BF16.to_string(),
        device: device.name.clone(),
        compute_capability: device.compute_capability,
        needs: BF16_MIN_COMPUTE_CAPABILITY,
        instead: vec![DType::F16.to_string(), DType::F32.to_string()],
    }))
}

/// The GPU this process's backends open (its ordinal); see [`use_gpu`].
static GPU: AtomicUsize = AtomicUsize::new(0);

/// Makes every CUDA backend this process creates from now on open GPU `ordinal` (a worker of
/// a multi-process run takes its `LOCAL_RANK`); GPU 0 unless called.
pub fn use_gpu(ordinal: usize) {
    GPU.store(ordinal, Ordering::Relaxed);
}

/// The GPU [`use_gpu`] chose.
pub fn gpu() -> usize {
    GPU.load(Ordering::Relaxed)
}

/// Checks, without any call that could panic, that the CUDA driver, a GPU, cuBLAS and NVRTC
/// are there, and describes the GPU this process runs on ([`use_gpu`], GPU 0 unless set).
/// The error says what is missing and what to install.
pub fn probe() -> Result<DeviceInfo> {
    let unavailable = |why: String| RuntimeError::CudaUnavailable(why);
    // SAFETY: only tries to dlopen the library under its candidate names.
    if !unsafe { sys::is_culib_present() } {
        return Err(unavailable(
            "the CUDA driver library (libcuda.so) cannot be loaded: this machine has no NVIDIA \
             driver, or the loader cannot find it; install the NVIDIA driver (580 or newer, for \
             CUDA 13), or use --backend host"
                .into(),
        ));
    }
    let mut version = 0;
    // SAFETY: a valid out-pointer; the library is present.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| unavailable(format!("the CUDA driver does not answer ({e:?})")))?;
    if version < MIN_DRIVER_VERSION {
        return Err(unavailable(format!(
            "the NVIDIA driver supports CUDA {}.{}, the backend needs CUDA {}.{} (driver 580 or \
             newer); update the driver, or use --backend host",
            version / 1000,
            version % 1000 / 10,
            MIN_DRIVER_VERSION / 1000,
            MIN_DRIVER_VERSION % 1000 / 10
        )));
    }
    result::init().map_err(|e| {
        unavailable(format!(
            "the CUDA driver found no usable GPU (cuInit: {}); check that `nvidia-smi` lists \
             one and that CUDA_VISIBLE_DEVICES does not hide it, or use --backend host",
            error_text(e)
        ))
    })?;
    let count = result::device::get_count().map_err(|e| unavailable(error_text(e)))?;
    if count < 1 {
        return Err(unavailable(
            "the CUDA driver sees no GPU; check `nvidia-smi` and CUDA_VISIBLE_DEVICES, or use \
             --backend host"
                .into(),
        ));
    }
    // SAFETY: only tries to dlopen the library under its candidate names.
    if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
        return Err(unavailable(
            "cuBLASLt (libcublasLt.so.13) cannot be loaded; install the CUDA 13 toolkit or \
             `pip install nvidia-cublas` and put the folder holding libcublasLt.so.13 on \
             LD_LIBRARY_PATH (scripts/gpu-check.sh does this), or use --backend host"
                .into(),
        ));
    }
    // SAFETY: only tries to dlopen the library under its candidate names.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(unavailable(
            "cuBLAS (libcublas.so.13) cannot be loaded; install the CUDA 13 toolkit or \
             `pip install nvidia-cublas` and put the folder holding libcublas.so.13 on \
             LD_LIBRARY_PATH (scripts/gpu-check.sh does this), or use --backend host"
                .into(),
        ));
    }
    if !nvrtc::available() {
        return Err(unavailable(format!(
            "NVRTC (libnvrtc.so.13), which compiles the kernels, cannot be loaded: {}",
            nvrtc::SETUP_HINT
        )));
    }
    // The GPU this process runs on: 0, or a worker's LOCAL_RANK ([`use_gpu`]).
    let ordinal = gpu();
    if ordinal >= count as usize {
        return Err(unavailable(format!(
            "this process runs on GPU {ordinal} (its LOCAL_RANK), but the driver sees {count} \
             GPU(s); pass --gpus {count} or fewer per node, and check CUDA_VISIBLE_DEVICES"
        )));
    }
    let device = result::device::get(ordinal as i32).map_err(|e| unavailable(error_text(e)))?;
    let attr = |a| {
        // SAFETY: a device handle from `device::get`; `a` is a valid attribute.
        unsafe { result::device::get_attribute(device, a) }.map_err(|e| unavailable(error_text(e)))
    };
    use sys::CUdevice_attribute::*;
    let major = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let multiprocessors = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as u32;
    if (major, minor) < MIN_COMPUTE_CAPABILITY {
        let (need_major, need_minor) = MIN_COMPUTE_CAPABILITY;
        return Err(unavailable(format!(
            "the GPU has compute capability {major}.{minor}; the CUDA 13 libraries the \
             backend loads (NVRTC, cuBLAS) support {need_major}.{need_minor} (Turing) and \
             newer; use --backend host"
        )));
    }
    let name = result::device::get_name(device).map_err(|e| unavailable(error_text(e)))?;
    // SAFETY: a device handle from `device::get`.
    let memory =
        unsafe { result::device::total_mem(device) }.map_err(|e| unavailable(error_text(e)))?;
    Ok(DeviceInfo {
        name,
        compute_capability: (major, minor),
        memory_bytes: memory as u64,
        multiprocessors,
        driver_version: version,
    })
}

/// A driver error's name and text.
pub fn error_text(e: result::DriverError) -> String {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    match e.error_string() {
        Ok(text) => format!("{name} ({})", text.to_string_lossy()),
        Err(_) => name,
    }
}

/// The error of a failed driver call made while doing `during`, with the way out that fits.
/// Whether the work enqueued on `stream` so far has finished (`cuStreamQuery`), without
/// blocking: for waits that must stay able to give up ([`super::nccl::poll_until`]).
///
/// # Safety
/// `stream` is a live stream of the context current on this thread.
pub unsafe fn stream_done(stream: sys::CUstream, during: &str) -> Result<bool> {
    // SAFETY: the caller's contract.
    done(unsafe { sys::cuStreamQuery(stream) }, during)
}

/// Whether the work before `event`'s last record has finished (`cuEventQuery`), without
/// blocking (see [`stream_done`]).
///
/// # Safety
/// `event` is a live event of the context current on this thread.
pub unsafe fn event_done(event: sys::CUevent, during: &str) -> Result<bool> {
    // SAFETY: the caller's contract.
    done(unsafe { sys::cuEventQuery(event) }, during)
}

/// A query's answer: finished, not yet, or the error it reports.
fn done(status: sys::CUresult, during: &str) -> Result<bool> {
    match status {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        e => Err(driver_error(during, result::DriverError(e))),
    }
}

pub fn driver_error(during: impl Into<String>, e: result::DriverError) -> RuntimeError {
    let hint = match e.0 {
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
            "the schedule needs more memory than is free: check `nvidia-smi` for other \
             processes, or compile for a smaller --gpu-memory (or --host-memory for pinned host \
             memory)"
        }
        sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS
        | sys::CUresult::CUDA_ERROR_LAUNCH_FAILED
        | sys::CUresult::CUDA_ERROR_ILLEGAL_INSTRUCTION => {
            "a kernel failed, and the context is unusable until the process restarts; rerun \
             with CUDA_LAUNCH_BLOCKING=1 to see which launch, and report it with the schedule"
        }
        _ => {
            "the device may be in a bad state after an earlier failure; check `nvidia-smi`, and \
             rerun with CUDA_LAUNCH_BLOCKING=1 to find the failing call"
        }
    };
    RuntimeError::Cuda {
        during: during.into(),
        detail: error_text(e),
        hint: hint.into(),
    }
}

/// The scheduling flag of the backend's context: a thread waiting for the GPU
/// (`cuStreamSynchronize`, `cuCtxSynchronize`) sleeps instead of spinning, so the stream
/// threads leave the cores to the CPU Adam. Data, so a test can see it.
pub const CONTEXT_SCHED_FLAGS: sys::CUctx_flags = sys::CUctx_flags::CU_CTX_SCHED_BLOCKING_SYNC;

/// Opens the primary context of device `ordinal` and sets [`CONTEXT_SCHED_FLAGS`] on it.
pub fn open_context(ordinal: usize) -> Result<Arc<CudaContext>> {
    let ctx =
        CudaContext::new(ordinal).map_err(|e| driver_error(format!("opening GPU {ordinal}"), e))?;
    ctx.bind_to_thread()
        .map_err(|e| driver_error("making the CUDA context current", e))?;
    result::ctx::set_flags(CONTEXT_SCHED_FLAGS)
        .map_err(|e| driver_error("asking the CUDA context to block rather than spin", e))?;
    Ok(ctx)
}

/// Why device bytes are written outside a kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteKind {
    /// Zeroing a new allocation (the arena, the gradient-norm slot), which any stream may use
    /// next.
    Allocation,
    /// A constant table that the kernels of one stream read.
    Constant,
    /// A write from the host between steps (`write_f32`, `fill_zero`), which any stream may
    /// read in the next step.
    BetweenSteps,
}

/// One driver call of a write to device memory outside a kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteStep {
    /// `cuCtxSynchronize`: waits for all work of every stream of the context.
    SynchronizeContext,
    /// The copy or memset itself, on the legacy default stream (the driver's synchronous
    /// `cuMemcpyHtoD` / `cuMemsetD8`, which may return before the bytes land). The backend's
    /// streams are non-blocking, so nothing orders their work after it but a synchronisation.
    OnDefaultStream,
    /// The copy or memset itself, enqueued on the stream whose kernels read the bytes, so the
    /// stream orders it before them.
    OnOwnStream,
}

/// The driver calls of a write of `kind`, in issue order: plain data, so the tests check that
/// every write on the default stream is followed by a synchronisation before anything can
/// read it (the race of a write left on the default stream while non-blocking streams run).
pub fn write_steps(kind: WriteKind) -> &'static [WriteStep] {
    use WriteStep::*;
    match kind {
        WriteKind::Allocation => &[OnDefaultStream, SynchronizeContext],
        WriteKind::Constant => &[OnOwnStream],
        // The first synchronisation lets the previous step's work finish with the bytes.
        WriteKind::BetweenSteps => &[SynchronizeContext, OnDefaultStream, SynchronizeContext],
    }
}

/// What a write puts in device memory.
#[derive(Clone, Copy, Debug)]
pub enum Fill<'a> {
    /// This many zero bytes.
    Zero(usize),
    /// These bytes.
    Bytes(&'a [u8]),
}

impl Fill<'_> {
    /// Bytes written.
    pub fn len(&self) -> usize {
        match self {
            Fill::Zero(n) => *n,
            Fill::Bytes(b) => b.len(),
        }
    }
}

/// Writes `fill` at device address `dst` with the driver calls of [`write_steps`]`(kind)`;
/// `stream` is the stream of a write [`WriteStep::OnOwnStream`].
///
/// # Safety
///
/// `dst` holds `fill.len()` bytes of memory of `ctx`; nothing reads or writes them meanwhile
/// but work that the steps order after the write.
pub unsafe fn write_device(
    ctx: &Arc<CudaContext>,
    kind: WriteKind,
    dst: u64,
    fill: Fill<'_>,
    stream: Option<&CudaStream>,
) -> Result<()> {
    if fill.len() == 0 {
        return Ok(());
    }
    ctx.bind_to_thread()
        .map_err(|e| driver_error("making the CUDA context current", e))?;
    for step in write_steps(kind) {
        // SAFETY (each call): `dst` holds the bytes (the caller's contract). A pageable
        // source may be dropped when an async copy returns: the driver has staged it by then.
        let status = match (step, fill) {
            (WriteStep::SynchronizeContext, _) => ctx.synchronize(),
            (WriteStep::OnDefaultStream, Fill::Zero(n)) => unsafe {
                result::memset_d8_sync(dst, 0, n)
            },
            (WriteStep::OnDefaultStream, Fill::Bytes(b)) => unsafe {
                result::memcpy_htod_sync(dst, b)
            },
            (WriteStep::OnOwnStream, fill) => {
                let s = stream.ok_or_else(|| {
                    RuntimeError::BadSchedule(format!(
                        "a {kind:?} write needs the stream that reads it; this is a bug in \
                         runtime/src/cuda"
                    ))
                })?;
                match fill {
                    Fill::Zero(n) => unsafe { result::memset_d8_async(dst, 0, n, s.cu_stream()) },
                    Fill::Bytes(b) => unsafe { result::memcpy_htod_async(dst, b, s.cu_stream()) },
                }
            }
        };
        status.map_err(|e| {
            driver_error(
                format!("writing {} device bytes ({kind:?}, {step:?})", fill.len()),
                e,
            )
        })?;
    }
    Ok(())
}

/// Device memory from `cuMemAlloc`, freed on drop.
pub struct DeviceMemory {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: a device allocation is a number that any thread of the process may use; the
// context it belongs to is thread safe.
unsafe impl Send for DeviceMemory {}
// SAFETY: as above; `&DeviceMemory` only reads the pointer and the size.
unsafe impl Sync for DeviceMemory {}

impl DeviceMemory {
    /// `bytes` of device memory, uninitialised; `what` names it in errors. Zero bytes allocate
    /// nothing (the pointer is 0).
    pub fn uninit(ctx: &Arc<CudaContext>, bytes: usize, what: &str) -> Result<Self> {
        ctx.bind_to_thread()
            .map_err(|e| driver_error(format!("binding the context to allocate the {what}"), e))?;
        let ptr = if bytes == 0 {
            0
        } else {
            // SAFETY: a plain allocation in the current context.
            unsafe { result::malloc_sync(bytes) }.map_err(|e| {
                driver_error(format!("allocating the {what} of {bytes} device bytes"), e)
            })?
        };
        Ok(Self {
            ptr,
            bytes,
            ctx: ctx.clone(),
        })
    }

    /// `bytes` of device memory, zeroed before this returns, so that no stream (the backend's
    /// are non-blocking) can see it otherwise; `what` names it in errors.
    pub fn zeroed(ctx: &Arc<CudaContext>, bytes: usize, what: &str) -> Result<Self> {
        let m = Self::uninit(ctx, bytes, what)?;
        // SAFETY: `m` owns `bytes` bytes and nothing else knows of it yet.
        unsafe { m.write(WriteKind::Allocation, Fill::Zero(bytes), None) }?;
        Ok(m)
    }

    /// Writes `fill` at the start of the allocation as [`write_steps`] orders a write of
    /// `kind` (`stream` is the stream of a [`WriteKind::Constant`]).
    ///
    /// # Safety
    ///
    /// The allocation holds `fill`'s bytes; nothing reads or writes them meanwhile but work
    /// the write's ordering puts after it.
    pub unsafe fn write(
        &self,
        kind: WriteKind,
        fill: Fill<'_>,
        stream: Option<&CudaStream>,
    ) -> Result<()> {
        if fill.len() > self.bytes {
            return Err(RuntimeError::BadSchedule(format!(
                "writing {} bytes into a device allocation of {}",
                fill.len(),
                self.bytes
            )));
        }
        // SAFETY: in bounds (checked); the caller's contract.
        unsafe { write_device(&self.ctx, kind, self.ptr, fill, stream) }
    }

    /// The device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes allocated.
    pub fn len(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.bytes > 0 {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: allocated by `malloc_sync` in `zeroed`, freed once; cuMemFree waits for
            // the device work that uses it.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Bytes each thread zeroes at a time in [`zero_in_parallel`]: large enough that the split
/// costs nothing, small enough that a region of a few GiB keeps every core busy.
const ZERO_CHUNK: usize = 64 << 20;

/// Zeroes `buf` on the rayon pool, [`ZERO_CHUNK`] bytes per task: a pinned region of tens or
/// hundreds of GiB (an offloaded model's optimizer state) is written once at start, page by
/// page, and one thread's memset leaves the machine's other cores and memory channels idle.
/// Returns how many tasks it split into.
pub fn zero_in_parallel(buf: &mut [u8]) -> usize {
    use rayon::prelude::*;
    buf.par_chunks_mut(ZERO_CHUNK).for_each(|c| c.fill(0));
    buf.len().div_ceil(ZERO_CHUNK)
}

/// Page-locked host memory from `cuMemHostAlloc` (portable, mapped into the device's address
/// space, cached for the CPU, which reads everything the host region holds), freed on drop.
pub struct PinnedMemory {
    ptr: *mut u8,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the memory is owned like a `Box<[u8]>`; the backend hands out views of it only
// under the schedule's ordering contract.
unsafe impl Send for PinnedMemory {}
// SAFETY: as above.
unsafe impl Sync for PinnedMemory {}

impl PinnedMemory {
    /// `bytes` of pinned host memory, zeroed; `what` names it in errors.
    pub fn zeroed(ctx: &Arc<CudaContext>, bytes: usize, what: &str) -> Result<Self> {
        ctx.bind_to_thread()
            .map_err(|e| driver_error(format!("binding the context to allocate the {what}"), e))?;
        let ptr = if bytes == 0 {
            std::ptr::null_mut()
        } else {
            let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
            // SAFETY: a plain allocation; the flags are valid.
            let ptr = unsafe { result::malloc_host(bytes, flags) }.map_err(|e| {
                driver_error(
                    format!("pinning {bytes} bytes of host memory for the {what}"),
                    e,
                )
            })?;
            let ptr = ptr.cast::<u8>();
            // SAFETY: `ptr` owns `bytes` writable bytes, which nothing else refers to yet.
            zero_in_parallel(unsafe { std::slice::from_raw_parts_mut(ptr, bytes) });
            ptr
        };
        Ok(Self {
            ptr,
            bytes,
            ctx: ctx.clone(),
        })
    }

    /// The first byte.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Bytes allocated.
    pub fn len(&self) -> usize {
        self.bytes
    }
}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: allocated by `malloc_host` in `zeroed`, freed once.
            let _ = unsafe { result::free_host(self.ptr.cast::<c_void>()) };
        }
    }
}

/// A CUDA event without timing whose waiters sleep rather than spin (the host optimizer's
/// thread waits on them while CPU Adam uses the other cores), destroyed on drop.
pub struct Event {
    event: sys::CUevent,
    ctx: Arc<CudaContext>,
}

// SAFETY: CUDA events may be recorded and waited on from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// A new event.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        ctx.bind_to_thread()
            .map_err(|e| driver_error("binding the context to create an event", e))?;
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
            | sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32;
        let mut event = std::ptr::null_mut();
        // SAFETY: a valid out-pointer and valid flags.
        unsafe { sys::cuEventCreate(&mut event, flags) }
            .result()
            .map_err(|e| driver_error("creating an event", e))?;
        Ok(Self {
            event,
            ctx: ctx.clone(),
        })
    }

    /// The raw event.
    pub fn raw(&self) -> sys::CUevent {
        self.event
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { result::event::destroy(self.event) };
    }
}

/// The type of a kernel parameter, as a launch must pass it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamKind {
    /// Any pointer: 8 bytes.
    Ptr,
    /// `i64` (`long long`).
    I64,
    /// `int`.
    I32,
    /// `float`.
    F32,
}

/// The parameter kinds of every `extern "C" __global__` function of `source`, by name, read
/// from its text, so a launch whose arguments do not match the kernel's declaration is an
/// error rather than a kernel reading garbage. `None` when a parameter has a type the
/// launcher cannot pass.
pub fn signatures(source: &'static str) -> Option<Vec<(&'static str, Vec<ParamKind>)>> {
    const MARK: &str = "extern \"C\" __global__ void ";
    let mut out = Vec::new();
    for (at, _) in source.match_indices(MARK) {
        let rest = &source[at + MARK.len()..];
        let open = rest.find('(')?;
        let close = rest.find(')')?;
        let name = rest[..open].trim();
        let mut kinds = Vec::new();
        for param in rest[open + 1..close].split(',').map(str::trim) {
            let ty = param
                .rsplit_once(|c: char| c.is_whitespace() || c == '*')?
                .0;
            let kind = if param.contains('*') {
                ParamKind::Ptr
            } else {
                match ty.trim() {
                    "i64" | "long long" => ParamKind::I64,
                    "int" => ParamKind::I32,
                    "float" => ParamKind::F32,
                    _ => return None,
                }
            };
            kinds.push(kind);
        }
        out.push((name, kinds));
    }
    Some(out)
}

/// Every kernel of [`super::SOURCES`], loaded into one context, by entry-point name, with the
/// parameter kinds its declaration has.
pub struct Kernels {
    functions: HashMap<&'static str, (CudaFunction, Vec<ParamKind>)>,
}

impl Kernels {
    /// Compiles every source for the device's architecture (once per process: later backends
    /// reuse the CUBINs) and loads them into `ctx`.
    pub fn load(ctx: &Arc<CudaContext>, compute_capability: (i32, i32)) -> Result<Self> {
        let compiled = compiled_for(compute_capability)?;
        let mut functions = HashMap::new();
        for c in compiled.iter() {
            let params: HashMap<&str, Vec<ParamKind>> = signatures(c.source.source)
                .ok_or_else(|| {
                    RuntimeError::BadSchedule(format!(
                        "a kernel of {} has a parameter type the launcher cannot pass",
                        c.source.file_name()
                    ))
                })?
                .into_iter()
                .collect();
            let module = ctx.load_module(c.module()).map_err(|e| {
                driver_error(
                    format!(
                        "loading the {} kernels compiled for {}",
                        c.source.name, c.arch
                    ),
                    e,
                )
            })?;
            for &entry in c.source.entry_points {
                let f = module
                    .load_function(entry)
                    .map_err(|e| driver_error(format!("finding kernel {entry}"), e))?;
                let kinds = params.get(entry).cloned().ok_or_else(|| {
                    RuntimeError::BadSchedule(format!("no declaration of kernel {entry} found"))
                })?;
                functions.insert(entry, (f, kinds));
            }
        }
        Ok(Self { functions })
    }

    /// The kernel named `name` and its parameter kinds.
    pub fn get(&self, name: &'static str) -> Result<(&CudaFunction, &[ParamKind])> {
        self.functions
            .get(name)
            .map(|(f, kinds)| (f, kinds.as_slice()))
            .ok_or_else(|| {
                RuntimeError::BadSchedule(format!(
                    "no kernel named {name} among the compiled sources (runtime/src/cuda/SOURCES)"
                ))
            })
    }
}

/// The compiled sources of this process, by compute capability.
type CompiledCache = Vec<((i32, i32), Arc<Vec<Compiled>>)>;

static COMPILED: Mutex<CompiledCache> = Mutex::new(Vec::new());

/// Every source compiled with NVRTC for `sm_XY` (compute capability X.Y), from the
/// process-wide cache or compiled now.
fn compiled_for(cc: (i32, i32)) -> Result<Arc<Vec<Compiled>>> {
    let mut cache = COMPILED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((_, c)) = cache.iter().find(|(k, _)| *k == cc) {
        return Ok(c.clone());
    }
    // NVRTC takes the architecture as a `&'static str`; one small string per compute
    // capability, made once per process under this lock.
    let arch: &'static str = Box::leak(format!("sm_{}{}", cc.0, cc.1).into_boxed_str());
    let compiled = nvrtc::compile_all(arch).map_err(|e| RuntimeError::Cuda {
        during: format!("compiling the kernels for {arch}"),
        detail: e.to_string(),
        hint: "this is a bug in the kernel sources or an NVRTC too old for the GPU; run \
               `cargo test -p protrain-runtime --features cuda --test it -- nvrtc::` and report \
               its output"
            .into(),
    })?;
    let compiled = Arc::new(compiled);
    cache.push((cc, compiled.clone()));
    Ok(compiled)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// bf16 is refused before compute capability 8.0 with the GPU, its capability and the
    /// types that run; f32 and f16 run there, and bf16 from 8.0 on.
    #[test]
    fn bf16_needs_compute_capability_8_0() {
        let gpu = |cc| DeviceInfo {
            name: "Tesla T4".into(),
            compute_capability: cc,
            memory_bytes: 16 << 30,
            multiprocessors: 40,
            driver_version: 13000,
        };
        let turing = gpu((7, 5));
        assert!(check_dtypes([DType::F32, DType::I32], &turing).is_ok());
        assert!(check_dtypes([DType::F16, DType::F32], &turing).is_ok());
        assert!(check_dtypes([DType::BF16], &gpu((8, 0))).is_ok());
        assert!(check_dtypes([DType::BF16], &gpu((9, 0))).is_ok());
        let err = check_dtypes([DType::F32, DType::BF16], &turing).unwrap_err();
        let text = err.worded(|s| format!("--{}", s.field()));
        for want in [
            "stores its tensors in bf16",
            "compute capability 8.0 or newer",
            "Tesla T4 has compute capability 7.5",
            "--dtype f16 or --dtype f32",
        ] {
            assert!(text.contains(want), "no `{want}` in: {text}");
        }
    }

    /// Every write is ordered before any later work that reads it: a write on the default
    /// stream is followed by a context synchronisation (the backend's streams are
    /// non-blocking, so nothing else orders them after it); a write on the reading stream
    /// needs nothing more. A write between steps also waits for the work before it.
    #[test]
    fn every_device_write_is_ordered_before_its_readers() {
        use WriteStep::*;
        for kind in [
            WriteKind::Allocation,
            WriteKind::Constant,
            WriteKind::BetweenSteps,
        ] {
            let steps = write_steps(kind);
            let writes: Vec<usize> = (0..steps.len())
                .filter(|&i| steps[i] != SynchronizeContext)
                .collect();
            assert_eq!(writes.len(), 1, "{kind:?}: one write, {steps:?}");
            let w = writes[0];
            if steps[w] == OnDefaultStream {
                assert_eq!(
                    steps.get(w + 1),
                    Some(&SynchronizeContext),
                    "{kind:?}: a default-stream write races the non-blocking streams: {steps:?}"
                );
            }
        }
        // Constants are read by one stream's kernels: the upload goes on that stream.
        assert_eq!(write_steps(WriteKind::Constant), &[OnOwnStream]);
        assert_eq!(
            write_steps(WriteKind::BetweenSteps).first(),
            Some(&SynchronizeContext),
            "a write between steps waits for the previous step"
        );
    }

    #[test]
    fn pinned_memory_is_zeroed_whole_in_parallel_chunks() {
        for len in [0, 1, 4097, ZERO_CHUNK - 1, ZERO_CHUNK, 2 * ZERO_CHUNK + 3] {
            let mut buf = vec![0xa5u8; len];
            let tasks = zero_in_parallel(&mut buf);
            assert!(buf.iter().all(|&b| b == 0), "{len} bytes");
            assert_eq!(tasks, len.div_ceil(ZERO_CHUNK), "{len} bytes");
        }
    }

    #[test]
    fn the_context_blocks_rather_than_spins() {
        assert_eq!(
            CONTEXT_SCHED_FLAGS,
            sys::CUctx_flags::CU_CTX_SCHED_BLOCKING_SYNC,
            "stream threads spinning in cuStreamSynchronize starve the CPU Adam"
        );
    }

    #[test]
    fn every_kernel_declaration_has_parameters_a_launch_can_pass() {
        for src in super::super::SOURCES {
            let sigs = signatures(src.source)
                .unwrap_or_else(|| panic!("{}: a parameter type is not passable", src.name));
            let names: Vec<&str> = sigs.iter().map(|(n, _)| *n).collect();
            assert_eq!(names, src.entry_points, "{}", src.name);
        }
        let norm = super::super::source_of("layer_norm_forward_bf16").unwrap();
        let sigs = signatures(norm.source).unwrap();
        let (_, kinds) = sigs
            .iter()
            .find(|(n, _)| *n == "layer_norm_forward_bf16")
            .unwrap();
        use ParamKind::*;
        assert_eq!(kinds, &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, I32, I32, F32]);
        let adam = super::super::source_of("adamw_f32").unwrap();
        let sigs = signatures(adam.source).unwrap();
        let (_, kinds) = sigs.iter().find(|(n, _)| *n == "clip_coef").unwrap();
        assert_eq!(kinds, &[Ptr, Ptr, Ptr, I32, F32]);
    }
}
