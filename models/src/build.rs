//! Lowering a [`ModelConfig`] to a forward [`Graph`]: the shared entry point and helpers; one
//! submodule per family.
//!
//! Every builder first declares the parameters, with their Hugging Face names and shapes, in the
//! order `model.named_parameters()` lists them (which is module-definition order, not execution
//! order), then emits the forward ops in execution order. It does not build the backward pass or
//! the optimizer: the compiler derives those.

mod gemma;
mod gpt2;
mod llama;
mod moe;
mod opt;
mod phi3;

use crate::config::{Activation, Architecture, ModelConfig, MAX_DIM, MAX_LAYERS};
use crate::error::{ModelError, Result};
use protrain_ir::{
    BlockId, BlockKind, DType, Graph, GraphInfo, OpKind, ParamId, Phase, Role, TensorType, ValueId,
    WeightLayout,
};

/// Batch geometry and element type of a built graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BuildOptions {
    /// Sequences per step.
    pub batch: u64,
    /// Tokens per sequence.
    pub seq: u64,
    /// Element type of parameters and activations (the loss is always `f32`).
    pub dtype: DType,
}

impl BuildOptions {
    /// `batch` sequences of `seq` tokens in bf16, the training precision of model states.
    pub fn new(batch: u64, seq: u64) -> Self {
        Self {
            batch,
            seq,
            dtype: DType::BF16,
        }
    }

    /// The same geometry in another element type.
    pub fn with_dtype(self, dtype: DType) -> Self {
        Self { dtype, ..self }
    }
}

/// Builds the forward graph of a model at `[batch, seq]`: inputs `tokens` and `targets`
/// (`i32[B,T]`), an embedding block, one block per layer, a head block that ends in the mean
/// cross-entropy loss, which is the graph's output.
///
/// Errors when the batch or sequence is empty, the element type is not floating point, the
/// sequence is longer than a learned-position table, or the sizes would overflow.
pub fn build_forward(config: &ModelConfig, options: &BuildOptions) -> Result<Graph> {
    check_options(config, options)?;
    let mut b = Builder::new(config, options);
    match &config.architecture {
        Architecture::Gpt2 => gpt2::build(&mut b, config)?,
        Architecture::Llama(layout)
        | Architecture::Mistral(layout)
        | Architecture::Qwen2(layout)
        | Architecture::Qwen3(layout)
        | Architecture::Olmo2(layout) => llama::build(&mut b, config, layout, None)?,
        Architecture::Mixtral(arch) | Architecture::Qwen3Moe(arch) => {
            llama::build(&mut b, config, &arch.layout, Some(&arch.moe))?
        }
        Architecture::Opt(layout) => opt::build(&mut b, config, layout)?,
        Architecture::Gemma2(layout) | Architecture::Gemma3(layout) => {
            gemma::build(&mut b, config, layout)?
        }
        Architecture::Phi3(layout) => phi3::build(&mut b, config, layout)?,
    }
    let mut graph = b.graph;
    crate::init::assign_inits(config, &mut graph);
    Ok(graph)
}

