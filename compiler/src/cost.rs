//! The cost model: op, copy and Adam times from a hardware profile, and ProTrain's step-time estimate.

use crate::comm::{collective_seconds, CollectiveKind, Topology};
use protrain_ir::{op_key, workspace, DType, HardwareProfile, Interconnect, OpKind, TensorType};
use std::collections::HashMap;

/// The direction of a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CopyDir {
    /// Host (pinned) memory to device memory.
    HostToDevice,
    /// Device memory to host (pinned) memory.
    DeviceToHost,
    /// Within device memory.
    DeviceToDevice,
    /// From the disk region (a file) into host memory.
    DiskToHost,
    /// From host memory to the disk region.
    HostToDisk,
}

/// What a cast costs against a CPU Adam step, per parameter: the cast reads the f32 master
/// and writes the narrow parameter (6 bytes); the CPU Adam reads the narrow gradient and the
/// f32 master, m and v and writes those three and the narrow parameter (28 bytes).
pub const CAST_PER_ADAM: f64 = 6.0 / 28.0;

/// The share of the host's cores each of two thread pools of as many threads as cores gets
/// while both run (the operating system's fair scheduler): what the cost model takes the CPU
/// Adam to keep beside compute kernels where the profile measured no share of its own.
pub const EVEN_CORE_SHARE: f64 = 0.5;

/// The shares of its rate the host backend's CPU Adam keeps while other work runs on the same
/// cores, each in (0, 1]: beside compute kernels alone, beside a copy alone, and beside both.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamShares {
    /// Beside compute kernels, no copy running.
    pub compute: f64,
    /// Beside a copy, no compute kernel running.
    pub copy: f64,
    /// Beside compute kernels and a copy together.
    pub compute_and_copy: f64,
}

impl AdamShares {
    /// The shares a profile measured (`cpu_adam_compute_share`, `cpu_adam_copy_share`,
    /// `cpu_adam_compute_copy_share`), each unmeasured one taken as: beside compute,
    /// [`EVEN_CORE_SHARE`]; beside a copy, no loss (1); beside both, the share beside compute.
    pub fn of(compute: Option<f64>, copy: Option<f64>, compute_and_copy: Option<f64>) -> Self {
        let compute = compute.unwrap_or(EVEN_CORE_SHARE);
        Self {
            compute,
            copy: copy.unwrap_or(1.0),
            compute_and_copy: compute_and_copy.unwrap_or(compute),
        }
    }
}

/// Estimates how long instructions take on some hardware.
///
/// A trait, as egg's `CostFunction` is, so the analytic [`Roofline`] and the table-driven
/// [`Measured`] are interchangeable wherever a cost is needed (fusion extraction, the
/// simulator, the policy search). It prices single instructions; overlap between streams is
/// the simulator's business, and [`estimate_iteration`] is the closed-form whole-step model.
///
/// Every method is total: it returns a time in seconds (finite for a validated profile) and
/// never panics, whatever the shapes.
pub trait CostModel {
    /// One execution of an op of `kind` reading `inputs` and writing `outputs`, computing in
    /// `dtype`, launch included.
    fn op_seconds(
        &self,
        kind: &OpKind,
        inputs: &[&TensorType],
        outputs: &[&TensorType],
        dtype: DType,
    ) -> f64;

    /// Copying `bytes` in direction `dir`, launch included; 0 for 0 bytes.
    fn copy_seconds(&self, bytes: u64, dir: CopyDir) -> f64;

    /// One host CPU Adam step over `params` parameters.
    fn cpu_adam_seconds(&self, params: u64) -> f64;

    /// What each host CPU Adam op costs beyond [`CostModel::cpu_adam_seconds`] of its
    /// parameters, in seconds: the profile's measured `cpu_adam_op_s` (the host backend's
    /// per-op hand-over of its blocks to the pool's threads), which the simulator adds to
    /// every AdamW op of a host optimizer stream. 0 by default and where not measured.
    fn cpu_adam_op_seconds(&self) -> f64 {
        0.0
    }

