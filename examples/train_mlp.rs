//! The demo: trains an MLP eagerly (burn's `Adam`) and graphed on the fast path (the loss
//! inside the graphed callable, the default `OutputPolicy::Guarded`, `MultiTensorAdam`), from
//! identical parameters and batches, and prints step times, the speedup, both loss curves and
//! the largest parameter difference.
//!
//! `cargo xtask demo` runs it (it picks the device and installs what wgpu needs), or
//! `cargo run --release --features cuda --example train_mlp -- [width] [depth] [batch] [steps]`
//! (`cargo run --example train_mlp` for wgpu).
//!
//! On CUDA the graphs are CUDA graphs; without an NVIDIA GPU (or without the `cuda` feature)
//! the demo runs on burn's wgpu backend, whose graphs are software graphs (on Mesa's lavapipe,
//! a CPU Vulkan): real captures and replays, not fast ones. Medians over `steps` steps after
//! warm-up, with a device sync per step.

#[path = "common/progress.rs"]
mod progress;

use std::time::Instant;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams};
use burn::prelude::*;
use burn::tensor::{Distribution, TensorData};
use burn_graphed::{FusedAdamConfig, Graphed, GraphedConfig};

#[derive(Module, Debug)]
struct Mlp {
    layers: Vec<Linear>,
}

impl Mlp {
    fn new(width: usize, depth: usize, device: &Device) -> Self {
        Self {
            layers: (0..depth)
                .map(|_| LinearConfig::new(width, width).init(device))
                .collect(),
        }
    }

    fn forward(&self, mut x: Tensor<2>) -> Tensor<2> {
        let last = self.layers.len().saturating_sub(1);
        for (index, layer) in self.layers.iter().enumerate() {
            x = layer.forward(x);
            if index < last {
                x = Relu::new().forward(x);
            }
        }
        x
    }
}

/// The model and its loss, as one callable: its graphs end in the loss.
fn mse(model: &Mlp, (x, target): (Tensor<2>, Tensor<2>)) -> Tensor<1> {
    (model.forward(x) - target).powi_scalar(2).mean()
}

/// Where the demo runs, and what to say about it: CUDA where a device answers, else wgpu.
fn pick_device() -> Result<(Device, String), String> {
    #[cfg(feature = "cuda")]
    if cuda_answers() {
        return Ok((Device::cuda(0), "CUDA device 0 (CUDA graphs)".into()));
    }
    // `cargo xtask demo` builds without `cuda` where nvidia-smi finds no GPU, and says so in
    // BURN_GRAPHED_DEMO_WHY: the real reason, rather than the feature it then left out.
    let why = if cfg!(feature = "cuda") {
        "no CUDA device answers".to_string()
    } else {
        std::env::var("BURN_GRAPHED_DEMO_WHY")
            .unwrap_or_else(|_| "built without the `cuda` feature".into())
    };
    #[cfg(feature = "wgpu")]
    return Ok((
        Device::wgpu(Default::default()),
        format!(
            "wgpu, software graphs ({why}; on a CPU Vulkan such as lavapipe the timings are not \
             a GPU's)"
        ),
    ));
    #[allow(unreachable_code)]
    Err(format!(
        "{why}, and the demo was built without the `wgpu` feature"
    ))
}

/// Whether the CUDA driver loads and lists a device (cudarc panics where the library is
/// missing).
#[cfg(feature = "cuda")]
fn cuda_answers() -> bool {
    std::panic::catch_unwind(|| {
        cudarc::driver::result::init().is_ok()
            && cudarc::driver::result::device::get_count().is_ok_and(|count| count > 0)
    })
    .unwrap_or(false)
}

