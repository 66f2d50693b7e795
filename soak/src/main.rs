//! `gritdb-soak`: the soak runner. Repeats rounds of four loads (TPC-H writes, create/drop
//! of many tables, Q1/Q6 scans, small mixed transactions) against one engine without
//! restarting it, checks every answer against an in-process model, samples memory after each
//! load and ends with growth per round and a pass/fail verdict. See `docs/soak.md`.

mod cli;
mod data;
mod loads;
mod model;
mod plot;
mod report;
mod run;
mod sample;

use clap::Parser;
use std::process::ExitCode;

/// jemalloc as the global allocator, so the engine's process view reports jemalloc's
/// `allocated` / `resident` / `retained` figures (and outside-engine bytes from them).
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    let result = match &cli.command {
        None => run::run(&cli.run),
        Some(cli::Command::Run(args)) => run::run(args),
        Some(cli::Command::Report { dir }) => run::report(dir),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("gritdb-soak: verdict FAIL");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("gritdb-soak: error: {e:#}");
            ExitCode::from(2)
        }
    }
}
