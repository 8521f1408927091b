//! Schedules: the verifier against one hand-built step broken one invariant at a time, the
//! `.ptsched` file format and its every error, and the canonical printer.

use protrain_ir::file::{self, FileProblem, MAGIC};
use protrain_ir::print::value_names;
use protrain_ir::verify_schedule::{verify, verify_schedule, Invariant};
use protrain_ir::{
    BlockKind, Buffer, BufferId, BufferKind, Chunk, ChunkId, ChunkMember, ChunkSizeTrial,
    ChunkTable, CopyKind, DType, EventId, Graph, GraphInfo, Header, Instr, IrError,
    MemoryBreakdown, OpId, OpKind, ParamId, Phase, Policy, Prediction, PrintOptions, Role,
    Schedule, Space, Stream, StreamKind, TensorRef, TensorType, ValueId, WeightLayout,
    FORMAT_VERSION,
};

// Streams of the tiny schedule.
const COMPUTE: usize = 0;
const H2D: usize = 1;
const D2H: usize = 2;
const HOST_OPT: usize = 3;

// Buffers of the tiny schedule.
const X: u32 = 0;
const TARGETS: u32 = 1;
const SLOT: u32 = 2;
const LOGITS: u32 = 3;
const LOSS: u32 = 4;
const LSE: u32 = 5;
const LOGITS_RELOAD: u32 = 6;
const DLOGITS: u32 = 7;
const DX: u32 = 8;
const GRADS: u32 = 9;
const HOST_CHUNK: u32 = 10;
const HOST_GRADS: u32 = 11;
const STATE: u32 = 12;
const HOST_LOGITS: u32 = 13;
const CE_WORKSPACE: u32 = 14;

fn at(buffer: u32, offset: u64) -> TensorRef {
    TensorRef {
        buffer: BufferId(buffer),
        offset,
    }
}

fn buf(name: &str, space: Space, offset: u64, size: u64, kind: BufferKind) -> Buffer {
    Buffer {
        name: name.into(),
        space,
        offset,
        size,
        kind,
        pitch: None,
    }
}

fn kernel(op: u32, inputs: &[TensorRef], outputs: &[TensorRef]) -> Instr {
    Instr::Kernel {
        op: OpId(op),
        inputs: inputs.to_vec(),
        outputs: outputs.to_vec(),
        workspace: None,
    }
}

fn copy(what: CopyKind, src: TensorRef, dst: TensorRef, bytes: u64) -> Instr {
    Instr::Copy {
        what,
        src,
        dst,
        bytes,
    }
}

fn record(e: u32) -> Instr {
    Instr::Record { event: EventId(e) }
}

fn wait(e: u32) -> Instr {
    Instr::Wait { event: EventId(e) }
}

/// The tiny schedule's graph: `logits = x W^T`, cross-entropy, its backward and one AdamW
/// update of `W`; with the values its homes and buffers name.
struct TinyGraph {
    g: Graph,
    x: ValueId,
    targets: ValueId,
    w: ValueId,
    m: ValueId,
    v: ValueId,
    logits: ValueId,
}

fn tiny_graph() -> TinyGraph {
    let mut g = Graph::new(GraphInfo {
        model: "tiny".into(),
        batch: 1,
        seq: 2,
    });
    let head = g.add_block("lm_head", BlockKind::Head);
    let f32_ = |shape: &[u64]| TensorType::new(shape, DType::F32);
    let x = g.add_input("x", f32_(&[1, 2, 4]));
    let targets = g.add_input("targets", TensorType::new([1, 2], DType::I32));
    let w = g.add_param("lm_head.weight", [3, 4], DType::F32, head);
    let w = g.param(w).value;
    let linear = OpKind::Linear {
        bias: false,
        layout: WeightLayout::OutIn,
    };
    let logits = g
        .add_op(
            linear,
            &[x, w],
            "logits",
            Role::Activation,
            head,
            Phase::Forward,
        )
        .unwrap();
    let loss = g
        .add_op(
            OpKind::CrossEntropy,
            &[logits, targets],
            "loss",
            Role::Loss,
            head,
            Phase::Forward,
        )
        .unwrap();
    g.add_output(loss);
    let lse = ValueId(loss.0 + 1);
    let dlogits = g
        .add_op(
            OpKind::CrossEntropyBackward,
            &[logits, targets, lse],
            "d.logits",
            Role::Activation,
            head,
            Phase::Backward,
        )
        .unwrap();
    let grads = g
        .add_op_multi(
            OpKind::LinearBackward {
                bias: false,
                layout: WeightLayout::OutIn,
            },
            &[x, w, dlogits],
            &[
                ("d.x".into(), Role::Activation),
                ("d.lm_head.weight".into(), Role::Grad),
            ],
            head,
            Phase::Backward,
        )
        .unwrap();
    let m = g.add_state("adam.m.lm_head.weight", f32_(&[3, 4]));
    let v = g.add_state("adam.v.lm_head.weight", f32_(&[3, 4]));
    let adamw = OpKind::AdamW {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        clipped: false,
    };
    g.add_op_multi(adamw, &[w, grads[1], m, v], &[], head, Phase::Optimizer)
        .unwrap();
    TinyGraph {
        g,
        x,
        targets,
        w,
        m,
        v,
        logits,
    }
}

