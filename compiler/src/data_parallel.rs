//! Data parallelism: adds the collective stream that sums every gradient over the ranks.
//!
//! The pass runs last, on an emitted (and, with `K > 1` micro-batches, accumulated) schedule,
//! and turns it into the one program every rank of a `gpus x nodes` run executes (SPMD: the
//! rank is a parameter of the run, never a different instruction list). It adds one
//! [`StreamKind::Collective`] stream and, for each gradient an AdamW op reads, one
//! [`Instr::AllReduce`] on it, ordered by events like any copy:
//!
//! - without accumulation, right after the kernel that computes the gradient: that kernel's
//!   stream records an event, the collective stream waits for it and sums the gradients the
//!   kernel wrote, records another event, and the kernel's stream waits for that one before
//!   its next instruction that reads one of them or records an event (through which another
//!   stream, such as the gradient offload, could read them). The backward kernels that do not
//!   read the gradient overlap the sum;
//! - with accumulation, once per micro-batch, into the accumulators: each `accumulate_grad`
//!   (see [`crate::accumulate`]) moves to the collective stream, where it adds every rank's
//!   gradient to the accumulator one by one in rank order (`((acc + g0) + g1) + ...`); its
//!   stream records an event where it was and waits for the sum. With rank `r`'s
//!   micro-batch `m` the global micro-batch `m * ranks + r` (the runtime's
//!   `data::rank_rows`), `W` ranks of `A` micro-batches make the very sums one rank of
//!   `W * A` micro-batches makes (`(((0 + g0) + g1) + g2) + g3`), where summing each rank's
//!   accumulator at the end would make `(g0 + g2) + (g1 + g3)`. It costs one collective per
//!   gradient per micro-batch instead of one per step, as ZeRO's reduce per micro-batch does.
//!   A sharded chunk's `accumulate_grad` sits where its gradient offload was (see
//!   [`crate::accumulate`]) and moves from there: each rank keeps the sums of its slice.
//!
//! The training graph's loss gradient is already scaled by `1 / (ranks * K)`
//! ([`crate::accumulate::scale_loss_gradient`]), so the sum is the mean gradient over the
//! global batch, and everything after it (the norm for clipping, AdamW) runs as on one rank.
//! Gradients of chunks that are sharded over the ranks (offloaded chunks, when
//! [`crate::shard::shardable`] allows) are left out: [`crate::shard`], the pass after this
//! one, reduce-scatters them, unless the update reads the global gradient norm: then they are
//! summed here too, whole, and [`crate::shard`] copies each rank's slice of the sum. Every other chunk (the persistent ones, and every chunk when
//! nothing is sharded) stays whole on every rank, replicated, with its gradients summed here. The loss each rank computes is its own rows'; the runtime
//! averages it over the ranks.
//!
//! It does not move the squared norms a clipping schedule computes right after each gradient
//! (so with clipping the compute stream waits for each sum), nor let a stream run on past an
//! accumulation over the ranks before it is done (the gradient's memory may be reused
//! right after).

use crate::comm::Topology;
use crate::error::{CompileError, Result};
use crate::shard::{merge, Job};
use protrain_ir::{
    BufferKind, EventId, Instr, OpId, OpKind, Schedule, Stream, StreamKind, TensorRef, ValueId,
};
use std::collections::{BTreeMap, HashSet};

/// Makes `schedule` the program of every rank of `topology`; returns it unchanged for one
/// rank. Fails when an AdamW op's gradient has no producing kernel (a compiler bug).
pub fn data_parallel(schedule: Schedule, topology: Topology) -> Result<Schedule> {
    if topology.ranks() <= 1 {
        return Ok(schedule);
    }
    let kind = StreamKind::Collective {
        gpus: topology.gpus,
        nodes: topology.nodes,
    };
    if schedule.is_chunk_major() {
        return sum_interleaved(schedule, kind);
    }
    match schedule.micro_batches() {
        k if k > 1 => sum_micro_batches(schedule, kind, k),
        _ => all_reduce_gradients(schedule, kind),
    }
}

