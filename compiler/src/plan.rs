//! Fixed-address memory planning: one arena offset per buffer, chosen before the run.

use protrain_ir::{format_bytes, Buffer, BufferId, BufferKind, Schedule, Space};
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::fmt;

/// Buffers start at multiples of this many bytes: every offset the planner gives, and every
/// region the runtime allocates, is aligned to it.
pub const BUFFER_ALIGN: u64 = 256;

/// One device buffer to place: its size, alignment and live range in the linear instruction
/// order.
///
/// The live range `[first, last]` is inclusive: two buffers whose ranges share an instruction are
/// live at the same time and must not overlap in the arena; a buffer whose range ends at `t` and
/// one that starts at `t + 1` may share bytes. The index of an interval in the slice handed to
/// [`plan_offsets`] is its [`BufferId`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Interval {
    /// Size in bytes. A buffer of size 0 occupies nothing and may sit anywhere aligned.
    pub size: u64,
    /// The offset must be a multiple of this; 0 is read as 1 (no constraint).
    pub align: u64,
    /// The first instruction at which the buffer is live.
    pub first: u32,
    /// The last instruction at which the buffer is live; at least `first` (a buffer with
    /// `last < first` is never live: the planner leaves it at 0 and [`check_plan`] rejects it).
    pub last: u32,
    /// Pins the buffer at this offset (a persistent region laid out beforehand, for instance);
    /// the planner places everything else around it. Pinned buffers must not overlap each other
    /// while live at the same time, and the offset must be aligned: [`check_plan`] says so if not.
    pub fixed_offset: Option<u64>,
}

impl Interval {
    /// A buffer of `size` bytes aligned to `align`, live from `first` to `last` inclusive.
    pub fn new(size: u64, align: u64, first: u32, last: u32) -> Self {
        Self {
            size,
            align,
            first,
            last,
            fixed_offset: None,
        }
    }

    /// The same buffer, pinned at `offset`.
    pub fn pinned(self, offset: u64) -> Self {
        Self {
            fixed_offset: Some(offset),
            ..self
        }
    }

    /// Whether the two live ranges share an instruction.
    pub fn live_together(&self, other: &Interval) -> bool {
        self.first <= other.last && other.first <= self.last
    }

    /// Whether the buffer takes bytes at some instruction: only those are planned and counted.
    fn occupies(&self) -> bool {
        self.size > 0 && self.first <= self.last
    }

    /// The alignment with 0 read as 1.
    fn alignment(&self) -> u64 {
        self.align.max(1)
    }
}

/// The buffer order a greedy best-fit pass places in; [`plan_offsets`] runs each and keeps the
/// smallest arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Strategy {
    /// Largest first, ties by earlier start ("greedy by size", as in XLA's heap simulator and
    /// TFLite's arena planner). Good when a few big buffers dominate.
    BySize,
    /// Earliest start first, ties by longer life then larger size: the order an allocator at
    /// run time would see. Good on stack-like lifetimes, where activations allocated in forward
    /// order and freed in reverse in backward nest and placing them as they appear keeps them
    /// stacked.
    ByStart,
    /// Largest `size x lifetime` first, ties by earlier start: the buffer's footprint in the
    /// offset-time plane. The best of the three when lifetimes are not nested, as with swapped
    /// activations that are freed in forward order once offloaded and reloaded in reverse.
    ByArea,
}

impl Strategy {
    /// Every strategy, in the order [`plan_offsets`] tries them; on a tie the earlier one wins.
    pub const ALL: [Strategy; 3] = [Strategy::BySize, Strategy::ByStart, Strategy::ByArea];

    /// The order in which this strategy places the unpinned buffers that occupy bytes.
    fn order(self, intervals: &[Interval]) -> Vec<u32> {
        let mut order: Vec<u32> = (0..intervals.len())
            .filter(|&i| intervals[i].fixed_offset.is_none() && intervals[i].occupies())
            .map(|i| i as u32)
            .collect();
        // Each key ends on the id, so the order (and so the plan) never depends on the sort.
        match self {
            Strategy::BySize => order.sort_unstable_by_key(|&i| {
                let b = &intervals[i as usize];
                (Reverse(b.size), b.first, Reverse(b.last), i)
            }),
            Strategy::ByStart => order.sort_unstable_by_key(|&i| {
                let b = &intervals[i as usize];
                (b.first, Reverse(b.last), Reverse(b.size), i)
            }),
            Strategy::ByArea => order.sort_unstable_by_key(|&i| {
                let b = &intervals[i as usize];
                // u128: a u64 size times a u32 lifetime can exceed u64.
                let area = u128::from(b.size) * (u128::from(b.last - b.first) + 1);
                (Reverse(area), b.first, i)
            }),
        }
        order
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Strategy::BySize => "best fit by size",
            Strategy::ByStart => "best fit by start",
            Strategy::ByArea => "best fit by size x lifetime",
        })
    }
}

/// Fixed arena offsets for a set of buffers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// The offset of each buffer, indexed like the intervals (by [`BufferId`]).
    pub offsets: Vec<u64>,
    /// The arena size: the highest `offset + size`.
    pub arena_bytes: u64,
    /// No placement can use less: the larger of the peak over time of the live bytes and the
    /// highest end of a pinned buffer. Sizes count unpadded, so the gap includes alignment
    /// padding.
    pub lower_bound_bytes: u64,
    /// The ordering whose placement was kept.
    pub strategy: Strategy,
}

impl Plan {
    /// The offset of buffer `id`. Panics if the plan has no such buffer.
    pub fn offset(&self, id: BufferId) -> u64 {
        self.offsets[id.index()]
    }

    /// Bytes of the arena above the lower bound: fragmentation and alignment padding, or slack
    /// in the bound itself.
    pub fn gap_bytes(&self) -> u64 {
        self.arena_bytes.saturating_sub(self.lower_bound_bytes)
    }

    /// [`gap_bytes`](Self::gap_bytes) as a fraction of the lower bound (0 when both are 0).
    pub fn gap_fraction(&self) -> f64 {
        if self.lower_bound_bytes == 0 {
            0.0
        } else {
            self.gap_bytes() as f64 / self.lower_bound_bytes as f64
        }
    }
}

impl fmt::Display for Plan {
    /// One line: `arena 1.20 GiB for 310 buffers (lower bound 1.18 GiB, gap 20.0 MiB = 1.66%),
    /// best fit by start`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "arena {} for {} buffers (lower bound {}, gap {} = {:.2}%), {}",
            format_bytes(self.arena_bytes),
            self.offsets.len(),
            format_bytes(self.lower_bound_bytes),
            format_bytes(self.gap_bytes()),
            100.0 * self.gap_fraction(),
            self.strategy
        )
    }
}

