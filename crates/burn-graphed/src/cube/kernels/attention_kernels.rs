//! The attention kernels (`#[cube]`): one forward, two backward, and the block sizes they
//! take from the device's shared memory. Launched by `attention_op.rs`, whose doc states the
//! arithmetic and the layout.
//!
//! Work split: a cube of [`THREADS`] units takes [`ROWS`] query rows (forward and dQ) or
//! [`KEYS`] keys (dK and dV), [`GROUP`] units each; the units of a row share its dot products and
//! its output's elements. The blocks it streams through shared memory are sized from the
//! device's shared memory ([`Blocks`]); a head dimension above [`MAX_DIM`], or a device too
//! small for the smallest blocks, is not taken (the caller runs burn's composition). Rows of
//! shared arrays are padded by one element so that the units of a row read different banks.
//!
//! Over 600 lines: three kernels and the helpers only they use (staging rows one block ahead,
//! the group sums and maxima, the block sizes), kept together as `attention_tc_kernels.rs`
//! keeps the tensor-core three.

// Kernels take queries, keys, values, a mask, their shapes and compile-time choices: more
// arguments than clippy's default. Inside `#[cube]` functions a compile-time condition stays its
// own `if` (it selects code, a runtime one branches), and division rounds up by hand
// (`div_ceil` is not a kernel operation).
#![allow(
    clippy::too_many_arguments,
    clippy::collapsible_if,
    clippy::manual_div_ceil
)]

use cubecl::prelude::*;

/// Units of a cube.
pub(in crate::cube) const THREADS: usize = 256;
/// Units per query row (forward, dQ) or per key (dK, dV).
const GROUP: usize = 16;
/// Query rows of a forward or dQ cube.
pub(in crate::cube) const ROWS: usize = THREADS / GROUP;
/// Keys of a dK/dV cube.
pub(in crate::cube) const KEYS: usize = THREADS / GROUP;
/// The largest head dimension taken.
pub(in crate::cube) const MAX_DIM: usize = 64;
/// The most shared memory a cube asks for (bytes), below CUDA's static limit of 48 KiB.
const MAX_SHARED: usize = 40 * 1024;

/// The block sizes of the three kernels for a head dimension: keys streamed per step of a
/// forward or dQ cube, query rows streamed per step of a dK/dV cube. Powers of two from
/// [`GROUP`] to 64, the largest whose shared arrays fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::cube) struct Blocks {
    /// Keys per step of the forward and dQ kernels.
    pub(in crate::cube) keys: usize,
    /// Query rows per step of the dK/dV kernel.
    pub(in crate::cube) rows: usize,
}

impl Blocks {
    /// The blocks for head dimension `dim` within `shared` bytes of shared memory per cube,
    /// or `None` where `dim` is 0 or above [`MAX_DIM`] or even the smallest blocks do not fit.
    pub(in crate::cube) fn for_dim(dim: usize, shared: usize) -> Option<Self> {
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
pub(in crate::cube) fn hidden(
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
            hide = hide || mask[mask_at(strides, b, h, i, kj)] != 0i32;
        }
    }
    hide
}

/// Where the mask holds the entry of query row `i`, key `kj` of batch `b`, head `h`.
#[cube]
pub(in crate::cube) fn mask_at(
    strides: &MaskStrides,
    b: usize,
    h: usize,
    i: usize,
    kj: usize,
) -> usize {
    b * (strides.batch as usize) + h * (strides.head as usize) + i * (strides.row as usize) + kj
}

/// The mask's strides along batches, heads and query rows (0 along a dimension of size 1).
#[derive(CubeType, CubeLaunch, Clone, Copy)]
#[expand(derive(Clone))]
pub(in crate::cube) struct MaskStrides {
    batch: u32,
    head: u32,
    row: u32,
}

/// Where a call's queries, keys and values lie in their buffers, and their gradients in
/// theirs: element `d` of head `h` of row `t` of batch `b` at `at + (b * len + t) * stride + h *
/// dim + d`, `at` the operand's. Three dense tensors `[batch, len, heads, dim]` have `stride =
/// heads * dim` and every `at` 0; self-attention's three projections as one tensor `[batch,
/// len, 3 * heads, dim]` (one product makes them) have `stride = 3 * heads * dim` and `at` 0,
/// `heads * dim` and `2 * heads * dim`. The output, its gradient, `lse` and `delta` are
/// always dense.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
#[expand(derive(Clone))]
pub(in crate::cube) struct Operands {
    pub(in crate::cube) stride: u32,
    pub(in crate::cube) q_at: u32,
    pub(in crate::cube) k_at: u32,
    pub(in crate::cube) v_at: u32,
}

