//! Atomic file output: every file protrain writes (schedules, weights, checkpoints, dumps,
//! profiles, traces) goes through [`write_atomic`], which first checks the target with
//! [`check_target`].

use std::io::{BufWriter, Write};
use std::path::Path;

/// Fails unless `path` may be replaced by a new file: it must not exist, or be a regular file
/// (following symbolic links) that is none of `inputs` (compared by device and inode on Unix,
/// by canonical path elsewhere). So `-o /dev/null` or a FIFO is refused rather than renamed
/// over, and `compile X -o X` does not destroy its own input. Missing inputs are ignored.
///
/// The error's kind is `InvalidInput` and its text says what to do; callers name the file.
pub fn check_target(path: &Path, inputs: &[&Path]) -> std::io::Result<()> {
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let refuse = |why: &str| Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, why));
    if meta.is_dir() {
        return refuse("it is a directory; give a file path");
    }
    if !meta.is_file() {
        return refuse(
            "it is not a regular file (a device, FIFO or socket), which protrain would \
             replace rather than write into; give a regular file path",
        );
    }
    for input in inputs {
        if same_file(path, &meta, input) {
            return refuse(
                "it is also an input of this command, which writing would destroy; give \
                 another output path",
            );
        }
    }
    Ok(())
}

/// Whether `input` is the file `path` (whose metadata is `meta`).
fn same_file(path: &Path, meta: &std::fs::Metadata, input: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let _ = path;
        std::fs::metadata(input).is_ok_and(|m| m.dev() == meta.dev() && m.ino() == meta.ino())
    }
    #[cfg(not(unix))]
    {
        let _ = meta;
        match (std::fs::canonicalize(path), std::fs::canonicalize(input)) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        }
    }
}

/// The write buffer: large enough that converting writers hand over whole pieces.
const BUFFER: usize = 1 << 20;

/// Writes `path` atomically: `write` fills a new temporary file in the same directory, named
/// `.NAME.XXXXXX.tmp`, which is synced to disk and then renamed over `path`
/// (`tempfile`'s `persist`). A reader sees the old file or the new one, never part of one, and
/// maps of the old file stay intact. On any error the temporary file is removed; a crash can
/// leave one behind, which the name marks as such.
///
/// The file gets the permissions `File::create` would give it (`0o666` less the umask).
/// It refuses a target that exists and is not a regular file ([`check_target`]); to refuse
/// overwriting a command's inputs as well, use [`write_atomic_checked`].
///
/// The error is the operating system's; callers name the file in their own error type.
pub fn write_atomic(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> std::io::Result<()> {
    write_atomic_checked(path, &[], write)
}

/// [`write_atomic`], refusing a `path` that is one of `inputs` ([`check_target`]).
pub fn write_atomic_checked(
    path: &Path,
    inputs: &[&Path],
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> std::io::Result<()> {
    check_target(path, inputs)?;
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
    fn refuses_devices_directories_and_inputs() {
        let dir = tempfile::tempdir().unwrap();
        for target in [Path::new("/dev/null"), dir.path()] {
            let e = write_atomic(target, |w| w.write_all(b"x")).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
        }
        use std::os::unix::fs::FileTypeExt;
        assert!(std::fs::metadata("/dev/null")
            .unwrap()
            .file_type()
            .is_char_device());
        let input = dir.path().join("in.json");
        std::fs::write(&input, b"input").unwrap();
        // The same file by another name is still the input.
        let other = dir.path().join(".").join("in.json");
        let e = write_atomic_checked(&other, &[&input], |w| w.write_all(b"x")).unwrap_err();
        assert!(e.to_string().contains("input"), "{e}");
        assert_eq!(std::fs::read(&input).unwrap(), b"input");
        write_atomic_checked(&dir.path().join("out"), &[&input], |w| w.write_all(b"x")).unwrap();
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
