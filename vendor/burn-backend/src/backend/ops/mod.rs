mod activation;
mod bool_tensor;
mod int_tensor;
mod modules;
mod pad;
mod qtensor;
mod tensor;
mod transaction;

pub(crate) mod argwhere;
pub(crate) mod cat;
pub(crate) mod repeat_dim;
pub(crate) mod sort;

pub use activation::*;
pub use bool_tensor::*;
pub use int_tensor::*;
pub use modules::*;
#[doc(hidden)]
pub use pad::validate_padding;
pub use qtensor::*;
pub use tensor::*;
pub use transaction::*;
