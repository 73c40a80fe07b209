//! # burn-graphed
//!
//! CUDA graphs for Burn training loops, in the manner of PyTorch's
//! `torch.cuda.make_graphed_callables`: wrap a module once with sample inputs, and each training
//! step replays one captured graph for the forward pass and one for the autodiff backward pass.
//! The rest of the loop (loss, `backward()`, `GradientsParams`, optimizer step, `valid()`)
//! stays as it is.
//!
//! ```no_run
//! use burn::nn::{Linear, LinearConfig, Relu};
//! use burn::prelude::*;
//! use burn_graphed::{Graphed, GraphedConfig};
//!
//! #[derive(Module, Debug)]
//! struct Mlp {
//!     hidden: Linear,
//!     output: Linear,
//! }
//!
//! impl Mlp {
//!     fn forward(&self, x: Tensor<2>) -> Tensor<2> {
//!         self.output.forward(Relu::new().forward(self.hidden.forward(x)))
//!     }
//! }
//!
//! # fn main() -> Result<(), burn_graphed::GraphedError> {
//! let device = Device::default().autodiff();
//! let mlp = Mlp {
//!     hidden: LinearConfig::new(64, 64).init(&device),
//!     output: LinearConfig::new(64, 8).init(&device),
//! };
//! let sample = Tensor::<2>::zeros([32, 64], &device);
//! let model = Graphed::new(mlp, Mlp::forward, sample, &GraphedConfig::new())?;
//!
//! let x = Tensor::<2>::ones([32, 64], &device);
//! let y = model.forward(x)?; // replays the forward graph
//! let grads = y.powi_scalar(2).mean().backward(); // replays the backward graph
//! # let _ = grads;
//! # Ok(())
//! # }
//! ```
//!
//! Graphs are captured on burn's cubecl backend with fusion (`cuda`; `wgpu` records its own
//! software graphs). On other backends (`flex`) every call runs eagerly, so the same code runs
//! everywhere. See ARCHITECTURE.md for the design and its invariants.
#![warn(missing_docs)]

mod config;
#[cfg(feature = "cube")]
mod cube;
mod error;
mod graphed;
mod group;
mod multi_adam;
mod optim;
mod params;
mod rng;
mod shape_cache;
mod stats;
mod tensors;

/// Locks `mutex`, also after a panic elsewhere poisoned it: every mutex of this crate guards
/// counters and records that stay consistent between statements, so a poisoned one is usable.
pub(crate) fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

pub use config::{FaultInjection, GraphedConfig, MismatchPolicy, OutputPolicy};
pub use error::{CapturePhase, GraphedError};
pub use graphed::Graphed;
pub use group::{Callable, CallableGroup, make_graphed_callables};
pub use multi_adam::MultiTensorAdam;
pub use optim::{FusedAdam, FusedAdamConfig};
pub use rng::{DeviceRng, GraphDropout, reference_mask, reference_normal, reference_uniform};
pub use shape_cache::ShapeCacheStats;
pub use stats::{CaptureSummary, FallbackReason, GraphMemory, GraphStats};
pub use tensors::{FlatTensor, TensorGroup};
