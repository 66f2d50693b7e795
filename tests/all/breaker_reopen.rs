//! Adversarial checks of replay under a smaller limit than the log was written with (the
//! inline flushes of `Engine::open`, budgeted writer buffers, early row-group cuts): many
//! tables with interleaved records, wide rows, records larger than the soft limit, faults in
//! the replay's inline flush, alternating limits, a lowered run-time limit before a crash,
//! export under a tight limit, and accounting after drops. Every answer is compared exactly
//! with a `BTreeMap` model (key -> version; every cell is a function of key, version and
//! column).

use arrow::array::{Array, ArrayRef, AsArray, BinaryArray, Int64Array, LargeStringArray, RecordBatch, StringArray, StringViewArray};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef};
use gritdb::memory::Category;
use gritdb::vfs::FaultFs;
use gritdb::{Engine, EngineConfig, Error, ExportOptions, ScanOptions, Table};
use gritdb_tests::mix;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;

// ---------------------------------------------------------------- the model

/// A table shape: `k` Int64 key, `v` Int64 (the row's version), then `cols` text columns
/// cycling `Utf8`, `Utf8View`, `LargeUtf8`, `Binary`, each cell `min..=max` bytes (or null).
#[derive(Clone, Copy, Debug)]
struct Spec {
    cols: usize,
    min: usize,
    max: usize,
}

impl Spec {
    fn schema(&self) -> SchemaRef {
        let mut fields = vec![Field::new("k", DataType::Int64, false), Field::new("v", DataType::Int64, true)];
        for c in 0..self.cols {
            let ty = match c % 4 {
                0 => DataType::Utf8,
                1 => DataType::Utf8View,
                2 => DataType::LargeUtf8,
                _ => DataType::Binary,
            };
            fields.push(Field::new(format!("c{c}"), ty, true));
        }
        Arc::new(Schema::new(fields))
    }

    fn key_schema() -> SchemaRef {
        Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)]))
    }

    /// The cell of column `c` for key `k` at version `ver`.
    fn cell(&self, k: i64, ver: u64, c: usize) -> Option<String> {
        let h = mix((k as u64).wrapping_mul(1_000_003) ^ ver.wrapping_mul(7919) ^ (c as u64) << 48);
        if h.is_multiple_of(13) {
            return None;
        }
        let len = self.min + (h >> 8) as usize % (self.max - self.min + 1);
        let mut s = format!("{k}/{ver}/{c}/");
        let fill = char::from(b'a' + (h % 26) as u8);
        while s.len() < len {
            s.push(fill);
        }
        Some(s)
    }

    fn batch(&self, rows: &[(i64, u64)]) -> RecordBatch {
        let mut cols: Vec<ArrayRef> =
            vec![Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.0))), Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.1 as i64)))];
        for c in 0..self.cols {
            let vals: Vec<Option<String>> = rows.iter().map(|&(k, v)| self.cell(k, v, c)).collect();
            cols.push(match c % 4 {
                0 => Arc::new(StringArray::from(vals)),
                1 => Arc::new(vals.iter().map(Option::as_deref).collect::<StringViewArray>()),
                2 => Arc::new(LargeStringArray::from(vals)),
                _ => Arc::new(vals.iter().map(|v| v.as_deref().map(str::as_bytes)).collect::<BinaryArray>()),
            });
        }
        RecordBatch::try_new(self.schema(), cols).unwrap()
    }

    fn keys(keys: &[i64]) -> RecordBatch {
        RecordBatch::try_new(Self::key_schema(), vec![Arc::new(Int64Array::from(keys.to_vec()))]).unwrap()
    }

    /// Average encoded bytes of a row (for sizing records).
    fn row_bytes(&self) -> usize {
        16 + self.cols * (self.min + self.max) / 2
    }
}

/// The bytes of row `i` of a text column of any of the types a table or a file may hold.
fn bytes_at(col: &ArrayRef, i: usize) -> Option<&[u8]> {
    if col.is_null(i) {
        return None;
    }
    Some(match col.data_type() {
        DataType::Utf8 => col.as_string::<i32>().value(i).as_bytes(),
        DataType::LargeUtf8 => col.as_string::<i64>().value(i).as_bytes(),
        DataType::Utf8View => col.as_string_view().value(i).as_bytes(),
        DataType::Binary => col.as_binary::<i32>().value(i),
        DataType::LargeBinary => col.as_binary::<i64>().value(i),
        DataType::BinaryView => col.as_binary_view().value(i),
        other => panic!("unexpected column type {other}"),
    })
}

/// One table's exact expected content: key -> version.
struct Model {
    spec: Spec,
    rows: BTreeMap<i64, u64>,
    next_ver: u64,
    /// Keys from here on were never written.
    next_key: i64,
}

impl Model {
    fn new(spec: Spec) -> Self {
        Self { spec, rows: BTreeMap::new(), next_ver: 1, next_key: 0 }
    }

    fn bump(&mut self) -> u64 {
        self.next_ver += 1;
        self.next_ver
    }

    fn note_keys(&mut self, rows: &[(i64, u64)]) {
        self.next_key = self.next_key.max(rows.iter().map(|r| r.0 + 1).max().unwrap_or(0));
    }

