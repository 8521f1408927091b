//! ZeRO-3 style sharding on the host backend, ranks as threads: offloaded chunks split over
//! the ranks (each holds 1/W of their host state), all-gathered before use and
//! reduce-scattered after their last backward use. W ranks of one micro-batch train bit for
//! bit as one rank accumulating W micro-batches over the same rows (the reduce-scatter sums
//! in rank order, the single rank's accumulation order), under a tight policy (every chunk
//! offloaded and sharded) and a roomy one, in f32 and bf16; the state the ranks gather
//! (weights, Adam moments) resumes on 2 ranks and on 1 as if uninterrupted.

use crate::common;

use protrain::compiler::comm::Topology;
use protrain::ir::verify_schedule::verify;
use protrain::ir::verify_schedule::VerifiedSchedule;
use protrain::ir::{
    BufferKind, DType, HardwareProfile, Instr, OpKind, Schedule, ShardPart, StreamKind,
};
use protrain::runtime::collective::{thread_ranks, Collective};
use protrain::runtime::data::rank_rows;
use protrain::runtime::params::init_params;
use protrain::runtime::train::vocab_of;
use protrain::runtime::Executor;
use protrain::{CompileOptions, OptimizerConfig, PolicyChoice};
use std::time::Duration;

const ROOMY: &str = "blocks=KK";
pub(crate) const TIGHT: &str = "n_persist=0 n_buffer=1 n_swap=1 n_checkpoint=1";
pub(crate) const BATCH: u64 = 2;
pub(crate) const SEQ: u64 = 16;

/// `model` compiled for `ranks` ranks of `k` micro-batches of `BATCH x SEQ`, unclipped.
fn compile(model: &str, policy: &str, ranks: u32, k: u64, dtype: DType) -> VerifiedSchedule {
    compile_clipped(model, policy, ranks, k, dtype, None)
}

/// [`compile`] with gradients clipped to the global norm `clip`.
fn compile_clipped(
    model: &str,
    policy: &str,
    ranks: u32,
    k: u64,
    dtype: DType,
    clip: Option<f64>,
) -> VerifiedSchedule {
    compile_on(
        model,
        policy,
        ranks,
        k,
        dtype,
        clip,
        HardwareProfile::host(),
    )
    .unwrap_or_else(|e| panic!("{model} {policy} {ranks} ranks x {k}: {e}"))
}

/// [`compile_clipped`] on `hardware` (as threads of one process), or the compile error.
pub(crate) fn compile_on(
    model: &str,
    policy: &str,
    ranks: u32,
    k: u64,
    dtype: DType,
    clip: Option<f64>,
    hardware: HardwareProfile,
) -> protrain::Result<VerifiedSchedule> {
    let config = protrain::models::load(model).expect("preset");
    let options = CompileOptions {
        batch: BATCH,
        seq: SEQ,
        dtype,
        hardware: hardware.with_thread_ranks(ranks),
        policy: PolicyChoice::parse(policy).expect("a policy"),
        optimizer: OptimizerConfig {
            grad_clip: clip,
            ..OptimizerConfig::default()
        },
        micro_batches: k,
        topology: Topology {
            gpus: ranks,
            nodes: 1,
        },
        ..CompileOptions::default()
    };
    protrain::compile(&config, &options).map(|c| c.schedule)
}

/// Every step's loss bits, the final weights' bits and the final Adam state's bits.
type Run = (Vec<u32>, Vec<Vec<u32>>, Vec<(String, Vec<u32>)>);

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// What a run starts from: the seed-0 weights and zero moments at step 0, or a state read
/// back from another run (weights, moments, steps taken).
type Start = (Vec<Vec<f32>>, Option<Vec<(String, Vec<f32>)>>, u64);

/// Trains on every rank of `schedule` (threads) the steps `first..first + steps` of the
/// synthetic corpus, each rank its rows of each global batch, from `start`. Every rank must
/// report the same losses and gather the same weights and state; returns rank 0's, with the
/// state as floats for resuming.
fn train(schedule: &VerifiedSchedule, start: &Start, steps: usize) -> (Run, Start) {
    let ranks = schedule.ranks() as usize;
    let global = BATCH * u64::from(schedule.micro_batches_per_step()) * ranks as u64;
    let vocab = vocab_of(&schedule.graph).expect("a language model");
    let first = start.2 as usize;
    let batches = common::batches(vocab, global, SEQ, first + steps, 7);
    // A disk tier's files: one per rank, each removed with its executor.
    let dir = tempfile::tempdir().expect("a disk directory");
    let run = |comm: Option<Box<dyn Collective>>| -> (Run, Start) {
        let mut executor = Executor::new(schedule).expect("an executor");
        let rank = comm.as_ref().map_or(0, |c| c.rank());
        if let Some(comm) = comm {
            executor.set_collective(comm).expect("the group fits");
        }
        executor.set_disk_dir(dir.path()).expect("a disk file");
        executor.load_params(&start.0).expect("loads");
        if let Some(state) = &start.1 {
            executor.load_state(state).expect("loads the state");
            executor.set_step(start.2);
        }
        let mut losses = Vec::new();
        let k = schedule.micro_batches_per_step() as usize;
        let (mut ins, mut outs) = (Vec::new(), Vec::new());
        for [inputs, targets] in &batches[first..] {
            rank_rows(inputs, rank, ranks, k, &mut ins).expect("rows");
            rank_rows(targets, rank, ranks, k, &mut outs).expect("rows");
            let r = executor.step(&[&ins, &outs]).expect("a step");
            losses.push(r.loss.to_bits());
        }
        let weights = executor.params().expect("weights");
        let state = executor.state().expect("state");
        let run = (
            losses,
            weights.iter().map(|w| bits(w)).collect(),
            state.iter().map(|(n, s)| (n.clone(), bits(s))).collect(),
        );
        (run, (weights, Some(state), executor.steps_taken()))
    };
    if ranks == 1 {
        let out = run(None);
        assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0);
        return out;
    }
    let comms = thread_ranks(ranks, Duration::from_secs(60)).expect("a group");
    let runs: Vec<(Run, Start)> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| scope.spawn(move || run(Some(Box::new(c)))))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank"))
            .collect()
    });
    for (r, other) in runs.iter().enumerate().skip(1) {
        assert!(other.0 == runs[0].0, "rank {r} diverged from rank 0");
    }
    assert_eq!(
        std::fs::read_dir(dir.path()).expect("dir").count(),
        0,
        "every rank's disk file is removed with its executor"
    );
    runs.into_iter().next().expect("rank 0")
}

fn fresh(schedule: &VerifiedSchedule) -> Start {
    (init_params(&schedule.graph, 0), None, 0)
}

/// How many all-gathers and reduce-scatters the collective stream issues.
fn collectives(schedule: &VerifiedSchedule) -> (usize, usize) {
    let all = || schedule.streams.iter().flat_map(|s| &s.instrs);
    (
        all()
            .filter(|i| matches!(i, Instr::AllGather { .. }))
            .count(),
        all()
            .filter(|i| matches!(i, Instr::ReduceScatter { .. }))
            .count(),
    )
}

