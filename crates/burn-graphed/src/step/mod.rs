//! [`GraphedStep`]: one graph per training step (forward, loss, backward, gradient clipping and
//! the optimizer update), replayed with nothing around it but the input copies. This file:
//! construction, routing, the step's run and its eager forms; `parallel.rs`: the data-parallel
//! step; `record.rs`: the parameters and the optimizer state as burn's modules and records.

mod parallel;
mod record;

use std::marker::PhantomData;
use std::sync::Arc;

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams, ModuleOptimizer};
use burn::tensor::Tensor;

use crate::callable::{StepRun, StepRunner};
use crate::config::{GraphedConfig, MismatchPolicy};
use crate::cube::{self, StepCut, StepGraph, StepState};
use crate::data_parallel::DataParallel;
use crate::error::GraphedError;
use crate::params::{self, ModuleMode};
use crate::route::{OnMiss, Route, Router};
use crate::stats::{EagerReason, StepStats};
use crate::step_optim::{Clipping, IntoStepOptimizer, StepOptimizer};
use crate::tensors::{FlatTensor, TensorGroup, TensorSpec};

/// A training step captured whole: the model's forward and loss, the autodiff backward, the
/// gradient clipping and the optimizer update, replayed as **one** graph per step (PyTorch's
/// "whole-network capture" with a `capturable` optimizer).
///
/// A step copies the batch into the graph's input buffers (unless it is already there), writes
/// the learning rate into a device buffer when it changed, and replays. The optimizer updates
/// the graph's parameter and state buffers in place; its step count lives on the device. The
/// loss comes back as a tensor (a device copy); nothing is read to the host unless you read it.
///
/// The optimizer is one of burn's ([`StepOptimizer`]: Adam, AdamW, SGD), with burn's
/// arithmetic, so that training with a `GraphedStep` gives what eager training with burn's own
/// optimizer gives: its update is burn's operation for operation in the parameter's dtype (bit
/// for bit in the tests; the forward and backward may run other kernels than eager burn's). The learning rate is data, so schedules need no new capture.
///
/// ```no_run
/// use burn::nn::{Linear, LinearConfig};
/// use burn::optim::AdamConfig;
/// use burn::prelude::*;
/// use burn_graphed::{GraphedConfig, GraphedStep};
///
/// #[derive(Module, Debug)]
/// struct Net {
///     layer: Linear,
/// }
///
/// fn mse(net: &Net, (x, y): (Tensor<2>, Tensor<2>)) -> Tensor<1> {
///     (net.layer.forward(x) - y).powi_scalar(2).mean()
/// }
///
/// # fn main() -> Result<(), burn_graphed::GraphedError> {
/// let device = Device::default().autodiff();
/// let net = Net { layer: LinearConfig::new(64, 8).init(&device) };
/// let sample = (Tensor::zeros([32, 64], &device), Tensor::zeros([32, 8], &device));
/// let mut step = GraphedStep::new(net, mse, &AdamConfig::new(), sample, &GraphedConfig::new())?;
/// for i in 0..100 {
///     let batch = (Tensor::ones([32, 64], &device), Tensor::zeros([32, 8], &device));
///     let lr = 1e-3 * 0.99f64.powi(i); // a schedule: no new capture
///     let loss = step.run(batch, lr)?; // one replay
/// #   let _ = loss;
/// }
/// let net = step.module(); // the current parameters
/// # let _ = net;
/// # Ok(())
/// # }
/// ```
///
/// Where the backend cannot capture (Flex), or a parameter's dtype is one the update kernels do
/// not take, every step runs eagerly with burn's optimizer. Where a batch's shapes have no graph
/// and the shape cache is full (or their capture failed), the step runs eagerly with the same
/// update kernels as the graphs; [`GraphedStep::stats`] counts both.
pub struct GraphedStep<M, I> {
    /// The model as given; with whole-step graphs its parameters are the template of the
    /// graphs' buffers, which hold the current values ([`GraphedStep::module`]).
    model: M,
    loss: fn(&M, I) -> Tensor<1>,
    optimizer: StepOptimizer,
    clipping: Option<Clipping>,
    micro_batches: usize,
    config: GraphedConfig,
    mode: ModuleMode,
    /// The whole step's device state (parameters, optimizer state, schedule), where the backend
    /// captures and the update kernels take the parameters' dtypes.
    state: Option<Arc<StepState>>,
    /// The step's graphs by input signature, and the eager steps by reason.
    router: Router<Arc<StepGraph>, Vec<TensorSpec>>,
    /// The rank's group and device, for a data-parallel step.
    parallel: Option<(DataParallel, burn::tensor::Device)>,
    /// burn's optimizer, for steps without whole-step graphs.
    eager: Option<ModuleOptimizer>,
    /// Replays and input copies (the router counts the rest).
    replays: u64,
    input_copies: u64,
    _inputs: PhantomData<fn(I)>,
}

