//! Softmax cross-entropy: burn-nn's `CrossEntropyLoss` with a fused forward and backward.

use burn::config::Config;
use burn::module::Module;
use burn::tensor::{DType, Device, Int, IntDType, Tensor};

use crate::cube;

/// Configuration of a [`CrossEntropyLoss`]: burn-nn's `CrossEntropyLossConfig`, field for field.
#[derive(Config, Debug)]
pub struct CrossEntropyLossConfig {
    /// Target values that add nothing to the loss (padding).
    pub pad_tokens: Option<Vec<usize>>,
    /// A weight per class.
    pub weights: Option<Vec<f32>>,
    /// Label smoothing, in `[0, 1]`.
    pub smoothing: Option<f32>,
    /// The inputs are logits (else probabilities).
    #[config(default = true)]
    pub logits: bool,
}

impl CrossEntropyLossConfig {
    /// The loss (burn-nn's checks: smoothing in `[0, 1]`, positive weights).
    ///
    /// # Panics
    ///
    /// As burn-nn's: on a smoothing outside `[0, 1]` or a weight that is not positive.
    pub fn init(&self, device: &Device) -> CrossEntropyLoss {
        let burn = burn::nn::loss::CrossEntropyLossConfig {
            pad_tokens: self.pad_tokens.clone(),
            weights: self.weights.clone(),
            smoothing: self.smoothing,
            logits: self.logits,
        }
        .init(device);
        CrossEntropyLoss::from(burn)
    }
}

/// burn-nn's `CrossEntropyLoss` (the same fields) whose default form (logits, no padding, no
/// weights, no smoothing) runs one kernel forward and one backward on burn's cubecl backends:
/// each row's `logsumexp(x) - x[target]` computed in `f32` and rounded once to the logits'
/// dtype, then their mean. Every other form, and other backends, run burn-nn's computation.
///
/// A target outside `0..classes` makes the loss NaN on the fused path (the device cannot stop
/// the step, and a graph cannot read the targets back to check them).
#[derive(Module, Debug)]
pub struct CrossEntropyLoss {
    /// Target values that add nothing to the loss (padding).
    pub pad_tokens: Option<Vec<usize>>,
    /// A weight per class.
    pub weights: Option<Tensor<1>>,
    /// Label smoothing.
    pub smoothing: Option<f32>,
    /// The inputs are logits (else probabilities).
    pub logits: bool,
}

impl From<burn::nn::loss::CrossEntropyLoss> for CrossEntropyLoss {
    fn from(loss: burn::nn::loss::CrossEntropyLoss) -> Self {
        Self {
            pad_tokens: loss.pad_tokens,
            weights: loss.weights,
            smoothing: loss.smoothing,
            logits: loss.logits,
        }
    }
}

impl From<CrossEntropyLoss> for burn::nn::loss::CrossEntropyLoss {
    fn from(loss: CrossEntropyLoss) -> Self {
        Self {
            pad_tokens: loss.pad_tokens,
            weights: loss.weights,
            smoothing: loss.smoothing,
            logits: loss.logits,
        }
    }
}

impl CrossEntropyLoss {
    /// The mean cross-entropy of `logits` (`[rows, classes]`) against `targets` (`[rows]`).
    ///
    /// # Panics
    ///
    /// As burn-nn's: when `targets` is not `[rows]`.
    pub fn forward(&self, logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
        let [rows, classes] = logits.dims();
        assert_eq!(
            targets.dims(),
            [rows],
            "cross-entropy: targets must be [{rows}] for logits of shape [{rows}, {classes}]"
        );
        let default_form = self.logits
            && self.pad_tokens.is_none()
            && self.weights.is_none()
            && self.smoothing.is_none();
        if default_form
            && rows > 0
            && classes > 0
            && matches!(logits.dtype(), DType::F32 | DType::F16 | DType::BF16)
            && cube::supports_graphs(&logits.device())
        {
            let targets = targets.cast(IntDType::I32);
            match cube::cross_entropy_rows(logits.into_dispatch(), targets.into_dispatch()) {
                Ok(rows) => return Tensor::<1>::from_dispatch(rows).mean(),
                Err(inputs) => {
                    let (logits, targets) = *inputs;
                    return self.composed(
                        Tensor::from_dispatch(logits),
                        Tensor::from_dispatch(targets),
                    );
                }
            }
        }
        self.composed(logits, targets)
    }

    /// burn-nn's computation.
    fn composed(&self, logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
        burn::nn::loss::CrossEntropyLoss::from(self.clone()).forward(logits, targets)
    }
}
