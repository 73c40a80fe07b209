//! The attention kernels on tensor cores (`#[cube]`, `cmma`): the forward, dQ and dK/dV kernels
//! of `attention_kernels.rs` with every product as tensor-core tiles into `f32`, on a device
//! whose planes are [`LANES`] units (CUDA). `f16` and `bf16` multiply 16x16x16 tiles of the
//! dtype. `f32` multiplies 16x16x8 TF32 tiles three times (3xTF32, [`Arithmetic::Split`]): each
//! operand `x` is staged as `hi = tf32(x)` and `lo = tf32(x - hi)`, and a product is
//! `lo_a hi_b + hi_a lo_b + hi_a hi_b`, `f32`'s accuracy but for the dropped `lo_a lo_b` and
//! `lo`'s rounding (at most `3 * 2^-22` of `|a b|`); what PyTorch's `f32` attention computes on
//! the same devices (CUTLASS's `OpMultiplyAddFastF32`), with TF32 allowed or not. Launched by
//! `attention_op.rs`, which states the arithmetic; the cases these kernels do not take (a head
//! dimension not a multiple of 16, a device without the tiles) run the others.
//!
//! Work split: a cube has [`SPLIT`] planes and takes 16 query rows (the forward, dQ) or 16 keys
//! (dK and dV); each plane takes its own share of the other side (the keys, or the query rows)
//! and the cube combines the planes' parts at the end, in plane order. Operands are staged in
//! shared memory in the multiplied dtype `M` (the dtype, or TF32 `hi` then `lo` in one array), in
//! vectors of up to 16 bytes ([`staging_width`]); a plane's
//! scores land in its own `f32` tiles in shared memory, where the two units of a row take the
//! row's softmax or gradient arithmetic in `f32`, its even and its odd columns, and combine
//! through a plane shuffle. The forward's output accumulates in shared memory (the softmax
//! rescales it; a plane's first block writes it without reading it), the gradients' in
//! registers (`cmma` accumulator tiles); the forward's combine stores the output in vectors
//! ([`output_width`]). Shared rows are padded by 16 bytes so that a plane's units, one row each, and a
//! tile's rows fall into different banks.
//! Rounding: the probabilities and the scores' gradients are rounded to the dtype before they
//! multiply (FlashAttention's choice; burn's composition rounds them too; in `f32` they are split
//! as the operands are); every sum is `f32`.
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
/// The edge of a tensor-core tile; query rows of a forward or dQ cube, keys of a dK/dV cube.
pub(in crate::cube) const TILE: usize = 16;
/// Planes of a cube: they share its 16 rows (or keys), each taking every `SPLIT`th block of
/// keys (or query rows), and combine their parts at the end.
pub(in crate::cube) const SPLIT: usize = 4;
/// Units of a cube.
const UNITS: usize = SPLIT * LANES;

// The kernels' fixed shares: dQ's `delta` takes eight units a row of a 16-row cube, and
// `add_planes` gives each unit whole elements of a tile.
const _: () = assert!(UNITS == 8 * TILE && (TILE * TILE).is_multiple_of(UNITS));
/// The largest head dimension taken.
const MAX_DIM: usize = 64;
/// The most shared memory a cube of the 2-byte dtypes asks for (bytes), 1 KiB below CUDA's
/// static limit of 48 KiB.
const MAX_SHARED: usize = 47 * 1024;
/// The most a cube of split `f32` asks for: its operands take four times the bytes (two TF32
/// copies), so blocks of 16 at head dimension 32 take 67-78 KiB (two or three cubes a
/// multiprocessor on Hopper's 228 KiB) and head dimension 64 fits one.
const MAX_SHARED_SPLIT: usize = 120 * 1024;
/// Alignment of shared arrays (bytes): a tile's load and store need 32.
const ALIGN: usize = 32;
/// Padding of a shared `f32` row (elements): 16 bytes, the least a tile's row stride may step
/// by. Unpadded, the rows of a tile (64 or 128 bytes apart) start in the same banks and the
/// units of a plane, one row pair each, read one bank at once.
const PAD32: usize = 4;

/// How the kernels multiply: the dtype's own tiles, or `f32` split into two TF32 parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::cube) enum Arithmetic {
    /// `f16` or `bf16` operands, 16x16x16 tiles of the dtype.
    Half,
    /// `f32` operands as TF32 `hi` and `lo` parts, three 16x16x8 tile products each.
    Split,
}

impl Arithmetic {
    /// Bytes of an operand element: the dtype's, as many as a staged part's.
    pub(in crate::cube) const fn bytes(self) -> usize {
        match self {
            Self::Half => 2,
            Self::Split => 4,
        }
    }

    /// Whether operands are split into TF32 parts; the kernels' compile-time flag.
    pub(in crate::cube) const fn split(self) -> bool {
        matches!(self, Self::Split)
    }

    /// The depth of a tile product ([`depth`]).
    pub(in crate::cube) const fn depth(self) -> usize {
        depth(self.split())
    }
}

/// Parts staged per operand element: `hi` and `lo` with the split, else the element itself.
const fn parts(split: bool) -> usize {
    if split { 2 } else { 1 }
}

/// Padding of a shared row of staged operands (elements): 16 bytes, as [`PAD32`].
const fn pad(split: bool) -> usize {
    if split { 4 } else { 8 }
}

/// The depth of a tile product: 16 for the 2-byte dtypes, 8 for TF32.
const fn depth(split: bool) -> usize {
    if split { 8 } else { 16 }
}

