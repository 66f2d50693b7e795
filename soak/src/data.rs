//! Data generated in process: TPC-H orders/lineitem parts (via `tpchgen-arrow`), the schemas
//! of the tables created and dropped each round, and the small tables of the mixed load.
//!
//! ## The TPC-H window
//! The generator at scale `SF` is cut into [`PARTS`] parts of consecutive orders (a lineitem
//! part holds exactly the lines of the same part's orders). The soak numbers parts by a
//! sequence `seq = 0, 1, 2, …`: `seq` maps to generator part `seq % PARTS + 1` with every
//! order key shifted by `(seq / PARTS) * KEY_STRIDE`, so the stream of parts never repeats a
//! key. The engine holds a sliding window of [`PARTS`] consecutive parts (about `SF` worth of
//! data): RF1 inserts the next parts, RF2 deletes the oldest. Every part can be regenerated
//! exactly at any time, which is what the model and the delete keys rely on.
//!
//! ## Versions
//! Updates do not read rows back from the engine: the row a part holds after `v` updates is
//! the generated row with [`lineitem_quantity`] (lineitem) or [`order_status`] (orders)
//! applied for version `v`. Version 0 is the generated row.

use anyhow::{Context, Result};
use arrow::array::{
    Array, ArrayRef, AsArray, BinaryArray, BooleanArray, Date32Array, Decimal128Array, Float32Array, Float64Array, Int8Array, Int16Array, Int32Array,
    Int64Array, LargeStringArray, RecordBatch, StringArray, StringViewArray, TimestampMicrosecondArray, UInt32Array, UInt64Array,
};
use arrow::datatypes::{DataType, Decimal128Type, Field, Int32Type, Int64Type, Schema, SchemaRef, TimeUnit};
use std::sync::{Arc, LazyLock};
use tpchgen::distribution::Distributions;
use tpchgen::generators::{LineItemGenerator, OrderGenerator};
use tpchgen::text::TextPool;
use tpchgen_arrow::{LineItemArrow, OrderArrow};

/// Parts the generator's order range is cut into; the engine holds this many parts.
pub const PARTS: u64 = 100;
/// Order-key shift between two passes over the generator (above any TPC-H order key up to
/// scale 500).
pub const KEY_STRIDE: i64 = 1 << 32;
/// Rows per generated batch.
const BATCH_ROWS: usize = 8192;
/// Size of the generator's comment text pool. dbgen's (and `tpchgen`'s default) is 300 MiB,
/// built once and held for the life of the process: it would be most of the soak's RSS and
/// outside-engine bytes and hide what the engine does. Comments are drawn from a 4 MiB pool
/// instead; every other column keeps its official TPC-H value.
const TEXT_POOL_BYTES: i32 = 4 << 20;

static TEXT_POOL: LazyLock<TextPool> = LazyLock::new(|| TextPool::new(TEXT_POOL_BYTES, Distributions::static_default()));

/// Primary key of `orders`.
pub const ORDERS_KEY: [&str; 1] = ["o_orderkey"];
/// Primary key of `lineitem`.
pub const LINEITEM_KEY: [&str; 2] = ["l_orderkey", "l_linenumber"];

/// Schema of `orders` as generated.
pub fn orders_schema() -> SchemaRef {
    OrderArrow::schema_ref()
}

/// Schema of `lineitem` as generated.
pub fn lineitem_schema() -> SchemaRef {
    LineItemArrow::schema_ref()
}

fn generator_part(seq: u64) -> i32 {
    (seq % PARTS) as i32 + 1
}

fn key_offset(seq: u64) -> i64 {
    (seq / PARTS) as i64 * KEY_STRIDE
}

/// The orders of part `seq` as they stand after `version` status updates.
pub fn orders(scale: f64, seq: u64, version: u32) -> Result<Vec<RecordBatch>> {
    let generator = OrderGenerator::new_with_distributions_and_text_pool(scale, generator_part(seq), PARTS as i32, Distributions::static_default(), &TEXT_POOL);
    let offset = key_offset(seq);
    OrderArrow::new(generator)
        .with_batch_size(BATCH_ROWS)
        .map(|b| {
            let b = b.context("generating orders")?;
            let keys = shift_keys(b.column(0), offset)?;
            let mut cols: Vec<ArrayRef> = b.columns().to_vec();
            cols[0] = keys.clone();
            if version > 0 {
                let keys = keys.as_primitive::<Int64Type>();
                let status: StringViewArray = keys.values().iter().map(|&k| Some(order_status(k, version))).collect();
                cols[2] = Arc::new(status);
            }
            RecordBatch::try_new(b.schema(), cols).context("building orders batch")
        })
        .collect()
}