/// Assigns every buffer a fixed offset so that no two buffers live at the same time overlap.
///
/// Pinned buffers keep their offset. The rest are placed by greedy best-fit once per
/// [`Strategy`] ordering: each buffer goes into the smallest hole, respecting its alignment,
/// between the bytes taken by already-placed buffers whose live ranges intersect its own, or
/// just above the highest of them if none fits. The smallest arena in [`granule`]s wins, the
/// earlier strategy on a tie. By start runs first, to completion; then by size, which stops
/// once its arena passes by start's granule (it wins a tie, so it can no longer win); then by
/// size x lifetime, which must beat both strictly, so it stops once its arena reaches the
/// better one's granule, and does not run at all when that one is close enough to the lower
/// bound: in its granule, where nothing can beat it, or within [`OPTIMALITY_GAP`] of it, where
/// nothing can beat it by more than that fraction. So the kept plan is the one running all
/// three to the end would keep, or at most that fraction larger.
///
/// By size x lifetime is the expensive one on deep graphs: it places long-lived buffers out of
/// nesting order, and each later long span reads hundreds of scattered ranges, where the other
/// two read tens, so its cost grows faster than the number of buffers. On such graphs the
/// other two end a gap above the bound that does not grow with depth (alignment padding, a few
/// holes), which shrinks against an arena growing with depth, so it is skipped where it costs
/// the most, past a depth that depends on that gap (`benches/RESULTS.md` has the figures of
/// `compiler/benches/compile_depth.rs`). The result depends only on the input: no hashing,
/// every sort has a total order, and a strategy that stops is one that would not have been
/// kept.
///
/// Complexity per strategy, for `n` buffers over `m <= n` distinct start times:
/// `O(sum_i (log m (log n + u_i) + r_i + b_i log b_i))`, where `r_i` is the number of byte ranges
/// read for buffer `i`, `b_i <= r_i` those read outside the cached ancestor unions, and `u_i` the
/// length of the unions it is added to. The taken bytes come from a segment tree over time whose
/// nodes hold unions of byte ranges (see `Occupancy`), so a query reads `O(log m)` unions instead
/// of every conflicting buffer: with `k_i` placed buffers live with buffer `i`, `r_i <= k_i` per
/// union read, and in practice `r_i` is far below `k_i` because buffers that sit next to each
/// other, as stacked activations do, merge into one range. Ancestor unions are cached and
/// brought up to date by merging (counted in `r_i`). Best fit reads the unions where they lie,
/// without concatenating or sorting them: each in turn cuts the free space still big enough to
/// hold the buffer, the longest union first, galloping past the ranges and the free windows
/// that do not meet (`best_hole_across`). So `r_i` bounds a query, and a range that falls where
/// the free space is already too small for the buffer is not read at all. Only the ranges read
/// beside an indexed ancestor union (below) are sorted (`b_i log b_i`).
///
/// That is what by size x lifetime needs on a LLaMA under a tight budget (the depth benchmark's
/// dimensions, 5/8 MiB a layer; see `benches/compile_depth.rs`): its long spans read about 576
/// ranges each from 14 unions at 1,024 layers, of which the longest leaves about 170 windows
/// that the rest cut down. Cutting rather than merging and sorting took its 16 plans there
/// from 3.21-3.40 s to 2.27-2.62 s (one thread), the other two orders unchanged.
///
/// The ancestors' union is what fragments with depth: by size x lifetime on a 1,024-layer
/// GPT-2, the long-lived buffers placed first leave a union of about 220 holes around a
/// short-lived buffer, nearly all big enough. Where the span's ancestors are one cached union,
/// best fit does not walk those holes: an index of them by size (built the second time a union
/// is read unchanged) gives the smallest untouched hole that fits by binary search, and only the
/// holes that the `b_i` other ranges cut are walked, so such a query costs
/// `O(b_i log u + t_i + s_i)` for `t_i` cut pieces and `s_i` holes skipped in the index, instead
/// of one step per hole. A span across a high boundary of the tree, whose ancestors below the
/// meeting point hold many ranges, walks its two ends' cached unions instead (`r_i` as before).
///
/// This does not check its input: pinned buffers that collide, or a pinned offset that is not
/// aligned, come out as given, and [`check_plan`] reports them.
pub fn plan_offsets(intervals: &[Interval]) -> Plan {
    assert!(
        u32::try_from(intervals.len()).is_ok(),
        "more than u32::MAX buffers"
    );
    let lower_bound_bytes = lower_bound(intervals);
    let starts = distinct_starts(intervals);
    let granule = granule(intervals);
    let granules = |plan: &Plan| plan.arena_bytes.div_ceil(granule);
    let [by_size, by_start, by_area] = Strategy::ALL;
    let second = plan_one(intervals, by_start, &starts, lower_bound_bytes, None)
        .expect("an unbounded plan completes");
    // By size stops at the first byte count past by start's granule (none if that is past
    // `u64::MAX`: then it never stops).
    let above = granules(&second)
        .checked_mul(granule)
        .and_then(|bytes| bytes.checked_add(1));
    let first = plan_one(intervals, by_size, &starts, lower_bound_bytes, above);
    // `min_by_key` keeps the first of equals: the earlier strategy.
    let better = [first, Some(second)]
        .into_iter()
        .flatten()
        .min_by_key(granules)
        .expect("by start's plan is complete");
    // Saturating: pinned buffers that collide can leave the arena below the bound.
    let gap = better.arena_bytes.saturating_sub(lower_bound_bytes);
    let close = granules(&better) == lower_bound_bytes.div_ceil(granule)
        || gap <= lower_bound_bytes / OPTIMALITY_GAP;
    if close {
        return better;
    }
    // Above the lower bound's granule, so at least one granule: by size x lifetime stops at
    // the first byte count in it.
    let reached = (granules(&better) - 1) * granule + 1;
    plan_one(
        intervals,
        by_area,
        &starts,
        lower_bound_bytes,
        Some(reached),
    )
    .unwrap_or(better)
}

/// How close to the lower bound a plan must be for [`plan_offsets`] not to try best fit by size
/// x lifetime: within one part in this many. 10,000 is the relative gap at which MIP solvers
/// stop by default (Gurobi's `MIPGap`, CPLEX's `mipgap`: 1e-4), so the plan kept is at most
/// that much larger than the one that order could give. It skips that order where it costs
/// the most: on deep graphs the other two orders end a constant few hundred kilobytes above the
/// bound while the bound grows with depth. How often it fires is measured in
/// `benches/RESULTS.md`.
pub const OPTIMALITY_GAP: u64 = 10_000;

/// The unit in which [`plan_offsets`] compares arenas: the coarsest alignment of any buffer
/// that takes bytes (1 if none asks for one; 256 bytes in a schedule, which is also the
/// alignment the runtime allocates its regions with). Two arenas that round up to the same
/// multiple of it are equally good: the bytes between them could hold no further buffer of
/// that alignment. Counting in it lets a plan be known optimal, and the other orders be
/// skipped, once it is in the lower bound's granule: the lower bound counts live bytes without
/// the padding that alignment forces (a 4-byte scalar beside 256-byte-aligned buffers), so an
/// arena a few bytes above it is often the best any order can do.
pub fn granule(intervals: &[Interval]) -> u64 {
    intervals
        .iter()
        .filter(|b| b.occupies())
        .map(Interval::alignment)
        .max()
        .unwrap_or(1)
}

/// [`plan_offsets`] with one ordering only: for comparing strategies, and for callers that know
/// which one suits their lifetimes.
pub fn plan_offsets_with(intervals: &[Interval], strategy: Strategy) -> Plan {
    assert!(
        u32::try_from(intervals.len()).is_ok(),
        "more than u32::MAX buffers"
    );
    plan_one(
        intervals,
        strategy,
        &distinct_starts(intervals),
        lower_bound(intervals),
        None,
    )
    .expect("an unbounded plan completes")
}