/// The tiny schedule's buffers, on the device and on the host.
fn tiny_buffers() -> Vec<Buffer> {
    use BufferKind::*;
    use Space::{Device, Host};
    vec![
        buf("x", Device, 0, 32, Input),
        buf("targets", Device, 32, 8, Input),
        buf("slot0", Device, 64, 64, ChunkSlot { slot: 0 }),
        buf("logits", Device, 128, 24, Activation),
        buf("loss", Device, 152, 4, Activation),
        buf("loss.lse", Device, 160, 8, Activation),
        buf("logits (reloaded)", Device, 168, 24, Activation),
        buf("d.logits", Device, 192, 24, Activation),
        buf("d.x", Device, 216, 32, Activation),
        buf(
            "grads chunk0",
            Device,
            256,
            64,
            GradChunk { chunk: ChunkId(0) },
        ),
        buf("chunk0", Host, 0, 64, HostChunk { chunk: ChunkId(0) }),
        buf(
            "grads chunk0",
            Host,
            64,
            64,
            HostGradChunk { chunk: ChunkId(0) },
        ),
        buf(
            "adam chunk0",
            Host,
            128,
            128,
            OptimizerState { chunk: ChunkId(0) },
        ),
        buf("logits (swapped)", Host, 256, 24, HostActivation),
        // Cross-entropy's per-row losses (2 rows of f32), aligned as workspaces are.
        buf("workspace.cross_entropy", Device, 48, 8, Workspace),
    ]
}

/// The tiny schedule's four streams: compute, the two copy directions and the host optimizer.
fn tiny_streams(logits: ValueId) -> Vec<Stream> {
    let fetch = CopyKind::FetchChunk { chunk: ChunkId(0) };
    let compute = vec![
        wait(0),
        kernel(0, &[at(X, 0), at(SLOT, 0)], &[at(LOGITS, 0)]),
        Instr::Kernel {
            op: OpId(1),
            inputs: vec![at(LOGITS, 0), at(TARGETS, 0)],
            outputs: vec![at(LOSS, 0), at(LSE, 0)],
            workspace: Some(at(CE_WORKSPACE, 0)),
        },
        record(1),
        wait(3),
        kernel(
            2,
            &[at(LOGITS_RELOAD, 0), at(TARGETS, 0), at(LSE, 0)],
            &[at(DLOGITS, 0)],
        ),
        kernel(
            3,
            &[at(X, 0), at(SLOT, 0), at(DLOGITS, 0)],
            &[at(DX, 0), at(GRADS, 0)],
        ),
        record(4),
    ];
    let h2d = vec![
        copy(fetch, at(HOST_CHUNK, 0), at(SLOT, 0), 64),
        record(0),
        wait(2),
        copy(
            CopyKind::ReloadActivation { value: logits },
            at(HOST_LOGITS, 0),
            at(LOGITS_RELOAD, 0),
            24,
        ),
        record(3),
    ];
    let d2h = vec![
        wait(1),
        copy(
            CopyKind::OffloadActivation { value: logits },
            at(LOGITS, 0),
            at(HOST_LOGITS, 0),
            24,
        ),
        record(2),
        wait(4),
        copy(
            CopyKind::OffloadGrads { chunk: ChunkId(0) },
            at(GRADS, 0),
            at(HOST_GRADS, 0),
            48,
        ),
        record(5),
    ];
    let host_opt = vec![
        wait(5),
        kernel(
            4,
            &[
                at(HOST_CHUNK, 0),
                at(HOST_GRADS, 0),
                at(STATE, 0),
                at(STATE, 64),
            ],
            &[],
        ),
    ];
    let stream = |name: &str, kind, instrs| Stream {
        name: name.into(),
        kind,
        instrs,
    };
    vec![
        stream("compute", StreamKind::Compute, compute),
        stream("h2d", StreamKind::HostToDevice, h2d),
        stream("d2h", StreamKind::DeviceToHost, d2h),
        stream("host_opt", StreamKind::HostOptimizer, host_opt),
    ]
}

/// The tiny schedule's header: the model, budgets, policy and prediction.
fn tiny_header(param_count: u64) -> Header {
    Header {
        format_version: FORMAT_VERSION,
        model: "tiny".into(),
        batch: 1,
        seq: 2,
        dtype: DType::F32,
        param_count,
        hardware: "test box: 1 KiB device, 1 KiB host".into(),
        device_budget_bytes: 1024,
        host_budget_bytes: 1024,
        disk_budget_bytes: 0,
        policy: Policy::protrain(0, 1, 1, 0, 1),
        prediction: Prediction {
            step_seconds: 1.5e-3,
            stream_busy_seconds: vec![1e-3, 2e-4, 2.5e-4, 1e-4],
            flops: 1_000,
            peak_device_bytes: 320,
            lower_bound_bytes: 296,
            host_bytes: 280,
            memory: MemoryBreakdown {
                persistent: 0,
                chunk_buffers: 128,
                activations: 128,
                workspace: 0,
                inputs: 40,
            },
        },
        report: "1 candidate, 1 fits\nchosen: the only one".into(),
    }
}

/// The tiny schedule's one chunk, holding `W`.
fn tiny_chunks() -> ChunkTable {
    ChunkTable {
        chunk_bytes: 64,
        chunks: vec![Chunk {
            members: vec![ChunkMember {
                param: ParamId(0),
                offset: 0,
                bytes: 48,
            }],
            used_bytes: 48,
            owner: 0,
        }],
        world_size: 1,
        param_chunk: vec![(ChunkId(0), 0)],
        trials: vec![ChunkSizeTrial {
            chunk_bytes: 64,
            chunks: 1,
            waste_bytes: 16,
        }],
    }
}

/// A training step of a one-layer model: `logits = linear(x, w)`, `loss = cross_entropy`,
/// their backward ops and an AdamW update of `w`.
///
/// `w` lives in host chunk 0 and is fetched into a device slot over the host-to-device stream;
/// `logits` is swapped: offloaded after the forward pass, reloaded into another buffer for the
/// backward pass; `w`'s gradient is offloaded and the host optimizer updates `w`, `m` and `v`
/// at their homes. Values: x %0, targets %1, w @lm_head.weight, m %2, v %3, logits %4,
/// loss %5, lse %6, dlogits %7, dx %8, dw %9.
fn tiny() -> Schedule {
    let TinyGraph {
        g,
        x,
        targets,
        w,
        m,
        v,
        logits,
    } = tiny_graph();
    Schedule {
        header: tiny_header(g.param_count()),
        chunks: tiny_chunks(),
        buffers: tiny_buffers(),
        streams: tiny_streams(logits),
        events: 6,
        arena_bytes: 320,
        host_bytes: 280,
        disk_bytes: 0,
        homes: vec![
            (x, at(X, 0)),
            (targets, at(TARGETS, 0)),
            (w, at(HOST_CHUNK, 0)),
            (m, at(STATE, 0)),
            (v, at(STATE, 64)),
        ],
        masters: vec![],
        loss: at(LOSS, 0),
        micro_batch_losses: vec![],
        graph: g,
    }
}

