//! A callable as the capture sees it: [`Callable`] (a module, the function that calls it and
//! its sample inputs) and [`Member`], the same with its types erased, plus the errors that
//! name a callable of a group.

use burn::module::Module;

use crate::error::GraphedError;
use crate::params::{self, ModuleMode, ParamEntry};
use crate::tensors::{FlatTensor, TensorGroup};

/// One callable of a group given to [`make_graphed_callables`](crate::make_graphed_callables): a module, the function that
/// calls it, and where its sample inputs come from.
pub struct Callable<M, I, O> {
    pub(crate) module: M,
    pub(crate) call: fn(&M, I) -> O,
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

/// A whole step's loss function with its types erased: runs the model, with its float
/// parameters replaced by the given tensors (visiting order), on flattened inputs; `None` when
/// they do not fit its input type.
pub(crate) type StepRunner<'a> =
    Box<dyn Fn(&[burn::backend::DispatchTensor], Vec<FlatTensor>) -> Option<StepRun> + 'a>;

/// What a [`StepRunner`] returns.
#[cfg_attr(not(feature = "cube"), allow(dead_code))] // read by the engine, with `cube`
pub(crate) struct StepRun {
    /// The loss.
    pub loss: burn::backend::DispatchTensor,
    /// The model's float parameters after the call, in visiting order: where the forward
    /// updates float state (burn's `BatchNorm` its running statistics), the new values. Empty
    /// where the model has no parameter that does not require grad.
    pub params_after: Vec<burn::backend::DispatchTensor>,
}

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
    #[cfg_attr(not(feature = "cube"), allow(dead_code))] // the engine's, with `cube`
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
