//! The in-process model the engine's answers are checked against.
//!
//! The model never reads the engine: it records, per TPC-H part in the window, the version of
//! its rows and the aggregates of the batches the soak wrote, and, per mixed table, a
//! `BTreeMap` of `id → v`. Aggregates use exact integer arithmetic on the decimals' unscaled
//! values (hundredths), so engine and model must agree to the last digit.

use crate::data::str_at;
use anyhow::{Context, Result, bail};
use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{Date32Type, Decimal128Type, Int64Type};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Days since 1970-01-01 of a proleptic Gregorian date.
pub const fn days_from_civil(y: i32, m: i32, d: i32) -> i32 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = (if y >= 0 { y } else { y - 399 }) / 400;
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Q1's filter: `l_shipdate <= date '1998-12-01' - interval '90' day` (= 1998-09-02).
pub const Q1_SHIPDATE_MAX: i32 = days_from_civil(1998, 12, 1) - 90;
/// Q6's filter: `l_shipdate >= date '1994-01-01'`.
pub const Q6_SHIPDATE_MIN: i32 = days_from_civil(1994, 1, 1);
/// Q6's filter: `l_shipdate < date '1995-01-01'`.
pub const Q6_SHIPDATE_END: i32 = days_from_civil(1995, 1, 1);

/// Columns a Q1 scan projects.
pub const Q1_COLUMNS: [&str; 7] = ["l_returnflag", "l_linestatus", "l_quantity", "l_extendedprice", "l_discount", "l_tax", "l_shipdate"];
/// Columns a Q6 scan projects.
pub const Q6_COLUMNS: [&str; 4] = ["l_shipdate", "l_discount", "l_quantity", "l_extendedprice"];
/// Columns an orders check projects.
pub const ORDERS_COLUMNS: [&str; 2] = ["o_orderstatus", "o_totalprice"];

/// One Q1 group (`l_returnflag`, `l_linestatus`). Sums are unscaled decimals: `sum_qty`,
/// `sum_base_price`, `sum_disc` in hundredths; `sum_disc_price` = Σ price·(1−disc) in 10⁻⁴;
/// `sum_charge` = Σ price·(1−disc)·(1+tax) in 10⁻⁶.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Q1Group {
    /// `count(*)`.
    pub count: u64,
    /// `sum(l_quantity)`.
    pub sum_qty: i128,
    /// `sum(l_extendedprice)`.
    pub sum_base_price: i128,
    /// `sum(l_extendedprice * (1 - l_discount))`.
    pub sum_disc_price: i128,
    /// `sum(l_extendedprice * (1 - l_discount) * (1 + l_tax))`.
    pub sum_charge: i128,
    /// `sum(l_discount)` (for `avg(l_discount)`).
    pub sum_disc: i128,
}

impl Q1Group {
    fn merge(&mut self, o: &Q1Group) {
        self.count += o.count;
        self.sum_qty += o.sum_qty;
        self.sum_base_price += o.sum_base_price;
        self.sum_disc_price += o.sum_disc_price;
        self.sum_charge += o.sum_charge;
        self.sum_disc += o.sum_disc;
    }
}

/// Aggregates over lineitem rows: row count and `sum(l_quantity)` over all rows, Q1 groups
/// and Q6 revenue (Σ price·disc in 10⁻⁴ over Q6's filter).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct LineitemAgg {
    /// Rows.
    pub rows: u64,
    /// `sum(l_quantity)` over all rows, in hundredths.
    pub sum_qty: i128,
    /// Q1 groups keyed by the first byte of returnflag and linestatus.
    pub q1: BTreeMap<[u8; 2], Q1Group>,
    /// Q6 revenue in 10⁻⁴.
    pub q6_revenue: i128,
}

fn dec<'a>(b: &'a RecordBatch, name: &str) -> Result<&'a [i128]> {
    let col = b.column_by_name(name).with_context(|| format!("column {name} missing"))?;
    if col.null_count() > 0 {
        bail!("column {name} has nulls");
    }
    Ok(col.as_primitive_opt::<Decimal128Type>().with_context(|| format!("column {name} is not Decimal128"))?.values())
}

fn date<'a>(b: &'a RecordBatch, name: &str) -> Result<&'a [i32]> {
    let col = b.column_by_name(name).with_context(|| format!("column {name} missing"))?;
    Ok(col.as_primitive_opt::<Date32Type>().with_context(|| format!("column {name} is not Date32"))?.values())
}

fn first_byte(col: &dyn Array, row: usize) -> Result<u8> {
    str_at(col, row).and_then(|s| s.bytes().next()).context("flag column is not a non-empty string")
}

