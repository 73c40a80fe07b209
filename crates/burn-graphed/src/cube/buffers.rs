//! Static buffers: the device memory a captured graph reads and writes, with the identity
//! checks and copies that refresh it between replays.

use std::collections::HashMap;
use std::sync::Mutex;

use burn::backend::ir::TensorId;
use burn::backend::{BackendTypes, Cube};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;

use super::copy_op::StaticCopyOps;

/// A tensor of burn's cubecl backend as user code holds it (a fusion handle).
pub(crate) type FusedTensor = <Cube as BackendTypes>::FloatTensorPrimitive;

/// Identity of a device buffer: allocation id and byte range. Two tensors with the same key
/// are the same memory (PyTorch's `data_ptr` comparison).
pub(crate) type BufferKey = (usize, u64, u64);

/// The identity of the buffer behind a cube tensor.
pub(crate) fn key_of(tensor: &CubeTensor) -> BufferKey {
    let (id, start, end) = tensor.handle.clone().binding().claim_key();
    (id.value, start, end)
}

/// The buffer behind a fusion tensor: drains the tensor's stream and asks the fusion server
/// (one round trip; capture time only).
fn key_of_fused(tensor: &FusedTensor) -> BufferKey {
    key_of(
        &tensor
            .client
            .resolve_tensor_float::<CubeBackend>(tensor.clone()),
    )
}

/// The buffers whose last copy left them unwritten, with the backend's reason: the copy's
/// source carried an earlier device failure, so cubecl skipped the copy. Filled at execution
/// time by the copy operation ([`note_copy`]), on the thread that drains the stream, and read
/// by the session right after a replay, whose drain ran the copies
/// ([`StaticBuffer::copy_failure`]). cubecl's graph replay does not look at what the graph
/// reads, so without this a replay would run on the buffer's stale values and mark its outputs
/// written: readable, and wrong. One record serves every device: cubecl numbers memory from
/// one process-wide counter (`ManagedMemoryId`), so keys never collide across devices.
static UNWRITTEN: Mutex<Option<HashMap<BufferKey, String>>> = Mutex::new(None);

/// Records how the copy into the buffer `key` ended: `Err` with the backend's reason when the
/// buffer holds no values after it.
pub(crate) fn note_copy(key: BufferKey, outcome: Result<(), String>) {
    let mut unwritten = crate::lock(&UNWRITTEN);
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
}

impl StaticBuffer {
    /// Wraps `fused` (one round trip to the fusion server, for the buffer's identity).
    pub fn new(fused: FusedTensor) -> Self {
        Self {
            key: key_of_fused(&fused),
            fused,
            contents: Mutex::new(None),
            handed_out: Mutex::new(None),
        }
    }

    fn contents(&self) -> std::sync::MutexGuard<'_, Option<TensorId>> {
        crate::lock(&self.contents)
    }

    /// Bytes of the tensor's elements (the pool may pad the allocation; that is not counted,
    /// so the figure is the same on every backend).
    pub fn bytes(&self) -> u64 {
        use burn::backend::TensorMetadata;
        let elements: usize = self.fused.shape().iter().product();
        (elements * self.fused.dtype().size()) as u64
    }

    /// Whether `source`'s values still have to be copied in: it is neither this buffer nor the
    /// tensor whose values the buffer holds.
    pub fn needs_copy(&self, source: &FusedTensor) -> bool {
        source.id != self.fused.id && *self.contents() != Some(source.id)
    }

    /// Queues a copy of `source` into this buffer unless [`needs_copy`](Self::needs_copy) says
    /// the values are here; returns the queued operation's output, which must be kept alive
    /// until the stream drained (fusion skips work whose results nobody holds).
    pub fn write_from(&self, source: &FusedTensor) -> Option<FusedTensor> {
        if !self.needs_copy(source) {
            return None;
        }
        *self.contents() = Some(source.id);
        Some(<Cube as StaticCopyOps>::copy_into_buffer(
            &self.fused,
            source,
        ))
    }

    /// Queues a copy of `source` into this buffer, which then holds no known source tensor.
    pub fn overwrite_from(&self, source: &FusedTensor) -> FusedTensor {
        *self.contents() = None;
        <Cube as StaticCopyOps>::copy_into_buffer(&self.fused, source)
    }

    /// The backend's reason when the last copy into this buffer left it unwritten (its source
    /// carried an earlier device failure); `None` when the copy wrote it. Ask only after the
    /// copy ran (a replay drains the stream first). The buffer then holds no known tensor, so
    /// that the same source passed again is copied, and checked, again.
    pub fn copy_failure(&self) -> Option<String> {
        let reason = crate::lock(&UNWRITTEN)
            .as_mut()
            .and_then(|map| map.remove(&self.key));
        if reason.is_some() {
            *self.contents() = None;
        }
        reason
    }

    /// Whether the buffer holds the values of the tensor with id `id`.
    pub fn holds(&self, id: TensorId) -> bool {
        *self.contents() == Some(id) || self.fused.id == id
    }

    /// Whether the buffer may be written: no tensor over it that user code still holds. Forgets
    /// the handed-out tensor (see [`hand_over`](Self::hand_over)) once only this record holds
    /// it.
    pub fn release_alias(&self) -> bool {
        use burn::backend::TensorMetadata;
        let mut handed_out = crate::lock(&self.handed_out);
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
        *crate::lock(&self.handed_out) = Some(tensor.clone());
    }

    /// Records that a graph just wrote the buffer and `handed_out` (a copy of it, or `None`)
    /// is the tensor that now has the same values.
    pub fn written_by_graph(&self, handed_out: Option<TensorId>) {
        *self.contents() = handed_out;
    }
}
