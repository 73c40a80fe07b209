//! Graph-safe randomness: `DeviceRng` draws fresh masks, uniform and normal values on every
//! call and every replay, with the requested statistics, following the host reference
//! sequence; a graphed `GraphDropout` and a graphed module adding normal noise equal eager ones
//! seeded alike (outputs and gradients).

use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn_graphed::testing::{reference_mask, reference_normal, reference_uniform};
use burn_graphed::{DeviceRng, GraphDropout, Graphed, GraphedConfig};
use burn_graphed_testkit::{TensorComparison, deep_copy};

use super::{batch, supports_graphs, tolerance_for};

fn values<const D: usize>(tensor: Tensor<D>) -> Vec<f32> {
    tensor
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32 data")
}

/// Two draws differ, each keeps about `keep` of the elements with the right scale, and both
/// equal the host reference of the sequence.
pub fn device_rng_draws_fresh_masks(device: &Device) {
    let rng = DeviceRng::new(42, device);
    let like = Tensor::<2>::zeros([256, 256], device);
    let (keep, scale) = (0.75f32, 1.0 / 0.75f32);
    let first = values(rng.dropout_mask(&like, keep, scale));
    let second = values(rng.dropout_mask(&like, keep, scale));
    assert_ne!(first, second, "two draws gave the same mask");
    for (draw, mask) in [&first, &second].into_iter().enumerate() {
        assert!(
            mask.iter().all(|v| *v == 0.0 || *v == scale),
            "values are 0 or the scale"
        );
        let kept = mask.iter().filter(|v| **v != 0.0).count() as f64 / mask.len() as f64;
        // 65536 Bernoulli(0.75) draws: standard deviation 0.0017.
        assert!(
            (kept - 0.75).abs() < 0.01,
            "draw {draw} kept {kept}, expected 0.75"
        );
        let reference = reference_mask(42, draw as u64, mask.len(), keep, scale);
        assert_eq!(
            mask, &reference,
            "draw {draw} differs from the host reference"
        );
    }
}

/// Draws shaped like tensors whose rows CUDA pitches (`[37, 11]`: rows 16 elements apart; and
/// a rank-3 `[5, 7, 3]`) equal the host reference element for element, in row-major order: the
/// draw kernel writes element `i` at index `i`, so its output buffer must be dense
/// (`cube/dense.rs`); a pitched one would leave the padding's garbage in place of the last
/// rows' values.
pub fn device_rng_fills_pitched_shapes(device: &Device) {
    let rng = DeviceRng::new(5, device);
    let (keep, scale) = (0.5f32, 2.0f32);
    let mask = rng.dropout_mask(&Tensor::<2>::zeros([37, 11], device), keep, scale);
    assert_eq!(mask.dims(), [37, 11]);
    assert_eq!(values(mask), reference_mask(5, 0, 37 * 11, keep, scale));
    let like = Tensor::<3>::zeros([5, 7, 3], device);
    let drawn = rng.uniform(&like, -1.0, 1.0);
    assert_eq!(drawn.dims(), [5, 7, 3]);
    assert_eq!(values(drawn), reference_uniform(5, 1, 5 * 7 * 3, -1.0, 1.0));
}

/// A graphed `GraphDropout` (input requiring grad, no parameters) against an eager one seeded
/// alike: every replay draws a new mask, outputs and input gradients equal eager.
pub fn graph_dropout_matches_eager(device: &Device, steps: usize) {
    let device = device.clone().autodiff();
    let graphed_dropout = GraphDropout::new(0.5, DeviceRng::new(11, &device)).expect("prob");
    let eager_dropout = GraphDropout::new(0.5, DeviceRng::new(11, &device)).expect("prob");
    let graphed = Graphed::new(
        graphed_dropout,
        |m: &GraphDropout, x: Tensor<2>| m.forward(x),
        batch([64, 64], 0, &device).require_grad(),
        &GraphedConfig::new(),
    )
    .expect("capture with device randomness passes replay validation");
    let tolerance = tolerance_for(&device);
    let mut patterns = Vec::new();
    for step in 0..steps {
        let x = batch([64, 64], step, &device).require_grad();
        let xe = batch([64, 64], step, &device).require_grad();
        let g = graphed.forward(x.clone()).expect("graphed call");
        let e = eager_dropout.forward(xe.clone());
        let (gv, ev) = (values(g.clone()), values(e.clone()));
        let comparison = TensorComparison::new(
            format!("step {step} output"),
            &TensorData::new(gv.clone(), [64, 64]),
            &TensorData::new(ev, [64, 64]),
            tolerance,
        );
        assert!(comparison.passed(), "{comparison:?}");
        patterns.push(gv.iter().map(|v| *v == 0.0).collect::<Vec<_>>());
        let gg = g.powi_scalar(2).sum().backward();
        let ge = e.powi_scalar(2).sum().backward();
        let (gx, ex) = (x.grad(&gg).expect("grad"), xe.grad(&ge).expect("grad"));
        let comparison = TensorComparison::new(
            format!("step {step} input gradient"),
            &gx.into_data(),
            &ex.into_data(),
            tolerance,
        );
        assert!(comparison.passed(), "{comparison:?}");
    }
    for window in patterns.windows(2) {
        assert_ne!(window[0], window[1], "two steps dropped the same elements");
    }
    assert_every_step_replayed(&device, &graphed.stats(), steps);
}

