//! Capturing the forward and backward graphs of a callable (the recipe of cubecl 0.11:
//! prepare, warm up, record; then prepare, warm up, record again for the backward).

use std::sync::{Arc, Mutex};

use burn::backend::ops::FloatTensorOps;
use burn::backend::{
    AutodiffBackend, Backend, Cube, Dispatch, DispatchDevice, DispatchTensor, TensorMetadata,
};
use burn::tensor::{Device, Tensor};

use super::buffers::{FusedTensor, StaticBuffer};
use super::session::{GroupLinks, Session, SessionState};
use crate::config::GraphedConfig;
use crate::error::{CapturePhase, GraphedError};
use crate::group::{Member, Runner};
use crate::tensors::{FlatTensor, TensorSpec};

/// CUDA captures in global mode: one capture at a time in the whole process.
static CAPTURE_LOCK: Mutex<()> = Mutex::new(());

/// Whether graphs can be captured on `device` (burn's cubecl backend).
pub(crate) fn supports_capture(device: &Device) -> bool {
    matches!(
        device.clone().inner().as_dispatch(),
        DispatchDevice::Cube(_)
    )
}

/// The fusion handle of a tensor of burn's cubecl backend, without its autodiff node.
pub(crate) fn fused(tensor: &DispatchTensor) -> Option<FusedTensor> {
    let inner = Tensor::<1>::from_dispatch(tensor.clone()).inner();
    inner.try_into_primitive::<Cube>().ok()
}

/// [`fused`], or the capture error of `phase` saying that a static tensor is not on burn's
/// cubecl backend.
fn static_fused(tensor: &DispatchTensor, phase: CapturePhase) -> Result<FusedTensor, GraphedError> {
    fused(tensor).ok_or_else(|| GraphedError::Capture {
        phase,
        reason: "a static tensor is not on burn's cubecl backend".into(),
    })
}

/// A copy of `tensor` in a buffer of its own, on the device without autodiff.
fn fresh_copy(tensor: &DispatchTensor) -> DispatchTensor {
    // `Tensor::inner` is idempotent; `Dispatch::inner` panics on a tensor without autodiff.
    let inner = Tensor::<1>::from_dispatch(tensor.clone())
        .inner()
        .into_dispatch();
    Dispatch::float_mul_scalar(inner, 1.0f32.into())
}

/// A copy of a parameter in a dense buffer of its own (rows not pitched), on the device without
/// autodiff: a graph's parameter buffer. The Adam kernels bind dense buffers only, so a pitched
/// parameter buffer (cubecl's layout of new tensors on CUDA) would cost every in-place update a
/// dense copy and a copy back (`dense::Target`). Errors like [`static_fused`].
fn dense_param_copy(tensor: &DispatchTensor) -> Result<DispatchTensor, GraphedError> {
    let fused = static_fused(tensor, CapturePhase::StaticBuffers)?;
    let copy = <Cube as super::copy_op::StaticCopyOps>::copy_to_new_dense_buffer(&fused);
    Ok(Tensor::<1>::from_primitive::<Cube>(copy).into_dispatch())
}

/// Leaves the prepared state on drop unless a recording started: an error between
/// `graph_prepare` and `graph_start_capture` (a failed warm-up) would otherwise leave the stream
/// prepared, and every later capture on it would fail with "already prepared".
struct Prepared<'a> {
    device: &'a DispatchDevice,
    armed: bool,
}

impl<'a> Prepared<'a> {
    fn new(device: &'a DispatchDevice, phase: CapturePhase) -> Result<Self, GraphedError> {
        Dispatch::graph_prepare(device).map_err(capture_error(phase))?;
        announce(phase);
        Ok(Self {
            device,
            armed: true,
        })
    }

    /// Starts the recording that consumes the prepared state.
    fn record(mut self, phase: CapturePhase) -> Result<Recording<'a>, GraphedError> {
        let recording = Recording::start(self.device, phase)?;
        self.armed = false;
        Ok(recording)
    }
}

impl Drop for Prepared<'_> {
    fn drop(&mut self) {
        if self.armed {
            // The lifecycle has no "cancel": an empty recording returns the stream to its
            // normal state, and the empty graph is dropped at once.
            if Dispatch::graph_start_capture(self.device).is_ok() {
                let _ = Dispatch::graph_stop_capture(self.device);
            }
        }
    }
}