/// Elements between a staged array's `hi` part and its `lo` part: the array's length in one
/// part, or 0 without the split (the one part is read twice over nothing).
const fn lo_at(len: usize, split: bool) -> usize {
    if split { len } else { 0 }
}

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
    /// is not a multiple of [`TILE`] up to [`MAX_DIM`] or the smallest blocks do not fit. Split
    /// `f32` keeps blocks of [`TILE`]: its shared arrays are the largest, and the smallest
    /// blocks leave the most cubes on a multiprocessor.
    pub(in crate::cube) fn for_dim(dim: usize, shared: usize, arith: Arithmetic) -> Option<Self> {
        if dim == 0 || !dim.is_multiple_of(TILE) || dim > MAX_DIM {
            return None;
        }
        let (budget, largest) = match arith {
            Arithmetic::Half => (shared.min(MAX_SHARED), 64),
            Arithmetic::Split => (shared.min(MAX_SHARED_SPLIT), TILE),
        };
        // Bytes of the kernels' shared arrays (padded rows): operands in the staged dtype (one
        // or two parts), products and accumulators in f32.
        let pad = pad(arith.split());
        let staged = arith.bytes() * parts(arith.split());
        let (op, acc) = ((dim + pad) * staged, (dim + PAD32) * 4);
        let scores = |n: usize| (n + PAD32) * 4;
        let weights = |n: usize| (n + pad) * staged;
        // The forward: a tile of queries, and per plane a block of keys and values, its
        // scores, weights, output accumulator and its rows' two statistics.
        let forward = |keys: usize| {
            (TILE + SPLIT * 2 * keys) * op + SPLIT * TILE * (scores(keys) + weights(keys) + acc + 8)
        };
        // dQ: a tile of queries and of output gradients, and per plane a block of keys and
        // values, its scores, their gradients and the gradients in the dtype; the rows' `delta`.
        let query = |keys: usize| {
            (2 * TILE + SPLIT * 2 * keys) * op
                + SPLIT * TILE * (2 * scores(keys) + weights(keys))
                + 4 * TILE
        };
        // dK/dV: a tile of keys and of values, and per plane a block of query rows and output
        // gradients, the transposed scores and their gradients (f32 and the dtype) and the
        // rows' `lse` and `delta`.
        let key = |rows: usize| {
            (2 * TILE + SPLIT * 2 * rows) * op
                + SPLIT * (8 * rows + TILE * (2 * scores(rows) + 2 * weights(rows)))
        };
        // Each aligned `Shared` array may start up to `ALIGN - 1` bytes past the previous
        // one's end: at most eight such arrays in a kernel.
        let fit = |size: &dyn Fn(usize) -> usize, largest: usize| {
            [64, 32, TILE]
                .into_iter()
                .find(|&n| n <= largest && size(n) + 8 * ALIGN <= budget)
        };
        Some(Self {
            forward_keys: fit(&forward, largest)?,
            grad_keys: fit(&query, largest)?,
            // A lane per row loads the rows' `lse` and `delta`: at most `LANES` rows.
            rows: fit(&key, largest.min(LANES))?,
        })
    }
}

/// The elements one staging load and store moves, for head dimension `dim`, operands of
/// `bytes` a element whose rows and buffers start at multiples of `aligned` elements: the
/// widest of 16 bytes' worth, 4, 2 and 1 elements that divides both, so that a vector lies
/// whole in one row, aligned to its size.
pub(in crate::cube) fn staging_width(dim: usize, aligned: usize, bytes: usize) -> usize {
    [16 / bytes, 4, 2]
        .into_iter()
        .find(|&w| aligned.is_multiple_of(w) && dim.is_multiple_of(w))
        .unwrap_or(1)
}

