//! CUDA kernel sources for every op kind but the matmuls, and (feature `cuda`) their NVRTC
//! compilation.
//!
//! The kernels live as `.cu` files in `kernels/`, one per op family as in
//! [`crate::kernels`], whose semantics they reproduce (f32 compute; `_f32`, `_bf16` and `_f16`
//! variants; deterministic reductions without floating-point atomics). Each source here is the
//! shared prelude `kernels/common.cuh` followed by the family's file, so it compiles on its own
//! with NVRTC, with no include path and no system header. [`SOURCES`] lists them with their
//! entry points; it is plain data, available without the `cuda` feature, so CPU-only builds can
//! check it. Matmuls (linear forward and backward) go to cuBLAS / cuBLASLt and are not here; the
//! mixture-of-experts grouped matmul is (`kernels/moe.cu`), since it reads its group boundaries
//! from device memory.
//!
//! Launch shapes are documented beside each entry point in the `.cu` files. The attention
//! tiles a launcher sizes grids with are defined here only and passed to NVRTC as `-D` defines
//! ([`KERNEL_DEFINES`]); workspace sizes come from `protrain_ir::WorkspaceLayout`.
//!
//! With the feature, `CudaBackend` executes schedules on a GPU (`backend.rs`: memory, streams
//! and events, and the executor of call plans; `launch.rs`: each op kind's kernels and GEMMs
//! as a pure call plan; `blas.rs`: the matmuls;
//! `replay.rs`: each op's launches resolved once and replayed every step;
//! `driver.rs`: driver resources and the library probe; `profile.rs`: measuring a GPU for
//! `protrain profile`; `nccl.rs`: NCCL collectives between one process per GPU, whose call
//! plans are plain data built without the feature too). [`runs`] (plain data, built without
//! the feature too) says which adjacent device AdamW ops the backend updates in one
//! multi-tensor launch. [`available`] says, without calling into a library that may be
//! missing, whether it can run here.

#[cfg(feature = "cuda")]
pub mod backend;
#[cfg(feature = "cuda")]
mod blas;
#[cfg(feature = "cuda")]
mod driver;
#[cfg(feature = "cuda")]
mod launch;
pub mod nccl;
#[cfg(feature = "cuda")]
pub mod nvrtc;
#[cfg(feature = "cuda")]
pub mod profile;
#[cfg(feature = "cuda")]
mod replay;
pub mod runs;

#[cfg(feature = "cuda")]
pub use backend::{CudaBackend, CudaStreamHandle, DROP_WAIT_VAR};
#[cfg(feature = "cuda")]
pub use driver::{
    check_dtypes, gpu, simulator_counters, use_gpu, DeviceInfo, SimCounters,
    BF16_MIN_COMPUTE_CAPABILITY, MIN_COMPUTE_CAPABILITY,
};
#[cfg(feature = "cuda")]
pub use replay::{launch_counters, LaunchCounters};
pub use runs::{adamw_runs, AdamWRun};

/// What `--backend cuda` says in a build without the CUDA backend.
pub const NOT_BUILT: &str = "the CUDA backend is not built into this protrain; rebuild with \
                             --features cuda on a machine with CUDA, or use --backend host";

/// Whether the CUDA backend can run here: built in (feature `cuda`), with an NVIDIA driver for
/// CUDA 13, a GPU, cuBLAS and NVRTC loadable. Probes each library before any call into it
/// (cudarc panics on a call into a library it cannot load). The error says what is missing
/// and what to do.
pub fn available() -> Result<(), String> {
    #[cfg(feature = "cuda")]
    {
        driver::probe().map(|_| ()).map_err(|e| match e {
            crate::RuntimeError::CudaUnavailable(why) => why,
            other => other.to_string(),
        })
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(NOT_BUILT.to_string())
    }
}

/// The GPU this process runs on ([`use_gpu`], GPU 0 unless set): its name, compute capability
/// and memory, as the driver reports them (on the CPU simulator the name says so). The error
/// is [`available`]'s.
#[cfg(feature = "cuda")]
pub fn device() -> Result<DeviceInfo, String> {
    driver::probe().map_err(|e| match e {
        crate::RuntimeError::CudaUnavailable(why) => why,
        other => other.to_string(),
    })
}

