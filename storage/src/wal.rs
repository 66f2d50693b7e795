//! Write-ahead log: every acknowledged insert / upsert / update / delete is appended (and, in
//! the default mode, fsynced) before the call returns, and replayed on open.
//!
//! ```text
//! <data dir>/wal/wal-00000001.log   segments, appended in order, rotated at 16 MiB
//! record = | len u32 | crc32 u32 (of payload) | payload |
//! payload = | op u8 (1 put, 2 delete) | table id u64 | first seq u64 | last seq u64 | Arrow IPC stream |
//! ```
//! View columns (`Utf8View`, `BinaryView`) are logged as `Binary` offset columns: 4 bytes per
//! value instead of 16 in IPC, and a per-batch fsync costs about its bytes (TPC-H lineitem:
//! 218 → 169 bytes per row). Replay casts them back ([`WalRecord::batch_as`]), checking a
//! `Utf8View` column's bytes are UTF-8 again; records of older builds logged `Utf8View` as
//! `Utf8`, and replay as well. Likewise a `Decimal128` column of precision ≤ 18 is logged as
//! `Decimal64` (8 bytes a value instead of 16, Parquet's `INT64` rule for such decimals;
//! lineitem's four decimals: 169 → 137 bytes per row) and widened back on replay; records of
//! older builds hold `Decimal128` and replay unchanged.
//! A segment is deleted once every table with records in it has committed files covering
//! those records (`flushed_seq` in its manifest), or was dropped.
//!
//! Recovery rules: the tail of the last segment left by a write the crash interrupted is
//! dropped and the segment truncated to the last whole record: a record cut short, a
//! zero-filled tail, a last record whose checksum fails (a torn page inside it) with no whole
//! record after it (zeros, or the first part of the next record: a group commit's pages reach
//! the disk in any order), or a record whose header page was not written (zeros) with no
//! whole record after it. Zeros after a torn record are what a file system shows for pages of the
//! file's length that were never written: [`WalSync::Relaxed`] leaves several records
//! unsynced, and a crash can persist some of their pages and not others. Such records were
//! never acknowledged as durable (a per-batch append returns after its fsync). Any other bad
//! record — a bad checksum with whole records after it, or damage in an older segment — is
//! [`StorageError::CorruptWal`], never skipped silently. So are bytes no write of this log
//! leaves where a record starts (a payload op byte other than 1 or 2, or 0 before other bytes
//! in its sector: text, another file's bytes) and a file named like a segment but not as the log names one
//! (`wal-1.log`): the open refuses, naming the file, and leaves it as it is.

use crate::error::{StorageError, io};
use crate::vfs::{Vfs, VfsFile};
use arrow_array::RecordBatch;
use arrow_ipc::reader::StreamReader;
use arrow_ipc::writer::StreamEncoder;
use gritdb_memctl::{Category, MemoryController, Reservation};
use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

const HEADER: usize = 8;
const PAYLOAD_HEADER: usize = 1 + 8 + 8 + 8;

/// Sequence numbers on disk — a WAL record's, a manifest's `flushed_seq` — and manifest
/// versions are below this bound. A write takes one sequence number per row and a commit one
/// version, so no table reaches 2^63 (three centuries at a billion rows a second); and since
/// the engine continues from them with `+ 1` (the next write, the next commit), a bound this
/// far below `u64::MAX` means no write's `seq + rows - 1` can wrap. A number at or past it
/// was not written by gritdb (a crafted or hand-edited file): refused. Before, only
/// `u64::MAX` itself was refused in a record: one ending at `u64::MAX - 1` replayed, the next
/// write was numbered `u64::MAX`, and the open after it refused the whole log.
pub(crate) const SEQ_LIMIT: u64 = 1 << 63;
/// Segment size at which a new segment is started, in bytes.
pub const SEGMENT_BYTES: u64 = 16 << 20;

/// When appended records reach stable storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum WalSync {
    /// fsync after every append, before the write call returns (default).
    #[default]
    PerBatch,
    /// Group commit: appends are written but fsynced by a background tick (the engine's
    /// `wal_sync_interval`); a crash may lose writes acknowledged within that interval. A
    /// segment is fsynced before it is closed at 16 MiB. When an fsync of acknowledged
    /// records fails, the log takes no more records: every later append and sync returns
    /// [`StorageError::Io`] naming the first failure, until the engine is reopened (which
    /// recovers what is on disk).
    Relaxed,
}

/// What a WAL record does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WalOp {
    /// Rows put (insert, upsert or update): replayed as upsert.
    Put,
    /// Keys deleted: replayed as delete.
    Delete,
}

/// One replayed record.
#[derive(Debug)]
pub struct WalRecord {
    /// Put or delete.
    pub op: WalOp,
    /// Table id.
    pub table: u64,
    /// First sequence number of the batch.
    pub first_seq: u64,
    /// Last sequence number of the batch.
    pub last_seq: u64,
    /// Rows (put) or key columns (delete).
    pub batch: RecordBatch,
    /// Where the record is in the log, for errors about it ([`WalPosition::corrupt`]).
    pub position: WalPosition,
}

/// Where a WAL record lies: its segment file and the byte offset of its frame in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WalPosition {
    /// The segment file (empty for records of [`decode_segment`], which reads bytes).
    pub segment: PathBuf,
    /// Byte offset of the record's frame (its length field) in the segment.
    pub offset: u64,
}

impl WalPosition {
    /// [`StorageError::CorruptWal`] naming this record: what a record whose checksum holds but
    /// whose contents cannot be replayed (columns or values that do not fit its table) is, so
    /// the error names the segment and offset to look at, as every other damage does.
    pub fn corrupt(&self, detail: impl Into<String>) -> StorageError {
        corrupt(&self.segment, self.offset, detail)
    }
}

struct Segment {
    id: u64,
    bytes: u64,
    /// Per table: the last sequence number written into this segment.
    max_seq: HashMap<u64, u64>,
}

struct Active {
    seg: Segment,
    file: Box<dyn VfsFile>,
}

struct Inner {
    active: Option<Active>,
    closed: Vec<Segment>,
    next_id: u64,
    /// [`WalSync::Relaxed`]: records were appended (and acknowledged) since the last fsync.
    unsynced: bool,
    /// [`WalSync::Relaxed`]: an fsync of acknowledged records failed. Sticky: the log takes
    /// no more records and every later sync fails, since after a failed fsync Linux may have
    /// dropped the dirty pages and cleared the error, so a later fsync that succeeds proves
    /// nothing about them (the `PostgreSQL` "fsyncgate" of 2018; `RocksDB` likewise stops
    /// writes on a WAL sync error). Reopening the engine recovers what is on disk.
    failed: Option<SyncFailure>,
}

/// The first failed fsync of acknowledged records ([`Inner::failed`]).
#[derive(Debug, Clone)]
struct SyncFailure {
    path: PathBuf,
    kind: std::io::ErrorKind,
    message: String,
}

impl SyncFailure {
    fn error(&self) -> StorageError {
        let text = format!(
            "an earlier fsync of this write-ahead log failed ({}); writes acknowledged since the last good fsync may not be durable, so the log takes no more records: reopen the engine to recover what is on disk",
            self.message
        );
        StorageError::Io { path: self.path.clone(), source: std::io::Error::new(self.kind, text) }
    }
}

impl Inner {
    /// Records a failed fsync of acknowledged records (the first one stays) and returns the
    /// error for the caller.
    fn fail_sync(&mut self, path: PathBuf, e: std::io::Error) -> StorageError {
        self.failed.get_or_insert_with(|| SyncFailure { path: path.clone(), kind: e.kind(), message: e.to_string() });
        StorageError::Io { path, source: e }
    }

    fn refuse_if_failed(&self) -> Result<(), StorageError> {
        self.failed.as_ref().map_or(Ok(()), |f| Err(f.error()))
    }
}

/// One WAL record encoded ahead of its append ([`Wal::encode_record`]): the frame and the
/// payload header in a small buffer of their own, then the batch as an Arrow IPC stream in
/// the buffers `arrow_ipc::writer::StreamEncoder` gives (the stream's metadata and padding,
/// and the column buffers themselves: slices of the batch's arrays, or of their compact copy
/// for the log, not copies), written with one vectored `write`. Reserved under
/// `write_buffers` while it exists: the compact copy, and every IPC buffer's length but the
/// slices of that copy (counted once, as the copy) — the slices of the caller's arrays too,
/// which over-counts them: the encoder's own allocations, e.g. re-based offsets of a sliced
/// array, are not told apart from them. The table id and sequence
/// numbers are filled in, and the checksum completed, by [`Wal::append_record`]; encoding can
/// thus run before the write is checked and numbered (the engine does it beside its key
/// checks).
pub struct EncodedRecord {
    /// The frame (length, checksum) and the payload header (op, table, sequence numbers).
    head: [u8; HEADER + PAYLOAD_HEADER],
    /// The Arrow IPC stream, in order.
    ipc: Vec<arrow_buffer::Buffer>,
    /// Bytes of `ipc`.
    ipc_len: usize,
    /// Held until the record is dropped (written or not).
    _res: Reservation,
    /// Checksum state of the IPC part (everything after the payload header).
    ipc_crc: crc32fast::Hasher,
}

impl EncodedRecord {
    /// The record's bytes on disk.
    fn len(&self) -> usize {
        HEADER + PAYLOAD_HEADER + self.ipc_len
    }
}

impl std::fmt::Debug for EncodedRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncodedRecord").field("bytes", &self.len()).finish_non_exhaustive()
    }
}

/// The write-ahead log of one engine.
pub struct Wal {
    dir: PathBuf,
    vfs: Arc<dyn Vfs>,
    sync: WalSync,
    ctl: Arc<MemoryController>,
    inner: Mutex<Inner>,
    /// What the open cut from the last segment.
    torn_tail: Option<TornTail>,
}

impl std::fmt::Debug for Wal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wal").field("dir", &self.dir).field("sync", &self.sync).finish_non_exhaustive()
    }
}

impl WalRecord {
    /// The record's batch with each column cast to the type `schema` gives it where the two
    /// differ only as layouts of the same data: view and offset layouts (`Utf8View` ↔ `Utf8`,
    /// `BinaryView` ↔ `Binary`, and `Binary` → `Utf8View`, which checks the bytes are UTF-8),
    /// and `Decimal64(p, s)` → `Decimal128(p, s)`. Records log view columns as `Binary` offset
    /// columns and decimals of precision ≤ 18 as `Decimal64`. Columns are matched by position;
    /// any other difference is left for the caller's schema check.
    ///
    /// # Errors
    /// [`StorageError::Arrow`] when a cast fails (a `Binary` value that is not UTF-8 for a
    /// `Utf8View` column is an error, never a null; so is a decimal outside its precision).
    pub fn batch_as(&self, schema: &arrow_schema::Schema) -> Result<RecordBatch, StorageError> {
        use arrow_schema::DataType::{Binary, BinaryView, Decimal64, Decimal128, Utf8, Utf8View};
        let got = self.batch.schema();
        let relayout = |from: &arrow_schema::DataType, to: &arrow_schema::DataType| {
            matches!((from, to), (Utf8, Utf8View) | (Utf8View, Utf8) | (BinaryView, Binary) | (Binary, BinaryView | Utf8View))
                || matches!((from, to), (Decimal64(p, s), Decimal128(q, t)) if p == q && s == t)
        };
        let strict = arrow_cast::CastOptions { safe: false, ..arrow_cast::CastOptions::default() };
        if got.fields().len() != schema.fields().len() || !got.fields().iter().zip(schema.fields()).any(|(g, w)| relayout(g.data_type(), w.data_type())) {
            return Ok(self.batch.clone());
        }
        let mut fields = Vec::with_capacity(got.fields().len());
        let mut cols = Vec::with_capacity(got.fields().len());
        for ((g, w), c) in got.fields().iter().zip(schema.fields()).zip(self.batch.columns()) {
            if relayout(g.data_type(), w.data_type()) {
                fields.push(Arc::new(g.as_ref().clone().with_data_type(w.data_type().clone())));
                cols.push(arrow_cast::cast_with_options(c, w.data_type(), &strict)?);
            } else {
                fields.push(Arc::clone(g));
                cols.push(Arc::clone(c));
            }
        }
        Ok(RecordBatch::try_new(Arc::new(arrow_schema::Schema::new_with_metadata(fields, got.metadata().clone())), cols)?)
    }
}

fn seg_name(id: u64) -> String {
    format!("wal-{id:08}.log")
}

/// The largest segment id: 15 digits. A log rotating every 16 MiB reaches it after about
/// 14 zebibytes written; a larger id in a name is not one this log gave, and an id near `u64::MAX`
/// would wrap the next segment's id to 0, whose records replay first (a fresh-clone trial
/// lost an acknowledged write so, with a `wal-18446744073709551615.log` added).
pub const MAX_SEGMENT_ID: u64 = 999_999_999_999_999;

/// The id of the segment named `name`, when it is exactly the name gritdb gives segment `id`:
/// `wal-` + the id in decimal, zero-padded to at least 8 digits, + `.log`
/// (`wal-00000001.log`, `wal-123456789012.log`), the id at most [`MAX_SEGMENT_ID`].
/// `wal-1.log`, `wal-000000000099.log` or a larger id are not: [`Wal::open`] refuses them
/// rather than read a file under another name than the one it would reopen and remove.
pub fn wal_segment_id(name: &str) -> Option<u64> {
    // `seg_name`'s spelling: the id zero-padded to 8 digits.
    let digits = name.strip_prefix("wal-")?.strip_suffix(".log")?;
    crate::canonical_id(digits, 8).filter(|&id| id <= MAX_SEGMENT_ID)
}

/// Whether a name is shaped like a segment's (`wal-*.log`) whatever lies between.
#[expect(clippy::case_sensitive_file_extension_comparisons, reason = "gritdb writes `.log` in lower case only; `WAL-1.LOG` is not a name it gives")]
fn segment_shaped(name: &str) -> bool {
    name.starts_with("wal-") && name.ends_with(".log")
}

fn corrupt(path: &Path, offset: u64, detail: impl Into<String>) -> StorageError {
    StorageError::CorruptWal { path: path.to_path_buf(), offset, detail: detail.into() }
}

