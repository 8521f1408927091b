//! Mixture-of-experts kinds: type rules, operand counts and FLOPs of routing, dispatch, the
//! grouped matmul and the combine, and of their backward kinds.
//!
//! The schedule is static while routing is data-dependent: a layer dispatches its `N = B*T`
//! tokens into one packed buffer of `N*k` rows (each token once per chosen expert) grouped by
//! expert, so every buffer has a fixed size and only the group boundaries (`offsets`, computed
//! by [`OpKind::MoeRoute`] at run time) change from step to step. No token is dropped. The cost
//! model prices a grouped matmul by that static bound, `N*k` rows, which is exactly the
//! number of rows computed whatever the routing (the per-expert split varies, the total does
//! not).

use super::*;

/// The most experts a layer may have (DeepSeek-V3's 256): a grouped matmul's backward writes one
/// weight gradient per expert, and the runtimes size their output tables by it.
pub const MAX_EXPERTS: u64 = 256;

/// Labels of a route's outputs, in order.
pub(super) const ROUTE_LABELS: &[&str] = &["weights", "experts", "rows", "slots", "offsets"];

impl OpKind {
    /// Whether this is a mixture-of-experts kind (forward or backward).
    pub fn is_moe(&self) -> bool {
        matches!(
            self,
            OpKind::MoeRoute { .. }
                | OpKind::MoeDispatch { .. }
                | OpKind::GroupedLinear { .. }
                | OpKind::MoeCombine { .. }
                | OpKind::MoeRouteBackward { .. }
                | OpKind::MoeDispatchBackward { .. }
                | OpKind::GroupedLinearBackward { .. }
                | OpKind::MoeCombineBackward { .. }
                | OpKind::MoeAuxLoss { .. }
                | OpKind::MoeAuxLossBackward { .. }
        )
    }

