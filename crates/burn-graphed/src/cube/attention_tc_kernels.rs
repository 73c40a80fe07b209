//! The attention kernels on tensor cores (`#[cube]`, `cmma`): the forward, dQ and dK/dV kernels
//! of `attention_kernels.rs` with every product as 16x16x16 tiles, for `f16` and `bf16` on a
//! device whose planes are [`LANES`] units and that multiplies such tiles of the dtype into
//! `f32` (CUDA). Launched by `attention_op.rs`, which states the arithmetic; the cases these
//! kernels do not take (`f32`, a head dimension not a multiple of 16) run the others.
//!
//! Work split: a cube of [`PLANES`] planes; a plane takes 16 query rows (forward, dQ) or 16 keys
//! (dK and dV). Operands are staged in shared memory in the dtype; a plane's products land in
//! its own `f32` tiles in shared memory, where the two units of a row take the row's softmax or
//! gradient arithmetic in `f32`, half of the columns each, and combine through a plane shuffle.
//! Rounding: the probabilities and the scores' gradients are rounded to the dtype before they
//! multiply (FlashAttention's choice; burn's composition rounds them too); every sum is `f32`.

// Kernels take queries, keys, values, a mask, their shapes and compile-time choices: more
// arguments than clippy's default. Inside `#[cube]` functions a compile-time condition stays its
// own `if`, and division rounds up by hand (`div_ceil` is not a kernel operation).
#![allow(
    clippy::too_many_arguments,
    clippy::collapsible_if,
    clippy::manual_div_ceil
)]

use cubecl::cmma::{self, MatrixIdent, MatrixLayout};
use cubecl::prelude::*;

use super::attention_kernels::{MaskStrides, hidden, probability, score_gradient};

/// Units of a plane; the kernels need exactly this many (two per row of a 16-row tile).
pub(super) const LANES: usize = 32;
/// Planes of a cube.
pub(super) const PLANES: usize = 2;
/// The edge of a tensor-core tile.
const TILE: usize = 16;
/// Query rows of a forward or dQ cube, keys of a dK/dV cube.
pub(super) const BLOCK: usize = PLANES * TILE;
/// Units of a cube.
const UNITS: usize = PLANES * LANES;
/// The largest head dimension taken.
const MAX_DIM: usize = 64;
/// The most shared memory a cube asks for (bytes), below CUDA's static limit of 48 KiB.
const MAX_SHARED: usize = 40 * 1024;
/// Alignment of shared arrays (bytes): a tile's load and store need 32.
const ALIGN: usize = 32;

/// The block sizes of the three kernels for a head dimension: keys streamed per step of the
/// forward and of the dQ kernel, query rows per step of the dK/dV kernel. Powers of two from
/// [`TILE`] to 64, the largest whose shared arrays fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct TensorBlocks {
    /// Keys per step of the forward.
    pub(super) forward_keys: usize,
    /// Keys per step of the dQ kernel.
    pub(super) grad_keys: usize,
    /// Query rows per step of the dK/dV kernel.
    pub(super) rows: usize,
}

impl TensorBlocks {
    /// The blocks for head dimension `dim` within `shared` bytes per cube, or `None` where `dim`
    /// is not a multiple of [`TILE`] up to [`MAX_DIM`] or the smallest blocks do not fit.
    pub(super) fn for_dim(dim: usize, shared: usize) -> Option<Self> {
        if dim == 0 || dim % TILE != 0 || dim > MAX_DIM {
            return None;
        }
        let budget = shared.min(MAX_SHARED);
        // Bytes: operands in the 2-byte dtype, products and accumulators in f32.
        let forward = |keys: usize| {
            2 * (BLOCK * dim + 2 * keys * dim) + BLOCK * keys * (4 + 2) + BLOCK * dim * 4
        };
        let query = |keys: usize| {
            2 * (2 * BLOCK * dim + 2 * keys * dim) + BLOCK * keys * (4 + 4 + 2) + BLOCK * dim * 4
        };
        let key = |rows: usize| {
            2 * (2 * BLOCK * dim + 2 * rows * dim)
                + 8 * rows
                + BLOCK * rows * (4 + 4 + 2 + 2)
                + BLOCK * dim * 8
        };
        let fit =
            |size: &dyn Fn(usize) -> usize| [64, 32, TILE].into_iter().find(|&n| size(n) <= budget);
        Some(Self {
            forward_keys: fit(&forward)?,
            grad_keys: fit(&query)?,
            rows: fit(&key)?,
        })
    }
}

