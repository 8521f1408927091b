//! protrain's runtime: executes compiled schedules, with the host kernels, data loading and
//! weight files they need.
//!
//! The runtime never depends on the compiler: a schedule file is all it needs.

pub mod affinity;
pub mod backend;
pub mod checkpoint;
pub mod collective;
pub mod cuda;
pub mod data;
pub mod disk;
pub mod dispatch;
pub mod error;
pub mod eval;
pub mod executor;
pub mod host;
pub mod interpreter;
pub mod kernels;
pub mod loss_scale;
pub mod lr_schedule;
mod memory;
pub mod params;
pub mod profiler;
pub mod rendezvous;
pub mod rng;
pub mod run_settings;
pub mod synthetic;
pub mod text;
pub mod thread_ranks;
pub mod train;
pub mod weights;

pub use backend::Backend;
pub use error::{Result, RuntimeError};
pub use executor::{Executor, Span, StepTiming};
pub use host::HostBackend;
pub use train::{RunSettings, StepRecord, Trainer, WeightReads};

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::path::Path;

    /// The modules of this crate (by top-level name) each module's code (comments and its
    /// `mod tests` left out) names through `crate::`.
    fn module_imports() -> BTreeMap<String, BTreeSet<String>> {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = vec![src.clone()];
        let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        while let Some(dir) = files.pop() {
            for entry in std::fs::read_dir(&dir).expect("the source directory") {
                let path = entry.expect("an entry").path();
                if path.is_dir() {
                    files.push(path);
                    continue;
                }
                if path.extension().is_none_or(|e| e != "rs") || path.ends_with("src/lib.rs") {
                    continue;
                }
                let rel = path.strip_prefix(&src).expect("under src");
                let top = rel.components().next().expect("a component");
                let top = top.as_os_str().to_string_lossy();
                let module = top.trim_end_matches(".rs").to_string();
                let text = std::fs::read_to_string(&path).expect("a source file");
                let code = text
                    .split("#[cfg(test)]\nmod tests")
                    .next()
                    .unwrap_or_default();
                let names = out.entry(module.clone()).or_default();
                for line in code.lines() {
                    let line = line.split("//").next().unwrap_or_default();
                    for (i, _) in line.match_indices("crate::") {
                        let rest = &line[i + "crate::".len()..];
                        let name: String = rest
                            .chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect();
                        if !name.is_empty() && name != module {
                            names.insert(name);
                        }
                    }
                }
            }
        }
        let modules: BTreeSet<String> = out.keys().cloned().collect();
        for names in out.values_mut() {
            names.retain(|n| modules.contains(n));
        }
        out
    }

    /// A cycle of `imports`, as the modules along it, if there is one.
    fn a_cycle(imports: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
        fn visit(
            at: &str,
            imports: &BTreeMap<String, BTreeSet<String>>,
            path: &mut Vec<String>,
            done: &mut BTreeSet<String>,
        ) -> Option<Vec<String>> {
            if let Some(i) = path.iter().position(|m| m == at) {
                let mut cycle = path[i..].to_vec();
                cycle.push(at.to_string());
                return Some(cycle);
            }
            if done.contains(at) {
                return None;
            }
            path.push(at.to_string());
            for next in &imports[at] {
                if let Some(cycle) = visit(next, imports, path, done) {
                    return Some(cycle);
                }
            }
            path.pop();
            done.insert(at.to_string());
            None
        }
        let mut done = BTreeSet::new();
        imports
            .keys()
            .find_map(|m| visit(m, imports, &mut Vec::new(), &mut done))
    }

    /// The runtime's modules form a DAG: shared pieces live in the module both sides read, and
    /// the CUDA backend owns its communicator (the generic `Collective` names no backend).
    #[test]
    fn modules_import_each_other_without_cycles() {
        let imports = module_imports();
        assert!(
            imports["train"].contains("checkpoint"),
            "the scan sees imports"
        );
        assert_eq!(a_cycle(&imports), None, "{imports:#?}");
    }
}
