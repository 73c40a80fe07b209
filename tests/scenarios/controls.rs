//! Negative controls: each comparison of the suite must fail when the smallest real error it
//! is meant to see is injected, in every regime the suite trains in: here SGD, Adam at lr 1e-4
//! and 1e-3, and inference; the `bf16` and `f16` regimes are the whole step's controls
//! (`whole_step.rs::whole_step_update_controls_in`; wgpu has no `bf16`, so the CPU suite runs f32
//! and f16, the GPU suite all three). Every control prints the tolerance, the
//! injected error (its largest absolute size) and the margin (the error in units of its
//! allowance, [`TensorComparison::worst`]: above 1 fails), beside the clean run's own worst
//! (below 1), so a bound that drifts toward the errors it must see shows in the log before a
//! control fails.
//!
//! Errors injected at the harness (they need no graphs, so Flex runs them too): a skipped
//! update (the graphed side's optimizer returns the module unchanged at step 1) and a wrong
//! row (after step 1's update, row 0 of the first weight keeps its values from before the
//! update: one row updated one step short). Errors injected into the graphs
//! (`burn_graphed::testing`): a stale batch (`SkipInputCopy`), stale parameters
//! (`SkipParamCopy`), a whole step without its update (`SkipUpdate`) or with its first
//! learning rate frozen (`FreezeLr`).

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use burn::prelude::*;
use burn_graphed::testing::{FaultInjection, inject};
use burn_graphed::{Graphed, GraphedConfig};
use burn_graphed_testkit::{
    EquivalenceReport, ModuleStep, TensorComparison, Tolerance, TrainingComparison,
    compare_training_with_optimizer, deep_copy, host_data,
};

use super::{Mlp, adam_config, batch, copy_config, mlp_forward, square_mean, tolerance_for};

/// A regime of the controls: the optimizer and its learning rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Regime {
    /// SGD with momentum 0.9 at lr 1e-2 (its step is `lr * velocity`: the smallest errors).
    Sgd,
    /// burn's Adam (the suite's ε, `ADAM_EPSILON`) at this learning rate.
    Adam(f64),
}

impl Regime {
    pub fn lr(self) -> f64 {
        match self {
            Regime::Sgd => 1e-2,
            Regime::Adam(lr) => lr,
        }
    }

    fn optimizer(self) -> ModuleOptimizer {
        match self {
            Regime::Sgd => SgdConfig::new()
                .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
                .init(),
            Regime::Adam(_) => adam_config().init(),
        }
    }
}

/// An error injected at the harness, on the graphed side's optimizer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Injected {
    /// Step 1's update is skipped (module and optimizer state unchanged).
    SkippedUpdate,
    /// Step 1's update leaves row 0 of the first weight as it was before it.
    WrongRow,
}

/// burn's optimizer with [`Injected`] at step 1.
#[derive(Clone)]
struct Faulty {
    inner: ModuleOptimizer,
    fault: Option<Injected>,
    step: usize,
}

impl ModuleStep for Faulty {
    fn step_module<M: Module>(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        let step = self.step;
        self.step += 1;
        match (step, self.fault) {
            (1, Some(Injected::SkippedUpdate)) => module,
            (1, Some(Injected::WrongRow)) => {
                let row = first_weight_row(&module);
                let updated = self.inner.step(lr, module, grads);
                updated.map(&mut RowWriter {
                    row: Some(row),
                    done: false,
                })
            }
            _ => self.inner.step(lr, module, grads),
        }
    }
}

/// Row 0 of the first parameter of rank 2 of `module`, read to the host now (the optimizer
/// step may write into its buffer).
fn first_weight_row<M: Module>(module: &M) -> TensorData {
    struct Reader(Option<TensorData>);
    impl ModuleVisitor for Reader {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.0.is_none() && D == 2 {
                let value = param.val();
                let dims = value.dims();
                let (rows, cols) = (dims[0], dims[1]);
                let value: Tensor<2> = value.reshape([rows, cols]);
                let row = value.slice([0..1, 0..cols]).reshape([cols]);
                self.0 = Some(host_data(row).expect("read row"));
            }
        }
    }
    let mut reader = Reader(None);
    module.visit(&mut reader);
    reader.0.expect("a parameter of rank 2")
}

/// Writes `row` into row 0 of the first parameter of rank 2 (`require_grad` kept).
struct RowWriter {
    row: Option<TensorData>,
    done: bool,
}

