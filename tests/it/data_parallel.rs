//! Data parallelism on the host backend, ranks as threads: W ranks of one micro-batch each
//! train bit for bit as one rank accumulating W micro-batches over the same rows (the
//! rank-order sum of the collective is the single rank's accumulation order), under a roomy
//! and a tight policy, in f32 and bf16, with clipping; ranks that accumulate several
//! micro-batches each (interleaved rows, each micro-batch summed over the ranks into the
//! accumulators) do too; a rank that dies or hangs
//! fails the others within the timeout, through the executor.

use crate::common;

use protrain::compiler::comm::Topology;
use protrain::ir::verify_schedule::VerifiedSchedule;
use protrain::ir::{DType, HardwareProfile};
use protrain::runtime::collective::thread_ranks;
use protrain::runtime::data::rank_rows;
use protrain::runtime::params::init_params;
use protrain::runtime::train::vocab_of;
use protrain::runtime::{Executor, RuntimeError};
use protrain::{CompileOptions, OptimizerConfig, PolicyChoice};
use std::time::{Duration, Instant};

const ROOMY: &str = "blocks=KK";
const TIGHT: &str = "n_persist=0 n_buffer=1 n_swap=1 n_checkpoint=1";
const BATCH: u64 = 2;
const SEQ: u64 = 16;
const STEPS: usize = 3;

/// `model` compiled for `ranks` ranks (threads of this process) of `k` micro-batches of
/// `BATCH x SEQ`, clipping at norm 1.
fn compile(model: &str, policy: &str, ranks: u32, k: u64, dtype: DType) -> VerifiedSchedule {
    let config = protrain::models::load(model).expect("preset");
    let options = CompileOptions {
        batch: BATCH,
        seq: SEQ,
        dtype,
        hardware: HardwareProfile::host().with_thread_ranks(ranks),
        policy: PolicyChoice::parse(policy).expect("a policy"),
        optimizer: OptimizerConfig {
            grad_clip: Some(1.0),
            ..OptimizerConfig::default()
        },
        micro_batches: k,
        topology: Topology {
            gpus: ranks,
            nodes: 1,
        },
        ..CompileOptions::default()
    };
    protrain::compile(&config, &options)
        .unwrap_or_else(|e| panic!("{model} {policy} {ranks} ranks x {k}: {e}"))
        .schedule
}

/// What a run gives: every step's (loss, grad norm) bits, and the final weights' bits.
type Run = (Vec<(u32, Option<u32>)>, Vec<Vec<u32>>);

