use crate::error::{StorageError, damaged_at_open, io};
use crate::index::{KeyIndex, Loc, encode_keys, key_converter};
use crate::manifest::{FileMeta, MANIFEST_FILE, Manifest, write_atomic};
use crate::vfs::Vfs;
use crate::write::{WriteOptions, write_data_file};
use arrow_array::RecordBatch;
use arrow_row::RowConverter;
use arrow_schema::{Schema, SchemaRef};
use gritdb_memctl::{Category, MemoryController, Reservation, TableAccount};
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use roaring::RoaringBitmap;
use std::collections::{BTreeMap, VecDeque};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub(crate) struct DataFile {
    pub(crate) meta: FileMeta,
    /// The rows, in memory, until the file is committed.
    pub(crate) pending: Option<Vec<RecordBatch>>,
    /// Deleted rows as seen by readers (committed + staged deletes).
    pub(crate) dv_live: RoaringBitmap,
    /// Deleted rows as of the committed manifest.
    pub(crate) dv_committed: RoaringBitmap,
    /// Removes the file from disk once it is obsolete (compacted away) and no scan holds it.
    pub(crate) guard: Arc<FileGuard>,
}

/// Keeps a data file on disk while scans may read it. Once compaction replaced the file it is
/// marked obsolete and removed when the last holder (table or scan) lets go. It also knows
/// the file's bytes against the CRC-32 its manifest recorded: a file loaded at open is checked
/// before its first read ([`Self::verify`]), and any file again before a read once it has
/// changed on disk since it was written or last matched (its [`FileStamp`]); a file found
/// damaged by any check or read is checked before every read (scans of it fail) and left out
/// of compactions until it matches again (restored from a backup).
#[derive(Debug)]
pub struct FileGuard {
    path: PathBuf,
    obsolete: std::sync::atomic::AtomicBool,
    vfs: Arc<dyn Vfs>,
    /// The CRC-32 the manifest records for the file: set at open for a loaded file, at the
    /// commit for a file this process wrote ([`Self::written`]); unset before the commit and
    /// for manifests older than the checksums.
    crc32: std::sync::OnceLock<u32>,
    /// What is known of the file's bytes against `crc32`.
    state: std::sync::Mutex<Checked>,
}

/// A [`FileGuard`]'s knowledge of its file's bytes.
#[derive(Debug)]
enum Checked {
    /// Loaded at open and not read yet: checked before its first read.
    Unverified,
    /// Matched its manifest's CRC-32, or written by this process: not read again before a
    /// read while its [`FileStamp`] is this one (taken when it matched or was committed;
    /// `None`: a file not written yet, or whose metadata could not be read then).
    Trusted { stamp: Option<FileStamp> },
    /// Did not match: the error's detail, and the file's [`FileStamp`] when it was read
    /// (`None` when it could not be read), by which [`FileGuard::verify_if_changed`] skips
    /// reading an unchanged file again.
    Damaged { detail: String, stamp: Option<FileStamp> },
    /// Not found at its path by the last check (deleted or moved outside the engine):
    /// checked before every read (a failed open, no read) until it is back and matches.
    Missing,
}

impl FileGuard {
    /// `crc32`: the checksum to verify the file against before its first read (a file loaded
    /// from a manifest); `None` for a file this process writes (then [`Self::written`] records
    /// its checksum once committed).
    pub(crate) fn new(path: PathBuf, vfs: &Arc<dyn Vfs>, crc32: Option<u32>) -> Arc<Self> {
        let recorded = std::sync::OnceLock::new();
        let state = match crc32 {
            Some(c) => {
                let _ = recorded.set(c);
                Checked::Unverified
            }
            None => Checked::Trusted { stamp: None },
        };
        Arc::new(Self { path, obsolete: std::sync::atomic::AtomicBool::new(false), vfs: Arc::clone(vfs), crc32: recorded, state: std::sync::Mutex::new(state) })
    }

