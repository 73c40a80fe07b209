//! A whole step's parameters as burn's module (`module`, `load_module`) and its optimizer state
//! as burn's [`OptimizerRecord`] and back: the record that burn's own `ModuleOptimizer` for the
//! same optimizer writes and reads, so that training can move between a [`GraphedStep`] and
//! eager burn in both directions.
//!
//! burn keeps its per-parameter states private to `ModuleOptimizer`, which alone writes and
//! reads records. So both directions go through a `ModuleOptimizer` of a stand-in optimizer
//! whose state type is burn's (`AdamState`, `AdamWState`, `SgdState`): exporting, its step
//! hands each parameter the state built from the graphs' buffers, and the record is then
//! burn's; importing, the record is loaded and its step hands each state out.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use burn::backend::ops::FloatTensorOps;
use burn::backend::{AutodiffBackend, Dispatch, DispatchTensor};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{
    AdamState, AdamWState, AdaptiveMomentumState, GradientsParams, LearningRate, ModuleOptimizer,
    Optimizer, OptimizerRecord, RecordState, SgdState, StateSink, momentum::MomentumState,
};
use burn::tensor::{Device, Tensor, TensorData};

use super::GraphedStep;
use crate::error::GraphedError;
use crate::params;
use crate::step_optim::StepOptimizer;
use crate::sync::lock;
use crate::tensors::{FlatTensor, TensorGroup};

/// One parameter's optimizer state as the graphs hold it: its state tensors (the moments, or
/// the velocity) and the updates done.
pub(crate) struct StateParts {
    pub tensors: Vec<DispatchTensor>,
    pub time: usize,
}

/// One parameter's state read from a record: its tensors' values and the updates done.
pub(crate) struct ImportedState {
    pub tensors: Vec<TensorData>,
    pub time: usize,
}

/// burn's state type of each optimizer kind, built from and broken into [`StateParts`].
trait Kind: Send + Sync + Clone + 'static {
    type State<const D: usize>: Clone + RecordState;
    fn build<const D: usize>(tensors: Vec<Tensor<D>>, time: usize) -> Self::State<D>;
}

#[derive(Clone)]
struct AdamKind;
#[derive(Clone)]
struct AdamWKind;
#[derive(Clone)]
struct SgdKind;

impl Kind for AdamKind {
    type State<const D: usize> = AdamState<D>;
    fn build<const D: usize>(tensors: Vec<Tensor<D>>, time: usize) -> AdamState<D> {
        let [moment_1, moment_2] = moments(tensors);
        AdamState::new(AdaptiveMomentumState::new(time, moment_1, moment_2))
    }
}

impl Kind for AdamWKind {
    type State<const D: usize> = AdamWState<D>;
    fn build<const D: usize>(tensors: Vec<Tensor<D>>, time: usize) -> AdamWState<D> {
        let [moment_1, moment_2] = moments(tensors);
        AdamWState::new(AdaptiveMomentumState::new(time, moment_1, moment_2))
    }
}

impl Kind for SgdKind {
    type State<const D: usize> = SgdState<D>;
    fn build<const D: usize>(tensors: Vec<Tensor<D>>, _time: usize) -> SgdState<D> {
        SgdState::new(tensors.into_iter().next().map(MomentumState::new))
    }
}

/// The two moments of an Adam state (the engine keeps two per parameter for Adam and AdamW).
fn moments<const D: usize>(tensors: Vec<Tensor<D>>) -> [Tensor<D>; 2] {
    let mut tensors = tensors.into_iter();
    match (tensors.next(), tensors.next()) {
        (Some(first), Some(second)) => [first, second],
        // Not reached: the engine keeps two state buffers per parameter for Adam and AdamW.
        (first, _) => {
            let first = first.expect("an Adam state has its first moment");
            [first.clone(), first]
        }
    }
}

/// The stand-in optimizer: exporting, hands out the queued states; importing, collects the
/// states it is given. Parameters are stepped in visiting order.
#[derive(Clone)]
struct Relay<K> {
    export: Arc<Mutex<VecDeque<StateParts>>>,
    import: Arc<Mutex<Vec<Option<ImportedState>>>>,
    _kind: std::marker::PhantomData<K>,
}

impl<K> Relay<K> {
    fn new(export: VecDeque<StateParts>) -> Self {
        Self {
            export: Arc::new(Mutex::new(export)),
            import: Arc::new(Mutex::new(Vec::new())),
            _kind: std::marker::PhantomData,
        }
    }
}

impl<K: Kind> Optimizer for Relay<K> {
    type State<const D: usize> = K::State<D>;

