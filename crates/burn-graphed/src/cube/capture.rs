//! Capturing the forward and backward graphs of a callable (the recipe of cubecl 0.11:
//! prepare, warm up, record; then prepare, warm up, record again for the backward).

use std::sync::{Arc, Mutex};

use burn::backend::ops::FloatTensorOps;
use burn::backend::{
    AutodiffBackend, Backend, Cube, Dispatch, DispatchDevice, DispatchTensor, TensorMetadata,
};
use burn::tensor::Tensor;

use super::buffers::{
    StaticBuffer, dispatch_of, fused, memory_of, memory_order, overlaps, static_fused,
    with_autodiff, without_autodiff,
};
use super::copy_op::copy_to_new;
use super::graphs::Graphs;
use super::lifecycle::{
    Preparation, RecordedGraph, capture_error, forget_unrun_metadata, materialize,
};
use super::progress::CaptureProgress;
use super::session::{GroupLinks, Session, SessionState};
use super::validate::validate_forward;
use super::values::{CapturedGroup, CapturedMember};
use super::{param_claim, random_state};
use crate::callable::{Member, Runner, first_chained, in_group, misfit};
use crate::config::GraphedConfig;
use crate::error::{CapturePhase, GraphedError};
use crate::sync::lock;
use crate::tensors::{ElementKind, FlatTensor};

/// The device of burn's cubecl backend, without autodiff.
type CubeDevice = <Cube as burn::backend::BackendTypes>::Device;

/// CUDA captures in global mode: one capture at a time in the whole process.
pub(super) static CAPTURE_LOCK: Mutex<()> = Mutex::new(());

/// A copy of `tensor` (of any kind) in a buffer of its own, on the device without autodiff.
/// Errors like [`static_fused`] for an int or bool tensor that is not on burn's cubecl backend.
pub(super) fn fresh_copy(
    tensor: &DispatchTensor,
    phase: CapturePhase,
) -> Result<DispatchTensor, GraphedError> {
    if ElementKind::of(tensor.dtype()) == ElementKind::Float {
        // `Tensor::inner` is idempotent; `Dispatch::inner` panics on a tensor without autodiff.
        let inner = Tensor::<1>::from_dispatch(tensor.clone())
            .inner()
            .into_dispatch();
        return Ok(Dispatch::float_mul_scalar(inner, 1.0f32.into()));
    }
    let source = static_fused(tensor, phase)?;
    Ok(dispatch_of(copy_to_new(&source)))
}

/// A copy of a parameter in a dense buffer of its own (rows not pitched), on the device without
/// autodiff: a graph's parameter buffer. The Adam kernels bind dense buffers only, so a pitched
/// parameter buffer (cubecl's layout of new tensors on CUDA) would cost every in-place update a
/// dense copy and a copy back (`dense::Target`). Errors like [`static_fused`].
pub(super) fn dense_param_copy(tensor: &DispatchTensor) -> Result<DispatchTensor, GraphedError> {
    let fused = static_fused(tensor, CapturePhase::StaticBuffers)?;
    let copy = <Cube as super::copy_op::StaticCopyOps>::copy_to_new_dense_buffer(&fused);
    Ok(Tensor::<1>::from_primitive::<Cube>(copy).into_dispatch())
}

/// A copy of a float parameter for an inference graph: dense as [`dense_param_copy`]'s, laid
/// out in the parameter's memory order (an int or bool parameter: [`dense_param_copy`]). A
/// weight stored transposed (burn's `LinearLayout::Col`, as PyTorch stores a linear weight)
/// stays a transposed view, so the graph's kernels see a column-major matrix, as an eager
/// call's do: the graph runs the kernels (the autotune keys) eager code runs on this model.
/// Inference graphs only: the optimizers' kernels bind row-major buffers. Errors like
/// [`static_fused`].
pub(super) fn ordered_param_copy(tensor: &DispatchTensor) -> Result<DispatchTensor, GraphedError> {
    if ElementKind::of(tensor.dtype()) != ElementKind::Float {
        return dense_param_copy(tensor);
    }
    let fused = static_fused(tensor, CapturePhase::StaticBuffers)?;
    let order = memory_order(&fused);
    if super::dense::is_identity(&order) {
        return dense_param_copy(tensor);
    }
    let inner = Tensor::<1>::from_dispatch(tensor.clone())
        .inner()
        .into_dispatch();
    // In memory order the view is row-major: its dense copy holds the values in the same order.
    let copy = dense_param_copy(&Dispatch::float_permute(inner, &order))?;
    let mut back = vec![0; order.len()];
    for (at, dim) in order.iter().enumerate() {
        back[*dim] = at;
    }
    Ok(Dispatch::float_permute(copy, &back))
}