    /// Output types of a mixture-of-experts kind, or why the inputs do not fit.
    pub(super) fn infer_moe(&self, inputs: &[&TensorType]) -> Result<Vec<TensorType>> {
        let fail = |why: String| IrError::TypeMismatch {
            op: self.mnemonic(),
            why,
        };
        let float = |t: &TensorType, what: &str| -> Result<()> {
            if t.dtype.is_float() {
                Ok(())
            } else {
                Err(fail(format!("{what} must be floating point, got {t}")))
            }
        };
        let i32_of = |t: &TensorType, shape: &[u64], what: &str| -> Result<()> {
            if t.dtype == DType::I32 && t.shape == shape {
                Ok(())
            } else {
                Err(fail(format!(
                    "{what} must be {}, got {t}",
                    TensorType::new(shape.to_vec(), DType::I32)
                )))
            }
        };
        let f32_of = |t: &TensorType, shape: &[u64], what: &str| -> Result<()> {
            if t.dtype == DType::F32 && t.shape == shape {
                Ok(())
            } else {
                Err(fail(format!(
                    "{what} must be {}, got {t}",
                    TensorType::new(shape.to_vec(), DType::F32)
                )))
            }
        };
        // `[B,T,C]` activations: the batch and sequence dimensions.
        let tokens_of = |t: &TensorType, what: &str| -> Result<(u64, u64)> {
            float(t, what)?;
            match t.shape[..] {
                [b, s, _] => Ok((b, s)),
                _ => Err(fail(format!("{what} must be [B,T,C], got {t}"))),
            }
        };
        // A packed `[rows, C]` buffer.
        let packed = |t: &TensorType, what: &str| -> Result<u64> {
            float(t, what)?;
            match t.shape[..] {
                [rows, _] => Ok(rows),
                _ => Err(fail(format!(
                    "{what} must be a packed [rows,C] buffer, got {t}"
                ))),
            }
        };
        let check_experts = |experts: u64, top_k: Option<u64>| -> Result<()> {
            if !(1..=MAX_EXPERTS).contains(&experts) {
                return Err(fail(format!(
                    "{experts} experts is outside 1..={MAX_EXPERTS}"
                )));
            }
            if let Some(k) = top_k.filter(|k| !(1..=experts).contains(k)) {
                return Err(fail(format!(
                    "top_k {k} must be in 1..={experts} (the experts)"
                )));
            }
            Ok(())
        };
        let check_k = |k: u64| -> Result<()> {
            if (1..=MAX_EXPERTS).contains(&k) {
                Ok(())
            } else {
                Err(fail(format!("top_k {k} is outside 1..={MAX_EXPERTS}")))
            }
        };
        Ok(match self {
            OpKind::MoeRoute { experts, top_k, .. }
            | OpKind::MoeRouteBackward { experts, top_k, .. } => {
                check_experts(*experts, Some(*top_k))?;
                let logits = inputs[0];
                let (b, s) = tokens_of(logits, "router logits")?;
                if logits.last_dim() != *experts {
                    return Err(fail(format!(
                        "router logits {logits} should have {experts} experts in the last dimension"
                    )));
                }
                let k = *top_k;
                if let OpKind::MoeRouteBackward { .. } = self {
                    i32_of(inputs[1], &[b, s, k], "chosen experts")?;
                    f32_of(inputs[2], &[b, s, k], "weight gradient")?;
                    return Ok(vec![logits.clone()]);
                }
                vec![
                    TensorType::new([b, s, k], DType::F32),
                    TensorType::new([b, s, k], DType::I32),
                    TensorType::new([b * s * k], DType::I32),
                    TensorType::new([b, s, k], DType::I32),
                    TensorType::new([experts + 1], DType::I32),
                ]
            }
            OpKind::MoeDispatch { top_k } => {
                check_k(*top_k)?;
                let x = inputs[0];
                let (b, s) = tokens_of(x, "input")?;
                let k = *top_k;
                i32_of(inputs[1], &[b * s * k], "rows")?;
                i32_of(inputs[2], &[b, s, k], "slots")?;
                vec![TensorType::new([b * s * k, x.last_dim()], x.dtype)]
            }
            OpKind::MoeDispatchBackward { top_k } => {
                check_k(*top_k)?;
                let slots = inputs[0];
                let rows = packed(inputs[1], "packed gradient")?;
                let (b, s) = match slots.shape[..] {
                    [b, s, k] if k == *top_k && slots.dtype == DType::I32 => (b, s),
                    _ => return Err(fail(format!("slots must be i32[B,T,{top_k}], got {slots}"))),
                };
                if rows != b * s * top_k {
                    return Err(fail(format!(
                        "the packed gradient {} should have {} rows",
                        inputs[1],
                        b * s * top_k
                    )));
                }
                vec![TensorType::new(
                    [b, s, inputs[1].last_dim()],
                    inputs[1].dtype,
                )]
            }
            OpKind::GroupedLinear { experts } | OpKind::GroupedLinearBackward { experts } => {
                check_experts(*experts, None)?;
                let e = *experts as usize;
                let xs = inputs[0];
                let rows = packed(xs, "input")?;
                i32_of(inputs[1], &[experts + 1], "offsets")?;
                let weights = &inputs[2..2 + e];
                let w0 = weights[0];
                if w0.shape.len() != 2 || w0.shape[1] != xs.last_dim() {
                    return Err(fail(format!(
                        "expert weight {w0} should be [out,{}]",
                        xs.last_dim()
                    )));
                }
                if let Some(w) = weights.iter().find(|w| **w != w0) {
                    return Err(fail(format!(
                        "every expert's weight must have one type: {w0} and {w}"
                    )));
                }
                float(w0, "expert weight")?;
                let ys = TensorType::new([rows, w0.shape[0]], xs.dtype);
                if let OpKind::GroupedLinearBackward { .. } = self {
                    let dys = inputs[2 + e];
                    if dys.shape != ys.shape {
                        return Err(fail(format!("output gradient {dys} does not match {ys}")));
                    }
                    let mut out = vec![xs.clone()];
                    out.extend(weights.iter().map(|w| (*w).clone()));
                    return Ok(out);
                }
                vec![ys]
            }
            OpKind::MoeCombine { top_k } | OpKind::MoeCombineBackward { top_k } => {
                check_k(*top_k)?;
                let ys = inputs[0];
                let rows = packed(ys, "expert outputs")?;
                let (b, s) = match inputs[1].shape[..] {
                    [b, s, _] => (b, s),
                    _ => {
                        return Err(fail(format!(
                            "weights must be f32[B,T,{top_k}], got {}",
                            inputs[1]
                        )))
                    }
                };
                let k = *top_k;
                f32_of(inputs[1], &[b, s, k], "weights")?;
                i32_of(inputs[2], &[b, s, k], "slots")?;
                if rows != b * s * k {
                    return Err(fail(format!(
                        "expert outputs {ys} should have {} rows",
                        b * s * k
                    )));
                }
                let out = TensorType::new([b, s, ys.last_dim()], ys.dtype);
                if let OpKind::MoeCombineBackward { .. } = self {
                    if inputs[3].shape != out.shape {
                        return Err(fail(format!(
                            "output gradient {} does not match {out}",
                            inputs[3]
                        )));
                    }
                    return Ok(vec![ys.clone(), inputs[1].clone()]);
                }
                vec![out]
            }
            OpKind::MoeAuxLoss {
                experts,
                top_k,
                layers,
                coef,
            }
            | OpKind::MoeAuxLossBackward {
                experts,
                top_k,
                layers,
                coef,
                ..
            } => {
                check_experts(*experts, Some(*top_k))?;
                if !coef.is_finite() {
                    return Err(fail(format!("coef {coef} must be finite")));
                }
                if !(1..=MAX_EXPERTS).contains(layers) {
                    return Err(fail(format!(
                        "{layers} sparse layers is outside 1..={MAX_EXPERTS} (its backward \
                         writes one gradient per layer)"
                    )));
                }
                let forward = matches!(self, OpKind::MoeAuxLoss { .. });
                let logits = if forward {
                    f32_of(inputs[0], &[], "the cross-entropy loss")?;
                    &inputs[1..]
                } else {
                    inputs
                };
                let first = logits[0];
                tokens_of(first, "router logits")?;
                if first.last_dim() != *experts {
                    return Err(fail(format!(
                        "router logits {first} should have {experts} experts in the last dimension"
                    )));
                }
                if let Some(other) = logits.iter().find(|t| **t != first) {
                    return Err(fail(format!(
                        "every layer's router logits must have one type: {first} and {other}"
                    )));
                }
                if forward {
                    vec![TensorType::new([], DType::F32)]
                } else {
                    logits.iter().map(|t| (*t).clone()).collect()
                }
            }
            _ => unreachable!("infer_moe is only called for mixture-of-experts kinds"),
        })
    }

