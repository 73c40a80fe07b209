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

/// What one draw computes per element, from the draw's two parameters `a` and `b` (a
/// compile-time parameter of the device kernel: one kernel per kind).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Draw {
    /// `b` (the scale) with probability `a` (the keep rate), else 0.
    Mask,
    /// Uniform in `[a, b)`.
    Uniform,
    /// Normal with mean `a` and standard deviation `b` (Box–Muller).
    Normal,
}

impl Draw {
    fn what(self) -> &'static str {
        match self {
            Self::Mask => "a mask",
            Self::Uniform => "uniform values",
            Self::Normal => "normal values",
        }
    }
}

/// The two words a draw with `state` = [seed low, seed high, counter low, counter high] hashes
/// every element's index with: (seed key, call key).
fn keys(state: [u32; 4]) -> (u32, u32) {
    let key = mix32(state[0] ^ mix32(state[1] ^ 0x9e37_79b9));
    let call = mix32(state[2] ^ mix32(state[3] ^ 0x632b_e5ab));
    (key, call)
}

/// Random number `index` of a draw: 24 random bits of the hash of (seed, call counter, index).
/// Counter-based, so every element and every call has its own. Masks, uniform and normal
/// values all draw from it.
fn bits24(keys: (u32, u32), index: u32) -> u32 {
    mix32(mix32(index ^ keys.0) ^ keys.1) >> 8
}

/// Random number `index` of a draw as a uniform number in `[0, 1)`, exact in f32.
fn unit(keys: (u32, u32), index: u32) -> f32 {
    bits24(keys, index) as f32 * 0.000_000_059_604_645
}

/// Element `index` of a draw of kind `draw` with parameters `a`, `b` (the host reference of
/// the device kernel, operation for operation). A normal element takes uniform numbers `2 *
/// index` and `2 * index + 1`, so every element of a draw has its own (indices wrap at 2^32:
/// the numbers of a normal draw of more than 2^31 elements repeat).
fn draw_value(draw: Draw, keys: (u32, u32), index: u32, a: f32, b: f32) -> f32 {
    match draw {
        Draw::Mask => {
            if unit(keys, index) < a {
                b
            } else {
                0.0
            }
        }
        Draw::Uniform => uniform_between(bits24(keys, index), a, b),
        Draw::Normal => {
            let pair = index.wrapping_mul(2);
            box_muller(unit(keys, pair), unit(keys, pair.wrapping_add(1)), a, b)
        }
    }
}

/// `low + (high - low) * bits * 2^-24`, in `[low, high)`: a value that rounds to `high` (or
/// above) is `low` instead, as in PyTorch.
///
/// The product is four products of 12-bit halves of the range and of `bits`, each exact in
/// f32, summed in a fixed order: so a device that fuses a multiply and an add (CUDA does unless
/// told not to) and one that does not (lavapipe) round alike, and both equal this bit for bit.
/// (With one `fma(range, u, low)` in the kernel and `mul_add` here, 24564 of 65536 values
/// differed by an ulp between lavapipe, whose `fma` does not fuse, and the host.) Devices that
/// flush subnormal products to zero may differ for ranges below about 1e-30.
fn uniform_between(bits: u32, low: f32, high: f32) -> f32 {
    let range = high - low;
    let range_high = f32::from_bits(range.to_bits() & 0xffff_f000);
    let range_low = range - range_high;
    let bits_high = (bits >> 12) as f32 * 0.000_244_140_63;
    let bits_low = (bits & 0xfff) as f32 * 0.000_000_059_604_645;
    let value = low
        + (range_high * bits_high
            + (range_high * bits_low + (range_low * bits_high + range_low * bits_low)));
    if value >= high { low } else { value }
}

/// A normal value with mean `mean` and standard deviation `std` from two uniform numbers in
/// `[0, 1)` (Box–Muller, the cosine half).
fn box_muller(first: f32, second: f32, mean: f32, std: f32) -> f32 {
    // In (0, 1] (exact): ln never sees 0.
    let u1 = 1.0 - first;
    let radius = (-2.0 * u1.ln()).sqrt();
    // In [-pi, pi), where GPU cosines are accurate; the sign does not matter.
    let angle = std::f32::consts::PI * (2.0 * second - 1.0);
    std.mul_add(radius * angle.cos(), mean)
}

/// Draw number `counter` of a generator seeded with `seed`, for `elements` elements, computed
/// on the host.
fn reference(draw: Draw, seed: u64, counter: u64, elements: usize, a: f32, b: f32) -> Vec<f32> {
    let keys = keys(words(seed, counter));
    (0..elements)
        .map(|i| draw_value(draw, keys, i as u32, a, b))
        .collect()
}

