//! Whole-step graphs (`GraphedStep`): forward, loss, backward, clipping and the optimizer
//! update in one replay, against eager training with burn's own optimizer.

use burn::optim::AdamConfig;
use burn::prelude::*;
use burn_graphed::testing::{FaultInjection, inject};
use burn_graphed::{
    Clipping, DeviceRng, EagerReason, GraphDropout, GraphedConfig, GraphedError, GraphedStep,
    SgdMomentum, StepOptimizer,
};
use burn_graphed_testkit::{Tolerance, WholeStepComparison, compare_whole_step};

use super::{Mlp, supports_graphs, tolerance_for};

/// The model of these scenarios: a small MLP and a mean squared error to a target.
fn mse(model: &Mlp, (x, target): (Tensor<2>, Tensor<2>)) -> Tensor<1> {
    (model.forward(x) - target).powi_scalar(2).mean()
}

/// The MLP with dropout from a device generator between its layers.
#[derive(Module, Debug)]
pub struct DropoutMlp {
    pub mlp: Mlp,
    pub dropout: GraphDropout,
}

fn dropout_mse(model: &DropoutMlp, (x, target): (Tensor<2>, Tensor<2>)) -> Tensor<1> {
    let hidden = model.dropout.forward(model.mlp.forward(x));
    (hidden - target).powi_scalar(2).mean()
}

fn batch(device: &Device, rows: usize, step: usize) -> (Tensor<2>, Tensor<2>) {
    let x = Tensor::<2>::from_data(
        TensorData::new(
            (0..rows * 8)
                .map(|i| ((i * 7 + step * 13) % 17) as f32 / 17.0 - 0.5)
                .collect::<Vec<_>>(),
            [rows, 8],
        ),
        device,
    );
    let target = Tensor::<2>::from_data(
        TensorData::new(
            (0..rows * 4)
                .map(|i| ((i * 5 + step * 3) % 11) as f32 / 11.0)
                .collect::<Vec<_>>(),
            [rows, 4],
        ),
        device,
    );
    (x, target)
}

/// `model` in a whole step with burn's default Adam, captured on a batch of 4.
fn adam_step(
    model: Mlp,
    device: &Device,
) -> Result<GraphedStep<Mlp, (Tensor<2>, Tensor<2>)>, GraphedError> {
    GraphedStep::new(
        model,
        mse,
        &AdamConfig::new(),
        batch(device, 4, 0),
        &GraphedConfig::new(),
    )
}

pub fn adam() -> StepOptimizer {
    StepOptimizer::Adam {
        beta_1: 0.9,
        beta_2: 0.999,
        epsilon: 1e-3,
        weight_decay: Some(1e-2),
    }
}

pub fn adamw() -> StepOptimizer {
    StepOptimizer::AdamW {
        beta_1: 0.8,
        beta_2: 0.99,
        epsilon: 1e-3,
        weight_decay: 5e-2,
    }
}

pub fn sgd_momentum() -> StepOptimizer {
    StepOptimizer::Sgd {
        momentum: Some(SgdMomentum {
            momentum: 0.9,
            dampening: 0.1,
            nesterov: true,
        }),
        weight_decay: Some(1e-2),
    }
}

/// The tolerance of the whole-step comparisons: the suite's ([`tolerance_for`]), whose docs
/// (`Tolerance`) derive it. What may differ is the graph's forward and backward, which fusion
/// cuts into other kernels than eager burn's (it sees the whole step): reduction orders, and
/// on CUDA TF32 products. The update itself computes as burn's does
/// ([`whole_step_update_is_burns_in`]). It must see a skipped update and a frozen learning
/// rate at the smallest rate these scenarios use (1e-4 in
/// [`whole_step_negative_controls`]), which it does with the margins that scenario prints.
fn tolerance(device: &Device) -> Tolerance {
    tolerance_for(device)
}

