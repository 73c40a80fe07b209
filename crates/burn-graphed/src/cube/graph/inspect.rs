//! What each recording holds ([`GraphContents`]): its nodes by type and, on request, a
//! Graphviz DOT file, as the CUDA driver reports them from the graph's template.
//!
//! cubecl-cuda destroys the template right after instantiating it, so the workspace carries
//! a patched cubecl-cuda (`vendor/README.md`) that reads it first and keeps the result for the
//! process; [`super::lifecycle::Recording`] asks for it around every `graph_stop_capture`. The
//! request and the answer are process-wide, and CUDA devices record at once (thread-local
//! capture mode), so every stop runs with its request and answer under one lock
//! ([`stop_inspected`], [`stop_abandoned`]). Without CUDA (wgpu's software graphs) no graph says what it holds.

use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::CapturePhase;
use crate::stats::GraphContents;
use crate::sync::lock;

/// Where graphs are written as DOT, when on.
static DOT_DIR: Mutex<Option<PathBuf>> = Mutex::new(None);
/// Numbers the DOT files of this process in capture order.
static DOT_SEQUENCE: AtomicU64 = AtomicU64::new(0);

/// Writes every graph captured from now on as `dir/<process id>-NNNN-<phase>.dot` (`None`:
/// stops).
pub(crate) fn write_graphs_as_dot(dir: Option<PathBuf>) {
    *lock(&DOT_DIR) = dir;
}

/// Keeps each stop of a recording, its request and its answer apart from every other's.
static STOPS: Mutex<()> = Mutex::new(());

/// Runs `stop`, the `graph_stop_capture` of a recording of `phase`: with its DOT file asked
/// for when [`write_graphs_as_dot`] is on, and what its graph holds.
pub(in crate::cube) fn stop_inspected<T>(
    phase: CapturePhase,
    stop: impl FnOnce() -> T,
) -> (T, GraphContents) {
    let _one = lock(&STOPS);
    forget();
    before_stop(phase);
    let stopped = stop();
    (stopped, after_stop(phase))
}

/// Runs `stop`, which ends an abandoned recording, and drops what its graph held.
pub(in crate::cube) fn stop_abandoned(stop: impl FnOnce()) {
    let _one = lock(&STOPS);
    stop();
    forget();
}

/// Forgets what an earlier recording may have left.
fn forget() {
    #[cfg(feature = "cuda")]
    {
        cubecl_cuda::graph_inspect::take_last_captured_graph();
        cubecl_cuda::graph_inspect::request_graph_dot(None);
    }
}

/// Right before `graph_stop_capture` of a recording of `phase`: asks for its DOT file when
/// [`write_graphs_as_dot`] is on.
fn before_stop(phase: CapturePhase) {
    let Some(dir) = lock(&DOT_DIR).clone() else {
        return;
    };
    if let Err(error) = std::fs::create_dir_all(&dir) {
        log::warn!(
            target: "burn_graphed::capture",
            "cannot write the {phase}'s graph as DOT into {}: {error}",
            dir.display()
        );
        return;
    }
    let number = DOT_SEQUENCE.fetch_add(1, Ordering::Relaxed);
    let slug: String = phase
        .to_string()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let _path = dir.join(format!("{}-{number:04}-{slug}.dot", std::process::id()));
    #[cfg(feature = "cuda")]
    cubecl_cuda::graph_inspect::request_graph_dot(Some(_path));
}

/// Right after `graph_stop_capture` returned a graph of `phase`: what it holds.
fn after_stop(phase: CapturePhase) -> GraphContents {
    #[cfg(feature = "cuda")]
    {
        cubecl_cuda::graph_inspect::request_graph_dot(None);
        if let Some(info) = cubecl_cuda::graph_inspect::take_last_captured_graph() {
            let nodes = info
                .nodes
                .map_err(|reason| {
                    log::warn!(
                        target: "burn_graphed::capture",
                        "the {phase}'s graph nodes are unknown: {reason}"
                    )
                })
                .ok()
                .map(|n| crate::stats::GraphNodes {
                    kernels: n.kernels,
                    copies: n.copies,
                    sets: n.sets,
                    other: n.other,
                });
            let dot = info.dot.and_then(|written| {
                written
                    .map_err(|reason| {
                        log::warn!(
                            target: "burn_graphed::capture",
                            "the {phase}'s graph was not written as DOT: {reason}"
                        )
                    })
                    .ok()
            });
            return GraphContents { phase, nodes, dot };
        }
    }
    GraphContents {
        phase,
        nodes: None,
        dot: None,
    }
}
