//! cubecl's CUDA server as the driver sees it, for the work this crate enqueues on cubecl's own
//! streams without cubecl (cuBLASLt products, driver copies): the server type whose buffers
//! `Client::get_resource` hands out, and the current context of a stream's thread.

use cudarc::driver::DriverError;
use cudarc::driver::sys::CUstream;

/// cubecl-cuda's server: the type `Client::get_resource` is asked for.
pub(super) type CudaServer = <cubecl_cuda::CudaRuntime as cubecl_runtime::runtime::Runtime>::Server;

/// Makes the context `stream` belongs to current on this thread, so that driver and library
/// calls on `stream` run in it. The error names the driver call that failed.
///
/// # Safety
///
/// `stream` is a live stream of cubecl's server (its pool holds a buffer the caller holds).
pub(super) unsafe fn make_current(stream: CUstream) -> Result<(), (&'static str, DriverError)> {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: `stream` is live (this function's contract); `cuStreamGetCtx` writes its
    // context into `ctx`, which then names a live context.
    unsafe { cudarc::driver::sys::cuStreamGetCtx(stream, &mut ctx) }
        .result()
        .map_err(|e| ("cuStreamGetCtx", e))?;
    // SAFETY: `ctx` is the live context `cuStreamGetCtx` just wrote.
    unsafe { cudarc::driver::result::ctx::set_current(ctx) }.map_err(|e| ("cuCtxSetCurrent", e))
}
