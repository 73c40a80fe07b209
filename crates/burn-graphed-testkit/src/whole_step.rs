//! The whole-step comparison: a [`GraphedStep`] against eager training with burn's own
//! optimizer (`Adam`, `AdamW` or `Sgd`, stepped per parameter exactly as burn's
//! `ModuleOptimizer` steps it), from the same parameters and batches, comparing after every
//! step the losses, every parameter and every optimizer state tensor (moments, velocity).

use std::any::Any;
use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::optim::{
    Adam, AdamW, GradientsAccumulator, GradientsParams, Optimizer, RecordState, Sgd, StateSink,
};
use burn::tensor::{Tensor, TensorData};
use burn_graphed::{
    BurnConfig, Clipping, GraphedConfig, GraphedStep, StepOptimizer, StepStats, TensorGroup,
};

use crate::{EquivalenceReport, HarnessError, TensorComparison, Tolerance, failed, read};

/// What [`compare_whole_step`] trains and how.
pub struct WholeStepComparison<'a, M, I> {
    /// The model (both sides start from deep copies of it).
    pub model: M,
    /// The graphed side's model, where a deep copy of `model` will not do: a model holding a
    /// [`DeviceRng`](burn_graphed::DeviceRng) shares its generator with its copies, so give
    /// each side its own generator, seeded alike, and the same parameters.
    pub twin: Option<M>,
    /// The loss function, as given to [`GraphedStep::new`].
    pub loss: fn(&M, I) -> Tensor<1>,
    /// The optimizer of both sides.
    pub optimizer: StepOptimizer,
    /// Gradient clipping of both sides.
    pub clipping: Option<Clipping>,
    /// The micro-batches of step `step` (the same number every step; one without accumulation).
    pub batches: &'a mut dyn FnMut(usize) -> Vec<I>,
    /// The learning rate of step `step` (a schedule).
    pub learning_rate: &'a dyn Fn(usize) -> f64,
    /// Steps to train.
    pub steps: usize,
    /// The graphed side's configuration.
    pub graphed: GraphedConfig,
    /// How close the two sides must be.
    pub tolerance: Tolerance,
}

/// The result of [`compare_whole_step`]: the comparisons (as [`EquivalenceReport::tensors`])
/// and the graphed side's counters.
#[derive(Debug, Clone)]
pub struct WholeStepReport {
    /// Every tensor compared, in order (`step N loss`, `step N param K`, `step N state K.J`).
    pub report: EquivalenceReport,
    /// The [`GraphedStep`]'s counters at the end.
    pub stats: StepStats,
}

