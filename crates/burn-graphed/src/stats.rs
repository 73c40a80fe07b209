//! Counters of what graphed calls did, readable at any time, and what their captures hold.

use std::collections::BTreeMap;
use std::fmt;

/// Why a call ran eagerly instead of replaying the graphs.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EagerReason {
    /// The device's backend cannot capture graphs (e.g. Flex).
    Unsupported,
    /// The inputs are not on an autodiff device (inference, e.g. after `valid()`).
    NoAutodiff,
    /// The module's train/eval flags or the parameters' `require_grad` differ from capture.
    ModeChanged,
    /// Neither an input nor a parameter of the call requires grad: there is no backward to
    /// replay.
    NothingRequiresGrad,
    /// An input's shape differs from capture.
    Shape {
        /// Input position.
        index: usize,
    },
    /// An input's dtype differs from capture.
    DType {
        /// Input position.
        index: usize,
    },
    /// An input's `require_grad` differs from capture.
    RequireGrad {
        /// Input position.
        index: usize,
    },
    /// The previous graphed call's backward has not run yet: replaying now would overwrite the
    /// activations it needs.
    BackwardPending,
    /// A replay would overwrite a buffer shared with another callable of the group whose
    /// backward has not run yet (e.g. a chained callable given another tensor than the previous
    /// callable's output while that callable's backward is pending).
    SharedBufferBusy,
    /// Under [`OutputPolicy::Guarded`](crate::OutputPolicy::Guarded), an output or gradient
    /// that an earlier replay handed out as its static buffer is still held by user code: a
    /// replay would change its value.
    OutputStillHeld,
    /// A parameter changed since the last replay, and its static buffer may not take the new
    /// values: [`FusedAdam`](crate::FusedAdam) updated that buffer in place and handed it out as
    /// the parameter, and user code still holds that parameter tensor (typically a clone of the
    /// module kept as a snapshot, whose values must not change). Calls replay again once that
    /// clone is dropped.
    ParamBufferAliased,
    /// The call came from another thread than the capture (graphs replay on the capturing
    /// thread's stream only).
    OtherThread,
    /// The call's input signature has no graphs and the shape cache cannot take one more
    /// (see [`GraphedConfig::max_graphs`](crate::GraphedConfig::max_graphs) and
    /// [`GraphedConfig::max_graph_bytes`](crate::GraphedConfig::max_graph_bytes)).
    ShapeCacheFull,
    /// Capturing graphs for the call's input signature failed (once; the signature is not
    /// tried again). The error is in [`ShapeCacheStats::last_capture_error`](crate::ShapeCacheStats::last_capture_error).
    CaptureFailed,
    /// A data-parallel whole step met input shapes without graphs: it runs eagerly, and the
    /// group's ranks capture them after its update, in turn
    /// ([`GraphedStep::data_parallel`](crate::GraphedStep::data_parallel)).
    CaptureAfterStep,
}

/// What [`Graphed::prepare`](crate::Graphed::prepare) found or did for a signature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prepared {
    /// Graphs for the signature were captured now: calls like the sample replay them.
    Captured,
    /// Graphs for the signature were already there (the capture's own sample, or an earlier
    /// call or `prepare`).
    Cached,
    /// Calls like the sample will run eagerly, for this reason.
    Eager(EagerReason),
}

impl fmt::Display for EagerReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EagerReason::Unsupported => f.write_str("backend cannot capture graphs"),
            EagerReason::OutputStillHeld => {
                f.write_str("an output or gradient of an earlier replay is still held")
            }
            EagerReason::ParamBufferAliased => {
                f.write_str("a parameter buffer is still held by a clone of the module")
            }
            EagerReason::NoAutodiff => f.write_str("inputs not on an autodiff device"),
            EagerReason::ModeChanged => {
                f.write_str("train/eval mode or parameter require_grad differs from capture")
            }
            EagerReason::NothingRequiresGrad => {
                f.write_str("no input or parameter requires grad")
            }
            EagerReason::Shape { index } => write!(f, "input {index} shape differs"),
            EagerReason::DType { index } => write!(f, "input {index} dtype differs"),
            EagerReason::RequireGrad { index } => {
                write!(f, "input {index} require_grad differs")
            }
            EagerReason::BackwardPending => {
                f.write_str("previous call's backward still pending")
            }
            EagerReason::SharedBufferBusy => f.write_str(
                "a buffer shared with another callable of the group is still needed by its backward",
            ),
            EagerReason::OtherThread => {
                f.write_str("called from another thread than the capture")
            }
            EagerReason::ShapeCacheFull => {
                f.write_str("no graphs for these input shapes and the shape cache is full")
            }
            EagerReason::CaptureFailed => {
                f.write_str("capturing graphs for these input shapes failed")
            }
            EagerReason::CaptureAfterStep => f.write_str(
                "no graphs for these input shapes yet: the ranks capture them after this step",
            ),
        }
    }
}