/// Where the device records graphs: every one of `steps` calls replayed both graphs, none
/// fell back.
fn assert_every_step_replayed(device: &Device, stats: &burn_graphed::GraphStats, steps: usize) {
    if supports_graphs(device) {
        assert_eq!(
            (stats.forward_replays, stats.backward_replays),
            (steps as u64, steps as u64),
            "{stats:?}"
        );
        assert_eq!(stats.total_eager(), 0, "{stats:?}");
    }
}

/// Mean and (population) variance.
fn moments(values: &[f32]) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().map(|v| f64::from(*v)).sum::<f64>() / n;
    let variance = values
        .iter()
        .map(|v| (f64::from(*v) - mean).powi(2))
        .sum::<f64>()
        / n;
    (mean, variance)
}

/// Uniform and normal draws: two draws of each differ; uniform values lie in `[low, high)`
/// with the mean and variance of the distribution and equal the host reference bit for bit;
/// normal values have the requested mean and standard deviation, 68.27% of them within one
/// standard deviation, and equal the host reference within a small tolerance (GPU `ln`, `cos`
/// and `sqrt` are not rounded like the host's). The four draws are draws 0-3 of one sequence:
/// the kinds share it.
pub fn device_rng_draws_uniform_and_normal(device: &Device) {
    let rng = DeviceRng::new(7, device);
    let like = Tensor::<2>::zeros([256, 256], device);
    let n = 65536.0f64;
    let (low, high) = (-2.0f32, 3.0f32);
    let uniform = [
        values(rng.uniform(&like, low, high)),
        values(rng.uniform(&like, low, high)),
    ];
    assert_ne!(
        uniform[0], uniform[1],
        "two uniform draws gave the same values"
    );
    let width = f64::from(high - low);
    for (draw, drawn) in uniform.iter().enumerate() {
        assert!(
            drawn.iter().all(|v| (low..high).contains(v)),
            "uniform draw {draw} left [{low}, {high})"
        );
        let (mean, variance) = moments(drawn);
        // 4 standard deviations of the estimators: width / sqrt(12 n) for the mean,
        // width^2 sqrt((1/80 - 1/144) / n) for the variance.
        let expected_mean = f64::from(low + high) / 2.0;
        assert!(
            (mean - expected_mean).abs() < 4.0 * width / (12.0 * n).sqrt(),
            "uniform draw {draw}: mean {mean}, expected {expected_mean}"
        );
        let expected_variance = width * width / 12.0;
        assert!(
            (variance - expected_variance).abs()
                < 4.0 * width * width * ((1.0 / 80.0 - 1.0 / 144.0) / n).sqrt(),
            "uniform draw {draw}: variance {variance}, expected {expected_variance}"
        );
        let reference = reference_uniform(7, draw as u64, drawn.len(), low, high);
        let differ: Vec<_> = (0..drawn.len())
            .filter(|i| drawn[*i].to_bits() != reference[*i].to_bits())
            .collect();
        assert!(
            differ.is_empty(),
            "uniform draw {draw}: {} values differ from the host reference, first {:?}",
            differ.len(),
            differ
                .iter()
                .take(5)
                .map(|i| (*i, drawn[*i], reference[*i]))
                .collect::<Vec<_>>()
        );
    }

    let (mean, std) = (1.5f32, 0.5f32);
    let normal = [
        values(rng.normal(&like, mean, std)),
        values(rng.normal(&like, mean, std)),
    ];
    assert_ne!(
        normal[0], normal[1],
        "two normal draws gave the same values"
    );
    for (draw, drawn) in normal.iter().enumerate() {
        let counter = 2 + draw as u64;
        let reference = reference_normal(7, counter, drawn.len(), mean, std);
        let worst = drawn
            .iter()
            .zip(&reference)
            .map(|(d, r)| (d - r).abs())
            .fold(0.0f32, f32::max);
        println!("normal draw {counter}: largest difference from the host reference {worst}");
        assert!(
            worst <= 1e-4 * std,
            "normal draw {counter} differs from the host reference by up to {worst}"
        );
        let (drawn_mean, variance) = moments(drawn);
        let drawn_std = variance.sqrt();
        // 4 standard deviations of the estimators: std / sqrt(n) for the mean,
        // std / sqrt(2 n) for the standard deviation.
        let std = f64::from(std);
        assert!(
            (drawn_mean - f64::from(mean)).abs() < 4.0 * std / n.sqrt(),
            "normal draw {counter}: mean {drawn_mean}, expected {mean}"
        );
        assert!(
            (drawn_std - std).abs() < 4.0 * std / (2.0 * n).sqrt(),
            "normal draw {counter}: standard deviation {drawn_std}, expected {std}"
        );
        let within = drawn
            .iter()
            .filter(|v| (f64::from(**v) - f64::from(mean)).abs() < std)
            .count() as f64
            / n;
        assert!(
            (within - 0.6827).abs() < 0.01,
            "normal draw {counter}: {within} within one standard deviation, expected 0.6827"
        );
    }
}

