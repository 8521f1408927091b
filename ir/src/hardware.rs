//! Hardware profiles: what a machine offers the scheduler, as named presets or measured JSON.

use crate::error::{IrError, Result};
use crate::op::OpKind;
use crate::types::{format_bytes, DType, TensorType};
use crate::workspace::flash_attention_supported;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::path::Path;

/// Peak floating-point operations per second for each element type (dense, no sparsity).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeakFlops {
    /// IEEE single precision on the vector (non-tensor) units.
    pub f32: f64,
    /// bfloat16 on the matrix (tensor) units, f32 accumulate.
    pub bf16: f64,
    /// IEEE half precision on the matrix (tensor) units, f32 accumulate.
    pub f16: f64,
}

impl PeakFlops {
    /// The peak for ops computing in `dtype`; integer ops (embedding lookups) use the f32 rate.
    pub fn get(&self, dtype: DType) -> f64 {
        match dtype {
            DType::F32 | DType::I32 => self.f32,
            DType::BF16 => self.bf16,
            DType::F16 => self.f16,
        }
    }
}

/// One measured op time: how long one execution of the op identified by `key` took.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeasuredOp {
    /// The op, as [`op_key`] writes it.
    pub key: String,
    /// Wall time of one execution, launch included, in seconds.
    pub seconds: f64,
}

/// How the GPUs of a machine talk to each other: what collectives between ranks cost.
///
/// Bandwidths are achievable **bus bandwidths** (NCCL's `busbw`: what each GPU sends and receives
/// per second in a ring), derated from link figures like the other bandwidths.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Interconnect {
    /// GPUs in one node: the most `--gpus` can ask for.
    pub gpus_per_node: u32,
    /// Bus bandwidth of a ring among the GPUs of one node, bytes per second per GPU.
    pub intra_node_bandwidth: f64,
    /// Network bandwidth of one node to the others (all its NICs), bytes per second.
    pub inter_node_bandwidth: f64,
    /// Fixed cost of one step of a ring collective (one hop), in seconds.
    pub step_latency_s: f64,
}

/// What a machine offers the scheduler: capacities, throughputs, and optionally measured ops.
///
/// It holds figures only; the compiler's cost model turns them into times. Conventions, so
/// that presets and measured profiles mean the same thing:
/// - peak FLOP/s are datasheet **dense** peaks (no 2:4 sparsity); the cost model applies its
///   own efficiency factors. `f32` is the non-tensor (CUDA-core) rate, because PyTorch runs
///   f32 matmuls without TF32 by default; `bf16`/`f16` are tensor-core rates with f32
///   accumulation, the mode mixed-precision training uses.
/// - bandwidths are **achievable** bytes per second, not theoretical: presets derate
///   datasheet figures by stated factors; a measured profile holds what was measured.
/// - the Adam rates count parameters updated per second by one step over fp32 master weights
///   and moments.
///
/// This is also the JSON format `protrain profile` writes and `--hardware FILE` reads; unknown
/// fields are rejected so that a misspelt field is an error, not a silently ignored setting.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareProfile {
    /// Short name (a preset name, or what the profiler called the device).
    pub name: String,
    /// One line for people: the device, the host it is paired with, where the figures come from.
    #[serde(default)]
    pub description: String,
    /// Total device memory in bytes.
    pub device_memory_bytes: u64,
    /// Host memory of one node the schedules may use for offloaded state (pinned), in bytes:
    /// a budget per node, which the node's ranks share (each is planned within its share).
    pub host_memory_bytes: u64,
    /// Device bytes no schedule may use: the CUDA context, cuBLAS/cuBLASLt workspaces, NCCL
    /// buffers and allocator slack.
    pub reserved_device_bytes: u64,
    /// Peak FLOP/s per element type.
    pub peak_flops: PeakFlops,
    /// Achievable device memory bandwidth, bytes read plus written per second.
    pub device_bandwidth: f64,
    /// Achievable host-to-device copy bandwidth from pinned memory, bytes per second.
    pub h2d_bandwidth: f64,
    /// Achievable device-to-host copy bandwidth into pinned memory, bytes per second.
    pub d2h_bandwidth: f64,
    /// Host `memcpy` bandwidth (bytes copied per second), for staging copies on the host.
    pub host_memcpy_bandwidth: f64,
    /// Fixed cost of launching one kernel or copy, in seconds.
    pub launch_overhead_s: f64,
    /// Parameters per second a multi-threaded, vectorised CPU Adam (DeepSpeed CPUAdam class)
    /// updates on the host this device is paired with.
    pub cpu_adam_params_per_s: f64,
    /// Seconds each host CPU Adam op costs beyond its parameters at `cpu_adam_params_per_s`:
    /// what a run of a model's AdamW ops, one after another as the host optimizer issues them,
    /// takes more than their parameters at that rate, per op (each op's hand-over of its
    /// blocks to the pool's threads, a thread woken for it, the calling thread alone on the
    /// small ones). Measured by `protrain profile`; 0 where it was not measured (presets,
    /// profiles written before it), which leaves the CPU Adam priced by its rate alone.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cpu_adam_op_s: f64,
    /// The share of its rate (`cpu_adam_params_per_s`, `cpu_adam_op_s`) the host optimizer
    /// keeps while the compute kernels run beside it on the same cores: on the host backend
    /// the two thread pools share the CPU, and the Adam, which streams its state from memory
    /// that the kernels' working sets compete for, may keep more or less than the half of
    /// the cores an even split gives it. Measured by `protrain profile --backend host` (a run
    /// of the graph's AdamW ops timed alone and beside its backward kernels running in a
    /// loop); `None` where it was not measured (presets, GPU profiles, whose host optimizer
    /// shares no cores with compute, and profiles written before it), which the cost model
    /// takes as the even split, 0.5. Between 0 (exclusive) and 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_adam_compute_share: Option<f64>,
    /// The share of its rate the host optimizer keeps while a copy runs beside it and no
    /// compute kernel does: on the host backend a copy is a `memcpy` on its stream's thread,
    /// which takes a core and streams memory as the Adam does. Measured by `protrain profile
    /// --backend host` as `cpu_adam_compute_share` is, beside a loop of copies; `None` where
    /// it was not measured, which the cost model takes as no loss (1). Between 0 (exclusive)
    /// and 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_adam_copy_share: Option<f64>,
    /// The share of its rate the host optimizer keeps while the compute kernels and a copy
    /// both run beside it: measured beside both loops at once, since the three contend for
    /// the same cores and memory together. `None` where it was not measured, which the cost
    /// model takes as `cpu_adam_compute_share`. Between 0 (exclusive) and 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_adam_compute_copy_share: Option<f64>,
    /// Parameters per second a fused device AdamW updates.
    pub gpu_adam_params_per_s: f64,
    /// Measured op times, keyed by [`op_key`]; empty for presets.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub measured_ops: Vec<MeasuredOp>,
    /// The links between GPUs, for runs on several; `None` when unknown (a profile measured on
    /// one GPU), which allows one GPU only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interconnect: Option<Interconnect>,
    /// The disk tier: how much of a disk the schedule may use for optimizer state host memory
    /// cannot hold, and how fast it reads and writes. A profile without it has the assumed
    /// NVMe rates and no disk ([`Disk::default`]).
    #[serde(default, skip_serializing_if = "Disk::is_default")]
    pub disk: Disk,
    /// The GPU's CUDA compute capability (major, minor), as `[8, 0]` in JSON: what the
    /// schedule may use on it (flash attention needs 8.0,
    /// [`FLASH_MIN_COMPUTE_CAPABILITY`](crate::workspace::FLASH_MIN_COMPUTE_CAPABILITY)).
    /// `None` when unknown (the host, a profile written before it was recorded): then the
    /// compiler judges by the device's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_capability: Option<(i32, i32)>,
}

