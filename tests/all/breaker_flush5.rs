//! Adversarial checks of the flush path: the delta's select in arena order (counting sort by
//! row block, per-block bitmap placement, the map-order fallback under a tight limit), the
//! tiled rows -> Arrow decode (128 rows a tile, column by column), and the key index's blocked
//! bloom filter built from several key parts. Every column type the codec supports, nullable
//! and not, null patterns that cross 8-row bytes and 128-row tiles; fixed, wide, composite and
//! variable-width keys with long shared prefixes; many files, compaction, reopen. Every answer
//! is compared value for value with a `BTreeMap` model (key -> version; every cell is a
//! function of key, version and column).

use arrow::array::{
    Array, ArrayRef, ArrowPrimitiveType, AsArray, BinaryArray, BinaryViewArray, BooleanArray, LargeBinaryArray, LargeStringArray,
    PrimitiveArray, RecordBatch, StringArray, StringViewArray,
};
use arrow::datatypes::{
    DataType, Date32Type, Date64Type, Decimal128Type, DurationMicrosecondType, DurationMillisecondType, DurationNanosecondType,
    DurationSecondType, Field, Float16Type, Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type, Schema, SchemaRef,
    Time32MillisecondType, Time32SecondType, Time64MicrosecondType, Time64NanosecondType, TimeUnit, TimestampMicrosecondType,
    TimestampMillisecondType, TimestampNanosecondType, TimestampSecondType, UInt8Type, UInt16Type, UInt32Type, UInt64Type,
};
use arrow::util::display::array_value_to_string;
use gritdb::memory::Category;
use gritdb::{CompareOp, Engine, EngineConfig, Error, ScanFilter, ScanOptions, Table, WalSync};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const MIB: usize = 1 << 20;

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A deterministic shuffle.
fn shuffle<T>(v: &mut [T], seed: u64) {
    for i in (1..v.len()).rev() {
        v.swap(i, (mix(seed ^ i as u64) % (i as u64 + 1)) as usize);
    }
}

// ---------------------------------------------------------------- shapes

/// Which rows of a nullable column are null.
#[derive(Clone, Copy, Debug)]
enum Nulls {
    Never,
    All,
    /// One in `n`, by hash.
    Hash(u64),
    /// Runs of `n` keys, alternately null and not (the phase shifted by the column).
    Runs(i64),
}

#[derive(Clone, Debug)]
struct Col {
    dt: DataType,
    nulls: Option<Nulls>,
}

/// The primary key, a function of the model's `i64` key `k` (injective).
#[derive(Clone, Copy, Debug)]
enum KeyKind {
    /// `Int64`.
    I64,
    /// `(Int16, UInt8)`: a 3-byte stored key.
    Small,
    /// `(Int64, Int64, Int64)`: 24 bytes, above the 16-byte integer compare.
    Wide,
    /// `(Decimal128(38, 0), Int32)`: 20 bytes, decimals of both signs.
    DecI32,
    /// `(Utf8, Int32)`: a 41-byte shared prefix, then `k` unpadded.
    Str,
    /// `(Binary, Boolean)`: 17..21 zero bytes then `k`; Boolean makes the layout variable.
    BinBool,
    /// `Utf8View`: `k` zero-padded to 12 bytes (even `k`) or 13 (odd).
    View,
    /// `(Float64, Timestamp(us, +05:30))`, negative floats included.
    F64Ts,
    /// Five `Decimal128(38, 5)` columns: an 80-byte stored key (above the 64-byte stack buffer).
    Dec5,
    /// `(UInt64, Int8)`: unsigned values past `i64::MAX`.
    U64I8,
}

impl KeyKind {
    fn fields(self) -> Vec<Field> {
        let f = |n: &str, dt: DataType| Field::new(n, dt, false);
        match self {
            KeyKind::I64 => vec![f("p0", DataType::Int64)],
            KeyKind::Small => vec![f("p0", DataType::Int16), f("p1", DataType::UInt8)],
            KeyKind::Wide => vec![f("p0", DataType::Int64), f("p1", DataType::Int64), f("p2", DataType::Int64)],
            KeyKind::DecI32 => vec![f("p0", DataType::Decimal128(38, 0)), f("p1", DataType::Int32)],
            KeyKind::Str => vec![f("p0", DataType::Utf8), f("p1", DataType::Int32)],
            KeyKind::BinBool => vec![f("p0", DataType::Binary), f("p1", DataType::Boolean)],
            KeyKind::View => vec![f("p0", DataType::Utf8View)],
            KeyKind::F64Ts => vec![f("p0", DataType::Float64), f("p1", DataType::Timestamp(TimeUnit::Microsecond, Some("+05:30".into())))],
            KeyKind::Dec5 => (0..5).map(|i| f(&format!("p{i}"), DataType::Decimal128(38, 5))).collect(),
            KeyKind::U64I8 => vec![f("p0", DataType::UInt64), f("p1", DataType::Int8)],
        }
    }

    fn arrays(self, ks: &[i64]) -> Vec<ArrayRef> {
        let i64s = |f: &dyn Fn(i64) -> i64| -> ArrayRef { Arc::new(PrimitiveArray::<Int64Type>::from_iter_values(ks.iter().map(|&k| f(k)))) };
        let i32s = |f: &dyn Fn(i64) -> i32| -> ArrayRef { Arc::new(PrimitiveArray::<Int32Type>::from_iter_values(ks.iter().map(|&k| f(k)))) };
        match self {
            KeyKind::I64 => vec![i64s(&|k| k)],
            KeyKind::Small => vec![
                Arc::new(PrimitiveArray::<Int16Type>::from_iter_values(ks.iter().map(|&k| (k >> 8) as i16 - 100))),
                Arc::new(PrimitiveArray::<UInt8Type>::from_iter_values(ks.iter().map(|&k| (k & 255) as u8))),
            ],
            KeyKind::Wide => vec![i64s(&|k| k % 7 - 3), i64s(&|k| -k), i64s(&|k| k * 3)],
            KeyKind::DecI32 => vec![
                Arc::new(
                    PrimitiveArray::<Decimal128Type>::from_iter_values(ks.iter().map(|&k| i128::from(k % 5 - 2) * 10i128.pow(30) + i128::from(k)))
                        .with_data_type(DataType::Decimal128(38, 0)),
                ),
                i32s(&|k| -(k as i32)),
            ],
            KeyKind::Str => vec![
                Arc::new(StringArray::from_iter_values(ks.iter().map(|&k| format!("customer/region-7/shared-prefix-000000/{k}")))),
                i32s(&|k| (k % 3) as i32),
            ],
            KeyKind::BinBool => vec![
                Arc::new(BinaryArray::from_iter_values(ks.iter().map(|&k| {
                    let mut b = vec![0u8; 17 + (k % 5) as usize];
                    b.extend_from_slice(&(k as u32).to_be_bytes());
                    b
                }))),
                Arc::new(BooleanArray::from_iter(ks.iter().map(|&k| Some(k % 2 == 0)))),
            ],
            KeyKind::View => vec![Arc::new(StringViewArray::from_iter_values(
                ks.iter().map(|&k| if k % 2 == 0 { format!("{k:012}") } else { format!("{k:013}") }),
            ))],
            KeyKind::F64Ts => vec![
                Arc::new(PrimitiveArray::<Float64Type>::from_iter_values(ks.iter().map(|&k| (k as f64 - 500.0) * 0.25))),
                Arc::new(
                    PrimitiveArray::<TimestampMicrosecondType>::from_iter_values(ks.iter().map(|&k| k * 1_000 - 77))
                        .with_data_type(DataType::Timestamp(TimeUnit::Microsecond, Some("+05:30".into()))),
                ),
            ],
            KeyKind::Dec5 => (0..5i128)
                .map(|i| -> ArrayRef {
                    Arc::new(
                        PrimitiveArray::<Decimal128Type>::from_iter_values(
                            ks.iter().map(|&k| if i == 4 { i128::from(k) - 300 } else { (10i128.pow(37) - 1) * if k % 2 == 0 { 1 } else { -1 } - i }),
                        )
                        .with_data_type(DataType::Decimal128(38, 5)),
                    )
                })
                .collect(),
            KeyKind::U64I8 => vec![
                Arc::new(PrimitiveArray::<UInt64Type>::from_iter_values(ks.iter().map(|&k| u64::MAX - (k as u64 >> 7) * 0x0100_0000_0000_0001))),
                Arc::new(PrimitiveArray::<Int8Type>::from_iter_values(ks.iter().map(|&k| (k & 127) as i8 - 64))),
            ],
        }
    }
}

