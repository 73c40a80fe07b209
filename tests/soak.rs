//! The CPU soak run, alone in its process: it asserts that the device's memory stops growing,
//! which other tests running at the same time on the same device would disturb (the GPU suite
//! runs its tests one at a time, so there the soak is an ordinary test of `tests/gpu.rs`).

mod scenarios;

use burn::prelude::*;

/// 60 SGD-momentum steps on wgpu (lavapipe) beside eager ones: eval every 10, parameters
/// compared and re-synchronized every 20, no growth of reserved bytes or live allocations after
/// the first checkpoint. SGD, not Adam: see `scenarios::robust::soak`.
#[test]
fn wgpu_soak() {
    let device = Device::wgpu(Default::default());
    let figures = scenarios::robust::soak(&device, scenarios::robust::sgd_momentum, 60, 10, 20, 20)
        .expect("wgpu captures graphs");
    println!("soak figures: {figures:?}");
}
