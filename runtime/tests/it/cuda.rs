//! Every kernel family of the CUDA backend against the host kernel, on random inputs, in f32
//! and bf16 storage. Needs the `cuda` feature and a GPU; run by `scripts/gpu-check.sh`:
//!
//! ```text
//! cargo test --release --features cuda -p protrain-runtime --test it -- --include-ignored cuda::
//! ```
//!
//! Every test is `#[ignore = "needs a GPU or the CUDA simulator"]`: `cuda-sim/ci.sh` runs them on
//! the simulator and `scripts/gpu-check.sh` on a GPU, both with `--include-ignored`. Run where
//! neither is, a test fails saying what is missing: it never passes by returning early.
//!
//! Each case builds a one-op graph, launches the op through `CudaBackend` on operands laid out
//! in the arena, and runs the same op through `dispatch::run` (the host backend's code) on the
//! same values: for bf16 storage the host gets the inputs rounded to bf16, exactly what the
//! device reads. The error of each output element is `|got - want| / (1 + |want|)`, and its
//! maximum must stay under the case's tolerance:
//!
//! - f32, elementwise and gathers (activations, add, embeddings, RoPE): 1e-5 (`expf`, `sincosf`
//!   may differ from the host's by an ulp or two);
//! - f32, reductions and matmuls (norms, attention, cross-entropy, linear via cuBLAS without
//!   TF32): 1e-4 (summation orders differ);
//! - bf16 storage: 1e-2 (each output is rounded to bf16 once or twice: 2^-8 relative, half an
//!   ulp each, plus the f32 differences above); f32 outputs of bf16 ops (log-sum-exps, the
//!   loss, squared norms): 1e-4;
//! - AdamW: the same bits as the host (the device update is written to round as the host's);
//! - mixture of experts: indices (the packed layout) exactly; in f32 on the simulator the
//!   routing, dispatch and combine give the host's bits, `ELEMENTWISE` on a GPU; the grouped
//!   matmul `REDUCTION`.

use protrain_ir::{
    BlockKind, DType, Epilogue, Graph, GraphInfo, OpId, OpKind, Phase, QkvLayout, Role,
    RopeScaling, Space, StreamKind, TensorType, ValueId, WeightLayout,
};
use protrain_runtime::backend::{Address, Backend, Launch};
use protrain_runtime::cuda::CudaBackend;
use protrain_runtime::dispatch::{self, Inputs, Outcome, Prepared};

const ELEMENTWISE: f64 = 1e-5;
const REDUCTION: f64 = 1e-4;
const BF16: f64 = 1e-2;

/// Fails the test, with what is missing, when the CUDA backend cannot run here.
fn require_gpu() {
    if let Err(why) = protrain_runtime::cuda::available() {
        panic!(
            "no CUDA device is available: {why}\nthese tests need a GPU; \
             scripts/gpu-check.sh runs them on one"
        );
    }
}

/// SplitMix64: deterministic inputs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-scale, scale).
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale)
            .collect()
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// An input's values.
#[derive(Clone, Debug)]
enum Data {
    F(Vec<f32>),
    I(Vec<i32>),
}

/// A one-op graph under construction.
struct Builder {
    g: Graph,
    data: Vec<Data>,
    inputs: Vec<ValueId>,
    rng: Rng,
}

impl Builder {
    fn new(seed: u64) -> Self {
        let mut g = Graph::new(GraphInfo {
            model: "cuda-kernels".into(),
            batch: 1,
            seq: 1,
        });
        g.add_block("b", BlockKind::Embedding);
        Self {
            g,
            data: Vec::new(),
            inputs: Vec::new(),
            rng: Rng(seed),
        }
    }

    /// A float input of `shape` in `dtype`, uniform in [-scale, scale).
    fn float(mut self, shape: &[u64], dtype: DType, scale: f32) -> Self {
        let n = shape.iter().product::<u64>() as usize;
        let values = self.rng.vec(n, scale);
        self.float_values(shape, dtype, values)
    }

    /// A float input of `shape` in `dtype` with these values.
    fn float_values(mut self, shape: &[u64], dtype: DType, values: Vec<f32>) -> Self {
        let block = protrain_ir::BlockId::new(0);
        let name = format!("in{}", self.inputs.len());
        let p = self.g.add_param(name, shape.to_vec(), dtype, block);
        self.inputs.push(self.g.param(p).value);
        self.data.push(Data::F(values));
        self
    }

    /// Token ids of `shape`, below `vocab`.
    fn tokens(mut self, shape: &[u64], vocab: usize) -> Self {
        let n = shape.iter().product::<u64>() as usize;
        let ids = (0..n).map(|_| self.rng.below(vocab) as i32).collect();
        let name = format!("in{}", self.inputs.len());
        let v = self
            .g
            .add_input(name, TensorType::new(shape.to_vec(), DType::I32));
        self.inputs.push(v);
        self.data.push(Data::I(ids));
        self
    }

    /// An i32 input of `shape` with these values (routing tables).
    fn ints(mut self, shape: &[u64], values: Vec<i32>) -> Self {
        let name = format!("in{}", self.inputs.len());
        let v = self
            .g
            .add_input(name, TensorType::new(shape.to_vec(), DType::I32));
        self.inputs.push(v);
        self.data.push(Data::I(values));
        self
    }

