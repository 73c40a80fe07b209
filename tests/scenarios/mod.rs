//! Scenarios shared by the CPU suite (`tests/cpu.rs`, wgpu on a software Vulkan, and Flex) and
//! the GPU suite (`tests/gpu.rs`, CUDA): each takes the device to run on.

#![allow(dead_code)]

pub mod batch_norm;
#[cfg(feature = "cuda")]
pub mod capture_mode;
pub mod controls;
pub mod data_parallel;
pub mod exact;
pub mod facts;
pub mod fused_attention;
pub mod fused_conv;
pub mod fused_embedding;
pub mod fused_linear;
pub mod fused_loss;
pub mod fused_norm;
pub mod global_pool;
pub mod group;
pub mod guarded;
pub mod inference;
pub mod inspect;
#[cfg(feature = "train")]
pub mod learner;
pub mod low_precision;
pub mod optim;
#[cfg(feature = "wgpu")]
pub mod picks;
#[cfg(feature = "cuda")]
pub mod process_faults;
#[cfg(feature = "cuda")]
pub mod processes;
pub mod prop;
pub mod random;
pub mod reads;
pub mod recovery;
pub mod robust;
pub mod skip;
pub mod tokens;
pub mod whole_step;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, LinearLayout, Relu};
use burn::optim::{AdamConfig, GradientsParams};
use burn::prelude::*;
use burn_graphed::testing::FaultInjection;
use burn_graphed::{EagerReason, Graphed, GraphedConfig, GraphedError, MismatchPolicy};
use burn_graphed_testkit::{Tolerance, TrainingComparison, compare_training, param_values};

/// depth x Linear(width, width) + ReLU, then Linear(width, out).
#[derive(Module, Debug)]
pub struct Mlp {
    pub layers: Vec<Linear>,
    pub head: Linear,
}

impl Mlp {
    pub fn new(width: usize, depth: usize, out: usize, device: &Device) -> Self {
        Self::with_layout(width, depth, out, LinearLayout::Row, device)
    }

    /// [`Mlp::new`] with its weights stored in `layout` (`Col`: each weight a transposed view
    /// of a `[d_output, d_input]` buffer, as PyTorch stores them).
    pub fn with_layout(
        width: usize,
        depth: usize,
        out: usize,
        layout: LinearLayout,
        device: &Device,
    ) -> Self {
        let linear = |d_in, d_out| {
            LinearConfig::new(d_in, d_out)
                .with_layout(layout)
                .init(device)
        };
        Self {
            layers: (0..depth).map(|_| linear(width, width)).collect(),
            head: linear(width, out),
        }
    }

    pub fn forward(&self, mut x: Tensor<2>) -> Tensor<2> {
        for layer in &self.layers {
            x = Relu::new().forward(layer.forward(x));
        }
        self.head.forward(x)
    }
}

/// Two inputs and two outputs; the third input is unused.
#[derive(Module, Debug)]
pub struct TwoHeads {
    pub a: Linear,
    pub b: Linear,
    pub shared: Linear,
}

impl TwoHeads {
    pub fn new(device: &Device) -> Self {
        Self {
            a: LinearConfig::new(16, 16).init(device),
            b: LinearConfig::new(8, 16).init(device),
            shared: LinearConfig::new(16, 4).init(device),
        }
    }

    pub fn forward(
        &self,
        (x, y, _unused): (Tensor<2>, Tensor<2>, Tensor<2>),
    ) -> (Tensor<2>, Tensor<2>) {
        let h = Relu::new().forward(self.a.forward(x) + self.b.forward(y));
        let out = self.shared.forward(h.clone());
        (out, h.sum_dim(1))
    }
}

fn mlp_forward(m: &Mlp, x: Tensor<2>) -> Tensor<2> {
    m.forward(x)
}

fn square_mean(y: Tensor<2>) -> Tensor<1> {
    y.powi_scalar(2).mean()
}

/// Deterministic batches: one per step, seeded by the step.
fn batch(shape: [usize; 2], step: usize, device: &Device) -> Tensor<2> {
    let n = shape[0] * shape[1];
    let values: Vec<f32> = (0..n)
        .map(|i| (((i * 7919 + (step % 997) * 104_729) % 1000) as f32 / 500.0) - 1.0)
        .collect();
    Tensor::<1>::from_floats(values.as_slice(), device).reshape(shape)
}

/// Trains the 3 x Linear(32) MLP with burn's `Adam` eagerly and, graphed with `graphed`, with
/// `graphed_optimizer` for `steps` steps on the same batches;
/// panics unless every output, loss, gradient and parameter matched. The report, for the
/// caller's counter checks.
pub fn mlp_against_eager<S: burn_graphed_testkit::ModuleStep>(
    device: &Device,
    steps: usize,
    graphed: GraphedConfig,
    graphed_optimizer: S,
) -> burn_graphed_testkit::EquivalenceReport {
    let run = MlpRun::new(device);
    mlp_against_eager_with(device, run, steps, graphed, graphed_optimizer)
}

/// What [`mlp_against_eager_with`] trains and how it compares.
pub struct MlpRun {
    /// `Mlp::new(width, depth, out)`; batches are `[16, width]`.
    pub width: usize,
    pub depth: usize,
    pub out: usize,
    /// The parameters' and batches' dtype (cast from `f32` unless it is `f32`).
    pub dtype: burn::tensor::FloatDType,
    /// The eager run's optimizer.
    pub eager_optimizer: burn::optim::ModuleOptimizer,
    pub tolerance: Tolerance,
}

