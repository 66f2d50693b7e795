use crate::error::{StorageError, io};
use crate::vfs::Vfs;
use crate::wal::SEQ_LIMIT;
use arrow_schema::Schema;
use serde::{Deserialize, Serialize};
use std::fs;
use std::io::Write as _;
use std::path::Path;

/// The manifest's file name inside a table directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The format this build writes: 2 adds the manifest's own checksum line
/// ([`MANIFEST_CHECKSUM_KEY`]) and the deletion vectors' checksums ([`FileMeta::dv_crc32`]).
/// Format-1 manifests (written before 2026-12-04) are still read, unchecked.
pub(crate) const FORMAT: u32 = 2;
/// The oldest format this build reads.
const OLDEST_FORMAT: u32 = 1;

/// The key of the manifest's first field line — the file's second line, right after the
/// `{` line — `  "manifest_crc32": N,`: `N` is the CRC-32 (IEEE, as `crc32fast` and
/// Python's `zlib.crc32`) of every byte after that line's newline, to the end of the file.
/// The manifest stays plain JSON (the key is one
/// more field, ignored by a reader that does not check it), and a flipped byte anywhere in it
/// — a digit of `flushed_seq`, a row count, a file name — is a
/// [`StorageError::CorruptManifest`] at open instead of a silently different table (a digit
/// of `flushed_seq` changed would make the write-ahead log skip or replay the wrong records).
pub const MANIFEST_CHECKSUM_KEY: &str = "manifest_crc32";

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
    /// CRC-32 (as [`Self::crc32`]) of the deletion-vector file [`Self::dv`] as written,
    /// checked when the table is opened: a roaring bitmap with a flipped bit still parses,
    /// as other rows deleted. `None` in format-1 manifests (checked then only against
    /// [`Self::deleted`] and [`Self::rows`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dv_crc32: Option<u32>,
    /// Bytes of the file's rows as Arrow arrays when it was written
    /// ([`crate::WrittenFile::decoded_bytes`]): what reading it back holds in memory, which
    /// [`Self::bytes`] does not tell. A page codec stores long repetitive values at 1/20
    /// (Snappy) to 1/250 (`LZ4_RAW`) of their size, so a compaction planned by file bytes
    /// merged files whose rows did not fit its limit. `None` in manifests written before
    /// 2026-12-04 ([`Self::decoded_estimate`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decoded_bytes: Option<u64>,
}

impl FileMeta {
    /// Bytes the file's rows take decoded: [`Self::decoded_bytes`], else
    /// [`LEGACY_DECODED_RATIO`] times the file's bytes.
    pub fn decoded_estimate(&self) -> u64 {
        self.decoded_bytes.unwrap_or_else(|| self.bytes.saturating_mul(LEGACY_DECODED_RATIO))
    }
}