fn check_options(config: &ModelConfig, options: &BuildOptions) -> Result<()> {
    let invalid = |msg: String| Err(ModelError::InvalidOptions(msg));
    if options.batch == 0 {
        return invalid("batch size must be at least 1".into());
    }
    if options.seq == 0 {
        return invalid("sequence length must be at least 1".into());
    }
    if !options.dtype.is_float() {
        return invalid(format!(
            "element type {} is not floating point; use f32, bf16 or f16",
            options.dtype
        ));
    }
    // A config from the parser is in range already; one assembled by hand may not be.
    let mut dims = vec![
        ("vocab_size", config.vocab_size, MAX_DIM),
        ("hidden_size", config.hidden_size, MAX_DIM),
        ("num_layers", config.num_layers, MAX_LAYERS),
        ("num_heads", config.num_heads, MAX_DIM),
        ("num_kv_heads", config.num_kv_heads, config.num_heads),
        ("head_dim", config.head_dim, MAX_DIM),
        ("intermediate_size", config.intermediate_size, MAX_DIM),
        (
            "max_position_embeddings",
            config.max_position_embeddings,
            MAX_DIM,
        ),
    ];
    if let Architecture::Opt(layout) = &config.architecture {
        dims.push(("word_embed_proj_dim", layout.word_embed_proj_dim, MAX_DIM));
    }
    for (field, value, max) in dims {
        if !(1..=max).contains(&value) {
            return invalid(format!(
                "{}: {field} {value} is outside 1..={max}",
                config.name
            ));
        }
    }
    if let Some(max_positions) = config.learned_positions() {
        if options.seq > max_positions {
            return Err(ModelError::SequenceTooLong {
                model: config.name.clone(),
                seq: options.seq,
                max_positions,
            });
        }
    }
    // Every size the graph (and the cost model after it) derives must fit in a u64: the largest
    // activation's bytes, the largest matmul's and the attention's FLOPs, and all parameters'
    // bytes in every model state (each layer holds fewer than 16 matrices of at most
    // `widest^2` elements). Computed in checked u128.
    let mut widths = vec![
        config.vocab_size,
        config.hidden_size,
        config.intermediate_size,
        (config.num_heads + 2 * config.num_kv_heads) * config.head_dim,
    ];
    if let Some(positions) = config.learned_positions() {
        widths.push(positions + 2);
    }
    if let Architecture::Opt(layout) = &config.architecture {
        widths.push(layout.word_embed_proj_dim);
    }
    let widest = u128::from(widths.into_iter().max().unwrap_or(1));
    let (b, t) = (u128::from(options.batch), u128::from(options.seq));
    let attention_width = u128::from(config.num_heads * config.head_dim);
    let layers = u128::from(config.num_layers) + 2;
    let sizes = [
        product(&[b, t, widest, 8]),
        product(&[2, b, t, widest, widest]),
        product(&[4, b, attention_width, t, t + 1]),
        product(&[layers, 16, widest, widest, 16]),
    ];
    if sizes
        .iter()
        .any(|s| s.is_none_or(|s| s > u128::from(u64::MAX)))
    {
        return invalid(format!(
            "batch {} x sequence {} of {} is too large to describe: its sizes overflow 64 bits",
            options.batch, options.seq, config.name
        ));
    }
    Ok(())
}

/// The op kind of an MLP activation.
fn activation(activation: Activation) -> OpKind {
    match activation {
        Activation::GeluTanh => OpKind::Gelu,
        Activation::Relu => OpKind::Relu,
        Activation::Silu => OpKind::Silu,
    }
}

fn product(factors: &[u128]) -> Option<u128> {
    factors.iter().try_fold(1u128, |acc, &f| acc.checked_mul(f))
}

/// A graph under construction, with the element type and the current block.
pub(crate) struct Builder {
    graph: Graph,
    dtype: DType,
    block: Option<BlockId>,
    /// The load-balancing loss the head adds to the cross-entropy, when the model has one.
    aux_loss: Option<AuxLoss>,
}

/// The load-balancing loss of a mixture-of-experts model (`output_router_logits`): every
/// sparse layer's router logits, in layer order, and the loss's settings.
pub(crate) struct AuxLoss {
    /// The router logits `[B,T,E]` of each sparse layer emitted so far.
    logits: Vec<ValueId>,
    /// Experts per sparse layer.
    experts: u64,
    /// Experts each token is sent to.
    top_k: u64,
    /// `router_aux_loss_coef`.
    coef: f64,
}

/// A declared parameter: its id (for aliases) and the value that holds it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Weight {
    id: ParamId,
    value: ValueId,
}

/// A linear layer's parameters.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Linear {
    weight: Weight,
    bias: Option<Weight>,
    layout: WeightLayout,
}

