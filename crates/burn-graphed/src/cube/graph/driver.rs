//! The capture driver: the one way the engine captures a graph. A group's forwards and
//! backwards (`capture.rs`), an inference forward (`capture.rs`) and a whole training step or
//! its two data-parallel halves (`step_graph.rs`) are recipes written with these stages only,
//! in this order:
//!
//! 1. **enter** ([`under_lock`]): the progress reports, the device's capture lock, the device
//!    generators saved;
//! 2. **static buffers** ([`Pools::start`] first, then [`static_inputs`], [`dense_param_copy`],
//!    [`ordered_param_copy`]): copies that only the graphs will read;
//! 3. per graph, **prepare and warm up** ([`warm_up`]: eager runs until one leaves the
//!    device's allocations as the previous did), **record** ([`Warmed::record`]: the recording,
//!    stopped and run once, [`lifecycle::materialize`](super::lifecycle::materialize));
//! 4. **validate** (`validate.rs`): the first replay against an eager run;
//! 5. **release** ([`Pools::release`]): the pools' growth, the warm-ups' pages given back;
//! 6. **exit** ([`under_lock`] again): the generators (and what the recipe saved) put back; after
//!    a failure, the launch metadata the failed recording cached and never ran forgotten.
//!
//! Each stage leaves the device usable when it fails: the guards of `lifecycle.rs` take the
//! stream out of capture mode, and the exit puts back what the warm-ups changed.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use burn::backend::ops::FloatTensorOps;
use burn::backend::{
    AutodiffBackend, Backend, Cube, Dispatch, DispatchDevice, DispatchTensor, TensorMetadata,
};
use burn::tensor::Tensor;

use super::super::buffers::{dispatch_of, memory_order, static_fused, with_autodiff};
use super::super::copy_op::copy_to_new;
use super::lifecycle::{
    Preparation, RecordedGraph, capture_error, forget_unrun_metadata, materialize,
};
use super::progress::CaptureProgress;
use super::random_state::{self, SavedStates};
use crate::config::GraphedConfig;
use crate::error::{CapturePhase, GraphedError};
use crate::sync::lock;
use crate::tensors::{ElementKind, FlatTensor};

/// The device of burn's cubecl backend, without autodiff.
pub(in crate::cube) type CubeDevice = <Cube as burn::backend::BackendTypes>::Device;

/// One capture at a time per device: cubecl's device thread issues a CUDA device's launches and
/// allocations, and two recordings there would forbid each other's calls. CUDA records in
/// thread-local mode ([`capture_mode`]), so CUDA devices record at once, as the thread ranks of
/// a data-parallel group with the all-reduce inside the graph must (their warm-ups meet at
/// each all-reduce); every other device shares one lock (key `None`), as every device does
/// under the global mode of a test's control.
static CAPTURE_LOCKS: Mutex<Vec<CaptureLock>> = Mutex::new(Vec::new());

/// A device's capture lock in [`CAPTURE_LOCKS`], under its key ([`capture_mode`]).
type CaptureLock = (Option<DispatchDevice>, Arc<Mutex<()>>);

/// Recordings begin in CUDA's global capture mode instead of thread-local (a test's control).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
static GLOBAL_MODE: AtomicBool = AtomicBool::new(false);

/// Makes CUDA recordings begin in global capture mode (`true`) or thread-local (`false`, the
/// default): a test's control, to show that a raw CUDA call of another thread then invalidates
/// a recording.
#[cfg(feature = "testing")]
pub(crate) fn set_global_mode(on: bool) {
    GLOBAL_MODE.store(on, std::sync::atomic::Ordering::SeqCst);
}

/// The capture mode for recordings on `dispatch` from now on, and the key of its capture lock.
fn capture_mode(dispatch: &DispatchDevice) -> Option<DispatchDevice> {
    #[cfg(feature = "cuda")]
    if let DispatchDevice::Cube(cubecl::Device::Cuda(_)) = dispatch {
        use cubecl_cuda::capture_mode::{CaptureMode, set};
        if GLOBAL_MODE.load(std::sync::atomic::Ordering::SeqCst) {
            set(CaptureMode::Global);
            return None;
        }
        set(CaptureMode::ThreadLocal);
        return Some(dispatch.clone());
    }
    let _ = dispatch;
    None
}