/// The lineitems of part `seq` as they stand after `version` quantity updates.
pub fn lineitems(scale: f64, seq: u64, version: u32) -> Result<Vec<RecordBatch>> {
    let generator =
        LineItemGenerator::new_with_distributions_and_text_pool(scale, generator_part(seq), PARTS as i32, Distributions::static_default(), &TEXT_POOL);
    let offset = key_offset(seq);
    LineItemArrow::new(generator)
        .with_batch_size(BATCH_ROWS)
        .map(|b| {
            let b = b.context("generating lineitem")?;
            let mut cols: Vec<ArrayRef> = b.columns().to_vec();
            cols[0] = shift_keys(b.column(0), offset)?;
            if version > 0 {
                let line = b.column(3).as_primitive::<Int32Type>();
                let qty = b.column(4).as_primitive::<Decimal128Type>();
                let new: Decimal128Array = qty
                    .values()
                    .iter()
                    .zip(line.values())
                    .map(|(&q, &l)| Some(lineitem_quantity(q, l, version)))
                    .collect::<Decimal128Array>()
                    .with_precision_and_scale(15, 2)
                    .context("quantity type")?;
                cols[4] = Arc::new(new);
            }
            RecordBatch::try_new(b.schema(), cols).context("building lineitem batch")
        })
        .collect()
}

fn shift_keys(col: &ArrayRef, offset: i64) -> Result<ArrayRef> {
    let keys = col.as_primitive_opt::<Int64Type>().context("order key column is not Int64")?;
    Ok(Arc::new(keys.unary::<_, Int64Type>(|k| k + offset)))
}

/// `l_quantity` (hundredths) of a line after `version` updates: a whole quantity in 1..=50
/// that changes with every version.
pub fn lineitem_quantity(original: i128, linenumber: i32, version: u32) -> i128 {
    let whole = original / 100 - 1 + 7 * i128::from(version) + i128::from(linenumber);
    (whole.rem_euclid(50) + 1) * 100
}

/// `o_orderstatus` of an order after `version` updates (`version` ≥ 1).
pub fn order_status(orderkey: i64, version: u32) -> &'static str {
    const STATUS: [&str; 3] = ["F", "O", "P"];
    STATUS[(orderkey.rem_euclid(3) as usize + version as usize) % 3]
}

/// Only the primary-key columns of `batch` (for deletes).
pub fn key_columns(batch: &RecordBatch, key: &[&str]) -> Result<RecordBatch> {
    let idx = key.iter().map(|k| batch.schema().index_of(k)).collect::<Result<Vec<_>, _>>().context("key column")?;
    batch.project(&idx).context("projecting key columns")
}

/// Number of schemas used by the create/drop load.
pub const CHURN_SCHEMAS: usize = 4;

static CHURN: LazyLock<[(SchemaRef, &'static [&'static str]); CHURN_SCHEMAS]> = LazyLock::new(|| {
    [
        (
            Arc::new(Schema::new(vec![
                Field::new("id", DataType::Int64, false),
                Field::new("name", DataType::Utf8, false),
                Field::new("amount", DataType::Decimal128(15, 2), true),
                Field::new("created", DataType::Date32, false),
            ])),
            &["id"],
        ),
        (
            Arc::new(Schema::new(vec![
                Field::new("a", DataType::Int32, false),
                Field::new("b", DataType::Int32, false),
                Field::new("flag", DataType::Boolean, true),
                Field::new("score", DataType::Float64, false),
                Field::new("note", DataType::LargeUtf8, true),
            ])),
            &["a", "b"],
        ),
        (
            Arc::new(Schema::new(vec![
                Field::new("k", DataType::Utf8, false),
                Field::new("payload", DataType::Binary, true),
                Field::new("ts", DataType::Timestamp(TimeUnit::Microsecond, None), false),
                Field::new("n", DataType::UInt64, false),
            ])),
            &["k"],
        ),
        (
            Arc::new(Schema::new(vec![
                Field::new("id", DataType::UInt32, false),
                Field::new("x", DataType::Int16, false),
                Field::new("y", DataType::Int8, true),
                Field::new("z", DataType::Float32, false),
                Field::new("s", DataType::Utf8View, true),
            ])),
            &["id"],
        ),
    ]
});

/// Schema and primary key of create/drop schema `i % CHURN_SCHEMAS`.
pub fn churn_schema(i: usize) -> (SchemaRef, &'static [&'static str]) {
    let (s, k) = &CHURN[i % CHURN_SCHEMAS];
    (Arc::clone(s), k)
}

