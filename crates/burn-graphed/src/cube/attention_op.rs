//! Scaled dot-product attention without the scores in memory: one kernel forward, two backward
//! (FlashAttention's order of work), with its own autodiff node: what
//! [`crate::nn::attention`] and its multi-head module run on burn's cubecl backends, where burn
//! materializes the `[batch, heads, q_len, k_len]` scores, masks them, takes a softmax in
//! several reductions and elementwise kernels, and multiplies, about as many kernels again
//! backward.
//!
//! Layout: queries, keys, values, the output and their gradients are `[batch, len, heads,
//! dim]`, dense (the layout a linear layer's output has before burn's head split, so the
//! modules pass them without a copy). The log-sum-exp of each query row, `lse`, and the backward's
//! `delta = rowsum(dO * O)` are `[batch, q_len, heads]` in `f32`.
//!
//! Arithmetic, per query row `i`, in `f32` whatever the dtype: `s_j = scale * q_i . k_j`; a hidden
//! key (mask, causal: `j > i`) has `s_j = fill` (`-inf` as burn's `attention`, burn-nn's
//! `min_float` in its multi-head attention); `o_i = sum_j p_j v_j` with `p = softmax(s)`, over
//! blocks of keys with a running maximum and sum (online softmax), so a row of any length needs
//! no more than a block of scores. With `quiet`, a virtual score 0 joins every row's softmax
//! and is dropped from the output (burn's `quiet_softmax`). A row whose every key is hidden by
//! `-inf` gets 0 (burn's `attention` does the same). Backward, FlashAttention-2's: `p_ij =
//! exp(s_ij - lse_i)` recomputed, `dp_ij = dO_i . v_j`, `ds_ij = p_ij (dp_ij - delta_i)` (0 where
//! the key is hidden: a fill has no gradient), `dQ_i = scale sum_j ds_ij k_j` (a kernel over query
//! blocks, which also writes `delta`), `dK_j = scale sum_i ds_ij q_i` and `dV_j = sum_i p_ij dO_i`
//! (a kernel over key blocks): no atomics, every sum in a fixed order, so a replay computes what
//! the eager call computed, bit for bit.
//!
//! Work split: a cube of [`THREADS`] units takes [`ROWS`] query rows (forward and dQ) or
//! [`KEYS`] keys (dK and dV), [`GROUP`] units each; the units of a row share its dot products and
//! its output's elements. The blocks it streams through shared memory are sized from the
//! device's shared memory ([`Blocks`]); a head dimension above [`MAX_DIM`], or a device too
//! small for the smallest blocks, is not taken (the caller runs burn's composition).

// Attention's kernels and ops take queries, keys, values, a mask, their shapes and the spec's
// five choices: more arguments than clippy's default, in the generated dispatch code too.
// Inside `#[cube]` functions a compile-time condition stays its own `if` (it selects code, a
// runtime one branches), and division rounds up by hand (`div_ceil` is not a kernel operation).
#![allow(
    clippy::too_many_arguments,
    clippy::collapsible_if,
    clippy::manual_div_ceil
)]

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Backend, Cube, backend_extension};
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::AttentionSpec;
use super::adam_op::kernel_elem;
use super::buffers::FusedTensor;
use super::dense::Dense;
use super::row_kernels::count_forward;

/// The autodiff tensor of burn's cubecl backend.
type AutodiffTensor = FloatTensor<Autodiff<Cube>>;
/// An int tensor of burn's cubecl backend.
type FusedInt = IntTensor<Cube>;

/// Units of a cube.
const THREADS: usize = 256;
/// Units per query row (forward, dQ) or per key (dK, dV).
const GROUP: usize = 16;
/// Query rows of a forward or dQ cube.
const ROWS: usize = THREADS / GROUP;
/// Keys of a dK/dV cube.
const KEYS: usize = THREADS / GROUP;
/// The largest head dimension taken.
pub(crate) const MAX_DIM: usize = 64;
/// The most shared memory a cube asks for (bytes), below CUDA's static limit of 48 KiB.
const MAX_SHARED: usize = 40 * 1024;

/// The block sizes of the three kernels for a head dimension: keys streamed per step of a
/// forward or dQ cube, query rows streamed per step of a dK/dV cube. Powers of two from
/// [`GROUP`] to 64, the largest whose shared arrays fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Blocks {
    /// Keys per step of the forward and dQ kernels.
    pub(crate) keys: usize,
    /// Query rows per step of the dK/dV kernel.
    pub(crate) rows: usize,
}

