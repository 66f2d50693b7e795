//! Crash test: SIGKILL a child running a keyed workload at random moments; after every kill,
//! reopen and compare with the model (no acknowledged row missing, no deleted row back, no
//! duplicate key, no temp file visible).

use gritdb_tests::crash::{child_main, run_parent};
use std::process::Command;

/// Child entry point: only runs when spawned by `sigkill_at_random_moments` (ignored
/// otherwise, so a plain `cargo test` never runs it directly).
#[test]
#[ignore = "child process of the crash test"]
fn crash_child() {
    let (Ok(dir), Ok(seed), Ok(start)) = (std::env::var("GRITDB_CRASH_DIR"), std::env::var("GRITDB_CRASH_SEED"), std::env::var("GRITDB_CRASH_START")) else {
        return;
    };
    child_main(dir.as_ref(), seed.parse().unwrap(), start.parse().unwrap());
}

#[test]
fn sigkill_at_random_moments() {
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    // GRITDB_CRASH_KILLS / GRITDB_CRASH_SEED_BASE run it longer (e.g. 1000 kills).
    let kills: usize = std::env::var("GRITDB_CRASH_KILLS").ok().and_then(|k| k.parse().ok()).unwrap_or(12);
    let seed: u64 = std::env::var("GRITDB_CRASH_SEED_BASE").ok().and_then(|k| k.parse().ok()).unwrap_or(7);
    let report = run_parent(dir.path(), seed, kills, |start| {
        let mut c = Command::new(&exe);
        c.args(["--ignored", "--exact", "crash::crash_child", "--nocapture", "--test-threads=1"])
            .env("GRITDB_CRASH_DIR", dir.path())
            .env("GRITDB_CRASH_SEED", seed.to_string())
            .env("GRITDB_CRASH_START", start.to_string());
        c
    })
    .unwrap();
    eprintln!("{report:?}");
    assert_eq!(report.kills, kills);
    assert!(report.acknowledged >= kills * 5, "{report:?}");
    assert!(report.clean(), "{report:?}");
}
