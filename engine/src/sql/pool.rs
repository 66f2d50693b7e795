//! `DataFusion`'s memory pool over gritdb's memory controller: every byte a query operator
//! reserves is counted in the `query` category under the engine's one limit.

use crate::engine::Shared;
use datafusion::common::DataFusionError;
use datafusion::execution::memory_pool::{MemoryLimit, MemoryPool, MemoryReservation, human_readable_size};
use gritdb_memctl::{Category, MemoryError};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// The last refusal of the pool, kept so `Engine::sql` can turn `DataFusion`'s string-only
/// `ResourcesExhausted` back into a typed [`crate::Error::MemoryLimit`] with its figures.
#[derive(Debug, Default)]
pub(crate) struct LastRefusal(Mutex<Option<MemoryError>>);

impl LastRefusal {
    fn set(&self, e: MemoryError) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
    }

    /// The last refusal, if any (left in place: several errors of one query may ask).
    pub(crate) fn get(&self) -> Option<MemoryError> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

/// A [`MemoryPool`] whose reservations are memctl reservations in [`Category::Query`].
///
/// `try_grow` succeeds only while the engine's accounted bytes (cached free chunks not
/// counted) plus the request stay under the *write soft limit* (`limit − flush_headroom`,
/// docs/memory.md): a query never takes the headroom the background writer needs to flush,
/// and the hard limit is enforced by memctl's compare-and-swap as for every other category.
/// A refusal is `DataFusion`'s `ResourcesExhausted` (so sorts and aggregates spill), with the
/// figures in its text. `grow` (infallible in `DataFusion`, used by a few join operators for
/// memory they already hold) is counted even past the limit, so the accounting stays true.
pub(crate) struct GritMemoryPool {
    shared: Arc<Shared>,
    reserved: AtomicUsize,
    last: Arc<LastRefusal>,
}

impl GritMemoryPool {
    pub(crate) fn new(shared: Arc<Shared>, last: Arc<LastRefusal>) -> Self {
        Self { shared, reserved: AtomicUsize::new(0), last }
    }

    /// What a query may hold in total now: the write soft limit.
    fn query_limit(&self) -> usize {
        self.shared.write_soft_limit()
    }
}

impl std::fmt::Debug for GritMemoryPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GritMemoryPool").field("reserved", &self.reserved.load(Ordering::Acquire)).finish_non_exhaustive()
    }
}

impl std::fmt::Display for GritMemoryPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "gritdb(query {} reserved; engine {} of {} in use, queries may use up to {})",
            human_readable_size(self.reserved.load(Ordering::Acquire)),
            human_readable_size(self.shared.ctl.used()),
            human_readable_size(self.shared.ctl.limit()),
            human_readable_size(self.query_limit()),
        )
    }
}

impl MemoryPool for GritMemoryPool {
    fn name(&self) -> &'static str {
        "gritdb"
    }

    fn grow(&self, reservation: &MemoryReservation, additional: usize) {
        if additional == 0 {
            return;
        }
        if !self.shared.ctl.force_reserve(Category::Query, None, additional) {
            tracing::warn!(
                consumer = reservation.consumer().name(),
                additional,
                used = self.shared.ctl.used(),
                limit = self.shared.ctl.limit(),
                "a query operator grew past the memory limit (DataFusion's infallible grow); counted"
            );
        }
        self.reserved.fetch_add(additional, Ordering::AcqRel);
    }

    fn shrink(&self, _reservation: &MemoryReservation, shrink: usize) {
        if shrink == 0 {
            return;
        }
        self.shared.ctl.release(Category::Query, None, shrink);
        self.reserved.fetch_sub(shrink, Ordering::AcqRel);
    }

    fn try_grow(&self, reservation: &MemoryReservation, additional: usize) -> datafusion::error::Result<()> {
        if additional == 0 {
            return Ok(());
        }
        let ctl = &self.shared.ctl;
        let soft = self.query_limit();
        let refused = if self.shared.pressure_bytes().saturating_add(additional) > soft {
            // Above the soft limit: the flush headroom is the writer's. The error names the
            // soft limit, which is what a query may use.
            ctl.count_failure(Category::Query);
            match ctl.limit_error(Category::Query, additional) {
                MemoryError::Limit { requested, used, category, top, .. } => Some(MemoryError::Limit { requested, used, limit: soft, category, top }),
                other => Some(other),
            }
        } else {
            ctl.try_reserve(Category::Query, None, additional).err()
        };
        if let Some(e) = refused {
            let msg = format!(
                "{e} (query operator {} holds {}; set a higher memory limit, or let the operator spill)",
                reservation.consumer().name(),
                human_readable_size(reservation.size()),
            );
            self.last.set(e);
            return Err(DataFusionError::ResourcesExhausted(msg));
        }
        self.reserved.fetch_add(additional, Ordering::AcqRel);
        Ok(())
    }

    fn reserved(&self) -> usize {
        self.reserved.load(Ordering::Acquire)
    }

    fn memory_limit(&self) -> MemoryLimit {
        MemoryLimit::Finite(self.query_limit())
    }
}