/// `steps` whole steps of the MLP with `optimizer` and `clipping`, `micro` micro-batches each,
/// a decaying learning rate and (with `batch_sizes`) a batch size that changes every step,
/// against burn's optimizer: every loss, parameter and optimizer state agree, and every step
/// replays where graphs exist.
pub fn whole_step_matches_eager(
    device: &Device,
    optimizer: StepOptimizer,
    clipping: Option<Clipping>,
    micro: usize,
    batch_sizes: &[usize],
    steps: usize,
) {
    let device = device.clone().autodiff();
    let model = Mlp::new(8, 2, 4, &device);
    let sizes = batch_sizes.to_vec();
    let report = compare_whole_step(WholeStepComparison {
        model,
        twin: None,
        loss: mse,
        optimizer,
        clipping,
        batches: &mut |step| {
            let rows = sizes[step % sizes.len()];
            (0..micro)
                .map(|m| batch(&device, rows, step * micro + m))
                .collect()
        },
        learning_rate: &|step| 2e-2 * 0.8f64.powi(step as i32),
        steps,
        graphed: GraphedConfig::new(),
        tolerance: tolerance(&device),
    })
    .expect("whole step");
    assert!(report.report.passed(), "{}", report.report);
    if supports_graphs(&device) {
        assert_eq!(
            report.stats.total_eager(),
            0,
            "every step replays: {:?}",
            report.stats
        );
        assert_eq!(report.stats.replays, steps as u64);
        assert_eq!(
            report.stats.shape_cache.graphs,
            batch_sizes.len().min(steps),
            "one graph per batch size"
        );
    } else {
        assert_eq!(
            report.stats.eager.get(&EagerReason::Unsupported),
            Some(&(steps as u64))
        );
    }
}

