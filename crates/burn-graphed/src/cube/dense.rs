//! Dense buffers: the only kind of buffer the kernels that index linearly bind (`update_op`,
//! `random_op`).
//!
//! cubecl 0.11 on CUDA allocates a new tensor **pitched** (`MemoryLayoutStrategy::Optimized`):
//! each row is padded to a power-of-two number of bytes, from 16 up to the device's memory
//! alignment, so the rows of a `[37, 11]` `bf16` tensor start 16 elements apart, those of a
//! `[32, 10]` `f32` weight 16 apart and those of a `[16, 3, 3, 3]` convolution kernel 4 apart.
//! wgpu allocates rows densely. A kernel that binds a buffer as a slice of `shape.product()`
//! elements reads and writes a pitched buffer's padding in place of its last rows' elements.
//! So those kernels bind [`Dense`] tensors only, and a
//! [`Dense`] is made only from a tensor that is dense or by a copy into a dense allocation.
//! A dense tensor's buffer may still run past its last element (one padded row; cubecl gives a
//! kernel's slice the buffer's length): [`Dense::arg`] binds it trimmed to the elements.

use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::BufferArg;

/// A tensor whose elements are the first `shape.product()` elements of its buffer, in
/// row-major order: not pitched, not tiled, not broadcast, not permuted.
#[derive(Clone, Debug)]
pub(crate) struct Dense(CubeTensor);

/// Whether `tensor`'s elements lie densely in row-major order in its buffer.
pub(crate) fn is_dense(tensor: &CubeTensor) -> bool {
    !tensor.meta.is_tiled() && tensor.is_contiguous()
}

impl Dense {
    /// `tensor` itself where it is dense, otherwise a dense copy of its values (a copy kernel).
    pub(crate) fn of(tensor: &CubeTensor) -> Self {
        // `into_contiguous` returns the tensor where it is contiguous and untiled, and
        // otherwise copies into an allocation of exactly `shape.product()` elements.
        Self(burn_cubecl::kernel::into_contiguous(tensor.clone()))
    }

    /// `tensor` itself where nothing else holds its buffer and it is dense, so that a kernel
    /// may write it in place; otherwise a dense copy of its values in a new buffer.
    pub(crate) fn owned(tensor: CubeTensor) -> Self {
        if tensor.can_mut() && is_dense(&tensor) {
            Self(tensor)
        } else {
            Self::copy_of(&tensor)
        }
    }

    /// A dense copy of `tensor`'s values in a new buffer, whatever `tensor`'s layout.
    pub(crate) fn copy_of(tensor: &CubeTensor) -> Self {
        let copy = Self::empty_like(tensor);
        copy_values(tensor, &copy.0);
        copy
    }

    /// A new dense buffer of `tensor`'s shape and dtype; its values are undefined.
    pub(crate) fn empty_like(tensor: &CubeTensor) -> Self {
        Self::new_empty(
            tensor.client.clone(),
            tensor.device.clone(),
            tensor.meta.shape().clone(),
            tensor.dtype,
        )
    }

