//! Parquet files gritdb writes are read by other engines with the same answers, and
//! `Table::export_parquet` fails typed, leaving no partial file.
//!
//! The cross-engine checks run `python3 tests/interop/check.py`, which reads the files with
//! pyarrow and with `DuckDB` and prints count and exact sums as JSON lines. Without python3 or
//! the packages the check fails when `GRITDB_INTEROP_REQUIRED=1` (CI sets it after
//! `pip install pyarrow duckdb`) and otherwise prints a `skipped:` line straight to the
//! terminal (not captured by the test harness), never passing in silence.

use arrow::array::{Array, Decimal128Array, RecordBatch};
use gritdb::memory::Category;
use gritdb::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use gritdb::vfs::FaultFs;
use gritdb::{Engine, EngineConfig, ExportError, ExportOptions, ScanOptions, Table};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use tpchgen::generators::LineItemGenerator;
use tpchgen_arrow::LineItemArrow;

/// Row count and exact sums (hundredths) of `l_quantity` and `l_extendedprice`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Totals {
    count: u64,
    quantity: i128,
    price: i128,
}

fn add_batch(t: &mut Totals, b: &RecordBatch) {
    let col = |name: &str| {
        let c = b.column(b.schema().index_of(name).unwrap());
        c.as_any().downcast_ref::<Decimal128Array>().unwrap().iter().map(|v| v.unwrap()).sum::<i128>()
    };
    t.count += b.num_rows() as u64;
    t.quantity += col("l_quantity");
    t.price += col("l_extendedprice");
}

/// What gritdb's own scan returns.
fn scan_totals(t: &Table) -> Totals {
    let mut tot = Totals { count: 0, quantity: 0, price: 0 };
    for b in t.scan(ScanOptions::default().projection(["l_quantity", "l_extendedprice"])).unwrap() {
        add_batch(&mut tot, &b.unwrap());
    }
    tot
}

/// What the `parquet` crate reads from `path`, and its row-group count.
fn file_totals(path: &Path) -> (Totals, usize) {
    let builder = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(path).unwrap()).unwrap();
    let groups = builder.metadata().num_row_groups();
    let mut tot = Totals { count: 0, quantity: 0, price: 0 };
    for b in builder.build().unwrap() {
        add_batch(&mut tot, &b.unwrap());
    }
    (tot, groups)
}

/// TPC-H lineitem at SF 0.01 (60,175 rows) in batches of 1,000 rows.
fn lineitem() -> Vec<RecordBatch> {
    let batches: Vec<RecordBatch> = LineItemArrow::new(LineItemGenerator::new(0.01, 1, 1)).with_batch_size(1000).collect::<Result<_, _>>().unwrap();
    assert_eq!(batches.iter().map(RecordBatch::num_rows).sum::<usize>(), 60_175);
    batches
}

/// `batch` with `l_quantity` raised by `delta` hundredths (for upserts that change sums).
fn bump_quantity(batch: &RecordBatch, delta: i128) -> RecordBatch {
    let i = batch.schema().index_of("l_quantity").unwrap();
    let q = batch.column(i).as_any().downcast_ref::<Decimal128Array>().unwrap();
    let bumped = Decimal128Array::from_iter_values(q.values().iter().map(|v| v + delta)).with_precision_and_scale(15, 2).unwrap();
    let mut cols = batch.columns().to_vec();
    cols[i] = Arc::new(bumped);
    RecordBatch::try_new(batch.schema(), cols).unwrap()
}

fn lineitem_table(engine: &Engine, batches: &[RecordBatch]) -> Table {
    let t = engine.create_table("lineitem", batches[0].schema(), &["l_orderkey", "l_linenumber"]).unwrap();
    for b in batches {
        t.insert(b).unwrap();
    }
    t
}

fn delete_batch(t: &Table, b: &RecordBatch) {
    let keys = b.project(&[0, 3]).unwrap();
    assert_eq!(t.delete(&keys).unwrap(), b.num_rows());
}

/// One JSON line of check.py's output.
#[derive(Debug)]
struct Reader {
    name: String,
    line: String,
}

/// The integer after `"key": ` in one of check.py's JSON lines (its keys are unique per
/// line; the values compared are plain integers).
fn json_int(line: &str, key: &str) -> i128 {
    let pat = format!("\"{key}\": ");
    let at = line.find(&pat).unwrap_or_else(|| panic!("no {key} in {line}")) + pat.len();
    let digits: String = line[at..].chars().take_while(|c| *c == '-' || c.is_ascii_digit()).collect();
    digits.parse().unwrap_or_else(|e| panic!("{key} in {line}: {e}"))
}

