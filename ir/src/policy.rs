//! A placement policy: which chunks stay on the device, how many chunk buffers stream the
//! rest, and what each transformer block does with its activations.

use crate::error::{IrError, Result};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

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

    /// The mode a letter names ([`BlockMode::letter`], either case).
    pub fn from_letter(letter: char) -> Option<Self> {
        match letter.to_ascii_uppercase() {
            'K' => Some(BlockMode::Keep),
            'C' => Some(BlockMode::Checkpoint),
            'S' => Some(BlockMode::Swap),
            _ => None,
        }
    }
}

/// Layers a `blocks=` value may name at most: a count in its text must not make the parser
/// allocate without bound.
pub const MAX_BLOCKS: usize = 1 << 20;

/// Block modes in their compact text form: each run of one mode as its letter, followed by
/// the run's length when longer than one (`S3C2K27` for three swapped, two checkpointed and
/// 27 kept blocks); `-` for none. [`parse_blocks`] reads it back.
pub fn format_blocks(modes: &[BlockMode]) -> String {
    if modes.is_empty() {
        return "-".into();
    }
    let mut out = String::new();
    let mut i = 0;
    while i < modes.len() {
        let run = modes[i..].iter().take_while(|&&m| m == modes[i]).count();
        out.push(modes[i].letter());
        if run > 1 {
            out.push_str(&run.to_string());
        }
        i += run;
    }
    out
}

/// Block modes from text: letters (either case), each optionally followed by a count of
/// repeats, so both the compact form [`format_blocks`] prints (`S3C2K27`) and one letter per
/// layer (`SSSCCKKK`) read; `-` is none. The error says what is wrong with the text.
pub fn parse_blocks(text: &str) -> std::result::Result<Vec<BlockMode>, String> {
    if text == "-" {
        return Ok(Vec::new());
    }
    let mut modes = Vec::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        let Some(mode) = BlockMode::from_letter(c) else {
            return Err(if c.is_ascii_digit() {
                format!("blocks={text} has a count `{c}` with no mode letter before it")
            } else {
                format!(
                    "block mode `{c}` in blocks={text} is not K (keep), C (checkpoint) or S (swap)"
                )
            });
        };
        let mut digits = String::new();
        while let Some(d) = chars.next_if(char::is_ascii_digit) {
            digits.push(d);
        }
        let run = if digits.is_empty() {
            1
        } else {
            match digits.parse::<usize>() {
                Ok(n) if n > 0 => n,
                _ => {
                    return Err(format!(
                        "blocks={text}: `{c}{digits}` repeats a mode {digits} times; give a                          count from 1 up"
                    ))
                }
            }
        };
        if modes.len().saturating_add(run) > MAX_BLOCKS {
            return Err(format!(
                "blocks={text} names more than {MAX_BLOCKS} layers; give one mode per layer of                  the model"
            ));
        }
        modes.extend(std::iter::repeat_n(mode, run));
    }
    Ok(modes)
}

