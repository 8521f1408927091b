//! Gradient accumulation: splits an emitted schedule into a micro-batch program that sums
//! each gradient into an accumulator and an update program that clips and steps on the sums.
//!
//! The pass runs after emission on a schedule whose training graph was derived for `K > 1`
//! micro-batches (its loss gradient is [`OpKind::CrossEntropyBackwardScaled`]); any other
//! schedule comes back unchanged, so a step of one micro-batch is exactly what the pipeline
//! always emitted. For each gradient an AdamW op reads, it adds an accumulator value in the
//! space where that AdamW reads the gradient (the arena for a persistent chunk, the host
//! region for an offloaded one, after the gradient offload) and an `accumulate_grad` op,
//! which runs where the AdamW ran, in the same stream with the same events: the gradient is
//! complete and still live there, so the micro-batch program needs no new order and no new
//! memory but the accumulators. Squared norms, the clip coefficient, its copy and the AdamW
//! ops move to the update program, which reads the accumulators; there the squared norms of
//! host accumulators run on the host optimizer and travel to the device as scalars for the
//! clip coefficient.
//!
//! In a data-parallel schedule [`crate::data_parallel`] then moves each `accumulate_grad` to
//! the collective stream, where it adds every rank's gradient to the accumulator in rank
//! order: the sums one rank accumulating every rank's micro-batches makes.
//!
//! A chunk sharded over the ranks ([`crate::shard`]; its gradient offload lands in a
//! [`BufferKind::HostShard`]) is summed earlier: its `accumulate_grad` kernels take the
//! place of its gradient offload, reading each gradient where the backward pass left it on
//! the device, so that the sum over the ranks is also the offload and no rank needs a whole
//! host copy of the chunk's gradients. The accumulator is the gradient's own place in the
//! gradient shard (each rank holds its `1/W`, and no host accumulator is appended), unless
//! the update reads the global norm ([`crate::shard::reads_global_norm`]): then it is whole,
//! appended as any host accumulator, so that each squared norm reads a whole sum.
//!
//! Accumulators live the whole step, so the planner places their buffers at the end of the
//! arena and the host region ([`crate::plan::append_buffer`]; the exact peak grows by exactly
//! their bytes); the pass itself lays out each accumulator within its buffer. It does not reorder the micro-batch
//! program, share gradient memory with accumulators, or overlap the update with the last
//! micro-batch's backward pass.

use crate::error::{CompileError, Result};
use crate::plan::{aligned, append_buffer};
use protrain_ir::{
    BufferId, BufferKind, CopyKind, EventId, Instr, OpId, OpKind, Phase, Schedule, Space,
    StreamKind, TensorRef, ValueId,
};
use std::collections::HashMap;

/// Prepares a training graph for `k` micro-batches per step: its loss gradient becomes
/// `1 / k` ([`OpKind::CrossEntropyBackwardScaled`]), which is also how [`accumulate`] (and
/// the search's every candidate) learns `k`. For `k <= 1` it changes nothing.
///
/// Fails when `k` is 0 or the graph has no cross-entropy backward op to scale.
pub fn scale_loss_gradient(training: &mut protrain_ir::Graph, k: u64) -> Result<()> {
    if k == 0 {
        return Err(CompileError::NoMicroBatches);
    }
    if k == 1 {
        return Ok(());
    }
    // A loss-scaled (fp16) loss gradient keeps its scale and takes the share.
    let seeds: Vec<(OpId, OpKind)> = training
        .ops()
        .filter_map(|(id, op)| match op.kind {
            OpKind::CrossEntropyBackward => {
                Some((id, OpKind::CrossEntropyBackwardScaled { micro_batches: k }))
            }
            OpKind::CrossEntropyBackwardLossScaled { loss_scale, .. } => Some((
                id,
                OpKind::CrossEntropyBackwardLossScaled {
                    micro_batches: k,
                    loss_scale,
                },
            )),
            _ => None,
        })
        .collect();
    // The load-balancing loss's gradient takes the same share (each micro-batch's loss is its
    // own cross-entropy plus its own auxiliary loss, and the step's is their mean).
    let aux: Vec<(OpId, OpKind)> = training
        .ops()
        .filter_map(|(id, op)| match op.kind.clone() {
            OpKind::MoeAuxLossBackward {
                experts,
                top_k,
                layers,
                coef,
                loss_scale,
                ..
            } => Some((
                id,
                OpKind::MoeAuxLossBackward {
                    experts,
                    top_k,
                    layers,
                    coef,
                    micro_batches: k,
                    loss_scale,
                },
            )),
            _ => None,
        })
        .collect();
    if seeds.is_empty() {
        return Err(CompileError::NoLoss);
    }
    for (op, kind) in seeds.into_iter().chain(aux) {
        training.set_kind(op, kind)?;
    }
    Ok(())
}

