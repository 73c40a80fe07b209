//! burn's `BatchNorm` in training mode: its running statistics are float state that the forward
//! updates and no optimizer trains (`RunningState`), so a graph must either keep them up to date
//! or refuse the model.

use burn::module::Module;
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, Relu};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::prelude::*;
use burn::tensor::TensorData;
use burn_graphed::{EagerReason, Graphed, GraphedConfig, GraphedError, GraphedStep};
use burn_graphed_testkit::{TensorComparison, Tolerance, deep_copy, host_data, param_values};

use super::{adam_config, kernels_may_differ, supports_graphs, tolerance_for};

/// Linear(8, 16), burn's `BatchNorm` over the 16 features, ReLU, Linear(16, 4).
#[derive(Module, Debug)]
pub struct NormNet {
    pub input: Linear,
    pub norm: BatchNorm,
    pub head: Linear,
}

impl NormNet {
    pub fn new(device: &Device) -> Self {
        Self {
            input: LinearConfig::new(8, 16).init(device),
            norm: BatchNormConfig::new(16).init(device),
            head: LinearConfig::new(16, 4).init(device),
        }
    }

    /// A second model with this one's values, sharing nothing with it. Not `deep_copy`: a
    /// `RunningState` keeps its value behind an `Arc` that every clone shares, and mapping a
    /// clone (as `deep_copy` does) writes the new value into that shared state, so a deep copy
    /// of a batch-norm model would share its running statistics with the original. burn's
    /// `BatchNorm` starts from constants (weights 1, biases 0, mean 0, variance 1): a new one is
    /// a copy of an untrained one.
    pub fn twin(&self, device: &Device) -> Self {
        Self {
            input: deep_copy(&self.input),
            norm: BatchNormConfig::new(16).init(device),
            head: deep_copy(&self.head),
        }
    }

    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = self.norm.forward(self.input.forward(x));
        self.head.forward(Relu::new().forward(h))
    }
}

fn norm_forward(model: &NormNet, x: Tensor<2>) -> Tensor<2> {
    model.forward(x)
}

fn norm_mse(model: &NormNet, (x, target): (Tensor<2>, Tensor<2>)) -> Tensor<1> {
    (model.forward(x) - target).powi_scalar(2).mean()
}

/// Step `step`'s batch: 8 rows whose features have means and spreads far from the running
/// statistics' start (0 and 1), and that change from step to step, so that every update moves
/// them.
fn norm_batch(device: &Device, step: usize) -> (Tensor<2>, Tensor<2>) {
    let rows = 8;
    let x: Vec<f32> = (0..rows * 8)
        .map(|i| {
            let (row, col) = (i / 8, i % 8);
            let wave = ((row * 7 + col * 3 + step * 5) % 13) as f32 / 13.0 - 0.5;
            1.5 + col as f32 * 0.5 + (1.0 + step as f32 * 0.25) * 3.0 * wave
        })
        .collect();
    let target: Vec<f32> = (0..rows * 4)
        .map(|i| ((i * 5 + step * 3) % 11) as f32 / 11.0)
        .collect();
    (
        Tensor::from_data(TensorData::new(x, [rows, 8]), device),
        Tensor::from_data(TensorData::new(target, [rows, 4]), device),
    )
}

/// The running mean and variance of `model`'s batch norm, after folding in the updates its
/// forwards left pending (`RunningState` keeps each thread's last update aside until the next
/// read: `valid()` folds them in).
fn running_stats(model: &NormNet) -> [TensorData; 2] {
    let norm = model.norm.valid();
    [
        host_data(norm.running_mean.value()).expect("read the running mean"),
        host_data(norm.running_var.value()).expect("read the running variance"),
    ]
}

/// The trainable parameters of `model` (the running statistics left out), in visiting order.
fn trained_params(model: &NormNet) -> Vec<TensorData> {
    param_values(&(
        model.input.clone(),
        model.norm.gamma.clone(),
        model.norm.beta.clone(),
        model.head.clone(),
    ))
    .expect("read back")
    .into_iter()
    .map(|(_, data)| data)
    .collect()
}