    /// The op, added last.
    fn op(mut self, kind: OpKind) -> Case {
        let block = protrain_ir::BlockId::new(0);
        let types: Vec<&TensorType> = self.inputs.iter().map(|&v| &self.g.value(v).ty).collect();
        let n_out = kind
            .infer(&types)
            .unwrap_or_else(|e| panic!("{}: {e}", kind.mnemonic()))
            .len();
        let outputs: Vec<(String, Role)> = (0..n_out)
            .map(|i| (format!("out{i}"), Role::Activation))
            .collect();
        self.g
            .add_op_multi(kind, &self.inputs, &outputs, block, Phase::Forward)
            .unwrap();
        let op = OpId::new(self.g.op_count() - 1);
        // What the device reads of a bf16 input is its rounding; so does the host.
        for (data, &v) in self.data.iter_mut().zip(&self.inputs) {
            if let (Data::F(x), DType::BF16) = (data, self.g.value(v).ty.dtype) {
                for e in x.iter_mut() {
                    *e = half::bf16::from_f32(*e).to_f32();
                }
            }
        }
        Case {
            g: self.g,
            op,
            data: self.data,
        }
    }
}

/// A one-op graph and its inputs' values.
struct Case {
    g: Graph,
    op: OpId,
    data: Vec<Data>,
}

/// The host kernels' inputs: input `i` as f32 or i32 values.
struct HostInputs<'a>(&'a [Data]);

impl<'a> Inputs<'a> for HostInputs<'a> {
    fn f32(&self, i: usize) -> &'a [f32] {
        match &self.0[i] {
            Data::F(x) => x,
            Data::I(_) => panic!("input {i} is token ids"),
        }
    }

    fn i32(&self, i: usize) -> &'a [i32] {
        match &self.0[i] {
            Data::I(x) => x,
            Data::F(_) => panic!("input {i} is floats"),
        }
    }
}

/// Where a case's operands lie on the device.
struct Placed {
    backend: CudaBackend,
    inputs: Vec<Address>,
    outputs: Vec<Address>,
    workspace: Option<(Address, u64)>,
    /// The f32 master weight of a bf16 AdamW.
    master: Option<Address>,
}

fn device(offset: u64) -> Address {
    Address {
        space: Space::Device,
        offset,
    }
}

impl Case {
    fn ty(&self, v: ValueId) -> &TensorType {
        &self.g.value(v).ty
    }

    /// Lays out the operands, writes the inputs.
    fn place(&self) -> Placed {
        let op = self.g.op(self.op);
        let mut end = 0u64;
        let mut put = |bytes: u64| {
            let at = device(end);
            end += bytes.max(1).next_multiple_of(256);
            at
        };
        let inputs: Vec<Address> = op.inputs.iter().map(|&v| put(self.ty(v).bytes())).collect();
        let outputs: Vec<Address> = op
            .outputs
            .iter()
            .map(|&v| put(self.ty(v).bytes()))
            .collect();
        let types: Vec<&TensorType> = op.inputs.iter().map(|&v| self.ty(v)).collect();
        let workspace = match op.kind.workspace_bytes(&types) {
            0 => None,
            bytes => Some((put(bytes), bytes)),
        };
        let master = match op.kind {
            OpKind::AdamW { .. } if self.ty(op.inputs[0]).dtype == DType::BF16 => {
                Some(put(4 * self.ty(op.inputs[0]).numel()))
            }
            _ => None,
        };
        let mut backend = CudaBackend::new(end, 0, 0).expect("the CUDA backend starts");
        for ((&v, &at), data) in op.inputs.iter().zip(&inputs).zip(&self.data) {
            match (data, self.ty(v).dtype) {
                (Data::I(ids), _) => backend.write_i32(at, ids).unwrap(),
                (Data::F(x), DType::BF16) => {
                    let narrow: Vec<half::bf16> =
                        x.iter().map(|&e| half::bf16::from_f32(e)).collect();
                    backend.write_bf16(at, &narrow).unwrap()
                }
                (Data::F(x), _) => backend.write_f32(at, x).unwrap(),
            }
        }
        Placed {
            backend,
            inputs,
            outputs,
            workspace,
            master,
        }
    }

    /// Launches the op on the device and returns what it reported.
    fn launch(&self, p: &mut Placed) -> Outcome {
        let op = self.g.op(self.op);
        let prepared = Prepared::new(&op.kind);
        let mut stream = p.backend.create_stream(StreamKind::Compute).unwrap();
        p.backend.begin_step();
        let launch = Launch {
            graph: &self.g,
            op,
            prepared: &prepared,
            inputs: &p.inputs,
            outputs: &p.outputs,
            workspace: p.workspace,
            step: 1,
            shard: None,
            pitches: protrain_runtime::dispatch::Pitches::DENSE,
        };
        // SAFETY: one stream on one thread; every operand has bytes of its own.
        let reported = unsafe { p.backend.launch(&mut stream, &launch) }
            .unwrap_or_else(|e| panic!("{}: {e}", op.kind.mnemonic()));
        p.backend.synchronize(&mut stream).unwrap();
        reported.merge(p.backend.step_outcome().unwrap())
    }

    /// Reads `n` values at `at` stored as `dtype`, as f32.
    fn read(p: &Placed, at: Address, n: usize, dtype: DType) -> Vec<f32> {
        match dtype {
            DType::BF16 => {
                let mut narrow = vec![half::bf16::ZERO; n];
                p.backend.read_bf16(at, &mut narrow).unwrap();
                narrow.into_iter().map(half::bf16::to_f32).collect()
            }
            _ => {
                let mut out = vec![0.0; n];
                p.backend.read_f32(at, &mut out).unwrap();
                out
            }
        }
    }

    /// Runs the op on both backends and compares every output (and the reported gradient
    /// norm); `tol` for bf16-stored outputs, `f32_tol` for f32 ones.
    fn check(&self, what: &str, f32_tol: f64) {
        self.check_outputs(what, f32_tol);
    }

