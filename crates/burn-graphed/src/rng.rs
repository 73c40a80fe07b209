//! Graph-safe randomness: [`DeviceRng`], a counter-based generator whose state lives in device
//! memory and is advanced by the device, and [`GraphDropout`], a dropout layer drawing from it.
//!
//! burn's random ops take their seeds from a host generator as kernel scalars, so a captured
//! graph replays one dropout mask (or one `Tensor::random` tensor) forever, and replay
//! validation refuses them (see
//! [`GraphedConfig::validate_replay`](crate::GraphedConfig::validate_replay)). A draw from a
//! `DeviceRng` is two kernels: one reads the state (seed, call counter) from the device buffer
//! and hashes (seed, counter, element index) into the values; the next advances the counter in
//! place. A graph records both, so every replay draws anew, and eager calls and replays walk
//! the same sequence: a graphed model and an eager copy seeded alike draw the same values.
//! A capture restores every generator's state when it ends (its warm-ups and checks draw too),
//! so capturing consumes no randomness.
//!
//! Three kinds of draw share the sequence (each call is one draw, whatever its kind):
//! [`DeviceRng::dropout_mask`], and [`DeviceRng::uniform`] and [`DeviceRng::normal`], the
//! graph-safe replacements for `Tensor::random(shape, Distribution::Uniform(low, high), device)`
//! and `Tensor::random(shape, Distribution::Normal(mean, std), device)` inside a graphed
//! callable.
//!
//! On a backend without graphs (Flex) the same generator runs on the host, with the same
//! sequence.

use std::fmt;
use std::sync::{Arc, Mutex};

use burn::module::{
    Content, Devices, Flag, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper,
    ModuleVisitor, Param,
};
use burn::tensor::{Device, Tensor, TensorCreationOptions, TensorData};

use crate::counter_rng::{Draw, draw_value, keys, words};
use crate::cube;
use crate::error::GraphedError;

enum State {
    /// The state on the device, read and advanced there by the draw kernels.
    Device(Arc<cube::RandomState>),
    /// The counter on the host (backends without graphs).
    Host(Mutex<u64>),
}

struct RngInner {
    seed: u64,
    device: Device,
    state: State,
}

/// A counter-based random generator whose state lives on the device (see the module docs).
///
/// Clones share the state (a module's copies made by optimizer steps and `valid()` draw from
/// one sequence); two generators made with the same seed draw the same sequence.
#[derive(Clone)]
pub struct DeviceRng {
    inner: Arc<RngInner>,
}

impl fmt::Debug for DeviceRng {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceRng")
            .field("seed", &self.inner.seed)
            .field("device", &self.inner.device)
            .finish_non_exhaustive()
    }
}

impl DeviceRng {
    /// A generator on `device` (its device without autodiff holds the state), at the start of
    /// the sequence of `seed`.
    pub fn new(seed: u64, device: &Device) -> Self {
        let device = device.clone().inner();
        let state = match cube::RandomState::new(seed, &device) {
            Some(state) => State::Device(state),
            None => State::Host(Mutex::new(0)),
        };
        Self {
            inner: Arc::new(RngInner {
                seed,
                device,
                state,
            }),
        }
    }

    /// The seed it was made with.
    pub fn seed(&self) -> u64 {
        self.inner.seed
    }

    /// A dropout mask shaped like `like`, on its device and with its dtype: `scale` where an
    /// element is kept (probability `keep`), 0 elsewhere. Advances the sequence by one draw.
    ///
    /// # Panics
    ///
    /// When `like` is on another device than the generator (as burn's ops do for tensors of
    /// two devices).
    pub fn dropout_mask<const D: usize>(
        &self,
        like: &Tensor<D>,
        keep: f32,
        scale: f32,
    ) -> Tensor<D> {
        self.draw(like, Draw::Mask, keep, scale)
    }

    /// Values uniform in `[low, high)`, shaped like `like`, on its device and with its dtype:
    /// the graph-safe `Tensor::random(shape, Distribution::Uniform(low, high), device)`.
    /// Advances the sequence by one draw. A constant under autodiff (no gradient flows into
    /// it).
    ///
    /// The values are drawn in f32; `high` is excluded there (a value that rounds to `high` is
    /// `low` instead, as in PyTorch), but casting to a narrower dtype can round up to `high`.
    /// Every value is `low` when `high <= low`.
    ///
    /// # Panics
    ///
    /// When `like` is on another device than the generator (as burn's ops do for tensors of
    /// two devices).
    pub fn uniform<const D: usize>(&self, like: &Tensor<D>, low: f32, high: f32) -> Tensor<D> {
        self.draw(like, Draw::Uniform, low, high)
    }

    /// Values normally distributed with mean `mean` and standard deviation `std`, shaped like
    /// `like`, on its device and with its dtype: the graph-safe `Tensor::random(shape,
    /// Distribution::Normal(mean, std), device)`. Advances the sequence by one draw. A
    /// constant under autodiff (no gradient flows into it).
    ///
    /// Box–Muller in f32 from two uniform numbers per element; every value is within
    /// `5.8 * std` of `mean` (the smallest first uniform number is 2^-24).
    ///
    /// # Panics
    ///
    /// When `like` is on another device than the generator (as burn's ops do for tensors of
    /// two devices).
    pub fn normal<const D: usize>(&self, like: &Tensor<D>, mean: f32, std: f32) -> Tensor<D> {
        self.draw(like, Draw::Normal, mean, std)
    }