/// Assumed sequential bandwidths of an NVMe SSD on PCIe 4.0 x4 for large (MiB) reads and
/// writes: a Samsung 980 PRO's datasheet gives 7.0 GB/s read and 5.1 GB/s write, sustained
/// writes past its SLC cache are lower, and a file system costs some; 5.0 and 3.5 GB/s are
/// an assumption of what a plain file reaches. `protrain profile --disk-dir` measures it.
const NVME_READ: f64 = 5.0 * GB;
/// See [`NVME_READ`].
const NVME_WRITE: f64 = 3.5 * GB;

/// The disk tier of a machine (see [`HardwareProfile::disk`]).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Disk {
    /// Bytes of disk the schedule may use (`--disk-memory`); 0: no disk tier.
    #[serde(default)]
    pub memory_bytes: u64,
    /// Achievable sequential read bandwidth of large reads from a file, bytes per second.
    pub read_bandwidth: f64,
    /// Achievable sequential write bandwidth of large writes to a file, bytes per second.
    pub write_bandwidth: f64,
}

impl Default for Disk {
    /// No disk, at the assumed NVMe rates.
    fn default() -> Self {
        Self {
            memory_bytes: 0,
            read_bandwidth: NVME_READ,
            write_bandwidth: NVME_WRITE,
        }
    }
}

impl Disk {
    /// Whether this is [`Disk::default`] (it is then left out of a profile's JSON).
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// Whether a figure is 0 (then left out of a profile's JSON).
fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// The names [`HardwareProfile::preset`] accepts.
pub const PRESETS: &[&str] = &[
    "rtx3090",
    "rtx4090",
    "a100-40gb",
    "a100-80gb",
    "h100",
    "h200",
    "host",
];

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const GB: f64 = 1e9;
const TFLOPS: f64 = 1e12;

/// Achievable fraction of a datasheet memory bandwidth. STREAM-class kernels reach about
/// 85-90% of HBM2e/HBM3/GDDR6X peak; 0.85 is the conservative end.
const DEVICE_BANDWIDTH_DERATE: f64 = 0.85;
/// Achievable fraction of the theoretical per-direction PCIe bandwidth for large pinned
/// copies (TLP/DLLP overhead and DMA setup): about 80%, the figure `bandwidthTest` shows.
const PCIE_DERATE: f64 = 0.8;
/// PCIe 4.0 x16, one direction: 16 GT/s x 16 lanes x 128/130 encoding / 8 bits = 31.5 GB/s.
const PCIE4_X16: f64 = 31.5 * GB;
/// PCIe 5.0 x16, one direction: 32 GT/s x 16 lanes x 128/130 / 8 = 63.0 GB/s.
const PCIE5_X16: f64 = 63.0 * GB;
/// Bytes of memory traffic one Adam update of one parameter causes: fp32 master weight, m and
/// v read and written (24), plus a 16-bit gradient read and a 16-bit parameter copy written
/// (4). All-fp32 (f32 gradient read, no 16-bit copy) comes to the same 28.
const ADAM_BYTES_PER_PARAM: f64 = 28.0;
/// Fraction of host DRAM bandwidth a multi-threaded, vectorised CPU Adam or `memcpy` reaches.
const HOST_DRAM_EFFICIENCY: f64 = 0.6;
/// A CUDA kernel launch costs a few microseconds of host and device time.
const GPU_LAUNCH_OVERHEAD_S: f64 = 5e-6;
/// Device bytes reserved on every GPU preset: CUDA context (about 0.3-0.5 GiB on Ampere and
/// later), cuBLAS/cuBLASLt workspaces and slack. An estimate; `protrain profile` measures it.
const GPU_RESERVED_BYTES: u64 = GIB;

/// Assumed f32 throughput of one host core: 2 FMA pipes x 8 f32 lanes (AVX2) x 2 FLOP x 2 GHz,
/// or one AVX-512 FMA pipe at the same clock. A modest x86 server core reaches it.
const HOST_F32_FLOPS_PER_CORE: f64 = 64e9;
/// Assumed DRAM bandwidth one host core can draw (a server core streams about 10-15 GB/s).
const HOST_BANDWIDTH_PER_CORE: f64 = 10.0 * GB;
/// Handing a kernel to a host thread pool costs on the order of a microsecond or two.
const HOST_LAUNCH_OVERHEAD_S: f64 = 2e-6;
/// The largest hardware profile file read: a measured profile is tens of KiB of JSON (its op
/// table grows with the models measured); this refuses weights or a device given by mistake.
pub const MAX_PROFILE_BYTES: u64 = 64 << 20;

/// Host memory assumed when `/proc/meminfo` cannot be read.
const HOST_FALLBACK_MEMORY: u64 = 16 * GIB;

/// Achievable fraction of a link's one-direction bandwidth that a ring collective's bus
/// bandwidth reaches: NCCL's all-reduce on a DGX A100 shows about 230-240 GB/s `busbw` over
/// NVLink 3's 300 GB/s per direction (nccl-tests); 0.8 is used for every link.
const COLLECTIVE_DERATE: f64 = 0.8;
/// NVLink 3 (A100 SXM4): 12 links x 25 GB/s per direction = 300 GB/s (the datasheet's 600 GB/s
/// counts both directions).
const NVLINK3: f64 = 300.0 * GB;
/// NVLink 4 (H100/H200 SXM): 18 links, 450 GB/s per direction (the datasheet's 900 GB/s both).
const NVLINK4: f64 = 450.0 * GB;
/// DGX A100: eight 200 Gb/s HDR InfiniBand NICs for compute, 8 x 25 GB/s.
const DGX_A100_NETWORK: f64 = 200.0 * GB;
/// DGX H100/H200: eight 400 Gb/s NDR InfiniBand NICs for compute, 8 x 50 GB/s.
const DGX_H100_NETWORK: f64 = 400.0 * GB;
/// A workstation node: one 100 Gb/s Ethernet NIC, 12.5 GB/s.
const WORKSTATION_NETWORK: f64 = 12.5 * GB;
/// One hop of a ring: a few microseconds over NVLink or PCIe inside a node.
const RING_STEP_LATENCY_S: f64 = 5e-6;

/// How a preset's GPUs are linked.
struct Links {
    gpus_per_node: u32,
    /// Raw one-direction bandwidth between two GPUs of a node, bytes/s.
    intra: f64,
    /// Raw network bandwidth of a node, bytes/s.
    inter: f64,
}

/// GeForce cards in a workstation: 4 per node, no peer-to-peer (the driver disables it on
/// GeForce), so a ring's traffic crosses PCIe into host memory and out again: half of a PCIe
/// 4.0 x16 direction.
const GEFORCE_LINKS: Links = Links {
    gpus_per_node: 4,
    intra: PCIE4_X16 / 2.0,
    inter: WORKSTATION_NETWORK,
};
/// Eight A100 SXM4 on NVSwitch (a DGX A100).
const DGX_A100_LINKS: Links = Links {
    gpus_per_node: 8,
    intra: NVLINK3,
    inter: DGX_A100_NETWORK,
};
/// Eight H100 or H200 SXM on NVSwitch (a DGX H100 or H200).
const DGX_H100_LINKS: Links = Links {
    gpus_per_node: 8,
    intra: NVLINK4,
    inter: DGX_H100_NETWORK,
};

impl Links {
    fn interconnect(&self) -> Interconnect {
        Interconnect {
            gpus_per_node: self.gpus_per_node,
            intra_node_bandwidth: (self.intra * COLLECTIVE_DERATE).round(),
            inter_node_bandwidth: (self.inter * COLLECTIVE_DERATE).round(),
            step_latency_s: RING_STEP_LATENCY_S,
        }
    }
}

/// A resource a step's time goes to, as the simulator's timeline tells them apart: what
/// `explain` names as bounding a step, and what [`HardwareProfile::with_faster`] speeds up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Resource {
    /// The device: kernels and copies within device memory (peak FLOP/s, device bandwidth,
    /// the device AdamW, launch overhead, measured op times).
    Compute,
    /// PCIe from the host to the device.
    PcieToDevice,
    /// PCIe from the device to the host.
    PcieToHost,
    /// The host CPU's Adam (and the casts a staged chunk's uploads need, priced from it).
    CpuAdam,
    /// Disk reads and writes of optimizer state.
    Disk,
    /// Collectives among ranks: the links within a node and the network between nodes.
    Network,
}