    /// On the host backend ([`CostModel::host_cores`]), the shares of its rate the CPU Adam
    /// keeps while compute kernels, copies or both run beside it on the same cores. The
    /// simulator stretches the host optimizer's busy time by them
    /// ([`crate::simulate::cpu_adam_beside_others_seconds`]). By default those of
    /// [`AdamShares::of`] a profile that measured none.
    fn cpu_adam_shares(&self) -> AdamShares {
        AdamShares::of(None, None, None)
    }

    /// Rounding `params` f32 master weights into narrow parameters on the host (a staged
    /// chunk's cast before an upload, the 12-byte layout). Both it and the CPU Adam stream
    /// memory, so it is priced from the measured CPU Adam rate by the bytes each moves per
    /// parameter ([`CAST_PER_ADAM`]).
    fn cpu_cast_seconds(&self, params: u64) -> f64 {
        self.cpu_adam_seconds(params) * CAST_PER_ADAM
    }

    /// One device AdamW launch over `params` parameters, launch included; 0 for 0 parameters.
    /// Where [`CostModel::multi_tensor_adamw`] holds, `params` is a whole run's.
    fn gpu_adam_seconds(&self, params: u64) -> f64;

    /// Whether the backend updates a run of adjacent device AdamW ops in one launch, as the
    /// CUDA backend's multi-tensor `adamw_multi` does (`protrain_runtime::cuda::runs`): the
    /// simulator then prices the run as one [`CostModel::gpu_adam_seconds`] over all its
    /// parameters, one launch overhead plus bandwidth, instead of one launch per parameter.
    /// `false` (the default) for a backend that launches one AdamW per parameter, as the host
    /// backend does.
    fn multi_tensor_adamw(&self) -> bool {
        false
    }

    /// Whether the target runs attention as the CUDA backend's flash attention kernels where
    /// they apply ([`flash_attention_on`]), which the planned workspaces follow (no score
    /// matrices) as the prices do. `true` (the default) for a GPU of compute capability 8.0
    /// or newer and the host.
    fn flash_attention(&self) -> bool {
        true
    }

    /// On the host backend, where every stream runs on the CPU: the cores the compute kernels
    /// share with the copy threads (each copy is a `memcpy` on a thread of its own, taking one
    /// core of these while it runs); the CPU Adam runs in the compute kernels' thread pool, so
    /// it takes them all. `None` for a device, whose streams do not share its compute units.
    /// The simulator charges compute for what it shares ([`crate::simulate::simulate`]).
    fn host_cores(&self) -> Option<f64> {
        None
    }

    /// How the GPUs are linked, for pricing collectives ([`CostModel::collective_seconds`]);
    /// `None` for a machine whose profile says nothing of it.
    fn interconnect(&self) -> Option<Interconnect> {
        None
    }

    /// One collective over `bytes` among `topology`'s ranks: a ring (hierarchical across
    /// nodes) on [`CostModel::interconnect`] ([`crate::comm::collective_seconds`]), 0 without
    /// one (the compiler refuses several ranks on such a machine, so only a cost model made
    /// for tests prices a collective at nothing).
    fn collective_seconds(&self, kind: CollectiveKind, bytes: u64, topology: Topology) -> f64 {
        self.interconnect()
            .map_or(0.0, |link| collective_seconds(kind, bytes, topology, &link))
    }
}

/// What limits an op class, for the roofline's efficiency factors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpClass {
    /// Dense matrix products on the matrix units: `linear`, `fused_linear` and their
    /// backward kinds (a fused epilogue's few FLOPs are priced at the matmul rate).
    Matmul,
    /// Attention, forward and backward: strided-batched GEMMs over score matrices with row
    /// kernels between them, as the CUDA backend runs it (`Roofline::attention_time`).
    Attention,
    /// Everything else: elementwise, normalisation, embedding, loss and optimizer kinds. They
    /// run on the vector units, so their compute peak is the f32 rate whatever the dtype.
    Elementwise,
}

