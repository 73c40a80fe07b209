//! Static buffers: the device memory a captured graph reads and writes, with the identity
//! checks and copies that refresh it between replays.

use std::sync::Mutex;

use burn::backend::ir::TensorId;
use burn::backend::{BackendTypes, Cube};
use burn_cubecl::{CubeBackend, tensor::CubeTensor};

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

/// A buffer that a graph reads or writes. Holding the resolved cube tensor keeps the buffer
/// alive for as long as the graph lives and keeps fusion from reusing it in place.
#[derive(Debug)]
pub(crate) struct StaticBuffer {
    /// The fusion handle, given to burn ops and to user code.
    pub fused: FusedTensor,
    /// The resolved tensor, used for copies.
    pub cube: CubeTensor,
    /// Its identity.
    pub key: BufferKey,
    /// The tensor last copied in. burn tensors never change value (an in-place kernel only
    /// reuses the buffer of a tensor nobody holds anymore, under a new id), so the same id
    /// again means the same contents, already here.
    last_source: Mutex<Option<TensorId>>,
}

impl StaticBuffer {
    /// Wraps `fused`, resolving it (executing its pending work).
    pub fn new(fused: FusedTensor) -> Self {
        let cube = resolve(&fused);
        let key = key_of(&cube);
        Self {
            fused,
            cube,
            key,
            last_source: Mutex::new(None),
        }
    }

    /// Bytes of the buffer.
    pub fn bytes(&self) -> u64 {
        self.key.2.saturating_sub(self.key.1)
    }

    /// Copies `source` into this buffer unless it is this buffer already; returns whether a
    /// copy was issued. Shapes and dtypes were checked by the caller.
    pub fn write_from(&self, source: &FusedTensor) -> bool {
        if source.id == self.fused.id {
            return false;
        }
        let mut last = self.last_source.lock().unwrap_or_else(|p| p.into_inner());
        if *last == Some(source.id) {
            return false;
        }
        let resolved = resolve(source);
        if key_of(&resolved) == self.key {
            return false;
        }
        self.copy_from_cube(resolved);
        *last = Some(source.id);
        true
    }

    /// Copies a resolved tensor into this buffer (which then holds no known source tensor).
    pub fn overwrite_from_cube(&self, source: CubeTensor) {
        *self.last_source.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.copy_from_cube(source);
    }

    fn copy_from_cube(&self, source: CubeTensor) {
        let source = burn_cubecl::kernel::untile(source);
        let dtype = burn::backend::cubecl::dtype_to_storage_type(self.cube.dtype);
        cubecl::std::tensor::copy_into(
            &self.cube.client,
            source.binding(),
            self.cube.clone().binding(),
            dtype,
        );
    }
}