fn json_str(line: &str, key: &str) -> String {
    let pat = format!("\"{key}\": \"");
    let at = line.find(&pat).unwrap_or_else(|| panic!("no {key} in {line}")) + pat.len();
    line[at..].chars().take_while(|c| *c != '"').collect()
}

fn reader_totals(r: &Reader) -> Totals {
    Totals { count: json_int(&r.line, "count") as u64, quantity: json_int(&r.line, "l_quantity"), price: json_int(&r.line, "l_extendedprice") }
}

fn check_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("interop/check.py")
}

/// Says why the check could not run: fails under `GRITDB_INTEROP_REQUIRED=1`, else prints a
/// `skipped:` line to the terminal (bypassing the harness's capture) and returns `None`.
fn unavailable(test: &str, why: &str) -> Option<Vec<Reader>> {
    let required = std::env::var("GRITDB_INTEROP_REQUIRED").is_ok_and(|v| v == "1");
    assert!(!required, "interop test {test}: {why}, and GRITDB_INTEROP_REQUIRED=1 (run `pip install pyarrow duckdb`)");
    let msg = format!(
        "\n*** interop::{test} skipped: {why} — the files were NOT checked with pyarrow/DuckDB. \
         Run `pip install pyarrow duckdb`; set GRITDB_INTEROP_REQUIRED=1 to make this a failure. ***\n"
    );
    let _ = std::io::stderr().write_all(msg.as_bytes());
    None
}

/// Runs check.py with `args`; `Some(readers)` (pyarrow and duckdb lines, plus the manifest
/// line when asked) or `None` when skipped. Any other failure of the script fails the test.
fn run_check(test: &str, args: &[&std::ffi::OsStr]) -> Option<Vec<Reader>> {
    let out = match Command::new("python3").arg(check_script()).args(args).output() {
        Ok(o) => o,
        Err(e) => return unavailable(test, &format!("python3 cannot be run ({e})")),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(2) {
        return unavailable(test, stderr.trim());
    }
    assert!(out.status.success(), "check.py failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}", out.status);
    let readers: Vec<Reader> = stdout.lines().filter(|l| l.starts_with('{')).map(|l| Reader { name: json_str(l, "reader"), line: l.to_owned() }).collect();
    for name in ["pyarrow", "duckdb"] {
        assert!(readers.iter().any(|r| r.name == name), "no {name} result from check.py:\n{stdout}\n{stderr}");
    }
    for r in &readers {
        let _ = writeln!(std::io::stderr(), "interop::{test}: {}", r.line);
    }
    Some(readers)
}

fn assert_readers_agree(readers: &[Reader], expected: Totals) {
    for r in readers.iter().filter(|r| r.name == "pyarrow" || r.name == "duckdb") {
        assert_eq!(reader_totals(r), expected, "{} disagrees with gritdb's scan: {}", r.name, r.line);
    }
}

/// (a) gritdb's own data files, after a flush whose deletes and replacements pass the
/// compaction threshold (10% of a file), hold no deletion vector: pyarrow and `DuckDB` reading
/// the files the manifest names get gritdb's count and sums. (There is no public "compact now"
/// call: compaction runs inside `flush`, which is what this relies on; check.py fails if a
/// deletion vector is left.)
#[test]
fn compacted_data_files_read_by_pyarrow_and_duckdb() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20)).unwrap();
    let batches = lineitem();
    let t = lineitem_table(&engine, &batches);
    t.flush().unwrap();
    // 20% of the rows replaced with new quantities, 15% deleted: 35% of the first file's rows
    // are dead after the next flush, so compaction rewrites it without them.
    for b in batches.iter().step_by(5) {
        t.upsert(&bump_quantity(b, 100)).unwrap();
    }
    let mut deleted = 0;
    for b in batches.iter().skip(2).step_by(7) {
        delete_batch(&t, b);
        deleted += b.num_rows();
    }
    t.flush().unwrap();
    let s = t.stats().unwrap();
    assert_eq!((s.active_delta_bytes, s.sealed_deltas), (0, 0), "everything is in files: {s:?}");
    let expected = scan_totals(&t);
    assert_eq!(expected.count, 60_175 - deleted as u64);
    assert_eq!(s.file_rows, expected.count);

    let Some(readers) = run_check("compacted_data_files_read_by_pyarrow_and_duckdb", &["--gritdb-table".as_ref(), dir.path().as_os_str(), "lineitem".as_ref()])
    else {
        return;
    };
    let manifest = readers.iter().find(|r| r.name == "manifest").expect("manifest line");
    assert_eq!(json_int(&manifest.line, "deleted_rows"), 0, "{}", manifest.line);
    assert_readers_agree(&readers, expected);
    engine.close().unwrap();
}