use crate::kernels::AdamWConfig;

/// One NVRTC compilation unit: a family's kernels with the prelude in front.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelSource {
    /// The family, also the `.cu` file's stem (`"norm"` for `kernels/norm.cu`).
    pub name: &'static str,
    /// The full text NVRTC compiles: `common.cuh`, a `#line` directive, the family's file.
    pub source: &'static str,
    /// Every `extern "C" __global__` function of the source, in file order.
    pub entry_points: &'static [&'static str],
}

impl KernelSource {
    /// The program name given to NVRTC, which its log uses for the family's own lines.
    pub fn file_name(&self) -> String {
        format!("{}.cu", self.name)
    }
}

/// The prelude every source starts with (bf16 and f16 conversions, warp and block reductions).
pub const PRELUDE: &str = include_str!("kernels/common.cuh");

/// `common.cuh`, then a `#line` directive so NVRTC's messages give the family file's own line
/// numbers, then the file.
macro_rules! kernel_source {
    ($name:literal, [$($entry:literal),* $(,)?]) => {
        KernelSource {
            name: $name,
            source: concat!(
                include_str!("kernels/common.cuh"),
                "\n#line 1 \"",
                $name,
                ".cu\"\n",
                include_str!(concat!("kernels/", $name, ".cu")),
            ),
            entry_points: &[$($entry),*],
        }
    };
}

