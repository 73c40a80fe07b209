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
//! ## The fastest step
//!
//! Put the loss inside the graphed callable, keep the default hand-outs of the graphs' own
//! buffers ([`OutputPolicy::Guarded`]), and train with [`MultiTensorAdam`]: outside the graphs
//! a step then queues the input copies, the seed gradient and one optimizer operation
//! (BENCHMARKS.md has the figures).
//!
//! ```no_run
//! # use burn::nn::{Linear, LinearConfig};
//! # use burn::prelude::*;
//! use burn::optim::GradientsParams;
//! use burn_graphed::{FusedAdamConfig, Graphed, GraphedConfig};
//! # #[derive(Module, Debug)]
//! # struct Mlp {
//! #     layer: Linear,
//! # }
//! # impl Mlp {
//! #     fn forward(&self, x: Tensor<2>) -> Tensor<2> {
//! #         self.layer.forward(x)
//! #     }
//! # }
//!
//! /// The model's forward and its loss, as one callable: its graphs end in the loss.
//! fn mse(model: &Mlp, (x, target): (Tensor<2>, Tensor<2>)) -> Tensor<1> {
//!     (model.forward(x) - target).powi_scalar(2).mean()
//! }
//!
//! # fn main() -> Result<(), burn_graphed::GraphedError> {
//! # let device = Device::default().autodiff();
//! # let mlp = Mlp { layer: LinearConfig::new(64, 8).init(&device) };
//! # let batches: Vec<(Tensor<2>, Tensor<2>)> = Vec::new();
//! let sample = (Tensor::zeros([32, 64], &device), Tensor::zeros([32, 8], &device));
//! let mut model = Graphed::new(mlp, mse, sample, &GraphedConfig::new())?;
//! let mut optim = FusedAdamConfig::new().init_multi_tensor();
//! for batch in batches {
//!     let loss = model.forward(batch)?; // replays the forward graph, loss included
//!     let grads = GradientsParams::from_grads(loss.backward(), &model); // the backward graph
//!     model = optim.step(1e-3, model, grads); // in place in the graphs' parameter buffers
//! }
//! # Ok(())
//! # }
//! ```
//!
//! Faster still, one graph per training step: [`GraphedStep`] (forward, loss, backward,
//! clipping and burn's Adam, AdamW or SGD in one replay); on several GPUs of one host,
//! [`GraphedStep::data_parallel`] (two replays per step, the gradients averaged between them).
//!
//! Graphs are captured on burn's cubecl backend with fusion (`cuda`; `wgpu` records its own
//! software graphs). On other backends (`flex`) every call runs eagerly, so the same code runs
//! everywhere. With the `train` feature, burn-train's `Learner` takes a graphed model
//! (`GraphedTrainStep`). See ARCHITECTURE.md for the design and its invariants.
#![warn(missing_docs)]

// The vocabulary: no backend types.
mod callable;
mod config;
mod counter_rng;
mod error;
// Used by the engine with `cube`, reachable by users with `testing`.
#[cfg_attr(not(all(feature = "testing", feature = "cube")), allow(dead_code))]
mod faults;
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
mod host_phases;
mod params;
mod ranks;
mod shape_cache;
mod stats;
mod step_optim;
mod sync;
mod tensors;

// The engine, behind its front door (`cube/mod.rs`).
mod cube;

// The features: a folder for a product of several files (`graphed/`, `step/`, `optim/`,
// `nn/`), a file for one of one.
mod data_parallel;
mod graphed;
pub mod nn;
mod optim;
mod rng;
mod route;
mod step;
#[cfg(feature = "train")]
mod train;

