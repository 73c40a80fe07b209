//! The graphed callables' recipes, written with the capture driver's stages (`driver.rs`): a
//! group's forward graphs in execution order, then its backward graphs in reverse; and an
//! inference call's forward graph alone. Both end in one assembly of static buffers and
//! sessions.

use std::sync::{Arc, Mutex};

use burn::backend::ops::FloatTensorOps;
use burn::backend::{
    AutodiffBackend, Backend, Dispatch, DispatchDevice, DispatchTensor, TensorMetadata,
};
use burn::tensor::Tensor;

use super::super::buffers::{
    StaticBuffer, dispatch_of, fused, memory_of, overlaps, static_fused, with_autodiff,
    without_autodiff,
};
use super::super::copy_op::copy_to_new;
use super::super::values::{CapturedGroup, CapturedMember};
use super::driver::{
    CubeDevice, InputView, Pools, autodiff_leaf, cube_device_of, dense_param_copy,
    ordered_param_copy, panic_message, static_inputs, under_lock, warm_up,
};
use super::graphs::Graphs;
use super::lifecycle::{RecordedGraph, capture_error};
use super::param_claim;
use super::session::{GroupLinks, Session, SessionState};
use super::validate::validate_forward;
use crate::callable::{Member, Runner, first_chained, in_group, misfit};
use crate::config::GraphedConfig;
use crate::error::{CapturePhase, GraphedError};
use crate::tensors::{FlatTensor, TensorSpec};

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
    /// The inputs as the call gives them (for a chained member: the previous outputs).
    inputs: Vec<TensorSpec>,
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

    /// One eager run of a warm-up ([`warm_up`]): the forward and, for a training call, the
    /// backward of the surrogate loss; what must be held until the device synchronized comes
    /// back. Each run syncs where the recordings end (after the forward, after building the
    /// surrogate loss), so that fusion cuts the work into the same kernels as in the forward
    /// and backward recordings: kernels that only the recording launches carry metadata that
    /// is first seen there (see `lifecycle::materialize`).
    fn warm_up_run(
        &mut self,
        index: usize,
        dispatch: &DispatchDevice,
        phase: CapturePhase,
    ) -> Result<((), Vec<FlatTensor>), GraphedError> {
        let outputs = self.run(index, phase)?;
        if !self.training {
            return Ok(((), outputs));
        }
        let sync = || Dispatch::sync(dispatch).map_err(capture_error(phase));
        if self.grad_outputs.is_empty() {
            self.grad_outputs = outputs
                .iter()
                .filter(|o| o.is_float())
                .map(|o| Dispatch::float_zeros(o.shape.clone().into(), dispatch, o.dtype.into()))
                .collect();
        }
        sync()?;
        let loss = surrogate_loss(&outputs, &self.grad_outputs);
        sync()?;
        let grads = loss.backward();
        sync()?;
        drop((outputs, grads));
        Ok(((), Vec::new()))
    }
}

/// Captures the members of a group together: the forward graphs in execution order, then the
/// backward graphs in reverse, so that a chained member's input gradients (written by its
/// backward graph) are the previous member's output gradients. `members[0]` has sample inputs
/// (the caller checked that).
///
/// # Errors
///
/// [`GraphedError::Unsupported`] off cubecl; the error of the stage that failed, with the
/// device usable and the generators as they were.
pub(crate) fn capture_group(
    members: &[Member<'_>],
    config: &GraphedConfig,
) -> Result<CapturedGroup<Graphs>, GraphedError> {
    let first = members
        .first()
        .and_then(|m| m.sample.as_ref())
        .and_then(|s| s.first())
        .ok_or(GraphedError::NoInputs)?;
    let (dispatch, cube_device) = cube_device_of(first)?;
    let what = match members.len() {
        1 => "burn-graphed: capturing a graphed callable".to_string(),
        n => format!("burn-graphed: capturing a group of {n} graphed callables"),
    };
    under_lock(&dispatch, what, |_| {
        let pools = Pools::start(&dispatch)?;
        let mut recorded: Vec<Recorded<'_>> = Vec::with_capacity(members.len());
        for (index, member) in members.iter().enumerate() {
            let member_state =
                record_forward(index, member, recorded.last(), true, config, &dispatch)?;
            recorded.push(member_state);
        }

        let chained: Vec<bool> = members.iter().map(|m| m.sample.is_none()).collect();
        let mut parent_grads: Vec<Vec<Option<DispatchTensor>>> = vec![Vec::new(); members.len()];
        let mut backwards = Vec::with_capacity(members.len());
        for index in (0..recorded.len()).rev() {
            // A member followed by a chained one takes that one's input gradients as its
            // output gradients.
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
                &dispatch,
            )?;
            backwards.push(Some(backward));
            parent_grads[index] = grads;
        }
        backwards.reverse();

        assemble(
            recorded,
            backwards,
            (&parent_grads, &chained),
            pools,
            config,
            (&dispatch, &cube_device),
        )
    })
}