impl MlpRun {
    /// The 3 x Linear(32) MLP in `f32`, burn's `Adam`, the device's tolerance.
    pub fn new(device: &Device) -> Self {
        Self {
            width: 32,
            depth: 3,
            out: 8,
            dtype: burn::tensor::FloatDType::F32,
            eager_optimizer: adam_config().init(),
            tolerance: tolerance_for(device),
        }
    }
}

/// [`mlp_against_eager`] with the model, dtype, eager optimizer and tolerance of `run`.
pub fn mlp_against_eager_with<S: burn_graphed_testkit::ModuleStep>(
    device: &Device,
    run: MlpRun,
    steps: usize,
    graphed: GraphedConfig,
    graphed_optimizer: S,
) -> burn_graphed_testkit::EquivalenceReport {
    let device = device.clone().autodiff();
    let dtype = run.dtype;
    let mut model = Mlp::new(run.width, run.depth, run.out, &device);
    let cast = dtype != burn::tensor::FloatDType::F32;
    if cast {
        model = burn_graphed_testkit::cast_params(&model, dtype);
    }
    let report = burn_graphed_testkit::compare_training_with_optimizer(
        TrainingComparison {
            model,
            call: mlp_forward,
            optimizer: run.eager_optimizer,
            learning_rate: 1e-2,
            batch: &mut |step| {
                let x = batch([16, run.width], step, &device);
                if cast { x.cast(dtype) } else { x }
            },
            loss: square_mean,
            steps,
            graphed,
            tolerance: run.tolerance,
            noise_step: 0.0,
        },
        graphed_optimizer,
    );
    let report = report.expect("comparison runs");
    println!("mlp: {report}");
    assert!(report.passed(), "{report}");
    report
}

/// Graphed MLP training equals eager training for `steps` Adam steps.
pub fn mlp_training_matches_eager(device: &Device, steps: usize) {
    let adam = adam_config().init();
    let report = mlp_against_eager(device, steps, GraphedConfig::new(), adam);
    if report.summary.graphed {
        assert_eq!(report.stats.forward_replays, steps as u64, "{report}");
        assert_eq!(report.stats.backward_replays, steps as u64, "{report}");
        // The graphs run on copies of the parameters; every call after an optimizer step (and
        // the first call) copies the module's current parameters into them.
        let params = report.summary.params as u64;
        assert_eq!(report.stats.param_copies, params * steps as u64, "{report}");
        assert_eq!(report.stats.total_eager(), 0, "{report}");
    }
}

/// The loss inside the graphed callable (the forward graph ends in a scalar, the backward graph
/// starts from the seed gradient), `OutputPolicy::Static` and `MultiTensorAdam`: the
/// configuration that queues the fewest operations outside the graphs. Equals eager training
/// with burn's `Adam`.
pub fn loss_inside_callable_matches_eager(device: &Device, steps: usize) {
    loss_inside_training_matches_eager(
        device,
        steps,
        GraphedConfig::new().with_outputs(burn_graphed::OutputPolicy::Static),
    );
}

/// [`loss_inside_callable_matches_eager`] with the graphed model's configuration `graphed`:
/// every step replays both graphs, no call runs eagerly, only the first call copies
/// parameters, and training equals eager training with burn's `Adam`.
pub fn loss_inside_training_matches_eager(device: &Device, steps: usize, graphed: GraphedConfig) {
    let device = device.clone().autodiff();
    let report = burn_graphed_testkit::compare_training_with_optimizer(
        TrainingComparison {
            model: Mlp::new(32, 3, 8, &device),
            call: |m: &Mlp, x: Tensor<2>| square_mean(m.forward(x)),
            optimizer: adam_config().init(),
            learning_rate: 1e-2,
            batch: &mut |step| batch([16, 32], step, &device),
            loss: |loss| loss,
            steps,
            graphed,
            tolerance: tolerance_for(&device),
            noise_step: 0.0,
        },
        fused_adam_config().init_multi_tensor(),
    )
    .expect("comparison runs");
    println!("loss inside the callable: {report}; {:?}", report.stats);
    assert!(report.passed(), "{report}");
    if report.summary.graphed {
        assert_eq!(report.summary.outputs, 1, "{report}");
        assert_eq!(report.stats.forward_replays, steps as u64, "{report}");
        assert_eq!(report.stats.backward_replays, steps as u64, "{report}");
        assert_eq!(report.stats.total_eager(), 0, "{report}");
        // MultiTensorAdam updates the graphs' parameter buffers in place: only the first call
        // copies parameters.
        assert_eq!(
            report.stats.param_copies, report.summary.params as u64,
            "{report}"
        );
    }
}

