//! System tables: `gritdb_memory` and `gritdb_tables`, computed when a query reads them.

use super::provider::ComputedTable;
use crate::engine::{EngineInner, memory_batch, memory_batch_schema};
use crate::error::{Error, Result};
use crate::table::Table;
use arrow_array::{ArrayRef, RecordBatch, StringArray, UInt64Array};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use datafusion::catalog::TableProvider;
use std::sync::{Arc, Weak};

/// Memory by category, engine-wide and per table.
pub(crate) const MEMORY: &str = "gritdb_memory";
/// One row per table.
pub(crate) const TABLES: &str = "gritdb_tables";
/// The system table names; they take precedence over engine tables of the same name.
pub(crate) const NAMES: [&str; 2] = [MEMORY, TABLES];

/// The system table `name`, if it is one.
pub(crate) fn table(name: &str, engine: &Arc<EngineInner>) -> Option<Arc<dyn TableProvider>> {
    match name {
        MEMORY => {
            let ctl = Arc::clone(&engine.shared.ctl);
            Some(Arc::new(ComputedTable::new(MEMORY, memory_batch_schema(), Arc::new(move || memory_batch(&ctl.report())))))
        }
        TABLES => {
            let weak = Arc::downgrade(engine);
            Some(Arc::new(ComputedTable::new(TABLES, tables_schema(), Arc::new(move || tables_batch(&weak)))))
        }
        _ => None,
    }
}

/// Columns of `gritdb_tables`.
fn tables_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("name", DataType::Utf8, false),
        Field::new("primary_key", DataType::Utf8, false),
        Field::new("rows", DataType::UInt64, true),
        Field::new("files", DataType::UInt64, false),
        Field::new("file_rows", DataType::UInt64, false),
        Field::new("delta_bytes", DataType::UInt64, false),
        Field::new("sealed_deltas", DataType::UInt64, false),
        Field::new("index_bytes", DataType::UInt64, false),
        Field::new("accounted_bytes", DataType::UInt64, false),
        Field::new("manifest_version", DataType::UInt64, false),
        Field::new("last_flush_error", DataType::Utf8, true),
        Field::new("damage", DataType::Utf8, true),
    ]))
}

/// One row per live table: live rows (an exact count: a key-column scan; null when it fails on
/// a file, whose error `damage` then shows), data files, live
/// rows in files, delta bytes (active + sealed), sealed deltas, key-index bytes, all bytes
/// accounted to the table, manifest version, last flush error, and the damage of the first data
/// file found damaged or missing (`TableStats::damage`), else the error the count failed with;
/// null when neither.
fn tables_batch(engine: &Weak<EngineInner>) -> Result<RecordBatch> {
    let engine = engine.upgrade().ok_or_else(|| Error::Closed("the engine".into()))?;
    let mut name = Vec::new();
    let mut pk = Vec::new();
    let mut cols: [Vec<u64>; 7] = Default::default();
    let mut live: Vec<Option<u64>> = Vec::new();
    let mut err: Vec<Option<String>> = Vec::new();
    let mut damage: Vec<Option<String>> = Vec::new();
    for inner in engine.all_tables() {
        let t = Table { inner, engine: Arc::clone(&engine) };
        // A table dropped meanwhile is simply not listed. A table whose count reads a damaged
        // or missing file is listed with no count and that error in `damage`: before, one
        // damaged table failed the whole query, the one that would show its damage. The
        // count runs first, so the damage it finds is in the figures read after it.
        let figures = match t.row_count() {
            Ok(rows) => t.stats().map(|s| (s, Some(rows))),
            Err(Error::Storage(e)) => {
                tracing::warn!(table = %t.name(), error = %e, "gritdb_tables: rows not counted");
                t.stats().map(|mut s| {
                    s.damage = s.damage.or_else(|| Some(e.to_string()));
                    (s, None)
                })
            }
            Err(e) => Err(e),
        };
        let (stats, rows) = match figures {
            Ok(x) => x,
            Err(Error::TableNotFound { .. }) => continue,
            Err(e) => return Err(e),
        };
        live.push(rows);
        name.push(t.name().to_owned());
        pk.push(t.primary_key().join(","));
        let values = [
            stats.files as u64,
            stats.file_rows,
            (stats.active_delta_bytes + stats.sealed_delta_bytes) as u64,
            stats.sealed_deltas as u64,
            stats.key_index_bytes as u64,
            stats.accounted_bytes as u64,
            stats.manifest_version,
        ];
        for (c, v) in cols.iter_mut().zip(values) {
            c.push(v);
        }
        err.push(stats.last_flush_error);
        damage.push(stats.damage);
    }
    let mut arrays: Vec<ArrayRef> = vec![Arc::new(StringArray::from(name)), Arc::new(StringArray::from(pk)), Arc::new(UInt64Array::from(live))];
    arrays.extend(cols.into_iter().map(|c| Arc::new(UInt64Array::from(c)) as ArrayRef));
    arrays.push(Arc::new(StringArray::from(err)));
    arrays.push(Arc::new(StringArray::from(damage)));
    Ok(RecordBatch::try_new(tables_schema(), arrays)?)
}