impl OpClass {
    /// The class of an op kind.
    pub fn of(kind: &OpKind) -> Self {
        match kind {
            OpKind::Linear { .. }
            | OpKind::LinearBackward { .. }
            | OpKind::FusedLinear { .. }
            | OpKind::FusedLinearBackward { .. } => OpClass::Matmul,
            OpKind::Attention { .. } | OpKind::AttentionBackward { .. } => OpClass::Attention,
            _ => OpClass::Elementwise,
        }
    }
}

/// Fractions of peak FLOP/s each op class reaches, for the roofline's compute term.
///
/// Bandwidths need no such factor: profiles hold achievable bandwidths already.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Efficiency {
    /// Large cuBLAS GEMMs reach about 70-80% of dense tensor peak on A100 (about 250 of 312
    /// TFLOP/s in bf16) and somewhat less on H100; 0.7 is the default.
    pub matmul: f64,
    /// Attention's GEMMs: batched products whose inner dimension is the head dimension
    /// (64-128) for `Q K^T` and `dO V^T` reach well below a large GEMM's rate; 0.5.
    pub attention: f64,
    /// Elementwise kernels are bandwidth-bound; their compute term rarely binds. 0.5.
    pub elementwise: f64,
}

impl Default for Efficiency {
    fn default() -> Self {
        Self {
            matmul: 0.7,
            attention: 0.5,
            elementwise: 0.5,
        }
    }
}

impl Efficiency {
    /// The factor for an op class.
    pub fn of(&self, class: OpClass) -> f64 {
        match class {
            OpClass::Matmul => self.matmul,
            OpClass::Attention => self.attention,
            OpClass::Elementwise => self.elementwise,
        }
    }
}

/// The parts of a roofline op estimate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OpTime {
    /// FLOPs / (peak x efficiency).
    pub compute_s: f64,
    /// Bytes moved / device bandwidth.
    pub memory_s: f64,
    /// The profile's launch overhead.
    pub launch_s: f64,
}

impl OpTime {
    /// The estimate: `max(compute, memory) + launch`.
    pub fn seconds(&self) -> f64 {
        self.compute_s.max(self.memory_s) + self.launch_s
    }

    /// Whether the compute term dominates the memory term.
    pub fn is_compute_bound(&self) -> bool {
        self.compute_s >= self.memory_s
    }
}

/// The analytic cost model: `max(FLOPs / (peak(dtype) x efficiency), bytes / bandwidth) +
/// launch overhead`, where bytes are every input and output byte once (plus the inputs an
/// optimizer op writes in place, once more).
///
/// It does not model caches, tile quantisation or kernel fusion: a measured profile does.
#[derive(Clone, Debug, PartialEq)]
pub struct Roofline {
    profile: HardwareProfile,
    efficiency: Efficiency,
}

impl Roofline {
    /// A roofline over `profile` with the default [`Efficiency`].
    pub fn new(profile: HardwareProfile) -> Self {
        Self {
            profile,
            efficiency: Efficiency::default(),
        }
    }

    /// The same roofline with other efficiency factors.
    pub fn with_efficiency(mut self, efficiency: Efficiency) -> Self {
        self.efficiency = efficiency;
        self
    }

    /// The profile it reads.
    pub fn profile(&self) -> &HardwareProfile {
        &self.profile
    }

    /// The efficiency factors it applies.
    pub fn efficiency(&self) -> &Efficiency {
        &self.efficiency
    }

