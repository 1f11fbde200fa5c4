//! A scoped fan-out over the machine's cores, for hashing, verifying and compressing chunks.
//!
//! Scoped threads rather than a pool: the client side runs inside the application's process (the
//! shim), where a resident thread pool would be an unwelcome guest, and a payload worth splitting
//! is several MiB, next to which spawning a thread (~20 µs) is noise.

use std::sync::Mutex;
use std::thread;

/// The machine's cores (1 if unknown): how many threads [`map`] uses at most.
pub fn cores() -> usize {
    thread::available_parallelism().map_or(1, std::num::NonZero::get)
}

/// `f` applied to every item, on up to as many threads as there are cores; results in item order.
pub fn map<I: Send, T: Send>(items: Vec<I>, f: impl Fn(I) -> T + Sync) -> Vec<T> {
    let threads = cores().min(items.len());
    if threads <= 1 {
        return items.into_iter().map(f).collect();
    }
    let n = items.len();
    let queue = Mutex::new(items.into_iter().enumerate());
    let next = || {
        queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .next()
    };
    let mut done: Vec<(usize, T)> = thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut out = Vec::new();
                    while let Some((i, item)) = next() {
                        out.push((i, f(item)));
                    }
                    out
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| match w.join() {
                Ok(out) => out,
                Err(panic) => std::panic::resume_unwind(panic),
            })
            .collect()
    });
    debug_assert_eq!(done.len(), n);
    done.sort_unstable_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, t)| t).collect()
}