#[test]
fn the_tiny_schedule_verifies() {
    let s = tiny();
    if let Err(e) = verify_schedule(&s) {
        panic!("{e}\n\n{}", s.to_text());
    }
}

// The proof type -------------------------------------------------------------------------

#[test]
fn verify_gives_a_verified_schedule_or_the_first_broken_invariant() {
    let mut proof = verify(tiny()).unwrap();
    assert_eq!(proof.events, 6, "it reads as the schedule");
    assert_eq!(proof.schedule().to_text(), tiny().to_text());
    // What the verifier does not read can change after verification.
    proof.prediction_mut().step_seconds = 2.0;
    proof.report_mut().push_str("\nsimulated");
    let schedule = proof.into_inner();
    assert_eq!(schedule.header.prediction.step_seconds, 2.0);
    assert!(verify_schedule(&schedule).is_ok());

    let mut broken = tiny();
    deadlock(&mut broken);
    let err = verify(broken).unwrap_err();
    assert_eq!(err.invariant, Invariant::Deadlock, "{err}");
    assert_eq!(
        protrain_ir::VerifiedSchedule::try_from(tiny())
            .unwrap()
            .to_text(),
        tiny().to_text()
    );
}

// The verifier, one broken invariant at a time --------------------------------------------

/// A way to break the tiny schedule.
type Breakage = fn(&mut Schedule);

/// Breaks the tiny schedule with `mutate` and checks the verifier names `invariant` in a
/// message that contains every piece of `expect`. Returns the message.
fn check(mutate: Breakage, invariant: Invariant, expect: &[&str]) -> String {
    let mut s = tiny();
    mutate(&mut s);
    let err = match verify_schedule(&s) {
        Ok(()) => panic!("the broken schedule verifies:\n{}", s.to_text()),
        Err(e) => e,
    };
    let text = err.to_string();
    assert_eq!(err.invariant, invariant, "{text}");
    for piece in expect {
        assert!(text.contains(piece), "expected `{piece}` in\n{text}");
    }
    text
}

fn overlapping_live_buffers(s: &mut Schedule) {
    // d.logits placed over x, which linear_backward still reads after d.logits is written.
    s.buffers[DLOGITS as usize].offset = 0;
}

fn missing_wait(s: &mut Schedule) {
    // The offload of logits no longer waits for the kernel that writes them.
    s.streams[D2H].instrs.swap(0, 1);
}

fn read_before_fetch_completes(s: &mut Schedule) {
    // The compute stream waits for the fetch only after the kernel that reads the weight.
    s.streams[COMPUTE].instrs.swap(0, 1);
}

fn release_before_last_use(s: &mut Schedule) {
    // The slot is refilled (as if for the next chunk) while linear_backward may still read
    // the weight in it.
    let fetch = s.streams[H2D].instrs[0].clone();
    s.streams[H2D].instrs.push(fetch);
}

fn arena_over_budget(s: &mut Schedule) {
    s.header.device_budget_bytes = 319;
}

fn swapped_activation_never_reloaded(s: &mut Schedule) {
    s.streams[H2D].instrs.remove(3);
}

fn event_never_recorded(s: &mut Schedule) {
    s.streams[D2H].instrs.pop();
}

fn deadlock(s: &mut Schedule) {
    // The fetch's event is recorded only after waiting for the offload, which waits for the
    // forward pass, which waits for the fetch.
    s.streams[H2D].instrs.swap(1, 2);
}

fn kernel_missing(s: &mut Schedule) {
    s.streams[HOST_OPT].instrs.pop();
}

fn offset_out_of_range(s: &mut Schedule) {
    s.buffers[HOST_LOGITS as usize].offset = 270;
}

fn update_away_from_home(s: &mut Schedule) {
    // AdamW updates v in the spare half of the state buffer, not at v's home.
    if let Instr::Kernel { inputs, .. } = &mut s.streams[HOST_OPT].instrs[1] {
        inputs[3].offset = 112;
    }
    s.buffers[STATE as usize].size = 160;
    s.host_bytes = 288;
}

fn loss_clobbered(s: &mut Schedule) {
    // d.x is placed over the loss after the loss is written: every read is still fine, but
    // the step ends without its loss.
    s.buffers[DX as usize].offset = 136;
}

fn event_never_waited(s: &mut Schedule) {
    s.streams[HOST_OPT].instrs.remove(0);
    s.streams[HOST_OPT].instrs.insert(0, wait(4));
}

fn op_runs_twice(s: &mut Schedule) {
    let again = s.streams[COMPUTE].instrs[2].clone();
    s.streams[COMPUTE].instrs.insert(3, again);
}

fn workspace_not_needed(s: &mut Schedule) {
    if let Instr::Kernel { workspace, .. } = &mut s.streams[COMPUTE].instrs[1] {
        *workspace = Some(at(DX, 0));
    }
}

fn event_out_of_range(s: &mut Schedule) {
    s.streams[COMPUTE].instrs[0] = wait(6);
}

fn wait_on_own_later_record(s: &mut Schedule) {
    // d2h waits for its own e2 before the offload that precedes the record.
    s.streams[D2H].instrs.insert(1, wait(2));
}

fn kernel_on_a_copy_stream(s: &mut Schedule) {
    let k = s.streams[HOST_OPT].instrs.pop().unwrap();
    s.streams[D2H].instrs.push(k);
}

fn misaligned_offset(s: &mut Schedule) {
    // d.x moved 2 bytes up, still inside the arena and clear of its neighbours: every f32
    // element of it would straddle two words.
    s.buffers[DX as usize].offset = 218;
}

