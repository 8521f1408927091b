//! Rotary position embedding, rotate-half form as Hugging Face LLaMA / Mistral apply it.

use rayon::prelude::*;

use super::math::ROW_GRAIN;

pub use protrain_ir::RopeScaling;

/// The `head_dim / 2` inverse frequencies `1 / theta^(2i / head_dim)`, rescaled by `scaling`,
/// computed step by step in f32 as `transformers.modeling_rope_utils` does on a float32 tensor
/// (a Python scalar meeting an f32 tensor is rounded to f32; `s / tensor` is
/// `tensor.reciprocal() * s`), so the values match transformers to the last bit up to libm's
/// `powf` against PyTorch's.
///
/// `head_dim` is the rotated width: the whole head, or its rotary part under
/// `partial_rotary_factor`. LongRoPE divides each frequency by its factor first
/// (`1 / (factor * theta^(2i / dim))`, as `_compute_longrope_parameters`).
pub fn rope_inv_freq(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Vec<f32> {
    assert!(head_dim.is_multiple_of(2), "rope: head_dim must be even");
    let dim = head_dim as f32;
    let base = theta as f32;
    let inv: Vec<f32> = (0..head_dim / 2)
        .map(|i| 1.0 / base.powf((2 * i) as f32 / dim))
        .collect();
    match scaling {
        RopeScaling::None => inv,
        RopeScaling::Linear { factor } => inv.iter().map(|&f| f / *factor as f32).collect(),
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings: old,
            beta_fast,
            beta_slow,
            truncate,
            ..
        } => {
            // `_compute_yarn_parameters`: the correction range in f64 (Python floats), the
            // ramp and the blend in f32 (tensors), each Python scalar rounded to f32 where it
            // meets a tensor.
            let d = head_dim as f64;
            let correction = |rotations: f64| {
                d * (*old as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln()
                    / (2.0 * theta.ln())
            };
            let (mut low, mut high) = (correction(*beta_fast), correction(*beta_slow));
            if *truncate {
                (low, high) = (low.floor(), high.ceil());
            }
            let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
            if low == high {
                high += 0.001;
            }
            let (low_f, span) = (low as f32, (high - low) as f32);
            let factor = *factor as f32;
            (0..head_dim / 2)
                .map(|i| {
                    let pos = base.powf((2 * i) as f32 / dim);
                    let extrapolation = 1.0 / pos;
                    let interpolation = 1.0 / (factor * pos);
                    let ramp = ((i as f32 - low_f) / span).clamp(0.0, 1.0);
                    let extrapolation_factor = 1.0 - ramp;
                    interpolation * (1.0 - extrapolation_factor)
                        + extrapolation * extrapolation_factor
                })
                .collect()
        }
        RopeScaling::LongRope { factors, .. } => {
            assert_eq!(
                factors.len(),
                head_dim / 2,
                "rope: one longrope factor per pair"
            );
            (0..head_dim / 2)
                .zip(factors)
                .map(|(i, &e)| 1.0 / (e as f32 * base.powf((2 * i) as f32 / dim)))
                .collect()
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old,
        } => {
            let (factor, low_freq_factor, high_freq_factor) =
                (*factor, *low_freq_factor, *high_freq_factor);
            let old = *old as f64;
            let low_freq_wavelen = (old / low_freq_factor) as f32;
            let high_freq_wavelen = (old / high_freq_factor) as f32;
            let two_pi = (2.0 * std::f64::consts::PI) as f32;
            let (factor_f, low_f) = (factor as f32, low_freq_factor as f32);
            let band = (high_freq_factor - low_freq_factor) as f32;
            inv.iter()
                .map(|&f| {
                    let wavelen = (1.0 / f) * two_pi;
                    let scaled = if wavelen > low_freq_wavelen {
                        f / factor_f
                    } else {
                        f
                    };
                    let smooth = ((1.0 / wavelen) * old as f32 - low_f) / band;
                    let smoothed = (1.0 - smooth) * scaled / factor_f + smooth * scaled;
                    // Written as transformers writes it: `~(w < high) * ~(w > low)`.
                    #[allow(clippy::neg_cmp_op_on_partial_ord)]
                    let medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
                    if medium {
                        smoothed
                    } else {
                        scaled
                    }
                })
                .collect()
        }
    }
}

/// Which part of `x [B, T, heads * head_dim]` a rotation touches: the first `rotary_dim`
/// elements of each of the first `rotated_heads` heads; the rest is copied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeDims {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Heads in a row of `x`.
    pub heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Rotated width of a rotated head (even, at most `head_dim`).
    pub rotary_dim: usize,
    /// Rotated heads, counted from the first.
    pub rotated_heads: usize,
}