/// Weights stored as transposed views (`LinearLayout::Col`): graphed training with burn's
/// `Adam` equals eager training, and a served model's inference graphs (whose parameter buffers
/// keep the transposed layout), at batch 1 and at batch 8, equal its eager outputs. The graphs'
/// parameter buffers are copies of strided parameters; nothing may read them as row-major.
pub fn col_layout_weights_match_eager(device: &Device) {
    let autodiff = device.clone().autodiff();
    let steps = 3;
    let report = compare_training(TrainingComparison {
        model: Mlp::with_layout(16, 2, 8, LinearLayout::Col, &autodiff),
        call: mlp_forward,
        optimizer: adam_config().init(),
        learning_rate: 1e-2,
        batch: &mut |step| batch([8, 16], step, &autodiff),
        loss: square_mean,
        steps,
        graphed: GraphedConfig::new(),
        tolerance: tolerance_for(&autodiff),
        noise_step: 0.0,
    })
    .expect("comparison runs");
    assert!(report.passed(), "{report}");
    if report.summary.graphed {
        assert_eq!(report.stats.forward_replays, steps as u64, "{report}");
        assert_eq!(report.stats.total_eager(), 0, "{report}");
    }

    let inner = device.clone().inner();
    let model = Mlp::with_layout(16, 2, 8, LinearLayout::Col, &inner);
    let samples = vec![batch([1, 16], 0, &inner), batch([8, 16], 0, &inner)];
    let served = Graphed::inference(model, mlp_forward, samples, &GraphedConfig::new())
        .expect("inference capture");
    for (call, rows) in [1, 8, 1].into_iter().enumerate() {
        let x = batch([rows, 16], call + 1, &inner);
        let expected = served.module().forward(x.clone()).into_data();
        let got = served.forward(x).expect("inference call").into_data();
        assert_data_close(device, &format!("inference call {call}"), &expected, &got);
    }
    if supports_graphs(device) {
        let stats = served.stats();
        assert_eq!(stats.forward_replays, 3, "{stats:?}");
        assert_eq!(stats.total_eager(), 0, "{stats:?}");
    }
}

fn two_heads_forward(
    m: &TwoHeads,
    inputs: (Tensor<2>, Tensor<2>, Tensor<2>),
) -> (Tensor<2>, Tensor<2>) {
    m.forward(inputs)
}

fn two_heads_loss((out, h): (Tensor<2>, Tensor<2>)) -> Tensor<1> {
    out.powi_scalar(2).mean() + h.mean()
}

/// Several inputs (one requiring grad, one unused) and several outputs.
pub fn multi_io_matches_eager(device: &Device, steps: usize) {
    let device = device.clone().autodiff();
    let model = TwoHeads::new(&device);
    let make = |step: usize| {
        (
            batch([4, 16], step, &device).require_grad(),
            batch([4, 8], step + 1000, &device),
            batch([4, 3], step + 2000, &device),
        )
    };
    let report = compare_training(TrainingComparison {
        model,
        call: two_heads_forward,
        optimizer: adam_config().init(),
        learning_rate: 1e-2,
        batch: &mut |step| make(if step == usize::MAX { 0 } else { step }),
        loss: two_heads_loss,
        steps,
        graphed: GraphedConfig::new().with_allow_unused_input(true),
        tolerance: tolerance_for(&device),
        noise_step: 0.0,
    })
    .expect("comparison runs");
    println!("two heads: {report}");
    assert!(report.passed(), "{report}");
    if report.summary.graphed {
        assert_eq!(report.summary.outputs, 2);
        assert_eq!(report.stats.forward_replays, steps as u64);
    }
}

/// The gradient of an input that requires grad equals eager's.
pub fn input_gradient_matches_eager(device: &Device) {
    let device = device.clone().autodiff();
    let model = TwoHeads::new(&device);
    let eager = burn_graphed_testkit::deep_copy(&model);
    let make = || {
        (
            batch([4, 16], 3, &device).require_grad(),
            batch([4, 8], 4, &device),
            batch([4, 3], 5, &device),
        )
    };
    let graphed = Graphed::new(
        model,
        two_heads_forward,
        make(),
        &GraphedConfig::new().with_allow_unused_input(true),
    )
    .expect("capture");
    let (xe, ye, ze) = make();
    let (xg, yg, zg) = make();
    let loss_e = two_heads_loss(eager.forward((xe.clone(), ye, ze)));
    let loss_g = two_heads_loss(graphed.forward((xg.clone(), yg, zg)).expect("call"));
    let ge = xe.grad(&loss_e.backward()).expect("eager grad").into_data();
    let gg = xg
        .grad(&loss_g.backward())
        .expect("graphed grad")
        .into_data();
    assert_data_close(&device, "input gradient", &ge, &gg);
}

/// An unused input that requires grad is refused unless allowed.
pub fn unused_input_is_refused(device: &Device) {
    let device = device.clone().autodiff();
    require_graphs(&device);
    let model = TwoHeads::new(&device);
    let sample = (
        batch([4, 16], 0, &device),
        batch([4, 8], 0, &device),
        batch([4, 3], 0, &device).require_grad(),
    );
    let error = Graphed::new(model, two_heads_forward, sample, &GraphedConfig::new())
        .expect_err("the third input is unused");
    assert_eq!(error, GraphedError::UnusedInput { index: 2 });
}

/// As many one-element parameters as asked: a module for the limit on one graphed call's
/// parents (inputs plus parameters).
#[derive(Module, Debug)]
pub struct ManyParams {
    pub params: Vec<burn::module::Param<Tensor<1>>>,
}

impl ManyParams {
    /// Every parameter's value, in one tensor.
    fn values(&self) -> Tensor<1> {
        Tensor::cat(self.params.iter().map(|param| param.val()).collect(), 0)
    }