fn misaligned_workspace(s: &mut Schedule) {
    s.buffers[CE_WORKSPACE as usize].offset = 40;
}

/// Sets an AdamW setting of the tiny schedule's graph, as an edit of its JSON form would.
fn set_adamw(s: &mut Schedule, key: &str, value: f64) {
    let mut json: serde_json::Value = serde_json::from_str(&s.graph.to_json()).unwrap();
    fn visit(v: &mut serde_json::Value, key: &str, value: f64) -> usize {
        match v {
            serde_json::Value::Object(map) if map.contains_key("beta2") => {
                map.insert(key.into(), value.into());
                1
            }
            serde_json::Value::Object(map) => map.values_mut().map(|v| visit(v, key, value)).sum(),
            serde_json::Value::Array(items) => items.iter_mut().map(|v| visit(v, key, value)).sum(),
            _ => 0,
        }
    }
    assert_eq!(
        visit(&mut json, key, value),
        1,
        "the tiny graph has one AdamW"
    );
    s.graph = Graph::from_json(&json.to_string()).unwrap();
}

fn negative_eps(s: &mut Schedule) {
    set_adamw(s, "eps", -1e233);
}

#[test]
fn overlapping_live_buffers_are_caught_at_the_clobbered_read() {
    check(
        overlapping_live_buffers,
        Invariant::DataFlow,
        &[
            "stream compute #6 (linear_backward d.x): reads %0 at device [0x0, 0x20)",
            "holds %7 (written by stream compute #5 (cross_entropy_backward d.logits))",
            "overlapping live buffers",
        ],
    );
}

#[test]
fn a_missing_wait_is_named() {
    check(
        missing_wait,
        Invariant::DataFlow,
        &[
            "stream d2h #0 (copy offload %4): reads %4 at device [0x80, 0x98), written by \
             stream compute #1 (linear logits), but is not ordered after that write: a \
             missing wait?",
        ],
    );
}

#[test]
fn a_read_before_its_fetch_completes_is_named() {
    check(
        read_before_fetch_completes,
        Invariant::DataFlow,
        &[
            "stream compute #0 (linear logits): reads @lm_head.weight at device [0x40, 0x70)",
            "stream h2d #0 (copy fetch chunk0) puts it there, but is not ordered before this \
             read: a missing wait?",
        ],
    );
}

#[test]
fn a_slot_refilled_before_the_last_use_of_its_chunk_is_named() {
    check(
        release_before_last_use,
        Invariant::DataFlow,
        &[
            "stream h2d #5 (copy fetch chunk0): overwrites @lm_head.weight at device \
             [0x40, 0x70) while stream compute #6 (linear_backward d.x) may still read it",
            "a release before its last use",
        ],
    );
}

#[test]
fn an_arena_over_budget_is_named() {
    check(
        arena_over_budget,
        Invariant::Budget,
        &["the device arena takes 320 B, over its budget of 319 B"],
    );
}

#[test]
fn a_swapped_activation_never_reloaded_is_named() {
    check(
        swapped_activation_never_reloaded,
        Invariant::DataFlow,
        &[
            "stream compute #5 (cross_entropy_backward d.logits): reads %4 at device \
             [0xa8, 0xc0) but that memory holds nothing",
            "%4 is offloaded (stream d2h #1 (copy offload %4)) but never reloaded there",
        ],
    );
}

#[test]
fn an_event_never_recorded_is_named() {
    check(
        event_never_recorded,
        Invariant::Events,
        &["stream host_opt #0 (wait e5): waits for e5, which no stream records"],
    );
}

#[test]
fn a_deadlock_is_named_with_every_blocked_stream() {
    check(
        deadlock,
        Invariant::Deadlock,
        &[
            "deadlock: no stream can go on: stream compute #0 waits for e0, which stream h2d \
             records at #2",
            "stream h2d #1 waits for e2, which stream d2h records at #2",
            "stream d2h #0 waits for e1, which stream compute records at #3",
        ],
    );
}

#[test]
fn a_missing_kernel_is_named() {
    check(
        kernel_missing,
        Invariant::Coverage,
        &["op4 (adamw lm_head.weight, optimizer phase) never runs"],
    );
}

#[test]
fn an_offset_out_of_range_is_named() {
    check(
        offset_out_of_range,
        Invariant::Bounds,
        &["buf13 (logits (swapped)) at host 0x10e + 24 B ends past the host region (280 B)"],
    );
}

#[test]
fn an_in_place_update_away_from_home_is_named() {
    check(
        update_away_from_home,
        Invariant::Homes,
        &[
            "stream host_opt #1 (adamw lm_head.weight): updates %3 in place at host 0xf0, but \
           its home is at host 0xc0",
        ],
    );
}

#[test]
fn a_clobbered_loss_is_named_at_the_end_of_the_step() {
    check(
        loss_clobbered,
        Invariant::EndOfStep,
        &[
            "at the end of the step `loss` (device [0x98, 0x9c)) holds %8 (written by stream \
           compute #6 (linear_backward d.x)), not the loss %5",
        ],
    );
}

#[test]
fn an_event_never_waited_for_is_named() {
    check(
        event_never_waited,
        Invariant::Events,
        &["stream d2h #5 (record e5): records e5, which no stream waits for"],
    );
}

#[test]
fn an_op_run_twice_is_named() {
    check(
        op_runs_twice,
        Invariant::Coverage,
        &[
            "stream compute #3 (cross_entropy loss): runs op1 a second time (first at stream \
           compute #2",
        ],
    );
}

#[test]
fn a_workspace_for_a_kernel_that_needs_none_is_named() {
    check(
        workspace_not_needed,
        Invariant::Ids,
        &["stream compute #1 (linear logits): has a workspace (buf7) but linear needs none"],
    );
}

#[test]
fn an_event_out_of_range_is_named() {
    check(
        event_out_of_range,
        Invariant::Ids,
        &["stream compute #0 (wait e6): uses e6, but events are numbered 0..6"],
    );
}

