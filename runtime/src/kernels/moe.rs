//! Mixture-of-experts kernels: top-k routing, dispatch of tokens into the packed buffer, the
//! grouped matmul over it, the weighted combine, and their backward passes.
//!
//! The packed buffer has `N*k` rows (`N` tokens, `k` experts each) grouped by expert, and by
//! token within a group; `rows[r]` is the slot `t*k + j` packed row `r` holds, `slots[t*k + j]`
//! the packed row of slot `j` of token `t`, and `offsets[e]..offsets[e+1]` expert `e`'s group.
//! Routing writes all three; the others only read them, so every kernel is a fixed-order loop
//! (sums over a token's slots run in slot order) and the results are the same bits run after
//! run.

use super::linear::{linear_backward, linear_forward, WeightLayout};
use rayon::prelude::*;

/// Softmax of one row of logits in f32, into `p`.
fn softmax_row(p: &mut [f32], logits: &[f32]) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for (p, &l) in p.iter_mut().zip(logits) {
        *p = (l - max).exp();
        sum += *p;
    }
    for p in p.iter_mut() {
        *p /= sum;
    }
}

/// The `k` largest of `p`, largest first; ties go to the lower index, as `torch.topk` gives
/// them on the CPU.
fn top_k(chosen: &mut [i32], p: &[f32]) {
    for j in 0..chosen.len() {
        let mut best: Option<usize> = None;
        for (e, &v) in p.iter().enumerate() {
            if chosen[..j].contains(&(e as i32)) {
                continue;
            }
            if best.is_none_or(|b| v > p[b]) {
                best = Some(e);
            }
        }
        chosen[j] = best.map_or(0, |b| b as i32);
    }
}

/// Top-k routing of `logits [N, E]` (as transformers' `TopKRouter`): the softmax in f32, the
/// `k` largest probabilities, divided by their sum when `normalize`, into `weights [N, k]`
/// and the chosen experts into `experts [N, k]`; then the packed layout (`rows [N*k]`,
/// `slots [N*k]`, `offsets [E+1]`) by a counting sort of the slots by expert.
#[allow(clippy::too_many_arguments)]
pub fn moe_route(
    weights: &mut [f32],
    experts: &mut [i32],
    rows: &mut [i32],
    slots: &mut [i32],
    offsets: &mut [i32],
    logits: &[f32],
    n_experts: usize,
    k: usize,
    normalize: bool,
) {
    let n = logits.len() / n_experts;
    assert_eq!(weights.len(), n * k, "moe_route: weights are not [N, k]");
    assert_eq!(experts.len(), n * k, "moe_route: experts are not [N, k]");
    assert_eq!(rows.len(), n * k, "moe_route: rows are not [N*k]");
    assert_eq!(slots.len(), n * k, "moe_route: slots are not [N*k]");
    assert_eq!(
        offsets.len(),
        n_experts + 1,
        "moe_route: offsets are not [E+1]"
    );
    weights
        .par_chunks_mut(k)
        .zip(experts.par_chunks_mut(k))
        .zip(logits.par_chunks(n_experts))
        .for_each_init(
            || vec![0.0f32; n_experts],
            |p, ((w, chosen), l)| {
                softmax_row(p, l);
                top_k(chosen, p);
                for (w, &e) in w.iter_mut().zip(chosen.iter()) {
                    *w = p[e as usize];
                }
                if normalize {
                    let sum: f32 = w.iter().sum();
                    for w in w.iter_mut() {
                        *w /= sum;
                    }
                }
            },
        );
    // Counting sort: group sizes, their starts, then each slot in token order takes the next
    // row of its expert's group (offsets[e] is the cursor, so it ends at the group's end).
    offsets.fill(0);
    for &e in experts.iter() {
        offsets[e as usize + 1] += 1;
    }
    for e in 1..=n_experts {
        offsets[e] += offsets[e - 1];
    }
    for (s, &e) in experts.iter().enumerate() {
        let r = offsets[e as usize] as usize;
        offsets[e as usize] += 1;
        rows[r] = s as i32;
        slots[s] = r as i32;
    }
    for e in (1..=n_experts).rev() {
        offsets[e] = offsets[e - 1];
    }
    offsets[0] = 0;
}

