//! Sharding: offloaded chunks split over the ranks (ZeRO-3 style), all-gathered before use and
//! reduce-scattered after their last backward use.
//!
//! The pass runs after [`crate::data_parallel`], on a schedule whose chunk table says it is
//! sharded (`world_size > 1`, made by [`sharded_table`] before placement where [`shardable`] allows): there,
//! [`crate::streams`] gave every offloaded chunk with optimizer state
//! [`BufferKind::HostShard`] homes of `1/ranks` of its host state and a device gradient chunk
//! of the whole `chunk_bytes`, and [`crate::data_parallel`] left those chunks' gradients out of
//! its all-reduces. This pass rewrites the chunk's copies, on the streams that had them:
//!
//! - a fetch becomes a shard copy of the rank's slice of the parameters into its slice of the
//!   chunk slot, then an all-gather on the collective stream, after which the event the fetch
//!   recorded (what the compute stream waits for) is recorded;
//! - a gradient offload becomes a reduce-scatter on the collective stream (after the waits
//!   that ordered the offload after the backward kernels), then a shard copy of the rank's
//!   slice of the summed gradients to its host shard, where the CPU Adam updates it.
//!
//! The collectives join the collective stream in the order one run of the step triggers
//! them (a run in which every collective completes as soon as it is issued), interleaved
//! with the all-reduces already there, so the stream never waits out of turn.
//!
//! Persistent chunks stay whole on every rank, their gradients all-reduced: the rule is fixed
//! ("offloaded = sharded, persistent = replicated"), not chosen by the cost model per chunk.
//!
//! A schedule that clips gradients or scales the loss reads the global gradient norm: one
//! squared norm per gradient tensor (an f64 sum in the kernel's own tree order, rounded to
//! f32), summed in parameter order. A rank holding one slice of a tensor's sum cannot give
//! those bits (a slice boundary splits the kernel's tree, and f64 addition does not
//! associate), so there [`crate::data_parallel`] all-reduces the sharded chunks' gradients
//! whole, right after their kernels, as it does replicated ones; each squared norm reads the
//! whole sum, bit for bit one rank's accumulated gradient, and the offload copies each rank's
//! slice of the sum to its shard (no reduce-scatter). The host state stays sharded (1/W per
//! rank); what it costs is the all-reduce's second half (an all-gather of the gradients).
//!
//! With accumulation (`A > 1` micro-batches per rank) a sharded chunk's gradients reach no
//! gradient offload here: [`crate::accumulate`] replaced each one with the chunk's
//! `accumulate_grad` kernels, which [`crate::data_parallel`] moved to the collective stream.
//! There each micro-batch's gradient is read on the device and summed over the ranks in rank
//! order into the part of its accumulator each rank holds, `((acc + g0) + g1) + ...` per
//! element (a reduce-scatter into the accumulator shards): the accumulator is the gradient's
//! place in the chunk's gradient shard, so a rank keeps `1/W` of the accumulators too, and
//! the CPU Adam of the rank reads its slice of the sums. Where the update reads the global
//! norm the accumulators stay whole on every rank (each squared norm reads a whole sum, as
//! one rank's does), summed as replicated ones are, and only the optimizer state is sharded.
//! This pass then turns the fetches alone, merging the all-gathers into the collective
//! stream's micro-batch program (before its [`Instr::EndMicroBatch`]).

use crate::comm::Topology;
use crate::error::{CompileError, Result};
use protrain_ir::{
    BufferKind, ChunkId, ChunkTable, CopyKind, DType, EventId, Graph, Instr, OpKind, Schedule,
    StreamKind, TensorRef,
};
use std::collections::HashMap;

/// Whether chunks compiled for `topology` shard their offloaded chunks (with or without
/// accumulation); the reason when they do not.
pub fn shardable(chunks: &ChunkTable, topology: Topology) -> std::result::Result<(), String> {
    if topology.ranks() < 2 {
        return Err("one rank".into());
    }
    if chunks.is_empty() {
        return Err("no chunks".into());
    }
    Ok(())
}

