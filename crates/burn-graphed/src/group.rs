//! Several callables captured together, as PyTorch's `make_graphed_callables` does with a
//! tuple: forward graphs in execution order, backward graphs in reverse, and no copy where one
//! callable's outputs are the next one's inputs.

use burn::module::Module;
use burn::tensor::Device;

use crate::config::GraphedConfig;
use crate::error::GraphedError;
use crate::graphed::Graphed;
use crate::params::{self, ModuleMode, ParamEntry};
use crate::stats::{CaptureSummary, FallbackReason, GraphMemory};
use crate::tensors::{FlatTensor, TensorGroup, TensorSpec};

/// One callable of a group given to [`make_graphed_callables`]: a module, the function that
/// calls it, and where its sample inputs come from.
pub struct Callable<M, I, O> {
    module: M,
    call: fn(&M, I) -> O,
    /// `None`: the previous callable's outputs.
    sample: Option<I>,
}

impl<M, I, O> Callable<M, I, O> {
    /// A callable with its own sample inputs, which must have the shapes, dtypes and
    /// `require_grad` of real use (their values do not matter).
    pub fn new(module: M, call: fn(&M, I) -> O, sample: I) -> Self {
        Self {
            module,
            call,
            sample: Some(sample),
        }
    }

    /// A callable whose inputs are the previous callable's outputs, as returned (flattened in
    /// order and regrouped as `I`). Its forward graph reads the previous graph's output
    /// buffers and its backward graph writes the previous graph's output-gradient buffers, so
    /// when the previous callable's outputs are passed straight in, nothing is copied between
    /// the two. Other tensors are accepted too (they are copied in, as for any input).
    pub fn chained(module: M, call: fn(&M, I) -> O) -> Self {
        Self {
            module,
            call,
            sample: None,
        }
    }
}

/// Runs a callable on flattened inputs; `None` when they do not fit its input type.
pub(crate) type Runner<'a> = Box<dyn Fn(Vec<FlatTensor>) -> Option<Vec<FlatTensor>> + 'a>;

/// A callable with its types erased, as the capture sees it.
pub(crate) struct Member<'a> {
    /// Flattened sample inputs; `None`: the previous member's outputs.
    pub sample: Option<Vec<FlatTensor>>,
    /// The module's float parameters, in visiting order.
    pub params: Vec<ParamEntry>,
    pub mode: ModuleMode,
    /// Runs the callable on the module itself.
    pub eager: Runner<'a>,
    /// Whether flattened tensors fit the callable's input type (count and grouping).
    pub fits: Box<dyn Fn(Vec<FlatTensor>) -> bool + 'a>,
    /// Runs the callable on a copy of the module whose float parameters are replaced, in
    /// visiting order.
    #[cfg_attr(not(feature = "cube"), allow(dead_code))]
    pub with_params: Box<dyn Fn(Vec<FlatTensor>) -> Runner<'a> + 'a>,
}

impl<M: Module, I: TensorGroup, O: TensorGroup> Callable<M, I, O> {
    pub(crate) fn member(&mut self) -> Member<'_> {
        let Callable {
            module,
            call,
            sample,
        } = self;
        let module: &M = module;
        let call = *call;
        let (params, mode) = params::collect(module);
        Member {
            sample: sample.take().map(TensorGroup::flatten),
            params,
            mode,
            eager: Box::new(move |inputs| I::unflatten(inputs).map(|i| call(module, i).flatten())),
            fits: Box::new(|inputs| I::unflatten(inputs).is_some()),
            with_params: Box::new(move |replacements| {
                let mut replacements = replacements.into_iter();
                let copy = params::replace(module.clone(), |_, param| {
                    replacements.next().unwrap_or(param)
                });
                Box::new(move |inputs| I::unflatten(inputs).map(|i| call(&copy, i).flatten()))
            }),
        }
    }
}

