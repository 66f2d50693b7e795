//! Breaker trial 4: fault classes from public bug reports of DuckDB, DataFusion, arrow-rs /
//! parquet and Delta/Iceberg-style stores: keys differing only in trailing bytes of 100 KB,
//! truncated byte-array statistics, unsigned and decimal statistics pruning, empty strings vs
//! nulls in keys, sliced boolean/view key batches, update of deleted keys in every layer,
//! zero-row writes, unsupported types, time-zone mismatches, field-name case and metadata,
//! zero-column projections with filters, stale handles after a case-variant re-create,
//! extreme configuration values and stray files in the table directory.

use arrow::array::{
    Array, ArrayRef, AsArray, BinaryArray, BinaryViewArray, BooleanArray, Decimal128Array, DictionaryArray, Int64Array, LargeBinaryArray, LargeStringArray,
    RecordBatch, StringArray, StringViewArray, TimestampMicrosecondArray, UInt8Array, UInt16Array, UInt32Array, UInt64Array,
};
use arrow::datatypes::{DataType, Field, Fields, Int32Type, IntervalUnit, Schema, SchemaRef, TimeUnit};
use arrow::util::display::{ArrayFormatter, FormatOptions};
use gritdb::{CompareOp, Engine, EngineConfig, Error, ScanFilter, ScanOptions, Table, UnifyError};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const MIB: usize = 1 << 20;
const OPS: [CompareOp; 6] = [CompareOp::Eq, CompareOp::NotEq, CompareOp::Lt, CompareOp::LtEq, CompareOp::Gt, CompareOp::GtEq];

fn cfg(limit: usize) -> EngineConfig {
    EngineConfig::default().memory_limit(limit).flush_age(Duration::from_secs(3600)).backpressure_timeout(Duration::from_secs(5))
}

fn open(dir: &Path) -> Engine {
    Engine::open(dir, cfg(64 * MIB)).unwrap()
}

fn holds<T: Ord + ?Sized>(op: CompareOp, a: &T, b: &T) -> bool {
    match op {
        CompareOp::Eq => a == b,
        CompareOp::NotEq => a != b,
        CompareOp::Lt => a < b,
        CompareOp::LtEq => a <= b,
        CompareOp::Gt => a > b,
        CompareOp::GtEq => a >= b,
        _ => unreachable!(),
    }
}

/// Every row of every batch as one display string, sorted.
fn dump_batches(batches: impl IntoIterator<Item = RecordBatch>) -> Vec<String> {
    let opts = FormatOptions::default().with_null("<null>");
    let mut out = Vec::new();
    for b in batches {
        let fmts: Vec<_> = b.columns().iter().map(|c| ArrayFormatter::try_new(c.as_ref(), &opts).unwrap()).collect();
        for r in 0..b.num_rows() {
            out.push(fmts.iter().map(|f| f.value(r).to_string()).collect::<Vec<_>>().join("|"));
        }
    }
    out.sort();
    out
}

fn dump(t: &Table) -> Vec<String> {
    dump_batches(t.scan(ScanOptions::default()).unwrap().map(Result::unwrap))
}

/// Rows matching `f` (key projection).
fn count(t: &Table, f: ScanFilter) -> usize {
    t.scan(ScanOptions::default().projection(t.primary_key()).filter(f)).unwrap().map(|b| b.unwrap().num_rows()).sum()
}

fn batch(schema: &SchemaRef, cols: Vec<ArrayRef>) -> RecordBatch {
    RecordBatch::try_new(Arc::clone(schema), cols).unwrap()
}

fn schema(fields: Vec<Field>) -> SchemaRef {
    Arc::new(Schema::new(fields))
}

// =====================================================================================
// 1. 100 KB keys differing only in trailing bytes, every byte-array key type
// =====================================================================================

fn bytes_array(dt: &DataType, vals: &[Vec<u8>]) -> ArrayRef {
    let s = || vals.iter().map(|v| std::str::from_utf8(v).unwrap());
    match dt {
        DataType::Binary => Arc::new(BinaryArray::from_iter_values(vals)),
        DataType::LargeBinary => Arc::new(LargeBinaryArray::from_iter_values(vals)),
        DataType::BinaryView => Arc::new(BinaryViewArray::from_iter_values(vals)),
        DataType::Utf8 => Arc::new(StringArray::from_iter_values(s())),
        DataType::LargeUtf8 => Arc::new(LargeStringArray::from_iter_values(s())),
        DataType::Utf8View => Arc::new(StringViewArray::from_iter_values(s())),
        _ => unreachable!(),
    }
}

fn bytes_at(a: &dyn Array, i: usize) -> Vec<u8> {
    match a.data_type() {
        DataType::Binary => a.as_binary::<i32>().value(i).to_vec(),
        DataType::LargeBinary => a.as_binary::<i64>().value(i).to_vec(),
        DataType::BinaryView => a.as_binary_view().value(i).to_vec(),
        DataType::Utf8 => a.as_string::<i32>().value(i).as_bytes().to_vec(),
        DataType::LargeUtf8 => a.as_string::<i64>().value(i).as_bytes().to_vec(),
        DataType::Utf8View => a.as_string_view().value(i).as_bytes().to_vec(),
        t => panic!("type {t}"),
    }
}

fn read_bytes_model(t: &Table) -> BTreeMap<Vec<u8>, i64> {
    let mut m = BTreeMap::new();
    for b in t.scan(ScanOptions::default()).unwrap() {
        let b = b.unwrap();
        let v = b.column(1).as_primitive::<arrow::datatypes::Int64Type>();
        for i in 0..b.num_rows() {
            assert!(m.insert(bytes_at(b.column(0).as_ref(), i), v.value(i)).is_none(), "a key returned twice");
        }
    }
    m
}

/// Ten keys of 100 KB that share everything but their last zero to two bytes (the bare
/// prefix, prefix+0x00, prefix+0x00 0x00, ...; for binary types also 0xFF tails) are distinct
/// keys in the delta, in files (whose statistics are truncated far before the difference),
/// after compaction and after reopen: upserts replace exactly one of them, deletes remove
/// exactly one, a point filter finds exactly one.
#[test]
fn hundred_kb_keys_differing_only_in_trailing_bytes() {
    for dt in [DataType::Binary, DataType::LargeBinary, DataType::BinaryView, DataType::Utf8, DataType::LargeUtf8, DataType::Utf8View] {
        let dir = tempfile::tempdir().unwrap();
        let base: Vec<u8> = (0..100_000u32).map(|i| b'a' + (i % 26) as u8).collect();
        let mut tails: Vec<Vec<u8>> = vec![vec![], vec![0], vec![0, 0], vec![1], vec![0x7f], vec![b'b'], vec![0, 1]];
        if matches!(dt, DataType::Binary | DataType::LargeBinary | DataType::BinaryView) {
            tails.extend([vec![0xff], vec![0xff, 0xff], vec![0xff, 0]]);
        }
        let keys: Vec<Vec<u8>> = tails.iter().map(|t| [base.as_slice(), t].concat()).collect();
        let s = schema(vec![Field::new("k", dt.clone(), false), Field::new("v", DataType::Int64, false)]);
        let mk = |ks: &[Vec<u8>], vs: Vec<i64>| batch(&s, vec![bytes_array(&dt, ks), Arc::new(Int64Array::from(vs))]);
        let mkk = |ks: &[Vec<u8>]| RecordBatch::try_new(schema(vec![Field::new("k", dt.clone(), false)]), vec![bytes_array(&dt, ks)]).unwrap();
        let mut model: BTreeMap<Vec<u8>, i64> = BTreeMap::new();
        {
            let engine = open(dir.path());
            let t = engine.create_table("t", Arc::clone(&s), &["k"]).unwrap();
            assert_eq!(t.insert(&mk(&keys, (0..keys.len() as i64).collect())).unwrap(), keys.len());
            for (i, k) in keys.iter().enumerate() {
                model.insert(k.clone(), i as i64);
            }
            // A repeat of any one key is refused as existing.
            for (i, k) in keys.iter().enumerate() {
                match t.insert(&mk(std::slice::from_ref(k), vec![-1])) {
                    Err(Error::KeyExists { row: 0, .. }) => {}
                    other => panic!("{dt}: key {i}: {other:?}"),
                }
            }
            t.flush().unwrap();
            for round in 1..=6i64 {
                // Upsert every other key (rotating), delete one, reinsert a deleted one.
                let pick: Vec<Vec<u8>> = keys.iter().enumerate().filter(|(i, _)| (*i as i64 + round) % 2 == 0).map(|(_, k)| k.clone()).collect();
                t.upsert(&mk(&pick, pick.iter().map(|_| round * 100).collect())).unwrap();
                for k in &pick {
                    model.insert(k.clone(), round * 100);
                }
                let victim = &keys[(round as usize * 3) % keys.len()];
                let expect = usize::from(model.remove(victim).is_some());
                assert_eq!(t.delete(&mkk(std::slice::from_ref(victim))).unwrap(), expect, "{dt} round {round}");
                if round % 2 == 0 {
                    let back = &keys[(round as usize * 3 + 1) % keys.len()];
                    if !model.contains_key(back) {
                        t.insert(&mk(std::slice::from_ref(back), vec![round * 1000])).unwrap();
                        model.insert(back.clone(), round * 1000);
                    }
                }
                t.flush().unwrap();
                assert_eq!(read_bytes_model(&t), model, "{dt} round {round}");
            }
            assert_eq!(read_bytes_model(&t), model, "{dt} before close");
            engine.close().unwrap();
        }
        let engine = open(dir.path());
        let t = engine.table("t").unwrap();
        assert_eq!(read_bytes_model(&t), model, "{dt} after reopen");
        for k in &keys {
            let lit = bytes_array(&dt, std::slice::from_ref(k));
            assert_eq!(count(&t, ScanFilter::compare("k", CompareOp::Eq, lit.clone())), usize::from(model.contains_key(k)), "{dt}: point filter");
            let below = model.keys().filter(|m| *m < k).count();
            assert_eq!(count(&t, ScanFilter::compare("k", CompareOp::Lt, lit)), below, "{dt}: < filter");
        }
        // Writes after reopen still find each key exactly.
        let live: Vec<Vec<u8>> = model.keys().cloned().collect();
        assert_eq!(t.update(&mk(&live, live.iter().map(|_| 7).collect())).unwrap(), live.len());
        t.flush().unwrap();
        let got = read_bytes_model(&t);
        assert_eq!(got.len(), live.len(), "{dt}");
        assert!(got.values().all(|&v| v == 7), "{dt}");
    }
}