    /// As [`Case::check`], returning each output as the device and the host computed it.
    fn check_outputs(&self, what: &str, f32_tol: f64) -> Vec<(Vec<f32>, Vec<f32>)> {
        require_gpu();
        let mut results = Vec::new();
        let op = self.g.op(self.op);
        let mut p = self.place();
        let got_outcome = self.launch(&mut p);
        let mut want: Vec<Vec<f32>> = op
            .outputs
            .iter()
            .map(|&v| vec![0.0; self.ty(v).numel() as usize])
            .collect();
        let mut ws = vec![0.0f32; dispatch::workspace_len(&self.g, op)];
        let mut outs: Vec<&mut [f32]> = want.iter_mut().map(|w| w.as_mut_slice()).collect();
        let want_outcome = dispatch::run(
            &self.g,
            op,
            &Prepared::new(&op.kind),
            &HostInputs(&self.data),
            &mut outs,
            &mut ws,
        )
        .unwrap();
        for (i, (&v, want)) in op.outputs.iter().zip(&want).enumerate() {
            let ty = self.ty(v);
            let got = Self::read(&p, p.outputs[i], want.len(), ty.dtype);
            if ty.dtype == DType::I32 {
                // Indices: the same values, not close ones.
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits() as i32).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(want), "{what}: output {i} ({ty})");
                continue;
            }
            let tol = match ty.dtype {
                DType::BF16 => BF16,
                _ => f32_tol,
            };
            assert_close(&format!("{what}: output {i} ({ty})"), &got, want, tol);
            results.push((got, want.clone()));
        }
        if let Some(norm) = want_outcome.grad_norm {
            let got = got_outcome
                .grad_norm
                .unwrap_or_else(|| panic!("{what}: no gradient norm reported"));
            assert_close(&format!("{what}: gradient norm"), &[got], &[norm], f32_tol);
        }
        results
    }
}

/// Fails unless every `|got - want| / (1 + |want|)` is at most `tol`.
fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut worst = (0.0f64, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let e = (f64::from(g) - f64::from(w)).abs() / (1.0 + f64::from(w).abs());
        // A NaN error counts as the worst.
        if e.is_nan() || e > worst.0 {
            worst = (e, i);
        }
    }
    let (e, i) = worst;
    eprintln!(
        "{what}: max error {e:.3e} at {i} (got {} want {})",
        got.get(i).copied().unwrap_or_default(),
        want.get(i).copied().unwrap_or_default()
    );
    assert!(
        e <= tol,
        "{what}: error {e:.3e} at element {i} (got {} want {}) exceeds {tol:e}",
        got[i],
        want[i]
    );
}

const DTYPES: [DType; 2] = [DType::F32, DType::BF16];

fn tol(dtype: DType, f32_tol: f64) -> f64 {
    match dtype {
        DType::BF16 => BF16.max(f32_tol),
        _ => f32_tol,
    }
}

#[test]
#[ignore = "needs a GPU or the CUDA simulator"]
fn activations_and_add() {
    for dtype in DTYPES {
        let x = [3, 37, 70];
        let unary = [
            (OpKind::Gelu, 4.0),
            (OpKind::Relu, 2.0),
            (OpKind::Silu, 6.0),
        ];
        for (kind, scale) in unary {
            let name = format!("{} {dtype}", kind.mnemonic());
            Builder::new(1)
                .float(&x, dtype, scale)
                .op(kind)
                .check(&name, ELEMENTWISE);
        }
        let backward = [
            OpKind::GeluBackward,
            OpKind::ReluBackward,
            OpKind::SiluBackward,
        ];
        for kind in backward {
            let name = format!("{} {dtype}", kind.mnemonic());
            Builder::new(2)
                .float(&x, dtype, 4.0)
                .float(&x, dtype, 1.0)
                .op(kind)
                .check(&name, ELEMENTWISE);
        }
        for kind in [OpKind::Swiglu, OpKind::Add] {
            let name = format!("{} {dtype}", kind.mnemonic());
            Builder::new(3)
                .float(&x, dtype, 4.0)
                .float(&x, dtype, 2.0)
                .op(kind)
                .check(&name, ELEMENTWISE);
        }
        Builder::new(4)
            .float(&x, dtype, 4.0)
            .float(&x, dtype, 2.0)
            .float(&x, dtype, 1.0)
            .op(OpKind::SwigluBackward)
            .check(&format!("swiglu_backward {dtype}"), ELEMENTWISE);
        // Phi-3's packed `[gate | up]` rows (odd width, so a half-row offset is unaligned).
        let packed = [3, 37, 2 * 35];
        Builder::new(5)
            .float(&packed, dtype, 4.0)
            .op(OpKind::PackedSwiglu)
            .check(&format!("packed_swiglu {dtype}"), ELEMENTWISE);
        Builder::new(6)
            .float(&packed, dtype, 4.0)
            .float(&[3, 37, 35], dtype, 1.0)
            .op(OpKind::PackedSwigluBackward)
            .check(&format!("packed_swiglu_backward {dtype}"), ELEMENTWISE);
    }
}