/// Every kernel source, with its entry points.
pub const SOURCES: &[KernelSource] = &[
    kernel_source!(
        "activation",
        [
            "gelu_forward_f32",
            "gelu_forward_bf16",
            "gelu_forward_f16",
            "gelu_backward_f32",
            "gelu_backward_bf16",
            "gelu_backward_f16",
            "relu_forward_f32",
            "relu_forward_bf16",
            "relu_forward_f16",
            "relu_backward_f32",
            "relu_backward_bf16",
            "relu_backward_f16",
            "silu_forward_f32",
            "silu_forward_bf16",
            "silu_forward_f16",
            "silu_backward_f32",
            "silu_backward_bf16",
            "silu_backward_f16",
            "swiglu_forward_f32",
            "swiglu_forward_bf16",
            "swiglu_forward_f16",
            "swiglu_backward_f32",
            "swiglu_backward_bf16",
            "swiglu_backward_f16",
            "packed_swiglu_forward_f32",
            "packed_swiglu_forward_bf16",
            "packed_swiglu_forward_f16",
            "packed_swiglu_backward_f32",
            "packed_swiglu_backward_bf16",
            "packed_swiglu_backward_f16",
            "geglu_forward_f32",
            "geglu_forward_bf16",
            "geglu_forward_f16",
            "geglu_backward_f32",
            "geglu_backward_bf16",
            "geglu_backward_f16",
            "softcap_forward_f32",
            "softcap_forward_bf16",
            "softcap_forward_f16",
            "softcap_backward_f32",
            "softcap_backward_bf16",
            "softcap_backward_f16",
            "scale_forward_f32",
            "scale_forward_bf16",
            "scale_forward_f16",
        ]
    ),
    kernel_source!(
        "add",
        [
            "add_forward_f32",
            "add_forward_bf16",
            "add_forward_f16",
            "add_backward_f32",
            "add_backward_bf16",
            "add_backward_f16",
            "bias_add_f32",
            "bias_add_bf16",
            "bias_add_f16",
        ]
    ),
    kernel_source!(
        "cast",
        [
            "cast_f32_to_bf16",
            "cast_bf16_to_f32",
            "cast_f32_to_f16",
            "cast_f16_to_f32",
        ]
    ),
    kernel_source!(
        "embedding",
        [
            "check_tokens",
            "embedding_forward_f32",
            "embedding_forward_bf16",
            "embedding_forward_f16",
            "embedding_backward_span",
            "embedding_backward_f32",
            "embedding_backward_bf16",
            "embedding_backward_f16",
            "position_embedding_forward_f32",
            "position_embedding_forward_bf16",
            "position_embedding_forward_f16",
            "position_embedding_backward_f32",
            "position_embedding_backward_bf16",
            "position_embedding_backward_f16",
        ]
    ),
    kernel_source!(
        "norm",
        [
            "layer_norm_forward_f32",
            "layer_norm_forward_bf16",
            "layer_norm_forward_f16",
            "layer_norm_backward_f32",
            "layer_norm_backward_bf16",
            "layer_norm_backward_f16",
            "rms_norm_forward_f32",
            "rms_norm_forward_bf16",
            "rms_norm_forward_f16",
            "rms_norm_backward_f32",
            "rms_norm_backward_bf16",
            "rms_norm_backward_f16",
            "norm_backward_params_partial_f32",
            "norm_backward_params_partial_bf16",
            "norm_backward_params_partial_f16",
        ]
    ),
    kernel_source!(
        "reduce",
        [
            "column_sum_partial_f32",
            "column_sum_partial_bf16",
            "column_sum_partial_f16",
            "column_sum_finish_f32",
            "column_sum_finish_bf16",
            "column_sum_finish_f16",
            "grad_norm_sq_partial_f32",
            "grad_norm_sq_partial_bf16",
            "grad_norm_sq_partial_f16",
            "grad_norm_sq_finish",
        ]
    ),
    kernel_source!(
        "rope",
        [
            "rope_forward_f32",
            "rope_forward_bf16",
            "rope_forward_f16",
            "rope_backward_f32",
            "rope_backward_bf16",
            "rope_backward_f16",
        ]
    ),
    kernel_source!(
        "attention",
        [
            "attention_forward_f32",
            "attention_forward_bf16",
            "attention_forward_f16",
            "attention_backward_delta_f32",
            "attention_backward_delta_bf16",
            "attention_backward_delta_f16",
            "attention_backward_dq_f32",
            "attention_backward_dq_bf16",
            "attention_backward_dq_f16",
            "attention_backward_dkv_f32",
            "attention_backward_dkv_bf16",
            "attention_backward_dkv_f16",
            "attention_softmax_f32",
            "attention_softmax_bf16",
            "attention_softmax_f16",
            "attention_backward_ds_f32",
            "attention_backward_ds_bf16",
            "attention_backward_ds_f16",
            "flash_attention_forward_bf16_d64",
            "flash_attention_backward_dq_bf16_d64",
            "flash_attention_backward_dkv_bf16_d64",
            "flash_attention_forward_bf16_d128",
            "flash_attention_backward_dq_bf16_d128",
            "flash_attention_backward_dkv_bf16_d128",
            "flash_attention_forward_bf16_d256",
            "flash_attention_backward_dq_bf16_d256",
            "flash_attention_backward_dkv_bf16_d256",
            "flash_attention_forward_f16_d64",
            "flash_attention_backward_dq_f16_d64",
            "flash_attention_backward_dkv_f16_d64",
            "flash_attention_forward_f16_d128",
            "flash_attention_backward_dq_f16_d128",
            "flash_attention_backward_dkv_f16_d128",
            "flash_attention_forward_f16_d256",
            "flash_attention_backward_dq_f16_d256",
            "flash_attention_backward_dkv_f16_d256",
        ]
    ),
    kernel_source!(
        "cross_entropy",
        [
            "cross_entropy_forward_f32",
            "cross_entropy_forward_bf16",
            "cross_entropy_forward_f16",
            "cross_entropy_loss",
            "cross_entropy_backward_f32",
            "cross_entropy_backward_bf16",
            "cross_entropy_backward_f16",
        ]
    ),
    kernel_source!(
        "adamw",
        [
            "adamw_f32",
            "adamw_bf16",
            "adamw_f16",
            "adamw_multi_f32",
            "adamw_multi_bf16",
            "adamw_multi_f16",
            "clip_coef",
            "unscale_coef",
            "scale_f32",
            "scale_bf16",
            "scale_f16",
            "scale_by_f32",
            "scale_by_bf16",
            "scale_by_f16",
        ]
    ),
    kernel_source!(
        "moe",
        [
            "moe_route_softmax_f32",
            "moe_route_softmax_bf16",
            "moe_route_softmax_f16",
            "moe_route_pack",
            "moe_route_backward_f32",
            "moe_route_backward_bf16",
            "moe_route_backward_f16",
            "moe_dispatch_f32",
            "moe_dispatch_bf16",
            "moe_dispatch_f16",
            "moe_dispatch_backward_f32",
            "moe_dispatch_backward_bf16",
            "moe_dispatch_backward_f16",
            "grouped_linear_forward_f32",
            "grouped_linear_forward_bf16",
            "grouped_linear_forward_f16",
            "grouped_linear_backward_dx_f32",
            "grouped_linear_backward_dx_bf16",
            "grouped_linear_backward_dx_f16",
            "grouped_linear_backward_dw_f32",
            "grouped_linear_backward_dw_bf16",
            "grouped_linear_backward_dw_f16",
            "moe_combine_f32",
            "moe_combine_bf16",
            "moe_combine_f16",
            "moe_combine_backward_dys_f32",
            "moe_combine_backward_dys_bf16",
            "moe_combine_backward_dys_f16",
            "moe_combine_backward_weights_f32",
            "moe_combine_backward_weights_bf16",
            "moe_combine_backward_weights_f16",
            "moe_aux_loss_f32",
            "moe_aux_loss_bf16",
            "moe_aux_loss_f16",
            "moe_aux_grads_f32",
            "moe_aux_grads_bf16",
            "moe_aux_grads_f16",
            "moe_aux_loss_backward_f32",
            "moe_aux_loss_backward_bf16",
            "moe_aux_loss_backward_f16",
        ]
    ),
];

