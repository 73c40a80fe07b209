//! `burn_graphed::nn::loss::CrossEntropyLoss` against the exact loss (host `f64` from the
//! very values the device holds) and against burn-nn's, the loss and the logits' gradient, in
//! `f32`, `f16` and `bf16`, odd class counts and class counts above one cube's threads; inside
//! a graphed call; the forms it does not fuse are burn-nn's.
//!
//! Tolerance, derived as for the norms (`fused_norm.rs`): the fused kernels and burn-nn's
//! composition compute the same formula and differ in the order of their sums and where they
//! round (the fused path in `f32`, one rounding to the dtype). So the fused error against the
//! exact values must be at most twice burn-nn's own error plus one rounding of the dtype,
//! relative to the largest exact magnitude. Negative control: the exact gradient for targets
//! one class off must exceed that bound tenfold.

use super::exact::{
    assert_graphed_equals_eager, host, relative_error as error, seeded, unit_roundoff,
};
use super::skip::skip;
use super::*;
use burn::tensor::{DType, FloatDType};

/// Deterministic values in [-3.0, 3.0).
fn values(count: usize, seed: u64) -> Vec<f32> {
    seeded(count, seed, -3.0, 3.0)
}
use burn_graphed::nn::loss::{CrossEntropyLoss, CrossEntropyLossConfig};

/// The exact mean loss and the logits' gradient.
fn exact(x: &[f64], targets: &[usize], classes: usize) -> (f64, Vec<f64>) {
    let rows = targets.len();
    let mut loss = 0.0;
    let mut grad = vec![0.0; x.len()];
    for (r, &t) in targets.iter().enumerate() {
        let row = &x[r * classes..(r + 1) * classes];
        let max = row.iter().fold(f64::MIN, |m, v| m.max(*v));
        let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
        loss += lse - row[t];
        for j in 0..classes {
            let p = (row[j] - lse).exp() - if j == t { 1.0 } else { 0.0 };
            grad[r * classes + j] = p / rows as f64;
        }
    }
    (loss / rows as f64, grad)
}

/// The loss and the logits' gradient of `loss` on `logits` and `targets`, read back.
fn run(loss: &dyn Fn(Tensor<2>) -> Tensor<1>, logits: Tensor<2>) -> (Vec<f64>, Vec<f64>) {
    let logits = logits.require_grad();
    let value = loss(logits.clone());
    let grads = value.backward();
    (
        host(value.into_data()),
        host(
            logits
                .grad(&grads)
                .expect("the logits' gradient")
                .into_data(),
        ),
    )
}