/// Trains `STEPS` steps of the synthetic corpus on every rank of `schedule`, each rank its
/// rows of the global batch ([`rank_rows`]: its micro-batch m the global micro-batch
/// m x W + r), from the seed-0 weights.
/// Every rank must report the same losses and end with the same weights; returns rank 0's.
fn train(schedule: &VerifiedSchedule) -> Run {
    let ranks = schedule.ranks() as usize;
    let global = BATCH * u64::from(schedule.micro_batches()) * ranks as u64;
    let vocab = vocab_of(&schedule.graph).expect("a language model");
    let batches = common::batches(vocab, global, SEQ, STEPS, 7);
    let run = |comm: Option<Box<dyn protrain::runtime::collective::Collective>>| -> Run {
        let mut executor = Executor::new(schedule).expect("an executor");
        let rank = comm.as_ref().map_or(0, |c| c.rank());
        if let Some(comm) = comm {
            executor.set_collective(comm).expect("the group fits");
        }
        executor
            .load_params(&init_params(&schedule.graph, 0))
            .expect("loads");
        let mut reports = Vec::new();
        let k = schedule.micro_batches() as usize;
        let (mut ins, mut outs) = (Vec::new(), Vec::new());
        for [inputs, targets] in &batches {
            rank_rows(inputs, rank, ranks, k, &mut ins).expect("rows");
            rank_rows(targets, rank, ranks, k, &mut outs).expect("rows");
            let r = executor.step(&[&ins, &outs]).expect("a step");
            reports.push((r.loss.to_bits(), r.grad_norm.map(f32::to_bits)));
        }
        let weights = executor.params().expect("weights");
        let bits = weights
            .iter()
            .map(|w| w.iter().map(|x| x.to_bits()).collect())
            .collect();
        (reports, bits)
    };
    if ranks == 1 {
        return run(None);
    }
    let comms = thread_ranks(ranks, Duration::from_secs(60)).expect("a group");
    let runs: Vec<Run> = std::thread::scope(|scope| {
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
        assert!(*other == runs[0], "rank {r} diverged from rank 0");
    }
    runs.into_iter().next().expect("rank 0")
}

#[test]
fn ranks_of_one_micro_batch_train_as_one_rank_accumulating_them_bit_for_bit() {
    for (model, dtype) in [
        ("gpt2-tiny", DType::F32),
        ("llama-tiny", DType::F32),
        ("gpt2-tiny", DType::BF16),
        ("gpt2-tiny", DType::F16),
    ] {
        for ranks in [2u32, 4] {
            let single = train(&compile(model, ROOMY, 1, u64::from(ranks), dtype));
            assert!(
                single.0.iter().all(|(_, n)| n.is_some()),
                "clipping reports"
            );
            for policy in [ROOMY, TIGHT] {
                let parallel = train(&compile(model, policy, ranks, 1, dtype));
                assert_eq!(
                    parallel.0, single.0,
                    "{model} {dtype} {policy}: {ranks} ranks' losses and norms against one rank \
                     of {ranks} micro-batches"
                );
                assert!(
                    parallel.1 == single.1,
                    "{model} {dtype} {policy}: {ranks} ranks' weights differ from one rank's"
                );
            }
        }
    }
}

/// Two ranks of two micro-batches (rank r's micro-batch m the global micro-batch 2m + r) sum
/// each micro-batch's gradients over the ranks into their accumulators,
/// `(((0 + g0) + g1) + g2) + g3`, as one rank of four does: losses, norms and weights bit for
/// bit, under the roomy policy (replicated chunks) and the tight one, in f32 and bf16.
#[test]
fn ranks_accumulating_several_micro_batches_train_as_one_rank_bit_for_bit() {
    for (model, dtype) in [("gpt2-tiny", DType::F32), ("llama-tiny", DType::BF16)] {
        let single = train(&compile(model, TIGHT, 1, 4, dtype));
        for policy in [ROOMY, TIGHT] {
            let parallel = train(&compile(model, policy, 2, 2, dtype));
            let what = format!("{model} {dtype} {policy}: 2 ranks x 2 against 1 x 4");
            assert_eq!(parallel.0, single.0, "{what}: losses and norms");
            assert!(parallel.1 == single.1, "{what}: weights differ");
        }
    }
}

#[test]
fn a_rank_that_dies_or_hangs_fails_the_other_within_the_timeout() {
    let schedule = compile("gpt2-tiny", ROOMY, 2, 1, DType::F32);
    let vocab = vocab_of(&schedule.graph).expect("a language model");
    let [inputs, targets] = common::batches(vocab, BATCH, SEQ, 1, 7).remove(0);
    let step = |comm: protrain::runtime::collective::ThreadRank| {
        let mut executor = Executor::new(&schedule).expect("an executor");
        executor.set_collective(Box::new(comm)).expect("fits");
        executor
            .load_params(&init_params(&schedule.graph, 0))
            .expect("loads");
        let started = Instant::now();
        let result = executor.step(&[&inputs, &targets]);
        (result, started.elapsed())
    };

    // Rank 1 dies before its first collective: rank 0 fails at once, naming it.
    let mut comms = thread_ranks(2, Duration::from_secs(30)).expect("a group");
    drop(comms.pop());
    let (result, took) = step(comms.pop().expect("rank 0"));
    let e = result.expect_err("rank 1 is gone");
    assert!(matches!(e, RuntimeError::Collective { rank: 0, .. }), "{e}");
    assert!(e.to_string().contains("rank 1 left"), "{e}");
    assert!(took < Duration::from_secs(10), "{took:?}");

    // Rank 1 hangs (alive, never stepping): rank 0 fails after the 1 s timeout.
    let mut comms = thread_ranks(2, Duration::from_secs(1)).expect("a group");
    let hung = comms.pop().expect("rank 1");
    let (result, took) = step(comms.pop().expect("rank 0"));
    let e = result.expect_err("rank 1 never arrives");
    assert!(e.to_string().contains("within 1.0 s"), "{e}");
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(10),
        "{took:?}"
    );
    drop(hung);
}

#[test]
fn a_data_parallel_schedule_needs_a_group_of_its_size() {
    let schedule = compile("gpt2-tiny", ROOMY, 2, 1, DType::F32);
    let mut executor = Executor::new(&schedule).expect("an executor");
    executor
        .load_params(&init_params(&schedule.graph, 0))
        .expect("loads");
    let n = (BATCH * SEQ) as usize;
    let e = executor
        .step(&[&vec![0; n], &vec![0; n]])
        .expect_err("no collective");
    assert!(e.to_string().contains("set_collective"), "{e}");
    let mut three = thread_ranks(3, Duration::from_secs(1)).expect("a group");
    let e = executor
        .set_collective(Box::new(three.remove(0)))
        .expect_err("3 ranks for 2");
    assert!(e.to_string().contains("compiled for 2"), "{e}");
}

/// The CUDA backend runs data-parallel schedules (NCCL, one process per GPU), so the executor
/// does not refuse them for want of collectives: without a GPU only the backend's own probe
/// fails (naming CUDA, not NCCL); with one, a rank whose collective exchanges host memory
/// (threads, the host backend's) is refused at its first collective, naming the way out.
#[cfg(feature = "cuda")]
#[test]
fn the_cuda_backend_takes_data_parallel_schedules_through_nccl_ranks() {
    let schedule = compile("gpt2-tiny", ROOMY, 2, 1, DType::BF16);
    let mut executor =
        match Executor::<protrain::runtime::cuda::CudaBackend>::with_backend(&schedule) {
            Ok(executor) => executor,
            Err(e) => {
                assert!(protrain::runtime::cuda::available().is_err(), "{e}");
                assert!(!e.to_string().contains("collectives"), "{e}");
                return;
            }
        };
    executor
        .load_params(&init_params(&schedule.graph, 0))
        .expect("loads");
    let mut two = thread_ranks(2, Duration::from_secs(5)).expect("a group");
    executor
        .set_collective(Box::new(two.remove(0)))
        .expect("2 ranks for 2");
    let n = (BATCH * SEQ) as usize;
    let e = executor
        .step(&[&vec![0; n], &vec![0; n]])
        .expect_err("threads are not NCCL ranks");
    assert!(e.to_string().contains("one process per GPU"), "{e}");
}
