use crate::error::{StorageError, io};
use crate::filter::{BoundFilter, FilePlan, ScanCounters, keep_rows};
use crate::grouped_read::GroupedReader;
use crate::vfs::Vfs;
use arrow_array::RecordBatch;
use arrow_buffer::{BooleanBuffer, BooleanBufferBuilder};
use gritdb_memctl::{Category, MemoryController, Reservation, TableAccount};
use parquet::arrow::ArrowWriter;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReader, ParquetRecordBatchReaderBuilder, RowSelection};
use parquet::arrow::arrow_writer::{ArrowColumnChunk, ArrowColumnWriter, ArrowRowGroupWriterFactory, compute_leaves};
use parquet::basic::Compression;
use parquet::errors::ParquetError;
use parquet::file::metadata::{PageIndexPolicy, ParquetMetaDataReader};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use roaring::RoaringBitmap;
use std::fs;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

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
    /// Cancels writes made with these options (and their clones): set when the table is
    /// dropped. Every default-built `WriteOptions` has its own token.
    pub cancel: CancelToken,
    /// Threads that encode a data file's columns, the calling thread included (scoped
    /// threads, started per encoded batch and joined before it returns). 1 = the calling
    /// thread alone. Default [`default_encode_threads`]: min(2, the
    /// machine's available parallelism). The file is the same whatever the count.
    pub encode_threads: usize,
    /// What a data-file write does when the limit leaves no room for its writer's buffers.
    /// `true` (the default; flushes, which must finish to give their delta's memory back):
    /// the smallest step is budgeted at its Arrow bytes alone when its estimate is refused,
    /// and what a step adds beyond its budget, and the metadata of written row groups, are
    /// counted past the limit ([`WrittenMetadata::CountPastLimit`]). `false` (compactions,
    /// which free nothing that is needed now and run again after a later flush): every step
    /// is budgeted at [`MAX_GROWTH_PCT`] of its Arrow bytes, the metadata before each row
    /// group is closed ([`WrittenMetadata::Budget`]), and a refusal, or a step that added more
    /// than its budget and does not fit, ends the write with [`StorageError::Memory`].
    pub count_past_limit: bool,
    /// With [`Self::count_past_limit`], asked before the smallest step is budgeted bare: it
    /// returns `true` after waiting for memory that another holder is about to give back
    /// (the step is then budgeted at its estimate again), `false` when nothing would (the
    /// step goes bare). `None` (the default) never waits. See [`MemoryWait`].
    pub memory_wait: Option<MemoryWait>,
    /// The most a step of an earlier file written with these options (or their clones) added
    /// to its writer's buffers, in percent of its Arrow bytes: a file's first step is
    /// budgeted at it instead of [`FIRST_GROWTH_PCT`]. Every default-built `WriteOptions` has
    /// its own; a table's flushes share theirs. See [`LearnedGrowth`].
    pub learned_growth: LearnedGrowth,
}

/// The most a step of the data files written with one [`WriteOptions`] (and its clones) added
/// to its writer's buffers, in percent of the step's Arrow bytes (0: no step yet). A file
/// starts its budget from it: before, every file's first step was budgeted at
/// [`FIRST_GROWTH_PCT`] (200%), and rows of 2-6 KB strings added 278-286% there, which a
/// flush under a 2 MiB limit counted past the limit (a temporary print in
/// `peak_limit::concurrent_writers_of_big_rows_stay_under_small_limits`, 2026-12-06).
#[derive(Debug, Clone, Default)]
pub struct LearnedGrowth(Arc<AtomicUsize>);

impl LearnedGrowth {
    /// The percentage learned so far, `None` before any step.
    pub fn pct(&self) -> Option<usize> {
        Some(self.0.load(Ordering::Relaxed)).filter(|&p| p > 0)
    }

    fn learn(&self, pct: usize) {
        self.0.fetch_max(pct, Ordering::Relaxed);
    }
}

/// How a data-file write waits for memory instead of counting its buffers past the limit
/// ([`WriteOptions::memory_wait`]): a function of the time already waited for the step,
/// returning `true` when it waited and the budget is worth asking again, `false` when nothing
/// else can free memory soon.
#[derive(Clone)]
pub struct MemoryWait(Arc<dyn Fn(std::time::Duration) -> bool + Send + Sync>);

impl MemoryWait {
    /// Wraps `wait` (see [`MemoryWait`]).
    pub fn new(wait: impl Fn(std::time::Duration) -> bool + Send + Sync + 'static) -> Self {
        Self(Arc::new(wait))
    }

    /// Calls the wait function with the time waited so far for this step.
    pub fn wait(&self, waited: std::time::Duration) -> bool {
        (self.0)(waited)
    }
}

impl std::fmt::Debug for MemoryWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MemoryWait(..)")
    }
}

impl Default for WriteOptions {
    fn default() -> Self {
        Self {
            write_batch_rows: 8192,
            row_group_bytes: 32 << 20,
            row_group_rows: 1 << 20,
            cancel: CancelToken::default(),
            encode_threads: default_encode_threads(),
            count_past_limit: true,
            memory_wait: None,
            learned_growth: LearnedGrowth::default(),
        }
    }
}

impl WriteOptions {
    /// How a write with these options counts the metadata of its written row groups:
    /// [`WrittenMetadata::CountPastLimit`] when [`Self::count_past_limit`], else
    /// [`WrittenMetadata::Budget`].
    fn written_metadata(&self) -> WrittenMetadata {
        if self.count_past_limit { WrittenMetadata::CountPastLimit } else { WrittenMetadata::Budget }
    }
}

/// Dictionary page limit of a column chunk, in bytes: 256 KiB (Parquet's default is 1 MiB,
/// `parquet::file::properties::DEFAULT_DICTIONARY_PAGE_SIZE_LIMIT`). A column whose distinct
/// values pass it falls back to plain encoding for the rest of its column chunk, as with the
/// default, only sooner. Best effort, as in Parquet: the writer checks the dictionary after
/// each batch it encodes, so a page can pass the limit by that batch's new values (a flush
/// encodes at most 8,192 rows at a time; a trial export held a 302,760-byte page).
///
/// Why not the default: the Parquet writer hashes every value of a dictionary-encoded column
/// into its interner until the dictionary reaches the limit, and for columns of mostly
/// distinct values (prices, comments, foreign keys) that hashing was 64% of a flush's CPU
/// (`perf record` of `gritdb-soak bench`, the writer thread). On TPC-H lineitem at SF 0.1,
/// best of 7 writes: 302 ms at 1 MiB, 242 ms at 256 KiB (−20%), for a file 3.6% larger
/// (17.86 → 18.51 MB); reads took as long (`docs/performance.md`, sixteenth pass). Columns of
/// few distinct values (flags, dates, quantities) keep their dictionaries: 256 KiB holds
/// 32,768 eight-byte values. It also bounds the writer's dictionary buffers, which count
/// under `write_buffers`, to a quarter of the default per column.
pub const DICTIONARY_PAGE_BYTES: usize = 256 << 10;

/// Data page size of gritdb's data files, in bytes: 1 MiB, Parquet's default
/// (`parquet::file::properties::DEFAULT_PAGE_SIZE`), set explicitly because the stepped writer
/// bounds each column's Arrow bytes in a step by it ([`write_steps`]). Best effort in Parquet:
/// the writer checks a page's size after each mini-batch it encodes, so a page passes it by up
/// to a mini-batch's values; with a step's bytes of a column bounded by this size, a page
/// holds at most about this size plus the larger of this size and its widest value.
pub const DATA_PAGE_BYTES: usize = 1 << 20;

/// Page compression of gritdb's own data files: `LZ4_RAW` (Parquet format 2.9, 2021; read by
/// arrow-rs, pyarrow and `DuckDB`, as `tests/all/interop.rs` checks).
///
/// Why not Snappy, Parquet's usual default: decompression was 22% of a TPC-H Q1 scan's CPU
/// (`perf record` of `gritdb-soak bench`'s Q1 at SF 0.1, `snap::decompress`). The same
/// lineitem rows written both ways (`docs/performance.md`, twentieth pass): Q1's five columns
/// read in 7.5–7.9 ms against 9.3 ms (best of 30), every column in 31 ms against 38–40 ms
/// (median of 8), for a file 2.9% larger (17.24 MB against 16.76 MB) written as fast
/// (242–252 ms against 246–250 ms). As `ClickHouse`, whose default codec is LZ4 for its decode
/// speed. Exports keep [`EXPORT_COMPRESSION`]. Files written with Snappy before stay readable:
/// a reader takes each column chunk's codec from the file. A scan reserves each dictionary
/// page at its header's uncompressed size ([`DictionaryPages`]): estimated from the chunk's
/// compression ratio, LZ4's far higher ratio on long repetitive values refused scans of
/// skewed text at 8 and 16 MiB that fit.
pub const DATA_FILE_COMPRESSION: Compression = Compression::LZ4_RAW;

/// Page compression of exports (`Table::export_parquet`): Snappy, which every Parquet reader
/// in use reads, for files meant for other engines (`LZ4_RAW` needs a reader from 2021 or
/// later: those built on parquet-mr before 1.13, Spark before 3.4 among them, refuse it).
pub const EXPORT_COMPRESSION: Compression = Compression::SNAPPY;

/// The Parquet writer properties of gritdb's data files: [`DATA_FILE_COMPRESSION`] pages,
/// dictionaries up to [`DICTIONARY_PAGE_BYTES`], row groups of at most `row_group_rows`
/// rows (callers cut them by bytes as well), the rest Parquet's defaults. A builder, so a
/// caller can add what is its own (an export sets [`EXPORT_COMPRESSION`] and its
/// `created_by`).
pub fn data_file_properties(row_group_rows: usize) -> parquet::file::properties::WriterPropertiesBuilder {
    WriterProperties::builder()
        .set_compression(DATA_FILE_COMPRESSION)
        .set_dictionary_page_size_limit(DICTIONARY_PAGE_BYTES)
        .set_data_page_size_limit(DATA_PAGE_BYTES)
        .set_max_row_group_row_count(Some(row_group_rows.max(1)))
}

/// Bytes a Parquet writer allocates for each dictionary-encoded column chunk of physical type
/// `INT32`, `INT64`, `FLOAT` or `DOUBLE` when a row group opens, before any value: parquet 59's
/// `Interner::new` preallocates a hash table of `DEFAULT_DEDUP_CAPACITY` (4,096) keys.
/// `ArrowWriter::memory_size` reads exactly this for one such column after one null row
/// (`write::tests::an_open_row_groups_dictionary_tables_are_known_before_they_exist`); byte
/// array, fixed-length byte array and boolean columns allocate theirs as values come (0–265
/// bytes after one row). A table of 64 `Int64` columns holds 4.7 MB of them from its first
/// row, whatever the row group's size.
pub const DICTIONARY_TABLE_BYTES: usize = 74_000;

/// The dictionary tables a row group of `descr` opens with `props`: [`DICTIONARY_TABLE_BYTES`]
/// for every leaf of a preallocating physical type whose dictionary is enabled.
fn dictionary_table_bytes(descr: &parquet::schema::types::SchemaDescriptor, props: &WriterProperties) -> usize {
    descr.columns().iter().filter(|c| preallocates_dictionary(c) && props.dictionary_enabled(c.path())).count().saturating_mul(DICTIONARY_TABLE_BYTES)
}

/// Whether a dictionary-encoded column chunk of `column` opens with [`DICTIONARY_TABLE_BYTES`].
fn preallocates_dictionary(column: &parquet::schema::types::ColumnDescriptor) -> bool {
    use parquet::basic::Type;
    matches!(column.physical_type(), Type::INT32 | Type::INT64 | Type::FLOAT | Type::DOUBLE)
}

/// `props` for a file of `schema` written with `room` bytes free under the limit: when the
/// dictionary tables every row group opens ([`DICTIONARY_TABLE_BYTES`] a column) would take
/// more than a quarter of `room`, those columns are written without dictionaries (plain
/// encoding, a larger file) rather than hold memory past the limit; otherwise `props` as
/// given. The row-group byte cut does not weigh here: it counts what a row group holds beyond
/// its tables (`write_steps`), and a wide table of few distinct values written plain needs
/// far bigger reader pages (120 `Int64` columns of 1,000 values each: a scan asked 12 MiB
/// where the dictionary-encoded files scanned at 8 MiB). Byte-array columns keep their dictionaries either way: they grow with their values,
/// inside the step budget.
pub fn fit_dictionaries(props: WriterProperties, schema: &arrow_schema::Schema, room: usize) -> WriterProperties {
    match parquet_schema(schema) {
        Some(descr) => fit_dictionaries_of(props, &descr, room),
        None => props,
    }
}

/// `schema`'s Parquet descriptor as `ArrowWriter` converts it; `None` when it cannot be
/// converted (the writer then fails with the reason).
fn parquet_schema(schema: &arrow_schema::Schema) -> Option<parquet::schema::types::SchemaDescriptor> {
    parquet::arrow::ArrowSchemaConverter::new().convert(schema).ok()
}

/// [`fit_dictionaries`] for a schema already converted to its Parquet descriptor.
fn fit_dictionaries_of(props: WriterProperties, descr: &parquet::schema::types::SchemaDescriptor, room: usize) -> WriterProperties {
    if dictionary_table_bytes(descr, &props) <= room / 4 {
        return props;
    }
    let mut builder = props.into_builder();
    for c in descr.columns().iter().filter(|c| preallocates_dictionary(c)) {
        builder = builder.set_column_dictionary_enabled(c.path().clone(), false);
    }
    builder.build()
}

