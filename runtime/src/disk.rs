//! The disk tier's file: one preallocated file in a directory the user gives (`--disk-dir`),
//! holding a schedule's disk region ([`protrain_ir::Space::Disk`]) at fixed offsets.
//!
//! [`DiskFile::create`] makes a new file there and writes zeros over all of it, so that a
//! disk too small fails at the start, naming the directory, not in the middle of a step; the
//! file is removed when the [`DiskFile`] is dropped. A run killed with `kill -9` cannot remove
//! its file: every live file is held under an exclusive lock ([`File::try_lock`]) for the
//! life of its process, so the next [`DiskFile::create`] in the directory removes the files
//! nobody holds ([`sweep`]) and says which. Reads and writes are positioned
//! (`pread`/`pwrite` through [`FileExt`]), so several threads can use the file at once; the
//! schedule's events keep them off each other's bytes. Plain buffered I/O: `O_DIRECT` would
//! need aligned host buffers and is not measured to pay yet.

use crate::error::{Result, RuntimeError};
use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes of zeros written at a time while preallocating.
const FILL: usize = 8 << 20;

/// A preallocated file holding a disk region; removed on drop.
#[derive(Debug)]
pub struct DiskFile {
    file: File,
    path: PathBuf,
    bytes: u64,
    swept: Vec<PathBuf>,
}

/// Files made by this process so far, for unique names.
static MADE: AtomicU64 = AtomicU64::new(0);

impl DiskFile {
    /// A new file of `bytes` zeros in `dir`. Fails, naming the directory and the way out,
    /// when it does not exist, is not a directory, cannot be written, or has no room.
    pub fn create(dir: &Path, bytes: u64) -> Result<Self> {
        let bad = |problem: String| RuntimeError::Disk {
            path: dir.to_path_buf(),
            problem,
        };
        match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(bad(
                    "is not a directory; give --disk-dir a directory on the disk for the \
                     optimizer state"
                        .into(),
                ))
            }
            Err(e) => {
                return Err(bad(format!(
                    "cannot be used as --disk-dir ({e}); create it (mkdir -p) or give another \
                     directory"
                )))
            }
        }
        let swept = sweep(dir);
        let n = MADE.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("protrain-{}-{n}.state", std::process::id()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| {
                bad(format!(
                    "cannot create the state file {} in it ({e}); check that the directory \
                     is writable or give another --disk-dir",
                    path.display()
                ))
            })?;
        // Held until the file is closed: the mark of a live file for another run's sweep.
        file.try_lock().map_err(|e| {
            bad(format!(
                "cannot lock the state file {} it holds ({e}); give a --disk-dir on a file \
                 system with file locks",
                path.display()
            ))
        })?;
        let disk = Self {
            file,
            path,
            bytes,
            swept,
        };
        let zeros = vec![0u8; FILL.min(bytes as usize)];
        let mut at = 0u64;
        while at < bytes {
            let n = (bytes - at).min(FILL as u64) as usize;
            disk.file
                .write_all_at(&zeros[..n], at)
                .map_err(|e| disk.io_error("preallocating", at, e))?;
            at += n as u64;
        }
        Ok(disk)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The state files of killed runs that [`DiskFile::create`] removed from the directory
    /// before making this one ([`sweep`]).
    pub fn swept(&self) -> &[PathBuf] {
        &self.swept
    }

    /// The file's size in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Fails when the file is no longer at its path (deleted while the run went on): what it
    /// held is then out of reach of a checkpoint.
    pub fn check(&self) -> Result<()> {
        check(&self.path)
    }

    /// Flushes what was written to the disk itself (`fdatasync`).
    pub fn sync(&self) -> Result<()> {
        self.file
            .sync_data()
            .map_err(|e| self.io_error("syncing", 0, e))
    }

    /// Reads `out.len()` bytes at `offset`.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.in_bounds(offset, out.len())?;
        self.file
            .read_exact_at(out, offset)
            .map_err(|e| self.io_error("reading", offset, e))
    }

    /// Writes `data` at `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.in_bounds(offset, data.len())?;
        self.file
            .write_all_at(data, offset)
            .map_err(|e| self.io_error("writing", offset, e))
    }

    fn in_bounds(&self, offset: u64, len: usize) -> Result<()> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.bytes => Ok(()),
            _ => Err(RuntimeError::BadSchedule(format!(
                "{len} bytes at disk offset {offset:#x} end past the disk region of {} bytes",
                self.bytes
            ))),
        }
    }

    fn io_error(&self, doing: &str, offset: u64, e: std::io::Error) -> RuntimeError {
        let way_out = match e.kind() {
            ErrorKind::StorageFull | ErrorKind::QuotaExceeded => format!(
                "the disk is full: the schedule needs {} bytes there; free space or give \
                 another --disk-dir",
                self.bytes
            ),
            ErrorKind::UnexpectedEof => "the file is shorter than the disk region: something \
                                         truncated it; resume from the last checkpoint"
                .into(),
            _ => "check the disk and resume from the last checkpoint".into(),
        };
        RuntimeError::Disk {
            path: self.path.clone(),
            problem: format!("{doing} at offset {offset:#x} failed ({e}); {way_out}"),
        }
    }
}