// =====================================================================================
// 2. Byte-array statistics truncated in the middle of multi-byte characters / 0xFF runs
// =====================================================================================

fn probe_strings() -> Vec<Vec<Option<String>>> {
    let fam = |unit: &str, n: usize, tails: &[&str]| -> Vec<Option<String>> { tails.iter().map(|t| Some(format!("{}{t}", unit.repeat(n)))).collect() };
    vec![
        fam("é", 40, &["a", "b", "", "\u{10FFFF}"]),
        fam("€", 30, &["a", "z", "€", ""]),
        fam("\u{10FFFF}", 25, &["", "a", "\u{10FFFF}"]),
        fam("𝄞", 20, &["x", "y", "é"]),
        {
            let mut v = fam("z", 70, &["", "\u{7f}", "\u{80}"]);
            v.push(None);
            v
        },
    ]
}

fn probe_binaries() -> Vec<Vec<Option<Vec<u8>>>> {
    let ff = |n: usize, tail: &[u8]| Some([vec![0xffu8; n], tail.to_vec()].concat());
    vec![
        vec![ff(80, &[]), ff(80, &[0]), ff(100, &[]), ff(79, &[0xfe])],
        vec![Some([vec![0xfe], vec![0xff; 70]].concat()), Some([vec![0xfe], vec![0xff; 70], vec![0]].concat()), None],
        vec![Some(vec![0u8; 70]), Some([vec![0u8; 70], vec![1]].concat()), Some(vec![])],
        vec![ff(64, &[]), ff(63, &[]), ff(65, &[])],
        vec![Some(vec![0x7f; 90]), Some([vec![0x7f; 64], vec![0x80]].concat())],
    ]
}

/// Filters on long strings made of 2-, 3- and 4-byte characters (U+10FFFF among them) and on
/// binaries made of 0xFF runs, whose Parquet statistics are truncated (min/max at 64 bytes,
/// the max "incremented"), answer exactly as the model for every operator and every probe,
/// one family per file, after flush and after reopen (arrow-rs truncation bugs: a max cut
/// inside a character, or a 0xFF max that cannot be incremented, pruned matching rows).
#[test]
fn filters_on_long_multibyte_strings_and_ff_binaries_are_exact_after_flush() {
    let dir = tempfile::tempdir().unwrap();
    let s = schema(vec![Field::new("k", DataType::Int64, false), Field::new("s", DataType::Utf8, true), Field::new("b", DataType::Binary, true)]);
    let strs = probe_strings();
    let bins = probe_binaries();
    let mut all_s: Vec<Option<String>> = Vec::new();
    let mut all_b: Vec<Option<Vec<u8>>> = Vec::new();
    let engine = open(dir.path());
    let t = engine.create_table("t", Arc::clone(&s), &["k"]).unwrap();
    let mut k = 0i64;
    for f in 0..strs.len().max(bins.len()) {
        let sv = strs.get(f).cloned().unwrap_or_default();
        let bv = bins.get(f).cloned().unwrap_or_default();
        let n = sv.len().max(bv.len());
        let sv: Vec<Option<String>> = (0..n).map(|i| sv.get(i).cloned().flatten()).collect();
        let bv: Vec<Option<Vec<u8>>> = (0..n).map(|i| bv.get(i).cloned().flatten()).collect();
        let keys: Vec<i64> = (k..k + n as i64).collect();
        k += n as i64;
        t.insert(&batch(
            &s,
            vec![
                Arc::new(Int64Array::from(keys)),
                Arc::new(StringArray::from(sv.iter().map(|x| x.as_deref()).collect::<Vec<_>>())),
                Arc::new(BinaryArray::from(bv.iter().map(|x| x.as_deref()).collect::<Vec<_>>())),
            ],
        ))
        .unwrap();
        t.flush().unwrap();
        all_s.extend(sv);
        all_b.extend(bv);
    }
    // Probes: every value, every value with its last character removed / a NUL appended.
    let mut sp: Vec<String> = all_s.iter().flatten().cloned().collect();
    for v in all_s.iter().flatten() {
        let mut c = v.clone();
        c.pop();
        sp.push(c);
        sp.push(format!("{v}\0"));
        sp.push(v.chars().take(21).collect());
    }
    let mut bp: Vec<Vec<u8>> = all_b.iter().flatten().cloned().collect();
    for v in all_b.iter().flatten() {
        bp.push(v[..v.len().saturating_sub(1)].to_vec());
        bp.push([v.as_slice(), &[0]].concat());
        bp.push(v[..v.len().min(64)].to_vec());
    }
    let check = |t: &Table, when: &str| {
        let mut bad = Vec::new();
        for p in &sp {
            for op in OPS {
                let want = all_s.iter().flatten().filter(|v| holds(op, v.as_bytes(), p.as_bytes())).count();
                let got = count(t, ScanFilter::compare("s", op, Arc::new(StringArray::from(vec![p.as_str()]))));
                if got != want {
                    bad.push(format!("s {op:?} {:?}..(len {}): got {got}, want {want}", p.chars().take(3).collect::<String>(), p.len()));
                }
            }
        }
        for p in &bp {
            for op in OPS {
                let want = all_b.iter().flatten().filter(|v| holds(op, v.as_slice(), p.as_slice())).count();
                let got = count(t, ScanFilter::compare("b", op, Arc::new(BinaryArray::from(vec![p.as_slice()]))));
                if got != want {
                    bad.push(format!("b {op:?} {:02x?}..(len {}): got {got}, want {want}", &p[..p.len().min(3)], p.len()));
                }
            }
        }
        assert!(bad.is_empty(), "{when}: {} wrong answers, first: {:#?}", bad.len(), &bad[..bad.len().min(10)]);
    };
    check_then_reopen(&t, engine, dir.path(), check);
}

// =====================================================================================
// 3. Unsigned statistics above the signed range
// =====================================================================================

/// A `UInt64` key (and `UInt32`, `UInt16`, `UInt8` columns) whose values straddle the signed
/// range (2^63, 2^31, 2^15, 2^7) and reach the type maximum, one range per file plus a file
/// mixing them: every filter answers as the model (statistics compared as signed would prune
/// the upper half), the key index finds every key after reopen, scans return all rows.
#[test]
fn unsigned_filters_and_keys_across_the_sign_bit_are_exact() {
    let dir = tempfile::tempdir().unwrap();
    let s = schema(vec![
        Field::new("u", DataType::UInt64, false),
        Field::new("w", DataType::UInt32, false),
        Field::new("y", DataType::UInt16, false),
        Field::new("x", DataType::UInt8, false),
    ]);
    let ranges: Vec<Vec<u64>> = vec![
        (0..20).collect(),
        ((1u64 << 63) - 10..(1u64 << 63) + 10).collect(),
        (u64::MAX - 19..=u64::MAX).collect(),
        vec![20, 21, (1 << 63) - 11, (1 << 63) + 10, u64::MAX - 20],
    ];
    let map_w = |u: u64, i: usize| match i {
        0 => u as u32,
        1 => (1u32 << 31) - 10 + (u.wrapping_sub((1 << 63) - 10) as u32 % 20),
        2 => u32::MAX - (u64::MAX - u) as u32,
        _ => [20, 21, (1 << 31) - 11, (1 << 31) + 10, u32::MAX - 20][(u as usize) % 5],
    };
    let mut rows: Vec<(u64, u32, u16, u8)> = Vec::new();
    let engine = open(dir.path());
    let t = engine.create_table("t", Arc::clone(&s), &["u"]).unwrap();
    for (i, r) in ranges.iter().enumerate() {
        let part: Vec<(u64, u32, u16, u8)> = r
            .iter()
            .map(|&u| {
                let w = map_w(u, i);
                (u, w, (w >> 16) as u16 ^ (w as u16), (w as u8) ^ ((w >> 24) as u8))
            })
            .collect();
        t.insert(&batch(
            &s,
            vec![
                Arc::new(UInt64Array::from(part.iter().map(|r| r.0).collect::<Vec<_>>())),
                Arc::new(UInt32Array::from(part.iter().map(|r| r.1).collect::<Vec<_>>())),
                Arc::new(UInt16Array::from(part.iter().map(|r| r.2).collect::<Vec<_>>())),
                Arc::new(UInt8Array::from(part.iter().map(|r| r.3).collect::<Vec<_>>())),
            ],
        ))
        .unwrap();
        t.flush().unwrap();
        rows.extend(part);
    }
    let check = |t: &Table, when: &str| {
        let mut bad = Vec::new();
        let mut probe = |col: &str, lit: ArrayRef, want: &dyn Fn(CompareOp) -> usize| {
            for op in OPS {
                let got = count(t, ScanFilter::compare(col, op, Arc::clone(&lit)));
                if got != want(op) {
                    bad.push(format!("{col} {op:?} {:?}: got {got}, want {}", lit, want(op)));
                }
            }
        };
        for &(u, w, y, x) in rows.iter().step_by(3).chain([(1u64 << 63, 1u32 << 31, 1u16 << 15, 128u8)].iter()) {
            probe("u", Arc::new(UInt64Array::from(vec![u])), &|op| rows.iter().filter(|r| holds(op, &r.0, &u)).count());
            probe("w", Arc::new(UInt32Array::from(vec![w])), &|op| rows.iter().filter(|r| holds(op, &r.1, &w)).count());
            probe("y", Arc::new(UInt16Array::from(vec![y])), &|op| rows.iter().filter(|r| holds(op, &r.2, &y)).count());
            probe("x", Arc::new(UInt8Array::from(vec![x])), &|op| rows.iter().filter(|r| holds(op, &r.3, &x)).count());
        }
        // An Int64 literal on the UInt64 column is cast losslessly.
        probe("u", Arc::new(Int64Array::from(vec![i64::MAX])), &|op| rows.iter().filter(|r| holds(op, &r.0, &(i64::MAX as u64))).count());
        assert!(bad.is_empty(), "{when}: {} wrong, first {:#?}", bad.len(), &bad[..bad.len().min(10)]);
        match t.scan(ScanOptions::default().filter(ScanFilter::compare("u", CompareOp::Gt, Arc::new(Int64Array::from(vec![-1]))))) {
            Err(Error::InvalidFilter { .. }) => {}
            other => panic!("{when}: a negative literal on UInt64: {:?}", other.map(|_| ())),
        }
        let n: usize = t.scan(ScanOptions::default()).unwrap().map(|b| b.unwrap().num_rows()).sum();
        assert_eq!(n, rows.len(), "{when}");
        // Every key exists for insert and update.
        for &(u, ..) in &rows {
            let b = batch(
                &s,
                vec![
                    Arc::new(UInt64Array::from(vec![u])),
                    Arc::new(UInt32Array::from(vec![0])),
                    Arc::new(UInt16Array::from(vec![0])),
                    Arc::new(UInt8Array::from(vec![0])),
                ],
            );
            assert!(matches!(t.insert(&b), Err(Error::KeyExists { .. })), "{when}: key {u} not found by insert");
        }
    };
    check_then_reopen(&t, engine, dir.path(), check);
}