#[test]
fn a_wait_for_a_later_record_on_the_same_stream_is_named() {
    check(
        wait_on_own_later_record,
        Invariant::Events,
        &["stream d2h #1 (wait e2): waits for e2, which this stream records later (#3)"],
    );
}

#[test]
fn an_offset_misaligned_for_its_element_type_is_named() {
    check(
        misaligned_offset,
        Invariant::Alignment,
        &[
            "stream compute #6 (linear_backward d.x): writes %8 (f32[1,2,4]) at device 0xda \
             (buf11), which is not a multiple of 4 bytes",
        ],
    );
}

#[test]
fn a_misaligned_workspace_is_named() {
    check(
        misaligned_workspace,
        Invariant::Alignment,
        &[
            "stream compute #2 (cross_entropy loss): has its workspace at device 0x28 (buf8), \
             which is not a multiple of 16 bytes",
        ],
    );
}

#[test]
fn optimizer_settings_out_of_range_are_named() {
    check(
        negative_eps,
        Invariant::Optimizer,
        &[
            "stream host_opt #1 (adamw lm_head.weight): eps = -1e233, but it must be finite \
             and > 0",
            "compile the schedule again with a valid AdamW epsilon",
        ],
    );
    let cases = [
        ("lr", -1e-3, "lr = -0.001, but it must be finite and >= 0"),
        ("beta1", -0.5, "beta1 = -0.5, but it must be in [0, 1)"),
        ("beta2", 1.0, "beta2 = 1.0, but it must be in [0, 1)"),
        ("eps", 0.0, "eps = 0.0, but it must be finite and > 0"),
        (
            "weight_decay",
            -0.1,
            "weight_decay = -0.1, but it must be finite and >= 0",
        ),
    ];
    for (key, value, expect) in cases {
        let mut s = tiny();
        set_adamw(&mut s, key, value);
        let err = verify_schedule(&s).expect_err(key);
        assert_eq!(err.invariant, Invariant::Optimizer, "{err}");
        assert!(
            err.to_string().contains(expect),
            "expected `{expect}` in\n{err}"
        );
    }
    // The edges of each range are fine: a zero learning rate and decay, zero betas.
    let mut s = tiny();
    for key in ["lr", "beta1", "beta2", "weight_decay"] {
        set_adamw(&mut s, key, 0.0);
    }
    verify_schedule(&s).unwrap();
}

#[test]
fn a_kernel_on_a_copy_stream_is_named() {
    check(
        kernel_on_a_copy_stream,
        Invariant::Ids,
        &["a kernel on a device-to-host stream"],
    );
}

/// Every message above, as a user reads it.
#[test]
fn every_broken_invariant_reads_clearly() {
    let cases: [(&str, Breakage); 21] = [
        ("overlapping live buffers", overlapping_live_buffers),
        ("missing wait", missing_wait),
        ("read before fetch completes", read_before_fetch_completes),
        ("release before last use", release_before_last_use),
        ("arena over budget", arena_over_budget),
        (
            "swapped activation never reloaded",
            swapped_activation_never_reloaded,
        ),
        ("event never recorded", event_never_recorded),
        ("deadlock", deadlock),
        ("kernel missing", kernel_missing),
        ("offset out of range", offset_out_of_range),
        ("update away from home", update_away_from_home),
        ("loss clobbered", loss_clobbered),
        ("event never waited", event_never_waited),
        ("op runs twice", op_runs_twice),
        ("workspace not needed", workspace_not_needed),
        ("event out of range", event_out_of_range),
        ("wait on own later record", wait_on_own_later_record),
        ("kernel on a copy stream", kernel_on_a_copy_stream),
        ("misaligned offset", misaligned_offset),
        ("misaligned workspace", misaligned_workspace),
        ("negative eps", negative_eps),
    ];
    let mut report = String::new();
    for (name, mutate) in cases {
        let mut s = tiny();
        mutate(&mut s);
        let err = verify_schedule(&s).expect_err(name);
        report.push_str(&format!("{name}:\n  {err}\n"));
    }
    insta::assert_snapshot!(report);
}

// A long pipeline -------------------------------------------------------------------------

/// The graph of [`pipeline`]: `layers` linear layers, each with its own weight, and a
/// cross-entropy loss; with its inputs and weights.
fn pipeline_graph(layers: usize) -> (Graph, ValueId, ValueId, Vec<ValueId>) {
    let mut g = Graph::new(GraphInfo {
        model: "pipeline".into(),
        batch: 1,
        seq: 2,
    });
    let head = g.add_block("layers", BlockKind::Head);
    let x = g.add_input("x", TensorType::new([1, 2, 4], DType::F32));
    let targets = g.add_input("targets", TensorType::new([1, 2], DType::I32));
    let linear = OpKind::Linear {
        bias: false,
        layout: WeightLayout::OutIn,
    };
    let mut h = x;
    let mut weights = Vec::new();
    for k in 0..layers {
        let w = g.add_param(format!("w.{k}"), [4, 4], DType::F32, head);
        let w = g.param(w).value;
        weights.push(w);
        h = g
            .add_op(
                linear.clone(),
                &[h, w],
                format!("h.{k}"),
                Role::Activation,
                head,
                Phase::Forward,
            )
            .unwrap();
    }
    let loss = g
        .add_op(
            OpKind::CrossEntropy,
            &[h, targets],
            "loss",
            Role::Loss,
            head,
            Phase::Forward,
        )
        .unwrap();
    g.add_output(loss);
    (g, x, targets, weights)
}

