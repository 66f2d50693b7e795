//! Shared helpers for gritdb's integration tests: the composite-key schema, batch builders
//! and the crash workload live in `gritdb_soak::crash` (the soak's `crash` subcommand uses
//! them too) and are re-exported here.

pub use gritdb_soak::crash::{Row, collect_composite, composite_batch, composite_keys, composite_schema};

/// The crash-consistency workload (see `gritdb_soak::crash`).
pub mod crash {
    pub use gritdb_soak::crash::*;
}