/// Loads this unit's share (`count * dim / THREADS` elements, rounded up; the last past
/// `count * dim` for some units, left 0) of `count` rows of `source` (rows `first..` of batch
/// `b`, head `h`, laid out as [`Operands`] says with `at` and `stride`; rows past `len` as 0) into `values`, as `f32`, every load
/// issued before any is used: the unrolled loop keeps them in flight together, and a caller
/// that stores them later (`store_rows`) overlaps their latency with its work in between.
#[cube]
fn fetch_rows<F: Float>(
    source: &[F],
    values: &mut Array<f32>,
    b: usize,
    h: usize,
    first: usize,
    len: usize,
    at: usize,
    stride: usize,
    #[comptime] count: usize,
    #[comptime] dim: usize,
) {
    #[unroll]
    for n in 0..comptime!((count * dim + THREADS - 1) / THREADS) {
        let idx = UNIT_POS as usize + n * THREADS;
        let row = first + idx / dim;
        let mut value = 0.0f32;
        if row < len && idx < comptime!(count * dim) {
            value = f32::cast_from(source[at + (b * len + row) * stride + h * dim + idx % dim]);
        }
        values[n] = value;
    }
}

/// The keys and values of one block: `fetch_rows` of `k` and of `v` (rows `first..` of batch `b`, head
/// `h`, rows past `k_len` as 0), laid out as `operands` says, into `k_next` and `v_next`.
#[cube]
fn fetch_keys_values<F: Float>(
    k: &[F],
    v: &[F],
    k_next: &mut Array<f32>,
    v_next: &mut Array<f32>,
    b: usize,
    h: usize,
    first: usize,
    k_len: usize,
    operands: &Operands,
    #[comptime] keys: usize,
    #[comptime] dim: usize,
) {
    let stride = operands.stride as usize;
    fetch_rows::<F>(
        k,
        k_next,
        b,
        h,
        first,
        k_len,
        operands.k_at as usize,
        stride,
        keys,
        dim,
    );
    fetch_rows::<F>(
        v,
        v_next,
        b,
        h,
        first,
        k_len,
        operands.v_at as usize,
        stride,
        keys,
        dim,
    );
}

/// Stores a share `fetch_rows` loaded into `target`, rows `pitch` apart.
#[cube]
fn store_rows(
    values: &Array<f32>,
    target: &mut Shared<[f32]>,
    #[comptime] count: usize,
    #[comptime] dim: usize,
    #[comptime] pitch: usize,
) {
    #[unroll]
    for n in 0..comptime!((count * dim + THREADS - 1) / THREADS) {
        let idx = UNIT_POS as usize + n * THREADS;
        if idx < comptime!(count * dim) {
            target[(idx / dim) * pitch + idx % dim] = values[n];
        }
    }
}

/// Loads `count` rows of `source` into `target` at once (`fetch_rows` then `store_rows`).
#[cube]
fn load_rows<F: Float>(
    source: &[F],
    target: &mut Shared<[f32]>,
    b: usize,
    h: usize,
    first: usize,
    len: usize,
    at: usize,
    stride: usize,
    #[comptime] count: usize,
    #[comptime] dim: usize,
    #[comptime] pitch: usize,
) {
    let mut values = Array::<f32>::new(comptime!((count * dim + THREADS - 1) / THREADS));
    fetch_rows::<F>(
        source,
        &mut values,
        b,
        h,
        first,
        len,
        at,
        stride,
        count,
        dim,
    );
    store_rows(&values, target, count, dim, pitch);
}

