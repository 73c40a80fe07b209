//! The demo: trains an MLP with Adam eagerly and with graphed forward/backward on CUDA, from
//! identical parameters and batches, and prints step times and the largest gradient and
//! parameter differences.
//!
//! `cargo run --release --features cuda --example train_mlp -- [width] [depth] [batch] [steps]`
//!
//! Two timings per mode: forward+backward alone (what the graphs replace), and the whole step
//! with Adam (which runs eagerly in both modes). Medians over `steps`, after 10 warm-up steps,
//! with a device sync per step.

use std::time::Instant;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams};
use burn::prelude::*;
use burn::tensor::TensorData;
use burn_graphed::{Graphed, GraphedConfig};

#[derive(Module, Debug)]
struct Mlp {
    layers: Vec<Linear>,
}

impl Mlp {
    fn forward(&self, mut x: Tensor<2>) -> Tensor<2> {
        for layer in &self.layers {
            x = Relu::new().forward(layer.forward(x));
        }
        x
    }
}

fn arg(index: usize, default: usize) -> usize {
    std::env::args()
        .nth(index)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

fn loss_of(y: Tensor<2>) -> Tensor<1> {
    y.powi_scalar(2).mean()
}

fn median_us(mut times: Vec<f64>) -> f64 {
    let mut warm = times.split_off(times.len().min(10));
    warm.sort_by(f64::total_cmp);
    warm.get(warm.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Times `steps` calls of `step`, syncing the device after each.
fn time(
    device: &Device,
    steps: usize,
    mut step: impl FnMut(usize),
) -> Result<f64, Box<dyn std::error::Error>> {
    let mut times = Vec::with_capacity(steps);
    for i in 0..steps + 10 {
        let start = Instant::now();
        step(i);
        device.sync()?;
        times.push(start.elapsed().as_secs_f64() * 1e6);
    }
    Ok(median_us(times))
}

/// Largest absolute difference and largest absolute eager value.
fn max_diff(
    eager: &TensorData,
    graphed: &TensorData,
) -> Result<(f32, f32), Box<dyn std::error::Error>> {
    let e = eager.clone().try_to_vec::<f32>()?;
    let g = graphed.clone().try_to_vec::<f32>()?;
    let diff = e
        .iter()
        .zip(&g)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let scale = e.iter().map(|a| a.abs()).fold(0.0f32, f32::max);
    Ok((diff, scale))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (width, depth, batch, steps) = (arg(1, 256), arg(2, 8), arg(3, 32), arg(4, 200));
    let device = Device::cuda(0).autodiff();
    device.seed(0);
    let model = Mlp {
        layers: (0..depth)
            .map(|_| LinearConfig::new(width, width).init(&device))
            .collect(),
    };
    let x = Tensor::<2>::random([batch, width], burn::tensor::Distribution::Default, &device);

    // Autotune picks kernels on first use; tune on a scratch copy so that both runs below use
    // the tuned kernels from their first step.
    let scratch = burn_graphed_testkit::deep_copy(&model);
    for _ in 0..3 {
        let _ = loss_of(scratch.forward(x.clone())).backward();
    }
    device.sync()?;

    // Step-0 gradients of both, from identical parameters.
    let eager_model = burn_graphed_testkit::deep_copy(&model);
    let capture_start = Instant::now();
    let graphed = Graphed::new(model, Mlp::forward, x.clone(), &GraphedConfig::new())?;
    let capture_ms = capture_start.elapsed().as_secs_f64() * 1e3;
    let id = eager_model.layers[0].weight.id;
    let eager_grad = GradientsParams::from_grads(
        loss_of(eager_model.forward(x.clone())).backward(),
        &eager_model,
    )
    .get::<2>(id)
    .map(Tensor::into_data);
    let graphed_grad =
        GradientsParams::from_grads(loss_of(graphed.forward(x.clone())?).backward(), &graphed)
            .get::<2>(id)
            .map(Tensor::into_data);

    // Forward + backward only.
    let eager_fb = time(&device, steps, |_| {
        let _ = loss_of(eager_model.forward(x.clone())).backward();
    })?;
    let mut failure = None;
    let graphed_fb = time(&device, steps, |_| match graphed.forward(x.clone()) {
        Ok(y) => drop(loss_of(y).backward()),
        Err(error) => failure = Some(error),
    })?;
    if let Some(error) = failure {
        return Err(error.into());
    }
    // The same with outputs and gradients handed out as the static buffers themselves.
    let static_model = Graphed::new(
        burn_graphed_testkit::deep_copy(graphed.module()),
        Mlp::forward,
        x.clone(),
        &GraphedConfig::new().with_outputs(burn_graphed::OutputPolicy::Static),
    )?;
    let static_fb = time(&device, steps, |_| match static_model.forward(x.clone()) {
        Ok(y) => drop(loss_of(y).backward()),
        Err(error) => failure = Some(error),
    })?;
    if let Some(error) = failure {
        return Err(error.into());
    }
    drop(static_model);

    // Whole training steps with Adam.
    // (Models move through `Option`s so that the optimizer owns the only reference to the old
    // parameters, as in a plain training loop.)
    let mut optim = AdamConfig::new().init();
    let mut eager = Some(eager_model);
    let eager_step = time(&device, steps, |_| {
        let model = eager.take().expect("model present");
        let grads =
            GradientsParams::from_grads(loss_of(model.forward(x.clone())).backward(), &model);
        eager = Some(optim.step(1e-3, model, grads));
    })?;
    let mut optim = AdamConfig::new().init();
    let mut trained = Some(graphed.clone());
    let graphed_step = time(&device, steps, |_| {
        let model = trained.take().expect("model present");
        match model.forward(x.clone()) {
            Ok(y) => {
                let grads = GradientsParams::from_grads(loss_of(y).backward(), &model);
                trained = Some(optim.step(1e-3, model, grads));
            }
            Err(error) => {
                failure = Some(error);
                trained = Some(model);
            }
        }
    })?;
    if let Some(error) = failure {
        return Err(error.into());
    }
    let (eager, trained) = (
        eager.expect("model present"),
        trained.expect("model present"),
    );

    let (grad_diff, grad_scale) = match (eager_grad, graphed_grad) {
        (Some(e), Some(g)) => max_diff(&e, &g)?,
        _ => (f32::NAN, f32::NAN),
    };
    let (param_diff, param_scale) = max_diff(
        &eager.layers[0].weight.val().inner().into_data(),
        &trained.module().layers[0].weight.val().inner().into_data(),
    )?;
    println!("MLP {depth} x Linear({width},{width}) + ReLU, batch {batch}, f32, loss mean(y^2)");
    println!("capture: {capture_ms:.1} ms; {:?}", graphed.summary());
    println!(
        "forward+backward: eager {eager_fb:8.1} us, graphed {graphed_fb:8.1} us -> {:.2}x",
        eager_fb / graphed_fb
    );
    println!(
        "forward+backward, OutputPolicy::Static: graphed {static_fb:8.1} us -> {:.2}x",
        eager_fb / static_fb
    );
    println!(
        "train step (Adam): eager {eager_step:8.1} us, graphed {graphed_step:8.1} us -> {:.2}x",
        eager_step / graphed_step
    );
    println!("(medians over {steps} steps after 10 warm-up steps, device sync each step)");
    println!(
        "max |grad diff| at step 0, layer 0 weight: {grad_diff:e} (max |grad| {grad_scale:e})"
    );
    println!(
        "max |param diff| after {} Adam steps, layer 0 weight: {param_diff:e} (max |param| {param_scale:e})",
        steps + 10
    );
    println!("stats: {:?}", trained.stats());
    Ok(())
}
