//! An embedding lookup with its own backward: what [`crate::nn::embedding`] runs on burn's
//! cubecl backends, where burn-cubecl's backward (`select_assign`) gives one unit to each
//! embedding dimension and walks every token in turn (docs/decisions.md, "Embeddings").
//!
//! The forward is a gather, one unit per token and dimension. The table's gradient: row
//! `v` is the sum of the output gradient's rows of the tokens whose id is `v`, 0 where no token
//! has it. One cube per token and block of [`THREADS`] dimensions: the cube of a token's first
//! occurrence owns the row and sums the rows of every token with that id, in token order, in
//! `f32`, rounded once to the dtype; a later occurrence's cube finds an earlier one and leaves.
//! A second pass sets the rows no token names to 0 (it runs first: a fill). No atomics: a replay
//! computes the eager call's values bit for bit; burn's backward sums in the same order but
//! rounds to the dtype after every addition.
//!
//! Cost: each token's cube reads the ids before it to find whether it is its id's first
//! occurrence (`tokens / THREADS` reads per unit); an owner then compares each later token's id
//! once (one unit per token) and lists the matches with a prefix sum over the cube: about
//! `distinct * tokens` comparisons in all, spread over the units, plus one read of each token's
//! gradient row. An id outside `0..rows` looks up a row of zeros and adds to no row (the ids are
//! not checked on the host: a graph cannot read them back).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Backend, Cube, backend_extension};
use burn::tensor::Shape;
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::super::buffers::FusedTensor;
use super::super::dense::Dense;
use super::super::kernels::row_kernels::{count_forward, row_grid, row_grid_by, row_of_cube};
use super::super::update::update_kernel::checked_elem;

/// The autodiff tensor of burn's cubecl backend.
type AutodiffTensor = FloatTensor<Autodiff<Cube>>;
/// An int tensor of burn's cubecl backend.
type FusedInt = IntTensor<Cube>;

/// The table of a fused embedding, as its backward needs it: shape and dtype, not its values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TableSpec {
    /// Rows of the table.
    pub(crate) rows: usize,
    /// Columns of the table.
    pub(crate) dim: usize,
    /// The table's dtype.
    pub(crate) dtype: burn::tensor::DType,
}

/// Units of a cube: dimensions a cube sums, and ids it compares per step.
const THREADS: usize = 256;

/// Sets every element of `out` to 0.
#[cube(launch_unchecked)]
fn embedding_zero_kernel<F: Float>(out: &mut [F], #[define(F)] _dtype: ElemType) {
    let i = row_of_cube() * THREADS + UNIT_POS as usize;
    if i < out.len() {
        out[i] = F::cast_from(0.0f32);
    }
}

/// The lookup: row `row_of_cube()` of `out` (`[tokens, dim]`), dimensions `CUBE_POS_Z *
/// THREADS..`, is row `ids[token]` of `table` (`[rows, dim]`); 0 for an id outside `0..rows`.
#[cube(launch_unchecked)]
fn embedding_gather_kernel<F: Float>(
    table: &[F],
    ids: &[i32],
    out: &mut [F],
    rows: u32,
    dim: u32,
    #[define(F)] _dtype: ElemType,
) {
    let token = row_of_cube();
    let dim = dim as usize;
    let d = CUBE_POS_Z as usize * THREADS + UNIT_POS as usize;
    if token < ids.len() && d < dim {
        let id = ids[token];
        let mut value = F::cast_from(0.0f32);
        if id >= 0i32 && (id as usize) < rows as usize {
            value = table[(id as usize) * dim + d];
        }
        out[token * dim + d] = value;
    }
}