    /// Inserts keys that must be new.
    fn insert(&mut self, t: &Table, keys: impl IntoIterator<Item = i64>) {
        let ver = self.bump();
        let rows: Vec<(i64, u64)> = keys.into_iter().map(|k| (k, ver)).collect();
        assert!(rows.iter().all(|r| !self.rows.contains_key(&r.0)), "model: insert of an existing key");
        assert_eq!(t.insert(&self.spec.batch(&rows)).unwrap(), rows.len(), "insert into {}", t.name());
        self.note_keys(&rows);
        self.rows.extend(rows);
    }

    fn upsert(&mut self, t: &Table, keys: impl IntoIterator<Item = i64>) {
        let ver = self.bump();
        let rows: Vec<(i64, u64)> = keys.into_iter().map(|k| (k, ver)).collect();
        assert_eq!(t.upsert(&self.spec.batch(&rows)).unwrap(), rows.len(), "upsert into {}", t.name());
        self.note_keys(&rows);
        self.rows.extend(rows);
    }

    /// Updates keys that must exist.
    fn update(&mut self, t: &Table, keys: impl IntoIterator<Item = i64>) {
        let ver = self.bump();
        let rows: Vec<(i64, u64)> = keys.into_iter().filter(|k| self.rows.contains_key(k)).map(|k| (k, ver)).collect();
        if rows.is_empty() {
            return;
        }
        assert_eq!(t.update(&self.spec.batch(&rows)).unwrap(), rows.len(), "update of {}", t.name());
        self.rows.extend(rows);
    }

    /// Deletes keys, some of which may not exist.
    fn delete(&mut self, t: &Table, keys: &[i64]) {
        let mut uniq = keys.to_vec();
        uniq.sort_unstable();
        uniq.dedup();
        let present = uniq.iter().filter(|k| self.rows.contains_key(k)).count();
        assert_eq!(t.delete(&Spec::keys(keys)).unwrap(), present, "delete from {}", t.name());
        for k in uniq {
            self.rows.remove(&k);
        }
    }

    /// Compares a batch stream exactly with the model.
    fn check_batches(&self, batches: impl IntoIterator<Item = RecordBatch>, what: &str) {
        let mut seen = 0usize;
        let mut keys = std::collections::BTreeSet::new();
        for b in batches {
            let ks = b.column(0).as_primitive::<Int64Type>();
            let vs = b.column(1).as_primitive::<Int64Type>();
            for i in 0..b.num_rows() {
                let k = ks.value(i);
                assert!(keys.insert(k), "{what}: key {k} returned twice");
                let Some(&ver) = self.rows.get(&k) else { panic!("{what}: key {k} is not in the model (deleted or never written)") };
                assert_eq!(vs.value(i), ver as i64, "{what}: key {k} has the wrong version");
                for c in 0..self.spec.cols {
                    let want = self.spec.cell(k, ver, c);
                    let got = bytes_at(b.column(2 + c), i);
                    assert!(got == want.as_deref().map(str::as_bytes), "{what}: key {k} version {ver} column c{c} differs");
                }
                seen += 1;
            }
        }
        assert_eq!(seen, self.rows.len(), "{what}: rows returned vs model");
    }

    fn check(&self, t: &Table, what: &str) {
        self.check_with(t, ScanOptions::default(), what);
    }

    fn check_with(&self, t: &Table, options: ScanOptions, what: &str) {
        let batches = t.scan(options).unwrap_or_else(|e| panic!("{what}: scan: {e}")).map(|b| b.unwrap_or_else(|e| panic!("{what}: scan batch: {e}")));
        self.check_batches(batches, what);
    }
}

// ---------------------------------------------------------------- engines

/// The large limit the logs are written under: 256 MiB, 64 MiB deltas, no age flushes.
fn big() -> EngineConfig {
    EngineConfig::default().memory_limit(256 * MIB).table_flush_bytes(64 * MIB).flush_age(Duration::from_hours(1))
}

/// A small limit, no age flushes, and a short backpressure wait (a refusal shows at once).
fn small(limit: usize) -> EngineConfig {
    EngineConfig::default().memory_limit(limit).flush_age(Duration::from_hours(1)).backpressure_timeout(Duration::from_secs(5))
}

fn open(dir: &Path, config: EngineConfig) -> Engine {
    let limit = config.memory_limit;
    let engine = Engine::open(dir, config).unwrap_or_else(|e| panic!("open at {limit:?}: {e}"));
    within(&engine, "after open");
    engine
}

fn within(engine: &Engine, what: &str) {
    let (used, limit) = (engine.memory().used(), engine.memory().limit());
    assert!(used <= limit, "{what}: {used} bytes used above the {limit} limit");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else if e.file_name() != "LOCK" {
            std::fs::copy(e.path(), &target).unwrap();
        }
    }
}

fn names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("t{i}")).collect()
}

// ---------------------------------------------------------------- many tables, mixed ops

/// One round of mixed writes on one table: `per` new keys, upserts over old (live or
/// deleted) keys and new ones, updates of live keys, and deletes of present and absent keys.
/// `round` varies which keys are picked.
fn mixed_round(m: &mut Model, t: &Table, round: i64, per: i64) {
    let base = m.next_key;
    m.insert(t, base..base + per);
    let span = base + per;
    let pick = |i: i64, salt: i64| (mix((i * 31 + round * 1_009 + salt) as u64) % span as u64) as i64;
    let mut ups: std::collections::BTreeSet<i64> = (0..per / 3).map(|i| pick(i, 1)).collect();
    ups.extend(span..span + per / 10);
    m.upsert(t, ups);
    m.update(t, (0..per / 6).map(|i| pick(i, 2)).collect::<std::collections::BTreeSet<_>>());
    let dels: Vec<i64> = (0..per / 8).map(|i| pick(i, 3)).chain([span + per, span + per + 7]).collect();
    m.delete(t, &dels);
}

