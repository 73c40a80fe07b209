//! Scaled dot-product attention and burn-nn's multi-head attention without the scores in
//! memory: the function takes burn's `attention` arguments, the module burn-nn's fields, so a
//! saved module loads into either.

use burn::config::Config;
use burn::module::Module;
use burn::nn::{Dropout, Gelu, Initializer};
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, DType, Device, Int, IntDType, Tensor};

use super::Linear;
use crate::cube::{self, AttentionSpec};

/// `softmax(Q Kᵀ * scale) V` over `query` `[batch, heads, q_len, dim]`, `key` and `value`
/// `[batch, heads, k_len, dim]`: burn's `burn::tensor::module::attention`, with its arguments
/// and results (a `true` in `mask` hides a key, `options.is_causal` hides the keys after each
/// query, a row with every key hidden is 0), in one kernel forward and two backward on burn's
/// cubecl backends, without the `[batch, heads, q_len, k_len]` scores in memory.
///
/// Fused when: a cubecl backend; `f32`, `f16` or `bf16`, one dtype for all three; the values'
/// dimension equal to the queries' and at most 64 (and fitting the device's shared memory);
/// no `attn_bias` and no `softcap`; a mask of shape `[batch or 1, heads or 1, q_len or 1,
/// k_len]`. Otherwise this is burn's computation. Precision: scores, softmax and sums in `f32`
/// whatever the dtype, the result rounded once.
///
/// # Panics
///
/// As burn's function, on shapes that do not agree.
pub fn attention(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    mask: Option<Tensor<4, Bool>>,
    attn_bias: Option<Tensor<4>>,
    options: AttentionModuleOptions,
) -> Tensor<4> {
    let [batch, heads, q_len, dim] = query.dims();
    let k_len = key.dims()[2];
    let takes_mask = mask.as_ref().is_none_or(|mask| {
        let [mb, mh, mq, mk] = mask.dims();
        (mb == 1 || mb == batch)
            && (mh == 1 || mh == heads)
            && (mq == 1 || mq == q_len)
            && mk == k_len
    });
    if attn_bias.is_none()
        && options.softcap.is_none()
        && takes_mask
        && fused(&query, &key, &value, 2)
    {
        let spec = AttentionSpec {
            masked: mask.is_some(),
            causal: options.is_causal,
            quiet: false,
            scale: options.scale.unwrap_or(1.0 / (dim as f64).sqrt()) as f32,
            fill: f32::NEG_INFINITY,
        };
        let swap = |t: Tensor<4>| t.swap_dims(1, 2);
        match fused_heads_last(swap(query), swap(key), swap(value), mask, spec) {
            Ok(out) => return out.swap_dims(1, 2),
            Err(declined) => {
                let (query, key, value, mask) = *declined;
                let (query, key, value) = (swap(query), swap(key), swap(value));
                return burn::tensor::module::attention(query, key, value, mask, None, options);
            }
        }
    }
    burn::tensor::module::attention(query, key, value, mask, attn_bias, options)
}

/// The tensors handed back where the kernels did not run: queries, keys, values, mask.
type Declined = Box<(Tensor<4>, Tensor<4>, Tensor<4>, Option<Tensor<4, Bool>>)>;

/// The fused attention of `q` over `k` and `v` in the heads-last layout `[batch, len, heads,
/// dim]`, the output in that layout; `Err` with the tensors where the engine has no kernels.
/// The caller checked [`fused`] and the mask's shape (heads-first, as burn's).
fn fused_heads_last(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<Tensor<4, Bool>>,
    spec: AttentionSpec,
) -> Result<Tensor<4>, Declined> {
    let mask_int = mask_i32(mask.as_ref(), &q.device());
    let inputs = (
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        mask_int.into_dispatch(),
    );
    match cube::attention(inputs, spec) {
        Ok(out) => Ok(Tensor::from_dispatch(out)),
        Err(inputs) => {
            let (q, k, v, _) = *inputs;
            Err(Box::new((
                Tensor::from_dispatch(q),
                Tensor::from_dispatch(k),
                Tensor::from_dispatch(v),
                mask,
            )))
        }
    }
}

