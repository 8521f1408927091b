//! Prepared launches: each op's call plan resolved once into what the driver takes, then
//! replayed every step.
//!
//! The first time a device stream issues an op, [`super::launch::calls`] plans it and the
//! backend resolves the plan into a [`ReadyOp`]: per kernel its function handle, grid, block,
//! shared memory and argument bytes (constant tables uploaded, the gradient-norm slot's address
//! filled in, the argument kinds checked against the kernel's declaration), per cuBLAS call its
//! description. The stream keeps it, keyed by the executor's per-instruction constants (which
//! live as long as the executor's plan of the schedule), together with what the plan was made
//! from: the op's kind, its operand types and their addresses. Each later step compares that
//! fingerprint, which allocates nothing, and replays the launches with `cuLaunchKernel` on the
//! stored bytes. The one part of a plan that changes every step, an AdamW's step scalars
//! (learning rate, bias corrections: [`super::launch::adamw_step_scalars`]), is written into
//! its argument bytes in place; any other change (a loss scale the dynamic scaler moved, an
//! executor made for another schedule) fails the comparison and the op is planned again.
//!
//! Process-wide counters ([`launch_counters`]) say how many ops were planned and replayed,
//! how many kernels and cuBLAS calls were issued and how many times the host waited for the
//! device, so a test can compare a step with the schedule that made it.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::{result, sys, CudaFunction};
use protrain_ir::{OpKind, TensorType};

use super::driver::{driver_error, ParamKind};
use super::launch::{Addresses, Arg, Call, ADAMW_SCALARS};
use crate::backend::{Address, Launch};
use crate::error::{Result, RuntimeError};

/// Most arguments of a kernel (the attention kernels pass the most, 17): a replay builds the
/// pointer array `cuLaunchKernel` takes on the stack.
pub(super) const MAX_KERNEL_ARGS: usize = 32;

/// One kernel launch, resolved: nothing left to look up or allocate to issue it.
pub(super) struct ReadyKernel {
    /// The entry point, for errors.
    name: &'static str,
    /// The loaded function (owned by the backend's [`super::driver::Kernels`], which outlives
    /// every stream).
    func: sys::CUfunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    /// Dynamic shared memory in bytes (none of the kernels uses any today).
    shared: u32,
    /// Each argument's bytes at the start of its own 8-byte slot, in parameter order.
    args: Vec<[u8; 8]>,
}

// SAFETY: `func` is a handle into a module the backend keeps loaded; the driver allows
// launching it from any thread that has the context current.
unsafe impl Send for ReadyKernel {}

impl ReadyKernel {
    /// `name` (function `f`, parameters `params`) over `grid` x `block` with `args`, which must
    /// be resolved (no [`Arg::Table`] or [`Arg::NormSlot`]) and match `params`.
    pub(super) fn new(
        name: &'static str,
        f: &CudaFunction,
        params: &[ParamKind],
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &[Arg],
    ) -> Result<Self> {
        let kinds_match =
            args.len() == params.len() && args.iter().zip(params).all(|(a, p)| a.kind() == *p);
        if !kinds_match {
            let kinds: Vec<ParamKind> = args.iter().map(Arg::kind).collect();
            return Err(RuntimeError::BadSchedule(format!(
                "kernel {name} takes {params:?} but the launch passes {kinds:?}; this is a bug \
                 in runtime/src/cuda/launch.rs"
            )));
        }
        if args.len() > MAX_KERNEL_ARGS {
            return Err(RuntimeError::BadSchedule(format!(
                "kernel {name} takes {} arguments, more than the {MAX_KERNEL_ARGS} a launch \
                 passes; raise MAX_KERNEL_ARGS in runtime/src/cuda/replay.rs",
                args.len()
            )));
        }
        let args = args
            .iter()
            .map(|a| {
                let mut slot = [0u8; 8];
                match *a {
                    Arg::Ptr(v) => slot.copy_from_slice(&v.to_ne_bytes()),
                    Arg::I64(v) => slot.copy_from_slice(&v.to_ne_bytes()),
                    Arg::I32(v) => slot[..4].copy_from_slice(&v.to_ne_bytes()),
                    Arg::F32(v) => slot[..4].copy_from_slice(&v.to_ne_bytes()),
                    Arg::Table(_) | Arg::NormSlot => {
                        return Err(RuntimeError::BadSchedule(format!(
                            "kernel {name} was prepared with an unresolved {a:?}; this is a bug \
                             in runtime/src/cuda/backend.rs"
                        )))
                    }
                }
                Ok(slot)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            name,
            func: f.cu_function(),
            grid,
            block,
            shared: 0,
            args,
        })
    }