    /// Records the CRC-32 of a file this process wrote, as its manifest commits it (the file
    /// is at its final path), and its [`FileStamp`]: a change on disk after this is checked
    /// before the next read.
    pub(crate) fn written(&self, crc32: u32) {
        let _ = self.crc32.set(crc32);
        let stamp = file_stamp(&self.path);
        let mut state = self.state();
        if let Checked::Trusted { stamp: s } = &mut *state {
            *s = stamp;
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Checked> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Checks the file before a read: a file loaded at open against its manifest's CRC-32 the
    /// first time (reading the whole file, 16 KiB at a time on the stack), a file found
    /// damaged every time until it matches again (restored), and a file that matched or that
    /// this process wrote again once it has changed on disk since ([`FileStamp`]: one `stat`,
    /// no read, while it has not). Before, a file this process wrote and something else then
    /// overwrote in place was read unchecked: of 29 single-byte flips in its data pages, 20
    /// scanned back wrong values without an error. A change within the same tick of the file
    /// system's clock as the commit or the last match (a few ms, at the kernel's timestamp
    /// granularity) keeps the stamp and is not found here; [`Self::explain_read_error`]
    /// still names the file when the change makes a read fail. Concurrent first calls may
    /// both read.
    ///
    /// # Errors
    /// [`StorageError::CorruptFile`] when the file's bytes do not match (a flipped or lost
    /// byte, a truncated or replaced file: nothing of it is read then); [`StorageError::Io`]
    /// when it cannot be read.
    pub fn verify(&self) -> Result<(), StorageError> {
        if let (true, stamp) = self.trusted()
            && (stamp.is_none() || file_stamp(&self.path) == stamp)
        {
            return Ok(());
        }
        match self.crc32.get() {
            Some(&expected) => self.check(expected, "checksum mismatch"),
            None => Ok(()),
        }
    }

    /// [`Self::verify`], but a file found damaged is read again only when it has changed on
    /// disk since ([`FileStamp`]: length, modification time, inode, status-change time; for
    /// the check before each compaction, so a damaged file is not read at every flush). A
    /// file restored within the same tick of the file system's clock as the damage was found
    /// is missed here (at the kernel's timestamp granularity, a few ms), not by
    /// [`Self::verify`].
    ///
    /// # Errors
    /// As [`Self::verify`]; the damage found before while the file is unchanged.
    pub fn verify_if_changed(&self) -> Result<(), StorageError> {
        if let Checked::Damaged { detail, stamp } = &*self.state()
            && stamp.is_some()
            && *stamp == file_stamp(&self.path)
        {
            return Err(StorageError::CorruptFile { path: self.path.clone(), detail: detail.clone() });
        }
        self.verify()
    }

    /// [`Self::verify`] before the file is rewritten (a compaction's input): the manifest's
    /// CRC-32 is checked whether or not this process wrote the file or checked it already — a
    /// rewrite would make damage done since permanent under a new, valid checksum. Without a
    /// recorded checksum (an older manifest), as [`Self::verify`].
    ///
    /// # Errors
    /// As [`Self::verify`]; the mismatch says "checksum mismatch before compaction".
    pub(crate) fn verify_before_rewrite(&self) -> Result<(), StorageError> {
        match self.crc32.get() {
            Some(&expected) => self.check(expected, "checksum mismatch before compaction"),
            None => self.verify(),
        }
    }

    /// `e`, an error reading this file, as [`StorageError::CorruptFile`] when the file's bytes
    /// no longer match its manifest's CRC-32 (the file changed while it was read, or within
    /// the clock tick of its last check, which [`Self::verify`]'s stamp does not see): a
    /// truncated or zeroed file gave a bare Parquet or Arrow error that named no file. Missing files,
    /// refused memory, and errors of a file that still matches are returned as they are.
    ///
    /// A file that matches again but whose stamp moved since the check before the read (it
    /// changed on disk while it was read: damaged, then restored, or rewritten in place) is
    /// `CorruptFile` too, saying so, and stays trusted: the next read gets it whole. A file
    /// known damaged when the error comes (another read found it meanwhile) returns that
    /// damage. Before, both gave the bare decode error (a trial of 2026-12-06: 18 of 10,901
    /// scans beside a file rewritten in place).
    pub fn explain_read_error(&self, e: StorageError) -> StorageError {
        let decoding = matches!(e, StorageError::Parquet(_) | StorageError::Arrow(_) | StorageError::CorruptFile { .. });
        let Some(&expected) = self.crc32.get() else { return e };
        if !decoding {
            return e;
        }
        // (The state's lock is let go before `damage` and `check` take it again.)
        let before = match &*self.state() {
            Checked::Trusted { stamp } => Ok(*stamp),
            Checked::Damaged { .. } => Err(()),
            Checked::Unverified | Checked::Missing => Ok(None),
        };
        let Ok(before) = before else { return self.damage().unwrap_or(e) };
        match self.check(expected, "checksum mismatch") {
            Err(damage @ StorageError::CorruptFile { .. }) => damage,
            Ok(()) if before.is_some() && self.trusted() != (true, before) => StorageError::CorruptFile {
                path: self.path.clone(),
                detail: format!("it changed on disk while it was read ({e}); its bytes match the manifest's CRC-32 again, so a new scan reads it whole"),
            },
            _ => e,
        }
    }

    /// Whether the file is trusted, and the stamp it is trusted at.
    fn trusted(&self) -> (bool, Option<FileStamp>) {
        match &*self.state() {
            Checked::Trusted { stamp } => (true, *stamp),
            _ => (false, None),
        }
    }

    /// The data file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the file was found damaged or missing and has not matched since.
    pub(crate) fn is_damaged(&self) -> bool {
        matches!(*self.state(), Checked::Damaged { .. } | Checked::Missing)
    }

    /// The damage found, as the error a read of the file returns (for a missing file the
    /// `NotFound` [`StorageError::Io`] naming it, which [`crate::TableStore::damage`] names
    /// [`StorageError::MissingFile`]); `None` for a file not found damaged or missing.
    pub(crate) fn damage(&self) -> Option<StorageError> {
        match &*self.state() {
            Checked::Damaged { detail, .. } => Some(StorageError::CorruptFile { path: self.path.clone(), detail: detail.clone() }),
            Checked::Missing => Some(StorageError::Io { path: self.path.clone(), source: std::io::ErrorKind::NotFound.into() }),
            _ => None,
        }
    }

    /// Reads the whole file and compares its CRC-32 with `expected`; a match marks the file
    /// trusted, a mismatch damaged ([`StorageError::CorruptFile`] whose detail begins with
    /// `what`), a file not found missing (the `NotFound` [`StorageError::Io`] naming it,
    /// which callers name [`StorageError::MissingFile`] with the table). The stamp is taken
    /// before the read, so a file changed while it is read is read again by the next check.
    fn check(&self, expected: u32, what: &str) -> Result<(), StorageError> {
        let stamp = file_stamp(&self.path);
        let (got, len) = match crate::write::file_crc32(&self.path) {
            Ok(x) => x,
            Err(e) => {
                if matches!(&e, StorageError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound) {
                    *self.state() = Checked::Missing;
                }
                return Err(e);
            }
        };
        if got != expected {
            let detail = crate::error::damaged_at_read(&crc_mismatch(what, expected, len, got));
            *self.state() = Checked::Damaged { detail: detail.clone(), stamp };
            return Err(StorageError::CorruptFile { path: self.path.clone(), detail });
        }
        *self.state() = Checked::Trusted { stamp };
        Ok(())
    }

    pub(crate) fn mark_obsolete(&self) {
        self.obsolete.store(true, std::sync::atomic::Ordering::Release);
    }
}

/// What a data file's CRC-32 mismatch says, beginning with `what`: the manifest's checksum,
/// the file's length in bytes and its checksum.
fn crc_mismatch(what: &str, expected: u32, len: u64, got: u32) -> String {
    format!("{what}: the manifest recorded CRC-32 {expected}, the file's {len} bytes have {got}")
}

/// `detail`, a data file's read error, or the file's checksum mismatch against `crc32` (its
/// manifest's) when there is one: the mismatch is the cause, the decode error its symptom.
fn checksum_or(path: &Path, crc32: Option<u32>, detail: String) -> String {
    match (crc32, crate::write::file_crc32(path)) {
        (Some(expected), Ok((got, len))) if got != expected => {
            format!("{} (reading its keys: {detail})", crc_mismatch("checksum mismatch", expected, len, got))
        }
        _ => detail,
    }
}

/// What tells a file changed on disk without reading it: its length and modification time
/// and, on Unix, its inode and status-change time (ctime), which a restore changes even when
/// it keeps the backup's modification time (`cp -p`, `rsync -a`, `tar x`: a trial restored a
/// file so, and flushes never read it again), as does any write in place. `None` when its
/// metadata cannot be read.
type FileStamp = (u64, std::time::SystemTime, u64, i64, i64);

/// `path`'s [`FileStamp`].
fn file_stamp(path: &Path) -> Option<FileStamp> {
    let m = fs::metadata(path).ok()?;
    #[cfg(unix)]
    let (ino, ctime, ctime_ns) = {
        use std::os::unix::fs::MetadataExt as _;
        (m.ino(), m.ctime(), m.ctime_nsec())
    };
    #[cfg(not(unix))]
    let (ino, ctime, ctime_ns) = (0, 0, 0);
    Some((m.len(), m.modified().ok()?, ino, ctime, ctime_ns))
}

impl Drop for FileGuard {
    fn drop(&mut self) {
        if self.obsolete.load(std::sync::atomic::Ordering::Acquire) {
            let _ = self.vfs.remove_file(&self.path);
        }
    }
}

/// A flush staged in memory: index and deletion vectors already updated, rows not yet in a
/// committed file.
#[derive(Debug, Clone)]
pub struct Staged {
    /// New data file id, when the flush has rows to write.
    pub file_id: Option<u32>,
    /// Rows deleted in older files by this flush.
    pub dv_additions: Vec<Loc>,
    /// Highest write sequence number the flush covers.
    pub max_seq: u64,
}

/// Encodes a flush's put keys for [`TableStore::stage_keyed`] without access to the store
/// ([`TableStore::put_keys`]): cheap to make, `Send`, and usable while others hold the store.
#[derive(Debug)]
pub struct PutKeyEncoder {
    schema: SchemaRef,
    key_cols: Vec<usize>,
    builder: crate::index::KeyBuilder,
}

/// A flush's puts with their keys as the key-index set of the file they become, budgeted
/// under `key_index` until staged (released when dropped unstaged). [`TableStore::stage_keyed`]
/// looks the older versions of the puts up by the set's keys.
#[derive(Debug)]
pub struct PutKeys {
    schema: SchemaRef,
    puts: Vec<RecordBatch>,
    /// `None` without put rows; `Err(detail)` when the keys are not strictly ascending.
    built: Option<crate::index::BuildResult>,
}

impl PutKeyEncoder {
    /// Encodes the keys of `puts` (empty batches are left out) and builds their key-index set.
    /// The puts must be sorted strictly ascending by key across batches, as a flush writes them.
    ///
    /// One batch's `arrow-row` keys exist at a time, budgeted under `key_index` beside the
    /// set while they are copied into it. Before, every batch's encoded keys were kept for
    /// the lookups of [`TableStore::stage_keyed`]: a flush held a variable-width key three
    /// times beside its batch (encoded, in the set, in the batch), and one-row inserts of
    /// 30–200 KB keys admitted at 1 MiB left deltas no flush could get that memory for
    /// (helper-52's F1, `big_keys`); for lineitem's key it was 17 B a row.
    ///
    /// # Errors
    /// [`StorageError::Arrow`] (a batch of another shape), [`StorageError::Memory`] when the
    /// key-index set or one batch's encoded keys cannot be budgeted.
    pub fn encode(&self, puts: &[RecordBatch]) -> Result<PutKeys, StorageError> {
        let puts: Vec<RecordBatch> = puts.iter().filter(|b| b.num_rows() > 0).cloned().collect();
        if puts.is_empty() {
            return Ok(PutKeys { schema: Arc::clone(&self.schema), puts, built: None });
        }
        let conv = key_converter(&self.schema, &self.key_cols)?;
        let mut part_res = self.builder.reservation();
        let mut set = self.builder.start(puts.iter().map(RecordBatch::num_rows).sum())?;
        let mut failed = None;
        for b in &puts {
            let part = encode_keys(&conv, b, &self.key_cols)?;
            part_res.try_grow(part.size())?;
            if let Err(detail) = set.push(&part)? {
                failed = Some(detail);
                break;
            }
            drop(part);
            part_res.free();
        }
        let built = match failed {
            Some(detail) => Err(detail),
            None => set.finish(),
        };
        Ok(PutKeys { schema: Arc::clone(&self.schema), puts, built: Some(built) })
    }
}

/// Where a scan reads a file's rows from.
#[derive(Debug, Clone)]
pub enum ScanSource {
    /// A staged file not yet written: its rows in memory, in order.
    Memory(Vec<RecordBatch>),
    /// A committed data file.
    File(PathBuf),
}

/// One file of a scan snapshot.
#[derive(Debug, Clone)]
pub struct FileScan {
    /// File id.
    pub id: u32,
    /// Rows source.
    pub source: ScanSource,
    /// Rows to skip: deletion vector plus rows replaced by newer in-memory versions.
    pub deleted: Arc<RoaringBitmap>,
    /// Keeps the file on disk while the scan reads it.
    pub guard: Arc<FileGuard>,
}

/// Everything one commit writes, prepared under the table lock and executed outside it.
#[derive(Debug)]
pub struct CommitPlan {
    data: Option<(String, Vec<RecordBatch>)>,
    /// Deletion vectors to write: file id, file name, bitmap, and its CRC-32 once written.
    dvs: Vec<(u32, String, RoaringBitmap, Option<u32>)>,
    manifest: Manifest,
    obsolete: Vec<String>,
    dir: PathBuf,
    /// The data file's size, CRC-32 and decoded bytes, once written.
    written: Option<crate::WrittenFile>,
    vfs: Arc<dyn Vfs>,
}

impl CommitPlan {
    /// Writes the data file, deletion vectors and manifest (no table lock needed).
    ///
    /// # Errors
    /// [`StorageError`]; nothing of this commit is visible then (the old manifest stands).
    pub fn execute(&mut self, opts: &WriteOptions, ctl: &Arc<MemoryController>, table: Option<&TableAccount>) -> Result<(), StorageError> {
        if let Some((name, batches)) = &self.data {
            let written = write_data_file(self.vfs.as_ref(), &self.dir, name, batches, opts, ctl, table)?;
            self.written = Some(written);
            if let Some(f) = self.manifest.files.iter_mut().find(|f| &f.name == name) {
                f.bytes = written.bytes;
                f.crc32 = Some(written.crc32);
                f.decoded_bytes = Some(written.decoded_bytes);
            }
        }
        for (id, name, bm, crc) in &mut self.dvs {
            let mut bytes = Vec::with_capacity(bm.serialized_size());
            bm.serialize_into(&mut bytes).map_err(io(self.dir.join(&*name)))?;
            write_atomic(self.vfs.as_ref(), &self.dir, name, &bytes)?;
            let hash = crc32fast::hash(&bytes);
            *crc = Some(hash);
            if let Some(f) = self.manifest.files.iter_mut().find(|f| f.id == *id) {
                f.dv_crc32 = Some(hash);
            }
        }
        self.manifest.write(self.vfs.as_ref(), &self.dir)?;
        for name in &self.obsolete {
            let _ = self.vfs.remove_file(&self.dir.join(name));
        }
        Ok(())
    }
}

/// The files, deletion vectors and key index of one table.
pub struct TableStore {
    pub(crate) dir: PathBuf,
    pub(crate) name: String,
    pub(crate) schema: SchemaRef,
    pub(crate) primary_key: Vec<String>,
    pub(crate) key_cols: Vec<usize>,
    pub(crate) conv: RowConverter,
    pub(crate) ctl: Arc<MemoryController>,
    pub(crate) account: Option<TableAccount>,
    pub(crate) files: BTreeMap<u32, DataFile>,
    pub(crate) index: KeyIndex,
    pub(crate) version: u64,
    pub(crate) next_file_id: u32,
    pub(crate) staged: VecDeque<Staged>,
    pub(crate) flushed_seq: u64,
    pub(crate) meta: Reservation,
    pub(crate) opts: WriteOptions,
    pub(crate) vfs: Arc<dyn Vfs>,
}

impl std::fmt::Debug for TableStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TableStore").field("name", &self.name).field("files", &self.files.len()).finish_non_exhaustive()
    }
}

