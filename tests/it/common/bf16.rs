//! One-op graphs for the mixed-precision tests: each op built twice, with its activations and
//! parameters in bf16 and in f32 (its f32-only operands, such as log-sum-exps, in f32 in
//! both), on the same values (bf16-representable, so both graphs read the same numbers). The
//! bf16 graph runs on the host backend through `Backend::launch`, as a schedule runs it; the
//! f32 graph through `dispatch::run`, the reference the CUDA backend's rounding contract is
//! stated against.

use protrain_ir::{
    BlockKind, DType, Graph, GraphInfo, OpId, OpKind, Phase, Role, Space, StreamKind, TensorType,
    ValueId,
};
use protrain_runtime::backend::{Address, Backend, Launch};
use protrain_runtime::dispatch::{self, Inputs, Outcome, Prepared};
use protrain_runtime::kernels::bf16;
use protrain_runtime::HostBackend;

/// `x` rounded to bf16 (nearest even) and widened back, as a bf16 store and load give it.
pub fn round(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// Every value of `x` rounded to bf16.
pub fn rounded(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| round(v)).collect()
}

/// The bits of `x`, for exact comparisons that tell `-0.0` from `0.0` and compare NaNs.
pub fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
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

    /// Uniform in [-scale, scale), rounded to bf16.
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| round(((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale))
            .collect()
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// An input's values.
#[derive(Clone, Debug)]
pub enum Data {
    /// Floats (bf16-representable where the bf16 graph stores them in bf16).
    F(Vec<f32>),
    /// Token ids.
    I(Vec<i32>),
}

impl Data {
    /// The floats; panics on token ids (a test's own mistake).
    pub fn floats(&self) -> &[f32] {
        match self {
            Data::F(x) => x,
            Data::I(_) => panic!("token ids where floats were expected"),
        }
    }
}

/// An input of a one-op case: its shape, whether the bf16 graph stores it in bf16, its values.
#[derive(Clone, Debug)]
struct Input {
    shape: Vec<u64>,
    narrow: bool,
    data: Data,
}

/// A one-op case under construction.
pub struct OneOp {
    inputs: Vec<Input>,
    rng: Rng,
}

impl OneOp {
    /// A case whose random inputs come from `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            inputs: Vec::new(),
            rng: Rng(seed),
        }
    }

    /// An activation or parameter input of `shape` (bf16 in the bf16 graph), uniform in
    /// [-scale, scale) and rounded to bf16.
    pub fn act(mut self, shape: &[u64], scale: f32) -> Self {
        let n = shape.iter().product::<u64>() as usize;
        let values = self.rng.vec(n, scale);
        self.act_values(shape, values)
    }

    /// An activation or parameter input of `shape` with these values, rounded to bf16.
    pub fn act_values(mut self, shape: &[u64], values: Vec<f32>) -> Self {
        self.inputs.push(Input {
            shape: shape.to_vec(),
            narrow: true,
            data: Data::F(rounded(&values)),
        });
        self
    }

    /// An input that is f32 in both graphs (a log-sum-exp, a squared norm).
    pub fn f32_values(mut self, shape: &[u64], values: Vec<f32>) -> Self {
        self.inputs.push(Input {
            shape: shape.to_vec(),
            narrow: false,
            data: Data::F(values),
        });
        self
    }

    /// Token ids of `shape`, below `vocab`.
    pub fn tokens(mut self, shape: &[u64], vocab: usize) -> Self {
        let n = shape.iter().product::<u64>() as usize;
        let ids = (0..n).map(|_| self.rng.below(vocab) as i32).collect();
        self.token_values(shape, ids)
    }

    /// Token ids of `shape` with these values.
    pub fn token_values(mut self, shape: &[u64], ids: Vec<i32>) -> Self {
        self.inputs.push(Input {
            shape: shape.to_vec(),
            narrow: false,
            data: Data::I(ids),
        });
        self
    }

    /// The case of `kind` on the inputs so far.
    pub fn op(self, kind: OpKind) -> Case {
        Case {
            bf16: graph(&kind, &self.inputs, DType::BF16),
            f32: graph(&kind, &self.inputs, DType::F32),
            data: self.inputs.into_iter().map(|i| i.data).collect(),
            kind,
        }
    }
}

