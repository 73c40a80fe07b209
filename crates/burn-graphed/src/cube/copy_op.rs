//! The device copy into a static buffer, as a lazy fusion operation: it is queued on the
//! caller's stream like any burn op and runs when the stream drains (at the latest, right
//! before the next graph replay), so refreshing inputs and parameters costs no host round trip.

use burn::backend::tensor::{BoolTensor, FloatTensor, IntTensor};
use burn::backend::{Backend, Cube, TensorMetadata, backend_extension};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;

use super::dense::{Dense, copy_values};
use crate::tensors::ElementKind;

/// Identity of a device buffer: allocation id and byte range. Two tensors with the same key
/// are the same memory (PyTorch's `data_ptr` comparison).
pub(crate) type BufferKey = (usize, u64, u64);

/// The identity of the buffer behind a cube tensor.
pub(crate) fn key_of(tensor: &CubeTensor) -> BufferKey {
    let (id, start, end) = tensor.handle.clone().binding().claim_key();
    (id.value, start, end)
}

/// Copies into an existing buffer.
#[backend_extension(Cube, Fusion)]
pub(crate) trait StaticCopyOps: Backend {
    /// Writes `source`'s values into `destination`'s buffer and returns `destination` (the same
    /// buffer). Shapes and dtypes were checked by the caller.
    #[fusion(dtype = destination, shape = destination)]
    fn copy_into_buffer(
        destination: &FloatTensor<Self>,
        source: &FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// A copy of `source` in a new buffer. A plain copy kernel rather than an elementwise op:
    /// fusion would merge an op like `x * 1` into its consumer, but re-plans its queue on every
    /// call when such outputs are dropped unused (docs/decisions.md).
    #[fusion(dtype = source, shape = source)]
    fn copy_to_new_buffer(source: &FloatTensor<Self>) -> FloatTensor<Self>;

    /// [`copy_into_buffer`](Self::copy_into_buffer) for int tensors (fusion checks that each
    /// output is of the kind its signature names). By value: burn's dispatch passes int and
    /// bool tensors by value only; callers pass clones, so the buffer keeps other holders and
    /// fusion never reuses it in place.
    #[fusion(dtype = destination, shape = destination)]
    fn copy_into_int_buffer(
        destination: IntTensor<Self>,
        source: IntTensor<Self>,
    ) -> IntTensor<Self>;

    /// [`copy_into_buffer`](Self::copy_into_buffer) for bool tensors, by value as above.
    #[fusion(dtype = destination, shape = destination)]
    fn copy_into_bool_buffer(
        destination: BoolTensor<Self>,
        source: BoolTensor<Self>,
    ) -> BoolTensor<Self>;

    /// [`copy_to_new_buffer`](Self::copy_to_new_buffer) for int tensors, by value as above.
    #[fusion(dtype = source, shape = source)]
    fn copy_to_new_int_buffer(source: IntTensor<Self>) -> IntTensor<Self>;

    /// [`copy_to_new_buffer`](Self::copy_to_new_buffer) for bool tensors, by value as above.
    #[fusion(dtype = source, shape = source)]
    fn copy_to_new_bool_buffer(source: BoolTensor<Self>) -> BoolTensor<Self>;

    /// A copy of `source` in a new **dense** buffer (rows not pitched, see
    /// [`dense`](super::dense)): a graph's parameter buffer, which `FusedAdam` and
    /// `MultiTensorAdam` then update in place without a dense copy and a copy back.
    #[fusion(dtype = source, shape = source)]
    fn copy_to_new_dense_buffer(source: &FloatTensor<Self>) -> FloatTensor<Self>;
}

impl StaticCopyOps for CubeBackend {
    fn copy_into_buffer(destination: &CubeTensor, source: &CubeTensor) -> CubeTensor {
        // The same memory already holds the values (checked here, at execution time, where the
        // buffers are known without a round trip).
        if key_of(source) != key_of(destination) {
            copy_values(source, destination);
        }
        destination.clone()
    }

    fn copy_to_new_buffer(source: &CubeTensor) -> CubeTensor {
        // Untiled first: the output takes its shape from it. The device's usual layout
        // (pitched rows on CUDA), as burn would allocate it.
        let source = burn_cubecl::kernel::untile(source.clone());
        let output = burn_cubecl::ops::numeric::empty_device_dtype(
            source.client.clone(),
            source.device.clone(),
            source.meta.shape().clone(),
            source.dtype,
        );
        copy_values(&source, &output);
        output
    }

    fn copy_to_new_dense_buffer(source: &CubeTensor) -> CubeTensor {
        Dense::copy_of(source).into_tensor()
    }

