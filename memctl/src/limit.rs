//! The default limit: 50% of physical RAM, or of the cgroup memory limit when that is lower.
//! (The production report in `shared/reference/BASELINE.md` moved from 30% to 50% of RAM.)

use std::fs;

/// Physical memory in bytes, from `sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE)`.
pub fn physical_memory_bytes() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions; it returns -1 on error.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    // SAFETY: as above.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if pages > 0 && page > 0 { (pages as usize).saturating_mul(page as usize) } else { 8 << 30 }
}

/// The cgroup memory limit of this process in bytes: cgroup v2 `memory.max` of the process's
/// own cgroup (or the root mount), else v1 `memory.limit_in_bytes`. `None` when unlimited or
/// unreadable.
pub fn cgroup_memory_limit() -> Option<usize> {
    let mut candidates = Vec::new();
    if let Ok(cg) = fs::read_to_string("/proc/self/cgroup") {
        for line in cg.lines() {
            // v2: "0::/path"; v1: "N:memory:/path"
            let mut parts = line.splitn(3, ':');
            let (_, ctrl, path) = (parts.next(), parts.next(), parts.next());
            match (ctrl, path) {
                (Some(""), Some(p)) => candidates.push(format!("/sys/fs/cgroup{p}/memory.max")),
                (Some(c), Some(p)) if c.split(',').any(|x| x == "memory") => {
                    candidates.push(format!("/sys/fs/cgroup/memory{p}/memory.limit_in_bytes"));
                }
                _ => {}
            }
        }
    }
    candidates.push("/sys/fs/cgroup/memory.max".to_owned());
    candidates.push("/sys/fs/cgroup/memory/memory.limit_in_bytes".to_owned());
    candidates.iter().filter_map(|p| parse_limit(&fs::read_to_string(p).ok()?)).min()
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

    #[test]
    fn default_is_half_of_ram_or_less() {
        let d = default_memory_limit();
        assert!(d > 0);
        assert!(d <= physical_memory_bytes() / 2);
    }
}
