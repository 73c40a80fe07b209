//! Whether `f32` matrix products may run on TF32 tensor cores: what PyTorch's
//! `torch.backends.cuda.matmul.allow_tf32` chooses for cuBLAS.
//!
//! Added by burn-graphed's carried patch (see the workspace's UPSTREAM.md). A device advertises
//! the TF32 type and its tensor-core tiles when its client is created; cubek's matmuls and
//! convolutions then stage `f32` operands as TF32 (10-bit mantissa) wherever autotune picks a
//! tensor-core kernel. Without TF32 they run `f32` products on CUDA cores. The choice is read
//! once per device, at its creation, so it is made before the first device is used; NVIDIA's
//! `NVIDIA_TF32_OVERRIDE=0` turns TF32 off whatever is set here, as it does for cuBLAS.

use std::sync::Mutex;

struct State {
    allowed: bool,
    /// The setting the devices created so far hold, if any was created.
    created_with: Option<bool>,
}

static STATE: Mutex<State> = Mutex::new(State {
    allowed: true,
    created_with: None,
});

fn state() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

fn overridden_off() -> bool {
    std::env::var("NVIDIA_TF32_OVERRIDE").is_ok_and(|v| v.trim() == "0")
}

/// Whether devices created from now on allow TF32 (`true` unless set off or overridden by
/// `NVIDIA_TF32_OVERRIDE=0`). Default: allowed, as in cubecl's release.
pub fn allowed() -> bool {
    state().allowed && !overridden_off()
}

/// Sets whether devices allow TF32 products. Takes effect for devices created after the call;
/// once a device was created holding another setting than `allowed`, the call changes nothing
/// and returns `Err(setting of the devices created)` (with `NVIDIA_TF32_OVERRIDE=0` the devices
/// hold `false`, so a late `set_allowed(true)` is refused too).
pub fn set_allowed(allowed: bool) -> Result<(), bool> {
    let mut state = state();
    match state.created_with {
        Some(held) if held != allowed => Err(held),
        _ => {
            state.allowed = allowed;
            Ok(())
        }
    }
}

/// The setting of a device being created, recorded as held.
pub(crate) fn take_for_new_device() -> bool {
    let mut state = state();
    let allowed = state.allowed && !overridden_off();
    state.created_with = Some(allowed);
    allowed
}
