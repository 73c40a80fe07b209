//! CUDA's capture mode: burn-graphed's recordings begin in thread-local mode (the carried
//! cubecl-cuda's `capture_mode`), so that the CUDA calls of another thread of the process (here
//! raw driver calls, an allocation and a free without pause, as another GPU's server thread
//! makes while a rank warms up) neither fail nor invalidate a recording; in global mode (the
//! release's, the control) they do.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use burn_graphed::{Graphed, GraphedConfig, GraphedError};

use super::*;

/// Captures per mode: each one recording (its warm-ups and check around it) beside the calls.
const CAPTURES: usize = 3;

/// What one run of captures beside another thread's CUDA calls came to.
#[derive(Debug)]
struct Beside {
    /// The other thread's allocations and frees, and how many of them failed.
    calls: usize,
    failed: usize,
    /// The first failure, as the driver said it.
    first_failure: Option<String>,
    /// Captures refused, of [`CAPTURES`].
    refused: usize,
}

/// [`CAPTURES`] captures of a fresh MLP's forward and backward on `device` while another thread
/// allocates and frees 1 MiB on the same GPU, with raw driver calls, from before the first
/// capture to after the last.
fn captures_beside_raw_calls(device: &Device) -> Beside {
    let done = Arc::new(AtomicBool::new(false));
    let caller = {
        let done = done.clone();
        std::thread::spawn(move || {
            use cudarc::driver::result;
            let (mut calls, mut failed, mut first_failure) = (0usize, 0usize, None);
            result::init().expect("the CUDA driver");
            let gpu = result::device::get(0).expect("GPU 0");
            // SAFETY: `gpu` came from `device::get`; the reference is released below.
            let context = unsafe { result::primary_ctx::retain(gpu) }.expect("its context");
            // SAFETY: `context` is GPU 0's primary context, retained above.
            unsafe { result::ctx::set_current(context) }.expect("made current");
            while calls < 16 || !done.load(Ordering::Acquire) {
                // SAFETY: this thread's current context is GPU 0's; the allocation is freed
                // at once and used for nothing else.
                let called = unsafe { result::malloc_sync(1 << 20) }
                    .and_then(|ptr| unsafe { result::free_sync(ptr) });
                calls += 2;
                if let Err(error) = called {
                    failed += 1;
                    first_failure.get_or_insert_with(|| format!("{error:?}"));
                }
            }
            // SAFETY: releases the reference retained above, on the same thread.
            let _ = unsafe { result::primary_ctx::release(gpu) };
            (calls, failed, first_failure)
        })
    };
    let mut refused = 0;
    for capture in 0..CAPTURES {
        let model = Mlp::new(16, 2, 4, device);
        let sample = batch([8, 16], capture, device).require_grad();
        match Graphed::new(model, mlp_forward, sample, &GraphedConfig::new()) {
            Ok(_) => {}
            Err(error @ GraphedError::Capture { .. }) => {
                refused += 1;
                println!("capture {capture} refused: {error}");
            }
            Err(error) => panic!("capture {capture}: {error}"),
        }
    }
    done.store(true, Ordering::Release);
    let (calls, failed, first_failure) = caller.join().expect("the calling thread");
    Beside {
        calls,
        failed,
        first_failure,
        refused,
    }
}

/// Recordings begin in CUDA's global capture mode while this lives (a control), and in
/// thread-local mode again after, a panic included: the mode is process-wide, and the suite's
/// next test in this process must not inherit it.
pub struct GlobalMode(());

impl GlobalMode {
    pub fn on() -> Self {
        burn_graphed::testing::capture_in_global_mode(true);
        GlobalMode(())
    }
}

impl Drop for GlobalMode {
    fn drop(&mut self) {
        burn_graphed::testing::capture_in_global_mode(false);
    }
}

/// In thread-local mode every capture holds and every call of the other thread succeeds; in
/// global mode (the control) some call fails or some capture is refused, or this test cannot
/// tell the modes apart and fails saying so.
pub fn other_threads_call_cuda_during_captures(device: &Device) {
    let device = device.clone().autodiff();
    require_graphs(&device);
    let thread_local = captures_beside_raw_calls(&device);
    let global = {
        let _control = GlobalMode::on();
        captures_beside_raw_calls(&device)
    };
    println!("thread-local mode: {thread_local:?}\nglobal mode (control): {global:?}");
    assert_eq!(
        (thread_local.refused, thread_local.failed),
        (0, 0),
        "thread-local mode: another thread's allocations and frees must neither fail nor \
         invalidate a recording: {thread_local:?}"
    );
    assert!(
        global.refused > 0 || global.failed > 0,
        "the control is blind: in global mode the other thread's {} calls all succeeded and no \
         capture was refused",
        global.calls
    );
}
