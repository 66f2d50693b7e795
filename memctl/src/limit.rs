//! The default limit: 50% of physical RAM, or of the cgroup memory limit when that is lower.
//! (The production report in `shared/reference/BASELINE.md` moved from 30% to 50% of RAM.)

use std::fs;
use std::path::{Path, PathBuf};

/// Physical memory in bytes, from `sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE)`.
pub fn physical_memory_bytes() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions; it returns -1 on error.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    // SAFETY: as above.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if pages > 0 && page > 0 { (pages as usize).saturating_mul(page as usize) } else { 8 << 30 }
}

/// The cgroup memory limit of this process in bytes: the smallest limit set on its cgroup or
/// on any ancestor of it, cgroup v2 `memory.max` or `memory.high` (under `/sys/fs/cgroup`) or
/// v1 `memory.limit_in_bytes` (under `/sys/fs/cgroup/memory`), the mount roots included.
/// `None` when none is set or none is readable.
///
/// `memory.high` counts as a limit: above it the kernel throttles the cgroup's allocations
/// and reclaims hard ("the main mechanism to control memory usage", the kernel's
/// `Documentation/admin-guide/cgroup-v2.rst`; systemd's `MemoryHigh=`), so an engine that
/// plans to fill memory up to it would stall its own writes. v1's
/// `memory.soft_limit_in_bytes` only steers reclaim under global pressure and is not read.
///
/// Ancestors count because a cgroup's limit applies to every cgroup below it: a systemd
/// service whose own `memory.max` is `max` inside a slice with `MemoryMax=`, or a process that
/// a container runtime put in a child cgroup of the container's, is killed at the ancestor's
/// limit: the kernel charges each page to the cgroup and to every ancestor
/// (`page_counter_try_charge` walks up the parents), and the first limit reached reclaims or
/// kills. Reading the process's own cgroup alone missed those, the fault `OpenJDK` fixed as
/// JDK-8217338 (v1) and JDK-8322420 (v2: "Limits in parent nested control groups are not
/// detected", which also takes the minimum up the hierarchy). The root mount is read too, for a
/// container whose `/sys/fs/cgroup` is its own cgroup while `/proc/self/cgroup` names the
/// host's path (no cgroup namespace).
pub fn cgroup_memory_limit() -> Option<usize> {
    let own = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    cgroup_limit_under(Path::new("/sys/fs/cgroup"), &own, |p| fs::read_to_string(p).ok())
}

/// [`cgroup_memory_limit`] for a cgroup filesystem mounted at `mount`, `own` being the text of
/// `/proc/self/cgroup` (v2 lines `0::/path`, v1 lines `N:controllers:/path`), reading each
/// limit file with `read`.
fn cgroup_limit_under(mount: &Path, own: &str, read: impl Fn(&Path) -> Option<String>) -> Option<usize> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (ctrl, path) = (parts.nth(1), parts.next());
        let (dir, files): (PathBuf, &[&str]) = match (ctrl, path) {
            (Some(""), Some(_)) => (mount.to_path_buf(), &["memory.max", "memory.high"]),
            (Some(c), Some(_)) if c.split(',').any(|x| x == "memory") => (mount.join("memory"), &["memory.limit_in_bytes"]),
            _ => continue,
        };
        // The cgroup, then each ancestor up to the mount root ("" at the end).
        let mut rel = Some(Path::new(path.unwrap_or("").trim_start_matches('/')));
        while let Some(r) = rel {
            candidates.extend(files.iter().map(|f| dir.join(r).join(f)));
            rel = r.parent();
        }
    }
    candidates.push(mount.join("memory.max"));
    candidates.push(mount.join("memory.high"));
    candidates.push(mount.join("memory").join("memory.limit_in_bytes"));
    candidates.iter().filter_map(|p| parse_limit(&read(p)?)).min()
}

fn parse_limit(text: &str) -> Option<usize> {
    let t = text.trim();
    if t == "max" {
        return None;
    }
    let v: u64 = t.parse().ok()?;
    // cgroup v1 reports "unlimited" as a huge page-aligned number.
    if v >= (1u64 << 60) { None } else { Some(v as usize) }
}

