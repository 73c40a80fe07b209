//! Turning callables into graphs: the checks before any capture, then the engine's capture of
//! the whole group, or, where the backend cannot capture, the plan to run every call eagerly.

use burn::tensor::Device;

use crate::callable::{Member, first_chained, in_group, misfit};
use crate::config::GraphedConfig;
use crate::cube;
use crate::error::GraphedError;
use crate::params::{self, ModuleMode};
use crate::stats::{CaptureSummary, EagerReason, GraphMemory};
use crate::tensors::{FlatTensor, TensorSpec};

/// What [`build`] makes of one member: everything a [`Graphed`](crate::Graphed) needs besides the module.
pub(crate) struct Built {
    /// The graphs; `None` where the backend cannot capture.
    pub graphs: Option<cube::Graphs>,
    pub inputs: Vec<TensorSpec>,
    pub mode: ModuleMode,
    pub device: Device,
    pub summary: CaptureSummary,
    pub memory: GraphMemory,
    /// Whether the callable was captured alone (not in a group of several), which lets it
    /// capture more signatures later.
    pub alone: bool,
}

/// Checks the members and captures them together (or prepares eager execution where the
/// backend cannot capture).
pub(crate) fn build(
    mut members: Vec<Member<'_>>,
    config: &GraphedConfig,
) -> Result<Vec<Built>, GraphedError> {
    let device = match members.first().map(|m| m.sample.as_ref()) {
        Some(Some(sample)) => sample.first().ok_or(GraphedError::NoInputs)?.device.clone(),
        Some(None) => return Err(first_chained()),
        None => return Err(GraphedError::NoInputs),
    };
    let alone = members.len() == 1;
    for (callable, member) in members.iter().enumerate() {
        check_member(member, &device, config).map_err(|error| in_group(alone, callable, error))?;
    }

    if cube::supports_graphs(&device) {
        return captured(&members, config);
    }
    if config.require_graphs {
        return Err(GraphedError::Unsupported {
            device: format!("{device:?}"),
        });
    }
    // Every call runs eagerly. A chained member's input specification is the previous
    // member's output: run the chain once to learn it.
    let mut built = Vec::with_capacity(members.len());
    let mut previous_outputs: Option<Vec<FlatTensor>> = None;
    for index in 0..members.len() {
        let sample = match members[index].sample.take() {
            Some(sample) => sample,
            None => {
                let outputs = previous_outputs.take().unwrap_or_default();
                if !(members[index].fits)(outputs.clone()) {
                    return Err(misfit(index, outputs.len()));
                }
                outputs
            }
        };
        let next_chained = members.get(index + 1).is_some_and(|m| m.sample.is_none());
        let member = &members[index];
        let inputs: Vec<TensorSpec> = sample.iter().map(FlatTensor::spec).collect();
        let member_device = sample.first().map_or(device.clone(), |t| t.device.clone());
        if next_chained {
            previous_outputs = (member.eager)(sample);
        }
        let summary = summary_of(member, &inputs, false, 0, 0);
        built.push(Built {
            graphs: None,
            summary: CaptureSummary {
                eager_reason: Some(EagerReason::Unsupported.to_string()),
                ..summary
            },
            inputs,
            mode: member.mode.clone(),
            device: member_device,
            memory: GraphMemory::default(),
            alone: members.len() == 1,
        });
    }
    Ok(built)
}

/// The checks of one member before any capture: sample inputs, an autodiff module, trainable
/// parameters only (unless allowed).
fn check_member(
    member: &Member<'_>,
    device: &Device,
    config: &GraphedConfig,
) -> Result<(), GraphedError> {
    if member.sample.as_ref().is_some_and(Vec::is_empty) {
        return Err(GraphedError::NoInputs);
    }
    let param_device = params::device_of(&member.params).unwrap_or_else(|| device.clone());
    if !param_device.is_autodiff() {
        return Err(GraphedError::NotAutodiff {
            what: "the module",
            device: format!("{param_device:?}"),
        });
    }
    for (index, param) in member.params.iter().enumerate() {
        if !param.tensor.require_grad && !config.allow_non_trainable_params {
            return Err(GraphedError::NonTrainableState {
                index,
                shape: param.tensor.shape.clone(),
            });
        }
    }
    Ok(())
}