impl Blocks {
    /// The blocks for head dimension `dim` within `shared` bytes of shared memory per cube,
    /// or `None` where `dim` is 0 or above [`MAX_DIM`] or even the smallest blocks do not fit.
    pub(crate) fn for_dim(dim: usize, shared: usize) -> Option<Self> {
        if dim == 0 || dim > MAX_DIM {
            return None;
        }
        let budget = shared.min(MAX_SHARED) / 4;
        let pitch = dim + 1;
        // dQ's arrays (the forward's are fewer): q and dO rows, keys and values, the block's
        // scores, the rows' sums, the reduction scratch.
        let query_side =
            |keys: usize| 2 * ROWS * pitch + 2 * keys * pitch + ROWS * keys + ROWS * dim + THREADS;
        // dK/dV's: keys and values, q and dO rows, probabilities and score gradients, the two
        // sums, the rows' lse and delta.
        let key_side = |rows: usize| {
            2 * KEYS * pitch + 2 * rows * pitch + 2 * KEYS * rows + 2 * KEYS * dim + 2 * rows
        };
        let fit = |size: &dyn Fn(usize) -> usize| {
            [64, 32, GROUP].into_iter().find(|&n| size(n) <= budget)
        };
        Some(Self {
            keys: fit(&query_side)?,
            rows: fit(&key_side)?,
        })
    }
}

/// The sum of `values[at + g]` over the `GROUP` units of a row, in order (every unit of the
/// row gets the same value). Every unit of the cube must call it (it meets the cube at
/// barriers); `values` is the cube's reduction scratch.
#[cube]
fn group_sum(values: &mut Shared<[f32]>, value: f32, row: usize) -> f32 {
    let unit = UNIT_POS as usize;
    values[unit] = value;
    sync_cube();
    let mut sum = 0.0f32;
    for g in 0..GROUP {
        sum += values[row * GROUP + g];
    }
    sync_cube();
    sum
}

/// The largest of `value` over the `GROUP` units of a row; as [`group_sum`].
#[cube]
fn group_max(values: &mut Shared<[f32]>, value: f32, row: usize) -> f32 {
    let unit = UNIT_POS as usize;
    values[unit] = value;
    sync_cube();
    let mut high = f32::min_value();
    for g in 0..GROUP {
        high = f32::max(high, values[row * GROUP + g]);
    }
    sync_cube();
    high
}

/// Whether key `kj` is hidden from query row `i` of batch `b`, head `h`: by the mask (an `i32`
/// tensor read at `b * strides.batch + h * strides.head + i * strides.row + kj`, nonzero hides;
/// read only where `valid`, the row and key in range: kernels evaluate both sides of `&&`) or,
/// with `causal`, by coming after the query.
#[cube]
fn hidden(
    mask: &[i32],
    strides: &MaskStrides,
    b: usize,
    h: usize,
    i: usize,
    kj: usize,
    valid: bool,
    #[comptime] masked: bool,
    #[comptime] causal: bool,
) -> bool {
    let mut hide = false;
    if causal {
        hide = kj > i;
    }
    if masked {
        if valid {
            let at = b * (strides.batch as usize)
                + h * (strides.head as usize)
                + i * (strides.row as usize)
                + kj;
            hide = hide || mask[at] != 0i32;
        }
    }
    hide
}

/// The mask's strides along batches, heads and query rows (0 along a dimension of size 1).
#[derive(CubeType, CubeLaunch, Clone, Copy)]
#[expand(derive(Clone))]
pub(crate) struct MaskStrides {
    batch: u32,
    head: u32,
    row: u32,
}

/// Loads `count` rows of `source` (`[batch, len, heads, dim]`, rows `first..` of batch `b`,
/// head `h`; rows past `len` as 0) into `target`, `pitch` apart.
#[cube]
fn load_rows<F: Float>(
    source: &[F],
    target: &mut Shared<[f32]>,
    b: usize,
    h: usize,
    first: usize,
    len: usize,
    heads: usize,
    #[comptime] count: usize,
    #[comptime] dim: usize,
    #[comptime] pitch: usize,
) {
    let mut idx = UNIT_POS as usize;
    while idx < count * dim {
        let row = idx / dim;
        let d = idx % dim;
        let at = first + row;
        let mut value = 0.0f32;
        if at < len {
            value = f32::cast_from(source[((b * len + at) * heads + h) * dim + d]);
        }
        target[row * pitch + d] = value;
        idx += THREADS;
    }
}