/// Heap bytes a Parquet writer keeps for each column chunk it has written until the file is
/// closed (the chunk's `ColumnChunkMetaData` and its column-index and offset-index entries),
/// besides the chunk statistics' min and max bytes, which [`FooterTally`] adds: 924–1,050
/// bytes a chunk measured with jemalloc's `allocated` (parquet 59, 10,000 one-row row groups
/// of 3 and of 16 `Int64`/`Utf8` columns, 8- and 200-byte strings; a temporary program),
/// rounded up.
pub const WRITTEN_CHUNK_BYTES: usize = 1024;

/// The bytes a Parquet writer holds for the row groups it has already written: their metadata
/// and page indexes stay in the writer until the file is closed, so a file of many small row
/// groups grows them without bound (2.8 KB a row group of three columns; an export of
/// 20,000 one-row row groups held 57 MB that no reservation counted). Each row group is
/// counted once, [`WRITTEN_CHUNK_BYTES`] per column chunk plus its statistics' min and max.
#[derive(Debug, Clone)]
pub struct FooterTally {
    groups: usize,
    bytes: usize,
    /// Leaf columns of the file's Parquet schema (column chunks a row group has).
    leaves: usize,
}

impl FooterTally {
    /// For a writer of `schema` (its Parquet leaf columns, as `ArrowWriter` converts it;
    /// the top-level fields when it cannot be converted).
    pub fn new(schema: &arrow_schema::Schema) -> Self {
        Self::of(schema, parquet_schema(schema).as_ref())
    }

    /// [`Self::new`] with `schema`'s Parquet descriptor already converted (`None`: it cannot
    /// be).
    fn of(schema: &arrow_schema::Schema, descr: Option<&parquet::schema::types::SchemaDescriptor>) -> Self {
        Self { groups: 0, bytes: 0, leaves: descr.map_or(schema.fields().len(), parquet::schema::types::SchemaDescriptor::num_columns) }
    }

    /// Counts the row groups of `flushed` (a writer's `flushed_row_groups()`, which only
    /// grows) that are not counted yet, and returns the total in bytes.
    pub fn update(&mut self, flushed: &[parquet::file::metadata::RowGroupMetaData]) -> usize {
        for group in flushed.get(self.groups..).unwrap_or_default() {
            for chunk in group.columns() {
                let stats = chunk.statistics().map_or(0, |s| s.min_bytes_opt().map_or(0, <[u8]>::len) + s.max_bytes_opt().map_or(0, <[u8]>::len));
                self.bytes = self.bytes.saturating_add(WRITTEN_CHUNK_BYTES + stats);
            }
        }
        self.groups = self.groups.max(flushed.len());
        self.bytes
    }

    /// The total counted so far, in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// What one more row group adds at least (its statistics not known yet): a column chunk
    /// per leaf column, [`WRITTEN_CHUNK_BYTES`] each. A writer budgets it before a step that
    /// fills a row group's rows (and so closes it).
    pub fn next_group_bytes(&self) -> usize {
        self.leaves.saturating_mul(WRITTEN_CHUNK_BYTES)
    }
}

/// Writes `batch` into `w` one row group's worth of rows at a time (at most `max_rows`, the
/// writer's `max_row_group_row_count`, less the rows its open row group holds). parquet 59's
/// `ArrowWriter::write` calls itself once for every row group a batch crosses, so a batch of
/// many row groups' rows (8,192 rows into one-row row groups) overflowed the stack and
/// aborted the process (an export did). [`write_steps`] already cuts its steps at row-group
/// ends; this keeps the one-thread writer safe whatever it is given.
fn write_within_row_groups<W: std::io::Write + Send>(w: &mut ArrowWriter<W>, batch: &RecordBatch, max_rows: usize) -> Result<(), ParquetError> {
    let mut at = 0;
    while at < batch.num_rows() {
        let len = max_rows.saturating_sub(w.in_progress_rows()).max(1).min(batch.num_rows() - at);
        w.write(&batch.slice(at, len))?;
        at += len;
    }
    Ok(())
}

/// Default thread count of a data-file write ([`WriteOptions::encode_threads`]) and of a
/// flush's rows → Arrow conversion: min(2, `std::thread::available_parallelism`), 1 when
/// that is unknown.
pub fn default_encode_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(2))
}

/// A flag that cancels the data-file writes of one table (its flushes and compactions) when
/// the table is dropped. Clones share the flag.
///
/// A write checks it before every call into the file layer (each `write` of the Parquet sink,
/// the fsync and the rename) and between the batches it encodes; once set, the write stops with
/// an I/O error of kind [`std::io::ErrorKind::Other`] ("write cancelled: the table was
/// dropped"), removes its temp file and frees its buffers. A call already inside the file
/// layer (a `write` or `fsync` blocked in the kernel) cannot be interrupted: the write stops
/// when that call returns.
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<std::sync::atomic::AtomicBool>);

impl CancelToken {
    /// Cancels every write using this token, now and later.
    pub fn cancel(&self) {
        self.0.store(true, std::sync::atomic::Ordering::Release);
    }

    /// True once [`Self::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }

    fn check(&self) -> std::io::Result<()> {
        if self.is_cancelled() {
            return Err(std::io::Error::other(CANCELLED));
        }
        Ok(())
    }
}

/// The message of a cancelled write's error.
const CANCELLED: &str = "write cancelled: the table was dropped";

/// A data file as written: its size, the CRC-32 of its bytes and its rows' Arrow size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WrittenFile {
    /// File size in bytes.
    pub bytes: u64,
    /// CRC-32 (IEEE, `crc32fast`) of the whole file, computed from the bytes as they were
    /// written (no second read); the manifest records it ([`crate::FileMeta::crc32`]).
    pub crc32: u32,
    /// Bytes of the rows written as Arrow arrays: the sum of [`crate::batch_bytes`] of the
    /// batches handed to the writer ([`crate::FileMeta::decoded_bytes`]).
    pub decoded_bytes: u64,
}

/// CRC-32 and length of the file at `path`, read 16 KiB at a time into a stack buffer (no
/// heap memory outside the limit).
///
/// # Errors
/// [`StorageError::Io`].
pub fn file_crc32(path: &Path) -> Result<(u32, u64), StorageError> {
    use std::io::Read as _;
    let mut f = fs::File::open(path).map_err(io(path))?;
    let mut h = crc32fast::Hasher::new();
    let mut buf = [0u8; 16 << 10];
    let mut len = 0u64;
    loop {
        let n = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(StorageError::Io { path: path.to_path_buf(), source: e }),
        };
        h.update(&buf[..n]);
        len += n as u64;
    }
    Ok((h.finalize(), len))
}

/// Writes `batches` (in order, one schema) as the Parquet file `dir/name`: written to `name.tmp`, fsynced, renamed,
/// directory fsynced, so the file is either absent or complete. The writer's buffers are
/// reserved under `write_buffers` as they grow (`ArrowWriter::memory_size`).
/// Returns the file's size and CRC-32.
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
) -> Result<WrittenFile, StorageError> {
    let schema =
        batches.first().map(RecordBatch::schema).ok_or_else(|| StorageError::CorruptFile { path: dir.join(name), detail: "no batch to write".into() })?;
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
) -> Result<WrittenFile, StorageError> {
    let tmp = dir.join(format!("{name}.tmp"));
    let dst = dir.join(name);
    let mut decoded_bytes = 0u64;
    let batches = batches.inspect(|b| {
        if let Ok(b) = b {
            decoded_bytes = decoded_bytes.saturating_add(crate::batch_bytes(b) as u64);
        }
    });
    let res = (|| {
        let seen = Arc::new(std::sync::Mutex::new(None));
        let cancel = &opts.cancel;
        cancel.check().map_err(io(&tmp))?;
        let file = Recording { inner: vfs.create(&tmp).map_err(io(&tmp))?, seen: Arc::clone(&seen), cancel: cancel.clone(), crc: crc32fast::Hasher::new() };
        let (mut budget, props) =
            Budget::for_file(ctl, table, schema, data_file_properties(opts.row_group_rows).build(), opts.written_metadata(), &opts.learned_growth);
        let pq = |e: ParquetError| parquet_io(e, &tmp, &seen);
        // `ArrowWriter` builds the Parquet schema and adds the Arrow schema to the footer's
        // metadata in both paths, so their files are alike.
        let writer = ArrowWriter::try_new(file, Arc::clone(schema), Some(props)).map_err(pq)?;
        // One thread too: `ParallelWriter` runs its tasks on the calling thread then, and
        // appends a row group's fields as they close (`ArrowWriter::flush` closes every column
        // first, holding the row group's pages beside its metadata). A schema of no field
        // (no column writer to run) goes through `ArrowWriter`.
        let file = if schema.fields().is_empty() {
            let mut w = SingleWriter { w: writer, max_rows: opts.row_group_rows.max(1) };
            for batch in batches {
                write_steps(&mut w, &batch?, opts, &mut budget, &tmp).map_err(|e| e.into_storage(&pq))?;
            }
            w.w.into_inner().map_err(pq)?
        } else {
            let (fw, factory) = writer.into_serialized_writer().map_err(pq)?;
            let mut w = ParallelWriter::new(fw, factory, schema, opts.encode_threads);
            for batch in batches {
                write_steps(&mut w, &batch?, opts, &mut budget, &tmp).map_err(|e| e.into_storage(&pq))?;
            }
            w.finish().map_err(pq)?
        };
        // The written row groups' metadata is freed with the writer, at the file's close.
        drop(budget);
        let crc32 = file.crc.finalize();
        let mut file = file.inner;
        cancel.check().map_err(io(&tmp))?;
        file.sync_all().map_err(io(&tmp))?;
        let size = file.len().map_err(io(&tmp))?;
        drop(file);
        cancel.check().map_err(io(&tmp))?;
        vfs.rename(&tmp, &dst).map_err(io(&dst))?;
        vfs.sync_dir(dir).map_err(io(dir))?;
        Ok((size, crc32))
    })();
    if res.is_err() {
        let _ = vfs.remove_file(&tmp);
    }
    res.map(|(bytes, crc32)| WrittenFile { bytes, crc32, decoded_bytes })
}

/// Rows per step of [`write_steps`] for `batch`, and the batch's average Arrow bytes per
/// row ([`crate::batch_bytes`] / rows, at least 1). The step is
/// `write_batch_rows`, fewer when that many rows would hold more than a quarter of
/// `row_group_bytes`, so one step of a wide table cannot overshoot the row-group cut by much.
/// At least 1.
fn step_rows(batch: &RecordBatch, opts: &WriteOptions) -> (usize, usize) {
    let rows = batch.num_rows().max(1);
    let per_row = crate::batch_bytes(batch).div_ceil(rows).max(1);
    (opts.write_batch_rows.min((opts.row_group_bytes / 4 / per_row).max(1)).max(1), per_row)
}

/// The Arrow bytes of row ranges of one batch, column by column ([`crate::bytes::range_bytes`]), for
/// [`write_steps`]: a step is sized and budgeted by what its own rows hold, not by the batch's
/// average row. A batch of narrow rows with a cluster of wide values put 11.5 MB of values in
/// one 8,192-row step budgeted at the average, and in one Parquet page.
struct StepSizer {
    columns: Vec<arrow_data::ArrayData>,
}

impl StepSizer {
    fn new(batch: &RecordBatch) -> Self {
        Self { columns: batch.columns().iter().map(|c| c.to_data()).collect() }
    }

    /// Arrow bytes of rows `at..at + len`.
    fn bytes(&self, at: usize, len: usize) -> usize {
        self.columns.iter().map(|c| crate::bytes::range_bytes(c, at, len)).fold(0, usize::saturating_add)
    }

    /// The Arrow bytes of rows `at..at + len` ([`Self::bytes`]) when they hold at most
    /// `max_bytes` in all and `max_column` in each column; `None` otherwise.
    fn fits(&self, at: usize, len: usize, max_bytes: usize, max_column: usize) -> Option<usize> {
        let mut total = 0usize;
        for c in &self.columns {
            let b = crate::bytes::range_bytes(c, at, len);
            if b > max_column {
                return None;
            }
            total = total.saturating_add(b);
        }
        (total <= max_bytes).then_some(total)
    }