pub use callable::Callable;
pub use config::{GraphedConfig, KERNEL_CACHE_VAR, MismatchPolicy, OutputPolicy};
pub use data_parallel::{Collective, DataParallel, replica_on};
pub use error::{CapturePhase, GraphedError};
pub use graphed::Graphed;
pub use graphed::group::{CallableGroup, make_graphed_callables};
pub use optim::multi_adam::MultiTensorAdam;
pub use optim::{FusedAdam, FusedAdamConfig};
pub use ranks::{ProcessEnv, RankGroup};
pub use rng::{DeviceRng, GraphDropout};
pub use shape_cache::ShapeCacheStats;
pub use stats::{
    CaptureSummary, EagerReason, GraphContents, GraphMemory, GraphNodes, GraphStats, Prepared,
    StepStats, TunedBundle,
};
pub use step::GraphedStep;
pub use step_optim::{
    BurnConfig, Clipping, IntoStepOptimizer, SgdMomentum, StepOptimizer, clip_grad_norm,
};
pub use tensors::{ElementKind, FlatTensor, GraphKind, TensorGroup};
#[cfg(feature = "train")]
pub use train::{GraphedInferenceStep, GraphedTrainStep};

/// Turns on cubecl's persistent cache of compiled kernels and autotune results, under `dir`
/// (or, with `None`, where cubecl's configuration puts it), so that a later process captures
/// without compiling again. The cache is on from process start by default
/// ([`KERNEL_CACHE_VAR`]): with it on, this moves it to `dir` for every kernel compiled or
/// tuned from now on (call it before the first capture). With it off (opted out, or a
/// configuration file says so), call it first thing in `main`, before any tensor operation.
///
/// # Errors
///
/// [`GraphedError::KernelCacheTooLate`] when the cache is off and cubecl's configuration is
/// already loaded (nothing changes; a `cubecl.toml` with `[compilation] cache = true` does the
/// same).
pub fn enable_kernel_cache(dir: Option<std::path::PathBuf>) -> Result<(), GraphedError> {
    if cube::enable_kernel_cache(dir) {
        Ok(())
    } else {
        Err(GraphedError::KernelCacheTooLate)
    }
}

/// Where compiled kernels and autotune picks are kept for the next process (cubecl's
/// environment file), or `None` where the kernel cache is off or the build has no cubecl
/// backend. Loads cubecl's configuration if no tensor operation did yet.
pub fn kernel_cache_location() -> Option<std::path::PathBuf> {
    cube::kernel_cache_location()
}

/// Writes the kernel picks cubecl's autotune made in this process and earlier ones (its
/// persistent cache: autotune results, and the compiled kernels where the cache keeps them) to
/// the file `out`, for [`import_tuned`] on other machines of the same GPU, driver and crate
/// versions: a cluster or a CI job then tunes once. Call it at the end of a run that met every
/// shape the model will meet (a capture of each, or a first step of each).
///
/// # Errors
///
/// [`GraphedError::TunedBundle`] naming `out` when the cache cannot be read or `out` cannot be
/// written (nothing is left at `out` then), or in a build without a cubecl backend.
pub fn export_tuned(out: impl AsRef<std::path::Path>) -> Result<TunedBundle, GraphedError> {
    let out = out.as_ref();
    cube::export_tuned(out).map_err(|reason| GraphedError::TunedBundle {
        argument: "out",
        path: out.display().to_string(),
        reason,
    })
}

/// Copies the kernel picks of a bundle that [`export_tuned`] wrote into this machine's cubecl
/// cache, so that the kernels it names are compiled without tuning. Entries the cache holds
/// already keep their value; cubecl reads only the entries of its own version and of this
/// device (a bundle from another GPU is copied and never read), and checks each pick against
/// the kernels it tunes, so a stale bundle costs a tuning, never a wrong kernel. Call it first
/// thing in `main`, before the first capture.
///
/// # Errors
///
/// [`GraphedError::TunedBundle`] naming `path` when it is not a bundle (nothing is copied), or
/// in a build without a cubecl backend. Entries the cache could not write (a read-only
/// directory, a full disk) are counted in [`TunedBundle::failed`], not an error: they are tuned
/// when needed, as without the bundle.
pub fn import_tuned(path: impl AsRef<std::path::Path>) -> Result<TunedBundle, GraphedError> {
    let path = path.as_ref();
    cube::import_tuned(path).map_err(|reason| GraphedError::TunedBundle {
        argument: "path",
        path: path.display().to_string(),
        reason,
    })
}