/// (b) After updates and deletes — some flushed (files with deletion vectors), some still in
/// the in-memory delta — the export holds exactly what the scan returns, for pyarrow, `DuckDB`
/// and the `parquet` crate; the raw data files alone would not.
#[test]
fn export_after_updates_and_deletes_read_by_pyarrow_and_duckdb() {
    let dir = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20)).unwrap();
    let batches = lineitem();
    let t = lineitem_table(&engine, &batches);
    t.flush().unwrap();
    // Flushed: 1 batch in 20 replaced and 1 in 30 deleted (under the 10% compaction threshold,
    // so the first file keeps a deletion vector).
    for b in batches.iter().step_by(20) {
        t.upsert(&bump_quantity(b, 7)).unwrap();
    }
    for b in batches.iter().skip(3).step_by(30) {
        delete_batch(&t, b);
    }
    t.flush().unwrap();
    // Still in memory: more updates (through `update`) and deletes.
    for b in batches.iter().skip(11).step_by(25) {
        assert_eq!(t.update(&bump_quantity(b, -3)).unwrap(), b.num_rows());
    }
    for b in batches.iter().skip(17).step_by(40) {
        delete_batch(&t, b);
    }
    assert!(t.stats().unwrap().active_delta_bytes > 0);
    let expected = scan_totals(&t);

    let path = out.path().join("lineitem.parquet");
    let stats = t.export_parquet(&path).unwrap();
    assert_eq!(stats.rows, expected.count);
    assert_eq!(stats.bytes, std::fs::metadata(&path).unwrap().len());
    assert_eq!(stats.path, path);
    let (read, groups) = file_totals(&path);
    assert_eq!(read, expected, "the parquet crate reads what the scan returned");
    assert_eq!(groups, stats.row_groups);
    assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 1, "no temp file left next to the export");

    let test = "export_after_updates_and_deletes_read_by_pyarrow_and_duckdb";
    let Some(readers) = run_check(test, &[path.as_os_str()]) else { return };
    assert_readers_agree(&readers, expected);
    // The raw data files (deletion vectors not applied, deltas not merged) read differently:
    // the export is what other engines must be given.
    let raw = run_check(test, &["--allow-deletion-vectors".as_ref(), "--gritdb-table".as_ref(), dir.path().as_os_str(), "lineitem".as_ref()]).unwrap();
    let manifest = raw.iter().find(|r| r.name == "manifest").unwrap();
    assert!(json_int(&manifest.line, "deleted_rows") > 0, "{}", manifest.line);
    let raw_pyarrow = raw.iter().find(|r| r.name == "pyarrow").unwrap();
    assert_ne!(reader_totals(raw_pyarrow), expected);
    engine.close().unwrap();
}

fn small_engine(dir: &Path, config: EngineConfig) -> (Engine, Table, Totals) {
    let engine = Engine::open(dir, config.memory_limit(256 << 20)).unwrap();
    let batches = lineitem();
    let t = lineitem_table(&engine, &batches[..10]);
    t.flush().unwrap();
    delete_batch(&t, &batches[1]);
    // Flushed (the first file keeps a deletion vector), so no background flush runs while a
    // test counts file-layer steps.
    t.flush().unwrap();
    let expected = scan_totals(&t);
    assert_eq!(expected.count, 9_000);
    (engine, t, expected)
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

#[test]
fn export_refuses_an_existing_target_unless_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let (engine, t, expected) = small_engine(dir.path(), EngineConfig::default());
    let path = out.path().join("t.parquet");
    std::fs::write(&path, b"keep me").unwrap();
    match t.export_parquet(&path) {
        Err(ExportError::TargetExists { path: p }) => assert_eq!(p, path),
        other => panic!("expected TargetExists, got {other:?}"),
    }
    assert_eq!(std::fs::read(&path).unwrap(), b"keep me", "the existing file is untouched");
    assert_eq!(entries(out.path()), ["t.parquet"]);
    // The error reads as what to do, and folds into gritdb::Error as AlreadyExists.
    let e = t.export_parquet(&path).unwrap_err();
    assert!(e.to_string().contains("overwrite(true)"), "{e}");
    match gritdb::Error::from(e) {
        gritdb::Error::Io { source, .. } => assert_eq!(source.kind(), std::io::ErrorKind::AlreadyExists),
        other => panic!("{other:?}"),
    }

    let stats = t.export_parquet_with(&path, &ExportOptions::default().overwrite(true)).unwrap();
    assert_eq!(stats.rows, 9_000);
    assert_eq!(file_totals(&path).0, expected);
    assert_eq!(entries(out.path()), ["t.parquet"]);
    engine.close().unwrap();
}

