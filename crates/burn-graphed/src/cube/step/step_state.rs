//! What the whole-step graphs of one model share ([`StepState`]): the static parameter
//! buffers, the optimizer's state buffers (moments or velocity) and the schedule (learning rate
//! and step count, `schedule_op`); the step's body as the graphs record it (forward, loss,
//! backward, clipping, update), its eager twin, and the snapshot that makes a capture change
//! nothing. The graphs themselves and their capture are in [`super::step_graph`].

use std::sync::{Arc, Mutex};

use burn::backend::ops::FloatTensorOps;
use burn::backend::{Backend, Cube, Dispatch, DispatchDevice, DispatchTensor};
use burn::tensor::{DType, Shape, Tensor};

use super::super::buffers::{FusedTensor, StaticBuffer, dispatch_of, fused, static_fused};
use super::super::copy_op::{StaticCopyOps, copy_into, copy_to_new};
use super::super::graph::driver::{autodiff_leaf, dense_param_copy, panic_message};
use super::super::graph::lifecycle::capture_error;
use super::super::graph::random_state;
use super::super::update::update_kernel::{Hyper, Rule, SCHEDULE_WORDS, kernel_elem, rule_of};
use super::super::update::update_op::{self, Clocks, Update, Writes};
use super::super::values::{Bucket, BucketLayout};
use super::schedule_op;
use crate::callable::{StepRun, StepRunner};
use crate::error::{CapturePhase, GraphedError};
use crate::faults::FaultInjection;
use crate::params::ParamEntry;
use crate::step_optim::{Clipping, StepOptimizer};
use crate::sync::lock;
use crate::tensors::FlatTensor;

/// The device of burn's cubecl backend, without autodiff.
type CubeDevice = <Cube as burn::backend::BackendTypes>::Device;

/// Updates a step count in `f32` counts exactly.
const MAX_STEPS: u64 = 1 << 24;

/// Results of queued work held at most before a synchronization lets them go.
const MAX_HELD: usize = 256;

/// What the graphs of one model's steps share (see the module docs).
pub(crate) struct StepState {
    pub(in crate::cube) dispatch: DispatchDevice,
    pub(in crate::cube) cube_device: CubeDevice,
    /// One per float parameter, in visiting order: dense buffers the update writes in place.
    params: Vec<StaticBuffer>,
    /// Whether each parameter requires grad (the others are not updated).
    require_grad: Vec<bool>,
    /// Per parameter, [`Rule::states`] buffers.
    states: Vec<Vec<StaticBuffer>>,
    /// `[lr, updates done, AdamW's decay factor]`.
    schedule: StaticBuffer,
    optimizer: StepOptimizer,
    clipping: Option<Clipping>,
    rule: Rule,
    hyper: Hyper,
    thread: std::thread::ThreadId,
    pub(in crate::cube) host: Mutex<HostSide>,
}

/// What the host knows of the device state without reading it.
#[derive(Default)]
pub(in crate::cube) struct HostSide {
    /// The learning rate the schedule holds.
    pub(in crate::cube) lr: Option<f64>,
    /// Updates done (the schedule's word 1, mirrored).
    pub(in crate::cube) steps: u64,
    /// Results of queued operations, held until a replay or a synchronization drained them
    /// (fusion skips work whose results nobody holds).
    pub(in crate::cube) queued: Vec<FusedTensor>,
}