    fn copy_into_int_buffer(destination: CubeTensor, source: CubeTensor) -> CubeTensor {
        Self::copy_into_buffer(&destination, &source)
    }

    fn copy_into_bool_buffer(destination: CubeTensor, source: CubeTensor) -> CubeTensor {
        Self::copy_into_buffer(&destination, &source)
    }

    fn copy_to_new_int_buffer(source: CubeTensor) -> CubeTensor {
        Self::copy_to_new_buffer(&source)
    }

    fn copy_to_new_bool_buffer(source: CubeTensor) -> CubeTensor {
        Self::copy_to_new_buffer(&source)
    }
}

/// A fusion tensor of burn's cubecl backend (float, int or bool).
type Fused = FloatTensor<Cube>;

/// Queues a copy of `source`'s values into `destination`'s buffer (same shape and dtype, of any
/// kind) and returns the queued operation's output, `destination`'s buffer.
pub(crate) fn copy_into(destination: &Fused, source: &Fused) -> Fused {
    match ElementKind::of(destination.dtype()) {
        ElementKind::Float => <Cube as StaticCopyOps>::copy_into_buffer(destination, source),
        ElementKind::Int => {
            <Cube as StaticCopyOps>::copy_into_int_buffer(destination.clone(), source.clone())
        }
        ElementKind::Bool => {
            <Cube as StaticCopyOps>::copy_into_bool_buffer(destination.clone(), source.clone())
        }
    }
}

/// Queues a copy of `source` (of any kind) in a new buffer of the device's usual layout.
pub(crate) fn copy_to_new(source: &Fused) -> Fused {
    match ElementKind::of(source.dtype()) {
        ElementKind::Float => <Cube as StaticCopyOps>::copy_to_new_buffer(source),
        ElementKind::Int => <Cube as StaticCopyOps>::copy_to_new_int_buffer(source.clone()),
        ElementKind::Bool => <Cube as StaticCopyOps>::copy_to_new_bool_buffer(source.clone()),
    }
}

/// A bit-for-bit copy of `tensor` (on burn's cubecl backend, without autodiff) in a new buffer.
pub(crate) fn copy_tensor(tensor: &burn::tensor::Tensor<1>) -> Option<burn::tensor::Tensor<1>> {
    use burn::backend::Cube;
    let fused = tensor.clone().try_into_primitive::<Cube>().ok()?;
    let copy = <Cube as StaticCopyOps>::copy_to_new_buffer(&fused);
    Some(burn::tensor::Tensor::from_primitive::<Cube>(copy))
}

/// `bucket`'s values in a dense buffer that only the returned tensor holds, for a collective
/// (on burn's cubecl backend; another tensor is returned as it is). cubecl's all-reduce takes
/// the element count from the byte size of the buffer it is given, and burn's reduces in place
/// only a buffer nobody else holds, copying the others into a buffer of the device's usual,
/// padded layout. Ranks whose buckets were made differently (one a replayed graph's static
/// bucket, another an eager concatenation, densely) would hand NCCL different counts, and the
/// rank with more elements waits for good. A dense buffer of the bucket's length is the same on
/// every rank.
pub(crate) fn collective_buffer(bucket: burn::tensor::Tensor<1>) -> burn::tensor::Tensor<1> {
    use burn::backend::Cube;
    // Without autodiff: the collective's operand is a plain tensor either way.
    let bucket = bucket.inner();
    match bucket.clone().try_into_primitive::<Cube>() {
        Ok(fused) => burn::tensor::Tensor::from_primitive::<Cube>(
            <Cube as StaticCopyOps>::copy_to_new_dense_buffer(&fused),
        ),
        Err(_) => bucket,
    }
}

/// Queues a copy of `source`'s values into `destination`'s own buffer (both on burn's cubecl
/// backend, without autodiff, same shape and dtype). Returns the queued operation's output,
/// which the caller keeps until the device synchronized (fusion skips work whose results
/// nobody holds); `None` when a tensor is not on the cubecl backend.
pub(crate) fn copy_tensor_into(
    destination: &burn::tensor::Tensor<1>,
    source: &burn::tensor::Tensor<1>,
) -> Option<FloatTensor<burn::backend::Cube>> {
    use burn::backend::Cube;
    let destination = destination.clone().try_into_primitive::<Cube>().ok()?;
    let source = source.clone().try_into_primitive::<Cube>().ok()?;
    Some(<Cube as StaticCopyOps>::copy_into_buffer(
        &destination,
        &source,
    ))
}
