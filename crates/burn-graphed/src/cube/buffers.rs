//! Static buffers: the device memory a captured graph reads and writes, with the identity
//! checks and copies that refresh it between replays.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::backend::ir::TensorId;
use burn::backend::{BackendTypes, Cube, DispatchTensor, TensorMetadata};
use burn::tensor::Tensor;
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;

use super::copy_op::{BufferKey, copy_into, key_of};
use super::dense::copy_values;
use crate::error::{CapturePhase, GraphedError};
use crate::tensors::with_kind;

/// A tensor of burn's cubecl backend as user code holds it (a fusion handle).
pub(crate) type FusedTensor = <Cube as BackendTypes>::FloatTensorPrimitive;

/// The fusion handle of a tensor of burn's cubecl backend (float, int or bool: fusion's handles
/// are one type for all three), without its autodiff node.
pub(crate) fn fused(tensor: &DispatchTensor) -> Option<FusedTensor> {
    with_kind!(tensor.dtype(), K => Tensor::<1, K>::from_dispatch(tensor.clone())
        .inner()
        .try_into_primitive::<Cube>()
        .ok())
}

/// The cube tensor behind a fusion handle of any kind: runs what the handle's fusion stream
/// has queued (a round trip to the fusion server).
pub(super) fn resolve(fused: &FusedTensor) -> CubeTensor {
    fused
        .client
        .resolve_tensor_float::<CubeBackend>(fused.clone())
}

/// The device memory behind a fusion handle of any kind: its buffer's identity and byte range
/// (see [`resolve`]).
pub(crate) fn memory_of(fused: &FusedTensor) -> BufferKey {
    key_of(&resolve(fused))
}

/// The dimensions of a fusion handle's tensor in memory order
/// ([`memory_order_of`](super::dense::memory_order_of)). Resolves the handle ([`resolve`]).
pub(crate) fn memory_order(fused: &FusedTensor) -> Vec<usize> {
    super::dense::memory_order_of(resolve(fused).meta.strides())
}

/// Whether the device wrote `tensor`'s bytes, after running the work queued on its fusion
/// stream: cubecl's answer for enqueue-time failures (a launch skipped because it read a buffer
/// an earlier failure left unwritten, whose outputs inherit that failure), with its account
/// when not. `Ok` for a tensor that is not on burn's cubecl backend.
pub(crate) fn check_written(tensor: &DispatchTensor) -> Result<(), String> {
    let Some(fused) = fused(tensor) else {
        return Ok(());
    };
    let cube = resolve(&fused);
    cube.client
        .check([&cube.handle])
        .map_err(|error| error.to_string())
}

/// Whether two buffer ranges share bytes.
pub(crate) fn overlaps(a: BufferKey, b: BufferKey) -> bool {
    a.0 == b.0 && a.1 < b.2 && b.1 < a.2
}

/// `fused` as a dispatch tensor of its elements' kind, on the device without autodiff.
pub(crate) fn dispatch_of(fused: FusedTensor) -> DispatchTensor {
    with_kind!(fused.dtype(), K => Tensor::<1, K>::from_primitive::<Cube>(fused).into_dispatch())
}

/// `tensor` (of any kind) without its autodiff association.
pub(crate) fn without_autodiff(tensor: &DispatchTensor) -> DispatchTensor {
    with_kind!(tensor.dtype(), K => Tensor::<1, K>::from_dispatch(tensor.clone())
        .inner()
        .into_dispatch())
}

/// `tensor` (of any kind) with autodiff enabled; a float tensor is not made to require grad.
pub(crate) fn with_autodiff(tensor: &DispatchTensor) -> DispatchTensor {
    with_kind!(tensor.dtype(), K => Tensor::<1, K>::from_dispatch(tensor.clone())
        .autodiff()
        .into_dispatch())
}

/// [`fused`], or the capture error of `phase` saying that a static tensor is not on burn's
/// cubecl backend.
pub(crate) fn static_fused(
    tensor: &DispatchTensor,
    phase: CapturePhase,
) -> Result<FusedTensor, GraphedError> {
    fused(tensor).ok_or_else(|| GraphedError::Capture {
        phase,
        reason: "a static tensor is not on burn's cubecl backend".into(),
    })
}