/// Decoded bytes per file byte assumed for a file whose manifest entry has no
/// [`FileMeta::decoded_bytes`]: TPC-H lineitem as Arrow arrays (about 190 bytes a row) over
/// its Snappy file (about 31 bytes a row at SF 0.1), rounded: 6.
pub const LEGACY_DECODED_RATIO: u64 = 6;

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

    /// Parses and checks manifest bytes (`path` only names the file in errors): the checksum
    /// line ([`MANIFEST_CHECKSUM_KEY`], required from format 2), then the JSON, then the
    /// entries' consistency.
    ///
    /// # Errors
    /// [`StorageError::CorruptManifest`] when the bytes do not parse, their checksum does not
    /// match, or they are inconsistent. A format-2 manifest whose second line is not the
    /// checksum line is refused in one of two words: the key missing altogether, or present
    /// elsewhere (the file was re-formatted, and the checksum, over exact bytes, cannot be
    /// verified).
    pub fn parse(text: &[u8], path: &Path) -> Result<Self, StorageError> {
        let path = path.to_path_buf();
        let corrupt = |detail: String| StorageError::CorruptManifest { path: path.clone(), detail };
        let checked = match split_checksum(text) {
            Some((Some(stored), body)) => {
                let actual = crc32fast::hash(body);
                if actual != stored {
                    return Err(corrupt(format!(
                        "checksum mismatch: {MANIFEST_CHECKSUM_KEY} is {stored}, the bytes after its line hash to {actual}, so they are \
                         not the bytes the engine wrote (damage, or an edit or re-format that was not resealed). If you edited it on \
                         purpose, reseal it ({RESEAL_DOC})"
                    )));
                }
                true
            }
            Some((None, _)) => {
                return Err(corrupt(format!(
                    "unreadable {MANIFEST_CHECKSUM_KEY} line: the file's second line must be `  \"{MANIFEST_CHECKSUM_KEY}\": N,` (N a \
                     decimal CRC-32, a newline right after the comma). If you edited it on purpose, reseal it ({RESEAL_DOC})"
                )));
            }
            None => false,
        };
        let m: Manifest = serde_json::from_slice(text).map_err(|e| corrupt(e.to_string()))?;
        if !(OLDEST_FORMAT..=FORMAT).contains(&m.format) {
            return Err(corrupt(format!("unknown format {}", m.format)));
        }
        if m.format >= 2 && !checked {
            return Err(corrupt(unchecked_detail(text, m.format)));
        }
        // The counters the table continues from with `+ 1`: the next commit's version (which
        // also names its deletion vectors) and the next write's sequence number. At the end
        // of `u64` they wrapped (writes numbered from 0 were then skipped at replay as
        // already flushed).
        for (name, value) in [("version", m.version), ("flushed_seq", m.flushed_seq)] {
            if value >= SEQ_LIMIT {
                return Err(corrupt(format!(
                    "{name} {value} is out of range (below {SEQ_LIMIT}): the engine continues from it, and no table commits or \
                     writes that many times"
                )));
            }
        }
        // Each entry named as gritdb names its file id, each id once: a flush or compaction
        // names its new file by `next_file_id` and a commit its deletion vectors by file id
        // and version, so an entry under another name could be replaced by a later file (its
        // rows lost), and of two entries with one id only the last was read.
        let mut ids = std::collections::HashSet::new();
        for f in &m.files {
            if f.id >= m.next_file_id || f.deleted > f.rows {
                return Err(corrupt(format!("bad file entry {f:?}")));
            }
            let name = crate::table::file_name(f.id);
            if f.name != name {
                return Err(corrupt(format!(
                    "file id {} is not named `{name}` but {:?}: gritdb names a data file by its id, and a later file of that name \
                     would replace it",
                    f.id, f.name
                )));
            }
            if let Some(dv) = &f.dv
                && !dv_name_fits(dv, f.id, m.version)
            {
                return Err(corrupt(format!(
                    "deletion vector {dv:?} of file id {} is not named `f{:06}.dv<version>` with a version up to the manifest's {}",
                    f.id, f.id, m.version
                )));
            }
            if !ids.insert(f.id) {
                return Err(corrupt(format!("lists file id {} twice", f.id)));
            }
        }
        // The key as `create_table` requires it: at least one column, each once. With none,
        // every row's key was the empty key and writes applied nothing while reporting their
        // rows written.
        if m.primary_key.is_empty() {
            return Err(corrupt("no primary-key column: a table's key has at least one".into()));
        }
        for (i, k) in m.primary_key.iter().enumerate() {
            if m.schema.index_of(k).is_err() {
                return Err(corrupt(format!("primary key column `{k}` not in schema")));
            }
            if m.primary_key[..i].contains(k) {
                return Err(corrupt(format!("primary key names column `{k}` twice")));
            }
        }
        Ok(m)
    }

    /// Writes the manifest atomically: `manifest.json.tmp`, fsync, rename over
    /// `manifest.json`, fsync the directory.
    ///
    /// # Errors
    /// [`StorageError::Io`]; [`StorageError::Arrow`] (`JsonError`) when the schema does not
    /// serialize. The previous manifest stays in place and the tmp file is removed.
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
        // Not a corrupt manifest (nothing was read): the schema did not serialize.
        let bytes = self.to_bytes().map_err(|e| arrow_schema::ArrowError::JsonError(format!("manifest of table {} for {}: {e}", self.table, dir.display())))?;
        write_atomic_tracked(vfs, dir, MANIFEST_FILE, &bytes, renamed)
    }

    /// The manifest as written: pretty JSON whose first field line is the checksum of the
    /// lines after it ([`MANIFEST_CHECKSUM_KEY`]).
    ///
    /// # Errors
    /// `serde_json`'s, for a schema it cannot serialize.
    pub fn to_bytes(&self) -> Result<Vec<u8>, serde_json::Error> {
        let json = serde_json::to_vec_pretty(self)?;
        // `to_vec_pretty` of a struct starts with "{\n" and has at least one field line.
        let body = &json[2..];
        let line = format!("{{\n  \"{MANIFEST_CHECKSUM_KEY}\": {},\n", crc32fast::hash(body));
        let mut out = Vec::with_capacity(line.len() + body.len());
        out.extend_from_slice(line.as_bytes());
        out.extend_from_slice(body);
        Ok(out)
    }
}

