use gritdb::{Engine, EngineConfig, ScanOptions};
use gritdb_tests::*;

#[test]
fn insert_flush_scan_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
    let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
    let rows: Vec<_> = (0..1000).map(|i| ((i, (i % 7) as i32), (Some(i * 10), Some(format!("s{i}"))))).collect();
    assert_eq!(t.insert(&composite_batch(&rows)).unwrap(), 1000);
    let got = collect_composite(t.scan(ScanOptions::default()).unwrap());
    assert_eq!(got.len(), 1000);
    assert_eq!(got[&(5, 5)], (Some(50), Some("s5".into())));
    t.flush().unwrap();
    assert_eq!(t.delete(&composite_keys(&[(5, 5), (6, 6), (99999, 1)])).unwrap(), 2);
    let up: Vec<_> = (0..5).map(|i| ((i, (i % 7) as i32), (None, Some("u".into())))).collect();
    t.upsert(&composite_batch(&up)).unwrap();
    let got = collect_composite(t.scan(ScanOptions::default()).unwrap());
    assert_eq!(got.len(), 998);
    assert_eq!(got[&(1, 1)], (None, Some("u".into())));
    t.flush().unwrap();
    drop(t);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
    let t = engine.table("t").unwrap();
    let got = collect_composite(t.scan(ScanOptions::default()).unwrap());
    assert_eq!(got.len(), 998);
    assert!(!got.contains_key(&(5, 5)));
    assert_eq!(got[&(1, 1)], (None, Some("u".into())));
    assert_eq!(got[&(900, 4)], (Some(9000), Some("s900".into())));
}
