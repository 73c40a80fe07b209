//! Fused layers with their own backward, for graphs and eager code alike: change a `use` line
//! (`burn::nn::LayerNorm` to `burn_graphed::nn::LayerNorm`) and the model runs one kernel where
//! burn composes several, inside a graph as outside. Each op runs its fused kernels on burn's
//! cubecl backends (CUDA, wgpu) and falls back to burn's own composition elsewhere (Flex) and
//! for inputs its kernels do not take; the parameters carry burn-nn's names and shapes, so a
//! module's saved parameters load into either.
//!
//! | op | fused on cubecl backends | falls back to burn's composition |
//! | --- | --- | --- |
//! | [`layer_norm`], [`LayerNorm`] | `f32`, `f16`, `bf16`; one kernel forward, three backward | other backends; mixed dtypes; an empty last dimension |
//! | [`rms_norm`], [`RmsNorm`] | as the layer norm (the same kernels, without the mean) | as the layer norm |
//! | [`attention::attention`] (burn's `attention`), [`attention::MultiHeadAttention`] | `f32`, `f16`, `bf16`, head dimension up to 64, masks and causal: one kernel forward, two backward, no scores in memory, on CUDA's tensor cores for head dimensions a multiple of 16 (`f32` as 3xTF32); self-attention's three projections as one product | other backends; an attention bias or softcap; mixed dtypes; in training with attention dropout (burn-nn's module) |
//! | [`TransformerEncoder`], [`PositionWiseFeedForward`] | its layer norms, attention and linear layers | as each op |
//! | [`Linear`] | at most 8 rows: one kernel forward; on CUDA, more rows and the backward's products through cuBLASLt (`f32` on TF32 tensor cores unless `allow_tf32(false)`, as burn's products; `f16`/`bf16` accumulated in `f32`) | more rows off CUDA; as the layer norm |
//! | [`conv2d`], [`Conv2d`] | `f32`, `f16`, `bf16`, stride, padding, dilation, groups, kernels up to 64 taps: one kernel forward, three backward, on the `[batch, channels, height, width]` layout (direct convolution on CUDA cores) | other backends; mixed dtypes; larger kernels |
//! | [`embedding`], [`Embedding`] | `f32`, `f16`, `bf16`: a gather kernel forward; backward one kernel, a cube per token and block of dimensions (burn-cubecl's walks the tokens in turn) | other backends; other dtypes |
//! | [`loss::CrossEntropyLoss`] | from logits without padding, weights or smoothing: one kernel forward, one backward | those forms; other backends; other dtypes |

pub mod attention;
mod conv;
mod embedding;
mod encoder;
mod linear;
pub mod loss;
mod norm;

pub use conv::{Conv2d, conv2d};
pub use embedding::{Embedding, embedding};
pub use encoder::{
    PositionWiseFeedForward, TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
    TransformerEncoderLayer,
};
pub use linear::Linear;
pub use norm::{LayerNorm, LayerNormConfig, RmsNorm, RmsNormConfig, layer_norm, rms_norm};