    /// The most rows from `at`, at most `len` and at least 1, that [`Self::fits`] (the bytes
    /// only grow with the rows, so a binary search finds it), and their Arrow bytes.
    fn fit(&self, at: usize, len: usize, max_bytes: usize, max_column: usize) -> (usize, usize) {
        if let Some(bytes) = self.fits(at, len, max_bytes, max_column) {
            return (len, bytes);
        }
        let (mut lo, mut hi) = (1, len);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if self.fits(at, mid, max_bytes, max_column).is_some() {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        // One row is taken whatever it holds.
        (lo, self.bytes(at, lo))
    }
}

/// What [`write_steps`] drives: `ArrowWriter` on one thread, or [`ParallelWriter`].
trait BatchSink {
    /// Encodes `batch` into the open row group.
    fn write(&mut self, batch: &RecordBatch) -> Result<(), ParquetError>;
    /// Bytes the encoders hold (`ArrowColumnWriter::memory_size` summed).
    fn memory_size(&self) -> usize;
    /// Closes the open row group and writes it to the file (no-op when it is empty).
    fn flush(&mut self) -> Result<(), ParquetError>;
    /// Rows in the open row group.
    fn in_progress_rows(&self) -> usize;
    /// The row groups written so far (their metadata, held until the file is closed).
    fn flushed_row_groups(&self) -> &[parquet::file::metadata::RowGroupMetaData];
}

/// `ArrowWriter` on one thread, with the row-group row cap it was built with (the writer does
/// not say it).
struct SingleWriter<W: std::io::Write + Send> {
    w: ArrowWriter<W>,
    max_rows: usize,
}

impl<W: std::io::Write + Send> BatchSink for SingleWriter<W> {
    fn write(&mut self, batch: &RecordBatch) -> Result<(), ParquetError> {
        write_within_row_groups(&mut self.w, batch, self.max_rows)
    }
    fn memory_size(&self) -> usize {
        self.w.memory_size()
    }
    fn flush(&mut self) -> Result<(), ParquetError> {
        self.w.flush()
    }
    fn in_progress_rows(&self) -> usize {
        self.w.in_progress_rows()
    }
    fn flushed_row_groups(&self) -> &[parquet::file::metadata::RowGroupMetaData] {
        self.w.flushed_row_groups()
    }
}

/// An error of a stepped Parquet write ([`StepWriter`]): from the budget or the batch stream
/// (already a [`StorageError`]), or from the Parquet writer, left to the caller to map
/// because it knows its sink (an I/O error the sink saw may reach it only as Parquet's text).
#[derive(Debug)]
pub enum StepError {
    /// The budget refused ([`StorageError::Memory`]), the write was cancelled
    /// ([`StorageError::Io`]), or the batch stream failed.
    Storage(StorageError),
    /// The Parquet writer failed (its sink's I/O errors included).
    Parquet(ParquetError),
}

impl StepError {
    fn into_storage(self, pq: &impl Fn(ParquetError) -> StorageError) -> StorageError {
        match self {
            Self::Storage(e) => e,
            Self::Parquet(e) => pq(e),
        }
    }
}

impl From<StorageError> for StepError {
    fn from(e: StorageError) -> Self {
        Self::Storage(e)
    }
}

impl From<gritdb_memctl::MemoryError> for StepError {
    fn from(e: gritdb_memctl::MemoryError) -> Self {
        Self::Storage(e.into())
    }
}

/// What a step's encoding adds to a writer's buffers, in percent of the step's Arrow bytes,
/// before any step of the file was seen, and at least for a row group's first step (which
/// allocates its encoders' buffers afresh): 200. The encoders' buffers grow by doubling (a
/// `Vec`'s capacity, which `ArrowWriter::memory_size` counts), so a step can take up to twice
/// what its values need: `write::tests::refused_buffer_growth_cuts_row_groups_early` peaked
/// at 340 KB in 256 KiB of room when steps were budgeted at their Arrow bytes, once what
/// existed was counted; a first step of 400-byte strings added 194% where the file's steps
/// so far had added at most 177% (`flush_parts`). After that the budget uses the most any
/// step of the file added ([`Budget::growth_pct`]), between 100 and [`MAX_GROWTH_PCT`]:
/// 64 `Int64` columns add 103%.
const FIRST_GROWTH_PCT: usize = 200;

/// The most [`Budget::growth_pct`] budgets a step at: 400% of its Arrow bytes.
const MAX_GROWTH_PCT: usize = 400;

/// The smallest step [`write_steps`] halves a refused step to, in Arrow bytes (one row when
/// a row is larger): 64 KiB, one default chunk.
const MIN_STEP_BYTES: usize = 64 << 10;

/// How a stepped Parquet write counts the metadata its writer keeps of the row groups it has
/// written (about [`WRITTEN_CHUNK_BYTES`] a column chunk plus its statistics, held until the
/// file is closed, [`FooterTally`]), under `write_buffers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrittenMetadata {
    /// Counted as it comes to exist, past the limit when need be
    /// ([`Reservation::force_resize`]); a step that fits but for it goes ahead. For flushes
    /// and compactions ([`write_data_file`], [`write_data_file_from`]), which must finish to
    /// give memory back: they close a row group early only when it holds at least twice its
    /// metadata, and their row-group row cap is Parquet's default, so the metadata stays a
    /// small part of what they write. Shrinking steps for it instead closed more, smaller row
    /// groups, each adding metadata (a 64-column table with 1 MiB of room wrote 102 row
    /// groups instead of 11).
    CountPastLimit,
    /// Budgeted before each row group is closed (one more row group's worth,
    /// [`FooterTally::next_group_bytes`]); refused, the write fails with
    /// [`StorageError::Memory`]. For writes whose row groups the caller sizes (an export's
    /// `row_group_rows`: 20,000 one-row row groups of two columns keep ~40 MB), which must
    /// not grow past the limit.
    Budget,
}

/// A data-file writer's reservations under `write_buffers`: its open row group's buffers and
/// what it keeps of the row groups it has written.
struct Budget {
    /// The writer's `memory_size`, or a step's budget ahead of it.
    buffers: Reservation,
    tally: FooterTally,
    /// [`FooterTally::bytes`]; one row group more while one is closed under
    /// [`WrittenMetadata::Budget`].
    held: Reservation,
    policy: WrittenMetadata,
    /// The dictionary tables a row group opens with ([`DICTIONARY_TABLE_BYTES`] a column),
    /// budgeted with its first step.
    opening: usize,
    /// The most a step of this file added to the writer's buffers, in percent of its Arrow
    /// bytes (`None` before the first step), starting from what earlier files learned.
    growth: Option<usize>,
    /// Where this file's steps teach later files ([`WriteOptions::learned_growth`]).
    learned: LearnedGrowth,
    /// The highest `buffers` + `held` so far, in bytes.
    peak: usize,
}

impl Budget {
    /// The budget of a file of `schema` written with `props`, and `props` fitted to the room
    /// left under `ctl`'s limit now ([`fit_dictionaries`]): the schema is converted to its
    /// Parquet descriptor once for the fitting, the dictionary tables and the footer tally.
    fn for_file(
        ctl: &Arc<MemoryController>,
        table: Option<&TableAccount>,
        schema: &arrow_schema::Schema,
        props: WriterProperties,
        policy: WrittenMetadata,
        learned: &LearnedGrowth,
    ) -> (Self, WriterProperties) {
        let descr = parquet_schema(schema);
        let props = match &descr {
            Some(d) => fit_dictionaries_of(props, d, ctl.limit().saturating_sub(ctl.used())),
            None => props,
        };
        let opening = descr.as_ref().map_or(0, |d| dictionary_table_bytes(d, &props));
        let budget = Self {
            buffers: Reservation::new(ctl, Category::WriteBuffers, table),
            tally: FooterTally::of(schema, descr.as_ref()),
            held: Reservation::new(ctl, Category::WriteBuffers, table),
            policy,
            opening,
            growth: learned.pct(),
            learned: learned.clone(),
            peak: 0,
        };
        (budget, props)
    }

    /// What the next step is budgeted at, in percent of its Arrow bytes: the most a step of
    /// this file, or of an earlier file with the same [`LearnedGrowth`], added so far;
    /// [`FIRST_GROWTH_PCT`] before the first.
    fn growth_pct(&self) -> usize {
        self.growth.unwrap_or(FIRST_GROWTH_PCT)
    }

    /// Learns from a step of `step_bytes` Arrow bytes that took the writer's buffers from
    /// `before` to `after` bytes (`opened`: the step opened the row group, whose dictionary
    /// tables are budgeted apart).
    fn observe(&mut self, step_bytes: usize, before: usize, after: usize, opened: bool) {
        let added = after.saturating_sub(before).saturating_sub(if opened { self.opening } else { 0 });
        let pct = (added.saturating_mul(100) / step_bytes.max(1)).clamp(100, MAX_GROWTH_PCT);
        self.growth = Some(self.growth.map_or(pct, |g| g.max(pct)));
        self.learned.learn(pct);
    }

    /// Whether closing a row group of `buffered` bytes (the writer's `memory_size`) early, on
    /// a refused budget, is worth the metadata the writer then keeps of it to the file's end:
    /// it must hold at least twice that metadata.
    /// The row group's dictionary tables ([`Self::opening`]) do not count: the next row group
    /// opens them again.
    fn worth_closing(&self, buffered: usize) -> bool {
        buffered.saturating_sub(self.opening) >= 2 * self.tally.next_group_bytes()
    }

    /// Under [`WrittenMetadata::Budget`], reserves what the writer will keep of the row group
    /// about to be closed; refused, it waits through [`WriteOptions::memory_wait`] (an
    /// export's, for memory other holders give back) and asks again.
    fn before_close(&mut self, opts: &WriteOptions) -> Result<(), gritdb_memctl::MemoryError> {
        if self.policy == WrittenMetadata::Budget {
            let mut waited_since = None;
            let want = self.tally.bytes().saturating_add(self.tally.next_group_bytes());
            while let Err(e) = self.held.try_resize(want) {
                if !wait_for_room(opts, &mut waited_since) {
                    return Err(e);
                }
            }
            self.note_peak();
        }
        Ok(())
    }

    /// Closes `w`'s open row group (no-op when it is empty), budgeted as [`Self::before_close`].
    fn close(&mut self, w: &mut (impl BatchSink + ?Sized), opts: &WriteOptions) -> Result<(), StepError> {
        if w.in_progress_rows() > 0 {
            self.before_close(opts)?;
        }
        w.flush().map_err(StepError::Parquet)?;
        self.update(&*w, w.memory_size());
        Ok(())
    }

    /// Counts the row groups `w` has closed since the last call, as they are (past the limit
    /// if need be: the memory exists), after releasing what its buffers no longer hold: a
    /// closed row group's pages are in the file and dropped as each field is appended
    /// ([`ParallelWriter::close_row_group`]), so they are not counted beside its metadata.
    /// `now`: the writer's `memory_size` (the caller has it; for a wide table it is a sum over
    /// thousands of column writers).
    fn update(&mut self, w: &(impl BatchSink + ?Sized), now: usize) {
        if now < self.buffers.size() {
            self.buffers.shrink(self.buffers.size() - now);
        }
        self.held.force_resize(self.tally.update(w.flushed_row_groups()));
        self.note_peak();
    }

    fn note_peak(&mut self) {
        self.peak = self.peak.max(self.buffers.size().saturating_add(self.held.size()));
    }
}

/// Waits through [`WriteOptions::memory_wait`] (none: `false`); `since` is when this step's
/// first wait began.
fn wait_for_room(opts: &WriteOptions, since: &mut Option<std::time::Instant>) -> bool {
    let Some(wait) = &opts.memory_wait else { return false };
    let start = *since.get_or_insert_with(std::time::Instant::now);
    wait.wait(start.elapsed())
}

/// Feeds `batch` to `w` in steps of `write_batch_rows`, keeping `budget` at the writer's
/// size and what it keeps of closed row groups, and cutting row groups by `row_group_bytes`
/// (the writer's rows limit cuts by rows). `file` names the file in a cancellation's error.
fn write_steps(w: &mut impl BatchSink, batch: &RecordBatch, opts: &WriteOptions, budget: &mut Budget, file: &Path) -> Result<(), StepError> {
    let max_rows = opts.row_group_rows.max(1);
    let (step, _) = step_rows(batch, opts);
    let sizer = StepSizer::new(batch);
    let mut at = 0;
    while at < batch.num_rows() {
        // Between encoded batches (and so between row groups) a drop stops the write.
        opts.cancel.check().map_err(io(file))?;
        // A step never crosses a row group's end (`ArrowWriter::write` calls itself once
        // for every row group a batch crosses).
        let len = step.min(batch.num_rows() - at).min(max_rows.saturating_sub(w.in_progress_rows()).max(1));
        // Nor holds more than a quarter of the row-group cut, or a data page's worth of any
        // one column, by its own rows ([`StepSizer`]): Parquet checks a page's size only
        // after each mini-batch, and sizes a step's mini-batches by its first rows.
        let (mut len, mut step_bytes) = sizer.fit(at, len, opts.row_group_bytes / 4, DATA_PAGE_BYTES);
        // The step's buffers are budgeted before they are made: its Arrow bytes times what
        // steps of this file added ([`Budget::growth_pct`]), and for a row group's first step
        // the dictionary tables it opens ([`DICTIONARY_TABLE_BYTES`]). Under a tight limit
        // the budget refuses; then, in order:
        // - the open row group is closed (its pages go to the file) when it holds at
        //   least twice what the writer keeps of it afterwards (its metadata, about
        //   `WRITTEN_CHUNK_BYTES` a column, [`Budget::worth_closing`]);
        // - under [`WrittenMetadata::CountPastLimit`], a step that fits but for the metadata
        //   this writer keeps of its written row groups is counted past the limit by that
        //   much: the memory is the same as when that metadata went uncounted, and is all
        //   freed when the file closes;
        // - otherwise the step is halved, down to one row or [`MIN_STEP_BYTES`];
        // - at the smallest step, with [`WriteOptions::count_past_limit`] (flushes), while
        //   [`WriteOptions::memory_wait`] says another holder is about to give memory back,
        //   the write waits and asks again; after that the smallest step is budgeted bare:
        //   its Arrow bytes alone, without the growth and tables estimated for it (what it
        //   really adds is counted once it exists, below), so a write that fits by its
        //   values is not refused for an estimate;
        // - then the open row group is closed whatever its size (before, this came first,
        //   and a wide table's flush at a tight limit closed a row group at every row, each
        //   keeping more metadata than it freed);
        // - the bare smallest step refused with no row group open (without
        //   `count_past_limit`: the smallest step refused) is the error.
        let mut bare = false;
        let mut waited_since = None;
        loop {
            // A row group's first step allocates its encoders' buffers afresh (capacities
            // rounded up to powers of two): at least [`FIRST_GROWTH_PCT`].
            let first = w.in_progress_rows() == 0;
            let (open, pct) = match (bare, first) {
                (true, _) => (0, 100),
                (false, true) if !opts.count_past_limit => (budget.opening, MAX_GROWTH_PCT),
                (false, true) => (budget.opening, budget.growth_pct().max(FIRST_GROWTH_PCT)),
                (false, false) if !opts.count_past_limit => (0, MAX_GROWTH_PCT),
                (false, false) => (0, budget.growth_pct()),
            };
            let ahead = w.memory_size().saturating_add(step_bytes.saturating_mul(pct) / 100).saturating_add(open);
            let Err(e) = budget.buffers.try_resize(ahead) else { break };
            let smallest = len == 1 || step_bytes <= MIN_STEP_BYTES;
            if w.in_progress_rows() > 0 && budget.worth_closing(w.memory_size()) {
                budget.close(w, opts)?;
            } else if budget.policy == WrittenMetadata::CountPastLimit
                && budget.held.size() > 0
                && budget.buffers.try_resize(ahead.saturating_sub(budget.held.size())).is_ok()
            {
                budget.buffers.force_resize(ahead);
                break;
            } else if !smallest {
                len /= 2;
                step_bytes = sizer.bytes(at, len);
            } else if !bare && opts.count_past_limit && wait_for_room(opts, &mut waited_since) {
                // Memory another holder gives back soon (a write's WAL record, another
                // flush): asked again at the estimate.
            } else if !bare && opts.count_past_limit {
                bare = true;
            } else if w.in_progress_rows() > 0 {
                // Last: a row group not worth closing (closing keeps more of its metadata
                // than it frees) is closed only when even the bare step does not fit.
                budget.close(w, opts)?;
            } else {
                return Err(e.into());
            }
        }
        // A step that fills the row group's rows closes it.
        if w.in_progress_rows() + len >= max_rows {
            budget.before_close(opts)?;
        }
        budget.note_peak();
        let (before, opened) = (w.memory_size(), w.in_progress_rows() == 0);
        w.write(&batch.slice(at, len)).map_err(StepError::Parquet)?;
        let buffered = w.memory_size();
        // A step that closed its row group shows nothing of what it added.
        if w.in_progress_rows() > 0 {
            budget.observe(step_bytes, before, buffered, opened);
        }
        budget.update(&*w, buffered);
        at += len;
        // Cut by the writer's whole buffered size (encoders and dictionaries included),
        // so its memory is bounded by about `row_group_bytes` + one step. When encoding
        // took more than the step budgeted and the limit refuses it, the bytes, which exist,
        // are counted past the limit first (so the high-water mark shows them), then a row
        // group worth closing is closed; a smaller one stays open (the next step's budget
        // then closes or shrinks).
        let refused = budget.buffers.try_resize(buffered).err();
        let over = refused.is_some();
        if let Some(e) = refused {
            budget.buffers.force_resize(buffered);
            budget.note_peak();
            if !opts.count_past_limit {
                return Err(e.into());
            }
        }
        // The cut is at least twice the dictionary tables a row group opens with: closing
        // does not free those (the next row group opens them again), so a cut they alone
        // fill would close a row group at every step.
        // Nor is a row group cut before it is worth closing: a row group of a wide table
        // keeps `WRITTEN_CHUNK_BYTES` a column of metadata to the file's end, and cutting
        // 200-column rows at 128 KiB kept 4.6 MB of it for a 20-row file at 2 MiB.
        if (buffered >= opts.row_group_bytes.max(2 * budget.opening) || over) && budget.worth_closing(buffered) {
            budget.close(w, opts)?;
        }
        budget.buffers.force_resize(w.memory_size());
        budget.note_peak();
    }
    Ok(())
}