/// A regime of [`whole_step_negative_controls`]: the optimizer and its first learning rate
/// (the schedule is `lr / (1 + step)`, so that a frozen rate differs from the second step on).
fn control_regimes() -> [(&'static str, StepOptimizer, f64); 4] {
    [
        ("Adam lr 1e-4", adam(), 1e-4),
        ("Adam lr 1e-3", adam(), 1e-3),
        ("AdamW lr 1e-3", adamw(), 1e-3),
        ("SGD lr 1e-2", sgd_momentum(), 1e-2),
    ]
}

/// The whole-step comparison (`compare_whole_step`, [`tolerance`]) must fail when the graph
/// records no update (`SkipUpdate`: the parameters stay where they started, the moments at
/// zero) or when the learning rate is frozen at the first step's while the schedule halves it
/// (`FreezeLr`: from step 1 each update is up to twice its size), in every regime of
/// [`control_regimes`], and pass without them. Each control prints its margin: the largest
/// element distance in units of its allowance (above 1 fails); the clean runs print theirs
/// (below 1).
pub fn whole_step_negative_controls(device: &Device) {
    super::require_graphs(device);
    let device = device.clone().autodiff();
    let tolerance = tolerance(&device);
    let run = |optimizer: StepOptimizer, lr: f64| {
        compare_whole_step(WholeStepComparison {
            model: Mlp::new(8, 1, 4, &device),
            twin: None,
            loss: mse,
            optimizer,
            clipping: None,
            batches: &mut |step| vec![batch(&device, 4, step)],
            learning_rate: &|step| lr / (1 + step) as f64,
            steps: 3,
            graphed: GraphedConfig::new(),
            tolerance,
        })
        .expect("whole step")
    };
    for (regime, optimizer, lr) in control_regimes() {
        let report = run(optimizer, lr).report;
        let worst = report.worst().expect("compared");
        println!(
            "control whole step {regime}, clean: worst {:.3} of its allowance ({})",
            worst.worst, worst.name
        );
        assert!(report.passed(), "{regime}, clean: {report}");
        for fault in [FaultInjection::SkipUpdate, FaultInjection::FreezeLr] {
            let _guard = inject(fault);
            let report = run(optimizer, lr).report;
            super::controls::must_fail(
                &format!("whole step {regime} {fault:?}"),
                &tolerance,
                &report,
            );
        }
    }
}

/// A whole step leaves the model as it was until it runs: capturing (warm-ups, the first run
/// of the recording) changes no parameter and no optimizer state, and the first step then
/// equals burn's first step.
pub fn whole_step_capture_changes_nothing(device: &Device) {
    let device = device.clone().autodiff();
    let model = Mlp::new(8, 1, 4, &device);
    let before = burn_graphed_testkit::param_values(&model).expect("read");
    let step = adam_step(model, &device).expect("capture");
    let after = burn_graphed_testkit::param_values(&step.module()).expect("read");
    for ((_, a), (_, b)) in before.iter().zip(&after) {
        a.assert_eq(b, true);
    }
    assert_eq!(step.steps(), 0);
    for states in step.optimizer_state() {
        for state in states {
            let data = Tensor::<1>::from_dispatch(state.tensor().clone()).into_data();
            assert!(
                data.try_to_vec::<f32>().unwrap().iter().all(|v| *v == 0.0),
                "moments untouched by the capture"
            );
        }
    }
}

/// Dropout from a `DeviceRng` inside the model: every replay draws a new mask, in the same
/// sequence as eager steps from a generator seeded alike, and the capture draws nothing.
pub fn whole_step_dropout_matches_eager(device: &Device, steps: usize) {
    let device = device.clone().autodiff();
    let mlp = Mlp::new(8, 1, 4, &device);
    let make = |mlp: Mlp| DropoutMlp {
        mlp,
        dropout: GraphDropout::new(0.3, DeviceRng::new(7, &device)).expect("dropout"),
    };
    let twin = make(burn_graphed_testkit::deep_copy(&mlp));
    let report = compare_whole_step(WholeStepComparison {
        model: make(mlp),
        twin: Some(twin),
        loss: dropout_mse,
        optimizer: adam(),
        clipping: None,
        batches: &mut |step| vec![batch(&device, 4, step)],
        learning_rate: &|_| 1e-2,
        steps,
        graphed: GraphedConfig::new(),
        tolerance: tolerance(&device),
    })
    .expect("whole step");
    assert!(report.report.passed(), "{}", report.report);
}

/// Bad input gets typed errors naming the argument, and nothing changes.
pub fn whole_step_bad_input(device: &Device) {
    let device = device.clone().autodiff();
    let model = Mlp::new(8, 1, 4, &device);
    let error = GraphedStep::new(
        model.clone(),
        mse,
        &AdamConfig::new().with_amsgrad(true),
        batch(&device, 4, 0),
        &GraphedConfig::new(),
    )
    .err()
    .expect("AMSGrad refused");
    assert!(
        matches!(
            error,
            GraphedError::InvalidArgument {
                argument: "optimizer",
                ..
            }
        ),
        "{error}"
    );
    let mut step = adam_step(model, &device).expect("capture");
    let before = burn_graphed_testkit::param_values(&step.module()).expect("read");
    let error = step.run(batch(&device, 4, 1), f64::NAN).unwrap_err();
    assert!(
        matches!(error, GraphedError::InvalidArgument { argument: "lr", .. }),
        "{error}"
    );
    let error = step
        .run_accumulated(vec![batch(&device, 4, 1), batch(&device, 4, 2)], 1e-3)
        .unwrap_err();
    assert!(
        matches!(
            error,
            GraphedError::InvalidArgument {
                argument: "batches",
                ..
            }
        ),
        "{error}"
    );
    let after = burn_graphed_testkit::param_values(&step.module()).expect("read");
    for ((_, a), (_, b)) in before.iter().zip(&after) {
        a.assert_eq(b, true);
    }
    assert_eq!(step.steps(), 0);
}

/// A loss that reads a value on the host cannot be captured where the device refuses reads in
/// a recording; where it does not (wgpu's software graphs), validation catches the frozen
/// value. Either way the model is untouched and eager training goes on.
pub fn whole_step_host_read_is_refused(device: &Device) {
    super::require_graphs(device);
    fn reading_mse(model: &Mlp, (x, target): (Tensor<2>, Tensor<2>)) -> Tensor<1> {
        let scale: f32 = target.clone().abs().max().into_scalar();
        (model.forward(x) - target / (scale + 1.0))
            .powi_scalar(2)
            .mean()
    }
    let device = device.clone().autodiff();
    let model = Mlp::new(8, 1, 4, &device);
    let before = burn_graphed_testkit::param_values(&model).expect("read");
    let result = GraphedStep::new(
        model.clone(),
        reading_mse,
        &AdamConfig::new(),
        batch(&device, 4, 0),
        &GraphedConfig::new(),
    );
    if let Err(error) = &result {
        assert!(
            matches!(
                error,
                GraphedError::Capture { .. } | GraphedError::ReplayDiffers { .. }
            ),
            "{error}"
        );
    }
    let after = burn_graphed_testkit::param_values(&model).expect("read");
    for ((_, a), (_, b)) in before.iter().zip(&after) {
        a.assert_eq(b, true);
    }
    // The device is usable: a correct step captures and trains.
    let mut step = adam_step(model, &device).expect("capture after a failed one");
    step.run(batch(&device, 4, 1), 1e-3).expect("step");
    assert_eq!(step.stats().replays, 1);
}

/// The optimizer state moves between a whole step and eager burn as burn's `OptimizerRecord`,
/// both ways: after three whole steps, eager burn loaded with the step's record and a new
/// whole step loaded with it go on exactly as the first step goes on.
pub fn whole_step_records_round_trip(device: &Device, optimizer: StepOptimizer) {
    use burn::optim::GradientsParams;
    use burn_graphed_testkit::{deep_copy, param_values};
    let device = device.clone().autodiff();
    let mut step = GraphedStep::new(
        Mlp::new(8, 1, 4, &device),
        mse,
        optimizer,
        batch(&device, 4, 0),
        &GraphedConfig::new(),
    )
    .expect("capture");
    for i in 0..3 {
        step.run(batch(&device, 4, i), 2e-2).expect("step");
    }
    // Through burn's serialized form (burnpack bytes), as a checkpoint would go.
    let bytes = step.optimizer_record().into_bytes().expect("serialize");
    let record = || burn::optim::OptimizerRecord::from_bytes(bytes.clone()).expect("deserialize");
    let at_three = deep_copy(&step.module());
    // Eager burn from the record.
    let mut eager = optimizer.to_burn(None).load_record(record());
    let mut eager_model = deep_copy(&at_three);
    // A new whole step from the record.
    let mut reloaded = GraphedStep::new(
        deep_copy(&at_three),
        mse,
        optimizer,
        batch(&device, 4, 0),
        &GraphedConfig::new(),
    )
    .expect("capture");
    reloaded.load_optimizer_record(record()).expect("load");
    // Adam's and AdamW's states carry their step count (SGD's has none).
    if reloaded.is_graphed() && !matches!(optimizer, StepOptimizer::Sgd { .. }) {
        assert_eq!(
            reloaded.steps(),
            step.steps(),
            "the step count comes with the record"
        );
    }
    for i in 3..5 {
        let loss = mse(&eager_model, batch(&device, 4, i));
        let grads = GradientsParams::from_grads(loss.backward(), &eager_model);
        eager_model = eager.step(2e-2, eager_model, grads);
        step.run(batch(&device, 4, i), 2e-2).expect("step");
        reloaded.run(batch(&device, 4, i), 2e-2).expect("step");
    }
    let tolerance = tolerance(&device);
    let expected = param_values(&eager_model).expect("read");
    for (what, model) in [
        ("continued", step.module()),
        ("reloaded", reloaded.module()),
    ] {
        for ((_, e), (_, g)) in expected.iter().zip(param_values(&model).expect("read")) {
            let comparison = burn_graphed_testkit::TensorComparison::new(what, e, &g, tolerance);
            assert!(comparison.passed(), "{comparison}");
        }
    }
}

/// A model whose gradient is its input, exactly: `loss = sum(weight * x) + sum(bias * x[0])`.
/// Whatever kernels the forward and backward run, both sides of a comparison get the same
/// gradients, so the update's arithmetic alone decides whether they agree.
#[derive(Module, Debug)]
pub struct Linear {
    pub weight: burn::module::Param<Tensor<2>>,
    pub bias: burn::module::Param<Tensor<1>>,
}

fn linear_loss(model: &Linear, x: Tensor<2>) -> Tensor<1> {
    let [_, cols] = x.dims();
    let first = x.clone().slice([0..1, 0..cols]).reshape([cols]);
    (model.weight.val() * x).sum() + (model.bias.val() * first).sum()
}

/// Values of both signs with magnitudes from about 1e-3 to 1, different for every `seed`.
fn spread(rows: usize, cols: usize, seed: usize) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| {
            let k = (i * 37 + seed * 101) % 97;
            let sign = if (i + seed).is_multiple_of(3) {
                -1.0
            } else {
                1.0
            };
            sign * 10f32.powf(-3.0 * (k as f32) / 97.0) * (1.0 + (k % 7) as f32 / 7.0)
        })
        .collect()
}

