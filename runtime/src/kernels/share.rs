//! Work shared out between the calling thread and a pool's threads, without the calling
//! thread waiting for threads that wake too late to find any.
//!
//! A rayon job handed to a pool from outside it (`install`, `scope`) returns only once a
//! pool thread has taken it and finished it, and the calling thread sleeps meanwhile: where
//! other threads hold the cores (the host backend's compute kernels beside its optimizer),
//! each hand-over waits for a woken thread to get a core, at both ends of the job. Here the
//! calling thread works through the items itself from the first moment, the pool's threads
//! join in as they wake, and the call returns as soon as the last item is done.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// What the calling thread and the pool's threads share for one [`share_out`]: the counters
/// and, with their lifetimes erased, the items and the work. The pointers are dereferenced
/// only for a claimed index below `len`, and [`share_out`] returns only after every such
/// index is done, so they never outlive the call; a thread that wakes later claims an index
/// at or beyond `len` and touches nothing else.
struct Shared {
    /// The next unclaimed index.
    next: AtomicUsize,
    /// Items done (whatever their outcome).
    done: AtomicUsize,
    len: usize,
    /// The first panic of the work, resumed on the calling thread.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// The items (`*mut T`).
    items: *mut (),
    /// The work (`*const &(dyn Fn(T) + Sync)`).
    work: *const (),
    /// Moves item `i` out and runs the work on it ([`take`] for the items' type).
    take: unsafe fn(*mut (), *const (), usize),
}

// SAFETY: the pointers are used only as the type's docs say, for items that are `Send` and
// work that is `Sync`.
unsafe impl Send for Shared {}
// SAFETY: as for `Send`; every other field is thread-safe.
unsafe impl Sync for Shared {}

/// Moves item `i` out of `items` and runs `work` on it.
///
/// # Safety
///
/// `items` points at a live buffer of at least `i + 1` items of `T` whose item `i` is moved
/// out once, here; `work` points at a live `&(dyn Fn(T) + Sync)`.
unsafe fn take<T>(items: *mut (), work: *const (), i: usize) {
    // SAFETY: the caller's contract.
    unsafe {
        let item = std::ptr::read(items.cast::<T>().add(i));
        let work = &*work.cast::<&(dyn Fn(T) + Sync)>();
        work(item);
    }
}

/// Claims and runs items until none is left.
fn drain(shared: &Shared) {
    loop {
        let i = shared.next.fetch_add(1, Ordering::AcqRel);
        if i >= shared.len {
            return;
        }
        // SAFETY: index `i` is below `len` and claimed by this thread alone, and `share_out`
        // keeps the items and the work alive until `done` counts it.
        let outcome = catch_unwind(AssertUnwindSafe(|| unsafe {
            (shared.take)(shared.items, shared.work, i)
        }));
        if let Err(panic) = outcome {
            shared
                .panic
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get_or_insert(panic);
        }
        shared.done.fetch_add(1, Ordering::Release);
    }
}

/// Runs `work` on every item of `items`, each once, on the calling thread and on the threads
/// of `pool` (one task for each, spawned first): every thread takes the next item from a
/// shared counter. Returns once every item is done; a pool thread that wakes after the last
/// item was taken finds none and ends without the caller waiting for it. While a pool thread
/// finishes the last items the calling thread spins, then yields. One item or none runs on
/// the calling thread alone. A panic of the work is resumed here once every item is done.
pub fn share_out<T: Send>(items: Vec<T>, work: &(dyn Fn(T) + Sync), pool: &rayon::ThreadPool) {
    let len = items.len();
    if len <= 1 {
        items.into_iter().for_each(work);
        return;
    }
    let mut items = std::mem::ManuallyDrop::new(items);
    let shared = Arc::new(Shared {
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        len,
        panic: Mutex::new(None),
        items: items.as_mut_ptr().cast(),
        work: std::ptr::from_ref(&work).cast(),
        take: take::<T>,
    });
    for _ in 0..pool.current_num_threads() {
        let shared = Arc::clone(&shared);
        pool.spawn(move || drain(&shared));
    }
    drain(&shared);
    let mut spins = 0u32;
    while shared.done.load(Ordering::Acquire) < len {
        match spins < 1 << 12 {
            true => std::hint::spin_loop(),
            false => std::thread::yield_now(),
        }
        spins += 1;
    }
    // SAFETY: every item was moved out (each index below `len` was taken once and is done),
    // so the buffer is freed without dropping any of them again.
    unsafe {
        items.set_len(0);
        std::mem::ManuallyDrop::drop(&mut items);
    }
    let panic = shared
        .panic
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
    if let Some(panic) = panic {
        resume_unwind(panic);
    }
}

#[cfg(test)]
mod tests {
    use super::share_out;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Barrier, Mutex};

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    }

    #[test]
    fn every_item_is_worked_on_once() {
        for (threads, len) in [(1, 0), (1, 1), (2, 2), (3, 1000)] {
            let seen: Vec<AtomicUsize> = (0..len).map(|_| AtomicUsize::new(0)).collect();
            let items: Vec<usize> = (0..len).collect();
            share_out(
                items,
                &|i| {
                    seen[i].fetch_add(1, Ordering::Relaxed);
                },
                &pool(threads),
            );
            assert!(
                seen.iter().all(|n| n.load(Ordering::Relaxed) == 1),
                "{threads} {len}"
            );
        }
    }

    /// With every pool thread held up, the calling thread does all the work and returns
    /// without waiting for them; when they are let go they find nothing left.
    #[test]
    fn the_caller_does_not_wait_for_threads_that_wake_late() {
        let pool = pool(2);
        let gate = Arc::new(Barrier::new(3));
        for _ in 0..2 {
            let gate = Arc::clone(&gate);
            pool.spawn(move || {
                gate.wait();
            });
        }
        let by = Mutex::new(Vec::new());
        let items: Vec<Box<usize>> = (0..64).map(Box::new).collect();
        share_out(
            items,
            &|i| by.lock().unwrap().push((*i, std::thread::current().id())),
            &pool,
        );
        let by = by.into_inner().unwrap();
        assert_eq!(by.len(), 64);
        let me = std::thread::current().id();
        assert!(
            by.iter().all(|&(_, id)| id == me),
            "the pool's threads were held up"
        );
        // The held-up threads go on, take their late tasks and find nothing.
        gate.wait();
        pool.install(|| {});
    }

    #[test]
    fn a_panic_of_the_work_is_resumed_after_every_item_is_done() {
        let done = AtomicUsize::new(0);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            share_out(
                (0..100).collect::<Vec<usize>>(),
                &|i| {
                    done.fetch_add(1, Ordering::Relaxed);
                    assert_ne!(i, 37, "item 37 fails");
                },
                &pool(2),
            )
        }));
        let message = outcome.unwrap_err();
        let text = message
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default();
        assert!(text.contains("item 37 fails"), "{text}");
        assert_eq!(done.load(Ordering::Relaxed), 100);
    }
}
