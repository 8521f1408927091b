//! Compiles the kernel sources with NVRTC, loaded at run time by cudarc.
//!
//! cudarc's dynamic loading panics on the first NVRTC call when `libnvrtc` cannot be found, so
//! every entry point here checks [`available`] first and returns [`NvrtcError::Missing`]
//! instead. Nothing here needs a GPU or a driver: compiling for a real architecture (`sm_80`,
//! `sm_90`) runs NVRTC's own ptxas and yields both PTX and a CUBIN.

use std::ffi::{c_char, CStr, CString};

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
/// `PROTRAIN_CUDA_INCLUDE`, the sources in parallel (NVRTC compiles distinct programs from
/// any thread; one at a time a backend's start waits for the sum of them), in [`SOURCES`]
/// order. The error is the first failing source's, in that order.
pub fn compile_all(arch: &'static str) -> Result<Vec<Compiled>, NvrtcError> {
    use rayon::prelude::*;
    let includes = include_paths_from_env();
    SOURCES
        .par_iter()
        .map(|s| compile(s, arch, &includes))
        .collect()
}
