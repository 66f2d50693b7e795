//! Data-file writes on one thread (`ArrowWriter`) and on several (`ParallelWriter`): the same
//! bytes on disk, row groups cut the same way, and on a failed sink, a cancellation or a
//! failing batch stream no file left and no writer buffer still counted.

use super::*;
use crate::bytes::range_bytes;
use crate::vfs::{FaultFs, StdFs};
use arrow_array::builder::{Int32Builder, ListBuilder};
use arrow_array::{ArrayRef, Decimal128Array, Int32Array, Int64Array, StringArray, StructArray};
use arrow_schema::{DataType, Field, Schema};
use gritdb_memctl::ControllerConfig;

fn ctl() -> Arc<MemoryController> {
    MemoryController::new(ControllerConfig { memory_limit: Some(256 << 20), ..ControllerConfig::default() }).unwrap()
}

/// Flat and nested columns (a struct and a list give fields with several or nested leaves),
/// nulls in some.
fn schema() -> arrow_schema::SchemaRef {
    let inner = vec![Field::new("a", DataType::Int32, true), Field::new("b", DataType::Utf8, true)];
    Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, false),
        Field::new("s", DataType::Utf8, true),
        Field::new("d", DataType::Decimal128(15, 2), false),
        Field::new("st", DataType::Struct(inner.into()), true),
        Field::new("l", DataType::List(Arc::new(Field::new("item", DataType::Int32, true))), true),
    ]))
}

fn batch(from: i64, rows: i64) -> RecordBatch {
    let keys: Vec<i64> = (from..from + rows).collect();
    let text: StringArray = keys.iter().map(|k| (k % 7 != 0).then(|| format!("comment {k} {}", "x".repeat((k % 40) as usize)))).collect();
    let dec = Decimal128Array::from_iter_values(keys.iter().map(|k| i128::from(*k) * 3)).with_precision_and_scale(15, 2).unwrap();
    let ints: Int32Array = keys.iter().map(|k| (k % 3 != 0).then_some(*k as i32)).collect();
    let strs: StringArray = keys.iter().map(|k| Some(format!("{}", k % 11))).collect();
    let nested = StructArray::from(vec![
        (Arc::new(Field::new("a", DataType::Int32, true)), Arc::new(ints) as ArrayRef),
        (Arc::new(Field::new("b", DataType::Utf8, true)), Arc::new(strs) as ArrayRef),
    ]);
    let mut list = ListBuilder::new(Int32Builder::new());
    for k in &keys {
        if k % 5 == 0 {
            list.append_null();
        } else {
            for v in 0..(k % 4) {
                list.values().append_value(v as i32);
            }
            list.append(true);
        }
    }
    RecordBatch::try_new(schema(), vec![Arc::new(Int64Array::from(keys)), Arc::new(text), Arc::new(dec), Arc::new(nested), Arc::new(list.finish())]).unwrap()
}

fn batches() -> Vec<RecordBatch> {
    vec![batch(0, 5_000), batch(5_000, 3_333), batch(8_333, 6_667)]
}

fn opts(threads: usize) -> WriteOptions {
    WriteOptions { write_batch_rows: 700, row_group_rows: 4_000, encode_threads: threads, ..WriteOptions::default() }
}

/// Rows per row group of a data file.
fn row_groups(path: &Path) -> Vec<i64> {
    let r = ParquetRecordBatchReaderBuilder::try_new(fs::File::open(path).unwrap()).unwrap();
    r.metadata().row_groups().iter().map(parquet::file::metadata::RowGroupMetaData::num_rows).collect()
}

fn read_all(path: &Path) -> Vec<RecordBatch> {
    read_file(path, None, Arc::new(RoaringBitmap::new()), 1 << 20).unwrap().collect::<Result<_, _>>().unwrap()
}

#[test]
fn every_thread_count_writes_the_same_file() {
    let dir = tempfile::tempdir().unwrap();
    let ctl = ctl();
    let input = batches();
    let mut files = Vec::new();
    for threads in [1, 2, 3, 8] {
        let name = format!("t{threads}.parquet");
        let written = write_data_file(&StdFs, dir.path(), &name, &input, &opts(threads), &ctl, None).unwrap();
        assert_eq!(ctl.category_bytes(Category::WriteBuffers), 0, "{threads} threads: writer buffers released");
        let path = dir.path().join(&name);
        assert_eq!(fs::metadata(&path).unwrap().len(), written.bytes);
        // The checksum taken from the bytes as written is the file's, on every thread count.
        assert_eq!(file_crc32(&path).unwrap(), (written.crc32, written.bytes), "{threads} threads");
        assert_eq!(written.crc32, crc32fast::hash(&fs::read(&path).unwrap()));
        files.push((threads, fs::read(&path).unwrap(), path));
    }
    // Cut by rows (4,000 per group) across input batches of 5,000, 3,333 and 6,667 rows.
    assert_eq!(row_groups(&files[0].2), vec![4_000, 4_000, 4_000, 3_000]);
    let want = arrow_select::concat::concat_batches(&schema(), &input).unwrap();
    for (threads, bytes, path) in &files {
        assert_eq!(bytes, &files[0].1, "{threads} threads: the file is byte for byte the one-thread file");
        let got = arrow_select::concat::concat_batches(&schema(), &read_all(path)).unwrap();
        assert_eq!(got, want, "{threads} threads: rows read back");
    }
}

#[test]
fn row_groups_are_cut_by_bytes_on_every_thread_count() {
    let dir = tempfile::tempdir().unwrap();
    let ctl = ctl();
    let input = batches();
    let mut cuts = Vec::new();
    for threads in [1, 2] {
        let o = WriteOptions { row_group_bytes: 96 << 10, row_group_rows: 1 << 20, ..opts(threads) };
        let name = format!("b{threads}.parquet");
        write_data_file(&StdFs, dir.path(), &name, &input, &o, &ctl, None).unwrap();
        let groups = row_groups(&dir.path().join(&name));
        assert!(groups.len() > 2, "{threads} threads: {groups:?}");
        assert_eq!(groups.iter().sum::<i64>(), 15_000);
        // The writer's buffered bytes stay near the cut: the peak is under cut + a few steps.
        assert!(ctl.category_peak(Category::WriteBuffers) < 1 << 20, "{}", ctl.category_peak(Category::WriteBuffers));
        cuts.push(groups);
    }
    assert_eq!(cuts[0], cuts[1]);
}

/// Files left in `dir` (a failed write leaves none, not even its temp file).
fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

#[test]
fn a_failing_sink_at_any_step_leaves_nothing_on_every_thread_count() {
    let input = batches();
    for threads in [1, 2] {
        let dir = tempfile::tempdir().unwrap();
        let ctl = ctl();
        let fs = FaultFs::new();
        let o = opts(threads);
        // How many file-layer steps a whole write takes.
        let before = fs.steps();
        write_data_file(&fs, dir.path(), "ok.parquet", &input, &o, &ctl, None).unwrap();
        let steps = fs.steps() - before;
        assert!(steps > 3, "{steps}");
        fs::remove_file(dir.path().join("ok.parquet")).unwrap();
        for n in 0..steps {
            let errno = if n % 2 == 0 { 28 } else { 5 }; // ENOSPC, EIO
            fs.fail_step(n, errno);
            let err = write_data_file(&fs, dir.path(), "f.parquet", &input, &o, &ctl, None).unwrap_err();
            fs.heal();
            match &err {
                StorageError::Io { source, .. } => assert_eq!(source.raw_os_error(), Some(errno), "{threads} threads, step {n}: {err}"),
                other => panic!("{threads} threads, step {n}: not an I/O error: {other}"),
            }
            // No temp file is left; the only file that may remain is a complete one, renamed
            // before the failing directory fsync (a table ignores files its manifest does not
            // name, and removes them at open).
            let left = listing(dir.path());
            if !left.is_empty() {
                assert_eq!(left, vec!["f.parquet".to_owned()], "{threads} threads, step {n}");
                assert_eq!(row_groups(&dir.path().join("f.parquet")), vec![4_000, 4_000, 4_000, 3_000]);
                fs::remove_file(dir.path().join("f.parquet")).unwrap();
            }
            assert_eq!(ctl.category_bytes(Category::WriteBuffers), 0, "{threads} threads, step {n}");
        }
        write_data_file(&fs, dir.path(), "f.parquet", &input, &o, &ctl, None).unwrap();
        assert_eq!(row_groups(&dir.path().join("f.parquet")), vec![4_000, 4_000, 4_000, 3_000]);
    }
}

#[test]
fn cancel_and_stream_errors_stop_the_parallel_writer() {
    let dir = tempfile::tempdir().unwrap();
    let ctl = ctl();
    let input = batches();
    let schema = schema();
    // Cancelled after the first batch (mid row group: 5,000 rows into the second group).
    let o = opts(2);
    let cancel = o.cancel.clone();
    let stream = input.iter().cloned().enumerate().map(|(i, b)| {
        if i == 1 {
            cancel.cancel();
        }
        Ok(b)
    });
    let err = write_data_file_from(&StdFs, dir.path(), "c.parquet", &schema, stream, &o, &ctl, None).unwrap_err();
    assert!(err.to_string().contains("cancelled"), "{err}");
    assert!(listing(dir.path()).is_empty());
    assert_eq!(ctl.category_bytes(Category::WriteBuffers), 0);
    // A stream that fails part-way (a compaction input that cannot be read).
    let stream = input
        .iter()
        .cloned()
        .map(Ok)
        .take(2)
        .chain(std::iter::once(Err(StorageError::CorruptFile { path: dir.path().join("input"), detail: "unreadable".into() })));
    let err = write_data_file_from(&StdFs, dir.path(), "e.parquet", &schema, stream, &opts(2), &ctl, None).unwrap_err();
    assert!(matches!(err, StorageError::CorruptFile { .. }), "{err}");
    assert!(listing(dir.path()).is_empty());
    assert_eq!(ctl.category_bytes(Category::WriteBuffers), 0);
}

