//! TPC-H Q1 and Q6 through SQL (`Engine::sql`, the `sql` feature), and their check against
//! the model ([`crate::model::LineitemAgg`]): counts and sums must agree to the last digit,
//! averages to the rounding of their last digit.

use crate::data::str_at;
use crate::model::LineitemAgg;
use anyhow::{Context, Result, bail, ensure};
use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{DataType, Decimal128Type, Int64Type};
use gritdb::Engine;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

/// TPC-H Q1, as the specification writes it (delta = 90 days).
pub const Q1: &str = "SELECT l_returnflag, l_linestatus,
    sum(l_quantity) AS sum_qty,
    sum(l_extendedprice) AS sum_base_price,
    sum(l_extendedprice * (1 - l_discount)) AS sum_disc_price,
    sum(l_extendedprice * (1 - l_discount) * (1 + l_tax)) AS sum_charge,
    avg(l_quantity) AS avg_qty,
    avg(l_extendedprice) AS avg_price,
    avg(l_discount) AS avg_disc,
    count(*) AS count_order
FROM lineitem
WHERE l_shipdate <= date '1998-12-01' - interval '90' day
GROUP BY l_returnflag, l_linestatus
ORDER BY l_returnflag, l_linestatus";

/// TPC-H Q6, as the specification writes it (1994, discount 0.06, quantity 24).
pub const Q6: &str = "SELECT sum(l_extendedprice * l_discount) AS revenue
FROM lineitem
WHERE l_shipdate >= date '1994-01-01'
  AND l_shipdate < date '1994-01-01' + interval '1' year
  AND l_discount BETWEEN 0.06 - 0.01 AND 0.06 + 0.01
  AND l_quantity < 24";

/// One row of Q1's answer. Decimals are unscaled at the scales the model uses: `sum_qty`,
/// `sum_base_price` in 10⁻², `sum_disc_price` in 10⁻⁴, `sum_charge` in 10⁻⁶; averages
/// are unscaled at `avg_scale`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Q1Row {
    /// `l_returnflag`.
    pub returnflag: String,
    /// `l_linestatus`.
    pub linestatus: String,
    /// `sum(l_quantity)`.
    pub sum_qty: i128,
    /// `sum(l_extendedprice)`.
    pub sum_base_price: i128,
    /// `sum(l_extendedprice * (1 - l_discount))`.
    pub sum_disc_price: i128,
    /// `sum(l_extendedprice * (1 - l_discount) * (1 + l_tax))`.
    pub sum_charge: i128,
    /// `avg(l_quantity)`, unscaled at `avg_scale`.
    pub avg_qty: i128,
    /// `avg(l_extendedprice)`, unscaled at `avg_scale`.
    pub avg_price: i128,
    /// `avg(l_discount)`, unscaled at `avg_scale`.
    pub avg_disc: i128,
    /// Scale of the three averages.
    pub avg_scale: i8,
    /// `count(*)`.
    pub count: u64,
}

/// The decimal at `row` of column `name`, unscaled at `scale` (exact: a column of a larger
/// scale is an error unless the digits dropped are zero).
fn decimal_at(b: &RecordBatch, name: &str, row: usize, scale: i8) -> Result<i128> {
    let (v, s) = decimal_raw(b, name, row)?;
    rescale(v, s, scale).with_context(|| format!("column {name}: {v} at scale {s} is not exact at scale {scale}"))
}

fn decimal_raw(b: &RecordBatch, name: &str, row: usize) -> Result<(i128, i8)> {
    let col = b.column_by_name(name).with_context(|| format!("no column {name}"))?;
    let DataType::Decimal128(_, s) = col.data_type() else { bail!("column {name} is {}, not Decimal128", col.data_type()) };
    ensure!(col.is_valid(row), "column {name} is null at row {row}");
    Ok((col.as_primitive::<Decimal128Type>().value(row), *s))
}

fn rescale(v: i128, from: i8, to: i8) -> Option<i128> {
    let d = (i32::from(to) - i32::from(from)).unsigned_abs();
    let p = 10i128.checked_pow(d)?;
    if to >= from { v.checked_mul(p) } else { (v % p == 0).then_some(v / p) }
}

