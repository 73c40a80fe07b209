//! Layer norm in one kernel forward and three backward, with its own autodiff node: what
//! [`crate::nn::layer_norm`] runs on burn's cubecl backends, where burn composes the norm from
//! two mean reductions and five elementwise operations forward and about twice that backward.
//!
//! Arithmetic: every element is read in its dtype and computed in `f32` (burn-nn's `LayerNorm`
//! casts `f16` and `bf16` inputs to `f32` for the norm and back, so the output is rounded once,
//! as there). Forward, per row of `width` elements: `mean = sum(x) / width`, `var = sum((x -
//! mean)^2) / width` (two passes, as burn's composition), `y = (x - mean) / sqrt(var + eps) *
//! gamma + beta`. The row's mean and `rstd = 1 / sqrt(var + eps)` are kept for the backward:
//! `xhat = (x - mean) * rstd`, `g = dy * gamma`, `dx = rstd * (g - mean(g) - xhat *
//! mean(g * xhat))`; `dgamma = sum over rows of dy * xhat`, `dbeta = sum over rows of dy`, summed
//! in `f32` per chunk of rows by one kernel and over the chunks by a third, in a fixed order,
//! and rounded once to the parameter's dtype. The sums inside a row run in a fixed tree order,
//! so a replay computes what the eager call computed, bit for bit; against burn's composition
//! they differ by the order of the sums (see the tests' tolerance).
//!
//! Over 600 lines: the four kernels of one op (forward, input gradient, parameter-gradient
//! chunks, their sum), their launches, the fusion operations and the autodiff node.

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
use super::super::kernels::norm_plane_kernel;
use super::super::kernels::row_kernels::{
    MAX_THREADS, count_forward, cube_sum, row_grid, row_of_cube, threads_for,
};
use super::super::update::update_kernel::checked_elem;
use super::super::values::OpInputs;

/// The autodiff tensor of burn's cubecl backend.
type AutodiffTensor = FloatTensor<Autodiff<Cube>>;

/// Chunks of rows the parameter gradients are summed over by the second backward kernel (each
/// chunk's sum is one row of partial sums; [`norm_chunk_sum_kernel`] adds the chunks).
const GRAD_CHUNKS: usize = 128;

/// Forward: row `r` of `input` normalized into `output`, its mean and `rstd` into `mean[r]`
/// and `rstd[r]`. `beta` is read only with `has_beta`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn norm_forward_kernel<F: Float>(
    input: &[F],
    gamma: &[F],
    beta: &[F],
    output: &mut [F],
    mean: &mut [f32],
    rstd: &mut [f32],
    width: u32,
    epsilon: f32,
    #[comptime] threads: usize,
    #[comptime] has_beta: bool,
    #[comptime] centered: bool,
    #[define(F)] _dtype: ElemType,
) {
    let row = row_of_cube();
    // Uniform over the cube: every unit of a cube has the same row, so the barriers inside
    // are met by all of them or none.
    if row < mean.len() {
        let width = width as usize;
        let base = row * width;
        let unit = UNIT_POS as usize;
        let count = f32::cast_from(width);
        let mut i = unit;
        let mut row_mean = 0.0f32;
        if centered {
            let mut sum = 0.0f32;
            while i < width {
                sum += f32::cast_from(input[base + i]);
                i += threads;
            }
            row_mean = cube_sum(sum, threads) / count;
        }
        let mut squares = 0.0f32;
        i = unit;
        while i < width {
            let centered = f32::cast_from(input[base + i]) - row_mean;
            squares += centered * centered;
            i += threads;
        }
        let var = cube_sum(squares, threads) / count;
        let denom = (var + epsilon).sqrt();
        i = unit;
        while i < width {
            let normalized = (f32::cast_from(input[base + i]) - row_mean) / denom;
            let mut y = normalized * f32::cast_from(gamma[i]);
            if has_beta {
                y += f32::cast_from(beta[i]);
            }
            output[base + i] = F::cast_from(y);
            i += threads;
        }
        if unit == 0 {
            mean[row] = row_mean;
            rstd[row] = 1.0f32 / denom;
        }
    }
}

