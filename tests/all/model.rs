//! Model-based test: random programs of insert / upsert / update / delete / flush / reopen on
//! a composite-key table, checked against a `BTreeMap` after every step. Chunk sizes and flush
//! thresholds are swept so chunk growth, oversize rows, background flushes and deletes of
//! already-flushed rows all run.

use gritdb::{Engine, EngineConfig, Error, ScanOptions};
use gritdb_tests::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;

type Model = BTreeMap<(i64, i32), Row>;

fn random_row(rng: &mut StdRng) -> Row {
    let v = if rng.random_bool(0.1) { None } else { Some(rng.random_range(-1000..1000)) };
    let s = if rng.random_bool(0.1) {
        None
    } else {
        let len = if rng.random_bool(0.02) { rng.random_range(5000..9000) } else { rng.random_range(0..40) };
        Some("x".repeat(len) + &rng.random_range(0..100).to_string())
    };
    (v, s)
}

fn random_key(rng: &mut StdRng) -> (i64, i32) {
    (rng.random_range(0..300), rng.random_range(0..3))
}

fn open(dir: &std::path::Path, chunk: usize, flush_bytes: usize) -> Engine {
    Engine::open(dir, EngineConfig::default().memory_limit(64 << 20).chunk_size(chunk).table_flush_bytes(flush_bytes)).unwrap()
}

fn distinct_keys(rng: &mut StdRng, n: usize) -> Vec<(i64, i32)> {
    let mut keys: Vec<(i64, i32)> = (0..n).map(|_| random_key(rng)).collect();
    keys.sort_unstable();
    keys.dedup();
    keys
}

fn run_program(seed: u64, chunk: usize, flush_bytes: usize, steps: usize) {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut engine = open(dir.path(), chunk, flush_bytes);
    let mut table = engine.create_table("m", composite_schema(), &["k1", "k2"]).unwrap();
    let mut model = Model::new();
    for step in 0..steps {
        let op = rng.random_range(0..100);
        let ctx = format!("seed {seed} chunk {chunk} step {step} op {op}");
        match op {
            0..=29 => {
                let keys = {
                    let n = rng.random_range(1..20);
                    distinct_keys(&mut rng, n)
                };
                let rows: Vec<_> = keys.iter().map(|k| (*k, random_row(&mut rng))).collect();
                let clash = keys.iter().position(|k| model.contains_key(k));
                match (table.insert(&composite_batch(&rows)), clash) {
                    (Ok(n), None) => {
                        assert_eq!(n, rows.len(), "{ctx}");
                        model.extend(rows);
                    }
                    (Err(Error::KeyExists { row, .. }), Some(c)) => assert_eq!(row, c, "{ctx}"),
                    (r, c) => panic!("{ctx}: insert gave {r:?}, expected clash at {c:?}"),
                }
            }
            30..=49 => {
                let keys = {
                    let n = rng.random_range(1..20);
                    distinct_keys(&mut rng, n)
                };
                let rows: Vec<_> = keys.iter().map(|k| (*k, random_row(&mut rng))).collect();
                assert_eq!(table.upsert(&composite_batch(&rows)).unwrap(), rows.len(), "{ctx}");
                model.extend(rows);
            }
            50..=59 => {
                let keys = {
                    let n = rng.random_range(1..10);
                    distinct_keys(&mut rng, n)
                };
                let rows: Vec<_> = keys.iter().map(|k| (*k, random_row(&mut rng))).collect();
                let missing = keys.iter().position(|k| !model.contains_key(k));
                match (table.update(&composite_batch(&rows)), missing) {
                    (Ok(n), None) => {
                        assert_eq!(n, rows.len(), "{ctx}");
                        model.extend(rows);
                    }
                    (Err(Error::KeyNotFound { row, .. }), Some(m)) => assert_eq!(row, m, "{ctx}"),
                    (r, m) => panic!("{ctx}: update gave {r:?}, expected missing at {m:?}"),
                }
            }
            60..=84 => {
                // Deletes include repeats and absent keys.
                let keys: Vec<(i64, i32)> = (0..rng.random_range(1..30)).map(|_| random_key(&mut rng)).collect();
                let mut expect = 0;
                let mut seen = std::collections::HashSet::new();
                for k in &keys {
                    if seen.insert(*k) && model.remove(k).is_some() {
                        expect += 1;
                    }
                }
                assert_eq!(table.delete(&composite_keys(&keys)).unwrap(), expect, "{ctx}");
            }
            85..=94 => {
                table.flush().unwrap();
            }
            _ => {
                drop(table);
                engine.close().unwrap();
                engine = open(dir.path(), chunk, flush_bytes);
                table = engine.table("m").unwrap();
            }
        }
        if step % 10 == 9 || step + 1 == steps {
            let got = collect_composite(table.scan(ScanOptions::default().batch_rows(37)).unwrap());
            assert_eq!(got, model, "{ctx}: scan differs from model");
        }
    }
    // Flushed and reopened, everything is still there.
    table.flush().unwrap();
    drop(table);
    engine.close().unwrap();
    let engine = open(dir.path(), chunk, flush_bytes);
    let got = collect_composite(engine.table("m").unwrap().scan(ScanOptions::default()).unwrap());
    assert_eq!(got, model, "seed {seed}: after final reopen");
}

#[test]
fn random_programs_small_chunks_background_flush() {
    for seed in 0..4 {
        run_program(seed, 4 << 10, 8 << 10, 300);
    }
}

#[test]
fn random_programs_default_chunks() {
    for seed in 100..103 {
        run_program(seed, 64 << 10, 1 << 20, 300);
    }
}