impl StepState {
    /// Static buffers for `params` (copies of their values), zeroed optimizer state and a
    /// schedule at step 0; `None` where the device or a parameter's dtype cannot run the
    /// update kernels (burn's optimizer then runs every step eagerly).
    pub(crate) fn new(
        params: &[ParamEntry],
        optimizer: StepOptimizer,
        clipping: Option<Clipping>,
    ) -> Result<Option<Arc<Self>>, GraphedError> {
        let Some(first) = params.first() else {
            return Ok(None);
        };
        let inner = first.tensor.device.clone().inner();
        let dispatch = inner.as_dispatch().clone();
        let DispatchDevice::Cube(cube_device) = &dispatch else {
            return Ok(None);
        };
        let cube_device = cube_device.clone();
        let fits = params
            .iter()
            .all(|p| kernel_elem(p.tensor.dtype).is_some() && fused(&p.tensor.tensor).is_some());
        if !fits {
            return Ok(None);
        }
        let (rule, hyper) = rule_of(&optimizer);
        let phase = CapturePhase::StaticBuffers;
        let buffer = |tensor: &DispatchTensor| -> Result<StaticBuffer, GraphedError> {
            Ok(StaticBuffer::new(static_fused(
                &dense_param_copy(tensor)?,
                phase,
            )?))
        };
        let mut buffers = Vec::with_capacity(params.len());
        let mut states = Vec::with_capacity(params.len());
        for param in params {
            buffers.push(buffer(&param.tensor.tensor)?);
            let zeros = Tensor::<1>::from_dispatch(param.tensor.tensor.clone())
                .inner()
                .zeros_like()
                .into_dispatch();
            states.push(
                (0..rule.states())
                    .map(|_| buffer(&zeros))
                    .collect::<Result<Vec<_>, _>>()?,
            );
        }
        let schedule = Tensor::<1>::from_data(
            burn::tensor::TensorData::new(vec![0.0f32; SCHEDULE_WORDS], [SCHEDULE_WORDS]),
            burn::tensor::TensorCreationOptions::new(inner).with_dtype(DType::F32),
        )
        .into_dispatch();
        Ok(Some(Arc::new(Self {
            dispatch,
            cube_device,
            params: buffers,
            require_grad: params.iter().map(|p| p.tensor.require_grad).collect(),
            states,
            schedule: StaticBuffer::new(static_fused(&dense_param_copy(&schedule)?, phase)?),
            optimizer,
            clipping,
            rule,
            hyper,
            thread: std::thread::current().id(),
            host: Mutex::new(HostSide::default()),
        })))
    }

    /// Updates done (the device's count, mirrored on the host).
    pub(crate) fn steps(&self) -> u64 {
        lock(&self.host).steps
    }

    /// Whether this thread may replay the graphs (the capturing thread's stream only).
    pub(crate) fn on_capture_thread(&self) -> bool {
        std::thread::current().id() == self.thread
    }

    /// Queues the write of the learning rate into the schedule, unless it holds it already.
    ///
    /// # Errors
    ///
    /// [`GraphedError::InvalidArgument`] for a rate that is not finite, or when the step count
    /// would pass [`MAX_STEPS`].
    pub(crate) fn set_lr(&self, lr: f64) -> Result<(), GraphedError> {
        if !lr.is_finite() {
            return Err(GraphedError::InvalidArgument {
                argument: "lr",
                detail: format!("got {lr}, expected a finite learning rate"),
            });
        }
        let mut host = lock(&self.host);
        if host.steps >= MAX_STEPS {
            return Err(GraphedError::InvalidArgument {
                argument: "lr",
                detail: format!(
                    "a whole step counts at most {MAX_STEPS} updates on the device; this is \
                     update {}",
                    host.steps + 1
                ),
            });
        }
        let frozen = host.lr.is_some() && crate::faults::injected() == FaultInjection::FreezeLr;
        if host.lr != Some(lr) && !frozen {
            let (rate, keep) = self.optimizer.schedule_for(lr);
            host.lr = Some(lr);
            drop(host);
            self.hold(vec![schedule_op::write_schedule(
                &self.schedule.fused,
                rate,
                keep,
            )])?;
        }
        Ok(())
    }

    /// Copies of the parameters' current values (on the device without autodiff), in visiting
    /// order: queued after every update queued so far.
    pub(crate) fn param_values(&self) -> Vec<DispatchTensor> {
        self.params.iter().map(copy_out).collect()
    }

    /// Copies of the optimizer state buffers, per parameter (two moments for Adam and AdamW,
    /// the velocity for SGD with momentum, none otherwise).
    pub(crate) fn state_values(&self) -> Vec<Vec<DispatchTensor>> {
        self.states
            .iter()
            .map(|states| states.iter().map(copy_out).collect())
            .collect()
    }

    /// Writes `values` (one per parameter, visiting order; same shapes and dtypes, checked by
    /// the caller) into the parameter buffers.
    pub(crate) fn load_params(&self, values: &[DispatchTensor]) -> Result<(), GraphedError> {
        let mut queued = Vec::with_capacity(values.len());
        for (buffer, value) in self.params.iter().zip(values) {
            let source = Tensor::<1>::from_dispatch(value.clone())
                .inner()
                .into_dispatch();
            let source = static_fused(&source, CapturePhase::StaticBuffers)?;
            queued.push(buffer.overwrite_from(&source));
        }
        self.hold(queued)
    }