/// How an offloaded (non-persistent) chunk keeps its model state in host memory, in bytes per
/// parameter for mixed precision (bf16 or f16 parameters with f32 master weights and moments).
///
/// - [`HostLayout::Full`], 16 bytes: the narrow parameters, their narrow gradients, and the
///   f32 master weight, Adam `m` and `v`, each in storage of its own.
/// - [`HostLayout::GradsInParams`], 14 bytes (PatrickStar's reuse): the gradients have no
///   storage of their own. Once a chunk's parameters have been uploaded for the last time in a
///   step (the backward pass reads them too), its gradient offload lands in the chunk's host
///   parameter storage, and the CPU Adam reads each gradient element there before it writes
///   the new parameter (the f32 master rounded, as always) over it, ready for the next step's
///   first upload. The compiler uses it for a chunk only where every upload of the chunk is
///   ordered before its gradient offload and the step takes one micro-batch (accumulation
///   uploads the parameters again after the gradients arrive); other chunks, and f32
///   schedules (whose parameter is its own master weight), keep the full layout. The
///   verifier's data flow proves each such reuse: a fetch that reads the storage after the
///   gradients arrived reads gradients where it must read parameters, and is refused.
/// - [`HostLayout::Staged`], 12 bytes (the floor: the f32 master and the two moments): the
///   chunk keeps no narrow copy at all. Before each upload a host cast stream rounds its f32
///   master weights into one of two host parameter staging buffers
///   ([`BufferKind::ParamStaging`](crate::BufferKind::ParamStaging)), exactly as the CPU Adam
///   rounds the master into the parameter in the other layouts, and the upload copies from
///   there; the buffers alternate, so the cast of the next chunk overlaps this chunk's upload.
///   Its gradients are offloaded into one of two host gradient staging buffers
///   ([`BufferKind::GradStaging`](crate::BufferKind::GradStaging)), where the CPU Adam reads
///   them (writing the rounded parameter over each gradient it read, which the next offload
///   into that buffer overwrites: the master carries the update). The pools are fixed, four
///   chunks' bytes whatever the number of staged chunks. It applies where the 14-byte layout
///   does and, besides, only on one rank and where the update reads no global coefficient:
///   gradient clipping by global norm and fp16's loss-scale overflow check need every
///   gradient of the step before the first update, so the gradients would need a home until
///   then, which is what the 14-byte layout gives them; such schedules keep 14 bytes as
///   their floor. `limit` stages at most that many chunks (the search's per-chunk choice:
///   the chunks uploaded fewest times per step first, as each upload costs a cast), the
///   other eligible chunks taking 14 bytes; `None` stages every eligible chunk.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum HostLayout {
    /// 16 bytes per parameter: parameters, gradients, master and moments apart.
    #[default]
    Full,
    /// 14 bytes per parameter: gradients land in the parameter storage after its last upload.
    GradsInParams,
    /// 12 bytes per parameter: uploads cast from the master through staging buffers,
    /// gradients consumed from staging buffers; at most `limit` chunks (the others 14).
    Staged {
        /// How many offloaded chunks are staged at most (`None`: every one that can be).
        limit: Option<u32>,
    },
}

impl HostLayout {
    /// Every eligible offloaded chunk staged (12 bytes per parameter).
    pub const STAGED: HostLayout = HostLayout::Staged { limit: None };

    /// Host bytes per parameter of an offloaded chunk in this layout, with narrow parameters of
    /// `narrow` bytes each (2 for bf16 and f16): parameters, gradients, f32 master, m and v.
    pub fn bytes_per_param(self, narrow: u64) -> u64 {
        match self {
            HostLayout::Full => 2 * narrow + 12,
            HostLayout::GradsInParams => narrow + 12,
            HostLayout::Staged { .. } => 12,
        }
    }

    /// The number the text form uses: the bytes per bf16 parameter (16, 14, 12).
    pub fn number(self) -> u32 {
        self.bytes_per_param(2) as u32
    }

    /// The layout with that number, if one has it (12: every eligible chunk staged).
    pub fn from_number(n: u32) -> Option<Self> {
        [
            HostLayout::Full,
            HostLayout::GradsInParams,
            HostLayout::STAGED,
        ]
        .into_iter()
        .find(|l| l.number() == n)
    }

    /// Whether chunks' gradients may land in their parameter storage or in staging: the
    /// 14- and 12-byte layouts.
    pub fn lean(self) -> bool {
        self != HostLayout::Full
    }
}

impl fmt::Display for HostLayout {
    /// `16`, `14`, `12`, or `12x30` (at most 30 chunks staged, the other eligible ones at
    /// 14), as `host_layout=` takes it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostLayout::Staged { limit: Some(n) } => write!(f, "12x{n}"),
            other => write!(f, "{}", other.number()),
        }
    }
}

impl FromStr for HostLayout {
    type Err = ();

    /// The text [`HostLayout`]'s `Display` writes.
    fn from_str(text: &str) -> std::result::Result<Self, ()> {
        match text.split_once('x') {
            Some(("12", n)) => n
                .parse::<u32>()
                .map(|n| HostLayout::Staged { limit: Some(n) })
                .map_err(|_| ()),
            Some(_) => Err(()),
            None => text
                .parse::<u32>()
                .ok()
                .and_then(HostLayout::from_number)
                .ok_or(()),
        }
    }
}

/// The order a step with gradient accumulation runs its `K` micro-batches in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MicroBatchOrder {
    /// One micro-batch after another: a program run `K` times, each run summing its gradients
    /// into accumulators, then the update (every streamed chunk is fetched once per
    /// micro-batch).
    #[default]
    Sequential,
    /// Chunk-major: one program runs every micro-batch through a layer while its chunk is on
    /// the device, then moves to the next layer (every streamed chunk is fetched once per
    /// step), summing each gradient over the micro-batches as it goes.
    ChunkMajor,
}

