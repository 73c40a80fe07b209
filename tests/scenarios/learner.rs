//! burn-train's `Learner` training a graphed model (`GraphedTrainStep`), against the same
//! `Learner` training the plain model.

use super::*;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::optim::ModuleOptimizer;
use burn::optim::lr_scheduler::constant::ConstantLr;
use burn::train::{
    InferenceStep, Learner, RegressionOutput, SupervisedTraining, TrainOutput, TrainStep,
    logger::InMemoryMetricLogger,
};
use burn_graphed::{GraphedInferenceStep, GraphedTrainStep, OutputPolicy};
use std::sync::Arc;

/// Inputs of 32 features, 8 targets.
#[derive(Clone, Debug)]
pub struct Batch {
    pub x: Tensor<2>,
    pub y: Tensor<2>,
}

/// Batches of deterministic rows: item `i` is row `i` of a fixed table.
struct Rows;

impl Batcher<usize, Batch> for Rows {
    fn batch(&self, items: Vec<usize>, device: &Device) -> Batch {
        let row = |i: usize, width: usize, salt: usize| -> Vec<f32> {
            (0..width)
                .map(|j| ((i * 131 + j * 17 + salt) % 97) as f32 / 48.5 - 1.0)
                .collect()
        };
        let n = items.len();
        let x: Vec<f32> = items.iter().flat_map(|&i| row(i, 32, 0)).collect();
        let y: Vec<f32> = items.iter().flat_map(|&i| row(i, 8, 7)).collect();
        Batch {
            x: Tensor::<1>::from_floats(x.as_slice(), device).reshape([n, 32]),
            y: Tensor::<1>::from_floats(y.as_slice(), device).reshape([n, 8]),
        }
    }
}

/// The loss of `output` against `targets`, and the learner's metrics item.
fn regression(output: Tensor<2>, targets: Tensor<2>) -> (Tensor<1>, RegressionOutput) {
    let loss = (output.clone() - targets.clone()).powi_scalar(2).mean();
    let item = RegressionOutput::new(loss.clone(), output, targets);
    (loss, item)
}

impl TrainStep for Mlp {
    type Input = Batch;
    type Output = RegressionOutput;

    fn step(&self, batch: Batch) -> TrainOutput<RegressionOutput> {
        let (loss, item) = regression(self.forward(batch.x), batch.y);
        TrainOutput::new(self, loss.backward(), item)
    }
}

impl InferenceStep for Mlp {
    type Input = Batch;
    type Output = RegressionOutput;

    fn step(&self, batch: Batch) -> RegressionOutput {
        regression(self.forward(batch.x), batch.y).1
    }
}

impl GraphedTrainStep<Tensor<2>, Tensor<2>> for Mlp {
    type Input = Batch;
    type Output = RegressionOutput;

    fn step(
        model: &Graphed<Self, Tensor<2>, Tensor<2>>,
        batch: Batch,
    ) -> TrainOutput<RegressionOutput> {
        let output = model.forward(batch.x).expect("graphed forward");
        let (loss, item) = regression(output, batch.y);
        TrainOutput::new(model, loss.backward(), item)
    }
}

impl GraphedInferenceStep<Tensor<2>, Tensor<2>> for Mlp {
    type Input = Batch;
    type Output = RegressionOutput;

    fn step(model: &Graphed<Self, Tensor<2>, Tensor<2>>, batch: Batch) -> RegressionOutput {
        let output = model.forward(batch.x).expect("graphed forward");
        regression(output, batch.y).1
    }
}

/// Train and validation loaders over `items` rows, in batches of `batch` (the last one smaller
/// where `items` is not a multiple), in order.
fn loaders(items: usize, batch: usize) -> (Arc<dyn DataLoader<Batch>>, Arc<dyn DataLoader<Batch>>) {
    let loader = |rows: usize| -> Arc<dyn DataLoader<Batch>> {
        DataLoaderBuilder::new(Rows)
            .batch_size(batch)
            .build(InMemDataset::new((0..rows).collect::<Vec<_>>()))
    };
    (loader(items), loader(batch))
}