/// Key blocks a query block `first..first + ROWS` reads: every block of `k_len` keys, or with
/// `causal` those up to its last row.
#[cube]
fn key_blocks(
    first: usize,
    k_len: usize,
    #[comptime] keys: usize,
    #[comptime] causal: bool,
) -> usize {
    let mut last = k_len;
    if causal {
        if first + ROWS < k_len {
            last = first + ROWS;
        }
    }
    (last + keys - 1) / keys
}

/// Forward: rows `block * ROWS..` of batch `CUBE_POS_Z`, head `CUBE_POS_Y`: `out` and `lse`.
#[cube(launch_unchecked)]
fn forward_kernel<F: Float>(
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
    let first = CUBE_POS_X as usize * ROWS;
    let unit = UNIT_POS as usize;
    let r = unit / GROUP;
    let t = unit % GROUP;
    let i = first + r;
    let pitch = comptime!(dim + 1);
    let mut qs = Shared::<[f32]>::new_slice(comptime!(ROWS * (dim + 1)));
    let mut ks = Shared::<[f32]>::new_slice(comptime!(keys * (dim + 1)));
    let mut vs = Shared::<[f32]>::new_slice(comptime!(keys * dim));
    let mut ps = Shared::<[f32]>::new_slice(comptime!(ROWS * keys));
    let mut acc = Shared::<[f32]>::new_slice(comptime!(ROWS * dim));
    let mut scratch = Shared::<[f32]>::new_slice(THREADS);
    load_rows::<F>(q, &mut qs, b, h, first, q_len, heads, ROWS, dim, pitch);
    let mut idx = unit;
    while idx < comptime!(ROWS * dim) {
        acc[idx] = 0.0f32;
        idx += THREADS;
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
        load_rows::<F>(k, &mut ks, b, h, base, k_len, heads, keys, dim, pitch);
        load_rows::<F>(v, &mut vs, b, h, base, k_len, heads, keys, dim, dim);
        sync_cube();
        let mut high = f32::min_value();
        let mut j = t;
        while j < keys {
            let kj = base + j;
            let mut s = 0.0f32;
            for d in 0..dim {
                s += qs[r * pitch + d] * ks[j * pitch + d];
            }
            s *= scale;
            let valid = i < q_len && kj < k_len;
            if valid && hidden(mask, &strides, b, h, i, kj, valid, masked, causal) {
                s = fill;
            }
            if kj < k_len {
                high = f32::max(high, s);
            }
            ps[r * keys + j] = s;
            j += GROUP;
        }
        let new_max = f32::max(row_max, group_max(&mut scratch, high, r));
        let mut part = 0.0f32;
        j = t;
        while j < keys {
            let mut p = 0.0f32;
            if base + j < k_len {
                p = (ps[r * keys + j] - new_max).exp();
            }
            ps[r * keys + j] = p;
            part += p;
            j += GROUP;
        }
        // The group sum's barrier also publishes `ps` to the row's other units.
        let block_sum = group_sum(&mut scratch, part, r);
        let alpha = (row_max - new_max).exp();
        row_sum = row_sum * alpha + block_sum;
        row_max = new_max;
        let mut d = t;
        while d < dim {
            let mut sum = 0.0f32;
            for jj in 0..keys {
                sum += ps[r * keys + jj] * vs[jj * dim + d];
            }
            acc[r * dim + d] = acc[r * dim + d] * alpha + sum;
            d += GROUP;
        }
    }
    if i < q_len {
        // Every key hidden by -inf: no weight anywhere, the row is 0 (as burn's attention).
        let mut inv = 0.0f32;
        if row_sum > 0.0f32 {
            inv = 1.0f32 / row_sum;
        }
        let mut d = t;
        while d < dim {
            out[((b * q_len + i) * heads + h) * dim + d] = F::cast_from(acc[r * dim + d] * inv);
            d += GROUP;
        }
        if t == 0 {
            lse[(b * q_len + i) * heads + h] = row_max + row_sum.ln();
        }
    }
}

/// `p_ij = exp(s_ij - lse_i)` of a score, 0 where the key lies past `k_len` or where a fill of
/// `-inf` hides it (whose row's `lse` may itself be `-inf`).
#[cube]
fn probability(s: f32, row_lse: f32, valid: bool) -> f32 {
    let mut p = 0.0f32;
    if valid && s > f32::min_value() {
        p = (s - row_lse).exp();
    }
    p
}

