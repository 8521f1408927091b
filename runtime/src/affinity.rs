//! Where a thread may run: the CPUs the calling thread is allowed (its affinity mask, which
//! `taskset`, `numactl` and cgroup cpusets narrow), and pinning a thread to one of them.
//! Linux only; elsewhere nothing is known and nothing is pinned.

/// The CPUs the calling thread may run on, in ascending order; empty where the system does
/// not say.
pub fn allowed_cpus() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `set` is a plain bit set, zeroed as `CPU_ZERO` leaves it, and its size is
        // the one passed; pid 0 is the calling thread.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
                return Vec::new();
            }
            (0..libc::CPU_SETSIZE as usize)
                .filter(|&cpu| libc::CPU_ISSET(cpu, &set))
                .collect()
        }
    }
    #[cfg(not(target_os = "linux"))]
    Vec::new()
}

/// The CPU the `index`-th thread of a pool is pinned to: the allowed CPUs in turn, so a pool
/// of one thread per allowed CPU gets one CPU each. `None` when no CPU is known.
pub fn cpu_for(index: usize, allowed: &[usize]) -> Option<usize> {
    match allowed.len() {
        0 => None,
        n => Some(allowed[index % n]),
    }
}

/// Pins the calling thread to `cpu`. False where the system refuses (a CPU outside the
/// thread's cpuset) or cannot pin; the thread then runs where it ran before.
pub fn pin_current_thread(cpu: usize) -> bool {
    #[cfg(target_os = "linux")]
    {
        if cpu >= libc::CPU_SETSIZE as usize {
            return false;
        }
        // SAFETY: as in `allowed_cpus`; `cpu` is below the set's size.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = cpu;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::{allowed_cpus, cpu_for, pin_current_thread};

    #[test]
    fn a_pools_threads_take_the_allowed_cpus_in_turn() {
        let allowed = [2, 5, 7];
        let cpus: Vec<_> = (0..5).map(|i| cpu_for(i, &allowed)).collect();
        assert_eq!(cpus, [Some(2), Some(5), Some(7), Some(2), Some(5)]);
        assert_eq!(cpu_for(0, &[]), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_pinned_thread_is_allowed_its_cpu_alone() {
        let allowed = allowed_cpus();
        assert!(!allowed.is_empty(), "Linux names the allowed CPUs");
        assert!(allowed.windows(2).all(|w| w[0] < w[1]), "{allowed:?}");
        let last = *allowed.last().unwrap();
        // A thread of its own, so the test's thread keeps its mask.
        let seen = std::thread::spawn(move || (pin_current_thread(last), allowed_cpus()))
            .join()
            .unwrap();
        assert_eq!(seen, (true, vec![last]));
        assert!(
            !pin_current_thread(usize::MAX),
            "a CPU beyond the set is refused"
        );
    }
}
