//! [`MultiTensorAdam`]: [`FusedAdam`] for a whole module at once, one fusion operation (and one
//! kernel per chunk of parameters) for every parameter of a step, like PyTorch's
//! `Adam(fused=True)`.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use burn::backend::DispatchTensor;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::grad_clipping::GradientClipping;
use burn::optim::{
    AdamState, AdaptiveMomentumState, GradientsParams, LearningRate, ModuleOptimizer, Optimizer,
    OptimizerRecord,
};
use burn::tensor::Tensor;

use burn::optim::grad_clipping::GradientClippingConfig;

use crate::cube;
use crate::optim::{FusedAdam, FusedAdamConfig};
use crate::sync::lock;

/// Burn's Adam for a whole module, computed by one fusion operation for all parameters of a
/// step: the host registers one operation instead of one per parameter ([`FusedAdam`] through
/// burn's `ModuleOptimizer`) or about fifteen per parameter (burn's `Adam`), and the device runs
/// one kernel per chunk of up to 24 parameters. The update is [`FusedAdam`]'s (the same kernel:
/// burn's `Adam` operation for operation), including its in-place writes into a
/// [`Graphed`](crate::Graphed) module's static parameter buffers where no user tensor can tell.
///
/// Create it with [`FusedAdamConfig::init_multi_tensor`](crate::FusedAdamConfig::init_multi_tensor)
/// and use it like burn's `ModuleOptimizer`: `model = optim.step(lr, model, grads)`. Records are
/// burn's [`OptimizerRecord`] in the layout `ModuleOptimizer` writes for Adam (state per
/// parameter id), so a record saved by either loads into the other.
///
/// Parameters in `f32`, `f16` and `bf16` are fused (moments in the parameter's dtype, as burn's
/// `Adam` keeps them, rounded where burn's `Adam` rounds); parameters of different dtypes share
/// the operation, one launch per dtype. Parameters that cannot be fused (another
/// backend than burn's cubecl one, another dtype, AMSGrad) take [`FusedAdam`]'s per-parameter
/// step, which runs burn's `Adam` for them.
///
/// # Example
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
/// let config = GraphedConfig::new().with_outputs(OutputPolicy::Static);
/// let mut model = Graphed::new(net, Net::forward, sample, &config)?;
/// let mut optim = FusedAdamConfig::new().init_multi_tensor();
/// for step in 0..10 {
///     let x = Tensor::<2>::ones([32, 64], &device) * step as f32;
///     let loss = model.forward(x)?.powi_scalar(2).mean();
///     let grads = GradientsParams::from_grads(loss.backward(), &model);
///     model = optim.step(1e-3, model, grads);
/// }
/// let record = optim.to_record(&model); // loads into burn's ModuleOptimizer with Adam too
/// # let _ = record;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct MultiTensorAdam {
    adam: FusedAdam,
    grad_clipping: Option<GradientClipping>,
    states: HashMap<ParamId, ErasedState>,
    last_batched: usize,
}

impl std::fmt::Debug for MultiTensorAdam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultiTensorAdam")
            .field("adam", &self.adam)
            .field("grad_clipping", &self.grad_clipping.is_some())
            .field("states", &self.states.len())
            .finish()
    }
}

impl FusedAdamConfig {
    /// The multi-tensor module optimizer: the same update as [`init`](Self::init)'s, with one
    /// fused operation for all parameters of a step.
    pub fn init_multi_tensor(&self) -> MultiTensorAdam {
        let clipping = self
            .grad_clipping
            .as_ref()
            .map(GradientClippingConfig::init);
        MultiTensorAdam::new(self.build(), clipping)
    }
}

impl MultiTensorAdam {
    pub(crate) fn new(adam: FusedAdam, grad_clipping: Option<GradientClipping>) -> Self {
        Self {
            adam,
            grad_clipping,
            states: HashMap::new(),
            last_batched: 0,
        }
    }

    /// How many parameters the last [`step`](Self::step) updated in its one fused operation
    /// (the others took the per-parameter step: see the type's documentation).
    pub fn last_batched(&self) -> usize {
        self.last_batched
    }

    /// Updates the parameters of `module` that have a gradient in `grads`, advancing their
    /// state, and returns the module. `lr` is the learning rate of this step.
    pub fn step<M: Module>(
        &mut self,
        lr: LearningRate,
        module: M,
        mut grads: GradientsParams,
    ) -> M {
        let mut gather = Gather {
            optim: self,
            grads: &mut grads,
            lr,
            pending: HashMap::new(),
            batch: cube::AdamBatch::default(),
        };
        let module = module.map(&mut gather);
        let Gather { pending, batch, .. } = gather;
        self.last_batched = pending.len();
        if pending.is_empty() {
            return module;
        }
        let updated = batch.finish();
        module.map(&mut Scatter {
            states: &mut self.states,
            pending,
            updated: updated.into_iter().map(Some).collect(),
        })
    }
}

