//! Adversarial checks of the flush path: the delta's select in arena order (counting sort by
//! row block, per-block bitmap placement, the map-order fallback), the tiled rows -> Arrow
//! decode (128 rows a tile, column by column) and the key index's blocked bloom filter built
//! from several key parts. Every column type the codec supports, nullable and not, null runs
//! crossing 8-row bytes and 128-row tiles, sliced inputs; fixed, wide, composite, float (NaN,
//! ±0) and variable-width keys with long shared prefixes and prefix chains; many files,
//! compaction, reopen, small limits, injected failures, concurrent scans. Every answer is
//! compared value for value with a `BTreeMap` model (key -> version; every cell is a function
//! of key, version and column).

use arrow::array::{
    Array, ArrayRef, ArrowPrimitiveType, AsArray, BinaryArray, BinaryViewArray, BooleanArray, LargeBinaryArray, LargeStringArray, PrimitiveArray, RecordBatch,
    StringArray, StringViewArray,
};
use arrow::datatypes::{
    DataType, Date32Type, Date64Type, Decimal128Type, DurationMicrosecondType, DurationMillisecondType, DurationNanosecondType, DurationSecondType, Field,
    Float16Type, Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type, Schema, SchemaRef, Time32MillisecondType, Time32SecondType,
    Time64MicrosecondType, Time64NanosecondType, TimeUnit, TimestampMicrosecondType, TimestampMillisecondType, TimestampNanosecondType, TimestampSecondType,
    UInt8Type, UInt16Type, UInt32Type, UInt64Type,
};
use arrow::util::display::array_value_to_string;
use gritdb::memory::Category;
use gritdb::{CompareOp, Engine, EngineConfig, Error, ScanFilter, ScanOptions, Table, WalSync};
use gritdb_tests::mix;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const MIB: usize = 1 << 20;

fn shuffle<T>(v: &mut [T], seed: u64) {
    for i in (1..v.len()).rev() {
        v.swap(i, (mix(seed ^ i as u64) % (i as u64 + 1)) as usize);
    }
}

// ---------------------------------------------------------------- shapes

/// Which rows of a nullable column are null: never, always, one in `n` by hash, or runs of
/// `n` keys alternately null and not (phase shifted by the column).
#[derive(Clone, Copy, Debug)]
enum Nulls {
    Never,
    All,
    Hash(u64),
    Runs(i64),
}

#[derive(Clone, Debug)]
struct Col {
    dt: DataType,
    nulls: Option<Nulls>,
}

/// The primary key, an injective function of the model's `i64` key `k` (0 <= k < 2^20).
#[derive(Clone, Copy, Debug)]
enum KeyKind {
    I64,     // `Int64`.
    Small,   // `(Int16, UInt8)`: a 3-byte stored key.
    Wide,    // `(Int64, Int64, Int64)`: 24 bytes, past the 16-byte integer compare.
    DecI32,  // `(Decimal128(38, 0), Int32)`: 20 bytes, both signs.
    Str,     // `(Utf8, Int32)`: a 40-byte shared prefix, then `k` unpadded.
    BinBool, // `(Binary, Boolean)`: 17..21 zero bytes then `k`; Boolean makes the layout variable.
    View,    // `Utf8View`: `k` zero-padded to 12 bytes (even `k`) or 13 (odd).
    F64Ts,   // `(Float64, Timestamp(us, +05:30))`: the float NaN of either sign and payload, ±0, ±inf.
    Dec5,    // Five `Decimal128(38, 5)`: an 80-byte stored key (past the 64-byte stack buffer).
    U64I8,   // `(UInt64, Int8)`: unsigned values past `i64::MAX`.
    /// `LargeBinary` prefix chains: empty, or 1.. bytes of 0x00, 0x01, 0xff or 'a', maybe
    /// followed by 0x02, 0x7f or 0x80 (keys that are prefixes of each other).
    Chain,
}

