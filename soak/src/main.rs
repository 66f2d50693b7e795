//! `gritdb-soak` with jemalloc as the global allocator (the default binary). See the library
//! docs and `docs/soak.md`.

use gritdb_soak::cli::Allocator;
use std::process::ExitCode;

/// jemalloc as the global allocator, so the engine's process view reports jemalloc's
/// `allocated` / `resident` / `retained` figures (and outside-engine bytes from them).
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    gritdb_soak::main_with(Allocator::Jemalloc)
}