impl RopeDims {
    /// Every head rotated over its whole width.
    pub fn whole(batch: usize, seq: usize, heads: usize, head_dim: usize) -> Self {
        Self {
            batch,
            seq,
            heads,
            head_dim,
            rotary_dim: head_dim,
            rotated_heads: heads,
        }
    }
}

/// Applies `f(x_lo, x_hi, cos, sin) -> (lo, hi)` to every rotation pair of every rotated
/// head, with cos and sin multiplied by `attention_factor` (in f32, as transformers scales
/// them), and copies every other element.
fn rotate(
    out: &mut [f32],
    x: &[f32],
    inv_freq: &[f32],
    attention_factor: f32,
    dims: RopeDims,
    f: impl Fn(f32, f32, f32, f32) -> (f32, f32) + Sync,
) {
    let RopeDims {
        batch,
        seq,
        heads,
        head_dim,
        rotary_dim,
        rotated_heads,
    } = dims;
    let half = rotary_dim / 2;
    let width = heads * head_dim;
    assert!(
        rotary_dim.is_multiple_of(2),
        "rope: rotary_dim must be even"
    );
    assert!(rotary_dim <= head_dim, "rope: rotary_dim exceeds head_dim");
    assert!(
        rotated_heads <= heads,
        "rope: more rotated heads than heads"
    );
    assert_eq!(
        inv_freq.len(),
        half,
        "rope: inv_freq is not [rotary_dim / 2]"
    );
    assert_eq!(x.len(), batch * seq * width, "rope: x is not [B, T, H * D]");
    assert_eq!(out.len(), x.len(), "rope: out is not [B, T, H * D]");
    if width == 0 {
        return;
    }
    let whole = rotary_dim == head_dim && rotated_heads == heads;
    out.par_chunks_mut(width)
        .zip(x.par_chunks(width))
        .enumerate()
        .with_min_len(ROW_GRAIN)
        .for_each(|(row, (o, xr))| {
            if !whole {
                o.copy_from_slice(xr);
            }
            // As transformers: position_ids.float() * inv_freq, then cos and sin in f32.
            let pos = (row % seq) as f32;
            for (i, &w) in inv_freq.iter().enumerate() {
                let angle = pos * w;
                let (sin, cos) = angle.sin_cos();
                let (sin, cos) = (sin * attention_factor, cos * attention_factor);
                for h in 0..rotated_heads {
                    let (lo, hi) = (h * head_dim + i, h * head_dim + i + half);
                    let (a, b) = f(xr[lo], xr[hi], cos, sin);
                    o[lo] = a;
                    o[hi] = b;
                }
            }
        });
}

/// RoPE: `x` and `out` are `[B, T, H * D]`, viewed `[B, T, H, D]`; position `t` (0-based
/// within the sequence) rotates pair `(i, i + D/2)` by `t * inv_freq[i]`:
/// `out[i] = x[i] cos - x[i + D/2] sin`, `out[i + D/2] = x[i + D/2] cos + x[i] sin`, as HF's
/// `q * cos + rotate_half(q) * sin`. `inv_freq` comes from [`rope_inv_freq`]. Overwrites `out`.
pub fn rope_forward(
    out: &mut [f32],
    x: &[f32],
    inv_freq: &[f32],
    batch: usize,
    seq: usize,
    n_heads: usize,
    head_dim: usize,
) {
    partial_rope_forward(
        out,
        x,
        inv_freq,
        1.0,
        RopeDims::whole(batch, seq, n_heads, head_dim),
    );
}

/// RoPE of part of `x` ([`RopeDims`]): pair `(i, i + rotary_dim/2)` of each rotated head as
/// [`rope_forward`] rotates it, with cos and sin multiplied by `attention_factor`; every other
/// element copied. Overwrites `out`.
pub fn partial_rope_forward(
    out: &mut [f32],
    x: &[f32],
    inv_freq: &[f32],
    attention_factor: f32,
    dims: RopeDims,
) {
    rotate(out, x, inv_freq, attention_factor, dims, |lo, hi, c, s| {
        (lo * c - hi * s, hi * c + lo * s)
    });
}

/// Backward of [`rope_forward`]: the inverse (transposed) rotation,
/// `dx[i] = dout[i] cos + dout[i + D/2] sin`, `dx[i + D/2] = dout[i + D/2] cos - dout[i] sin`.
/// Overwrites `dx`.
pub fn rope_backward(
    dx: &mut [f32],
    dout: &[f32],
    inv_freq: &[f32],
    batch: usize,
    seq: usize,
    n_heads: usize,
    head_dim: usize,
) {
    partial_rope_backward(
        dx,
        dout,
        inv_freq,
        1.0,
        RopeDims::whole(batch, seq, n_heads, head_dim),
    );
}

