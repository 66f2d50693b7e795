//! A seeded random program of pool operations checked against a model after every step
//! (bumpalo's quickcheck style, without a dependency): chunk counts per holder, the limit,
//! the share of cached chunks, and exact category sums. Swept over chunk sizes and limits.

use gritdb_memctl::{Category, ControllerConfig, MemoryController, MemoryError, PoolChunk, RowArena};
use std::time::Duration;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn run(seed: u64, chunk_size: usize, limit_chunks: usize, thread_cache: bool) {
    let ctl = MemoryController::new(ControllerConfig {
        memory_limit: Some(limit_chunks * chunk_size),
        chunk_size,
        thread_cache,
        thread_cache_chunks: 1 + (seed % 40) as usize,
        batch_chunks: 1 + (seed % 20) as usize,
        ..ControllerConfig::default()
    })
    .expect("valid");
    let mut rng = Rng(seed | 1);
    let mut held: Vec<PoolChunk<'_>> = Vec::new();
    let mut arenas: Vec<(RowArena, Vec<gritdb_memctl::RowRef>)> = (0..3).map(|_| (RowArena::new(&ctl, None), Vec::new())).collect();
    for step in 0..2_000 {
        match rng.below(10) {
            0..=2 => match ctl.acquire_chunk(None) {
                Ok(c) => held.push(c),
                Err(MemoryError::Limit { .. }) => {}
                Err(e) => panic!("{e}"),
            },
            3 | 4 => {
                if !held.is_empty() {
                    let i = rng.below(held.len() as u64) as usize;
                    held.swap_remove(i);
                }
            }
            5 | 6 => {
                let (a, rows) = &mut arenas[rng.below(3) as usize];
                let len = 1 + rng.below(chunk_size as u64 / 3) as usize;
                if let Ok((r, _)) = a.alloc(len) {
                    rows.push(r);
                }
            }
            7 => {
                let (a, rows) = &mut arenas[rng.below(3) as usize];
                if !rows.is_empty() {
                    let i = rng.below(rows.len() as u64) as usize;
                    a.free(rows.swap_remove(i));
                }
            }
            8 => {
                let keep = rng.below(4) as usize * chunk_size;
                ctl.trim_free_chunks(keep);
                assert!(ctl.category_bytes(Category::FreeChunks) <= keep, "step {step}");
            }
            _ => {
                let l = (2 + rng.below(2 * limit_chunks as u64) as usize) * chunk_size;
                ctl.set_limit(l).expect("at least two chunks");
                if rng.below(4) == 0 {
                    ctl.trim_idle(Duration::ZERO);
                }
            }
        }
        // The model: every holder's chunks, exactly.
        let arena_bytes: usize = arenas.iter().map(|(a, _)| a.bytes()).sum();
        assert_eq!(ctl.category_bytes(Category::RowBlocks), held.len() * chunk_size + arena_bytes, "step {step}");
        let sum: usize = Category::ALL.iter().map(|c| ctl.category_bytes(*c)).sum();
        assert_eq!(sum, ctl.used(), "step {step}");
        let st = ctl.pool_stats();
        assert_eq!(ctl.category_bytes(Category::FreeChunks), (st.thread_cached_chunks + st.central_chunks) * chunk_size);
        assert!(ctl.category_bytes(Category::FreeChunks) <= ctl.limit() / 8, "step {step}: cached chunks above the share");
        if ctl.used() > ctl.limit() {
            // Only right after the limit was lowered below what the holders own.
            assert_eq!(ctl.category_bytes(Category::FreeChunks), 0, "step {step}");
        }
        assert!(ctl.category_peak(Category::RowBlocks) >= ctl.category_bytes(Category::RowBlocks));
    }
    drop(held);
    drop(arenas);
    ctl.trim_free_chunks(0);
    for c in Category::ALL {
        assert_eq!(ctl.category_bytes(c), 0, "seed {seed}: {c}");
    }
}

#[test]
fn random_programs_match_the_model() {
    for seed in 1..=12u64 {
        for (chunk, limit_chunks) in [(4 << 10, 40), (64 << 10, 200), (1 << 20, 12)] {
            run(seed * 7919, chunk, limit_chunks, seed % 3 != 0);
        }
    }
}
