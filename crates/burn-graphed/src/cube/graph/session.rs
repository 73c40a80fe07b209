//! A captured forward/backward pair and everything that replaying it needs.

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use burn::backend::{Cube, DispatchGraph};

use super::super::buffers::{DirectCopy, FusedTensor, StaticBuffer};
use super::write_check;
use crate::config::OutputPolicy;
use crate::error::GraphedError;
use crate::faults::FaultInjection;
use crate::host_phases::{self, HostPhase};
use crate::stats::{GraphContents, GraphStats};
use crate::sync::lock;
use crate::tensors::ElementKind;

/// The graphs of one captured callable and their static buffers.
///
/// Field order is drop order: the graphs go before the buffers they point into. Buffers shared
/// with another callable of the same group are `Arc`s, so they outlive both graphs.
#[derive(Debug)]
pub(crate) struct Session {
    pub forward: DispatchGraph,
    /// `None` for an inference call's graphs (forward only).
    pub backward: Option<DispatchGraph>,
    /// What the graphs hold: the forward's, then the backward's.
    pub contents: Vec<GraphContents>,
    /// The device the graphs were captured on (without autodiff).
    pub device: <Cube as burn::backend::BackendTypes>::Device,
    /// One per flattened input. For a chained callable, the previous callable's outputs.
    pub inputs: Vec<Arc<StaticBuffer>>,
    /// One per float parameter, in visiting order.
    pub params: Vec<StaticBuffer>,
    /// One per output; written by the forward graph.
    pub outputs: Vec<Arc<StaticBuffer>>,
    /// One per float output (int and bool outputs carry no gradient), in output order; read by
    /// the backward graph. Where the next callable of the group is chained to this one, its
    /// input gradients, written by its backward graph.
    pub grad_outputs: Vec<Arc<StaticBuffer>>,
    /// Zeros shaped like each float output, for outputs that receive no gradient.
    pub zeros: Vec<StaticBuffer>,
    /// One per parent slot (float inputs, then parameters): the gradient the backward graph
    /// writes, `None` where the slot needs none (no require_grad, or unused).
    pub grad_parents: Vec<Option<Arc<StaticBuffer>>>,
    pub output_policy: OutputPolicy,
    pub fault: FaultInjection,
    /// The group this callable was captured in, and its position there.
    pub group: Arc<GroupLinks>,
    pub member: usize,
    /// The capturing thread: the graphs replay on its stream.
    pub thread: std::thread::ThreadId,
    pub state: Mutex<SessionState>,
}

/// What the callables of one group know of each other: which ones share buffers, and which
/// ones wait for their backward.
#[derive(Debug)]
pub(crate) struct GroupLinks {
    /// Per member: whether its inputs are the previous member's output buffers.
    pub chained: Vec<bool>,
    /// Per member: alive while a replayed forward waits for its backward.
    pending: Mutex<Vec<Weak<PendingBackward>>>,
}

impl GroupLinks {
    pub fn new(chained: Vec<bool>) -> Self {
        let pending = chained.iter().map(|_| Weak::new()).collect();
        Self {
            chained,
            pending: Mutex::new(pending),
        }
    }

    fn pending(&self) -> MutexGuard<'_, Vec<Weak<PendingBackward>>> {
        lock(&self.pending)
    }

    fn is_pending(&self, member: usize) -> bool {
        self.pending()
            .get(member)
            .is_some_and(|token| token.strong_count() > 0)
    }
}

/// What changes from call to call.
#[derive(Debug, Default)]
pub(crate) struct SessionState {
    pub stats: GraphStats,
    /// Which outputs received a gradient for the pending backward.
    pub received: Vec<bool>,
    /// Queued gradient copies, held until the backward replay drained the stream.
    pub queued: Vec<FusedTensor>,
}

/// Token of a forward replay whose backward has not run: dropped when the backward ran or the
/// autodiff graph was freed without it.
#[derive(Debug)]
pub(crate) struct PendingBackward;