/// Backward of [`partial_rope_forward`]: the inverse rotation of the rotated part (scaled by
/// the same `attention_factor`), the rest copied. Overwrites `dx`.
pub fn partial_rope_backward(
    dx: &mut [f32],
    dout: &[f32],
    inv_freq: &[f32],
    attention_factor: f32,
    dims: RopeDims,
) {
    rotate(
        dx,
        dout,
        inv_freq,
        attention_factor,
        dims,
        |lo, hi, c, s| (lo * c + hi * s, hi * c - lo * s),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::{assert_close, check_grad, Rng};

    #[test]
    fn inv_freq_matches_transformers() {
        // Printed by `make_fixtures.py` (transformers 5.24 and 5.25, torch 2.15:
        // `_compute_default_rope_parameters`, `_compute_linear_scaling_rope_parameters`,
        // `_compute_llama3_parameters`, `_compute_yarn_parameters`,
        // `_compute_longrope_parameters`) for head_dim 16; llama3 with theta 500000, factor 8,
        // low 1, high 4, original 8192; the others with theta 10000: linear factor 4, yarn
        // factor 4 over 64 original positions (betas 32 and 1 truncated, 8 and 2 not),
        // longrope's short factors 1, 1.5, .., 4.5. Every llama3 branch (kept, interpolated,
        // divided) and every yarn ramp region occurs for head_dim 16 at these settings.
        let default = rope_inv_freq(16, 10000.0, &RopeScaling::None);
        let linear = rope_inv_freq(16, 10000.0, &RopeScaling::Linear { factor: 4.0 });
        let llama3 = rope_inv_freq(
            16,
            500000.0,
            &RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            },
        );
        let yarn = |beta_fast, beta_slow, truncate| {
            rope_inv_freq(
                16,
                10000.0,
                &RopeScaling::Yarn {
                    factor: 4.0,
                    original_max_position_embeddings: 64,
                    beta_fast,
                    beta_slow,
                    truncate,
                    attention_factor: 1.0,
                },
            )
        };
        let longrope = rope_inv_freq(
            16,
            10000.0,
            &RopeScaling::LongRope {
                factors: (0..8).map(|i| 1.0 + 0.5 * f64::from(i)).collect(),
                attention_factor: 1.0,
            },
        );
        for (got, want, name) in [
            (&default, fixture::DEFAULT, "default"),
            (&linear, fixture::LINEAR, "linear"),
            (&llama3, fixture::LLAMA3, "llama3"),
            (&yarn(32.0, 1.0, true), fixture::YARN, "yarn"),
            (
                &yarn(8.0, 2.0, false),
                fixture::YARN_UNTRUNCATED,
                "yarn untruncated",
            ),
            (&longrope, fixture::LONGROPE, "longrope"),
        ] {
            // Within one ulp: libm's powf and PyTorch's vectorised pow may round differently.
            assert_eq!(got.len(), want.len(), "{name}");
            for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                let ulp = (w as f32).abs() * f32::EPSILON;
                assert!(
                    (g - w as f32).abs() <= ulp,
                    "{name}[{i}]: {g} vs transformers {w}"
                );
            }
        }
    }

    /// Exact f32 values, printed by `make_fixtures.py` beside this file.
    mod fixture {
        pub const DEFAULT: &[f64] = &[
            1.0,
            0.3162277638912201,
            0.10000000149011612,
            0.03162277862429619,
            0.009999999776482582,
            0.003162277862429619,
            0.0010000000474974513,
            0.0003162277862429619,
        ];
        // LINEAR: attention factor 1.0
        pub const LINEAR: &[f64] = &[
            0.25,
            0.07905694097280502,
            0.02500000037252903,
            0.007905694656074047,
            0.0024999999441206455,
            0.0007905694656074047,
            0.0002500000118743628,
            7.905694656074047e-05,
        ];
        // LLAMA3: attention factor 1.0
        pub const LLAMA3: &[f64] = &[
            1.0,
            0.193922758102417,
            0.03760603070259094,
            0.00729266507551074,
            0.0005248460220173001,
            3.428102354519069e-05,
            6.647869668086059e-06,
            1.289173155782919e-06,
        ];
        // YARN: attention factor 1.138629436111989
        pub const YARN: &[f64] = &[
            1.0,
            0.23717081546783447,
            0.04999999701976776,
            0.007905694656074047,
            0.0024999999441206455,
            0.0007905694656074047,
            0.0002500000118743628,
            7.905694656074047e-05,
        ];
        // YARN_UNTRUNCATED: attention factor 1.138629436111989
        pub const YARN_UNTRUNCATED: &[f64] = &[
            1.0,
            0.16058915853500366,
            0.02500000037252903,
            0.007905694656074047,
            0.0024999999441206455,
            0.0007905694656074047,
            0.0002500000118743628,
            7.905694656074047e-05,
        ];
        // LONGROPE: attention factor 1.0408329997330663
        pub const LONGROPE: &[f64] = &[
            1.0,
            0.21081849932670593,
            0.05000000074505806,
            0.012649111449718475,
            0.0033333334140479565,
            0.0009035079274326563,
            0.0002500000118743628,
            7.027283572824672e-05,
        ];
    }

    fn rope(x: &[f32], inv: &[f32], b: usize, t: usize, h: usize, d: usize) -> Vec<f32> {
        let mut out = vec![f32::NAN; x.len()];
        rope_forward(&mut out, x, inv, b, t, h, d);
        out
    }

    #[test]
    fn forward_matches_rotate_half_reference() {
        let (b, t, h, d) = (2, 7, 3, 8);
        let inv = rope_inv_freq(d, 10000.0, &RopeScaling::None);
        let x = Rng::new(50).vec(b * t * h * d);
        let got = rope(&x, &inv, b, t, h, d);
        let mut want = vec![0.0f64; x.len()];
        for bi in 0..b {
            for ti in 0..t {
                for hi in 0..h {
                    let base = ((bi * t + ti) * h + hi) * d;
                    for i in 0..d {
                        let j = i % (d / 2);
                        let angle = ti as f64 * inv[j] as f64;
                        let rot = if i < d / 2 {
                            -x[base + i + d / 2]
                        } else {
                            x[base + i - d / 2]
                        };
                        want[base + i] =
                            x[base + i] as f64 * angle.cos() + rot as f64 * angle.sin();
                    }
                }
            }
        }
        assert_close("rope", &got, &want, 2e-6);
        // Position 0 is the identity.
        assert_eq!(&got[..h * d], &x[..h * d]);
    }

    #[test]
    fn backward_is_the_gradient() {
        let (b, t, h, d) = (2, 5, 2, 6);
        let inv = rope_inv_freq(d, 10000.0, &RopeScaling::Linear { factor: 2.0 });
        let mut rng = Rng::new(51);
        let (x, cot) = (rng.vec(b * t * h * d), rng.vec(b * t * h * d));
        let mut dx = vec![f32::NAN; x.len()];
        rope_backward(&mut dx, &cot, &inv, b, t, h, d);
        check_grad("rope dx", &x, &dx, |x| rope(x, &inv, b, t, h, d), &cot);
    }

    #[test]
    fn partial_rope_rotates_the_rotary_part_of_the_rotated_heads_and_copies_the_rest() {
        // Two rotated heads of three (q, k of a packed qkv; v copied), 4 of 6 elements
        // rotated, cos and sin scaled by 1.25: the rotated part equals a whole-head RoPE of
        // the same 4-wide heads scaled by 1.25, everything else is x.
        let (b, t, heads, d, r, rot) = (2, 5, 3, 6, 4, 2);
        let scaling = RopeScaling::LongRope {
            factors: vec![1.5, 3.0],
            attention_factor: 1.25,
        };
        let inv = rope_inv_freq(r, 10000.0, &scaling);
        // Divided by each pair's factor.
        let plain = rope_inv_freq(r, 10000.0, &RopeScaling::None);
        assert_eq!(
            inv,
            [
                1.0 / (1.5 * (1.0 / plain[0])),
                1.0 / (3.0 * (1.0 / plain[1]))
            ]
        );
        let dims = RopeDims {
            batch: b,
            seq: t,
            heads,
            head_dim: d,
            rotary_dim: r,
            rotated_heads: rot,
        };
        let x = Rng::new(52).vec(b * t * heads * d);
        let mut got = vec![f32::NAN; x.len()];
        partial_rope_forward(&mut got, &x, &inv, 1.25, dims);
        let rotary: Vec<f32> = x
            .chunks(d)
            .enumerate()
            .filter(|(i, _)| i % heads < rot)
            .flat_map(|(_, h)| h[..r].to_vec())
            .collect();
        let want = rope(&rotary, &inv, b, t, rot, r);
        let mut k = 0;
        for (i, (head_got, head_x)) in got.chunks(d).zip(x.chunks(d)).enumerate() {
            if i % heads < rot {
                for j in 0..r {
                    let w = want[k * r + j] * 1.25;
                    assert!(
                        (head_got[j] - w).abs() <= 1e-5 * w.abs().max(1.0),
                        "{i} {j}"
                    );
                }
                assert_eq!(&head_got[r..], &head_x[r..]);
                k += 1;
            } else {
                assert_eq!(head_got, head_x);
            }
        }
        let cot = Rng::new(53).vec(x.len());
        let mut dx = vec![f32::NAN; x.len()];
        partial_rope_backward(&mut dx, &cot, &inv, 1.25, dims);
        let f = |x: &[f32]| {
            let mut out = vec![0.0; x.len()];
            partial_rope_forward(&mut out, x, &inv, 1.25, dims);
            out
        };
        check_grad("partial rope dx", &x, &dx, f, &cot);
    }
}
