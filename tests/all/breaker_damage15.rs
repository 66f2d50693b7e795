//! helper-39's probes (a fresh-user trial of 2026-12-06, kept as regression tests; p39_b, p39_b2
//! and p39_d failed before `engine, storage: a missing data file is damage ...` and the
//! read-error change after it): committed data files changed on disk (flips, truncation, appended bytes,
//! another valid file of the table, rename, mtime restored), the damage shown in `TableStats`
//! and `gritdb_tables`, writes/flushes/compactions while damaged, concurrent scans, and bad
//! input, runtime limits and memory back to baseline.
//!
//! Each probe collects its failures and asserts once at the end, listing them all.

use arrow::array::{Array as _, AsArray as _, RecordBatch};
use arrow::datatypes::Int64Type;
use gritdb::{Engine, EngineConfig, Error, ScanOptions, StorageError};
use gritdb_tests::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The file system's clock tick: every change and restore waits one out (documented limit).
fn tick() {
    std::thread::sleep(Duration::from_millis(25));
}

fn cfg() -> EngineConfig {
    EngineConfig::default().memory_limit(64 << 20)
}

fn rows(from: i64, n: i64) -> Vec<((i64, i32), Row)> {
    (from..from + n).map(|k| ((k, 0), (Some(k * 7 + 1), Some(format!("value {k}"))))).collect()
}

fn sum_of(r: &[((i64, i32), Row)]) -> i64 {
    r.iter().map(|x| x.1.0.unwrap()).sum()
}

/// Table `t` of `n` rows in two files of `n / 2` rows each: the table, its files (sorted) and
/// the outcome a whole scan must have.
fn two_file_table(engine: &Engine, root: &Path, n: usize) -> (gritdb::Table, Vec<PathBuf>, Outcome) {
    let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
    let all = rows(0, n as i64);
    t.insert(&composite_batch(&all[..n / 2])).unwrap();
    t.flush().unwrap();
    t.insert(&composite_batch(&all[n / 2..])).unwrap();
    t.flush().unwrap();
    let files = parquet_files(&dir_of_table(root, "t"));
    (t, files, Outcome::Rows(n, sum_of(&all), 0))
}

fn parquet_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|e| e == "parquet")).collect();
    v.sort();
    v
}

#[derive(Debug, PartialEq)]
enum Outcome {
    /// rows, sum of v, duplicate keys seen
    Rows(usize, i64, usize),
    Corrupt(PathBuf, String),
    Other(String),
}

fn classify(e: Error) -> Outcome {
    match e {
        Error::Storage(StorageError::CorruptFile { path, detail, .. }) => Outcome::Corrupt(path, detail),
        e => Outcome::Other(format!("{e:?} / {e}")),
    }
}

fn scan_with(t: &gritdb::Table, opts: ScanOptions) -> Outcome {
    let scan = match t.scan(opts) {
        Ok(s) => s,
        Err(e) => return classify(e),
    };
    drain(scan)
}

fn drain(scan: impl IntoIterator<Item = gritdb::Result<RecordBatch>>) -> Outcome {
    let (mut n, mut sum, mut dups) = (0usize, 0i64, 0usize);
    let mut seen = std::collections::HashSet::new();
    for b in scan {
        match b {
            Ok(b) => {
                n += b.num_rows();
                let k1 = b.column(0).as_primitive::<Int64Type>();
                for k in k1.iter().flatten() {
                    if !seen.insert(k) {
                        dups += 1;
                    }
                }
                sum += b.column(2).as_primitive::<Int64Type>().iter().flatten().sum::<i64>();
            }
            Err(e) => return classify(e),
        }
    }
    Outcome::Rows(n, sum, dups)
}

fn scan_outcome(t: &gritdb::Table) -> Outcome {
    scan_with(t, ScanOptions::default())
}

fn flip_at(good: &[u8], at: usize) -> Vec<u8> {
    let mut b = good.to_vec();
    b[at] ^= 0x5a;
    b
}

/// Replaces `path` by a new inode holding `bytes` (write aside, rename over).
fn replace_by_rename(path: &Path, bytes: &[u8]) {
    let aside = path.with_extension("swap");
    std::fs::write(&aside, bytes).unwrap();
    std::fs::rename(&aside, path).unwrap();
}

fn touch_r(reference: &Path, target: &Path) {
    let st = std::process::Command::new("touch").arg("-r").arg(reference).arg(target).status().unwrap();
    assert!(st.success());
}

/// One kind of change to a committed file: `(path, its good bytes, the other file's path and
/// bytes)`.
type Change = Box<dyn Fn(&Path, &[u8], &Path, &[u8])>;

fn ch(name: &'static str, f: impl Fn(&Path, &[u8], &Path, &[u8]) + 'static) -> (&'static str, Change) {
    (name, Box::new(f))
}

