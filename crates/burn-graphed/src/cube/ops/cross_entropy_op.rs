//! Softmax cross-entropy from logits and class targets in one kernel forward and one backward,
//! with its own autodiff node: what [`crate::nn::loss::CrossEntropyLoss`] runs on burn's cubecl
//! backends, where burn-nn composes a log-softmax (a max and a sum reduction, elementwise
//! kernels), a gather and a mean, and about as many kernels backward.
//!
//! Arithmetic, per row of `classes` logits, in `f32` whatever the dtype: `max`, `lse = max +
//! ln(sum(exp(x - max)))`, the row's loss `lse - x[target]`, rounded once to the logits' dtype
//! (burn-nn's loss has that dtype). The row's `lse` is kept for the backward: `dx = (exp(x -
//! lse) - [j == target]) * g` for the row's incoming gradient `g`. Sums in a fixed tree order,
//! as the norms' (`norm_op.rs`).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Backend, Cube, backend_extension};
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::super::buffers::FusedTensor;
use super::super::dense::Dense;
use super::super::kernels::row_kernels::{
    count_forward, cube_max, cube_sum, row_grid, row_of_cube, threads_for,
};
use super::super::update::update_kernel::checked_elem;

/// The autodiff tensor of burn's cubecl backend.
type AutodiffTensor = FloatTensor<Autodiff<Cube>>;
/// An int tensor of burn's cubecl backend.
type FusedInt = IntTensor<Cube>;

/// Forward: row `r`'s loss into `loss[r]` (the logits' dtype) and its log-sum-exp into `lse[r]`.
/// `nan` is a NaN from the host (WGSL has no NaN literal), the loss of a row whose target lies
/// outside `0..classes`.
#[cube(launch_unchecked)]
fn cross_entropy_forward_kernel<F: Float>(
    logits: &[F],
    targets: &[i32],
    loss: &mut [F],
    lse: &mut [f32],
    classes: u32,
    nan: f32,
    #[comptime] threads: usize,
    #[define(F)] _dtype: ElemType,
) {
    let row = row_of_cube();
    // Uniform over the cube (one row per cube): the barriers are met by all units or none.
    if row < lse.len() {
        let classes = classes as usize;
        let base = row * classes;
        let unit = UNIT_POS as usize;
        let mut high = f32::min_value();
        let mut i = unit;
        while i < classes {
            high = f32::max(high, f32::cast_from(logits[base + i]));
            i += threads;
        }
        let row_max = cube_max(high, threads);
        let mut sum = 0.0f32;
        i = unit;
        while i < classes {
            sum += (f32::cast_from(logits[base + i]) - row_max).exp();
            i += threads;
        }
        let row_lse = row_max + cube_sum(sum, threads).ln();
        if unit == 0 {
            let target = targets[row];
            // A target outside `0..classes` gives a NaN loss (and NaN gradients), never a read
            // outside the row: the host cannot check the targets without reading them back,
            // which a graph cannot do.
            let mut row_loss = nan;
            if target >= 0i32 && (target as usize) < classes {
                row_loss = row_lse - f32::cast_from(logits[base + target as usize]);
            }
            loss[row] = F::cast_from(row_loss);
            lse[row] = row_lse;
        }
    }
}

/// Backward: row `r` of `dx` from the row's log-sum-exp, target and incoming gradient.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn cross_entropy_backward_kernel<F: Float>(
    grad: &[F],
    logits: &[F],
    targets: &[i32],
    lse: &[f32],
    dx: &mut [F],
    classes: u32,
    nan: f32,
    #[comptime] threads: usize,
    #[define(F)] _dtype: ElemType,
) {
    let row = row_of_cube();
    if row < lse.len() {
        let classes = classes as usize;
        let base = row * classes;
        let g = f32::cast_from(grad[row]);
        let row_lse = lse[row];
        let target = targets[row];
        let valid = target >= 0i32 && (target as usize) < classes;
        let mut i = UNIT_POS as usize;
        while i < classes {
            let mut p = (f32::cast_from(logits[base + i]) - row_lse).exp();
            if valid && i == target as usize {
                p -= 1.0f32;
            }
            if !valid {
                p = nan;
            }
            dx[base + i] = F::cast_from(p * g);
            i += threads;
        }
    }
}