    /// [`values`](Self::values), read back in one read. (Reading each parameter would do, but
    /// on lavapipe dropping 4096 tensors read one by one took 87 s: a device round trip
    /// each.)
    fn read(&self) -> Vec<f32> {
        self.values()
            .into_data()
            .try_to_vec::<f32>()
            .expect("f32 data")
    }
}

fn many_params_forward(model: &ManyParams, x: Tensor<1>) -> Tensor<1> {
    x + model.values().sum()
}

/// One graphed call takes at most `MAX` inputs and parameters together: one more is refused
/// with a typed error naming both counts, before anything is recorded, and the parameters
/// keep their values. With `fit`, also exactly `MAX` captures (the largest node type), and
/// its call matches eager: 3.5 minutes on lavapipe, so the CPU suite leaves it to the GPU's.
pub fn too_many_parents_is_refused(device: &Device, fit: bool) {
    const MAX: usize = 4096;
    let device = device.clone().autodiff();
    require_graphs(&device);
    let model = |params: usize| ManyParams {
        params: (0..params)
            .map(|i| {
                let value = Tensor::<1>::from_floats([i as f32 / params as f32], &device);
                burn::module::Param::from_tensor(value)
            })
            .collect(),
    };
    let capture = |model: &ManyParams| {
        let sample = Tensor::<1>::from_floats([0.5], &device).require_grad();
        Graphed::new(
            model.clone(),
            many_params_forward,
            sample,
            &GraphedConfig::new(),
        )
    };
    let too_many = model(MAX);
    let before = too_many.read();
    let error = capture(&too_many).expect_err("one input and 4096 parameters are 4097 parents");
    assert_eq!(
        error,
        GraphedError::TooManyParents {
            parents: MAX + 1,
            max: MAX
        }
    );
    assert_eq!(too_many.read(), before, "the refused module's parameters");
    if !fit {
        return;
    }

    let fits = model(MAX - 1);
    let graphed = capture(&fits).expect("one input and 4095 parameters are 4096 parents");
    let x = Tensor::<1>::from_floats([0.25], &device);
    let value = |t: Tensor<1>| t.into_data().try_to_vec::<f32>().expect("f32 data")[0];
    let got = value(graphed.forward(x.clone()).expect("graphed call"));
    let expected = value(many_params_forward(&fits, x));
    // 4095 values summed, perhaps in another order: a few ulps of the sum (about 2048).
    assert!(
        (got - expected).abs() <= 1e-3,
        "graphed {got} against eager {expected}"
    );
    assert_eq!(
        graphed.stats().forward_replays,
        1,
        "the call replayed its graph"
    );
}

/// After `valid()`, calls (on the device without autodiff) replay forward-only inference
/// graphs, captured at the first such call, and equal the eager eval outputs, also after
/// training steps; back in training the training graphs serve again. With
/// `graph_inference = false` eval calls run eagerly (`NoAutodiff`).
pub fn eval_calls_replay_inference_graphs(device: &Device) {
    let device = device.clone().autodiff();
    let model = Mlp::new(16, 2, 4, &device);
    let graphed = capture_mlp(model, batch([8, 16], 0, &device));
    let mut optim = adam_config().init();
    let mut graphed = graphed;
    for step in 0..2 {
        let loss = square_mean(
            graphed
                .forward(batch([8, 16], step + 1, &device))
                .expect("train"),
        );
        let grads = GradientsParams::from_grads(loss.backward(), &graphed);
        graphed = optim.step(1e-2, graphed, grads);
    }
    let valid = graphed.valid();
    for step in 0..3 {
        let x = batch([8, 16], 10 + step, &device.clone().inner());
        let expected = valid.module().forward(x.clone()).into_data();
        let got = valid.forward(x).expect("eval call").into_data();
        assert_data_close(&device, &format!("eval call {step}"), &expected, &got);
    }
    let stats = graphed.stats();
    if supports_graphs(&device) {
        assert_eq!(stats.forward_replays, 2 + 3, "{stats:?}");
        assert_eq!(stats.total_eager(), 0, "{stats:?}");
        assert_eq!(
            graphed.stats().shape_cache.graphs,
            2,
            "training and inference graphs"
        );
    } else {
        assert_eq!(
            stats.eager.get(&EagerReason::Unsupported),
            Some(&5),
            "{stats:?}"
        );
    }
    // Back in training mode, the training graphs serve again.
    let y = graphed
        .forward(batch([8, 16], 20, &device))
        .expect("train call");
    let _ = y.powi_scalar(2).mean().backward();
    if supports_graphs(&device) {
        assert_eq!(graphed.stats().forward_replays, 6);
    }

    let eager_eval = Graphed::new(
        Mlp::new(16, 2, 4, &device),
        mlp_forward,
        batch([8, 16], 0, &device),
        &GraphedConfig::new().with_graph_inference(false),
    )
    .expect("capture")
    .valid();
    let _ = eager_eval
        .forward(batch([8, 16], 1, &device.clone().inner()))
        .expect("eval call");
    if supports_graphs(&device) {
        let stats = eager_eval.stats();
        assert_eq!(
            stats.eager.get(&EagerReason::NoAutodiff),
            Some(&1),
            "{stats:?}"
        );
    }
}