/// The compute and host-to-device streams of [`pipeline`]: each layer's chunk fetched into
/// one of two slots, alternating, and the layer run once it arrives.
fn pipeline_streams(
    layers: usize,
    first_chunk: u32,
    ce_workspace: u32,
) -> (Vec<Instr>, Vec<Instr>) {
    // Events: fetched(k) = k; slot_free(k) = layers + k, for k < layers - 2.
    let mut compute = Vec::new();
    let mut h2d = Vec::new();
    for k in 0..layers {
        let slot = SLOT + (k % 2) as u32;
        if k >= 2 {
            h2d.push(wait((layers + k - 2) as u32));
        }
        h2d.push(copy(
            CopyKind::FetchChunk {
                chunk: ChunkId(k as u32),
            },
            at(first_chunk + k as u32, 0),
            at(slot, 0),
            64,
        ));
        h2d.push(record(k as u32));
        let input = if k == 0 {
            at(X, 0)
        } else {
            at(4 + ((k - 1) % 2) as u32, 0)
        };
        compute.push(wait(k as u32));
        compute.push(kernel(
            k as u32,
            &[input, at(slot, 0)],
            &[at(4 + (k % 2) as u32, 0)],
        ));
        if k + 2 < layers {
            compute.push(record((layers + k) as u32));
        }
    }
    compute.push(Instr::Kernel {
        op: OpId(layers as u32),
        inputs: vec![at(4 + ((layers - 1) % 2) as u32, 0), at(TARGETS, 0)],
        outputs: vec![at(6, 0), at(7, 0)],
        workspace: Some(at(ce_workspace, 0)),
    });
    (compute, h2d)
}

/// A forward pass of `layers` linear layers, each weight in its own host chunk, fetched into
/// two slots in turn: the fetch of layer `k` waits for the kernel of layer `k - 2` to be done
/// with the slot. About `6 * layers` instructions.
fn pipeline(layers: usize) -> Schedule {
    let mut s = tiny();
    let (g, x, targets, weights) = pipeline_graph(layers);
    use Space::{Device, Host};
    let n = layers as u64;
    let mut buffers = vec![
        buf("x", Device, 0, 32, BufferKind::Input),
        buf("targets", Device, 32, 8, BufferKind::Input),
        buf("slot0", Device, 64, 64, BufferKind::ChunkSlot { slot: 0 }),
        buf("slot1", Device, 128, 64, BufferKind::ChunkSlot { slot: 1 }),
        buf("act0", Device, 192, 32, BufferKind::Activation),
        buf("act1", Device, 224, 32, BufferKind::Activation),
        buf("loss", Device, 256, 4, BufferKind::Activation),
        buf("loss.lse", Device, 264, 8, BufferKind::Activation),
        buf(
            "workspace.cross_entropy",
            Device,
            48,
            8,
            BufferKind::Workspace,
        ),
    ];
    let ce_workspace = buffers.len() as u32 - 1;
    let first_chunk = buffers.len() as u32;
    let mut members = Vec::new();
    for k in 0..layers {
        buffers.push(buf(
            &format!("chunk{k}"),
            Host,
            64 * k as u64,
            64,
            BufferKind::HostChunk {
                chunk: ChunkId(k as u32),
            },
        ));
        members.push(Chunk {
            members: vec![ChunkMember {
                param: ParamId(k as u32),
                offset: 0,
                bytes: 64,
            }],
            used_bytes: 64,
            owner: 0,
        });
    }
    let (compute, h2d) = pipeline_streams(layers, first_chunk, ce_workspace);
    s.homes = vec![(x, at(X, 0)), (targets, at(TARGETS, 0))];
    s.homes.extend(
        weights
            .iter()
            .enumerate()
            .map(|(k, &w)| (w, at(first_chunk + k as u32, 0))),
    );
    s.streams = vec![
        Stream {
            name: "compute".into(),
            kind: StreamKind::Compute,
            instrs: compute,
        },
        Stream {
            name: "h2d".into(),
            kind: StreamKind::HostToDevice,
            instrs: h2d,
        },
    ];
    s.events = (2 * layers - 2) as u32;
    s.chunks = ChunkTable {
        chunk_bytes: 64,
        param_chunk: (0..layers).map(|k| (ChunkId(k as u32), 0)).collect(),
        chunks: members,
        world_size: 1,
        trials: vec![],
    };
    s.buffers = buffers;
    s.arena_bytes = 272;
    s.host_bytes = 64 * n;
    s.header.device_budget_bytes = 272;
    s.header.host_budget_bytes = 64 * n;
    s.header.param_count = g.param_count();
    s.loss = at(6, 0);
    s.graph = g;
    s
}

#[test]
fn a_long_pipeline_verifies_and_one_missing_wait_in_it_is_found() {
    let layers = 20_000;
    let s = pipeline(layers);
    if let Err(e) = verify_schedule(&s) {
        panic!("{e}");
    }
    // Move the wait that keeps the fetch of layer 10002 out of slot 0 until layer 10000 is
    // done with it to the end of the stream (the event must still be waited for).
    let mut broken = s.clone();
    let k = 10_002;
    let pos = broken.streams[1]
        .instrs
        .iter()
        .position(|i| *i == wait((layers + k - 2) as u32))
        .unwrap();
    broken.streams[1].instrs.remove(pos);
    broken.streams[1].instrs.push(wait((layers + k - 2) as u32));
    let err = verify_schedule(&broken).unwrap_err();
    assert_eq!(err.invariant, Invariant::DataFlow, "{err}");
    assert_eq!(
        err.message,
        "stream h2d #30004 (copy fetch chunk10002): overwrites @w.10000 at device [0x40, 0x80) \
         while stream compute #30001 (linear h.10000) may still read it: nothing orders that \
         read before this write (a release before its last use, or a missing wait?)"
    );
}

// The printer -----------------------------------------------------------------------------

#[test]
fn the_printer_is_canonical() {
    insta::assert_snapshot!(tiny().to_text());
}

