//! What [`crate::Engine::open`] takes as its data directory, decided before it creates,
//! changes or removes anything there.
//!
//! ```text
//! path missing / empty dir ───────────────────────────────> New     (created, marker written)
//! dir with the marker file GRITDB (format 1) ──────────────> Marked  (opened)
//! dir without it, holding only what an older gritdb wrote,
//!   with a pid LOCK or a table whose manifest reads ───────> Legacy  (opened, then marker written)
//! anything else ───────────────────────────────────────────> NotADataDir / BadDataDirMarker,
//!                                                            nothing touched
//! ```
//!
//! The open's cleanup removes things: dropped tables' `t<N>` directories in `trash/`, table
//! directories without a manifest (an interrupted create), files a manifest does not name,
//! and `wal/` segments, each only under a name gritdb gives. So a directory is only taken
//! when it is positively gritdb's. Before the marker, a `LOCK` file
//! or a `tables/` directory was enough, and a foreign directory holding `tables/t7/draft.tmp`
//! lost that file to the cleanup (fresh-clone trial, 2026-12-04).

use crate::error::{DataDirFound, Error, MarkerProblem, Result, io};
use gritdb_storage::{MANIFEST_FILE, Manifest, Vfs};
use std::fs;
use std::path::Path;

/// The file at the root of every data directory gritdb creates (since 2026-12-04) that makes
/// it one: two lines, `gritdb data directory` and `format 1`. Written durably (temp file,
/// fsync, rename, fsync of the directory) right after the first open takes the `LOCK`.
pub const DATA_DIR_MARKER: &str = "GRITDB";

/// The data-directory format this build writes and reads (the marker's second line).
pub(crate) const DATA_DIR_FORMAT: u32 = 1;

/// The marker's first line.
const MARKER_MAGIC: &str = "gritdb data directory";

/// A marker longer than this is not one gritdb wrote (it writes 31 bytes).
const MARKER_MAX_BYTES: u64 = 4096;

/// Entries of a directory that do not make it someone else's: `lost+found`, which `mkfs`
/// leaves at the root of a new ext2/3/4 file system (a data directory on its own volume).
const IGNORED_ENTRIES: [&str; 1] = ["lost+found"];

/// Names a foreign directory's error lists (the rest are counted).
const LISTED_ENTRIES: usize = 5;

/// The name of the marker's temp file, left by an open killed while writing it.
fn marker_tmp() -> String {
    format!("{DATA_DIR_MARKER}.tmp")
}

/// The marker's bytes.
fn marker_bytes() -> String {
    format!("{MARKER_MAGIC}\nformat {DATA_DIR_FORMAT}\n")
}

/// What [`classify`] found: the open may go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A missing path (to create) or an empty directory: a new data directory.
    New,
    /// A directory with a valid marker.
    Marked,
    /// A directory an older gritdb wrote, before the marker: it gets one.
    Legacy,
}

/// Decides whether `dir` is a data directory [`crate::Engine::open`] may use, reading only.
///
/// # Errors
/// [`Error::NotADataDir`] for a missing path when `create` is off, a file, or a non-empty
/// directory that is not positively gritdb's; [`Error::BadDataDirMarker`] for a marker
/// gritdb cannot read; [`Error::Storage`] for a manifest of a legacy data directory that does
/// not read (its `tables/t<N>/manifest.json` damaged); [`Error::Io`].
pub(crate) fn classify(dir: &Path, create: bool) -> Result<Kind> {
    let refuse = |found| Err(Error::NotADataDir { path: dir.to_path_buf(), found });
    let meta = match fs::metadata(dir) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return if create { Ok(Kind::New) } else { refuse(DataDirFound::Missing) };
        }
        Err(e) => return Err(Error::Io { path: dir.to_path_buf(), source: e }),
    };
    if !meta.is_dir() {
        return refuse(DataDirFound::NotADirectory);
    }
    let marker = dir.join(DATA_DIR_MARKER);
    if fs::symlink_metadata(&marker).is_ok_and(|m| m.is_file()) {
        check_marker(&marker)?;
        return Ok(Kind::Marked);
    }
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).map_err(io(dir))? {
        let name = entry.map_err(io(dir))?.file_name();
        if !IGNORED_ENTRIES.iter().any(|i| name == *i) {
            names.push(name.to_string_lossy().into_owned());
        }
    }
    if names.is_empty() {
        return Ok(Kind::New);
    }
    if is_legacy(dir, &names)? {
        return Ok(Kind::Legacy);
    }
    names.sort();
    let total = names.len();
    names.truncate(LISTED_ENTRIES);
    refuse(DataDirFound::Foreign { entries: names, total })
}