/// `chunks` sharded over `ranks`: the same chunks, each padded at its end so that it splits
/// into `ranks` equal slices of whole 4-byte words (so every element type's elements, and
/// their f32 mirrors, split evenly too). The padding is at most `4 * ranks - 4` bytes a chunk;
/// its bytes belong to no parameter, are gathered and summed with the rest and read by
/// nothing.
pub fn sharded_table(chunks: &ChunkTable, ranks: u32) -> ChunkTable {
    let mut table = chunks.clone();
    table.world_size = ranks;
    table.chunk_bytes = chunks.chunk_bytes.next_multiple_of(4 * u64::from(ranks));
    table
}

/// Whether the update reads the global gradient norm (clipping, or loss scaling's unscale
/// coefficient): then sharded chunks' gradients are all-reduced whole instead of
/// reduce-scattered (see the module doc).
pub fn reads_global_norm(graph: &Graph) -> bool {
    graph
        .ops()
        .any(|(_, op)| matches!(op.kind, OpKind::GradNormSq))
}

/// A collective a pass adds: issued once `trigger` is recorded, recording `done` after.
pub(crate) struct Job {
    /// The event after which the collective may run.
    pub trigger: EventId,
    /// The collective.
    pub instr: Instr,
    /// The event it records when done.
    pub done: EventId,
}

/// Turns the copies of `schedule`'s sharded chunks into shard copies and collectives (see the
/// module doc); returns it unchanged when nothing is sharded. Fails on a schedule that
/// shards without a collective stream (a compiler bug).
pub fn shard(mut schedule: Schedule) -> Result<Schedule> {
    if !schedule.sharded() {
        return Ok(schedule);
    }
    let comm = schedule
        .streams
        .iter()
        .position(|s| matches!(s.kind, StreamKind::Collective { .. }))
        .ok_or_else(|| {
            CompileError::Validation("a sharded schedule has no collective stream".into())
        })?;
    let dtype_of = |chunk: ChunkId| -> DType {
        schedule
            .chunks
            .chunk(chunk)
            .members
            .first()
            .map_or(DType::F32, |m| {
                let g = &schedule.graph;
                g.value(g.param(m.param).value).ty.dtype
            })
    };
    let mut events = schedule.events;
    let mut event = || {
        events += 1;
        EventId(events - 1)
    };
    // Gradients already summed whole by [`crate::data_parallel`] (for the global norm) are
    // offloaded as each rank's slice of the sum, without a reduce-scatter.
    // So are a chunk-major schedule's, summed over the ranks micro-batch by micro-batch.
    let summed = reads_global_norm(&schedule.graph) || schedule.is_chunk_major();
    let mut jobs: Vec<Job> = Vec::new();
    for (s, stream) in schedule.streams.iter_mut().enumerate() {
        if s == comm {
            continue;
        }
        let old = std::mem::take(&mut stream.instrs);
        let mut instrs = Vec::with_capacity(old.len() + 8);
        let mut it = old.into_iter().peekable();
        while let Some(instr) = it.next() {
            let Instr::Copy { what, src, dst, .. } = instr else {
                instrs.push(instr);
                continue;
            };
            // A sharded chunk's fetch reads its parameter shard; its gradient offload writes
            // its gradient shard, or its parameter shard in the 14-byte layout.
            let shard_of = |t: &TensorRef| {
                let b = &schedule.buffers[t.buffer.index()];
                matches!(b.kind, BufferKind::HostShard { .. }).then_some((t.buffer, b.size))
            };
            let sharded = match what {
                CopyKind::FetchChunk { chunk } => shard_of(&src).map(|s| (chunk, s, true)),
                CopyKind::OffloadGrads { chunk } => shard_of(&dst).map(|s| (chunk, s, false)),
                _ => None,
            };
            let Some((chunk, (home, bytes), fetch)) = sharded else {
                instrs.push(instr);
                continue;
            };
            let shard = TensorRef {
                buffer: home,
                offset: 0,
            };
            if fetch {
                let trigger = event();
                instrs.push(Instr::CopyShard {
                    what,
                    src: shard,
                    dst,
                    bytes,
                });
                instrs.push(Instr::Record { event: trigger });
                // The fetch's own record (what the readers wait for) moves after the gather.
                let done = match it.peek() {
                    Some(&Instr::Record { event }) => {
                        it.next();
                        event
                    }
                    _ => {
                        let done = event();
                        instrs.push(Instr::Wait { event: done });
                        done
                    }
                };
                jobs.push(Job {
                    trigger,
                    instr: Instr::AllGather {
                        chunk,
                        at: dst,
                        bytes,
                    },
                    done,
                });
            } else if summed {
                instrs.push(Instr::CopyShard {
                    what,
                    src,
                    dst: shard,
                    bytes,
                });
            } else {
                let (trigger, done) = (event(), event());
                instrs.push(Instr::Record { event: trigger });
                instrs.push(Instr::Wait { event: done });
                instrs.push(Instr::CopyShard {
                    what,
                    src,
                    dst: shard,
                    bytes,
                });
                jobs.push(Job {
                    trigger,
                    instr: Instr::ReduceScatter {
                        chunk,
                        at: src,
                        bytes,
                        dtype: dtype_of(chunk),
                    },
                    done,
                });
            }
        }
        stream.instrs = instrs;
    }
    schedule.events = events;
    let merged = merge(&schedule, comm, jobs)?;
    schedule.streams[comm].instrs = merged;
    Ok(schedule)
}