/// Decodes a deletion-vector file's bytes and checks them against the manifest entry of its
/// data file: the CRC-32 when the manifest has one ([`FileMeta::dv_crc32`]), and always that
/// the bitmap holds [`FileMeta::deleted`] rows, each below [`FileMeta::rows`] (a damaged
/// bitmap that still decodes deletes other rows, silently).
///
/// # Errors
/// What is wrong, for [`StorageError::CorruptFile`].
fn read_deletion_vector(bytes: &[u8], f: &FileMeta) -> Result<RoaringBitmap, String> {
    if let Some(want) = f.dv_crc32 {
        let got = crc32fast::hash(bytes);
        if got != want {
            return Err(format!("deletion vector checksum mismatch: the manifest has {want}, the bytes hash to {got}"));
        }
    }
    let bm = RoaringBitmap::deserialize_from(bytes).map_err(|e| e.to_string())?;
    if bm.len() != f.deleted {
        return Err(format!("deletion vector holds {} rows, the manifest says {}", bm.len(), f.deleted));
    }
    if let Some(max) = bm.max()
        && u64::from(max) >= f.rows
    {
        return Err(format!("deletion vector names row {max} of a {}-row file", f.rows));
    }
    Ok(bm)
}

pub(crate) fn file_name(id: u32) -> String {
    format!("f{id:06}.parquet")
}

