//! gritdb integration tests (one binary; see STYLE.md item 15).

// Lints of clippy's pedantic group that fight test code, off for the test binaries only (the
// library crates keep them): tests narrate in doc comments with names unquoted
// (`doc_markdown`), keep the one-letter names of the sums they check (`many_single_char_names`,
// `similar_names`), give durations in the unit the scenario speaks of
// (`duration_suboptimal_units`), declare a helper where it is first used
// (`items_after_statements`), spell out the shapes they collect (`type_complexity`), build
// Arrow arrays with the arrays' own `from_iter` (`from_iter_instead_of_collect`), walk the
// index of two parallel columns or records (`needless_range_loop`), mix seeds with decimal
// constants (`decimal_bitwise_operands`), list a case's arms one by one (`match_same_arms`),
// take any `catch_unwind` error as a panic (`match_wild_err_arm`), and match the lowercase
// `.tmp` names gritdb itself writes (`case_sensitive_file_extension_comparisons`).
#![allow(
    clippy::from_iter_instead_of_collect,
    clippy::needless_range_loop,
    clippy::decimal_bitwise_operands,
    clippy::match_same_arms,
    clippy::match_wild_err_arm,
    clippy::case_sensitive_file_extension_comparisons,
    clippy::doc_markdown,
    clippy::many_single_char_names,
    clippy::similar_names,
    clippy::duration_suboptimal_units,
    clippy::items_after_statements,
    clippy::type_complexity
)]

#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

mod accounting;
mod backpressure;
mod bad_input;
mod big_keys;
mod big_strings;
mod breaker_audit14;
mod breaker_audit16;
mod breaker_damage15;
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
mod fair_admission;
mod faults;
mod filter;
mod flush_parts;
mod flush_threads;
mod interop;
mod model;
mod peak_limit;
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