/// The kernels as lazy fusion operations on burn's cubecl backend.
#[backend_extension(Cube, Fusion)]
pub(crate) trait CrossEntropyKernels: Backend {
    /// `(loss, lse)`: each row's loss `[rows]` in the logits' dtype and its log-sum-exp
    /// `[rows]` in `f32`. `targets` are `i32` class indices; a row whose target is outside
    /// `0..classes` gets a NaN loss and NaN gradients.
    #[fusion(meta = |logits, _targets| {
        let rows = logits.shape[0];
        (
            burn::backend::fusion::custom::TensorSpec::new(Shape::new([rows]), logits.dtype),
            burn::backend::fusion::custom::TensorSpec::new(Shape::new([rows]), DType::F32),
        )
    })]
    fn cross_entropy_forward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// The logits' gradient for the rows' incoming gradient `grad` (`[rows]`, the logits'
    /// dtype).
    #[fusion(meta = |_grad, logits, _targets, _lse| logits.clone())]
    fn cross_entropy_backward(
        grad: FloatTensor<Self>,
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

impl CrossEntropyKernels for CubeBackend {
    fn cross_entropy_forward(logits: CubeTensor, targets: CubeTensor) -> (CubeTensor, CubeTensor) {
        let [rows, classes] = logits.meta.shape().dims::<2>();
        let elem = checked_elem(&logits, "cross-entropy");
        let (client, device) = (logits.client.clone(), logits.device.clone());
        let loss = Dense::new_empty(
            client.clone(),
            device.clone(),
            Shape::new([rows]),
            logits.dtype,
        );
        let lse = Dense::new_empty(client.clone(), device, Shape::new([rows]), DType::F32);
        let (logits, targets) = (Dense::of(&logits), Dense::of(&targets));
        let threads = threads_for(classes);
        // SAFETY: the kernel is instantiated for `elem`, the logits' dtype and the loss's (made
        // with it); the targets are i32 (the caller cast them) and lse f32. A cube reads row
        // `r < rows` of the logits (below `rows * classes`; the target's element only when it
        // lies in `0..classes`) and element `r` of the targets (`[rows]`, checked by the
        // caller), and writes element `r` of loss and lse, new allocations distinct from the
        // read buffers.
        unsafe {
            cross_entropy_forward_kernel::launch_unchecked(
                &client,
                row_grid(rows),
                CubeDim::new_1d(threads as u32),
                logits.arg(),
                targets.arg(),
                loss.arg(),
                lse.arg(),
                classes as u32,
                f32::NAN,
                threads,
                elem,
            );
        }
        (loss.into_tensor(), lse.into_tensor())
    }

    fn cross_entropy_backward(
        grad: CubeTensor,
        logits: CubeTensor,
        targets: CubeTensor,
        lse: CubeTensor,
    ) -> CubeTensor {
        let [rows, classes] = logits.meta.shape().dims::<2>();
        let elem = checked_elem(&logits, "cross-entropy");
        let (client, device) = (logits.client.clone(), logits.device.clone());
        let dx = Dense::new_empty(
            client.clone(),
            device,
            logits.meta.shape().clone(),
            logits.dtype,
        );
        let (grad, logits) = (Dense::of(&grad), Dense::of(&logits));
        let (targets, lse) = (Dense::of(&targets), Dense::of(&lse));
        let threads = threads_for(classes);
        // SAFETY: as in the forward: `elem` for grad, logits and dx, i32 targets, f32 lse; a
        // cube reads row `r < rows` (and element `r` of grad, targets and lse) and writes row
        // `r` of dx, a new allocation.
        unsafe {
            cross_entropy_backward_kernel::launch_unchecked(
                &client,
                row_grid(rows),
                CubeDim::new_1d(threads as u32),
                grad.arg(),
                logits.arg(),
                targets.arg(),
                lse.arg(),
                dx.arg(),
                classes as u32,
                f32::NAN,
                threads,
                elem,
            );
        }
        dx.into_tensor()
    }
}

/// The cross-entropy with its own backward, reached from `Tensor` through burn's dispatch.
#[backend_extension(Cube, Autodiff)]
pub(crate) trait FusedCrossEntropyOps: Backend {
    /// Each row's loss `lse(logits[r]) - logits[r, targets[r]]`, `[rows]`.
    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> FloatTensor<Self>;
}

impl FusedCrossEntropyOps for Cube {
    fn fused_cross_entropy(logits: FusedTensor, targets: FusedInt) -> FusedTensor {
        count_forward();
        <Cube as CrossEntropyKernels>::cross_entropy_forward(logits, targets).0
    }
}

/// What the backward keeps of the forward.
#[derive(Debug, Clone)]
struct Saved {
    logits: FusedTensor,
    targets: FusedInt,
    lse: FusedTensor,
}

/// The backward node: one parent, the logits.
#[derive(Debug)]
struct CrossEntropyBackward;

impl Backward<Cube, 1> for CrossEntropyBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Saved, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_logits] = ops.parents;
        let grad = grads.consume::<Cube>(&ops.node);
        let Saved {
            logits,
            targets,
            lse,
        } = ops.state;
        if let Some(node) = node_logits {
            let dx =
                <Cube as CrossEntropyKernels>::cross_entropy_backward(grad, logits, targets, lse);
            grads.register::<Cube>(node.id, dx);
        }
    }
}

impl<C: CheckpointStrategy> FusedCrossEntropyOps for Autodiff<Cube, C> {
    fn fused_cross_entropy(logits: AutodiffTensor, targets: FusedInt) -> AutodiffTensor {
        let (logits, node) = logits.into_parts();
        let prepared = CrossEntropyBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful();
        count_forward();
        let (loss, lse) =
            <Cube as CrossEntropyKernels>::cross_entropy_forward(logits.clone(), targets.clone());
        match prepared {
            OpsKind::Tracked(prep) => prep.finish(
                Saved {
                    logits,
                    targets,
                    lse,
                },
                loss,
            ),
            OpsKind::UnTracked(prep) => prep.finish(loss),
        }
    }
}

/// Each row's cross-entropy of `logits` (`[rows, classes]`, f32, f16 or bf16, burn's cubecl
/// backend) against `targets` (`[rows]`, i32 class indices; outside `0..classes`: a NaN row),
/// through burn's dispatch: `[rows]` in the logits' dtype. The caller checked the dtypes and
/// shapes.
/// Never `Err` here (see the stand-in, which hands the tensors back).
pub(crate) fn cross_entropy_rows(
    logits: burn::backend::DispatchTensor,
    targets: burn::backend::DispatchTensor,
) -> Result<burn::backend::DispatchTensor, Box<super::super::values::LossInputs>> {
    Ok(<burn::backend::Dispatch as FusedCrossEntropyOps>::fused_cross_entropy(logits, targets))
}