    fn step<const D: usize>(
        &self,
        _lr: LearningRate,
        tensor: Tensor<D>,
        _grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        lock(&self.import).push(state.as_ref().map(|state| {
            let mut sink = StateSink::default();
            state.state_flatten("", &mut sink);
            let time = sink
                .scalars
                .iter()
                .find(|(name, _)| name.ends_with("time"))
                .and_then(|(_, value)| usize::try_from(*value).ok())
                .unwrap_or(1);
            ImportedState {
                tensors: sink.tensors.into_iter().map(|(_, data)| data).collect(),
                time,
            }
        }));
        let exported = lock(&self.export).pop_front().map(|parts| {
            let tensors = parts
                .tensors
                .into_iter()
                .map(Tensor::from_dispatch)
                .collect();
            K::build::<D>(tensors, parts.time)
        });
        (tensor, exported.or(state))
    }

    fn to_device<const D: usize>(state: Self::State<D>, _device: &Device) -> Self::State<D> {
        state
    }
}

/// A gradient for every float parameter of `model` that requires one (its own values: the
/// stand-in ignores them), so that `ModuleOptimizer` steps each of them, in visiting order.
fn every_param<M: Module>(model: &M) -> GradientsParams {
    struct Every(GradientsParams);
    impl ModuleVisitor for Every {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if param.is_require_grad() {
                self.0.register(param.id, param.val().inner());
            }
        }
    }
    let mut every = Every(GradientsParams::new());
    model.visit(&mut every);
    every.0
}

/// Runs `relay` over every parameter of `model` that requires grad, after `load` (a record to
/// load, when importing); returns the module optimizer (for its record) and what the relay
/// collected.
fn relay<M: Module, K: Kind>(
    model: &M,
    relay: Relay<K>,
    load: Option<OptimizerRecord>,
) -> (ModuleOptimizer, Vec<Option<ImportedState>>) {
    let import = relay.import.clone();
    let mut optimizer = ModuleOptimizer::from(relay);
    if let Some(record) = load {
        optimizer = optimizer.load_record(record);
    }
    let _ = optimizer.step(0.0, model.clone(), every_param(model));
    let collected = std::mem::take(&mut *lock(&import));
    (optimizer, collected)
}

/// burn's record of `optimizer` for `model` whose parameters that require grad (visiting order)
/// have the states `states`.
pub(crate) fn export<M: Module>(
    model: &M,
    optimizer: &StepOptimizer,
    states: Vec<StateParts>,
) -> OptimizerRecord {
    let states: VecDeque<StateParts> = states.into();
    let record = match optimizer {
        StepOptimizer::Adam { .. } => relay(model, Relay::<AdamKind>::new(states), None).0,
        StepOptimizer::AdamW { .. } => relay(model, Relay::<AdamWKind>::new(states), None).0,
        StepOptimizer::Sgd { .. } => relay(model, Relay::<SgdKind>::new(states), None).0,
    };
    record.to_record()
}

/// The states `record` holds for `model`'s parameters that require grad (visiting order;
/// `None` where it holds none), read as burn's `optimizer` would.
///
/// # Errors
///
/// [`GraphedError::InvalidArgument`] naming `record` when the states are not all at the same
/// step, or only some parameters have one.
pub(crate) fn import<M: Module>(
    model: &M,
    optimizer: &StepOptimizer,
    record: OptimizerRecord,
) -> Result<Vec<Option<ImportedState>>, GraphedError> {
    let collected = match optimizer {
        StepOptimizer::Adam { .. } => {
            relay(model, Relay::<AdamKind>::new(VecDeque::new()), Some(record)).1
        }
        StepOptimizer::AdamW { .. } => {
            relay(
                model,
                Relay::<AdamWKind>::new(VecDeque::new()),
                Some(record),
            )
            .1
        }
        StepOptimizer::Sgd { .. } => {
            relay(model, Relay::<SgdKind>::new(VecDeque::new()), Some(record)).1
        }
    };
    let present = collected.iter().filter(|s| s.is_some()).count();
    if present != 0 && present != collected.len() {
        return Err(GraphedError::InvalidArgument {
            argument: "record",
            detail: format!(
                "holds a state for {present} of the {} parameters that train; a whole step \
                 updates all of them at one step count",
                collected.len()
            ),
        });
    }
    let mut times = collected.iter().flatten().map(|s| s.time);
    if let Some(first) = times.next()
        && let Some(other) = times.find(|t| *t != first)
    {
        return Err(GraphedError::InvalidArgument {
            argument: "record",
            detail: format!(
                "holds states at step {first} and at step {other}; a whole step keeps one step \
                 count for every parameter"
            ),
        });
    }
    Ok(collected)
}