/// Backward of the input: row `r` of `dx` from the same row of `grad` and `input`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn norm_input_grad_kernel<F: Float>(
    grad: &[F],
    input: &[F],
    gamma: &[F],
    mean: &[f32],
    rstd: &[f32],
    dx: &mut [F],
    width: u32,
    #[comptime] threads: usize,
    #[comptime] centered: bool,
    #[define(F)] _dtype: ElemType,
) {
    let row = row_of_cube();
    // Uniform over the cube, as in the forward.
    if row < mean.len() {
        let width = width as usize;
        let base = row * width;
        let unit = UNIT_POS as usize;
        let count = f32::cast_from(width);
        let row_mean = mean[row];
        let row_rstd = rstd[row];
        let mut sum_g = 0.0f32;
        let mut sum_gx = 0.0f32;
        let mut i = unit;
        while i < width {
            let g = f32::cast_from(grad[base + i]) * f32::cast_from(gamma[i]);
            let xhat = (f32::cast_from(input[base + i]) - row_mean) * row_rstd;
            sum_g += g;
            sum_gx += g * xhat;
            i += threads;
        }
        let mut mean_g = 0.0f32;
        if centered {
            mean_g = cube_sum(sum_g, threads) / count;
        }
        let mean_gx = cube_sum(sum_gx, threads) / count;
        i = unit;
        while i < width {
            let g = f32::cast_from(grad[base + i]) * f32::cast_from(gamma[i]);
            let xhat = (f32::cast_from(input[base + i]) - row_mean) * row_rstd;
            dx[base + i] = F::cast_from(row_rstd * (g - mean_g - xhat * mean_gx));
            i += threads;
        }
    }
}

/// Backward of gamma and beta, in partial sums: unit `c` of cube `(x, k)` sums column
/// `x * CUBE_DIM_X + c` over the rows of chunk `k` into row `k` of `dgamma` and `dbeta`
/// (`[chunks, width]`, `f32`).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn norm_param_grad_kernel<F: Float>(
    grad: &[F],
    input: &[F],
    mean: &[f32],
    rstd: &[f32],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
    width: u32,
    rows_per_chunk: u32,
    #[define(F)] _dtype: ElemType,
) {
    let width = width as usize;
    let column = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    let chunk = CUBE_POS_Y as usize;
    if column < width {
        let rows = mean.len();
        let mut row = chunk * rows_per_chunk as usize;
        let mut end = row + rows_per_chunk as usize;
        if end > rows {
            end = rows;
        }
        let mut sum_gamma = 0.0f32;
        let mut sum_beta = 0.0f32;
        while row < end {
            let dy = f32::cast_from(grad[row * width + column]);
            let xhat = (f32::cast_from(input[row * width + column]) - mean[row]) * rstd[row];
            sum_gamma += dy * xhat;
            sum_beta += dy;
            row += 1;
        }
        dgamma[chunk * width + column] = sum_gamma;
        dbeta[chunk * width + column] = sum_beta;
    }
}

/// Columns of the parameter gradients one cube of [`norm_chunk_sum_kernel`] finishes.
const SUM_COLUMNS: usize = 32;
/// Units per column of [`norm_chunk_sum_kernel`], each summing every `SUM_LANES`-th chunk.
const SUM_LANES: usize = 8;

