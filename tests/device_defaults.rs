//! A device whose default float dtype is not f32, alone in its process: burn's device
//! settings are set once per device, before its first tensor, so this cannot share a process
//! (and a device) with the CPU suite.

use burn::prelude::*;
use burn::tensor::{DType, FloatDType, TensorCreationOptions};
use burn_graphed::DeviceRng;
use burn_graphed::testing::{reference_mask, reference_uniform};

/// `device` with f16 as its default float dtype, or why it cannot have it (an adapter without
/// f16, such as Mesa's OpenGL fallback of wgpu).
fn f16_default(mut device: Device) -> Result<Device, String> {
    device
        .configure(FloatDType::F16)
        .map_err(|error| format!("{error:?}"))?;
    Ok(device)
}

/// `skipped: TEST: WHY` past the harness's capture, which the runners count as a skip, not a
/// pass (the scenarios' helper; this binary does not load the scenarios).
#[path = "scenarios/skip.rs"]
mod skip;

/// A tensor of zeros in `dtype`, whatever the device's default.
fn zeros(shape: [usize; 2], device: &Device, dtype: DType) -> Tensor<2> {
    Tensor::zeros(
        shape,
        TensorCreationOptions::new(device.clone()).with_dtype(dtype),
    )
}

/// Uniform draws in f32 over `[0, 1024)`, `like`'s draw `counter` of the sequence of `seed`,
/// equal the host reference exactly.
fn assert_f32_uniform(rng: &DeviceRng, like: &Tensor<2>, seed: u64, counter: u64) {
    let n = like.shape().num_elements();
    let drawn = rng.uniform(like, 0.0, 1024.0);
    assert_eq!(drawn.dtype(), DType::F32);
    let drawn = drawn.into_data().try_to_vec::<f32>().expect("f32 data");
    assert_eq!(
        drawn,
        reference_uniform(seed, counter, n, 0.0, 1024.0),
        "f32 draw {counter}"
    );
}

/// `DeviceRng` keeps its four state words in f32 whatever the device's default float dtype:
/// its draws on a device configured for f16 equal the host reference (in f16, where the
/// values chosen are exact). Before the state was made with an explicit dtype it followed the
/// device's default: an f16 state rounds the seed's words away and holds half the 16 bytes the
/// draw kernel reads.
#[test]
fn device_rng_keeps_f32_state_on_an_f16_device() {
    let device = match f16_default(Device::wgpu(Default::default())) {
        Ok(device) => device,
        Err(why) => {
            return skip::skip(&format!("the wgpu adapter has no f16 ({why})"));
        }
    };
    let rng = DeviceRng::new(7, &device);
    let like = Tensor::<2>::zeros([32, 48], &device);
    assert_eq!(like.dtype(), DType::F16, "the device's default");
    let n = like.shape().num_elements();

    let (keep, scale) = (0.5f32, 2.0f32);
    let mask = rng.dropout_mask(&like, keep, scale);
    assert_eq!(mask.dtype(), DType::F16, "a draw takes `like`'s dtype");
    let mask = mask
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32 data");
    assert_eq!(mask, reference_mask(7, 0, n, keep, scale), "draw 0");

    // Uniform over [0, 1024) in f16, compared after the same rounding.
    let drawn = rng.uniform(&like, 0.0, 1024.0);
    let drawn = drawn
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32 data");
    let reference: Vec<f32> = reference_uniform(7, 1, n, 0.0, 1024.0)
        .into_iter()
        .map(|v| burn::tensor::f16::from_f32(v).to_f32())
        .collect();
    assert_eq!(drawn, reference, "draw 1");

    // An f32 `like` on the same device draws f32 values, unrounded.
    assert_f32_uniform(&rng, &zeros([32, 48], &device, DType::F32), 7, 2);
}

/// The host generator (Flex: no graphs) makes its values in `like`'s dtype directly: an f32
/// draw on a device whose default is f16 is not rounded through f16 on the way.
#[test]
fn host_rng_draws_in_the_like_dtype_on_an_f16_device() {
    let device = f16_default(Device::flex()).expect("Flex supports f16 as its default float dtype");
    let rng = DeviceRng::new(11, &device);
    assert_f32_uniform(&rng, &zeros([16, 24], &device, DType::F32), 11, 0);
}
