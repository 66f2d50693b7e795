//! The WAL record decoder must return records or an error for any bytes, never panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = gritdb_storage::decode_segment(data);
});