fn changes() -> Vec<(&'static str, Change)> {
    let mut v: Vec<(&'static str, Change)> = Vec::new();
    v.push(ch("flip byte 0 in place", |p, g, _, _| std::fs::write(p, flip_at(g, 0)).unwrap()));
    v.push(ch("flip middle byte in place", |p, g, _, _| std::fs::write(p, flip_at(g, g.len() / 2)).unwrap()));
    v.push(ch("flip byte at 1/3 in place", |p, g, _, _| std::fs::write(p, flip_at(g, g.len() / 3)).unwrap()));
    v.push(ch("flip last byte in place", |p, g, _, _| std::fs::write(p, flip_at(g, g.len() - 1)).unwrap()));
    v.push(ch("flip middle byte via pwrite (no truncate)", |p, g, _, _| {
        use std::io::{Seek as _, SeekFrom, Write as _};
        let mut f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
        f.seek(SeekFrom::Start((g.len() / 2) as u64)).unwrap();
        f.write_all(&[g[g.len() / 2] ^ 0x01]).unwrap();
    }));
    v.push(ch("truncated by one byte", |p, g, _, _| std::fs::write(p, &g[..g.len() - 1]).unwrap()));
    v.push(ch("truncated to half", |p, g, _, _| std::fs::write(p, &g[..g.len() / 2]).unwrap()));
    v.push(ch("truncated to zero", |p, _, _, _| std::fs::write(p, b"").unwrap()));
    v.push(ch("one byte appended", |p, g, _, _| {
        let mut b = g.to_vec();
        b.push(0);
        std::fs::write(p, b).unwrap();
    }));
    v.push(ch("a valid Parquet file (PAR1...PAR1) appended", |p, g, _, o| {
        let mut b = g.to_vec();
        b.extend_from_slice(o);
        std::fs::write(p, b).unwrap();
    }));
    v.push(ch("the other data file's bytes written over it", |p, _, _, o| std::fs::write(p, o).unwrap()));
    v.push(ch("the other data file copied over it with cp -p", |p, _, op, _| {
        let st = std::process::Command::new("cp").arg("-p").arg(op).arg(p).status().unwrap();
        assert!(st.success());
    }));
    v.push(ch("replaced by rename: one byte flipped", |p, g, _, _| replace_by_rename(p, &flip_at(g, g.len() / 2))));
    v.push(ch("replaced by rename: the other data file", |p, _, _, o| replace_by_rename(p, o)));
    v.push(ch("replaced by a hard link to the other data file", |p, _, op, _| {
        std::fs::remove_file(p).unwrap();
        std::fs::hard_link(op, p).unwrap();
    }));
    v.push(ch("flip in place, mtime restored (touch -r)", |p, g, _, _| {
        let r = p.with_extension("mtime-ref");
        std::fs::write(&r, b"").unwrap();
        touch_r(p, &r);
        std::fs::write(p, flip_at(g, g.len() / 2)).unwrap();
        touch_r(&r, p);
        std::fs::remove_file(&r).unwrap();
    }));
    v.push(ch("replaced by rename, flip, mtime restored (touch -r)", |p, g, _, _| {
        let aside = p.with_extension("swap");
        std::fs::write(&aside, flip_at(g, g.len() / 2)).unwrap();
        touch_r(p, &aside);
        std::fs::rename(&aside, p).unwrap();
    }));
    v
}

/// Restores `p` to `good`: in place (same inode) when `in_place`, else by rename.
fn restore(p: &Path, good: &[u8], in_place: bool) {
    if in_place
        && std::fs::symlink_metadata(p).is_ok_and(|m| {
            use std::os::unix::fs::MetadataExt as _;
            m.nlink() == 1
        })
    {
        std::fs::write(p, good).unwrap();
    } else {
        replace_by_rename(p, good);
    }
}

fn run_changes(engine: &Engine, t: &gritdb::Table, files: [&Path; 2], want: &Outcome, phase: &str, failures: &mut Vec<String>) {
    for which in 0..2 {
        let (p, other) = (files[which], files[1 - which]);
        let good = std::fs::read(p).unwrap();
        let other_bytes = std::fs::read(other).unwrap();
        for (i, (what, change)) in changes().into_iter().enumerate() {
            let label = format!("{phase}: {} / {what}", p.file_name().unwrap().to_string_lossy());
            tick();
            change(p, &good, other, &other_bytes);
            // A plain scan, a projected scan of the key only and a row count: all read the file.
            match scan_outcome(t) {
                Outcome::Corrupt(path, detail) => {
                    if path != p {
                        failures.push(format!("{label}: CorruptFile names {} not {}", path.display(), p.display()));
                    }
                    if !detail.contains("checksum mismatch") {
                        failures.push(format!("{label}: detail without 'checksum mismatch': {detail}"));
                    }
                }
                other => failures.push(format!("{label}: scan expected CorruptFile, got {other:?}")),
            }
            match t.row_count() {
                Err(Error::Storage(StorageError::CorruptFile { .. })) => {}
                other => failures.push(format!("{label}: row_count expected CorruptFile, got {other:?}")),
            }
            let st = t.stats().unwrap();
            if st.damaged_files != vec![p.to_path_buf()] || st.damage.is_none() {
                failures.push(format!("{label}: stats damaged_files {:?} damage {:?}", st.damaged_files, st.damage));
            }
            if !engine.degraded_tables().iter().any(|(n, _)| n == "t") {
                failures.push(format!("{label}: degraded_tables {:?}", engine.degraded_tables()));
            }
            tick();
            restore(p, &good, i % 2 == 0);
            let back = scan_outcome(t);
            if &back != want {
                failures.push(format!("{label}: restored: expected {want:?}, got {back:?}"));
            }
            let st = t.stats().unwrap();
            if !st.damaged_files.is_empty() || st.damage.is_some() || !engine.degraded_tables().is_empty() {
                failures.push(format!("{label}: restored, still damaged: {:?} {:?} {:?}", st.damaged_files, st.damage, engine.degraded_tables()));
            }
        }
    }
}

/// 2a: every kind of change to a committed file, in the process that wrote it and after a
/// reopen, is CorruptFile naming it; restored, exact rows and sum.
#[test]
fn p39_a_every_change_is_corrupt_file_and_restore_reads_exact() {
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    let want = {
        let engine = Engine::open(dir.path(), cfg()).unwrap();
        let (t, files, want) = two_file_table(&engine, dir.path(), 4_000);
        assert_eq!(files.len(), 2, "{files:?}");
        assert_eq!(scan_outcome(&t), want);
        run_changes(&engine, &t, [files[0].as_path(), files[1].as_path()], &want, "written in process", &mut failures);
        drop(t);
        engine.close().unwrap();
        want
    };
    {
        let engine = Engine::open(dir.path(), cfg()).unwrap();
        let t = engine.table("t").unwrap();
        let files = parquet_files(&dir_of_table(dir.path(), "t"));
        assert_eq!(scan_outcome(&t), want);
        run_changes(&engine, &t, [files[0].as_path(), files[1].as_path()], &want, "loaded at open, read once", &mut failures);
        drop(t);
        engine.close().unwrap();
    }
    {
        // Loaded at open and changed before its first read.
        let files = parquet_files(&dir_of_table(dir.path(), "t"));
        let engine = Engine::open(dir.path(), cfg()).unwrap();
        let t = engine.table("t").unwrap();
        let good = std::fs::read(&files[1]).unwrap();
        tick();
        std::fs::write(&files[1], flip_at(&good, good.len() / 2)).unwrap();
        match scan_outcome(&t) {
            Outcome::Corrupt(p, _) if p == files[1] => {}
            other => failures.push(format!("loaded, unread, flipped: {other:?}")),
        }
        tick();
        std::fs::write(&files[1], &good).unwrap();
        let back = scan_outcome(&t);
        if back != want {
            failures.push(format!("loaded, unread, restored: {back:?}"));
        }
        drop(t);
        engine.close().unwrap();
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// 2a': a scan already running when a file it has not reached yet is damaged fails with
/// CorruptFile (never finishes with wrong rows); a file damaged in place while its reader is
/// open is reported as observed.
#[test]
fn p39_a2_damage_ahead_of_and_under_an_open_scan() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg()).unwrap();
    let (t, files, want) = two_file_table(&engine, dir.path(), 40_000);
    assert_eq!(files.len(), 2);
    let good: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
    assert_eq!(scan_outcome(&t), want);
    // Take one batch, then damage both files in place (the one open and the one ahead).
    let mut scan = t.scan(ScanOptions::default().batch_rows(100)).unwrap();
    let first = scan.next().unwrap().unwrap();
    tick();
    for (f, g) in files.iter().zip(&good) {
        let mut b = g.clone();
        for i in 1..50 {
            let at = i * b.len() / 50;
            b[at] ^= 0x5a;
        }
        std::fs::write(f, b).unwrap();
    }
    let rest = drain(std::iter::once(Ok(first)).chain(scan));
    eprintln!("probe39 a2: scan open across damage of both files: {rest:?}");
    let ok = matches!(&rest, Outcome::Corrupt(..));
    tick();
    for (f, g) in files.iter().zip(&good) {
        std::fs::write(f, g).unwrap();
    }
    assert_eq!(scan_outcome(&t), want, "restored");
    assert!(ok, "a scan open across the damage of the file ahead of it finished without CorruptFile: {rest:?}");
}

/// 2b: damage shows in TableStats and gritdb_tables from the read that finds it to the read
/// that finds it restored; gritdb_tables lists every table; two damaged tables, a dropped
/// table, drop of a damaged table, close + reopen with damage, no acknowledged write lost.
#[cfg(feature = "sql")]
#[test]
fn p39_b_stats_and_gritdb_tables_through_damage_drop_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let mut failures: Vec<String> = Vec::new();
    let q = |engine: &Engine| -> Vec<(String, Option<u64>, Option<String>, Option<String>)> {
        let b = engine.sql("SELECT name, rows, damage, last_flush_error FROM gritdb_tables ORDER BY name").unwrap();
        let mut out = Vec::new();
        for b in b {
            let name = b.column(0).as_string::<i32>();
            let r = b.column(1).as_primitive::<arrow::datatypes::UInt64Type>();
            let d = b.column(2).as_string::<i32>();
            let e = b.column(3).as_string::<i32>();
            for i in 0..b.num_rows() {
                out.push((
                    name.value(i).to_owned(),
                    r.is_valid(i).then(|| r.value(i)),
                    d.is_valid(i).then(|| d.value(i).to_owned()),
                    e.is_valid(i).then(|| e.value(i).to_owned()),
                ));
            }
        }
        out
    };
    let fa;
    let fb;
    let ga;
    let gb;
    {
        let engine = Engine::open(dir.path(), cfg()).unwrap();
        for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
            let t = engine.create_table(name, composite_schema(), &["k1", "k2"]).unwrap();
            t.insert(&composite_batch(&rows(i as i64 * 10_000, 2_000))).unwrap();
            t.flush().unwrap();
        }
        fa = parquet_files(&dir_of_table(dir.path(), "a")).remove(0);
        fb = parquet_files(&dir_of_table(dir.path(), "b")).remove(0);
        ga = std::fs::read(&fa).unwrap();
        gb = std::fs::read(&fb).unwrap();
        tick();
        std::fs::write(&fa, flip_at(&ga, ga.len() / 2)).unwrap();
        std::fs::write(&fb, flip_at(&gb, gb.len() / 2)).unwrap();
        // First gritdb_tables after the damage, before any other read found it: its own count
        // is the read that finds it.
        let first = q(&engine);
        eprintln!("probe39 b: first gritdb_tables after damage (no read before): {first:?}");
        if first.len() != 3 {
            failures.push(format!("first query: {} rows: {first:?}", first.len()));
        }
        for row in first.iter().filter(|r| r.0 == "a" || r.0 == "b") {
            if row.1.is_some() {
                failures.push(format!("first query: damaged table {} has rows {:?}", row.0, row.1));
            }
            if row.2.is_none() && row.3.is_none() {
                failures.push(format!(
                    "first query: table {}: rows null but damage AND last_flush_error null (docs/sql.md: null rows 'which damage or last_flush_error says'): {row:?}",
                    row.0
                ));
            }
        }
        let second = q(&engine);
        eprintln!("probe39 b: second gritdb_tables: {second:?}");
        for row in &second {
            match row.0.as_str() {
                "a" | "b" => {
                    let f = if row.0 == "a" { &fa } else { &fb };
                    if row.1.is_some() || !row.2.as_deref().is_some_and(|d| d.contains(&f.display().to_string())) {
                        failures.push(format!("second query: {row:?}"));
                    }
                }
                "c" => {
                    if row.1 != Some(2_000) || row.2.is_some() {
                        failures.push(format!("second query: {row:?}"));
                    }
                }
                _ => failures.push(format!("second query: unknown row {row:?}")),
            }
        }
        let a = engine.table("a").unwrap();
        if a.stats().unwrap().damaged_files != vec![fa.clone()] {
            failures.push(format!("a.stats: {:?}", a.stats().unwrap().damaged_files));
        }
        // SQL over the damaged table: what error, typed?
        match engine.sql("SELECT count(*), sum(v) FROM a") {
            Ok(b) => failures.push(format!("SQL over damaged a returned Ok: {b:?}")),
            Err(e) => {
                eprintln!("probe39 b: SQL over damaged table: {e:?}\n  display: {e}");
                if !e.to_string().contains(&fa.display().to_string()) {
                    failures.push(format!("SQL over damaged a: error does not name the file: {e}"));
                }
                if !matches!(e, Error::Storage(StorageError::CorruptFile { .. })) {
                    eprintln!("probe39 b: NOTE: SQL error over damaged file is not Error::Storage(CorruptFile)");
                }
            }
        }
        // Export over the damaged table.
        let out = dir.path().parent().unwrap().join(format!("probe39-export-{}.parquet", std::process::id()));
        match a.export_parquet(&out) {
            Ok(s) => failures.push(format!("export of damaged a returned Ok: {s:?}")),
            Err(e) => {
                if !e.to_string().contains(&fa.display().to_string()) {
                    failures.push(format!("export over damaged a: the error does not name the file: {e}"));
                }
            }
        }
        if out.exists() {
            failures.push(format!("a failed export left {}", out.display()));
            let _ = std::fs::remove_file(&out);
        }
        // Drop c (healthy) and a (damaged).
        engine.drop_table("c").unwrap();
        drop(a);
        if let Err(e) = engine.drop_table("a") {
            failures.push(format!("drop of damaged table a: {e:?}"));
        }
        let after_drop = q(&engine);
        eprintln!("probe39 b: after drops: {after_drop:?}");
        if after_drop.len() != 1 || after_drop[0].0 != "b" {
            failures.push(format!("after drops: {after_drop:?}"));
        }
        if engine.degraded_tables().iter().any(|(n, _)| n == "a") {
            failures.push(format!("dropped table a still degraded: {:?}", engine.degraded_tables()));
        }
        // A new table named a is clean.
        let a2 = engine.create_table("a", composite_schema(), &["k1", "k2"]).unwrap();
        a2.insert(&composite_batch(&rows(0, 10))).unwrap();
        a2.flush().unwrap();
        if !a2.stats().unwrap().damaged_files.is_empty() {
            failures.push("recreated a shows damage".into());
        }
        // Unflushed acknowledged writes to damaged b, then close.
        let b = engine.table("b").unwrap();
        b.insert(&composite_batch(&rows(50_000, 500))).unwrap();
        drop((b, a2));
        if let Err(e) = engine.close() {
            failures.push(format!("close with b damaged: {e:?}"));
        }
    }
    // Reopen with b still damaged: documented that a damaged file may refuse the open.
    match Engine::open(dir.path(), cfg()) {
        Err(e) => {
            eprintln!("probe39 b: reopen with damage: Err {e:?}");
            if !e.to_string().contains(&fb.display().to_string()) {
                failures.push(format!("reopen refused without naming the file: {e}"));
            }
        }
        Ok(engine) => {
            let b = engine.table("b").unwrap();
            match scan_outcome(&b) {
                Outcome::Corrupt(p, _) if p == fb => {}
                other => failures.push(format!("reopened, b damaged: {other:?}")),
            }
            drop(b);
            engine.close().unwrap();
        }
    }
    tick();
    std::fs::write(&fb, &gb).unwrap();
    let engine = Engine::open(dir.path(), cfg()).unwrap();
    let b = engine.table("b").unwrap();
    let mut want_rows = rows(10_000, 2_000);
    want_rows.extend(rows(50_000, 500));
    let got = scan_outcome(&b);
    if got != Outcome::Rows(2_500, sum_of(&want_rows), 0) {
        failures.push(format!("restored b after reopen: {got:?}"));
    }
    let last = q(&engine);
    eprintln!("probe39 b: restored: {last:?}");
    if last.iter().any(|r| r.2.is_some()) || !last.iter().any(|r| r.0 == "b" && r.1 == Some(2_500)) {
        failures.push(format!("restored gritdb_tables: {last:?}"));
    }
    let _ = ga;
    drop(b);
    engine.close().unwrap();
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// 2c: writes, flushes and compactions while a file is damaged.
#[test]
fn p39_c_writes_flushes_and_compactions_while_damaged() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg()).unwrap();
    let mut failures: Vec<String> = Vec::new();
    // Model: k1 -> v.
    let mut model: BTreeMap<i64, i64> = BTreeMap::new();
    let put = |m: &mut BTreeMap<i64, i64>, r: &[((i64, i32), Row)]| {
        for x in r {
            m.insert(x.0.0, x.1.0.unwrap());
        }
    };
    let want = |m: &BTreeMap<i64, i64>| Outcome::Rows(m.len(), m.values().sum(), 0);

    // Phase 1: damage found by a read, then writes and flushes.
    let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
    let base = rows(0, 2_000);
    t.insert(&composite_batch(&base)).unwrap();
    t.flush().unwrap();
    put(&mut model, &base);
    let f1 = parquet_files(&dir_of_table(dir.path(), "t")).remove(0);
    let good = std::fs::read(&f1).unwrap();
    let bad = flip_at(&good, good.len() / 2);
    tick();
    std::fs::write(&f1, &bad).unwrap();
    assert!(matches!(scan_outcome(&t), Outcome::Corrupt(..)));
    for i in 0..6 {
        let r = rows(10_000 + i * 300, 300);
        t.insert(&composite_batch(&r)).unwrap();
        if let Err(e) = t.flush() {
            failures.push(format!("phase 1 flush {i}: {e:?}"));
        }
        put(&mut model, &r);
    }
    let st = t.stats().unwrap();
    eprintln!("probe39 c: after 6 flushes: files {} damaged {:?} last_flush_error {:?}", st.files, st.damaged_files, st.last_flush_error);
    if st.damaged_files != vec![f1.clone()] || std::fs::read(&f1).unwrap() != bad {
        failures.push(format!("phase 1: damaged file not left alone: {:?}", st.damaged_files));
    }
    // 30% of the damaged file's rows deleted, some upserted, some updated.
    t.delete(&composite_keys(&(0..600).map(|k| (k, 0)).collect::<Vec<_>>())).unwrap();
    for k in 0..600 {
        model.remove(&k);
    }
    let up: Vec<((i64, i32), Row)> = (600..700).map(|k| ((k, 0), (Some(-k), Some("upserted".into())))).collect();
    t.upsert(&composite_batch(&up)).unwrap();
    put(&mut model, &up);
    let upd: Vec<((i64, i32), Row)> = (700..750).map(|k| ((k, 0), (Some(3 * k), None))).collect();
    match t.update(&composite_batch(&upd)) {
        Ok(_) => put(&mut model, &upd),
        Err(e) => failures.push(format!("update of keys in the damaged file: {e:?}")),
    }
    if let Err(e) = t.flush() {
        failures.push(format!("phase 1 flush after deletes: {e:?}"));
    }
    if std::fs::read(&f1).map_or(true, |b| b != bad) {
        failures.push("phase 1: the damaged file was rewritten or removed by a compaction".into());
    }
    if !matches!(scan_outcome(&t), Outcome::Corrupt(..)) {
        failures.push("phase 1: scan while damaged did not fail".into());
    }
    tick();
    std::fs::write(&f1, &good).unwrap();
    let got = scan_outcome(&t);
    if got != want(&model) {
        failures.push(format!("phase 1 restored: expected {:?}, got {got:?}", want(&model)));
    }
    if let Err(e) = t.flush() {
        failures.push(format!("phase 1 flush after restore: {e:?}"));
    }
    let got = scan_outcome(&t);
    if got != want(&model) {
        failures.push(format!("phase 1 after restore + flush: expected {:?}, got {got:?}", want(&model)));
    }
    eprintln!("probe39 c: after restore + flush: f1 exists {} stats {:?}", f1.exists(), t.stats().unwrap().damaged_files);

    // Phase 2: damage not yet found by a read; the flush's compaction finds it.
    let u = engine.create_table("u", composite_schema(), &["k1", "k2"]).unwrap();
    let ur = rows(0, 2_000);
    u.insert(&composite_batch(&ur)).unwrap();
    u.flush().unwrap();
    let uf = parquet_files(&dir_of_table(dir.path(), "u")).remove(0);
    let ugood = std::fs::read(&uf).unwrap();
    tick();
    std::fs::write(&uf, flip_at(&ugood, ugood.len() / 2)).unwrap();
    u.delete(&composite_keys(&(0..500).map(|k| (k, 0)).collect::<Vec<_>>())).unwrap();
    match u.flush() {
        Ok(_) => {}
        Err(e) => failures.push(format!("phase 2: flush whose compaction meets undetected damage: {e:?}")),
    }
    let st = u.stats().unwrap();
    eprintln!("probe39 c: phase 2: damaged {:?} last_flush_error {:?} degraded {:?}", st.damaged_files, st.last_flush_error, engine.degraded_tables());
    if st.damaged_files != vec![uf.clone()] {
        failures.push(format!("phase 2: stats.damaged_files {:?}", st.damaged_files));
    }
    tick();
    std::fs::write(&uf, &ugood).unwrap();
    let got = scan_outcome(&u);
    let want_u = Outcome::Rows(1_500, sum_of(&ur[500..]), 0);
    if got != want_u {
        failures.push(format!("phase 2 restored: {got:?} expected {want_u:?}"));
    }
    u.flush().unwrap();
    if scan_outcome(&u) != want_u {
        failures.push("phase 2 after flush".into());
    }

    // Phase 3: every row of the damaged file deleted (or upserted): the file is dropped unread.
    for (name, by_upsert) in [("w", false), ("x", true)] {
        let w = engine.create_table(name, composite_schema(), &["k1", "k2"]).unwrap();
        let r1 = rows(0, 1_000);
        let r2 = rows(1_000, 1_000);
        w.insert(&composite_batch(&r1)).unwrap();
        w.flush().unwrap();
        w.insert(&composite_batch(&r2)).unwrap();
        w.flush().unwrap();
        let wf = parquet_files(&dir_of_table(dir.path(), name));
        let wgood = std::fs::read(&wf[0]).unwrap();
        tick();
        std::fs::write(&wf[0], flip_at(&wgood, wgood.len() / 2)).unwrap();
        assert!(matches!(scan_outcome(&w), Outcome::Corrupt(..)));
        let mut m: BTreeMap<i64, i64> = BTreeMap::new();
        put(&mut m, &r2);
        if by_upsert {
            let up: Vec<((i64, i32), Row)> = (0..1_000).map(|k| ((k, 0), (Some(k + 1), None))).collect();
            w.upsert(&composite_batch(&up)).unwrap();
            put(&mut m, &up);
        } else {
            w.delete(&composite_keys(&(0..1_000).map(|k| (k, 0)).collect::<Vec<_>>())).unwrap();
        }
        if let Err(e) = w.flush() {
            failures.push(format!("phase 3 {name}: flush: {e:?}"));
        }
        let st = w.stats().unwrap();
        let deg = engine.degraded_tables();
        eprintln!("probe39 c: phase 3 {name}: file exists {} damaged {:?} degraded {deg:?}", wf[0].exists(), st.damaged_files);
        let got = scan_outcome(&w);
        if got != want(&m) {
            failures.push(format!("phase 3 {name}: all rows of the damaged file replaced: scan {got:?}, expected {:?}", want(&m)));
        }
        if wf[0].exists() && !st.damaged_files.is_empty() {
            eprintln!("probe39 c: phase 3 {name}: NOTE the dead damaged file is kept");
        }
        if !wf[0].exists() && (!st.damaged_files.is_empty() || deg.iter().any(|(n, _)| n == name)) {
            failures.push(format!("phase 3 {name}: file gone but still shown damaged: {:?} {deg:?}", st.damaged_files));
        }
        if wf[0].exists() {
            tick();
            std::fs::write(&wf[0], &wgood).unwrap();
        }
    }
    drop((t, u));
    engine.close().unwrap();
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// 2d: concurrent scans while a file is swapped between damaged and good, by rename (atomic:
/// only the check-then-open window is open) and in place. Every scan must be exact or
/// CorruptFile naming the file.
#[test]
fn p39_d_concurrent_scans_while_a_file_is_swapped() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg()).unwrap();
    let (t, files, want) = two_file_table(&engine, dir.path(), 4_000);
    let f = files[1].clone();
    let good = std::fs::read(&f).unwrap();
    let bad = flip_at(&good, good.len() / 2);
    let mut report = Vec::new();
    let mut wrong_all = Vec::new();
    for in_place in [false, true] {
        let stop = AtomicBool::new(false);
        let results: std::sync::Mutex<Vec<Outcome>> = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        let o = scan_outcome(&t);
                        results.lock().unwrap().push(o);
                    }
                });
            }
            for _ in 0..30 {
                for bytes in [&bad, &good] {
                    tick();
                    if in_place {
                        std::fs::write(&f, bytes).unwrap();
                    } else {
                        replace_by_rename(&f, bytes);
                    }
                }
            }
            stop.store(true, Ordering::Relaxed);
        });
        let results = results.into_inner().unwrap();
        let exact = results.iter().filter(|o| **o == want).count();
        let corrupt = results.iter().filter(|o| matches!(o, Outcome::Corrupt(p, _) if *p == f)).count();
        let wrong: Vec<&Outcome> = results.iter().filter(|o| **o != want && !matches!(o, Outcome::Corrupt(p, _) if *p == f)).collect();
        report.push(format!("in_place={in_place}: {} scans: {exact} exact, {corrupt} CorruptFile, {} other", results.len(), wrong.len()));
        for w in wrong.iter().take(5) {
            wrong_all.push(format!("in_place={in_place}: {w:?}"));
        }
        tick();
        let back = scan_outcome(&t);
        if back != want {
            wrong_all.push(format!("in_place={in_place}: after the swaps, good bytes: {back:?}"));
        }
    }
    eprintln!("probe39 d: {}", report.join("; "));
    assert!(wrong_all.is_empty(), "{}\n{}", report.join("\n"), wrong_all.join("\n"));
}