/// The mask as the kernels take it: `i32`, or without one a one-element placeholder, bound and
/// never read (the spec says unmasked), no values written, no cast.
fn mask_i32(mask: Option<&Tensor<4, Bool>>, device: &Device) -> Tensor<4, Int> {
    match mask {
        Some(mask) => mask.clone().int().cast(IntDType::I32),
        None => Tensor::<4, Int>::empty([1, 1, 1, 1], device),
    }
}

/// The fused attention of the queries over the keys and values of `qkv` (`[batch, len, 3 *
/// heads, dim]`, the three in turn), `[batch, len, heads, dim]`; `None` where the engine has no
/// kernels. The caller checked what [`fused_heads_last`]'s caller checks.
fn fused_packed(
    qkv: Tensor<4>,
    mask: Option<Tensor<4, Bool>>,
    spec: AttentionSpec,
) -> Option<Tensor<4>> {
    let mask_int = mask_i32(mask.as_ref(), &qkv.device());
    cube::attention_packed((qkv.into_dispatch(), mask_int.into_dispatch()), spec)
        .ok()
        .map(Tensor::from_dispatch)
}

/// The packed kernels' attention of `qkv` (`[batch, len, 3 * heads, dim]`) as burn's
/// `attention` computes it (no mask, scale `1 / sqrt(dim)`): `[batch, len, heads, dim]`, or
/// `None` where the kernels do not take it (`burn_graphed::testing::attention_packed`).
#[cfg(feature = "testing")]
pub(crate) fn attention_packed(qkv: Tensor<4>, causal: bool) -> Option<Tensor<4>> {
    let [_, len, heads, dim] = qkv.dims();
    let taken = matches!(qkv.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && heads % 3 == 0
        && len > 0
        && cube::attention_supports_dim(&qkv.device(), dim);
    let spec = AttentionSpec {
        masked: false,
        causal,
        quiet: false,
        scale: (1.0 / (dim as f64).sqrt()) as f32,
        fill: f32::NEG_INFINITY,
    };
    taken.then(|| fused_packed(qkv, None, spec)).flatten()
}

/// `a`, `b` and `c` (one shape and dtype) side by side along their last dimension, one kernel
/// forward and one backward; `None` where the engine has no kernels.
fn join3<const D: usize>(a: Tensor<D>, b: Tensor<D>, c: Tensor<D>) -> Option<Tensor<D>> {
    cube::join3((a.into_dispatch(), b.into_dispatch(), c.into_dispatch()))
        .ok()
        .map(Tensor::from_dispatch)
}

/// Whether the kernels take these queries, keys and values (`[.., dim]`, their lengths along
/// `len_axis`: 2 heads-first, 1 heads-last).
fn fused(query: &Tensor<4>, key: &Tensor<4>, value: &Tensor<4>, len_axis: usize) -> bool {
    let dtype = query.dtype();
    let dim = query.dims()[3];
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
        && key.dtype() == dtype
        && value.dtype() == dtype
        && key.dims()[3] == dim
        && value.dims()[3] == dim
        && query.dims()[len_axis] > 0
        && key.dims()[len_axis] > 0
        && cube::attention_supports_dim(&query.device(), dim)
}

/// Configuration of a [`MultiHeadAttention`]: burn-nn's `MultiHeadAttentionConfig`, field for
/// field and default for default.
#[derive(Config, Debug)]
pub struct MultiHeadAttentionConfig {
    /// The size of each linear layer.
    pub d_model: usize,
    /// The number of heads.
    pub n_heads: usize,
    /// The dropout rate (on the attention weights, in training).
    #[config(default = 0.1)]
    pub dropout: f64,
    /// The score of a masked key.
    #[config(default = -1.0e4)]
    pub min_float: f64,
    /// burn's `quiet_softmax` instead of the softmax.
    #[config(default = false)]
    pub quiet_softmax: bool,
    /// The initializer of the linear layers.
    #[config(
        default = "Initializer::KaimingUniform{gain: 0.5773502691896258, fan_out_only:false}"
    )]
    pub initializer: Initializer,
    /// A bias on the key projection.
    #[config(default = true)]
    pub key_bias: bool,
    /// A bias on the value projection.
    #[config(default = true)]
    pub value_bias: bool,
    /// A bias on the query projection.
    #[config(default = true)]
    pub query_bias: bool,
    /// A bias on the output projection.
    #[config(default = true)]
    pub output_bias: bool,
}

