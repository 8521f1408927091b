//! Pointwise activations: GELU (tanh form, HF `gelu_new`), ReLU, SiLU, SwiGLU, GeGLU, and
//! Gemma's soft-cap and constant scale.
//!
//! Every backward overwrites its input gradient(s). All are parallel over fixed-size chunks and
//! compute each element independently, so results do not depend on the thread count.

use rayon::prelude::*;

use super::math::{fast, sigmoid, ELEM_GRAIN};

/// `sqrt(2 / pi)`.
const GELU_K: f32 = 0.797_884_6;
/// The cubic coefficient of the tanh approximation.
const GELU_C: f32 = 0.044_715;

/// `out = f(x)`, elementwise, in parallel chunks.
fn map(out: &mut [f32], x: &[f32], f: impl Fn(f32) -> f32 + Sync) {
    assert_eq!(out.len(), x.len(), "activation: length mismatch");
    out.par_chunks_mut(ELEM_GRAIN)
        .zip(x.par_chunks(ELEM_GRAIN))
        .for_each(|(o, x)| {
            fast(
                #[inline(always)]
                || {
                    for (o, &x) in o.iter_mut().zip(x) {
                        *o = f(x);
                    }
                },
            )
        });
}

/// `out = f(a, b)`, elementwise, in parallel chunks.
fn map2(out: &mut [f32], a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32 + Sync) {
    assert_eq!(out.len(), a.len(), "activation: length mismatch");
    assert_eq!(out.len(), b.len(), "activation: length mismatch");
    out.par_chunks_mut(ELEM_GRAIN)
        .zip(a.par_chunks(ELEM_GRAIN).zip(b.par_chunks(ELEM_GRAIN)))
        .for_each(|(o, (a, b))| {
            fast(
                #[inline(always)]
                || {
                    for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
                        *o = f(a, b);
                    }
                },
            )
        });
}

/// `1 + tanh(u) = 2 sigmoid(2u)`, so `gelu(x) = x * sigmoid(2u)`: the same function as HF's
/// `0.5 * x * (1 + tanh(u))` with `u = sqrt(2/pi) (x + 0.044715 x^3)`, without the
/// cancellation in `1 + tanh` for negative `x`. Returns `sigmoid(2u)`.
#[inline(always)]
fn gelu_parts(x: f32) -> f32 {
    let u = GELU_K * (x + GELU_C * (x * x * x));
    sigmoid(2.0 * u)
}

/// GELU, tanh approximation (HF `gelu_new`, `F.gelu(approximate="tanh")`):
/// `out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub fn gelu_forward(out: &mut [f32], x: &[f32]) {
    map(
        out,
        x,
        #[inline(always)]
        |x| x * gelu_parts(x),
    );
}

/// Backward of [`gelu_forward`]: `dx = dout * gelu'(x)`, with
/// `gelu'(x) = s + 2 x s (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 x^2)` and `s = sigmoid(2u)`.
pub fn gelu_backward(dx: &mut [f32], dout: &[f32], x: &[f32]) {
    map2(
        dx,
        dout,
        x,
        #[inline(always)]
        |d, x| {
            let s = gelu_parts(x);
            let du = GELU_K * (1.0 + 3.0 * GELU_C * (x * x));
            d * (s + 2.0 * x * s * (1.0 - s) * du)
        },
    );
}

/// ReLU: `out = max(x, 0)`, NaN propagated as `torch.relu` does.
pub fn relu_forward(out: &mut [f32], x: &[f32]) {
    map(
        out,
        x,
        #[inline(always)]
        |x| if x <= 0.0 { 0.0 } else { x },
    );
}

/// Backward of [`relu_forward`]: `dx = dout` where `x > 0`, else 0 (torch's
/// `threshold_backward`).
pub fn relu_backward(dx: &mut [f32], dout: &[f32], x: &[f32]) {
    map2(
        dx,
        dout,
        x,
        #[inline(always)]
        |d, x| if x <= 0.0 { 0.0 } else { d },
    );
}

/// SiLU: `out = x / (1 + e^-x)` (= `x * sigmoid(x)`, in the form torch's CPU kernel uses).
pub fn silu_forward(out: &mut [f32], x: &[f32]) {
    map(
        out,
        x,
        #[inline(always)]
        |x| x / (1.0 + super::math::exp(-x)),
    );
}

/// `d silu / dx = s (1 + x (1 - s))` with `s = sigmoid(x)`.
#[inline(always)]
fn silu_grad(x: f32) -> f32 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
}

/// Backward of [`silu_forward`]: `dx = dout * s (1 + x (1 - s))`, `s = sigmoid(x)`.
pub fn silu_backward(dx: &mut [f32], dout: &[f32], x: &[f32]) {
    map2(
        dx,
        dout,
        x,
        #[inline(always)]
        |d, x| d * silu_grad(x),
    );
}

