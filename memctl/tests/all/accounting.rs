//! Categories, peaks, reservations, tables and the report.

use crate::{CHUNK, assert_all_zero, assert_categories_sum_to_used, ctl};
use gritdb_memctl::{BatchBlock, Category, Reservation};

#[test]
fn reservations_count_per_category_and_table_and_release_on_drop() {
    let ctl = ctl(64 << 20);
    let t = ctl.register_table("t");
    let mut r = Reservation::new(&ctl, Category::KeyIndex, Some(&t));
    r.try_grow(1000).expect("fits");
    r.try_resize(600).expect("shrink");
    assert_eq!(r.size(), 600);
    assert_eq!(ctl.category_bytes(Category::KeyIndex), 600);
    assert_eq!(t.bytes(Category::KeyIndex), 600);
    assert_eq!(ctl.category_peak(Category::KeyIndex), 1000);
    let b = BatchBlock::new(&ctl, Category::BatchBlocks, Some(&t), 100).expect("fits");
    assert_eq!(b.len(), 112, "rounded up to 16");
    assert_eq!(ctl.category_bytes(Category::BatchBlocks), 112);
    assert_eq!(t.total_bytes(), 712);
    assert_categories_sum_to_used(&ctl);
    drop((r, b));
    assert_eq!(t.total_bytes(), 0);
    assert_all_zero(&ctl);
}

#[test]
fn pool_category_peaks_follow_the_high_water_mark() {
    let ctl = ctl(64 << 20);
    let held: Vec<_> = (0..20).map(|_| ctl.acquire_chunk(None).expect("fits")).collect();
    assert_eq!(ctl.category_peak(Category::RowBlocks), 20 * CHUNK);
    drop(held);
    assert_eq!(ctl.category_bytes(Category::RowBlocks), 0);
    assert_eq!(ctl.category_peak(Category::RowBlocks), 20 * CHUNK);
    assert_eq!(ctl.category_peak(Category::FreeChunks), 20 * CHUNK);
    assert_eq!(ctl.peak(), 20 * CHUNK);
    ctl.reset_peaks();
    assert_eq!(ctl.category_peak(Category::RowBlocks), 0);
    assert_eq!(ctl.category_peak(Category::FreeChunks), 20 * CHUNK);
    assert_eq!(ctl.peak(), 20 * CHUNK, "free chunks are still held");
    ctl.trim_free_chunks(0);
    ctl.reset_peaks();
    assert_eq!(ctl.peak(), 0);
    assert_eq!(ctl.category_peak(Category::FreeChunks), 0);
}

#[test]
fn report_matches_the_exact_figures() {
    let ctl = ctl(64 << 20);
    let t = ctl.register_table("orders");
    let held: Vec<_> = (0..5).map(|_| ctl.acquire_chunk(Some(&t)).expect("fits")).collect();
    drop(ctl.acquire_chunk(None).expect("fits")); // one into this thread's cache
    let r = ctl.report();
    assert_eq!(r.used, ctl.used());
    assert_eq!(r.category(Category::RowBlocks), 5 * CHUNK);
    assert_eq!(r.category(Category::FreeChunks), CHUNK);
    let row = r.categories.iter().find(|c| c.category == Category::RowBlocks).expect("row_blocks");
    assert_eq!((row.allocs, row.frees), (6, 1));
    let free = r.categories.iter().find(|c| c.category == Category::FreeChunks).expect("free_chunks");
    assert_eq!(free.allocs - free.frees, 1);
    assert_eq!(r.tables.len(), 1);
    assert_eq!(r.tables[0].bytes, 5 * CHUNK);
    let text = r.to_string();
    assert!(text.contains("row_blocks"), "{text}");
    assert!(text.contains("table orders"), "{text}");
    drop(held);
}