#[rustfmt::skip]
const KINDS: [KeyKind; 11] = [KeyKind::I64, KeyKind::Small, KeyKind::Wide, KeyKind::DecI32, KeyKind::Str, KeyKind::BinBool, KeyKind::View, KeyKind::F64Ts, KeyKind::Dec5, KeyKind::U64I8, KeyKind::Chain];

fn prim<T: ArrowPrimitiveType>(dt: &DataType, vals: impl Iterator<Item = Option<T::Native>>) -> ArrayRef {
    Arc::new(PrimitiveArray::<T>::from_iter(vals).with_data_type(dt.clone()))
}

impl KeyKind {
    fn types(self) -> Vec<DataType> {
        use DataType as D;
        match self {
            KeyKind::I64 => vec![D::Int64],
            KeyKind::Small => vec![D::Int16, D::UInt8],
            KeyKind::Wide => vec![D::Int64; 3],
            KeyKind::DecI32 => vec![D::Decimal128(38, 0), D::Int32],
            KeyKind::Str => vec![D::Utf8, D::Int32],
            KeyKind::BinBool => vec![D::Binary, D::Boolean],
            KeyKind::View => vec![D::Utf8View],
            KeyKind::F64Ts => vec![D::Float64, D::Timestamp(TimeUnit::Microsecond, Some("+05:30".into()))],
            KeyKind::Dec5 => vec![D::Decimal128(38, 5); 5],
            KeyKind::U64I8 => vec![D::UInt64, D::Int8],
            KeyKind::Chain => vec![D::LargeBinary],
        }
    }

    fn fields(self) -> Vec<Field> {
        self.types().into_iter().enumerate().map(|(i, dt)| Field::new(format!("p{i}"), dt, false)).collect()
    }

    fn arrays(self, ks: &[i64]) -> Vec<ArrayRef> {
        let tys = self.types();
        macro_rules! p {
            ($i:expr, $t:ty, $f:expr) => {
                prim::<$t>(&tys[$i], ks.iter().map(|&k| Some($f(k))))
            };
        }
        match self {
            KeyKind::I64 => vec![p!(0, Int64Type, |k| k)],
            KeyKind::Small => vec![p!(0, Int16Type, |k| (k >> 8) as i16 - 100), p!(1, UInt8Type, |k| (k & 255) as u8)],
            KeyKind::Wide => vec![p!(0, Int64Type, |k| k % 7 - 3), p!(1, Int64Type, |k: i64| -k), p!(2, Int64Type, |k| k * 3)],
            KeyKind::DecI32 => vec![p!(0, Decimal128Type, |k| i128::from(k % 5 - 2) * 10i128.pow(30) + i128::from(k)), p!(1, Int32Type, |k| -(k as i32))],
            KeyKind::Str => vec![
                Arc::new(StringArray::from_iter_values(ks.iter().map(|&k| format!("customer/region-7/shared-prefix-000000/{k}")))),
                p!(1, Int32Type, |k| (k % 3) as i32),
            ],
            KeyKind::BinBool => vec![
                Arc::new(BinaryArray::from_iter_values(ks.iter().map(|&k| [vec![0u8; 17 + (k % 5) as usize], (k as u32).to_be_bytes().to_vec()].concat()))),
                Arc::new(BooleanArray::from_iter(ks.iter().map(|&k| Some(k % 2 == 0)))),
            ],
            KeyKind::View => {
                vec![Arc::new(StringViewArray::from_iter_values(ks.iter().map(|&k| if k % 2 == 0 { format!("{k:012}") } else { format!("{k:013}") })))]
            }
            KeyKind::F64Ts => {
                let special = [0x7ff8_0000_0000_0000u64, 0xfff8_0000_0000_0000, 0x7ff0_0000_0000_0001, 0, 1 << 63, 0x7ff0 << 48, 0xfff0 << 48];
                let f = |k: i64| special.get(k as usize % 8).map_or((k as f64 - 500.0) * 0.25, |&b| f64::from_bits(b));
                vec![p!(0, Float64Type, f), p!(1, TimestampMicrosecondType, |k| k * 1_000 - 77)]
            }
            KeyKind::Dec5 => (0..5)
                .map(|i| {
                    p!(i, Decimal128Type, |k: i64| if i == 4 { i128::from(k) - 300 } else { (10i128.pow(37) - 1) * (1 - 2 * i128::from(k % 2)) - i as i128 })
                })
                .collect(),
            KeyKind::U64I8 => vec![p!(0, UInt64Type, |k: i64| u64::MAX - (k as u64 >> 7) * 0x0100_0000_0000_0001), p!(1, Int8Type, |k| (k & 127) as i8 - 64)],
            KeyKind::Chain => vec![Arc::new(LargeBinaryArray::from_iter_values(ks.iter().map(|&k| {
                if k == 0 {
                    return Vec::new();
                }
                let mut b = vec![[0x00u8, 0x01, 0xff, b'a'][k as usize % 4]; k as usize / 16 + 1];
                b.extend([None, Some(0x02u8), Some(0x7f), Some(0x80)][k as usize / 4 % 4]);
                b
            })))],
        }
    }
}

