//! memctl integration tests: one binary (see STYLE.md, item 15), one module per area.
//!
//! The binary's global allocator counts bytes per thread ([`alloc_count`]), so tests can
//! check that what the pool frees really goes back to the allocator.

mod accounting;
mod alloc_count;
mod arena;
mod errors;
#[cfg(feature = "fault-injection")]
mod faults;
mod model;
mod pool;

use gritdb_memctl::{Category, ControllerConfig, MemoryController};
use std::sync::Arc;

#[global_allocator]
static ALLOC: alloc_count::CountingAlloc = alloc_count::CountingAlloc;

/// Chunk size used by most tests (small, so limits stay small).
pub const CHUNK: usize = 64 << 10;

/// A controller with `limit` bytes and 64 KiB chunks.
pub fn ctl(limit: usize) -> Arc<MemoryController> {
    MemoryController::new(ControllerConfig { memory_limit: Some(limit), chunk_size: CHUNK, ..ControllerConfig::default() }).expect("valid config")
}

/// The sum of every category equals `used`, exactly (call with no concurrent activity).
pub fn assert_categories_sum_to_used(ctl: &MemoryController) {
    let sum: usize = Category::ALL.iter().map(|c| ctl.category_bytes(*c)).sum();
    assert_eq!(sum, ctl.used(), "categories {:?}", Category::ALL.map(|c| ctl.category_bytes(c)));
}

/// Every category is zero and so is `used` (after everything was dropped and trimmed).
pub fn assert_all_zero(ctl: &MemoryController) {
    for c in Category::ALL {
        assert_eq!(ctl.category_bytes(c), 0, "category {c}");
    }
    assert_eq!(ctl.used(), 0);
}