/// An export target in the engine's data directory or below it is refused, with or without
/// `overwrite`, however it is spelled (through `..` or a symbolic link): nothing is written
/// there and the table reads and reopens as before. Before, an export over a data file
/// replaced it (a trial of 2026-12-03: 6,996 rows scanned from a 4,998-row table, then the
/// table failed to open).
#[test]
fn export_into_the_engines_data_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let (engine, t, expected) = small_engine(dir.path(), EngineConfig::default());
    let mut files = Vec::new();
    let mut stack = vec![dir.path().to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                files.push((p.clone(), std::fs::read(&p).unwrap()));
            }
        }
    }
    let data = files.iter().map(|(p, _)| p.clone()).find(|p| p.extension().is_some_and(|x| x == "parquet")).expect("a data file");
    std::os::unix::fs::symlink(dir.path(), out.path().join("link")).unwrap();
    let table_dir = data.parent().unwrap().to_path_buf();
    let targets = [
        data.clone(),
        dir.path().join("export.parquet"),
        table_dir.join("new.parquet"),
        out.path().join("link").join(data.strip_prefix(dir.path()).unwrap()),
        table_dir.join("..").join("..").join("x.parquet"),
    ];
    for target in &targets {
        for overwrite in [false, true] {
            match t.export_parquet_with(target, &ExportOptions::default().overwrite(overwrite)) {
                Err(ExportError::InvalidPath { path, reason }) => {
                    assert_eq!(&path, target);
                    assert!(reason.contains("data directory"), "{reason}");
                }
                other => panic!("{}: expected InvalidPath, got {other:?}", target.display()),
            }
        }
    }
    for (p, bytes) in &files {
        assert_eq!(&std::fs::read(p).unwrap(), bytes, "{} unchanged", p.display());
    }
    assert!(!dir.path().join("export.parquet").exists() && !table_dir.join("new.parquet").exists());
    assert_eq!(scan_totals(&t), expected);
    // A target beside the data directory (a sibling whose name starts the same) is not inside it.
    let beside = dir.path().with_extension("exports");
    std::fs::create_dir(&beside).unwrap();
    let stats = t.export_parquet(beside.join("t.parquet")).unwrap();
    assert_eq!(stats.rows, 9_000);
    std::fs::remove_dir_all(&beside).unwrap();
    drop(t);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20)).unwrap();
    assert_eq!(scan_totals(&engine.table("lineitem").unwrap()), expected);
    engine.close().unwrap();
}

#[test]
fn export_into_a_missing_directory_or_bad_path_is_typed() {
    let dir = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let (engine, t, _) = small_engine(dir.path(), EngineConfig::default());
    let missing = out.path().join("no-such-dir");
    match t.export_parquet(missing.join("t.parquet")) {
        Err(ExportError::DirectoryNotFound { dir }) => assert_eq!(dir, missing),
        other => panic!("expected DirectoryNotFound, got {other:?}"),
    }
    // A file where the directory should be is no directory either.
    std::fs::write(out.path().join("plain-file"), b"x").unwrap();
    assert!(matches!(t.export_parquet(out.path().join("plain-file/t.parquet")), Err(ExportError::DirectoryNotFound { .. })));
    match t.export_parquet("") {
        Err(ExportError::InvalidPath { reason, .. }) => assert_eq!(reason, "empty path"),
        other => panic!("expected InvalidPath, got {other:?}"),
    }
    assert!(matches!(t.export_parquet(out.path().join("..")), Err(ExportError::InvalidPath { .. })));
    std::fs::create_dir(out.path().join("a-dir")).unwrap();
    for overwrite in [false, true] {
        let r = t.export_parquet_with(out.path().join("a-dir"), &ExportOptions::default().overwrite(overwrite));
        assert!(matches!(r, Err(ExportError::InvalidPath { reason: "a directory is in the way", .. })), "{r:?}");
    }
    assert!(!missing.exists());
    assert_eq!(entries(out.path()), ["a-dir", "plain-file"]);
    assert!(entries(&out.path().join("a-dir")).is_empty());
    engine.close().unwrap();
}

