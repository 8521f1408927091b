//! The `protrain` crate's integration tests, one module per subject, linked into one test
//! binary (`cargo test --test it`; one subject: `cargo test --test it -- cli::`).
//! `cli_support` runs the built binary; `common` holds what the tests that train share.

mod adamw_launches;
mod capacity;
mod checkpoint;
mod cli;
mod cli_support;
mod common;
mod compile_cli;
#[cfg(feature = "cuda")]
mod cuda_e2e;
mod data_parallel;
mod disk_tier;
mod docs;
mod equivalence;
mod eval;
mod eval_cli;
mod fuzz;
mod grad_accum;
mod host_bf16;
mod host_f16;
mod host_layout;
mod launcher;
mod lr_schedule;
mod padded_rows;
mod parity;
mod profile_cli;
mod reliability;
mod run_cli;
mod schedules;
mod sharded;
mod sharded_checkpoint;
mod staged_layout;
