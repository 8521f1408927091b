//! The memory planner: hand-written cases, property tests, and training-step patterns.

use proptest::prelude::*;
use protrain_compiler::plan::{self, check_plan, plan_offsets, plan_offsets_with, Interval, Plan};

const MIB: u64 = 1 << 20;

/// Plans `intervals`, checks the plan, and compares the offsets and arena with `expect`.
fn check(intervals: &[Interval], expect_offsets: &[u64], expect_arena: u64) -> Plan {
    let plan = plan_offsets(intervals);
    check_plan(intervals, &plan).unwrap();
    assert_eq!(plan.offsets, expect_offsets, "offsets of {intervals:?}");
    assert_eq!(plan.arena_bytes, expect_arena, "arena of {intervals:?}");
    plan
}

/// `check_plan` rejects `offsets` in an arena of `arena` bytes with an error containing `why`.
fn check_rejects(intervals: &[Interval], offsets: &[u64], arena: u64, why: &str) {
    let plan = Plan {
        offsets: offsets.to_vec(),
        arena_bytes: arena,
        lower_bound_bytes: 0,
        strategy: plan::Strategy::BySize,
    };
    let err = check_plan(intervals, &plan).unwrap_err();
    assert!(err.contains(why), "expected {why:?} in {err:?}");
}

#[test]
fn plan_empty() {
    let plan = check(&[], &[], 0);
    assert_eq!(plan.lower_bound_bytes, 0);
}

#[test]
fn plan_disjoint_lifetimes_share_offset_zero() {
    let plan = check(
        &[
            Interval::new(100, 1, 0, 2),
            Interval::new(100, 1, 3, 5),
            Interval::new(60, 1, 6, 6),
        ],
        &[0, 0, 0],
        100,
    );
    assert_eq!(plan.lower_bound_bytes, 100);
    assert_eq!(plan.gap_bytes(), 0);
}

#[test]
fn plan_overlapping_lifetimes_stack() {
    check(
        &[
            Interval::new(100, 1, 0, 5),
            Interval::new(50, 1, 1, 3),
            Interval::new(30, 1, 2, 2),
        ],
        &[0, 100, 150],
        180,
    );
}

#[test]
fn plan_ranges_are_inclusive() {
    // The second starts at the instruction where the first is last used: both are live there.
    check(
        &[Interval::new(100, 1, 0, 5), Interval::new(100, 1, 5, 9)],
        &[0, 100],
        200,
    );
}

#[test]
fn plan_alignment_respected() {
    let plan = check(
        &[
            Interval::new(100, 1, 0, 5),
            Interval::new(10, 256, 0, 5),
            Interval::new(5, 4096, 1, 2),
        ],
        &[0, 256, 4096],
        4101,
    );
    // The bound counts unpadded bytes, so the padding shows up in the gap.
    assert_eq!(plan.lower_bound_bytes, 115);
}

#[test]
fn plan_fixed_offsets_respected() {
    check(
        &[
            Interval::new(100, 1, 0, 9).pinned(1000),
            // The larger fills the hole below the pinned buffer, the smaller goes above it.
            Interval::new(500, 1, 0, 9),
            Interval::new(600, 1, 0, 9),
            // Not live with the pinned buffer, so free to take its bytes.
            Interval::new(2000, 1, 10, 12),
        ],
        &[1000, 1100, 0, 0],
        2000,
    );
}

#[test]
fn plan_best_fit_takes_the_smallest_hole() {
    // Pinned buffers leave holes [0, 300) and [400, 500): 400 bytes go above both, 250 in the
    // larger hole, and 80 in the smaller one rather than the 50 bytes left of the larger.
    check(
        &[
            Interval::new(100, 1, 0, 10).pinned(300),
            Interval::new(100, 1, 0, 10).pinned(500),
            Interval::new(400, 1, 0, 10),
            Interval::new(250, 1, 0, 10),
            Interval::new(80, 1, 0, 10),
        ],
        &[300, 500, 600, 0, 400],
        1000,
    );
}

/// The arena of each strategy alone: by size, by start, by size x lifetime.
fn each_arena(intervals: &[Interval]) -> [u64; 3] {
    plan::Strategy::ALL.map(|strategy| plan_offsets_with(intervals, strategy).arena_bytes)
}

