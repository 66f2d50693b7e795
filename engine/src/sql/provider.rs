//! gritdb tables as `DataFusion` [`TableProvider`]s, read by a leaf plan that runs the blocking
//! scan iterator off the async workers.

use super::filter::translate;
use super::to_datafusion;
use crate::ScanFilter;
use crate::scan::ScanOptions;
use crate::table::Table;
use arrow_array::{RecordBatch, RecordBatchOptions};
use arrow_schema::SchemaRef;
use async_trait::async_trait;
use datafusion::catalog::{Session, TableProvider};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::execution::TaskContext;
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown, TableType};
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricBuilder, MetricsSet};
use datafusion::physical_plan::stream::RecordBatchReceiverStream;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties, ReplaceChildrenOptions, SendableRecordBatchStream};
use std::fmt;
use std::fmt::Write as _;
use std::sync::Arc;
use tokio::sync::mpsc::Sender;

/// Batches a scan may have produced but the query not yet taken (bounded channel).
const CHANNEL_BATCHES: usize = 2;

/// Where a producer sends its batches.
type BatchSender = Sender<datafusion::error::Result<RecordBatch>>;

/// Produces the batches of one partition (the third argument) on a blocking thread, sending
/// them into the sender (batches of at most the given rows) and recording its figures in the
/// metrics set; returns when done, on error, or when the receiver is gone (`blocking_send`
/// fails).
pub(crate) type Producer = dyn Fn(&BatchSender, usize, usize, &ExecutionPlanMetricsSet) -> datafusion::error::Result<()> + Send + Sync;

/// A leaf plan of `partitions` partitions whose batches come from a blocking producer (a
/// table scan, a system table). The producer runs through `DataFusion`'s
/// [`RecordBatchReceiverStream::builder`]`.spawn_blocking` (the spawned task is tied to the
/// stream: dropping the stream stops it at its next batch).
pub(crate) struct BlockingSourceExec {
    /// `GritScan: table=lineitem, projection=[..], limit=..`, for EXPLAIN.
    label: String,
    schema: SchemaRef,
    producer: Arc<Producer>,
    partitions: usize,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl fmt::Debug for BlockingSourceExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockingSourceExec").field("label", &self.label).finish_non_exhaustive()
    }
}

impl BlockingSourceExec {
    pub(crate) fn new(label: String, schema: SchemaRef, producer: Arc<Producer>, partitions: usize) -> Self {
        let partitions = partitions.max(1);
        let properties = PlanProperties::new(
            EquivalenceProperties::new(Arc::clone(&schema)),
            Partitioning::UnknownPartitioning(partitions),
            EmissionType::Incremental,
            Boundedness::Bounded,
        );
        Self { label, schema, producer, partitions, properties: Arc::new(properties), metrics: ExecutionPlanMetricsSet::new() }
    }
}

impl DisplayAs for BlockingSourceExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        match t {
            DisplayFormatType::Default | DisplayFormatType::Verbose => f.write_str(&self.label),
            DisplayFormatType::TreeRender => Ok(()),
        }
    }
}

impl ExecutionPlan for BlockingSourceExec {
    fn name(&self) -> &'static str {
        "GritScan"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> datafusion::error::Result<TreeNodeRecursion>,
    ) -> datafusion::error::Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn replace_children(
        self: Arc<Self>,
        _children: Vec<Arc<dyn ExecutionPlan>>,
        _options: ReplaceChildrenOptions,
    ) -> datafusion::error::Result<Arc<dyn ExecutionPlan>> {
        Ok(self)
    }

    fn with_new_children(self: Arc<Self>, _children: Vec<Arc<dyn ExecutionPlan>>) -> datafusion::error::Result<Arc<dyn ExecutionPlan>> {
        Ok(self)
    }

    fn execute(&self, partition: usize, context: Arc<TaskContext>) -> datafusion::error::Result<SendableRecordBatchStream> {
        if partition >= self.partitions {
            return Err(datafusion::error::DataFusionError::Internal(format!(
                "{} has {} partition(s), asked for partition {partition}",
                self.label, self.partitions
            )));
        }
        let batch_rows = context.session_config().batch_size().max(1);
        let mut builder = RecordBatchReceiverStream::builder(Arc::clone(&self.schema), CHANNEL_BATCHES);
        let tx = builder.tx();
        let producer = Arc::clone(&self.producer);
        let metrics = self.metrics.clone();
        builder.spawn_blocking(move || producer(&tx, batch_rows, partition, &metrics));
        Ok(builder.build())
    }

    /// The scan's figures (`EXPLAIN ANALYZE`): `files_opened`, `row_groups_total`,
    /// `row_groups_pruned`, `rows_pruned_by_page_index`, `rows_decoded`, `rows_matched`.
    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }
}

