//! NCCL between the ranks of a data-parallel group, one per GPU, processes or threads of one
//! process: one communicator per rank, made from a unique id that rank 0 mints (handed to every
//! process by the group's rendezvous; shared by the threads of `DataParallel::group`), and the
//! gradient bucket's mean as a lazy fusion operation that enqueues `ncclAllReduce` on cubecl's
//! own stream.
//!
//! Why not cubecl's collectives: cubecl 0.11 mints its NCCL ids inside the process and numbers
//! the ranks by the devices of that process, so processes cannot share a communicator; and it
//! issues collectives on a stream of their own, which a capture of the compute stream does not
//! record. Enqueued on the stream cubecl's kernels run on (the carried patch's
//! `GpuResource::stream`, as the cuBLASLt products do), the all-reduce runs in order with the
//! step eagerly, and a capture records it into the step's graph with the rest of the step.
//!
//! The communicator is made at its first all-reduce, with the stream's context current: NCCL
//! binds a communicator to the device current at its making. Every rank reaches that
//! all-reduce in the same step (the ranks agreed on the step first), and it is never inside a
//! recording: every capture warms up eagerly first.
//!
//! No device waits for good ([`end`], the watchdog): an all-reduce a peer never joins (its
//! process died after the step's agreement) spins on the device, and the next read of this
//! rank's values waits behind it. When the group ends so (the rank group's `OnEnd`: a process
//! gone, a timeout, an abandonment), the communicator is aborted (`ncclCommAbort`, from the
//! thread that learned of the end), which ends the spinning kernels, unless the stream drains
//! within a short grace on its own (nothing waited). A thread polls every communicator's
//! asynchronous error (`ncclCommGetAsyncError`) and ends the group on one.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::time::Duration;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Cube, backend_extension};
use burn::tensor::Tensor;
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;

/// Bytes of an NCCL unique id (`ncclUniqueId`).
pub(crate) const UNIQUE_ID_BYTES: usize = 128;

/// The communicators of this process: index `i` is [`join`]'s `i`-th answer.
static COMMUNICATORS: Mutex<Vec<Communicator>> = Mutex::new(Vec::new());

/// The failures of all-reduces since the last [`take_failure`] of their group, first one kept
/// per group (index `i`: group `i`, as [`COMMUNICATORS`]): the fusion operation cannot return
/// an error, so it leaves its bucket unreduced and says why here. Per group: thread ranks of
/// one process each take their own.
static FAILURES: Mutex<Vec<Option<String>>> = Mutex::new(Vec::new());

/// How long an ended group's stream may take to drain on its own before its communicator is
/// aborted: a peer that ended after its last all-reduce completed leaves nothing waiting, and
/// aborting then would cut this rank's own last all-reduce short.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// Between two polls of the communicators' asynchronous errors.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const POLL: Duration = Duration::from_millis(100);

/// Whether [`end`] aborts communicators (a test's negative control turns it off, to show that
/// the device then waits for good).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
static ABORT: AtomicBool = AtomicBool::new(true);

/// An asynchronous NCCL error a test injects: the watchdog's next poll reports it on every
/// communicator of this process.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
static INJECTED: Mutex<Option<String>> = Mutex::new(None);

/// All-reduces enqueued in place (the bucket's own buffer) and into a new buffer (the bucket
/// held elsewhere too), for tests.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
static IN_PLACE: AtomicUsize = AtomicUsize::new(0);
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
static INTO_NEW: AtomicUsize = AtomicUsize::new(0);

/// The all-reduces enqueued so far in this process: in place, and into a new buffer.
#[cfg(feature = "testing")]
pub(crate) fn reductions() -> (usize, usize) {
    use std::sync::atomic::Ordering::Relaxed;
    (IN_PLACE.load(Relaxed), INTO_NEW.load(Relaxed))
}

/// What a group does on its communicator's asynchronous error: ends the rank group.
pub(crate) type OnError = Box<dyn Fn(String) + Send + Sync>;

/// One rank's place in a group of processes, and its NCCL communicator once made.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Communicator {
    id: [u8; UNIQUE_ID_BYTES],
    rank: usize,
    size: usize,
    /// `ncclComm_t`, as an address (made at the first all-reduce).
    comm: Option<usize>,
    /// The stream of its last all-reduce (`CUstream`, as an address).
    stream: Option<usize>,
    /// Why the group ended ([`end`]); no all-reduce runs after.
    ended: Option<String>,
    /// The watchdog saw the communicator fail and ended its group (once).
    failed: bool,
    on_error: std::sync::Arc<OnError>,
}