/// A table: key columns `p*`, `kk` Int64 (the model key, for matching rows back), `v` Int64
/// (the version), then the value columns `c*`.
struct Shape {
    key: KeyKind,
    cols: Vec<Col>,
}

fn cell_hash(k: i64, ver: u64, c: usize) -> u64 {
    mix((k as u64).wrapping_mul(0x100_0000_01b3) ^ ver.rotate_left(24) ^ ((c as u64) << 52))
}

fn is_null(n: Nulls, k: i64, h: u64, c: usize) -> bool {
    match n {
        Nulls::Never => false,
        Nulls::All => true,
        Nulls::Hash(m) => (h >> 3).is_multiple_of(m),
        Nulls::Runs(m) => (k + c as i64).div_euclid(m) % 2 == 0,
    }
}

/// Text of `len` bytes or one more (a 2-byte fill may overshoot), starting with key and version.
fn text(k: i64, ver: u64, h: u64) -> String {
    const LENS: [usize; 12] = [0, 1, 5, 11, 12, 13, 14, 16, 17, 40, 300, 2_000];
    let len = LENS[(h >> 8) as usize % LENS.len()];
    let mut s = format!("{k}.{ver}|");
    if len <= s.len() {
        s.truncate(len);
        return s;
    }
    let fill = ['a', 'q', 'é', 'z'][(h >> 40) as usize % 4];
    while s.len() < len {
        s.push(fill);
    }
    s
}

fn bytes(k: i64, ver: u64, h: u64) -> Vec<u8> {
    let mut b = text(k, ver, h).into_bytes();
    for (i, x) in b.iter_mut().enumerate() {
        *x ^= (h >> (i % 50)) as u8 & 0x81;
    }
    b
}

fn prim<T: ArrowPrimitiveType>(dt: &DataType, vals: impl Iterator<Item = Option<T::Native>>) -> ArrayRef {
    Arc::new(PrimitiveArray::<T>::from_iter(vals).with_data_type(dt.clone()))
}

impl Shape {
    fn schema(&self) -> SchemaRef {
        let mut f = self.key.fields();
        f.push(Field::new("kk", DataType::Int64, false));
        f.push(Field::new("v", DataType::Int64, false));
        for (c, col) in self.cols.iter().enumerate() {
            f.push(Field::new(format!("c{c}"), col.dt.clone(), col.nulls.is_some()));
        }
        Arc::new(Schema::new(f))
    }

    fn key_names(&self) -> Vec<String> {
        self.key.fields().iter().map(|f| f.name().clone()).collect()
    }

    fn column(&self, c: usize, rows: &[(i64, u64)]) -> ArrayRef {
        let col = &self.cols[c];
        let nulls = col.nulls.unwrap_or(Nulls::Never);
        let cells = || {
            rows.iter().map(move |&(k, ver)| {
                let h = cell_hash(k, ver, c);
                (!is_null(nulls, k, h, c)).then_some((k, ver, h))
            })
        };
        // Random bits with zero and all-ones now and then.
        let bits = |h: u64| match h % 16 {
            0 => 0,
            1 => u64::MAX,
            _ => mix(h),
        };
        let dt = &col.dt;
        macro_rules! p {
            ($t:ty, $f:expr) => {
                prim::<$t>(dt, cells().map(|x| x.map(|(_, _, h)| $f(bits(h)))))
            };
        }
        match dt {
            DataType::Boolean => Arc::new(cells().map(|x| x.map(|(_, _, h)| h & 16 != 0)).collect::<BooleanArray>()),
            DataType::Int8 => p!(Int8Type, |b: u64| b as i8),
            DataType::Int16 => p!(Int16Type, |b: u64| b as i16),
            DataType::Int32 => p!(Int32Type, |b: u64| b as i32),
            DataType::Int64 => p!(Int64Type, |b: u64| b as i64),
            DataType::UInt8 => p!(UInt8Type, |b: u64| b as u8),
            DataType::UInt16 => p!(UInt16Type, |b: u64| b as u16),
            DataType::UInt32 => p!(UInt32Type, |b: u64| b as u32),
            DataType::UInt64 => p!(UInt64Type, |b: u64| b),
            DataType::Float16 => p!(Float16Type, |b: u64| <Float16Type as ArrowPrimitiveType>::Native::from_bits(b as u16)),
            DataType::Float32 => p!(Float32Type, |b: u64| f32::from_bits(b as u32)),
            DataType::Float64 => p!(Float64Type, f64::from_bits),
            DataType::Date32 => p!(Date32Type, |b: u64| b as i32),
            DataType::Date64 => p!(Date64Type, |b: u64| b as i64),
            DataType::Time32(TimeUnit::Second) => p!(Time32SecondType, |b: u64| b as i32),
            DataType::Time32(_) => p!(Time32MillisecondType, |b: u64| (b % 86_400_000) as i32),
            DataType::Time64(TimeUnit::Microsecond) => p!(Time64MicrosecondType, |b: u64| (b % 86_400_000_000) as i64),
            DataType::Time64(_) => p!(Time64NanosecondType, |b: u64| b as i64),
            DataType::Timestamp(TimeUnit::Second, _) => p!(TimestampSecondType, |b: u64| b as i64),
            DataType::Timestamp(TimeUnit::Millisecond, _) => p!(TimestampMillisecondType, |b: u64| b as i64),
            DataType::Timestamp(TimeUnit::Microsecond, _) => p!(TimestampMicrosecondType, |b: u64| b as i64),
            DataType::Timestamp(TimeUnit::Nanosecond, _) => p!(TimestampNanosecondType, |b: u64| b as i64),
            DataType::Duration(TimeUnit::Second) => p!(DurationSecondType, |b: u64| b as i64),
            DataType::Duration(TimeUnit::Millisecond) => p!(DurationMillisecondType, |b: u64| b as i64),
            DataType::Duration(TimeUnit::Microsecond) => p!(DurationMicrosecondType, |b: u64| b as i64),
            DataType::Duration(TimeUnit::Nanosecond) => p!(DurationNanosecondType, |b: u64| b as i64),
            DataType::Decimal128(prec, _) => {
                let m = 10i128.pow(u32::from(*prec));
                p!(Decimal128Type, |b: u64| {
                    let wide = (i128::from(b) << 64 | i128::from(mix(b))) % m;
                    // The bounds themselves now and then.
                    match b % 7 {
                        0 => m - 1,
                        1 => 1 - m,
                        _ => wide,
                    }
                })
            }
            DataType::Utf8 => Arc::new(cells().map(|x| x.map(|(k, v, h)| text(k, v, h))).collect::<StringArray>()),
            DataType::LargeUtf8 => Arc::new(cells().map(|x| x.map(|(k, v, h)| text(k, v, h))).collect::<LargeStringArray>()),
            DataType::Utf8View => Arc::new(cells().map(|x| x.map(|(k, v, h)| text(k, v, h))).collect::<StringViewArray>()),
            DataType::Binary => Arc::new(BinaryArray::from_iter(cells().map(|x| x.map(|(k, v, h)| bytes(k, v, h))))),
            DataType::LargeBinary => Arc::new(LargeBinaryArray::from_iter(cells().map(|x| x.map(|(k, v, h)| bytes(k, v, h))))),
            DataType::BinaryView => Arc::new(BinaryViewArray::from_iter(cells().map(|x| x.map(|(k, v, h)| bytes(k, v, h))))),
            other => panic!("no generator for {other}"),
        }
    }