impl MicroBatchOrder {
    /// The word `order=` takes.
    pub fn name(self) -> &'static str {
        match self {
            MicroBatchOrder::Sequential => "sequential",
            MicroBatchOrder::ChunkMajor => "chunk-major",
        }
    }
}

impl fmt::Display for MicroBatchOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for MicroBatchOrder {
    type Err = ();

    /// The text [`MicroBatchOrder`]'s `Display` writes.
    fn from_str(text: &str) -> std::result::Result<Self, ()> {
        [MicroBatchOrder::Sequential, MicroBatchOrder::ChunkMajor]
            .into_iter()
            .find(|o| o.name() == text)
            .ok_or(())
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
    /// How offloaded chunks keep their state on the host (see [`HostLayout`]).
    pub host_layout: HostLayout,
    /// The order of a step's micro-batches with gradient accumulation (see
    /// [`MicroBatchOrder`]); without accumulation there is one and the order means nothing.
    #[serde(default)]
    pub order: MicroBatchOrder,
}

impl Policy {
    /// Everything on the device: every chunk persistent, every block kept.
    pub fn resident(chunks: u32, layers: usize) -> Self {
        Self {
            n_persist: chunks,
            n_buffer: 0,
            blocks: vec![BlockMode::Keep; layers],
            prefetch: 1,
            host_layout: HostLayout::Full,
            order: MicroBatchOrder::Sequential,
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
            host_layout: HostLayout::Full,
            order: MicroBatchOrder::Sequential,
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
            host_layout: HostLayout::Full,
            order: MicroBatchOrder::Sequential,
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
            host_layout: HostLayout::Full,
            order: MicroBatchOrder::Sequential,
        }
    }

    /// This policy with its micro-batches in order `order`.
    pub fn with_order(self, order: MicroBatchOrder) -> Self {
        Self { order, ..self }
    }

    /// This policy with offloaded chunks in host layout `layout`.
    pub fn with_layout(self, layout: HostLayout) -> Self {
        Self {
            host_layout: layout,
            ..self
        }
    }

    /// Blocks in a mode.
    pub fn count(&self, mode: BlockMode) -> usize {
        self.blocks.iter().filter(|&&m| m == mode).count()
    }
}

impl fmt::Display for Policy {
    /// `n_persist=3 n_buffer=2 prefetch=1 blocks=SCSCK4` (blocks in the compact form of
    /// [`format_blocks`]), then ` host_layout=14` when the layout is not the full one and
    /// ` order=chunk-major` when the micro-batches are not sequential.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "n_persist={} n_buffer={} prefetch={} blocks={}",
            self.n_persist,
            self.n_buffer,
            self.prefetch,
            format_blocks(&self.blocks)
        )?;
        if self.host_layout != HostLayout::Full {
            write!(f, " host_layout={}", self.host_layout)?;
        }
        if self.order != MicroBatchOrder::Sequential {
            write!(f, " order={}", self.order)?;
        }
        Ok(())
    }
}

/// A policy as a user writes it: some of its settings, the rest left to defaults that depend
/// on the model ([`PolicySpec::resolve`]).
///
/// Its text form is `key=value` pairs separated by commas or spaces, so the line a
/// [`Policy`] prints (`n_persist=3 n_buffer=2 prefetch=1 blocks=SCSCK4`) parses back to
/// the same policy. The keys are `n_persist`, `n_buffer`, `prefetch`, `blocks` (a mode
/// letter per run of layers followed by the run's length when over one, or one letter per
/// layer; `-` for none; see [`parse_blocks`]), `host_layout` (16, 14 or 12 bytes per parameter, or `12xN` for
/// at most `N` chunks at 12 and the rest at 14; see [`HostLayout`]), `order` (`sequential` or
/// `chunk-major`, see [`MicroBatchOrder`]) and, instead of `blocks`, `n_swap` and `n_checkpoint` (ProTrain's interleaved layout). A key given twice, or `blocks` with `n_swap` or `n_checkpoint`, is an
/// error rather than one silently winning.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicySpec {
    /// Chunks kept on the device.
    pub n_persist: Option<u32>,
    /// Chunk buffers.
    pub n_buffer: Option<u32>,
    /// Swapped blocks in ProTrain's layout.
    pub n_swap: Option<u32>,
    /// Checkpointed blocks in ProTrain's layout.
    pub n_checkpoint: Option<u32>,
    /// One mode per layer.
    pub blocks: Option<Vec<BlockMode>>,
    /// The prefetch distance.
    pub prefetch: Option<u32>,
    /// The host layout of offloaded chunks.
    pub host_layout: Option<HostLayout>,
    /// The order of the micro-batches with gradient accumulation.
    pub order: Option<MicroBatchOrder>,
}

