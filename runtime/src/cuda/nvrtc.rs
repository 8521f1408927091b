//! Compiles the kernel sources with NVRTC, loaded at run time by cudarc.
//!
//! cudarc's dynamic loading panics on the first NVRTC call when `libnvrtc` cannot be found, so
//! every entry point here checks [`available`] first and returns [`NvrtcError::Missing`]
//! instead. Nothing here needs a GPU or a driver: compiling for a real architecture (`sm_80`,
//! `sm_90`) runs NVRTC's own ptxas and yields both PTX and a CUBIN.
//!
//! Compiled sources are cached on disk ([`compile_cached`], [`cache_dir`]): one file per
//! source, named by a hash of everything the result depends on (the source text, the options,
//! the architecture and NVRTC's version), which it also stores in full to be checked on load,
//! with a CRC of the whole entry. An entry is written to a temporary file and renamed into
//! place, so a reader sees a whole entry or none; one that does not check out (truncated,
//! corrupted, another key) is compiled again and replaced.

use std::ffi::{c_char, CStr, CString};
use std::hash::Hasher;
use std::io::Write;
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result, sys, Ptx};

use super::{include_paths_from_env, KernelSource, KERNEL_DEFINES, SOURCES};

/// How to make NVRTC loadable, for error messages.
pub const SETUP_HINT: &str =
    "run `source <(bash scripts/nvrtc-env.sh --install)`, which pip-installs \
     the CUDA 13.0 NVRTC wheel (nvidia-cuda-nvrtc) into ~/.cache/protrain/nvrtc and puts its \
     libnvrtc.so.13 on LD_LIBRARY_PATH (an NVRTC already pip-installed is found without \
     --install)";

/// What can go wrong compiling a kernel source.
#[derive(Debug, thiserror::Error)]
pub enum NvrtcError {
    /// The NVRTC library cannot be loaded.
    #[error("NVRTC (libnvrtc.so) cannot be loaded: {SETUP_HINT}")]
    Missing,
    /// NVRTC rejected a source; `log` is its message.
    #[error("NVRTC failed on {file} for {arch} ({status}):\n{log}")]
    Compile {
        /// The source's file name (`norm.cu`).
        file: String,
        /// The target architecture.
        arch: &'static str,
        /// NVRTC's status code.
        status: String,
        /// NVRTC's log.
        log: String,
    },
}

/// One compiled source.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The source it came from.
    pub source: &'static KernelSource,
    /// The architecture it was compiled for.
    pub arch: &'static str,
    /// The PTX text (JIT-compiled by a driver at least as new as this NVRTC).
    pub ptx: String,
    /// The CUBIN for `arch` (loadable by any driver of the same major CUDA version), when `arch`
    /// is a real architecture (`sm_XX`).
    pub cubin: Option<Vec<u8>>,
    /// NVRTC's log: empty, or its warnings.
    pub log: String,
}

impl Compiled {
    /// The module for cudarc to load: the CUBIN when there is one, else the PTX.
    pub fn module(&self) -> Ptx {
        match &self.cubin {
            Some(bin) => Ptx::from_binary(bin.clone()),
            None => Ptx::from_src(self.ptx.clone()),
        }
    }
}