/// Whether `name` is one gritdb gives a file in a table directory, exactly as it spells it:
/// `manifest.json`, a data file `f<id>.parquet` and a deletion vector `f<id>.dv<version>` (the
/// id zero-padded to 6 digits, a `u32`; the version a `u64` without leading zeros), or the
/// temp file of any of them (`<name>.tmp`). Only such files are removed by the open's
/// cleanup ([`TableStore::open`]) or taken as a table's by an older directory's adoption.
pub fn is_table_file_name(name: &str) -> bool {
    let name = name.strip_suffix(".tmp").unwrap_or(name);
    // `file_name`'s spelling: a `u32` zero-padded to 6 digits.
    let file_id = |s: &str| crate::canonical_id(s, 6).is_some_and(|id| u32::try_from(id).is_ok());
    if name == MANIFEST_FILE {
        return true;
    }
    let Some(rest) = name.strip_prefix('f') else { return false };
    if let Some(id) = rest.strip_suffix(".parquet") {
        return file_id(id);
    }
    rest.split_once(".dv").is_some_and(|(id, version)| file_id(id) && crate::canonical_id(version, 1).is_some())
}

impl TableStore {
    /// Creates the table directory `dir` (must not exist) with a version-1 manifest.
    ///
    /// # Errors
    /// [`StorageError::Io`] (also when `dir` exists), [`StorageError::Arrow`] for key types that
    /// cannot be row-encoded.
    pub fn create(
        vfs: Arc<dyn Vfs>,
        dir: &Path,
        name: &str,
        schema: SchemaRef,
        key_cols: &[usize],
        ctl: &Arc<MemoryController>,
        account: Option<&TableAccount>,
    ) -> Result<Self, StorageError> {
        let primary_key = key_cols.iter().map(|&i| schema.field(i).name().clone()).collect::<Vec<_>>();
        let conv = key_converter(&schema, key_cols)?;
        vfs.create_dir(dir).map_err(io(dir))?;
        let m = Manifest::new(name, schema.as_ref().clone(), primary_key.clone());
        // The manifest makes the table exist; fsync the parent so the directory entry is
        // durable too.
        let parent = dir.parent().unwrap_or(dir);
        if let Err(e) = m.write(vfs.as_ref(), dir).and_then(|()| vfs.sync_dir(parent).map_err(io(parent))) {
            let _ = fs::remove_dir_all(dir);
            return Err(e);
        }
        let mut s = Self::empty(vfs, dir, name, schema, primary_key, key_cols.to_vec(), conv, ctl, account);
        s.account_metadata();
        Ok(s)
    }

