//! The optimizer update: one kernel (`update_kernel`: burn's Adam, AdamW and SGD with momentum,
//! operation for operation in the parameter's dtype, its clock from the host or from a device
//! buffer), one fusion operation that launches it over many parameters (`update_op`), and the
//! eager Adam steps of the public optimizers (`adam_step`). The whole step records the same
//! operation with its clock on the device.

pub(super) mod adam_step;
pub(super) mod update_kernel;
pub(super) mod update_op;
