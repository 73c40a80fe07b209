//! `FusedAdam` and `MultiTensorAdam` on parameters in `bf16` or `f16`: the update kernels take
//! the parameter's dtype, compute each element in `f32` and round once when storing (moments
//! stay in the parameter's dtype, as burn's `Adam` keeps them). Only on burn's cubecl backend
//! with a device that has the dtype (CUDA for `bf16`).

use super::optim::{Kind, assert_updated_in_place};
use super::*;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::{AdamState, Optimizer};
use burn::tensor::{DType, FloatDType};
use burn_graphed_testkit::{TensorComparison, cast_params, deep_copy};

/// The dtype burn reports for tensors cast to `dtype`.
fn dtype_of(dtype: FloatDType) -> DType {
    DType::from(dtype)
}

/// `values` rounded to `dtype` (nearest, ties to even, as the kernels' stores round) and widened
/// back to `f32`.
fn rounded(values: Vec<f32>, shape: [usize; 2], dtype: FloatDType) -> TensorData {
    TensorData::new(values, shape).convert_dtype(dtype_of(dtype))
}

fn host(tensor: Tensor<2>) -> Vec<f32> {
    tensor
        .into_data()
        .try_to_vec_as::<f32>()
        .expect("a float tensor")
}

/// One step of `FusedAdam` in `dtype` equals the step computed exactly (in `f64`, on the host,
/// from the same `dtype` values) and rounded once to `dtype`, to one unit in the last place, for
/// the parameter and both moments, over three steps with weight decay (each step from the
/// kernel's own previous state, so errors cannot accumulate unseen). Burn's `Adam` in `dtype`
/// rounds after each of its operations and is further off (see
/// [`multi_tensor_adam_trains_in`]).
pub fn fused_adam_rounds_once_in(device: &Device, dtype: FloatDType) {
    let shape = [37, 11];
    let penalty = 0.05;
    let config =
        fused_adam_config().with_weight_decay(Some(WeightDecayConfig::new(penalty as f32)));
    let adam = config.build();
    let (b1, b2, eps) = (
        f64::from(config.beta_1),
        f64::from(config.beta_2),
        f64::from(config.epsilon),
    );
    let lr = 1e-2;
    let mut param = batch(shape, 100, device).cast(dtype);
    let mut state: Option<AdamState<2>> = None;
    let n = shape[0] * shape[1];
    for step in 0..3 {
        // Gradients of both signs and magnitudes from 1e-3 to 1.
        let grad =
            (batch(shape, step, device) * batch(shape, step + 7, device).exp() / 2.7).cast(dtype);
        let (p, g) = (host(param.clone()), host(grad.clone()));
        let (m, v) = match &state {
            Some(state) => (
                host(state.momentum.moment_1.clone()),
                host(state.momentum.moment_2.clone()),
            ),
            None => (vec![0.0; n], vec![0.0; n]),
        };
        let t = step as i32 + 1;
        let (mut new_p, mut new_m, mut new_v) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        for i in 0..n {
            let g = f64::from(g[i]) + f64::from(p[i]) * penalty;
            let m = f64::from(m[i]) * b1 + g * (1.0 - b1);
            let v = f64::from(v[i]) * b2 + g * g * (1.0 - b2);
            let update = (m / (1.0 - b1.powi(t))) / ((v / (1.0 - b2.powi(t))).sqrt() + eps);
            new_p[i] = (f64::from(p[i]) - lr * update) as f32;
            new_m[i] = m as f32;
            new_v[i] = v as f32;
        }
        let (updated, new_state) = adam.step(lr, param, grad, state);
        let new_state = new_state.expect("Adam keeps a state");
        let momentum = &new_state.momentum;
        assert_eq!(momentum.time, step + 1);
        let tolerance = Tolerance::ulps_of(dtype_of(dtype), 1);
        for (what, expected, actual) in [
            ("param", new_p, &updated),
            ("moment 1", new_m, &momentum.moment_1),
            ("moment 2", new_v, &momentum.moment_2),
        ] {
            let expected = rounded(expected, shape, dtype);
            let actual = actual.clone().into_data();
            let name = format!("{dtype:?} step {step} {what}");
            let comparison = TensorComparison::new(name, &expected, &actual, tolerance);
            println!("{comparison}");
            assert!(comparison.passed(), "{comparison}");
        }
        (param, state) = (updated, Some(new_state));
    }
}

/// How close two trainings in `dtype` whose kernels may round differently must be: two units in
/// the last place (one rounding against several), or 1e-3 absolute (a tenth of one step's
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

/// A model in `dtype` trained with `MultiTensorAdam` (every parameter in the one operation) and
/// with per-parameter `FusedAdam`, four steps with weight decay: the two agree to a unit in the
/// last place at every step (the same arithmetic, one launch against one per parameter), every
/// parameter stays in `dtype`, and after the first step both are within
/// [`low_precision_tolerance`] of burn's `Adam` in `dtype`. (Only the first step: burn's `Adam`
/// rounds to `dtype` after each of its operations, so its trajectory drifts from the fused one's,
/// which rounds once; `fused_adam_rounds_once_in` pins the fused arithmetic at every step.)
pub fn multi_tensor_adam_trains_in(device: &Device, dtype: FloatDType) {
    let device = device.clone().autodiff();
    let decay = Some(WeightDecayConfig::new(0.05));
    // Widths whose rows CUDA pitches (11 and 3 elements).
    let model = cast_params(&Mlp::new(11, 2, 3, &device), dtype);
    let mut reference = deep_copy(&model);
    let mut per_param = deep_copy(&model);
    let mut check = ParamsCheck::with_tolerance(&model, low_precision_tolerance(dtype));
    let mut multi = model;
    let mut adam = adam_config().with_weight_decay(decay.clone()).init();
    let config = fused_adam_config().with_weight_decay(decay);
    let (mut fused_adam, mut multi_adam) = (config.init(), config.init_multi_tensor());
    let step_of = |model: Mlp, optim: &mut dyn FnMut(Mlp, GradientsParams) -> Mlp, x| {
        let loss = square_mean(model.forward(x));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        optim(model, grads)
    };
    for step in 0..4 {
        let x = batch([8, 11], step, &device).cast(dtype);
        if step == 0 {
            reference = step_of(reference, &mut |m, g| adam.step(1e-2, m, g), x.clone());
        }
        per_param = step_of(
            per_param,
            &mut |m, g| fused_adam.step(1e-2, m, g),
            x.clone(),
        );
        multi = step_of(multi, &mut |m, g| multi_adam.step(1e-2, m, g), x);
        let values = param_values(&multi).expect("read back");
        assert_eq!(multi_adam.last_batched(), values.len());
        for (_, values) in values {
            assert_eq!(values.dtype(), dtype_of(dtype), "step {step}");
        }
        let what = format!("{dtype:?} step {step}");
        let agree = Tolerance {
            abs: 1e-3,
            ..Tolerance::ulps_of(dtype_of(dtype), 1)
        };
        assert_params_close(&what, &per_param, &multi, agree);
        if step == 0 {
            check.assert(&what, &reference, &per_param);
            check.assert(&what, &reference, &multi);
        }
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