/// Reads Q1's answer ([`Q1`]'s columns).
///
/// # Errors
/// A column missing or of an unexpected type, a null, a sum not exact at the model's scale.
pub fn q1_rows(batches: &[RecordBatch]) -> Result<Vec<Q1Row>> {
    let mut out = Vec::new();
    for b in batches {
        let count = b.column_by_name("count_order").context("no column count_order")?;
        let count = count.as_primitive_opt::<Int64Type>().context("count_order is not Int64")?;
        let flag = b.column_by_name("l_returnflag").context("no column l_returnflag")?;
        let status = b.column_by_name("l_linestatus").context("no column l_linestatus")?;
        for r in 0..b.num_rows() {
            let (avg_qty, avg_scale) = decimal_raw(b, "avg_qty", r)?;
            out.push(Q1Row {
                returnflag: str_at(flag.as_ref(), r).context("l_returnflag is not a string")?.to_owned(),
                linestatus: str_at(status.as_ref(), r).context("l_linestatus is not a string")?.to_owned(),
                sum_qty: decimal_at(b, "sum_qty", r, 2)?,
                sum_base_price: decimal_at(b, "sum_base_price", r, 2)?,
                sum_disc_price: decimal_at(b, "sum_disc_price", r, 4)?,
                sum_charge: decimal_at(b, "sum_charge", r, 6)?,
                avg_qty,
                avg_price: decimal_at(b, "avg_price", r, avg_scale)?,
                avg_disc: decimal_at(b, "avg_disc", r, avg_scale)?,
                avg_scale,
                count: u64::try_from(count.value(r)).context("negative count")?,
            });
        }
    }
    Ok(out)
}

/// Q6's revenue, unscaled in 10⁻⁴ (the model's scale).
///
/// # Errors
/// Not one row of one Decimal128 column, or null.
pub fn q6_revenue(batches: &[RecordBatch]) -> Result<i128> {
    let rows: Vec<(usize, &RecordBatch)> = batches.iter().flat_map(|b| (0..b.num_rows()).map(move |r| (r, b))).collect();
    ensure!(rows.len() == 1, "Q6 returned {} rows, expected 1", rows.len());
    decimal_at(rows[0].1, "revenue", rows[0].0, 4)
}

/// Every difference between the model's Q1 and SQL's answer (`None` when they agree): the
/// groups, their counts and sums exactly, the averages to the rounding of their last digit
/// (`|avg × count − sum| < count` at the average's scale).
pub fn q1_diff(model: &LineitemAgg, rows: &[Q1Row]) -> Option<String> {
    let mut out = String::new();
    let mut keys: Vec<[u8; 2]> = Vec::new();
    for r in rows {
        let key = [r.returnflag.bytes().next().unwrap_or(0), r.linestatus.bytes().next().unwrap_or(0)];
        keys.push(key);
        let Some(m) = model.q1.get(&key) else {
            let _ = write!(out, "group {}{} not in the model; ", r.returnflag, r.linestatus);
            continue;
        };
        let exact = [
            ("count", i128::from(r.count), i128::from(m.count)),
            ("sum_qty", r.sum_qty, m.sum_qty),
            ("sum_base_price", r.sum_base_price, m.sum_base_price),
            ("sum_disc_price", r.sum_disc_price, m.sum_disc_price),
            ("sum_charge", r.sum_charge, m.sum_charge),
        ];
        for (name, sql, model) in exact {
            if sql != model {
                let _ = write!(out, "group {}{} {name}: sql {sql} model {model}; ", r.returnflag, r.linestatus);
            }
        }
        let n = i128::from(m.count.max(1));
        for (name, avg, sum) in [("avg_qty", r.avg_qty, m.sum_qty), ("avg_price", r.avg_price, m.sum_base_price), ("avg_disc", r.avg_disc, m.sum_disc)] {
            let ok = rescale(sum, 2, r.avg_scale).is_some_and(|s| (avg * n - s).abs() < n);
            if !ok {
                let _ = write!(out, "group {}{} {name}: sql {avg} (scale {}) model sum {sum} / {n}; ", r.returnflag, r.linestatus, r.avg_scale);
            }
        }
    }
    for k in model.q1.keys() {
        if !keys.contains(k) {
            let _ = write!(out, "group {}{} missing from SQL; ", k[0] as char, k[1] as char);
        }
    }
    if keys.windows(2).any(|w| w[0] >= w[1]) {
        out.push_str("groups not in ORDER BY order; ");
    }
    (!out.is_empty()).then_some(out)
}

/// Runs [`Q1`] through [`Engine::sql`] on the table `lineitem`; returns its rows and the
/// time the query took.
///
/// # Errors
/// The query's error, or an answer that cannot be read.
pub fn run_q1(engine: &Engine) -> Result<(Vec<Q1Row>, Duration)> {
    let t = Instant::now();
    let batches = engine.sql(Q1).context("SQL Q1")?;
    let took = t.elapsed();
    Ok((q1_rows(&batches)?, took))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rescale_is_exact_or_refuses() {
        assert_eq!(rescale(123, 2, 4), Some(12_300));
        assert_eq!(rescale(12_300, 4, 2), Some(123));
        assert_eq!(rescale(12_301, 4, 2), None);
    }
}
