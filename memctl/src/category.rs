use serde::Serialize;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// What a counted byte is for. See the crate docs for what each category includes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Category {
    /// Chunks and oversize allocations holding encoded delta rows.
    RowBlocks,
    /// Blocks holding Arrow arrays built from sealed deltas for a flush.
    BatchBlocks,
    /// Primary-key index tables and key bytes.
    KeyIndex,
    /// Parquet writer buffers (encoded pages not yet written).
    WriteBuffers,
    /// Decoded batches held by scans and delta snapshots.
    ScanBuffers,
    /// Schemas, manifests, deletion vectors, arena block tables.
    Metadata,
    /// Memory SQL query operators reserve (hash tables, sort and aggregate buffers) through
    /// the engine's `DataFusion` memory pool (the `sql` feature of `gritdb`).
    Query,
    /// Empty chunks cached by the pool for reuse.
    FreeChunks,
}

impl Category {
    /// Number of categories.
    pub const COUNT: usize = 8;
    /// All categories in report order.
    pub const ALL: [Category; Category::COUNT] = [
        Category::RowBlocks,
        Category::BatchBlocks,
        Category::KeyIndex,
        Category::WriteBuffers,
        Category::ScanBuffers,
        Category::Metadata,
        Category::Query,
        Category::FreeChunks,
    ];

    /// The name shown in reports (`row_blocks`, `batch_blocks`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Category::RowBlocks => "row_blocks",
            Category::BatchBlocks => "batch_blocks",
            Category::KeyIndex => "key_index",
            Category::WriteBuffers => "write_buffers",
            Category::ScanBuffers => "scan_buffers",
            Category::Metadata => "metadata",
            Category::Query => "query",
            Category::FreeChunks => "free_chunks",
        }
    }

    /// The two categories the chunk pool moves chunks between. Their shared counters may lag
    /// behind thread caches' fast paths; exact figures come from `pool_figures`.
    pub(crate) const fn is_pool(self) -> bool {
        matches!(self, Category::RowBlocks | Category::FreeChunks)
    }

    pub(crate) const fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for Category {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Current bytes, high-water mark and event counts of one category (engine-wide or per table).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub current: AtomicUsize,
    pub peak: AtomicUsize,
    pub allocs: AtomicU64,
    pub frees: AtomicU64,
    pub failures: AtomicU64,
}

impl Counters {
    pub(crate) fn add(&self, bytes: usize) {
        let now = self.current.fetch_add(bytes, Ordering::AcqRel) + bytes;
        self.peak.fetch_max(now, Ordering::AcqRel);
        self.allocs.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn sub(&self, bytes: usize) {
        let prev = self.current.fetch_sub(bytes, Ordering::AcqRel);
        debug_assert!(prev >= bytes, "category underflow: {prev} - {bytes}");
        self.frees.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds without touching the peak, wrapping (pool categories: see `is_pool`).
    pub(crate) fn add_raw(&self, bytes: usize) {
        self.current.fetch_add(bytes, Ordering::AcqRel);
        self.allocs.fetch_add(1, Ordering::Relaxed);
    }

    /// Subtracts, wrapping (pool categories).
    pub(crate) fn sub_raw(&self, bytes: usize) {
        self.sub_raw_n(bytes, 1);
    }

    /// Subtracts `bytes` released in `events` releases, wrapping (pool categories).
    pub(crate) fn sub_raw_n(&self, bytes: usize, events: u64) {
        self.current.fetch_sub(bytes, Ordering::AcqRel);
        self.frees.fetch_add(events, Ordering::Relaxed);
    }

    pub(crate) fn get(&self) -> usize {
        self.current.load(Ordering::Acquire)
    }

    pub(crate) fn reset_peak(&self) {
        self.peak.store(self.get(), Ordering::Release);
    }
}

pub(crate) type CounterSet = [Counters; Category::COUNT];
