use serde::Serialize;

/// Which allocator the process view's allocator figures come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum AllocatorKind {
    /// jemalloc is the global allocator; figures from `tikv-jemalloc-ctl` `stats.*`.
    Jemalloc,
    /// glibc malloc; figures from `mallinfo2()` (`allocated` = in-use arena + mmapped bytes).
    Glibc,
    /// No allocator figures available.
    Unknown,
}

/// The allocator's own figures, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AllocatorStats {
    /// Which allocator these figures describe.
    pub kind: AllocatorKind,
    /// Bytes allocated by the application (jemalloc `stats.allocated`; glibc uordblks + hblkhd).
    pub allocated: usize,
    /// Bytes in active pages (jemalloc `stats.active`; glibc: same as allocated).
    pub active: usize,
    /// Bytes in physically resident pages (jemalloc `stats.resident`; glibc: arena + mmapped).
    pub resident: usize,
    /// Bytes retained in virtual memory, not returned to the OS (jemalloc `stats.retained`;
    /// glibc: free bytes held in arenas, fordblks).
    pub retained: usize,
}

/// Process-wide memory figures beside the engine's accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ProcessView {
    /// Resident set size in bytes (`VmRSS` of `/proc/self/status`).
    pub rss: usize,
    /// Peak resident set size in bytes (`VmHWM` of `/proc/self/status`).
    pub vmhwm: usize,
    /// The allocator's own figures.
    pub allocator: AllocatorStats,
}

impl ProcessView {
    /// Reads `/proc/self/status` and the allocator (advancing jemalloc's epoch first).
    pub fn read() -> Self {
        let (rss, vmhwm) = read_proc_status();
        Self { rss, vmhwm, allocator: allocator_stats() }
    }
}

fn read_proc_status() -> (usize, usize) {
    let Ok(text) = std::fs::read_to_string("/proc/self/status") else {
        return (0, 0);
    };
    let field = |name: &str| {
        text.lines().find(|l| l.starts_with(name)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse::<usize>().ok()).map_or(0, |kb| kb * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// True when jemalloc is the process's global allocator: a 256 KiB heap allocation moves
/// jemalloc's per-thread `allocated` counter. (Linking jemalloc does not make it the
/// allocator; the embedding binary decides with `#[global_allocator]`.)
#[cfg(feature = "jemalloc-stats")]
fn jemalloc_is_global() -> bool {
    use std::sync::OnceLock;
    static IS: OnceLock<bool> = OnceLock::new();
    *IS.get_or_init(|| {
        let Ok(counter) = tikv_jemalloc_ctl::thread::allocatedp::read() else {
            return false;
        };
        let before = counter.get();
        let probe: Vec<u8> = Vec::with_capacity(256 << 10);
        let after = counter.get();
        drop(std::hint::black_box(probe));
        after.wrapping_sub(before) >= 256 << 10
    })
}

fn allocator_stats() -> AllocatorStats {
    #[cfg(feature = "jemalloc-stats")]
    if jemalloc_is_global() {
        use tikv_jemalloc_ctl::{epoch, stats};
        if epoch::advance().is_ok() {
            let get = |r: Result<usize, tikv_jemalloc_ctl::Error>| r.unwrap_or(0);
            return AllocatorStats {
                kind: AllocatorKind::Jemalloc,
                allocated: get(stats::allocated::read()),
                active: get(stats::active::read()),
                resident: get(stats::resident::read()),
                retained: get(stats::retained::read()),
            };
        }
    }
    glibc_stats()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn glibc_stats() -> AllocatorStats {
    // SAFETY: mallinfo2 only reads the allocator's statistics; no preconditions.
    let mi = unsafe { libc::mallinfo2() };
    AllocatorStats {
        kind: AllocatorKind::Glibc,
        allocated: mi.uordblks + mi.hblkhd,
        active: mi.uordblks + mi.hblkhd,
        resident: mi.arena + mi.hblkhd,
        retained: mi.fordblks,
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn glibc_stats() -> AllocatorStats {
    AllocatorStats { kind: AllocatorKind::Unknown, allocated: 0, active: 0, resident: 0, retained: 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_rss_and_allocator() {
        let v = ProcessView::read();
        assert!(v.rss > 0, "RSS must be read from /proc/self/status");
        assert!(v.vmhwm >= v.rss);
        // The unit-test binary uses the system allocator: the view must say glibc, not zeros.
        assert_eq!(v.allocator.kind, AllocatorKind::Glibc);
        assert!(v.allocator.allocated > 0);
    }
}