/// SwiGLU, the LLaMA MLP gate: `out = silu(gate) * up`; all three have the same shape.
pub fn swiglu_forward(out: &mut [f32], gate: &[f32], up: &[f32]) {
    map2(
        out,
        gate,
        up,
        #[inline(always)]
        |g, u| g / (1.0 + super::math::exp(-g)) * u,
    );
}

/// Backward of [`swiglu_forward`]: `dgate = dout * up * silu'(gate)`, `dup = dout *
/// silu(gate)`, both overwritten.
pub fn swiglu_backward(dgate: &mut [f32], dup: &mut [f32], dout: &[f32], gate: &[f32], up: &[f32]) {
    let n = dout.len();
    for (len, what) in [
        (dgate.len(), "dgate"),
        (dup.len(), "dup"),
        (gate.len(), "gate"),
        (up.len(), "up"),
    ] {
        assert_eq!(len, n, "swiglu_backward: {what} length differs from dout");
    }
    dgate
        .par_chunks_mut(ELEM_GRAIN)
        .zip(dup.par_chunks_mut(ELEM_GRAIN))
        .zip(dout.par_chunks(ELEM_GRAIN))
        .zip(gate.par_chunks(ELEM_GRAIN).zip(up.par_chunks(ELEM_GRAIN)))
        .for_each(|(((dg, du), d), (g, u))| {
            fast(
                #[inline(always)]
                || {
                    for ((((dg, du), &d), &g), &u) in dg.iter_mut().zip(du).zip(d).zip(g).zip(u) {
                        let s = sigmoid(g);
                        *du = d * (g * s);
                        *dg = d * u * (s * (1.0 + g * (1.0 - s)));
                    }
                },
            )
        });
}

/// GeGLU, Gemma's MLP gate: `out = gelu_tanh(gate) * up` (transformers' `gelu_pytorch_tanh`,
/// the formula of [`gelu_forward`]).
pub fn geglu_forward(out: &mut [f32], gate: &[f32], up: &[f32]) {
    map2(
        out,
        gate,
        up,
        #[inline(always)]
        |g, u| g * gelu_parts(g) * u,
    );
}

/// Backward of [`geglu_forward`]: `dgate = dout * up * gelu'(gate)`, `dup = dout *
/// gelu(gate)`, both overwritten.
pub fn geglu_backward(dgate: &mut [f32], dup: &mut [f32], dout: &[f32], gate: &[f32], up: &[f32]) {
    let n = dout.len();
    for (len, what) in [
        (dgate.len(), "dgate"),
        (dup.len(), "dup"),
        (gate.len(), "gate"),
        (up.len(), "up"),
    ] {
        assert_eq!(len, n, "geglu_backward: {what} length differs from dout");
    }
    dgate
        .par_chunks_mut(ELEM_GRAIN)
        .zip(dup.par_chunks_mut(ELEM_GRAIN))
        .zip(dout.par_chunks(ELEM_GRAIN))
        .zip(gate.par_chunks(ELEM_GRAIN).zip(up.par_chunks(ELEM_GRAIN)))
        .for_each(|(((dg, du), d), (g, u))| {
            fast(
                #[inline(always)]
                || {
                    for ((((dg, du), &d), &g), &u) in dg.iter_mut().zip(du).zip(d).zip(g).zip(u) {
                        let s = gelu_parts(g);
                        let dk = GELU_K * (1.0 + 3.0 * GELU_C * (g * g));
                        *du = d * (g * s);
                        *dg = d * u * (s + 2.0 * g * s * (1.0 - s) * dk);
                    }
                },
            )
        });
}

/// Soft-capping: `out = cap * tanh(x / cap)` (Gemma 2's final logits).
pub fn softcap_forward(out: &mut [f32], x: &[f32], cap: f32) {
    map(
        out,
        x,
        #[inline(always)]
        |x| cap * (x / cap).tanh(),
    );
}

/// Backward of [`softcap_forward`] from its output `y`: `dx = dout * (1 - (y / cap)^2)`
/// (torch's tanh backward, which also reads the output).
pub fn softcap_backward(dx: &mut [f32], dout: &[f32], y: &[f32], cap: f32) {
    map2(
        dx,
        dout,
        y,
        #[inline(always)]
        |d, y| {
            let t = y / cap;
            d * (1.0 - t * t)
        },
    );
}

/// `out = x * factor` (Gemma's embedding scale; the caller rounds `factor` to the storage
/// type first, as transformers makes it a tensor of the activations' dtype). Its own backward.
pub fn scale_forward(out: &mut [f32], x: &[f32], factor: f32) {
    map(
        out,
        x,
        #[inline(always)]
        |x| x * factor,
    );
}