/// Reads the marker at `path`: `Ok` when it is one this build reads.
fn check_marker(path: &Path) -> Result<()> {
    let bad = |problem| Err(Error::BadDataDirMarker { path: path.to_path_buf(), problem });
    let damaged = |detail: String| bad(MarkerProblem::Damaged { detail });
    let len = fs::metadata(path).map_err(io(path))?.len();
    if len > MARKER_MAX_BYTES {
        return damaged(format!("{len} bytes, where gritdb writes {}", marker_bytes().len()));
    }
    let bytes = fs::read(path).map_err(io(path))?;
    let Ok(text) = std::str::from_utf8(&bytes) else {
        return damaged("not UTF-8 text".into());
    };
    let mut lines = text.lines();
    if lines.next() != Some(MARKER_MAGIC) {
        return damaged(format!("its first line is not `{MARKER_MAGIC}`"));
    }
    let Some(format) = lines.next().and_then(|l| l.strip_prefix("format ")).and_then(|n| n.parse::<u64>().ok()) else {
        return damaged("its second line is not `format N`".into());
    };
    if format != u64::from(DATA_DIR_FORMAT) {
        return bad(MarkerProblem::UnknownFormat { found: format, supported: DATA_DIR_FORMAT });
    }
    // Later lines are left for later formats' additions that this one may ignore.
    Ok(())
}

/// Writes the marker into `dir` (a new or legacy data directory, its `LOCK` held).
///
/// # Errors
/// [`Error::Storage`] (`StorageError::Io`) when it cannot be written and synced.
pub(crate) fn write_marker(vfs: &dyn Vfs, dir: &Path) -> Result<()> {
    gritdb_storage::write_atomic(vfs, dir, DATA_DIR_MARKER, marker_bytes().as_bytes()).map_err(Error::Storage)
}

/// Whether a directory without the marker, holding `names` (not empty, `lost+found` aside), is
/// one an older gritdb wrote: every entry is one gritdb writes, and one of them proves it.
///
/// - `LOCK`: a file holding a decimal pid (proof: every open writes its pid there first);
/// - `tables/`: only `t<N>` directories, each with a manifest that reads and checks out
///   (proof), or holding only `manifest.json.tmp` or nothing (an interrupted create);
/// - `trash/`: only `t<N>` directories holding only table files (`manifest.json`,
///   `f<N>.parquet`, `f<N>.dv<N>`, and their `.tmp`s);
/// - `wal/`: only `wal-<N>.log` files, named exactly as gritdb names them (`wal-00000001.log`);
/// - the marker's temp file (an open killed while writing it).
///
/// So a foreign directory is never taken for gritdb's because one of its names matches, and
/// whatever the open's cleanup removes has a name gritdb gives.
///
/// # Errors
/// When every name and shape is gritdb's but a `manifest.json` does not read: that manifest's
/// error ([`Error::Storage`]), as before the marker; [`Error::Io`] when a directory cannot
/// be listed.
fn is_legacy(dir: &Path, names: &[String]) -> Result<bool> {
    let mut proof = false;
    let mut manifests = Vec::new();
    for name in names {
        let path = dir.join(name);
        let Ok(meta) = fs::symlink_metadata(&path) else { return Ok(false) };
        let ok = match name.as_str() {
            "LOCK" => {
                // Every open wrote its pid there first.
                let pid = meta.is_file() && is_gritdb_lock(&path);
                proof |= pid;
                pid
            }
            n if n == marker_tmp() => meta.is_file(),
            "tables" => meta.is_dir() && tables_look_gritdb(&path, &mut manifests)?,
            "trash" => meta.is_dir() && all_entries(&path, |e| is_table_dir_name(e) && table_files_only(&path.join(e)))?,
            "wal" => meta.is_dir() && all_entries(&path, |e| is_wal_segment(e) && fs::symlink_metadata(path.join(e)).is_ok_and(|m| m.is_file()))?,
            _ => false,
        };
        if !ok {
            return Ok(false);
        }
    }
    for table in manifests {
        Manifest::read(&table).map_err(Error::Storage)?;
        proof = true;
    }
    Ok(proof)
}