/// When the budget refuses the writer buffers' growth, the row group is cut early instead of
/// the write failing: the file holds every row in more, smaller row groups, on one thread and
/// several, and the buffers are given back. With no room even for one step's buffers the write
/// fails with a memory error and leaves no file.
#[test]
fn refused_buffer_growth_cuts_row_groups_early() {
    let input = batches();
    // Room for about 256 KiB of writer buffers: far less than the file's one-group size.
    let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(4 << 20), chunk_size: 64 << 10, ..ControllerConfig::default() }).unwrap();
    let mut held = Reservation::new(&ctl, Category::Metadata, None);
    held.try_resize((4 << 20) - (256 << 10)).unwrap();
    let want = arrow_select::concat::concat_batches(&schema(), &input).unwrap();
    for threads in [1, 2] {
        let dir = tempfile::tempdir().unwrap();
        let o = WriteOptions { row_group_rows: 1 << 20, ..opts(threads) };
        write_data_file(&StdFs, dir.path(), "f.parquet", &input, &o, &ctl, None).unwrap();
        let groups = row_groups(&dir.path().join("f.parquet"));
        assert!(groups.len() > 2, "{threads} threads: {groups:?}");
        assert_eq!(groups.iter().sum::<i64>(), 15_000);
        let got = arrow_select::concat::concat_batches(&schema(), &read_all(&dir.path().join("f.parquet"))).unwrap();
        assert_eq!(got, want, "{threads} threads");
        assert_eq!(ctl.category_bytes(Category::WriteBuffers), 0);
        // Counted as they exist: past the room by at most what one step's buffers grew beyond
        // its budget (they grow by doubling). Before, the four fixed-width columns' dictionary
        // tables (296 KB) were made in 256 KiB of room and went uncounted; now they are not made.
        assert!(ctl.category_peak(Category::WriteBuffers) <= 2 * (256 << 10), "{}", ctl.category_peak(Category::WriteBuffers));
        assert_eq!(dictionary_pages(&dir.path().join("f.parquet")), 0, "{threads} threads");
    }
    // No room at all: a typed memory error, nothing left behind.
    held.try_resize((4 << 20) - 1024).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let err = write_data_file(&StdFs, dir.path(), "g.parquet", &input, &opts(2), &ctl, None).unwrap_err();
    assert!(matches!(err, StorageError::Memory(_)), "{err}");
    assert!(listing(dir.path()).is_empty());
    assert_eq!(ctl.category_bytes(Category::WriteBuffers), 0);
}

#[test]
fn wide_batches_are_fed_in_steps_under_a_quarter_of_the_row_group_cut() {
    let b = batch(0, 5_000);
    let per_row = crate::batch_bytes(&b).div_ceil(5_000);
    let o = WriteOptions { row_group_bytes: 64 << 10, write_batch_rows: 8192, ..WriteOptions::default() };
    assert_eq!(step_rows(&b, &o), ((16 << 10) / per_row, per_row));
    assert_eq!(step_rows(&b, &WriteOptions::default()).0, 8192, "lineitem-sized rows keep the 8,192-row step");
    assert_eq!(step_rows(&b, &WriteOptions { row_group_bytes: 1, ..WriteOptions::default() }).0, 1);
}

/// A byte cap on read batches: the file's uncompressed bytes per row (the largest row
/// group's) bound the rows decoded at once; every row still comes back, in order.
#[test]
fn read_batches_are_capped_by_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let ctl = ctl();
    let input = batches();
    write_data_file(&StdFs, dir.path(), "r.parquet", &input, &opts(1), &ctl, None).unwrap();
    let path = dir.path().join("r.parquet");
    let md = ParquetRecordBatchReaderBuilder::try_new(fs::File::open(&path).unwrap()).unwrap().metadata().clone();
    let all: Vec<usize> = (0..5).collect();
    let groups: Vec<usize> = (0..md.num_row_groups()).collect();
    let per_row = md
        .row_groups()
        .iter()
        .map(|g| {
            usize::try_from(g.columns().iter().map(parquet::file::metadata::ColumnChunkMetaData::uncompressed_size).sum::<i64>())
                .unwrap()
                .div_ceil(g.num_rows() as usize)
        })
        .max()
        .unwrap();
    assert_eq!(batch_rows_for(&md, &groups, &all, &schema(), 8192, 0).0, 8192, "no cap");
    // The string columns count their value bytes and a view per row when that is more than
    // their uncompressed size: at most 100 rows for 100 rows' uncompressed bytes.
    let rows =
        batch_rows_for(&md, &groups, &all, &schema(), 8192, 100 * per_row + schema().fields().iter().map(|f| column_fixed_bytes(f.data_type())).sum::<usize>())
            .0;
    assert!((40..=100).contains(&rows), "{rows}");
    assert_eq!(batch_rows_for(&md, &groups, &all, &schema(), 8192, 1).0, 1);
    // The estimate of a batch counts no more rows than the file holds (15,000).
    let whole_file = batch_rows_for(&md, &groups, &all, &schema(), 15_000, 0).1;
    assert_eq!(batch_rows_for(&md, &groups, &all, &schema(), 1 << 20, 0), (1 << 20, whole_file));
    assert!(batch_rows_for(&md, &groups, &all, &schema(), 14_999, 0).1 < whole_file);
    let spec = ReadSpec { batch_bytes: 100 * per_row, ..ReadSpec::plain(None, Arc::new(RoaringBitmap::new()), 8192) };
    let got: Vec<RecordBatch> = read_file_with(&path, spec).unwrap().collect::<Result<_, _>>().unwrap();
    assert!(got.iter().all(|b| b.num_rows() <= rows), "{:?}", got.iter().map(RecordBatch::num_rows).max());
    assert_eq!(got.iter().map(RecordBatch::num_rows).sum::<usize>(), 15_000);
    let want = arrow_select::concat::concat_batches(&schema(), &input).unwrap();
    assert_eq!(arrow_select::concat::concat_batches(&schema(), &got).unwrap(), want);
}

/// A dictionary-encoded column of four 3,000-byte values: its chunk's uncompressed size is
/// the indices and one dictionary page (a few bytes a row), but each decoded row holds 3 KB;
/// the cap goes by the value bytes.
#[test]
fn read_cap_counts_dictionary_encoded_values_whole() {
    let dir = tempfile::tempdir().unwrap();
    let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("s", DataType::Utf8, false)]));
    let vals: Vec<String> = (0..4).map(|i| char::from(b'a' + i).to_string().repeat(3_000)).collect();
    let b = RecordBatch::try_new(
        Arc::clone(&schema),
        vec![Arc::new(Int64Array::from_iter_values(0..20_000)), Arc::new(StringArray::from_iter_values((0..20_000).map(|i| vals[i % 4].as_str())))],
    )
    .unwrap();
    write_data_file(&StdFs, dir.path(), "d.parquet", &[b], &WriteOptions::default(), &ctl(), None).unwrap();
    let md = ParquetRecordBatchReaderBuilder::try_new(fs::File::open(dir.path().join("d.parquet")).unwrap()).unwrap().metadata().clone();
    let col = md.row_group(0).column(1);
    assert!(col.uncompressed_size() < 20_000 * 100, "dictionary-encoded: {}", col.uncompressed_size());
    let rows = batch_rows_for(&md, &[0], &[0, 1], &schema, 8192, 1 << 20).0;
    assert!(((1 << 20) / 3_100..=(1 << 20) / 3_000).contains(&rows), "{rows}");
}

/// The decoded length in bytes of the dictionary page of column `leaf` of row group 0 of
/// `path`, as the parquet crate's own page reader returns it (decompressed).
fn dictionary_page_len(path: &Path, leaf: usize) -> u64 {
    use parquet::column::page::Page;
    use parquet::file::reader::{FileReader as _, SerializedFileReader};
    let file = SerializedFileReader::new(fs::File::open(path).unwrap()).unwrap();
    match file.get_row_group(0).unwrap().get_column_page_reader(leaf).unwrap().get_next_page().unwrap() {
        Some(Page::DictionaryPage { buf, .. }) => buf.len() as u64,
        other => panic!("column {leaf} starts with {:?}", other.map(|p| p.page_type())),
    }
}

