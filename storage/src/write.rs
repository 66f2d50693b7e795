use crate::error::{StorageError, io};
use crate::vfs::Vfs;
use arrow_array::{BooleanArray, RecordBatch};
use arrow_select::filter::filter_record_batch;
use gritdb_memctl::{Category, MemoryController, Reservation, TableAccount};
use parquet::arrow::ArrowWriter;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use roaring::RoaringBitmap;
use std::fs;
use std::path::Path;
use std::sync::Arc;

/// How data files are written.
#[derive(Debug, Clone)]
pub struct WriteOptions {
    /// Rows handed to the Parquet writer at a time.
    pub write_batch_rows: usize,
    /// A row group is closed once the writer's buffered bytes (`ArrowWriter::memory_size`:
    /// encoded pages, encoders, dictionaries) pass this, so writer memory stays bounded for
    /// wide tables. Default 32 MiB.
    pub row_group_bytes: usize,
    /// Upper bound on rows per row group. Default 1,048,576 (Parquet's default).
    pub row_group_rows: usize,
}

impl Default for WriteOptions {
    fn default() -> Self {
        Self { write_batch_rows: 8192, row_group_bytes: 32 << 20, row_group_rows: 1 << 20 }
    }
}

/// Writes `batches` (in order, one schema) as the Parquet file `dir/name`: written to `name.tmp`, fsynced, renamed,
/// directory fsynced, so the file is either absent or complete. The writer's buffers are
/// reserved under `write_buffers` as they grow (`ArrowWriter::memory_size`).
/// Returns the file size in bytes.
///
/// # Errors
/// [`StorageError::Io`], [`StorageError::Parquet`], [`StorageError::Memory`]; the tmp file is
/// removed on error.
pub fn write_data_file(
    vfs: &dyn Vfs,
    dir: &Path,
    name: &str,
    batches: &[RecordBatch],
    opts: &WriteOptions,
    ctl: &Arc<MemoryController>,
    table: Option<&TableAccount>,
) -> Result<u64, StorageError> {
    let schema = batches.first().map(RecordBatch::schema).ok_or_else(|| StorageError::CorruptFile {
        path: dir.join(name),
        detail: "no batch to write".into(),
    })?;
    write_data_file_from(vfs, dir, name, &schema, batches.iter().cloned().map(Ok), opts, ctl, table)
}

/// [`write_data_file`] from a stream of batches (for example the live rows of a file being
/// compacted), so only one batch and the writer's buffers are in memory at a time.
///
/// # Errors
/// As [`write_data_file`], plus errors the stream yields.
#[allow(clippy::too_many_arguments)]
pub fn write_data_file_from(
    vfs: &dyn Vfs,
    dir: &Path,
    name: &str,
    schema: &arrow_schema::SchemaRef,
    batches: impl Iterator<Item = Result<RecordBatch, StorageError>>,
    opts: &WriteOptions,
    ctl: &Arc<MemoryController>,
    table: Option<&TableAccount>,
) -> Result<u64, StorageError> {
    let tmp = dir.join(format!("{name}.tmp"));
    let dst = dir.join(name);
    let res = (|| {
        let seen = Arc::new(std::sync::Mutex::new(None));
        let file = Recording { inner: vfs.create(&tmp).map_err(io(&tmp))?, seen: Arc::clone(&seen) };
        let props = WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .set_max_row_group_row_count(Some(opts.row_group_rows.max(1)))
            .build();
        let pq = |e: parquet::errors::ParquetError| parquet_io(e, &tmp, &seen);
        let mut writer = ArrowWriter::try_new(file, Arc::clone(schema), Some(props)).map_err(pq)?;
        let mut buffers = Reservation::new(ctl, Category::WriteBuffers, table);
        let step = opts.write_batch_rows.max(1);
        for batch in batches {
            let batch = batch?;
            let mut at = 0;
            while at < batch.num_rows() {
                let len = step.min(batch.num_rows() - at);
                writer.write(&batch.slice(at, len)).map_err(pq)?;
                at += len;
                buffers.try_resize(writer.memory_size())?;
                // Cut by the writer's whole buffered size (encoders and dictionaries included),
                // so its memory is bounded by about `row_group_bytes` + one step.
                if writer.memory_size() >= opts.row_group_bytes {
                    writer.flush().map_err(pq)?;
                    buffers.try_resize(writer.memory_size())?;
                }
            }
        }
        let mut file = writer.into_inner().map_err(pq)?.inner;
        drop(buffers);
        file.sync_all().map_err(io(&tmp))?;
        let size = file.len().map_err(io(&tmp))?;
        drop(file);
        vfs.rename(&tmp, &dst).map_err(io(&dst))?;
        vfs.sync_dir(dir).map_err(io(dir))?;
        Ok(size)
    })();
    if res.is_err() {
        let _ = vfs.remove_file(&tmp);
    }
    res
}

