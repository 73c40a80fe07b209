//! A 2-D convolution in one kernel forward and one or three backward, reading and writing the
//! `[batch, channels, height, width]` layout the model holds, with its own autodiff node: what
//! [`crate::nn::conv2d`] runs on burn's cubecl backends, where burn-cubecl's convolution moves
//! the data around its products (slices, packs, copies and fills: half the bench CNN's step).
//!
//! Direct convolution: a unit computes one output pixel for a block of output channels (the
//! forward), or one input pixel for a block of input channels (the input gradient), reading
//! each input value once per block and the weights as values common to every unit of a cube.
//! The weight gradient is a sum over every output pixel: one cube per output-channel block and
//! input channel (and per chunk of pixels where there are few such cubes) sums its pixels per
//! unit, then over the cube in shared memory, then a second kernel sums the chunks in order.
//! Stride, dilation, groups and asymmetric padding as burn's `ConvOptions`.
//!
//! Arithmetic: every value is read in its dtype and summed in `f32`, rounded once to the dtype
//! (also in `bf16`, where burn-cubecl's convolutions sum in `bf16` after a failed tune:
//! BENCHMARKS.md). The sums run in a fixed order, so a replay computes what the eager call
//! computed, bit for bit; against burn's convolution they differ by the order of the sums and,
//! in `f32` on CUDA, by TF32 where burn's tune picks it (see the tests' tolerance).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Cube, backend_extension};
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::super::buffers::FusedTensor;
use super::super::dense::Dense;
use super::super::kernels::conv_kernels::{
    Geometry, GeometryLaunch, PIXEL_THREADS, Taps, WEIGHT_THREADS, conv_chunk_sum_kernel,
    conv_forward_kernel, conv_input_grad_kernel, conv_weight_grad_kernel,
};
use super::super::kernels::row_kernels::count_forward;
use super::super::update::update_kernel::checked_elem;
use super::super::values::{ConvSpec, OpInputs};
use super::conv_tiling::{pixel_tiling, weight_block, weight_chunks};

/// The autodiff tensor of burn's cubecl backend.
type AutodiffTensor = FloatTensor<Autodiff<Cube>>;

/// The most kernel taps (`kernel_h * kernel_w`) the fused path takes: the weight gradient holds
/// `taps` sums per unit in registers and `taps * WEIGHT_THREADS` in shared memory.
pub(crate) const MAX_TAPS: usize = 64;