/// The table's gradient rows: the cube of token `row_of_cube()` and dimensions
/// `CUBE_POS_Z * THREADS..`: where the token is its id's first occurrence, row `ids[token]` of
/// `out` (`[rows, dim]`) gets the sum of `grad`'s rows (`[tokens, dim]`) of every token with
/// that id, in token order.
///
/// The owner walks the tokens from its own on in blocks of [`THREADS`]: each unit compares one
/// token's id, a prefix sum over the cube lists the block's matching tokens in order, and every
/// unit adds those tokens' rows at its dimension. So a cube's work grows with the tokens over
/// [`THREADS`] plus its id's occurrences, not with the tokens on every unit.
#[cube(launch_unchecked)]
fn embedding_grad_kernel<F: Float>(
    grad: &[F],
    ids: &[i32],
    out: &mut [F],
    rows: u32,
    dim: u32,
    #[define(F)] _dtype: ElemType,
) {
    let token = row_of_cube();
    let tokens = ids.len();
    let dim = dim as usize;
    let unit = UNIT_POS as usize;
    let d = CUBE_POS_Z as usize * THREADS + unit;
    let mut scan = Shared::<[u32]>::new_slice(THREADS);
    let mut list = Shared::<[u32]>::new_slice(THREADS);
    let mut earlier = Shared::<[u32]>::new_slice(1usize);
    // Uniform over the cube (one token per cube): every unit meets the barriers or none does.
    if token < tokens {
        let id = ids[token];
        if id >= 0i32 && (id as usize) < rows as usize {
            if unit == 0 {
                earlier[0] = 0u32;
            }
            sync_cube();
            let mut s = unit;
            while s < token {
                if ids[s] == id {
                    // Every unit that writes, writes 1.
                    earlier[0] = 1u32;
                }
                s += THREADS;
            }
            sync_cube();
            if earlier[0] == 0u32 {
                let mut sum = 0.0f32;
                let mut base = token;
                while base < tokens {
                    let at = base + unit;
                    let mut hit = 0u32;
                    // Nested, not `&&`: a kernel evaluates both sides, and no id past the last
                    // token may be read.
                    #[allow(clippy::collapsible_if)]
                    if at < tokens {
                        if ids[at] == id {
                            hit = 1u32;
                        }
                    }
                    // The previous block's list and count are read by every unit.
                    sync_cube();
                    scan[unit] = hit;
                    sync_cube();
                    // Inclusive prefix sum of the hits (Hillis-Steele).
                    let mut offset = 1usize;
                    while offset < THREADS {
                        let mut value = scan[unit];
                        if unit >= offset {
                            value += scan[unit - offset];
                        }
                        sync_cube();
                        scan[unit] = value;
                        sync_cube();
                        offset *= 2;
                    }
                    if hit == 1u32 {
                        list[(scan[unit] - 1u32) as usize] = at as u32;
                    }
                    let count = scan[THREADS - 1] as usize;
                    sync_cube();
                    if d < dim {
                        for k in 0..count {
                            sum += f32::cast_from(grad[list[k] as usize * dim + d]);
                        }
                    }
                    base += THREADS;
                }
                if d < dim {
                    out[(id as usize) * dim + d] = F::cast_from(sum);
                }
            }
        }
    }
}

/// The kernels as lazy fusion operations on burn's cubecl backend.
#[backend_extension(Cube, Fusion)]
pub(crate) trait EmbeddingKernels: Backend {
    /// Rows `ids` (`[tokens]`, `i32`) of `table` (`[rows, dim]`): `[tokens, dim]` in the
    /// table's dtype; a row of zeros for an id outside `0..rows`.
    #[fusion(meta = |table, ids| {
        burn::backend::fusion::custom::TensorSpec::new(
            Shape::new([ids.shape.num_elements(), table.shape[1]]),
            table.dtype,
        )
    })]
    fn embedding_forward(table: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self>;

    /// The table's gradient, of `table`'s shape and dtype, from the output's gradient `grad`
    /// (`[tokens, dim]`, the table's dtype) and the tokens' `ids` (`[tokens]`, `i32`).
    #[fusion(meta = |_grad, _ids, table| {
        burn::backend::fusion::custom::TensorSpec::new(
            Shape::new([table.rows, table.dim]),
            table.dtype,
        )
    })]
    fn embedding_grad(
        grad: FloatTensor<Self>,
        ids: IntTensor<Self>,
        table: TableSpec,
    ) -> FloatTensor<Self>;
}

