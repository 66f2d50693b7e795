//! A bound on `GROUP BY CUBE (..)` before `DataFusion` plans it.
//!
//! `CUBE (e1, .., en)` stands for the 2^n grouping sets of its expressions, and `DataFusion` 55
//! builds all of them while planning, in memory no limit governs: the physical planner's
//! `create_cube_physical_expr` one `Vec<bool>` of n flags per set, `powerset` (a `CUBE` beside
//! other grouping items) one `Vec` of expression references per set, before its own check of
//! 4,096 sets runs. `CUBE` of 30 columns asked for about 50 GiB. The mixed path already refuses
//! more than [`MAX_GROUPING_SETS`] sets, so a lone `CUBE` is held to the same number:
//! at most [`MAX_CUBE_EXPRESSIONS`] expressions (2^12 = 4,096). `ROLLUP (n)` is n + 1 sets,
//! `GROUPING SETS` as many as written: both grow with the text, which the token bounds cap.

use datafusion::sql::parser::Statement as DfStatement;
use datafusion::sql::sqlparser::ast::{Expr, Visit, Visitor};
use std::ops::ControlFlow;

/// The most grouping sets one `GROUP BY` item may stand for: `DataFusion`'s own limit on the
/// sets of a `GROUP BY` that mixes grouping items (`check_grouping_sets_size_limit` in
/// datafusion-expr 55, `utils.rs`).
pub const MAX_GROUPING_SETS: usize = 4096;

/// The most expressions a `CUBE (..)` may hold: 2^12 = [`MAX_GROUPING_SETS`] sets.
pub const MAX_CUBE_EXPRESSIONS: usize = 12;

/// `Err(n)` with the expression count of the first `CUBE` in `statement` (any query or
/// subquery of it) holding more than [`MAX_CUBE_EXPRESSIONS`]. Run after the depth checks,
/// so the visitor's recursion is bounded.
pub(crate) fn check_cube_size(statement: &DfStatement) -> Result<(), usize> {
    struct Cubes;
    impl Visitor for Cubes {
        type Break = usize;
        fn pre_visit_expr(&mut self, expr: &Expr) -> ControlFlow<usize> {
            match expr {
                // Each element of a CUBE's list is one grouping item (a parenthesized list
                // counts once, as `DataFusion` takes it).
                Expr::Cube(items) if items.len() > MAX_CUBE_EXPRESSIONS => ControlFlow::Break(items.len()),
                _ => ControlFlow::Continue(()),
            }
        }
    }
    let Some(statement) = super::depth::planned_statement(statement) else { return Ok(()) };
    match statement.visit(&mut Cubes) {
        ControlFlow::Continue(()) => Ok(()),
        ControlFlow::Break(n) => Err(n),
    }
}