/// Arenas count in granules (the coarsest alignment, 256 bytes here). By start ends at 1,792
/// bytes, 252 above the lower bound of 1,540 and in its granule, so nothing can beat it and by
/// size x lifetime is not run; counted in bytes, that order's 1,540 won (found by a search over
/// small random cases).
#[test]
fn plan_in_the_lower_bounds_granule_is_kept() {
    let intervals = [
        Interval::new(512, 256, 1, 2),
        Interval::new(512, 256, 2, 2),
        Interval::new(512, 256, 1, 4),
        Interval::new(768, 256, 4, 5),
        Interval::new(4, 256, 1, 4),
    ];
    assert_eq!(each_arena(&intervals), [1796, 1792, 1540]);
    let plan = check(&intervals, &[768, 1280, 0, 768, 512], 1792);
    assert_eq!(plan.strategy, plan::Strategy::ByStart);
    assert_eq!(plan.lower_bound_bytes, 1540);
}

/// By size ends 4 bytes above the lower bound, one granule above it but within one part in
/// [`plan::OPTIMALITY_GAP`], so by size x lifetime, which would end on the bound, is not run:
/// the plan kept is 4 bytes (0.0001%) larger than running every order would give.
#[test]
fn plan_within_the_optimality_gap_is_kept() {
    let intervals = [
        Interval::new(4 * MIB, 256, 0, 6),
        Interval::new(768, 256, 1, 1),
        Interval::new(512, 256, 2, 5),
        Interval::new(768, 256, 5, 5),
        Interval::new(4, 256, 0, 4),
        Interval::new(4, 256, 2, 4),
    ];
    let bound = 4 * MIB + 1280;
    assert_eq!(each_arena(&intervals), [bound + 4, bound + 256, bound]);
    let plan = plan_offsets(&intervals);
    check_plan(&intervals, &plan).unwrap();
    assert_eq!(plan.strategy, plan::Strategy::BySize);
    assert_eq!(
        (plan.arena_bytes, plan.lower_bound_bytes),
        (bound + 4, bound)
    );
}

#[test]
fn plan_zero_sized_buffers_take_no_space() {
    let plan = check(
        &[
            Interval::new(0, 256, 0, 9),
            Interval::new(64, 1, 0, 9),
            Interval::new(0, 1, 3, 3).pinned(64),
        ],
        &[0, 0, 64],
        64,
    );
    assert_eq!(plan.lower_bound_bytes, 64);
}

#[test]
fn plan_display() {
    let plan = check(
        &[
            Interval::new(3 * MIB, 256, 0, 4),
            Interval::new(MIB, 256, 2, 6),
        ],
        &[0, 3 * MIB],
        4 * MIB,
    );
    assert_eq!(
        plan.to_string(),
        "arena 4.0 MiB for 2 buffers (lower bound 4.0 MiB, gap 0 B = 0.00%), best fit by size"
    );
}

#[test]
fn plan_checker_rejects_bad_plans() {
    let two = [Interval::new(100, 256, 0, 5), Interval::new(100, 1, 5, 9)];
    check_rejects(&two, &[0, 50], 150, "overlap while both are live");
    check_rejects(&two, &[0, 0], 100, "overlap while both are live");
    check_rejects(&two, &[100, 0], 200, "not a multiple of its alignment 256");
    check_rejects(&two, &[0, 100], 150, "ends past the arena");
    check_rejects(&two, &[0], 200, "1 offsets for 2 buffers");
    let pinned = [Interval::new(100, 1, 0, 5).pinned(100)];
    check_rejects(&pinned, &[0], 200, "pinned at 100 but placed at 0");
    // Disjoint lifetimes may share bytes, so this one is fine.
    let plan = Plan {
        offsets: vec![0, 0],
        arena_bytes: 100,
        lower_bound_bytes: 100,
        strategy: plan::Strategy::ByStart,
    };
    check_plan(
        &[Interval::new(100, 1, 0, 4), Interval::new(100, 1, 5, 9)],
        &plan,
    )
    .unwrap();
}