/// A one-op graph of `kind` whose narrow inputs are `dtype`.
fn graph(kind: &OpKind, inputs: &[Input], dtype: DType) -> (Graph, OpId) {
    let mut g = Graph::new(GraphInfo {
        model: "one-op".into(),
        batch: 1,
        seq: 1,
    });
    let block = g.add_block("b", BlockKind::Embedding);
    let mut values: Vec<ValueId> = Vec::new();
    for (i, input) in inputs.iter().enumerate() {
        let name = format!("in{i}");
        values.push(match (&input.data, input.narrow) {
            (Data::I(_), _) => g.add_input(name, TensorType::new(input.shape.clone(), DType::I32)),
            (Data::F(_), narrow) => {
                let dt = if narrow { dtype } else { DType::F32 };
                let p = g.add_param(name, input.shape.clone(), dt, block);
                g.param(p).value
            }
        });
    }
    let types: Vec<&TensorType> = values.iter().map(|&v| &g.value(v).ty).collect();
    let n_out = kind
        .infer(&types)
        .unwrap_or_else(|e| panic!("{}: {e}", kind.mnemonic()))
        .len();
    let outputs: Vec<(String, Role)> = (0..n_out)
        .map(|i| (format!("out{i}"), Role::Activation))
        .collect();
    g.add_op_multi(kind.clone(), &values, &outputs, block, Phase::Forward)
        .unwrap_or_else(|e| panic!("{}: {e}", kind.mnemonic()));
    let op = OpId::new(g.op_count() - 1);
    (g, op)
}

/// A one-op case: the op in a bf16 graph and in an f32 graph, and its inputs' values.
pub struct Case {
    /// The op kind.
    pub kind: OpKind,
    bf16: (Graph, OpId),
    f32: (Graph, OpId),
    /// Each input's values.
    pub data: Vec<Data>,
}

/// f32 and token-id views of a case's inputs, for `dispatch::run`.
struct Views<'a>(&'a [Data]);

impl<'a> Inputs<'a> for Views<'a> {
    fn f32(&self, i: usize) -> &'a [f32] {
        self.0[i].floats()
    }

    fn i32(&self, i: usize) -> &'a [i32] {
        match &self.0[i] {
            Data::I(x) => x,
            Data::F(_) => panic!("input {i} is floats, read as token ids"),
        }
    }
}

/// Runs the op of `kind` on these inputs in f32 with `dispatch::run`: its outputs and what it
/// reported. The reference that compositions of ops are built from.
pub fn run_f32(kind: OpKind, inputs: &[(&[u64], Data)]) -> (Vec<Vec<f32>>, Outcome) {
    let mut case = OneOp::new(0);
    for (shape, data) in inputs {
        case = match data {
            Data::F(x) => case.f32_values(shape, x.clone()),
            Data::I(ids) => case.token_values(shape, ids.clone()),
        };
    }
    case.op(kind).run_f32()
}

impl Case {
    /// The shape of input `i`.
    pub fn input_shape(&self, i: usize) -> Vec<u64> {
        let (g, op) = &self.bf16;
        g.value(g.op(*op).inputs[i]).ty.shape.clone()
    }

    /// The bf16 graph's type of output `i`.
    pub fn output_type(&self, i: usize) -> TensorType {
        let (g, op) = &self.bf16;
        g.value(g.op(*op).outputs[i]).ty.clone()
    }

    /// Outputs of the op in the f32 graph (`dispatch::run` on the same values), with what it
    /// reported.
    pub fn run_f32(&self) -> (Vec<Vec<f32>>, Outcome) {
        let (g, op) = &self.f32;
        let op = g.op(*op);
        let mut outs: Vec<Vec<f32>> = op
            .outputs
            .iter()
            .map(|&v| vec![f32::NAN; g.value(v).ty.numel() as usize])
            .collect();
        let mut views: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
        let mut ws = vec![f32::NAN; dispatch::workspace_len(g, op)];
        let outcome = dispatch::run(
            g,
            op,
            &Prepared::new(&op.kind),
            &Views(&self.data),
            &mut views,
            &mut ws,
        )
        .unwrap_or_else(|e| panic!("{} in f32: {e}", op.kind.mnemonic()));
        (outs, outcome)
    }

    /// Outputs of the op in the bf16 graph, run on the host backend from operands at planned
    /// addresses (bf16 ones stored as bf16, the workspace the planner would give it), each
    /// read back widened to f32, with what it reported.
    pub fn run_host_bf16(&self) -> (Vec<Vec<f32>>, Outcome) {
        let (outs, _, outcome) = self.launch_bf16(None);
        (outs, outcome)
    }

