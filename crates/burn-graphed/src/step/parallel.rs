//! A data-parallel whole step ([`GraphedStep::data_parallel`]): the gradient half, replayed
//! or eager; the ranks' agreement; the bucket's mean; the update half; then, where a rank met
//! shapes without graphs, every rank's turn to capture them.

use std::sync::Arc;

use burn::module::Module;
use burn::tensor::Tensor;

use super::{CAPTURE_TURN, GraphedStep, STEP_AGREEMENT, concat};
use crate::config::MismatchPolicy;
use crate::cube::{Bucket, StepGraph, StepState};
use crate::data_parallel::DataParallel;
use crate::error::GraphedError;
use crate::route::{NoCapture, OnMiss, Route};
use crate::stats::EagerReason;
use crate::tensors::{FlatTensor, TensorGroup, TensorSpec};

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
        let digest = half.as_ref().map_err(Clone::clone).map(|(_, bucket, _)| {
            let layout = &bucket.layout;
            (layout.fingerprint(), layout.len, layout.dtype, lr)
        });
        let (_, any_capture) =
            group
                .ranks()
                .agree_and_vote(STEP_AGREEMENT, digest, wants_capture)?;
        let (losses, bucket, half) = half?;
        let averaged = group
            .mean(Tensor::from_dispatch(bucket.tensor))?
            .into_dispatch();
        if let Half::Replayed(graph) = &half {
            graph.replay_update(&averaged)?;
        } else {
            state.eager_update(&Bucket {
                tensor: averaged,
                layout: bucket.layout,
            })?;
        }
        if any_capture {
            self.capture_in_turn(state, flat, key, wants_capture)?;
        }
        Ok(concat(losses))
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

    /// The first half of a data-parallel step: the losses, this rank's bucket, and how the half
    /// ran. Shapes without graphs are not captured here (their capture needs every rank, after
    /// the step): the half runs eagerly and asks for the capture.
    fn gradient_half(
        &mut self,
        state: &StepState,
        flat: &[Vec<FlatTensor>],
        key: &Vec<TensorSpec>,
        lr: f64,
    ) -> Result<(Vec<burn::backend::DispatchTensor>, Bucket, Half), GraphedError> {
        let miss = OnMiss::<NoCapture<_>>::After;
        let routed = self
            .router
            .route(key, miss, |_| false, false, |graph| Ok(graph.clone()))?;
        state.set_lr(lr)?;
        match routed.route {
            Route::Replay(graph) => {
                let (losses, copies, bucket) = graph.replay_gradients(flat)?;
                self.replays += 1;
                self.input_copies += copies;
                Ok((losses, bucket, Half::Replayed(graph)))
            }
            Route::Eager(reason) => {
                // New shapes are captured after the step, not refused.
                if self.config.on_mismatch == MismatchPolicy::Error
                    && reason != EagerReason::CaptureAfterStep
                {
                    return Err(GraphedError::mismatch(reason, &flat.concat(), &[]));
                }
                let half = if reason == EagerReason::CaptureAfterStep {
                    Half::CaptureAfter
                } else {
                    Half::Eager
                };
                self.router.count_eager(reason);
                let (losses, bucket) = state.eager_gradients(&self.runner(), flat)?;
                Ok((losses, bucket, half))
            }
        }
    }
}
