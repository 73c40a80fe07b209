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
//! The kernels and their work split are `attention_kernels.rs`'s.
//!
//! Over 600 lines: the two kernel families' launches (tensor-core and CUDA-core, forward and
//! backward), the choice between them, the fusion operations and the autodiff nodes of one op
//! in its two layouts (three tensors, or one packed), and the test that the layouts agree.

// The ops take queries, keys, values, a mask and the spec's five choices: more arguments than
// clippy's default, in the generated dispatch code too.
#![allow(clippy::too_many_arguments)]

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Backend, Cube, backend_extension};
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::super::buffers::FusedTensor;
use super::super::dense::Dense;
use super::super::kernels::attention_kernels::{
    Blocks, KEYS, MaskStridesLaunch, OperandsLaunch, ROWS, THREADS, attention_forward_kernel,
    attention_key_grad_kernel, attention_query_grad_kernel,
};
use super::super::kernels::attention_tc_kernels::{
    Arithmetic, LANES, SPLIT, TILE, TensorBlocks, attention_forward_tc_kernel,
    attention_key_grad_tc_kernel, attention_query_grad_tc_kernel, output_width, staging_width,
};
use super::super::kernels::row_kernels::count_forward;
use super::super::update::update_kernel::{checked_elem, kernel_elem};
use super::super::values::AttentionSpec;

/// Attention calls (forward or backward) run on tensor cores in this process (read by
/// `burn_graphed::testing`).
static TENSOR_CORE_CALLS: AtomicUsize = AtomicUsize::new(0);

/// Attention calls run on tensor cores so far in this process.
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
pub(crate) fn tensor_core_calls() -> usize {
    TENSOR_CORE_CALLS.load(Ordering::Relaxed)
}

/// Packed attention forwards (self-attention's projections in one tensor) queued in this
/// process (read by `burn_graphed::testing`).
static PACKED_CALLS: AtomicUsize = AtomicUsize::new(0);

/// Packed attention forwards queued so far in this process.
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
pub(crate) fn packed_calls() -> usize {
    PACKED_CALLS.load(Ordering::Relaxed)
}

/// The backward's blocks on tensor cores where set, `grad_keys << 8 | rows` (0: as
/// `TensorBlocks::for_dim` chooses): `burn_graphed::testing::force_attention_blocks`.
#[cfg(feature = "testing")]
static FORCED_BLOCKS: AtomicUsize = AtomicUsize::new(0);

/// Sets (or with `None` clears) [`FORCED_BLOCKS`]: `(grad_keys, rows)`.
#[cfg(feature = "testing")]
pub(crate) fn force_blocks(blocks: Option<(usize, usize)>) {
    let code = blocks.map_or(0, |(keys, rows)| (keys.min(255) << 8) | rows.min(255));
    FORCED_BLOCKS.store(code, Ordering::Relaxed);
}

/// `blocks` with the forced backward blocks where set, each taken only where it is a block
/// size (`TILE`, 32 or 64) no larger than the one chosen: a smaller block needs less shared
/// memory, so the kernels still fit.
fn forced(blocks: TensorBlocks) -> TensorBlocks {
    #[cfg(feature = "testing")]
    {
        let code = FORCED_BLOCKS.load(Ordering::Relaxed);
        let pick = |forced: usize, chosen: usize| {
            if [TILE, 32, 64].contains(&forced) && forced <= chosen {
                forced
            } else {
                chosen
            }
        };
        if code != 0 {
            return TensorBlocks {
                grad_keys: pick(code >> 8, blocks.grad_keys),
                rows: pick(code & 0xff, blocks.rows),
                ..blocks
            };
        }
    }
    blocks
}