#[test]
#[ignore = "needs a GPU or the CUDA simulator"]
fn embeddings() {
    for dtype in DTYPES {
        let (b, t, v, c) = (2, 37, 50, 70);
        for padding_idx in [None, Some(3)] {
            let what = format!("embedding pad {padding_idx:?} {dtype}");
            Builder::new(5)
                .tokens(&[b, t], v as usize)
                .float(&[v, c], dtype, 1.0)
                .op(OpKind::Embedding { padding_idx })
                .check(&what, ELEMENTWISE);
            Builder::new(6)
                .tokens(&[b, t], v as usize)
                .float(&[b, t, c], dtype, 1.0)
                .op(OpKind::EmbeddingBackward {
                    rows: v,
                    padding_idx,
                })
                .check(&format!("{what} backward"), tol(dtype, REDUCTION));
        }
        let (p, offset) = (64, 2);
        Builder::new(7)
            .tokens(&[b, t], v as usize)
            .float(&[p, c], dtype, 1.0)
            .op(OpKind::PositionEmbedding { offset })
            .check(&format!("position_embedding {dtype}"), ELEMENTWISE);
        Builder::new(8)
            .tokens(&[b, t], v as usize)
            .float(&[b, t, c], dtype, 1.0)
            .op(OpKind::PositionEmbeddingBackward { rows: p, offset })
            .check(
                &format!("position_embedding_backward {dtype}"),
                tol(dtype, REDUCTION),
            );
    }
}

#[test]
#[ignore = "needs a GPU or the CUDA simulator"]
fn norms_forward_and_backward() {
    for dtype in DTYPES {
        // 300 rows: more than one 256-row chunk of the weight-gradient sums.
        let (x, c) = ([3u64, 100, 72], 72u64);
        let eps = 1e-5;
        Builder::new(9)
            .float(&x, dtype, 2.0)
            .float(&[c], dtype, 1.0)
            .float(&[c], dtype, 1.0)
            .op(OpKind::LayerNorm { eps })
            .check(&format!("layer_norm {dtype}"), REDUCTION);
        Builder::new(10)
            .float(&x, dtype, 2.0)
            .float(&[c], dtype, 1.0)
            .float(&x, dtype, 1.0)
            .op(OpKind::LayerNormBackward { eps })
            .check(&format!("layer_norm_backward {dtype}"), REDUCTION);
        // Whole rows, then per head of 24 (Qwen3's q_norm) with a `1 + weight` scale (Gemma).
        for (head_dim, unit_offset) in [(None, false), (Some(24), true)] {
            let w = head_dim.unwrap_or(c);
            Builder::new(11)
                .float(&x, dtype, 2.0)
                .float(&[w], dtype, 1.0)
                .op(OpKind::RmsNorm {
                    eps,
                    head_dim,
                    unit_offset,
                })
                .check(&format!("rms_norm {dtype} {head_dim:?}"), REDUCTION);
            Builder::new(12)
                .float(&x, dtype, 2.0)
                .float(&[w], dtype, 1.0)
                .float(&x, dtype, 1.0)
                .op(OpKind::RmsNormBackward {
                    eps,
                    head_dim,
                    unit_offset,
                })
                .check(
                    &format!("rms_norm_backward {dtype} {head_dim:?}"),
                    REDUCTION,
                );
        }
    }
}

#[test]
#[ignore = "needs a GPU or the CUDA simulator"]
fn linear_forward_and_backward_in_both_layouts() {
    for dtype in DTYPES {
        let (b, t, d_in, d_out) = (2u64, 150u64, 48u64, 40u64);
        for layout in [WeightLayout::OutIn, WeightLayout::InOut] {
            let w = match layout {
                WeightLayout::OutIn => [d_out, d_in],
                WeightLayout::InOut => [d_in, d_out],
            };
            for bias in [false, true] {
                let what = format!("linear {layout:?} bias {bias} {dtype}");
                let mut fwd = Builder::new(13)
                    .float(&[b, t, d_in], dtype, 1.0)
                    .float(&w, dtype, 0.5);
                if bias {
                    fwd = fwd.float(&[d_out], dtype, 1.0);
                }
                fwd.op(OpKind::Linear { bias, layout })
                    .check(&what, REDUCTION);
                Builder::new(14)
                    .float(&[b, t, d_in], dtype, 1.0)
                    .float(&w, dtype, 0.5)
                    .float(&[b, t, d_out], dtype, 1.0)
                    .op(OpKind::LinearBackward { bias, layout })
                    .check(&format!("{what} backward"), REDUCTION);
            }
        }
    }
}

/// A fused linear forward with every epilogue, on 15 rows of 9 features, against the host
/// kernels: none, bias, bias + GELU, GELU and the residual (with and without bias) run as one
/// cuBLASLt matmul each over 16 output features; ReLU, SwiGLU and a GELU over 13 features
/// (cuBLASLt cannot keep that GELU's input) as a matmul and a kernel. In bf16 the epilogue
/// adds the bias, the GELU and the residual in f32 and rounds once, as the host does
/// (`dispatch::gelu_in_matmul`): at least 99% of the device's bf16 outputs equal the host's
/// to the bit (the rest differ by the f32 summation order). A host that applied the GELU to
/// the rounded projection misses that by far (56 of the 240 GELU outputs of the first bf16
/// case differ). On the simulator, no GEMM of the process runs without its handle's
/// workspace (cuBLAS would allocate its own).
#[test]
#[ignore = "needs a GPU or the CUDA simulator"]
fn fused_linear_forward_with_each_epilogue() {
    let (b, t, d_in) = (3u64, 5u64, 9u64);
    for dtype in DTYPES {
        for layout in [WeightLayout::OutIn, WeightLayout::InOut] {
            for (epilogue, d_out, count) in [
                (Epilogue::None, 16, 2),
                (Epilogue::Gelu, 16, 1),
                (Epilogue::Gelu, 13, 1),
                (Epilogue::Relu, 16, 1),
                (Epilogue::Swiglu, 16, 2),
                (Epilogue::Residual, 16, 1),
            ] {
                let w = match layout {
                    WeightLayout::OutIn => [d_out, d_in],
                    WeightLayout::InOut => [d_in, d_out],
                };
                for bias in [false, true] {
                    let what =
                        format!("fused linear {epilogue:?} {d_out} {layout:?} bias {bias} {dtype}");
                    let mut case = Builder::new(16).float(&[b, t, d_in], dtype, 1.0);
                    for _ in 0..count {
                        case = case.float(&w, dtype, 0.5);
                    }
                    if bias {
                        for _ in 0..count {
                            case = case.float(&[d_out], dtype, 1.0);
                        }
                    }
                    if epilogue == Epilogue::Residual {
                        case = case.float(&[b, t, d_out], dtype, 2.0);
                    }
                    let results = case
                        .op(OpKind::FusedLinear {
                            count,
                            bias,
                            layout,
                            epilogue,
                        })
                        .check_outputs(&what, REDUCTION);
                    // Every GEMM of the process so far ran with its handle's workspace.
                    if let Some(c) = protrain_runtime::cuda::simulator_counters() {
                        assert_eq!(c.unplanned_workspaces, 0, "{what}: {c:?}");
                    }
                    if dtype == DType::BF16 {
                        for (i, (got, want)) in results.iter().enumerate() {
                            let same = got.iter().zip(want).filter(|(g, w)| g == w).count();
                            assert!(
                                same as f64 >= 0.99 * got.len() as f64,
                                "{what}: output {i}: only {same} of {} values are the host's",
                                got.len()
                            );
                        }
                    }
                }
            }
        }
    }
}