impl Resource {
    /// Every resource, in the order above.
    pub const ALL: [Resource; 6] = [
        Resource::Compute,
        Resource::PcieToDevice,
        Resource::PcieToHost,
        Resource::CpuAdam,
        Resource::Disk,
        Resource::Network,
    ];

    /// Its name for people: `compute`, `PCIe to device`, `CPU Adam`.
    pub fn name(self) -> &'static str {
        match self {
            Resource::Compute => "compute",
            Resource::PcieToDevice => "PCIe to device",
            Resource::PcieToHost => "PCIe to host",
            Resource::CpuAdam => "CPU Adam",
            Resource::Disk => "disk",
            Resource::Network => "network",
        }
    }

    /// Its name in JSON: `compute`, `pcie_to_device`, `cpu_adam`.
    pub fn key(self) -> &'static str {
        match self {
            Resource::Compute => "compute",
            Resource::PcieToDevice => "pcie_to_device",
            Resource::PcieToHost => "pcie_to_host",
            Resource::CpuAdam => "cpu_adam",
            Resource::Disk => "disk",
            Resource::Network => "network",
        }
    }
}

/// Figures that define a GPU preset; [`GpuSpec::profile`] derives the rest.
struct GpuSpec {
    name: &'static str,
    description: &'static str,
    /// Total device memory as `nvidia-smi` reports it, in MiB.
    memory_mib: u64,
    /// Datasheet peak FP32 (non-tensor), TFLOP/s.
    f32_tflops: f64,
    /// Datasheet dense BF16/FP16 tensor peak with FP32 accumulate, TFLOP/s.
    tensor_tflops: f64,
    /// Datasheet memory bandwidth, GB/s.
    memory_gbs: f64,
    /// Theoretical one-direction PCIe bandwidth of the host link, bytes/s.
    pcie: f64,
    /// Host memory of a node with such GPUs, GiB (its ranks share it).
    host_gib: u64,
    /// Host DRAM bandwidth available to this GPU, GB/s.
    host_dram_gbs: f64,
    /// How the GPUs of its node and the nodes are linked.
    links: Links,
    /// CUDA compute capability (major, minor), from NVIDIA's CUDA GPUs table.
    compute_capability: (i32, i32),
}

impl GpuSpec {
    fn profile(&self) -> HardwareProfile {
        // Derived rates are rounded to whole units so that they survive a JSON round trip exactly.
        let device_bandwidth = (self.memory_gbs * GB * DEVICE_BANDWIDTH_DERATE).round();
        let host_dram = self.host_dram_gbs * GB * HOST_DRAM_EFFICIENCY;
        HardwareProfile {
            name: self.name.to_string(),
            description: self.description.to_string(),
            device_memory_bytes: self.memory_mib * MIB,
            host_memory_bytes: self.host_gib * GIB,
            reserved_device_bytes: GPU_RESERVED_BYTES,
            peak_flops: PeakFlops {
                f32: self.f32_tflops * TFLOPS,
                bf16: self.tensor_tflops * TFLOPS,
                f16: self.tensor_tflops * TFLOPS,
            },
            device_bandwidth,
            h2d_bandwidth: (self.pcie * PCIE_DERATE).round(),
            d2h_bandwidth: (self.pcie * PCIE_DERATE).round(),
            // memcpy reads and writes every byte it copies.
            host_memcpy_bandwidth: (host_dram / 2.0).round(),
            launch_overhead_s: GPU_LAUNCH_OVERHEAD_S,
            cpu_adam_params_per_s: (host_dram / ADAM_BYTES_PER_PARAM).round(),
            cpu_adam_op_s: 0.0,
            cpu_adam_compute_share: None,
            cpu_adam_copy_share: None,
            cpu_adam_compute_copy_share: None,
            gpu_adam_params_per_s: (device_bandwidth / ADAM_BYTES_PER_PARAM).round(),
            measured_ops: Vec::new(),
            interconnect: Some(self.links.interconnect()),
            disk: Disk::default(),
            compute_capability: Some(self.compute_capability),
        }
    }
}

/// NVIDIA GeForce RTX 3090 in a desktop workstation.
///
/// NVIDIA Ampere GA102 GPU Architecture whitepaper v2.0, Appendix A: 35.6 TFLOP/s peak FP32,
/// 71 TFLOP/s peak FP16 and BF16 tensor with FP32 accumulate (142 with sparsity), 936 GB/s
/// GDDR6X, PCIe 4.0 x16. `nvidia-smi` reports 24576 MiB. Host: a desktop with 128 GiB of
/// dual-channel DDR4-3200 (2 x 25.6 = 51.2 GB/s), the common maximum for such boards.
const RTX3090: GpuSpec = GpuSpec {
    name: "rtx3090",
    description:
        "NVIDIA GeForce RTX 3090 24 GB, PCIe 4.0 x16, desktop host with 128 GiB DDR4-3200 \
                  (GA102 whitepaper figures)",
    memory_mib: 24576,
    f32_tflops: 35.6,
    tensor_tflops: 71.0,
    memory_gbs: 936.0,
    pcie: PCIE4_X16,
    host_gib: 128,
    host_dram_gbs: 51.2,
    links: GEFORCE_LINKS,
    compute_capability: (8, 6),
};