/// The autodiff tensor of burn's cubecl backend.
type AutodiffTensor = FloatTensor<Autodiff<Cube>>;
/// An int tensor of burn's cubecl backend.
type FusedInt = IntTensor<Cube>;

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

    /// `(out, lse)` as [`attention_forward`](Self::attention_forward), the queries, keys and
    /// values as one tensor `qkv` `[batch, len, 3 * heads, dim]` (their heads in turn: a
    /// self-attention's three projections made by one product).
    #[fusion(meta = |qkv, _mask, _masked, _causal, _quiet, _scale, _fill| {
        let [batch, len, heads, dim] = qkv.shape.dims::<4>();
        (
            burn::backend::fusion::custom::TensorSpec::new(
                Shape::new([batch, len, heads / 3, dim]),
                qkv.dtype,
            ),
            burn::backend::fusion::custom::TensorSpec::new(
                Shape::new([batch, len, heads / 3]),
                DType::F32,
            ),
        )
    })]
    fn attention_packed_forward(
        qkv: FloatTensor<Self>,
        mask: IntTensor<Self>,
        masked: bool,
        causal: bool,
        quiet: bool,
        scale: f32,
        fill: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// The gradient of `qkv` (its layout) for the output's gradient `dout`.
    #[fusion(meta = |qkv, _out, _dout, _lse, _mask, _masked, _causal, _quiet, _scale, _fill| {
        burn::backend::fusion::custom::TensorSpec::new(qkv.shape.clone(), qkv.dtype)
    })]
    fn attention_packed_backward(
        qkv: FloatTensor<Self>,
        out: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        mask: IntTensor<Self>,
        masked: bool,
        causal: bool,
        quiet: bool,
        scale: f32,
        fill: f32,
    ) -> FloatTensor<Self>;
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
    /// The tensor-core kernels' blocks and arithmetic where they take the call.
    tensor: Option<(TensorBlocks, Arithmetic)>,
    strides: [u32; 3],
    /// Where the operands lie: `OperandsLaunch`'s stride, then the queries', keys' and values'
    /// offsets.
    operands: [u32; 4],
}