/// Whether `dv` is the name a commit gives a deletion vector of file `id` at a version up to
/// `version`: `f<id, 6 digits>.dv<version, no leading zeros>`.
fn dv_name_fits(dv: &str, id: u32, version: u64) -> bool {
    dv.strip_prefix(&format!("f{id:06}.dv")).and_then(|v| crate::canonical_id(v, 1)).is_some_and(|v| v <= version)
}

/// Where the docs show how to reseal a hand-edited manifest, for error texts.
const RESEAL_DOC: &str = "docs/architecture.md, \"Resealing a hand-edited manifest\"";

/// Why a manifest of `format` (2 or later) whose bytes do not start with the checksum line is
/// refused: the key missing altogether, or present but not where the format puts it (the
/// file was re-formatted: the checksum covers exact bytes, so it cannot be verified).
fn unchecked_detail(text: &[u8], format: u32) -> String {
    let present = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(text).is_ok_and(|m| m.contains_key(MANIFEST_CHECKSUM_KEY));
    let line = format!("`  \"{MANIFEST_CHECKSUM_KEY}\": N,` on the file's second line, right after the `{{` line");
    if present {
        format!(
            "format {format}: its {MANIFEST_CHECKSUM_KEY} key is present but not as {line}, so the file was re-formatted (compacted \
             onto one line, re-indented, keys re-ordered or CRLF line ends, as `jq -c` or `json.dump` do). The checksum covers \
             the exact bytes the engine wrote, so re-formatted bytes cannot be verified and are not read: put back the file the \
             engine wrote, or reseal this one ({RESEAL_DOC})"
        )
    } else {
        format!(
            "format {format} without its {MANIFEST_CHECKSUM_KEY} checksum: the key is missing (it must be {line}). If the file \
             was edited on purpose, reseal it ({RESEAL_DOC})"
        )
    }
}

/// Splits manifest bytes into the checksum its first field line (the file's second line)
/// states and the bytes it covers:
/// `None` when the text has no checksum line (a format-1 manifest, or one damaged there —
/// then the format check refuses it); `Some((None, _))` when the line is there but its
/// number does not read.
fn split_checksum(text: &[u8]) -> Option<(Option<u32>, &[u8])> {
    let prefix = format!("{{\n  \"{MANIFEST_CHECKSUM_KEY}\": ");
    let rest = text.strip_prefix(prefix.as_bytes())?;
    let Some(end) = rest.iter().position(|&b| b == b'\n') else { return Some((None, rest)) };
    let number = rest[..end].strip_suffix(b",").and_then(|n| std::str::from_utf8(n).ok()).and_then(|n| n.parse::<u32>().ok());
    Some((number, &rest[end + 1..]))
}