/// The message of a caught panic, when it carries one.
pub(super) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(no message)".into())
}

/// One eager forward and backward with gradient `grad_outputs` on the outputs, returning the
/// outputs (kept alive by the caller until the device synchronized).
/// `grad_outputs` has one gradient per float output; int and bool outputs carry none.
fn surrogate_loss(outputs: &[FlatTensor], grad_outputs: &[DispatchTensor]) -> Tensor<1> {
    let mut total: Option<DispatchTensor> = None;
    for (output, grad) in outputs.iter().filter(|o| o.is_float()).zip(grad_outputs) {
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
    Tensor::<1>::from_dispatch(total.expect("`Recorded::run` refuses outputs without a float"))
}

/// `outputs`, where each output whose memory is that of one of `inputs` or of an earlier
/// output (a mask passed on to the next callable, as it is or as a view: burn's reshapes and
/// broadcasts keep the buffer) is replaced by a copy of its own, made by the callable's run and
/// so recorded with it. Every output then has a buffer of its own: one handed out over an
/// input buffer would change with the next call's input copy, and two records over one buffer
/// would each keep it from ever looking free to the other. A float output stays in autodiff
/// (its gradient flows through the copy).
fn own_buffers(outputs: Vec<FlatTensor>, inputs: &[FlatTensor]) -> Vec<FlatTensor> {
    let mut taken: Vec<_> = inputs
        .iter()
        .filter_map(|input| fused(&input.tensor))
        .map(|buffer| memory_of(&buffer))
        .collect();
    outputs
        .into_iter()
        .map(|output| {
            let Some(buffer) = fused(&output.tensor) else {
                return output;
            };
            let memory = memory_of(&buffer);
            if !taken.iter().any(|other| overlaps(*other, memory)) {
                taken.push(memory);
                return output;
            }
            let tensor = if output.is_float() {
                Dispatch::float_mul_scalar(output.tensor.clone(), 1.0f32.into())
            } else {
                with_autodiff(&dispatch_of(copy_to_new(&buffer)))
            };
            FlatTensor { tensor, ..output }
        })
        .collect()
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
    forward: Option<RecordedGraph>,
    /// Whether the call trains (a backward follows its forward); `false` for an inference
    /// call, whose outputs need no float among them and whose warm-ups run no backward.
    training: bool,
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
        .ok_or_else(|| misfit(index, self.autodiff_inputs.len()))?;
        if outputs.is_empty() {
            return Err(GraphedError::NoOutputs);
        }
        if self.training && !outputs.iter().any(FlatTensor::is_float) {
            let outputs = outputs
                .iter()
                .map(|o| format!("{:?} {:?}", o.kind(), o.shape))
                .collect::<Vec<_>>()
                .join(", ");
            return Err(GraphedError::NoFloatOutput { outputs });
        }
        // Asking where the outputs lie runs the queued work: work that reads a tensor the
        // device never wrote fails there, and fusion panics with the reason. That is a capture
        // error (the caller then names the unwritten sample tensor), not a panic.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            own_buffers(outputs, &self.autodiff_inputs)
        }))
        .map_err(|panic| GraphedError::Capture {
            phase,
            reason: format!(
                "running the callable's work failed: {}",
                panic_message(&*panic)
            ),
        })
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
            if !self.training {
                sync()?;
                drop(outputs);
            } else {
                self.train_warm_up_step(outputs, dispatch, phase)?;
            }
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

    /// The backward half of a training warm-up run, on `outputs` of its forward.
    fn train_warm_up_step(
        &mut self,
        outputs: Vec<FlatTensor>,
        dispatch: &DispatchDevice,
        phase: CapturePhase,
    ) -> Result<(), GraphedError> {
        let sync = || Dispatch::sync(dispatch).map_err(capture_error(phase));
        {
            if self.grad_outputs.is_empty() {
                self.grad_outputs = outputs
                    .iter()
                    .filter(|o| o.is_float())
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
        }
        Ok(())
    }
}