/// A LayerNorm's (or RMSNorm's, with no bias) parameters.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Norm {
    weight: Weight,
    bias: Option<Weight>,
}

impl Builder {
    fn new(config: &ModelConfig, options: &BuildOptions) -> Self {
        Self {
            graph: Graph::new(GraphInfo {
                model: config.name.clone(),
                batch: options.batch,
                seq: options.seq,
            }),
            dtype: options.dtype,
            aux_loss: None,
            block: None,
        }
    }

    /// Adds `tokens` and `targets`, `i32[B,T]`.
    fn inputs(&mut self) -> (ValueId, ValueId) {
        let ty = TensorType::new([self.graph.info.batch, self.graph.info.seq], DType::I32);
        (
            self.graph.add_input("tokens", ty.clone()),
            self.graph.add_input("targets", ty),
        )
    }

    /// Adds the embedding block, one block per layer named `{prefix}.{i}`, and the head block.
    fn blocks(&mut self, embedding: &str, layer_prefix: &str, layers: u64, head: &str) -> Blocks {
        let embedding = self.graph.add_block(embedding, BlockKind::Embedding);
        let layers = (0..layers)
            .map(|i| {
                // MAX_LAYERS keeps the index inside u32.
                let index = u32::try_from(i).unwrap_or(u32::MAX);
                self.graph
                    .add_block(format!("{layer_prefix}.{i}"), BlockKind::Layer(index))
            })
            .collect();
        let head = self.graph.add_block(head, BlockKind::Head);
        Blocks {
            embedding,
            layers,
            head,
        }
    }

    /// Declares a parameter of the builder's element type.
    fn param(&mut self, name: String, shape: &[u64], block: BlockId) -> Weight {
        let id = self
            .graph
            .add_param(name, shape.to_vec(), self.dtype, block);
        Weight {
            id,
            value: self.graph.param(id).value,
        }
    }

    /// Records another name of a parameter.
    fn alias(&mut self, weight: Weight, alias: String) {
        self.graph.add_param_alias(weight.id, alias);
    }

    /// Declares `model.embed_tokens.weight` `[vocab, hidden]` in `blocks.embedding`, also named
    /// `lm_head.weight` when `config` ties the embeddings (the Hub's names of the decoder-only
    /// families that share LLaMA's layout).
    fn embed_tokens(&mut self, config: &ModelConfig, blocks: &Blocks) -> Weight {
        let shape = [config.vocab_size, config.hidden_size];
        let embed = self.param("model.embed_tokens.weight".into(), &shape, blocks.embedding);
        if config.tie_word_embeddings {
            self.alias(embed, "lm_head.weight".into());
        }
        embed
    }

    /// The LM head's weight: `embed` when `config` ties the embeddings, else a new
    /// `lm_head.weight` `[vocab, hidden]` in `blocks.head`.
    fn lm_head(&mut self, config: &ModelConfig, embed: Weight, blocks: &Blocks) -> Weight {
        match config.tie_word_embeddings {
            true => embed,
            false => {
                let shape = [config.vocab_size, config.hidden_size];
                self.param("lm_head.weight".into(), &shape, blocks.head)
            }
        }
    }

    /// Declares `{name}.weight` (and `{name}.bias`) of a linear layer from `input` to `output`
    /// features, in the layout the layer stores.
    fn linear_params(
        &mut self,
        name: &str,
        input: u64,
        output: u64,
        bias: bool,
        layout: WeightLayout,
        block: BlockId,
    ) -> Linear {
        let shape = match layout {
            WeightLayout::OutIn => [output, input],
            WeightLayout::InOut => [input, output],
        };
        let weight = self.param(format!("{name}.weight"), &shape, block);
        let bias = bias.then(|| self.param(format!("{name}.bias"), &[output], block));
        Linear {
            weight,
            bias,
            layout,
        }
    }