/// Whether the NVRTC library can be loaded (under any of the names cudarc tries).
pub fn available() -> bool {
    // SAFETY: only tries to dlopen the library under its candidate names.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's version as (major, minor), or `None` when it cannot be loaded.
pub fn version() -> Option<(i32, i32)> {
    if !available() {
        return None;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers; the library is present.
    let status = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    status.result().ok().map(|()| (major, minor))
}

/// The options every source is compiled with: the architecture, C++17, IEEE division and
/// square root (NVRTC's defaults, stated so that no flag can turn on fast math), the
/// [`KERNEL_DEFINES`] as `-D` defines, and `include_paths`.
pub fn options(arch: &str, include_paths: &[String]) -> Vec<String> {
    let mut opts = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_owned(),
        "--prec-div=true".to_owned(),
        "--prec-sqrt=true".to_owned(),
        "--ftz=false".to_owned(),
    ];
    opts.extend(
        KERNEL_DEFINES
            .iter()
            .map(|(name, value)| format!("-D{name}={value}")),
    );
    opts.extend(include_paths.iter().map(|p| format!("--include-path={p}")));
    opts
}

fn c_text(bytes: &[c_char]) -> String {
    if bytes.is_empty() {
        return String::new();
    }
    // SAFETY: NVRTC's logs and PTX are NUL-terminated.
    unsafe { CStr::from_ptr(bytes.as_ptr()) }
        .to_string_lossy()
        .trim_end()
        .to_owned()
}

/// Destroys the program when dropped, whatever path leaves [`compile`].
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by create_program and destroyed only here.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// Compiles `source` for `arch` (`"sm_80"`, `"sm_90"`, or a virtual `"compute_90"`, which
/// gives PTX only) with `include_paths`.
pub fn compile(
    source: &'static KernelSource,
    arch: &'static str,
    include_paths: &[String],
) -> Result<Compiled, NvrtcError> {
    if !available() {
        return Err(NvrtcError::Missing);
    }
    let file = source.file_name();
    let fail = |status: result::NvrtcError, log: String| NvrtcError::Compile {
        file: file.clone(),
        arch,
        status: format!("{status:?}"),
        log,
    };
    let text = CString::new(source.source).expect("kernel sources contain no NUL");
    let name = CString::new(file.as_str()).expect("file names contain no NUL");
    let prog =
        Program(result::create_program(&text, Some(&name)).map_err(|e| fail(e, String::new()))?);
    let opts = options(arch, include_paths);
    // SAFETY: `prog` is a live program; `text` and `name` outlive it.
    let compiled = unsafe { result::compile_program(prog.0, &opts) };
    // SAFETY: as above.
    let log = unsafe { result::get_program_log(prog.0) }
        .map(|l| c_text(&l))
        .unwrap_or_default();
    compiled.map_err(|e| fail(e, log.clone()))?;
    // SAFETY: as above; compiled successfully.
    let ptx = c_text(&unsafe { result::get_ptx(prog.0) }.map_err(|e| fail(e, log.clone()))?);
    let cubin = if arch.starts_with("sm_") {
        // SAFETY: as above.
        Some(unsafe { cubin_of(prog.0) }.map_err(|e| fail(e, log.clone()))?)
    } else {
        None
    };
    Ok(Compiled {
        source,
        arch,
        ptx,
        cubin,
        log,
    })
}

/// The CUBIN of a program compiled for a real architecture.
///
/// # Safety
/// `prog` must be a live, successfully compiled program.
unsafe fn cubin_of(prog: sys::nvrtcProgram) -> Result<Vec<u8>, result::NvrtcError> {
    let mut size = 0usize;
    // SAFETY: the caller's contract; a valid out-pointer.
    unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }.result()?;
    let mut bin = vec![0u8; size];
    // SAFETY: `bin` holds `size` bytes, as NVRTC asked.
    unsafe { sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr().cast()) }.result()?;
    Ok(bin)
}

/// Compiles every source in [`SOURCES`] for `arch`, with the include paths of
/// `PROTRAIN_CUDA_INCLUDE`, through the disk cache of [`cache_dir`], the sources in parallel
/// (NVRTC compiles distinct programs from any thread; one at a time a backend's start waits
/// for the sum of them), in [`SOURCES`] order. The error is the first failing source's, in
/// that order.
pub fn compile_all(arch: &'static str) -> Result<Vec<Compiled>, NvrtcError> {
    use rayon::prelude::*;
    let includes = include_paths_from_env();
    let dir = cache_dir();
    SOURCES
        .par_iter()
        .map(|s| compile_cached(s, arch, &includes, dir.as_deref()).map(|(c, _)| c))
        .collect()
}

/// The variable that places the compiled-kernel cache: a directory, or `off` (or empty) for
/// no cache. Unset, the cache is `$XDG_CACHE_HOME/protrain/kernels` (`~/.cache/...` without
/// it).
pub const CACHE_VAR: &str = "PROTRAIN_KERNEL_CACHE";