/// The parameter gradients from their partial sums: column `c` of `dgamma` and `dbeta`
/// (`[chunks, width]`, `f32`) summed over the chunks into `gamma_grad[c]` and `beta_grad[c]`,
/// rounded once to `F`. Unit `(x, y)` of cube `b` sums column `b * SUM_COLUMNS + x` over
/// chunks `y, y + SUM_LANES, ...` in order; unit `(x, 0)` adds the lanes' sums in lane order.
#[cube(launch_unchecked)]
fn norm_chunk_sum_kernel<F: Float>(
    dgamma: &[f32],
    dbeta: &[f32],
    gamma_grad: &mut [F],
    beta_grad: &mut [F],
    width: u32,
    #[define(F)] _dtype: ElemType,
) {
    let width = width as usize;
    let chunks = dgamma.len() / width;
    let x = UNIT_POS_X as usize;
    let lane = UNIT_POS_Y as usize;
    let column = CUBE_POS_X as usize * SUM_COLUMNS + x;
    let mut gamma_lanes = Shared::<[f32]>::new_slice(SUM_COLUMNS * SUM_LANES);
    let mut beta_lanes = Shared::<[f32]>::new_slice(SUM_COLUMNS * SUM_LANES);
    let mut sum_gamma = 0.0f32;
    let mut sum_beta = 0.0f32;
    if column < width {
        let mut chunk = lane;
        while chunk < chunks {
            sum_gamma += dgamma[chunk * width + column];
            sum_beta += dbeta[chunk * width + column];
            chunk += SUM_LANES;
        }
    }
    gamma_lanes[lane * SUM_COLUMNS + x] = sum_gamma;
    beta_lanes[lane * SUM_COLUMNS + x] = sum_beta;
    sync_cube();
    if lane == 0 && column < width {
        let mut total_gamma = gamma_lanes[x];
        let mut total_beta = beta_lanes[x];
        let mut other = 1usize;
        while other < SUM_LANES {
            total_gamma += gamma_lanes[other * SUM_COLUMNS + x];
            total_beta += beta_lanes[other * SUM_COLUMNS + x];
            other += 1;
        }
        gamma_grad[column] = F::cast_from(total_gamma);
        beta_grad[column] = F::cast_from(total_beta);
    }
}