/// Chunk-major accumulation ([`crate::interleave`]): each gradient the optimizer reads is
/// `((g1 + g2) + g3) ...`, the adds of the rank's `K` micro-batches' gradients in order. Over
/// the ranks the sums must be those of one rank accumulating every rank's micro-batches in
/// the global order (rank `r`'s micro-batch `m` is the global micro-batch `m * ranks + r`,
/// the runtime's `data::rank_rows`): `((((0 + g1@0) + g1@1) + g2@0) + g2@1) ...`. So the first
/// micro-batch's gradient is all-reduced in place right after its kernel (a sum from zero in
/// rank order), and each add moves to the collective stream, where it starts from the
/// running sum (already the ranks') and adds every rank's gradient of the next micro-batch in
/// rank order, as an `accumulate_grad` over the ranks does; its stream records an event where
/// it was and waits for the sum. Every rank then holds the whole sums, sharded chunks' too:
/// [`crate::shard`] copies each rank's slice of those to its shard without a reduce-scatter.
///
/// The parameters are gathered once per step per pass (the interleaved graph runs every
/// micro-batch through a chunk while it is resident); the gradients are summed over the
/// ranks once per micro-batch, which the global order needs (a sum of per-rank sums is not
/// one rank's bits).
fn sum_interleaved(mut schedule: Schedule, kind: StreamKind) -> Result<Schedule> {
    let k = schedule.micro_batch_losses.len();
    let graph = &schedule.graph;
    let mut firsts: Vec<ValueId> = Vec::new();
    let mut adds: HashSet<OpId> = HashSet::new();
    for (_, op) in graph.ops() {
        if !matches!(op.kind, OpKind::AdamW { .. }) {
            continue;
        }
        let mut sum = op.inputs[1];
        for _ in 1..k {
            let add = graph
                .value(sum)
                .producer
                .filter(|&p| graph.op(p).kind == OpKind::Add && graph.op(p).inputs.len() == 2)
                .ok_or_else(|| {
                    CompileError::Validation(format!(
                        "the gradient {} of a chunk-major schedule is not a sum of {k} \
                         micro-batches' gradients",
                        graph.value(op.inputs[1]).name
                    ))
                })?;
            adds.insert(add);
            sum = graph.op(add).inputs[0];
        }
        firsts.push(sum);
    }
    let mut events = schedule.events;
    let mut event = || {
        events += 1;
        EventId(events - 1)
    };
    let jobs = take_kernels(&mut schedule.streams, |op| adds.contains(&op), &mut event);
    schedule.events = events;
    let mut schedule = all_reduce_values(schedule, kind, &firsts)?;
    let comm = schedule.streams.len() - 1;
    schedule.streams[comm].instrs = merge(&schedule, comm, jobs)?;
    Ok(schedule)
}

/// Takes every kernel of an op that `moves` off `streams`, for the collective stream: each
/// leaves in its place a record of a new trigger event and a wait for a new done event
/// (from `event`), and comes back as the [`Job`] that [`merge`] places on the collective
/// stream between the two.
fn take_kernels(
    streams: &mut [Stream],
    moves: impl Fn(OpId) -> bool,
    event: &mut impl FnMut() -> EventId,
) -> Vec<Job> {
    let mut jobs: Vec<Job> = Vec::new();
    for stream in streams.iter_mut() {
        let old = std::mem::take(&mut stream.instrs);
        let mut instrs = Vec::with_capacity(old.len() + 8);
        for instr in old {
            if !matches!(&instr, Instr::Kernel { op, .. } if moves(*op)) {
                instrs.push(instr);
                continue;
            }
            let (trigger, done) = (event(), event());
            instrs.push(Instr::Record { event: trigger });
            instrs.push(Instr::Wait { event: done });
            jobs.push(Job {
                trigger,
                instr,
                done,
            });
        }
        stream.instrs = instrs;
    }
    jobs
}

/// The gradients the optimizer reads, in the order their AdamW ops appear, but those of
/// sharded chunks, which [`crate::shard`] reduce-scatters, unless the schedule reads the
/// global gradient norm (clipping, loss scaling): then it sums sharded chunks' gradients here
/// too, whole, so each squared norm reads the whole sum ([`crate::shard`] says why).
fn summed_gradients(schedule: &Schedule) -> Vec<ValueId> {
    let norms = crate::shard::reads_global_norm(&schedule.graph);
    let mut grads: Vec<ValueId> = Vec::new();
    for stream in &schedule.streams {
        for instr in &stream.instrs {
            if let Instr::Kernel { op, inputs, .. } = instr {
                let o = schedule.graph.op(*op);
                let sharded = !norms
                    && inputs.get(1).is_some_and(|t| {
                        matches!(schedule.buffer(t.buffer).kind, BufferKind::HostShard { .. })
                    });
                if let (OpKind::AdamW { .. }, false) = (&o.kind, sharded) {
                    grads.push(o.inputs[1]);
                }
            }
        }
    }
    grads
}

/// With `k > 1` micro-batches, each micro-batch's gradients are summed over the ranks into
/// the accumulators: every `accumulate_grad` moves to the collective stream, where it adds
/// every rank's gradient to the accumulator in rank order; its stream records an event where
/// it was and waits for the sum before going on (the gradient's memory may be reused after
/// it, its last reader).
fn sum_micro_batches(mut schedule: Schedule, kind: StreamKind, k: u32) -> Result<Schedule> {
    let mut events = schedule.events;
    let mut event = || {
        events += 1;
        EventId(events - 1)
    };
    let graph = &schedule.graph;
    let jobs = take_kernels(
        &mut schedule.streams,
        |op| graph.op(op).kind == OpKind::AccumulateGrad,
        &mut event,
    );
    schedule.streams.push(Stream {
        name: "comm".into(),
        kind,
        instrs: Vec::new(),
    });
    schedule.events = events;
    let comm = schedule.streams.len() - 1;
    let mut merged = merge(&schedule, comm, jobs)?;
    merged.push(Instr::EndMicroBatch { micro_batches: k });
    schedule.streams[comm].instrs = merged;
    Ok(schedule)
}