impl MultiHeadAttentionConfig {
    /// burn-nn's configuration with the same values.
    pub fn to_burn(&self) -> burn::nn::attention::MultiHeadAttentionConfig {
        burn::nn::attention::MultiHeadAttentionConfig::new(self.d_model, self.n_heads)
            .with_dropout(self.dropout)
            .with_min_float(self.min_float)
            .with_quiet_softmax(self.quiet_softmax)
            .with_initializer(self.initializer.clone())
            .with_key_bias(self.key_bias)
            .with_value_bias(self.value_bias)
            .with_query_bias(self.query_bias)
            .with_output_bias(self.output_bias)
    }

    /// A module initialized as burn-nn's (burn-nn builds it).
    pub fn init(&self, device: &Device) -> MultiHeadAttention {
        self.to_burn().init(device).into()
    }
}

/// The input of a [`MultiHeadAttention`]: burn-nn's `MhaInput`.
#[derive(Debug, Clone)]
pub struct MhaInput {
    query: Tensor<3>,
    key: Tensor<3>,
    value: Tensor<3>,
    mask_pad: Option<Tensor<2, Bool>>,
    mask_attn: Option<Tensor<3, Bool>>,
    /// Made by [`MhaInput::self_attn`]: the three projections may run as one product.
    self_attention: bool,
}

impl MhaInput {
    /// Self-attention: `tensor` `[batch, len, d_model]` as queries, keys and values (where
    /// the kernels run, the three projections are one product: see [`MultiHeadAttention`]).
    pub fn self_attn(tensor: Tensor<3>) -> Self {
        Self {
            self_attention: true,
            ..Self::new(tensor.clone(), tensor.clone(), tensor)
        }
    }

    /// Queries `[batch, q_len, d_model]` over keys and values `[batch, k_len, d_model]`.
    pub fn new(query: Tensor<3>, key: Tensor<3>, value: Tensor<3>) -> Self {
        Self {
            query,
            key,
            value,
            mask_pad: None,
            mask_attn: None,
            self_attention: false,
        }
    }

    /// The padding mask `[batch, k_len]` (true: padding, hidden from every query).
    pub fn mask_pad(mut self, mask_pad: Tensor<2, Bool>) -> Self {
        self.mask_pad = Some(mask_pad);
        self
    }

    /// The attention mask `[batch, q_len, k_len]` (true: hidden).
    pub fn mask_attn(mut self, mask_attn: Tensor<3, Bool>) -> Self {
        self.mask_attn = Some(mask_attn);
        self
    }

    fn into_burn(self) -> burn::nn::attention::MhaInput {
        let mut input = burn::nn::attention::MhaInput::new(self.query, self.key, self.value);
        if let Some(mask) = self.mask_pad {
            input = input.mask_pad(mask);
        }
        if let Some(mask) = self.mask_attn {
            input = input.mask_attn(mask);
        }
        input
    }
}

/// The output of a [`MultiHeadAttention`]: the context only (burn-nn's `MhaOutput` also holds
/// the attention weights, which the fused kernels never hold in memory).
#[derive(Debug, Clone)]
pub struct MhaOutput {
    /// `[batch, q_len, d_model]`.
    pub context: Tensor<3>,
}