    /// One draw of kind `draw`, shaped like `like` (see the public methods).
    fn draw<const D: usize>(&self, like: &Tensor<D>, draw: Draw, a: f32, b: f32) -> Tensor<D> {
        let device = like.device();
        assert!(
            device.clone().inner() == self.inner.device,
            "DeviceRng on {:?} asked for {} on {device:?}",
            self.inner.device,
            draw.what()
        );
        let values = match &self.inner.state {
            State::Device(state) => state.draw(like.clone().inner(), draw, a, b),
            State::Host(counter) => {
                let mut counter = crate::sync::lock(counter);
                let keys = keys(words(self.inner.seed, *counter));
                *counter += 1;
                let shape = like.shape();
                let values: Vec<f32> = (0..shape.num_elements())
                    .map(|i| draw_value(draw, keys, i as u32, a, b))
                    .collect();
                // In `like`'s dtype: one rounding of the f32 values, not two through the
                // device's default float dtype.
                Tensor::<D>::from_data(
                    TensorData::new(values, shape),
                    TensorCreationOptions::new(self.inner.device.clone()).with_dtype(like.dtype()),
                )
            }
        };
        let values = if device.is_autodiff() {
            Tensor::from_inner(values)
        } else {
            values
        };
        values.cast(like.dtype())
    }
}

impl Module for DeviceRng {
    fn map<M: ModuleMapper>(self, _mapper: &mut M) -> Self {
        self
    }

    fn visit<V: ModuleVisitor>(&self, _visitor: &mut V) {}

    fn to_device(self, _device: &Device) -> Self {
        self
    }

    fn fork(self, _device: &Device) -> Self {
        self
    }

    fn collect_devices(&self, devices: Devices) -> Devices {
        devices
    }

    fn materialize(self) -> Self {
        self
    }

    fn valid(&self) -> Self {
        self.clone()
    }

    fn train(self) -> Self {
        self
    }
}

impl ModuleDisplayDefault for DeviceRng {
    fn content(&self, content: Content) -> Option<Content> {
        content
            .add_formatted(&format!("DeviceRng(seed {})", self.inner.seed))
            .optional()
    }
}

impl ModuleDisplay for DeviceRng {}

/// Dropout whose masks come from a [`DeviceRng`]: graph-safe (every replay draws a new mask),
/// otherwise as burn's `Dropout` (kept values scaled by `1 / (1 - prob)`, identity in eval mode
/// or without autodiff).
///
/// ```no_run
/// use burn::nn::{Linear, LinearConfig};
/// use burn::prelude::*;
/// use burn_graphed::{DeviceRng, GraphDropout, Graphed, GraphedConfig};
///
/// #[derive(Module, Debug)]
/// struct Net {
///     linear: Linear,
///     dropout: GraphDropout,
/// }
///
/// fn forward(net: &Net, x: Tensor<2>) -> Tensor<2> {
///     net.dropout.forward(net.linear.forward(x))
/// }
///
/// # fn main() -> Result<(), burn_graphed::GraphedError> {
/// let device = Device::default().autodiff();
/// let net = Net {
///     linear: LinearConfig::new(64, 64).init(&device),
///     dropout: GraphDropout::new(0.1, DeviceRng::new(42, &device))?,
/// };
/// let sample = Tensor::<2>::zeros([32, 64], &device);
/// // Replay validation accepts it: the replay and an eager run draw the same mask.
/// let net = Graphed::new(net, forward, sample, &GraphedConfig::new())?;
/// let y = net.forward(Tensor::<2>::ones([32, 64], &device))?; // a new mask every replay
/// # let _ = y;
/// # Ok(())
/// # }
/// ```
#[derive(Module, Debug)]
pub struct GraphDropout {
    /// Probability of zeroing an element during training.
    pub prob: f64,
    /// Whether to behave as during training (cleared by `valid()`).
    pub training: Param<Flag>,
    /// Where the masks come from.
    pub rng: DeviceRng,
}

impl GraphDropout {
    /// Dropout with probability `prob` drawing from `rng`.
    ///
    /// # Errors
    ///
    /// [`GraphedError::InvalidProbability`](crate::GraphedError::InvalidProbability) unless
    /// `0 <= prob < 1`.
    pub fn new(prob: f64, rng: DeviceRng) -> Result<Self, GraphedError> {
        if !prob.is_finite() || !(0.0..1.0).contains(&prob) {
            return Err(GraphedError::InvalidProbability { prob });
        }
        Ok(Self {
            prob,
            training: Param::from_bool(true),
            rng,
        })
    }

    /// Applies dropout during training (module in training mode, input on an autodiff device);
    /// returns the input unchanged otherwise.
    ///
    /// # Panics
    ///
    /// When `input` is on another device than the generator (as
    /// [`DeviceRng::dropout_mask`]).
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        if !self.training.is_enabled() || !input.device().is_autodiff() || self.prob == 0.0 {
            return input;
        }
        let keep = 1.0 - self.prob;
        let mask = self
            .rng
            .dropout_mask(&input, keep as f32, (1.0 / keep) as f32);
        input * mask
    }
}