/// A fused linear backward over 3 rows (d_in 5, two projections of 7 with biases, as a SwiGLU
/// MLP's gate and up): in bf16 its kept gradients and input-gradient contribution take an odd
/// multiple of 2 bytes, so the f32 bias partials behind them are only aligned because the
/// workspace layout aligns every part (`protrain_ir::WorkspaceLayout`).
#[test]
#[ignore = "needs a GPU or the CUDA simulator"]
fn fused_linear_backward_with_odd_rows() {
    let (b, t, d_in, d_out) = (1u64, 3u64, 5u64, 7u64);
    for dtype in DTYPES {
        for epilogue in [Epilogue::Swiglu, Epilogue::None] {
            let what = format!("fused linear backward {epilogue:?} {dtype}");
            let mut case = Builder::new(15)
                .float(&[b, t, d_in], dtype, 1.0)
                .float(&[d_out, d_in], dtype, 0.5)
                .float(&[d_out, d_in], dtype, 0.5);
            // Swiglu: the kept gate and up, then the output's gradient; none: each
            // projection's gradient.
            let grads = match epilogue {
                Epilogue::Swiglu => 3,
                _ => 2,
            };
            for _ in 0..grads {
                case = case.float(&[b, t, d_out], dtype, 1.0);
            }
            case.op(OpKind::FusedLinearBackward {
                count: 2,
                bias: true,
                layout: WeightLayout::OutIn,
                epilogue,
            })
            .check(&what, REDUCTION);
        }
    }
}

#[test]
#[ignore = "needs a GPU or the CUDA simulator"]
fn rope_forward_and_backward() {
    for dtype in DTYPES {
        let scalings = [
            RopeScaling::None,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 16,
            },
            // cos and sin scaled by the attention factor.
            RopeScaling::Yarn {
                factor: 4.0,
                original_max_position_embeddings: 16,
                beta_fast: 32.0,
                beta_slow: 1.0,
                truncate: true,
                attention_factor: 1.1386,
            },
            RopeScaling::LongRope {
                factors: (0..8).map(|i| 1.0 + 0.5 * f64::from(i)).collect(),
                attention_factor: 1.0408,
            },
        ];
        for scaling in scalings.clone() {
            let (head_dim, theta) = (16, 10_000.0);
            let x = [2, 37, 4 * head_dim];
            let what = format!("rope {scaling:?} {dtype}");
            Builder::new(15)
                .float(&x, dtype, 2.0)
                .op(OpKind::Rope {
                    head_dim,
                    theta,
                    scaling: scaling.clone(),
                })
                .check(&what, REDUCTION);
            Builder::new(16)
                .float(&x, dtype, 2.0)
                .op(OpKind::RopeBackward {
                    head_dim,
                    theta,
                    scaling,
                })
                .check(&format!("{what} backward"), REDUCTION);
        }
        // Phi-3's packed qkv [B, T, (4 + 2 + 2) * 16]: q's and k's six heads rotated, v's two
        // copied; and a partial rotary factor of 1/2 (8 of 16 elements rotated, the rest
        // copied) over every head.
        for (rotary_dim, heads, scaling) in [
            (16, 6, scalings[3].clone()),
            (8, 8, RopeScaling::None),
            (8, 6, scalings[2].clone()),
        ] {
            let head_dim = 16;
            let x = [2, 37, 8 * head_dim];
            let what = format!("partial rope {rotary_dim} of {heads} heads {scaling:?} {dtype}");
            let scaling = match scaling {
                // One divisor per rotated pair.
                RopeScaling::LongRope {
                    attention_factor, ..
                } => RopeScaling::LongRope {
                    factors: (0..rotary_dim / 2).map(|i| 1.0 + 0.5 * i as f64).collect(),
                    attention_factor,
                },
                other => other,
            };
            Builder::new(17)
                .float(&x, dtype, 2.0)
                .op(OpKind::PartialRope {
                    head_dim,
                    rotary_dim,
                    heads,
                    theta: 10_000.0,
                    scaling: scaling.clone(),
                })
                .check(&what, REDUCTION);
            Builder::new(18)
                .float(&x, dtype, 2.0)
                .op(OpKind::PartialRopeBackward {
                    head_dim,
                    rotary_dim,
                    heads,
                    theta: 10_000.0,
                    scaling,
                })
                .check(&format!("{what} backward"), REDUCTION);
        }
    }
}

