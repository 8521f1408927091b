//! protrain's compiler: from a forward graph to a training graph and, later passes, to a
//! verified schedule. One pass per file; `pipeline` lists them in order.

pub mod accumulate;
pub mod autodiff;
pub mod bound;
pub mod carry;
pub mod chunk;
pub mod comm;
pub mod cost;
pub mod data_parallel;
pub mod disk;
pub mod egraph;
pub mod emit;
pub mod error;
pub mod fuse;
pub mod interleave;
pub mod lower;
pub mod movement;
pub mod pad_rows;
pub mod pipeline;
pub mod place;
pub mod plan;
pub mod search;
pub mod search_forward;
pub mod shard;
pub mod simulate;
pub mod split;
pub mod streams;
pub mod validate;

pub use autodiff::OptimizerConfig;
pub use error::{CompileError, Result};

/// The crate's architecture, checked on its own source: the modules import one another in one
/// direction, and only `plan` lays out memory.
#[cfg(test)]
mod architecture {
    use std::collections::{BTreeMap, BTreeSet};
    use std::path::Path;

    /// Each module's source (a folder module's files together), its comments and its
    /// `#[cfg(test)]` tail left out: what the compiled crate is made of.
    fn modules() -> BTreeMap<String, String> {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut out = BTreeMap::new();
        let mut files = Vec::new();
        for entry in std::fs::read_dir(&src).expect("src") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                for inner in std::fs::read_dir(&path).expect("folder") {
                    files.push(inner.expect("entry").path());
                }
            } else {
                files.push(path);
            }
        }
        for path in files {
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let relative = path.strip_prefix(&src).expect("under src");
            let module = relative
                .iter()
                .next()
                .and_then(|c| c.to_str())
                .expect("a name")
                .trim_end_matches(".rs")
                .to_string();
            if module == "lib" {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("readable");
            let text = text.split("#[cfg(test)]").next().unwrap_or("");
            let code: String = text
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .map(|l| format!("{l}\n"))
                .collect();
            out.entry(module)
                .or_insert_with(String::new)
                .push_str(&code);
        }
        out
    }

    /// The modules `code` names as `crate::NAME`, including those of `use crate::{..}`.
    fn imports(code: &str, names: &BTreeSet<String>) -> BTreeSet<String> {
        let mut found = BTreeSet::new();
        for (at, _) in code.match_indices("crate::") {
            let rest = &code[at + "crate::".len()..];
            let group = match rest.strip_prefix('{') {
                Some(inner) => &inner[..inner.find('}').unwrap_or(inner.len())],
                None => rest,
            };
            for part in group.split(',') {
                let name: String = part
                    .trim()
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if names.contains(&name) {
                    found.insert(name);
                }
                if !rest.starts_with('{') {
                    break;
                }
            }
        }
        found
    }

    #[test]
    fn modules_import_each_other_in_one_direction() {
        let modules = modules();
        let names: BTreeSet<String> = modules.keys().cloned().collect();
        let edges: BTreeMap<&str, BTreeSet<String>> = modules
            .iter()
            .map(|(m, code)| {
                let mut to = imports(code, &names);
                to.remove(m);
                (m.as_str(), to)
            })
            .collect();
        // A module is in a cycle when it reaches itself.
        let mut cycles = Vec::new();
        for &start in edges.keys() {
            let mut seen = BTreeSet::new();
            let mut stack: Vec<&str> = edges[start].iter().map(String::as_str).collect();
            while let Some(m) = stack.pop() {
                if m == start {
                    cycles.push(start);
                    break;
                }
                if seen.insert(m) {
                    stack.extend(edges[m].iter().map(String::as_str));
                }
            }
        }
        assert!(
            cycles.is_empty(),
            "these modules import themselves through others: {cycles:?}; imports: {edges:?}"
        );
    }

    #[test]
    fn only_plan_lays_out_memory() {
        let mut offenders = Vec::new();
        for (module, code) in modules() {
            if module == "plan" {
                continue;
            }
            for line in code.lines() {
                let line = line.trim();
                let assigns = |field: &str| {
                    line.split(field).skip(1).any(|after| {
                        let after = after.trim_start();
                        (after.starts_with('=') && !after.starts_with("=="))
                            || after.starts_with("+=")
                    })
                };
                let lays_out = assigns(".offset")
                    || assigns("schedule.arena_bytes")
                    || assigns("schedule.host_bytes")
                    || assigns("schedule.disk_bytes")
                    || (module != "streams" && line.contains("Buffer {"));
                if lays_out {
                    offenders.push(format!("{module}: {line}"));
                }
            }
        }
        assert!(
            offenders.is_empty(),
            "offsets and region sizes are plan's to give:\n{}",
            offenders.join("\n")
        );
    }
}