/// The source that defines `entry_point`, if any.
pub fn source_of(entry_point: &str) -> Option<&'static KernelSource> {
    SOURCES
        .iter()
        .find(|s| s.entry_points.contains(&entry_point))
}

/// Macros every source is compiled with, as `-D NAME=VALUE`: the attention kernels' tile
/// constants, which launchers size grids with. `kernels/attention.cu` defines none of them (it
/// stops with `#error` without them), so this table is their only copy; `.ci/run` reads it to
/// compile the CPU emulation harness.
pub const KERNEL_DEFINES: [(&str, u64); 7] = [
    ("ATTN_MAX_D", 128),
    ("ATTN_THREADS", 128),
    ("ATTN_FWD_ROWS", 16),
    ("ATTN_DQ_ROWS", 8),
    ("ATTN_DKV_ROWS", 8),
    ("ATTN_FLASH_THREADS", 128),
    ("ATTN_FLASH_ROWS", 64),
];

/// The attention kernels' largest head dimension (`ATTN_MAX_D`); they trap on a larger one.
pub const ATTN_MAX_HEAD_DIM: usize = KERNEL_DEFINES[0].1 as usize;
/// Threads per block of every attention kernel but the delta step (`ATTN_THREADS`).
pub const ATTN_THREADS: u32 = KERNEL_DEFINES[1].1 as u32;
/// Query rows per forward block: grid `(ceil(T / this), H, B)` (`ATTN_FWD_ROWS`).
pub const ATTN_FWD_ROWS: usize = KERNEL_DEFINES[2].1 as usize;
/// Query rows per dq block: grid `(ceil(T / this), H, B)` (`ATTN_DQ_ROWS`).
pub const ATTN_DQ_ROWS: usize = KERNEL_DEFINES[3].1 as usize;
/// Key rows per dk/dv block: grid `(ceil(T / this), KV, B)` (`ATTN_DKV_ROWS`).
pub const ATTN_DKV_ROWS: usize = KERNEL_DEFINES[4].1 as usize;
/// Threads per block of the flash attention kernels (`ATTN_FLASH_THREADS`, 4 warps).
pub const ATTN_FLASH_THREADS: u32 = KERNEL_DEFINES[5].1 as u32;
/// Rows per flash attention block, 16 per warp: grid `(ceil(T / this), H, B)` for the forward
/// and dq, `(ceil(T / this), KV, B)` for dk/dv (`ATTN_FLASH_ROWS`).
pub const ATTN_FLASH_ROWS: usize = KERNEL_DEFINES[6].1 as usize;

/// The block shape of the column-sum partial kernels (`column_sum_partial_*`,
/// `norm_backward_params_partial_*`): 32 columns by 8 row lanes (32 parts of 16 bytes of
/// columns for the norm's, 128 f32 or 256 bf16 and f16 columns).
pub const COLUMN_SUM_BLOCK: (u32, u32) = (32, 8);
/// Rows per chunk of the column sums: a function of nothing but this constant, so the order
/// of every sum, and so its bits, depends only on the shape.
pub const COLUMN_SUM_ROWS_PER_CHUNK: usize = protrain_ir::op::REDUCTION_ROWS as usize;