#[test]
fn sharded_ranks_train_as_one_rank_accumulating_their_micro_batches_bit_for_bit() {
    for (model, dtype) in [
        ("gpt2-tiny", DType::F32),
        ("llama-tiny", DType::F32),
        ("gpt2-tiny", DType::BF16),
    ] {
        for ranks in [2u32, 4] {
            let one = compile(model, TIGHT, 1, u64::from(ranks), dtype);
            let (single, _) = train(&one, &fresh(&one), 3);
            for policy in [TIGHT, ROOMY] {
                let what = format!("{model} {dtype} {policy} on {ranks} ranks");
                let schedule = compile(model, policy, ranks, 1, dtype);
                let (gathers, scatters) = collectives(&schedule);
                if policy == TIGHT {
                    // Every chunk is offloaded, so sharded: gathered for the forward and the
                    // backward pass, its gradients reduce-scattered once.
                    assert!(schedule.sharded(), "{what}");
                    assert_eq!(scatters, schedule.chunks.len(), "{what}");
                    assert!(gathers >= 2 * scatters - 1, "{what}: {gathers} gathers");
                    let whole = compile(model, policy, 1, u64::from(ranks), dtype);
                    assert!(
                        schedule.host_bytes * u64::from(ranks) < whole.host_bytes * 3 / 2,
                        "{what}: {} host bytes per rank against {} for one rank",
                        schedule.host_bytes,
                        whole.host_bytes
                    );
                }
                let (parallel, _) = train(&schedule, &fresh(&schedule), 3);
                assert_eq!(parallel.0, single.0, "{what}: losses");
                assert!(parallel.1 == single.1, "{what}: weights differ");
                assert!(parallel.2 == single.2, "{what}: Adam moments differ");
            }
        }
    }
}