impl Call {
    /// The call of `q` over `k` (`[batch, len, heads, dim]` each), or with `packed` of `q`
    /// alone, `[batch, len, 3 * heads, dim]`, the queries, keys and values in turn.
    fn of(q: &CubeTensor, k: &CubeTensor, mask: &CubeTensor, masked: bool, packed: bool) -> Self {
        let [batch, q_len, heads, dim] = q.meta.shape().dims::<4>();
        let k_len = k.meta.shape().dims::<4>()[1];
        let (heads, operands) = if packed {
            let heads = heads / 3;
            let width = (heads * dim) as u32;
            (heads, [3 * width, 0, width, 2 * width])
        } else {
            (heads, [(heads * dim) as u32, 0, 0, 0])
        };
        let shared = q.client.properties().hardware.max_shared_memory_size;
        let blocks = Blocks::for_dim(dim, shared).unwrap_or_else(|| {
            panic!(
                "burn-graphed: attention kernel given head dimension {dim} (the caller checks it)"
            )
        });
        let tensor = tensor_cores(q, dim, shared);
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
            tensor,
            strides,
            operands,
        }
    }

    fn strides(&self) -> MaskStridesLaunch {
        let [batch, head, row] = self.strides;
        MaskStridesLaunch::new(batch, head, row)
    }

    fn operands(&self) -> OperandsLaunch {
        let [stride, q_at, k_at, v_at] = self.operands;
        OperandsLaunch::new(stride, q_at, k_at, v_at)
    }

    /// The tensor-core kernels' staging width (`staging_width`) for the operands `staged`
    /// (each laid out with this call's stride and offsets, or densely with `heads * dim`
    /// elements a row): vectors as wide as every row and every buffer's start allow.
    fn staging_width(&self, staged: &[&Dense]) -> usize {
        let counts = self.operands.iter().map(|&n| n as usize);
        let aligned = Dense::common_alignment(staged, counts.chain([self.heads * self.dim]));
        let bytes = self.tensor.map_or(2, |(_, arith)| arith.bytes());
        staging_width(self.dim, aligned, bytes)
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

/// The tensor-core kernels' blocks and arithmetic for `q`'s dtype and head dimension `dim`,
/// where the device takes them: planes of exactly [`LANES`] units, products into `f32` of
/// 16x16x16 tiles of `f16` or `bf16`, or for `f32` of 16x16x8 TF32 tiles (the carried
/// cubecl-cuda keeps those tiles on a device made without TF32: the split is `f32`'s
/// accuracy), and a head dimension those kernels take within `shared` bytes.
fn tensor_cores(q: &CubeTensor, dim: usize, shared: usize) -> Option<(TensorBlocks, Arithmetic)> {
    use cubecl::features::MmaConfig;
    let (arith, elem) = match q.dtype {
        DType::F16 | DType::BF16 => (Arithmetic::Half, kernel_elem(q.dtype)?),
        DType::F32 => (Arithmetic::Split, tf32_elem()),
        _ => return None,
    };
    let hardware = &q.client.properties().hardware;
    if hardware.plane_size_min != LANES as u32 || hardware.plane_size_max != LANES as u32 {
        return None;
    }
    let tile = MmaConfig {
        a_type: elem,
        b_type: elem,
        cd_type: ElemType::Float(cubecl::ir::FloatKind::F32),
        m: 16,
        n: 16,
        k: arith.depth() as u32,
    };
    if !q.client.features().matmul.cmma.contains(&tile) {
        return None;
    }
    TensorBlocks::for_dim(dim, shared, arith).map(|blocks| (forced(blocks), arith))
}

/// The TF32 element type.
fn tf32_elem() -> ElemType {
    ElemType::Float(cubecl::ir::FloatKind::TF32)
}

/// The element types of the tensor-core kernels: the operands' `elem`, and what they multiply
/// (`elem` itself, or TF32 for the split).
fn tile_elems(elem: ElemType, arith: Arithmetic) -> [ElemType; 2] {
    match arith {
        Arithmetic::Half => [elem, elem],
        Arithmetic::Split => [elem, tf32_elem()],
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
        let call = Call::of(&q, &k, &mask, masked, false);
        let spec = spec_of(masked, causal, quiet, scale.into(), fill.into());
        let (q, k, v) = (Dense::of(&q), Dense::of(&k), Dense::of(&v));
        launch_forward(&call, [&q, &k, &v], &Dense::of(&mask), spec)
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
        quiet: bool,
        scale: f32,
        fill: f32,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        let call = Call::of(&q, &k, &mask, masked, false);
        let spec = spec_of(masked, causal, quiet, scale.into(), fill.into());
        let (dq, dk, dv) = (
            Dense::empty_like(&q),
            Dense::empty_like(&k),
            Dense::empty_like(&v),
        );
        let (q, k, v) = (Dense::of(&q), Dense::of(&k), Dense::of(&v));
        let saved = [&Dense::of(&out), &Dense::of(&dout), &Dense::of(&lse)];
        launch_backward(
            &call,
            [&q, &k, &v],
            saved,
            &Dense::of(&mask),
            [&dq, &dk, &dv],
            spec,
        );
        (dq.into_tensor(), dk.into_tensor(), dv.into_tensor())
    }

    fn attention_packed_forward(
        qkv: CubeTensor,
        mask: CubeTensor,
        masked: bool,
        causal: bool,
        quiet: bool,
        scale: f32,
        fill: f32,
    ) -> (CubeTensor, CubeTensor) {
        let call = Call::of(&qkv, &qkv, &mask, masked, true);
        let spec = spec_of(masked, causal, quiet, scale.into(), fill.into());
        let qkv = Dense::of(&qkv);
        launch_forward(&call, [&qkv, &qkv, &qkv], &Dense::of(&mask), spec)
    }

    fn attention_packed_backward(
        qkv: CubeTensor,
        out: CubeTensor,
        dout: CubeTensor,
        lse: CubeTensor,
        mask: CubeTensor,
        masked: bool,
        causal: bool,
        quiet: bool,
        scale: f32,
        fill: f32,
    ) -> CubeTensor {
        let call = Call::of(&qkv, &qkv, &mask, masked, true);
        let spec = spec_of(masked, causal, quiet, scale.into(), fill.into());
        // Every element is written: the dQ kernel the queries' heads of every row, the dK/dV
        // kernel the keys' and the values'.
        let dqkv = Dense::empty_like(&qkv);
        let qkv = Dense::of(&qkv);
        let saved = [&Dense::of(&out), &Dense::of(&dout), &Dense::of(&lse)];
        launch_backward(
            &call,
            [&qkv, &qkv, &qkv],
            saved,
            &Dense::of(&mask),
            [&dqkv, &dqkv, &dqkv],
            spec,
        );
        dqkv.into_tensor()
    }
}

/// The forward's launch: `(out, lse)` (dense, `[batch, q_len, heads, dim]` and `[batch, q_len,
/// heads]`) of the operands `q`, `k`, `v` laid out as `call` says (three tensors or one packed
/// tensor bound three times).
fn launch_forward(
    call: &Call,
    [q, k, v]: [&Dense; 3],
    mask: &Dense,
    spec: AttentionSpec,
) -> (CubeTensor, CubeTensor) {
    let AttentionSpec {
        masked,
        causal,
        quiet,
        scale,
        fill,
    } = spec;
    let elem = checked_elem(q.tensor(), "attention");
    let (client, device) = (q.tensor().client.clone(), q.tensor().device.clone());
    let out = Dense::new_empty(
        client.clone(),
        device.clone(),
        Shape::new([call.batch, call.q_len, call.heads, call.dim]),
        q.tensor().dtype,
    );
    let lse = Dense::new_empty(
        client.clone(),
        device,
        Shape::new([call.batch, call.q_len, call.heads]),
        DType::F32,
    );
    if let Some((blocks, arith)) = call.tensor {
        TENSOR_CORE_CALLS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as the kernel below, with the tensor-core kernel's cubes: `SPLIT` planes
        // of `LANES` units (`tensor_cores` checked the device's planes are that size and
        // that it multiplies the tiles of `arith` into f32), `TILE` rows each, its
        // shared arrays sized by `TensorBlocks::for_dim` within the device's limit; its
        // staging vectors of `staging_width` elements divide the rows, the offsets and the
        // buffers' starts, so each is one aligned read of elements the scalar reads covered;
        // its output vectors of `output_width` elements divide a unit's columns, the rows and
        // out's start, so each is one aligned write of elements the scalar writes covered.
        unsafe {
            attention_forward_tc_kernel::launch_unchecked(
                &client,
                call.grid(call.q_len, TILE),
                CubeDim::new_2d(LANES as u32, SPLIT as u32),
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
                call.operands(),
                scale,
                fill,
                call.dim,
                call.staging_width(&[q, k, v]),
                output_width(
                    call.dim,
                    Dense::common_alignment(&[&out], [call.heads * call.dim]),
                    arith.bytes(),
                ),
                blocks.forward_keys,
                masked,
                causal,
                quiet,
                arith.split(),
                tile_elems(elem, arith),
            );
        }
        return (out.into_tensor(), lse.into_tensor());
    }
    // SAFETY: the kernel is instantiated for `elem`, the dtype of q, k, v (the caller
    // checked they agree) and of out (made with it); lse is f32 and the mask i32. A cube
    // reads rows below `q_len` of q and below `k_len` of k and v (dense, `[batch, len,
    // heads, dim]` each or `[batch, len, 3 * heads, dim]` bound three times, the operands'
    // stride and offsets `Call::of` took from that shape, `dim` the kernel's), and the mask, when `masked`, at `b * s0 + h * s1 + i * s2
    // + j` for `b < batch`, `h < heads`, `i < q_len`, `j < k_len`, inside the dense mask
    // whose shape gave the strides (0 along its dimensions of size 1). It writes the rows
    // `i < q_len` of its own block of out and lse, new allocations distinct from the read
    // buffers. Shared memory: `Blocks::for_dim` sized the blocks within the device's limit.
    unsafe {
        attention_forward_kernel::launch_unchecked(
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
            call.operands(),
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

/// The backward's launches: the gradients of `q`, `k`, `v` (laid out as `call` says) into
/// `dq`, `dk`, `dv` (the same layout: three new tensors, or one new packed tensor bound three
/// times, of which each kernel writes its own operands' elements), from the forward's `out`,
/// the output's gradient `dout` and `lse`.
fn launch_backward(
    call: &Call,
    [q, k, v]: [&Dense; 3],
    [out, dout, lse]: [&Dense; 3],
    mask: &Dense,
    [dq, dk, dv]: [&Dense; 3],
    spec: AttentionSpec,
) {
    let AttentionSpec {
        masked,
        causal,
        scale,
        fill,
        ..
    } = spec;
    let elem = checked_elem(q.tensor(), "attention");
    let client = q.tensor().client.clone();
    let delta = Dense::new_empty(
        client.clone(),
        q.tensor().device.clone(),
        lse.tensor().meta.shape().clone(),
        DType::F32,
    );
    if let Some((blocks, arith)) = call.tensor {
        TENSOR_CORE_CALLS.fetch_add(1, Ordering::Relaxed);
        let width = call.staging_width(&[q, k, v, dout]);
        // SAFETY: as the kernels below, with the tensor-core kernels' cubes (`SPLIT` planes
        // of `LANES` units, `TILE` rows or keys each; the device checked by
        // `tensor_cores`, the shared arrays sized by `TensorBlocks::for_dim`, the staging
        // vectors as in the forward, `width` computed over every operand they read).
        unsafe {
            attention_query_grad_tc_kernel::launch_unchecked(
                &client,
                call.grid(call.q_len, TILE),
                CubeDim::new_2d(LANES as u32, SPLIT as u32),
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
                call.operands(),
                scale,
                fill,
                call.dim,
                width,
                blocks.grad_keys,
                masked,
                causal,
                arith.split(),
                tile_elems(elem, arith),
            );
            attention_key_grad_tc_kernel::launch_unchecked(
                &client,
                call.grid(call.k_len, TILE),
                CubeDim::new_2d(LANES as u32, SPLIT as u32),
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
                call.operands(),
                scale,
                fill,
                call.dim,
                width,
                blocks.rows,
                masked,
                causal,
                arith.split(),
                tile_elems(elem, arith),
            );
        }
        return;
    }
    // SAFETY: as in the forward: `elem` for q, k, v, out, dout and the gradients, f32 for
    // lse and delta, i32 for the mask, the same shapes and bounds; the gradients in the
    // operands' layout. The first kernel writes rows `i < q_len` of its block of dq and
    // delta; the second reads delta (after the first, on the same stream) and writes keys
    // `j < k_len` of its block of dk and dv. The written buffers are new allocations,
    // distinct from the read ones; where dq, dk and dv are one packed buffer, each writes
    // only its own operand's heads (offsets `heads * dim` apart, `dim` elements each), so no
    // element is written twice or through two bindings.
    unsafe {
        attention_query_grad_kernel::launch_unchecked(
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
            call.operands(),
            scale,
            fill,
            call.dim,
            call.blocks.keys,
            masked,
            causal,
            elem,
        );
        attention_key_grad_kernel::launch_unchecked(
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
            call.operands(),
            scale,
            fill,
            call.dim,
            call.blocks.rows,
            masked,
            causal,
            elem,
        );
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

    /// The attention of the queries over the keys and values of `qkv` (`[batch, len, 3 *
    /// heads, dim]`, the three in turn), as [`AttentionKernels::attention_packed_forward`]'s
    /// first output; the backward's gradient in `qkv`'s layout.
    fn fused_attention_packed(
        qkv: FloatTensor<Self>,
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

    fn fused_attention_packed(
        qkv: FusedTensor,
        mask: FusedInt,
        masked: bool,
        causal: bool,
        quiet: bool,
        scale: f64,
        fill: f64,
    ) -> FusedTensor {
        forward_packed(qkv, mask, spec_of(masked, causal, quiet, scale, fill)).0
    }
}

/// The packed forward through the fusion kernels: `(out, lse)`.
fn forward_packed(
    qkv: FusedTensor,
    mask: FusedInt,
    spec: AttentionSpec,
) -> (FusedTensor, FusedTensor) {
    count_forward();
    PACKED_CALLS.fetch_add(1, Ordering::Relaxed);
    <Cube as AttentionKernels>::attention_packed_forward(
        qkv,
        mask,
        spec.masked,
        spec.causal,
        spec.quiet,
        spec.scale,
        spec.fill,
    )
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

/// What the packed backward keeps of the forward.
#[derive(Debug, Clone)]
struct SavedPacked {
    qkv: FusedTensor,
    out: FusedTensor,
    lse: FusedTensor,
    mask: FusedInt,
    spec: AttentionSpec,
}

/// The packed backward node: parent qkv.
#[derive(Debug)]
struct PackedAttentionBackward;

impl Backward<Cube, 1> for PackedAttentionBackward {
    type State = SavedPacked;

    fn backward(
        self,
        ops: Ops<SavedPacked, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node] = ops.parents;
        let dout = grads.consume::<Cube>(&ops.node);
        let SavedPacked {
            qkv,
            out,
            lse,
            mask,
            spec,
        } = ops.state;
        let dqkv = <Cube as AttentionKernels>::attention_packed_backward(
            qkv,
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
        if let Some(node) = node {
            grads.register::<Cube>(node.id, dqkv);
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

    fn fused_attention_packed(
        qkv: AutodiffTensor,
        mask: FusedInt,
        masked: bool,
        causal: bool,
        quiet: bool,
        scale: f64,
        fill: f64,
    ) -> AutodiffTensor {
        let (qkv, node) = qkv.into_parts();
        let prepared = PackedAttentionBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful();
        let spec = spec_of(masked, causal, quiet, scale, fill);
        let (out, lse) = forward_packed(qkv.clone(), mask.clone(), spec);
        match prepared {
            OpsKind::Tracked(prep) => prep.finish(
                SavedPacked {
                    qkv,
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
    (q, k, v, mask): super::super::values::AttentionInputs,
    spec: AttentionSpec,
) -> Result<burn::backend::DispatchTensor, Box<super::super::values::AttentionInputs>> {
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

/// The attention of the queries over the keys and values of `qkv` (`[batch, len, 3 * heads,
/// dim]`, the three in turn: self-attention's projections made by one product) with `mask`
/// (as [`attention`]'s), through burn's dispatch: `[batch, len, heads, dim]`. The caller
/// checked what [`attention`]'s caller checks. Never `Err` here (see the stand-in).
pub(crate) fn attention_packed(
    (qkv, mask): super::super::values::PackedAttentionInputs,
    spec: AttentionSpec,
) -> Result<burn::backend::DispatchTensor, Box<super::super::values::PackedAttentionInputs>> {
    Ok(
        <burn::backend::Dispatch as FusedAttentionOps>::fused_attention_packed(
            qkv,
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
    let Some(shared) = super::super::graph::lifecycle::max_shared_memory(device) else {
        return false;
    };
    Blocks::for_dim(dim, shared).is_some()
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::super::super::dense::test_support::*;
    use super::*;

    fn tensor<const D: usize>(values: &[f32], shape: [usize; D], dtype: DType) -> CubeTensor {
        let words: Vec<[u8; 4]> = values.iter().map(|v| v.to_le_bytes()).collect();
        padded(&words, shape, dtype)
    }

    fn read(tensor: &CubeTensor) -> Vec<f32> {
        let n = tensor.meta.shape().num_elements();
        buffer(tensor)[..n].to_vec()
    }

    /// The packed call reads its queries, keys and values where the separate call's tensors
    /// hold them, so it computes the separate call's output, `lse` and gradients bit for bit
    /// (the kernels' arithmetic does not depend on the layout): causal, with a padding mask,
    /// 19 rows (a partial block), 2 heads of 8. The gradient's three parts land in the packed
    /// layout: with the keys' and values' offsets swapped or one head off, they would differ.
    #[test]
    fn packed_equals_separate() {
        let [batch, len, heads, dim] = [2, 19, 2, 8];
        let width = heads * dim;
        let qkv: Vec<f32> = (0..batch * len * 3 * width)
            .map(|i| (i as f32 * 0.61).sin())
            .collect();
        // Part `p` (0 queries, 1 keys, 2 values) of every row.
        let part = |values: &[f32], p: usize| -> Vec<f32> {
            values
                .chunks(3 * width)
                .flat_map(|row| row[p * width..(p + 1) * width].to_vec())
                .collect()
        };
        let shape = [batch, len, heads, dim];
        let [q, k, v] = [0, 1, 2].map(|p| tensor(&part(&qkv, p), shape, DType::F32));
        let packed = tensor(&qkv, [batch, len, 3 * heads, dim], DType::F32);
        let hidden: Vec<[u8; 4]> = (0..batch * len)
            .map(|i| i32::from(i % len >= len - 3).to_le_bytes())
            .collect();
        let mask = || padded(&hidden, [batch, 1, 1, len], DType::I32);
        let (scale, fill) = (0.35, f32::NEG_INFINITY);
        let (out, lse) = <CubeBackend as AttentionKernels>::attention_forward(
            q.clone(),
            k.clone(),
            v.clone(),
            mask(),
            true,
            true,
            false,
            scale,
            fill,
        );
        let (packed_out, packed_lse) = <CubeBackend as AttentionKernels>::attention_packed_forward(
            packed.clone(),
            mask(),
            true,
            true,
            false,
            scale,
            fill,
        );
        assert_eq!(packed_out.meta.shape().dims::<4>(), shape);
        assert_eq!(read(&packed_out), read(&out), "the output");
        assert_eq!(read(&packed_lse), read(&lse), "lse");
        let dout_values: Vec<f32> = (0..batch * len * width)
            .map(|i| (i as f32 * 0.23).cos())
            .collect();
        let dout = || tensor(&dout_values, shape, DType::F32);
        let (dq, dk, dv) = <CubeBackend as AttentionKernels>::attention_backward(
            q,
            k,
            v,
            out.clone(),
            dout(),
            lse.clone(),
            mask(),
            true,
            true,
            false,
            scale,
            fill,
        );
        let dqkv = <CubeBackend as AttentionKernels>::attention_packed_backward(
            packed,
            out,
            dout(),
            lse,
            mask(),
            true,
            true,
            false,
            scale,
            fill,
        );
        let dqkv = read(&dqkv);
        for (p, (what, grad)) in [("dq", dq), ("dk", dk), ("dv", dv)].into_iter().enumerate() {
            assert_eq!(part(&dqkv, p), read(&grad), "{what}");
        }
    }
}