/// NVIDIA GeForce RTX 4090 in a desktop workstation.
///
/// NVIDIA Ada GPU Architecture whitepaper, Appendix A: 82.6 TFLOP/s peak FP32, 165.2 TFLOP/s
/// peak FP16 and BF16 tensor with FP32 accumulate (330.4 with sparsity; GeForce runs FP32
/// accumulate at half the FP16-accumulate rate), 1008 GB/s GDDR6X, PCIe 4.0 x16. `nvidia-smi`
/// reports 24564 MiB. Host: 128 GiB of dual-channel DDR5-5600 (2 x 44.8 = 89.6 GB/s).
const RTX4090: GpuSpec = GpuSpec {
    name: "rtx4090",
    description:
        "NVIDIA GeForce RTX 4090 24 GB, PCIe 4.0 x16, desktop host with 128 GiB DDR5-5600 \
                  (Ada whitepaper figures)",
    memory_mib: 24564,
    f32_tflops: 82.6,
    tensor_tflops: 165.2,
    memory_gbs: 1008.0,
    pcie: PCIE4_X16,
    host_gib: 128,
    host_dram_gbs: 89.6,
    links: GEFORCE_LINKS,
    compute_capability: (8, 9),
};

/// NVIDIA A100 SXM4 40 GB, one eighth of a DGX A100.
///
/// NVIDIA A100 Tensor Core GPU datasheet: 19.5 TFLOP/s FP32, 312 TFLOP/s BF16/FP16 tensor dense
/// (624 with sparsity), 1555 GB/s HBM2, PCIe 4.0 x16. `nvidia-smi` reports 40960 MiB. Host: the
/// DGX A100 (320 GB) datasheet's 1 TB of system memory over 8 GPUs = 128 GiB each, and its two
/// AMD EPYC 7742 with 8 channels of DDR4-3200 each (409.6 GB/s) over 8 GPUs = 51.2 GB/s each.
const A100_40GB: GpuSpec = GpuSpec {
    name: "a100-40gb",
    description: "NVIDIA A100 SXM4 40 GB, PCIe 4.0 x16, 1/8 of a DGX A100 host (A100 datasheet \
                  figures)",
    memory_mib: 40960,
    f32_tflops: 19.5,
    tensor_tflops: 312.0,
    memory_gbs: 1555.0,
    pcie: PCIE4_X16,
    host_gib: 128,
    host_dram_gbs: 51.2,
    links: DGX_A100_LINKS,
    compute_capability: (8, 0),
};

/// NVIDIA A100 SXM4 80 GB, one eighth of a DGX A100 (640 GB).
///
/// NVIDIA A100 Tensor Core GPU datasheet: 19.5 TFLOP/s FP32, 312 TFLOP/s BF16/FP16 tensor dense,
/// 2039 GB/s HBM2e, PCIe 4.0 x16. `nvidia-smi` reports 81920 MiB. Host: the DGX A100 (640 GB)
/// datasheet's 2 TB over 8 GPUs = 256 GiB each; DRAM bandwidth as for the 40 GB preset.
const A100_80GB: GpuSpec = GpuSpec {
    name: "a100-80gb",
    description: "NVIDIA A100 SXM4 80 GB, PCIe 4.0 x16, 1/8 of a DGX A100 host (A100 datasheet \
                  figures)",
    memory_mib: 81920,
    f32_tflops: 19.5,
    tensor_tflops: 312.0,
    memory_gbs: 2039.0,
    pcie: PCIE4_X16,
    host_gib: 256,
    host_dram_gbs: 51.2,
    links: DGX_A100_LINKS,
    compute_capability: (8, 0),
};

/// NVIDIA H100 SXM5 80 GB, one eighth of a DGX H100.
///
/// NVIDIA H100 Tensor Core GPU datasheet: 67 TFLOP/s FP32, 989 TFLOP/s BF16/FP16 tensor dense
/// (the datasheet's 1979 is with sparsity), 3.35 TB/s HBM3, PCIe 5.0 x16. `nvidia-smi` reports
/// 81559 MiB. Host: the DGX H100 datasheet's 2 TB over 8 GPUs = 256 GiB each, and its two Xeon
/// Platinum 8480C with 8 channels of DDR5-4800 each (614.4 GB/s) over 8 GPUs = 76.8 GB/s each.
const H100: GpuSpec = GpuSpec {
    name: "h100",
    description: "NVIDIA H100 SXM5 80 GB, PCIe 5.0 x16, 1/8 of a DGX H100 host (H100 datasheet \
                  figures)",
    memory_mib: 81559,
    f32_tflops: 67.0,
    tensor_tflops: 989.0,
    memory_gbs: 3350.0,
    pcie: PCIE5_X16,
    host_gib: 256,
    host_dram_gbs: 76.8,
    links: DGX_H100_LINKS,
    compute_capability: (9, 0),
};

/// NVIDIA H200 SXM 141 GB, one eighth of a DGX H200.
///
/// NVIDIA H200 Tensor Core GPU datasheet: the H100's GH100 compute (67 TFLOP/s FP32, 989
/// TFLOP/s BF16/FP16 tensor dense, 1979 with sparsity) with 141 GB HBM3e at 4.8 TB/s, PCIe 5.0
/// x16. `nvidia-smi` reports 143771 MiB. Host: the DGX H200 datasheet's 2 TB and the same two
/// Xeon Platinum 8480C as the DGX H100, over 8 GPUs.
const H200: GpuSpec = GpuSpec {
    name: "h200",
    description: "NVIDIA H200 SXM 141 GB, PCIe 5.0 x16, 1/8 of a DGX H200 host (H200 datasheet \
                  figures)",
    memory_mib: 143771,
    f32_tflops: 67.0,
    tensor_tflops: 989.0,
    memory_gbs: 4800.0,
    pcie: PCIE5_X16,
    host_gib: 256,
    host_dram_gbs: 76.8,
    links: DGX_H100_LINKS,
    compute_capability: (9, 0),
};

impl HardwareProfile {
    /// A named preset (see [`PRESETS`]); the name is matched ignoring case, `-`, `_` and spaces,
    /// so `RTX 3090` and `a100_80gb` work. `None` for an unknown name.
    ///
    /// `host` describes the machine this runs on, read now: its core count and memory.
    pub fn preset(name: &str) -> Option<Self> {
        let key = normalize_name(name);
        let spec = match key.as_str() {
            "rtx3090" => RTX3090,
            "rtx4090" => RTX4090,
            "a10040gb" => A100_40GB,
            "a10080gb" => A100_80GB,
            "h100" => H100,
            "h200" => H200,
            "host" => return Some(Self::host()),
            _ => return None,
        };
        Some(spec.profile())
    }

