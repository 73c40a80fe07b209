//! burn-train's `Learner` on a graphed model (feature `train`).
//!
//! `Learner` trains any `LearnerModel`: a [`Module`] with burn-train's `TrainStep` and
//! `InferenceStep`. A model's own `TrainStep` calls its forward directly, and the orphan rule
//! keeps user code from implementing burn-train's traits for [`Graphed`]; so the model
//! implements [`GraphedTrainStep`] and [`GraphedInferenceStep`] (its steps written against the
//! graphed wrapper) and this module implements `TrainStep` and `InferenceStep` for `Graphed`
//! with them. Validation calls `model.valid()`'s forward, which replays inference graphs.

use burn::module::Module;
use burn::train::{InferenceStep, ItemLazy, TrainOutput, TrainStep};

use crate::graphed::Graphed;
use crate::tensors::TensorGroup;

/// A training step of a model wrapped in [`Graphed`], for burn-train's `Learner`.
///
/// Implement it where a plain model implements burn-train's `TrainStep`: `step` receives the
/// graphed wrapper, calls [`Graphed::forward`] (a graph replay) and computes the loss and its
/// gradients as the plain step would. `Graphed<Self, I, O>` then implements `TrainStep` with
/// it, and `InferenceStep` with [`GraphedInferenceStep`], so
/// `Learner::new(graphed, optim, scheduler)` takes the graphed model. `examples/train_learner.rs` is a complete program.
///
/// What to know about `Learner` and graphs:
/// - `Learner::optimizer_step` steps a clone of the model while the learner still holds the
///   original, so the optimizer cannot reuse parameter buffers: each step's new parameters are
///   copied into the graphs on the next call (one device copy per parameter, counted in
///   [`GraphStats::param_copies`](crate::GraphStats::param_copies)), as with burn's `Adam` in
///   a loop of one's own. A loop of one's own with [`MultiTensorAdam`](crate::MultiTensorAdam)
///   avoids them.
/// - Its metrics read each step's outputs later, on another thread. Hand out copies
///   (`GraphedConfig::new().with_outputs(OutputPolicy::Copy)`, see
///   [`OutputPolicy::Copy`](crate::OutputPolicy::Copy)): under `Static` the metrics would read
///   the next replay's values, and under `Guarded` (the default) a step whose previous outputs
///   the metrics still hold runs eagerly.
/// - On CUDA a capture needs the device to itself, and the metrics thread reads while the
///   training thread works. Graphs for a batch shape first met during training (an epoch's
///   smaller last batch) are captured then: if the metrics thread reads during that capture,
///   the capture fails (that shape then runs eagerly,
///   [`EagerReason::CaptureFailed`](crate::EagerReason::CaptureFailed)), and so may the
///   read, which burn-train reports as a training error. Capture every batch shape before
///   `launch` (one `forward` and `backward` per shape), or set
///   [`GraphedConfig::max_graphs`](crate::GraphedConfig::max_graphs) to 1 so other shapes run
///   eagerly without a capture.
pub trait GraphedTrainStep<I, O>: Module + Sized {
    /// The batch of a training step.
    type Input: Send + 'static;
    /// What the step hands to the learner's metrics.
    type Output: ItemLazy + 'static;

    /// Runs the forward pass through `model` (graphed), the loss and its backward pass.
    fn step(model: &Graphed<Self, I, O>, batch: Self::Input) -> TrainOutput<Self::Output>;
}

impl<M, I, O> TrainStep for Graphed<M, I, O>
where
    M: GraphedTrainStep<I, O>,
    I: TensorGroup,
    O: TensorGroup,
{
    type Input = M::Input;
    type Output = M::Output;

    fn step(&self, item: Self::Input) -> TrainOutput<Self::Output> {
        M::step(self, item)
    }
}

/// A validation (or inference) step of a model wrapped in [`Graphed`], for burn-train's
/// `Learner`.
///
/// Implement it where a plain model implements burn-train's `InferenceStep`: `step` receives
/// the graphed wrapper after `valid()` and calls [`Graphed::forward`], which replays the
/// forward-only inference graphs of the call's signature (captured at its first use, or before
/// `launch` with [`Graphed::prepare`] on `graphed.valid()` and a batch on the device without
/// autodiff, which avoids a capture while the metrics thread reads). To validate eagerly,
/// call the wrapped model's own step: `model.module().step(batch)`.
pub trait GraphedInferenceStep<I, O>: Module + Sized {
    /// The batch of a validation step.
    type Input: Send + 'static;
    /// What the step hands to the learner's metrics.
    type Output: ItemLazy + 'static;

    /// Runs the forward pass through `model` (graphed, in eval mode) and what follows it.
    fn step(model: &Graphed<Self, I, O>, batch: Self::Input) -> Self::Output;
}

impl<M, I, O> InferenceStep for Graphed<M, I, O>
where
    M: GraphedInferenceStep<I, O>,
    I: TensorGroup,
    O: TensorGroup,
{
    type Input = M::Input;
    type Output = M::Output;

    fn step(&self, item: Self::Input) -> Self::Output {
        M::step(self, item)
    }
}