/// Sequential bandwidths of the disk tier's file I/O in a directory, bytes per second.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DiskBandwidth {
    /// Reads of `block` bytes, one after another, through the page cache, as the runtime
    /// reads (a file just written may be read from memory: what the runtime sees too).
    pub read: f64,
    /// Writes of `block` bytes, one after another, then `fdatasync`: what reaches the disk.
    pub write: f64,
}

/// Measures [`DiskBandwidth`] in `dir` with a file of `bytes` written and read in blocks of
/// `block` bytes (a chunk's state is read and written whole, so use about that much); the
/// file is removed after. Fails as [`DiskFile::create`] does.
pub fn measure(dir: &Path, bytes: u64, block: usize) -> Result<DiskBandwidth> {
    let block = block.max(1);
    let file = DiskFile::create(dir, bytes)?;
    file.sync()?;
    let data = vec![0x5au8; block.min(bytes as usize)];
    let started = std::time::Instant::now();
    let mut at = 0u64;
    while at < bytes {
        let n = (bytes - at).min(block as u64) as usize;
        file.write(at, &data[..n])?;
        at += n as u64;
    }
    file.sync()?;
    let write = bytes as f64 / started.elapsed().as_secs_f64().max(1e-9);
    let mut out = vec![0u8; block.min(bytes as usize)];
    let started = std::time::Instant::now();
    let mut at = 0u64;
    while at < bytes {
        let n = (bytes - at).min(block as u64) as usize;
        file.read(at, &mut out[..n])?;
        at += n as u64;
    }
    let read = bytes as f64 / started.elapsed().as_secs_f64().max(1e-9);
    Ok(DiskBandwidth { read, write })
}

/// Fails when the disk tier's file `path` is gone (see [`DiskFile::check`]).
pub fn check(path: &Path) -> Result<()> {
    match std::fs::metadata(path) {
        Ok(_) => Ok(()),
        Err(e) => Err(RuntimeError::Disk {
            path: path.to_path_buf(),
            problem: format!(
                "the optimizer state file vanished ({e}): something removed it while the run \
                 used it; keep --disk-dir out of reach of cleaners and resume from the last \
                 checkpoint (--resume)"
            ),
        }),
    }
}

/// Whether `name` is the name [`DiskFile::create`] gives its files: `protrain-PID-N.state`.
/// Returns the PID.
fn state_file_pid(name: &str) -> Option<u32> {
    let (pid, n) = name
        .strip_prefix("protrain-")?
        .strip_suffix(".state")?
        .split_once('-')?;
    n.parse::<u64>().ok()?;
    pid.parse().ok()
}