/// What the ranks of a data-parallel group do, each in its turn, when one of them captures.
const CAPTURE_TURN: &str = "capturing a whole step";

/// What the ranks of a data-parallel step agree on before averaging its bucket.
const STEP_AGREEMENT: &str =
    "a whole step's gradients (which parameters, elements, dtype) and learning rate";

impl<M, I> GraphedStep<M, I>
where
    M: Module,
    I: TensorGroup,
{
    /// Captures one training step of `model` with the loss function `loss` and `optimizer`
    /// (burn's `&AdamConfig`, `&AdamWConfig`, `&SgdConfig`, or a [`StepOptimizer`]), on
    /// `sample` (the shapes and dtypes of real batches; the values do not matter).
    ///
    /// The model and the optimizer state are left as they were: the capture's warm-ups run on
    /// the graph's own buffers and are undone, and it consumes no [`DeviceRng`](crate::DeviceRng)
    /// draws. The optimizer state starts empty, as a new burn optimizer's.
    ///
    /// # Errors
    ///
    /// [`GraphedError::InvalidArgument`] naming `optimizer` for what whole steps do not run
    /// (AMSGrad, cautious weight decay) or `clipping` for global-norm clipping where graphs
    /// cannot be used, [`GraphedError::Capture`] or [`GraphedError::ReplayDiffers`] when the
    /// step cannot be captured (the device is left usable), [`GraphedError::Unsupported`] when
    /// [`GraphedConfig::require_graphs`] is set and the backend cannot capture,
    /// [`GraphedError::NonTrainableState`] for a float parameter that does not require grad
    /// (burn's `BatchNorm` running statistics, which a replayed step would leave stale) unless
    /// [`GraphedConfig::allow_non_trainable_params`] says such parameters are constants.
    pub fn new(
        model: M,
        loss: fn(&M, I) -> Tensor<1>,
        optimizer: impl IntoStepOptimizer,
        sample: I,
        config: &GraphedConfig,
    ) -> Result<Self, GraphedError> {
        Self::accumulating(model, loss, optimizer, vec![sample], config)
    }

    /// As [`new`](Self::new), for steps that accumulate gradients over `samples.len()`
    /// micro-batches before one update (burn's `GradientsAccumulator`: the gradients are
    /// summed; scale the loss inside `loss` for a mean). Steps then go through
    /// [`run_accumulated`](Self::run_accumulated).
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new), and [`GraphedError::InvalidArgument`] naming `samples` when it is
    /// empty.
    pub fn accumulating(
        model: M,
        loss: fn(&M, I) -> Tensor<1>,
        optimizer: impl IntoStepOptimizer,
        samples: Vec<I>,
        config: &GraphedConfig,
    ) -> Result<Self, GraphedError> {
        Self::build(model, loss, optimizer, samples, config, None)
    }

    /// As [`accumulating`](Self::accumulating), for the rank of a data-parallel group that
    /// `data_parallel` is (one thread per device, `model` a [`replica_on`](crate::replica_on)
    /// its device): every step's gradients, summed over the rank's micro-batches, are
    /// averaged over the ranks before the update, so that every replica takes the same step.
    ///
    /// Each step replays two graphs cut at the gradient bucket: forward, loss, backward and
    /// the gradients flattened into one bucket; then, after the group's collective averaged
    /// the bucket in place of the graphs, the clipping and the update. With
    /// [`Collective::Nccl`](crate::Collective::Nccl)'s `in_graph` (threads or processes) each
    /// step is one graph with the all-reduce inside. The ranks capture in turn
    /// ([`DataParallel::in_turn`]; at once with the all-reduce inside), and agree before every
    /// collective on the bucket's
    /// layout and the learning rate: a rank that fails, or whose step differs, ends the step on
    /// every rank with the same typed error instead of a hang. Run each rank's training inside
    /// [`DataParallel::run`], so that a rank failing outside a step releases the others.
    ///
    /// A step whose batch shapes have no graph yet on some rank (a new batch size, an uneven
    /// last batch on one rank) runs eagerly on those ranks
    /// ([`EagerReason::CaptureAfterStep`]); after its update every rank takes its turn and
    /// those ranks capture the shapes, which later steps replay. The returned losses are this
    /// rank's.
    ///
    /// # Errors
    ///
    /// As [`accumulating`](Self::accumulating); on every rank alike, a failed capture is
    /// [`GraphedError::RankFailed`] (the model and device left usable), and replicas that do
    /// not start from the same parameters (make them with [`replica_on`](crate::replica_on)) are
    /// [`GraphedError::RanksDisagree`]; [`GraphedError::InvalidArgument`] naming `model` when
    /// its device is not the one the group's collective gives this rank.
    pub fn data_parallel(
        data_parallel: &DataParallel,
        model: M,
        loss: fn(&M, I) -> Tensor<1>,
        optimizer: impl IntoStepOptimizer,
        samples: Vec<I>,
        config: &GraphedConfig,
    ) -> Result<Self, GraphedError> {
        Self::build(
            model,
            loss,
            optimizer,
            samples,
            config,
            Some(data_parallel.clone()),
        )
    }

    fn build(
        model: M,
        loss: fn(&M, I) -> Tensor<1>,
        optimizer: impl IntoStepOptimizer,
        samples: Vec<I>,
        config: &GraphedConfig,
        parallel: Option<DataParallel>,
    ) -> Result<Self, GraphedError> {
        if samples.is_empty() {
            return Err(GraphedError::InvalidArgument {
                argument: "samples",
                detail: "got no micro-batch, expected at least one".into(),
            });
        }
        let (optimizer, clipping) = optimizer.into_step_optimizer()?;
        let (param_entries, mode) = params::collect(&model);
        if let Some(device) = params::device_of(&param_entries)
            && !device.is_autodiff()
        {
            return Err(GraphedError::NotAutodiff {
                what: "the model",
                device: format!("{device:?}"),
            });
        }
        // burn's `BatchNorm` keeps its running statistics in float parameters that do not
        // require grad and that the forward updates on the host's side of burn's module.
        // Refused as `Graphed` refuses it, on every backend alike, unless the caller allows
        // such parameters: the step then keeps what its forward writes into them
        // (`StepState::gradients`).
        if !config.allow_non_trainable_params
            && let Some((index, param)) = param_entries
                .iter()
                .enumerate()
                .find(|(_, param)| !param.tensor.require_grad)
        {
            return Err(GraphedError::NonTrainableState {
                index,
                shape: param.tensor.shape.clone(),
            });
        }
        let parallel = match (parallel, params::device_of(&param_entries)) {
            (Some(group), Some(device)) => Some((group, device)),
            (Some(_), None) => {
                return Err(GraphedError::InvalidArgument {
                    argument: "model",
                    detail: "given a model without float parameters, expected at least one \
                             parameter to train"
                        .into(),
                });
            }
            (None, _) => None,
        };
        let state = StepState::new(&param_entries, optimizer, clipping)?;
        let mut step = Self {
            parallel,
            micro_batches: samples.len(),
            eager: state.is_none().then(|| optimizer.to_burn(clipping)),
            state: None,
            router: Router::new(None, config),
            model,
            loss,
            optimizer,
            clipping,
            config: config.clone(),
            mode,
            replays: 0,
            input_copies: 0,
            _inputs: PhantomData,
        };
        if let Some((group, _)) = &step.parallel {
            group.agree_on_start(&step.model)?;
        }
        let Some(state) = state else {
            if config.require_graphs {
                return Err(GraphedError::Unsupported {
                    device: format!("{:?}", param_entries.first().map(|p| &p.tensor.device)),
                });
            }
            return Ok(step);
        };
        let flat: Vec<Vec<FlatTensor>> = samples.into_iter().map(TensorGroup::flatten).collect();
        let (graph, bytes) = step.capture(&state, &flat)?;
        step.router = Router::new(Some((signature(&flat), graph, bytes)), config);
        step.state = Some(state);
        Ok(step)
    }

    /// One training step on `batch` at learning rate `lr`: one replay where a graph serves the
    /// batch's shapes. Returns the loss (shape `[1]` for a loss function returning a mean),
    /// without autodiff.
    ///
    /// # Errors
    ///
    /// [`GraphedError::InvalidArgument`] naming `batch` when the step accumulates several
    /// micro-batches, or `lr` when it is not finite; [`GraphedError::Mismatch`] when the step
    /// cannot replay and [`GraphedConfig::on_mismatch`] is [`MismatchPolicy::Error`];
    /// [`GraphedError::InputNotWritten`] when an input holds no values; [`GraphedError::Replay`]
    /// when the device refuses the replay.
    pub fn run(&mut self, batch: I, lr: f64) -> Result<Tensor<1>, GraphedError> {
        if self.micro_batches != 1 {
            return self.refuse(GraphedError::InvalidArgument {
                argument: "batch",
                detail: format!(
                    "this step accumulates {} micro-batches: call run_accumulated",
                    self.micro_batches
                ),
            });
        }
        self.run_accumulated(vec![batch], lr)
    }

    /// One training step over the micro-batches `batches` (as many as the capture's samples):
    /// their gradients summed, then one update. Returns the micro-batches' losses, in order.
    ///
    /// # Errors
    ///
    /// As [`run`](Self::run); [`GraphedError::InvalidArgument`] naming `batches` for another
    /// number of micro-batches than the capture's.
    pub fn run_accumulated(&mut self, batches: Vec<I>, lr: f64) -> Result<Tensor<1>, GraphedError> {
        if batches.len() != self.micro_batches {
            return self.refuse(GraphedError::InvalidArgument {
                argument: "batches",
                detail: format!(
                    "got {} micro-batches, expected {} (the capture's)",
                    batches.len(),
                    self.micro_batches
                ),
            });
        }
        if !lr.is_finite() {
            return self.refuse(GraphedError::InvalidArgument {
                argument: "lr",
                detail: format!("got {lr}, expected a finite learning rate"),
            });
        }
        let Some(state) = self.state.clone() else {
            return self.burn_step(batches, lr, EagerReason::Unsupported);
        };
        let flat: Vec<Vec<FlatTensor>> = batches.into_iter().map(TensorGroup::flatten).collect();
        let key = signature(&flat);
        if let Some((group, _)) = self.parallel.clone() {
            return self.parallel_step(&group, &state, &flat, &key, lr);
        }
        // The model is the step's own (only `load_module` replaces it, checking its
        // structure), so its train/eval mode is the capture's: nothing to compare per step.
        let miss = OnMiss::Capture(|| self.capture(&state, &flat));
        let routed = self
            .router
            .route(&key, miss, |_| false, false, |graph| Ok(graph.clone()))?;
        state.set_lr(lr)?;
        let losses = match routed.route {
            Route::Replay(graph) => {
                let (losses, copies) = graph.replay(&flat)?;
                self.replays += 1;
                self.input_copies += copies;
                losses
            }
            Route::Eager(reason) => {
                if self.config.on_mismatch == MismatchPolicy::Error {
                    return Err(GraphedError::mismatch(reason, &flat.concat(), &[]));
                }
                self.router.count_eager(reason);
                state.eager_step(&self.runner(), &flat)?
            }
        };
        Ok(concat(losses))
    }

    /// `error`, refusing a step before it started; in a data-parallel group, stated to the
    /// other ranks at the step's agreement first, so that they end the step with it too.
    fn refuse<T>(&self, error: GraphedError) -> Result<T, GraphedError> {
        if let Some((group, _)) = &self.parallel {
            group
                .ranks()
                .agree(STEP_AGREEMENT, Err::<(), _>(error.clone()))?;
        }
        Err(error)
    }

    /// Captures a whole step (a data-parallel rank: its two halves, in the rank's turn) for
    /// `flat`'s signature, with the bytes it holds.
    fn capture(
        &self,
        state: &Arc<StepState>,
        flat: &[Vec<FlatTensor>],
    ) -> Result<(Arc<StepGraph>, u64), GraphedError> {
        let runner = self.runner();
        let alone = |_: &str, outcome| outcome;
        let graph = match &self.parallel {
            None => cube::capture_step(state, &runner, flat, &self.config, StepCut::Whole, &alone),
            Some((group, device)) => match group.in_graph_group() {
                None => group.in_turn(CAPTURE_TURN, device, || {
                    group.check_device(device)?;
                    let cut = StepCut::AtBucket;
                    cube::capture_step(state, &runner, flat, &self.config, cut, &alone)
                }),
                // Every rank captures at once (processes, or threads whose devices record in
                // thread-local capture mode): they agree before each all-reduce of the capture.
                Some(nccl) => group.at_once(CAPTURE_TURN, device, || {
                    group.check_device(device)?;
                    let meet = |what: &str, outcome| group.ranks().agree(what, outcome);
                    let cut = StepCut::InGraph { group: nccl };
                    cube::capture_step(state, &runner, flat, &self.config, cut, &meet)
                }),
            },
        }?;
        let bytes = graph.held_bytes();
        Ok((Arc::new(graph), bytes))
    }

    /// The loss function on the model with its parameters replaced, type-erased.
    fn runner(&self) -> StepRunner<'_> {
        let model = &self.model;
        let loss = self.loss;
        // Without the opt-in the model has no parameter that does not require grad (it was
        // refused), so no state to keep.
        let keeps_state = self.config.allow_non_trainable_params;
        Box::new(move |params, inputs| {
            let mut params = params.iter();
            let copy = params::replace(model.clone(), |_, flat| FlatTensor {
                tensor: params.next().cloned().unwrap_or(flat.tensor.clone()),
                ..flat
            });
            let loss = loss(&copy, I::unflatten(inputs)?).into_dispatch();
            if !keeps_state {
                return Some(StepRun {
                    loss,
                    params_after: Vec::new(),
                });
            }
            // burn's `RunningState` keeps a forward's update aside until the next read, and
            // a visit reads the value before it; `valid` folds the update in (into the state
            // every clone of the model shares, so that the next replacement starts clean).
            let _ = copy.valid();
            let params_after = params::collect(&copy)
                .0
                .into_iter()
                .map(|entry| entry.tensor.tensor)
                .collect();
            Some(StepRun { loss, params_after })
        })
    }

    /// A step with burn's optimizer, where no whole-step state exists.
    fn burn_step(
        &mut self,
        batches: Vec<I>,
        lr: f64,
        reason: EagerReason,
    ) -> Result<Tensor<1>, GraphedError> {
        if self.config.on_mismatch == MismatchPolicy::Error && reason != EagerReason::Unsupported {
            let flat: Vec<FlatTensor> = batches.into_iter().flat_map(I::flatten).collect();
            return Err(GraphedError::mismatch(reason, &flat, &[]));
        }
        let Some(optimizer) = self.eager.as_mut() else {
            return Err(GraphedError::Unsupported {
                device: "(no eager optimizer)".into(),
            });
        };
        let mut accumulator = GradientsAccumulator::<M>::new();
        let mut losses = Vec::with_capacity(batches.len());
        for batch in batches {
            let loss = (self.loss)(&self.model, batch);
            let grads = GradientsParams::from_grads(loss.backward(), &self.model);
            accumulator.accumulate(&self.model, grads);
            losses.push(loss.inner().into_dispatch());
        }
        let mut grads = accumulator.grads();
        if let Some((group, _)) = &self.parallel {
            group.ranks().agree(STEP_AGREEMENT, Ok(lr))?;
            grads = group.average(&self.model, grads)?;
        }
        if let Some(Clipping::GlobalNorm(max)) = self.clipping {
            grads = crate::step_optim::clip_grad_norm(&self.model, grads, max);
        }
        self.model = optimizer.step(lr, self.model.clone(), grads);
        self.router.count_eager(reason);
        Ok(concat(losses))
    }

    /// Optimizer updates done.
    pub fn steps(&self) -> u64 {
        match self.state.as_ref() {
            Some(state) => state.steps(),
            None => self.router.eager_calls().values().sum(),
        }
    }

    /// Whether steps can replay whole-step graphs (burn's cubecl backend, parameters in a
    /// dtype the update kernels take).
    pub fn is_graphed(&self) -> bool {
        self.state.is_some()
    }

    /// The optimizer and clipping the step runs. Its constants are compiled into the step's
    /// graphs: to train on with another optimizer, build a new step from
    /// [`module`](Self::module).
    pub fn optimizer(&self) -> (StepOptimizer, Option<Clipping>) {
        (self.optimizer, self.clipping)
    }

    /// Counters: replays, eager steps by reason, input copies, the shape cache.
    pub fn stats(&self) -> StepStats {
        StepStats {
            replays: self.replays,
            eager: self.router.eager_calls(),
            input_copies: self.input_copies,
            shape_cache: self.router.cache_stats(),
            graphs: self
                .router
                .graphs()
                .iter()
                .flat_map(|graph| graph.contents().iter().cloned())
                .collect(),
        }
    }
}

/// The signature of a step's micro-batches: every flattened input's shape and dtype.
fn signature(flat: &[Vec<FlatTensor>]) -> Vec<TensorSpec> {
    flat.iter()
        .flatten()
        .map(|t| TensorSpec {
            require_grad: false,
            ..t.spec()
        })
        .collect()
}

/// The micro-batches' losses as one tensor.
fn concat(losses: Vec<burn::backend::DispatchTensor>) -> Tensor<1> {
    let mut losses: Vec<Tensor<1>> = losses.into_iter().map(Tensor::from_dispatch).collect();
    if losses.len() == 1 {
        return losses.remove(0);
    }
    Tensor::cat(losses, 0)
}
