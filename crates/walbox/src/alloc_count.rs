//! The global allocator's counts, for the benchmark: with
//! `WALBOX_COUNT_ALLOCATIONS=1` in its environment, walbox counts every
//! allocation, reallocation and byte the process asks the allocator for and
//! prints them on stderr when it exits (`walbox-bench --only allocations`
//! divides them by the events relayed). Memory that C libraries (librdkafka)
//! allocate with `malloc` is not seen.
//!
//! The counting is in every build, off unless asked for: one relaxed load of
//! a flag per allocation, so that the benchmark counts the very binary `make
//! release` builds and `make bench` builds nothing of its own.

// A global allocator is an unsafe trait; this one only passes each call on.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The allocator underneath, counted.
pub struct Counting<A>(pub A);

/// Whether this process counts (set once, at start).
static ON: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static REALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call goes to the allocator underneath unchanged; the counters
// are only added to.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Counting<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if ON.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { self.0.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if ON.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { self.0.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.0.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if ON.load(Ordering::Relaxed) {
            REALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            BYTES.fetch_add(
                new_size.saturating_sub(layout.size()) as u64,
                Ordering::Relaxed,
            );
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { self.0.realloc(ptr, layout, new_size) }
    }
}

/// Counts from now on when `WALBOX_COUNT_ALLOCATIONS=1` (the start of
/// `main`: the runtime's and the clients' start-up included).
pub fn start_if_asked() {
    if std::env::var_os("WALBOX_COUNT_ALLOCATIONS").is_some_and(|v| v == "1") {
        ON.store(true, Ordering::Relaxed);
    }
}

/// When counting, prints the line the benchmark reads, on exit:
/// `allocations: N reallocations: R bytes: B`.
#[allow(clippy::print_stderr)] // the benchmark reads it
pub fn report() {
    if !ON.load(Ordering::Relaxed) {
        return;
    }
    eprintln!(
        "allocations: {} reallocations: {} bytes: {}",
        ALLOCATIONS.load(Ordering::Relaxed),
        REALLOCATIONS.load(Ordering::Relaxed),
        BYTES.load(Ordering::Relaxed)
    );
}