#[test]
fn force_reserve_counts_truthfully_past_the_limit_and_releases_to_zero() {
    let ctl = ctl(4 * CHUNK);
    assert!(ctl.force_reserve(Category::Query, None, CHUNK), "fits under the limit");
    assert_eq!(ctl.category_bytes(Category::Query), CHUNK);
    let failures = |ctl: &gritdb_memctl::MemoryController| {
        let r = ctl.report();
        r.categories.iter().find(|c| c.category == Category::Query).map(|c| c.failures)
    };
    assert_eq!(failures(&ctl), Some(0));
    // 1 + 4 chunks: refused by try_reserve, counted anyway (already allocated by the caller).
    assert!(!ctl.force_reserve(Category::Query, None, 4 * CHUNK));
    assert_eq!(ctl.used(), 5 * CHUNK);
    assert_eq!(ctl.category_bytes(Category::Query), 5 * CHUNK);
    assert_eq!(ctl.peak(), 5 * CHUNK);
    assert_eq!(failures(&ctl), Some(1));
    assert!(ctl.try_reserve(Category::Query, None, 1).is_err(), "over the limit: nothing more");
    ctl.release(Category::Query, None, 5 * CHUNK);
    assert_eq!(ctl.category_bytes(Category::Query), 0);
    assert_all_zero(&ctl);
}

/// `absorb` moves bytes between two reservations of one category and table without a moment
/// counted twice (the limit is exactly what both hold: a double count would be refused); and
/// between different categories or tables it moves the counts to the absorbing side.
#[test]
fn absorb_moves_bytes_without_counting_them_twice() {
    let c = ctl(4 * CHUNK);
    let t = c.register_table("t");
    let u = c.register_table("u");
    let mut index = Reservation::new(&c, Category::KeyIndex, Some(&t));
    index.try_grow(CHUNK).unwrap();
    let mut built = Reservation::new(&c, Category::KeyIndex, Some(&t));
    built.try_grow(3 * CHUNK).unwrap();
    assert_eq!(c.used(), 4 * CHUNK);
    index.absorb(built);
    assert_eq!((index.size(), c.used(), t.bytes(Category::KeyIndex)), (4 * CHUNK, 4 * CHUNK, 4 * CHUNK));
    assert_eq!(c.category_bytes(Category::KeyIndex), 4 * CHUNK);
    index.shrink(3 * CHUNK);
    // Another table and category: the counts move over to `index`'s.
    let mut other = Reservation::new(&c, Category::WriteBuffers, Some(&u));
    other.try_grow(2 * CHUNK).unwrap();
    index.absorb(other);
    assert_eq!(index.size(), 3 * CHUNK);
    assert_eq!((t.bytes(Category::KeyIndex), u.bytes(Category::WriteBuffers)), (3 * CHUNK, 0));
    assert_eq!((c.category_bytes(Category::KeyIndex), c.category_bytes(Category::WriteBuffers)), (3 * CHUNK, 0));
    assert_eq!(c.used(), 3 * CHUNK);
    drop(index);
    assert_eq!(c.used(), 0);
    assert_categories_sum_to_used(&c);
}

/// `Reservation::force_resize` counts growth past the limit (memory that already exists), says
/// whether it fitted, shrinks like `try_resize`, and gives everything back on drop.
#[test]
fn force_resize_counts_past_the_limit_and_shrinks_to_zero() {
    let ctl = ctl(4 * CHUNK);
    let mut r = Reservation::new(&ctl, Category::WriteBuffers, None);
    assert!(r.force_resize(2 * CHUNK), "fits under the limit");
    assert!(!r.force_resize(6 * CHUNK), "past the limit, counted anyway");
    assert_eq!((r.size(), ctl.used(), ctl.category_bytes(Category::WriteBuffers)), (6 * CHUNK, 6 * CHUNK, 6 * CHUNK));
    assert!(r.force_resize(CHUNK), "shrinking always fits");
    assert_eq!(ctl.category_bytes(Category::WriteBuffers), CHUNK);
    assert_eq!(ctl.category_peak(Category::WriteBuffers), 6 * CHUNK);
    drop(r);
    assert_all_zero(&ctl);
}