/// The gradient of [`moe_route`]'s weights with respect to its logits: through the
/// renormalisation (when `normalize`) and the softmax, for the experts `experts` chose; the
/// choice itself has no gradient. `dlogits [N, E]` is overwritten.
pub fn moe_route_backward(
    dlogits: &mut [f32],
    dweights: &[f32],
    logits: &[f32],
    experts: &[i32],
    n_experts: usize,
    k: usize,
    normalize: bool,
) {
    dlogits
        .par_chunks_mut(n_experts)
        .zip(logits.par_chunks(n_experts))
        .zip(dweights.par_chunks(k).zip(experts.par_chunks(k)))
        .for_each_init(
            || vec![0.0f32; n_experts],
            |p, ((dl, l), (dw, chosen))| {
                softmax_row(p, l);
                // dp for the chosen probabilities: w_j = p_j / S, so
                // dp_j = (dw_j - sum_i dw_i w_i) / S; without renormalising, dp_j = dw_j.
                dl.fill(0.0);
                if normalize {
                    let sum: f32 = chosen.iter().map(|&e| p[e as usize]).sum();
                    let dot: f32 = chosen
                        .iter()
                        .zip(dw)
                        .map(|(&e, &g)| g * (p[e as usize] / sum))
                        .sum();
                    for (&e, &g) in chosen.iter().zip(dw) {
                        dl[e as usize] = (g - dot) / sum;
                    }
                } else {
                    for (&e, &g) in chosen.iter().zip(dw) {
                        dl[e as usize] = g;
                    }
                }
                // Softmax: dl_i = p_i (dp_i - sum_j dp_j p_j).
                let dot: f32 = chosen.iter().map(|&e| dl[e as usize] * p[e as usize]).sum();
                for (d, &p) in dl.iter_mut().zip(p.iter()) {
                    *d = p * (*d - dot);
                }
            },
        );
}

/// Gathers `x [N, C]` into the packed `xs [N*k, C]`: row `r` is token `rows[r] / k`.
pub fn moe_dispatch(xs: &mut [f32], x: &[f32], rows: &[i32], c: usize, k: usize) {
    assert_eq!(xs.len(), rows.len() * c, "moe_dispatch: xs is not [N*k, C]");
    xs.par_chunks_mut(c).zip(rows).for_each(|(out, &s)| {
        let t = s as usize / k;
        out.copy_from_slice(&x[t * c..(t + 1) * c]);
    });
}

/// The gradient of [`moe_dispatch`]: each token's packed-row gradients, summed in slot order,
/// into `dx [N, C]` (overwritten).
pub fn moe_dispatch_backward(dx: &mut [f32], dxs: &[f32], slots: &[i32], c: usize, k: usize) {
    dx.par_chunks_mut(c)
        .zip(slots.par_chunks(k))
        .for_each(|(out, token_slots)| {
            for (j, &r) in token_slots.iter().enumerate() {
                let row = &dxs[r as usize * c..(r as usize + 1) * c];
                if j == 0 {
                    out.copy_from_slice(row);
                } else {
                    for (o, &g) in out.iter_mut().zip(row) {
                        *o += g;
                    }
                }
            }
        });
}

/// The group boundaries of `offsets` as row ranges.
fn groups(offsets: &[i32]) -> impl Iterator<Item = (usize, std::ops::Range<usize>)> + '_ {
    offsets
        .windows(2)
        .enumerate()
        .map(|(e, w)| (e, w[0] as usize..w[1] as usize))
}