    fn batch(&self, rows: &[(i64, u64)]) -> RecordBatch {
        let ks: Vec<i64> = rows.iter().map(|r| r.0).collect();
        let mut cols = self.key.arrays(&ks);
        cols.push(Arc::new(PrimitiveArray::<Int64Type>::from_iter_values(ks.iter().copied())));
        cols.push(Arc::new(PrimitiveArray::<Int64Type>::from_iter_values(rows.iter().map(|r| r.1 as i64))));
        for c in 0..self.cols.len() {
            cols.push(self.column(c, rows));
        }
        RecordBatch::try_new(self.schema(), cols).unwrap()
    }

    fn keys(&self, ks: &[i64]) -> RecordBatch {
        RecordBatch::try_new(Arc::new(Schema::new(self.key.fields())), self.key.arrays(ks)).unwrap()
    }
}

/// Every type the codec supports, each nullable (null patterns cycling) and not; all-null
/// columns of a few kinds.
fn every_type() -> Vec<Col> {
    let tz = |s: &str| Some(Arc::<str>::from(s));
    let types = [
        DataType::Boolean,
        DataType::Int8,
        DataType::Int16,
        DataType::Int32,
        DataType::Int64,
        DataType::UInt8,
        DataType::UInt16,
        DataType::UInt32,
        DataType::UInt64,
        DataType::Float16,
        DataType::Float32,
        DataType::Float64,
        DataType::Date32,
        DataType::Date64,
        DataType::Time32(TimeUnit::Second),
        DataType::Time32(TimeUnit::Millisecond),
        DataType::Time64(TimeUnit::Microsecond),
        DataType::Time64(TimeUnit::Nanosecond),
        DataType::Timestamp(TimeUnit::Second, None),
        DataType::Timestamp(TimeUnit::Millisecond, tz("UTC")),
        DataType::Timestamp(TimeUnit::Microsecond, tz("+02:00")),
        DataType::Timestamp(TimeUnit::Nanosecond, None),
        DataType::Duration(TimeUnit::Second),
        DataType::Duration(TimeUnit::Millisecond),
        DataType::Duration(TimeUnit::Microsecond),
        DataType::Duration(TimeUnit::Nanosecond),
        DataType::Decimal128(1, 0),
        DataType::Decimal128(5, 2),
        DataType::Decimal128(18, 4),
        DataType::Decimal128(19, 0),
        DataType::Decimal128(38, 0),
        DataType::Decimal128(38, 10),
        DataType::Utf8,
        DataType::LargeUtf8,
        DataType::Utf8View,
        DataType::Binary,
        DataType::LargeBinary,
        DataType::BinaryView,
    ];
    let patterns =
        [Nulls::Hash(5), Nulls::Runs(1), Nulls::Runs(7), Nulls::Runs(8), Nulls::Runs(127), Nulls::Runs(128), Nulls::Runs(129), Nulls::Never, Nulls::Hash(2)];
    let mut cols = Vec::new();
    for (i, dt) in types.iter().enumerate() {
        cols.push(Col { dt: dt.clone(), nulls: Some(patterns[i % patterns.len()]) });
        cols.push(Col { dt: dt.clone(), nulls: None });
    }
    for dt in [DataType::Boolean, DataType::Int32, DataType::Utf8View, DataType::Binary, DataType::Decimal128(38, 0)] {
        cols.push(Col { dt, nulls: Some(Nulls::All) });
    }
    cols
}

/// A few columns of each layout (bool, fixed, offsets, views) for key-heavy tests.
fn few_types() -> Vec<Col> {
    vec![
        Col { dt: DataType::Utf8, nulls: Some(Nulls::Hash(7)) },
        Col { dt: DataType::Boolean, nulls: Some(Nulls::Runs(3)) },
        Col { dt: DataType::BinaryView, nulls: Some(Nulls::Runs(129)) },
        Col { dt: DataType::Decimal128(38, 10), nulls: None },
    ]
}

// ---------------------------------------------------------------- the model

struct Model {
    shape: Shape,
    rows: BTreeMap<i64, u64>,
    ver: u64,
    /// Write batches as slices of a larger batch (odd offsets into every buffer and bitmap).
    sliced: bool,
}

fn table_rows(m: &Model, ks: &[i64], ver: u64) -> Vec<(i64, u64)> {
    let _ = m;
    ks.iter().map(|&k| (k, ver)).collect()
}

impl Model {
    fn new(shape: Shape) -> Self {
        Self { shape, rows: BTreeMap::new(), ver: 0, sliced: false }
    }

    /// The batch to write for `rows`: built directly, or (when `sliced`, every other call)
    /// cut out of a larger batch whose other rows (keys below -1) must not be written.
    fn input(&mut self, rows: &[(i64, u64)]) -> RecordBatch {
        if !self.sliced {
            return self.shape.batch(rows);
        }
        self.ver += 1;
        let (before, after) = (3 + (self.ver % 9) as usize, 1 + (self.ver % 4) as usize);
        let pad = |i: usize| (-2 - i as i64, self.ver);
        let all: Vec<(i64, u64)> = (0..before).map(pad).chain(rows.iter().copied()).chain((before..before + after).map(pad)).collect();
        self.shape.batch(&all).slice(before, rows.len())
    }

    fn create(&self, e: &Engine, name: &str) -> Table {
        let names = self.shape.key_names();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        e.create_table(name, self.shape.schema(), &refs).unwrap()
    }

    fn insert(&mut self, t: &Table, ks: &[i64]) {
        self.ver += 1;
        let rows = table_rows(self, ks, self.ver);
        assert!(ks.iter().all(|k| !self.rows.contains_key(k)), "model: insert of an existing key");
        assert_eq!(t.insert(&self.input(&rows)).unwrap(), rows.len());
        self.rows.extend(rows);
    }

