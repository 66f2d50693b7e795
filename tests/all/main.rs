//! gritdb integration tests (one binary; see STYLE.md item 15).

#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

mod accounting;
mod backpressure;
mod bad_input;
mod big_strings;
mod breaker_audit14;
mod breaker_encode6;
mod breaker_flush5;
mod breaker_gate8;
mod breaker_keys10;
mod breaker_reopen;
mod breaker_session12;
mod breaker_session13;
mod breaker_slices;
mod breaker_trial;
mod breaker_trial2;
mod breaker_trial3;
mod breaker_trial4;
mod breaker_trial5;
mod breaker_trial6;
mod breaker_views;
mod breaker_wal9;
mod breaker_walpool7;
mod breaker_write11;
mod compaction;
mod crash;
mod create_drop;
mod data_dir;
mod drop_faults;
mod drop_flush;
mod faults;
mod filter;
mod flush_parts;
mod flush_threads;
mod interop;
mod model;
mod refused_writes;
mod regressions;
mod reopen_smaller;
mod retention;
mod runtime;
mod scan_memory;
mod scan_partitions;
mod sliced_writes;
mod smoke;
#[cfg(feature = "sql")]
mod sql;
mod tpch;
mod wal;
mod writer;