impl LineitemAgg {
    /// Adds rows, count, `sum(l_quantity)` and the Q1 groups of a batch holding [`Q1_COLUMNS`].
    pub fn add_q1(&mut self, b: &RecordBatch) -> Result<()> {
        let (qty, price, disc, tax) = (dec(b, "l_quantity")?, dec(b, "l_extendedprice")?, dec(b, "l_discount")?, dec(b, "l_tax")?);
        let ship = date(b, "l_shipdate")?;
        let rf = b.column_by_name("l_returnflag").context("l_returnflag missing")?;
        let ls = b.column_by_name("l_linestatus").context("l_linestatus missing")?;
        self.rows += b.num_rows() as u64;
        for r in 0..b.num_rows() {
            self.sum_qty += qty[r];
            if ship[r] > Q1_SHIPDATE_MAX {
                continue;
            }
            let g = self.q1.entry([first_byte(rf.as_ref(), r)?, first_byte(ls.as_ref(), r)?]).or_default();
            let disc_price = price[r] * (100 - disc[r]);
            g.count += 1;
            g.sum_qty += qty[r];
            g.sum_base_price += price[r];
            g.sum_disc_price += disc_price;
            g.sum_charge += disc_price * (100 + tax[r]);
            g.sum_disc += disc[r];
        }
        Ok(())
    }

    /// Adds the Q6 revenue of a batch holding [`Q6_COLUMNS`].
    pub fn add_q6(&mut self, b: &RecordBatch) -> Result<()> {
        let (qty, price, disc) = (dec(b, "l_quantity")?, dec(b, "l_extendedprice")?, dec(b, "l_discount")?);
        let ship = date(b, "l_shipdate")?;
        for r in 0..b.num_rows() {
            if (Q6_SHIPDATE_MIN..Q6_SHIPDATE_END).contains(&ship[r]) && (5..=7).contains(&disc[r]) && qty[r] < 2400 {
                self.q6_revenue += price[r] * disc[r];
            }
        }
        Ok(())
    }

    /// Adds everything (Q1 and Q6) of full lineitem batches.
    pub fn from_batches(batches: &[RecordBatch]) -> Result<Self> {
        let mut a = Self::default();
        for b in batches {
            a.add_q1(b)?;
            a.add_q6(b)?;
        }
        Ok(a)
    }

    fn merge(&mut self, o: &LineitemAgg) {
        self.rows += o.rows;
        self.sum_qty += o.sum_qty;
        self.q6_revenue += o.q6_revenue;
        for (k, g) in &o.q1 {
            self.q1.entry(*k).or_default().merge(g);
        }
    }
}

/// Aggregates over orders: rows, `sum(o_totalprice)` (hundredths), rows per `o_orderstatus`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct OrdersAgg {
    /// Rows.
    pub rows: u64,
    /// `sum(o_totalprice)` in hundredths.
    pub sum_totalprice: i128,
    /// `count(*)` per `o_orderstatus`.
    pub by_status: BTreeMap<String, u64>,
}

impl OrdersAgg {
    /// Adds a batch holding [`ORDERS_COLUMNS`].
    pub fn add(&mut self, b: &RecordBatch) -> Result<()> {
        let price = dec(b, "o_totalprice")?;
        let status = b.column_by_name("o_orderstatus").context("o_orderstatus missing")?;
        self.rows += b.num_rows() as u64;
        for (r, p) in price.iter().enumerate() {
            self.sum_totalprice += p;
            let s = str_at(status.as_ref(), r).context("o_orderstatus is not a non-null string")?;
            *self.by_status.entry(s.to_owned()).or_default() += 1;
        }
        Ok(())
    }

    /// Aggregates of whole orders batches.
    pub fn from_batches(batches: &[RecordBatch]) -> Result<Self> {
        let mut a = Self::default();
        for b in batches {
            a.add(b)?;
        }
        Ok(a)
    }

    fn merge(&mut self, o: &OrdersAgg) {
        self.rows += o.rows;
        self.sum_totalprice += o.sum_totalprice;
        for (k, n) in &o.by_status {
            *self.by_status.entry(k.clone()).or_default() += n;
        }
    }
}

/// Row count and sums of a mixed table.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MixedAgg {
    /// Rows.
    pub rows: u64,
    /// `sum(id)`.
    pub sum_id: i128,
    /// `sum(v)`.
    pub sum_v: i128,
}