// =====================================================================================
// 4. Decimal statistics: negatives, extremes, every physical width
// =====================================================================================

/// `Decimal128(38,4)` (fixed-length bytes in Parquet), `(18,0)` (INT64) and `(9,2)` (INT32)
/// columns with negative, zero and extreme values, one sign per file plus a mixed file:
/// every comparison answers as the model (sign-unaware byte comparison of statistics is a
/// known Parquet bug class), with literals of the column type and Int64 literals.
#[test]
fn decimal_filters_with_negatives_and_extremes_are_exact() {
    let dir = tempfile::tempdir().unwrap();
    let s = schema(vec![
        Field::new("k", DataType::Int64, false),
        Field::new("d38", DataType::Decimal128(38, 4), true),
        Field::new("d18", DataType::Decimal128(18, 0), true),
        Field::new("d9", DataType::Decimal128(9, 2), true),
    ]);
    let m38 = 10i128.pow(38) - 1;
    let m18 = 10i128.pow(18) - 1;
    let m9 = 10i128.pow(9) - 1;
    let files: Vec<Vec<i128>> = vec![
        vec![-m38, -(1 << 70), -256, -255, -1],
        vec![1, 255, 256, 1 << 64, m38],
        vec![0, -1, 1, -(1 << 63), (1 << 63) - 1, -128, 127],
        vec![-129, 128, -(1 << 31), 1 << 31],
    ];
    let d = |v: i128, m: i128, p: u8, sc: i8| -> Decimal128Array { Decimal128Array::from(vec![Some(v.clamp(-m, m))]).with_precision_and_scale(p, sc).unwrap() };
    let engine = open(dir.path());
    let t = engine.create_table("t", Arc::clone(&s), &["k"]).unwrap();
    let mut rows: Vec<(i128, i128, i128)> = Vec::new();
    let mut k = 0i64;
    for f in &files {
        let part: Vec<(i128, i128, i128)> = f.iter().map(|&v| (v, v.clamp(-m18, m18), v.clamp(-m9, m9))).collect();
        let col = |sel: &dyn Fn(&(i128, i128, i128)) -> i128, p: u8, sc: i8| -> ArrayRef {
            Arc::new(Decimal128Array::from(part.iter().map(|r| Some(sel(r))).collect::<Vec<_>>()).with_precision_and_scale(p, sc).unwrap())
        };
        t.insert(&batch(
            &s,
            vec![Arc::new(Int64Array::from((k..k + part.len() as i64).collect::<Vec<_>>())), col(&|r| r.0, 38, 4), col(&|r| r.1, 18, 0), col(&|r| r.2, 9, 2)],
        ))
        .unwrap();
        k += part.len() as i64;
        t.flush().unwrap();
        rows.extend(part);
    }
    let check = |t: &Table, when: &str| {
        let mut bad = Vec::new();
        let mut probes: Vec<i128> = rows.iter().map(|r| r.0).collect();
        probes.extend([0, -2, 2, -(1 << 64), 1 << 70]);
        for &p in &probes {
            for op in OPS {
                for (col, m, pr, sc, sel) in [("d38", m38, 38u8, 4i8, 0usize), ("d18", m18, 18, 0, 1), ("d9", m9, 9, 2, 2)] {
                    let pv = p.clamp(-m, m);
                    let want = rows.iter().filter(|r| holds(op, &[r.0, r.1, r.2][sel], &pv)).count();
                    let got = count(t, ScanFilter::compare(col, op, Arc::new(d(pv, m, pr, sc))));
                    if got != want {
                        bad.push(format!("{col} {op:?} {pv}: got {got}, want {want}"));
                    }
                }
            }
        }
        // Int64 literals on the (18,0) column.
        for p in [-1i64, 0, 1, -999_999_999_999_999_999, 999_999_999_999_999_999, -256, 255, i64::from(i32::MIN), 1 << 31] {
            for op in OPS {
                let want = rows.iter().filter(|r| holds(op, &r.1, &i128::from(p))).count();
                let got = count(t, ScanFilter::compare("d18", op, Arc::new(Int64Array::from(vec![p]))));
                if got != want {
                    bad.push(format!("d18 {op:?} int {p}: got {got}, want {want}"));
                }
            }
        }
        assert!(bad.is_empty(), "{when}: {} wrong, first {:#?}", bad.len(), &bad[..bad.len().min(10)]);
    };
    check_then_reopen(&t, engine, dir.path(), check);
}

// =====================================================================================
// 5. Empty string vs null, empty binary keys
// =====================================================================================

/// A composite key (Utf8, Binary) where "" and an empty binary are ordinary values, distinct
/// from "\0" and [0]; value columns keep "" apart from null through flush, deletes,
/// re-inserts and reopen; `IS NULL` and `= ''` count exactly.
#[test]
fn empty_strings_and_empty_binaries_are_values_not_nulls() {
    let dir = tempfile::tempdir().unwrap();
    let s = schema(vec![
        Field::new("ks", DataType::Utf8, false),
        Field::new("kb", DataType::Binary, false),
        Field::new("s", DataType::Utf8, true),
        Field::new("lb", DataType::LargeBinary, true),
    ]);
    type Row = (String, Vec<u8>, Option<String>, Option<Vec<u8>>);
    let mk = |rows: &[Row]| {
        batch(
            &s,
            vec![
                Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.0.as_str()))),
                Arc::new(BinaryArray::from_iter_values(rows.iter().map(|r| r.1.as_slice()))),
                Arc::new(StringArray::from(rows.iter().map(|r| r.2.as_deref()).collect::<Vec<_>>())),
                Arc::new(LargeBinaryArray::from(rows.iter().map(|r| r.3.as_deref()).collect::<Vec<_>>())),
            ],
        )
    };
    let mkk = |keys: &[(&str, &[u8])]| {
        RecordBatch::try_new(
            schema(vec![Field::new("ks", DataType::Utf8, false), Field::new("kb", DataType::Binary, false)]),
            vec![Arc::new(StringArray::from_iter_values(keys.iter().map(|k| k.0))), Arc::new(BinaryArray::from_iter_values(keys.iter().map(|k| k.1)))],
        )
        .unwrap()
    };
    let r = |a: &str, b: &[u8], c: Option<&str>, d: Option<&[u8]>| -> Row { (a.into(), b.to_vec(), c.map(Into::into), d.map(<[u8]>::to_vec)) };
    let mut model: BTreeMap<(String, Vec<u8>), Row> = BTreeMap::new();
    let put = |m: &mut BTreeMap<(String, Vec<u8>), Row>, rows: &[Row]| {
        for x in rows {
            m.insert((x.0.clone(), x.1.clone()), x.clone());
        }
    };
    let first = vec![
        r("", b"", Some(""), Some(b"")),
        r("", b"\0", None, None),
        r("\0", b"", Some("\0"), Some(b"\0")),
        r("", b"\0\0", Some(""), None),
        r("a", b"", None, Some(b"")),
    ];
    let expect = |m: &BTreeMap<(String, Vec<u8>), Row>| dump_batches([mk(&m.values().cloned().collect::<Vec<_>>())]);
    let lit = |v: &str| -> ArrayRef { Arc::new(StringArray::from(vec![v])) };
    let counts = |t: &Table, m: &BTreeMap<(String, Vec<u8>), Row>, when: &str| {
        assert_eq!(dump(t), expect(m), "{when}");
        assert_eq!(count(t, ScanFilter::is_null("s")), m.values().filter(|x| x.2.is_none()).count(), "{when}: s IS NULL");
        assert_eq!(count(t, ScanFilter::compare("s", CompareOp::Eq, lit(""))), m.values().filter(|x| x.2.as_deref() == Some("")).count(), "{when}: s = ''");
        assert_eq!(count(t, ScanFilter::is_null("lb")), m.values().filter(|x| x.3.is_none()).count(), "{when}: lb IS NULL");
        assert_eq!(count(t, ScanFilter::compare("ks", CompareOp::Eq, lit(""))), m.keys().filter(|k| k.0.is_empty()).count(), "{when}: ks = ''");
        assert_eq!(
            count(t, ScanFilter::compare("kb", CompareOp::Eq, Arc::new(BinaryArray::from(vec![&b""[..]])))),
            m.keys().filter(|k| k.1.is_empty()).count(),
            "{when}: kb = x''"
        );
    };
    {
        let engine = open(dir.path());
        let t = engine.create_table("t", Arc::clone(&s), &["ks", "kb"]).unwrap();
        t.insert(&mk(&first)).unwrap();
        put(&mut model, &first);
        counts(&t, &model, "delta");
        t.flush().unwrap();
        counts(&t, &model, "file");
        assert!(matches!(t.insert(&mk(&[r("", b"", None, None)])), Err(Error::KeyExists { .. })));
        assert_eq!(t.delete(&mkk(&[("", b"")])).unwrap(), 1);
        model.remove(&(String::new(), vec![]));
        assert_eq!(t.delete(&mkk(&[("", b""), ("", b"")])).unwrap(), 0);
        counts(&t, &model, "after delete");
        t.flush().unwrap();
        let again = vec![r("", b"", None, Some(b"")), r("a", b"", Some(""), None)];
        t.upsert(&mk(&again)).unwrap();
        put(&mut model, &again);
        counts(&t, &model, "re-upserted");
        engine.close().unwrap();
    }
    let engine = open(dir.path());
    let t = engine.table("t").unwrap();
    counts(&t, &model, "reopened (WAL)");
    t.flush().unwrap();
    drop(t);
    engine.close().unwrap();
    let engine = open(dir.path());
    let t = engine.table("t").unwrap();
    counts(&t, &model, "reopened (files)");
}

// =====================================================================================
// 6. Sliced batches with a Boolean + Utf8View key
// =====================================================================================

