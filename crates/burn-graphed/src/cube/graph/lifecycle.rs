//! The capture lifecycle of cubecl 0.11 (prepare, record, stop) as guards that always leave
//! the stream out of capture mode, and the steps around a recording: announcing the phase,
//! running a fresh graph once, forgetting what a failed recording left behind.

use burn::backend::{Backend, Dispatch, DispatchDevice};
use burn::tensor::Device;

use crate::error::{CapturePhase, GraphedError};
use crate::stats::GraphContents;

/// Whether graphs can be captured on `device` (burn's cubecl backend).
pub(crate) fn supports_graphs(device: &Device) -> bool {
    matches!(
        device.clone().inner().as_dispatch(),
        DispatchDevice::Cube(_)
    )
}

/// Whether cubecl launches kernels in a way a graph can record. Its profiling log at level
/// `basic` or above (`CUBECL_DEBUG_LOG`, or `[profiling.logger]` in a cubecl.toml) times every
/// launch with device timestamps, which no graph records: on wgpu the first launch inside the
/// window fails on the device thread (a panic, not an error). The reason, with what to change,
/// where it cannot.
pub(in crate::cube) fn launches_can_be_recorded() -> Result<(), String> {
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig, profiling::ProfilingLogLevel};
    match CubeClRuntimeConfig::get().profiling.logger.level {
        ProfilingLogLevel::Disabled | ProfilingLogLevel::Minimal => Ok(()),
        level => Err(format!(
            "cubecl's profiling log (level {level:?}) times every kernel launch, which a graph \
             cannot record: unset CUBECL_DEBUG_LOG, or set [profiling.logger] level to \
             \"minimal\" or \"disabled\" in the cubecl.toml, to capture"
        )),
    }
}

/// The most shared memory (bytes) a cube may use on `device`, or `None` off cubecl.
pub(in crate::cube) fn max_shared_memory(device: &Device) -> Option<usize> {
    match device.clone().inner().as_dispatch() {
        DispatchDevice::Cube(cube) => {
            Some(cube.client().properties().hardware.max_shared_memory_size)
        }
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

/// Leaves the prepared state on drop unless a recording started: an error between
/// `graph_prepare` and `graph_start_capture` (a failed warm-up) would otherwise leave the stream
/// prepared, and every later capture on it would fail with "already prepared".
pub(in crate::cube) struct Preparation<'a> {
    device: &'a DispatchDevice,
    armed: bool,
}

impl<'a> Preparation<'a> {
    pub(in crate::cube) fn new(
        device: &'a DispatchDevice,
        phase: CapturePhase,
    ) -> Result<Self, GraphedError> {
        Dispatch::graph_prepare(device).map_err(capture_error(phase))?;
        announce(phase);
        Ok(Self {
            device,
            armed: true,
        })
    }

    /// Starts the recording that consumes the prepared state.
    pub(in crate::cube) fn record(
        mut self,
        phase: CapturePhase,
    ) -> Result<Recording<'a>, GraphedError> {
        let recording = Recording::start(self.device, phase)?;
        self.armed = false;
        Ok(recording)
    }
}

impl Drop for Preparation<'_> {
    fn drop(&mut self) {
        if self.armed {
            // The lifecycle has no "cancel": an empty recording returns the stream to its
            // normal state, and the empty graph is dropped at once.
            super::inspect::stop_abandoned(|| {
                if Dispatch::graph_start_capture(self.device).is_ok() {
                    let _ = Dispatch::graph_stop_capture(self.device);
                }
            });
        }
    }
}

/// A recording's graph and what it holds.
pub(in crate::cube) type RecordedGraph = (burn::backend::DispatchGraph, GraphContents);

/// Ends the capture on drop unless stopped: whatever happens inside the window (an error, a
/// panic in user code), the stream leaves capture mode.
pub(in crate::cube) struct Recording<'a> {
    device: &'a DispatchDevice,
    open: bool,
}

impl<'a> Recording<'a> {
    fn start(device: &'a DispatchDevice, phase: CapturePhase) -> Result<Self, GraphedError> {
        Dispatch::graph_start_capture(device).map_err(|error| GraphedError::Capture {
            phase,
            reason: error.to_string(),
        })?;
        announce(phase);
        Ok(Self { device, open: true })
    }