/// Stages `count` rows of `source` (`[batch, len, heads, dim]`, rows `first..` of batch `b`,
/// head `h`; rows past `len` as 0) in `target`, densely, in the dtype.
#[cube]
fn stage_rows<F: Float>(
    source: &[F],
    target: &mut Shared<[F]>,
    b: usize,
    h: usize,
    first: usize,
    len: usize,
    heads: usize,
    #[comptime] count: usize,
    #[comptime] dim: usize,
) {
    let mut idx = UNIT_POS as usize;
    while idx < count * dim {
        let row = idx / dim;
        let d = idx % dim;
        let at = first + row;
        let mut value = F::cast_from(0.0f32);
        if at < len {
            value = source[((b * len + at) * heads + h) * dim + d];
        }
        target[idx] = value;
        idx += UNITS;
    }
}

/// One 16x16 `f32` tile of a plane's product `A B` into `out` at `out_at` (rows `out_stride`
/// apart), added to what it holds with `accumulate`: `steps` tiles of `A` (row-major, rows
/// `a_stride` apart, the `s`th at `a_at + s * a_step`) times those of `B` (`b_layout`, the
/// `s`th at `b_at + s * b_step`). Every unit of the plane calls it.
#[cube]
fn product_tile<F: Float>(
    a: &Shared<[F]>,
    a_at: usize,
    a_stride: usize,
    a_step: usize,
    b: &Shared<[F]>,
    b_at: usize,
    b_stride: usize,
    b_step: usize,
    out: &mut Shared<[f32]>,
    out_at: usize,
    out_stride: usize,
    #[comptime] steps: usize,
    #[comptime] b_layout: MatrixLayout,
    #[comptime] accumulate: bool,
) {
    let mut acc = cmma::Matrix::<f32>::from_value(
        MatrixIdent::Accumulator,
        TILE,
        TILE,
        TILE,
        MatrixLayout::Undefined,
        0.0f32,
    );
    if accumulate {
        cmma::load_with_layout(
            &mut acc,
            &out.slice(out_at, out.len()),
            out_stride as u32,
            MatrixLayout::RowMajor,
        );
    }
    #[unroll]
    for s in 0..steps {
        let a_tile = cmma::Matrix::<F>::from_slice(
            MatrixIdent::A,
            TILE,
            TILE,
            TILE,
            MatrixLayout::RowMajor,
            &a.slice(a_at + s * a_step, a.len()),
            a_stride as u32,
        );
        let b_tile = cmma::Matrix::<F>::from_slice(
            MatrixIdent::B,
            TILE,
            TILE,
            TILE,
            b_layout,
            &b.slice(b_at + s * b_step, b.len()),
            b_stride as u32,
        );
        cmma::execute::<F, F, f32, f32, cmma::Plane>(&a_tile, &b_tile, &acc, &acc);
    }
    cmma::store(
        &mut out.slice_mut(out_at, out.len()),
        &acc,
        out_stride as u32,
        MatrixLayout::RowMajor,
    );
}

/// Key blocks of `keys` a query block `first..first + BLOCK` reads: every block of `k_len`
/// keys, or with `causal` those up to its last row.
#[cube]
fn key_blocks(
    first: usize,
    k_len: usize,
    #[comptime] keys: usize,
    #[comptime] causal: bool,
) -> usize {
    let mut last = k_len;
    if causal {
        if first + BLOCK < k_len {
            last = first + BLOCK;
        }
    }
    (last + keys - 1) / keys
}

