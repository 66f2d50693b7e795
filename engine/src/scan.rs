use crate::error::{Error, Result};
use crate::table::TableInner;
use arrow_array::{BooleanArray, RecordBatch};
use arrow_buffer::{BooleanBuffer, Buffer, NullBuffer};
use arrow_data::ArrayData;
use arrow_select::filter::filter_record_batch;
use gritdb_memctl::{Category, MemoryController, MemoryError, Reservation, TableAccount};
use gritdb_storage::{
    BoundFilter, FileReader, FileScan, FilterError, ReadSpec, ScanCounters, ScanFilter, ScanMetrics, ScanSource, StorageError, filter_batch, read_file_within,
};
use std::collections::HashMap;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

/// What a scan reads: columns, a predicate, batch size.
#[derive(Debug, Clone)]
pub struct ScanOptions {
    projection: Option<Vec<String>>,
    filter: Option<ScanFilter>,
    batch_rows: usize,
}

impl Default for ScanOptions {
    fn default() -> Self {
        Self { projection: None, filter: None, batch_rows: 8192 }
    }
}

impl ScanOptions {
    /// Only these columns, in this order (default: all columns), each named exactly as in the
    /// schema (case-sensitive).
    #[must_use]
    pub fn projection<I, S>(mut self, columns: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.projection = Some(columns.into_iter().map(Into::into).collect());
        self
    }

    /// Only rows for which `filter` is true (SQL semantics: a comparison with null is not
    /// true), from files and in-memory deltas alike. Data files skip row groups and pages
    /// whose Parquet statistics prove no row matches ([`Scan::metrics`] counts them); the
    /// rest is filtered row by row, so the result is exact. Filter columns need not be in
    /// the projection. Replaces an earlier filter. Floats compare as `PostgreSQL` and `DuckDB`
    /// compare them, and as float keys are identified ([`crate::Engine::create_table`]):
    /// −0.0 = 0.0, every NaN (any sign or payload) equals every other NaN, and NaN is above
    /// every number. (SQL through `DataFusion` differs on NaNs: see `docs/sql.md`.)
    ///
    /// [`Table::scan`](crate::Table::scan) returns [`Error::ColumnNotFound`] for an unknown
    /// filter column and [`Error::InvalidFilter`] for a literal that cannot be compared with
    /// its column.
    #[must_use]
    pub fn filter(mut self, filter: ScanFilter) -> Self {
        self.filter = Some(filter);
        self
    }

    /// Largest batch returned, in rows (default 8,192; at least 1: `0` is taken as 1).
    #[must_use]
    pub fn batch_rows(mut self, rows: usize) -> Self {
        self.batch_rows = rows.max(1);
        self
    }
}

/// Largest snapshot batch of a delta, in encoded row bytes (keeps string offsets far from
/// `i32::MAX`).
const SNAPSHOT_BATCH_BYTES: usize = 256 << 20;

/// A streaming scan over one snapshot: an iterator of `Result<RecordBatch>`.
///
/// The snapshot is taken when the scan is created: in-memory deltas are copied into
/// batch blocks counted under `scan_buffers` (released when the batches are dropped), file
/// lists and deletion vectors are cloned; files are then read one batch of `batch_rows` at a
/// time (never a whole row group). Every batch handed out — decoded from a file or copied out
/// of a delta — counts under `scan_buffers` (and the table's figures) for as long as the
/// caller holds any array of it; when that memory cannot be had, `next` waits up to
/// `backpressure_timeout` for releases and then yields [`Error::MemoryLimit`]. Such a refusal
/// loses nothing and holds nothing: the refused batch is what the next call returns, and an
/// open file reader is closed with its buffers (reopened at the same file row,
/// [`gritdb_storage::FileReader::resume_row`], when the scan goes on), so a refused scan the
/// caller keeps does not hold memory writers need. Any other error — a data file that could
/// not be opened or read (`StorageError::MissingFile` when it was removed outside the engine,
/// `StorageError::CorruptFile` when damaged), a table dropped under the scan — ends the scan:
/// later calls return `None`, so no call after an error returns rows as if the scan were
/// whole (a caller that drains a scan's errors is not looped forever either); a new scan
/// reads the table again.
pub struct Scan {
    table: std::sync::Arc<TableInner>,
    /// Asked to flush (seal the largest deltas) when a batch's memory cannot be had: waiting
    /// alone frees nothing while the memory is in deltas no write is pushing out.
    engine: std::sync::Arc<crate::engine::EngineInner>,
    /// In-memory batches to return, every byte counted under `scan_buffers` while queued:
    /// slices of snapshot blocks, or copies (rows a filter kept, columns of a projection)
    /// counted when they were made.
    memory: VecDeque<RecordBatch>,
    files: VecDeque<FileScan>,
    /// Set when the front of `files` is a file a refused reader was reading: the file row
    /// its reopened reader starts at ([`ReadSpec::resume_at`]).
    resume_at: Option<u64>,
    /// The open file reader, with the file it reads (path, deletion vector, and the guard that
    /// keeps the file on disk) for a reopen.
    current: Option<(FileReader, FileScan)>,
    /// The open file reader's metadata and own buffers (pages, dictionaries) under
    /// `scan_buffers`, while `current` is open ([`gritdb_storage::FileReader::buffer_bytes`]):
    /// grown step by step while the file is opened, before each step's allocation
    /// ([`gritdb_storage::read_file_within`]). A refusal there puts the file back to be opened
    /// again by the next call; when a decoded batch's reservation is refused (after the wait),
    /// the reader is closed and its file put back to be reopened where the refused batch
    /// starts.
    reader_buffers: Option<Reservation>,
    projection: Option<Vec<usize>>,
    filter: Option<Arc<BoundFilter>>,
    counters: Arc<ScanCounters>,
    batch_rows: usize,
    /// This scan's share of each data file's row groups ([`ReadSpec::partition`]) when it is
    /// one of [`crate::Table::scan_partitions`]; `None`: all of them.
    partition: Option<(usize, usize)>,
    /// Set once a wait to leave flush room ([`Self::waiting_for_memory`]) found nothing to
    /// flush or ran out its `backpressure_timeout`: from then on the hard limit alone decides
    /// for this scan, so a flush that cannot proceed costs the scan one timeout, not one per
    /// batch.
    flush_room_given_up: std::sync::atomic::AtomicBool,
    /// Set by an error other than `MemoryLimit`: the scan returns nothing more.
    failed: bool,
}

