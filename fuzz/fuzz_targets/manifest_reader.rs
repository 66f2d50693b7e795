//! The manifest parser must return a manifest or a typed error for any bytes, never panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = gritdb_storage::Manifest::parse(data, std::path::Path::new("fuzz/manifest.json"));
});