/// A composite key (Boolean, Utf8View) with BinaryView and Boolean values, written as slices
/// at odd bit offsets (insert, upsert, update, delete keys): the rows are exactly the model
/// in the delta, after flush and after reopen (bit-offset and view-buffer handling of sliced
/// inputs are frequent arrow-rs consumer bugs).
#[test]
fn sliced_boolean_and_view_key_batches_at_odd_offsets() {
    let dir = tempfile::tempdir().unwrap();
    let s = schema(vec![
        Field::new("f", DataType::Boolean, false),
        Field::new("name", DataType::Utf8View, false),
        Field::new("bv", DataType::BinaryView, true),
        Field::new("ok", DataType::Boolean, true),
    ]);
    let ks = schema(vec![Field::new("f", DataType::Boolean, false), Field::new("name", DataType::Utf8View, false)]);
    type Row = (bool, String, Option<Vec<u8>>, Option<bool>);
    let name = |i: usize| if i.is_multiple_of(3) { format!("n{i}") } else { format!("a-rather-long-name-beyond-twelve-bytes-{i}") };
    let row = |i: usize, generation: usize| -> Row {
        let bv = !(i + generation).is_multiple_of(4);
        (
            i.is_multiple_of(2),
            name(i / 2),
            bv.then(|| vec![(i + generation) as u8; (i * 7 + generation) % 40]),
            (!(i + generation).is_multiple_of(5)).then_some((i + generation).is_multiple_of(3)),
        )
    };
    let mk = |rows: &[Row]| {
        batch(
            &s,
            vec![
                Arc::new(BooleanArray::from(rows.iter().map(|r| r.0).collect::<Vec<_>>())),
                Arc::new(StringViewArray::from_iter_values(rows.iter().map(|r| r.1.as_str()))),
                Arc::new(BinaryViewArray::from(rows.iter().map(|r| r.2.as_deref()).collect::<Vec<_>>())),
                Arc::new(BooleanArray::from(rows.iter().map(|r| r.3).collect::<Vec<_>>())),
            ],
        )
    };
    let mkk = |rows: &[Row]| {
        RecordBatch::try_new(
            Arc::clone(&ks),
            vec![
                Arc::new(BooleanArray::from(rows.iter().map(|r| r.0).collect::<Vec<_>>())),
                Arc::new(StringViewArray::from_iter_values(rows.iter().map(|r| r.1.as_str()))),
            ],
        )
        .unwrap()
    };
    let mut model: BTreeMap<(bool, String), Row> = BTreeMap::new();
    let expect = |m: &BTreeMap<(bool, String), Row>| dump_batches([mk(&m.values().cloned().collect::<Vec<_>>())]);
    {
        let engine = open(dir.path());
        let t = engine.create_table("t", Arc::clone(&s), &["f", "name"]).unwrap();
        for generation in 0..4usize {
            let all: Vec<Row> = (0..96).map(|i| row(i, generation)).collect();
            let big = mk(&all);
            let keys = mkk(&all);
            for (off, len) in [(1usize, 13usize), (9, 20), (29, 3), (33, 31), (67, 29)] {
                let sl = big.slice(off, len);
                match generation {
                    0 => {
                        // Overlapping slices: the first key already present refuses the slice.
                        let first = (off..off + len).position(|i| model.contains_key(&(all[i].0, all[i].1.clone())));
                        match (t.insert(&sl), first) {
                            (Ok(n), None) => assert_eq!(n, len),
                            (Err(Error::KeyExists { row, .. }), Some(r)) => {
                                assert_eq!(row, r, "slice ({off},{len})");
                                continue;
                            }
                            (other, f) => panic!("slice ({off},{len}): {other:?}, first existing {f:?}"),
                        }
                    }
                    1 | 3 => {
                        t.upsert(&sl).unwrap();
                    }
                    _ => {
                        // Update only the slice's rows that exist; a slice with a missing key is
                        // refused whole.
                        let exists = (off..off + len).all(|i| model.contains_key(&(all[i].0, all[i].1.clone())));
                        match t.update(&sl) {
                            Ok(n) => assert!(exists && n == len),
                            Err(Error::KeyNotFound { row, .. }) => {
                                assert!(!exists);
                                assert!(!model.contains_key(&(all[off + row].0, all[off + row].1.clone())));
                                continue;
                            }
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
                for r in &all[off..off + len] {
                    model.insert((r.0, r.1.clone()), r.clone());
                }
            }
            // Delete a sliced key batch at an odd bit offset.
            let (off, len) = (5 + generation * 2, 7 + generation);
            let want = all[off..off + len].iter().filter(|r| model.contains_key(&(r.0, r.1.clone()))).count();
            assert_eq!(t.delete(&keys.slice(off, len)).unwrap(), want, "generation {generation}");
            for r in &all[off..off + len] {
                model.remove(&(r.0, r.1.clone()));
            }
            assert_eq!(dump(&t), expect(&model), "generation {generation} delta");
            if generation % 2 == 1 {
                t.flush().unwrap();
                assert_eq!(dump(&t), expect(&model), "generation {generation} flushed");
            }
        }
        engine.close().unwrap();
    }
    let engine = open(dir.path());
    let t = engine.table("t").unwrap();
    assert_eq!(dump(&t), expect(&model), "reopened");
    let trues = model.keys().filter(|k| k.0).count();
    assert_eq!(count(&t, ScanFilter::compare("f", CompareOp::Eq, Arc::new(BooleanArray::from(vec![true])))), trues);
    assert_eq!(count(&t, ScanFilter::compare("f", CompareOp::Lt, Arc::new(BooleanArray::from(vec![true])))), model.len() - trues);
}

// =====================================================================================
// 7. Update of a key whose newest version is a delete, in every layer
// =====================================================================================

fn kv() -> SchemaRef {
    schema(vec![Field::new("k", DataType::Int64, false), Field::new("v", DataType::Int64, true)])
}

fn kvb(keys: &[i64], v: i64) -> RecordBatch {
    batch(&kv(), vec![Arc::new(Int64Array::from(keys.to_vec())), Arc::new(Int64Array::from(keys.iter().map(|k| k * 10 + v).collect::<Vec<_>>()))])
}

fn kk(keys: &[i64]) -> RecordBatch {
    RecordBatch::try_new(schema(vec![Field::new("k", DataType::Int64, false)]), vec![Arc::new(Int64Array::from(keys.to_vec()))]).unwrap()
}

fn kv_model(t: &Table) -> BTreeMap<i64, Option<i64>> {
    let mut m = BTreeMap::new();
    for b in t.scan(ScanOptions::default()).unwrap() {
        let b = b.unwrap();
        let k = b.column(0).as_primitive::<arrow::datatypes::Int64Type>();
        let v = b.column(1).as_primitive::<arrow::datatypes::Int64Type>();
        for i in 0..b.num_rows() {
            assert!(m.insert(k.value(i), v.is_valid(i).then(|| v.value(i))).is_none(), "key {} twice", k.value(i));
        }
    }
    m
}

/// For a key whose newest version is a tombstone — in the active delta over a file row, in a
/// deletion vector, after reopen from the WAL and from files — `update` is `KeyNotFound` (at
/// that row, nothing of the batch applied), `delete` counts 0, `insert` succeeds; and a key
/// deleted and re-inserted is updatable.
#[test]
fn update_of_a_key_deleted_in_each_layer_is_key_not_found() {
    let dir = tempfile::tempdir().unwrap();
    let mut model: BTreeMap<i64, Option<i64>> = BTreeMap::new();
    let apply = |m: &mut BTreeMap<i64, Option<i64>>, keys: &[i64], v: i64| {
        for &k in keys {
            m.insert(k, Some(k * 10 + v));
        }
    };
    let probe = |t: &Table, m: &mut BTreeMap<i64, Option<i64>>, dead: i64, live: i64, tag: &str| {
        // [live, dead]: row 1 is missing; nothing applies, not even row 0.
        match t.update(&kvb(&[live, dead], 5)) {
            Err(Error::KeyNotFound { row: 1, .. }) => {}
            other => panic!("{tag}: update of deleted {dead}: {other:?}"),
        }
        assert_eq!(t.delete(&kk(&[dead])).unwrap(), 0, "{tag}");
        assert_eq!(kv_model(t), *m, "{tag}: after refused update");
        t.insert(&kvb(&[dead], 7)).unwrap();
        apply(m, &[dead], 7);
        assert_eq!(t.update(&kvb(&[dead, live], 8)).unwrap(), 2, "{tag}");
        apply(m, &[dead, live], 8);
        assert_eq!(kv_model(t), *m, "{tag}");
        assert_eq!(t.delete(&kk(&[dead])).unwrap(), 1, "{tag}");
        m.remove(&dead);
    };
    {
        let engine = open(dir.path());
        let t = engine.create_table("t", kv(), &["k"]).unwrap();
        let keys: Vec<i64> = (0..100).collect();
        t.insert(&kvb(&keys, 0)).unwrap();
        apply(&mut model, &keys, 0);
        // Layer 1: put and delete both in the active delta.
        t.insert(&kvb(&[1000], 0)).unwrap();
        assert_eq!(t.delete(&kk(&[1000])).unwrap(), 1);
        probe(&t, &mut model, 1000, 1, "active put+delete");
        t.flush().unwrap();
        // Layer 2: file row, delete in the active delta.
        assert_eq!(t.delete(&kk(&[2])).unwrap(), 1);
        model.remove(&2);
        probe(&t, &mut model, 2, 3, "file row, active tombstone");
        // Layer 3: deletion vector.
        assert_eq!(t.delete(&kk(&[4])).unwrap(), 1);
        model.remove(&4);
        t.flush().unwrap();
        probe(&t, &mut model, 4, 5, "deletion vector");
        // Upsert in delta over file, delete, flush, then the tombstone in a file layer.
        t.upsert(&kvb(&[6], 3)).unwrap();
        assert_eq!(t.delete(&kk(&[6])).unwrap(), 1);
        model.remove(&6);
        t.flush().unwrap();
        // Leave tombstones only in the WAL for the reopen.
        assert_eq!(t.delete(&kk(&[8, 9])).unwrap(), 2);
        model.remove(&8);
        model.remove(&9);
        assert_eq!(kv_model(&t), model);
        engine.close().unwrap();
    }
    let engine = open(dir.path());
    let t = engine.table("t").unwrap();
    assert_eq!(kv_model(&t), model, "reopened");
    probe(&t, &mut model, 6, 7, "reopened: tombstone flushed before close");
    probe(&t, &mut model, 8, 10, "reopened: tombstone replayed from the WAL");
    // Many small flushes (compaction) with a tombstone each, then update of each deleted key.
    for r in 0..6i64 {
        assert_eq!(t.delete(&kk(&[20 + r])).unwrap(), 1);
        model.remove(&(20 + r));
        t.flush().unwrap();
    }
    for r in 0..6i64 {
        assert!(matches!(t.update(&kvb(&[20 + r], 1)), Err(Error::KeyNotFound { row: 0, .. })), "compacted tombstone {r}");
    }
    assert_eq!(kv_model(&t), model, "after compaction");
    let n = model.len();
    drop(t);
    engine.close().unwrap();
    let engine = open(dir.path());
    let t = engine.table("t").unwrap();
    assert_eq!(kv_model(&t), model);
    assert_eq!(t.row_count().unwrap(), n as u64);
}

// =====================================================================================
// 8. Zero-row writes, slices of zero rows at the end of a batch
// =====================================================================================

/// Zero-row batches — built empty, or sliced at offset = len — for insert, upsert, update and
/// delete return 0, log nothing (the WAL bytes do not grow), change nothing, and a zero-row
/// batch of the wrong schema is still a schema error; the table replays exactly.
#[test]
fn zero_row_writes_return_zero_and_log_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let model;
    {
        let engine = open(dir.path());
        let t = engine.create_table("t", kv(), &["k"]).unwrap();
        t.insert(&kvb(&[1, 2, 3], 0)).unwrap();
        model = kv_model(&t);
        let wal0 = engine.wal_usage();
        let full = kvb(&[1, 2, 3], 9);
        let empties = [kvb(&[], 0), full.slice(3, 0), full.slice(0, 0), full.slice(1, 0)];
        for e in &empties {
            assert_eq!(t.insert(e).unwrap(), 0);
            assert_eq!(t.upsert(e).unwrap(), 0);
            assert_eq!(t.update(e).unwrap(), 0);
        }
        let keys = kk(&[1, 2, 3]);
        for e in [kk(&[]), keys.slice(3, 0), keys.slice(2, 0)] {
            assert_eq!(t.delete(&e).unwrap(), 0);
        }
        assert_eq!(engine.wal_usage(), wal0, "zero-row writes logged something");
        assert_eq!(kv_model(&t), model);
        // Wrong schema with zero rows is still refused.
        let wrong = RecordBatch::new_empty(schema(vec![Field::new("k", DataType::Int32, false), Field::new("v", DataType::Int64, true)]));
        assert!(matches!(t.insert(&wrong), Err(Error::Input(UnifyError::SchemaMismatch { .. }))));
        let wrongk = RecordBatch::new_empty(schema(vec![Field::new("k", DataType::Utf8, false)]));
        assert!(matches!(t.delete(&wrongk), Err(Error::Input(UnifyError::SchemaMismatch { .. }))));
        // A flush with only zero-row writes since the last flush writes nothing new.
        t.flush().unwrap();
        let files = t.stats().unwrap().files;
        for e in &empties {
            t.upsert(e).unwrap();
        }
        assert_eq!(t.flush().unwrap(), 0);
        assert_eq!(t.stats().unwrap().files, files);
        engine.close().unwrap();
    }
    let engine = open(dir.path());
    assert_eq!(kv_model(&engine.table("t").unwrap()), model);
}

// =====================================================================================
// 9. Unsupported types: typed refusals at create and at write
// =====================================================================================

/// Column types the row codec does not store (dictionary, list, struct, fixed-size binary,
/// interval, Decimal256, null, map-like) are refused by `create_table` with a typed error —
/// as a key or as a value column — leaving no table behind; the name is then free. A
/// dictionary-encoded batch for a Utf8 table is a schema mismatch, not a panic.
#[test]
fn unsupported_column_types_are_typed_refusals() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path());
    let dict = DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8));
    let types = [
        dict.clone(),
        DataType::List(Arc::new(Field::new("item", DataType::Int64, true))),
        DataType::Struct(Fields::from(vec![Field::new("a", DataType::Int64, true)])),
        DataType::FixedSizeBinary(16),
        DataType::Interval(IntervalUnit::MonthDayNano),
        DataType::Decimal256(40, 2),
        DataType::Null,
        DataType::Float16,
    ];
    let mut refused = 0;
    for (i, ty) in types.iter().enumerate() {
        for as_key in [false, true] {
            let nullable = matches!(ty, DataType::Null);
            let s = if as_key {
                schema(vec![Field::new("k", ty.clone(), nullable), Field::new("v", DataType::Int64, true)])
            } else {
                schema(vec![Field::new("k", DataType::Int64, false), Field::new("v", ty.clone(), true)])
            };
            let name = format!("t{i}{}", u8::from(as_key));
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.create_table(&name, s, &["k"])));
            match r {
                Err(_) => panic!("{ty} (key {as_key}): create_table panicked"),
                Ok(Ok(t)) => {
                    // Only a type the engine stores may be accepted (Float16 is one).
                    assert!(matches!(ty, DataType::Float16), "{ty} (key {as_key}) accepted");
                    drop(t);
                    engine.drop_table(&name).unwrap();
                }
                Ok(Err(Error::Input(_) | Error::InvalidPrimaryKey(_) | Error::Config(_))) => {
                    refused += 1;
                    assert!(!engine.table_names().contains(&name), "{ty}: a refused table is listed");
                    assert!(matches!(engine.table(&name), Err(Error::TableNotFound { .. })));
                }
                Ok(Err(e)) => panic!("{ty} (key {as_key}): unexpected error {e:?}"),
            }
            engine.create_table(&name, kv(), &["k"]).unwrap();
            engine.drop_table(&name).unwrap();
        }
    }
    assert_eq!(refused, 2 * (types.len() - 1));
    // A dictionary-encoded batch for a Utf8 column.
    let s = schema(vec![Field::new("k", DataType::Int64, false), Field::new("s", DataType::Utf8, true)]);
    let t = engine.create_table("strs", Arc::clone(&s), &["k"]).unwrap();
    let d: DictionaryArray<Int32Type> = vec!["a", "b", "a"].into_iter().collect();
    let db = RecordBatch::try_new(
        schema(vec![Field::new("k", DataType::Int64, false), Field::new("s", dict, true)]),
        vec![Arc::new(Int64Array::from(vec![1, 2, 3])), Arc::new(d)],
    )
    .unwrap();
    assert!(matches!(t.insert(&db), Err(Error::Input(UnifyError::SchemaMismatch { .. }))));
    assert!(matches!(t.upsert(&db), Err(Error::Input(UnifyError::SchemaMismatch { .. }))));
    assert_eq!(t.row_count().unwrap(), 0);
    drop(t);
    engine.close().unwrap();
    // Nothing from the refused creates is found at reopen.
    let engine = open(dir.path());
    assert_eq!(engine.table_names(), vec!["strs".to_owned()]);
}

