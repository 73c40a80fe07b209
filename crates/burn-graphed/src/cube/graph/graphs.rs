//! [`Graphs`]: the handle the features floor holds to one captured callable, and a call's way
//! through it: admitted (or told why it runs eagerly) before it enters, then copy in, replay,
//! link into autodiff.

use std::sync::{Arc, OnceLock};

use burn::backend::{DispatchTensor, TensorMetadata};
use burn::tensor::Tensor;

use super::super::buffers::{FusedTensor, dispatch_of, fused};
use super::node;
use super::session::Session;
use crate::error::GraphedError;
use crate::stats::{EagerReason, GraphContents, GraphStats};
use crate::tensors::{ElementKind, FlatTensor};

/// The forward and backward graphs of one captured callable, with their static buffers.
/// Clones share them.
#[derive(Clone, Debug)]
pub(crate) struct Graphs(Arc<Session>);

impl Graphs {
    pub(in crate::cube) fn new(session: Arc<Session>) -> Self {
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

    /// Admits a call with `inputs` (flattened, matching the capture's signature) on a module
    /// whose float parameters are `params` (visiting order), for a training replay
    /// (`training`: the outputs are linked into autodiff) or an inference replay; or says why
    /// the call must run eagerly. Nothing runs, and nothing changes: the router asks before the
    /// call enters the engine.
    ///
    /// `handles` are `params` as the engine's handles, made at the first admission of the
    /// module value whose parameters these are and kept with its facts.
    pub(crate) fn admit(
        &self,
        inputs: &[FlatTensor],
        params: &[FlatTensor],
        handles: &ParamHandles,
        training: bool,
    ) -> Result<Admitted, EagerReason> {
        let session = &self.0;
        if training && session.backward_pending() {
            return Err(EagerReason::BackwardPending);
        }
        let fused_inputs = all_fused(inputs).ok_or(EagerReason::Unsupported)?;
        if training && session.shared_buffer_busy(&fused_inputs) {
            return Err(EagerReason::SharedBufferBusy);
        }
        let fused_params = handles.of(params).ok_or(EagerReason::Unsupported)?;
        if let Some(reason) = cannot_replay(session, &fused_params) {
            return Err(reason);
        }
        let tracked = if training {
            let tracked = inputs
                .iter()
                .filter(|t| t.is_float())
                .chain(params)
                .map(|t| &t.tensor)
                .find(|t| burn::backend::Dispatch::is_tracked(t))
                .cloned()
                // Nothing requires grad: there is no backward to graph.
                .ok_or(EagerReason::NothingRequiresGrad)?;
            Some(tracked)
        } else {
            None
        };
        Ok(Admitted {
            inputs: fused_inputs,
            params: fused_params,
            tracked,
        })
    }

    /// Replays the forward graph for a call [`admit`](Self::admit)ted with `inputs` and
    /// `params` (the same tensors; `params` may be empty for an inference call, which links
    /// nothing into autodiff): copies them in where they are not there already and returns
    /// the outputs. A training call's float outputs are linked into autodiff (their
    /// backward replays the backward graph); an inference call's are handed out under the
    /// output policy, on the device without autodiff.
    ///
    /// # Errors
    ///
    /// [`GraphedError::InputNotWritten`], [`GraphedError::ParameterNotWritten`] and
    /// [`GraphedError::Replay`] from the forward replay.
    pub(crate) fn replay(
        &self,
        call: Admitted,
        inputs: Vec<FlatTensor>,
        params: Vec<FlatTensor>,
    ) -> Result<Vec<FlatTensor>, GraphedError> {
        let session = &self.0;
        let outputs = session.replay_forward(&call.inputs, &call.params)?;
        let Some(tracked) = call.tracked else {
            let device = inputs
                .first()
                .map(|t| t.device.clone())
                .ok_or(GraphedError::NoInputs)?;
            return Ok(outputs
                .into_iter()
                .map(|output| FlatTensor {
                    device: device.clone(),
                    shape: output.shape().to_vec(),
                    dtype: output.dtype(),
                    require_grad: false,
                    tensor: dispatch_of(output),
                })
                .collect());
        };
        // The parents, as the capture numbered them: the float inputs (int and bool inputs
        // carry no gradient), then the parameters.
        let parents: Vec<_> = inputs
            .into_iter()
            .filter(FlatTensor::is_float)
            .chain(params)
            .map(|t| t.tensor)
            .collect();
        let is_float = |o: &FusedTensor| ElementKind::of(o.dtype()) == ElementKind::Float;
        // Every output is on the call's autodiff device, with its autodiff context (its
        // checkpointing strategy): the float ones linked into autodiff (their backward replays
        // the backward graph), the int and bool ones as they are.
        let device = Tensor::<1>::from_dispatch(tracked.clone()).device();
        let context = tracked.autodiff;
        let floats = outputs.iter().filter(|o| is_float(o)).cloned().collect();
        let mut linked = node::link(tracked, parents, floats, session).into_iter();
        Ok(outputs
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
            .collect())
    }
}

/// A call that [`Graphs::admit`] let through: its tensors as the engine's handles.
pub(crate) struct Admitted {
    inputs: Vec<FusedTensor>,
    params: Arc<[FusedTensor]>,
    /// For a training call, a tensor autodiff tracks: the outputs' autodiff device and context.
    tracked: Option<DispatchTensor>,
}

/// Why `session` cannot replay now over parameters `params`, training or inference alike: a
/// guarded hand-out of its last replay is still held, or a parameter buffer is aliased by a
/// tensor user code holds.
fn cannot_replay(session: &Session, params: &[FusedTensor]) -> Option<EagerReason> {
    if session.hand_outs_held() {
        Some(EagerReason::OutputStillHeld)
    } else if !session.params_writable(params) {
        Some(EagerReason::ParamBufferAliased)
    } else {
        None
    }
}

/// A module value's float parameters as the engine's handles (`None` when one is not on
/// burn's cubecl backend), made at the value's first admitted call and kept for its life, so
/// that a call clones and drops no parameter handle. Kept with the value's facts, which are
/// dropped before a mapper updates a parameter in place (a fused optimizer updates only what
/// nothing else holds). Made on the capture thread, the only one a call is admitted on: a
/// handle is bound to the fusion stream of the thread that cloned it.
#[derive(Default)]
pub(crate) struct ParamHandles(OnceLock<Option<Arc<[FusedTensor]>>>);

impl ParamHandles {
    /// The handles of `params`, the parameters of the value these handles belong to.
    fn of(&self, params: &[FlatTensor]) -> Option<Arc<[FusedTensor]>> {
        self.0
            .get_or_init(|| all_fused(params).map(Arc::from))
            .clone()
    }
}

/// The fusion handles of `tensors`, or `None` when one is not on burn's cubecl backend.
fn all_fused(tensors: &[FlatTensor]) -> Option<Vec<FusedTensor>> {
    tensors.iter().map(|t| fused(&t.tensor)).collect()
}
