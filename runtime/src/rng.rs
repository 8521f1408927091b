//! The runtime's one pseudo-random generator: initial weights, the synthetic corpus and test data.
//!
//! The generator is SplitMix64 (Steele, Lea and Flood), taken from `rand_xoshiro`; only the
//! draws built on it live here. Every draw is pinned: initial weights, the synthetic corpus and
//! every test that trains on them depend on these exact bits, so a change here is a change to
//! every run. That is also why normal draws use Box-Muller and not `rand_distr`'s ziggurat.

use rand_xoshiro::rand_core::{Rng as _, SeedableRng};

/// A small, fast, seedable generator: deterministic on every platform.
#[derive(Clone, Debug)]
pub struct Rng(rand_xoshiro::SplitMix64);

impl Rng {
    /// A generator whose state starts at `seed` (SplitMix64 mixes it on every draw).
    pub fn new(seed: u64) -> Self {
        Rng(rand_xoshiro::SplitMix64::seed_from_u64(seed))
    }

    /// A generator for stream `stream` of `seed`: streams of one seed are independent, so
    /// each parameter (say) can draw its values without depending on the others' sizes.
    pub fn stream(seed: u64, stream: u64) -> Self {
        Self::new(seed ^ stream.wrapping_add(1).wrapping_mul(0xD1B5_4A32_D192_ED03))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in (0, 1]: never 0, so its logarithm is finite.
    pub fn uniform_open0(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `[-1, 1)` as an `f32`, from the top 24 bits.
    pub fn signed_unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// Uniform in `0..n` (Lemire's multiply-shift; the bias is below `n / 2^64`).
    pub fn below(&mut self, n: u32) -> u32 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u32
    }

    /// `n` draws from a normal distribution with mean 0 and standard deviation `std`, by
    /// Box-Muller in f64: each pair of uniforms gives a cosine and a sine draw, in that order.
    pub fn normal_vec(&mut self, n: usize, std: f64) -> Vec<f32> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let (u1, u2) = (self.uniform_open0(), self.uniform_open0());
            let r = (-2.0 * u1.ln()).sqrt() * std;
            let theta = std::f64::consts::TAU * u2;
            out.push((r * theta.cos()) as f32);
            if out.len() < n {
                out.push((r * theta.sin()) as f32);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_pinned() {
        // Every value below is what the generators this module replaced (hand-written
        // SplitMix64 copies in params.rs and synthetic.rs) drew, so initial weights and the
        // synthetic corpus are bit-identical to before; a change of generator, seeding or
        // draw is caught here rather than as changed weights.
        let mut rng = Rng::new(1234567);
        let want = [
            6457827717110365317u64,
            3203168211198807973,
            9817491932198370423,
        ];
        for w in want {
            assert_eq!(rng.next_u64(), w);
        }
        // Box-Muller draws of parameter stream 3 of seed 7, as `init_params` makes them:
        // these are the bits every model's initial weights are built from.
        let normal = Rng::stream(7, 3).normal_vec(5, 0.02);
        let bits: Vec<u32> = normal.iter().map(|v| v.to_bits()).collect();
        assert_eq!(
            bits,
            [0x3ced863c, 0xbbebfbb2, 0x3c604b36, 0xbc9729ca, 0xbc37a4dc]
        );
        let mut rng = Rng::new(5);
        let unit: Vec<u32> = (0..3).map(|_| rng.signed_unit().to_bits()).collect();
        assert_eq!(unit, [0xbe67e628, 0x3f012e62, 0xbf08da5a]);
        let below: Vec<u32> = (0..5).map(|_| rng.below(24)).collect();
        assert_eq!(below, [2, 4, 9, 23, 12]);
    }

    #[test]
    fn ranges_hold() {
        let mut rng = Rng::new(9);
        for _ in 0..10_000 {
            let u = rng.uniform_open0();
            assert!(u > 0.0 && u <= 1.0);
            let s = rng.signed_unit();
            assert!((-1.0..1.0).contains(&s));
            assert!(rng.below(24) < 24);
        }
    }
}
