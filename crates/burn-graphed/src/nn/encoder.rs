//! burn-nn's transformer encoder with the fused layer norms and the fused multi-head attention:
//! the same fields, names and forward (burn-nn 0.22.1 `transformer/encoder.rs`), so a saved
//! encoder loads into either. The feed-forward block is burn-nn's with this crate's `Linear`.

use burn::config::Config;
use burn::module::Module;
use burn::nn::{Dropout, Initializer, activation::Activation, activation::ActivationConfig};
use burn::tensor::{Bool, Device, Tensor};

use super::Linear;
use super::attention::{MhaInput, MultiHeadAttention};
use super::norm::LayerNorm;

/// Configuration of a [`TransformerEncoder`]: burn-nn's `TransformerEncoderConfig`, field for
/// field and default for default.
#[derive(Config, Debug)]
pub struct TransformerEncoderConfig {
    /// The size of the model.
    pub d_model: usize,
    /// The size of the position-wise feed-forward network.
    pub d_ff: usize,
    /// The number of attention heads.
    pub n_heads: usize,
    /// The number of layers.
    pub n_layers: usize,
    /// The dropout rate.
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Layer norm before the attention and the feed-forward block (pre-norm), else after.
    #[config(default = false)]
    pub norm_first: bool,
    /// `quiet_softmax` in the attention.
    #[config(default = false)]
    pub quiet_softmax: bool,
    /// The initializer of the parameters (burn-nn's default: Kaiming uniform, gain
    /// `1/sqrt(3)`).
    #[config(
        default = "Initializer::KaimingUniform{gain: 0.5773502691896258, fan_out_only:false}"
    )]
    pub initializer: Initializer,
    /// The activation of the feed-forward block.
    #[config(default = "ActivationConfig::Gelu")]
    pub activation: ActivationConfig,
    /// The epsilon of the layer norms.
    #[config(default = 1e-5)]
    pub layer_norm_eps: f64,
}

impl TransformerEncoderConfig {
    /// burn-nn's configuration with the same values.
    pub fn to_burn(&self) -> burn::nn::transformer::TransformerEncoderConfig {
        burn::nn::transformer::TransformerEncoderConfig::new(
            self.d_model,
            self.d_ff,
            self.n_heads,
            self.n_layers,
        )
        .with_dropout(self.dropout)
        .with_norm_first(self.norm_first)
        .with_quiet_softmax(self.quiet_softmax)
        .with_initializer(self.initializer.clone())
        .with_activation(self.activation.clone())
        .with_layer_norm_eps(self.layer_norm_eps)
    }

    /// An encoder initialized as burn-nn's (burn-nn builds it; its layer norms and attention
    /// become the fused ones).
    pub fn init(&self, device: &Device) -> TransformerEncoder {
        TransformerEncoder::from_burn(self.to_burn().init(device), self.layer_norm_eps)
    }
}

/// The input of a [`TransformerEncoder`]: burn-nn's `TransformerEncoderInput`.
#[derive(Debug)]
pub struct TransformerEncoderInput {
    tensor: Tensor<3>,
    mask_pad: Option<Tensor<2, Bool>>,
    mask_attn: Option<Tensor<3, Bool>>,
}

impl TransformerEncoderInput {
    /// The input `[batch, length, d_model]`, no mask.
    pub fn new(tensor: Tensor<3>) -> Self {
        Self {
            tensor,
            mask_pad: None,
            mask_attn: None,
        }
    }

    /// The padding mask `[batch, length]` (true: padding).
    pub fn mask_pad(mut self, mask_pad: Tensor<2, Bool>) -> Self {
        self.mask_pad = Some(mask_pad);
        self
    }

    /// The attention mask `[batch, length, length]` (true: masked).
    pub fn mask_attn(mut self, mask_attn: Tensor<3, Bool>) -> Self {
        self.mask_attn = Some(mask_attn);
        self
    }
}