/// The capture lock of `key` ([`CAPTURE_LOCKS`]).
fn capture_lock(key: Option<DispatchDevice>) -> Arc<Mutex<()>> {
    let mut locks = lock(&CAPTURE_LOCKS);
    if let Some((_, found)) = locks.iter().find(|(k, _)| *k == key) {
        return found.clone();
    }
    let made = Arc::new(Mutex::new(()));
    locks.push((key, made.clone()));
    made
}

/// Stages 1 and 6: runs `capture` holding the device's capture lock, with progress reports headed
/// `what`, and puts the device generators back as they were before it (warm-ups, recordings
/// and checks draw from them too: capturing consumes no randomness, so a graphed model and an
/// eager copy seeded alike draw the same masks). `capture` receives the saved generators, for
/// a recipe whose warm-ups must each start from them. After a failure, the kernel metadata the
/// failed recording cached and never ran is forgotten.
///
/// # Errors
///
/// `capture`'s error; a capture error when the generators could not be put back.
pub(in crate::cube) fn under_lock<T>(
    dispatch: &DispatchDevice,
    what: impl Into<String>,
    capture: impl FnOnce(&SavedStates) -> Result<T, GraphedError>,
) -> Result<T, GraphedError> {
    let _progress = CaptureProgress::start(what);
    let device_lock = capture_lock(capture_mode(dispatch));
    let _lock = lock(&device_lock);
    let generators = random_state::save();
    let captured = capture(&generators);
    let restored =
        random_state::restore(&generators).map_err(capture_error(CapturePhase::StaticBuffers));
    if captured.is_err() || restored.is_err() {
        forget_unrun_metadata(dispatch);
    }
    let captured = captured?;
    restored?;
    Ok(captured)
}

/// The cubecl device `first` (a sample input) lives on, without autodiff.
///
/// # Errors
///
/// [`GraphedError::Unsupported`] off burn's cubecl backend.
pub(in crate::cube) fn cube_device_of(
    first: &FlatTensor,
) -> Result<(DispatchDevice, CubeDevice), GraphedError> {
    let dispatch = first.device.clone().inner().as_dispatch().clone();
    match &dispatch {
        DispatchDevice::Cube(device) => {
            let device = device.clone();
            Ok((dispatch, device))
        }
        #[allow(unreachable_patterns)]
        other => Err(GraphedError::Unsupported {
            device: format!("{other:?}"),
        }),
    }
}

/// The device pools' reserved bytes when a capture began (stage 2).
pub(in crate::cube) struct Pools {
    before: u64,
}

/// What a capture did to the device pools ([`Pools::release`]).
pub(in crate::cube) struct PoolBytes {
    /// Reserved bytes the capture added, after the release.
    pub growth: u64,
    /// Reserved bytes the release gave back (the warm-ups' empty pages).
    pub released: u64,
}

impl Pools {
    /// Waits for the device and notes its reserved bytes.
    ///
    /// # Errors
    ///
    /// [`GraphedError::Capture`] of [`CapturePhase::StaticBuffers`] when the device fails.
    pub(in crate::cube) fn start(dispatch: &DispatchDevice) -> Result<Self, GraphedError> {
        Dispatch::sync(dispatch).map_err(capture_error(CapturePhase::StaticBuffers))?;
        Ok(Self {
            before: reserved_bytes(dispatch),
        })
    }

    /// Stage 5, once every recording has stopped and run ([`Warmed::record`]): waits for the
    /// device and, with `release_capture_memory`, frees the pools' empty pages. cubecl refuses
    /// a cleanup while recording, and one between a warm-up and its recording would make the
    /// recording allocate (and guard) fresh pages; now it frees only empty pages that no graph
    /// guards, and evicts only launch metadata that no graph pins (already uploaded).
    ///
    /// # Errors
    ///
    /// [`GraphedError::Capture`] of `phase` when the device fails.
    pub(in crate::cube) fn release(
        self,
        dispatch: &DispatchDevice,
        config: &GraphedConfig,
        phase: CapturePhase,
    ) -> Result<PoolBytes, GraphedError> {
        Dispatch::sync(dispatch).map_err(capture_error(phase))?;
        let captured = reserved_bytes(dispatch);
        if config.release_capture_memory {
            Dispatch::memory_cleanup(dispatch);
        }
        let after = reserved_bytes(dispatch);
        Ok(PoolBytes {
            growth: after.saturating_sub(self.before),
            released: captured.saturating_sub(after),
        })
    }
}

