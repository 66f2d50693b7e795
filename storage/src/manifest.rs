use crate::error::{StorageError, io};
use crate::vfs::Vfs;
use arrow_schema::Schema;
use serde::{Deserialize, Serialize};
use std::fs;
use std::io::Write as _;
use std::path::Path;

/// The manifest's file name inside a table directory.
pub const MANIFEST_FILE: &str = "manifest.json";
const FORMAT: u32 = 1;

/// One data file as committed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileMeta {
    /// File id (unique within the table, increasing).
    pub id: u32,
    /// File name inside the table directory.
    pub name: String,
    /// Rows in the file (deleted ones included).
    pub rows: u64,
    /// File size in bytes.
    pub bytes: u64,
    /// Name of the deletion-vector file, if any row is deleted.
    pub dv: Option<String>,
    /// Rows in the deletion vector.
    pub deleted: u64,
    /// CRC-32 (IEEE, as `crc32fast`) of the whole file as written, checked the first time
    /// the file is read after the table is opened ([`crate::FileGuard::verify`]): Parquet
    /// pages carry no checksum from arrow-rs's writer, so a flipped byte in a value went
    /// unnoticed (a trial of 2026-12-03 changed a stored `Int64` silently). `None` in
    /// manifests written before it (not checked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crc32: Option<u32>,
}

/// The committed state of a table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version of this file (1).
    pub format: u32,
    /// Table name.
    pub table: String,
    /// Increases by one with every commit.
    pub version: u64,
    /// Arrow schema of the table.
    pub schema: Schema,
    /// Primary-key column names, in key order.
    pub primary_key: Vec<String>,
    /// Next data file id.
    pub next_file_id: u32,
    /// Every write with a sequence number up to this one is in the committed files (the
    /// write-ahead log needs to keep only later records of this table).
    #[serde(default)]
    pub flushed_seq: u64,
    /// Live data files.
    pub files: Vec<FileMeta>,
}

impl Manifest {
    /// A version-1 manifest of an empty table.
    pub fn new(table: &str, schema: Schema, primary_key: Vec<String>) -> Self {
        Self { format: FORMAT, table: table.to_owned(), version: 1, schema, primary_key, next_file_id: 1, flushed_seq: 0, files: vec![] }
    }

    /// Reads and checks `<dir>/manifest.json`.
    ///
    /// # Errors
    /// [`StorageError::Io`] when unreadable, [`StorageError::CorruptManifest`] when it does not
    /// parse or is inconsistent.
    pub fn read(dir: &Path) -> Result<Self, StorageError> {
        let path = dir.join(MANIFEST_FILE);
        let text = fs::read(&path).map_err(io(&path))?;
        Self::parse(&text, &path)
    }

    /// Parses and checks manifest bytes (`path` only names the file in errors).
    ///
    /// # Errors
    /// [`StorageError::CorruptManifest`] when the bytes do not parse or are inconsistent.
    pub fn parse(text: &[u8], path: &Path) -> Result<Self, StorageError> {
        let path = path.to_path_buf();
        let m: Manifest = serde_json::from_slice(text)
            .map_err(|e| StorageError::CorruptManifest { path: path.clone(), detail: e.to_string() })?;
        if m.format != FORMAT {
            return Err(StorageError::CorruptManifest { path, detail: format!("unknown format {}", m.format) });
        }
        for f in &m.files {
            if f.id >= m.next_file_id || f.name.contains('/') || f.deleted > f.rows {
                return Err(StorageError::CorruptManifest { path, detail: format!("bad file entry {f:?}") });
            }
        }
        for k in &m.primary_key {
            if m.schema.index_of(k).is_err() {
                return Err(StorageError::CorruptManifest { path, detail: format!("primary key column `{k}` not in schema") });
            }
        }
        Ok(m)
    }

    /// Writes the manifest atomically: `manifest.json.tmp`, fsync, rename over
    /// `manifest.json`, fsync the directory.
    ///
    /// # Errors
    /// [`StorageError::Io`]; the previous manifest stays in place and the tmp file is removed.
    pub fn write(&self, vfs: &dyn Vfs, dir: &Path) -> Result<(), StorageError> {
        self.write_tracked(vfs, dir, &mut false)
    }

    /// [`Self::write`], setting `renamed` once the new manifest may be in place: after the
    /// rename succeeded, or failed with the tmp file gone (a rename the file system applied
    /// and then reported an error for). From then on an error leaves it unknown whether the
    /// old or the new manifest is the one on disk, so every file either names must be kept.
    ///
    /// # Errors
    /// As [`Self::write`].
    pub fn write_tracked(&self, vfs: &dyn Vfs, dir: &Path, renamed: &mut bool) -> Result<(), StorageError> {
        let bytes = serde_json::to_vec_pretty(self).map_err(|e| StorageError::CorruptManifest {
            path: dir.join(MANIFEST_FILE),
            detail: e.to_string(),
        })?;
        write_atomic_tracked(vfs, dir, MANIFEST_FILE, &bytes, renamed)
    }
}

/// Writes `name` in `dir` atomically (tmp + fsync + rename + fsync dir).
pub(crate) fn write_atomic(vfs: &dyn Vfs, dir: &Path, name: &str, bytes: &[u8]) -> Result<(), StorageError> {
    write_atomic_tracked(vfs, dir, name, bytes, &mut false)
}

/// [`write_atomic`], setting `renamed` once the rename may have taken effect (see
/// [`Manifest::write_tracked`]).
fn write_atomic_tracked(vfs: &dyn Vfs, dir: &Path, name: &str, bytes: &[u8], renamed: &mut bool) -> Result<(), StorageError> {
    let tmp = dir.join(format!("{name}.tmp"));
    let dst = dir.join(name);
    let res = (|| {
        let mut f = vfs.create(&tmp).map_err(io(&tmp))?;
        f.write_all(bytes).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
        drop(f);
        let moved = vfs.rename(&tmp, &dst);
        *renamed = moved.is_ok() || crate::vfs::rename_may_have_happened(&tmp);
        moved.map_err(io(&dst))?;
        vfs.sync_dir(dir).map_err(io(dir))
    })();
    if res.is_err() {
        let _ = vfs.remove_file(&tmp);
    }
    res
}
