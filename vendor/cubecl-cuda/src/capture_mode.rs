//! The CUDA capture mode a recording begins in: what CUDA forbids other threads while it
//! records.
//!
//! Added by burn-graphed's carried patch (see the workspace's UPSTREAM.md). In the release every
//! recording begins in `CU_STREAM_CAPTURE_MODE_GLOBAL`: while any thread of the process records,
//! a potentially unsafe CUDA call (an allocation, a synchronization) of any other thread fails
//! and invalidates the recording. So the devices of one process cannot record at the same time,
//! nor can one record while another runs eagerly; ranks of a data-parallel group that are
//! threads of one process cannot warm up a step holding a collective together and record it.
//! In `ThreadLocal` mode such a call is forbidden only on the thread that began the recording
//! (cubecl's device thread, which issues the device's launches and allocations). The mode is
//! process-wide, read when a recording begins. Default: `Global`, as in the release.

use core::sync::atomic::{AtomicBool, Ordering};
use cudarc::driver::sys::CUstreamCaptureMode;

/// What CUDA forbids other threads while a recording is open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureMode {
    /// Every thread of the process: CUDA's `CU_STREAM_CAPTURE_MODE_GLOBAL`.
    Global,
    /// Only the thread that began the recording: `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`.
    ThreadLocal,
}

static THREAD_LOCAL: AtomicBool = AtomicBool::new(false);

/// The mode recordings begin in from now on; returns the mode before.
pub fn set(mode: CaptureMode) -> CaptureMode {
    let before = THREAD_LOCAL.swap(mode == CaptureMode::ThreadLocal, Ordering::SeqCst);
    if before {
        CaptureMode::ThreadLocal
    } else {
        CaptureMode::Global
    }
}

/// The mode recordings begin in.
pub fn get() -> CaptureMode {
    if THREAD_LOCAL.load(Ordering::SeqCst) {
        CaptureMode::ThreadLocal
    } else {
        CaptureMode::Global
    }
}

/// CUDA's value for [`get`].
pub(crate) fn sys() -> CUstreamCaptureMode {
    match get() {
        CaptureMode::Global => CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        CaptureMode::ThreadLocal => CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
    }
}
