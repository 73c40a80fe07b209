//! The bench's models (`mlp`, `transformer`, `cnn`, `lm` and their `_fused` variants): their
//! layers, forward calls, inputs and losses.

use super::*;

#[derive(Module, Debug)]
pub(crate) struct Mlp {
    pub(crate) layers: Vec<Linear>,
}

/// The bench's MLP, 8 x Linear(256, 256), its weights stored in `layout`.
pub(crate) fn mlp_of(layout: LinearLayout, device: &Device) -> Mlp {
    Mlp {
        layers: (0..8)
            .map(|_| LinearConfig::new(256, 256).with_layout(layout).init(device))
            .collect(),
    }
}

/// The `mlp` with `burn_graphed::nn::Linear` layers (`mlp_fused`): the same parameters; each
/// layer's ReLU in its product's launch; on at most 8 rows (the batch-1 inference modes) its
/// layers run their own kernel, on more cuBLASLt on CUDA.
#[derive(Module, Debug)]
pub(crate) struct FusedMlp {
    pub(crate) layers: Vec<burn_graphed::nn::Linear>,
}

/// [`mlp_forward`] with each layer's ReLU in its product's launch (`Linear::forward_relu`).
pub(crate) fn fused_mlp_forward(m: &FusedMlp, mut x: Tensor<2>) -> Tensor<2> {
    for layer in &m.layers {
        x = layer.forward_relu(x);
    }
    x
}

pub(crate) fn mlp_forward(m: &Mlp, mut x: Tensor<2>) -> Tensor<2> {
    for layer in &m.layers {
        x = Relu::new().forward(layer.forward(x));
    }
    x
}

#[derive(Module, Debug)]
pub(crate) struct Encoder {
    pub(crate) encoder: TransformerEncoder,
}

pub(crate) fn encoder_forward(m: &Encoder, x: Tensor<3>) -> Tensor<3> {
    m.encoder.forward(TransformerEncoderInput::new(x))
}

/// The `transformer` with `burn_graphed::nn`'s fused layers: burn-nn's encoder, initialized
/// alike, converted (the same parameters, layer norms fused).
#[derive(Module, Debug)]
pub(crate) struct FusedEncoder {
    pub(crate) encoder: burn_graphed::nn::TransformerEncoder,
}

pub(crate) fn fused_encoder_forward(m: &FusedEncoder, x: Tensor<3>) -> Tensor<3> {
    m.encoder
        .forward(burn_graphed::nn::TransformerEncoderInput::new(x))
}

#[derive(Module, Debug)]
pub(crate) struct Cnn {
    pub(crate) conv1: Conv2d,
    pub(crate) conv2: Conv2d,
    pub(crate) pool: AdaptiveAvgPool2d,
    pub(crate) head: Linear,
}

pub(crate) fn cnn_forward(m: &Cnn, x: Tensor<4>) -> Tensor<2> {
    let x = Relu::new().forward(m.conv1.forward(x));
    let x = Relu::new().forward(m.conv2.forward(x));
    let x = m.pool.forward(x).flatten::<2>(1, 3);
    m.head.forward(x)
}

/// The `cnn` model: two 3x3 convolutions (3 -> 16 -> 32 channels, padding 1), ReLU, global
/// average pooling and a linear head (`torch_reference.py`'s `Cnn`).
pub(crate) fn make_cnn(d: &Device) -> Cnn {
    Cnn {
        conv1: Conv2dConfig::new([3, 16], [3, 3])
            .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
            .init(d),
        conv2: Conv2dConfig::new([16, 32], [3, 3])
            .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
            .init(d),
        pool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
        head: LinearConfig::new(32, 10).init(d),
    }
}

/// A batch of the `cnn`'s `[rows, 3, 32, 32]` images.
pub(crate) fn cnn_input(d: &Device, rows: usize) -> Tensor<4> {
    Tensor::random([rows, 3, 32, 32], Distribution::Default, d)
}

/// A `[rows, 256]` batch of the MLPs for the forward alone, uniform in `[0, k)` where `k` counts
/// the batches made so far on this thread (1, 2, ...): at one row in `bf16` two batches of
/// noise at one scale came out of the eight layers as close as the check's allowance, so that
/// its stale batch would pass for the right one (as [`cnn_forward_batch`]).
pub(crate) fn mlp_forward_batch(d: &Device, rows: usize) -> Tensor<2> {
    Tensor::random([rows, 256], Distribution::Uniform(0.0, next_scale()), d)
}