/// How many `accumulate_grad` kernels the collective stream runs (each sums a micro-batch's
/// gradient over the ranks into its accumulator), and how many AdamW ops the schedule has.
fn accumulations_over_ranks(schedule: &VerifiedSchedule) -> (usize, usize) {
    let graph = &schedule.graph;
    let kernels = |collective: bool| {
        schedule
            .streams
            .iter()
            .filter(|s| matches!(s.kind, StreamKind::Collective { .. }) == collective)
            .flat_map(|s| &s.instrs)
            .filter_map(|i| match i {
                Instr::Kernel { op, .. } => Some(&graph.op(*op).kind),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let on_comm = kernels(true)
        .into_iter()
        .filter(|k| **k == OpKind::AccumulateGrad)
        .count();
    let adamws = graph
        .ops()
        .filter(|(_, o)| matches!(o.kind, OpKind::AdamW { .. }))
        .count();
    let local = kernels(false)
        .into_iter()
        .filter(|k| **k == OpKind::AccumulateGrad)
        .count();
    assert_eq!(local, 0, "an accumulate_grad off the collective stream");
    (on_comm, adamws)
}

/// The host bytes of `schedule`'s buffers that hold offloaded chunks' state: sharded (every
/// part of every shard, each rank's), whole (parameters, gradients, optimizer state), and
/// whole host accumulators.
fn host_state(schedule: &VerifiedSchedule) -> (u64, u64, u64) {
    let of = |f: fn(&BufferKind) -> bool| {
        schedule
            .buffers
            .iter()
            .filter(|b| b.space == protrain::ir::Space::Host && f(&b.kind))
            .map(|b| b.size)
            .sum()
    };
    (
        of(|k| matches!(k, BufferKind::HostShard { .. })),
        of(|k| {
            matches!(
                k,
                BufferKind::HostChunk { .. }
                    | BufferKind::HostGradChunk { .. }
                    | BufferKind::OptimizerState { .. }
            )
        }),
        of(|k| matches!(k, BufferKind::Accumulators)),
    )
}

/// W ranks of A micro-batches each, for W in {2, 4} and A in {2, 3}, gpt2-tiny and
/// llama-tiny, f32 and bf16, clipped and not, under the tight policy (every chunk offloaded,
/// so sharded) and the roomy one: the losses, weights and Adam moments of one rank
/// accumulating W x A micro-batches, bit for bit. Rank r's micro-batch m reads global
/// micro-batch m x W + r, and each micro-batch's gradients are summed over the ranks in rank
/// order into the accumulators (a sharded chunk's straight from the device into the part
/// each rank holds), so the ranks add the global micro-batches' gradients one by one in
/// their order, as the single rank does. Each rank holds 1/W of the sharded chunks' host
/// state, and unclipped 1/W of their accumulators too (they are the gradient shards: no
/// whole host accumulator); clipped, the accumulators stay whole so that every squared norm
/// reads a whole sum.
///
/// Mutations that fail it: the host backend's sharded sum adding the ranks' sum to the
/// accumulator (`acc + (g0 + g1)`: the fold in `reduce_part_into` starting from rank 0's
/// gradient, `acc` added last): gpt2-tiny f32 on 2 x 2, the weights differ; the accumulate
/// pass laying a sharded chunk's accumulators out whole (`Laid::Appended` for every
/// accumulator): the whole-accumulators assertion.
#[test]
fn sharded_ranks_of_several_micro_batches_train_as_one_rank_of_w_x_a_bit_for_bit() {
    for model in ["gpt2-tiny", "llama-tiny"] {
        for dtype in [DType::F32, DType::BF16] {
            for clip in [None, Some(0.05)] {
                let mut singles: Vec<(u64, VerifiedSchedule, Run)> = Vec::new();
                for (ranks, a) in [(2u32, 2u64), (2, 3), (4, 2), (4, 3)] {
                    let all = u64::from(ranks) * a;
                    if !singles.iter().any(|(k, _, _)| *k == all) {
                        let one = compile_clipped(model, TIGHT, 1, all, dtype, clip);
                        let run = train(&one, &fresh(&one), 3).0;
                        singles.push((all, one, run));
                    }
                    let (_, one, single) = singles.iter().find(|(k, _, _)| *k == all).expect("run");
                    for policy in [TIGHT, ROOMY] {
                        let what =
                            format!("{model} {dtype} clip {clip:?} {policy}: {ranks} ranks x {a}");
                        let schedule = compile_clipped(model, policy, ranks, a, dtype, clip);
                        let (on_comm, adamws) = accumulations_over_ranks(&schedule);
                        assert_eq!(on_comm, adamws, "{what}");
                        if policy == TIGHT {
                            assert!(schedule.sharded(), "{what}");
                            let (shards, unsharded, accumulators) = host_state(&schedule);
                            let (_, state, whole) = host_state(one);
                            assert_eq!(unsharded, 0, "{what}: whole state on a rank");
                            match clip {
                                // The accumulators are the gradient shards.
                                None => {
                                    assert_eq!(accumulators, 0, "{what}: whole accumulators");
                                    assert!(
                                        schedule.host_bytes * u64::from(ranks)
                                            < one.host_bytes * 3 / 2,
                                        "{what}: {} host bytes per rank against {} for one rank",
                                        schedule.host_bytes,
                                        one.host_bytes
                                    );
                                }
                                Some(_) => assert_eq!(accumulators, whole, "{what}"),
                            }
                            // The sharded state is 1/W of one rank's (padding aside).
                            assert!(
                                shards * u64::from(ranks) <= state + state / 8
                                    && shards * u64::from(ranks) * 8 >= state * 7,
                                "{what}: {shards} sharded bytes per rank of a {state}-byte state"
                            );
                        }
                        let (parallel, _) = train(&schedule, &fresh(&schedule), 3);
                        assert_eq!(parallel.0, single.0, "{what}: losses");
                        assert!(parallel.1 == single.1, "{what}: weights differ");
                        assert!(parallel.2 == single.2, "{what}: Adam moments differ");
                    }
                }
            }
        }
    }
}

/// Clipping (and f16's loss scaling) reads the global gradient norm: sharded ranks sum the
/// sharded chunks' gradients whole (all-reduce) so each squared norm reads the whole sum,
/// and still keep 1/W of the host state each; they train bit for bit as one rank
/// accumulating their micro-batches. A clip of 0.05 clips every step of these models.
#[test]
fn clipped_sharded_ranks_train_as_one_rank_accumulating_bit_for_bit() {
    for (model, dtype) in [
        ("gpt2-tiny", DType::F32),
        ("llama-tiny", DType::F32),
        ("gpt2-tiny", DType::BF16),
        ("llama-tiny", DType::BF16),
        ("gpt2-tiny", DType::F16),
    ] {
        for ranks in [2u32, 4] {
            let what = format!("{model} {dtype} clipped on {ranks} ranks");
            let clip = Some(0.05);
            let one = compile_clipped(model, TIGHT, 1, u64::from(ranks), dtype, clip);
            let (single, _) = train(&one, &fresh(&one), 3);
            let schedule = compile_clipped(model, TIGHT, ranks, 1, dtype, clip);
            assert!(schedule.sharded(), "{what}");
            let (gathers, scatters) = collectives(&schedule);
            assert_eq!(scatters, 0, "{what}: the gradients are all-reduced whole");
            assert!(gathers >= 2 * schedule.chunks.len() - 1, "{what}");
            assert!(
                schedule.host_bytes * u64::from(ranks) < one.host_bytes * 3 / 2,
                "{what}: {} host bytes per rank against {} for one rank",
                schedule.host_bytes,
                one.host_bytes
            );
            let (parallel, _) = train(&schedule, &fresh(&schedule), 3);
            assert_eq!(parallel.0, single.0, "{what}: losses");
            assert!(parallel.1 == single.1, "{what}: weights differ");
            assert!(parallel.2 == single.2, "{what}: Adam moments differ");
            // The clip changed the run: unclipped, the weights differ.
            let free = compile(model, TIGHT, ranks, 1, dtype);
            let (unclipped, _) = train(&free, &fresh(&free), 3);
            assert!(unclipped.1 != parallel.1, "{what}: the clip never bit");
        }
    }
}

/// Chunks whose size does not split into `W` slices of whole words are padded at their end
/// and sharded all the same: `W` ranks (the fewest, from 3, that do not split the model's
/// chunks evenly) train bit for bit as one rank accumulating `W` micro-batches, clipped or
/// not.
#[test]
fn chunks_that_do_not_split_evenly_are_padded_and_sharded_bit_for_bit() {
    for (model, dtype) in [("gpt2-tiny", DType::F32), ("llama-tiny", DType::BF16)] {
        let chunk_bytes = compile(model, TIGHT, 1, 1, dtype).chunks.chunk_bytes;
        let ranks = (3u32..=8)
            .find(|&w| !chunk_bytes.is_multiple_of(4 * u64::from(w)))
            .expect("a rank count that does not split the chunks");
        for clip in [None, Some(0.05)] {
            let what = format!("{model} {dtype} clip {clip:?} on {ranks} ranks");
            let one = compile_clipped(model, TIGHT, 1, u64::from(ranks), dtype, clip);
            assert_eq!(one.chunks.chunk_bytes, chunk_bytes, "{what}");
            let (single, _) = train(&one, &fresh(&one), 3);
            let schedule = compile_clipped(model, TIGHT, ranks, 1, dtype, clip);
            assert!(schedule.sharded(), "{what}");
            let padded = schedule.chunks.chunk_bytes;
            let words = 4 * u64::from(ranks);
            assert!(padded.is_multiple_of(words), "{what}: {padded} bytes");
            assert!(
                padded > chunk_bytes && padded < chunk_bytes + words,
                "{what}: {chunk_bytes} bytes padded to {padded}"
            );
            let (parallel, _) = train(&schedule, &fresh(&schedule), 3);
            assert_eq!(parallel.0, single.0, "{what}: losses");
            assert!(parallel.1 == single.1, "{what}: weights differ");
            assert!(parallel.2 == single.2, "{what}: Adam moments differ");
        }
    }
}

/// Sharding composes with the 14-byte host layout: each rank's slice of a chunk's summed
/// bf16 gradients lands in its parameter shard after the chunk's last upload (no gradient
/// shard), so a rank keeps 14 bytes per offloaded parameter over W; the ranks still train bit
/// for bit as one rank accumulating their micro-batches (in the full layout, as accumulation
/// always is), clipped or not.
#[test]
fn sharded_ranks_in_the_14_byte_layout_train_as_one_rank_accumulating_bit_for_bit() {
    let lean = "n_persist=0 n_buffer=2 n_swap=1 n_checkpoint=1 host_layout=14";
    let full = "n_persist=0 n_buffer=2 n_swap=1 n_checkpoint=1";
    for model in ["gpt2-tiny", "llama-tiny"] {
        for ranks in [2u32, 4] {
            for clip in [None, Some(0.05)] {
                let what = format!("{model} bf16 clip {clip:?} on {ranks} ranks, 14 bytes");
                let dtype = DType::BF16;
                let one = compile_clipped(model, full, 1, u64::from(ranks), dtype, clip);
                let (single, _) = train(&one, &fresh(&one), 3);
                let schedule = compile_clipped(model, lean, ranks, 1, dtype, clip);
                let wide = compile_clipped(model, full, ranks, 1, dtype, clip);
                assert!(schedule.sharded(), "{what}");
                let grad_shards = |s: &VerifiedSchedule| {
                    s.buffers
                        .iter()
                        .filter(|b| {
                            matches!(
                                b.kind,
                                BufferKind::HostShard {
                                    part: ShardPart::Grads,
                                    ..
                                }
                            )
                        })
                        .count()
                };
                assert_eq!(grad_shards(&schedule), 0, "{what}: gradient shards");
                assert_eq!(grad_shards(&wide), schedule.chunks.len(), "{what}");
                // Each rank saves its slice of every chunk's gradients: 2 of 16 bytes.
                let saved = wide.host_bytes - schedule.host_bytes;
                let slice = schedule.chunks.chunk_bytes / u64::from(ranks);
                assert!(
                    saved >= slice * schedule.chunks.len() as u64,
                    "{what}: {} host bytes against {} in the full layout",
                    schedule.host_bytes,
                    wide.host_bytes
                );
                let (parallel, _) = train(&schedule, &fresh(&schedule), 3);
                assert_eq!(parallel.0, single.0, "{what}: losses");
                assert!(parallel.1 == single.1, "{what}: weights differ");
                assert!(parallel.2 == single.2, "{what}: Adam moments differ");
            }
        }
    }
}

/// The mutation: chunk 0's parameter shard uploaded once more at the end of the step, after
/// each rank's slice of its gradients landed in that shard (14-byte layout). The verifier
/// refuses it as a fetch that reads gradients where parameters must be; the schedule it was
/// made from verifies.
#[test]
fn a_shard_upload_after_the_gradients_landed_in_it_is_refused() {
    let lean = "n_persist=0 n_buffer=2 n_swap=1 n_checkpoint=1 host_layout=14";
    let schedule: Schedule = (*compile("gpt2-tiny", lean, 2, 1, DType::BF16)).clone();
    let mutated = common::upload_chunk0_after_its_gradient_offload(&schedule);
    let err = verify(mutated)
        .expect_err("an upload after the gradient offload")
        .to_string();
    assert!(err.contains("data flow"), "{err}");
    assert!(
        err.contains("fetch chunk0") && err.contains("landed in the parameter storage"),
        "the refusal names the upload and the gradients in its storage: {err}"
    );
    verify(schedule).expect("the schedule it was made from verifies");
}

/// The weights and Adam moments read from 4 sharded ranks (gathered from their shards) resume
/// on 2 ranks accumulating 2 micro-batches each, on 1 rank accumulating 4 and on 4 again:
/// the losses and final state of an uninterrupted 4-rank run, bit for bit (the 2 ranks sum
/// each micro-batch's gradients into their accumulators in rank order, the global
/// micro-batches' order).
#[test]
fn a_sharded_state_resumes_on_another_number_of_ranks_as_if_uninterrupted() {
    let four = compile("gpt2-tiny", TIGHT, 4, 1, DType::F32);
    let (whole, _) = train(&four, &fresh(&four), 4);
    let (first, state) = train(&four, &fresh(&four), 2);
    assert_eq!(first.0, whole.0[..2]);
    for (ranks, k) in [(2u32, 2u64), (1, 4), (4, 1)] {
        let schedule = compile("gpt2-tiny", TIGHT, ranks, k, DType::F32);
        if ranks == 2 {
            assert!(schedule.micro_batches() == 2 && schedule.sharded());
        }
        let (rest, _) = train(&schedule, &state, 2);
        let what = format!("resumed on {ranks} ranks x {k}");
        assert_eq!(rest.0, whole.0[2..], "{what}: losses");
        assert!(rest.1 == whole.1, "{what}: weights");
        assert!(rest.2 == whole.2, "{what}: moments");
    }
}

/// Two sharded ranks of the tight policy resume on 2 sharded ranks of the roomy one (its
/// chunks persistent and replicated) bit for bit: where the state lives does not change it.
#[test]
fn a_sharded_state_resumes_under_another_policy_bit_for_bit() {
    let tight = compile("gpt2-tiny", TIGHT, 2, 1, DType::F32);
    let roomy = compile("gpt2-tiny", ROOMY, 2, 1, DType::F32);
    let (whole, _) = train(&tight, &fresh(&tight), 4);
    let (_, state) = train(&tight, &fresh(&tight), 2);
    let (rest, _) = train(&roomy, &state, 2);
    assert_eq!(rest.0, whole.0[2..]);
    assert!(rest.1 == whole.1 && rest.2 == whole.2);
}

/// 4 sharded ranks of 2 micro-batches each: the weights and Adam moments they gather resume
/// on 2 sharded ranks of 4 micro-batches, on 1 rank of 8 and on 4 x 2 again, bit for bit as
/// the uninterrupted run (every layout sums the global micro-batches' gradients in their
/// order).
#[test]
fn a_sharded_accumulating_state_resumes_on_another_number_of_ranks_as_if_uninterrupted() {
    for dtype in [DType::F32, DType::BF16] {
        let four = compile("gpt2-tiny", TIGHT, 4, 2, dtype);
        assert!(four.sharded() && four.micro_batches() == 2);
        let (whole, _) = train(&four, &fresh(&four), 4);
        let (first, state) = train(&four, &fresh(&four), 2);
        assert_eq!(first.0, whole.0[..2]);
        for (ranks, k) in [(2u32, 4u64), (1, 8), (4, 2)] {
            let schedule = compile("gpt2-tiny", TIGHT, ranks, k, dtype);
            assert_eq!(schedule.sharded(), ranks > 1);
            let (rest, _) = train(&schedule, &state, 2);
            let what = format!("{dtype} resumed on {ranks} ranks x {k}");
            assert_eq!(rest.0, whole.0[2..], "{what}: losses");
            assert!(rest.1 == whole.1, "{what}: weights");
            assert!(rest.2 == whole.2, "{what}: moments");
        }
    }
}

/// The mutation: in a sharded schedule of 2 micro-batches per rank, the collective stream's
/// first sum of a sharded chunk's gradient into the ranks' accumulator shards moved to the
/// start of the stream, before any wait. The verifier refuses it (the sum would read the
/// gradient before the backward pass writes it); the schedule it was made from verifies.
#[test]
fn a_sharded_sum_before_its_gradient_is_written_is_refused() {
    let schedule: Schedule = (*compile("gpt2-tiny", TIGHT, 2, 2, DType::F32)).clone();
    let mut mutated = schedule.clone();
    let comm = mutated
        .streams
        .iter_mut()
        .find(|s| matches!(s.kind, StreamKind::Collective { .. }))
        .expect("a collective stream");
    let buffers = &schedule.buffers;
    let at = comm
        .instrs
        .iter()
        .position(|i| match i {
            Instr::Kernel { inputs, .. } => {
                matches!(
                    buffers[inputs[0].buffer.index()].kind,
                    BufferKind::HostShard {
                        part: ShardPart::Grads,
                        ..
                    }
                ) && buffers[inputs[1].buffer.index()].space == protrain::ir::Space::Device
            }
            _ => false,
        })
        .expect("a sum into a gradient shard, from the device");
    assert!(
        matches!(comm.instrs[at - 1], Instr::Wait { .. }),
        "the sum waits for its trigger"
    );
    let sum = comm.instrs.remove(at);
    comm.instrs.insert(0, sum);
    let err = verify(mutated)
        .expect_err("a sum before its gradient")
        .to_string();
    assert!(err.contains("data flow"), "{err}");
    assert!(
        err.contains("accumulate_grad"),
        "the refusal names the sum: {err}"
    );
    verify(schedule).expect("the schedule it was made from verifies");
}

/// The simulator prices a sharded chunk's sum into the ranks' accumulator shards as what it
/// moves: a reduce-scatter of the gradient over the interconnect plus the copy of the rank's
/// `1/W` of it to the host (a replicated accumulator's sum is an all-reduce), on 4 ranks of
/// a100-80gb accumulating 2 micro-batches.
///
/// Mutation that fails it: pricing every sum on the collective stream as an all-reduce of its
/// bytes (what `instr_seconds` did before sharded accumulation).
#[test]
fn the_simulator_prices_a_sharded_sum_as_a_reduce_scatter_and_the_ranks_copy() {
    use protrain::compiler::comm::CollectiveKind;
    use protrain::compiler::cost::{cost_model, CopyDir};
    use protrain::compiler::simulate::instr_seconds;
    let config = protrain::models::load("gpt2-tiny").expect("preset");
    let hardware = HardwareProfile::preset("a100-80gb").expect("a preset");
    let topology = Topology { gpus: 4, nodes: 1 };
    let options = CompileOptions {
        batch: BATCH,
        seq: SEQ,
        policy: PolicyChoice::parse(TIGHT).expect("a policy"),
        micro_batches: 2,
        topology,
        ..CompileOptions::for_hardware(hardware.clone())
    };
    let schedule = protrain::compile(&config, &options)
        .expect("compiles")
        .schedule;
    assert!(schedule.sharded());
    let cost = cost_model(&hardware);
    let mut priced = 0;
    for (s, stream) in schedule.streams.iter().enumerate() {
        for instr in &stream.instrs {
            let Instr::Kernel { op, inputs, .. } = instr else {
                continue;
            };
            let sharded = matches!(
                schedule.buffer(inputs[0].buffer).kind,
                BufferKind::HostShard { .. }
            );
            if schedule.graph.op(*op).kind != OpKind::AccumulateGrad || !sharded {
                continue;
            }
            let bytes = schedule
                .graph
                .value(schedule.graph.op(*op).inputs[0])
                .ty
                .bytes();
            let expected = cost.collective_seconds(CollectiveKind::ReduceScatter, bytes, topology)
                + cost.copy_seconds(bytes.div_ceil(4), CopyDir::DeviceToHost);
            let got = instr_seconds(
                &schedule,
                protrain::ir::StreamId::new(s),
                instr,
                cost.as_ref(),
            );
            assert!(
                (got - expected).abs() <= 1e-9 * expected && expected > 0.0,
                "{}: {got} s, not {expected} s",
                schedule.graph.value(schedule.graph.op(*op).inputs[0]).name
            );
            priced += 1;
        }
    }
    assert!(priced > 0, "no sharded sum");
}

/// The host memory of a node of `ranks` ranks that leaves each rank the least host region
/// the disk tier can give `schedule` with its optimizer state alone on disk (every
/// offloaded chunk's optimizer state shards), with the disk it takes per rank.
pub(crate) fn least_on_disk(schedule: &VerifiedSchedule, ranks: u32) -> (u64, u64) {
    let (host, disk) =
        protrain::compiler::disk::least_host_for_state(schedule).expect("the disk tier applies");
    (host * u64::from(ranks), disk)
}

/// The bytes of each rank's shards of the optimizer state of every offloaded chunk (moments
/// and master weights), each at the next 4 KiB of the disk region, as the tier lays them out.
fn state_shard_bytes(schedule: &Schedule) -> u64 {
    schedule
        .buffers
        .iter()
        .filter(|b| {
            matches!(
                b.kind,
                BufferKind::HostShard {
                    part: ShardPart::AdamM | ShardPart::AdamV | ShardPart::Master,
                    ..
                }
            )
        })
        .fold(0, |end, b| end.next_multiple_of(4096) + b.size)
}

/// Two sharded ranks whose node's host memory holds only what the disk tier leaves: each
/// rank keeps its shards of every chunk's Adam moments (and bf16 master weights) in its own
/// disk file, read into sharded staging buffers before its CPU Adam and written back after.
/// They train bit for bit as the same ranks with everything in host memory and as one rank
/// accumulating their micro-batches, in f32 and bf16, clipped (the global norm) or not; each
/// rank's disk region is its shards' bytes, and the node's host memory is what was given.
#[test]
fn sharded_ranks_with_their_state_on_disk_train_as_in_host_memory_bit_for_bit() {
    for (model, dtype, clip) in [
        ("gpt2-tiny", DType::F32, None),
        ("llama-tiny", DType::BF16, Some(0.05)),
    ] {
        let ranks = 2u32;
        let what = format!("{model} {dtype} clip {clip:?} on {ranks} ranks");
        let memory = compile_clipped(model, TIGHT, ranks, 1, dtype, clip);
        assert!(memory.sharded() && memory.disk_bytes == 0, "{what}");
        let (node_host, disk) = least_on_disk(&memory, ranks);
        let hardware = HardwareProfile::host()
            .with_host_memory(node_host)
            .with_disk_memory(u64::from(ranks) * disk);
        let on_disk = compile_on(model, TIGHT, ranks, 1, dtype, clip, hardware)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(
            on_disk.disk_chunks().len(),
            on_disk.chunks.len(),
            "{what}: every chunk's state shards on disk"
        );
        assert_eq!(on_disk.disk_bytes, state_shard_bytes(&memory), "{what}");
        assert_eq!(on_disk.disk_bytes, disk, "{what}");
        assert!(
            on_disk.host_bytes * u64::from(ranks) <= node_host
                && on_disk.host_bytes < memory.host_bytes,
            "{what}: {} host bytes a rank against {} in memory",
            on_disk.host_bytes,
            memory.host_bytes
        );
        let one = compile_clipped(model, TIGHT, 1, u64::from(ranks), dtype, clip);
        trains_as_in_memory_and_one_rank(&what, &on_disk, &memory, &one);
    }
}

/// Three steps of `on_disk` give the losses, weights and Adam moments of three of `memory`
/// (the same ranks in host memory) and of `one` (one rank accumulating their micro-batches),
/// bit for bit.
fn trains_as_in_memory_and_one_rank(
    what: &str,
    on_disk: &VerifiedSchedule,
    memory: &VerifiedSchedule,
    one: &VerifiedSchedule,
) {
    let (single, _) = train(one, &fresh(one), 3);
    let (in_memory, _) = train(memory, &fresh(memory), 3);
    let (disk_run, _) = train(on_disk, &fresh(on_disk), 3);
    assert_eq!(in_memory.0, single.0, "{what}: losses in memory");
    assert_eq!(disk_run.0, in_memory.0, "{what}: losses");
    assert!(disk_run.1 == in_memory.1, "{what}: weights differ");
    assert!(disk_run.2 == in_memory.2, "{what}: Adam moments differ");
    assert!(
        disk_run.1 == single.1,
        "{what}: weights differ from one rank"
    );
    assert!(
        disk_run.2 == single.2,
        "{what}: moments differ from one rank"
    );
}

/// A sharded schedule over its host budget compiles with the fewest chunks' state shards on
/// disk that bring each rank within it (here each rank's share is 200 KiB under what it
/// needs in host memory); the
/// schedule verifies, its disk region per rank is those chunks' shards (each at the next
/// 4 KiB), and its disk reads and writes move one rank's shard each.
#[test]
fn a_sharded_schedule_over_its_host_budget_compiles_with_its_shards_on_disk() {
    let (model, dtype, ranks) = ("gpt2-tiny", DType::BF16, 2u32);
    let memory = compile_clipped(model, TIGHT, ranks, 1, dtype, None);
    let (_, disk) = least_on_disk(&memory, ranks);
    let node_host = u64::from(ranks) * (memory.host_bytes - (200 << 10));
    let hardware = HardwareProfile::host()
        .with_host_memory(node_host)
        .with_disk_memory(u64::from(ranks) * disk);
    let schedule = compile_on(model, TIGHT, ranks, 1, dtype, None, hardware).expect("compiles");
    let verified = verify((*schedule).clone()).expect("verifies");
    let moved = verified.disk_chunks();
    assert!(
        !moved.is_empty() && moved.len() <= verified.chunks.len(),
        "{} of {} chunks' state on disk",
        moved.len(),
        verified.chunks.len()
    );
    assert!(verified.host_bytes * u64::from(ranks) <= node_host);
    let on_disk: Vec<&protrain::ir::Buffer> = verified
        .buffers
        .iter()
        .filter(|b| b.space == protrain::ir::Space::Disk)
        .collect();
    let want = on_disk
        .iter()
        .fold(0, |end: u64, b| end.next_multiple_of(4096) + b.size);
    assert_eq!(verified.disk_bytes, want);
    // Moments and master weights of each moved chunk, 1/ranks of its state each.
    assert_eq!(on_disk.len(), 3 * moved.len());
    let shard = verified.chunks.chunk_bytes / u64::from(ranks);
    for b in &on_disk {
        assert!(matches!(b.kind, BufferKind::HostShard { .. }), "{}", b.name);
        assert_eq!(b.size, 2 * shard, "{}: f32 of a bf16 shard", b.name);
    }
    let transfers = verified
        .streams
        .iter()
        .flat_map(|s| &s.instrs)
        .filter_map(|i| match i {
            Instr::DiskRead { bytes, .. } | Instr::DiskWrite { bytes, .. } => Some(*bytes),
            _ => None,
        })
        .collect::<Vec<_>>();
    assert_eq!(transfers.len(), 2 * on_disk.len());
    assert!(transfers.iter().all(|&b| b == 2 * shard));
}

/// What the disk tier still refuses on sharded ranks: a host budget below what every
/// chunk's shards on disk leave (its optimizer state, parameters and gradients: staging
/// buffers and activations stay in host memory). The error names the need per rank and
/// the ways out.
#[test]
fn sharded_ranks_over_host_memory_with_every_state_shard_on_disk_are_refused() {
    let (model, dtype, ranks) = ("gpt2-tiny", DType::F32, 2u32);
    let memory = compile_clipped(model, TIGHT, ranks, 1, dtype, None);
    let (least, disk) = least_with_storage_on_disk(&memory, ranks).expect("storage moves");
    let hardware = HardwareProfile::host()
        .with_host_memory(least - 4096)
        .with_disk_memory(u64::from(ranks) * disk * 4);
    let err = compile_on(model, TIGHT, ranks, 1, dtype, None, hardware)
        .expect_err("over budget")
        .to_string();
    for needle in [
        "of the optimizer state, parameters and gradients of all 4 offloaded chunks on disk",
        "give more --host-memory",
        "(--nodes M, each node keeping 1/M of the shards)",
        "run fewer ranks on a node (--gpus N)",
    ] {
        assert!(err.contains(needle), "no `{needle}` in: {err}");
    }
}

/// The kernels of `op` on the collective stream and off it.
fn kernels_of(schedule: &VerifiedSchedule, op: &OpKind) -> (usize, usize) {
    let mut counts = (0, 0);
    for stream in &schedule.streams {
        let comm = matches!(stream.kind, StreamKind::Collective { .. });
        for instr in &stream.instrs {
            if let Instr::Kernel { op: o, .. } = instr {
                if schedule.graph.op(*o).kind == *op {
                    match comm {
                        true => counts.0 += 1,
                        false => counts.1 += 1,
                    }
                }
            }
        }
    }
    counts
}

/// Two ranks of 4 micro-batches each in the chunk-major order (every micro-batch through a
/// chunk while it is resident), gpt2-tiny in f32 and llama-tiny in bf16, under a tight
/// policy (every chunk offloaded, so sharded, through three buffers: a layer of these models
/// reads up to three chunks, and fewer buffers than that gather them again per micro-batch) and the roomy one (replicated): the losses,
/// weights and Adam moments of the same ranks in the sequential order and of one rank
/// accumulating all 8 micro-batches, bit for bit. Each rank gathers a sharded chunk once per
/// pass per step, as one micro-batch does (the sequential order's micro-batch program
/// gathers it once per pass per micro-batch), with no reduce-scatter: the first
/// micro-batch's gradients are all-reduced and every later one is summed over the ranks into
/// the running sum by its add on the collective stream, in the global micro-batches' order.
///
/// Mutation that fails it: summing the ranks' gradients once after the last micro-batch
/// (`data_parallel` all-reducing a chunk-major schedule's sums as one micro-batch's, the
/// adds left on the compute stream): no add on the collective stream.
const TIGHT_THREE_BUFFERS: &str = "n_persist=0 n_buffer=3 n_swap=1 n_checkpoint=1";

#[test]
fn chunk_major_sharded_ranks_train_as_sequential_and_one_rank_bit_for_bit() {
    let (ranks, a) = (2u32, 4u64);
    for (model, dtype) in [("gpt2-tiny", DType::F32), ("llama-tiny", DType::BF16)] {
        let one = compile(model, TIGHT, 1, u64::from(ranks) * a, dtype);
        let (single, _) = train(&one, &fresh(&one), 3);
        for policy in [TIGHT_THREE_BUFFERS, ROOMY] {
            let what = format!("{model} {dtype} {policy}: {ranks} ranks x {a} chunk-major");
            let sequential = compile(model, policy, ranks, a, dtype);
            let chunk_major = compile(
                model,
                &format!("{policy} order=chunk-major"),
                ranks,
                a,
                dtype,
            );
            assert!(chunk_major.is_chunk_major(), "{what}");
            assert_eq!(chunk_major.micro_batches_per_step(), a as u32, "{what}");
            let adamws = chunk_major
                .graph
                .ops()
                .filter(|(_, o)| matches!(o.kind, OpKind::AdamW { .. }))
                .count();
            assert_eq!(
                kernels_of(&chunk_major, &OpKind::Add).0,
                adamws * (a as usize - 1),
                "{what}: an add over the ranks per gradient per later micro-batch"
            );
            let all_reduces = chunk_major
                .streams
                .iter()
                .flat_map(|s| &s.instrs)
                .filter(|i| matches!(i, Instr::AllReduce { .. }))
                .count();
            assert_eq!(all_reduces, adamws, "{what}: the first micro-batch's sums");
            if policy == TIGHT_THREE_BUFFERS {
                assert!(chunk_major.sharded(), "{what}");
                let once = compile(model, policy, ranks, 1, dtype);
                let (gathers, scatters) = collectives(&chunk_major);
                assert_eq!(gathers, collectives(&once).0, "{what}: gathers per step");
                assert_eq!(scatters, 0, "{what}: reduce-scatters");
                // The sequential order's micro-batch program gathers as often, per micro-batch.
                assert_eq!(sequential.micro_batches(), a as u32, "{what}");
                assert_eq!(collectives(&sequential).0, gathers, "{what}");
            }
            let (in_order, _) = train(&sequential, &fresh(&sequential), 3);
            let (interleaved, _) = train(&chunk_major, &fresh(&chunk_major), 3);
            assert_eq!(in_order.0, single.0, "{what}: sequential losses");
            assert_eq!(interleaved.0, in_order.0, "{what}: losses");
            assert!(interleaved.1 == in_order.1, "{what}: weights differ");
            assert!(interleaved.2 == in_order.2, "{what}: Adam moments differ");
            assert!(
                interleaved.1 == single.1,
                "{what}: weights differ from one rank"
            );
            assert!(
                interleaved.2 == single.2,
                "{what}: moments differ from one rank"
            );
        }
    }
}

/// The host memory of a node of `ranks` ranks that leaves each rank the least host region
/// the disk tier can give `schedule` with every model state it can move on disk (each
/// rank's shards of the optimizer state, parameters and gradients), with the disk it takes
/// per rank; `None` where moving storage leaves no less than the state alone.
pub(crate) fn least_with_storage_on_disk(
    schedule: &VerifiedSchedule,
    ranks: u32,
) -> Option<(u64, u64)> {
    let (host, disk) = protrain::compiler::disk::least_host(schedule)?;
    let (state_only, _) = protrain::compiler::disk::least_host_for_state(schedule)?;
    (host < state_only).then_some((host * u64::from(ranks), disk))
}

/// The chunks whose parameter shards and whose gradient shards are on disk, and the uploads
/// (shard fetches) that read a sharded staging buffer of parameters, in `schedule`.
pub(crate) fn storage_shards_on_disk(
    schedule: &Schedule,
) -> (
    Vec<protrain::ir::ChunkId>,
    Vec<protrain::ir::ChunkId>,
    usize,
) {
    let on_disk = |want: ShardPart| {
        schedule
            .buffers
            .iter()
            .filter(|b| b.space == protrain::ir::Space::Disk)
            .filter_map(|b| match b.kind {
                BufferKind::HostShard { chunk, part } if part == want => Some(chunk),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let staged_uploads = schedule
        .streams
        .iter()
        .flat_map(|s| &s.instrs)
        .filter(|i| match i {
            Instr::CopyShard {
                what: protrain::ir::CopyKind::FetchChunk { .. },
                src,
                ..
            } => matches!(
                schedule.buffer(src.buffer).kind,
                BufferKind::ShardStaging {
                    part: ShardPart::Params,
                    ..
                }
            ),
            _ => false,
        })
        .count();
    (
        on_disk(ShardPart::Params),
        on_disk(ShardPart::Grads),
        staged_uploads,
    )
}

/// Two sharded ranks with each rank's parameter and gradient shards on its disk file too
/// (read before each upload, written after each gradient offload, read and written around
/// the CPU Adam), beside its optimizer state shards. gpt2-tiny in f32 gets there by its host
/// budget: the node's host memory is the least the disk tier can leave, below what the
/// state alone on disk leaves, and the search's disk pass moves the storage (its 4 chunks'
/// shards outweigh the staging rings). llama-tiny's 2 chunks' shards weigh no more than
/// their rings, so no budget makes the pass move them: it takes the tier at its most
/// ([`every_state`](protrain::compiler::disk::every_state)), in the 16-byte layout
/// (gradient shards of their own) and the 14-byte one (gradients offloaded into the
/// parameter shards), with the gradient norm clipped. The schedule says what moved (every
/// chunk's parameter shards on disk, gradient shards where they move, every upload from a
/// sharded staging buffer) and the ranks train bit for bit as the same ranks in host memory
/// and as one rank accumulating their micro-batches.
#[test]
fn sharded_ranks_with_their_parameters_and_gradients_on_disk_train_as_in_host_memory() {
    let ranks = 2u32;
    let lean = format!("{TIGHT} host_layout=14");
    for (model, dtype, clip, policy, by_budget) in [
        ("gpt2-tiny", DType::F32, None, TIGHT, true),
        ("llama-tiny", DType::BF16, Some(0.05), TIGHT, false),
        ("llama-tiny", DType::BF16, Some(0.05), lean.as_str(), false),
    ] {
        let what = format!("{model} {dtype} clip {clip:?} {policy} on {ranks} ranks");
        let memory = compile_on(
            model,
            policy,
            ranks,
            1,
            dtype,
            clip,
            HardwareProfile::host(),
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        let on_disk = match by_budget {
            true => {
                let (node_host, disk) = least_with_storage_on_disk(&memory, ranks)
                    .unwrap_or_else(|| panic!("{what}: moving storage saves host memory"));
                let hardware = HardwareProfile::host()
                    .with_host_memory(node_host)
                    .with_disk_memory(u64::from(ranks) * disk);
                let on_disk = compile_on(model, policy, ranks, 1, dtype, clip, hardware)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(on_disk.disk_bytes, disk, "{what}: the disk region is exact");
                let (state_only, _) = least_on_disk(&memory, ranks);
                assert!(
                    on_disk.host_bytes * u64::from(ranks) <= node_host && node_host < state_only,
                    "{what}: {} host bytes a rank, {node_host} a node, {state_only} with the \
                     state alone on disk",
                    on_disk.host_bytes
                );
                on_disk
            }
            false => {
                let most = protrain::compiler::disk::every_state((*memory).clone(), 1)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                verify(most).unwrap_or_else(|e| panic!("{what}: {e}"))
            }
        };
        let chunks = on_disk.chunks.len();
        assert_eq!(on_disk.disk_chunks().len(), chunks, "{what}: state shards");
        let (params, grads, staged_uploads) = storage_shards_on_disk(&on_disk);
        assert_eq!(params.len(), chunks, "{what}: parameter shards on disk");
        let own_grads = on_disk.buffers.iter().any(|b| {
            matches!(
                b.kind,
                BufferKind::HostShard {
                    part: ShardPart::Grads,
                    ..
                }
            )
        });
        assert_eq!(
            !grads.is_empty(),
            own_grads,
            "{what}: gradient shards on disk"
        );
        let uploads = on_disk
            .streams
            .iter()
            .flat_map(|s| &s.instrs)
            .filter(|i| {
                matches!(
                    i,
                    Instr::CopyShard {
                        what: protrain::ir::CopyKind::FetchChunk { .. },
                        ..
                    }
                )
            })
            .count();
        assert_eq!(staged_uploads, uploads, "{what}: every upload staged");
        let one = compile_clipped(model, TIGHT, 1, u64::from(ranks), dtype, clip);
        trains_as_in_memory_and_one_rank(&what, &on_disk, &memory, &one);
    }
}

/// Malformed moves of sharded storage that the verifier refuses, on two ranks with every
/// model state on disk: an upload that no longer waits for the read of its parameter shard
/// (it would upload what the staging buffer held before), an upload from a sharded staging
/// buffer of gradients, a disk read of a parameter shard into one, and a disk read of half a
/// parameter shard (each rank moves its whole shard).
#[test]
fn malformed_moves_of_sharded_storage_are_refused() {
    use protrain::ir::{CopyKind, StreamKind, TensorRef};
    let memory = compile_clipped("gpt2-tiny", TIGHT, 2, 1, DType::F32, None);
    let schedule: Schedule =
        protrain::compiler::disk::every_state((*memory).clone(), 2).expect("moves");
    verify(schedule.clone()).expect("verifies as compiled");
    let stream_of = |kind: StreamKind| {
        schedule
            .streams
            .iter()
            .position(|st| st.kind == kind)
            .unwrap()
    };
    let (io, h2d) = (
        stream_of(StreamKind::DiskIo),
        stream_of(StreamKind::HostToDevice),
    );
    let kind = |t: TensorRef| schedule.buffers[t.buffer.index()].kind;
    let refused = |s: Schedule| verify(s).expect_err("refused").to_string();
    let grads_staging = schedule
        .buffers
        .iter()
        .position(|b| {
            matches!(
                b.kind,
                BufferKind::ShardStaging {
                    part: ShardPart::Grads,
                    ..
                }
            )
        })
        .map(protrain::ir::BufferId::new)
        .expect("a sharded staging buffer of gradients");
    // The first upload, from a sharded staging buffer of parameters, after its wait.
    let upload = schedule.streams[h2d]
        .instrs
        .iter()
        .position(|i| {
            matches!(i, Instr::CopyShard { what: CopyKind::FetchChunk { .. }, src, .. }
                if matches!(kind(*src), BufferKind::ShardStaging { part: ShardPart::Params, .. }))
        })
        .expect("an upload from a staging buffer");
    let mut s = schedule.clone();
    let wait = s.streams[h2d].instrs.remove(upload - 1);
    assert!(matches!(wait, Instr::Wait { .. }), "{wait:?}");
    s.streams[0].instrs.push(wait);
    let err = refused(s);
    assert!(err.contains("data flow") && err.contains("fetch"), "{err}");
    let mut s = schedule.clone();
    if let Instr::CopyShard { src, .. } = &mut s.streams[h2d].instrs[upload] {
        src.buffer = grads_staging;
    }
    let err = refused(s);
    assert!(
        err.contains("nor a sharded disk staging buffer of that part"),
        "{err}"
    );
    // The first read of a parameter shard from disk.
    let read = schedule.streams[io]
        .instrs
        .iter()
        .position(|i| {
            matches!(i, Instr::DiskRead { src, .. }
                if matches!(kind(*src), BufferKind::HostShard { part: ShardPart::Params, .. }))
        })
        .expect("a read of a parameter shard");
    let mut s = schedule.clone();
    if let Instr::DiskRead { dst, .. } = &mut s.streams[io].instrs[read] {
        dst.buffer = grads_staging;
    }
    let err = refused(s);
    assert!(
        err.contains("not a sharded disk staging buffer of the same part"),
        "{err}"
    );
    let mut s = schedule.clone();
    if let Instr::DiskRead { bytes, .. } = &mut s.streams[io].instrs[read] {
        *bytes /= 2;
    }
    let err = refused(s);
    assert!(err.contains("each rank's whole shard"), "{err}");
}

/// Where `schedule`'s disk stream reads what each micro-batch's uploads take: it has a
/// micro-batch marker, and at least one read before it (so once per micro-batch, as the
/// sequential order's uploads run).
fn reads_every_micro_batch(schedule: &Schedule) -> bool {
    schedule
        .streams
        .iter()
        .find(|s| s.kind == StreamKind::DiskIo)
        .and_then(|s| {
            let marker = s
                .instrs
                .iter()
                .position(|i| matches!(i, Instr::EndMicroBatch { .. }))?;
            Some(
                s.instrs[..marker]
                    .iter()
                    .any(|i| matches!(i, Instr::DiskRead { .. })),
            )
        })
        .unwrap_or(false)
}

/// `memory` (a schedule of `ranks` sharded ranks in host memory) with each rank's shards of
/// every model state the disk tier can take on its disk file: by the node's host budget
/// (the least the tier can leave, below what the state alone on disk leaves, so the search's
/// disk pass moves the storage) where `by_budget`, else the tier at its most
/// ([`every_state`](protrain::compiler::disk::every_state), one staging buffer a ring).
/// Asserts from the schedule that every chunk's state shards and parameter shards are on
/// disk and that every upload reads a sharded staging buffer.
fn with_storage_on_disk(
    what: &str,
    memory: &VerifiedSchedule,
    (model, policy, ranks, k, dtype, clip): (&str, &str, u32, u64, DType, Option<f64>),
    by_budget: bool,
) -> VerifiedSchedule {
    assert!(memory.sharded() && memory.disk_bytes == 0, "{what}");
    let on_disk = match by_budget {
        true => {
            let (node_host, disk) = least_with_storage_on_disk(memory, ranks)
                .unwrap_or_else(|| panic!("{what}: moving storage saves host memory"));
            let hardware = HardwareProfile::host()
                .with_host_memory(node_host)
                .with_disk_memory(u64::from(ranks) * disk);
            let on_disk = compile_on(model, policy, ranks, k, dtype, clip, hardware)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(on_disk.disk_bytes, disk, "{what}: the disk region is exact");
            assert!(
                on_disk.host_bytes * u64::from(ranks) <= node_host,
                "{what}: {} host bytes a rank, {node_host} a node",
                on_disk.host_bytes
            );
            on_disk
        }
        false => {
            let most = protrain::compiler::disk::every_state((**memory).clone(), 1)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            verify(most).unwrap_or_else(|e| panic!("{what}: {e}"))
        }
    };
    let chunks = on_disk.chunks.len();
    assert_eq!(on_disk.disk_chunks().len(), chunks, "{what}: state shards");
    let (params, _, staged_uploads) = storage_shards_on_disk(&on_disk);
    assert_eq!(params.len(), chunks, "{what}: parameter shards on disk");
    let uploads = on_disk
        .streams
        .iter()
        .flat_map(|s| &s.instrs)
        .filter(|i| {
            matches!(
                i,
                Instr::CopyShard {
                    what: protrain::ir::CopyKind::FetchChunk { .. },
                    ..
                }
            )
        })
        .count();
    assert!(uploads > 0, "{what}: shard uploads");
    assert_eq!(staged_uploads, uploads, "{what}: every upload staged");
    on_disk
}

/// Two sharded ranks of two micro-batches each (the sequential order) with each rank's
/// optimizer state and parameter shards on its disk file: every micro-batch's uploads read
/// the parameter shards from disk, the update reads and writes them once. The gradient
/// shards are the accumulators there (each micro-batch's gradients summed over the ranks
/// into them by kernels on the collective stream), so they stay in host memory, unclipped;
/// clipped, the accumulators are whole and the gradient shards move. gpt2-tiny in f32 gets
/// there by the node's host budget, llama-tiny in bf16 (clipped) by the tier at its most, in
/// the 16- and 14-byte layouts. They train bit for bit as the same ranks in host memory and
/// as one rank accumulating all four micro-batches.
#[test]
fn accumulating_sharded_ranks_with_their_storage_on_disk_train_as_in_host_memory() {
    let (ranks, k) = (2u32, 2u64);
    let lean = format!("{TIGHT} host_layout=14");
    for (model, dtype, clip, policy, by_budget) in [
        ("gpt2-tiny", DType::F32, None, TIGHT, true),
        ("llama-tiny", DType::BF16, Some(0.05), TIGHT, false),
        ("llama-tiny", DType::BF16, Some(0.05), lean.as_str(), false),
    ] {
        let what = format!("{model} {dtype} clip {clip:?} {policy}: {ranks} ranks x {k}");
        let shape = (model, policy, ranks, k, dtype, clip);
        let memory = compile_on(
            model,
            policy,
            ranks,
            k,
            dtype,
            clip,
            HardwareProfile::host(),
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        let on_disk = with_storage_on_disk(&what, &memory, shape, by_budget);
        assert_eq!(on_disk.micro_batches(), k as u32, "{what}");
        assert!(reads_every_micro_batch(&on_disk), "{what}");
        if clip.is_none() {
            let (_, grads, _) = storage_shards_on_disk(&on_disk);
            assert!(grads.is_empty(), "{what}: the accumulator shards stay");
            assert_eq!(
                accumulations_over_ranks(&on_disk).0,
                accumulations_over_ranks(&memory).0
            );
        }
        let one = compile_clipped(model, TIGHT, 1, u64::from(ranks) * k, dtype, clip);
        trains_as_in_memory_and_one_rank(&what, &on_disk, &memory, &one);
    }
}

/// Two sharded ranks of four micro-batches each in the chunk-major order (every micro-batch
/// through a chunk while it is resident, its gradients summed over the ranks on the device)
/// with each rank's optimizer state, parameter and gradient shards on its disk file: each
/// shard is read from disk once per pass per step, not once per micro-batch (the disk stream
/// has no per-micro-batch reads). gpt2-tiny in f32 by the node's host budget, llama-tiny in
/// bf16 by the tier at its most: the losses, weights and Adam moments of the same ranks in
/// the chunk-major and the sequential order in host memory and of one rank accumulating all
/// 8 micro-batches, bit for bit.
#[test]
fn chunk_major_sharded_ranks_with_their_shards_on_disk_train_as_in_host_memory() {
    let (ranks, a) = (2u32, 4u64);
    let chunk_major = format!("{TIGHT_THREE_BUFFERS} order=chunk-major");
    for (model, dtype, by_budget) in [
        ("gpt2-tiny", DType::F32, true),
        ("llama-tiny", DType::BF16, false),
    ] {
        let what = format!("{model} {dtype}: {ranks} ranks x {a} chunk-major");
        let shape = (model, chunk_major.as_str(), ranks, a, dtype, None);
        let memory = compile(model, &chunk_major, ranks, a, dtype);
        assert!(memory.is_chunk_major(), "{what}");
        let on_disk = with_storage_on_disk(&what, &memory, shape, by_budget);
        assert!(on_disk.is_chunk_major(), "{what}");
        assert!(
            !reads_every_micro_batch(&on_disk),
            "{what}: reads once a step"
        );
        let (_, grads, _) = storage_shards_on_disk(&on_disk);
        assert_eq!(grads.len(), on_disk.chunks.len(), "{what}: gradient shards");
        let one = compile(model, TIGHT, 1, u64::from(ranks) * a, dtype);
        trains_as_in_memory_and_one_rank(&what, &on_disk, &memory, &one);
        let sequential = compile(model, TIGHT_THREE_BUFFERS, ranks, a, dtype);
        let (in_order, _) = train(&sequential, &fresh(&sequential), 3);
        let (disk_run, _) = train(&on_disk, &fresh(&on_disk), 3);
        assert_eq!(disk_run.0, in_order.0, "{what}: sequential losses");
        assert!(
            disk_run.1 == in_order.1,
            "{what}: sequential weights differ"
        );
        assert!(
            disk_run.2 == in_order.2,
            "{what}: sequential moments differ"
        );
    }
}

/// One rank of four micro-batches in the chunk-major order with every model state on disk
/// (each chunk's optimizer state, parameters and gradients, through rings of two staging
/// buffers): gpt2-tiny in f32 and llama-tiny in bf16 (the 14-byte layout) train bit for bit
/// as the sequential order and the chunk-major order in host memory.
#[test]
fn chunk_major_accumulation_with_every_state_on_disk_trains_as_in_host_memory() {
    let a = 4u64;
    for (model, dtype, layout) in [
        ("gpt2-tiny", DType::F32, 16),
        ("llama-tiny", DType::BF16, 14),
    ] {
        let what = format!("{model} {dtype} host_layout={layout}: 1 rank x {a} chunk-major");
        let policy = format!("{TIGHT_THREE_BUFFERS} host_layout={layout}");
        let memory = compile(model, &format!("{policy} order=chunk-major"), 1, a, dtype);
        assert!(memory.is_chunk_major() && memory.disk_bytes == 0, "{what}");
        let most = protrain::compiler::disk::every_state((*memory).clone(), 2)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let on_disk = verify(most).unwrap_or_else(|e| panic!("{what}: {e}"));
        let all_on_disk = |kind: fn(&BufferKind) -> bool| {
            let of_kind: Vec<_> = on_disk.buffers.iter().filter(|b| kind(&b.kind)).collect();
            !of_kind.is_empty() && of_kind.iter().all(|b| b.space == protrain::ir::Space::Disk)
        };
        assert!(
            all_on_disk(|k| matches!(k, BufferKind::OptimizerState { .. })),
            "{what}: optimizer state"
        );
        assert!(
            all_on_disk(|k| matches!(k, BufferKind::HostChunk { .. })),
            "{what}: parameters"
        );
        if layout == 16 {
            assert!(
                all_on_disk(|k| matches!(k, BufferKind::HostGradChunk { .. })),
                "{what}: gradients"
            );
        }
        assert!(
            !reads_every_micro_batch(&on_disk),
            "{what}: reads once a step"
        );
        let sequential = compile(model, &policy, 1, a, dtype);
        let (in_order, _) = train(&sequential, &fresh(&sequential), 3);
        let (in_memory, _) = train(&memory, &fresh(&memory), 3);
        let (disk_run, _) = train(&on_disk, &fresh(&on_disk), 3);
        assert_eq!(in_memory.0, in_order.0, "{what}: losses in memory");
        assert_eq!(disk_run.0, in_memory.0, "{what}: losses");
        assert!(disk_run.1 == in_memory.1, "{what}: weights differ");
        assert!(disk_run.2 == in_memory.2, "{what}: Adam moments differ");
        assert!(
            disk_run.1 == in_order.1,
            "{what}: weights differ from sequential"
        );
        assert!(
            disk_run.2 == in_order.2,
            "{what}: moments differ from sequential"
        );
    }
}
