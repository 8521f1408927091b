//! This machine's host memory: what it can give now, and the check that the regions a backend
//! is about to take fit in it.

pub(crate) use crate::error::{HostRegion, MemoryNeed};
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
/// way when they are touched; this says up front what is missing
/// ([`RuntimeError::HostMemoryShort`], whose regions say which compile-time budget makes it
/// smaller). `None` (not known) passes.
///
/// The host backend holds its device arena and host region in host memory; the CUDA backend
/// pins its host region (the arena is on the GPU, checked against the GPU's free memory).
pub(crate) fn check_host_memory(regions: &[MemoryNeed], available: Option<u64>) -> Result<()> {
    let needed = regions
        .iter()
        .fold(0u64, |sum, r| sum.saturating_add(r.bytes));
    match available {
        Some(available) if needed > available => Err(RuntimeError::HostMemoryShort {
            regions: regions.to_vec(),
            available,
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_fit_while_their_sum_is_available() {
        let need = |region, bytes| MemoryNeed { region, bytes };
        let both = |a, b| {
            [
                need(HostRegion::DeviceArena, a),
                need(HostRegion::HostRegion, b),
            ]
        };
        assert!(check_host_memory(&both(1, 1), Some(2)).is_ok());
        assert!(check_host_memory(&both(2, 1), Some(2)).is_err());
        assert!(check_host_memory(&both(u64::MAX, 1), None).is_ok());
        assert!(check_host_memory(&both(u64::MAX, u64::MAX), Some(u64::MAX - 1)).is_err());
    }

    #[test]
    fn a_refusal_carries_every_region_and_names_its_budget() {
        let regions = [
            MemoryNeed {
                region: HostRegion::DeviceArena,
                bytes: 3 << 30,
            },
            MemoryNeed {
                region: HostRegion::HostRegion,
                bytes: 2 << 30,
            },
        ];
        let err = check_host_memory(&regions, Some(4 << 30)).unwrap_err();
        let RuntimeError::HostMemoryShort {
            regions: carried,
            available,
        } = &err
        else {
            panic!("not a host memory refusal: {err}");
        };
        assert_eq!((carried.as_slice(), *available), (&regions[..], 4 << 30));
        let e = err.to_string();
        for part in [
            "device arena (3.00 GiB)",
            "host region (2.00 GiB)",
            "need 5.00 GiB",
            "only 4.00 GiB",
            "1.00 GiB missing",
            "for less with device memory and host memory",
        ] {
            assert!(e.contains(part), "{part:?} not in: {e}");
        }
        assert!(!e.contains("--"), "the library names no flag: {e}");
    }
}