/// A Parquet file's `ArrowWriter` fed in budgeted steps, as a flush writes its data files:
/// the writer's buffers and the metadata it keeps of written row groups are reserved under
/// `write_buffers` (in `ctl`, and `table` when given) as they grow, row groups are cut at
/// [`WriteOptions::row_group_bytes`] of buffered bytes and at the writer properties'
/// `max_row_group_row_count` rows, and under a tight limit row groups are closed early and
/// steps shrink rather than pass the limit. Everything reserved is released when it is
/// dropped or [`finish`](Self::finish)ed. For writers outside the flush (the engine's
/// export), whose sink is their own.
pub struct StepWriter<W: std::io::Write + Send> {
    w: SingleWriter<W>,
    opts: WriteOptions,
    budget: Budget,
    path: std::path::PathBuf,
}

/// What a [`StepWriter`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepStats {
    /// Row groups in the file.
    pub row_groups: usize,
    /// The highest the writer's reservations reached together (its buffers, a step's budget
    /// ahead, and its written row groups' metadata), in bytes.
    pub peak_bytes: usize,
}

impl<W: std::io::Write + Send> StepWriter<W> {
    /// An `ArrowWriter` over `sink` for batches of `schema`, with `props` (dictionaries of
    /// fixed-width columns turned off when their tables do not fit the room left under the
    /// limit, [`fit_dictionaries`]); `opts` gives the byte cut, the rows a step takes at
    /// most, and the cancel token (its `row_group_rows` is taken from `props`, its
    /// `encode_threads` is not used: one thread). `path` names the file in errors.
    ///
    /// # Errors
    /// [`StepError::Parquet`] when the schema cannot be written as Parquet.
    #[allow(clippy::too_many_arguments)]
    pub fn try_new(
        sink: W,
        schema: arrow_schema::SchemaRef,
        props: WriterProperties,
        mut opts: WriteOptions,
        policy: WrittenMetadata,
        ctl: &Arc<MemoryController>,
        table: Option<&TableAccount>,
        path: &Path,
    ) -> Result<Self, StepError> {
        opts.row_group_rows = props.max_row_group_row_count().unwrap_or(usize::MAX).max(1);
        let (budget, props) = Budget::for_file(ctl, table, &schema, props, policy, &opts.learned_growth);
        let w = ArrowWriter::try_new(sink, schema, Some(props)).map_err(StepError::Parquet)?;
        Ok(Self { w: SingleWriter { w, max_rows: opts.row_group_rows }, opts, budget, path: path.to_path_buf() })
    }

    /// Encodes `batch` (of the writer's schema) in steps, closing row groups as they fill.
    ///
    /// # Errors
    /// [`StepError::Storage`] with [`StorageError::Memory`] when the limit refuses even one
    /// row with no row group open, or (under [`WrittenMetadata::Budget`]) a closed row
    /// group's metadata; [`StepError::Parquet`] from the writer. The file is then unfinished:
    /// drop the writer and remove it.
    pub fn write(&mut self, batch: &RecordBatch) -> Result<(), StepError> {
        write_steps(&mut self.w, batch, &self.opts, &mut self.budget, &self.path)
    }

    /// Closes the last row group, writes the footer and returns the sink (not fsynced) with
    /// what was written; the reservations are released.
    ///
    /// # Errors
    /// As [`Self::write`].
    pub fn finish(mut self) -> Result<(W, StepStats), StepError> {
        self.budget.close(&mut self.w, &self.opts)?;
        let stats = StepStats { row_groups: self.w.w.flushed_row_groups().len(), peak_bytes: self.budget.peak };
        let sink = self.w.w.into_inner().map_err(StepError::Parquet)?;
        Ok((sink, stats))
    }
}

/// A Parquet file written with its columns encoded on several threads (parquet's
/// `ArrowColumnWriter` per leaf column, as `DataFusion`'s parallel writer does). Each batch is
/// split into one task per top-level field; `threads` scoped threads (the caller's included)
/// take tasks, costliest first by the encode time each field took so far, and the call returns
/// once all are encoded. A row group is closed the same way (each column's last page and
/// dictionary) and then appended to the file in column order on the calling thread, which
/// makes every write to the sink. Rows per row group are capped at `max_row_group_row_count`
/// like `ArrowWriter` does.
struct ParallelWriter {
    file: SerializedFileWriter<Recording>,
    factory: ArrowRowGroupWriterFactory,
    schema: arrow_schema::SchemaRef,
    /// Per top-level field: the leaf column writers of the open row group (empty: no row group
    /// open).
    writers: Vec<Mutex<Vec<ArrowColumnWriter>>>,
    /// Per top-level field: nanoseconds spent on it so far (orders the tasks).
    cost: Vec<u64>,
    /// Row groups written.
    row_groups: usize,
    buffered_rows: usize,
    max_rows: usize,
    threads: usize,
}

/// A task of [`ParallelWriter`]: one top-level field (its index) and its leaf column writers.
type FieldTask<'a> = dyn Fn(usize, &mut Vec<ArrowColumnWriter>) -> Result<(), ParquetError> + Sync + 'a;

impl ParallelWriter {
    fn new(file: SerializedFileWriter<Recording>, factory: ArrowRowGroupWriterFactory, schema: &arrow_schema::SchemaRef, threads: usize) -> Self {
        let max_rows = file.properties().max_row_group_row_count().unwrap_or(usize::MAX).max(1);
        let cost = vec![0; schema.fields().len()];
        Self { file, factory, schema: Arc::clone(schema), writers: Vec::new(), cost, row_groups: 0, buffered_rows: 0, max_rows, threads }
    }

    /// Opens the next row group's column writers, grouped by top-level field.
    fn open_row_group(&mut self) -> Result<(), ParquetError> {
        let descr = self.file.schema_descr();
        let mut by_field: Vec<Vec<ArrowColumnWriter>> = (0..self.schema.fields().len()).map(|_| Vec::new()).collect();
        for (leaf, w) in self.factory.create_column_writers(self.row_groups)?.into_iter().enumerate() {
            by_field[descr.get_column_root_idx(leaf)].push(w);
        }
        self.writers = by_field.into_iter().map(Mutex::new).collect();
        Ok(())
    }

    /// Runs `task` for every field of `writers` on up to `threads` threads (scoped; the
    /// calling thread is one of them), taking the fields in `order` (each field once), and
    /// adds each task's time to `cost`. Returns the first error; the other threads then take
    /// no new task.
    fn run(writers: &[Mutex<Vec<ArrowColumnWriter>>], cost: &mut [u64], threads: usize, order: &[usize], task: &FieldTask<'_>) -> Result<(), ParquetError> {
        debug_assert_eq!(order.len(), writers.len());
        let next = AtomicUsize::new(0);
        let failed = AtomicBool::new(false);
        let spent: Vec<AtomicU64> = order.iter().map(|_| AtomicU64::new(0)).collect();
        let work = || -> Result<(), ParquetError> {
            loop {
                let at = next.fetch_add(1, Ordering::Relaxed);
                if at >= order.len() || failed.load(Ordering::Relaxed) {
                    return Ok(());
                }
                let f = order[at];
                let t = std::time::Instant::now();
                let mut ws = writers[f].lock().unwrap_or_else(PoisonError::into_inner);
                if let Err(e) = task(f, &mut ws) {
                    failed.store(true, Ordering::Relaxed);
                    return Err(e);
                }
                spent[f].store(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
            }
        };
        let helpers = threads.min(order.len()).saturating_sub(1);
        let res = std::thread::scope(|s| {
            // Threads the OS cannot start are simply fewer helpers.
            let handles: Vec<_> = (0..helpers).filter_map(|_| std::thread::Builder::new().spawn_scoped(s, work).ok()).collect();
            let mut res = work();
            for h in handles {
                let r = h.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
                if res.is_ok() {
                    res = r;
                }
            }
            res
        });
        for (c, s) in cost.iter_mut().zip(&spent) {
            *c = c.saturating_add(s.load(Ordering::Relaxed));
        }
        res
    }

    /// Encodes `batch` (no more rows than the open row group has room for).
    fn encode(&mut self, batch: &RecordBatch) -> Result<(), ParquetError> {
        if self.writers.is_empty() {
            self.open_row_group()?;
        }
        let schema = &self.schema;
        // Costliest first, so the longest task does not start last and run alone.
        let mut order: Vec<usize> = (0..self.writers.len()).collect();
        order.sort_by_key(|&f| std::cmp::Reverse(self.cost[f]));
        Self::run(&self.writers, &mut self.cost, self.threads, &order, &|f, ws| {
            let leaves = compute_leaves(schema.field(f), batch.column(f))?;
            for (w, leaf) in ws.iter_mut().zip(&leaves) {
                w.write(leaf)?;
            }
            Ok(())
        })?;
        self.buffered_rows += batch.num_rows();
        Ok(())
    }

    /// Closes the open row group's column writers (each its last page and dictionary, in
    /// parallel, taken in field order) and appends each field's chunks to the file as soon as
    /// every field before it is appended; an appended chunk's pages are dropped at once. So
    /// only the chunks closed ahead of the next one to append (about one a thread) wait beside
    /// the metadata the file keeps of those appended. Before, every chunk was closed first and
    /// then appended: the row group's pages and its metadata were held together (200 columns
    /// of strings at 2 MiB: 231 KB of metadata on top of the pages, which took a flush to 1.13
    /// times the limit when the close was forced by a refused budget).
    fn close_row_group(&mut self) -> Result<(), ParquetError> {
        struct Appender<'a> {
            rg: parquet::file::writer::SerializedRowGroupWriter<'a, Recording>,
            /// The field whose chunks are appended next.
            next: usize,
            /// Fields closed ahead of `next`, by field.
            waiting: std::collections::BTreeMap<usize, Vec<ArrowColumnChunk>>,
        }
        let writers = std::mem::take(&mut self.writers);
        let appender = Mutex::new(Appender { rg: self.file.next_row_group()?, next: 0, waiting: std::collections::BTreeMap::new() });
        // Field order: a closed chunk waits only for those before it. (Costliest first, as
        // `encode` takes them, measured no faster: docs/performance.md, thirty-seventh pass.)
        let order: Vec<usize> = (0..writers.len()).collect();
        Self::run(&writers, &mut self.cost, self.threads, &order, &|f, ws| {
            let closed = ws.drain(..).map(ArrowColumnWriter::close).collect::<Result<Vec<_>, _>>()?;
            let mut a = appender.lock().unwrap_or_else(PoisonError::into_inner);
            a.waiting.insert(f, closed);
            loop {
                let next = a.next;
                let Some(chunks) = a.waiting.remove(&next) else { break };
                for chunk in chunks {
                    chunk.append_to_row_group(&mut a.rg)?;
                }
                a.next += 1;
            }
            Ok(())
        })?;
        appender.into_inner().unwrap_or_else(PoisonError::into_inner).rg.close()?;
        self.row_groups += 1;
        self.buffered_rows = 0;
        Ok(())
    }

