//! Write-ahead log: every acknowledged insert / upsert / update / delete is appended (and, in
//! the default mode, fsynced) before the call returns, and replayed on open.
//!
//! ```text
//! <data dir>/wal/wal-00000001.log   segments, appended in order, rotated at 16 MiB
//! record = | len u32 | crc32 u32 (of payload) | payload |
//! payload = | op u8 (1 put, 2 delete) | table id u64 | first seq u64 | last seq u64 | Arrow IPC stream |
//! ```
//! A segment is deleted once every table with records in it has committed files covering
//! those records (`flushed_seq` in its manifest), or was dropped.
//!
//! Recovery rules: the tail of the last segment left by a write the crash interrupted is
//! dropped and the segment truncated to the last whole record: a record cut short, a last
//! record whose checksum fails (a torn page inside it), or a zero-filled tail. Such a record
//! was never acknowledged (the append returns after its fsync). Any other bad record — a bad
//! checksum with whole records after it, or damage in an older segment — is
//! [`StorageError::CorruptWal`], never skipped silently.

use crate::error::{StorageError, io};
use crate::vfs::{Vfs, VfsFile};
use arrow_array::RecordBatch;
use arrow_ipc::reader::StreamReader;
use arrow_ipc::writer::StreamWriter;
use gritdb_memctl::{Category, MemoryController, Reservation};
use std::collections::HashMap;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

const HEADER: usize = 8;
const PAYLOAD_HEADER: usize = 1 + 8 + 8 + 8;
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
    /// `wal_sync_interval`); a crash may lose writes acknowledged within that interval.
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
    unsynced: bool,
}

/// A record buffer and the `write_buffers` reservation covering its capacity.
struct Scratch {
    buf: Vec<u8>,
    res: Reservation,
}

/// The write-ahead log of one engine.
pub struct Wal {
    dir: PathBuf,
    vfs: Arc<dyn Vfs>,
    sync: WalSync,
    ctl: Arc<MemoryController>,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for Wal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wal").field("dir", &self.dir).field("sync", &self.sync).finish_non_exhaustive()
    }
}

fn seg_name(id: u64) -> String {
    format!("wal-{id:08}.log")
}

fn corrupt(path: &Path, offset: u64, detail: impl Into<String>) -> StorageError {
    StorageError::CorruptWal { path: path.to_path_buf(), offset, detail: detail.into() }
}

