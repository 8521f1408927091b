//! Atomic file output: every file protrain writes (schedules, weights, checkpoints, dumps,
//! profiles, traces) goes through [`write_atomic`].

use std::io::{BufWriter, Write};
use std::path::Path;

/// The write buffer: large enough that converting writers hand over whole pieces.
const BUFFER: usize = 1 << 20;

/// Writes `path` atomically: `write` fills a new temporary file in the same directory, named
/// `.NAME.XXXXXX.tmp`, which is synced to disk and then renamed over `path`
/// (`tempfile`'s `persist`). A reader sees the old file or the new one, never part of one, and
/// maps of the old file stay intact. On any error the temporary file is removed; a crash can
/// leave one behind, which the name marks as such.
///
/// The file gets the permissions `File::create` would give it (`0o666` less the umask).
/// It does not check what `path` is: it replaces whatever is there.
///
/// The error is the operating system's; callers name the file in their own error type.
pub fn write_atomic(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let io = |e: std::io::Error| e;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map_or_else(|| "output".into(), |n| n.to_string_lossy().into_owned());
    let mut builder = tempfile::Builder::new();
    let prefix = format!(".{name}.");
    builder.prefix(&prefix).suffix(".tmp");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    let mut tmp = builder.tempfile_in(dir).map_err(io)?;
    {
        let mut w = BufWriter::with_capacity(BUFFER, tmp.as_file_mut());
        write(&mut w).map_err(io)?;
        w.flush().map_err(io)?;
    }
    tmp.as_file().sync_all().map_err(io)?;
    tmp.persist(path).map_err(|e| io(e.error))?;
    // Make the rename itself durable. Some file systems refuse to sync a directory; the data
    // is already synced and renamed, so that is not worth failing the write for.
    #[cfg(unix)]
    if let Ok(dir) = std::fs::File::open(dir) {
        let _ = dir.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.bin");
        std::fs::write(&path, b"old").unwrap();
        write_atomic(&path, |w| w.write_all(b"new")).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1);
    }

    #[test]
    fn a_failed_write_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.bin");
        std::fs::write(&path, b"old").unwrap();
        let e = write_atomic(&path, |w| {
            w.write_all(b"part")?;
            Err(std::io::Error::other("disk full"))
        })
        .unwrap_err();
        assert!(e.to_string().contains("disk full"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[cfg(unix)]
    #[test]
    fn permissions_are_those_of_file_create() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (created, atomic) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::File::create(&created).unwrap();
        write_atomic(&atomic, |_| Ok(())).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode();
        assert_eq!(mode(&atomic), mode(&created));
    }
}