/// The plan of one strategy, or `None` if its arena would reach `bound` bytes.
fn plan_one(
    intervals: &[Interval],
    strategy: Strategy,
    starts: &[u32],
    lower_bound_bytes: u64,
    bound: Option<u64>,
) -> Option<Plan> {
    let offsets = best_fit(intervals, &strategy.order(intervals), starts, bound)?;
    Some(Plan {
        arena_bytes: arena_size(intervals, &offsets),
        offsets,
        lower_bound_bytes,
        strategy,
    })
}

/// Checks a plan against its intervals: one offset per buffer, pinned buffers where pinned,
/// every offset aligned, every buffer inside the arena, the arena no smaller than the lower bound,
/// and no two buffers live at the same time sharing a byte.
///
/// Independent of the planner: a sweep over time keeps the live buffers in a map ordered by
/// offset, and a buffer that starts is compared with its two neighbours there, which suffices
/// because the live set is checked to be disjoint at every step. `O(n log n)`. The error names
/// the first violation found.
pub fn check_plan(intervals: &[Interval], plan: &Plan) -> Result<(), String> {
    if plan.offsets.len() != intervals.len() {
        return Err(format!(
            "the plan has {} offsets for {} buffers",
            plan.offsets.len(),
            intervals.len()
        ));
    }
    if plan.arena_bytes < plan.lower_bound_bytes {
        return Err(format!(
            "the arena ({} B) is below the lower bound ({} B)",
            plan.arena_bytes, plan.lower_bound_bytes
        ));
    }
    for (i, (b, &offset)) in intervals.iter().zip(&plan.offsets).enumerate() {
        let id = BufferId::new(i);
        if b.first > b.last {
            return Err(format!(
                "{id}: live range [{}, {}] is empty",
                b.first, b.last
            ));
        }
        if let Some(fixed) = b.fixed_offset {
            if fixed != offset {
                return Err(format!("{id}: pinned at {fixed} but placed at {offset}"));
            }
        }
        if offset % b.alignment() != 0 {
            return Err(format!(
                "{id}: offset {offset} is not a multiple of its alignment {}",
                b.align
            ));
        }
        match offset.checked_add(b.size) {
            Some(end) if end <= plan.arena_bytes => {}
            _ => {
                return Err(format!(
                    "{id}: [{offset}, {offset} + {}) ends past the arena ({} B)",
                    b.size, plan.arena_bytes
                ))
            }
        }
    }

    let mut by_first: Vec<u32> = (0..intervals.len() as u32)
        .filter(|&i| intervals[i as usize].occupies())
        .collect();
    let mut by_last = by_first.clone();
    by_first.sort_unstable_by_key(|&i| (intervals[i as usize].first, i));
    by_last.sort_unstable_by_key(|&i| (intervals[i as usize].last, i));
    // Live buffers keyed by (offset, id), valued by end; kept pairwise disjoint.
    let mut live: BTreeMap<(u64, u32), u64> = BTreeMap::new();
    let mut ended = by_last.iter().peekable();
    for &i in &by_first {
        let b = &intervals[i as usize];
        // Buffers whose last instruction is before this start no longer hold their bytes.
        while let Some(&&j) = ended.peek() {
            if intervals[j as usize].last >= b.first {
                break;
            }
            live.remove(&(plan.offsets[j as usize], j));
            ended.next();
        }
        let offset = plan.offsets[i as usize];
        let end = offset + b.size;
        let below = live.range(..(offset, i)).next_back();
        let above = live.range((offset, i)..).next();
        for (&(other_offset, j), &other_end) in below.into_iter().chain(above) {
            if other_offset < end && offset < other_end {
                let o = &intervals[j as usize];
                return Err(format!(
                    "{} [{offset}, {end}) live [{}, {}] and {} [{other_offset}, {other_end}) \
                     live [{}, {}] overlap while both are live",
                    BufferId::new(i as usize),
                    b.first,
                    b.last,
                    BufferId::new(j as usize),
                    o.first,
                    o.last
                ));
            }
        }
        live.insert((offset, i), end);
    }
    Ok(())
}

/// The larger of the peak over time of the sum of live sizes and the highest pinned end.
fn lower_bound(intervals: &[Interval]) -> u64 {
    // (time, is_start, size): at equal times the ends (false) sort first, because a buffer whose
    // last instruction is t - 1 no longer counts at t. Times are u64 so `last + 1` cannot wrap.
    let mut events: Vec<(u64, bool, u64)> = Vec::with_capacity(2 * intervals.len());
    let mut pinned_end = 0;
    for b in intervals {
        if let Some(offset) = b.fixed_offset {
            pinned_end = pinned_end.max(offset.saturating_add(b.size));
        }
        if b.occupies() {
            events.push((u64::from(b.first), true, b.size));
            events.push((u64::from(b.last) + 1, false, b.size));
        }
    }
    events.sort_unstable();
    let (mut live, mut peak) = (0u64, 0u64);
    for (_, is_start, size) in events {
        if is_start {
            live += size;
            peak = peak.max(live);
        } else {
            live -= size;
        }
    }
    peak.max(pinned_end)
}

/// The highest `offset + size`.
fn arena_size(intervals: &[Interval], offsets: &[u64]) -> u64 {
    intervals
        .iter()
        .zip(offsets)
        .map(|(b, &o)| o.saturating_add(b.size))
        .max()
        .unwrap_or(0)
}

/// The sorted distinct start times of the buffers that occupy bytes: the leaves of the
/// [`Occupancy`] index.
fn distinct_starts(intervals: &[Interval]) -> Vec<u32> {
    let mut starts: Vec<u32> = intervals
        .iter()
        .filter(|b| b.occupies())
        .map(|b| b.first)
        .collect();
    starts.sort_unstable();
    starts.dedup();
    starts
}

/// Places the pinned buffers, then the others in `order`, each by best fit against the bytes
/// taken by placed buffers live with it; gives up, returning `None`, as soon as the arena
/// reaches `bound` bytes, if given.
fn best_fit(
    intervals: &[Interval],
    order: &[u32],
    starts: &[u32],
    bound: Option<u64>,
) -> Option<Vec<u64>> {
    let reached = |arena: u64| bound.is_some_and(|bound| arena >= bound);
    // Unpinned buffers that occupy nothing keep offset 0, which is always aligned.
    let mut offsets = vec![0u64; intervals.len()];
    let mut index = Occupancy::new(starts);
    for (i, b) in intervals.iter().enumerate() {
        if let Some(offset) = b.fixed_offset {
            offsets[i] = offset;
            if b.occupies() {
                index.insert(b, offset);
            }
        }
    }
    // Reused across buffers: the ranges read outside an indexed ancestor union, sorted.
    let mut below: Vec<(u64, u64)> = Vec::new();
    let mut scratch = HoleScratch::default();
    let mut windows = Windows::default();
    // The arena so far: pinned ends, and the sizes of unplaced buffers at offset 0.
    let mut arena = arena_size(intervals, &offsets);
    for &i in order {
        if reached(arena) {
            return None;
        }
        let b = &intervals[i as usize];
        let (size, align) = (b.size, b.alignment());
        let ancestors = index.taken(b);
        let offset = match ancestors {
            Ancestors::One(a) if index.indexed(a) => {
                index.gather(&mut below);
                let (path, holes) = (&index.path[a], &index.holes[a]);
                best_hole_indexed(path, holes, &below, size, align, &mut scratch)
            }
            _ => index.best_hole(ancestors, size, align, &mut windows),
        };
        offsets[i as usize] = offset;
        arena = arena.max(offset.saturating_add(b.size));
        index.insert(b, offset);
    }
    (!reached(arena)).then_some(offsets)
}

