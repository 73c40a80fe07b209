//! The device state of a [`DeviceRng`](crate::DeviceRng) generator, its draws, and the
//! registry that lets a capture put every generator back as it found it (a capture's warm-ups
//! and checks draw too, and capturing must consume no randomness).

use std::sync::{Arc, Mutex, Weak};

use burn::tensor::{DType, Device, Tensor, TensorCreationOptions, TensorData};

use super::super::kernels::random_op::GraphRandomOps;
use crate::counter_rng::{Draw, words};
use crate::sync::lock;

/// A generator's state: four f32 elements whose bits are the state words (seed, call
/// counter), in a device buffer that the draw kernels read and advance in place. Never
/// reallocated: graphs record its address.
pub(crate) struct RandomState {
    tensor: Tensor<1>,
    device: Device,
}

/// Generators with device state (weak: a dropped generator leaves at the next registration).
static LIVE: Mutex<Vec<Weak<RandomState>>> = Mutex::new(Vec::new());

impl RandomState {
    /// The state of a generator seeded with `seed`, at the start of its sequence, on `device`
    /// (without autodiff). `None` where the backend cannot capture graphs: there the host
    /// counter serves, with the same sequence.
    pub(crate) fn new(seed: u64, device: &Device) -> Option<Arc<Self>> {
        if !super::lifecycle::supports_graphs(device) {
            return None;
        }
        let values: Vec<f32> = words(seed, 0).iter().map(|w| f32::from_bits(*w)).collect();
        // F32 whatever the device's default float dtype: the draw kernel reads the four words
        // bit for bit, which a conversion would destroy.
        let tensor = Tensor::<1>::from_data(
            TensorData::new(values, [4]),
            TensorCreationOptions::new(device.clone()).with_dtype(DType::F32),
        );
        let state = Arc::new(Self {
            tensor,
            device: device.clone(),
        });
        let mut live = lock(&LIVE);
        live.retain(|weak| weak.strong_count() > 0);
        live.push(Arc::downgrade(&state));
        Some(state)
    }

    /// One draw of kind `draw` with parameters `a`, `b`, shaped like `like` (on the state's
    /// device, without autodiff), in f32; advances the counter on the device.
    pub(crate) fn draw<const D: usize>(
        self: &Arc<Self>,
        like: Tensor<D>,
        draw: Draw,
        a: f32,
        b: f32,
    ) -> Tensor<D> {
        touch(self);
        Tensor::<D>::from_dispatch(<burn::backend::Dispatch as GraphRandomOps>::draw(
            &self.tensor.clone().into_dispatch(),
            &like.into_dispatch(),
            draw,
            a,
            b,
        ))
    }
}

// Which generators the capturing thread drew from since the outermost save (see
// `SavedStates`): a capture restores only those, so that draws other threads make from their
// own generators while a capture runs are not undone.
thread_local! {
    static TOUCHED: std::cell::RefCell<Option<Vec<Weak<RandomState>>>> =
        const { std::cell::RefCell::new(None) };
}

/// Notes that this thread drew from `state` (when a save is open on this thread).
fn touch(state: &Arc<RandomState>) {
    TOUCHED.with(|touched| {
        if let Some(touched) = touched.borrow_mut().as_mut()
            && !touched
                .iter()
                .any(|t| std::ptr::eq(t.as_ptr(), Arc::as_ptr(state)))
        {
            touched.push(Arc::downgrade(state));
        }
    });
}

/// Whether this thread drew from `state` since the outermost open save.
fn touched(state: &Arc<RandomState>) -> bool {
    TOUCHED.with(|touched| {
        touched.borrow().as_ref().is_some_and(|touched| {
            touched
                .iter()
                .any(|t| std::ptr::eq(t.as_ptr(), Arc::as_ptr(state)))
        })
    })
}

/// The device states of the live generators, copied by [`save`], for [`restore`].
///
/// The outermost save on a thread starts recording which generators the thread draws from
/// (graph replays draw from the generators their recording drew from, on this thread too);
/// dropping it stops the recording. Nested saves (replay validation inside a capture) see
/// the same record.
pub(crate) struct SavedStates {
    states: Vec<(Arc<RandomState>, Tensor<1>)>,
    outermost: bool,
}

impl Drop for SavedStates {
    fn drop(&mut self) {
        if self.outermost {
            TOUCHED.with(|touched| *touched.borrow_mut() = None);
        }
    }
}

/// Copies the device states of every live generator (a 16-byte copy each), for [`restore`].
pub(crate) fn save() -> SavedStates {
    let outermost = TOUCHED.with(|touched| {
        let mut touched = touched.borrow_mut();
        let outermost = touched.is_none();
        if outermost {
            *touched = Some(Vec::new());
        }
        outermost
    });
    let live = lock(&LIVE);
    let states = live
        .iter()
        .filter_map(Weak::upgrade)
        // A buffer copy, not `state * 1.0`: the words are integers, whose f32 bit patterns
        // include NaNs that arithmetic may change.
        .filter_map(|state| {
            super::super::copy_op::copy_tensor(&state.tensor).map(|copy| (state.clone(), copy))
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
pub(crate) fn restore(saved: &SavedStates) -> Result<(), burn::backend::ExecutionError> {
    let mut queued = Vec::with_capacity(saved.states.len());
    let mut device = None;
    for (state, copy) in saved.states.iter().filter(|(state, _)| touched(state)) {
        queued.extend(super::super::copy_op::copy_tensor_into(&state.tensor, copy));
        device = Some(&state.device);
    }
    if let Some(device) = device {
        device.sync()?;
    }
    drop(queued);
    Ok(())
}