    /// Writes a loaded optimizer state: per parameter (visiting order), its state tensors (on
    /// the device, shapes and dtypes checked by the caller) or `None` for zeros, and the
    /// updates done.
    pub(crate) fn load_states(
        &self,
        states: &[Option<Vec<DispatchTensor>>],
        steps: u64,
    ) -> Result<(), GraphedError> {
        if steps >= MAX_STEPS {
            return Err(GraphedError::InvalidArgument {
                argument: "record",
                detail: format!("holds step {steps}; a whole step counts at most {MAX_STEPS}"),
            });
        }
        let phase = CapturePhase::StaticBuffers;
        let mut queued = Vec::new();
        for (index, buffers) in self.states.iter().enumerate() {
            let given = states.get(index).and_then(Option::as_ref);
            for (slot, buffer) in buffers.iter().enumerate() {
                let source = match given.and_then(|tensors| tensors.get(slot)) {
                    Some(tensor) => Tensor::<1>::from_dispatch(tensor.clone()).inner(),
                    None => {
                        Tensor::<1>::from_dispatch(dispatch_of(buffer.fused.clone())).zeros_like()
                    }
                };
                queued.push(buffer.overwrite_from(&static_fused(&source.into_dispatch(), phase)?));
            }
        }
        queued.push(schedule_op::write_count(&self.schedule.fused, steps as f32));
        self.hold(queued)?;
        lock(&self.host).steps = steps;
        Ok(())
    }

    /// The step body on `params` (autodiff leaves over the static buffers or over copies) for
    /// each micro-batch of `micro_inputs`: [`gradients`](Self::gradients), then
    /// [`update`](Self::update). Returns the losses (without autodiff) and the queued results
    /// to hold until the stream drained.
    pub(in crate::cube) fn body(
        &self,
        run: &StepRunner<'_>,
        params: &[DispatchTensor],
        micro_inputs: &[Vec<FlatTensor>],
        phase: CapturePhase,
    ) -> Result<(Vec<DispatchTensor>, Vec<FusedTensor>), GraphedError> {
        let (losses, grads, mut queued) = self.gradients(run, params, micro_inputs, phase)?;
        queued.extend(self.update(grads, phase)?);
        Ok((losses, queued))
    }