impl std::fmt::Debug for Scan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scan").field("memory_batches", &self.memory.len()).field("files", &self.files.len()).finish_non_exhaustive()
    }
}

impl Scan {
    pub(crate) fn new(inner: &std::sync::Arc<TableInner>, engine: &std::sync::Arc<crate::engine::EngineInner>, options: &ScanOptions) -> Result<Self> {
        let schema = inner.codec.schema();
        let projection = match &options.projection {
            None => None,
            Some(cols) => Some(
                cols.iter()
                    .map(|c| schema.index_of(c).map_err(|_| Error::ColumnNotFound { table: inner.name.clone(), column: c.clone() }))
                    .collect::<Result<Vec<_>>>()?,
            ),
        };
        let filter = match &options.filter {
            None => None,
            Some(f) => Some(Arc::new(f.bind(schema).map_err(|e| match e {
                FilterError::ColumnNotFound { column } => Error::ColumnNotFound { table: inner.name.clone(), column },
                source => Error::InvalidFilter { table: inner.name.clone(), source },
            })?)),
        };
        let g = inner.state()?;
        let st = g.as_ref().ok_or_else(|| Error::TableNotFound { name: inner.name.clone() })?;
        let mut memory = Vec::new();
        // Each snapshot batch gets its own exactly sized block: a batch the caller keeps holds
        // nothing but itself.
        let (rows, bytes) = (options.batch_rows, SNAPSHOT_BATCH_BYTES);
        memory.extend(st.active.to_batches(Category::ScanBuffers, false, rows, bytes, |_| true)?.puts);
        for k in (0..st.sealed.len()).rev() {
            let newer = st.sealed.range(k + 1..);
            let b = st.sealed[k]
                .to_batches(Category::ScanBuffers, false, rows, bytes, |key| st.active.get(key).is_none() && newer.clone().all(|n| n.get(key).is_none()))?;
            memory.extend(b.puts);
        }
        let delta_keys = st.active.entries().map(|(k, _)| k).chain(st.sealed.iter().flat_map(|s| s.entries().map(|(k, _)| k)));
        let files = st.store.scan_files(delta_keys);
        drop(g);
        let mut scan = Self {
            table: std::sync::Arc::clone(inner),
            engine: std::sync::Arc::clone(engine),
            memory: VecDeque::new(),
            files: files.into(),
            resume_at: None,
            current: None,
            reader_buffers: None,
            projection,
            filter,
            counters: Arc::new(ScanCounters::default()),
            batch_rows: options.batch_rows,
            partition: None,
            flush_room_given_up: std::sync::atomic::AtomicBool::new(false),
            failed: false,
        };
        for b in memory {
            let Some(b) = apply_filter(b, scan.filter.as_deref())? else { continue };
            scan.queue(b)?;
        }
        Ok(scan)
    }

    /// This scan as `n` scans (at least 1) of the same snapshot that together return its rows,
    /// each exactly once: scan `i` reads row group `g` of data file `id` when
    /// `(g + id) % n == i` (so files of one row group each are spread over the scans too),
    /// and scan 0 also returns the in-memory rows (deltas and flushes not yet committed). Nothing is read or reserved here. Each is an independent iterator
    /// (`Send`), counted and refused like any scan, with its own [`Scan::metrics`]; each
    /// counts the data files it opens.
    pub(crate) fn into_partitions(mut self, n: usize) -> Vec<Scan> {
        let n = n.max(1);
        if n == 1 {
            return vec![self];
        }
        let files: Vec<FileScan> = self.files.drain(..).collect();
        let mut memory = std::mem::take(&mut self.memory);
        let mut out = Vec::with_capacity(n);
        for index in 0..n {
            out.push(Scan {
                table: Arc::clone(&self.table),
                engine: Arc::clone(&self.engine),
                memory: if index == 0 { std::mem::take(&mut memory) } else { VecDeque::new() },
                // Rows of files not yet committed are in memory: scan 0 returns them whole.
                files: files.iter().filter(|f| index == 0 || matches!(f.source, ScanSource::File(_))).cloned().collect(),
                resume_at: None,
                current: None,
                reader_buffers: None,
                projection: self.projection.clone(),
                filter: self.filter.clone(),
                counters: Arc::new(ScanCounters::default()),
                batch_rows: self.batch_rows,
                partition: Some((index, n)),
                flush_room_given_up: std::sync::atomic::AtomicBool::new(false),
                failed: false,
            });
        }
        out
    }

    /// What the scan has done so far: files opened, row groups read and pruned by the
    /// filter, rows decoded and returned. Files are opened as the scan reaches them, so the
    /// figures are complete once the scan is exhausted.
    pub fn metrics(&self) -> ScanMetrics {
        self.counters.snapshot()
    }

