//! Chunking: packs parameters into equal-size chunks in the order the forward pass first
//! uses them (PatrickStar), choosing the chunk size that wastes the least.
//!
//! A parameter is never split across chunks, so the chunk size is at least the largest
//! parameter. The pass tries sizes from that up to four times it and keeps the one with the
//! least unused capacity (ties go to the smaller size, which streams in finer steps). It
//! does not decide where chunks live; `place` does.

use protrain_ir::{Chunk, ChunkId, ChunkMember, ChunkSizeTrial, ChunkTable, Graph, ParamId, Phase};

/// Parameters start at multiples of this many bytes inside a chunk, so every tensor a
/// kernel reads is aligned for vector loads.
pub const PARAM_ALIGN: u64 = 256;

/// Size candidates tried between the largest parameter and four times it.
const TRIALS: u64 = 48;

/// Packs the graph's parameters into chunks; `world_size` ranks share them round-robin.
pub fn chunk(graph: &Graph, world_size: u32) -> ChunkTable {
    let order = first_use_order(graph);
    let sizes: Vec<u64> = order
        .iter()
        .map(|&p| graph.value(graph.param(p).value).ty.bytes())
        .collect();
    let largest = sizes.iter().copied().max().unwrap_or(0).max(1);
    let base = align_up(largest, PARAM_ALIGN);
    let mut trials: Vec<ChunkSizeTrial> = (0..=TRIALS)
        .map(|i| align_up(base + base * 3 * i / TRIALS, PARAM_ALIGN))
        .map(|chunk_bytes| {
            let (chunks, used) = pack(&sizes, chunk_bytes);
            ChunkSizeTrial {
                chunk_bytes,
                chunks: chunks.len() as u32,
                waste_bytes: chunks.len() as u64 * chunk_bytes - used,
            }
        })
        .collect();
    trials.sort_by_key(|t| (t.waste_bytes, t.chunk_bytes));
    trials.dedup_by_key(|t| t.chunk_bytes);
    let chunk_bytes = trials[0].chunk_bytes;
    let (packed, _) = pack(&sizes, chunk_bytes);

    let mut param_chunk = vec![(ChunkId(0), 0); graph.params().len()];
    let world_size = world_size.max(1);
    let chunks = packed
        .iter()
        .enumerate()
        .map(|(c, members)| {
            let members: Vec<ChunkMember> = members
                .iter()
                .map(|&(i, offset)| {
                    let param = order[i];
                    param_chunk[param.index()] = (ChunkId::new(c), offset);
                    ChunkMember {
                        param,
                        offset,
                        bytes: sizes[i],
                    }
                })
                .collect();
            let used_bytes = members.last().map_or(0, |m| m.offset + m.bytes);
            Chunk {
                members,
                used_bytes,
                owner: c as u32 % world_size,
            }
        })
        .collect();
    trials.truncate(8);
    ChunkTable {
        chunk_bytes,
        chunks,
        world_size,
        param_chunk,
        trials,
    }
}

/// Parameters in the order the forward ops first read them; any parameter no forward op
/// reads comes last, in declaration order.
fn first_use_order(graph: &Graph) -> Vec<ParamId> {
    let mut seen = vec![false; graph.params().len()];
    let mut order = Vec::with_capacity(seen.len());
    for (_, op) in graph.ops().filter(|(_, op)| op.phase == Phase::Forward) {
        for &input in &op.inputs {
            if let Some(p) = graph.param_of(input) {
                if !std::mem::replace(&mut seen[p.index()], true) {
                    order.push(p);
                }
            }
        }
    }
    order.extend(
        graph
            .params()
            .map(|(id, _)| id)
            .filter(|id| !seen[id.index()]),
    );
    order
}

/// Next-fit packing in order: each chunk holds `(index, offset)` pairs; also returns the
/// bytes used (padding included, so the waste counts what alignment costs too).
fn pack(sizes: &[u64], chunk_bytes: u64) -> (Vec<Vec<(usize, u64)>>, u64) {
    let mut chunks: Vec<Vec<(usize, u64)>> = Vec::new();
    let mut fill = chunk_bytes;
    let mut used = 0;
    for (i, &size) in sizes.iter().enumerate() {
        let offset = align_up(fill, PARAM_ALIGN);
        if chunks.is_empty() || offset + size > chunk_bytes {
            chunks.push(vec![(i, 0)]);
            fill = size;
        } else {
            chunks.last_mut().expect("a chunk exists").push((i, offset));
            fill = offset + size;
        }
    }
    for chunk in &chunks {
        let &(last, offset) = chunk.last().expect("chunks are never empty");
        used += offset + sizes[last];
    }
    (chunks, used)
}

fn align_up(x: u64, align: u64) -> u64 {
    x.div_ceil(align) * align
}
