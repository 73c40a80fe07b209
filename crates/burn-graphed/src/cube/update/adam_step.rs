//! The eager Adam steps of the public optimizers, as operations of `update_op`: one parameter at
//! a time (`FusedAdam`, through burn's `ModuleOptimizer`), or every parameter of a module in one
//! operation (`MultiTensorAdam`, a [`Batch`]). The arithmetic is the update kernel's, which is
//! burn's `Adam` operation for operation in the parameter's dtype. Where a parameter's values
//! are in a graph's static buffer and nobody else can tell, the update goes into that buffer
//! (`param_claim`).

use burn::backend::{Cube, DispatchTensor};
use burn::optim::{AdamState, AdaptiveMomentumState, LearningRate};
use burn::tensor::Tensor;

use super::super::buffers::FusedTensor;
use super::super::graph::param_claim::{self, ParamSlot};
use super::super::values::Unfused;
use super::update_kernel::{Clock, kernel_elem, rule_of};
use super::update_op::{Clocks, Update, Writes, register};
use crate::step_optim::StepOptimizer;

/// A parameter's step, ready for the update kernel: its tensors as fusion tensors of burn's
/// cubecl backend, and the step number.
struct AdamOperands {
    param: FusedTensor,
    grad: FusedTensor,
    /// First and second moments (zeros at the first step).
    moments: (FusedTensor, FusedTensor),
    /// The step, counted from 1.
    time: usize,
}

/// The tensors of one Adam step as fusion tensors, or the arguments back (`Err`) where the step
/// cannot be fused: not on burn's cubecl backend, a dtype the kernel does not take (it takes
/// `f32`, `f16` and `bf16`), gradient or moments in another dtype than the parameter, AMSGrad's
/// state, or shapes that differ.
fn prepare<const D: usize>(
    tensor: Tensor<D>,
    grad: Tensor<D>,
    state: Option<AdamState<D>>,
) -> Result<AdamOperands, Box<Unfused<D>>> {
    let (shape, dtype) = (tensor.shape(), tensor.dtype());
    let moments_fit = state.as_ref().is_none_or(|state| {
        let momentum = &state.momentum;
        momentum.moment_1.shape() == shape
            && momentum.moment_2.shape() == shape
            && momentum.moment_1.dtype() == dtype
            && momentum.moment_2.dtype() == dtype
            && momentum.max_moment_2.is_none()
    });
    let fusable = moments_fit
        && super::super::graph::lifecycle::supports_graphs(&tensor.device())
        && kernel_elem(dtype).is_some()
        && grad.dtype() == dtype
        && grad.shape() == shape
        && grad.device() == tensor.device();
    if !fusable {
        return Err(Box::new((tensor, grad, state)));
    }
    let primitive = |tensor: &Tensor<D>| tensor.clone().try_into_primitive::<Cube>().ok();
    let (time, moment_1, moment_2) = match &state {
        Some(state) => {
            let momentum = &state.momentum;
            let (moment_1, moment_2) = (&momentum.moment_1, &momentum.moment_2);
            (momentum.time + 1, primitive(moment_1), primitive(moment_2))
        }
        // Zero moments: `0 * b1 + g * (1 - b1)` is burn's first-step `g * (1 - b1)` exactly.
        None => (
            1,
            primitive(&tensor.zeros_like()),
            primitive(&tensor.zeros_like()),
        ),
    };
    // Converted from clones, so that nothing is lost if one does not convert; the originals
    // are dropped right after, and the clones are then the only holders again.
    let (Some(param), Some(grad_primitive), Some(moment_1), Some(moment_2)) =
        (primitive(&tensor), primitive(&grad), moment_1, moment_2)
    else {
        return Err(Box::new((tensor, grad, state)));
    };
    drop((tensor, grad, state));
    Ok(AdamOperands {
        param,
        grad: grad_primitive,
        moments: (moment_1, moment_2),
        time,
    })
}

/// The update of one prepared parameter: into the graph buffer that holds its values where
/// [`param_claim::claim`] allows (none of `claimed`), else into its own buffer or a copy.
fn update_of(
    operands: AdamOperands,
    clock: usize,
    claimed: &[Option<ParamSlot>],
) -> (Update, Option<ParamSlot>) {
    let claim = param_claim::claim(operands.param, claimed);
    let writes = match claim.in_place {
        Some(_) => Writes::StaticParam,
        None => Writes::Owned,
    };
    let (moment_1, moment_2) = operands.moments;
    let update = Update {
        param: claim.values,
        grad: operands.grad,
        states: vec![moment_1, moment_2],
        writes,
        clock,
    };
    (update, claim.in_place)
}

/// Checks `optimizer` is burn's Adam: the eager optimizers fuse nothing else.
fn adam_only(optimizer: &StepOptimizer) -> bool {
    matches!(optimizer, StepOptimizer::Adam { .. })
}