/// The cases of one dtype; a device without the dtype skips them, and says so.
pub fn cross_entropy_matches_exact(device: &Device, dtype: FloatDType) {
    let device = device.clone().autodiff();
    if !device.supports_dtype(DType::from(dtype)) {
        skip(&format!("{device:?} has no {dtype:?}"));
        return;
    }
    let fused = CrossEntropyLossConfig::new().init(&device);
    let burn_nn: burn::nn::loss::CrossEntropyLoss = fused.clone().into();
    for (seed, [rows, classes]) in [[5, 7], [33, 300], [64, 512], [4, 1000]]
        .into_iter()
        .enumerate()
    {
        let seed = seed as u64 * 10;
        let logits = Tensor::<1>::from_data(
            TensorData::new(values(rows * classes, seed), [rows * classes]),
            &device,
        )
        .cast(dtype)
        .reshape([rows, classes]);
        let targets: Vec<usize> = values(rows, seed + 1)
            .iter()
            .map(|v| ((v + 3.0) / 6.0 * classes as f32) as usize % classes)
            .collect();
        let target_tensor = Tensor::<1, Int>::from_data(
            TensorData::new(targets.iter().map(|&t| t as i64).collect(), [rows]),
            &device,
        );
        let x = host(logits.clone().into_data());
        let (loss, grad) = exact(&x, &targets, classes);

        let before = burn_graphed::testing::fused_ops();
        let (fused_loss, fused_grad) =
            run(&|l| fused.forward(l, target_tensor.clone()), logits.clone());
        let (burn_loss, burn_grad) = run(&|l| burn_nn.forward(l, target_tensor.clone()), logits);
        let u = unit_roundoff(dtype);
        let label = format!("cross-entropy {dtype:?} [{rows}, {classes}]");
        for (what, fused, burn, truth) in [
            ("loss", &fused_loss, &burn_loss, &vec![loss]),
            ("gradient", &fused_grad, &burn_grad, &grad),
        ] {
            let (fused_error, burn_error) = (error(fused, truth), error(burn, truth));
            let bound = 2.0 * burn_error + u;
            println!(
                "{label} {what}: fused error {fused_error:.3e}, burn-nn's {burn_error:.3e}, bound {bound:.3e}"
            );
            assert!(
                fused_error <= bound,
                "{label} {what}: fused error {fused_error:.3e} above {bound:.3e} (burn-nn's {burn_error:.3e})"
            );
            // Negative control, on the gradient: every target one class off. (The loss is a
            // mean over rows, in which a wrong target moves by a fraction of a logit over the
            // row count, below bf16's resolution; the gradient shows every row's target.)
            if what == "gradient" {
                let shifted: Vec<usize> = targets.iter().map(|t| (t + 1) % classes).collect();
                let control = error(&exact(&x, &shifted, classes).1, truth);
                assert!(
                    control > 10.0 * bound,
                    "control {label} {what}: targets one class off are off {control:.3e}, not 10x the bound {bound:.3e}"
                );
            }
        }
        if supports_graphs(&device) {
            assert!(
                burn_graphed::testing::fused_ops() > before,
                "{label}: the fused kernels did not run"
            );
        } else {
            assert_eq!(
                (fused_loss, fused_grad),
                (burn_loss, burn_grad),
                "{label}: the fallback is not burn-nn's computation"
            );
        }
    }
    if supports_graphs(&device) {
        // A target outside the classes: a NaN loss, never a read outside the row.
        let logits = Tensor::<2>::zeros([2, 3], &device);
        let targets = Tensor::<1, Int>::from_data(TensorData::new(vec![1i64, 7], [2]), &device);
        let value = fused.forward(logits, targets).into_scalar::<f32>();
        assert!(
            value.is_nan(),
            "an out-of-range target gave the loss {value}"
        );
    }
}

/// The forms the fused kernels do not take (padding, weights, smoothing, probabilities) are
/// burn-nn's computation, bit for bit.
pub fn cross_entropy_other_forms_are_burn_nn(device: &Device) {
    let device = device.clone().autodiff();
    let logits =
        Tensor::<1>::from_data(TensorData::new(values(6 * 5, 3), [30]), &device).reshape([6, 5]);
    let probabilities = burn::tensor::activation::softmax(logits.clone(), 1);
    let targets =
        Tensor::<1, Int>::from_data(TensorData::new(vec![0i64, 1, 4, 2, 3, 1], [6]), &device);
    let configs = [
        CrossEntropyLossConfig::new().with_pad_tokens(Some(vec![1])),
        CrossEntropyLossConfig::new().with_weights(Some(vec![1.0, 2.0, 0.5, 1.0, 3.0])),
        CrossEntropyLossConfig::new().with_smoothing(Some(0.1)),
        CrossEntropyLossConfig::new().with_logits(false),
    ];
    for config in configs {
        let ours: CrossEntropyLoss = config.init(&device);
        let theirs: burn::nn::loss::CrossEntropyLoss = ours.clone().into();
        let input = if ours.logits {
            logits.clone()
        } else {
            probabilities.clone()
        };
        assert_eq!(
            ours.forward(input.clone(), targets.clone()).into_data(),
            theirs.forward(input, targets.clone()).into_data(),
            "{config:?}"
        );
    }
}