/// burn-nn's `MultiHeadAttention` with the fused [`attention`] inside and this crate's
/// [`Linear`] projections: the same fields, names and forward, so saved parameters load into
/// either and `From` converts both ways. On self-attention ([`MhaInput::self_attn`]) whose
/// query, key and value projections all have a bias or none has, the three run as one
/// product: their weights joined side by side (one copy kernel, split back by one in the
/// backward), the queries, keys and values read by the attention kernels from that product's
/// output in place. Where the
/// kernels do not run (see [`attention`]; and in training with a dropout rate above 0, whose
/// dropout acts on the attention weights) this is burn-nn's forward.
#[derive(Module, Debug)]
pub struct MultiHeadAttention {
    /// The query projection.
    pub query: Linear,
    /// The key projection.
    pub key: Linear,
    /// The value projection.
    pub value: Linear,
    /// The output projection.
    pub output: Linear,
    /// Dropout on the attention weights.
    pub dropout: Dropout,
    /// burn-nn's (unused in its forward).
    pub activation: Gelu,
    /// The size of the model.
    pub d_model: usize,
    /// The number of heads.
    pub n_heads: usize,
    /// The size of a head.
    pub d_k: usize,
    /// The score of a masked key.
    pub min_float: f64,
    /// burn's `quiet_softmax` instead of the softmax.
    pub quiet_softmax: bool,
}

impl MultiHeadAttention {
    /// burn-nn's forward (`MultiHeadAttention::forward`), the context only.
    ///
    /// # Panics
    ///
    /// As burn-nn's, when the inputs' last dimension is not `d_model` or their batch sizes or
    /// key and value lengths differ.
    pub fn forward(&self, input: MhaInput) -> MhaOutput {
        self.forward_inner(input, None)
    }

    /// `residual + self.forward(input).context`, the residual added in the output
    /// projection ([`Linear::forward_add`]: before its one rounding where it runs fused): a
    /// transformer block's `x + attention(x)` in one launch less.
    ///
    /// # Panics
    ///
    /// As [`forward`](Self::forward), and when the residual's shape is not the query's.
    pub fn forward_add(&self, input: MhaInput, residual: Tensor<3>) -> MhaOutput {
        self.forward_inner(input, Some(residual))
    }

    fn forward_inner(&self, input: MhaInput, residual: Option<Tensor<3>>) -> MhaOutput {
        let [batch, q_len, d_model] = input.query.dims();
        let [key_batch, k_len, _] = input.key.dims();
        assert!(
            d_model == self.d_model
                && input.key.dims()[2] == d_model
                && input.value.dims() == [batch, k_len, d_model]
                && key_batch == batch,
            "MultiHeadAttention: query {:?}, key {:?}, value {:?} for d_model {}",
            input.query.dims(),
            input.key.dims(),
            input.value.dims(),
            self.d_model
        );
        let dropping = self.dropout.prob > 0.0
            && self.dropout.training.is_enabled()
            && input.query.device().is_autodiff();
        // The projections keep the inputs' dtype where the weights have it.
        let dtype = input.query.dtype();
        let same_dtype = [&input.key, &input.value]
            .iter()
            .all(|x| x.dtype() == dtype)
            && [&self.query, &self.key, &self.value]
                .iter()
                .all(|linear| linear.weight.val().dtype() == dtype);
        let fusable = !dropping
            && same_dtype
            && matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
            && q_len > 0
            && k_len > 0
            && cube::attention_supports_dim(&input.query.device(), self.d_k);
        if fusable {
            let mask = mask_of(&input, batch, q_len, k_len);
            let spec = AttentionSpec {
                masked: mask.is_some(),
                causal: false,
                quiet: self.quiet_softmax,
                scale: (1.0 / (self.d_k as f64).sqrt()) as f32,
                fill: self.min_float as f32,
            };
            let joined = if input.self_attention {
                self.joined_projections(dtype)
            } else {
                None
            };
            let context =
                match joined {
                    Some((weight, bias)) => {
                        let qkv = super::linear::linear(input.query.clone(), weight, bias)
                            .reshape([batch, q_len, 3 * self.n_heads, self.d_k]);
                        fused_packed(qkv, mask, spec)
                    }
                    None => {
                        let heads = |x: Tensor<3>, linear: &Linear, len: usize| {
                            linear
                                .forward(x)
                                .reshape([batch, len, self.n_heads, self.d_k])
                        };
                        let q = heads(input.query.clone(), &self.query, q_len);
                        let k = heads(input.key.clone(), &self.key, k_len);
                        let v = heads(input.value.clone(), &self.value, k_len);
                        fused_heads_last(q, k, v, mask, spec).ok()
                    }
                };
            // Only without the engine's kernels (no cubecl) is this `None`: `fusable` says
            // they run.
            if let Some(context) = context {
                let context = context.reshape([batch, q_len, d_model]);
                let context = match residual {
                    Some(residual) => self.output.forward_add(context, residual),
                    None => self.output.forward(context),
                };
                return MhaOutput { context };
            }
        }
        let context = self.to_burn().forward(input.into_burn()).context;
        let context = match residual {
            Some(residual) => residual + context,
            None => context,
        };
        MhaOutput { context }
    }

