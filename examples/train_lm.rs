//! A small decoder-only language model trained from token ids, eagerly (burn's `Adam`) and as
//! one graph per training step (`GraphedStep`): token and position embeddings, pre-norm
//! transformer blocks with causal self-attention (a `TransformerEncoder` with a causal mask),
//! a separate output head, and cross-entropy against integer targets. Its layers are
//! `burn_graphed::nn`'s (fused kernels with their own backward, burn-nn's parameters): the
//! `use` lines below are the only difference from the same model on burn-nn's. The graph takes
//! the token ids (`Tensor<2, Int>`), the causal mask (`Tensor<3, Bool>`) and the next-token
//! targets (`Tensor<1, Int>`) and does forward, loss, backward and the Adam update in one
//! replay. Prints step times, the speedup, and both loss curves side by side.
//!
//! `cargo run --release --features cuda --example train_lm -- [width] [layers] [batch] [steps]`
//! on an NVIDIA GPU, `cargo run --example train_lm` on wgpu (software graphs on lavapipe:
//! real captures and replays, not fast ones). The corpus is made here: no download.

#[path = "common/progress.rs"]
mod progress;

use std::time::Instant;

use burn::module::Module;
use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::{EmbeddingConfig, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::prelude::*;
use burn::tensor::{Bool, TensorData};
use burn_graphed::nn::loss::CrossEntropyLossConfig;
use burn_graphed::nn::{
    Embedding, LayerNorm, LayerNormConfig, Linear, TransformerEncoder, TransformerEncoderConfig,
    TransformerEncoderInput,
};
use burn_graphed::{GraphedConfig, GraphedStep};

/// The corpus: a few sentences, repeated with variations, read character by character.
fn corpus() -> String {
    let subjects = [
        "the graph",
        "a kernel",
        "the model",
        "each step",
        "the device",
    ];
    let verbs = ["replays", "records", "trains", "copies", "updates"];
    let objects = [
        "its buffers",
        "the weights",
        "one batch",
        "the loss",
        "every token",
    ];
    let mut text = String::new();
    for i in 0..600 {
        text.push_str(&format!(
            "{} {} {}. ",
            subjects[i % 5],
            verbs[(i / 5) % 5],
            objects[(i / 25) % 5]
        ));
    }
    text
}

#[derive(Module, Debug)]
struct Lm {
    tokens: Embedding,
    positions: Embedding,
    blocks: TransformerEncoder,
    norm: LayerNorm,
    head: Linear,
}

impl Lm {
    fn new(vocab: usize, width: usize, layers: usize, context: usize, device: &Device) -> Self {
        Self {
            // burn-nn's configurations build the embeddings and the head; `into` keeps their
            // parameters in the fused layers.
            tokens: EmbeddingConfig::new(vocab, width).init(device).into(),
            positions: EmbeddingConfig::new(context, width).init(device).into(),
            blocks: TransformerEncoderConfig::new(width, 4 * width, (width / 32).max(2), layers)
                .with_norm_first(true)
                .with_dropout(0.0)
                .init(device),
            norm: LayerNormConfig::new(width).init(device),
            head: LinearConfig::new(width, vocab).init(device).into(),
        }
    }

    /// Logits `[batch, length, vocab]` of token ids `[batch, length]` under the causal mask.
    fn forward(&self, ids: Tensor<2, Int>, mask: Tensor<3, Bool>) -> Tensor<3> {
        let [_, length] = ids.dims();
        let width = self.tokens.weight.dims()[1];
        // The first `length` rows of the position table: no position ids to upload.
        let positions = self
            .positions
            .weight
            .val()
            .slice([0..length, 0..width])
            .unsqueeze::<3>();
        let x = self.tokens.forward(ids) + positions;
        let x = self
            .blocks
            .forward(TransformerEncoderInput::new(x).mask_attn(mask));
        self.head.forward(self.norm.forward(x))
    }
}

/// Token ids, the causal mask, and each position's next token (flattened).
type Batch = (Tensor<2, Int>, Tensor<3, Bool>, Tensor<1, Int>);

/// The step's loss: mean next-token cross-entropy. The whole of it is one graph.
fn lm_loss(model: &Lm, (ids, mask, targets): Batch) -> Tensor<1> {
    let logits = model.forward(ids, mask);
    let [batch, length, vocab] = logits.dims();
    CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits.reshape([batch * length, vocab]), targets)
}