/// dQ and `delta`: rows `block * ROWS..` of batch `CUBE_POS_Z`, head `CUBE_POS_Y`.
#[cube(launch_unchecked)]
fn query_grad_kernel<F: Float>(
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
    let first = CUBE_POS_X as usize * ROWS;
    let unit = UNIT_POS as usize;
    let r = unit / GROUP;
    let t = unit % GROUP;
    let i = first + r;
    let pitch = comptime!(dim + 1);
    let mut qs = Shared::<[f32]>::new_slice(comptime!(ROWS * (dim + 1)));
    let mut dos = Shared::<[f32]>::new_slice(comptime!(ROWS * (dim + 1)));
    let mut ks = Shared::<[f32]>::new_slice(comptime!(keys * (dim + 1)));
    let mut vs = Shared::<[f32]>::new_slice(comptime!(keys * (dim + 1)));
    let mut ds = Shared::<[f32]>::new_slice(comptime!(ROWS * keys));
    let mut acc = Shared::<[f32]>::new_slice(comptime!(ROWS * dim));
    let mut scratch = Shared::<[f32]>::new_slice(THREADS);
    load_rows::<F>(q, &mut qs, b, h, first, q_len, heads, ROWS, dim, pitch);
    load_rows::<F>(dout, &mut dos, b, h, first, q_len, heads, ROWS, dim, pitch);
    let mut idx = unit;
    while idx < comptime!(ROWS * dim) {
        acc[idx] = 0.0f32;
        idx += THREADS;
    }
    let row = (b * q_len + i) * heads + h;
    let mut part = 0.0f32;
    let mut row_lse = 0.0f32;
    if i < q_len {
        let mut d = t;
        while d < dim {
            part += f32::cast_from(dout[row * dim + d]) * f32::cast_from(out[row * dim + d]);
            d += GROUP;
        }
        row_lse = lse[row];
    }
    let row_delta = group_sum(&mut scratch, part, r);
    if i < q_len && t == 0 {
        delta[row] = row_delta;
    }
    let blocks = key_blocks(first, k_len, keys, causal);
    for block in 0..blocks {
        let base = block * keys;
        sync_cube();
        load_rows::<F>(k, &mut ks, b, h, base, k_len, heads, keys, dim, pitch);
        load_rows::<F>(v, &mut vs, b, h, base, k_len, heads, keys, dim, pitch);
        sync_cube();
        let mut j = t;
        while j < keys {
            let kj = base + j;
            let valid = i < q_len && kj < k_len;
            let mut s = 0.0f32;
            let mut dp = 0.0f32;
            for d in 0..dim {
                s += qs[r * pitch + d] * ks[j * pitch + d];
                dp += dos[r * pitch + d] * vs[j * pitch + d];
            }
            s *= scale;
            let hide = valid && hidden(mask, &strides, b, h, i, kj, valid, masked, causal);
            if hide {
                s = fill;
            }
            let mut grad = probability(s, row_lse, valid) * (dp - row_delta);
            if hide || !valid {
                grad = 0.0f32;
            }
            ds[r * keys + j] = grad;
            j += GROUP;
        }
        sync_cube();
        let mut d = t;
        while d < dim {
            let mut sum = 0.0f32;
            for jj in 0..keys {
                sum += ds[r * keys + jj] * ks[jj * pitch + d];
            }
            acc[r * dim + d] += sum;
            d += GROUP;
        }
    }
    if i < q_len {
        let mut d = t;
        while d < dim {
            dq[row * dim + d] = F::cast_from(acc[r * dim + d] * scale);
            d += GROUP;
        }
    }
}