/// Chunks (the partials' leading dimension) of a column sum over `rows` rows: the workspace
/// is `column_sum_chunks(rows) * cols` f32s per summed parameter.
pub fn column_sum_chunks(rows: usize) -> usize {
    protrain_ir::op::reduction_chunks(rows as u64) as usize
}

/// Blocks (= f64 partials) of `grad_norm_sq_partial_*` over `n` elements with 256-thread
/// blocks: enough to fill a GPU, at most 1024, and a function of `n` alone.
pub fn grad_norm_partials(n: usize) -> usize {
    protrain_ir::op::grad_norm_partials(n as u64) as usize
}

/// The f32 scalars of one `adamw_f32` / `adamw_bf16` launch, rounded from f64 arithmetic as
/// the host kernel ([`crate::kernels::adamw_step`], which matches torch) rounds them, so a
/// device step gives the host's bits. Pass them in field order after `grad_scale`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWScalars {
    /// `1 - lr * weight_decay` (exactly 1 when weight decay is off: multiplying by it is exact).
    pub decay: f32,
    /// `1 - beta1`, the weight of `exp_avg.lerp_(grad, 1 - beta1)`.
    pub lerp_w: f32,
    /// `beta2`.
    pub beta2: f32,
    /// `1 - beta2`.
    pub one_minus_beta2: f32,
    /// `sqrt(1 - beta2^step)`.
    pub bc2_sqrt: f32,
    /// `eps`.
    pub eps: f32,
    /// `-lr / (1 - beta1^step)`.
    pub neg_step_size: f32,
}

impl AdamWScalars {
    /// The scalars of step `step` (1-based, after this step's increment).
    pub fn new(cfg: &AdamWConfig, step: u64) -> Self {
        assert!(step >= 1, "adamw: step is 1-based");
        let t = step as f64;
        let bias_correction1 = 1.0 - cfg.beta1.powf(t);
        let bias_correction2 = 1.0 - cfg.beta2.powf(t);
        AdamWScalars {
            decay: if cfg.weight_decay != 0.0 {
                (1.0 - cfg.lr * cfg.weight_decay) as f32
            } else {
                1.0
            },
            lerp_w: (1.0 - cfg.beta1) as f32,
            beta2: cfg.beta2 as f32,
            one_minus_beta2: (1.0 - cfg.beta2) as f32,
            bc2_sqrt: bias_correction2.sqrt() as f32,
            eps: cfg.eps as f32,
            neg_step_size: (-(cfg.lr / bias_correction1)) as f32,
        }
    }
}