    /// Inputs of a mixture-of-experts kind.
    pub(super) fn moe_arity(&self) -> usize {
        match self {
            OpKind::MoeRoute { .. } => 1,
            OpKind::MoeDispatch { .. } => 3,
            OpKind::GroupedLinear { experts } => 2 + *experts as usize,
            OpKind::MoeCombine { .. } => 3,
            OpKind::MoeRouteBackward { .. } => 3,
            OpKind::MoeDispatchBackward { .. } => 2,
            OpKind::GroupedLinearBackward { experts } => 3 + *experts as usize,
            OpKind::MoeCombineBackward { .. } => 4,
            OpKind::MoeAuxLoss { layers, .. } => 1 + *layers as usize,
            OpKind::MoeAuxLossBackward { layers, .. } => *layers as usize,
            _ => unreachable!("moe_arity is only called for mixture-of-experts kinds"),
        }
    }

    /// FLOPs of a mixture-of-experts kind. A grouped matmul is priced by its static bound,
    /// every one of the `B*T*k` packed rows, spread evenly over the experts: the total is
    /// exact whatever the routing, the split is an estimate.
    pub(super) fn moe_flops(&self, inputs: &[&TensorType], outputs: &[&TensorType]) -> u64 {
        let out: u64 = outputs.iter().map(|t| t.numel()).sum();
        match self {
            // Softmax, top-k selection and the counting sort of the rows.
            OpKind::MoeRoute { top_k, .. } => (5 + top_k) * inputs[0].numel(),
            OpKind::MoeRouteBackward { .. } => 8 * inputs[0].numel(),
            OpKind::MoeDispatch { .. } | OpKind::MoeDispatchBackward { .. } => out,
            OpKind::GroupedLinear { .. } => 2 * inputs[0].numel() * outputs[0].last_dim(),
            OpKind::GroupedLinearBackward { .. } => {
                4 * inputs[0].numel() * inputs[inputs.len() - 1].last_dim()
            }
            OpKind::MoeCombine { .. } => 2 * inputs[0].numel(),
            OpKind::MoeCombineBackward { .. } => 4 * inputs[0].numel(),
            // Per logit: the softmax, the top-k scan and the sums; the backward's softmax
            // and its vector-Jacobian product.
            OpKind::MoeAuxLoss { top_k, .. } => {
                (6 + top_k) * inputs[1..].iter().map(|t| t.numel()).sum::<u64>()
            }
            OpKind::MoeAuxLossBackward { .. } => 8 * out,
            _ => unreachable!("moe_flops is only called for mixture-of-experts kinds"),
        }
    }

