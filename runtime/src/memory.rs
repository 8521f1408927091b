//! This machine's host memory: what it can give now, and the check that the regions a backend
//! is about to take fit in it.

use crate::error::{Result, RuntimeError};

/// Memory the system can give without swapping (`MemAvailable` in `/proc/meminfo`), where
/// that can be read.
pub(crate) fn memory_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Fails when `regions`, the host memory a backend is about to take (each named, with its
/// bytes), need more than `available` bytes together. The allocation itself would succeed
/// (pages are zeroed lazily, or pinned and then zeroed page by page) and the run be killed part
/// way when they are touched; this says up front what is missing and which compile flag makes
/// it smaller. `None` (not known) passes.
///
/// The host backend holds its device arena and host region in host memory; the CUDA backend
/// pins its host region (the arena is on the GPU, checked against the GPU's free memory).
pub(crate) fn check_host_memory(regions: &[MemoryNeed], available: Option<u64>) -> Result<()> {
    let needed = regions
        .iter()
        .fold(0u64, |sum, r| sum.saturating_add(r.bytes));
    match available {
        Some(available) if needed > available => {
            let what: Vec<String> = regions
                .iter()
                .map(|r| format!("{} ({})", r.name, protrain_ir::format_bytes(r.bytes)))
                .collect();
            let flags: Vec<&str> = regions.iter().map(|r| r.flag).collect();
            Err(RuntimeError::BadSchedule(format!(
                "the {} {} {} of host memory, but only {} is available on this machine ({} \
                 missing); free memory, or compile the schedule for less with {}",
                what.join(" and "),
                if regions.len() == 1 { "needs" } else { "need" },
                protrain_ir::format_bytes(needed),
                protrain_ir::format_bytes(available),
                protrain_ir::format_bytes(needed - available),
                flags.join(" and "),
            )))
        }
        _ => Ok(()),
    }
}

/// Host memory a backend takes, for [`check_host_memory`]: the region's name, its bytes,
/// and the compile flag that bounds it.
pub(crate) struct MemoryNeed {
    /// What the error calls the region.
    pub name: &'static str,
    /// Its size.
    pub bytes: u64,
    /// The `protrain compile` flag that compiles a schedule needing less of it.
    pub flag: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_fit_while_their_sum_is_available() {
        let need = |name, bytes| MemoryNeed {
            name,
            bytes,
            flag: "--host-memory",
        };
        let both = |a, b| [need("device arena", a), need("host region", b)];
        assert!(check_host_memory(&both(1, 1), Some(2)).is_ok());
        assert!(check_host_memory(&both(2, 1), Some(2)).is_err());
        assert!(check_host_memory(&both(u64::MAX, 1), None).is_ok());
        assert!(check_host_memory(&both(u64::MAX, u64::MAX), Some(u64::MAX - 1)).is_err());
    }

    #[test]
    fn a_refusal_names_every_region_and_the_flag_that_bounds_it() {
        let regions = [
            MemoryNeed {
                name: "device arena",
                bytes: 3 << 30,
                flag: "--gpu-memory",
            },
            MemoryNeed {
                name: "host region",
                bytes: 2 << 30,
                flag: "--host-memory",
            },
        ];
        let e = check_host_memory(&regions, Some(4 << 30))
            .unwrap_err()
            .to_string();
        for part in [
            "device arena (3.00 GiB)",
            "host region (2.00 GiB)",
            "need 5.00 GiB",
            "only 4.00 GiB",
            "1.00 GiB missing",
            "--gpu-memory and --host-memory",
        ] {
            assert!(e.contains(part), "{part:?} not in: {e}");
        }
    }
}
