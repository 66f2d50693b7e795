//! `DataFusion` filter expressions translated into gritdb's [`ScanFilter`], so scans prune
//! row groups and pages by Parquet statistics and return only matching rows.
//!
//! Translated: `column <op> literal` and `literal <op> column` (`=`, `<>`, `<`, `<=`, `>`,
//! `>=`), `column IS [NOT] NULL`, `column BETWEEN literal AND literal`, and `AND` / `OR` of
//! translated parts. Anything else (a column inside a cast or function, `NOT`, `LIKE`, ...)
//! stays with `DataFusion` only. A translated filter must also bind to the table schema (the
//! literal's type comparable with the column's), else it is not pushed.
//!
//! A chain of one operator (`a OR b OR c ...`, which the SQL parser builds as a tree as deep as
//! the chain is long) becomes one `Or` (`And`) of all its parts, walked with a heap stack: only
//! alternations of `AND` and `OR` nest. A filter that would still nest deeper than
//! [`MAX_FILTER_DEPTH`] − 1 levels (one level is kept for the `And` that joins a scan's pushed
//! filters) is not pushed, and the translation stops descending there, so its recursion is
//! bounded by that depth however deep the expression is.
//!
//! Comparisons of float columns are never pushed: gritdb's [`ScanFilter`] compares floats as
//! `PostgreSQL` does (`-0.0 = 0.0`, every NaN equal and above every number), `DataFusion` 55's
//! filter normalizes only the sign of zero (`datafusion-physical-expr-common`'s `apply_cmp`) and
//! orders NaNs by IEEE 754 totalOrder (a negative NaN below −infinity, payloads apart;
//! measured in `tests/all/sql.rs`), and a pushed filter is applied by both (`DataFusion` keeps its own
//! `FilterExec`). A row on which they disagree would be dropped by both sides of a partition: a
//! negative NaN would match neither `x < 0` nor `x >= 0`. Float columns are not pruned by Parquet
//! statistics either (see `gritdb_storage::filter`), so nothing is lost by leaving them to
//! `DataFusion`.

use crate::{CompareOp, MAX_FILTER_DEPTH, ScanFilter};
use arrow_schema::{DataType, Schema};
use datafusion::logical_expr::{BinaryExpr, Expr, Operator};

/// Deepest filter pushed: the scan joins its pushed filters in one more `And`.
const MAX_PUSHED_DEPTH: usize = MAX_FILTER_DEPTH - 1;

/// The [`ScanFilter`] equivalent to `expr` on `schema`, if there is one.
pub(crate) fn translate(expr: &Expr, schema: &Schema) -> Option<ScanFilter> {
    let f = to_scan_filter(expr, schema, 1)?;
    if f.depth() > MAX_PUSHED_DEPTH {
        return None;
    }
    f.bind(schema).ok()?;
    Some(f)
}

/// True for a column whose comparisons stay with `DataFusion` (floats: see the module docs).
fn float_column(name: &str, schema: &Schema) -> bool {
    schema.field_with_name(name).is_ok_and(|f| matches!(f.data_type(), DataType::Float16 | DataType::Float32 | DataType::Float64))
}