/// Whether `f32` matrix products on CUDA may round their operands to TF32 (10-bit mantissa) on
/// tensor cores, as PyTorch's `torch.backends.cuda.matmul.allow_tf32`. Allowed by default (as
/// in cubecl): cubecl's autotune then times TF32 tensor-core kernels among its candidates for
/// burn's `f32` matmuls and convolutions and keeps whichever is fastest, per operand layout,
/// so two runs of one `f32` formula (eager and graphed, or two processes) may round
/// differently. With `false`, `f32` products run in `f32` on CUDA cores: one formula rounds
/// alike wherever it runs, up to the order of its sums, and compares with PyTorch's default
/// (`allow_tf32 = False`). [`nn::Linear`]'s cuBLASLt products follow it too; `f16` and `bf16`
/// products are not affected, nor is [`nn::attention::attention`] in `f32`, which multiplies on
/// TF32 tensor cores either way with each operand split into two TF32 parts (3xTF32, `f32`'s
/// accuracy but for about `2^-20` of a product, as PyTorch's `f32` attention). The setting is
/// read when a CUDA device is first used: call this first thing in `main`. NVIDIA's
/// `NVIDIA_TF32_OVERRIDE=0` turns TF32 off whatever is set here. No effect without the `cuda`
/// feature.
///
/// # Errors
///
/// [`GraphedError::Tf32TooLate`] when a CUDA device was already created with the other
/// setting (nothing changes).
pub fn allow_tf32(allowed: bool) -> Result<(), GraphedError> {
    cube::set_tf32_allowed(allowed).map_err(|held| GraphedError::Tf32TooLate {
        requested: allowed,
        held,
    })
}

/// Whether CUDA devices created from now on may run `f32` products on TF32 tensor cores
/// ([`allow_tf32`]; `NVIDIA_TF32_OVERRIDE=0` included). `false` without the `cuda` feature.
pub fn tf32_allowed() -> bool {
    cube::tf32_allowed()
}

/// Writes every graph captured from now on, in this process, as a Graphviz DOT file
/// `dir/<process id>-NNNN-<phase>.dot` (numbered in capture order), with each node's kernel
/// name and launch parameters, as PyTorch's `CUDAGraph.debug_dump` writes, and names the file
/// in the graph's [`GraphContents::dot`]; `None` stops. CUDA only: wgpu's software graphs
/// write nothing. A file that cannot be written is a warning of log target
/// `burn_graphed::capture`, never an error of the capture.
pub fn write_graphs_as_dot(dir: Option<std::path::PathBuf>) {
    cube::write_graphs_as_dot(dir)
}

/// Runs `work` and, while it runs longer than a second, says so as a capture does: a line of
/// log target `burn_graphed::progress` (level `info`) after a second and every five seconds,
/// naming `what`, the time so far and the distinct kernels launched so far, then one when it
/// ends. For the long work outside a capture: a model's first eager steps compile and tune
/// every kernel they launch (a minute or more for a transformer's cold start), and silence
/// reads as a hang. With no logger that shows the target, nothing is watched. Without a
/// cubecl backend it runs `work` and says nothing.
///
/// ```
/// let loss = burn_graphed::report_progress("first eager step", || 2.0 * 21.0);
/// assert_eq!(loss, 42.0);
/// ```
pub fn report_progress<T>(what: &str, work: impl FnOnce() -> T) -> T {
    cube::report_while(what, work)
}

/// Whether graphed calls on `device` capture and replay graphs (burn's cubecl backends, CUDA
/// and wgpu) or run every call eagerly (Flex; any backend without the `cube` feature). It
/// says what the backend can do: a capture can still fail on such a device, with an error.
pub fn supports_graphs(device: &burn::prelude::Device) -> bool {
    cube::supports_graphs(device)
}

/// Hooks for tests and benchmarks (the `testing` feature): deliberate faults that prove the
/// equivalence checks catch them, and the host reference of [`DeviceRng`]'s draws.
#[cfg(feature = "testing")]
pub mod testing {
    pub use crate::counter_rng::{reference_mask, reference_normal, reference_uniform};
    pub use crate::faults::{FaultGuard, FaultInjection, exit_after_agreement, inject};

