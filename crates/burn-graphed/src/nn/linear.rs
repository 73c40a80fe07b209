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
///   stream (inside graphs too), `f32` without TF32, `f16`/`bf16` accumulated in `f32`, the
///   bias in the product's epilogue (`BURN_GRAPHED_VENDOR_MATMUL=off` turns it off);
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
    let [d_input, d_output] = weight.dims();
    let dims = input.dims();
    assert!(
        D > 0 && dims[D - 1] == d_input,
        "Linear: the input's last dimension must be {d_input}, got shape {dims:?}"
    );
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
        && cube::supports_graphs(&device);
    if !fused {
        return burn::tensor::module::linear(input, weight, bias);
    }
    let mut out_dims = dims;
    out_dims[D - 1] = d_output;
    let inputs = (
        input.reshape([rows, d_input]).into_dispatch(),
        weight.into_dispatch(),
        bias.map(Tensor::into_dispatch),
    );
    match cube::linear(inputs, vendor) {
        Ok(out) => Tensor::<2>::from_dispatch(out).reshape(out_dims),
        Err(inputs) => {
            let (x, weight, bias) = *inputs;
            burn::tensor::module::linear(
                Tensor::<2>::from_dispatch(x),
                Tensor::from_dispatch(weight),
                bias.map(Tensor::from_dispatch),
            )
            .reshape(out_dims)
        }
    }
}