/// Six tables whose records interleave (inserts, upserts, updates, deletes), written at
/// 256 MiB and reopened at 4, 6 and 8 MiB in turn (each time written to and dropped without
/// close), then closed and reopened at 4 MiB: every table exact each time.
#[test]
fn six_tables_mixed_ops_reopened_at_4_6_8_mib() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec { cols: 8, min: 16, max: 300 };
    let tables = names(6);
    let mut models: Vec<Model> = tables.iter().map(|_| Model::new(spec)).collect();
    {
        let engine = open(dir.path(), big());
        let ts: Vec<Table> = tables.iter().map(|n| engine.create_table(n, spec.schema(), &["k"]).unwrap()).collect();
        for round in 0..5 {
            for (m, t) in models.iter_mut().zip(&ts) {
                mixed_round(m, t, round, 500);
            }
        }
        drop(ts);
        drop(engine);
    }
    for (round, limit) in (5..).zip([4 * MIB, 6 * MIB, 8 * MIB]) {
        let engine = open(dir.path(), small(limit));
        for (m, n) in models.iter_mut().zip(&tables) {
            let t = engine.table(n).unwrap();
            m.check(&t, &format!("{n} at {limit} after replay"));
            mixed_round(m, &t, round, 120);
            within(&engine, "after writes");
        }
        engine.table("t0").unwrap().flush().unwrap();
        within(&engine, "after a flush");
        drop(engine);
    }
    let engine = open(dir.path(), small(8 * MIB));
    for (m, n) in models.iter().zip(&tables) {
        m.check(&engine.table(n).unwrap(), &format!("{n} before close"));
    }
    engine.close().unwrap();
    let engine = open(dir.path(), small(4 * MIB));
    for (m, n) in models.iter().zip(&tables) {
        m.check(&engine.table(n).unwrap(), &format!("{n} after close and reopen at 4 MiB"));
    }
}

// ---------------------------------------------------------------- records vs the soft limit

/// One table holding a single put record of about `record_mib` MiB written at 256 MiB, then
/// a small upsert and delete after it, reopened at `limit`: exact, writable, flushable.
fn one_big_record(record_mib: usize, limit: usize) {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec { cols: 4, min: 1_000, max: 3_000 };
    let mut m = Model::new(spec);
    {
        let engine = open(dir.path(), big());
        let t = engine.create_table("big", spec.schema(), &["k"]).unwrap();
        let rows = (record_mib * MIB / spec.row_bytes()) as i64;
        m.insert(&t, 0..rows);
        m.upsert(&t, 0..10);
        m.delete(&t, &[11, 12, rows + 5]);
    }
    let engine = open(dir.path(), small(limit));
    let t = engine.table("big").unwrap();
    m.check(&t, "after replay");
    m.upsert(&t, 20..40);
    t.flush().unwrap();
    within(&engine, "after a flush");
    m.check(&t, "after a flush");
    drop(t);
    engine.close().unwrap();
    let engine = open(dir.path(), small(limit));
    m.check(&engine.table("big").unwrap(), "after close and reopen");
}

#[test]
fn one_record_of_2_mib_reopened_at_8_mib() {
    one_big_record(2, 8 * MIB);
}

#[test]
fn one_record_of_3_mib_reopened_at_8_mib() {
    one_big_record(3, 8 * MIB);
}

#[test]
fn one_record_of_5_mib_reopened_at_8_mib() {
    one_big_record(5, 8 * MIB);
}

/// Bigger than the 6 MiB soft limit itself (still under the hard limit).
#[test]
fn one_record_of_7_mib_reopened_at_8_mib() {
    one_big_record(7, 8 * MIB);
}

/// Bigger than the hard limit: replay would have to apply the record in parts.
#[test]
fn one_record_of_12_mib_reopened_at_8_mib() {
    one_big_record(12, 8 * MIB);
}

/// A record of 2 MiB at 4 MiB (half the limit, above the 3 MiB soft limit's room once
/// anything else is held).
#[test]
fn one_record_of_2_mib_reopened_at_4_mib() {
    one_big_record(2, 4 * MIB);
}

// ---------------------------------------------------------------- wide rows

/// 32 text columns of 4..64 KiB (rows of about 1.1 MB), `per_record` rows per log record,
/// written at 256 MiB and reopened at 8 MiB: exact, writable and flushable.
fn wide_rows(per_record: i64, limit: usize) {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec { cols: 32, min: 4 << 10, max: 64 << 10 };
    let mut m = Model::new(spec);
    let n = 24;
    {
        let engine = open(dir.path(), big());
        let t = engine.create_table("wide", spec.schema(), &["k"]).unwrap();
        for at in (0..n).step_by(per_record as usize) {
            m.insert(&t, at..(at + per_record).min(n));
        }
        m.upsert(&t, [1, 3]);
        m.delete(&t, &[2, 5]);
    }
    let engine = open(dir.path(), small(limit));
    let t = engine.table("wide").unwrap();
    m.check(&t, "after replay");
    m.upsert(&t, [0]);
    t.flush().unwrap();
    within(&engine, "after a flush");
    m.check(&t, "after a flush");
    drop(t);
    engine.close().unwrap();
    let engine = open(dir.path(), small(limit));
    m.check(&engine.table("wide").unwrap(), "after close and reopen");
}