    /// A new dense buffer of `shape` and `dtype`; its values are undefined.
    pub(crate) fn new_empty(
        client: cubecl::client::Client,
        device: burn_cubecl::CubeDevice,
        shape: burn::tensor::Shape,
        dtype: burn::tensor::DType,
    ) -> Self {
        Self(burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
            client, device, shape, dtype,
        ))
    }

    /// The number of elements.
    pub(crate) fn len(&self) -> usize {
        self.0.meta.shape().iter().product()
    }

    /// The largest number of elements that divides every one of `counts` and the start of
    /// each of `buffers` (in elements of its dtype; a start between elements divides by 1):
    /// the widest vector whose loads stay aligned and whole in every row. 0 with nothing given.
    pub(crate) fn common_alignment(
        buffers: &[&Dense],
        counts: impl IntoIterator<Item = usize>,
    ) -> usize {
        let starts = buffers.iter().map(|dense| {
            let tensor = dense.tensor();
            let bytes = tensor.handle.offset_start.unwrap_or(0) as usize;
            let size = tensor.dtype.size();
            if bytes.is_multiple_of(size) {
                bytes / size
            } else {
                1
            }
        });
        counts.into_iter().chain(starts).fold(0, gcd)
    }

    /// The tensor.
    pub(crate) fn tensor(&self) -> &CubeTensor {
        &self.0
    }

    /// The tensor, to hand on.
    pub(crate) fn into_tensor(self) -> CubeTensor {
        self.0
    }

    /// The buffer as a kernel's slice argument of [`len`](Self::len) elements: the slice's
    /// `len()` inside the kernel is this tensor's element count.
    ///
    /// cubecl gives a kernel's slice the length of the bound handle (its bytes in use over the
    /// element size), not the length passed with it, and a dense tensor's handle may be longer
    /// than its elements: CUDA pads a row to its pitch, so a one-row tensor or a tensor made
    /// contiguous by a copy there holds spare elements past its last. The handle is bound
    /// trimmed to the elements, so a kernel that counts by `len()` never reads the spare ones.
    ///
    /// # Safety
    ///
    /// The kernel must read and write the slice as elements of this tensor's dtype (it is
    /// instantiated for that dtype), and only below the slice's length: the length is counted in
    /// those elements, and cubecl does not check it.
    pub(crate) unsafe fn arg(&self) -> BufferArg {
        let bytes = (self.len() * self.0.dtype.size()) as u64;
        let handle = self.0.handle.clone();
        let spare = handle.size_in_used().saturating_sub(bytes);
        let handle = if spare > 0 {
            handle.offset_end(spare)
        } else {
            handle
        };
        // SAFETY: the buffer holds `len()` elements of the tensor's dtype densely from the
        // handle's offset on (the type's invariant), and the handle is trimmed to exactly those
        // bytes; that the kernel reads elements of that dtype is the caller's obligation.
        unsafe { BufferArg::from_raw_parts(handle, self.len()) }
    }
}

/// The buffer a kernel updates in place, and the tensor that holds the result afterwards.
pub(crate) struct Target {
    dense: Dense,
    /// A graph's static buffer that is not dense: `dense` is a copy of it, whose values
    /// [`finish`](Self::finish) puts back.
    write_back: Option<CubeTensor>,
}

impl Target {
    /// A graph's static buffer, updated in place: itself where it is dense, else through a
    /// dense copy whose values go back into it.
    pub(crate) fn static_buffer(buffer: CubeTensor) -> Self {
        if is_dense(&buffer) {
            Self {
                dense: Dense(buffer),
                write_back: None,
            }
        } else {
            Self {
                dense: Dense::copy_of(&buffer),
                write_back: Some(buffer),
            }
        }
    }

    /// A tensor updated in its own buffer where nothing else holds it and it is dense,
    /// otherwise in a dense copy ([`Dense::owned`]).
    pub(crate) fn owned(tensor: CubeTensor) -> Self {
        Self {
            dense: Dense::owned(tensor),
            write_back: None,
        }
    }

    /// The buffer the kernel writes.
    pub(crate) fn dense(&self) -> &Dense {
        &self.dense
    }

    /// After the kernel's launch: the updated tensor (for a static buffer, that buffer, with the
    /// copy's values queued back into it where the kernel wrote a copy).
    pub(crate) fn finish(self) -> CubeTensor {
        match self.write_back {
            Some(buffer) => {
                copy_values(self.dense.tensor(), &buffer);
                buffer
            }
            None => self.dense.into_tensor(),
        }
    }
}