/// The tiny schedule with its buffer table in another order (reversed), every reference
/// renumbered to match: the same schedule.
fn reversed_buffers() -> Schedule {
    let mut s = tiny();
    let n = s.buffers.len() as u32;
    s.buffers.reverse();
    let flip = |t: &mut TensorRef| t.buffer = BufferId(n - 1 - t.buffer.0);
    for instr in s.streams.iter_mut().flat_map(|st| &mut st.instrs) {
        match instr {
            Instr::Kernel {
                inputs,
                outputs,
                workspace,
                ..
            } => inputs
                .iter_mut()
                .chain(outputs)
                .chain(workspace)
                .for_each(flip),
            Instr::Copy { src, dst, .. } => {
                flip(src);
                flip(dst);
            }
            Instr::AllReduce { at, .. }
            | Instr::AllGather { at, .. }
            | Instr::ReduceScatter { at, .. } => flip(at),
            Instr::CopyShard { src, dst, .. }
            | Instr::DiskRead { src, dst, .. }
            | Instr::DiskWrite { src, dst, .. }
            | Instr::CastChunk { src, dst, .. } => {
                flip(src);
                flip(dst);
            }
            Instr::Record { .. } | Instr::Wait { .. } | Instr::EndMicroBatch { .. } => {}
        }
    }
    s.homes.iter_mut().for_each(|(_, t)| flip(t));
    s.masters.iter_mut().for_each(|(_, t)| flip(t));
    flip(&mut s.loss);
    s
}

#[test]
fn buffers_print_numbered_in_order_of_appearance_whatever_their_ids() {
    let s = tiny();
    let text = s.to_text();
    // The homes come first: x, targets, then the weight's host chunk.
    assert!(text.contains("  %0 (x) at buf0 = device[+0x0]\n"), "{text}");
    assert!(
        text.contains("  @lm_head.weight at buf2 = host[+0x0]\n"),
        "{text}"
    );
    let reversed = reversed_buffers();
    verify_schedule(&reversed).unwrap();
    assert_eq!(reversed.to_text(), text);
    // The verifier names buffers as the printer does.
    let mut a = tiny();
    let mut b = reversed_buffers();
    workspace_not_needed(&mut a);
    if let Instr::Kernel { workspace, .. } = &mut b.streams[COMPUTE].instrs[1] {
        *workspace = Some(at(14 - DX, 0));
    }
    assert_eq!(
        verify_schedule(&a).unwrap_err(),
        verify_schedule(&b).unwrap_err()
    );
}

#[test]
fn the_report_can_be_left_out() {
    let s = tiny();
    let full = s.to_text();
    assert!(full.contains("; report:\n;   1 candidate, 1 fits\n;   chosen: the only one\n"));
    assert_eq!(s.to_text_with(PrintOptions::default()), full);
    let without = s.to_text_with(PrintOptions::WITHOUT_REPORT);
    assert!(
        !without.contains("report") && !without.contains("chosen"),
        "{without}"
    );
    assert_eq!(
        without,
        full.replace(
            "; report:\n;   1 candidate, 1 fits\n;   chosen: the only one\n",
            ""
        )
    );
}

#[test]
fn the_schedule_printer_names_values_as_the_graph_printer_does() {
    let s = tiny();
    let names = value_names(&s.graph);
    let graph_text = s.graph.to_text();
    for (_, op) in s.graph.ops() {
        for &v in &op.outputs {
            let line = format!("{}: {}", names[v.index()], s.graph.value(v).ty);
            assert!(graph_text.contains(&line), "`{line}` not in\n{graph_text}");
        }
        let inputs: Vec<&str> = op
            .inputs
            .iter()
            .map(|v| names[v.index()].as_str())
            .collect();
        let used = format!("] {}", inputs.join(", "));
        let bare = format!("{} {}", op.kind.mnemonic(), inputs.join(", "));
        assert!(
            graph_text.contains(&used) || graph_text.contains(&bare),
            "`{bare}` not in\n{graph_text}"
        );
    }
    assert_eq!(names[2], "@lm_head.weight");
    assert_eq!(names[9], "%2");
}

// The file format -------------------------------------------------------------------------

fn problem<T>(result: protrain_ir::Result<T>) -> (FileProblem, String) {
    match result {
        Err(e @ IrError::ScheduleFile { .. }) => {
            let text = e.to_string();
            let IrError::ScheduleFile { problem, .. } = e else {
                unreachable!()
            };
            (problem, text)
        }
        Err(e) => panic!("expected a file problem, got {e}"),
        Ok(_) => panic!("expected a file problem, the bytes decode"),
    }
}

#[test]
fn a_schedule_round_trips_through_bytes_and_files() {
    let s = tiny();
    let bytes = file::encode(&s);
    assert_eq!(&bytes[..8], MAGIC);
    let back = file::decode(&bytes).unwrap();
    assert_eq!(back.to_text(), s.to_text());
    assert_eq!(file::encode(&back), bytes, "encoding is deterministic");
    assert_eq!(back.graph.to_json(), s.graph.to_json());

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.ptsched");
    file::write(&path, &s).unwrap();
    file::write(&path, &s).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
    assert_eq!(file::read(&path).unwrap().to_text(), s.to_text());
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(left.len(), 1, "no temporary file is left behind");
}

#[test]
fn wrong_magic_is_not_a_schedule() {
    let mut bytes = file::encode(&tiny());
    bytes[0] = b'X';
    let (p, text) = problem(file::decode(&bytes));
    assert!(matches!(p, FileProblem::NotASchedule));
    assert_eq!(
        text,
        "schedule data: not a protrain schedule (.ptsched); compile one with `protrain compile`"
    );
    let (p, _) = problem(file::decode(b"{\"graph\": 1}"));
    assert!(matches!(p, FileProblem::NotASchedule));
}