/// What a graphed callable has done so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Calls that replayed the forward graph.
    pub forward_replays: u64,
    /// Backward passes that replayed the backward graph.
    pub backward_replays: u64,
    /// Input tensors copied into static buffers (an input already in its static buffer is not).
    pub input_copies: u64,
    /// Parameter tensors copied into static buffers (after optimizer steps).
    pub param_copies: u64,
    /// Output gradients copied into the static gradient buffers. A gradient that a chained
    /// callable's backward graph wrote there itself is not copied.
    pub grad_copies: u64,
    /// Calls that ran eagerly, by reason.
    pub eager: BTreeMap<EagerReason, u64>,
    /// The shape cache: graphs held per input signature, hits, captures of new signatures,
    /// evictions (see [`GraphedConfig::max_graphs`](crate::GraphedConfig::max_graphs)). Zero
    /// counters without graphs.
    pub shape_cache: crate::shape_cache::ShapeCacheStats,
    /// The graphs held now: per input signature in the shape cache, the forward graph and (for
    /// training calls) the backward graph.
    pub graphs: Vec<GraphContents>,
}

impl GraphStats {
    /// Adds the replay and copy counters of `other` (another graph of the same callable).
    pub(crate) fn add_replays(&mut self, other: &GraphStats) {
        self.forward_replays += other.forward_replays;
        self.backward_replays += other.backward_replays;
        self.input_copies += other.input_copies;
        self.param_copies += other.param_copies;
        self.grad_copies += other.grad_copies;
    }

    /// Total eager calls.
    pub fn total_eager(&self) -> u64 {
        self.eager.values().sum()
    }
}

/// Shape of what was captured: counts and bytes, stable across runs (snapshot material).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaptureSummary {
    /// Whether hardware graphs were captured (false: every call runs eagerly).
    pub graphed: bool,
    /// Why there are no graphs, when there are none.
    pub eager_reason: Option<String>,
    /// Flattened input tensors.
    pub inputs: usize,
    /// Inputs that require grad at capture.
    pub inputs_requiring_grad: usize,
    /// Output tensors.
    pub outputs: usize,
    /// Float parameters of the module.
    pub params: usize,
    /// Parameters that receive gradients.
    pub trainable_params: usize,
    /// Bytes of the static buffers this callable owns: inputs, parameter copies, outputs,
    /// incoming and outgoing gradients. The graphs' internal activations are not included.
    pub static_bytes: u64,
}

/// Device memory that a graphed callable's capture holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GraphMemory {
    /// Bytes of the static buffers this callable owns (as in [`CaptureSummary::static_bytes`]).
    pub static_bytes: u64,
    /// Bytes of the static buffers of every callable captured with it (a shared buffer once).
    pub group_static_bytes: u64,
    /// Growth of the device's reserved pool bytes over the whole group's capture, warm-ups
    /// included, measured after the capture's memory cleanup
    /// ([`GraphedConfig::release_capture_memory`](crate::GraphedConfig::release_capture_memory)):
    /// the memory the capture added to the pools, which the graphs may pin (cubecl guards every
    /// page a recording touched until the graph is dropped). 0 without graphs, and 0 where the
    /// cleanup returned more of the pools' earlier free pages than the capture added.
    pub capture_pool_growth_bytes: u64,
    /// Reserved bytes that the capture's memory cleanup returned to the device (pages only the
    /// warm-ups used, and other empty pages of the pools); 0 with
    /// [`GraphedConfig::release_capture_memory`](crate::GraphedConfig::release_capture_memory)
    /// off and without graphs.
    pub capture_released_bytes: u64,
}

impl GraphMemory {
    /// The device bytes attributed to these graphs in the shape cache's byte limit: the larger
    /// of the static buffers and the pool growth of the capture (an estimate: the pages a
    /// recording pins can also lie in memory the pools had before).
    pub fn held_bytes(&self) -> u64 {
        self.static_bytes.max(self.capture_pool_growth_bytes)
    }
}