impl EmbeddingKernels for CubeBackend {
    fn embedding_forward(table: CubeTensor, ids: CubeTensor) -> CubeTensor {
        let [rows, dim] = table.meta.shape().dims::<2>();
        let tokens = ids.meta.shape().num_elements();
        let elem = checked_elem(&table, "embedding");
        let client = table.client.clone();
        let out = Dense::new_empty(
            client.clone(),
            table.device.clone(),
            Shape::new([tokens, dim]),
            table.dtype,
        );
        let (table, ids) = (Dense::of(&table), Dense::of(&ids));
        // SAFETY: `elem` is the dtype of the table (checked by the caller) and of `out` (made
        // with it); the ids are i32 (cast by the caller). A unit reads id `token < tokens` (the
        // slice's length) and table element `(id, d)` only for `id < rows`, `d < dim`, and
        // writes `out` element `(token, d)` inside `[tokens, dim]`, a new allocation distinct
        // from the read buffers.
        unsafe {
            embedding_gather_kernel::launch_unchecked(
                &client,
                row_grid_by(tokens, dim.div_ceil(THREADS)),
                CubeDim::new_1d(THREADS as u32),
                table.arg(),
                ids.arg(),
                out.arg(),
                rows as u32,
                dim as u32,
                elem,
            );
        }
        out.into_tensor()
    }

    fn embedding_grad(grad: CubeTensor, ids: CubeTensor, table: TableSpec) -> CubeTensor {
        let TableSpec { rows, dim, dtype } = table;
        let tokens = ids.meta.shape().num_elements();
        let elem = checked_elem(&grad, "embedding");
        let (client, device) = (grad.client.clone(), grad.device.clone());
        let (grad, ids) = (Dense::of(&grad), Dense::of(&ids));
        let out = Dense::new_empty(client.clone(), device, Shape::new([rows, dim]), dtype);
        // SAFETY: `elem` is the dtype of the table, `grad` (checked by the caller) and `out`
        // (made like the table); the ids are i32 (cast by the caller). The zero kernel writes
        // element `i < out.len()` only. A cube of the second reads id elements below `tokens`
        // (the slice's length) and `grad` elements `(t, d)` with `t < tokens`, `d < dim`
        // (`grad` is `[tokens, dim]`, checked by the caller), and writes `out` row
        // `id < rows` at `d < dim`: inside `[rows, dim]`. Each row is written by one cube per
        // dimension block (the first occurrence's), after the zero kernel on the same stream.
        // `out` is a new allocation, distinct from the read buffers.
        unsafe {
            embedding_zero_kernel::launch_unchecked(
                &client,
                row_grid((rows * dim).div_ceil(THREADS)),
                CubeDim::new_1d(THREADS as u32),
                out.arg(),
                elem,
            );
            embedding_grad_kernel::launch_unchecked(
                &client,
                row_grid_by(tokens, dim.div_ceil(THREADS)),
                CubeDim::new_1d(THREADS as u32),
                grad.arg(),
                ids.arg(),
                out.arg(),
                rows as u32,
                dim as u32,
                elem,
            );
        }
        out.into_tensor()
    }
}