#[test]
fn wide_rows_one_per_record_reopened_at_8_mib() {
    wide_rows(1, 8 * MIB);
}

#[test]
fn wide_rows_three_per_record_reopened_at_8_mib() {
    wide_rows(3, 8 * MIB);
}

#[test]
fn wide_rows_one_per_record_reopened_at_6_mib() {
    wide_rows(1, 6 * MIB);
}

/// Rows just under `max_row_bytes` (2 MiB): 32 columns of 56..62 KiB, one per record,
/// reopened at 8 MiB.
#[test]
fn rows_near_max_row_bytes_reopened_at_8_mib() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec { cols: 32, min: 56 << 10, max: 62 << 10 };
    let mut m = Model::new(spec);
    let cfg = |c: EngineConfig| c.max_row_bytes(2 * MIB);
    {
        let engine = open(dir.path(), cfg(big()));
        let t = engine.create_table("w", spec.schema(), &["k"]).unwrap();
        for k in 0..12 {
            m.insert(&t, [k]);
        }
        m.upsert(&t, [4]);
        m.delete(&t, &[7]);
    }
    let engine = open(dir.path(), cfg(small(8 * MIB)));
    let t = engine.table("w").unwrap();
    m.check(&t, "after replay");
    m.upsert(&t, [5]);
    t.flush().unwrap();
    within(&engine, "after a flush");
    m.check(&t, "after a flush");
}

// ---------------------------------------------------------------- many small records

/// `records` records of about 150 KB each (`cols` text columns), written at 256 MiB and
/// replayed at 8 MiB. Returns the manifest commits the replay made and checks the data.
fn replay_commits(cols: usize, records: i64) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    // About 1,500 bytes a row whatever the column count.
    let avg = 1_500 / cols;
    let spec = Spec { cols, min: avg / 2, max: avg * 3 / 2 };
    let mut m = Model::new(spec);
    let version_before;
    {
        let engine = open(dir.path(), big());
        let t = engine.create_table("w", spec.schema(), &["k"]).unwrap();
        for r in 0..records {
            m.insert(&t, r * 100..(r + 1) * 100);
        }
        version_before = t.stats().unwrap().manifest_version;
    }
    let start = Instant::now();
    let engine = open(dir.path(), small(8 * MIB));
    let took = start.elapsed();
    let t = engine.table("w").unwrap();
    let commits = t.stats().unwrap().manifest_version - version_before;
    m.check(&t, "after replay");
    eprintln!("{cols} columns, {records} records of 100 rows at 8 MiB: {commits} manifest commits, {took:?}, {} files", t.stats().unwrap().files);
    commits
}

/// The log is about 15 MB: with a 1 MiB flush threshold and a 6 MiB soft limit, replay at
/// 8 MiB needs a few dozen commits at most, however many columns the rows are cut into.
#[test]
fn replay_of_a_narrow_table_flushes_by_bytes() {
    let commits = replay_commits(3, 100);
    assert!(commits <= 40, "replay made {commits} commits for 100 records of 150 KB");
}

/// The same bytes in 30 columns: replay must not flush before every record (the record's
/// size estimate must not grow with its column count).
#[test]
fn replay_of_a_wide_table_does_not_flush_per_record() {
    let commits = replay_commits(30, 100);
    assert!(commits <= 40, "replay made {commits} commits for 100 records of 150 KB (a flush per record)");
}

// ---------------------------------------------------------------- faults in the inline flush

fn fault_source(dir: &Path) -> Vec<Model> {
    let spec = Spec { cols: 6, min: 40, max: 400 };
    let mut models: Vec<Model> = (0..3).map(|_| Model::new(spec)).collect();
    let engine = open(dir, big());
    let ts: Vec<Table> = names(3).iter().map(|n| engine.create_table(n, spec.schema(), &["k"]).unwrap()).collect();
    for round in 0..4 {
        for (m, t) in models.iter_mut().zip(&ts) {
            mixed_round(m, t, round, 400);
        }
    }
    models
}

fn check_all(engine: &Engine, models: &[Model], what: &str) {
    for (m, n) in models.iter().zip(names(models.len())) {
        check_at(engine, m, &engine.table(&n).unwrap(), ScanOptions::default(), &format!("{n}: {what}"));
    }
}