/// 1, 2, ...: the batches made so far on this thread by the forward batches of distinct
/// scales ([`mlp_forward_batch`], [`cnn_forward_batch`]).
fn next_scale() -> f64 {
    thread_local! {
        static MADE: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    }
    MADE.with(|made| {
        made.set(made.get() + 1);
        f64::from(made.get())
    })
}

/// A batch of the `cnn`'s images for the forward alone, uniform in `[0, k)` where `k` counts the
/// batches made so far on this thread (1, 2, ...): after the global average pool two batches of
/// noise at one scale give outputs closer than `bf16`'s allowance, so that the check's stale
/// batch would pass for the right one; at scales of their own they differ.
pub(crate) fn cnn_forward_batch(d: &Device, rows: usize) -> Tensor<4> {
    Tensor::random(
        [rows, 3, 32, 32],
        Distribution::Uniform(0.0, next_scale()),
        d,
    )
}

/// The `cnn` with `burn_graphed::nn`'s `Conv2d` and `Linear` layers (`cnn_fused`), converted
/// from [`make_cnn`]'s model: the same parameters.
#[derive(Module, Debug)]
pub(crate) struct FusedCnn {
    pub(crate) conv1: burn_graphed::nn::Conv2d,
    pub(crate) conv2: burn_graphed::nn::Conv2d,
    pub(crate) pool: AdaptiveAvgPool2d,
    pub(crate) head: burn_graphed::nn::Linear,
}

pub(crate) fn fused_cnn_forward(m: &FusedCnn, x: Tensor<4>) -> Tensor<2> {
    let x = Relu::new().forward(m.conv1.forward(x));
    let x = Relu::new().forward(m.conv2.forward(x));
    let x = m.pool.forward(x).flatten::<2>(1, 3);
    m.head.forward(x)
}

pub(crate) fn mean_square<const D: usize>(y: Tensor<D>) -> Tensor<1> {
    y.powi_scalar(2).mean()
}

/// The `lm` model: token and learned position embeddings, pre-norm transformer blocks under a
/// causal mask, a final norm and an output head (`torch_reference.py`'s `Lm`).
#[derive(Module, Debug)]
pub(crate) struct Lm {
    pub(crate) tokens: Embedding,
    pub(crate) positions: Embedding,
    pub(crate) blocks: TransformerEncoder,
    pub(crate) norm: LayerNorm,
    pub(crate) head: Linear,
}

pub(crate) const LM_VOCAB: usize = 512;
pub(crate) const LM_LENGTH: usize = 128;
pub(crate) const LM_BATCH: usize = 8;

/// Token ids, the causal mask and the next-token targets (flattened).
pub(crate) type LmBatch = (Tensor<2, Int>, Tensor<3, Bool>, Tensor<1, Int>);

pub(crate) fn make_lm(device: &Device) -> Lm {
    Lm {
        tokens: EmbeddingConfig::new(LM_VOCAB, 256).init(device),
        positions: EmbeddingConfig::new(LM_LENGTH, 256).init(device),
        blocks: TransformerEncoderConfig::new(256, 1024, 8, 2)
            .with_norm_first(true)
            .with_dropout(0.0)
            .init(device),
        norm: LayerNormConfig::new(256).init(device),
        head: LinearConfig::new(256, LM_VOCAB).init(device),
    }
}

/// The `lm` with `burn_graphed::nn`'s fused layers (token embedding, blocks, final norm and
/// head; its loss is the fused cross-entropy, [`fused_lm_loss_of`]), converted from
/// [`make_lm`]'s model: the same parameters.
#[derive(Module, Debug)]
pub(crate) struct FusedLm {
    pub(crate) tokens: burn_graphed::nn::Embedding,
    pub(crate) positions: Embedding,
    pub(crate) blocks: burn_graphed::nn::TransformerEncoder,
    pub(crate) norm: burn_graphed::nn::LayerNorm,
    pub(crate) head: burn_graphed::nn::Linear,
}

pub(crate) fn make_fused_lm(device: &Device) -> FusedLm {
    let lm = make_lm(device);
    FusedLm {
        tokens: lm.tokens.into(),
        positions: lm.positions,
        blocks: burn_graphed::nn::TransformerEncoder::from_burn(lm.blocks, 1e-5),
        norm: burn_graphed::nn::LayerNorm::from_burn(lm.norm, 1e-5),
        head: lm.head.into(),
    }
}

/// [`lm_forward`] of the fused model.
pub(crate) fn fused_lm_forward(m: &FusedLm, (ids, mask, _targets): LmBatch) -> Tensor<3> {
    let [_, length] = ids.dims();
    let positions = m.positions.weight.val().slice([0..length, 0..256]);
    let x = m.tokens.forward(ids) + positions.unsqueeze::<3>();
    let x = m
        .blocks
        .forward(burn_graphed::nn::TransformerEncoderInput::new(x).mask_attn(mask));
    m.head.forward(m.norm.forward(x))
}

