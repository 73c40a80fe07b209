//! The capture and replay machinery on burn's cubecl backend (CUDA graphs, or wgpu's software
//! graphs). Everything that touches device buffers or graphs is in here.

pub(crate) mod adam_multi_op;
pub(crate) mod adam_op;
pub(crate) mod buffers;
pub(crate) mod capture;
pub(crate) mod copy_op;
pub(crate) mod dense;
pub(crate) mod node;
pub(crate) mod random_op;
pub(crate) mod session;
pub(crate) mod write_check;