// =====================================================================================
// 10. Time zones of timestamp keys
// =====================================================================================

/// A `Timestamp(us, "+00:00")` key: batches whose zone is spelled "UTC" or absent are schema
/// mismatches (not silently merged with another zone), filter literals must carry the same
/// zone (`InvalidFilter` otherwise), and with it filters are exact after flush and reopen; the
/// zone survives reopen.
#[test]
fn timestamp_key_zones_must_match_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let tz = DataType::Timestamp(TimeUnit::Microsecond, Some("+00:00".into()));
    let s = schema(vec![Field::new("ts", tz.clone(), false), Field::new("v", DataType::Int64, false)]);
    let ts = |vals: &[i64], z: Option<&str>| -> ArrayRef {
        let a = TimestampMicrosecondArray::from(vals.to_vec());
        Arc::new(match z {
            Some(z) => a.with_timezone(z),
            None => a,
        })
    };
    let mkz = |vals: &[i64], z: Option<&str>| {
        let dt = DataType::Timestamp(TimeUnit::Microsecond, z.map(Into::into));
        RecordBatch::try_new(
            schema(vec![Field::new("ts", dt, false), Field::new("v", DataType::Int64, false)]),
            vec![ts(vals, z), Arc::new(Int64Array::from(vals.to_vec()))],
        )
        .unwrap()
    };
    let vals: Vec<i64> = vec![i64::MIN, -1, 0, 1, 1_700_000_000_000_000, i64::MAX];
    {
        let engine = open(dir.path());
        let t = engine.create_table("t", Arc::clone(&s), &["ts"]).unwrap();
        t.insert(&mkz(&vals[..3], Some("+00:00"))).unwrap();
        t.flush().unwrap();
        t.insert(&mkz(&vals[3..], Some("+00:00"))).unwrap();
        for z in [Some("UTC"), None, Some("+01:00")] {
            assert!(matches!(t.upsert(&mkz(&[42], z)), Err(Error::Input(UnifyError::SchemaMismatch { .. }))), "{z:?}");
        }
        match t.scan(ScanOptions::default().filter(ScanFilter::compare("ts", CompareOp::Eq, ts(&[0], Some("UTC"))))) {
            Err(Error::InvalidFilter { .. }) => {}
            other => panic!("a UTC literal on a +00:00 column: {:?}", other.map(|_| ())),
        }
        engine.close().unwrap();
    }
    let engine = open(dir.path());
    let t = engine.table("t").unwrap();
    assert_eq!(t.schema().field(0).data_type(), &tz);
    for &p in &vals {
        for op in OPS {
            let want = vals.iter().filter(|v| holds(op, *v, &p)).count();
            assert_eq!(count(&t, ScanFilter::compare("ts", op, ts(&[p], Some("+00:00")))), want, "{op:?} {p}");
        }
    }
    let got: Vec<_> = t.scan(ScanOptions::default()).unwrap().map(Result::unwrap).collect();
    assert!(got.iter().all(|b| b.schema().field(0).data_type() == &tz));
    assert_eq!(got.iter().map(RecordBatch::num_rows).sum::<usize>(), vals.len());
}

// =====================================================================================
// 11. Field-name case, metadata and nullability declarations of input batches
// =====================================================================================