    /// The names [`preset`](Self::preset) accepts.
    pub fn presets() -> &'static [&'static str] {
        PRESETS
    }

    /// A preset by name, or else a profile JSON file at that path: what `--hardware` takes.
    /// The file is read as [`from_json_file`](Self::from_json_file) reads it: a regular file
    /// of at most [`MAX_PROFILE_BYTES`].
    pub fn load(name_or_path: &str) -> Result<Self> {
        if let Some(profile) = Self::preset(name_or_path) {
            return Ok(profile);
        }
        let path = Path::new(name_or_path);
        // `symlink_metadata`: a dangling link is named as a file, not as an unknown preset.
        if path.symlink_metadata().is_ok() {
            return Self::from_json_file(path);
        }
        Err(IrError::UnknownHardware {
            name: name_or_path.to_string(),
            known: PRESETS.join(", "),
        })
    }

    /// This machine as the "device": the host backend runs kernels on the CPU cores and its
    /// arena lives in host RAM, so device and host share one memory, split half and half, and
    /// every copy is a `memcpy`.
    ///
    /// Peak f32 FLOP/s is the core count times an assumed 64 GFLOP/s per core (2 FMA pipes x 8
    /// f32 lanes x 2 FLOP x 2 GHz); bf16/f16 run at the f32 rate (no matrix units assumed).
    /// Memory bandwidth is the core count times an assumed 10 GB/s per core. Memory comes from
    /// `/proc/meminfo` (16 GiB when it cannot be read). `protrain profile` measures all of it.
    pub fn host() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
        let memory = host_memory_total().unwrap_or(HOST_FALLBACK_MEMORY);
        let f32_flops = cores as f64 * HOST_F32_FLOPS_PER_CORE;
        let bandwidth = cores as f64 * HOST_BANDWIDTH_PER_CORE;
        let memcpy = (bandwidth / 2.0).round();
        let adam = (bandwidth * HOST_DRAM_EFFICIENCY / ADAM_BYTES_PER_PARAM).round();
        Self {
            name: "host".to_string(),
            description: format!(
                "this machine's CPU as the device: {cores} cores x 64 GFLOP/s f32 and 10 GB/s \
                 each (assumed), {} of RAM split between arena and host region",
                format_bytes(memory)
            ),
            device_memory_bytes: memory / 2,
            host_memory_bytes: memory - memory / 2,
            reserved_device_bytes: 0,
            peak_flops: PeakFlops {
                f32: f32_flops,
                bf16: f32_flops,
                f16: f32_flops,
            },
            device_bandwidth: bandwidth,
            h2d_bandwidth: memcpy,
            d2h_bandwidth: memcpy,
            host_memcpy_bandwidth: memcpy,
            launch_overhead_s: HOST_LAUNCH_OVERHEAD_S,
            cpu_adam_params_per_s: adam,
            cpu_adam_op_s: 0.0,
            cpu_adam_compute_share: None,
            cpu_adam_copy_share: None,
            cpu_adam_compute_copy_share: None,
            gpu_adam_params_per_s: adam,
            measured_ops: Vec::new(),
            interconnect: None,
            disk: Disk::default(),
            compute_capability: None,
        }
    }

    /// Whether the GPU runs the CUDA backend's flash attention kernels (compute capability
    /// [`FLASH_MIN_COMPUTE_CAPABILITY`](crate::workspace::FLASH_MIN_COMPUTE_CAPABILITY) or
    /// newer), as far as the profile says: `None` when it does not state its compute
    /// capability.
    pub fn flash_attention(&self) -> Option<bool> {
        self.compute_capability.map(flash_attention_supported)
    }

    /// Whether the profile describes the host CPU as the device: the `host` preset, or a
    /// profile `protrain profile --backend host` measured (named `host...`). The host backend
    /// runs fused attention tiles and shares its cores between streams, and compiles f32 by
    /// default; the cost model and the defaults ask this one question.
    pub fn is_host(&self) -> bool {
        self.name.starts_with("host")
    }

    /// Device bytes a schedule may use: device memory minus the reserved bytes (0 if the
    /// reservation exceeds the memory).
    pub fn usable_device_bytes(&self) -> u64 {
        self.device_memory_bytes
            .saturating_sub(self.reserved_device_bytes)
    }

    /// The same profile with another device memory size (`--device-memory`); the reservation
    /// is kept, so the usable budget is `bytes` minus it.
    pub fn with_device_memory(mut self, bytes: u64) -> Self {
        self.device_memory_bytes = bytes;
        self
    }

    /// The same profile with another host memory size (`--host-memory`).
    pub fn with_host_memory(mut self, bytes: u64) -> Self {
        self.host_memory_bytes = bytes;
        self
    }

    /// The same profile with another disk size (`--disk-memory`).
    pub fn with_disk_memory(mut self, bytes: u64) -> Self {
        self.disk.memory_bytes = bytes;
        self
    }

    /// This profile with ranks as threads of one process, exchanging through its memory (the
    /// host backend's collectives): up to `ranks` per "node", at the device bandwidth, with
    /// no network. For the `host` profile, whose device is this machine's memory; a profile
    /// that already says how its GPUs are linked keeps its interconnect.
    pub fn with_thread_ranks(mut self, ranks: u32) -> Self {
        if self.interconnect.is_none() {
            self.interconnect = Some(Interconnect {
                gpus_per_node: ranks.max(1),
                intra_node_bandwidth: self.device_bandwidth,
                inter_node_bandwidth: self.device_bandwidth,
                step_latency_s: self.launch_overhead_s,
            });
        }
        self
    }

    /// This profile with `resource` `factor` times as fast: its rates multiplied and its
    /// fixed costs divided by `factor` (for [`Resource::Compute`], every peak FLOP/s, the
    /// device bandwidth, the device AdamW rate, the launch overhead and every measured op
    /// time; for [`Resource::Network`], both bandwidths and the ring step latency of the
    /// interconnect, where there is one). What `explain` re-simulates to say what a step would
    /// take with one resource faster.
    pub fn with_faster(mut self, resource: Resource, factor: f64) -> Self {
        match resource {
            Resource::Compute => {
                self.peak_flops.f32 *= factor;
                self.peak_flops.bf16 *= factor;
                self.peak_flops.f16 *= factor;
                self.device_bandwidth *= factor;
                self.gpu_adam_params_per_s *= factor;
                self.launch_overhead_s /= factor;
                for m in &mut self.measured_ops {
                    m.seconds /= factor;
                }
            }
            Resource::PcieToDevice => self.h2d_bandwidth *= factor,
            Resource::PcieToHost => self.d2h_bandwidth *= factor,
            Resource::CpuAdam => {
                self.cpu_adam_params_per_s *= factor;
                self.cpu_adam_op_s /= factor;
            }
            Resource::Disk => {
                self.disk.read_bandwidth *= factor;
                self.disk.write_bandwidth *= factor;
            }
            Resource::Network => {
                if let Some(i) = &mut self.interconnect {
                    i.intra_node_bandwidth *= factor;
                    i.inter_node_bandwidth *= factor;
                    i.step_latency_s /= factor;
                }
            }
        }
        self
    }

    /// The peak FLOP/s for ops computing in `dtype`.
    pub fn peak(&self, dtype: DType) -> f64 {
        self.peak_flops.get(dtype)
    }

    /// The measured time of the op `key` ([`op_key`]), if the profile has one; the last entry
    /// wins when a key repeats.
    pub fn measured(&self, key: &str) -> Option<f64> {
        self.measured_ops
            .iter()
            .rev()
            .find(|m| m.key == key)
            .map(|m| m.seconds)
    }

    /// Adds the measured ops of `other` whose keys this profile does not have yet (profiling a
    /// second graph of the same model, such as its fused form).
    pub fn add_measured_ops(&mut self, other: &[MeasuredOp]) {
        for m in other {
            if self.measured(&m.key).is_none() {
                self.measured_ops.push(m.clone());
            }
        }
    }

    /// One line for people and schedule headers: name, memory, peaks, bandwidths.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "{}: {} device ({} usable), {} host, {:.1} TFLOP/s bf16, {:.1} TFLOP/s f32, \
             {:.0} GB/s device, {:.1}/{:.1} GB/s H2D/D2H",
            self.name,
            format_bytes(self.device_memory_bytes),
            format_bytes(self.usable_device_bytes()),
            format_bytes(self.host_memory_bytes),
            self.peak_flops.bf16 / TFLOPS,
            self.peak_flops.f32 / TFLOPS,
            self.device_bandwidth / GB,
            self.h2d_bandwidth / GB,
            self.d2h_bandwidth / GB,
        );
        if !self.measured_ops.is_empty() {
            let _ = write!(s, ", {} measured ops", self.measured_ops.len());
        }
        s
    }

    /// Checks that every figure is usable: rates finite and positive, the reservation smaller
    /// than device memory, measured times finite and non-negative.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| {
            Err(IrError::BadProfile {
                name: self.name.clone(),
                why,
            })
        };
        if self.device_memory_bytes == 0 {
            return bad("device_memory_bytes is 0".into());
        }
        if self.reserved_device_bytes >= self.device_memory_bytes {
            return bad(format!(
                "reserved_device_bytes ({}) leaves nothing of device_memory_bytes ({})",
                format_bytes(self.reserved_device_bytes),
                format_bytes(self.device_memory_bytes)
            ));
        }
        let rates = [
            ("peak_flops.f32", self.peak_flops.f32),
            ("peak_flops.bf16", self.peak_flops.bf16),
            ("peak_flops.f16", self.peak_flops.f16),
            ("device_bandwidth", self.device_bandwidth),
            ("h2d_bandwidth", self.h2d_bandwidth),
            ("d2h_bandwidth", self.d2h_bandwidth),
            ("host_memcpy_bandwidth", self.host_memcpy_bandwidth),
            ("cpu_adam_params_per_s", self.cpu_adam_params_per_s),
            ("gpu_adam_params_per_s", self.gpu_adam_params_per_s),
            ("disk.read_bandwidth", self.disk.read_bandwidth),
            ("disk.write_bandwidth", self.disk.write_bandwidth),
        ];
        for (field, value) in rates {
            if !(value.is_finite() && value > 0.0) {
                return bad(format!("{field} must be a positive number, got {value}"));
            }
        }
        if !(self.cpu_adam_op_s.is_finite() && self.cpu_adam_op_s >= 0.0) {
            return bad(format!(
                "cpu_adam_op_s must be a non-negative number, got {}",
                self.cpu_adam_op_s
            ));
        }
        let shares = [
            (
                "cpu_adam_compute_share",
                self.cpu_adam_compute_share,
                "the even split (0.5)",
            ),
            (
                "cpu_adam_copy_share",
                self.cpu_adam_copy_share,
                "no loss (1)",
            ),
            (
                "cpu_adam_compute_copy_share",
                self.cpu_adam_compute_copy_share,
                "cpu_adam_compute_share's",
            ),
        ];
        for (field, share, default) in shares {
            if let Some(share) = share {
                if !(share.is_finite() && share > 0.0 && share <= 1.0) {
                    return bad(format!(
                        "{field} must be above 0 and at most 1, got {share}; remove it to \
                         take {default}"
                    ));
                }
            }
        }
        if !(self.launch_overhead_s.is_finite() && self.launch_overhead_s >= 0.0) {
            return bad(format!(
                "launch_overhead_s must be a non-negative number, got {}",
                self.launch_overhead_s
            ));
        }
        if let Some(link) = &self.interconnect {
            if link.gpus_per_node == 0 {
                return bad("interconnect.gpus_per_node is 0; a node has at least one GPU".into());
            }
            for (field, value) in [
                (
                    "interconnect.intra_node_bandwidth",
                    link.intra_node_bandwidth,
                ),
                (
                    "interconnect.inter_node_bandwidth",
                    link.inter_node_bandwidth,
                ),
            ] {
                if !(value.is_finite() && value > 0.0) {
                    return bad(format!("{field} must be a positive number, got {value}"));
                }
            }
            if !(link.step_latency_s.is_finite() && link.step_latency_s >= 0.0) {
                return bad(format!(
                    "interconnect.step_latency_s must be a non-negative number, got {}",
                    link.step_latency_s
                ));
            }
        }
        if let Some((major, minor)) = self.compute_capability {
            if !(1..=99).contains(&major) || !(0..=9).contains(&minor) {
                return bad(format!(
                    "compute_capability [{major}, {minor}] is not a CUDA compute capability; \
                     give [major, minor] as `nvidia-smi --query-gpu=compute_cap` prints it \
                     (8.0 is [8, 0]), or leave the field out"
                ));
            }
        }
        for m in &self.measured_ops {
            if m.key.trim().is_empty() {
                return bad("a measured op has an empty key".into());
            }
            if !(m.seconds.is_finite() && m.seconds >= 0.0) {
                return bad(format!(
                    "measured op `{}` has time {}, expected a non-negative number of seconds",
                    m.key, m.seconds
                ));
            }
        }
        Ok(())
    }

    /// Parses and validates a profile from JSON text.
    pub fn from_json(text: &str) -> Result<Self> {
        let profile: Self = serde_json::from_str(text).map_err(|e| IrError::ProfileJson {
            origin: "JSON text".into(),
            source: e,
        })?;
        profile.validate()?;
        Ok(profile)
    }

    /// Reads, parses and validates a profile JSON file.
    pub fn from_json_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let what = "a hardware profile JSON written by `protrain profile`, or a preset name";
        let bytes = crate::file::read_input(path, MAX_PROFILE_BYTES, what)?;
        let profile: Self = serde_json::from_slice(&bytes).map_err(|e| IrError::ProfileJson {
            origin: path.display().to_string(),
            source: e,
        })?;
        profile.validate()?;
        Ok(profile)
    }

    /// The profile as pretty-printed JSON, the format [`from_json`](Self::from_json) reads.
    ///
    /// Whole numbers read back exactly; other floats may come back one unit in the last place
    /// off (serde_json's default float parser), far below any figure's precision.
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self).map_err(|e| IrError::ProfileJson {
            origin: format!("profile `{}`", self.name),
            source: e,
        })
    }
}

