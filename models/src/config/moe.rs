//! The mixture-of-experts fields of `MixtralConfig` and `Qwen3MoeConfig`, and what they
//! become: [`MoeLayout`].

use super::{flag, Context, Dim, Flag, LlamaLayout, NonNegative};
use crate::error::Result;
use protrain_ir::op::MAX_EXPERTS;
use serde::{Deserialize, Serialize};

/// A LLaMA-like layout whose MLPs are (some of them) mixtures of experts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeArchitecture {
    /// Attention, norms and RoPE, as the dense family has them.
    pub layout: LlamaLayout,
    /// The experts and their router.
    pub moe: MoeLayout,
}

/// The sparse MLP blocks: a router linear (no bias), softmax in f32, top-k, SwiGLU experts and
/// the weighted combine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeLayout {
    /// Experts per sparse layer (`num_local_experts`, Qwen's `num_experts`).
    pub experts: u64,
    /// Experts each token is sent to (`num_experts_per_tok`).
    pub top_k: u64,
    /// Whether the chosen probabilities are divided by their sum (always for Mixtral; Qwen's
    /// `norm_topk_prob`).
    pub normalize: bool,
    /// Width of one expert's hidden layer (Mixtral's `intermediate_size`, Qwen's
    /// `moe_intermediate_size`).
    pub expert_intermediate_size: u64,
    /// Which layers are sparse, one flag per layer (Qwen's `decoder_sparse_step` and
    /// `mlp_only_layers`; every layer for Mixtral). The others have a dense SwiGLU MLP of
    /// `intermediate_size`.
    pub sparse_layers: Vec<bool>,
    /// The weight of the load-balancing loss (`router_aux_loss_coef`) when transformers adds
    /// it (`output_router_logits`); `None` when it does not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aux_loss_coef: Option<f64>,
}

impl MoeLayout {
    /// Whether layer `i` has experts.
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.sparse_layers.get(layer).copied().unwrap_or(false)
    }
}

/// The fields both configuration classes may carry; each is read by the family that has it.
#[derive(Deserialize, Default)]
pub(super) struct MoeJson {
    /// The experts of a sparse layer (both families).
    num_local_experts: Option<Dim>,
    /// The other name of `num_local_experts` (Qwen's Hub configs use it).
    num_experts: Option<Dim>,
    num_experts_per_tok: Option<Dim>,
    norm_topk_prob: Option<Flag>,
    moe_intermediate_size: Option<Dim>,
    decoder_sparse_step: Option<Dim>,
    mlp_only_layers: Option<Vec<Dim<{ u64::MAX }>>>,
    output_router_logits: Option<Flag>,
    router_aux_loss_coef: Option<NonNegative>,
    router_jitter_noise: Option<NonNegative>,
    /// Qwen2-MoE's shared expert, which Qwen3-MoE does not have.
    shared_expert_intermediate_size: Option<Dim<{ u64::MAX }>>,
}

impl MoeJson {
    /// The sparse blocks as `c.model_type`'s configuration class reads them, for `layers`
    /// layers whose dense MLPs are `intermediate` wide. Refuses by name what would change the
    /// model and is not built: Mixtral's router jitter, a shared expert. The load-balancing
    /// loss is built when `output_router_logits` is true, weighted by `router_aux_loss_coef`.
    pub(super) fn into_layout(
        self,
        c: &Context,
        layers: u64,
        intermediate: u64,
    ) -> Result<MoeLayout> {
        let mixtral = c.model_type == "mixtral";
        if mixtral
            && self
                .router_jitter_noise
                .as_ref()
                .is_some_and(|n| n.0 != 0.0)
        {
            return Err(c.unsupported("router_jitter_noise", "non-zero", "0.0"));
        }
        if let Some(d) = self.shared_expert_intermediate_size.filter(|d| d.0 > 0) {
            return Err(c.unsupported(
                "shared_expert_intermediate_size",
                &d.0.to_string(),
                "absent or 0 (Qwen3-MoE has no shared expert)",
            ));
        }
        // Both classes map `num_experts` onto `num_local_experts` (transformers 5 writes the
        // latter for Qwen3-MoE too); two different counts are ambiguous.
        let expert_field = "num_local_experts";
        let experts = match (self.num_local_experts, self.num_experts) {
            (Some(a), Some(b)) if a.0 != b.0 => {
                return Err(c.invalid(
                    expert_field,
                    &format!("the same count as num_experts ({}), or absent", b.0),
                    a.0,
                ))
            }
            (Some(d), _) | (None, Some(d)) => d.0,
            (None, None) if mixtral => 8,
            (None, None) => 128,
        };
        if !(1..=MAX_EXPERTS).contains(&experts) {
            return Err(c.invalid(
                expert_field,
                &format!("a number of experts in 1..={MAX_EXPERTS}"),
                experts,
            ));
        }
        let top_k = self
            .num_experts_per_tok
            .map_or(if mixtral { 2 } else { 8 }, |d| d.0);
        if top_k > experts {
            return Err(c.invalid(
                "num_experts_per_tok",
                &format!("at most {expert_field} ({experts})"),
                top_k,
            ));
        }
        let sparse_layers = match mixtral {
            true => vec![true; layers as usize],
            false => {
                let step = self.decoder_sparse_step.map_or(1, |d| d.0);
                let dense: Vec<u64> = self
                    .mlp_only_layers
                    .unwrap_or_default()
                    .into_iter()
                    .map(|d| d.0)
                    .collect();
                (0..layers)
                    .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
                    .collect()
            }
        };
        Ok(MoeLayout {
            experts,
            top_k,
            normalize: mixtral || flag(self.norm_topk_prob, false),
            expert_intermediate_size: match mixtral {
                true => intermediate,
                false => self.moe_intermediate_size.map_or(768, |d| d.0),
            },
            sparse_layers,
            // Both classes default the weight to 0.001.
            aux_loss_coef: flag(self.output_router_logits, false)
                .then(|| self.router_aux_loss_coef.map_or(0.001, |c| c.0)),
        })
    }
}
