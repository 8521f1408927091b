//! The type rules: each op kind's output types from its input types, or why they do not fit.

use super::*;

impl OpKind {
    /// The types of the op's outputs given its input types, or why they do not fit.
    pub fn infer(&self, inputs: &[&TensorType]) -> Result<Vec<TensorType>> {
        let fail = |why: String| IrError::TypeMismatch {
            op: self.mnemonic(),
            why,
        };
        match self.arity() {
            Some(n) if n != inputs.len() => {
                return Err(fail(format!("takes {n} inputs, got {}", inputs.len())));
            }
            None if inputs.is_empty() => return Err(fail("takes at least one input".into())),
            _ => {}
        }
        let f32_scalar = TensorType::new([], DType::F32);
        if self.is_moe() {
            return self.infer_moe(inputs);
        }
        if let Some(forward) = self.forward_of() {
            return self.infer_backward(&forward, inputs);
        }
        Ok(match self {
            OpKind::Attention { heads, .. } => {
                let out = self.infer_forward(inputs)?;
                let lse = TensorType::new([out.shape[0], *heads, out.shape[1]], DType::F32);
                vec![out, lse]
            }
            OpKind::CrossEntropy => {
                let loss = self.infer_forward(inputs)?;
                vec![loss, TensorType::new(inputs[1].shape.clone(), DType::F32)]
            }
            OpKind::FusedLinear {
                count,
                bias,
                layout,
                epilogue,
            } => {
                let n = *count as usize;
                let fits = match epilogue.projections() {
                    None => (2..=MAX_PROJECTIONS).contains(count),
                    Some(k) => *count == k,
                };
                if !fits {
                    return Err(fail(format!(
                        "epilogue {} does not take {count} projections",
                        epilogue.name()
                    )));
                }
                let linear = OpKind::Linear {
                    bias: *bias,
                    layout: *layout,
                };
                let mut projections = Vec::with_capacity(n);
                for i in 0..n {
                    let mut one = vec![inputs[0], inputs[1 + i]];
                    if *bias {
                        one.push(inputs[1 + n + i]);
                    }
                    projections.push(linear.infer_forward(&one)?);
                }
                let mut out = Vec::with_capacity(n + 1);
                match epilogue {
                    Epilogue::None => out.extend(projections),
                    Epilogue::Gelu | Epilogue::Relu => {
                        out.push(projections[0].clone());
                        out.extend(projections);
                    }
                    Epilogue::Swiglu => {
                        let y =
                            OpKind::Swiglu.infer_forward(&[&projections[0], &projections[1]])?;
                        out.extend(projections);
                        out.push(y);
                    }
                    Epilogue::Residual => {
                        let r = inputs[inputs.len() - 1];
                        if *r != projections[0] {
                            return Err(fail(format!(
                                "residual {r} does not match the projection {}",
                                projections[0]
                            )));
                        }
                        out.push(r.clone());
                    }
                }
                out
            }
            OpKind::GradNormSq => {
                if !inputs[0].dtype.is_float() {
                    return Err(fail(format!(
                        "a gradient must be floating point, got {}",
                        inputs[0]
                    )));
                }
                vec![f32_scalar]
            }
            OpKind::ClipCoef { .. } | OpKind::UnscaleCoef { .. } => {
                if let Some(t) = inputs.iter().find(|t| ***t != f32_scalar) {
                    return Err(fail(format!("takes squared norms f32[], got {t}")));
                }
                vec![f32_scalar]
            }
            OpKind::AdamW { clipped, .. } => {
                let param = inputs[0];
                for (what, t) in ["grad", "m", "v"].iter().zip(&inputs[1..4]) {
                    if t.shape != param.shape || !t.dtype.is_float() {
                        return Err(fail(format!(
                            "{what} {t} does not match the parameter {param}"
                        )));
                    }
                }
                if *clipped && *inputs[4] != f32_scalar {
                    return Err(fail(format!(
                        "clip coefficient must be f32[], got {}",
                        inputs[4]
                    )));
                }
                vec![]
            }
            OpKind::AccumulateGrad => {
                let (acc, grad) = (inputs[0], inputs[1]);
                if acc.shape != grad.shape || !acc.dtype.is_float() || !grad.dtype.is_float() {
                    return Err(fail(format!(
                        "the gradient {grad} does not match its accumulator {acc}"
                    )));
                }
                vec![]
            }
            OpKind::MoveStart(_) | OpKind::MoveDone(_) | OpKind::Release { .. } => {
                self.infer_movement(inputs)?
            }
            _ => vec![self.infer_forward(inputs)?],
        })
    }