    /// Opens the next file of the queue: a data file's reader, or a staged file's rows queued
    /// in memory. On an error nothing of the file is kept — rows it queued are dropped (and
    /// their memory released) and the file goes back to the front of the queue at the same
    /// row — so a refused open is retried whole by the next call (a staged file refused
    /// halfway returned half its rows on the retry, trial of 2026-12-03); any other error ends
    /// the scan ([`Iterator::next`]).
    fn open_next_file(&mut self) -> Result<bool> {
        let Some(f) = self.files.pop_front() else { return Ok(false) };
        let resume_at = self.resume_at.take();
        let queued = self.memory.len();
        match self.open_file(&f, resume_at) {
            Ok(()) => Ok(true),
            Err(e) => {
                self.memory.truncate(queued);
                // A committed file removed outside the engine is named with its table; one
                // whose footer no longer decodes is checked against its manifest's checksum.
                let e = match (e, &f.source) {
                    (Error::Storage(e), ScanSource::File(path)) => Error::Storage(f.guard.explain_read_error(e.or_missing_file(path, &self.table.name))),
                    (e, _) => e,
                };
                self.files.push_front(f);
                self.resume_at = resume_at;
                Err(e)
            }
        }
    }

    fn open_file(&mut self, f: &FileScan, resume_at: Option<u64>) -> Result<()> {
        match &f.source {
            ScanSource::Memory(batches) => {
                let mut first = 0u32;
                for batch in batches {
                    let n = batch.num_rows() as u32;
                    let (batch, copied) = if f.deleted.range_cardinality(first..first + n) == 0 {
                        (batch.clone(), false)
                    } else {
                        let keep: BooleanArray = (first..first + n).map(|r| Some(!f.deleted.contains(r))).collect();
                        (filter_record_batch(batch, &keep)?, true)
                    };
                    first += n;
                    let Some((batch, filtered)) = apply_filter(batch, self.filter.as_deref())? else { continue };
                    // Rows the deletion vector dropped were copied out too.
                    self.queue((batch, filtered || copied))?;
                }
            }
            ScanSource::File(path) => {
                // No file is opened once the engine is closed: its directory lock is released,
                // and another engine may own the directory (a waiting export went on reading
                // after `close`, beside a second engine that had opened it: helper-49's F1).
                self.engine.check_open()?;
                // A file loaded at open is checked against its manifest's checksum before
                // its first read in this process, and any file again once it has changed on
                // disk since it was committed or matched (a mismatch ends the scan:
                // CorruptFile).
                f.guard.verify()?;
                // Free chunks the pool caches are given back on demand: free here.
                let free = self.table.shared.free_bytes();
                let batch_bytes = scan_batch_bytes(&self.table.shared);
                let spec = ReadSpec {
                    projection: self.projection.clone(),
                    filter: self.filter.clone(),
                    deleted: Arc::clone(&f.deleted),
                    batch_rows: self.batch_rows,
                    batch_bytes,
                    // Page pruning is worth its column index only while it fits the memory
                    // free now: a 121-column file of 77 row groups keeps 3.1 MB of it, and a
                    // filtered scan at 8 MiB was refused for it (`breaker_trial3`).
                    pruning_budget: free,
                    // A reader of every column that would take more than half of the memory
                    // free now (beside a batch) decodes its columns in groups: a 500-column file
                    // written at 2 MiB needed 3.4 MiB read whole, and every scan of it was refused.
                    decode_budget: free,
                    counters: Some(Arc::clone(&self.counters)),
                    resume_at,
                    // Row group `g` of file `id` is this scan's when `(g + id) % n == i`: files of one
                    // row group each go to the scans in turn.
                    partition: self.partition.map(|(i, n)| ((i + n - f.id as usize % n) % n, n)),
                };
                // The file's metadata is counted while it is parsed, not only once the reader
                // is open: each step's bytes are reserved before they are allocated
                // (`read_file_within`), and the reservation then becomes the reader's.
                let mut r = Reservation::new(&self.table.shared.ctl, Category::ScanBuffers, Some(&self.table.account));
                let it = read_file_within(path, spec, &mut |total| {
                    if total > r.size() {
                        self.waiting_for_memory_raw(r.size(), total - r.size(), || r.try_resize(total))?;
                    }
                    Ok(())
                })?;
                let bytes = it.buffer_bytes();
                if bytes > r.size() {
                    self.waiting_for_memory(r.size(), bytes - r.size(), || r.try_resize(bytes))?;
                } else {
                    r.shrink(r.size() - bytes);
                }
                self.reader_buffers = Some(r);
                self.current = Some((it, f.clone()));
            }
        }
        Ok(())
    }
}

/// Cap on a file batch's decoded bytes (`ReadSpec::batch_bytes`): an eighth of the write soft
/// limit (the limit less the flush headroom, docs/memory.md), at least 64 KiB. Files written
/// under a larger limit — wide rows in big row groups — then decode in batches a small limit
/// holds (2.7 KB rows at 4 MiB: ~140 rows a batch instead of 8,192); at the default limit it
/// caps nothing of usual width.
fn scan_batch_bytes(shared: &crate::engine::Shared) -> usize {
    (shared.write_soft_limit() / 8).max(64 << 10)
}

/// Keeps a decoded (or copied) buffer alive and its bytes counted under `scan_buffers`: the
/// owner of the buffers a returned batch points at, dropped with the last of them. Its
/// reservation covers the allocation's capacity and the bookkeeping the re-pointing adds
/// (see [`count_batch`]).
struct Counted {
    _buffer: Buffer,
    _reservation: Reservation,
}