/// dK and dV: keys `block * KEYS..` of batch `CUBE_POS_Z`, head `CUBE_POS_Y`.
#[cube(launch_unchecked)]
fn key_grad_kernel<F: Float>(
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
    let first = CUBE_POS_X as usize * KEYS;
    let unit = UNIT_POS as usize;
    let j = unit / GROUP;
    let t = unit % GROUP;
    let kj = first + j;
    let pitch = comptime!(dim + 1);
    let mut ks = Shared::<[f32]>::new_slice(comptime!(KEYS * (dim + 1)));
    let mut vs = Shared::<[f32]>::new_slice(comptime!(KEYS * (dim + 1)));
    let mut qs = Shared::<[f32]>::new_slice(comptime!(rows * (dim + 1)));
    let mut dos = Shared::<[f32]>::new_slice(comptime!(rows * (dim + 1)));
    let mut ps = Shared::<[f32]>::new_slice(comptime!(KEYS * rows));
    let mut ds = Shared::<[f32]>::new_slice(comptime!(KEYS * rows));
    let mut dk_acc = Shared::<[f32]>::new_slice(comptime!(KEYS * dim));
    let mut dv_acc = Shared::<[f32]>::new_slice(comptime!(KEYS * dim));
    let mut lses = Shared::<[f32]>::new_slice(rows);
    let mut deltas = Shared::<[f32]>::new_slice(rows);
    load_rows::<F>(k, &mut ks, b, h, first, k_len, heads, KEYS, dim, pitch);
    load_rows::<F>(v, &mut vs, b, h, first, k_len, heads, KEYS, dim, pitch);
    let mut idx = unit;
    while idx < comptime!(KEYS * dim) {
        dk_acc[idx] = 0.0f32;
        dv_acc[idx] = 0.0f32;
        idx += THREADS;
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
        load_rows::<F>(q, &mut qs, b, h, base, q_len, heads, rows, dim, pitch);
        load_rows::<F>(dout, &mut dos, b, h, base, q_len, heads, rows, dim, pitch);
        if unit < rows {
            let qi = base + unit;
            let mut row_lse = 0.0f32;
            let mut row_delta = 0.0f32;
            if qi < q_len {
                row_lse = lse[(b * q_len + qi) * heads + h];
                row_delta = delta[(b * q_len + qi) * heads + h];
            }
            lses[unit] = row_lse;
            deltas[unit] = row_delta;
        }
        sync_cube();
        let mut ii = t;
        while ii < rows {
            let qi = base + ii;
            let valid = qi < q_len && kj < k_len;
            let mut s = 0.0f32;
            let mut dp = 0.0f32;
            for d in 0..dim {
                s += qs[ii * pitch + d] * ks[j * pitch + d];
                dp += dos[ii * pitch + d] * vs[j * pitch + d];
            }
            s *= scale;
            let hide = valid && hidden(mask, &strides, b, h, qi, kj, valid, masked, causal);
            if hide {
                s = fill;
            }
            let p = probability(s, lses[ii], valid);
            let mut grad = p * (dp - deltas[ii]);
            if hide || !valid {
                grad = 0.0f32;
            }
            ps[j * rows + ii] = p;
            ds[j * rows + ii] = grad;
            ii += GROUP;
        }
        sync_cube();
        let mut d = t;
        while d < dim {
            let mut sum_v = 0.0f32;
            let mut sum_k = 0.0f32;
            for i2 in 0..rows {
                sum_v += ps[j * rows + i2] * dos[i2 * pitch + d];
                sum_k += ds[j * rows + i2] * qs[i2 * pitch + d];
            }
            dv_acc[j * dim + d] += sum_v;
            dk_acc[j * dim + d] += sum_k;
            d += GROUP;
        }
    }
    if kj < k_len {
        let at = ((b * k_len + kj) * heads + h) * dim;
        let mut d = t;
        while d < dim {
            dk[at + d] = F::cast_from(dk_acc[j * dim + d] * scale);
            dv[at + d] = F::cast_from(dv_acc[j * dim + d]);
            d += GROUP;
        }
    }
}

/// The kernels as lazy fusion operations on burn's cubecl backend.
#[backend_extension(Cube, Fusion)]
pub(crate) trait AttentionKernels: Backend {
    /// `(out, lse)`: the attention of `q` (`[batch, q_len, heads, dim]`) over `k` and `v`
    /// (`[batch, k_len, heads, dim]`), `[batch, q_len, heads, dim]` in their dtype, and each
    /// query row's log-sum-exp `[batch, q_len, heads]` in `f32`. `mask` is an `i32` tensor
    /// `[batch or 1, heads or 1, q_len or 1, k_len]`, read only with `masked`.
    #[fusion(meta = |q, _k, _v, _mask, _masked, _causal, _quiet, _scale, _fill| {
        let [batch, q_len, heads, _] = q.shape.dims::<4>();
        (
            burn::backend::fusion::custom::TensorSpec::new(q.shape.clone(), q.dtype),
            burn::backend::fusion::custom::TensorSpec::new(
                Shape::new([batch, q_len, heads]),
                DType::F32,
            ),
        )
    })]
    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: IntTensor<Self>,
        masked: bool,
        causal: bool,
        quiet: bool,
        scale: f32,
        fill: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `(dq, dk, dv)` for the output's gradient `dout`, from the forward's tensors and `lse`.
    #[fusion(meta = |q, k, v, _out, _dout, _lse, _mask, _masked, _causal, _quiet, _scale, _fill| {
        (
            burn::backend::fusion::custom::TensorSpec::new(q.shape.clone(), q.dtype),
            burn::backend::fusion::custom::TensorSpec::new(k.shape.clone(), k.dtype),
            burn::backend::fusion::custom::TensorSpec::new(v.shape.clone(), v.dtype),
        )
    })]
    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        mask: IntTensor<Self>,
        masked: bool,
        causal: bool,
        quiet: bool,
        scale: f32,
        fill: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