/// Forward: rows `CUBE_POS_X * BLOCK..` of batch `CUBE_POS_Z`, head `CUBE_POS_Y`: `out` and
/// `lse`, as `attention_kernels::forward_kernel`.
#[cube(launch_unchecked)]
pub(super) fn forward_tc_kernel<F: Float>(
    q: &[F],
    k: &[F],
    v: &[F],
    mask: &[i32],
    out: &mut [F],
    lse: &mut [f32],
    q_len: u32,
    k_len: u32,
    heads: u32,
    strides: MaskStrides,
    scale: f32,
    fill: f32,
    #[comptime] dim: usize,
    #[comptime] keys: usize,
    #[comptime] masked: bool,
    #[comptime] causal: bool,
    #[comptime] quiet: bool,
    #[define(F)] _dtype: ElemType,
) {
    let q_len = q_len as usize;
    let k_len = k_len as usize;
    let heads = heads as usize;
    let h = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let first = CUBE_POS_X as usize * BLOCK;
    let plane = UNIT_POS_Y as usize;
    let lane = UNIT_POS_X as usize;
    let r = plane * TILE + lane / 2;
    let half = lane % 2;
    let i = first + r;
    let mut qs = Shared::<[F]>::new_aligned_slice(comptime!(BLOCK * dim), ALIGN);
    let mut ks = Shared::<[F]>::new_aligned_slice(comptime!(keys * dim), ALIGN);
    let mut vs = Shared::<[F]>::new_aligned_slice(comptime!(keys * dim), ALIGN);
    let mut ss = Shared::<[f32]>::new_aligned_slice(comptime!(BLOCK * keys), ALIGN);
    let mut ps = Shared::<[F]>::new_aligned_slice(comptime!(BLOCK * keys), ALIGN);
    let mut os = Shared::<[f32]>::new_aligned_slice(comptime!(BLOCK * dim), ALIGN);
    stage_rows::<F>(q, &mut qs, b, h, first, q_len, heads, BLOCK, dim);
    // The unit's half of its row of the output and of the scores.
    let o_at = r * dim + half * comptime!(dim / 2);
    let s_at = r * keys + half * comptime!(keys / 2);
    for d in 0..comptime!(dim / 2) {
        os[o_at + d] = 0.0f32;
    }
    // The quiet softmax's virtual score 0: running maximum 0, running sum exp(0 - 0).
    let mut row_max = f32::min_value();
    let mut row_sum = 0.0f32;
    if quiet {
        row_max = 0.0f32;
        row_sum = 1.0f32;
    }
    let blocks = key_blocks(first, k_len, keys, causal);
    for block in 0..blocks {
        let base = block * keys;
        sync_cube();
        stage_rows::<F>(k, &mut ks, b, h, base, k_len, heads, keys, dim);
        stage_rows::<F>(v, &mut vs, b, h, base, k_len, heads, keys, dim);
        sync_cube();
        // The plane's scores: its 16 rows of q times the block's keys.
        #[unroll]
        for n in 0..comptime!(keys / TILE) {
            product_tile::<F>(
                &qs,
                plane * TILE * dim,
                dim,
                TILE,
                &ks,
                n * TILE * dim,
                dim,
                TILE,
                &mut ss,
                plane * TILE * keys + n * TILE,
                keys,
                comptime!(dim / TILE),
                MatrixLayout::ColMajor,
                false,
            );
        }
        sync_plane();
        let mut high = f32::min_value();
        for c in 0..comptime!(keys / 2) {
            let kj = base + half * comptime!(keys / 2) + c;
            let valid = i < q_len && kj < k_len;
            let mut s = ss[s_at + c] * scale;
            if valid && hidden(mask, &strides, b, h, i, kj, valid, masked, causal) {
                s = fill;
            }
            if kj < k_len {
                high = f32::max(high, s);
            }
            ss[s_at + c] = s;
        }
        let new_max = f32::max(row_max, f32::max(high, plane_shuffle_xor(high, 1)));
        let mut part = 0.0f32;
        for c in 0..comptime!(keys / 2) {
            let mut p = 0.0f32;
            if base + half * comptime!(keys / 2) + c < k_len {
                p = (ss[s_at + c] - new_max).exp();
            }
            ps[s_at + c] = F::cast_from(p);
            part += p;
        }
        let block_sum = part + plane_shuffle_xor(part, 1);
        let alpha = (row_max - new_max).exp();
        row_sum = row_sum * alpha + block_sum;
        row_max = new_max;
        for d in 0..comptime!(dim / 2) {
            os[o_at + d] *= alpha;
        }
        sync_plane();
        // The plane's output rows += its probabilities times the block's values.
        #[unroll]
        for n in 0..comptime!(dim / TILE) {
            product_tile::<F>(
                &ps,
                plane * TILE * keys,
                keys,
                TILE,
                &vs,
                n * TILE,
                dim,
                TILE * dim,
                &mut os,
                plane * TILE * dim + n * TILE,
                dim,
                comptime!(keys / TILE),
                MatrixLayout::RowMajor,
                true,
            );
        }
        sync_plane();
    }
    if i < q_len {
        // Every key hidden by -inf: no weight anywhere, the row is 0 (as burn's attention).
        let mut inv = 0.0f32;
        if row_sum > 0.0f32 {
            inv = 1.0f32 / row_sum;
        }
        let at = ((b * q_len + i) * heads + h) * dim + half * comptime!(dim / 2);
        for d in 0..comptime!(dim / 2) {
            out[at + d] = F::cast_from(os[o_at + d] * inv);
        }
        if half == 0 {
            lse[(b * q_len + i) * heads + h] = row_max + row_sum.ln();
        }
    }
}