/// The elements one store of the forward's output moves (its combine gives each unit `dim / 8`
/// consecutive columns of a row): [`staging_width`] of those columns, for rows and a buffer
/// that start at multiples of `aligned` elements of `bytes` each.
pub(in crate::cube) fn output_width(dim: usize, aligned: usize, bytes: usize) -> usize {
    staging_width(dim / (UNITS / TILE), aligned, bytes)
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

/// The keys, values and mask entries of one block of keys (the forward's and dQ's): `load_rows`
/// of `k` and of `v` (rows `first..` of batch `b`, head `h`, rows past `k_len` as 0, laid out as
/// `operands` says) into `k_next` and `v_next`, and with `masked` query row `i`'s entries
/// (`fetch_mask` by row, the unit's `half`) into `mask_next`.
#[cube]
fn load_key_block<F: Float, W: Size>(
    k: &[F],
    v: &[F],
    mask: &[i32],
    strides: &MaskStrides,
    operands: &Operands,
    k_next: &mut Array<Vector<F, W>>,
    v_next: &mut Array<Vector<F, W>>,
    mask_next: &mut Array<i32>,
    b: usize,
    h: usize,
    i: usize,
    first: usize,
    half: usize,
    q_len: usize,
    k_len: usize,
    unit: usize,
    #[comptime] units: usize,
    #[comptime] keys: usize,
    #[comptime] dim: usize,
    #[comptime] masked: bool,
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
    fetch_mask(
        mask, strides, mask_next, b, h, i, first, half, q_len, k_len, keys, true, masked,
    );
}

/// The query rows, output gradients and mask entries of one block of query rows (dK/dV's):
/// `load_rows` of `q` (laid out as `operands` says) and of `dout` (dense, `heads * dim` a row),
/// rows `first..` of batch `b`, head `h`, rows past `q_len` as 0, into `q_next` and `do_next`,
/// and with `masked` key `kj`'s entries (`fetch_mask` by key, the unit's `half`) into
/// `mask_next`.
#[cube]
fn load_row_block<F: Float, W: Size>(
    q: &[F],
    dout: &[F],
    mask: &[i32],
    strides: &MaskStrides,
    operands: &Operands,
    q_next: &mut Array<Vector<F, W>>,
    do_next: &mut Array<Vector<F, W>>,
    mask_next: &mut Array<i32>,
    b: usize,
    h: usize,
    kj: usize,
    first: usize,
    half: usize,
    q_len: usize,
    k_len: usize,
    heads: usize,
    unit: usize,
    #[comptime] units: usize,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
    #[comptime] masked: bool,
) {
    load_rows::<F, W>(
        q,
        q_next,
        b,
        h,
        first,
        q_len,
        operands.q_at as usize,
        operands.stride as usize,
        unit,
        units,
        rows,
        dim,
    );
    load_rows::<F, W>(
        dout,
        do_next,
        b,
        h,
        first,
        q_len,
        0,
        heads * dim,
        unit,
        units,
        rows,
        dim,
    );
    fetch_mask(
        mask, strides, mask_next, b, h, kj, first, half, q_len, k_len, rows, false, masked,
    );
}

/// Stores a share `load_rows` loaded (unit `unit` of `units`) into `target` from element `to`
/// on, rows `dim + pad(split)` apart (`W` divides both and `to`, and the shared arrays are
/// [`ALIGN`]ed: every vector lands whole and aligned), in the staged dtype `M`: with `split`,
/// each element `x` as `hi = tf32(x)` there and `lo = tf32(x - hi)` `lo` elements further.
#[cube]
fn store_rows<F: Float, M: Float, W: Size>(
    values: &Array<Vector<F, W>>,
    target: &mut Shared<[M]>,
    to: usize,
    unit: usize,
    #[comptime] units: usize,
    #[comptime] count: usize,
    #[comptime] dim: usize,
    #[comptime] lo: usize,
    #[comptime] split: bool,
) {
    let width = W::value().comptime();
    let vectors = comptime!(count * dim / width);
    let pitch = comptime!(dim + pad(split));
    let lines = target.as_vectorized_mut().with_vector_size_mut::<W>();
    #[unroll]
    for n in 0..comptime!(share(count, dim, width, units)) {
        let vector = unit + n * units;
        let idx = vector * width;
        let at = (to + (idx / dim) * pitch + idx % dim) / width;
        let mut inside = true;
        if comptime!(!vectors.is_multiple_of(units)) {
            inside = vector < vectors;
        }
        if inside {
            if split {
                let x = values[n];
                let mut high = Vector::<M, W>::zeroed();
                let mut low = Vector::<M, W>::zeroed();
                #[unroll]
                for e in 0..width {
                    let xe = f32::cast_from(x.extract_dynamic(e));
                    let he = M::cast_from(xe);
                    high.insert_dynamic(e, he);
                    low.insert_dynamic(e, M::cast_from(xe - f32::cast_from(he)));
                }
                lines[at] = high;
                lines[at + comptime!(lo / width)] = low;
            } else {
                lines[at] = Vector::<M, W>::cast_from(values[n]);
            }
        }
    }
}

/// Stores `x` at `at` of `target` in the staged dtype `M`: with `split` as `hi` there and `lo`
/// `lo` elements further (see `store_rows`).
#[cube]
fn put<M: Float>(
    target: &mut Shared<[M]>,
    at: usize,
    x: f32,
    #[comptime] lo: usize,
    #[comptime] split: bool,
) {
    let high = M::cast_from(x);
    target[at] = high;
    if split {
        target[at + lo] = M::cast_from(x - f32::cast_from(high));
    }
}

/// Stages `count` rows of `source` in `target` at once (`load_rows` then `store_rows`), the
/// whole cube's units taking part.
#[cube]
fn stage_rows<F: Float, M: Float, W: Size>(
    source: &[F],
    target: &mut Shared<[M]>,
    b: usize,
    h: usize,
    first: usize,
    len: usize,
    at: usize,
    stride: usize,
    #[comptime] units: usize,
    #[comptime] count: usize,
    #[comptime] dim: usize,
    #[comptime] split: bool,
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
    let lo = comptime!(lo_at(count * (dim + pad(split)), split));
    store_rows::<F, M, W>(&values, target, 0, unit, units, count, dim, lo, split);
}

/// The accumulator tile of the products of `depth(split)`.
#[cube]
fn accumulator(#[comptime] split: bool) -> cmma::Matrix<f32> {
    cmma::Matrix::<f32>::from_value(
        MatrixIdent::Accumulator,
        TILE,
        TILE,
        comptime!(depth(split)),
        MatrixLayout::Undefined,
        0.0f32,
    )
}

/// One 16x16 `f32` tile of a plane's product `A B` into `out` at `out_at` (rows `out_stride`
/// apart), added to what it holds with `accumulate`: `A` row-major from `a_at` (rows
/// `a_stride` apart) times `B` (`b_layout`, from `b_at`, rows `b_stride` apart, consecutive
/// elements of the product's sum `b_k` apart), over `length` of the sum ([`accumulate_tile`]).
/// Every unit of the plane calls it.
#[cube]
fn product_tile<M: Float>(
    a: &Shared<[M]>,
    a_at: usize,
    a_stride: usize,
    b: &Shared<[M]>,
    b_at: usize,
    b_stride: usize,
    b_k: usize,
    out: &mut Shared<[f32]>,
    out_at: usize,
    out_stride: usize,
    #[comptime] length: usize,
    #[comptime] b_layout: MatrixLayout,
    #[comptime] accumulate: bool,
    #[comptime] a_lo: usize,
    #[comptime] b_lo: usize,
    #[comptime] split: bool,
) {
    let mut acc = accumulator(split);
    if accumulate {
        cmma::load_with_layout(
            &mut acc,
            &out.slice(out_at, out.len()),
            out_stride as u32,
            MatrixLayout::RowMajor,
        );
    }
    accumulate_tile::<M>(
        &acc, a, a_at, a_stride, b, b_at, b_stride, b_k, length, b_layout, a_lo, b_lo, split,
    );
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
pub(in crate::cube) fn attention_forward_tc_kernel<F: Float, M: Float>(
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
    #[comptime] out_width: usize,
    #[comptime] keys: usize,
    #[comptime] masked: bool,
    #[comptime] causal: bool,
    #[comptime] quiet: bool,
    #[comptime] split: bool,
    #[define(F, M)] _dtypes: [ElemType; 2],
) {
    // The staged operands move `width` elements a load and a store, the output `out_width` a
    // store.
    let size!(W) = width;
    let size!(V) = out_width;
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
    let op = comptime!(dim + pad(split));
    let sp = comptime!(keys + PAD32);
    let pp = comptime!(keys + pad(split));
    let ap = comptime!(dim + PAD32);
    // The staged arrays' parts (`lo_at`) and their lengths in both.
    let parts = comptime!(parts(split));
    let q_lo = comptime!(lo_at(TILE * op, split));
    let kv_lo = comptime!(lo_at(SPLIT * keys * op, split));
    let p_lo = comptime!(lo_at(SPLIT * TILE * pp, split));
    let mut qs = Shared::<[M]>::new_aligned_slice(comptime!(parts * TILE * op), ALIGN);
    let mut ks = Shared::<[M]>::new_aligned_slice(comptime!(parts * SPLIT * keys * op), ALIGN);
    let mut vs = Shared::<[M]>::new_aligned_slice(comptime!(parts * SPLIT * keys * op), ALIGN);
    let mut ss =
        Shared::<[f32]>::new_aligned_slice(comptime!(SPLIT * TILE * (keys + PAD32)), ALIGN);
    let mut ps = Shared::<[M]>::new_aligned_slice(comptime!(parts * SPLIT * TILE * pp), ALIGN);
    let mut os = Shared::<[f32]>::new_aligned_slice(comptime!(SPLIT * TILE * (dim + PAD32)), ALIGN);
    let mut stats = Shared::<[f32]>::new_slice(comptime!(SPLIT * TILE * 2));
    // This plane's regions of the shared arrays.
    let kv_at = plane * keys * op;
    let s_at = plane * TILE * sp;
    let p_at = plane * TILE * pp;
    let o_at = plane * TILE * ap;
    let steps = plane_steps(key_blocks(first, k_len, TILE, keys, causal), plane);
    // The plane's first block's keys and values are in flight while the queries are staged.
    let mut k_next = Array::<Vector<F, W>>::new(comptime!(share(keys, dim, width, LANES)));
    let mut v_next = Array::<Vector<F, W>>::new(comptime!(share(keys, dim, width, LANES)));
    let mut mask_next = Array::<i32>::new(comptime!(keys / 2));
    if steps > 0 {
        load_key_block::<F, W>(
            k,
            v,
            mask,
            &strides,
            &operands,
            &mut k_next,
            &mut v_next,
            &mut mask_next,
            b,
            h,
            i,
            plane * keys,
            half,
            q_len,
            k_len,
            lane,
            LANES,
            keys,
            dim,
            masked,
        );
    }
    stage_rows::<F, M, W>(
        q, &mut qs, b, h, first, q_len, q_at, stride, UNITS, TILE, dim, split,
    );
    // A plane's first block writes its accumulator whole (below); one without a block leaves
    // it 0 for the combine, where its weight is 0.
    if steps == 0 {
        for c in 0..comptime!(dim / 2) {
            os[o_at + r * ap + 2 * c + half] = 0.0f32;
        }
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
        store_rows::<F, M, W>(
            &k_next, &mut ks, kv_at, lane, LANES, keys, dim, kv_lo, split,
        );
        store_rows::<F, M, W>(
            &v_next, &mut vs, kv_at, lane, LANES, keys, dim, kv_lo, split,
        );
        let bits = mask_bits(&mask_next, keys, masked);
        sync_plane();
        // The plane's next block's keys, values and mask entries, in flight while this block
        // is worked on.
        if step + 1 < steps {
            let next = base + SPLIT * keys;
            load_key_block::<F, W>(
                k,
                v,
                mask,
                &strides,
                &operands,
                &mut k_next,
                &mut v_next,
                &mut mask_next,
                b,
                h,
                i,
                next,
                half,
                q_len,
                k_len,
                lane,
                LANES,
                keys,
                dim,
                masked,
            );
        }
        // The plane's scores: the 16 rows of q times its block's keys.
        #[unroll]
        for n in 0..comptime!(keys / TILE) {
            product_tile::<M>(
                &qs,
                0,
                op,
                &ks,
                kv_at + n * TILE * op,
                op,
                1,
                &mut ss,
                s_at + n * TILE,
                sp,
                dim,
                MatrixLayout::ColMajor,
                false,
                q_lo,
                kv_lo,
                split,
            );
        }
        sync_plane();
        // The unit's scores (its row, every other column), scaled and masked, kept in
        // registers between the block's maximum and its weights.
        let mut scores = Array::<f32>::new(comptime!(keys / 2));
        let mut high = f32::min_value();
        #[unroll]
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
            scores[c] = s;
        }
        let new_max = f32::max(row_max, f32::max(high, plane_shuffle_xor(high, 1)));
        let mut part = 0.0f32;
        #[unroll]
        for c in 0..comptime!(keys / 2) {
            let j = 2 * c + half;
            let mut p = 0.0f32;
            if base + j < k_len {
                p = (scores[c] - new_max).exp();
            }
            put::<M>(&mut ps, p_at + r * pp + j, p, p_lo, split);
            part += p;
        }
        let block_sum = part + plane_shuffle_xor(part, 1);
        let alpha = (row_max - new_max).exp();
        row_sum = row_sum * alpha + block_sum;
        row_max = new_max;
        // The accumulator rescaled to the new maximum; the first block's starts from 0, which
        // the rescale would leave 0 (the quiet softmax's virtual score adds no output).
        if step > 0 {
            for c in 0..comptime!(dim / 2) {
                os[o_at + r * ap + 2 * c + half] *= alpha;
            }
        }
        sync_plane();
        // The plane's output rows (+)= its weights times its block's values.
        if step == 0 {
            output_tiles::<M>(
                &ps, &vs, &mut os, p_at, pp, kv_at, op, o_at, ap, keys, dim, false, p_lo, kv_lo,
                split,
            );
        } else {
            output_tiles::<M>(
                &ps, &vs, &mut os, p_at, pp, kv_at, op, o_at, ap, keys, dim, true, p_lo, kv_lo,
                split,
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
    let row = unit / comptime!(UNITS / TILE);
    let part = unit % comptime!(UNITS / TILE);
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
        // The unit's columns, `out_width` a store (it divides them and the row's start).
        let columns = comptime!(dim / (UNITS / TILE));
        let at = ((b * q_len + ci) * heads + h) * dim + part * columns;
        let lines = out.as_vectorized_mut().with_vector_size_mut::<V>();
        #[unroll]
        for n in 0..comptime!(columns / out_width) {
            let mut value = Vector::<F, V>::zeroed();
            #[unroll]
            for e in 0..out_width {
                let d = part * columns + n * out_width + e;
                let mut o = 0.0f32;
                #[unroll]
                for p in 0..SPLIT {
                    o += os[(p * TILE + row) * ap + d] * weights[p];
                }
                value.insert(e, F::cast_from(o * inv));
            }
            lines[(at + n * out_width) / out_width] = value;
        }
        if part == 0 {
            lse[(b * q_len + ci) * heads + h] = m + total.ln();
        }
    }
}

/// A forward plane's output tiles: its 16 rows of weights (`ps` from `p_at`, rows `pp`
/// apart) times its block of `keys` values (`vs` from `kv_at`, rows `op` apart) into the
/// accumulator (`os` from `o_at`, rows `ap` apart), added to it with `accumulate`, else
/// written whole.
#[cube]
fn output_tiles<M: Float>(
    ps: &Shared<[M]>,
    vs: &Shared<[M]>,
    os: &mut Shared<[f32]>,
    p_at: usize,
    #[comptime] pp: usize,
    kv_at: usize,
    #[comptime] op: usize,
    o_at: usize,
    #[comptime] ap: usize,
    #[comptime] keys: usize,
    #[comptime] dim: usize,
    #[comptime] accumulate: bool,
    #[comptime] p_lo: usize,
    #[comptime] kv_lo: usize,
    #[comptime] split: bool,
) {
    #[unroll]
    for n in 0..comptime!(dim / TILE) {
        product_tile::<M>(
            ps,
            p_at,
            pp,
            vs,
            kv_at + n * TILE,
            op,
            op,
            os,
            o_at + n * TILE,
            ap,
            keys,
            MatrixLayout::RowMajor,
            accumulate,
            p_lo,
            kv_lo,
            split,
        );
    }
}

/// The steps of plane `plane` over `blocks` blocks, the plane taking blocks `plane`,
/// `plane + SPLIT`, ..: the count of those below `blocks`.
#[cube]
fn plane_steps(blocks: usize, plane: usize) -> usize {
    let mut steps = 0usize;
    if plane < blocks {
        steps = (blocks - plane + SPLIT - 1) / SPLIT;
    }
    steps
}

/// The `count` zeroed `f32` accumulator tiles of a plane, kept in registers across a kernel's
/// loop (`accumulate_tile`) and summed over the planes at its end (`add_planes`).
#[cube]
fn zero_tiles(#[comptime] count: usize, #[comptime] split: bool) -> Sequence<cmma::Matrix<f32>> {
    let mut tiles = Sequence::<cmma::Matrix<f32>>::new();
    #[unroll]
    for _ in 0..count {
        tiles.push(accumulator(split));
    }
    tiles
}

/// Adds a plane's product `A B` to the accumulator tile `acc` (registers): `A` row-major from
/// `a_at` (rows `a_stride` apart) times `B` (`b_layout`, from `b_at`, rows `b_stride` apart,
/// consecutive elements of the sum `b_k` apart), over `length` of the sum in tiles of
/// `depth(split)`, in order. With `split` each tile product is three, the small ones first:
/// `A`'s `lo` part (`a_lo` elements past its `hi`) times `B`'s `hi`, `A`'s `hi` times `B`'s
/// `lo` (`b_lo` past), then the `hi` parts. Every unit of the plane calls it.
#[cube]
fn accumulate_tile<M: Float>(
    acc: &cmma::Matrix<f32>,
    a: &Shared<[M]>,
    a_at: usize,
    a_stride: usize,
    b: &Shared<[M]>,
    b_at: usize,
    b_stride: usize,
    b_k: usize,
    #[comptime] length: usize,
    #[comptime] b_layout: MatrixLayout,
    #[comptime] a_lo: usize,
    #[comptime] b_lo: usize,
    #[comptime] split: bool,
) {
    let depth = comptime!(depth(split));
    #[unroll]
    for s in 0..comptime!(length / depth) {
        let a_from = a_at + s * depth;
        let b_from = b_at + s * depth * b_k;
        let a_high = cmma::Matrix::<M>::from_slice(
            MatrixIdent::A,
            TILE,
            TILE,
            depth,
            MatrixLayout::RowMajor,
            &a.slice(a_from, a.len()),
            a_stride as u32,
        );
        let b_high = cmma::Matrix::<M>::from_slice(
            MatrixIdent::B,
            TILE,
            TILE,
            depth,
            b_layout,
            &b.slice(b_from, b.len()),
            b_stride as u32,
        );
        if split {
            let a_low = cmma::Matrix::<M>::from_slice(
                MatrixIdent::A,
                TILE,
                TILE,
                depth,
                MatrixLayout::RowMajor,
                &a.slice(a_from + a_lo, a.len()),
                a_stride as u32,
            );
            let b_low = cmma::Matrix::<M>::from_slice(
                MatrixIdent::B,
                TILE,
                TILE,
                depth,
                b_layout,
                &b.slice(b_from + b_lo, b.len()),
                b_stride as u32,
            );
            cmma::execute::<M, M, f32, f32, cmma::Plane>(&a_low, &b_high, acc, acc);
            cmma::execute::<M, M, f32, f32, cmma::Plane>(&a_high, &b_low, acc, acc);
        }
        cmma::execute::<M, M, f32, f32, cmma::Plane>(&a_high, &b_high, acc, acc);
    }
}

/// The sum over the cube's [`SPLIT`] planes of their accumulator tile `tile`, times `factor`,
/// into `target`: row `rr` and column `cc` of the sum at `at + rr * stride + cc`, rows from
/// `valid` on left out. Each plane stores its tile in its own region of `scratch` (at
/// `plane * TILE * pitch`, rows `pitch` apart, `pitch >= TILE`); after a barrier each unit
/// adds its elements' parts in plane order (a fixed order: a replay sums as the eager call),
/// and a second barrier frees `scratch`. Every unit of the cube calls it.
#[cube]
fn add_planes<F: Float>(
    tile: &cmma::Matrix<f32>,
    scratch: &mut Shared<[f32]>,
    target: &mut [F],
    at: usize,
    stride: usize,
    valid: usize,
    factor: f32,
    #[comptime] pitch: usize,
) {
    let plane = UNIT_POS_Y as usize;
    let unit = UNIT_POS as usize;
    cmma::store(
        &mut scratch.slice_mut(plane * TILE * pitch, scratch.len()),
        tile,
        pitch as u32,
        MatrixLayout::RowMajor,
    );
    sync_cube();
    #[unroll]
    for t in 0..comptime!(TILE * TILE / UNITS) {
        let e = unit + t * UNITS;
        let rr = e / TILE;
        let cc = e % TILE;
        let mut sum = 0.0f32;
        #[unroll]
        for p in 0..SPLIT {
            sum += scratch[(p * TILE + rr) * pitch + cc];
        }
        if rr < valid {
            target[at + rr * stride + cc] = F::cast_from(sum * factor);
        }
    }
    sync_cube();
}

/// dQ and `delta`: rows `CUBE_POS_X * TILE..` of batch `CUBE_POS_Z`, head `CUBE_POS_Y`, as
/// `attention_kernels::query_grad_kernel`. Plane `p` of the [`SPLIT`] takes the key blocks
/// `p, p + SPLIT, ..` (as the forward) and sums its part of dQ in its own tiles, held in
/// registers; at the end the cube adds the planes' parts in plane order (`add_planes`). Each
/// part is a sum over keys, so the parts add without rescaling.
#[cube(launch_unchecked)]
pub(in crate::cube) fn attention_query_grad_tc_kernel<F: Float, M: Float>(
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
    #[comptime] split: bool,
    #[define(F, M)] _dtypes: [ElemType; 2],
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
    let op = comptime!(dim + pad(split));
    let sp = comptime!(keys + PAD32);
    let pp = comptime!(keys + pad(split));
    // The staged arrays' parts (`lo_at`) and their lengths in both.
    let parts = comptime!(parts(split));
    let q_lo = comptime!(lo_at(TILE * op, split));
    let kv_lo = comptime!(lo_at(SPLIT * keys * op, split));
    let p_lo = comptime!(lo_at(SPLIT * TILE * pp, split));
    let mut qs = Shared::<[M]>::new_aligned_slice(comptime!(parts * TILE * op), ALIGN);
    let mut dos = Shared::<[M]>::new_aligned_slice(comptime!(parts * TILE * op), ALIGN);
    let mut ks = Shared::<[M]>::new_aligned_slice(comptime!(parts * SPLIT * keys * op), ALIGN);
    let mut vs = Shared::<[M]>::new_aligned_slice(comptime!(parts * SPLIT * keys * op), ALIGN);
    let mut ss =
        Shared::<[f32]>::new_aligned_slice(comptime!(SPLIT * TILE * (keys + PAD32)), ALIGN);
    let mut dps =
        Shared::<[f32]>::new_aligned_slice(comptime!(SPLIT * TILE * (keys + PAD32)), ALIGN);
    let mut dss = Shared::<[M]>::new_aligned_slice(comptime!(parts * SPLIT * TILE * pp), ALIGN);
    let mut row_deltas = Shared::<[f32]>::new_slice(TILE);
    // This plane's regions of the shared arrays.
    let kv_at = plane * keys * op;
    let s_at = plane * TILE * sp;
    let p_at = plane * TILE * pp;
    let steps = plane_steps(key_blocks(first, k_len, TILE, keys, causal), plane);
    // The plane's first block's keys and values are in flight while the rows are staged.
    let mut k_next = Array::<Vector<F, W>>::new(comptime!(share(keys, dim, width, LANES)));
    let mut v_next = Array::<Vector<F, W>>::new(comptime!(share(keys, dim, width, LANES)));
    let mut mask_next = Array::<i32>::new(comptime!(keys / 2));
    if steps > 0 {
        load_key_block::<F, W>(
            k,
            v,
            mask,
            &strides,
            &operands,
            &mut k_next,
            &mut v_next,
            &mut mask_next,
            b,
            h,
            i,
            plane * keys,
            half,
            q_len,
            k_len,
            lane,
            LANES,
            keys,
            dim,
            masked,
        );
    }
    stage_rows::<F, M, W>(
        q, &mut qs, b, h, first, q_len, q_at, stride, UNITS, TILE, dim, split,
    );
    stage_rows::<F, M, W>(
        dout,
        &mut dos,
        b,
        h,
        first,
        q_len,
        0,
        heads * dim,
        UNITS,
        TILE,
        dim,
        split,
    );
    // The rows' `delta` (the sum of `dO * out` over a row): eight units a row, each `dim / 8`
    // consecutive columns in order, then over the eight by shuffles (each unit of the eight
    // ends with the same sum: each step adds the same two values); kept for the row's units.
    let unit = UNIT_POS as usize;
    let d_row = unit / 8;
    let d_part = unit % 8;
    let d_i = first + d_row;
    let d_at = ((b * q_len + d_i) * heads + h) * dim + d_part * comptime!(dim / 8);
    let mut part = 0.0f32;
    if d_i < q_len {
        #[unroll]
        for c in 0..comptime!(dim / 8) {
            part += f32::cast_from(dout[d_at + c]) * f32::cast_from(out[d_at + c]);
        }
    }
    part += plane_shuffle_xor(part, 1);
    part += plane_shuffle_xor(part, 2);
    part += plane_shuffle_xor(part, 4);
    if d_i < q_len && d_part == 0 {
        row_deltas[d_row] = part;
        delta[(b * q_len + d_i) * heads + h] = part;
    }
    let row_lse = row_value(lse, b, h, i, q_len, heads);
    let dq_tiles = zero_tiles(comptime!(dim / TILE), split);
    sync_cube();
    let row_delta = row_deltas[r];
    for step in 0..steps {
        let base = (plane + step * SPLIT) * keys;
        store_rows::<F, M, W>(
            &k_next, &mut ks, kv_at, lane, LANES, keys, dim, kv_lo, split,
        );
        store_rows::<F, M, W>(
            &v_next, &mut vs, kv_at, lane, LANES, keys, dim, kv_lo, split,
        );
        let bits = mask_bits(&mask_next, keys, masked);
        sync_plane();
        // The plane's next block's keys, values and mask entries, in flight while this block
        // is worked on.
        if step + 1 < steps {
            let next = base + SPLIT * keys;
            load_key_block::<F, W>(
                k,
                v,
                mask,
                &strides,
                &operands,
                &mut k_next,
                &mut v_next,
                &mut mask_next,
                b,
                h,
                i,
                next,
                half,
                q_len,
                k_len,
                lane,
                LANES,
                keys,
                dim,
                masked,
            );
        }
        // The plane's scores (q k^T) and the output gradient's products with the values (dO v^T).
        #[unroll]
        for n in 0..comptime!(keys / TILE) {
            product_tile::<M>(
                &qs,
                0,
                op,
                &ks,
                kv_at + n * TILE * op,
                op,
                1,
                &mut ss,
                s_at + n * TILE,
                sp,
                dim,
                MatrixLayout::ColMajor,
                false,
                q_lo,
                kv_lo,
                split,
            );
            product_tile::<M>(
                &dos,
                0,
                op,
                &vs,
                kv_at + n * TILE * op,
                op,
                1,
                &mut dps,
                s_at + n * TILE,
                sp,
                dim,
                MatrixLayout::ColMajor,
                false,
                q_lo,
                kv_lo,
                split,
            );
        }
        sync_plane();
        for c in 0..comptime!(keys / 2) {
            let j = 2 * c + half;
            let kj = base + j;
            let valid = i < q_len && kj < k_len;
            let mut s = ss[s_at + r * sp + j] * scale;
            let hide = valid && hides(bits, c, i, kj, masked, causal);
            if hide {
                s = fill;
            }
            let p = probability(s, row_lse, valid);
            let grad = score_gradient(p, dps[s_at + r * sp + j], row_delta, hide, valid);
            put::<M>(&mut dss, p_at + r * pp + j, grad, p_lo, split);
        }
        sync_plane();
        // The plane's part of dQ += dS k.
        #[unroll]
        for n in 0..comptime!(dim / TILE) {
            accumulate_tile::<M>(
                dq_tiles.index(n),
                &dss,
                p_at,
                pp,
                &ks,
                kv_at + n * TILE,
                op,
                op,
                keys,
                MatrixLayout::RowMajor,
                p_lo,
                kv_lo,
                split,
            );
        }
        sync_plane();
    }
    let at = q_at + (b * q_len + first) * stride + h * dim;
    #[unroll]
    for n in 0..comptime!(dim / TILE) {
        add_planes::<F>(
            dq_tiles.index(n),
            &mut ss,
            dq,
            at + n * TILE,
            stride,
            q_len - first,
            scale,
            sp,
        );
    }
}

/// dK and dV: keys `CUBE_POS_X * TILE..` of batch `CUBE_POS_Z`, head `CUBE_POS_Y`, as
/// `attention_kernels::key_grad_kernel`. Plane `p` of the [`SPLIT`] takes the query blocks
/// `p, p + SPLIT, ..` (from the first a causal mask lets see the keys) and sums its parts of
/// dK and dV in its own tiles, held in registers; at the end the cube adds the planes' parts
/// in plane order (`add_planes`).
#[cube(launch_unchecked)]
pub(in crate::cube) fn attention_key_grad_tc_kernel<F: Float, M: Float>(
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
    #[comptime] split: bool,
    #[define(F, M)] _dtypes: [ElemType; 2],
) {
    // The staged operands move `width` elements a load and a store.
    let size!(W) = width;
    let q_len = q_len as usize;
    let k_len = k_len as usize;
    let heads = heads as usize;
    let stride = operands.stride as usize;
    let (k_at, v_at) = (operands.k_at as usize, operands.v_at as usize);
    let h = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let first = CUBE_POS_X as usize * TILE;
    let plane = UNIT_POS_Y as usize;
    let lane = UNIT_POS_X as usize;
    let j = lane / 2;
    let half = lane % 2;
    let kj = first + j;
    let op = comptime!(dim + pad(split));
    let sp = comptime!(rows + PAD32);
    let pp = comptime!(rows + pad(split));
    // The staged arrays' parts (`lo_at`) and their lengths in both.
    let parts = comptime!(parts(split));
    let k_lo = comptime!(lo_at(TILE * op, split));
    let q_lo = comptime!(lo_at(SPLIT * rows * op, split));
    let p_lo = comptime!(lo_at(SPLIT * TILE * pp, split));
    let mut ks = Shared::<[M]>::new_aligned_slice(comptime!(parts * TILE * op), ALIGN);
    let mut vs = Shared::<[M]>::new_aligned_slice(comptime!(parts * TILE * op), ALIGN);
    let mut qs = Shared::<[M]>::new_aligned_slice(comptime!(parts * SPLIT * rows * op), ALIGN);
    let mut dos = Shared::<[M]>::new_aligned_slice(comptime!(parts * SPLIT * rows * op), ALIGN);
    let mut sts =
        Shared::<[f32]>::new_aligned_slice(comptime!(SPLIT * TILE * (rows + PAD32)), ALIGN);
    let mut dpts =
        Shared::<[f32]>::new_aligned_slice(comptime!(SPLIT * TILE * (rows + PAD32)), ALIGN);
    let mut pts = Shared::<[M]>::new_aligned_slice(comptime!(parts * SPLIT * TILE * pp), ALIGN);
    let mut dsts = Shared::<[M]>::new_aligned_slice(comptime!(parts * SPLIT * TILE * pp), ALIGN);
    let mut lses = Shared::<[f32]>::new_slice(comptime!(SPLIT * rows));
    let mut deltas = Shared::<[f32]>::new_slice(comptime!(SPLIT * rows));
    // This plane's regions of the shared arrays.
    let q_off = plane * rows * op;
    let s_at = plane * TILE * sp;
    let p_at = plane * TILE * pp;
    let r_at = plane * rows;
    // With `causal`, query rows before the cube's first key see none of its keys.
    let mut start = 0usize;
    if causal {
        let mut skipped = first;
        if q_len < first {
            skipped = q_len;
        }
        start = skipped / rows;
    }
    let steps = plane_steps((q_len + rows - 1) / rows - start, plane);
    // The plane's first block's rows (queries, output gradients, their `lse` and `delta`, a
    // lane per row: `rows` <= LANES) are in flight while the keys and values are staged.
    let mut q_next = Array::<Vector<F, W>>::new(comptime!(share(rows, dim, width, LANES)));
    let mut do_next = Array::<Vector<F, W>>::new(comptime!(share(rows, dim, width, LANES)));
    let mut mask_next = Array::<i32>::new(comptime!(rows / 2));
    let mut lse_next = 0.0f32;
    let mut delta_next = 0.0f32;
    if steps > 0 {
        let first_row = (start + plane) * rows;
        load_row_block::<F, W>(
            q,
            dout,
            mask,
            &strides,
            &operands,
            &mut q_next,
            &mut do_next,
            &mut mask_next,
            b,
            h,
            kj,
            first_row,
            half,
            q_len,
            k_len,
            heads,
            lane,
            LANES,
            rows,
            dim,
            masked,
        );
        lse_next = row_value(lse, b, h, first_row + lane, q_len, heads);
        delta_next = row_value(delta, b, h, first_row + lane, q_len, heads);
    }
    stage_rows::<F, M, W>(
        k, &mut ks, b, h, first, k_len, k_at, stride, UNITS, TILE, dim, split,
    );
    stage_rows::<F, M, W>(
        v, &mut vs, b, h, first, k_len, v_at, stride, UNITS, TILE, dim, split,
    );
    let dk_tiles = zero_tiles(comptime!(dim / TILE), split);
    let dv_tiles = zero_tiles(comptime!(dim / TILE), split);
    sync_cube();
    for step in 0..steps {
        let base = (start + plane + step * SPLIT) * rows;
        store_rows::<F, M, W>(&q_next, &mut qs, q_off, lane, LANES, rows, dim, q_lo, split);
        store_rows::<F, M, W>(
            &do_next, &mut dos, q_off, lane, LANES, rows, dim, q_lo, split,
        );
        if lane < rows {
            lses[r_at + lane] = lse_next;
            deltas[r_at + lane] = delta_next;
        }
        let bits = mask_bits(&mask_next, rows, masked);
        sync_plane();
        // The plane's next block's rows and mask entries, in flight while this block is
        // worked on.
        if step + 1 < steps {
            let next = base + SPLIT * rows;
            load_row_block::<F, W>(
                q,
                dout,
                mask,
                &strides,
                &operands,
                &mut q_next,
                &mut do_next,
                &mut mask_next,
                b,
                h,
                kj,
                next,
                half,
                q_len,
                k_len,
                heads,
                lane,
                LANES,
                rows,
                dim,
                masked,
            );
            lse_next = row_value(lse, b, h, next + lane, q_len, heads);
            delta_next = row_value(delta, b, h, next + lane, q_len, heads);
        }
        // The transposed scores (k q^T) and (v dO^T) of the cube's keys and the plane's rows.
        #[unroll]
        for n in 0..comptime!(rows / TILE) {
            product_tile::<M>(
                &ks,
                0,
                op,
                &qs,
                q_off + n * TILE * op,
                op,
                1,
                &mut sts,
                s_at + n * TILE,
                sp,
                dim,
                MatrixLayout::ColMajor,
                false,
                k_lo,
                q_lo,
                split,
            );
            product_tile::<M>(
                &vs,
                0,
                op,
                &dos,
                q_off + n * TILE * op,
                op,
                1,
                &mut dpts,
                s_at + n * TILE,
                sp,
                dim,
                MatrixLayout::ColMajor,
                false,
                k_lo,
                q_lo,
                split,
            );
        }
        sync_plane();
        for c in 0..comptime!(rows / 2) {
            let ii = 2 * c + half;
            let qi = base + ii;
            let valid = qi < q_len && kj < k_len;
            let mut s = sts[s_at + j * sp + ii] * scale;
            let hide = valid && hides(bits, c, qi, kj, masked, causal);
            if hide {
                s = fill;
            }
            let p = probability(s, lses[r_at + ii], valid);
            put::<M>(&mut pts, p_at + j * pp + ii, p, p_lo, split);
            let grad = score_gradient(p, dpts[s_at + j * sp + ii], deltas[r_at + ii], hide, valid);
            put::<M>(&mut dsts, p_at + j * pp + ii, grad, p_lo, split);
        }
        sync_plane();
        // The plane's parts: dV += P^T dO, dK += dS^T q.
        #[unroll]
        for n in 0..comptime!(dim / TILE) {
            accumulate_tile::<M>(
                dv_tiles.index(n),
                &pts,
                p_at,
                pp,
                &dos,
                q_off + n * TILE,
                op,
                op,
                rows,
                MatrixLayout::RowMajor,
                p_lo,
                q_lo,
                split,
            );
            accumulate_tile::<M>(
                dk_tiles.index(n),
                &dsts,
                p_at,
                pp,
                &qs,
                q_off + n * TILE,
                op,
                op,
                rows,
                MatrixLayout::RowMajor,
                p_lo,
                q_lo,
                split,
            );
        }
        sync_plane();
    }
    let at = (b * k_len + first) * stride + h * dim;
    #[unroll]
    for n in 0..comptime!(dim / TILE) {
        add_planes::<F>(
            dv_tiles.index(n),
            &mut sts,
            dv,
            v_at + at + n * TILE,
            stride,
            k_len - first,
            1.0f32,
            sp,
        );
        add_planes::<F>(
            dk_tiles.index(n),
            &mut sts,
            dk,
            k_at + at + n * TILE,
            stride,
            k_len - first,
            scale,
            sp,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_blocks_fit_the_shared_memory() {
        let cuda = 48 * 1024;
        assert_eq!(
            TensorBlocks::for_dim(32, cuda, Arithmetic::Half),
            Some(TensorBlocks {
                forward_keys: 32,
                grad_keys: 32,
                rows: 16
            })
        );
        assert_eq!(
            TensorBlocks::for_dim(64, cuda, Arithmetic::Half),
            Some(TensorBlocks {
                forward_keys: 16,
                grad_keys: 16,
                rows: 16
            })
        );
        // Head dimension 16: 32 query rows a dK/dV block, as many as a plane's lanes.
        assert_eq!(
            TensorBlocks::for_dim(16, cuda, Arithmetic::Half),
            Some(TensorBlocks {
                forward_keys: 32,
                grad_keys: 32,
                rows: 32
            })
        );
        // Not a multiple of the tile, none, or too large.
        assert_eq!(TensorBlocks::for_dim(8, cuda, Arithmetic::Half), None);
        assert_eq!(TensorBlocks::for_dim(0, cuda, Arithmetic::Half), None);
        assert_eq!(TensorBlocks::for_dim(80, cuda, Arithmetic::Half), None);
    }

    #[test]
    fn split_blocks_are_tiles_within_their_budget() {
        let tiles = Some(TensorBlocks {
            forward_keys: TILE,
            grad_keys: TILE,
            rows: TILE,
        });
        // Hopper's opt-in limit (227 KiB): blocks of 16 at head dimensions 16 to 64.
        let hopper = 227 * 1024;
        for dim in [16, 32, 48, 64] {
            assert_eq!(
                TensorBlocks::for_dim(dim, hopper, Arithmetic::Split),
                tiles,
                "{dim}"
            );
        }
        // Two parts of four bytes: at head dimension 32 the forward takes 66,560 bytes and the
        // dK/dV kernel 77,312 (before alignment), over CUDA's static 48 KiB.
        assert_eq!(
            TensorBlocks::for_dim(32, 48 * 1024, Arithmetic::Split),
            None
        );
        assert_eq!(
            TensorBlocks::for_dim(32, 78 * 1024, Arithmetic::Split),
            tiles
        );
        assert_eq!(
            TensorBlocks::for_dim(32, 75 * 1024, Arithmetic::Split),
            None
        );
        assert_eq!(TensorBlocks::for_dim(24, hopper, Arithmetic::Split), None);
    }

    #[test]
    fn staging_width_keeps_vectors_whole_and_aligned() {
        // The bench's heads (32) on aligned operands: 16-byte vectors.
        assert_eq!(staging_width(32, 768, 2), 8);
        assert_eq!(staging_width(64, 0, 2), 8);
        // An operand 4 elements off a 16-byte boundary: 8-byte vectors.
        assert_eq!(staging_width(32, 4, 2), 4);
        // Odd alignment: one element at a time.
        assert_eq!(staging_width(32, 3, 2), 1);
        assert_eq!(staging_width(32, 6, 2), 2);
        // `f32`: 16 bytes are 4 elements.
        assert_eq!(staging_width(32, 768, 4), 4);
        assert_eq!(staging_width(32, 6, 4), 2);
    }

    #[test]
    fn output_width_is_whole_aligned_vectors_of_a_units_columns() {
        // The bench's heads (32, four columns a unit): one 8-byte vector of bf16, one 16-byte
        // of f32; head dimension 64 (eight): one 16-byte vector of either.
        assert_eq!(output_width(32, 256, 2), 4);
        assert_eq!(output_width(32, 256, 4), 4);
        assert_eq!(output_width(64, 512, 2), 8);
        assert_eq!(output_width(64, 512, 4), 4);
        // Head dimension 48 (six columns): pairs; 16 (two): a pair.
        assert_eq!(output_width(48, 384, 2), 2);
        assert_eq!(output_width(16, 128, 2), 2);
        // A buffer starting at an odd element: one element a store.
        assert_eq!(output_width(64, 1, 2), 1);
    }

    #[test]
    fn shares_cover_every_vector_once() {
        // 16 rows of 32 in 8-element vectors among a forward cube's 128 units: 64 vectors,
        // one round, half the units idle; among a plane's 32: two rounds each.
        assert_eq!(share(TILE, 32, 8, UNITS), 1);
        assert_eq!(share(32, 32, 8, LANES), 4);
        assert_eq!(share(16, 48, 8, 64), 2);
        for (count, dim, width, units) in [(16, 48, 8, 64), (16, 16, 8, 128), (64, 32, 1, 64)] {
            let rounds = share(count, dim, width, units);
            let vectors = count * dim / width;
            assert!(rounds * units >= vectors && (rounds - 1) * units < vectors);
        }
    }
}
