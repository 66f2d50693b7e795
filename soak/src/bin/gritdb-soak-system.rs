//! `gritdb-soak` with the system allocator (glibc malloc on Linux), for comparing with the
//! jemalloc binary: `gritdb-soak --allocator system` starts this one. The engine's process
//! view then reports glibc `mallinfo2()` figures.

use gritdb_soak::cli::Allocator;
use std::process::ExitCode;

fn main() -> ExitCode {
    gritdb_soak::main_with(Allocator::System)
}
