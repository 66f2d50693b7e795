//! Staging a flush with keys built off the store's lock (`TableStore::put_keys` →
//! `PutKeyEncoder::encode` → `TableStore::stage_keyed`), and a compaction's key-index set
//! built in `CompactionPlan::execute`: the same index as building them in place, every byte
//! counted under `key_index` while held, nothing changed by a refused stage.

use crate::table::TableStore;
use crate::vfs::{StdFs, Vfs};
use crate::{CompactionOptions, StorageError, WriteOptions};
use arrow_array::{ArrayRef, Int64Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use gritdb_memctl::{Category, ControllerConfig, MemoryController};
use std::sync::Arc;

fn ctl() -> Arc<MemoryController> {
    MemoryController::new(ControllerConfig { memory_limit: Some(256 << 20), ..ControllerConfig::default() }).expect("config")
}

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("v", DataType::Int64, false)]))
}

fn key_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)]))
}

fn rows(keys: impl Iterator<Item = i64> + Clone) -> RecordBatch {
    let cols: Vec<ArrayRef> = vec![Arc::new(Int64Array::from_iter_values(keys.clone())), Arc::new(Int64Array::from_iter_values(keys.map(|k| k * 10)))];
    RecordBatch::try_new(schema(), cols).expect("batch")
}

fn no_deletes() -> RecordBatch {
    RecordBatch::new_empty(key_schema())
}

fn store(dir: &std::path::Path, ctl: &Arc<MemoryController>, name: &str) -> TableStore {
    let vfs: Arc<dyn Vfs> = Arc::new(StdFs);
    TableStore::create(vfs, &dir.join(name), name, schema(), &[0], ctl, None).expect("create")
}

fn key_index(ctl: &MemoryController) -> usize {
    ctl.category_bytes(Category::KeyIndex)
}

/// Keys encoded off the store give the index `stage` gives: the same rows, bytes and
/// lookups, older versions in deletion vectors. The encoded keys are counted under
/// `key_index` from `encode` on, and dropping them unstaged gives every byte back.
#[test]
fn keys_built_off_the_store_stage_as_in_place() {
    let dir = tempfile::tempdir().expect("dir");
    let (c1, c2) = (ctl(), ctl());
    let (mut a, mut b) = (store(dir.path(), &c1, "a"), store(dir.path(), &c2, "b"));
    let first = [rows(0..1000), rows(1000..5000)];
    let second = [rows((500..1500).map(|k| k * 2))];
    for (i, puts) in [&first[..], &second[..]].into_iter().enumerate() {
        a.stage(puts, &no_deletes(), i as u64 + 1).expect("stage");
        let before = key_index(&c2);
        let keyed = b.put_keys().encode(puts).expect("encode");
        assert!(key_index(&c2) > before, "the built key set is counted before it is staged");
        b.stage_keyed(keyed, &no_deletes(), i as u64 + 1).expect("stage_keyed");
        assert_eq!((b.index().rows(), b.index().bytes()), (a.index().rows(), a.index().bytes()));
        assert_eq!(key_index(&c2), key_index(&c1));
    }
    assert_eq!(b.index().rows(), 6000);
    for k in [0i64, 999, 1000, 2998, 3000, 4999] {
        let key = crate::index::encode_keys(&b.conv, &rows([k].into_iter()), &[0]).expect("key");
        let key = key.row(0);
        assert_eq!(b.find_key(key.as_ref()), a.find_key(key.as_ref()), "key {k}");
        assert!(b.find_key(key.as_ref()).is_some(), "key {k}");
    }
    // Keys 1000, 1002, ..., 2998 of the first flush are older versions now: 1000 rows.
    let deleted = |s: &TableStore| s.files.values().map(|f| f.dv_live.len()).sum::<u64>();
    assert_eq!((deleted(&a), deleted(&b)), (1000, 1000));

    let before = key_index(&c2);
    let keyed = b.put_keys().encode(&[rows(10_000..20_000)]).expect("encode");
    // The built set, counted while it waits for the lock: 8 B a key, a 64-byte bloom block
    // per 51 keys (10 bits a key: 196 blocks) and a 16-byte fence per 64 keys (157). The
    // encoded keys are no longer kept for `stage_keyed`'s lookups (it looks the set's own
    // keys up): they were 9 B a key more plus their offsets.
    assert_eq!(key_index(&c2) - before, 10_000 * 8 + 196 * 64 + 157 * 16, "the set alone is held");
    drop(keyed);
    assert_eq!(key_index(&c2), before, "dropped unstaged: every byte back");
}

