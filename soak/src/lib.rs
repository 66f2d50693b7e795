//! `gritdb-soak`: the soak runner. Repeats rounds of four loads (TPC-H writes, create/drop
//! of many tables, Q1/Q6 scans, small mixed transactions) against one engine without
//! restarting it, checks every answer against an in-process model, samples memory after each
//! load and ends with growth per round and a pass/fail verdict. See `docs/soak.md`.
//!
//! Two binaries share this library and differ only in their global allocator:
//! `gritdb-soak` (jemalloc) and `gritdb-soak-system` (the system allocator, glibc malloc).
//! `--allocator` picks one; the other binary is started when it is not this one.

pub mod baseline;
pub mod bench;
pub mod cli;
pub mod crash;
pub mod data;
pub mod loads;
pub mod model;
pub mod plot;
pub mod report;
pub mod run;
pub mod sample;
#[cfg(feature = "sql")]
pub mod sql;
pub mod tune;

use clap::Parser;
use cli::{Allocator, Cli, Command};
use std::process::ExitCode;

/// Entry point of both binaries; `allocator` is the global allocator the calling binary
/// installed.
pub fn main_with(allocator: Allocator) -> ExitCode {
    let cli = Cli::parse();
    let wanted = match &cli.command {
        None => Some(cli.run.allocator),
        Some(Command::Run(a)) => Some(a.allocator),
        // `tune` starts one `run` process per limit, each with `--allocator`.
        Some(Command::Tune(_) | Command::Report { .. } | Command::Crash(_) | Command::CrashChild(_) | Command::Bench(_)) => None,
    };
    if let Some(wanted) = wanted
        && wanted != allocator
    {
        return exit(run::exec_sibling(wanted));
    }
    let result = match &cli.command {
        None => run::run(&cli.run, allocator),
        Some(Command::Run(args)) => run::run(args, allocator),
        Some(Command::Tune(t)) => tune::tune(t),
        Some(Command::Report { dir }) => run::report(dir),
        Some(Command::Crash(c)) => crash::run_cli(c),
        Some(Command::CrashChild(c)) => crash::child_main(&c.dir, c.seed, c.start),
        Some(Command::Bench(b)) => bench::run_cli(b),
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

fn exit(code: anyhow::Result<u8>) -> ExitCode {
    match code {
        Ok(c) => ExitCode::from(c),
        Err(e) => {
            eprintln!("gritdb-soak: error: {e:#}");
            ExitCode::from(2)
        }
    }
}