/// An autodiff view of `tensor` (on the device without autodiff), a leaf that requires grad
/// when `require_grad` (float tensors only: int and bool tensors never do).
pub(super) fn autodiff_leaf(tensor: &DispatchTensor, require_grad: bool) -> DispatchTensor {
    if ElementKind::of(tensor.dtype()) != ElementKind::Float {
        return with_autodiff(tensor);
    }
    let leaf = Dispatch::from_inner(tensor.clone());
    if require_grad {
        Dispatch::float_set_require_grad(leaf, true)
    } else {
        leaf
    }
}

/// Reserved bytes of the device's pools (call after a sync).
pub(super) fn reserved_bytes(dispatch: &DispatchDevice) -> u64 {
    Dispatch::memory_pool_usage(dispatch).map_or(0, |usage| usage.bytes_reserved)
}

/// Captures the members of a group together: the forward graphs in execution order, then the
/// backward graphs in reverse, so that a chained member's input gradients (written by its
/// backward graph) are the previous member's output gradients. `members[0]` has sample inputs
/// (the caller checked that).
pub(crate) fn capture_group(
    members: &[Member<'_>],
    config: &GraphedConfig,
) -> Result<CapturedGroup<Graphs>, GraphedError> {
    let first = members
        .first()
        .and_then(|m| m.sample.as_ref())
        .and_then(|s| s.first())
        .ok_or(GraphedError::NoInputs)?;
    let _progress = CaptureProgress::start(match members.len() {
        1 => "burn-graphed: capturing a graphed callable".to_string(),
        n => format!("burn-graphed: capturing a group of {n} graphed callables"),
    });
    under_capture_lock(first, |dispatch, cube_device| {
        capture_locked(members, config, dispatch, cube_device)
    })
}

/// Runs `capture` on the cubecl device of `first` (a sample input), holding the capture lock,
/// and gives its result back with the device generators as they were before (warm-ups,
/// recordings and checks draw from them too: capturing consumes no randomness, so a graphed
/// model and an eager copy seeded alike draw the same masks). After a failure, the kernel
/// metadata the failed recording cached and never ran is forgotten.
///
/// # Errors
///
/// [`GraphedError::Unsupported`] off cubecl; `capture`'s error; a capture error when the
/// generators could not be put back.
fn under_capture_lock<T>(
    first: &FlatTensor,
    capture: impl FnOnce(&DispatchDevice, &CubeDevice) -> Result<T, GraphedError>,
) -> Result<T, GraphedError> {
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
    let _lock = lock(&CAPTURE_LOCK);
    let generators = random_state::save();
    let captured = capture(dispatch, &cube_device);
    let restored =
        random_state::restore(&generators).map_err(capture_error(CapturePhase::StaticBuffers));
    if captured.is_err() || restored.is_err() {
        forget_unrun_metadata(dispatch);
    }
    let captured = captured?;
    restored?;
    Ok(captured)
}

/// [`capture_group`] once the capture lock is held: the forwards, the backwards, the sessions.
fn capture_locked(
    members: &[Member<'_>],
    config: &GraphedConfig,
    dispatch: &DispatchDevice,
    cube_device: &CubeDevice,
) -> Result<CapturedGroup<Graphs>, GraphedError> {
    Dispatch::sync(dispatch).map_err(capture_error(CapturePhase::StaticBuffers))?;
    let reserved_before = reserved_bytes(dispatch);

    let mut recorded: Vec<Recorded<'_>> = Vec::with_capacity(members.len());
    for (index, member) in members.iter().enumerate() {
        let member_state = record_forward(index, member, recorded.last(), config, dispatch)?;
        recorded.push(member_state);
    }

    let chained: Vec<bool> = members.iter().map(|m| m.sample.is_none()).collect();
    let mut parent_grads: Vec<Vec<Option<DispatchTensor>>> = vec![Vec::new(); members.len()];
    let mut backwards = Vec::with_capacity(members.len());
    for index in (0..recorded.len()).rev() {
        // A member followed by a chained one takes that one's input gradients as its output
        // gradients.
        let next_grads = match chained.get(index + 1) {
            Some(true) => parent_grads[index + 1].as_slice(),
            _ => &[],
        };
        let (backward, grads) = record_backward(
            index,
            &mut recorded[index],
            next_grads,
            (chained[index], members.len() == 1),
            config,
            dispatch,
        )?;
        backwards.push(backward);
        parent_grads[index] = grads;
    }
    backwards.reverse();

    let members = assemble(
        recorded,
        backwards,
        &parent_grads,
        &chained,
        config,
        dispatch,
        cube_device,
    )?;
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
        members,
        pool_growth_bytes: reserved_after.saturating_sub(reserved_before),
        released_bytes: reserved_captured.saturating_sub(reserved_after),
    })
}