impl ModuleMapper for RowWriter {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.done || D != 2 {
            return param;
        }
        self.done = true;
        let row = self.row.take().expect("one row");
        param.map(|tensor| {
            let dims = tensor.dims();
            let mut shape = dims;
            shape[0] = 1;
            let values = Tensor::<1>::from_data(row, &tensor.device()).reshape(shape);
            let ranges: [std::ops::Range<usize>; D] =
                std::array::from_fn(|i| if i == 0 { 0..1 } else { 0..dims[i] });
            if !tensor.device().is_autodiff() {
                return tensor.slice_assign(ranges, values);
            }
            // A trained parameter: a new leaf, as an optimizer step makes it.
            let require_grad = tensor.is_require_grad();
            let written = Tensor::from_inner(tensor.inner().slice_assign(ranges, values.inner()));
            if require_grad {
                written.require_grad()
            } else {
                written
            }
        })
    }
}

/// Prints a clean run's worst comparison and requires it to pass.
fn clean(what: &str, report: &EquivalenceReport) {
    let worst = report.worst().expect("something compared");
    println!(
        "control {what}, clean: worst {:.3} of its allowance ({})",
        worst.worst, worst.name
    );
    assert!(report.passed(), "{what}, clean: {report}");
}

/// Prints a control's margin (its worst comparison) and requires the comparison to fail.
pub fn must_fail(what: &str, tolerance: &Tolerance, report: &EquivalenceReport) {
    let worst = report.worst().expect("something compared");
    println!(
        "control {what}: {tolerance:?}; injected error up to {:.3e} ({}), {:.1} of its \
         allowance; {} of {} comparisons fail",
        worst.max_abs,
        worst.name,
        worst.worst,
        report.failures().count(),
        report.tensors.len()
    );
    assert!(
        !report.passed(),
        "{what} must fail the comparison: {report}"
    );
}

/// The training comparison of the controls: the MLP (16 wide, two hidden layers), three steps
/// of `regime` on the suite's batches, under `tolerance_for(device)`, with the graphed side
/// stepped by `graphed_optimizer`.
fn train<S: ModuleStep>(
    device: &Device,
    regime: Regime,
    graphed_optimizer: S,
) -> EquivalenceReport {
    let device = device.clone().autodiff();
    compare_training_with_optimizer(
        TrainingComparison {
            model: Mlp::new(16, 2, 4, &device),
            call: mlp_forward,
            optimizer: regime.optimizer(),
            learning_rate: regime.lr(),
            batch: &mut |step| batch([8, 16], step, &device),
            loss: square_mean,
            steps: 3,
            // Copies: SGD's momentum keeps a step's gradient as its state.
            graphed: copy_config(),
            tolerance: tolerance_for(&device),
            noise_step: 0.0,
        },
        graphed_optimizer,
    )
    .expect("comparison runs")
}

/// The training comparison (`compare_training`, the suite's tolerance of `device`) in
/// `regime` sees a skipped update and a wrong row, and passes without them. Needs no graphs.
pub fn training_controls(device: &Device, regime: Regime) {
    let tolerance = tolerance_for(device);
    let faulty = |fault| Faulty {
        inner: regime.optimizer(),
        fault,
        step: 0,
    };
    clean(&format!("{regime:?}"), &train(device, regime, faulty(None)));
    for fault in [Injected::SkippedUpdate, Injected::WrongRow] {
        let report = train(device, regime, faulty(Some(fault)));
        must_fail(&format!("{regime:?} {fault:?}"), &tolerance, &report);
    }
}

/// The training comparison in `regime` sees a stale batch (`SkipInputCopy`) at every learning
/// rate; stale parameters (`SkipParamCopy`: the forward one step behind from step 1 on) where
/// products are compared to f32 rounding (`norm_rel` 0), or at lr 1e-2 and above: under
/// `Tolerance::tensor_cores` a forward one step stale at lr 1e-3 or below can change the
/// outputs by less than the TF32 allowance (1e-2 of their largest value), and the parameters
/// it leads to by less than a step, so it is printed there, not required. Needs graphs.
pub fn graph_controls(device: &Device, regime: Regime) {
    super::require_graphs(device);
    let tolerance = tolerance_for(device);
    let step = || regime.optimizer();
    for fault in [FaultInjection::SkipInputCopy, FaultInjection::SkipParamCopy] {
        let _guard = inject(fault);
        let report = train(device, regime, step());
        let what = format!("{regime:?} {fault:?}");
        if fault == FaultInjection::SkipParamCopy && tolerance.norm_rel > 0.0 && regime.lr() < 1e-2
        {
            let worst = report.worst().expect("something compared");
            println!(
                "control {what} (not required under TF32): passed {}, worst {:.3} ({})",
                report.passed(),
                worst.worst,
                worst.name
            );
            continue;
        }
        must_fail(&what, &tolerance, &report);
    }
}