    /// The compute, memory and launch parts of an op's time.
    ///
    /// FLOPs come from [`OpKind::flops`] over the output types the kind infers from `inputs`;
    /// inputs the kind rejects count no FLOPs (the op is then costed by its bytes alone), so a
    /// malformed op cannot make this panic.
    pub fn op_time(
        &self,
        kind: &OpKind,
        inputs: &[&TensorType],
        outputs: &[&TensorType],
        dtype: DType,
    ) -> OpTime {
        let flops = match kind.infer(inputs) {
            Ok(inferred) => {
                let inferred: Vec<&TensorType> = inferred.iter().collect();
                kind.flops(inputs, &inferred)
            }
            Err(_) => 0,
        };
        let class = OpClass::of(kind);
        let peak = match class {
            OpClass::Matmul | OpClass::Attention => self.profile.peak(dtype),
            OpClass::Elementwise => self.profile.peak(DType::F32),
        };
        let written_in_place: u64 = kind
            .writes_inputs()
            .iter()
            .filter_map(|&i| inputs.get(i))
            .map(|t| t.bytes())
            .sum();
        let bytes: u64 =
            inputs.iter().chain(outputs).map(|t| t.bytes()).sum::<u64>() + written_in_place;
        if let Some(time) = self.attention_time(kind, inputs, bytes, dtype) {
            return time;
        }
        OpTime {
            compute_s: flops as f64 / (peak * self.efficiency.of(class)),
            memory_s: bytes as f64 / self.profile.device_bandwidth,
            launch_s: self.profile.launch_overhead_s,
        }
    }
}

/// Query-key pairs a causal mask (with an optional sliding window of `window` keys) leaves
/// visible in a sequence of `t`: `t (t + 1) / 2` causal, `sum_t min(t + 1, W)` windowed.
pub fn visible_pairs(t: u64, window: Option<u64>) -> f64 {
    let t = t as f64;
    match window {
        Some(w) if (w as f64) < t => {
            let w = w as f64;
            // Rows 0..w see t + 1 keys each; the rest see w.
            w * (w + 1.0) / 2.0 + (t - w) * w
        }
        _ => t * (t + 1.0) / 2.0,
    }
}

/// Throughput of the CUDA backend's flash attention kernels as a fraction of the dense
/// bf16/f16 tensor peak, from published measurements of the design they follow.
///
/// The kernels are FlashAttention-2's design (arXiv 2307.08691): `mma.sync` m16n8k16 tensor
/// core products with f32 accumulation, one warp per 16 rows, online softmax, a separate dQ
/// and dK/dV pass. Published figures for that design:
/// - A100 (and the other `mma.sync` GPUs, Ampere and Ada): FlashAttention-2, section 4.1
///   ("Benchmarking attention"): up to 73% of the theoretical maximum FLOP/s forward and up
///   to 63% backward on A100 80 GB (FLOPs of a causal mask counted once).
/// - H100 and H200: FlashAttention-3 (arXiv 2407.08608), abstract and section 4.1: the same
///   FlashAttention-2 kernels reach about 35% of H100's dense peak, because they issue
///   `mma.sync` instead of Hopper's asynchronous `wgmma` and TMA; the backward keeps
///   FlashAttention-2's backward-to-forward ratio on A100 (63 / 73). FlashAttention-3's own
///   75% forward needs those Hopper instructions, which these kernels do not use.
///
/// These are the best published figures of the design, so a prediction is an upper bound on
/// these kernels until `scripts/gpu-check.sh` measures them; a measured profile replaces them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlashEfficiency {
    /// Forward fraction of peak.
    pub forward: f64,
    /// Backward fraction of peak.
    pub backward: f64,
}

/// FlashAttention-2 on A100 (arXiv 2307.08691, section 4.1).
pub const FLASH_A100: FlashEfficiency = FlashEfficiency {
    forward: 0.73,
    backward: 0.63,
};

/// FlashAttention-2's kernels on H100 (arXiv 2407.08608: 35% utilization), backward scaled by
/// FlashAttention-2's own backward-to-forward ratio.
pub const FLASH_HOPPER: FlashEfficiency = FlashEfficiency {
    forward: 0.35,
    backward: 0.35 * 0.63 / 0.73,
};