/// A `Learner` run of `epochs` epochs in a fresh directory, without an application log (the
/// default renderer still prints each split's start); panics if the run ended with an error.
fn fit<M>(
    model: M,
    optimizer: ModuleOptimizer,
    (train, valid): (Arc<dyn DataLoader<Batch>>, Arc<dyn DataLoader<Batch>>),
    epochs: usize,
    name: &str,
) -> M
where
    M: burn::train::LearnerModel + InferenceStep<Input = Batch> + TrainStep<Input = Batch>,
{
    let dir = std::env::temp_dir().join(format!(
        "burn-graphed-learner-{name}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let learner = Learner::new(model, optimizer, ConstantLr::new(1e-2));
    let result = SupervisedTraining::new(&dir, train, valid)
        .num_epochs(epochs)
        .with_metric_logger(InMemoryMetricLogger::new())
        .with_application_logger(None)
        .launch(learner);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(result.error.is_none(), "{name}: {:?}", result.error);
    result.model
}

/// `Learner` trains the graphed MLP like the plain one: 2 epochs of 5 batches of 16 and a last
/// batch of 8, burn's `Adam`; the trained parameters agree, every step of the graphed run
/// replayed its training graphs and every validation call (one batch of 16 per epoch) its
/// inference graph. The last batch's shape and the validation graphs are captured before
/// `launch`, as the steps' docs advise (on CUDA a capture during training may collide with the
/// metrics thread's reads).
pub fn learner_trains_graphed_like_eager(device: &Device) {
    let device = device.clone().autodiff();
    let model = Mlp::new(32, 3, 8, &device);
    let eager = burn_graphed_testkit::deep_copy(&model);
    let mut check = super::ParamsCheck::new(&device, &model);
    let (epochs, items, batch) = (2, 88, 16);
    let sample = Tensor::<2>::zeros([batch, 32], &device);
    let graphed = Graphed::new(
        model,
        mlp_forward,
        sample,
        &GraphedConfig::new().with_outputs(OutputPolicy::Copy),
    )
    .expect("capture");
    // `LearnerModel` needs `Display`: the graphed model shows as the model it wraps.
    assert_eq!(graphed.to_string(), eager.to_string());
    assert!(eager.to_string().contains("params: "), "{eager}");
    let last = Rows.batch((0..items % batch).collect(), &device);
    let primed = graphed
        .forward(last.x)
        .expect("capture of the last batch's shape");
    let _ = primed.powi_scalar(2).mean().backward();
    let validation = Tensor::<2>::zeros([batch, 32], &device.clone().inner());
    let prepared = graphed
        .valid()
        .prepare(validation)
        .expect("validation graphs");
    let graphed = fit(
        graphed,
        adam_config().init(),
        loaders(items, batch),
        epochs,
        "graphed",
    );
    let eager = fit(
        eager,
        adam_config().init(),
        loaders(items, batch),
        epochs,
        "eager",
    );
    // Relative to how far the eager model moved from `start` (its net distance: `Learner`'s
    // steps are not seen one by one, which makes the bound tighter than the path's).
    check.assert("learner", &eager, &graphed);

    let stats = graphed.stats();
    let cache = graphed.stats().shape_cache;
    println!("learner: {stats:?}; {cache:?}");
    let steps = (epochs * items.div_ceil(batch)) as u64;
    if graphed.summary().graphed {
        // The priming call and every step replayed, forward and backward, and every
        // validation call its inference graph; the captures of a new shape and of the
        // validation graphs were before `launch`.
        assert_eq!(prepared, burn_graphed::Prepared::Captured);
        assert_eq!(
            stats.forward_replays,
            steps + 1 + epochs as u64,
            "{stats:?}"
        );
        assert_eq!(stats.backward_replays, steps + 1, "{stats:?}");
        assert!(stats.eager.is_empty(), "{stats:?}");
        assert_eq!(cache.captures, 2, "{cache:?}");
        // `Learner` steps a clone of the model while holding the original: every step's new
        // parameters are copied into the graphs on the next call.
        assert!(stats.param_copies >= steps, "{stats:?}");
    } else {
        assert_eq!(
            prepared,
            burn_graphed::Prepared::Eager(EagerReason::Unsupported)
        );
        assert_eq!(stats.forward_replays, 0, "{stats:?}");
    }
}