    /// Closes the last row group and writes the footer; returns the sink.
    fn finish(mut self) -> Result<Recording, ParquetError> {
        BatchSink::flush(&mut self)?;
        self.file.into_inner()
    }
}

impl BatchSink for ParallelWriter {
    fn write(&mut self, batch: &RecordBatch) -> Result<(), ParquetError> {
        let mut at = 0;
        while at < batch.num_rows() {
            let len = (self.max_rows - self.buffered_rows).min(batch.num_rows() - at);
            self.encode(&batch.slice(at, len))?;
            at += len;
            if self.buffered_rows >= self.max_rows {
                self.close_row_group()?;
            }
        }
        Ok(())
    }
    fn memory_size(&self) -> usize {
        self.writers.iter().map(|m| m.lock().unwrap_or_else(PoisonError::into_inner).iter().map(ArrowColumnWriter::memory_size).sum::<usize>()).sum()
    }
    fn flush(&mut self) -> Result<(), ParquetError> {
        if self.buffered_rows == 0 {
            return Ok(());
        }
        self.close_row_group()
    }
    fn in_progress_rows(&self) -> usize {
        self.buffered_rows
    }
    fn flushed_row_groups(&self) -> &[parquet::file::metadata::RowGroupMetaData] {
        self.file.flushed_row_groups()
    }
}

/// Reads a data file, keeping only columns `projection` (indices into the table schema;
/// `None` = all) and rows not in `deleted`, in batches of up to `batch_rows`.
///
/// # Errors
/// [`StorageError::Io`] when the file cannot be opened, [`StorageError::Parquet`] when it is
/// not valid Parquet; the iterator yields later decoding errors.
pub fn read_file(path: &Path, projection: Option<&[usize]>, deleted: Arc<RoaringBitmap>, batch_rows: usize) -> Result<FileReader, StorageError> {
    read_file_with(path, ReadSpec::plain(projection, deleted, batch_rows))
}

/// [`read_file`] with the reader's memory in `res` (which holds nothing else), grown before each step of the open
/// allocates (see [`read_file_within`]) and then sized to [`FileReader::buffer_bytes`].
///
/// # Errors
/// As [`read_file`]; [`StorageError::Memory`] when `res` cannot grow (nothing more is read).
pub fn read_file_reserved(
    path: &Path,
    projection: Option<&[usize]>,
    deleted: Arc<RoaringBitmap>,
    batch_rows: usize,
    res: &mut Reservation,
) -> Result<FileReader, StorageError> {
    let reader = read_file_within(path, ReadSpec::plain(projection, deleted, batch_rows), &mut |total| Ok(res.try_resize(total.max(res.size()))?))?;
    res.try_resize(reader.buffer_bytes())?;
    Ok(reader)
}

/// What [`read_file_with`] reads from a data file.
#[derive(Debug, Clone)]
pub struct ReadSpec {
    /// Columns returned, in this order (indices into the table schema; `None` = all, in
    /// schema order).
    pub projection: Option<Vec<usize>>,
    /// Only rows this predicate makes true (bound to the table schema).
    pub filter: Option<Arc<BoundFilter>>,
    /// File rows to skip (deletion vector and rows replaced in memory).
    pub deleted: Arc<RoaringBitmap>,
    /// Largest batch decoded at a time, in rows (returned batches are at most this).
    pub batch_rows: usize,
    /// Largest batch decoded at a time, in bytes (0: no cap): fewer rows than `batch_rows` are
    /// decoded at once when the read columns' bytes per row in the file's row groups say a
    /// batch would be bigger (Parquet column-chunk metadata: the uncompressed size, or for
    /// byte arrays the size statistics' unencoded value bytes plus a view per row when
    /// larger, and the densest page of a byte-array column where the page index gives its
    /// value bytes; the largest row group's figure).
    pub batch_bytes: usize,
    /// Most bytes the reader may hold ([`FileReader::buffer_bytes`]) with the column index
    /// that lets `filter` prune pages (each page's min / max of every column, kept while the
    /// reader is open). When it would hold more, the file is opened again without it and the
    /// filter prunes row groups only; the rows returned are the same. `usize::MAX`: prune
    /// pages whenever the file has the index; 0: never.
    pub pruning_budget: usize,
    /// Twice the bytes the reader ([`FileReader::buffer_bytes`]: its column readers and the
    /// file's metadata) and one decoded batch (as `batch_bytes` sizes it) may hold together:
    /// the other half is left for the batches a caller holds, writers and other scans.
    /// When one reader of every column read would hold more, the columns are decoded in
    /// groups instead, each group's Parquet reader built for one batch and dropped before the
    /// next group's ([`reader_buffer_bytes`] of each group at most half of this less the
    /// metadata and the batch, one column a group at least), and the groups' columns put side
    /// by side. The rows returned are the same; each batch then reads the pages it needs
    /// again, skipping the rows before it within them (the offset index, loaded for it, skips
    /// whole pages). A 500-column file of mixed types written at a 2 MiB limit needs 3.4 MiB
    /// read whole. `usize::MAX`: always whole.
    pub decode_budget: usize,
    /// Where row groups read and pruned and rows decoded are counted.
    pub counters: Option<Arc<ScanCounters>>,
    /// Reopens a file a reader of the same spec already read part of: file rows before this
    /// one (a file row number, as [`FileReader::resume_row`] gives it) are not read, and the
    /// file and its row groups are not counted again in `counters`. `None`: a first open,
    /// from the file's first row.
    pub resume_at: Option<u64>,
    /// `Some((index, count))`: only this share of the file's row groups, those whose ordinal
    /// `g` has `g % count == index` (`count` ≥ 1, `index` < `count`), so that `count` readers
    /// of one file, each on its own thread, read every row once between them. The counters
    /// then count this share's row groups (each reader still counts the file it opens).
    /// `None`: every row group.
    pub partition: Option<(usize, usize)>,
}

impl ReadSpec {
    /// Every row group of a file, `projection`'s columns (`None`: all), without the rows in
    /// `deleted`, in batches of at most `batch_rows` rows: no filter, byte cap, counters,
    /// resume point or partition.
    pub fn plain(projection: Option<&[usize]>, deleted: Arc<RoaringBitmap>, batch_rows: usize) -> Self {
        Self {
            projection: projection.map(<[usize]>::to_vec),
            filter: None,
            deleted,
            batch_rows,
            batch_bytes: 0,
            pruning_budget: usize::MAX,
            decode_budget: usize::MAX,
            counters: None,
            resume_at: None,
            partition: None,
        }
    }
}

/// Reads a data file as `spec` says: row groups (and, with the page index, pages) whose
/// statistics prove no row matches the filter are not read; the rest are decoded
/// `batch_rows` at a time (never a whole row group at once) and filtered exactly (deleted
/// rows and rows the predicate does not make true are dropped). Empty batches are never
/// yielded.
///
/// # Errors
/// [`StorageError::Io`] when the file cannot be opened, [`StorageError::Parquet`] when it is
/// not valid Parquet, [`StorageError::CorruptFile`] when the Parquet decoder fails on it
/// (a panic of the decoder, caught); the iterator yields later decoding errors, after which
/// it ends.
pub fn read_file_with(path: &Path, spec: ReadSpec) -> Result<FileReader, StorageError> {
    read_file_within(path, spec, &mut |_| Ok(()))
}

/// Heap bytes a parsed Parquet footer may take per byte of its Thrift encoding, while it is
/// decoded: parquet 59's `ParquetMetaData::memory_size` of the result was 3.56–4.23 times the
/// encoded length on files of 1–400 columns and 1–500 row groups (`Int64` and `Utf8` columns,
/// this crate's writer properties), plus the encoded bytes themselves, read into one buffer
/// for the decode.
pub const FOOTER_MEMORY_FACTOR: usize = 5;
/// The same for a page index (column index and offset index together) per encoded byte:
/// 3.4–13.3 times on the files above with more than one column chunk (24 times on a one-chunk
/// file of a 43-byte index), plus the encoded bytes read for the decode.
pub const PAGE_INDEX_MEMORY_FACTOR: usize = 15;
/// The same for an offset index read alone: 2.6–8.0 times on the files above, plus the
/// encoded bytes.
pub const OFFSET_INDEX_MEMORY_FACTOR: usize = 9;

/// The encoded length of the Parquet footer of `file` (its last 8 bytes say it), 0 when the
/// file is too short or does not end in a Parquet footer (the parse that follows reports it).
pub(crate) fn footer_length(file: &fs::File) -> usize {
    use std::os::unix::fs::FileExt;
    const TAIL: usize = parquet::file::FOOTER_SIZE;
    let Ok(len) = file.metadata().map(|m| m.len()) else { return 0 };
    let mut tail = [0u8; TAIL];
    if len < TAIL as u64 || file.read_exact_at(&mut tail, len - TAIL as u64).is_err() {
        return 0;
    }
    // A length past the file's own is damage, not a footer to budget for (the parse that
    // follows reports the file as corrupt, rather than a reservation as a memory limit).
    parquet::file::metadata::FooterTail::try_new(&tail).map_or(0, |t| t.metadata_length()).min(usize::try_from(len).unwrap_or(usize::MAX))
}

/// Runs `decode`, a read of the Parquet file `path`, turning a panic of the decoder into
/// [`StorageError::CorruptFile`]. The parquet crate panics on some damaged files where it
/// should return an error (a negative column chunk start or length, an unknown type in the
/// footer, a dictionary page missing: `unimplemented!`s and `expect`s in its footer and page
/// readers). A data file loaded from a manifest is only checked against its checksum before
/// its first scan, not before the key-index rebuild at open, and a manifest of an older build
/// records no checksum at all, so such a file reaches the decoder. `decode` must leave no
/// shared state half changed when it unwinds: the reads here touch only their own reader.
pub(crate) fn parquet_guard<T>(path: &Path, decode: impl FnOnce() -> Result<T, StorageError>) -> Result<T, StorageError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(decode)).unwrap_or_else(|p| {
        let text = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()));
        Err(StorageError::CorruptFile {
            path: path.to_path_buf(),
            detail: format!("the Parquet decoder failed on it: {}", text.unwrap_or_else(|| "panic".into())),
        })
    })
}

/// [`read_file_with`], asking `reserve(total)` for the memory of each step before it is
/// allocated, so that a file's metadata is counted while it is parsed and not only once the
/// reader is open: `total` bytes before the footer is decoded (its encoded length times
/// [`FOOTER_MEMORY_FACTOR`]), then the decoded footer's size plus the page index's encoded
/// length times [`PAGE_INDEX_MEMORY_FACTOR`] (or [`OFFSET_INDEX_MEMORY_FACTOR`]) before a page
/// index is read. Each call gives the whole amount wanted so far, not an increment; the last
/// may be smaller than an earlier one. The caller sizes its reservation to
/// [`FileReader::buffer_bytes`] afterwards. The column index for page pruning is read only
/// when its estimate, the decoded footer and the reader's buffers fit `spec.pruning_budget`.
///
/// # Errors
/// As [`read_file_with`], and `reserve`'s error as it is (nothing more is read after it).
pub fn read_file_within(path: &Path, spec: ReadSpec, reserve: &mut dyn FnMut(usize) -> Result<(), StorageError>) -> Result<FileReader, StorageError> {
    // Readers of committed files are scans and compactions: a damaged file's error says so.
    parquet_guard(path, || open_reader(path, spec, reserve)).map_err(|e| match e {
        StorageError::CorruptFile { path, detail } => StorageError::CorruptFile { detail: crate::error::damaged_at_read(&detail), path },
        e => e,
    })
}

