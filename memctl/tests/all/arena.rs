//! Row arenas over pool chunks.

use crate::{CHUNK, assert_all_zero, assert_categories_sum_to_used, ctl};
use gritdb_memctl::{Category, MemoryError, RowArena};

#[test]
fn rows_live_in_chunks_and_blocks_go_back_when_empty() {
    let ctl = ctl(64 << 20);
    let mut a = RowArena::new(&ctl, None);
    let rows: Vec<_> = (0..10_000u32)
        .map(|i| {
            let (r, b) = a.alloc(24).expect("fits");
            b[..4].copy_from_slice(&i.to_le_bytes());
            r
        })
        .collect();
    assert_eq!(a.live_rows(), 10_000);
    let chunks = (10_000 * 24usize).div_ceil(CHUNK);
    assert_eq!(a.block_count(), chunks);
    assert_eq!(a.bytes(), chunks * CHUNK);
    assert_eq!(ctl.category_bytes(Category::RowBlocks), chunks * CHUNK);
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(a.get(*r)[..4], (i as u32).to_le_bytes());
    }
    for r in &rows[..5_000] {
        a.free(*r);
    }
    assert!(a.block_count() < chunks, "whole blocks went back");
    assert_categories_sum_to_used(&ctl);
    drop(a);
    ctl.trim_free_chunks(0);
    assert_all_zero(&ctl);
}

#[test]
fn oversize_rows_get_exact_allocations() {
    let ctl = ctl(64 << 20);
    let t = ctl.register_table("wide");
    let mut a = RowArena::new(&ctl, Some(&t));
    let (r, b) = a.alloc(CHUNK + 1).expect("fits");
    b.fill(1);
    assert_eq!(r.len(), CHUNK + 1);
    assert_eq!(ctl.category_bytes(Category::RowBlocks), CHUNK + 1);
    assert_eq!(t.bytes(Category::RowBlocks), CHUNK + 1);
    a.free(r);
    assert_eq!(ctl.category_bytes(Category::RowBlocks), 0);
    drop(a);
    assert_all_zero(&ctl);
}

#[test]
fn prepared_rows_cannot_fail_and_failed_prepare_holds_nothing() {
    let ctl = ctl(8 * CHUNK);
    let mut a = RowArena::new(&ctl, None);
    let sizes = vec![1000usize; 300]; // ~5 chunks
    a.prepare(sizes.iter().copied()).expect("fits");
    let held = ctl.used();
    for s in &sizes {
        a.alloc(*s).expect("prepared");
    }
    assert_eq!(ctl.used(), held, "no new budget after prepare");
    let rows_before = ctl.category_bytes(Category::RowBlocks);
    let too_many = vec![CHUNK; 20];
    assert!(matches!(
        a.prepare(too_many),
        Err(MemoryError::Limit { .. })
    ));
    assert_eq!(
        ctl.category_bytes(Category::RowBlocks),
        rows_before,
        "no chunk stays acquired"
    );
    assert!(ctl.used() <= ctl.limit());
    a.release_spare();
    drop(a);
    ctl.trim_free_chunks(0);
    assert_all_zero(&ctl);
}

#[test]
fn zero_length_rows_do_not_count_their_chunk_twice() {
    let ctl = ctl(64 << 20);
    let mut a = RowArena::new(&ctl, None);
    let (r0, b0) = a.alloc(0).expect("fits");
    assert!(b0.is_empty() && r0.is_empty());
    a.alloc(0).expect("fits");
    a.alloc(10).expect("fits");
    assert_eq!(a.bytes(), CHUNK);
    assert_eq!(ctl.category_bytes(Category::RowBlocks), CHUNK);
    assert_eq!(a.live_rows(), 3);
    drop(a);
    ctl.trim_free_chunks(0);
    assert_all_zero(&ctl);
}
