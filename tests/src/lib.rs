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
