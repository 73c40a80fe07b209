//! What a whole-step graph's optimizer is: burn's Adam, AdamW or SGD (their constants), the
//! optional gradient clipping, and the values the host writes into the graph's schedule for a
//! learning rate.

use burn::config::Config;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::optim::grad_clipping::{GradientClipping, GradientClippingConfig};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, ModuleOptimizer, SgdConfig, decay::WeightDecayConfig};
use burn::tensor::Tensor;

use crate::error::GraphedError;

/// SGD's momentum, as burn's [`MomentumConfig`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdMomentum {
    /// Momentum factor.
    pub momentum: f32,
    /// Dampening of the gradient's contribution.
    pub dampening: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

/// The optimizer of a [`GraphedStep`](crate::GraphedStep): one of burn's, with burn's
/// arithmetic. Build it from burn's config (`AdamConfig::new().try_into()?`) or directly.
///
/// Its constants are compiled into the captured graph; the learning rate is not (it is written
/// into a device buffer before each replay, so schedules need no new capture).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepOptimizer {
    /// burn's `Adam` (weight decay as an L2 penalty added to the gradient).
    Adam {
        /// Decay of the first moment.
        beta_1: f32,
        /// Decay of the second moment.
        beta_2: f32,
        /// Added to the denominator.
        epsilon: f32,
        /// L2 penalty.
        weight_decay: Option<f32>,
    },
    /// burn's `AdamW` (decoupled weight decay).
    AdamW {
        /// Decay of the first moment.
        beta_1: f32,
        /// Decay of the second moment.
        beta_2: f32,
        /// Added to the denominator.
        epsilon: f32,
        /// Decoupled weight decay.
        weight_decay: f32,
    },
    /// burn's `Sgd`.
    Sgd {
        /// Momentum, if any.
        momentum: Option<SgdMomentum>,
        /// L2 penalty.
        weight_decay: Option<f32>,
    },
}

/// burn's configuration of a [`StepOptimizer`] ([`StepOptimizer::burn_config`]).
#[derive(Debug, Clone)]
pub enum BurnConfig {
    /// burn's Adam.
    Adam(AdamConfig),
    /// burn's AdamW.
    AdamW(AdamWConfig),
    /// burn's SGD.
    Sgd(SgdConfig),
}

/// Gradient clipping of a whole step, computed on the device (no host synchronization).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Clipping {
    /// burn's `GradientClipping::Value`: each element clamped to `[-value, value]`.
    Value(f32),
    /// burn's `GradientClipping::Norm`: each parameter's gradient scaled so that its own L2
    /// norm is at most the value.
    Norm(f32),
    /// PyTorch's `clip_grad_norm_`: every gradient scaled by one factor so that the L2 norm of
    /// all gradients together is at most the value.
    GlobalNorm(f32),
}

impl Clipping {
    /// burn's clipping of the same name; `None` for [`GlobalNorm`](Self::GlobalNorm), which
    /// burn does not have.
    pub fn to_burn(self) -> Option<GradientClipping> {
        match self {
            Clipping::Value(value) => Some(GradientClipping::Value(value)),
            Clipping::Norm(norm) => Some(GradientClipping::Norm(norm)),
            Clipping::GlobalNorm(_) => None,
        }
    }

    fn from_burn(config: &GradientClippingConfig) -> Self {
        match *config {
            GradientClippingConfig::Value(value) => Clipping::Value(value),
            GradientClippingConfig::Norm(norm) => Clipping::Norm(norm),
        }
    }
}

impl StepOptimizer {
    /// burn's configuration of the same optimizer with the same constants.
    pub fn burn_config(&self) -> BurnConfig {
        match *self {
            StepOptimizer::Adam {
                beta_1,
                beta_2,
                epsilon,
                weight_decay,
            } => BurnConfig::Adam(
                AdamConfig::new()
                    .with_beta_1(beta_1)
                    .with_beta_2(beta_2)
                    .with_epsilon(epsilon)
                    .with_weight_decay(weight_decay.map(WeightDecayConfig::new)),
            ),
            StepOptimizer::AdamW {
                beta_1,
                beta_2,
                epsilon,
                weight_decay,
            } => BurnConfig::AdamW(
                AdamWConfig::new()
                    .with_beta_1(beta_1)
                    .with_beta_2(beta_2)
                    .with_epsilon(epsilon)
                    .with_weight_decay(weight_decay),
            ),
            StepOptimizer::Sgd {
                momentum,
                weight_decay,
            } => BurnConfig::Sgd(
                SgdConfig::new()
                    .with_momentum(momentum.map(|m| {
                        MomentumConfig::new()
                            .with_momentum(f64::from(m.momentum))
                            .with_dampening(m.dampening)
                            .with_nesterov(m.nesterov)
                    }))
                    .with_weight_decay(weight_decay.map(WeightDecayConfig::new)),
            ),
        }
    }