/// The element type of the queries; the caller checked it.
fn elem_of(tensor: &CubeTensor) -> ElemType {
    kernel_elem(tensor.dtype).unwrap_or_else(|| {
        panic!(
            "burn-graphed: attention kernel given {:?} (the caller checks the dtype)",
            tensor.dtype
        )
    })
}

/// The shapes of a call: `(batch, q_len, k_len, heads, dim)`, its blocks and the mask's
/// strides (0 along a dimension of size 1).
struct Call {
    batch: usize,
    q_len: usize,
    k_len: usize,
    heads: usize,
    dim: usize,
    blocks: Blocks,
    strides: [u32; 3],
}

impl Call {
    fn of(q: &CubeTensor, k: &CubeTensor, mask: &CubeTensor, masked: bool) -> Self {
        let [batch, q_len, heads, dim] = q.meta.shape().dims::<4>();
        let k_len = k.meta.shape().dims::<4>()[1];
        let shared = q.client.properties().hardware.max_shared_memory_size;
        let blocks = Blocks::for_dim(dim, shared).unwrap_or_else(|| {
            panic!(
                "burn-graphed: attention kernel given head dimension {dim} (the caller checks it)"
            )
        });
        let strides = if masked {
            let [mb, mh, mq, mk] = mask.meta.shape().dims::<4>();
            let stride = |size: usize, inner: usize| if size == 1 { 0 } else { inner as u32 };
            [
                stride(mb, mh * mq * mk),
                stride(mh, mq * mk),
                stride(mq, mk),
            ]
        } else {
            [0; 3]
        };
        Self {
            batch,
            q_len,
            k_len,
            heads,
            dim,
            blocks,
            strides,
        }
    }

    fn strides(&self) -> MaskStridesLaunch {
        let [batch, head, row] = self.strides;
        MaskStridesLaunch::new(batch, head, row)
    }

    /// One cube per block of `per_cube` rows of `len`, per head, per batch.
    fn grid(&self, len: usize, per_cube: usize) -> CubeCount {
        CubeCount::Static(
            len.div_ceil(per_cube).max(1) as u32,
            self.heads as u32,
            self.batch as u32,
        )
    }
}

/// A dense `i32` mask, or with no mask a one-element buffer never read.
fn mask_of(mask: &CubeTensor, masked: bool) -> Dense {
    if masked {
        Dense::of(mask)
    } else {
        Dense::new_empty(
            mask.client.clone(),
            mask.device.clone(),
            Shape::new([1]),
            DType::I32,
        )
    }
}

impl AttentionKernels for CubeBackend {
    fn attention_forward(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        mask: CubeTensor,
        masked: bool,
        causal: bool,
        quiet: bool,
        scale: f32,
        fill: f32,
    ) -> (CubeTensor, CubeTensor) {
        let call = Call::of(&q, &k, &mask, masked);
        let elem = elem_of(&q);
        let (client, device) = (q.client.clone(), q.device.clone());
        let out = Dense::new_empty(
            client.clone(),
            device.clone(),
            q.meta.shape().clone(),
            q.dtype,
        );
        let lse = Dense::new_empty(
            client.clone(),
            device,
            Shape::new([call.batch, call.q_len, call.heads]),
            DType::F32,
        );
        let (q, k, v, mask) = (
            Dense::of(&q),
            Dense::of(&k),
            Dense::of(&v),
            mask_of(&mask, masked),
        );
        // SAFETY: the kernel is instantiated for `elem`, the dtype of q, k, v (the caller
        // checked they agree) and of out (made with it); lse is f32 and the mask i32. A cube
        // reads rows below `q_len` of q and below `k_len` of k and v (`[batch, len, heads, dim]`
        // dense, `dim` the kernel's), and the mask, when `masked`, at `b * s0 + h * s1 + i * s2
        // + j` for `b < batch`, `h < heads`, `i < q_len`, `j < k_len`, inside the dense mask
        // whose shape gave the strides (0 along its dimensions of size 1). It writes the rows
        // `i < q_len` of its own block of out and lse, new allocations distinct from the read
        // buffers. Shared memory: `Blocks::for_dim` sized the blocks within the device's limit.
        unsafe {
            forward_kernel::launch_unchecked(
                &client,
                call.grid(call.q_len, ROWS),
                CubeDim::new_1d(THREADS as u32),
                q.arg(),
                k.arg(),
                v.arg(),
                mask.arg(),
                out.arg(),
                lse.arg(),
                call.q_len as u32,
                call.k_len as u32,
                call.heads as u32,
                call.strides(),
                scale,
                fill,
                call.dim,
                call.blocks.keys,
                masked,
                causal,
                quiet,
                elem,
            );
        }
        (out.into_tensor(), lse.into_tensor())
    }