/// A reader's buffer estimate, per column read: one decoded data page (the chunk's bytes
/// over its page count: 60,000 rows are three 20,000-row pages) and the dictionary page as
/// stored and decoded (the page's own uncompressed size, here taken from the page the
/// parquet crate's page reader returns); once, the larger compressed data page of the
/// columns read and the 8 KiB header buffer (both live only while a page is read); both
/// columns read count both; nothing for a reader that reads no row group. `k` (60,000
/// distinct `Int64`) and `s` (four 3,000-byte strings, whose dictionary page is stored in a
/// few hundred bytes) are both dictionary-encoded by the default writer; `s`'s dictionary is
/// exactly its four values, each PLAIN-encoded behind a 4-byte length: 12,016 bytes.
#[test]
fn reader_buffer_bytes_count_one_page_per_column_and_the_dictionary() {
    let dir = tempfile::tempdir().unwrap();
    let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("s", DataType::Utf8, false)]));
    let vals: Vec<String> = (0..4).map(|i| char::from(b'a' + i).to_string().repeat(3_000)).collect();
    let b = RecordBatch::try_new(
        Arc::clone(&schema),
        vec![Arc::new(Int64Array::from_iter_values(0..60_000)), Arc::new(StringArray::from_iter_values((0..60_000).map(|i| vals[i % 4].as_str())))],
    )
    .unwrap();
    write_data_file(&StdFs, dir.path(), "p.parquet", &[b], &WriteOptions::default(), &ctl(), None).unwrap();
    let path = dir.path().join("p.parquet");
    let md = ParquetRecordBatchReaderBuilder::try_new(fs::File::open(&path).unwrap()).unwrap().metadata().clone();
    assert_eq!(md.num_row_groups(), 1);
    // (held while the reader is open, the compressed page while one is read)
    let per_column = |leaf: usize| {
        let c = md.row_group(0).column(leaf);
        let (unc, comp) = (c.uncompressed_size() as u64, c.compressed_size() as u64);
        let pages = 3u64.max(unc.div_ceil(1 << 20));
        let stored = (c.data_page_offset() - c.dictionary_page_offset().expect("dictionary-encoded")) as u64;
        let dict = stored + dictionary_page_len(&path, leaf);
        (usize::try_from(unc.div_ceil(pages) + dict + (4 << 10)).unwrap(), usize::try_from(comp.div_ceil(pages)).unwrap())
    };
    let expected = |leaf: usize| per_column(leaf).0 + per_column(leaf).1 + (8 << 10);
    assert_eq!(dictionary_page_len(&path, 1), 4 * (4 + 3_000));
    // The metadata the reader keeps counts too: without the page index here (no filter, no
    // byte cap), with it when batches are capped in bytes.
    let meta = md.memory_size();
    let k_only = read_file(&path, Some(&[0]), Arc::new(RoaringBitmap::new()), 8192).unwrap().buffer_bytes();
    assert_eq!(k_only, expected(0) + meta);
    let s_only = read_file(&path, Some(&[1]), Arc::new(RoaringBitmap::new()), 8192).unwrap().buffer_bytes();
    assert_eq!(s_only, expected(1) + meta);
    assert!(s_only >= 12_000 + (8 << 10), "the decoded dictionary counts: {s_only}");
    let both = read_file(&path, None, Arc::new(RoaringBitmap::new()), 8192).unwrap().buffer_bytes();
    let both_columns = per_column(0).0 + per_column(1).0 + per_column(0).1.max(per_column(1).1) + (8 << 10);
    assert_eq!(both, both_columns + meta);
    assert!(both < expected(0) + expected(1) + meta, "one compressed page and one header buffer, not one a column");
    let indexed = ParquetRecordBatchReaderBuilder::try_new_with_options(
        fs::File::open(&path).unwrap(),
        parquet::arrow::arrow_reader::ArrowReaderOptions::new().with_page_index_policy(parquet::file::metadata::PageIndexPolicy::Optional),
    )
    .unwrap()
    .metadata()
    .memory_size();
    assert!(indexed > meta, "the page index takes bytes: {indexed} vs {meta}");
    let capped = ReadSpec { batch_bytes: 1 << 20, ..ReadSpec::plain(None, Arc::new(RoaringBitmap::new()), 8192) };
    // A byte cap reads the offset index alone (the column index serves only filters), and
    // only when a byte-array column is read: `k` alone keeps the footer's metadata.
    let offsets_only = ParquetRecordBatchReaderBuilder::try_new_with_options(
        fs::File::open(&path).unwrap(),
        parquet::arrow::arrow_reader::ArrowReaderOptions::new()
            .with_column_index_policy(parquet::file::metadata::PageIndexPolicy::Skip)
            .with_offset_index_policy(parquet::file::metadata::PageIndexPolicy::Optional),
    )
    .unwrap()
    .metadata()
    .memory_size();
    assert!(meta < offsets_only && offsets_only < indexed, "{meta} < {offsets_only} < {indexed}");
    assert_eq!(read_file_with(&path, capped.clone()).unwrap().buffer_bytes(), both_columns + offsets_only);
    let k_capped = ReadSpec { projection: Some(vec![0]), ..capped.clone() };
    assert_eq!(read_file_with(&path, k_capped).unwrap().buffer_bytes(), expected(0) + meta);
    // A filter reads both halves (page pruning needs the column index's statistics).
    let all = crate::ScanFilter::compare("k", crate::CompareOp::GtEq, Arc::new(Int64Array::from(vec![0])));
    let filtered = ReadSpec { projection: Some(vec![0]), filter: Some(Arc::new(all.bind(&schema).unwrap())), ..capped };
    let pruning = read_file_with(&path, filtered.clone()).unwrap();
    assert!(pruning.prunes_pages());
    assert_eq!(pruning.buffer_bytes(), expected(0) + indexed);
    // The column index is read only when its estimate (encoded bytes times
    // PAGE_INDEX_MEMORY_FACTOR), the footer and the reader's buffers fit the budget: a budget
    // one byte short of that keeps the footer's metadata only, and yields the same rows; a
    // budget that holds it exactly prunes pages.
    let encoded: usize = md.row_group(0).columns().iter().map(|c| (c.column_index_length().unwrap() + c.offset_index_length().unwrap()) as usize).sum();
    let estimate = meta + encoded * PAGE_INDEX_MEMORY_FACTOR;
    assert!(estimate >= indexed, "the estimate covers the decoded index: {estimate} vs {indexed}");
    let rows = |r: FileReader| r.map(|b| b.unwrap().num_rows()).sum::<usize>();
    let exact = read_file_with(&path, ReadSpec { pruning_budget: expected(0) + estimate, ..filtered.clone() }).unwrap();
    assert!(exact.prunes_pages());
    let unpruned = read_file_with(&path, ReadSpec { pruning_budget: expected(0) + estimate - 1, ..filtered.clone() }).unwrap();
    assert!(!unpruned.prunes_pages());
    assert_eq!(unpruned.buffer_bytes(), expected(0) + meta);
    let never = read_file_with(&path, ReadSpec { pruning_budget: 0, ..filtered }).unwrap();
    assert_eq!(never.buffer_bytes(), expected(0) + meta);
    assert_eq!((rows(pruning), rows(exact), rows(unpruned), rows(never)), (60_000, 60_000, 60_000, 60_000));
    // A filter no row group can match: the reader reads nothing and holds nothing.
    let none = crate::ScanFilter::compare("k", crate::CompareOp::Gt, Arc::new(Int64Array::from(vec![1_000_000])));
    let spec = ReadSpec {
        projection: None,
        filter: Some(Arc::new(none.bind(&schema).unwrap())),
        deleted: Arc::new(RoaringBitmap::new()),
        batch_rows: 8192,
        batch_bytes: 0,
        pruning_budget: usize::MAX,
        decode_budget: usize::MAX,
        counters: None,
        resume_at: None,
        partition: None,
    };
    assert_eq!(read_file_with(&path, spec).unwrap().buffer_bytes(), 0);
}

/// `DICTIONARY_PAGE_BYTES` decides where a column of distinct values leaves its dictionary:
/// 100,000 distinct `Int64` (800,000 bytes of values, under Parquet's 1 MiB default) fall
/// back to plain pages once the dictionary holds 256 KiB, on one thread and on several; a
/// column of 50 values stays dictionary-encoded throughout. The rows read back unchanged.
#[test]
fn distinct_columns_leave_their_dictionary_at_the_data_file_limit() {
    use parquet::basic::{Encoding, PageType};
    use parquet::file::reader::{FileReader as _, SerializedFileReader};
    let dir = tempfile::tempdir().unwrap();
    let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("q", DataType::Int64, false)]));
    let rows = 100_000i64;
    let b = RecordBatch::try_new(
        Arc::clone(&schema),
        vec![Arc::new(Int64Array::from_iter_values(0..rows)), Arc::new(Int64Array::from_iter_values((0..rows).map(|i| i % 50)))],
    )
    .unwrap();
    for threads in [1, 2] {
        let name = format!("d{threads}.parquet");
        let o = WriteOptions { encode_threads: threads, ..WriteOptions::default() };
        write_data_file(&StdFs, dir.path(), &name, std::slice::from_ref(&b), &o, &ctl(), None).unwrap();
        let path = dir.path().join(&name);
        let reader = SerializedFileReader::new(fs::File::open(&path).unwrap()).unwrap();
        assert_eq!(reader.metadata().num_row_groups(), 1);
        let rg = reader.get_row_group(0).unwrap();
        // (dictionary entries, rows in plain data pages, rows in dictionary-index data pages)
        let pages = |leaf: usize| {
            let (mut dict, mut plain, mut indexed) = (0u32, 0u32, 0u32);
            for page in rg.get_column_page_reader(leaf).unwrap() {
                let page = page.unwrap();
                match (page.page_type(), page.encoding()) {
                    (PageType::DICTIONARY_PAGE, _) => dict += page.num_values(),
                    (_, Encoding::PLAIN) => plain += page.num_values(),
                    (_, Encoding::RLE_DICTIONARY | Encoding::PLAIN_DICTIONARY) => indexed += page.num_values(),
                    (t, e) => panic!("unexpected page {t:?} {e:?}"),
                }
            }
            (dict, plain, indexed)
        };
        let (dict, plain, indexed) = pages(0);
        let limit_values = (DICTIONARY_PAGE_BYTES / 8) as u32;
        assert!(dict >= limit_values && dict < limit_values + 8192, "{threads} threads: k's dictionary stops at the limit: {dict} values");
        assert_eq!(dict, indexed, "{threads} threads: the rows before the fallback are the dictionary's (all distinct)");
        assert_eq!(plain + indexed, rows as u32, "{threads} threads: every k row is in a data page");
        assert!(plain > 0, "{threads} threads: k fell back to plain pages");
        assert_eq!(pages(1), (50, 0, rows as u32), "{threads} threads: q keeps its 50-value dictionary");
        let got = arrow_select::concat::concat_batches(&schema, &read_all(&path)).unwrap();
        assert_eq!(got, b, "{threads} threads: rows read back");
    }
}

/// A file of `batch(0, 20_000)` in 4 row groups of 5,000 rows in `dir`, and a deletion vector
/// for it: every 9th row and 30 rows across the first row groups' boundary.
fn four_row_groups(dir: &Path) -> (std::path::PathBuf, RoaringBitmap) {
    let o = WriteOptions { row_group_rows: 5_000, ..WriteOptions::default() };
    write_data_file(&StdFs, dir, "r.parquet", &[batch(0, 20_000)], &o, &ctl(), None).unwrap();
    let deleted = (0..20_000u32).filter(|r| r % 9 == 0 || (4_990..5_020).contains(r)).collect();
    (dir.join("r.parquet"), deleted)
}

