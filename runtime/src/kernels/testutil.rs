//! Test helpers for the kernels: deterministic test data and a finite-difference gradient check.

/// Test data drawn from the runtime's generator ([`crate::rng::Rng`]).
pub struct Rng(crate::rng::Rng);

impl Rng {
    /// A generator with the given seed.
    pub fn new(seed: u64) -> Self {
        Rng(crate::rng::Rng::new(seed))
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        self.0.signed_unit()
    }

    /// `n` values uniform in [-1, 1).
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        let n = u32::try_from(n).expect("test ranges fit in u32");
        self.0.below(n) as usize
    }
}

/// Step of the central differences. The kernels run in f32, so the difference quotient carries
/// a rounding error of about `eps_f32 * |loss| / h` (~1e-5 for these sizes), and a truncation
/// error of about `h^2 / 6 * f'''` (~1e-5 for the smooth ops here); 1e-2 balances the two.
const H: f32 = 1e-2;

/// Allowed `|fd - analytic| <= ATOL + RTOL * |analytic|`. Ten times the error budget above,
/// and far below what a wrong formula gives (a missing term, factor or sign is O(0.1..1)).
const ATOL: f64 = 1e-3;
const RTOL: f64 = 1e-3;

/// `sum_i out[i] * cot[i]` in f64.
pub fn weighted(out: &[f32], cot: &[f32]) -> f64 {
    assert_eq!(out.len(), cot.len());
    out.iter()
        .zip(cot)
        .map(|(&o, &c)| o as f64 * c as f64)
        .sum()
}

/// Checks `analytic` against the central-difference gradient of `x -> sum(f(x) * cot)`.
pub fn check_grad(
    name: &str,
    x: &[f32],
    analytic: &[f32],
    f: impl Fn(&[f32]) -> Vec<f32>,
    cot: &[f32],
) {
    check_grad_scalar(name, x, analytic, |x| weighted(&f(x), cot));
}

/// Checks `analytic` against the central-difference gradient of the scalar `loss`.
pub fn check_grad_scalar(name: &str, x: &[f32], analytic: &[f32], loss: impl Fn(&[f32]) -> f64) {
    assert_eq!(
        x.len(),
        analytic.len(),
        "{name}: gradient has the wrong length"
    );
    let mut xp = x.to_vec();
    for i in 0..x.len() {
        let (hi, lo) = (x[i] + H, x[i] - H);
        xp[i] = hi;
        let fp = loss(&xp);
        xp[i] = lo;
        let fm = loss(&xp);
        xp[i] = x[i];
        let fd = (fp - fm) / (hi as f64 - lo as f64);
        let an = analytic[i] as f64;
        let err = (fd - an).abs();
        assert!(
            err <= ATOL + RTOL * an.abs(),
            "{name}[{i}]: analytic {an} vs finite difference {fd}"
        );
    }
    // A gradient that is all zeros passes trivially against a constant function; make sure the
    // check actually exercised something.
    assert!(
        analytic.iter().any(|&g| g.abs() > 1e-3),
        "{name}: gradient is all ~zero, the check is vacuous"
    );
}

/// Checks `analytic` along a few random directions `u`: `(loss(x + h u) - loss(x - h u)) / 2h`
/// against `analytic . u`. For inputs too large to difference one element at a time; a wrong
/// gradient component of size `e` moves the dot product by about `e`, so the tolerance is taken
/// relative to `sum |analytic_i u_i|`.
pub fn check_grad_directional(
    name: &str,
    x: &[f32],
    analytic: &[f32],
    loss: impl Fn(&[f32]) -> f64,
) {
    assert_eq!(
        x.len(),
        analytic.len(),
        "{name}: gradient has the wrong length"
    );
    let mut rng = Rng::new(x.len() as u64);
    for dir in 0..4 {
        let u = rng.vec(x.len());
        let xp: Vec<f32> = x.iter().zip(&u).map(|(&a, &b)| a + H * b).collect();
        let xm: Vec<f32> = x.iter().zip(&u).map(|(&a, &b)| a - H * b).collect();
        let fd = (loss(&xp) - loss(&xm)) / (2.0 * H as f64);
        let an: f64 = analytic
            .iter()
            .zip(&u)
            .map(|(&g, &b)| g as f64 * b as f64)
            .sum();
        let scale: f64 = analytic
            .iter()
            .zip(&u)
            .map(|(&g, &b)| (g as f64 * b as f64).abs())
            .sum();
        assert!(
            (fd - an).abs() <= ATOL + RTOL * scale,
            "{name} direction {dir}: analytic {an} vs finite difference {fd}"
        );
    }
}

/// Asserts `|a - b| <= tol * (1 + |b|)` elementwise.
pub fn assert_close(name: &str, a: &[f32], b: &[f64], tol: f64) {
    assert_eq!(a.len(), b.len(), "{name}: length");
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x as f64 - y).abs() <= tol * (1.0 + y.abs()),
            "{name}[{i}]: {x} vs reference {y}"
        );
    }
}

/// The bit patterns of a slice, for exact comparisons that treat NaN as equal to itself.
pub fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}