/// One fused Adam step of one parameter, or the arguments back (`Err`) where the step cannot be
/// fused (see [`prepare`]; `optimizer` must be Adam): a [`Batch`] of one.
pub(crate) fn step<const D: usize>(
    optimizer: &StepOptimizer,
    lr: LearningRate,
    tensor: Tensor<D>,
    grad: Tensor<D>,
    state: Option<AdamState<D>>,
) -> Result<(Tensor<D>, Option<AdamState<D>>), Box<Unfused<D>>> {
    let mut batch = Batch::default();
    // The stand-in holds no tensor the update needs alone (see `Batch::gather`).
    let (_, time) = batch.gather(optimizer, lr, tensor, grad, state)?;
    let Some([param, moment_1, moment_2]) = batch.finish().pop() else {
        unreachable!("a batch of one gathered parameter hands back one update")
    };
    let momentum = AdaptiveMomentumState::new(
        time,
        Tensor::from_dispatch(moment_1),
        Tensor::from_dispatch(moment_2),
    );
    Ok((Tensor::from_dispatch(param), Some(AdamState::new(momentum))))
}

/// The parameters of one optimizer step gathered for one operation, and the static buffers
/// the in-place ones write.
#[derive(Default)]
pub(crate) struct Batch {
    updates: Vec<Update>,
    /// Per update: the static buffer it writes in place, if any.
    buffers: Vec<Option<ParamSlot>>,
    /// The clock of each step number in the batch: `(time, clock)`.
    clocks: Vec<(usize, Clock)>,
    /// The optimizer of the batch (every gather passes the same).
    optimizer: Option<StepOptimizer>,
}

impl Batch {
    /// Adds the Adam step of one parameter to the batch and returns the step number and the
    /// tensor that stands in for the parameter until [`finish`](Self::finish) (of the same
    /// shape; its values are not the parameter's), or the arguments back (`Err`) where the step
    /// cannot be fused (`optimizer` must be Adam).
    pub fn gather<const D: usize>(
        &mut self,
        optimizer: &StepOptimizer,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AdamState<D>>,
    ) -> Result<(Tensor<D>, usize), Box<Unfused<D>>> {
        if !adam_only(optimizer) || self.optimizer.is_some_and(|batch| batch != *optimizer) {
            return Err(Box::new((tensor, grad, state)));
        }
        self.optimizer = Some(*optimizer);
        let operands = prepare(tensor, grad, state)?;
        let time = operands.time;
        let clock = match self.clocks.iter().position(|(t, _)| *t == time) {
            Some(index) => index,
            None => {
                self.clocks.push((time, Clock::new(lr, time)));
                self.clocks.len() - 1
            }
        };
        // The stand-in holds neither the old parameter (outside graphs its buffer may then be
        // updated in place, as fusion decides) nor a tensor over a graph buffer that user code
        // could read: the graph's own buffer tensor where the update goes in place (dropping
        // it releases nothing), the gradient otherwise (same shape; fusion frees it when the
        // stand-in is dropped). A buffer already written by this batch (two parameters over
        // the same tensor) is not written twice: the second update goes to a new buffer.
        let (update, slot) = update_of(operands, clock, &self.buffers);
        let stand_in = match &slot {
            Some(_) => Tensor::<D>::from_primitive::<Cube>(update.param.clone()),
            None => Tensor::<D>::from_primitive::<Cube>(update.grad.clone()),
        };
        self.updates.push(update);
        self.buffers.push(slot);
        Ok((stand_in, time))
    }

    /// Queues the batch as one fusion operation; returns per gathered parameter, in order, the
    /// new parameter and moments, as dispatch tensors. The static buffers written in place
    /// record their new parameter tensors as handed out.
    pub fn finish(self) -> Vec<[DispatchTensor; 3]> {
        let Some(optimizer) = self.optimizer.filter(|_| !self.updates.is_empty()) else {
            return Vec::new();
        };
        let (rule, hyper) = rule_of(&optimizer);
        let clocks = self.clocks.into_iter().map(|(_, clock)| clock).collect();
        let updated = register(self.updates, Clocks::Host(clocks), rule, hyper);
        let dispatch = |primitive| Tensor::<1>::from_primitive::<Cube>(primitive).into_dispatch();
        updated
            .into_iter()
            .zip(&self.buffers)
            .map(|(tensors, buffer)| {
                let mut tensors = tensors.into_iter();
                let (Some(param), Some(moment_1), Some(moment_2)) =
                    (tensors.next(), tensors.next(), tensors.next())
                else {
                    unreachable!("an Adam update hands back its parameter and two moments")
                };
                if let Some(slot) = buffer {
                    slot.hand_over(&param);
                }
                [dispatch(param), dispatch(moment_1), dispatch(moment_2)]
            })
            .collect()
    }
}