    /// Overwrites the last `values.len()` arguments, which must be `float`s (an AdamW's step
    /// scalars).
    fn patch_tail(&mut self, values: &[f32]) {
        let from = self.args.len() - values.len();
        for (slot, v) in self.args[from..].iter_mut().zip(values) {
            slot[..4].copy_from_slice(&v.to_ne_bytes());
        }
    }

    /// Enqueues the launch on `stream`.
    ///
    /// # Safety
    ///
    /// The context is current; the arguments' addresses are live and the ordering contract
    /// the launch was issued under keeps other streams away from them.
    pub(super) unsafe fn launch(&self, stream: sys::CUstream) -> Result<()> {
        let mut params = [std::ptr::null_mut::<c_void>(); MAX_KERNEL_ARGS];
        for (p, slot) in params.iter_mut().zip(&self.args) {
            // The driver only reads through these pointers.
            *p = slot.as_ptr().cast_mut().cast();
        }
        // SAFETY: one pointer per declared parameter (checked in `new`), each to at least the
        // parameter's bytes; the caller's contract for the rest.
        unsafe {
            result::launch_kernel(
                self.func,
                self.grid,
                self.block,
                self.shared,
                stream,
                &mut params[..self.args.len()],
            )
        }
        .map_err(|e| driver_error(format!("launching {}", self.name), e))?;
        KERNELS.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// One step of a prepared op.
pub(super) enum ReadyCall {
    /// A kernel, resolved.
    Kernel(ReadyKernel),
    /// A cuBLAS call, as its plan describes it (the description is plain data: nothing to
    /// resolve).
    Library(Call),
}

/// An op's launches, resolved, with what they were made from (see the module doc).
pub(super) struct ReadyOp {
    kind: OpKind,
    inputs: Vec<TensorType>,
    outputs: Vec<TensorType>,
    at_inputs: Vec<Address>,
    at_outputs: Vec<Address>,
    workspace: Option<(Address, u64)>,
    /// The operands' device addresses the plan was made with (a merged AdamW run is planned
    /// again from its members').
    pub addresses: Addresses,
    /// The launches, in issue order; none for an AdamW op held for its run's last.
    pub calls: Vec<ReadyCall>,
    /// Whether a launch writes the backend's gradient-norm slot ([`Arg::NormSlot`]).
    pub writes_norm: bool,
    /// For an AdamW op, its step scalars as last issued.
    pub scalars: Option<[f32; ADAMW_SCALARS]>,
}

impl ReadyOp {
    /// A prepared op for launch `l`, its operand types `inputs` and `outputs`, device
    /// addresses `addresses` and launches `calls`.
    pub(super) fn new(
        l: &Launch<'_>,
        inputs: &[&TensorType],
        outputs: &[&TensorType],
        addresses: Addresses,
        calls: Vec<ReadyCall>,
        writes_norm: bool,
    ) -> Self {
        Self {
            kind: l.op.kind.clone(),
            inputs: inputs.iter().map(|&t| t.clone()).collect(),
            outputs: outputs.iter().map(|&t| t.clone()).collect(),
            at_inputs: l.inputs.to_vec(),
            at_outputs: l.outputs.to_vec(),
            workspace: l.workspace,
            addresses,
            calls,
            writes_norm,
            scalars: None,
        }
    }

    /// Whether launch `l` has the plan this op was made from: the same kind (an AdamW's step
    /// scalars aside, which are patched), operand types and addresses. Allocates nothing.
    pub(super) fn matches(&self, l: &Launch<'_>) -> bool {
        let graph = l.graph;
        let op = l.op;
        same_plan(&self.kind, &op.kind)
            && self.at_inputs == l.inputs
            && self.at_outputs == l.outputs
            && self.workspace == l.workspace
            && self.inputs.len() == op.inputs.len()
            && self.outputs.len() == op.outputs.len()
            && self
                .inputs
                .iter()
                .zip(&op.inputs)
                .all(|(t, &v)| *t == graph.value(v).ty)
            && self
                .outputs
                .iter()
                .zip(&op.outputs)
                .all(|(t, &v)| *t == graph.value(v).ty)
    }

    /// The kind the op was planned with.
    pub(super) fn kind(&self) -> &OpKind {
        &self.kind
    }

    /// Its operand types.
    pub(super) fn types(&self) -> (&[TensorType], &[TensorType]) {
        (&self.inputs, &self.outputs)
    }

    /// Writes `scalars` into its AdamW launch (the last [`ADAMW_SCALARS`] arguments of the
    /// `adamw_*` or `adamw_multi_*` kernel).
    pub(super) fn patch_adamw(&mut self, scalars: &[f32; ADAMW_SCALARS]) {
        for call in &mut self.calls {
            if let ReadyCall::Kernel(k) = call {
                if k.name.starts_with("adamw_") {
                    k.patch_tail(scalars);
                }
            }
        }
    }
}

/// Whether ops of kinds `a` and `b` have the same plan but for what a replay patches: two
/// AdamWs differ only in their step scalars unless one is clipped and the other not.
fn same_plan(a: &OpKind, b: &OpKind) -> bool {
    match (a, b) {
        (OpKind::AdamW { clipped: x, .. }, OpKind::AdamW { clipped: y, .. }) => x == y,
        _ => a == b,
    }
}

static KERNELS: AtomicU64 = AtomicU64::new(0);
static LIBRARY_CALLS: AtomicU64 = AtomicU64::new(0);
static PLANNED: AtomicU64 = AtomicU64::new(0);
static REPLAYED: AtomicU64 = AtomicU64::new(0);
static SYNCS: AtomicU64 = AtomicU64::new(0);

/// What the CUDA backends of this process have issued so far: see [`launch_counters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaunchCounters {
    /// Kernel launches (`cuLaunchKernel`).
    pub kernels: u64,
    /// cuBLAS calls (each GEMM or strided-batched GEMM of a plan).
    pub library_calls: u64,
    /// Device-stream launches of an op that planned it ([`super::launch::calls`]) and
    /// resolved the plan: an op's first issue, or one whose kind, types or addresses changed.
    pub planned: u64,
    /// Device-stream launches of an op that replayed its prepared launches.
    pub replayed: u64,
    /// Host waits for device work: a stream synchronised at the end of its step, an event a
    /// host stream waited on, the whole device settled before a host access.
    pub syncs: u64,
}

impl std::ops::Sub for LaunchCounters {
    type Output = LaunchCounters;

