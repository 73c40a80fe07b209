//! The counter-based generator's arithmetic on the host: the kinds of draw, the hash of
//! (seed, call counter, element index) into random bits, and the values each kind makes of
//! them. The device kernel (`cube/kernels/random_op.rs`) computes the same, operation for operation;
//! [`DeviceRng`](crate::DeviceRng) runs this on backends without graphs, and tests compare the
//! device with it.

/// A 32-bit integer hash with good avalanche (Wellons' "lowbias32"); the device kernel
/// (`cube/kernels/random_op.rs`) computes the same.
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
    pub(crate) fn what(self) -> &'static str {
        match self {
            Self::Mask => "a mask",
            Self::Uniform => "uniform values",
            Self::Normal => "normal values",
        }
    }
}

/// The two words a draw with `state` = [seed low, seed high, counter low, counter high] hashes
/// every element's index with: (seed key, call key).
pub(crate) fn keys(state: [u32; 4]) -> (u32, u32) {
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
pub(crate) fn draw_value(draw: Draw, keys: (u32, u32), index: u32, a: f32, b: f32) -> f32 {
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
#[cfg(feature = "testing")]
fn reference(draw: Draw, seed: u64, counter: u64, elements: usize, a: f32, b: f32) -> Vec<f32> {
    let keys = keys(words(seed, counter));
    (0..elements)
        .map(|i| draw_value(draw, keys, i as u32, a, b))
        .collect()
}

/// The mask that draw number `counter` of a generator seeded with `seed` gives for `elements`
/// elements ([`DeviceRng::dropout_mask`](crate::DeviceRng::dropout_mask)), computed on the host: the reference that tests
/// compare the device kernel with (bit for bit).
#[cfg(feature = "testing")]
pub fn reference_mask(seed: u64, counter: u64, elements: usize, keep: f32, scale: f32) -> Vec<f32> {
    reference(Draw::Mask, seed, counter, elements, keep, scale)
}

/// The values that draw number `counter` of a generator seeded with `seed` gives for `elements`
/// elements with [`DeviceRng::uniform`](crate::DeviceRng::uniform), computed on the host: equal to the device's bit for
/// bit (the device computes the same operations, each exact or rounded alike everywhere:
/// see `uniform_between`).
#[cfg(feature = "testing")]
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
/// elements with [`DeviceRng::normal`](crate::DeviceRng::normal), computed on the host. Equal to the device's only
/// within a small tolerance, not bit for bit: the uniform numbers are the same, but GPU `ln`,
/// `cos` and `sqrt` are not rounded like the host's.
#[cfg(feature = "testing")]
pub fn reference_normal(seed: u64, counter: u64, elements: usize, mean: f32, std: f32) -> Vec<f32> {
    reference(Draw::Normal, seed, counter, elements, mean, std)
}

pub(crate) fn words(seed: u64, counter: u64) -> [u32; 4] {
    [
        seed as u32,
        (seed >> 32) as u32,
        counter as u32,
        (counter >> 32) as u32,
    ]
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