// ---------------------------------------------------------------------------------------------
// Property tests.

/// A buffer of 1 B..1 MiB, aligned to 1, 256 or 4096 bytes, live within 0..200.
fn interval() -> impl Strategy<Value = Interval> {
    (
        1..=MIB,
        prop::sample::select(vec![1u64, 256, 4096]),
        0u32..200,
        0u32..200,
    )
        .prop_map(|(size, align, a, b)| Interval::new(size, align, a.min(b), a.max(b)))
}

/// Random buffers, the first few pinned one above the other so that they never collide.
fn intervals() -> impl Strategy<Value = Vec<Interval>> {
    (prop::collection::vec(interval(), 0..300), 0usize..8).prop_map(|(mut v, pinned)| {
        let mut floor = 0u64;
        for b in v.iter_mut().take(pinned) {
            let offset = floor.next_multiple_of(b.align);
            *b = b.pinned(offset);
            floor = offset + b.size;
        }
        v
    })
}

proptest! {
    // No failure files: a failing case is printed, and this test has no source dir to keep one.
    #![proptest_config(ProptestConfig {
        cases: 128,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn plan_is_valid_and_above_the_bound(intervals in intervals()) {
        let plan = plan_offsets(&intervals);
        prop_assert_eq!(check_plan(&intervals, &plan), Ok(()));
        prop_assert!(plan.arena_bytes >= plan.lower_bound_bytes);
        // Arenas count in granules: the coarsest alignment.
        let granule = plan::granule(&intervals);
        let granules = |p: &Plan| p.arena_bytes.div_ceil(granule);
        let mut each = Vec::new();
        for strategy in plan::Strategy::ALL {
            let one = plan_offsets_with(&intervals, strategy);
            prop_assert_eq!(check_plan(&intervals, &one), Ok(()));
            each.push(one);
        }
        // Exactly the first of the smallest, offset for offset: a strategy that stops once it
        // cannot win must never change which plan is kept. Best fit by size x lifetime, skipped
        // when the better of the other two is close to the lower bound, is the one exception,
        // and then the plan kept is within `OPTIMALITY_GAP` of the bound.
        let first_two = each[..2].iter().min_by_key(|p| granules(p)).unwrap().clone();
        let first_smallest = each.into_iter().min_by_key(granules).unwrap();
        // Every other plan is the first of the smallest, so no strategy beats it.
        if plan != first_smallest {
            prop_assert_eq!(&plan, &first_two);
            prop_assert_eq!(first_smallest.strategy, plan::Strategy::ByArea);
            let gap = plan.arena_bytes - plan.lower_bound_bytes;
            prop_assert!(gap <= plan.lower_bound_bytes / plan::OPTIMALITY_GAP);
        }
    }

    #[test]
    fn plan_is_deterministic(intervals in intervals()) {
        prop_assert_eq!(plan_offsets(&intervals), plan_offsets(&intervals));
    }

    /// Pins part of a planned set where it was placed, adds more buffers, and plans again:
    /// pinned buffers that are live together but never collide, placed first.
    #[test]
    fn plan_around_pinned_buffers(
        first in prop::collection::vec(interval(), 1..150),
        keep in prop::collection::vec(any::<bool>(), 150),
        more in prop::collection::vec(interval(), 0..150),
    ) {
        let plan = plan_offsets(&first);
        let mut intervals: Vec<Interval> = first
            .iter()
            .zip(&plan.offsets)
            .zip(&keep)
            .filter(|&(_, &k)| k)
            .map(|((b, &offset), _)| b.pinned(offset))
            .collect();
        intervals.extend(more);
        let plan = plan_offsets(&intervals);
        prop_assert_eq!(check_plan(&intervals, &plan), Ok(()));
    }
}

// ---------------------------------------------------------------------------------------------
// Training-step patterns.

/// How a transformer block's activations are handled, as the placement pass would choose.
#[derive(Clone, Copy, PartialEq)]
enum Block {
    /// Saved activations stay on the device until the block's backward.
    Keep,
    /// Only the block input is kept; the rest is recomputed at the start of its backward.
    Checkpoint,
    /// Saved activations are offloaded to the host during the next block's forward and
    /// reloaded into new buffers during the backward of the block after.
    Swap,
}