/// The collective stream's instructions with `jobs` merged in: one run of the step, the
/// streams other than `comm` going one instruction at a time (the lowest-numbered that can),
/// the collective stream running ahead whenever it can, and each job issued (and done) as
/// soon as its trigger is recorded.
pub(crate) fn merge(schedule: &Schedule, comm: usize, jobs: Vec<Job>) -> Result<Vec<Instr>> {
    let streams = &schedule.streams;
    let mut by_trigger: HashMap<EventId, Job> = jobs.into_iter().map(|j| (j.trigger, j)).collect();
    let mut recorded = vec![false; schedule.events as usize];
    let mut pc = vec![0usize; streams.len()];
    let existing = &streams[comm].instrs;
    let mut out = Vec::with_capacity(existing.len() + 3 * by_trigger.len());
    // Where each stream's micro-batch program ends (accumulation): the collective stream
    // passes its marker only once every other stream has, so that no collective of the
    // micro-batch lands in the update program.
    let marker: Vec<Option<usize>> = streams
        .iter()
        .map(|s| {
            s.instrs
                .iter()
                .position(|i| matches!(i, Instr::EndMicroBatch { .. }))
        })
        .collect();
    loop {
        let others_done = (0..streams.len())
            .filter(|&s| s != comm)
            .all(|s| marker[s].is_none_or(|m| pc[s] > m));
        // The collective stream's own instructions, as far as they can go.
        while let Some(instr) = existing.get(pc[comm]) {
            match *instr {
                Instr::Wait { event } if !recorded[event.index()] => break,
                Instr::EndMicroBatch { .. } if !others_done => break,
                Instr::Record { event } => recorded[event.index()] = true,
                _ => {}
            }
            out.push(instr.clone());
            pc[comm] += 1;
        }
        let next = (0..streams.len()).find(|&s| {
            s != comm
                && match streams[s].instrs.get(pc[s]) {
                    None => false,
                    Some(Instr::Wait { event }) => recorded[event.index()],
                    Some(_) => true,
                }
        });
        let Some(s) = next else {
            break;
        };
        if let Instr::Record { event } = streams[s].instrs[pc[s]] {
            recorded[event.index()] = true;
            if let Some(job) = by_trigger.remove(&event) {
                out.push(Instr::Wait { event });
                out.push(job.instr);
                out.push(Instr::Record { event: job.done });
                recorded[job.done.index()] = true;
            }
        }
        pc[s] += 1;
    }
    let stuck: Vec<String> = (0..streams.len())
        .filter(|&s| pc[s] < streams[s].instrs.len())
        .map(|s| format!("{} at #{}", streams[s].name, pc[s]))
        .collect();
    if !stuck.is_empty() || !by_trigger.is_empty() {
        return Err(CompileError::Validation(format!(
            "sharding could not order the collectives: {} wait for events never recorded",
            stuck.join(", ")
        )));
    }
    Ok(out)
}