    /// Forward and loss, then backward, for each micro-batch of `micro_inputs`, on `params`:
    /// the losses (without autodiff), each parameter's gradient summed over the micro-batches
    /// (`None` for a parameter that got none), and the queued results to hold until the stream
    /// drained of the copies that keep the float state the forwards updated
    /// ([`keep_state`](Self::keep_state)). A micro-batch's forward reads the state the one
    /// before it left, as eager accumulation does.
    #[allow(clippy::type_complexity)]
    pub(in crate::cube) fn gradients(
        &self,
        run: &StepRunner<'_>,
        params: &[DispatchTensor],
        micro_inputs: &[Vec<FlatTensor>],
        phase: CapturePhase,
    ) -> Result<
        (
            Vec<DispatchTensor>,
            Vec<Option<DispatchTensor>>,
            Vec<FusedTensor>,
        ),
        GraphedError,
    > {
        let mut grads: Vec<Option<DispatchTensor>> = vec![None; params.len()];
        let mut losses = Vec::with_capacity(micro_inputs.len());
        let mut current = params.to_vec();
        for inputs in micro_inputs {
            let StepRun { loss, params_after } =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    run(&current, inputs.clone())
                }))
                .map_err(|panic| GraphedError::Capture {
                    phase,
                    reason: format!("the loss function panicked: {}", panic_message(&*panic)),
                })?
                .ok_or(GraphedError::InputCount {
                    expected: micro_inputs.first().map_or(0, Vec::len),
                    got: inputs.len(),
                })?;
            let slots = current.iter_mut().zip(&self.require_grad);
            for ((slot, &trained), after) in slots.zip(params_after) {
                if !trained {
                    *slot = after;
                }
            }
            let loss = Tensor::<1>::from_dispatch(loss);
            let gradients = loss.backward();
            for (sum, param) in grads.iter_mut().zip(params) {
                let Some(grad) = Tensor::<1>::from_dispatch(param.clone())
                    .grad(&gradients)
                    .map(Tensor::into_dispatch)
                else {
                    continue;
                };
                *sum = Some(match sum.take() {
                    Some(total) => Dispatch::float_add(total, grad),
                    None => grad,
                });
            }
            losses.push(loss.inner().into_dispatch());
        }
        let kept = self.keep_state(&current, phase)?;
        Ok((losses, grads, kept))
    }

    /// Copies into their buffers the parameters that do not require grad and that `current`
    /// holds as other tensors than the buffers (state a forward updated, as burn's `BatchNorm`
    /// updates its running statistics): queued after the backward, which may read the old
    /// values, and recorded in the graph with the rest of the step, so that every replay
    /// keeps what its forward computed, as eager training keeps it in the module. Returns the
    /// queued results to hold until the stream drained.
    fn keep_state(
        &self,
        current: &[DispatchTensor],
        phase: CapturePhase,
    ) -> Result<Vec<FusedTensor>, GraphedError> {
        let mut queued = Vec::new();
        for ((buffer, &trained), value) in self.params.iter().zip(&self.require_grad).zip(current) {
            if trained || fused(value).is_some_and(|value| value.id == buffer.fused.id) {
                continue;
            }
            let source = Tensor::<1>::from_dispatch(value.clone())
                .inner()
                .into_dispatch();
            queued.push(copy_into(&buffer.fused, &static_fused(&source, phase)?));
        }
        Ok(queued)
    }

    /// `grads` clipped, then the optimizer update of the parameter buffers queued in place and
    /// the step count advanced: the queued results to hold until the stream drained.
    pub(in crate::cube) fn update(
        &self,
        grads: Vec<Option<DispatchTensor>>,
        phase: CapturePhase,
    ) -> Result<Vec<FusedTensor>, GraphedError> {
        let grads = super::step_clip::clip(grads, self.clipping);
        let mut updates = Vec::new();
        for ((buffer, states), grad) in self.params.iter().zip(&self.states).zip(grads) {
            let Some(grad) = grad else { continue };
            updates.push(Update {
                param: buffer.fused.clone(),
                grad: static_fused(&grad, phase)?,
                states: states.iter().map(|s| s.fused.clone()).collect(),
                writes: Writes::Static,
                clock: 0,
            });
        }
        let mut queued = Vec::new();
        if !updates.is_empty() && crate::faults::injected() != FaultInjection::SkipUpdate {
            queued = update_op::register(
                updates,
                Clocks::Device(self.schedule.fused.clone()),
                self.rule,
                self.hyper.clone(),
            )
            .into_iter()
            .flatten()
            .collect();
        }
        queued.push(schedule_op::advance(&self.schedule.fused));
        Ok(queued)
    }

    /// The gradients of a step flattened into one bucket, in visiting order.
    ///
    /// # Errors
    ///
    /// [`GraphedError::InvalidArgument`] naming `model` when no parameter got a gradient: a
    /// data-parallel step has nothing to average.
    pub(in crate::cube) fn fill_bucket(
        &self,
        grads: Vec<Option<DispatchTensor>>,
    ) -> Result<Bucket, GraphedError> {
        let has_grad: Vec<bool> = grads.iter().map(Option::is_some).collect();
        let grads: Vec<Tensor<1>> = grads
            .into_iter()
            .flatten()
            .map(Tensor::from_dispatch)
            .collect();
        let Some(first) = grads.first() else {
            return Err(GraphedError::InvalidArgument {
                argument: "model",
                detail: "no parameter got a gradient, expected at least one to average".into(),
            });
        };
        let dtype = if grads.iter().all(|g| g.dtype() == first.dtype()) {
            first.dtype()
        } else {
            DType::F32
        };
        let parts: Vec<Tensor<1>> = grads
            .into_iter()
            .map(|grad| {
                let numel = grad.shape().num_elements();
                let flat = grad.reshape([numel]);
                if flat.dtype() == dtype {
                    flat
                } else {
                    flat.cast(dtype)
                }
            })
            .collect();
        let tensor = Tensor::cat(parts, 0);
        Ok(Bucket {
            layout: BucketLayout {
                has_grad,
                len: tensor.shape().num_elements(),
                dtype,
            },
            tensor: tensor.into_dispatch(),
        })
    }

    /// Whether each float parameter requires grad (is trained).
    pub(in crate::cube) fn trained(&self) -> &[bool] {
        &self.require_grad
    }

    /// Each float parameter's shape and dtype.
    pub(in crate::cube) fn param_specs(&self) -> Vec<(Shape, DType)> {
        self.params
            .iter()
            .map(|p| (p.fused.shape.clone(), p.fused.dtype))
            .collect()
    }

    /// `bucket` split back into the gradients of the parameters its layout names, each in its
    /// parameter's shape and dtype.
    pub(in crate::cube) fn split_bucket(&self, bucket: &Bucket) -> Vec<Option<DispatchTensor>> {
        let flat = Tensor::<1>::from_dispatch(bucket.tensor.clone());
        let mut offset = 0;
        self.params
            .iter()
            .zip(&bucket.layout.has_grad)
            .map(|(param, &has_grad)| {
                if !has_grad {
                    return None;
                }
                let (shape, dtype) = (param.fused.shape.clone(), param.fused.dtype);
                let numel = shape.num_elements();
                let part = flat.clone().narrow(0, offset, numel);
                offset += numel;
                let part = if part.dtype() == dtype {
                    part
                } else {
                    part.cast(dtype)
                };
                Some(Dispatch::float_reshape(part.into_dispatch(), shape))
            })
            .collect()
    }

    /// Autodiff leaves over the parameter buffers (those that require grad track it).
    pub(in crate::cube) fn leaves(&self) -> Vec<DispatchTensor> {
        self.params
            .iter()
            .zip(&self.require_grad)
            .map(|(buffer, &grad)| autodiff_leaf(&dispatch_of(buffer.fused.clone()), grad))
            .collect()
    }

    /// One step run eagerly on the static buffers, with the same update kernels a graph
    /// replays: where no graph serves the call. Returns the losses, one per micro-batch.
    pub(crate) fn eager_step(
        &self,
        run: &StepRunner<'_>,
        micro_inputs: &[Vec<FlatTensor>],
    ) -> Result<Vec<DispatchTensor>, GraphedError> {
        let (losses, queued) = self.body(run, &self.leaves(), micro_inputs, CapturePhase::Step)?;
        self.hold(queued)?;
        lock(&self.host).steps += 1;
        Ok(losses)
    }

    /// The first half of a step cut at its bucket ([`StepCut::AtBucket`]), run eagerly on the
    /// static buffers: the losses, one per micro-batch, and the gradients' bucket.
    pub(crate) fn eager_gradients(
        &self,
        run: &StepRunner<'_>,
        micro_inputs: &[Vec<FlatTensor>],
    ) -> Result<(Vec<DispatchTensor>, Bucket), GraphedError> {
        let phase = CapturePhase::Step;
        let (losses, grads, kept) = self.gradients(run, &self.leaves(), micro_inputs, phase)?;
        self.hold(kept)?;
        Ok((losses, self.fill_bucket(grads)?))
    }

    /// The second half, run eagerly: `bucket` (the averaged gradients) split back, clipped,
    /// and the update queued, with the same kernels as the update graph.
    pub(crate) fn eager_update(&self, bucket: &Bucket) -> Result<(), GraphedError> {
        let queued = self.update(self.split_bucket(bucket), CapturePhase::Step)?;
        self.hold(queued)?;
        lock(&self.host).steps += 1;
        Ok(())
    }

    /// Holds the results of queued work until a replay drains the stream; past
    /// [`MAX_HELD`] of them (steps that never replay), waits for the device and lets them go.
    pub(in crate::cube) fn hold(&self, queued: Vec<FusedTensor>) -> Result<(), GraphedError> {
        let mut host = lock(&self.host);
        host.queued.extend(queued);
        if host.queued.len() > MAX_HELD {
            Dispatch::sync(&self.dispatch).map_err(|error| GraphedError::Replay {
                which: "whole step",
                reason: error.to_string(),
            })?;
            host.queued.clear();
        }
        Ok(())
    }

    /// Dense copies of every buffer a step writes, to put back after a capture.
    pub(in crate::cube) fn snapshot(&self) -> Vec<(FusedTensor, FusedTensor)> {
        self.params
            .iter()
            .chain(self.states.iter().flatten())
            .chain(std::iter::once(&self.schedule))
            .map(|buffer| {
                let copy = <Cube as StaticCopyOps>::copy_to_new_dense_buffer(&buffer.fused);
                (buffer.fused.clone(), copy)
            })
            .collect()
    }

    /// Writes a snapshot back and waits for it.
    pub(in crate::cube) fn restore(
        &self,
        snapshot: &[(FusedTensor, FusedTensor)],
        generators: &random_state::SavedStates,
        phase: CapturePhase,
    ) -> Result<(), GraphedError> {
        let queued: Vec<FusedTensor> = snapshot
            .iter()
            .map(|(buffer, copy)| copy_into(buffer, copy))
            .collect();
        Dispatch::sync(&self.dispatch).map_err(capture_error(phase))?;
        drop(queued);
        random_state::restore(generators).map_err(capture_error(phase))
    }
}

/// A bit-for-bit copy of a static buffer in a new buffer, as a tensor without autodiff.
pub(in crate::cube) fn copy_out(buffer: &StaticBuffer) -> DispatchTensor {
    dispatch_of(copy_to_new(&buffer.fused))
}
