//! The `gritdb.public` schema: every engine table, resolved at planning time, plus the system
//! tables.

use super::provider::TableScanProvider;
use super::system;
use super::to_datafusion;
use crate::engine::EngineInner;
use crate::error::Error;
use crate::table::Table;
use async_trait::async_trait;
use datafusion::catalog::{SchemaProvider, TableProvider};
use std::sync::{Arc, Weak};

/// Resolves table names against the engine at planning time, so tables created or dropped
/// after the session was built are seen. Holds the engine weakly: a cached session does not
/// keep a dropped engine alive.
#[derive(Debug)]
pub(crate) struct EngineSchema {
    engine: Weak<EngineInner>,
    /// The session's table functions (`generate_series`, `range`, ...): a name of one that is
    /// no table is left for the planner to resolve as the function.
    table_functions: Vec<String>,
}

impl EngineSchema {
    pub(crate) fn new(engine: Weak<EngineInner>, table_functions: Vec<String>) -> Self {
        Self { engine, table_functions }
    }

    fn engine(&self) -> crate::Result<Arc<EngineInner>> {
        let engine = self.engine.upgrade().ok_or_else(|| Error::Closed("the engine".into()))?;
        engine.check_open()?;
        Ok(engine)
    }
}

#[async_trait]
impl SchemaProvider for EngineSchema {
    fn table_names(&self) -> Vec<String> {
        let mut names: Vec<String> = system::NAMES.iter().map(|s| (*s).to_owned()).collect();
        if let Ok(engine) = self.engine() {
            names.extend(engine.table_names());
        }
        names
    }

    /// A system table, else the engine's table of that name (exact, else the one table whose
    /// name matches ignoring case — names are unique ignoring case — so the lowercase form SQL
    /// gives unquoted identifiers finds `Orders`). An unknown name is
    /// [`Error::TableNotFound`], carried through `DataFusion` and returned as such by
    /// `Engine::sql`.
    async fn table(&self, name: &str) -> datafusion::error::Result<Option<Arc<dyn TableProvider>>> {
        let engine = self.engine().map_err(to_datafusion)?;
        if let Some(t) = system::table(name, &engine) {
            return Ok(Some(t));
        }
        match engine.lookup(name) {
            Some(inner) => Ok(Some(Arc::new(TableScanProvider::new(Table { inner, engine })))),
            // `FROM generate_series(1, 10)`: DataFusion asks the schema for every name in
            // `FROM` before it tells table functions apart (before: `TableNotFound`).
            None if self.table_functions.iter().any(|f| f == name) => Ok(None),
            None => Err(to_datafusion(Error::TableNotFound { name: name.to_owned() })),
        }
    }

    fn table_exist(&self, name: &str) -> bool {
        system::NAMES.contains(&name) || self.engine().is_ok_and(|e| e.lookup(name).is_some())
    }
}