/// Kernels that write gradients, by (stream, index), with the gradients and where.
type Producers = BTreeMap<(usize, usize), Vec<(ValueId, TensorRef)>>;

/// Each kernel that writes gradients the optimizer reads; fails when one of `grads` has no
/// such kernel.
fn gradient_producers(schedule: &Schedule, grads: &[ValueId]) -> Result<Producers> {
    let wanted: HashSet<ValueId> = grads.iter().copied().collect();
    let mut producers = Producers::new();
    for (s, stream) in schedule.streams.iter().enumerate() {
        for (i, instr) in stream.instrs.iter().enumerate() {
            if let Instr::Kernel { op, outputs, .. } = instr {
                for (&v, &t) in schedule.graph.op(*op).outputs.iter().zip(outputs) {
                    if wanted.contains(&v) {
                        producers.entry((s, i)).or_default().push((v, t));
                    }
                }
            }
        }
    }
    let found: HashSet<ValueId> = producers.values().flatten().map(|&(v, _)| v).collect();
    if let Some(&missing) = grads.iter().find(|v| !found.contains(v)) {
        return Err(CompileError::Validation(format!(
            "no kernel computes the gradient {} that AdamW reads",
            schedule.graph.value(missing).name
        )));
    }
    Ok(producers)
}

/// With one micro-batch, each gradient is all-reduced right after the kernel that computes
/// it (see the module doc), and the kernel's stream waits for the sum before its next
/// instruction that reads one of them or records an event.
fn all_reduce_gradients(schedule: Schedule, kind: StreamKind) -> Result<Schedule> {
    let grads = summed_gradients(&schedule);
    all_reduce_values(schedule, kind, &grads)
}

/// [`all_reduce_gradients`] of the values `grads`: each all-reduced right after the kernel
/// that computes it, on a collective stream added last.
fn all_reduce_values(
    mut schedule: Schedule,
    kind: StreamKind,
    grads: &[ValueId],
) -> Result<Schedule> {
    let mut events = schedule.events;
    let mut event = || {
        events += 1;
        EventId(events - 1)
    };
    let producers = gradient_producers(&schedule, grads)?;
    let mut comm: Vec<Instr> = Vec::new();
    // Instructions to insert after (stream, index), and before (stream, index).
    let mut after: BTreeMap<(usize, usize), Vec<Instr>> = BTreeMap::new();
    let mut before: BTreeMap<(usize, usize), Vec<Instr>> = BTreeMap::new();
    // `producers` is ordered by stream, then index: the collective stream sums the
    // gradients in the order they are computed, so it never waits out of turn.
    for (&(s, i), outs) in &producers {
        let (computed, summed) = (event(), event());
        after
            .entry((s, i))
            .or_default()
            .push(Instr::Record { event: computed });
        comm.push(Instr::Wait { event: computed });
        for &(value, at) in outs {
            comm.push(Instr::AllReduce { value, at });
        }
        comm.push(Instr::Record { event: summed });
        let instrs = &schedule.streams[s].instrs;
        let summed_values: HashSet<ValueId> = outs.iter().map(|&(v, _)| v).collect();
        let next = instrs[i + 1..]
            .iter()
            .position(|instr| match instr {
                Instr::Record { .. } | Instr::EndMicroBatch { .. } => true,
                Instr::Kernel { op, .. } => schedule
                    .graph
                    .op(*op)
                    .inputs
                    .iter()
                    .any(|v| summed_values.contains(v)),
                _ => false,
            })
            .map_or(instrs.len(), |p| i + 1 + p);
        before
            .entry((s, next))
            .or_default()
            .push(Instr::Wait { event: summed });
    }
    for (s, stream) in schedule.streams.iter_mut().enumerate() {
        let old = std::mem::take(&mut stream.instrs);
        let n = old.len();
        let mut instrs = Vec::with_capacity(n + 4);
        for (i, instr) in old.into_iter().enumerate() {
            if let Some(waits) = before.remove(&(s, i)) {
                instrs.extend(waits);
            }
            instrs.push(instr);
            if let Some(records) = after.remove(&(s, i)) {
                instrs.extend(records);
            }
        }
        if let Some(waits) = before.remove(&(s, n)) {
            instrs.extend(waits);
        }
        stream.instrs = instrs;
    }
    schedule.streams.push(Stream {
        name: "comm".into(),
        kind,
        instrs: comm,
    });
    schedule.events = events;
    Ok(schedule)
}