/// Ends the capture on drop unless stopped: whatever happens inside the window (an error, a
/// panic in user code), the stream leaves capture mode.
struct Recording<'a> {
    device: &'a DispatchDevice,
    open: bool,
}

impl<'a> Recording<'a> {
    fn start(device: &'a DispatchDevice, phase: CapturePhase) -> Result<Self, GraphedError> {
        Dispatch::graph_start_capture(device).map_err(|error| GraphedError::Capture {
            phase,
            reason: error.to_string(),
        })?;
        announce(phase);
        Ok(Self { device, open: true })
    }

    fn stop(mut self, phase: CapturePhase) -> Result<burn::backend::DispatchGraph, GraphedError> {
        self.open = false;
        let stopped = Dispatch::graph_stop_capture(self.device);
        announce(format_args!("{phase} closed"));
        stopped.map_err(|error| {
            let mut reason = error.to_string();
            if reason.contains("CAPTURE_INVALIDATED") {
                reason.push_str(INVALIDATED_HINT);
            }
            GraphedError::Capture { phase, reason }
        })
    }
}

/// Appended to a recording that the driver invalidated.
///
/// cubecl 0.11 records CUDA graphs in global capture mode: while a recording is open, an
/// operation that another thread issues on the device and that is not allowed during a
/// capture (a synchronization, a read) fails there (status 900) and invalidates the recording.
/// Measured on an H100 (`other_threads_keep_their_draws`).
const INVALIDATED_HINT: &str = " (CUDA records graphs in global capture mode: a read or \
synchronization that another thread issued on the device during the recording invalidates it, \
and fails on that thread; keep other threads off the device while capturing, then retry)";

impl Drop for Recording<'_> {
    fn drop(&mut self) {
        if self.open {
            // The recording is abandoned; its error says only that, so it is not reported.
            let _ = Dispatch::graph_stop_capture(self.device);
        }
    }
}

/// Announces the capture phase that starts from here (a `log` debug event of target
/// `burn_graphed::capture` whose message is the phase), so that a listener can tell which phase
/// the next kernel launches and warnings belong to: cubecl's autotuner, for one, reports only as
/// a `log` warning a key it had to decide unmeasured because profiling is refused while a
/// graph records (the bench's `warn_log`).
fn announce(phase: impl std::fmt::Display) {
    log::debug!(target: "burn_graphed::capture", "{phase}");
}

fn capture_error(phase: CapturePhase) -> impl Fn(burn::backend::ExecutionError) -> GraphedError {
    move |error| GraphedError::Capture {
        phase,
        reason: error.to_string(),
    }
}

/// The message of a caught panic, when it carries one.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(no message)".into())
}

/// What a successful capture of a group hands to the graphed modules.
pub(crate) struct CapturedGroup {
    /// One per member, in execution order.
    pub sessions: Vec<Arc<Session>>,
    /// Per member, the inputs as captured (for a chained member: the previous outputs).
    pub inputs: Vec<Vec<TensorSpec>>,
    /// Growth of the device's reserved pool bytes over the whole capture (warm-ups included):
    /// an upper bound on the memory that the graphs pin.
    pub pool_growth_bytes: u64,
    /// Reserved bytes that the capture's memory cleanup returned to the device.
    pub released_bytes: u64,
}

/// One eager forward and backward with gradient `grad_outputs` on the outputs, returning the
/// outputs (kept alive by the caller until the device synchronized).
fn surrogate_loss(outputs: &[FlatTensor], grad_outputs: &[DispatchTensor]) -> Tensor<1> {
    let mut total: Option<DispatchTensor> = None;
    for (output, grad) in outputs.iter().zip(grad_outputs) {
        let product =
            Dispatch::float_mul(output.tensor.clone(), Dispatch::from_inner(grad.clone()));
        let flat =
            Dispatch::float_reshape(product, [output.shape.iter().product::<usize>()].into());
        let term = Dispatch::float_sum(flat);
        total = Some(match total {
            Some(total) => Dispatch::float_add(total, term),
            None => term,
        });
    }
    Tensor::<1>::from_dispatch(total.expect("at least one output"))
}