/// Inputs made on the inner (non-autodiff) device, as data loaders often do, still replay:
/// the module's parameters decide that this is training.
pub fn inner_device_inputs_replay(device: &Device) {
    let device = device.clone().autodiff();
    let model = Mlp::new(16, 1, 4, &device);
    let eager = burn_graphed_testkit::deep_copy(&model);
    let inner = device.clone().inner();
    let graphed = capture_mlp(model, batch([8, 16], 0, &inner));
    let x = batch([8, 16], 1, &inner);
    let loss_g = square_mean(graphed.forward(x.clone()).expect("call"));
    let loss_e = square_mean(eager.forward(x));
    let grads_g = GradientsParams::from_grads(loss_g.backward(), &graphed);
    let grads_e = GradientsParams::from_grads(loss_e.backward(), &eager);
    let ge = grads_e
        .get::<2>(eager.head.weight.id)
        .expect("eager grad")
        .into_data();
    let gg = grads_g
        .get::<2>(graphed.module().head.weight.id)
        .expect("graphed grad")
        .into_data();
    assert_data_close(&device, "head weight gradient", &ge, &gg);
    if supports_graphs(&device) {
        let stats = graphed.stats();
        assert_eq!(
            (stats.forward_replays, stats.backward_replays),
            (1, 1),
            "{stats:?}"
        );
    }
}

/// Another batch size runs eagerly (fallback) or fails (Error policy). Without graphs every
/// call runs eagerly for that reason, and the Error policy refuses the other batch size all
/// the same: the check needs no graphs.
pub fn shape_change_falls_back_or_errors(device: &Device) {
    let device = device.clone().autodiff();
    let fallback = if supports_graphs(&device) {
        EagerReason::Shape { index: 0 }
    } else {
        EagerReason::Unsupported
    };
    let model = Mlp::new(16, 1, 4, &device);
    let graphed = Graphed::new(
        model.clone(),
        mlp_forward,
        batch([8, 16], 0, &device),
        &GraphedConfig::new().with_max_graphs(1),
    )
    .expect("capture");
    let y = graphed
        .forward(batch([4, 16], 0, &device))
        .expect("fallback");
    assert_eq!(y.dims(), [4, 4]);
    assert_eq!(graphed.stats().eager.get(&fallback), Some(&1));

    let strict = Graphed::new(
        model,
        mlp_forward,
        batch([8, 16], 0, &device),
        &GraphedConfig::new()
            .with_on_mismatch(MismatchPolicy::Error)
            .with_max_graphs(1),
    )
    .expect("capture");
    let error = strict
        .forward(batch([4, 16], 0, &device))
        .expect_err("strict");
    assert_eq!(
        error,
        GraphedError::Mismatch {
            reason: EagerReason::Shape { index: 0 },
            detail: "input 0: given Float F32 [4, 16], captured Float F32 [8, 16]".into(),
        }
    );
}

/// A second forward before the first one's backward would overwrite its activations: it runs
/// eagerly, and both gradients are right.
pub fn second_call_before_backward_is_eager(device: &Device) {
    let device = device.clone().autodiff();
    let model = Mlp::new(16, 1, 4, &device);
    let eager = burn_graphed_testkit::deep_copy(&model);
    let graphed = capture_mlp(model, batch([8, 16], 0, &device));
    let a = batch([8, 16], 1, &device);
    let b = batch([8, 16], 2, &device);
    let loss_g = square_mean(graphed.forward(a.clone()).unwrap())
        + square_mean(graphed.forward(b.clone()).unwrap());
    let loss_e = square_mean(eager.forward(a)) + square_mean(eager.forward(b));
    let grads_g = GradientsParams::from_grads(loss_g.backward(), &graphed);
    let grads_e = GradientsParams::from_grads(loss_e.backward(), &eager);
    let ge = grads_e.get::<2>(eager.head.weight.id).unwrap().into_data();
    let gg = grads_g
        .get::<2>(graphed.module().head.weight.id)
        .unwrap()
        .into_data();
    assert_data_close(&device, "head weight gradient", &ge, &gg);
    if supports_graphs(&device) {
        assert_eq!(
            graphed.stats().eager.get(&EagerReason::BackwardPending),
            Some(&1)
        );
    }
}

/// The harness catches stale parameters and stale inputs.
pub fn harness_catches_faults(device: &Device) {
    let device = device.clone().autodiff();
    require_graphs(&device);
    for fault in [FaultInjection::SkipParamCopy, FaultInjection::SkipInputCopy] {
        let _fault = burn_graphed::testing::inject(fault);
        let report = compare_training(TrainingComparison {
            model: Mlp::new(16, 2, 4, &device),
            call: mlp_forward,
            optimizer: adam_config().init(),
            learning_rate: 1e-2,
            batch: &mut |step| batch([8, 16], step, &device),
            loss: square_mean,
            steps: 3,
            graphed: GraphedConfig::new(),
            tolerance: tolerance_for(&device),
            noise_step: 0.0,
        })
        .expect("comparison runs");
        assert!(!report.passed(), "{fault:?} went unnoticed: {report}");
    }
}