/// Whether `device` is a CUDA device of burn's cubecl backend (where NCCL runs).
pub(crate) fn is_cuda(device: &burn::tensor::Device) -> bool {
    #[cfg(feature = "cuda")]
    {
        use burn::backend::DispatchDevice;
        matches!(
            device.clone().inner().as_dispatch(),
            DispatchDevice::Cube(cubecl::Device::Cuda(_))
        )
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        false
    }
}

/// A fresh NCCL unique id, for rank 0 to hand to every rank.
///
/// # Errors
///
/// Where NCCL is missing (built without CUDA, `libnccl` not found) or refuses.
pub(crate) fn unique_id() -> Result<Vec<u8>, String> {
    #[cfg(feature = "cuda")]
    {
        nccl::unique_id()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err("NCCL needs burn-graphed's cuda feature".into())
    }
}

/// Registers this process as rank `rank` of `size` of the group that shares `id`; the answer
/// names the group to [`mean`]. The communicator itself is made at the first all-reduce.
///
/// # Errors
///
/// An id of another length than NCCL's.
pub(crate) fn join(
    id: &[u8],
    rank: usize,
    size: usize,
    on_error: OnError,
) -> Result<usize, String> {
    let id: [u8; UNIQUE_ID_BYTES] = id.try_into().map_err(|_| {
        format!(
            "an NCCL unique id of {} bytes, expected {UNIQUE_ID_BYTES}",
            id.len()
        )
    })?;
    let mut communicators = crate::sync::lock(&COMMUNICATORS);
    communicators.push(Communicator {
        id,
        rank,
        size,
        comm: None,
        stream: None,
        ended: None,
        failed: false,
        on_error: std::sync::Arc::new(on_error),
    });
    Ok(communicators.len() - 1)
}