/// Queues a copy of `source`'s values into `destination`'s buffer, each read and written
/// through its own layout (pitched, dense or strided). Same shape and dtype: the caller's
/// obligation.
pub(crate) fn copy_values(source: &CubeTensor, destination: &CubeTensor) {
    // cubecl's copy vectorizes its writes along the destination's last dimension and, for
    // large tensors, packs several elements per unit there as if that dimension were
    // contiguous in memory. A destination laid out in another order (an inference graph's
    // transposed weight) is first viewed in its memory order, the source alike: the same
    // elements pair up, and the destination's last dimension is its innermost.
    let order = memory_order_of(destination.meta.strides());
    let (source, destination) = if is_identity(&order) {
        (
            burn_cubecl::kernel::untile(source.clone()),
            destination.clone(),
        )
    } else {
        (
            burn_cubecl::ops::permute(source.clone(), &order),
            burn_cubecl::ops::permute(destination.clone(), &order),
        )
    };
    let dtype = burn::backend::cubecl::dtype_to_storage_type(destination.dtype);
    let client = destination.client.clone();
    cubecl::std::tensor::copy_into(&client, source.binding(), destination.binding(), dtype);
}

/// The dimensions of a tensor with `strides` in memory order: from the largest stride to the
/// smallest, ties (size-1 dimensions) in dimension order. `0..rank` for a row-major tensor,
/// pitched rows included; `[1, 0]` for a transposed view of a row-major matrix.
pub(crate) fn memory_order_of(strides: &[usize]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..strides.len()).collect();
    order.sort_by(|a, b| strides[*b].cmp(&strides[*a]));
    order
}

/// Whether a dimension order is `0..rank`.
pub(crate) fn is_identity(order: &[usize]) -> bool {
    order.iter().enumerate().all(|(dim, at)| dim == *at)
}

/// Tensors laid out as CUDA lays them out, made by hand on wgpu (which allocates densely), for
/// the unit tests of the kernels that bind [`Dense`] buffers.
#[cfg(all(test, feature = "wgpu"))]
pub(crate) mod test_support {
    use burn::tensor::DType;
    use burn_cubecl::CubeDevice;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::zspace::metadata::Metadata;
    use cubecl::zspace::{Shape, Strides};

    /// Rows of the test tensors.
    pub const ROWS: usize = 7;
    /// Columns of the test tensors: 20 bytes, which CUDA pads to 32 (a pitch of 8 elements).
    pub const COLS: usize = 5;
    /// The row pitch CUDA gives them.
    pub const PITCH: usize = 8;

    fn device() -> CubeDevice {
        CubeDevice::Wgpu(Default::default())
    }

    /// `ROWS x COLS` values, all different, from `seed`.
    pub fn values(seed: f32) -> Vec<f32> {
        (0..ROWS * COLS)
            .map(|i| (i as f32 * 0.37 + seed).sin())
            .collect()
    }

    /// `values` (`ROWS x COLS`, row-major) in a new buffer whose rows lie `pitch` elements
    /// apart; the padding holds NaN.
    pub fn laid_out(values: &[f32], pitch: usize) -> CubeTensor {
        let mut buffer = vec![f32::NAN; ROWS * pitch];
        for (row, chunk) in values.chunks(COLS).enumerate() {
            buffer[row * pitch..row * pitch + COLS].copy_from_slice(chunk);
        }
        let bytes: Vec<u8> = buffer.iter().flat_map(|v| v.to_le_bytes()).collect();
        let device = device();
        let client = device.client();
        let handle = client.create_from_slice(&bytes);
        let metadata = Metadata::new(Shape::new([ROWS, COLS]), Strides::new(&[pitch, 1]));
        CubeTensor::new(client, handle, metadata, device, DType::F32)
    }

    /// A row-major tensor of `shape` over the first of `words` (4-byte elements of `dtype`),
    /// in a buffer of all of them: what CUDA allocates for one row (padded to its pitch).
    pub fn padded<const D: usize>(
        words: &[[u8; 4]],
        shape: [usize; D],
        dtype: DType,
    ) -> CubeTensor {
        let device = device();
        let client = device.client();
        let handle = client.create_from_slice(words.concat().as_slice());
        let strides: Vec<usize> = (0..D).map(|d| shape[d + 1..].iter().product()).collect();
        let metadata = Metadata::new(Shape::new(shape), Strides::new(&strides));
        CubeTensor::new(client, handle, metadata, device, dtype)
    }