/// `m.check_with(t, options)` at the engine's limit; or, when the scan is refused for memory,
/// the refusal checked and the data checked at a raised limit. Files written under a large
/// limit have row groups whose reader holds a page and a dictionary per column, about 1–2 MiB
/// each, which a small limit may not have room for. Before the reader's buffers were counted
/// such scans "passed" at 4 MiB while holding 18–23 MB outside the engine's figures (measured
/// with jemalloc's `allocated` in `files_scanned_small`). Now the scan returns a typed
/// `MemoryLimit` in `scan_buffers`; its `requested` is more than the limit leaves, and a limit
/// raised by that much scans exactly (the limit is restored after). Returns whether it was
/// refused.
fn check_at(engine: &Engine, m: &Model, t: &Table, options: ScanOptions, what: &str) -> bool {
    let refused = match t.scan(options.clone()).map(|s| s.map(|b| b.map(|b| b.num_rows())).find_map(Result::err)) {
        Ok(None) => None,
        Ok(Some(e)) | Err(e) => Some(e),
    };
    let Some(e) = refused else {
        m.check_with(t, options, what);
        return false;
    };
    let Error::MemoryLimit { requested, used, limit, category, .. } = e else { panic!("{what}: scan: {e}") };
    assert_eq!(category, Category::ScanBuffers, "{what}");
    assert!(used + requested > limit, "{what}: {requested} B refused with {used} B of {limit} B in use");
    eprintln!("{what}: the scan needs {requested} B of scan buffers beside {used} B at a {limit} B limit; checked at a raised limit");
    engine.set_memory_limit(limit + requested + (4 << 20)).unwrap();
    m.check_with(t, options, &format!("{what} (limit raised)"));
    engine.set_memory_limit(limit).unwrap();
    true
}

/// A log written at 256 MiB, reopened at 4 MiB through a file layer that fails the n-th
/// write-side step (every step of the replay's inline flushes is tried, sampled), then
/// reopened normally: nothing lost, nothing resurrected.
#[test]
fn a_fault_in_any_step_of_the_replay_flush_loses_nothing() {
    let src = tempfile::tempdir().unwrap();
    let models = fault_source(src.path());
    // How many write-side steps a clean replay at 4 MiB takes.
    let steps = {
        let work = tempfile::tempdir().unwrap();
        copy_dir(src.path(), work.path());
        let fs = FaultFs::new();
        let engine = open(work.path(), small(4 * MIB).vfs(Arc::new(fs.clone())));
        check_all(&engine, &models, "clean replay through FaultFs");
        fs.steps()
    };
    assert!(steps > 0, "replay at 4 MiB must flush inline");
    let stride = (steps / 24).max(1);
    let mut failed_opens = 0;
    for n in (0..steps).step_by(stride as usize) {
        let work = tempfile::tempdir().unwrap();
        copy_dir(src.path(), work.path());
        let fs = FaultFs::new();
        fs.fail_step(n, 5);
        match Engine::open(work.path(), small(4 * MIB).vfs(Arc::new(fs.clone()))) {
            Ok(engine) => check_all(&engine, &models, &format!("open that survived a fault at step {n}")),
            Err(e) => {
                eprintln!("fault at step {n} of {steps}: open failed: {e}");
                failed_opens += 1;
            }
        }
        let engine = open(work.path(), small(4 * MIB));
        check_all(&engine, &models, &format!("after a fault at step {n} of {steps}"));
        // And writable and flushable after it.
        engine.flush_all().unwrap();
        check_all(&engine, &models, &format!("flushed after a fault at step {n}"));
    }
    assert!(failed_opens > 0, "no fault made the open fail");
}

/// Two faulty opens in a row (different steps), then ENOSPC on everything, then a clean open.
#[test]
fn repeated_faulty_replays_then_a_clean_one() {
    let src = tempfile::tempdir().unwrap();
    let models = fault_source(src.path());
    for (a, b) in [(3, 7), (10, 2), (25, 40)] {
        let work = tempfile::tempdir().unwrap();
        copy_dir(src.path(), work.path());
        for n in [a, b] {
            let fs = FaultFs::new();
            fs.fail_step(n, 28);
            if let Ok(engine) = Engine::open(work.path(), small(4 * MIB).vfs(Arc::new(fs.clone()))) {
                check_all(&engine, &models, "a faulty open that succeeded");
            }
        }
        let fs = FaultFs::new();
        fs.fail_all(28);
        let res = Engine::open(work.path(), small(4 * MIB).vfs(Arc::new(fs.clone())));
        assert!(res.is_err(), "replay at 4 MiB with every write failing must fail to open");
        drop(res);
        let engine = open(work.path(), small(6 * MIB));
        check_all(&engine, &models, &format!("clean open after faults at {a}, {b} and everywhere"));
    }
}

/// Three small files, then a fourth flush that compacts the four: a fault at each of that
/// flush's write-side steps (flush commit, then compaction write and manifest commit), then a
/// clean reopen. The replay test above reached this through the inline flush's compaction.
#[test]
fn a_fault_in_any_step_of_a_compacting_flush_leaves_the_dir_openable() {
    let spec = Spec { cols: 2, min: 8, max: 40 };
    let run = |fault: Option<u64>| -> u64 {
        let dir = tempfile::tempdir().unwrap();
        let fs = FaultFs::new();
        let mut m = Model::new(spec);
        let steps = {
            let engine = open(dir.path(), small(64 * MIB).vfs(Arc::new(fs.clone())));
            let t = engine.create_table("c", spec.schema(), &["k"]).unwrap();
            for i in 0..3 {
                m.insert(&t, i * 100..(i + 1) * 100);
                t.flush().unwrap();
            }
            assert_eq!(t.stats().unwrap().files, 3);
            m.insert(&t, 300..400);
            let before = fs.steps();
            if let Some(n) = fault {
                fs.fail_step(n, 5);
            }
            let res = t.flush();
            if let (Some(n), Err(e)) = (fault, &res) {
                eprintln!("compacting flush, fault at step {n}: {e}");
            }
            if fault.is_none() {
                res.unwrap();
                assert_eq!(t.stats().unwrap().files, 1, "the fourth flush compacts the four files");
            }
            fs.steps() - before
        };
        let engine = Engine::open(dir.path(), small(64 * MIB)).unwrap_or_else(|e| panic!("open after a fault at step {fault:?} of a compacting flush: {e}"));
        m.check(&engine.table("c").unwrap(), &format!("after a fault at step {fault:?}"));
        steps
    };
    let steps = run(None);
    for n in 0..steps {
        run(Some(n));
    }
}

