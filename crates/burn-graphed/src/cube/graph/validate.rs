//! Replay validation: right after a forward graph is recorded, it is replayed on new input
//! values and compared with an eager run on the same values, so that a callable whose work a
//! graph cannot repeat (a mask drawn on the host, a value read on the host) is refused.

use burn::backend::ops::{BoolTensorOps, FloatTensorOps, IntTensorOps};
use burn::backend::{
    Backend, Dispatch, DispatchDevice, DispatchGraph, DispatchTensor, TensorMetadata,
};
use burn::tensor::Tensor;

use super::super::buffers::static_fused;
use super::super::copy_op::copy_into;
use super::lifecycle::{announce, capture_error, materialize};
use super::random_state;
use crate::error::{CapturePhase, GraphedError};
use crate::tensors::{ElementKind, FlatTensor, with_kind};

/// Replays `graph`, the forward graph of callable `index` whose static inputs are
/// `static_inputs` and whose outputs are `outputs`, on new input values ([`new_values`]) and
/// compares its outputs with `eager`, an eager run on the same values.
///
/// Same inputs and parameters, same kernels: the two agree up to rounding (fusion may order
/// a reduction differently), so the tolerance is loose (1% of each value plus 0.1% of the
/// output's largest magnitude). What a graph freezes differs by far more: a dropout mask
/// drawn on the host, or a scalar read on the host from the sample's values.
///
/// # Errors
///
/// [`GraphedError::ReplayDiffers`] for the first output that differs, and
/// [`GraphedError::Capture`] when the device fails.
pub(in crate::cube) fn validate_forward(
    index: usize,
    static_inputs: &[DispatchTensor],
    outputs: &[FlatTensor],
    graph: &DispatchGraph,
    dispatch: &DispatchDevice,
    eager: impl FnOnce() -> Result<Vec<FlatTensor>, GraphedError>,
) -> Result<(), GraphedError> {
    let phase = CapturePhase::Validation;
    announce(phase);
    let mut queued = Vec::with_capacity(static_inputs.len());
    for input in static_inputs {
        let shifted = new_values(input);
        queued.push(copy_into(
            &static_fused(input, phase)?,
            &static_fused(&shifted, phase)?,
        ));
    }
    Dispatch::sync(dispatch).map_err(capture_error(phase))?;
    drop(queued);
    // The replay and the eager run must draw the same numbers from device generators.
    let generators = random_state::save();
    materialize(dispatch, graph, phase)?;
    let read = |tensor: &DispatchTensor| -> Result<Vec<f32>, GraphedError> {
        let reason = |error: String| GraphedError::Capture {
            phase,
            reason: format!("reading an output back: {error}"),
        };
        with_kind!(tensor.dtype(), K => Tensor::<1, K>::from_dispatch(tensor.clone())
            .inner()
            .try_into_data())
        .map_err(|error| reason(error.to_string()))?
        .convert::<f32>()
        .try_to_vec::<f32>()
        .map_err(|error| reason(format!("{error:?}")))
    };
    let replayed = outputs
        .iter()
        .map(|o| read(&o.tensor))
        .collect::<Result<Vec<_>, _>>()?;
    random_state::restore(&generators).map_err(capture_error(phase))?;
    let eager = eager()?;
    for (output, (replayed, eager)) in replayed.iter().zip(&eager).enumerate() {
        let eager_values = read(&eager.tensor)?;
        let difference = if eager.is_float() {
            first_difference(replayed, &eager_values)
        } else {
            first_discrete_difference(replayed, &eager_values)
        };
        if let Some(detail) = difference {
            return Err(GraphedError::ReplayDiffers {
                callable: index,
                output,
                detail,
            });
        }
    }
    Ok(())
}