/// Input batches whose field names differ in case are refused (never matched to another
/// column), schema and field metadata on the input are ignored, and a batch field declared
/// non-nullable for a nullable column (or nullable for a non-nullable one, without nulls) is
/// accepted; projections naming a column in another case are `ColumnNotFound` or resolve to
/// that column, never something else.
#[test]
fn field_name_case_metadata_and_nullability_of_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path());
    let s = schema(vec![Field::new("id", DataType::Int64, false), Field::new("Val", DataType::Int64, true)]);
    let t = engine.create_table("t", Arc::clone(&s), &["id"]).unwrap();
    let with = |fields: Vec<Field>, md: HashMap<String, String>, k: Vec<i64>| {
        let v: Vec<i64> = k.iter().map(|x| x * 2).collect();
        RecordBatch::try_new(Arc::new(Schema::new_with_metadata(fields, md)), vec![Arc::new(Int64Array::from(k)), Arc::new(Int64Array::from(v))]).unwrap()
    };
    let md: HashMap<String, String> = [("origin".to_owned(), "test".to_owned())].into();
    // Case differences.
    for (a, b) in [("ID", "Val"), ("id", "val"), ("Id", "VAL")] {
        let r = t.insert(&with(vec![Field::new(a, DataType::Int64, false), Field::new(b, DataType::Int64, true)], HashMap::new(), vec![1]));
        assert!(matches!(r, Err(Error::Input(UnifyError::SchemaMismatch { .. }))), "{a},{b}: {r:?}");
    }
    let r = t.delete(&RecordBatch::try_new(schema(vec![Field::new("ID", DataType::Int64, false)]), vec![Arc::new(Int64Array::from(vec![1]))]).unwrap());
    assert!(matches!(r, Err(Error::Input(UnifyError::SchemaMismatch { .. }))), "delete ID: {r:?}");
    // Metadata and nullability declarations.
    let f_md = |n: &str, nullable| Field::new(n, DataType::Int64, nullable).with_metadata([("x".to_owned(), "y".to_owned())].into());
    assert_eq!(t.insert(&with(vec![f_md("id", false), f_md("Val", true)], md.clone(), vec![1, 2])).unwrap(), 2);
    assert_eq!(t.insert(&with(vec![Field::new("id", DataType::Int64, true), Field::new("Val", DataType::Int64, false)], md, vec![3])).unwrap(), 1);
    assert_eq!(t.row_count().unwrap(), 3);
    t.flush().unwrap();
    // The table keeps its own schema, without the inputs' metadata.
    let out: Vec<RecordBatch> = t.scan(ScanOptions::default()).unwrap().map(Result::unwrap).collect();
    assert!(out.iter().all(|b| b.schema().metadata().get("origin").is_none() && b.schema().field(0).metadata().is_empty()));
    assert_eq!(dump_batches(out), vec!["1|2", "2|4", "3|6"]);
    // Projection in another case.
    match t.scan(ScanOptions::default().projection(["val"])) {
        Err(Error::ColumnNotFound { column, .. }) => assert_eq!(column, "val"),
        Ok(sc) => {
            let b: Vec<RecordBatch> = sc.map(Result::unwrap).collect();
            assert_eq!(dump_batches(b), vec!["2", "4", "6"]);
        }
        Err(e) => panic!("{e:?}"),
    }
}

// =====================================================================================
// 12. Zero-column projection with a filter; duplicated projection columns
// =====================================================================================

/// `projection([])` with a filter counts exactly the matching rows over files, deletion
/// vectors, sealed/active deltas (the COUNT(*) WHERE ... class of DataFusion bugs), and a
/// projection naming a column twice is a typed error or returns it twice — never a panic.
#[test]
fn zero_column_projection_with_filters_counts_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path());
    let t = engine.create_table("t", kv(), &["k"]).unwrap();
    let mut model: BTreeMap<i64, Option<i64>> = BTreeMap::new();
    for f in 0..5i64 {
        let keys: Vec<i64> = (f * 1000..f * 1000 + 1500).collect();
        let vals: Vec<Option<i64>> = keys.iter().map(|k| (k % 7 != 0).then_some(k % 100)).collect();
        t.upsert(&batch(&kv(), vec![Arc::new(Int64Array::from(keys.clone())), Arc::new(Int64Array::from(vals.clone()))])).unwrap();
        for (k, v) in keys.iter().zip(vals) {
            model.insert(*k, v);
        }
        let del: Vec<i64> = keys.iter().copied().filter(|k| k % 11 == 0).collect();
        t.delete(&kk(&del)).unwrap();
        for k in del {
            model.remove(&k);
        }
        if f < 4 {
            t.flush().unwrap();
        }
    }
    let filters: Vec<(ScanFilter, Box<dyn Fn(i64, Option<i64>) -> bool>)> = vec![
        (ScanFilter::compare("v", CompareOp::Lt, Arc::new(Int64Array::from(vec![10]))), Box::new(|_, v| v.is_some_and(|v| v < 10))),
        (ScanFilter::is_null("v"), Box::new(|_, v| v.is_none())),
        (ScanFilter::compare("k", CompareOp::GtEq, Arc::new(Int64Array::from(vec![3500]))), Box::new(|k, _| k >= 3500)),
        (
            ScanFilter::or([ScanFilter::compare("k", CompareOp::Eq, Arc::new(Int64Array::from(vec![4001]))), ScanFilter::is_null("v")]),
            Box::new(|k, v| k == 4001 || v.is_none()),
        ),
        (ScanFilter::and([]), Box::new(|_, _| true)),
        (ScanFilter::or([]), Box::new(|_, _| false)),
    ];
    for (f, pred) in &filters {
        let want = model.iter().filter(|(k, v)| pred(**k, **v)).count();
        let batches: Vec<RecordBatch> =
            t.scan(ScanOptions::default().projection(Vec::<String>::new()).filter(f.clone())).unwrap().map(Result::unwrap).collect();
        assert!(batches.iter().all(|b| b.num_columns() == 0), "{f}");
        assert_eq!(batches.iter().map(RecordBatch::num_rows).sum::<usize>(), want, "{f}: empty projection");
        assert_eq!(count(&t, f.clone()), want, "{f}: key projection");
    }
    match t.scan(ScanOptions::default().projection(["v", "v"])) {
        Ok(sc) => {
            for b in sc {
                let b = b.unwrap();
                assert_eq!(b.num_columns(), 2);
                assert_eq!(b.column(0).to_data(), b.column(1).to_data());
            }
        }
        Err(e) => assert!(matches!(e, Error::ColumnNotFound { .. } | Error::Input(_) | Error::Config(_)), "{e:?}"),
    }
}

// =====================================================================================
// 13. A stale handle after drop and a case-variant re-create
// =====================================================================================

/// A handle to "Orders" kept across `drop_table("orders")` and `create_table("ORDERS")`:
/// its writes are refused (`TableNotFound`/`Closed`), never landing in the new table; its
/// scan opened before the drop ends or reports the drop; the new table holds only its own
/// rows, also after reopen.
#[test]
fn a_stale_handle_never_writes_into_a_case_variant_recreated_table() {
    let dir = tempfile::tempdir().unwrap();
    {
        let engine = open(dir.path());
        let old = engine.create_table("Orders", kv(), &["k"]).unwrap();
        old.insert(&kvb(&(0..100).collect::<Vec<_>>(), 0)).unwrap();
        old.flush().unwrap();
        old.insert(&kvb(&(100..150).collect::<Vec<_>>(), 0)).unwrap();
        let mut scan = old.scan(ScanOptions::default().batch_rows(10)).unwrap();
        let first = scan.next().unwrap().unwrap().num_rows();
        engine.drop_table("orders").unwrap();
        let new = engine.create_table("ORDERS", kv(), &["k"]).unwrap();
        new.insert(&kvb(&[1000, 1001], 1)).unwrap();
        for (what, r) in [
            ("insert", old.insert(&kvb(&[5000], 0))),
            ("upsert", old.upsert(&kvb(&[1000], 9))),
            ("update", old.update(&kvb(&[1001], 9))),
            ("delete", old.delete(&kk(&[1000]))),
        ] {
            assert!(matches!(r, Err(Error::TableNotFound { .. } | Error::Closed(_))), "stale {what}: {r:?}");
        }
        assert!(matches!(old.flush(), Err(Error::TableNotFound { .. } | Error::Closed(_)) | Ok(0)));
        // The old scan: its snapshot or a typed end.
        let mut rest = first;
        for b in scan.by_ref() {
            match b {
                Ok(b) => rest += b.num_rows(),
                Err(Error::TableNotFound { .. } | Error::Closed(_)) => break,
                Err(e) => panic!("old scan: {e:?}"),
            }
        }
        assert!(rest <= 150, "old scan returned {rest} rows");
        assert_eq!(kv_model(&new), [(1000, Some(10001)), (1001, Some(10011))].into_iter().collect());
        assert!(matches!(old.scan(ScanOptions::default()), Err(Error::TableNotFound { .. } | Error::Closed(_))));
        drop((old, scan));
        engine.close().unwrap();
    }
    let engine = open(dir.path());
    assert_eq!(engine.table_names(), vec!["ORDERS".to_owned()]);
    let t = engine.table("orders").unwrap();
    assert_eq!(t.name(), "ORDERS");
    assert_eq!(kv_model(&t), [(1000, Some(10001)), (1001, Some(10011))].into_iter().collect());
}

// =====================================================================================
// 14. Extreme configuration values (size overflow)
// =====================================================================================

fn workload(engine: &Engine, name: &str) {
    let t = engine.create_table(name, kv(), &["k"]).unwrap();
    let keys: Vec<i64> = (0..2000).collect();
    assert_eq!(t.insert(&kvb(&keys, 0)).unwrap(), 2000);
    assert_eq!(t.delete(&kk(&[5, 6])).unwrap(), 2);
    t.flush().unwrap();
    assert_eq!(t.upsert(&kvb(&[5, 7], 1)).unwrap(), 2);
    let m = kv_model(&t);
    assert_eq!(m.len(), 1999);
    assert_eq!(m[&7], Some(71));
    assert_eq!(m.values().map(|v| v.unwrap()).sum::<i64>(), keys.iter().map(|k| k * 10).sum::<i64>() - 60 + 2);
}