/// A gritdb table as a `DataFusion` table: a consistent snapshot (committed files minus
/// deletion vectors, merged with the sealed and active deltas — [`Table::scan`]) taken when
/// the query starts reading it, with projection and limit pushed into the scan. The scan has
/// [`crate::EngineConfig::sql_scan_partitions`] partitions (default 1), read on as many
/// threads: [`Table::scan_partitions`] of one snapshot, taken by the first partition to start
/// and shared by the others.
#[derive(Debug)]
pub(crate) struct TableScanProvider {
    table: Table,
    schema: SchemaRef,
}

impl TableScanProvider {
    pub(crate) fn new(table: Table) -> Self {
        let schema = table.schema();
        Self { table, schema }
    }
}

#[async_trait]
impl TableProvider for TableScanProvider {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn supports_filters_pushdown(&self, filters: &[&Expr]) -> datafusion::error::Result<Vec<TableProviderFilterPushDown>> {
        Ok(filters
            .iter()
            .map(|f| if translate(f, &self.schema).is_some() { TableProviderFilterPushDown::Inexact } else { TableProviderFilterPushDown::Unsupported })
            .collect())
    }

    async fn scan(
        &self,
        _state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> datafusion::error::Result<Arc<dyn ExecutionPlan>> {
        let out_schema: SchemaRef = match projection {
            Some(p) => Arc::new(self.schema.project(p)?),
            None => Arc::clone(&self.schema),
        };
        // A LIMIT is read by one partition: the others would decode rows it throws away.
        let partitions = if limit.is_some() { 1 } else { self.table.inner.shared.config.sql_scan_partitions.max(1) };
        let filters: Vec<ScanFilter> = filters.iter().filter_map(|f| translate(f, &self.schema)).collect();
        let filter = match filters.len() {
            0 => None,
            1 => filters.into_iter().next(),
            _ => Some(ScanFilter::and(filters)),
        };
        // Columns the scan reads. An empty projection (COUNT(*)) still needs the row counts:
        // read the first key column, return batches without columns.
        let read: Vec<String> = match projection {
            Some(p) if p.is_empty() => self.table.primary_key().into_iter().take(1).collect(),
            Some(p) => p.iter().map(|&i| self.schema.field(i).name().clone()).collect(),
            None => self.schema.fields().iter().map(|f| f.name().clone()).collect(),
        };
        let mut label = format!("GritScan: table={}", self.table.name());
        if projection.is_some() {
            let names: Vec<&str> = out_schema.fields().iter().map(|f| f.name().as_str()).collect();
            let _ = write!(label, ", projection=[{}]", names.join(", "));
        }
        if let Some(f) = &filter {
            let _ = write!(label, ", filter={f}");
        }
        if let Some(n) = limit {
            let _ = write!(label, ", limit={n}");
        }
        if partitions > 1 {
            let _ = write!(label, ", partitions={partitions}");
        }
        let table = self.table.clone();
        let schema = Arc::clone(&out_schema);
        let snapshot = Arc::new(SharedSnapshot::default());
        let producer: Arc<Producer> = Arc::new(move |tx: &BatchSender, batch_rows: usize, partition: usize, metrics: &ExecutionPlanMetricsSet| {
            let mut options = ScanOptions::default().projection(read.clone()).batch_rows(batch_rows);
            if let Some(f) = &filter {
                options = options.filter(f.clone());
            }
            let mut scan = snapshot.take(partition, || table.scan_partitions(options, partitions)).map_err(to_datafusion)?;
            let result = send_all(&mut scan, &schema, limit, tx);
            let m = scan.metrics();
            for (name, v) in [
                ("files_opened", m.files_opened),
                ("row_groups_total", m.row_groups_total),
                ("row_groups_pruned", m.row_groups_pruned),
                ("rows_pruned_by_page_index", m.rows_pruned_by_page_index),
                ("rows_decoded", m.rows_decoded),
                ("rows_matched", m.rows_matched),
            ] {
                MetricBuilder::new(metrics).global_counter(name).add(v as usize);
            }
            result
        });
        Ok(Arc::new(BlockingSourceExec::new(label, out_schema, producer, partitions)))
    }
}

/// The partition scans of one snapshot of a table, handed to a plan's partitions as they
/// start: the first to start takes the snapshot (all partitions' scans at once), the others
/// take theirs from it. A partition started again (the plan executed once more) finds its
/// scan taken and begins a new snapshot for every partition started after it. Scans not yet
/// taken are dropped with the plan, releasing their memory.
#[derive(Default)]
struct SharedSnapshot(std::sync::Mutex<Vec<Option<crate::Scan>>>);

impl SharedSnapshot {
    /// Partition `i`'s scan, from the current snapshot or, when that has none left for `i`,
    /// from a new one made by `scans`.
    fn take(&self, i: usize, scans: impl FnOnce() -> crate::Result<Vec<crate::Scan>>) -> crate::Result<crate::Scan> {
        let mut g = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if g.get(i).is_none_or(Option::is_none) {
            *g = scans()?.into_iter().map(Some).collect();
        }
        g.get_mut(i).and_then(Option::take).ok_or_else(|| crate::Error::Config(format!("no scan for partition {i}")))
    }
}

/// Sends the scan's batches (at most `limit` rows) until the scan ends or the receiver is gone.
fn send_all(scan: &mut crate::Scan, schema: &SchemaRef, limit: Option<usize>, tx: &BatchSender) -> datafusion::error::Result<()> {
    let mut remaining = limit.unwrap_or(usize::MAX);
    // A query that dropped its stream closed the channel: stop before the next batch, which
    // may open a file (and reserve its reader's buffers) only for the send to fail.
    while remaining > 0 && !tx.is_closed() {
        let Some(batch) = scan.next() else { break };
        let batch = batch.map_err(to_datafusion)?;
        let n = batch.num_rows().min(remaining);
        remaining -= n;
        let batch = if n < batch.num_rows() { batch.slice(0, n) } else { batch };
        if tx.blocking_send(Ok(conform(schema, &batch)?)).is_err() {
            break; // the query stopped reading (LIMIT satisfied, cancelled, failed)
        }
    }
    Ok(())
}

/// `batch` under the plan's schema (same columns; names, nullability and metadata as the
/// plan declares them), or a batch of `batch`'s row count without columns.
fn conform(schema: &SchemaRef, batch: &RecordBatch) -> datafusion::error::Result<RecordBatch> {
    let columns = if schema.fields().is_empty() { vec![] } else { batch.columns().to_vec() };
    let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
    Ok(RecordBatch::try_new_with_options(Arc::clone(schema), columns, &options)?)
}

/// A one-batch table computed when the query reads it (system tables).
pub(crate) struct ComputedTable {
    name: &'static str,
    schema: SchemaRef,
    compute: Arc<dyn Fn() -> crate::Result<RecordBatch> + Send + Sync>,
}

impl fmt::Debug for ComputedTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ComputedTable").field("name", &self.name).finish_non_exhaustive()
    }
}

