//! What a captured graph holds, read from its template before it is instantiated and
//! destroyed: its nodes by type and, on request, a Graphviz DOT dump
//! (`cuGraphDebugDotPrint`, what PyTorch's `CUDAGraph.debug_dump` writes).
//!
//! Added by burn-graphed's carried patch (see the workspace's UPSTREAM.md): the template is
//! destroyed inside [`instantiate_recording`](super::capture), so nothing outside this crate
//! can read it afterwards. The request and the result are process-wide: set the request before
//! `stop_capture`, take the result after it, one recording at a time (in
//! [`ThreadLocal`](crate::capture_mode::CaptureMode) mode devices record at once: the caller
//! keeps their stops apart).

use cudarc::driver::sys::{CUgraph, CUgraphNode, CUgraphNodeType};
use std::path::PathBuf;
use std::sync::Mutex;

/// The nodes of one captured graph, by type.
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

/// What the last graph instantiated in this process held.
#[derive(Debug, Clone)]
pub struct CapturedGraphInfo {
    /// Its nodes, or why they could not be read.
    pub nodes: Result<GraphNodes, String>,
    /// The DOT file written for it when one was requested: its path, or why it failed.
    pub dot: Option<Result<PathBuf, String>>,
}

static DOT_REQUEST: Mutex<Option<PathBuf>> = Mutex::new(None);
static LAST: Mutex<Option<CapturedGraphInfo>> = Mutex::new(None);

/// Asks that the next graph instantiated in this process be written as Graphviz DOT to
/// `path` (verbose: kernel names and launch parameters); `None` withdraws the request.
pub fn request_graph_dot(path: Option<PathBuf>) {
    *DOT_REQUEST.lock().unwrap_or_else(|e| e.into_inner()) = path;
}

/// The last graph instantiated in this process, taken (a second call returns `None` until
/// another graph is instantiated).
pub fn take_last_captured_graph() -> Option<CapturedGraphInfo> {
    LAST.lock().unwrap_or_else(|e| e.into_inner()).take()
}

/// Reads `graph`'s nodes and writes the requested DOT file, for
/// [`take_last_captured_graph`].
///
/// # Safety
///
/// `graph` must be a valid, not-yet-destroyed `CUgraph`.
pub(crate) unsafe fn record(graph: CUgraph) {
    // SAFETY: `graph` is valid per this function's contract.
    let nodes = unsafe { count_nodes(graph) };
    let request = DOT_REQUEST
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    // SAFETY: as above.
    let dot = request.map(|path| unsafe { write_dot(graph, path) });
    *LAST.lock().unwrap_or_else(|e| e.into_inner()) = Some(CapturedGraphInfo { nodes, dot });
}

/// # Safety
///
/// `graph` must be a valid, not-yet-destroyed `CUgraph`.
unsafe fn count_nodes(graph: CUgraph) -> Result<GraphNodes, String> {
    let mut count: usize = 0;
    // SAFETY: `graph` is valid per this function's contract; a null node array asks only for
    // the count.
    unsafe { cudarc::driver::sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count) }
        .result()
        .map_err(|err| format!("cuGraphGetNodes failed: {err}"))?;
    if count == 0 {
        // The driver refuses a node array for an empty graph.
        return Ok(GraphNodes::default());
    }
    let mut handles: Vec<CUgraphNode> = vec![std::ptr::null_mut(); count];
    let mut read = count;
    // SAFETY: `handles` has room for `read` entries, the count reported above.
    unsafe { cudarc::driver::sys::cuGraphGetNodes(graph, handles.as_mut_ptr(), &mut read) }
        .result()
        .map_err(|err| format!("cuGraphGetNodes failed: {err}"))?;
    let mut nodes = GraphNodes::default();
    for node in handles.iter().take(read) {
        let mut ty = CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` is a handle the driver just wrote, of the still-live `graph`.
        unsafe { cudarc::driver::sys::cuGraphNodeGetType(*node, &mut ty) }
            .result()
            .map_err(|err| format!("cuGraphNodeGetType failed: {err}"))?;
        match ty {
            CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL => nodes.kernels += 1,
            CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY => nodes.copies += 1,
            CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET => nodes.sets += 1,
            _ => nodes.other += 1,
        }
    }
    Ok(nodes)
}

/// # Safety
///
/// `graph` must be a valid, not-yet-destroyed `CUgraph`.
unsafe fn write_dot(graph: CUgraph, path: PathBuf) -> Result<PathBuf, String> {
    let c_path = path
        .to_str()
        .and_then(|text| std::ffi::CString::new(text).ok())
        .ok_or_else(|| format!("{} is not UTF-8 without NUL bytes", path.display()))?;
    let verbose = cudarc::driver::sys::CUgraphDebugDot_flags::CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE;
    // SAFETY: `graph` is valid per this function's contract and `c_path` is a NUL-terminated
    // string that outlives the call.
    unsafe { cudarc::driver::sys::cuGraphDebugDotPrint(graph, c_path.as_ptr(), verbose as u32) }
        .result()
        .map_err(|err| format!("cuGraphDebugDotPrint({}) failed: {err}", path.display()))?;
    Ok(path)
}
