//! A linear layer with its own backward: `y = x W + b`, and `y = x W + b + r` with a residual
//! `r` added before the one rounding (a transformer block's `x + proj(h)`: one launch where
//! burn runs the product and the addition apart), each through a ReLU where asked (an MLP's
//! `relu(x W + b)`: one launch where burn runs two).
//!
//! - On at most [`MAX_ROWS`] rows (batch 1 inference, small batches), a kernel of ours that
//!   spreads each output column's dot product over a cube, where cubecl's tuned matmul never
//!   times its gemv candidates for a row-major weight (UPSTREAM.md 13). Products and sums in
//!   `f32` whatever the dtype, one rounding at the store; each column's sum in a fixed order
//!   (the cube's slices of `k`, each in order, then the slices in order), so a replay equals
//!   the eager call bit for bit.
//! - On more rows where cuBLASLt is available (CUDA), one cuBLASLt product with the bias in its
//!   epilogue and the residual as its `C` (`beta = 1`) (`vendor_matmul.rs`).
//!
//! The backward (`dx = dy Wᵀ`, `dW = xᵀ dy`, `db = 1ᵀ dy`, `dr = dy`): three products through
//! cuBLASLt where available; burn's matmuls and sum elsewhere; the residual's gradient is `dy`
//! itself (no kernel). Through a ReLU, `dy` first keeps only the elements whose output is above
//! zero (the forward's own decision, read from its output: one elementwise kernel).
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ops::{ActivationOps, FloatTensorOps};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Cube, TensorMetadata, backend_extension};
use burn::tensor::Shape;
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::super::buffers::FusedTensor;
use super::super::dense::Dense;
use super::super::kernels::row_kernels::count_forward;
use super::super::update::update_kernel::kernel_elem;
use super::vendor_matmul;

/// The autodiff tensor of burn's cubecl backend.
type AutodiffTensor = FloatTensor<Autodiff<Cube>>;

/// The most rows the kernel takes (a cube row per input row; the weight is read once per row).
pub(crate) const MAX_ROWS: usize = 8;
/// Units of a cube.
const UNITS: usize = 256;
/// Bytes of each row of `W` a cube reads: one 32-byte memory sector, so that a cube's loads
/// use every byte of the sectors they fetch, however few columns that is.
const SEGMENT_BYTES: usize = 32;

/// `out[r, c] = sum_k x[r, k] * w[k, c] (+ bias[c]) (+ residual[r, c])`: cube `(i, r)` computes
/// columns `i * columns ..` of row `r`; unit `(c, s)` sums `k = s, s + slices, ...` of column
/// `c` (`slices = UNITS / columns`), then unit `(c, 0)` adds the partial sums in slice order,
/// the bias, the residual, and with `relu` takes the larger of the sum and zero. A unit's loads
/// are independent, so a few per unit (`d_in / slices`) are in flight at once: the kernel waits
/// on the memory a couple of times, not once per load.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn linear_small_rows_kernel<F: Float>(
    x: &[F],
    w: &[F],
    bias: &[F],
    residual: &[F],
    out: &mut [F],
    d_in: u32,
    d_out: u32,
    #[comptime] columns: usize,
    #[comptime] has_bias: bool,
    #[comptime] has_residual: bool,
    #[comptime] relu: bool,
    #[define(F)] _dtype: ElemType,
) {
    let slices = comptime!(UNITS / columns);
    let d_in = d_in as usize;
    let d_out = d_out as usize;
    let lane = UNIT_POS_X as usize;
    let column = CUBE_POS_X as usize * columns + lane;
    let row = CUBE_POS_Y as usize;
    let slice = UNIT_POS_Y as usize;
    let mut partial = 0.0f32;
    if column < d_out {
        let mut k = slice;
        while k < d_in {
            partial += f32::cast_from(x[row * d_in + k]) * f32::cast_from(w[k * d_out + column]);
            k += slices;
        }
    }
    let mut shared = Shared::<[f32]>::new_slice(UNITS);
    shared[slice * columns + lane] = partial;
    sync_cube();
    if slice == 0 && column < d_out {
        let mut sum = 0.0f32;
        #[unroll]
        for s in 0..slices {
            sum += shared[s * columns + lane];
        }
        if has_bias {
            sum += f32::cast_from(bias[column]);
        }
        if has_residual {
            sum += f32::cast_from(residual[row * d_out + column]);
        }
        if relu {
            sum = f32::max(sum, 0.0);
        }
        out[row * d_out + column] = F::cast_from(sum);
    }
}

