//! The attention kernels on tensor cores (`#[cube]`, `cmma`): the forward, dQ and dK/dV kernels
//! of `attention_kernels.rs` with every product as 16x16x16 tiles, for `f16` and `bf16` on a
//! device whose planes are [`LANES`] units and that multiplies such tiles of the dtype into
//! `f32` (CUDA). Launched by `attention_op.rs`, which states the arithmetic; the cases these
//! kernels do not take (`f32`, a head dimension not a multiple of 16) run the others.
//!
//! Work split: the forward's cube takes 16 query rows with [`SPLIT`] planes, each over its own
//! share of the keys, combined at the end; a dQ or dK/dV cube has [`PLANES`] planes, and a plane
//! takes 16 query rows (dQ) or 16 keys (dK and dV). Operands are staged in shared memory in the
//! dtype, in vectors of up to 16 bytes ([`staging_width`]); a plane's products land in
//! its own `f32` tiles in shared memory, where the two units of a row take the row's softmax or
//! gradient arithmetic in `f32`, its even and its odd columns, and combine through a plane
//! shuffle. Shared rows are padded by 16 bytes so that a plane's units, one row each, and a
//! tile's rows fall into different banks.
//! Rounding: the probabilities and the scores' gradients are rounded to the dtype before they
//! multiply (FlashAttention's choice; burn's composition rounds them too); every sum is `f32`.
//!
//! Over 600 lines: three kernels and the helpers only they use (staging, the tile product, the
//! block sizes), kept together as `attention_kernels.rs` keeps the CUDA-core three.

// Kernels take queries, keys, values, a mask, their shapes and compile-time choices: more
// arguments than clippy's default. Inside `#[cube]` functions a compile-time condition stays its
// own `if`, and division rounds up by hand (`div_ceil` is not a kernel operation). The tile
// loads and stores borrow a `slice` of shared memory as the `cmma` functions' examples do (the
// form that ran on the device).
#![allow(
    clippy::too_many_arguments,
    clippy::collapsible_if,
    clippy::manual_div_ceil,
    clippy::needless_borrow
)]

use cubecl::cmma::{self, MatrixIdent, MatrixLayout};
use cubecl::prelude::*;

use super::attention_kernels::{
    MaskStrides, Operands, mask_at, probability, row_value, score_gradient,
};

/// Units of a plane; the kernels need exactly this many (two per row of a 16-row tile).
pub(in crate::cube) const LANES: usize = 32;
/// Planes of a cube.
pub(in crate::cube) const PLANES: usize = 2;
/// The edge of a tensor-core tile; query rows of a forward cube.
pub(in crate::cube) const TILE: usize = 16;
/// Query rows of a dQ cube, keys of a dK/dV cube; the unit of `fills_device`'s count.
pub(in crate::cube) const BLOCK: usize = PLANES * TILE;
/// Units of a dQ or dK/dV cube.
const UNITS: usize = PLANES * LANES;
/// Planes of a forward cube: they share its 16 query rows, each taking every `SPLIT`th block
/// of keys, and combine their rows' partial softmaxes at the end.
pub(in crate::cube) const SPLIT: usize = 4;
/// Units of a forward cube.
const FORWARD_UNITS: usize = SPLIT * LANES;
/// The largest head dimension taken.
const MAX_DIM: usize = 64;
/// The most shared memory a cube asks for (bytes), 1 KiB below CUDA's static limit of 48 KiB.
const MAX_SHARED: usize = 47 * 1024;
/// Alignment of shared arrays (bytes): a tile's load and store need 32.
const ALIGN: usize = 32;
/// Padding of a shared row (elements): 16 bytes in the 2-byte dtype (8) and in `f32` (4), the
/// least a tile's row stride may step by. Unpadded, the rows of a tile (64 or 128 bytes apart)
/// start in the same banks and the units of a plane, one row pair each, read one bank at once.
const PAD: usize = 8;
const PAD32: usize = 4;
/// Elements of the widest staging load and store: 16 bytes of the 2-byte dtype, one
/// instruction each way where a scalar copy takes eight.
const VECTOR: usize = 8;

/// The block sizes of the three kernels for a head dimension: keys streamed per step of the
/// forward and of the dQ kernel, query rows per step of the dK/dV kernel. Powers of two from
/// [`TILE`] to 64, the largest whose shared arrays fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::cube) struct TensorBlocks {
    /// Keys per step of the forward.
    pub(in crate::cube) forward_keys: usize,
    /// Keys per step of the dQ kernel.
    pub(in crate::cube) grad_keys: usize,
    /// Query rows per step of the dK/dV kernel.
    pub(in crate::cube) rows: usize,
}

