//! The compiler's integration tests, one module per subject, linked into one test binary
//! (`cargo test -p protrain-compiler --test it`; one subject: `-- plan::`).

// cost.rs, fuse.rs and simulate.rs hold their tests in an inner module of the file's own name
// (test paths `cost::cost::...`), which the filter `cost::` selects all the same.
#![allow(clippy::module_inception)]

mod accumulate;
mod common;
mod cost;
mod data_parallel;
mod forward_only;
mod fuse;
mod movement;
mod pipeline;
mod plan;
mod schedule_golden;
mod search;
mod search_choice;
mod simulate;
mod validate;