/// The tail [`Wal::open`] dropped from the last segment: bytes after the last whole record
/// that recovery took for a write a crash interrupted (see the module's recovery rules) and
/// cut off. With [`WalSync::PerBatch`] such a write was never acknowledged, as an append
/// returns after its fsync; but damage to the last acknowledged record (a flipped bit in its
/// length or payload) looks the same, so an application that must know reads this after
/// every open.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TornTail {
    /// The segment cut.
    pub segment: PathBuf,
    /// Where the dropped bytes began (the segment's new length), in bytes.
    pub offset: u64,
    /// Bytes dropped.
    pub bytes: u64,
    /// What recovery saw there ("record extends past the end of the segment", ...).
    pub detail: String,
}

impl Wal {
    /// Opens the WAL in `dir` (created if missing), calling `replay` with every record in
    /// order. A torn last record is dropped (and the segment truncated; [`Self::torn_tail`]
    /// says what was dropped).
    ///
    /// # Errors
    /// [`StorageError::CorruptWal`] for damage other than a torn tail, [`StorageError::Io`],
    /// or whatever `replay` returns.
    pub fn open<E: From<StorageError>>(
        dir: &Path,
        vfs: Arc<dyn Vfs>,
        sync: WalSync,
        ctl: &Arc<MemoryController>,
        mut replay: impl FnMut(WalRecord) -> Result<(), E>,
    ) -> Result<Self, E> {
        fs::create_dir_all(dir).map_err(io(dir)).map_err(E::from)?;
        let mut ids: Vec<u64> = Vec::new();
        for entry in fs::read_dir(dir).map_err(io(dir)).map_err(E::from)? {
            let name = entry.map_err(io(dir)).map_err(E::from)?.file_name();
            let name = name.to_string_lossy();
            match wal_segment_id(&name) {
                // Only a regular file: through a symlink the open would cut (or read without
                // end, `/dev/zero`) a file outside the data directory, and a FIFO blocks it.
                Some(_) if !fs::symlink_metadata(dir.join(&*name)).is_ok_and(|m| m.is_file()) => {
                    return Err(E::from(corrupt(
                        &dir.join(&*name),
                        0,
                        "named as a segment but not a regular file (a symlink, directory, FIFO or device); move it out of the log directory",
                    )));
                }
                Some(id) => ids.push(id),
                // A name like a segment's that gritdb would not give one (`wal-1.log`): its
                // records (if it holds any) would be neither replayed nor removed; refused
                // before anything is read or changed. Other names are not the log's; left alone.
                None if segment_shaped(&name) => {
                    return Err(E::from(corrupt(
                        &dir.join(&*name),
                        0,
                        "not a segment name this log writes (`wal-` + the id in at least 8 digits without extra zeros + `.log`); move the file out of the log directory",
                    )));
                }
                None => {}
            }
        }
        ids.sort_unstable();
        let mut closed = Vec::new();
        let mut torn_tail = None;
        for (i, &id) in ids.iter().enumerate() {
            let last = i + 1 == ids.len();
            let path = dir.join(seg_name(id));
            let (seg, torn) = read_segment(&path, id, last, &mut replay)?;
            closed.push(seg);
            torn_tail = torn_tail.or(torn);
        }
        let next_id = ids.last().map_or(1, |l| l + 1); // at most `MAX_SEGMENT_ID` + 1
        Ok(Self {
            dir: dir.to_path_buf(),
            vfs,
            sync,
            ctl: Arc::clone(ctl),
            inner: Mutex::new(Inner { active: None, closed, next_id, unsynced: false, failed: None }),
            torn_tail,
        })
    }

    /// The tail this open cut from the last segment, if any ([`TornTail`]).
    pub fn torn_tail(&self) -> Option<&TornTail> {
        self.torn_tail.as_ref()
    }

    /// Whether [`Self::append`] fsyncs before it returns ([`WalSync::PerBatch`]).
    pub fn syncs_each_append(&self) -> bool {
        self.sync == WalSync::PerBatch
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Encodes a record of `batch` for a later [`Self::append_record`].
    ///
    /// # Errors
    /// [`StorageError::Memory`] when the buffer cannot be budgeted, [`StorageError::Arrow`],
    /// [`StorageError::Io`] for a record above 4 GiB.
    pub fn encode_record(&self, op: WalOp, batch: &RecordBatch) -> Result<EncodedRecord, StorageError> {
        let mut res = Reservation::new(&self.ctl, Category::WriteBuffers, None);
        // The compact copy of view and decimal columns lives until the IPC encoding is done;
        // it is reserved column by column before each part is allocated.
        let compact = compact_for_log(batch, &mut res)?;
        let logged = compact.as_ref().unwrap_or(batch);
        // The columns the compact copy made: fresh arrays at offset 0, whose buffers the
        // encoder writes as they are (slices, not copies), so they are counted once, as the
        // copy. Counting them again here refused, at 2 MiB, a 2-row insert of two 404 KB
        // `Utf8View` values that `Utf8` took (helper-48's F1).
        let (copied, kept): (Vec<_>, Vec<_>) = logged.columns().iter().zip(batch.columns()).partition(|(l, c)| !Arc::ptr_eq(l, c));
        let copied: Vec<&arrow_array::ArrayRef> = copied.into_iter().map(|(l, _)| l).collect();
        // A slice's own rows, not its parent's buffers (the IPC encoder encodes only the
        // slice). The encoder's own allocations (its metadata, re-based offsets and shifted
        // bitmaps of sliced arrays) are budgeted before it runs, at the other columns' bytes.
        let compacted = res.size();
        let others = kept.iter().map(|(c, _)| crate::bytes::range_bytes(&c.to_data(), 0, c.len())).fold(0, usize::saturating_add);
        res.try_grow(others + 1024)?;
        let mut enc = StreamEncoder::try_new(logged.schema_ref())?;
        let mut ipc = enc.encode(logged)?;
        ipc.extend(enc.finish()?);
        let ipc_len = ipc.iter().map(arrow_buffer::Buffer::len).sum::<usize>();
        let in_copy = copy_slice_bytes(&ipc, &copied);
        drop(copied);
        drop(compact);
        // What the record holds until it is written: the compact copy (its arrays stay alive
        // in `ipc`) and the IPC buffers that are not slices of it.
        res.try_resize(compacted + (ipc_len - in_copy))?;
        let len = u32::try_from(PAYLOAD_HEADER + ipc_len).map_err(|_| StorageError::Io {
            path: self.dir.clone(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "WAL record above 4 GiB; write smaller batches"),
        })?;
        let mut head = [0; HEADER + PAYLOAD_HEADER];
        head[..4].copy_from_slice(&len.to_le_bytes());
        head[HEADER] = match op {
            WalOp::Put => 1,
            WalOp::Delete => 2,
        };
        // Table id, first and last sequence number: filled in by `append_record`.
        let mut ipc_crc = crc32fast::Hasher::new();
        for b in &ipc {
            ipc_crc.update(b.as_slice());
        }
        Ok(EncodedRecord { head, ipc, ipc_len, _res: res, ipc_crc })
    }

    /// Appends one record; with [`WalSync::PerBatch`] it is fsynced before this returns.
    /// The record is encoded as its frame and payload header plus the Arrow IPC encoder's
    /// buffers ([`EncodedRecord`], reserved under `write_buffers` while it exists) and
    /// written with one vectored `write` (more when the file takes part of it).
    ///
    /// # Errors
    /// [`StorageError::Io`] (the record may be partly written: recovery drops a torn tail),
    /// [`StorageError::Memory`], [`StorageError::Arrow`].
    pub fn append(&self, op: WalOp, table: u64, first_seq: u64, last_seq: u64, batch: &RecordBatch) -> Result<(), StorageError> {
        let rec = self.encode_record(op, batch)?;
        self.append_record(rec, table, first_seq, last_seq)
    }

    /// Appends a record from [`Self::encode_record`] as table `table`'s writes
    /// `first_seq..=last_seq`; with [`WalSync::PerBatch`] it is fsynced before this returns.
    ///
    /// # Errors
    /// [`StorageError::Io`] (the record may be partly written: recovery drops a torn tail).
    pub fn append_record(&self, mut rec: EncodedRecord, table: u64, first_seq: u64, last_seq: u64) -> Result<(), StorageError> {
        let head = &mut rec.head[HEADER + 1..];
        head[..8].copy_from_slice(&table.to_le_bytes());
        head[8..16].copy_from_slice(&first_seq.to_le_bytes());
        head[16..].copy_from_slice(&last_seq.to_le_bytes());
        let mut crc = crc32fast::Hasher::new();
        crc.update(&rec.head[HEADER..]);
        crc.combine(&rec.ipc_crc);
        let crc = crc.finalize();
        rec.head[4..HEADER].copy_from_slice(&crc.to_le_bytes());
        let mut parts = Vec::with_capacity(1 + rec.ipc.len());
        parts.push(std::io::IoSlice::new(&rec.head));
        parts.extend(rec.ipc.iter().map(|b| std::io::IoSlice::new(b.as_slice())));
        // The record (and its reservation) is dropped when this returns, written or not.
        self.write_record(&mut parts, rec.len(), table, last_seq)
    }

    /// Writes one record of `len` bytes, given as `parts` in order (consumed by the write).
    fn write_record(&self, parts: &mut [std::io::IoSlice<'_>], len: usize, table: u64, last_seq: u64) -> Result<(), StorageError> {
        let mut g = self.lock();
        g.refuse_if_failed()?;
        if g.active.as_ref().is_some_and(|a| a.seg.bytes >= SEGMENT_BYTES) {
            // Relaxed: the group-commit tick fsyncs the active segment only, so a full one's
            // acknowledged tail is fsynced before it is closed.
            if g.unsynced
                && let Some(a) = g.active.as_mut()
            {
                let path = self.dir.join(seg_name(a.seg.id));
                if let Err(e) = a.file.sync_all() {
                    return Err(g.fail_sync(path, e));
                }
                g.unsynced = false;
            }
            let a = g.active.take().map(|a| a.seg);
            g.closed.extend(a);
        }
        if g.active.is_none() {
            let id = g.next_id;
            // Past the last id the open accepts, a segment's records would be refused (and
            // then lost) at the next open: this write is refused instead, before it is logged.
            if id > MAX_SEGMENT_ID {
                return Err(StorageError::Io {
                    path: self.dir.join(seg_name(id)),
                    source: std::io::Error::other(format!(
                        "the write-ahead log is out of segment ids (the last is {MAX_SEGMENT_ID}); flush, export the tables and open a new data directory"
                    )),
                });
            }
            let path = self.dir.join(seg_name(id));
            let file = self.vfs.create(&path).map_err(io(&path))?;
            self.vfs.sync_dir(&self.dir).map_err(io(&self.dir))?;
            // Ids at open are at most `MAX_SEGMENT_ID`: no wrap in any real log's life.
            g.next_id = id.saturating_add(1);
            g.active = Some(Active { seg: Segment { id, bytes: 0, max_seq: HashMap::new() }, file });
        }
        let a = g.active.as_mut().expect("active segment just ensured"); // infallible
        let good = a.seg.bytes;
        let mut res = crate::vfs::write_all_vectored(a.file.as_mut(), parts);
        if res.is_ok() && self.sync == WalSync::PerBatch {
            res = a.file.sync_all();
        }
        if let Err(e) = res {
            // The write is not acknowledged, so it must not come back on recovery: cut the
            // segment back to its last whole record (best effort) and start a new segment for
            // the next append.
            let path = self.dir.join(seg_name(a.seg.id));
            let seg = g.active.take().map(|a| a.seg);
            g.closed.extend(seg);
            // Relaxed: the segment's earlier records were acknowledged unsynced; the cut's
            // fsync below is theirs too.
            let acknowledged_unsynced = g.unsynced;
            if let Err(t) = fs::OpenOptions::new().write(true).open(&path).and_then(|f| {
                f.set_len(good)?;
                f.sync_all()
            }) {
                tracing::error!(path = %path.display(), error = %t, "could not cut a failed WAL record");
                if acknowledged_unsynced {
                    g.fail_sync(path.clone(), t);
                }
            }
            return Err(StorageError::Io { path, source: e });
        }
        a.seg.bytes += len as u64;
        let e = a.seg.max_seq.entry(table).or_insert(0);
        *e = (*e).max(last_seq);
        if self.sync == WalSync::Relaxed {
            g.unsynced = true;
        }
        Ok(())
    }

    /// fsyncs the active segment if anything was appended since the last sync.
    ///
    /// # Errors
    /// [`StorageError::Io`]: this fsync failed, or an earlier fsync of acknowledged records
    /// did. Either is final for this log: no later append or sync succeeds (see
    /// [`WalSync::Relaxed`]).
    pub fn sync(&self) -> Result<(), StorageError> {
        let mut g = self.lock();
        g.refuse_if_failed()?;
        if !g.unsynced {
            return Ok(());
        }
        if let Some(a) = g.active.as_mut() {
            let path = self.dir.join(seg_name(a.seg.id));
            if let Err(e) = a.file.sync_all() {
                return Err(g.fail_sync(path, e));
            }
        }
        g.unsynced = false;
        Ok(())
    }

    /// True once an fsync of acknowledged records has failed ([`WalSync::Relaxed`]): the log
    /// takes no more records until the engine is reopened.
    pub fn has_failed(&self) -> bool {
        self.lock().failed.is_some()
    }

    /// Deletes every segment whose records are all covered: `covered(table, seq)` says whether
    /// table `table` has committed files containing its records up to `seq` (or was dropped).
    /// The active segment is closed first when it is fully covered. Returns segments removed.
    pub fn truncate(&self, covered: impl Fn(u64, u64) -> bool) -> usize {
        let gone = self.forget_covered(covered);
        self.remove_segments(&gone);
        gone.len()
    }

    /// The bookkeeping half of [`Self::truncate`]: forgets every fully covered segment (it no
    /// longer counts in [`Self::segment_count`] or [`Self::bytes`], and no record is appended
    /// to it) and returns their files, for [`Self::remove_segments`] now or later — on another
    /// thread, so a flush does not wait for the unlinks (~5 ms per 16 MiB segment on ext4
    /// here). A file not yet removed when the process dies holds only covered records: the
    /// next open skips them and removes it at its first truncation.
    pub fn forget_covered(&self, covered: impl Fn(u64, u64) -> bool) -> Vec<PathBuf> {
        let mut g = self.lock();
        let done = |s: &Segment| s.max_seq.iter().all(|(t, q)| covered(*t, *q));
        if g.active.as_ref().is_some_and(|a| a.seg.bytes > 0 && done(&a.seg)) && !g.unsynced {
            let seg = g.active.take().map(|a| a.seg);
            g.closed.extend(seg);
        }
        let (gone, keep): (Vec<Segment>, Vec<Segment>) = std::mem::take(&mut g.closed).into_iter().partition(|s| done(s));
        g.closed = keep;
        drop(g);
        gone.iter().map(|s| self.dir.join(seg_name(s.id))).collect()
    }

    /// Removes segment files returned by [`Self::forget_covered`], then fsyncs the log
    /// directory. Errors are ignored (a file left behind is removed by a later truncation
    /// after the next open).
    pub fn remove_segments(&self, files: &[PathBuf]) {
        for f in files {
            let _ = self.vfs.remove_file(f);
        }
        if !files.is_empty() {
            let _ = self.vfs.sync_dir(&self.dir);
        }
    }

    /// Segment files currently kept (closed + active).
    pub fn segment_count(&self) -> usize {
        let g = self.lock();
        g.closed.len() + usize::from(g.active.is_some())
    }

    /// Bytes in kept segments.
    pub fn bytes(&self) -> u64 {
        let g = self.lock();
        g.closed.iter().map(|s| s.bytes).sum::<u64>() + g.active.as_ref().map_or(0, |a| a.seg.bytes)
    }

    /// Largest table id named by any kept record (so ids are never reused while the WAL still
    /// names them).
    pub fn max_table_id(&self) -> u64 {
        let g = self.lock();
        g.closed.iter().chain(g.active.as_ref().map(|a| &a.seg)).flat_map(|s| s.max_seq.keys().copied()).max().unwrap_or(0)
    }
}

/// Bytes of the buffers in `ipc` that lie inside a buffer of one of `columns` (validity,
/// offsets, values, views, data buffers, and their children's): slices the IPC encoder took
/// of those arrays rather than copies. A buffer is inside when its whole address range is.
fn copy_slice_bytes(ipc: &[arrow_buffer::Buffer], columns: &[&arrow_array::ArrayRef]) -> usize {
    fn ranges(d: &arrow_data::ArrayData, out: &mut Vec<(usize, usize)>) {
        let span = |b: &arrow_buffer::Buffer| (b.as_ptr() as usize, b.as_ptr() as usize + b.len());
        out.extend(d.buffers().iter().map(span));
        out.extend(d.nulls().map(|n| span(n.buffer())));
        for c in d.child_data() {
            ranges(c, out);
        }
    }
    if columns.is_empty() {
        return 0;
    }
    let mut spans = Vec::new();
    for c in columns {
        ranges(&c.to_data(), &mut spans);
    }
    // Sorted by start, each with the furthest end of any span starting at or before it: a
    // buffer is inside some span exactly when that furthest end, over the spans starting at
    // or before its start, reaches its end. One binary search a buffer (a wide table of
    // thousands of copied columns would make a scan of every span per buffer quadratic).
    spans.sort_unstable();
    let mut furthest = 0;
    for span in &mut spans {
        furthest = furthest.max(span.1);
        span.1 = furthest;
    }
    ipc.iter()
        .filter(|b| {
            let (at, end) = (b.as_ptr() as usize, b.as_ptr() as usize + b.len());
            let before = spans.partition_point(|&(s, _)| s <= at);
            !b.is_empty() && before > 0 && spans[before - 1].1 >= end
        })
        .map(arrow_buffer::Buffer::len)
        .sum()
}

/// A `Decimal128` of precision ≤ 18 ([`arrow_schema::DECIMAL64_MAX_PRECISION`]): every value
/// of such a column fits an `i64` (|v| ≤ 10^18 − 1 < 2^63), so it is logged as `Decimal64`.
fn narrowable(t: &arrow_schema::DataType) -> bool {
    matches!(t, arrow_schema::DataType::Decimal128(p, _) if *p <= arrow_schema::DECIMAL64_MAX_PRECISION)
}

/// `batch` as it is logged, or `None` when it is logged as it is:
/// - top-level view columns (`Utf8View`, `BinaryView`) become `Binary` offset columns
///   ([`views_to_binary`]); when a batch's strings exceed `i32` offsets its views stay views;
/// - `Decimal128` columns of precision ≤ 18 become `Decimal64` of the same precision and
///   scale ([`narrow_decimal`]);
/// - byte columns whose null slots span at least [`crate::bytes::NULL_SPAN_COPY_BYTES`] of
///   values (`arrow::compute::nullif` keeps them) are copied without those values: the IPC
///   encoder writes an array's values from its first offset to its last, and a 2-row batch
///   whose null spanned 4 MiB was a 4 MiB record, refused at a 2 MiB limit (helper-45's F8;
///   `tests::a_nulls_span_of_values_is_not_logged`). The threshold is on the batch's spans
///   together, so many columns each spanning a little are copied too.
///
/// A view costs 16 bytes per value in Arrow IPC (plus the bytes of values over 12 bytes), an
/// offset 4 plus the value's bytes; such a decimal 16 bytes against 8. TPC-H lineitem records
/// shrink from 218 to 137 bytes per row, and a per-batch fsync costs about its bytes (a
/// `dd oflag=dsync` here: 1.4 MB writes 743 MB/s, 0.7 MB writes 873 MB/s). Replay casts back
/// to the table's types ([`WalRecord::batch_as`]).
///
/// Every part is reserved in `res` before it is allocated: per view column its `i32` offsets
/// (4 bytes a value, plus one) and a validity bitmap, then its value bytes (plus 16 of slack)
/// once the offsets have summed them; per narrowed decimal column 8 bytes a value and a
/// validity bitmap. (The value bytes used to be summed in a pass of their own before any
/// allocation, `total_bytes_len`: 61% of this function's own CPU in `gritdb-soak bench`,
/// docs/performance.md, twenty-seventh pass.)
///
/// # Errors
/// [`StorageError::Memory`] when a part cannot be reserved; [`StorageError::Arrow`] when a
/// view points outside its array's data buffers.
fn compact_for_log(batch: &RecordBatch, res: &mut Reservation) -> Result<Option<RecordBatch>, StorageError> {
    use arrow_array::cast::AsArray as _;
    use arrow_schema::{DataType, Field, Schema};
    let schema = batch.schema();
    let views = |t: &DataType| matches!(t, DataType::Utf8View | DataType::BinaryView);
    // Null spans of the batch's columns together: 40 columns each spanning 60,000 bytes made a
    // 2.4 MB record of a 2-row batch when the threshold was per column (helper-47's F4).
    let spans: Vec<usize> = batch.columns().iter().map(|c| crate::bytes::null_span_bytes(c.as_ref())).collect();
    let copy_spans = spans.iter().fold(0usize, |a, &b| a.saturating_add(b)) >= crate::bytes::NULL_SPAN_COPY_BYTES;
    // A string column whose null slots hold bytes that are not UTF-8 (or cut a character) is
    // copied whatever their size: the IPC encoder logs every byte between the first offset and
    // the last, and replay's IPC reader checks UTF-8 over every slot, nulls included — an
    // acknowledged 3-row insert made the next open refuse the directory (helper-50's F1). The
    // writes' check (`unify`'s `check_utf8`) has passed its valid values; this checks the
    // rest, for columns whose nulls span bytes only.
    let bad_null_text: Vec<bool> = batch
        .columns()
        .iter()
        .zip(&spans)
        .map(|(c, &span)| span > 0 && matches!(c.data_type(), DataType::Utf8 | DataType::LargeUtf8) && c.to_data().validate_values().is_err())
        .collect();
    let nulls_span = |i: usize| (copy_spans && spans[i] > 0) || bad_null_text[i];
    if !schema.fields().iter().enumerate().any(|(i, f)| views(f.data_type()) || narrowable(f.data_type()) || nulls_span(i)) {
        return Ok(None);
    }
    let mut fields = Vec::with_capacity(schema.fields().len());
    let mut cols: Vec<arrow_array::ArrayRef> = Vec::with_capacity(schema.fields().len());
    let mut changed = false;
    let n = batch.num_rows();
    let bitmap = n.div_ceil(8) + 128;
    for (i, (f, c)) in schema.fields().iter().zip(batch.columns()).enumerate() {
        let logged: Option<arrow_array::ArrayRef> = match f.data_type() {
            DataType::Utf8View => {
                res.try_grow(4 * (n + 1) + bitmap)?;
                views_to_binary(c.as_string_view(), &mut |b| Ok(res.try_grow(b + 16)?))?.map(|b| Arc::new(b) as _)
            }
            DataType::BinaryView => {
                res.try_grow(4 * (n + 1) + bitmap)?;
                views_to_binary(c.as_binary_view(), &mut |b| Ok(res.try_grow(b + 16)?))?.map(|b| Arc::new(b) as _)
            }
            t if narrowable(t) => {
                res.try_grow(8 * n + bitmap)?;
                narrow_decimal(c.as_primitive())?.map(|d| Arc::new(d) as _)
            }
            // Values its nulls span are not logged: `take` copies the valid ones alone (its
            // indices, offsets, bitmap and values reserved first).
            t if nulls_span(i) => {
                let width = if matches!(t, DataType::LargeUtf8 | DataType::LargeBinary) { 8 } else { 4 };
                res.try_grow(8 * n + width * (n + 1) + bitmap + crate::bytes::range_bytes(&c.to_data(), 0, n))?;
                let all = arrow_array::UInt64Array::from_iter_values(0..n as u64);
                Some(arrow_select::take::take(c.as_ref(), &all, None)?)
            }
            _ => None,
        };
        if let Some(col) = logged {
            fields.push(Arc::new(Field::new(f.name(), col.data_type().clone(), f.is_nullable()).with_metadata(f.metadata().clone())));
            cols.push(col);
            changed = true;
        } else {
            fields.push(Arc::clone(f));
            cols.push(Arc::clone(c));
        }
    }
    if !changed {
        return Ok(None);
    }
    Ok(Some(RecordBatch::try_new(Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone())), cols)?))
}

