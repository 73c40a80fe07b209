//! Whole-step graphs: forward, loss, backward, gradient clipping and the optimizer update of
//! one training step recorded as **one** graph, replayed with nothing around it but the input
//! copies and, when the learning rate changed, one small write.
//!
//! [`StepState`] owns what every graph of a model's steps shares: the static parameter buffers,
//! the optimizer's state buffers (moments or velocity) and the schedule (learning rate and
//! step count, `step_update_op`). A [`StepGraph`] is one captured step for one input signature:
//! its graph, its static input buffers and its loss buffers. Graphs of several signatures (the
//! shape cache) all read and update the same parameters, so switching between batch sizes
//! copies nothing.
//!
//! Capturing changes nothing: the warm-ups and the first run of the recording update the
//! buffers, which are put back from a snapshot taken before (and the device generators too).

use std::sync::{Arc, Mutex};

use burn::backend::ops::FloatTensorOps;
use burn::backend::{Backend, Cube, Dispatch, DispatchDevice, DispatchGraph, DispatchTensor};
use burn::tensor::{DType, Tensor};

use super::buffers::{DirectCopy, FusedTensor, StaticBuffer, dispatch_of, fused, static_fused};
use super::capture::{
    CAPTURE_LOCK, autodiff_leaf, dense_param_copy, fresh_copy, panic_message, reserved_bytes,
};
use super::copy_op::{StaticCopyOps, copy_into, copy_to_new};
use super::lifecycle::{Preparation, capture_error, forget_unrun_metadata, materialize};
use super::progress::CaptureProgress;
use super::step_update_op::{self, Hyper, Rule, SCHEDULE_WORDS, Update};
use super::validate::first_difference;
use super::values::{Bucket, BucketLayout, StepCut};
use super::{random_state, write_check};
use crate::callable::StepRunner;
use crate::config::GraphedConfig;
use crate::error::{CapturePhase, GraphedError};
use crate::faults::FaultInjection;
use crate::params::ParamEntry;
use crate::stats::GraphContents;
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
    dispatch: DispatchDevice,
    cube_device: CubeDevice,
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
    host: Mutex<HostSide>,
}

/// What the host knows of the device state without reading it.
#[derive(Default)]
struct HostSide {
    /// The learning rate the schedule holds.
    lr: Option<f64>,
    /// Updates done (the schedule's word 1, mirrored).
    steps: u64,
    /// Results of queued operations, held until a replay or a synchronization drained them
    /// (fusion skips work whose results nobody holds).
    queued: Vec<FusedTensor>,
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
        let fits = params.iter().all(|p| {
            super::adam_op::kernel_elem(p.tensor.dtype).is_some()
                && fused(&p.tensor.tensor).is_some()
        });
        if !fits {
            return Ok(None);
        }
        let (rule, hyper) = step_update_op::rule_of(&optimizer);
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

