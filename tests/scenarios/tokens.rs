//! Token-id models: int and bool tensors into and out of graphed calls and whole steps. A small
//! language model takes token ids (`Tensor<2, Int>`) and a causal mask (`Tensor<3, Bool>`),
//! returns its cross-entropy loss against integer targets (`Tensor<1, Int>`) and its argmax
//! predictions (`Tensor<2, Int>`), all inside one graph.

use std::fmt::Write;

use burn::nn::attention::{
    MhaInput, MultiHeadAttention, MultiHeadAttentionConfig, generate_autoregressive_mask,
};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::Bool;
use burn_graphed::{
    Callable, Graphed, GraphedConfig, GraphedError, MismatchPolicy, make_graphed_callables,
};
use burn_graphed_testkit::{
    TrainingComparison, WholeStepComparison, compare_training, compare_whole_step,
};

use super::{adam_config, supports_graphs, tolerance_for};

/// Tokens of the vocabulary.
pub const VOCAB: usize = 13;
const WIDTH: usize = 8;

/// Token embedding, one pre-norm causal self-attention block with a residual, and an output
/// head.
#[derive(Module, Debug)]
pub struct TinyLm {
    embed: Embedding,
    norm: LayerNorm,
    attention: MultiHeadAttention,
    head: Linear,
}

impl TinyLm {
    pub fn new(device: &Device) -> Self {
        Self {
            embed: EmbeddingConfig::new(VOCAB, WIDTH).init(device),
            norm: LayerNormConfig::new(WIDTH).init(device),
            attention: MultiHeadAttentionConfig::new(WIDTH, 2)
                .with_dropout(0.0)
                .init(device),
            head: LinearConfig::new(WIDTH, VOCAB).init(device),
        }
    }
}

/// Token ids, the causal mask, and the next-token targets (flattened).
pub type TokenBatch = (Tensor<2, Int>, Tensor<3, Bool>, Tensor<1, Int>);

/// The loss (mean cross-entropy of the next token) and the argmax predictions.
pub fn tiny_lm_forward(
    model: &TinyLm,
    (ids, mask, targets): TokenBatch,
) -> (Tensor<1>, Tensor<2, Int>) {
    let x = model.embed.forward(ids);
    let attended = model
        .attention
        .forward(MhaInput::self_attn(model.norm.forward(x.clone())).mask_attn(mask))
        .context;
    let logits = model.head.forward(x + attended);
    let [rows, length, vocab] = logits.dims();
    let predictions = logits.clone().argmax(2).reshape([rows, length]);
    let loss = CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits.reshape([rows * length, vocab]), targets);
    (loss, predictions)
}

/// The loss alone: a whole step's loss function.
pub fn tiny_lm_loss(model: &TinyLm, batch: TokenBatch) -> Tensor<1> {
    tiny_lm_forward(model, batch).0
}

fn first_output((loss, _): (Tensor<1>, Tensor<2, Int>)) -> Tensor<1> {
    loss
}

/// `rows` sequences of `length` tokens, made from `step` (every step its own): ids, the
/// causal mask, and each position's next token as its target.
pub fn token_batch(device: &Device, rows: usize, length: usize, step: usize) -> TokenBatch {
    let token = |row: usize, position: usize| (row * 5 + position * 3 + step * 7 + 1) % VOCAB;
    let ids: Vec<i64> = (0..rows * length)
        .map(|i| token(i / length, i % length) as i64)
        .collect();
    let targets: Vec<i64> = (0..rows * length)
        .map(|i| token(i / length, i % length + 1) as i64)
        .collect();
    (
        Tensor::from_data(TensorData::new(ids, [rows, length]), device),
        generate_autoregressive_mask(rows, length, device),
        Tensor::from_data(TensorData::new(targets, [rows * length]), device),
    )
}