/// The keys of a policy's text form, in the order they are documented.
const POLICY_KEYS: [&str; 8] = [
    "n_persist",
    "n_buffer",
    "n_swap",
    "n_checkpoint",
    "blocks",
    "prefetch",
    "host_layout",
    "order",
];

impl FromStr for PolicySpec {
    type Err = IrError;

    fn from_str(text: &str) -> Result<Self> {
        let bad = |why: String| IrError::BadPolicy {
            text: text.trim().to_string(),
            why,
        };
        let mut spec = Self::default();
        let mut seen: Vec<&str> = Vec::new();
        let parts = text
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|p| !p.is_empty());
        for part in parts {
            let Some((key, value)) = part.split_once('=') else {
                return Err(bad(format!(
                    "`{part}` is not key=value; write e.g. n_persist=4 n_buffer=2 \
                     n_checkpoint=8 (commas or spaces between pairs), or auto"
                )));
            };
            let Some(&key) = POLICY_KEYS.iter().find(|&&k| k == key) else {
                return Err(bad(format!(
                    "unknown key `{key}`; the keys are {}",
                    POLICY_KEYS.join(", ")
                )));
            };
            if seen.contains(&key) {
                return Err(bad(format!("{key} is given twice; give it once")));
            }
            seen.push(key);
            let number = || {
                value.parse::<u32>().map_err(|_| {
                    bad(format!(
                        "{key}={value}: `{value}` is not a whole number below 2^32"
                    ))
                })
            };
            match key {
                "n_persist" => spec.n_persist = Some(number()?),
                "n_buffer" => spec.n_buffer = Some(number()?),
                "n_swap" => spec.n_swap = Some(number()?),
                "n_checkpoint" => spec.n_checkpoint = Some(number()?),
                "prefetch" => spec.prefetch = Some(number()?),
                "host_layout" => {
                    spec.host_layout = Some(value.parse::<HostLayout>().map_err(|()| {
                        bad(format!(
                            "host_layout={value}: give 16 (parameters, gradients, master and \
                             moments apart), 14 (gradients in the parameter storage), 12 (no \
                             narrow copy: uploads cast from the master through staging) or \
                             12xN (at most N chunks at 12 bytes, the others at 14)"
                        ))
                    })?);
                }
                "order" => {
                    spec.order = Some(value.parse::<MicroBatchOrder>().map_err(|()| {
                        bad(format!(
                            "order={value}: give sequential (one micro-batch after another) \
                             or chunk-major (every micro-batch through a layer while its \
                             chunk is on the device)"
                        ))
                    })?);
                }
                _ => spec.blocks = Some(parse_blocks(value).map_err(bad)?),
            }
        }
        if spec.blocks.is_some() && (spec.n_swap.is_some() || spec.n_checkpoint.is_some()) {
            return Err(bad(
                "blocks= gives every layer's mode, so n_swap and n_checkpoint would be ignored; \
                 give either blocks or n_swap/n_checkpoint"
                    .into(),
            ));
        }
        Ok(spec)
    }
}

impl PolicySpec {
    /// The policy for a model with `chunks` chunks and `layers` layers. Unset keys default to
    /// everything persistent and kept, `n_buffer` to 2 (at most the streamed chunks) when
    /// something is streamed, `prefetch` to 1 and `host_layout` to the full one.
    pub fn resolve(&self, chunks: u32, layers: usize) -> Result<Policy> {
        let bad = |why: String| IrError::BadPolicy {
            text: self.to_string(),
            why,
        };
        let n_persist = self.n_persist.unwrap_or(chunks);
        if n_persist > chunks {
            return Err(bad(format!(
                "n_persist={n_persist} but the model has {chunks} chunks; give at most {chunks}"
            )));
        }
        let streamed = chunks - n_persist;
        let n_buffer = self.n_buffer.unwrap_or(2.min(streamed));
        let blocks = match &self.blocks {
            Some(modes) => {
                if modes.len() != layers {
                    return Err(bad(format!(
                        "blocks= has {} modes but the model has {layers} layers; give one \
                         letter per layer",
                        modes.len()
                    )));
                }
                modes.clone()
            }
            None => {
                let n_swap = self.n_swap.unwrap_or(0) as usize;
                let n_checkpoint = self.n_checkpoint.unwrap_or(0) as usize;
                if n_swap + n_checkpoint > layers {
                    return Err(bad(format!(
                        "n_swap + n_checkpoint = {} but the model has {layers} layers",
                        n_swap + n_checkpoint
                    )));
                }
                Policy::protrain(n_persist, n_buffer, n_swap, n_checkpoint, layers).blocks
            }
        };
        Ok(Policy {
            n_persist,
            n_buffer,
            blocks,
            prefetch: self.prefetch.unwrap_or(1),
            host_layout: self.host_layout.unwrap_or_default(),
            order: self.order.unwrap_or_default(),
        })
    }
}