/// A `Decimal128` column of precision ≤ 18 as a `Decimal64` column of the same precision,
/// scale, values and validity, or `None` when a valid value does not fit an `i64` (a batch
/// that skipped validation; it is then logged as it is). Null slots are logged as their low
/// 8 bytes (their values are undefined either way).
///
/// # Errors
/// [`StorageError::Arrow`] when the precision and scale are not a valid `Decimal64` type.
fn narrow_decimal(a: &arrow_array::Decimal128Array) -> Result<Option<arrow_array::Decimal64Array>, StorageError> {
    let arrow_schema::DataType::Decimal128(precision, scale) = *arrow_array::Array::data_type(a) else { return Ok(None) };
    let nulls = arrow_array::Array::nulls(a).filter(|n| n.null_count() > 0);
    let fits = |v: i128| i64::try_from(v).is_ok();
    let all_fit = match nulls {
        None => a.values().iter().all(|&v| fits(v)),
        Some(n) => a.values().iter().enumerate().all(|(i, &v)| n.is_null(i) || fits(v)),
    };
    if !all_fit {
        return Ok(None);
    }
    // Truncation is exact for every valid value (checked above).
    #[allow(clippy::cast_possible_truncation)]
    let narrow = a.unary::<_, arrow_array::types::Decimal64Type>(|v| v as i64);
    Ok(Some(narrow.with_precision_and_scale(precision, scale)?))
}

/// The values of a view column as one `Binary` column with the same validity, or `None` when
/// they exceed `i32` offsets. Offsets are summed from the views' lengths and the bytes copied
/// from the views (values up to 12 bytes are inline) or the data buffers (Arrow columnar
/// format, "Variable-size Binary View Layout"). This replaces `arrow_cast`'s view → offset
/// cast, which appends value by value through a builder (`cast_view_to_byte`): that cast was
/// 31% of the WAL record thread's CPU in `gritdb-soak bench` (docs/performance.md, eighth
/// pass). No UTF-8 check: a `Utf8View` column's bytes are UTF-8 already, and replay checks
/// them again ([`WalRecord::batch_as`]).
///
/// `reserve` is called with the value bytes once the offsets have summed them, before the
/// value buffer (those bytes plus 16) is allocated.
///
/// # Errors
/// [`StorageError::Arrow`] when a view names a data buffer or a range its array does not have
/// (an array built without validation); whatever `reserve` returns.
fn views_to_binary<T: arrow_array::types::ByteViewType + ?Sized>(
    a: &arrow_array::GenericByteViewArray<T>,
    reserve: &mut impl FnMut(usize) -> Result<(), StorageError>,
) -> Result<Option<arrow_array::BinaryArray>, StorageError> {
    let views = a.views();
    let nulls = arrow_array::Array::nulls(a).filter(|n| n.null_count() > 0);
    let live = |i: usize| nulls.is_none_or(|n| n.is_valid(i));
    let mut offsets = Vec::with_capacity(views.len() + 1);
    offsets.push(0i32);
    let mut end = 0usize;
    for (i, &v) in views.iter().enumerate() {
        if live(i) {
            end += v as u32 as usize;
        }
        let Ok(at) = i32::try_from(end) else { return Ok(None) };
        offsets.push(at);
    }
    reserve(end)?;
    // 16 bytes of slack: an inline value is appended as all 12 inline bytes and cut back to
    // its length, so short values cost a fixed-size move, not a `memcpy` call. Appended, not
    // written into a zeroed buffer: zeroing it (`calloc` of a large extent) was 14% of the
    // WAL record thread's CPU (docs/performance.md, twenty-seventh pass).
    let mut values: Vec<u8> = Vec::with_capacity(end + 16);
    let buffers = a.data_buffers();
    for (i, &v) in views.iter().enumerate() {
        let len = v as u32 as usize;
        if len == 0 || !live(i) {
            continue;
        }
        if len <= 12 {
            let pos = values.len();
            values.extend_from_slice(&v.to_le_bytes()[4..]);
            values.truncate(pos + len);
        } else {
            let (buffer, offset) = ((v >> 64) as u32 as usize, (v >> 96) as u32 as usize);
            let src = buffers.get(buffer).and_then(|b| b.get(offset..offset + len)).ok_or_else(|| {
                arrow_schema::ArrowError::InvalidArgumentError(format!(
                    "view {i} names bytes {offset}..{} of data buffer {buffer}, which its array does not have",
                    offset + len
                ))
            })?;
            values.extend_from_slice(src);
        }
    }
    debug_assert_eq!(values.len(), end, "the offsets summed the same lengths");
    let offsets = arrow_buffer::OffsetBuffer::new(arrow_buffer::ScalarBuffer::from(offsets));
    Ok(Some(arrow_array::BinaryArray::try_new(offsets, arrow_buffer::Buffer::from_vec(values), nulls.cloned())?))
}