impl ComputedTable {
    pub(crate) fn new(name: &'static str, schema: SchemaRef, compute: Arc<dyn Fn() -> crate::Result<RecordBatch> + Send + Sync>) -> Self {
        Self { name, schema, compute }
    }
}

#[async_trait]
impl TableProvider for ComputedTable {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }

    fn table_type(&self) -> TableType {
        TableType::View
    }

    async fn scan(
        &self,
        _state: &dyn Session,
        projection: Option<&Vec<usize>>,
        _filters: &[Expr],
        _limit: Option<usize>,
    ) -> datafusion::error::Result<Arc<dyn ExecutionPlan>> {
        let out_schema: SchemaRef = match projection {
            Some(p) => Arc::new(self.schema.project(p)?),
            None => Arc::clone(&self.schema),
        };
        let projection = projection.cloned();
        let compute = Arc::clone(&self.compute);
        let schema = Arc::clone(&out_schema);
        let producer: Arc<Producer> = Arc::new(move |tx: &BatchSender, _batch_rows: usize, _partition: usize, _metrics: &ExecutionPlanMetricsSet| {
            let batch = compute().map_err(to_datafusion)?;
            let batch = match &projection {
                Some(p) => batch.project(p)?,
                None => batch,
            };
            let batch = conform(&schema, &batch)?;
            let _ = tx.blocking_send(Ok(batch));
            Ok(())
        });
        Ok(Arc::new(BlockingSourceExec::new(format!("GritScan: system table={}", self.name), out_schema, producer, 1)))
    }
}
