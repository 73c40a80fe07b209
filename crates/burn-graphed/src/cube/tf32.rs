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

#[cfg(test)]
mod tests {
    use crate::error::GraphedError;

    /// Without the `cuda` feature no device rounds `f32` products to TF32, whatever is asked.
    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_cuda_nothing_rounds_to_tf32() {
        assert_eq!(super::set_allowed(true), Ok(()));
        assert!(!super::allowed());
        assert_eq!(super::set_allowed(false), Ok(()));
        assert!(!super::allowed());
    }

    /// The refusal names the argument, what was asked, what the devices hold and what to do.
    #[test]
    fn a_late_change_says_what_to_do() {
        let message = GraphedError::Tf32TooLate {
            requested: true,
            held: false,
        }
        .to_string();
        for part in [
            "argument `allowed`",
            "allow_tf32(true)",
            "with TF32 off",
            "first thing in main",
        ] {
            assert!(message.contains(part), "{part:?} not in {message:?}");
        }
    }
}
