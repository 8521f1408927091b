//! The models crate's integration tests, one module per subject, linked into one test binary
//! (`cargo test -p protrain-models --test it`; one subject: `-- parsing::`).

mod errors;
mod graphs;
mod moe;
mod params;
mod parsing;
mod phi3;