/// The lowest aligned offset in the smallest hole between `taken` ranges (which may overlap)
/// that fits `size` bytes, or the first aligned offset above all of them.
///
/// The definition of best fit, kept as the reference that [`best_hole_across`] and
/// [`best_hole_indexed`] are tested against.
#[cfg(test)]
fn best_hole(taken: &mut [(u64, u64)], size: u64, align: u64) -> u64 {
    taken.sort();
    let mut floor = 0u64; // everything below is taken (or the arena's start)
    let mut best: Option<(u64, u64)> = None; // (hole size, offset)
    for &(start, end) in taken.iter() {
        let candidate = floor.next_multiple_of(align);
        // The smallest hole wins, so big holes stay whole for big buffers.
        if candidate.saturating_add(size) <= start
            && best.is_none_or(|(hole, _)| start - floor < hole)
        {
            best = Some((start - floor, candidate));
        }
        floor = floor.max(end);
    }
    best.map_or(floor.next_multiple_of(align), |(_, offset)| offset)
}

/// The free byte ranges still in play while [`best_hole_across`] cuts them, and the pieces
/// being cut: reused across buffers.
#[derive(Default)]
struct Windows {
    open: Vec<(u64, u64)>,
    cut: Vec<(u64, u64)>,
}

/// [`best_hole`] on the union of `lists`, each itself a union (sorted, disjoint), read where
/// they lie rather than concatenated and sorted.
///
/// The free space starts as one window, `[0, u64::MAX)`, and each list in turn cuts the open
/// windows into the pieces between its ranges; a piece too small to hold `size` bytes at an
/// aligned offset is dropped, since cutting only shrinks it. What is left are the holes of the
/// union that fit, and the space above everything, which is never dropped. Each list is read
/// by galloping over the ranges that lie between windows and over the windows no range reaches
/// into (those are copied whole), so a list costs the ranges inside open windows plus a
/// logarithm per window it cuts, not one step per range. Lists read largest first leave few
/// windows for the many small ones that follow.
fn best_hole_across<'a>(
    lists: impl IntoIterator<Item = &'a [(u64, u64)]>,
    size: u64,
    align: u64,
    windows: &mut Windows,
) -> u64 {
    let fits = |floor: u64, end: u64| floor.next_multiple_of(align).saturating_add(size) <= end;
    let Windows { open, cut } = windows;
    open.clear();
    open.push((0, u64::MAX));
    for list in lists {
        cut.clear();
        let (mut w, mut j) = (0, 0);
        while let Some(&(low, _)) = open.get(w) {
            j = gallop(list, j, |&(_, end)| end <= low);
            let Some(&(start, _)) = list.get(j) else {
                break;
            };
            let reached = gallop(open, w, |&(_, high)| high <= start);
            cut.extend_from_slice(&open[w..reached]);
            w = reached;
            let Some(&(low, high)) = open.get(w) else {
                break;
            };
            if list[j].1 <= low {
                continue; // that range lies between windows: gallop past it
            }
            let mut floor = low;
            while let Some(&(start, end)) = list.get(j) {
                if start >= high {
                    break;
                }
                if start > floor && fits(floor, start) {
                    cut.push((floor, start));
                }
                floor = floor.max(end);
                if end >= high {
                    break; // it may reach into the next window too
                }
                j += 1;
            }
            if high == u64::MAX || (floor < high && fits(floor, high)) {
                cut.push((floor, high));
            }
            w += 1;
        }
        cut.extend_from_slice(&open[w..]);
        std::mem::swap(open, cut);
    }
    let (&(top, _), holes) = open.split_last().expect("the space above everything stays");
    // The smallest hole wins, the lowest of equals: what the walk from the bottom would pick.
    holes
        .iter()
        .min_by_key(|&&(floor, start)| (start - floor, floor))
        .map_or(top, |&(floor, _)| floor)
        .next_multiple_of(align)
}

/// The first index from `from` at which `pred` is false, `pred` being true and then false along
/// `v`: found by galloping, in `O(log d)` steps for a distance `d`.
fn gallop<T>(v: &[T], from: usize, pred: impl Fn(&T) -> bool) -> usize {
    let (mut at, mut step) = (from, 1);
    while v.get(at + step - 1).is_some_and(&pred) {
        at += step;
        step *= 2;
    }
    at + v[at..(at + step).min(v.len())].partition_point(pred)
}

/// A hole of a union: `(length, start, k)` for the hole just below the union's range `k`.
type Hole = (u64, u64, u32);

/// The holes of a union (sorted, disjoint, non-adjacent ranges), sorted by size then start, so
/// that the smallest hole of at least a given length is a binary search away. The space above
/// the last range is not a hole here.
fn holes_of(union: &[(u64, u64)], out: &mut Vec<Hole>) {
    out.clear();
    let mut floor = 0;
    for (k, &(start, end)) in union.iter().enumerate() {
        if start > floor {
            out.push((start - floor, floor, k as u32));
        }
        floor = end;
    }
    out.sort_unstable();
}

/// Reused buffers of [`best_hole_indexed`].
#[derive(Default)]
struct HoleScratch {
    /// The other ranges as a union.
    merged: Vec<(u64, u64)>,
    /// The holes of the indexed union that the other ranges reach into, by `k`, ascending.
    touched: Vec<u32>,
}

