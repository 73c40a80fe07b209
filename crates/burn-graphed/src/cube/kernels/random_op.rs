//! Graph-safe random numbers on the device: a counter-based generator whose state (seed and
//! call counter, four `u32` words) lives in a device buffer. A draw reads the state on the
//! device and a second kernel advances the counter there, so a captured graph that replays
//! the two kernels draws new numbers on every replay, in the same sequence as eager calls.
//! One kernel serves every kind of draw (mask, uniform, normal: a compile-time parameter); the
//! host reference (`crate::counter_rng::draw_value`) computes the same, operation for operation.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, backend_extension};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use std::f32::consts::PI;

use super::super::dense::Dense;
use crate::counter_rng::Draw;

impl Draw {
    /// The kind as fusion's first scalar of the operation.
    fn code(self) -> u32 {
        self as u32
    }
}

/// Threads per cube of the draw kernel.
const CUBE_THREADS: u32 = 256;

/// A 32-bit integer hash with good avalanche (Wellons' "lowbias32").
#[cube]
fn mix32(value: u32) -> u32 {
    let mut x = value;
    x ^= x >> 16u32;
    x *= 0x7feb_352du32;
    x ^= x >> 15u32;
    x *= 0x846c_a68bu32;
    x ^= x >> 16u32;
    x
}

/// Random number `index` of the draw whose keys are `key` (seed) and `call` (counter): 24
/// random bits of a hash of (seed, call counter, index). Counter-based, so every element and
/// every call has its own.
#[cube]
fn bits24(key: u32, call: u32, index: u32) -> u32 {
    mix32(mix32(index ^ key) ^ call) >> 8u32
}

/// Random number `index` as a uniform number in [0, 1), exact in f32.
#[cube]
fn unit(key: u32, call: u32, index: u32) -> f32 {
    f32::cast_from(bits24(key, call, index)) * 0.000_000_059_604_645f32
}

/// Element `i` of a draw of kind `draw` with parameters `a` and `b`: a mask (`b` with
/// probability `a`, else 0), uniform in `[a, b)`, or normal with mean `a` and standard
/// deviation `b` (Box–Muller from uniform numbers `2i` and `2i + 1`).
#[cube(launch_unchecked)]
fn rng_draw_kernel(state: &[u32], out: &mut [f32], a: f32, b: f32, #[comptime] draw: Draw) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        let key = mix32(state[0] ^ mix32(state[1] ^ 0x9e37_79b9u32));
        let call = mix32(state[2] ^ mix32(state[3] ^ 0x632b_e5abu32));
        let index = u32::cast_from(i);
        let mut value = 0.0f32;
        match draw {
            Draw::Mask => {
                if unit(key, call, index) < a {
                    value = b;
                }
            }
            Draw::Uniform => {
                // As `crate::counter_rng::uniform_between`: four exact products of 12-bit halves, so
                // that fusing a multiply and an add (NVRTC does) changes nothing.
                let bits = bits24(key, call, index);
                let range = b - a;
                let range_high = f32::reinterpret(u32::reinterpret(range) & 0xffff_f000u32);
                let range_low = range - range_high;
                let bits_high = f32::cast_from(bits >> 12u32) * 0.000_244_140_63f32;
                let bits_low = f32::cast_from(bits & 0xfffu32) * 0.000_000_059_604_645f32;
                value = a
                    + (range_high * bits_high
                        + (range_high * bits_low + (range_low * bits_high + range_low * bits_low)));
                if value >= b {
                    value = a;
                }
            }
            Draw::Normal => {
                // As `crate::counter_rng::box_muller`: u1 in (0, 1], so ln never sees 0; the angle in
                // [-pi, pi), where GPU cosines are accurate.
                let u1 = 1.0f32 - unit(key, call, index * 2u32);
                let u2 = unit(key, call, index * 2u32 + 1u32);
                let radius = (-2.0f32 * u1.ln()).sqrt();
                let angle = PI * (2.0f32 * u2 - 1.0f32);
                value = fma(b, radius * angle.cos(), a);
            }
        }
        out[i] = value;
    }
}

/// Advances the call counter (words 2 and 3, a 64-bit counter) by one.
#[cube(launch_unchecked)]
fn rng_advance_kernel(state: &mut [u32]) {
    if ABSOLUTE_POS == 0 {
        let next = state[2] + 1u32;
        state[2] = next;
        if next == 0u32 {
            state[3] += 1u32;
        }
    }
}

/// Random ops whose state is a device buffer.
#[backend_extension(Cube, Fusion)]
pub(crate) trait GraphRandomOps: Backend {
    /// A draw of kind `draw` (parameters `a`, `b`) shaped like `like`, in f32, from the
    /// generator `state` (a 4-element f32 tensor whose bits are the state words), whose counter
    /// is then advanced on the device.
    #[fusion(dtype = state, shape = like)]
    fn draw(
        state: &FloatTensor<Self>,
        like: &FloatTensor<Self>,
        #[fusion(scalar = draw.code())] draw: Draw,
        a: f32,
        b: f32,
    ) -> FloatTensor<Self>;
}

impl GraphRandomOps for CubeBackend {
    fn draw(state: &CubeTensor, like: &CubeTensor, draw: Draw, a: f32, b: f32) -> CubeTensor {
        let shape = like.meta.shape().clone();
        // Dense: the kernel writes element `i` at index `i` (see `dense`).
        let out = Dense::new_empty(
            state.client.clone(),
            state.device.clone(),
            shape,
            burn::tensor::DType::F32,
        );
        let cubes = (out.len() as u32).div_ceil(CUBE_THREADS).max(1);
        // `DeviceRng`, the only maker of states, makes them 4 f32 words whatever the device's
        // default float dtype; checked here in release builds too, since the launches below
        // rely on it.
        assert!(
            state.dtype == burn::tensor::DType::F32 && state.meta.shape().num_elements() == 4,
            "a DeviceRng state is 4 f32 words, not {:?} of {:?}",
            state.meta.shape(),
            state.dtype
        );
        // SAFETY: `launch_unchecked` skips bounds checks: the kernel reads words 0-3 of `state`
        // (4 elements of 4 bytes: asserted above) and writes `out`, a dense f32 buffer (the
        // kernel's element type), only below its length.
        unsafe {
            rng_draw_kernel::launch_unchecked(
                &state.client,
                CubeCount::Static(cubes, 1, 1),
                CubeDim::new_1d(CUBE_THREADS),
                BufferArg::from_raw_parts(state.handle.clone(), 4),
                out.arg(),
                a,
                b,
                draw,
            );
        }
        // SAFETY: one thread writes words 2 and 3 of the same 4-word buffer; launched after the
        // draw kernel on the same stream, so the draw read the counter before it moves.
        unsafe {
            rng_advance_kernel::launch_unchecked(
                &state.client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(1),
                BufferArg::from_raw_parts(state.handle.clone(), 4),
            );
        }
        out.into_tensor()
    }
}