/// Rank `rank`'s language-model batch made from a draw (a data-parallel value check): every id
/// and target shifted by `rank * 97` in the vocabulary, so that the ranks train other rows of
/// the embedding and the head.
pub(crate) fn lm_shard((ids, mask, targets): LmBatch, rank: usize) -> LmBatch {
    let shift = (rank * 97) as i64;
    let vocab = LM_VOCAB as i64;
    (
        (ids + shift).remainder_scalar(vocab),
        mask,
        (targets + shift).remainder_scalar(vocab),
    )
}

/// The logits of the ids under the mask (the targets are the loss's).
pub(crate) fn lm_forward(m: &Lm, (ids, mask, _targets): LmBatch) -> Tensor<3> {
    let [_, length] = ids.dims();
    let positions = m.positions.weight.val().slice([0..length, 0..256]);
    let x = m.tokens.forward(ids) + positions.unsqueeze::<3>();
    let x = m
        .blocks
        .forward(TransformerEncoderInput::new(x).mask_attn(mask));
    m.head.forward(m.norm.forward(x))
}

/// Mean next-token cross-entropy of `logits` against the batch's targets.
pub(crate) fn lm_loss_of(logits: Tensor<3>, batch: &LmBatch) -> Tensor<1> {
    let [rows, length, vocab] = logits.dims();
    CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits.reshape([rows * length, vocab]), batch.2.clone())
}

/// [`lm_loss_of`] with `burn_graphed::nn`'s fused cross-entropy (the `lm_fused` model).
pub(crate) fn fused_lm_loss_of(logits: Tensor<3>, batch: &LmBatch) -> Tensor<1> {
    let [rows, length, vocab] = logits.dims();
    burn_graphed::nn::loss::CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits.reshape([rows * length, vocab]), batch.2.clone())
}

/// Tensors kept per batch size and device on this thread (made once per process).
type PerSize<T> = std::thread::LocalKey<std::cell::RefCell<Vec<(usize, Device, T)>>>;

/// The tensor `kept` holds for `rows` rows on `device`, made by `make` (and kept) the first
/// time.
fn kept_per_size<T: Clone>(
    kept: &'static PerSize<T>,
    rows: usize,
    device: &Device,
    make: impl FnOnce() -> T,
) -> T {
    kept.with(|kept| {
        let mut kept = kept.borrow_mut();
        if let Some((.., value)) = kept.iter().find(|(r, d, _)| *r == rows && d == device) {
            return value.clone();
        }
        let value = make();
        kept.push((rows, device.clone(), value.clone()));
        value
    })
}

/// A batch of `rows` rows of random ids and targets under one causal mask shared by every batch
/// of that size and device (made once per process), so that the graphs copy it in once, as
/// PyTorch's model holds its mask.
pub(crate) fn lm_batch(device: &Device, rows: usize) -> LmBatch {
    thread_local! {
        static MASKS: std::cell::RefCell<Vec<(usize, Device, Tensor<3, Bool>)>> =
            const { std::cell::RefCell::new(Vec::new()) };
    }
    let mask = kept_per_size(&MASKS, rows, device, || {
        generate_autoregressive_mask(rows, LM_LENGTH, device)
    });
    // Drawn as ints: floats drawn in bf16 and cast would round ids near the top to VOCAB.
    let ids = || {
        Tensor::<1, Int>::random(
            [rows * LM_LENGTH],
            Distribution::Uniform(0.0, LM_VOCAB as f64),
            device,
        )
    };
    (ids().reshape([rows, LM_LENGTH]), mask, ids())
}

/// A batch for the forward alone ([`lm_forward`] reads no targets): new ids, with the mask and
/// the targets shared by every such batch of that size and device (made once per process), so
/// that an inference graph copies in the ids alone, as PyTorch's graphed forward takes them.
pub(crate) fn lm_forward_batch(device: &Device, rows: usize) -> LmBatch {
    thread_local! {
        static TARGETS: std::cell::RefCell<Vec<(usize, Device, Tensor<1, Int>)>> =
            const { std::cell::RefCell::new(Vec::new()) };
    }
    let (ids, mask, targets) = lm_batch(device, rows);
    (ids, mask, kept_per_size(&TARGETS, rows, device, || targets))
}

/// [`mean_square`] as the loss of a call on a batch that holds no targets.
pub(crate) fn mean_square_of<const D: usize, I>(y: Tensor<D>, _batch: &I) -> Tensor<1> {
    mean_square(y)
}