/// `usize::MAX` (and other extremes) for the memory limit, max row bytes, table flush bytes
/// and flush batch bytes, at open and via `set_memory_limit`, are a `Config` error or work —
/// a small workload is then exact — never a panic from an overflowing size computation.
#[test]
fn extreme_configuration_values_are_config_errors_or_work() {
    type Tweak = fn(EngineConfig) -> EngineConfig;
    let cases: Vec<(&str, Tweak)> = vec![
        ("memory_limit MAX", |c| c.memory_limit(usize::MAX)),
        ("max_row_bytes MAX", |c| c.max_row_bytes(usize::MAX)),
        ("table_flush_bytes MAX", |c| c.table_flush_bytes(usize::MAX)),
        ("table_flush_bytes 0", |c| c.table_flush_bytes(0)),
        ("flush_batch_bytes MAX", |c| c.flush_batch_bytes(usize::MAX)),
        ("flush_batch_bytes 0", |c| c.flush_batch_bytes(0)),
        ("flush_age MAX", |c| c.flush_age(Duration::MAX)),
        ("wal_sync_interval MAX", |c| c.wal_sync_interval(Duration::MAX).wal_sync(gritdb::WalSync::Relaxed)),
        ("flush_threads MAX", |c| c.flush_threads(usize::MAX)),
    ];
    let mut bad = Vec::new();
    for (what, tweak) in cases {
        let dir = tempfile::tempdir().unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match Engine::open(dir.path(), tweak(cfg(64 * MIB))) {
            Err(Error::Config(_)) => "config error".to_owned(),
            Err(e) => format!("unexpected error {e:?}"),
            Ok(engine) => {
                workload(&engine, "t");
                engine.close().unwrap();
                "ok".to_owned()
            }
        }));
        match r {
            Ok(s) if s == "ok" || s == "config error" => {}
            Ok(s) => bad.push(format!("{what}: {s}")),
            Err(p) => bad.push(format!("{what}: panicked: {}", crate::breaker_trial::panic_text(&*p))),
        }
    }
    // At run time.
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg(64 * MIB)).unwrap();
    for lim in [usize::MAX, usize::MAX / 2, 0, 1] {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.set_memory_limit(lim)));
        match r {
            Ok(Ok(()) | Err(Error::Config(_) | Error::MemoryLimit { .. })) => {}
            Ok(Err(e)) => bad.push(format!("set_memory_limit({lim}): {e:?}")),
            Err(p) => bad.push(format!("set_memory_limit({lim}): panicked: {}", crate::breaker_trial::panic_text(&*p))),
        }
        let name = format!("t{}", lim.count_ones());
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| workload(&engine, &name)));
        if let Err(p) = r {
            bad.push(format!("workload after set_memory_limit({lim}): {}", crate::breaker_trial::panic_text(&*p)));
        }
        engine.set_memory_limit(64 * MIB).unwrap();
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

// =====================================================================================
// 15. Stray files in a table directory
// =====================================================================================

/// Files the manifest does not name — a zero-length `.parquet`, a garbage `.parquet` with a
/// name like the engine's, a garbage deletion vector, a manifest temp file — are ignored (or
/// removed) at open: every row is there, writes and flushes go on, and the engine never
/// reads them as data (a Delta/Iceberg-style "orphan file" must not become rows).
#[test]
fn stray_files_in_a_table_directory_are_never_read_as_data() {
    let dir = tempfile::tempdir().unwrap();
    let model;
    {
        let engine = open(dir.path());
        let t = engine.create_table("t", kv(), &["k"]).unwrap();
        t.insert(&kvb(&(0..500).collect::<Vec<_>>(), 0)).unwrap();
        t.flush().unwrap();
        t.delete(&kk(&[1, 2, 3])).unwrap();
        t.flush().unwrap();
        model = kv_model(&t);
        engine.close().unwrap();
    }
    let tdir = std::fs::read_dir(dir.path().join("tables")).unwrap().next().unwrap().unwrap().path();
    let names: Vec<String> = std::fs::read_dir(&tdir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    let real = names.iter().find(|n| n.ends_with(".parquet")).unwrap().clone();
    // A copy of a real data file under a new name holds real-looking rows: it must not be read.
    let stem = real.trim_end_matches(".parquet");
    let digits: String = stem.chars().filter(char::is_ascii_digit).collect();
    let prefix: String = stem.chars().take_while(|c| !c.is_ascii_digit()).collect();
    let n: u64 = digits.parse().unwrap_or(0);
    let copy = format!("{prefix}{}.parquet", n + 50);
    std::fs::copy(tdir.join(&real), tdir.join(&copy)).unwrap();
    std::fs::write(tdir.join(format!("{prefix}{}.parquet", n + 51)), b"").unwrap();
    std::fs::write(tdir.join(format!("{prefix}{}.parquet", n + 52)), b"PAR1garbagePAR1").unwrap();
    std::fs::write(tdir.join(format!("{stem}.dv999")), b"garbage").unwrap();
    std::fs::write(tdir.join("manifest.json.tmp"), b"{\"truncated\": ").unwrap();
    for round in 0..2 {
        let engine = open(dir.path());
        let t = engine.table("t").unwrap();
        assert_eq!(kv_model(&t), model, "round {round}");
        assert_eq!(t.row_count().unwrap(), 497);
        if round == 0 {
            // Writes and a compaction-triggering run of flushes leave the model exact.
            for r in 0..5 {
                t.upsert(&kvb(&[1000 + r], 0)).unwrap();
                t.flush().unwrap();
            }
            t.delete(&kk(&(1000..1005).collect::<Vec<_>>())).unwrap();
            t.flush().unwrap();
            assert_eq!(kv_model(&t), model);
        }
        drop(t);
        engine.close().unwrap();
    }
}

/// `backpressure_timeout(Duration::MAX)` — "wait as long as it takes" — is accepted by
/// `Engine::open`; every write, scan, drop and limit change then computes
/// `Instant::now() + timeout`, which must not panic (saturate, or refuse the value at open
/// with `Error::Config`).
#[test]
fn backpressure_timeout_of_duration_max_is_refused_or_works() {
    let dir = tempfile::tempdir().unwrap();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match Engine::open(dir.path(), cfg(64 * MIB).backpressure_timeout(Duration::MAX)) {
        Err(Error::Config(_)) => {}
        Err(e) => panic!("unexpected {e:?}"),
        Ok(engine) => {
            workload(&engine, "t");
            engine.set_memory_limit(32 * MIB).unwrap();
            engine.drop_table("t").unwrap();
            engine.close().unwrap();
        }
    }));
    if let Err(p) = r {
        panic!("panicked: {}", crate::breaker_trial::panic_text(&*p));
    }
}

// =====================================================================================
// 16. Huge batch sizes for scans and exports
// =====================================================================================

/// `ScanOptions::batch_rows(usize::MAX)` over files, a deletion vector and deltas, and an
/// export with `row_group_rows`, `row_group_bytes` and `batch_rows` of `usize::MAX` (or 0),
/// return exactly the rows — no overflowing `rows * width` reservation, no panic.
#[test]
fn huge_batch_rows_for_scans_and_exports_are_exact() {
    let dir = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let engine = open(dir.path());
    let t = engine.create_table("t", kv(), &["k"]).unwrap();
    t.insert(&kvb(&(0..30_000).collect::<Vec<_>>(), 0)).unwrap();
    t.flush().unwrap();
    t.delete(&kk(&(0..30_000).step_by(3).collect::<Vec<_>>())).unwrap();
    t.upsert(&kvb(&(29_000..31_000).collect::<Vec<_>>(), 1)).unwrap();
    let mut model = kv_model(&t);
    assert_eq!(model.len(), 21_333);
    for rows in [usize::MAX, usize::MAX / 2, 1 << 40, 0] {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut n = 0usize;
            let mut sum = 0i64;
            for b in t.scan(ScanOptions::default().batch_rows(rows)).unwrap() {
                let b = b.unwrap();
                n += b.num_rows();
                sum += b.column(1).as_primitive::<arrow::datatypes::Int64Type>().iter().map(|v| v.unwrap()).sum::<i64>();
            }
            (n, sum)
        }));
        let (n, sum) = r.unwrap_or_else(|p| panic!("batch_rows({rows}): {}", crate::breaker_trial::panic_text(&*p)));
        assert_eq!(n, model.len(), "batch_rows({rows})");
        assert_eq!(sum, model.values().map(|v| v.unwrap()).sum::<i64>(), "batch_rows({rows})");
    }
    for (i, o) in [
        gritdb::ExportOptions::default().row_group_rows(usize::MAX).row_group_bytes(usize::MAX).batch_rows(usize::MAX),
        gritdb::ExportOptions::default().row_group_rows(0).row_group_bytes(0).batch_rows(0),
    ]
    .iter()
    .enumerate()
    {
        let path = out.path().join(format!("out{i}.parquet"));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| t.export_parquet_with(&path, o)));
        let stats = r.unwrap_or_else(|p| panic!("export {i}: {}", crate::breaker_trial::panic_text(&*p))).unwrap();
        let _ = stats;
        let reader =
            gritdb::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(&path).unwrap()).unwrap().build().unwrap();
        let mut got = BTreeMap::new();
        for b in reader {
            let b = b.unwrap();
            let k = b.column(0).as_primitive::<arrow::datatypes::Int64Type>();
            let v = b.column(1).as_primitive::<arrow::datatypes::Int64Type>();
            for j in 0..b.num_rows() {
                got.insert(k.value(j), v.is_valid(j).then(|| v.value(j)));
            }
        }
        assert_eq!(got, model, "export {i}");
    }
    model.clear();
}

// =====================================================================================
// 17. Reopen with a smaller max_row_bytes than rows already acknowledged
// =====================================================================================

fn ks_schema() -> SchemaRef {
    schema(vec![Field::new("k", DataType::Int64, false), Field::new("s", DataType::Utf8, true)])
}

fn ks_batch(keys: &[i64], width: usize, tag: u8) -> RecordBatch {
    let vals: Vec<String> = keys.iter().map(|k| format!("{k:08}{}", char::from(b'a' + tag % 26)).repeat(width / 9 + 1)[..width].to_owned()).collect();
    batch(&ks_schema(), vec![Arc::new(Int64Array::from(keys.to_vec())), Arc::new(StringArray::from_iter_values(vals))])
}

fn ks_model(t: &Table) -> BTreeMap<i64, (usize, String)> {
    let mut m = BTreeMap::new();
    for b in t.scan(ScanOptions::default()).unwrap() {
        let b = b.unwrap();
        let k = b.column(0).as_primitive::<arrow::datatypes::Int64Type>();
        let s = b.column(1).as_string::<i32>();
        for i in 0..b.num_rows() {
            m.insert(k.value(i), (s.value(i).len(), s.value(i)[..9].to_owned()));
        }
    }
    m
}

