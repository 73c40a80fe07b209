mod base;
mod device;
mod memory_pools;
mod primitive;
mod profile;
mod router_device_type;

pub use base::*;
pub use device::*;
pub use memory_pools::*;
pub use primitive::*;
pub use profile::*;
pub use router_device_type::*;

/// Backend operations on tensors.
pub mod ops;

/// Distributed backend extension.
pub mod distributed;
