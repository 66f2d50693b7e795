//! The API works from plain threads and from inside a tokio multi-thread runtime.

use gritdb::{Engine, EngineConfig, ScanOptions};
use gritdb_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn works_inside_a_tokio_runtime() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20).table_flush_bytes(64 << 10)).unwrap();
    let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
    for b in 0..20 {
        let rows: Vec<_> = (0..500).map(|i| ((b * 500 + i, 0), (Some(i), Some("x".repeat(20))))).collect();
        t.insert(&composite_batch(&rows)).unwrap();
    }
    // Also from a blocking task of the caller's runtime (the caller's own runtime, not the
    // engine's: the clippy.toml rule is about the library).
    let t2 = t.clone();
    #[allow(clippy::disallowed_methods)]
    tokio::task::spawn_blocking(move || t2.flush().unwrap()).await.unwrap();
    assert_eq!(collect_composite(t.scan(ScanOptions::default()).unwrap()).len(), 10_000);
    drop(t);
    // Dropping the engine inside an async context must not panic.
    drop(engine);
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
    assert_eq!(engine.table("t").unwrap().row_count().unwrap(), 10_000);
    engine.close().unwrap();
}

#[test]
fn works_from_many_plain_threads() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20).table_flush_bytes(32 << 10)).unwrap();
    let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
    std::thread::scope(|s| {
        for th in 0..4i64 {
            let t = t.clone();
            s.spawn(move || {
                for b in 0..10 {
                    let rows: Vec<_> = (0..200).map(|i| ((th * 1_000_000 + b * 1000 + i, 1), (Some(i), None))).collect();
                    t.insert(&composite_batch(&rows)).unwrap();
                }
            });
        }
    });
    assert_eq!(t.row_count().unwrap(), 8000);
    t.flush().unwrap();
    assert!(t.stats().unwrap().files >= 1);
    assert_eq!(t.row_count().unwrap(), 8000);
}