/// Other values for a static input, of its shape and kind: floats scaled by 1.5 and shifted by
/// 0.25; int and bool tensors reversed along their first axis, so that token ids stay valid
/// indices and masks stay masks (a tensor whose rows are all alike keeps its values, and the
/// check then only compares the replay with eager on the sample's values).
fn new_values(input: &DispatchTensor) -> DispatchTensor {
    match ElementKind::of(input.dtype()) {
        ElementKind::Float => Dispatch::float_add_scalar(
            Dispatch::float_mul_scalar(input.clone(), 1.5f32.into()),
            0.25f32.into(),
        ),
        _ if input.shape().num_dims() == 0 => input.clone(),
        ElementKind::Int => Dispatch::int_flip(input.clone(), &[0]),
        ElementKind::Bool => Dispatch::bool_flip(input.clone(), &[0]),
    }
}

/// Where the int or bool values `replayed` differ from `eager`, if in more than 1% of the
/// elements (at least one may differ). Whole numbers have no rounding to allow for, but an
/// argmax over two near-equal values may fall either way when a reduction is ordered
/// differently; a graph that froze the values differs almost everywhere.
pub(in crate::cube) fn first_discrete_difference(
    replayed: &[f32],
    eager: &[f32],
) -> Option<String> {
    let differing = differing(replayed, eager, |r, e| r == e);
    (differing.len() > eager.len().div_ceil(100)).then(|| report(&differing, replayed, eager))?
}

/// The graph's first losses against the last warm-up's (the same state, inputs and generator
/// draws): a loss function whose work a graph cannot repeat (a value read on the host, a mask
/// drawn on the host) gives another loss.
pub(in crate::cube) fn validate_losses(
    replayed: &[DispatchTensor],
    eager: &[DispatchTensor],
) -> Result<(), GraphedError> {
    let phase = CapturePhase::Validation;
    let read = |tensor: &DispatchTensor| -> Result<Vec<f32>, GraphedError> {
        Tensor::<1>::from_dispatch(tensor.clone())
            .try_into_data()
            .map_err(|error| GraphedError::Capture {
                phase,
                reason: format!("reading a loss back: {error}"),
            })?
            .convert::<f32>()
            .try_to_vec::<f32>()
            .map_err(|error| GraphedError::Capture {
                phase,
                reason: format!("reading a loss back: {error:?}"),
            })
    };
    for (index, (replayed, eager)) in replayed.iter().zip(eager).enumerate() {
        if let Some(detail) = first_difference(&read(replayed)?, &read(eager)?) {
            return Err(GraphedError::ReplayDiffers {
                callable: 0,
                output: index,
                detail,
            });
        }
    }
    Ok(())
}

/// Where `replayed` differs from `eager` beyond the validation tolerance (see
/// [`validate_forward`]), if anywhere.
pub(in crate::cube) fn first_difference(replayed: &[f32], eager: &[f32]) -> Option<String> {
    let scale = eager
        .iter()
        .filter(|v| v.is_finite())
        .fold(0.0f32, |m, v| m.max(v.abs()));
    let differing = differing(replayed, eager, |r, e| {
        let both_nan = r.is_nan() && e.is_nan();
        let close = (r - e).abs() <= 1e-2 * e.abs() + 1e-3 * scale + 1e-6;
        // A NaN on one side only is a difference (`close` is false for it).
        both_nan || close
    });
    report(&differing, replayed, eager)
}

/// The positions where `replayed` and `eager` are not `alike`.
fn differing(replayed: &[f32], eager: &[f32], alike: impl Fn(f32, f32) -> bool) -> Vec<usize> {
    replayed
        .iter()
        .zip(eager)
        .enumerate()
        .filter(|(_, (r, e))| !alike(**r, **e))
        .map(|(i, _)| i)
        .collect()
}

/// How many elements differ and the first of them, or `None` when none does.
fn report(differing: &[usize], replayed: &[f32], eager: &[f32]) -> Option<String> {
    let first = *differing.first()?;
    Some(format!(
        "{} of {} elements differ, first at {first}: replayed {}, eager {}",
        differing.len(),
        eager.len(),
        replayed[first],
        eager[first]
    ))
}
