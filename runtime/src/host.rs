//! The host backend: the arena and the host region in host memory, streams as threads.
//!
//! The device arena is one 256-byte-aligned allocation of exactly the planned size, the host
//! region another; every tensor is read and written in place at its planned offset. A stream's
//! work runs on the thread that issues it (the executor gives each stream its own thread),
//! kernels use rayon inside (every stream thread shares the global pool, which is how rayon is
//! meant to be called from several threads), copies are `memcpy` on the issuing thread, and
//! events are real synchronisation: a flag per event under one mutex, with a condition
//! variable that wakes waiters.

use crate::backend::{Address, Backend, Launch};
use crate::dispatch::{self, Outcome};
use crate::error::{Result, RuntimeError};
use bytemuck::Pod;
use protrain_ir::{EventId, OpKind, Space, StreamKind};
use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

/// Alignment of the arena and the host region, as the planner aligns buffers.
pub const REGION_ALIGN: usize = 256;

/// Most outputs an op kind writes: a fused linear's backward with the most projections
/// ([`protrain_ir::op::MAX_PROJECTIONS`], each with a bias) writes `1 + 2 * 15`.
const MAX_OUTPUTS: usize = 1 + 2 * protrain_ir::op::MAX_PROJECTIONS as usize;

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
}

/// A host stream: its work runs on the thread that issues it.
#[derive(Debug)]
pub struct HostStream {
    kind: StreamKind,
}

impl HostStream {
    /// What the stream is for.
    pub fn kind(&self) -> StreamKind {
        self.kind
    }
}

impl HostBackend {
    fn region(&self, space: Space) -> &Region {
        match space {
            Space::Device => &self.arena,
            Space::Host => &self.host,
        }
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
            self.region(at.space)
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
            self.region(at.space)
                .at(at.offset, (len * size) as u64, std::mem::align_of::<T>())?;
        // SAFETY: as in `slice`, and no other view exists per the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr.cast::<T>(), len) })
    }
}

/// A kernel's inputs at their planned addresses, checked in bounds before the kernel runs.
struct ArenaInputs<'a> {
    backend: &'a HostBackend,
    launch: &'a Launch<'a>,
}

impl ArenaInputs<'_> {
    fn len(&self, i: usize) -> usize {
        self.launch.graph.value(self.launch.op.inputs[i]).ty.numel() as usize
    }

    /// Checks every input's range and alignment, so the views below cannot fail.
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
            self.backend
                .region(at.space)
                .at(at.offset, 4 * self.len(i) as u64, 4)?;
        }
        Ok(())
    }
}

impl<'a> dispatch::Inputs<'a> for ArenaInputs<'a> {
    fn f32(&self, i: usize) -> &'a [f32] {
        // SAFETY: in bounds (checked in `check`); the ordering contract `launch` was called
        // under keeps writers away while the kernel reads.
        unsafe { self.backend.slice(self.launch.inputs[i], self.len(i)) }
            .expect("inputs were checked before the kernel ran")
    }

    fn i32(&self, i: usize) -> &'a [i32] {
        // SAFETY: as for `f32`.
        unsafe { self.backend.slice(self.launch.inputs[i], self.len(i)) }
            .expect("inputs were checked before the kernel ran")
    }
}

/// Memory the system can give without swapping (`MemAvailable` in `/proc/meminfo`), where
/// that can be read.
fn memory_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Fails when the arena and host region together need more than `available` bytes. The
/// allocation itself would succeed (pages are zeroed lazily) and the run be killed part way
/// when they are touched; this says up front what is missing. `None` (not known) passes.
fn check_available(arena_bytes: u64, host_bytes: u64, available: Option<u64>) -> Result<()> {
    let needed = arena_bytes.saturating_add(host_bytes);
    match available {
        Some(available) if needed > available => Err(RuntimeError::BadSchedule(format!(
            "the device arena ({}) and host region ({}) need {} of memory, but only {} is \
             available on this machine ({} missing); free memory, or compile the schedule for \
             less with --gpu-memory and --host-memory",
            protrain_ir::format_bytes(arena_bytes),
            protrain_ir::format_bytes(host_bytes),
            protrain_ir::format_bytes(needed),
            protrain_ir::format_bytes(available),
            protrain_ir::format_bytes(needed - available),
        ))),
        _ => Ok(()),
    }
}

impl Backend for HostBackend {
    type Stream = HostStream;