/// Whether `name` (a device as the profiler names it: `tesla-v100-sxm2-16gb`, `tesla-t4`,
/// `nvidia-geforce-rtx-2080-ti`) is a GPU older than compute capability 8.0 (Volta, Turing,
/// Pascal and before): no bf16 `mma.sync`, so the CUDA backend runs its attention as GEMMs
/// (`protrain_ir::workspace::FLASH_MIN_COMPUTE_CAPABILITY`). Matched on whole words; asked
/// only of a profile that does not state its compute capability ([`flash_attention_on`]).
pub fn before_sm80(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    let words: Vec<&str> = name
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .collect();
    const WHOLE: [&str; 9] = [
        "v100", "t4", "p100", "p40", "p4", "k80", "k40", "gtx", "volta",
    ];
    words.iter().any(|w| WHOLE.contains(w))
        || words.windows(2).any(|p| {
            matches!(p, ["titan", "v" | "rtx"] | ["quadro", "rtx"])
                || (p[0] == "rtx" && p[1].starts_with("20"))
        })
}

/// Whether `profile`'s GPU runs the CUDA backend's flash attention kernels (compute
/// capability 8.0 or newer): its compute capability where the profile states it
/// ([`HardwareProfile::flash_attention`]: every GPU preset does, and `protrain profile
/// --backend cuda` records it), else judged by its name ([`before_sm80`]). The compiler plans
/// attention's workspace ([`crate::emit::HeaderInputs::flash_attention`]) and prices attention
/// ([`FlashEfficiency::of`]) by this one answer, so a schedule for an older GPU has the GEMM
/// path's score workspace the CUDA backend asks for there.
pub fn flash_attention_on(profile: &HardwareProfile) -> bool {
    profile
        .flash_attention()
        .unwrap_or_else(|| !before_sm80(&profile.name))
}

impl FlashEfficiency {
    /// The figures for `profile`'s GPU: Hopper (a name naming an H100, H200, H800 or GH200,
    /// as the presets and `nvidia-smi` names do) or the `mma.sync` generations before it
    /// (Ampere and Ada); `None` for a GPU before compute capability 8.0
    /// ([`flash_attention_on`]), whose attention runs as GEMMs and is priced so.
    pub fn of(profile: &HardwareProfile) -> Option<Self> {
        if !flash_attention_on(profile) {
            return None;
        }
        let name = profile.name.to_ascii_lowercase();
        if ["h100", "h200", "h800", "gh200"]
            .iter()
            .any(|h| name.contains(h))
        {
            Some(FLASH_HOPPER)
        } else {
            Some(FLASH_A100)
        }
    }
}

