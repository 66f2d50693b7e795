//! Shared helpers for gritdb's integration tests: the composite-key schema, batch builders
//! and the crash workload live in `gritdb_soak::crash` (the soak's `crash` subcommand uses
//! them too) and are re-exported here.

pub use gritdb_soak::crash::{Row, collect_composite, composite_batch, composite_keys, composite_schema};

/// The crash-consistency workload (see `gritdb_soak::crash`).
pub mod crash {
    pub use gritdb_soak::crash::*;
}

/// `SplitMix64`'s output function (Steele, Lea and Flood, "Fast splittable pseudorandom number
/// generators", 2014): a deterministic, well-mixed `u64` from any `u64`, for tests that need
/// reproducible pseudo-random keys, values and orders without a seeded RNG.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// `len` characters drawn from the `count` consecutive ASCII characters from `first`, by
/// Marsaglia's xorshift64 (13, 7, 17; "Xorshift RNGs", 2003) from `seed | 1`: text that LZ4
/// and dictionaries do not shrink, the same for the same arguments.
pub fn random_text(len: usize, seed: u64, first: u8, count: u8) -> String {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (first + (x % u64::from(count)) as u8) as char
        })
        .collect()
}

/// One thread's scheduling as Linux shows it in `/proc/<pid>/task/<tid>/stat` (`proc(5)`:
/// field 1 the thread id, field 2 the name in parentheses, field 19 the nice value, field 41
/// the policy: 0 `SCHED_OTHER`, 3 `SCHED_BATCH`, 5 `SCHED_IDLE`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadSched {
    /// Thread id.
    pub tid: u32,
    /// Thread name (`comm`).
    pub name: String,
    /// Scheduling policy.
    pub policy: u32,
    /// Nice value.
    pub nice: i32,
}

/// Parses one `stat` file's text (see [`ThreadSched`]). The name may hold spaces and
/// parentheses, so the fields after it are found from the last `)`.
pub fn parse_thread_stat(stat: &str) -> ThreadSched {
    let (open, close) = (stat.find('(').expect("stat has a name"), stat.rfind(')').expect("stat has a name"));
    // Fields after the name start at field 3 (state).
    let f: Vec<&str> = stat[close + 1..].split_whitespace().collect();
    ThreadSched {
        tid: stat[..open].trim().parse().expect("stat field 1 is the thread id"),
        name: stat[open + 1..close].to_owned(),
        policy: f[41 - 3].parse().expect("stat field 41 is the policy"),
        nice: f[19 - 3].parse().expect("stat field 19 is the nice value"),
    }
}

/// The calling thread's scheduling (`/proc/thread-self/stat`).
pub fn current_thread_sched() -> ThreadSched {
    parse_thread_stat(&std::fs::read_to_string("/proc/thread-self/stat").expect("read /proc/thread-self/stat"))
}

/// Every thread of this process (`/proc/self/task/*/stat`); a thread that ends between the
/// listing and the read is left out.
pub fn process_threads() -> Vec<ThreadSched> {
    std::fs::read_dir("/proc/self/task")
        .expect("list /proc/self/task")
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .map(|s| parse_thread_stat(&s))
        .collect()
}

/// Rewrites a table's `manifest.json` by hand, as an operator or a broken tool would, and
/// seals it again with the checksum line the engine writes (`gritdb_storage::Manifest`: the
/// first field line, the file's second, `  "manifest_crc32": N,` holds the CRC-32 of every
/// byte after it), so a test
/// reaches the checks behind the checksum: `edit` gets and returns the JSON without that
/// line (starting `{\n`).
///
/// # Panics
/// When the file cannot be read or written, or `edit` returns text not starting `{\n`.
pub fn edit_manifest(path: &std::path::Path, edit: impl FnOnce(&str) -> String) {
    let text = std::fs::read_to_string(path).expect("read manifest");
    let plain = match text.strip_prefix("{\n  \"manifest_crc32\": ") {
        Some(rest) => format!("{{\n{}", &rest[rest.find('\n').expect("checksum line ends") + 1..]),
        None => text,
    };
    let edited = edit(&plain);
    let body = edited.strip_prefix("{\n").expect("edited manifest starts with {\\n");
    let sealed = format!("{{\n  \"manifest_crc32\": {},\n{body}", crc32fast::hash(body.as_bytes()));
    std::fs::write(path, sealed).expect("write manifest");
}

/// Accounted bytes per category once no query runs and no scan is open, with the cached free
/// chunks given back. A query or stream that was dropped or failed stops a moment later:
/// `DataFusion`'s aborted tasks and a scan's blocking producer drop what they hold at their
/// next step, and a producer between two files holds no `scan_buffers` for that instant. So
/// `query` and `scan_buffers` must read 0 for 100 ms in a row (20 reads, 5 ms apart), not once:
/// a single 0 read between a producer's files was followed by its next reader's 8,235 bytes
/// (`breaker_trial5`, one full run in two on a loaded machine). Panics after 15 s.
pub fn settled(engine: &gritdb::Engine) -> Vec<(gritdb::memory::Category, usize)> {
    use gritdb::memory::Category;
    use std::time::{Duration, Instant};
    let start = Instant::now();
    let ctl = engine.memory();
    let mut zero_reads = 0;
    while zero_reads < 20 {
        if ctl.category_bytes(Category::Query) == 0 && ctl.category_bytes(Category::ScanBuffers) == 0 {
            zero_reads += 1;
        } else {
            zero_reads = 0;
        }
        assert!(start.elapsed() < Duration::from_secs(15), "query or scan memory not released: {}", engine.memory_report());
        std::thread::sleep(Duration::from_millis(5));
    }
    engine.release_cached_memory();
    Category::ALL.iter().map(|&c| (c, ctl.category_bytes(c))).collect()
}

/// The directory of table `name` under data directory `root` (the `tables/t<N>` whose
/// manifest names it). Panics when none does.
pub fn dir_of_table(root: &std::path::Path, name: &str) -> std::path::PathBuf {
    let want = format!("\"table\": \"{name}\"");
    std::fs::read_dir(root.join("tables"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|d| std::fs::read_to_string(d.join("manifest.json")).is_ok_and(|m| m.contains(&want)))
        .unwrap_or_else(|| panic!("no manifest names table {name}"))
}
