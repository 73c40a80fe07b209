//! A copy into a static buffer as one driver copy (`cuMemcpyDtoDAsync`) on cubecl's stream,
//! where source and buffer are laid out alike on a CUDA device: the replay's task launches it
//! in place of cubecl's copy kernel, whose launch costs several times the driver call on the
//! host. Anything else (another layout or device, a buffer cubecl will not hand out because a
//! failed launch left it unwritten) is left to the kernel, so that cubecl's account of what
//! each buffer holds stays its own: the kernel is skipped on an unwritten source and marks the
//! buffer, which the replay's check then reports.

use std::cell::Cell;

use burn_cubecl::tensor::CubeTensor;

thread_local! {
    /// Driver copies enqueued for the calls of this thread (read by `burn_graphed::testing`;
    /// per thread, so that a test counts its own calls' copies while others run).
    static COPIES: Cell<usize> = const { Cell::new(0) };
}

/// Counts `copies` driver copies enqueued for a call of this thread (the caller's, not the
/// device thread's that enqueued them).
pub(super) fn note(copies: usize) {
    COPIES.with(|count| count.set(count.get() + copies));
}

/// Driver copies enqueued so far for the calls of this thread.
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
pub(crate) fn copies() -> usize {
    COPIES.with(Cell::get)
}

/// Copies `source`'s values into `destination` with one driver copy and returns `true`, or
/// returns `false` having done nothing (the caller launches cubecl's copy kernel instead): not
/// both on a CUDA device, other dtypes, shapes or strides, or a buffer cubecl does not hand
/// out. Runs where cubecl answers inline: inside `ComputeClient::exclusive`, on the caller's
/// stream, after the work queued before the task.
pub(super) fn copy(source: &CubeTensor, destination: &CubeTensor) -> bool {
    #[cfg(feature = "cuda")]
    {
        cuda::copy(source, destination).is_some()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (source, destination);
        false
    }
}

/// The elements from a tensor's first to its last in memory (padding between rows included),
/// for `shape` and `strides` in elements; 0 when it has none.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn span(shape: &[usize], strides: &[usize]) -> usize {
    if shape.contains(&0) {
        return 0;
    }
    1 + shape
        .iter()
        .zip(strides)
        .map(|(&size, &stride)| (size - 1) * stride)
        .sum::<usize>()
}

#[cfg(feature = "cuda")]
mod cuda {
    use burn_cubecl::tensor::CubeTensor;

    use super::super::cuda_stream::{CudaServer, make_current};

    /// [`copy`](super::copy); `None` where it did nothing.
    pub(super) fn copy(source: &CubeTensor, destination: &CubeTensor) -> Option<()> {
        let on_cuda = |t: &CubeTensor| matches!(t.device, cubecl::Device::Cuda(_));
        if !on_cuda(source)
            || !on_cuda(destination)
            || source.dtype != destination.dtype
            || source.meta.shape() != destination.meta.shape()
            || source.meta.strides() != destination.meta.strides()
        {
            return None;
        }
        let bytes = super::span(destination.meta.shape(), destination.meta.strides())
            * destination.dtype.size();
        if bytes == 0 {
            return Some(());
        }
        // Refused for a buffer a failed launch left unwritten: the kernel then carries the
        // failure over as cubecl does. The destination first: made on the capture thread's
        // stream, it names the stream to enqueue on; the source's resource orders it there.
        let resource = |t: &CubeTensor| t.client.get_resource::<CudaServer>(t.handle.clone());
        let to = resource(destination).ok()?;
        let from = resource(source).ok()?;
        let (to, from) = (to.resource(), from.resource());
        if to.stream.is_null() || (bytes as u64) > to.size.min(from.size) {
            return None;
        }
        // SAFETY: `to.stream` is a live stream of cubecl's server: its pool holds the
        // destination, whose resource we hold.
        unsafe { make_current(to.stream) }.ok()?;
        // SAFETY: both addresses are live buffers of cubecl's CUDA server, held by the
        // resources above until the copy is enqueued, and at least `bytes` long (checked); the
        // copy is enqueued on the stream whose pool holds the destination, in its context (made
        // current above), after the kernels the server launched before handing the resources
        // out, and stream order keeps any later reuse of the source's memory behind it.
        unsafe { cudarc::driver::result::memcpy_dtod_async(to.ptr, from.ptr, bytes, to.stream) }
            .ok()
    }
}

#[cfg(test)]
mod tests {
    use super::span;

    #[test]
    fn a_span_runs_from_the_first_element_to_the_last() {
        assert_eq!(span(&[2, 3], &[3, 1]), 6);
        // Pitched rows: the padding between rows is inside the span, not after the last row.
        assert_eq!(span(&[2, 3], &[8, 1]), 11);
        assert_eq!(span(&[4], &[1]), 4);
        assert_eq!(span(&[], &[]), 1);
        assert_eq!(span(&[3, 0], &[1, 1]), 0);
    }
}