// `HELD_ALLOCATION_BYTES` (storage) is sized from a `Buffer` and a `Reservation`: the fields
// of `Counted`.
const _: () = assert!(size_of::<Counted>() == size_of::<Buffer>() + size_of::<Reservation>());

/// `batch` with every buffer re-pointed at a [`Counted`] owner that holds the original buffer
/// and a `scan_buffers` reservation, so the bytes count for as long as any array of the batch
/// is alive. No data is copied. Counted, in bytes:
///
/// - each distinct allocation's capacity, once per batch however many buffers or columns of
///   it point there, with its owner ([`gritdb_storage::HELD_ALLOCATION_BYTES`]: the owner's
///   `Arc` and the original buffer's `Arc<Bytes>`, 144 bytes);
/// - each buffer handle re-pointed ([`gritdb_storage::HELD_BUFFER_BYTES`]: the `Arc<Bytes>`
///   of the custom allocation, 64 bytes);
/// - each array ([`gritdb_storage::held_array_bytes`] of its struct's size: its `Arc` and its
///   slot in the batch, 128 bytes for a `PrimitiveArray`, 176 for a `StringArray`), and a view
///   array's shared list of data buffers.
///
/// Measured (jemalloc, `process::held_batches_of_a_wide_table_are_counted_as_allocated`):
/// a held nullable `Int64` column of a few rows took 544 bytes beside its buffers' capacities
/// and a `Utf8` one 819; before these were counted, 5,000 all-null `Int64` columns held as
/// one batch at 8 MiB took 13.8 MB for 6.3 MB counted.
///
/// An array's bookkeeping is added to the reservation of the owner of its first buffer,
/// which lives at least as long as the array (the array holds a handle to it); when that
/// allocation already has an owner in this batch, the array gets an owner of its own for
/// that buffer, reserving the bookkeeping and not the capacity again. An array of no
/// non-empty buffer (no rows) counts nothing.
///
/// # Errors
/// [`MemoryError::Limit`] when a reservation does not fit; whatever was reserved for the
/// batch is released again.
pub(crate) fn count_batch(batch: &RecordBatch, ctl: &Arc<MemoryController>, table: Option<&TableAccount>) -> Result<RecordBatch, MemoryError> {
    let mut owners: HashMap<usize, Arc<Counted>> = HashMap::new();
    let mut cols = Vec::with_capacity(batch.num_columns());
    for c in batch.columns() {
        // The new array is of the same type as `c`, so of the same struct size.
        let array = gritdb_storage::held_array_bytes(size_of_val(c.as_ref()));
        cols.push(arrow_array::make_array(rewrap(&c.to_data(), array, &mut owners, ctl, table)?));
    }
    let options = arrow_array::RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
    RecordBatch::try_new_with_options(batch.schema(), cols, &options).map_err(|e| MemoryError::Config(e.to_string()))
}

/// Bytes the array `d` keeps allocated beside its buffers' data once re-pointed: `array`
/// (its struct, [`count_batch`]), a handle for each of its non-empty buffers, and a view
/// array's `Arc<[Buffer]>` of data buffers. Children count with their own arrays.
fn bookkeeping_bytes(d: &ArrayData, array: usize) -> usize {
    let wrapped = |b: &Buffer| b.capacity() != 0 && !b.is_empty();
    let handles = d.buffers().iter().filter(|b| wrapped(b)).count() + usize::from(d.nulls().is_some_and(|n| wrapped(n.buffer())));
    let views = match d.data_type() {
        arrow_schema::DataType::Utf8View | arrow_schema::DataType::BinaryView => {
            gritdb_storage::alloc_size_class(2 * size_of::<usize>() + size_of::<Buffer>() * d.buffers().len().saturating_sub(1))
        }
        _ => 0,
    };
    array + handles * gritdb_storage::HELD_BUFFER_BYTES + views
}