    fn upsert(&mut self, t: &Table, ks: &[i64]) {
        self.ver += 1;
        let rows = table_rows(self, ks, self.ver);
        assert_eq!(t.upsert(&self.input(&rows)).unwrap(), rows.len());
        self.rows.extend(rows);
    }

    fn update(&mut self, t: &Table, ks: &[i64]) {
        self.ver += 1;
        let rows = table_rows(self, ks, self.ver);
        assert!(ks.iter().all(|k| self.rows.contains_key(k)), "model: update of a missing key");
        assert_eq!(t.update(&self.input(&rows)).unwrap(), rows.len());
        self.rows.extend(rows);
    }

    fn delete(&mut self, t: &Table, ks: &[i64]) {
        let present = ks.iter().filter(|k| self.rows.contains_key(k)).count();
        assert_eq!(t.delete(&self.shape.keys(ks)).unwrap(), present);
        for k in ks {
            self.rows.remove(k);
        }
    }

    /// The table's content equals the model, value for value. Batches are checked as they
    /// come (each against the model's rows for its keys, in its order) and dropped, so the
    /// check holds little scan memory under a small limit.
    fn check(&self, t: &Table, what: &str) {
        self.check_with(t, ScanOptions::default(), None, &|_, _| true, what);
    }

    /// [`Self::check`] of a scan with `options`, projected to schema columns `proj` (which
    /// must hold `kk`) when given, returning the model's rows for which `keep(k, version)`.
    fn check_with(&self, t: &Table, options: ScanOptions, proj: Option<&[usize]>, keep: &dyn Fn(i64, u64) -> bool, what: &str) {
        let full = self.shape.schema();
        let cols: Vec<usize> = proj.map_or_else(|| (0..full.fields().len()).collect(), <[usize]>::to_vec);
        let schema = Arc::new(full.project(&cols).unwrap());
        let kk = cols.iter().position(|&c| c == self.shape.key.fields().len()).expect("kk projected");
        let mut seen = std::collections::BTreeSet::new();
        for b in t.scan(options).unwrap_or_else(|e| panic!("{what}: scan: {e}")) {
            let got = b.unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(got.schema().fields(), schema.fields(), "{what}: scan schema");
            let keys: Vec<i64> = got.column(kk).as_primitive::<Int64Type>().values().to_vec();
            let rows: Vec<(i64, u64)> = keys
                .iter()
                .map(|&k| {
                    assert!(seen.insert(k), "{what}: key {k} returned twice");
                    (k, *self.rows.get(&k).unwrap_or_else(|| panic!("{what}: key {k} is not in the model")))
                })
                .collect();
            assert!(rows.iter().all(|&(k, v)| keep(k, v)), "{what}: a row the filter should drop");
            let want = self.shape.batch(&rows).project(&cols).unwrap();
            for j in 0..schema.fields().len() {
                let (g, w) = (got.column(j), want.column(j));
                if g.to_data() == w.to_data() {
                    continue;
                }
                let i = (0..g.len()).find(|&i| g.slice(i, 1).to_data() != w.slice(i, 1).to_data()).unwrap_or(0);
                panic!(
                    "{what}: column {} ({}) differs at key {} (row {i} of a {}-row batch): got {:?}, want {:?}",
                    schema.field(j).name(),
                    schema.field(j).data_type(),
                    keys[i],
                    g.len(),
                    array_value_to_string(g, i).unwrap(),
                    array_value_to_string(w, i).unwrap()
                );
            }
        }
        let want = self.rows.iter().filter(|(k, v)| keep(**k, **v)).count();
        if seen.len() != want {
            let missing: Vec<_> = self.rows.iter().filter(|(k, v)| keep(**k, **v) && !seen.contains(k)).take(5).collect();
            panic!("{what}: {} rows vs {want} in the model; missing {missing:?}", seen.len());
        }
    }

    /// Scans with a projection (kk and every third value column from `salt` on, in reverse
    /// order), a range filter on kk, and an IS NULL filter on a value column, each checked.
    fn check_projected(&self, t: &Table, salt: u64, n: i64, what: &str) {
        let base = self.shape.key.fields().len();
        let names: Vec<String> = self.shape.schema().fields().iter().map(|f| f.name().clone()).collect();
        let mut proj: Vec<usize> = (base + 2..names.len()).filter(|c| (*c as u64 + salt) % 3 == 0).rev().collect();
        proj.insert(proj.len() / 2, base);
        let opts = || ScanOptions::default().projection(proj.iter().map(|&c| names[c].clone())).batch_rows(100 + salt as usize * 37);
        self.check_with(t, opts(), Some(&proj), &|_, _| true, &format!("{what}, projected"));
        let cut = n / 3 + salt as i64;
        let f = ScanFilter::compare("kk", CompareOp::Lt, Arc::new(PrimitiveArray::<Int64Type>::from(vec![cut])));
        self.check_with(t, opts().filter(f), Some(&proj), &|k, _| k < cut, &format!("{what}, kk < {cut}"));
        let c = (salt as usize * 5) % self.shape.cols.len();
        if let Some(nulls) = self.shape.cols[c].nulls {
            let f = ScanFilter::is_null(format!("c{c}"));
            let keep = |k: i64, v: u64| is_null(nulls, k, cell_hash(k, v, c), c);
            self.check_with(t, opts().filter(f), Some(&proj), &keep, &format!("{what}, c{c} IS NULL"));
        }
    }

    /// Key checks one row at a time: insert of a live key is refused with `KeyExists`, update
    /// of an absent key with `KeyNotFound` (nothing changes); the opposite writes succeed.
    fn probe(&mut self, t: &Table, ks: impl IntoIterator<Item = i64>, what: &str) {
        for k in ks {
            let row = self.input(&[(k, self.ver + 1)]);
            if self.rows.contains_key(&k) {
                match t.insert(&row) {
                    Err(Error::KeyExists { row: 0, .. }) => {}
                    other => panic!("{what}: insert of live key {k}: {other:?}"),
                }
                if k % 3 == 0 {
                    self.update(t, &[k]);
                }
            } else {
                match t.update(&row) {
                    Err(Error::KeyNotFound { row: 0, .. }) => {}
                    other => panic!("{what}: update of absent key {k}: {other:?}"),
                }
                if k % 3 == 0 {
                    self.insert(t, &[k]);
                }
            }
        }
    }
}

fn config(limit: usize) -> EngineConfig {
    EngineConfig::default()
        .memory_limit(limit)
        .flush_age(Duration::from_hours(1))
        .backpressure_timeout(Duration::from_secs(5))
        .wal_sync(WalSync::Relaxed)
}

fn open(dir: &Path, cfg: EngineConfig) -> Engine {
    Engine::open(dir, cfg).unwrap_or_else(|e| panic!("open: {e}"))
}

/// `keys` written in batches whose sizes cycle through `sizes`.
fn in_batches(keys: &[i64], sizes: &[usize], mut f: impl FnMut(&[i64])) {
    let (mut at, mut i) = (0, 0);
    while at < keys.len() {
        let n = sizes[i % sizes.len()].min(keys.len() - at);
        f(&keys[at..at + n]);
        at += n;
        i += 1;
    }
}