/// Where an accumulator is laid out.
#[derive(Clone, Copy)]
enum Laid {
    /// At this offset of the accumulators' buffer of its space, appended to the space.
    Appended(u64),
    /// At this address: a sharded chunk's gradient in its gradient shard.
    At(TensorRef),
}

/// The gradient offloads into a sharded chunk's shard, by the shard buffer: where the copy
/// is (stream, index), its source and destination, and its bytes.
fn sharded_offloads(
    schedule: &Schedule,
) -> HashMap<BufferId, ((usize, usize), TensorRef, TensorRef, u64)> {
    let mut out = HashMap::new();
    for (s, stream) in schedule.streams.iter().enumerate() {
        for (i, instr) in stream.instrs.iter().enumerate() {
            if let Instr::Copy {
                what: CopyKind::OffloadGrads { .. },
                src,
                dst,
                bytes,
            } = *instr
            {
                if matches!(
                    schedule.buffer(dst.buffer).kind,
                    BufferKind::HostShard { .. }
                ) {
                    out.insert(dst.buffer, ((s, i), src, dst, bytes));
                }
            }
        }
    }
    out
}

/// A gradient's accumulator.
struct Acc {
    acc: ValueId,
    home: TensorRef,
    space: Space,
}

/// An AdamW kernel: its op, the gradient it reads and where.
type AdamW = (OpId, ValueId, TensorRef);

/// Where a sharded chunk's gradient was on the device before the offload the sums replace,
/// and where that offload is (stream, index), by AdamW op.
type OnDevice = HashMap<OpId, (TensorRef, (usize, usize))>;

/// The accumulators added to the graph before they are placed: each one's value, space and
/// layout, the accumulator of each gradient (an index into `laid`), the sum op of each AdamW
/// op, and the bytes appended to the device (`[0]`) and host (`[1]`) accumulators' buffers.
#[derive(Default)]
struct Added {
    laid: Vec<(ValueId, Space, Laid)>,
    acc_of: HashMap<ValueId, usize>,
    sum_of: HashMap<OpId, OpId>,
    used: [u64; 2],
}

/// The squared norms that read accumulators: the host ones (op, accumulator index), in op
/// order, with the workspace the largest of them needs, and the device ones.
struct Norms {
    host: Vec<(OpId, usize)>,
    device: HashMap<OpId, usize>,
    workspace: u64,
}

/// Makes `schedule` accumulate gradients over the micro-batches its graph's loss gradient is
/// scaled for ([`micro_batches`]); returns it unchanged for one.
///
/// Fails when the schedule lacks a stream the update program needs, or when two AdamW ops
/// read one gradient (compiler bugs).
pub fn accumulate(schedule: Schedule) -> Result<Schedule> {
    let k = schedule.graph.micro_batches();
    accumulate_micro_batches(schedule, k)
}

/// [`accumulate`] over `k` micro-batches per rank, whatever the loss gradient is scaled for:
/// in a data-parallel schedule it is scaled for `ranks x k` (see [`crate::data_parallel`]).
pub fn accumulate_micro_batches(mut schedule: Schedule, k: u64) -> Result<Schedule> {
    if k <= 1 {
        return Ok(schedule);
    }
    let micro_batches = u32::try_from(k).map_err(|_| {
        CompileError::BadOptimizer(format!(
            "{k} micro-batches per step is more than a schedule counts"
        ))
    })?;
    let adamws = adamw_kernels(&schedule);
    let on_device = sharded_gradients(&schedule, &adamws)?;
    let added = add_accumulators(&mut schedule, &adamws, &on_device)?;
    let norms = read_accumulators(&mut schedule, &added)?;
    let (accs, scratch) = place_accumulators(&mut schedule, &added, &norms);
    let moved = micro_batch_program(
        &mut schedule,
        &adamws,
        &on_device,
        &added,
        &accs,
        micro_batches,
    );
    update_program(&mut schedule, &moved, &accs, &norms, scratch)?;
    schedule.homes.extend(accs.iter().map(|a| (a.acc, a.home)));
    predict(&mut schedule, k, added.used[0]);
    Ok(schedule)
}