fn arg(index: usize, default: usize) -> usize {
    std::env::args()
        .nth(index)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times.get(times.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Largest absolute difference of two tensors' values, and the largest absolute value of the
/// first.
fn max_diff(
    eager: TensorData,
    graphed: TensorData,
) -> Result<(f32, f32), Box<dyn std::error::Error>> {
    let e = eager.convert::<f32>().try_into_vec::<f32>()?;
    let g = graphed.convert::<f32>().try_into_vec::<f32>()?;
    let diff = e
        .iter()
        .zip(&g)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let scale = e.iter().map(|a| a.abs()).fold(0.0f32, f32::max);
    Ok((diff, scale))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    progress::install();
    let (device, what) = pick_device()?;
    let cuda = what.starts_with("CUDA");
    let (width, depth, batch, steps) = if cuda {
        (arg(1, 256), arg(2, 8), arg(3, 32), arg(4, 200))
    } else {
        (arg(1, 64), arg(2, 4), arg(3, 16), arg(4, 30))
    };
    let warmup = 5;
    println!("device: {what}");
    println!(
        "model: {depth} x Linear({width}, {width}), ReLU between, batch {batch}, f32, MSE loss"
    );
    let device = device.autodiff();
    device.seed(0);
    let model = Mlp::new(width, depth, &device);
    let batches: Vec<(Tensor<2>, Tensor<2>)> = (0..4)
        .map(|_| {
            (
                Tensor::random([batch, width], Distribution::Default, &device),
                Tensor::random([batch, width], Distribution::Default, &device),
            )
        })
        .collect();
    let lr = 1e-3;

    // Eager: burn's Adam.
    let mut eager = burn_graphed_testkit::deep_copy(&model);
    let mut optim = AdamConfig::new().init();
    let (mut eager_times, mut eager_losses) = (Vec::new(), Vec::new());
    for step in 0..steps + warmup {
        let start = Instant::now();
        let (model, loss) =
            progress::eager_step(step, || -> Result<_, Box<dyn std::error::Error>> {
                let loss = mse(&eager, batches[step % batches.len()].clone());
                let grads = GradientsParams::from_grads(loss.backward(), &eager);
                let model = optim.step(lr, eager, grads);
                device.sync()?;
                Ok((model, loss))
            })?;
        eager = model;
        eager_times.push(start.elapsed().as_secs_f64() * 1e6);
        eager_losses.push(loss.into_scalar::<f32>());
    }

    // Graphed: the fast path, which is the default configuration.
    let capture = Instant::now();
    let sample = batches[0].clone();
    let mut graphed = Graphed::new(model, mse, sample, &GraphedConfig::new())?;
    let capture_ms = capture.elapsed().as_secs_f64() * 1e3;
    let mut optim = FusedAdamConfig::new().init_multi_tensor();
    let (mut graphed_times, mut graphed_losses) = (Vec::new(), Vec::new());
    for step in 0..steps + warmup {
        let start = Instant::now();
        let loss = graphed.forward(batches[step % batches.len()].clone())?;
        let grads = GradientsParams::from_grads(loss.backward(), &graphed);
        graphed = optim.step(lr, graphed, grads);
        device.sync()?;
        graphed_times.push(start.elapsed().as_secs_f64() * 1e6);
        // Read after the step: the loss is the graph's own buffer, dropped before the next
        // call, so every call replays.
        graphed_losses.push(loss.into_scalar::<f32>());
    }

    let eager_us = median(eager_times.split_off(warmup));
    let graphed_us = median(graphed_times.split_off(warmup));
    println!(
        "first step: eager {:.2} s (compiling and tuning its kernels), graphed {:.2} s (capture \
         included; kernels the eager steps compiled are reused)",
        eager_times[0] / 1e6,
        capture_ms / 1e3 + graphed_times[0] / 1e6
    );
    println!("capture: {capture_ms:.0} ms (warm-ups, two recordings, replay validation)");
    match burn_graphed::kernel_cache_location() {
        Some(file) => println!(
            "kernel cache: {} (a next run loads what this one compiled and tuned)",
            file.display()
        ),
        None => println!("kernel cache: off (a next run compiles and tunes again)"),
    }
    println!(
        "train step: eager {eager_us:.0} us, graphed {graphed_us:.0} us -> {:.2}x (medians over {steps} steps)",
        eager_us / graphed_us
    );
    println!("loss, eager vs graphed:");
    let mut shown = vec![0, 1, 2, (steps + warmup) / 2, steps + warmup - 1];
    shown.sort_unstable();
    shown.dedup();
    for step in shown {
        println!(
            "  step {step:4}: {:.6} {:.6}",
            eager_losses[step], graphed_losses[step]
        );
    }
    let (param_diff, param_scale) = max_diff(
        eager.layers[0].weight.val().inner().into_data(),
        graphed.module().layers[0].weight.val().inner().into_data(),
    )?;
    println!(
        "max |param diff| after {} steps, layer 0 weight: {param_diff:e} (max |param| {param_scale:e})",
        steps + warmup
    );
    let stats = graphed.stats();
    println!(
        "graphs: {} forward and {} backward replays, {} input copies, {} parameter copies, {} eager calls",
        stats.forward_replays,
        stats.backward_replays,
        stats.input_copies,
        stats.param_copies,
        stats.total_eager()
    );
    // On CUDA each graph says how many kernels a replay launches (wgpu's software graphs do not).
    for graph in &stats.graphs {
        if let Some(nodes) = graph.nodes {
            println!("{}: {} kernel nodes", graph.phase, nodes.kernels);
        }
    }
    Ok(())
}