fn rewrap(
    d: &ArrayData,
    array: usize,
    owners: &mut HashMap<usize, Arc<Counted>>,
    ctl: &Arc<MemoryController>,
    table: Option<&TableAccount>,
) -> Result<ArrayData, MemoryError> {
    // This array's bookkeeping, reserved with the first buffer wrapped.
    let mut pending = bookkeeping_bytes(d, array);
    let mut wrap = |b: &Buffer| -> Result<Buffer, MemoryError> {
        if b.capacity() == 0 || b.is_empty() {
            return Ok(b.clone());
        }
        let key = b.data_ptr().as_ptr() as usize;
        let extra = std::mem::take(&mut pending);
        let ptr = std::ptr::NonNull::new(b.as_ptr().cast_mut()).unwrap_or(std::ptr::NonNull::dangling());
        let new_owner = |buffer: Buffer, bytes: usize| -> Result<Arc<Counted>, MemoryError> {
            let mut r = Reservation::new(ctl, Category::ScanBuffers, table);
            r.try_grow(bytes)?;
            Ok(Arc::new(Counted { _buffer: buffer, _reservation: r }))
        };
        let owner = match owners.entry(key) {
            // The allocation is counted already: the array's bookkeeping gets an owner of its
            // own, holding a handle through the allocation's owner (so that one stays counted
            // while this array lives). That handle is one more `Arc<Bytes>`, in
            // `HELD_ALLOCATION_BYTES` in place of the original buffer's.
            std::collections::hash_map::Entry::Occupied(o) if extra > 0 => {
                // SAFETY: as for the buffer returned below: `o`'s owner holds a clone of a
                // buffer of this allocation, which `ptr..ptr + b.len()` lies inside.
                let through = unsafe { Buffer::from_custom_allocation(ptr, b.len(), Arc::clone(o.get()) as Arc<dyn arrow_buffer::alloc::Allocation>) };
                new_owner(through, extra + gritdb_storage::HELD_ALLOCATION_BYTES)?
            }
            std::collections::hash_map::Entry::Occupied(o) => Arc::clone(o.get()),
            std::collections::hash_map::Entry::Vacant(v) => {
                Arc::clone(v.insert(new_owner(b.clone(), b.capacity() + gritdb_storage::HELD_ALLOCATION_BYTES + extra)?))
            }
        };
        // SAFETY: `ptr..ptr + b.len()` lies inside the allocation `b` points at, which the owner
        // keeps alive (it holds a clone of `b`, or a handle through the owner that does) for as
        // long as the new buffer exists; the bytes are never written through either buffer
        // (Arrow buffers are immutable once shared).
        Ok(unsafe { Buffer::from_custom_allocation(ptr, b.len(), owner) })
    };
    let buffers = d.buffers().iter().map(&mut wrap).collect::<Result<Vec<Buffer>, _>>()?;
    let nulls = match d.nulls() {
        Some(n) => {
            let inner = n.inner();
            let wrapped = wrap(inner.inner())?;
            // SAFETY: the same bits, offset, length and null count as `n`.
            Some(unsafe { NullBuffer::new_unchecked(BooleanBuffer::new(wrapped, inner.offset(), inner.len()), n.null_count()) })
        }
        None => None,
    };
    // A child's array struct is not known from its data alone; the largest a table may hold.
    let child_array = gritdb_storage::held_array_bytes(gritdb_storage::MAX_ARRAY_STRUCT_BYTES);
    let children = d.child_data().iter().map(|c| rewrap(c, child_array, owners, ctl, table)).collect::<Result<Vec<_>, _>>()?;
    let builder = d.clone().into_builder().buffers(buffers).nulls(nulls).child_data(children);
    // SAFETY: the same data as `d` (a valid array), only owned through other handles.
    Ok(unsafe { builder.build_unchecked() })
}

/// `b` (a batch of the whole table schema) minus the rows `filter` does not make true.
/// The flag says whether the rows were copied out (some were dropped).
fn apply_filter(b: RecordBatch, filter: Option<&BoundFilter>) -> Result<Option<(RecordBatch, bool)>> {
    let n = b.num_rows();
    match filter {
        None => Ok(Some((b, false))),
        Some(f) => Ok(filter_batch(&b, f)?.map(|out| {
            let copied = out.num_rows() != n;
            (out, copied)
        })),
    }
}

/// Copy-out threshold: a returned batch is compacted when the buffers it keeps alive hold at
/// least this many times the bytes it uses (`shared/reference/seeds/000_b69fcdd581e98bef.txt`:
/// a capacity ratio of 2 did as well as any memory-pressure rule).
pub const RETAIN_RATIO: usize = 2;

fn walk_buffers(d: &arrow_data::ArrayData, seen: &mut std::collections::HashSet<usize>, total: &mut usize) {
    let mut add = |b: &arrow_buffer::Buffer| {
        if seen.insert(b.data_ptr().as_ptr() as usize) {
            *total += b.capacity();
        }
    };
    for b in d.buffers() {
        add(b);
    }
    if let Some(n) = d.nulls() {
        add(n.buffer());
    }
    for c in d.child_data() {
        walk_buffers(c, seen, total);
    }
}

/// Bytes a batch keeps alive: the capacity of every distinct buffer it references (a buffer
/// shared by several columns counts once).
pub fn retained_bytes(batch: &RecordBatch) -> usize {
    let mut seen = std::collections::HashSet::new();
    let mut total = 0;
    for c in batch.columns() {
        walk_buffers(&c.to_data(), &mut seen, &mut total);
    }
    total
}

/// Returns `batch` itself, or a compact copy when it keeps alive at least [`RETAIN_RATIO`]
/// times the bytes it uses (a small slice of a big decoded or snapshot buffer).
///
/// # Errors
/// Arrow errors while copying.
pub fn compact_if_sparse(batch: RecordBatch) -> Result<RecordBatch> {
    Ok(sparse_copy(&batch)?.unwrap_or(batch))
}

/// A compact copy of `batch` when it keeps alive at least [`RETAIN_RATIO`] times the bytes it
/// uses; `None` when it is dense enough to hand out as it is.
fn sparse_copy(batch: &RecordBatch) -> Result<Option<RecordBatch>> {
    let used = gritdb_storage::batch_bytes(batch).max(1);
    if retained_bytes(batch) < RETAIN_RATIO * used {
        return Ok(None);
    }
    Ok(Some(copy_out(batch)?))
}

/// A copy of `batch` whose buffers hold exactly its rows.
fn copy_out(batch: &RecordBatch) -> Result<RecordBatch> {
    let idx = arrow_array::UInt32Array::from_iter_values(0..batch.num_rows() as u32);
    let mut cols = Vec::with_capacity(batch.num_columns());
    for c in batch.columns() {
        let taken = arrow_select::take::take(c.as_ref(), &idx, None)?;
        // `take` on view arrays copies the views but shares the data buffers: collect them.
        let taken: arrow_array::ArrayRef = match taken.data_type() {
            arrow_schema::DataType::Utf8View => std::sync::Arc::new(arrow_array::cast::AsArray::as_string_view(&taken).gc()),
            arrow_schema::DataType::BinaryView => std::sync::Arc::new(arrow_array::cast::AsArray::as_binary_view(&taken).gc()),
            _ => taken,
        };
        cols.push(taken);
    }
    // The row count is explicit: an empty projection has no column to carry it.
    let options = arrow_array::RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
    Ok(RecordBatch::try_new_with_options(batch.schema(), cols, &options)?)
}