/// The kernel as a lazy fusion operation on burn's cubecl backend.
#[backend_extension(Cube, Fusion)]
pub(crate) trait LinearKernels: Backend {
    /// `x W (+ bias) (+ residual)`, through a ReLU with `relu`, for `x` `[rows, d_in]` (`rows
    /// <= MAX_ROWS`), `W` `[d_in, d_out]`, `bias` `[d_out]` read only with `has_bias`,
    /// `residual` `[rows, d_out]` read only with `has_residual` (pass any tensor otherwise):
    /// `[rows, d_out]` in the dtype of all four (checked by the caller).
    #[fusion(meta = |x, w, _bias, _residual, _has_bias, _has_residual, _relu| {
        let mut spec = x.clone();
        spec.shape = Shape::new([x.shape[0], w.shape[1]]);
        spec
    })]
    #[allow(clippy::too_many_arguments)]
    fn small_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        has_bias: bool,
        has_residual: bool,
        relu: bool,
    ) -> FloatTensor<Self>;

    /// `op(a) op(b) (+ bias where has_bias) (+ residual where has_residual)`, through a ReLU
    /// with `relu`, `op` transposing where `ta` / `tb` say, through cuBLASLt (`[m, n]`, dense;
    /// the residual `[m, n]`); burn's matmul, additions and ReLU where cuBLASLt refuses the
    /// operands.
    #[fusion(meta = |a, b, _bias, _residual, _has_bias, _has_residual, ta, tb, _relu| {
        let mut spec = a.clone();
        let m = if *ta { a.shape[1] } else { a.shape[0] };
        let n = if *tb { b.shape[0] } else { b.shape[1] };
        spec.shape = Shape::new([m, n]);
        spec
    })]
    #[allow(clippy::too_many_arguments)]
    fn vendor_gemm(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        has_bias: bool,
        has_residual: bool,
        ta: bool,
        tb: bool,
        relu: bool,
    ) -> FloatTensor<Self>;
}

impl LinearKernels for CubeBackend {
    fn small_linear(
        x: CubeTensor,
        w: CubeTensor,
        bias: CubeTensor,
        residual: CubeTensor,
        has_bias: bool,
        has_residual: bool,
        relu: bool,
    ) -> CubeTensor {
        let [rows, d_in] = x.meta.shape().dims::<2>();
        let [_, d_out] = w.meta.shape().dims::<2>();
        let elem = kernel_elem(x.dtype).unwrap_or_else(|| {
            panic!(
                "burn-graphed: small linear kernel given {:?} (the caller checks the dtype)",
                x.dtype
            )
        });
        // 8 columns a cube in `f32`, 16 in `f16` and `bf16` (powers of two: they divide `UNITS`).
        let columns = (SEGMENT_BYTES / x.dtype.size()).clamp(1, UNITS);
        let (client, device) = (x.client.clone(), x.device.clone());
        let out = Dense::new_empty(client.clone(), device, Shape::new([rows, d_out]), x.dtype);
        let (x, w, bias, residual) = (
            Dense::of(&x),
            Dense::of(&w),
            Dense::of(&bias),
            Dense::of(&residual),
        );
        // SAFETY: the kernel is instantiated for `elem`, the dtype of x, w, bias and residual
        // (one dtype, checked by the caller) and out (made with it). Cube `(i, r)` reads row
        // `r < rows` of x (indices below `rows * d_in`), rows `k < d_in` of w at columns below
        // `d_out` (below `d_in * d_out`), bias below `d_out` (its length, checked by the caller,
        // read only with `has_bias`), residual below `rows * d_out` (its shape `[rows, d_out]`,
        // dense, checked by the caller, read only with `has_residual`) and writes row `r` of
        // out, a new allocation; the shared array holds `UNITS` values, indexed by the unit's
        // position in the cube of that size (`columns * slices`, `columns` dividing `UNITS`).
        unsafe {
            linear_small_rows_kernel::launch_unchecked(
                &client,
                CubeCount::Static(d_out.div_ceil(columns) as u32, rows as u32, 1),
                CubeDim::new_2d(columns as u32, (UNITS / columns) as u32),
                x.arg(),
                w.arg(),
                bias.arg(),
                residual.arg(),
                out.arg(),
                d_in as u32,
                d_out as u32,
                columns,
                has_bias,
                has_residual,
                relu,
                elem,
            );
        }
        out.into_tensor()
    }