    /// burn's optimizer with the same constants (and `clipping`, where burn has it), for eager
    /// steps where graphs cannot run, and as the reference of the equivalence tests.
    pub fn to_burn(&self, clipping: Option<Clipping>) -> ModuleOptimizer {
        let optimizer = match self.burn_config() {
            BurnConfig::Adam(config) => config.init(),
            BurnConfig::AdamW(config) => config.init(),
            BurnConfig::Sgd(config) => config.init(),
        };
        match clipping.and_then(Clipping::to_burn) {
            Some(clipping) => optimizer.with_grad_clipping(clipping),
            None => optimizer,
        }
    }

    /// The schedule words that depend on the learning rate, as burn-optim computes them: the
    /// rate as the kernels' `f32`, and AdamW's decay factor `1 - lr * weight_decay` (in `f64`,
    /// rounded once).
    // Without cubecl no graph reads them (the unit tests do).
    #[cfg_attr(not(feature = "cube"), allow(dead_code))]
    pub(crate) fn schedule_for(&self, lr: f64) -> (f32, f32) {
        let keep = match *self {
            StepOptimizer::AdamW { weight_decay, .. } => {
                (1.0 - lr * f64::from(weight_decay)) as f32
            }
            _ => 1.0,
        };
        (lr as f32, keep)
    }
}

/// `grads` scaled by PyTorch's `clip_grad_norm_` factor, `max_norm / (norm + 1e-6)` clamped to
/// 1, the norm over every gradient of `model`'s float parameters: [`Clipping::GlobalNorm`] for
/// steps outside graphs. Tensor operations only: nothing is read on the host.
pub fn clip_grad_norm<M: Module>(
    model: &M,
    grads: GradientsParams,
    max_norm: f32,
) -> GradientsParams {
    struct Norm<'a>(&'a GradientsParams, Option<Tensor<1>>);
    impl ModuleVisitor for Norm<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.0.get::<D>(param.id) {
                let n = grad.shape().num_elements();
                let sum = grad.reshape([n]).square().sum();
                self.1 = Some(match self.1.take() {
                    Some(total) => total + sum,
                    None => sum,
                });
            }
        }
    }
    struct Scale(GradientsParams, Tensor<1>);
    impl ModuleVisitor for Scale {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.0.remove::<D>(param.id) {
                let factor = self.1.clone().reshape([1; D]);
                self.0.register(param.id, grad * factor);
            }
        }
    }
    let mut norm = Norm(&grads, None);
    model.visit(&mut norm);
    let Some(total) = norm.1 else {
        return grads;
    };
    let factor = (max_norm / total.sqrt().add_scalar(1e-6)).clamp_max(1.0);
    let mut scale = Scale(grads, factor);
    model.visit(&mut scale);
    scale.0
}

/// A field of a burn optimizer config, read through its serialized form (burn's configs keep
/// their fields private).
fn field(json: &serde_json::Value, name: &str) -> Option<serde_json::Value> {
    json.get(name).cloned().filter(|v| !v.is_null())
}

fn f32_field(json: &serde_json::Value, name: &str) -> Result<f32, GraphedError> {
    field(json, name)
        .and_then(|v| v.as_f64())
        .map(|v| v as f32)
        .ok_or_else(|| unsupported_config(format!("no number `{name}`")))
}

fn flag(json: &serde_json::Value, name: &str) -> bool {
    field(json, name).and_then(|v| v.as_bool()).unwrap_or(false)
}

fn penalty(json: &serde_json::Value) -> Result<Option<f32>, GraphedError> {
    field(json, "weight_decay")
        .map(|decay| {
            serde_json::from_value::<WeightDecayConfig>(decay)
                .map(|d| d.penalty)
                .map_err(|e| unsupported_config(format!("weight_decay: {e}")))
        })
        .transpose()
}

fn clipping(json: &serde_json::Value, name: &str) -> Result<Option<Clipping>, GraphedError> {
    field(json, name)
        .map(|value| {
            serde_json::from_value::<GradientClippingConfig>(value)
                .map(|c| Clipping::from_burn(&c))
                .map_err(|e| unsupported_config(format!("{name}: {e}")))
        })
        .transpose()
}

fn unsupported_config(detail: String) -> GraphedError {
    GraphedError::InvalidArgument {
        argument: "optimizer",
        detail,
    }
}

fn to_json<C: Config>(config: &C) -> Result<serde_json::Value, GraphedError> {
    serde_json::to_value(config).map_err(|e| unsupported_config(e.to_string()))
}

/// A burn optimizer config as a whole-step optimizer and its gradient clipping.
pub trait IntoStepOptimizer {
    /// The optimizer and clipping, or [`GraphedError::InvalidArgument`] naming `optimizer` for
    /// what whole-step graphs do not run (AMSGrad, cautious weight decay).
    fn into_step_optimizer(self) -> Result<(StepOptimizer, Option<Clipping>), GraphedError>;
}