/// Captures the forward graph alone of `member`, a call without autodiff (evaluation after
/// `valid()`, serving), as [`record_forward`] does for a training call: static copies of its
/// sample inputs and copies of its parameters in their memory order, all without autodiff. The
/// session has no backward graph, no output gradients and no parents; its buffers are its own
/// (nothing is shared with the training graphs).
///
/// # Errors
///
/// As [`capture_group`].
pub(crate) fn capture_inference(
    member: &Member<'_>,
    config: &GraphedConfig,
) -> Result<CapturedGroup<Graphs>, GraphedError> {
    let sample = member.sample.as_ref().ok_or(GraphedError::NoInputs)?;
    let first = sample.first().ok_or(GraphedError::NoInputs)?;
    let (dispatch, cube_device) = cube_device_of(first)?;
    under_lock(
        &dispatch,
        "burn-graphed: capturing an inference graph",
        |_| {
            let pools = Pools::start(&dispatch)?;
            let recorded = record_forward(0, member, None, false, config, &dispatch)?;
            assemble(
                vec![recorded],
                vec![None],
                (&[Vec::new()], &[false]),
                pools,
                config,
                (&dispatch, &cube_device),
            )
        },
    )
}

/// The forward phase of member `index`: its static inputs (copies of the sample, or for a
/// chained member the `previous` member's recorded outputs themselves) and parameter copies,
/// the warm-up, the recording, its first run and its validation. A `training` call's inputs and
/// parameters are autodiff leaves over dense copies (the backward follows); an inference call's
/// are the copies themselves, its parameters in their memory order ([`ordered_param_copy`]).
fn record_forward<'a>(
    index: usize,
    member: &'a Member<'_>,
    previous: Option<&Recorded<'_>>,
    training: bool,
    config: &GraphedConfig,
    dispatch: &DispatchDevice,
) -> Result<Recorded<'a>, GraphedError> {
    let view = if training {
        InputView::Sampled
    } else {
        InputView::Plain
    };
    let (inputs, (static_inputs, autodiff_inputs)) = match (&member.sample, previous) {
        (Some(sample), _) => (
            sample.iter().map(FlatTensor::spec).collect::<Vec<_>>(),
            static_inputs(sample, view)?,
        ),
        (None, Some(previous)) => {
            let statics: Vec<DispatchTensor> = previous
                .outputs
                .iter()
                .map(|o| without_autodiff(&o.tensor))
                .collect();
            let views = previous
                .outputs
                .iter()
                .zip(&statics)
                .map(|(output, tensor)| FlatTensor {
                    tensor: autodiff_leaf(tensor, output.require_grad),
                    ..output.clone()
                })
                .collect();
            (
                previous.outputs.iter().map(FlatTensor::spec).collect(),
                (statics, views),
            )
        }
        (None, None) => return Err(first_chained()),
    };
    // Parents: the float inputs (int and bool inputs carry no gradient), then the parameters.
    let parents = autodiff_inputs.iter().filter(|i| i.is_float()).count() + member.params.len();
    if training && parents > super::node::MAX_PARENTS {
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
            let (copy, tensor) = if training {
                let copy = dense_param_copy(&param.tensor.tensor)?;
                let leaf = autodiff_leaf(&copy, param.tensor.require_grad);
                autodiff_params.push(leaf.clone());
                (copy, leaf)
            } else {
                let copy = ordered_param_copy(&param.tensor.tensor)?;
                (copy.clone(), copy)
            };
            static_params.push(copy);
            Ok(FlatTensor {
                tensor,
                require_grad: training && param.tensor.require_grad,
                ..param.tensor.clone()
            })
        })
        .collect::<Result<_, GraphedError>>()?;
    let mut member_state = Recorded {
        inputs,
        static_inputs,
        autodiff_inputs,
        static_params,
        autodiff_params,
        run: (member.with_params)(replacements),
        grad_outputs: Vec::new(),
        outputs: Vec::new(),
        forward: None,
        training,
    };
    let warmup = CapturePhase::ForwardWarmup;
    let (warmed, ()) = warm_up(dispatch, config, warmup, || {
        member_state.warm_up_run(index, dispatch, warmup)
    })?;
    // The autodiff graph built while recording is what the backward capture runs.
    let (outputs, forward) = warmed.record(CapturePhase::Forward, || {
        member_state.run(index, CapturePhase::Forward)
    })?;
    member_state.outputs = outputs;
    if config.validate_replay {
        validate_forward(
            index,
            &member_state.static_inputs,
            &member_state.outputs,
            &forward.0,
            dispatch,
            || member_state.run(index, CapturePhase::Validation),
        )?;
    }
    member_state.forward = Some(forward);
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
    // Before the warm-up: the recording must launch nothing the warm-up did not (the chained
    // member's gradient buffers can have other strides than zeros made here, and new strides
    // are new kernel metadata; see `driver::warm_up`).
    for (slot, grad) in next_grads
        .iter()
        .take(member_state.grad_outputs.len())
        .enumerate()
    {
        if let Some(grad) = grad {
            member_state.grad_outputs[slot] = grad.clone();
        }
    }
    let warmup = CapturePhase::BackwardWarmup;
    let (warmed, ()) = warm_up(dispatch, config, warmup, || {
        member_state.warm_up_run(index, dispatch, warmup)
    })?;
    let loss = surrogate_loss(&member_state.outputs, &member_state.grad_outputs);
    Dispatch::sync(dispatch).map_err(capture_error(warmup))?;
    let member_state = &*member_state;
    let ((grads_of_member, grads), backward) = warmed.record(CapturePhase::Backward, || {
        let grads = loss.backward();
        // One slot per parent: the float inputs (by their position among all inputs), then
        // the parameters.
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
            // An unused input of a chained member only means that the previous member's
            // output gets a zero gradient.
            if let Some(position) = input
                && requires
                && grad.is_none()
                && !chained
                && !config.allow_unused_input
            {
                return Err(in_group(
                    alone,
                    index,
                    GraphedError::UnusedInput { index: position },
                ));
            }
            grads_of_member.push(grad);
        }
        // The gradients' container is dropped after the graph's first run (it holds only
        // references to what the graph wrote).
        Ok((grads_of_member, grads))
    })?;
    drop(grads);
    Ok((backward, grads_of_member))
}