/// The buffers that the last work writing them outside the graphs left unwritten, with the
/// backend's reason: a copy whose source carried an earlier device failure (cubecl skipped the
/// copy), or a fused optimizer's in-place update that read such a gradient. Filled at execution
/// time by the question a replay asks first (`write_check`, [`note_checked`]), on cubecl's
/// device thread, and read there by the same task before it replays
/// ([`StaticBuffer::unwritten_reason`]). An entry stays until a later check finds the buffer
/// written (after the next copy into it or update of it), a graph writes the buffer, or the
/// buffer is dropped, so every replay over the buffer meanwhile is refused. One record serves
/// every device: cubecl numbers memory from one process-wide counter (`ManagedMemoryId`), so
/// keys never collide across devices.
static UNWRITTEN: Mutex<Option<HashMap<BufferKey, String>>> = Mutex::new(None);

/// Records cubecl's answer for the buffer `key`: `Err` with the backend's reason when the
/// buffer holds no values.
pub(crate) fn note_checked(key: BufferKey, outcome: Result<(), String>) {
    let mut unwritten = crate::sync::lock(&UNWRITTEN);
    match outcome {
        Ok(()) => {
            if let Some(map) = unwritten.as_mut() {
                map.remove(&key);
            }
        }
        Err(reason) => {
            unwritten
                .get_or_insert_with(HashMap::new)
                .insert(key, reason);
        }
    }
}

/// Whether some buffer is recorded as unwritten: one lock, so that a replay with nothing
/// recorded asks no buffer.
pub(crate) fn any_unwritten() -> bool {
    crate::sync::lock(&UNWRITTEN)
        .as_ref()
        .is_some_and(|map| !map.is_empty())
}

/// A copy into a static buffer that bypasses fusion: its source resolved to the cube tensor
/// on the caller's thread, launched on cubecl's device thread by the replay's own task
/// ([`write_check`](super::graph::write_check)), on the caller's stream and before the question and
/// the replay. A fusion operation would cost fusion's planning of one more operation per copy
/// and call.
pub(crate) struct DirectCopy<'a> {
    source: CubeTensor,
    /// The source's id, which the buffer records once the copy is launched.
    id: TensorId,
    into: &'a StaticBuffer,
}

impl<'a> DirectCopy<'a> {
    /// The buffer the copy writes.
    pub fn target(&self) -> &'a StaticBuffer {
        self.into
    }

    /// The client of the device the copy runs on.
    pub fn client(&self) -> &cubecl::client::Client {
        &self.source.client
    }

    /// Launches the copy (nothing when the source is the buffer's own memory; a driver copy
    /// where [`driver_copy`](super::driver_copy) takes it, cubecl's copy kernel otherwise),
    /// then records that the buffer holds the source: a copy that never ran is never taken for
    /// done. Runs where cubecl launches inline: inside `ComputeClient::exclusive`. Returns
    /// whether it was a driver copy.
    pub fn launch(&self) -> bool {
        let mut driver = false;
        if key_of(&self.source) != self.into.key {
            driver = super::driver_copy::copy(&self.source, &self.into.cube);
            if !driver {
                copy_values(&self.source, &self.into.cube);
            }
        }
        *self.into.contents() = Some(self.id);
        driver
    }
}