#[test]
fn versions_other_than_this_build_s_are_named() {
    let mut bytes = file::encode(&tiny());
    bytes[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
    let (p, text) = problem(file::decode(&bytes));
    assert!(matches!(p, FileProblem::NewerVersion { .. }));
    assert_eq!(
        text,
        format!(
            "schedule data: written by a newer protrain (format {}, this build reads {}); \
             upgrade protrain",
            FORMAT_VERSION + 1,
            FORMAT_VERSION
        )
    );
    bytes[8..12].copy_from_slice(&(FORMAT_VERSION - 1).to_le_bytes());
    let (p, text) = problem(file::decode(&bytes));
    assert!(matches!(p, FileProblem::OlderVersion { .. }));
    let older = format!(
        "written by an older protrain (format {}, this build reads {FORMAT_VERSION})",
        FORMAT_VERSION - 1
    );
    assert!(text.contains(&older), "{text}");
}

#[test]
fn truncation_anywhere_is_named_without_a_panic() {
    let bytes = file::encode(&tiny());
    let n = bytes.len();
    for len in [0, 1, 7, 8, 11, 12, 19, 20, 21, n / 2, n - 5, n - 4, n - 1] {
        let (p, text) = problem(file::decode(&bytes[..len]));
        assert!(
            matches!(p, FileProblem::Truncated { have, .. } if have == len as u64),
            "{len}: {text}"
        );
        assert!(text.starts_with("schedule data: truncated: "), "{text}");
        assert!(text.ends_with("copy it again or compile it again with `protrain compile`"));
    }
    let (_, text) = problem(file::decode(&bytes[..11]));
    assert!(
        text.contains("truncated: 11 bytes, but the header needs 20"),
        "{text}"
    );
    let (_, text) = problem(file::decode(&bytes[..n - 1]));
    assert!(
        text.contains(&format!(
            "truncated: {} bytes, but the payload the header announces, with its checksum, \
             needs {n}",
            n - 1
        )),
        "{text}"
    );
}

#[test]
fn trailing_bytes_are_named() {
    let mut bytes = file::encode(&tiny());
    bytes.extend_from_slice(b"more");
    let (p, text) = problem(file::decode(&bytes));
    assert!(matches!(p, FileProblem::TrailingBytes { extra: 4 }));
    assert!(
        text.contains("4 unexpected bytes after the checksum"),
        "{text}"
    );
}

#[test]
fn a_flipped_payload_byte_is_corruption() {
    let clean = file::encode(&tiny());
    for at in [20, 21, clean.len() / 2, clean.len() - 5, clean.len() - 1] {
        let mut bytes = clean.clone();
        bytes[at] ^= 0x10;
        let (p, text) = problem(file::decode(&bytes));
        assert!(matches!(p, FileProblem::Corrupted { .. }), "{at}: {text}");
        assert!(text.starts_with("schedule data: corrupted: the payload's CRC-32 is 0x"));
    }
}

/// Frames `payload` as a schedule file with a correct checksum.
fn framed(payload: &[u8]) -> Vec<u8> {
    let mut bytes = MAGIC.to_vec();
    bytes.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(payload);
    bytes.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    bytes
}

#[test]
fn an_intact_payload_that_is_not_a_schedule_is_named() {
    // Nothing; not bincode; a node cut short; an empty tree; a tree that is only `null`.
    for payload in [
        &b""[..],
        &[0xff; 16][..],
        &[0, 1, 3][..],
        &[0, 0][..],
        &[0, 1, 0][..],
    ] {
        let (p, text) = problem(file::decode(&framed(payload)));
        assert!(matches!(p, FileProblem::Payload { .. }), "{text}");
        let want = format!(
            "schedule data: the payload does not decode as a format {FORMAT_VERSION} schedule"
        );
        assert!(text.starts_with(&want), "{text}");
    }
    // An intact payload cut short, with a checksum to match.
    let good = file::encode(&tiny());
    let len = u64::from_le_bytes(good[12..20].try_into().unwrap()) as usize;
    let (p, _) = problem(file::decode(&framed(&good[20..20 + len - 1])));
    assert!(matches!(p, FileProblem::Payload { .. }));
}

#[test]
fn decode_verifies_and_decode_unverified_does_not() {
    let mut s = tiny();
    deadlock(&mut s);
    let bytes = file::encode(&s);
    match file::decode(&bytes) {
        Err(IrError::Schedule(e)) => assert_eq!(e.invariant, Invariant::Deadlock),
        other => panic!("expected the verifier's error, got {:?}", other.map(|_| ())),
    }
    assert!(file::decode_unverified(&bytes).is_ok());

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.ptsched");
    file::write(&path, &s).unwrap();
    let err = file::read(&path).unwrap_err().to_string();
    assert!(
        err.starts_with(&format!(
            "{}: invalid schedule (deadlock): ",
            path.display()
        )),
        "{err}"
    );
    assert!(
        err.ends_with("; compile it again with `protrain compile`"),
        "{err}"
    );
    assert!(file::read_unverified(&path).is_ok());

    let missing = dir.path().join("missing.ptsched");
    let err = file::read(&missing).unwrap_err();
    assert!(matches!(err, IrError::Io { .. }), "{err}");
    assert!(err.to_string().starts_with("cannot read "), "{err}");
}

proptest::proptest! {
    /// A policy's printed line, blocks in runs, parses back to the same policy, and so does
    /// its blocks written one letter per layer.
    #[test]
    fn policy_print_then_parse_round_trips(
        modes in proptest::collection::vec(0u8..3, 0..80),
        n_persist in 0u32..6,
        n_buffer in 0u32..3,
        prefetch in 1u32..3,
    ) {
        use protrain_ir::{BlockMode, PolicySpec};
        let blocks: Vec<BlockMode> = modes
            .iter()
            .map(|m| [BlockMode::Keep, BlockMode::Checkpoint, BlockMode::Swap][*m as usize])
            .collect();
        let policy = Policy { n_persist, n_buffer, prefetch, blocks, ..Policy::resident(0, 0) };
        let printed = policy.to_string();
        let back = printed.parse::<PolicySpec>().unwrap().resolve(6, policy.blocks.len());
        proptest::prop_assert_eq!(back.unwrap(), policy.clone(), "{}", printed);
        let long: String = policy.blocks.iter().map(|m| m.letter()).collect();
        let long = if long.is_empty() { "-".to_string() } else { long };
        proptest::prop_assert_eq!(protrain_ir::parse_blocks(&long).unwrap(), policy.blocks);
    }
}