/// `rows` rows for create/drop schema `i % CHURN_SCHEMAS` (keys `0..rows`).
pub fn churn_rows(i: usize, rows: usize) -> Result<RecordBatch> {
    let (schema, _) = churn_schema(i);
    let n = rows as i64;
    let cols: Vec<ArrayRef> = match i % CHURN_SCHEMAS {
        0 => vec![
            Arc::new(Int64Array::from_iter_values(0..n)),
            Arc::new(StringArray::from_iter_values((0..n).map(|r| format!("row {r} of table {i}")))),
            Arc::new((0..n).map(|r| (r % 2 == 0).then_some(i128::from(r) * 1234)).collect::<Decimal128Array>().with_precision_and_scale(15, 2)?),
            Arc::new(Date32Array::from_iter_values((0..n).map(|r| 9000 + r as i32))),
        ],
        1 => vec![
            Arc::new(Int32Array::from_iter_values((0..n).map(|r| r as i32 / 2))),
            Arc::new(Int32Array::from_iter_values((0..n).map(|r| r as i32 % 2))),
            Arc::new((0..n).map(|r| (r % 3 != 0).then_some(r % 2 == 0)).collect::<BooleanArray>()),
            Arc::new(Float64Array::from_iter_values((0..n).map(|r| r as f64 * 0.5))),
            Arc::new((0..n).map(|r| (r % 2 == 1).then(|| "x".repeat(40 + r as usize))).collect::<LargeStringArray>()),
        ],
        2 => vec![
            Arc::new(StringArray::from_iter_values((0..n).map(|r| format!("key-{r:08}")))),
            Arc::new((0..n).map(|r| (r % 2 == 0).then(|| vec![r as u8; 24])).collect::<BinaryArray>()),
            Arc::new(TimestampMicrosecondArray::from_iter_values((0..n).map(|r| 1_700_000_000_000_000 + r))),
            Arc::new(UInt64Array::from_iter_values((0..n).map(|r| r as u64 * 7))),
        ],
        _ => vec![
            Arc::new(UInt32Array::from_iter_values((0..n).map(|r| r as u32))),
            Arc::new(Int16Array::from_iter_values((0..n).map(|r| r as i16 - 5))),
            Arc::new((0..n).map(|r| (r % 2 == 0).then_some(r as i8)).collect::<Int8Array>()),
            Arc::new(Float32Array::from_iter_values((0..n).map(|r| r as f32 / 3.0))),
            Arc::new((0..n).map(|r| (r % 3 != 2).then_some(if r % 2 == 0 { "short" } else { "a string longer than twelve" })).collect::<StringViewArray>()),
        ],
    };
    RecordBatch::try_new(schema, cols).context("building create/drop rows")
}

/// Schema of the persistent small tables of the mixed load: `id` (key), `v`, `tag`.
pub fn mixed_schema() -> SchemaRef {
    static S: LazyLock<SchemaRef> = LazyLock::new(|| {
        Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false), Field::new("v", DataType::Int64, false), Field::new("tag", DataType::Utf8, true)]))
    });
    Arc::clone(&S)
}

/// Rows `(id, v)` for a mixed table; `tag` is derived from both.
pub fn mixed_rows(rows: &[(i64, i64)]) -> Result<RecordBatch> {
    let cols: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.0))),
        Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.1))),
        Arc::new(rows.iter().map(|&(id, v)| (v % 4 != 0).then(|| format!("tag-{id}-{v}"))).collect::<StringArray>()),
    ];
    RecordBatch::try_new(mixed_schema(), cols).context("building mixed rows")
}

/// Keys `id` for a delete on a mixed table.
pub fn mixed_keys(ids: &[i64]) -> Result<RecordBatch> {
    let schema = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false)]));
    RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from_iter_values(ids.iter().copied()))]).context("building mixed keys")
}

/// The string at `row` of a `Utf8` / `LargeUtf8` / `Utf8View` column (`None` when null or when
/// the column is not a string column).
pub fn str_at(col: &dyn Array, row: usize) -> Option<&str> {
    if col.is_null(row) {
        return None;
    }
    match col.data_type() {
        DataType::Utf8 => Some(col.as_string::<i32>().value(row)),
        DataType::LargeUtf8 => Some(col.as_string::<i64>().value(row)),
        DataType::Utf8View => Some(col.as_string_view().value(row)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_align_and_keys_shift() {
        let o = orders(0.01, PARTS + 3, 0).expect("orders");
        let l = lineitems(0.01, PARTS + 3, 2).expect("lineitem");
        let okeys: Vec<i64> = o.iter().flat_map(|b| b.column(0).as_primitive::<Int64Type>().values().to_vec()).collect();
        let lkeys: std::collections::BTreeSet<i64> = l.iter().flat_map(|b| b.column(0).as_primitive::<Int64Type>().values().to_vec()).collect();
        assert!(okeys.iter().all(|&k| k > KEY_STRIDE));
        assert_eq!(okeys.iter().copied().collect::<std::collections::BTreeSet<_>>(), lkeys);
        let q = l[0].column(4).as_primitive::<Decimal128Type>();
        assert!(q.values().iter().all(|&v| (100..=5000).contains(&v) && v % 100 == 0));
    }

    #[test]
    fn versions_change_values() {
        assert_ne!(lineitem_quantity(1700, 1, 1), lineitem_quantity(1700, 1, 2));
        assert_ne!(order_status(7, 1), order_status(7, 2));
        for s in 0..CHURN_SCHEMAS {
            let b = churn_rows(s, 4).expect("rows");
            assert_eq!(b.num_rows(), 4);
        }
    }
}
