//! Chunk pool and row arena benchmarks (issue 3). Numbers and the command are in
//! `docs/performance.md`, section "memctl chunk pool".
//!
//! - `chunk_pool_burst<b>/<variant>/<n>t`: each of n threads repeatedly acquires a burst of
//!   b chunks ([`BURSTS`]; writing one byte in each) and releases them; throughput counts
//!   acquire+release pairs over all threads. Variants: `thread_cache` (this pool),
//!   `central_mutex` (same pool, `thread_cache: false`: every operation takes the central
//!   mutex), `global_alloc` (the global allocator's alloc/dealloc of the same size; the bench
//!   binary uses the system allocator).
//! - `row_alloc/<variant>`: 24-byte rows bump-allocated and written, [`ROWS`] per iteration, in
//!   a `RowArena` (fresh per iteration, dropped after, its chunks going back to the pool) and
//!   in a `bumpalo::Bump` (reset per iteration).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gritdb_memctl::{ControllerConfig, MemoryController, PoolChunk, RowArena};
use std::alloc::{Layout, alloc, dealloc};
use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Chunks held at once by each thread per iteration: 8 stays within one thread cache (the
/// fast path only); 64 is twice a thread cache, so every iteration refills from and flushes
/// to the central list in batches of 16.
const BURSTS: [usize; 2] = [8, 64];
/// Rows per iteration of the row benchmarks.
const ROWS: usize = 100_000;
const ROW: usize = 24;
const CHUNK: usize = gritdb_memctl::DEFAULT_CHUNK_SIZE;

fn controller(thread_cache: bool) -> Arc<MemoryController> {
    MemoryController::new(ControllerConfig { memory_limit: Some(1 << 30), thread_cache, ..ControllerConfig::default() }).expect("valid config")
}

/// Runs `work(iters)` on `threads` threads started together; returns the wall time from the
/// common start to the last thread's end.
fn run_threads(threads: usize, iters: u64, work: &(dyn Fn(u64) + Sync)) -> Duration {
    let barrier = Barrier::new(threads + 1);
    let start = std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                barrier.wait();
                work(iters);
            });
        }
        barrier.wait();
        Instant::now()
    });
    start.elapsed()
}

fn pool_burst(ctl: &MemoryController, burst: usize, iters: u64) {
    let mut held: Vec<PoolChunk<'_>> = Vec::with_capacity(burst);
    for _ in 0..iters {
        for i in 0..burst {
            let mut c = ctl.acquire_chunk(None).expect("under the limit");
            c.bytes_mut()[0] = i as u8;
            held.push(c);
        }
        black_box(&held);
        held.clear();
    }
}

fn alloc_burst(burst: usize, iters: u64) {
    let layout = Layout::from_size_align(CHUNK, 16).expect("valid layout");
    let mut held: Vec<*mut u8> = Vec::with_capacity(burst);
    for _ in 0..iters {
        for i in 0..burst {
            // SAFETY: `layout` has a non-zero size.
            let p = unsafe { alloc(layout) };
            assert!(!p.is_null(), "allocation failed");
            // SAFETY: `p` points to CHUNK writable bytes just allocated.
            unsafe { p.write(i as u8) };
            held.push(p);
        }
        black_box(&held);
        for p in held.drain(..) {
            // SAFETY: `p` was allocated above with the same layout and is freed once.
            unsafe { dealloc(p, layout) };
        }
    }
}

fn chunk_pool(c: &mut Criterion) {
    for burst in BURSTS {
        let mut g = c.benchmark_group(format!("chunk_pool_burst{burst}"));
        g.measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
        for threads in [1usize, 2, 4] {
            g.throughput(Throughput::Elements((threads * burst) as u64));
            let cached = controller(true);
            g.bench_function(BenchmarkId::new("thread_cache", format!("{threads}t")), |b| {
                b.iter_custom(|iters| run_threads(threads, iters, &|n| pool_burst(&cached, burst, n)));
            });
            let central = controller(false);
            g.bench_function(BenchmarkId::new("central_mutex", format!("{threads}t")), |b| {
                b.iter_custom(|iters| run_threads(threads, iters, &|n| pool_burst(&central, burst, n)));
            });
            g.bench_function(BenchmarkId::new("global_alloc", format!("{threads}t")), |b| {
                b.iter_custom(|iters| run_threads(threads, iters, &|n| alloc_burst(burst, n)));
            });
        }
        g.finish();
    }
}

fn row_alloc(c: &mut Criterion) {
    let mut g = c.benchmark_group("row_alloc");
    g.measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    g.throughput(Throughput::Elements(ROWS as u64));
    let row = [7u8; ROW];
    let ctl = controller(true);
    g.bench_function("row_arena_24B", |b| {
        b.iter(|| {
            let mut arena = RowArena::new(&ctl, None);
            for _ in 0..ROWS {
                let (r, bytes) = arena.alloc(ROW).expect("under the limit");
                bytes.copy_from_slice(&row);
                black_box(r);
            }
            arena
        });
    });
    let mut bump = bumpalo::Bump::new();
    g.bench_function("bumpalo_24B", |b| {
        b.iter(|| {
            for _ in 0..ROWS {
                black_box(bump.alloc_slice_copy(&row));
            }
            bump.reset();
        });
    });
    g.finish();
}

criterion_group!(benches, chunk_pool, row_alloc);
criterion_main!(benches);