/// The compiled-kernel cache directory [`CACHE_VAR`] names, or its default; `None` when it is
/// off or no home directory is known.
pub fn cache_dir() -> Option<PathBuf> {
    cache_dir_from(
        std::env::var_os(CACHE_VAR).as_deref(),
        std::env::var_os("XDG_CACHE_HOME").as_deref(),
        std::env::var_os("HOME").as_deref(),
    )
}

/// [`cache_dir`] from the values of [`CACHE_VAR`], `XDG_CACHE_HOME` and `HOME`.
fn cache_dir_from(
    var: Option<&std::ffi::OsStr>,
    xdg: Option<&std::ffi::OsStr>,
    home: Option<&std::ffi::OsStr>,
) -> Option<PathBuf> {
    match var {
        Some(v) if v.is_empty() || v == "off" => None,
        Some(v) => Some(PathBuf::from(v)),
        None => {
            let base = match (xdg.filter(|x| !x.is_empty()), home) {
                (Some(x), _) => PathBuf::from(x),
                (None, Some(h)) if !h.is_empty() => Path::new(h).join(".cache"),
                _ => return None,
            };
            Some(base.join("protrain").join("kernels"))
        }
    }
}

/// What [`compile_cached`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheOutcome {
    /// No cache directory: compiled.
    Off,
    /// Loaded from the cache.
    Hit,
    /// Not in the cache: compiled, and stored if the directory can be written.
    Miss,
    /// In the cache but unreadable, corrupted or for another key: compiled and replaced.
    Rebuilt,
}

/// The first bytes of a cache entry (and its format's version).
const CACHE_MAGIC: &[u8] = b"protrain-kernel-cache 1\n";

/// Everything a compiled source depends on, as text: the architecture, NVRTC's version, the
/// options (the defines and include paths among them) and the source's length and two
/// independent hashes of it.
fn cache_key(source: &KernelSource, arch: &str, include_paths: &[String]) -> String {
    let (major, minor) = version().unwrap_or((0, 0));
    let mut fnv = fnv::FnvHasher::default();
    fnv.write(source.source.as_bytes());
    format!(
        "name={}\narch={arch}\nnvrtc={major}.{minor}\noptions={}\nsource={} bytes, fnv64 {:016x}, \
         crc32 {:08x}\n",
        source.name,
        options(arch, include_paths).join(" "),
        source.source.len(),
        fnv.finish(),
        crc32fast::hash(source.source.as_bytes()),
    )
}

/// The file of `key`'s entry in `dir`.
fn cache_file(dir: &Path, name: &str, key: &str) -> PathBuf {
    let mut h = fnv::FnvHasher::default();
    h.write(key.as_bytes());
    dir.join(format!("{name}-{:016x}.bin", h.finish()))
}