/// Finds the stream of `kind`; fails when the schedule has none (a compiler bug).
fn stream_of(s: &Schedule, kind: StreamKind) -> Result<usize> {
    s.streams
        .iter()
        .position(|st| st.kind == kind)
        .ok_or_else(|| {
            CompileError::Validation(format!(
                "accumulation needs a {kind:?} stream, the schedule has none"
            ))
        })
}

/// Every AdamW kernel, the gradient it reads and where.
fn adamw_kernels(schedule: &Schedule) -> Vec<AdamW> {
    let mut adamws = Vec::new();
    for stream in &schedule.streams {
        for instr in &stream.instrs {
            if let Instr::Kernel { op, inputs, .. } = instr {
                let o = schedule.graph.op(*op);
                if let OpKind::AdamW { .. } = o.kind {
                    adamws.push((*op, o.inputs[1], inputs[1]));
                }
            }
        }
    }
    adamws
}

/// A sharded chunk's gradients (see the module doc): for each AdamW reading its gradient
/// from a gradient shard, where the gradient was on the device before the offload that the
/// sums replace.
fn sharded_gradients(schedule: &Schedule, adamws: &[AdamW]) -> Result<OnDevice> {
    let offloads = sharded_offloads(schedule);
    let mut on_device = OnDevice::new();
    for &(op, grad, at) in adamws {
        let Some(&(place, src, dst, bytes)) = offloads.get(&at.buffer) else {
            continue;
        };
        let within = at.offset.checked_sub(dst.offset).filter(|o| *o < bytes);
        let Some(within) = within else {
            return Err(CompileError::Validation(format!(
                "{} is read at {:#x} in its chunk's gradient shard, outside the offload that \
                 fills it",
                schedule.graph.value(grad).name,
                at.offset
            )));
        };
        let device = TensorRef {
            buffer: src.buffer,
            offset: src.offset + within,
        };
        on_device.insert(op, (device, place));
    }
    Ok(on_device)
}

/// Adds an accumulator and its sum op for each AdamW's gradient and points the AdamW at the
/// accumulator; lays each out at its offset in its space's accumulators' buffer, or, for a
/// sharded chunk's gradient when the update does not read the norm, at the gradient's own
/// place in its shard.
fn add_accumulators(
    schedule: &mut Schedule,
    adamws: &[AdamW],
    on_device: &OnDevice,
) -> Result<Added> {
    let norms = crate::shard::reads_global_norm(&schedule.graph);
    let mut added = Added::default();
    for &(op, grad, at) in adamws {
        if added.acc_of.contains_key(&grad) {
            return Err(CompileError::Validation(format!(
                "{} is read by two AdamW ops; accumulation sums each gradient once",
                schedule.graph.value(grad).name
            )));
        }
        let o = schedule.graph.op(op).clone();
        let ty = schedule.graph.value(grad).ty.clone();
        let name = format!("accum.{}", schedule.graph.value(o.inputs[0]).name);
        let acc = schedule.graph.add_accumulator(name, ty.clone());
        schedule.graph.add_op_multi(
            OpKind::AccumulateGrad,
            &[acc, grad],
            &[],
            o.block,
            Phase::Backward,
        )?;
        added
            .sum_of
            .insert(op, OpId::new(schedule.graph.op_count() - 1));
        schedule.graph.set_input(op, 1, acc)?;
        let space = schedule.buffer(at.buffer).space;
        if on_device.contains_key(&op) && !norms {
            added.laid.push((acc, space, Laid::At(at)));
        } else {
            let slot = &mut added.used[usize::from(space == Space::Host)];
            added.laid.push((acc, space, Laid::Appended(*slot)));
            *slot += aligned(ty.bytes());
        }
        added.acc_of.insert(grad, added.laid.len() - 1);
    }
    Ok(added)
}