/// Replays one segment's records; for the last segment, also what its torn tail was, once
/// cut ([`TornTail`]).
fn read_segment<E: From<StorageError>>(
    path: &Path,
    id: u64,
    last: bool,
    replay: &mut impl FnMut(WalRecord) -> Result<(), E>,
) -> Result<(Segment, Option<TornTail>), E> {
    let data = fs::read(path).map_err(io(path)).map_err(E::from)?;
    let mut seg = Segment { id, bytes: 0, max_seq: HashMap::new() };
    let mut at = 0usize;
    let end = data.len();
    let mut torn_detail = String::new();
    while at < end {
        let mut torn = |detail: &str| -> Result<(), E> {
            if last {
                tracing::warn!(path = %path.display(), offset = at, detail, "dropping torn WAL tail");
                detail.clone_into(&mut torn_detail);
                Ok(())
            } else {
                Err(corrupt(path, at as u64, detail).into())
            }
        };
        if end - at < HEADER {
            torn("incomplete record header")?;
            break;
        }
        let len = u32::from_le_bytes(data[at..at + 4].try_into().expect("4 bytes")) as usize; // infallible
        let crc = u32::from_le_bytes(data[at + 4..at + 8].try_into().expect("4 bytes")); // infallible
        if len != 0 && !record_start_plausible(&data, at) {
            // A torn write leaves a prefix of what was written, or zeros where pages were not
            // written; never other bytes where the header says a record starts. Text or
            // another file's bytes here are not gritdb's: refused, the file left as it is
            // (before, such a last segment was cut to nothing as a "torn tail", then removed).
            return Err(corrupt(
                path,
                at as u64,
                "bytes that are not a record's (the payload's op byte is not 1 or 2): not a torn write; move the file away if it is not this log's",
            )
            .into());
        }
        if len == 0 {
            // No record is empty; zeros to the end are a preallocated or zero-filled tail.
            if data[at..].iter().all(|&b| b == 0) {
                torn("zero-length record (zero-filled tail)")?;
                break;
            }
            // A header page the crash did not write, with some of the record's later pages
            // written: a torn tail when no whole record follows. A whole record after it is
            // damage in front of records, never a torn tail.
            if whole_record_after(&data, at) {
                return Err(corrupt(path, at as u64, "zero-length record with whole records after it").into());
            }
            torn("zero-length record header with a partly written record after it")?;
            break;
        }
        if end - at - HEADER < len {
            // A torn write leaves only this record's partial payload behind it; a whole,
            // checksum-valid record further on means this header was damaged in the middle
            // of the log: acknowledged writes follow, so that is corruption, not a tail.
            if whole_record_after(&data, at) {
                return Err(corrupt(path, at as u64, "record length runs past the end, with whole records after it").into());
            }
            torn("record extends past the end of the segment")?;
            break;
        }
        let payload = &data[at + HEADER..at + HEADER + len];
        if crc32fast::hash(payload) != crc {
            // Records of one group commit reach the disk in any order, so a crash can leave
            // this record's page unwritten and part of the next one written (or zeros): a
            // torn tail when no whole record follows, as in the branches above. A whole
            // record after it is damage in front of acknowledged records: where the length
            // says the next record starts, or where the payload's own IPC stream ends (the
            // walk cannot see past damage in the stream's framing, the length can).
            let followed = whole_record_at(&data, at + HEADER + len) || whole_record_after(&data, at);
            if last && !followed {
                torn("checksum mismatch with no whole record after it")?;
                break;
            }
            return Err(corrupt(path, at as u64, "checksum mismatch with records after it").into());
        }
        let position = WalPosition { segment: path.to_path_buf(), offset: at as u64 };
        let rec = decode(payload, position).map_err(|d| E::from(corrupt(path, at as u64, d)))?;
        let e = seg.max_seq.entry(rec.table).or_insert(0);
        *e = (*e).max(rec.last_seq);
        replay(rec)?;
        at += HEADER + len;
    }
    let mut tail = None;
    if at < end {
        let f = fs::OpenOptions::new().write(true).open(path).map_err(io(path)).map_err(E::from)?;
        f.set_len(at as u64).and_then(|()| f.sync_all()).map_err(io(path)).map_err(E::from)?;
        tail = Some(TornTail { segment: path.to_path_buf(), offset: at as u64, bytes: (end - at) as u64, detail: torn_detail });
    }
    seg.bytes = at as u64;
    Ok((seg, tail))
}

/// Whether a record whose header (non-zero length) is at `at` could be one this log wrote,
/// torn or not: its payload's op byte is 1 or 2, or past the end (the record cut there), or 0
/// with zeros to the end of its 512-byte sector (a sector or page of the record the crash did
/// not write; `breaker_session13` zeroes a last record's payload from its op byte on). Text
/// at a record's start fails this (a printable byte), and so do files of other formats with a
/// byte other than 0, 1 or 2 there or other bytes after a 0 in its sector. Damage further
/// inside a last record is still taken for a torn tail (`breaker_trial2`: a flipped checksum,
/// IPC marker or payload byte then part of the next record); a crash cannot be told from
/// that damage there.
fn record_start_plausible(data: &[u8], at: usize) -> bool {
    const SECTOR: usize = 512;
    let op = at + HEADER;
    match data.get(op) {
        None | Some(1 | 2) => true,
        Some(0) => data[op..data.len().min((op / SECTOR + 1) * SECTOR)].iter().all(|&b| b == 0),
        Some(_) => false,
    }
}

/// Whether a whole record follows the record whose header (length or checksum untrustworthy)
/// is at `at`. The record's own payload is walked first, not searched: its 25-byte payload
/// header, then the Arrow IPC stream message by message (continuation marker, metadata
/// length, flatbuffer `Message`, `bodyLength` bytes of body; Arrow columnar format,
/// "Encapsulated message format") to the end-of-stream marker. User values live in message
/// bodies, which the walk steps over, so a value holding the bytes of a WAL record is never
/// taken for one (`breaker_session13::torn_tail_with_a_record_shaped_value_is_still_a_torn_tail`),
/// and the walk costs a few steps, not a pass over the record (the search this replaced was
/// quadratic in a torn record's size). Then:
/// - a message body runs past the end of the data (its length matching the message's own
///   buffers): this record is the torn tail, nothing follows;
/// - a metadata length runs past the end: a cut inside the metadata, or that length damaged
///   (`breaker_trial2::a_record_with_its_length_and_ipc_metadata_length_damaged_before_whole_records_is_corrupt`):
///   the rest, which holds no message body, is searched ([`record_shaped_at_any_offset`]);
/// - the stream ends: the payload is whole, only its header is damaged; what follows it is
///   zeros, the end, or records (corruption when one is whole);
/// - the bytes stop being a stream (a page the crash did not write, damage): nothing more is
///   known about where the record ends, so [`record_shaped_at_any_offset`] searches the rest.
fn whole_record_after(data: &[u8], mut at: usize) -> bool {
    let end = data.len();
    loop {
        let from = at + HEADER;
        if end - from < PAYLOAD_HEADER {
            return false;
        }
        let p = &data[from..];
        let seq = |i: usize| u64::from_le_bytes(p[i..i + 8].try_into().expect("8 bytes")); // infallible
        if !matches!(p[0], 1 | 2) || seq(9) > seq(17) {
            return record_shaped_at_any_offset(data, from);
        }
        match ipc_stream_end(data, from + PAYLOAD_HEADER) {
            IpcWalk::Garbage(g) => return record_shaped_at_any_offset(data, g),
            // A metadata length past the end: a write cut inside the metadata (which holds no
            // user values), or the length itself damaged, with records after it.
            IpcWalk::MetaRunsOff(meta) => return record_shaped_at_any_offset(data, meta),
            IpcWalk::End(next) if whole_record_at(data, next) => return true,
            // A second damaged header right after (not zeros to the end): walk that record too.
            IpcWalk::End(next) if end - next >= HEADER && !data[next..].iter().all(|&b| b == 0) => at = next,
            // A body runs off the end (its length checked against the message's buffers), or
            // the stream is followed by zeros or too few bytes for a header.
            IpcWalk::RunsOff | IpcWalk::End(_) => return false,
        }
    }
}

/// Where an Arrow IPC stream starting at `from` ends, per [`whole_record_after`].
enum IpcWalk {
    /// The offset just past the end-of-stream marker.
    End(usize),
    /// A message's body (or a marker) runs past the end of the data.
    RunsOff,
    /// A message's metadata length runs past the end of the data; the offset where its
    /// metadata starts. (A torn write can cut a record there, but so can damage to the
    /// length: the metadata is the schema and buffer layout, never user values, so the
    /// bytes from there on may be searched for records.)
    MetaRunsOff(usize),
    /// The bytes stop being an IPC message; the offset to search for records from: the
    /// metadata of the last message stepped over (its lengths may be what went wrong), or the
    /// stream's start.
    Garbage(usize),
}

fn ipc_stream_end(data: &[u8], from: usize) -> IpcWalk {
    const CONTINUATION: [u8; 4] = [0xff; 4];
    let end = data.len();
    let mut pos = from;
    // Where a search must start when the bytes stop being a stream: the metadata of the last
    // message stepped over, since a damaged length in it (the flatbuffer still parses with
    // bytes after its tables) steps past the record's end into the next record, and
    // searching only from there misses that record's start
    // (`breaker_trial3::a_stretched_ipc_length_in_a_record_before_the_last_is_corrupt_wal`).
    let mut search = from;
    loop {
        if end - pos < 8 {
            // A prefix of a continuation marker and length is still a stream cut short.
            let have = &data[pos..];
            let n = have.len().min(4);
            return if have[..n] == CONTINUATION[..n] { IpcWalk::RunsOff } else { IpcWalk::Garbage(search) };
        }
        if data[pos..pos + 4] != CONTINUATION {
            return IpcWalk::Garbage(search);
        }
        let Ok(meta) = usize::try_from(i32::from_le_bytes(data[pos + 4..pos + 8].try_into().expect("4 bytes"))) else {
            return IpcWalk::Garbage(search); // infallible slice; a negative length is garbage
        };
        if meta == 0 {
            return IpcWalk::End(pos + 8);
        }
        if end - pos - 8 < meta {
            return IpcWalk::MetaRunsOff(pos + 8);
        }
        let Ok(message) = arrow_ipc::root_as_message(&data[pos + 8..pos + 8 + meta]) else { return IpcWalk::Garbage(search) };
        let Ok(body) = usize::try_from(message.bodyLength()) else { return IpcWalk::Garbage(search) };
        if !body_length_matches_buffers(&message, body) {
            return IpcWalk::Garbage(search);
        }
        match (pos + 8 + meta).checked_add(body) {
            Some(next) if next <= end => {
                search = pos + 8;
                pos = next;
            }
            _ => return IpcWalk::RunsOff,
        }
    }
}

/// Whether a message's `bodyLength` is what its own buffers take: 0 for a schema; for a
/// record or dictionary batch at least the end of its last buffer and less than that plus 64
/// (the largest IPC body alignment; Arrow columnar format, "Encapsulated message format":
/// buffers are padded to 8 or 64 bytes). A damaged body length is then told from a body a
/// torn write cut short, so the walk does not take it for the end of the data.
fn body_length_matches_buffers(message: &arrow_ipc::Message<'_>, body: usize) -> bool {
    let batch = match message.header_type() {
        arrow_ipc::MessageHeader::Schema => return body == 0,
        arrow_ipc::MessageHeader::RecordBatch => message.header_as_record_batch(),
        arrow_ipc::MessageHeader::DictionaryBatch => message.header_as_dictionary_batch().and_then(|d| d.data()),
        _ => return true,
    };
    let Some(buffers) = batch.and_then(|b| b.buffers()) else { return body < 64 };
    // A negative offset or length is no buffer (arrow-ipc would slice by it as a `usize`).
    if buffers.iter().any(|b| b.offset() < 0 || b.length() < 0) {
        return false;
    }
    let last = buffers.iter().map(|b| b.offset().saturating_add(b.length())).max().unwrap_or(0);
    usize::try_from(last).is_ok_and(|last| last <= body && body < last.saturating_add(64))
}

/// Whether a whole record — a header whose length fits, a payload of a known op with
/// `first_seq <= last_seq` whose IPC stream starts with a continuation marker and ends with
/// the end-of-stream marker, and a matching checksum — starts at `q`.
fn whole_record_at(data: &[u8], q: usize) -> bool {
    let end = data.len();
    if end - q < HEADER + PAYLOAD_HEADER + 8 {
        return false;
    }
    let len = u32::from_le_bytes([data[q], data[q + 1], data[q + 2], data[q + 3]]) as usize;
    if len < PAYLOAD_HEADER + 16 || end - q - HEADER < len {
        return false;
    }
    let p = &data[q + HEADER..q + HEADER + len];
    let seq = |i: usize| u64::from_le_bytes(p[i..i + 8].try_into().expect("8 bytes")); // infallible
    matches!(p[0], 1 | 2)
        && seq(9) <= seq(17)
        && p[PAYLOAD_HEADER..PAYLOAD_HEADER + 4] == [0xff; 4]
        && p[len - 8..] == [0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0]
        && crc32fast::hash(p) == u32::from_le_bytes([data[q + 4], data[q + 5], data[q + 6], data[q + 7]])
}

/// Whether [`whole_record_at`] holds at any offset from `from` on: the fallback when the
/// bytes at a damaged record stop being its payload. The cheap checks (op byte, sequence
/// order, the IPC stream's first and last markers) run before the checksum, so it runs at
/// few offsets unless the bytes are built to pass them.
fn record_shaped_at_any_offset(data: &[u8], from: usize) -> bool {
    (from..data.len()).any(|q| whole_record_at(data, q))
}