/// The mask that draw number `counter` of a generator seeded with `seed` gives for `elements`
/// elements ([`DeviceRng::dropout_mask`]), computed on the host: the reference that tests
/// compare the device kernel with (bit for bit).
#[doc(hidden)]
pub fn reference_mask(seed: u64, counter: u64, elements: usize, keep: f32, scale: f32) -> Vec<f32> {
    reference(Draw::Mask, seed, counter, elements, keep, scale)
}

/// The values that draw number `counter` of a generator seeded with `seed` gives for `elements`
/// elements with [`DeviceRng::uniform`], computed on the host: equal to the device's bit for
/// bit (the device computes the same operations, each exact or rounded alike everywhere:
/// see `uniform_between`).
#[doc(hidden)]
pub fn reference_uniform(
    seed: u64,
    counter: u64,
    elements: usize,
    low: f32,
    high: f32,
) -> Vec<f32> {
    reference(Draw::Uniform, seed, counter, elements, low, high)
}

/// The values that draw number `counter` of a generator seeded with `seed` gives for `elements`
/// elements with [`DeviceRng::normal`], computed on the host. Equal to the device's only
/// within a small tolerance, not bit for bit: the uniform numbers are the same, but GPU `ln`,
/// `cos` and `sqrt` are not rounded like the host's.
#[doc(hidden)]
pub fn reference_normal(seed: u64, counter: u64, elements: usize, mean: f32, std: f32) -> Vec<f32> {
    reference(Draw::Normal, seed, counter, elements, mean, std)
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
            // F32 whatever the device's default float dtype: the draw kernel reads the four
            // words bit for bit (`GraphRandomOps::draw`), which a conversion would destroy.
            let state = Tensor::<1>::from_data(
                TensorData::new(values, [4]),
                TensorCreationOptions::new(device.clone()).with_dtype(burn::tensor::DType::F32),
            );
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
            #[cfg(feature = "cube")]
            State::Device(state) => {
                use crate::cube::random_op::GraphRandomOps;
                touch(&self.inner);
                let like_inner = like.clone().inner();
                Tensor::<D>::from_dispatch(<burn::backend::Dispatch as GraphRandomOps>::draw(
                    &state.clone().into_dispatch(),
                    &like_inner.into_dispatch(),
                    draw,
                    a,
                    b,
                ))
            }
            State::Host(counter) => {
                let mut counter = crate::lock(counter);
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

// Which generators the capturing thread drew from since the outermost save (see
// `SavedStates`): a capture restores only those, so that draws other threads make from their
// own generators while a capture runs are not undone.
#[cfg(feature = "cube")]
thread_local! {
    static TOUCHED: std::cell::RefCell<Option<Vec<std::sync::Weak<RngInner>>>> =
        const { std::cell::RefCell::new(None) };
}

/// Notes that this thread drew from `inner` (when a save is open on this thread).
#[cfg(feature = "cube")]
fn touch(inner: &Arc<RngInner>) {
    TOUCHED.with(|touched| {
        if let Some(touched) = touched.borrow_mut().as_mut()
            && !touched
                .iter()
                .any(|t| std::ptr::eq(t.as_ptr(), Arc::as_ptr(inner)))
        {
            touched.push(Arc::downgrade(inner));
        }
    });
}

/// Whether this thread drew from `inner` since the outermost open save.
#[cfg(feature = "cube")]
fn touched(inner: &Arc<RngInner>) -> bool {
    TOUCHED.with(|touched| {
        touched.borrow().as_ref().is_some_and(|touched| {
            touched
                .iter()
                .any(|t| std::ptr::eq(t.as_ptr(), Arc::as_ptr(inner)))
        })
    })
}

/// The device states of the live generators, copied by [`save_device_states`], for
/// [`restore_device_states`].
///
/// The outermost save on a thread starts recording which generators the thread draws from
/// (graph replays draw from the generators their recording drew from, on this thread too);
/// dropping it stops the recording. Nested saves (replay validation inside a capture) see
/// the same record.
#[cfg(feature = "cube")]
pub(crate) struct SavedStates {
    states: Vec<(Arc<RngInner>, Tensor<1>)>,
    outermost: bool,
}

#[cfg(feature = "cube")]
impl Drop for SavedStates {
    fn drop(&mut self) {
        if self.outermost {
            TOUCHED.with(|touched| *touched.borrow_mut() = None);
        }
    }
}

/// Copies the device states of every live generator (a 16-byte copy each), for
/// [`restore_device_states`].
#[cfg(feature = "cube")]
pub(crate) fn save_device_states() -> SavedStates {
    let outermost = TOUCHED.with(|touched| {
        let mut touched = touched.borrow_mut();
        let outermost = touched.is_none();
        if outermost {
            *touched = Some(Vec::new());
        }
        outermost
    });
    let live = crate::lock(&DEVICE_RNGS);
    let states = live
        .iter()
        .filter_map(std::sync::Weak::upgrade)
        .filter_map(|inner| match &inner.state {
            // A buffer copy, not `state * 1.0`: the words are integers, whose f32 bit patterns
            // include NaNs that arithmetic may change.
            State::Device(state) => {
                crate::cube::copy_op::copy_tensor(state).map(|copy| (inner.clone(), copy))
            }
            State::Host(_) => None,
        })
        .collect();
    SavedStates { states, outermost }
}

/// Writes the saved states of the generators this thread drew from since the outermost save
/// back into their own buffers (their addresses, which graphs recorded, do not change), and
/// waits for the copies. Generators only other threads drew from keep their draws. (One
/// generator drawn from by this thread's capture and, at the same time, by another thread
/// loses the other thread's draws: share no generator across threads while capturing.)
///
/// # Errors
///
/// The device's error when the wait fails.
#[cfg(feature = "cube")]
pub(crate) fn restore_device_states(
    saved: &SavedStates,
) -> Result<(), burn::backend::ExecutionError> {
    let mut queued = Vec::with_capacity(saved.states.len());
    let mut device = None;
    for (inner, copy) in saved.states.iter().filter(|(inner, _)| touched(inner)) {
        if let State::Device(state) = &inner.state {
            queued.extend(crate::cube::copy_op::copy_tensor_into(state, copy));
            device = Some(&inner.device);
        }
    }
    if let Some(device) = device {
        device.sync()?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The largest uniform number, `1 - 2^-24`, rounds to 2 in `[1, 2)`: it must not be
    /// returned.
    #[test]
    fn uniform_excludes_high() {
        let largest = 0x00ff_ffff;
        assert_eq!(
            1.0f32 + (largest as f32 * 0.000_000_059_604_645),
            2.0,
            "the case rounds up"
        );
        assert_eq!(uniform_between(largest, 1.0, 2.0), 1.0);
        assert_eq!(uniform_between(largest, 0.0, 1.0), 1.0 - f32::EPSILON / 2.0);
        assert_eq!(uniform_between(0, -3.0, 5.0), -3.0);
    }

    /// Every partial product of `uniform_between` is exact (so fusing a multiply with the next
    /// add cannot change it), and the value is within an ulp (of the larger bound) of the
    /// exact one.
    #[test]
    fn uniform_products_are_exact() {
        assert_eq!(0.000_244_140_63f32, 2.0f32.powi(-12));
        assert_eq!(0.000_000_059_604_645f32, 2.0f32.powi(-24));
        for (low, high) in [
            (0.0f32, 1.0f32),
            (-2.0, 3.0),
            (0.1, 0.7),
            (-1e-3, 1e-3),
            (3.0, 1e4),
        ] {
            let range = high - low;
            let range_high = f32::from_bits(range.to_bits() & 0xffff_f000);
            let range_low = range - range_high;
            assert_eq!(
                f64::from(range_high) + f64::from(range_low),
                f64::from(range)
            );
            for index in 0..4096 {
                let bits = mix32(index) >> 8;
                let bits_high = (bits >> 12) as f32 * 0.000_244_140_63;
                let bits_low = (bits & 0xfff) as f32 * 0.000_000_059_604_645;
                for (x, y) in [range_high, range_low]
                    .into_iter()
                    .flat_map(|x| [(x, bits_high), (x, bits_low)])
                {
                    assert_eq!(f64::from(x * y), f64::from(x) * f64::from(y), "{x} * {y}");
                }
                let value = uniform_between(bits, low, high);
                let exact = f64::from(low) + f64::from(range) * f64::from(bits) / 16_777_216.0;
                // As for any f32 `low + range * u`: within an ulp of the larger bound.
                let ulp = f64::from(low.abs().max(high.abs())) * f64::from(f32::EPSILON);
                assert!(
                    (f64::from(value) - exact).abs() <= ulp,
                    "{value} vs {exact}"
                );
            }
        }
    }

    /// A first uniform number of 0 gives a finite value (ln sees 1), and the largest one
    /// gives the largest magnitude, `sqrt(-2 ln 2^-24) * std`, on either side of the mean.
    #[test]
    fn normal_values_are_finite_and_bounded() {
        let largest = 0x00ff_ffff as f32 * 0.000_000_059_604_645;
        assert_eq!(box_muller(0.0, 0.25, 1.0, 2.0), 1.0);
        let bound = (-2.0 * (0.000_000_059_604_645f32).ln()).sqrt();
        assert!((5.7..5.8).contains(&bound), "{bound}");
        assert!((box_muller(largest, 0.5, 0.0, 1.0) - bound).abs() < 1e-5);
        assert!((box_muller(largest, 0.0, 0.0, 1.0) + bound).abs() < 1e-5);
        assert!((box_muller(largest, 0.5, 3.0, 0.5) - (3.0 + 0.5 * bound)).abs() < 1e-5);
    }
}