// ---------------------------------------------------------------- every type

/// One table of every column type under `key`: inserts in shuffled order in batches of 1, 7,
/// 127, 128, 129 and 1000 rows; upserts of shuffled subsets (later blocks replace earlier
/// rows), updates, deletes and re-inserts; flushes between rounds in small batches (several
/// key parts per file). Checked from the delta, after each flush, after a drop without close
/// (replay), after close and reopen.
fn every_type_round_trip(key: KeyKind, n: i64, seed: u64, chunk: usize) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = Model::new(Shape { key, cols: every_type() });
    m.sliced = seed % 2 == 1;
    let cfg = || config(256 * MIB).chunk_size(chunk).flush_batch_bytes(64 << 10).table_flush_bytes(64 * MIB);
    let sizes = [1, 7, 127, 128, 129, 1000];
    {
        let e = open(dir.path(), cfg());
        let t = m.create(&e, "all");
        let mut keys: Vec<i64> = (0..n).collect();
        shuffle(&mut keys, seed);
        in_batches(&keys, &sizes, |b| m.insert(&t, b));
        m.check(&t, "after inserts, unflushed");
        t.flush().unwrap();
        m.check(&t, "after the first flush");
        for round in 0..3u64 {
            let mut sub: Vec<i64> = keys.iter().copied().filter(|k| mix(*k as u64 ^ round) % 3 == 0).collect();
            shuffle(&mut sub, seed ^ round);
            in_batches(&sub, &sizes[round as usize..], |b| m.upsert(&t, b));
            // The same keys again, descending: each replaces a row in a later block.
            sub.sort_unstable_by(|a, b| b.cmp(a));
            in_batches(&sub[..sub.len() / 2], &[129], |b| m.upsert(&t, b));
            let upd: Vec<i64> = m.rows.keys().copied().filter(|k| k % 11 == round as i64).collect();
            in_batches(&upd, &[128], |b| m.update(&t, b));
            let del: Vec<i64> = keys.iter().copied().filter(|k| mix(*k as u64 ^ 77 ^ round) % 5 == 0).collect();
            in_batches(&del, &[7, 1000], |b| m.delete(&t, b));
            let back: Vec<i64> = del.iter().copied().filter(|k| k % 2 == 0).collect();
            in_batches(&back, &[127], |b| m.insert(&t, b));
            if round != 1 {
                t.flush().unwrap();
            }
            m.check(&t, &format!("round {round}"));
            m.check_projected(&t, round, n, &format!("round {round}"));
        }
        m.probe(&t, (0..n + 20).step_by(7), "probe before reopen");
        drop(t);
        drop(e);
    }
    let e = open(dir.path(), cfg());
    let t = e.table("all").unwrap();
    m.check(&t, "after replay");
    t.flush().unwrap();
    m.check(&t, "after replay and flush");
    m.probe(&t, (3..n + 20).step_by(5), "probe after reopen");
    e.close().unwrap();
    let e = open(dir.path(), cfg());
    m.check(&e.table("all").unwrap(), "after close and reopen");
}

#[test]
fn every_type_round_trips_int64_key() {
    every_type_round_trip(KeyKind::I64, 2_100, 1, 64 << 10);
}

/// 4 KiB chunks: a handful of rows a block (runs under 16 rows are compared, longer ones
/// placed by bitmap), rows above 4 KiB in blocks of their own.
#[test]
fn every_type_round_trips_4_kib_chunks() {
    every_type_round_trip(KeyKind::Wide, 1_500, 3, 4 << 10);
}

/// 4 MiB chunks: offsets past 1 MiB (the comparison sort within a block).
#[test]
fn every_type_round_trips_4_mib_chunks() {
    every_type_round_trip(KeyKind::BinBool, 1_500, 4, 4 << 20);
}

#[test]
fn every_type_round_trips_string_key() {
    every_type_round_trip(KeyKind::Str, 1_300, 2, 64 << 10);
}

// ---------------------------------------------------------------- many files, key lookups

/// `rounds` flushes, each a file whose keys interleave with every other file's (round `r`
/// inserts `k ≡ r mod rounds`), each also upserting older keys (moving them to the newest
/// file, the old row in a deletion vector), deleting some and re-inserting deleted ones;
/// flush batches of 1 KiB, so each file's keys come to the index as many parts. Then every
/// key is probed (KeyExists / KeyNotFound), compaction runs, and it all again after reopen.
fn many_files(key: KeyKind, rounds: i64, per: i64) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = Model::new(Shape { key, cols: few_types() });
    let cfg = || config(64 * MIB).flush_batch_bytes(1 << 10);
    let span = rounds * per;
    {
        let e = open(dir.path(), cfg());
        let t = m.create(&e, "many");
        for r in 0..rounds {
            let mut new: Vec<i64> = (0..per).map(|i| i * rounds + r).collect();
            new.reverse();
            m.insert(&t, &new);
            let old: Vec<i64> = m.rows.keys().copied().filter(|k| mix(*k as u64 ^ r as u64) % 4 == 0).collect();
            m.upsert(&t, &old);
            let del: Vec<i64> = (0..span).filter(|k| mix(*k as u64 ^ 0xdead ^ r as u64) % 9 == 0).collect();
            m.delete(&t, &del);
            let back: Vec<i64> = del.iter().copied().filter(|k| k % 3 == 1 && *k % rounds < r).collect();
            m.insert(&t, &back);
            t.flush().unwrap();
        }
        m.check(&t, &format!("{key:?}: after {rounds} flushes"));
        m.probe(&t, -3..span + 3, &format!("{key:?}: probe"));
        t.flush().unwrap();
        m.check(&t, &format!("{key:?}: after the probes' flush"));
        drop(t);
        drop(e);
    }
    let e = open(dir.path(), cfg());
    let t = e.table("many").unwrap();
    m.check(&t, &format!("{key:?}: after reopen"));
    m.probe(&t, (-3..span + 3).rev(), &format!("{key:?}: probe after reopen"));
    t.flush().unwrap();
    m.check(&t, &format!("{key:?}: after reopen and flush"));
}

#[test]
fn many_files_int64_key() {
    many_files(KeyKind::I64, 12, 40);
}

#[test]
fn many_files_three_byte_key() {
    many_files(KeyKind::Small, 12, 40);
}

#[test]
fn many_files_24_byte_key() {
    many_files(KeyKind::Wide, 12, 40);
}

#[test]
fn many_files_decimal_int32_key() {
    many_files(KeyKind::DecI32, 12, 40);
}

#[test]
fn many_files_string_prefix_key() {
    many_files(KeyKind::Str, 12, 40);
}

#[test]
fn many_files_binary_boolean_key() {
    many_files(KeyKind::BinBool, 12, 40);
}

#[test]
fn many_files_view_key_12_and_13_bytes() {
    many_files(KeyKind::View, 12, 40);
}

#[test]
fn many_files_80_byte_decimal_key() {
    many_files(KeyKind::Dec5, 12, 40);
}

#[test]
fn many_files_uint64_int8_key() {
    many_files(KeyKind::U64I8, 12, 40);
}