/// 2d: scan_partitions while damaged, and its bounds.
#[test]
fn p39_d2_scan_partitions_bounds_and_damage() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg()).unwrap();
    let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
    let all = rows(0, 6_000);
    for c in all.chunks(2_000) {
        t.insert(&composite_batch(c)).unwrap();
        t.flush().unwrap();
    }
    t.insert(&composite_batch(&rows(100_000, 77))).unwrap(); // in the delta
    let total = 6_077;
    let mut failures = Vec::new();
    for n in [0usize, 1, 2, 3, 7, 64] {
        match t.scan_partitions(ScanOptions::default(), n) {
            Ok(parts) => {
                let mut rows_seen = 0;
                for p in parts {
                    match drain(p) {
                        Outcome::Rows(r, _, _) => rows_seen += r,
                        other => failures.push(format!("partitions {n}: {other:?}")),
                    }
                }
                if rows_seen != total {
                    failures.push(format!("partitions {n}: {rows_seen} rows, expected {total}"));
                }
            }
            Err(e) => failures.push(format!("scan_partitions({n}): {e:?}")),
        }
    }
    match t.scan_partitions(ScanOptions::default(), gritdb::MAX_THREADS + 1) {
        Err(Error::Config(_)) => {}
        other => failures.push(format!("MAX_THREADS+1: {:?}", other.map(|v| v.len()))),
    }
    let files = parquet_files(&dir_of_table(dir.path(), "t"));
    let good = std::fs::read(&files[1]).unwrap();
    tick();
    std::fs::write(&files[1], flip_at(&good, good.len() / 2)).unwrap();
    let parts = t.scan_partitions(ScanOptions::default(), 3).unwrap();
    let outs: Vec<Outcome> = parts.into_iter().map(drain).collect();
    eprintln!("probe39 d2: partitions while damaged: {outs:?}");
    let corrupt = outs.iter().filter(|o| matches!(o, Outcome::Corrupt(p, _) if *p == files[1])).count();
    if corrupt == 0 || outs.iter().any(|o| matches!(o, Outcome::Other(_))) {
        failures.push(format!("partitions while damaged: {outs:?}"));
    }
    tick();
    std::fs::write(&files[1], &good).unwrap();
    let parts = t.scan_partitions(ScanOptions::default(), 3).unwrap();
    let n: usize = parts
        .into_iter()
        .map(|p| match drain(p) {
            Outcome::Rows(r, _, _) => r,
            _ => 0,
        })
        .sum();
    if n != total {
        failures.push(format!("partitions restored: {n}"));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// 2d: bad input to writes: every case a typed error (or a documented Ok), table unchanged.
#[test]
fn p39_e_bad_input_to_writes() {
    use arrow::array::{ArrayRef, Int32Array, Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg()).unwrap();
    let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
    let base = rows(0, 100);
    t.insert(&composite_batch(&base)).unwrap();
    t.flush().unwrap();
    let want = Outcome::Rows(100, sum_of(&base), 0);
    let mut failures = Vec::new();
    let mut seen = Vec::new();
    let mut check = |what: &str, r: gritdb::Result<usize>, ok: fn(&gritdb::Result<usize>) -> bool| {
        seen.push(format!("{what}: {r:?}"));
        if !ok(&r) {
            failures.push(format!("{what}: unexpected {r:?}"));
        }
    };
    // Duplicate keys in one batch.
    let dup = composite_batch(&[((500, 0), (Some(1), None)), ((501, 0), (Some(2), None)), ((500, 0), (Some(3), None))]);
    check("insert dup in batch", t.insert(&dup), |r| matches!(r, Err(Error::DuplicateKey { first: 0, row: 2, .. })));
    check("upsert dup in batch", t.upsert(&dup), |r| matches!(r, Err(Error::DuplicateKey { .. })));
    check("update dup in batch", t.update(&dup), Result::is_err);
    check("delete dup keys in batch", t.delete(&composite_keys(&[(1, 0), (1, 0)])), |r| r.is_err() || matches!(r, Ok(1)));
    // Empty batches.
    let empty = composite_batch(&[]);
    check("insert empty", t.insert(&empty), |r| matches!(r, Ok(0)));
    check("upsert empty", t.upsert(&empty), |r| matches!(r, Ok(0)));
    check("update empty", t.update(&empty), |r| matches!(r, Ok(0)));
    check("delete empty", t.delete(&composite_keys(&[])), |r| matches!(r, Ok(0)));
    // A zero-row batch of another schema.
    let other = RecordBatch::new_empty(Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, false)])));
    check("insert empty wrong schema", t.insert(&other), |r| matches!(r, Err(Error::Input(_))));
    // A batch whose schema marks the key nullable but holds no nulls (same types).
    let sch = Arc::new(Schema::new(vec![
        Field::new("k1", DataType::Int64, true),
        Field::new("k2", DataType::Int32, true),
        Field::new("v", DataType::Int64, true),
        Field::new("s", DataType::Utf8, true),
    ]));
    let nb = RecordBatch::try_new(
        sch.clone(),
        vec![
            Arc::new(Int64Array::from(vec![900])) as ArrayRef,
            Arc::new(Int32Array::from(vec![0])),
            Arc::new(Int64Array::from(vec![5])),
            Arc::new(StringArray::from(vec!["n"])),
        ],
    )
    .unwrap();
    let r = t.insert(&nb);
    let inserted_nullable = matches!(r, Ok(1));
    check("insert with nullable-typed key fields, no nulls", r, |_| true);
    // Null in a key.
    let nk = RecordBatch::try_new(
        sch,
        vec![
            Arc::new(Int64Array::from(vec![Some(901), Some(902)])) as ArrayRef,
            Arc::new(Int32Array::from(vec![Some(0), None])),
            Arc::new(Int64Array::from(vec![5, 6])),
            Arc::new(StringArray::from(vec!["n", "m"])),
        ],
    )
    .unwrap();
    check("insert null key", t.insert(&nk), |r| matches!(r, Err(Error::Input(gritdb::UnifyError::NullKey { row: 1, .. }))));
    check("upsert null key", t.upsert(&nk), |r| matches!(r, Err(Error::Input(_))));
    // Existing key, missing key.
    check("insert existing key", t.insert(&composite_batch(&[((5, 0), (Some(1), None))])), |r| matches!(r, Err(Error::KeyExists { .. })));
    check("update missing key", t.update(&composite_batch(&[((777_777, 0), (Some(1), None))])), |r| matches!(r, Err(Error::KeyNotFound { .. })));
    check("delete missing key", t.delete(&composite_keys(&[(777_777, 0)])), |r| r.is_ok() || matches!(r, Err(Error::KeyNotFound { .. })));
    // Batch mixing a new and an existing key: rejected whole.
    check("insert new + existing", t.insert(&composite_batch(&[((800, 0), (Some(1), None)), ((6, 0), (Some(1), None))])), |r| {
        matches!(r, Err(Error::KeyExists { .. }))
    });
    // Sliced batch (offset) with a duplicate only outside the slice: accepted.
    let big = composite_batch(&[((1_000, 0), (Some(1), None)), ((1_001, 0), (Some(2), None)), ((1_000, 0), (Some(3), None))]);
    check("insert slice without the dup", t.insert(&big.slice(0, 2)), |r| matches!(r, Ok(2)));
    eprintln!("probe39 e:\n  {}", seen.join("\n  "));
    let mut expect_rows = base.clone();
    expect_rows.push(((1_000, 0), (Some(1), None)));
    expect_rows.push(((1_001, 0), (Some(2), None)));
    // "delete dup keys in batch" deleted key (1, 0) (Ok(1)): its row (v = 8) is gone.
    expect_rows.retain(|r| r.0 != (1, 0));
    let mut n = expect_rows.len();
    let mut s = sum_of(&expect_rows);
    if inserted_nullable {
        n += 1;
        s += 5;
    }
    let got = scan_outcome(&t);
    if got != Outcome::Rows(n, s, 0) {
        failures.push(format!("table after bad input: {got:?}, expected {:?}", Outcome::Rows(n, s, 0)));
    }
    let _ = want;
    t.flush().unwrap();
    drop(t);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), cfg()).unwrap();
    let got = scan_outcome(&engine.table("t").unwrap());
    if got != Outcome::Rows(n, s, 0) {
        failures.push(format!("reopened after bad input: {got:?}"));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// 2d/3: memory limit changed at run time, and every category back to its baseline after the
/// tables (one of them damaged, scans failing on it) are dropped.
#[test]
fn p39_f_runtime_limit_and_memory_back_to_baseline() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(32 << 20)).unwrap();
    let mut failures = Vec::new();
    let baseline = settled(&engine);
    match engine.set_memory_limit(64 << 10) {
        Err(Error::Config(m)) => eprintln!("probe39 f: 64 KiB limit: Config({m})"),
        other => failures.push(format!("64 KiB limit: {other:?}")),
    }
    let tables: Vec<gritdb::Table> = (0..3).map(|i| engine.create_table(&format!("m{i}"), composite_schema(), &["k1", "k2"]).unwrap()).collect();
    for (i, t) in tables.iter().enumerate() {
        for c in 0..3 {
            t.insert(&composite_batch(&rows(i as i64 * 1_000_000 + c * 5_000, 5_000))).unwrap();
            t.flush().unwrap();
        }
        t.insert(&composite_batch(&rows(i as i64 * 1_000_000 + 900_000, 3_000))).unwrap(); // unflushed
    }
    let used = engine.memory().used();
    eprintln!("probe39 f: used with 3 tables: {used}");
    // Lower below what is held (the unflushed deltas can be flushed, the key index cannot).
    let low = 256 << 10;
    match engine.set_memory_limit(low) {
        Ok(()) => eprintln!("probe39 f: lowered to 256 KiB: Ok (used now {})", engine.memory().used()),
        Err(e) => {
            eprintln!("probe39 f: lowered to 256 KiB: {e:?}");
            if !matches!(e, Error::MemoryLimit { .. }) {
                failures.push(format!("lowering: untyped {e:?}"));
            }
            if engine.memory().limit() != 32 << 20 {
                failures.push(format!("limit after a refused lowering: {}", engine.memory().limit()));
            }
        }
    }
    engine.set_memory_limit(48 << 20).unwrap();
    // Damage one table's file, scan it a few times (errors), concurrently scan the others.
    let f = parquet_files(&dir_of_table(dir.path(), "m1")).remove(0);
    let good = std::fs::read(&f).unwrap();
    tick();
    std::fs::write(&f, flip_at(&good, good.len() / 2)).unwrap();
    std::thread::scope(|s| {
        for t in &tables {
            s.spawn(move || {
                for _ in 0..5 {
                    let _ = scan_outcome(t);
                    let mut sc = t.scan(ScanOptions::default().batch_rows(64)).unwrap();
                    let _ = sc.next(); // dropped half-read
                }
            });
        }
    });
    let o = scan_outcome(&tables[1]);
    if !matches!(o, Outcome::Corrupt(..)) {
        failures.push(format!("m1 damaged: {o:?}"));
    }
    let mid = settled(&engine);
    eprintln!("probe39 f: settled with tables: {mid:?}");
    for t in &tables {
        let name = t.name().to_owned();
        engine.drop_table(&name).unwrap();
    }
    drop(tables);
    let after = settled(&engine);
    let diffs: Vec<String> = baseline.iter().zip(&after).filter(|(a, b)| a.1 != b.1).map(|(a, b)| format!("{:?}: {} -> {}", a.0, a.1, b.1)).collect();
    eprintln!("probe39 f: baseline {baseline:?}\n  after drop {after:?}");
    if !diffs.is_empty() {
        failures.push(format!("categories not back to baseline after drop: {}", diffs.join(", ")));
    }
    if !engine.degraded_tables().is_empty() {
        failures.push(format!("degraded after dropping all: {:?}", engine.degraded_tables()));
    }
    engine.close().unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// 2b': a data file missing (moved away): gritdb_tables lists the table with `rows` null, and