    /// The whole buffer behind `tensor`, padding included.
    pub fn buffer(tensor: &CubeTensor) -> Vec<f32> {
        let bytes = tensor
            .client
            .read_one(tensor.handle.clone())
            .expect("the buffer reads back");
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    /// `tensor`'s elements in row-major order, read through its strides.
    pub fn elements(tensor: &CubeTensor) -> Vec<f32> {
        let buffer = buffer(tensor);
        let strides = tensor.meta.strides();
        let (row_stride, col_stride) = (strides[0], strides[1]);
        (0..ROWS)
            .flat_map(|r| (0..COLS).map(move |c| r * row_stride + c * col_stride))
            .map(|i| buffer[i])
            .collect()
    }

    /// Whether every padding element of a `PITCH`-pitched buffer is still NaN.
    pub fn padding_untouched(tensor: &CubeTensor) -> bool {
        let buffer = buffer(tensor);
        (0..ROWS).all(|r| {
            buffer[r * PITCH + COLS..(r + 1) * PITCH]
                .iter()
                .all(|v| v.is_nan())
        })
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::test_support::*;
    use super::*;
    use burn::tensor::DType;
    use cubecl::prelude::*;

    #[test]
    fn pitched_tensors_are_not_dense() {
        assert!(!is_dense(&laid_out(&values(0.0), PITCH)));
        assert!(is_dense(&laid_out(&values(0.0), COLS)));
    }

    /// `Dense::owned`, `Dense::of` and `Dense::copy_of` of a pitched tensor are dense buffers
    /// holding its elements and nothing else; the original is left alone.
    #[test]
    fn dense_copies_of_a_pitched_tensor_hold_its_elements() {
        let pitched = laid_out(&values(0.0), PITCH);
        for dense in [
            Dense::owned(pitched.clone()),
            Dense::of(&pitched),
            Dense::copy_of(&pitched),
        ] {
            assert!(is_dense(dense.tensor()));
            assert_eq!(dense.len(), ROWS * COLS);
            assert_eq!(buffer(dense.tensor()), values(0.0));
        }
        assert_eq!(elements(&pitched), values(0.0));
        assert!(padding_untouched(&pitched));
    }

    /// What a kernel reads as `len()` of a slice.
    #[cube(launch_unchecked)]
    fn length_kernel(x: &[f32], out: &mut [u32]) {
        if UNIT_POS == 0 {
            out[0] = x.len() as u32;
        }
    }

    /// A dense tensor whose handle is longer than its elements (one CUDA row, padded) binds as
    /// a slice of its elements: `len()` in the kernel is the tensor's length, not the buffer's.
    #[test]
    fn a_padded_row_binds_as_its_elements() {
        let row = padded(&[1.0f32.to_le_bytes(); 64], [18], DType::F32);
        assert!(is_dense(&row));
        let out = padded(&[[0; 4]], [1], DType::U32);
        let (x, out) = (Dense::of(&row), Dense::of(&out));
        // SAFETY: the kernel reads nothing of `x` and writes element 0 of `out` (one element).
        unsafe {
            length_kernel::launch_unchecked(
                &row.client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(1),
                x.arg(),
                out.arg(),
            );
        }
        let bytes = row
            .client
            .read_one(out.tensor().handle.clone())
            .expect("reads back");
        assert_eq!(
            u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
            18
        );
    }

    /// `copy_values` writes a pitched destination through its strides: elements replaced,
    /// padding left alone.
    #[test]
    fn copy_values_writes_through_the_destination_layout() {
        let destination = laid_out(&values(0.0), PITCH);
        copy_values(&laid_out(&values(1.0), COLS), &destination);
        assert_eq!(elements(&destination), values(1.0));
        assert!(padding_untouched(&destination));
    }
}

/// The greatest common divisor of `a` and `b` (`gcd(0, b) == b`).
pub(crate) fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}