/// Twenty-odd steps of the language model, graphed (ids, mask and targets in; loss and
/// predictions out) against eager, with burn's Adam: every output (the int predictions
/// exactly), the loss, every gradient and every parameter after each step.
pub fn token_model_matches_eager(device: &Device, steps: usize) {
    const LEARNING_RATE: f64 = 1e-2;
    let device = device.clone().autodiff();
    let tolerance = tolerance_for(&device);
    let report = compare_training(TrainingComparison {
        model: TinyLm::new(&device),
        call: tiny_lm_forward,
        optimizer: adam_config().init(),
        learning_rate: LEARNING_RATE,
        batch: &mut |step| token_batch(&device, 3, 6, if step == usize::MAX { 0 } else { step }),
        loss: first_output,
        steps,
        graphed: GraphedConfig::new(),
        tolerance,
        // The key projection's bias has a gradient of rounding noise (softmax ignores a
        // constant added to a query's scores): Adam moves it by at most lr abs / epsilon a step.
        noise_step: LEARNING_RATE * tolerance.abs / f64::from(super::ADAM_EPSILON),
    })
    .expect("comparison runs");
    println!("token model: {report}");
    assert!(report.passed(), "{report}");
    if supports_graphs(&device) {
        assert!(report.summary.graphed);
        assert_eq!(report.summary.inputs, 3);
        assert_eq!(report.summary.inputs_requiring_grad, 0);
        assert_eq!(report.summary.outputs, 2);
        assert_eq!(report.stats.forward_replays, steps as u64);
        assert_eq!(report.stats.backward_replays, steps as u64);
        assert!(report.stats.eager.is_empty(), "{:?}", report.stats);
    }
}

/// The language model in whole steps (forward from ids, cross-entropy, backward, Adam in one
/// graph) against eager training with burn's Adam, with sequences of two lengths through the
/// shape cache.
pub fn token_whole_step_matches_eager(device: &Device, steps: usize) {
    let device = device.clone().autodiff();
    let lengths = [6, 6, 5];
    let report = compare_whole_step(WholeStepComparison {
        model: TinyLm::new(&device),
        twin: None,
        loss: tiny_lm_loss,
        optimizer: super::whole_step::adam(),
        clipping: None,
        batches: &mut |step| vec![token_batch(&device, 3, lengths[step % lengths.len()], step)],
        learning_rate: &|step| 1e-2 * 0.9f64.powi(step as i32),
        steps,
        graphed: GraphedConfig::new(),
        tolerance: tolerance_for(&device),
    })
    .expect("whole step");
    assert!(report.report.passed(), "{}", report.report);
    if supports_graphs(&device) {
        assert_eq!(report.stats.total_eager(), 0, "{:?}", report.stats);
        assert_eq!(report.stats.replays, steps as u64);
        assert_eq!(report.stats.shape_cache.graphs, 2, "one graph per length");
    }
}

/// The first callable of a token group: embeds the ids and passes the padding mask on, as it
/// is and as a view (`unsqueeze` keeps the buffer).
fn embed_and_pass(
    model: &TinyLm,
    (ids, mask): (Tensor<2, Int>, Tensor<2, Bool>),
) -> (Tensor<3>, Tensor<2, Bool>, Tensor<3, Bool>) {
    let view = mask.clone().unsqueeze_dim::<3>(2);
    (model.embed.forward(ids), mask, view)
}

/// The second callable, chained: zeroes the masked positions (through both masks) and returns
/// the mean square of the head's logits.
fn masked_head(
    model: &TinyLm,
    (hidden, mask, view): (Tensor<3>, Tensor<2, Bool>, Tensor<3, Bool>),
) -> Tensor<1> {
    let keep = view.bool_not().float();
    let hidden = (hidden * keep).mask_fill(mask.unsqueeze_dim::<3>(2), 0.0);
    model.head.forward(hidden).powi_scalar(2).mean()
}