/// [`read_file_within`] without its guard against decoder panics.
fn open_reader(path: &Path, spec: ReadSpec, reserve: &mut dyn FnMut(usize) -> Result<(), StorageError>) -> Result<FileReader, StorageError> {
    let file = fs::File::open(path).map_err(io(path))?;
    reserve(footer_length(&file).saturating_mul(FOOTER_MEMORY_FACTOR))?;
    let footer = ParquetMetaDataReader::new().parse_and_finish(&file)?;
    let descr = footer.file_metadata().schema_descr_ptr();
    let width = descr.root_schema().get_fields().len();
    let out: Vec<usize> = spec.projection.clone().unwrap_or_else(|| (0..width).collect());
    let mut read: Vec<usize> = out.iter().chain(spec.filter.iter().flat_map(|f| f.columns())).copied().collect();
    read.sort_unstable();
    read.dedup();
    if let Some(&bad) = read.iter().find(|&&c| c >= width) {
        return Err(StorageError::CorruptFile { path: path.to_path_buf(), detail: format!("column {bad} asked for; the file has {width}") });
    }
    // The page index is read only where it is used, as the reader keeps it (and counts it) for
    // as long as it is open: both halves for a filter's page pruning, the offset index alone
    // when batches are capped in bytes and a read column is a byte array (the per-page value
    // sizes of [`densest_page`]). A 121-column Int64 file of 77 row groups holds 4.0 MB of
    // metadata, 7.1 MB with its page index (`breaker_trial3`).
    let byte_arrays = spec.batch_bytes > 0
        && descr
            .columns()
            .iter()
            .enumerate()
            .any(|(leaf, c)| c.physical_type() == parquet::basic::Type::BYTE_ARRAY && read.binary_search(&descr.get_column_root_idx(leaf)).is_ok());
    // Encoded page-index bytes: (column index + offset index, offset index alone).
    let (both, offsets) = footer.row_groups().iter().flat_map(parquet::file::metadata::RowGroupMetaData::columns).fold((0usize, 0usize), |(b, o), c| {
        let ci = c.column_index_length().map_or(0, |n| usize::try_from(n).unwrap_or(0));
        let oi = c.offset_index_length().map_or(0, |n| usize::try_from(n).unwrap_or(0));
        (b.saturating_add(ci).saturating_add(oi), o.saturating_add(oi))
    });
    let all: Vec<usize> = (0..footer.num_row_groups()).collect();
    let with_column_index = || footer.memory_size().saturating_add(both.saturating_mul(PAGE_INDEX_MEMORY_FACTOR));
    // The dictionary page headers of every row group, read only when the pruning estimate
    // needs them (and then kept for the reader's own reservation).
    let mut dictionaries: Option<DictionaryPages> = None;
    // Page pruning is worth its column index only while it fits the budget (decided before
    // reading it, from the estimate; checked again on the decoded size below).
    let pruning = spec.filter.is_some()
        && spec.pruning_budget > 0
        && both > offsets
        && with_column_index().saturating_add(reader_buffer_bytes(
            &footer,
            &all,
            &read,
            dictionaries.insert(DictionaryPages::read(&file, &footer, &all, &read)),
        )) <= spec.pruning_budget;
    let with_index = |md: parquet::file::metadata::ParquetMetaData,
                      column_index: bool,
                      reserve: &mut dyn FnMut(usize) -> Result<(), StorageError>|
     -> Result<_, StorageError> {
        if !column_index && !byte_arrays {
            return Ok(md);
        }
        let (policy, wanted) = if column_index {
            (PageIndexPolicy::Optional, both.saturating_mul(PAGE_INDEX_MEMORY_FACTOR))
        } else {
            (PageIndexPolicy::Skip, offsets.saturating_mul(OFFSET_INDEX_MEMORY_FACTOR))
        };
        reserve(md.memory_size().saturating_add(wanted))?;
        let mut reader = ParquetMetaDataReader::new_with_metadata(md).with_column_index_policy(policy).with_offset_index_policy(PageIndexPolicy::Optional);
        reader.read_page_indexes(&file)?;
        Ok(reader.finish()?)
    };
    let mut md = with_index(footer, pruning, reserve)?;
    if pruning
        && md.column_index().is_some()
        && reader_buffer_bytes(&md, &all, &read, dictionaries.get_or_insert_with(|| DictionaryPages::read(&file, &md, &all, &read)))
            .saturating_add(md.memory_size())
            > spec.pruning_budget
    {
        drop(md);
        md = with_index(ParquetMetaDataReader::new().parse_and_finish(&file)?, false, reserve)?;
    }
    let mut metadata = ArrowReaderMetadata::try_new(Arc::new(md), ArrowReaderOptions::new())?;
    // One reader of every column read and a decoded batch would take more than half of the
    // budget: the columns are decoded in groups, each batch skipping the rows before it within
    // the pages it reads again, so the offset index is loaded to skip whole pages
    // (`ReadSpec::decode_budget`). Decided over every row group (the plan is made below).
    let mut groups = None;
    if spec.decode_budget != usize::MAX && read.len() > 1 {
        let mut md = Arc::clone(metadata.metadata());
        let (_, batch) = batch_rows_for(&md, &all, &read, metadata.schema(), spec.batch_rows, spec.batch_bytes);
        // One reader of every column only while it leaves half of the budget: taken to the
        // edge, the file's batches found no room beside it (four 500-byte-string columns at
        // 8 MiB: a 7.3 MB reader of 8.2 MB free, and the next 250 KiB batch was refused).
        let over = |dicts: &DictionaryPages| {
            md.memory_size().saturating_add(batch).saturating_add(reader_buffer_bytes(&md, &all, &read, dicts)) > spec.decode_budget / 2
        };
        // The dictionary pages' headers (a read per column chunk) only when the estimate from
        // the chunks' compression ratios alone does not fit.
        if dictionaries.is_some() || over(&DictionaryPages::default()) {
            dictionaries.get_or_insert_with(|| DictionaryPages::read(&file, &md, &all, &read));
        }
        if let Some(dicts) = dictionaries.as_ref().filter(|d| over(d)) {
            if md.offset_index().is_none() && offsets > 0 {
                drop(metadata);
                reserve(md.memory_size().saturating_add(offsets.saturating_mul(OFFSET_INDEX_MEMORY_FACTOR)))?;
                let mut reader = ParquetMetaDataReader::new_with_metadata(Arc::unwrap_or_clone(md))
                    .with_column_index_policy(PageIndexPolicy::Skip)
                    .with_offset_index_policy(PageIndexPolicy::Optional);
                reader.read_page_indexes(&file)?;
                metadata = ArrowReaderMetadata::try_new(Arc::new(reader.finish()?), ArrowReaderOptions::new())?;
                md = Arc::clone(metadata.metadata());
            }
            // Groups take at most half of what is left beside the metadata and the batch: the
            // rest stays for the batches the caller holds, writers and other scans (sized to
            // all of it, an idle grouped scan at 2 MiB held 1.7 MB and a 1 MB insert beside it
            // was refused; at 4 MiB a scan's groups left no room for its own next batch).
            let budget = spec.decode_budget.saturating_sub(md.memory_size()).saturating_sub(batch) / 2;
            groups = Some(column_groups(&md, &all, &read, dicts, budget)).filter(|g| g.len() > 1);
        }
    }
    let mut position = vec![usize::MAX; width];
    for (at, &c) in read.iter().enumerate() {
        position[c] = at;
    }
    let md = Arc::clone(metadata.metadata());
    let total: u64 = md.row_groups().iter().map(|g| g.num_rows() as u64).sum();
    let mut plan = match &spec.filter {
        Some(f) => f.plan(&md, metadata.schema()),
        None => FilePlan {
            row_groups: (0..md.num_row_groups()).collect(),
            ranges: if total > 0 { crate::filter::whole(total) } else { Vec::new() },
            pruned_row_groups: 0,
            pruned_page_rows: 0,
        },
    };
    // The selection is relative to the rows of the chosen row groups, concatenated.
    let mut starts = Vec::with_capacity(md.num_row_groups());
    let mut at = 0u64;
    for g in md.row_groups() {
        starts.push(at);
        at += g.num_rows() as u64;
    }
    let mut share = md.num_row_groups() as u64;
    if let Some((index, count)) = spec.partition {
        let count = count.max(1);
        let mine = |g: usize| g % count == index;
        share = (0..md.num_row_groups()).filter(|&g| mine(g)).count() as u64;
        plan.row_groups.retain(|&g| mine(g));
        let spans: Vec<std::ops::Range<u64>> = plan.row_groups.iter().map(|&g| starts[g]..starts[g] + md.row_group(g).num_rows() as u64).collect();
        plan.ranges = crate::filter::intersect(&plan.ranges, &spans);
        // This share's figures: its groups not read, and the rows of its read groups that the
        // page index ruled out.
        plan.pruned_row_groups = share - plan.row_groups.len() as u64;
        let in_groups: u64 = spans.iter().map(|r| r.end - r.start).sum();
        plan.pruned_page_rows = in_groups - plan.ranges.iter().map(|r| r.end - r.start).sum::<u64>();
    }
    match spec.resume_at {
        Some(from) => {
            // The rows already returned are cut from the plan, and row groups wholly before
            // them are not read again.
            plan.ranges.retain(|r| r.end > from);
            if let Some(r) = plan.ranges.first_mut() {
                r.start = r.start.max(from);
            }
            plan.row_groups.retain(|&g| starts[g] + md.row_group(g).num_rows() as u64 > from);
        }
        None => {
            if let Some(c) = &spec.counters {
                c.add_file(share, plan.pruned_row_groups, plan.pruned_page_rows);
            }
        }
    }
    let out_positions: Vec<usize> = out.iter().map(|&c| position[c]).collect();
    let identity = out_positions.iter().copied().eq(0..read.len());
    let mut reader = FileReader {
        path: path.to_path_buf(),
        inner: None,
        // The reader keeps the file's metadata (the page index too, when loaded) for as long
        // as it is open: parquet's own estimate of its heap bytes.
        buffer_bytes: {
            let dicts = dictionaries.unwrap_or_else(|| DictionaryPages::read(&file, &md, &plan.row_groups, &read));
            match &groups {
                Some(groups) => groups.iter().map(|g| reader_buffer_bytes(&md, &plan.row_groups, g, &dicts)).max().unwrap_or(0),
                None => reader_buffer_bytes(&md, &plan.row_groups, &read, &dicts),
            }
            .saturating_add(md.memory_size())
        },
        column_index: md.column_index().is_some(),
        cursor: Cursor { ranges: plan.ranges.clone(), at: 0, offset: 0 },
        returned_from: spec.resume_at.unwrap_or(0),
        position,
        out_positions: (!identity).then_some(out_positions),
        spec,
    };
    if plan.row_groups.is_empty() {
        return Ok(reader);
    }
    let mut relative = Vec::with_capacity(plan.ranges.len());
    let mut base = 0u64;
    let mut selected_rows = 0u64;
    let mut ranges = plan.ranges.iter().peekable();
    for &g in &plan.row_groups {
        let (lo, n) = (starts[g], md.row_group(g).num_rows() as u64);
        while let Some(r) = ranges.next_if(|r| r.start < lo + n) {
            relative.push((r.start - lo + base) as usize..(r.end - lo + base) as usize);
        }
        base += n;
        selected_rows += n;
    }
    let kept: u64 = plan.ranges.iter().map(|r| r.end - r.start).sum();
    let (rows, _) = batch_rows_for(&md, &plan.row_groups, &read, metadata.schema(), reader.spec.batch_rows, reader.spec.batch_bytes);
    if let Some(groups) = groups {
        reader.inner = Some(Decode::Grouped(Box::new(GroupedReader {
            path: path.to_path_buf(),
            file,
            metadata,
            groups,
            pending: Cursor { ranges: plan.ranges, at: 0, offset: 0 },
            starts,
            row_groups: plan.row_groups,
            batch_rows: rows,
        })));
        return Ok(reader);
    }
    let mut builder = ParquetRecordBatchReaderBuilder::new_with_metadata(file, metadata)
        .with_batch_size(rows)
        .with_projection(ProjectionMask::roots(md.file_metadata().schema_descr(), read.iter().copied()));
    if plan.row_groups.len() < md.num_row_groups() {
        builder = builder.with_row_groups(plan.row_groups.clone());
    }
    if kept < selected_rows {
        builder = builder.with_row_selection(RowSelection::from_consecutive_ranges(relative.into_iter(), selected_rows as usize));
    }
    reader.inner = Some(Decode::Whole(builder.build()?));
    Ok(reader)
}

/// Pages per column chunk the writers here produce at most rows or bytes of: parquet's
/// `DEFAULT_DATA_PAGE_ROW_COUNT_LIMIT` (20,000 rows) and `DEFAULT_PAGE_SIZE` (1 MiB), which
/// [`WriteOptions`] leaves as they are.
const PAGE_ROWS: u64 = 20_000;
const PAGE_BYTES: u64 = 1 << 20;
/// The read buffer parquet's page reader takes for a page's header (`BufReader`'s default
/// over a `File`): made for each page read and dropped with it, so one at a time.
const PAGE_HEADER_BUFFER: u64 = 8 << 10;
/// A column reader's own state besides its pages (parquet 59's array reader, record reader,
/// decoders and page locations), per column read: 4 KiB. Measured (a fresh-clone trial of
/// 2026-12-06, jemalloc's `allocated` against the scan's count): 1.7–2.3 KB a column went
/// uncounted for 2,000 and 5,000 `Int64` columns once the header buffer was counted once a
/// reader instead of once a column (it had covered this state before).
const COLUMN_READER_BYTES: u64 = 4 << 10;

/// Bytes [`row_memory_bytes`] adds to a row's own figures: the column readers, page header
/// buffers and fixed-width columns of a scan, and the writer's state in a flush (64 KiB;
/// the measurements below needed 19–64 KiB).
const ROW_MEMORY_SLACK: usize = 64 << 10;

/// Bytes of memory a row needs for a full scan to read it back, a flush to write it and an
/// open to rebuild its key index, when the largest of its string and binary values is
/// `largest` bytes, all of them together `values` bytes (the largest included), those of its
/// key columns `key_values` bytes, and its primary key encodes to `key` bytes (Arrow's row
/// format, as the key index holds it): the largest of
/// - a scan: `4 × largest + values + key`. The reader holds the column with the largest value
///   about four times (a decoded page; the dictionary page stored and decoded, as parquet's
///   writer puts a chunk's first values in a dictionary however long; the page compressed
///   while it is read, incompressible text gaining nothing from LZ4) and reads the other
///   columns one after another; the batch it hands out holds every value once; the key index
///   holds the key;
/// - a flush: `2 × values + 3 × key`. The row (its values and its encoded key) is in a row
///   block and again in the Arrow batch being written, and the key enters the file's key
///   index;
/// - an open: `4 × key_values + 2 × key`. Rebuilding a file's key index reads its key
///   columns (pages and dictionaries of each, the batch out), encodes the keys and holds
///   the index being built. Measured (helper-45): a key of two or three string columns at
///   the bound of the first two terms was written and read back, but the data directory did
///   not reopen at the same limit: its rebuild needed about 5.4 × the encoded key (11.1 ×
///   each of two columns' values; this term gives 12.1 ×);
///
/// plus 64 KiB. Measured (2026-12-07, rows of random letters of 20 KB – 5 MB, the smallest
/// limit under which the row was written, flushed, read by a full scan, flushed beside another
/// write, and read again after a reopen, by bisection to 4 KiB): one value 5.03–5.20 × +
/// 19–29 KiB up to 1 MB, less above 1 MiB (split into pages); two values `v` each 6.0–6.2 `v`
/// up to 1 MB (the scan: `4v + 2v`); a string key alone 6.1–6.2 × (the scan, `5k + k`) up to
/// 1 MB and 5.09 × from 2 MB (the flush, `2k + 3 × 1.03k`: the row format spends one byte in 32
/// on a string); a string key and a value of its size 7.1 × (the flush, `4v + 3 × 1.03v`) at
/// every size from 300 KB. Before, a 300 KB string was written and flushed at 1 MiB and read
/// by no scan under that limit (helper-41), and a 406 KB key at 2 MiB broke the table's scans,
/// flushes and reopens at that limit (helper-44).
pub fn row_memory_bytes(largest: usize, values: usize, key_values: usize, key: usize) -> usize {
    let scan = largest.saturating_mul(4).saturating_add(values).saturating_add(key);
    let flush = values.saturating_mul(2).saturating_add(key.saturating_mul(3));
    let open = key_values.saturating_mul(4).saturating_add(key.saturating_mul(2));
    scan.max(flush).max(open).saturating_add(ROW_MEMORY_SLACK)
}