    /// Turns off (`false`) or on the abort of a data-parallel group's NCCL communicators when
    /// the group ends with a rank gone: a negative control, to show that a device then waits
    /// in the all-reduce for good. On by default.
    pub fn nccl_abort(on: bool) {
        crate::cube::nccl_set_abort(on);
    }

    /// Makes CUDA recordings begin in CUDA's global capture mode (`true`), where a potentially
    /// unsafe CUDA call of any other thread invalidates a recording, or in thread-local mode
    /// (`false`, the default), where only the recording device's own thread is restricted: a
    /// negative control. Process-wide; global mode also keeps every device's captures one at a
    /// time.
    pub fn capture_in_global_mode(on: bool) {
        crate::cube::set_capture_global_mode(on);
    }

    /// Makes the NCCL watchdog's next poll report `reason` as an asynchronous error of every
    /// communicator of this process, as a failing network would.
    pub fn inject_nccl_error(reason: &str) {
        crate::cube::nccl_inject_error(reason);
    }

    /// The NCCL all-reduces this process enqueued so far: `(in place, into a new buffer)`. A
    /// bucket the all-reduce alone holds is reduced in its own buffer; one held elsewhere too
    /// keeps its values, and the mean goes to a new buffer.
    pub fn nccl_reductions() -> (usize, usize) {
        crate::cube::nccl_reductions()
    }

    /// Makes the data-parallel steps captured after it, with the all-reduce inside their graph
    /// and one micro-batch, start their all-reduces during the backward, bucket by bucket
    /// (`true`), or after it, in one bucket (`false`, the default until two GPUs measure the
    /// overlap's gain): the A/B.
    pub fn overlap_all_reduces(on: bool) {
        crate::cube::set_overlap(on);
    }

    /// Makes the all-reduces that [`overlap_all_reduces`] starts during the backward run on a
    /// side stream beside it (`true`, the default), or on the backward's own stream in its order
    /// (`false`): the A/B of what the fork and the joins cost a step.
    pub fn overlap_on_side_stream(on: bool) {
        crate::cube::nccl_set_side_stream(on);
    }

    /// Makes the steps captured after it cut their gradients' buckets at `caps` bytes (the
    /// first bucket's, the others'; PyTorch's DDP's 1 MiB and 25 MiB by default, `None`).
    pub fn overlap_bucket_caps(caps: Option<(usize, usize)>) {
        crate::cube::set_overlap_caps(caps);
    }

    /// The gradient buckets this process started so far: while their backward went on, and
    /// after it.
    pub fn overlap_starts() -> (usize, usize) {
        crate::cube::overlap_starts()
    }

    /// [`DataParallel`](crate::DataParallel)'s mean of every rank's `bucket` (a 1-D float
    /// tensor, the same length on every rank, each rank calling at once), as a step averages
    /// its gradients' bucket.
    ///
    /// # Errors
    ///
    /// The collective's, as [`DataParallel::average`](crate::DataParallel::average)'s.
    pub fn all_reduce_mean(
        group: &crate::data_parallel::DataParallel,
        bucket: burn::tensor::Tensor<1>,
    ) -> Result<burn::tensor::Tensor<1>, crate::error::GraphedError> {
        group.mean(bucket)
    }
    pub use crate::host_phases::{HostPhase, phase_times, time_phases};

    /// How many ops this process ran through the fused kernels of [`crate::nn`] (norms,
    /// cross-entropy; not burn's composition): a test's proof that the fused path ran.
    pub fn fused_ops() -> usize {
        crate::cube::fused_norm_forwards()
    }

    /// How many matrix products this process ran through cuBLASLt (`burn_graphed::nn::Linear`
    /// on CUDA, forward and backward): a test's proof that the vendor path ran.
    pub fn vendor_matmuls() -> usize {
        crate::cube::vendor_gemms()
    }

    /// How many copies into a graph's static buffers this process enqueued as driver copies
    /// (`cuMemcpyDtoDAsync`, on CUDA, where the source is laid out as the buffer) rather than
    /// with cubecl's copy kernel: a test's proof that the driver path ran.
    pub fn driver_copies() -> usize {
        crate::cube::driver_copies()
    }