fn decode(payload: &[u8], position: WalPosition) -> Result<WalRecord, String> {
    if payload.len() < PAYLOAD_HEADER {
        return Err("record shorter than its header".into());
    }
    let op = match payload[0] {
        1 => WalOp::Put,
        2 => WalOp::Delete,
        other => return Err(format!("unknown op {other}")),
    };
    let u64_at = |i: usize| u64::from_le_bytes(payload[i..i + 8].try_into().expect("8 bytes")); // infallible
    let (table, first_seq, last_seq) = (u64_at(1), u64_at(9), u64_at(17));
    // Replay continues numbering at `last_seq + 1` and the manifest's `flushed_seq` covers
    // every record up to it: a record claiming a number near `u64::MAX` (or a reversed range)
    // would wrap the sequence, and later acknowledged writes would be skipped as already
    // flushed or numbered `u64::MAX` (refused at the next open). See [`SEQ_LIMIT`].
    if first_seq > last_seq || last_seq >= SEQ_LIMIT || first_seq == 0 {
        return Err(format!("the record's sequence numbers {first_seq}..={last_seq} are out of range"));
    }
    // The stream's framing is walked before arrow-ipc reads it: its reader allocates a
    // message's `bodyLength` before reading the body (a damaged length under a valid checksum
    // asked for 512 GB and aborted the process) and slices buffers by offsets it does not
    // check against the body (a panic). The walk checks every metadata and body length
    // against the bytes there, and each body against its own buffers; a record as written
    // ends in the end-of-stream marker exactly at the payload's end.
    if !matches!(ipc_stream_end(payload, PAYLOAD_HEADER), IpcWalk::End(end) if end == payload.len()) {
        return Err("the record's Arrow IPC stream is malformed (a message length or buffer outside the record)".into());
    }
    // arrow-ipc still panics on some metadata a checksum-valid record can hold (an integer
    // width or float precision it does not know, a validity buffer shorter than its array:
    // `expect`s and asserts in its schema conversion and array building). The decode reads
    // nothing but `payload`, so a panic in it leaves no state behind: it is this record's
    // error.
    let read = || -> Result<RecordBatch, String> {
        let mut reader = StreamReader::try_new(&payload[PAYLOAD_HEADER..], None).map_err(|e| e.to_string())?;
        reader.next().ok_or("no batch in record")?.map_err(|e| e.to_string())
    };
    let batch = std::panic::catch_unwind(read).map_err(|p| {
        let text = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()));
        format!("the record's Arrow IPC stream cannot be decoded: {}", text.unwrap_or_else(|| "the decoder panicked".into()))
    })??;
    Ok(WalRecord { op, table, first_seq, last_seq, batch, position })
}

/// Decodes one WAL segment's bytes without side effects, for fuzzing and inspection: returns
/// the records and the offset where decoding stopped.
///
/// # Errors
/// The first malformed record, as text with its offset.
pub fn decode_segment(data: &[u8]) -> Result<Vec<WalRecord>, (usize, String)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + HEADER <= data.len() {
        let len = u32::from_le_bytes(data[at..at + 4].try_into().expect("4 bytes")) as usize; // infallible
        let crc = u32::from_le_bytes(data[at + 4..at + 8].try_into().expect("4 bytes")); // infallible
        if data.len() - at - HEADER < len {
            return Err((at, "record extends past the end".into()));
        }
        let payload = &data[at + HEADER..at + HEADER + len];
        if crc32fast::hash(payload) != crc {
            return Err((at, "checksum mismatch".into()));
        }
        out.push(decode(payload, WalPosition { segment: PathBuf::new(), offset: at as u64 }).map_err(|d| (at, d))?);
        at += HEADER + len;
    }
    Ok(out)
}

impl Drop for Wal {
    fn drop(&mut self) {
        let _ = self.sync();
    }
}