/// Points the squared norms at the accumulators; those of host ones need host scratch for
/// their results and (shared, they run in turn) workspace.
fn read_accumulators(schedule: &mut Schedule, added: &Added) -> Result<Norms> {
    let mut norms = Norms {
        host: Vec::new(),
        device: HashMap::new(),
        workspace: 0,
    };
    // In accumulator order (that of the AdamW ops): rewiring an input moves the graph's
    // edges, so the order of the rewiring is part of the schedule file, which must be the
    // same on every run.
    let mut grads: Vec<(ValueId, usize)> = added.acc_of.iter().map(|(&g, &i)| (g, i)).collect();
    grads.sort_by_key(|&(_, i)| i);
    for (grad, i) in grads {
        for op in schedule.graph.users(grad) {
            if schedule.graph.op(op).kind != OpKind::GradNormSq {
                continue;
            }
            schedule.graph.set_input(op, 0, added.laid[i].0)?;
            match added.laid[i].1 {
                // Accumulators are laid out before anything moves to disk.
                Space::Host | Space::Disk => {
                    let o = schedule.graph.op(op);
                    let types: Vec<_> = o
                        .inputs
                        .iter()
                        .map(|v| &schedule.graph.value(*v).ty)
                        .collect();
                    norms.workspace = norms.workspace.max(o.kind.workspace_bytes(&types));
                    norms.host.push((op, i));
                }
                Space::Device => {
                    norms.device.insert(op, i);
                }
            }
        }
    }
    norms.host.sort();
    Ok(norms)
}

/// Has the planner place the accumulators' buffers and the host update scratch
/// ([`append_buffer`]); returns each accumulator's home and the scratch buffer, if any.
fn place_accumulators(
    schedule: &mut Schedule,
    added: &Added,
    norms: &Norms,
) -> (Vec<Acc>, Option<BufferId>) {
    let mut buffer_of = [None, None];
    for (space, name) in [
        (Space::Device, "accumulators"),
        (Space::Host, "host accumulators"),
    ] {
        let bytes = added.used[usize::from(space == Space::Host)];
        if bytes > 0 {
            buffer_of[usize::from(space == Space::Host)] = Some(append_buffer(
                schedule,
                name,
                space,
                BufferKind::Accumulators,
                bytes,
            ));
        }
    }
    let scratch_bytes = aligned(4) * norms.host.len() as u64 + norms.workspace;
    let scratch = (!norms.host.is_empty()).then(|| {
        append_buffer(
            schedule,
            "host update scratch",
            Space::Host,
            BufferKind::HostScratch,
            scratch_bytes,
        )
    });
    let accs = added
        .laid
        .iter()
        .map(|&(acc, space, laid)| Acc {
            acc,
            space,
            home: match laid {
                Laid::At(home) => home,
                Laid::Appended(offset) => TensorRef {
                    buffer: buffer_of[usize::from(space == Space::Host)].expect("appended above"),
                    offset,
                },
            },
        })
        .collect();
    (accs, scratch)
}