// ---------------------------------------------------------------- alternating limits

/// Reopened ten times at alternating limits (4 MiB .. 256 MiB), written to each time, closed
/// or dropped alternately: exact after every open.
#[test]
fn alternating_limits_over_many_reopens() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec { cols: 5, min: 20, max: 600 };
    let mut models: Vec<Model> = (0..3).map(|_| Model::new(spec)).collect();
    let tables = names(3);
    {
        let engine = open(dir.path(), big());
        for (m, n) in models.iter_mut().zip(&tables) {
            let t = engine.create_table(n, spec.schema(), &["k"]).unwrap();
            for round in 0..6 {
                mixed_round(m, &t, round, 500);
            }
        }
    }
    let limits = [4, 256, 6, 64, 4, 8, 5, 256, 4, 12];
    for (i, mib) in limits.into_iter().enumerate() {
        let config = if mib >= 64 { big().memory_limit(mib * MIB) } else { small(mib * MIB) };
        let engine = open(dir.path(), config);
        let per = if mib >= 64 { 500 } else { 150 };
        for (m, n) in models.iter_mut().zip(&tables) {
            let t = engine.table(n).unwrap();
            m.check(&t, &format!("{n}, session {i} at {mib} MiB"));
            mixed_round(m, &t, 10 + i as i64 * 3, per);
            within(&engine, "after writes");
        }
        if i % 2 == 0 {
            engine.close().unwrap();
        } else {
            drop(engine);
        }
    }
    let engine = open(dir.path(), small(4 * MIB));
    check_all(&engine, &models, "final open at 4 MiB");
}

// ---------------------------------------------------------------- lowered at run time

/// Written at 256 MiB, lowered to 12 MiB at run time, written more (upserts, deletes),
/// dropped without close and reopened at 4 MiB: exact.
#[test]
fn lowered_at_run_time_then_crash_then_reopen_smaller() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec { cols: 10, min: 30, max: 500 };
    let mut models: Vec<Model> = (0..2).map(|_| Model::new(spec)).collect();
    let tables = names(2);
    {
        let engine = open(dir.path(), big());
        let ts: Vec<Table> = tables.iter().map(|n| engine.create_table(n, spec.schema(), &["k"]).unwrap()).collect();
        for round in 0..10 {
            for (m, t) in models.iter_mut().zip(&ts) {
                mixed_round(m, t, round, 300);
            }
        }
        engine.set_memory_limit(12 * MIB).unwrap();
        within(&engine, "after lowering");
        for round in 10..14 {
            for (m, t) in models.iter_mut().zip(&ts) {
                mixed_round(m, t, round, 300);
            }
        }
        within(&engine, "after writes at the lowered limit");
        check_all(&engine, &models, "before the crash");
    }
    let engine = open(dir.path(), small(4 * MIB));
    // Files written at 256 MiB hold 8,192-row batches of 2.7 KB rows: scanned in 256-row
    // batches (the default fails at 4 MiB: `wide_files_from_a_large_limit_scanned_at_4_mib`).
    let check = |models: &[Model], what: &str| {
        for (m, n) in models.iter().zip(&tables) {
            check_at(&engine, m, &engine.table(n).unwrap(), ScanOptions::default().batch_rows(256), &format!("{n}: {what}"));
        }
    };
    check(&models, "reopened at 4 MiB");
    for (m, n) in models.iter_mut().zip(&tables) {
        mixed_round(m, &engine.table(n).unwrap(), 9, 100);
    }
    engine.flush_all().unwrap();
    within(&engine, "after flush_all");
    check(&models, "after writes and flush_all at 4 MiB");
}

// ---------------------------------------------------------------- export

fn read_parquet(path: &Path) -> (Vec<RecordBatch>, usize) {
    let file = std::fs::File::open(path).unwrap();
    let builder = gritdb::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file).unwrap();
    let groups = builder.metadata().num_row_groups();
    let batches = builder.build().unwrap().map(Result::unwrap).collect();
    (batches, groups)
}

/// A log of 12.6 KB rows replayed at 6 MiB (deltas left unflushed), then exported with
/// each of `cases`: every file exact, writer buffers given back.
fn export_after_a_small_reopen(cases: &[(&str, ExportOptions)]) {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec { cols: 12, min: 100, max: 2_000 };
    let mut m = Model::new(spec);
    {
        let engine = open(dir.path(), big());
        let t = engine.create_table("x", spec.schema(), &["k"]).unwrap();
        for round in 0..10 {
            mixed_round(&mut m, &t, round, 60);
        }
    }
    let engine = open(dir.path(), small(6 * MIB));
    let t = engine.table("x").unwrap();
    m.check(&t, "after replay");
    let out = tempfile::tempdir().unwrap();
    for (name, opts) in cases {
        let path = out.path().join(format!("{name}.parquet"));
        let stats = t.export_parquet_with(&path, opts).unwrap_or_else(|e| panic!("export {name} at 6 MiB: {e}"));
        within(&engine, "after export");
        // A background flush the export's scan asked for (memory pressure) may still be
        // writing: its buffers go back when it ends.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while engine.memory().category_bytes(Category::WriteBuffers) != 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(engine.memory().category_bytes(Category::WriteBuffers), 0, "{name}: writer buffers given back");
        assert_eq!(stats.rows, m.rows.len() as u64, "{name}: exported rows");
        let (batches, groups) = read_parquet(&path);
        assert_eq!(groups, stats.row_groups, "{name}: row groups");
        m.check_batches(batches, &format!("export {name}"));
    }
}

