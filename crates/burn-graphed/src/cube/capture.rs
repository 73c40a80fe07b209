//! Capturing the forward and backward graphs of a callable (the recipe of cubecl 0.11:
//! prepare, warm up, record; then prepare, warm up, record again for the backward).

use std::sync::{Arc, Mutex};

use burn::backend::ops::FloatTensorOps;
use burn::backend::{
    AutodiffBackend, Backend, Cube, Dispatch, DispatchDevice, DispatchTensor, TensorMetadata,
};
use burn::module::Module;
use burn::tensor::{Device, Tensor};

use super::buffers::{FusedTensor, StaticBuffer};
use super::session::{Session, SessionState};
use crate::config::GraphedConfig;
use crate::error::{CapturePhase, GraphedError};
use crate::params::{self, ParamEntry};
use crate::tensors::{FlatTensor, TensorGroup};

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

/// A copy of `tensor` in a buffer of its own, on the device without autodiff.
fn fresh_copy(tensor: &DispatchTensor) -> DispatchTensor {
    // `Tensor::inner` is idempotent; `Dispatch::inner` panics on a tensor without autodiff.
    let inner = Tensor::<1>::from_dispatch(tensor.clone())
        .inner()
        .into_dispatch();
    Dispatch::float_mul_scalar(inner, 1.0f32.into())
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
        Ok(Self { device, open: true })
    }

    fn stop(mut self, phase: CapturePhase) -> Result<burn::backend::DispatchGraph, GraphedError> {
        self.open = false;
        Dispatch::graph_stop_capture(self.device).map_err(|error| GraphedError::Capture {
            phase,
            reason: error.to_string(),
        })
    }
}

impl Drop for Recording<'_> {
    fn drop(&mut self) {
        if self.open {
            // The recording is abandoned; its error says only that, so it is not reported.
            let _ = Dispatch::graph_stop_capture(self.device);
        }
    }
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