/// An entry's bytes: the magic, the key, the PTX, the CUBIN (if any), the log, each with its
/// length, then a CRC32 of all before it.
fn encode_entry(key: &str, c: &Compiled) -> Vec<u8> {
    let mut out = CACHE_MAGIC.to_vec();
    let mut part = |bytes: &[u8]| {
        out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(bytes);
    };
    part(key.as_bytes());
    part(c.ptx.as_bytes());
    match &c.cubin {
        Some(bin) => {
            part(&[1]);
            part(bin);
        }
        None => part(&[0]),
    }
    part(c.log.as_bytes());
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// The PTX, CUBIN and log of an entry for `key`, or `None` when `bytes` is not one (another
/// key, truncated, corrupted).
fn decode_entry(bytes: &[u8], key: &str) -> Option<(String, Option<Vec<u8>>, String)> {
    let (body, crc) = bytes.split_at_checked(bytes.len().checked_sub(4)?)?;
    if crc32fast::hash(body).to_le_bytes() != crc {
        return None;
    }
    let mut rest = body.strip_prefix(CACHE_MAGIC)?;
    let mut part = || -> Option<&[u8]> {
        let (len, tail) = rest.split_at_checked(8)?;
        let len = usize::try_from(u64::from_le_bytes(len.try_into().ok()?)).ok()?;
        let (part, tail) = tail.split_at_checked(len)?;
        rest = tail;
        Some(part)
    };
    if part()? != key.as_bytes() {
        return None;
    }
    let ptx = String::from_utf8(part()?.to_vec()).ok()?;
    let cubin = match part()? {
        [1] => Some(part()?.to_vec()),
        [0] => None,
        _ => return None,
    };
    let log = String::from_utf8(part()?.to_vec()).ok()?;
    rest.is_empty().then_some((ptx, cubin, log))
}

/// Writes `bytes` to `path` whole or not at all: into a temporary file beside it, renamed into
/// place.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_data()?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

/// [`compile`] through the cache in `dir` (`None`: no cache): the entry for this source,
/// architecture, options and NVRTC version when one checks out, else a compilation, stored
/// for next time. A cache that cannot be read or written costs a compilation, never an error;
/// the errors are [`compile`]'s.
pub fn compile_cached(
    source: &'static KernelSource,
    arch: &'static str,
    include_paths: &[String],
    dir: Option<&Path>,
) -> Result<(Compiled, CacheOutcome), NvrtcError> {
    let Some(dir) = dir else {
        return Ok((compile(source, arch, include_paths)?, CacheOutcome::Off));
    };
    if !available() {
        return Err(NvrtcError::Missing);
    }
    let key = cache_key(source, arch, include_paths);
    let path = cache_file(dir, source.name, &key);
    let outcome = match std::fs::read(&path) {
        Ok(bytes) => match decode_entry(&bytes, &key) {
            Some((ptx, cubin, log)) => {
                let c = Compiled {
                    source,
                    arch,
                    ptx,
                    cubin,
                    log,
                };
                return Ok((c, CacheOutcome::Hit));
            }
            None => CacheOutcome::Rebuilt,
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => CacheOutcome::Miss,
        Err(_) => CacheOutcome::Rebuilt,
    };
    let c = compile(source, arch, include_paths)?;
    // A cache that cannot be written (read-only, full) only costs the next run a compilation.
    let _ = write_atomically(&path, &encode_entry(&key, &c));
    Ok((c, outcome))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn the_cache_directory_is_the_variables_or_the_xdg_default_or_none() {
        let dir = |var: Option<&str>, xdg: Option<&str>, home: Option<&str>| {
            cache_dir_from(
                var.map(OsStr::new),
                xdg.map(OsStr::new),
                home.map(OsStr::new),
            )
        };
        assert_eq!(
            dir(Some("/tmp/k"), Some("/x"), Some("/h")),
            Some(PathBuf::from("/tmp/k"))
        );
        assert_eq!(dir(Some("off"), Some("/x"), Some("/h")), None);
        assert_eq!(dir(Some(""), Some("/x"), Some("/h")), None);
        assert_eq!(
            dir(None, Some("/x"), Some("/h")),
            Some(PathBuf::from("/x/protrain/kernels"))
        );
        assert_eq!(
            dir(None, Some(""), Some("/h")),
            Some(PathBuf::from("/h/.cache/protrain/kernels"))
        );
        assert_eq!(dir(None, None, None), None);
    }

    #[test]
    fn an_entry_decodes_only_whole_and_under_its_own_key() {
        let src = &SOURCES[0];
        let c = Compiled {
            source: src,
            arch: "sm_80",
            ptx: "// ptx".into(),
            cubin: Some(vec![1, 2, 3]),
            log: String::new(),
        };
        let key = "arch=sm_80\n";
        let bytes = encode_entry(key, &c);
        assert_eq!(
            decode_entry(&bytes, key),
            Some(("// ptx".to_owned(), Some(vec![1, 2, 3]), String::new()))
        );
        assert_eq!(decode_entry(&bytes, "arch=sm_90\n"), None);
        for cut in [0, 1, 4, bytes.len() / 2, bytes.len() - 1] {
            assert_eq!(decode_entry(&bytes[..cut], key), None, "cut at {cut}");
        }
        for i in 0..bytes.len() {
            let mut flipped = bytes.clone();
            flipped[i] ^= 1;
            assert_eq!(decode_entry(&flipped, key), None, "byte {i} flipped");
        }
    }
}