/// The entry of `values` (`[batch, len, heads]`: a row's `lse` or `delta`) at query row `qi` of
/// batch `b`, head `h`; 0 past `len`.
#[cube]
pub(in crate::cube) fn row_value(
    values: &[f32],
    b: usize,
    h: usize,
    qi: usize,
    len: usize,
    heads: usize,
) -> f32 {
    let mut value = 0.0f32;
    if qi < len {
        value = values[(b * len + qi) * heads + h];
    }
    value
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
pub(in crate::cube) fn attention_forward_kernel<F: Float>(
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
    operands: Operands,
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
    let stride = operands.stride as usize;
    let q_at = operands.q_at as usize;
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
    // The first block's keys and values are in flight while the queries are loaded.
    let blocks = key_blocks(first, k_len, keys, causal);
    let mut k_next = Array::<f32>::new(comptime!((keys * dim + THREADS - 1) / THREADS));
    let mut v_next = Array::<f32>::new(comptime!((keys * dim + THREADS - 1) / THREADS));
    fetch_keys_values::<F>(
        k,
        v,
        &mut k_next,
        &mut v_next,
        b,
        h,
        0,
        k_len,
        &operands,
        keys,
        dim,
    );
    load_rows::<F>(
        q, &mut qs, b, h, first, q_len, q_at, stride, ROWS, dim, pitch,
    );
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
    for block in 0..blocks {
        let base = block * keys;
        sync_cube();
        store_rows(&k_next, &mut ks, keys, dim, pitch);
        store_rows(&v_next, &mut vs, keys, dim, dim);
        sync_cube();
        // The next block's keys and values, in flight while this block is worked on.
        if block + 1 < blocks {
            fetch_keys_values::<F>(
                k,
                v,
                &mut k_next,
                &mut v_next,
                b,
                h,
                base + keys,
                k_len,
                &operands,
                keys,
                dim,
            );
        }
        let mut high = f32::min_value();
        let mut j = t;
        while j < keys {
            let kj = base + j;
            let mut s = dot(&qs, r * pitch, &ks, j * pitch, dim) * scale;
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
pub(in crate::cube) fn probability(s: f32, row_lse: f32, valid: bool) -> f32 {
    let mut p = 0.0f32;
    if valid && s > f32::min_value() {
        p = (s - row_lse).exp();
    }
    p
}

/// The dot product of the `dim` elements at `a[a_at..]` and `b[b_at..]`, summed in order.
#[cube]
fn dot(
    a: &Shared<[f32]>,
    a_at: usize,
    b: &Shared<[f32]>,
    b_at: usize,
    #[comptime] dim: usize,
) -> f32 {
    let mut sum = 0.0f32;
    for d in 0..dim {
        sum += a[a_at + d] * b[b_at + d];
    }
    sum
}

/// The score's gradient `p (dp - delta)`, 0 where the key is hidden (a fill has no gradient)
/// or the pair is out of range.
#[cube]
pub(in crate::cube) fn score_gradient(
    p: f32,
    dp: f32,
    row_delta: f32,
    hide: bool,
    valid: bool,
) -> f32 {
    let mut grad = p * (dp - row_delta);
    if hide || !valid {
        grad = 0.0f32;
    }
    grad
}

/// dQ and `delta`: rows `block * ROWS..` of batch `CUBE_POS_Z`, head `CUBE_POS_Y`.
#[cube(launch_unchecked)]
pub(in crate::cube) fn attention_query_grad_kernel<F: Float>(
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
    operands: Operands,
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
    let stride = operands.stride as usize;
    let q_at = operands.q_at as usize;
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
    // The first block's keys and values are in flight while the rows are loaded.
    let blocks = key_blocks(first, k_len, keys, causal);
    let mut k_next = Array::<f32>::new(comptime!((keys * dim + THREADS - 1) / THREADS));
    let mut v_next = Array::<f32>::new(comptime!((keys * dim + THREADS - 1) / THREADS));
    fetch_keys_values::<F>(
        k,
        v,
        &mut k_next,
        &mut v_next,
        b,
        h,
        0,
        k_len,
        &operands,
        keys,
        dim,
    );
    load_rows::<F>(
        q, &mut qs, b, h, first, q_len, q_at, stride, ROWS, dim, pitch,
    );
    load_rows::<F>(
        dout,
        &mut dos,
        b,
        h,
        first,
        q_len,
        0,
        heads * dim,
        ROWS,
        dim,
        pitch,
    );
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
    for block in 0..blocks {
        let base = block * keys;
        sync_cube();
        store_rows(&k_next, &mut ks, keys, dim, pitch);
        store_rows(&v_next, &mut vs, keys, dim, pitch);
        sync_cube();
        // The next block's keys and values, in flight while this block is worked on.
        if block + 1 < blocks {
            fetch_keys_values::<F>(
                k,
                v,
                &mut k_next,
                &mut v_next,
                b,
                h,
                base + keys,
                k_len,
                &operands,
                keys,
                dim,
            );
        }
        let mut j = t;
        while j < keys {
            let kj = base + j;
            let valid = i < q_len && kj < k_len;
            let mut s = dot(&qs, r * pitch, &ks, j * pitch, dim) * scale;
            let dp = dot(&dos, r * pitch, &vs, j * pitch, dim);
            let hide = valid && hidden(mask, &strides, b, h, i, kj, valid, masked, causal);
            if hide {
                s = fill;
            }
            let p = probability(s, row_lse, valid);
            ds[r * keys + j] = score_gradient(p, dp, row_delta, hide, valid);
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
            dq[q_at + (b * q_len + i) * stride + h * dim + d] =
                F::cast_from(acc[r * dim + d] * scale);
            d += GROUP;
        }
    }
}

/// dK and dV: keys `block * KEYS..` of batch `CUBE_POS_Z`, head `CUBE_POS_Y`.
#[cube(launch_unchecked)]
pub(in crate::cube) fn attention_key_grad_kernel<F: Float>(
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
    operands: Operands,
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
    let stride = operands.stride as usize;
    let (q_at, k_at, v_at) = (
        operands.q_at as usize,
        operands.k_at as usize,
        operands.v_at as usize,
    );
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
    // The first block's rows (queries, output gradients, their `lse` and `delta`; a unit per
    // row, `rows` <= THREADS) are in flight while the keys and values are loaded.
    let mut q_next = Array::<f32>::new(comptime!((rows * dim + THREADS - 1) / THREADS));
    let mut do_next = Array::<f32>::new(comptime!((rows * dim + THREADS - 1) / THREADS));
    fetch_rows::<F>(
        q,
        &mut q_next,
        b,
        h,
        start * rows,
        q_len,
        q_at,
        stride,
        rows,
        dim,
    );
    fetch_rows::<F>(
        dout,
        &mut do_next,
        b,
        h,
        start * rows,
        q_len,
        0,
        heads * dim,
        rows,
        dim,
    );
    let mut lse_next = row_value(lse, b, h, start * rows + UNIT_POS as usize, q_len, heads);
    let mut delta_next = row_value(delta, b, h, start * rows + UNIT_POS as usize, q_len, heads);
    load_rows::<F>(
        k, &mut ks, b, h, first, k_len, k_at, stride, KEYS, dim, pitch,
    );
    load_rows::<F>(
        v, &mut vs, b, h, first, k_len, v_at, stride, KEYS, dim, pitch,
    );
    let mut idx = unit;
    while idx < comptime!(KEYS * dim) {
        dk_acc[idx] = 0.0f32;
        dv_acc[idx] = 0.0f32;
        idx += THREADS;
    }
    for block in start..blocks {
        let base = block * rows;
        sync_cube();
        store_rows(&q_next, &mut qs, rows, dim, pitch);
        store_rows(&do_next, &mut dos, rows, dim, pitch);
        if unit < rows {
            lses[unit] = lse_next;
            deltas[unit] = delta_next;
        }
        sync_cube();
        // The next block's rows, in flight while this block is worked on.
        if block + 1 < blocks {
            fetch_rows::<F>(
                q,
                &mut q_next,
                b,
                h,
                base + rows,
                q_len,
                q_at,
                stride,
                rows,
                dim,
            );
            fetch_rows::<F>(
                dout,
                &mut do_next,
                b,
                h,
                base + rows,
                q_len,
                0,
                heads * dim,
                rows,
                dim,
            );
            lse_next = row_value(lse, b, h, base + rows + UNIT_POS as usize, q_len, heads);
            delta_next = row_value(delta, b, h, base + rows + UNIT_POS as usize, q_len, heads);
        }
        let mut ii = t;
        while ii < rows {
            let qi = base + ii;
            let valid = qi < q_len && kj < k_len;
            let mut s = dot(&qs, ii * pitch, &ks, j * pitch, dim) * scale;
            let dp = dot(&dos, ii * pitch, &vs, j * pitch, dim);
            let hide = valid && hidden(mask, &strides, b, h, qi, kj, valid, masked, causal);
            if hide {
                s = fill;
            }
            let p = probability(s, lses[ii], valid);
            ps[j * rows + ii] = p;
            ds[j * rows + ii] = score_gradient(p, dp, deltas[ii], hide, valid);
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
        let at = (b * k_len + kj) * stride + h * dim;
        let mut d = t;
        while d < dim {
            dk[k_at + at + d] = F::cast_from(dk_acc[j * dim + d] * scale);
            dv[v_at + at + d] = F::cast_from(dv_acc[j * dim + d]);
            d += GROUP;
        }
    }
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
