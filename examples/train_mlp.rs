//! The demo: trains an MLP with Adam eagerly and with graphed forward/backward on CUDA, from
//! identical parameters and batches, and prints the step times and the largest gradient and
//! parameter differences.
//!
//! `cargo run --release --features cuda --example train_mlp -- [width] [depth] [batch] [steps]`

use std::time::Instant;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams};
use burn::prelude::*;
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

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (width, depth, batch, steps) = (arg(1, 256), arg(2, 8), arg(3, 32), arg(4, 200));
    let device = Device::cuda(0).autodiff();
    device.seed(0);
    let model = Mlp {
        layers: (0..depth)
            .map(|_| LinearConfig::new(width, width).init(&device))
            .collect(),
    };
    let eager_model = burn_graphed_testkit::deep_copy(&model);
    let x = Tensor::<2>::random([batch, width], burn::tensor::Distribution::Default, &device);

    let loss_of = |y: Tensor<2>| y.powi_scalar(2).mean();

    // Eager.
    let mut optim = AdamConfig::new().init();
    let mut eager = eager_model;
    let mut eager_grads = None;
    let mut eager_times = Vec::new();
    for step in 0..steps {
        let start = Instant::now();
        let loss = loss_of(eager.forward(x.clone()));
        let grads = GradientsParams::from_grads(loss.backward(), &eager);
        if step == 0 {
            eager_grads = grads
                .get::<2>(eager.layers[0].weight.id)
                .map(|g| g.into_data());
        }
        eager = optim.step(1e-3, eager, grads);
        device.sync()?;
        eager_times.push(start.elapsed().as_secs_f64() * 1e6);
    }

    // Graphed.
    let capture_start = Instant::now();
    let mut graphed = Graphed::new(model, Mlp::forward, x.clone(), &GraphedConfig::new())?;
    let capture_ms = capture_start.elapsed().as_secs_f64() * 1e3;
    let mut optim = AdamConfig::new().init();
    let mut graphed_grads = None;
    let mut graphed_times = Vec::new();
    for step in 0..steps {
        let start = Instant::now();
        let loss = loss_of(graphed.forward(x.clone())?);
        let grads = GradientsParams::from_grads(loss.backward(), &graphed);
        if step == 0 {
            graphed_grads = grads
                .get::<2>(graphed.module().layers[0].weight.id)
                .map(|g| g.into_data());
        }
        graphed = optim.step(1e-3, graphed, grads);
        device.sync()?;
        graphed_times.push(start.elapsed().as_secs_f64() * 1e6);
    }

    let median = |times: &mut Vec<f64>| {
        let warm = times.split_off(times.len().min(10));
        let mut warm = warm;
        warm.sort_by(f64::total_cmp);
        warm.get(warm.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let eager_us = median(&mut eager_times);
    let graphed_us = median(&mut graphed_times);
    let max_grad_diff = match (eager_grads, graphed_grads) {
        (Some(e), Some(g)) => e
            .try_to_vec::<f32>()?
            .iter()
            .zip(g.try_to_vec::<f32>()?)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max),
        _ => f32::NAN,
    };
    let max_param_diff = eager.layers[0]
        .weight
        .val()
        .inner()
        .sub(graphed.module().layers[0].weight.val().inner())
        .abs()
        .max()
        .into_scalar::<f32>();
    println!(
        "MLP {depth} x Linear({width},{width}) + ReLU, batch {batch}, Adam, {steps} steps, f32"
    );
    println!("capture: {capture_ms:.1} ms; {:?}", graphed.summary());
    println!("eager train step:   {eager_us:8.1} us (median after 10 warm-up steps)");
    println!(
        "graphed train step: {graphed_us:8.1} us  -> speedup {:.2}x",
        eager_us / graphed_us
    );
    println!("max |grad diff| (step 0, layer 0 weight): {max_grad_diff:e}");
    println!("max |param diff| after {steps} steps (layer 0 weight): {max_param_diff:e}");
    println!("stats: {:?}", graphed.stats());
    Ok(())
}
