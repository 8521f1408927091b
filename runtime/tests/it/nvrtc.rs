//! Compiles every CUDA kernel source with NVRTC for sm_75, sm_80 and sm_90: the check of the kernels
//! that needs no GPU. Needs the `cuda` feature and NVRTC from PyPI:
//!
//! ```text
//! source <(bash scripts/nvrtc-env.sh --install)
//! cargo test -p protrain-runtime --features cuda --test it -- nvrtc::
//! ```
//!
//! A missing NVRTC fails the test (it never skips), with the commands above in the message.

use protrain_runtime::cuda::{self, nvrtc, SOURCES};

/// The architectures checked: T4 and the RTX 20 series (sm_75, the oldest the backend runs on:
/// CUDA 13's NVRTC compiles nothing older, and the flash attention kernels trap there), A100
/// (sm_80) and H100 / H200 (sm_90).
const ARCHS: [&str; 3] = ["sm_75", "sm_80", "sm_90"];

/// The names of the kernels a PTX module defines (`.entry NAME(`).
fn ptx_entries(ptx: &str) -> Vec<&str> {
    ptx.lines()
        .filter_map(|l| {
            let rest = l.trim_start().strip_prefix(".visible .entry ")?;
            Some(rest.split('(').next().unwrap_or(rest).trim())
        })
        .collect()
}

/// Fails the test, with what to do, when NVRTC cannot be loaded.
fn require_nvrtc() {
    assert!(
        nvrtc::available(),
        "NVRTC cannot be loaded (LD_LIBRARY_PATH={:?}): {}",
        std::env::var("LD_LIBRARY_PATH").unwrap_or_default(),
        nvrtc::SETUP_HINT
    );
}

#[test]
fn every_kernel_source_compiles_for_sm75_sm80_and_sm90() {
    require_nvrtc();
    let (major, minor) = nvrtc::version().expect("nvrtcVersion");
    eprintln!("NVRTC {major}.{minor}");
    let includes = cuda::include_paths_from_env();
    let mut failures = Vec::new();
    for arch in ARCHS {
        for src in SOURCES {
            match nvrtc::compile(src, arch, &includes) {
                Ok(c) => {
                    if !c.log.is_empty() {
                        failures.push(format!("{} {arch}: warnings:\n{}", src.file_name(), c.log));
                    }
                    let mut got = ptx_entries(&c.ptx);
                    let mut want = src.entry_points.to_vec();
                    got.sort_unstable();
                    want.sort_unstable();
                    if got != want {
                        failures.push(format!(
                            "{} {arch}: the PTX defines {got:?}, SOURCES lists {want:?}",
                            src.file_name()
                        ));
                    }
                    if c.cubin.as_ref().is_none_or(|b| b.is_empty()) {
                        failures.push(format!("{} {arch}: no CUBIN", src.file_name()));
                    }
                }
                Err(e) => failures.push(e.to_string()),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} problem(s):\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

/// The multi-tensor AdamW (one launch per run of AdamW ops, see `protrain_runtime::cuda::runs`)
/// compiles in every storage type, in the same unit as the per-tensor kernels it matches.
#[test]
fn the_multi_tensor_adamw_compiles_in_every_storage_type() {
    require_nvrtc();
    for dt in ["f32", "bf16", "f16"] {
        let entry = format!("adamw_multi_{dt}");
        let src = cuda::source_of(&entry).unwrap_or_else(|| panic!("{entry} is not in SOURCES"));
        assert_eq!(cuda::source_of(&format!("adamw_{dt}")), Some(src));
        let c = nvrtc::compile(src, "sm_90", &cuda::include_paths_from_env())
            .unwrap_or_else(|e| panic!("{entry}: {e}"));
        assert!(ptx_entries(&c.ptx).contains(&entry.as_str()), "{entry}");
    }
}

#[test]
fn a_compile_error_reports_the_file_and_line() {
    require_nvrtc();
    // A copy of a real source with one undefined name appended: the error must name the
    // family's file and a line within it, thanks to the #line directive after the prelude.
    let broken: &'static str = Box::leak(
        format!("{}\nint broken = undefined_name;\n", SOURCES[0].source).into_boxed_str(),
    );
    let src: &'static cuda::KernelSource = Box::leak(Box::new(cuda::KernelSource {
        source: broken,
        ..SOURCES[0]
    }));
    let err = nvrtc::compile(src, "sm_90", &[]).expect_err("the source does not compile");
    let text = err.to_string();
    assert!(text.contains(&src.file_name()), "{text}");
    assert!(text.contains("undefined_name"), "{text}");
}

/// The compiled-kernel cache: a first compile misses and stores the entry, a second load hits
/// it with the same CUBIN, a changed source misses, a corrupted or truncated entry is compiled
/// again and replaced (and hits afterwards), and no directory means no cache.
#[test]
fn compiled_kernels_are_cached_on_disk_and_rebuilt_when_corrupt() {
    use nvrtc::{compile_cached, CacheOutcome};
    require_nvrtc();
    let dir = tempfile::tempdir().unwrap();
    let src = SOURCES.iter().find(|s| s.name == "cast").unwrap();
    let load = |src: &'static cuda::KernelSource| {
        compile_cached(src, "sm_80", &[], Some(dir.path())).unwrap_or_else(|e| panic!("{e}"))
    };
    let (first, outcome) = load(src);
    assert_eq!(outcome, CacheOutcome::Miss);
    let files: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "one entry and no temporary file: {files:?}");
    let (second, outcome) = load(src);
    assert_eq!(outcome, CacheOutcome::Hit);
    assert_eq!(
        (&second.cubin, &second.ptx, &second.log),
        (&first.cubin, &first.ptx, &first.log)
    );

    // Another source text (a comment more) is another key.
    let changed: &'static str = Box::leak(format!("{}\n// changed\n", src.source).into_boxed_str());
    let changed: &'static cuda::KernelSource = Box::leak(Box::new(cuda::KernelSource {
        source: changed,
        ..*src
    }));
    assert_eq!(load(changed).1, CacheOutcome::Miss);
    assert_eq!(load(changed).1, CacheOutcome::Hit);

    // One flipped byte in the middle, then a truncated entry: each is rebuilt, then hits.
    let entry = &files[0];
    let mut bytes = std::fs::read(entry).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(entry, &bytes).unwrap();
    let (rebuilt, outcome) = load(src);
    assert_eq!(outcome, CacheOutcome::Rebuilt);
    assert_eq!(rebuilt.cubin, first.cubin);
    assert_eq!(load(src).1, CacheOutcome::Hit);
    let whole = std::fs::read(entry).unwrap();
    std::fs::write(entry, &whole[..whole.len() - 9]).unwrap();
    assert_eq!(load(src).1, CacheOutcome::Rebuilt);
    assert_eq!(load(src).1, CacheOutcome::Hit);

    let (off, outcome) = compile_cached(src, "sm_80", &[], None).unwrap();
    assert_eq!(outcome, CacheOutcome::Off);
    assert_eq!(off.cubin, first.cubin);
}