/// A linear layer whose hidden activation gets normal noise from a `DeviceRng`.
#[derive(Module, Debug)]
pub struct NoisyLinear {
    pub linear: Linear,
    pub rng: DeviceRng,
}

impl NoisyLinear {
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = self.linear.forward(x);
        let noise = self.rng.normal(&h, 0.0, 0.1);
        h + noise
    }
}

/// A graphed `NoisyLinear` against an eager copy whose generator is seeded alike, for `steps`
/// calls on new inputs (with replay validation on, as by default): every call adds noise of
/// the requested spread that differs from the previous call's, and outputs, input gradients
/// and parameter gradients equal eager.
pub fn graphed_noise_matches_eager(device: &Device, steps: usize) {
    let device = device.clone().autodiff();
    let model = NoisyLinear {
        linear: LinearConfig::new(16, 32).init(&device),
        rng: DeviceRng::new(5, &device),
    };
    let eager = NoisyLinear {
        linear: deep_copy(&model.linear),
        rng: DeviceRng::new(5, &device),
    };
    let graphed = Graphed::new(
        model,
        NoisyLinear::forward,
        batch([32, 16], 0, &device).require_grad(),
        &GraphedConfig::new(),
    )
    .expect("capture with device noise passes replay validation");
    let tolerance = tolerance_for(&device);
    let compare = |what: String, graphed: Tensor<2>, eager: Tensor<2>| {
        let comparison =
            TensorComparison::new(what, &graphed.into_data(), &eager.into_data(), tolerance);
        assert!(comparison.passed(), "{comparison:?}");
    };
    let mut previous_noise: Option<Vec<f32>> = None;
    for step in 0..steps {
        let x = batch([32, 16], step, &device).require_grad();
        let xe = batch([32, 16], step, &device).require_grad();
        let g = graphed.forward(x.clone()).expect("graphed call");
        let e = eager.forward(xe.clone());
        compare(format!("step {step} output"), g.clone(), e.clone());
        // The noise the graph added: its output less the noiseless layer (same parameters).
        let noiseless = eager.linear.valid().forward(xe.clone().inner());
        let noise = values(g.clone().inner() - noiseless);
        let (mean, variance) = moments(&noise);
        assert!(
            mean.abs() < 0.03 && (0.08..0.12).contains(&variance.sqrt()),
            "step {step}: noise mean {mean}, standard deviation {}, expected 0 and 0.1",
            variance.sqrt()
        );
        if let Some(previous) = &previous_noise {
            let changed = noise
                .iter()
                .zip(previous)
                .filter(|(a, b)| (*a - *b).abs() > 1e-3)
                .count();
            assert!(
                changed > noise.len() * 9 / 10,
                "step {step}: only {changed} of {} noise values changed since the last step",
                noise.len()
            );
        }
        previous_noise = Some(noise);
        let gg = g.powi_scalar(2).sum().backward();
        let ge = e.powi_scalar(2).sum().backward();
        compare(
            format!("step {step} input gradient"),
            x.grad(&gg).expect("graphed input gradient"),
            xe.grad(&ge).expect("eager input gradient"),
        );
        let (linear, linear_eager) = (&graphed.module().linear, &eager.linear);
        compare(
            format!("step {step} weight gradient"),
            linear.weight.grad(&gg).expect("graphed weight gradient"),
            linear_eager
                .weight
                .grad(&ge)
                .expect("eager weight gradient"),
        );
        let bias = |l: &Linear, grads| {
            l.bias
                .as_ref()
                .expect("bias")
                .grad(grads)
                .expect("bias gradient")
                .unsqueeze::<2>()
        };
        compare(
            format!("step {step} bias gradient"),
            bias(linear, &gg),
            bias(linear_eager, &ge),
        );
    }
    assert_every_step_replayed(&device, &graphed.stats(), steps);
}