/// A member of the group on its way through the capture.
struct Recorded<'a> {
    /// Static inputs, without autodiff (for a chained member: the previous outputs).
    static_inputs: Vec<DispatchTensor>,
    /// Autodiff views of the static inputs, as the callable receives them.
    autodiff_inputs: Vec<FlatTensor>,
    static_params: Vec<DispatchTensor>,
    autodiff_params: Vec<DispatchTensor>,
    run: Runner<'a>,
    /// Gradients fed to the outputs in warm-ups and, unless the next member is chained, in
    /// the backward capture.
    grad_outputs: Vec<DispatchTensor>,
    outputs: Vec<FlatTensor>,
    forward: Option<burn::backend::DispatchGraph>,
}

impl Recorded<'_> {
    /// Runs the callable on `inputs`; a panic (e.g. a host read that the device refuses inside
    /// a capture) becomes an error of `phase`, and `Recording` ends an open capture on the way.
    fn run(&self, index: usize, phase: CapturePhase) -> Result<Vec<FlatTensor>, GraphedError> {
        let outputs = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            (self.run)(self.autodiff_inputs.clone())
        }))
        .map_err(|panic| GraphedError::Capture {
            phase,
            reason: format!("the callable panicked: {}", panic_message(&*panic)),
        })?
        .ok_or_else(|| crate::group::misfit(index, self.autodiff_inputs.len()))?;
        if outputs.is_empty() {
            return Err(GraphedError::NoOutputs);
        }
        Ok(outputs)
    }

    /// Eager forward+backward runs, each held until the device synchronized (fusion elides
    /// work whose results are dropped): at least `min_iters`, then more until one run leaves
    /// the device's live allocations as the previous one did, at most `max_iters`.
    ///
    /// Each run syncs where the recordings end (after the forward, after building the
    /// surrogate loss), so that fusion cuts the work into the same kernels as in the forward
    /// and backward recordings: kernels that only the recording launches carry metadata that
    /// is first seen there (see [`materialize`]).
    ///
    /// Why adaptive: every kernel launch reads its shapes and strides from a device buffer
    /// that cubecl caches by content. A launch that first appears inside the recording (a
    /// kernel that autotuning or fusion picks only on a later run) builds its buffer there.
    /// A run that creates no new cached buffer is the sign that the next run, the recording,
    /// will not either.
    fn warm_up(
        &mut self,
        index: usize,
        (min_iters, max_iters): (usize, usize),
        dispatch: &DispatchDevice,
        phase: CapturePhase,
    ) -> Result<usize, GraphedError> {
        let mut previous = None;
        let sync = || Dispatch::sync(dispatch).map_err(capture_error(phase));
        for iteration in 1..=max_iters.max(min_iters).max(1) {
            let outputs = self.run(index, phase)?;
            if self.grad_outputs.is_empty() {
                self.grad_outputs = outputs
                    .iter()
                    .map(|o| {
                        Dispatch::float_zeros(o.shape.clone().into(), dispatch, o.dtype.into())
                    })
                    .collect();
            }
            sync()?;
            let loss = surrogate_loss(&outputs, &self.grad_outputs);
            sync()?;
            let grads = loss.backward();
            sync()?;
            drop((outputs, grads));
            sync()?;
            let allocations =
                Dispatch::memory_pool_usage(dispatch).map(|usage| usage.number_allocs);
            if iteration >= min_iters.max(1) && allocations.is_some() && allocations == previous {
                return Ok(iteration);
            }
            previous = allocations;
        }
        Ok(max_iters.max(min_iters).max(1))
    }
}

/// Replays a graph right after its recording, and waits for it.
///
/// Why: a kernel launch reads its shapes and strides from a device buffer that cubecl caches
/// by content. A launch whose metadata is first seen inside a recording builds that buffer
/// there, and the upload into it is recorded, not executed: until the graph first runs, the
/// cached buffer holds whatever the memory held before, and every eager launch with the same
/// metadata reads it. Measured on an H100 before this existed: out-of-bounds reads by eager
/// kernels of the next warm-up (CUDA error 700, 8 GB past an allocation) and wrong replayed
/// outputs. Running the graph once initializes every such buffer (the graph keeps the host
/// bytes it uploads from) before anything else launches.
///
/// # Errors
///
/// [`GraphedError::Capture`] of `phase` when the replay or the wait fails.
fn materialize(
    dispatch: &DispatchDevice,
    graph: &burn::backend::DispatchGraph,
    phase: CapturePhase,
) -> Result<(), GraphedError> {
    // SAFETY: `graph_replay` needs every buffer the recording touched alive, unused by other
    // streams, and refreshed on the capture stream. The caller still holds every tensor the
    // recording read or wrote (static inputs, parameters, outputs, gradients), the freed
    // activations lie in pages guarded for the graph's life, and this thread holds the
    // capture lock and issued the recording on this stream.
    unsafe { Dispatch::graph_replay(dispatch, graph) }.map_err(capture_error(phase))?;
    Dispatch::sync(dispatch).map_err(capture_error(phase))
}