/// Reads a data file, keeping only columns `projection` (indices into the table schema;
/// `None` = all) and rows not in `deleted`, in batches of up to `batch_rows`.
///
/// # Errors
/// [`StorageError::Io`] when the file cannot be opened, [`StorageError::Parquet`] when it is
/// not valid Parquet; the iterator yields later decoding errors.
pub fn read_file(
    path: &Path,
    projection: Option<&[usize]>,
    deleted: Arc<RoaringBitmap>,
    batch_rows: usize,
) -> Result<impl Iterator<Item = Result<RecordBatch, StorageError>> + Send + use<>, StorageError> {
    let file = fs::File::open(path).map_err(io(path))?;
    let mut builder = ParquetRecordBatchReaderBuilder::try_new(file)?.with_batch_size(batch_rows.max(1));
    if let Some(p) = projection {
        let mask = ProjectionMask::roots(builder.parquet_schema(), p.iter().copied());
        builder = builder.with_projection(mask);
    }
    let reader = builder.build()?;
    let mut row = 0u32;
    Ok(reader.filter_map(move |b| {
        let b = match b {
            Ok(b) => b,
            Err(e) => return Some(Err(StorageError::Arrow(e))),
        };
        let start = row;
        row += b.num_rows() as u32;
        if deleted.range_cardinality(start..row) == 0 {
            return Some(Ok(b));
        }
        let keep: BooleanArray = (start..row).map(|r| Some(!deleted.contains(r))).collect();
        match filter_record_batch(&b, &keep) {
            Ok(f) if f.num_rows() == 0 => None,
            Ok(f) => Some(Ok(f)),
            Err(e) => Some(Err(StorageError::Arrow(e))),
        }
    }))
}

/// The Parquet writer's sink: remembers the last I/O error, because Parquet reports some of
/// them only as text ("fail to get inner writer: ...").
struct Recording {
    inner: Box<dyn crate::vfs::VfsFile>,
    seen: Arc<Seen>,
}

impl Recording {
    fn note(&self, e: &std::io::Error) {
        if let Ok(mut s) = self.seen.lock() {
            *s = Some((e.kind(), e.raw_os_error(), e.to_string()));
        }
    }
}

impl std::io::Write for Recording {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.inner.write(buf).inspect_err(|e| self.note(e))
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush().inspect_err(|e| self.note(e))
    }
}

type Seen = std::sync::Mutex<Option<(std::io::ErrorKind, Option<i32>, String)>>;

/// Turns a Parquet error caused by the sink back into [`StorageError::Io`] (with the path),
/// so ENOSPC and EIO read as what they are.
fn parquet_io(e: parquet::errors::ParquetError, path: &Path, seen: &Seen) -> StorageError {
    if let parquet::errors::ParquetError::External(inner) = e {
        return match inner.downcast::<std::io::Error>() {
            Ok(io_err) => StorageError::Io { path: path.to_path_buf(), source: *io_err },
            Err(other) => StorageError::Parquet(parquet::errors::ParquetError::External(other)),
        };
    }
    if let Ok(mut s) = seen.lock()
        && let Some((kind, raw, msg)) = s.take()
    {
        let source = match raw {
            Some(code) => std::io::Error::from_raw_os_error(code),
            None => std::io::Error::new(kind, msg),
        };
        return StorageError::Io { path: path.to_path_buf(), source };
    }
    StorageError::Parquet(e)
}