/// Refused stages change nothing: keys that are not ascending (`CorruptFile`, naming the
/// file the flush would have written) and keys encoded for another table's schema.
#[test]
fn a_refused_keyed_stage_changes_nothing() {
    let dir = tempfile::tempdir().expect("dir");
    let c = ctl();
    let mut s = store(dir.path(), &c, "t");
    s.stage(&[rows(0..100)], &no_deletes(), 1).expect("stage");
    let before = (s.index().rows(), s.index().bytes(), key_index(&c), s.files.len(), s.staged_count());
    let unsorted = s.put_keys().encode(&[rows([5i64, 3, 200].into_iter())]).expect("encode");
    match s.stage_keyed(unsorted, &no_deletes(), 2) {
        Err(StorageError::CorruptFile { path, detail }) => {
            assert!(path.ends_with(crate::table::file_name(2)), "{}", path.display());
            assert!(detail.contains("ascending"), "{detail}");
        }
        other => panic!("expected CorruptFile, got {other:?}"),
    }
    assert_eq!(before, (s.index().rows(), s.index().bytes(), key_index(&c), s.files.len(), s.staged_count()));

    let other_schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("w", DataType::Utf8, false)]));
    let vfs: Arc<dyn Vfs> = Arc::new(StdFs);
    let other = TableStore::create(vfs, &dir.path().join("o"), "o", other_schema.clone(), &[0], &c, None).expect("create");
    let foreign = RecordBatch::try_new(
        other_schema,
        vec![Arc::new(Int64Array::from_iter_values(500..600)), Arc::new(arrow_array::StringArray::from_iter_values((0..100).map(|i| i.to_string())))],
    )
    .expect("batch");
    let keyed = other.put_keys().encode(&[foreign]).expect("encode");
    assert!(matches!(s.stage_keyed(keyed, &no_deletes(), 2), Err(StorageError::Arrow(_))));
    assert_eq!(before, (s.index().rows(), s.index().bytes(), key_index(&c), s.files.len(), s.staged_count()));
}

/// A compaction's new key set is built (and counted under `key_index`) in `execute`, before
/// the state lock; installed, the index holds exactly the live rows; an abandoned plan gives
/// its key set's bytes back.
#[test]
fn compaction_builds_its_key_set_in_execute() {
    let dir = tempfile::tempdir().expect("dir");
    let c = ctl();
    let mut s = store(dir.path(), &c, "t");
    let opts = CompactionOptions { small_file_rows: 1 << 20, small_files_trigger: 2, ..CompactionOptions::default() };
    let wopts = WriteOptions::default();
    for (i, (from, to)) in [(0, 3000), (3000, 6000)].into_iter().enumerate() {
        s.stage(&[rows(from..to)], &no_deletes(), i as u64 + 1).expect("stage");
        let mut plan = s.plan_commit().expect("staged");
        plan.execute(&wopts, &c, None).expect("write");
        s.finish_commit(plan);
    }
    let base = key_index(&c);
    for abandon in [true, false] {
        let mut plan = s.plan_compaction(&opts).expect("two small files");
        plan.execute(&wopts, &c, None).expect("execute");
        assert!(key_index(&c) >= base + 6000 * 8, "the new file's 6,000 keys are counted after execute");
        if abandon {
            plan.abandon();
            drop(plan);
            assert_eq!(key_index(&c), base, "abandoned: its key set's bytes are back");
            continue;
        }
        s.install_compaction(&mut plan).expect("install");
        plan.commit().expect("commit");
        s.finish_compaction(plan);
    }
    assert_eq!((s.files.len(), s.index().rows()), (1, 6000));
    assert_eq!(key_index(&c), s.index().bytes());
}

