use crate::category::{Category, Counters};
use crate::controller::MemoryController;
use crate::process::ProcessView;
use serde::Serialize;
use std::fmt;
use std::sync::atomic::Ordering;

/// One category's figures.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CategoryReport {
    /// Category name (`row_blocks`, ...).
    pub category: Category,
    /// Current bytes.
    pub bytes: usize,
    /// High-water mark in bytes.
    pub peak_bytes: usize,
    /// Number of reservations/allocations.
    pub allocs: u64,
    /// Number of releases.
    pub frees: u64,
    /// Number of refused requests (limit reached or injected failure).
    pub failures: u64,
}

impl CategoryReport {
    fn from_counters(category: Category, c: &Counters) -> Self {
        Self {
            category,
            bytes: c.current.load(Ordering::Acquire),
            peak_bytes: c.peak.load(Ordering::Acquire),
            allocs: c.allocs.load(Ordering::Relaxed),
            frees: c.frees.load(Ordering::Relaxed),
            failures: c.failures.load(Ordering::Relaxed),
        }
    }
}

/// One table's figures.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TableReport {
    /// Table name.
    pub table: String,
    /// Current bytes over all categories.
    pub bytes: usize,
    /// The table was dropped but still holds bytes (batches a scan handed out and the caller
    /// keeps, or a flush stuck in a system call); they are released when those go.
    pub dropped: bool,
    /// Per-category figures (categories with any activity).
    pub categories: Vec<CategoryReport>,
}

/// Engine memory by category and table, beside the process view. Serializable (serde) and
/// printable as a table (`Display`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemoryReport {
    /// The limit in bytes.
    pub limit: usize,
    /// Accounted bytes.
    pub used: usize,
    /// High-water mark of `used`.
    pub peak: usize,
    /// Chunk size in bytes.
    pub chunk_size: usize,
    /// Per category, in [`Category::ALL`] order.
    pub categories: Vec<CategoryReport>,
    /// Per table, in creation order.
    pub tables: Vec<TableReport>,
    /// RSS, `VmHWM` and allocator figures.
    pub process: ProcessView,
    /// Allocator `allocated` minus the engine's accounted bytes (saturating at 0): heap bytes
    /// outside the engine's categories (the production report's "outside-engine allocation").
    pub outside_engine: usize,
}

impl MemoryController {
    /// A snapshot of every figure. Reads `/proc/self/status` and the allocator.
    ///
    /// The counters are separate atomics that other threads move while they are read, so the
    /// categories, tables and `used` are read back to back (before the slower process view)
    /// and read again, up to [`SNAPSHOT_TRIES`] times, until `used` did not move during the
    /// read and equals the categories' sum: in a moment without concurrent reservations the
    /// categories add up to `used` exactly. Before, `used` was read after the process view,
    /// and a release in between (a background flush ending) made `used` minus the tables'
    /// bytes wrong by the bytes released. A table's figure may still lag `used` by a
    /// reservation that is in flight while it is read; under constant concurrent changes the
    /// last read is returned.
    pub fn report(&self) -> MemoryReport {
        self.observe_pool_peaks();
        let mut tries = 0;
        let (used, categories, tables) = loop {
            tries += 1;
            let used_before = self.used();
            let categories = self.category_reports();
            let tables = self.table_reports();
            let used = self.used();
            let sum = categories.iter().fold(0usize, |a, c| a.wrapping_add(c.bytes));
            if (used == used_before && sum == used) || tries >= SNAPSHOT_TRIES {
                break (used, categories, tables);
            }
            std::thread::yield_now();
        };
        let process = ProcessView::read();
        MemoryReport {
            limit: self.limit(),
            used,
            peak: self.peak(),
            chunk_size: self.chunk_size(),
            categories,
            tables,
            process,
            outside_engine: process.allocator.allocated.saturating_sub(used),
        }
    }
}