/// dQ and `delta`: rows `CUBE_POS_X * BLOCK..` of batch `CUBE_POS_Z`, head `CUBE_POS_Y`, as
/// `attention_kernels::query_grad_kernel`.
#[cube(launch_unchecked)]
pub(super) fn query_grad_tc_kernel<F: Float>(
    q: &[F],
    k: &[F],
    v: &[F],
    out: &[F],
    dout: &[F],
    lse: &[f32],
    mask: &[i32],
    dq: &mut [F],
    delta: &mut [f32],
    q_len: u32,
    k_len: u32,
    heads: u32,
    strides: MaskStrides,
    scale: f32,
    fill: f32,
    #[comptime] dim: usize,
    #[comptime] keys: usize,
    #[comptime] masked: bool,
    #[comptime] causal: bool,
    #[define(F)] _dtype: ElemType,
) {
    let q_len = q_len as usize;
    let k_len = k_len as usize;
    let heads = heads as usize;
    let h = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let first = CUBE_POS_X as usize * BLOCK;
    let plane = UNIT_POS_Y as usize;
    let lane = UNIT_POS_X as usize;
    let r = plane * TILE + lane / 2;
    let half = lane % 2;
    let i = first + r;
    let mut qs = Shared::<[F]>::new_aligned_slice(comptime!(BLOCK * dim), ALIGN);
    let mut dos = Shared::<[F]>::new_aligned_slice(comptime!(BLOCK * dim), ALIGN);
    let mut ks = Shared::<[F]>::new_aligned_slice(comptime!(keys * dim), ALIGN);
    let mut vs = Shared::<[F]>::new_aligned_slice(comptime!(keys * dim), ALIGN);
    let mut ss = Shared::<[f32]>::new_aligned_slice(comptime!(BLOCK * keys), ALIGN);
    let mut dps = Shared::<[f32]>::new_aligned_slice(comptime!(BLOCK * keys), ALIGN);
    let mut dss = Shared::<[F]>::new_aligned_slice(comptime!(BLOCK * keys), ALIGN);
    let mut acc = Shared::<[f32]>::new_aligned_slice(comptime!(BLOCK * dim), ALIGN);
    stage_rows::<F>(q, &mut qs, b, h, first, q_len, heads, BLOCK, dim);
    stage_rows::<F>(dout, &mut dos, b, h, first, q_len, heads, BLOCK, dim);
    let o_at = r * dim + half * comptime!(dim / 2);
    let s_at = r * keys + half * comptime!(keys / 2);
    for d in 0..comptime!(dim / 2) {
        acc[o_at + d] = 0.0f32;
    }
    let row = (b * q_len + i) * heads + h;
    let mut part = 0.0f32;
    let mut row_lse = 0.0f32;
    if i < q_len {
        let at = row * dim + half * comptime!(dim / 2);
        for d in 0..comptime!(dim / 2) {
            part += f32::cast_from(dout[at + d]) * f32::cast_from(out[at + d]);
        }
        row_lse = lse[row];
    }
    let row_delta = part + plane_shuffle_xor(part, 1);
    if i < q_len && half == 0 {
        delta[row] = row_delta;
    }
    let blocks = key_blocks(first, k_len, keys, causal);
    for block in 0..blocks {
        let base = block * keys;
        sync_cube();
        stage_rows::<F>(k, &mut ks, b, h, base, k_len, heads, keys, dim);
        stage_rows::<F>(v, &mut vs, b, h, base, k_len, heads, keys, dim);
        sync_cube();
        // The plane's scores (q k^T) and their products with the values (dO v^T).
        #[unroll]
        for n in 0..comptime!(keys / TILE) {
            product_tile::<F>(
                &qs,
                plane * TILE * dim,
                dim,
                TILE,
                &ks,
                n * TILE * dim,
                dim,
                TILE,
                &mut ss,
                plane * TILE * keys + n * TILE,
                keys,
                comptime!(dim / TILE),
                MatrixLayout::ColMajor,
                false,
            );
            product_tile::<F>(
                &dos,
                plane * TILE * dim,
                dim,
                TILE,
                &vs,
                n * TILE * dim,
                dim,
                TILE,
                &mut dps,
                plane * TILE * keys + n * TILE,
                keys,
                comptime!(dim / TILE),
                MatrixLayout::ColMajor,
                false,
            );
        }
        sync_plane();
        for c in 0..comptime!(keys / 2) {
            let kj = base + half * comptime!(keys / 2) + c;
            let valid = i < q_len && kj < k_len;
            let mut s = ss[s_at + c] * scale;
            let hide = valid && hidden(mask, &strides, b, h, i, kj, valid, masked, causal);
            if hide {
                s = fill;
            }
            let p = probability(s, row_lse, valid);
            dss[s_at + c] = F::cast_from(score_gradient(p, dps[s_at + c], row_delta, hide, valid));
        }
        sync_plane();
        // dQ += dS k.
        #[unroll]
        for n in 0..comptime!(dim / TILE) {
            product_tile::<F>(
                &dss,
                plane * TILE * keys,
                keys,
                TILE,
                &ks,
                n * TILE,
                dim,
                TILE * dim,
                &mut acc,
                plane * TILE * dim + n * TILE,
                dim,
                comptime!(keys / TILE),
                MatrixLayout::RowMajor,
                true,
            );
        }
        sync_plane();
    }
    if i < q_len {
        let at = row * dim + half * comptime!(dim / 2);
        for d in 0..comptime!(dim / 2) {
            dq[at + d] = F::cast_from(acc[o_at + d] * scale);
        }
    }
}