    fn new(arena_bytes: u64, host_bytes: u64, events: u32) -> Result<Self> {
        check_available(arena_bytes, host_bytes, memory_available())?;
        Ok(Self {
            arena: Region::new(arena_bytes, "device arena")?,
            host: Region::new(host_bytes, "host region")?,
            events: Mutex::new(EventState {
                recorded: vec![false; events as usize],
                aborted: false,
            }),
            event_recorded: Condvar::new(),
        })
    }

    fn create_stream(&self, kind: StreamKind) -> Result<HostStream> {
        Ok(HostStream { kind })
    }

    fn begin_step(&mut self) {
        let state = self
            .events
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        state.recorded.fill(false);
        state.aborted = false;
    }

    unsafe fn launch(&self, _stream: &mut HostStream, l: &Launch<'_>) -> Result<Outcome> {
        let (graph, op) = (l.graph, l.op);
        let len = |v: protrain_ir::ValueId| graph.value(v).ty.numel() as usize;
        if let OpKind::AdamW { clipped, .. } = op.kind {
            if l.inputs.len() != op.inputs.len() || op.inputs.len() < 4 + usize::from(clipped) {
                return Err(RuntimeError::BadSchedule(format!(
                    "adamw has {} inputs but its kernel gives {} addresses",
                    op.inputs.len(),
                    l.inputs.len()
                )));
            }
            // SAFETY: the caller upholds the ordering contract: nothing else touches the
            // parameter, moments or gradient meanwhile, and they do not overlap each other.
            unsafe {
                let param = self.slice_mut(l.inputs[0], len(op.inputs[0]))?;
                let grad = self.slice(l.inputs[1], len(op.inputs[1]))?;
                let m = self.slice_mut(l.inputs[2], len(op.inputs[2]))?;
                let v = self.slice_mut(l.inputs[3], len(op.inputs[3]))?;
                let coef = match clipped {
                    true => Some(self.slice::<f32>(l.inputs[4], 1)?[0]),
                    false => None,
                };
                dispatch::adamw(&op.kind, param, grad, m, v, coef, l.step);
            }
            return Ok(Outcome::default());
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
        let mut outputs: [&mut [f32]; MAX_OUTPUTS] = Default::default();
        for (i, out) in outputs.iter_mut().enumerate().take(n) {
            // SAFETY: the caller upholds the ordering contract: outputs overlap no input, no
            // other output and the workspace, and no other stream touches them meanwhile.
            *out = unsafe { self.slice_mut(l.outputs[i], len(op.outputs[i]))? };
        }
        let workspace: &mut [f32] = match l.workspace {
            // SAFETY: as for the outputs.
            Some((at, bytes)) => unsafe { self.slice_mut(at, (bytes / 4) as usize)? },
            None => &mut [],
        };
        dispatch::run(graph, op, l.prepared, &inputs, &mut outputs[..n], workspace)
    }

    unsafe fn copy(
        &self,
        _stream: &mut HostStream,
        src: Address,
        dst: Address,
        bytes: u64,
    ) -> Result<()> {
        let from = self.region(src.space).at(src.offset, bytes, 1)?;
        let to = self.region(dst.space).at(dst.offset, bytes, 1)?;
        // SAFETY: both ranges are inside their regions (checked above); the caller upholds the
        // ordering contract for them. `copy` (memmove): nothing here rules out that they
        // overlap each other.
        unsafe { std::ptr::copy(from, to, bytes as usize) };
        Ok(())
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
        // SAFETY: `&mut self`: no step is running, so no other view exists.
        unsafe { self.slice_mut(at, data.len())? }.copy_from_slice(data);
        Ok(())
    }

    fn write_i32(&mut self, at: Address, data: &[i32]) -> Result<()> {
        // SAFETY: as in `write_f32`.
        unsafe { self.slice_mut(at, data.len())? }.copy_from_slice(data);
        Ok(())
    }

    fn fill_zero(&mut self, at: Address, bytes: u64) -> Result<()> {
        let ptr = self.region(at.space).at(at.offset, bytes, 1)?;
        // SAFETY: in bounds (checked above); `&mut self`: no step is running.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes as usize) };
        Ok(())
    }

    fn read_f32(&self, at: Address, out: &mut [f32]) -> Result<()> {
        // SAFETY: nothing writes these bytes meanwhile: a `launch` or `copy` writing them
        // concurrently would break the ordering contract its caller promised.
        out.copy_from_slice(unsafe { self.slice(at, out.len())? });
        Ok(())
    }
}

#[cfg(test)]
mod tests {

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
        assert!(check_available(1, 1, Some(2)).is_ok());
        assert!(check_available(2, 1, Some(2)).is_err());
        assert!(check_available(u64::MAX, 1, None).is_ok());
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