/// The forward phase of member `index`: its static inputs (copies of the sample, or for a
/// chained member the `previous` member's recorded outputs themselves) and dense parameter
/// copies, the warm-up, the recording, its first run and its validation.
fn record_forward<'a>(
    index: usize,
    member: &'a Member<'_>,
    previous: Option<&Recorded<'_>>,
    config: &GraphedConfig,
    dispatch: &DispatchDevice,
) -> Result<Recorded<'a>, GraphedError> {
    let (source, static_inputs): (&[FlatTensor], Vec<DispatchTensor>) =
        match (&member.sample, previous) {
            (Some(sample), _) => (
                sample,
                sample
                    .iter()
                    .map(|t| fresh_copy(&t.tensor, CapturePhase::StaticBuffers))
                    .collect::<Result<_, _>>()?,
            ),
            (None, Some(previous)) => (
                &previous.outputs,
                previous
                    .outputs
                    .iter()
                    .map(|o| without_autodiff(&o.tensor))
                    .collect(),
            ),
            (None, None) => return Err(first_chained()),
        };
    let autodiff_inputs: Vec<FlatTensor> = source
        .iter()
        .zip(&static_inputs)
        .map(|(tensor, static_input)| FlatTensor {
            tensor: autodiff_leaf(static_input, tensor.require_grad),
            ..tensor.clone()
        })
        .collect();
    // Parents: the float inputs (int and bool inputs carry no gradient), then the parameters.
    let parents = autodiff_inputs.iter().filter(|i| i.is_float()).count() + member.params.len();
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
        training: true,
    };
    let prepared = Preparation::new(dispatch, CapturePhase::ForwardWarmup)?;
    member_state.warm_up(
        index,
        (config.warmup_iters, config.max_warmup_iters),
        dispatch,
        CapturePhase::ForwardWarmup,
    )?;
    // The autodiff graph built while recording is what the backward capture runs.
    let recording = prepared.record(CapturePhase::Forward)?;
    member_state.outputs = member_state.run(index, CapturePhase::Forward)?;
    let (forward, contents) = recording.stop(CapturePhase::Forward)?;
    materialize(dispatch, &forward, CapturePhase::Forward)?;
    if config.validate_replay {
        validate_forward(
            index,
            &member_state.static_inputs,
            &member_state.outputs,
            &forward,
            dispatch,
            || member_state.run(index, CapturePhase::Validation),
        )?;
    }
    member_state.forward = Some((forward, contents));
    Ok(member_state)
}

