//! `gritdb-soak`'s command line: bad input exits with status 2 and a reason, never a panic
//! (from `breaker_trial5`; here so that cargo builds the binary under test,
//! `CARGO_BIN_EXE_gritdb-soak`, in whatever profile the tests run).

use std::path::Path;

/// Bad command lines of `gritdb-soak`: every one exits with code 2 and a one-line reason on
/// stderr that names the problem; none panics or prints a backtrace.
#[test]
fn soak_cli_bad_input_exits_2_with_a_reason_and_never_panics() {
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let garbage = w.join("garbage");
    std::fs::create_dir(&garbage).unwrap();
    std::fs::write(garbage.join("soak.csv"), "not,a,soak,csv\n1,2,3,4\n").unwrap();
    let header_only = w.join("header");
    std::fs::create_dir(&header_only).unwrap();
    std::fs::write(header_only.join("soak.csv"), "round,load\n").unwrap();
    let notpq = w.join("x.parquet");
    std::fs::write(&notpq, vec![7u8; 5000]).unwrap();
    let nonempty = w.join("nonempty");
    std::fs::create_dir(&nonempty).unwrap();
    std::fs::write(nonempty.join("f"), "x").unwrap();
    let data = w.join("data").to_string_lossy().into_owned();
    let out = w.join("out").to_string_lossy().into_owned();
    let s = |p: &Path| p.to_string_lossy().into_owned();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["--bogus".into()], "unexpected argument"),
        (vec!["--rounds".into(), "0".into()], "--rounds"),
        (vec!["--rounds".into(), "abc".into()], "invalid digit"),
        (vec!["--memory-limit".into(), "0".into()], "positive"),
        (vec!["--memory-limit".into(), "10XB".into()], "unknown unit"),
        (
            vec!["--memory-limit".into(), "1".into(), "--rounds".into(), "1".into(), "--data-dir".into(), data.clone(), "--out".into(), out.clone()],
            "below the minimum",
        ),
        (vec!["--scale".into(), "nan".into()], "positive"),
        (vec!["report".into(), s(&w.join("missing"))], "No such file"),
        (vec!["report".into(), s(&garbage)], "parsing"),
        (vec!["report".into(), s(&header_only)], "soak.csv"),
        (vec!["bench".into(), "--scale".into(), "-1".into()], "-1"),
        (vec!["bench".into(), "--scale".into(), "0".into()], "positive"),
        (vec!["bench".into(), "--runs".into(), "0".into(), "--scale".into(), "0.001".into()], "at least 1"),
        (vec!["bench".into(), "--parquet".into(), s(&notpq), "--runs".into(), "1".into()], "Parquet"),
        (vec!["bench".into(), "--parquet".into(), s(&w.join("none.parquet")), "--runs".into(), "1".into()], "No such file"),
        (vec!["crash".into(), "--kills".into(), "1".into(), "--dir".into(), s(&nonempty)], "not empty"),
        (vec!["tune".into(), "--limits".into(), "64MiB,zz".into()], "zz"),
    ];
    // A refused limit leaves an earlier run's data dir and log as they were.
    let kept = w.join("kept");
    std::fs::create_dir_all(kept.join("data/tables")).unwrap();
    std::fs::create_dir_all(kept.join("out")).unwrap();
    std::fs::write(kept.join("out/soak.log"), "earlier run").unwrap();
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_gritdb-soak"))
        .args(["--memory-limit", "1KB", "--data-dir"])
        .arg(kept.join("data"))
        .arg("--out")
        .arg(kept.join("out"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("below the minimum"), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(kept.join("data/tables").is_dir(), "the earlier data dir was wiped");
    assert_eq!(std::fs::read_to_string(kept.join("out/soak.log")).unwrap(), "earlier run");
    let mut wrong = Vec::new();
    for (args, needle) in &cases {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_gritdb-soak")).args(args).current_dir(w).env("RUST_BACKTRACE", "1").output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        let code = o.status.code();
        if code != Some(2) || !err.contains(needle) || err.contains("panicked") || err.contains("stack backtrace") {
            wrong.push(format!("{args:?}: exit {code:?}, stderr: {}", err.trim()));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// A `--data-dir` that is a regular file is refused (exit 2, the reason on stderr) before
/// anything is created: no `--out` directory (nor its parents) is left behind, and the file
/// is as it was. Before, the run failed but left an empty `--out` directory.
#[test]
fn soak_data_dir_a_file_creates_no_out_dir() {
    let work = tempfile::tempdir().unwrap();
    let file = work.path().join("data.db");
    std::fs::write(&file, "somebody's file").unwrap();
    let out = work.path().join("new/out");
    let err = refused_setup(&file, &out);
    assert!(err.contains("is not a directory") && err.contains("data.db"), "{err}");
    assert!(!work.path().join("new").exists(), "--out (or its parent) was created: {err}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "somebody's file");
    let names: Vec<_> = std::fs::read_dir(work.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["data.db"]);
}

/// A set-up that fails after `--out` was created (the data directory is in use by another
/// gritdb) removes the `--out` directory it created, and leaves the data directory alone.
#[test]
fn soak_setup_failure_removes_the_out_dir_it_created() {
    let work = tempfile::tempdir().unwrap();
    let data = work.path().join("data");
    let engine = gritdb::Engine::open(&data, gritdb::EngineConfig::default().memory_limit(64 << 20)).unwrap();
    let out = work.path().join("out");
    let err = refused_setup(&data, &out);
    assert!(err.contains("in use"), "{err}");
    assert!(!out.exists(), "--out was left behind: {err}");
    assert!(data.join("LOCK").is_file() && data.join("tables").is_dir(), "the data dir was wiped");
    engine.close().unwrap();
}

/// Runs one soak round with `--data-dir data --out out`, expecting the refusal of its set-up
/// (exit 2); returns its stderr.
fn refused_setup(data: &std::path::Path, out: &std::path::Path) -> String {
    let o =
        std::process::Command::new(env!("CARGO_BIN_EXE_gritdb-soak")).args(["--rounds", "1", "--data-dir"]).arg(data).arg("--out").arg(out).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{err}");
    err
}