/// Group `group` ended (`reason`): no all-reduce runs on it again, and its communicator is
/// aborted unless its stream drains within [`DRAIN_GRACE`] (a peer's kernels then waited for
/// nothing). Called from any thread but the one whose device may wait; at most once takes
/// effect.
pub(crate) fn end(group: usize, reason: &str) {
    let taken = {
        let mut communicators = crate::sync::lock(&COMMUNICATORS);
        let Some(entry) = communicators.get_mut(group) else {
            return;
        };
        if entry.ended.is_some() {
            return;
        }
        entry.ended = Some(reason.to_string());
        (entry.comm.take(), entry.stream)
    };
    #[cfg(feature = "cuda")]
    if let (Some(comm), stream) = taken {
        nccl::abort(comm, stream, reason);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = taken;
}

/// Turns [`end`]'s abort on or off for this process (a test's negative control).
#[cfg(feature = "testing")]
pub(crate) fn set_abort(on: bool) {
    ABORT.store(on, std::sync::atomic::Ordering::SeqCst);
}

/// Makes the watchdog's next poll report `reason` as an asynchronous NCCL error of every
/// communicator of this process (a test's stand-in for a failing network).
#[cfg(feature = "testing")]
pub(crate) fn inject_error(reason: &str) {
    *crate::sync::lock(&INJECTED) = Some(reason.to_string());
}

/// The mean of every rank's `bucket` (a 1-D float tensor of the same length and dtype on every
/// rank, each rank calling at the same point of its step) over the group [`join`] named
/// `group`: a new tensor. Lazy, as any tensor operation: the all-reduce is enqueued when fusion
/// runs the operation, and a capture records it.
pub(crate) fn mean(bucket: Tensor<1>, group: usize) -> Tensor<1> {
    let bucket = bucket.inner();
    match bucket.clone().try_into_primitive::<Cube>() {
        Ok(fused) => {
            // The operation alone holds the bucket where the caller handed over its last
            // reference: fusion marks it read-write, and the all-reduce reduces it in place.
            drop(bucket);
            Tensor::from_primitive::<Cube>(<Cube as CollectiveOps>::nccl_mean(fused, group))
        }
        Err(_) => {
            fail(group, "the bucket is not on burn's cubecl backend".into());
            bucket
        }
    }
}

/// The first all-reduce failure of group `group` since the last call, if any.
pub(crate) fn take_failure(group: usize) -> Option<String> {
    crate::sync::lock(&FAILURES)
        .get_mut(group)
        .and_then(Option::take)
}

fn fail(group: usize, reason: String) {
    log::error!("burn-graphed: an NCCL all-reduce did not run: {reason}");
    let mut failures = crate::sync::lock(&FAILURES);
    if failures.len() <= group {
        failures.resize(group + 1, None);
    }
    failures[group].get_or_insert(reason);
}

/// The all-reduce as a lazy fusion operation on burn's cubecl backend.
#[backend_extension(Cube, Fusion)]
pub(crate) trait CollectiveOps: Backend {
    /// The mean over group `group`'s ranks of `bucket` (1-D, `f32`, `f16` or `bf16`): a new
    /// dense tensor; `bucket` itself where the all-reduce cannot run ([`take_failure`] says
    /// why).
    #[fusion(meta = |bucket, _group| bucket.clone())]
    fn nccl_mean(bucket: FloatTensor<Self>, group: usize) -> FloatTensor<Self>;
}

impl CollectiveOps for CubeBackend {
    fn nccl_mean(bucket: CubeTensor, group: usize) -> CubeTensor {
        #[cfg(feature = "cuda")]
        {
            match nccl::mean(&bucket, group) {
                Ok(out) => out,
                Err(reason) => {
                    fail(group, reason);
                    bucket
                }
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            fail(group, "NCCL needs burn-graphed's cuda feature".into());
            bucket
        }
    }
}

#[cfg(feature = "cuda")]
mod nccl {
    use burn::tensor::{DType, Shape};
    use burn_cubecl::tensor::CubeTensor;
    use cudarc::driver::sys::CUstream;
    use cudarc::nccl::{result, sys};

    use super::super::cuda_stream::{CudaServer, make_current};
    use super::super::dense::{Dense, is_dense};
    use super::{COMMUNICATORS, UNIQUE_ID_BYTES};

    /// NCCL's data type for `dtype`.
    fn nccl_type(dtype: DType) -> Option<sys::ncclDataType_t> {
        use sys::ncclDataType_t as Nccl;
        match dtype {
            DType::F32 => Some(Nccl::ncclFloat32),
            DType::F16 => Some(Nccl::ncclFloat16),
            DType::BF16 => Some(Nccl::ncclBfloat16),
            _ => None,
        }
    }

    pub(super) fn unique_id() -> Result<Vec<u8>, String> {
        let id = result::get_uniqueid().map_err(|e| format!("ncclGetUniqueId: {e:?}"))?;
        // `c_char` to bytes, bit for bit.
        Ok(id.internal.iter().map(|&c| c as u8).collect())
    }

    /// The entry of group `group`, unless the group ended.
    fn live(
        communicators: &mut [super::Communicator],
        group: usize,
    ) -> Result<&mut super::Communicator, String> {
        let entry = communicators
            .get_mut(group)
            .ok_or_else(|| format!("no NCCL group {group} in this process"))?;
        if let Some(reason) = &entry.ended {
            return Err(format!("the group ended ({reason})"));
        }
        Ok(entry)
    }

    /// Makes group `group`'s communicator if this is its first all-reduce (every rank makes it
    /// in the same step; NCCL waits for all of them), with `stream`'s context current. NCCL's
    /// wait is outside the lock: the ranks of a group may be threads of this process, each
    /// making its own.
    fn make_communicator(group: usize, stream: CUstream) -> Result<(), String> {
        let (id, rank, size) = {
            let mut communicators = crate::sync::lock(&COMMUNICATORS);
            let entry = live(&mut communicators, group)?;
            entry.stream = Some(stream as usize);
            if entry.comm.is_some() {
                return Ok(());
            }
            (entry.id, entry.rank, entry.size)
        };
        let mut unique = sys::ncclUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        for (slot, byte) in unique.internal.iter_mut().zip(id) {
            *slot = byte as std::ffi::c_char;
        }
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` is a valid place for the communicator NCCL makes; `unique` is the
        // group's id as rank 0 minted it, `rank < size` (the group numbered the ranks); the
        // caller made the context of the device this rank runs on current.
        unsafe {
            result::comm_init_rank(
                &mut comm,
                size as std::ffi::c_int,
                unique,
                rank as std::ffi::c_int,
            )
        }
        .map_err(|e| format!("ncclCommInitRank (rank {rank} of {size}): {e:?}"))?;
        let ended = {
            let mut communicators = crate::sync::lock(&COMMUNICATORS);
            let entry = &mut communicators[group];
            match &entry.ended {
                Some(reason) => Some(reason.clone()),
                None => {
                    entry.comm = Some(comm as usize);
                    None
                }
            }
        };
        if let Some(reason) = ended {
            // The group ended while NCCL made it: no one else holds the communicator.
            abort(comm as usize, None, &reason);
            return Err(format!("the group ended ({reason})"));
        }
        watch();
        Ok(())
    }

    /// The communicator of group `group` in `communicators`, made by [`make_communicator`].
    /// The caller holds the lock until its all-reduce is enqueued, so that [`super::end`] never
    /// aborts a communicator in the middle of that call.
    fn communicator(
        communicators: &mut [super::Communicator],
        group: usize,
    ) -> Result<sys::ncclComm_t, String> {
        live(communicators, group)?
            .comm
            .map(|comm| comm as sys::ncclComm_t)
            .ok_or_else(|| format!("NCCL group {group} has no communicator"))
    }

    /// Starts the watchdog once per process: every [`POLL`](super::POLL), [`poll`].
    fn watch() {
        static STARTED: std::sync::Once = std::sync::Once::new();
        STARTED.call_once(|| {
            let spawned = std::thread::Builder::new()
                .name("burn-graphed-nccl-watchdog".into())
                .spawn(|| {
                    loop {
                        std::thread::sleep(super::POLL);
                        poll();
                    }
                });
            if let Err(e) = spawned {
                log::warn!("burn-graphed: no NCCL watchdog thread ({e}); errors surface at the next agreement");
            }
        });
    }

    /// One poll of every live communicator's asynchronous error: a failed one's group ends on
    /// every rank (`on_error`), and the group's end on each rank aborts its communicator where
    /// its stream does not drain ([`super::end`]): where kernels wait.
    fn poll() {
        let injected = crate::sync::lock(&super::INJECTED).take();
        let failed: Vec<_> = {
            let mut communicators = crate::sync::lock(&COMMUNICATORS);
            communicators
                .iter_mut()
                .filter(|entry| entry.ended.is_none() && !entry.failed)
                .filter_map(|entry| {
                    let comm = entry.comm?;
                    let reason = injected.clone().or_else(|| async_error(comm))?;
                    entry.failed = true;
                    Some((
                        format!("NCCL's communicator failed: {reason}"),
                        entry.on_error.clone(),
                    ))
                })
                .collect()
        };
        for (reason, on_error) in failed {
            log::error!("burn-graphed: {reason}; ending the group");
            on_error(reason);
        }
    }

    /// The communicator's asynchronous error, if it has one.
    fn async_error(comm: usize) -> Option<String> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `comm` is a live communicator (the caller holds the lock under which `end`
        // and this poll take it before aborting); `state` is a valid place for the answer.
        let asked = unsafe { sys::ncclCommGetAsyncError(comm as sys::ncclComm_t, &mut state) };
        match (asked, state) {
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess)
            | (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclInProgress) => None,
            (sys::ncclResult_t::ncclSuccess, state) => Some(format!("{state:?}")),
            (asked, _) => Some(format!("ncclCommGetAsyncError: {asked:?}")),
        }
    }

    /// Aborts `comm` (taken out of its group: no one else uses it again) unless `stream`
    /// finishes on its own within the drain grace: nothing waits then, and NCCL's abort of a
    /// communicator whose peers live and wait for nothing is not needed (and was seen to take
    /// minutes: `tests/scenarios/process_faults.rs`).
    pub(super) fn abort(comm: usize, stream: Option<usize>, reason: &str) {
        if !super::ABORT.load(std::sync::atomic::Ordering::SeqCst) {
            log::warn!("burn-graphed: NCCL abort turned off; the group ended ({reason})");
            return;
        }
        if let Some(stream) = stream {
            let stream = stream as CUstream;
            // SAFETY: `stream` is cubecl's stream of the group's last all-reduce; cubecl's
            // streams live as long as its server, which outlives every group of the process.
            let current = unsafe { make_current(stream) };
            let deadline = std::time::Instant::now() + super::DRAIN_GRACE;
            while current.is_ok() && std::time::Instant::now() < deadline {
                // SAFETY: as above; querying a stream is thread-safe.
                let state = unsafe { cudarc::driver::sys::cuStreamQuery(stream) };
                if state == cudarc::driver::sys::CUresult::CUDA_SUCCESS {
                    log::info!("burn-graphed: the group ended ({reason}); nothing waits in NCCL");
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
        log::error!(
            "burn-graphed: the group ended ({reason}); aborting NCCL's communicator so that no \
             kernel waits for a peer that will not come"
        );
        // SAFETY: `comm` is a communicator this process made and no one uses again (taken out
        // of its group under the lock); NCCL allows aborting from another thread than the one
        // whose work waits, which it ends.
        if let Err(e) = unsafe { result::comm_abort(comm as sys::ncclComm_t) } {
            log::error!("burn-graphed: ncclCommAbort: {e:?}");
        }
    }

    /// The mean of `bucket` over group `group`, into a new dense tensor, enqueued on the stream
    /// cubecl's kernels run on.
    pub(super) fn mean(bucket: &CubeTensor, group: usize) -> Result<CubeTensor, String> {
        let dims = bucket.meta.shape().num_dims();
        if dims != 1 {
            return Err(format!("a bucket of {dims} dimensions, expected 1"));
        }
        let dtype = nccl_type(bucket.dtype)
            .ok_or_else(|| format!("a bucket of {:?}, expected f32, f16 or bf16", bucket.dtype))?;
        let len = bucket.meta.shape()[0];
        // In place where this operation holds the bucket's only reference (the step's bucket,
        // handed over at its last use): one copy of the gradients' bucket per rank. Where
        // anything else holds the buffer, its values must stay, and the mean goes to a new one.
        let in_place = bucket.can_mut() && is_dense(bucket);
        let (source, out) = if in_place {
            (None, Dense::of(bucket))
        } else {
            let out = Dense::new_empty(
                bucket.client.clone(),
                bucket.device.clone(),
                Shape::new([len]),
                bucket.dtype,
            );
            (Some(Dense::of(bucket)), out)
        };
        let resource = |tensor: &CubeTensor| {
            tensor
                .client
                .get_resource::<CudaServer>(tensor.handle.clone())
                .map_err(|e| format!("cubecl did not hand out the bucket's buffer: {e}"))
        };
        // The output first: made on this thread's stream, it names the stream to enqueue on.
        let out_res = resource(out.tensor())?;
        let source_res = match &source {
            Some(source) => Some(resource(source.tensor())?),
            None => None,
        };
        let send = source_res.as_ref().unwrap_or(&out_res).resource().ptr;
        let stream: CUstream = out_res.resource().stream;
        if stream.is_null() {
            return Err("the buffer names no stream".into());
        }
        // SAFETY: `stream` is a live stream of cubecl's server: its pool holds `out`, which we
        // hold.
        unsafe { make_current(stream) }.map_err(|(call, e)| format!("{call}: {e}"))?;
        make_communicator(group, stream)?;
        let mut communicators = crate::sync::lock(&COMMUNICATORS);
        let comm = communicator(&mut communicators, group)?;
        // SAFETY: both addresses are live device allocations of at least `len` elements of
        // `dtype` (`source` dense over the bucket, `out` made for it, or both the bucket's own
        // dense buffer, which NCCL reduces in place, and which nothing else holds), held until
        // the operation returns, after which the stream orders every later use after the
        // all-reduce; `comm` is this process's communicator of the group, made on this
        // device; `stream` is cubecl's stream of this thread, on which the kernels that wrote
        // the bucket were enqueued (the resources were handed out after them).
        unsafe {
            result::all_reduce(
                send as *const std::ffi::c_void,
                out_res.resource().ptr as *mut std::ffi::c_void,
                len,
                dtype,
                sys::ncclRedOp_t::ncclAvg,
                comm,
                stream as sys::cudaStream_t,
            )
        }
        .map_err(|e| format!("ncclAllReduce: {e:?}"))?;
        drop(communicators);
        let counter = if in_place {
            &super::IN_PLACE
        } else {
            &super::INTO_NEW
        };
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(out.into_tensor())
    }
}