/// Writes `name` in `dir` atomically and durably: `name.tmp`, fsync, rename over `name`,
/// fsync `dir` (the manifest's way, also used for the data directory's marker file).
///
/// # Errors
/// [`StorageError::Io`]; the tmp file is removed and a previous `name` stays in place.
pub fn write_atomic(vfs: &dyn Vfs, dir: &Path, name: &str, bytes: &[u8]) -> Result<(), StorageError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_schema::{DataType, Field};

    fn sample() -> Manifest {
        let schema = Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("v", DataType::Utf8, true)]);
        let mut m = Manifest::new("t", schema, vec!["k".into()]);
        m.version = 7;
        m.next_file_id = 3;
        m.flushed_seq = 123_456;
        m.files = vec![
            FileMeta {
                id: 1,
                name: "f000001.parquet".into(),
                rows: 8192,
                bytes: 70_001,
                dv: Some("f000001.dv7".into()),
                deleted: 10,
                crc32: Some(42),
                dv_crc32: Some(7),
                decoded_bytes: Some(900_000),
            },
            FileMeta {
                id: 2,
                name: "f000002.parquet".into(),
                rows: 500,
                bytes: 4_000,
                dv: None,
                deleted: 0,
                crc32: Some(43),
                dv_crc32: None,
                decoded_bytes: None,
            },
        ];
        m
    }

    /// The written bytes are JSON whose first field is the checksum, and they read back as
    /// the same manifest.
    #[test]
    fn a_written_manifest_reads_back_and_is_plain_json() {
        let m = sample();
        let bytes = m.to_bytes().unwrap();
        let text = std::str::from_utf8(&bytes).unwrap();
        assert!(text.starts_with("{\n  \"manifest_crc32\": "), "{text}");
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let body = &bytes[text.find(",\n").unwrap() + 2..];
        assert_eq!(v[MANIFEST_CHECKSUM_KEY].as_u64(), Some(u64::from(crc32fast::hash(body))));
        assert_eq!(v["format"].as_u64(), Some(2));
        assert_eq!(Manifest::parse(&bytes, Path::new("m")).unwrap(), m);
    }

    /// Written by the engine, sealed, but holding what no build wrote — a counter at the end
    /// of `u64`, a file entry not named for its id or an id twice, a deletion vector named for
    /// another file or a later version, an empty or repeated key — is refused
    /// (`CorruptManifest`), each saying what is wrong; the sample itself reads.
    #[test]
    fn a_sealed_manifest_the_engine_could_not_have_written_is_refused() {
        type Edit = fn(&mut Manifest);
        let cases: [(Edit, &str); 10] = [
            (|m| m.flushed_seq = u64::MAX, "flushed_seq 18446744073709551615 is out of range"),
            (|m| m.flushed_seq = SEQ_LIMIT, "flushed_seq 9223372036854775808 is out of range"),
            (|m| m.version = u64::MAX - 1, "version 18446744073709551614 is out of range"),
            (|m| m.files[0].name = "f000002.parquet".into(), "file id 1 is not named `f000001.parquet`"),
            (|m| m.files[1].name = "../f000002.parquet".into(), "file id 2 is not named `f000002.parquet`"),
            (|m| m.files[0].dv = Some("f000002.dv7".into()), "deletion vector \"f000002.dv7\" of file id 1"),
            (|m| m.files[0].dv = Some("f000001.dv8".into()), "with a version up to the manifest's 7"),
            (|m| m.files[1] = m.files[0].clone(), "lists file id 1 twice"),
            (|m| m.primary_key.clear(), "no primary-key column"),
            (|m| m.primary_key = vec!["k".into(), "v".into(), "k".into()], "primary key names column `k` twice"),
        ];
        assert!(Manifest::parse(&sample().to_bytes().unwrap(), Path::new("m")).is_ok());
        for (edit, want) in cases {
            let mut m = sample();
            edit(&mut m);
            match Manifest::parse(&m.to_bytes().unwrap(), Path::new("m")) {
                Err(StorageError::CorruptManifest { detail, .. }) => assert!(detail.contains(want), "{want:?} not in {detail}"),
                other => panic!("{want}: {other:?}"),
            }
        }
    }

    /// Every single-bit flip of every byte of a written manifest is refused
    /// (`CorruptManifest`), wherever it lands: in a value the JSON still parses with (a digit
    /// of `flushed_seq`, a row count, a file name), in a key, in the checksum line itself.
    #[test]
    fn every_flipped_bit_of_a_manifest_is_refused() {
        let bytes = sample().to_bytes().unwrap();
        let mut parsed_after_flip = 0;
        for at in 0..bytes.len() {
            for bit in 0..8 {
                let mut b = bytes.clone();
                b[at] ^= 1 << bit;
                match Manifest::parse(&b, Path::new("m")) {
                    Err(StorageError::CorruptManifest { .. }) => {}
                    other => panic!("byte {at} bit {bit} ({:?}): {other:?}", bytes[at] as char),
                }
                parsed_after_flip += usize::from(serde_json::from_slice::<Manifest>(&b).is_ok());
            }
        }
        // Without the checksum many of these flips would have been taken as a table.
        assert!(parsed_after_flip >= 100, "{parsed_after_flip} flips still parse as JSON");
    }

    /// A format-1 manifest (before checksums) is read unchecked; a format-2 one without its
    /// checksum line, or with an unreadable one, is refused.
    #[test]
    fn older_manifests_read_and_a_missing_checksum_line_is_refused() {
        let mut m = sample();
        m.format = 1;
        for f in &mut m.files {
            f.crc32 = None;
            f.dv_crc32 = None;
        }
        let plain = serde_json::to_vec_pretty(&m).unwrap();
        assert_eq!(Manifest::parse(&plain, Path::new("m")).unwrap(), m);
        m.format = 2;
        let plain = serde_json::to_vec_pretty(&m).unwrap();
        let e = Manifest::parse(&plain, Path::new("m")).unwrap_err();
        assert!(matches!(e, StorageError::CorruptManifest { .. }), "{e:?}");
        assert!(e.to_string().contains("format 2 without its manifest_crc32 checksum: the key is missing"), "{e}");
        assert!(e.to_string().contains("reseal it (docs/architecture.md"), "{e}");
        let mut unreadable = b"{\n  \"manifest_crc32\": x1,\n".to_vec();
        unreadable.extend_from_slice(&plain[2..]);
        let e = Manifest::parse(&unreadable, Path::new("m")).unwrap_err();
        assert!(matches!(e, StorageError::CorruptManifest { .. }), "{e:?}");
        assert!(e.to_string().contains("unreadable manifest_crc32 line"), "{e}");
        for cut in [0, 5, 22, 30] {
            let bytes = sample().to_bytes().unwrap();
            assert!(matches!(Manifest::parse(&bytes[..cut], Path::new("m")), Err(StorageError::CorruptManifest { .. })), "cut {cut}");
        }
    }

    /// A manifest re-formatted by a tool (compacted onto one line as `jq -c` does, re-indented
    /// as `json.dump(indent=4)`, or with CRLF line ends) keeps its `manifest_crc32` key but
    /// not the line the checksum is defined on: it is refused as re-formatted, distinct from a
    /// key missing altogether and from a checksum mismatch; the checksum itself still equals
    /// the original's. A manifest that kept the layout but gained a trailing newline (as
    /// `jq .` writes) is a checksum mismatch.
    #[test]
    fn a_reformatted_manifest_is_refused_as_reformatted() {
        let bytes = sample().to_bytes().unwrap();
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let mut indented = Vec::new();
        let fmt = serde_json::ser::PrettyFormatter::with_indent(b"    ");
        serde::Serialize::serialize(&v, &mut serde_json::Serializer::with_formatter(&mut indented, fmt)).unwrap();
        let crlf = String::from_utf8(bytes.clone()).unwrap().replace('\n', "\r\n").into_bytes();
        for (what, text) in [("compact", serde_json::to_vec(&v).unwrap()), ("indent 4", indented), ("crlf", crlf)] {
            let e = Manifest::parse(&text, Path::new("m")).unwrap_err();
            assert!(matches!(e, StorageError::CorruptManifest { .. }), "{what}: {e:?}");
            let msg = e.to_string();
            for part in
                ["manifest_crc32 key is present but not as", "so the file was re-formatted", "cannot be verified", "reseal this one (docs/architecture.md"]
            {
                assert!(msg.contains(part), "{what}: {part:?} not in {msg}");
            }
            assert!(!msg.contains("missing") && !msg.contains("mismatch"), "{what}: {msg}");
        }
        let mut trailing = bytes.clone();
        trailing.push(b'\n');
        let e = Manifest::parse(&trailing, Path::new("m")).unwrap_err();
        assert!(matches!(e, StorageError::CorruptManifest { .. }), "{e:?}");
        assert!(e.to_string().contains("checksum mismatch: manifest_crc32 is"), "{e}");
        assert!(e.to_string().contains("not the bytes the engine wrote"), "{e}");
    }

    /// A manifest is read only when the engine opens its data directory, and one refused
    /// manifest refuses the whole open: the text says so, naming the data directory of a
    /// manifest at `<data dir>/tables/t<id>/manifest.json` and the file.
    #[test]
    fn a_corrupt_manifest_says_the_data_directory_does_not_open() {
        let path = Path::new("/srv/data/tables/t3/manifest.json");
        let e = Manifest::parse(b"{", path).unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with("corrupt manifest /srv/data/tables/t3/manifest.json: "), "{msg}");
        assert!(msg.contains("The engine does not open its data directory `/srv/data` while one of its table manifests is refused"), "{msg}");
        assert!(msg.ends_with("restore this manifest from a backup"), "{msg}");
        assert!(!msg.contains("The table cannot be opened"), "{msg}");
        let other = Manifest::parse(b"{", Path::new("m")).unwrap_err().to_string();
        assert!(other.contains("The engine does not open its data directory while"), "{other}");
    }
}