/// Row groups cut at 512 KiB by the caller: the export fits beside its scan at 6 MiB.
#[test]
fn export_with_a_small_row_group_cut_after_a_small_reopen_is_exact() {
    export_after_a_small_reopen(&[("512k", ExportOptions::default().row_group_bytes(512 << 10))]);
}

/// The default options (32 MiB row groups) and a 64 MiB cut: only the budget cuts the row
/// groups, and the writer's buffers must leave the scan room for its next batch.
#[test]
fn export_after_a_small_reopen_is_exact() {
    export_after_a_small_reopen(&[
        ("default", ExportOptions::default()),
        ("one-group", ExportOptions::default().row_group_bytes(64 * MIB).row_group_rows(1 << 30)),
    ]);
}

/// Wide rows (about 1.1 MB) exported at 8 MiB after a small reopen.
#[test]
fn export_of_wide_rows_at_8_mib_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec { cols: 32, min: 4 << 10, max: 64 << 10 };
    let mut m = Model::new(spec);
    {
        let engine = open(dir.path(), big());
        let t = engine.create_table("w", spec.schema(), &["k"]).unwrap();
        for k in 0..16 {
            m.insert(&t, [k]);
        }
    }
    let engine = open(dir.path(), small(8 * MIB));
    let t = engine.table("w").unwrap();
    let out = tempfile::tempdir().unwrap();
    let path = out.path().join("w.parquet");
    let stats = t.export_parquet(&path).unwrap_or_else(|e| panic!("export at 8 MiB: {e}"));
    within(&engine, "after export");
    assert_eq!(stats.rows, 16);
    m.check_batches(read_parquet(&path).0, "export of wide rows");
}

// ---------------------------------------------------------------- accounting

fn categories(e: &Engine) -> Vec<(Category, usize)> {
    Category::ALL.iter().map(|c| (*c, e.memory().category_bytes(*c))).collect()
}

/// After a replay at 6 MiB with inline flushes, scans, writes and a flush, dropping every
/// table returns each category to an empty engine's figures, and the report lists no table.
#[test]
fn dropping_every_table_after_a_small_reopen_returns_to_baseline() {
    let empty = tempfile::tempdir().unwrap();
    let baseline = {
        let engine = open(empty.path(), small(6 * MIB));
        engine.release_cached_memory();
        (categories(&engine), engine.memory().used())
    };
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec { cols: 8, min: 50, max: 700 };
    let mut models: Vec<Model> = (0..4).map(|_| Model::new(spec)).collect();
    let tables = names(4);
    {
        let engine = open(dir.path(), big());
        let ts: Vec<Table> = tables.iter().map(|n| engine.create_table(n, spec.schema(), &["k"]).unwrap()).collect();
        for round in 0..6 {
            for (m, t) in models.iter_mut().zip(&ts) {
                mixed_round(m, t, round, 250);
            }
        }
    }
    let engine = open(dir.path(), small(6 * MIB));
    check_all(&engine, &models, "after replay");
    let t0 = engine.table("t0").unwrap();
    models[0].upsert(&t0, 0..50);
    t0.flush().unwrap();
    models[0].check(&t0, "after a flush");
    drop(t0);
    for n in &tables {
        engine.drop_table(n).unwrap();
    }
    engine.release_cached_memory();
    assert_eq!(categories(&engine), baseline.0, "every category back to an empty engine's");
    assert_eq!(engine.memory().used(), baseline.1);
    let report = engine.memory_report();
    assert!(report.tables.is_empty(), "tables left in the report: {:?}", report.tables.iter().map(|t| (&t.table, t.bytes)).collect::<Vec<_>>());
}

// ---------------------------------------------------------------- small chunks

/// Written at 256 MiB with 64 KiB chunks, reopened at 4 MiB with 4 KiB chunks (rows of
/// 1..20 KB are then oversize allocations): exact, writable, flushable.
#[test]
fn reopened_with_4_kib_chunks_at_4_mib() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec { cols: 4, min: 200, max: 5_000 };
    let mut m = Model::new(spec);
    {
        let engine = open(dir.path(), big());
        let t = engine.create_table("c", spec.schema(), &["k"]).unwrap();
        for round in 0..10 {
            mixed_round(&mut m, &t, round, 70);
        }
    }
    let engine = open(dir.path(), small(4 * MIB).chunk_size(4 << 10));
    let t = engine.table("c").unwrap();
    m.check(&t, "after replay with 4 KiB chunks");
    mixed_round(&mut m, &t, 99, 40);
    t.flush().unwrap();
    within(&engine, "after a flush");
    m.check(&t, "after a flush");
    drop(t);
    engine.close().unwrap();
    let engine = open(dir.path(), small(4 * MIB).chunk_size(4 << 10));
    m.check(&engine.table("c").unwrap(), "after close and reopen");
}