impl TensorBlocks {
    /// The blocks for head dimension `dim` within `shared` bytes per cube, or `None` where `dim`
    /// is not a multiple of [`TILE`] up to [`MAX_DIM`] or the smallest blocks do not fit.
    pub(in crate::cube) fn for_dim(dim: usize, shared: usize) -> Option<Self> {
        if dim == 0 || !dim.is_multiple_of(TILE) || dim > MAX_DIM {
            return None;
        }
        let budget = shared.min(MAX_SHARED);
        // Bytes of the kernels' shared arrays (padded rows): operands in the 2-byte dtype,
        // products and accumulators in f32.
        let (op, acc) = (dim + PAD, (dim + PAD32) * 4);
        let scores = |n: usize| (n + PAD32) * 4;
        let weights = |n: usize| (n + PAD) * 2;
        // The forward: a tile of queries, and per plane a block of keys and values, its
        // scores, weights, output accumulator and its rows' two statistics.
        let forward = |keys: usize| {
            2 * (TILE + SPLIT * 2 * keys) * op
                + SPLIT * TILE * (scores(keys) + weights(keys) + acc + 8)
        };
        let query = |keys: usize| {
            2 * (2 * BLOCK + 2 * keys) * op + BLOCK * (2 * scores(keys) + weights(keys) + acc)
        };
        let key = |rows: usize| {
            2 * (2 * BLOCK + 2 * rows) * op
                + 8 * rows
                + BLOCK * (2 * scores(rows) + 2 * weights(rows) + 2 * acc)
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

/// The elements one staging load and store moves, for head dimension `dim` and operands whose
/// rows and buffers start at multiples of `aligned` elements: the widest of [`VECTOR`], 4, 2
/// and 1 that divides both, so that a vector lies whole in one row, aligned to its size.
pub(in crate::cube) fn staging_width(dim: usize, aligned: usize) -> usize {
    [VECTOR, 4, 2]
        .into_iter()
        .find(|&w| aligned.is_multiple_of(w) && dim.is_multiple_of(w))
        .unwrap_or(1)
}

/// Vectors of `width` elements a unit stages of `count` rows of `dim` among `units` units:
/// rounded up, so that the last round leaves some units without one where `units` does not
/// divide the rows' vectors.
fn share(count: usize, dim: usize, width: usize, units: usize) -> usize {
    (count * dim / width).div_ceil(units)
}

/// Loads unit `unit`'s share (of `units` units, [`share`] vectors of `W` elements) of `count`
/// rows of `source` (rows `first..` of batch `b`, head `h`, laid out as [`Operands`] says with
/// `at` and `stride`; rows past `len` as 0) into `values`, every load issued before any is
/// used: the unrolled loop keeps them in flight together, and a caller that stores them later
/// (`store_rows`) overlaps their latency with its work in between. A vector never crosses a
/// row: `W` divides `dim`, `at`, `stride` and the buffer's start ([`staging_width`]).
#[cube]
fn load_rows<F: Float, W: Size>(
    source: &[F],
    values: &mut Array<Vector<F, W>>,
    b: usize,
    h: usize,
    first: usize,
    len: usize,
    at: usize,
    stride: usize,
    unit: usize,
    #[comptime] units: usize,
    #[comptime] count: usize,
    #[comptime] dim: usize,
) {
    let width = W::value().comptime();
    let vectors = comptime!(count * dim / width);
    let lines = source.as_vectorized().with_vector_size::<W>();
    #[unroll]
    for n in 0..comptime!(share(count, dim, width, units)) {
        let vector = unit + n * units;
        let idx = vector * width;
        let row = first + idx / dim;
        let mut inside = row < len;
        if comptime!(!vectors.is_multiple_of(units)) {
            inside = inside && vector < vectors;
        }
        let mut value = Vector::<F, W>::zeroed();
        if inside {
            value = lines[(at + (b * len + row) * stride + h * dim + idx % dim) / width];
        }
        values[n] = value;
    }
}

/// The keys and values of one block: `load_rows` of `k` and of `v` (rows `first..` of batch `b`, head
/// `h`, rows past `k_len` as 0), laid out as `operands` says, into `k_next` and `v_next`.
#[cube]
fn load_keys_values<F: Float, W: Size>(
    k: &[F],
    v: &[F],
    k_next: &mut Array<Vector<F, W>>,
    v_next: &mut Array<Vector<F, W>>,
    b: usize,
    h: usize,
    first: usize,
    k_len: usize,
    operands: &Operands,
    unit: usize,
    #[comptime] units: usize,
    #[comptime] keys: usize,
    #[comptime] dim: usize,
) {
    let stride = operands.stride as usize;
    load_rows::<F, W>(
        k,
        k_next,
        b,
        h,
        first,
        k_len,
        operands.k_at as usize,
        stride,
        unit,
        units,
        keys,
        dim,
    );
    load_rows::<F, W>(
        v,
        v_next,
        b,
        h,
        first,
        k_len,
        operands.v_at as usize,
        stride,
        unit,
        units,
        keys,
        dim,
    );
}

/// Stores a share `load_rows` loaded (unit `unit` of `units`) into `target` from element `to`
/// on, rows `dim + PAD` apart (`W` divides both and `to`, and the shared arrays are
/// [`ALIGN`]ed: every vector lands whole and aligned).
#[cube]
fn store_rows<F: Float, W: Size>(
    values: &Array<Vector<F, W>>,
    target: &mut Shared<[F]>,
    to: usize,
    unit: usize,
    #[comptime] units: usize,
    #[comptime] count: usize,
    #[comptime] dim: usize,
) {
    let width = W::value().comptime();
    let vectors = comptime!(count * dim / width);
    let lines = target.as_vectorized_mut().with_vector_size_mut::<W>();
    #[unroll]
    for n in 0..comptime!(share(count, dim, width, units)) {
        let vector = unit + n * units;
        let idx = vector * width;
        let at = (to + (idx / dim) * comptime!(dim + PAD) + idx % dim) / width;
        let mut inside = true;
        if comptime!(!vectors.is_multiple_of(units)) {
            inside = vector < vectors;
        }
        if inside {
            lines[at] = values[n];
        }
    }
}

/// Stages `count` rows of `source` in `target` at once (`load_rows` then `store_rows`), the
/// whole cube's units taking part.
#[cube]
fn stage_rows<F: Float, W: Size>(
    source: &[F],
    target: &mut Shared<[F]>,
    b: usize,
    h: usize,
    first: usize,
    len: usize,
    at: usize,
    stride: usize,
    #[comptime] units: usize,
    #[comptime] count: usize,
    #[comptime] dim: usize,
) {
    let width = W::value().comptime();
    let unit = UNIT_POS as usize;
    let mut values = Array::<Vector<F, W>>::new(comptime!(share(count, dim, width, units)));
    load_rows::<F, W>(
        source,
        &mut values,
        b,
        h,
        first,
        len,
        at,
        stride,
        unit,
        units,
        count,
        dim,
    );
    store_rows::<F, W>(&values, target, 0, unit, units, count, dim);
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

/// Loads, with `masked`, the mask entries this unit meets in a block of `count` (a row's keys or
/// a key's rows), every load issued before any is used (see `load_rows`): its `count / 2`
/// entries `base + 2c + half` along the block, at query row `fixed` (`by_row`) or key `fixed`
/// (otherwise), into `values`; 0 where the row or the key is out of range.
#[cube]
fn fetch_mask(
    mask: &[i32],
    strides: &MaskStrides,
    values: &mut Array<i32>,
    b: usize,
    h: usize,
    fixed: usize,
    base: usize,
    half: usize,
    q_len: usize,
    k_len: usize,
    #[comptime] count: usize,
    #[comptime] by_row: bool,
    #[comptime] masked: bool,
) {
    if masked {
        #[unroll]
        for c in 0..comptime!(count / 2) {
            let along = base + 2 * c + half;
            let mut value = 0i32;
            if by_row {
                if fixed < q_len && along < k_len {
                    value = mask[mask_at(strides, b, h, fixed, along)];
                }
            } else {
                if along < q_len && fixed < k_len {
                    value = mask[mask_at(strides, b, h, along, fixed)];
                }
            }
            values[c] = value;
        }
    }
}

/// The entries `fetch_mask` loaded as bits (bit `c`: entry `c` hides its key); 0 without
/// `masked`. `count / 2` is at most 32 (blocks of at most 64).
#[cube]
fn mask_bits(values: &Array<i32>, #[comptime] count: usize, #[comptime] masked: bool) -> u32 {
    let mut bits = 0u32;
    if masked {
        #[unroll]
        for c in 0..comptime!(count / 2) {
            if values[c] != 0i32 {
                bits |= 1u32 << (c as u32);
            }
        }
    }
    bits
}

/// Whether entry `c` of a unit's block is hidden: by the mask's `bits` (`mask_bits`), or with
/// `causal` by key `kj` coming after query row `i`.
#[cube]
fn hides(
    bits: u32,
    c: usize,
    i: usize,
    kj: usize,
    #[comptime] masked: bool,
    #[comptime] causal: bool,
) -> bool {
    let mut hide = false;
    if causal {
        hide = kj > i;
    }
    if masked {
        hide = hide || ((bits >> (c as u32)) & 1u32) != 0u32;
    }
    hide
}

/// Key blocks of `keys` a query block `first..first + rows` reads: every block of `k_len`
/// keys, or with `causal` those up to its last row.
#[cube]
fn key_blocks(
    first: usize,
    k_len: usize,
    #[comptime] rows: usize,
    #[comptime] keys: usize,
    #[comptime] causal: bool,
) -> usize {
    let mut last = k_len;
    if causal {
        if first + rows < k_len {
            last = first + rows;
        }
    }
    (last + keys - 1) / keys
}

/// Forward: rows `CUBE_POS_X * TILE..` of batch `CUBE_POS_Z`, head `CUBE_POS_Y`: `out` and
/// `lse`, as `attention_kernels::forward_kernel`. Plane `p` of the [`SPLIT`] takes the key
/// blocks `p, p + SPLIT, ..`: its own running softmax over them (the unit pair of a row takes
/// its even and its odd columns) into its own output accumulator; at the end the cube combines
/// the planes' rows (`exp(m_p - m)` each, `m` the largest of their maxima). A plane's chain of
/// dependent work is a `SPLIT`th of a whole row's, and a cube of 16 rows leaves four times the
/// planes of 32-row cubes on the device to hide each other's latency.
#[cube(launch_unchecked)]
pub(in crate::cube) fn attention_forward_tc_kernel<F: Float>(
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
    #[comptime] width: usize,
    #[comptime] keys: usize,
    #[comptime] masked: bool,
    #[comptime] causal: bool,
    #[comptime] quiet: bool,
    #[define(F)] _dtype: ElemType,
) {
    // The staged operands move `width` elements a load and a store.
    let size!(W) = width;
    let q_len = q_len as usize;
    let k_len = k_len as usize;
    let heads = heads as usize;
    let stride = operands.stride as usize;
    let q_at = operands.q_at as usize;
    let h = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let first = CUBE_POS_X as usize * TILE;
    let plane = UNIT_POS_Y as usize;
    let lane = UNIT_POS_X as usize;
    let r = lane / 2;
    let half = lane % 2;
    let i = first + r;
    // Row pitches: operands, scores, weights, the output's accumulator.
    let op = comptime!(dim + PAD);
    let sp = comptime!(keys + PAD32);
    let pp = comptime!(keys + PAD);
    let ap = comptime!(dim + PAD32);
    let mut qs = Shared::<[F]>::new_aligned_slice(comptime!(TILE * (dim + PAD)), ALIGN);
    let mut ks = Shared::<[F]>::new_aligned_slice(comptime!(SPLIT * keys * (dim + PAD)), ALIGN);
    let mut vs = Shared::<[F]>::new_aligned_slice(comptime!(SPLIT * keys * (dim + PAD)), ALIGN);
    let mut ss =
        Shared::<[f32]>::new_aligned_slice(comptime!(SPLIT * TILE * (keys + PAD32)), ALIGN);
    let mut ps = Shared::<[F]>::new_aligned_slice(comptime!(SPLIT * TILE * (keys + PAD)), ALIGN);
    let mut os = Shared::<[f32]>::new_aligned_slice(comptime!(SPLIT * TILE * (dim + PAD32)), ALIGN);
    let mut stats = Shared::<[f32]>::new_slice(comptime!(SPLIT * TILE * 2));
    // This plane's regions of the shared arrays.
    let kv_at = plane * keys * op;
    let s_at = plane * TILE * sp;
    let p_at = plane * TILE * pp;
    let o_at = plane * TILE * ap;
    let blocks = key_blocks(first, k_len, TILE, keys, causal);
    let mut steps = 0usize;
    if plane < blocks {
        steps = (blocks - plane + SPLIT - 1) / SPLIT;
    }
    // The plane's first block's keys and values are in flight while the queries are staged.
    let mut k_next = Array::<Vector<F, W>>::new(comptime!(share(keys, dim, width, LANES)));
    let mut v_next = Array::<Vector<F, W>>::new(comptime!(share(keys, dim, width, LANES)));
    let mut mask_next = Array::<i32>::new(comptime!(keys / 2));
    if steps > 0 {
        load_keys_values::<F, W>(
            k,
            v,
            &mut k_next,
            &mut v_next,
            b,
            h,
            plane * keys,
            k_len,
            &operands,
            lane,
            LANES,
            keys,
            dim,
        );
        fetch_mask(
            mask,
            &strides,
            &mut mask_next,
            b,
            h,
            i,
            plane * keys,
            half,
            q_len,
            k_len,
            keys,
            true,
            masked,
        );
    }
    stage_rows::<F, W>(
        q,
        &mut qs,
        b,
        h,
        first,
        q_len,
        q_at,
        stride,
        FORWARD_UNITS,
        TILE,
        dim,
    );
    for c in 0..comptime!(dim / 2) {
        os[o_at + r * ap + 2 * c + half] = 0.0f32;
    }
    // The quiet softmax's virtual score 0, counted once (plane 0): running maximum 0, running
    // sum exp(0 - 0).
    let mut row_max = f32::min_value();
    let mut row_sum = 0.0f32;
    if quiet {
        if plane == 0 {
            row_max = 0.0f32;
            row_sum = 1.0f32;
        }
    }
    sync_cube();
    for step in 0..steps {
        let block = plane + step * SPLIT;
        let base = block * keys;
        store_rows::<F, W>(&k_next, &mut ks, kv_at, lane, LANES, keys, dim);
        store_rows::<F, W>(&v_next, &mut vs, kv_at, lane, LANES, keys, dim);
        let bits = mask_bits(&mask_next, keys, masked);
        sync_plane();
        // The plane's next block's keys, values and mask entries, in flight while this block
        // is worked on.
        if step + 1 < steps {
            let next = base + SPLIT * keys;
            load_keys_values::<F, W>(
                k,
                v,
                &mut k_next,
                &mut v_next,
                b,
                h,
                next,
                k_len,
                &operands,
                lane,
                LANES,
                keys,
                dim,
            );
            fetch_mask(
                mask,
                &strides,
                &mut mask_next,
                b,
                h,
                i,
                next,
                half,
                q_len,
                k_len,
                keys,
                true,
                masked,
            );
        }
        // The plane's scores: the 16 rows of q times its block's keys.
        #[unroll]
        for n in 0..comptime!(keys / TILE) {
            product_tile::<F>(
                &qs,
                0,
                op,
                TILE,
                &ks,
                kv_at + n * TILE * op,
                op,
                TILE,
                &mut ss,
                s_at + n * TILE,
                sp,
                comptime!(dim / TILE),
                MatrixLayout::ColMajor,
                false,
            );
        }
        sync_plane();
        let mut high = f32::min_value();
        for c in 0..comptime!(keys / 2) {
            let j = 2 * c + half;
            let kj = base + j;
            let valid = i < q_len && kj < k_len;
            let mut s = ss[s_at + r * sp + j] * scale;
            if valid && hides(bits, c, i, kj, masked, causal) {
                s = fill;
            }
            if kj < k_len {
                high = f32::max(high, s);
            }
            ss[s_at + r * sp + j] = s;
        }
        let new_max = f32::max(row_max, f32::max(high, plane_shuffle_xor(high, 1)));
        let mut part = 0.0f32;
        for c in 0..comptime!(keys / 2) {
            let j = 2 * c + half;
            let mut p = 0.0f32;
            if base + j < k_len {
                p = (ss[s_at + r * sp + j] - new_max).exp();
            }
            ps[p_at + r * pp + j] = F::cast_from(p);
            part += p;
        }
        let block_sum = part + plane_shuffle_xor(part, 1);
        let alpha = (row_max - new_max).exp();
        row_sum = row_sum * alpha + block_sum;
        row_max = new_max;
        for c in 0..comptime!(dim / 2) {
            os[o_at + r * ap + 2 * c + half] *= alpha;
        }
        sync_plane();
        // The plane's output rows += its weights times its block's values.
        #[unroll]
        for n in 0..comptime!(dim / TILE) {
            product_tile::<F>(
                &ps,
                p_at,
                pp,
                TILE,
                &vs,
                kv_at + n * TILE,
                op,
                TILE * op,
                &mut os,
                o_at + n * TILE,
                ap,
                comptime!(keys / TILE),
                MatrixLayout::RowMajor,
                true,
            );
        }
        sync_plane();
    }
    if half == 0 {
        stats[(plane * TILE + r) * 2] = row_max;
        stats[(plane * TILE + r) * 2 + 1] = row_sum;
    }
    sync_cube();
    // The combine: the cube's units in eights, one eight a row, each unit `dim / 8` of its
    // columns. The planes' parts of a row, scaled to the largest of their maxima, summed.
    let unit = UNIT_POS as usize;
    let row = unit / comptime!(FORWARD_UNITS / TILE);
    let part = unit % comptime!(FORWARD_UNITS / TILE);
    let ci = first + row;
    let mut m = f32::min_value();
    #[unroll]
    for p in 0..SPLIT {
        m = f32::max(m, stats[(p * TILE + row) * 2]);
    }
    let mut weights = Array::<f32>::new(SPLIT);
    let mut total = 0.0f32;
    #[unroll]
    for p in 0..SPLIT {
        let w = (stats[(p * TILE + row) * 2] - m).exp();
        weights[p] = w;
        total += stats[(p * TILE + row) * 2 + 1] * w;
    }
    if ci < q_len {
        // Every key hidden by -inf: no weight anywhere, the row is 0 (as burn's attention).
        let mut inv = 0.0f32;
        if total > 0.0f32 {
            inv = 1.0f32 / total;
        }
        let at = ((b * q_len + ci) * heads + h) * dim;
        let columns = comptime!(dim / (FORWARD_UNITS / TILE));
        #[unroll]
        for c in 0..columns {
            let d = part * columns + c;
            let mut o = 0.0f32;
            #[unroll]
            for p in 0..SPLIT {
                o += os[(p * TILE + row) * ap + d] * weights[p];
            }
            out[at + d] = F::cast_from(o * inv);
        }
        if part == 0 {
            lse[(b * q_len + ci) * heads + h] = m + total.ln();
        }
    }
}

/// dQ and `delta`: rows `CUBE_POS_X * BLOCK..` of batch `CUBE_POS_Z`, head `CUBE_POS_Y`, as
/// `attention_kernels::query_grad_kernel`.
#[cube(launch_unchecked)]
pub(in crate::cube) fn attention_query_grad_tc_kernel<F: Float>(
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
    #[comptime] width: usize,
    #[comptime] keys: usize,
    #[comptime] masked: bool,
    #[comptime] causal: bool,
    #[define(F)] _dtype: ElemType,
) {
    // The staged operands move `width` elements a load and a store.
    let size!(W) = width;
    let q_len = q_len as usize;
    let k_len = k_len as usize;
    let heads = heads as usize;
    let stride = operands.stride as usize;
    let q_at = operands.q_at as usize;
    let h = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let first = CUBE_POS_X as usize * BLOCK;
    let plane = UNIT_POS_Y as usize;
    let lane = UNIT_POS_X as usize;
    let r = plane * TILE + lane / 2;
    let half = lane % 2;
    let i = first + r;
    let op = comptime!(dim + PAD);
    let sp = comptime!(keys + PAD32);
    let pp = comptime!(keys + PAD);
    let ap = comptime!(dim + PAD32);
    let mut qs = Shared::<[F]>::new_aligned_slice(comptime!(BLOCK * (dim + PAD)), ALIGN);
    let mut dos = Shared::<[F]>::new_aligned_slice(comptime!(BLOCK * (dim + PAD)), ALIGN);
    let mut ks = Shared::<[F]>::new_aligned_slice(comptime!(keys * (dim + PAD)), ALIGN);
    let mut vs = Shared::<[F]>::new_aligned_slice(comptime!(keys * (dim + PAD)), ALIGN);
    let mut ss = Shared::<[f32]>::new_aligned_slice(comptime!(BLOCK * (keys + PAD32)), ALIGN);
    let mut dps = Shared::<[f32]>::new_aligned_slice(comptime!(BLOCK * (keys + PAD32)), ALIGN);
    let mut dss = Shared::<[F]>::new_aligned_slice(comptime!(BLOCK * (keys + PAD)), ALIGN);
    let mut acc = Shared::<[f32]>::new_aligned_slice(comptime!(BLOCK * (dim + PAD32)), ALIGN);
    // The first block's keys and values are in flight while the rows are staged.
    let blocks = key_blocks(first, k_len, BLOCK, keys, causal);
    let mut k_next = Array::<Vector<F, W>>::new(comptime!(share(keys, dim, width, UNITS)));
    let mut v_next = Array::<Vector<F, W>>::new(comptime!(share(keys, dim, width, UNITS)));
    let mut mask_next = Array::<i32>::new(comptime!(keys / 2));
    load_keys_values::<F, W>(
        k,
        v,
        &mut k_next,
        &mut v_next,
        b,
        h,
        0,
        k_len,
        &operands,
        UNIT_POS as usize,
        UNITS,
        keys,
        dim,
    );
    fetch_mask(
        mask,
        &strides,
        &mut mask_next,
        b,
        h,
        i,
        0,
        half,
        q_len,
        k_len,
        keys,
        true,
        masked,
    );
    stage_rows::<F, W>(
        q, &mut qs, b, h, first, q_len, q_at, stride, UNITS, BLOCK, dim,
    );
    stage_rows::<F, W>(
        dout,
        &mut dos,
        b,
        h,
        first,
        q_len,
        0,
        heads * dim,
        UNITS,
        BLOCK,
        dim,
    );
    for c in 0..comptime!(dim / 2) {
        acc[r * ap + 2 * c + half] = 0.0f32;
    }
    let row = (b * q_len + i) * heads + h;
    let mut part = 0.0f32;
    let mut row_lse = 0.0f32;
    if i < q_len {
        #[unroll]
        for c in 0..comptime!(dim / 2) {
            let at = row * dim + 2 * c + half;
            part += f32::cast_from(dout[at]) * f32::cast_from(out[at]);
        }
        row_lse = lse[row];
    }
    let row_delta = part + plane_shuffle_xor(part, 1);
    if i < q_len && half == 0 {
        delta[row] = row_delta;
    }
    for block in 0..blocks {
        let base = block * keys;
        sync_cube();
        store_rows::<F, W>(&k_next, &mut ks, 0, UNIT_POS as usize, UNITS, keys, dim);
        store_rows::<F, W>(&v_next, &mut vs, 0, UNIT_POS as usize, UNITS, keys, dim);
        let bits = mask_bits(&mask_next, keys, masked);
        sync_cube();
        // The next block's keys, values and mask entries, in flight while this block is worked
        // on.
        if block + 1 < blocks {
            let next = base + keys;
            load_keys_values::<F, W>(
                k,
                v,
                &mut k_next,
                &mut v_next,
                b,
                h,
                next,
                k_len,
                &operands,
                UNIT_POS as usize,
                UNITS,
                keys,
                dim,
            );
            fetch_mask(
                mask,
                &strides,
                &mut mask_next,
                b,
                h,
                i,
                next,
                half,
                q_len,
                k_len,
                keys,
                true,
                masked,
            );
        }
        // The plane's scores (q k^T) and the output gradient's products with the values (dO v^T).
        #[unroll]
        for n in 0..comptime!(keys / TILE) {
            product_tile::<F>(
                &qs,
                plane * TILE * op,
                op,
                TILE,
                &ks,
                n * TILE * op,
                op,
                TILE,
                &mut ss,
                plane * TILE * sp + n * TILE,
                sp,
                comptime!(dim / TILE),
                MatrixLayout::ColMajor,
                false,
            );
            product_tile::<F>(
                &dos,
                plane * TILE * op,
                op,
                TILE,
                &vs,
                n * TILE * op,
                op,
                TILE,
                &mut dps,
                plane * TILE * sp + n * TILE,
                sp,
                comptime!(dim / TILE),
                MatrixLayout::ColMajor,
                false,
            );
        }
        sync_plane();
        for c in 0..comptime!(keys / 2) {
            let j = 2 * c + half;
            let kj = base + j;
            let valid = i < q_len && kj < k_len;
            let mut s = ss[r * sp + j] * scale;
            let hide = valid && hides(bits, c, i, kj, masked, causal);
            if hide {
                s = fill;
            }
            let p = probability(s, row_lse, valid);
            let grad = score_gradient(p, dps[r * sp + j], row_delta, hide, valid);
            dss[r * pp + j] = F::cast_from(grad);
        }
        sync_plane();
        // dQ += dS k.
        #[unroll]
        for n in 0..comptime!(dim / TILE) {
            product_tile::<F>(
                &dss,
                plane * TILE * pp,
                pp,
                TILE,
                &ks,
                n * TILE,
                op,
                TILE * op,
                &mut acc,
                plane * TILE * ap + n * TILE,
                ap,
                comptime!(keys / TILE),
                MatrixLayout::RowMajor,
                true,
            );
        }
        sync_plane();
    }
    if i < q_len {
        for c in 0..comptime!(dim / 2) {
            let d = 2 * c + half;
            dq[q_at + (b * q_len + i) * stride + h * dim + d] =
                F::cast_from(acc[r * ap + d] * scale);
        }
    }
}

/// dK and dV: keys `CUBE_POS_X * BLOCK..` of batch `CUBE_POS_Z`, head `CUBE_POS_Y`, as
/// `attention_kernels::key_grad_kernel`.
#[cube(launch_unchecked)]
pub(in crate::cube) fn attention_key_grad_tc_kernel<F: Float>(
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
    #[comptime] width: usize,
    #[comptime] rows: usize,
    #[comptime] masked: bool,
    #[comptime] causal: bool,
    #[define(F)] _dtype: ElemType,
) {
    // The staged operands move `width` elements a load and a store.
    let size!(W) = width;
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
    let first = CUBE_POS_X as usize * BLOCK;
    let unit = UNIT_POS as usize;
    let plane = UNIT_POS_Y as usize;
    let lane = UNIT_POS_X as usize;
    let j = plane * TILE + lane / 2;
    let half = lane % 2;
    let kj = first + j;
    let op = comptime!(dim + PAD);
    let sp = comptime!(rows + PAD32);
    let pp = comptime!(rows + PAD);
    let ap = comptime!(dim + PAD32);
    let mut ks = Shared::<[F]>::new_aligned_slice(comptime!(BLOCK * (dim + PAD)), ALIGN);
    let mut vs = Shared::<[F]>::new_aligned_slice(comptime!(BLOCK * (dim + PAD)), ALIGN);
    let mut qs = Shared::<[F]>::new_aligned_slice(comptime!(rows * (dim + PAD)), ALIGN);
    let mut dos = Shared::<[F]>::new_aligned_slice(comptime!(rows * (dim + PAD)), ALIGN);
    let mut sts = Shared::<[f32]>::new_aligned_slice(comptime!(BLOCK * (rows + PAD32)), ALIGN);
    let mut dpts = Shared::<[f32]>::new_aligned_slice(comptime!(BLOCK * (rows + PAD32)), ALIGN);
    let mut pts = Shared::<[F]>::new_aligned_slice(comptime!(BLOCK * (rows + PAD)), ALIGN);
    let mut dsts = Shared::<[F]>::new_aligned_slice(comptime!(BLOCK * (rows + PAD)), ALIGN);
    let mut dk_acc = Shared::<[f32]>::new_aligned_slice(comptime!(BLOCK * (dim + PAD32)), ALIGN);
    let mut dv_acc = Shared::<[f32]>::new_aligned_slice(comptime!(BLOCK * (dim + PAD32)), ALIGN);
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
    // row, `rows` <= UNITS) are in flight while the keys and values are staged.
    let mut q_next = Array::<Vector<F, W>>::new(comptime!(share(rows, dim, width, UNITS)));
    let mut do_next = Array::<Vector<F, W>>::new(comptime!(share(rows, dim, width, UNITS)));
    let mut mask_next = Array::<i32>::new(comptime!(rows / 2));
    let first_row = start * rows;
    load_rows::<F, W>(
        q,
        &mut q_next,
        b,
        h,
        first_row,
        q_len,
        q_at,
        stride,
        unit,
        UNITS,
        rows,
        dim,
    );
    load_rows::<F, W>(
        dout,
        &mut do_next,
        b,
        h,
        first_row,
        q_len,
        0,
        heads * dim,
        unit,
        UNITS,
        rows,
        dim,
    );
    fetch_mask(
        mask,
        &strides,
        &mut mask_next,
        b,
        h,
        kj,
        first_row,
        half,
        q_len,
        k_len,
        rows,
        false,
        masked,
    );
    let mut lse_next = row_value(lse, b, h, first_row, q_len, heads);
    let mut delta_next = row_value(delta, b, h, first_row, q_len, heads);
    stage_rows::<F, W>(
        k, &mut ks, b, h, first, k_len, k_at, stride, UNITS, BLOCK, dim,
    );
    stage_rows::<F, W>(
        v, &mut vs, b, h, first, k_len, v_at, stride, UNITS, BLOCK, dim,
    );
    for c in 0..comptime!(dim / 2) {
        dk_acc[j * ap + 2 * c + half] = 0.0f32;
        dv_acc[j * ap + 2 * c + half] = 0.0f32;
    }
    for block in start..blocks {
        let base = block * rows;
        sync_cube();
        store_rows::<F, W>(&q_next, &mut qs, 0, unit, UNITS, rows, dim);
        store_rows::<F, W>(&do_next, &mut dos, 0, unit, UNITS, rows, dim);
        if unit < rows {
            lses[unit] = lse_next;
            deltas[unit] = delta_next;
        }
        let bits = mask_bits(&mask_next, rows, masked);
        sync_cube();
        // The next block's rows and mask entries, in flight while this block is worked on.
        if block + 1 < blocks {
            let next = base + rows;
            load_rows::<F, W>(
                q,
                &mut q_next,
                b,
                h,
                next,
                q_len,
                q_at,
                stride,
                unit,
                UNITS,
                rows,
                dim,
            );
            load_rows::<F, W>(
                dout,
                &mut do_next,
                b,
                h,
                next,
                q_len,
                0,
                heads * dim,
                unit,
                UNITS,
                rows,
                dim,
            );
            fetch_mask(
                mask,
                &strides,
                &mut mask_next,
                b,
                h,
                kj,
                next,
                half,
                q_len,
                k_len,
                rows,
                false,
                masked,
            );
            lse_next = row_value(lse, b, h, next, q_len, heads);
            delta_next = row_value(delta, b, h, next, q_len, heads);
        }
        // The plane's transposed scores (k q^T) and (v dO^T).
        #[unroll]
        for n in 0..comptime!(rows / TILE) {
            product_tile::<F>(
                &ks,
                plane * TILE * op,
                op,
                TILE,
                &qs,
                n * TILE * op,
                op,
                TILE,
                &mut sts,
                plane * TILE * sp + n * TILE,
                sp,
                comptime!(dim / TILE),
                MatrixLayout::ColMajor,
                false,
            );
            product_tile::<F>(
                &vs,
                plane * TILE * op,
                op,
                TILE,
                &dos,
                n * TILE * op,
                op,
                TILE,
                &mut dpts,
                plane * TILE * sp + n * TILE,
                sp,
                comptime!(dim / TILE),
                MatrixLayout::ColMajor,
                false,
            );
        }
        sync_plane();
        for c in 0..comptime!(rows / 2) {
            let ii = 2 * c + half;
            let qi = base + ii;
            let valid = qi < q_len && kj < k_len;
            let mut s = sts[j * sp + ii] * scale;
            let hide = valid && hides(bits, c, qi, kj, masked, causal);
            if hide {
                s = fill;
            }
            let p = probability(s, lses[ii], valid);
            pts[j * pp + ii] = F::cast_from(p);
            let grad = score_gradient(p, dpts[j * sp + ii], deltas[ii], hide, valid);
            dsts[j * pp + ii] = F::cast_from(grad);
        }
        sync_plane();
        // dV += P^T dO, dK += dS^T q.
        #[unroll]
        for n in 0..comptime!(dim / TILE) {
            product_tile::<F>(
                &pts,
                plane * TILE * pp,
                pp,
                TILE,
                &dos,
                n * TILE,
                op,
                TILE * op,
                &mut dv_acc,
                plane * TILE * ap + n * TILE,
                ap,
                comptime!(rows / TILE),
                MatrixLayout::RowMajor,
                true,
            );
            product_tile::<F>(
                &dsts,
                plane * TILE * pp,
                pp,
                TILE,
                &qs,
                n * TILE,
                op,
                TILE * op,
                &mut dk_acc,
                plane * TILE * ap + n * TILE,
                ap,
                comptime!(rows / TILE),
                MatrixLayout::RowMajor,
                true,
            );
        }
        sync_plane();
    }
    if kj < k_len {
        let at = (b * k_len + kj) * stride + h * dim;
        for c in 0..comptime!(dim / 2) {
            let d = 2 * c + half;
            dk[k_at + at + d] = F::cast_from(dk_acc[j * ap + d] * scale);
            dv[v_at + at + d] = F::cast_from(dv_acc[j * ap + d]);
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
                forward_keys: 32,
                grad_keys: 64,
                rows: 32
            })
        );
        assert_eq!(
            TensorBlocks::for_dim(64, cuda),
            Some(TensorBlocks {
                forward_keys: 16,
                grad_keys: 32,
                rows: 16
            })
        );
        // Not a multiple of the tile, none, or too large.
        assert_eq!(TensorBlocks::for_dim(8, cuda), None);
        assert_eq!(TensorBlocks::for_dim(0, cuda), None);
        assert_eq!(TensorBlocks::for_dim(80, cuda), None);
    }

    #[test]
    fn staging_width_keeps_vectors_whole_and_aligned() {
        // The bench's heads (32) on aligned operands: 16-byte vectors.
        assert_eq!(staging_width(32, 768), 8);
        assert_eq!(staging_width(64, 0), 8);
        // An operand 4 elements off a 16-byte boundary: 8-byte vectors.
        assert_eq!(staging_width(32, 4), 4);
        // Odd alignment: one element at a time.
        assert_eq!(staging_width(32, 3), 1);
        assert_eq!(staging_width(32, 6), 2);
    }

    #[test]
    fn shares_cover_every_vector_once() {
        // 16 rows of 32 in 8-element vectors among a forward cube's 128 units: 64 vectors,
        // one round, half the units idle; among a plane's 32: two rounds each.
        assert_eq!(share(TILE, 32, 8, FORWARD_UNITS), 1);
        assert_eq!(share(32, 32, 8, LANES), 4);
        assert_eq!(share(16, 48, 8, UNITS), 2);
        for (count, dim, width, units) in [(16, 48, 8, 64), (16, 16, 8, 128), (64, 32, 1, 64)] {
            let rounds = share(count, dim, width, units);
            let vectors = count * dim / width;
            assert!(rounds * units >= vectors && (rounds - 1) * units < vectors);
        }
    }
}