/// The grouped matmul: rows `offsets[e]..offsets[e+1]` of `xs [R, in]` times expert `e`'s
/// weight `[out, in]` transposed, into `ys [R, out]`, each group as [`linear_forward`]
/// computes it.
pub fn grouped_linear_forward(
    ys: &mut [f32],
    xs: &[f32],
    offsets: &[i32],
    weights: &[&[f32]],
    d_in: usize,
    d_out: usize,
) {
    for (e, range) in groups(offsets) {
        if range.is_empty() {
            continue;
        }
        linear_forward(
            &mut ys[range.start * d_out..range.end * d_out],
            &xs[range.start * d_in..range.end * d_in],
            weights[e],
            None,
            WeightLayout::OutIn,
            range.len(),
            d_in,
            d_out,
        );
    }
}

/// The gradient of [`grouped_linear_forward`]: `dxs` and each expert's weight gradient
/// (overwritten; zero for an expert whose group is empty).
#[allow(clippy::too_many_arguments)]
pub fn grouped_linear_backward(
    dxs: &mut [f32],
    dweights: &mut [&mut [f32]],
    dys: &[f32],
    xs: &[f32],
    offsets: &[i32],
    weights: &[&[f32]],
    d_in: usize,
    d_out: usize,
) {
    for (e, range) in groups(offsets) {
        if range.is_empty() {
            dweights[e].fill(0.0);
            continue;
        }
        linear_backward(
            Some(&mut dxs[range.start * d_in..range.end * d_in]),
            dweights[e],
            None,
            &dys[range.start * d_out..range.end * d_out],
            &xs[range.start * d_in..range.end * d_in],
            weights[e],
            WeightLayout::OutIn,
            range.len(),
            d_in,
            d_out,
            false,
        );
    }
}

/// The weighted combine: token `t`'s output is `sum_j ys[slots[t*k+j]] * weights[t*k+j]`,
/// summed in slot order, into `out [N, C]`.
pub fn moe_combine(
    out: &mut [f32],
    ys: &[f32],
    weights: &[f32],
    slots: &[i32],
    c: usize,
    k: usize,
) {
    out.par_chunks_mut(c)
        .zip(slots.par_chunks(k).zip(weights.par_chunks(k)))
        .for_each(|(o, (token_slots, w))| {
            for (j, (&r, &w)) in token_slots.iter().zip(w).enumerate() {
                let row = &ys[r as usize * c..(r as usize + 1) * c];
                if j == 0 {
                    for (o, &y) in o.iter_mut().zip(row) {
                        *o = y * w;
                    }
                } else {
                    for (o, &y) in o.iter_mut().zip(row) {
                        *o += y * w;
                    }
                }
            }
        });
}

/// The gradient of [`moe_combine`]: `dys [N*k, C]` (each packed row's output gradient times
/// its weight) and `dweights [N, k]` (the dot product of the output gradient with the
/// expert's output), both overwritten.
#[allow(clippy::too_many_arguments)]
pub fn moe_combine_backward(
    dys: &mut [f32],
    dweights: &mut [f32],
    dout: &[f32],
    ys: &[f32],
    weights: &[f32],
    slots: &[i32],
    c: usize,
    k: usize,
) {
    // Each packed row is one slot's, so each is written once.
    for (s, &r) in slots.iter().enumerate() {
        let (t, w, r) = (s / k, weights[s], r as usize);
        for (d, &g) in dys[r * c..(r + 1) * c]
            .iter_mut()
            .zip(&dout[t * c..(t + 1) * c])
        {
            *d = g * w;
        }
    }
    dweights
        .par_iter_mut()
        .zip(slots.par_iter())
        .enumerate()
        .for_each(|(s, (dw, &r))| {
            let (t, r) = (s / k, r as usize);
            let (g, y) = (&dout[t * c..(t + 1) * c], &ys[r * c..(r + 1) * c]);
            *dw = g.iter().zip(y).map(|(&g, &y)| g * y).sum();
        });
}

