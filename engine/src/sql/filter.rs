//! `DataFusion` filter expressions translated into gritdb's [`ScanFilter`], so scans prune
//! row groups and pages by Parquet statistics and return only matching rows.
//!
//! Translated: `column <op> literal` and `literal <op> column` (`=`, `<>`, `<`, `<=`, `>`,
//! `>=`), `column IS [NOT] NULL`, `column BETWEEN literal AND literal`, and `AND` / `OR` of
//! translated parts. Anything else (a column inside a cast or function, `NOT`, `LIKE`, ...)
//! stays with `DataFusion` only. A translated filter must also bind to the table schema (the
//! literal's type comparable with the column's), else it is not pushed.
//!
//! Comparisons of float columns are never pushed: gritdb's [`ScanFilter`] compares floats by
//! IEEE 754 total order (`-0.0 < 0.0`), `DataFusion`'s filter as `PostgreSQL` does (`-0.0 =
//! 0.0`, NaN above every number; measured), and a pushed filter is applied by both (`DataFusion` keeps its own
//! `FilterExec`). A row on which they disagree was dropped by both sides of a partition: a
//! `-0.0` row matched neither `x < 0` nor `x >= 0`. Float columns are not pruned by Parquet
//! statistics either (see `gritdb_storage::filter`), so nothing is lost by leaving them to
//! `DataFusion`.

use crate::{CompareOp, ScanFilter};
use arrow_schema::{DataType, Schema};
use datafusion::logical_expr::{BinaryExpr, Expr, Operator};

/// The [`ScanFilter`] equivalent to `expr` on `schema`, if there is one.
pub(crate) fn translate(expr: &Expr, schema: &Schema) -> Option<ScanFilter> {
    let f = to_scan_filter(expr, schema)?;
    f.bind(schema).ok()?;
    Some(f)
}

/// True for a column whose comparisons stay with `DataFusion` (floats: see the module docs).
fn float_column(name: &str, schema: &Schema) -> bool {
    schema.field_with_name(name).is_ok_and(|f| matches!(f.data_type(), DataType::Float16 | DataType::Float32 | DataType::Float64))
}

fn to_scan_filter(expr: &Expr, schema: &Schema) -> Option<ScanFilter> {
    match expr {
        Expr::BinaryExpr(BinaryExpr { left, op: Operator::And, right }) => {
            Some(ScanFilter::and([to_scan_filter(left, schema)?, to_scan_filter(right, schema)?]))
        }
        Expr::BinaryExpr(BinaryExpr { left, op: Operator::Or, right }) => {
            Some(ScanFilter::or([to_scan_filter(left, schema)?, to_scan_filter(right, schema)?]))
        }
        Expr::BinaryExpr(BinaryExpr { left, op, right }) => {
            let op = compare_op(*op)?;
            match (left.as_ref(), right.as_ref()) {
                (Expr::Column(c), Expr::Literal(v, _)) if !float_column(&c.name, schema) => {
                    Some(ScanFilter::compare(c.name.clone(), op, v.to_array().ok()?))
                }
                (Expr::Literal(v, _), Expr::Column(c)) if !float_column(&c.name, schema) => {
                    Some(ScanFilter::compare(c.name.clone(), flip(op), v.to_array().ok()?))
                }
                _ => None,
            }
        }
        Expr::IsNull(e) => match e.as_ref() {
            Expr::Column(c) => Some(ScanFilter::is_null(c.name.clone())),
            _ => None,
        },
        Expr::IsNotNull(e) => match e.as_ref() {
            Expr::Column(c) => Some(ScanFilter::is_not_null(c.name.clone())),
            _ => None,
        },
        Expr::Between(b) if !b.negated => match (b.expr.as_ref(), b.low.as_ref(), b.high.as_ref()) {
            (Expr::Column(c), Expr::Literal(lo, _), Expr::Literal(hi, _)) if !float_column(&c.name, schema) => Some(ScanFilter::and([
                ScanFilter::compare(c.name.clone(), CompareOp::GtEq, lo.to_array().ok()?),
                ScanFilter::compare(c.name.clone(), CompareOp::LtEq, hi.to_array().ok()?),
            ])),
            _ => None,
        },
        _ => None,
    }
}

fn compare_op(op: Operator) -> Option<CompareOp> {
    Some(match op {
        Operator::Eq => CompareOp::Eq,
        Operator::NotEq => CompareOp::NotEq,
        Operator::Lt => CompareOp::Lt,
        Operator::LtEq => CompareOp::LtEq,
        Operator::Gt => CompareOp::Gt,
        Operator::GtEq => CompareOp::GtEq,
        _ => return None,
    })
}

/// `literal <op> column` as `column <flip(op)> literal`.
fn flip(op: CompareOp) -> CompareOp {
    match op {
        CompareOp::Lt => CompareOp::Gt,
        CompareOp::LtEq => CompareOp::GtEq,
        CompareOp::Gt => CompareOp::Lt,
        CompareOp::GtEq => CompareOp::LtEq,
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_schema::{DataType, Field};
    use datafusion::logical_expr::{col, lit};

    fn schema() -> Schema {
        Schema::new(vec![Field::new("id", DataType::Int64, false), Field::new("s", DataType::Utf8, true), Field::new("x", DataType::Float64, true)])
    }

    fn t(e: &Expr) -> Option<String> {
        translate(e, &schema()).map(|f| f.to_string())
    }

    #[test]
    fn translates_comparisons_reversed_and_combined() {
        assert_eq!(t(&col("id").gt_eq(lit(5i64))).as_deref(), Some("id >= 5"));
        assert_eq!(t(&lit(5i64).lt(col("id"))).as_deref(), Some("id > 5"));
        assert_eq!(t(&col("id").eq(lit(1i64)).and(col("s").is_not_null())).as_deref(), Some("(id = 1 AND s IS NOT NULL)"));
        assert_eq!(t(&col("id").eq(lit(1i64)).or(col("s").is_null())).as_deref(), Some("(id = 1 OR s IS NULL)"));
        assert_eq!(t(&col("id").between(lit(1i64), lit(9i64))).as_deref(), Some("(id >= 1 AND id <= 9)"));
        assert_eq!(t(&col("s").eq(lit("x"))).as_deref(), Some("s = 'x'"));
    }

    #[test]
    fn leaves_what_it_cannot_translate_exactly() {
        // A part that does not translate makes the whole AND/OR stay with DataFusion.
        assert_eq!(t(&col("id").eq(lit(1i64)).and(col("s").like(lit("a%")))), None);
        assert_eq!(t(&col("id").not_between(lit(1i64), lit(9i64))), None);
        assert_eq!(t(&(col("id") + lit(1i64)).eq(lit(2i64))), None);
        // A literal the column cannot be compared with, and an unknown column.
        assert_eq!(t(&col("id").eq(lit("x"))), None);
        assert_eq!(t(&col("nope").eq(lit(1i64))), None);
        // Float comparisons stay with DataFusion (its -0.0 = 0.0, not the scan's total order);
        // their NULL tests are pushed.
        assert_eq!(t(&col("x").lt(lit(0.0f64))), None);
        assert_eq!(t(&lit(0.0f64).lt_eq(col("x"))), None);
        assert_eq!(t(&col("x").between(lit(0.0f64), lit(1.0f64))), None);
        assert_eq!(t(&col("id").eq(lit(1i64)).and(col("x").eq(lit(0.0f64)))), None);
        assert_eq!(t(&col("x").is_null()).as_deref(), Some("x IS NULL"));
    }
}