/// A buffer that a graph reads or writes. Holding the fusion handle keeps the buffer alive for
/// as long as the graph lives and keeps fusion from reusing it in place for another tensor.
///
/// In a group of callables one buffer can serve two graphs (an output of one callable is the
/// input of the next; the input gradient of the next is the output gradient of the first): it is
/// then shared through an `Arc`, and `contents` is the one record of what it holds.
#[derive(Debug)]
pub(crate) struct StaticBuffer {
    /// The fusion handle, given to burn ops and to user code.
    pub fused: FusedTensor,
    /// The same buffer as a cube tensor, for the question a replay asks cubecl first
    /// (`write_check`) on the device thread, where fusion's handles cannot be looked up. Its
    /// handle is one more holder of the buffer, which nothing here writes in place on the
    /// strength of being the only one.
    pub cube: CubeTensor,
    /// The device buffer's identity, fixed for the buffer's life (the graphs hold it).
    key: BufferKey,
    /// The tensor whose values the buffer holds, when known: the tensor last copied in, or the
    /// copy handed out after a graph wrote the buffer. burn tensors never change value (an
    /// in-place kernel only reuses the buffer of a tensor nobody holds anymore, under a new
    /// id), so the same id again means the same contents, already here.
    contents: Mutex<Option<TensorId>>,
    /// A clone of the tensor over this very buffer that [`FusedAdam`](crate::FusedAdam) handed
    /// out as a module parameter after updating the buffer in place. Kept to learn whether user
    /// code still holds that tensor (a clone of the module): then the buffer may not be written,
    /// because that tensor would change value.
    handed_out: Mutex<Option<FusedTensor>>,
    /// Whether a fused optimizer updated the buffer in place since the last forward replay
    /// asked cubecl about it ([`take_in_place_update`](Self::take_in_place_update)).
    updated_in_place: AtomicBool,
}

impl Drop for StaticBuffer {
    /// Forgets what [`UNWRITTEN`] holds for this buffer: its memory goes back to the pool.
    fn drop(&mut self) {
        if let Some(map) = crate::sync::lock(&UNWRITTEN).as_mut() {
            map.remove(&self.key);
        }
    }
}

impl StaticBuffer {
    /// Wraps `fused` (one round trip to the fusion server, which drains the tensor's stream,
    /// for the buffer's cube tensor and identity).
    pub fn new(fused: FusedTensor) -> Self {
        let cube = resolve(&fused);
        Self {
            key: key_of(&cube),
            cube,
            fused,
            contents: Mutex::new(None),
            handed_out: Mutex::new(None),
            updated_in_place: AtomicBool::new(false),
        }
    }

    /// The device buffer's identity.
    pub fn key(&self) -> BufferKey {
        self.key
    }