/// How close the whole step must be to eager training: to the bit where both run the same
/// kernels on the same values (Flex, where every step runs burn's optimizer; wgpu, where the
/// trained parameters and losses of this model equal eager's to the bit); on CUDA the
/// device's tolerance ([`tolerance_for`]: with TF32 off, the default, 1e-6 absolute or 1e-5
/// relative or 4 units in the last place), since the graph's forward and backward may run
/// other kernels than eager's in another order of the same f32 sums (the batch statistics'
/// reductions, the products; call AQ on an H200: 1 to 65 units apart after 1 to 5 steps, at
/// most 2.4e-7). What it must catch is far larger: one missed Adam step at this test's lr
/// (1e-2) moves a parameter by about 1e-2, one missed statistics update moves the running mean
/// by a tenth of the gap to the batch mean; the negative controls check both against it.
fn whole_step_tolerance(device: &Device) -> Tolerance {
    if kernels_may_differ(device) {
        tolerance_for(device)
    } else {
        Tolerance::exact()
    }
}

/// The first layer's bias in visiting order (after its weight). Its exact gradient is zero: the
/// batch norm after it subtracts the batch mean, which the bias only shifts. Adam moves it by
/// what rounding leaves of that gradient (on CUDA, 3.7e-7 to 7.8e-7 in a step, call AR), under
/// the device's tolerance: no comparison of two trainings can tell one such step from none, so
/// the missed-step control leaves it out where kernels may differ (on Flex and wgpu, exact
/// comparisons, it stays in).
const FIRST_BIAS: usize = 1;

