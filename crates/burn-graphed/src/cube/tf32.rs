//! Whether `f32` matrix products on CUDA devices may round their operands to TF32 on tensor
//! cores (cubecl's matmuls and convolutions; burn-graphed's own cuBLASLt products never do).
//! The choice lives in the carried cubecl-cuda (`cubecl_cuda::tf32`, vendor/README.md), which
//! reads it when a device is created; without the `cuda` feature no device rounds to TF32.

/// Sets the choice for devices created from now on; `Err(held)` when a device was already
/// created holding the other one.
pub(crate) fn set_allowed(allowed: bool) -> Result<(), bool> {
    #[cfg(feature = "cuda")]
    {
        cubecl_cuda::tf32::set_allowed(allowed)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = allowed;
        Ok(())
    }
}

/// Whether CUDA devices created from now on may run `f32` products on TF32 tensor cores.
pub(crate) fn allowed() -> bool {
    #[cfg(feature = "cuda")]
    {
        cubecl_cuda::tf32::allowed()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}