/// Captures restore only the generators the capturing thread drew from: a generator another
/// thread draws from while captures run keeps every draw (before, a capture put back the
/// state of every live generator, and the other thread's draws repeated).
///
/// `concurrent_use`: whether the backend lets another thread use the device while a recording
/// is open: no capture is refused and no read fails. wgpu does, and CUDA in burn-graphed's
/// thread-local capture mode does (the other thread's reads wait on their own thread, its
/// launches go on its own stream). CUDA in global capture mode (the release's, the control of
/// `capture_mode.rs`) does not: there the other thread's reads fail with an error value and every
/// capture (3 of 3) fails with `GraphedError::Capture` naming the cause; neither may panic or
/// crash, and the device must work on both threads afterwards. The other thread makes its first
/// draws before the captures begin, so that the memory its draws need is there: a new page
/// allocated during a recording is refused in either mode.
pub fn other_threads_keep_their_draws(device: &Device, concurrent_use: bool) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let device = device.clone().autodiff();
    super::require_graphs(&device);
    let done = std::sync::Arc::new(AtomicBool::new(false));
    let (started, first_draws) = std::sync::mpsc::channel::<()>();
    let drawer = {
        let done = done.clone();
        let device = device.clone().inner();
        std::thread::spawn(move || {
            let rng = DeviceRng::new(77, &device);
            let like = Tensor::<2>::zeros([16, 16], &device);
            let (mut draws, mut failed) = (Vec::new(), 0usize);
            // At least a few draws, and on until the captures are over.
            while draws.len() < 4 || !done.load(Ordering::Acquire) {
                match rng.uniform(&like, 0.0, 1.0).into_data().try_to_vec::<f32>() {
                    Ok(values) => {
                        draws.push(values);
                        if draws.len() == 2 {
                            let _ = started.send(());
                        }
                    }
                    Err(error) if !concurrent_use => {
                        failed += 1;
                        if failed == 1 {
                            println!("other thread, first failed read: {error:?}");
                        }
                    }
                    Err(error) => panic!("a read on another thread failed: {error:?}"),
                }
            }
            (draws, failed)
        })
    };
    // Before any capture: two draws (the drawer's memory in place), or a drawer that ended.
    let _ = first_draws.recv();
    let mut refused = 0;
    for capture in 0..3 {
        let dropout = GraphDropout::new(0.5, DeviceRng::new(capture, &device)).expect("prob");
        match Graphed::new(
            dropout,
            |m: &GraphDropout, x: Tensor<2>| m.forward(x),
            batch([64, 64], 0, &device).require_grad(),
            &GraphedConfig::new(),
        ) {
            Ok(_) => {}
            Err(error @ burn_graphed::GraphedError::Capture { .. }) if !concurrent_use => {
                refused += 1;
                println!("capture {capture} refused: {error}");
            }
            Err(error) => panic!("capture {capture}: {error}"),
        }
    }
    done.store(true, Ordering::Release);
    let (draws, failed) = drawer.join().expect("the drawing thread does not panic");
    println!(
        "other thread: {} draws, {failed} failed reads; {refused} of 3 captures refused",
        draws.len()
    );
    if concurrent_use {
        assert_eq!(
            (refused, failed),
            (0, 0),
            "the device lets another thread use it during captures"
        );
    } else {
        // CUDA in global capture mode: every capture is invalidated by the drawing thread,
        // which draws without pause while the captures run, and that thread's reads fail in
        // turn (measured on an H100: 3 of 3 captures refused).
        assert_eq!(
            refused, 3,
            "captures refused, with {failed} failed reads on the other thread"
        );
        assert!(failed >= 1, "the other thread's reads during the captures");
    }
    if concurrent_use {
        for (i, later) in draws.iter().enumerate() {
            for (j, earlier) in draws[..i].iter().enumerate() {
                assert_ne!(
                    later,
                    earlier,
                    "draw {i} of {} repeated draw {j}",
                    draws.len()
                );
            }
        }
    }
    // Both threads can use the device again.
    let after = std::thread::spawn({
        let device = device.clone().inner();
        move || {
            let like = Tensor::<2>::zeros([16, 16], &device);
            let rng = DeviceRng::new(78, &device);
            values(rng.uniform(&like, 0.0, 1.0))
        }
    })
    .join()
    .expect("a draw on another thread after the captures");
    assert_eq!(
        after,
        reference_uniform(78, 0, 256, 0.0, 1.0),
        "the other thread's draw after the captures"
    );
    super::mlp_training_matches_eager(&device, 2);
}