/// Reserved bytes of the device's pools (call after a sync).
fn reserved_bytes(dispatch: &DispatchDevice) -> u64 {
    Dispatch::memory_pool_usage(dispatch).map_or(0, |usage| usage.bytes_reserved)
}

/// A prepared device whose warm-ups have settled ([`warm_up`]), ready to record.
pub(in crate::cube) struct Warmed<'d> {
    dispatch: &'d DispatchDevice,
    prepared: Preparation<'d>,
}

/// Stage 3: prepares the device for a recording of `phase`'s graph (announcing `warmup`), then
/// runs `run` eagerly: at least `warmup_iters` times, then more until one run leaves the
/// device's live allocations as the previous one did, at most `max_warmup_iters` times. Each
/// run gives what the caller keeps (`K`, the last run's is returned) and what is held only
/// until the device synchronized (`H`: fusion skips work whose results nobody holds).
///
/// Why adaptive: every kernel launch reads its shapes and strides from a device buffer that
/// cubecl caches by content. A launch that first appears inside the recording (a kernel that
/// autotuning or fusion picks only on a later run) builds its buffer there. A run that creates
/// no new cached buffer is the sign that the next run, the recording, will not either. A run
/// must therefore cut its work as the recording will (sync where the recording ends), so that
/// fusion launches the same kernels.
///
/// # Errors
///
/// `run`'s error, or [`GraphedError::Capture`] of `warmup` when the device fails (the device
/// leaves the prepared state) or cubecl launches kernels in a way no graph records (its
/// profiling log on: nothing ran).
pub(in crate::cube) fn warm_up<'d, K, H>(
    dispatch: &'d DispatchDevice,
    config: &GraphedConfig,
    warmup: CapturePhase,
    mut run: impl FnMut() -> Result<(K, H), GraphedError>,
) -> Result<(Warmed<'d>, K), GraphedError> {
    super::lifecycle::launches_can_be_recorded().map_err(|reason| GraphedError::Capture {
        phase: warmup,
        reason,
    })?;
    let prepared = Preparation::new(dispatch, warmup)?;
    let sync = || Dispatch::sync(dispatch).map_err(capture_error(warmup));
    let iterations = config.max_warmup_iters.max(config.warmup_iters).max(1);
    let mut previous = None;
    let mut iteration = 0;
    loop {
        iteration += 1;
        let (keep, held) = run()?;
        sync()?;
        drop(held);
        sync()?;
        let allocations = Dispatch::memory_pool_usage(dispatch).map(|usage| usage.number_allocs);
        let settled = iteration >= config.warmup_iters.max(1)
            && allocations.is_some()
            && allocations == previous;
        if settled || iteration >= iterations {
            return Ok((Warmed { dispatch, prepared }, keep));
        }
        previous = allocations;
    }
}

impl Warmed<'_> {
    /// Stage 3, the recording: records `work` as `phase`'s graph, stops, and runs the graph
    /// once, waiting for it ([`materialize`]), before giving back `work`'s result and the
    /// graph. Whatever `work` returns is held until then. An error (or a panic) inside `work`
    /// ends the recording and is returned.
    ///
    /// # Errors
    ///
    /// `work`'s error, or [`GraphedError::Capture`] of `phase` when the recording, its stop or
    /// its first run fails.
    pub(in crate::cube) fn record<R>(
        self,
        phase: CapturePhase,
        work: impl FnOnce() -> Result<R, GraphedError>,
    ) -> Result<(R, RecordedGraph), GraphedError> {
        self.record_met(phase, work, |stopped| stopped)
    }

    /// [`record`](Self::record), with `stopped` told whether the recording and its stop
    /// succeeded before the graph's first run (the device out of capture mode either way):
    /// ranks whose graphs hold a collective agree there, so that none runs its graph while
    /// another's recording failed. Its error ends the capture.
    ///
    /// # Errors
    ///
    /// As [`record`](Self::record), and `stopped`'s.
    pub(in crate::cube) fn record_met<R>(
        self,
        phase: CapturePhase,
        work: impl FnOnce() -> Result<R, GraphedError>,
        stopped: impl FnOnce(Result<(), GraphedError>) -> Result<(), GraphedError>,
    ) -> Result<(R, RecordedGraph), GraphedError> {
        let recorded = self.prepared.record(phase).and_then(|recording| {
            // An error inside `work` drops the recording, which ends it.
            let result = work()?;
            Ok((result, recording.stop(phase)?))
        });
        stopped(recorded.as_ref().map(|_| ()).map_err(Clone::clone))?;
        let (result, (graph, contents)) = recorded?;
        materialize(self.dispatch, &graph, phase)?;
        Ok((result, (graph, contents)))
    }
}

