//! Chunking: packs parameters into equal-size chunks in the order the forward pass first
//! uses them (PatrickStar), choosing the chunk size that wastes the least.
//!
//! A parameter is never split across chunks. [`chunk`] tries packing sizes from the largest
//! parameter up to four times it and keeps the one with the least unused capacity (ties go to
//! the smaller size, which streams in finer steps). Where a parameter outside the transformer
//! layers is more than four times the largest inside them (a large vocabulary's embedding:
//! Gemma-2-9B's is 18 times its largest layer weight), every chunk is then that parameter's
//! size, and a device that must hold two chunk buffers of it may not fit. [`chunk_apart`] packs
//! such a model with sizes from the layers' largest instead, each parameter larger than the
//! packing size a chunk of its own, sized to it (as PatrickStar treats embeddings): the
//! table's capacity (a chunk buffer's size) is that parameter's, and the other chunks stream
//! in the layers' finer steps. The pipeline takes it where no policy fits the first table.
//! Neither decides where chunks live; `place` does.

use protrain_ir::{
    BlockKind, Chunk, ChunkId, ChunkMember, ChunkSizeTrial, ChunkTable, Graph, ParamId, Phase,
};

/// Parameters start at multiples of this many bytes inside a chunk, so every tensor a
/// kernel reads is aligned for vector loads.
pub const PARAM_ALIGN: u64 = 256;

/// Size candidates tried between the largest parameter and four times it.
const TRIALS: u64 = 48;

/// Packs the graph's parameters into chunks; `world_size` ranks share them round-robin.
pub fn chunk(graph: &Graph, world_size: u32) -> ChunkTable {
    let (largest, _) = largest_sizes(graph);
    pack_from(graph, world_size, largest)
}

/// The chunks [`chunk`] makes with sizes from the layers' largest parameter, each parameter
/// larger than the packing size a chunk of its own; `None` where no parameter is more than four
/// times the layers' largest (then [`chunk`]'s table is as fine as the layers allow).
pub fn chunk_apart(graph: &Graph, world_size: u32) -> Option<ChunkTable> {
    let (largest, in_layers) = largest_sizes(graph);
    (largest > 4 * in_layers).then(|| pack_from(graph, world_size, in_layers))
}

/// The largest parameter and the largest a layer reads, aligned.
fn largest_sizes(graph: &Graph) -> (u64, u64) {
    let largest = graph
        .params()
        .map(|(_, p)| graph.value(p.value).ty.bytes())
        .max()
        .unwrap_or(0);
    let in_layers = largest_in_layers(graph);
    (
        align_up(largest.max(1), PARAM_ALIGN),
        align_up(in_layers.max(1), PARAM_ALIGN),
    )
}

/// Packs with the least wasteful size from `base` to four times it.
fn pack_from(graph: &Graph, world_size: u32, base: u64) -> ChunkTable {
    let order = first_use_order(graph);
    let sizes: Vec<u64> = order
        .iter()
        .map(|&p| graph.value(graph.param(p).value).ty.bytes())
        .collect();
    let largest = align_up(sizes.iter().copied().max().unwrap_or(0).max(1), PARAM_ALIGN);
    let mut trials: Vec<ChunkSizeTrial> = (0..=TRIALS)
        .map(|i| align_up(base + base * 3 * i / TRIALS, PARAM_ALIGN))
        .map(|chunk_bytes| {
            let (chunks, _) = pack(&sizes, chunk_bytes);
            // A chunk of its own (a parameter beyond the packing size) wastes nothing.
            let waste_bytes = chunks
                .iter()
                .map(|c| chunk_bytes.saturating_sub(used_of(c, &sizes)))
                .sum();
            ChunkSizeTrial {
                chunk_bytes,
                chunks: chunks.len() as u32,
                waste_bytes,
            }
        })
        .collect();
    trials.sort_by_key(|t| (t.waste_bytes, t.chunk_bytes));
    trials.dedup_by_key(|t| t.chunk_bytes);
    let (packed, _) = pack(&sizes, trials[0].chunk_bytes);
    // Every chunk fits the table's capacity: the packing size, or a larger parameter's own
    // chunk.
    let chunk_bytes = trials[0].chunk_bytes.max(largest);

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

/// The largest parameter a transformer layer's forward ops read (0 for a model without
/// layers).
fn largest_in_layers(graph: &Graph) -> u64 {
    graph
        .ops()
        .filter(|(_, op)| op.phase == Phase::Forward)
        .filter(|(_, op)| matches!(graph.block(op.block).kind, BlockKind::Layer(_)))
        .flat_map(|(_, op)| op.inputs.iter().filter_map(|&v| graph.param_of(v)))
        .map(|p| graph.value(graph.param(p).value).ty.bytes())
        .max()
        .unwrap_or(0)
}

/// Bytes a packed chunk's members take, padding between them included.
fn used_of(chunk: &[(usize, u64)], sizes: &[u64]) -> u64 {
    chunk
        .last()
        .map_or(0, |&(last, offset)| offset + sizes[last])
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