/// A step of a capture: where one failed ([`GraphedError::Capture`](crate::GraphedError::Capture)),
/// which recording made a graph ([`GraphContents::phase`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CapturePhase {
    /// Copying sample inputs and parameters into static buffers.
    StaticBuffers,
    /// Eager warm-up runs before the forward capture.
    ForwardWarmup,
    /// Recording the forward graph.
    Forward,
    /// Eager warm-up runs before the backward capture.
    BackwardWarmup,
    /// Recording the backward graph.
    Backward,
    /// Checking the forward graph against eager execution on new input values.
    Validation,
    /// Eager runs of a whole training step before its capture.
    StepWarmup,
    /// Recording a whole training step (forward, loss, backward, optimizer update).
    Step,
}

impl fmt::Display for CapturePhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CapturePhase::StaticBuffers => "static-buffer setup",
            CapturePhase::ForwardWarmup => "forward warm-up",
            CapturePhase::Forward => "forward capture",
            CapturePhase::BackwardWarmup => "backward warm-up",
            CapturePhase::Backward => "backward capture",
            CapturePhase::Validation => "replay validation",
            CapturePhase::StepWarmup => "whole-step warm-up",
            CapturePhase::Step => "whole-step capture",
        })
    }
}

/// The nodes of one captured graph, by type, as the CUDA driver reports them.
///
/// A graph replays its nodes in dependency order; burn-graphed records on one stream, so each
/// node waits for the one before it, and on the GPU each dependent kernel node costs about a
/// microsecond of its own: `kernels` is the count that bounds a small model's replay from
/// below.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphNodes {
    /// Kernel launches.
    pub kernels: usize,
    /// Memory copies.
    pub copies: usize,
    /// Memory sets.
    pub sets: usize,
    /// Every other node (events, host calls, empty nodes, child graphs).
    pub other: usize,
}

impl GraphNodes {
    /// All nodes.
    pub fn total(&self) -> usize {
        self.kernels + self.copies + self.sets + self.other
    }
}

/// One captured graph: which recording made it, what it holds, and where its Graphviz dump
/// went ([`write_graphs_as_dot`](crate::write_graphs_as_dot)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphContents {
    /// The recording: [`CapturePhase::Forward`](CapturePhase::Forward),
    /// [`Backward`](CapturePhase::Backward) or [`Step`](CapturePhase::Step).
    pub phase: CapturePhase,
    /// Its nodes; `None` where the backend does not say (wgpu's software graphs) or the driver
    /// refused to (a warning of log target `burn_graphed::capture` says why).
    pub nodes: Option<GraphNodes>,
    /// The DOT file written for it, when [`write_graphs_as_dot`](crate::write_graphs_as_dot)
    /// was on at its capture and the driver wrote it.
    pub dot: Option<std::path::PathBuf>,
}

/// What a [`GraphedStep`](crate::GraphedStep) has done so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepStats {
    /// Steps that replayed a whole-step graph.
    pub replays: u64,
    /// Steps that ran eagerly, by reason.
    pub eager: BTreeMap<EagerReason, u64>,
    /// Input tensors copied into static buffers (an input already there is not).
    pub input_copies: u64,
    /// The shape cache of the step's graphs.
    pub shape_cache: crate::shape_cache::ShapeCacheStats,
    /// The graphs held now: per input signature in the shape cache, the whole step's graph (or,
    /// for a data-parallel step, its gradient half and its update half).
    pub graphs: Vec<GraphContents>,
}

impl StepStats {
    /// Total eager steps.
    pub fn total_eager(&self) -> u64 {
        self.eager.values().sum()
    }
}

/// What [`export_tuned`](crate::export_tuned) wrote, or what [`import_tuned`](crate::import_tuned)
/// read and copied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TunedBundle {
    /// The bundle's cache namespaces (one per autotuned operation, and the compiled kernels
    /// where the backend keeps them), each named with the cubecl version and the device.
    pub namespaces: Vec<String>,
    /// Entries in the bundle.
    pub entries: usize,
    /// Entries copied into this machine's cache (import).
    pub imported: usize,
    /// Entries this machine's cache had already: its own value is kept (import).
    pub skipped: usize,
    /// Entries the cache could not write (a full disk, a read-only directory): recomputed
    /// when needed, as without the bundle (import).
    pub failed: usize,
}