/// The largest string or binary value outside the key a row may hold for
/// [`row_memory_bytes`] to stay within `budget` bytes, when its other such values are `rest`
/// bytes together, those of its key columns `key_values`, and its key encodes to `key` bytes:
/// the smaller of `(budget − 64 KiB − rest − key) / 5` and `(budget − 64 KiB − 2 × rest − 3 ×
/// key) / 2`; 0 when nothing fits, the open's `4 × key_values + 2 × key` included.
pub fn largest_value_within(budget: usize, rest: usize, key_values: usize, key: usize) -> usize {
    let b = budget.saturating_sub(ROW_MEMORY_SLACK);
    if key_values.saturating_mul(4).saturating_add(key.saturating_mul(2)) > b {
        return 0;
    }
    let scan = b.saturating_sub(rest.saturating_add(key)) / 5;
    let flush = b.saturating_sub(rest.saturating_mul(2).saturating_add(key.saturating_mul(3))) / 2;
    scan.min(flush)
}

/// The largest single string or binary value a scan reads back under a memory limit of
/// `limit` bytes when nothing else holds memory and the row has no other such value (its key
/// counted as no bytes): `(limit − 64 KiB) / 5` bytes ([`largest_value_within`]`(limit, 0,
/// 0, 0)`; 196,608 B at 1 MiB). A write refuses a row whose [`row_memory_bytes`] do not fit
/// beside the tables' key indexes, which for one value beside an `Int64` key (9 bytes
/// encoded) is 2 bytes less: 196,606 B at 1 MiB (`gritdb::Error::ValueTooLarge`).
pub fn largest_readable_value(limit: usize) -> usize {
    largest_value_within(limit, 0, 0, 0)
}

/// Bytes a Parquet reader of the columns `read` of `row_groups` holds besides the batches it
/// returns, estimated from the file's metadata: per leaf column, one decoded data page (the
/// chunk's uncompressed bytes over its page count, the larger of rows / 20,000 and bytes /
/// 1 MiB), its dictionary page as stored (the bytes between the dictionary and the first
/// data page offsets) and decoded (the page header's `uncompressed_page_size`, read by
/// [`DictionaryPages::read`]; failing that, the stored bytes times the chunk's uncompressed /
/// compressed ratio) and [`COLUMN_READER_BYTES`] of reader state; once, for the column that
/// needs most, a data page's compressed copy while it is decompressed (the compressed bytes
/// over the same count) and the 8 KiB header buffer; the largest row group's sum.
/// The page reader of parquet 59 (`SerializedPageReader` over a `File`) reads a chunk one
/// page at a time, so this is what an open reader holds between batches; the compressed copy
/// and the header buffer live only while one page is read (`get_read`, `get_bytes` and
/// `decode_page` in one call), and the reader decodes its columns one after another. Before,
/// they were counted for every column: 1.6 MB of header buffers alone for a 200-column file,
/// which then did not scan at the 2 MiB limit it was written under. Measured on TPC-H
/// lineitem (16 columns, 8,192-row batches, jemalloc `allocated` less accounted bytes): an open
/// scan held 2.3–4.1 MB outside the engine's figures before it was counted.
pub(crate) fn reader_buffer_bytes(
    md: &parquet::file::metadata::ParquetMetaData,
    row_groups: &[usize],
    read: &[usize],
    dictionaries: &DictionaryPages,
) -> usize {
    let descr = md.file_metadata().schema_descr();
    row_groups
        .iter()
        .map(|&g| {
            let rg = md.row_group(g);
            let mut held = 0u64;
            let mut transient = None;
            for leaf in (0..rg.num_columns()).filter(|&leaf| read.binary_search(&descr.get_column_root_idx(leaf)).is_ok()) {
                let (h, t) = leaf_reader_bytes(md, g, leaf, dictionaries);
                held = held.saturating_add(h);
                transient = Some(transient.map_or(t, |m: u64| m.max(t)));
            }
            // A reader that reads no column of the group reads no page of it.
            transient.map_or(held, |t| held.saturating_add(t).saturating_add(PAGE_HEADER_BUFFER))
        })
        .max()
        .map_or(0, |b| usize::try_from(b).unwrap_or(usize::MAX))
}

/// What a reader of leaf column `leaf` of row group `g` holds, as [`reader_buffer_bytes`]
/// counts it: `(held, transient)` bytes — held between batches (a decoded page, the
/// dictionary page stored and decoded, [`COLUMN_READER_BYTES`]), and a page's compressed
/// copy, held only while that page is read.
fn leaf_reader_bytes(md: &parquet::file::metadata::ParquetMetaData, g: usize, leaf: usize, dictionaries: &DictionaryPages) -> (u64, u64) {
    let rg = md.row_group(g);
    let rows = u64::try_from(rg.num_rows()).unwrap_or(0).max(1);
    let bytes = |v: i64| u64::try_from(v).unwrap_or(0);
    let c = rg.column(leaf);
    let (unc, comp) = (bytes(c.uncompressed_size()), bytes(c.compressed_size()));
    let pages = (rows.div_ceil(PAGE_ROWS)).max(unc.div_ceil(PAGE_BYTES)).max(1);
    // The dictionary page as stored (the bytes before the first data page) and decoded: its
    // header's own uncompressed size when it was read, else the stored size at the chunk's
    // compression ratio; at most the whole chunk.
    let stored = c.dictionary_page_offset().map_or(0, |d| bytes(c.data_page_offset() - d));
    let decoded = dictionaries.uncompressed(g, leaf).unwrap_or_else(|| stored.saturating_mul(unc) / comp.max(1));
    let dict = if stored == 0 { 0 } else { (stored + decoded).min(unc + stored) };
    (unc.div_ceil(pages) + dict + COLUMN_READER_BYTES, comp.div_ceil(pages))
}

/// `read` (root columns, ascending) cut into runs of consecutive columns, each of which a
/// reader of `row_groups` holds at most `budget` bytes for ([`reader_buffer_bytes`]; a
/// column that alone needs more is a run of its own). A run's figure is taken as the sum over
/// its columns of each column's largest row group, plus the largest compressed page and the
/// header buffer: never less than [`reader_buffer_bytes`] of the run, which takes the largest
/// row group's sum.
pub(crate) fn column_groups(
    md: &parquet::file::metadata::ParquetMetaData,
    row_groups: &[usize],
    read: &[usize],
    dictionaries: &DictionaryPages,
    budget: usize,
) -> Vec<Vec<usize>> {
    let descr = md.file_metadata().schema_descr();
    // (held, transient) of each column of `read`: the largest over the row groups.
    let mut cost = vec![(0u64, 0u64); read.len()];
    for &g in row_groups {
        let mut in_group = vec![(0u64, 0u64); read.len()];
        for leaf in 0..md.row_group(g).num_columns() {
            if let Ok(at) = read.binary_search(&descr.get_column_root_idx(leaf)) {
                let (h, t) = leaf_reader_bytes(md, g, leaf, dictionaries);
                in_group[at] = (in_group[at].0.saturating_add(h), in_group[at].1.max(t));
            }
        }
        for (c, (h, t)) in cost.iter_mut().zip(in_group) {
            *c = (c.0.max(h), c.1.max(t));
        }
    }
    let budget = u64::try_from(budget).unwrap_or(u64::MAX);
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let (mut held, mut transient) = (0u64, 0u64);
    for (&column, &(h, t)) in read.iter().zip(&cost) {
        let (with_held, with_transient) = (held.saturating_add(h), transient.max(t));
        match groups.last_mut() {
            Some(group) if with_held.saturating_add(with_transient).saturating_add(PAGE_HEADER_BUFFER) <= budget => {
                group.push(column);
                (held, transient) = (with_held, with_transient);
            }
            _ => {
                groups.push(vec![column]);
                (held, transient) = (h, t);
            }
        }
    }
    groups
}

/// The uncompressed sizes (bytes) of the dictionary pages of some column chunks of one file,
/// read from the pages' own headers, for [`reader_buffer_bytes`]. The footer has no such
/// size: a column chunk's metadata gives where its dictionary page starts and where its data
/// pages start, so only the page's stored size. Scaling that by the chunk's compression ratio
/// is wrong whenever the dictionary compresses unlike the data pages: a chunk of long,
/// repetitive values that `LZ4_RAW` stores at 1/200 of their size, beside a dictionary of
/// short distinct strings, was estimated at 200× its dictionary (the breaker tests
/// `a_row_group_of_skewed_widths_scans_at_8_mib` and
/// `a_wide_tail_in_binary_and_view_columns_scans_exactly`).
#[derive(Debug, Default)]
pub(crate) struct DictionaryPages {
    /// `((row group, leaf column), uncompressed page bytes)`, sorted.
    sizes: Vec<((usize, usize), u64)>,
}

impl DictionaryPages {
    /// Reads the header of the dictionary page of each column chunk of `row_groups` whose
    /// root column is in `read` (sorted): one positioned read of at most
    /// [`DICTIONARY_HEADER_PEEK`] bytes per dictionary page. A header that cannot be read or
    /// is not as [`dictionary_page_uncompressed`] expects is left out, and the estimate
    /// stands for it.
    pub(crate) fn read(file: &fs::File, md: &parquet::file::metadata::ParquetMetaData, row_groups: &[usize], read: &[usize]) -> Self {
        use std::os::unix::fs::FileExt;
        let descr = md.file_metadata().schema_descr();
        let mut sizes = Vec::new();
        let mut head = [0u8; DICTIONARY_HEADER_PEEK];
        for &g in row_groups {
            let rg = md.row_group(g);
            for leaf in (0..rg.num_columns()).filter(|&leaf| read.binary_search(&descr.get_column_root_idx(leaf)).is_ok()) {
                let c = rg.column(leaf);
                let Some(at) = c.dictionary_page_offset().and_then(|d| u64::try_from(d).ok()) else { continue };
                let Ok(stored) = u64::try_from(c.data_page_offset()).map(|d| d.saturating_sub(at)) else { continue };
                let want = head.len().min(usize::try_from(stored).unwrap_or(usize::MAX));
                if file.read_exact_at(&mut head[..want], at).is_ok()
                    && let Some(size) = dictionary_page_uncompressed(&head[..want], stored)
                {
                    sizes.push(((g, leaf), size));
                }
            }
        }
        sizes.sort_unstable();
        Self { sizes }
    }

    /// The uncompressed bytes of the dictionary page of `leaf` in row group `g`, when read.
    fn uncompressed(&self, g: usize, leaf: usize) -> Option<u64> {
        self.sizes.binary_search_by_key(&(g, leaf), |&(k, _)| k).ok().map(|i| self.sizes[i].1)
    }
}

/// Bytes read at a dictionary page's start for its header. The three fields read are at
/// most 16 bytes (a field byte and a varint of at most 5 bytes each).
const DICTIONARY_HEADER_PEEK: usize = 16;

/// The uncompressed size in bytes of a dictionary page, from the first bytes of its
/// Thrift compact-protocol `PageHeader` (parquet-format `parquet.thrift`: field 1 `type`,
/// 2 `uncompressed_page_size`, 3 `compressed_page_size`, each a required `i32`, which
/// arrow-rs, parquet-java and `DuckDB` all write first and in that order, each as the field
/// byte `0x15`, delta 1 and type `i32`, then a zigzag varint). `stored` is the page's
/// stored bytes, header included. None unless the three fields are there, the type is
/// `DICTIONARY_PAGE` (2), and the compressed size leaves room in `stored` for the bytes
/// parsed; the parquet crate keeps its own header parser private.
fn dictionary_page_uncompressed(head: &[u8], stored: u64) -> Option<u64> {
    const DICTIONARY_PAGE: i32 = 2;
    let mut at = 0usize;
    let mut field = || -> Option<i32> {
        if *head.get(at)? != 0x15 {
            return None;
        }
        at += 1;
        let mut n = 0u32;
        for shift in (0..35).step_by(7) {
            let b = *head.get(at)?;
            at += 1;
            n |= u32::from(b & 0x7f).checked_shl(shift)?;
            if b & 0x80 == 0 {
                return Some((n >> 1) as i32 ^ -((n & 1) as i32));
            }
        }
        None
    };
    let (kind, uncompressed, compressed) = (field()?, field()?, field()?);
    let (uncompressed, compressed) = (u64::try_from(uncompressed).ok()?, u64::try_from(compressed).ok()?);
    (kind == DICTIONARY_PAGE && compressed.saturating_add(at as u64) <= stored).then_some(uncompressed)
}