    #[allow(clippy::too_many_arguments)]
    fn empty(
        vfs: Arc<dyn Vfs>,
        dir: &Path,
        name: &str,
        schema: SchemaRef,
        primary_key: Vec<String>,
        key_cols: Vec<usize>,
        conv: RowConverter,
        ctl: &Arc<MemoryController>,
        account: Option<&TableAccount>,
    ) -> Self {
        let key_types: Vec<_> = key_cols.iter().map(|&i| schema.field(i).data_type().clone()).collect();
        Self {
            dir: dir.to_path_buf(),
            name: name.to_owned(),
            schema,
            primary_key,
            key_cols,
            conv,
            ctl: Arc::clone(ctl),
            account: account.cloned(),
            index: KeyIndex::new(ctl, account, &key_types),
            files: BTreeMap::new(),
            version: 1,
            next_file_id: 1,
            staged: VecDeque::new(),
            flushed_seq: 0,
            meta: Reservation::new(ctl, Category::Metadata, account),
            opts: WriteOptions::default(),
            vfs,
        }
    }

    /// Reads the manifest of `dir` and only that (for the catalog at engine open).
    ///
    /// # Errors
    /// As [`Manifest::read`].
    pub fn read_manifest(dir: &Path) -> Result<Manifest, StorageError> {
        Manifest::read(dir)
    }