#[test]
fn many_files_float_timestamp_key() {
    many_files(KeyKind::F64Ts, 12, 40);
}

// ---------------------------------------------------------------- large flushes

/// Over 2 × 16,384 rows (the select sorts in two parts on two threads and merges them), a
/// batch of 65,537 rows (the flush cuts batches at 65,536), written in descending key order,
/// then upserted in shuffled order so the newest rows lie in later blocks than their
/// neighbours; small 1 KiB-row-ish flush batches too.
fn large_flush(key: KeyKind, batch_bytes: usize) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = Model::new(Shape { key, cols: few_types() });
    let cfg = || config(512 * MIB).table_flush_bytes(256 * MIB).flush_batch_bytes(batch_bytes).flush_threads(2);
    let e = open(dir.path(), cfg());
    let t = m.create(&e, "large");
    let n = 80_000i64;
    let desc: Vec<i64> = (0..n).rev().collect();
    in_batches(&desc, &[65_537, 1], |b| m.insert(&t, b));
    let mut sub: Vec<i64> = (0..n).filter(|k| mix(*k as u64) % 3 == 0).collect();
    shuffle(&mut sub, 9);
    in_batches(&sub, &[4_096], |b| m.upsert(&t, b));
    let del: Vec<i64> = (0..n).filter(|k| mix(*k as u64 ^ 5) % 7 == 0).collect();
    m.delete(&t, &del);
    t.flush().unwrap();
    m.check(&t, &format!("{key:?}: after a large flush"));
    let mut sub: Vec<i64> = (0..n + 40_000).filter(|k| mix(*k as u64 ^ 11) % 2 == 0).collect();
    shuffle(&mut sub, 10);
    in_batches(&sub, &[65_537, 999], |b| m.upsert(&t, b));
    t.flush().unwrap();
    m.check(&t, &format!("{key:?}: after a second large flush"));
    m.probe(&t, (0..n + 40_010).step_by(997), &format!("{key:?}: probe"));
    drop(t);
    e.close().unwrap();
    let e = open(dir.path(), cfg());
    m.check(&e.table("large").unwrap(), &format!("{key:?}: after reopen"));
}

#[test]
fn large_flush_string_key_in_two_parts() {
    large_flush(KeyKind::Str, 256 << 20);
}

#[test]
fn large_flush_int64_key_small_batches() {
    large_flush(KeyKind::I64, 1 << 20);
}

// ---------------------------------------------------------------- failures inside a flush

/// An allocation failure injected at the n-th reservation of a flush of 34,000 rows (two sort
/// parts; the select's row-start budget among them: refused, the select falls back to map
/// order), for n = 0, 1, 2, ...: the flush either succeeds or fails with a typed memory error;
/// either way the table stays exact, the key checks hold, and a retry succeeds.
#[test]
fn injected_failure_walks_a_large_flush() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = Model::new(Shape { key: KeyKind::Str, cols: few_types() });
    let e = open(dir.path(), config(256 * MIB).table_flush_bytes(128 * MIB).flush_batch_bytes(256 << 10).flush_threads(2));
    let t = m.create(&e, "inj");
    let n = 34_000i64;
    let mut round = 0u64;
    let refill = |m: &mut Model, round: u64| {
        let mut ks: Vec<i64> = (0..n).filter(|k| mix(*k as u64 ^ round) % 4 != 0).collect();
        shuffle(&mut ks, round);
        in_batches(&ks, &[9_000], |b| m.upsert(&t, b));
        let del: Vec<i64> = (0..n).filter(|k| mix(*k as u64 ^ round ^ 99) % 10 == 0).collect();
        m.delete(&t, &del);
    };
    refill(&mut m, round);
    let (mut ok, mut failed) = (0, 0);
    for step in 0..30u64 {
        e.memory().inject_failure_after(Some(step));
        let r = t.flush();
        e.memory().inject_failure_after(None);
        match r {
            Ok(_) => ok += 1,
            Err(Error::Memory(_) | Error::MemoryLimit { .. }) => failed += 1,
            Err(other) => panic!("step {step}: untyped flush failure {other:?}"),
        }
        m.check(&t, &format!("step {step}"));
        m.probe(&t, (0..n).step_by(4_999), &format!("step {step}"));
        if r.is_ok() {
            assert_eq!(e.memory().category_bytes(Category::BatchBlocks), 0, "step {step}: batch blocks held after a flush");
            round += 1;
            refill(&mut m, round);
        }
    }
    assert!(ok > 0 && failed > 5, "{ok} flushes succeeded, {failed} failed");
    t.flush().unwrap();
    m.check(&t, "after the walk");
    for c in [Category::BatchBlocks, Category::ScanBuffers, Category::WriteBuffers] {
        assert_eq!(e.memory().category_bytes(c), 0, "{c:?} held after the walk");
    }
    drop(t);
    e.close().unwrap();
    let e = open(dir.path(), config(256 * MIB));
    m.check(&e.table("inj").unwrap(), "after reopen");
}

// ---------------------------------------------------------------- float keys

/// Float keys are compared by their bits (arrow-row's total order): NaNs of both signs and
/// several payloads, ±0, ±inf and subnormals are distinct keys, in the delta, in files (the
/// fixed-width index), after compaction and after reopen.
#[test]
fn float_keys_nan_payloads_and_signed_zeros() {
    let f64s: Vec<f64> = [0x7ff8_0000_0000_0000u64, 0xfff8_0000_0000_0000, 0x7ff0_0000_0000_0001, 0x7ff8_0000_0000_00ff, 0, 1 << 63, 1, (1 << 63) | 1]
        .into_iter()
        .map(f64::from_bits)
        .chain([f64::INFINITY, f64::NEG_INFINITY, 1.5, -1.5, f64::MAX, f64::MIN])
        .collect();
    let f32s: Vec<f32> = [0x7fc0_0000u32, 0xffc0_0000, 0x7f80_0001, 0, 1 << 31].into_iter().map(f32::from_bits).collect();
    let schema = Arc::new(Schema::new(vec![
        Field::new("a", DataType::Float64, false),
        Field::new("b", DataType::Float32, false),
        Field::new("v", DataType::Int64, false),
    ]));
    let combos: Vec<(f64, f32)> = f64s.iter().flat_map(|&a| f32s.iter().map(move |&b| (a, b))).collect();
    let batch = |rows: &[(f64, f32)], v: i64| {
        RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(PrimitiveArray::<Float64Type>::from_iter_values(rows.iter().map(|r| r.0))),
                Arc::new(PrimitiveArray::<Float32Type>::from_iter_values(rows.iter().map(|r| r.1))),
                Arc::new(PrimitiveArray::<Int64Type>::from_iter_values(rows.iter().map(|_| v))),
            ],
        )
        .unwrap()
    };
    let bits = |b: &RecordBatch| -> Vec<(u64, u32, i64)> {
        let a = b.column(0).as_primitive::<Float64Type>();
        let f = b.column(1).as_primitive::<Float32Type>();
        let v = b.column(2).as_primitive::<Int64Type>();
        (0..b.num_rows()).map(|i| (a.value(i).to_bits(), f.value(i).to_bits(), v.value(i))).collect()
    };
    let scan = |t: &Table| {
        let mut all: Vec<(u64, u32, i64)> = t.scan(ScanOptions::default()).unwrap().flat_map(|b| bits(&b.unwrap())).collect();
        all.sort_unstable();
        all
    };
    let dir = tempfile::tempdir().unwrap();
    let mut want: Vec<(u64, u32, i64)> = combos.iter().map(|r| (r.0.to_bits(), r.1.to_bits(), 1)).collect();
    want.sort_unstable();
    {
        let e = open(dir.path(), config(64 * MIB));
        let t = e.create_table("f", Arc::clone(&schema), &["a", "b"]).unwrap();
        // One file per f64 value (interleaved key ranges), compacted along the way.
        for (i, &a) in f64s.iter().enumerate() {
            let rows: Vec<(f64, f32)> = f32s.iter().map(|&b| (a, b)).collect();
            t.insert(&batch(&rows, 1)).unwrap();
            if i % 2 == 0 {
                t.flush().unwrap();
            }
        }
        assert_eq!(scan(&t), want);
        t.flush().unwrap();
        assert_eq!(scan(&t), want);
        for (i, r) in combos.iter().enumerate() {
            assert!(matches!(t.insert(&batch(&[*r], 2)), Err(Error::KeyExists { .. })), "insert of key {i} {r:?}");
        }
        assert_eq!(t.update(&batch(&combos, 2)).unwrap(), combos.len());
        t.flush().unwrap();
    }
    let e = open(dir.path(), config(64 * MIB));
    let t = e.table("f").unwrap();
    let want2: Vec<(u64, u32, i64)> = want.iter().map(|r| (r.0, r.1, 2)).collect();
    assert_eq!(scan(&t), want2);
    for r in &combos {
        assert!(matches!(t.insert(&batch(&[*r], 3)), Err(Error::KeyExists { .. })), "after reopen: insert of key {r:?}");
    }
    assert_eq!(t.delete(&RecordBatch::try_new(Arc::new(Schema::new(schema.fields()[..2].to_vec())), batch(&combos, 0).columns()[..2].to_vec()).unwrap()).unwrap(), combos.len());
    t.flush().unwrap();
    assert_eq!(scan(&t), vec![]);
}