/// Rows decoded per batch, and the bytes such a batch is estimated to take decoded:
/// `batch_rows`, fewer when `batch_bytes` (non-zero) less [`column_fixed_bytes`] of each column read
/// over the read columns' bytes per row is fewer — per column the largest of the chunk's
/// average, its densest page ([`densest_page`]) and its Arrow type's fixed width
/// (`schema`: the file's Arrow schema), the largest row group's sum among `row_groups`. At
/// least 1 row. The estimate is the rows (at most those of `row_groups` together) times that
/// figure plus the fixed bytes.
fn batch_rows_for(
    md: &parquet::file::metadata::ParquetMetaData,
    row_groups: &[usize],
    read: &[usize],
    schema: &arrow_schema::Schema,
    batch_rows: usize,
    batch_bytes: usize,
) -> (usize, usize) {
    let batch_rows = batch_rows.max(1);
    let descr = md.file_metadata().schema_descr();
    let width = |leaf: usize| {
        let root = descr.get_column_root_idx(leaf);
        // A value's decoded width whatever its encoding: a column of one repeated or null
        // value is stored in a few bytes a page but decodes to its full width a row (5,000
        // all-null `Int64` columns: 40 KB a row decoded, none stored). A boolean counts a
        // byte, a validity bit is left in the rounding.
        schema.fields().get(root).map_or(0, |f| f.data_type().primitive_width().unwrap_or(1))
    };
    let per_row = row_groups
        .iter()
        .map(|&g| {
            let rg = md.row_group(g);
            // A byte-array column's decoded size is its values' bytes (the size statistics'
            // unencoded bytes, when written) plus up to a 16-byte view per row, whatever its
            // encoding: a dictionary-encoded chunk's uncompressed size counts only its indices
            // and one dictionary page.
            let rows = rg.num_rows().max(1);
            let pages = md.offset_index().and_then(|o| o.get(g));
            (0..rg.num_columns())
                .filter(|&leaf| read.binary_search(&descr.get_column_root_idx(leaf)).is_ok())
                .map(|leaf| {
                    let c = rg.column(leaf);
                    let values = c.unencoded_byte_array_data_bytes().map_or(0, |b| b.saturating_add(16 * rows));
                    let average = c.uncompressed_size().max(values).saturating_add(rows - 1) / rows;
                    let densest = pages.and_then(|p| p.get(leaf)).map_or(0, |o| densest_page(o, rows));
                    average.max(densest).max(i64::try_from(width(leaf)).unwrap_or(i64::MAX))
                })
                .sum::<i64>()
        })
        .max()
        .map_or(1, |b| usize::try_from(b).unwrap_or(usize::MAX).max(1));
    let fixed = read.iter().map(|&c| schema.fields().get(c).map_or(0, |f| column_fixed_bytes(f.data_type()))).fold(0, usize::saturating_add);
    let rows = if batch_bytes == 0 { batch_rows } else { batch_rows.min((batch_bytes.saturating_sub(fixed) / per_row).max(1)) };
    // No batch holds more rows than the row groups read.
    let most: u64 = row_groups.iter().map(|&g| u64::try_from(md.row_group(g).num_rows()).unwrap_or(0)).sum();
    let decoded = rows.min(usize::try_from(most).unwrap_or(usize::MAX));
    (rows, decoded.saturating_mul(per_row).saturating_add(fixed))
}

/// Bytes a decoded column of type `dt` takes whatever its row count, counted as the engine
/// counts a batch it hands out (`count_batch`), so that a batch planned to fit `batch_bytes`
/// is counted within it: each of its buffers (a value and a validity buffer; a byte array's
/// offsets too, a view array's data buffer) allocated in 64-byte multiples (Arrow's
/// `MutableBuffer` alignment: one row of 5,000 columns takes 640 KB of buffers, not 40 KB),
/// its re-pointed handle ([`crate::HELD_BUFFER_BYTES`]) and its owner
/// ([`crate::HELD_ALLOCATION_BYTES`]), and the array itself ([`crate::held_array_bytes`] of
/// the largest array struct). 720 bytes for an `Int64` column, 992 for a `Utf8` one; 128
/// (the buffers alone) before the engine counted its bookkeeping, when 5,000 all-null
/// `Int64` columns held as a one-row batch took 13.8 MB for 6.3 MB counted.
fn column_fixed_bytes(dt: &arrow_schema::DataType) -> usize {
    use arrow_schema::DataType as D;
    let buffers = match dt {
        D::Utf8 | D::LargeUtf8 | D::Binary | D::LargeBinary | D::Utf8View | D::BinaryView => 3,
        _ => 2,
    };
    buffers * (BUFFER_ALIGNMENT + crate::HELD_BUFFER_BYTES + crate::HELD_ALLOCATION_BYTES) + crate::held_array_bytes(crate::MAX_ARRAY_STRUCT_BYTES)
}

/// Arrow's `MutableBuffer` allocates in multiples of this many bytes.
const BUFFER_ALIGNMENT: usize = 64;

/// The largest unencoded value bytes per row (plus a 16-byte view) of any page of a byte-array
/// column chunk, from its offset index (Parquet page index: `unencoded_byte_array_data_bytes`
/// per page, rows per page from `first_row_index`); 0 without those sizes. The chunk's
/// average is blind to rows of very unequal width: 20,000 rows of 20 bytes and then 500 of
/// 40 KB average 1 KB a row, and a batch sized by it from the wide tail decodes 40 times its
/// budget (`breaker_slices::a_row_group_of_skewed_widths_scans_at_16_mib`).
fn densest_page(index: &parquet::file::page_index::offset_index::OffsetIndexMetaData, rows: i64) -> i64 {
    let (Some(sizes), locations) = (index.unencoded_byte_array_data_bytes(), index.page_locations()) else { return 0 };
    if sizes.len() != locations.len() {
        return 0;
    }
    locations
        .iter()
        .enumerate()
        .map(|(p, l)| {
            let end = locations.get(p + 1).map_or(rows, |n| n.first_row_index);
            let page_rows = (end - l.first_row_index).max(1);
            (sizes[p].max(0).saturating_add(page_rows - 1) / page_rows).saturating_add(16)
        })
        .max()
        .unwrap_or(0)
}

/// File row numbers of the rows a reader yields, in order.
#[derive(Debug)]
pub(crate) struct Cursor {
    ranges: Vec<std::ops::Range<u64>>,
    at: usize,
    offset: u64,
}

impl Cursor {
    /// The file row of the next row the reader yields (the end of the last range when it is
    /// done; 0 when there is none).
    fn position(&self) -> u64 {
        match self.ranges.get(self.at) {
            Some(r) => r.start + self.offset,
            None => self.ranges.last().map_or(0, |r| r.end),
        }
    }

    /// The next `n` file rows as `(first row, count)` runs.
    pub(crate) fn take(&mut self, mut n: u64, out: &mut Vec<(u64, u64)>) {
        out.clear();
        while n > 0 && self.at < self.ranges.len() {
            let r = &self.ranges[self.at];
            let start = r.start + self.offset;
            let len = (r.end - start).min(n);
            out.push((start, len));
            n -= len;
            self.offset += len;
            if r.start + self.offset == r.end {
                self.at += 1;
                self.offset = 0;
            }
        }
    }
}

/// The batches of one data file ([`read_file_with`]): an iterator of
/// `Result<RecordBatch, StorageError>`.
pub struct FileReader {
    /// The data file (named in errors).
    path: std::path::PathBuf,
    inner: Option<Decode>,
    /// `reader_buffer_bytes` of what this reader reads (of its largest column group, when
    /// decoded in groups).
    buffer_bytes: usize,
    /// Whether the metadata kept holds the column index (page pruning).
    column_index: bool,
    cursor: Cursor,
    /// The file row of the first row decoded for the batch returned last ([`Self::resume_row`]).
    returned_from: u64,
    /// Table column -> column of the decoded batch.
    position: Vec<usize>,
    /// Decoded columns in output order (`None`: the decoded order is the output order).
    out_positions: Option<Vec<usize>>,
    spec: ReadSpec,
}

/// How a [`FileReader`] decodes its columns.
enum Decode {
    /// One Parquet reader of every column read, open for as long as the file is read.
    Whole(ParquetRecordBatchReader),
    /// A reader per column group for each batch ([`ReadSpec::decode_budget`]).
    Grouped(Box<GroupedReader>),
}

impl Decode {
    fn next(&mut self) -> Option<Result<RecordBatch, StorageError>> {
        match self {
            Self::Whole(r) => r.next().map(|b| b.map_err(StorageError::Arrow)),
            Self::Grouped(g) => g.next_batch().transpose(),
        }
    }
}

impl std::fmt::Debug for FileReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileReader").field("spec", &self.spec).finish_non_exhaustive()
    }
}

impl FileReader {
    /// Bytes this reader holds besides the batches it returns, estimated from the file's
    /// metadata (0 when no row group is read). Per leaf column read: one decoded data page
    /// (the chunk's uncompressed bytes over its page count, the larger of rows / 20,000 and
    /// bytes / 1 MiB: parquet's default page limits, which [`WriteOptions`] keeps), the
    /// dictionary page as stored and decoded, and 4 KiB of column reader state; once, the
    /// largest compressed page and an 8 KiB header buffer; the largest row group's sum — of
    /// the largest column group when the columns are decoded in groups
    /// ([`ReadSpec::decode_budget`]); plus the file's metadata the reader keeps, with the page
    /// index when it was loaded (`ParquetMetaData::memory_size`). Callers count it while the
    /// reader is open.
    pub fn buffer_bytes(&self) -> usize {
        if self.inner.is_some() { self.buffer_bytes } else { 0 }
    }

    /// Where a reader reopened with the same spec ([`ReadSpec::resume_at`]) yields the batch
    /// this one returned last again, and then what follows it: the file row number of the
    /// first row decoded for that batch (rows before it were returned or dropped by the
    /// deletion vector or the filter). Before the first batch, the row the reader started at.
    /// A caller that could not keep the last batch (its memory was refused) drops this reader
    /// and its buffers and reopens there later, losing no row and returning none twice.
    pub fn resume_row(&self) -> u64 {
        self.returned_from
    }

    /// True when this reader keeps the file's column index, so its filter prunes pages (the
    /// file has the index and [`ReadSpec::pruning_budget`] allowed it).
    pub fn prunes_pages(&self) -> bool {
        self.inner.is_some() && self.column_index
    }

    fn filter(&mut self, b: &RecordBatch) -> Result<Option<RecordBatch>, StorageError> {
        let n = b.num_rows() as u64;
        if let Some(c) = &self.spec.counters {
            c.add_decoded(n);
        }
        let mut runs = Vec::new();
        self.cursor.take(n, &mut runs);
        let deleted = &self.spec.deleted;
        let mut keep: Option<BooleanBuffer> = None;
        if runs.iter().any(|&(s, l)| deleted.range_cardinality(s as u32..(s + l) as u32) > 0) {
            let mut bits = BooleanBufferBuilder::new(n as usize);
            for &(s, l) in &runs {
                if deleted.range_cardinality(s as u32..(s + l) as u32) == 0 {
                    bits.append_n(l as usize, true);
                } else {
                    for r in s..s + l {
                        bits.append(!deleted.contains(r as u32));
                    }
                }
            }
            keep = Some(bits.finish());
        }
        if let Some(f) = &self.spec.filter {
            let pos = &self.position;
            let m = f.evaluate(b, &|c| pos[c])?;
            keep = Some(match keep {
                Some(k) => &k & &m,
                None => m,
            });
        }
        let b = match keep {
            Some(k) => match keep_rows(b, k)? {
                Some(b) => b,
                None => return Ok(None),
            },
            None => b.clone(),
        };
        Ok(Some(match &self.out_positions {
            Some(p) => b.project(p)?,
            None => b,
        }))
    }
}

impl Iterator for FileReader {
    type Item = Result<RecordBatch, StorageError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let from = self.cursor.position();
            let inner = self.inner.as_mut()?;
            let b = match parquet_guard(&self.path, || Ok(inner.next())) {
                Ok(None) => return None,
                Ok(Some(Ok(b))) => b,
                Ok(Some(Err(e))) => return Some(Err(e)),
                Err(e) => {
                    // A reader whose decoder panicked is in no state to go on.
                    self.inner = None;
                    return Some(Err(e));
                }
            };
            match self.filter(&b) {
                Ok(Some(b)) => {
                    self.returned_from = from;
                    return Some(Ok(b));
                }
                Ok(None) => {}
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

/// The Parquet writer's sink: remembers the last I/O error, because Parquet reports some of
/// them only as text ("fail to get inner writer: ...").
struct Recording {
    inner: Box<dyn crate::vfs::VfsFile>,
    seen: Arc<Seen>,
    /// Checked before every call into the file layer.
    cancel: CancelToken,
    /// CRC-32 of the bytes written so far (the file is written front to back, once).
    crc: crc32fast::Hasher,
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
        self.cancel.check().inspect_err(|e| self.note(e))?;
        let n = self.inner.write(buf).inspect_err(|e| self.note(e))?;
        self.crc.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush().inspect_err(|e| self.note(e))
    }
}

type Seen = std::sync::Mutex<Option<(std::io::ErrorKind, Option<i32>, String)>>;

/// Turns a Parquet error caused by the sink back into [`StorageError::Io`] (with the path),
/// so ENOSPC and EIO read as what they are.
fn parquet_io(e: ParquetError, path: &Path, seen: &Seen) -> StorageError {
    if let ParquetError::External(inner) = e {
        return match inner.downcast::<std::io::Error>() {
            Ok(io_err) => StorageError::Io { path: path.to_path_buf(), source: *io_err },
            Err(other) => StorageError::Parquet(ParquetError::External(other)),
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

#[cfg(test)]
#[path = "write_tests.rs"]
mod tests;