/// A table: key columns `p*`, `kk` Int64 (the model key, to match rows back), `v` Int64 (the
/// version), then the value columns `c*`.
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

/// Text of 0, 1, 5, 11, 12, 13, ... 2,000 bytes (one more when a 2-byte fill overshoots).
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
    text(k, ver, h).into_bytes().into_iter().enumerate().map(|(i, x)| x ^ ((h >> (i % 50)) as u8 & 0x81)).collect()
}

impl Shape {
    fn schema(&self) -> SchemaRef {
        let mut f = self.key.fields();
        f.push(Field::new("kk", DataType::Int64, false));
        f.push(Field::new("v", DataType::Int64, false));
        f.extend(self.cols.iter().enumerate().map(|(c, col)| Field::new(format!("c{c}"), col.dt.clone(), col.nulls.is_some())));
        Arc::new(Schema::new(f))
    }

    fn column(&self, c: usize, rows: &[(i64, u64)]) -> ArrayRef {
        let (dt, nulls) = (&self.cols[c].dt, self.cols[c].nulls.unwrap_or(Nulls::Never));
        let cells = || {
            rows.iter().map(move |&(k, ver)| {
                let h = cell_hash(k, ver, c);
                (!is_null(nulls, k, h, c)).then_some((k, ver, h))
            })
        };
        // Random bits, with zero and all ones now and then.
        let bits = |h: u64| [0, u64::MAX].get(h as usize % 16).copied().unwrap_or_else(|| mix(h));
        macro_rules! p {
            ($t:ty, $f:expr) => {
                prim::<$t>(dt, cells().map(|x| x.map(|(_, _, h)| $f(bits(h)))))
            };
        }
        use TimeUnit::{Microsecond as Us, Millisecond as Ms, Nanosecond as Ns, Second as S};
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
            DataType::Time32(S) => p!(Time32SecondType, |b: u64| b as i32),
            DataType::Time32(_) => p!(Time32MillisecondType, |b: u64| (b % 86_400_000) as i32),
            DataType::Time64(Us) => p!(Time64MicrosecondType, |b: u64| (b % 86_400_000_000) as i64),
            DataType::Time64(_) => p!(Time64NanosecondType, |b: u64| b as i64),
            DataType::Timestamp(S, _) => p!(TimestampSecondType, |b: u64| b as i64),
            DataType::Timestamp(Ms, _) => p!(TimestampMillisecondType, |b: u64| b as i64),
            DataType::Timestamp(Us, _) => p!(TimestampMicrosecondType, |b: u64| b as i64),
            DataType::Timestamp(Ns, _) => p!(TimestampNanosecondType, |b: u64| b as i64),
            DataType::Duration(S) => p!(DurationSecondType, |b: u64| b as i64),
            DataType::Duration(Ms) => p!(DurationMillisecondType, |b: u64| b as i64),
            DataType::Duration(Us) => p!(DurationMicrosecondType, |b: u64| b as i64),
            DataType::Duration(Ns) => p!(DurationNanosecondType, |b: u64| b as i64),
            DataType::Decimal128(prec, _) => {
                let m = 10i128.pow(u32::from(*prec));
                // The precision's bounds now and then.
                p!(Decimal128Type, |b: u64| [m - 1, 1 - m].get(b as usize % 7).copied().unwrap_or((i128::from(b) << 64 | i128::from(mix(b))) % m))
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
        cols.extend((0..self.cols.len()).map(|c| self.column(c, rows)));
        RecordBatch::try_new(self.schema(), cols).unwrap()
    }
}

/// Every type the codec supports, each nullable (null patterns cycling) and not, plus
/// all-null columns of each layout.
fn every_type() -> Vec<Col> {
    use DataType as D;
    use TimeUnit::{Microsecond as Us, Millisecond as Ms, Nanosecond as Ns, Second as S};
    let tz = |s: &str| Some(Arc::<str>::from(s));
    #[rustfmt::skip]
    let types = [
        D::Boolean, D::Int8, D::Int16, D::Int32, D::Int64, D::UInt8, D::UInt16, D::UInt32, D::UInt64, D::Float16, D::Float32,
        D::Float64, D::Date32, D::Date64, D::Time32(S), D::Time32(Ms), D::Time64(Us), D::Time64(Ns), D::Timestamp(S, None),
        D::Timestamp(Ms, tz("UTC")), D::Timestamp(Us, tz("+02:00")), D::Timestamp(Ns, None), D::Duration(S), D::Duration(Ms),
        D::Duration(Us), D::Duration(Ns), D::Decimal128(1, 0), D::Decimal128(5, 2), D::Decimal128(18, 4), D::Decimal128(19, 0),
        D::Decimal128(38, 0), D::Decimal128(38, 10), D::Utf8, D::LargeUtf8, D::Utf8View, D::Binary, D::LargeBinary, D::BinaryView,
    ];
    use Nulls::{Hash, Never, Runs};
    let patterns = [Hash(5), Runs(1), Runs(7), Runs(8), Runs(127), Runs(128), Runs(129), Never, Hash(2)];
    let mut cols: Vec<Col> = types
        .iter()
        .enumerate()
        .flat_map(|(i, dt)| [Col { dt: dt.clone(), nulls: Some(patterns[i % patterns.len()]) }, Col { dt: dt.clone(), nulls: None }])
        .collect();
    cols.extend([D::Boolean, D::Int32, D::Utf8View, D::Binary, D::Decimal128(38, 0)].map(|dt| Col { dt, nulls: Some(Nulls::All) }));
    cols
}

/// One column of each layout (offsets, bool, views, fixed) for key-heavy tests.
fn few_types() -> Vec<Col> {
    let c = |dt, nulls| Col { dt, nulls };
    vec![
        c(DataType::Utf8, Some(Nulls::Hash(7))),
        c(DataType::Boolean, Some(Nulls::Runs(3))),
        c(DataType::BinaryView, Some(Nulls::Runs(129))),
        c(DataType::Decimal128(38, 10), None),
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

impl Model {
    fn new(key: KeyKind, cols: Vec<Col>) -> Self {
        Self { shape: Shape { key, cols }, rows: BTreeMap::new(), ver: 0, sliced: false }
    }

    /// The batch written for `rows`: built directly, or cut out of a larger batch whose other
    /// rows (keys below -1) are not written.
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
        let names: Vec<String> = self.shape.key.fields().iter().map(|f| f.name().clone()).collect();
        e.create_table(name, self.shape.schema(), &names.iter().map(String::as_str).collect::<Vec<_>>()).unwrap()
    }

    /// Writes `ks` at a new version: 0 insert (keys must be new), 1 upsert, 2 update (keys
    /// must exist).
    fn put(&mut self, t: &Table, ks: &[i64], op: u8) {
        self.ver += 1;
        let rows: Vec<(i64, u64)> = ks.iter().map(|&k| (k, self.ver)).collect();
        let b = self.input(&rows);
        let n = [Table::insert, Table::upsert, Table::update][op as usize](t, &b);
        assert_eq!(n.unwrap_or_else(|e| panic!("op {op}: {e}")), rows.len());
        self.rows.extend(rows);
    }

    fn insert(&mut self, t: &Table, ks: &[i64]) {
        self.put(t, ks, 0);
    }

    fn upsert(&mut self, t: &Table, ks: &[i64]) {
        self.put(t, ks, 1);
    }

    fn delete(&mut self, t: &Table, ks: &[i64]) {
        let present = ks.iter().filter(|k| self.rows.contains_key(k)).count();
        let keys = RecordBatch::try_new(Arc::new(Schema::new(self.shape.key.fields())), self.shape.key.arrays(ks)).unwrap();
        assert_eq!(t.delete(&keys).unwrap(), present);
        for k in ks {
            self.rows.remove(k);
        }
    }

    fn check(&self, t: &Table, what: &str) {
        self.check_with(t, ScanOptions::default(), None, &|_, _| true, what);
    }

    /// The scan with `options`, projected to schema columns `proj` (holding `kk`) when given,
    /// returns exactly the model's rows for which `keep(k, version)`. Batches are checked as
    /// they come and dropped (little scan memory under a small limit).
    fn check_with(&self, t: &Table, options: ScanOptions, proj: Option<&[usize]>, keep: &dyn Fn(i64, u64) -> bool, what: &str) {
        let full = self.shape.schema();
        let cols: Vec<usize> = proj.map_or_else(|| (0..full.fields().len()).collect(), <[usize]>::to_vec);
        let schema = Arc::new(full.project(&cols).unwrap());
        let kk = cols.iter().position(|&c| c == self.shape.key.fields().len()).expect("kk projected");
        let mut seen = BTreeSet::new();
        for b in t.scan(options).unwrap_or_else(|e| panic!("{what}: scan: {e}")) {
            let got = b.unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(got.schema().fields(), schema.fields(), "{what}: scan schema");
            let keys: Vec<i64> = got.column(kk).as_primitive::<Int64Type>().values().to_vec();
            let rows: Vec<(i64, u64)> = keys
                .iter()
                .map(|&k| {
                    assert!(seen.insert(k), "{what}: key {k} returned twice");
                    let v = *self.rows.get(&k).unwrap_or_else(|| panic!("{what}: key {k} is not in the model"));
                    assert!(keep(k, v), "{what}: key {k} should have been filtered out");
                    (k, v)
                })
                .collect();
            let want = self.shape.batch(&rows).project(&cols).unwrap();
            for j in 0..schema.fields().len() {
                let (g, w) = (got.column(j), want.column(j));
                if g.to_data() != w.to_data() {
                    let i = (0..g.len()).find(|&i| g.slice(i, 1).to_data() != w.slice(i, 1).to_data()).unwrap_or(0);
                    let (gv, wv) = (array_value_to_string(g, i).unwrap(), array_value_to_string(w, i).unwrap());
                    panic!("{what}: column {} ({}) differs at key {}: got {gv:?}, want {wv:?}", schema.field(j).name(), schema.field(j).data_type(), keys[i]);
                }
            }
        }
        let want = self.rows.iter().filter(|(k, v)| keep(**k, **v)).count();
        let missing: Vec<_> = self.rows.iter().filter(|(k, v)| keep(**k, **v) && !seen.contains(k)).take(5).collect();
        assert_eq!(seen.len(), want, "{what}: rows returned vs model; missing {missing:?}");
    }

    /// Scans with a projection (kk among every third value column, reversed), a range filter
    /// on kk and an IS NULL filter on a value column.
    fn check_projected(&self, t: &Table, salt: u64, n: i64, what: &str) {
        let base = self.shape.key.fields().len();
        let names: Vec<String> = self.shape.schema().fields().iter().map(|f| f.name().clone()).collect();
        let mut proj: Vec<usize> = (base + 2..names.len()).filter(|c| (*c as u64 + salt).is_multiple_of(3)).rev().collect();
        proj.insert(proj.len() / 2, base);
        let opts = || ScanOptions::default().projection(proj.iter().map(|&c| names[c].clone())).batch_rows(100 + salt as usize * 37);
        self.check_with(t, opts(), Some(&proj), &|_, _| true, &format!("{what}, projected"));
        let cut = n / 3 + salt as i64;
        let f = ScanFilter::compare("kk", CompareOp::Lt, Arc::new(PrimitiveArray::<Int64Type>::from(vec![cut])));
        self.check_with(t, opts().filter(f), Some(&proj), &|k, _| k < cut, &format!("{what}, kk < {cut}"));
        let c = (salt as usize * 5) % self.shape.cols.len();
        if let Some(nulls) = self.shape.cols[c].nulls {
            let keep = |k: i64, v: u64| is_null(nulls, k, cell_hash(k, v, c), c);
            self.check_with(t, opts().filter(ScanFilter::is_null(format!("c{c}"))), Some(&proj), &keep, &format!("{what}, c{c} IS NULL"));
        }
    }

    /// One row at a time: insert of a live key is refused with `KeyExists`, update of an
    /// absent key with `KeyNotFound`; every third key then gets the write that succeeds.
    fn probe(&mut self, t: &Table, ks: impl IntoIterator<Item = i64>, what: &str) {
        for k in ks {
            let row = self.input(&[(k, self.ver + 1)]);
            if self.rows.contains_key(&k) {
                assert!(matches!(t.insert(&row), Err(Error::KeyExists { row: 0, .. })), "{what}: insert of live key {k}");
                if k % 3 == 0 {
                    self.put(t, &[k], 2);
                }
            } else {
                assert!(matches!(t.update(&row), Err(Error::KeyNotFound { row: 0, .. })), "{what}: update of absent key {k}");
                if k % 3 == 0 {
                    self.insert(t, &[k]);
                }
            }
        }
    }
}

fn config(limit: usize) -> EngineConfig {
    EngineConfig::default().memory_limit(limit).flush_age(Duration::from_hours(1)).backpressure_timeout(Duration::from_secs(5)).wal_sync(WalSync::Relaxed)
}

fn open(dir: &Path, cfg: EngineConfig) -> Engine {
    Engine::open(dir, cfg).unwrap_or_else(|e| panic!("open: {e}"))
}

/// `keys` in batches whose sizes cycle through `sizes`.
fn in_batches(keys: &[i64], sizes: &[usize], mut f: impl FnMut(&[i64])) {
    let (mut at, mut i) = (0, 0);
    while at < keys.len() {
        let n = sizes[i % sizes.len()].min(keys.len() - at);
        f(&keys[at..at + n]);
        (at, i) = (at + n, i + 1);
    }
}

// ---------------------------------------------------------------- every type

/// Every column type under `key`: inserts in shuffled order in batches of 1, 7, 127, 128, 129
/// and 1000 rows; upserts of shuffled subsets and again descending (later blocks replace
/// earlier rows), updates, deletes, re-inserts; flushes in 64 KiB batches (several key parts
/// per file). Checked from the delta, after flushes (projected and filtered too), after a
/// drop without close (replay), after close and reopen; keys probed before and after.
fn every_type_round_trip(key: KeyKind, n: i64, seed: u64, chunk: usize) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = Model::new(key, every_type());
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
            let mut sub: Vec<i64> = keys.iter().copied().filter(|k| mix(*k as u64 ^ round).is_multiple_of(3)).collect();
            shuffle(&mut sub, seed ^ round);
            in_batches(&sub, &sizes[round as usize..], |b| m.upsert(&t, b));
            sub.sort_unstable_by(|a, b| b.cmp(a));
            in_batches(&sub[..sub.len() / 2], &[129], |b| m.upsert(&t, b));
            let upd: Vec<i64> = m.rows.keys().copied().filter(|k| k % 11 == round as i64).collect();
            in_batches(&upd, &[128], |b| m.put(&t, b, 2));
            let del: Vec<i64> = keys.iter().copied().filter(|k| mix(*k as u64 ^ 77 ^ round).is_multiple_of(5)).collect();
            in_batches(&del, &[7, 1000], |b| m.delete(&t, b));
            in_batches(&del.iter().copied().filter(|k| k % 2 == 0).collect::<Vec<_>>(), &[127], |b| m.insert(&t, b));
            if round != 1 {
                t.flush().unwrap();
            }
            m.check(&t, &format!("round {round}"));
            m.check_projected(&t, round, n, &format!("round {round}"));
        }
        m.probe(&t, (0..n + 20).step_by(7), "probe before reopen");
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
fn every_type_round_trips_int64_key_sliced_inputs() {
    every_type_round_trip(KeyKind::I64, 2_100, 1, 64 << 10);
}

/// 4 KiB chunks: a few rows a block (runs under 16 rows compared, longer ones placed by
/// bitmap), rows above 4 KiB in blocks of their own.
#[test]
fn every_type_round_trips_4_kib_chunks() {
    every_type_round_trip(KeyKind::Wide, 1_500, 3, 4 << 10);
}

/// 4 MiB chunks: offsets past 1 MiB (compared within a block).
#[test]
fn every_type_round_trips_4_mib_chunks() {
    every_type_round_trip(KeyKind::BinBool, 1_500, 4, 4 << 20);
}

// ---------------------------------------------------------------- many files, key lookups

/// For every key layout: 12 flushes, each a file whose keys interleave with every other
/// file's (round `r` inserts `k ≡ r mod 12`, descending), upserting older keys (the old row
/// into a deletion vector), deleting some and re-inserting; 1 KiB flush batches (many key
/// parts per file); compaction along the way. Every key is probed, and again after reopen.
#[test]
fn many_files_every_key_layout() {
    let (rounds, per) = (12i64, 40i64);
    for key in KINDS {
        let dir = tempfile::tempdir().unwrap();
        let mut m = Model::new(key, few_types());
        let cfg = || config(64 * MIB).flush_batch_bytes(1 << 10);
        let span = rounds * per;
        {
            let e = open(dir.path(), cfg());
            let t = m.create(&e, "many");
            for r in 0..rounds {
                m.insert(&t, &(0..per).rev().map(|i| i * rounds + r).collect::<Vec<_>>());
                let old: Vec<i64> = m.rows.keys().copied().filter(|k| mix(*k as u64 ^ r as u64).is_multiple_of(4)).collect();
                m.upsert(&t, &old);
                let del: Vec<i64> = (0..span).filter(|k| mix(*k as u64 ^ 0xdead ^ r as u64).is_multiple_of(9)).collect();
                m.delete(&t, &del);
                m.insert(&t, &del.iter().copied().filter(|k| k % 3 == 1 && *k % rounds < r).collect::<Vec<_>>());
                t.flush().unwrap();
            }
            m.check(&t, &format!("{key:?}: after {rounds} flushes"));
            m.probe(&t, 0..span + 3, &format!("{key:?}: probe"));
            t.flush().unwrap();
            m.check(&t, &format!("{key:?}: after the probes' flush"));
        }
        let e = open(dir.path(), cfg());
        let t = e.table("many").unwrap();
        m.check(&t, &format!("{key:?}: after reopen"));
        m.probe(&t, (0..span + 3).rev(), &format!("{key:?}: probe after reopen"));
        t.flush().unwrap();
        m.check(&t, &format!("{key:?}: after reopen and flush"));
    }
}

// ---------------------------------------------------------------- large flushes

/// 80,000 rows (the select sorts two parts on two threads and merges them) written descending
/// in a batch of 65,537 (the flush cuts batches at 65,536) and single rows, then upserted in
/// shuffled order (newest rows in later blocks than their neighbours), deleted in part.
fn large_flush(key: KeyKind, batch_bytes: usize) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = Model::new(key, few_types());
    let cfg = || config(512 * MIB).table_flush_bytes(256 * MIB).flush_batch_bytes(batch_bytes).flush_threads(2);
    let e = open(dir.path(), cfg());
    let t = m.create(&e, "large");
    let n = 80_000i64;
    in_batches(&(0..n).rev().collect::<Vec<_>>(), &[65_537, 1], |b| m.insert(&t, b));
    let mut sub: Vec<i64> = (0..n).filter(|k| mix(*k as u64).is_multiple_of(3)).collect();
    shuffle(&mut sub, 9);
    in_batches(&sub, &[4_096], |b| m.upsert(&t, b));
    m.delete(&t, &(0..n).filter(|k| mix(*k as u64 ^ 5).is_multiple_of(7)).collect::<Vec<_>>());
    t.flush().unwrap();
    m.check(&t, &format!("{key:?}: after a large flush"));
    let mut sub: Vec<i64> = (0..n + 40_000).filter(|k| mix(*k as u64 ^ 11).is_multiple_of(2)).collect();
    shuffle(&mut sub, 10);
    in_batches(&sub, &[65_537, 999], |b| m.upsert(&t, b));
    t.flush().unwrap();
    m.check(&t, &format!("{key:?}: after a second large flush"));
    m.probe(&t, (0..n + 40_010).step_by(997), &format!("{key:?}: probe"));
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

// ---------------------------------------------------------------- failures and small limits

/// An allocation failure injected at the n-th reservation of a flush of ~23,000 keys (two
/// sort parts; at one step the select's row-start budget is refused and it reads in map
/// order), n = 0, 1, 2, ...: the flush succeeds or fails with a typed memory error; either
/// way the table stays exact, key checks hold, a retry succeeds, and nothing stays held.
#[test]
fn injected_failure_walks_a_large_flush() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = Model::new(KeyKind::Str, few_types());
    let e = open(dir.path(), config(256 * MIB).table_flush_bytes(128 * MIB).flush_batch_bytes(256 << 10).flush_threads(2));
    let t = m.create(&e, "inj");
    let n = 34_000i64;
    let refill = |m: &mut Model, round: u64| {
        let mut ks: Vec<i64> = (0..n).filter(|k| !mix(*k as u64 ^ round).is_multiple_of(4)).collect();
        shuffle(&mut ks, round);
        in_batches(&ks, &[9_000], |b| m.upsert(&t, b));
        m.delete(&t, &(0..n).filter(|k| mix(*k as u64 ^ round ^ 99).is_multiple_of(10)).collect::<Vec<_>>());
    };
    let (mut round, mut ok, mut failed) = (0u64, 0, 0);
    refill(&mut m, round);
    for step in 0..30u64 {
        e.memory().inject_failure_after(Some(step));
        let r = t.flush();
        e.memory().inject_failure_after(None);
        match &r {
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
    e.close().unwrap();
    m.check(&open(dir.path(), config(256 * MIB)).table("inj").unwrap(), "after reopen");
}

/// Every type under a 6 MiB limit (1 MiB deltas flushed by the background writer on two
/// threads while writes go on), reopened at 4 and 5 MiB (replay flushes inline): exact each
/// time, writable, flushable.
#[test]
fn every_type_under_small_limits() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = Model::new(KeyKind::Str, every_type());
    let cfg = |limit: usize| config(limit).background_flush_threads(2).flush_threads(2).flush_batch_bytes(128 << 10);
    let n = 1_800i64;
    {
        let e = open(dir.path(), cfg(6 * MIB));
        let t = m.create(&e, "small");
        let mut keys: Vec<i64> = (0..n).collect();
        shuffle(&mut keys, 21);
        in_batches(&keys, &[127, 1, 128, 7, 129], |b| m.insert(&t, b));
        for round in 0..3u64 {
            let mut sub: Vec<i64> = (0..n).filter(|k| mix(*k as u64 ^ round).is_multiple_of(2)).collect();
            shuffle(&mut sub, round);
            in_batches(&sub, &[129, 128], |b| m.upsert(&t, b));
            in_batches(&(0..n).filter(|k| mix(*k as u64 ^ round ^ 5).is_multiple_of(6)).collect::<Vec<_>>(), &[500], |b| m.delete(&t, b));
        }
        m.check(&t, "at 6 MiB");
        assert!(e.memory().used() <= e.memory().limit());
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
    m.check(&open(dir.path(), cfg(4 * MIB)).table("small").unwrap(), "last reopen at 4 MiB");
}
