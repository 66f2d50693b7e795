//! `gritdb-soak` with jemalloc as the global allocator (the default binary). See the library
//! docs and `docs/soak.md`.

use gritdb_soak::bench::CountingAlloc;
use gritdb_soak::cli::Allocator;
use std::process::ExitCode;

/// jemalloc as the global allocator, so the engine's process view reports jemalloc's
/// `allocated` / `resident` / `retained` figures (and outside-engine bytes from them).
/// Wrapped in a counter of allocation calls (one relaxed atomic add per call) that
/// `gritdb-soak bench` reads for allocations per row.
#[global_allocator]
static GLOBAL: CountingAlloc<tikv_jemallocator::Jemalloc> = CountingAlloc(tikv_jemallocator::Jemalloc);

fn main() -> ExitCode {
    gritdb_soak::main_with(Allocator::Jemalloc)
}
