//! The chunk table: parameters packed into fixed-size chunks in first-use order (PatrickStar).

use crate::ids::{ChunkId, ParamId};
use serde::{Deserialize, Serialize};

/// A parameter's place in its chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkMember {
    /// The parameter.
    pub param: ParamId,
    /// Byte offset of the parameter inside the chunk.
    pub offset: u64,
    /// Bytes the parameter takes.
    pub bytes: u64,
}

/// One chunk: parameters laid out back to back in the order they are first used.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunk {
    /// Its parameters, by increasing offset.
    pub members: Vec<ChunkMember>,
    /// Bytes its parameters take (the rest of the chunk is waste).
    pub used_bytes: u64,
    /// The rank that owns it when sharded (`index mod world_size`).
    pub owner: u32,
}

/// One chunk size the search tried.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkSizeTrial {
    /// Capacity of every chunk, in bytes.
    pub chunk_bytes: u64,
    /// Chunks needed.
    pub chunks: u32,
    /// Capacity left unused over all chunks.
    pub waste_bytes: u64,
}

/// Every chunk, the capacity they share, and where each parameter sits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkTable {
    /// Capacity of every chunk (a chunk buffer's size), in bytes of the parameters' element
    /// type: the packing size, or a parameter's own chunk where one is larger.
    pub chunk_bytes: u64,
    /// The chunks, in first-use order.
    pub chunks: Vec<Chunk>,
    /// Ranks the chunks are sharded over (only 1 runs today).
    pub world_size: u32,
    /// For each parameter (by [`ParamId`]), its chunk and offset.
    pub param_chunk: Vec<(ChunkId, u64)>,
    /// The chunk sizes the search tried, best first.
    pub trials: Vec<ChunkSizeTrial>,
}

impl ChunkTable {
    /// Number of chunks.
    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    /// Whether there are no chunks.
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// A chunk.
    pub fn chunk(&self, id: ChunkId) -> &Chunk {
        &self.chunks[id.index()]
    }

    /// Every chunk with its id.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (ChunkId, &Chunk)> {
        self.chunks
            .iter()
            .enumerate()
            .map(|(i, c)| (ChunkId::new(i), c))
    }

    /// The chunk holding a parameter and the parameter's byte offset in it.
    pub fn locate(&self, param: ParamId) -> (ChunkId, u64) {
        self.param_chunk[param.index()]
    }

    /// Capacity left unused over all chunks.
    pub fn waste_bytes(&self) -> u64 {
        self.chunks
            .iter()
            .map(|c| self.chunk_bytes - c.used_bytes)
            .sum()
    }
}
