//! The kernels the operations launch (`#[cube]` functions), with their work splits.

pub(super) mod attention_kernels;
pub(super) mod attention_tc_kernels;
pub(super) mod conv_kernels;
pub(super) mod norm_plane_kernel;
pub(super) mod random_op;
pub(super) mod row_kernels;