    /// Output types of a backward kind: the gradients of the forward inputs that have one.
    fn infer_backward(&self, forward: &OpKind, inputs: &[&TensorType]) -> Result<Vec<TensorType>> {
        let fail = |why: String| IrError::TypeMismatch {
            op: self.mnemonic(),
            why,
        };
        let dy = inputs[inputs.len() - 1];
        let same = |a: &TensorType, b: &TensorType, what: &str| -> Result<()> {
            if a.shape == b.shape {
                Ok(())
            } else {
                Err(fail(format!("{what} {b} does not match {a}")))
            }
        };
        Ok(match self {
            OpKind::EmbeddingBackward { rows, .. }
            | OpKind::PositionEmbeddingBackward { rows, .. } => {
                let tokens = inputs[0];
                if tokens.dtype != DType::I32
                    || dy.shape.len() != 3
                    || dy.shape[..2] != tokens.shape[..]
                {
                    return Err(fail(format!("dy {dy} does not match tokens {tokens}")));
                }
                vec![TensorType::new([*rows, dy.last_dim()], dy.dtype)]
            }
            OpKind::LayerNormBackward { .. }
            | OpKind::RmsNormBackward { .. }
            | OpKind::LinearBackward { .. } => {
                let (x, w) = (inputs[0], inputs[1]);
                let mut fwd_inputs = vec![x, w];
                let bias;
                if let OpKind::LayerNorm { .. } = forward {
                    bias = w.clone();
                    fwd_inputs.push(&bias);
                }
                let bias_ty;
                if let OpKind::Linear { bias: true, layout } = forward {
                    let out = match layout {
                        WeightLayout::OutIn => w.shape.first().copied().unwrap_or(0),
                        WeightLayout::InOut => w.shape.get(1).copied().unwrap_or(0),
                    };
                    bias_ty = TensorType::new([out], w.dtype);
                    fwd_inputs.push(&bias_ty);
                }
                let y = forward.infer_forward(&fwd_inputs)?;
                same(&y, dy, "dy")?;
                fwd_inputs.iter().map(|t| (*t).clone()).collect()
            }
            OpKind::GeluBackward | OpKind::ReluBackward | OpKind::SiluBackward => {
                same(inputs[0], dy, "dy")?;
                vec![inputs[0].clone()]
            }
            OpKind::SoftcapBackward { .. } => {
                same(inputs[0], dy, "dy")?;
                vec![inputs[0].clone()]
            }
            OpKind::SwigluBackward | OpKind::GegluBackward => {
                let y = forward.infer_forward(&inputs[..2])?;
                same(&y, dy, "dy")?;
                vec![inputs[0].clone(), inputs[1].clone()]
            }
            OpKind::RopeBackward { .. } | OpKind::PartialRopeBackward { .. } => {
                vec![forward.infer_forward(&[dy])?]
            }
            OpKind::PackedSwigluBackward => {
                let y = forward.infer_forward(&inputs[..1])?;
                same(&y, dy, "dy")?;
                vec![inputs[0].clone()]
            }
            OpKind::AttentionBackward { qkv, .. } => {
                let n = match qkv {
                    QkvLayout::Separate => 3,
                    QkvLayout::Packed => 1,
                };
                let expected = forward.infer(&inputs[..n])?;
                same(&expected[0], inputs[n], "out")?;
                same(&expected[1], inputs[n + 1], "lse")?;
                same(&expected[0], dy, "dout")?;
                inputs[..n].iter().map(|t| (*t).clone()).collect()
            }
            OpKind::CrossEntropyBackward
            | OpKind::CrossEntropyBackwardScaled { .. }
            | OpKind::CrossEntropyBackwardLossScaled { .. } => {
                let expected = forward.infer(&inputs[..2])?;
                same(&expected[1], inputs[2], "lse")?;
                vec![inputs[0].clone()]
            }
            OpKind::FusedLinearBackward {
                count,
                bias,
                layout,
                epilogue,
            } => {
                let n = *count as usize;
                let (x, weights) = (inputs[0], &inputs[1..1 + n]);
                let plain = OpKind::Linear {
                    bias: false,
                    layout: *layout,
                };
                let mut projections = Vec::with_capacity(n);
                for w in weights {
                    projections.push(plain.infer_forward(&[x, w])?);
                }
                let biases: Vec<TensorType> = projections
                    .iter()
                    .zip(weights)
                    .map(|(h, w)| TensorType::new([h.last_dim()], w.dtype))
                    .collect();
                let mut fwd_inputs: Vec<&TensorType> = vec![x];
                fwd_inputs.extend(weights.iter().copied());
                if *bias {
                    fwd_inputs.extend(biases.iter());
                }
                if *epilogue == Epilogue::Residual {
                    fwd_inputs.push(&projections[0]);
                }
                let outs = forward.infer(&fwd_inputs)?;
                let rest = &inputs[1 + n..];
                let (kept, grads) = if epilogue.has_output() && epilogue.keeps_projections() {
                    rest.split_at(n)
                } else {
                    rest.split_at(0)
                };
                for (h, want) in kept.iter().zip(&outs) {
                    same(want, h, "kept projection")?;
                }
                let wanted: Vec<&TensorType> = if epilogue.has_output() {
                    outs.last().into_iter().collect()
                } else {
                    outs.iter().collect()
                };
                for (g, want) in grads.iter().zip(wanted) {
                    same(want, g, "output gradient")?;
                }
                let mut out = vec![x.clone()];
                out.extend(weights.iter().map(|w| (*w).clone()));
                if *bias {
                    out.extend(biases);
                }
                out
            }
            _ => unreachable!("infer_backward is only called for backward kinds"),
        })
    }

