//! [`Workers`]: a few named background threads behind a bounded queue, for the work a session keeps off
//! its executor (decoding received chunks, filling payloads from the content cache, writing the cache).

use std::sync::mpsc::{SyncSender, sync_channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use tracing::warn;

/// Up to n threads taking jobs from one bounded queue; each thread keeps state it made itself (a
/// decoder, say). A job the threads cannot take (none could be started) runs on the caller's thread,
/// so nothing is lost. Dropping it lets the threads finish the queued jobs, then joins them.
pub struct Workers<J> {
    jobs: Option<SyncSender<J>>,
    threads: Vec<JoinHandle<()>>,
    /// Runs a job on the caller's thread, with fresh state.
    inline: Arc<dyn Fn(J) + Send + Sync>,
}

impl<J: Send + 'static> Workers<J> {
    /// Starts up to `threads` (at least one) threads named `name`, each running `work` on the jobs with
    /// the state `state` makes; `queue` jobs at most wait for them ([`Workers::run`] blocks past it).
    pub fn start<S: 'static>(
        name: &str,
        threads: usize,
        queue: usize,
        state: impl Fn() -> S + Send + Sync + 'static,
        work: impl Fn(&mut S, J) + Send + Sync + 'static,
    ) -> Self {
        let (state, work) = (Arc::new(state), Arc::new(work));
        let (jobs, rx) = sync_channel::<J>(queue);
        let rx = Arc::new(Mutex::new(rx));
        let threads: Vec<JoinHandle<()>> = (0..threads.max(1))
            .filter_map(|_| {
                let (rx, state, work) = (rx.clone(), state.clone(), work.clone());
                std::thread::Builder::new()
                    .name(name.into())
                    .spawn(move || {
                        let mut mine = state();
                        loop {
                            // The lock is held only while waiting for the next job.
                            let job = rx.lock().unwrap_or_else(PoisonError::into_inner).recv();
                            let Ok(job) = job else { break };
                            work(&mut mine, job);
                        }
                    })
                    .inspect_err(|err| warn!(%err, name, "cannot start a worker thread"))
                    .ok()
            })
            .collect();
        if threads.is_empty() {
            warn!(name, "no worker thread: its jobs run inline");
        }
        Self {
            jobs: (!threads.is_empty()).then_some(jobs),
            threads,
            inline: Arc::new(move |job| work(&mut state(), job)),
        }
    }

    /// Queues `job` (waiting for room), or runs it here when no thread is there to take it.
    pub fn run(&self, job: J) {
        let job = match &self.jobs {
            Some(jobs) => match jobs.send(job) {
                Ok(()) => return,
                Err(err) => err.0,
            },
            None => job,
        };
        (self.inline)(job);
    }
}

impl<J> std::fmt::Debug for Workers<J> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workers")
            .field("threads", &self.threads.len())
            .finish_non_exhaustive()
    }
}

impl<J> Drop for Workers<J> {
    fn drop(&mut self) {
        drop(self.jobs.take());
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_job_runs_once_with_its_threads_own_state_and_drop_waits_for_them() {
        let done = Arc::new(AtomicUsize::new(0));
        let made = Arc::new(AtomicUsize::new(0));
        let workers = {
            let (done, made) = (done.clone(), made.clone());
            Workers::start(
                "test-worker",
                3,
                2,
                move || {
                    made.fetch_add(1, Ordering::SeqCst);
                    0usize
                },
                move |count: &mut usize, n: usize| {
                    *count += 1;
                    done.fetch_add(n, Ordering::SeqCst);
                },
            )
        };
        for n in 1..=100 {
            workers.run(n);
        }
        drop(workers);
        assert_eq!(done.load(Ordering::SeqCst), 5050);
        assert_eq!(made.load(Ordering::SeqCst), 3);
    }
}
