//! One question to cubecl, queued as a fusion operation: do the static buffers that work outside
//! the graphs just wrote (copies into them, fused optimizer updates of them) hold values?
//!
//! cubecl skips a launch that reads memory an earlier failure left unwritten, and marks what it
//! would have written; its graph replay, though, does not look at what the graph reads, so a
//! replay over such a buffer would run on its stale values and mark its outputs written:
//! readable, and wrong. The session queues this operation after the copies of a call, before
//! its replay; it runs in the replay's drain, after the work it asks about, and asks cubecl
//! once for all the buffers (`ComputeClient::check`: one round trip to the device's thread,
//! about 7 us on an idle device, `train_step --check-cost`, but about 45 us inside a training
//! step, where it waits for the device thread's queue: BENCHMARKS.md). The answer goes into the
//! record the session reads after the replay (`buffers::note_checked`).
//!
//! Asking after the replay instead would save queueing this operation, but cubecl settles the
//! graph's whole write set on replay, and a kernel whose bindings carry no read/write
//! attributes counts all of them as written: the mark of an input buffer could be cleared
//! before it is read. Asking in the copy operation itself (the first version) cost one round
//! trip per copy and per optimizer update: 18 on a step of the 16-parameter MLP with
//! `FusedAdam`, against 2 now (one per replay).

use burn_cubecl::CubeBackend;
use burn_fusion::custom::{CustomOpIr, HandleContainer, OperationFn, OperationIr, StreamId};
use burn_fusion::custom::{TensorId, TensorIr};
use burn_fusion::{FusionBackend, FusionRuntime};

use super::buffers::{FusedTensor, StaticBuffer, key_of, note_checked};

/// Fusion's handles of burn's cubecl backend.
type Handles =
    HandleContainer<<<CubeBackend as FusionBackend>::FusionRuntime as FusionRuntime>::FusionHandle>;

/// Queues the question for `buffers` (not empty) on the caller's stream. Returns the
/// operation's output, a tensor over the first buffer, which the caller keeps until the stream
/// drained (fusion skips work whose results nobody holds); `None` when `buffers` is empty.
pub(crate) fn queue_check(buffers: &[&StaticBuffer]) -> Option<FusedTensor> {
    use burn::backend::TensorMetadata;
    let first = &buffers.first()?.fused;
    let client = first.client.clone();
    let output = TensorIr::uninit(client.create_empty_handle(), first.shape(), first.dtype());
    let output_id = output.id;
    // The buffers' own handles stay with their `StaticBuffer`s, so every input is read-only
    // here: fusion neither frees nor reuses them.
    let inputs: Vec<TensorIr> = buffers
        .iter()
        .map(|buffer| buffer.fused.clone().into_ir())
        .collect();
    let description = CustomOpIr {
        id: "burn_graphed_check_buffers".into(),
        inputs: inputs.clone(),
        outputs: vec![output],
        scalars: Vec::new(),
    };
    let operation = OperationFn(move |handles: &mut Handles| {
        execute(&inputs, output_id, handles);
        Ok(())
    });
    client
        .register(
            StreamId::current(),
            OperationIr::Custom(description),
            operation,
        )
        .into_iter()
        .next()
}

/// The operation, on fusion's server: asks cubecl once for all the buffers and, only when that
/// answer is a failure, once per buffer, to know which; records each buffer's answer.
fn execute(inputs: &[TensorIr], output: TensorId, handles: &mut Handles) {
    let buffers: Vec<_> = inputs
        .iter()
        .map(|input| handles.get_float_tensor::<CubeBackend>(input))
        .collect();
    // The output is the first buffer itself (the caller holds it until the drain).
    handles.register_float_tensor::<CubeBackend>(&output, buffers[0].clone());
    let client = &buffers[0].client;
    let all = client.check(buffers.iter().map(|tensor| &tensor.handle));
    for tensor in &buffers {
        let outcome = match &all {
            Ok(()) => Ok(()),
            Err(_) => tensor
                .client
                .check([&tensor.handle])
                .map_err(|error| error.to_string()),
        };
        note_checked(key_of(tensor), outcome);
    }
}
