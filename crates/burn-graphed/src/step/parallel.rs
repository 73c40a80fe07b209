//! A data-parallel whole step ([`GraphedStep::data_parallel`]): the gradient half, replayed
//! or eager; the ranks' agreement; the bucket's mean; the update half; then, where a rank met
//! shapes without graphs, every rank's turn to capture them. With the all-reduce inside the
//! graph: the ranks' agreement, then one replay (or the eager step around the collective).

use std::sync::Arc;

use burn::module::Module;
use burn::tensor::Tensor;

use super::{CAPTURE_TURN, GraphedStep, STEP_AGREEMENT, concat};
use crate::config::MismatchPolicy;
use crate::cube::{Bucket, BucketLayout, StepGraph, StepState};
use crate::data_parallel::DataParallel;
use crate::error::GraphedError;
use crate::route::{NoCapture, OnMiss, Route};
use crate::stats::EagerReason;
use crate::tensors::{FlatTensor, TensorGroup, TensorSpec};

/// A data-parallel step's route: ready for the ranks' agreement with the all-reduce inside
/// the graph, or for the gradient half's replay.
enum Ready {
    /// This graph replays the step (the whole step with the all-reduce inside; otherwise its
    /// gradient half).
    Replay(Arc<StepGraph>),
    /// The step's gradients, computed eagerly; the all-reduce and the update follow.
    Eager {
        losses: Vec<burn::backend::DispatchTensor>,
        bucket: Box<Bucket>,
        /// The shapes have no graph yet: every rank captures them after the step.
        capture_after: bool,
    },
}

/// How the gradient half of a data-parallel step ran.
enum Half {
    /// By this graph, whose update half ends the step.
    Replayed(Arc<StepGraph>),
    Eager,
    /// Eagerly, for shapes without graphs that the ranks capture after the step.
    CaptureAfter,
}

