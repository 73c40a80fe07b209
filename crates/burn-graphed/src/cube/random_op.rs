//! Graph-safe random numbers on the device: a counter-based generator whose state (seed and
//! call counter, four `u32` words) lives in a device buffer. A draw reads the state on the
//! device and a second kernel advances the counter there, so a captured graph that replays
//! the two kernels draws new numbers on every replay, in the same sequence as eager calls.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, backend_extension};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Threads per cube of the mask kernel.
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

/// Element `i` of the mask: `scale` with probability `keep`, else 0. The random word is a
/// hash of (seed, call counter, i): counter-based, so every element and every call has its own.
#[cube(launch_unchecked)]
fn dropout_mask_kernel(state: &[u32], mask: &mut [f32], keep: f32, scale: f32) {
    let i = ABSOLUTE_POS;
    if i < mask.len() {
        let key = mix32(state[0] ^ mix32(state[1] ^ 0x9e37_79b9u32));
        let call = mix32(state[2] ^ mix32(state[3] ^ 0x632b_e5abu32));
        let word = mix32(mix32(u32::cast_from(i) ^ key) ^ call);
        // 24 random bits: a uniform draw in [0, 1) exact in f32.
        let uniform = f32::cast_from(word >> 8u32) * 0.000_000_059_604_645f32;
        let mut value = 0.0f32;
        if uniform < keep {
            value = scale;
        }
        mask[i] = value;
    }
}

/// Advances the call counter (words 2 and 3, a 64-bit counter) by one.
#[cube(launch_unchecked)]
fn advance_kernel(state: &mut [u32]) {
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
    /// A dropout mask shaped like `like` (f32: `scale` where kept, 0 elsewhere) drawn from the
    /// generator `state` (a 4-element f32 tensor whose bits are the state words), whose counter
    /// is then advanced on the device.
    #[fusion(dtype = state, shape = like)]
    fn dropout_mask(
        state: &FloatTensor<Self>,
        like: &FloatTensor<Self>,
        keep: f32,
        scale: f32,
    ) -> FloatTensor<Self>;
}

impl GraphRandomOps for CubeBackend {
    fn dropout_mask(state: &CubeTensor, like: &CubeTensor, keep: f32, scale: f32) -> CubeTensor {
        let shape = like.meta.shape().clone();
        let elements: usize = shape.iter().product();
        let mask = burn_cubecl::ops::numeric::empty_device_dtype(
            state.client.clone(),
            state.device.clone(),
            shape,
            burn::tensor::DType::F32,
        );
        let cubes = (elements as u32).div_ceil(CUBE_THREADS).max(1);
        // SAFETY: `launch_unchecked` skips bounds checks: the kernel reads words 0-3 of `state`
        // (a 4-element, 4-byte-per-element buffer, checked by `DeviceRng`, its only maker) and
        // writes `mask` only below its length, which is the length declared here.
        unsafe {
            dropout_mask_kernel::launch_unchecked(
                &state.client,
                CubeCount::Static(cubes, 1, 1),
                CubeDim::new_1d(CUBE_THREADS),
                BufferArg::from_raw_parts(state.handle.clone(), 4),
                BufferArg::from_raw_parts(mask.handle.clone(), elements),
                keep,
                scale,
            );
        }
        // SAFETY: one thread writes words 2 and 3 of the same 4-word buffer; launched after the
        // mask kernel on the same stream, so the mask read the counter before it moves.
        unsafe {
            advance_kernel::launch_unchecked(
                &state.client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(1),
                BufferArg::from_raw_parts(state.handle.clone(), 4),
            );
        }
        mask
    }
}