/// Drops the metadata buffers that a failed recording left in cubecl's cache.
///
/// An abandoned recording leaves the entries it created in the cache, unpinned, with the
/// recorded (never executed) uploads: eager launches with that metadata would read
/// uninitialized memory (see [`materialize`]). A memory cleanup evicts every entry no live
/// graph pins; entries of live graphs were initialized by [`materialize`].
fn forget_unrun_metadata(dispatch: &DispatchDevice) {
    Dispatch::memory_cleanup(dispatch);
}

impl Recorded<'_> {
    /// Replays the forward graph on new input values (the static inputs scaled by 1.5 and
    /// shifted by 0.25) and compares its outputs with an eager run on the same values.
    ///
    /// Same inputs and parameters, same kernels: the two agree up to rounding (fusion may order
    /// a reduction differently), so the tolerance is loose (1% of each value plus 0.1% of the
    /// output's largest magnitude). What a graph freezes differs by far more: a dropout mask
    /// drawn on the host, or a scalar read on the host from the sample's values.
    ///
    /// # Errors
    ///
    /// [`GraphedError::ReplayDiffers`] for the first output that differs, and
    /// [`GraphedError::Capture`] when the device fails.
    fn validate_forward(
        &self,
        index: usize,
        graph: &burn::backend::DispatchGraph,
        dispatch: &DispatchDevice,
    ) -> Result<(), GraphedError> {
        use super::copy_op::StaticCopyOps;
        let phase = CapturePhase::Validation;
        announce(phase);
        let mut queued = Vec::with_capacity(self.static_inputs.len());
        for input in &self.static_inputs {
            let shifted = Dispatch::float_add_scalar(
                Dispatch::float_mul_scalar(input.clone(), 1.5f32.into()),
                0.25f32.into(),
            );
            queued.push(<Cube as StaticCopyOps>::copy_into_buffer(
                &static_fused(input, phase)?,
                &static_fused(&shifted, phase)?,
            ));
        }
        Dispatch::sync(dispatch).map_err(capture_error(phase))?;
        drop(queued);
        // The replay and the eager run must draw the same numbers from device generators.
        let generators = crate::rng::save_device_states();
        materialize(dispatch, graph, phase)?;
        let read = |tensor: &DispatchTensor| -> Result<Vec<f32>, GraphedError> {
            let reason = |error: String| GraphedError::Capture {
                phase,
                reason: format!("reading an output back: {error}"),
            };
            Tensor::<1>::from_dispatch(tensor.clone())
                .inner()
                .try_into_data()
                .map_err(|error| reason(error.to_string()))?
                .convert::<f32>()
                .try_to_vec::<f32>()
                .map_err(|error| reason(format!("{error:?}")))
        };
        let replayed = self
            .outputs
            .iter()
            .map(|o| read(&o.tensor))
            .collect::<Result<Vec<_>, _>>()?;
        crate::rng::restore_device_states(&generators).map_err(capture_error(phase))?;
        let eager = self.run(index, phase)?;
        for (output, (replayed, eager)) in replayed.iter().zip(&eager).enumerate() {
            let eager = read(&eager.tensor)?;
            if let Some(detail) = first_difference(replayed, &eager) {
                return Err(GraphedError::ReplayDiffers {
                    callable: index,
                    output,
                    detail,
                });
            }
        }
        Ok(())
    }
}

