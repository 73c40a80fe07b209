//! The fused Adam updates outside a whole step: one parameter at a time (`FusedAdam`) and many in
//! one launch (`MultiTensorAdam`).

pub(super) mod adam_multi_op;
pub(super) mod adam_op;
