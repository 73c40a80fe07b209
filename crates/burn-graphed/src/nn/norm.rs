//! Layer norm and RMS norm: the functions and modules with burn-nn's parameters.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::{DType, Device, FloatDType, Tensor};

use crate::cube;

/// `input` normalized over its last dimension, scaled by `gamma`, shifted by `beta`: what
/// `burn::tensor::module::layer_norm` computes, `(x - mean) / sqrt(var + epsilon) * gamma +
/// beta` with the biased variance, in one kernel forward and three backward on burn's cubecl
/// backends.
///
/// Precision: on the fused path every element is computed in `f32` whatever the dtype and the
/// result rounded once (as PyTorch's layer norm does); burn-nn computes `f16` in `f32` too, but
/// `bf16` in `bf16`, rounding after each operation, so a `bf16` result here is the closer one to
/// the exact norm. Elsewhere (not a cubecl backend, gamma or beta of another dtype than the
/// input, an empty last dimension) this is burn-nn's computation.
///
/// # Panics
///
/// As burn's function: when gamma (or beta) is not `[d]` for an input `[.., d]`.
pub fn layer_norm<const D: usize>(
    input: Tensor<D>,
    gamma: Tensor<1>,
    beta: Option<Tensor<1>>,
    epsilon: f64,
) -> Tensor<D> {
    let [width] = gamma.dims();
    let dims = input.dims();
    assert!(
        D > 0 && dims[D - 1] == width && beta.as_ref().is_none_or(|b| b.dims() == [width]),
        "layer_norm: gamma and beta must be [{}] for an input of shape {dims:?}, got gamma \
         {:?} and beta {:?}",
        dims.get(D.wrapping_sub(1)).copied().unwrap_or(0),
        gamma.dims(),
        beta.as_ref().map(Tensor::dims),
    );
    if fused(&input, &gamma, beta.as_ref()) {
        let inputs = (
            input.into_dispatch(),
            gamma.into_dispatch(),
            beta.map(Tensor::into_dispatch),
        );
        match cube::norm(inputs, true, epsilon) {
            Ok(output) => return Tensor::from_dispatch(output),
            Err(inputs) => {
                let (input, gamma, beta) = *inputs;
                return composed(
                    Tensor::from_dispatch(input),
                    Tensor::from_dispatch(gamma),
                    beta.map(Tensor::from_dispatch),
                    epsilon,
                );
            }
        }
    }
    composed(input, gamma, beta, epsilon)
}

/// `input` divided by its root mean square over the last dimension, scaled by `gamma`: what
/// burn-nn's `RmsNorm` computes, `x / sqrt(mean(x^2) + epsilon) * gamma`, in one kernel forward
/// and three backward on burn's cubecl backends. Precision as [`layer_norm`]'s (every element in
/// `f32`, one rounding; burn-nn takes the mean of squares in `f32` and divides in the input's
/// dtype); elsewhere burn-nn's computation.
///
/// # Panics
///
/// When gamma is not `[d]` for an input `[.., d]`.
pub fn rms_norm<const D: usize>(input: Tensor<D>, gamma: Tensor<1>, epsilon: f64) -> Tensor<D> {
    let [width] = gamma.dims();
    let dims = input.dims();
    assert!(
        D > 0 && dims[D - 1] == width,
        "rms_norm: gamma must be [{}] for an input of shape {dims:?}, got {:?}",
        dims.get(D.wrapping_sub(1)).copied().unwrap_or(0),
        gamma.dims(),
    );
    if fused(&input, &gamma, None) {
        match cube::norm(
            (input.into_dispatch(), gamma.into_dispatch(), None),
            false,
            epsilon,
        ) {
            Ok(output) => return Tensor::from_dispatch(output),
            Err(inputs) => {
                let (input, gamma, _) = *inputs;
                return rms_composed(
                    Tensor::from_dispatch(input),
                    Tensor::from_dispatch(gamma),
                    epsilon,
                );
            }
        }
    }
    rms_composed(input, gamma, epsilon)
}

/// burn-nn's RMS norm (`RmsNorm::forward` of burn-nn 0.22.1).
fn rms_composed<const D: usize>(input: Tensor<D>, gamma: Tensor<1>, epsilon: f64) -> Tensor<D> {
    let dtype = input.dtype();
    let rms = (input.clone().cast(DType::F32).square().mean_dim(D - 1) + epsilon).sqrt();
    (input / rms.cast(dtype)) * gamma.unsqueeze()
}

/// Whether the fused kernels take these tensors.
fn fused<const D: usize>(input: &Tensor<D>, gamma: &Tensor<1>, beta: Option<&Tensor<1>>) -> bool {
    let dtype = input.dtype();
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
        && gamma.dtype() == dtype
        && beta.is_none_or(|beta| beta.dtype() == dtype)
        && input.dims()[D - 1] > 0
        && cube::supports_graphs(&input.device())
}

