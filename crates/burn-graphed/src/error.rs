//! The error type of every fallible operation in this crate.

pub use crate::stats::CapturePhase;
use crate::stats::EagerReason;
use crate::tensors::{FlatTensor, TensorSpec};

/// Everything that can go wrong when capturing or calling a graphed callable.
///
/// Every variant names the argument or the step concerned, what was given and what was
/// expected. None of them leaves the model or the device in a changed state: a failed capture
/// drops its partial graphs and static buffers, and a rejected call runs nothing.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum GraphedError {
    /// After capture, the forward graph replayed on new input values gave other outputs than an
    /// eager run of the callable on the same values: the callable does something that a graph
    /// cannot repeat.
    #[error(
        "callable {callable}: the replayed forward graph differs from eager execution on the same \
         inputs (output {output}: {detail}). A graph repeats what it recorded: random ops (burn's \
         Dropout draws its mask on the host, so a replay would reuse one mask forever: use \
         burn_graphed::GraphDropout, whose DeviceRng draws anew on every replay, keep random \
         ops outside the graphed callable, or set `validate_replay = false` to accept frozen \
         randomness) and values read on the host inside the callable (`into_data`, \
         `into_scalar`: a replay reuses the value read at capture; move the read out of the \
         callable) cannot be graphed"
    )]
    ReplayDiffers {
        /// Position of the callable in its group (0 when captured alone).
        callable: usize,
        /// Position of the first differing output among the flattened outputs.
        output: usize,
        /// Where and by how much it differs.
        detail: String,
    },
    /// A check of one callable of a group (several captured together) failed: which one, and
    /// why. A callable captured alone reports the inner error directly.
    #[error("callable {callable} of the group: {error}")]
    InGroup {
        /// Position of the callable in the group.
        callable: usize,
        /// What is wrong with it.
        error: Box<GraphedError>,
    },
    /// A dropout probability outside `[0, 1)`.
    #[error("dropout probability {prob} is not in [0, 1)")]
    InvalidProbability {
        /// The probability given.
        prob: f64,
    },
    /// A call passed a different number of input tensors than the sample inputs had.
    #[error(
        "wrong number of inputs: the callable was captured with {expected} input tensor(s), got {got}"
    )]
    InputCount {
        /// Tensors in the sample inputs.
        expected: usize,
        /// Tensors passed now.
        got: usize,
    },
    /// An input lives on another device than the one the graphs were captured on.
    #[error("input {index}: device {got} differs from the capture device {expected}")]
    InputDevice {
        /// Position of the tensor among the flattened inputs.
        index: usize,
        /// Capture device.
        expected: String,
        /// Device of the tensor passed now.
        got: String,
    },
    /// The module's parameters are not the ones it had at capture (added, removed, reshaped).
    #[error("the module's parameters changed since capture: {detail}")]
    ParametersChanged {
        /// What differs.
        detail: String,
    },
    /// The call has more float inputs and parameters than one graphed call takes: its autodiff
    /// node has one parent per float input and parameter, and the node types go up to a fixed
    /// count.
    #[error(
        "the callable has {parents} float inputs and parameters together, more than the {max} \
         one graphed call supports; graph a smaller part of the model, or group parameters \
         into fewer tensors"
    )]
    TooManyParents {
        /// Float inputs plus parameters of the callable.
        parents: usize,
        /// The most one graphed call supports.
        max: usize,
    },
    /// The module holds float state that is not trained (e.g. batch-norm running statistics),
    /// which a replayed graph would not keep up to date.
    #[error(
        "parameter {index} ({shape:?}) does not require grad while the module is in training mode: \
         it may be state that the forward updates (e.g. BatchNorm running statistics), which a \
         replayed graph would leave stale. Set `allow_non_trainable_params` only if such \
         tensors are constants"
    )]
    NonTrainableState {
        /// Position of the parameter in visiting order.
        index: usize,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// An input that requires grad received no gradient at capture.
    #[error(
        "input {index} requires grad but the callable does not use it; \
         set `allow_unused_input` to accept that (its gradient is then absent)"
    )]
    UnusedInput {
        /// Position of the tensor among the flattened inputs.
        index: usize,
    },
    /// A chained callable of a group cannot take the previous callable's outputs as inputs.
    #[error("callable {index} of the group is chained to the previous one, but {detail}")]
    Chain {
        /// Position of the callable in the group.
        index: usize,
        /// What does not fit.
        detail: String,
    },
    /// The sample inputs contained no tensor.
    #[error("a graphed callable needs at least one input tensor")]
    NoInputs,
    /// The callable returned no tensor.
    #[error("the callable returned no output tensor")]
    NoOutputs,
    /// burn-graphed broke one of its own invariants: a bug, not a misuse. Nothing was replayed
    /// with it; the model and the optimizer state are as the last finished call left them.
    #[error(
        "burn-graphed broke its own invariant ({what}): a bug; please report it with the call \
         that led here"
    )]
    Internal {
        /// The invariant that did not hold.
        what: &'static str,
    },
    /// The callable returned only int and bool tensors: nothing a gradient can flow back through.
    #[error(
        "the callable returned no float tensor (outputs: {outputs}); a graphed training call \
         needs at least one float output to carry the gradient back"
    )]
    NoFloatOutput {
        /// The outputs' kinds and shapes, e.g. `Int [4, 16]`.
        outputs: String,
    },
    /// The device's backend cannot record graphs and `require_graphs` was set.
    #[error(
        "the backend of device {device} cannot capture graphs (needs burn's cubecl backend: cuda or wgpu)"
    )]
    Unsupported {
        /// The device.
        device: String,
    },
    /// The device and the module disagree on autodiff: capture needs a training setup.
    #[error("capture needs {what} on an autodiff device (Device::autodiff()); got {device}")]
    NotAutodiff {
        /// What was not on an autodiff device.
        what: &'static str,
        /// The device found.
        device: String,
    },
    /// An input holds no values: the device never wrote its bytes (an allocation or a launch
    /// that made it failed, and the backend skipped every launch that read it since), so a
    /// graph can neither record nor replay work that reads it. Found when a capture fails (the
    /// backend refuses to seal a recording that skipped a launch; the capture then reads its
    /// sample inputs back) and at a call (the copy into the graph's input buffer finds it,
    /// before any output is handed out). Eager code given the tensor fails at its next read.
    #[error(
        "input {index} holds no values: the work that made this tensor failed on the device (a \
         failed allocation or launch), and a graph can neither record nor replay work that \
         reads it; find that failure (eager code reading the tensor fails the same way). The \
         backend's account: {reason}"
    )]
    InputNotWritten {
        /// Position of the tensor among the flattened inputs.
        index: usize,
        /// What the backend reported for the tensor.
        reason: String,
    },
    /// A parameter of the module holds no values: the device never wrote its bytes (see
    /// [`GraphedError::InputNotWritten`]; a parameter gets there when an optimizer step read a
    /// gradient that a failed launch left unwritten, for example). Found when a capture fails
    /// (by reading the module's parameters back) and at a call that copies the parameter into
    /// the graph's buffer.
    #[error(
        "parameter {index} ({shape:?}) holds no values: the work that made it (an \
         initialization or an optimizer step) failed on the device, and a graph can neither \
         record nor replay work that reads it; the module cannot train on this device as it \
         is, eagerly either. The backend's account: {reason}"
    )]
    ParameterNotWritten {
        /// Position of the parameter in visiting order.
        index: usize,
        /// Its shape.
        shape: Vec<usize>,
        /// What the backend reported for the parameter.
        reason: String,
    },
    /// A data-parallel step's gradients hold no values on this rank: the work that made them
    /// failed on the device (a launch cubecl skipped because it read a tensor an earlier
    /// failure left unwritten, such as an unwritten input batch). Found before the all-reduce
    /// and stated to every rank: cubecl skips a collective whose source holds no values, so
    /// averaging would leave the other ranks waiting in NCCL for good.
    #[error(
        "the gradients to average hold no values: the work that made them failed on the device \
         (an input or parameter it read holds no values). The backend's account: {reason}"
    )]
    GradientsNotWritten {
        /// What the backend reported for the gradient bucket.
        reason: String,
    },
    /// A capture step failed; the graphs were dropped and the device left out of capture mode.
    #[error("capture failed during {phase}: {reason}")]
    Capture {
        /// The step that failed.
        phase: CapturePhase,
        /// What the backend reported.
        reason: String,
    },
    /// Replaying a captured graph failed.
    #[error("graph replay failed ({which}): {reason}")]
    Replay {
        /// `forward` or `backward`.
        which: &'static str,
        /// What the backend reported.
        reason: String,
    },
    /// An argument of a whole-step call or constructor is not what it must be.
    #[error("argument `{argument}`: {detail}")]
    InvalidArgument {
        /// The argument.
        argument: &'static str,
        /// What was given and what was expected.
        detail: String,
    },
    /// cubecl's persistent kernel cache was asked for, with the cache off, after cubecl's
    /// configuration was loaded.
    #[error(
        "the kernel cache is off (BURN_GRAPHED_KERNEL_CACHE=off, or a cubecl configuration \
         file says so) and cubecl's configuration is already loaded by a tensor operation: \
         turn it on first thing in main, unset BURN_GRAPHED_KERNEL_CACHE, or put \
         `[compilation] cache = true` in the cubecl.toml"
    )]
    KernelCacheTooLate,
    /// [`crate::export_tuned`] or [`crate::import_tuned`] could not write or read its bundle.
    #[error(
        "argument `{argument}`: the kernel picks bundle {path}: {reason} (export_tuned writes \
         one after a run; import_tuned reads it before the first tensor operation)"
    )]
    TunedBundle {
        /// `out` (export) or `path` (import).
        argument: &'static str,
        /// The bundle's path.
        path: String,
        /// cubecl's reason.
        reason: String,
    },
    /// [`crate::allow_tf32`] asked for a change after a CUDA device was created.
    #[error(
        "argument `allowed`: allow_tf32({requested}) was called after a CUDA device was created \
         with TF32 {}; the setting is read when a device is first used (call allow_tf32 first \
         thing in main{})",
        if *held { "allowed" } else { "off" },
        if *requested { ", and leave NVIDIA_TF32_OVERRIDE unset" } else { ", or set NVIDIA_TF32_OVERRIDE=0" }
    )]
    Tf32TooLate {
        /// The setting asked for.
        requested: bool,
        /// The setting the created devices hold.
        held: bool,
    },
    /// A call does not match the capture and the policy is to refuse rather than run eagerly.
    #[error("call does not match the capture and on_mismatch = Error: {reason} ({detail})")]
    Mismatch {
        /// Why the call does not match.
        reason: EagerReason,
        /// The input concerned, what was given and what the capture took (or, for a reason
        /// that names no input, the call's input signature).
        detail: String,
    },
    /// A rank of a data-parallel group failed at a step every rank takes together; every rank
    /// gets this error and stops there (the others would wait in a collective forever).
    #[error("data-parallel group: rank {rank} failed at `{what}`: {reason}; every rank stops here")]
    RankFailed {
        /// The first rank that failed.
        rank: usize,
        /// The step the ranks were deciding.
        what: String,
        /// That rank's error.
        reason: String,
    },
    /// The ranks of a data-parallel group decided differently at a step that must be the same
    /// on every rank (replay or eager, what to capture); every rank stops there.
    #[error(
        "data-parallel group: the ranks decided differently at `{what}` ({decisions}); a \
         collective would hang, so every rank stops here"
    )]
    RanksDisagree {
        /// The step the ranks were deciding (rank 0's, if they were deciding different steps).
        what: String,
        /// What each rank decided.
        decisions: String,
    },
    /// Ranks of a data-parallel group did not reach a step within the group's timeout; every
    /// rank that did gets this error instead of waiting forever.
    #[error(
        "data-parallel group: ranks {missing:?} did not reach `{what}` within {waited_ms} ms; \
         every rank stops here"
    )]
    RankTimeout {
        /// The step the waiting ranks had reached.
        what: String,
        /// The ranks that had not arrived.
        missing: Vec<usize>,
        /// How long the first rank to give up waited.
        waited_ms: u64,
    },
    /// The group's collective failed on this rank (NCCL refused to make the communicator or
    /// to enqueue the all-reduce, or could not be loaded); the message names the call.
    #[error("data-parallel collective: {reason}")]
    Collective {
        /// What NCCL or the engine reported.
        reason: String,
    },
    /// A process could not join its group of processes: rank 0 could not listen at the
    /// group's address, or another rank could not reach it there within the timeout, or was
    /// refused.
    #[error(
        "data-parallel group of processes: rank {rank} could not join at {address}: {reason} \
         (every rank needs the same WORLD_SIZE, MASTER_ADDR and MASTER_PORT, and rank 0's \
         port free)"
    )]
    Rendezvous {
        /// This process's rank.
        rank: usize,
        /// `MASTER_ADDR:MASTER_PORT`.
        address: String,
        /// What failed.
        reason: String,
    },
}