/// Where `replayed` differs from `eager` beyond the validation tolerance (see
/// [`Recorded::validate_forward`]), if anywhere.
fn first_difference(replayed: &[f32], eager: &[f32]) -> Option<String> {
    let scale = eager
        .iter()
        .filter(|v| v.is_finite())
        .fold(0.0f32, |m, v| m.max(v.abs()));
    let differing: Vec<usize> = replayed
        .iter()
        .zip(eager)
        .enumerate()
        .filter(|(_, (r, e))| {
            let both_nan = r.is_nan() && e.is_nan();
            let close = (*r - *e).abs() <= 1e-2 * e.abs() + 1e-3 * scale + 1e-6;
            // A NaN on one side only is a difference (`close` is false for it).
            !both_nan && !close
        })
        .map(|(i, _)| i)
        .collect();
    let first = *differing.first()?;
    Some(format!(
        "{} of {} elements differ, first at {first}: replayed {}, eager {}",
        differing.len(),
        eager.len(),
        replayed[first],
        eager[first]
    ))
}

/// An autodiff view of `tensor` (on the device without autodiff), a leaf that requires grad
/// when `require_grad`.
fn autodiff_leaf(tensor: &DispatchTensor, require_grad: bool) -> DispatchTensor {
    let leaf = Dispatch::from_inner(tensor.clone());
    if require_grad {
        Dispatch::float_set_require_grad(leaf, true)
    } else {
        leaf
    }
}

/// Reserved bytes of the device's pools (call after a sync).
fn reserved_bytes(dispatch: &DispatchDevice) -> u64 {
    Dispatch::memory_pool_usage(dispatch).map_or(0, |usage| usage.bytes_reserved)
}