/// docs/sql.md says `damage` then says why.
#[cfg(feature = "sql")]
#[test]
fn p39_b2_gritdb_tables_with_a_missing_file() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg()).unwrap();
    let t = engine.create_table("m", composite_schema(), &["k1", "k2"]).unwrap();
    t.insert(&composite_batch(&rows(0, 1_000))).unwrap();
    t.flush().unwrap();
    let f = parquet_files(&dir_of_table(dir.path(), "m")).remove(0);
    let aside = f.with_extension("aside");
    std::fs::rename(&f, &aside).unwrap();
    let mut failures = Vec::new();
    match t.scan(ScanOptions::default()).unwrap().collect::<gritdb::Result<Vec<RecordBatch>>>() {
        Err(Error::Storage(StorageError::MissingFile { .. })) => {}
        other => failures.push(format!("scan of missing file: {:?}", other.map(|b| b.len()))),
    }
    for i in 0..2 {
        let b = engine.sql("SELECT name, rows, damage, last_flush_error FROM gritdb_tables").unwrap();
        let b = arrow::compute::concat_batches(&b[0].schema(), &b).unwrap();
        let (rows_null, damage_null, err_null) = (b.column(1).is_null(0), b.column(2).is_null(0), b.column(3).is_null(0));
        eprintln!(
            "probe39 b2: query {i}: rows null {rows_null}, damage null {damage_null}, last_flush_error null {err_null}; degraded {:?}",
            engine.degraded_tables()
        );
        if !rows_null {
            failures.push(format!("query {i}: rows not null with the file missing"));
        }
        if rows_null && damage_null && err_null {
            failures.push(format!("query {i}: rows null and neither damage nor last_flush_error says why (docs/sql.md)"));
        }
    }
    std::fs::rename(&aside, &f).unwrap();
    if t.row_count().unwrap() != 1_000 {
        failures.push("restored".into());
    }
    drop(t);
    engine.close().unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
