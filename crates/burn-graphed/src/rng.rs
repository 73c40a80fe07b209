//! Graph-safe randomness: [`DeviceRng`], a counter-based generator whose state lives in device
//! memory and is advanced by the device, and [`GraphDropout`], a dropout layer drawing from it.
//!
//! burn's random ops take their seeds from a host generator as kernel scalars, so a captured
//! graph replays one dropout mask forever (and replay validation refuses them, see
//! [`GraphedConfig::validate_replay`](crate::GraphedConfig::validate_replay)). A draw from a
//! `DeviceRng` is two kernels: one reads the state (seed, call counter) from the device buffer
//! and hashes (seed, counter, element index) into the mask; the next advances the counter in
//! place. A graph records both, so every replay draws a new mask, and eager calls and replays
//! walk the same sequence: a graphed model and an eager copy seeded alike draw the same masks.
//! A capture restores every generator's state when it ends (its warm-ups and checks draw too),
//! so capturing consumes no randomness.
//!
//! On a backend without graphs (Flex) the same generator runs on the host, with the same
//! sequence.

use std::fmt;
use std::sync::{Arc, Mutex};

use burn::module::{
    Content, Devices, Flag, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper,
    ModuleVisitor, Param,
};
use burn::tensor::{Device, Tensor, TensorData};

/// A 32-bit integer hash with good avalanche (Wellons' "lowbias32"); the device kernel
/// (`cube/random_op.rs`) computes the same.
pub(crate) fn mix32(value: u32) -> u32 {
    let mut x = value;
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^= x >> 16;
    x
}

/// Element `index` of the mask drawn with `state` = [seed low, seed high, counter low, counter
/// high]: `scale` with probability `keep`, else 0 (the host reference of the device kernel).
pub(crate) fn mask_value(state: [u32; 4], index: usize, keep: f32, scale: f32) -> f32 {
    let key = mix32(state[0] ^ mix32(state[1] ^ 0x9e37_79b9));
    let call = mix32(state[2] ^ mix32(state[3] ^ 0x632b_e5ab));
    let word = mix32(mix32(index as u32 ^ key) ^ call);
    let uniform = (word >> 8) as f32 * 0.000_000_059_604_645;
    if uniform < keep { scale } else { 0.0 }
}

/// The mask that draw number `counter` of a generator seeded with `seed` gives for `elements`
/// elements, computed on the host: the reference that tests compare the device kernel with.
#[doc(hidden)]
pub fn reference_mask(seed: u64, counter: u64, elements: usize, keep: f32, scale: f32) -> Vec<f32> {
    let state = words(seed, counter);
    (0..elements)
        .map(|i| mask_value(state, i, keep, scale))
        .collect()
}

fn words(seed: u64, counter: u64) -> [u32; 4] {
    [
        seed as u32,
        (seed >> 32) as u32,
        counter as u32,
        (counter >> 32) as u32,
    ]
}

enum State {
    /// Four f32 elements whose bits are the state words, in a device buffer that the draw
    /// kernels read and advance in place (never reallocated: graphs record its address).
    #[cfg(feature = "cube")]
    Device(Box<Tensor<1>>),
    /// The counter on the host (backends without graphs).
    Host(Mutex<u64>),
}

pub(crate) struct RngInner {
    seed: u64,
    device: Device,
    state: State,
}

/// Generators with device state, for captures to save and restore (weak: a dropped generator
/// leaves the registry at the next capture).
#[cfg(feature = "cube")]
static DEVICE_RNGS: Mutex<Vec<std::sync::Weak<RngInner>>> = Mutex::new(Vec::new());

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
        #[cfg(feature = "cube")]
        if crate::cube::capture::supports_capture(&device) {
            let values: Vec<f32> = words(seed, 0).iter().map(|w| f32::from_bits(*w)).collect();
            let state = Tensor::<1>::from_data(TensorData::new(values, [4]), &device);
            let inner = Arc::new(RngInner {
                seed,
                device,
                state: State::Device(Box::new(state)),
            });
            let mut live = crate::lock(&DEVICE_RNGS);
            live.retain(|weak| weak.strong_count() > 0);
            live.push(Arc::downgrade(&inner));
            return Self { inner };
        }
        Self {
            inner: Arc::new(RngInner {
                seed,
                device,
                state: State::Host(Mutex::new(0)),
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
        let device = like.device();
        assert!(
            device.clone().inner() == self.inner.device,
            "DeviceRng on {:?} asked for a mask on {device:?}",
            self.inner.device
        );
        let mask = match &self.inner.state {
            #[cfg(feature = "cube")]
            State::Device(state) => {
                use crate::cube::random_op::GraphRandomOps;
                let like_inner = like.clone().inner();
                Tensor::<D>::from_dispatch(
                    <burn::backend::Dispatch as GraphRandomOps>::dropout_mask(
                        &state.clone().into_dispatch(),
                        &like_inner.into_dispatch(),
                        keep,
                        scale,
                    ),
                )
            }
            State::Host(counter) => {
                let mut counter = crate::lock(counter);
                let state = words(self.inner.seed, *counter);
                *counter += 1;
                let shape = like.shape();
                let values: Vec<f32> = (0..shape.num_elements())
                    .map(|i| mask_value(state, i, keep, scale))
                    .collect();
                Tensor::<D>::from_data(TensorData::new(values, shape), &self.inner.device)
            }
        };
        let mask = if device.is_autodiff() {
            Tensor::from_inner(mask)
        } else {
            mask
        };
        mask.cast(like.dtype())
    }
}

/// The device states of every live generator, copied, for [`restore_device_states`].
#[cfg(feature = "cube")]
pub(crate) fn save_device_states() -> Vec<(Arc<RngInner>, Tensor<1>)> {
    let live = crate::lock(&DEVICE_RNGS);
    live.iter()
        .filter_map(std::sync::Weak::upgrade)
        .filter_map(|inner| match &inner.state {
            // A buffer copy, not `state * 1.0`: the words are integers, whose f32 bit patterns
            // include NaNs that arithmetic may change.
            State::Device(state) => {
                crate::cube::copy_op::copy_tensor(state).map(|copy| (inner.clone(), copy))
            }
            State::Host(_) => None,
        })
        .collect()
}

/// Writes saved states back into the generators' own buffers (their addresses, which graphs
/// recorded, do not change), and waits for the copies.
///
/// # Errors
///
/// The device's error when the wait fails.
#[cfg(feature = "cube")]
pub(crate) fn restore_device_states(
    saved: &[(Arc<RngInner>, Tensor<1>)],
) -> Result<(), burn::backend::ExecutionError> {
    let mut queued = Vec::with_capacity(saved.len());
    for (inner, copy) in saved {
        if let State::Device(state) = &inner.state {
            queued.extend(crate::cube::copy_op::copy_tensor_into(state, copy));
        }
    }
    if let Some((inner, _)) = saved.first() {
        inner.device.sync()?;
    }
    drop(queued);
    Ok(())
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
    pub fn new(prob: f64, rng: DeviceRng) -> Result<Self, crate::GraphedError> {
        if !prob.is_finite() || !(0.0..1.0).contains(&prob) {
            return Err(crate::GraphedError::InvalidProbability { prob });
        }
        Ok(Self {
            prob,
            training: Param::from_bool(true),
            rng,
        })
    }

    /// Applies dropout during training (module in training mode, input on an autodiff device);
    /// returns the input unchanged otherwise.
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