impl GraphedError {
    /// [`GraphedError::Internal`]: a build returned fewer graphs than the callables given it.
    pub(crate) const FEWER_GRAPHS: Self = Self::Internal {
        what: "the build returned fewer graphs than callables",
    };

    /// [`GraphedError::Internal`]: a call's inputs, flattened and counted against the sample's,
    /// did not rebuild into the input type.
    pub(crate) const INPUTS_MISFIT: Self = Self::Internal {
        what: "a call's flattened inputs do not fit the input type",
    };

    /// [`GraphedError::Mismatch`] for a call refused for `reason`: for a reason that names an
    /// input, the detail is that input as `given` and as `captured`; otherwise the call's
    /// input signature.
    pub(crate) fn mismatch(
        reason: EagerReason,
        given: &[FlatTensor],
        captured: &[TensorSpec],
    ) -> Self {
        use EagerReason::{DType, RequireGrad, Shape};
        let detail = match &reason {
            Shape { index } | DType { index } | RequireGrad { index }
                if given.get(*index).is_some() && captured.get(*index).is_some() =>
            {
                format!(
                    "input {index}: given {}, captured {}",
                    given[*index].spec().describe(),
                    captured[*index].describe()
                )
            }
            _ => {
                let inputs: Vec<String> = given
                    .iter()
                    .enumerate()
                    .map(|(index, t)| format!("input {index} {}", t.spec().describe()))
                    .collect();
                format!("given {}", inputs.join(", "))
            }
        };
        Self::Mismatch { reason, detail }
    }
}