/// Builds the device buffers of one training step in a linear order.
struct Step {
    intervals: Vec<Interval>,
    /// The current instruction.
    t: u32,
    /// Unit activation size: batch x sequence x hidden x 2 bytes.
    h: u64,
    align: u64,
    /// Small deterministic jitter for temporary sizes.
    seed: u64,
}

impl Step {
    fn op(&mut self) -> u32 {
        self.t += 1;
        self.t
    }

    /// A buffer of `eighths / 8` activation units, born now; `use_` extends its life.
    fn alloc(&mut self, eighths: u64) -> usize {
        let size = (self.h * eighths / 8).next_multiple_of(self.align);
        self.intervals
            .push(Interval::new(size, self.align, self.t, self.t));
        self.intervals.len() - 1
    }

    /// Marks buffer `i` as used now: its range extends to the current instruction.
    fn use_(&mut self, i: usize) {
        self.intervals[i].last = self.t;
    }

    /// A kernel workspace of a jittered size, live for the current instruction only.
    fn workspace(&mut self, eighths: u64) {
        self.seed = self
            .seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let jitter = 6 + (self.seed >> 60) % 5; // 6..=10 eighths of the nominal size
        self.alloc(eighths * jitter / 8);
    }
}

/// Ids of one block's saved activations, in the order forward produced them.
#[derive(Clone, Copy)]
struct Saved {
    x: usize,
    ln1: usize,
    qkv: usize,
    attn: usize,
    stats: usize,
    x_mid: usize,
    ln2: usize,
    fc1: usize,
    gelu: usize,
}

impl Saved {
    fn all(&self) -> [usize; 9] {
        let Saved {
            x,
            ln1,
            qkv,
            attn,
            stats,
            x_mid,
            ln2,
            fc1,
            gelu,
        } = *self;
        [x, ln1, qkv, attn, stats, x_mid, ln2, fc1, gelu]
    }

    fn map(&self, mut f: impl FnMut(usize) -> usize) -> Saved {
        let [x, ln1, qkv, attn, stats, x_mid, ln2, fc1, gelu] = self.all().map(&mut f);
        Saved {
            x,
            ln1,
            qkv,
            attn,
            stats,
            x_mid,
            ln2,
            fc1,
            gelu,
        }
    }
}

/// A block's forward: ops in order, returning the saved activations and the block output.
fn block_forward(s: &mut Step, x: usize) -> (Saved, usize) {
    s.op();
    s.use_(x);
    let ln1 = s.alloc(8);
    s.op();
    s.use_(ln1);
    let qkv = s.alloc(24);
    s.workspace(2);
    s.op();
    s.use_(qkv);
    let attn = s.alloc(8);
    let stats = s.alloc(1);
    s.workspace(16);
    s.op();
    s.use_(attn);
    let proj = s.alloc(8);
    s.workspace(2);
    s.op();
    s.use_(proj);
    s.use_(x);
    let x_mid = s.alloc(8);
    s.op();
    s.use_(x_mid);
    let ln2 = s.alloc(8);
    s.op();
    s.use_(ln2);
    let fc1 = s.alloc(32);
    s.workspace(2);
    s.op();
    s.use_(fc1);
    let gelu = s.alloc(32);
    s.op();
    s.use_(gelu);
    let fc2 = s.alloc(8);
    s.workspace(2);
    s.op();
    s.use_(fc2);
    s.use_(x_mid);
    let out = s.alloc(8);
    let saved = Saved {
        x,
        ln1,
        qkv,
        attn,
        stats,
        x_mid,
        ln2,
        fc1,
        gelu,
    };
    (saved, out)
}

