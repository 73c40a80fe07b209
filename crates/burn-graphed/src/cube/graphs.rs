//! [`Graphs`]: the handle the features floor holds to one captured callable, and a call's way
//! through it: admit (or say why the call runs eagerly), copy in, replay, link into autodiff.

use std::sync::Arc;

use burn::backend::{DispatchTensor, TensorMetadata};
use burn::tensor::Tensor;

use super::buffers::{FusedTensor, dispatch_of, fused};
use super::node;
use super::session::Session;
use super::values::Replayed;
use crate::error::GraphedError;
use crate::host_phases::{self, HostPhase};
use crate::stats::{FallbackReason, GraphContents, GraphStats};
use crate::tensors::{ElementKind, FlatTensor};

/// The forward and backward graphs of one captured callable, with their static buffers.
/// Clones share them.
#[derive(Clone, Debug)]
pub(crate) struct Graphs(Arc<Session>);

impl Graphs {
    pub(super) fn new(session: Arc<Session>) -> Self {
        Self(session)
    }

    /// Whether a forward replay still waits for its backward.
    pub(crate) fn backward_pending(&self) -> bool {
        self.0.backward_pending()
    }

    /// Whether these are inference graphs (a forward graph alone).
    pub(crate) fn is_inference(&self) -> bool {
        self.0.backward.is_none()
    }

    /// What these graphs hold: the forward's, then the backward's.
    pub(crate) fn contents(&self) -> &[GraphContents] {
        &self.0.contents
    }

    /// Replays, copies and gradient copies of these graphs so far.
    pub(crate) fn stats(&self) -> GraphStats {
        self.0.lock().stats.clone()
    }

    /// A call with `inputs` (flattened, matching the capture's signature) on a module whose
    /// float parameters are `params` (visiting order): replays the forward graph and returns
    /// its outputs linked into autodiff (their backward replays the backward graph), or gives
    /// the inputs back with the reason the call must run eagerly. Nothing runs in that case.
    ///
    /// # Errors
    ///
    /// [`GraphedError::InputNotWritten`], [`GraphedError::ParameterNotWritten`] and
    /// [`GraphedError::Replay`] from the forward replay.
    pub(crate) fn replay(
        &self,
        inputs: Vec<FlatTensor>,
        params: Vec<FlatTensor>,
    ) -> Result<Replayed, GraphedError> {
        let session = &self.0;
        let eager = |reason, inputs| Ok(Replayed::Eager(reason, inputs));
        if session.backward_pending() {
            return eager(FallbackReason::BackwardPending, inputs);
        }
        let Some(fused_inputs) = all_fused(&inputs) else {
            return eager(FallbackReason::Unsupported, inputs);
        };
        if session.shared_buffer_busy(&fused_inputs) {
            return eager(FallbackReason::SharedBufferBusy, inputs);
        }
        let Some(fused_params) = all_fused(&params) else {
            return eager(FallbackReason::Unsupported, inputs);
        };
        if let Some(reason) = cannot_replay(session, &fused_params) {
            return eager(reason, inputs);
        }
        let Some(route) = inputs
            .iter()
            .filter(|t| t.is_float())
            .chain(&params)
            .map(|t| &t.tensor)
            .find(|t| burn::backend::Dispatch::is_tracked(t))
            .cloned()
        else {
            // Nothing requires grad: there is no backward to graph.
            return eager(FallbackReason::ModeChanged, inputs);
        };
        // The parents, as the capture numbered them: the float inputs (int and bool inputs
        // carry no gradient), then the parameters.
        let parents: Vec<_> = inputs
            .into_iter()
            .filter(FlatTensor::is_float)
            .chain(params)
            .map(|t| t.tensor)
            .collect();
        host_phases::lap(HostPhase::Admit);
        let outputs = session.replay_forward(&fused_inputs, &fused_params)?;
        let is_float = |o: &FusedTensor| ElementKind::of(o.dtype()) == ElementKind::Float;
        // Every output is on the call's autodiff device, with its autodiff context (its
        // checkpointing strategy): the float ones linked into autodiff (their backward replays
        // the backward graph), the int and bool ones as they are.
        let device = Tensor::<1>::from_dispatch(route.clone()).device();
        let context = route.autodiff;
        let floats = outputs.iter().filter(|o| is_float(o)).cloned().collect();
        let mut linked = node::link(route, parents, floats, session).into_iter();
        Ok(Replayed::Outputs(
            outputs
                .into_iter()
                .map(|output| {
                    let (shape, dtype) = (output.shape().to_vec(), output.dtype());
                    let tensor = if is_float(&output) {
                        linked.next().expect("one linked tensor per float output")
                    } else {
                        DispatchTensor {
                            autodiff: context,
                            ..dispatch_of(output)
                        }
                    };
                    FlatTensor {
                        device: device.clone(),
                        shape,
                        dtype,
                        // A replayed output is not a leaf; autodiff tracks a float one.
                        require_grad: false,
                        tensor,
                    }
                })
                .collect(),
        ))
    }
}

impl Graphs {
    /// A call without autodiff on inference graphs ([`capture_inference`](super::capture_inference)):
    /// copies the inputs and parameters in where they are not there already, replays the
    /// forward graph and returns its outputs as handed out under the output policy (on the
    /// device without autodiff); or gives the inputs back with the reason the call must run
    /// eagerly. Nothing runs in that case.
    ///
    /// # Errors
    ///
    /// As [`replay`](Self::replay).
    pub(crate) fn replay_inference(
        &self,
        inputs: Vec<FlatTensor>,
        params: Vec<FlatTensor>,
    ) -> Result<Replayed, GraphedError> {
        let session = &self.0;
        let eager = |reason, inputs| Ok(Replayed::Eager(reason, inputs));
        let (Some(fused_inputs), Some(fused_params)) = (all_fused(&inputs), all_fused(&params))
        else {
            return eager(FallbackReason::Unsupported, inputs);
        };
        if let Some(reason) = cannot_replay(session, &fused_params) {
            return eager(reason, inputs);
        }
        host_phases::lap(HostPhase::Admit);
        let device = inputs
            .first()
            .map(|t| t.device.clone())
            .ok_or(GraphedError::NoInputs)?;
        let outputs = session.replay_forward(&fused_inputs, &fused_params)?;
        Ok(Replayed::Outputs(
            outputs
                .into_iter()
                .map(|output| FlatTensor {
                    device: device.clone(),
                    shape: output.shape().to_vec(),
                    dtype: output.dtype(),
                    require_grad: false,
                    tensor: dispatch_of(output),
                })
                .collect(),
        ))
    }
}

/// Why `session` cannot replay now over parameters `params`, training or inference alike: a
/// guarded hand-out of its last replay is still held, or a parameter buffer is aliased by a
/// tensor user code holds.
fn cannot_replay(session: &Session, params: &[FusedTensor]) -> Option<FallbackReason> {
    if session.hand_outs_held() {
        Some(FallbackReason::OutputStillHeld)
    } else if !session.params_writable(params) {
        Some(FallbackReason::ParamBufferAliased)
    } else {
        None
    }
}

/// The fusion handles of `tensors`, or `None` when one is not on burn's cubecl backend.
fn all_fused(tensors: &[FlatTensor]) -> Option<Vec<FusedTensor>> {
    tensors.iter().map(|t| fused(&t.tensor)).collect()
}
