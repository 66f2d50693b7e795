//! The deadlines of [`crate::EngineConfig::sql_statement_timeout`], kept by a thread outside
//! the SQL runtime.
//!
//! A statement runs as a task on the engine's SQL runtime, and a tokio timer inside it is
//! seen only when the task yields: an operator that works long between yields (a join whose
//! condition discards most pairs, a window over the whole input) kept the worker, and with
//! one SQL thread its caller waited 4–25 s past a 300 ms deadline and got an answer
//! (helper-42). Here one thread per engine (`gritdb-sql-deadline`, started at the first
//! statement with a timeout, ended with the engine's SQL state) waits for the earliest
//! pending deadline; at it, it marks the statement's [`Deadline`] passed, aborts its task and
//! wakes its caller, whose `QueryTask` then returns `Timeout` without waiting for the SQL
//! worker. The aborted task is dropped at its next yield, and its memory given back then.

use futures::task::AtomicWaker;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::task::Context;
use std::time::Instant;
use tokio::task::AbortHandle;

/// The pending deadlines and their thread; ends the thread when dropped.
#[derive(Default)]
pub(crate) struct Watchdog {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    queue: Mutex<Queue>,
    /// Signalled when an earlier deadline is added, or at `stop`.
    changed: Condvar,
}

#[derive(Default)]
struct Queue {
    /// Pending deadlines by (time, registration number): a statement that ends first removes
    /// its own, so this holds only statements still running.
    due: BTreeMap<(Instant, u64), Arc<Entry>>,
    next: u64,
    /// Whether the thread runs (started at the first registration).
    running: bool,
    /// Set when the [`Watchdog`] is dropped: the thread ends.
    stop: bool,
}

/// One statement's side of its deadline: set and woken by the thread.
struct Entry {
    passed: AtomicBool,
    waker: AtomicWaker,
    task: AbortHandle,
}

impl Entry {
    fn fire(&self) {
        // The mark first: a caller that sees its task cancelled then sees it passed.
        self.passed.store(true, Ordering::Release);
        self.task.abort();
        self.waker.wake();
    }
}

/// A statement's registered deadline; dropping it (the statement is done) removes it.
pub(crate) struct Deadline {
    shared: Arc<Shared>,
    key: (Instant, u64),
    entry: Arc<Entry>,
}

impl Deadline {
    /// Whether the deadline has passed; if not, `cx`'s waker is woken when it does.
    pub(crate) fn passed(&self, cx: &Context<'_>) -> bool {
        self.entry.waker.register(cx.waker());
        self.entry.passed.load(Ordering::Acquire)
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        // Gone already when it passed. An earliest deadline removed leaves the thread one
        // spurious wake-up, so it is not signalled.
        self.shared.lock().due.remove(&self.key);
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Watchdog {
    /// Registers a deadline `at` which `task` is aborted and the returned [`Deadline`] passes.
    /// `None` when the thread could not be started (the statement then has only its
    /// in-task timer).
    pub(crate) fn register(&self, at: Instant, task: AbortHandle) -> Option<Deadline> {
        let mut q = self.shared.lock();
        if !q.running {
            let shared = Arc::clone(&self.shared);
            std::thread::Builder::new().name("gritdb-sql-deadline".into()).spawn(move || run(&shared)).ok()?;
            q.running = true;
        }
        let key = (at, q.next);
        q.next = q.next.wrapping_add(1);
        let entry = Arc::new(Entry { passed: AtomicBool::new(false), waker: AtomicWaker::new(), task });
        let earliest = q.due.first_key_value().is_none_or(|(first, _)| key < *first);
        q.due.insert(key, Arc::clone(&entry));
        drop(q);
        if earliest {
            self.shared.changed.notify_one();
        }
        Some(Deadline { shared: Arc::clone(&self.shared), key, entry })
    }

    /// How many deadlines are pending (statements with a timeout still running).
    #[cfg(test)]
    fn pending(&self) -> usize {
        self.shared.lock().due.len()
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.changed.notify_one();
    }
}

/// The thread: fires each deadline when it comes, until [`Queue::stop`].
fn run(shared: &Shared) {
    let mut q = shared.lock();
    loop {
        if q.stop {
            return;
        }
        let now = Instant::now();
        let mut fired = Vec::new();
        while let Some(first) = q.due.first_entry() {
            if first.key().0 > now {
                break;
            }
            fired.push(first.remove());
        }
        if !fired.is_empty() {
            // Wakers run outside the lock (a statement ending meanwhile takes it to deregister).
            drop(q);
            for entry in &fired {
                entry.fire();
            }
            q = shared.lock();
            continue;
        }
        q = match q.due.first_key_value().map(|((at, _), _)| at.saturating_duration_since(now)) {
            Some(wait) => shared.changed.wait_timeout(q, wait).unwrap_or_else(PoisonError::into_inner).0,
            None => shared.changed.wait(q).unwrap_or_else(PoisonError::into_inner),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A deadline passes, aborts its task and wakes its waiter at its time, later ones wait;
    /// statements that end first leave nothing behind; dropping the watchdog ends its thread.
    #[test]
    #[allow(clippy::disallowed_methods)] // a runtime of the test's own
    fn deadlines_fire_in_order_deregister_and_the_thread_ends() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).build().unwrap();
        let watchdog = Watchdog::default();
        let start = Instant::now();
        let idle = || rt.spawn(std::future::pending::<()>());
        let (soon, late) = (idle(), idle());
        let late_deadline = watchdog.register(start + Duration::from_mins(10), late.abort_handle()).unwrap();
        let soon_deadline = watchdog.register(start + Duration::from_millis(100), soon.abort_handle()).unwrap();
        assert_eq!(watchdog.pending(), 2);
        // Awaited like `QueryTask`: woken at the deadline, not before.
        futures::executor::block_on(std::future::poll_fn(|cx| if soon_deadline.passed(cx) { std::task::Poll::Ready(()) } else { std::task::Poll::Pending }));
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(100) && waited < Duration::from_secs(5), "{waited:?}");
        assert!(rt.block_on(soon).unwrap_err().is_cancelled());
        let noop = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(!late_deadline.passed(&noop) && !late.is_finished());
        assert_eq!(watchdog.pending(), 1);
        drop((soon_deadline, late_deadline));
        assert_eq!(watchdog.pending(), 0);
        // Many statements that end before their deadline: nothing grows.
        for _ in 0..10_000 {
            let task = idle();
            let d = watchdog.register(Instant::now() + Duration::from_mins(1), task.abort_handle()).unwrap();
            assert!(!d.passed(&noop));
            task.abort();
        }
        assert_eq!(watchdog.pending(), 0);
        // The thread holds the only other reference to the shared state; it lets go as it ends.
        let shared = Arc::downgrade(&watchdog.shared);
        drop(watchdog);
        let until = Instant::now() + Duration::from_secs(10);
        while shared.strong_count() > 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(shared.strong_count(), 0, "the watchdog's thread still runs");
        drop(late);
    }
}