#[test]
fn export_of_a_dropped_table_or_closed_engine_is_typed() {
    let dir = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let (engine, t, _) = small_engine(dir.path(), EngineConfig::default());
    engine.drop_table("lineitem").unwrap();
    match t.export_parquet(out.path().join("t.parquet")) {
        Err(ExportError::Engine(gritdb::Error::TableNotFound { name })) => assert_eq!(name, "lineitem"),
        other => panic!("expected TableNotFound, got {other:?}"),
    }
    let t2 = engine.create_table("other", lineitem()[0].schema(), &["l_orderkey", "l_linenumber"]).unwrap();
    engine.close().unwrap();
    assert!(matches!(t2.export_parquet(out.path().join("t.parquet")), Err(ExportError::Engine(gritdb::Error::Closed(_)))));
    assert!(entries(out.path()).is_empty());
}

/// ENOSPC injected at every write-side step of an export in turn (create, each write, fsync,
/// rename, directory fsync): each failure is `ExportError::Io` with errno 28 and leaves the
/// export directory empty; with no fault the export completes with the scan's rows.
#[test]
fn export_enospc_at_every_step_leaves_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let fs = FaultFs::new();
    let (engine, t, expected) = small_engine(dir.path(), EngineConfig::default().vfs(Arc::new(fs.clone())));
    let path = out.path().join("t.parquet");
    // Small row groups: several writes, so failures land mid-file too.
    let opts = ExportOptions::default().row_group_bytes(16 << 10).batch_rows(1000);
    let mut failures = 0;
    let stats = loop {
        assert!(failures < 10_000, "export never completed");
        fs.fail_step(failures, 28);
        match t.export_parquet_with(&path, &opts) {
            Ok(s) => break s,
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(28), "step {failures}: {e:?}");
                assert!(matches!(e, ExportError::Io { .. }), "{e:?}");
                assert!(entries(out.path()).is_empty(), "step {failures} left {:?}", entries(out.path()));
                failures += 1;
            }
        }
    };
    fs.heal();
    // create + at least one write + fsync + rename + directory fsync.
    assert!(failures >= 5, "only {failures} steps");
    assert_eq!(stats.rows, 9_000);
    assert!(stats.row_groups > 1, "{stats:?}");
    assert_eq!(file_totals(&path).0, expected);
    assert_eq!(entries(out.path()), ["t.parquet"]);
    engine.close().unwrap();
}

/// The lineitem table written and flushed in an engine at a 256 MiB limit, with an empty
/// output directory beside it and the totals a scan of the table reads.
struct Flushed {
    dir: tempfile::TempDir,
    out: tempfile::TempDir,
    engine: Engine,
    t: Table,
    expected: Totals,
}

fn flushed_lineitem() -> Flushed {
    let dir = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20)).unwrap();
    let t = lineitem_table(&engine, &lineitem());
    t.flush().unwrap();
    let expected = scan_totals(&t);
    Flushed { dir, out, engine, t, expected }
}

/// The export streams: row groups are cut by the writer's buffered bytes, the writer's
/// buffers (`write_buffers`) and the scanned batches (`scan_buffers`) are counted while it
/// runs and released after, and the file holds the scan's rows.
#[test]
fn export_streams_in_row_groups_cut_by_bytes() {
    let Flushed { dir: _dir, out, engine, t, expected } = flushed_lineitem();
    let before = engine.memory().category_bytes(Category::WriteBuffers);
    let scan_before = engine.memory().category_bytes(Category::ScanBuffers);
    let cut = 256 << 10;
    let path = out.path().join("t.parquet");
    let stats = t.export_parquet_with(&path, &ExportOptions::default().row_group_bytes(cut).batch_rows(2048)).unwrap();
    assert_eq!(engine.memory().category_bytes(Category::WriteBuffers), before, "writer buffers released");
    assert_eq!(engine.memory().category_bytes(Category::ScanBuffers), scan_before, "scanned batches released");
    assert!(stats.row_groups >= 4, "{stats:?}");
    // Bounded by the cut plus what one batch of 2,048 rows adds, plus the written row groups'
    // metadata (16 column chunks each, at most 2 KiB a chunk with lineitem's statistics).
    let metadata = stats.row_groups * 16 * 2 * gritdb::WRITTEN_CHUNK_BYTES;
    assert!(stats.peak_buffer_bytes > 0 && stats.peak_buffer_bytes < cut + (2 << 20) + metadata, "{stats:?}");
    let (read, groups) = file_totals(&path);
    assert_eq!(read, expected);
    assert_eq!(groups, stats.row_groups);
    let whole = t.export_parquet(out.path().join("whole.parquet")).unwrap();
    assert_eq!(whole.row_groups, 1, "60k lineitem rows fit one default row group: {whole:?}");
    assert_eq!(file_totals(&out.path().join("whole.parquet")).0, expected);
    engine.close().unwrap();
}