/// The kernels as lazy fusion operations on burn's cubecl backend.
#[backend_extension(Cube, Fusion)]
pub(crate) trait ConvKernels: Backend {
    /// The forward: `[batch, out_channels, out_h, out_w]` in the input's dtype. `bias` is read
    /// only with `spec.has_bias` (pass the weight otherwise). Shapes, dtypes and the spec were
    /// checked by the caller ([`conv2d`]).
    #[fusion(meta = |input, weight, _bias, spec| {
        burn::backend::fusion::custom::TensorSpec::new(
            Shape::new(spec.output_shape(&input.shape.dims::<4>(), &weight.shape.dims::<4>())),
            input.dtype,
        )
    })]
    fn conv_forward(
        input: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        spec: ConvSpec,
    ) -> FloatTensor<Self>;

    /// The input gradient, of `input`'s shape and dtype (its values are not read).
    #[fusion(meta = |_grad, input, _weight, _spec| input.clone())]
    fn conv_input_grad(
        grad: FloatTensor<Self>,
        input: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        spec: ConvSpec,
    ) -> FloatTensor<Self>;

    /// `(weight gradient, bias gradient)`: of the weight's shape, and `[out_channels]`, in the
    /// weight's dtype (the bias gradient is computed with or without a bias).
    #[fusion(meta = |_grad, _input, weight, _spec| {
        let out_channels = weight.shape[0];
        (
            weight.clone(),
            burn::backend::fusion::custom::TensorSpec::new(Shape::new([out_channels]), weight.dtype),
        )
    })]
    fn conv_weight_grad(
        grad: FloatTensor<Self>,
        input: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        spec: ConvSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

/// The launch's sizes from the input's and the weight's shapes, the kernel's compile-time
/// constants, and the output's shape.
fn geometry(
    input: &CubeTensor,
    weight: &CubeTensor,
    spec: &ConvSpec,
) -> (Geometry, Taps, [usize; 4]) {
    let x = input.meta.shape().dims::<4>();
    let w = weight.meta.shape().dims::<4>();
    let out = spec.output_shape(&x, &w);
    let u = |v: usize| v as u32;
    let g = Geometry {
        batch: u(x[0]),
        in_channels: u(x[1]),
        height: u(x[2]),
        width: u(x[3]),
        out_channels: u(w[0]),
        out_height: u(out[2]),
        out_width: u(out[3]),
        pad_top: u(spec.padding[0].0),
        pad_left: u(spec.padding[1].0),
        group_in: u(w[1]),
        group_out: u(w[0] / spec.groups),
    };
    let taps = Taps {
        kernel: [w[2], w[3]],
        stride: spec.stride,
        dilation: spec.dilation,
    };
    (g, taps, out)
}

impl Geometry {
    fn launch(&self) -> GeometryLaunch {
        GeometryLaunch::new(
            self.batch,
            self.in_channels,
            self.height,
            self.width,
            self.out_channels,
            self.out_height,
            self.out_width,
            self.pad_top,
            self.pad_left,
            self.group_in,
            self.group_out,
        )
    }
}

impl ConvKernels for CubeBackend {
    fn conv_forward(
        input: CubeTensor,
        weight: CubeTensor,
        bias: CubeTensor,
        spec: ConvSpec,
    ) -> CubeTensor {
        let (g, taps, out) = geometry(&input, &weight, &spec);
        let elem = checked_elem(&input, "convolution");
        let client = input.client.clone();
        let output = Dense::new_empty(
            client.clone(),
            input.device.clone(),
            Shape::new(out),
            input.dtype,
        );
        let (input, weight, bias) = (Dense::of(&input), Dense::of(&weight), Dense::of(&bias));
        let pixels = out[0] * out[2] * out[3];
        let tiling = pixel_tiling(
            pixels,
            spec.groups,
            g.group_out as usize,
            g.group_in as usize,
        );
        // The kernel's parts are `PIXEL_THREADS / splits` slots each (`pixel_tiling` gives
        // powers of two up to 16).
        debug_assert_eq!(PIXEL_THREADS % tiling.splits, 0, "splits {}", tiling.splits);
        // SAFETY: the kernel is instantiated for `elem`, the dtype of the input, the weight and
        // the bias (one dtype, checked by the caller) and of the output (made with it). A unit
        // with pixel `p < batch * out_h * out_w` reads input elements `(n, c, iy, ix)` with
        // `c < in_channels`, `iy < height`, `ix < width` (checked), weight rows of channels
        // below `out_channels` (clamped into its group) at taps below `group_in * taps`, bias
        // elements below `out_channels` (the bias has `out_channels` elements, checked by the
        // caller; not read without it), and writes output `(n, co, oy, ox)` inside `out`. The
        // output is a new allocation, distinct from the read buffers.
        unsafe {
            conv_forward_kernel::launch_unchecked(
                &client,
                tiling.grid,
                CubeDim::new_1d(PIXEL_THREADS as u32),
                input.arg(),
                weight.arg(),
                bias.arg(),
                output.arg(),
                g.launch(),
                taps,
                tiling.block,
                tiling.per_unit,
                tiling.splits,
                spec.has_bias,
                elem,
            );
        }
        output.into_tensor()
    }

    fn conv_input_grad(
        grad: CubeTensor,
        input: CubeTensor,
        weight: CubeTensor,
        spec: ConvSpec,
    ) -> CubeTensor {
        let (g, taps, _) = geometry(&input, &weight, &spec);
        let elem = checked_elem(&input, "convolution");
        let client = input.client.clone();
        let dx = Dense::empty_like(&input);
        let (grad, weight) = (Dense::of(&grad), Dense::of(&weight));
        let pixels = (g.batch * g.height * g.width) as usize;
        let tiling = pixel_tiling(pixels, spec.groups, g.group_in as usize, 0);
        // SAFETY: one dtype `elem` for grad, weight and dx (checked by the caller). A unit with
        // input pixel `p < batch * height * width` reads grad elements `(n, co, oy, ox)` with
        // `co < out_channels`, `oy < out_h`, `ox < out_w` (checked; grad has the forward's
        // output shape), weight elements of channel `co` at input-channel offsets clamped into
        // `group_in` and taps below `taps`, and writes dx `(n, ci, y, x)` inside the input's
        // shape. dx is a new allocation, distinct from the read buffers.
        unsafe {
            conv_input_grad_kernel::launch_unchecked(
                &client,
                tiling.grid,
                CubeDim::new_1d(PIXEL_THREADS as u32),
                grad.arg(),
                weight.arg(),
                dx.arg(),
                g.launch(),
                taps,
                tiling.block,
                tiling.per_unit,
                elem,
            );
        }
        dx.into_tensor()
    }

    fn conv_weight_grad(
        grad: CubeTensor,
        input: CubeTensor,
        weight: CubeTensor,
        spec: ConvSpec,
    ) -> (CubeTensor, CubeTensor) {
        let (g, taps, out) = geometry(&input, &weight, &spec);
        let elem = checked_elem(&input, "convolution");
        let client = input.client.clone();
        let device = input.device.clone();
        let new = |shape: Shape, dtype: DType| {
            Dense::new_empty(client.clone(), device.clone(), shape, dtype)
        };
        let (out_channels, group_in, group_out) = (
            g.out_channels as usize,
            g.group_in as usize,
            g.group_out as usize,
        );
        let kernel_taps = taps.kernel[0] * taps.kernel[1];
        let block = weight_block(kernel_taps, group_out);
        let cube_blocks = spec.groups * group_out.div_ceil(block);
        let pixels = out[0] * out[2] * out[3];
        let (chunks, per_chunk) = weight_chunks(pixels, cube_blocks * group_in);
        let weights = out_channels * group_in * kernel_taps;
        let partial = new(Shape::new([chunks, weights]), DType::F32);
        let bias_partial = new(Shape::new([chunks, out_channels]), DType::F32);
        let weight_grad = new(weight.meta.shape().clone(), weight.dtype);
        let bias_grad = new(Shape::new([out_channels]), weight.dtype);
        let (grad, input) = (Dense::of(&grad), Dense::of(&input));
        // SAFETY: one dtype `elem` for grad, input and the two gradients (checked by the
        // caller), f32 for the partial sums. A cube `(b, ci, k)` (`b` below the output-channel
        // blocks, `ci < group_in`, `k < chunks`) reads grad at output pixels below `pixels` of
        // channels clamped below `out_channels`, input at `(n, c, iy, ix)` inside its shape
        // (checked), indexes its shared array below `block * taps * WEIGHT_THREADS` (its size),
        // and writes row `k < chunks` of the partial sums at weights below `weights` and output
        // channels below `out_channels`. Every element of the partial sums is written by exactly
        // one cube (each weight of each chunk; each bias of each chunk by its block's `ci == 0`
        // cube) before the second kernel, on the same stream, reads it; that kernel writes
        // element `i` of the two new gradients, `i` below their lengths. The written buffers are
        // new allocations, distinct from each other and from the read ones.
        unsafe {
            conv_weight_grad_kernel::launch_unchecked(
                &client,
                CubeCount::Static(cube_blocks as u32, group_in as u32, chunks as u32),
                CubeDim::new_1d(WEIGHT_THREADS as u32),
                grad.arg(),
                input.arg(),
                partial.arg(),
                bias_partial.arg(),
                g.launch(),
                per_chunk as u32,
                taps,
                block,
                WEIGHT_THREADS,
                elem,
            );
            conv_chunk_sum_kernel::launch_unchecked(
                &client,
                CubeCount::Static(weights.div_ceil(PIXEL_THREADS).max(1) as u32, 1, 1),
                CubeDim::new_1d(PIXEL_THREADS as u32),
                partial.arg(),
                bias_partial.arg(),
                weight_grad.arg(),
                bias_grad.arg(),
                chunks as u32,
                elem,
            );
        }
        (weight_grad.into_tensor(), bias_grad.into_tensor())
    }
}

/// The convolution with its own backward, reached from `Tensor` through burn's dispatch.
#[backend_extension(Cube, Autodiff)]
pub(crate) trait FusedConvOps: Backend {
    /// `input` (`[batch, in_channels, height, width]`) convolved with `weight`
    /// (`[out_channels, in_channels / groups, kernel_h, kernel_w]`), plus `bias`
    /// (`[out_channels]`) where `spec.has_bias` (otherwise `bias` is not read and gets no
    /// gradient: pass the weight). An optional tensor does not cross burn 0.22's generated
    /// dispatch (UPSTREAM.md 14), hence the flag.
    fn fused_conv2d(
        input: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        spec: ConvSpec,
    ) -> FloatTensor<Self>;
}

/// Without autodiff: the forward alone.
impl FusedConvOps for Cube {
    fn fused_conv2d(
        input: FusedTensor,
        weight: FusedTensor,
        bias: FusedTensor,
        spec: ConvSpec,
    ) -> FusedTensor {
        count_forward();
        <Cube as ConvKernels>::conv_forward(input, weight, bias, spec)
    }
}

/// What the backward keeps of the forward.
#[derive(Debug, Clone)]
struct Saved {
    input: FusedTensor,
    weight: FusedTensor,
    spec: ConvSpec,
}

/// The backward node: parents input, weight and bias (an untracked stand-in without a bias).
#[derive(Debug)]
struct ConvBackward;

impl Backward<Cube, 3> for ConvBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Saved, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_input, node_weight, node_bias] = ops.parents;
        let grad = grads.consume::<Cube>(&ops.node);
        let Saved {
            input,
            weight,
            spec,
        } = ops.state;
        if node_weight.is_some() || node_bias.is_some() {
            let (dweight, dbias) = <Cube as ConvKernels>::conv_weight_grad(
                grad.clone(),
                input.clone(),
                weight.clone(),
                spec,
            );
            if let Some(node) = node_weight {
                grads.register::<Cube>(node.id, dweight);
            }
            if let Some(node) = node_bias {
                grads.register::<Cube>(node.id, dbias);
            }
        }
        if let Some(node) = node_input {
            let dx = <Cube as ConvKernels>::conv_input_grad(grad, input, weight, spec);
            grads.register::<Cube>(node.id, dx);
        }
    }
}