/// `count` batches of `batch` windows of `length + 1` tokens at pseudo-random offsets, under
/// one causal mask (the same tensor in every batch: the graph copies it in once).
fn batches(
    tokens: &[i64],
    batch: usize,
    length: usize,
    count: usize,
    device: &Device,
) -> Vec<Batch> {
    let mask = generate_autoregressive_mask(batch, length, device);
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state as usize % (tokens.len() - length - 1)
    };
    (0..count)
        .map(|_| {
            let (mut ids, mut targets) = (Vec::new(), Vec::new());
            for _ in 0..batch {
                let start = next();
                ids.extend_from_slice(&tokens[start..start + length]);
                targets.extend_from_slice(&tokens[start + 1..start + length + 1]);
            }
            (
                Tensor::from_data(TensorData::new(ids, [batch, length]), device),
                mask.clone(),
                Tensor::from_data(TensorData::new(targets, [batch * length]), device),
            )
        })
        .collect()
}

/// CUDA where a device answers, else wgpu's software graphs; an error naming why where the
/// build has neither (`--no-default-features --features cuda` on a machine without a GPU).
fn pick_device() -> Result<(Device, bool), String> {
    #[cfg(feature = "cuda")]
    if std::panic::catch_unwind(|| {
        cudarc::driver::result::init().is_ok()
            && cudarc::driver::result::device::get_count().is_ok_and(|count| count > 0)
    })
    .unwrap_or(false)
    {
        return Ok((Device::cuda(0), true));
    }
    #[cfg(feature = "wgpu")]
    return Ok((Device::wgpu(Default::default()), false));
    #[allow(unreachable_code)]
    Err("no CUDA device answers, and this build has no `wgpu` feature to fall back on".into())
}

