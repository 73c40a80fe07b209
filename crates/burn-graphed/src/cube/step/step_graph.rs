//! Whole-step graphs: forward, loss, backward, gradient clipping and the optimizer update of
//! one training step recorded as **one** graph, replayed with nothing around it but the input
//! copies and, when the learning rate changed, one small write.
//!
//! [`StepState`] owns what every graph of a model's steps shares: the static parameter buffers,
//! the optimizer's state buffers (moments or velocity) and the schedule (learning rate and
//! step count, `schedule_op`). A [`StepGraph`] is one captured step for one input signature:
//! its graph, its static input buffers and its loss buffers. Graphs of several signatures (the
//! shape cache) all read and update the same parameters, so switching between batch sizes
//! copies nothing.
//!
//! Capturing changes nothing: the warm-ups and the first run of the recording update the
//! buffers, which are put back from a snapshot taken before (and the device generators too).

use std::sync::Arc;

use burn::backend::{Backend, Dispatch, DispatchGraph, DispatchTensor};

use super::super::buffers::{
    DirectCopy, FusedTensor, StaticBuffer, check_written, dispatch_of, fused, static_fused,
};
use super::super::collective::{end as end_collective, mean, take_failure};
use super::super::graph::driver::{InputView, Pools, static_inputs, under_lock, warm_up};
use super::super::graph::lifecycle::capture_error;
use super::super::graph::random_state::SavedStates;
use super::super::graph::validate::validate_losses;
use super::super::graph::write_check::{self, cube_graph};
use super::super::values::{Bucket, BucketLayout, Meet, StepCut};
use super::step_state::{StepState, copy_out};
use crate::callable::StepRunner;
use crate::config::GraphedConfig;
use crate::error::{CapturePhase, GraphedError};
use crate::faults::FaultInjection;
use crate::stats::GraphContents;
use crate::sync::lock;
use crate::tensors::FlatTensor;

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
    /// With [`StepCut::InGraph`]: the layout of the bucket the graph averages, which the ranks
    /// compare before every replay.
    averaged: Option<BucketLayout>,
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

    /// The layout of the bucket the graph averages inside it ([`StepCut::InGraph`]).
    pub(crate) fn averaged_layout(&self) -> Option<&BucketLayout> {
        self.averaged.as_ref()
    }

    /// Whether every input of `micro_inputs` holds values (runs the work queued for each): what
    /// a rank states before it replays a graph with a collective inside, whose replay must not
    /// then be refused on one rank alone (the others' all-reduce would wait for it for good).
    ///
    /// # Errors
    ///
    /// [`GraphedError::InputNotWritten`] naming the first input without values.
    pub(crate) fn inputs_written(
        &self,
        micro_inputs: &[Vec<FlatTensor>],
    ) -> Result<(), GraphedError> {
        for (index, input) in micro_inputs.iter().flatten().enumerate() {
            super::super::buffers::check_written(&input.tensor)
                .map_err(|reason| GraphedError::InputNotWritten { index, reason })?;
        }
        Ok(())
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
            if !super::super::buffers::any_unwritten() {
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

/// Captures one step of `run` on the micro-batches of `sample` (at least one), as one graph or
/// cut at its bucket (`cut`), updating `state`'s buffers; leaves every buffer and generator as
/// it found it: each warm-up starts from a snapshot taken before, and so does the recording.
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
    meet: &Meet<'_>,
) -> Result<StepGraph, GraphedError> {
    let dispatch = &state.dispatch;
    let what = match cut {
        StepCut::Whole => "burn-graphed: capturing a whole training step",
        StepCut::AtBucket => "burn-graphed: capturing a data-parallel training step",
        StepCut::InGraph { .. } => {
            "burn-graphed: capturing a data-parallel training step, all-reduce inside"
        }
    };
    under_lock(dispatch, what, |generators| {
        Dispatch::sync(dispatch).map_err(capture_error(CapturePhase::StaticBuffers))?;
        // Everything queued before (a learning-rate write, an eager step) is in the buffers now.
        lock(&state.host).queued.clear();
        let snapshot = state.snapshot();
        let captured = capture_from(state, run, sample, config, cut, &snapshot, generators, meet);
        let restored = state.restore(&snapshot, generators, CapturePhase::StaticBuffers);
        let graph = captured?;
        restored?;
        Ok(graph)
    })
}

/// [`capture_step`] once the lock is held and the snapshot taken.
#[allow(clippy::too_many_arguments)]
fn capture_from(
    state: &Arc<StepState>,
    run: &StepRunner<'_>,
    sample: &[Vec<FlatTensor>],
    config: &GraphedConfig,
    cut: StepCut,
    snapshot: &[(FusedTensor, FusedTensor)],
    generators: &SavedStates,
    meet: &Meet<'_>,
) -> Result<StepGraph, GraphedError> {
    let dispatch = &state.dispatch;
    let pools = Pools::start(dispatch)?;
    let (static_inputs, autodiff_inputs): (Vec<_>, Vec<_>) = sample
        .iter()
        .map(|inputs| static_inputs(inputs, InputView::Constant))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .unzip();
    let leaves = state.leaves();
    let warmup = CapturePhase::StepWarmup;
    let phase = CapturePhase::Step;
    let restore = || state.restore(snapshot, generators, warmup);
    // The whole step, eagerly, from the snapshot, as the graph will run it (cut at the bucket
    // or not): the losses are kept, the queued writes held until the device synchronized.
    // With the all-reduce inside, every rank warms up as many times (their all-reduces pair up
    // one for one), and the ranks agree that their gradients hold values before each.
    let fixed;
    let warm_config = if let StepCut::InGraph { .. } = cut {
        let runs = config.max_warmup_iters.max(config.warmup_iters).max(1);
        fixed = GraphedConfig {
            warmup_iters: runs,
            max_warmup_iters: runs,
            ..config.clone()
        };
        &fixed
    } else {
        config
    };
    // With the all-reduce inside and one micro-batch, the all-reduces start during the
    // backward (`overlap`); the update's gradients come from the buckets either way.
    let overlapped = matches!(cut, StepCut::InGraph { .. })
        && autodiff_inputs.len() == 1
        && super::overlap::enabled();
    let (warmed, eager_losses) = warm_up(dispatch, warm_config, warmup, || {
        restore()?;
        match cut {
            StepCut::Whole => state.body(run, &leaves, &autodiff_inputs, warmup),
            StepCut::AtBucket => {
                let (losses, grads, mut queued) =
                    state.gradients(run, &leaves, &autodiff_inputs, warmup)?;
                let bucket = state.fill_bucket(grads)?;
                queued.extend(state.update(state.split_bucket(&bucket), warmup)?);
                Ok((losses, queued))
            }
            StepCut::InGraph { group } if overlapped => {
                let gradients =
                    super::overlap::gradients(state, run, &leaves, &autodiff_inputs, warmup, group)
                        .and_then(|(losses, started, kept)| {
                            started
                                .check_written()
                                .map_err(|reason| GraphedError::GradientsNotWritten { reason })?;
                            Ok((losses, started, kept))
                        });
                // The all-reduces began in the backward: where a rank failed before its own,
                // the others' wait on the device for a peer that will not come, so the group's
                // communicator ends (aborted unless the streams drain).
                let met = met(
                    meet,
                    "a warm-up's gradients, their all-reduces begun",
                    gradients,
                )
                .inspect_err(|error| end_collective(group, &error.to_string()));
                let (losses, started, mut queued) = met?;
                queued.extend(state.update(super::overlap::split(state, started, group), warmup)?);
                Ok((losses, queued))
            }
            StepCut::InGraph { group } => {
                let gradients = state
                    .gradients(run, &leaves, &autodiff_inputs, warmup)
                    .and_then(|(losses, grads, kept)| {
                        let bucket = state.fill_bucket(grads)?;
                        check_written(&bucket.tensor)
                            .map_err(|reason| GraphedError::GradientsNotWritten { reason })?;
                        Ok((losses, bucket, kept))
                    });
                let (losses, bucket, mut queued) = met(
                    meet,
                    "a warm-up's gradients, before their all-reduce",
                    gradients,
                )?;
                let averaged = average(bucket, group);
                queued.extend(state.update(state.split_bucket(&averaged), warmup)?);
                Ok((losses, queued))
            }
        }
    })?;
    if let Some(reason) = cut.group().and_then(take_failure) {
        return Err(GraphedError::Capture {
            phase: warmup,
            reason: format!("the all-reduce failed: {reason}"),
        });
    }
    restore()?;
    let mut averaged = None;
    let ((graph, losses), update, contents) = match cut {
        StepCut::Whole => {
            // The first run of the recording (`Warmed::record`) updates the buffers; the
            // snapshot puts them back afterwards.
            let ((losses, _queued), (graph, contents)) =
                warmed.record(phase, || state.body(run, &leaves, &autodiff_inputs, phase))?;
            ((graph, losses), None, vec![contents])
        }
        StepCut::InGraph { group } => {
            // The ranks agree that every recording stopped before any runs its graph once.
            let record = || {
                if overlapped {
                    let (losses, started, mut queued) = super::overlap::gradients(
                        state,
                        run,
                        &leaves,
                        &autodiff_inputs,
                        phase,
                        group,
                    )?;
                    let layout = started.layout.clone();
                    queued
                        .extend(state.update(super::overlap::split(state, started, group), phase)?);
                    return Ok((losses, layout, queued));
                }
                let (losses, grads, mut queued) =
                    state.gradients(run, &leaves, &autodiff_inputs, phase)?;
                let mean = average(state.fill_bucket(grads)?, group);
                queued.extend(state.update(state.split_bucket(&mean), phase)?);
                Ok((losses, mean.layout, queued))
            };
            let stopped = |result| meet("the recording of the step, before its first run", result);
            let ((losses, layout, _queued), (graph, contents)) =
                warmed.record_met(phase, record, stopped)?;
            averaged = Some(layout);
            ((graph, losses), None, vec![contents])
        }
        StepCut::AtBucket => {
            let ((losses, bucket, _kept), (graph, contents)) = warmed.record(phase, || {
                let (losses, grads, kept) =
                    state.gradients(run, &leaves, &autodiff_inputs, phase)?;
                Ok((losses, state.fill_bucket(grads)?, kept))
            })?;
            // The update half: warmed up and recorded on the bucket the gradient graph wrote.
            let (warmed, ()) = warm_up(dispatch, config, warmup, || {
                restore()?;
                Ok(((), state.update(state.split_bucket(&bucket), warmup)?))
            })?;
            restore()?;
            let (_queued, (update, update_contents)) =
                warmed.record(phase, || state.update(state.split_bucket(&bucket), phase))?;
            let update = UpdateGraph {
                graph: update,
                bucket: StaticBuffer::new(static_fused(&bucket.tensor, phase)?),
                layout: bucket.layout,
            };
            (
                (graph, losses),
                Some(update),
                vec![contents, update_contents],
            )
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
    let pools = pools.release(dispatch, config, phase)?;
    Ok(StepGraph {
        graph,
        update,
        inputs,
        losses,
        state: state.clone(),
        bytes,
        growth: pools.growth,
        fault: crate::faults::injected(),
        contents,
        averaged,
    })
}

/// `result` once every rank stated its own on `what` ([`Meet`]).
fn met<T>(meet: &Meet<'_>, what: &str, result: Result<T, GraphedError>) -> Result<T, GraphedError> {
    meet(what, result.as_ref().map(|_| ()).map_err(Clone::clone))?;
    result
}

/// `bucket` averaged over NCCL group `group` (lazily: a fusion operation), same layout. Taken
/// whole, so that the all-reduce holds the bucket's only reference and reduces it in place.
fn average(bucket: Bucket, group: usize) -> Bucket {
    let tensor = burn::tensor::Tensor::<1>::from_dispatch(bucket.tensor);
    Bucket {
        tensor: mean(tensor, group).into_dispatch(),
        layout: bucket.layout,
    }
}