/// Inference outputs, compared element by element (`TensorComparison`, the suite's tolerance
/// of `device`): a served model equals eager calls, and fails against them with a wrong row in
/// its first weight (row 0 holding row 1's values) and, where graphs are captured, when its
/// graph skips the input copy (it answers the capture's batch).
pub fn inference_controls(device: &Device) {
    let inner = device.clone().inner();
    let tolerance = tolerance_for(device);
    let model = Mlp::new(16, 2, 4, &inner);
    let sample = || vec![batch([8, 16], 0, &inner)];
    let x = batch([8, 16], 5, &inner);
    let expected = host_data(model.forward(x.clone())).expect("eager outputs");
    let compare = |served: &Graphed<Mlp, Tensor<2>, Tensor<2>>, what: &str| {
        let got = host_data(served.forward(x.clone()).expect("inference call")).expect("read");
        TensorComparison::new(what, &expected, &got, tolerance)
    };
    // Clones, not deep copies: a deep copy asks for gradients, which marks a training module.
    let served = Graphed::inference(model.clone(), mlp_forward, sample(), &GraphedConfig::new())
        .expect("capture");
    let comparison = compare(&served, "inference");
    println!("control inference, clean: {comparison}");
    assert!(comparison.passed(), "{comparison}");

    let mut wrong = model.clone();
    let row_1 = {
        let weight = wrong.layers[0].weight.val();
        let [_, cols] = weight.dims();
        host_data(weight.slice([1..2, 0..cols]).reshape([cols])).expect("read row")
    };
    wrong = wrong.map(&mut RowWriter {
        row: Some(row_1),
        done: false,
    });
    let served =
        Graphed::inference(wrong, mlp_forward, sample(), &GraphedConfig::new()).expect("capture");
    let comparison = compare(&served, "inference with a wrong row");
    println!("control inference WrongRow: {tolerance:?}; {comparison}");
    assert!(!comparison.passed(), "a wrong row must fail: {comparison}");

    if burn_graphed::supports_graphs(device) {
        let _guard = inject(FaultInjection::SkipInputCopy);
        let served =
            Graphed::inference(model.clone(), mlp_forward, sample(), &GraphedConfig::new())
                .expect("capture");
        let comparison = compare(&served, "inference on a stale batch");
        println!("control inference SkipInputCopy: {tolerance:?}; {comparison}");
        assert!(
            !comparison.passed(),
            "a stale batch must fail: {comparison}"
        );
    }
}

/// `ParamsCheck` under `Tolerance::tensor_cores` (the CUDA bound, forced here on any device):
/// two eager Adam trainings at lr 1e-4 from the same start, one of which skips step 1's update,
/// compared after every step. The clean twin passes (the same kernels: distance 0); the one
/// a step behind fails from step 1 on, where a bound of 1e-2 of each parameter's largest value
/// (what `assert_params_close` applied before parameters went through `ParamsCheck`) would
/// accept it: printed beside, with its margin. Needs no graphs.
pub fn params_check_sees_one_step(device: &Device) {
    let device = device.clone().autodiff();
    let tolerance = Tolerance::tensor_cores();
    let lr = 1e-4;
    let start = Mlp::new(16, 2, 4, &device);
    let (mut reference, mut twin, mut behind) =
        (deep_copy(&start), deep_copy(&start), deep_copy(&start));
    let (mut adam, mut twin_adam, mut behind_adam) = (
        adam_config().init(),
        adam_config().init(),
        adam_config().init(),
    );
    let mut check = super::ParamsCheck::with_tolerance(&start, tolerance);
    for step in 0..4 {
        let x = batch([8, 16], step, &device);
        let grads = |model: &Mlp| {
            let loss = square_mean(model.forward(x.clone()));
            GradientsParams::from_grads(loss.backward(), model)
        };
        let (g, t, b) = (grads(&reference), grads(&twin), grads(&behind));
        reference = adam.step(lr, reference, g);
        twin = twin_adam.step(lr, twin, t);
        if step != 1 {
            behind = behind_adam.step(lr, behind, b);
        }
        let what = format!("step {step}");
        let clean = check.compare(&format!("{what} clean"), &reference, &twin);
        assert!(clean.iter().all(TensorComparison::passed), "{clean:?}");
        let behind_now = check.compare(&format!("{what} a step behind"), &reference, &behind);
        let worst = behind_now.iter().map(|c| c.worst).fold(0.0_f64, f64::max);
        let by_largest =
            burn_graphed_testkit::compare_params(&what, &reference, &behind, tolerance)
                .expect("read back");
        let by_largest_worst = by_largest.iter().map(|c| c.worst).fold(0.0_f64, f64::max);
        println!(
            "control ParamsCheck {what}: a step behind at lr {lr:e} is {worst:.1} of the path \
             bound's allowance, {by_largest_worst:.2} of a bound by the largest value"
        );
        if step >= 1 {
            assert!(
                worst > 1.0,
                "{what}: a step behind must fail: {behind_now:?}"
            );
            assert!(
                by_largest_worst <= 1.0,
                "{what}: the bound by the largest value was expected to accept a step at lr \
                 {lr:e} (the reason for the path bound): {by_largest:?}"
            );
        }
    }
}