/// The measured-table key of an op: its mnemonic, the attributes that change its cost, and its
/// input types, e.g. `linear f32[8,1024,768]x[768,2304]` or
/// `attention heads=12 kv_heads=12 head_dim=64 qkv=packed bf16[8,1024,2304]`.
///
/// Inputs are joined with `x`; an input's element type is written only when it differs from
/// the previous input's (`embedding i32[8,1024]xf32[50257,768]`). Attributes that do not change
/// the work (epsilons, learning rates, RoPE bases and scaling, padding rows, offsets) are left
/// out, so one measurement serves every value of them; any other attribute is kept.
pub fn op_key(kind: &OpKind, inputs: &[&TensorType]) -> String {
    const COST_NEUTRAL: &[&str] = &[
        "eps",
        "lr",
        "betas",
        "weight_decay",
        "theta",
        "scaling",
        "max_norm",
        "padding_idx",
        "offset",
    ];
    let mut key = kind.mnemonic().to_string();
    for (name, value) in kind.attributes() {
        if !COST_NEUTRAL.contains(&name) {
            let _ = write!(key, " {name}={value}");
        }
    }
    let mut previous: Option<DType> = None;
    for (i, t) in inputs.iter().enumerate() {
        key.push(if i == 0 { ' ' } else { 'x' });
        if previous != Some(t.dtype) {
            key.push_str(t.dtype.name());
        }
        previous = Some(t.dtype);
        key.push('[');
        for (j, d) in t.shape.iter().enumerate() {
            if j > 0 {
                key.push(',');
            }
            let _ = write!(key, "{d}");
        }
        key.push(']');
    }
    key
}