#[test]
#[ignore = "needs a GPU or the CUDA simulator"]
fn attention_forward_and_backward() {
    for dtype in DTYPES {
        // (heads, kv_heads, head_dim, window, qkv, seq): grouped heads, a sliding window,
        // GPT-2's packed layout, heads of 128 and wider (the GEMM path has no limit on the
        // head dimension), and T = 2048 with 5 KV heads: 16 MiB of f32 scores per head, so the
        // plan runs two GEMM batches of KV heads (4, then 1), each for both heads of a group.
        let shapes = [
            (4u64, 2u64, 16u64, None, QkvLayout::Separate, 37u64),
            (4, 4, 32, Some(5), QkvLayout::Separate, 70),
            (3, 3, 32, None, QkvLayout::Packed, 45),
            (2, 1, 128, None, QkvLayout::Separate, 40),
            (2, 2, 160, Some(16), QkvLayout::Packed, 33),
            (10, 5, 8, Some(300), QkvLayout::Separate, 2048),
        ];
        for (heads, kv_heads, head_dim, window, qkv, t) in shapes {
            let b = 2u64;
            let what = format!(
                "attention h{heads} kv{kv_heads} d{head_dim} window {window:?} {qkv:?} {dtype}"
            );
            let kind = OpKind::Attention {
                heads,
                kv_heads,
                head_dim,
                window,
                qkv,
                scale: None,
                softcap: None,
            };
            let fwd = match qkv {
                QkvLayout::Separate => Builder::new(17)
                    .float(&[b, t, heads * head_dim], dtype, 1.0)
                    .float(&[b, t, kv_heads * head_dim], dtype, 1.0)
                    .float(&[b, t, kv_heads * head_dim], dtype, 1.0),
                QkvLayout::Packed => {
                    Builder::new(17).float(&[b, t, (heads + 2 * kv_heads) * head_dim], dtype, 1.0)
                }
            };
            let case = fwd.op(kind.clone());
            case.check(&what, REDUCTION);
            // The backward from the forward's own out and lse, as a step computes them.
            let (out, lse) = forward_results(&case);
            let mut bwd = Builder::new(18);
            for (i, d) in case.data.iter().enumerate() {
                let Data::F(x) = d else {
                    unreachable!("attention inputs are floats")
                };
                let shape = case.ty(case.g.op(case.op).inputs[i]).shape.clone();
                bwd = bwd.float_values(&shape, dtype, x.clone());
            }
            let out_shape = [b, t, heads * head_dim];
            bwd.float_values(&out_shape, dtype, out)
                .float_values(&[b, heads, t], DType::F32, lse)
                .float(&out_shape, dtype, 1.0)
                .op(OpKind::AttentionBackward {
                    heads,
                    kv_heads,
                    head_dim,
                    window,
                    qkv,
                    scale: None,
                    softcap: None,
                })
                .check(&format!("{what} backward"), REDUCTION);
        }
    }
}

/// The host's outputs of a forward attention case (out, lse).
fn forward_results(case: &Case) -> (Vec<f32>, Vec<f32>) {
    let op = case.g.op(case.op);
    let mut want: Vec<Vec<f32>> = op
        .outputs
        .iter()
        .map(|&v| vec![0.0; case.ty(v).numel() as usize])
        .collect();
    let mut outs: Vec<&mut [f32]> = want.iter_mut().map(|w| w.as_mut_slice()).collect();
    dispatch::run(
        &case.g,
        op,
        &Prepared::new(&op.kind),
        &HostInputs(&case.data),
        &mut outs,
        &mut [],
    )
    .unwrap();
    let lse = want.pop().unwrap();
    let out = want.pop().unwrap();
    (out, lse)
}

#[test]
#[ignore = "needs a GPU or the CUDA simulator"]
fn cross_entropy_forward_and_backward() {
    for dtype in DTYPES {
        let (b, t, v) = (2u64, 37u64, 300u64);
        let case = Builder::new(19)
            .float(&[b, t, v], dtype, 4.0)
            .tokens(&[b, t], v as usize)
            .op(OpKind::CrossEntropy);
        case.check(&format!("cross_entropy {dtype}"), REDUCTION);
        // The backward from the host's lse of the same logits.
        let op = case.g.op(case.op);
        let mut loss = vec![0.0f32];
        let mut lse = vec![0.0f32; (b * t) as usize];
        dispatch::run(
            &case.g,
            op,
            &Prepared::new(&op.kind),
            &HostInputs(&case.data),
            &mut [loss.as_mut_slice(), lse.as_mut_slice()],
            &mut [],
        )
        .unwrap();
        let (Data::F(logits), Data::I(targets)) = (&case.data[0], &case.data[1]) else {
            unreachable!("logits then targets")
        };
        let mut bwd = Builder::new(20).float_values(&[b, t, v], dtype, logits.clone());
        let tv = bwd
            .g
            .add_input("targets", TensorType::new([b, t], DType::I32));
        bwd.inputs.push(tv);
        bwd.data.push(Data::I(targets.clone()));
        bwd.float_values(&[b, t], DType::F32, lse)
            .op(OpKind::CrossEntropyBackward)
            .check(&format!("cross_entropy_backward {dtype}"), REDUCTION);
    }
}

#[test]
#[ignore = "needs a GPU or the CUDA simulator"]
fn gradient_norms_and_clip_coefficient() {
    for dtype in DTYPES {
        Builder::new(21)
            .float(&[100_003], dtype, 1.0)
            .op(OpKind::GradNormSq)
            .check(&format!("grad_norm_sq {dtype}"), REDUCTION);
    }
    // The squared norms of three gradients; the total norm 5 is clipped to 1.
    let mut clip = Builder::new(22);
    for sq in [9.0f32, 12.0, 4.0] {
        clip = clip.float_values(&[], DType::F32, vec![sq]);
    }
    clip.op(OpKind::ClipCoef { max_norm: 1.0 })
        .check("clip_coef", ELEMENTWISE);
}