/// A reader reopened at [`FileReader::resume_row`] after any batch returns that batch again
/// and then exactly the rest: over 4 row groups, with a deletion vector, with and without a
/// filter, batches of 700 rows. The reopened file is not counted again in the scan counters,
/// and a reader reopened past the last row reads nothing and holds nothing.
#[test]
fn a_reader_reopened_at_its_resume_row_returns_the_last_batch_and_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let (path, deleted) = four_row_groups(dir.path());
    let keys = |b: &RecordBatch| b.column(0).as_any().downcast_ref::<Int64Array>().unwrap().values().to_vec();
    let from = crate::ScanFilter::compare("k", crate::CompareOp::GtEq, Arc::new(Int64Array::from(vec![7_777])));
    for filter in [None, Some(Arc::new(from.bind(&schema()).unwrap()))] {
        let counters = Arc::new(crate::ScanCounters::default());
        let spec = ReadSpec {
            projection: Some(vec![0, 1]),
            filter: filter.clone(),
            deleted: Arc::new(deleted.clone()),
            batch_rows: 700,
            batch_bytes: 0,
            pruning_budget: usize::MAX,
            decode_budget: usize::MAX,
            counters: Some(Arc::clone(&counters)),
            resume_at: None,
            partition: None,
        };
        let whole: Vec<Vec<i64>> = read_file_with(&path, spec.clone()).unwrap().map(|b| keys(&b.unwrap())).collect();
        let lo = if filter.is_some() { 7_777 } else { 0 };
        let want: Vec<i64> = (lo..20_000).filter(|k| !deleted.contains(*k as u32)).collect();
        assert_eq!(whole.concat(), want);
        assert!(whole.len() > 10, "{} batches", whole.len());
        for k in 0..whole.len() {
            let mut r = read_file_with(&path, spec.clone()).unwrap();
            let mut got: Vec<i64> = Vec::new();
            for _ in 0..=k {
                got.extend(keys(&r.next().unwrap().unwrap()));
            }
            let at = r.resume_row();
            let last = whole[k][0] as u64;
            assert!(at <= last, "batch {k}: resume row {at} after its first row {last}");
            let files = counters.snapshot().files_opened;
            let again = read_file_with(&path, ReadSpec { resume_at: Some(at), ..spec.clone() }).unwrap();
            assert_eq!(counters.snapshot().files_opened, files, "a reopened file is not counted again");
            let rest: Vec<i64> = again.map(|b| keys(&b.unwrap())).collect::<Vec<_>>().concat();
            let before: usize = whole[..k].iter().map(Vec::len).sum();
            assert_eq!(rest, want[before..].to_vec(), "reopened after batch {k} at row {at}");
            assert_eq!(got.len(), before + whole[k].len());
        }
        let end = read_file_with(&path, ReadSpec { resume_at: Some(20_000), ..spec.clone() }).unwrap();
        assert_eq!(end.buffer_bytes(), 0);
        assert_eq!(end.count(), 0);
    }
}

/// `count` readers of one file, each with its share of the row groups
/// ([`ReadSpec::partition`]), return every row of the unpartitioned read exactly once between
/// them: 4 row groups of 5,000 rows, with a deletion vector, with and without a filter (whose
/// page index prunes), 1 to 5 shares (5: one share reads nothing and holds nothing). Their
/// counters add up to the file's row groups and to the unpartitioned read's pruning; a share
/// reopened at its resume row goes on exactly.
#[test]
fn partitioned_readers_return_each_row_once_between_them() {
    let dir = tempfile::tempdir().unwrap();
    let o = WriteOptions { row_group_rows: 5_000, ..WriteOptions::default() };
    write_data_file(&StdFs, dir.path(), "p.parquet", &[batch(0, 20_000)], &o, &ctl(), None).unwrap();
    let path = dir.path().join("p.parquet");
    let deleted: RoaringBitmap = (0..20_000u32).filter(|r| r % 9 == 0).collect();
    let keys = |r: FileReader| -> Vec<i64> { r.flat_map(|b| b.unwrap().column(0).as_any().downcast_ref::<Int64Array>().unwrap().values().to_vec()).collect() };
    let band = crate::ScanFilter::and([
        crate::ScanFilter::compare("k", crate::CompareOp::GtEq, Arc::new(Int64Array::from(vec![7_777]))),
        crate::ScanFilter::compare("k", crate::CompareOp::Lt, Arc::new(Int64Array::from(vec![16_000]))),
    ]);
    for filter in [None, Some(Arc::new(band.bind(&schema()).unwrap()))] {
        let spec = |partition, counters: &Arc<crate::ScanCounters>| ReadSpec {
            projection: Some(vec![0]),
            filter: filter.clone(),
            deleted: Arc::new(deleted.clone()),
            batch_rows: 1_000,
            batch_bytes: 0,
            pruning_budget: usize::MAX,
            decode_budget: usize::MAX,
            counters: Some(Arc::clone(counters)),
            resume_at: None,
            partition,
        };
        let all_counters = Arc::new(crate::ScanCounters::default());
        let all = keys(read_file_with(&path, spec(None, &all_counters)).unwrap());
        let (lo, hi) = if filter.is_some() { (7_777, 16_000) } else { (0, 20_000) };
        assert_eq!(all, (lo..hi).filter(|k| k % 9 != 0).collect::<Vec<i64>>());
        let whole = all_counters.snapshot();
        assert_eq!(whole.row_groups_total, 4);
        for count in 1..=5 {
            let counters = Arc::new(crate::ScanCounters::default());
            let mut got: Vec<i64> = Vec::new();
            for index in 0..count {
                let r = read_file_with(&path, spec(Some((index, count)), &counters)).unwrap();
                if index >= 4 {
                    assert_eq!(r.buffer_bytes(), 0, "share {index} of {count} has no row group");
                }
                got.extend(keys(r));
            }
            got.sort_unstable();
            assert_eq!(got, all, "{count} shares, filter {}", filter.is_some());
            let m = counters.snapshot();
            assert_eq!(m.files_opened, count as u64);
            assert_eq!(
                (m.row_groups_total, m.row_groups_pruned, m.rows_pruned_by_page_index),
                (4, whole.row_groups_pruned, whole.rows_pruned_by_page_index),
                "{count} shares"
            );
        }
        // Share 1 of 2 (row groups 1 and 3), reopened after its third batch.
        let counters = Arc::new(crate::ScanCounters::default());
        let share = keys(read_file_with(&path, spec(Some((1, 2)), &counters)).unwrap());
        let mut r = read_file_with(&path, spec(Some((1, 2)), &counters)).unwrap();
        let mut before = 0;
        for _ in 0..2 {
            before += r.next().unwrap().unwrap().num_rows();
        }
        assert!(r.next().unwrap().is_ok());
        let at = r.resume_row();
        drop(r);
        let again = keys(read_file_with(&path, ReadSpec { resume_at: Some(at), ..spec(Some((1, 2)), &counters) }).unwrap());
        assert_eq!(again, share[before..].to_vec(), "share 1 of 2 reopened at row {at}: its third batch and the rest");
    }
}

/// A reader whose columns would not fit its `decode_budget` together decodes them in groups
/// and returns exactly what one reader of them all returns — every batch, with a deletion
/// vector, a filter, a projection out of schema order (nested columns too), a share of the row
/// groups, and reopened at its resume row — while holding less: its `buffer_bytes` is its
/// largest group's, and at a budget of 0 bytes that is one column's.
#[test]
fn a_file_read_in_column_groups_returns_what_one_reader_returns() {
    let dir = tempfile::tempdir().unwrap();
    let (path, deleted) = four_row_groups(dir.path());
    let band = crate::ScanFilter::and([
        crate::ScanFilter::compare("k", crate::CompareOp::GtEq, Arc::new(Int64Array::from(vec![3_333]))),
        crate::ScanFilter::compare("k", crate::CompareOp::Lt, Arc::new(Int64Array::from(vec![16_000]))),
    ]);
    let read = |spec: &ReadSpec| -> (Vec<RecordBatch>, usize) {
        let r = read_file_with(&path, spec.clone()).unwrap();
        let held = r.buffer_bytes();
        (r.collect::<Result<_, _>>().unwrap(), held)
    };
    for filter in [None, Some(Arc::new(band.bind(&schema()).unwrap()))] {
        for (projection, partition) in [(None, None), (Some(vec![4, 0, 3, 1]), None), (Some(vec![2, 1]), Some((1, 2)))] {
            let whole = ReadSpec { projection: projection.clone(), filter: filter.clone(), partition, ..ReadSpec::plain(None, Arc::new(deleted.clone()), 700) };
            let (want, whole_bytes) = read(&whole);
            assert!(want.len() > 5, "{} batches", want.len());
            let rows: usize = want.iter().map(RecordBatch::num_rows).sum();
            assert!(rows > 2_000, "{rows} rows");
            for budget in [0, whole_bytes / 2] {
                let grouped = ReadSpec { decode_budget: budget, ..whole.clone() };
                let (got, held) = read(&grouped);
                assert_eq!(got, want, "budget {budget}, projection {projection:?}, filter {}", filter.is_some());
                assert!(held < whole_bytes, "budget {budget}: holds {held} of one reader's {whole_bytes}");
                // Reopened after its third batch: that batch again, then the rest.
                let mut r = read_file_with(&path, grouped.clone()).unwrap();
                for _ in 0..3 {
                    r.next().unwrap().unwrap();
                }
                let at = r.resume_row();
                let rest: Vec<RecordBatch> = read_file_with(&path, ReadSpec { resume_at: Some(at), ..grouped }).unwrap().collect::<Result<_, _>>().unwrap();
                let want_rest = arrow_select::concat::concat_batches(&want[0].schema(), &want[2..]).unwrap();
                assert_eq!(arrow_select::concat::concat_batches(&want[0].schema(), &rest).unwrap(), want_rest, "reopened at {at}");
            }
        }
    }
}