/// SwiGLU of a packed `[gate | up]`: `x` is rows of `2 * width` (gate first, as
/// `chunk(2, dim=-1)` splits Phi-3's `gate_up_proj` output), `out` rows of `width`, each
/// element computed as [`swiglu_forward`] computes it.
pub fn packed_swiglu_forward(out: &mut [f32], x: &[f32], width: usize) {
    assert!(width > 0, "packed_swiglu: empty rows");
    assert_eq!(
        x.len(),
        2 * out.len(),
        "packed_swiglu: x is not [.., 2 * width]"
    );
    assert!(
        out.len().is_multiple_of(width),
        "packed_swiglu: out is not [.., width]"
    );
    out.par_chunks_mut(width)
        .zip(x.par_chunks(2 * width))
        .with_min_len(ELEM_GRAIN / width + 1)
        .for_each(|(o, xr)| {
            let (gate, up) = xr.split_at(width);
            fast(
                #[inline(always)]
                || {
                    for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                        *o = g / (1.0 + super::math::exp(-g)) * u;
                    }
                },
            )
        });
}

/// Backward of [`packed_swiglu_forward`]: each row of `dx` is `[dgate | dup]`, each element
/// as [`swiglu_backward`] computes it. Overwrites `dx`.
pub fn packed_swiglu_backward(dx: &mut [f32], dout: &[f32], x: &[f32], width: usize) {
    assert!(width > 0, "packed_swiglu_backward: empty rows");
    assert_eq!(
        x.len(),
        2 * dout.len(),
        "packed_swiglu_backward: x is not [.., 2 * width]"
    );
    assert_eq!(
        dx.len(),
        x.len(),
        "packed_swiglu_backward: dx differs from x"
    );
    dx.par_chunks_mut(2 * width)
        .zip(dout.par_chunks(width))
        .zip(x.par_chunks(2 * width))
        .with_min_len(ELEM_GRAIN / width + 1)
        .for_each(|((dxr, d), xr)| {
            let (gate, up) = xr.split_at(width);
            let (dg, du) = dxr.split_at_mut(width);
            fast(
                #[inline(always)]
                || {
                    for ((((dg, du), &d), &g), &u) in dg.iter_mut().zip(du).zip(d).zip(gate).zip(up)
                    {
                        let s = sigmoid(g);
                        *du = d * (g * s);
                        *dg = d * u * (s * (1.0 + g * (1.0 - s)));
                    }
                },
            )
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::{assert_close, check_grad, Rng};

    /// Inputs spread over [-4, 4], kept at least 0.05 away from ReLU's kink so that the
    /// finite difference (step 1e-2) never straddles it.
    fn inputs(seed: u64, n: usize) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        (0..n)
            .map(|_| {
                let v = 4.0 * rng.uniform();
                if v.abs() < 0.05 {
                    v.signum() * 0.05 + v
                } else {
                    v
                }
            })
            .collect()
    }

    fn unary(f: fn(&mut [f32], &[f32]), x: &[f32]) -> Vec<f32> {
        let mut out = vec![f32::NAN; x.len()];
        f(&mut out, x);
        out
    }

    #[test]
    fn forwards_match_the_pytorch_formulas_in_f64() {
        let x = inputs(30, 64);
        let y = inputs(31, 64);
        let gelu: Vec<f64> = x
            .iter()
            .map(|&x| {
                let x = x as f64;
                let k = (2.0 / std::f64::consts::PI).sqrt();
                0.5 * x * (1.0 + (k * (x + 0.044715 * x.powi(3))).tanh())
            })
            .collect();
        assert_close("gelu", &unary(gelu_forward, &x), &gelu, 1e-6);
        let relu: Vec<f64> = x.iter().map(|&x| (x as f64).max(0.0)).collect();
        assert_close("relu", &unary(relu_forward, &x), &relu, 0.0);
        let silu = |x: f64| x / (1.0 + (-x).exp());
        let want: Vec<f64> = x.iter().map(|&x| silu(x as f64)).collect();
        assert_close("silu", &unary(silu_forward, &x), &want, 1e-6);
        let mut out = vec![0.0; 64];
        swiglu_forward(&mut out, &x, &y);
        let want: Vec<f64> = x
            .iter()
            .zip(&y)
            .map(|(&g, &u)| silu(g as f64) * u as f64)
            .collect();
        assert_close("swiglu", &out, &want, 1e-6);
        assert!(unary(relu_forward, &[f32::NAN])[0].is_nan());
    }

    #[test]
    fn gradients() {
        let x = inputs(32, 40);
        let up = inputs(33, 40);
        let cot = Rng::new(34).vec(40);
        type Pair = (
            fn(&mut [f32], &[f32]),
            fn(&mut [f32], &[f32], &[f32]),
            &'static str,
        );
        let pairs: [Pair; 3] = [
            (gelu_forward, gelu_backward, "gelu"),
            (relu_forward, relu_backward, "relu"),
            (silu_forward, silu_backward, "silu"),
        ];
        for (fwd, bwd, name) in pairs {
            let mut dx = vec![f32::NAN; 40];
            bwd(&mut dx, &cot, &x);
            check_grad(name, &x, &dx, |x| unary(fwd, x), &cot);
        }
        let (mut dg, mut du) = (vec![f32::NAN; 40], vec![f32::NAN; 40]);
        swiglu_backward(&mut dg, &mut du, &cot, &x, &up);
        let sw = |g: &[f32], u: &[f32]| {
            let mut o = vec![0.0; 40];
            swiglu_forward(&mut o, g, u);
            o
        };
        check_grad("swiglu dgate", &x, &dg, |g| sw(g, &up), &cot);
        check_grad("swiglu dup", &up, &du, |u| sw(&x, u), &cot);
        let (mut dg, mut du) = (vec![f32::NAN; 40], vec![f32::NAN; 40]);
        geglu_backward(&mut dg, &mut du, &cot, &x, &up);
        let ge = |g: &[f32], u: &[f32]| {
            let mut o = vec![0.0; 40];
            geglu_forward(&mut o, g, u);
            o
        };
        check_grad("geglu dgate", &x, &dg, |g| ge(g, &up), &cot);
        check_grad("geglu dup", &up, &du, |u| ge(&x, u), &cot);
        // A cap of 2 bends inputs of magnitude up to 4 well into tanh's curve.
        let cap = |x: &[f32]| {
            let mut o = vec![0.0; 40];
            softcap_forward(&mut o, x, 2.0);
            o
        };
        let mut dx = vec![f32::NAN; 40];
        softcap_backward(&mut dx, &cot, &cap(&x), 2.0);
        check_grad("softcap", &x, &dx, cap, &cot);
    }

    #[test]
    fn gemma_forwards_match_the_pytorch_formulas_in_f64() {
        let (x, y) = (inputs(35, 64), inputs(36, 64));
        let gelu = |x: f64| {
            let k = (2.0 / std::f64::consts::PI).sqrt();
            0.5 * x * (1.0 + (k * (x + 0.044715 * x.powi(3))).tanh())
        };
        let mut out = vec![0.0; 64];
        geglu_forward(&mut out, &x, &y);
        let want: Vec<f64> = x
            .iter()
            .zip(&y)
            .map(|(&g, &u)| gelu(g as f64) * u as f64)
            .collect();
        assert_close("geglu", &out, &want, 1e-6);
        softcap_forward(&mut out, &x, 3.0);
        let want: Vec<f64> = x.iter().map(|&x| 3.0 * (x as f64 / 3.0).tanh()).collect();
        assert_close("softcap", &out, &want, 1e-6);
        assert!(out.iter().all(|y| y.abs() < 3.0));
        scale_forward(&mut out, &x, 1.5);
        let want: Vec<f64> = x.iter().map(|&x| 1.5 * x as f64).collect();
        assert_close("scale", &out, &want, 1e-6);
    }

    #[test]
    fn packed_swiglu_is_swiglu_of_the_two_halves_bit_for_bit() {
        let (rows, width) = (7, 5);
        let mut rng = Rng::new(90);
        let (x, dout) = (rng.vec(rows * 2 * width), rng.vec(rows * width));
        let gate: Vec<f32> = x
            .chunks(2 * width)
            .flat_map(|r| r[..width].to_vec())
            .collect();
        let up: Vec<f32> = x
            .chunks(2 * width)
            .flat_map(|r| r[width..].to_vec())
            .collect();
        let mut want = vec![0.0; rows * width];
        swiglu_forward(&mut want, &gate, &up);
        let mut got = vec![f32::NAN; rows * width];
        packed_swiglu_forward(&mut got, &x, width);
        assert_eq!(got, want);
        let (mut dgate, mut dup) = (vec![0.0; rows * width], vec![0.0; rows * width]);
        swiglu_backward(&mut dgate, &mut dup, &dout, &gate, &up);
        let mut dx = vec![f32::NAN; x.len()];
        packed_swiglu_backward(&mut dx, &dout, &x, width);
        let want_dx: Vec<f32> = dgate
            .chunks(width)
            .zip(dup.chunks(width))
            .flat_map(|(g, u)| [g, u].concat())
            .collect();
        assert_eq!(dx, want_dx);
        let f = |x: &[f32]| {
            let mut out = vec![0.0; rows * width];
            packed_swiglu_forward(&mut out, x, width);
            out
        };
        check_grad("packed swiglu dx", &x, &dx, f, &dout);
    }
}
