mod fuser;
mod optimization;

pub(crate) mod launch;
pub(crate) mod tune;
pub(crate) mod unit;

pub use fuser::*;
pub use optimization::*;