impl Scan {
    /// A read error after the table was dropped (its files are gone) reads as what it is.
    fn explain(&self, e: Error) -> Error {
        self.table.explain(e)
    }
}

impl Iterator for Scan {
    type Item = Result<RecordBatch>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        let r = self.next_inner();
        if let Some(Ok(b)) = &r {
            self.counters.add_matched(b.num_rows() as u64);
        }
        match r {
            Some(Err(e)) => {
                // A refusal is retried by the next call; any other error ends the scan, which
                // lets go of its reader, queue and files at once. A refusal met after the
                // table was dropped is the table gone, and ends it too.
                let e = self.explain(e);
                if !e.is_memory_limit() {
                    self.failed = true;
                    self.current = None;
                    self.reader_buffers = None;
                    self.memory.clear();
                    self.files.clear();
                }
                Some(Err(e))
            }
            other => other,
        }
    }
}

impl Scan {
    /// `b` counted under `scan_buffers` (see [`count_batch`]). When the memory is not there,
    /// waits for releases (flushes, or batches the caller drops) up to `backpressure_timeout`,
    /// then returns [`Error::MemoryLimit`].
    fn counted(&self, b: &RecordBatch) -> Result<RecordBatch> {
        self.waiting_for_memory(0, b.get_array_memory_size(), || count_batch(b, &self.table.shared.ctl, Some(&self.table.account)))
    }

    /// A batch the open reader decoded (its buffers, `own` bytes, held beside it), counted as
    /// [`Self::counted`] counts, but never waited for with the reader open: when the batch
    /// cannot be counted now (or the scan leaves room for a flush first, as
    /// [`Self::waiting_for_memory`] does), the reader is closed ([`Self::close_for_retry`]:
    /// its buffers released, its file to be reopened where this batch starts) and the scan
    /// waits holding nothing of the file until `own` plus the batch's bytes are free; `None`
    /// then tells the caller to reopen and decode again. The flush the scan waits for may
    /// need exactly the reader's buffers: at 2 MiB a flush of a row near the bound, its
    /// batches converted, was refused its write buffers while a scan's reader of the same
    /// size row held 1.6 MiB and waited for the flush's 395 KiB — each retry of the flush
    /// refused again, the scan refused after the whole `backpressure_timeout`, 4 scans of 12
    /// (helper-45's F2; `scan_memory::a_scan_waiting_for_memory_lets_go_of_its_reader_so_a_flush_can_finish`).
    /// `deadline` is the wait's end, set at the first wait of the caller's `next`.
    ///
    /// # Errors
    /// [`Error::MemoryLimit`] at once when `own` plus the batch is more than the limit, or
    /// when the memory is not free by the deadline (the reader closed, or kept for the caller
    /// to close).
    fn counted_decoded(&mut self, own: usize, b: &RecordBatch, deadline: &mut Option<Instant>) -> Result<Option<RecordBatch>> {
        use std::sync::atomic::Ordering::Relaxed;
        let table = Arc::clone(&self.table);
        let ctl = &table.shared.ctl;
        let count = || count_batch(b, ctl, Some(&table.account));
        let bytes = b.get_array_memory_size();
        if own.saturating_add(bytes) > ctl.limit() {
            return count().map(Some).map_err(Error::from);
        }
        let deadline = *deadline.get_or_insert_with(|| crate::engine::deadline_after(table.shared.config.backpressure_timeout));
        let over = || Instant::now() >= deadline || self.stop_waiting();
        let mut short = !self.flush_room_given_up.load(Relaxed) && self.engine.scan_flush_room_short(bytes);
        if short && (over() || !self.engine.relieve_pressure(true)) {
            // Nothing to flush, or the wait ran out: the hard limit alone decides, for the
            // rest of the scan.
            self.flush_room_given_up.store(true, Relaxed);
            short = false;
        }
        let refused = if short {
            None
        } else {
            match count() {
                Ok(c) => return Ok(Some(c)),
                Err(e @ MemoryError::Limit { .. }) if over() => return Err(e.into()),
                Err(e @ MemoryError::Limit { .. }) => Some(e),
                Err(e) => return Err(e.into()),
            }
        };
        self.close_for_retry();
        let need = own.saturating_add(bytes);
        loop {
            self.engine.relieve_pressure(true);
            if !self.engine.wait_for_memory(deadline) || self.stop_waiting() {
                // The refusal, the reader already closed; or, waiting for a flush's room,
                // the hard limit alone decides from now on.
                if let Some(e) = refused {
                    return Err(e.into());
                }
                self.flush_room_given_up.store(true, Relaxed);
                return Ok(None);
            }
            // Free chunks count as free (a reservation takes them back): counted as used, the
            // chunks a flush left in the pool kept a scan of a row near the bound waiting out
            // its whole `backpressure_timeout` after the flush it waited for was done
            // (helper-47's F1).
            let free = table.shared.free_bytes() >= need;
            if free && !(short && self.engine.scan_flush_room_short(bytes)) {
                return Ok(None);
            }
        }
    }