/// `column_groups` cuts the columns read into runs in order: one run when the budget holds
/// them all, one column a run at a budget of 0, and otherwise runs whose reader estimate each
/// fits the budget.
#[test]
fn column_groups_fit_the_budget_in_column_order() {
    let dir = tempfile::tempdir().unwrap();
    write_data_file(&StdFs, dir.path(), "c.parquet", &batches(), &opts(1), &ctl(), None).unwrap();
    let path = dir.path().join("c.parquet");
    let file = fs::File::open(&path).unwrap();
    let md = ParquetRecordBatchReaderBuilder::try_new(file.try_clone().unwrap()).unwrap().metadata().clone();
    let all: Vec<usize> = (0..md.num_row_groups()).collect();
    let read = vec![0, 1, 2, 3, 4];
    let dicts = DictionaryPages::read(&file, &md, &all, &read);
    assert_eq!(column_groups(&md, &all, &read, &dicts, usize::MAX), vec![read.clone()]);
    assert_eq!(column_groups(&md, &all, &read, &dicts, 0), vec![vec![0], vec![1], vec![2], vec![3], vec![4]]);
    let largest = read.iter().map(|&c| reader_buffer_bytes(&md, &all, &[c], &dicts)).max().unwrap();
    let whole = reader_buffer_bytes(&md, &all, &read, &dicts);
    for budget in [largest, usize::midpoint(largest, whole), whole - 1] {
        let groups = column_groups(&md, &all, &read, &dicts, budget);
        assert!(groups.len() > 1 && groups.len() < read.len() || budget == largest, "{budget}: {groups:?}");
        assert_eq!(groups.concat(), read, "in order, each column once");
        for g in &groups {
            assert!(reader_buffer_bytes(&md, &all, g, &dicts) <= budget, "{budget}: {g:?}");
        }
    }
}

/// `read_file_within` asks for each step's memory before the step allocates it: the footer's
/// encoded length times `FOOTER_MEMORY_FACTOR` before the footer is decoded (covering its
/// decoded size), then the decoded footer plus the page index's estimate before the index is
/// read (covering the decoded index). A refusal ends the open at that step with the error as
/// given: a refused footer leaves the file uncounted (nothing was parsed).
#[test]
fn a_reader_asks_for_its_metadata_memory_before_parsing_it() {
    let dir = tempfile::tempdir().unwrap();
    write_data_file(&StdFs, dir.path(), "m.parquet", &batches(), &opts(1), &ctl(), None).unwrap();
    let path = dir.path().join("m.parquet");
    let footer = encoded_footer_len(&path);
    let plain = ParquetRecordBatchReaderBuilder::try_new(fs::File::open(&path).unwrap()).unwrap().metadata().memory_size();
    let indexed = ParquetRecordBatchReaderBuilder::try_new_with_options(
        fs::File::open(&path).unwrap(),
        parquet::arrow::arrow_reader::ArrowReaderOptions::new().with_page_index_policy(PageIndexPolicy::Optional),
    )
    .unwrap()
    .metadata()
    .memory_size();
    let schema = schema();
    let filter = crate::ScanFilter::compare("k", crate::CompareOp::GtEq, Arc::new(Int64Array::from(vec![100])));
    let counters = Arc::new(ScanCounters::default());
    let spec = ReadSpec { filter: Some(Arc::new(filter.bind(&schema).unwrap())), counters: Some(Arc::clone(&counters)), ..read_spec_plain() };
    let mut asked = Vec::new();
    let reader = read_file_within(&path, spec.clone(), &mut |total| {
        asked.push(total);
        Ok(())
    })
    .unwrap();
    assert!(reader.prunes_pages());
    assert_eq!(asked.len(), 2, "{asked:?}");
    assert_eq!(asked[0], footer * FOOTER_MEMORY_FACTOR);
    assert!(asked[0] >= plain + footer, "footer estimate {} for {plain} decoded + {footer} read", asked[0]);
    assert!(asked[1] >= indexed && asked[1] > plain, "index estimate {} for {indexed} decoded", asked[1]);
    assert!(reader.buffer_bytes() >= indexed);
    assert_eq!(reader.map(|b| b.unwrap().num_rows()).sum::<usize>(), 15_000 - 100);
    assert_eq!(counters.snapshot().files_opened, 1);
    // Refused at the footer: the refusal as given, nothing parsed or counted.
    let quiet = Arc::new(ScanCounters::default());
    let mut calls = 0;
    let refused = read_file_within(&path, ReadSpec { counters: Some(Arc::clone(&quiet)), ..spec.clone() }, &mut |total| {
        calls += 1;
        Err(StorageError::Memory(gritdb_memctl::MemoryError::Limit { category: Category::ScanBuffers, requested: total, used: 0, limit: 1, top: Vec::new() }))
    });
    assert!(matches!(refused, Err(StorageError::Memory(gritdb_memctl::MemoryError::Limit { requested, .. })) if requested == footer * FOOTER_MEMORY_FACTOR));
    assert_eq!((calls, quiet.snapshot().files_opened), (1, 0));
    // Refused at the page index: the same, one step later.
    let mut calls = 0;
    let refused = read_file_within(&path, ReadSpec { counters: Some(Arc::clone(&quiet)), ..spec }, &mut |total| {
        calls += 1;
        if calls == 2 {
            return Err(StorageError::Memory(gritdb_memctl::MemoryError::Limit {
                category: Category::ScanBuffers,
                requested: total,
                used: 0,
                limit: 1,
                top: Vec::new(),
            }));
        }
        Ok(())
    });
    assert!(matches!(refused, Err(StorageError::Memory(_))));
    assert_eq!((calls, quiet.snapshot().files_opened), (2, 0));
    // Not Parquet: no footer length to estimate from (0 asked), and the parse's error.
    fs::write(dir.path().join("junk.parquet"), b"not a parquet file at all").unwrap();
    let mut asked = Vec::new();
    let junk = read_file_within(&dir.path().join("junk.parquet"), read_spec_plain(), &mut |t| {
        asked.push(t);
        Ok(())
    });
    assert!(matches!(junk, Err(StorageError::Parquet(_))), "{junk:?}");
    assert_eq!(asked, vec![0]);
}

fn read_spec_plain() -> ReadSpec {
    ReadSpec {
        projection: None,
        filter: None,
        deleted: Arc::new(RoaringBitmap::new()),
        batch_rows: 1_000,
        batch_bytes: 0,
        pruning_budget: usize::MAX,
        decode_budget: usize::MAX,
        counters: None,
        resume_at: None,
        partition: None,
    }
}

/// `read_file_reserved` (compaction's reader): the footer's estimate is reserved before the
/// parse, so a controller without room for it refuses the open with nothing held; with the
/// room, the reservation ends at the reader's `buffer_bytes` and the rows are all there.
#[test]
fn a_reserved_reader_is_refused_before_its_footer_is_parsed() {
    let dir = tempfile::tempdir().unwrap();
    write_data_file(&StdFs, dir.path(), "r.parquet", &batches(), &opts(1), &ctl(), None).unwrap();
    let path = dir.path().join("r.parquet");
    let estimate = encoded_footer_len(&path) * FOOTER_MEMORY_FACTOR;
    let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), ..ControllerConfig::default() }).unwrap();
    let mut filler = Reservation::new(&ctl, Category::Metadata, None);
    filler.try_grow((64 << 20) - ctl.used() - estimate + 1).unwrap();
    let mut res = Reservation::new(&ctl, Category::BatchBlocks, None);
    match read_file_reserved(&path, None, Arc::new(RoaringBitmap::new()), 1_000, &mut res) {
        Err(StorageError::Memory(gritdb_memctl::MemoryError::Limit { requested, .. })) => assert_eq!(requested, estimate),
        other => panic!("{:?}", other.map(|r| r.buffer_bytes())),
    }
    assert_eq!((res.size(), ctl.category_bytes(Category::BatchBlocks)), (0, 0));
    drop(filler);
    let reader = read_file_reserved(&path, None, Arc::new(RoaringBitmap::new()), 1_000, &mut res).unwrap();
    assert_eq!(res.size(), reader.buffer_bytes());
    assert_eq!(reader.map(|b| b.unwrap().num_rows()).sum::<usize>(), 15_000);
}

/// The encoded footer length a Parquet file's last 8 bytes give.
fn encoded_footer_len(path: &Path) -> usize {
    use std::os::unix::fs::FileExt;
    let f = fs::File::open(path).unwrap();
    let mut tail = [0u8; 4];
    f.read_exact_at(&mut tail, f.metadata().unwrap().len() - 8).unwrap();
    u32::from_le_bytes(tail) as usize
}

/// A dictionary page's header gives its uncompressed size: the three leading `i32` fields of
/// the Thrift compact `PageHeader` (field byte `0x15`, zigzag varints). Anything else — a
/// data page, fields out of order, a varint cut short, a compressed size past the page's
/// stored bytes, a negative size — gives None, and the estimate stands.
#[test]
fn a_dictionary_page_header_gives_its_uncompressed_size() {
    // type 2 (zigzag 4), uncompressed 12,016 (zigzag 24,032 = 0xE0 0xBB 0x01),
    // compressed 300 (zigzag 600 = 0xD8 0x04), then the rest of a header.
    let head = [0x15, 0x04, 0x15, 0xE0, 0xBB, 0x01, 0x15, 0xD8, 0x04, 0x1c, 0x15, 0x08];
    assert_eq!(dictionary_page_uncompressed(&head, 320), Some(12_016));
    // The header's parsed bytes (9) and the compressed 300 must fit the stored bytes.
    assert_eq!(dictionary_page_uncompressed(&head, 309), Some(12_016));
    assert_eq!(dictionary_page_uncompressed(&head, 308), None);
    // A data page (type 0) is not a dictionary.
    assert_eq!(dictionary_page_uncompressed(&[0x15, 0x00, 0x15, 0x02, 0x15, 0x02], 100), None);
    // Field 2 first (delta 2), a cut varint, an empty read.
    assert_eq!(dictionary_page_uncompressed(&[0x25, 0x04, 0x15, 0x02, 0x15, 0x02], 100), None);
    assert_eq!(dictionary_page_uncompressed(&[0x15, 0x04, 0x15, 0xE0, 0xBB], 100), None);
    assert_eq!(dictionary_page_uncompressed(&[], 100), None);
    // A negative uncompressed size (zigzag 1 = -1).
    assert_eq!(dictionary_page_uncompressed(&[0x15, 0x04, 0x15, 0x01, 0x15, 0x02], 100), None);
}