/// Ids and a padding mask (the last `pad` positions of every row masked).
fn ids_and_mask(device: &Device, step: usize, pad: usize) -> (Tensor<2, Int>, Tensor<2, Bool>) {
    let (ids, _, _) = token_batch(device, 3, 6, step);
    let flags: Vec<bool> = (0..18).map(|i| i % 6 >= 6 - pad).collect();
    (
        ids,
        Tensor::from_data(TensorData::new(flags, [3, 6]), device),
    )
}

/// A group whose first callable passes a bool mask on to the second, chained one, as it is and
/// as a view: each mask output gets a buffer of its own, every call replays under the default
/// (guarded) hand-outs, and losses and gradients equal eager's.
pub fn token_group_passes_a_mask_on(device: &Device) {
    let device = device.clone().autodiff();
    let (first, second) = (TinyLm::new(&device), TinyLm::new(&device));
    let (first_e, second_e) = (
        burn_graphed_testkit::deep_copy(&first),
        burn_graphed_testkit::deep_copy(&second),
    );
    let (first_g, second_g) = make_graphed_callables(
        (
            Callable::new(first, embed_and_pass, ids_and_mask(&device, 0, 1)),
            Callable::chained(second, masked_head),
        ),
        &GraphedConfig::new(),
    )
    .expect("capture");
    let tolerance = tolerance_for(&device);
    for step in 1..5 {
        let batch = ids_and_mask(&device, step, step % 3);
        let loss_e = masked_head(&second_e, embed_and_pass(&first_e, batch.clone()));
        let passed = first_g.forward(batch).expect("first");
        let loss_g = second_g.forward(passed).expect("second");
        let read = |loss: &Tensor<1>| loss.clone().inner().into_data();
        let losses = burn_graphed_testkit::TensorComparison::new(
            format!("step {step} loss"),
            &read(&loss_e),
            &read(&loss_g),
            tolerance,
        );
        assert!(losses.passed(), "{losses}");
        let (mut ge, mut gg) = (loss_e.backward(), loss_g.backward());
        let first_grads = (
            GradientsParams::from_module(&mut ge, &first_e),
            GradientsParams::from_module(&mut gg, &first_g),
        );
        super::assert_grads_close(
            &format!("step {step} first"),
            (&first_e, &first_grads.0),
            (&first_g, &first_grads.1),
            tolerance,
        );
        let second_grads = (
            GradientsParams::from_module(&mut ge, &second_e),
            GradientsParams::from_module(&mut gg, &second_g),
        );
        super::assert_grads_close(
            &format!("step {step} second"),
            (&second_e, &second_grads.0),
            (&second_g, &second_grads.1),
            tolerance,
        );
    }
    if supports_graphs(&device) {
        for (name, stats) in [("first", first_g.stats()), ("second", second_g.stats())] {
            assert_eq!(stats.forward_replays, 4, "{name}: {stats:?}");
            assert_eq!(stats.total_eager(), 0, "{name}: {stats:?}");
        }
    }
}

/// A model whose only outputs are ints: nothing carries a gradient back.
fn predictions_only(model: &TinyLm, batch: TokenBatch) -> Tensor<2, Int> {
    tiny_lm_forward(model, batch).1
}

/// A callable that returns a float tensor, to chain an int-taking callable to.
fn float_out(model: &TinyLm, (ids, _, _): TokenBatch) -> Tensor<3> {
    model.embed.forward(ids)
}

/// A callable that takes int ids, chained to one that returns floats.
fn ids_in(model: &TinyLm, ids: Tensor<2, Int>) -> Tensor<3> {
    model.embed.forward(ids)
}

