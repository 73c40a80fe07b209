//! The CPU suite's memory tests, alone in their process and one at a time: they assert on the
//! device's reserved bytes, which other tests running at the same time on the same device would
//! disturb (the GPU suite runs its tests one at a time, so there they are ordinary tests of
//! `tests/gpu.rs`).

mod scenarios;

use std::sync::Mutex;

/// Held by each test of this file: libtest runs tests on parallel threads.
static ALONE: Mutex<()> = Mutex::new(());

fn alone() -> std::sync::MutexGuard<'static, ()> {
    ALONE.lock().unwrap_or_else(|poison| poison.into_inner())
}

/// 60 SGD-momentum steps on wgpu (lavapipe) beside eager ones: eval every 10, parameters
/// compared and re-synchronized every 20, no growth of reserved bytes or live allocations after
/// the first checkpoint. SGD, not Adam: see `scenarios::robust::soak`.
#[test]
fn wgpu_soak() {
    let _alone = alone();
    let device = scenarios::picks::wgpu();
    let figures = scenarios::robust::soak(&device, scenarios::robust::sgd_momentum, 60, 10, 20, 20)
        .expect("wgpu captures graphs");
    println!("soak figures: {figures:?}");
    assert_eq!(
        (figures.checkpoints, figures.evals, figures.replays),
        (3, 6, 66),
        "{figures:?}"
    );
    // wgpu runs the same kernels graphed and eagerly: the parameters never drift apart.
    assert_eq!(figures.max_drift, 0.0, "{figures:?}");
}

/// The same soak with burn's Adam, whose bias corrections change every step: wgpu passes
/// kernel scalars in cubecl's cached metadata buffers, so every step leaves new ones
/// (ROBUSTNESS.md, "Long runs"): live allocations grow after the first checkpoint, which is
/// why `wgpu_soak` uses SGD. Training still equals eager (no drift).
#[test]
fn wgpu_adam_soak_grows_kernel_metadata() {
    let _alone = alone();
    let device = scenarios::picks::wgpu();
    let figures = scenarios::robust::soak_run(&device, scenarios::robust::adam, 60, 10, 20, 20)
        .expect("wgpu captures graphs");
    println!("Adam soak figures: {figures:?}");
    assert!(
        figures.allocs_at_end > figures.allocs_after_settle + 40 * 4,
        "Adam's per-step scalars: at least 4 more live allocations a step: {figures:?}"
    );
    assert_eq!(figures.max_drift, 0.0, "{figures:?}");
}

/// A capture returns the pages only its warm-ups used (`release_capture_memory`).
#[test]
fn wgpu_capture_releases_warmup_memory() {
    let _alone = alone();
    scenarios::robust::capture_releases_warmup_memory(&scenarios::picks::wgpu());
}