    fn attention_backward(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        out: CubeTensor,
        dout: CubeTensor,
        lse: CubeTensor,
        mask: CubeTensor,
        masked: bool,
        causal: bool,
        _quiet: bool,
        scale: f32,
        fill: f32,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        let call = Call::of(&q, &k, &mask, masked);
        let elem = elem_of(&q);
        let (client, device) = (q.client.clone(), q.device.clone());
        let new = |like: &CubeTensor| {
            Dense::new_empty(
                client.clone(),
                device.clone(),
                like.meta.shape().clone(),
                like.dtype,
            )
        };
        let (dq, dk, dv) = (new(&q), new(&k), new(&v));
        let delta = Dense::new_empty(
            client.clone(),
            device.clone(),
            lse.meta.shape().clone(),
            DType::F32,
        );
        let (q, k, v) = (Dense::of(&q), Dense::of(&k), Dense::of(&v));
        let (out, dout, lse) = (Dense::of(&out), Dense::of(&dout), Dense::of(&lse));
        let mask = mask_of(&mask, masked);
        // SAFETY: as in the forward: `elem` for q, k, v, out, dout and the gradients, f32 for
        // lse and delta, i32 for the mask, the same shapes and bounds. The first kernel writes
        // rows `i < q_len` of its block of dq and delta; the second reads delta (after the
        // first, on the same stream) and writes keys `j < k_len` of its block of dk and dv. The
        // written buffers are new allocations, distinct from each other and the read ones.
        unsafe {
            query_grad_kernel::launch_unchecked(
                &client,
                call.grid(call.q_len, ROWS),
                CubeDim::new_1d(THREADS as u32),
                q.arg(),
                k.arg(),
                v.arg(),
                out.arg(),
                dout.arg(),
                lse.arg(),
                mask.arg(),
                dq.arg(),
                delta.arg(),
                call.q_len as u32,
                call.k_len as u32,
                call.heads as u32,
                call.strides(),
                scale,
                fill,
                call.dim,
                call.blocks.keys,
                masked,
                causal,
                elem,
            );
            key_grad_kernel::launch_unchecked(
                &client,
                call.grid(call.k_len, KEYS),
                CubeDim::new_1d(THREADS as u32),
                q.arg(),
                k.arg(),
                v.arg(),
                dout.arg(),
                lse.arg(),
                delta.arg(),
                mask.arg(),
                dk.arg(),
                dv.arg(),
                call.q_len as u32,
                call.k_len as u32,
                call.heads as u32,
                call.strides(),
                scale,
                fill,
                call.dim,
                call.blocks.rows,
                masked,
                causal,
                elem,
            );
        }
        (dq.into_tensor(), dk.into_tensor(), dv.into_tensor())
    }
}

/// Attention with its own backward, reached from `Tensor` through burn's dispatch.
#[backend_extension(Cube, Autodiff)]
pub(crate) trait FusedAttentionOps: Backend {
    /// The attention of `q` over `k` and `v` (`[batch, len, heads, dim]`), as
    /// [`AttentionKernels::attention_forward`]'s first output.
    fn fused_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: IntTensor<Self>,
        masked: bool,
        causal: bool,
        quiet: bool,
        scale: f64,
        fill: f64,
    ) -> FloatTensor<Self>;
}

/// The forward through the fusion kernels: `(out, lse)`.
fn forward(
    (q, k, v, mask): (FusedTensor, FusedTensor, FusedTensor, FusedInt),
    spec: AttentionSpec,
) -> (FusedTensor, FusedTensor) {
    count_forward();
    <Cube as AttentionKernels>::attention_forward(
        q,
        k,
        v,
        mask,
        spec.masked,
        spec.causal,
        spec.quiet,
        spec.scale,
        spec.fill,
    )
}

fn spec_of(masked: bool, causal: bool, quiet: bool, scale: f64, fill: f64) -> AttentionSpec {
    AttentionSpec {
        masked,
        causal,
        quiet,
        scale: scale as f32,
        fill: fill as f32,
    }
}

/// Without autodiff: the forward alone.
impl FusedAttentionOps for Cube {
    fn fused_attention(
        q: FusedTensor,
        k: FusedTensor,
        v: FusedTensor,
        mask: FusedInt,
        masked: bool,
        causal: bool,
        quiet: bool,
        scale: f64,
        fill: f64,
    ) -> FusedTensor {
        forward((q, k, v, mask), spec_of(masked, causal, quiet, scale, fill)).0
    }
}