    /// Whether `optimizer` and `clipping` are the ones this state's kernels were made for.
    pub(crate) fn runs(&self, optimizer: &StepOptimizer, clipping: Option<Clipping>) -> bool {
        self.optimizer == *optimizer && self.clipping == clipping
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
            self.hold(vec![step_update_op::write_schedule(
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
        queued.push(step_update_op::write_count(
            &self.schedule.fused,
            steps as f32,
        ));
        self.hold(queued)?;
        lock(&self.host).steps = steps;
        Ok(())
    }

    /// The step body on `params` (autodiff leaves over the static buffers or over copies) for
    /// each micro-batch of `micro_inputs`: [`gradients`](Self::gradients), then
    /// [`update`](Self::update). Returns the losses (without autodiff) and the queued results
    /// to hold until the stream drained.
    fn body(
        &self,
        run: &StepRunner<'_>,
        params: &[DispatchTensor],
        micro_inputs: &[Vec<FlatTensor>],
        phase: CapturePhase,
    ) -> Result<(Vec<DispatchTensor>, Vec<FusedTensor>), GraphedError> {
        let (losses, grads) = self.gradients(run, params, micro_inputs, phase)?;
        Ok((losses, self.update(grads, phase)?))
    }

    /// Forward and loss, then backward, for each micro-batch of `micro_inputs`, on `params`:
    /// the losses (without autodiff) and each parameter's gradient summed over the
    /// micro-batches (`None` for a parameter that got none).
    fn gradients(
        &self,
        run: &StepRunner<'_>,
        params: &[DispatchTensor],
        micro_inputs: &[Vec<FlatTensor>],
        phase: CapturePhase,
    ) -> Result<(Vec<DispatchTensor>, Vec<Option<DispatchTensor>>), GraphedError> {
        let mut grads: Vec<Option<DispatchTensor>> = vec![None; params.len()];
        let mut losses = Vec::with_capacity(micro_inputs.len());
        for inputs in micro_inputs {
            let loss = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                run(params, inputs.clone())
            }))
            .map_err(|panic| GraphedError::Capture {
                phase,
                reason: format!("the loss function panicked: {}", panic_message(&*panic)),
            })?
            .ok_or(GraphedError::InputCount {
                expected: micro_inputs.first().map_or(0, Vec::len),
                got: inputs.len(),
            })?;
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
        Ok((losses, grads))
    }

    /// `grads` clipped, then the optimizer update of the parameter buffers queued in place and
    /// the step count advanced: the queued results to hold until the stream drained.
    fn update(
        &self,
        grads: Vec<Option<DispatchTensor>>,
        phase: CapturePhase,
    ) -> Result<Vec<FusedTensor>, GraphedError> {
        let grads = clip(grads, self.clipping);
        let mut updates = Vec::new();
        for ((buffer, states), grad) in self.params.iter().zip(&self.states).zip(grads) {
            let Some(grad) = grad else { continue };
            updates.push(Update {
                param: buffer.fused.clone(),
                grad: static_fused(&grad, phase)?,
                states: states.iter().map(|s| s.fused.clone()).collect(),
            });
        }
        let mut queued = Vec::new();
        if !updates.is_empty() && crate::faults::injected() != FaultInjection::SkipUpdate {
            queued = step_update_op::register(
                updates,
                &self.schedule.fused,
                self.rule,
                self.hyper.clone(),
            );
        }
        queued.push(step_update_op::advance(&self.schedule.fused));
        Ok(queued)
    }

    /// The gradients of a step flattened into one bucket, in visiting order.
    ///
    /// # Errors
    ///
    /// [`GraphedError::InvalidArgument`] naming `model` when no parameter got a gradient: a
    /// data-parallel step has nothing to average.
    fn fill_bucket(&self, grads: Vec<Option<DispatchTensor>>) -> Result<Bucket, GraphedError> {
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

    /// `bucket` split back into the gradients of the parameters its layout names, each in its
    /// parameter's shape and dtype.
    fn split_bucket(&self, bucket: &Bucket) -> Vec<Option<DispatchTensor>> {
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
    fn leaves(&self) -> Vec<DispatchTensor> {
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
        let (losses, grads) = self.gradients(run, &self.leaves(), micro_inputs, phase)?;
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
    fn hold(&self, queued: Vec<FusedTensor>) -> Result<(), GraphedError> {
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
    fn snapshot(&self) -> Vec<(FusedTensor, FusedTensor)> {
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
    fn restore(
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
fn copy_out(buffer: &StaticBuffer) -> DispatchTensor {
    dispatch_of(copy_to_new(&buffer.fused))
}

/// `grads` clipped as `clipping` says, with burn's arithmetic for [`Clipping::Value`] and
/// [`Clipping::Norm`] (`grad_clipping/base.rs`: the norm in `f32`, divided by itself plus the
/// smallest positive `f32`, the factor clamped to 1), and PyTorch's `clip_grad_norm_` for
/// [`Clipping::GlobalNorm`] (one factor `max / (norm + 1e-6)`, clamped to 1). Tensor
/// operations only: no value is read on the host.
fn clip(
    grads: Vec<Option<DispatchTensor>>,
    clipping: Option<Clipping>,
) -> Vec<Option<DispatchTensor>> {
    let Some(clipping) = clipping else {
        return grads;
    };
    let flat = |grad: DispatchTensor| -> (Tensor<1>, burn::tensor::Shape, DType) {
        let tensor = Tensor::<1>::from_dispatch(grad);
        let (shape, dtype) = (tensor.shape(), tensor.dtype());
        let flat = tensor.reshape([shape.num_elements()]);
        let flat = match dtype {
            DType::F16 | DType::BF16 => flat.cast(burn::tensor::FloatDType::F32),
            _ => flat,
        };
        (flat, shape, dtype)
    };
    let back = |flat: Tensor<1>, shape: burn::tensor::Shape, dtype: DType| -> DispatchTensor {
        let flat = if dtype == flat.dtype() {
            flat
        } else {
            flat.cast(dtype)
        };
        Dispatch::float_reshape(flat.into_dispatch(), shape)
    };
    match clipping {
        Clipping::Value(value) => grads
            .into_iter()
            .map(|g| {
                g.map(|g| {
                    let (flat, shape, dtype) = flat(g);
                    back(flat.clamp(-value, value), shape, dtype)
                })
            })
            .collect(),
        Clipping::Norm(max) => grads
            .into_iter()
            .map(|g| {
                g.map(|g| {
                    let (flat, shape, dtype) = flat(g);
                    let norm = flat.clone().square().sum().sqrt();
                    let factor = (max / norm.add_scalar(f32::MIN_POSITIVE)).clamp_max(1.0);
                    back(flat * factor, shape, dtype)
                })
            })
            .collect(),
        Clipping::GlobalNorm(max) => {
            let flats: Vec<Option<(Tensor<1>, burn::tensor::Shape, DType)>> =
                grads.into_iter().map(|g| g.map(flat)).collect();
            let total = flats
                .iter()
                .flatten()
                .map(|(flat, _, _)| flat.clone().square().sum())
                .reduce(|a, b| a + b);
            let Some(total) = total else {
                return flats.into_iter().map(|_| None).collect();
            };
            let factor = (max / total.sqrt().add_scalar(1e-6)).clamp_max(1.0);
            flats
                .into_iter()
                .map(|f| f.map(|(flat, shape, dtype)| back(flat * factor.clone(), shape, dtype)))
                .collect()
        }
    }
}

/// One captured step for one input signature (see the module docs). Field order is drop
/// order: the graph before the buffers it points into (the parameters live in `state`).
pub(crate) struct StepGraph {
    /// The whole step, or its gradient half ([`StepCut::AtBucket`]).
    graph: DispatchGraph,
    /// With [`StepCut::AtBucket`]: the update half and the bucket between the two, which
    /// `graph` writes: dropped after `graph`.
    update: Option<UpdateGraph>,
    /// Per micro-batch, one per flattened input.
    inputs: Vec<Vec<StaticBuffer>>,
    /// One per micro-batch: written by the graph.
    losses: Vec<StaticBuffer>,
    state: Arc<StepState>,
    /// Device bytes the graph's own buffers hold.
    bytes: u64,
    /// Pool growth of the capture.
    growth: u64,
    /// The fault injected at capture (tests only).
    fault: FaultInjection,
    /// What the graphs hold: the whole step's (or the gradient half's, then the update
    /// half's).
    contents: Vec<GraphContents>,
}

/// The update half of a step cut at its bucket. Field order is drop order.
struct UpdateGraph {
    graph: DispatchGraph,
    /// Written by the gradient graph, read by this one.
    bucket: StaticBuffer,
    layout: BucketLayout,
}

impl StepGraph {
    /// Bytes of the graph's input and loss buffers plus what the capture grew the pools by.
    pub(crate) fn held_bytes(&self) -> u64 {
        self.bytes + self.growth
    }

    /// What the step's graphs hold.
    pub(crate) fn contents(&self) -> &[GraphContents] {
        &self.contents
    }

    /// Copies the inputs in where they are not already in the static buffers, replays the
    /// step, and returns copies of the losses (one per micro-batch, without autodiff) and the
    /// number of input copies made.
    ///
    /// # Errors
    ///
    /// [`GraphedError::InputNotWritten`] when an input holds no values (nothing replayed), and
    /// [`GraphedError::Replay`] when the device refuses the replay or the step is cut at its
    /// bucket.
    pub(crate) fn replay(
        &self,
        micro_inputs: &[Vec<FlatTensor>],
    ) -> Result<(Vec<DispatchTensor>, u64), GraphedError> {
        if self.update.is_some() {
            return Err(cut_error(true));
        }
        let copies = self.replay_first(micro_inputs)?;
        lock(&self.state.host).steps += 1;
        Ok((self.losses.iter().map(copy_out).collect(), copies))
    }

    /// The gradient half of a step cut at its bucket: as [`replay`](Self::replay), and the
    /// bucket the graph wrote (the buffer itself, valid until the next replay), to be averaged
    /// and handed to [`replay_update`](Self::replay_update).
    ///
    /// # Errors
    ///
    /// As [`replay`](Self::replay); [`GraphedError::Replay`] when the step is not cut.
    pub(crate) fn replay_gradients(
        &self,
        micro_inputs: &[Vec<FlatTensor>],
    ) -> Result<(Vec<DispatchTensor>, u64, Bucket), GraphedError> {
        let update = self.update.as_ref().ok_or_else(|| cut_error(false))?;
        let copies = self.replay_first(micro_inputs)?;
        update.bucket.written_by_graph(None);
        let bucket = Bucket {
            tensor: dispatch_of(update.bucket.fused.clone()),
            layout: update.layout.clone(),
        };
        Ok((self.losses.iter().map(copy_out).collect(), copies, bucket))
    }

    /// The update half: copies `averaged` (the gradient bucket averaged over the ranks, of the
    /// layout [`replay_gradients`](Self::replay_gradients) gave) into the bucket and replays
    /// the update.
    ///
    /// # Errors
    ///
    /// [`GraphedError::Replay`] naming the update graph when `averaged` is not a bucket of this
    /// graph's length and dtype or holds no values (the collective failed), when called off the
    /// capturing thread, when the device refuses the replay, or when the step is not cut.
    pub(crate) fn replay_update(&self, averaged: &DispatchTensor) -> Result<(), GraphedError> {
        let update = self.update.as_ref().ok_or_else(|| cut_error(false))?;
        let refused = |reason: String| GraphedError::Replay {
            which: "update",
            reason,
        };
        if !self.state.on_capture_thread() {
            return Err(refused(
                "called on another thread than the capture's (its stream replays it)".into(),
            ));
        }
        let source = fused(averaged).ok_or_else(|| {
            refused("the averaged gradient bucket is not on burn's cubecl backend".into())
        })?;
        let (len, dtype) = (update.layout.len, update.layout.dtype);
        if source.shape.as_slice() != [len] || source.dtype != dtype {
            return Err(refused(format!(
                "the collective gave a bucket of shape {:?} of {:?}, expected [{len}] of \
                 {dtype:?} (the gradient graph's)",
                source.shape.as_slice(),
                source.dtype
            )));
        }
        let copies: Vec<DirectCopy<'_>> = update
            .bucket
            .direct_copy_from(&source)
            .into_iter()
            .collect();
        let written: Vec<&StaticBuffer> = copies.iter().map(DirectCopy::target).collect();
        let held = std::mem::take(&mut lock(&self.state.host).queued);
        let graph = cube_graph(&update.graph, "update")?;
        let bucket = &update.bucket;
        let unwritten = || {
            let reason = bucket.unwritten_reason()?;
            Some(GraphedError::Replay {
                which: "update",
                reason: format!("the averaged gradient bucket holds no values: {reason}"),
            })
        };
        // SAFETY: as in `replay_first`; the bucket is `update`'s own (field order drops the
        // update graph before it). The collective's output it copies is a tensor of its own:
        // burn's all-reduce writes in place only a buffer nobody else holds, and the bucket's
        // `StaticBuffer` holds it. The copy is launched by the replay's task on this thread's
        // stream, the capturing thread's (checked above), after the work queued on it, and
        // nothing is queued between the resolve above and the replay.
        unsafe {
            write_check::replay_after_check(
                "update",
                graph,
                &self.state.cube_device,
                &copies,
                &written,
                unwritten,
            )
        }?;
        drop(held);
        lock(&self.state.host).steps += 1;
        Ok(())
    }

    /// Copies the inputs in where needed and replays [`graph`](Self::graph); returns the number
    /// of copies.
    fn replay_first(&self, micro_inputs: &[Vec<FlatTensor>]) -> Result<u64, GraphedError> {
        let mut copies: Vec<DirectCopy<'_>> = Vec::new();
        let fault = self.fault;
        for (buffers, inputs) in self.inputs.iter().zip(micro_inputs) {
            for (buffer, input) in buffers.iter().zip(inputs) {
                let Some(source) = fused(&input.tensor) else {
                    return Err(GraphedError::Replay {
                        which: "whole step",
                        reason: "an input is not on burn's cubecl backend".into(),
                    });
                };
                if fault == FaultInjection::SkipInputCopy {
                    continue;
                }
                copies.extend(buffer.direct_copy_from(&source));
            }
        }
        let copied = copies.len() as u64;
        let written: Vec<&StaticBuffer> = copies.iter().map(DirectCopy::target).collect();
        let held = std::mem::take(&mut lock(&self.state.host).queued);
        let graph = cube_graph(&self.graph, "whole step")?;
        let inputs: Vec<&StaticBuffer> = self.inputs.iter().flatten().collect();
        let unwritten = || {
            if !super::buffers::any_unwritten() {
                return None;
            }
            inputs
                .iter()
                .enumerate()
                .find_map(|(index, b)| Some((index, b.unwritten_reason()?)))
                .map(|(index, reason)| GraphedError::InputNotWritten { index, reason })
        };
        // SAFETY: `replay_after_check` has `graph_replay`'s contract. Every buffer the
        // recording touched is alive: the static inputs and losses in `self`, the parameters,
        // states and schedule in `self.state` (an `Arc` this graph holds; field order drops the
        // graph first), and the activations and gradients in pages guarded for the graph's
        // life. The schedule write was queued from this thread, the capturing thread (the
        // caller checked it), on the stream the replay runs on, and the copies are launched by
        // the replay's task on that stream, after it; nothing is queued between the resolves
        // above and the replay.
        unsafe {
            write_check::replay_after_check(
                "whole step",
                graph,
                &self.state.cube_device,
                &copies,
                &written,
                unwritten,
            )
        }?;
        drop(held);
        for buffer in &self.losses {
            buffer.written_by_graph(None);
        }
        Ok(copied)
    }
}

/// The replay refused by a step captured cut at its bucket (`cut`) or whole.
fn cut_error(cut: bool) -> GraphedError {
    let reason = if cut {
        "this step was captured as two graphs for a data-parallel group, not as one"
    } else {
        "this step was captured as one graph, not as two for a data-parallel group"
    };
    GraphedError::Replay {
        which: "whole step",
        reason: reason.into(),
    }
}

/// `graph` as captured on burn's cubecl backend.
fn cube_graph<'a>(
    graph: &'a DispatchGraph,
    which: &'static str,
) -> Result<&'a write_check::CubeGraph, GraphedError> {
    match graph {
        DispatchGraph::Cube(graph) => Ok(graph),
        #[allow(unreachable_patterns)]
        _ => Err(GraphedError::Replay {
            which,
            reason: "the graph was not captured on burn's cubecl backend".into(),
        }),
    }
}

/// Captures one step of `run` on the micro-batches of `sample` (at least one), as one graph or
/// cut at its bucket (`cut`), updating `state`'s buffers; leaves every buffer and generator as
/// it found it.
///
/// # Errors
///
/// [`GraphedError::Capture`] of the phase that failed (the device is left out of capture mode
/// and the state as it was), and [`GraphedError::ReplayDiffers`] when the graph's loss differs
/// from an eager run's (with `validate_replay`).
pub(crate) fn capture_step(
    state: &Arc<StepState>,
    run: &StepRunner<'_>,
    sample: &[Vec<FlatTensor>],
    config: &GraphedConfig,
    cut: StepCut,
) -> Result<StepGraph, GraphedError> {
    let dispatch = &state.dispatch;
    let _progress = CaptureProgress::start(match cut {
        StepCut::Whole => "burn-graphed: capturing a whole training step",
        StepCut::AtBucket => "burn-graphed: capturing a data-parallel training step",
    });
    let _lock = lock(&CAPTURE_LOCK);
    let generators = random_state::save();
    Dispatch::sync(dispatch).map_err(capture_error(CapturePhase::StaticBuffers))?;
    // Everything queued before (a learning-rate write, an eager step) is in the buffers now.
    lock(&state.host).queued.clear();
    let snapshot = state.snapshot();
    let captured = capture_locked(state, run, sample, config, cut, &snapshot, &generators);
    let restored = state.restore(&snapshot, &generators, CapturePhase::StaticBuffers);
    if captured.is_err() || restored.is_err() {
        forget_unrun_metadata(dispatch);
    }
    let graph = captured?;
    restored?;
    Ok(graph)
}

fn capture_locked(
    state: &Arc<StepState>,
    run: &StepRunner<'_>,
    sample: &[Vec<FlatTensor>],
    config: &GraphedConfig,
    cut: StepCut,
    snapshot: &[(FusedTensor, FusedTensor)],
    generators: &random_state::SavedStates,
) -> Result<StepGraph, GraphedError> {
    let dispatch = &state.dispatch;
    let reserved_before = reserved_bytes(dispatch);
    let static_inputs: Vec<Vec<DispatchTensor>> = sample
        .iter()
        .map(|inputs| {
            inputs
                .iter()
                .map(|t| fresh_copy(&t.tensor, CapturePhase::StaticBuffers))
                .collect::<Result<_, _>>()
        })
        .collect::<Result<_, _>>()?;
    let autodiff_inputs: Vec<Vec<FlatTensor>> = sample
        .iter()
        .zip(&static_inputs)
        .map(|(inputs, statics)| {
            inputs
                .iter()
                .zip(statics)
                .map(|(input, tensor)| FlatTensor {
                    tensor: autodiff_leaf(tensor, false),
                    require_grad: false,
                    ..input.clone()
                })
                .collect()
        })
        .collect();
    let leaves = state.leaves();
    let warmup = CapturePhase::StepWarmup;
    let phase = CapturePhase::Step;
    let restore = || state.restore(snapshot, generators, warmup);
    let prepared = Preparation::new(dispatch, warmup)?;
    // The whole step, eagerly, as the graph will run it (cut at the bucket or not).
    let whole_step = || -> Result<(Vec<DispatchTensor>, Vec<FusedTensor>), GraphedError> {
        match cut {
            StepCut::Whole => state.body(run, &leaves, &autodiff_inputs, warmup),
            StepCut::AtBucket => {
                let (losses, grads) = state.gradients(run, &leaves, &autodiff_inputs, warmup)?;
                let bucket = state.fill_bucket(grads)?;
                Ok((losses, state.update(state.split_bucket(&bucket), warmup)?))
            }
        }
    };
    let eager_losses = warm_up(state, config, &restore, whole_step)?;
    restore()?;
    let recording = prepared.record(phase)?;
    let (graph, losses, update, contents) = match cut {
        StepCut::Whole => {
            let (losses, queued) = state.body(run, &leaves, &autodiff_inputs, phase)?;
            let (graph, contents) = recording.stop(phase)?;
            drop(queued);
            // The first run initializes the launch metadata the recording uploaded
            // (`materialize`); the snapshot puts the buffers back afterwards.
            materialize(dispatch, &graph, phase)?;
            (graph, losses, None, vec![contents])
        }
        StepCut::AtBucket => {
            let (losses, grads) = state.gradients(run, &leaves, &autodiff_inputs, phase)?;
            let bucket = state.fill_bucket(grads)?;
            let (graph, contents) = recording.stop(phase)?;
            materialize(dispatch, &graph, phase)?;
            // The update half: warmed up and recorded on the bucket the gradient graph wrote.
            let prepared = Preparation::new(dispatch, warmup)?;
            warm_up(state, config, &restore, || {
                Ok((
                    Vec::new(),
                    state.update(state.split_bucket(&bucket), warmup)?,
                ))
            })?;
            restore()?;
            let recording = prepared.record(phase)?;
            let queued = state.update(state.split_bucket(&bucket), phase)?;
            let (update, update_contents) = recording.stop(phase)?;
            drop(queued);
            materialize(dispatch, &update, phase)?;
            let update = UpdateGraph {
                graph: update,
                bucket: StaticBuffer::new(static_fused(&bucket.tensor, phase)?),
                layout: bucket.layout,
            };
            (graph, losses, Some(update), vec![contents, update_contents])
        }
    };
    if config.validate_replay {
        validate_losses(&losses, &eager_losses)?;
    }
    let to_buffer = |tensor: &DispatchTensor| static_fused(tensor, phase).map(StaticBuffer::new);
    let inputs = static_inputs
        .iter()
        .map(|inputs| inputs.iter().map(to_buffer).collect::<Result<Vec<_>, _>>())
        .collect::<Result<Vec<_>, _>>()?;
    let losses = losses
        .iter()
        .map(to_buffer)
        .collect::<Result<Vec<_>, _>>()?;
    let bytes = inputs
        .iter()
        .flatten()
        .chain(&losses)
        .chain(update.as_ref().map(|u| &u.bucket))
        .map(StaticBuffer::bytes)
        .sum();
    Dispatch::sync(dispatch).map_err(capture_error(phase))?;
    if config.release_capture_memory {
        // As in `capture::capture_locked`: after every recording ran.
        Dispatch::memory_cleanup(dispatch);
    }
    let growth = reserved_bytes(dispatch).saturating_sub(reserved_before);
    Ok(StepGraph {
        graph,
        update,
        inputs,
        losses,
        state: state.clone(),
        bytes,
        growth,
        fault: crate::faults::injected(),
        contents,
    })
}

/// Runs `step` eagerly from the snapshot (`restore`) until one run leaves the pools as the
/// previous did (see `capture::Recorded::warm_up`), at least `warmup_iters` and at most
/// `max_warmup_iters` times; each run's results are held until the device synchronized,
/// because fusion skips work whose results nobody holds. Returns the last run's losses.
fn warm_up(
    state: &StepState,
    config: &GraphedConfig,
    restore: &dyn Fn() -> Result<(), GraphedError>,
    step: impl Fn() -> Result<(Vec<DispatchTensor>, Vec<FusedTensor>), GraphedError>,
) -> Result<Vec<DispatchTensor>, GraphedError> {
    let dispatch = &state.dispatch;
    let warmup = CapturePhase::StepWarmup;
    let mut previous = None;
    let mut eager_losses = Vec::new();
    let iterations = config.max_warmup_iters.max(config.warmup_iters).max(1);
    for iteration in 1..=iterations {
        restore()?;
        let (losses, queued) = step()?;
        Dispatch::sync(dispatch).map_err(capture_error(warmup))?;
        drop(queued);
        eager_losses = losses;
        Dispatch::sync(dispatch).map_err(capture_error(warmup))?;
        let allocations = Dispatch::memory_pool_usage(dispatch).map(|u| u.number_allocs);
        if iteration >= config.warmup_iters.max(1)
            && allocations.is_some()
            && allocations == previous
        {
            break;
        }
        previous = allocations;
    }
    Ok(eager_losses)
}

/// The graph's first losses against the last warm-up's (the same state, inputs and generator
/// draws): a loss function whose work a graph cannot repeat (a value read on the host, a mask
/// drawn on the host) gives another loss.
fn validate_losses(
    replayed: &[DispatchTensor],
    eager: &[DispatchTensor],
) -> Result<(), GraphedError> {
    let phase = CapturePhase::Validation;
    let read = |tensor: &DispatchTensor| -> Result<Vec<f32>, GraphedError> {
        Tensor::<1>::from_dispatch(tensor.clone())
            .try_into_data()
            .map_err(|error| GraphedError::Capture {
                phase,
                reason: format!("reading a loss back: {error}"),
            })?
            .convert::<f32>()
            .try_to_vec::<f32>()
            .map_err(|error| GraphedError::Capture {
                phase,
                reason: format!("reading a loss back: {error:?}"),
            })
    };
    for (index, (replayed, eager)) in replayed.iter().zip(eager).enumerate() {
        if let Some(detail) = first_difference(&read(replayed)?, &read(eager)?) {
            return Err(GraphedError::ReplayDiffers {
                callable: 0,
                output: index,
                detail,
            });
        }
    }
    Ok(())
}
