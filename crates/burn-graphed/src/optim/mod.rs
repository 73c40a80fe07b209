//! [`FusedAdam`]: burn's Adam as one kernel per parameter, updating a graph's static parameter
//! buffers in place (PyTorch's `Adam(fused=True)` on captured parameters).

pub(crate) mod multi_adam;

use burn::config::Config;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::{Adam, AdamConfig, AdamState, LearningRate, ModuleOptimizer, Optimizer};
use burn::tensor::{Device, Tensor};

use crate::cube;
use crate::step_optim::StepOptimizer;

/// Configuration of [`FusedAdam`]: the same fields and defaults as burn's
/// [`AdamConfig`].
#[derive(Config, Debug)]
pub struct FusedAdamConfig {
    /// Decay of the first moment.
    #[config(default = 0.9)]
    pub beta_1: f32,
    /// Decay of the second moment.
    #[config(default = 0.999)]
    pub beta_2: f32,
    /// Added to the denominator for numerical stability.
    #[config(default = 1e-5)]
    pub epsilon: f32,
    /// AMSGrad. Not fused: every step then runs burn's `Adam`.
    #[config(default = false)]
    pub amsgrad: bool,
    /// L2 weight decay, as burn's `Adam` applies it (added to the gradient).
    pub weight_decay: Option<WeightDecayConfig>,
    /// Gradient clipping, applied by the [`ModuleOptimizer`] before the update.
    pub grad_clipping: Option<GradientClippingConfig>,
}

impl FusedAdamConfig {
    /// The per-parameter optimizer, for [`ModuleOptimizer::from`] or
    /// [`ModuleOptimizer::with_group`].
    pub fn build(&self) -> FusedAdam {
        let mut reference = AdamConfig::new()
            .with_beta_1(self.beta_1)
            .with_beta_2(self.beta_2)
            .with_epsilon(self.epsilon)
            .with_amsgrad(self.amsgrad);
        if let Some(decay) = &self.weight_decay {
            reference = reference.with_weight_decay(Some(decay.clone()));
        }
        // AMSGrad keeps a third moment the update kernel does not: burn's `Adam` runs then.
        let fused = (!self.amsgrad).then_some(StepOptimizer::Adam {
            beta_1: self.beta_1,
            beta_2: self.beta_2,
            epsilon: self.epsilon,
            weight_decay: self.weight_decay.as_ref().map(|decay| decay.penalty),
        });
        FusedAdam {
            fused,
            reference: reference.build(),
        }
    }

    /// The module optimizer, used exactly like the one [`AdamConfig::init`] returns:
    /// `model = optim.step(lr, model, grads)`. One fused operation per parameter; see
    /// [`init_multi_tensor`](Self::init_multi_tensor) for one per step.
    pub fn init(&self) -> ModuleOptimizer {
        let optim = ModuleOptimizer::from(self.build());
        match &self.grad_clipping {
            Some(clipping) => optim.with_grad_clipping(clipping.init()),
            None => optim,
        }
    }
}

/// Burn's Adam, computed by one kernel per parameter instead of about fifteen tensor
/// operations, and writing into a graph's static parameter buffer in place where it can.
///
/// A drop-in replacement for burn's `Adam`: the same update (burn's operations in burn's order,
/// rounded to the parameter's dtype where burn rounds: the kernel of
/// [`MultiTensorAdam`](crate::MultiTensorAdam) and of a [`GraphedStep`](crate::GraphedStep)'s
/// Adam; bit for bit where the compiler contracts multiply-adds as in burn's kernel, else
/// within a rounding per step), the same state type ([`AdamState`], so records load in
/// either), the same use through [`ModuleOptimizer`]. Create it with [`FusedAdamConfig::init`].
///
/// # In place, and only where nobody can tell
///
/// When a parameter's values are in the static buffer of a [`Graphed`](crate::Graphed) module
/// (the forward replay copied them there, or the previous step wrote them there), the update
/// is written into that buffer and the returned parameter is a tensor over it: the next
/// replay needs no parameter copy. This happens only when no user tensor can observe the
/// buffer change: the parameter tensor given to the step is not held anywhere else (fusion's
/// own rule for in-place kernels), the graph's backward is not pending, and the step runs on
/// the capturing thread. A clone of the module kept across a step (a snapshot) therefore keeps
/// its values: the step then writes a new buffer, and the graphed module runs eagerly
/// ([`EagerReason::ParamBufferAliased`](crate::EagerReason::ParamBufferAliased)) until
/// the snapshot is dropped.
///
/// Parameters in `f32`, `f16` and `bf16` are updated by the same kernel instantiated for their
/// dtype, with gradients and moments in that dtype (as burn's `Adam` keeps them), rounding
/// where burn's `Adam` rounds. On other backends, other dtypes, and with AMSGrad, every step
/// runs burn's `Adam`.
///
/// # Example
///
/// The loop of a graphed model, with `FusedAdam` and outputs handed out without copies
/// ([`OutputPolicy::Guarded`](crate::OutputPolicy::Guarded)): no copy of any kind per step
/// but the input's.
///
/// ```no_run
/// use burn::nn::{Linear, LinearConfig};
/// use burn::optim::GradientsParams;
/// use burn::prelude::*;
/// use burn_graphed::{FusedAdamConfig, Graphed, GraphedConfig, OutputPolicy};
///
/// #[derive(Module, Debug)]
/// struct Net {
///     layer: Linear,
/// }
///
/// impl Net {
///     fn forward(&self, x: Tensor<2>) -> Tensor<2> {
///         self.layer.forward(x)
///     }
/// }
///
/// # fn main() -> Result<(), burn_graphed::GraphedError> {
/// let device = Device::default().autodiff();
/// let net = Net { layer: LinearConfig::new(64, 64).init(&device) };
/// let sample = Tensor::<2>::zeros([32, 64], &device);
/// let config = GraphedConfig::new().with_outputs(OutputPolicy::Guarded);
/// let mut model = Graphed::new(net, Net::forward, sample, &config)?;
/// let mut optim = FusedAdamConfig::new().init();
/// for step in 0..10 {
///     let x = Tensor::<2>::ones([32, 64], &device) * step as f32;
///     let loss = model.forward(x)?.powi_scalar(2).mean();
///     let grads = GradientsParams::from_grads(loss.backward(), &model);
///     // The model moves into the step (no clone), so the update can go in place.
///     model = optim.step(1e-3, model, grads);
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct FusedAdam {
    /// The update kernel's optimizer (burn's Adam), or `None` where it cannot run (AMSGrad).
    pub(crate) fused: Option<StepOptimizer>,
    reference: Adam,
}

impl std::fmt::Debug for FusedAdam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FusedAdam")
            .field("fused", &self.fused)
            .finish_non_exhaustive()
    }
}

impl Optimizer for FusedAdam {
    type State<const D: usize> = AdamState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let (tensor, grad, state) = match &self.fused {
            Some(adam) => match cube::adam_step(adam, lr, tensor, grad, state) {
                Ok(updated) => return updated,
                Err(unfused) => *unfused,
            },
            None => (tensor, grad, state),
        };
        self.reference.step(lr, tensor, grad, state)
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        <Adam as Optimizer>::to_device(state, device)
    }
}