/// A block's backward from the gradient `dy` of its output; returns the input's gradient.
fn block_backward(s: &mut Step, a: &Saved, dy: usize) -> usize {
    s.op(); // fc2 backward
    s.use_(dy);
    s.use_(a.gelu);
    let dgelu = s.alloc(32);
    s.workspace(2);
    s.op(); // gelu backward
    s.use_(dgelu);
    s.use_(a.fc1);
    let dfc1 = s.alloc(32);
    s.op(); // fc1 backward
    s.use_(dfc1);
    s.use_(a.ln2);
    let dln2 = s.alloc(8);
    s.workspace(2);
    s.op(); // ln2 backward, plus the residual's gradient
    s.use_(dln2);
    s.use_(a.x_mid);
    s.use_(dy);
    let dmid = s.alloc(8);
    s.op(); // proj backward
    s.use_(dmid);
    s.use_(a.attn);
    let dattn = s.alloc(8);
    s.workspace(2);
    s.op(); // attention backward
    s.use_(dattn);
    s.use_(a.qkv);
    s.use_(a.stats);
    let dqkv = s.alloc(24);
    s.workspace(16);
    s.op(); // qkv backward
    s.use_(dqkv);
    s.use_(a.ln1);
    let dln1 = s.alloc(8);
    s.workspace(2);
    s.op(); // ln1 backward, plus the residual's gradient
    s.use_(dln1);
    s.use_(a.x);
    s.use_(dmid);
    s.alloc(8)
}

/// One training step of a decoder-only transformer: embedding, `blocks` in forward order, head
/// and loss, then the blocks' backward in reverse order. With `persistent`, a region of that many
/// bytes (model states kept on the device) is pinned at offset 0 for the whole step.
fn training_step(
    blocks: &[Block],
    h: u64,
    vocab_units: u64,
    persistent: u64,
    seed: u64,
) -> Vec<Interval> {
    /// What backward finds of a block's forward.
    enum Held {
        Kept(Saved),
        Recompute { input: usize },
        Swapped(Saved),
    }
    let mut s = Step {
        intervals: Vec::new(),
        t: 0,
        h,
        align: 256,
        seed,
    };
    if persistent > 0 {
        s.intervals
            .push(Interval::new(persistent, 4096, 0, 0).pinned(0));
    }
    let tokens = s.alloc(1);
    s.op();
    s.use_(tokens);
    let mut x = s.alloc(8);
    let mut held = Vec::new();
    // Device copies of a swapped block's activations, freed once the next block's forward has
    // overlapped their offload.
    let mut offloading: Vec<usize> = Vec::new();
    for &block in blocks {
        let input = x;
        let (a, out) = block_forward(&mut s, input);
        for i in offloading.drain(..) {
            s.use_(i);
        }
        held.push(match block {
            Block::Keep => Held::Kept(a),
            // The activations die after their last forward use; only the input is kept.
            Block::Checkpoint => Held::Recompute { input },
            Block::Swap => {
                offloading.extend(a.all());
                Held::Swapped(a)
            }
        });
        x = out;
    }
    s.op(); // final norm
    for i in offloading.drain(..) {
        s.use_(i);
    }
    s.use_(x);
    let lnf = s.alloc(8);
    s.op(); // lm head
    s.use_(lnf);
    let logits = s.alloc(8 * vocab_units);
    s.op(); // cross-entropy forward and backward
    s.use_(logits);
    let dlogits = s.alloc(8 * vocab_units);
    s.op(); // lm head backward
    s.use_(dlogits);
    s.use_(logits);
    s.use_(lnf);
    let dlnf = s.alloc(8);
    s.op(); // final norm backward
    s.use_(dlnf);
    s.use_(x);
    let mut dy = s.alloc(8);
    // A swapped block is reloaded into fresh buffers one block ahead of its backward.
    let mut reloaded: Option<Saved> = None;
    let reload = |s: &mut Step, held: &Held| match held {
        Held::Swapped(a) => Some(a.map(|i| {
            let copy = s.intervals[i];
            s.intervals
                .push(Interval::new(copy.size, copy.align, s.t, s.t));
            s.intervals.len() - 1
        })),
        _ => None,
    };
    if let Some(last) = held.last() {
        reloaded = reload(&mut s, last);
    }
    while let Some(h) = held.pop() {
        let a = match h {
            Held::Kept(a) => a,
            Held::Recompute { input } => block_forward(&mut s, input).0,
            Held::Swapped(_) => reloaded.take().expect("reloaded one block ahead"),
        };
        if let Some(next) = held.last() {
            reloaded = reload(&mut s, next);
        }
        dy = block_backward(&mut s, &a, dy);
    }
    let t_end = s.op();
    s.use_(dy);
    if persistent > 0 {
        s.intervals[0].last = t_end;
    }
    s.intervals
}