/// Leaf columns of [`schema`]: `k`, `s`, `d`, `st.a`, `st.b`, `l.item`.
const LEAVES: usize = 6;

/// One-row row groups from 8,192-row steps. `ArrowWriter::write` calls itself once for every
/// row group a batch crosses, so a step of 8,192 rows into one-row row groups overflowed the
/// stack (and aborted the process); the steps now end at row-group ends, which this checks on
/// a 512 KiB stack.
#[test]
fn one_row_row_groups_are_written_without_recursion() {
    let input = vec![batch(0, 8_192)];
    let want = arrow_select::concat::concat_batches(&schema(), &input).unwrap();
    for threads in [1, 2] {
        let ctl = ctl();
        let dir = tempfile::tempdir().unwrap();
        let o = WriteOptions { write_batch_rows: 8_192, row_group_rows: 1, ..opts(threads) };
        std::thread::scope(|s| {
            let write = || write_data_file(&StdFs, dir.path(), "f.parquet", &input, &o, &ctl, None);
            std::thread::Builder::new().stack_size(512 << 10).spawn_scoped(s, write).unwrap().join().unwrap()
        })
        .unwrap();
        let path = dir.path().join("f.parquet");
        assert_eq!(row_groups(&path), vec![1; 8_192], "{threads} threads");
        assert_eq!(arrow_select::concat::concat_batches(&schema(), &read_all(&path)).unwrap(), want, "{threads} threads");
        assert_eq!(ctl.category_bytes(Category::WriteBuffers), 0, "{threads} threads: released with the writer");
        // What the writer kept of the 8,192 written row groups was counted until the close.
        let kept = 8_192 * LEAVES * WRITTEN_CHUNK_BYTES;
        assert!(ctl.category_peak(Category::WriteBuffers) >= kept, "{threads} threads: peak {} < {kept}", ctl.category_peak(Category::WriteBuffers));
    }
}

/// `columns` `Int64` columns of `rows` distinct values each (column `c` holds `k * (c + 1)`).
fn wide(columns: usize, rows: i64) -> RecordBatch {
    let fields: Vec<Field> = (0..columns).map(|c| Field::new(format!("c{c}"), DataType::Int64, false)).collect();
    let cols: Vec<ArrayRef> = (0..columns).map(|c| Arc::new(Int64Array::from_iter_values((0..rows).map(|k| k * (c as i64 + 1)))) as ArrayRef).collect();
    RecordBatch::try_new(Arc::new(Schema::new(fields)), cols).unwrap()
}

/// A 64-column table written with 1 MiB of room, where each row group's metadata (64 KiB,
/// [`WRITTEN_CHUNK_BYTES`] a column chunk) is a large share of the room: every row is written,
/// on one thread and two; what the writer keeps of its written row groups is counted, past
/// the room by at most that metadata plus one step's growth of the open row group's buffers
/// (they grow by doubling, so a step can add what the row group held: at most the room), where
/// it went uncounted before; the steps do not shrink for it, so the file has a few more row
/// groups than the 11 of steps budgeted at their Arrow bytes (shrinking steps for the
/// metadata wrote 102, each adding metadata); and all of it is released at the close. The
/// 64 dictionary tables (4.7 MB, [`DICTIONARY_TABLE_BYTES`] each) do not fit 1 MiB: the
/// columns are written plain. Before, they were made and went uncounted: the writer held
/// 6.8 MB while `write_buffers` peaked at 1.56 MB.
#[test]
fn a_wide_table_under_a_tight_limit_counts_its_row_groups_metadata() {
    let b = wide(64, 20_000);
    let room = 1 << 20;
    let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(16 << 20), chunk_size: 64 << 10, ..ControllerConfig::default() }).unwrap();
    let mut held = Reservation::new(&ctl, Category::Metadata, None);
    held.try_resize((16 << 20) - room).unwrap();
    for threads in [1, 2] {
        ctl.reset_peaks();
        let dir = tempfile::tempdir().unwrap();
        let o = WriteOptions { row_group_rows: 1 << 20, write_batch_rows: 8_192, encode_threads: threads, ..WriteOptions::default() };
        write_data_file(&StdFs, dir.path(), "w.parquet", std::slice::from_ref(&b), &o, &ctl, None).unwrap();
        let path = dir.path().join("w.parquet");
        let groups = row_groups(&path);
        assert_eq!(groups.iter().sum::<i64>(), 20_000, "{threads} threads");
        assert!((2..=24).contains(&groups.len()), "{threads} threads: {groups:?}");
        assert_eq!(dictionary_pages(&path), 0, "{threads} threads");
        assert_eq!(arrow_select::concat::concat_batches(&b.schema(), &read_all(&path)).unwrap(), b, "{threads} threads");
        assert_eq!(ctl.category_bytes(Category::WriteBuffers), 0, "{threads} threads: released with the writer");
        // An `Int64` chunk's statistics add 16 bytes (min and max).
        let metadata = groups.len() * 64 * (WRITTEN_CHUNK_BYTES + 16);
        let peak = ctl.category_peak(Category::WriteBuffers);
        assert!(peak > room && peak <= 2 * room + metadata, "{threads} threads: peak {peak}, room {room}, metadata {metadata}");
    }
    assert_eq!(ctl.used(), held.size());
}

/// A tally counts each written row group once, however often it is updated, at
/// [`WRITTEN_CHUNK_BYTES`] a column chunk plus the chunk's statistics; the next row group is
/// estimated at a chunk per leaf column.
#[test]
fn footer_tally_counts_each_row_group_once() {
    let mut w = ArrowWriter::try_new(Vec::new(), schema(), Some(data_file_properties(1_000).build())).unwrap();
    let mut tally = FooterTally::new(&schema());
    assert_eq!(tally.next_group_bytes(), LEAVES * WRITTEN_CHUNK_BYTES);
    assert_eq!(tally.update(w.flushed_row_groups()), 0);
    w.write(&batch(0, 2_500)).unwrap();
    w.flush().unwrap();
    let groups = w.flushed_row_groups();
    assert_eq!(groups.len(), 3);
    let stats: usize = groups
        .iter()
        .flat_map(parquet::file::metadata::RowGroupMetaData::columns)
        .map(|c| c.statistics().map_or(0, |s| s.min_bytes_opt().map_or(0, <[u8]>::len) + s.max_bytes_opt().map_or(0, <[u8]>::len)))
        .sum();
    assert!(stats > 0);
    let want = 3 * LEAVES * WRITTEN_CHUNK_BYTES + stats;
    assert_eq!(tally.update(groups), want);
    assert_eq!(tally.update(groups), want, "counted once");
    assert_eq!(tally.update(&groups[..1]), want, "a shorter slice adds nothing");
    assert_eq!(tally.bytes(), want);
}

/// The two ways of counting written row groups' metadata, through [`StepWriter`] on one
/// `Int64` column at a 1 MiB limit with one-row row groups: 2,000 row groups keep at least
/// 2,000 × `WRITTEN_CHUNK_BYTES` (~2 MB). Budgeted, the write is refused with `MemoryLimit`
/// in `write_buffers` before the metadata passes the limit; counted past the limit (a
/// flush's rule), it finishes with every row group and its peak holds them. Both give every
/// byte back.
#[test]
fn step_writer_budgets_or_counts_written_row_groups_metadata() {
    let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(1 << 20), ..ControllerConfig::default() }).unwrap();
    let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)]));
    let b = RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(Int64Array::from_iter_values(0..2_000))]).unwrap();
    let writer = |policy| {
        let props = data_file_properties(1).build();
        StepWriter::try_new(Vec::new(), Arc::clone(&schema), props, WriteOptions::default(), policy, &ctl, None, Path::new("steps.parquet")).unwrap()
    };
    let mut budgeted = writer(WrittenMetadata::Budget);
    match budgeted.write(&b) {
        Err(StepError::Storage(StorageError::Memory(gritdb_memctl::MemoryError::Limit { category, .. }))) => assert_eq!(category, Category::WriteBuffers),
        other => panic!("expected a refused budget, got {other:?}"),
    }
    let refused_at = budgeted.budget.tally.bytes();
    assert!(refused_at <= 1 << 20, "the budgeted metadata stayed under the limit: {refused_at}");
    // Each one-row row group opens a dictionary table, budgeted with its step.
    assert!(refused_at > (1 << 20) - DICTIONARY_TABLE_BYTES - 4 * WRITTEN_CHUNK_BYTES, "refused only near the limit: {refused_at}");
    drop(budgeted);
    assert_eq!(ctl.category_bytes(Category::WriteBuffers), 0);
    ctl.reset_peaks();
    let mut counted = writer(WrittenMetadata::CountPastLimit);
    counted.write(&b).unwrap();
    let (bytes, stats) = counted.finish().unwrap();
    assert_eq!(stats.row_groups, 2_000);
    assert!(stats.peak_bytes >= 2_000 * WRITTEN_CHUNK_BYTES, "{stats:?}");
    assert_eq!(ctl.category_peak(Category::WriteBuffers), stats.peak_bytes);
    assert_eq!(ctl.category_bytes(Category::WriteBuffers), 0);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("steps.parquet");
    std::fs::write(&path, bytes).unwrap();
    assert_eq!(row_groups(&path), vec![1; 2_000]);
    let sum: i64 = read_all(&path).iter().map(|r| r.column(0).as_any().downcast_ref::<Int64Array>().unwrap().values().iter().sum::<i64>()).sum();
    assert_eq!(sum, 1_999 * 2_000 / 2);
}

