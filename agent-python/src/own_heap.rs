//! Counts the extension's own heap. Every Rust allocation in this library is
//! the agent's (census tables, queues, spool buffers), so the system
//! allocator, wrapped with one relaxed counter, tells exactly what the agent
//! holds. Samples carry it (agent-core's `own_heap`), and the analysis reads
//! the server's growth without it: a census's address table, kept until the
//! next census, would otherwise be a step in the server's RSS.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

static LIVE: AtomicUsize = AtomicUsize::new(0);

struct Counting;

// SAFETY: each method forwards to `System` unchanged; the counter only
// observes sizes and never touches the memory.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            // The old block is gone only when the new one was given.
            LIVE.fetch_add(new_size, Ordering::Relaxed);
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Live bytes the extension's Rust code holds now (requested sizes, without
/// the allocator's own headers).
pub fn live_bytes() -> u64 {
    LIVE.load(Ordering::Relaxed) as u64
}

/// Hands back to the system what a census freed. A census lists every
/// tracked object (lists of 8 bytes an object, a table of their addresses)
/// and frees most of it at once; glibc keeps such freed memory resident,
/// where it reads as a step in the server's RSS. `malloc_trim` returns the
/// free pages of every arena (about 1 ms for a 500 MiB heap, measured);
/// it runs without the GIL, on the thread that took the census.
pub fn trim_after_census() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory; it takes each arena's
    // lock and is safe to call from any thread.
    unsafe {
        libc::malloc_trim(0);
    }
}