impl<C: CheckpointStrategy> FusedConvOps for Autodiff<Cube, C> {
    fn fused_conv2d(
        input: AutodiffTensor,
        weight: AutodiffTensor,
        bias: AutodiffTensor,
        spec: ConvSpec,
    ) -> AutodiffTensor {
        let (input, input_node) = input.into_parts();
        let (weight, weight_node) = weight.into_parts();
        let (bias, bias_node) = bias.into_parts();
        // Without a bias, an untracked parent in its place: it asks for no gradient.
        let bias_node = if spec.has_bias {
            bias_node
        } else {
            AutodiffTensor::new(weight.clone()).node()
        };
        let prepared = ConvBackward
            .prepare::<C>([input_node, weight_node, bias_node])
            .compute_bound()
            .stateful();
        count_forward();
        let output = <Cube as ConvKernels>::conv_forward(input.clone(), weight.clone(), bias, spec);
        match prepared {
            OpsKind::Tracked(prep) => prep.finish(
                Saved {
                    input,
                    weight,
                    spec,
                },
                output,
            ),
            OpsKind::UnTracked(prep) => prep.finish(output),
        }
    }
}

/// The fused convolution of tensors of burn's cubecl backend (autodiff or not), through
/// burn's dispatch. The caller checked the device (a cubecl one), the dtypes (one of `f32`,
/// `f16`, `bf16` for all), the shapes (`spec.fits`) and whether a bias is given.
/// Never `Err` here (see the stand-in, which hands the tensors back).
pub(crate) fn conv2d(
    (input, weight, bias): OpInputs,
    spec: ConvSpec,
) -> Result<burn::backend::DispatchTensor, Box<OpInputs>> {
    let bias = bias.unwrap_or_else(|| weight.clone());
    Ok(<burn::backend::Dispatch as FusedConvOps>::fused_conv2d(
        input, weight, bias, spec,
    ))
}
