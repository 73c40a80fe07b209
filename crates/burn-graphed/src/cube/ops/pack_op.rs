//! Three tensors of one shape side by side along their last dimension, with its own backward
//! (the gradient split back into three): how a self-attention's query, key and value
//! projections become one product (`[d_in, 3 * d_out]` weights, `[3 * d_out]` biases) while the
//! module keeps burn-nn's three `Linear`s. One kernel each way, one unit per element, values
//! copied unchanged; burn's `cat` takes a kernel per input forward and a slice per input
//! backward.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Cube, backend_extension};
use burn::tensor::Shape;
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::super::buffers::FusedTensor;
use super::super::dense::Dense;
use super::super::kernels::row_kernels::{count_forward, row_grid, row_of_cube};
use super::super::update::update_kernel::checked_elem;

/// The autodiff tensor of burn's cubecl backend.
type AutodiffTensor = FloatTensor<Autodiff<Cube>>;

/// Units of a cube; a cube takes one row of the side-by-side tensor.
const THREADS: usize = 256;

/// One row of the side-by-side tensor, by the cube's units in turn: `out[dst + j]` for `j <
/// 3 * cols` from `a`, `b` and `c` at `src + j % cols`, the part by `j / cols`.
#[cube]
fn join_row<F: Float>(
    a: &[F],
    b: &[F],
    c: &[F],
    out: &mut [F],
    src: usize,
    dst: usize,
    cols: usize,
) {
    let mut col = UNIT_POS as usize;
    while col < 3 * cols {
        let part = col / cols;
        let at = src + col % cols;
        let mut value = a[at];
        if part == 1 {
            value = b[at];
        } else if part == 2 {
            value = c[at];
        }
        out[dst + col] = value;
        col += THREADS;
    }
}

/// Row `row_of_cube()` of `out` (`[rows, 3 * cols]`) from the same row of `a`, `b` and `c`
/// (`[rows, cols]` each) side by side.
#[cube(launch_unchecked)]
fn pack_join_kernel<F: Float>(
    a: &[F],
    b: &[F],
    c: &[F],
    out: &mut [F],
    rows: u32,
    cols: u32,
    #[define(F)] _dtype: ElemType,
) {
    let row = row_of_cube();
    let cols = cols as usize;
    if row < rows as usize {
        join_row::<F>(a, b, c, out, row * cols, row * 3 * cols, cols);
    }
}

/// [`pack_join_kernel`] for weights `a`, `b`, `c` and their biases `bias_a`, `bias_b`,
/// `bias_c` (`[cols]` each) in one launch: cube `rows` (one past the weights' rows) joins the
/// biases into `out_bias` (`[3 * cols]`).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn pack_join_biased_kernel<F: Float>(
    a: &[F],
    b: &[F],
    c: &[F],
    bias_a: &[F],
    bias_b: &[F],
    bias_c: &[F],
    out: &mut [F],
    out_bias: &mut [F],
    rows: u32,
    cols: u32,
    #[define(F)] _dtype: ElemType,
) {
    let row = row_of_cube();
    let cols = cols as usize;
    let rows = rows as usize;
    if row < rows {
        join_row::<F>(a, b, c, out, row * cols, row * 3 * cols, cols);
    } else if row == rows {
        join_row::<F>(bias_a, bias_b, bias_c, out_bias, 0, 0, cols);
    }
}

/// Row `row_of_cube()` of `joined` (`[rows, 3 * cols]`) split into the same row of `a`, `b` and
/// `c` (`[rows, cols]` each).
#[cube(launch_unchecked)]
fn pack_split_kernel<F: Float>(
    joined: &[F],
    a: &mut [F],
    b: &mut [F],
    c: &mut [F],
    rows: u32,
    cols: u32,
    #[define(F)] _dtype: ElemType,
) {
    let row = row_of_cube();
    let cols = cols as usize;
    if row < rows as usize {
        let mut col = UNIT_POS as usize;
        while col < 3 * cols {
            let part = col / cols;
            let at = row * cols + col % cols;
            let value = joined[row * 3 * cols + col];
            if part == 0 {
                a[at] = value;
            } else if part == 1 {
                b[at] = value;
            } else {
                c[at] = value;
            }
            col += THREADS;
        }
    }
}