/// 50% of `min(physical memory, cgroup limit)`, in bytes.
pub fn default_memory_limit() -> usize {
    let phys = physical_memory_bytes();
    let base = cgroup_memory_limit().map_or(phys, |c| c.min(phys));
    base / 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cgroup_values() {
        assert_eq!(parse_limit("max\n"), None);
        assert_eq!(parse_limit("1073741824\n"), Some(1 << 30));
        assert_eq!(parse_limit("9223372036854771712"), None);
        assert_eq!(parse_limit("garbage"), None);
    }

    /// A fake cgroup filesystem: `files` maps paths under `/cg` to their text.
    fn limit(own: &str, files: &[(&str, &str)]) -> Option<usize> {
        let files: std::collections::HashMap<PathBuf, String> = files.iter().map(|(p, t)| (Path::new("/cg").join(p), (*t).to_owned())).collect();
        cgroup_limit_under(Path::new("/cg"), own, |p| files.get(p).cloned())
    }

    /// The smallest limit along the hierarchy counts: a leaf at `max` under a limited parent,
    /// a limited leaf under a larger parent, v1 the same way, the mount root for a container
    /// that sees the host's path, and nothing set at all.
    #[test]
    fn the_smallest_limit_of_the_cgroup_and_its_ancestors_counts() {
        let v2 = "0::/system.slice/app.service\n";
        // The service's own memory.max is "max"; its slice has MemoryMax=1 GiB.
        let slice = [("system.slice/app.service/memory.max", "max\n"), ("system.slice/memory.max", "1073741824\n")];
        assert_eq!(limit(v2, &slice), Some(1 << 30));
        // A smaller leaf under a larger slice.
        assert_eq!(limit(v2, &[("system.slice/app.service/memory.max", "268435456\n"), ("system.slice/memory.max", "1073741824\n")]), Some(256 << 20));
        // The mount root (a container's own cgroup with no cgroup namespace: the host's path
        // does not exist under the mount).
        assert_eq!(limit("0::/docker/abc\n", &[("memory.max", "536870912\n")]), Some(512 << 20));
        // v1: the memory controller's hierarchy, among other controllers' lines; "unlimited"
        // (a huge page-aligned number) at the leaf.
        let v1 = "12:cpu,cpuacct:/k8s/pod1\n7:memory:/k8s/pod1/c1\n0::/\n";
        let v1_files = [("memory/k8s/pod1/c1/memory.limit_in_bytes", "9223372036854771712\n"), ("memory/k8s/pod1/memory.limit_in_bytes", "2147483648\n")];
        assert_eq!(limit(v1, &v1_files), Some(2 << 30));
        // Nothing set, nothing readable, or garbage: no limit.
        assert_eq!(limit(v2, &[("system.slice/memory.max", "max\n")]), None);
        assert_eq!(limit("", &[]), None);
        assert_eq!(limit("garbage\n::\n", &[("memory.max", "nonsense")]), None);
        // The process at the root: one candidate, the root's file.
        assert_eq!(limit("0::/\n", &[("memory.max", "4096\n")]), Some(4096));
    }

    /// v2 `memory.high` (systemd's `MemoryHigh=`) is a limit too, wherever it is set and
    /// whether or not `memory.max` is; the smaller of the two counts.
    #[test]
    fn memory_high_counts_as_a_limit() {
        let v2 = "0::/system.slice/app.service\n";
        let own_high = [("system.slice/app.service/memory.max", "max\n"), ("system.slice/app.service/memory.high", "805306368\n")];
        assert_eq!(limit(v2, &own_high), Some(768 << 20));
        let slice_high = [("system.slice/app.service/memory.max", "1073741824\n"), ("system.slice/memory.high", "536870912\n")];
        assert_eq!(limit(v2, &slice_high), Some(512 << 20));
        let high_above_max = [("system.slice/app.service/memory.max", "268435456\n"), ("system.slice/app.service/memory.high", "1073741824\n")];
        assert_eq!(limit(v2, &high_above_max), Some(256 << 20));
        assert_eq!(limit(v2, &[("system.slice/app.service/memory.high", "max\n")]), None);
        assert_eq!(limit("0::/docker/abc\n", &[("memory.high", "4096\n")]), Some(4096));
    }

    #[test]
    fn default_is_half_of_ram_or_less() {
        let d = default_memory_limit();
        assert!(d > 0);
        assert!(d <= physical_memory_bytes() / 2);
    }
}