impl MultiTensorAdam {
    /// The optimizer state of `module`'s parameters as burn's [`OptimizerRecord`], written by
    /// burn's own `ModuleOptimizer` (so it loads into `ModuleOptimizer` with `Adam` or
    /// [`FusedAdam`], and into [`load_record`](Self::load_record)). Takes the module because
    /// burn's record is filled by a step over it: the step is given each state as it is and
    /// leaves the parameters as they are. Reads the moments from the device.
    pub fn to_record<M: Module>(&self, module: &M) -> OptimizerRecord {
        let ids = ParamIds::of(module, |id| self.states.contains_key(&id));
        let queue = ids.ids.iter().map(|id| self.states[id].clone()).collect();
        let relay = Relay(Arc::new(Mutex::new(RelayQueue::Give(queue))));
        let mut writer = ModuleOptimizer::from(relay);
        let _ = writer.step(0.0, module.clone(), ids.zero_grads);
        writer.to_record()
    }

    /// Loads the states of `module`'s parameters from `record`, saved by
    /// [`to_record`](Self::to_record) or by burn's `ModuleOptimizer` with `Adam` or
    /// [`FusedAdam`]. Parameters without a state in the record start from fresh moments, as in
    /// `ModuleOptimizer::load_record`; states of other parameters are ignored.
    pub fn load_record<M: Module>(mut self, module: &M, record: OptimizerRecord) -> Self {
        let ids = ParamIds::of(module, |_| true);
        let relay = Relay(Arc::new(Mutex::new(RelayQueue::Take(Vec::new()))));
        let mut reader = ModuleOptimizer::from(relay.clone()).load_record(record);
        let _ = reader.step(0.0, module.clone(), ids.zero_grads);
        let RelayQueue::Take(states) =
            std::mem::replace(&mut *lock(&relay.0), RelayQueue::Take(Vec::new()))
        else {
            unreachable!("a reading relay only takes")
        };
        self.states = ids
            .ids
            .into_iter()
            .zip(states)
            .filter_map(|(id, state)| Some((id, state?)))
            .collect();
        self
    }
}

/// The parameters of a module in visiting order (burn's `ModuleOptimizer` maps them in the
/// same order), with a zero gradient for each.
struct ParamIds {
    ids: Vec<ParamId>,
    zero_grads: GradientsParams,
}

impl ParamIds {
    fn of<M: Module>(module: &M, keep: impl Fn(ParamId) -> bool) -> Self {
        struct Visit<F> {
            keep: F,
            ids: ParamIds,
        }
        impl<F: Fn(ParamId) -> bool> ModuleVisitor for Visit<F> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if (self.keep)(param.id) {
                    self.ids.ids.push(param.id);
                    let zeros = param.val().inner().zeros_like();
                    self.ids.zero_grads.register(param.id, zeros);
                }
            }
        }
        let mut visit = Visit {
            keep,
            ids: ParamIds {
                ids: Vec::new(),
                zero_grads: GradientsParams::new(),
            },
        };
        module.visit(&mut visit);
        visit.ids
    }
}

/// What a [`Relay`] does with the states burn's `ModuleOptimizer` steps through it.
enum RelayQueue {
    /// Hands these states out, one per step, in order (writing a record).
    Give(std::collections::VecDeque<ErasedState>),
    /// Keeps the state each step is given (reading a record).
    Take(Vec<Option<ErasedState>>),
}

/// A per-parameter optimizer that changes no parameter and only moves states between burn's
/// `ModuleOptimizer` (which writes and reads records) and a [`MultiTensorAdam`].
#[derive(Clone)]
struct Relay(Arc<Mutex<RelayQueue>>);

impl Optimizer for Relay {
    type State<const D: usize> = AdamState<D>;

    fn step<const D: usize>(
        &self,
        _lr: LearningRate,
        tensor: Tensor<D>,
        _grad: Tensor<D>,
        state: Option<AdamState<D>>,
    ) -> (Tensor<D>, Option<AdamState<D>>) {
        match &mut *lock(&self.0) {
            RelayQueue::Give(queue) => {
                let given = queue.pop_front().and_then(ErasedState::take::<D>);
                (tensor, given)
            }
            RelayQueue::Take(states) => {
                states.push(state.map(ErasedState::new));
                (tensor, None)
            }
        }
    }

    fn to_device<const D: usize>(
        state: AdamState<D>,
        device: &burn::tensor::Device,
    ) -> AdamState<D> {
        <FusedAdam as Optimizer>::to_device(state, device)
    }
}