/// How a graph's code receives its static inputs ([`static_inputs`]).
#[derive(Clone, Copy)]
pub(in crate::cube) enum InputView {
    /// Autodiff leaves that require grad where the sample did (a graphed callable's forward).
    Sampled,
    /// Autodiff leaves that never require grad (a whole step's batch).
    Constant,
    /// The static tensors themselves, without autodiff (an inference forward).
    Plain,
}

/// Stage 2: a static copy of each of `sample`'s tensors (on the device without autodiff) and
/// the view the graph's code receives of it ([`InputView`]).
///
/// # Errors
///
/// As [`fresh_copy`].
pub(in crate::cube) fn static_inputs(
    sample: &[FlatTensor],
    view: InputView,
) -> Result<(Vec<DispatchTensor>, Vec<FlatTensor>), GraphedError> {
    let statics = sample
        .iter()
        .map(|t| fresh_copy(&t.tensor, CapturePhase::StaticBuffers))
        .collect::<Result<Vec<_>, _>>()?;
    let views = sample
        .iter()
        .zip(&statics)
        .map(|(input, tensor)| match view {
            InputView::Sampled => FlatTensor {
                tensor: autodiff_leaf(tensor, input.require_grad),
                ..input.clone()
            },
            InputView::Constant => FlatTensor {
                tensor: autodiff_leaf(tensor, false),
                require_grad: false,
                ..input.clone()
            },
            InputView::Plain => FlatTensor {
                tensor: tensor.clone(),
                require_grad: false,
                ..input.clone()
            },
        })
        .collect();
    Ok((statics, views))
}

/// A copy of `tensor` (of any kind) in a buffer of its own, on the device without autodiff.
/// Errors like [`static_fused`] for an int or bool tensor that is not on burn's cubecl backend.
fn fresh_copy(
    tensor: &DispatchTensor,
    phase: CapturePhase,
) -> Result<DispatchTensor, GraphedError> {
    if ElementKind::of(tensor.dtype()) == ElementKind::Float {
        // `Tensor::inner` is idempotent; `Dispatch::inner` panics on a tensor without autodiff.
        let inner = Tensor::<1>::from_dispatch(tensor.clone())
            .inner()
            .into_dispatch();
        return Ok(Dispatch::float_mul_scalar(inner, 1.0f32.into()));
    }
    let source = static_fused(tensor, phase)?;
    Ok(dispatch_of(copy_to_new(&source)))
}

/// An autodiff view of `tensor` (on the device without autodiff), a leaf that requires grad
/// when `require_grad` (float tensors only: int and bool tensors never do).
pub(in crate::cube) fn autodiff_leaf(
    tensor: &DispatchTensor,
    require_grad: bool,
) -> DispatchTensor {
    if ElementKind::of(tensor.dtype()) != ElementKind::Float {
        return with_autodiff(tensor);
    }
    let leaf = Dispatch::from_inner(tensor.clone());
    if require_grad {
        Dispatch::float_set_require_grad(leaf, true)
    } else {
        leaf
    }
}

/// Stage 2: a copy of a parameter in a dense buffer of its own (rows not pitched), on the
/// device without autodiff: a training graph's parameter buffer. The Adam kernels bind dense
/// buffers only, so a pitched parameter buffer (cubecl's layout of new tensors on CUDA) would
/// cost every in-place update a dense copy and a copy back (`dense::Target`). Errors like
/// [`static_fused`].
pub(in crate::cube) fn dense_param_copy(
    tensor: &DispatchTensor,
) -> Result<DispatchTensor, GraphedError> {
    let fused = static_fused(tensor, CapturePhase::StaticBuffers)?;
    let copy = <Cube as super::super::copy_op::StaticCopyOps>::copy_to_new_dense_buffer(&fused);
    Ok(Tensor::<1>::from_primitive::<Cube>(copy).into_dispatch())
}

