//! Float columns compared with DECIMAL constants.
//!
//! The session parses `1.5` as an exact DECIMAL (`parse_float_as_decimal`, as `DuckDB` and the
//! SQL standard do, so that `l_discount BETWEEN 0.06 - 0.01 AND 0.06 + 0.01` includes 0.07).
//! `DataFusion`'s comparison coercion then casts a `Float64` column to `Decimal128(30, 15)` for
//! `x > 1.5`, and that cast fails at execution on NaN, ±infinity and any value of 1e15 or
//! more: the query errors instead of answering. [`FloatComparedWithDecimal`] runs before
//! `DataFusion`'s own type coercion and casts the constant side to `Float64` instead, so the
//! comparison runs in floating point, where NaN, the infinities and large values compare as
//! they do everywhere else (NaN above every number, as in `PostgreSQL` and `DataFusion`).

use datafusion::arrow::datatypes::DataType;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{DFSchema, Result};
use datafusion::config::ConfigOptions;
use datafusion::logical_expr::expr::{Between, BinaryExpr, Cast, InList};
use datafusion::logical_expr::utils::merge_schema;
use datafusion::logical_expr::{Expr, ExprSchemable, LogicalPlan, Operator};
use datafusion::optimizer::AnalyzerRule;

/// The analyzer rule (see the module docs): in comparisons (`=`, `<>`, `<`, `<=`, `>`, `>=`,
/// `IS [NOT] DISTINCT FROM`), `BETWEEN` and `IN` lists whose value side is a float column or
/// expression, every side that is a DECIMAL constant (no column reference: a literal or
/// arithmetic on literals, evaluated exactly first) becomes `CAST(.. AS DOUBLE)`.
#[derive(Debug, Default)]
pub(crate) struct FloatComparedWithDecimal;

impl AnalyzerRule for FloatComparedWithDecimal {
    fn analyze(&self, plan: LogicalPlan, _config: &ConfigOptions) -> Result<LogicalPlan> {
        plan.transform_up_with_subqueries(|plan| {
            let schema = match plan.inputs().as_slice() {
                [] => plan.schema().as_ref().clone(),
                inputs => merge_schema(inputs),
            };
            plan.map_expressions(|e| e.transform_up(|e| Ok(rewrite(e, &schema))))
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &'static str {
        "gritdb_float_compared_with_decimal"
    }
}

fn is_float(e: &Expr, schema: &DFSchema) -> bool {
    e.get_type(schema).is_ok_and(|t| matches!(t, DataType::Float16 | DataType::Float32 | DataType::Float64))
}

fn is_decimal_constant(e: &Expr, schema: &DFSchema) -> bool {
    e.column_refs().is_empty() && e.get_type(schema).is_ok_and(|t| matches!(t, DataType::Decimal128(..) | DataType::Decimal256(..)))
}

fn as_double(e: Expr) -> Expr {
    Expr::Cast(Cast::new(Box::new(e), DataType::Float64))
}

/// `e` with its DECIMAL constants cast to `DOUBLE` when it compares them with a float.
fn rewrite(e: Expr, schema: &DFSchema) -> Transformed<Expr> {
    match e {
        Expr::BinaryExpr(BinaryExpr { left, op, right })
            if matches!(
                op,
                Operator::Eq
                    | Operator::NotEq
                    | Operator::Lt
                    | Operator::LtEq
                    | Operator::Gt
                    | Operator::GtEq
                    | Operator::IsDistinctFrom
                    | Operator::IsNotDistinctFrom
            ) && ((is_float(&left, schema) && is_decimal_constant(&right, schema)) || (is_float(&right, schema) && is_decimal_constant(&left, schema))) =>
        {
            let (left, right) = if is_float(&left, schema) { (*left, as_double(*right)) } else { (as_double(*left), *right) };
            Transformed::yes(Expr::BinaryExpr(BinaryExpr::new(Box::new(left), op, Box::new(right))))
        }
        Expr::Between(Between { expr, negated, low, high })
            if is_float(&expr, schema) && (is_decimal_constant(&low, schema) || is_decimal_constant(&high, schema)) =>
        {
            let fix = |b: Box<Expr>| if is_decimal_constant(&b, schema) { Box::new(as_double(*b)) } else { b };
            Transformed::yes(Expr::Between(Between { expr, negated, low: fix(low), high: fix(high) }))
        }
        Expr::InList(InList { expr, list, negated }) if is_float(&expr, schema) && list.iter().any(|v| is_decimal_constant(v, schema)) => {
            let list = list.into_iter().map(|v| if is_decimal_constant(&v, schema) { as_double(v) } else { v }).collect();
            Transformed::yes(Expr::InList(InList { expr, list, negated }))
        }
        e => Transformed::no(e),
    }
}