/// Plans a pattern with every strategy, prints the gaps, and returns the gap of the kept plan,
/// which must be the first smallest of the three, offset for offset: the strategies that stop
/// early against by start's arena must never change which plan is kept, here on the
/// lifetimes of whole training steps.
fn gaps(name: &str, intervals: &[Interval]) -> f64 {
    let plan = plan_offsets(intervals);
    check_plan(intervals, &plan).unwrap();
    let all: Vec<Plan> = plan::Strategy::ALL
        .iter()
        .map(|&st| plan_offsets_with(intervals, st))
        .collect();
    let each: Vec<String> = all
        .iter()
        .map(|p| {
            check_plan(intervals, p).unwrap();
            format!("{}: {:.3}%", p.strategy, 100.0 * p.gap_fraction())
        })
        .collect();
    println!("{name}: {plan}; {}", each.join(", "));
    let first_smallest = all.iter().min_by_key(|p| p.arena_bytes).unwrap();
    assert_eq!(&plan, first_smallest, "{name}: not the first smallest plan");
    plan.gap_fraction()
}

/// ProTrain's interleaved block layout: `swap` swapped blocks early, interleaved with
/// `checkpoint` checkpointed ones, the rest kept.
fn layout(blocks: usize, swap: usize, checkpoint: usize) -> Vec<Block> {
    let (mut swap, mut checkpoint) = (swap, checkpoint);
    (0..blocks)
        .map(|i| {
            if swap > 0 && (i % 2 == 0 || checkpoint == 0) {
                swap -= 1;
                Block::Swap
            } else if checkpoint > 0 {
                checkpoint -= 1;
                Block::Checkpoint
            } else {
                Block::Keep
            }
        })
        .collect()
}

#[test]
fn plan_training_steps_within_3_percent_of_the_bound() {
    let h = 8 * 2048 * 4096 * 2; // batch 8, sequence 2048, hidden 4096, bf16: 128 MiB
    let gpt2 = 4 * 1024 * 768 * 2; // batch 4, sequence 1024, hidden 768: 6 MiB
    let cases = [
        ("48 kept", training_step(&layout(48, 0, 0), h, 8, 0, 1)),
        (
            "48 kept, large vocabulary",
            training_step(&layout(48, 0, 0), h / 4, 32, 0, 2),
        ),
        (
            "48 kept, persistent region",
            training_step(&layout(48, 0, 0), h, 8, 40 * h, 3),
        ),
        (
            "12 kept, GPT-2 small",
            training_step(&layout(12, 0, 0), gpt2, 65, 0, 4),
        ),
        (
            "48 checkpointed",
            training_step(&layout(48, 0, 48), h, 8, 0, 5),
        ),
        ("48 swapped", training_step(&layout(48, 48, 0), h, 8, 0, 6)),
        (
            "48 swapped, persistent region",
            training_step(&layout(48, 48, 0), h, 8, 10 * h, 7),
        ),
        (
            "48 = 32 swap + 16 ckpt",
            training_step(&layout(48, 32, 16), h, 8, 0, 8),
        ),
        (
            "48 = 16 swap + 16 ckpt + 16 keep",
            training_step(&layout(48, 16, 16), h, 8, 10 * h, 9),
        ),
        (
            "48 = 8 swap + 24 ckpt + 16 keep",
            training_step(&layout(48, 8, 24), h, 8, 0, 10),
        ),
        (
            "80 = 60 swap + 20 ckpt",
            training_step(&layout(80, 60, 20), h, 4, 0, 11),
        ),
        (
            "80 = 20 swap + 40 ckpt + 20 keep",
            training_step(&layout(80, 20, 40), h, 4, 0, 12),
        ),
    ];
    for (name, intervals) in &cases {
        let gap = gaps(name, intervals);
        assert!(
            gap <= 0.03,
            "{name}: arena {:.2}% above the lower bound",
            100.0 * gap
        );
    }
}