/// Makes each stream's program the micro-batch program: each AdamW becomes its gradient's
/// sum, where it was (a sharded chunk's, where its offload was); the rest of the optimizer
/// moves to the update, returned in stream order; every record and wait stays; each stream
/// ends with its micro-batch marker.
fn micro_batch_program(
    schedule: &mut Schedule,
    adamws: &[AdamW],
    on_device: &OnDevice,
    added: &Added,
    accs: &[Acc],
    micro_batches: u32,
) -> Vec<Instr> {
    // The sum of AdamW `op`'s gradient, read at `grad_at`, into its accumulator.
    let sum = |op: OpId, grad: ValueId, grad_at: TensorRef| Instr::Kernel {
        op: added.sum_of[&op],
        inputs: vec![accs[added.acc_of[&grad]].home, grad_at],
        outputs: vec![],
        workspace: None,
    };
    // A sharded chunk's sums take the place of its gradient offload, reading the gradients
    // on the device, in the order of their AdamW ops.
    let mut at_offload: HashMap<(usize, usize), Vec<Instr>> = HashMap::new();
    for &(op, grad, _) in adamws {
        if let Some(&(device, place)) = on_device.get(&op) {
            at_offload
                .entry(place)
                .or_default()
                .push(sum(op, grad, device));
        }
    }
    let mut moved: Vec<Instr> = Vec::new();
    for (s, stream) in schedule.streams.iter_mut().enumerate() {
        let mut kept = Vec::with_capacity(stream.instrs.len() + 1);
        for (i, instr) in std::mem::take(&mut stream.instrs).into_iter().enumerate() {
            if let Some(sums) = at_offload.remove(&(s, i)) {
                kept.extend(sums);
                continue;
            }
            match &instr {
                Instr::Kernel { op, inputs, .. } => match schedule.graph.op(*op).kind {
                    OpKind::AdamW { .. } => {
                        if !on_device.contains_key(op) {
                            let grad = schedule.graph.op(added.sum_of[op]).inputs[1];
                            kept.push(sum(*op, grad, inputs[1]));
                        }
                        moved.push(instr);
                    }
                    OpKind::GradNormSq | OpKind::ClipCoef { .. } | OpKind::UnscaleCoef { .. } => {
                        moved.push(instr)
                    }
                    _ => kept.push(instr),
                },
                Instr::Copy {
                    what: CopyKind::Scalar { .. },
                    ..
                } => moved.push(instr),
                _ => kept.push(instr),
            }
        }
        kept.push(Instr::EndMicroBatch { micro_batches });
        stream.instrs = kept;
    }
    moved
}

/// Appends the update program to the streams: squared norms (device ones where the
/// gradients' were, host ones on the host optimizer, their results then copied to where the
/// gradients' were on the device), the clip coefficient, device AdamW, the coefficient's
/// copy, host AdamW.
fn update_program(
    schedule: &mut Schedule,
    moved: &[Instr],
    accs: &[Acc],
    norms: &Norms,
    scratch: Option<BufferId>,
) -> Result<()> {
    let graph = &schedule.graph;
    let home_of = |v: ValueId| accs.iter().find(|a| a.acc == v).map(|a| (a.home, a.space));
    let reading_acc = |instr: &Instr, index: usize| -> (Instr, Option<Space>) {
        let mut instr = instr.clone();
        let mut space = None;
        if let Instr::Kernel { op, inputs, .. } = &mut instr {
            if let Some((home, s)) = home_of(graph.op(*op).inputs[index]) {
                inputs[index] = home;
                space = Some(s);
            }
        }
        (instr, space)
    };
    let kind_of = |i: &Instr| match i {
        Instr::Kernel { op, .. } => Some(&graph.op(*op).kind),
        _ => None,
    };
    let compute = stream_of(schedule, StreamKind::Compute)?;
    let mut update: Vec<Vec<Instr>> = vec![Vec::new(); schedule.streams.len()];
    let mut events = schedule.events;
    let mut event = || {
        events += 1;
        EventId(events - 1)
    };
    for instr in moved
        .iter()
        .filter(|i| kind_of(i) == Some(&OpKind::GradNormSq))
    {
        if let Instr::Kernel { op, .. } = instr {
            if norms.device.contains_key(op) {
                update[compute].push(reading_acc(instr, 0).0);
            }
        }
    }
    if let Some(scratch) = scratch {
        let host = stream_of(schedule, StreamKind::HostOptimizer)?;
        let h2d = stream_of(schedule, StreamKind::HostToDevice)?;
        let uploads = host_norms(schedule, moved, accs, norms, scratch, &mut update[host])?;
        let (normed, uploaded) = (event(), event());
        update[host].push(Instr::Record { event: normed });
        // Device norms' workspaces may lie where the uploads land: upload after them.
        if !update[compute].is_empty() {
            let device_normed = event();
            update[compute].push(Instr::Record {
                event: device_normed,
            });
            update[h2d].push(Instr::Wait {
                event: device_normed,
            });
        }
        update[h2d].push(Instr::Wait { event: normed });
        update[h2d].extend(uploads);
        update[h2d].push(Instr::Record { event: uploaded });
        update[compute].push(Instr::Wait { event: uploaded });
    }
    if let Some(clip) = moved
        .iter()
        .find(|i| kind_of(i).is_some_and(OpKind::is_grad_coef))
    {
        update[compute].push(clip.clone());
    }
    let mut host_adamw = Vec::new();
    for instr in moved
        .iter()
        .filter(|i| matches!(kind_of(i), Some(OpKind::AdamW { .. })))
    {
        match reading_acc(instr, 1) {
            (instr, Some(Space::Host)) => host_adamw.push(instr),
            (instr, _) => update[compute].push(instr),
        }
    }
    if !host_adamw.is_empty() {
        let host = stream_of(schedule, StreamKind::HostOptimizer)?;
        if let Some(copy) = moved.iter().find(|i| matches!(i, Instr::Copy { .. })) {
            let d2h = stream_of(schedule, StreamKind::DeviceToHost)?;
            let (clipped, copied) = (event(), event());
            update[compute].push(Instr::Record { event: clipped });
            update[d2h].push(Instr::Wait { event: clipped });
            update[d2h].push(copy.clone());
            update[d2h].push(Instr::Record { event: copied });
            update[host].push(Instr::Wait { event: copied });
        }
        update[host].extend(host_adamw);
    }
    for (stream, tail) in schedule.streams.iter_mut().zip(update) {
        stream.instrs.extend(tail);
    }
    schedule.events = events;
    Ok(())
}