/// The backward phase of member `index`: the warm-up and the recording of the backward of its
/// recorded forward, fed `next_grads` (the next member's input gradients, where it is chained
/// to this one) or zeros as output gradients. Returns the graph and the gradient of each parent
/// slot (float inputs, then parameters). `(chained, alone)`: whether this member is chained to the
/// previous one, and whether it is the only member.
fn record_backward(
    index: usize,
    member_state: &mut Recorded<'_>,
    next_grads: &[Option<DispatchTensor>],
    (chained, alone): (bool, bool),
    config: &GraphedConfig,
    dispatch: &DispatchDevice,
) -> Result<(RecordedGraph, Vec<Option<DispatchTensor>>), GraphedError> {
    let prepared = Preparation::new(dispatch, CapturePhase::BackwardWarmup)?;
    // Before the warm-up: the recording must launch nothing the warm-up did not (the chained
    // member's gradient buffers can have other strides than zeros made here, and new strides
    // are new kernel metadata; see `Recorded::warm_up`).
    for (slot, grad) in next_grads
        .iter()
        .take(member_state.grad_outputs.len())
        .enumerate()
    {
        if let Some(grad) = grad {
            member_state.grad_outputs[slot] = grad.clone();
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
    // One slot per parent: the float inputs (by their position among all inputs), then the
    // parameters.
    let parents = member_state
        .autodiff_inputs
        .iter()
        .enumerate()
        .filter(|(_, input)| input.is_float())
        .map(|(position, input)| (Some(position), &input.tensor))
        .chain(member_state.autodiff_params.iter().map(|p| (None, p)));
    let mut grads_of_member = Vec::new();
    for (input, parent) in parents {
        let requires = Dispatch::float_is_require_grad(parent);
        let grad = requires
            .then(|| Tensor::<1>::from_dispatch(parent.clone()).grad(&grads))
            .flatten()
            .map(|grad| grad.into_dispatch());
        // An unused input of a chained member only means that the previous member's output
        // gets a zero gradient.
        if let Some(position) = input
            && requires
            && grad.is_none()
            && !chained
            && !config.allow_unused_input
        {
            drop(recording);
            return Err(in_group(
                alone,
                index,
                GraphedError::UnusedInput { index: position },
            ));
        }
        grads_of_member.push(grad);
    }
    let (backward, contents) = recording.stop(CapturePhase::Backward)?;
    materialize(dispatch, &backward, CapturePhase::Backward)?;
    drop(grads);
    Ok(((backward, contents), grads_of_member))
}

/// The last phase: the static buffers of every recorded member (the ones two members share
/// built once) and its session.
fn assemble(
    recorded: Vec<Recorded<'_>>,
    backwards: Vec<RecordedGraph>,
    parent_grads: &[Vec<Option<DispatchTensor>>],
    chained: &[bool],
    config: &GraphedConfig,
    dispatch: &DispatchDevice,
    cube_device: &CubeDevice,
) -> Result<Vec<CapturedMember<Graphs>>, GraphedError> {
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
    let links = Arc::new(GroupLinks::new(chained.to_vec()));
    let fault = crate::faults::injected();
    let mut members = Vec::with_capacity(recorded.len());
    for (index, (member_state, (backward, backward_contents))) in
        recorded.into_iter().zip(backwards).enumerate()
    {
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
        let inputs = member_state
            .autodiff_inputs
            .iter()
            .map(FlatTensor::spec)
            .collect();
        let (forward, forward_contents) =
            member_state.forward.ok_or_else(|| GraphedError::Capture {
                phase: CapturePhase::Forward,
                reason: "no forward graph was recorded".into(),
            })?;
        let session = Arc::new(Session {
            forward,
            backward: Some(backward),
            contents: vec![forward_contents, backward_contents],
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
            fault,
            group: links.clone(),
            member: index,
            thread: std::thread::current().id(),
            state: Mutex::new(SessionState::default()),
        });
        param_claim::register(&session);
        members.push(CapturedMember {
            inputs,
            outputs: session.outputs.len(),
            static_bytes: session.static_bytes(),
            graphs: Graphs::new(session),
        });
    }
    Ok(members)
}

/// Captures the forward graph alone of `member`, a call without autodiff (evaluation after
/// `valid()`, serving): static copies of its sample inputs and dense copies of its parameters
/// on the device without autodiff, the warm-up, the recording, its first run and its
/// validation, as for a training call. The session has no backward graph, no output gradients
/// and no parents; its buffers are its own (nothing is shared with the training graphs).
pub(crate) fn capture_inference(
    member: &Member<'_>,
    config: &GraphedConfig,
) -> Result<CapturedGroup<Graphs>, GraphedError> {
    let sample = member.sample.as_ref().ok_or(GraphedError::NoInputs)?;
    let first = sample.first().ok_or(GraphedError::NoInputs)?;
    let _progress = CaptureProgress::start("burn-graphed: capturing an inference graph");
    under_capture_lock(first, |dispatch, cube_device| {
        inference_locked(member, sample, config, dispatch, cube_device)
    })
}

/// [`capture_inference`] once the capture lock is held.
fn inference_locked(
    member: &Member<'_>,
    sample: &[FlatTensor],
    config: &GraphedConfig,
    dispatch: &DispatchDevice,
    cube_device: &CubeDevice,
) -> Result<CapturedGroup<Graphs>, GraphedError> {
    let phase = CapturePhase::StaticBuffers;
    Dispatch::sync(dispatch).map_err(capture_error(phase))?;
    let reserved_before = reserved_bytes(dispatch);
    let static_inputs = sample
        .iter()
        .map(|t| fresh_copy(&t.tensor, phase))
        .collect::<Result<Vec<_>, _>>()?;
    let inputs: Vec<FlatTensor> = sample
        .iter()
        .zip(&static_inputs)
        .map(|(t, tensor)| FlatTensor {
            tensor: tensor.clone(),
            require_grad: false,
            ..t.clone()
        })
        .collect();
    let static_params = member
        .params
        .iter()
        .map(|p| ordered_param_copy(&p.tensor.tensor))
        .collect::<Result<Vec<_>, _>>()?;
    let replacements = member
        .params
        .iter()
        .zip(&static_params)
        .map(|(p, tensor)| FlatTensor {
            tensor: tensor.clone(),
            require_grad: false,
            ..p.tensor.clone()
        })
        .collect();
    let mut recorded = Recorded {
        static_inputs,
        autodiff_inputs: inputs,
        static_params,
        autodiff_params: Vec::new(),
        run: (member.with_params)(replacements),
        grad_outputs: Vec::new(),
        outputs: Vec::new(),
        forward: None,
        training: false,
    };
    let prepared = Preparation::new(dispatch, CapturePhase::ForwardWarmup)?;
    recorded.warm_up(
        0,
        (config.warmup_iters, config.max_warmup_iters),
        dispatch,
        CapturePhase::ForwardWarmup,
    )?;
    let recording = prepared.record(CapturePhase::Forward)?;
    recorded.outputs = recorded.run(0, CapturePhase::Forward)?;
    let (forward, contents) = recording.stop(CapturePhase::Forward)?;
    materialize(dispatch, &forward, CapturePhase::Forward)?;
    if config.validate_replay {
        validate_forward(
            0,
            &recorded.static_inputs,
            &recorded.outputs,
            &forward,
            dispatch,
            || recorded.run(0, CapturePhase::Validation),
        )?;
    }
    let to_buffer = |tensor: &DispatchTensor| static_fused(tensor, phase).map(StaticBuffer::new);
    let shared = |tensor: &DispatchTensor| to_buffer(tensor).map(Arc::new);
    let session = Arc::new(Session {
        forward,
        backward: None,
        contents: vec![contents],
        device: cube_device.clone(),
        inputs: recorded
            .static_inputs
            .iter()
            .map(shared)
            .collect::<Result<_, _>>()?,
        params: recorded
            .static_params
            .iter()
            .map(to_buffer)
            .collect::<Result<_, _>>()?,
        outputs: recorded
            .outputs
            .iter()
            .map(|o| shared(&o.tensor))
            .collect::<Result<_, _>>()?,
        grad_outputs: Vec::new(),
        zeros: Vec::new(),
        grad_parents: Vec::new(),
        output_policy: config.outputs,
        fault: crate::faults::injected(),
        group: Arc::new(GroupLinks::new(vec![false])),
        member: 0,
        thread: std::thread::current().id(),
        state: Mutex::new(SessionState::default()),
    });
    Dispatch::sync(dispatch).map_err(capture_error(phase))?;
    let reserved_captured = reserved_bytes(dispatch);
    if config.release_capture_memory {
        Dispatch::memory_cleanup(dispatch);
    }
    let reserved_after = reserved_bytes(dispatch);
    Ok(CapturedGroup {
        members: vec![CapturedMember {
            inputs: sample.iter().map(FlatTensor::spec).collect(),
            outputs: session.outputs.len(),
            static_bytes: session.static_bytes(),
            graphs: Graphs::new(session),
        }],
        pool_growth_bytes: reserved_after.saturating_sub(reserved_before),
        released_bytes: reserved_captured.saturating_sub(reserved_after),
    })
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use burn::tensor::{Device, Tensor, TensorData};

    use super::super::buffers::{fused, memory_of, memory_order, resolve};
    use super::super::dense::copy_values;
    use super::ordered_param_copy;

    fn counting<const D: usize>(shape: [usize; D], device: &Device) -> Tensor<D> {
        let len = shape.iter().product::<usize>();
        let values: Vec<f32> = (0..len).map(|i| i as f32).collect();
        Tensor::from_data(TensorData::new(values, shape), device)
    }

    /// An inference graph's copy of a parameter keeps its memory order in a buffer of its own:
    /// a transposed view (burn's `LinearLayout::Col`) stays transposed, a row-major tensor
    /// row-major, a rank-3 view in a cyclic order keeps that order (its inverse is not itself),
    /// and each holds the parameter's values.
    #[test]
    fn ordered_param_copy_keeps_the_memory_order() {
        let device = Device::wgpu(Default::default());
        let matrix = counting([3, 4], &device);
        let cube = counting([2, 3, 4], &device);
        let cases: [(Tensor<3>, Vec<usize>); 3] = [
            (matrix.clone().transpose().unsqueeze(), vec![0, 2, 1]),
            (matrix.unsqueeze(), vec![0, 1, 2]),
            // Dimension 0 of the view is the stored last one, and so on: in memory order the
            // view's dimensions are [1, 2, 0].
            (cube.permute([2, 0, 1]), vec![1, 2, 0]),
        ];
        for (param, order) in cases {
            let dispatch = param.clone().into_dispatch();
            let source = memory_of(&fused(&dispatch).expect("cube"));
            let copy = ordered_param_copy(&dispatch).expect("copy");
            let copied = fused(&copy).expect("cube");
            assert_eq!(memory_order(&copied), order);
            assert_ne!(memory_of(&copied).0, source.0, "a buffer of its own");
            Tensor::<3>::from_dispatch(copy)
                .to_data()
                .assert_eq(&param.to_data(), true);
        }
    }

    /// A copy into a transposed buffer large enough that cubecl's copy packs several elements
    /// per unit (as every refresh of an inference graph's transposed weight is) puts each value
    /// in its place, from a transposed source and from a row-major one.
    #[test]
    fn copies_into_a_transposed_buffer_land_in_place() {
        let device = Device::wgpu(Default::default());
        let stored = counting([512, 512], &device);
        let destination = ordered_param_copy(&stored.clone().transpose().into_dispatch())
            .expect("a transposed buffer");
        let destination = fused(&destination).expect("cube");
        let destination_cube = resolve(&destination);
        let row_major = counting([512, 512], &device).mul_scalar(2.0);
        for source in [stored.clone().mul_scalar(3.0).transpose(), row_major] {
            let expected = source.to_data();
            let source_cube = resolve(&fused(&source.into_dispatch()).expect("cube"));
            copy_values(&source_cube, &destination_cube);
            Tensor::<2>::from_primitive::<burn::backend::Cube>(destination.clone())
                .to_data()
                .assert_eq(&expected, true);
        }
    }
}
