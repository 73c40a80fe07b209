mod base;

pub use base::*;

pub(crate) mod handle;