/// Column chunks of fixed-width physical types (not byte arrays) in the file at `path` that
/// have a dictionary page.
fn dictionary_pages(path: &Path) -> usize {
    let r = ParquetRecordBatchReaderBuilder::try_new(fs::File::open(path).unwrap()).unwrap();
    r.metadata()
        .row_groups()
        .iter()
        .flat_map(parquet::file::metadata::RowGroupMetaData::columns)
        .filter(|c| c.column_type() != parquet::basic::Type::BYTE_ARRAY && c.dictionary_page_offset().is_some())
        .count()
}

/// A row group opens a dictionary table of exactly [`DICTIONARY_TABLE_BYTES`] for each
/// `INT32`/`INT64`/`FLOAT`/`DOUBLE` column before any value (parquet's `Interner`), and none
/// for byte-array or boolean columns (a boolean's bit buffer is 256 bytes). A file whose tables do not fit a quarter of the room
/// left under the limit writes those columns without dictionaries; with room, it keeps them.
#[test]
fn an_open_row_groups_dictionary_tables_are_known_before_they_exist() {
    use arrow_array::{BooleanArray, Date32Array, Float32Array, Float64Array};
    let fixed: Vec<ArrayRef> = vec![
        Arc::new(Int32Array::from(vec![None])),
        Arc::new(Int64Array::from(vec![None])),
        Arc::new(Float32Array::from(vec![None])),
        Arc::new(Float64Array::from(vec![None])),
        Arc::new(Date32Array::from(vec![None])),
    ];
    let growing: Vec<ArrayRef> = vec![Arc::new(StringArray::from(vec![None::<&str>])), Arc::new(BooleanArray::from(vec![None]))];
    for (a, want) in fixed.into_iter().map(|a| (a, DICTIONARY_TABLE_BYTES)).chain(growing.into_iter().map(|a| (a, 0))) {
        let schema = Arc::new(Schema::new(vec![Field::new("c", a.data_type().clone(), true)]));
        let mut w = ArrowWriter::try_new(Vec::new(), Arc::clone(&schema), Some(data_file_properties(1 << 20).build())).unwrap();
        w.write(&RecordBatch::try_new(Arc::clone(&schema), vec![Arc::clone(&a)]).unwrap()).unwrap();
        if want > 0 {
            assert_eq!(w.memory_size(), want, "{}", a.data_type());
        } else {
            assert!(w.memory_size() <= 256, "{}: {}", a.data_type(), w.memory_size());
        }
        let descr = parquet::arrow::ArrowSchemaConverter::new().convert(&schema).unwrap();
        assert_eq!(dictionary_table_bytes(&descr, &data_file_properties(1 << 20).build()), want, "{}", a.data_type());
    }
    // 64 `Int64` columns and a string: 4.7 MB of tables, kept with 19 MB of room, not with 18.
    let mut fields: Vec<Field> = (0..64).map(|c| Field::new(format!("c{c}"), DataType::Int64, false)).collect();
    fields.push(Field::new("s", DataType::Utf8, false));
    let schema = Schema::new(fields);
    let tables = 64 * DICTIONARY_TABLE_BYTES;
    let kept = fit_dictionaries(data_file_properties(1 << 20).build(), &schema, 4 * tables);
    assert!(kept.dictionary_enabled(&parquet::schema::types::ColumnPath::from("c0")));
    let plain = fit_dictionaries(data_file_properties(1 << 20).build(), &schema, 4 * tables - 4);
    assert!(!plain.dictionary_enabled(&parquet::schema::types::ColumnPath::from("c63")));
    assert!(plain.dictionary_enabled(&parquet::schema::types::ColumnPath::from("s")), "a string column keeps its dictionary");
    // Written: with 64 MiB of room every chunk has a dictionary page; with 1 MiB, none does.
    let b = wide(64, 5_000);
    for (room, want) in [(64 << 20, 64), (1 << 20, 0)] {
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(room), chunk_size: 64 << 10, ..ControllerConfig::default() }).unwrap();
        let dir = tempfile::tempdir().unwrap();
        write_data_file(&StdFs, dir.path(), "d.parquet", std::slice::from_ref(&b), &WriteOptions::default(), &ctl, None).unwrap();
        let path = dir.path().join("d.parquet");
        let groups = row_groups(&path).len();
        assert_eq!(dictionary_pages(&path), want * groups, "room {room}");
        assert_eq!(arrow_select::concat::concat_batches(&b.schema(), &read_all(&path)).unwrap(), b, "room {room}");
        assert_eq!(ctl.category_bytes(Category::WriteBuffers), 0);
    }
}

/// A controller of 4 MiB with all but `room` bytes held under `metadata` by the returned
/// reservation.
fn tight(room: usize) -> (Arc<MemoryController>, Reservation) {
    let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(4 << 20), chunk_size: 64 << 10, ..ControllerConfig::default() }).unwrap();
    let mut held = Reservation::new(&ctl, Category::Metadata, None);
    held.try_resize((4 << 20) - room).unwrap();
    (ctl, held)
}

#[test]
fn without_count_past_limit_a_write_is_refused_instead_of_passing_the_limit() {
    // 96 KiB of room: the smallest step (64 KiB of Arrow bytes) budgeted at 400% does not fit.
    for threads in [1, 2] {
        let (ctl, _held) = tight(96 << 10);
        let dir = tempfile::tempdir().unwrap();
        let o = WriteOptions { count_past_limit: false, ..opts(threads) };
        let err = write_data_file(&StdFs, dir.path(), "f.parquet", &batches(), &o, &ctl, None).unwrap_err();
        assert!(matches!(err, StorageError::Memory(_)), "{threads} threads: {err}");
        assert!(listing(dir.path()).is_empty(), "{threads} threads");
        assert_eq!(ctl.category_bytes(Category::WriteBuffers), 0);
        assert!(ctl.peak() <= 4 << 20, "{threads} threads: peak {}", ctl.peak());
        // With it (a flush's options), the same write finishes, its last steps budgeted bare.
        let o = WriteOptions { count_past_limit: true, ..opts(threads) };
        write_data_file(&StdFs, dir.path(), "g.parquet", &batches(), &o, &ctl, None).unwrap();
        assert_eq!(row_groups(&dir.path().join("g.parquet")).iter().sum::<i64>(), 15_000);
        assert_eq!(ctl.category_bytes(Category::WriteBuffers), 0);
    }
}

#[test]
fn a_write_waits_for_memory_given_back_before_its_last_resort() {
    for threads in [1, 2] {
        let (ctl, held) = tight(96 << 10);
        let held = Arc::new(Mutex::new(held));
        let calls = Arc::new(AtomicUsize::new(0));
        let wait = {
            let (held, calls) = (Arc::clone(&held), Arc::clone(&calls));
            // The other holder gives 2 MiB back during the first wait.
            MemoryWait::new(move |waited| {
                assert!(waited < std::time::Duration::from_mins(1));
                if calls.fetch_add(1, Ordering::AcqRel) == 0 {
                    held.lock().unwrap().shrink(2 << 20);
                }
                true
            })
        };
        let dir = tempfile::tempdir().unwrap();
        let o = WriteOptions { memory_wait: Some(wait), ..opts(threads) };
        write_data_file(&StdFs, dir.path(), "f.parquet", &batches(), &o, &ctl, None).unwrap();
        let expected = arrow_select::concat::concat_batches(&schema(), &batches()).unwrap();
        let got = arrow_select::concat::concat_batches(&schema(), &read_all(&dir.path().join("f.parquet"))).unwrap();
        assert_eq!(got, expected, "{threads} threads");
        assert_eq!(calls.load(Ordering::Acquire), 1, "{threads} threads: asked once, then room");
        // Waited instead of counting the step past the limit.
        assert!(ctl.peak() <= 4 << 20, "{threads} threads: peak {}", ctl.peak());
        assert_eq!(ctl.category_bytes(Category::WriteBuffers), 0);
        // A wait that says nothing will come back leaves the bare last resort: it finishes.
        let (ctl, _held) = tight(96 << 10);
        let o = WriteOptions { memory_wait: Some(MemoryWait::new(|_| false)), ..opts(threads) };
        write_data_file(&StdFs, dir.path(), "g.parquet", &batches(), &o, &ctl, None).unwrap();
        assert_eq!(row_groups(&dir.path().join("g.parquet")).iter().sum::<i64>(), 15_000);
    }
}

/// A file's steps teach the next file written with the same options (or a clone: a table's
/// flushes share theirs) how much a step adds, and its first step is budgeted at that instead
/// of `FIRST_GROWTH_PCT`; options built apart learn apart.
#[test]
fn a_files_first_step_is_budgeted_at_what_earlier_files_learned() {
    let dir = tempfile::tempdir().unwrap();
    let ctl = ctl();
    let o = opts(1);
    assert_eq!(o.learned_growth.pct(), None);
    write_data_file(&StdFs, dir.path(), "a.parquet", &batches(), &o, &ctl, None).unwrap();
    let learned = o.learned_growth.pct().expect("learned from the first file");
    assert!((100..=MAX_GROWTH_PCT).contains(&learned), "{learned}");
    let shared = o.clone();
    assert_eq!(shared.learned_growth.pct(), Some(learned));
    assert_eq!(opts(1).learned_growth.pct(), None, "options built apart learn apart");
    let descr_schema = schema();
    let (budget, _) = Budget::for_file(&ctl, None, &descr_schema, data_file_properties(4_000).build(), WrittenMetadata::CountPastLimit, &shared.learned_growth);
    assert_eq!(budget.growth_pct(), learned, "the next file starts at what was learned");
    let (fresh, _) =
        Budget::for_file(&ctl, None, &descr_schema, data_file_properties(4_000).build(), WrittenMetadata::CountPastLimit, &LearnedGrowth::default());
    assert_eq!(fresh.growth_pct(), FIRST_GROWTH_PCT);
    // A second file never lowers what was learned.
    write_data_file(&StdFs, dir.path(), "b.parquet", &batches()[..1], &shared, &ctl, None).unwrap();
    assert!(o.learned_growth.pct().unwrap() >= learned);
}