/// File ids are `u32`s and were incremented unchecked: after 2^32 - 1 flushes and compactions
/// of one table the next id wrapped to 0 and on to the ids (and file names) of live files.
/// The last id is never handed out: staging a file then is `FileIdsExhausted`, nothing
/// changes, and no compaction is planned (with one id left, two small files are); a stage
/// without puts (deletes only) still works.
#[test]
fn file_ids_never_wrap() {
    let dir = tempfile::tempdir().expect("dir");
    let ctl = ctl();
    let mut s = store(dir.path(), &ctl, "t");
    let opts = CompactionOptions { small_file_rows: 1 << 20, small_files_trigger: 2, ..CompactionOptions::default() };
    s.next_file_id = u32::MAX - 2;
    for (i, keys) in [0..10, 10..20].into_iter().enumerate() {
        s.stage(&[rows(keys)], &no_deletes(), i as u64 + 1).expect("stage");
        let mut plan = s.plan_commit().expect("staged");
        plan.execute(&WriteOptions::default(), &ctl, None).expect("write");
        s.finish_commit(plan);
    }
    assert_eq!(s.next_file_id, u32::MAX);
    assert!(s.plan_compaction(&opts).is_none(), "no id for the merged file");
    let (rows_before, bytes_before) = (s.index().rows(), s.index().bytes());
    match s.stage(&[rows(20..30)], &no_deletes(), 3) {
        Err(StorageError::FileIdsExhausted { table }) => assert_eq!(table, "t"),
        other => panic!("{other:?}"),
    }
    assert_eq!((s.index().rows(), s.index().bytes(), s.next_file_id), (rows_before, bytes_before, u32::MAX));
    let deletes = RecordBatch::try_new(key_schema(), vec![Arc::new(Int64Array::from(vec![3]))]).expect("keys");
    s.stage(&[], &deletes, 4).expect("a stage without puts writes no file");
    // One id back (as if it were free): the same two files are merged.
    let mut s2 = store(dir.path(), &ctl, "u");
    s2.next_file_id = u32::MAX - 3;
    for (i, keys) in [0..10, 10..20].into_iter().enumerate() {
        s2.stage(&[rows(keys)], &no_deletes(), i as u64 + 1).expect("stage");
        let mut plan = s2.plan_commit().expect("staged");
        plan.execute(&WriteOptions::default(), &ctl, None).expect("write");
        s2.finish_commit(plan);
    }
    assert!(s2.plan_compaction(&opts).is_some(), "u32::MAX - 1 is the last id handed out");
}