/// The bound of [`whole_step_update_is_burns_in`]: bitwise, for Adam, AdamW and SGD in every
/// dtype. The update computes burn's operations in burn's order and dtype, and its
/// multiply-adds contract as burn's fused kernels' do (`cube/update/update_kernel.rs`), so nothing
/// in the arithmetic may differ; any difference is an error.
fn update_tolerance(_dtype: burn::tensor::FloatDType, _optimizer: StepOptimizer) -> Tolerance {
    Tolerance::exact()
}

/// `steps` whole steps of [`Linear`] with `optimizer` in `dtype` against burn's optimizer, with
/// `fault` built into the graph.
fn update_comparison(
    device: &Device,
    dtype: burn::tensor::FloatDType,
    optimizer: StepOptimizer,
    steps: usize,
    fault: FaultInjection,
) -> burn_graphed_testkit::WholeStepReport {
    let device = device.clone().autodiff();
    let (rows, cols) = (9, 13);
    let tensor = |values: Vec<f32>, shape: Vec<usize>| {
        Tensor::<2>::from_data(TensorData::new(values, [shape[0], shape[1]]), &device)
    };
    let model = Linear {
        weight: burn::module::Param::from_tensor(tensor(
            spread(rows, cols, 1000),
            vec![rows, cols],
        )),
        bias: burn::module::Param::from_tensor(
            tensor(spread(1, cols, 2000), vec![1, cols]).reshape([cols]),
        ),
    };
    let model = burn_graphed_testkit::cast_params(&model, dtype);
    let _guard = inject(fault);
    compare_whole_step(WholeStepComparison {
        model,
        twin: None,
        loss: linear_loss,
        optimizer,
        clipping: None,
        batches: &mut |step| vec![tensor(spread(rows, cols, step), vec![rows, cols]).cast(dtype)],
        learning_rate: &|step| 3e-2 * 0.7f64.powi(step as i32),
        steps,
        graphed: GraphedConfig::new(),
        tolerance: update_tolerance(dtype, optimizer),
    })
    .expect("whole step")
}

