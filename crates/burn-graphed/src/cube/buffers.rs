//! Static buffers: the device memory a captured graph reads and writes, with the identity
//! checks and copies that refresh it between replays.

use std::sync::Mutex;

use burn::backend::ir::TensorId;
use burn::backend::{BackendTypes, Cube};
use burn_cubecl::{CubeBackend, tensor::CubeTensor};

use super::copy_op::StaticCopyOps;

/// A tensor of burn's cubecl backend as user code holds it (a fusion handle).
pub(crate) type FusedTensor = <Cube as BackendTypes>::FloatTensorPrimitive;

/// Identity of a device buffer: allocation id and byte range. Two tensors with the same key
/// are the same memory (PyTorch's `data_ptr` comparison).
pub(crate) type BufferKey = (usize, u64, u64);

/// The cube tensor behind a fusion handle. Drains the handle's stream (executing its pending
/// work) and leaves `tensor` untouched.
pub(crate) fn resolve(tensor: &FusedTensor) -> CubeTensor {
    let tensor = tensor.clone();
    let client = tensor.client.clone();
    client.resolve_tensor_float::<CubeBackend>(tensor)
}

/// The identity of the buffer behind a cube tensor.
pub(crate) fn key_of(tensor: &CubeTensor) -> BufferKey {
    let (id, start, end) = tensor.handle.clone().binding().claim_key();
    (id.value, start, end)
}

/// A buffer that a graph reads or writes. Holding the fusion handle keeps the buffer alive for
/// as long as the graph lives and keeps fusion from reusing it in place for another tensor.
#[derive(Debug)]
pub(crate) struct StaticBuffer {
    /// The fusion handle, given to burn ops and to user code.
    pub fused: FusedTensor,
    /// Its identity.
    pub key: BufferKey,
    /// The tensor last copied in. burn tensors never change value (an in-place kernel only
    /// reuses the buffer of a tensor nobody holds anymore, under a new id), so the same id
    /// again means the same contents, already here.
    last_source: Mutex<Option<TensorId>>,
}

impl StaticBuffer {
    /// Wraps `fused`, resolving it (executing its pending work) to learn its buffer.
    pub fn new(fused: FusedTensor) -> Self {
        let key = key_of(&resolve(&fused));
        Self {
            fused,
            key,
            last_source: Mutex::new(None),
        }
    }

    /// Bytes of the buffer.
    pub fn bytes(&self) -> u64 {
        self.key.2.saturating_sub(self.key.1)
    }

    /// Queues a copy of `source` into this buffer unless it is this buffer already or was
    /// the last tensor copied in; returns the queued operation's output, which must be kept
    /// alive until the stream drained (fusion skips work whose results nobody holds).
    pub fn write_from(&self, source: &FusedTensor) -> Option<FusedTensor> {
        if source.id == self.fused.id {
            return None;
        }
        let mut last = self.last_source.lock().unwrap_or_else(|p| p.into_inner());
        if *last == Some(source.id) {
            return None;
        }
        *last = Some(source.id);
        Some(<Cube as StaticCopyOps>::copy_into_buffer(
            &self.fused,
            source,
        ))
    }

    /// Queues a copy of `source` into this buffer, which then holds no known source tensor.
    pub fn overwrite_from(&self, source: &FusedTensor) -> FusedTensor {
        *self.last_source.lock().unwrap_or_else(|p| p.into_inner()) = None;
        <Cube as StaticCopyOps>::copy_into_buffer(&self.fused, source)
    }
}