/// Removes from `dir` the state files that no live run holds: left by runs killed before
/// they could remove their own (what they held lives on in their checkpoints, never in this
/// file). A file counts as left when its name is one [`DiskFile::create`] gives, it is a plain
/// file, no process holds its lock, and the process that made it (the PID in its name) is not
/// running on this machine (checked through `/proc` where there is one; the lock alone
/// decides elsewhere). Returns the paths removed; files it cannot open, lock or remove are
/// left alone, since they are not provably stale.
pub fn sweep(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let proc_here = Path::new("/proc/self").exists();
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(state_file_pid) else {
            continue;
        };
        let path = entry.path();
        if !entry.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        if proc_here && Path::new("/proc").join(pid.to_string()).exists() {
            continue;
        }
        let Ok(file) = OpenOptions::new().read(true).write(true).open(&path) else {
            continue;
        };
        if file.try_lock().is_ok() && std::fs::remove_file(&path).is_ok() {
            removed.push(path);
        }
    }
    removed.sort();
    removed
}

impl Drop for DiskFile {
    fn drop(&mut self) {
        // Nothing else holds the path: the state lives on only in checkpoints, which copy it.
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_zeroed_written_read_and_removed() {
        let dir = std::env::temp_dir();
        let disk = DiskFile::create(&dir, 10_000).unwrap();
        let path = disk.path().to_path_buf();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 10_000);
        let mut out = [7u8; 16];
        disk.read(9_984, &mut out).unwrap();
        assert_eq!(out, [0; 16]);
        disk.write(100, &[1, 2, 3]).unwrap();
        let mut back = [0u8; 3];
        disk.read(100, &mut back).unwrap();
        assert_eq!(back, [1, 2, 3]);
        assert!(disk.read(9_999, &mut out).is_err(), "past the end");
        drop(disk);
        assert!(!path.exists(), "removed on drop");
    }

    /// The PID of a process that has exited (and been waited for).
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    }

    #[test]
    fn a_killed_runs_file_is_swept_and_a_held_or_foreign_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let pid = dead_pid();
        let left = dir.path().join(format!("protrain-{pid}-0.state"));
        let held = dir.path().join(format!("protrain-{pid}-1.state"));
        let foreign = [
            "protrain-x-0.state",
            "protrain-1-0.state.tmp",
            "notes.state",
        ];
        std::fs::write(&left, b"left by kill -9").unwrap();
        std::fs::write(&held, b"still in use").unwrap();
        for name in foreign {
            std::fs::write(dir.path().join(name), b"not ours").unwrap();
        }
        let holder = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&held)
            .unwrap();
        holder.try_lock().unwrap();
        let disk = DiskFile::create(dir.path(), 64).unwrap();
        assert_eq!(disk.swept(), [left.clone()]);
        assert!(!left.exists() && held.exists());
        for name in foreign {
            assert!(dir.path().join(name).exists(), "{name} is not a state file");
        }
        // Another run's sweep leaves this live file (held, and made by a live process).
        assert!(sweep(dir.path()).is_empty());
        assert!(disk.path().exists());
        drop(holder);
        assert_eq!(sweep(dir.path()), [held]);
    }

    #[test]
    fn bandwidths_are_measured_in_a_directory() {
        let bw = measure(&std::env::temp_dir(), 4 << 20, 1 << 20).unwrap();
        assert!(bw.read.is_finite() && bw.read > 0.0, "{bw:?}");
        assert!(bw.write.is_finite() && bw.write > 0.0, "{bw:?}");
    }

    #[test]
    fn a_missing_directory_and_a_vanished_file_are_named() {
        let missing = std::env::temp_dir().join("protrain-no-such-dir-for-disk-test");
        let e = DiskFile::create(&missing, 16).unwrap_err().to_string();
        assert!(
            e.contains("protrain-no-such-dir") && e.contains("mkdir"),
            "{e}"
        );
        let disk = DiskFile::create(&std::env::temp_dir(), 16).unwrap();
        disk.check().unwrap();
        std::fs::remove_file(disk.path()).unwrap();
        let e = disk.check().unwrap_err().to_string();
        assert!(e.contains("vanished") && e.contains("--resume"), "{e}");
    }
}