/// `steps` whole steps of [`Linear`] with `optimizer`, its parameters and inputs in `dtype`,
/// under a decaying learning rate, against burn's optimizer in `dtype`. The update kernel
/// rounds to `dtype` where burn's operations round and contracts the multiply-adds burn's
/// fused kernels contract, so Adam, AdamW and SGD agree to the bit in `bf16`, `f16` and `f32`
/// (measured on an H100; the wgpu suite checks `f32`).
pub fn whole_step_update_is_burns_in(
    device: &Device,
    dtype: burn::tensor::FloatDType,
    optimizer: StepOptimizer,
    steps: usize,
) {
    let report = update_comparison(device, dtype, optimizer, steps, FaultInjection::None);
    let summary = report.report.to_string();
    eprintln!(
        "update_is_burns {dtype:?} {optimizer:?}: {}",
        summary.lines().next().unwrap_or("")
    );
    assert!(report.report.passed(), "{dtype:?}: {}", report.report);
    if supports_graphs(device) {
        assert_eq!(report.stats.replays, steps as u64, "{:?}", report.stats);
    }
}

/// The negative controls of [`whole_step_update_is_burns_in`] in `dtype`: for Adam, AdamW and
/// SGD, a graph without its update (`SkipUpdate`) and one with its first learning rate frozen
/// (`FreezeLr`: step 1 at 3e-2 where the schedule gives 2.1e-2) fail [`update_tolerance`];
/// each prints its margin. Where the device lacks `dtype`, a `skipped:` line.
pub fn whole_step_update_controls_in(device: &Device, dtype: burn::tensor::FloatDType) {
    super::require_graphs(device);
    if !device.supports_dtype(dtype) {
        return super::skip::skip(&format!("the device has no {dtype:?}"));
    }
    for optimizer in [adam(), adamw(), sgd_momentum()] {
        for fault in [FaultInjection::SkipUpdate, FaultInjection::FreezeLr] {
            let report = update_comparison(device, dtype, optimizer, 3, fault).report;
            super::controls::must_fail(
                &format!("update {dtype:?} {optimizer:?} {fault:?}"),
                &update_tolerance(dtype, optimizer),
                &report,
            );
        }
    }
}