    fn vendor_gemm(
        a: CubeTensor,
        b: CubeTensor,
        bias: CubeTensor,
        residual: CubeTensor,
        has_bias: bool,
        has_residual: bool,
        ta: bool,
        tb: bool,
        relu: bool,
    ) -> CubeTensor {
        let residual = has_residual.then_some(residual);
        let bias_given = has_bias.then_some(&bias);
        match vendor_matmul::gemm(&a, &b, bias_given, residual.as_ref(), (ta, tb), relu) {
            Ok(out) => out,
            Err(error) => {
                static ONCE: std::sync::Once = std::sync::Once::new();
                ONCE.call_once(|| {
                    log::warn!("burn-graphed: a product ran on burn's matmul: {error}");
                });
                let a = if ta {
                    CubeBackend::float_transpose(a)
                } else {
                    a
                };
                let b = if tb {
                    CubeBackend::float_transpose(b)
                } else {
                    b
                };
                let mut out = CubeBackend::float_matmul(a, b);
                if has_bias {
                    let n = bias.meta.shape()[0];
                    out = CubeBackend::float_add(
                        out,
                        CubeBackend::float_reshape(bias, Shape::new([1, n])),
                    );
                }
                if let Some(residual) = residual {
                    out = CubeBackend::float_add(out, residual);
                }
                if relu {
                    out = CubeBackend::relu(out);
                }
                out
            }
        }
    }
}

/// The linear layer with its own backward, reached from `Tensor` through burn's dispatch.
#[backend_extension(Cube, Autodiff)]
pub(crate) trait FusedLinearOps: Backend {
    /// `x W (+ bias where has_bias) (+ residual where has_residual)`, through a ReLU where
    /// `relu`, `x` `[rows, d_in]`, `residual` `[rows, d_out]`: the small kernel on at most
    /// [`MAX_ROWS`] rows, otherwise cuBLASLt (the caller checked `vendor`); the backward's
    /// products through cuBLASLt where `vendor`.
    #[allow(clippy::too_many_arguments)]
    fn fused_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        has_bias: bool,
        has_residual: bool,
        vendor: bool,
        relu: bool,
    ) -> FloatTensor<Self>;
}

/// What one call does after the product: adds the bias and the residual, each where it is
/// given (an operand that is not given is a stand-in tensor the kernels never read), then a
/// ReLU where `relu`.
struct Addends {
    bias: FusedTensor,
    residual: FusedTensor,
    has_bias: bool,
    has_residual: bool,
    relu: bool,
}

/// The forward on the fused backend: the small kernel or one cuBLASLt product.
fn forward(x: FusedTensor, w: FusedTensor, add: Addends) -> FusedTensor {
    count_forward();
    let Addends {
        bias,
        residual,
        has_bias,
        has_residual,
        relu,
    } = add;
    if x.shape()[0] <= MAX_ROWS {
        <Cube as LinearKernels>::small_linear(x, w, bias, residual, has_bias, has_residual, relu)
    } else {
        <Cube as LinearKernels>::vendor_gemm(
            x,
            w,
            bias,
            residual,
            has_bias,
            has_residual,
            false,
            false,
            relu,
        )
    }
}

impl FusedLinearOps for Cube {
    fn fused_linear(
        x: FusedTensor,
        w: FusedTensor,
        bias: FusedTensor,
        residual: FusedTensor,
        has_bias: bool,
        has_residual: bool,
        _vendor: bool,
        relu: bool,
    ) -> FusedTensor {
        let add = Addends {
            bias,
            residual,
            has_bias,
            has_residual,
            relu,
        };
        forward(x, w, add)
    }
}

/// What the backward keeps: the input, the weight, whether its products go to cuBLASLt, and
/// through a ReLU the output (whose zeros say where the gradient stops).
#[derive(Debug, Clone)]
struct Saved {
    x: FusedTensor,
    w: FusedTensor,
    vendor: bool,
    relu_output: Option<FusedTensor>,
}

/// The backward node: parents x, W, the bias and the residual (untracked stand-ins where not
/// given).
#[derive(Debug)]
struct LinearBackward;