impl Roofline {
    /// Attention as the CUDA backend runs it (`runtime/src/cuda/launch.rs`): per batch
    /// element, batch of KV heads and query head of a group, strided-batched GEMMs on the
    /// matrix units over whole `[T, T]` score matrices (the causal and window masks are applied
    /// between them, so masked pairs cost FLOPs too: 2 GEMMs forward, 5 backward), with row
    /// kernels between them that read and write the f32 scores in the planned workspace
    /// (forward: S written, read, P written and read, `8 + 2e` bytes per pair in storage of
    /// `e` bytes; backward: S and dP written and read, P and dS written, P read once and dS
    /// twice, `16 + 5e`). The row kernels wait on the GEMMs and the GEMMs on them, so the
    /// compute term is the GEMM time plus the score traffic; the memory term is the operands;
    /// each call is one launch. Attention in bf16 or f16 with a head dimension of 64, 128 or
    /// 256 on a GPU of compute capability 8.0 or newer ([`flash_attention_on`]) runs as flash
    /// attention instead ([`workspace::attention_runs_flash`]): the visible
    /// pairs' FLOPs at [`FlashEfficiency`] of the peak, no score traffic, one launch forward and
    /// three backward (delta, dQ, dK and dV). `None` for other kinds, and for the `host` profile (the preset,
    /// and what the profiler names a host measurement), whose backend runs attention as fused
    /// tiles without a score matrix: the generic roofline over the unmasked pairs prices that.
    fn attention_time(
        &self,
        kind: &OpKind,
        inputs: &[&TensorType],
        operand_bytes: u64,
        dtype: DType,
    ) -> Option<OpTime> {
        let (heads, kv_heads, head_dim, window, backward) = match *kind {
            OpKind::Attention {
                heads,
                kv_heads,
                head_dim,
                window,
                ..
            } => (heads, kv_heads, head_dim, window, false),
            OpKind::AttentionBackward {
                heads,
                kv_heads,
                head_dim,
                window,
                ..
            } => (heads, kv_heads, head_dim, window, true),
            _ => return None,
        };
        if self.profile.is_host() {
            return None;
        }
        let q = inputs.first()?;
        let (b, t) = (*q.shape.first()?, *q.shape.get(1)?);
        let flash = FlashEfficiency::of(&self.profile)
            .filter(|_| workspace::attention_runs_flash(dtype, head_dim));
        if let Some(f) = flash {
            let p = &self.profile;
            // FLOPs of the visible pairs only (the kernels skip masked tiles): 2 products of
            // 2 D FLOPs a pair forward, 5 backward (S again, dP, dV, dQ, dK).
            let pairs = (b * heads) as f64 * visible_pairs(t, window);
            let (products, fraction, calls) = if backward {
                (5.0, f.backward, 3.0)
            } else {
                (2.0, f.forward, 1.0)
            };
            return Some(OpTime {
                compute_s: products * 2.0 * pairs * head_dim as f64 / (p.peak(dtype) * fraction),
                memory_s: operand_bytes as f64 / p.device_bandwidth,
                launch_s: calls * p.launch_overhead_s,
            });
        }
        let e = dtype.size();
        let pairs = (b * heads * t * t) as f64;
        let (gemms, score_bytes, calls_per_batch) = if backward {
            (5.0, 16 + 5 * e, 6)
        } else {
            (2.0, 8 + 2 * e, 3)
        };
        let per_batch = workspace::attention_head_batch(kv_heads, t);
        let batches = b * kv_heads.div_ceil(per_batch.max(1)) * (heads / kv_heads.max(1));
        // The backward's delta kernel is one more launch.
        let calls = batches * calls_per_batch + u64::from(backward);
        let p = &self.profile;
        let gemm_s = gemms * 2.0 * pairs * head_dim as f64
            / (p.peak(dtype) * self.efficiency.of(OpClass::Attention));
        Some(OpTime {
            compute_s: gemm_s + pairs * score_bytes as f64 / p.device_bandwidth,
            memory_s: operand_bytes as f64 / p.device_bandwidth,
            launch_s: calls as f64 * p.launch_overhead_s,
        })
    }
}

impl CostModel for Roofline {
    fn interconnect(&self) -> Option<Interconnect> {
        self.profile.interconnect
    }

    fn op_seconds(
        &self,
        kind: &OpKind,
        inputs: &[&TensorType],
        outputs: &[&TensorType],
        dtype: DType,
    ) -> f64 {
        self.op_time(kind, inputs, outputs, dtype).seconds()
    }

    fn copy_seconds(&self, bytes: u64, dir: CopyDir) -> f64 {
        if bytes == 0 {
            return 0.0;
        }
        let p = &self.profile;
        let transfer = match dir {
            CopyDir::HostToDevice => bytes as f64 / p.h2d_bandwidth,
            CopyDir::DeviceToHost => bytes as f64 / p.d2h_bandwidth,
            // A device copy reads and writes every byte.
            CopyDir::DeviceToDevice => 2.0 * bytes as f64 / p.device_bandwidth,
            CopyDir::DiskToHost => bytes as f64 / p.disk.read_bandwidth,
            CopyDir::HostToDisk => bytes as f64 / p.disk.write_bandwidth,
        };
        transfer + p.launch_overhead_s
    }

    fn cpu_adam_seconds(&self, params: u64) -> f64 {
        params as f64 / self.profile.cpu_adam_params_per_s
    }

    fn cpu_adam_op_seconds(&self) -> f64 {
        self.profile.cpu_adam_op_s
    }

    fn cpu_adam_shares(&self) -> AdamShares {
        AdamShares::of(
            self.profile.cpu_adam_compute_share,
            self.profile.cpu_adam_copy_share,
            self.profile.cpu_adam_compute_copy_share,
        )
    }

    fn gpu_adam_seconds(&self, params: u64) -> f64 {
        if params == 0 {
            return 0.0;
        }
        params as f64 / self.profile.gpu_adam_params_per_s + self.profile.launch_overhead_s
    }