/// Rows of 200 KB acknowledged under `max_row_bytes` = 1 MiB (some in files, some only in
/// the WAL of an engine dropped without close) meet a reopen with `max_row_bytes` = 64 KiB:
/// the open replays them or refuses with a typed error naming the WAL record (`CorruptWal`
/// with the setting in its detail) — and a reopen with the old value
/// then finds every row; after a successful small open, a new big row is `RowTooLarge`,
/// old big rows can be updated small, and flush/compaction keep every row.
#[test]
fn reopen_with_a_smaller_max_row_bytes_keeps_every_acknowledged_row() {
    let dir = tempfile::tempdir().unwrap();
    let big = cfg(64 * MIB).max_row_bytes(MIB);
    let mut want: BTreeMap<i64, (usize, String)>;
    {
        let engine = Engine::open(dir.path(), big.clone()).unwrap();
        let t = engine.create_table("t", ks_schema(), &["k"]).unwrap();
        t.insert(&ks_batch(&(0..20).collect::<Vec<_>>(), 200_000, 0)).unwrap();
        t.flush().unwrap();
        t.upsert(&ks_batch(&(10..30).collect::<Vec<_>>(), 200_000, 1)).unwrap();
        t.insert(&ks_batch(&(30..40).collect::<Vec<_>>(), 100, 2)).unwrap();
        want = ks_model(&t);
        assert_eq!(want.len(), 40);
        drop(t);
        drop(engine); // no close: rows 10..40 are only in the WAL
    }
    let small = cfg(64 * MIB).max_row_bytes(64 << 10);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Engine::open(dir.path(), small.clone())));
    match r {
        Err(p) => panic!("open with a smaller max_row_bytes panicked: {}", crate::breaker_trial::panic_text(&*p)),
        Ok(Err(e)) => {
            // The WAL record holding the big rows, named (segment and offset).
            assert!(
                matches!(&e, Error::Storage(gritdb::StorageError::CorruptWal { path, detail, .. }) if path.starts_with(dir.path().join("wal")) && detail.contains("max_row_bytes")),
                "untyped refusal: {e:?}"
            );
        }
        Ok(Ok(engine)) => {
            let t = engine.table("t").unwrap();
            assert_eq!(ks_model(&t), want, "replayed under the small max");
            match t.upsert(&ks_batch(&[100], 200_000, 3)) {
                Err(Error::Input(UnifyError::RowTooLarge { row: 0, max, .. })) => assert_eq!(max, 64 << 10),
                other => panic!("a new big row: {other:?}"),
            }
            assert_eq!(t.update(&ks_batch(&[0, 15], 50, 4)).unwrap(), 2);
            want.insert(0, (50, ks_batch(&[0], 50, 4).column(1).as_string::<i32>().value(0)[..9].to_owned()));
            want.insert(15, (50, ks_batch(&[15], 50, 4).column(1).as_string::<i32>().value(0)[..9].to_owned()));
            for r in 0..5 {
                t.upsert(&ks_batch(&[200 + r], 100, 5)).unwrap();
                want.insert(200 + r, (100, ks_batch(&[200 + r], 100, 5).column(1).as_string::<i32>().value(0)[..9].to_owned()));
                t.flush().unwrap();
            }
            assert_eq!(ks_model(&t), want, "after flushes under the small max");
            drop(t);
            engine.close().unwrap();
        }
    }
    let engine = Engine::open(dir.path(), big).unwrap();
    assert_eq!(ks_model(&engine.table("t").unwrap()), want, "reopened with the old max");
}

// =====================================================================================
// 18. Filter literals that are slices, carry a null buffer, or are null
// =====================================================================================

/// Filter literals given as one-element *slices* of longer arrays (offset != 0), with a null
/// buffer that marks them valid, or null, for Int64, Utf8, Utf8View, Boolean and Decimal
/// columns: a valid literal answers as its value (not the array's first element), a null
/// literal matches nothing for every operator — in deltas and in files.
#[test]
fn sliced_and_null_filter_literals_compare_by_their_own_value() {
    let dir = tempfile::tempdir().unwrap();
    let s = schema(vec![
        Field::new("k", DataType::Int64, false),
        Field::new("s", DataType::Utf8, true),
        Field::new("sv", DataType::Utf8View, true),
        Field::new("b", DataType::Boolean, true),
        Field::new("d", DataType::Decimal128(20, 3), true),
    ]);
    let engine = open(dir.path());
    let t = engine.create_table("t", Arc::clone(&s), &["k"]).unwrap();
    let n = 300i64;
    let keys: Vec<i64> = (0..n).collect();
    let strs: Vec<String> = keys.iter().map(|k| format!("value-{k:04}-with-a-long-tail")).collect();
    let mk = |range: std::ops::Range<usize>| {
        batch(
            &s,
            vec![
                Arc::new(Int64Array::from(keys[range.clone()].to_vec())),
                Arc::new(StringArray::from_iter_values(strs[range.clone()].iter())),
                Arc::new(StringViewArray::from_iter_values(strs[range.clone()].iter())),
                Arc::new(BooleanArray::from(keys[range.clone()].iter().map(|k| k % 3 == 0).collect::<Vec<_>>())),
                Arc::new(
                    Decimal128Array::from(keys[range].iter().map(|k| i128::from(*k) * 1000 - 150_000).collect::<Vec<_>>())
                        .with_precision_and_scale(20, 3)
                        .unwrap(),
                ),
            ],
        )
    };
    t.insert(&mk(0..150)).unwrap();
    t.flush().unwrap();
    t.insert(&mk(150..300)).unwrap();
    let check = |t: &Table, when: &str| {
        let p = 200usize; // the literal's value is row 200's; the arrays' first element is row 0's
        let lits: Vec<(&str, ArrayRef, ArrayRef, Box<dyn Fn(usize) -> std::cmp::Ordering>)> = vec![
            ("k", ar(Int64Array::from(keys.clone())).slice(p, 1), ar(Int64Array::from(vec![None::<i64>, Some(5)])).slice(0, 1), Box::new(move |i| i.cmp(&p))),
            ("s", ar(StringArray::from_iter_values(strs.iter())).slice(p, 1), ar(StringArray::from(vec![None::<&str>])), Box::new(move |i| i.cmp(&p))),
            (
                "sv",
                ar(StringViewArray::from_iter_values(strs.iter())).slice(p, 1),
                ar(StringViewArray::from(vec![Some("x"), None])).slice(1, 1),
                Box::new(move |i| i.cmp(&p)),
            ),
            (
                "d",
                ar(Decimal128Array::from(keys.iter().map(|k| i128::from(*k) * 1000 - 150_000).collect::<Vec<_>>()).with_precision_and_scale(20, 3).unwrap())
                    .slice(p, 1),
                ar(Decimal128Array::from(vec![Some(1), None]).with_precision_and_scale(20, 3).unwrap()).slice(1, 1),
                Box::new(move |i| i.cmp(&p)),
            ),
        ];
        for (col, lit, null, ord) in &lits {
            for op in OPS {
                let want = (0..n as usize)
                    .filter(|&i| {
                        let o = ord(i);
                        match op {
                            CompareOp::Eq => o.is_eq(),
                            CompareOp::NotEq => o.is_ne(),
                            CompareOp::Lt => o.is_lt(),
                            CompareOp::LtEq => o.is_le(),
                            CompareOp::Gt => o.is_gt(),
                            CompareOp::GtEq => o.is_ge(),
                            _ => unreachable!(),
                        }
                    })
                    .count();
                assert_eq!(count(t, ScanFilter::compare(*col, op, Arc::clone(lit))), want, "{when}: {col} {op:?} sliced literal");
                assert_eq!(count(t, ScanFilter::compare(*col, op, Arc::clone(null))), 0, "{when}: {col} {op:?} NULL");
            }
        }
        // Boolean literal at a bit offset: true is element 3 of [f, f, f, t].
        let bl = ar(BooleanArray::from(vec![false, false, false, true])).slice(3, 1);
        assert_eq!(count(t, ScanFilter::compare("b", CompareOp::Eq, bl.clone())), (0..n).filter(|k| k % 3 == 0).count(), "{when}: b = sliced true");
        assert_eq!(count(t, ScanFilter::compare("b", CompareOp::Lt, bl)), (0..n).filter(|k| k % 3 != 0).count(), "{when}: b < sliced true");
    };
    check(&t, "delta + file");
    t.flush().unwrap();
    check(&t, "files");
    drop(t);
    engine.close().unwrap();
    let engine = open(dir.path());
    check(&engine.table("t").unwrap(), "reopened");
}

fn ar(a: impl Array + 'static) -> ArrayRef {
    Arc::new(a)
}

/// `writer_threads(usize::MAX)` (the builder only clamps from below) made `Engine::open` panic
/// in tokio's semaphore. Every thread count above `gritdb::MAX_THREADS` is now
/// `Error::Config` at open, before anything is created on disk; `MAX_THREADS` background
/// flush threads open and work.
#[test]
fn thread_counts_above_max_threads_are_config_errors() {
    type Set = fn(gritdb::EngineConfig, usize) -> gritdb::EngineConfig;
    let setters: [(&str, Set); 3] = [
        ("writer_threads", |c, n| c.writer_threads(n)),
        ("flush_threads", |c, n| c.flush_threads(n)),
        ("background_flush_threads", |c, n| c.background_flush_threads(n)),
    ];
    let mut bad = Vec::new();
    for (name, set) in setters {
        for n in [usize::MAX, usize::MAX >> 2, gritdb::MAX_THREADS + 1] {
            let dir = tempfile::tempdir().unwrap();
            let data = dir.path().join("d");
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Engine::open(&data, set(cfg(64 * MIB), n)).map(|_| ())));
            match r {
                Ok(Err(Error::Config(msg))) => {
                    assert!(msg.contains(name), "{msg}");
                    assert!(!data.exists(), "{name}({n}) created the data directory");
                }
                Ok(other) => bad.push(format!("{name}({n}): {other:?}")),
                Err(p) => bad.push(format!("{name}({n}): panicked: {}", crate::breaker_trial::panic_text(&*p))),
            }
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg(64 * MIB).writer_threads(gritdb::MAX_THREADS)).unwrap();
    workload(&engine, "t");
    engine.close().unwrap();
}

/// `check` of table `t` as it is ("after flush"), then of the same table after a clean close
/// and reopen of `dir` ("after reopen").
fn check_then_reopen(t: &gritdb::Table, engine: Engine, dir: &std::path::Path, check: impl Fn(&gritdb::Table, &str)) {
    check(t, "after flush");
    engine.close().unwrap();
    let engine = open(dir);
    check(&engine.table("t").unwrap(), "after reopen");
}