/// A parameter's [`AdamState`], of any rank. Shared by clones of the optimizer until one of
/// them steps (the step then writes new moments: `Dense::owned` copies a shared buffer).
#[derive(Clone)]
struct ErasedState(Arc<dyn Any + Send + Sync>);

impl ErasedState {
    fn new<const D: usize>(state: AdamState<D>) -> Self {
        Self(Arc::new(state))
    }

    /// The state, if it is an Adam state of rank `D`.
    fn take<const D: usize>(self) -> Option<AdamState<D>> {
        let value = self.0.downcast::<AdamState<D>>().ok()?;
        Some(Arc::try_unwrap(value).unwrap_or_else(|shared| (*shared).clone()))
    }
}

/// How a parameter was marked before the step (burn's `ModuleOptimizer` restores the same).
struct Marks {
    require_grad: bool,
    distributed: bool,
    checkpointing: Option<burn::tensor::GradientCheckpointingStrategy>,
}

impl Marks {
    fn of<const D: usize>(tensor: &Tensor<D>) -> Self {
        Self {
            require_grad: tensor.is_require_grad(),
            distributed: tensor.is_distributed(),
            checkpointing: tensor.gradient_checkpointing_strategy(),
        }
    }

    fn restore<const D: usize>(&self, updated: Tensor<D>, id: ParamId) -> Tensor<D> {
        let mut tensor = Tensor::from_inner(updated);
        if let Some(strategy) = self.checkpointing {
            tensor = tensor.with_gradient_checkpointing_strategy(strategy);
        }
        if self.require_grad {
            tensor = tensor.require_grad();
        }
        if self.distributed {
            tensor = tensor.set_distributed(id);
        }
        tensor
    }
}

/// A parameter gathered into the batch: its marks and step number, and its index in the batch.
struct Pending {
    marks: Marks,
    time: usize,
    index: usize,
}

/// First pass: takes each parameter's gradient and state; gathers the fusable ones into the
/// batch (the module keeps a stand-in of the same shape until the second pass) and steps
/// the others one by one.
struct Gather<'a> {
    optim: &'a mut MultiTensorAdam,
    grads: &'a mut GradientsParams,
    lr: LearningRate,
    pending: HashMap<ParamId, Pending>,
    batch: cube::AdamBatch,
}

impl ModuleMapper for Gather<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(grad) = self.grads.remove::<D>(id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let marks = Marks::of(&tensor);
        let tensor = tensor.inner();
        let grad = match &self.optim.grad_clipping {
            Some(clipping) => clipping.clip_gradient(grad),
            None => grad,
        };
        let device = tensor.device();
        let state = self
            .optim
            .states
            .remove(&id)
            .and_then(ErasedState::take::<D>)
            .map(|state| <FusedAdam as Optimizer>::to_device(state, &device));
        let gathered = match &self.optim.adam.fused {
            Some(adam) => self.batch.gather(adam, self.lr, tensor, grad, state),
            None => Err(Box::new((tensor, grad, state))),
        };
        let (tensor, grad, state) = match gathered {
            Ok((stand_in, time)) => {
                let index = self.pending.len();
                self.pending.insert(id, Pending { marks, time, index });
                return Param::from_mapped_value(id, stand_in, mapper);
            }
            Err(unfused) => *unfused,
        };
        let (tensor, state) = self.optim.adam.step(self.lr, tensor, grad, state);
        if let Some(state) = state {
            self.optim.states.insert(id, ErasedState::new(state));
        }
        Param::from_mapped_value(id, marks.restore(tensor, id), mapper)
    }
}

/// Second pass: puts the batch's new parameters and moments in place of the stand-ins.
struct Scatter<'a> {
    states: &'a mut HashMap<ParamId, ErasedState>,
    pending: HashMap<ParamId, Pending>,
    /// Per gathered parameter: the new parameter and the two moments.
    updated: Vec<Option<[DispatchTensor; 3]>>,
}

impl ModuleMapper for Scatter<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let pending = self.pending.remove(&param.id);
        let updated = pending.and_then(|p| Some((self.updated.get_mut(p.index)?.take()?, p)));
        let Some(([new_param, moment_1, moment_2], pending)) = updated else {
            return param;
        };
        let (id, stand_in, mapper) = param.consume();
        drop(stand_in);
        let momentum = AdaptiveMomentumState::new(
            pending.time,
            Tensor::<D>::from_dispatch(moment_1),
            Tensor::<D>::from_dispatch(moment_2),
        );
        self.states
            .insert(id, ErasedState::new(AdamState::new(momentum)));
        let new_param = Tensor::<D>::from_dispatch(new_param);
        Param::from_mapped_value(id, pending.marks.restore(new_param, id), mapper)
    }
}