/// What a successful capture hands to the graphed module.
pub(crate) struct Captured {
    pub session: Arc<Session>,
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

/// Captures `call` on `module` with `sample` inputs.
pub(crate) fn capture<M, I, O>(
    module: &M,
    call: fn(&M, I) -> O,
    sample: Vec<FlatTensor>,
    module_params: &[ParamEntry],
    config: &GraphedConfig,
) -> Result<Captured, GraphedError>
where
    M: Module,
    I: TensorGroup,
    O: TensorGroup,
{
    let device = sample[0].device.clone();
    let inner = device.clone().inner();
    let dispatch = inner.as_dispatch();
    let _lock = CAPTURE_LOCK
        .lock()
        .unwrap_or_else(|poison| poison.into_inner());

    // Static inputs and parameter copies, with the autodiff views the callable runs on.
    let static_inputs: Vec<DispatchTensor> = sample.iter().map(|t| fresh_copy(&t.tensor)).collect();
    let autodiff_inputs: Vec<FlatTensor> = sample
        .iter()
        .zip(&static_inputs)
        .map(|(sample, copy)| {
            let mut tensor = Dispatch::from_inner(copy.clone());
            if sample.require_grad {
                tensor = Dispatch::float_set_require_grad(tensor, true);
            }
            FlatTensor {
                tensor,
                ..sample.clone()
            }
        })
        .collect();
    let mut static_params = Vec::with_capacity(module_params.len());
    let mut autodiff_params = Vec::with_capacity(module_params.len());
    let capture_module = params::replace(module.clone(), |_, param| {
        let copy = fresh_copy(&param.tensor);
        static_params.push(copy.clone());
        let mut tensor = Dispatch::from_inner(copy);
        if param.require_grad {
            tensor = Dispatch::float_set_require_grad(tensor, true);
        }
        autodiff_params.push(tensor.clone());
        FlatTensor { tensor, ..param }
    });

    // A panic in the callable (e.g. a host read that the device refuses inside a capture)
    // becomes an error of the step it happened in; `Recording` ends an open capture on the way.
    let run = |inputs: &[FlatTensor], phase| -> Result<Vec<FlatTensor>, GraphedError> {
        let input = I::unflatten(inputs.to_vec()).ok_or(GraphedError::InputCount {
            expected: inputs.len(),
            got: inputs.len(),
        })?;
        let outputs = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            call(&capture_module, input)
        }))
        .map_err(|panic| GraphedError::Capture {
            phase,
            reason: format!("the callable panicked: {}", panic_message(&*panic)),
        })?
        .flatten();
        if outputs.is_empty() {
            return Err(GraphedError::NoOutputs);
        }
        Ok(outputs)
    };

    // Forward warm-up (with backward, so that both paths are tuned and pooled).
    let prepared = Prepared::new(dispatch, CapturePhase::ForwardWarmup)?;
    let mut grad_outputs: Vec<DispatchTensor> = Vec::new();
    let warmup = |grad_outputs: &mut Vec<DispatchTensor>, phase| -> Result<(), GraphedError> {
        for _ in 0..config.warmup_iters.max(1) {
            let outputs = run(&autodiff_inputs, phase)?;
            if grad_outputs.is_empty() {
                *grad_outputs = outputs
                    .iter()
                    .map(|o| {
                        Dispatch::float_zeros(o.shape.clone().into(), dispatch, o.dtype.into())
                    })
                    .collect();
            }
            let loss = surrogate_loss(&outputs, grad_outputs);
            let grads = loss.backward();
            Dispatch::sync(dispatch).map_err(capture_error(phase))?;
            drop((outputs, grads));
        }
        Ok(())
    };
    warmup(&mut grad_outputs, CapturePhase::ForwardWarmup)?;

    // Forward capture: the autodiff graph built here is what the backward capture runs.
    let recording = prepared.record(CapturePhase::Forward)?;
    let outputs = run(&autodiff_inputs, CapturePhase::Forward)?;
    let forward = recording.stop(CapturePhase::Forward)?;

    // Backward warm-up in fresh memory, then the backward capture.
    let prepared = Prepared::new(dispatch, CapturePhase::BackwardWarmup)?;
    warmup(&mut grad_outputs, CapturePhase::BackwardWarmup)?;
    let loss = surrogate_loss(&outputs, &grad_outputs);
    Dispatch::sync(dispatch).map_err(capture_error(CapturePhase::BackwardWarmup))?;
    let recording = prepared.record(CapturePhase::Backward)?;
    let grads = loss.backward();
    let parents: Vec<&DispatchTensor> = autodiff_inputs
        .iter()
        .map(|input| &input.tensor)
        .chain(&autodiff_params)
        .collect();
    let mut parent_grads = Vec::with_capacity(parents.len());
    for (slot, parent) in parents.iter().enumerate() {
        let requires = Dispatch::float_is_require_grad(parent);
        let grad = requires
            .then(|| Tensor::<1>::from_dispatch((*parent).clone()).grad(&grads))
            .flatten()
            .map(|grad| grad.into_dispatch());
        if requires && grad.is_none() && slot < sample.len() && !config.allow_unused_input {
            drop(recording);
            return Err(GraphedError::UnusedInput { index: slot });
        }
        parent_grads.push(grad);
    }
    let backward = recording.stop(CapturePhase::Backward)?;
    drop(grads);

    let to_buffer = |tensor: &DispatchTensor| -> Result<StaticBuffer, GraphedError> {
        let fused = fused(tensor).ok_or_else(|| GraphedError::Capture {
            phase: CapturePhase::StaticBuffers,
            reason: "a static tensor is not on burn's cubecl backend".into(),
        })?;
        Ok(StaticBuffer::new(fused))
    };
    let zeros = grad_outputs
        .iter()
        .map(|g| Dispatch::float_zeros(g.shape(), dispatch, g.dtype().into()))
        .collect::<Vec<_>>();
    let session = Session {
        forward,
        backward,
        device: match dispatch {
            DispatchDevice::Cube(device) => device.clone(),
            #[allow(unreachable_patterns)]
            other => {
                return Err(GraphedError::Unsupported {
                    device: format!("{other:?}"),
                });
            }
        },
        inputs: static_inputs
            .iter()
            .map(to_buffer)
            .collect::<Result<_, _>>()?,
        params: static_params
            .iter()
            .map(to_buffer)
            .collect::<Result<_, _>>()?,
        outputs: outputs
            .iter()
            .map(|o| to_buffer(&o.tensor))
            .collect::<Result<_, _>>()?,
        grad_outputs: grad_outputs
            .iter()
            .map(to_buffer)
            .collect::<Result<_, _>>()?,
        zeros: zeros.iter().map(to_buffer).collect::<Result<_, _>>()?,
        grad_parents: parent_grads
            .iter()
            .map(|g| g.as_ref().map(to_buffer).transpose())
            .collect::<Result<_, _>>()?,
        output_policy: config.outputs,
        fault: config.fault,
        state: Mutex::new(SessionState::default()),
    };
    Dispatch::sync(dispatch).map_err(capture_error(CapturePhase::StaticBuffers))?;
    Ok(Captured {
        session: Arc::new(session),
    })
}