/// Adam's ε in this suite's comparisons of two training runs (graphed against eager, one
/// optimizer against another): 1e-3, where burn's default is 1e-5.
///
/// Adam moves a parameter by lr·m̂/(√v̂ + ε), so where a gradient element is near zero its step
/// changes by up to lr/ε times a change of that gradient. With burn's ε and this suite's lr of
/// 1e-2, a gradient difference of 4e-6 (inside [`Tolerance::tensor_cores`], e.g. a TF32 product
/// in one run and not the other) can move the parameter by 4e-3, which no parameter tolerance
/// short of a whole step accepts: measured on an H200 (2026-11-26, the chained group test with
/// four test processes on the GPU at once), one element of a 128-element bias 4.18e-3 off
/// after the first step while every gradient agreed within tolerance. With ε = 1e-3 the same
/// difference moves it by at most 4e-5. A missed or wrong update still moves every element
/// whose gradient is well above ε by about lr per step, and `harness_catches_faults` checks
/// that the comparisons see it.
pub const ADAM_EPSILON: f32 = 1e-3;

/// burn's `AdamConfig` with [`ADAM_EPSILON`]: the Adam of the training comparisons.
pub fn adam_config() -> AdamConfig {
    AdamConfig::new().with_epsilon(ADAM_EPSILON)
}

/// `FusedAdamConfig` (burn's fields and defaults) with [`ADAM_EPSILON`], to compare with
/// [`adam_config`].
pub fn fused_adam_config() -> burn_graphed::FusedAdamConfig {
    burn_graphed::FusedAdamConfig::new().with_epsilon(ADAM_EPSILON)
}

/// Whether two runs of one computation on `device` may run other kernels: on CUDA, cubecl's
/// autotune picks per operand layout and by timing, TF32 tensor-core products among them where
/// TF32 is allowed (UPSTREAM.md 16); elsewhere (lavapipe, Flex) one formula runs one way.
pub fn kernels_may_differ(device: &Device) -> bool {
    format!("{device:?}").contains("Cuda")
}

/// Whether `f32` products on `device` may round to TF32 in one run and not another: on CUDA
/// with TF32 allowed (`burn_graphed::allow_tf32`; the GPU suite turns it off except in its
/// TF32 child process, `tests/gpu.rs`).
pub fn tf32_products(device: &Device) -> bool {
    kernels_may_differ(device) && burn_graphed::tf32_allowed()
}

/// The harness tolerance for `device`: where f32 matrix products may run on TF32 tensor cores
/// in one path and not the other ([`tf32_products`]), `Tolerance::tensor_cores`, a measured
/// bound; elsewhere (CUDA with TF32 off included: other kernels, other orders of f32 sums) the
/// default, a derived one (see `Tolerance`).
pub fn tolerance_for(device: &Device) -> Tolerance {
    if tf32_products(device) {
        Tolerance::tensor_cores()
    } else {
        Tolerance::default()
    }
}

/// Asserts that `graphed` agrees with `eager` within the harness tolerance of `device`
/// ([`tolerance_for`]: f32 sums in other orders, or on CUDA with TF32 allowed, f32 products
/// rounded to TF32 in one path and not the other), the comparison named `what`.
pub fn assert_data_close(device: &Device, what: &str, eager: &TensorData, graphed: &TensorData) {
    let comparison =
        burn_graphed_testkit::TensorComparison::new(what, eager, graphed, tolerance_for(device));
    assert!(comparison.passed(), "{comparison}");
}

/// Asserts that every float parameter of `a` and `b` (in number too) agrees within
/// `tolerance`, comparisons named `what`. For tolerances without a norm-relative part (the same
/// kernels, or a fixed number of units in the last place): a `norm_rel` relative to a
/// parameter's largest value could swallow a whole optimizer step, so parameters of trainings
/// that may round differently go through [`ParamsCheck`], which scales it by how far they moved.
pub fn assert_params_close<A: Module, B: Module>(what: &str, a: &A, b: &B, tolerance: Tolerance) {
    assert_eq!(
        tolerance.norm_rel, 0.0,
        "{what}: a norm-relative tolerance on parameters goes through ParamsCheck"
    );
    for comparison in
        burn_graphed_testkit::compare_params(what, a, b, tolerance).expect("read back")
    {
        assert!(comparison.passed(), "{comparison}");
    }
}