/// Stage 2: a copy of a float parameter for an inference graph: dense as
/// [`dense_param_copy`]'s, laid out in the parameter's memory order (an int or bool parameter:
/// [`dense_param_copy`]). A weight stored transposed (burn's `LinearLayout::Col`, as PyTorch
/// stores a linear weight) stays a transposed view, so the graph's kernels see a column-major
/// matrix, as an eager call's do: the graph runs the kernels (the autotune keys) eager code
/// runs on this model. Inference graphs only: the optimizers' kernels bind row-major buffers.
/// Errors like [`static_fused`].
pub(in crate::cube) fn ordered_param_copy(
    tensor: &DispatchTensor,
) -> Result<DispatchTensor, GraphedError> {
    if ElementKind::of(tensor.dtype()) != ElementKind::Float {
        return dense_param_copy(tensor);
    }
    let fused = static_fused(tensor, CapturePhase::StaticBuffers)?;
    let order = memory_order(&fused);
    if super::super::dense::is_identity(&order) {
        return dense_param_copy(tensor);
    }
    let inner = Tensor::<1>::from_dispatch(tensor.clone())
        .inner()
        .into_dispatch();
    // In memory order the view is row-major: its dense copy holds the values in the same order.
    let copy = dense_param_copy(&Dispatch::float_permute(inner, &order))?;
    let mut back = vec![0; order.len()];
    for (at, dim) in order.iter().enumerate() {
        back[*dim] = at;
    }
    Ok(Dispatch::float_permute(copy, &back))
}

/// The message of a caught panic, when it carries one.
pub(in crate::cube) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(no message)".into())
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use burn::tensor::{Device, Tensor, TensorData};

    use super::super::super::buffers::{fused, memory_of, memory_order, resolve};
    use super::super::super::dense::copy_values;
    use super::ordered_param_copy;

    fn counting<const D: usize>(shape: [usize; D], device: &Device) -> Tensor<D> {
        let len = shape.iter().product::<usize>();
        let values: Vec<f32> = (0..len).map(|i| i as f32).collect();
        Tensor::from_data(TensorData::new(values, shape), device)
    }

    /// An inference graph's copy of a parameter keeps its memory order in a buffer of its own:
    /// a transposed view (burn's `LinearLayout::Col`) stays transposed, a row-major tensor
    /// row-major, a rank-3 view in a cyclic order keeps that order (its inverse is not itself),
    /// and each holds the parameter's values.
    #[test]
    fn ordered_param_copy_keeps_the_memory_order() {
        let device = Device::wgpu(Default::default());
        let matrix = counting([3, 4], &device);
        let cube = counting([2, 3, 4], &device);
        let cases: [(Tensor<3>, Vec<usize>); 3] = [
            (matrix.clone().transpose().unsqueeze(), vec![0, 2, 1]),
            (matrix.unsqueeze(), vec![0, 1, 2]),
            // Dimension 0 of the view is the stored last one, and so on: in memory order the
            // view's dimensions are [1, 2, 0].
            (cube.permute([2, 0, 1]), vec![1, 2, 0]),
        ];
        for (param, order) in cases {
            let dispatch = param.clone().into_dispatch();
            let source = memory_of(&fused(&dispatch).expect("cube"));
            let copy = ordered_param_copy(&dispatch).expect("copy");
            let copied = fused(&copy).expect("cube");
            assert_eq!(memory_order(&copied), order);
            assert_ne!(memory_of(&copied).0, source.0, "a buffer of its own");
            Tensor::<3>::from_dispatch(copy)
                .to_data()
                .assert_eq(&param.to_data(), true);
        }
    }

    /// A copy into a transposed buffer large enough that cubecl's copy packs several elements
    /// per unit (as every refresh of an inference graph's transposed weight is) puts each value
    /// in its place, from a transposed source and from a row-major one.
    #[test]
    fn copies_into_a_transposed_buffer_land_in_place() {
        let device = Device::wgpu(Default::default());
        let stored = counting([512, 512], &device);
        let destination = ordered_param_copy(&stored.clone().transpose().into_dispatch())
            .expect("a transposed buffer");
        let destination = fused(&destination).expect("cube");
        let destination_cube = resolve(&destination);
        let row_major = counting([512, 512], &device).mul_scalar(2.0);
        for source in [stored.clone().mul_scalar(3.0).transpose(), row_major] {
            let expected = source.to_data();
            let source_cube = resolve(&fused(&source.into_dispatch()).expect("cube"));
            copy_values(&source_cube, &destination_cube);
            Tensor::<2>::from_primitive::<burn::backend::Cube>(destination.clone())
                .to_data()
                .assert_eq(&expected, true);
        }
    }
}