/// The most value bytes (the page index's `unencoded_byte_array_data_bytes`) any data page of
/// any byte-array column chunk of the file at `path` holds.
fn largest_page_values(path: &Path) -> i64 {
    let f = fs::File::open(path).unwrap();
    let md = ParquetMetaDataReader::new().with_offset_index_policy(PageIndexPolicy::Optional).parse_and_finish(&f).unwrap();
    let index = md.offset_index().expect("the file has an offset index");
    index.iter().flatten().filter_map(|c| c.unencoded_byte_array_data_bytes().map(|s| s.iter().copied().max().unwrap_or(0))).max().unwrap_or(0)
}

/// 60,000 rows of 14-byte strings with two clusters of 24 consecutive 512 KiB values in one
/// input batch, as `Utf8`, `Binary`, `Utf8View`, `List<Utf8>` (one value a row) and a struct
/// of one `Utf8` field.
fn clustered(kind: &str) -> RecordBatch {
    let wide = |k: usize| (20_100..20_124).contains(&k) || (45_500..45_524).contains(&k);
    let values: Vec<String> = (0..60_000).map(|k| format!("{k:>10}").chars().cycle().take(if wide(k) { 512 << 10 } else { 14 }).collect()).collect();
    let utf8 = || Arc::new(StringArray::from_iter_values(values.iter())) as ArrayRef;
    let col: ArrayRef = match kind {
        "Utf8" => utf8(),
        "Binary" => Arc::new(arrow_array::BinaryArray::from_iter_values(values.iter())),
        "Utf8View" => Arc::new(arrow_array::StringViewArray::from_iter_values(values.iter())),
        "List<Utf8>" => {
            let offsets = arrow_buffer::OffsetBuffer::from_lengths(std::iter::repeat_n(1, values.len()));
            Arc::new(arrow_array::ListArray::new(Arc::new(Field::new("item", DataType::Utf8, false)), offsets, utf8(), None))
        }
        _ => Arc::new(StructArray::from(vec![(Arc::new(Field::new("s", DataType::Utf8, false)), utf8())])),
    };
    let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("s", col.data_type().clone(), false)]));
    RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from_iter_values(0..60_000)), col]).unwrap()
}

/// A data page holds at most two pages' worth of value bytes when no value is wider than a
/// page (`DATA_PAGE_BYTES` a step and a column, on top of a page not yet full), however the
/// wide values cluster in the input batch, in flat and nested columns: 1,650,368 bytes at most here, against 11,540,272 before.
/// parquet 59.3 sizes a mini-batch from the first values of a chunk and writes the rest of the
/// chunk in mini-batches of that many rows, so a step of 8,192 rows whose first rows are narrow
/// put 22 values of 512 KiB in one page, which a reader must then decompress whole
/// (`breaker_trial2::clusters_of_wide_values_among_narrow_ones_scan_at_16_mib`).
#[test]
fn clustered_wide_values_leave_no_page_past_two_page_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let ctl = ctl();
    for (i, kind) in ["Utf8", "Binary", "Utf8View", "List<Utf8>", "Struct<Utf8>"].iter().enumerate() {
        let b = clustered(kind);
        let name = format!("c{i}.parquet");
        for threads in [1, 2] {
            let o = WriteOptions { encode_threads: threads, ..WriteOptions::default() };
            write_data_file(&StdFs, dir.path(), &name, std::slice::from_ref(&b), &o, &ctl, None).unwrap();
            let path = dir.path().join(&name);
            let largest = largest_page_values(&path);
            assert!(largest <= 2 * DATA_PAGE_BYTES as i64, "{kind} on {threads} threads: a page of {largest} value bytes");
            let got = arrow_select::concat::concat_batches(&b.schema(), &read_all(&path)).unwrap();
            assert_eq!(got, b, "{kind} on {threads} threads");
            fs::remove_file(&path).unwrap();
        }
    }
}

/// `range_bytes` counts what a range of rows uses, on slices and inside nested columns: a list
/// slice counts its own child values, not the whole child array as Arrow's
/// `get_slice_memory_size` does, and a view array the lengths its views give.
#[test]
fn range_bytes_counts_the_rows_own_values() {
    use arrow_array::Array;
    let words: Vec<String> = (0..100).map(|i| "x".repeat(i)).collect();
    let s = StringArray::from_iter_values(words.iter());
    // Rows 10..20 of a slice starting at row 5: values of lengths 15..25, 4-byte offsets.
    let sliced = s.slice(5, 50).to_data();
    assert_eq!(range_bytes(&sliced, 10, 10), (15..25).sum::<usize>() + 40);
    let views = arrow_array::StringViewArray::from_iter_values(words.iter()).slice(5, 50).to_data();
    // Lengths 15..25 are out of line; of 5..15, only 13 and 14.
    assert_eq!(range_bytes(&views, 10, 10), (15..25).sum::<usize>() + 160);
    assert_eq!(range_bytes(&views, 0, 10), 13 + 14 + 160);
    // A list of two strings a row (rows 2i, 2i+1 of `words`), sliced.
    let offsets = arrow_buffer::OffsetBuffer::from_lengths(std::iter::repeat_n(2, 50));
    let list = arrow_array::ListArray::new(Arc::new(Field::new("item", DataType::Utf8, false)), offsets, Arc::new(s.clone()), None);
    let data = list.slice(10, 20).to_data();
    // Rows 3..5 of the slice: list rows 13 and 14, strings 26..30.
    assert_eq!(range_bytes(&data, 3, 2), (26..30).sum::<usize>() + 4 * 4 + 2 * 4);
    assert!(list.slice(10, 2).to_data().get_slice_memory_size().unwrap() > 4_000, "Arrow counts the whole child");
    assert_eq!(
        crate::batch_bytes(&RecordBatch::try_from_iter([("l", Arc::new(list.slice(10, 2)) as ArrayRef)]).unwrap()),
        (20..24).sum::<usize>() + 4 * 4 + 2 * 4
    );
    // Fixed widths and nulls.
    let ints = Int64Array::from(vec![Some(1), None, Some(3), Some(4)]).to_data();
    assert_eq!(range_bytes(&ints, 1, 3), 24 + 1);
    let st = StructArray::from(vec![
        (Arc::new(Field::new("a", DataType::Int32, false)), Arc::new(Int32Array::from(vec![1, 2, 3, 4])) as ArrayRef),
        (Arc::new(Field::new("b", DataType::Utf8, false)), Arc::new(StringArray::from(vec!["a", "bb", "ccc", "dddd"])) as ArrayRef),
    ])
    .slice(1, 3)
    .to_data();
    assert_eq!(range_bytes(&st, 1, 2), 8 + (3 + 4) + 8);
}

/// `batch_bytes` counts a view column's out-of-line values beside its views, and a slice only
/// the values its own views point to: 200,000 views of 25-byte strings are 3.2 MB of views and
/// 5.0 MB of values (Arrow's `get_slice_memory_size` said 3.2 MB in all).
#[test]
fn batch_bytes_counts_a_view_columns_values() {
    let n = 200_000;
    let v = arrow_array::StringViewArray::from_iter_values((0..n).map(|k| format!("value {k:0>12} v1")));
    let b = RecordBatch::try_from_iter([("v", Arc::new(v) as ArrayRef)]).unwrap();
    assert_eq!(crate::batch_bytes(&b), n * (16 + 21));
    assert_eq!(crate::batch_bytes(&b.slice(1_000, 1_000)), 1_000 * (16 + 21));
    // Values of at most 12 bytes live in their views.
    let short = arrow_array::StringViewArray::from_iter_values((0..n).map(|k| format!("{k}")));
    assert_eq!(crate::batch_bytes(&RecordBatch::try_from_iter([("v", Arc::new(short) as ArrayRef)]).unwrap()), n * 16);
}

/// A flush of a wide table at a tight limit does not cut a row group that keeps more of its
/// metadata to the file's end than it frees: 20 rows of 200 `Utf8` columns (100-byte values,
/// 21 KB a row) written with 128 KiB of row-group cut and 2 MiB of room made a row group of
/// every row, 4.63 MB of `write_buffers` held for their metadata (19 row groups × 200
/// column chunks × ~1.2 KB) and a peak of 4.79 MB. Now a row group is cut only once it holds
/// twice its metadata ([`Budget::worth_closing`]), and at the smallest step the writer goes
/// bare before it closes a row group not worth closing. On one and two encode threads.
#[test]
fn a_wide_tables_flush_at_a_tight_limit_does_not_cut_row_groups_smaller_than_their_metadata() {
    let fields: Vec<Field> = (0..200).map(|c| Field::new(format!("s{c}"), DataType::Utf8, true)).collect();
    let cols: Vec<ArrayRef> = (0..200).map(|c| Arc::new(StringArray::from_iter_values((0..20).map(|k| format!("{:0100}", k * 200 + c)))) as ArrayRef).collect();
    let b = RecordBatch::try_new(Arc::new(Schema::new(fields)), cols).unwrap();
    let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(2 << 20), chunk_size: 64 << 10, ..ControllerConfig::default() }).unwrap();
    for threads in [1, 2] {
        ctl.reset_peaks();
        let dir = tempfile::tempdir().unwrap();
        let o = WriteOptions { row_group_bytes: 128 << 10, encode_threads: threads, ..WriteOptions::default() };
        write_data_file(&StdFs, dir.path(), "w.parquet", std::slice::from_ref(&b), &o, &ctl, None).unwrap();
        let path = dir.path().join("w.parquet");
        let groups = row_groups(&path);
        assert_eq!(groups.iter().sum::<i64>(), 20, "{threads} threads");
        // Each row group holds at least twice its metadata (200 × `WRITTEN_CHUNK_BYTES`):
        // about 10 of these rows.
        assert!(groups.len() <= 3, "{threads} threads: {groups:?}");
        assert_eq!(arrow_select::concat::concat_batches(&b.schema(), &read_all(&path)).unwrap(), b, "{threads} threads");
        let peak = ctl.category_peak(Category::WriteBuffers);
        assert!(peak <= 2 << 20, "{threads} threads: write_buffers peaked at {peak} B at a 2 MiB limit");
        assert_eq!(ctl.used(), 0, "{threads} threads: released with the writer");
    }
}