/// Every column chunk's codec in the Parquet file at `path`, deduplicated.
fn codecs(path: &Path) -> Vec<gritdb::parquet::basic::Compression> {
    let reader = gritdb::parquet::file::reader::SerializedFileReader::new(std::fs::File::open(path).unwrap()).unwrap();
    let meta = gritdb::parquet::file::reader::FileReader::metadata(&reader);
    let mut out: Vec<_> =
        meta.row_groups().iter().flat_map(|g| g.columns().iter().map(gritdb::parquet::file::metadata::ColumnChunkMetaData::compression)).collect();
    out.dedup();
    out
}

/// Data files are written with `DATA_FILE_COMPRESSION` (`LZ4_RAW`, for the scan's decode
/// speed) and exports with `EXPORT_COMPRESSION` (Snappy, for readers older than `LZ4_RAW`);
/// the rows read back are the same either way.
#[test]
fn data_files_are_lz4_raw_and_exports_snappy() {
    use gritdb::parquet::basic::Compression;
    assert_eq!((gritdb::DATA_FILE_COMPRESSION, gritdb::EXPORT_COMPRESSION), (Compression::LZ4_RAW, Compression::SNAPPY));
    let Flushed { dir, out, engine, t, expected } = flushed_lineitem();
    assert_eq!(expected.count, 60_175);
    let files: Vec<PathBuf> = walk(dir.path()).into_iter().filter(|p| p.extension().is_some_and(|e| e == "parquet")).collect();
    assert!(!files.is_empty(), "a flush writes a data file");
    let mut in_files = Totals { count: 0, quantity: 0, price: 0 };
    for f in &files {
        assert_eq!(codecs(f), [Compression::LZ4_RAW], "{}", f.display());
        let (part, _) = file_totals(f);
        (in_files.count, in_files.quantity, in_files.price) = (in_files.count + part.count, in_files.quantity + part.quantity, in_files.price + part.price);
    }
    assert_eq!(in_files, expected, "the data files hold the table (no deletes)");
    let path = out.path().join("t.parquet");
    t.export_parquet(&path).unwrap();
    assert_eq!(codecs(&path), [Compression::SNAPPY]);
    assert_eq!(file_totals(&path).0, expected);
    engine.close().unwrap();
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() { out.extend(walk(&p)) } else { out.push(p) }
    }
    out
}

/// A table of two `Int64` columns (`k` the key, `v = k * 3`) holding keys `0..rows`, flushed.
fn two_column_table(engine: &Engine, rows: i64) -> Table {
    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};
    let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("v", DataType::Int64, false)]));
    let t = engine.create_table("pairs", Arc::clone(&schema), &["k"]).unwrap();
    let batch =
        RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from_iter_values(0..rows)), Arc::new(Int64Array::from_iter_values((0..rows).map(|k| k * 3)))])
            .unwrap();
    t.insert(&batch).unwrap();
    t.flush().unwrap();
    t
}

/// Row count, sum of `v` and row groups of an exported two-column file.
fn pairs_in_file(path: &Path) -> (usize, i64, usize) {
    use arrow::array::AsArray;
    let builder = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(path).unwrap()).unwrap();
    let groups = builder.metadata().num_row_groups();
    let (mut rows, mut sum) = (0, 0);
    for b in builder.build().unwrap() {
        let b = b.unwrap();
        rows += b.num_rows();
        sum += b.column(1).as_primitive::<arrow::datatypes::Int64Type>().values().iter().sum::<i64>();
    }
    (rows, sum, groups)
}

