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
    assert!(matches!(a.prepare(too_many), Err(MemoryError::Limit { .. })));
    assert_eq!(ctl.category_bytes(Category::RowBlocks), rows_before, "no chunk stays acquired");
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

/// A refused write rolls its rows back: after `rollback(mark, rows)` the arena holds exactly
/// the blocks, bytes and bump offset it held at `mark` (rows that spilled into new chunks and
/// an oversize row included), the table's counters are back, and the next row lands right
/// after the last row kept.
#[test]
fn rollback_returns_the_arena_to_its_mark_chunk_for_chunk() {
    let ctl = ctl(64 << 20);
    let t = ctl.register_table("t");
    let mut a = RowArena::new(&ctl, Some(&t));
    let kept: Vec<_> = (0..100u32).map(|_| a.alloc(100).expect("fits").0).collect();
    let (blocks, bytes, table_rows) = (a.block_count(), a.bytes(), t.bytes(Category::RowBlocks));
    assert_eq!((blocks, bytes), (1, CHUNK));
    let (mark, meta) = (a.mark(), ctl.category_bytes(Category::Metadata));
    // Fill the rest of the active chunk, spill into three more, and one oversize row.
    let mut refused: Vec<_> = (0..(3 * CHUNK / 100 + 500)).map(|_| a.alloc(100).expect("fits").0).collect();
    refused.push(a.alloc(CHUNK + 10).expect("fits").0);
    assert_eq!(a.block_count(), 4 + 1, "four chunks (655 rows of 100 bytes each) and the oversize row");
    a.rollback(mark, &refused);
    assert_eq!((a.block_count(), a.bytes(), a.live_rows()), (blocks, bytes, 100));
    assert_eq!(t.bytes(Category::RowBlocks), table_rows, "the table's row blocks are back");
    assert_eq!(ctl.category_bytes(Category::Metadata), meta, "the block table is back");
    assert_eq!(a.mark(), mark);
    // The next row goes right after the kept ones, in the same chunk.
    let (next, buf) = a.alloc(100).expect("fits");
    buf.fill(0xab);
    assert_eq!((next.at().block(), a.block_count()), (kept[99].at().block(), 1));
    assert_eq!(a.get_from(kept[99].at())[100..200], [0xab; 100]);
    // A rollback of nothing changes nothing; one inside the active chunk rewinds it.
    let mark = a.mark();
    a.rollback(mark, &[]);
    assert_eq!(a.mark(), mark);
    let r = a.alloc(50).expect("fits").0;
    a.rollback(mark, &[r]);
    assert_eq!((a.mark(), a.block_count()), (mark, 1));
    drop(a);
    ctl.trim_free_chunks(0);
    assert_all_zero(&ctl);
}

/// A write refused after `prepare` but before any row was allocated (its WAL append failed),
/// on a fresh arena: the mark taken before `prepare`, `rollback` with no rows and
/// `release_spare` leave no block, no block table and no bytes in any category.
#[test]
fn rollback_after_prepare_gives_back_the_block_table() {
    let ctl = ctl(64 << 20);
    let t = ctl.register_table("t");
    let mut a = RowArena::new(&ctl, Some(&t));
    let mark = a.mark();
    a.prepare(std::iter::repeat_n(100usize, 2_000)).expect("fits");
    assert!(ctl.category_bytes(Category::Metadata) > 0, "prepare made room in the block table");
    a.rollback(mark, &[]);
    a.release_spare();
    assert_eq!((a.block_count(), a.bytes(), a.mark()), (0, 0, mark));
    assert_eq!((ctl.category_bytes(Category::Metadata), t.bytes(Category::Metadata), t.bytes(Category::RowBlocks)), (0, 0, 0));
    // The same, after rows that stay: the table returns to its size with them.
    let kept: Vec<_> = (0..700).map(|_| a.alloc(100).expect("fits").0).collect();
    let (mark, meta) = (a.mark(), ctl.category_bytes(Category::Metadata));
    a.prepare(std::iter::repeat_n(100usize, 5_000)).expect("fits");
    let refused: Vec<_> = (0..5_000).map(|_| a.alloc(100).expect("prepared").0).collect();
    assert!(ctl.category_bytes(Category::Metadata) > meta);
    a.rollback(mark, &refused);
    a.release_spare();
    assert_eq!((a.mark(), a.live_rows(), ctl.category_bytes(Category::Metadata)), (mark, kept.len(), meta));
    drop(a);
    ctl.trim_free_chunks(0);
    assert_all_zero(&ctl);
}
