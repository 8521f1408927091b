//! The README and `docs/` as a reader meets them: the README stays a short front door whose
//! first commands are the two users and CI run, its command table names every command the
//! binary has, the pages name no command the binary lacks and link only to files in this
//! repository; and code comments say what the code does, not the history of its making.

use crate::cli_support;
use crate::common::root;

use cli_support::{protrain, stdout};
use std::path::{Path, PathBuf};

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The README, every page of `docs/` and the benchmarks' two pages.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![
        root().join("README.md"),
        root().join("benches/README.md"),
        root().join("benches/RESULTS.md"),
    ];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("a docs/ directory")
        .map(|e| e.expect("a docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    assert!(!docs.is_empty(), "docs/ holds the user guides");
    pages.extend(docs);
    pages
}

/// The subcommands `protrain --help` lists, `help` aside.
fn commands() -> Vec<String> {
    let help = stdout(&protrain(&["--help"]));
    let listed = help
        .split("Commands:")
        .nth(1)
        .and_then(|rest| rest.split("Options:").next())
        .expect("--help lists the commands");
    let commands: Vec<String> = listed
        .lines()
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect();
    assert!(commands.len() >= 10, "{commands:?}");
    commands
}

#[test]
fn the_readme_is_a_front_door_that_starts_with_the_two_commands() {
    let readme = read(&root().join("README.md"));
    let lines = readme.lines().count();
    assert!(
        lines <= 300,
        "the README has {lines} lines; move detail to docs/"
    );
    let first_block: Vec<&str> = readme
        .split("```sh\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("a sh code block")
        .lines()
        .collect();
    assert_eq!(
        first_block,
        [
            "cargo run --release -- train gpt2-tiny --gpu-memory 4MiB   # the main job",
            "cargo test --workspace                                      # the tests",
        ],
        "the README's first commands are the ones users and CI rely on"
    );
}

#[test]
fn the_readme_command_table_names_every_command() {
    let readme = read(&root().join("README.md"));
    for command in commands() {
        assert!(
            readme.contains(&format!("| `{command}")),
            "the README's command table has no row for `{command}`"
        );
    }
}

#[test]
fn the_pages_name_no_command_the_binary_lacks() {
    let commands = commands();
    for page in pages() {
        let text = read(&page);
        // `protrain WORD` in inline code, and `protrain WORD` or `$ protrain WORD` starting a
        // line of a code block.
        let inline = text.split("`protrain ").skip(1);
        let mut in_block = false;
        let block = text.lines().filter_map(move |l| {
            if l.trim_start().starts_with("```") {
                in_block = !in_block;
                return None;
            }
            let l = l.trim_start().trim_start_matches("$ ");
            in_block.then(|| l.strip_prefix("protrain ")).flatten()
        });
        for rest in inline.chain(block) {
            let word: String = rest
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '-')
                .collect();
            if word.is_empty() || word.starts_with('-') {
                continue; // `protrain <command>`, `protrain --help`
            }
            assert!(
                commands.contains(&word) || word == "help",
                "{} names `protrain {word}`, which is no command (the commands: {})",
                page.display(),
                commands.join(", ")
            );
        }
    }
}

#[test]
fn the_pages_link_only_to_files_in_the_repository() {
    for page in pages() {
        let text = read(&page);
        assert!(
            !text.contains("../shared"),
            "{} points outside the repository (../shared)",
            page.display()
        );
        let dir = page.parent().expect("a page's directory");
        for target in text.split("](").skip(1).filter_map(|t| t.split(')').next()) {
            if target.starts_with("http") || target.starts_with('#') {
                continue;
            }
            let file = target.split('#').next().expect("a path");
            assert!(
                dir.join(file).exists(),
                "{} links to {target}, which does not exist",
                page.display()
            );
        }
    }
}

/// Source files whose comments are checked, under `dir`, skipping build outputs.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a readable directory") {
        let path = entry.expect("an entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if !matches!(name, "target" | ".git" | "snapshots" | "fixtures") {
                sources(&path, out);
            }
        } else if ["rs", "sh", "py", "cu", "cuh", "cpp", "h"]
            .iter()
            .any(|x| path.extension().is_some_and(|e| e == *x))
        {
            out.push(path);
        }
    }
}

/// The history a comment line tells (a numbered work period or issue, a discarded attempt),
/// if any.
fn history(comment: &str) -> Option<&'static str> {
    let lower = comment.to_lowercase();
    for (marker, what) in [
        ("session ", "a numbered session"),
        ("issue ", "an issue number"),
    ] {
        for (at, _) in lower.match_indices(marker) {
            let after = &lower[at + marker.len()..];
            if after.starts_with(|c: char| c.is_ascii_digit()) {
                return Some(what);
            }
        }
    }
    ["not kept", "tried and"]
        .into_iter()
        .find(|m| lower.contains(m))
        .map(|_| "an attempt not kept")
}

#[test]
fn code_comments_tell_no_development_history() {
    let mut files = vec![root().join(".ci/run")];
    sources(&root(), &mut files);
    let mut found = Vec::new();
    for file in files {
        let relative = file.strip_prefix(root()).expect("under the root");
        for (n, line) in read(&file).lines().enumerate() {
            let line = line.trim_start();
            if !(line.starts_with("//") || line.starts_with('#')) {
                continue;
            }
            if let Some(what) = history(line) {
                found.push(format!("{}:{}: {what}: {line}", relative.display(), n + 1));
            }
        }
    }
    assert!(
        found.is_empty(),
        "comments say what the code does and why; history belongs in commit messages and \
         measurements in benches/RESULTS.md:\n{}",
        found.join("\n")
    );
}