    /// A GPU runs on the CUDA backend, which merges runs of AdamW; the host backend does not.
    fn multi_tensor_adamw(&self) -> bool {
        !self.profile.is_host()
    }

    fn flash_attention(&self) -> bool {
        flash_attention_on(&self.profile)
    }

    /// A host profile without a measured op table prices every copy that overlaps compute at
    /// its whole duration (one core): a `memcpy` streams memory as fast as the cores can, and
    /// the kernels beside it (gemm packing, the element-wise and attention kernels) wait on
    /// the same memory. Measured on the 2-core host (GPT-2 4x256, `blocks=SSKK`): the swaps'
    /// copies took 36 ms of a 572 ms step, and the step ran 6% slower than `KKKK`, the copies'
    /// whole time; charging them per core, or not at all, would make swapping a block look
    /// free, and the search would swap blocks the host has room to keep. One core, not the
    /// machine's count, so a schedule compiled for a given profile (and its snapshot) is the
    /// same on every machine.
    fn host_cores(&self) -> Option<f64> {
        self.profile.is_host().then_some(1.0)
    }
}

/// The table-driven cost model: an op's measured time when the profile's table has its
/// [`op_key`], else the [`Roofline`] estimate. Copies and Adam steps use the profile's
/// (measured) rates, as the roofline does.
#[derive(Clone, Debug, PartialEq)]
pub struct Measured {
    roofline: Roofline,
    table: HashMap<String, f64>,
}

impl Measured {
    /// A measured model over `profile`'s op table (the last entry wins when a key repeats),
    /// falling back to a default roofline.
    pub fn new(profile: HardwareProfile) -> Self {
        Self::with_fallback(Roofline::new(profile))
    }

    /// A measured model over the op table of `roofline`'s profile, falling back to `roofline`.
    pub fn with_fallback(roofline: Roofline) -> Self {
        let table = roofline
            .profile()
            .measured_ops
            .iter()
            .map(|m| (m.key.clone(), m.seconds))
            .collect();
        Self { roofline, table }
    }

    /// The measured time of an op, if the table has it.
    pub fn lookup(&self, kind: &OpKind, inputs: &[&TensorType]) -> Option<f64> {
        self.table.get(&op_key(kind, inputs)).copied()
    }

    /// How many ops the table holds.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether the table is empty (every op falls back to the roofline).
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// The fallback roofline.
    pub fn roofline(&self) -> &Roofline {
        &self.roofline
    }
}

impl CostModel for Measured {
    fn interconnect(&self) -> Option<Interconnect> {
        self.roofline.interconnect()
    }

    fn op_seconds(
        &self,
        kind: &OpKind,
        inputs: &[&TensorType],
        outputs: &[&TensorType],
        dtype: DType,
    ) -> f64 {
        self.lookup(kind, inputs)
            .unwrap_or_else(|| self.roofline.op_seconds(kind, inputs, outputs, dtype))
    }

    fn copy_seconds(&self, bytes: u64, dir: CopyDir) -> f64 {
        self.roofline.copy_seconds(bytes, dir)
    }

    fn cpu_adam_seconds(&self, params: u64) -> f64 {
        self.roofline.cpu_adam_seconds(params)
    }

    fn cpu_adam_op_seconds(&self) -> f64 {
        self.roofline.cpu_adam_op_seconds()
    }

    fn cpu_adam_shares(&self) -> AdamShares {
        self.roofline.cpu_adam_shares()
    }

    fn gpu_adam_seconds(&self, params: u64) -> f64 {
        self.roofline.gpu_adam_seconds(params)
    }

    fn multi_tensor_adamw(&self) -> bool {
        self.roofline.multi_tensor_adamw()
    }

    fn flash_attention(&self) -> bool {
        self.roofline.flash_attention()
    }

    /// A measured host profile describes the machine it was measured on, which is the one
    /// compiling for it (`protrain profile` then `compile`): its available cores.
    fn host_cores(&self) -> Option<f64> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        self.roofline.host_cores().map(|_| cores as f64)
    }
}