/// Row groups much smaller than the scan's batches. `ArrowWriter::write` calls itself once for
/// every row group a batch crosses, so one batch of 20,000 rows into one-row row groups
/// overflowed the stack and aborted the process; the export now feeds the writer a row
/// group at a time (on a 1 MiB stack here, which 20,000 such frames would overflow). The
/// row groups it has written stay in the writer until the file is closed, and are counted
/// under `write_buffers`: the peak holds them, and they are released with the writer.
#[test]
fn export_of_row_groups_far_smaller_than_a_batch_is_exact_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20)).unwrap();
    let rows = 20_000i64;
    let t = two_column_table(&engine, rows);
    let before = engine.memory().category_bytes(Category::WriteBuffers);
    let path = out.path().join("ones.parquet");
    let options = ExportOptions::default().row_group_rows(1).batch_rows(20_000);
    let stats = std::thread::scope(|s| {
        std::thread::Builder::new().stack_size(1 << 20).spawn_scoped(s, || t.export_parquet_with(&path, &options)).unwrap().join().unwrap()
    })
    .unwrap();
    assert_eq!((stats.rows, stats.row_groups), (20_000, 20_000));
    assert_eq!(pairs_in_file(&path), (20_000, 3 * (rows * (rows - 1) / 2), 20_000));
    // Two column chunks a row group, each counted at least `WRITTEN_CHUNK_BYTES`.
    assert!(stats.peak_buffer_bytes >= 20_000 * 2 * gritdb::WRITTEN_CHUNK_BYTES, "{stats:?}");
    assert!(stats.peak_buffer_bytes <= engine.memory().category_peak(Category::WriteBuffers), "{stats:?}");
    assert_eq!(engine.memory().category_bytes(Category::WriteBuffers), before, "writer buffers released");
    // Row groups of 7 rows from batches of 1,000: every cut lands inside a batch.
    let path = out.path().join("sevens.parquet");
    let stats = t.export_parquet_with(&path, &ExportOptions::default().row_group_rows(7).batch_rows(1_000)).unwrap();
    assert_eq!(stats.row_groups, 20_000usize.div_ceil(7));
    assert_eq!(pairs_in_file(&path), (20_000, 3 * (rows * (rows - 1) / 2), 20_000usize.div_ceil(7)));
    engine.close().unwrap();
}

/// The written row groups' metadata counts against the limit: 20,000 one-row row groups need
/// about 40 MB, more than an 8 MiB engine has, so the export fails with a typed
/// `MemoryLimit` in `write_buffers` (it grew outside the limit before, 57 MB of RSS at a 4 MiB
/// limit), leaves no file, and gives its memory back; with larger row groups it succeeds.
#[test]
fn an_export_of_more_row_groups_than_the_limit_holds_fails_typed() {
    let dir = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(8 << 20)).unwrap();
    let rows = 20_000i64;
    let t = two_column_table(&engine, rows);
    let path = out.path().join("ones.parquet");
    let err = t.export_parquet_with(&path, &ExportOptions::default().row_group_rows(1)).unwrap_err();
    match &err {
        ExportError::Engine(gritdb::Error::MemoryLimit { category, .. }) => assert_eq!(*category, Category::WriteBuffers, "{err}"),
        other => panic!("expected MemoryLimit in write_buffers, got {other:?}"),
    }
    assert!(entries(out.path()).is_empty(), "no file of the failed export: {:?}", entries(out.path()));
    // The export's memory is given back: the writer's buffers and its scan's batches.
    assert_eq!(engine.memory().category_bytes(Category::WriteBuffers), 0);
    assert_eq!(engine.memory().category_bytes(Category::ScanBuffers), 0);
    let stats = t.export_parquet_with(&path, &ExportOptions::default().row_group_rows(1_000)).unwrap();
    assert_eq!(stats.row_groups, 20);
    assert_eq!(pairs_in_file(&path), (20_000, 3 * (rows * (rows - 1) / 2), 20));
    engine.close().unwrap();
}

/// The byte cut holds for whole default batches: the writer is fed steps of at most a quarter
/// of `row_group_bytes`, so a 1 MiB cut over 8,192-row lineitem batches (about 2.5 MB of Arrow
/// each) peaks near the cut plus one step, and at most the dictionary tables of lineitem's 16
/// columns (`DICTIONARY_TABLE_BYTES` each: the cut is at least twice them), where it reached 8.2 MB when a whole batch was one
/// step; and the reported peak is never above `write_buffers`' high-water mark.
#[test]
fn export_steps_keep_the_writer_near_its_byte_cut() {
    let Flushed { dir: _dir, out, engine, t, expected } = flushed_lineitem();
    let path = out.path().join("t.parquet");
    let cut = 1 << 20;
    let stats = t.export_parquet_with(&path, &ExportOptions::default().row_group_bytes(cut)).unwrap();
    assert!(stats.peak_buffer_bytes < 2 * cut + 16 * gritdb::DICTIONARY_TABLE_BYTES, "{stats:?}");
    assert!(stats.peak_buffer_bytes <= engine.memory().category_peak(Category::WriteBuffers), "{stats:?}");
    assert!(stats.row_groups >= 4, "{stats:?}");
    assert_eq!(file_totals(&path), (expected, stats.row_groups));
    engine.close().unwrap();
}

