pub mod elemwise;
pub mod matmul;
pub mod nhwc_relayout;
pub mod reduce;
pub mod reduce_broadcasted;

mod base;

pub use base::*;
