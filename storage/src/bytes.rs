//! How many bytes a caller's batch stands for.

use arrow_array::{Array, RecordBatch};

/// Bytes of `batch`'s own rows: per column `ArrayData::get_slice_memory_size`,
/// so a slice (`RecordBatch::slice`, or arrays with an offset) counts its rows' share of the
/// buffers, not the parent's whole buffers as `RecordBatch::get_array_memory_size` does (a
/// 1,000-row slice of a 1 M-row batch was budgeted as 139 MiB). View arrays count their data
/// buffers whole (a view may point anywhere in them). A column whose slice size Arrow cannot
/// compute counts its whole buffers.
pub fn batch_bytes(batch: &RecordBatch) -> usize {
    batch.columns().iter().map(|c| c.to_data().get_slice_memory_size().unwrap_or_else(|_| c.get_array_memory_size())).sum()
}