impl IntoStepOptimizer for StepOptimizer {
    fn into_step_optimizer(self) -> Result<(StepOptimizer, Option<Clipping>), GraphedError> {
        Ok((self, None))
    }
}

impl IntoStepOptimizer for (StepOptimizer, Clipping) {
    fn into_step_optimizer(self) -> Result<(StepOptimizer, Option<Clipping>), GraphedError> {
        Ok((self.0, Some(self.1)))
    }
}

impl IntoStepOptimizer for (StepOptimizer, Option<Clipping>) {
    fn into_step_optimizer(self) -> Result<(StepOptimizer, Option<Clipping>), GraphedError> {
        Ok(self)
    }
}

impl IntoStepOptimizer for &AdamConfig {
    fn into_step_optimizer(self) -> Result<(StepOptimizer, Option<Clipping>), GraphedError> {
        let json = to_json(self)?;
        if flag(&json, "amsgrad") {
            return Err(unsupported_config(
                "AMSGrad is not run by whole-step graphs (expected amsgrad = false)".into(),
            ));
        }
        Ok((
            StepOptimizer::Adam {
                beta_1: f32_field(&json, "beta_1")?,
                beta_2: f32_field(&json, "beta_2")?,
                epsilon: f32_field(&json, "epsilon")?,
                weight_decay: penalty(&json)?,
            },
            clipping(&json, "grad_clipping")?,
        ))
    }
}

impl IntoStepOptimizer for &AdamWConfig {
    fn into_step_optimizer(self) -> Result<(StepOptimizer, Option<Clipping>), GraphedError> {
        let json = to_json(self)?;
        if flag(&json, "amsgrad") || flag(&json, "cautious_weight_decay") {
            return Err(unsupported_config(
                "AMSGrad and cautious weight decay are not run by whole-step graphs (expected \
                 both false)"
                    .into(),
            ));
        }
        Ok((
            StepOptimizer::AdamW {
                beta_1: f32_field(&json, "beta_1")?,
                beta_2: f32_field(&json, "beta_2")?,
                epsilon: f32_field(&json, "epsilon")?,
                weight_decay: f32_field(&json, "weight_decay")?,
            },
            clipping(&json, "grad_clipping")?,
        ))
    }
}

impl IntoStepOptimizer for &SgdConfig {
    fn into_step_optimizer(self) -> Result<(StepOptimizer, Option<Clipping>), GraphedError> {
        let json = to_json(self)?;
        let momentum = field(&json, "momentum")
            .map(|m| {
                serde_json::from_value::<MomentumConfig>(m)
                    .map_err(|e| unsupported_config(format!("momentum: {e}")))
            })
            .transpose()?;
        Ok((
            StepOptimizer::Sgd {
                momentum: momentum.map(|m| SgdMomentum {
                    momentum: m.momentum as f32,
                    dampening: m.dampening,
                    nesterov: m.nesterov,
                }),
                weight_decay: penalty(&json)?,
            },
            clipping(&json, "gradient_clipping")?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burn_configs_convert_with_their_constants() {
        let (adam, clip) = (&AdamConfig::new()
            .with_beta_1(0.8)
            .with_weight_decay(Some(WeightDecayConfig::new(0.01)))
            .with_grad_clipping(Some(GradientClippingConfig::Norm(1.5))))
            .into_step_optimizer()
            .unwrap();
        assert_eq!(
            adam,
            StepOptimizer::Adam {
                beta_1: 0.8,
                beta_2: 0.999,
                epsilon: 1e-5,
                weight_decay: Some(0.01)
            }
        );
        assert_eq!(clip, Some(Clipping::Norm(1.5)));
        let (sgd, _) = (&SgdConfig::new().with_momentum(Some(
            MomentumConfig::new().with_momentum(0.9).with_nesterov(true),
        )))
            .into_step_optimizer()
            .unwrap();
        assert!(matches!(
            sgd,
            StepOptimizer::Sgd {
                momentum: Some(SgdMomentum { nesterov: true, .. }),
                weight_decay: None
            }
        ));
        let (adamw, _) = (&AdamWConfig::new()).into_step_optimizer().unwrap();
        assert!(matches!(adamw, StepOptimizer::AdamW { weight_decay, .. } if weight_decay == 1e-4));
    }

    #[test]
    fn amsgrad_is_refused_naming_the_argument() {
        let error = (&AdamConfig::new().with_amsgrad(true))
            .into_step_optimizer()
            .unwrap_err();
        assert!(error.to_string().contains("optimizer"), "{error}");
        assert!(error.to_string().contains("AMSGrad"), "{error}");
    }

    #[test]
    fn adamw_decay_factor_is_computed_in_f64() {
        let adamw = StepOptimizer::AdamW {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-5,
            weight_decay: 0.01,
        };
        assert_eq!(
            adamw.schedule_for(1e-3),
            (1e-3f64 as f32, (1.0 - 1e-5f64) as f32)
        );
    }
}