/// AdamW on the device against `dispatch::adamw`: f32 to the bit; bf16 with its f32 master
/// weight to the bit on the master, the bf16 parameter its rounding.
#[test]
#[ignore = "needs a GPU or the CUDA simulator"]
fn adamw_matches_the_host_to_the_bit() {
    require_gpu();
    let n = 10_007u64;
    for (dtype, clipped) in [
        (DType::F32, false),
        (DType::F32, true),
        (DType::BF16, false),
        (DType::BF16, true),
    ] {
        let what = format!("adamw {dtype} clipped {clipped}");
        let mut rng = Rng(23);
        let master: Vec<f32> = rng.vec(n as usize, 1.0);
        let kind = OpKind::AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            clipped,
        };
        let v: Vec<f32> = rng.vec(n as usize, 0.01).iter().map(|x| x.abs()).collect();
        let mut bld = Builder::new(24)
            .float_values(&[n], dtype, master.clone())
            .float(&[n], dtype, 1.0)
            .float(&[n], DType::F32, 0.1)
            .float_values(&[n], DType::F32, v);
        if clipped {
            bld = bld.float_values(&[], DType::F32, vec![0.37]);
        }
        let block = protrain_ir::BlockId::new(0);
        bld.g
            .add_op_multi(kind.clone(), &bld.inputs, &[], block, Phase::Optimizer)
            .unwrap();
        let op = OpId::new(bld.g.op_count() - 1);
        for (data, &val) in bld.data.iter_mut().zip(&bld.inputs) {
            if let (Data::F(x), DType::BF16) = (data, bld.g.value(val).ty.dtype) {
                for e in x.iter_mut() {
                    *e = half::bf16::from_f32(*e).to_f32();
                }
            }
        }
        let case = Case {
            g: bld.g,
            op,
            data: bld.data,
        };
        let mut p = case.place();
        let Some(master_at) = p.master else {
            assert_eq!(dtype, DType::F32);
            case.launch(&mut p);
            let dev: Vec<Vec<f32>> = [0, 2, 3]
                .iter()
                .map(|&i| Case::read(&p, p.inputs[i], n as usize, DType::F32))
                .collect();
            let host = host_adamw(&case, &kind, None);
            for (k, (d, h)) in dev.iter().zip(&host).enumerate() {
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(d),
                    bits(h),
                    "{what}: operand {k} differs from the host's"
                );
            }
            continue;
        };
        // The master weight starts as the unrounded values, the bf16 param as their rounding.
        p.backend.write_f32(master_at, &master).unwrap();
        p.backend.set_master_weight(p.inputs[2], master_at);
        case.launch(&mut p);
        let got_master = Case::read(&p, master_at, n as usize, DType::F32);
        let got_param = Case::read(&p, p.inputs[0], n as usize, DType::BF16);
        let got_m = Case::read(&p, p.inputs[2], n as usize, DType::F32);
        let host = host_adamw(&case, &kind, Some(master));
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got_master), bits(&host[0]), "{what}: master weights");
        assert_eq!(bits(&got_m), bits(&host[1]), "{what}: exp_avg");
        let rounded: Vec<f32> = host[0]
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect();
        assert_eq!(bits(&got_param), bits(&rounded), "{what}: bf16 params");
    }
}

/// The host's AdamW on the case's values (from `master` for a bf16 parameter): param (or
/// master), m, v after one step.
fn host_adamw(case: &Case, kind: &OpKind, master: Option<Vec<f32>>) -> Vec<Vec<f32>> {
    let f = |i: usize| match &case.data[i] {
        Data::F(x) => x.clone(),
        Data::I(_) => unreachable!("AdamW operands are floats"),
    };
    let mut param = master.unwrap_or_else(|| f(0));
    let (grad, mut m, mut v) = (f(1), f(2), f(3));
    let coef = (case.data.len() > 4).then(|| f(4)[0]);
    dispatch::adamw(kind, &mut param, &grad, &mut m, &mut v, coef, 1);
    vec![param, m, v]
}

/// A routing as the host kernel computes it.
struct Routed {
    weights: Vec<f32>,
    experts: Vec<i32>,
    rows: Vec<i32>,
    slots: Vec<i32>,
    offsets: Vec<i32>,
}

/// The renormalised routing of the tokens of `logits` over `e` experts, `k` each, by the host
/// kernel.
fn host_route(logits: &[f32], e: usize, k: usize) -> Routed {
    let n = logits.len() / e;
    let mut r = Routed {
        weights: vec![0.0; n * k],
        experts: vec![0; n * k],
        rows: vec![0; n * k],
        slots: vec![0; n * k],
        offsets: vec![0; e + 1],
    };
    protrain_runtime::kernels::moe_route(
        &mut r.weights,
        &mut r.experts,
        &mut r.rows,
        &mut r.slots,
        &mut r.offsets,
        logits,
        e,
        k,
        true,
    );
    r
}

/// Whether the device is the CPU simulator, whose `expf` is the host's: there the routing and
/// the combine give the host's bits.
fn simulated() -> bool {
    protrain_runtime::cuda::device().is_ok_and(|d| d.name.contains("simulator"))
}