    /// An AdamW case's bf16 step on the host backend with f32 master weight `master`: the
    /// master, the bf16 parameter (widened), `m` and `v` after the step.
    pub fn adamw_host_bf16(&self, master: &[f32]) -> [Vec<f32>; 4] {
        let (_, inputs, _) = self.launch_bf16(Some(master));
        let [master, param, _grad, m, v, ..] = &inputs[..] else {
            unreachable!("adamw reads param, grad, m and v, and a master weight is added")
        };
        [master.clone(), param.clone(), m.clone(), v.clone()]
    }

    /// Places the bf16 graph's operands (and the master weight `master` of an AdamW's
    /// parameter, placed last) and launches the op: its outputs, then the master weight (when
    /// given) followed by its inputs as they are after the launch, and what it reported.
    fn launch_bf16(&self, master: Option<&[f32]>) -> (Vec<Vec<f32>>, Vec<Vec<f32>>, Outcome) {
        let (g, op) = &self.bf16;
        let op = g.op(*op);
        let ty = |v: ValueId| &g.value(v).ty;
        let mut end = 0u64;
        let mut put = |bytes: u64| {
            let at = Address {
                space: Space::Device,
                offset: end,
            };
            end += bytes.max(1).next_multiple_of(256);
            at
        };
        let inputs: Vec<Address> = op.inputs.iter().map(|&v| put(ty(v).bytes())).collect();
        let outputs: Vec<Address> = op.outputs.iter().map(|&v| put(ty(v).bytes())).collect();
        let types: Vec<&TensorType> = op.inputs.iter().map(|&v| ty(v)).collect();
        let workspace = match op.kind.workspace_bytes(&types) {
            0 => None,
            bytes => Some((put(bytes), bytes)),
        };
        let master_at = master.map(|m| put(4 * m.len() as u64));
        let mut backend = HostBackend::new(end, 0, 0).expect("the host backend starts");
        if let (Some(at), Some(values)) = (master_at, master) {
            backend.write_f32(at, values).unwrap();
            backend.set_master_weight(inputs[2], at);
        }
        for ((&v, &at), data) in op.inputs.iter().zip(&inputs).zip(&self.data) {
            match (data, ty(v).dtype) {
                (Data::I(ids), _) => backend.write_i32(at, ids).unwrap(),
                (Data::F(x), DType::BF16) => {
                    let narrow: Vec<bf16> = x.iter().map(|&e| bf16::from_f32(e)).collect();
                    backend.write_bf16(at, &narrow).unwrap()
                }
                (Data::F(x), _) => backend.write_f32(at, x).unwrap(),
            }
        }
        let prepared = Prepared::new(&op.kind);
        let mut stream = backend.create_stream(StreamKind::Compute).unwrap();
        backend.begin_step();
        let launch = Launch {
            graph: g,
            op,
            prepared: &prepared,
            inputs: &inputs,
            outputs: &outputs,
            workspace,
            step: 1,
            shard: None,
            pitches: protrain_runtime::dispatch::Pitches::DENSE,
        };
        // SAFETY: one stream on one thread; every operand has bytes of its own.
        let outcome = unsafe { backend.launch(&mut stream, &launch) }
            .unwrap_or_else(|e| panic!("{} in bf16 on the host: {e}", op.kind.mnemonic()));
        let outs = op
            .outputs
            .iter()
            .zip(&outputs)
            .map(|(&v, &at)| read(&backend, at, ty(v)))
            .collect();
        let f32_type = |n: usize| TensorType::new([n as u64], DType::F32);
        let after = master_at
            .map(|at| read(&backend, at, &f32_type(master.map_or(0, <[f32]>::len))))
            .into_iter()
            .chain(
                op.inputs
                    .iter()
                    .zip(&inputs)
                    .filter(|(&v, _)| ty(v).dtype != DType::I32)
                    .map(|(&v, &at)| read(&backend, at, ty(v))),
            )
            .collect();
        (outs, after, outcome)
    }
}

/// The values of type `ty` at `at`, widened to f32.
pub fn read(backend: &HostBackend, at: Address, ty: &TensorType) -> Vec<f32> {
    let n = ty.numel() as usize;
    match ty.dtype {
        DType::BF16 => {
            let mut narrow = vec![bf16::ZERO; n];
            backend.read_bf16(at, &mut narrow).unwrap();
            narrow.into_iter().map(bf16::to_f32).collect()
        }
        _ => {
            let mut out = vec![0.0; n];
            backend.read_f32(at, &mut out).unwrap();
            out
        }
    }
}