/// Include directories for NVRTC from `PROTRAIN_CUDA_INCLUDE` (`:`-separated; unset or empty:
/// none), as `scripts/nvrtc-env.sh` exports it. The sources need none today; the variable lets
/// a kernel use the CUDA headers (`cuda_bf16.h`) later without changing the callers.
pub fn include_paths_from_env() -> Vec<String> {
    std::env::var("PROTRAIN_CUDA_INCLUDE")
        .map(|v| {
            v.split(':')
                .filter(|p| !p.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// The names of the `extern "C" __global__` functions defined in `text`, in order.
    fn declared_entry_points(text: &str) -> Vec<&str> {
        const MARK: &str = "extern \"C\" __global__ void ";
        text.match_indices(MARK)
            .map(|(at, _)| {
                let rest = &text[at + MARK.len()..];
                &rest[..rest.find('(').expect("an entry point has a parameter list")]
            })
            .collect()
    }

    #[test]
    fn every_entry_point_is_listed_once_and_defined() {
        let mut seen = BTreeSet::new();
        for src in SOURCES {
            assert_eq!(
                declared_entry_points(src.source),
                src.entry_points,
                "{}: the list must name every extern \"C\" kernel, in file order",
                src.file_name()
            );
            for &e in src.entry_points {
                assert!(seen.insert(e), "{e} is listed twice");
                assert_eq!(source_of(e).map(|s| s.name), Some(src.name));
            }
        }
        assert!(
            declared_entry_points(PRELUDE).is_empty(),
            "the prelude defines no kernel"
        );
    }

    #[test]
    fn sources_are_self_contained() {
        for src in SOURCES {
            assert!(src.source.starts_with(PRELUDE), "{}", src.name);
            let body = &src.source[PRELUDE.len()..];
            assert!(
                body.starts_with(&format!("\n#line 1 \"{}\"\n", src.file_name())),
                "{}",
                src.name
            );
            // NVRTC has no system headers; the sources include nothing so that no include path
            // is needed where the kernels are compiled at run time.
            assert!(
                !src.source
                    .lines()
                    .any(|l| l.trim_start().starts_with("#include")),
                "{} includes a header",
                src.name
            );
        }
    }

    #[test]
    fn every_op_family_with_host_kernels_has_device_kernels() {
        // Families of `crate::kernels`, less `linear` (its matmuls go to cuBLAS; its bias add
        // and bias gradient are in `add` and `reduce`).
        for family in [
            "activation",
            "adamw",
            "add",
            "attention",
            "cross_entropy",
            "embedding",
            "moe",
            "norm",
            "rope",
        ] {
            assert!(SOURCES.iter().any(|s| s.name == family), "{family}");
        }
    }

    /// The element update of `adamw.cu`, transcribed operation by operation (`mul_add` where
    /// it calls `fmaf`, plain operations where it rounds each one).
    fn device_update(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: AdamWScalars) {
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            let pi = *p * s.decay;
            let diff = g - *m;
            let mi = if s.lerp_w.abs() < 0.5 {
                s.lerp_w.mul_add(diff, *m)
            } else {
                (s.lerp_w - 1.0).mul_add(diff, g)
            };
            let vi = (s.one_minus_beta2 * g).mul_add(g, *v * s.beta2);
            let denom = vi.sqrt() / s.bc2_sqrt + s.eps;
            *m = mi;
            *v = vi;
            *p = pi + (s.neg_step_size * mi) / denom;
        }
    }

    #[test]
    fn adamw_scalars_reproduce_the_host_step_to_the_bit() {
        let n = 1000;
        let wave = |k: f32| -> Vec<f32> { (0..n).map(|i| ((i as f32) * k).sin()).collect() };
        let (p0, g, m0) = (wave(0.37), wave(1.3), wave(0.11));
        let v0: Vec<f32> = wave(0.07).iter().map(|x| x.abs()).collect();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for cfg in [
            AdamWConfig::default(),
            AdamWConfig {
                weight_decay: 0.0,
                beta1: 0.3,
                ..AdamWConfig::default()
            },
        ] {
            for step in [1, 2, 1000] {
                let (mut p1, mut m1, mut v1) = (p0.clone(), m0.clone(), v0.clone());
                crate::kernels::adamw_step(&mut p1, &g, &mut m1, &mut v1, step, &cfg);
                let (mut p2, mut m2, mut v2) = (p0.clone(), m0.clone(), v0.clone());
                device_update(&mut p2, &g, &mut m2, &mut v2, AdamWScalars::new(&cfg, step));
                assert_eq!(bits(&p1), bits(&p2), "param, {cfg:?} step {step}");
                assert_eq!(bits(&m1), bits(&m2), "exp_avg, {cfg:?} step {step}");
                assert_eq!(bits(&v1), bits(&v2), "exp_avg_sq, {cfg:?} step {step}");
            }
        }
    }

    #[test]
    fn attention_tiles_are_defined_only_by_the_launcher() {
        let attention = SOURCES.iter().find(|s| s.name == "attention").unwrap();
        for (name, _) in KERNEL_DEFINES {
            assert!(
                !attention.source.contains(&format!("#define {name} ")),
                "attention.cu defines {name}: a second copy of KERNEL_DEFINES"
            );
            assert!(
                attention.source.contains(name),
                "attention.cu never uses {name}"
            );
        }
        assert!(attention.source.contains("#error"));
    }

    #[test]
    fn workspace_sizes_depend_on_the_shape_only() {
        assert_eq!(column_sum_chunks(0), 1);
        assert_eq!(column_sum_chunks(256), 1);
        assert_eq!(column_sum_chunks(257), 2);
        assert_eq!(grad_norm_partials(1), 1);
        assert_eq!(grad_norm_partials(usize::MAX / 2), 1024);
    }
}