    /// Ends the recording: its graph, and what the graph holds.
    pub(in crate::cube) fn stop(
        mut self,
        phase: CapturePhase,
    ) -> Result<RecordedGraph, GraphedError> {
        self.open = false;
        let (stopped, contents) =
            super::inspect::stop_inspected(phase, || Dispatch::graph_stop_capture(self.device));
        announce(format_args!("{phase} closed"));
        let graph = stopped.map_err(|error| {
            let mut reason = error.to_string();
            if reason.contains("CAPTURE_INVALIDATED") {
                reason.push_str(INVALIDATED_HINT);
            }
            GraphedError::Capture { phase, reason }
        })?;
        Ok((graph, contents))
    }
}

/// Appended to a recording that the driver invalidated.
///
/// cubecl's device thread issues a CUDA device's launches, copies and allocations, and records
/// in thread-local capture mode ([`super::driver`]): a call CUDA forbids during a recording (an
/// allocation or a free, a synchronization) that this thread makes while the recording is open
/// fails (status 900) and invalidates it: memory the recorded work grows into, or the new
/// memory of another thread's work on the same device (the GPU tests
/// `capture_failures_are_recovered`, `other_threads_keep_their_draws`). Other threads' reads,
/// and their work that needs no new memory, go on.
const INVALIDATED_HINT: &str = " (an allocation, free or synchronization made on the device while it recorded invalidates the recording: memory the recorded work or another thread's work on the same device grew into; run a step eagerly first or keep other threads off the device while capturing, then retry)";

impl Drop for Recording<'_> {
    fn drop(&mut self) {
        if self.open {
            // The recording is abandoned; its error says only that, so it is not reported.
            super::inspect::stop_abandoned(|| {
                let _ = Dispatch::graph_stop_capture(self.device);
            });
        }
    }
}

/// Announces the capture phase that starts from here (a `log` debug event of target
/// `burn_graphed::capture` whose message is the phase), so that a listener can tell which phase
/// the next kernel launches and warnings belong to: cubecl's autotuner, for one, reports only as
/// a `log` warning a key it had to decide unmeasured because profiling is refused while a
/// graph records (the bench's `warn_log`).
/// The capture's progress reports name it too ([`super::progress`]).
pub(in crate::cube) fn announce(phase: impl std::fmt::Display) {
    log::debug!(target: "burn_graphed::capture", "{phase}");
    super::progress::phase(phase);
}

pub(in crate::cube) fn capture_error(
    phase: CapturePhase,
) -> impl Fn(burn::backend::ExecutionError) -> GraphedError {
    move |error| GraphedError::Capture {
        phase,
        reason: error.to_string(),
    }
}

/// Replays a graph right after its recording, and waits for it.
///
/// Why: a kernel launch reads its shapes and strides from a device buffer that cubecl caches
/// by content. A launch whose metadata is first seen inside a recording builds that buffer
/// there, and the upload into it is recorded, not executed: until the graph first runs, the
/// cached buffer holds whatever the memory held before, and every eager launch with the same
/// metadata reads it: out-of-bounds reads by eager kernels and wrong replayed outputs
/// (docs/decisions.md). Running the graph once initializes every such buffer (the graph keeps
/// the host bytes it uploads from) before anything else launches.
///
/// # Errors
///
/// [`GraphedError::Capture`] of `phase` when the replay or the wait fails.
pub(in crate::cube) fn materialize(
    dispatch: &DispatchDevice,
    graph: &burn::backend::DispatchGraph,
    phase: CapturePhase,
) -> Result<(), GraphedError> {
    // SAFETY: `graph_replay` needs every buffer the recording touched alive, unused by other
    // streams, and refreshed on the capture stream. The caller still holds every tensor the
    // recording read or wrote (static inputs, parameters, outputs, gradients), the freed
    // activations lie in pages guarded for the graph's life, and this thread holds the
    // device's capture lock and issued the recording on this stream.
    unsafe { Dispatch::graph_replay(dispatch, graph) }.map_err(capture_error(phase))?;
    Dispatch::sync(dispatch).map_err(capture_error(phase))
}

/// Drops the metadata buffers that a failed recording left in cubecl's cache.
///
/// An abandoned recording leaves the entries it created in the cache, unpinned, with the
/// recorded (never executed) uploads: eager launches with that metadata would read
/// uninitialized memory (see [`materialize`]). A memory cleanup evicts every entry no live
/// graph pins; entries of live graphs were initialized by [`materialize`].
pub(in crate::cube) fn forget_unrun_metadata(dispatch: &DispatchDevice) {
    Dispatch::memory_cleanup(dispatch);
}
