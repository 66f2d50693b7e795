//! The background writer: a tokio runtime owned by the engine whose blocking tasks flush
//! sealed deltas (and remove covered write-ahead-log segment files, [`spawn_blocking_on`]),
//! and the WAL record pool beside it. It is the one place gritdb spawns tasks (see
//! `clippy.toml`).

use crate::config::BackgroundPriority;
use crate::error::{Error, Result};
use crate::table::{TableInner, lock};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{Semaphore, mpsc};

/// Most threads the WAL record pool runs at once: one per writing thread with a big put in
/// flight (tokio's own default for a blocking pool). More writers than this queue for a thread;
/// a queued record waits only for its own writer, and one whose write was refused meanwhile
/// is cancelled unrun (`PendingAppend`).
const WAL_POOL_THREADS: usize = 512;

pub(crate) struct Writer {
    rt: Mutex<Option<tokio::runtime::Runtime>>,
    /// The WAL record pool: a runtime used only for its blocking threads, which encode and
    /// append the WAL records of big puts beside their writers (`Table::write`). Its own
    /// runtime, so records stuck behind a stalled disk never hold a thread a flush needs, and
    /// kept threads, so a record's buffers come from a warm allocator arena.
    wal_rt: Mutex<Option<tokio::runtime::Runtime>>,
    tx: mpsc::UnboundedSender<Arc<TableInner>>,
    in_flight: Arc<AtomicUsize>,
}

impl Writer {
    pub(crate) fn new(threads: usize) -> Result<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .max_blocking_threads(threads.max(1))
            .thread_name("gritdb-writer")
            .enable_time()
            .build()
            .map_err(|e| Error::Io { path: "tokio runtime".into(), source: e })?;
        let (tx, mut rx) = mpsc::unbounded_channel::<Arc<TableInner>>();
        let in_flight = Arc::new(AtomicUsize::new(0));
        let sem = Arc::new(Semaphore::new(threads.max(1)));
        let done = Arc::clone(&in_flight);
        // The dispatcher: one task receiving flush requests; each flush runs as a blocking task
        // bounded by the semaphore (at most `threads` flushes at once). Dropping the runtime
        // (Writer::shutdown) aborts it.
        #[allow(clippy::disallowed_methods)]
        rt.spawn(async move {
            while let Some(table) = rx.recv().await {
                let Ok(permit) = Arc::clone(&sem).acquire_owned().await else { break };
                let done = Arc::clone(&done);
                #[allow(clippy::disallowed_methods)]
                tokio::task::spawn_blocking(move || {
                    table.flush_scheduled.store(false, Ordering::Release);
                    run_flush(&table);
                    drop(permit);
                    done.fetch_sub(1, Ordering::AcqRel);
                });
            }
        });
        let wal_rt = tokio::runtime::Builder::new_current_thread()
            .max_blocking_threads(WAL_POOL_THREADS)
            .thread_name("gritdb-wal")
            .build()
            .map_err(|e| Error::Io { path: "tokio runtime".into(), source: e })?;
        Ok(Self { rt: Mutex::new(Some(rt)), wal_rt: Mutex::new(Some(wal_rt)), tx, in_flight })
    }

    /// A handle to the WAL record pool (`None` once shut down).
    pub(crate) fn wal_pool(&self) -> Option<tokio::runtime::Handle> {
        lock(&self.wal_rt).as_ref().map(|rt| rt.handle().clone())
    }

    /// Runs `tick` every `interval` on the writer's runtime until it returns `false` or the
    /// engine shuts down (used for the WAL group commit and for age-based flushes).
    pub(crate) fn start_ticker(&self, interval: std::time::Duration, mut tick: impl FnMut() -> bool + Send + 'static) {
        let g = lock(&self.rt);
        let Some(rt) = g.as_ref() else { return };
        #[allow(clippy::disallowed_methods)]
        rt.spawn(async move {
            let mut t = tokio::time::interval(interval.max(std::time::Duration::from_millis(1)));
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                t.tick().await;
                if !tick() {
                    break;
                }
            }
        });
    }

    /// Queues a flush of `table` unless one is already queued.
    pub(crate) fn schedule(&self, table: &Arc<TableInner>) {
        if table.flush_scheduled.swap(true, Ordering::AcqRel) {
            return;
        }
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        if self.tx.send(Arc::clone(table)).is_err() {
            table.flush_scheduled.store(false, Ordering::Release);
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// A handle to the writer's runtime (`None` once shut down), for the one other blocking
    /// task the engine runs there: removing covered WAL segment files.
    pub(crate) fn handle(&self) -> Option<tokio::runtime::Handle> {
        lock(&self.rt).as_ref().map(|rt| rt.handle().clone())
    }

    /// Flushes queued or running.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Stops the runtime without blocking (safe inside another tokio runtime).
    pub(crate) fn shutdown(&self) {
        if let Some(rt) = lock(&self.rt).take() {
            rt.shutdown_background();
        }
        if let Some(rt) = lock(&self.wal_rt).take() {
            rt.shutdown_background();
        }
    }
}

fn run_flush(table: &TableInner) {
    set_background_priority(table.shared.config.background_priority);
    let res = std::panic::catch_unwind(AssertUnwindSafe(|| table.flush_sealed(table.shared.config.background_flush_threads, None)));
    match res {
        Ok(Ok(rows)) => tracing::debug!(table = %table.name, rows, "background flush done"),
        Ok(Err(Error::TableNotFound { .. } | Error::Closed(_))) => {} // dropped or engine closed meanwhile
        // A write cancelled by drop_table.
        Ok(Err(_)) if table.is_dropped() => tracing::debug!(table = %table.name, "flush cancelled: the table was dropped"),
        Ok(Err(e)) => {
            tracing::error!(table = %table.name, error = %e, "background flush failed; rows stay in memory and are retried");
        }
        Err(_) => tracing::error!(table = %table.name, "background flush panicked; rows stay in memory"),
    }
}

/// Runs `task` as a blocking task on the writer's runtime (`handle` from [`Writer::handle`]).
/// A runtime already shut down drops the task unrun.
pub(crate) fn spawn_blocking_on(handle: &tokio::runtime::Handle, task: impl FnOnce() + Send + 'static) {
    drop(handle.spawn_blocking(task));
}

/// Puts the calling thread under `priority` (see [`BackgroundPriority`]): `SCHED_BATCH`, then
/// nice max(`nice`, the thread's nice value). Linux keeps both per thread (`sched(7)`,
/// `setpriority(2)` NOTES), and threads the caller starts inherit them. Best effort: a refusal
/// leaves the thread as it was.
#[cfg(target_os = "linux")]
pub(crate) fn set_background_priority(priority: BackgroundPriority) {
    let BackgroundPriority::Batch(nice) = priority else { return };
    // SAFETY: `sched_getscheduler(0)` reads the calling thread's policy; no pointers.
    let policy = unsafe { libc::sched_getscheduler(0) };
    if policy == libc::SCHED_IDLE || policy < 0 {
        return;
    }
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid `sched_param` that outlives the call; pid 0 = the calling
    // thread. Leaving a real-time policy, or going from SCHED_OTHER to SCHED_BATCH, needs no
    // privilege (`sched(7)`).
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &raw const param) } != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "background flush: SCHED_BATCH refused");
        return;
    }
    // `getpriority` may return -1 as a value: errno tells an error apart (`getpriority(2)`).
    // SAFETY: `__errno_location` returns the calling thread's errno slot, valid for the
    // thread's life; `getpriority` takes no pointers.
    let current = unsafe {
        *libc::__errno_location() = 0;
        let v = libc::getpriority(libc::PRIO_PROCESS, 0);
        if v == -1 && *libc::__errno_location() != 0 {
            return;
        }
        v
    };
    let target = i32::from(nice).max(current);
    // SAFETY: no pointers; who 0 = the calling thread (per-thread nice on Linux).
    if target != current && unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, target) } != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), nice = target, "background flush: nice refused");
    }
}