// ---------------------------------------------------------------- small limits

/// Every type under a 6 MiB limit (1 MiB deltas, flushed by the background writer on two
/// threads while writes go on, row groups cut early), then reopened at 4 MiB and 5 MiB:
/// exact each time; refusals, if any, are typed and leave nothing applied.
#[test]
fn every_type_under_small_limits() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = Model::new(Shape { key: KeyKind::Str, cols: every_type() });
    let cfg = |limit: usize| config(limit).background_flush_threads(2).flush_threads(2).flush_batch_bytes(128 << 10);
    let n = 1_800i64;
    {
        let e = open(dir.path(), cfg(6 * MIB));
        let t = m.create(&e, "small");
        let mut keys: Vec<i64> = (0..n).collect();
        shuffle(&mut keys, 21);
        in_batches(&keys, &[127, 1, 128, 7, 129], |b| m.insert(&t, b));
        for round in 0..3u64 {
            let mut sub: Vec<i64> = (0..n).filter(|k| mix(*k as u64 ^ round) % 2 == 0).collect();
            shuffle(&mut sub, round);
            in_batches(&sub, &[129, 128], |b| m.upsert(&t, b));
            let del: Vec<i64> = (0..n).filter(|k| mix(*k as u64 ^ round ^ 5) % 6 == 0).collect();
            in_batches(&del, &[500], |b| m.delete(&t, b));
        }
        m.check(&t, "at 6 MiB");
        let used = e.memory().used();
        assert!(used <= e.memory().limit(), "{used} above the limit");
        drop(t);
        drop(e);
    }
    for limit in [4 * MIB, 5 * MIB] {
        let e = open(dir.path(), cfg(limit));
        let t = e.table("small").unwrap();
        m.check(&t, &format!("replayed at {limit}"));
        let back: Vec<i64> = (0..n).filter(|k| !m.rows.contains_key(k) && k % 3 == (limit / MIB) as i64 % 3).collect();
        in_batches(&back, &[128], |b| m.insert(&t, b));
        m.probe(&t, (0..n).step_by(13), &format!("probe at {limit}"));
        t.flush().unwrap();
        m.check(&t, &format!("flushed at {limit}"));
        e.close().unwrap();
    }
    let e = open(dir.path(), cfg(4 * MIB));
    m.check(&e.table("small").unwrap(), "last reopen at 4 MiB");
}

// ---------------------------------------------------------------- concurrency

/// Every row a scan returns is self-consistent: each cell is the function of the row's key
/// and version (whatever version the snapshot saw), and no key comes twice.
fn check_consistent(shape: &Shape, t: &Table, what: &str) -> usize {
    let kk = shape.key.fields().len();
    let mut seen = std::collections::BTreeSet::new();
    for b in t.scan(ScanOptions::default().batch_rows(777)).unwrap_or_else(|e| panic!("{what}: scan: {e}")) {
        let got = b.unwrap_or_else(|e| panic!("{what}: {e}"));
        let ks = got.column(kk).as_primitive::<Int64Type>();
        let vs = got.column(kk + 1).as_primitive::<Int64Type>();
        let rows: Vec<(i64, u64)> = (0..got.num_rows()).map(|i| (ks.value(i), vs.value(i) as u64)).collect();
        for r in &rows {
            assert!(seen.insert(r.0), "{what}: key {} returned twice", r.0);
        }
        let want = shape.batch(&rows);
        for j in 0..got.num_columns() {
            assert!(got.column(j).to_data() == want.column(j).to_data(), "{what}: column {j} inconsistent with key and version");
        }
    }
    seen.len()
}

/// Two writers on one table (disjoint keys) and a reader scanning and probing while the
/// background writer flushes 1 MiB deltas on two threads and compacts: every scan is
/// self-consistent, and the end state is exact (also after a drop without close).
#[test]
fn writers_and_scans_during_background_flushes() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = || config(24 * MIB).table_flush_bytes(MIB).background_flush_threads(2).flush_batch_bytes(64 << 10).flush_age(Duration::from_millis(50));
    let shape = || Shape { key: KeyKind::Str, cols: few_types().into_iter().chain(every_type().into_iter().step_by(3)).collect() };
    let e = open(dir.path(), cfg());
    let t = Model::new(shape()).create(&e, "conc");
    let done = std::sync::atomic::AtomicBool::new(false);
    let models: Vec<Model> = std::thread::scope(|s| {
        let writers: Vec<_> = (0..2i64)
            .map(|w| {
                let t = t.clone();
                s.spawn(move || {
                    let mut m = Model::new(shape());
                    let mine = |k: i64| k * 2 + w;
                    for round in 0..12i64 {
                        let new: Vec<i64> = (round * 300..round * 300 + 300).rev().map(mine).collect();
                        in_batches(&new, &[1, 7, 128, 129], |b| m.insert(&t, b));
                        let mut old: Vec<i64> = m.rows.keys().copied().filter(|k| mix(*k as u64 ^ round as u64) % 3 == 0).collect();
                        shuffle(&mut old, round as u64);
                        in_batches(&old, &[127], |b| m.upsert(&t, b));
                        let del: Vec<i64> = m.rows.keys().copied().filter(|k| mix(*k as u64 ^ 7 ^ round as u64) % 8 == 0).collect();
                        m.delete(&t, &del);
                        m.probe(&t, (0..40).map(|i| mine(i * 89 % (round * 300 + 300))), &format!("writer {w} round {round}"));
                    }
                    m
                })
            })
            .collect();
        let reader = s.spawn(|| {
            let mut scans = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                check_consistent(&shape(), &t, &format!("scan {scans}"));
                scans += 1;
            }
            scans
        });
        let models = writers.into_iter().map(|h| h.join().unwrap()).collect();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(reader.join().unwrap() > 0);
        models
    });
    let mut m = Model::new(shape());
    for w in models {
        m.rows.extend(w.rows);
    }
    m.check(&t, "after the writers");
    drop(t);
    drop(e);
    let e = open(dir.path(), cfg());
    let t = e.table("conc").unwrap();
    m.check(&t, "after a drop without close");
    t.flush().unwrap();
    m.check(&t, "after reopen and flush");
}