/// The kernels as lazy fusion operations on burn's cubecl backend.
#[backend_extension(Cube, Fusion)]
pub(crate) trait LayerNormKernels: Backend {
    /// The forward: `(output, mean, rstd)`, the output of `input`'s shape and dtype, the row
    /// statistics `[rows]` in `f32`. `beta` is read only with `has_beta` (pass any tensor of
    /// gamma's shape otherwise). Without `centered`, the RMS norm: no mean is subtracted (the
    /// saved mean is 0). Shapes and dtypes were checked by the caller.
    #[fusion(meta = |input, _gamma, _beta, _epsilon, _has_beta, _centered| {
        let rows = rows_of(&input.shape);
        let stats = burn::backend::fusion::custom::TensorSpec::new(Shape::new([rows]), DType::F32);
        (input.clone(), stats.clone(), stats)
    })]
    fn layer_norm_forward(
        input: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f32,
        has_beta: bool,
        centered: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// The backward: `(dx, dgamma, dbeta)`, `dx` of `input`'s shape and dtype, the parameter
    /// gradients of gamma's shape and dtype. `centered` as in the forward.
    #[fusion(meta = |_grad, input, gamma, _mean, _rstd, _centered| {
        (input.clone(), gamma.clone(), gamma.clone())
    })]
    fn layer_norm_backward(
        grad: FloatTensor<Self>,
        input: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        centered: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

/// Rows of a tensor of `shape` normalized over its last dimension.
fn rows_of(shape: &Shape) -> usize {
    let width = shape[shape.num_dims() - 1];
    shape.num_elements().checked_div(width).unwrap_or(0)
}

/// Rows per chunk of the parameter gradients' partial sums over `rows` rows: each chunk's sum
/// runs down its rows in order (`burn_graphed::testing`, for the tests' rounding bound).
#[cfg(feature = "testing")]
pub(crate) fn grad_rows_per_chunk(rows: usize) -> usize {
    grad_chunks(rows).1
}

/// Lanes of [`norm_chunk_sum_kernel`]: lane `l` adds chunks `l, l + lanes, ...` in order, then the
/// lanes are added in order (`burn_graphed::testing`, for the tests' rounding bound).
#[cfg(feature = "testing")]
pub(crate) fn grad_sum_lanes() -> usize {
    SUM_LANES
}

/// `(chunks, rows per chunk)` of the parameter gradients' partial sums over `rows` rows.
fn grad_chunks(rows: usize) -> (usize, usize) {
    let per_chunk = rows.div_ceil(GRAD_CHUNKS).max(1);
    (rows.div_ceil(per_chunk).max(1), per_chunk)
}

/// Where a launch goes and what it covers: the input's rows of `width` elements of `elem`.
struct Layout {
    shape: Shape,
    rows: usize,
    width: usize,
    elem: ElemType,
    client: cubecl::client::Client,
    device: burn_cubecl::CubeDevice,
}

impl Layout {
    fn of(input: &CubeTensor) -> Self {
        let shape = input.meta.shape().clone();
        Self {
            rows: rows_of(&shape),
            width: shape[shape.num_dims() - 1],
            shape,
            elem: checked_elem(input, "layer norm"),
            client: input.client.clone(),
            device: input.device.clone(),
        }
    }

    /// A new dense buffer of `dtype` (the input's dtype when `None`), of `shape` (the
    /// input's when `None`).
    fn new_buffer(&self, shape: Option<Shape>, dtype: DType) -> Dense {
        Dense::new_empty(
            self.client.clone(),
            self.device.clone(),
            shape.unwrap_or_else(|| self.shape.clone()),
            dtype,
        )
    }
}

impl LayerNormKernels for CubeBackend {
    fn layer_norm_forward(
        input: CubeTensor,
        gamma: CubeTensor,
        beta: CubeTensor,
        epsilon: f32,
        has_beta: bool,
        centered: bool,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        let layout = Layout::of(&input);
        let (rows, width, elem, client) = (layout.rows, layout.width, layout.elem, &layout.client);
        let output = layout.new_buffer(None, input.dtype);
        let (input, gamma, beta) = (Dense::of(&input), Dense::of(&gamma), Dense::of(&beta));
        let stats = || layout.new_buffer(Some(Shape::new([rows])), DType::F32);
        let (mean, rstd) = (stats(), stats());
        let vector = norm_plane_kernel::vector_width(
            client.properties(),
            width,
            input.tensor().dtype.size(),
            &[&input, &gamma, &beta, &output],
        );
        let processors = client
            .properties()
            .hardware
            .num_streaming_multiprocessors
            .unwrap_or(0) as usize;
        let per_cube = norm_plane_kernel::rows_per_cube(rows, processors);
        if let (Some(vector), Some(per_cube)) = (vector, per_cube) {
            // SAFETY: as below; plane `p` of cube `c` reads and writes row `c * per_cube + p` only,
            // when below `rows` (mean's length), in vectors of `vector` elements that divide
            // `width` and every buffer's start (`vector_width`), so a vector lies whole in one
            // row of input and output and in gamma and beta (`width` long, checked by the
            // caller); the cube is `LANES x per_cube` units, lane `l` taking vectors `k * LANES + l`
            // for `k` below `width / (LANES * vector)`.
            unsafe {
                norm_plane_kernel::norm_forward_plane_kernel::launch_unchecked(
                    client,
                    row_grid(rows.div_ceil(per_cube)),
                    CubeDim::new_2d(norm_plane_kernel::LANES as u32, per_cube as u32),
                    input.arg(),
                    gamma.arg(),
                    beta.arg(),
                    output.arg(),
                    mean.arg(),
                    rstd.arg(),
                    epsilon,
                    width,
                    vector,
                    per_cube,
                    has_beta,
                    centered,
                    elem,
                );
            }
            return (output.into_tensor(), mean.into_tensor(), rstd.into_tensor());
        }
        let threads = threads_for(width);
        // SAFETY: the kernel is instantiated for `elem`, the dtype of the input, gamma and beta
        // (one dtype, checked by the caller) and of the output (made with it); mean and rstd
        // are f32. A cube reads and writes row `r < rows` only, at indices below `rows *
        // width` (the lengths of input and output) and, for gamma and beta, below `width`
        // (their length, checked by the caller); the written buffers are new allocations,
        // distinct from each other and from the read ones.
        unsafe {
            norm_forward_kernel::launch_unchecked(
                client,
                row_grid(rows),
                CubeDim::new_1d(threads as u32),
                input.arg(),
                gamma.arg(),
                beta.arg(),
                output.arg(),
                mean.arg(),
                rstd.arg(),
                width as u32,
                epsilon,
                threads,
                has_beta,
                centered,
                elem,
            );
        }
        (output.into_tensor(), mean.into_tensor(), rstd.into_tensor())
    }

    fn layer_norm_backward(
        grad: CubeTensor,
        input: CubeTensor,
        gamma: CubeTensor,
        mean: CubeTensor,
        rstd: CubeTensor,
        centered: bool,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        let layout = Layout::of(&input);
        let (rows, width, elem, client) = (layout.rows, layout.width, layout.elem, &layout.client);
        let dx = layout.new_buffer(None, input.dtype);
        // The parameter gradients, of the input's dtype (the kernels' `elem`; gamma's too: one
        // dtype, checked by the caller).
        let param = || layout.new_buffer(Some(Shape::new([layout.width])), input.dtype);
        let (gamma_grad, beta_grad) = (param(), param());
        let (grad, input, gamma) = (Dense::of(&grad), Dense::of(&input), Dense::of(&gamma));
        let (mean, rstd) = (Dense::of(&mean), Dense::of(&rstd));
        let (chunks, per_chunk) = grad_chunks(rows);
        let partial = || layout.new_buffer(Some(Shape::new([chunks, width])), DType::F32);
        let (dgamma, dbeta) = (partial(), partial());
        let threads = threads_for(width);
        // SAFETY: as in the forward: one dtype `elem` for grad, input, gamma, dx and the
        // parameter gradients, f32 for the statistics and the partial sums; a cube of the
        // first kernel touches row `r < rows` only (indices below `rows * width`, gamma below
        // `width`); a unit of the second touches column `c < width` of the rows of its chunk
        // `k < chunks` (at most `rows`) and row `k` of the partial sums (`chunks * width`
        // elements); a unit of the third reads column `c < width` of the partial sums' rows
        // (`chunks = len / width` of them), writes element `c` of the two `[width]` gradients,
        // and indexes its shared arrays below `SUM_COLUMNS * SUM_LANES` (the cube's units). The written buffers are new allocations, distinct from each other and
        // from the read ones; the third kernel runs after the second on the same stream.
        unsafe {
            norm_input_grad_kernel::launch_unchecked(
                client,
                row_grid(rows),
                CubeDim::new_1d(threads as u32),
                grad.arg(),
                input.arg(),
                gamma.arg(),
                mean.arg(),
                rstd.arg(),
                dx.arg(),
                width as u32,
                threads,
                centered,
                elem,
            );
            norm_param_grad_kernel::launch_unchecked(
                client,
                CubeCount::Static(width.div_ceil(MAX_THREADS).max(1) as u32, chunks as u32, 1),
                CubeDim::new_1d(MAX_THREADS as u32),
                grad.arg(),
                input.arg(),
                mean.arg(),
                rstd.arg(),
                dgamma.arg(),
                dbeta.arg(),
                width as u32,
                per_chunk as u32,
                elem,
            );
            norm_chunk_sum_kernel::launch_unchecked(
                client,
                CubeCount::Static(width.div_ceil(SUM_COLUMNS).max(1) as u32, 1, 1),
                CubeDim::new_2d(SUM_COLUMNS as u32, SUM_LANES as u32),
                dgamma.arg(),
                dbeta.arg(),
                gamma_grad.arg(),
                beta_grad.arg(),
                width as u32,
                elem,
            );
        }
        (
            dx.into_tensor(),
            gamma_grad.into_tensor(),
            beta_grad.into_tensor(),
        )
    }
}

/// The layer norm (and, without `centered`, the RMS norm) with its own backward, reached from
/// `Tensor` through burn's dispatch.
#[backend_extension(Cube, Autodiff)]
pub(crate) trait FusedNormOps: Backend {
    /// `input` normalized over its last dimension, scaled by `gamma`, shifted by `beta` where
    /// `has_beta` (otherwise `beta` is not read and gets no gradient: pass gamma). An optional
    /// tensor argument does not cross burn 0.22's generated dispatch into `Autodiff`, hence
    /// the flag (UPSTREAM.md 14). Without `centered`: the RMS norm.
    fn fused_norm(
        input: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        has_beta: bool,
        centered: bool,
        epsilon: f64,
    ) -> FloatTensor<Self>;
}

/// The forward through the fusion kernels: `(output, mean, rstd)`.
fn forward(
    input: FusedTensor,
    gamma: FusedTensor,
    beta: FusedTensor,
    has_beta: bool,
    centered: bool,
    epsilon: f64,
) -> (FusedTensor, FusedTensor, FusedTensor) {
    count_forward();
    <Cube as LayerNormKernels>::layer_norm_forward(
        input,
        gamma,
        beta,
        epsilon as f32,
        has_beta,
        centered,
    )
}

/// Without autodiff: the forward alone.
impl FusedNormOps for Cube {
    fn fused_norm(
        input: FusedTensor,
        gamma: FusedTensor,
        beta: FusedTensor,
        has_beta: bool,
        centered: bool,
        epsilon: f64,
    ) -> FusedTensor {
        forward(input, gamma, beta, has_beta, centered, epsilon).0
    }
}

/// What the backward keeps of the forward.
#[derive(Debug, Clone)]
struct Saved {
    input: FusedTensor,
    gamma: FusedTensor,
    mean: FusedTensor,
    rstd: FusedTensor,
    centered: bool,
}

/// The backward node: parents input, gamma and beta (an untracked stand-in without beta).
#[derive(Debug)]
struct LayerNormBackward;

impl Backward<Cube, 3> for LayerNormBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Saved, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_input, node_gamma, node_beta] = ops.parents;
        let grad = grads.consume::<Cube>(&ops.node);
        let Saved {
            input,
            gamma,
            mean,
            rstd,
            centered,
        } = ops.state;
        let (dx, dgamma, dbeta) = <Cube as LayerNormKernels>::layer_norm_backward(
            grad, input, gamma, mean, rstd, centered,
        );
        if let Some(node) = node_input {
            grads.register::<Cube>(node.id, dx);
        }
        if let Some(node) = node_gamma {
            grads.register::<Cube>(node.id, dgamma);
        }
        if let Some(node) = node_beta {
            grads.register::<Cube>(node.id, dbeta);
        }
    }
}