/// Reads of the counters [`MemoryController::report`] makes at most to find `used` equal to
/// the categories' sum.
pub const SNAPSHOT_TRIES: usize = 8;

impl MemoryController {
    /// Every category's figures, the pool categories exact (thread caches' unfolded moves
    /// added: see [`MemoryController::pool_figures`]).
    fn category_reports(&self) -> Vec<CategoryReport> {
        let pool = self.pool_figures();
        Category::ALL
            .iter()
            .map(|c| {
                let mut r = CategoryReport::from_counters(*c, &self.counters[c.index()]);
                match c {
                    Category::RowBlocks => {
                        r.bytes = pool.row_bytes;
                        r.allocs += pool.takes;
                        r.frees += pool.puts;
                    }
                    Category::FreeChunks => {
                        r.bytes = pool.free_bytes;
                        r.allocs += pool.puts;
                        r.frees += pool.takes;
                    }
                    _ => {}
                }
                r.peak_bytes = r.peak_bytes.max(r.bytes);
                r
            })
            .collect()
    }

    /// Every live table's figures, in creation order.
    fn table_reports(&self) -> Vec<TableReport> {
        self.live_tables()
            .iter()
            .map(|t| TableReport {
                table: t.name().to_owned(),
                bytes: t.total_bytes(),
                dropped: t.is_dropped(),
                categories: Category::ALL.iter().map(|c| CategoryReport::from_counters(*c, &t.0.counters[c.index()])).filter(|r| r.allocs > 0).collect(),
            })
            .collect()
    }
}

impl MemoryReport {
    /// Current bytes of one category.
    pub fn category(&self, category: Category) -> usize {
        self.categories.iter().find(|c| c.category == category).map_or(0, |c| c.bytes)
    }
}

/// Formats bytes in binary units: `512 B`, `1.5 KiB`, `256.0 MiB`, `2.00 GiB`.
pub fn format_bytes(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    let prec = if unit >= 3 { 2 } else { 1 };
    format!("{v:.prec$} {}", UNITS[unit])
}

impl fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "limit {}  used {}  peak {}  ({} tables)", format_bytes(self.limit), format_bytes(self.used), format_bytes(self.peak), self.tables.len())?;
        writeln!(f, "{:<14} {:>12} {:>12} {:>10} {:>10} {:>8}", "category", "bytes", "peak", "allocs", "frees", "failed")?;
        for c in &self.categories {
            writeln!(
                f,
                "{:<14} {:>12} {:>12} {:>10} {:>10} {:>8}",
                c.category.name(),
                format_bytes(c.bytes),
                format_bytes(c.peak_bytes),
                c.allocs,
                c.frees,
                c.failures
            )?;
        }
        let mut tables: Vec<&TableReport> = self.tables.iter().collect();
        tables.sort_by_key(|t| std::cmp::Reverse(t.bytes));
        for t in tables.iter().take(10) {
            let note = if t.dropped { "  (dropped; held by the caller's batches)" } else { "" };
            writeln!(f, "table {:<24} {:>12}{note}", t.table, format_bytes(t.bytes))?;
        }
        if tables.len() > 10 {
            writeln!(f, "... {} more tables", tables.len() - 10)?;
        }
        let a = &self.process.allocator;
        writeln!(
            f,
            "process: RSS {}  VmHWM {}  allocator {:?}: allocated {} active {} resident {} retained {}  outside-engine {}",
            format_bytes(self.process.rss),
            format_bytes(self.process.vmhwm),
            a.kind,
            format_bytes(a.allocated),
            format_bytes(a.active),
            format_bytes(a.resident),
            format_bytes(a.retained),
            format_bytes(self.outside_engine)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::format_bytes;

    #[test]
    fn formats_units() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(1536), "1.5 KiB");
        assert_eq!(format_bytes(256 << 20), "256.0 MiB");
        assert_eq!(format_bytes(3 << 30), "3.00 GiB");
    }
}