/// What a token model's capture holds, what calls with another sequence length do under each
/// policy, and the errors of bad uses, snapshotted (`token_facts_graphed` where the device
/// captures, `token_facts_eager` on Flex). A refused call leaves the parameters untouched.
pub fn token_facts(device: &Device) {
    let device = device.clone().autodiff();
    let mut facts = String::new();
    let graphs = supports_graphs(&device);
    let config = GraphedConfig::new().with_max_graphs(1);
    let graphed = Graphed::new(
        TinyLm::new(&device),
        tiny_lm_forward,
        token_batch(&device, 3, 6, 0),
        &config,
    )
    .expect("capture");
    let summary = graphed.summary();
    writeln!(
        facts,
        "capture: graphed {}, inputs {} ({} require grad), outputs {}, params {}",
        summary.graphed,
        summary.inputs,
        summary.inputs_requiring_grad,
        summary.outputs,
        summary.params
    )
    .unwrap();
    let (loss, predictions) = graphed
        .forward(token_batch(&device, 3, 6, 1))
        .expect("call");
    writeln!(
        facts,
        "outputs: loss {:?} {:?}, predictions {:?} {:?}, loss requires grad {}",
        loss.dtype(),
        loss.dims(),
        predictions.dtype(),
        predictions.dims(),
        loss.is_tracked() || !graphs
    )
    .unwrap();
    drop(predictions);
    let _ = loss.backward();
    let (loss, _) = graphed
        .forward(token_batch(&device, 3, 5, 2))
        .expect("another length runs eagerly");
    let _ = loss.backward();
    // One causal mask broadcast over the batch: a mask of another shape that the model takes.
    let (ids, _, targets) = token_batch(&device, 3, 6, 3);
    let (loss, _) = graphed
        .forward((ids, generate_autoregressive_mask(1, 6, &device), targets))
        .expect("a broadcast mask runs eagerly");
    let _ = loss.backward();
    let stats = graphed.stats();
    writeln!(
        facts,
        "after calls of length 6, of length 5 and with a mask of one row (max_graphs 1): \
         replays {}, eager {:?}",
        stats.forward_replays, stats.eager
    )
    .unwrap();

    let strict = Graphed::new(
        TinyLm::new(&device),
        tiny_lm_forward,
        token_batch(&device, 3, 6, 0),
        &config.clone().with_on_mismatch(MismatchPolicy::Error),
    )
    .expect("capture");
    let before = burn_graphed_testkit::param_values(&strict).expect("read back");
    let (ids, _, targets) = token_batch(&device, 3, 6, 3);
    let other_mask = generate_autoregressive_mask(1, 6, &device);
    let refused = strict.forward((ids, other_mask, targets));
    writeln!(facts, "errors:").unwrap();
    writeln!(facts, "  mask of another shape: {}", error_text(refused)).unwrap();
    let after = burn_graphed_testkit::param_values(&strict).expect("read back");
    writeln!(
        facts,
        "  parameters untouched by the refused call: {}",
        before == after
    )
    .unwrap();
    let int_only = Graphed::new(
        TinyLm::new(&device),
        predictions_only,
        token_batch(&device, 3, 6, 0),
        &GraphedConfig::new(),
    );
    writeln!(facts, "  only int outputs: {}", error_text(int_only)).unwrap();
    let model = TinyLm::new(&device);
    let chained = make_graphed_callables(
        (
            Callable::new(model.clone(), float_out, token_batch(&device, 3, 6, 0)),
            Callable::chained(model, ids_in),
        ),
        &GraphedConfig::new(),
    );
    writeln!(
        facts,
        "  float output chained into int input: {}",
        error_text(chained)
    )
    .unwrap();

    // A bool's storage is the backend's (u32 on wgpu, u8 on CUDA); the facts are the same.
    let facts = facts
        .replace("Bool(U32)", "Bool(..)")
        .replace("Bool(U8)", "Bool(..)");
    let name = if graphs {
        "token_facts_graphed"
    } else {
        "token_facts_eager"
    };
    super::facts::snapshot(name, &facts);
}

fn error_text<T>(result: Result<T, GraphedError>) -> String {
    match result {
        Ok(_) => "no error".to_string(),
        Err(error) => error.to_string(),
    }
}
