//! The compiler's integration tests, one module per subject, linked into one test binary
//! (`cargo test -p protrain-compiler --test it`; one subject: `-- plan::`).

mod accumulate;
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