/// What [`build`] makes of one member: everything a [`Graphed`] needs besides the module.
pub(crate) struct Built {
    #[cfg(feature = "cube")]
    pub session: Option<std::sync::Arc<crate::cube::session::Session>>,
    /// Why there are no graphs, when there are none.
    pub eager_reason: Option<FallbackReason>,
    pub inputs: Vec<TensorSpec>,
    pub mode: ModuleMode,
    pub device: Device,
    pub summary: CaptureSummary,
    pub memory: GraphMemory,
    /// Whether the callable was captured alone (not in a group of several), which lets it
    /// capture more signatures later.
    #[cfg_attr(not(feature = "cube"), allow(dead_code))]
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

    #[cfg(feature = "cube")]
    if crate::cube::capture::supports_capture(&device) {
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
            #[cfg(feature = "cube")]
            session: None,
            eager_reason: Some(FallbackReason::Unsupported),
            summary: CaptureSummary {
                eager_reason: Some(FallbackReason::Unsupported.to_string()),
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

/// `error` of callable `callable`, saying which callable when it is one of several.
pub(crate) fn in_group(alone: bool, callable: usize, error: GraphedError) -> GraphedError {
    if alone {
        error
    } else {
        GraphedError::InGroup {
            callable,
            error: Box::new(error),
        }
    }
}

/// The error of a group whose first callable is chained (it has nothing to chain to).
pub(crate) fn first_chained() -> GraphedError {
    GraphedError::Chain {
        index: 0,
        detail: "the first callable of a group has no previous callable".into(),
    }
}

/// The error of a chained callable whose inputs do not fit the previous callable's `outputs`.
pub(crate) fn misfit(index: usize, outputs: usize) -> GraphedError {
    GraphedError::Chain {
        index,
        detail: format!(
            "the previous callable's {outputs} output tensor(s) do not fit this callable's inputs"
        ),
    }
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
#[cfg(feature = "cube")]
fn unwritten_source(members: &[Member<'_>]) -> Option<GraphedError> {
    let unreadable = |flat: &FlatTensor| {
        burn::Tensor::<1>::from_dispatch(flat.tensor.clone())
            .inner()
            .try_into_data()
            .err()
            .map(|error| error.to_string())
    };
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

#[cfg(feature = "cube")]
fn captured(members: &[Member<'_>], config: &GraphedConfig) -> Result<Vec<Built>, GraphedError> {
    // A capture that reads a tensor the device never wrote fails (cubecl refuses to seal a
    // recording that skipped a launch); name that tensor rather than the phase it broke.
    let group =
        crate::cube::capture::capture_group(members, config).map_err(|error| match error {
            GraphedError::Capture { .. } => unwritten_source(members).unwrap_or(error),
            other => other,
        })?;
    let group_static_bytes = group.sessions.iter().map(|s| s.static_bytes()).sum();
    let mut previous_device = None;
    let mut built = Vec::with_capacity(members.len());
    for ((member, session), inputs) in members.iter().zip(group.sessions).zip(group.inputs) {
        let device = match &member.sample {
            Some(sample) => sample.first().map(|t| t.device.clone()),
            None => previous_device.clone(),
        }
        .ok_or(GraphedError::NoInputs)?;
        // A chained member's inputs are the outputs of the previous one: autodiff tensors.
        previous_device = Some(device.clone().autodiff());
        let static_bytes = session.static_bytes();
        built.push(Built {
            summary: summary_of(member, &inputs, true, session.outputs.len(), static_bytes),
            memory: GraphMemory {
                static_bytes,
                group_static_bytes,
                capture_pool_growth_bytes: group.pool_growth_bytes,
                capture_released_bytes: group.released_bytes,
            },
            session: Some(session),
            alone: members.len() == 1,
            eager_reason: None,
            inputs,
            mode: member.mode.clone(),
            device,
        });
    }
    Ok(built)
}

mod sealed {
    pub trait Sealed {}
}

/// A tuple of [`Callable`]s that [`make_graphed_callables`] captures together (one to four).
pub trait CallableGroup: sealed::Sealed + Sized {
    /// The graphed callables, one [`Graphed`] per [`Callable`], in the same order.
    type Graphed;

    /// Captures the group; see [`make_graphed_callables`].
    ///
    /// # Errors
    ///
    /// As [`make_graphed_callables`].
    fn capture(self, config: &GraphedConfig) -> Result<Self::Graphed, GraphedError>;
}

/// Captures several callables together, in execution order: the forward graphs in order, then
/// the backward graphs in reverse (as PyTorch's `make_graphed_callables` does with a tuple).
///
/// A callable made with [`Callable::chained`] takes the previous callable's outputs as its
/// inputs: its graphs read and write the previous graphs' buffers directly, so a training step
/// that feeds one callable's outputs straight into the next copies nothing between them, in
/// either direction. Each result is an ordinary [`Graphed`] module (train it, `valid()` it, save
/// it as usual); [`Graphed::memory`] reports the memory the group holds.
///
/// ```no_run
/// use burn::nn::{Linear, LinearConfig};
/// use burn::prelude::*;
/// use burn_graphed::{Callable, GraphedConfig, make_graphed_callables};
///
/// # fn main() -> Result<(), burn_graphed::GraphedError> {
/// let device = Device::default().autodiff();
/// let encoder = LinearConfig::new(64, 32).init(&device);
/// let decoder = LinearConfig::new(32, 64).init(&device);
/// let sample = Tensor::<2>::zeros([16, 64], &device);
/// let (encoder, decoder) = make_graphed_callables(
///     (
///         Callable::new(encoder, Linear::forward::<2>, sample),
///         Callable::chained(decoder, Linear::forward::<2>),
///     ),
///     &GraphedConfig::new(),
/// )?;
/// let x = Tensor::<2>::ones([16, 64], &device);
/// let y = decoder.forward(encoder.forward(x.clone())?)?; // no copy between the two graphs
/// let grads = (y - x).powi_scalar(2).mean().backward(); // both backward graphs
/// # let _ = grads;
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`GraphedError::Chain`] when the first callable is chained or a chained callable's input
/// type does not fit the previous outputs, and every error of [`Graphed::new`]. A failure
/// leaves every module untouched and drops every graph captured so far.
pub fn make_graphed_callables<G: CallableGroup>(
    callables: G,
    config: &GraphedConfig,
) -> Result<G::Graphed, GraphedError> {
    callables.capture(config)
}

macro_rules! callable_group {
    ($($idx:tt: $M:ident $I:ident $O:ident),+) => {
        impl<$($M: Module, $I: TensorGroup, $O: TensorGroup),+> sealed::Sealed
            for ($(Callable<$M, $I, $O>,)+)
        {
        }

        impl<$($M: Module, $I: TensorGroup, $O: TensorGroup),+> CallableGroup
            for ($(Callable<$M, $I, $O>,)+)
        {
            type Graphed = ($(Graphed<$M, $I, $O>,)+);

            fn capture(mut self, config: &GraphedConfig) -> Result<Self::Graphed, GraphedError> {
                let built = build(vec![$(self.$idx.member()),+], config)?;
                let mut built = built.into_iter();
                Ok(($(
                    Graphed::from_built(
                        self.$idx.module,
                        self.$idx.call,
                        built.next().ok_or(GraphedError::NoOutputs)?,
                        config,
                    ),
                )+))
            }
        }
    };
}

callable_group!(0: M0 I0 O0);
callable_group!(0: M0 I0 O0, 1: M1 I1 O1);
callable_group!(0: M0 I0 O0, 1: M1 I1 O1, 2: M2 I2 O2);
callable_group!(0: M0 I0 O0, 1: M1 I1 O1, 2: M2 I2 O2, 3: M3 I3 O3);