    /// `attempt` (to count about `bytes`) until it does not fail for the limit, up to
    /// `backpressure_timeout`; then its `MemoryLimit`. Between tries the engine seals its
    /// largest deltas and queues their flush (as a refused write does) and the scan waits for
    /// releases: memory held in deltas below their flush threshold is freed by nothing else (a
    /// scan at 4 MiB after a replay of 2.5 MiB of deltas waited its 5 s and failed:
    /// `breaker_reopen::alternating_limits_over_many_reopens` on a loaded machine).
    ///
    /// Before the first try, a scan leaves the memory to flush the largest delta
    /// ([`EngineInner::scan_flush_room_short`], the write admission rule's bound): while
    /// `bytes` would not leave it and there is something to flush, the scan seals and waits
    /// as above first. Without this a caller keeping its batches took the flush headroom, and
    /// the sealed deltas' flush could not get its batch blocks (248 KB wanted, 30 KB free):
    /// `scan_memory::a_scan_short_of_memory_flushes_other_tables_deltas`. When nothing can be
    /// flushed or the wait runs out, the hard limit alone decides, for the rest of the scan
    /// (a stalled flush cost a scan keeping its batches the whole timeout before every batch:
    /// `breaker_trial3::a_scan_beside_a_stalled_flush_waits_once_not_per_batch`).
    ///
    /// `own` is what this scan holds that the `bytes` are needed beside (its open reader's
    /// buffers): when `own + bytes` is more than the limit, nothing another scan, write or
    /// flush releases can make room, and the refusal comes at once, without the wait (a
    /// reader of 2 MB values needs about 6 MB of pages beside each decoded batch: at 5 and
    /// 6 MiB each refusal came after the whole `backpressure_timeout`;
    /// `scan_memory::a_batch_bigger_than_the_limit_beside_its_own_reader_is_refused_at_once`).
    /// After a refused try the scan's other holdings join `own` ([`Self::held_bytes`]: batches
    /// queued, staged files' rows not yet reached), which only it can give back: waiting for
    /// them is waiting for itself.
    fn waiting_for_memory<T>(&self, own: usize, bytes: usize, attempt: impl FnMut() -> std::result::Result<T, MemoryError>) -> Result<T> {
        self.waiting_for_memory_raw(own, bytes, attempt).map_err(Error::from)
    }

