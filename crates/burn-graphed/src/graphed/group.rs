//! Several callables captured together, as PyTorch's `make_graphed_callables` does with a
//! tuple: forward graphs in execution order, backward graphs in reverse, and no copy where one
//! callable's outputs are the next one's inputs.

use burn::module::Module;

use crate::callable::Callable;
use crate::config::GraphedConfig;
use crate::error::GraphedError;
use crate::graphed::Graphed;
use crate::graphed::build::build;
use crate::tensors::TensorGroup;

mod sealed {
    pub trait Sealed {}
}

/// A tuple of [`Callable`]s that [`make_graphed_callables`] captures together (one to four).
pub trait CallableGroup: sealed::Sealed + Sized {
    /// The graphed callables, one [`Graphed`] per [`Callable`], in the same order.
    type Graphed;

    /// Captures the group; see [`make_graphed_callables`].
    ///
    /// # Errors
    ///
    /// As [`make_graphed_callables`].
    fn capture(self, config: &GraphedConfig) -> Result<Self::Graphed, GraphedError>;
}

/// Captures several callables together, in execution order: the forward graphs in order, then
/// the backward graphs in reverse (as PyTorch's `make_graphed_callables` does with a tuple).
///
/// A callable made with [`Callable::chained`] takes the previous callable's outputs as its
/// inputs: its graphs read and write the previous graphs' buffers directly, so a training step
/// that feeds one callable's outputs straight into the next copies nothing between them, in
/// either direction. Each result is an ordinary [`Graphed`] module (train it, `valid()` it, save
/// it as usual); [`Graphed::memory`] reports the memory the group holds.
///
/// ```no_run
/// use burn::nn::{Linear, LinearConfig};
/// use burn::prelude::*;
/// use burn_graphed::{Callable, GraphedConfig, make_graphed_callables};
///
/// # fn main() -> Result<(), burn_graphed::GraphedError> {
/// let device = Device::default().autodiff();
/// let encoder = LinearConfig::new(64, 32).init(&device);
/// let decoder = LinearConfig::new(32, 64).init(&device);
/// let sample = Tensor::<2>::zeros([16, 64], &device);
/// let (encoder, decoder) = make_graphed_callables(
///     (
///         Callable::new(encoder, Linear::forward::<2>, sample),
///         Callable::chained(decoder, Linear::forward::<2>),
///     ),
///     &GraphedConfig::new(),
/// )?;
/// let x = Tensor::<2>::ones([16, 64], &device);
/// let y = decoder.forward(encoder.forward(x.clone())?)?; // no copy between the two graphs
/// let grads = (y - x).powi_scalar(2).mean().backward(); // both backward graphs
/// # let _ = grads;
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`GraphedError::Chain`] when the first callable is chained or a chained callable's input
/// type does not fit the previous outputs, and every error of [`Graphed::new`]. A failure
/// leaves every module untouched and drops every graph captured so far.
pub fn make_graphed_callables<G: CallableGroup>(
    callables: G,
    config: &GraphedConfig,
) -> Result<G::Graphed, GraphedError> {
    callables.capture(config)
}

macro_rules! callable_group {
    ($($idx:tt: $M:ident $I:ident $O:ident),+) => {
        impl<$($M: Module, $I: TensorGroup, $O: TensorGroup),+> sealed::Sealed
            for ($(Callable<$M, $I, $O>,)+)
        {
        }

        impl<$($M: Module, $I: TensorGroup, $O: TensorGroup),+> CallableGroup
            for ($(Callable<$M, $I, $O>,)+)
        {
            type Graphed = ($(Graphed<$M, $I, $O>,)+);

            fn capture(mut self, config: &GraphedConfig) -> Result<Self::Graphed, GraphedError> {
                let built = build(vec![$(self.$idx.member()),+], config)?;
                let mut built = built.into_iter();
                Ok(($(
                    Graphed::from_built(
                        self.$idx.module,
                        self.$idx.call,
                        built.next().ok_or(GraphedError::FEWER_GRAPHS)?,
                        config,
                    ),
                )+))
            }
        }
    };
}

callable_group!(0: M0 I0 O0);
callable_group!(0: M0 I0 O0, 1: M1 I1 O1);
callable_group!(0: M0 I0 O0, 1: M1 I1 O1, 2: M2 I2 O2);
callable_group!(0: M0 I0 O0, 1: M1 I1 O1, 2: M2 I2 O2, 3: M3 I3 O3);