fn arg(index: usize, default: usize) -> usize {
    std::env::args()
        .nth(index)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times.get(times.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    progress::install();
    let (device, cuda) = pick_device()?;
    let (width, layers, batch, steps, length) = if cuda {
        (arg(1, 256), arg(2, 4), arg(3, 16), arg(4, 200), 128)
    } else {
        (arg(1, 32), arg(2, 2), arg(3, 4), arg(4, 20), 32)
    };
    let text = corpus();
    let mut vocab: Vec<char> = text.chars().collect();
    vocab.sort_unstable();
    vocab.dedup();
    let tokens: Vec<i64> = text
        .chars()
        .map(|c| vocab.binary_search(&c).expect("in the vocabulary") as i64)
        .collect();
    println!(
        "device: {}",
        if cuda {
            "CUDA device 0 (CUDA graphs)"
        } else {
            "wgpu (software graphs: real captures, not a GPU's timings)"
        }
    );
    println!(
        "model: {layers} pre-norm blocks, width {width}, vocabulary {} characters, batch \
         {batch} x {length} tokens, corpus {} characters",
        vocab.len(),
        tokens.len()
    );
    let device = device.autodiff();
    device.seed(0);
    let model = Lm::new(vocab.len(), width, layers, length, &device);
    let data = batches(&tokens, batch, length, 8, &device);
    let lr = |step: usize| 1e-3 * (1.0 - step as f64 / (2 * steps) as f64);
    let warmup = 3;

    // Eager: burn's Adam, one backward and one optimizer step per batch.
    let mut eager = burn_graphed_testkit::deep_copy(&model);
    let mut optim = AdamConfig::new().init();
    let (mut eager_times, mut eager_losses) = (Vec::new(), Vec::new());
    for step in 0..steps + warmup {
        let start = Instant::now();
        let (model, loss) =
            progress::eager_step(step, || -> Result<_, Box<dyn std::error::Error>> {
                let loss = lm_loss(&eager, data[step % data.len()].clone());
                let grads = GradientsParams::from_grads(loss.backward(), &eager);
                let model = optim.step(lr(step), eager, grads);
                device.sync()?;
                Ok((model, loss))
            })?;
        eager = model;
        eager_times.push(start.elapsed().as_secs_f64() * 1e6);
        eager_losses.push(loss.into_scalar::<f32>());
    }

    // Graphed: forward, loss, backward and Adam in one graph; the schedule's rate is data.
    let capture = Instant::now();
    let mut step_graph = GraphedStep::new(
        model,
        lm_loss,
        &AdamConfig::new(),
        data[0].clone(),
        &GraphedConfig::new(),
    )?;
    let capture_ms = capture.elapsed().as_secs_f64() * 1e3;
    let (mut graphed_times, mut graphed_losses) = (Vec::new(), Vec::new());
    for step in 0..steps + warmup {
        let start = Instant::now();
        let loss = step_graph.run(data[step % data.len()].clone(), lr(step))?;
        device.sync()?;
        graphed_times.push(start.elapsed().as_secs_f64() * 1e6);
        graphed_losses.push(loss.into_scalar::<f32>());
    }

    let eager_us = median(eager_times.split_off(warmup));
    let graphed_us = median(graphed_times.split_off(warmup));
    println!(
        "first step: eager {:.2} s (compiling and tuning its kernels), one graph per step \
         {:.2} s (capture included; kernels the eager steps compiled are reused)",
        eager_times[0] / 1e6,
        capture_ms / 1e3 + graphed_times[0] / 1e6
    );
    println!("capture: {capture_ms:.0} ms (warm-ups, the recording, replay validation)");
    match burn_graphed::kernel_cache_location() {
        Some(file) => println!(
            "kernel cache: {} (a next run loads what this one compiled and tuned)",
            file.display()
        ),
        None => println!("kernel cache: off (a next run compiles and tunes again)"),
    }
    println!(
        "train step: eager {eager_us:.0} us, one graph per step {graphed_us:.0} us -> {:.2}x \
         (medians over {steps} steps)",
        eager_us / graphed_us
    );
    println!("loss, eager vs graphed:");
    let last = steps + warmup - 1;
    // A few steps, each once (a short run's quarters fall on the first steps).
    let mut shown = vec![0, 1, 2, last / 4, last / 2, 3 * last / 4, last];
    shown.sort_unstable();
    shown.dedup();
    for step in shown {
        println!(
            "  step {step:4}: {:.5} {:.5}",
            eager_losses[step], graphed_losses[step]
        );
    }
    let worst = eager_losses
        .iter()
        .zip(&graphed_losses)
        .map(|(e, g)| ((e - g) / e).abs())
        .fold(0.0f32, f32::max);
    // TF32 products on CUDA and reordered sums make the runs drift apart by rounding only.
    let tolerance = 2e-2;
    println!(
        "largest relative loss difference over {} steps: {worst:.2e} ({})",
        steps + warmup,
        if worst <= tolerance {
            "within tolerance"
        } else {
            "OUTSIDE tolerance"
        }
    );
    let stats = step_graph.stats();
    println!(
        "graphs: {} replays, {} input copies, {} eager steps",
        stats.replays,
        stats.input_copies,
        stats.total_eager()
    );
    // On CUDA the step's graph says how many kernels a replay launches.
    for graph in &stats.graphs {
        if let Some(nodes) = graph.nodes {
            println!("{}: {} kernel nodes", graph.phase, nodes.kernels);
        }
    }
    if worst > tolerance {
        return Err(format!("the graphed losses differ from eager by {worst:e}").into());
    }
    Ok(())
}