/// A linear classifier whose graphed call holds the fused loss equals its eager call, bit for
/// bit, loss and gradients, over several calls.
pub fn cross_entropy_graphed_matches_eager(device: &Device) {
    let device = device.clone().autodiff();
    let model = burn::nn::LinearConfig::new(16, 10).init(&device);
    let eager = burn_graphed_testkit::deep_copy(&model);
    let batch = |step: u64| {
        (
            Tensor::<1>::from_data(TensorData::new(values(8 * 16, 50 + step), [128]), &device)
                .reshape([8, 16]),
            Tensor::<1, Int>::from_data(
                TensorData::new((0..8).map(|i| (i * 3 + step as i64) % 10).collect(), [8]),
                &device,
            ),
        )
    };
    let call = move |m: &burn::nn::Linear, (x, t): (Tensor<2>, Tensor<1, Int>)| {
        CrossEntropyLossConfig::new()
            .init(&x.device())
            .forward(m.forward(x), t)
    };
    let graphed =
        burn_graphed::Graphed::new(model, call, batch(0), &GraphedConfig::new()).expect("capture");
    assert_graphed_equals_eager(&graphed, &eager, call, (1..4).map(batch), |m, grads| {
        m.weight
            .val()
            .grad(grads)
            .expect("the weight's gradient")
            .into_data()
    });
    if supports_graphs(&device) {
        assert_eq!(graphed.stats().forward_replays, 3, "{:?}", graphed.stats());
    }
}

/// A small model made only of `burn_graphed::nn`'s fused layers (an encoder with fused norms,
/// a final fused norm, a few-row linear head, the fused cross-entropy) trained in whole steps
/// against burn's optimizer on the same model, four steps with Adam and a decaying rate: every
/// loss, parameter and optimizer state within the whole-step comparison's tolerance (the one
/// `whole_step_negative_controls` shows catches a skipped update and a frozen rate), and every
/// step replays where graphs exist.
pub fn fused_model_whole_step_matches_eager(device: &Device) {
    use burn_graphed::nn::{
        LayerNorm, LayerNormConfig, Linear, TransformerEncoder, TransformerEncoderConfig,
        TransformerEncoderInput,
    };
    use burn_graphed::{GraphedConfig, StepOptimizer};
    use burn_graphed_testkit::{WholeStepComparison, compare_whole_step};

    #[derive(Module, Debug)]
    struct Tiny {
        encoder: TransformerEncoder,
        norm: LayerNorm,
        head: Linear,
    }
    type Batch = (Tensor<3>, Tensor<1, Int>);
    fn loss(m: &Tiny, (x, targets): Batch) -> Tensor<1> {
        let [batch, length, _] = x.dims();
        let hidden = m
            .norm
            .forward(m.encoder.forward(TransformerEncoderInput::new(x)));
        let logits = m.head.forward(hidden).reshape([batch * length, 10]);
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, targets)
    }

    let device = device.clone().autodiff();
    let model = Tiny {
        encoder: TransformerEncoderConfig::new(16, 32, 2, 1)
            .with_dropout(0.0)
            .with_norm_first(true)
            .init(&device),
        norm: LayerNormConfig::new(16).init(&device),
        head: burn::nn::LinearConfig::new(16, 10).init(&device).into(),
    };
    // Two sequences of four: eight rows, so the head runs the few-row kernel.
    let batch = |step: usize| -> Vec<Batch> {
        let step = step as u64;
        vec![(
            Tensor::<1>::from_data(
                TensorData::new(values(2 * 4 * 16, 200 + step), [128]),
                &device,
            )
            .reshape([2, 4, 16]),
            Tensor::<1, Int>::from_data(
                TensorData::new((0..8).map(|i| (i * 7 + step as i64) % 10).collect(), [8]),
                &device,
            ),
        )]
    };
    let steps = 4;
    let report = compare_whole_step(WholeStepComparison {
        model,
        twin: None,
        loss,
        optimizer: StepOptimizer::Adam {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-5,
            weight_decay: None,
        },
        clipping: None,
        batches: &mut |step| batch(step),
        learning_rate: &|step| 1e-2 * 0.8f64.powi(step as i32),
        steps,
        graphed: GraphedConfig::new(),
        tolerance: tolerance_for(&device),
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
    }
}