/// The cost model a profile calls for: [`Measured`] when it carries an op table, else
/// [`Roofline`].
pub fn cost_model(profile: &HardwareProfile) -> Box<dyn CostModel + Send + Sync> {
    if profile.measured_ops.is_empty() {
        Box::new(Roofline::new(profile.clone()))
    } else {
        Box::new(Measured::new(profile.clone()))
    }
}

/// One chunk's times, the inputs of ProTrain's closed-form model (ProTrain, arXiv 2406.08334,
/// §4), all in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ChunkTimes {
    /// Forward compute of the ops that use this chunk's parameters.
    pub forward_compute: f64,
    /// Backward compute of those ops.
    pub backward_compute: f64,
    /// Forward ops re-run in the backward pass for checkpointed blocks.
    pub recompute: f64,
    /// Communication overlapped with the forward compute: fetching the chunk's parameters when
    /// it is not persistent, swapping activations out.
    pub forward_comm: f64,
    /// Communication overlapped with the backward compute: fetching the parameters again,
    /// offloading gradients, reloading swapped activations.
    pub backward_comm: f64,
}

/// The breakdown of ProTrain's closed-form iteration time, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct IterationEstimate {
    /// `T_fwd = Σ max(forward_compute, forward_comm)`.
    pub forward: f64,
    /// `T_bwd = Σ max(backward_compute + recompute, backward_comm)`.
    pub backward: f64,
    /// Device AdamW over the persistent chunks, after the backward pass.
    pub gpu_optimizer: f64,
    /// Host CPU Adam over the offloaded chunks, overlapped with the backward pass.
    pub cpu_optimizer: f64,
    /// `T_iter = T_fwd + max(T_bwd + T_gpu_optim, T_cpu_optim)`.
    pub total: f64,
}

impl IterationEstimate {
    /// How much of the CPU optimizer is not hidden behind the backward pass and the device
    /// optimizer.
    pub fn cpu_optimizer_exposed(&self) -> f64 {
        (self.cpu_optimizer - (self.backward + self.gpu_optimizer)).max(0.0)
    }
}

/// [`estimate_iteration`] on the host backend, where the CPU Adam runs on the cores the
/// compute runs on and so cannot hide behind the backward pass:
/// `T_iter = T_fwd + T_bwd + T_gpu_optim + T_cpu_optim`.
pub fn estimate_iteration_sharing_cores(
    chunks: &[ChunkTimes],
    gpu_optimizer: f64,
    cpu_optimizer: f64,
) -> IterationEstimate {
    let overlapped = estimate_iteration(chunks, gpu_optimizer, cpu_optimizer);
    IterationEstimate {
        total: overlapped.forward + overlapped.backward + gpu_optimizer + cpu_optimizer,
        ..overlapped
    }
}

/// ProTrain's closed-form iteration time (arXiv 2406.08334, §4):
/// `T_iter = T_fwd + max(T_bwd + T_gpu_optim, T_cpu_optim)`, with
/// `T_fwd = Σ_chunks max(T_compute, T_comm)` and
/// `T_bwd = Σ_chunks max(T_compute + T_recompute, T_comm)`.
///
/// It assumes each chunk's communication overlaps its own compute perfectly and that the CPU
/// optimizer overlaps the whole backward pass; the simulator, not this, accounts for prefetch
/// distance, buffer contention and stream dependencies.
pub fn estimate_iteration(
    chunks: &[ChunkTimes],
    gpu_optimizer: f64,
    cpu_optimizer: f64,
) -> IterationEstimate {
    let forward = chunks
        .iter()
        .map(|c| c.forward_compute.max(c.forward_comm))
        .sum::<f64>();
    let backward = chunks
        .iter()
        .map(|c| (c.backward_compute + c.recompute).max(c.backward_comm))
        .sum::<f64>();
    IterationEstimate {
        forward,
        backward,
        gpu_optimizer,
        cpu_optimizer,
        total: forward + (backward + gpu_optimizer).max(cpu_optimizer),
    }
}