/// A `GraphedStep` (burn's Adam) over a model with burn's `BatchNorm` in training mode,
/// against eager training with burn's Adam, `steps` steps on the same batches, each of `micro`
/// micro-batches (with more than one, `GraphedStep::accumulating` against burn's
/// `GradientsAccumulator`: each forward updates the statistics in turn, the gradients are
/// summed before one update): after every step the losses, every trained parameter, the
/// running mean and the running variance agree ([`whole_step_tolerance`]). Negative controls,
/// at every step: eager's statistics against its statistics before the step (what a step that
/// missed their update would show), and each trained parameter against its value before the
/// step (a missed optimizer step; [`FIRST_BIAS`] only where comparisons are exact), fail the
/// same comparison.
///
/// The step is built with `allow_non_trainable_params` (without it, the step is refused:
/// [`batch_norm_is_refused`]). The whole-step graph keeps the statistics its forwards compute:
/// it copies them into their buffers after the backward, so `GraphedStep::module` shows them
/// as eager training's module does (ROBUSTNESS.md).
pub fn batch_norm_whole_step_matches_eager(device: &Device, steps: usize, micro: usize) {
    let device = device.clone().autodiff();
    let eager_start = NormNet::new(&device);
    let twin = eager_start.twin(&device);
    let mut before_stats = running_stats(&eager_start);
    let mut before_params = trained_params(&eager_start);
    let tolerance = whole_step_tolerance(&device);
    let mut eager = eager_start;
    let mut optimizer = adam_config().init();
    let batches = |index: usize| -> Vec<(Tensor<2>, Tensor<2>)> {
        (0..micro)
            .map(|part| norm_batch(&device, index * micro + part))
            .collect()
    };
    let config = GraphedConfig::new().with_allow_non_trainable_params(true);
    let mut step = if micro == 1 {
        GraphedStep::new(
            twin,
            norm_mse,
            &adam_config(),
            norm_batch(&device, 0),
            &config,
        )
    } else {
        GraphedStep::accumulating(twin, norm_mse, &adam_config(), batches(0), &config)
    }
    .expect("capture");
    let lr = 1e-2;
    let mut failures = Vec::new();
    let stats_names = ["running mean", "running variance"];
    for index in 0..steps {
        let parts = batches(index);
        let mut accumulator = GradientsAccumulator::new();
        let mut eager_losses = Vec::new();
        for part in parts.clone() {
            let loss = norm_mse(&eager, part);
            eager_losses.push(loss.clone().inner());
            accumulator.accumulate(&eager, GradientsParams::from_grads(loss.backward(), &eager));
        }
        eager = optimizer.step(lr, eager, accumulator.grads());
        let eager_loss_data = host_data(Tensor::cat(eager_losses, 0)).expect("eager losses");
        let graphed_loss = if micro == 1 {
            step.run(parts.into_iter().next().expect("one batch"), lr)
        } else {
            step.run_accumulated(parts, lr)
        };
        let graphed_loss = host_data(graphed_loss.expect("step")).expect("graphed loss");
        let graphed = step.module();
        let mut compare = |what: String, e: &TensorData, g: &TensorData| {
            let comparison = TensorComparison::new(what, e, g, tolerance);
            if !comparison.passed() {
                failures.push(comparison.to_string());
            }
        };
        compare(
            format!("step {index} loss"),
            &eager_loss_data,
            &graphed_loss,
        );
        let (params_now, g) = (trained_params(&eager), trained_params(&graphed));
        assert_eq!(params_now.len(), g.len());
        for (param, (e, g)) in params_now.iter().zip(&g).enumerate() {
            compare(format!("step {index} param {param}"), e, g);
        }
        let (e, g) = (running_stats(&eager), running_stats(&graphed));
        for (name, (e, g)) in stats_names.iter().zip(e.iter().zip(&g)) {
            compare(format!("step {index} {name}"), e, g);
        }
        // Negative controls: a missed update of the statistics, a missed optimizer step.
        for (name, (e, before)) in stats_names.iter().zip(e.iter().zip(&before_stats)) {
            let control = TensorComparison::new(
                format!("negative control: step {index} {name} against the step before"),
                e,
                before,
                tolerance,
            );
            assert!(!control.passed(), "the statistics did not move: {control}");
        }
        for (param, (now, before)) in params_now.iter().zip(&before_params).enumerate() {
            if param == FIRST_BIAS && kernels_may_differ(&device) {
                continue;
            }
            let control = TensorComparison::new(
                format!("negative control: step {index} param {param} against the step before"),
                now,
                before,
                tolerance,
            );
            assert!(!control.passed(), "a parameter did not move: {control}");
        }
        before_stats = e;
        before_params = params_now;
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let stats = step.stats();
    if supports_graphs(&device) {
        assert_eq!(
            (stats.replays, stats.total_eager()),
            (steps as u64, 0),
            "{stats:?}"
        );
    } else {
        assert_eq!(
            stats.eager.get(&EagerReason::Unsupported),
            Some(&(steps as u64)),
            "{stats:?}"
        );
    }
}

/// `Graphed` and `GraphedStep` refuse the same model before anything runs, unless
/// `allow_non_trainable_params` says otherwise: the running statistics do not require grad
/// while the model trains (a callable's graphs would leave them at their start; a whole step
/// keeps them: [`batch_norm_whole_step_matches_eager`]). Both name the running mean: `NonTrainableState`, parameter 4 in visiting
/// order, after the first layer's weight and bias and the norm's weight and bias. On every
/// backend alike (the check needs no graphs), so that a model that builds on Flex builds on
/// CUDA.
pub fn batch_norm_is_refused(device: &Device) {
    let device = device.clone().autodiff();
    let refused = GraphedError::NonTrainableState {
        index: 4,
        shape: vec![16],
    };
    let graphed = Graphed::new(
        NormNet::new(&device),
        norm_forward,
        norm_batch(&device, 0).0,
        &GraphedConfig::new(),
    )
    .map(|_| ());
    assert_eq!(graphed, Err(refused.clone()), "Graphed");
    let step = GraphedStep::new(
        NormNet::new(&device),
        norm_mse,
        &adam_config(),
        norm_batch(&device, 0),
        &GraphedConfig::new(),
    )
    .map(|_| ());
    assert_eq!(step, Err(refused), "GraphedStep");
}
