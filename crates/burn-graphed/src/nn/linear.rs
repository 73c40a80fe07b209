//! A linear layer: burn-nn's `Linear` whose calls on a few rows run a kernel of their own.

use burn::module::{Module, Param};
use burn::tensor::{DType, Tensor};

use crate::cube;

/// burn-nn's `Linear` (the same fields; `From` converts both ways; build it with burn-nn's
/// `LinearConfig` and convert) with its own backward:
///
/// - calls on at most 8 rows (batch-1 inference, small batches; leading dimensions flattened)
///   run one kernel that splits each output column's dot product over a cube, on burn's cubecl
///   backends, in `f32` whatever the dtype with one rounding: cubecl's tuned matmul never
///   times its one-row kernels for a row-major weight (UPSTREAM.md 13);
/// - on CUDA, calls on more rows, and the backward's products, run through cuBLASLt on cubecl's
///   stream (inside graphs too), `f32` on TF32 tensor cores unless `allow_tf32(false)`,
///   `f16`/`bf16` accumulated in `f32`, the bias in the product's epilogue
///   (`BURN_GRAPHED_VENDOR_MATMUL=off` turns it off);
/// - elsewhere (more rows on wgpu, Flex, mixed dtypes): burn-nn's computation.
#[derive(Module, Debug)]
pub struct Linear {
    /// The weight, `[d_input, d_output]`.
    pub weight: Param<Tensor<2>>,
    /// The bias, `[d_output]`.
    pub bias: Option<Param<Tensor<1>>>,
}

impl From<burn::nn::Linear> for Linear {
    fn from(linear: burn::nn::Linear) -> Self {
        Self {
            weight: linear.weight,
            bias: linear.bias,
        }
    }
}

impl From<Linear> for burn::nn::Linear {
    fn from(linear: Linear) -> Self {
        Self {
            weight: linear.weight,
            bias: linear.bias,
        }
    }
}

impl Linear {
    /// `input` (`[..., d_input]`) times the weight, plus the bias.
    ///
    /// # Panics
    ///
    /// As burn-nn's: when the input's last dimension is not `d_input`.
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        linear(input, self.weight.val(), self.bias.as_ref().map(Param::val))
    }

    /// `residual + self.forward(input)`, the residual added before the output's one rounding
    /// where the layer runs fused (in cuBLASLt's epilogue, or the small kernel's), so one
    /// launch where burn runs two: a transformer block's `x + proj(h)`. Elsewhere burn's
    /// `forward(input) + residual`. The residual's gradient is the output's.
    ///
    /// # Panics
    ///
    /// When the input's last dimension is not `d_input`, or the residual's shape is not the
    /// output's (`[..., d_output]`).
    pub fn forward_add<const D: usize>(&self, input: Tensor<D>, residual: Tensor<D>) -> Tensor<D> {
        let (weight, bias) = (self.weight.val(), self.bias.as_ref().map(Param::val));
        linear_then(input, weight, bias, Some(residual), false)
    }

    /// `relu(self.forward(input))`, the ReLU taken in the same launch where the layer runs
    /// fused (cuBLASLt's `RELU_BIAS` epilogue, or the small kernel's store), before the
    /// output's one rounding: an MLP's hidden layer in one launch where burn runs two. Its
    /// backward passes the gradient where the output is above zero, as burn's ReLU does.
    /// Elsewhere burn's `relu(forward(input))`.
    ///
    /// # Panics
    ///
    /// As [`Linear::forward`].
    pub fn forward_relu<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let (weight, bias) = (self.weight.val(), self.bias.as_ref().map(Param::val));
        linear_then(input, weight, bias, None, true)
    }
}

/// `input` (`[..., d_input]`) times `weight` (`[d_input, d_output]`), plus `bias`
/// (`[d_output]`): [`Linear::forward`]'s computation for any weight and bias (a module that
/// joins its layers' weights runs one product through it).
///
/// # Panics
///
/// When the input's last dimension is not `d_input`.
pub(crate) fn linear<const D: usize>(
    input: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
) -> Tensor<D> {
    linear_then(input, weight, bias, None, false)
}

/// [`linear`] plus `residual` (the output's shape), then a ReLU where `relu`, both before the
/// one rounding where the layer runs fused; burn's composition (`relu(linear(..) + residual)`)
/// elsewhere.
///
/// # Panics
///
/// When the input's last dimension is not `d_input` or the residual's shape is not the
/// output's.
fn linear_then<const D: usize>(
    input: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    residual: Option<Tensor<D>>,
    relu: bool,
) -> Tensor<D> {
    let [d_input, d_output] = weight.dims();
    let dims = input.dims();
    assert!(
        D > 0 && dims[D - 1] == d_input,
        "Linear: the input's last dimension must be {d_input}, got shape {dims:?}"
    );
    let mut out_dims = dims;
    out_dims[D - 1] = d_output;
    if let Some(residual) = &residual {
        assert!(
            residual.dims() == out_dims,
            "Linear: the residual must have the output's shape {out_dims:?}, got {:?}",
            residual.dims()
        );
    }
    let rows = dims[..D - 1].iter().product::<usize>();
    let dtype = input.dtype();
    let device = input.device();
    let vendor = cube::vendor_matmul_available(&device);
    // Without cubecl the range is empty (`SMALL_LINEAR_ROWS` is 0) and no vendor library
    // runs: nothing is fused.
    #[allow(clippy::reversed_empty_ranges)]
    let fused = ((1..=cube::SMALL_LINEAR_ROWS).contains(&rows) || (vendor && rows > 0))
        && d_input > 0
        && d_output > 0
        && matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
        && weight.dtype() == dtype
        && bias.as_ref().is_none_or(|b| b.dtype() == dtype)
        && residual.as_ref().is_none_or(|r| r.dtype() == dtype)
        && cube::supports_graphs(&device);
    // burn's composition: the product (and bias), then the residual, then the ReLU.
    let composed = |input: Tensor<D>, weight, bias, residual: Option<Tensor<D>>| {
        let out = burn::tensor::module::linear(input, weight, bias);
        let out = match residual {
            Some(residual) => out + residual,
            None => out,
        };
        if relu {
            burn::tensor::activation::relu(out)
        } else {
            out
        }
    };
    if !fused {
        return composed(input, weight, bias, residual);
    }
    let inputs = (
        (
            input.reshape([rows, d_input]).into_dispatch(),
            weight.into_dispatch(),
            bias.map(Tensor::into_dispatch),
        ),
        residual.map(|r| r.reshape([rows, d_output]).into_dispatch()),
    );
    match cube::linear(inputs, vendor, relu) {
        Ok(out) => Tensor::<2>::from_dispatch(out).reshape(out_dims),
        Err(inputs) => {
            let ((x, weight, bias), residual) = *inputs;
            composed(
                Tensor::<2>::from_dispatch(x).reshape(dims),
                Tensor::from_dispatch(weight),
                bias.map(Tensor::from_dispatch),
                residual.map(|r| Tensor::<2>::from_dispatch(r).reshape(out_dims)),
            )
        }
    }
}