impl Backward<Cube, 4> for LinearBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Saved, 4>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_x, node_w, node_bias, node_residual] = ops.parents;
        let Saved {
            x,
            w,
            vendor,
            relu_output,
        } = ops.state;
        let dy = grads.consume::<Cube>(&ops.node);
        // Through the ReLU: the gradient where the output is above zero, zero elsewhere.
        let dy = match relu_output {
            Some(out) => Cube::relu_backward(out, dy),
            None => dy,
        };
        // `op(a) op(b)`: cuBLASLt reads the transposes in place; burn's matmul takes views.
        let product = |a: FusedTensor, b: FusedTensor, ta: bool, tb: bool| {
            if vendor {
                <Cube as LinearKernels>::vendor_gemm(
                    a,
                    b.clone(),
                    b.clone(),
                    b,
                    false,
                    false,
                    ta,
                    tb,
                    false,
                )
            } else {
                let a = if ta { Cube::float_transpose(a) } else { a };
                let b = if tb { Cube::float_transpose(b) } else { b };
                Cube::float_matmul(a, b)
            }
        };
        // `out = ... + residual`: the residual's gradient is the output's.
        if let Some(node) = node_residual {
            grads.register::<Cube>(node.id, dy.clone());
        }
        if let Some(node) = node_x {
            grads.register::<Cube>(node.id, product(dy.clone(), w, false, true));
        }
        if let Some(node) = node_w {
            grads.register::<Cube>(node.id, product(x, dy.clone(), true, false));
        }
        if let Some(node) = node_bias {
            let [rows, d_out] = dy.shape().dims::<2>();
            // With cuBLASLt, the column sums as the product `1ᵀ dy` (one fill and one
            // product, where a reduction over the rows of a row-major `dy` reads it strided).
            let db = if vendor {
                let ones = Cube::float_ones(
                    Shape::new([1, rows]),
                    &dy.device(),
                    burn::tensor::FloatDType::from(dy.dtype()),
                );
                <Cube as LinearKernels>::vendor_gemm(
                    ones.clone(),
                    dy,
                    ones.clone(),
                    ones,
                    false,
                    false,
                    false,
                    false,
                    false,
                )
            } else {
                Cube::float_sum_dim(dy, 0)
            };
            grads.register::<Cube>(node.id, Cube::float_reshape(db, Shape::new([d_out])));
        }
    }
}

impl<C: CheckpointStrategy> FusedLinearOps for Autodiff<Cube, C> {
    fn fused_linear(
        x: AutodiffTensor,
        w: AutodiffTensor,
        bias: AutodiffTensor,
        residual: AutodiffTensor,
        has_bias: bool,
        has_residual: bool,
        vendor: bool,
        relu: bool,
    ) -> AutodiffTensor {
        let (x, x_node) = x.into_parts();
        let (w, w_node) = w.into_parts();
        let (bias, bias_node) = bias.into_parts();
        let (residual, residual_node) = residual.into_parts();
        // Without a bias or a residual, an untracked parent in its place: it asks for no
        // gradient.
        let untracked = |given: bool, node| {
            if given {
                node
            } else {
                AutodiffTensor::new(w.clone()).node()
            }
        };
        let bias_node = untracked(has_bias, bias_node);
        let residual_node = untracked(has_residual, residual_node);
        let prepared = LinearBackward
            .prepare::<C>([x_node, w_node, bias_node, residual_node])
            .compute_bound()
            .stateful();
        let add = Addends {
            bias,
            residual,
            has_bias,
            has_residual,
            relu,
        };
        let out = forward(x.clone(), w.clone(), add);
        match prepared {
            OpsKind::Tracked(prep) => {
                let relu_output = relu.then(|| out.clone());
                let saved = Saved {
                    x,
                    w,
                    vendor,
                    relu_output,
                };
                prep.finish(saved, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}

/// `x W (+ bias) (+ residual)`, through a ReLU where `relu`, for `x` `[rows, d_in]` through
/// burn's dispatch: the small
/// kernel on at most [`MAX_ROWS`] rows, cuBLASLt on more (the caller checked
/// [`vendor_matmul::available`] then). The caller checked the device (a cubecl one), the dtypes
/// (one of `f32`, `f16`, `bf16` for all) and the shapes (the residual `[rows, d_out]`). Never
/// `Err` here (see the stand-in, which hands the tensors back).
pub(crate) fn linear(
    inputs: super::super::values::LinearInputs,
    vendor: bool,
    relu: bool,
) -> Result<burn::backend::DispatchTensor, Box<super::super::values::LinearInputs>> {
    let ((x, w, bias), residual) = inputs;
    let (has_bias, has_residual) = (bias.is_some(), residual.is_some());
    let bias = bias.unwrap_or_else(|| w.clone());
    let residual = residual.unwrap_or_else(|| w.clone());
    Ok(<burn::backend::Dispatch as FusedLinearOps>::fused_linear(
        x,
        w,
        bias,
        residual,
        has_bias,
        has_residual,
        vendor,
        relu,
    ))
}