    /// Printed attributes of a mixture-of-experts forward kind.
    pub(super) fn moe_attributes(&self) -> Vec<(&'static str, String)> {
        match self {
            OpKind::MoeRoute {
                experts,
                top_k,
                normalize,
            } => {
                let mut attrs = vec![
                    ("experts", experts.to_string()),
                    ("top_k", top_k.to_string()),
                ];
                if *normalize {
                    attrs.push(("normalize", "true".into()));
                }
                attrs
            }
            OpKind::MoeDispatch { top_k } | OpKind::MoeCombine { top_k } => {
                vec![("top_k", top_k.to_string())]
            }
            OpKind::GroupedLinear { experts } => vec![("experts", experts.to_string())],
            OpKind::MoeAuxLoss {
                experts,
                top_k,
                layers,
                coef,
            } => vec![
                ("experts", experts.to_string()),
                ("top_k", top_k.to_string()),
                ("layers", layers.to_string()),
                ("coef", format!("{coef}")),
            ],
            _ => vec![],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(shape: &[u64], dtype: DType) -> TensorType {
        TensorType::new(shape.to_vec(), dtype)
    }

    #[test]
    fn routing_gives_the_packed_layout_and_its_types() {
        let route = OpKind::MoeRoute {
            experts: 4,
            top_k: 2,
            normalize: true,
        };
        let out = route.infer(&[&t(&[2, 3, 4], DType::BF16)]).unwrap();
        assert_eq!(
            out,
            [
                t(&[2, 3, 2], DType::F32),
                t(&[2, 3, 2], DType::I32),
                t(&[12], DType::I32),
                t(&[2, 3, 2], DType::I32),
                t(&[5], DType::I32),
            ]
        );
        assert_eq!(route.output_labels().len(), out.len());
        assert_eq!(
            route.attributes(),
            [
                ("experts", "4".to_string()),
                ("top_k", "2".into()),
                ("normalize", "true".into())
            ]
        );
        let wrong = route.infer(&[&t(&[2, 3, 5], DType::F32)]).unwrap_err();
        assert!(wrong.to_string().contains("4 experts"), "{wrong}");
        let too_many = OpKind::MoeRoute {
            experts: 4,
            top_k: 5,
            normalize: false,
        };
        let err = too_many.infer(&[&t(&[2, 3, 4], DType::F32)]).unwrap_err();
        assert!(err.to_string().contains("top_k 5"), "{err}");
    }

    #[test]
    fn dispatch_grouped_matmul_and_combine_keep_the_static_row_count() {
        let (x, rows, slots, offsets) = (
            t(&[2, 3, 8], DType::F32),
            t(&[12], DType::I32),
            t(&[2, 3, 2], DType::I32),
            t(&[5], DType::I32),
        );
        let dispatch = OpKind::MoeDispatch { top_k: 2 };
        let xs = dispatch.infer(&[&x, &rows, &slots]).unwrap().remove(0);
        assert_eq!(xs, t(&[12, 8], DType::F32));
        let w = t(&[6, 8], DType::F32);
        let grouped = OpKind::GroupedLinear { experts: 4 };
        let ys = grouped
            .infer(&[&xs, &offsets, &w, &w, &w, &w])
            .unwrap()
            .remove(0);
        assert_eq!(ys, t(&[12, 6], DType::F32));
        // Priced by every packed row: 2 * rows * in * out.
        assert_eq!(
            grouped.flops(&[&xs, &offsets, &w, &w, &w, &w], &[&ys]),
            2 * 12 * 8 * 6
        );
        let other = t(&[6, 4], DType::F32);
        assert!(grouped.infer(&[&xs, &offsets, &w, &other, &w, &w]).is_err());
        assert!(
            grouped.infer(&[&xs, &offsets, &w, &w, &w]).is_err(),
            "one weight short"
        );
        let weights = t(&[2, 3, 2], DType::F32);
        let combine = OpKind::MoeCombine { top_k: 2 };
        let out = combine.infer(&[&ys, &weights, &slots]).unwrap().remove(0);
        assert_eq!(out, t(&[2, 3, 6], DType::F32));
        // The backward kinds give the gradients of the differentiated inputs.
        let back = OpKind::GroupedLinearBackward { experts: 4 };
        let grads = back.infer(&[&xs, &offsets, &w, &w, &w, &w, &ys]).unwrap();
        assert_eq!(grads.len(), 5);
        assert_eq!(back.forward_of(), Some(grouped));
        let back = OpKind::MoeCombineBackward { top_k: 2 };
        let grads = back.infer(&[&ys, &weights, &slots, &out]).unwrap();
        assert_eq!(grads, [ys.clone(), weights.clone()]);
        let back = OpKind::MoeDispatchBackward { top_k: 2 };
        assert_eq!(back.infer(&[&slots, &xs]).unwrap(), [x]);
        let back = OpKind::MoeRouteBackward {
            experts: 4,
            top_k: 2,
            normalize: true,
        };
        let logits = t(&[2, 3, 4], DType::F32);
        let chosen = t(&[2, 3, 2], DType::I32);
        assert_eq!(
            back.infer(&[&logits, &chosen, &weights]).unwrap(),
            std::slice::from_ref(&logits)
        );
        assert_eq!(back.mnemonic(), "moe_route_backward");
        assert_eq!(back.attributes()[1], ("top_k", "2".to_string()));
    }
}