/// The embedding with its own backward, reached from `Tensor` through burn's dispatch.
#[backend_extension(Cube, Autodiff)]
pub(crate) trait FusedEmbeddingOps: Backend {
    /// Rows `ids` (`[tokens]`, `i32`) of `table` (`[rows, dim]`): `[tokens, dim]`.
    fn fused_embedding(table: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self>;
}

/// The forward: the gather of the rows.
fn gather(table: FusedTensor, ids: FusedInt) -> FusedTensor {
    <Cube as EmbeddingKernels>::embedding_forward(table, ids)
}

impl FusedEmbeddingOps for Cube {
    fn fused_embedding(table: FusedTensor, ids: FusedInt) -> FusedTensor {
        count_forward();
        gather(table, ids)
    }
}

/// What the backward keeps of the forward.
#[derive(Debug, Clone)]
struct Saved {
    table: TableSpec,
    ids: FusedInt,
}

/// The backward node: one parent, the table.
#[derive(Debug)]
struct EmbeddingBackward;

impl Backward<Cube, 1> for EmbeddingBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Saved, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_table] = ops.parents;
        let grad = grads.consume::<Cube>(&ops.node);
        let Saved { table, ids } = ops.state;
        if let Some(node) = node_table {
            let dtable = <Cube as EmbeddingKernels>::embedding_grad(grad, ids, table);
            grads.register::<Cube>(node.id, dtable);
        }
    }
}

impl<C: CheckpointStrategy> FusedEmbeddingOps for Autodiff<Cube, C> {
    fn fused_embedding(table: AutodiffTensor, ids: FusedInt) -> AutodiffTensor {
        let (table, node) = table.into_parts();
        let prepared = EmbeddingBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful();
        count_forward();
        let [rows, dim] = table.shape.dims::<2>();
        let spec = TableSpec {
            rows,
            dim,
            dtype: table.dtype,
        };
        let output = gather(table, ids.clone());
        match prepared {
            OpsKind::Tracked(prep) => prep.finish(Saved { table: spec, ids }, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        }
    }
}

/// Rows `ids` (`[tokens]`, i32) of `table` (`[rows, dim]`, f32, f16 or bf16, burn's cubecl
/// backend, autodiff or not), through burn's dispatch: `[tokens, dim]`. The caller checked the
/// dtypes and shapes. Never `Err` here (see the stand-in, which hands the tensors back).
pub(crate) fn embedding_rows(
    table: burn::backend::DispatchTensor,
    ids: burn::backend::DispatchTensor,
) -> Result<burn::backend::DispatchTensor, Box<super::super::values::EmbeddingInputs>> {
    Ok(<burn::backend::Dispatch as FusedEmbeddingOps>::fused_embedding(table, ids))
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::super::super::dense::test_support::*;
    use super::*;
    use burn::tensor::DType;

    /// The ids and the output gradient as CUDA lays out one padded row (a graphed call's ids on
    /// CUDA: their buffer runs past the last token): the spare ids name row 0 and the spare
    /// gradient values are 100, so a kernel counting tokens by the buffer's length would add
    /// 100s into row 0. The table's gradient holds exactly the tokens' sums.
    #[test]
    fn grad_reads_only_the_tokens() {
        let ids: Vec<[u8; 4]> = [2i32, 0, 2]
            .into_iter()
            .chain(std::iter::repeat_n(0, 13))
            .map(i32::to_le_bytes)
            .collect();
        let grad: Vec<[u8; 4]> = [1.0f32, 2.0, 4.0, 8.0, 16.0, 32.0]
            .into_iter()
            .chain(std::iter::repeat_n(100.0, 10))
            .map(f32::to_le_bytes)
            .collect();
        let table = TableSpec {
            rows: 4,
            dim: 2,
            dtype: DType::F32,
        };
        let out = <CubeBackend as EmbeddingKernels>::embedding_grad(
            padded(&grad, [3, 2], DType::F32),
            padded(&ids, [3], DType::I32),
            table,
        );
        // Row 0: token 1; row 2: tokens 0 and 2; rows 1 and 3: no token.
        assert_eq!(
            buffer(&out),
            [4.0, 8.0, 0.0, 0.0, 17.0, 34.0, 0.0, 0.0],
            "the table's gradient"
        );
    }
}