    /// The query, key and value projections' weights side by side (`[d_model, 3 * d_model]`)
    /// and their biases (`[3 * d_model]`), where all three have a bias of `dtype` or none has
    /// one; `None` otherwise, or where the engine has no kernels.
    fn joined_projections(&self, dtype: DType) -> Option<(Tensor<2>, Option<Tensor<1>>)> {
        let linears = [&self.query, &self.key, &self.value];
        let biases: Vec<Tensor<1>> = linears
            .iter()
            .filter_map(|linear| linear.bias.as_ref().map(|bias| bias.val()))
            .collect();
        if !(biases.is_empty() || biases.len() == 3)
            || biases.iter().any(|bias| bias.dtype() != dtype)
        {
            return None;
        }
        let [wq, wk, wv] = linears.map(|linear| linear.weight.val());
        match <[Tensor<1>; 3]>::try_from(biases) {
            Ok([bq, bk, bv]) => {
                let (weight, bias) = cube::join3_biased((
                    (wq.into_dispatch(), wk.into_dispatch(), wv.into_dispatch()),
                    (bq.into_dispatch(), bk.into_dispatch(), bv.into_dispatch()),
                ))
                .ok()?;
                Some((
                    Tensor::from_dispatch(weight),
                    Some(Tensor::from_dispatch(bias)),
                ))
            }
            Err(_) => Some((join3(wq, wk, wv)?, None)),
        }
    }

    /// This module as burn-nn's (the same parameters, burn-nn's forward).
    fn to_burn(&self) -> burn::nn::attention::MultiHeadAttention {
        self.clone().into()
    }
}

/// The masks of `input` as one `[batch, 1, q_len or 1, k_len]` mask (heads-first, as
/// burn's `attention` takes it), or `None`.
fn mask_of(input: &MhaInput, batch: usize, q_len: usize, k_len: usize) -> Option<Tensor<4, Bool>> {
    let pad = input
        .mask_pad
        .clone()
        .map(|mask| mask.reshape([batch, 1, 1, k_len]));
    let attn = input
        .mask_attn
        .clone()
        .map(|mask| mask.reshape([batch, 1, q_len, k_len]));
    match (pad, attn) {
        (Some(pad), Some(attn)) => Some(pad.expand([batch, 1, q_len, k_len]).bool_or(attn)),
        (pad, attn) => pad.or(attn),
    }
}

impl From<burn::nn::attention::MultiHeadAttention> for MultiHeadAttention {
    fn from(module: burn::nn::attention::MultiHeadAttention) -> Self {
        Self {
            query: module.query.into(),
            key: module.key.into(),
            value: module.value.into(),
            output: module.output.into(),
            dropout: module.dropout,
            activation: module.activation,
            d_model: module.d_model,
            n_heads: module.n_heads,
            d_k: module.d_k,
            min_float: module.min_float,
            quiet_softmax: module.quiet_softmax,
        }
    }
}

impl From<MultiHeadAttention> for burn::nn::attention::MultiHeadAttention {
    fn from(module: MultiHeadAttention) -> Self {
        Self {
            query: module.query.into(),
            key: module.key.into(),
            value: module.value.into(),
            output: module.output.into(),
            dropout: module.dropout,
            activation: module.activation,
            d_model: module.d_model,
            n_heads: module.n_heads,
            d_k: module.d_k,
            min_float: module.min_float,
            quiet_softmax: module.quiet_softmax,
        }
    }
}