/// dK and dV: keys `CUBE_POS_X * BLOCK..` of batch `CUBE_POS_Z`, head `CUBE_POS_Y`, as
/// `attention_kernels::key_grad_kernel`.
#[cube(launch_unchecked)]
pub(super) fn key_grad_tc_kernel<F: Float>(
    q: &[F],
    k: &[F],
    v: &[F],
    dout: &[F],
    lse: &[f32],
    delta: &[f32],
    mask: &[i32],
    dk: &mut [F],
    dv: &mut [F],
    q_len: u32,
    k_len: u32,
    heads: u32,
    strides: MaskStrides,
    scale: f32,
    fill: f32,
    #[comptime] dim: usize,
    #[comptime] rows: usize,
    #[comptime] masked: bool,
    #[comptime] causal: bool,
    #[define(F)] _dtype: ElemType,
) {
    let q_len = q_len as usize;
    let k_len = k_len as usize;
    let heads = heads as usize;
    let h = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let first = CUBE_POS_X as usize * BLOCK;
    let unit = UNIT_POS as usize;
    let plane = UNIT_POS_Y as usize;
    let lane = UNIT_POS_X as usize;
    let j = plane * TILE + lane / 2;
    let half = lane % 2;
    let kj = first + j;
    let mut ks = Shared::<[F]>::new_aligned_slice(comptime!(BLOCK * dim), ALIGN);
    let mut vs = Shared::<[F]>::new_aligned_slice(comptime!(BLOCK * dim), ALIGN);
    let mut qs = Shared::<[F]>::new_aligned_slice(comptime!(rows * dim), ALIGN);
    let mut dos = Shared::<[F]>::new_aligned_slice(comptime!(rows * dim), ALIGN);
    let mut sts = Shared::<[f32]>::new_aligned_slice(comptime!(BLOCK * rows), ALIGN);
    let mut dpts = Shared::<[f32]>::new_aligned_slice(comptime!(BLOCK * rows), ALIGN);
    let mut pts = Shared::<[F]>::new_aligned_slice(comptime!(BLOCK * rows), ALIGN);
    let mut dsts = Shared::<[F]>::new_aligned_slice(comptime!(BLOCK * rows), ALIGN);
    let mut dk_acc = Shared::<[f32]>::new_aligned_slice(comptime!(BLOCK * dim), ALIGN);
    let mut dv_acc = Shared::<[f32]>::new_aligned_slice(comptime!(BLOCK * dim), ALIGN);
    let mut lses = Shared::<[f32]>::new_slice(rows);
    let mut deltas = Shared::<[f32]>::new_slice(rows);
    stage_rows::<F>(k, &mut ks, b, h, first, k_len, heads, BLOCK, dim);
    stage_rows::<F>(v, &mut vs, b, h, first, k_len, heads, BLOCK, dim);
    let o_at = j * dim + half * comptime!(dim / 2);
    let t_at = j * rows + half * comptime!(rows / 2);
    for d in 0..comptime!(dim / 2) {
        dk_acc[o_at + d] = 0.0f32;
        dv_acc[o_at + d] = 0.0f32;
    }
    // With `causal`, query rows before the block's first key see none of its keys.
    let mut start = 0usize;
    if causal {
        let mut skipped = first;
        if q_len < first {
            skipped = q_len;
        }
        start = skipped / rows;
    }
    let blocks = (q_len + rows - 1) / rows;
    for block in start..blocks {
        let base = block * rows;
        sync_cube();
        stage_rows::<F>(q, &mut qs, b, h, base, q_len, heads, rows, dim);
        stage_rows::<F>(dout, &mut dos, b, h, base, q_len, heads, rows, dim);
        let mut idx = unit;
        while idx < rows {
            let qi = base + idx;
            let mut row_lse = 0.0f32;
            let mut row_delta = 0.0f32;
            if qi < q_len {
                row_lse = lse[(b * q_len + qi) * heads + h];
                row_delta = delta[(b * q_len + qi) * heads + h];
            }
            lses[idx] = row_lse;
            deltas[idx] = row_delta;
            idx += UNITS;
        }
        sync_cube();
        // The plane's transposed scores (k q^T) and (v dO^T).
        #[unroll]
        for n in 0..comptime!(rows / TILE) {
            product_tile::<F>(
                &ks,
                plane * TILE * dim,
                dim,
                TILE,
                &qs,
                n * TILE * dim,
                dim,
                TILE,
                &mut sts,
                plane * TILE * rows + n * TILE,
                rows,
                comptime!(dim / TILE),
                MatrixLayout::ColMajor,
                false,
            );
            product_tile::<F>(
                &vs,
                plane * TILE * dim,
                dim,
                TILE,
                &dos,
                n * TILE * dim,
                dim,
                TILE,
                &mut dpts,
                plane * TILE * rows + n * TILE,
                rows,
                comptime!(dim / TILE),
                MatrixLayout::ColMajor,
                false,
            );
        }
        sync_plane();
        for c in 0..comptime!(rows / 2) {
            let ii = half * comptime!(rows / 2) + c;
            let qi = base + ii;
            let valid = qi < q_len && kj < k_len;
            let mut s = sts[t_at + c] * scale;
            let hide = valid && hidden(mask, &strides, b, h, qi, kj, valid, masked, causal);
            if hide {
                s = fill;
            }
            let p = probability(s, lses[ii], valid);
            pts[t_at + c] = F::cast_from(p);
            dsts[t_at + c] =
                F::cast_from(score_gradient(p, dpts[t_at + c], deltas[ii], hide, valid));
        }
        sync_plane();
        // dV += P^T dO, dK += dS^T q.
        #[unroll]
        for n in 0..comptime!(dim / TILE) {
            product_tile::<F>(
                &pts,
                plane * TILE * rows,
                rows,
                TILE,
                &dos,
                n * TILE,
                dim,
                TILE * dim,
                &mut dv_acc,
                plane * TILE * dim + n * TILE,
                dim,
                comptime!(rows / TILE),
                MatrixLayout::RowMajor,
                true,
            );
            product_tile::<F>(
                &dsts,
                plane * TILE * rows,
                rows,
                TILE,
                &qs,
                n * TILE,
                dim,
                TILE * dim,
                &mut dk_acc,
                plane * TILE * dim + n * TILE,
                dim,
                comptime!(rows / TILE),
                MatrixLayout::RowMajor,
                true,
            );
        }
        sync_plane();
    }
    if kj < k_len {
        let at = ((b * k_len + kj) * heads + h) * dim + half * comptime!(dim / 2);
        for d in 0..comptime!(dim / 2) {
            dk[at + d] = F::cast_from(dk_acc[o_at + d] * scale);
            dv[at + d] = F::cast_from(dv_acc[o_at + d]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_blocks_fit_the_shared_memory() {
        let cuda = 48 * 1024;
        assert_eq!(
            TensorBlocks::for_dim(32, cuda),
            Some(TensorBlocks {
                forward_keys: 64,
                grad_keys: 64,
                rows: 32
            })
        );
        assert_eq!(
            TensorBlocks::for_dim(64, cuda),
            Some(TensorBlocks {
                forward_keys: 64,
                grad_keys: 32,
                rows: 16
            })
        );
        // Not a multiple of the tile, none, or too large.
        assert_eq!(TensorBlocks::for_dim(8, cuda), None);
        assert_eq!(TensorBlocks::for_dim(0, cuda), None);
        assert_eq!(TensorBlocks::for_dim(80, cuda), None);
    }
}
