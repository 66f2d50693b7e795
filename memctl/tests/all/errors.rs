//! Error values and their text (pinned: users and the engine's error wrap read them).

use crate::{CHUNK, ctl};
use gritdb_memctl::{Category, ControllerConfig, MemoryController, MemoryError};

#[test]
fn limit_error_text_is_pinned() {
    let ctl = ctl(2 * CHUNK);
    let t = ctl.register_table("orders");
    let held: Vec<_> = (0..2).map(|_| ctl.acquire_chunk(Some(&t)).expect("fits")).collect();
    let err = ctl.acquire_chunk(Some(&t)).expect_err("third chunk is over the limit");
    assert_eq!(
        err.to_string(),
        "memory limit reached: requested 64.0 KiB for row_blocks, 128.0 KiB of 128.0 KiB in use; \
         top consumers: category:row_blocks 128.0 KiB, table:orders 128.0 KiB. \
         Raise the limit (EngineConfig::memory_limit / set_memory_limit), or flush and drop tables"
    );
    match err {
        MemoryError::Limit { requested, used, limit, category, top } => {
            assert_eq!((requested, used, limit, category), (CHUNK, 2 * CHUNK, 2 * CHUNK, Category::RowBlocks));
            assert_eq!(top.len(), 2);
        }
        other => panic!("expected Limit, got {other:?}"),
    }
    drop(held);
}

#[test]
fn limit_errors_are_counted_as_failures_of_their_category() {
    let ctl = ctl(2 * CHUNK);
    let _a = ctl.acquire_chunk(None).expect("fits");
    let _b = ctl.acquire_chunk(None).expect("fits");
    for _ in 0..3 {
        assert!(matches!(ctl.acquire_chunk(None), Err(MemoryError::Limit { .. })));
    }
    assert!(ctl.try_reserve(Category::KeyIndex, None, 1).is_err());
    let r = ctl.report();
    let failures = |c: Category| r.categories.iter().find(|x| x.category == c).map(|x| x.failures);
    assert_eq!(failures(Category::RowBlocks), Some(3));
    assert_eq!(failures(Category::KeyIndex), Some(1));
    assert_eq!(failures(Category::Metadata), Some(0));
}

#[test]
fn config_errors_say_what_is_wrong() {
    let small =
        MemoryController::new(ControllerConfig { memory_limit: Some(CHUNK), chunk_size: CHUNK, ..ControllerConfig::default() }).expect_err("below two chunks");
    assert_eq!(small.to_string(), "invalid memory configuration: memory limit of 65536 B is below the minimum of two chunks (131072 B)");
    let odd = MemoryController::new(ControllerConfig { chunk_size: 3000, ..ControllerConfig::default() }).expect_err("not a power of two");
    assert!(odd.to_string().contains("power of two"), "{odd}");
    let c = ctl(4 * CHUNK);
    assert!(matches!(c.set_limit(CHUNK), Err(MemoryError::Config(_))));
    assert_eq!(c.limit(), 4 * CHUNK, "a refused limit leaves the old one");
}