/// Every mixture-of-experts kind against the host kernels: the routing (both normalisations;
/// its packed layout computed on the device must be the host's exactly), its gradient,
/// dispatch and combine and their gradients, and the grouped matmul and its gradients over the
/// uneven groups a random routing gives (4 experts, 13 tokens, top-2). In f32 on the
/// simulator, every kind but the grouped matmul (another summation order than the host's gemm
/// crate, `REDUCTION`) gives the host's bits; on a GPU, whose `expf` may differ in the last
/// place, they are `ELEMENTWISE` close.
#[test]
#[ignore = "needs a GPU or the CUDA simulator"]
fn mixture_of_experts_forward_and_backward() {
    require_gpu();
    let (b, t, e, k, c, o) = (1u64, 13u64, 4u64, 2u64, 6u64, 5u64);
    let exact = if simulated() { 0.0 } else { ELEMENTWISE };
    let n = (b * t) as usize;
    let mut rng = Rng(21);
    let logits = rng.vec(n * e as usize, 3.0);
    let Routed {
        weights: w,
        experts: ex,
        rows,
        slots,
        offsets: off,
    } = host_route(&logits, e as usize, k as usize);
    for dtype in DTYPES {
        for normalize in [true, false] {
            Builder::new(30)
                .float_values(&[b, t, e], dtype, logits.clone())
                .op(OpKind::MoeRoute {
                    experts: e,
                    top_k: k,
                    normalize,
                })
                .check(&format!("moe route {dtype} normalize {normalize}"), exact);
            Builder::new(31)
                .float_values(&[b, t, e], dtype, logits.clone())
                .ints(&[b, t, k], ex.clone())
                .float(&[b, t, k], DType::F32, 1.0)
                .op(OpKind::MoeRouteBackward {
                    experts: e,
                    top_k: k,
                    normalize,
                })
                .check(
                    &format!("moe route backward {dtype} normalize {normalize}"),
                    exact,
                );
        }
        let r = b * t * k;
        Builder::new(32)
            .float(&[b, t, c], dtype, 1.0)
            .ints(&[r], rows.clone())
            .ints(&[b, t, k], slots.clone())
            .op(OpKind::MoeDispatch { top_k: k })
            .check(&format!("moe dispatch {dtype}"), exact);
        Builder::new(33)
            .ints(&[b, t, k], slots.clone())
            .float(&[r, c], dtype, 1.0)
            .op(OpKind::MoeDispatchBackward { top_k: k })
            .check(&format!("moe dispatch backward {dtype}"), exact);
        Builder::new(34)
            .float(&[r, c], dtype, 1.0)
            .float_values(&[b, t, k], DType::F32, w.clone())
            .ints(&[b, t, k], slots.clone())
            .op(OpKind::MoeCombine { top_k: k })
            .check(&format!("moe combine {dtype}"), exact);
        Builder::new(35)
            .float(&[r, c], dtype, 1.0)
            .float_values(&[b, t, k], DType::F32, w.clone())
            .ints(&[b, t, k], slots.clone())
            .float(&[b, t, c], dtype, 1.0)
            .op(OpKind::MoeCombineBackward { top_k: k })
            .check(&format!("moe combine backward {dtype}"), exact);
        let mut grouped = Builder::new(36)
            .float(&[r, c], dtype, 1.0)
            .ints(&[e + 1], off.clone());
        for _ in 0..e {
            grouped = grouped.float(&[o, c], dtype, 0.5);
        }
        grouped
            .op(OpKind::GroupedLinear { experts: e })
            .check(&format!("grouped linear {dtype}"), REDUCTION);
        let mut grouped = Builder::new(37)
            .float(&[r, c], dtype, 1.0)
            .ints(&[e + 1], off.clone());
        for _ in 0..e {
            grouped = grouped.float(&[o, c], dtype, 0.5);
        }
        grouped
            .float(&[r, o], dtype, 1.0)
            .op(OpKind::GroupedLinearBackward { experts: e })
            .check(&format!("grouped linear backward {dtype}"), REDUCTION);
    }
    // The routing must leave some expert with more rows than another for the groups to be
    // uneven.
    let sizes: Vec<i32> = off.windows(2).map(|g| g[1] - g[0]).collect();
    assert!(sizes.iter().min() < sizes.iter().max(), "{sizes:?}");
}

/// The load-balancing loss and its gradient against the host kernels, over three sparse
/// layers of 150 tokens: 450 rows, so each of the 256 partial sums of the probabilities takes
/// one or two rows and the in-order reduction of the partials decides the bits. On the
/// simulator (the host's `expf`) the loss and the gradients are the host's to the bit.
#[test]
#[ignore = "needs a GPU or the CUDA simulator"]
fn load_balancing_loss_forward_and_backward() {
    require_gpu();
    let (b, t, e, k, layers) = (1u64, 150u64, 5u64, 2u64, 3u64);
    let exact = if simulated() { 0.0 } else { REDUCTION };
    for dtype in DTYPES {
        for micro_batches in [1, 4] {
            let mut forward = Builder::new(40).float_values(&[], DType::F32, vec![2.25]);
            let mut backward = Builder::new(41);
            for _ in 0..layers {
                forward = forward.float(&[b, t, e], dtype, 3.0);
                backward = backward.float(&[b, t, e], dtype, 3.0);
            }
            forward
                .op(OpKind::MoeAuxLoss {
                    experts: e,
                    top_k: k,
                    layers,
                    coef: 0.05,
                })
                .check(&format!("load-balancing loss {dtype}"), exact);
            backward
                .op(OpKind::MoeAuxLossBackward {
                    experts: e,
                    top_k: k,
                    layers,
                    coef: 0.05,
                    micro_batches,
                    loss_scale: (micro_batches > 1).then_some(1024.0),
                })
                .check(
                    &format!("load-balancing loss backward {dtype} over {micro_batches}"),
                    exact,
                );
        }
    }
}