/// What the backward keeps of the forward.
#[derive(Debug, Clone)]
struct Saved {
    q: FusedTensor,
    k: FusedTensor,
    v: FusedTensor,
    out: FusedTensor,
    lse: FusedTensor,
    mask: FusedInt,
    spec: AttentionSpec,
}

/// The backward node: parents q, k and v.
#[derive(Debug)]
struct AttentionBackward;

impl Backward<Cube, 3> for AttentionBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Saved, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let dout = grads.consume::<Cube>(&ops.node);
        let Saved {
            q,
            k,
            v,
            out,
            lse,
            mask,
            spec,
        } = ops.state;
        let (dq, dk, dv) = <Cube as AttentionKernels>::attention_backward(
            q,
            k,
            v,
            out,
            dout,
            lse,
            mask,
            spec.masked,
            spec.causal,
            spec.quiet,
            spec.scale,
            spec.fill,
        );
        for (node, grad) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<Cube>(node.id, grad);
            }
        }
    }
}

impl<C: CheckpointStrategy> FusedAttentionOps for Autodiff<Cube, C> {
    fn fused_attention(
        q: AutodiffTensor,
        k: AutodiffTensor,
        v: AutodiffTensor,
        mask: FusedInt,
        masked: bool,
        causal: bool,
        quiet: bool,
        scale: f64,
        fill: f64,
    ) -> AutodiffTensor {
        let (q, q_node) = q.into_parts();
        let (k, k_node) = k.into_parts();
        let (v, v_node) = v.into_parts();
        let prepared = AttentionBackward
            .prepare::<C>([q_node, k_node, v_node])
            .compute_bound()
            .stateful();
        let spec = spec_of(masked, causal, quiet, scale, fill);
        let (out, lse) = forward((q.clone(), k.clone(), v.clone(), mask.clone()), spec);
        match prepared {
            OpsKind::Tracked(prep) => prep.finish(
                Saved {
                    q,
                    k,
                    v,
                    out: out.clone(),
                    lse,
                    mask,
                    spec,
                },
                out,
            ),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}

/// The attention of `q` over `k` and `v` (`[batch, len, heads, dim]`, one float dtype, burn's
/// cubecl backend, autodiff or not) with `mask` (`i32` `[batch or 1, heads or 1, q_len or 1,
/// k_len]`, read with `spec.masked`), through burn's dispatch: `[batch, q_len, heads, dim]`.
/// The caller checked the device, the dtypes, the shapes and the head dimension
/// ([`supports_dim`]).
/// Never `Err` here (see the stand-in, which hands the tensors back).
pub(crate) fn attention(
    (q, k, v, mask): super::AttentionInputs,
    spec: AttentionSpec,
) -> Result<burn::backend::DispatchTensor, Box<super::AttentionInputs>> {
    Ok(
        <burn::backend::Dispatch as FusedAttentionOps>::fused_attention(
            q,
            k,
            v,
            mask,
            spec.masked,
            spec.causal,
            spec.quiet,
            f64::from(spec.scale),
            f64::from(spec.fill),
        ),
    )
}

/// Whether the kernels take head dimension `dim` on `device` (its shared memory fits the
/// smallest blocks).
pub(crate) fn supports_dim(device: &burn::tensor::Device, dim: usize) -> bool {
    let Some(shared) = super::lifecycle::max_shared_memory(device) else {
        return false;
    };
    Blocks::for_dim(dim, shared).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_fit_the_shared_memory() {
        // CUDA's 48 KiB (capped at 40): the largest blocks up to a head dimension of 32.
        let cuda = 48 * 1024;
        assert_eq!(
            Blocks::for_dim(32, cuda),
            Some(Blocks { keys: 64, rows: 64 })
        );
        assert_eq!(
            Blocks::for_dim(64, cuda),
            Some(Blocks { keys: 32, rows: 32 })
        );
        // wgpu's default 16 KiB: smaller blocks, none for 64.
        let wgpu = 16 * 1024;
        assert_eq!(
            Blocks::for_dim(8, wgpu),
            Some(Blocks { keys: 64, rows: 64 })
        );
        assert_eq!(Blocks::for_dim(64, wgpu), None);
        assert_eq!(Blocks::for_dim(0, cuda), None);
        assert_eq!(Blocks::for_dim(MAX_DIM + 1, cuda), None);
    }
}