/// [`best_hole`] on the union of `union` (sorted, disjoint, non-adjacent, with its
/// [`holes_of`]) and `other` (sorted by start, may overlap): the same offset, found without
/// walking every hole of `union`.
///
/// A hole of `union` that no range of `other` reaches into is a hole of the whole, so the
/// smallest of those that fits is the first fitting one in `holes` from `size` up, skipping the
/// touched ones. The touched holes are cut by `other` into smaller ones, which are walked one by
/// one. The smaller of the two winners (the lower on a tie, as the walk would pick) is the best
/// fit. `O(o log u + t + s)` for `o` other ranges, `u` ranges in `union`, `t` pieces of touched
/// holes and `s` holes skipped in the index (touched, or too small for the alignment).
fn best_hole_indexed(
    union: &[(u64, u64)],
    holes: &[Hole],
    other: &[(u64, u64)],
    size: u64,
    align: u64,
    scratch: &mut HoleScratch,
) -> u64 {
    let HoleScratch { merged, touched } = scratch;
    merged.clear();
    for &(start, end) in other {
        match merged.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    // Hole `k` is `[end of range k - 1 (or 0), start of range k (or unbounded))`; a range
    // `[s, e)` reaches into holes `lo..=hi`: those ending above `s` and starting below `e`.
    touched.clear();
    for &(s, e) in merged.iter() {
        let lo = union.partition_point(|&(start, _)| start <= s);
        let hi = union.partition_point(|&(_, end)| end < e);
        for k in lo.max(touched.last().map_or(0, |&k| k as usize + 1))..=hi {
            touched.push(k as u32);
        }
    }
    // (hole length, hole start, offset) of the best fit so far.
    let mut best: Option<(u64, u64, u64)> = None;
    let consider = |floor: u64, start: u64, best: &mut Option<(u64, u64, u64)>| {
        let candidate = floor.next_multiple_of(align);
        if candidate.saturating_add(size) <= start
            && best.is_none_or(|(hole, at, _)| (start - floor, floor) < (hole, at))
        {
            *best = Some((start - floor, floor, candidate));
        }
    };
    // The touched holes, cut by the other ranges; the space above everything is `top`.
    let mut top = union.last().map_or(0, |&(_, end)| end);
    let mut j = 0;
    for &k in touched.iter() {
        let k = k as usize;
        let hole_start = if k == 0 { 0 } else { union[k - 1].1 };
        let hole_end = union.get(k).map(|&(start, _)| start);
        while merged[j].1 <= hole_start {
            j += 1; // a touched hole has a range reaching into it at or after `j`
        }
        let mut floor = hole_start;
        for &(s, e) in &merged[j..] {
            if hole_end.is_some_and(|hole_end| s >= hole_end) {
                break;
            }
            if s > floor {
                consider(floor, s, &mut best);
            }
            floor = floor.max(e);
        }
        match hole_end {
            Some(hole_end) if hole_end > floor => consider(floor, hole_end, &mut best),
            Some(_) => {}
            None => top = floor,
        }
    }
    // The untouched holes, smallest first: the first that fits is the best of them.
    let from = holes.partition_point(|&(hole, _, _)| hole < size);
    for &(hole, start, k) in &holes[from..] {
        if best.is_some_and(|(best_hole, at, _)| (hole, start) >= (best_hole, at)) {
            break;
        }
        if touched.binary_search(&k).is_ok() {
            continue;
        }
        let candidate = start.next_multiple_of(align);
        if candidate.saturating_add(size) <= start + hole {
            best = Some((hole, start, candidate));
            break;
        }
    }
    best.map_or(top.next_multiple_of(align), |(_, _, offset)| offset)
}

/// Disjoint, non-adjacent byte ranges `[start, end)`, sorted: a union of placed buffers.
///
/// A sorted vector rather than an ordered map: unions are read whole far more often than they
/// grow, and reading a vector is a copy where a map is a pointer chase per range. Growing one
/// moves the ranges above the new one, a `memmove` of a few kilobytes at most here.
#[derive(Clone, Default)]
struct Ranges(Vec<(u64, u64)>);

impl Ranges {
    /// Adds `[start, end)`, merging every range it overlaps or touches, so that a stack of
    /// adjacent buffers is one entry however many buffers it holds. Returns whether the union
    /// grew.
    fn insert(&mut self, start: u64, end: u64) -> bool {
        // The ranges it touches or overlaps are `lo..hi`: those ending at or after `start` and
        // starting at or before `end`.
        let lo = self.0.partition_point(|&(_, e)| e < start);
        // Already covered: the common case high in the tree, where unions fill up.
        if let Some(&(s, e)) = self.0.get(lo) {
            if s <= start && e >= end {
                return false;
            }
        }
        let hi = lo + self.0[lo..].partition_point(|&(s, _)| s <= end);
        if lo == hi {
            self.0.insert(lo, (start, end));
        } else {
            self.0[lo] = (start.min(self.0[lo].0), end.max(self.0[hi - 1].1));
            self.0.drain(lo + 1..hi);
        }
        true
    }

    fn as_slice(&self) -> &[(u64, u64)] {
        &self.0
    }
}

/// The union of two sorted lists of disjoint, non-adjacent ranges, in the same form.
fn merge_unions(a: &[(u64, u64)], b: &[(u64, u64)], out: &mut Vec<(u64, u64)>) {
    out.clear();
    out.reserve(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    loop {
        let (start, end) = match (a.get(i), b.get(j)) {
            (Some(&x), Some(&y)) if x <= y => {
                i += 1;
                x
            }
            (Some(_), Some(&y)) => {
                j += 1;
                y
            }
            (Some(&x), None) => {
                i += 1;
                x
            }
            (None, Some(&y)) => {
                j += 1;
                y
            }
            (None, None) => break,
        };
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
}

/// The bytes taken by placed buffers, indexed by live range: which bytes are taken by buffers
/// live at some instruction of `[first, last]`?
///
/// A segment tree over the distinct start times; leaf `j` stands for the instructions from
/// `starts[j]` to just before `starts[j + 1]`. Two live ranges intersect exactly when their leaf
/// spans do, because each begins on its own leaf. A buffer is recorded as a byte range at the
/// `O(log m)` canonical nodes covering its span (`own`), and in the union of everything below each
/// of those nodes and their ancestors (`below`). The buffers live with a span are those recorded
/// at an ancestor of one of its canonical nodes (they cover that node), plus those recorded at or
/// below one of them: so a query reads `O(log m)` unions, not the buffers one by one.
///
/// What is recorded at the ancestors of a node is read as one union, `path`, kept between
/// queries and brought up to date when an ancestor's own ranges grew since, and read once for
/// the ancestors the span's two ends share (or once per end) rather than once per canonical
/// node: buffers with nested lifetimes (the activations a forward pass keeps for its backward
/// pass) sit at many different ancestors, each holding disconnected pieces of one stack, which
/// merge in the union. (This halved the ranges read on a 1,024-layer schedule.) A union that
/// really has many gaps is indexed by hole size (`holes`), so that best fit need not walk them.
struct Occupancy<'a> {
    starts: &'a [u32],
    /// Leaves at `width..2 * width`; node `n`'s children at `2n` and `2n + 1`.
    width: usize,
    own: Vec<Ranges>,
    below: Vec<Ranges>,
    /// Per node, the union of `own` over the node and its ancestors, sorted, and the insert
    /// (`clock`) it was computed at; `None` until first needed.
    path: Vec<Vec<(u64, u64)>>,
    computed: Vec<Option<u64>>,
    /// Per node, the insert at which its `own` last grew.
    changed: Vec<u64>,
    /// Per node, [`holes_of`] its `path`, and the `computed` of the path it was built from:
    /// built for a long path read a second time, so that a path that changes between reads is
    /// walked rather than indexed.
    holes: Vec<Vec<Hole>>,
    holes_at: Vec<Option<u64>>,
    read_at: Vec<Option<u64>>,
    /// Inserts so far.
    clock: u64,
    /// Scratch: the canonical nodes of the current span.
    canonical: Vec<usize>,
    /// Scratch: the deepest parents of canonical nodes.
    deepest: Vec<usize>,
    /// Scratch: the unions a query reads, named by [`taken`](Self::taken).
    lists: Vec<List>,
}

/// One of the unions of byte ranges an [`Occupancy`] keeps, by node.
#[derive(Clone, Copy)]
enum List {
    /// What is recorded at or below the node.
    Below(usize),
    /// What is recorded at the node.
    Own(usize),
    /// What is recorded at the node and its ancestors.
    Path(usize),
}

impl<'a> Occupancy<'a> {
    fn new(starts: &'a [u32]) -> Self {
        let width = starts.len().next_power_of_two();
        Self {
            starts,
            width,
            own: vec![Ranges::default(); 2 * width],
            below: vec![Ranges::default(); 2 * width],
            path: vec![Vec::new(); 2 * width],
            computed: vec![None; 2 * width],
            changed: vec![0; 2 * width],
            holes: vec![Vec::new(); 2 * width],
            holes_at: vec![None; 2 * width],
            read_at: vec![None; 2 * width],
            clock: 0,
            canonical: Vec::new(),
            deepest: Vec::new(),
            lists: Vec::new(),
        }
    }

    /// Finds the canonical nodes of `b`'s leaf span.
    fn decompose(&mut self, b: &Interval) {
        let lo = self
            .starts
            .binary_search(&b.first)
            .expect("every start time is a leaf");
        let hi = self.starts.partition_point(|&s| s <= b.last); // one past the last leaf
        self.canonical.clear();
        let (mut l, mut r) = (lo + self.width, hi + self.width);
        while l < r {
            if l & 1 == 1 {
                self.canonical.push(l);
                l += 1;
            }
            if r & 1 == 1 {
                r -= 1;
                self.canonical.push(r);
            }
            l >>= 1;
            r >>= 1;
        }
    }

    /// Records buffer `b` at `offset`.
    fn insert(&mut self, b: &Interval, offset: u64) {
        let end = offset.saturating_add(b.size);
        self.clock += 1;
        self.decompose(b);
        for &v in &self.canonical {
            if self.own[v].insert(offset, end) {
                self.changed[v] = self.clock;
            }
            // Ancestors already holding the range (from a sibling's insert) hold it above too.
            let mut u = v;
            while u > 0 && self.below[u].insert(offset, end) {
                u >>= 1;
            }
        }
    }

    /// Brings `path[v]` up to date, and those of its ancestors.
    fn update_path(&mut self, v: usize) {
        // From the root down: a node's union is current if its own ranges and its parent's
        // union have not changed since it was computed.
        let depth = usize::BITS - 1 - v.leading_zeros();
        let mut parent_computed = 0;
        for level in 0..=depth {
            let u = v >> (depth - level);
            let current =
                self.computed[u].is_some_and(|at| at >= self.changed[u] && at >= parent_computed);
            if !current {
                // Merged in place, so each node's vector keeps its capacity between updates.
                let (above, here) = self.path.split_at_mut(u);
                let above: &[(u64, u64)] = if u > 1 { &above[u >> 1] } else { &[] };
                merge_unions(above, self.own[u].as_slice(), &mut here[0]);
                self.computed[u] = Some(self.clock);
            }
            parent_computed = self.computed[u].unwrap_or(0);
        }
    }

    /// The bytes of recorded buffers live with `b`: names in `lists` the unions at and below
    /// its span's canonical nodes and, where one path union is read, the own unions of their
    /// ancestors below the meeting node (empty unions left out); returns the nodes whose path
    /// unions (`path`) hold the rest, brought up to date.
    ///
    /// The ancestors of the canonical nodes lie on two root-to-leaf paths, one per end of the
    /// span, through the deepest parents of canonical nodes; above the point where the two meet
    /// they are shared. That shared part is read as one cached union; the few nodes below it,
    /// on either side, are read as their own ranges.
    fn taken(&mut self, b: &Interval) -> Ancestors {
        self.lists.clear();
        self.decompose(b);
        self.deepest.clear();
        let mut meet: Option<usize> = None;
        for i in 0..self.canonical.len() {
            let v = self.canonical[i];
            if !self.below[v].as_slice().is_empty() {
                self.lists.push(List::Below(v));
            }
            let parent = v >> 1;
            let deeper = |&w: &usize| w > 1 && w >> 1 != parent && is_ancestor(parent, w >> 1);
            if parent > 0 && !self.canonical.iter().any(deeper) {
                meet = Some(meet.map_or(parent, |m| common_ancestor(m, parent)));
                self.deepest.push(parent);
            }
        }
        let Some(meet) = meet else {
            return Ancestors::None;
        };
        // Every deepest parent (two at most), up to the meeting node, which it excludes.
        let chain_ranges: usize = below_meet(&self.deepest, meet)
            .map(|u| self.own[u].as_slice().len())
            .sum();
        self.update_path(meet);
        let shared = self.path[meet].len();
        match self.deepest[..] {
            // The two sides below the meeting node hold a large part of the ranges (a span
            // across a high boundary of the tree): their cached unions beat reading those.
            [p, q] if shared < HOLE_INDEX_MIN || 2 * chain_ranges > shared => {
                self.update_path(p);
                self.update_path(q);
                Ancestors::Two(p, q)
            }
            _ => {
                for u in below_meet(&self.deepest, meet) {
                    if !self.own[u].as_slice().is_empty() {
                        self.lists.push(List::Own(u));
                    }
                }
                Ancestors::One(meet)
            }
        }
    }

    /// The ranges of union `l`.
    fn list(&self, l: List) -> &[(u64, u64)] {
        match l {
            List::Below(v) => self.below[v].as_slice(),
            List::Own(u) => self.own[u].as_slice(),
            List::Path(v) => &self.path[v],
        }
    }

    /// Replaces `out` with the ranges of the unions named by the last [`taken`](Self::taken),
    /// sorted by start (they may overlap across unions). The stable sort finds and merges the
    /// sorted runs, one per union.
    fn gather(&self, out: &mut Vec<(u64, u64)>) {
        out.clear();
        for &l in &self.lists {
            out.extend_from_slice(self.list(l));
        }
        out.sort();
    }

    /// Best fit for `size` bytes at `align` against the unions named by the last
    /// [`taken`](Self::taken) and the path unions of `ancestors`, read by
    /// [`best_hole_across`], the longest first.
    fn best_hole(
        &mut self,
        ancestors: Ancestors,
        size: u64,
        align: u64,
        windows: &mut Windows,
    ) -> u64 {
        match ancestors {
            Ancestors::None => {}
            Ancestors::One(a) => self.lists.push(List::Path(a)),
            Ancestors::Two(p, q) => self.lists.extend([List::Path(p), List::Path(q)]),
        }
        let mut lists = std::mem::take(&mut self.lists);
        lists.sort_unstable_by_key(|&l| Reverse(self.list(l).len()));
        let offset = best_hole_across(lists.iter().map(|&l| self.list(l)), size, align, windows);
        self.lists = lists;
        offset
    }

    /// Whether `holes[v]` indexes `path[v]` (the union of what is recorded at node `v` and its
    /// ancestors, as of the last [`taken`](Self::taken) that named `v`) by hole size, indexing
    /// a long union the second time it is read unchanged.
    fn indexed(&mut self, v: usize) -> bool {
        let at = self.computed[v];
        if self.path[v].len() < HOLE_INDEX_MIN {
            return false;
        }
        if self.holes_at[v] != at {
            if self.read_at[v] != at {
                // Read once at this version: a walk costs no more than indexing it would.
                self.read_at[v] = at;
                return false;
            }
            holes_of(&self.path[v], &mut self.holes[v]);
            self.holes_at[v] = at;
        }
        true
    }
}

/// Where the bytes taken by buffers recorded above a span's canonical nodes are, besides the
/// ranges [`Occupancy::taken`] lists.
enum Ancestors {
    /// Nowhere: the span is the whole tree.
    None,
    /// In the path union of this node.
    One(usize),
    /// In the path unions of these two.
    Two(usize, usize),
}

/// The shortest path union worth indexing by hole size; shorter ones are walked. Unit tests
/// index nearly every union, so that their small random plans go through the index.
const HOLE_INDEX_MIN: usize = if cfg!(test) { 2 } else { 32 };

/// The nodes from each of `deepest` up to `meet`, an ancestor of all of them, which is left out.
fn below_meet(deepest: &[usize], meet: usize) -> impl Iterator<Item = usize> + '_ {
    deepest.iter().flat_map(move |&d| {
        std::iter::successors(Some(d), |&u| Some(u >> 1)).take_while(move |&u| u != meet)
    })
}

/// The deepest common ancestor of nodes `a` and `b` in the heap-numbered tree.
fn common_ancestor(mut a: usize, mut b: usize) -> usize {
    let (da, db) = (a.ilog2(), b.ilog2());
    if da > db {
        a >>= da - db;
    } else {
        b >>= db - da;
    }
    while a != b {
        a >>= 1;
        b >>= 1;
    }
    a
}

/// Whether node `a` is `b` or above it in the heap-numbered tree.
fn is_ancestor(a: usize, b: usize) -> bool {
    let (da, db) = (a.ilog2(), b.ilog2());
    db >= da && b >> (db - da) == a
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::{any, prop, prop_assert_eq, proptest, Strategy as _};

    /// [`best_fit`] with the taken bytes found by scanning every placed buffer live with the
    /// one being placed: the reference the index must agree with, offset for offset.
    fn best_fit_by_scan(intervals: &[Interval], order: &[u32]) -> Vec<u64> {
        let mut offsets = vec![0u64; intervals.len()];
        let mut placed: Vec<usize> = Vec::new();
        for (i, b) in intervals.iter().enumerate() {
            if let Some(offset) = b.fixed_offset {
                offsets[i] = offset;
                if b.occupies() {
                    placed.push(i);
                }
            }
        }
        for &i in order {
            let b = &intervals[i as usize];
            let mut taken: Vec<(u64, u64)> = placed
                .iter()
                .filter(|&&j| intervals[j].live_together(b))
                .map(|&j| (offsets[j], offsets[j] + intervals[j].size))
                .collect();
            offsets[i as usize] = best_hole(&mut taken, b.size, b.alignment());
            placed.push(i as usize);
        }
        offsets
    }

    /// Buffers with lifetimes nested, staggered and short, some pinned, some empty.
    fn buffers() -> impl proptest::strategy::Strategy<Value = Vec<Interval>> {
        let one = (1u64..200, 0u32..60, 0u32..40, 0u8..10, any::<bool>()).prop_map(
            |(size, first, length, kind, pin)| {
                let size = if kind == 0 { 0 } else { size };
                let align = [1, 8, 16, 64][kind as usize % 4];
                let b = Interval::new(size, align, first, first + length);
                if pin && kind == 9 {
                    b.pinned(size * 64)
                } else {
                    b
                }
            },
        );
        prop::collection::vec(one, 0..120)
    }

    proptest! {
        #[test]
        fn the_index_places_every_buffer_where_a_scan_would(intervals in buffers()) {
            let starts = distinct_starts(&intervals);
            for strategy in Strategy::ALL {
                let order = strategy.order(&intervals);
                let offsets = best_fit_by_scan(&intervals, &order);
                prop_assert_eq!(
                    best_fit(&intervals, &order, &starts, None),
                    Some(offsets.clone()),
                    "{}", strategy
                );
                // A bound stops the placement exactly when the arena reaches it.
                let arena = arena_size(&intervals, &offsets);
                prop_assert_eq!(best_fit(&intervals, &order, &starts, Some(arena)), None);
                prop_assert_eq!(
                    best_fit(&intervals, &order, &starts, Some(arena + 1)),
                    Some(offsets)
                );
            }
        }
    }

    /// Up to 40 byte ranges sorted by start, overlapping, touching or apart.
    fn sorted_ranges() -> impl proptest::strategy::Strategy<Value = Vec<(u64, u64)>> {
        prop::collection::vec((0u64..600, 1u64..80), 0..40).prop_map(|mut v| {
            v.sort_unstable();
            v.into_iter().map(|(s, len)| (s, s + len)).collect()
        })
    }

    proptest! {
        #[test]
        fn the_cut_finds_the_hole_a_sort_would(
            lists in prop::collection::vec(sorted_ranges(), 0..6),
            size in 1u64..100,
            align in prop::sample::select(vec![1u64, 2, 8, 16, 64]),
        ) {
            let unions: Vec<Vec<(u64, u64)>> = lists.into_iter().map(union).collect();
            let mut all = unions.concat();
            let mut windows = Windows::default();
            prop_assert_eq!(
                best_hole_across(unions.iter().map(Vec::as_slice), size, align, &mut windows),
                best_hole(&mut all, size, align)
            );
        }
    }

    proptest! {
        #[test]
        fn the_hole_index_finds_the_hole_a_sort_would(
            union_of in sorted_ranges(),
            other in sorted_ranges(),
            spread in 1u64..4,
            size in 1u64..100,
            align in prop::sample::select(vec![1u64, 2, 8, 16, 64]),
        ) {
            // Spread one list out so that some of its holes are long and others cut.
            let spread: Vec<(u64, u64)> =
                union_of.iter().map(|&(s, e)| (s * spread, e * spread)).collect();
            let indexed = union(spread);
            let mut holes = Vec::new();
            holes_of(&indexed, &mut holes);
            let mut all: Vec<(u64, u64)> = [&indexed[..], &other[..]].concat();
            prop_assert_eq!(
                best_hole_indexed(
                    &indexed,
                    &holes,
                    &other,
                    size,
                    align,
                    &mut HoleScratch::default()
                ),
                best_hole(&mut all, size, align)
            );
        }
    }

    /// The union of the ranges in `ranges`, as sorted disjoint non-adjacent ranges.
    fn union(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
        ranges.sort_unstable();
        let mut out: Vec<(u64, u64)> = Vec::new();
        for (s, e) in ranges {
            match out.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => out.push((s, e)),
            }
        }
        out
    }

    /// The index reports the same bytes as a scan of every placed buffer.
    #[test]
    fn plan_occupancy_matches_scan() {
        // A fixed pseudo-random walk is enough here; the property tests cover whole plans.
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        let intervals: Vec<Interval> = (0..400)
            .map(|_| {
                let first = next(300) as u32;
                Interval::new(1 + next(64), 1, first, first + next(40) as u32)
            })
            .collect();
        let offsets: Vec<u64> = intervals.iter().map(|_| next(2000)).collect();
        let starts = distinct_starts(&intervals);
        let mut index = Occupancy::new(&starts);
        let mut got = Vec::new();
        for (i, b) in intervals.iter().enumerate() {
            index.insert(b, offsets[i]);
            if i % 40 != 39 {
                continue;
            }
            for q in &intervals {
                let ancestors = index.taken(q);
                index.gather(&mut got);
                assert!(got.is_sorted());
                match ancestors {
                    Ancestors::None => {}
                    Ancestors::One(m) => got.extend_from_slice(&index.path[m]),
                    Ancestors::Two(m, n) => {
                        got.extend_from_slice(&index.path[m]);
                        got.extend_from_slice(&index.path[n]);
                    }
                }
                let want = (0..=i)
                    .filter(|&j| intervals[j].live_together(q))
                    .map(|j| (offsets[j], offsets[j] + intervals[j].size))
                    .collect();
                assert_eq!(
                    union(got.clone()),
                    union(want),
                    "{q:?} after {} inserts",
                    i + 1
                );
            }
        }
    }
}