/// The data directory's WAL folder name.
pub const WAL_DIR: &str = "wal";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vfs::StdFs;
    use arrow_array::{Array, Int32Array, StringViewArray};
    use arrow_ipc::writer::StreamWriter;
    use arrow_schema::{DataType, Field, Schema};
    use gritdb_memctl::ControllerConfig;

    /// The batch as `StreamWriter` writes it, after the log's compact copy.
    fn stream_writer_bytes(batch: &RecordBatch) -> Vec<u8> {
        let mut res = Reservation::new(&MemoryController::new(ControllerConfig::default()).unwrap(), Category::WriteBuffers, None);
        let compact = compact_for_log(batch, &mut res).unwrap();
        let batch = compact.as_ref().unwrap_or(batch);
        let mut out = Vec::new();
        let mut w = StreamWriter::try_new(&mut out, batch.schema_ref()).unwrap();
        w.write(batch).unwrap();
        w.finish().unwrap();
        out
    }

    /// A record written from the IPC encoder's buffers with vectored writes holds exactly the
    /// bytes `StreamWriter` wrote into one buffer before: full, sliced (at bit and byte
    /// offsets, so offsets are re-based and bitmaps shifted), empty, with nulls, views,
    /// decimals and a dictionary column. The segment is the frame, the payload header and
    /// those bytes, one record after the other, and replays to the same rows; the write
    /// buffers come back to the byte.
    #[test]
    fn a_record_written_in_parts_is_byte_for_byte_the_ipc_stream() {
        use arrow_array::{Decimal128Array, DictionaryArray, Int64Array, StringArray, types::Int16Type};
        let dir = tempfile::tempdir().unwrap();
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), ..ControllerConfig::default() }).unwrap();
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("s", DataType::Utf8, true),
            Field::new("v", DataType::Utf8View, true),
            Field::new("d", DataType::Decimal128(12, 2), true),
            Field::new("e", DataType::Dictionary(Box::new(DataType::Int16), Box::new(DataType::Utf8)), true),
        ]));
        let n = 5000;
        let strings: Vec<Option<String>> = (0..n).map(|i| (i % 7 != 0).then(|| format!("value-{}", "x".repeat(i % 40)))).collect();
        let dict: DictionaryArray<Int16Type> = (0..n).map(|i| (i % 5 != 0).then(|| ["a", "bb", "ccc"][i % 3])).collect();
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from_iter_values(0..n as i64)),
                Arc::new(strings.iter().cloned().collect::<StringArray>()),
                Arc::new(strings.iter().cloned().collect::<StringViewArray>()),
                Arc::new((0..n).map(|i| (i % 11 != 0).then_some(i as i128 * 7)).collect::<Decimal128Array>().with_precision_and_scale(12, 2).unwrap()),
                Arc::new(dict),
            ],
        )
        .unwrap();
        let wal = Wal::open(dir.path(), Arc::new(StdFs), WalSync::PerBatch, &ctl, |_| Ok::<(), StorageError>(())).unwrap();
        let buffers = |ctl: &Arc<MemoryController>| ctl.report().categories.iter().find(|c| c.category == Category::WriteBuffers).unwrap().bytes;
        let before = buffers(&ctl);
        let parts = [batch.clone(), batch.slice(3, 1000), batch.slice(8, 4000), batch.slice(4999, 1), batch.slice(10, 0)];
        let mut want = Vec::new();
        for (i, b) in parts.iter().enumerate() {
            let ipc = stream_writer_bytes(b);
            let seq = i as u64 * 10_000 + 1;
            wal.append(WalOp::Put, 3, seq, seq + b.num_rows().max(1) as u64 - 1, b).unwrap();
            want.push(ipc);
        }
        assert_eq!(buffers(&ctl), before, "every record's reservation is released after its append");
        drop(wal);
        let seg = std::fs::read(dir.path().join(seg_name(1))).unwrap();
        let mut at = 0;
        for (i, ipc) in want.iter().enumerate() {
            let len = u32::from_le_bytes(seg[at..at + 4].try_into().unwrap()) as usize;
            assert_eq!(len, PAYLOAD_HEADER + ipc.len(), "record {i}'s length");
            assert_eq!(&seg[at + HEADER + PAYLOAD_HEADER..at + HEADER + len], &ipc[..], "record {i}'s IPC bytes");
            at += HEADER + len;
        }
        assert_eq!(at, seg.len(), "nothing but the records");
        let recs = replayed(dir.path(), &ctl);
        assert_eq!(recs.len(), parts.len());
        for (rec, b) in recs.iter().zip(&parts) {
            assert_eq!(&rec.batch_as(&schema).unwrap(), b);
        }
    }

    /// A file that takes a vectored write a few bytes at a time still gets the whole record,
    /// in order; one that takes nothing is `WriteZero`, not a loop.
    #[test]
    fn a_vectored_record_is_written_whole_through_short_writes() {
        struct Short(Vec<u8>, usize);
        impl std::io::Write for Short {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                let n = buf.len().min(self.1);
                self.0.extend_from_slice(&buf[..n]);
                Ok(n)
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        impl VfsFile for Short {
            fn sync_all(&mut self) -> std::io::Result<()> {
                Ok(())
            }
            fn len(&self) -> std::io::Result<u64> {
                Ok(self.0.len() as u64)
            }
        }
        let parts: Vec<Vec<u8>> = vec![vec![1; 5], vec![], vec![2; 17], vec![3; 1], vec![4; 40]];
        let want: Vec<u8> = parts.concat();
        for step in [1, 3, 7, 64] {
            let mut f = Short(Vec::new(), step);
            let mut slices: Vec<std::io::IoSlice<'_>> = parts.iter().map(|p| std::io::IoSlice::new(p)).collect();
            crate::vfs::write_all_vectored(&mut f, &mut slices).unwrap();
            assert_eq!(f.0, want, "{step} bytes a write");
        }
        let mut f = Short(Vec::new(), 0);
        let mut slices: Vec<std::io::IoSlice<'_>> = parts.iter().map(|p| std::io::IoSlice::new(p)).collect();
        assert_eq!(crate::vfs::write_all_vectored(&mut f, &mut slices).unwrap_err().kind(), std::io::ErrorKind::WriteZero);
    }

    /// A record of a view batch is stored with offset columns and fewer bytes than the same
    /// batch's IPC with views; `batch_as` gives back the views with equal values, and the
    /// write buffers are released once the record is written.
    #[test]
    fn view_columns_are_logged_compact_and_restored() {
        let dir = tempfile::tempdir().unwrap();
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), ..ControllerConfig::default() }).unwrap();
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int32, false), Field::new("s", DataType::Utf8View, true)]));
        let vals: Vec<Option<String>> = (0..2000).map(|i| (i % 9 != 0).then(|| "v".repeat(i % 30))).collect();
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![Arc::new(Int32Array::from_iter_values(0..2000)), Arc::new(vals.iter().cloned().collect::<StringViewArray>())],
        )
        .unwrap();
        let wal = Wal::open(dir.path(), Arc::new(StdFs), WalSync::PerBatch, &ctl, |_| Ok::<(), StorageError>(())).unwrap();
        let before = ctl.report().categories.iter().find(|c| c.category == Category::WriteBuffers).unwrap().bytes;
        wal.append(WalOp::Put, 7, 1, 2000, &batch).unwrap();
        let after = ctl.report().categories.iter().find(|c| c.category == Category::WriteBuffers).unwrap().bytes;
        assert_eq!(after, before, "the record's buffers are released after the append");
        let mut with_views = Vec::new();
        {
            let mut w = StreamWriter::try_new(&mut with_views, &schema).unwrap();
            w.write(&batch).unwrap();
            w.finish().unwrap();
        }
        let logged = wal.bytes() as usize;
        assert!(logged < with_views.len(), "logged {logged} bytes, IPC with views {}", with_views.len());
        drop(wal);
        let recs = replayed(dir.path(), &ctl);
        assert_eq!(recs.len(), 1);
        assert_eq!(recs[0].batch.schema().field(1).data_type(), &DataType::Binary);
        let back = recs[0].batch_as(&schema).unwrap();
        assert_eq!(back.schema().field(1).data_type(), &DataType::Utf8View);
        let s = back.column(1).as_any().downcast_ref::<StringViewArray>().unwrap();
        let got: Vec<Option<String>> = (0..s.len()).map(|i| (!s.is_null(i)).then(|| s.value(i).to_string())).collect();
        assert_eq!(got, vals);
    }

    /// A record of a view column holds its compact copy once: the IPC encoder writes the
    /// copy's offsets, values and bitmap as slices, and the record counted them again beside
    /// the copy (helper-48's F1: at 2 MiB, two 404 KB `Utf8View` values were refused where
    /// `Utf8` took them). Exactly: copy (offsets 4 × (n + 1) and bitmap n / 8 + 128 bytes, then
    /// values + 16) plus the IPC buffers that are not its slices; for the `Utf8` batch, its IPC
    /// buffers. The view record holds at most 2 KiB more than the `Utf8` one.
    #[test]
    fn a_view_columns_copy_is_counted_once() {
        const LEN: usize = 404_000;
        let dir = tempfile::tempdir().unwrap();
        let ctl = MemoryController::new(ControllerConfig::default()).unwrap();
        let wal = Wal::open(dir.path(), Arc::new(StdFs), WalSync::PerBatch, &ctl, |_| Ok::<(), StorageError>(())).unwrap();
        let held = || ctl.report().categories.iter().find(|c| c.category == Category::WriteBuffers).unwrap().bytes;
        let (a, b) = ("a".repeat(LEN), "b".repeat(LEN));
        let batch = |t: DataType| {
            let s = arrow_cast::cast(&arrow_array::StringArray::from(vec![a.as_str(), b.as_str()]), &t).unwrap();
            RecordBatch::try_new(Arc::new(Schema::new(vec![Field::new("s", t, true)])), vec![s]).unwrap()
        };
        let before = held();
        let plain = wal.encode_record(WalOp::Put, &batch(DataType::Utf8)).unwrap();
        let plain_held = held() - before;
        assert_eq!(plain_held, plain.ipc_len, "a Utf8 record holds its IPC buffers");
        for t in [DataType::Utf8View, DataType::BinaryView] {
            let rec = wal.encode_record(WalOp::Put, &batch(t.clone())).unwrap();
            let copy = 4 * 3 + (2usize.div_ceil(8) + 128) + 2 * LEN + 16;
            let copied_in_ipc = 4 * 3 + 2 * LEN; // offsets and values (no nulls: no bitmap)
            let view_held = held() - before - plain_held;
            assert_eq!(view_held, copy + rec.ipc_len - copied_in_ipc, "{t}");
            assert!(view_held < plain_held + 2048, "{t}: {view_held} bytes against Utf8's {plain_held}");
            drop(rec);
        }
        drop(plain);
        assert_eq!(held(), before);
    }

    /// `views_to_binary` gives the values, nulls and lengths `arrow_cast`'s view → offset cast
    /// gives: inline (≤ 12 bytes) and buffer values, empty values, nulls, a sliced array
    /// (views from the middle of the parent), and a `BinaryView` column with non-UTF-8 bytes.
    #[test]
    fn views_to_binary_matches_the_arrow_cast() {
        use arrow_array::{BinaryArray, BinaryViewArray, StringViewArray};
        let vals: Vec<Option<String>> = (0..3000).map(|i| (i % 7 != 3).then(|| format!("{i:x}").repeat(i % 11))).collect();
        let full: StringViewArray = vals.iter().cloned().collect();
        for (start, len) in [(0, 3000), (1, 2998), (1013, 977), (2999, 1), (5, 0)] {
            let a = full.slice(start, len);
            let got = views_to_binary(&a, &mut |_| Ok(())).unwrap().unwrap();
            let want = arrow_cast::cast(&a, &DataType::Binary).unwrap();
            let want = want.as_any().downcast_ref::<BinaryArray>().unwrap();
            assert_eq!(&got, want, "slice {start}+{len}");
            assert_eq!(got.null_count(), vals[start..start + len].iter().filter(|v| v.is_none()).count());
            let bytes: usize = vals[start..start + len].iter().flatten().map(String::len).sum();
            assert_eq!(got.value_data().len(), bytes, "slice {start}+{len}");
        }
        let raw: Vec<Option<Vec<u8>>> = (0..500u32).map(|i| (i % 5 != 0).then(|| (0..i % 40).map(|b| (b as u8) ^ 0xff).collect())).collect();
        let bv: BinaryViewArray = raw.iter().map(|v| v.as_deref()).collect();
        let got = views_to_binary(&bv, &mut |_| Ok(())).unwrap().unwrap();
        let back: Vec<Option<Vec<u8>>> = got.iter().map(|v| v.map(<[u8]>::to_vec)).collect();
        assert_eq!(back, raw);
    }

    /// The compact copy is reserved before it is allocated, part by part: a view batch whose
    /// value bytes (8 MB) exceed a 4 MiB limit, while its offsets (160 KB) fit, is refused
    /// with `StorageError::Memory`, nothing is logged, and `write_buffers` is back at its
    /// baseline to the byte; a batch of the same rows with 40-byte values is logged.
    #[test]
    fn a_record_whose_compact_copy_exceeds_the_limit_is_refused_whole() {
        let dir = tempfile::tempdir().unwrap();
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(4 << 20), ..ControllerConfig::default() }).unwrap();
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int32, false), Field::new("s", DataType::Utf8View, false)]));
        let rows = 40_000;
        let batch_of = |len: usize| {
            let s: StringViewArray = (0..rows).map(|i| Some(format!("{i:0len$}"))).collect();
            RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(Int32Array::from_iter_values(0..rows)), Arc::new(s)]).unwrap()
        };
        let wal = Wal::open(dir.path(), Arc::new(StdFs), WalSync::PerBatch, &ctl, |_| Ok::<(), StorageError>(())).unwrap();
        let buffers = || ctl.report().categories.iter().find(|c| c.category == Category::WriteBuffers).unwrap().bytes;
        let before = buffers();
        let err = wal.append(WalOp::Put, 1, 1, rows as u64, &batch_of(200)).unwrap_err();
        assert!(matches!(err, StorageError::Memory(_)), "{err}");
        assert_eq!(buffers(), before, "the offsets' reservation is released with the refused values'");
        assert_eq!(wal.bytes(), 0, "nothing of the refused record is logged");
        wal.append(WalOp::Put, 1, 1, rows as u64, &batch_of(40)).unwrap();
        assert_eq!(buffers(), before);
        assert!(wal.bytes() > 40 * rows as u64, "{} bytes logged", wal.bytes());
        drop(wal);
        assert_eq!(replayed_rows(dir.path(), &ctl), rows as usize);
    }

    /// A record whose `Binary` column holds bytes that are not UTF-8 does not replay into a
    /// `Utf8View` column: `batch_as` returns an error, never the value as a null.
    #[test]
    fn batch_as_refuses_non_utf8_bytes_for_a_string_column() {
        use arrow_array::BinaryArray;
        let got = Arc::new(Schema::new(vec![Field::new("s", DataType::Binary, true)]));
        let want = Schema::new(vec![Field::new("s", DataType::Utf8View, true)]);
        let bad = BinaryArray::from_iter_values([&b"ok"[..], &[0xff, 0xfe][..]]);
        let rec = WalRecord {
            op: WalOp::Put,
            table: 1,
            first_seq: 1,
            last_seq: 2,
            batch: RecordBatch::try_new(got, vec![Arc::new(bad)]).unwrap(),
            position: WalPosition { segment: PathBuf::new(), offset: 0 },
        };
        assert!(matches!(rec.batch_as(&want), Err(StorageError::Arrow(_))));
    }

    fn keyed(first: i32, rows: i32, text: &str) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int32, false), Field::new("s", DataType::Utf8, false)]));
        let texts: Vec<&str> = (0..rows).map(|_| text).collect();
        RecordBatch::try_new(schema, vec![Arc::new(Int32Array::from_iter_values(first..first + rows)), Arc::new(arrow_array::StringArray::from(texts))])
            .unwrap()
    }

    /// Decimals of precision ≤ 18 are logged as `Decimal64` and come back from `batch_as`
    /// bit for bit: the extremes of precision 18 (±(10^18 − 1)), nulls whose slots hold values
    /// no `i64` holds, and a sliced batch. A precision-19 column and a precision-18 column
    /// holding a value past `i64` (a batch that skipped validation) are logged as they are.
    /// The record is 8 bytes a value smaller than the same batch's IPC for each narrowed column.
    #[test]
    fn decimals_of_precision_18_are_logged_in_8_bytes_and_restored() {
        use arrow_array::Decimal128Array;
        use arrow_array::cast::AsArray as _;
        use arrow_buffer::{NullBuffer, ScalarBuffer};
        let dir = tempfile::tempdir().unwrap();
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), ..ControllerConfig::default() }).unwrap();
        let max18 = 10i128.pow(18) - 1;
        let n = 3000usize;
        let vals: Vec<i128> = (0..n as i128)
            .map(|i| match i % 5 {
                0 => max18,
                1 => -max18,
                2 => i * 7 - 9000,
                3 => i128::MAX,
                _ => 0,
            })
            .collect();
        // Row i % 5 == 3 is null and its slot holds i128::MAX: undefined, never read back.
        let nulls = NullBuffer::from((0..n).map(|i| i % 5 != 3).collect::<Vec<_>>());
        let d18 = Decimal128Array::new(ScalarBuffer::from(vals.clone()), Some(nulls)).with_precision_and_scale(18, 4).unwrap();
        let d19 = Decimal128Array::from_iter_values((0..n as i128).map(|i| i * 1_000_000_007)).with_precision_and_scale(19, 0).unwrap();
        // Precision 15 by type, but one valid value past i64: not narrowed (nothing validated it).
        let wide = Decimal128Array::from_iter_values((0..n as i128).map(|i| if i == 17 { i128::from(i64::MAX) + 1 } else { i }))
            .with_precision_and_scale(15, 2)
            .unwrap();
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int32, false),
            Field::new("d18", DataType::Decimal128(18, 4), true),
            Field::new("d19", DataType::Decimal128(19, 0), false),
            Field::new("wide", DataType::Decimal128(15, 2), false),
        ]));
        let batch =
            RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(Int32Array::from_iter_values(0..n as i32)), Arc::new(d18), Arc::new(d19), Arc::new(wide)])
                .unwrap();
        let slice = batch.slice(1001, 777);
        let wal = Wal::open(dir.path(), Arc::new(StdFs), WalSync::PerBatch, &ctl, |_| Ok::<(), StorageError>(())).unwrap();
        wal.append(WalOp::Put, 7, 1, n as u64, &batch).unwrap();
        let first = wal.bytes() as usize;
        wal.append(WalOp::Put, 7, 3001, 3777, &slice).unwrap();
        let mut plain = Vec::new();
        {
            let mut w = StreamWriter::try_new(&mut plain, &schema).unwrap();
            w.write(&batch).unwrap();
            w.finish().unwrap();
        }
        // One narrowed column: 8 bytes a row fewer, less up to 64 bytes of IPC padding.
        let record = first - HEADER - PAYLOAD_HEADER;
        assert!(record + 8 * n <= plain.len() + 64 && record + 8 * n + 64 >= plain.len(), "record {record} B, plain IPC {} B", plain.len());
        drop(wal);
        let recs = replayed(dir.path(), &ctl);
        assert_eq!(recs.len(), 2);
        let logged = recs[0].batch.schema();
        assert_eq!(logged.field(1).data_type(), &DataType::Decimal64(18, 4));
        assert_eq!(logged.field(2).data_type(), &DataType::Decimal128(19, 0));
        assert_eq!(logged.field(3).data_type(), &DataType::Decimal128(15, 2));
        for (rec, want) in recs.iter().zip([&batch, &slice]) {
            let back = rec.batch_as(&schema).unwrap();
            assert_eq!(back.schema(), schema);
            for c in 0..4 {
                let (g, w) = (back.column(c), want.column(c));
                assert_eq!(g.len(), w.len());
                assert_eq!(g.logical_nulls(), w.logical_nulls(), "column {c}");
                if c == 0 {
                    assert_eq!(g.as_primitive::<arrow_array::types::Int32Type>(), w.as_primitive::<arrow_array::types::Int32Type>());
                    continue;
                }
                let (g, w) = (g.as_primitive::<arrow_array::types::Decimal128Type>(), w.as_primitive::<arrow_array::types::Decimal128Type>());
                let valid: Vec<Option<i128>> = w.iter().collect();
                assert_eq!(g.iter().collect::<Vec<_>>(), valid, "column {c}");
            }
        }
        let d = recs[0].batch_as(&schema).unwrap();
        let d = d.column(1).as_primitive::<arrow_array::types::Decimal128Type>();
        assert_eq!((d.value(0), d.value(1), d.value(2), d.is_null(3)), (max18, -max18, 2 * 7 - 9000, true));
    }

    /// A byte column whose null spans 4,000,000 bytes of values (`nullif`) is logged without
    /// them: the record of its two rows is under 4 KiB at a 2 MiB limit (it was 4 MB, refused),
    /// the write buffers come back to 0, and replay gives the same rows. A null spanning less
    /// than `NULL_SPAN_COPY_BYTES` is logged as it is.
    #[test]
    fn a_nulls_span_of_values_is_not_logged() {
        use arrow_array::{BooleanArray, Int64Array, LargeStringArray, StringArray};
        let dir = tempfile::tempdir().unwrap();
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(2 << 20), ..ControllerConfig::default() }).unwrap();
        let long = "x".repeat(4_000_000);
        let nullif = |a: &dyn Array| arrow_select::nullif::nullif(a, &BooleanArray::from(vec![true, false])).unwrap();
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("s", DataType::Utf8, true),
            Field::new("l", DataType::LargeUtf8, true),
        ]));
        // Keys `k, k + 1`; row 0 nulled over `nulled` in both columns, row 1 `s` and `l`.
        let rows = |k: i64, nulled: &str, s: &str, l: &str| {
            let cols: Vec<Arc<dyn Array>> =
                vec![Arc::new(Int64Array::from(vec![k, k + 1])), nullif(&StringArray::from(vec![nulled, s])), nullif(&LargeStringArray::from(vec![nulled, l]))];
            RecordBatch::try_new(Arc::clone(&schema), cols).unwrap()
        };
        let batch = rows(1, &long, "hello", "world");
        let wal = Wal::open(dir.path(), Arc::new(StdFs), WalSync::PerBatch, &ctl, |_| Ok::<(), StorageError>(())).unwrap();
        wal.append(WalOp::Put, 7, 1, 2, &batch).unwrap();
        assert!(wal.bytes() < 4096, "record of {} bytes", wal.bytes());
        assert_eq!(ctl.category_bytes(Category::WriteBuffers), 0);
        // Under the copy's threshold: logged as it is, the short null span in the record.
        let small = rows(3, &"y".repeat(1000), "a", "b");
        let before = wal.bytes();
        wal.append(WalOp::Put, 7, 3, 4, &small).unwrap();
        assert!(wal.bytes() - before > 2000, "record of {} bytes", wal.bytes() - before);
        drop(wal);
        let recs = replayed(dir.path(), &ctl);
        assert_eq!(recs.len(), 2);
        for (rec, want) in recs.iter().zip([&batch, &small]) {
            let back = rec.batch_as(&schema).unwrap();
            assert_eq!(back.num_rows(), 2);
            for c in 0..3 {
                assert_eq!(back.column(c).logical_nulls(), want.column(c).logical_nulls(), "column {c}");
            }
            assert_eq!(
                back.column(1).as_any().downcast_ref::<StringArray>().unwrap().value(1),
                want.column(1).as_any().downcast_ref::<StringArray>().unwrap().value(1)
            );
            assert_eq!(
                back.column(2).as_any().downcast_ref::<LargeStringArray>().unwrap().value(1),
                want.column(2).as_any().downcast_ref::<LargeStringArray>().unwrap().value(1)
            );
        }
        assert_eq!(ctl.category_bytes(Category::WriteBuffers), 0);
    }

    /// Null spans under the copy threshold each, over it together: 40 `Utf8` columns whose
    /// row-0 null spans 60,000 bytes each (2.4 MB in all) made a 2.4 MB record, refused at
    /// 2 MiB (helper-47's F4). Now every spanning column is copied: the record is small, and
    /// replay gives the valid values back and the nulls as nulls.
    #[test]
    fn null_spans_under_the_threshold_each_are_copied_together() {
        use arrow_array::{BooleanArray, Int64Array, StringArray};
        const COLUMNS: usize = 40;
        const { assert!(60_000 < crate::bytes::NULL_SPAN_COPY_BYTES && COLUMNS * 60_000 > 2 << 20) };
        let dir = tempfile::tempdir().unwrap();
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(2 << 20), ..ControllerConfig::default() }).unwrap();
        let mut fields = vec![Field::new("k", DataType::Int64, false)];
        fields.extend((0..COLUMNS).map(|i| Field::new(format!("s{i}"), DataType::Utf8, true)));
        let schema = Arc::new(Schema::new(fields));
        let mut cols: Vec<Arc<dyn Array>> = vec![Arc::new(Int64Array::from(vec![1, 2]))];
        for i in 0..COLUMNS {
            let spanned = StringArray::from(vec!["z".repeat(60_000), format!("v{i}")]);
            cols.push(arrow_select::nullif::nullif(&spanned, &BooleanArray::from(vec![true, false])).unwrap());
        }
        let batch = RecordBatch::try_new(Arc::clone(&schema), cols).unwrap();
        let wal = Wal::open(dir.path(), Arc::new(StdFs), WalSync::PerBatch, &ctl, |_| Ok::<(), StorageError>(())).unwrap();
        wal.append(WalOp::Put, 7, 1, 2, &batch).unwrap();
        assert!(wal.bytes() < 64 << 10, "record of {} bytes", wal.bytes());
        assert_eq!(ctl.category_bytes(Category::WriteBuffers), 0);
        drop(wal);
        let recs = replayed(dir.path(), &ctl);
        assert_eq!(recs.len(), 1);
        let back = recs[0].batch_as(&schema).unwrap();
        for i in 0..COLUMNS {
            let s = back.column(i + 1).as_any().downcast_ref::<StringArray>().unwrap();
            assert!(s.is_null(0), "column {i}");
            assert_eq!(s.value(1), format!("v{i}"));
        }
    }

    /// Every record a reopen of the log in `dir` replays, in order.
    fn replayed(dir: &Path, ctl: &Arc<MemoryController>) -> Vec<WalRecord> {
        let mut recs = Vec::new();
        Wal::open(dir, Arc::new(StdFs), WalSync::PerBatch, ctl, |r| {
            recs.push(r);
            Ok::<(), StorageError>(())
        })
        .unwrap();
        recs
    }

    fn replayed_rows(dir: &Path, ctl: &Arc<MemoryController>) -> usize {
        replayed(dir, ctl).iter().map(|r| r.batch.num_rows()).sum()
    }

    /// Relaxed mode: a failed fsync of acknowledged records is final. The sync reports the
    /// OS error; every later append and sync is refused with a text naming the first failure,
    /// also once the disk is healthy again (a later fsync that succeeds would prove nothing
    /// about the pages the failed one dropped). What reached the file is replayed at reopen.
    #[test]
    fn relaxed_fsync_failure_refuses_every_later_append_and_sync() {
        let dir = tempfile::tempdir().unwrap();
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), ..ControllerConfig::default() }).unwrap();
        let fs = crate::vfs::FaultFs::new();
        let wal = Wal::open(dir.path(), Arc::new(fs.clone()), WalSync::Relaxed, &ctl, |_| Ok::<(), StorageError>(())).unwrap();
        wal.append(WalOp::Put, 1, 1, 10, &keyed(0, 10, "a")).unwrap();
        fs.fail_step(0, 5); // EIO on the tick's fsync
        match wal.sync() {
            Err(StorageError::Io { source, .. }) => assert_eq!(source.raw_os_error(), Some(5), "{source}"),
            other => panic!("expected EIO, got {other:?}"),
        }
        assert!(wal.has_failed());
        fs.heal();
        for attempt in 0..2 {
            let err = wal.append(WalOp::Put, 1, 11, 20, &keyed(10, 10, "b")).unwrap_err().to_string();
            assert!(err.contains("earlier fsync") && err.contains("reopen"), "append {attempt}: {err}");
            let err = wal.sync().unwrap_err().to_string();
            assert!(err.contains("earlier fsync"), "sync {attempt}: {err}");
        }
        drop(wal);
        assert_eq!(replayed_rows(dir.path(), &ctl), 10, "the refused records never reached the log");
    }

    /// Per-batch mode keeps going after a failed fsync: that write is not acknowledged (and is
    /// cut from the log), every earlier one was fsynced by its own call.
    #[test]
    fn per_batch_fsync_failure_fails_that_write_only() {
        let dir = tempfile::tempdir().unwrap();
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), ..ControllerConfig::default() }).unwrap();
        let fs = crate::vfs::FaultFs::new();
        let wal = Wal::open(dir.path(), Arc::new(fs.clone()), WalSync::PerBatch, &ctl, |_| Ok::<(), StorageError>(())).unwrap();
        wal.append(WalOp::Put, 1, 1, 10, &keyed(0, 10, "a")).unwrap();
        fs.fail_step(1, 5); // the write succeeds, its fsync fails
        assert!(wal.append(WalOp::Put, 1, 11, 20, &keyed(10, 10, "b")).is_err());
        assert!(!wal.has_failed());
        wal.append(WalOp::Put, 1, 21, 30, &keyed(20, 10, "c")).unwrap();
        drop(wal);
        assert_eq!(replayed_rows(dir.path(), &ctl), 20, "rows 0..10 and 20..30; the failed write was cut");
    }

    /// The bytes of three real records: `a` (rows 0..10), `b` (10..30) and `c` (30..35).
    fn three_records(ctl: &Arc<MemoryController>) -> [Vec<u8>; 3] {
        let src = tempfile::tempdir().unwrap();
        let wal = Wal::open(src.path(), Arc::new(StdFs), WalSync::PerBatch, ctl, |_| Ok::<(), StorageError>(())).unwrap();
        let mut ends = Vec::new();
        for (first, from, n, tag) in [(1, 0, 10, "a"), (11, 10, 20, "b"), (31, 30, 5, "c")] {
            wal.append(WalOp::Put, 1, first, first + n as u64 - 1, &keyed(from, n, tag)).unwrap();
            ends.push(usize::try_from(wal.bytes()).unwrap());
        }
        drop(wal);
        let all = fs::read(src.path().join(seg_name(1))).unwrap();
        [all[..ends[0]].to_vec(), all[ends[0]..ends[1]].to_vec(), all[ends[1]..].to_vec()]
    }

    /// Opens a log made of `segments` (numbered from 1): the rows replayed or the error, and
    /// each segment's length after the open (a cut torn tail shortens the last).
    fn open_segments(ctl: &Arc<MemoryController>, segments: &[Vec<u8>]) -> (Result<usize, StorageError>, Vec<u64>) {
        let dir = tempfile::tempdir().unwrap();
        for (i, seg) in segments.iter().enumerate() {
            fs::write(dir.path().join(seg_name(i as u64 + 1)), seg).unwrap();
        }
        let mut rows = 0;
        let r = Wal::open(dir.path(), Arc::new(StdFs), WalSync::PerBatch, ctl, |rec| {
            rows += rec.batch.num_rows();
            Ok::<(), StorageError>(())
        });
        let lens = (1..=segments.len() as u64).map(|i| fs::metadata(dir.path().join(seg_name(i))).unwrap().len()).collect();
        (r.map(|_| rows), lens)
    }

    /// Recovery of torn records before zeros (pages of the file's length a crash did not
    /// write). Segment bytes are built from two real records (`a`, `b`) and a third (`c`);
    /// `z` is 64 KiB of zeros:
    /// - last segment `a b z`, `a b'` (b's payload damaged) `z`, `a 0b` (b's header not
    ///   written) `z`: `a` (and `b` when whole) replay, the rest is a torn tail, cut;
    /// - last segment `a z b z`: a zero gap with a whole record after it is corruption;
    /// - an older segment `a b' z` or `a b z` before a segment `c`: corruption (only the last
    ///   segment can end torn).
    #[test]
    fn torn_records_before_zeros_are_cut_from_the_last_segment_only() {
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), ..ControllerConfig::default() }).unwrap();
        let [a, b, c] = three_records(&ctl);
        let (a, b, c, a_len, b_len) = (&a[..], &b[..], &c[..], a.len(), b.len());
        let z = vec![0u8; 64 << 10];
        let mut b_damaged = b.to_vec();
        b_damaged[b_len / 2] ^= 0x40;
        let mut b_headless = b.to_vec();
        b_headless[..HEADER].fill(0);
        let open = |segments: &[Vec<u8>]| open_segments(&ctl, segments);
        let cat = |parts: &[&[u8]]| parts.concat();
        let (both_end, a_end) = ((a_len + b_len) as u64, a_len as u64);
        let ok = |(r, lens): (Result<usize, StorageError>, Vec<u64>)| (r.unwrap(), lens);
        assert_eq!(ok(open(&[cat(&[a, b, &z])])), (30, vec![both_end]));
        assert_eq!(ok(open(&[cat(&[a, &b_damaged, &z])])), (10, vec![a_end]));
        assert_eq!(ok(open(&[cat(&[a, &b_headless, &z])])), (10, vec![a_end]));
        assert!(matches!(open(&[cat(&[a, &z[..4096], b, &z])]).0, Err(StorageError::CorruptWal { .. })));
        assert!(matches!(open(&[cat(&[a, b, &z]), c.to_vec()]).0, Err(StorageError::CorruptWal { .. })));
        assert!(matches!(open(&[cat(&[a, &b_damaged, &z]), c.to_vec()]).0, Err(StorageError::CorruptWal { .. })));
    }

    /// Only the names the log gives its segments are segment names: at least 8 digits, no
    /// extra zeros, an id that fits `u64`.
    #[test]
    fn segment_names_are_parsed_exactly() {
        assert_eq!(wal_segment_id("wal-00000001.log"), Some(1));
        assert_eq!(wal_segment_id(&seg_name(42)), Some(42));
        assert_eq!(wal_segment_id("wal-123456789012.log"), Some(123_456_789_012));
        assert_eq!(wal_segment_id(&seg_name(MAX_SEGMENT_ID)), Some(MAX_SEGMENT_ID));
        assert_eq!(wal_segment_id(&seg_name(MAX_SEGMENT_ID + 1)), None);
        assert_eq!(wal_segment_id(&seg_name(u64::MAX)), None, "the next id would wrap to 0");
        for bad in [
            "wal-1.log",
            "wal-0000001.log",
            "wal-000000001.log",
            "wal-000000000099.log",
            "wal-99999999999999999999.log",
            "wal-+0000001.log",
            "wal-0000000a.log",
            "wal-.log",
            "wal-00000001.log.tmp",
            "WAL-00000001.log",
            "notes.txt",
        ] {
            assert_eq!(wal_segment_id(bad), None, "{bad}");
        }
    }

    /// A file named like a segment but not as the log names one, or a last segment whose
    /// bytes are not records (text, another file's bytes), is `CorruptWal` naming it and is
    /// left byte for byte (before: `wal-1.log` failed with `NotFound wal-00000001.log`, and
    /// a text segment was cut to nothing as a torn tail). Other names are left alone. Torn
    /// tails still open: `breaker_trial2`, `torn_records_before_zeros_are_cut_from_the_last_segment_only`.
    #[test]
    fn files_that_are_not_this_logs_segments_are_refused_and_kept() {
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), ..ControllerConfig::default() }).unwrap();
        let [a, _, _] = three_records(&ctl);
        let text = b"these are someone's notes, not a log\n".repeat(40);
        for (name, bytes) in [
            ("wal-1.log", a.clone()),
            ("wal-000000000002.log", a.clone()),
            (&seg_name(2)[..], text.clone()),
            // a record, then text where the next record would start
            (&seg_name(2)[..], [&a[..], &text].concat()),
            // another format's file: a zero where the op byte goes, other bytes after it
            (&seg_name(2)[..], [&b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR"[..], &[7u8; 600]].concat()),
            // the text's first 8 bytes read as a short length (4) and some checksum
            (&seg_name(2)[..], [&4u32.to_le_bytes()[..], b"crc?", b"text after a small length"].concat()),
        ] {
            let dir = tempfile::tempdir().unwrap();
            fs::write(dir.path().join(seg_name(1)), &a).unwrap();
            fs::write(dir.path().join(name), &bytes).unwrap();
            fs::write(dir.path().join("README.txt"), b"kept").unwrap();
            let r = Wal::open(dir.path(), Arc::new(StdFs), WalSync::PerBatch, &ctl, |_| Ok::<(), StorageError>(()));
            match r {
                Err(StorageError::CorruptWal { path, .. }) => assert_eq!(path, dir.path().join(name), "{name}"),
                other => panic!("{name}: expected CorruptWal, got {:?}", other.map(|_| ())),
            }
            assert_eq!(fs::read(dir.path().join(name)).unwrap(), bytes, "{name} is left as it was");
            assert_eq!(fs::read(dir.path().join(seg_name(1))).unwrap(), a);
        }
        // Names not shaped like a segment's are not the log's: the log opens, they stay.
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(seg_name(1)), &a).unwrap();
        for other in ["README.txt", "wal-00000002.log.tmp", "wal-00000003.bak"] {
            fs::write(dir.path().join(other), b"kept").unwrap();
        }
        let mut rows = 0;
        Wal::open(dir.path(), Arc::new(StdFs), WalSync::PerBatch, &ctl, |rec| {
            rows += rec.batch.num_rows();
            Ok::<(), StorageError>(())
        })
        .unwrap();
        assert_eq!(rows, 10);
        for other in ["README.txt", "wal-00000002.log.tmp", "wal-00000003.bak"] {
            assert_eq!(fs::read(dir.path().join(other)).unwrap(), b"kept");
        }
    }

    /// A segment name that is a symlink (to a user's file outside the log, or `/dev/zero`), a
    /// directory or a FIFO is `CorruptWal` naming it, and nothing behind it is read or cut
    /// (before: the user's file was truncated to 0 bytes, `/dev/zero` read without end, a FIFO
    /// blocked the open). An id past `MAX_SEGMENT_ID` (`u64::MAX`, whose next id wrapped to 0
    /// and replayed first, losing an acknowledged write) is refused by its name.
    #[test]
    fn segment_names_on_other_than_regular_files_are_refused_and_nothing_is_cut() {
        // What each case makes at the segment's path.
        type Make<'a> = Box<dyn Fn(&Path) + 'a>;
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), ..ControllerConfig::default() }).unwrap();
        let [a, _, _] = three_records(&ctl);
        let outside = tempfile::tempdir().unwrap();
        let user_file = outside.path().join("notes.txt");
        fs::write(&user_file, b"ok\n").unwrap();
        let name = seg_name(2);
        let cases: [(&str, Make<'_>); 5] = [
            ("symlink to a user's file", Box::new(|p: &Path| std::os::unix::fs::symlink(&user_file, p).unwrap())),
            ("symlink to /dev/zero", Box::new(|p: &Path| std::os::unix::fs::symlink("/dev/zero", p).unwrap())),
            ("dangling symlink", Box::new(|p: &Path| std::os::unix::fs::symlink("/nonexistent/x", p).unwrap())),
            ("directory", Box::new(|p: &Path| fs::create_dir(p).unwrap())),
            ("FIFO", Box::new(|p: &Path| assert!(std::process::Command::new("mkfifo").arg(p).status().unwrap().success()))),
        ];
        for (what, make) in cases {
            let dir = tempfile::tempdir().unwrap();
            fs::write(dir.path().join(seg_name(1)), &a).unwrap();
            make(&dir.path().join(&name));
            match Wal::open(dir.path(), Arc::new(StdFs), WalSync::PerBatch, &ctl, |_| Ok::<(), StorageError>(())) {
                Err(StorageError::CorruptWal { path, .. }) => assert_eq!(path, dir.path().join(&name), "{what}"),
                other => panic!("{what}: expected CorruptWal, got {:?}", other.map(|_| ())),
            }
            assert!(fs::symlink_metadata(dir.path().join(&name)).is_ok(), "{what}: left in place");
            assert_eq!(fs::read(dir.path().join(seg_name(1))).unwrap(), a, "{what}");
        }
        assert_eq!(fs::read(&user_file).unwrap(), b"ok\n", "the user's file is not cut");
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(seg_name(1)), &a).unwrap();
        fs::write(dir.path().join("wal-18446744073709551615.log"), vec![0u8; 8192]).unwrap();
        match Wal::open(dir.path(), Arc::new(StdFs), WalSync::PerBatch, &ctl, |_| Ok::<(), StorageError>(())) {
            Err(StorageError::CorruptWal { path, .. }) => assert_eq!(path, dir.path().join("wal-18446744073709551615.log")),
            other => panic!("u64::MAX: expected CorruptWal, got {:?}", other.map(|_| ())),
        }
        assert_eq!(fs::read(dir.path().join("wal-18446744073709551615.log")).unwrap().len(), 8192);
    }

    /// A log whose last segment has the last id opens, but a write that needs the next
    /// segment is refused before it is logged (before: written to a 16-digit segment the next
    /// open refused, so the acknowledged write was lost when that file was moved away).
    #[test]
    fn a_log_out_of_segment_ids_refuses_the_write_and_loses_nothing() {
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), ..ControllerConfig::default() }).unwrap();
        let [a, _, _] = three_records(&ctl);
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(seg_name(1)), &a).unwrap();
        fs::write(dir.path().join(seg_name(MAX_SEGMENT_ID)), b"").unwrap();
        let wal = Wal::open(dir.path(), Arc::new(StdFs), WalSync::PerBatch, &ctl, |_| Ok::<(), StorageError>(())).unwrap();
        match wal.append(WalOp::Put, 1, 11, 20, &keyed(10, 10, "b")) {
            Err(StorageError::Io { source, .. }) => assert!(source.to_string().contains("out of segment ids"), "{source}"),
            other => panic!("expected Io, got {other:?}"),
        }
        drop(wal);
        let mut names: Vec<String> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        assert_eq!(names, [seg_name(1), seg_name(MAX_SEGMENT_ID)]);
        assert_eq!(replayed_rows(dir.path(), &ctl), 10);
    }

    /// A damaged header is told from a torn tail by walking the record's IPC messages: a
    /// length past the end over a whole payload with a whole record after it is corruption,
    /// and so are two headerless records in a row before one; a payload cut short is a torn
    /// tail however its bytes look (`breaker_session13` has the record-shaped value).
    #[test]
    fn damaged_headers_are_told_from_torn_tails_by_walking_the_payload() {
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), ..ControllerConfig::default() }).unwrap();
        let [a, b, c] = three_records(&ctl);
        let (a, b, c, a_len) = (&a[..], &b[..], &c[..], a.len());
        let mut b_long = b.to_vec();
        b_long[..4].copy_from_slice(&0x7fff_ffffu32.to_le_bytes());
        let mut b_headless = b.to_vec();
        b_headless[..HEADER].fill(0);
        let open = |seg: Vec<u8>| {
            let (r, lens) = open_segments(&ctl, &[seg]);
            (r.map_err(|e| matches!(e, StorageError::CorruptWal { .. })), lens[0])
        };
        let a_end = a_len as u64;
        assert_eq!(open([a, &b_long, c].concat()).0, Err(true));
        assert_eq!(open([a, &b_long].concat()), (Ok(10), a_end));
        assert_eq!(open([a, &b_headless, &b_headless, c].concat()).0, Err(true));
        assert_eq!(open([a, &b_headless, &b_headless].concat()), (Ok(10), a_end));
        for cut in [1, HEADER + 3, HEADER + PAYLOAD_HEADER + 2, b.len() / 2, b.len() - 9, b.len() - 1] {
            assert_eq!(open([a, &b[..cut]].concat()), (Ok(10), a_end), "b cut to {cut} bytes");
            assert_eq!(open([a, &b_headless[..cut]].concat()), (Ok(10), a_end), "headless b cut to {cut} bytes");
        }
    }

    /// Seeded random damage to a last segment of three records (cut anywhere; a byte range
    /// zeroed or overwritten; a length or checksum field rewritten; combinations): the open
    /// never panics, and either replays a prefix of the records (0, 10, 30 or all 35 rows,
    /// never part of one) or refuses with `CorruptWal`; a log that was only cut short replays
    /// exactly the whole records before the cut. 1,000 cases (each a directory and an open: a
    /// few seconds).
    #[test]
    fn random_damage_to_the_last_segment_replays_a_prefix_or_is_corrupt() {
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), ..ControllerConfig::default() }).unwrap();
        let [a, b, c] = three_records(&ctl);
        let whole = [&a[..], &b[..], &c[..]].concat();
        // xorshift64*: deterministic, no dependency.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = |n: usize| {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as usize % n.max(1)
        };
        let mut seen = std::collections::BTreeMap::new();
        for case in 0..1000 {
            let mut seg = whole.clone();
            let mut only_cut = true;
            for _ in 0..=next(3) {
                let at = next(seg.len());
                let kind = next(5);
                only_cut &= kind == 0;
                match kind {
                    0 => seg.truncate(at),
                    1 => {
                        let to = (at + 1 + next(64 << 10)).min(seg.len());
                        seg[at..to].fill(0);
                    }
                    2 => {
                        let to = (at + 1 + next(16)).min(seg.len());
                        for byte in &mut seg[at..to] {
                            *byte = next(256) as u8;
                        }
                    }
                    _ => {
                        // A record's length or checksum field (the first, second or third).
                        let start = [0, a.len(), a.len() + b.len()][next(3)] + 4 * next(2);
                        if start + 4 <= seg.len() {
                            seg[start..start + 4].copy_from_slice(&(next(usize::MAX) as u32).to_le_bytes());
                        }
                    }
                }
                if seg.is_empty() {
                    break;
                }
            }
            // A log only cut short is a torn tail: the whole records before the cut replay.
            let whole_before_cut = [(a.len(), 10), (a.len() + b.len(), 30)].iter().filter(|(end, _)| *end <= seg.len()).map(|(_, r)| *r).max().unwrap_or(0);
            let outcome = match open_segments(&ctl, &[seg]).0 {
                Ok(rows) if only_cut => {
                    assert_eq!(rows, whole_before_cut, "case {case}: a cut log");
                    rows
                }
                Err(e) if only_cut => panic!("case {case}: a log only cut short is refused: {e}"),
                Ok(rows) => {
                    assert!([0, 10, 30, 35].contains(&rows), "case {case}: replayed {rows} rows");
                    rows
                }
                Err(e) => {
                    assert!(matches!(e, StorageError::CorruptWal { .. }), "case {case}: {e}");
                    usize::MAX
                }
            };
            *seen.entry(outcome).or_insert(0) += 1;
        }
        // Each damaged prefix comes up, and corruption (all 35 rows need an undamaged log).
        assert_eq!(seen.keys().copied().collect::<Vec<_>>(), [0, 10, 30, usize::MAX], "{seen:?}");
    }

    /// A record whose checksum matches but whose Arrow IPC stream is damaged (a record
    /// written by a faulty build, or crafted): every byte of record `b`'s payload after its
    /// header changed three ways, the checksum recomputed. `decode_segment` never panics
    /// (its contract, and the fuzz target's): it returns the records or an error at `b`.
    #[test]
    fn a_damaged_ipc_stream_under_a_valid_checksum_is_an_error_not_a_panic() {
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), ..ControllerConfig::default() }).unwrap();
        let [a, b, _] = three_records(&ctl);
        let mut panics = Vec::new();
        let (mut decoded, mut refused) = (0, 0);
        for at in HEADER + PAYLOAD_HEADER..b.len() {
            for change in [0x01u8, 0x80, 0xff] {
                let mut rec = b.clone();
                rec[at] ^= change;
                let crc = crc32fast::hash(&rec[HEADER..]);
                rec[4..HEADER].copy_from_slice(&crc.to_le_bytes());
                let seg = [&a[..], &rec[..]].concat();
                match std::panic::catch_unwind(|| decode_segment(&seg)) {
                    Ok(Ok(records)) => {
                        assert_eq!(records.len(), 2, "byte {at} ^ {change:#x}");
                        decoded += 1;
                    }
                    Ok(Err((offset, _))) => {
                        assert_eq!(offset, a.len(), "byte {at} ^ {change:#x}: the error names record b");
                        refused += 1;
                    }
                    Err(_) => panics.push((at, change)),
                }
            }
        }
        assert!(
            panics.is_empty(),
            "{} of {} damaged records panicked: {:?}",
            panics.len(),
            3 * (b.len() - HEADER - PAYLOAD_HEADER),
            &panics[..panics.len().min(20)]
        );
        assert!(refused > 0 && decoded > 0, "{refused} refused, {decoded} decoded");
    }

    /// A checksum-valid record whose sequence numbers are reversed, start at 0 or reach
    /// [`SEQ_LIMIT`] is refused at that record (replay continues at `last_seq + 1`, which
    /// wrapped at `u64::MAX`, and the next write's numbers after it).
    #[test]
    fn a_record_with_sequence_numbers_out_of_range_is_refused() {
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), ..ControllerConfig::default() }).unwrap();
        let [a, b, _] = three_records(&ctl);
        let first = u64::from_le_bytes(b[HEADER + 9..HEADER + 17].try_into().unwrap());
        let last = u64::from_le_bytes(b[HEADER + 17..HEADER + 25].try_into().unwrap());
        assert!(first >= 1 && first <= last, "{first}..={last}");
        assert_eq!(decode_segment(&[&a[..], &b[..]].concat()).map(|r| r.len()), Ok(2));
        for (f, l) in
            [(last + 1, last), (0, last), (first, u64::MAX), (u64::MAX, u64::MAX), (first, u64::MAX - 1), (first, SEQ_LIMIT), (SEQ_LIMIT, SEQ_LIMIT + 1)]
        {
            let mut rec = b.clone();
            rec[HEADER + 9..HEADER + 17].copy_from_slice(&f.to_le_bytes());
            rec[HEADER + 17..HEADER + 25].copy_from_slice(&l.to_le_bytes());
            let crc = crc32fast::hash(&rec[HEADER..]);
            rec[4..HEADER].copy_from_slice(&crc.to_le_bytes());
            match decode_segment(&[&a[..], &rec[..]].concat()) {
                Err((offset, e)) => {
                    assert_eq!(offset, a.len(), "{f}..={l}");
                    assert!(e.contains("out of range"), "{f}..={l}: {e}");
                }
                Ok(r) => panic!("{f}..={l}: decoded {} records", r.len()),
            }
        }
    }

    /// Relaxed mode fsyncs a full segment before closing it (the tick fsyncs only the active
    /// one): the append that rotates is one fsync, one create, one directory fsync and one
    /// write, where a plain relaxed append is one write; and a failure of that fsync is final.
    #[test]
    fn relaxed_rotation_fsyncs_the_closed_segment() {
        let dir = tempfile::tempdir().unwrap();
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(256 << 20), ..ControllerConfig::default() }).unwrap();
        let fs = crate::vfs::FaultFs::new();
        let wal = Wal::open(dir.path(), Arc::new(fs.clone()), WalSync::Relaxed, &ctl, |_| Ok::<(), StorageError>(())).unwrap();
        let big = "x".repeat(1 << 20); // one 1 MiB value per record
        let seq = std::cell::Cell::new(0u64);
        let append = |wal: &Wal| {
            let n = seq.get() + 1;
            seq.set(n);
            wal.append(WalOp::Put, 1, n, n, &keyed(i32::try_from(n).unwrap(), 1, &big))
        };
        while wal.bytes() < SEGMENT_BYTES {
            let before = fs.steps();
            append(&wal).unwrap();
            if wal.segment_count() == 1 && seq.get() > 1 {
                assert_eq!(fs.steps() - before, 1, "a relaxed append inside a segment is one write");
            }
        }
        assert_eq!(wal.segment_count(), 1);
        let before = fs.steps();
        append(&wal).unwrap();
        assert_eq!(wal.segment_count(), 2);
        assert_eq!(fs.steps() - before, 4, "fsync of the full segment, create, directory fsync, write");

        // The same again, with the full segment's fsync failing.
        while wal.bytes() < 2 * SEGMENT_BYTES {
            append(&wal).unwrap();
        }
        let rows_before = usize::try_from(seq.get()).unwrap();
        fs.fail_step(0, 5);
        let err = append(&wal).unwrap_err().to_string();
        assert!(wal.has_failed(), "{err}");
        assert_eq!(wal.segment_count(), 2, "no new segment after the failed fsync");
        assert!(append(&wal).unwrap_err().to_string().contains("earlier fsync"));
        drop(wal);
        assert_eq!(replayed_rows(dir.path(), &ctl), rows_before);
    }
}