impl Wal {
    /// Opens the WAL in `dir` (created if missing), calling `replay` with every record in
    /// order. A torn last record is dropped (and the segment truncated).
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
        let mut ids: Vec<u64> = fs::read_dir(dir)
            .map_err(io(dir))
            .map_err(E::from)?
            .flatten()
            .filter_map(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                n.strip_prefix("wal-").and_then(|r| r.strip_suffix(".log")).and_then(|r| r.parse().ok())
            })
            .collect();
        ids.sort_unstable();
        let mut closed = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let last = i + 1 == ids.len();
            let path = dir.join(seg_name(id));
            let seg = read_segment(&path, id, last, &mut replay)?;
            closed.push(seg);
        }
        let next_id = ids.last().map_or(1, |l| l + 1);
        Ok(Self {
            dir: dir.to_path_buf(),
            vfs,
            sync,
            ctl: Arc::clone(ctl),
            inner: Mutex::new(Inner { active: None, closed, next_id, unsynced: false }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether [`Self::append`] fsyncs before it returns ([`WalSync::PerBatch`]).
    pub fn syncs_each_append(&self) -> bool {
        self.sync == WalSync::PerBatch
    }

    /// Encodes one record (header placeholder, payload header, Arrow IPC stream) into `scratch`
    /// and fills in its length and checksum; returns the record's length in bytes.
    fn encode(scratch: &mut Scratch, op: WalOp, table: u64, first_seq: u64, last_seq: u64, batch: &RecordBatch) -> Result<usize, StorageError> {
        let buf = &mut scratch.buf;
        buf.clear();
        let estimate = HEADER + PAYLOAD_HEADER + batch.get_array_memory_size() + 1024;
        if scratch.res.size() < estimate.max(buf.capacity()) {
            scratch.res.try_resize(estimate.max(buf.capacity()))?;
        }
        buf.reserve(estimate);
        buf.extend_from_slice(&[0; HEADER]);
        buf.push(match op {
            WalOp::Put => 1,
            WalOp::Delete => 2,
        });
        buf.extend_from_slice(&table.to_le_bytes());
        buf.extend_from_slice(&first_seq.to_le_bytes());
        buf.extend_from_slice(&last_seq.to_le_bytes());
        {
            let mut w = StreamWriter::try_new(&mut *buf, batch.schema_ref())?;
            w.write(batch)?;
            w.finish()?;
        }
        scratch.res.try_resize(buf.capacity())?;
        let len = u32::try_from(buf.len() - HEADER).map_err(|_| StorageError::Io {
            path: PathBuf::new(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "WAL record above 4 GiB; write smaller batches"),
        })?;
        let crc = crc32fast::hash(&buf[HEADER..]);
        buf[..4].copy_from_slice(&len.to_le_bytes());
        buf[4..HEADER].copy_from_slice(&crc.to_le_bytes());
        Ok(buf.len())
    }

    /// Appends one record; with [`WalSync::PerBatch`] it is fsynced before this returns.
    /// The record (frame header included) is encoded into one buffer, sized up front and
    /// reserved under `write_buffers` while it exists, and written with one `write`.
    ///
    /// # Errors
    /// [`StorageError::Io`] (the record may be partly written: recovery drops a torn tail),
    /// [`StorageError::Memory`], [`StorageError::Arrow`].
    pub fn append(&self, op: WalOp, table: u64, first_seq: u64, last_seq: u64, batch: &RecordBatch) -> Result<(), StorageError> {
        let mut scratch = Scratch { buf: Vec::new(), res: Reservation::new(&self.ctl, Category::WriteBuffers, None) };
        self.append_encoded(&mut scratch, op, table, first_seq, last_seq, batch)
    }

    fn append_encoded(&self, scratch: &mut Scratch, op: WalOp, table: u64, first_seq: u64, last_seq: u64, batch: &RecordBatch) -> Result<(), StorageError> {
        let record_len = Self::encode(scratch, op, table, first_seq, last_seq, batch).map_err(|e| match e {
            StorageError::Io { source, .. } => StorageError::Io { path: self.dir.clone(), source },
            other => other,
        })?;
        let mut g = self.lock();
        if g.active.as_ref().is_some_and(|a| a.seg.bytes >= SEGMENT_BYTES) {
            let a = g.active.take().map(|a| a.seg);
            g.closed.extend(a);
        }
        if g.active.is_none() {
            let id = g.next_id;
            let path = self.dir.join(seg_name(id));
            let file = self.vfs.create(&path).map_err(io(&path))?;
            self.vfs.sync_dir(&self.dir).map_err(io(&self.dir))?;
            g.next_id += 1;
            g.active = Some(Active { seg: Segment { id, bytes: 0, max_seq: HashMap::new() }, file });
        }
        let a = g.active.as_mut().expect("active segment just ensured"); // infallible
        let good = a.seg.bytes;
        let mut res = a.file.write_all(&scratch.buf);
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
            drop(g);
            if let Err(t) = fs::OpenOptions::new().write(true).open(&path).and_then(|f| {
                f.set_len(good)?;
                f.sync_all()
            }) {
                tracing::error!(path = %path.display(), error = %t, "could not cut a failed WAL record");
            }
            return Err(StorageError::Io { path, source: e });
        }
        a.seg.bytes += record_len as u64;
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
    /// [`StorageError::Io`].
    pub fn sync(&self) -> Result<(), StorageError> {
        let mut g = self.lock();
        if !g.unsynced {
            return Ok(());
        }
        g.unsynced = false;
        if let Some(a) = g.active.as_mut() {
            let path = self.dir.join(seg_name(a.seg.id));
            a.file.sync_all().map_err(io(path))?;
        }
        Ok(())
    }

    /// Deletes every segment whose records are all covered: `covered(table, seq)` says whether
    /// table `table` has committed files containing its records up to `seq` (or was dropped).
    /// The active segment is closed first when it is fully covered. Returns segments removed.
    pub fn truncate(&self, covered: impl Fn(u64, u64) -> bool) -> usize {
        let mut g = self.lock();
        let done = |s: &Segment| s.max_seq.iter().all(|(t, q)| covered(*t, *q));
        if g.active.as_ref().is_some_and(|a| a.seg.bytes > 0 && done(&a.seg)) && !g.unsynced {
            let seg = g.active.take().map(|a| a.seg);
            g.closed.extend(seg);
        }
        let (gone, keep): (Vec<Segment>, Vec<Segment>) = std::mem::take(&mut g.closed).into_iter().partition(|s| done(s));
        g.closed = keep;
        drop(g);
        for s in &gone {
            let _ = self.vfs.remove_file(&self.dir.join(seg_name(s.id)));
        }
        if !gone.is_empty() {
            let _ = self.vfs.sync_dir(&self.dir);
        }
        gone.len()
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

fn read_segment<E: From<StorageError>>(
    path: &Path,
    id: u64,
    last: bool,
    replay: &mut impl FnMut(WalRecord) -> Result<(), E>,
) -> Result<Segment, E> {
    let data = fs::read(path).map_err(io(path)).map_err(E::from)?;
    let mut seg = Segment { id, bytes: 0, max_seq: HashMap::new() };
    let mut at = 0usize;
    let end = data.len();
    while at < end {
        let torn = |detail: &str| -> Result<(), E> {
            if last {
                tracing::warn!(path = %path.display(), offset = at, detail, "dropping torn WAL tail");
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
        if len == 0 {
            // No record is empty; zeros are a preallocated or zero-filled tail.
            torn("zero-length record (zero-filled tail)")?;
            break;
        }
        if end - at - HEADER < len {
            torn("record extends past the end of the segment")?;
            break;
        }
        let payload = &data[at + HEADER..at + HEADER + len];
        if crc32fast::hash(payload) != crc {
            if last && at + HEADER + len == end {
                torn("checksum mismatch in the last record")?;
                break;
            }
            return Err(corrupt(path, at as u64, "checksum mismatch with records after it").into());
        }
        let rec = decode(payload).map_err(|d| E::from(corrupt(path, at as u64, d)))?;
        let e = seg.max_seq.entry(rec.table).or_insert(0);
        *e = (*e).max(rec.last_seq);
        replay(rec)?;
        at += HEADER + len;
    }
    if at < end {
        let f = fs::OpenOptions::new().write(true).open(path).map_err(io(path)).map_err(E::from)?;
        f.set_len(at as u64).and_then(|()| f.sync_all()).map_err(io(path)).map_err(E::from)?;
    }
    seg.bytes = at as u64;
    Ok(seg)
}

fn decode(payload: &[u8]) -> Result<WalRecord, String> {
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
    let mut reader = StreamReader::try_new(&payload[PAYLOAD_HEADER..], None).map_err(|e| e.to_string())?;
    let batch = reader.next().ok_or("no batch in record")?.map_err(|e| e.to_string())?;
    Ok(WalRecord { op, table, first_seq, last_seq, batch })
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
        out.push(decode(payload).map_err(|d| (at, d))?);
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