/// The last phases: the static buffers of every recorded member (the ones two members share
/// built once) and its session, then the release of the capture's `pools`. A member without a
/// backward graph is an inference call's. `(parent_grads, chained)`: each member's parent
/// gradients, and whether it is chained to the previous member.
fn assemble(
    recorded: Vec<Recorded<'_>>,
    backwards: Vec<Option<RecordedGraph>>,
    (parent_grads, chained): (&[Vec<Option<DispatchTensor>>], &[bool]),
    pools: Pools,
    config: &GraphedConfig,
    (dispatch, cube_device): (&DispatchDevice, &CubeDevice),
) -> Result<CapturedGroup<Graphs>, GraphedError> {
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
        let (forward, forward_contents) =
            member_state.forward.ok_or_else(|| GraphedError::Capture {
                phase: CapturePhase::Forward,
                reason: "no forward graph was recorded".into(),
            })?;
        let training = backward.is_some();
        let (backward, backward_contents) = backward.unzip();
        let session = Arc::new(Session {
            forward,
            backward,
            contents: std::iter::once(forward_contents)
                .chain(backward_contents)
                .collect(),
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
        if training {
            // A fused optimizer may write its update into these parameter buffers.
            param_claim::register(&session);
        }
        members.push(CapturedMember {
            inputs: member_state.inputs,
            outputs: session.outputs.len(),
            static_bytes: session.static_bytes(),
            graphs: Graphs::new(session),
        });
    }
    let pools = pools.release(dispatch, config, CapturePhase::StaticBuffers)?;
    Ok(CapturedGroup {
        members,
        pool_growth_bytes: pools.growth,
        released_bytes: pools.released,
    })
}
