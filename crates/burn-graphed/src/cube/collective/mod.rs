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

/// The sources of all-reduces started on a side stream into a new buffer (group, bucket index,
/// source): held until cubecl's stream waits for the all-reduce, so that cubecl does not hand
/// their memory out again while the side stream reads it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
static HELD: Mutex<Vec<(usize, usize, CubeTensor)>> = Mutex::new(Vec::new());

/// Whether [`start_mean`]'s all-reduces fork onto the group's side stream (the default), or are
/// enqueued on cubecl's stream where they start, in the backward's order ([`wait_mean`] then
/// waits for nothing): a test's A/B of what the fork and the joins cost where nothing overlaps.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
static SIDE_STREAM: AtomicBool = AtomicBool::new(true);

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn on_side_stream() -> bool {
    SIDE_STREAM.load(std::sync::atomic::Ordering::Relaxed)
}

/// Makes the all-reduces started after it run on the group's side stream (`true`, the default)
/// or on cubecl's stream.
#[cfg(feature = "testing")]
pub(crate) fn set_side_stream(on: bool) {
    SIDE_STREAM.store(on, std::sync::atomic::Ordering::Relaxed);
}

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
        let streams = [stream, super::side_stream::stream(group)];
        nccl::abort(comm, &streams, reason);
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
    collective_op(bucket, group, |fused| {
        <Cube as CollectiveOps>::nccl_mean(fused, group)
    })
}

/// Where an all-reduce is enqueued.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Clone, Copy)]
enum On {
    /// cubecl's stream, in order.
    Main,
    /// The group's side stream, forked off cubecl's after what it holds so far, as bucket
    /// `index` of a step.
    Side(usize),
    /// cubecl's stream, once it joined the side stream: a step's last bucket, which nothing is
    /// left to overlap.
    MainAfterSide,
}

/// [`mean`] of bucket `index` of a step whose all-reduces start during the backward: enqueued on
/// the group's side stream (`side_stream`), after what cubecl's stream holds so far, so that the
/// backward's later kernels run beside it; or (`last`: the step's last bucket, which starts as
/// its backward ends) on cubecl's stream after it joined the side stream, so that the step's
/// graph holds one branch and no edge another implies. Every rank starts the same buckets in
/// the same order; [`wait_mean`] makes cubecl's stream wait for it before anything reads the
/// mean.
pub(crate) fn start_mean(bucket: Tensor<1>, group: usize, index: usize, last: bool) -> Tensor<1> {
    collective_op(bucket, group, |fused| {
        <Cube as CollectiveOps>::nccl_start_mean(fused, group, index, last)
    })
}

/// `mean`, [`start_mean`]'s result for bucket `index`, once cubecl's stream waited for its
/// all-reduce: the same buffer.
pub(crate) fn wait_mean(mean: Tensor<1>, group: usize, index: usize) -> Tensor<1> {
    collective_op(mean, group, |fused| {
        <Cube as CollectiveOps>::nccl_wait_mean(fused, group, index)
    })
}

/// `op` on `bucket`'s fusion tensor, or `bucket` itself where it is not on burn's cubecl
/// backend (the group's failure says so).
fn collective_op(
    bucket: Tensor<1>,
    group: usize,
    op: impl FnOnce(FloatTensor<Cube>) -> FloatTensor<Cube>,
) -> Tensor<1> {
    let bucket = bucket.inner();
    match bucket.clone().try_into_primitive::<Cube>() {
        Ok(fused) => {
            // The operation alone holds the bucket where the caller handed over its last
            // reference: fusion marks it read-write, and the all-reduce reduces it in place.
            drop(bucket);
            Tensor::from_primitive::<Cube>(op(fused))
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

    /// [`nccl_mean`](Self::nccl_mean) on the group's side stream, as bucket `index` of a step,
    /// or after it (`last`) ([`start_mean`]).
    #[fusion(meta = |bucket, _group, _index, _last| bucket.clone())]
    fn nccl_start_mean(
        bucket: FloatTensor<Self>,
        group: usize,
        index: usize,
        last: bool,
    ) -> FloatTensor<Self>;

    /// `mean` once cubecl's stream waited for bucket `index`'s all-reduce ([`wait_mean`]).
    #[fusion(meta = |mean, _group, _index| mean.clone())]
    fn nccl_wait_mean(mean: FloatTensor<Self>, group: usize, index: usize) -> FloatTensor<Self>;
}

impl CollectiveOps for CubeBackend {
    fn nccl_mean(bucket: CubeTensor, group: usize) -> CubeTensor {
        enqueued(bucket, group, |bucket| nccl::mean(bucket, group, On::Main))
    }

    fn nccl_start_mean(bucket: CubeTensor, group: usize, index: usize, last: bool) -> CubeTensor {
        let on = if last {
            On::MainAfterSide
        } else {
            On::Side(index)
        };
        enqueued(bucket, group, |bucket| nccl::mean(bucket, group, on))
    }

    fn nccl_wait_mean(mean: CubeTensor, group: usize, index: usize) -> CubeTensor {
        enqueued(mean, group, |mean| nccl::wait(mean, group, index))
    }
}

/// Without CUDA no group joins (`join`'s callers ask `is_cuda` first); were one reached, it
/// fails.
#[cfg(not(feature = "cuda"))]
mod nccl {
    use burn_cubecl::tensor::CubeTensor;

    const NO_NCCL: &str = "NCCL needs burn-graphed's cuda feature";

    pub(super) fn mean(_: &CubeTensor, _: usize, _: super::On) -> Result<CubeTensor, String> {
        Err(NO_NCCL.into())
    }

    pub(super) fn wait(_: &CubeTensor, _: usize, _: usize) -> Result<CubeTensor, String> {
        Err(NO_NCCL.into())
    }
}

/// `enqueue`'s tensor, or `tensor` itself where it failed (the group's failure says why).
fn enqueued(
    tensor: CubeTensor,
    group: usize,
    enqueue: impl FnOnce(&CubeTensor) -> Result<CubeTensor, String>,
) -> CubeTensor {
    match enqueue(&tensor) {
        Ok(out) => out,
        Err(reason) => {
            fail(group, reason);
            tensor
        }
    }
}

#[cfg(feature = "cuda")]
mod nccl;