/// Elsewhere [`BackgroundPriority`] is ignored.
#[cfg(not(target_os = "linux"))]
pub(crate) fn set_background_priority(_priority: BackgroundPriority) {}

#[cfg(all(test, target_os = "linux", not(miri)))]
mod tests {
    use super::*;

    /// The calling thread's (policy, nice value).
    fn scheduling() -> (i32, i32) {
        // SAFETY: neither call takes pointers; 0 = the calling thread.
        unsafe { (libc::sched_getscheduler(0), libc::getpriority(libc::PRIO_PROCESS, 0)) }
    }

    /// `Batch(n)` puts a thread under `SCHED_BATCH` at nice max(n, its nice value) and never
    /// raises it; `Inherit` changes nothing; threads it starts inherit the setting.
    #[test]
    fn batch_lowers_the_calling_thread_only() {
        let (policy0, nice0) = std::thread::spawn(scheduling).join().unwrap();
        let got = std::thread::spawn(|| {
            set_background_priority(BackgroundPriority::Inherit);
            let inherit = scheduling();
            set_background_priority(BackgroundPriority::Batch(7));
            let batch = scheduling();
            // Asking for a lower nice value later does not raise the thread again.
            set_background_priority(BackgroundPriority::Batch(2));
            let again = scheduling();
            let child = std::thread::spawn(scheduling).join().unwrap();
            (inherit, batch, again, child)
        })
        .join()
        .unwrap();
        assert_eq!(got.0, (policy0, nice0), "Inherit leaves the thread as it was");
        assert_eq!(got.1, (libc::SCHED_BATCH, nice0.max(7)));
        assert_eq!(got.2, (libc::SCHED_BATCH, nice0.max(7)));
        assert_eq!(got.3, (libc::SCHED_BATCH, nice0.max(7)), "a thread it starts inherits the setting");
        assert_eq!(scheduling(), (policy0, nice0), "other threads are untouched");
    }
}