impl<M, I> GraphedStep<M, I>
where
    M: Module,
    I: TensorGroup,
{
    /// A data-parallel step (see [`data_parallel`](Self::data_parallel)): the gradient half,
    /// replayed or eager; the ranks' agreement; the bucket averaged; the update half; then,
    /// when any rank met shapes without graphs, every rank's turn to capture them.
    pub(super) fn parallel_step(
        &mut self,
        group: &DataParallel,
        state: &Arc<StepState>,
        flat: &[Vec<FlatTensor>],
        key: &Vec<TensorSpec>,
        lr: f64,
    ) -> Result<Tensor<1>, GraphedError> {
        if group.in_graph_group().is_some() {
            return self.in_graph_step(group, state, flat, key, lr);
        }
        let half = self
            .gradient_half(state, flat, key, lr)
            .and_then(|(losses, bucket, half)| {
                // An eager half's bucket holds no values where a launch was skipped (an input
                // without values); a replayed one was written by its graph, whose replay refuses
                // such inputs.
                if !matches!(half, Half::Replayed(_)) {
                    crate::data_parallel::written(&bucket.tensor)?;
                }
                Ok((losses, bucket, half))
            });
        let wants_capture = matches!(&half, Ok((_, _, Half::CaptureAfter)));
        let layout = half
            .as_ref()
            .map(|(_, bucket, _)| &bucket.layout)
            .map_err(Clone::clone);
        let any_capture = agree_on_step(group, layout, lr, wants_capture, state.steps())?;
        let (losses, bucket, half) = half?;
        if let Half::Replayed(graph) = &half {
            let averaged = group
                .mean(Tensor::from_dispatch(bucket.tensor))?
                .into_dispatch();
            graph.replay_update(&averaged)?;
        } else {
            eager_update(group, state, bucket)?;
        }
        if any_capture {
            self.capture_in_turn(state, flat, key, wants_capture)?;
        }
        Ok(concat(losses))
    }

    /// A data-parallel step whose graph holds the all-reduce ([`Collective::Nccl`] with
    /// `in_graph`): the route, and what could fail before the collective (the inputs' values,
    /// an eager step's gradients); the ranks' agreement on it; then the one replay, or the
    /// eager step's all-reduce and update; then, when any rank met shapes without graphs,
    /// every rank's capture of its step's shapes (all at once; a rank that had their graph
    /// replaces it).
    ///
    /// [`Collective::Nccl`]: crate::Collective::Nccl
    fn in_graph_step(
        &mut self,
        group: &DataParallel,
        state: &Arc<StepState>,
        flat: &[Vec<FlatTensor>],
        key: &Vec<TensorSpec>,
        lr: f64,
    ) -> Result<Tensor<1>, GraphedError> {
        let ready = self.ready_in_graph(state, flat, key, lr);
        let wants_capture = matches!(
            &ready,
            Ok(Ready::Eager {
                capture_after: true,
                ..
            })
        );
        let layout = ready
            .as_ref()
            .map_err(Clone::clone)
            .and_then(|ready| match ready {
                Ready::Replay(graph) => graph.averaged_layout().ok_or(GraphedError::Internal {
                    what: "a graph of a step with its all-reduce inside has no bucket layout",
                }),
                Ready::Eager { bucket, .. } => Ok(&bucket.layout),
            });
        let any_capture = agree_on_step(group, layout, lr, wants_capture, state.steps())?;
        let losses = match ready? {
            Ready::Replay(graph) => {
                let (losses, copies) = graph.replay(flat)?;
                self.replays += 1;
                self.input_copies += copies;
                losses
            }
            Ready::Eager { losses, bucket, .. } => {
                eager_update(group, state, *bucket)?;
                losses
            }
        };
        if any_capture {
            // Every rank captures, those with graphs for their shapes again: each warm-up's
            // all-reduce, and the recording's first run, wait for every rank.
            self.capture_in_turn(state, flat, key, true)?;
        }
        Ok(concat(losses))
    }

    /// What a step with the all-reduce inside does before the ranks agree: [`route`](Self::route),
    /// then the graph's inputs, or the eager step's bucket, checked for values.
    fn ready_in_graph(
        &mut self,
        state: &StepState,
        flat: &[Vec<FlatTensor>],
        key: &Vec<TensorSpec>,
        lr: f64,
    ) -> Result<Ready, GraphedError> {
        let ready = self.route(state, flat, key, lr)?;
        match &ready {
            Ready::Replay(graph) => graph.inputs_written(flat)?,
            Ready::Eager { bucket, .. } => crate::data_parallel::written(&bucket.tensor)?,
        }
        Ok(ready)
    }

    /// A data-parallel step's route, the learning rate written: the graph to replay, or the
    /// step's gradients computed eagerly (the losses and the bucket). Shapes without graphs are
    /// not captured here (their capture needs every rank, after the step): the step runs
    /// eagerly and asks for the capture.
    fn route(
        &mut self,
        state: &StepState,
        flat: &[Vec<FlatTensor>],
        key: &Vec<TensorSpec>,
        lr: f64,
    ) -> Result<Ready, GraphedError> {
        let miss = OnMiss::<NoCapture<_>>::After;
        let routed = self
            .router
            .route(key, miss, |_| false, false, |graph| Ok(graph.clone()))?;
        state.set_lr(lr)?;
        match routed.route {
            Route::Replay(graph) => Ok(Ready::Replay(graph)),
            Route::Eager(reason) => {
                // New shapes are captured after the step, not refused.
                if self.config.on_mismatch == MismatchPolicy::Error
                    && reason != EagerReason::CaptureAfterStep
                {
                    return Err(GraphedError::mismatch(reason, &flat.concat(), &[]));
                }
                let capture_after = reason == EagerReason::CaptureAfterStep;
                self.router.count_eager(reason);
                let (losses, bucket) = state.eager_gradients(&self.runner(), flat)?;
                Ok(Ready::Eager {
                    losses,
                    bucket: Box::new(bucket),
                    capture_after,
                })
            }
        }
    }

    /// Every rank's turn at capturing after a step in which some met shapes without graphs:
    /// those ranks (`wanted`) capture `flat`'s signature into their shape cache, the others
    /// wait their turn.
    ///
    /// # Errors
    ///
    /// On every rank alike, [`GraphedError::RankFailed`] when a rank's capture failed (the
    /// group is spent).
    fn capture_in_turn(
        &mut self,
        state: &Arc<StepState>,
        flat: &[Vec<FlatTensor>],
        key: &[TensorSpec],
        wanted: bool,
    ) -> Result<(), GraphedError> {
        let captured = if wanted {
            self.capture(state, flat).map(Some)
        } else {
            let Some((group, device)) = &self.parallel else {
                return Ok(());
            };
            group.in_turn(CAPTURE_TURN, device, || Ok(None))
        }?;
        if let Some((graph, bytes)) = captured {
            self.router.insert(key.to_vec(), graph, bytes);
        }
        Ok(())
    }

    /// The first half of a data-parallel step cut at its bucket: the losses, this rank's
    /// bucket, and how the half ran ([`route`](Self::route), then the gradient graph's replay).
    fn gradient_half(
        &mut self,
        state: &StepState,
        flat: &[Vec<FlatTensor>],
        key: &Vec<TensorSpec>,
        lr: f64,
    ) -> Result<(Vec<burn::backend::DispatchTensor>, Bucket, Half), GraphedError> {
        match self.route(state, flat, key, lr)? {
            Ready::Replay(graph) => {
                let (losses, copies, bucket) = graph.replay_gradients(flat)?;
                self.replays += 1;
                self.input_copies += copies;
                Ok((losses, bucket, Half::Replayed(graph)))
            }
            Ready::Eager {
                losses,
                bucket,
                capture_after,
            } => {
                let half = if capture_after {
                    Half::CaptureAfter
                } else {
                    Half::Eager
                };
                Ok((losses, *bucket, half))
            }
        }
    }
}

/// The ranks' agreement on step `step` (updates done so far): every rank's bucket layout (or
/// its failure) and learning rate, and whether any rank must capture new shapes after the step
/// (the vote).
fn agree_on_step(
    group: &DataParallel,
    layout: Result<&BucketLayout, GraphedError>,
    lr: f64,
    wants_capture: bool,
    step: u64,
) -> Result<bool, GraphedError> {
    let digest = layout.map(|layout| (layout.fingerprint(), layout.len, layout.dtype, lr));
    let (_, any_capture) = group
        .ranks()
        .agree_and_vote(STEP_AGREEMENT, digest, wants_capture)?;
    crate::faults::after_agreement(step);
    Ok(any_capture)
}

/// An eagerly computed `bucket` averaged over the group, then the update, with the graphs'
/// kernels.
fn eager_update(
    group: &DataParallel,
    state: &StepState,
    bucket: Bucket,
) -> Result<(), GraphedError> {
    let averaged = group
        .mean(Tensor::from_dispatch(bucket.tensor))?
        .into_dispatch();
    state.eager_update(&Bucket {
        tensor: averaged,
        layout: bucket.layout,
    })
}