impl MixedAgg {
    /// Adds a batch holding `id` and `v`.
    pub fn add(&mut self, b: &RecordBatch) -> Result<()> {
        let col = |n: &str| -> Result<&[i64]> {
            Ok(b.column_by_name(n).and_then(|c| c.as_primitive_opt::<Int64Type>()).with_context(|| format!("column {n} missing or not Int64"))?.values())
        };
        let (id, v) = (col("id")?, col("v")?);
        self.rows += b.num_rows() as u64;
        self.sum_id += id.iter().map(|&x| i128::from(x)).sum::<i128>();
        self.sum_v += v.iter().map(|&x| i128::from(x)).sum::<i128>();
        Ok(())
    }
}

/// What the model knows of one part in the window.
#[derive(Debug, Clone)]
pub struct Part {
    /// Quantity updates applied to its lineitems.
    pub lineitem_version: u32,
    /// Status updates applied to its orders.
    pub orders_version: u32,
    /// Rows of its lineitem.
    pub lineitem: LineitemAgg,
    /// Rows of its orders.
    pub orders: OrdersAgg,
}

/// The model: parts in the window and the content of every mixed table.
#[derive(Debug, Default)]
pub struct Model {
    /// Parts by sequence number, oldest first.
    pub parts: BTreeMap<u64, Part>,
    /// Sequence number of the next part RF1 inserts.
    pub next_seq: u64,
    /// `id → v` of each mixed table.
    pub mixed: Vec<BTreeMap<i64, i64>>,
}

impl Model {
    /// A model with `mixed_tables` empty mixed tables and no parts.
    pub fn new(mixed_tables: usize) -> Self {
        Self { parts: BTreeMap::new(), next_seq: 0, mixed: vec![BTreeMap::new(); mixed_tables] }
    }

    /// Lineitem aggregates over the window.
    pub fn lineitem(&self) -> LineitemAgg {
        let mut a = LineitemAgg::default();
        for p in self.parts.values() {
            a.merge(&p.lineitem);
        }
        a
    }

    /// Orders aggregates over the window.
    pub fn orders(&self) -> OrdersAgg {
        let mut a = OrdersAgg::default();
        for p in self.parts.values() {
            a.merge(&p.orders);
        }
        a
    }

    /// Aggregates of mixed table `t`.
    pub fn mixed_agg(&self, t: usize) -> MixedAgg {
        let m = &self.mixed[t];
        MixedAgg { rows: m.len() as u64, sum_id: m.keys().map(|&k| i128::from(k)).sum(), sum_v: m.values().map(|&v| i128::from(v)).sum() }
    }
}

/// Describes every difference between the model's Q1 answer and the engine's (`None` when equal).
pub fn q1_diff(model: &LineitemAgg, engine: &LineitemAgg) -> Option<String> {
    let mut out = String::new();
    if model.rows != engine.rows {
        let _ = write!(out, "lineitem rows: model {} engine {}; ", model.rows, engine.rows);
    }
    if model.sum_qty != engine.sum_qty {
        let _ = write!(out, "sum(l_quantity)*100: model {} engine {}; ", model.sum_qty, engine.sum_qty);
    }
    let keys: std::collections::BTreeSet<_> = model.q1.keys().chain(engine.q1.keys()).collect();
    for k in keys {
        let (m, e) = (model.q1.get(k), engine.q1.get(k));
        if m != e {
            let _ = write!(out, "Q1 group {}{}: model {m:?} engine {e:?}; ", k[0] as char, k[1] as char);
        }
    }
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data;

    #[test]
    fn civil_dates() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(Q1_SHIPDATE_MAX, days_from_civil(1998, 9, 2));
    }

    #[test]
    fn aggregates_add_up_across_parts() {
        let a = LineitemAgg::from_batches(&data::lineitems(0.01, 0, 0).expect("gen")).expect("agg");
        let b = LineitemAgg::from_batches(&data::lineitems(0.01, 1, 0).expect("gen")).expect("agg");
        let mut m = Model::new(0);
        for (seq, agg) in [(0, a.clone()), (1, b.clone())] {
            m.parts.insert(seq, Part { lineitem_version: 0, orders_version: 0, lineitem: agg, orders: OrdersAgg::default() });
        }
        let total = m.lineitem();
        assert_eq!(total.rows, a.rows + b.rows);
        assert_eq!(total.sum_qty, a.sum_qty + b.sum_qty);
        assert!(total.q6_revenue > 0 && total.q1.len() >= 3);
        assert!(q1_diff(&total, &total).is_none());
        assert!(q1_diff(&total, &a).is_some());
    }
}
