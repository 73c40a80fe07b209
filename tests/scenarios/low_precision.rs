//! Graphed training with `FusedAdam` and `MultiTensorAdam` on parameters in `bf16` or `f16`,
//! and the tolerance of trainings in those dtypes. (That the eager optimizers are burn's `Adam`
//! bit for bit in every dtype is `optim::eager_adams_are_burns_in`.) Only on burn's cubecl
//! backend with a device that has the dtype (CUDA for `bf16`).

use super::optim::{Kind, assert_updated_in_place};
use super::*;
use burn::tensor::{DType, FloatDType};

/// The dtype burn reports for tensors cast to `dtype`.
fn dtype_of(dtype: FloatDType) -> DType {
    DType::from(dtype)
}

/// How close two trainings in `dtype` whose kernels may round differently must be: two units in
/// the last place (one value rounded twice by kernels that fuse differently), or 1e-3 absolute (a tenth of one step's
/// update at the tests' learning rate 1e-2), or 1e-2 of the comparison's scale: for products
/// (outputs, losses, gradients), their largest magnitude (matrix products in `dtype` that the
/// two paths may run with different kernels: two roundings of `bf16`, unit roundoff 2^-8,
/// differ by up to about 0.8% of it); for parameters, the path they travelled (`ParamMovement`,
/// through `ParamsCheck` or the testkit's comparisons). A skipped or doubled update moves a
/// parameter by about 1e-2: over two `bf16` units below magnitude 0.5 (3.9e-3 there), ten times
/// the absolute term.
pub fn low_precision_tolerance(dtype: FloatDType) -> Tolerance {
    Tolerance {
        abs: 1e-3,
        norm_rel: 1e-2,
        ..Tolerance::ulps_of(dtype_of(dtype), 2)
    }
}

/// Graphed training in `dtype` with `FusedAdam` of `kind` equals eager training with
/// per-parameter `FusedAdam` in `dtype` (outputs, losses, gradients, parameters within
/// [`low_precision_tolerance`]: the graphed forward may fuse its products differently), on an
/// MLP whose rows CUDA pitches (24 and 3 elements), and the update goes into the graphs'
/// parameter buffers: only the first call copies parameters, no call falls back.
pub fn graphed_fused_adam_trains_in(device: &Device, kind: Kind, dtype: FloatDType, steps: usize) {
    let run = MlpRun {
        width: 24,
        depth: 3,
        out: 3,
        dtype,
        eager_optimizer: fused_adam_config().init(),
        tolerance: low_precision_tolerance(dtype),
    };
    let report = mlp_against_eager_with(device, run, steps, super::copy_config(), kind.optimizer());
    assert!(report.summary.graphed, "{report}");
    assert_updated_in_place(&report, steps);
}
