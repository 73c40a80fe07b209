mod parameters;
mod scheme;

pub use parameters::*;
pub use scheme::*;

pub use burn_std::quantization::{
    BlockScale, BlockSize, Calibration, QuantMode, QuantPropagation, QuantScheme, QuantStore,
    QuantValue, QuantizedBytes, ScaleDtype, global_scale_dtype, quantizable, scale_to_dtype,
};
