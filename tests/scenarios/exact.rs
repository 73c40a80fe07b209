//! What the fused ops' tests (`fused_norm`, `fused_loss`, `fused_linear`) share: deterministic
//! inputs, the unit roundoff of a dtype, values read back in `f64`, and the error measure
//! against exact values (host `f64`).

use burn::tensor::{FloatDType, TensorData};

/// `count` deterministic values in `[low, high)` from `seed` (a linear congruential sequence).
pub fn seeded(count: usize, seed: u64, low: f32, high: f32) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..count)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32;
            low + unit * (high - low)
        })
        .collect()
}

/// The unit roundoff of `dtype` (half a unit in the last place at 1).
pub fn unit_roundoff(dtype: FloatDType) -> f64 {
    match dtype {
        FloatDType::F16 => 2f64.powi(-11),
        FloatDType::BF16 => 2f64.powi(-8),
        _ => 2f64.powi(-24),
    }
}

/// A float tensor's values, widened to `f64`.
pub fn host(data: TensorData) -> Vec<f64> {
    data.convert::<f32>()
        .try_to_vec::<f32>()
        .expect("float values")
        .into_iter()
        .map(f64::from)
        .collect()
}

/// The largest distance between `got` and `exact`, over the largest exact magnitude.
pub fn relative_error(got: &[f64], exact: &[f64]) -> f64 {
    let scale = exact
        .iter()
        .fold(0.0f64, |m, v| m.max(v.abs()))
        .max(f64::MIN_POSITIVE);
    got.iter()
        .zip(exact)
        .fold(0.0f64, |m, (g, e)| m.max((g - e).abs()))
        / scale
}

/// `graphed`'s call and `forward` on `eager` (a copy of the same module), on each of
/// `inputs`: the outputs, and the gradient `grad` reads (of the output's sum), must be equal
/// bit for bit (the fused kernels sum in a fixed order, so a replay computes what the eager
/// call computes) where both run the same kernels. On CUDA they need not: burn's own products
/// around the fused ops are tuned per layout (the graph's parameter buffers and the eager
/// copy's are laid out apart), and the picks, TF32 tensor cores or f32, follow the timing of
/// each tuning (seen with eight test processes on a GPU); there the comparison is the suite's
/// bound ([`super::tolerance_for`]: f32 sums in other orders, or with TF32 allowed the
/// tensor-core bound, which a stale batch or a wrong row still exceeds about a hundredfold).
/// Steps are numbered from 1 in the messages.
pub fn assert_graphed_equals_eager<M, I, const D: usize>(
    graphed: &burn_graphed::Graphed<M, I, burn::tensor::Tensor<D>>,
    eager: &M,
    forward: fn(&M, I) -> burn::tensor::Tensor<D>,
    inputs: impl IntoIterator<Item = I>,
    grad: fn(&M, &burn::tensor::Gradients) -> TensorData,
) where
    M: burn::module::Module,
    I: burn_graphed::TensorGroup + Clone,
{
    for (step, x) in (1..).zip(inputs) {
        let expected = forward(eager, x.clone());
        let got = graphed.forward(x).expect("graphed call");
        let device = got.device();
        let same = |what: String, got: TensorData, expected: TensorData| {
            if !super::kernels_may_differ(&device) {
                assert_eq!(got, expected, "{what}");
            } else {
                super::assert_data_close(&device, &what, &expected, &got);
            }
        };
        same(
            format!("step {step} output"),
            got.clone().into_data(),
            expected.clone().into_data(),
        );
        let (g, e) = (got.sum().backward(), expected.sum().backward());
        same(
            format!("step {step} gradient"),
            grad(graphed.module(), &g),
            grad(eager, &e),
        );
    }
}

/// How far (relative) [`nudged`] moves each input element to measure how much a module of
/// burn-nn's moves when its inputs move by one rounding: about five units of f32's roundoff
/// (3e-7) where f32 products are computed in f32; TF32's unit roundoff (2^-11) where they may
/// round to TF32 ([`super::tf32_products`]), since there burn-nn's own products are off by
/// that much of their inputs and a nudge of 3e-7 vanishes in the rounding.
pub fn nudge_size(device: &burn::tensor::Device) -> f32 {
    if super::tf32_products(device) {
        2f32.powi(-11)
    } else {
        3e-7
    }
}

/// `x` with every element moved by `size` of itself, alternately up and down.
pub fn nudged<const D: usize>(x: burn::tensor::Tensor<D>, size: f32) -> burn::tensor::Tensor<D> {
    let dims = x.dims();
    let count: usize = dims.iter().product();
    let factors: Vec<f32> = (0..count)
        .map(|i| if i % 2 == 0 { 1.0 + size } else { 1.0 - size })
        .collect();
    let device = x.device();
    x * burn::tensor::Tensor::<1>::from_data(TensorData::new(factors, [count]), &device)
        .reshape(dims)
}