    /// Declares `{name}.weight` (and `{name}.bias`) of a norm over `width` features.
    fn norm_params(&mut self, name: &str, width: u64, bias: bool, block: BlockId) -> Norm {
        let weight = self.param(format!("{name}.weight"), &[width], block);
        let bias = bias.then(|| self.param(format!("{name}.bias"), &[width], block));
        Norm { weight, bias }
    }

    /// Makes `block` the block of the ops that follow.
    fn enter(&mut self, block: BlockId) {
        self.block = Some(block);
    }

    /// Adds a forward op writing one activation.
    fn op(&mut self, kind: OpKind, inputs: &[ValueId], name: String) -> Result<ValueId> {
        self.op_with_role(kind, inputs, name, Role::Activation)
    }

    fn op_with_role(
        &mut self,
        kind: OpKind,
        inputs: &[ValueId],
        name: String,
        role: Role,
    ) -> Result<ValueId> {
        let block = self.block.ok_or_else(|| {
            ModelError::InvalidOptions("internal error: an op was added before any block".into())
        })?;
        Ok(self
            .graph
            .add_op(kind, inputs, name, role, block, Phase::Forward)?)
    }

    /// Applies a linear layer.
    fn linear(&mut self, x: ValueId, layer: &Linear, name: String) -> Result<ValueId> {
        let kind = OpKind::Linear {
            bias: layer.bias.is_some(),
            layout: layer.layout,
        };
        let mut inputs = vec![x, layer.weight.value];
        inputs.extend(layer.bias.map(|b| b.value));
        self.op(kind, &inputs, name)
    }

    /// Applies a LayerNorm (with bias) or an RMSNorm (without).
    fn norm(&mut self, x: ValueId, norm: &Norm, eps: f64, name: String) -> Result<ValueId> {
        match norm.bias {
            Some(bias) => self.op(
                OpKind::LayerNorm { eps },
                &[x, norm.weight.value, bias.value],
                name,
            ),
            None => self.op(
                OpKind::RmsNorm {
                    eps,
                    head_dim: None,
                    unit_offset: false,
                },
                &[x, norm.weight.value],
                name,
            ),
        }
    }

    /// Adds two activations.
    fn add(&mut self, a: ValueId, b: ValueId, name: String) -> Result<ValueId> {
        self.op(OpKind::Add, &[a, b], name)
    }

    /// The head's last steps: `logits = x W^T` with `lm_head` (`[V, C]`), then the mean
    /// cross-entropy against `targets`, marked as the loss and the graph's output.
    fn logits_and_loss(&mut self, x: ValueId, lm_head: Weight, targets: ValueId) -> Result<()> {
        let head = Linear {
            weight: lm_head,
            bias: None,
            layout: WeightLayout::OutIn,
        };
        let logits = self.linear(x, &head, "logits".into())?;
        let loss = match self.aux_loss.take().filter(|a| !a.logits.is_empty()) {
            None => self.op_with_role(
                OpKind::CrossEntropy,
                &[logits, targets],
                "loss".into(),
                Role::Loss,
            )?,
            // transformers' `loss += router_aux_loss_coef * aux_loss`.
            Some(aux) => {
                let ce = self.op(
                    OpKind::CrossEntropy,
                    &[logits, targets],
                    "cross_entropy".into(),
                )?;
                let mut inputs = vec![ce];
                inputs.extend(&aux.logits);
                self.op_with_role(
                    OpKind::MoeAuxLoss {
                        experts: aux.experts,
                        top_k: aux.top_k,
                        layers: aux.logits.len() as u64,
                        coef: aux.coef,
                    },
                    &inputs,
                    "loss".into(),
                    Role::Loss,
                )?
            }
        };
        self.graph.add_output(loss);
        Ok(())
    }
}

/// The blocks of a model, in forward order.
pub(crate) struct Blocks {
    embedding: BlockId,
    layers: Vec<BlockId>,
    head: BlockId,
}