/// burn-nn's `TransformerEncoder` with fused layer norms and attention.
#[derive(Module, Debug)]
pub struct TransformerEncoder {
    /// The layers.
    pub layers: Vec<TransformerEncoderLayer>,
    /// The size of the model.
    pub d_model: usize,
    /// The size of the feed-forward block.
    pub d_ff: usize,
    /// The number of attention heads.
    pub n_heads: usize,
    /// The number of layers.
    pub n_layers: usize,
    /// The dropout rate.
    pub dropout: f64,
    /// Pre-norm.
    pub norm_first: bool,
    /// `quiet_softmax` in the attention.
    pub quiet_softmax: bool,
}

impl TransformerEncoder {
    /// Applies every layer in turn (burn-nn's forward).
    pub fn forward(&self, input: TransformerEncoderInput) -> Tensor<3> {
        let mut x = input.tensor;
        for layer in &self.layers {
            x = layer.forward(x, input.mask_pad.clone(), input.mask_attn.clone());
        }
        x
    }

    /// burn-nn's `encoder` with its layer norms and attention fused; `layer_norm_eps` must be the epsilon it
    /// was configured with (burn-nn keeps it private).
    pub fn from_burn(
        encoder: burn::nn::transformer::TransformerEncoder,
        layer_norm_eps: f64,
    ) -> Self {
        Self {
            layers: encoder
                .layers
                .into_iter()
                .map(|layer| TransformerEncoderLayer {
                    mha: layer.mha.into(),
                    pwff: layer.pwff.into(),
                    norm_1: LayerNorm::from_burn(layer.norm_1, layer_norm_eps),
                    norm_2: LayerNorm::from_burn(layer.norm_2, layer_norm_eps),
                    dropout: layer.dropout,
                    norm_first: layer.norm_first,
                })
                .collect(),
            d_model: encoder.d_model,
            d_ff: encoder.d_ff,
            n_heads: encoder.n_heads,
            n_layers: encoder.n_layers,
            dropout: encoder.dropout,
            norm_first: encoder.norm_first,
            quiet_softmax: encoder.quiet_softmax,
        }
    }

    /// This encoder as burn-nn's (the same parameters, burn's layer norms and attention).
    pub fn into_burn(self) -> burn::nn::transformer::TransformerEncoder {
        burn::nn::transformer::TransformerEncoder {
            layers: self
                .layers
                .into_iter()
                .map(|layer| burn::nn::transformer::TransformerEncoderLayer {
                    mha: layer.mha.into(),
                    pwff: layer.pwff.into(),
                    norm_1: layer.norm_1.into_burn(),
                    norm_2: layer.norm_2.into_burn(),
                    dropout: layer.dropout,
                    norm_first: layer.norm_first,
                })
                .collect(),
            d_model: self.d_model,
            d_ff: self.d_ff,
            n_heads: self.n_heads,
            n_layers: self.n_layers,
            dropout: self.dropout,
            norm_first: self.norm_first,
            quiet_softmax: self.quiet_softmax,
        }
    }
}

/// burn-nn's `TransformerEncoderLayer` with fused layer norms and attention.
#[derive(Module, Debug)]
pub struct TransformerEncoderLayer {
    /// Self-attention, fused.
    pub mha: MultiHeadAttention,
    /// The feed-forward block (burn-nn's, with this crate's [`Linear`]).
    pub pwff: PositionWiseFeedForward,
    /// The norm around the feed-forward block (pre-norm: before it; post-norm: after the
    /// attention's residual).
    pub norm_1: LayerNorm,
    /// The other norm (pre-norm: before the attention; post-norm: at the end).
    pub norm_2: LayerNorm,
    /// Dropout on both residual paths.
    pub dropout: Dropout,
    /// Pre-norm.
    pub norm_first: bool,
}