impl fmt::Display for PolicySpec {
    /// The settings given, in the text form [`PolicySpec::from_str`] reads.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        let numbers = [
            ("n_persist", self.n_persist),
            ("n_buffer", self.n_buffer),
            ("n_swap", self.n_swap),
            ("n_checkpoint", self.n_checkpoint),
            ("prefetch", self.prefetch),
        ];
        for (key, value) in numbers {
            if let Some(v) = value {
                parts.push(format!("{key}={v}"));
            }
        }
        if let Some(modes) = &self.blocks {
            parts.push(format!("blocks={}", format_blocks(modes)));
        }
        if let Some(layout) = self.host_layout {
            parts.push(format!("host_layout={layout}"));
        }
        if let Some(order) = self.order {
            parts.push(format!("order={order}"));
        }
        f.write_str(&parts.join(" "))
    }
}

impl From<&Policy> for PolicySpec {
    /// Every setting of `policy`, so that resolving gives it back.
    fn from(policy: &Policy) -> Self {
        Self {
            n_persist: Some(policy.n_persist),
            n_buffer: Some(policy.n_buffer),
            n_swap: None,
            n_checkpoint: None,
            blocks: Some(policy.blocks.clone()),
            prefetch: Some(policy.prefetch),
            // Left out when full, its default, so the text form reads as it always did.
            host_layout: (policy.host_layout != HostLayout::Full).then_some(policy.host_layout),
            order: (policy.order != MicroBatchOrder::Sequential).then_some(policy.order),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<PolicySpec> {
        text.parse()
    }

    #[test]
    fn the_printed_form_parses_back_to_the_same_policy() {
        for policy in [
            Policy::protrain(1, 2, 2, 4, 8),
            Policy::resident(5, 3),
            Policy::resident(5, 0),
            Policy::zero3_offload(2, 4),
            Policy {
                host_layout: HostLayout::GradsInParams,
                ..Policy::zero3_offload(2, 4)
            },
            Policy::zero3_offload(2, 4).with_layout(HostLayout::STAGED),
            Policy::zero3_offload(2, 4).with_layout(HostLayout::Staged { limit: Some(3) }),
            Policy::zero3_offload(2, 4)
                .with_layout(HostLayout::GradsInParams)
                .with_order(MicroBatchOrder::ChunkMajor),
        ] {
            let printed = policy.to_string();
            let back = parse(&printed).unwrap().resolve(5, policy.blocks.len());
            assert_eq!(back.unwrap(), policy, "{printed}");
        }
    }

    #[test]
    fn blocks_print_as_runs_and_both_forms_parse() {
        use BlockMode::{Checkpoint as C, Keep as K, Swap as S};
        let mut modes = vec![S, S, S, C, C];
        modes.extend([K; 27]);
        let policy = Policy {
            blocks: modes.clone(),
            ..Policy::resident(4, 32)
        };
        assert_eq!(
            policy.to_string(),
            "n_persist=4 n_buffer=0 prefetch=1 blocks=S3C2K27"
        );
        assert_eq!(format_blocks(&[S, C, S, K, K]), "SCSK2");
        assert_eq!(format_blocks(&[]), "-");
        let long: String = modes.iter().map(|m| m.letter()).collect();
        assert_eq!(parse_blocks(&long).unwrap(), modes);
        assert_eq!(parse_blocks("s3c2k27").unwrap(), modes);
        assert_eq!(parse_blocks("S1C1").unwrap(), [S, C]);
        for (text, why) in [
            ("K0", "from 1 up"),
            ("3K", "no mode letter"),
            ("K99999999999999999999", "from 1 up"),
            ("K2000000", "more than 1048576 layers"),
            ("KX", "block mode `X`"),
        ] {
            let err = parse_blocks(text).unwrap_err();
            assert!(err.contains(why), "{text}: {err}");
        }
    }

    #[test]
    fn host_layouts_print_as_their_bytes_per_parameter() {
        for (text, layout) in [
            ("16", HostLayout::Full),
            ("14", HostLayout::GradsInParams),
            ("12", HostLayout::STAGED),
            ("12x30", HostLayout::Staged { limit: Some(30) }),
        ] {
            assert_eq!(text.parse::<HostLayout>(), Ok(layout));
            assert_eq!(layout.to_string(), text);
        }
        let p = parse("n_persist=0 host_layout=12x3")
            .unwrap()
            .resolve(5, 1)
            .unwrap();
        assert_eq!(p.host_layout, HostLayout::Staged { limit: Some(3) });
        assert_eq!(
            p.to_string(),
            "n_persist=0 n_buffer=2 prefetch=1 blocks=K host_layout=12x3"
        );
        assert_eq!(HostLayout::STAGED.bytes_per_param(2), 12);
    }

    #[test]
    fn commas_and_spaces_both_separate_pairs() {
        let a = parse("n_persist=0,n_buffer=2,n_checkpoint=2").unwrap();
        let b = parse("n_persist=0 n_buffer=2  n_checkpoint=2").unwrap();
        let c = parse(" n_persist=0, n_buffer=2 ,n_checkpoint=2 ").unwrap();
        assert_eq!(a, b);
        assert_eq!(a, c);
        assert_eq!(a.n_checkpoint, Some(2));
    }

    #[test]
    fn duplicate_and_conflicting_keys_are_refused() {
        let err = parse("n_persist=1,n_persist=2").unwrap_err().to_string();
        assert!(err.contains("n_persist is given twice"), "{err}");
        let err = parse("blocks=KK,n_swap=1").unwrap_err().to_string();
        assert!(
            err.contains("either blocks or n_swap/n_checkpoint"),
            "{err}"
        );
        let err = parse("n_checkpoint=1 blocks=CK").unwrap_err().to_string();
        assert!(err.contains("either blocks"), "{err}");
    }

    #[test]
    fn bad_parts_name_the_problem() {
        for (text, says) in [
            ("n_persist", "is not key=value"),
            ("n_persists=1", "unknown key `n_persists`"),
            ("n_buffer=-1", "not a whole number"),
            ("blocks=KX", "block mode `X`"),
            ("host_layout=13", "give 16"),
            ("host_layout=x", "give 16"),
            ("order=chunk", "give sequential"),
            ("host_layout=14x2", "12xN"),
            ("host_layout=12x", "12xN"),
            ("host_layout=12x-1", "12xN"),
        ] {
            let err = parse(text).unwrap_err().to_string();
            assert!(err.contains(says), "{text}: {err}");
        }
        let err = parse("blocks=KK").unwrap().resolve(4, 3).unwrap_err();
        assert!(err.to_string().contains("has 2 modes"), "{err}");
        let err = parse("n_persist=9").unwrap().resolve(4, 3).unwrap_err();
        assert!(err.to_string().contains("at most 4"), "{err}");
    }

    #[test]
    fn unset_keys_take_their_defaults() {
        let p = parse("n_persist=1").unwrap().resolve(4, 2).unwrap();
        assert_eq!((p.n_persist, p.n_buffer, p.prefetch), (1, 2, 1));
        assert_eq!(p.blocks, vec![BlockMode::Keep; 2]);
        let p = parse("").unwrap().resolve(4, 2).unwrap();
        assert_eq!(p, Policy::resident(4, 2));
        let p = parse("n_persist=3").unwrap().resolve(4, 2).unwrap();
        assert_eq!(p.n_buffer, 1, "at most the one streamed chunk");
    }

    #[test]
    fn protrain_layout_interleaves_swaps_among_checkpoints_and_keeps_the_rest() {
        let p = Policy::protrain(1, 2, 2, 4, 8);
        assert_eq!(
            p.to_string(),
            "n_persist=1 n_buffer=2 prefetch=1 blocks=SC2SC2K2"
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
            "n_persist=0 n_buffer=2 prefetch=1 blocks=C3"
        );
        assert_eq!(Policy::gemini(0.5, 9, 2, 2).n_persist, 4);
        assert_eq!(
            Policy::resident(5, 2).to_string(),
            "n_persist=5 n_buffer=0 prefetch=1 blocks=K2"
        );
    }
}
