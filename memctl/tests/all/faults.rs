//! The fault-injection hook (`--features fault-injection`): the Nth chunk acquisition or
//! reservation fails, on every path (thread cache hit, refill, new chunk, reservations,
//! arena block tables, batch blocks), as a typed error, and nothing leaks.

use crate::{CHUNK, assert_all_zero, assert_categories_sum_to_used, ctl};
use gritdb_memctl::{BatchBlock, Category, MemoryController, MemoryError, Reservation, RowArena, TableAccount};
use std::sync::Arc;

fn failures(ctl: &MemoryController, c: Category) -> u64 {
    ctl.report().categories.iter().find(|x| x.category == c).map_or(0, |x| x.failures)
}

#[test]
fn hook_fires_on_a_thread_cache_hit() {
    let ctl = ctl(64 << 20);
    drop(ctl.acquire_chunk(None).expect("fits")); // now in this thread's cache
    assert_eq!(ctl.pool_stats().thread_cached_chunks, 1);
    ctl.inject_failure_after(Some(0));
    assert_eq!(ctl.acquire_chunk(None).expect_err("injected"), MemoryError::Injected { category: Category::RowBlocks });
    assert_eq!(failures(&ctl, Category::RowBlocks), 1);
    assert_eq!(ctl.pool_stats().thread_cached_chunks, 1, "the cached chunk was not taken");
    let c = ctl.acquire_chunk(None).expect("the hook fires once");
    drop(c);
    assert_categories_sum_to_used(&ctl);
}

#[test]
fn hook_fires_on_refill_and_new_chunk_paths() {
    let ctl = ctl(64 << 20);
    // Central list holds chunks, this thread's cache is empty: the next take is a refill.
    std::thread::scope(|s| {
        s.spawn(|| {
            drop((0..40).map(|_| ctl.acquire_chunk(None).expect("fits")).collect::<Vec<_>>());
        })
        .join()
        .expect("filler");
    });
    assert!(ctl.pool_stats().central_chunks > 0);
    ctl.inject_failure_after(Some(0));
    assert!(matches!(ctl.acquire_chunk(None), Err(MemoryError::Injected { .. })));
    ctl.trim_free_chunks(0);
    // Nothing cached at all: the next take is a new chunk.
    ctl.inject_failure_after(Some(0));
    assert!(matches!(ctl.acquire_chunk(None), Err(MemoryError::Injected { .. })));
    assert_eq!(failures(&ctl, Category::RowBlocks), 2);
    assert_all_zero(&ctl);
}

#[test]
fn hook_counts_reservations_and_chunks_in_order() {
    let ctl = ctl(64 << 20);
    ctl.inject_failure_after(Some(2));
    let mut r = Reservation::new(&ctl, Category::KeyIndex, None);
    r.try_grow(10).expect("1st: passes");
    let c = ctl.acquire_chunk(None).expect("2nd: passes");
    assert_eq!(r.try_grow(10), Err(MemoryError::Injected { category: Category::KeyIndex }));
    r.try_grow(10).expect("4th: disarmed again");
    assert_eq!(failures(&ctl, Category::KeyIndex), 1);
    drop((r, c));
    ctl.inject_failure_after(None);
}

/// One run of a small ingest-like workload: arenas with normal and oversize rows, frees,
/// `prepare`/`release_spare`, batch blocks and reservations, across two threads.
fn workload(ctl: &Arc<MemoryController>, table: &TableAccount) -> Result<(), MemoryError> {
    let mut arena = RowArena::new(ctl, Some(table));
    let mut rows = Vec::new();
    for i in 0..3_000usize {
        let len = if i % 1_000 == 999 { CHUNK + 10 } else { 16 + i % 200 };
        let (r, b) = arena.alloc(len)?;
        b[0] = 1;
        rows.push(r);
    }
    for r in rows.iter().step_by(3) {
        arena.free(*r);
    }
    arena.prepare([100, 2_000, CHUNK * 2, 50_000])?;
    for s in [100, 2_000, CHUNK * 2, 50_000] {
        arena.alloc(s).expect("prepared rows cannot fail");
    }
    arena.release_spare();
    let block = BatchBlock::new(ctl, Category::BatchBlocks, Some(table), 100_000)?;
    let mut index = Reservation::new(ctl, Category::KeyIndex, Some(table));
    index.try_grow(4_096)?;
    index.try_resize(100_000)?;
    // The writer thread drops the sealed rows.
    std::thread::scope(|s| s.spawn(move || drop(arena)).join().expect("writer"));
    let mut other = RowArena::new(ctl, None);
    for _ in 0..500 {
        other.alloc(300)?;
    }
    drop((block, index, other));
    Ok(())
}

#[test]
fn walking_the_failure_point_across_a_workload_never_leaks() {
    let mut n = 0u64;
    loop {
        let ctl = ctl(64 << 20);
        let table = ctl.register_table("t");
        ctl.inject_failure_after(Some(n));
        let result = workload(&ctl, &table);
        ctl.inject_failure_after(None);
        // Whatever happened, everything was dropped: nothing may stay counted.
        assert_eq!(table.total_bytes(), 0, "n = {n}");
        assert_eq!(ctl.category_bytes(Category::RowBlocks), 0, "n = {n}");
        assert_categories_sum_to_used(&ctl);
        ctl.trim_free_chunks(0);
        assert_all_zero(&ctl);
        match result {
            Err(MemoryError::Injected { .. }) => {
                let failed: u64 = ctl.report().categories.iter().map(|c| c.failures).sum();
                assert_eq!(failed, 1, "n = {n}");
                // The controller stays usable: the same workload passes now.
                workload(&ctl, &table).expect("usable after an injected failure");
                drop(table);
                ctl.trim_free_chunks(0);
                assert_all_zero(&ctl);
            }
            Err(e) => panic!("n = {n}: unexpected error {e}"),
            Ok(()) => {
                assert!(n > 10, "the workload has more than a few hook points");
                break;
            }
        }
        n += 1;
    }
}