impl TransformerEncoderLayer {
    /// burn-nn's forward, with its norms in the same places.
    pub fn forward(
        &self,
        x: Tensor<3>,
        mask_pad: Option<Tensor<2, Bool>>,
        mask_attn: Option<Tensor<3, Bool>>,
    ) -> Tensor<3> {
        let mut residual = x.clone();
        if self.norm_first {
            residual = self.norm_2.forward(residual);
        }
        let mut attention_input = MhaInput::self_attn(residual);
        if let Some(mask_pad) = mask_pad {
            attention_input = attention_input.mask_pad(mask_pad);
        }
        if let Some(mask_attn) = mask_attn {
            attention_input = attention_input.mask_attn(mask_attn);
        }
        // Where the dropout passes its input through, each residual addition is the last
        // product's epilogue (`forward_add`): one launch less each.
        let mut x = if dropout_acts(&self.dropout, &x) {
            x.clone()
                + self
                    .dropout
                    .forward(self.mha.forward(attention_input).context)
        } else {
            self.mha.forward_add(attention_input, x.clone()).context
        };
        let residual = if self.norm_first {
            self.norm_1.forward(x.clone())
        } else {
            x = self.norm_1.forward(x);
            x.clone()
        };
        let mut x = if dropout_acts(&self.dropout, &x) {
            x.clone() + self.dropout.forward(self.pwff.forward(residual))
        } else {
            self.pwff.forward_add(residual, x)
        };
        if !self.norm_first {
            x = self.norm_2.forward(x);
        }
        x
    }
}

/// burn-nn's `PositionWiseFeedForward` (the same fields and forward: inner projection,
/// activation, dropout, outer projection) with this crate's [`Linear`]; `From` converts both
/// ways, and saved parameters load into either.
#[derive(Module, Debug)]
pub struct PositionWiseFeedForward {
    /// `d_model` to `d_ff`.
    pub linear_inner: Linear,
    /// `d_ff` to `d_model`.
    pub linear_outer: Linear,
    /// Dropout after the activation.
    pub dropout: Dropout,
    /// The activation (not in the record, as burn-nn's).
    #[module(skip)]
    pub activation: Activation,
}

impl PositionWiseFeedForward {
    /// burn-nn's forward.
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        self.linear_outer.forward(self.hidden(input))
    }

    /// `residual + self.forward(input)`, the residual added in the outer projection
    /// ([`Linear::forward_add`]).
    ///
    /// # Panics
    ///
    /// As [`forward`](Self::forward), and when the residual's shape is not the output's.
    pub fn forward_add<const D: usize>(&self, input: Tensor<D>, residual: Tensor<D>) -> Tensor<D> {
        self.linear_outer.forward_add(self.hidden(input), residual)
    }

    /// The inner projection, the activation and the dropout.
    fn hidden<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let x = self.linear_inner.forward(input);
        let x = self.activation.forward(x);
        self.dropout.forward(x)
    }
}

/// Whether `dropout` changes `x` (burn's `Dropout::forward` returns its input as it is
/// otherwise).
fn dropout_acts<const D: usize>(dropout: &Dropout, x: &Tensor<D>) -> bool {
    dropout.prob > 0.0 && dropout.training.is_enabled() && x.device().is_autodiff()
}

impl From<burn::nn::transformer::PositionWiseFeedForward> for PositionWiseFeedForward {
    fn from(pwff: burn::nn::transformer::PositionWiseFeedForward) -> Self {
        Self {
            linear_inner: pwff.linear_inner.into(),
            linear_outer: pwff.linear_outer.into(),
            dropout: pwff.dropout,
            activation: pwff.activation,
        }
    }
}

impl From<PositionWiseFeedForward> for burn::nn::transformer::PositionWiseFeedForward {
    fn from(pwff: PositionWiseFeedForward) -> Self {
        Self {
            linear_inner: pwff.linear_inner.into(),
            linear_outer: pwff.linear_outer.into(),
            dropout: pwff.dropout,
            activation: pwff.activation,
        }
    }
}
