//! Data-parallel graphed training: one replica of an MLP per GPU, each on its own share of
//! every batch, the gradients averaged across the GPUs (one bucketed NCCL all-reduce per step)
//! before every replica takes the same Adam step, each step two graph replays
//! (`GraphedStep::data_parallel`).
//!
//! `cargo run --release --features cuda --example train_ddp -- [gpus] [steps]` (NCCL must be
//! loadable as `libnccl.so`; the GPU bundle's `run.sh` links the machine's). With fewer than two
//! GPUs (or without `cuda`) it runs two ranks on one device and averages through the host: the
//! same loop, not a fast one.
//!
//! The loop, per rank (one thread each):
//! 1. a replica of the model on the rank's device (`replica_on`: same values and parameter ids);
//! 2. its whole step captured, one rank at a time (CUDA captures of one process must not
//!    overlap, and a capture failing on one rank is an error on every rank);
//! 3. per step: `step.run(shard, lr)`: the gradient graph on the rank's shard, the bucket's
//!    all-reduce, the update graph. Every rank then holds the same parameters.

use std::time::{Duration, Instant};

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::AdamConfig;
use burn::prelude::*;
use burn::tensor::Distribution;
use burn_graphed::{Collective, DataParallel, GraphedConfig, GraphedStep, replica_on};

#[derive(Module, Debug)]
pub struct Mlp {
    layers: Vec<Linear>,
}

impl Mlp {
    pub fn new(width: usize, depth: usize, device: &Device) -> Self {
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

/// The loss of a step: a mean over the batch, so that the average of the ranks' gradients on
/// equal shards is the gradient of the whole batch.
pub fn mse(model: &Mlp, (x, target): (Tensor<2>, Tensor<2>)) -> Tensor<1> {
    (model.forward(x) - target).powi_scalar(2).mean()
}

/// What one rank saw: its losses per step, its steps that replayed graphs, its median step
/// time, the time to its first trained step (capture included), its trained replica.
pub struct RankRun {
    pub losses: Vec<f32>,
    pub replays: u64,
    pub step_us: f64,
    pub first_step_s: f64,
    pub model: Mlp,
}

/// Trains `model` data-parallel for `steps` steps on `devices` (autodiff devices, rank `i` on
/// `devices[i]`), averaging with `collective`; every rank gets `rows` rows of each batch. The
/// runs in rank order.
///
/// # Errors
///
/// A capture or a step that failed, on every rank alike (`GraphedError::RankFailed`,
/// `RanksDisagree`, `RankTimeout`).
pub fn train(
    model: &Mlp,
    devices: &[Device],
    collective: Collective,
    steps: usize,
    rows: usize,
) -> Result<Vec<RankRun>, burn_graphed::GraphedError> {
    let group = DataParallel::group(devices.len(), Duration::from_secs(300), collective)?;
    let width = model.layers[0].weight.dims()[0];
    std::thread::scope(|scope| {
        let ranks: Vec<_> = group
            .into_iter()
            .zip(devices)
            .map(|(dp, device)| {
                // `run`: a rank whose step fails stops the others at once.
                scope.spawn(move || {
                    dp.run(|dp| {
                        let rank = dp.ranks().rank();
                        // The rank's shard of each batch: its own rows (seeded by step and rank).
                        let shard = |step: usize| {
                            device.seed((step * devices.len() + rank) as u64);
                            (
                                Tensor::random([rows, width], Distribution::Default, device),
                                Tensor::random([rows, width], Distribution::Default, device),
                            )
                        };
                        let replica = replica_on(model, device);
                        let made = Instant::now();
                        let mut train = GraphedStep::data_parallel(
                            dp,
                            replica,
                            mse,
                            &AdamConfig::new(),
                            vec![shard(0)],
                            &GraphedConfig::new(),
                        )?;
                        let (mut losses, mut times) = (Vec::new(), Vec::new());
                        let mut first_step_s = f64::NAN;
                        for step in 0..steps {
                            let batch = shard(step);
                            let start = Instant::now();
                            let loss = train.run(batch, 1e-3)?;
                            times.push(start.elapsed().as_secs_f64() * 1e6);
                            losses.push(loss.into_scalar::<f32>());
                            if step == 0 {
                                first_step_s = made.elapsed().as_secs_f64();
                            }
                        }
                        times.sort_by(f64::total_cmp);
                        Ok(RankRun {
                            losses,
                            replays: train.stats().replays,
                            step_us: times.get(times.len() / 2).copied().unwrap_or(f64::NAN),
                            first_step_s,
                            model: train.into_module(),
                        })
                    })
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|rank| rank.join().expect("a rank's thread"))
            .collect()
    })
}

fn arg(index: usize, default: usize) -> usize {
    std::env::args()
        .nth(index)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

/// The NVIDIA GPUs the driver sees (0 where none answers).
#[cfg(feature = "cuda")]
pub fn gpu_count() -> usize {
    std::panic::catch_unwind(|| {
        cudarc::driver::result::init()
            .and_then(|()| cudarc::driver::result::device::get_count())
            .unwrap_or(0)
    })
    .unwrap_or(0) as usize
}

/// The devices and collective of the run: `wanted` GPUs and NCCL where there are that many, else
/// two ranks on the default device averaging through the host.
fn pick(wanted: usize) -> (Vec<Device>, Collective, String) {
    #[cfg(feature = "cuda")]
    {
        let count = gpu_count();
        if count >= wanted && wanted >= 2 {
            let gpus: Vec<Device> = (0..wanted).map(Device::cuda).collect();
            return (
                gpus.clone(),
                Collective::AllReduce { devices: gpus },
                format!("{wanted} GPUs, NCCL all-reduce"),
            );
        }
    }
    let _ = wanted;
    let device = Device::default();
    (
        vec![device.clone(), device],
        Collective::Host,
        "2 ranks on the default device, averaged through the host (fewer GPUs than asked)".into(),
    )
}

#[allow(dead_code)]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (devices, collective, what) = pick(arg(1, 2));
    let steps = arg(2, 100);
    let devices: Vec<Device> = devices.into_iter().map(Device::autodiff).collect();
    println!("ranks: {what}");
    devices[0].seed(0);
    let model = Mlp::new(256, 8, &devices[0]);
    let runs = train(&model, &devices, collective, steps, 32)?;
    for (rank, run) in runs.iter().enumerate() {
        println!(
            "rank {rank}: first step after {:.2} s (capture included), loss {:.5} -> {:.5}, {} of \
             {steps} steps replayed, median step {:.0} us",
            run.first_step_s,
            run.losses[0],
            run.losses[steps - 1],
            run.replays,
            run.step_us
        );
    }
    let first = burn_graphed_testkit::param_values(&runs[0].model)?;
    let same = runs[1..]
        .iter()
        .all(|run| burn_graphed_testkit::param_values(&run.model).is_ok_and(|v| v == first));
    println!("replicas bitwise equal: {same}");
    Ok(())
}
