//! NCCL itself (`cuda` only): the unique id, the communicators made at a group's first
//! all-reduce, the watchdog of their asynchronous errors, the abort of an ended group's, and
//! the all-reduce enqueued on cubecl's stream or started on the group's side stream.

use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cudarc::driver::sys::CUstream;
use cudarc::nccl::{result, sys};

use super::super::cuda_stream::{CudaServer, make_current};
use super::super::dense::{Dense, is_dense};
use super::{COMMUNICATORS, On, UNIQUE_ID_BYTES};

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
        abort(comm as usize, &[], &reason);
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
            log::warn!(
                "burn-graphed: no NCCL watchdog thread ({e}); errors surface at the next agreement"
            );
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

/// Aborts `comm` (taken out of its group: no one else uses it again) unless its `streams`
/// (cubecl's stream of its last all-reduce, its side stream) finish on their own within the
/// drain grace: nothing waits then, and NCCL's abort of a communicator whose peers live and
/// wait for nothing is not needed (and was seen to take minutes:
/// `tests/scenarios/process_faults.rs`).
pub(super) fn abort(comm: usize, streams: &[Option<usize>], reason: &str) {
    if !super::ABORT.load(std::sync::atomic::Ordering::SeqCst) {
        log::warn!("burn-graphed: NCCL abort turned off; the group ended ({reason})");
        return;
    }
    let streams: Vec<CUstream> = streams.iter().flatten().map(|&s| s as CUstream).collect();
    if let Some(&first) = streams.first() {
        // SAFETY: each stream is cubecl's stream of the group's last all-reduce or the
        // group's side stream, on one device; both kinds live as long as the process's
        // server, which outlives every group of the process.
        let current = unsafe { make_current(first) };
        let deadline = std::time::Instant::now() + super::DRAIN_GRACE;
        while current.is_ok() && std::time::Instant::now() < deadline {
            // SAFETY: as above; querying a stream is thread-safe.
            let drained = streams.iter().all(|&stream| unsafe {
                cudarc::driver::sys::cuStreamQuery(stream)
                    == cudarc::driver::sys::CUresult::CUDA_SUCCESS
            });
            if drained {
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

/// The mean of `bucket` over group `group`, in the bucket's buffer or a new dense tensor,
/// enqueued where `on` says.
pub(super) fn mean(bucket: &CubeTensor, group: usize, on: On) -> Result<CubeTensor, String> {
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
    let main: CUstream = out_res.resource().stream;
    if main.is_null() {
        return Err("the buffer names no stream".into());
    }
    // SAFETY: `main` is a live stream of cubecl's server: its pool holds `out`, which we
    // hold.
    unsafe { make_current(main) }.map_err(|(call, e)| format!("{call}: {e}"))?;
    make_communicator(group, main)?;
    let on = match on {
        On::Side(_) | On::MainAfterSide if !super::on_side_stream() => On::Main,
        on => on,
    };
    let stream = match on {
        // SAFETY: `main` is live and its context current (above).
        On::Side(index) => unsafe { super::super::side_stream::fork(group, main, index) }?,
        On::MainAfterSide => {
            // SAFETY: `main` is live and its context current (above).
            unsafe { super::super::side_stream::join(group, main) }?;
            main
        }
        On::Main => main,
    };
    let mut communicators = crate::sync::lock(&COMMUNICATORS);
    let comm = communicator(&mut communicators, group)?;
    // SAFETY: both addresses are live device allocations of at least `len` elements of
    // `dtype` (`source` dense over the bucket, `out` made for it, or both the bucket's own
    // dense buffer, which NCCL reduces in place, and which nothing else holds), held until
    // the operation returns, after which the stream orders every later use after the
    // all-reduce; `comm` is this process's communicator of the group, made on this
    // device; `stream` is cubecl's stream of this thread, on which the kernels that wrote
    // the bucket were enqueued (the resources were handed out after them), or the group's
    // side stream, which waits for them (`fork`), and which cubecl's stream waits for
    // before any later use (`wait`), the source held until then (`HELD`).
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
    if let On::Side(index) = on {
        // SAFETY: `fork` made the side stream and this bucket's event; the context is
        // current (above).
        unsafe { super::super::side_stream::done(group, index) }?;
        if let Some(source) = source {
            crate::sync::lock(&super::HELD).push((group, index, source.into_tensor()));
        }
    }
    let counter = if in_place {
        &super::IN_PLACE
    } else {
        &super::INTO_NEW
    };
    counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Ok(out.into_tensor())
}

/// `mean` (bucket `index` of group `group`, started on the side stream) once the stream
/// cubecl's kernels run on waited for its all-reduce (and every one started before it, the
/// side stream's last: the first wait of a step joins, the others find it joined); the
/// bucket's source, where it was not reduced in place, is let go.
pub(super) fn wait(mean: &CubeTensor, group: usize, index: usize) -> Result<CubeTensor, String> {
    if !super::on_side_stream() {
        // Enqueued on cubecl's stream (`mean`): in order already.
        return Ok(mean.clone());
    }
    let resource = mean
        .client
        .get_resource::<CudaServer>(mean.handle.clone())
        .map_err(|e| format!("cubecl did not hand out the mean's buffer: {e}"))?;
    let main: CUstream = resource.resource().stream;
    if main.is_null() {
        return Err("the buffer names no stream".into());
    }
    // SAFETY: `main` is a live stream of cubecl's server: its pool holds `mean`, which we
    // hold; the bucket's event was recorded when its all-reduce was enqueued (`mean`).
    unsafe {
        make_current(main).map_err(|(call, e)| format!("{call}: {e}"))?;
        super::super::side_stream::join(group, main)?;
    }
    crate::sync::lock(&super::HELD).retain(|(g, i, _)| (*g, *i) != (group, index));
    Ok(mean.clone())
}
