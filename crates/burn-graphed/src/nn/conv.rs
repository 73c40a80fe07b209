//! A 2-D convolution on the layout the model holds: the function and burn-nn's module.

use burn::module::{Module, Param};
use burn::nn::PaddingConfig2d;
use burn::tensor::ops::ConvOptions;
use burn::tensor::{DType, Tensor};

use crate::cube::{self, ConvSpec};

/// What `burn::tensor::module::conv2d` computes (`input` `[batch, channels_in, height, width]`,
/// `weight` `[channels_out, channels_in / groups, kernel_h, kernel_w]`, `bias`
/// `[channels_out]`; stride, padding, dilation and groups as `options`), in one kernel forward
/// and, backward, one for the input's gradient and two for the weight's and the bias's, on
/// burn's cubecl backends, reading the input where it lies in the `[batch, channels, height,
/// width]` order: no copies, slices or packs around the products.
///
/// Precision: every product is summed in `f32` whatever the dtype and rounded once, also in
/// `bf16` (burn-cubecl's convolutions in `bf16` do not train correctly with cubecl 0.11.3:
/// BENCHMARKS.md). The kernels are direct convolutions on CUDA cores: `f32` without TF32, the
/// arithmetic PyTorch uses by default; they suit the small and mid-size convolutions of the
/// models this library is for, not the widest layers, where a tensor-core implicit GEMM wins.
/// Elsewhere (not a cubecl backend, mixed dtypes, a kernel of more than 64 taps, an empty
/// input or output) this is burn's `conv2d`.
///
/// # Panics
///
/// As burn's function: when the shapes do not fit together.
pub fn conv2d(
    input: Tensor<4>,
    weight: Tensor<4>,
    bias: Option<Tensor<1>>,
    options: ConvOptions<2>,
) -> Tensor<4> {
    let spec = ConvSpec {
        stride: options.stride,
        padding: options.padding,
        dilation: options.dilation,
        groups: options.groups,
        has_bias: bias.is_some(),
    };
    if !fused(&input, &weight, bias.as_ref(), &spec) {
        return burn::tensor::module::conv2d(input, weight, bias, options);
    }
    let inputs = (
        input.into_dispatch(),
        weight.into_dispatch(),
        bias.map(Tensor::into_dispatch),
    );
    match cube::conv2d(inputs, spec) {
        Ok(output) => Tensor::from_dispatch(output),
        Err(inputs) => {
            let (input, weight, bias) = *inputs;
            burn::tensor::module::conv2d(
                Tensor::from_dispatch(input),
                Tensor::from_dispatch(weight),
                bias.map(Tensor::from_dispatch),
                options,
            )
        }
    }
}

/// The most cubes a launch has along a grid dimension on every backend here (wgpu's limit).
const MAX_GRID: usize = 65_535;

/// Whether the fused kernels take these tensors: sizes that fit together as burn requires
/// (anything else goes to burn's function, which says what is wrong), one float dtype, a
/// cubecl device, and launch grids within every backend's limits.
fn fused(input: &Tensor<4>, weight: &Tensor<4>, bias: Option<&Tensor<1>>, spec: &ConvSpec) -> bool {
    let dtype = input.dtype();
    let x = input.dims();
    let w = weight.dims();
    let out = spec.output_shape(&x, &w);
    let groups = spec.groups;
    let taps = w[2] * w[3];
    // Without cubecl the range is empty (`CONV_MAX_TAPS` is 0): nothing is fused.
    #[allow(clippy::reversed_empty_ranges)]
    let taps_fit = (1..=cube::CONV_MAX_TAPS).contains(&taps);
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
        && weight.dtype() == dtype
        && bias.is_none_or(|b| b.dtype() == dtype && b.dims() == [w[0]])
        && groups > 0
        && x[1] == w[1] * groups
        && w[0].is_multiple_of(groups)
        && taps_fit
        && x.iter().chain(&w).chain(&out).all(|&d| d > 0)
        && w[0] <= MAX_GRID
        && w[1] <= MAX_GRID
        && spec.stride.iter().chain(&spec.dilation).all(|&s| s > 0)
        && cube::supports_graphs(&input.device())
}

/// `(before, after)` padding of one spatial dimension of `size` for burn-nn's `padding`, as
/// burn-nn's `Conv2d` computes it (`Same`: the output keeps `ceil(size / stride)` positions,
/// the odd one after).
fn padding_pair(
    padding: &PaddingConfig2d,
    dim: usize,
    size: usize,
    kernel: usize,
    stride: usize,
) -> (usize, usize) {
    match padding {
        PaddingConfig2d::Valid => (0, 0),
        PaddingConfig2d::Same => {
            let out = size.div_ceil(stride);
            let total = if out > 0 {
                ((out - 1) * stride + kernel).saturating_sub(size)
            } else {
                0
            };
            (total / 2, total - total / 2)
        }
        PaddingConfig2d::Explicit(top, left, bottom, right) => {
            if dim == 0 {
                (*top, *bottom)
            } else {
                (*left, *right)
            }
        }
    }
}

/// burn-nn's `Conv2d` (the same fields and record; `From` converts both ways; build it with
/// burn-nn's `Conv2dConfig` and convert) whose forward is [`conv2d`]: on burn's cubecl backends
/// one kernel forward and three backward on the layout the model holds; elsewhere burn's.
#[derive(Module, Debug)]
pub struct Conv2d {
    /// The weight, `[channels_out, channels_in / groups, kernel_h, kernel_w]`.
    pub weight: Param<Tensor<4>>,
    /// The bias, `[channels_out]`.
    pub bias: Option<Param<Tensor<1>>>,
    /// Stride.
    pub stride: [usize; 2],
    /// Kernel size.
    pub kernel_size: [usize; 2],
    /// Dilation.
    pub dilation: [usize; 2],
    /// Groups.
    pub groups: usize,
    /// Padding.
    #[module(skip)]
    pub padding: PaddingConfig2d,
}

impl From<burn::nn::conv::Conv2d> for Conv2d {
    fn from(conv: burn::nn::conv::Conv2d) -> Self {
        Self {
            weight: conv.weight,
            bias: conv.bias,
            stride: conv.stride,
            kernel_size: conv.kernel_size,
            dilation: conv.dilation,
            groups: conv.groups,
            padding: conv.padding,
        }
    }
}

impl From<Conv2d> for burn::nn::conv::Conv2d {
    fn from(conv: Conv2d) -> Self {
        Self {
            weight: conv.weight,
            bias: conv.bias,
            stride: conv.stride,
            kernel_size: conv.kernel_size,
            dilation: conv.dilation,
            groups: conv.groups,
            padding: conv.padding,
        }
    }
}

impl Conv2d {
    /// `input` (`[batch, channels_in, height, width]`) convolved, as burn-nn's `forward`.
    ///
    /// # Panics
    ///
    /// As burn-nn's: when the input's channels do not fit the weight.
    pub fn forward(&self, input: Tensor<4>) -> Tensor<4> {
        let [_, _, height, width] = input.dims();
        let vertical = padding_pair(
            &self.padding,
            0,
            height,
            self.kernel_size[0],
            self.stride[0],
        );
        let horizontal = padding_pair(&self.padding, 1, width, self.kernel_size[1], self.stride[1]);
        conv2d(
            input,
            self.weight.val(),
            self.bias.as_ref().map(Param::val),
            ConvOptions::new_with_padding(
                self.stride,
                [vertical, horizontal],
                self.dilation,
                self.groups,
            ),
        )
    }
}