/// Whether every entry of `tables/` is a `t<N>` directory with a manifest (collected into
/// `manifests` to be read) or an interrupted create.
fn tables_look_gritdb(tables: &Path, manifests: &mut Vec<std::path::PathBuf>) -> Result<bool> {
    all_entries(tables, |name| {
        let path = tables.join(name);
        if !is_table_dir_name(name) || !fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir()) {
            return false;
        }
        if fs::symlink_metadata(path.join(MANIFEST_FILE)).is_ok_and(|m| m.is_file()) {
            manifests.push(path);
            return true;
        }
        is_interrupted_create(&path).unwrap_or(false)
    })
}

/// Whether `check` holds for the name of every entry of `dir` (names that are not UTF-8 are
/// not gritdb's).
fn all_entries(dir: &Path, mut check: impl FnMut(&str) -> bool) -> Result<bool> {
    for entry in fs::read_dir(dir).map_err(io(dir))? {
        let name = entry.map_err(io(dir))?.file_name();
        if !name.to_str().is_some_and(&mut check) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The id of a table directory named `t<id>` exactly as gritdb names it (`t7`; not `t07`,
/// `t+7` or an id past `u64::MAX`).
pub(crate) fn table_dir_id(name: &str) -> Option<u64> {
    gritdb_storage::canonical_id(name.strip_prefix('t')?, 1)
}

/// `t<N>`: a table directory's name ([`table_dir_id`]).
fn is_table_dir_name(name: &str) -> bool {
    table_dir_id(name).is_some()
}

/// Empties `trash/` of the open data directory `dir` of what interrupted drops left there:
/// the `t<N>` directories ([`table_dir_id`]) a drop renamed there, which it had committed to
/// remove. Other entries are not gritdb's: left, with a warning. Creates `trash/` when missing.
///
/// # Errors
/// [`Error::Io`] when `trash/` cannot be listed or created, or a table directory removed.
pub(crate) fn empty_trash(dir: &Path) -> Result<()> {
    let trash = dir.join("trash");
    fs::create_dir_all(&trash).map_err(io(&trash))?;
    for entry in fs::read_dir(&trash).map_err(io(&trash))? {
        let entry = entry.map_err(io(&trash))?;
        let path = entry.path();
        let ours = entry.file_name().to_str().is_some_and(is_table_dir_name) && fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir());
        if ours {
            fs::remove_dir_all(&path).map_err(io(&path))?;
        } else {
            tracing::warn!(path = %path.display(), "leaving an entry of trash/ gritdb did not put there");
        }
    }
    Ok(())
}

/// `wal-<N>.log`: a write-ahead log segment's name exactly as gritdb gives it
/// ([`gritdb_storage::wal_segment_id`]: `wal-1.log` is not one).
fn is_wal_segment(name: &str) -> bool {
    gritdb_storage::wal_segment_id(name).is_some()
}

/// Whether `dir` holds only files named as a table's ([`gritdb_storage::is_table_file_name`]:
/// `manifest.json`, `f<N>.parquet`, `f<N>.dv<N>`, each possibly with `.tmp` after it; a
/// dropped table in `trash/`).
fn table_files_only(dir: &Path) -> bool {
    fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir())
        && all_entries(dir, |n| gritdb_storage::is_table_file_name(n) && fs::symlink_metadata(dir.join(n)).is_ok_and(|m| m.is_file())).unwrap_or(false)
}

/// Whether the table directory `dir` (which has no manifest) is what an interrupted
/// `create_table` leaves: nothing, or only the manifest's temp file. The open removes such a
/// directory; anything else in it means a manifest was lost, and the open refuses.
///
/// # Errors
/// [`Error::Io`] when it cannot be listed.
pub(crate) fn is_interrupted_create(dir: &Path) -> Result<bool> {
    let tmp = format!("{MANIFEST_FILE}.tmp");
    all_entries(dir, |n| n == tmp && fs::symlink_metadata(dir.join(n)).is_ok_and(|m| m.is_file()))
}

/// Whether the `LOCK` file at `path` is one gritdb wrote: its whole content is the decimal pid
/// of the process that last opened the directory. `LevelDB` and `RocksDB` leave an empty `LOCK`
/// in their directories; taking one for gritdb's let the open's cleanup remove that program's
/// files (fresh-clone trial, 2026-12-04). A file that cannot be read is not gritdb's.
fn is_gritdb_lock(path: &Path) -> bool {
    let mut buf = [0u8; 32];
    let Ok(mut f) = fs::File::open(path) else { return false };
    let Ok(n) = std::io::Read::read(&mut f, &mut buf) else { return false };
    n > 0 && n < buf.len() && buf[..n].iter().all(u8::is_ascii_digit)
}