    /// Opens a table directory: reads the manifest and deletion vectors, rebuilds the key index
    /// from the key columns of every data file, and removes files the manifest does not name.
    ///
    /// # Errors
    /// [`StorageError::CorruptManifest`], [`StorageError::CorruptFile`] (a truncated or
    /// damaged data file, a deletion vector whose bytes or rows disagree with its manifest
    /// entry), [`StorageError::MissingFile`] (a file the manifest lists is not there),
    /// [`StorageError::Io`], [`StorageError::Memory`].
    #[allow(clippy::needless_pass_by_value)] // the manifest read at open belongs to the table
    pub fn open(vfs: Arc<dyn Vfs>, dir: &Path, ctl: &Arc<MemoryController>, account: Option<&TableAccount>, manifest: Manifest) -> Result<Self, StorageError> {
        let schema: SchemaRef = Arc::new(manifest.schema.clone());
        let key_cols = manifest.primary_key.iter().map(|k| schema.index_of(k)).collect::<Result<Vec<_>, _>>()?;
        let conv = key_converter(&schema, &key_cols)?;
        let mut s = Self::empty(vfs, dir, &manifest.table, schema, manifest.primary_key.clone(), key_cols, conv, ctl, account);
        s.version = manifest.version;
        s.next_file_id = manifest.next_file_id;
        s.flushed_seq = manifest.flushed_seq;
        let mut known: std::collections::HashSet<String> = [MANIFEST_FILE.to_owned()].into();
        for f in &manifest.files {
            known.insert(f.name.clone());
            let dv = match &f.dv {
                Some(name) => {
                    known.insert(name.clone());
                    let p = dir.join(name);
                    let bytes = fs::read(&p).map_err(|e| StorageError::Io { path: p.clone(), source: e }.or_missing_file(&p, &s.name))?;
                    read_deletion_vector(&bytes, f)
                        .map_err(|detail| StorageError::CorruptFile { path: p.clone(), detail: damaged_at_open(&s.name, &detail) })?
                }
                None => RoaringBitmap::new(),
            };
            let path = dir.join(&f.name);
            // The keys are read before the file's checksum is verified (that waits for its
            // first scan); when they do not decode, or decode out of order, the checksum says
            // whether the file was damaged (before, a flipped byte in a key column was refused
            // as "keys are not strictly ascending", which reads as the engine's own fault).
            let damaged = |detail: String| damaged_at_open(&s.name, &checksum_or(&path, f.crc32, detail));
            let built = s.index_keys_of(&path, f.rows).map_err(|e| match e {
                StorageError::CorruptFile { path, detail } => StorageError::CorruptFile { detail: damaged(detail), path },
                StorageError::Parquet(_) | StorageError::Arrow(_) => StorageError::CorruptFile { detail: damaged(e.to_string()), path: path.clone() },
                e => e.or_missing_file(&path, &s.name),
            })?;
            match built {
                Ok(built) => s.index.install(f.id, built),
                Err(detail) => return Err(StorageError::CorruptFile { detail: damaged(detail), path }),
            }
            let guard = FileGuard::new(path, &s.vfs, f.crc32);
            s.files.insert(f.id, DataFile { meta: f.clone(), pending: None, dv_live: dv.clone(), dv_committed: dv, guard });
        }
        if let Ok(rd) = fs::read_dir(dir) {
            for e in rd.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if known.contains(&n) {
                    continue;
                }
                // Only names gritdb gives (a data file or deletion vector of a commit that
                // did not happen, a temp file): anything else is not the engine's to remove.
                if is_table_file_name(&n) {
                    tracing::info!(table = %s.name, file = %n, "removing file not named by the manifest");
                    let _ = fs::remove_file(e.path());
                } else {
                    tracing::warn!(table = %s.name, file = %n, "leaving a file gritdb did not write in the table directory");
                }
            }
        }
        s.account_metadata();
        Ok(s)
    }

    /// The key set of data file `path` (which must hold `rows` rows), built from its key
    /// columns one 8,192-row batch at a time. Budgeted under `key_index` (this table's): the
    /// set as it grows, each decoded batch and its keys in the index's encoding while they
    /// live, and the Parquet reader's page and dictionary buffers and the file's metadata
    /// (the estimate of [`crate::FileReader::buffer_bytes`]). Before, the rebuild at open held the reader and
    /// every batch's keys twice over (all parts, then one concatenated copy) outside the
    /// limit.
    ///
    /// # Errors
    /// [`StorageError::CorruptFile`] when the file cannot be read, [`StorageError::Memory`]
    /// when the limit has no room for the rebuild; `Ok(Err(detail))` when its keys are not
    /// those of a data file (not strictly ascending, or not `rows` of them).
    pub(crate) fn index_keys_of(&self, path: &Path, rows: u64) -> Result<crate::index::BuildResult, StorageError> {
        // Read before the file's checksum is verified (that waits for its first scan): a
        // decoder panic on a damaged file is this file's CorruptFile.
        crate::write::parquet_guard(path, || self.read_keys_of(path, rows))
    }

    /// [`Self::index_keys_of`] without its guard against decoder panics.
    fn read_keys_of(&self, path: &Path, rows: u64) -> Result<crate::index::BuildResult, StorageError> {
        let corrupt = |detail: String| StorageError::CorruptFile { path: path.to_path_buf(), detail };
        let file = fs::File::open(path).map_err(io(path))?;
        let mut res = Reservation::new(&self.ctl, Category::KeyIndex, self.account.as_ref());
        // The footer is counted before it is parsed (`read_file_within`'s estimate).
        res.try_grow(crate::write::footer_length(&file).saturating_mul(crate::write::FOOTER_MEMORY_FACTOR))?;
        let loaded = parquet::arrow::arrow_reader::ArrowReaderMetadata::load(&file, parquet::arrow::arrow_reader::ArrowReaderOptions::new())
            .map_err(|e| corrupt(e.to_string()))?;
        let metadata = std::sync::Arc::clone(loaded.metadata());
        let mut read = self.key_cols.clone();
        read.sort_unstable();
        read.dedup();
        let in_file = metadata.file_metadata().num_rows();
        if u64::try_from(in_file).ok() != Some(rows) {
            return Err(corrupt(format!("manifest says {rows} rows, file has {in_file}")));
        }
        let groups: Vec<usize> = (0..metadata.num_row_groups()).collect();
        let dictionaries = crate::write::DictionaryPages::read(&file, &metadata, &groups, &read);
        res.try_resize(crate::write::reader_buffer_bytes(&metadata, &groups, &read, &dictionaries).saturating_add(metadata.memory_size()))?;
        let builder = ParquetRecordBatchReaderBuilder::new_with_metadata(file, loaded);
        let mask = ProjectionMask::roots(builder.parquet_schema(), read.iter().copied());
        // Always found: `read` is `key_cols` sorted.
        let order: Vec<usize> = self.key_cols.iter().map(|k| read.binary_search(k).unwrap_or(0)).collect();
        let reader = builder.with_projection(mask).with_batch_size(8192).build()?;
        let keys = self.index.builder();
        let mut set = keys.start(usize::try_from(rows).unwrap_or(usize::MAX))?;
        for b in reader {
            let b = b.map_err(|e| corrupt(e.to_string()))?;
            let decoded = crate::batch_bytes(&b);
            res.try_grow(decoded)?;
            // The projection returns the key columns in schema order; the row converter
            // takes them in key order (a key declared as `["b", "a"]` over `(a, b, ..)`).
            let cols = order.iter().map(|&i| b.column(i).clone()).collect();
            let part = gritdb_keys::encode_keys(&self.conv, cols)?;
            drop(b);
            res.shrink(decoded);
            let encoded = part.size();
            res.try_grow(encoded)?;
            if let Err(detail) = set.push(&part)? {
                return Ok(Err(detail));
            }
            drop(part);
            res.shrink(encoded);
        }
        Ok(set.finish())
    }

    pub(crate) fn is_deleted(&self, loc: Loc) -> bool {
        self.files.get(&loc.file).is_none_or(|f| f.dv_live.contains(loc.row))
    }

    /// The live location of `key` (arrow-row bytes) in the data files.
    pub fn find_key(&self, key: &[u8]) -> Option<Loc> {
        self.index.find(key, |l| self.is_deleted(l))
    }

    pub(crate) fn account_metadata(&mut self) {
        let per_file = std::mem::size_of::<DataFile>() + 64;
        let bytes: usize =
            self.files.values().map(|f| per_file + f.dv_live.serialized_size() + f.dv_committed.serialized_size()).sum::<usize>() + std::mem::size_of::<Self>();
        if self.meta.try_resize(bytes).is_err() {
            tracing::warn!(table = %self.name, bytes, "metadata accounting above limit");
        }
    }

    /// Table name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Table directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Arrow schema.
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// Primary-key column names.
    pub fn primary_key(&self) -> &[String] {
        &self.primary_key
    }

    /// Primary-key column indices.
    pub fn key_columns(&self) -> &[usize] {
        &self.key_cols
    }

    /// Manifest version of the last commit.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Data files (committed and staged).
    pub fn file_count(&self) -> usize {
        self.files.len()
    }

    /// Live rows in files (rows minus deletion vectors), staged files included.
    pub fn live_rows(&self) -> u64 {
        self.files.values().map(|f| f.meta.rows - f.dv_live.len()).sum()
    }

    /// Key-index bytes of the files with a live row: what the index keeps once the files
    /// whose rows are all deleted are dropped, which the next compaction does without
    /// reading them ([`Self::has_dead_files`]).
    pub fn live_index_bytes(&self) -> usize {
        self.files.values().filter(|f| f.meta.rows > f.dv_live.len()).map(|f| self.index.file_bytes(f.meta.id)).sum()
    }

    /// Whether a committed file has no live row: the next compaction drops it, reading and
    /// writing no data file (only the manifest).
    pub fn has_dead_files(&self) -> bool {
        self.files.values().any(|f| f.pending.is_none() && f.meta.rows == f.dv_live.len())
    }

    /// The key index.
    pub fn index(&self) -> &KeyIndex {
        &self.index
    }

    /// True when `key` (arrow-row bytes) is live in some file.
    pub fn contains_key(&self, key: &[u8]) -> bool {
        self.find_key(key).is_some()
    }

    /// Stages a flush in memory: puts become a new (pending) data file and the index points
    /// their keys at it; older versions of those keys and `delete_keys` go into deletion
    /// vectors. Readers see the result at once; [`Self::plan_commit`] makes it durable, and
    /// its manifest records `max_seq` as `flushed_seq` (every write up to it is in committed
    /// files; pass 0 for a part of a flush whose other parts are still to come). Returns
    /// `None`, staging nothing, when there are no puts or deletes and `max_seq` is already
    /// recorded. [`Self::put_keys`] then [`Self::stage_keyed`], in one step.
    ///
    /// # Errors
    /// [`StorageError::Memory`] when the index cannot grow (nothing changed then),
    /// [`StorageError::Arrow`].
    pub fn stage(&mut self, puts: &[RecordBatch], delete_keys: &RecordBatch, max_seq: u64) -> Result<Option<Staged>, StorageError> {
        let keyed = self.put_keys().encode(puts)?;
        self.stage_keyed(keyed, delete_keys, max_seq)
    }

    /// An encoder of a flush's put keys that needs no access to this store: the expensive
    /// half of [`Self::stage`] (the keys' `arrow-row` encoding and their key-index set, ~15–25
    /// ms for 368,640 lineitem rows) runs without the caller's lock on the store, and
    /// [`Self::stage_keyed`] does the rest under it.
    pub fn put_keys(&self) -> PutKeyEncoder {
        PutKeyEncoder { schema: Arc::clone(&self.schema), key_cols: self.key_cols.clone(), builder: self.index.builder() }
    }

    /// [`Self::stage`] with the puts' keys from [`Self::put_keys`] (the puts travel with them).
    ///
    /// # Errors
    /// As [`Self::stage`]; [`StorageError::Arrow`] when `keyed` was encoded for another
    /// schema; [`StorageError::CorruptFile`] when the puts' keys are not strictly ascending.
    pub fn stage_keyed(&mut self, keyed: PutKeys, delete_keys: &RecordBatch, max_seq: u64) -> Result<Option<Staged>, StorageError> {
        let PutKeys { schema, puts, built } = keyed;
        if schema != self.schema {
            return Err(arrow_schema::ArrowError::InvalidArgumentError(format!("put keys encoded for another schema than table {}'s", self.name)).into());
        }
        let put_rows: usize = puts.iter().map(RecordBatch::num_rows).sum();
        // Nothing to write and nothing to record. A flush written in parts (the engine's
        // memory-short path) may end on an empty part: it still stages, so the manifest
        // records that every write up to `max_seq` is in committed files.
        if put_rows == 0 && delete_keys.num_rows() == 0 && max_seq <= self.staged.back().map_or(self.flushed_seq, |s| s.max_seq.max(self.flushed_seq)) {
            return Ok(None);
        }
        // File ids are `u32`s (names, key-index locations, the manifest): the last one is
        // never handed out, so `next_file_id` cannot wrap onto a live file's id (and name).
        if put_rows > 0 && self.next_file_id == u32::MAX {
            return Err(StorageError::FileIdsExhausted { table: self.name.clone() });
        }
        let del_rows = gritdb_keys::encode_keys(&self.conv, delete_keys.columns().to_vec())?;
        let file_id = (put_rows > 0).then_some(self.next_file_id);
        let mut additions = Vec::new();
        for r in &del_rows {
            if let Some(old) = self.find_key(r.as_ref()) {
                additions.push(old);
            }
        }
        if let (Some(id), Some(built)) = (file_id, built) {
            let built = built.map_err(|detail| StorageError::CorruptFile { path: self.dir.join(file_name(id)), detail })?;
            // Older live versions of the put keys (looked up before the new file is indexed),
            // by the new set's stored keys.
            for k in built.stored_keys() {
                if let Some(old) = self.index.find_stored(k, |l| self.is_deleted(l)) {
                    additions.push(old);
                }
            }
            self.index.install(id, built);
            self.next_file_id += 1;
            let meta =
                FileMeta { id, name: file_name(id), rows: put_rows as u64, bytes: 0, dv: None, deleted: 0, crc32: None, dv_crc32: None, decoded_bytes: None };
            let guard = FileGuard::new(self.dir.join(&meta.name), &self.vfs, None);
            self.files.insert(id, DataFile { meta, pending: Some(puts), dv_live: RoaringBitmap::new(), dv_committed: RoaringBitmap::new(), guard });
        }
        for loc in &additions {
            if let Some(f) = self.files.get_mut(&loc.file) {
                f.dv_live.insert(loc.row);
            }
        }
        self.account_metadata();
        let staged = Staged { file_id, dv_additions: additions, max_seq };
        self.staged.push_back(staged.clone());
        Ok(Some(staged))
    }

    /// Every write with a sequence number up to this one is in committed files.
    pub fn flushed_seq(&self) -> u64 {
        self.flushed_seq
    }

    /// Flushes staged but not yet committed.
    pub fn staged_count(&self) -> usize {
        self.staged.len()
    }

    /// Prepares the commit of the oldest staged flush (`None` when nothing is staged).
    pub fn plan_commit(&self) -> Option<CommitPlan> {
        let st = self.staged.front()?;
        let next_version = self.version + 1;
        let mut by_file: BTreeMap<u32, RoaringBitmap> = BTreeMap::new();
        for loc in &st.dv_additions {
            by_file.entry(loc.file).or_default().insert(loc.row);
        }
        let mut files = Vec::new();
        let mut dvs = Vec::new();
        let mut obsolete = Vec::new();
        let mut data = None;
        for (id, f) in &self.files {
            let is_new = Some(*id) == st.file_id;
            if f.pending.is_some() && !is_new {
                continue; // staged later; not part of this commit
            }
            let mut meta = f.meta.clone();
            if let Some(add) = by_file.get(id) {
                let bm = &f.dv_committed | add;
                let name = format!("f{id:06}.dv{next_version}");
                if let Some(old) = &meta.dv {
                    obsolete.push(old.clone());
                }
                meta.dv = Some(name.clone());
                meta.deleted = bm.len();
                meta.dv_crc32 = None; // set when written (`CommitPlan::execute`)
                dvs.push((*id, name, bm, None));
            }
            if is_new {
                data = f.pending.clone().map(|b| (meta.name.clone(), b));
            }
            files.push(meta);
        }
        let manifest = Manifest {
            format: crate::manifest::FORMAT,
            table: self.name.clone(),
            version: next_version,
            schema: self.schema.as_ref().clone(),
            primary_key: self.primary_key.clone(),
            next_file_id: self.next_file_id,
            flushed_seq: self.flushed_seq.max(st.max_seq),
            files,
        };
        Some(CommitPlan { data, dvs, manifest, obsolete, dir: self.dir.clone(), written: None, vfs: Arc::clone(&self.vfs) })
    }

    /// Applies an executed commit plan: the staged file becomes a committed file (its rows
    /// are now read from disk and its in-memory batch is dropped).
    pub fn finish_commit(&mut self, plan: CommitPlan) {
        let Some(st) = self.staged.pop_front() else { return };
        for (id, name, bm, crc) in plan.dvs {
            if let Some(f) = self.files.get_mut(&id) {
                f.meta.dv = Some(name);
                f.meta.deleted = bm.len();
                f.meta.dv_crc32 = crc;
                f.dv_committed = bm;
            }
        }
        if let Some(id) = st.file_id
            && let Some(f) = self.files.get_mut(&id)
        {
            f.pending = None;
            f.meta.bytes = plan.written.map_or(0, |w| w.bytes);
            f.meta.crc32 = plan.written.map(|w| w.crc32);
            if let Some(w) = plan.written {
                f.guard.written(w.crc32);
            }
            f.meta.decoded_bytes = plan.written.map(|w| w.decoded_bytes);
        }
        self.version = plan.manifest.version;
        self.flushed_seq = plan.manifest.flushed_seq;
        self.account_metadata();
    }

    /// The memory controller this table's index and metadata draw from.
    pub fn controller(&self) -> &Arc<MemoryController> {
        &self.ctl
    }

    /// The table's accounting handle.
    pub fn account(&self) -> Option<&TableAccount> {
        self.account.as_ref()
    }

    /// Write options for data files.
    pub fn write_options(&self) -> &WriteOptions {
        &self.opts
    }

    /// A scan snapshot: every file with its rows to skip — its deletion vector plus the rows of
    /// every key in `newer_keys` (keys that newer in-memory layers hold).
    ///
    /// Staged files (rows still in memory, [`ScanSource::Memory`]) come first, then committed
    /// ones by id. A scan holds a staged file's batches from its snapshot until it reaches
    /// them, and they stay counted (`batch_blocks`) even after the flush that made them commits
    /// and lets go: behind the committed files, a scan at 2 MiB held one row's 395 KiB of them
    /// while its reader of a committed file (1.6 MiB for a row at the bound) waited for 395 KiB
    /// more — memory only it could give back — and was refused after the whole
    /// `backpressure_timeout`, 11 scans of 12 beside a flush of the same rows (helper-45's F2;
    /// `scan_memory::a_scan_beside_a_flush_reads_its_staged_rows_before_opening_a_file`).
    pub fn scan_files<'a>(&self, newer_keys: impl Iterator<Item = &'a [u8]>) -> Vec<FileScan> {
        let mut masks: BTreeMap<u32, RoaringBitmap> = BTreeMap::new();
        for k in newer_keys {
            if let Some(loc) = self.find_key(k) {
                masks.entry(loc.file).or_default().insert(loc.row);
            }
        }
        let mut files: Vec<FileScan> = self
            .files
            .iter()
            .map(|(id, f)| {
                let deleted = match masks.remove(id) {
                    Some(m) => &f.dv_live | &m,
                    None => f.dv_live.clone(),
                };
                let source = match &f.pending {
                    Some(b) => ScanSource::Memory(b.clone()),
                    None => ScanSource::File(self.dir.join(&f.meta.name)),
                };
                FileScan { id: *id, source, deleted: Arc::new(deleted), guard: Arc::clone(&f.guard) }
            })
            .collect();
        // Stable: staged files keep their id order among themselves, as committed ones do.
        files.sort_by_key(|f| matches!(f.source, ScanSource::File(_)));
        files
    }

    /// Schema of the key columns.
    pub fn key_schema(&self) -> SchemaRef {
        Arc::new(Schema::new(self.key_cols.iter().map(|&i| self.schema.field(i).clone()).collect::<Vec<_>>()))
    }
}