/// Partial sums of [`aux_sums`]: row `g` of the rows of every layer, in layer then row order,
/// adds to partial `g % AUX_PARTIALS`, and the partials are added in index order. The CUDA
/// kernels (`moe_aux_*` in `cuda/kernels/moe.cu`) run one thread per partial, so both sum the
/// probabilities in this order and agree to the bit.
pub const AUX_PARTIALS: usize = 256;

/// The per-expert sums of transformers' `load_balancing_loss_func` over every layer's rows:
/// how many rows' top-k holds each expert (`counts`) and each expert's summed probability
/// (`probs`), in f64 ([`AUX_PARTIALS`] says in which order); and the rows counted.
fn aux_sums(logits: &[&[f32]], n_experts: usize, k: usize) -> (Vec<f64>, Vec<f64>, f64) {
    let mut counts = vec![0.0f64; n_experts];
    let mut partials = vec![0.0f64; AUX_PARTIALS * n_experts];
    let (mut p, mut chosen) = (vec![0.0f32; n_experts], vec![0i32; k]);
    let mut rows = 0usize;
    for layer in logits {
        for l in layer.chunks(n_experts) {
            softmax_row(&mut p, l);
            top_k(&mut chosen, &p);
            for &e in &chosen {
                counts[e as usize] += 1.0;
            }
            let part = rows % AUX_PARTIALS;
            let sums = &mut partials[part * n_experts..(part + 1) * n_experts];
            for (s, &v) in sums.iter_mut().zip(&p) {
                *s += f64::from(v);
            }
            rows += 1;
        }
    }
    let mut probs = vec![0.0f64; n_experts];
    for part in partials.chunks(n_experts) {
        for (s, &v) in probs.iter_mut().zip(part) {
            *s += v;
        }
    }
    (counts, probs, rows as f64)
}

/// `loss + coef * aux`, with `aux` transformers' `load_balancing_loss_func` of the router
/// `logits [N, E]` of each sparse layer: `E * sum_e (c_e / R) * (p_e / R)` over the `R` rows
/// of all layers, `c_e` the rows whose top-k (chosen as [`moe_route`] chooses) holds expert
/// `e` and `p_e` the sum of its softmax probability.
pub fn moe_aux_loss(loss: f32, logits: &[&[f32]], n_experts: usize, k: usize, coef: f64) -> f32 {
    let (counts, probs, rows) = aux_sums(logits, n_experts, k);
    let aux: f64 = counts
        .iter()
        .zip(&probs)
        .map(|(c, p)| (c / rows) * (p / rows))
        .sum::<f64>()
        * n_experts as f64;
    (f64::from(loss) + coef * aux) as f32
}