/// Lowercases and drops `-`, `_` and spaces, so preset names match loosely.
fn normalize_name(name: &str) -> String {
    name.chars()
        .filter(|c| !matches!(c, '-' | '_' | ' '))
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

/// Total RAM from `/proc/meminfo`, where there is one.
fn host_memory_total() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line
        .trim_start_matches("MemTotal:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::{QkvLayout, WeightLayout};

    #[test]
    fn every_preset_loads_and_validates() {
        for name in PRESETS {
            let p = HardwareProfile::preset(name).expect(name);
            assert_eq!(p.name, *name);
            p.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(p.usable_device_bytes() < p.device_memory_bytes || name == &"host");
            assert!(!p.description.is_empty());
        }
        assert_eq!(HardwareProfile::presets(), PRESETS);
    }

    #[test]
    fn preset_relations_are_sane() {
        let get = |n: &str| HardwareProfile::preset(n).unwrap();
        let (h100, h200) = (get("h100"), get("h200"));
        assert!(h200.device_memory_bytes > h100.device_memory_bytes);
        assert!(h200.device_bandwidth > h100.device_bandwidth);
        assert_eq!(h200.peak_flops, h100.peak_flops);
        assert!(get("a100-80gb").device_memory_bytes > get("a100-40gb").device_memory_bytes);
        for name in [
            "rtx3090",
            "rtx4090",
            "a100-40gb",
            "a100-80gb",
            "h100",
            "h200",
        ] {
            let p = get(name);
            assert!(p.peak(DType::BF16) > p.peak(DType::F32), "{name}");
            assert_eq!(p.peak(DType::BF16), p.peak(DType::F16), "{name}");
            assert!(p.device_bandwidth > p.h2d_bandwidth, "{name}");
            assert!(p.gpu_adam_params_per_s > p.cpu_adam_params_per_s, "{name}");
            assert!(p.host_memory_bytes > p.device_memory_bytes, "{name}");
        }
        assert!(get("h100").h2d_bandwidth > get("a100-80gb").h2d_bandwidth);
        assert_eq!(get("rtx3090").device_memory_bytes, 24 * GIB);
    }

    #[test]
    fn preset_names_match_loosely() {
        assert_eq!(
            HardwareProfile::preset("RTX 3090"),
            HardwareProfile::preset("rtx3090")
        );
        assert_eq!(
            HardwareProfile::preset("A100_80GB").map(|p| p.name),
            Some("a100-80gb".to_string())
        );
        assert_eq!(HardwareProfile::preset("v100"), None);
    }

    #[test]
    fn load_names_an_unknown_hardware_and_the_presets() {
        let err = HardwareProfile::load("tpu-v9").unwrap_err().to_string();
        assert!(err.contains("tpu-v9"), "{err}");
        assert!(err.contains("rtx3090, rtx4090"), "{err}");
        assert_eq!(HardwareProfile::load("h200").unwrap().name, "h200");
    }

    #[test]
    fn host_preset_describes_this_machine() {
        let host = HardwareProfile::preset("host").unwrap();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        assert_eq!(host.peak(DType::F32), cores * 64e9);
        assert_eq!(host.peak(DType::BF16), host.peak(DType::F32));
        assert_eq!(host.h2d_bandwidth, host.host_memcpy_bandwidth);
        assert_eq!(host.reserved_device_bytes, 0);
    }

    #[test]
    fn json_round_trip_keeps_every_field() {
        let mut p = HardwareProfile::preset("rtx4090")
            .unwrap()
            .with_device_memory(12 * GIB);
        p.measured_ops.push(MeasuredOp {
            key: "linear bf16[8,1024,768]x[768,2304]".into(),
            seconds: 1.25e-4,
        });
        let text = p.to_json().unwrap();
        assert_eq!(HardwareProfile::from_json(&text).unwrap(), p);
        // Every preset reads back exactly, and omits the empty op table.
        for name in PRESETS {
            let preset = HardwareProfile::preset(name).unwrap();
            let text = preset.to_json().unwrap();
            assert!(!text.contains("measured_ops"), "{name}");
            assert_eq!(HardwareProfile::from_json(&text).unwrap(), preset, "{name}");
        }
    }

    #[test]
    fn gpu_presets_say_how_their_gpus_are_linked() {
        let link = |name: &str| {
            HardwareProfile::preset(name)
                .unwrap()
                .interconnect
                .unwrap_or_else(|| panic!("{name} has an interconnect"))
        };
        // NVLink 4 over NVLink 3 over PCIe through the host, each derated to a bus bandwidth.
        assert_eq!(link("h200").intra_node_bandwidth, 360e9);
        assert_eq!(link("a100-80gb").intra_node_bandwidth, 240e9);
        assert_eq!(link("rtx3090").intra_node_bandwidth, 12.6e9);
        assert_eq!(link("a100-40gb").gpus_per_node, 8);
        assert_eq!(link("rtx4090").gpus_per_node, 4);
        assert!(link("h100").inter_node_bandwidth > link("a100-80gb").inter_node_bandwidth);
        // The host backend's ranks are threads, not GPUs on links.
        assert!(HardwareProfile::preset("host")
            .unwrap()
            .interconnect
            .is_none());
    }

    #[test]
    fn a_profile_without_an_interconnect_still_loads_and_a_bad_one_is_named() {
        let mut p = HardwareProfile::preset("rtx3090").unwrap();
        p.interconnect = None;
        let text = p.to_json().unwrap();
        assert!(!text.contains("interconnect"), "{text}");
        assert_eq!(HardwareProfile::from_json(&text).unwrap(), p);
        let mut bad = HardwareProfile::preset("h100").unwrap();
        bad.interconnect.as_mut().unwrap().gpus_per_node = 0;
        let err = HardwareProfile::from_json(&bad.to_json().unwrap()).unwrap_err();
        assert!(err.to_string().contains("gpus_per_node is 0"), "{err}");
        let mut bad = HardwareProfile::preset("h100").unwrap();
        bad.interconnect.as_mut().unwrap().inter_node_bandwidth = -1.0;
        let err = HardwareProfile::from_json(&bad.to_json().unwrap()).unwrap_err();
        assert!(
            err.to_string()
                .contains("inter_node_bandwidth must be a positive"),
            "{err}"
        );
    }

    /// Every GPU preset states its compute capability (what decides flash attention), the
    /// host none; a profile written without one still loads, and a value that is not a
    /// compute capability is refused with the form it takes.
    #[test]
    fn gpu_presets_state_their_compute_capability() {
        let cc = |name: &str| HardwareProfile::preset(name).unwrap().compute_capability;
        assert_eq!(cc("rtx3090"), Some((8, 6)));
        assert_eq!(cc("rtx4090"), Some((8, 9)));
        assert_eq!(cc("a100-40gb"), Some((8, 0)));
        assert_eq!(cc("h200"), Some((9, 0)));
        assert_eq!(cc("host"), None);
        for name in PRESETS.iter().filter(|n| **n != "host") {
            assert_eq!(
                HardwareProfile::preset(name).unwrap().flash_attention(),
                Some(true)
            );
        }
        let mut older = HardwareProfile::preset("a100-80gb").unwrap();
        older.compute_capability = Some((7, 0));
        assert_eq!(older.flash_attention(), Some(false));
        let text = older.to_json().unwrap();
        assert!(
            text.contains("\"compute_capability\": [\n    7,\n    0\n  ]"),
            "{text}"
        );
        assert_eq!(HardwareProfile::from_json(&text).unwrap(), older);
        older.compute_capability = None;
        let text = older.to_json().unwrap();
        assert!(!text.contains("compute_capability"), "{text}");
        assert_eq!(
            HardwareProfile::from_json(&text).unwrap().flash_attention(),
            None
        );
        older.compute_capability = Some((80, 10));
        let err = HardwareProfile::from_json(&older.to_json().unwrap()).unwrap_err();
        assert!(err.to_string().contains("[8, 0]"), "{err}");
    }

    #[test]
    fn json_errors_name_the_problem() {
        let check = |text: &str, expect: &str| {
            let err = HardwareProfile::from_json(text).unwrap_err().to_string();
            assert!(err.contains(expect), "`{err}` should mention `{expect}`");
        };
        let good = HardwareProfile::preset("rtx3090")
            .unwrap()
            .to_json()
            .unwrap();
        check(
            &good.replace("\"device_bandwidth\"", "\"device_bandwith\""),
            "unknown field `device_bandwith`",
        );
        check(&good.replace("\"h2d_bandwidth\"", "\"x\""), "unknown field");
        check("{}", "missing field `name`");
        check("not json", "not a hardware profile");
        let mut zero = HardwareProfile::preset("rtx3090").unwrap();
        zero.h2d_bandwidth = 0.0;
        check(
            &zero.to_json().unwrap(),
            "h2d_bandwidth must be a positive number",
        );
        let mut reserved = HardwareProfile::preset("rtx3090").unwrap();
        reserved.reserved_device_bytes = reserved.device_memory_bytes;
        check(&reserved.to_json().unwrap(), "reserved_device_bytes");
        let missing = HardwareProfile::from_json_file("/nonexistent/profile.json")
            .unwrap_err()
            .to_string();
        assert!(missing.contains("/nonexistent/profile.json"), "{missing}");
    }

    #[test]
    fn a_resource_twice_as_fast_doubles_its_figures_and_no_others() {
        let base = HardwareProfile::preset("h100").unwrap();
        for r in Resource::ALL {
            let f = base.clone().with_faster(r, 2.0);
            assert_eq!(
                f.peak_flops.bf16 == base.peak_flops.bf16 * 2.0
                    && f.device_bandwidth == base.device_bandwidth * 2.0,
                r == Resource::Compute
            );
            assert_eq!(
                f.launch_overhead_s * 2.0 == base.launch_overhead_s,
                r == Resource::Compute
            );
            assert_eq!(
                f.h2d_bandwidth == base.h2d_bandwidth * 2.0,
                r == Resource::PcieToDevice
            );
            assert_eq!(
                f.d2h_bandwidth == base.d2h_bandwidth * 2.0,
                r == Resource::PcieToHost
            );
            assert_eq!(
                f.cpu_adam_params_per_s == base.cpu_adam_params_per_s * 2.0,
                r == Resource::CpuAdam
            );
            assert_eq!(
                f.disk.read_bandwidth == base.disk.read_bandwidth * 2.0
                    && f.disk.write_bandwidth == base.disk.write_bandwidth * 2.0,
                r == Resource::Disk
            );
            let (a, b) = (f.interconnect.unwrap(), base.interconnect.unwrap());
            assert_eq!(
                a.intra_node_bandwidth == b.intra_node_bandwidth * 2.0
                    && a.inter_node_bandwidth == b.inter_node_bandwidth * 2.0,
                r == Resource::Network
            );
            assert_eq!(f.device_memory_bytes, base.device_memory_bytes);
        }
        // Measured op times halve with the compute.
        let mut measured = base.clone();
        measured.measured_ops.push(MeasuredOp {
            key: "k".into(),
            seconds: 1.0,
        });
        let f = measured.with_faster(Resource::Compute, 2.0);
        assert_eq!(f.measured("k"), Some(0.5));
    }

    #[test]
    fn overrides_change_the_budget() {
        let p = HardwareProfile::preset("rtx3090")
            .unwrap()
            .with_device_memory(8 * GIB)
            .with_host_memory(32 * GIB);
        assert_eq!(p.device_memory_bytes, 8 * GIB);
        assert_eq!(p.usable_device_bytes(), 7 * GIB);
        assert_eq!(p.host_memory_bytes, 32 * GIB);
        assert_eq!(
            p.clone().with_device_memory(GIB / 2).usable_device_bytes(),
            0
        );
        assert!(p
            .summary()
            .starts_with("rtx3090: 8.00 GiB device (7.00 GiB usable)"));
    }

    #[test]
    fn measured_lookup_prefers_the_last_entry() {
        let mut p = HardwareProfile::preset("h100").unwrap();
        for seconds in [1.0, 2.0] {
            p.measured_ops.push(MeasuredOp {
                key: "add".into(),
                seconds,
            });
        }
        assert_eq!(p.measured("add"), Some(2.0));
        assert_eq!(p.measured("gelu"), None);
    }

    #[test]
    fn op_keys_are_canonical() {
        let x = TensorType::new([8, 1024, 768], DType::F32);
        let w = TensorType::new([768, 2304], DType::F32);
        let linear = OpKind::Linear {
            bias: false,
            layout: WeightLayout::InOut,
        };
        assert_eq!(
            op_key(&linear, &[&x, &w]),
            "linear weight=in_out f32[8,1024,768]x[768,2304]"
        );
        let tokens = TensorType::new([8, 1024], DType::I32);
        let table = TensorType::new([50257, 768], DType::F32);
        assert_eq!(
            op_key(
                &OpKind::Embedding {
                    padding_idx: Some(1)
                },
                &[&tokens, &table]
            ),
            "embedding i32[8,1024]xf32[50257,768]"
        );
        let qkv = TensorType::new([8, 1024, 2304], DType::BF16);
        let attention = OpKind::Attention {
            heads: 12,
            kv_heads: 12,
            head_dim: 64,
            window: None,
            qkv: QkvLayout::Packed,
            scale: None,
            softcap: None,
        };
        assert_eq!(
            op_key(&attention, &[&qkv]),
            "attention heads=12 kv_heads=12 head_dim=64 qkv=packed bf16[8,1024,2304]"
        );
        // Epsilons do not change the work, so they do not split the table.
        let ln = |eps| op_key(&OpKind::LayerNorm { eps }, &[&x]);
        assert_eq!(ln(1e-5), ln(1e-6));
        assert_eq!(op_key(&OpKind::Add, &[]), "add");
        assert_eq!(
            op_key(&OpKind::GradNormSq, &[&TensorType::new([], DType::F32)]),
            "grad_norm_sq f32[]"
        );
    }
}