/// A table of 64 columns holding keys `0..rows`, flushed: `k` the key, 39 `Int64` columns
/// `k * c` (c = 1..=39) and 24 `Utf8` columns `"v{k}"`.
fn wide_table(engine: &Engine, rows: i64) -> Table {
    use arrow::array::{ArrayRef, Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    let mut fields: Vec<Field> = (0..40).map(|c| Field::new(if c == 0 { "k".to_string() } else { format!("c{c}") }, DataType::Int64, false)).collect();
    fields.extend((40..64).map(|c| Field::new(format!("s{c}"), DataType::Utf8, false)));
    let schema = Arc::new(Schema::new(fields));
    let t = engine.create_table("wide", Arc::clone(&schema), &["k"]).unwrap();
    for from in (0..rows).step_by(500) {
        let keys = from..(from + 500).min(rows);
        let mut cols: Vec<ArrayRef> = (0..40i64).map(|c| Arc::new(Int64Array::from_iter_values(keys.clone().map(|k| k * c.max(1)))) as ArrayRef).collect();
        cols.extend((40..64).map(|_| Arc::new(StringArray::from_iter_values(keys.clone().map(|k| format!("v{k}")))) as ArrayRef));
        t.insert(&RecordBatch::try_new(Arc::clone(&schema), cols).unwrap()).unwrap();
    }
    t.flush().unwrap();
    t
}

/// Rows, the sum of every `Int64` value, the total length of every string, and row groups
/// of an exported file.
fn wide_file_totals(path: &Path) -> (usize, i128, usize, usize) {
    use arrow::array::AsArray;
    use arrow::datatypes::DataType;
    let builder = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(path).unwrap()).unwrap();
    let groups = builder.metadata().num_row_groups();
    let (mut rows, mut sum, mut text) = (0, 0i128, 0);
    for b in builder.build().unwrap() {
        let b = b.unwrap();
        rows += b.num_rows();
        for c in b.columns() {
            match c.data_type() {
                DataType::Int64 => sum += c.as_primitive::<arrow::datatypes::Int64Type>().values().iter().map(|v| i128::from(*v)).sum::<i128>(),
                _ => text += c.as_string::<i32>().iter().map(|v| v.map_or(0, str::len)).sum::<usize>(),
            }
        }
    }
    (rows, sum, text, groups)
}

/// Small scan batches do not make small row groups. A 64-column table at 16 MiB: the
/// writer's 40 dictionary tables (3 MB, `DICTIONARY_TABLE_BYTES` each) filled the export's
/// byte cut from the first row, so every scanned batch closed a row group; each kept ~64 KiB
/// of metadata, and `batch_rows(16)` and smaller failed with `MemoryLimit` in
/// `write_buffers` (fresh-clone trial). Now the tables are left out when they take more than
/// a quarter of the room, and the cut is at least twice them: every batch
/// size writes the same few row groups, exactly, within the limit.
#[test]
fn small_export_batches_of_a_wide_table_make_few_row_groups() {
    let dir = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let limit = 16 << 20;
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(limit)).unwrap();
    let rows = 3_000i64;
    let t = wide_table(&engine, rows);
    // The key plus 39 columns of k * c (c = 1..=39): the sum of k times 1 + 39 * 40 / 2;
    // "v{k}" is 1 + the digits of k long, in 24 columns.
    let want_sum = i128::from(rows * (rows - 1) / 2) * (1 + 39 * 40 / 2);
    let want_text = 24 * (0..rows).map(|k| 1 + k.to_string().len()).sum::<usize>();
    for batch_rows in [8_192, 64, 16, 1] {
        let path = out.path().join(format!("w{batch_rows}.parquet"));
        let stats = t.export_parquet_with(&path, &ExportOptions::default().batch_rows(batch_rows)).unwrap_or_else(|e| panic!("batch_rows {batch_rows}: {e}"));
        assert_eq!((stats.rows, stats.row_groups <= 4), (3_000, true), "batch_rows {batch_rows}: {stats:?}");
        assert_eq!(wide_file_totals(&path), (3_000, want_sum, want_text, stats.row_groups), "batch_rows {batch_rows}");
        assert!(stats.peak_buffer_bytes < limit / 2, "batch_rows {batch_rows}: {stats:?}");
    }
    assert_eq!(engine.memory().category_bytes(Category::WriteBuffers), 0);
    assert!(engine.memory().peak() <= limit);
    engine.close().unwrap();
}