impl<C: CheckpointStrategy> FusedNormOps for Autodiff<Cube, C> {
    fn fused_norm(
        input: AutodiffTensor,
        gamma: AutodiffTensor,
        beta: AutodiffTensor,
        has_beta: bool,
        centered: bool,
        epsilon: f64,
    ) -> AutodiffTensor {
        let (input, input_node) = input.into_parts();
        let (gamma, gamma_node) = gamma.into_parts();
        let (beta, beta_node) = beta.into_parts();
        // Without beta, an untracked parent in its place: it asks for no gradient.
        let beta_node = if has_beta {
            beta_node
        } else {
            AutodiffTensor::new(gamma.clone()).node()
        };
        let prepared = LayerNormBackward
            .prepare::<C>([input_node, gamma_node, beta_node])
            .compute_bound()
            .stateful();
        let (output, mean, rstd) = forward(
            input.clone(),
            gamma.clone(),
            beta,
            has_beta,
            centered,
            epsilon,
        );
        match prepared {
            OpsKind::Tracked(prep) => prep.finish(
                Saved {
                    input,
                    gamma,
                    mean,
                    rstd,
                    centered,
                },
                output,
            ),
            OpsKind::UnTracked(prep) => prep.finish(output),
        }
    }
}

/// The fused layer norm (`centered`) or RMS norm of tensors of burn's cubecl backend (autodiff
/// or not), through burn's dispatch. The caller checked the device (a cubecl one), the dtypes
/// (one of `f32`, `f16`, `bf16` for all) and the shapes (gamma and beta `[width]`, the input's
/// last dimension `width > 0`).
/// Never `Err` here (see the stand-in, which hands the tensors back).
pub(crate) fn norm(
    (input, gamma, beta): OpInputs,
    centered: bool,
    epsilon: f64,
) -> Result<burn::backend::DispatchTensor, Box<OpInputs>> {
    let has_beta = beta.is_some();
    let beta = beta.unwrap_or_else(|| gamma.clone());
    Ok(<burn::backend::Dispatch as FusedNormOps>::fused_norm(
        input, gamma, beta, has_beta, centered, epsilon,
    ))
}