/// Files record the bytes of their rows as Arrow arrays (`decoded_bytes`: two `Int64`
/// columns, 16 bytes a row), and a merge is planned by those, not by the files' bytes: two
/// 3,000-row files (96,000 decoded bytes together, a fraction of that on disk) are merged
/// when a tenth of the limit holds their decoded rows, and not when only their file bytes
/// fit in it. A manifest entry without the figure (written before it existed) counts
/// `LEGACY_DECODED_RATIO` times its file bytes.
#[test]
fn compaction_is_planned_by_the_files_decoded_bytes() {
    let dir = tempfile::tempdir().expect("dir");
    let c = ctl();
    let mut s = store(dir.path(), &c, "t");
    let opts = CompactionOptions { small_file_rows: 1 << 20, small_files_trigger: 2, ..CompactionOptions::default() };
    for (i, (from, to)) in [(0, 3000), (3000, 6000)].into_iter().enumerate() {
        s.stage(&[rows(from..to)], &no_deletes(), i as u64 + 1).expect("stage");
        let mut plan = s.plan_commit().expect("staged");
        plan.execute(&WriteOptions::default(), &c, None).expect("write");
        s.finish_commit(plan);
    }
    let metas: Vec<crate::FileMeta> = s.files.values().map(|f| f.meta.clone()).collect();
    assert_eq!(metas.iter().map(|m| m.decoded_bytes).collect::<Vec<_>>(), [Some(48_000), Some(48_000)]);
    let on_disk: u64 = metas.iter().map(|m| m.bytes).sum();
    assert!(on_disk * 10 < 900_000, "the files' bytes fit a tenth of 900,000: {on_disk}");
    // The limit must hold what the store already counts; a tenth of it is the budget.
    c.set_limit(900_000).expect("limit");
    assert!(s.plan_compaction(&opts).is_none(), "96,000 decoded bytes do not fit 90,000");
    c.set_limit(960_000).expect("limit");
    let plan = s.plan_compaction(&opts).expect("96,000 decoded bytes fit 96,000");
    assert_eq!(plan.inputs().len(), 2);
    plan.abandon();
    drop(plan);
    let legacy = crate::FileMeta { decoded_bytes: None, ..metas[0].clone() };
    assert_eq!(legacy.decoded_estimate(), metas[0].bytes * crate::LEGACY_DECODED_RATIO);
    assert_eq!(metas[0].decoded_estimate(), 48_000);
}

/// The names a table directory's files get are recognised exactly as written (`file_name`, a
/// deletion vector's `f<id:06>.dv<version>`, `write_atomic`'s `.tmp`); near misses are not.
#[test]
fn table_file_names_are_recognised_exactly() {
    use crate::is_table_file_name;
    for good in [
        crate::table::file_name(1),
        crate::table::file_name(u32::MAX),
        format!("{}.tmp", crate::table::file_name(7)),
        "f000001.dv2".to_owned(),
        "f000001.dv0".to_owned(),
        "f4294967295.dv18446744073709551615".to_owned(),
        "f000012.dv3.tmp".to_owned(),
        crate::MANIFEST_FILE.to_owned(),
        format!("{}.tmp", crate::MANIFEST_FILE),
    ] {
        assert!(is_table_file_name(&good), "{good}");
    }
    for bad in [
        "f1.parquet",
        "f0000001.parquet",
        "f4294967296.parquet",
        "f00000a.parquet",
        "f000001.parquet.bak",
        "f000001.dv02",
        "f000001.dv",
        "f000001.dv+2",
        "F000001.parquet",
        "manifest.json.bak",
        "notes.txt",
        ".tmp",
        "f.parquet",
    ] {
        assert!(!is_table_file_name(bad), "{bad}");
    }
}

/// Stages `puts` and `deletes` and commits them (a file when there are puts).
fn flush(s: &mut TableStore, c: &Arc<MemoryController>, puts: &[RecordBatch], deletes: &RecordBatch, seq: u64) {
    s.stage(puts, deletes, seq).expect("stage");
    let mut plan = s.plan_commit().expect("staged");
    plan.execute(&WriteOptions::default(), c, None).expect("write");
    s.finish_commit(plan);
}

fn key_batch(keys: impl Iterator<Item = i64>) -> RecordBatch {
    RecordBatch::try_new(key_schema(), vec![Arc::new(Int64Array::from_iter_values(keys))]).expect("keys")
}

fn parquet_files(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir).expect("dir").filter(|e| e.as_ref().is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".parquet"))).count()
}

