//! Decoding a data file's columns a group at a time ([`crate::ReadSpec::decode_budget`]).
//!
//! A Parquet reader holds state for every column it reads (parquet 59's array and record
//! readers, decoders, a decoded page and the dictionary: about 4 KiB a column and more,
//! `write::COLUMN_READER_BYTES`) for as long as it is open. For a wide file under a small memory
//! limit that is more than the limit: 500 columns of mixed types, written in files of 10 rows
//! at 2 MiB, needed 3.4 MiB of reader to be read back. Here each batch's rows are decoded by one
//! reader per group of columns, built for that batch and dropped before the next group's, so
//! only one group's state is held at a time; the groups' columns are then put side by side, in
//! the order one reader of them all would give.

use crate::error::StorageError;
use crate::write::Cursor;
use arrow_array::{RecordBatch, RecordBatchReader};
use arrow_schema::{Field, Schema};
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ParquetRecordBatchReaderBuilder, RowSelection};
use std::fs;
use std::sync::Arc;

/// The batches of one file's selected rows, decoded by column groups.
pub(crate) struct GroupedReader {
    /// The data file (named in errors).
    pub(crate) path: std::path::PathBuf,
    /// The data file, cloned (a new descriptor) for each group's reader.
    pub(crate) file: fs::File,
    /// The file's metadata, shared by every group's reader.
    pub(crate) metadata: ArrowReaderMetadata,
    /// Root columns of each group, ascending; together the columns read, in order.
    pub(crate) groups: Vec<Vec<usize>>,
    /// The file rows selected and not yet decoded.
    pub(crate) pending: Cursor,
    /// The file row each row group starts at.
    pub(crate) starts: Vec<u64>,
    /// The row groups read, ascending.
    pub(crate) row_groups: Vec<usize>,
    /// Rows decoded per batch.
    pub(crate) batch_rows: usize,
}

impl GroupedReader {
    /// The next `batch_rows` selected rows (fewer at the end), every group's columns.
    /// `Ok(None)` once every selected row was returned.
    ///
    /// # Errors
    /// [`StorageError::Io`] when the file cannot be opened again, [`StorageError::Parquet`]
    /// or [`StorageError::Arrow`] from the decoder, [`StorageError::CorruptFile`] when a group
    /// decodes a row count other than the one selected.
    pub(crate) fn next_batch(&mut self) -> Result<Option<RecordBatch>, StorageError> {
        let mut runs = Vec::new();
        self.pending.take(self.batch_rows as u64, &mut runs);
        let rows: u64 = runs.iter().map(|&(_, n)| n).sum();
        if rows == 0 {
            return Ok(None);
        }
        // The row groups the runs fall in, and the runs as positions in those row groups'
        // rows laid end to end (what a reader's row selection is relative to).
        let md = Arc::clone(self.metadata.metadata());
        let mut touched = Vec::new();
        let mut selection = Vec::new();
        let mut base = 0u64;
        for &g in &self.row_groups {
            let (lo, n) = (self.starts[g], u64::try_from(md.row_group(g).num_rows()).unwrap_or(0));
            let before = selection.len();
            for &(start, len) in &runs {
                let (s, e) = (start.max(lo), (start + len).min(lo + n));
                if s < e {
                    selection.push(usize::try_from(s - lo + base).unwrap_or(usize::MAX)..usize::try_from(e - lo + base).unwrap_or(usize::MAX));
                }
            }
            if selection.len() > before {
                touched.push(g);
                base += n;
            }
        }
        let descr = md.file_metadata().schema_descr();
        let mut fields: Vec<Arc<Field>> = Vec::new();
        let mut columns = Vec::new();
        for group in &self.groups {
            let file = self.file.try_clone().map_err(|source| StorageError::Io { path: self.path.clone(), source })?;
            let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(file, self.metadata.clone())
                .with_batch_size(usize::try_from(rows).unwrap_or(usize::MAX))
                .with_projection(ProjectionMask::roots(descr, group.iter().copied()))
                .with_row_groups(touched.clone())
                .with_row_selection(RowSelection::from_consecutive_ranges(selection.iter().cloned(), usize::try_from(base).unwrap_or(usize::MAX)))
                .build()?;
            let schema = reader.schema();
            let parts = reader.collect::<Result<Vec<RecordBatch>, _>>()?;
            let part = match parts.len() {
                1 => parts.into_iter().next().unwrap_or_else(|| RecordBatch::new_empty(Arc::clone(&schema))),
                _ => arrow_select::concat::concat_batches(&schema, &parts)?,
            };
            if part.num_rows() as u64 != rows {
                return Err(StorageError::CorruptFile {
                    path: self.path.clone(),
                    detail: format!("columns {group:?} decoded {} rows where {rows} were selected", part.num_rows()),
                });
            }
            fields.extend(part.schema().fields().iter().cloned());
            columns.extend(part.columns().iter().cloned());
        }
        let options = arrow_array::RecordBatchOptions::new().with_row_count(Some(usize::try_from(rows).unwrap_or(usize::MAX)));
        Ok(Some(RecordBatch::try_new_with_options(Arc::new(Schema::new(fields)), columns, &options)?))
    }
}