/// A checkpoint of burn-nn's module (`burn_nn()`, a fresh one each call) loads into a fresh
/// fused module (`fused()`) and the fused module's into a fresh burn-nn one, every parameter
/// equal bit for bit: a checkpoint of one is a checkpoint of the other. Each fresh module draws
/// other random values, so a load that kept them fails. `what` names the files' folder.
pub fn records_load_both_ways<A: Module, B: Module>(
    what: &str,
    burn_nn: impl Fn() -> A,
    fused: impl Fn() -> B,
) {
    let dir = std::env::temp_dir().join(format!(
        "burn-graphed-{what}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    record_loads_into(
        &dir.join("burn_nn.bpk"),
        burn_nn(),
        fused(),
        &format!("{what}: burn-nn's file in the fused module"),
    );
    record_loads_into(
        &dir.join("fused.bpk"),
        fused(),
        burn_nn(),
        &format!("{what}: the fused module's file in burn-nn's"),
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `saved` written to `file` and loaded into `fresh`: every parameter equal bit for bit.
fn record_loads_into<S: Module, L: Module>(file: &std::path::Path, saved: S, fresh: L, what: &str) {
    saved.clone().save_file(file).expect("the module saves");
    let loaded = fresh.load_file(file);
    assert_params_close(what, &loaded, &saved, Tolerance::exact());
}

/// Parameters of two trainings from the same start, compared relative to the path the
/// reference travelled ([`burn_graphed_testkit::ParamMovement`]): where f32 products may round
/// to TF32 in one training and not the other ([`tolerance_for`] on CUDA), that rounding reaches
/// a parameter only through its updates, so its bound is `norm_rel` (1e-2) of the sum of the
/// reference's per-step largest changes, which a skipped or stale step (about one whole step)
/// exceeds; `Tolerance` (testkit) derives it, `params_check_sees_one_step` is its control.
/// Elsewhere `norm_rel` is 0 and the path plays no part.
///
/// Call [`ParamsCheck::advance`] (or [`ParamsCheck::assert`]) after every reference step:
/// steps it does not see are missing from the path, which makes the bound tighter (the net
/// distance is at most the path), never looser.
pub struct ParamsCheck {
    movement: burn_graphed_testkit::ParamMovement,
    tolerance: Tolerance,
}

impl ParamsCheck {
    /// From `start`, the parameters before the first step, under [`tolerance_for`] `device`.
    pub fn new<M: Module>(device: &Device, start: &M) -> Self {
        Self::with_tolerance(start, tolerance_for(device))
    }

    /// From `start` under `tolerance`.
    pub fn with_tolerance<M: Module>(start: &M, tolerance: Tolerance) -> Self {
        Self {
            movement: burn_graphed_testkit::ParamMovement::new(values_of(start)),
            tolerance,
        }
    }

    /// Adds the reference's step since the last call to the path, comparing nothing.
    pub fn advance<M: Module>(&mut self, reference: &M) {
        self.movement.advance(&values_of(reference));
    }

    /// Adds the reference's step to the path, then compares every parameter of `other` with
    /// `reference`'s (one comparison per parameter, named `"{what} param {index}"`, and a failing
    /// one where their counts differ).
    pub fn compare<A: Module, B: Module>(
        &mut self,
        what: &str,
        reference: &A,
        other: &B,
    ) -> Vec<burn_graphed_testkit::TensorComparison> {
        let (reference, other) = (values_of(reference), values_of(other));
        self.movement
            .compare(what, &reference, &other, self.tolerance)
    }

    /// [`ParamsCheck::compare`], asserting that every comparison passed.
    pub fn assert<A: Module, B: Module>(&mut self, what: &str, reference: &A, other: &B) {
        for comparison in self.compare(what, reference, other) {
            assert!(comparison.passed(), "{comparison}");
        }
    }
}

/// The values of `module`'s float parameters, in visiting order.
fn values_of<M: Module>(module: &M) -> Vec<TensorData> {
    burn_graphed_testkit::values_only(param_values(module).expect("read back"))
}

/// Asserts that `calls` graphed training calls each replayed their forward and backward
/// graphs and none ran eagerly.
pub fn assert_every_call_replayed(stats: &burn_graphed::GraphStats, calls: u64) {
    assert_eq!(
        (
            stats.forward_replays,
            stats.backward_replays,
            stats.total_eager()
        ),
        (calls, calls, 0),
        "{stats:?}"
    );
}

/// Asserts that every parameter gradient of `graphed` agrees with `eager`'s within `tolerance`
/// (or both are missing), comparisons named `what`, and that there was one to compare.
pub fn assert_grads_close<E: Module, G: Module>(
    what: &str,
    eager: (&E, &GradientsParams),
    graphed: (&G, &GradientsParams),
    tolerance: Tolerance,
) {
    let comparisons =
        burn_graphed_testkit::compare_grads(what, eager, graphed, tolerance).expect("read back");
    assert!(!comparisons.is_empty(), "{what}: no gradient compared");
    for comparison in comparisons {
        assert!(comparison.passed(), "{comparison}");
    }
}

/// Asserts that `module`'s float parameters are, bit for bit and in number, the values
/// `before` recorded (a failed capture or a refused call must leave the module as it was).
pub fn assert_params_unchanged<M: Module>(
    module: &M,
    before: &[(burn::module::ParamId, TensorData)],
) {
    let now = param_values(module).expect("read back");
    assert_eq!(now.len(), before.len(), "parameter count changed");
    for ((_, a), (_, b)) in now.iter().zip(before) {
        a.assert_eq(b, true);
    }
}

/// The configuration of the scenarios that keep outputs or gradients of one call alive across
/// the next (to compare them later, or because an optimizer keeps a gradient as its state, as
/// SGD's momentum does at its first step): hand-outs are copies, so no call runs eagerly for
/// them. Under the default, `OutputPolicy::Guarded`, such a call runs eagerly
/// (`EagerReason::OutputStillHeld`), which the scenarios that count replays do not expect.
pub fn copy_config() -> GraphedConfig {
    GraphedConfig::new().with_outputs(burn_graphed::OutputPolicy::Copy)
}

/// `model` graphed with `mlp_forward` and the default configuration (`Guarded` hand-outs),
/// captured on `sample`.
pub fn capture_mlp(model: Mlp, sample: Tensor<2>) -> Graphed<Mlp, Tensor<2>, Tensor<2>> {
    Graphed::new(model, mlp_forward, sample, &GraphedConfig::new()).expect("capture")
}

/// The call counters of `stats`, without its list of graphs (which a capture fills, and whose
/// node counts only CUDA gives) and its shape cache's counters (which a capture fills; the
/// snapshots state them apart): what "counts nothing" and the backend-neutral snapshots compare.
pub fn counters(stats: burn_graphed::GraphStats) -> burn_graphed::GraphStats {
    burn_graphed::GraphStats {
        graphs: Vec::new(),
        shape_cache: Default::default(),
        ..stats
    }
}

/// Whether `device` records graphs (burn-graphed's answer for the backend, not a probe
/// capture: a probe that failed would answer "no" and skip the caller's graphed checks).
pub fn supports_graphs(device: &Device) -> bool {
    burn_graphed::supports_graphs(device)
}

/// For a scenario that checks only what graphs do: on a backend that cannot capture it fails
/// rather than passing with nothing checked. The suites run such scenarios only where graphs
/// are captured (`cpu.rs` marks their Flex instances ignored, with the reason).
pub fn require_graphs(device: &Device) {
    assert!(
        supports_graphs(device),
        "this scenario checks graphs, and {device:?} cannot capture them: run it on a backend \
         that does (the CPU suite marks its Flex instance ignored)"
    );
}

/// Whether a capture of a small MLP on `device` recorded graphs (`summary().graphed`); a
/// failed capture fails the caller.
pub fn capture_records_graphs(device: &Device) -> bool {
    let device = device.clone().autodiff();
    let graphed = Graphed::new(
        Mlp::new(16, 1, 16, &device),
        mlp_forward,
        Tensor::zeros([8, 16], &device),
        &GraphedConfig::new(),
    )
    .expect("capture");
    graphed.summary().graphed
}

/// A forward that reads a value back to the host: a device sync, which a CUDA capture forbids.
fn syncing_forward(m: &Mlp, x: Tensor<2>) -> Tensor<2> {
    let y = m.forward(x);
    // Panics if the device refuses the read; the capture turns that into an error.
    let _ = y.clone().sum().into_data();
    y
}

/// A capture that fails inside the forward returns `GraphedError::Capture`, leaves the module's
/// parameters untouched and the device usable: eager training and a new capture of a correct
/// forward still give the eager results. `must_fail`: whether the backend refuses syncs inside
/// a capture (CUDA does; wgpu's software graphs may not).
pub fn capture_failure_leaves_device_usable(device: &Device, must_fail: bool) {
    let device = device.clone().autodiff();
    require_graphs(&device);
    let model = Mlp::new(16, 2, 4, &device);
    let before = burn_graphed_testkit::deep_copy(&model);
    let attempt = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Graphed::new(
            model.clone(),
            syncing_forward,
            batch([8, 16], 0, &device),
            &GraphedConfig::new(),
        )
    }));
    match attempt {
        Ok(Err(GraphedError::Capture { phase, reason })) => {
            println!("capture failed as expected during {phase}: {reason}");
        }
        Ok(Err(other)) => panic!("expected a capture error, got {other}"),
        Ok(Ok(_)) if must_fail => panic!("a host read inside the capture went unnoticed"),
        Ok(Ok(_)) => println!("this backend records host reads without failing"),
        Err(_) => panic!("the failed capture panicked instead of returning an error"),
    }
    // The module is untouched.
    assert_params_unchanged(&model, &param_values(&before).expect("read back"));
    // The device still runs eager work and captures correctly.
    mlp_training_matches_eager(&device, 3);
}