/// A file whose every row is deleted is dropped by a compaction that reads and writes no data
/// file, and every such file goes in one: before, each was rewritten as an empty file, one for
/// one, so under steady upserts of a bounded key set the files (and their `metadata`) grew
/// without bound. The manifest read back names only the files with live rows, and a store
/// opened from it finds exactly the live keys.
#[test]
fn files_whose_rows_are_all_deleted_are_dropped_without_a_new_file() {
    let dir = tempfile::tempdir().expect("dir");
    let c = ctl();
    let mut s = store(dir.path(), &c, "t");
    for (i, (from, to)) in [(0, 1000), (1000, 2000), (2000, 3000)].into_iter().enumerate() {
        flush(&mut s, &c, &[rows(from..to)], &no_deletes(), i as u64 + 1);
    }
    // All of the first two files' rows deleted, and all but ten of the third's.
    flush(&mut s, &c, &[], &key_batch((0..2000).chain(2010..3000)), 4);
    assert_eq!((s.files.len(), parquet_files(&dir.path().join("t"))), (3, 3));
    let mut plan = s.plan_compaction(&CompactionOptions::default()).expect("two dead files");
    let dead: Vec<u32> = s.files.values().filter(|f| f.meta.rows == f.dv_live.len()).map(|f| f.meta.id).collect();
    assert_eq!((plan.inputs(), dead.len()), (dead, 2));
    plan.execute(&WriteOptions::default(), &c, None).expect("execute");
    s.install_compaction(&mut plan).expect("install");
    plan.commit().expect("commit");
    assert_eq!(s.finish_compaction(plan), 0, "no row rewritten");
    assert_eq!((s.files.len(), s.index().rows()), (1, 1000), "one file left, its 1,000 rows indexed (10 live)");
    assert_eq!(parquet_files(&dir.path().join("t")), 1, "no new file written, both inputs removed");
    let manifest = TableStore::read_manifest(&dir.path().join("t")).expect("manifest");
    assert_eq!(manifest.files.len(), 1);
    let c2 = ctl();
    let reopened = TableStore::open(Arc::new(StdFs), &dir.path().join("t"), &c2, None, manifest).expect("open");
    let conv = crate::index::key_converter(&schema(), &[0]).expect("converter");
    let live = (0..3000i64).filter(|k| {
        let keys = crate::index::encode_keys(&conv, &key_batch(std::iter::once(*k)), &[0]).expect("encode");
        reopened.find_key(keys.row(0).as_ref()).is_some()
    });
    assert_eq!(live.collect::<Vec<_>>(), (2000..2010).collect::<Vec<_>>());
}

/// A merge is planned by its inputs' live rows' share of their decoded bytes: files whose rows
/// were mostly deleted (upserted again since) are merged by what a merge holds of them, not by
/// their whole rows. Four 3,000-row files (48,000 decoded bytes each), three of them with ten
/// live rows: at a budget of 90,000 bytes (a tenth of 900,000) the two such files beside the
/// one rewritten alone and the whole file merge (48,320 bytes); by whole bytes no two fit.
#[test]
fn merges_are_planned_by_the_live_rows_decoded_bytes() {
    let dir = tempfile::tempdir().expect("dir");
    let c = ctl();
    let mut s = store(dir.path(), &c, "t");
    for i in 0..4i64 {
        flush(&mut s, &c, &[rows(i * 3000..(i + 1) * 3000)], &no_deletes(), i as u64 + 1);
    }
    // Files 2-4 keep ten rows each, but the third nine: it is the worst.
    flush(&mut s, &c, &[], &key_batch((3010..6000).chain(6011..9000).chain(9010..12000).chain([6000, 6001])), 5);
    c.set_limit(900_000).expect("limit");
    let opts = CompactionOptions { small_files_trigger: 3, ..CompactionOptions::default() };
    let mut plan = s.plan_compaction(&opts).expect("a merge");
    let mut inputs = plan.inputs();
    inputs.sort_unstable();
    let ids: Vec<u32> = s.files.keys().copied().collect();
    assert_eq!(inputs, [ids[0], ids[1], ids[3]], "the worst file (9 of 3,000 live) is not among them");
    plan.execute(&WriteOptions::default(), &c, None).expect("execute");
    s.install_compaction(&mut plan).expect("install");
    plan.commit().expect("commit");
    assert_eq!(s.finish_compaction(plan), 3020);
    assert_eq!(s.files.len(), 2);
}