/// Captures the members of a group together: the forward graphs in execution order, then the
/// backward graphs in reverse, so that a chained member's input gradients (written by its
/// backward graph) are the previous member's output gradients. `members[0]` has sample inputs
/// (the caller checked that).
pub(crate) fn capture_group(
    members: &[Member<'_>],
    config: &GraphedConfig,
) -> Result<CapturedGroup, GraphedError> {
    let first = members
        .first()
        .and_then(|m| m.sample.as_ref())
        .and_then(|s| s.first())
        .ok_or(GraphedError::NoInputs)?;
    let inner = first.device.clone().inner();
    let dispatch = inner.as_dispatch();
    let cube_device = match dispatch {
        DispatchDevice::Cube(device) => device.clone(),
        #[allow(unreachable_patterns)]
        other => {
            return Err(GraphedError::Unsupported {
                device: format!("{other:?}"),
            });
        }
    };
    let _lock = crate::lock(&CAPTURE_LOCK);
    // Warm-ups, recordings and checks draw from the device generators too: put them back, so
    // that capturing consumes no randomness (a graphed model and an eager copy seeded alike
    // then draw the same masks).
    let generators = crate::rng::save_device_states();
    let captured = capture_locked(members, config, dispatch, &cube_device);
    let restored = crate::rng::restore_device_states(&generators)
        .map_err(capture_error(CapturePhase::StaticBuffers));
    if captured.is_err() || restored.is_err() {
        forget_unrun_metadata(dispatch);
    }
    let captured = captured?;
    restored?;
    Ok(captured)
}

/// [`capture_group`] once the capture lock is held.
fn capture_locked(
    members: &[Member<'_>],
    config: &GraphedConfig,
    dispatch: &DispatchDevice,
    cube_device: &<Cube as burn::backend::BackendTypes>::Device,
) -> Result<CapturedGroup, GraphedError> {
    Dispatch::sync(dispatch).map_err(capture_error(CapturePhase::StaticBuffers))?;
    let reserved_before = reserved_bytes(dispatch);

    // Forwards, in execution order.
    let mut recorded: Vec<Recorded<'_>> = Vec::with_capacity(members.len());
    for (index, member) in members.iter().enumerate() {
        // Static inputs: copies of the sample, or for a chained member the previous member's
        // recorded outputs themselves (without autodiff).
        let (source, static_inputs): (&[FlatTensor], Vec<DispatchTensor>) =
            match (&member.sample, recorded.last()) {
                (Some(sample), _) => (
                    sample,
                    sample.iter().map(|t| fresh_copy(&t.tensor)).collect(),
                ),
                (None, Some(previous)) => (
                    &previous.outputs,
                    previous
                        .outputs
                        .iter()
                        .map(|o| {
                            Tensor::<1>::from_dispatch(o.tensor.clone())
                                .inner()
                                .into_dispatch()
                        })
                        .collect(),
                ),
                (None, None) => return Err(crate::group::first_chained()),
            };
        let autodiff_inputs: Vec<FlatTensor> = source
            .iter()
            .zip(&static_inputs)
            .map(|(tensor, static_input)| FlatTensor {
                tensor: autodiff_leaf(static_input, tensor.require_grad),
                ..tensor.clone()
            })
            .collect();
        let parents = autodiff_inputs.len() + member.params.len();
        if parents > super::node::MAX_PARENTS {
            return Err(GraphedError::TooManyParents {
                parents,
                max: super::node::MAX_PARENTS,
            });
        }
        let mut static_params = Vec::with_capacity(member.params.len());
        let mut autodiff_params = Vec::with_capacity(member.params.len());
        let replacements = member
            .params
            .iter()
            .map(|param| {
                let copy = dense_param_copy(&param.tensor.tensor)?;
                static_params.push(copy.clone());
                let tensor = autodiff_leaf(&copy, param.tensor.require_grad);
                autodiff_params.push(tensor.clone());
                Ok(FlatTensor {
                    tensor,
                    ..param.tensor.clone()
                })
            })
            .collect::<Result<_, GraphedError>>()?;
        let mut member_state = Recorded {
            static_inputs,
            autodiff_inputs,
            static_params,
            autodiff_params,
            run: (member.with_params)(replacements),
            grad_outputs: Vec::new(),
            outputs: Vec::new(),
            forward: None,
        };
        let prepared = Prepared::new(dispatch, CapturePhase::ForwardWarmup)?;
        member_state.warm_up(
            index,
            (config.warmup_iters, config.max_warmup_iters),
            dispatch,
            CapturePhase::ForwardWarmup,
        )?;
        // The autodiff graph built while recording is what the backward capture runs.
        let recording = prepared.record(CapturePhase::Forward)?;
        member_state.outputs = member_state.run(index, CapturePhase::Forward)?;
        let forward = recording.stop(CapturePhase::Forward)?;
        materialize(dispatch, &forward, CapturePhase::Forward)?;
        if config.validate_replay {
            member_state.validate_forward(index, &forward, dispatch)?;
        }
        member_state.forward = Some(forward);
        recorded.push(member_state);
    }

    // Backwards, in reverse order. A member followed by a chained one takes that one's input
    // gradients as its output gradients.
    let chained: Vec<bool> = members.iter().map(|m| m.sample.is_none()).collect();
    let mut parent_grads: Vec<Vec<Option<DispatchTensor>>> = vec![Vec::new(); members.len()];
    let mut backwards = Vec::with_capacity(members.len());
    for index in (0..recorded.len()).rev() {
        let prepared = Prepared::new(dispatch, CapturePhase::BackwardWarmup)?;
        let member_state = &mut recorded[index];
        // Before the warm-up: the recording must launch nothing the warm-up did not (the
        // chained member's gradient buffers can have other strides than zeros made here, and
        // new strides are new kernel metadata; see `warm_up`).
        if chained.get(index + 1).copied().unwrap_or(false) {
            for (slot, grad) in parent_grads[index + 1]
                .iter()
                .take(member_state.grad_outputs.len())
                .enumerate()
            {
                if let Some(grad) = grad {
                    member_state.grad_outputs[slot] = grad.clone();
                }
            }
        }
        member_state.warm_up(
            index,
            (config.warmup_iters, config.max_warmup_iters),
            dispatch,
            CapturePhase::BackwardWarmup,
        )?;
        let loss = surrogate_loss(&member_state.outputs, &member_state.grad_outputs);
        Dispatch::sync(dispatch).map_err(capture_error(CapturePhase::BackwardWarmup))?;
        let recording = prepared.record(CapturePhase::Backward)?;
        let grads = loss.backward();
        let parents = member_state
            .autodiff_inputs
            .iter()
            .map(|input| &input.tensor)
            .chain(&member_state.autodiff_params);
        let mut grads_of_member = Vec::new();
        for (slot, parent) in parents.enumerate() {
            let requires = Dispatch::float_is_require_grad(parent);
            let grad = requires
                .then(|| Tensor::<1>::from_dispatch(parent.clone()).grad(&grads))
                .flatten()
                .map(|grad| grad.into_dispatch());
            let is_input = slot < member_state.autodiff_inputs.len();
            // An unused input of a chained member only means that the previous member's
            // output gets a zero gradient.
            if requires
                && grad.is_none()
                && is_input
                && !chained[index]
                && !config.allow_unused_input
            {
                drop(recording);
                return Err(crate::group::in_group(
                    members.len() == 1,
                    index,
                    GraphedError::UnusedInput { index: slot },
                ));
            }
            grads_of_member.push(grad);
        }
        let backward = recording.stop(CapturePhase::Backward)?;
        materialize(dispatch, &backward, CapturePhase::Backward)?;
        backwards.push(backward);
        drop(grads);
        parent_grads[index] = grads_of_member;
    }
    backwards.reverse();

    // Static buffers; the ones two members share are built once.
    let to_buffer = |tensor: &DispatchTensor| {
        static_fused(tensor, CapturePhase::StaticBuffers).map(StaticBuffer::new)
    };
    let shared = |tensor: &DispatchTensor| to_buffer(tensor).map(Arc::new);
    let outputs: Vec<Vec<Arc<StaticBuffer>>> = recorded
        .iter()
        .map(|r| r.outputs.iter().map(|o| shared(&o.tensor)).collect())
        .collect::<Result<_, _>>()?;
    let grad_parents: Vec<Vec<Option<Arc<StaticBuffer>>>> = parent_grads
        .iter()
        .map(|grads| {
            grads
                .iter()
                .map(|g| g.as_ref().map(shared).transpose())
                .collect()
        })
        .collect::<Result<_, _>>()?;
    let links = Arc::new(GroupLinks::new(chained.clone()));
    let mut sessions = Vec::with_capacity(recorded.len());
    let mut inputs = Vec::with_capacity(recorded.len());
    for (index, (member_state, backward)) in recorded.into_iter().zip(backwards).enumerate() {
        let input_buffers = if chained[index] {
            outputs[index - 1].clone()
        } else {
            member_state
                .static_inputs
                .iter()
                .map(shared)
                .collect::<Result<_, _>>()?
        };
        let next_chained = chained.get(index + 1).copied().unwrap_or(false);
        let grad_outputs = member_state
            .grad_outputs
            .iter()
            .enumerate()
            .map(|(slot, grad)| {
                match grad_parents
                    .get(index + 1)
                    .and_then(|next| next.get(slot))
                    .filter(|_| next_chained)
                {
                    Some(Some(buffer)) => Ok(buffer.clone()),
                    _ => shared(grad),
                }
            })
            .collect::<Result<_, _>>()?;
        let zeros = member_state
            .grad_outputs
            .iter()
            .map(|g| {
                to_buffer(&Dispatch::float_zeros(
                    g.shape(),
                    dispatch,
                    g.dtype().into(),
                ))
            })
            .collect::<Result<_, _>>()?;
        inputs.push(
            member_state
                .autodiff_inputs
                .iter()
                .map(FlatTensor::spec)
                .collect(),
        );
        let forward = member_state.forward.ok_or_else(|| GraphedError::Capture {
            phase: CapturePhase::Forward,
            reason: "no forward graph was recorded".into(),
        })?;
        let session = Arc::new(Session {
            forward,
            backward,
            device: cube_device.clone(),
            inputs: input_buffers,
            params: member_state
                .static_params
                .iter()
                .map(to_buffer)
                .collect::<Result<_, _>>()?,
            outputs: outputs[index].clone(),
            grad_outputs,
            zeros,
            grad_parents: grad_parents[index].clone(),
            output_policy: config.outputs,
            fault: config.fault,
            group: links.clone(),
            member: index,
            thread: std::thread::current().id(),
            state: Mutex::new(SessionState::default()),
        });
        super::session::register(&session);
        sessions.push(session);
    }
    Dispatch::sync(dispatch).map_err(capture_error(CapturePhase::StaticBuffers))?;
    let reserved_captured = reserved_bytes(dispatch);
    if config.release_capture_memory {
        // Every recording has stopped and run (`materialize`): cubecl refuses a cleanup while
        // recording, and one between a warm-up and its recording would make the recording
        // allocate (and guard) fresh pages. Now it frees only empty pages that no graph
        // guards, and evicts only launch metadata that no graph pins (already uploaded).
        Dispatch::memory_cleanup(dispatch);
    }
    let reserved_after = reserved_bytes(dispatch);
    Ok(CapturedGroup {
        sessions,
        inputs,
        pool_growth_bytes: reserved_after.saturating_sub(reserved_before),
        released_bytes: reserved_captured.saturating_sub(reserved_after),
    })
}
