//! Options of a graphed callable.

use burn::config::Config;

/// What a call does when it does not match the capture (other shapes, dtypes, `require_grad`,
/// train/eval mode, a backend without graphs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, burn::serde::Serialize, burn::serde::Deserialize)]
#[serde(crate = "burn::serde")]
pub enum MismatchPolicy {
    /// Run the wrapped callable eagerly and count the fallback (the default, as PyTorch does
    /// for `training` changes).
    Fallback,
    /// Return [`GraphedError::Mismatch`](crate::GraphedError::Mismatch).
    Error,
}

/// How outputs and gradients leave the static buffers that every replay overwrites.
#[derive(Debug, Clone, Copy, PartialEq, Eq, burn::serde::Serialize, burn::serde::Deserialize)]
#[serde(crate = "burn::serde")]
pub enum OutputPolicy {
    /// Hand out copies: one copy kernel per output and per gradient; a tensor kept across
    /// steps keeps its value, and no call ever runs eagerly because of one.
    Copy,
    /// Hand out the static buffers themselves: no copy, but a tensor kept past the next call
    /// of the same callable shows that call's values (PyTorch's behaviour).
    Static,
    /// Hand out the static buffers themselves, as `Static`, but never let a replay overwrite
    /// one that user code still holds: a call made while an output or gradient of an earlier
    /// replay is still alive runs eagerly
    /// ([`EagerReason::OutputStillHeld`](crate::EagerReason::OutputStillHeld)). The
    /// default: in the usual loop (outputs feed the loss, gradients feed the optimizer, both
    /// are dropped before the next step) nothing is held and every call replays without
    /// copies; a tensor kept across steps keeps its value, at the price of eager calls while
    /// it lives. Where outputs are kept on purpose (burn-train's `Learner` hands them to its
    /// metrics), `Copy` keeps every call replaying.
    ///
    /// A [`TensorData`](burn::tensor::TensorData) read from it is not a holder: burn 0.22.1
    /// reads lazily on its cubecl backends (the copy to the host happens on first access), so
    /// data first looked at after the next call shows that call's values, as it would after
    /// any in-place write of burn's fusion. Look at the data before the next call, or keep
    /// the tensor.
    Guarded,
}

/// Configuration of [`Graphed`](crate::Graphed).
#[derive(Config, Debug)]
pub struct GraphedConfig {
    /// Eager iterations (forward and backward) before each capture, at least, so that
    /// autotuning, fusion and the allocator reach their steady state.
    #[config(default = 3)]
    pub warmup_iters: usize,
    /// Eager iterations before each capture, at most: past `warmup_iters`, warm-up goes on
    /// until one iteration leaves the device's live allocations as the previous one did (no
    /// new cached kernel metadata, which a recording must not create; see docs/decisions.md).
    #[config(default = 12)]
    pub max_warmup_iters: usize,
    /// What a call that does not match the capture does.
    #[config(default = "MismatchPolicy::Fallback")]
    pub on_mismatch: MismatchPolicy,
    /// Input signatures (shapes, dtypes, `require_grad`) that may have graphs at once, the
    /// capture's own included. A call with a new signature is captured (warm-up and recording:
    /// milliseconds to seconds, once) while the cache has room or can evict its least recently
    /// used entry; beyond that it runs eagerly. 1 gives PyTorch's behaviour: only the sample's
    /// signature replays. Only for a callable captured alone: the members of a group keep the
    /// signatures they were captured with.
    #[config(default = 4)]
    pub max_graphs: usize,
    /// Device bytes that the cached graphs of one callable may hold together
    /// ([`GraphMemory::held_bytes`](crate::GraphMemory::held_bytes) each); `None`: no limit
    /// besides `max_graphs`. A new signature whose graphs do not fit runs eagerly.
    #[config(default = "None")]
    pub max_graph_bytes: Option<u64>,
    /// How outputs and gradients are handed out.
    #[config(default = "OutputPolicy::Guarded")]
    pub outputs: OutputPolicy,
    /// Whether calls without autodiff (after `valid()`, or a model built for inference) replay
    /// forward-only graphs, captured on first use of a signature in the same shape cache as the
    /// training graphs; `false`: such calls run eagerly (`EagerReason::NoAutodiff`).
    #[config(default = true)]
    pub graph_inference: bool,
    /// Accept inputs that require grad but are not used by the callable (their gradient is then
    /// absent), as PyTorch's `allow_unused_input`.
    #[config(default = false)]
    pub allow_unused_input: bool,
    /// Accept float parameters that do not require grad while training. A callable's graphs
    /// treat them as constants that the caller may replace between steps, never as state the
    /// forward updates; a whole step ([`GraphedStep`](crate::GraphedStep)) also keeps the values
    /// its forward writes into them, as burn's `BatchNorm` updates its running statistics.
    #[config(default = false)]
    pub allow_non_trainable_params: bool,
    /// After capturing each forward graph, replay it on new input values (the sample's,
    /// scaled and shifted) and compare it with an eager run on the same values; refuse the
    /// capture with [`GraphedError::ReplayDiffers`](crate::GraphedError::ReplayDiffers) when
    /// they differ. This catches what a graph silently freezes: burn's random ops (a replayed
    /// dropout would repeat one mask) and values read on the host inside the callable. Costs
    /// one eager forward and one replay per capture. Set `false` to accept frozen randomness.
    #[config(default = true)]
    pub validate_replay: bool,
    /// After a capture, return to the device the pool pages that only the capture's warm-ups
    /// used: a memory cleanup once every graph has been recorded and run, which releases the
    /// empty pages that no graph guards (the graphs' own pages stay, cubecl guards them until
    /// the graphs drop). Without it those pages stay reserved for later eager work. Costs one
    /// device sync per capture, and eager kernels re-upload their cached launch metadata once.
    #[config(default = true)]
    pub release_capture_memory: bool,
    /// Fail with [`GraphedError::Unsupported`](crate::GraphedError::Unsupported) instead of
    /// running eagerly when the device's backend cannot capture graphs.
    #[config(default = false)]
    pub require_graphs: bool,
}

/// The environment variable that chooses cubecl's persistent kernel cache when the process
/// starts. Unset: the cache (compiled kernels and autotune picks) is on under cubecl's
/// per-user directory (`~/.cache/cubecl` on Linux), unless the user's cubecl configuration
/// (`cubecl.toml`, or a `burn.toml`'s `[cubecl]` table) sets `[compilation] cache` itself;
/// `off`: burn-graphed leaves cubecl's configuration alone; any other value: the directory to
/// keep the cache in. A directory that cannot be written leaves the cache off and says so once,
/// as a `log` warning at the first capture; it never fails a program.
pub const KERNEL_CACHE_VAR: &str = "BURN_GRAPHED_KERNEL_CACHE";