/// Trains `comparison.model` eagerly with burn's optimizer and, from a deep copy, with a
/// [`GraphedStep`], on the same batches and learning rates, and compares every step's losses,
/// parameters and optimizer state element by element: losses and states (moments, velocity)
/// relative to their own largest value ([`TensorComparison::new`]), parameters relative to the
/// path they travelled ([`crate::ParamMovement`]; [`Tolerance`] says why).
/// The counts must agree too: parameters, parameters with states, and state tensors per
/// parameter (burn's optimizer keeps one state per parameter it stepped).
///
/// # Errors
///
/// [`HarnessError::Graphed`] when the [`GraphedStep`] fails, [`HarnessError::Read`] when a
/// value cannot be read back.
pub fn compare_whole_step<M, I>(
    comparison: WholeStepComparison<'_, M, I>,
) -> Result<WholeStepReport, HarnessError>
where
    M: Module,
    I: TensorGroup + Clone,
{
    let WholeStepComparison {
        model,
        twin,
        loss,
        optimizer,
        clipping,
        batches,
        learning_rate,
        steps,
        graphed,
        tolerance,
    } = comparison;
    let mut movement = crate::ParamMovement::new(crate::values_only(crate::param_values(&model)?));
    let mut eager = Reference::new(crate::deep_copy(&model), optimizer, clipping);
    let first = batches(0);
    let mut step = GraphedStep::accumulating(
        twin.unwrap_or_else(|| crate::deep_copy(&model)),
        loss,
        (optimizer, clipping),
        first.clone(),
        &graphed,
    )
    .map_err(HarnessError::Graphed)?;
    let mut tensors = Vec::new();
    for index in 0..steps {
        let micro = if index == 0 {
            first.clone()
        } else {
            batches(index)
        };
        let lr = learning_rate(index);
        let eager_losses = eager.step(loss, micro.clone(), lr)?;
        let graphed_losses = read(
            step.run_accumulated(micro, lr)
                .map_err(HarnessError::Graphed)?,
            "graphed loss",
        )?;
        tensors.push(TensorComparison::new(
            format!("step {index} loss"),
            &eager_losses,
            &graphed_losses,
            tolerance,
        ));
        let eager_params = crate::param_values(&eager.model)?;
        let graphed_params = crate::param_values(&step.module())?;
        let values = |params: &[(ParamId, TensorData)]| -> Vec<TensorData> {
            params.iter().map(|(_, data)| data.clone()).collect()
        };
        tensors.extend(movement.compare(
            &format!("step {index}"),
            &values(&eager_params),
            &values(&graphed_params),
            tolerance,
        ));
        if step.is_graphed() {
            let graphed_states = step.optimizer_state();
            let eager_states = eager.states(&eager_params)?;
            // Every parameter's states, and as many of them: a state missing on one side
            // would otherwise fall out of the zip below.
            if eager_states.len() != graphed_states.len() {
                tensors.push(failed(format!(
                    "step {index} states: {} parameters eager, {} graphed",
                    eager_states.len(),
                    graphed_states.len()
                )));
            }
            for (param, (e, g)) in eager_states.iter().zip(&graphed_states).enumerate() {
                if e.len() != g.len() {
                    tensors.push(failed(format!(
                        "step {index} state {param}: {} tensors eager, {} graphed",
                        e.len(),
                        g.len()
                    )));
                }
                for (slot, (e, g)) in e.iter().zip(g).enumerate() {
                    let g = read(
                        Tensor::<1>::from_dispatch(g.tensor().clone()),
                        "graphed optimizer state",
                    )?;
                    tensors.push(TensorComparison::new(
                        format!("step {index} state {param}.{slot}"),
                        e,
                        &g,
                        tolerance,
                    ));
                }
            }
        }
    }
    Ok(WholeStepReport {
        report: EquivalenceReport {
            tensors,
            stats: Default::default(),
            summary: burn_graphed::CaptureSummary {
                graphed: step.is_graphed(),
                eager_reason: None,
                inputs: 0,
                inputs_requiring_grad: 0,
                outputs: 1,
                params: 0,
                trainable_params: 0,
                static_bytes: 0,
            },
            shape_cache: step.stats().shape_cache,
        },
        stats: step.stats(),
    })
}

/// burn's optimizer of each kind, stepped per parameter.
#[derive(Clone)]
enum BurnOptimizer {
    Adam(Adam),
    AdamW(AdamW),
    Sgd(Sgd),
}

impl BurnOptimizer {
    fn new(optimizer: StepOptimizer) -> Self {
        match optimizer.burn_config() {
            BurnConfig::Adam(config) => Self::Adam(config.build()),
            BurnConfig::AdamW(config) => Self::AdamW(config.build()),
            BurnConfig::Sgd(config) => Self::Sgd(config.build()),
        }
    }
}

/// The eager side: the model, burn's optimizer and its per-parameter states.
struct Reference<M> {
    model: M,
    optimizer: BurnOptimizer,
    clipping: Option<Clipping>,
    /// Per parameter: its state (`O::State<D>`) and the state's tensors, flattened in field
    /// order.
    states: HashMap<ParamId, (Box<dyn Any>, Vec<TensorData>)>,
}

impl<M: Module> Reference<M> {
    fn new(model: M, optimizer: StepOptimizer, clipping: Option<Clipping>) -> Self {
        Self {
            model,
            optimizer: BurnOptimizer::new(optimizer),
            clipping,
            states: HashMap::new(),
        }
    }