// ---------------------------------------------------------------- prefix chains

/// Keys that are prefixes of each other and tie on their first 16 bytes and more: empty,
/// runs of 0x00, 0x01, 0xff and 'a' of 0..=48 bytes, with one more byte after them, as
/// `BinaryView`, `LargeBinary` and `LargeUtf8` keys (composite with a `Boolean`). Written in
/// shuffled order over several flushes (each key moved between files by upserts), deleted and
/// re-inserted; after every step the scan equals the model and every key probes right.
#[test]
fn keys_that_are_prefixes_of_each_other() {
    let mut keys: Vec<Vec<u8>> = Vec::new();
    for n in 0..=48usize {
        for b in [0x00u8, 0x01, 0xff, b'a'] {
            keys.push(vec![b; n]);
            for tail in [0x00u8, 0x01, 0x80] {
                let mut k = vec![b; n];
                k.push(tail);
                keys.push(k);
            }
        }
    }
    keys.sort();
    keys.dedup();
    for dt in [DataType::BinaryView, DataType::LargeBinary, DataType::LargeUtf8] {
        let text = dt == DataType::LargeUtf8;
        // LargeUtf8 keys must be UTF-8: map 0x80 / 0xff to other characters.
        let keys: Vec<Vec<u8>> = if text {
            let mut k: Vec<Vec<u8>> = keys.iter().map(|k| k.iter().map(|&b| if b >= 0x80 { b'~' } else { b }).collect()).collect();
            k.sort();
            k.dedup();
            k
        } else {
            keys.clone()
        };
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", dt.clone(), false),
            Field::new("b", DataType::Boolean, false),
            Field::new("v", DataType::Int64, true),
        ]));
        let key_col = |ks: &[(usize, bool)]| -> ArrayRef {
            let it = ks.iter().map(|&(i, _)| keys[i].as_slice());
            match &dt {
                DataType::BinaryView => Arc::new(BinaryViewArray::from_iter_values(it)),
                DataType::LargeBinary => Arc::new(LargeBinaryArray::from_iter_values(it)),
                _ => Arc::new(LargeStringArray::from_iter_values(it.map(|b| std::str::from_utf8(b).unwrap()))),
            }
        };
        let batch = |ks: &[(usize, bool)], v: i64| {
            RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    key_col(ks),
                    Arc::new(BooleanArray::from_iter(ks.iter().map(|k| Some(k.1)))),
                    Arc::new(PrimitiveArray::<Int64Type>::from_iter(ks.iter().map(|k| (k.0 % 5 != 0).then_some(v + k.0 as i64)))),
                ],
            )
            .unwrap()
        };
        let key_batch = |ks: &[(usize, bool)]| RecordBatch::try_new(Arc::new(schema.project(&[0, 1]).unwrap()), batch(ks, 0).columns()[..2].to_vec()).unwrap();
        let read = |t: &Table| -> BTreeMap<(Vec<u8>, bool), Option<i64>> {
            let mut out = BTreeMap::new();
            for b in t.scan(ScanOptions::default().batch_rows(50)).unwrap() {
                let b = b.unwrap();
                let k = b.column(0);
                for i in 0..b.num_rows() {
                    let key = match &dt {
                        DataType::BinaryView => k.as_binary_view().value(i).to_vec(),
                        DataType::LargeBinary => k.as_binary::<i64>().value(i).to_vec(),
                        _ => k.as_string::<i64>().value(i).as_bytes().to_vec(),
                    };
                    let v = b.column(2).as_primitive::<Int64Type>();
                    let dup = out.insert((key, b.column(1).as_boolean().value(i)), v.is_valid(i).then(|| v.value(i)));
                    assert!(dup.is_none(), "{dt}: a key returned twice");
                }
            }
            out
        };
        let all: Vec<(usize, bool)> = (0..keys.len()).flat_map(|i| [(i, false), (i, true)]).collect();
        let mut model: BTreeMap<(usize, bool), i64> = BTreeMap::new();
        let expect = |model: &BTreeMap<(usize, bool), i64>| -> BTreeMap<(Vec<u8>, bool), Option<i64>> {
            model.iter().map(|(&(i, b), &v)| ((keys[i].clone(), b), (i % 5 != 0).then_some(v + i as i64))).collect()
        };
        let probe = |t: &Table, model: &BTreeMap<(usize, bool), i64>, what: &str| {
            for k in &all {
                let one = batch(&[*k], 9);
                if model.contains_key(k) {
                    assert!(matches!(t.insert(&one), Err(Error::KeyExists { .. })), "{dt} {what}: insert of live key {:?}", keys[k.0]);
                } else {
                    assert!(matches!(t.update(&one), Err(Error::KeyNotFound { .. })), "{dt} {what}: update of absent key {:?}", keys[k.0]);
                }
            }
        };
        let dir = tempfile::tempdir().unwrap();
        {
            let e = open(dir.path(), config(64 * MIB).flush_batch_bytes(1 << 10));
            let t = e.create_table("p", Arc::clone(&schema), &["k", "b"]).unwrap();
            for round in 0..6u64 {
                let mut ks: Vec<(usize, bool)> = all.iter().copied().filter(|k| mix(k.0 as u64 * 2 + u64::from(k.1) ^ round) % 3 == 0).collect();
                shuffle(&mut ks, round);
                let v = round as i64 * 1_000;
                t.upsert(&batch(&ks, v)).unwrap();
                model.extend(ks.iter().map(|&k| (k, v)));
                let dels: Vec<(usize, bool)> = all.iter().copied().filter(|k| mix(k.0 as u64 ^ round ^ 31) % 7 == 0).collect();
                t.delete(&key_batch(&dels)).unwrap();
                for k in &dels {
                    model.remove(k);
                }
                assert_eq!(read(&t), expect(&model), "{dt} round {round} before flush");
                t.flush().unwrap();
                assert_eq!(read(&t), expect(&model), "{dt} round {round} after flush");
            }
            probe(&t, &model, "before reopen");
        }
        let e = open(dir.path(), config(64 * MIB));
        let t = e.table("p").unwrap();
        assert_eq!(read(&t), expect(&model), "{dt} after reopen");
        probe(&t, &model, "after reopen");
    }
}