/// The planning pass: gives every buffer of a streamed schedule its offset. Device buffers
/// get offsets in one arena from their live ranges on the compute timeline (buffers live all
/// step span it whole); host buffers are laid out one after another, since the host region
/// holds chunks, gradients and swapped activations that are all live across the step.
pub fn plan_buffers(streamed: &mut crate::streams::Streamed) -> Planned {
    use protrain_ir::Space;
    let end = streamed.compute_kernels.saturating_sub(1);
    let device: Vec<usize> = (0..streamed.buffers.len())
        .filter(|&i| streamed.buffers[i].buffer.space == Space::Device)
        .collect();
    let intervals: Vec<Interval> = device
        .iter()
        .map(|&i| {
            let p = &streamed.buffers[i];
            let (first, last) = p.live.unwrap_or((0, end));
            Interval::new(p.buffer.size, BUFFER_ALIGN, first, last.max(first))
        })
        .collect();
    let plan = plan_offsets(&intervals);
    for (&i, &offset) in device.iter().zip(&plan.offsets) {
        streamed.buffers[i].buffer.offset = offset;
    }
    let mut host = 0u64;
    for p in streamed
        .buffers
        .iter_mut()
        .filter(|p| p.buffer.space == Space::Host)
    {
        p.buffer.offset = host;
        host = (host + p.buffer.size).div_ceil(BUFFER_ALIGN) * BUFFER_ALIGN;
    }

    // What the device holds at the peak of live bytes.
    let mut delta = vec![0i128; end as usize + 2];
    for iv in &intervals {
        delta[iv.first as usize] += i128::from(iv.size);
        delta[iv.last as usize + 1] -= i128::from(iv.size);
    }
    let (mut live, mut peak_time, mut peak) = (0i128, 0u32, -1i128);
    for (t, d) in delta.iter().enumerate().take(end as usize + 1) {
        live += d;
        if live > peak {
            (peak, peak_time) = (live, t as u32);
        }
    }
    let mut memory = protrain_ir::MemoryBreakdown::default();
    for (&i, iv) in device.iter().zip(&intervals) {
        if iv.first > peak_time || iv.last < peak_time {
            continue;
        }
        use protrain_ir::BufferKind as K;
        let slot = match streamed.buffers[i].buffer.kind {
            K::Input => &mut memory.inputs,
            K::PersistentChunk { .. } | K::OptimizerState { .. } => &mut memory.persistent,
            K::ChunkSlot { .. } | K::GradChunk { .. } => &mut memory.chunk_buffers,
            K::Workspace => &mut memory.workspace,
            _ => &mut memory.activations,
        };
        *slot += iv.size;
    }
    Planned {
        arena_bytes: plan.arena_bytes,
        lower_bound_bytes: plan.lower_bound_bytes,
        host_bytes: host,
        memory,
        strategy: plan.strategy,
    }
}