fn summary_of(
    member: &Member<'_>,
    inputs: &[TensorSpec],
    graphed: bool,
    outputs: usize,
    static_bytes: u64,
) -> CaptureSummary {
    CaptureSummary {
        graphed,
        eager_reason: None,
        inputs: inputs.len(),
        inputs_requiring_grad: inputs.iter().filter(|t| t.require_grad).count(),
        outputs,
        params: member.params.len(),
        trainable_params: member
            .params
            .iter()
            .filter(|p| p.tensor.require_grad)
            .count(),
        static_bytes,
    }
}

/// Why a capture of `members` failed, when the cause is a tensor it was given: the first sample
/// input or parameter (members in order, inputs before parameters) that does not read back.
/// Asked only after a capture failed, so a capture that succeeds reads nothing.
fn unwritten_source(members: &[Member<'_>]) -> Option<GraphedError> {
    let unreadable = FlatTensor::read_back_error;
    let alone = members.len() == 1;
    members.iter().enumerate().find_map(|(callable, member)| {
        let input = member
            .sample
            .iter()
            .flatten()
            .enumerate()
            .find_map(|(index, flat)| {
                unreadable(flat).map(|reason| GraphedError::InputNotWritten { index, reason })
            });
        input
            .or_else(|| {
                member.params.iter().enumerate().find_map(|(index, param)| {
                    unreadable(&param.tensor).map(|reason| GraphedError::ParameterNotWritten {
                        index,
                        shape: param.tensor.shape.clone(),
                        reason,
                    })
                })
            })
            .map(|error| in_group(alone, callable, error))
    })
}

fn captured(members: &[Member<'_>], config: &GraphedConfig) -> Result<Vec<Built>, GraphedError> {
    // A capture that reads a tensor the device never wrote fails (cubecl refuses to seal a
    // recording that skipped a launch); name that tensor rather than the phase it broke.
    let group = cube::capture_group(members, config).map_err(|error| match error {
        GraphedError::Capture { .. } => unwritten_source(members).unwrap_or(error),
        other => other,
    })?;
    let group_static_bytes = group.members.iter().map(|m| m.static_bytes).sum();
    let mut previous_device = None;
    let mut built = Vec::with_capacity(members.len());
    for (member, captured) in members.iter().zip(group.members) {
        let device = match &member.sample {
            Some(sample) => sample.first().map(|t| t.device.clone()),
            None => previous_device.clone(),
        }
        .ok_or(GraphedError::NoInputs)?;
        // A chained member's inputs are the outputs of the previous one: autodiff tensors.
        previous_device = Some(device.clone().autodiff());
        let static_bytes = captured.static_bytes;
        built.push(Built {
            summary: summary_of(
                member,
                &captured.inputs,
                true,
                captured.outputs,
                static_bytes,
            ),
            memory: GraphMemory {
                static_bytes,
                group_static_bytes,
                capture_pool_growth_bytes: group.pool_growth_bytes,
                capture_released_bytes: group.released_bytes,
            },
            graphs: Some(captured.graphs),
            alone: members.len() == 1,
            inputs: captured.inputs,
            mode: member.mode.clone(),
            device,
        });
    }
    Ok(built)
}

/// Captures the forward graph of a call without autodiff (evaluation, serving; see
/// `cube::capture_inference`): the graphs, the memory they hold and the number of outputs.
pub(crate) fn build_inference(
    member: &Member<'_>,
    config: &GraphedConfig,
) -> Result<(cube::Graphs, GraphMemory, usize), GraphedError> {
    let group = cube::capture_inference(member, config).map_err(|error| match error {
        GraphedError::Capture { .. } => {
            unwritten_source(std::slice::from_ref(member)).unwrap_or(error)
        }
        other => other,
    })?;
    let (pool_growth, released) = (group.pool_growth_bytes, group.released_bytes);
    let captured = group
        .members
        .into_iter()
        .next()
        .ok_or(GraphedError::FEWER_GRAPHS)?;
    let outputs = captured.outputs;
    Ok((
        captured.graphs,
        GraphMemory {
            static_bytes: captured.static_bytes,
            group_static_bytes: captured.static_bytes,
            capture_pool_growth_bytes: pool_growth,
            capture_released_bytes: released,
        },
        outputs,
    ))
}
