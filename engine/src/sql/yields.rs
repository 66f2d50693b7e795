//! Yield points above the operators that can emit far more than they read, so that the work
//! of a statement past [`crate::EngineConfig::sql_statement_timeout`] stops (its caller has
//! `Timeout` at the deadline already: `deadline`).
//!
//! A `DataFusion` stream runs on a tokio worker until it returns `Pending`, and the abort of
//! its task (and the tokio timer inside it) takes effect only then. Scans and
//! exchanges yield (`DataFusion`'s `EnsureCooperative` rule wraps them), but a join emits many
//! batches for each batch it reads without polling its input: a cross join, a whole left side
//! for each batch of the right. Above such an operator the aggregate that counts it polled
//! it ready after ready and never gave its worker back; with one SQL thread (one core, as
//! `taskset -c 0` or a one-CPU container gives) a 300 ms statement counting a three-way cross
//! join of 50,000-row tables ran on for minutes, and a two-way one ran to its end and answered
//! instead of `Timeout` (2026-12-07, `sql::a_cross_join_past_the_timeout_is_cancelled_on_one_sql_thread`).
//!
//! [`JoinYields`] wraps every join and unnest in `DataFusion`'s own [`CooperativeExec`]: each
//! batch they emit takes a unit of the task's tokio budget (128 a turn), so their consumers
//! return `Pending` at least every 128 batches. Its properties are its input's, so the plan
//! above it is unchanged.

use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::error::Result;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::coop::CooperativeExec;
use std::sync::Arc;

/// The physical optimizer rule (run after `DataFusion`'s own) that puts a [`CooperativeExec`]
/// above every join and unnest.
#[derive(Debug, Default)]
pub(crate) struct JoinYields;

/// Operators whose output is not bounded by the batches they read: every join
/// (`CrossJoinExec`, `NestedLoopJoinExec`, `HashJoinExec`, `SortMergeJoinExec`,
/// `SymmetricHashJoinExec`, `PiecewiseMergeJoinExec`, ...) and `UnnestExec`.
fn multiplies(plan: &dyn ExecutionPlan) -> bool {
    let name = plan.name();
    name.ends_with("JoinExec") || name == "UnnestExec"
}

impl PhysicalOptimizerRule for JoinYields {
    fn optimize(&self, plan: Arc<dyn ExecutionPlan>, _config: &ConfigOptions) -> Result<Arc<dyn ExecutionPlan>> {
        // Bottom-up, once per node: the root too (a join at the top of a plan is polled by
        // the statement's own collecting loop).
        plan.transform_up(|node| {
            if multiplies(node.as_ref()) {
                Ok(Transformed::yes(Arc::new(CooperativeExec::new(node)) as Arc<dyn ExecutionPlan>))
            } else {
                Ok(Transformed::no(node))
            }
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &'static str {
        "gritdb_join_yields"
    }

    fn schema_check(&self) -> bool {
        true
    }
}