    /// [`Self::waiting_for_memory`] with the allocator's error as it is (for the storage
    /// crate's reservation callback).
    fn waiting_for_memory_raw<T>(
        &self,
        own: usize,
        bytes: usize,
        mut attempt: impl FnMut() -> std::result::Result<T, MemoryError>,
    ) -> std::result::Result<T, MemoryError> {
        use std::sync::atomic::Ordering::Relaxed;
        let deadline = crate::engine::deadline_after(self.table.shared.config.backpressure_timeout);
        // What else this scan holds, computed at the first refusal (a walk of its queue).
        let mut held: Option<usize> = None;
        // A scan of a table dropped meanwhile stops waiting at the next wake-up (at most
        // 100 ms): its refusal then reads as `TableNotFound` ([`Self::explain`]) and ends the
        // scan. Before, it waited out the whole timeout (9.3 s of 10 s after the drop, for a
        // scan and an export alike; fresh-clone trial of 2026-12-06,
        // `fair_admission::a_scan_waiting_for_memory_when_its_table_is_dropped_ends_with_table_not_found`).
        loop {
            // Read again each time round: the limit may have been raised meanwhile.
            if own.saturating_add(bytes) > self.table.shared.ctl.limit() {
                return attempt();
            }
            if !self.flush_room_given_up.load(Relaxed) && self.engine.scan_flush_room_short(bytes) {
                if self.engine.relieve_pressure(true) && self.engine.wait_for_memory(deadline) && !self.stop_waiting() {
                    continue;
                }
                self.flush_room_given_up.store(true, Relaxed);
            }
            match attempt() {
                Ok(v) => return Ok(v),
                Err(e @ MemoryError::Limit { .. }) => {
                    let held = *held.get_or_insert_with(|| self.held_bytes());
                    if own.saturating_add(held).saturating_add(bytes) > self.table.shared.ctl.limit() {
                        return Err(e);
                    }
                    // Waits even when nothing is left to flush: other scans' batches may be
                    // dropped.
                    self.engine.relieve_pressure(true);
                    if !self.engine.wait_for_memory(deadline) || self.stop_waiting() {
                        return Err(e);
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Whether a wait for memory ends now: the table was dropped, or the engine closed (its
    /// refusal then reads as `TableNotFound` or `Closed`, [`TableInner::explain`], and ends
    /// the scan). Before the engine's check, an export waiting in its scan when `close`
    /// returned waited out its whole timeout (helper-49's F2).
    fn stop_waiting(&self) -> bool {
        self.table.is_dropped() || self.engine.check_open().is_err()
    }

    /// Bytes this scan holds besides its open reader and has not handed out: the batches of
    /// its queue and of the staged files ([`ScanSource::Memory`]) at the front of its file
    /// queue (snapshots keep them first), each distinct buffer's capacity once. The caller
    /// holds the rest.
    fn held_bytes(&self) -> usize {
        let staged = self.files.iter().map_while(|f| match &f.source {
            ScanSource::Memory(batches) => Some(batches.iter()),
            ScanSource::File(_) => None,
        });
        let mut seen = std::collections::HashSet::new();
        let mut total = 0;
        for b in self.memory.iter().chain(staged.flatten()) {
            for c in b.columns() {
                walk_buffers(&c.to_data(), &mut seen, &mut total);
            }
        }
        total
    }

    /// Closes the open file reader, releasing its buffers, and puts its file back at the
    /// front of the queue, to be reopened where the batch it returned last starts (that batch
    /// was refused, or the reader's own buffers were and it returned none).
    fn close_for_retry(&mut self) {
        if let Some((reader, file)) = self.current.take() {
            self.resume_at = Some(reader.resume_row());
            self.files.push_front(file);
        }
        self.reader_buffers = None;
    }

    /// Queues an in-memory batch of the whole table schema (`copied`: its rows are a heap copy,
    /// made by a filter or a deletion vector, rather than a slice of a counted snapshot block)
    /// in the scan's projection and in batches of at most `batch_rows`. Every queued piece is
    /// counted: a slice of a snapshot block is (the block is), and a copy is counted when it
    /// is made, so rows waiting in the queue are within the limit like rows handed out. A
    /// projection that drops columns copies the kept ones out (a slice would keep the dropped
    /// columns' part of the block alive).
    ///
    /// # Errors
    /// [`Error::MemoryLimit`] when a copy's memory cannot be had after the wait
    /// ([`Self::counted`]); Arrow errors while copying.
    fn queue(&mut self, (b, copied): (RecordBatch, bool)) -> Result<()> {
        if b.num_rows() == 0 {
            return Ok(());
        }
        let (b, narrowed) = match self.projection.as_deref() {
            Some(p) => (b.project(p)?, p.len() < b.num_columns()),
            None => (b, false),
        };
        let mut at = 0;
        while at < b.num_rows() {
            let len = self.batch_rows.min(b.num_rows() - at);
            let piece = b.slice(at, len);
            let piece = if narrowed || (copied && len < b.num_rows()) {
                self.counted(&copy_out(&piece)?)?
            } else if copied {
                self.counted(&piece)?
            } else {
                piece
            };
            self.memory.push_back(piece);
            at += len;
        }
        Ok(())
    }

    fn next_inner(&mut self) -> Option<Result<RecordBatch>> {
        // The end of this call's wait for a decoded batch's memory (set at its first wait).
        let mut deadline = None;
        loop {
            if let Some(b) = self.memory.pop_front() {
                // Queued batches are counted already; only a compact copy needs its own count.
                let r = match sparse_copy(&b) {
                    Ok(None) => return Some(Ok(b)),
                    Ok(Some(copy)) => self.counted(&copy),
                    Err(e) => Err(e),
                };
                if r.is_err() {
                    // Refused: the next call returns the batch instead.
                    self.memory.push_front(b);
                }
                return Some(r);
            }
            if let Some((it, f)) = self.current.as_mut() {
                // Decoded batches are always counted (they were on the heap). A refused one
                // closes the reader, its file to be reopened where the batch starts: the retry
                // loses no row. A read error ends the scan (`next` lets go of everything).
                if let Some(r) = it.next() {
                    let own = self.reader_buffers.as_ref().map_or(0, Reservation::size);
                    // A decode error of a damaged file says so, naming the file (a file
                    // changed while it is read, or in the clock tick of its last check).
                    let r = r.map_err(|e| f.guard.explain_read_error(e));
                    let counted = r.map_err(Error::from).and_then(compact_if_sparse).and_then(|b| self.counted_decoded(own, &b, &mut deadline));
                    match counted {
                        // The reader was let go for a wait: reopen and decode the batch again.
                        Ok(None) => continue,
                        Ok(Some(b)) => return Some(Ok(b)),
                        Err(e) => {
                            if e.is_memory_limit() {
                                self.close_for_retry();
                            }
                            return Some(Err(e));
                        }
                    }
                }
                self.current = None;
                self.reader_buffers = None;
            }
            match self.open_next_file() {
                Ok(true) => {}
                Ok(false) => return None,
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

impl From<arrow_schema::ArrowError> for Error {
    fn from(e: arrow_schema::ArrowError) -> Self {
        Error::Storage(StorageError::Arrow(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{ArrayRef, Int64Array};

    /// A buffer shared by two columns (and the same batch counted twice) is reserved once per
    /// counted batch, for exactly its capacity, and released when the last array goes.
    #[test]
    fn shared_buffers_count_once_per_batch() {
        let ctl = MemoryController::new(gritdb_memctl::ControllerConfig { memory_limit: Some(64 << 20), ..Default::default() }).unwrap();
        let col: ArrayRef = Arc::new(Int64Array::from_iter_values(0..10_000));
        let cap = retained_bytes(&RecordBatch::try_from_iter([("a", Arc::clone(&col))]).unwrap());
        let col_a = Arc::clone(&col);
        let batch = RecordBatch::try_from_iter([("a", Arc::clone(&col)), ("b", col)]).unwrap();
        let counted = count_batch(&batch, &ctl, None).unwrap();
        // Each array counts its own bookkeeping ([`count_batch`]); the allocation's capacity and
        // owner once.
        let array = gritdb_storage::held_array_bytes(size_of_val(col_a.as_ref())) + gritdb_storage::HELD_BUFFER_BYTES;
        let cap = cap + gritdb_storage::HELD_ALLOCATION_BYTES;
        let total = cap + array + (array + gritdb_storage::HELD_ALLOCATION_BYTES);
        assert_eq!(ctl.category_bytes(Category::ScanBuffers), total);
        assert_eq!(counted, batch);
        let kept = Arc::clone(counted.column(1));
        drop(counted);
        drop(batch);
        // Column `b`'s owner holds a handle through column `a`'s, which reserved the capacity.
        assert_eq!(ctl.category_bytes(Category::ScanBuffers), total, "a kept column keeps the allocation counted");
        drop(kept);
        assert_eq!(ctl.category_bytes(Category::ScanBuffers), 0);
    }
}