/// What the planning pass decided.
#[derive(Clone, Debug)]
pub struct Planned {
    /// Bytes of the device arena.
    pub arena_bytes: u64,
    /// The peak of live device bytes: no placement needs less.
    pub lower_bound_bytes: u64,
    /// Bytes of the host region.
    pub host_bytes: u64,
    /// Device bytes by purpose at the peak of live bytes.
    pub memory: protrain_ir::MemoryBreakdown,
    /// The ordering whose arena was kept.
    pub strategy: Strategy,
}

/// Alignment of each buffer in the disk region: a page, so that reads and writes could go
/// around the page cache (`O_DIRECT`) without copying.
pub const DISK_ALIGN: u64 = 4096;

/// `bytes` rounded up to [`BUFFER_ALIGN`]: where the next buffer after `bytes` starts.
pub fn aligned(bytes: u64) -> u64 {
    bytes.div_ceil(BUFFER_ALIGN) * BUFFER_ALIGN
}

/// Places a buffer that a pass after emission adds ([`crate::accumulate`]'s accumulators and
/// host scratch, [`crate::disk`]'s staging buffers): at the end of `space`, at the next
/// multiple of [`BUFFER_ALIGN`], growing the space by it. Such a buffer lives the whole step,
/// so it overlaps nothing there and the exact peak grows by exactly its bytes; placing it at
/// the end keeps every offset [`plan_buffers`] gave. Returns its id.
pub fn append_buffer(
    schedule: &mut Schedule,
    name: &str,
    space: Space,
    kind: BufferKind,
    size: u64,
) -> BufferId {
    let end = match space {
        Space::Device => &mut schedule.arena_bytes,
        Space::Host => &mut schedule.host_bytes,
        Space::Disk => &mut schedule.disk_bytes,
    };
    let offset = aligned(*end);
    *end = offset + size;
    schedule.buffers.push(Buffer {
        name: name.into(),
        space,
        offset,
        size,
        kind,
        pitch: None,
    });
    BufferId::new(schedule.buffers.len() - 1)
}