impl Session {
    pub fn lock(&self) -> MutexGuard<'_, SessionState> {
        lock(&self.state)
    }

    /// Whether a previous forward still waits for its backward.
    pub fn backward_pending(&self) -> bool {
        self.group.is_pending(self.member)
    }

    /// Whether a forward replay with `inputs` now would overwrite a buffer shared with another
    /// callable of the group whose backward still needs it: the outputs, which the next chained
    /// callable's backward reads as its inputs, or (when an input is not already there) the
    /// inputs, which are the previous callable's outputs.
    pub fn shared_buffer_busy(&self, inputs: &[FusedTensor]) -> bool {
        let next = self.member + 1;
        if self.group.chained.get(next).copied().unwrap_or(false) && self.group.is_pending(next) {
            return true;
        }
        self.member > 0
            && self.group.chained[self.member]
            && self.group.is_pending(self.member - 1)
            && self
                .inputs
                .iter()
                .zip(inputs)
                .any(|(buffer, input)| buffer.needs_copy(input))
    }

    /// Bytes of the static buffers this callable owns (a buffer shared with the previous
    /// callable of its group is counted there: the inputs of a chained callable, and the
    /// output gradients that are the next callable's input gradients).
    pub fn static_bytes(&self) -> u64 {
        let chained = self.group.chained[self.member];
        let next_chained = self
            .group
            .chained
            .get(self.member + 1)
            .copied()
            .unwrap_or(false);
        let inputs = self.inputs.iter().filter(|_| !chained).map(|b| b.bytes());
        let grad_outputs = self
            .grad_outputs
            .iter()
            .filter(|_| !next_chained)
            .map(|b| b.bytes());
        let owned = self
            .params
            .iter()
            .chain(&self.zeros)
            .map(StaticBuffer::bytes)
            .chain(
                self.outputs
                    .iter()
                    .chain(self.grad_parents.iter().flatten())
                    .map(|b| b.bytes()),
            );
        inputs.chain(grad_outputs).chain(owned).sum()
    }

    /// Whether the parameter buffers that `params` would have to be copied into are free to be
    /// written (see [`StaticBuffer::release_alias`]); `false` when a tensor over one of them,
    /// handed out by the fused optimizer, is still held by user code (a clone of the module).
    pub fn params_writable(&self, params: &[FusedTensor]) -> bool {
        self.params
            .iter()
            .zip(params)
            .all(|(buffer, param)| !buffer.needs_copy(param) || buffer.release_alias())
    }

    /// Whether an output or gradient that an earlier replay handed out as its static buffer
    /// (`OutputPolicy::Guarded`) is still held by user code, so that replaying now would
    /// change its value. Always `false` under the other policies.
    pub fn hand_outs_held(&self) -> bool {
        use burn::backend::TensorMetadata;
        self.output_policy == OutputPolicy::Guarded
            && self
                .outputs
                .iter()
                .chain(self.grad_parents.iter().flatten())
                // Fusion's test for an in-place write: the buffer's own handle is the only
                // holder.
                .any(|buffer| !buffer.fused.can_mut())
    }

    /// Copies the call's inputs and parameters into the static buffers where they are not
    /// there already, replays the forward graph and returns its outputs as handed out under
    /// the output policy.
    pub fn replay_forward(
        &self,
        inputs: &[FusedTensor],
        params: &[FusedTensor],
    ) -> Result<Vec<FusedTensor>, GraphedError> {
        // The copies, launched by the replay's task; resolving their sources drained the stream.
        let mut copies = Vec::new();
        if self.fault != FaultInjection::SkipInputCopy {
            direct_copies(self.inputs.iter().map(|b| &**b), inputs, &mut copies);
        }
        let input_copies = copies.len() as u64;
        if self.fault != FaultInjection::SkipParamCopy {
            direct_copies(self.params.iter(), params, &mut copies);
        }
        let param_copies = copies.len() as u64 - input_copies;
        // The buffers written outside the graph since the last replay: asked about below.
        let mut written: Vec<&StaticBuffer> = copies.iter().map(DirectCopy::target).collect();
        for buffer in &self.params {
            // Each flag is taken (reset) whether or not the buffer was also copied into.
            if buffer.take_in_place_update() && !written.iter().any(|w| std::ptr::eq(*w, buffer)) {
                written.push(buffer);
            }
        }
        host_phases::lap(HostPhase::Copy);
        // The copies, one question to cubecl for every buffer written, then the replay unless
        // a buffer it reads holds no values (`write_check`): one task on the device thread.
        let asked = self.to_ask(&written);
        // SAFETY: `replay_after_check` has `graph_replay`'s contract: every buffer the
        // recording touched alive, not used concurrently, and refreshed on the capture stream.
        // The static buffers live in `self`, which outlives the graph (field order); the
        // activations the recording wrote were freed into pages that stay guarded while the
        // graph lives, so nothing else is placed there; the copies are launched by the replay's
        // task on this thread's stream, the capture thread's (the caller checked the thread),
        // before the replay, and the work queued before them was drained first (nothing is
        // queued between the resolves above and the replay).
        unsafe {
            write_check::replay_after_check(
                "forward",
                write_check::cube_graph(&self.forward, "forward")?,
                &self.device,
                &copies,
                asked,
                || self.unwritten_source(),
            )
        }?;
        let outputs = self.outputs.iter().map(|b| self.hand_out(b)).collect();
        let mut state = self.lock();
        state.stats.forward_replays += 1;
        state.stats.input_copies += input_copies;
        state.stats.param_copies += param_copies;
        state.received = vec![false; self.grad_outputs.len()];
        Ok(outputs)
    }

    /// Before a forward replay, once cubecl answered for the buffers just written: the error
    /// naming the first input, else parameter, whose buffer holds no values (the copy into it
    /// found its source unwritten and cubecl skipped it, or, for a parameter, the fused
    /// optimizer's in-place update read an unwritten gradient), so that the replay does not
    /// run on the buffer's stale values. With nothing recorded for any buffer (the usual case)
    /// no buffer is looked up.
    fn unwritten_source(&self) -> Option<GraphedError> {
        use burn::backend::TensorMetadata;
        let input = first_unwritten(self.inputs.iter().map(|b| &**b).enumerate());
        let param = first_unwritten(self.params.iter().enumerate());
        match (input, param) {
            (Some((index, reason)), _) => Some(GraphedError::InputNotWritten { index, reason }),
            (None, Some((index, reason))) => Some(GraphedError::ParameterNotWritten {
                index,
                shape: self.params[index].fused.shape().iter().copied().collect(),
                reason,
            }),
            (None, None) => None,
        }
    }

    /// Registers the token of the forward just replayed.
    pub fn start_pending(&self) -> Arc<PendingBackward> {
        let token = Arc::new(PendingBackward);
        if let Some(slot) = self.group.pending().get_mut(self.member) {
            *slot = Arc::downgrade(&token);
        }
        token
    }

    /// Stores the gradient of output `index` for the coming backward replay.
    pub fn deposit_grad(&self, index: usize, grad: &FusedTensor) {
        let queued = self.grad_outputs[index].write_from(grad);
        let mut state = self.lock();
        if let Some(received) = state.received.get_mut(index) {
            *received = true;
        }
        state.stats.grad_copies += u64::from(queued.is_some());
        state.queued.extend(queued);
    }

    /// Zero-fills the gradients of outputs that received none, replays the backward graph and
    /// returns the gradient of each parent slot.
    pub fn replay_backward(&self) -> Result<Vec<Option<FusedTensor>>, GraphedError> {
        use burn::backend::TensorMetadata;
        let (received, mut queued) = {
            let mut state = self.lock();
            (
                std::mem::take(&mut state.received),
                std::mem::take(&mut state.queued),
            )
        };
        for (index, buffer) in self.grad_outputs.iter().enumerate() {
            if !received.get(index).copied().unwrap_or(false) {
                queued.push(buffer.overwrite_from(&self.zeros[index].fused));
            }
        }
        // Every output gradient's buffer, copied into now or holding the tensor given last time
        // (it is asked again), in one question before the replay (`write_check`).
        let grad_outputs: Vec<&StaticBuffer> = self.grad_outputs.iter().map(|b| &**b).collect();
        let asked = self.to_ask(&grad_outputs);
        // An output gradient that carried an earlier device failure was not copied in: refuse
        // rather than replay on the previous gradient and hand out gradients of it.
        let unwritten_gradient = || {
            let (slot, reason) = first_unwritten(grad_outputs.iter().copied().enumerate())?;
            // Gradient slots number the float outputs; the error names the output's position.
            let index = self
                .outputs
                .iter()
                .enumerate()
                .filter(|(_, o)| ElementKind::of(o.fused.dtype()) == ElementKind::Float)
                .nth(slot)
                .map_or(slot, |(position, _)| position);
            Some(GraphedError::Replay {
                which: "backward",
                reason: format!(
                    "the gradient given to output {index} holds no values: the work that made \
                     it failed on the device (eager code reading it fails the same way). The \
                     backend's account: {reason}"
                ),
            })
        };
        // SAFETY: as in `replay_forward`: every buffer of the recording is owned by `self` or
        // lies in guarded pages, and the gradient copies above were queued on this stream,
        // which is drained before the replay.
        unsafe {
            write_check::replay_after_check(
                "backward",
                write_check::cube_graph(
                    self.backward.as_ref().ok_or_else(|| GraphedError::Replay {
                        which: "backward",
                        reason: "inference graphs have no backward graph".into(),
                    })?,
                    "backward",
                )?,
                &self.device,
                &[],
                asked,
                unwritten_gradient,
            )
        }?;
        drop(queued);
        self.lock().stats.backward_replays += 1;
        Ok(self
            .grad_parents
            .iter()
            .map(|slot| slot.as_ref().map(|buffer| self.hand_out(buffer)))
            .collect())
    }

    /// A buffer a replay just wrote, as handed to user code according to the output policy;
    /// the buffer records that the handed-out tensor holds its values, so that passing it to
    /// the next callable of a group (or back as a gradient) copies nothing.
    fn hand_out(&self, buffer: &StaticBuffer) -> FusedTensor {
        let tensor = match self.output_policy {
            // A queued copy kernel: fusion runs it before the next replay overwrites the buffer
            // (it drains the stream first).
            OutputPolicy::Copy => super::super::copy_op::copy_to_new(&buffer.fused),
            OutputPolicy::Static | OutputPolicy::Guarded => buffer.fused.clone(),
        };
        buffer.written_by_graph(Some(tensor.id));
        tensor
    }

    /// The buffers a replay asks cubecl about: `written`, or none under
    /// `FaultInjection::SkipWriteCheck` (the bench's A/B of the question).
    fn to_ask<'a>(&self, written: &'a [&'a StaticBuffer]) -> &'a [&'a StaticBuffer] {
        if self.fault == FaultInjection::SkipWriteCheck {
            &[]
        } else {
            written
        }
    }
}

/// The copy of each source into its buffer where the values are not there already
/// ([`StaticBuffer::direct_copy_from`]), pushed onto `copies`.
fn direct_copies<'a>(
    buffers: impl Iterator<Item = &'a StaticBuffer>,
    sources: &[FusedTensor],
    copies: &mut Vec<DirectCopy<'a>>,
) {
    copies.extend(
        buffers
            .zip(sources)
            .filter_map(|(buffer, source)| buffer.direct_copy_from(source)),
    );
}

/// The first of `buffers` (position, buffer) that the last copy into it or in-place update of
/// it left unwritten, with the backend's reason ([`StaticBuffer::unwritten_reason`]); none is
/// asked when nothing is recorded for any buffer (one lock).
fn first_unwritten<'a>(
    buffers: impl Iterator<Item = (usize, &'a StaticBuffer)>,
) -> Option<(usize, String)> {
    if !super::super::buffers::any_unwritten() {
        return None;
    }
    buffers
        .filter_map(|(index, buffer)| Some((index, buffer.unwritten_reason()?)))
        .next()
}