    fn contents(&self) -> std::sync::MutexGuard<'_, Option<TensorId>> {
        crate::sync::lock(&self.contents)
    }

    /// Bytes of the tensor's elements (the pool may pad the allocation; that is not counted,
    /// so the figure is the same on every backend).
    pub fn bytes(&self) -> u64 {
        let elements: usize = self.fused.shape().iter().product();
        (elements * self.fused.dtype().size()) as u64
    }

    /// Whether `source`'s values still have to be copied in: it is neither this buffer nor the
    /// tensor whose values the buffer holds.
    pub fn needs_copy(&self, source: &FusedTensor) -> bool {
        source.id != self.fused.id && *self.contents() != Some(source.id)
    }

    /// `source` as a cube tensor, to be copied into this buffer on cubecl's device thread right
    /// before a replay ([`DirectCopy`]), unless [`needs_copy`](Self::needs_copy) says the values
    /// are here; the buffer records that it holds `source` when the copy is launched. Resolving
    /// `source` runs what its fusion stream has queued (a round trip to the fusion server).
    pub fn direct_copy_from(&self, source: &FusedTensor) -> Option<DirectCopy<'_>> {
        if !self.needs_copy(source) {
            return None;
        }
        Some(DirectCopy {
            source: resolve(source),
            id: source.id,
            into: self,
        })
    }

    /// Queues a copy of `source` into this buffer unless [`needs_copy`](Self::needs_copy) says
    /// the values are here; returns the queued operation's output, which must be kept alive
    /// until the stream drained (fusion skips work whose results nobody holds).
    pub fn write_from(&self, source: &FusedTensor) -> Option<FusedTensor> {
        if !self.needs_copy(source) {
            return None;
        }
        *self.contents() = Some(source.id);
        Some(copy_into(&self.fused, source))
    }

    /// Queues a copy of `source` into this buffer, which then holds no known source tensor.
    pub fn overwrite_from(&self, source: &FusedTensor) -> FusedTensor {
        *self.contents() = None;
        copy_into(&self.fused, source)
    }

    /// The backend's reason when the last copy into this buffer, or the last in-place optimizer
    /// update of it, left it unwritten (its source or gradient carried an earlier device
    /// failure); `None` when that work wrote it. Ask only after the work ran (a replay drains
    /// the stream first). The answer stays until a copy into the buffer or an update of it
    /// succeeds: passing the same unwritten tensor again copies nothing (the buffer is noted
    /// to hold it) and is refused again.
    pub fn unwritten_reason(&self) -> Option<String> {
        crate::sync::lock(&UNWRITTEN)
            .as_ref()
            .and_then(|map| map.get(&self.key).cloned())
    }

    /// Whether the buffer holds the values of the tensor with id `id`.
    pub fn holds(&self, id: TensorId) -> bool {
        *self.contents() == Some(id) || self.fused.id == id
    }

    /// Whether the buffer may be written: no tensor over it that user code still holds. Forgets
    /// the handed-out tensor (see [`hand_over`](Self::hand_over)) once only this record holds
    /// it.
    pub fn release_alias(&self) -> bool {
        let mut handed_out = crate::sync::lock(&self.handed_out);
        match &*handed_out {
            None => true,
            // Fusion's own test for an in-place write: nobody else holds the tensor.
            Some(tensor) if tensor.can_mut() => {
                *handed_out = None;
                true
            }
            Some(_) => false,
        }
    }

    /// Records that `tensor`, a tensor over this buffer just written in place, is handed to
    /// user code: the buffer holds its values, and may not be written again while user code
    /// holds it ([`release_alias`](Self::release_alias)).
    pub fn hand_over(&self, tensor: &FusedTensor) {
        *self.contents() = Some(tensor.id);
        *crate::sync::lock(&self.handed_out) = Some(tensor.clone());
        self.updated_in_place.store(true, Ordering::Relaxed);
    }

    /// Whether a fused optimizer updated the buffer in place since the last call of this
    /// (which forgets it): the forward replay then asks cubecl whether the update wrote it.
    pub fn take_in_place_update(&self) -> bool {
        self.updated_in_place.swap(false, Ordering::Relaxed)
    }

    /// Records that a graph just wrote the buffer and `handed_out` (a copy of it, or `None`)
    /// is the tensor that now has the same values.
    pub fn written_by_graph(&self, handed_out: Option<TensorId>) {
        *self.contents() = handed_out;
        // It holds values now, whatever an earlier copy into it left (a buffer that a group's
        // next callable reads, say).
        note_checked(self.key, Ok(()));
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod collective_tests {
    use burn::tensor::{Device, Tensor, TensorData};

    use super::super::copy_op::collective_buffer;
    use super::{fused, memory_of};

    /// The collective's buffer holds the bucket's values, in memory of its own that spans the
    /// bucket's elements exactly, whether the bucket is a buffer of its own or a view into a
    /// larger one (a replayed half's bucket and an eager one are made differently). wgpu
    /// allocates densely, so the padded buffers of CUDA are checked only end to end, by the GPU
    /// suite's `data_parallel_whole_steps_capture_new_shapes_together`.
    #[test]
    fn collective_buffer_is_a_dense_copy_of_its_own() {
        let device = Device::wgpu(Default::default());
        let values: Vec<f32> = (0..37).map(|i| i as f32 * 0.5).collect();
        let larger: Vec<f32> = (0..100).map(|i| i as f32).collect();
        let own = Tensor::<1>::from_data(TensorData::new(values.clone(), [37]), &device);
        let view = Tensor::<1>::from_data(TensorData::new(larger, [100]), &device).narrow(0, 3, 37);
        for bucket in [own, view] {
            let source = memory_of(&fused(&bucket.clone().into_dispatch()).expect("cube"));
            let expected = bucket.to_data();
            let copy = collective_buffer(bucket);
            let memory = memory_of(&fused(&copy.clone().into_dispatch()).expect("cube"));
            assert_ne!(memory.0, source.0, "a buffer of its own");
            assert_eq!(memory.2 - memory.1, 37 * 4, "the bucket's bytes exactly");
            copy.to_data().assert_eq(&expected, true);
        }
    }
}