/// The host accumulators' squared norms, pushed to the host optimizer's update program
/// `host`, each into its slot of the scratch buffer (its workspace after the slots); returns
/// the copies of their results to where each gradient's squared norm was on the device, for
/// the clip coefficient.
fn host_norms(
    schedule: &Schedule,
    moved: &[Instr],
    accs: &[Acc],
    norms: &Norms,
    scratch: BufferId,
    host: &mut Vec<Instr>,
) -> Result<Vec<Instr>> {
    let graph = &schedule.graph;
    let workspace = TensorRef {
        buffer: scratch,
        offset: aligned(4) * norms.host.len() as u64,
    };
    let mut uploads = Vec::with_capacity(norms.host.len());
    for (n, &(op, i)) in norms.host.iter().enumerate() {
        let at = TensorRef {
            buffer: scratch,
            offset: aligned(4) * n as u64,
        };
        let o = graph.op(op);
        let types: Vec<_> = o.inputs.iter().map(|v| &graph.value(*v).ty).collect();
        host.push(Instr::Kernel {
            op,
            inputs: vec![accs[i].home],
            outputs: vec![at],
            workspace: (o.kind.workspace_bytes(&types) > 0).then_some(workspace),
        });
        let on_device = moved.iter().find_map(|instr| match instr {
            Instr::Kernel {
                op: o2, outputs, ..
            } if *o2 == op => Some(outputs[0]),
            _ => None,
        });
        let Some(dst) = on_device else {
            return Err(CompileError::Validation(format!(
                "no device address for the squared norm {}",
                graph.value(o.outputs[0]).name
            )));
        };
        uploads.push(Instr::Copy {
            what: CopyKind::Scalar {
                value: o.outputs[0],
            },
            src: at,
            dst,
            bytes: 4,
        });
    }
    Ok(uploads)
}

/// The prediction: `k` micro-batches of work, and the accumulators' memory (`device_bytes` of
/// them on the device).
fn predict(schedule: &mut Schedule, k: u64, device_bytes: u64) {
    let graph = &schedule.graph;
    let flops: u64 = graph
        .ops()
        .map(|(_, op)| {
            let ins: Vec<_> = op.inputs.iter().map(|&v| &graph.value(v).ty).collect();
            let outs: Vec<_> = op.outputs.iter().map(|&v| &graph.value(v).ty).collect();
            let once = op.kind.flops(&ins, &outs);
            match op.phase {
                Phase::Optimizer => once,
                _ => k * once,
            }
        })
        .sum();
    let p = &mut schedule.header.prediction;
    p.flops = flops;
    p.peak_device_bytes = schedule.arena_bytes;
    p.lower_bound_bytes += device_bytes;
    p.host_bytes = schedule.host_bytes;
    p.memory.persistent += device_bytes;
}