/// The bytes of a disk region holding buffers of `sizes`, in that order, each at the next
/// multiple of [`DISK_ALIGN`] (as [`move_to_disk`] lays them out).
pub fn disk_region_bytes(sizes: impl IntoIterator<Item = u64>) -> u64 {
    sizes.into_iter().fold(0u64, |end, size| {
        end.div_ceil(DISK_ALIGN) * DISK_ALIGN + size
    })
}

/// The bytes of `schedule`'s host region laid out again without the buffers `moved` and with
/// buffers of `added` sizes appended, as [`move_to_disk`] and [`append_buffer`] would lay it
/// out: for the disk tier to weigh a choice before it makes it.
pub fn host_bytes_after(schedule: &Schedule, moved: &[BufferId], added: &[u64]) -> u64 {
    let kept = schedule
        .buffers
        .iter()
        .enumerate()
        .filter(|&(i, b)| b.space == Space::Host && !moved.contains(&BufferId::new(i)))
        .map(|(_, b)| b.size);
    kept.chain(added.iter().copied())
        .fold(0u64, |end, size| aligned(end) + size)
}

/// Moves the buffers `moved` (host buffers, in this order) to the disk region, each at the next
/// multiple of [`DISK_ALIGN`], and lays the host region out again without them, its buffers
/// back to back in the order of their offsets, each at the next multiple of [`BUFFER_ALIGN`].
/// Sets [`Schedule::disk_bytes`] and [`Schedule::host_bytes`] (the end of the last buffer). For
/// [`crate::disk`], which then appends its staging buffers ([`append_buffer`]).
pub fn move_to_disk(schedule: &mut Schedule, moved: &[BufferId]) {
    let mut disk = 0u64;
    for &m in moved {
        let b = &mut schedule.buffers[m.index()];
        b.space = Space::Disk;
        b.offset = disk.div_ceil(DISK_ALIGN) * DISK_ALIGN;
        disk = b.offset + b.size;
    }
    schedule.disk_bytes = disk;
    let mut host: Vec<usize> = (0..schedule.buffers.len())
        .filter(|&i| schedule.buffers[i].space == Space::Host)
        .collect();
    host.sort_by_key(|&i| schedule.buffers[i].offset);
    let mut end = 0u64;
    for i in host {
        let b = &mut schedule.buffers[i];
        b.offset = aligned(end);
        end = b.offset + b.size;
    }
    schedule.host_bytes = end;
}
