mod activation;
mod bool_tensor;
mod int_tensor;
mod module;
mod qtensor;
mod tensor;
mod transaction;

pub(crate) mod distributed;

pub(crate) mod base;
pub use base::*;
pub use qtensor::*;

/// Numeric utility functions for jit backends
pub mod numeric;