    /// What was counted between two readings (`later - earlier`).
    fn sub(self, earlier: LaunchCounters) -> LaunchCounters {
        LaunchCounters {
            kernels: self.kernels - earlier.kernels,
            library_calls: self.library_calls - earlier.library_calls,
            planned: self.planned - earlier.planned,
            replayed: self.replayed - earlier.replayed,
            syncs: self.syncs - earlier.syncs,
        }
    }
}

/// The counters of every CUDA backend in this process so far (a test that reads them runs
/// alone on the device).
pub fn launch_counters() -> LaunchCounters {
    LaunchCounters {
        kernels: KERNELS.load(Ordering::Relaxed),
        library_calls: LIBRARY_CALLS.load(Ordering::Relaxed),
        planned: PLANNED.load(Ordering::Relaxed),
        replayed: REPLAYED.load(Ordering::Relaxed),
        syncs: SYNCS.load(Ordering::Relaxed),
    }
}

/// Counts a kernel launched outside a prepared op (the backend's own sums, the profiler).
pub(super) fn count_kernel() {
    KERNELS.fetch_add(1, Ordering::Relaxed);
}

/// Counts a cuBLAS call.
pub(super) fn count_library_call() {
    LIBRARY_CALLS.fetch_add(1, Ordering::Relaxed);
}

/// Counts an op planned (`true`) or replayed (`false`).
pub(super) fn count_op(planned: bool) {
    match planned {
        true => PLANNED.fetch_add(1, Ordering::Relaxed),
        false => REPLAYED.fetch_add(1, Ordering::Relaxed),
    };
}

/// Counts a host wait for device work.
pub(super) fn count_sync() {
    SYNCS.fetch_add(1, Ordering::Relaxed);
}