    /// How many attention calls (forwards and backwards) this process ran on tensor cores
    /// (`burn_graphed::nn::attention` and its modules in `f16` or `bf16`, a head dimension a
    /// multiple of 16 up to 64, on a device with 16x16x16 tensor-core products: CUDA): a test's
    /// proof that those kernels ran.
    pub fn attention_tensor_core_calls() -> usize {
        crate::cube::attention_tensor_core_calls()
    }

    /// How many self-attention calls of `burn_graphed::nn::attention::MultiHeadAttention`
    /// this process queued with the query, key and value projections as one product (the
    /// packed kernels): a test's proof that the joined path ran.
    pub fn packed_attention_calls() -> usize {
        crate::cube::packed_attention_calls()
    }

    /// The packed attention kernels (`MultiHeadAttention`'s self-attention path) on `qkv`
    /// `[batch, len, 3 * heads, dim]`, the queries', keys' and values' heads in turn, as
    /// `burn_graphed::nn::attention::attention` computes it without a mask (causal or not):
    /// `[batch, len, heads, dim]`, with the backward into `qkv`'s layout; `None` where the
    /// kernels do not take it (no cubecl backend, another dtype, a head dimension above 64).
    pub fn attention_packed(
        qkv: burn::tensor::Tensor<4>,
        causal: bool,
    ) -> Option<burn::tensor::Tensor<4>> {
        crate::nn::attention::attention_packed(qkv, causal)
    }

    /// Makes the attention's backward on tensor cores take `(grad_keys, rows)`: keys per block of
    /// a dQ cube's plane and query rows per block of a dK/dV cube's plane, each where it is 16,
    /// 32 or 64 and no larger than the block chosen for the head dimension (the largest that
    /// fits the shared memory); `None`: as chosen. Process-wide, read when a call's kernels
    /// launch. The values depend on it only through the order of the sums.
    pub fn force_attention_blocks(blocks: Option<(usize, usize)>) {
        crate::cube::force_attention_blocks(blocks);
    }

    /// Makes every fused convolution's forward and input gradient (`burn_graphed::nn::conv2d`)
    /// compute `(per_unit, block, splits)`: `per_unit` pixels of `block` channels per unit, the
    /// forward's summed channels split in `splits` parts of a cube (a power of two up to 16;
    /// the input gradient takes no split, nor a forward of over 32 sums a unit, whose parts
    /// would not fit a cube's shared memory), whatever the shapes (`None`: chosen by size again),
    /// so that small test shapes run every tiling. Process-wide. The values depend on the
    /// split only (it changes the order of the sums), within the tests' bound.
    pub fn force_conv_tiling(tiling: Option<(usize, usize, usize)>) {
        crate::cube::force_conv_tiling(tiling);
    }

    /// Whether products on `device` run through cuBLASLt (a CUDA device, `libcublasLt` found,
    /// `BURN_GRAPHED_VENDOR_MATMUL` not `off`).
    pub fn vendor_matmul_available(device: &burn::prelude::Device) -> bool {
        crate::cube::vendor_matmul_available(device)
    }

    /// Rows per chunk of the fused layer and RMS norms' parameter-gradient sums over `rows`
    /// rows: each chunk sums its rows in order in `f32`, then the chunks are added in
    /// [`norm_sum_lanes`] lanes (the order a test's rounding bound follows).
    pub fn norm_rows_per_chunk(rows: usize) -> usize {
        crate::cube::norm_rows_per_chunk(rows)
    }

    /// Lanes the fused norms add their chunks' sums in: lane `l` adds chunks `l, l + lanes,
    /// ...` in order, then the lanes are added in order.
    pub fn norm_sum_lanes() -> usize {
        crate::cube::norm_sum_lanes()
    }

    /// Captures from now on write their progress lines (`log` target
    /// `burn_graphed::progress`) after `first` and every `every`, in place of one second and
    /// five: a test's way to see a short capture report.
    pub fn set_capture_progress(first: std::time::Duration, every: std::time::Duration) {
        crate::cube::set_progress_intervals(first, every)
    }
}