/// burn-nn's layer norm (`LayerNorm::forward` of burn-nn 0.22.1): `f16` in `f32`, other dtypes
/// in their own.
fn composed<const D: usize>(
    input: Tensor<D>,
    gamma: Tensor<1>,
    beta: Option<Tensor<1>>,
    epsilon: f64,
) -> Tensor<D> {
    use burn::tensor::module::layer_norm as burn_layer_norm;
    if input.dtype() == DType::F16 {
        let f32 = FloatDType::F32;
        burn_layer_norm(
            input.cast(f32),
            gamma.cast(f32),
            beta.map(|b| b.cast(f32)),
            epsilon,
        )
        .cast(FloatDType::F16)
    } else {
        burn_layer_norm(input, gamma, beta, epsilon)
    }
}

/// Configuration of a [`LayerNorm`]: burn-nn's `LayerNormConfig`, field for field.
#[derive(Debug, Config)]
pub struct LayerNormConfig {
    /// The size of the last dimension of the input.
    pub d_model: usize,
    /// A value required for numerical stability.
    #[config(default = 1e-5)]
    pub epsilon: f64,
    /// Whether the module has a learnable bias (beta).
    #[config(default = true)]
    pub bias: bool,
}

impl LayerNormConfig {
    /// A layer norm with gamma ones and beta zeros, as burn-nn's.
    pub fn init(&self, device: &Device) -> LayerNorm {
        LayerNorm {
            gamma: Param::from_tensor(Tensor::ones([self.d_model], device)),
            beta: self
                .bias
                .then(|| Param::from_tensor(Tensor::zeros([self.d_model], device))),
            epsilon: self.epsilon,
        }
    }
}

/// burn-nn's `LayerNorm` with the fused [`layer_norm`]: the same parameters (`gamma`, and
/// `beta` with a bias), the same names and shapes, so saved parameters load into either.
#[derive(Module, Debug)]
pub struct LayerNorm {
    /// The learnable scale, `[d_model]`.
    pub gamma: Param<Tensor<1>>,
    /// The learnable bias, `[d_model]`, when configured.
    pub beta: Option<Param<Tensor<1>>>,
    epsilon: f64,
}

impl LayerNorm {
    /// Normalizes `input` (`[..., d_model]`) over its last dimension.
    ///
    /// # Panics
    ///
    /// When the input's last dimension is not `d_model`.
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        layer_norm(
            input,
            self.gamma.val(),
            self.beta.as_ref().map(Param::val),
            self.epsilon,
        )
    }

    /// The epsilon added to the variance.
    pub fn epsilon(&self) -> f64 {
        self.epsilon
    }

    /// This module as burn-nn's `LayerNorm` (the same parameters, burn's composition).
    pub fn into_burn(self) -> burn::nn::LayerNorm {
        let [d_model] = self.gamma.dims();
        let mut module = burn::nn::LayerNormConfig::new(d_model)
            .with_epsilon(self.epsilon)
            .with_bias(self.beta.is_some())
            .init(&self.gamma.device());
        module.gamma = self.gamma;
        module.beta = self.beta;
        module
    }

    /// burn-nn's `module` as this module; `epsilon` must be the one it was configured with
    /// (burn-nn keeps it private).
    pub fn from_burn(module: burn::nn::LayerNorm, epsilon: f64) -> Self {
        Self {
            gamma: module.gamma,
            beta: module.beta,
            epsilon,
        }
    }
}

/// Configuration of an [`RmsNorm`]: burn-nn's `RmsNormConfig`, field for field.
#[derive(Debug, Config)]
pub struct RmsNormConfig {
    /// The size of the last dimension of the input.
    pub d_model: usize,
    /// A value required for numerical stability.
    #[config(default = 1e-5)]
    pub epsilon: f64,
}

impl RmsNormConfig {
    /// An RMS norm with gamma ones, as burn-nn's.
    ///
    /// # Panics
    ///
    /// When epsilon is not positive (as burn-nn's).
    pub fn init(&self, device: &Device) -> RmsNorm {
        assert!(self.epsilon > 0.0, "epsilon must be positive.");
        RmsNorm {
            gamma: Param::from_tensor(Tensor::ones([self.d_model], device)),
            epsilon: self.epsilon,
        }
    }
}

/// burn-nn's `RmsNorm` with the fused [`rms_norm`]: the same fields, so saved parameters load
/// into either, and `From` converts both ways.
#[derive(Module, Debug)]
pub struct RmsNorm {
    /// The learnable scale, `[d_model]`.
    pub gamma: Param<Tensor<1>>,
    /// The epsilon added to the mean of squares.
    pub epsilon: f64,
}

impl RmsNorm {
    /// Normalizes `input` (`[..., d_model]`) over its last dimension.
    ///
    /// # Panics
    ///
    /// When the input's last dimension is not `d_model`.
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        rms_norm(input, self.gamma.val(), self.epsilon)
    }
}

impl From<burn::nn::RmsNorm> for RmsNorm {
    fn from(module: burn::nn::RmsNorm) -> Self {
        Self {
            gamma: module.gamma,
            epsilon: module.epsilon,
        }
    }
}

impl From<RmsNorm> for burn::nn::RmsNorm {
    fn from(module: RmsNorm) -> Self {
        let mut burn_module = burn::nn::RmsNormConfig::new(module.gamma.dims()[0])
            .with_epsilon(module.epsilon)
            .init(&module.gamma.device());
        burn_module.gamma = module.gamma;
        burn_module
    }
}