    /// The type of a forward kind's main output given its input types.
    fn infer_forward(&self, inputs: &[&TensorType]) -> Result<TensorType> {
        let fail = |why: String| IrError::TypeMismatch {
            op: self.mnemonic(),
            why,
        };
        if Some(inputs.len()) != self.arity() {
            return Err(fail(format!(
                "takes {:?} inputs, got {}",
                self.arity(),
                inputs.len()
            )));
        }
        let float = |t: &TensorType, what: &str| -> Result<()> {
            if t.dtype.is_float() {
                Ok(())
            } else {
                Err(fail(format!("{what} must be floating point, got {t}")))
            }
        };
        let tokens = |t: &TensorType| -> Result<()> {
            if t.dtype == DType::I32 && t.shape.len() == 2 {
                Ok(())
            } else {
                Err(fail(format!("token ids must be i32[B,T], got {t}")))
            }
        };
        let vector = |t: &TensorType, len: u64, what: &str| -> Result<()> {
            if t.shape == [len] {
                Ok(())
            } else {
                Err(fail(format!("{what} must be [{len}], got {t}")))
            }
        };
        match self {
            OpKind::Embedding { .. } | OpKind::PositionEmbedding { .. } => {
                tokens(inputs[0])?;
                let table = inputs[1];
                float(table, "table")?;
                if table.shape.len() != 2 {
                    return Err(fail(format!("table must be [rows,C], got {table}")));
                }
                if let OpKind::PositionEmbedding { offset } = self {
                    let needed = offset + inputs[0].shape[1];
                    if table.shape[0] < needed {
                        return Err(fail(format!(
                            "sequence needs {needed} position rows, the table has {}",
                            table.shape[0]
                        )));
                    }
                }
                let mut shape = inputs[0].shape.clone();
                shape.push(table.shape[1]);
                Ok(TensorType::new(shape, table.dtype))
            }
            OpKind::LayerNorm { .. } => {
                let x = inputs[0];
                float(x, "input")?;
                for p in &inputs[1..] {
                    vector(p, x.last_dim(), "weight and bias")?;
                }
                Ok(x.clone())
            }
            OpKind::RmsNorm { head_dim, .. } => {
                let x = inputs[0];
                float(x, "input")?;
                let width = match *head_dim {
                    None => x.last_dim(),
                    Some(d) if d > 0 && x.last_dim().is_multiple_of(d) => d,
                    Some(d) => {
                        return Err(fail(format!(
                            "the last dimension of {x} is not a whole number of groups of \
                             head_dim {d}"
                        )))
                    }
                };
                vector(inputs[1], width, "weight")?;
                Ok(x.clone())
            }
            OpKind::Linear { bias, layout } => {
                let (x, w) = (inputs[0], inputs[1]);
                float(x, "input")?;
                if w.shape.len() != 2 {
                    return Err(fail(format!("weight must be 2-D, got {w}")));
                }
                let (w_in, w_out) = match layout {
                    WeightLayout::OutIn => (w.shape[1], w.shape[0]),
                    WeightLayout::InOut => (w.shape[0], w.shape[1]),
                };
                if x.last_dim() != w_in {
                    return Err(fail(format!("input {x} does not match weight {w}")));
                }
                if *bias {
                    vector(inputs[2], w_out, "bias")?;
                }
                Ok(x.with_last_dim(w_out))
            }
            OpKind::Gelu
            | OpKind::Relu
            | OpKind::Silu
            | OpKind::Scale { .. }
            | OpKind::Softcap { .. } => {
                if let OpKind::Softcap { cap: v } | OpKind::Scale { factor: v } = self {
                    if !(v.is_finite() && (*v > 0.0 || matches!(self, OpKind::Scale { .. }))) {
                        return Err(fail(format!("{v} must be a finite number (a cap > 0)")));
                    }
                }
                float(inputs[0], "input")?;
                Ok(inputs[0].clone())
            }
            OpKind::Swiglu | OpKind::Geglu | OpKind::Add => {
                float(inputs[0], "input")?;
                if inputs[0] != inputs[1] {
                    return Err(fail(format!(
                        "inputs differ: {} and {}",
                        inputs[0], inputs[1]
                    )));
                }
                Ok(inputs[0].clone())
            }
            OpKind::Rope {
                head_dim, scaling, ..
            } => {
                let x = inputs[0];
                float(x, "input")?;
                if *head_dim == 0
                    || head_dim % 2 != 0
                    || !x.last_dim().is_multiple_of(*head_dim)
                    || x.shape.len() != 3
                {
                    return Err(fail(format!(
                        "{x} is not [B,T,heads*{head_dim}] with an even head_dim"
                    )));
                }
                check_rope_scaling(scaling, *head_dim).map_err(fail)?;
                Ok(x.clone())
            }
            OpKind::PartialRope {
                head_dim,
                rotary_dim,
                heads,
                scaling,
                ..
            } => {
                let x = inputs[0];
                float(x, "input")?;
                if *head_dim == 0 || !x.last_dim().is_multiple_of(*head_dim) || x.shape.len() != 3 {
                    return Err(fail(format!("{x} is not [B,T,heads*{head_dim}]")));
                }
                if *rotary_dim == 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim {
                    return Err(fail(format!(
                        "rotary_dim {rotary_dim} is not even and from 2 to head_dim {head_dim}"
                    )));
                }
                let total = x.last_dim() / head_dim;
                if *heads == 0 || *heads > total {
                    return Err(fail(format!(
                        "{heads} rotated heads, but {x} holds {total} heads of {head_dim}"
                    )));
                }
                check_rope_scaling(scaling, *rotary_dim).map_err(fail)?;
                Ok(x.clone())
            }
            OpKind::PackedSwiglu => {
                let x = inputs[0];
                float(x, "input")?;
                if x.shape.is_empty() || !x.last_dim().is_multiple_of(2) {
                    return Err(fail(format!(
                        "{x} does not end in an even width (gate then up)"
                    )));
                }
                let mut shape = x.shape.clone();
                if let Some(last) = shape.last_mut() {
                    *last /= 2;
                }
                Ok(TensorType::new(shape, x.dtype))
            }
            OpKind::Attention {
                heads,
                kv_heads,
                head_dim,
                qkv,
                scale,
                softcap,
                ..
            } => {
                for (what, v) in [("scale", scale), ("softcap", softcap)] {
                    if let Some(v) = v.filter(|v| !(v.is_finite() && *v > 0.0)) {
                        return Err(fail(format!("{what} {v} must be a finite number > 0")));
                    }
                }
                if *kv_heads == 0 || heads % kv_heads != 0 {
                    return Err(fail(format!(
                        "{heads} heads are not a multiple of {kv_heads} KV heads"
                    )));
                }
                let q_width = heads * head_dim;
                let kv_width = kv_heads * head_dim;
                let q = inputs[0];
                float(q, "q")?;
                if q.shape.len() != 3 {
                    return Err(fail(format!("q must be [B,T,C], got {q}")));
                }
                match qkv {
                    QkvLayout::Packed => {
                        if q.last_dim() != q_width + 2 * kv_width {
                            return Err(fail(format!(
                                "packed qkv {q} should have last dimension {}",
                                q_width + 2 * kv_width
                            )));
                        }
                    }
                    QkvLayout::Separate => {
                        if q.last_dim() != q_width {
                            return Err(fail(format!(
                                "q {q} should have last dimension {q_width}"
                            )));
                        }
                        let kv = q.with_last_dim(kv_width);
                        if inputs[1] != &kv || inputs[2] != &kv {
                            return Err(fail(format!(
                                "k {} and v {} should both be {kv}",
                                inputs[1], inputs[2]
                            )));
                        }
                    }
                }
                Ok(q.with_last_dim(q_width))
            }
            OpKind::CrossEntropy => {
                let (logits, targets) = (inputs[0], inputs[1]);
                float(logits, "logits")?;
                tokens(targets)?;
                if logits.shape.len() != 3 || logits.shape[..2] != targets.shape[..] {
                    return Err(fail(format!(
                        "logits {logits} do not match targets {targets}"
                    )));
                }
                Ok(TensorType::new([], DType::F32))
            }
            _ => Err(fail("is not a forward kind".into())),
        }
    }
}

/// Checks a RoPE scaling against the rotated width: finite positive factors, and one LongRoPE
/// factor per rotated pair.
fn check_rope_scaling(scaling: &crate::op::RopeScaling, rotary_dim: u64) -> Result<(), String> {
    if let crate::op::RopeScaling::LongRope {
        factors,
        attention_factor,
    } = scaling
    {
        if factors.len() as u64 != rotary_dim / 2 {
            return Err(format!(
                "longrope has {} factors, but the rotation has {} pairs",
                factors.len(),
                rotary_dim / 2
            ));
        }
        if let Some(bad) = factors
            .iter()
            .chain([attention_factor])
            .find(|f| !(f.is_finite() && **f > 0.0))
        {
            return Err(format!("longrope factor {bad} must be a finite number > 0"));
        }
    }
    Ok(())
}
