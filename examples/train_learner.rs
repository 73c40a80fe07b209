//! burn-train's `Learner` training a graphed model: the model implements `GraphedTrainStep` and
//! `GraphedInferenceStep` (its steps, written against the graphed wrapper), and `Learner` takes
//! `Graphed<Mlp, _, _>` like any model. Training steps replay the training graphs, validation
//! the inference graphs.
//!
//! `cargo run --release --example train_learner` (wgpu, where the machine has one; on a
//! machine without a GPU, lavapipe: slow, but graphed), or `--features cuda` for CUDA.

use std::sync::Arc;
use std::time::Instant;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::AdamConfig;
use burn::optim::lr_scheduler::constant::ConstantLr;
use burn::prelude::*;
use burn::train::{
    Learner, RegressionOutput, SupervisedTraining, TrainOutput, logger::InMemoryMetricLogger,
};
use burn_graphed::{Graphed, GraphedConfig, GraphedInferenceStep, GraphedTrainStep, OutputPolicy};

#[derive(Module, Debug)]
struct Mlp {
    hidden: Linear,
    output: Linear,
}

impl Mlp {
    fn new(device: &Device) -> Self {
        Self {
            hidden: LinearConfig::new(64, 64).init(device),
            output: LinearConfig::new(64, 1).init(device),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.output
            .forward(Relu::new().forward(self.hidden.forward(x)))
    }
}

#[derive(Clone, Debug)]
struct Batch {
    x: Tensor<2>,
    y: Tensor<2>,
}

/// Row `i`: 64 features in [-1, 1) and their mean as the target.
struct Rows;

impl Batcher<usize, Batch> for Rows {
    fn batch(&self, items: Vec<usize>, device: &Device) -> Batch {
        let n = items.len();
        let x: Vec<f32> = items
            .iter()
            .flat_map(|&i| (0..64).map(move |j| ((i * 37 + j * 11) % 64) as f32 / 32.0 - 1.0))
            .collect();
        let y: Vec<f32> = x
            .chunks(64)
            .map(|row| row.iter().sum::<f32>() / 64.0)
            .collect();
        Batch {
            x: Tensor::<1>::from_floats(x.as_slice(), device).reshape([n, 64]),
            y: Tensor::<1>::from_floats(y.as_slice(), device).reshape([n, 1]),
        }
    }
}

fn mse(output: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
    (output - y).powi_scalar(2).mean()
}

/// The training step, with `model.forward` replaying the graphs.
impl GraphedTrainStep<Tensor<2>, Tensor<2>> for Mlp {
    type Input = Batch;
    type Output = RegressionOutput;

    fn step(
        model: &Graphed<Self, Tensor<2>, Tensor<2>>,
        batch: Batch,
    ) -> TrainOutput<Self::Output> {
        // `forward` fails only on a call the graphs cannot serve under `MismatchPolicy::Error`
        // or a device error; burn-train's step has no error path, so this stops training.
        let output = model.forward(batch.x).expect("graphed forward");
        let loss = mse(output.clone(), batch.y.clone());
        let item = RegressionOutput::new(loss.clone(), output, batch.y);
        TrainOutput::new(model, loss.backward(), item)
    }
}

/// The validation step, with `model.forward` (after `valid()`) replaying the inference graphs.
impl GraphedInferenceStep<Tensor<2>, Tensor<2>> for Mlp {
    type Input = Batch;
    type Output = RegressionOutput;

    fn step(model: &Graphed<Self, Tensor<2>, Tensor<2>>, batch: Batch) -> RegressionOutput {
        let output = model.forward(batch.x).expect("graphed forward");
        RegressionOutput::new(mse(output.clone(), batch.y.clone()), output, batch.y)
    }
}

fn device() -> Device {
    #[cfg(feature = "cuda")]
    return Device::cuda(0);
    #[cfg(not(feature = "cuda"))]
    Device::wgpu(Default::default())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = device().autodiff();
    let batch_size = 32;
    let sample = Tensor::<2>::zeros([batch_size, 64], &device);
    let start = Instant::now();
    let model = Graphed::new(
        Mlp::new(&device),
        Mlp::forward,
        sample,
        &GraphedConfig::new().with_outputs(OutputPolicy::Copy),
    )?;
    // The epoch's last batch has 8 rows: its graphs are captured now, before the Learner's
    // threads start (on CUDA a capture needs the device to itself).
    let items = batch_size * 20 + 8;
    let prepared = model.prepare(Tensor::<2>::zeros([8, 64], &device))?;
    println!("last batch: {prepared:?}");
    // Validation runs `model.valid()` on the device without autodiff: its inference graphs
    // (batches of 64) are captured now too.
    let inner = device.clone().inner();
    let prepared = model
        .valid()
        .prepare(Tensor::<2>::zeros([64, 64], &inner))?;
    println!("validation batch: {prepared:?}");
    // Every graph the run replays is captured by now: the wait before the first step.
    println!(
        "graphs captured in {:.2} s (the first run compiles and tunes their kernels)",
        start.elapsed().as_secs_f64()
    );

    let loader = |items: usize| -> Arc<dyn DataLoader<Batch>> {
        DataLoaderBuilder::new(Rows)
            .batch_size(batch_size)
            .build(InMemDataset::new((0..items).collect::<Vec<_>>()))
    };
    let dir = std::env::temp_dir().join("burn-graphed-train-learner");
    let learner = Learner::new(model, AdamConfig::new().init(), ConstantLr::new(1e-3));
    let result = SupervisedTraining::new(&dir, loader(items), loader(batch_size * 2))
        .num_epochs(3)
        .with_metric_logger(InMemoryMetricLogger::new())
        .with_application_logger(None)
        .launch(learner);
    if let Some(error) = result.error {
        return Err(format!("training failed: {error}").into());
    }
    let model = result.model;
    // 63 steps (21 per epoch, the last of 8 rows): each replayed the forward and the backward
    // graph of its batch size; 3 validation calls replayed the inference graph; nothing
    // captured during training.
    println!("{:?}", model.stats());
    println!("{:?}", model.stats().shape_cache);
    Ok(())
}