    /// One step on the micro-batches `micro`: burn's `GradientsAccumulator`, clipping, then
    /// the optimizer per parameter. Returns the losses.
    fn step<I>(
        &mut self,
        loss: fn(&M, I) -> Tensor<1>,
        micro: Vec<I>,
        lr: f64,
    ) -> Result<TensorData, HarnessError> {
        let mut accumulator = GradientsAccumulator::<M>::new();
        let mut losses = Vec::new();
        for batch in micro {
            let value = loss(&self.model, batch);
            let grads = GradientsParams::from_grads(value.backward(), &self.model);
            accumulator.accumulate(&self.model, grads);
            losses.push(value.inner());
        }
        let mut grads = accumulator.grads();
        if let Some(Clipping::GlobalNorm(max)) = self.clipping {
            grads = burn_graphed::clip_grad_norm(&self.model, grads, max);
        }
        let mut mapper = Stepper {
            grads: &mut grads,
            optimizer: &self.optimizer,
            clipping: self.clipping,
            lr,
            states: &mut self.states,
            error: None,
        };
        self.model = self.model.clone().map(&mut mapper);
        if let Some(error) = mapper.error {
            return Err(error);
        }
        read(Tensor::cat(losses, 0), "eager loss")
    }

    /// The state tensors of every parameter, in the order of `params` (visiting order).
    fn states(
        &self,
        params: &[(ParamId, TensorData)],
    ) -> Result<Vec<Vec<TensorData>>, HarnessError> {
        Ok(params
            .iter()
            .map(|(id, _)| self.states.get(id).map(|s| s.1.clone()).unwrap_or_default())
            .collect())
    }
}

/// burn's `ModuleOptimizer` step, per parameter, keeping each state where it can be read.
struct Stepper<'a> {
    grads: &'a mut GradientsParams,
    optimizer: &'a BurnOptimizer,
    clipping: Option<Clipping>,
    lr: f64,
    states: &'a mut HashMap<ParamId, (Box<dyn Any>, Vec<TensorData>)>,
    error: Option<HarnessError>,
}

impl Stepper<'_> {
    fn step<O: Optimizer, const D: usize>(
        &mut self,
        optimizer: &O,
        id: ParamId,
        tensor: Tensor<D>,
        grad: Tensor<D>,
    ) -> Tensor<D> {
        let state = self
            .states
            .remove(&id)
            .and_then(|(state, _)| state.downcast::<O::State<D>>().ok())
            .map(|state| *state);
        let (tensor, state) = optimizer.step(self.lr, tensor, grad, state);
        if let Some(state) = state {
            let mut sink = StateSink::default();
            state.state_flatten("", &mut sink);
            let tensors = sink
                .tensors
                .into_iter()
                .map(|(_, data)| crate::materialize(data, "eager optimizer state"))
                .collect::<Result<Vec<_>, _>>();
            match tensors {
                Ok(tensors) => {
                    self.states.insert(id, (Box::new(state), tensors));
                }
                Err(error) => self.error = Some(error),
            }
        }
        tensor
    }
}

impl ModuleMapper for Stepper<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(grad) = self.grads.remove::<D>(id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        // Global-norm clipping was applied to every gradient before (`clip_grad_norm`).
        let grad = match self.clipping.and_then(Clipping::to_burn) {
            Some(clipping) => clipping.clip_gradient(grad),
            None => grad,
        };
        let require_grad = tensor.is_require_grad();
        let inner = tensor.inner();
        let optimizer = self.optimizer.clone();
        let updated = match &optimizer {
            BurnOptimizer::Adam(o) => self.step(o, id, inner, grad),
            BurnOptimizer::AdamW(o) => self.step(o, id, inner, grad),
            BurnOptimizer::Sgd(o) => self.step(o, id, inner, grad),
        };
        let updated = Tensor::from_inner(updated);
        let updated = if require_grad {
            updated.require_grad()
        } else {
            updated
        };
        Param::from_mapped_value(id, updated, mapper)
    }
}
