//! The CUDA profiler's range around the timed steps, so that `ncu` and `nsys` profile the
//! steady state of any model without counting launches to skip (`run.sh profile`).

/// `cuProfilerStart` on creation, `cuProfilerStop` on drop; nothing without a profiler
/// attached, and nothing at all off CUDA.
pub struct Range {
    #[cfg(feature = "cuda")]
    device: Option<cudarc::driver::sys::CUdevice>,
}

impl Range {
    /// Starts the range on CUDA device 0's primary context (the one cubecl uses). Failures
    /// (no driver, no device) are reported and leave the run unprofiled, not failed.
    #[cfg(feature = "cuda")]
    pub fn start() -> Self {
        use cudarc::driver::{result, sys};
        let device = (|| {
            let device = result::device::get(0)?;
            // SAFETY: `device` comes from `device::get`, as `retain` requires; the
            // reference it takes is released in `drop`.
            let context = unsafe { result::primary_ctx::retain(device) }?;
            // SAFETY: `context` is the device's primary context, initialized by the
            // `retain` above (and by cubecl before it) and alive until that `release`.
            unsafe { result::ctx::set_current(context) }?;
            // SAFETY: the calling thread has a current context (set above), the one
            // requirement of `cuProfilerStart`.
            unsafe { sys::cuProfilerStart() }.result()?;
            Ok::<_, result::DriverError>(device)
        })();
        match device {
            Ok(device) => Self {
                device: Some(device),
            },
            Err(error) => {
                eprintln!("# profiler range not started: {error:?}");
                Self { device: None }
            }
        }
    }

    #[cfg(not(feature = "cuda"))]
    pub fn start() -> Self {
        Self {}
    }
}

#[cfg(feature = "cuda")]
impl Drop for Range {
    fn drop(&mut self) {
        use cudarc::driver::{result, sys};
        if let Some(device) = self.device {
            // SAFETY: same thread and context as `start`, which set the context current
            // and started the range.
            let _ = unsafe { sys::cuProfilerStop() }.result();
            // SAFETY: releases the reference `start` retained on this `device`, which
            // came from `device::get`.
            let _ = unsafe { result::primary_ctx::release(device) };
        }
    }
}