/// `expr` at nesting level `depth` of the filter being built (1: the root).
fn to_scan_filter(expr: &Expr, schema: &Schema, depth: usize) -> Option<ScanFilter> {
    if depth > MAX_PUSHED_DEPTH {
        return None;
    }
    match expr {
        Expr::BinaryExpr(BinaryExpr { op: chain @ (Operator::And | Operator::Or), .. }) => {
            // The whole chain of this operator, left to right, with a heap stack: its parts
            // are the operands that are not this operator (`a AND (b AND c)` is three parts).
            let mut parts = Vec::new();
            let mut todo = vec![expr];
            while let Some(e) = todo.pop() {
                match e {
                    Expr::BinaryExpr(BinaryExpr { left, op, right }) if op == chain => {
                        todo.push(right);
                        todo.push(left);
                    }
                    part => parts.push(to_scan_filter(part, schema, depth + 1)?),
                }
            }
            Some(if *chain == Operator::And { ScanFilter::and(parts) } else { ScanFilter::or(parts) })
        }
        Expr::BinaryExpr(BinaryExpr { left, op, right }) => {
            let op = compare_op(*op)?;
            match (left.as_ref(), right.as_ref()) {
                (Expr::Column(c), Expr::Literal(v, _)) if !float_column(&c.name, schema) => Some(ScanFilter::compare(c.name.clone(), op, v.to_array().ok()?)),
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
        // Float comparisons stay with DataFusion (its NaN order is not the scan's);
        // their NULL tests are pushed.
        assert_eq!(t(&col("x").lt(lit(0.0f64))), None);
        assert_eq!(t(&lit(0.0f64).lt_eq(col("x"))), None);
        assert_eq!(t(&col("x").between(lit(0.0f64), lit(1.0f64))), None);
        assert_eq!(t(&col("id").eq(lit(1i64)).and(col("x").eq(lit(0.0f64)))), None);
        assert_eq!(t(&col("x").is_null()).as_deref(), Some("x IS NULL"));
    }

    fn on_stack<T: Send + 'static>(bytes: usize, work: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::Builder::new().stack_size(bytes).spawn(work).expect("spawn").join().expect("no panic")
    }

    /// A chain of 100,000 ORs (left-deep, as the SQL parser builds `a OR b OR c ...`) is one
    /// `Or` of 100,000 parts (depth 2), translated on a thread with 256 KiB of stack: the
    /// chain is walked with a heap stack. Before, the translation recursed once per OR and
    /// overflowed the stack. ANDs and ORs alternating past the depth limit are not pushed
    /// (left to `DataFusion`), with the recursion cut at the limit; at the limit they are.
    /// (`DataFusion`'s own expressions are built and dropped on a large stack: its drop of a
    /// deep `Expr` recurses.)
    #[test]
    fn long_chains_are_flattened_and_deep_nesting_is_not_pushed() {
        let exprs = on_stack(512 << 20, || {
            let mut chain = col("id").eq(lit(0i64));
            for i in 1..100_000i64 {
                chain = chain.or(col("id").eq(lit(i)));
            }
            let alternating = |depth: usize| {
                let mut e = col("id").gt_eq(lit(500i64));
                for level in 1..depth {
                    e = if level % 2 == 1 { e.or(col("id").eq(lit(level as i64))) } else { e.and(col("s").is_not_null()) };
                }
                e
            };
            std::sync::Arc::new((chain, alternating(MAX_PUSHED_DEPTH), alternating(MAX_PUSHED_DEPTH + 1), alternating(100_000)))
        });
        let shared = std::sync::Arc::clone(&exprs);
        let (chain, at_limit, past, far) = on_stack(256 << 10, move || {
            let (chain, at_limit, past, far) = &*shared;
            let t = |e: &Expr| translate(e, &schema()).map(|f| (f.depth(), f.to_string().len()));
            (translate(chain, &schema()), t(at_limit), t(past), t(far))
        });
        let chain = chain.expect("a chain of ORs is pushed");
        assert_eq!(chain.depth(), 2);
        let ScanFilter::Or(parts) = &chain else { panic!("{}", &chain.to_string()[..100]) };
        assert_eq!(parts.len(), 100_000);
        assert_eq!(parts[0].to_string(), "id = 0");
        assert_eq!(parts[99_999].to_string(), "id = 99999");
        assert_eq!(at_limit.map(|(d, _)| d), Some(MAX_PUSHED_DEPTH));
        assert_eq!(past, None);
        assert_eq!(far, None);
        // `a AND (b AND c)` and `(a AND b) AND c` are one AND of three parts.
        let three = |e: &Expr| t(e).expect("pushed");
        assert_eq!(three(&col("id").gt(lit(1i64)).and(col("id").lt(lit(9i64)).and(col("s").is_null()))), "(id > 1 AND id < 9 AND s IS NULL)");
        assert_eq!(three(&col("id").gt(lit(1i64)).and(col("id").lt(lit(9i64))).and(col("s").is_null())), "(id > 1 AND id < 9 AND s IS NULL)");
        assert_eq!(three(&col("id").gt(lit(1i64)).or(col("id").lt(lit(9i64)).and(col("s").is_null()))), "(id > 1 OR (id < 9 AND s IS NULL))");
        on_stack(512 << 20, move || drop(exprs));
    }
}
