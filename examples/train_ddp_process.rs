//! Data-parallel graphed training with one process per GPU, as `torchrun` runs PyTorch's DDP:
//!
//! ```sh
//! cargo build --release --features cuda --example train_ddp_process
//! cargo xtask launch --nproc 2 -- target/release/examples/train_ddp_process [steps]
//! ```
//!
//! Each process reads its rank from the launcher's variables (`ProcessEnv`), trains on GPU
//! `LOCAL_RANK` (the default device without `cuda`), joins the group at rank 0's address,
//! takes rank 0's starting values (`DataParallel::broadcast`: each process initialized its
//! model with its own random draws) and runs a whole step per batch, its gradients averaged by
//! NCCL inside the step's graph on CUDA (`Collective::Nccl`), through the host elsewhere
//! (`Collective::Host`). On
//! several machines, run the launcher on each with `--nnodes`, `--node-rank`, and rank 0's
//! `--master-addr` and `--master-port`. Every rank prints a digest of its trained parameters:
//! equal digests, equal replicas.

#[path = "common/progress.rs"]
mod progress;
#[path = "train_ddp.rs"]
#[allow(dead_code)]
mod train_ddp;

use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::AdamConfig;
use burn::prelude::*;
use burn::tensor::Distribution;
use burn_graphed::{Collective, DataParallel, GraphedConfig, GraphedStep, ProcessEnv};
use train_ddp::{Mlp, mse};

/// The device of this machine's `local_rank`-th process, and how the group averages there:
/// NCCL inside the step's graph on a GPU, through the host elsewhere.
fn device(local_rank: usize) -> (Device, Collective) {
    #[cfg(feature = "cuda")]
    if local_rank < train_ddp::gpu_count() {
        return (
            Device::cuda(local_rank),
            Collective::Nccl { in_graph: true },
        );
    }
    let _ = local_rank;
    (Device::default(), Collective::Host)
}

/// A digest of the parameters' values (not their ids, which each process drew itself).
struct Digest(std::collections::hash_map::DefaultHasher);

impl ModuleVisitor for Digest {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        param.val().into_data().as_bytes().hash(&mut self.0);
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    progress::install();
    let env = ProcessEnv::from_env()?;
    let steps = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(50);
    let (width, rows) = (256, 32);
    let (device, collective) = device(env.local_rank);
    let device = device.autodiff();
    let dp = DataParallel::join(&env, Duration::from_secs(300), collective)?;
    let started = Instant::now();
    // Each process draws its own starting values; the broadcast makes them rank 0's.
    device.seed(1000 + env.rank as u64);
    let model = dp.broadcast(Mlp::new(width, 4, &device))?;
    let shard = |step: usize| {
        device.seed((step * env.world_size + env.rank) as u64);
        (
            Tensor::random([rows, width], Distribution::Default, &device),
            Tensor::random([rows, width], Distribution::Default, &device),
        )
    };
    let mut train = GraphedStep::data_parallel(
        &dp,
        model,
        mse,
        &AdamConfig::new(),
        vec![shard(0)],
        &GraphedConfig::new(),
    )?;
    let mut losses = Vec::new();
    for step in 0..steps {
        losses.push(train.run(shard(step), 1e-3)?.into_scalar::<f32>());
        if step == 0 {
            println!(
                "rank {}: first step after {:.2} s (capture included)",
                env.rank,
                started.elapsed().as_secs_f64()
            );
        }
    }
    let mut digest = Digest(Default::default());
    train.into_module().visit(&mut digest);
    println!(
        "rank {} of {} on {:?}: loss {:.5} -> {:.5}, parameters' digest {:016x}",
        env.rank,
        env.world_size,
        device,
        losses.first().copied().unwrap_or(f32::NAN),
        losses.last().copied().unwrap_or(f32::NAN),
        digest.0.finish()
    );
    Ok(())
}