impl<M, I> GraphedStep<M, I>
where
    M: Module,
    I: TensorGroup,
{
    /// The model with the current parameters: copies of the graphs' buffers (later steps do
    /// not change it), with the `require_grad` of the model given.
    pub fn module(&self) -> M {
        let Some(state) = self.state.as_ref() else {
            return self.model.clone();
        };
        let values = state.param_values();
        with_values(self.model.clone(), values)
    }

    /// The model with the current parameters, ending the step.
    pub fn into_module(self) -> M {
        self.module()
    }

    /// Makes `model`'s parameters the current ones (a checkpoint loaded, a model assigned
    /// back); the optimizer state is kept.
    ///
    /// # Errors
    ///
    /// [`GraphedError::ParametersChanged`] when `model`'s parameters differ in number, id,
    /// shape or `require_grad`, or its train/eval flags, from the step's model (nothing is
    /// written then).
    pub fn load_module(&mut self, model: M) -> Result<(), GraphedError> {
        let (entries, mode) = params::collect(&model);
        if let Some(detail) = mode.difference(&self.mode) {
            return Err(GraphedError::ParametersChanged { detail });
        }
        if let Some(state) = self.state.as_ref() {
            let values: Vec<_> = entries.into_iter().map(|e| e.tensor.tensor).collect();
            state.load_params(&values)?;
        }
        self.model = model;
        Ok(())
    }

    /// The optimizer state, per float parameter in visiting order: the two moments for Adam
    /// and AdamW, the velocity for SGD with momentum, nothing for plain SGD (copies, without
    /// autodiff). Empty where steps run with burn's optimizer (see its records instead).
    pub fn optimizer_state(&self) -> Vec<Vec<FlatTensor>> {
        let Some(state) = self.state.as_ref() else {
            return Vec::new();
        };
        state
            .state_values()
            .into_iter()
            .map(|states| {
                states
                    .into_iter()
                    .map(|tensor| FlatTensor::from_tensor(Tensor::<1>::from_dispatch(tensor)))
                    .collect()
            })
            .collect()
    }

    /// The optimizer state as burn's [`OptimizerRecord`](burn::optim::OptimizerRecord): the
    /// record that burn's own optimizer of the same kind (`AdamConfig::new().init()`, ...) writes
    /// after the same steps, so that eager burn can load it (`load_record`) and go on.
    pub fn optimizer_record(&self) -> burn::optim::OptimizerRecord {
        let Some(state) = self.state.as_ref() else {
            return self
                .eager
                .as_ref()
                .map(ModuleOptimizer::to_record)
                .unwrap_or_default();
        };
        let steps = state.steps();
        let states = if steps == 0 {
            Vec::new()
        } else {
            let (entries, _) = params::collect(&self.model);
            state
                .state_values()
                .into_iter()
                .zip(entries)
                .filter(|(_, entry)| entry.tensor.require_grad)
                .map(|(tensors, _)| StateParts {
                    tensors,
                    time: steps as usize,
                })
                .collect()
        };
        export(&self.model, &self.optimizer, states)
    }

    /// Loads an optimizer state saved by burn's optimizer of the same kind (or by
    /// [`optimizer_record`](Self::optimizer_record)); the next step goes on from it. Adam's and
    /// AdamW's states carry their step count; SGD's does not, so a record with velocities counts
    /// as one update done (what SGD's arithmetic distinguishes).
    ///
    /// # Errors
    ///
    /// [`GraphedError::InvalidArgument`] naming `record` when its states are at different steps,
    /// cover only some of the parameters that train, or do not fit a parameter's shape (nothing
    /// is loaded then).
    pub fn load_optimizer_record(
        &mut self,
        record: burn::optim::OptimizerRecord,
    ) -> Result<(), GraphedError> {
        let Some(state) = self.state.as_ref() else {
            if let Some(eager) = self.eager.take() {
                self.eager = Some(eager.load_record(record));
            }
            return Ok(());
        };
        let imported = import(&self.model, &self.optimizer, record)?;
        let (entries, _) = params::collect(&self.model);
        let mut imported = imported.into_iter();
        let mut states = Vec::with_capacity(entries.len());
        let mut steps = 0;
        for (index, entry) in entries.iter().enumerate() {
            if !entry.tensor.require_grad {
                states.push(None);
                continue;
            }
            let Some(state) = imported.next().flatten() else {
                states.push(None);
                continue;
            };
            steps = state.time as u64;
            let device = entry.tensor.device.clone().inner();
            let mut tensors = Vec::with_capacity(state.tensors.len());
            for data in state.tensors {
                if data.shape().as_slice() != entry.tensor.shape.as_slice() {
                    return Err(GraphedError::InvalidArgument {
                        argument: "record",
                        detail: format!(
                            "parameter {index} has shape {:?}, its state in the record {:?}",
                            entry.tensor.shape,
                            data.shape()
                        ),
                    });
                }
                let data = data.convert_dtype(entry.tensor.dtype);
                tensors.push(Dispatch::float_from_data(
                    data,
                    &device.as_dispatch().clone(),
                ));
            }
            states.push(Some(tensors));
        }
        state.load_states(&states, steps)
    }
}

/// `model` with its float parameters replaced by `values` (visiting order), each with the
/// `require_grad` it had.
fn with_values<M: Module>(model: M, values: Vec<burn::backend::DispatchTensor>) -> M {
    let mut values = values.into_iter();
    params::replace(model, |_, flat| {
        let Some(value) = values.next() else {
            return flat;
        };
        let tensor = Dispatch::from_inner(value);
        FlatTensor {
            tensor: if flat.require_grad {
                Dispatch::float_set_require_grad(tensor, true)
            } else {
                tensor
            },
            ..flat
        }
    })
}