// ---------------------------------------------------------------- a big delete record

/// 150,000 rows in files (closed at 256 MiB), then one delete record of `deletes` keys and
/// some upserts (log only), reopened at 4 MiB: exact, flushable.
fn big_delete_record(deletes: i64) {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec { cols: 1, min: 8, max: 24 };
    let mut m = Model::new(spec);
    let n = 150_000;
    {
        let engine = open(dir.path(), big());
        let t = engine.create_table("d", spec.schema(), &["k"]).unwrap();
        for at in (0..n).step_by(50_000) {
            m.insert(&t, at..at + 50_000);
        }
        drop(t);
        engine.close().unwrap();
    }
    {
        let engine = open(dir.path(), big());
        let t = engine.table("d").unwrap();
        let dels: Vec<i64> = (0..deletes).map(|i| i * n / deletes + i % 3).collect();
        m.delete(&t, &dels);
        m.upsert(&t, n - 10..n + 10);
    }
    let engine = open(dir.path(), small(4 * MIB));
    let t = engine.table("d").unwrap();
    check_at(&engine, &m, &t, ScanOptions::default(), "after replay at 4 MiB");
    t.flush().unwrap();
    within(&engine, "after a flush");
    check_at(&engine, &m, &t, ScanOptions::default(), "after a flush");
}

#[test]
fn a_delete_record_of_30_000_keys_replayed_at_4_mib() {
    big_delete_record(30_000);
}

/// Replayed in slices now, but the table's file key index (2.9 MiB for its 150,000 keys) and
/// one slice's delta do not fit the 4 MiB limit: the key index must be in memory.
#[test]
#[ignore = "breaker: the table's key index (2.9 MiB) leaves a 4 MiB limit no room to replay into: open fails with MemoryLimit (an in-memory key index is the design)"]
fn a_delete_record_of_140_000_keys_replayed_at_4_mib() {
    big_delete_record(140_000);
}

// ---------------------------------------------------------------- files from the large limit

/// `rows` rows of `spec` flushed into files at 256 MiB (closed: nothing in the log), then
/// scanned at `limit` with the default scan options.
fn files_scanned_small(spec: Spec, rows: i64, limit: usize) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = Model::new(spec);
    {
        let engine = open(dir.path(), big());
        let t = engine.create_table("f", spec.schema(), &["k"]).unwrap();
        for at in (0..rows).step_by(2_000) {
            m.insert(&t, at..(at + 2_000).min(rows));
        }
        drop(t);
        engine.close().unwrap();
    }
    let engine = open(dir.path(), small(limit));
    let t = engine.table("f").unwrap();
    check_at(&engine, &m, &t, ScanOptions::default(), &format!("files written at 256 MiB scanned at {limit}"));
    m.upsert(&t, 0..20);
    t.flush().unwrap();
    check_at(&engine, &m, &t, ScanOptions::default(), "after a flush");
}

/// 20,000 rows of about 2.7 KB (54 MB) in 256 MiB-limit files, scanned at 4 MiB.
#[test]
fn wide_files_from_a_large_limit_scanned_at_4_mib() {
    files_scanned_small(Spec { cols: 10, min: 30, max: 500 }, 20_000, 4 * MIB);
}

/// 20,000 rows of about 1.3 KB in 256 MiB-limit files, scanned at 8 MiB.
#[test]
fn wide_files_from_a_large_limit_scanned_at_8_mib() {
    files_scanned_small(Spec { cols: 8, min: 16, max: 300 }, 20_000, 8 * MIB);
}

/// Narrow rows (about 60 B) in 256 MiB-limit files, scanned at 4 MiB.
#[test]
fn narrow_files_from_a_large_limit_scanned_at_4_mib() {
    files_scanned_small(Spec { cols: 2, min: 8, max: 40 }, 60_000, 4 * MIB);
}

/// Chunks of 1 or 2 MiB at a 4 MiB limit (two chunks is the smallest allowed), 3 tables.
fn big_chunks(chunk: usize) {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec { cols: 4, min: 20, max: 400 };
    let mut models: Vec<Model> = (0..3).map(|_| Model::new(spec)).collect();
    {
        let engine = open(dir.path(), big());
        let ts: Vec<Table> = names(3).iter().map(|n| engine.create_table(n, spec.schema(), &["k"]).unwrap()).collect();
        for round in 0..4 {
            for (m, t) in models.iter_mut().zip(&ts) {
                mixed_round(m, t, round, 300);
            }
        }
    }
    let engine = open(dir.path(), small(4 * MIB).chunk_size(chunk));
    check_all(&engine, &models, &format!("replayed with {chunk}-byte chunks at 4 MiB"));
    for (m, n) in models.iter_mut().zip(names(3)) {
        mixed_round(m, &engine.table(&n).unwrap(), 50, 50);
    }
    engine.flush_all().unwrap();
    within(&engine, "after flush_all");
    check_all(&engine, &models, "after writes and flush_all");
}

#[test]
fn reopened_with_1_mib_chunks_at_4_mib() {
    big_chunks(MIB);
}

#[test]
fn reopened_with_2_mib_chunks_at_4_mib() {
    big_chunks(2 * MIB);
}
