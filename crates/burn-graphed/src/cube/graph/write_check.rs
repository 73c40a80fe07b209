//! A replay that first asks cubecl whether the static buffers written outside the graphs since
//! the last replay (copies into them, fused optimizer updates of them) hold values, and replays
//! only when the session's record then says every buffer the graph reads does.
//!
//! cubecl skips a launch that reads memory an earlier failure left unwritten, and marks what it
//! would have written; its graph replay, though, does not look at what the graph reads
//! (UPSTREAM.md 2), so a replay over such a buffer would run on its stale values and mark its
//! outputs written: readable, and wrong.
//!
//! The copies into the static buffers, the question and the replay are one task on cubecl's
//! device thread (`ComputeClient::exclusive`; the nested launches, `check` and graph replay run
//! inline there, in that order), after fusion drained the caller's stream: the work asked about
//! is queued before the task, and the question costs no round trip of its own, since the
//! replay makes one anyway.
//!
//! Not after the replay: cubecl settles the graph's write set on replay, and counts a binding
//! without read/write attributes as written, so an input's mark could be cleared before it is
//! asked. The designs rejected for cost, with their measurements: docs/decisions.md.

use std::time::Instant;

use burn::backend::Backend;
use burn_cubecl::CubeBackend;

use super::super::buffers::{DirectCopy, StaticBuffer, note_checked};
use crate::error::GraphedError;
use crate::host_phases::{self, HostPhase};

/// The graph a session replays and the device it was captured on.
pub(crate) type CubeGraph = burn::backend::BackendGraph<CubeBackend>;
type CubeDevice = <CubeBackend as burn::backend::BackendTypes>::Device;

/// `graph` as captured on burn's cubecl backend.
///
/// # Errors
///
/// [`GraphedError::Replay`] naming `which` graph when it was captured on another backend.
pub(in crate::cube) fn cube_graph<'a>(
    graph: &'a burn::backend::DispatchGraph,
    which: &'static str,
) -> Result<&'a CubeGraph, GraphedError> {
    match graph {
        burn::backend::DispatchGraph::Cube(graph) => Ok(graph),
        #[allow(unreachable_patterns)]
        other => Err(GraphedError::Replay {
            which,
            reason: format!("graph {other:?} was not captured on burn's cubecl backend"),
        }),
    }
}

/// In one task on cubecl's device thread, after the work queued on the caller's fusion stream:
/// launches `copies`, asks about `asked` (unless empty) and records the answers, asks `refusal`
/// whether the call must be refused (it reads the record), and replays `graph` unless it must.
/// Resolving the copies' sources drained the caller's stream; without copies it is drained here.
///
/// # Errors
///
/// The refusal `refusal` returned (nothing replayed; the copies ran), or
/// [`GraphedError::Replay`] naming `which` graph when cubecl refused the replay or its device
/// thread could not run the task.
///
/// # Safety
///
/// As [`Backend::graph_replay`]: every buffer the recording touched is alive and not used
/// concurrently, and was refreshed on the capture stream (this thread's). With `copies`, nothing
/// was queued on this thread's fusion stream since their sources were resolved (which drained
/// it): the task does not drain it again.
pub(crate) unsafe fn replay_after_check(
    which: &'static str,
    graph: &CubeGraph,
    device: &CubeDevice,
    copies: &[DirectCopy<'_>],
    asked: &[&StaticBuffer],
    refusal: impl FnOnce() -> Option<GraphedError> + Send,
) -> Result<(), GraphedError> {
    let replay_error = |reason: String| GraphedError::Replay { which, reason };
    let client = match (copies.first(), asked.first()) {
        (Some(copy), _) => copy.client(),
        (None, Some(first)) => {
            // What updated the buffers asked about reaches the device thread's queue first.
            first.fused.client.sync(|| ());
            host_phases::lap(HostPhase::Drain);
            &first.cube.client
        }
        (None, None) => {
            if let Some(error) = refusal() {
                return Err(error);
            }
            // SAFETY: forwarded from this function's contract. Fusion's `graph_replay` drains
            // the caller's stream first.
            let replayed = unsafe { <burn::backend::Cube as Backend>::graph_replay(device, graph) }
                .map_err(|error| replay_error(error.to_string()));
            host_phases::lap(HostPhase::Replay);
            return replayed;
        }
    };
    let (replayed, task, driver_copies) = client
        .exclusive(|| {
            let began = Instant::now();
            let mut driver_copies = 0;
            let task = || {
                for copy in copies {
                    driver_copies += usize::from(copy.launch());
                }
                if !asked.is_empty() {
                    note_answers(asked);
                }
                if let Some(error) = refusal() {
                    return Err(error);
                }
                // SAFETY: forwarded from this function's contract; the caller's fusion stream
                // was drained and the copies launched above on its stream, ahead of the replay.
                unsafe { CubeBackend::graph_replay(device, graph) }
                    .map_err(|error| replay_error(error.to_string()))
            };
            let replayed = task();
            (replayed, began.elapsed(), driver_copies)
        })
        .map_err(|error| replay_error(error.to_string()))?;
    super::super::driver_copy::note(driver_copies);
    host_phases::lap_with_part(HostPhase::Replay, HostPhase::DeviceTask, task);
    replayed
}

/// Asks cubecl once for all of `asked` and, only when that answer is a failure, once per
/// buffer, to know which; records each buffer's answer. On the device thread, the questions
/// run inline.
fn note_answers(asked: &[&StaticBuffer]) {
    let client = &asked[0].cube.client;
    let all = client.check(asked.iter().map(|buffer| &buffer.cube.handle));
    for buffer in asked {
        let outcome = match &all {
            Ok(()) => Ok(()),
            Err(_) => client
                .check([&buffer.cube.handle])
                .map_err(|error| error.to_string()),
        };
        note_checked(buffer.key(), outcome);
    }
}