/// `(rows, cols)` of a tensor seen as `[rows, cols]`, `cols` its last dimension.
fn rows_cols(shape: &Shape) -> (usize, usize) {
    let cols = shape.iter().last().copied().unwrap_or(1);
    (shape.num_elements() / cols.max(1), cols)
}

/// `shape` with its last dimension `last`.
fn with_last(shape: &Shape, last: usize) -> Shape {
    let mut dims: Vec<usize> = shape.iter().copied().collect();
    if let Some(end) = dims.last_mut() {
        *end = last;
    }
    Shape::from(dims)
}

/// The kernels as lazy fusion operations on burn's cubecl backend.
#[backend_extension(Cube, Fusion)]
pub(crate) trait PackKernels: Backend {
    /// `a`, `b` and `c` (one shape and dtype, checked by the caller) side by side along their
    /// last dimension.
    #[fusion(meta = |a, _b, _c| {
        let mut spec = a.clone();
        spec.shape = with_last(&a.shape, 3 * rows_cols(&a.shape).1);
        spec
    })]
    fn join3(a: FloatTensor<Self>, b: FloatTensor<Self>, c: FloatTensor<Self>)
    -> FloatTensor<Self>;

    /// [`PackKernels::join3`] of weights `a`, `b`, `c` (`[.., cols]`) and of their biases
    /// `bias_a`, `bias_b`, `bias_c` (`[cols]`; one dtype for all six, checked by the caller) in
    /// one launch: `(weights, biases)`.
    #[fusion(meta = |a, _b, _c, bias_a, _bias_b, _bias_c| {
        let mut weights = a.clone();
        weights.shape = with_last(&a.shape, 3 * rows_cols(&a.shape).1);
        let mut biases = bias_a.clone();
        biases.shape = with_last(&bias_a.shape, 3 * rows_cols(&bias_a.shape).1);
        (weights, biases)
    })]
    fn join3_biased(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias_a: FloatTensor<Self>,
        bias_b: FloatTensor<Self>,
        bias_c: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `joined` split into three along its last dimension (a multiple of 3).
    #[fusion(meta = |joined| {
        let mut spec = joined.clone();
        spec.shape = with_last(&joined.shape, rows_cols(&joined.shape).1 / 3);
        (spec.clone(), spec.clone(), spec)
    })]
    fn split3(
        joined: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

impl PackKernels for CubeBackend {
    fn join3(a: CubeTensor, b: CubeTensor, c: CubeTensor) -> CubeTensor {
        let elem = checked_elem(&a, "join");
        let (rows, cols) = rows_cols(a.meta.shape());
        let shape = with_last(a.meta.shape(), 3 * cols);
        let out = Dense::new_empty(a.client.clone(), a.device.clone(), shape, a.dtype);
        let client = a.client.clone();
        let (a, b, c) = (Dense::of(&a), Dense::of(&b), Dense::of(&c));
        // SAFETY: the kernel is instantiated for `elem`, the dtype of a, b, c (one shape and
        // dtype, checked by the caller) and of out (made with it). Cube `r < rows` reads
        // elements `r * cols..(r + 1) * cols` of a, b and c (`rows * cols` each, dense) and
        // writes elements `r * 3 cols..(r + 1) * 3 cols` of out (`rows * 3 cols`, a new
        // allocation); cubes past `rows` do nothing.
        unsafe {
            pack_join_kernel::launch_unchecked(
                &client,
                row_grid(rows),
                CubeDim::new_1d(THREADS as u32),
                a.arg(),
                b.arg(),
                c.arg(),
                out.arg(),
                rows as u32,
                cols as u32,
                elem,
            );
        }
        out.into_tensor()
    }

    fn join3_biased(
        a: CubeTensor,
        b: CubeTensor,
        c: CubeTensor,
        bias_a: CubeTensor,
        bias_b: CubeTensor,
        bias_c: CubeTensor,
    ) -> (CubeTensor, CubeTensor) {
        let elem = checked_elem(&a, "join");
        let (rows, cols) = rows_cols(a.meta.shape());
        let new = |like: &CubeTensor| {
            let shape = with_last(like.meta.shape(), 3 * cols);
            Dense::new_empty(like.client.clone(), like.device.clone(), shape, like.dtype)
        };
        let (out, out_bias) = (new(&a), new(&bias_a));
        let client = a.client.clone();
        let [a, b, c, bias_a, bias_b, bias_c] =
            [&a, &b, &c, &bias_a, &bias_b, &bias_c].map(Dense::of);
        // SAFETY: the kernel is instantiated for `elem`, the dtype of the six inputs (one
        // dtype; a, b, c one shape, the biases `[cols]` each: checked by the caller) and of the
        // two outputs (made with it). Cube `r < rows` reads elements `r * cols..(r + 1) * cols`
        // of a, b and c (`rows * cols` each, dense) and writes elements `r * 3 cols..(r + 1) *
        // 3 cols` of out; cube `rows` reads elements `0..cols` of the biases and writes
        // `0..3 cols` of out_bias; both outputs are new allocations. Cubes past `rows` do
        // nothing.
        unsafe {
            pack_join_biased_kernel::launch_unchecked(
                &client,
                row_grid(rows + 1),
                CubeDim::new_1d(THREADS as u32),
                a.arg(),
                b.arg(),
                c.arg(),
                bias_a.arg(),
                bias_b.arg(),
                bias_c.arg(),
                out.arg(),
                out_bias.arg(),
                rows as u32,
                cols as u32,
                elem,
            );
        }
        (out.into_tensor(), out_bias.into_tensor())
    }

    fn split3(joined: CubeTensor) -> (CubeTensor, CubeTensor, CubeTensor) {
        let elem = checked_elem(&joined, "split");
        let (rows, joined_cols) = rows_cols(joined.meta.shape());
        let cols = joined_cols / 3;
        let shape = with_last(joined.meta.shape(), cols);
        let new = || {
            Dense::new_empty(
                joined.client.clone(),
                joined.device.clone(),
                shape.clone(),
                joined.dtype,
            )
        };
        let (a, b, c) = (new(), new(), new());
        let client = joined.client.clone();
        let joined = Dense::of(&joined);
        // SAFETY: the kernel is instantiated for `elem`, the dtype of joined and of a, b, c
        // (made with it). Cube `r < rows` reads elements `r * 3 cols..(r + 1) * 3 cols` of
        // joined (`rows * 3 cols`, dense) and writes elements `r * cols..(r + 1) * cols` of a,
        // b and c (`rows * cols` each, three new allocations); cubes past `rows` do nothing.
        unsafe {
            pack_split_kernel::launch_unchecked(
                &client,
                row_grid(rows),
                CubeDim::new_1d(THREADS as u32),
                joined.arg(),
                a.arg(),
                b.arg(),
                c.arg(),
                rows as u32,
                cols as u32,
                elem,
            );
        }
        (a.into_tensor(), b.into_tensor(), c.into_tensor())
    }
}

/// The join with its own backward, reached from `Tensor` through burn's dispatch.
#[backend_extension(Cube, Autodiff)]
pub(crate) trait FusedPackOps: Backend {
    /// `a`, `b` and `c` side by side along their last dimension; the backward splits the
    /// gradient back.
    fn fused_join3(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        c: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// [`FusedPackOps::fused_join3`] of weights and of their biases (`[cols]` each) in one
    /// launch: `(weights, biases)`; the backward splits each gradient back.
    fn fused_join3_biased(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias_a: FloatTensor<Self>,
        bias_b: FloatTensor<Self>,
        bias_c: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

impl FusedPackOps for Cube {
    fn fused_join3(a: FusedTensor, b: FusedTensor, c: FusedTensor) -> FusedTensor {
        count_forward();
        <Cube as PackKernels>::join3(a, b, c)
    }

    fn fused_join3_biased(
        a: FusedTensor,
        b: FusedTensor,
        c: FusedTensor,
        bias_a: FusedTensor,
        bias_b: FusedTensor,
        bias_c: FusedTensor,
    ) -> (FusedTensor, FusedTensor) {
        count_forward();
        <Cube as PackKernels>::join3_biased(a, b, c, bias_a, bias_b, bias_c)
    }
}

/// The backward node: parents a, b and c; it keeps nothing of the forward.
#[derive(Debug)]
struct JoinBackward;

impl Backward<Cube, 3> for JoinBackward {
    type State = ();

    fn backward(self, ops: Ops<(), 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let dout = grads.consume::<Cube>(&ops.node);
        let (da, db, dc) = <Cube as PackKernels>::split3(dout);
        for (node, grad) in ops.parents.into_iter().zip([da, db, dc]) {
            if let Some(node) = node {
                grads.register::<Cube>(node.id, grad);
            }
        }
    }
}

impl<C: CheckpointStrategy> FusedPackOps for Autodiff<Cube, C> {
    fn fused_join3(a: AutodiffTensor, b: AutodiffTensor, c: AutodiffTensor) -> AutodiffTensor {
        let (a, a_node) = a.into_parts();
        let (b, b_node) = b.into_parts();
        let (c, c_node) = c.into_parts();
        let prepared = JoinBackward
            .prepare::<C>([a_node, b_node, c_node])
            .compute_bound();
        count_forward();
        prepared.stateless(<Cube as PackKernels>::join3(a, b, c))
    }

    /// Two nodes, the weights' and the biases', each split back by its own backward; one
    /// launch forward.
    fn fused_join3_biased(
        a: AutodiffTensor,
        b: AutodiffTensor,
        c: AutodiffTensor,
        bias_a: AutodiffTensor,
        bias_b: AutodiffTensor,
        bias_c: AutodiffTensor,
    ) -> (AutodiffTensor, AutodiffTensor) {
        let [(a, a_node), (b, b_node), (c, c_node)] = [a, b, c].map(|t| t.into_parts());
        let [
            (bias_a, bias_a_node),
            (bias_b, bias_b_node),
            (bias_c, bias_c_node),
        ] = [bias_a, bias_b, bias_c].map(|t| t.into_parts());
        let weights = JoinBackward
            .prepare::<C>([a_node, b_node, c_node])
            .compute_bound();
        let biases = JoinBackward
            .prepare::<C>([bias_a_node, bias_b_node, bias_c_node])
            .compute_bound();
        count_forward();
        let (joined, joined_bias) =
            <Cube as PackKernels>::join3_biased(a, b, c, bias_a, bias_b, bias_c);
        (weights.stateless(joined), biases.stateless(joined_bias))
    }
}

/// `a`, `b` and `c` (one shape, one of `f32`, `f16`, `bf16`, burn's cubecl backend, autodiff
/// or not: checked by the caller) side by side along their last dimension, through burn's
/// dispatch; the backward splits the gradient back. Never `Err` here (see the stand-in).
pub(crate) fn join3(
    (a, b, c): super::super::values::JoinInputs,
) -> Result<burn::backend::DispatchTensor, Box<super::super::values::JoinInputs>> {
    Ok(<burn::backend::Dispatch as FusedPackOps>::fused_join3(
        a, b, c,
    ))
}

/// [`join3`] of weights and of their biases in one launch: `(weights, biases)`. Never `Err`
/// here (see the stand-in).
pub(crate) fn join3_biased(
    ((a, b, c), (bias_a, bias_b, bias_c)): super::super::values::JoinBiasedInputs,
) -> Result<
    (burn::backend::DispatchTensor, burn::backend::DispatchTensor),
    Box<super::super::values::JoinBiasedInputs>,
> {
    Ok(
        <burn::backend::Dispatch as FusedPackOps>::fused_join3_biased(
            a, b, c, bias_a, bias_b, bias_c,
        ),
    )
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::super::super::dense::test_support::*;
    use super::*;
    use burn::tensor::DType;

    fn tensor<const D: usize>(values: &[f32], shape: [usize; D]) -> CubeTensor {
        let words: Vec<[u8; 4]> = values.iter().map(|v| v.to_le_bytes()).collect();
        padded(&words, shape, DType::F32)
    }

    fn read(tensor: &CubeTensor) -> Vec<f32> {
        let n = tensor.meta.shape().num_elements();
        buffer(tensor)[..n].to_vec()
    }

    /// Three `[3, 5]` tensors side by side are the host's rows joined, and split back into
    /// themselves; a 1-D join (a bias) too.
    #[test]
    fn join_and_split_round_trip() {
        let parts: Vec<Vec<f32>> = (0..3)
            .map(|p| (0..15).map(|i| (p * 100 + i) as f32).collect())
            .collect();
        let [a, b, c] = [0, 1, 2].map(|p| tensor(&parts[p], [3, 5]));
        let joined = <CubeBackend as PackKernels>::join3(a, b, c);
        assert_eq!(joined.meta.shape().dims::<2>(), [3, 15]);
        let expected: Vec<f32> = (0..3)
            .flat_map(|r| (0..3).flat_map(move |p| (0..5).map(move |col| (r, p, col))))
            .map(|(r, p, col)| parts[p][r * 5 + col])
            .collect();
        assert_eq!(read(&joined), expected, "the joined rows");
        let (a, b, c) = <CubeBackend as PackKernels>::split3(joined);
        for (p, part) in [a, b, c].iter().enumerate() {
            assert_eq!(part.meta.shape().dims::<2>(), [3, 5]);
            assert_eq!(read(part), parts[p], "part {p} split back");
        }
        let [a, b, c] = [0, 1, 2].map(|p| tensor(&parts[p][..4], [4]));
        let joined = <CubeBackend as PackKernels>::join3(a, b, c);
        let expected: Vec<f32> = parts.iter().flat_map(|p| p[..4].to_vec()).collect();
        assert_eq!(read(&joined), expected, "the joined biases");
    }

    /// Weights and biases joined in one launch are what two joins give.
    #[test]
    fn joined_weights_and_biases_in_one_launch() {
        let parts: Vec<Vec<f32>> = (0..6)
            .map(|p| (0..15).map(|i| (p * 100 + i) as f32).collect())
            .collect();
        let weights = || [0, 1, 2].map(|p| tensor(&parts[p], [3, 5]));
        let biases = || [3, 4, 5].map(|p| tensor(&parts[p][..5], [5]));
        let ([a, b, c], [bias_a, bias_b, bias_c]) = (weights(), biases());
        let (joined, joined_bias) =
            <CubeBackend as PackKernels>::join3_biased(a, b, c, bias_a, bias_b, bias_c);
        assert_eq!(joined.meta.shape().dims::<2>(), [3, 15]);
        assert_eq!(joined_bias.meta.shape().dims::<1>(), [15]);
        let ([a, b, c], [bias_a, bias_b, bias_c]) = (weights(), biases());
        let apart = <CubeBackend as PackKernels>::join3(a, b, c);
        let apart_bias = <CubeBackend as PackKernels>::join3(bias_a, bias_b, bias_c);
        assert_eq!(read(&joined), read(&apart), "the joined weights");
        assert_eq!(read(&joined_bias), read(&apart_bias), "the joined biases");
        let expected: Vec<f32> = parts[3..].iter().flat_map(|p| p[..5].to_vec()).collect();
        assert_eq!(read(&joined_bias), expected, "the biases in order");
    }
}
