//! A second CUDA stream per NCCL group, on which a data-parallel step's bucketed all-reduces
//! run while the backward goes on in cubecl's stream (`collective`'s `start_mean` and
//! `wait_mean`). A bucket's all-reduce is forked off cubecl's stream by an event (the side
//! stream waits for the kernels that filled the bucket) and its end is recorded in an event of
//! its own. cubecl's stream joins the side stream once, on the last bucket's event (the side
//! stream runs its buckets in order), before anything reads a bucket. Inside a recording the
//! fork draws the side stream into the capture and the join brings it back, as CUDA requires of
//! every stream a capture forks before the capture ends.
//!
//! One join on the last event, not one per bucket: a wait on an earlier bucket's event would
//! be an edge the later one implies, and a graph with such redundant edges launches each of its
//! kernels more slowly (docs/decisions.md, "The all-reduces can start during the backward").
//!
//! Streams and events live as long as the process, as cubecl's streams do: a group's are made
//! at its first overlapped all-reduce, on the device of the stream it forks from.

use std::collections::BTreeMap;
use std::sync::Mutex;

use cudarc::driver::sys::{self, CUevent, CUstream};

/// A group's side stream, the event that forks it off, and one event per bucket of a step.
struct Side {
    /// `CUstream`, as an address.
    stream: usize,
    /// `CUevent`, as an address: recorded on cubecl's stream, waited for by the side stream.
    fork: usize,
    /// `CUevent`s, as addresses: bucket `k`'s all-reduce ended.
    done: Vec<usize>,
    /// The bucket whose all-reduce was enqueued last and cubecl's stream has not joined yet.
    pending: Option<usize>,
}

/// The side streams of this process, by NCCL group.
static SIDES: Mutex<BTreeMap<usize, Side>> = Mutex::new(BTreeMap::new());

fn event() -> Result<usize, String> {
    let mut event: CUevent = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: `event` is a valid place for the event the driver makes, in the current context
    // (the caller made the stream's context current).
    unsafe { sys::cuEventCreate(&mut event, flags) }
        .result()
        .map_err(|e| format!("cuEventCreate: {e}"))?;
    Ok(event as usize)
}

/// The side stream of group `group`, made if this is its first use, waiting for what `main`
/// holds so far: the stream to enqueue bucket `bucket`'s all-reduce on.
///
/// # Safety
///
/// `main` is a live stream of cubecl's server whose context is current on this thread.
pub(super) unsafe fn fork(group: usize, main: CUstream, bucket: usize) -> Result<CUstream, String> {
    let mut sides = crate::sync::lock(&SIDES);
    if let std::collections::btree_map::Entry::Vacant(vacant) = sides.entry(group) {
        let mut stream: CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: `stream` is a valid place for the stream the driver makes, in the current
        // context (this function's contract).
        unsafe { sys::cuStreamCreate(&mut stream, flags) }
            .result()
            .map_err(|e| format!("cuStreamCreate: {e}"))?;
        let side = Side {
            stream: stream as usize,
            fork: event()?,
            done: Vec::new(),
            pending: None,
        };
        vacant.insert(side);
    }
    let side = sides.get_mut(&group).expect("made above");
    while side.done.len() <= bucket {
        side.done.push(event()?);
    }
    let (stream, fork) = (side.stream as CUstream, side.fork as CUevent);
    // SAFETY: `fork` and `stream` are this group's live event and stream, made in `main`'s
    // context; `main` is live (this function's contract). The wait takes the record just
    // made, so one fork event serves every bucket.
    unsafe {
        sys::cuEventRecord(fork, main)
            .result()
            .map_err(|e| format!("cuEventRecord (fork): {e}"))?;
        sys::cuStreamWaitEvent(stream, fork, 0)
            .result()
            .map_err(|e| format!("cuStreamWaitEvent (fork): {e}"))?;
    }
    Ok(stream)
}

/// Records on group `group`'s side stream that bucket `bucket`'s all-reduce, enqueued there
/// last, ended.
///
/// # Safety
///
/// [`fork`] made the group's stream and the bucket's event, and its context is current.
pub(super) unsafe fn done(group: usize, bucket: usize) -> Result<(), String> {
    let mut sides = crate::sync::lock(&SIDES);
    let side = sides
        .get_mut(&group)
        .ok_or_else(|| format!("NCCL group {group} has no side stream"))?;
    let event = *side
        .done
        .get(bucket)
        .ok_or_else(|| format!("NCCL group {group}'s side stream has no bucket {bucket}"))?;
    // SAFETY: the event and stream are live (made by `fork`, never destroyed).
    unsafe { sys::cuEventRecord(event as CUevent, side.stream as CUstream) }
        .result()
        .map_err(|e| format!("cuEventRecord (bucket {bucket} done): {e}"))?;
    side.pending = Some(bucket);
    Ok(())
}

/// Makes `main` wait until every all-reduce enqueued on group `group`'s side stream ended (the
/// last one's event), unless it did already since they were enqueued.
///
/// # Safety
///
/// `main` is a live stream of cubecl's server on the device of the group's side stream.
pub(super) unsafe fn join(group: usize, main: CUstream) -> Result<(), String> {
    let mut sides = crate::sync::lock(&SIDES);
    let Some(side) = sides.get_mut(&group) else {
        return Ok(());
    };
    let Some(bucket) = side.pending.take() else {
        return Ok(());
    };
    let event = side.done[bucket];
    // SAFETY: the event is live (made by `fork`, never destroyed); `main` is live (this
    // function's contract).
    unsafe { sys::cuStreamWaitEvent(main, event as CUevent, 0) }
        .result()
        .map_err(|e| format!("cuStreamWaitEvent (bucket {bucket}): {e}"))
}

/// Group `group`'s side stream, if it has one (`CUstream`, as an address): what an ended
/// group's abort must see drained, as cubecl's stream.
pub(super) fn stream(group: usize) -> Option<usize> {
    crate::sync::lock(&SIDES)
        .get(&group)
        .map(|side| side.stream)
}
