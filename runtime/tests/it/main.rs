//! The runtime's integration tests, one module per subject, linked into one test binary
//! (`cargo test -p protrain-runtime --test it`; one subject: `-- text::`). The CUDA modules
//! build only with the `cuda` feature.

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod cuda_probe;
#[cfg(feature = "cuda")]
mod nccl;
#[cfg(feature = "cuda")]
mod nvrtc;
mod rendezvous;
mod text;
