//! A placement policy: which chunks stay on the device, how many chunk buffers stream the
//! rest, and what each transformer block does with its activations.

use serde::{Deserialize, Serialize};
use std::fmt;

/// What a transformer block does with the activations its backward pass needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockMode {
    /// Keep them on the device until the backward pass.
    Keep,
    /// Keep only the block's input; recompute the rest just before the block's backward pass.
    Checkpoint,
    /// Copy them to host memory after the forward pass and back before the backward pass.
    Swap,
}

impl BlockMode {
    /// One letter for compact printing: `K`, `C`, `S`.
    pub fn letter(self) -> char {
        match self {
            BlockMode::Keep => 'K',
            BlockMode::Checkpoint => 'C',
            BlockMode::Swap => 'S',
        }
    }
}

/// A placement policy.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Policy {
    /// Chunks `0..n_persist` stay on the device all step and are updated there.
    pub n_persist: u32,
    /// Device buffers the other chunks are fetched into, in turn.
    pub n_buffer: u32,
    /// One mode per transformer layer, in forward order.
    pub blocks: Vec<BlockMode>,
    /// How many chunks ahead of use a fetch is issued (1: the next chunk while this one runs).
    pub prefetch: u32,
}

impl Policy {
    /// Everything on the device: every chunk persistent, every block kept.
    pub fn resident(chunks: u32, layers: usize) -> Self {
        Self {
            n_persist: chunks,
            n_buffer: 0,
            blocks: vec![BlockMode::Keep; layers],
            prefetch: 1,
        }
    }

    /// ProTrain's layout: `n_swap` swapped and `n_checkpoint` checkpointed blocks first, the
    /// swapped ones spread evenly among the checkpointed ones (so swap traffic overlaps
    /// recomputation), and the remaining blocks kept.
    pub fn protrain(
        n_persist: u32,
        n_buffer: u32,
        n_swap: usize,
        n_checkpoint: usize,
        layers: usize,
    ) -> Self {
        Self {
            n_persist,
            n_buffer,
            blocks: (0..layers)
                .map(|l| Self::protrain_mode(l, n_swap, n_checkpoint, layers))
                .collect(),
            prefetch: 1,
        }
    }

    /// Layer `l`'s mode in ProTrain's layout (see [`Policy::protrain`]), without building the
    /// policy: the search estimates hundreds of thousands of layouts this way.
    pub fn protrain_mode(l: usize, n_swap: usize, n_checkpoint: usize, layers: usize) -> BlockMode {
        let prefix = (n_swap + n_checkpoint).min(layers);
        let n_swap = n_swap.min(prefix);
        // Bresenham: exactly n_swap of the prefix, evenly spread, the first block swapped.
        if l >= prefix {
            BlockMode::Keep
        } else if (l * n_swap) % prefix < n_swap {
            BlockMode::Swap
        } else {
            BlockMode::Checkpoint
        }
    }

    /// How DeepSpeed ZeRO-3 offload and FSDP CPU offload run: every chunk on the host,
    /// streamed through `n_buffer` buffers, every block checkpointed.
    pub fn zero3_offload(n_buffer: u32, layers: usize) -> Self {
        Self {
            n_persist: 0,
            n_buffer,
            blocks: vec![BlockMode::Checkpoint; layers],
            prefetch: 1,
        }
    }

    /// Colossal-AI Gemini's static placement: the first `fraction` of the chunks on the
    /// device, the rest offloaded, every block checkpointed.
    pub fn gemini(fraction: f64, chunks: u32, n_buffer: u32, layers: usize) -> Self {
        let n_persist = ((chunks as f64) * fraction.clamp(0.0, 1.0)).floor() as u32;
        Self {
            n_persist,
            n_buffer,
            blocks: vec![BlockMode::Checkpoint; layers],
            prefetch: 1,
        }
    }

    /// Blocks in a mode.
    pub fn count(&self, mode: BlockMode) -> usize {
        self.blocks.iter().filter(|&&m| m == mode).count()
    }
}

impl fmt::Display for Policy {
    /// `n_persist=3 n_buffer=2 prefetch=1 blocks=SCSCKKKK`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let blocks: String = self.blocks.iter().map(|m| m.letter()).collect();
        write!(
            f,
            "n_persist={} n_buffer={} prefetch={} blocks={}",
            self.n_persist,
            self.n_buffer,
            self.prefetch,
            if blocks.is_empty() {
                "-".into()
            } else {
                blocks
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protrain_layout_interleaves_swaps_among_checkpoints_and_keeps_the_rest() {
        let p = Policy::protrain(1, 2, 2, 4, 8);
        assert_eq!(
            p.to_string(),
            "n_persist=1 n_buffer=2 prefetch=1 blocks=SCCSCCKK"
        );
        assert_eq!(p.count(BlockMode::Swap), 2);
        assert_eq!(p.count(BlockMode::Checkpoint), 4);
        assert_eq!(p.count(BlockMode::Keep), 2);
        let all_swap = Policy::protrain(0, 1, 4, 0, 4);
        assert_eq!(all_swap.count(BlockMode::Swap), 4);
        let clamped = Policy::protrain(0, 1, 10, 10, 3);
        assert_eq!(clamped.blocks.len(), 3);
    }

    #[test]
    fn other_systems_policies() {
        assert_eq!(
            Policy::zero3_offload(2, 3).to_string(),
            "n_persist=0 n_buffer=2 prefetch=1 blocks=CCC"
        );
        assert_eq!(Policy::gemini(0.5, 9, 2, 2).n_persist, 4);
        assert_eq!(
            Policy::resident(5, 2).to_string(),
            "n_persist=5 n_buffer=0 prefetch=1 blocks=KK"
        );
    }
}