/// The gradient of [`moe_aux_loss`] with respect to each layer's logits, for a loss gradient
/// of `seed`: the counts are constants, so `d/dp_e = coef * E * c_e / R^2` for every row, taken
/// back through each row's softmax. Each `dlogits[l]` is overwritten.
pub fn moe_aux_loss_backward(
    dlogits: &mut [&mut [f32]],
    logits: &[&[f32]],
    n_experts: usize,
    k: usize,
    coef: f64,
    seed: f32,
) {
    let (counts, _, rows) = aux_sums(logits, n_experts, k);
    let scale = f64::from(seed) * coef * n_experts as f64 / (rows * rows);
    let g: Vec<f32> = counts.iter().map(|c| (c * scale) as f32).collect();
    for (dl, l) in dlogits.iter_mut().zip(logits) {
        dl.par_chunks_mut(n_experts)
            .zip(l.par_chunks(n_experts))
            .for_each_init(
                || vec![0.0f32; n_experts],
                |p, (dl, l)| {
                    softmax_row(p, l);
                    let dot: f32 = p.iter().zip(&g).map(|(p, g)| p * g).sum();
                    for ((d, &p), &g) in dl.iter_mut().zip(p.iter()).zip(&g) {
                        *d = p * (g - dot);
                    }
                },
            );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::{check_grad, check_grad_scalar, Rng};

    /// Tokens, experts, chosen per token, input and output widths of the checks.
    const N: usize = 6;
    const E: usize = 4;
    const K: usize = 2;
    const C: usize = 5;
    const I: usize = 3;

    struct Routed {
        weights: Vec<f32>,
        experts: Vec<i32>,
        rows: Vec<i32>,
        slots: Vec<i32>,
        offsets: Vec<i32>,
    }

    fn route(logits: &[f32], normalize: bool) -> Routed {
        let mut r = Routed {
            weights: vec![0.0; N * K],
            experts: vec![0; N * K],
            rows: vec![0; N * K],
            slots: vec![0; N * K],
            offsets: vec![0; E + 1],
        };
        moe_route(
            &mut r.weights,
            &mut r.experts,
            &mut r.rows,
            &mut r.slots,
            &mut r.offsets,
            logits,
            E,
            K,
            normalize,
        );
        r
    }

    #[test]
    fn routing_picks_the_largest_probabilities_and_packs_rows_by_expert() {
        // Token 0 prefers experts 2 then 0; token 1 experts 1 then 3; token 2 ties 3 and 0.
        let logits = [
            1.0, -1.0, 2.0, 0.0, //
            -2.0, 3.0, 0.0, 1.0, //
            0.5, -1.0, -1.0, 0.5,
        ];
        let mut r = Routed {
            weights: vec![0.0; 6],
            experts: vec![0; 6],
            rows: vec![0; 6],
            slots: vec![0; 6],
            offsets: vec![0; 5],
        };
        moe_route(
            &mut r.weights,
            &mut r.experts,
            &mut r.rows,
            &mut r.slots,
            &mut r.offsets,
            &logits,
            4,
            2,
            true,
        );
        assert_eq!(r.experts, [2, 0, 1, 3, 0, 3]);
        assert_eq!(r.offsets, [0, 2, 3, 4, 6]);
        // Expert 0: slots 1 (token 0) and 4 (token 2); expert 1: slot 2; 2: slot 0; 3: 3, 5.
        assert_eq!(r.rows, [1, 4, 2, 0, 3, 5]);
        assert_eq!(r.slots, [3, 0, 2, 4, 1, 5]);
        // Renormalised: p2 / (p2 + p0) = e^2 / (e^2 + e^1).
        let w = (2f64.exp() / (2f64.exp() + 1f64.exp())) as f32;
        assert!((r.weights[0] - w).abs() < 1e-6, "{:?}", r.weights);
        assert_eq!(r.weights[4], 0.5);
        // Without renormalising, the softmax probabilities themselves.
        let mut plain = vec![0.0; 6];
        moe_route(
            &mut plain,
            &mut r.experts,
            &mut r.rows,
            &mut r.slots,
            &mut r.offsets,
            &logits,
            4,
            2,
            false,
        );
        let total: f64 = [1.0f64, -1.0, 2.0, 0.0].iter().map(|l| l.exp()).sum();
        assert!((plain[0] as f64 - 2f64.exp() / total).abs() < 1e-6);
    }

    /// The whole layer on fixed routing: dispatch, grouped matmul, combine.
    fn layer(x: &[f32], w: &[Vec<f32>], r: &Routed, weights: &[f32]) -> Vec<f32> {
        let mut xs = vec![0.0; N * K * C];
        moe_dispatch(&mut xs, x, &r.rows, C, K);
        let mut ys = vec![0.0; N * K * I];
        let ws: Vec<&[f32]> = w.iter().map(Vec::as_slice).collect();
        grouped_linear_forward(&mut ys, &xs, &r.offsets, &ws, C, I);
        let mut out = vec![0.0; N * I];
        moe_combine(&mut out, &ys, weights, &r.slots, I, K);
        out
    }

    #[test]
    fn the_layer_matches_a_per_token_loop_and_its_gradients_match_finite_differences() {
        let mut rng = Rng::new(7);
        let x = rng.vec(N * C);
        let w: Vec<Vec<f32>> = (0..E).map(|_| rng.vec(I * C)).collect();
        let logits: Vec<f32> = rng.vec(N * E).iter().map(|v| 3.0 * v).collect();
        let cot = rng.vec(N * I);
        for normalize in [true, false] {
            let r = route(&logits, normalize);
            let out = layer(&x, &w, &r, &r.weights);
            // Reference: each token's chosen experts one by one.
            for t in 0..N {
                for o in 0..I {
                    let mut want = 0.0f64;
                    for j in 0..K {
                        let e = r.experts[t * K + j] as usize;
                        let dot: f64 = (0..C)
                            .map(|i| x[t * C + i] as f64 * w[e][o * C + i] as f64)
                            .sum();
                        want += dot * r.weights[t * K + j] as f64;
                    }
                    assert!((out[t * I + o] as f64 - want).abs() < 1e-5);
                }
            }
            // Backward through the whole layer.
            let mut dys = vec![0.0; N * K * I];
            let mut dweights = vec![0.0; N * K];
            let mut xs = vec![0.0; N * K * C];
            moe_dispatch(&mut xs, &x, &r.rows, C, K);
            let ws: Vec<&[f32]> = w.iter().map(Vec::as_slice).collect();
            let mut ys = vec![0.0; N * K * I];
            grouped_linear_forward(&mut ys, &xs, &r.offsets, &ws, C, I);
            moe_combine_backward(
                &mut dys,
                &mut dweights,
                &cot,
                &ys,
                &r.weights,
                &r.slots,
                I,
                K,
            );
            let mut dxs = vec![0.0; N * K * C];
            let mut dw: Vec<Vec<f32>> = vec![vec![0.0; I * C]; E];
            let mut dw_views: Vec<&mut [f32]> = dw.iter_mut().map(Vec::as_mut_slice).collect();
            grouped_linear_backward(&mut dxs, &mut dw_views, &dys, &xs, &r.offsets, &ws, C, I);
            let mut dx = vec![0.0; N * C];
            moe_dispatch_backward(&mut dx, &dxs, &r.slots, C, K);
            let mut dlogits = vec![0.0; N * E];
            moe_route_backward(
                &mut dlogits,
                &dweights,
                &logits,
                &r.experts,
                E,
                K,
                normalize,
            );

            check_grad("moe dx", &x, &dx, |x| layer(x, &w, &r, &r.weights), &cot);
            for e in 0..E {
                check_grad(
                    "moe dweight",
                    &w[e],
                    &dw[e],
                    |we| {
                        let mut w2 = w.clone();
                        w2[e] = we.to_vec();
                        layer(&x, &w2, &r, &r.weights)
                    },
                    &cot,
                );
            }
            // The logits: routing is recomputed, so the choice is held where no two
            // probabilities are within the step of each other.
            check_grad(
                "moe dlogits",
                &logits,
                &dlogits,
                |l| {
                    let r2 = route(l, normalize);
                    assert_eq!(r2.experts, r.experts, "the step changed the routing");
                    layer(&x, &w, &r2, &r2.weights)
                },
                &cot,
            );
        }
    }

    #[test]
    fn an_expert_no_token_chose_gets_a_zero_weight_gradient() {
        let mut rng = Rng::new(9);
        // Expert 3's logit is far below the others for every token.
        let logits: Vec<f32> = (0..N * E)
            .map(|i| if i % E == 3 { -50.0 } else { rng.uniform() })
            .collect();
        let r = route(&logits, true);
        assert_eq!(r.offsets[3], r.offsets[4]);
        let xs = rng.vec(N * K * C);
        let dys = rng.vec(N * K * I);
        let w: Vec<Vec<f32>> = (0..E).map(|_| rng.vec(I * C)).collect();
        let ws: Vec<&[f32]> = w.iter().map(Vec::as_slice).collect();
        let mut dw: Vec<Vec<f32>> = vec![vec![f32::NAN; I * C]; E];
        let mut views: Vec<&mut [f32]> = dw.iter_mut().map(Vec::as_mut_slice).collect();
        let mut dxs = vec![0.0; N * K * C];
        grouped_linear_backward(&mut dxs, &mut views, &dys, &xs, &r.offsets, &ws, C, I);
        assert!(dw[3].iter().all(|&g| g == 0.0));
        assert!(dw[..3].iter().flatten().all(|g| g.is_finite()));
    }

    #[test]
    fn the_load_balancing_loss_matches_its_formula_and_finite_differences() {
        let mut rng = Rng::new(11);
        // Two layers of N tokens; scaled so that no two probabilities of a row are close.
        let layers: Vec<Vec<f32>> = (0..2)
            .map(|_| rng.vec(N * E).iter().map(|v| 3.0 * v).collect())
            .collect();
        let views: Vec<&[f32]> = layers.iter().map(Vec::as_slice).collect();
        // Large, so that the gradient stands well above the finite-difference tolerance.
        let coef = 20.0;
        // The formula, spelled out: counts and probabilities of every row of both layers.
        let (mut c, mut p) = (vec![0.0f64; E], vec![0.0f64; E]);
        for layer in &layers {
            let r = route(layer, false);
            for &e in &r.experts {
                c[e as usize] += 1.0;
            }
            for row in layer.chunks(E) {
                let z: f64 = row.iter().map(|&v| f64::from(v).exp()).sum();
                for (e, &v) in row.iter().enumerate() {
                    p[e] += f64::from(v).exp() / z;
                }
            }
        }
        let rows = (2 * N) as f64;
        let aux: f64 = (0..E).map(|e| c[e] / rows * p[e] / rows).sum::<f64>() * E as f64;
        let got = moe_aux_loss(1.5, &views, E, K, coef);
        assert!((f64::from(got) - (1.5 + coef * aux)).abs() < 1e-6, "{got}");
        // Balanced routing gives k: every expert holds k/E of the rows and 1/E of the mass.
        assert!(aux > 0.0);

        let mut grads = vec![vec![f32::NAN; N * E]; 2];
        let mut grad_views: Vec<&mut [f32]> = grads.iter_mut().map(Vec::as_mut_slice).collect();
        moe_aux_loss_backward(&mut grad_views, &views, E, K, coef, 1.0);
        for l in 0..2 {
            check_grad_scalar("aux dlogits", &layers[l], &grads[l], |x| {
                let mut moved = layers.clone();
                moved[l] = x.to_vec();
                let v: Vec<&[f32]> = moved.iter().map(Vec::as_slice).collect();
                // The counts are constants: the step must not change the routing.
                assert_eq!(route(x, false).experts, route(&layers[l], false).experts);
                // In f64, so that the difference is not the f32 loss's rounding.
                let (c, p, rows) = aux_sums(&v, E, K);
                let dot: f64 = c.iter().zip(&p).map(|(c, p)| c * p).sum();
                coef * E as f64 * dot / (rows * rows)
            });
        }
        // The seed scales the gradient (1 / micro-batches, the loss scale).
        let mut half = vec![vec![0.0; N * E]; 2];
        let mut half_views: Vec<&mut [f32]> = half.iter_mut().map(Vec::as_mut_slice).collect();
        moe_aux_loss_backward(&mut half_views, &views, E, K, coef, 0.5);
        for (h, g) in half.iter().flatten().zip(grads.iter().flatten()) {
            assert!((h - 0.5 * g).abs() <= 1e-7 * g.abs().max(1e-3), "{h} {g}");
        }
    }
}