/// Serving: a module without autodiff graphed for inference over shape buckets (batch sizes 1,
/// 2, 4, 8): every call of a bucket replays its graph and equals the module's eager output; a
/// held output makes the next call run eagerly under the default guarded hand-outs; a training
/// module is refused with a typed error.
pub fn inference_buckets_replay(device: &Device) {
    let inner = device.clone().inner();
    let model = Mlp::new(16, 2, 4, &inner);
    let buckets = [1, 2, 4, 8];
    let graphed = Graphed::inference(
        model,
        mlp_forward,
        buckets.iter().map(|&b| batch([b, 16], 0, &inner)).collect(),
        &GraphedConfig::new(),
    )
    .expect("capture");
    let mut calls = 0;
    for round in 0..2 {
        for &rows in &buckets {
            let x = batch([rows, 16], 100 + round * 10 + rows, &inner);
            let expected = graphed.module().forward(x.clone()).into_data();
            let got = graphed.forward(x).expect("call").into_data();
            assert_data_close(device, &format!("bucket {rows}"), &expected, &got);
            calls += 1;
        }
    }
    let held = graphed.forward(batch([2, 16], 7, &inner)).expect("call");
    let _next = graphed.forward(batch([2, 16], 8, &inner)).expect("call");
    drop(held);
    let stats = graphed.stats();
    if supports_graphs(device) {
        assert_eq!(stats.forward_replays, calls + 1, "{stats:?}");
        assert_eq!(
            stats.eager.get(&EagerReason::OutputStillHeld),
            Some(&1),
            "{stats:?}"
        );
        assert_eq!(graphed.stats().shape_cache.graphs, buckets.len());
    } else {
        assert_eq!(stats.total_eager(), calls + 2, "{stats:?}");
    }
    let training = Graphed::inference(
        Mlp::new(16, 2, 4, &device.clone().autodiff()),
        mlp_forward,
        vec![batch([2, 16], 0, &inner)],
        &GraphedConfig::new(),
    );
    assert!(
        matches!(
            training,
            Err(GraphedError::InvalidArgument {
                argument: "module",
                ..
            })
        ),
        "{:?}",
        training.err()
    );
}
