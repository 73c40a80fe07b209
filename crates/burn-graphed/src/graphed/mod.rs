//! [`Graphed`]: a module wrapper whose calls replay captured forward and backward graphs.
//!
//! Over 600 lines: the public type's methods with their documentation (about half the file),
//! its `Module` implementation and the plan of a call; the routing is `route.rs`'s and the
//! capture `build.rs`'s.

pub(crate) mod build;
pub(crate) mod group;

use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use burn::module::{
    Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, ModuleVisitor,
};
use burn::tensor::Device;

use crate::callable::Callable;
use crate::config::{GraphedConfig, MismatchPolicy};
use crate::cube::{Admitted, Graphs, ParamHandles};
use crate::error::GraphedError;
use crate::graphed::build::{Built, build, build_inference};
use crate::host_phases::{self, HostPhase};
use crate::params::{self, ModuleMode};
use crate::route::{OnMiss, Route, Routed, Router};
use crate::stats::{CaptureSummary, EagerReason, GraphMemory, GraphStats, Prepared};
use crate::sync::lock;
use crate::tensors::{FlatTensor, TensorGroup, TensorSpec};

/// State shared by every copy of a [`Graphed`] module (optimizer steps and `valid()` make
/// copies): the router (the graphs by input signature, the eager counters), the capture's
/// signature, and the counters of evicted graphs.
struct Shared {
    /// The captured graphs, training and inference, by signature.
    router: Router<Graphs, Signature>,
    /// The signature of the first capture (the sample's).
    inputs: Vec<TensorSpec>,
    mode: ModuleMode,
    device: Device,
    /// Configuration of the first capture, for the captures of new signatures.
    config: GraphedConfig,
    /// Whether new training signatures may be captured (a callable captured alone,
    /// `max_graphs > 1`).
    recapture: bool,
    summary: CaptureSummary,
    memory: GraphMemory,
    /// The replay counters of graphs evicted from the cache (live graphs count their own).
    retired: Mutex<GraphStats>,
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("summary", &self.summary)
            .finish_non_exhaustive()
    }
}

/// What graphs serve: an input signature, for training calls, or for inference calls (calls
/// without autodiff) of a module with the given train/eval flags.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Signature {
    /// The flags of the module, for inference graphs (which hold its eval-time behaviour);
    /// `None` for training graphs, whose calls are checked against the capture's mode.
    inference: Option<Vec<bool>>,
    inputs: Vec<TensorSpec>,
}

/// A call the router sent to replay: the graphs, their admission, and, for a training call,
/// the module's float parameters (visiting order: the outputs' autodiff parents; an inference
/// call has no use for them).
struct Call {
    graphs: Graphs,
    admitted: Admitted,
    params: Vec<FlatTensor>,
}

/// Where a call's signature leads: the key of its graphs, and what a miss does (`Some`: run
/// eagerly for that reason, where this callable captures no more training signatures).
type Plan = (Signature, Option<EagerReason>);

/// What a call needs to know of the module: its float parameters, whether one of them is on
/// autodiff, its train/eval flags, and how its mode compares with the capture's. Collected at a
/// [`Graphed`] value's first call and kept for the value's life: its module never changes,
/// since every way to another module (an optimizer step, `valid()`, a record, a device move)
/// makes a new value ([`Graphed::wrapping`]), which collects again.
struct ModuleFacts {
    params: Vec<FlatTensor>,
    /// `params` as the engine's handles, made at the first admitted call.
    handles: ParamHandles,
    autodiff: bool,
    flags: Vec<bool>,
    /// Parameters added, removed, replaced or reshaped since capture
    /// ([`ModuleMode::structural_difference`]).
    structural: Option<String>,
    /// Whether the module's mode differs from the capture's ([`ModuleMode::difference`]).
    mode_changed: bool,
}

impl ModuleFacts {
    fn of<M: Module>(module: &M, captured: &ModuleMode) -> Self {
        let (params, mode) = params::collect(module);
        let params: Vec<FlatTensor> = params.into_iter().map(|p| p.tensor).collect();
        Self {
            autodiff: params.iter().any(|t| t.device.is_autodiff()),
            structural: mode.structural_difference(captured),
            mode_changed: mode.difference(captured).is_some(),
            flags: mode.flags,
            params,
            handles: ParamHandles::default(),
        }
    }
}

/// A module whose forward pass and autodiff backward pass replay captured graphs.
///
/// Made by [`Graphed::new`] from a module, the function that calls it, and sample inputs.
/// It is itself a [`Module`]: optimizers, records and `valid()` see the wrapped module's
/// parameters, and every copy shares the captured graphs.
///
/// A call replays the graphs when it matches the capture: same input shapes, dtypes and
/// `require_grad`, the module in the same train/eval state with the same parameters, on an
/// autodiff device, on the capturing thread, with the previous call's backward done. Any other
/// call runs the wrapped function eagerly (or fails, with
/// [`MismatchPolicy::Error`]); [`Graphed::stats`] counts both.
///
/// After an optimizer step the parameters are new tensors: the next call copies them into the
/// graphs' parameter buffers (one device copy per changed parameter). Inputs are copied into the
/// static input buffers unless they are those buffers already.
pub struct Graphed<M, I, O> {
    inner: M,
    call: fn(&M, I) -> O,
    shared: Arc<Shared>,
    /// `inner`'s facts, from this value's first call on; never carried to another value.
    facts: OnceLock<ModuleFacts>,
}

impl<M, I, O> Graphed<M, I, O> {
    /// `inner` served by the graphs of `shared`: the one way to a value, so that no value
    /// starts with another module's [`ModuleFacts`].
    fn wrapping(inner: M, call: fn(&M, I) -> O, shared: Arc<Shared>) -> Self {
        Self {
            inner,
            call,
            shared,
            facts: OnceLock::new(),
        }
    }

    /// The value serving `f(inner)`. This value's facts are dropped first: they hold clones of
    /// the parameters, and a mapper that updates a parameter in place (the fused optimizers)
    /// does so only where nothing else holds it.
    fn rewrap(self, f: impl FnOnce(M) -> M) -> Self {
        let Self {
            inner,
            call,
            shared,
            facts,
        } = self;
        drop(facts);
        Self::wrapping(f(inner), call, shared)
    }
}

impl<M: Clone, I, O> Clone for Graphed<M, I, O> {
    fn clone(&self) -> Self {
        Self::wrapping(self.inner.clone(), self.call, self.shared.clone())
    }
}

impl<M: fmt::Debug, I, O> fmt::Debug for Graphed<M, I, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Graphed")
            .field("inner", &self.inner)
            .field("capture", &self.shared.summary)
            .finish()
    }
}

impl<M, I, O> Graphed<M, I, O>
where
    M: Module,
    I: TensorGroup,
    O: TensorGroup,
{
    /// Captures `call(&module, sample)`'s forward pass and autodiff backward pass as graphs.
    ///
    /// `module` must be on an autodiff device in training mode, as it will be used; `sample`
    /// must have the shapes, dtypes and `require_grad` of the real inputs (its values do not
    /// matter). The module itself is not modified: the graphs run on copies of its parameters,
    /// refreshed before each call.
    ///
    /// On a backend that cannot capture graphs (e.g. Flex) the result runs every call eagerly,
    /// unless [`GraphedConfig::require_graphs`] asks for an error.
    ///
    /// # Errors
    ///
    /// [`GraphedError::NoInputs`], [`GraphedError::NoOutputs`], [`GraphedError::NotAutodiff`],
    /// [`GraphedError::NonTrainableState`], [`GraphedError::UnusedInput`],
    /// [`GraphedError::TooManyParents`] (more than 4096 inputs and parameters),
    /// [`GraphedError::Capture`] (with the failing step; the device is left out of capture mode
    /// and usable), [`GraphedError::ReplayDiffers`] when the first replay does not reproduce
    /// the eager run ([`GraphedConfig::validate_replay`], on by default),
    /// [`GraphedError::InputNotWritten`] and [`GraphedError::ParameterNotWritten`]
    /// when the capture failed on a sample input or parameter whose values the device never
    /// wrote (an earlier failed allocation or launch), and [`GraphedError::Unsupported`] when
    /// graphs are required but impossible. After any of them the module is untouched and the
    /// device usable.
    pub fn new(
        module: M,
        call: fn(&M, I) -> O,
        sample: I,
        config: &GraphedConfig,
    ) -> Result<Self, GraphedError> {
        let mut callable = Callable::new(module, call, sample);
        let built = build(vec![callable.member()], config)?
            .into_iter()
            .next()
            .ok_or(GraphedError::FEWER_GRAPHS)?;
        Ok(Self::from_built(callable.module, call, built, config))
    }

    /// Graphs `call(&module, x)` for inference only (serving): `module` on a device without
    /// autodiff (or after `valid()`), one forward graph per sample, captured now. `samples` are
    /// the shape buckets a server pads its requests to, e.g. batch sizes 1, 2, 4 and 8 (the
    /// padding, and slicing the outputs back, are the caller's); a call of another signature
    /// is captured at first use within [`GraphedConfig::max_graphs`] (at least one per
    /// sample is kept), or runs eagerly beyond the cache's limits. Calls replay with the same
    /// input-copy rule and output policy as training calls; under the default
    /// [`OutputPolicy::Guarded`](crate::OutputPolicy::Guarded) a call replays once the
    /// previous call's outputs are dropped.
    ///
    /// # Errors
    ///
    /// [`GraphedError::NoInputs`] without samples, [`GraphedError::NotAutodiff`]'s opposite:
    /// [`GraphedError::InvalidArgument`] for a module on an autodiff device, and the errors of
    /// a capture as for [`Graphed::new`]. On a backend that cannot capture every call runs
    /// eagerly (unless [`GraphedConfig::require_graphs`]).
    pub fn inference(
        module: M,
        call: fn(&M, I) -> O,
        samples: Vec<I>,
        config: &GraphedConfig,
    ) -> Result<Self, GraphedError> {
        let buckets = samples.len();
        let mut samples = samples.into_iter();
        let first = samples.next().ok_or(GraphedError::NoInputs)?;
        let config = config
            .clone()
            .with_graph_inference(true)
            .with_max_graphs(config.max_graphs.max(buckets));
        let mut callable = Callable::new(module, call, first);
        let member = callable.member();
        let (params, mode) = (member.params.clone(), member.mode.clone());
        let sample = member.sample.clone().unwrap_or_default();
        let device = sample
            .first()
            .map(|t| t.device.clone())
            .ok_or(GraphedError::NoInputs)?;
        if params::device_of(&params).is_some_and(|d| d.is_autodiff()) || device.is_autodiff() {
            return Err(GraphedError::InvalidArgument {
                argument: "module",
                detail: "inference graphs take a module and samples on a device without \
                         autodiff (`valid()` gives one); a training module is graphed with \
                         `Graphed::new`"
                    .into(),
            });
        }
        let inputs: Vec<TensorSpec> = sample.iter().map(FlatTensor::spec).collect();
        let captured = if crate::cube::supports_graphs(&device) {
            Some(build_inference(&member, &config)?)
        } else if config.require_graphs {
            return Err(GraphedError::Unsupported {
                device: format!("{device:?}"),
            });
        } else {
            None
        };
        drop(member);
        let summary = CaptureSummary {
            graphed: captured.is_some(),
            eager_reason: captured
                .is_none()
                .then(|| EagerReason::Unsupported.to_string()),
            inputs: inputs.len(),
            inputs_requiring_grad: 0,
            outputs: captured.as_ref().map_or(0, |(_, _, outputs)| *outputs),
            params: params.len(),
            trainable_params: 0,
            static_bytes: captured.as_ref().map_or(0, |(_, m, _)| m.static_bytes),
        };
        let memory = captured.as_ref().map(|(_, m, _)| *m).unwrap_or_default();
        let first = captured.map(|(graphs, memory, _)| {
            let key = Signature {
                inference: Some(mode.flags.clone()),
                inputs: inputs.clone(),
            };
            (key, graphs, memory.held_bytes())
        });
        let graphed = Self::wrapping(
            callable.module,
            call,
            Arc::new(Shared {
                router: Router::new(first, &config),
                inputs,
                mode,
                device,
                config: config.clone(),
                recapture: true,
                summary,
                memory,
                retired: Mutex::new(GraphStats::default()),
            }),
        );
        for sample in samples {
            graphed.prepare(sample)?;
        }
        Ok(graphed)
    }

    /// Assembles a graphed module from what the capture of its group made.
    pub(crate) fn from_built(
        module: M,
        call: fn(&M, I) -> O,
        built: Built,
        config: &GraphedConfig,
    ) -> Self {
        let first = built.graphs.map(|graphs| {
            let key = Signature {
                inference: None,
                inputs: built.inputs.clone(),
            };
            (key, graphs, built.memory.held_bytes())
        });
        Self::wrapping(
            module,
            call,
            Arc::new(Shared {
                router: Router::new(first, config),
                inputs: built.inputs,
                mode: built.mode,
                device: built.device,
                config: config.clone(),
                recapture: built.alone && config.max_graphs > 1,
                summary: built.summary,
                memory: built.memory,
                retired: Mutex::new(GraphStats::default()),
            }),
        )
    }

    /// Runs the callable: a replay of the graphs when the call matches the capture, the wrapped
    /// function otherwise (see [`Graphed`]).
    ///
    /// # Errors
    ///
    /// [`GraphedError::InputCount`] when the number of input tensors differs from capture (for
    /// `Vec` inputs), [`GraphedError::InputDevice`] for an input on another device,
    /// [`GraphedError::Mismatch`] for any other difference when the policy is
    /// [`MismatchPolicy::Error`], [`GraphedError::ParametersChanged`] when the module's
    /// parameters were added, removed, replaced or reshaped since capture (the graphs cannot
    /// serve it: capture again), [`GraphedError::InputNotWritten`] and
    /// [`GraphedError::ParameterNotWritten`] when an input or a parameter that had to be copied
    /// into the graphs holds no values (an earlier allocation or launch that made it failed on
    /// the device; eager code would carry the failure on to its next read, a replay would run
    /// on stale values), and [`GraphedError::Replay`] when the device rejects a replay.
    /// On a backend that cannot capture, where every call runs eagerly, a call is refused as
    /// it would be where graphs exist when the reason is the call's and not the graphs':
    /// [`GraphedError::ParametersChanged`], and under [`MismatchPolicy::Error`] a call
    /// without autodiff (inference graphs off), in another train/eval mode, or with inputs of
    /// another signature where the callable captures no more signatures (in a group, or
    /// `max_graphs = 1`).
    ///
    /// # Panics
    ///
    /// The backward pass of a replayed call panics if the device rejects the backward replay,
    /// or if the gradient it is given holds no values (as above): burn's backward steps cannot
    /// return errors, and continuing would yield wrong gradients.
    pub fn forward(&self, input: I) -> Result<O, GraphedError> {
        host_phases::start();
        let flat = self.flat_inputs(input)?;
        let routed = self.route(&flat, false, |graphs, params, training| {
            host_phases::lap(HostPhase::Lookup);
            let admitted = graphs.admit(&flat, params, &self.facts().handles, training)?;
            host_phases::lap(HostPhase::Admit);
            Ok(Call {
                graphs: graphs.clone(),
                admitted,
                params: if training {
                    params.to_vec()
                } else {
                    Vec::new()
                },
            })
        })?;
        match routed.route {
            Route::Replay(call) => {
                let outputs = call.graphs.replay(call.admitted, flat, call.params)?;
                let outputs = O::unflatten(outputs).ok_or(GraphedError::Internal {
                    what: "a replay's outputs do not fit the output type captured",
                });
                host_phases::lap(HostPhase::HandOut);
                outputs
            }
            Route::Eager(reason) => self.eager(flat, reason),
        }
    }

    /// Gets graphs ready for calls shaped like `sample` without running a training step:
    /// captures them now when calls with `sample`'s signature would capture them at their
    /// first call (another batch size, dtype or `require_grad`, within
    /// [`GraphedConfig::max_graphs`], evicting the least recently used idle graphs when the
    /// cache is full, as such a call would), or finds them cached. `sample`'s values do not
    /// matter, but the device must have written them. Nothing is trained and no gradient is
    /// left behind; the shape cache counts the capture ([`GraphStats::shape_cache`]).
    ///
    /// Use it before a loop in which a capture would be unwelcome: the epoch's smaller last
    /// batch before burn-train's `Learner` starts (on CUDA a capture needs the device to
    /// itself, and the `Learner`'s metrics thread reads from it), or every shape a model will
    /// meet, so that no step pays for a capture.
    ///
    /// Returns [`Prepared::Eager`] with the reason when calls like `sample` will not replay
    /// whatever is done now (they run eagerly, or fail under [`MismatchPolicy::Error`]): the
    /// backend cannot capture, the module is not in the capture's train/eval state, the call
    /// is on another thread, the shape cache is full of graphs still in use, the callable was
    /// captured in a group (only a callable captured alone captures more signatures), or an
    /// earlier call's capture of this signature failed.
    ///
    /// # Errors
    ///
    /// [`GraphedError::InputCount`] and [`GraphedError::InputDevice`] as for
    /// [`Graphed::forward`], [`GraphedError::ParametersChanged`] when the module's parameters
    /// were added, removed, replaced or reshaped since capture, and the capture's own error
    /// when it fails (as from [`Graphed::new`]: [`GraphedError::Capture`],
    /// [`GraphedError::ReplayDiffers`], [`GraphedError::InputNotWritten`], ...). A failed
    /// capture is not recorded: the module is untouched, the device usable, and a later call
    /// or `prepare` of the same signature tries again.
    pub fn prepare(&self, sample: I) -> Result<Prepared, GraphedError> {
        let flat = self.flat_inputs(sample)?;
        let routed = self.route(&flat, true, |_, _, _| Ok(()))?;
        Ok(match routed.route {
            Route::Replay(()) if routed.captured => Prepared::Captured,
            Route::Replay(()) => Prepared::Cached,
            Route::Eager(reason) => Prepared::Eager(reason),
        })
    }

    /// `input`'s tensors, checked against the capture's count and device.
    ///
    /// # Errors
    ///
    /// [`GraphedError::InputCount`] and [`GraphedError::InputDevice`].
    fn flat_inputs(&self, input: I) -> Result<Vec<FlatTensor>, GraphedError> {
        let flat = input.flatten();
        if flat.len() != self.shared.inputs.len() {
            return Err(GraphedError::InputCount {
                expected: self.shared.inputs.len(),
                got: flat.len(),
            });
        }
        for (index, tensor) in flat.iter().enumerate() {
            if tensor.device != self.shared.device {
                return Err(GraphedError::InputDevice {
                    index,
                    expected: format!("{:?}", self.shared.device),
                    got: format!("{:?}", tensor.device),
                });
            }
        }
        Ok(flat)
    }

    /// Routes a call with inputs `flat` ([`Router::route`]): the module's facts and the
    /// inputs give the signature and what a miss does ([`plan`](Self::plan)); a miss captures
    /// the signature's graphs now where this callable and the shape cache allow it (its error
    /// is the call's with `strict`); then `ready` admits the call on the graphs found, given
    /// the module's parameters and whether the call trains. Evicted graphs' counters are kept.
    ///
    /// # Errors
    ///
    /// [`GraphedError::ParametersChanged`] when parameters were added, removed, replaced or
    /// reshaped since capture (on every backend alike), and a failed capture's error as
    /// [`Router::route`] says.
    fn route<T>(
        &self,
        flat: &[FlatTensor],
        strict: bool,
        ready: impl FnOnce(&Graphs, &[FlatTensor], bool) -> Result<T, EagerReason>,
    ) -> Result<Routed<T, Graphs>, GraphedError> {
        let router = &self.shared.router;
        if let Some(reason) = router.unavailable() {
            if reason == EagerReason::Unsupported {
                // The module is checked as where graphs exist: a structural change is refused
                // on every backend alike (what the plan says besides does not matter here).
                let _plan = self.plan(flat)?;
            }
            return Ok(Routed::eager(reason));
        }
        let plan = self.plan(flat)?;
        host_phases::lap(HostPhase::Plan);
        let (key, refused) = match plan {
            Ok(plan) => plan,
            Err(reason) => return Ok(Routed::eager(reason)),
        };
        let training = key.inference.is_none();
        let miss = match refused {
            Some(reason) => OnMiss::Eager(reason),
            None => OnMiss::Capture(|| self.capture(flat, training)),
        };
        // An inference capture never evicts training graphs: an evaluation pass would
        // otherwise cost the next training step a capture (with `max_graphs = 1`, every epoch).
        let busy =
            |graphs: &Graphs| graphs.backward_pending() || (!training && !graphs.is_inference());
        let params = &self.facts().params;
        let routed = router.route(&key, miss, busy, strict, |graphs| {
            ready(graphs, params, training)
        })?;
        if !routed.evicted.is_empty() {
            let mut retired = lock(&self.shared.retired);
            for evicted in &routed.evicted {
                retired.add_replays(&evicted.stats());
            }
        }
        Ok(routed)
    }

    /// This value's module facts, collected at its first call.
    fn facts(&self) -> &ModuleFacts {
        self.facts
            .get_or_init(|| ModuleFacts::of(&self.inner, &self.shared.mode))
    }

    /// The signature a call with inputs `flat` is routed by, with what a miss does; or why it
    /// runs eagerly whatever graphs exist (a call without autodiff where inference graphs are
    /// off, another train/eval mode). Checks go from the general to the particular, so that an
    /// eval call is reported as such rather than as the input differences that eval brings
    /// along. Inputs may come from the inner device (data loaders often make them there): what
    /// decides training is the module's parameters, or an input that is on autodiff.
    ///
    /// # Errors
    ///
    /// [`GraphedError::ParametersChanged`] when parameters were added, removed, replaced or
    /// reshaped since capture, for a call that graphs would serve.
    fn plan(&self, flat: &[FlatTensor]) -> Result<Result<Plan, EagerReason>, GraphedError> {
        let facts = self.facts();
        let autodiff = facts.autodiff || flat.iter().any(|t| t.device.is_autodiff());
        if !autodiff && !self.shared.config.graph_inference {
            return Ok(Err(EagerReason::NoAutodiff));
        }
        if let Some(detail) = &facts.structural {
            return Err(GraphedError::ParametersChanged {
                detail: detail.clone(),
            });
        }
        if !autodiff {
            // Every callable captures inference graphs of new signatures (they share nothing).
            return Ok(Ok((inference_key(flat, facts.flags.clone()), None)));
        }
        if facts.mode_changed {
            return Ok(Err(EagerReason::ModeChanged));
        }
        // Only a signature the cache lost can match the sample's.
        let refused = (!self.shared.recapture).then(|| {
            input_difference(flat, &self.shared.inputs).unwrap_or(EagerReason::ShapeCacheFull)
        });
        Ok(Ok((training_key(flat), refused)))
    }

    /// Under [`MismatchPolicy::Error`], on a backend that cannot capture: why graphs could not
    /// serve this call whatever the device (a call without autodiff where inference graphs
    /// are off, another train/eval mode, or inputs of another signature where this callable
    /// captures no more signatures: one of a group, or `max_graphs = 1`), so that such a call
    /// is refused on every backend alike. The reasons that concern graphs only (another
    /// thread, a pending backward, the shape cache's state) are not asked.
    fn differs_without_graphs(&self, flat: &[FlatTensor]) -> Option<EagerReason> {
        match self.plan(flat) {
            Ok(Err(reason)) => Some(reason),
            Ok(Ok((key, Some(_)))) if key.inference.is_none() => {
                input_difference(flat, &self.shared.inputs)
            }
            _ => None,
        }
    }

    /// The eager call for `reason`, counted; refused instead under [`MismatchPolicy::Error`].
    fn eager(&self, flat: Vec<FlatTensor>, reason: EagerReason) -> Result<O, GraphedError> {
        if self.shared.config.on_mismatch == MismatchPolicy::Error {
            let refused = if reason == EagerReason::Unsupported {
                self.differs_without_graphs(&flat)
            } else {
                Some(reason.clone())
            };
            if let Some(refused) = refused {
                return Err(GraphedError::mismatch(refused, &flat, &self.shared.inputs));
            }
        }
        self.shared.router.count_eager(reason);
        // `flat` is this call's inputs flattened, counted against the sample's already.
        let input = I::unflatten(flat).ok_or(GraphedError::INPUTS_MISFIT)?;
        Ok((self.call)(&self.inner, input))
    }

    /// Captures the graphs of another signature of this callable, with the bytes they hold:
    /// training graphs, or inference graphs for a call without autodiff.
    fn capture(&self, flat: &[FlatTensor], training: bool) -> Result<(Graphs, u64), GraphedError> {
        let sample = I::unflatten(flat.to_vec()).ok_or(GraphedError::INPUTS_MISFIT)?;
        let mut callable = Callable::new(self.inner.clone(), self.call, sample);
        let (graphs, memory) = if training {
            let built = build(vec![callable.member()], &self.shared.config)?
                .into_iter()
                .next()
                .ok_or(GraphedError::FEWER_GRAPHS)?;
            let graphs = built.graphs.ok_or(GraphedError::Unsupported {
                device: format!("{:?}", self.shared.device),
            })?;
            (graphs, built.memory)
        } else {
            let (graphs, memory, _) = build_inference(&callable.member(), &self.shared.config)?;
            (graphs, memory)
        };
        Ok((graphs, memory.held_bytes()))
    }

    /// The wrapped module.
    pub fn module(&self) -> &M {
        &self.inner
    }

    /// Unwraps the module (the graphs are dropped with the last copy of this wrapper).
    pub fn into_module(self) -> M {
        self.inner
    }

    /// What was captured.
    pub fn summary(&self) -> &CaptureSummary {
        &self.shared.summary
    }

    /// Device memory that the capture holds: this callable's static buffers, those of its
    /// whole group, and what the capture added to the device's pools.
    pub fn memory(&self) -> GraphMemory {
        self.shared.memory
    }

    /// Counters of replays, copies and eager calls so far, over every copy of this wrapper
    /// and every graph it captured (evicted ones included), with its shape cache's.
    pub fn stats(&self) -> GraphStats {
        let router = &self.shared.router;
        let mut stats = lock(&self.shared.retired).clone();
        for graphs in router.graphs() {
            stats.add_replays(&graphs.stats());
            stats.graphs.extend_from_slice(graphs.contents());
        }
        stats.eager = router.eager_calls();
        stats.shape_cache = router.cache_stats();
        stats
    }
}

impl<M: Module, I, O> Module for Graphed<M, I, O> {
    fn collect_devices(&self, devices: Devices) -> Devices {
        self.inner.collect_devices(devices)
    }

    fn fork(self, device: &Device) -> Self {
        self.rewrap(|inner| inner.fork(device))
    }

    fn to_device(self, device: &Device) -> Self {
        self.rewrap(|inner| inner.to_device(device))
    }

    fn train(self) -> Self {
        self.rewrap(M::train)
    }

    fn valid(&self) -> Self {
        Self::wrapping(self.inner.valid(), self.call, self.shared.clone())
    }

    fn materialize(self) -> Self {
        self.rewrap(M::materialize)
    }

    fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
        self.inner.visit(visitor)
    }

    fn map<Mp: ModuleMapper>(self, mapper: &mut Mp) -> Self {
        self.rewrap(|inner| inner.map(mapper))
    }
}

// Displayed as the wrapped module: its content and its parameter count.
impl<M: Module + ModuleDisplay, I, O> ModuleDisplayDefault for Graphed<M, I, O> {
    fn content(&self, content: Content) -> Option<Content> {
        self.inner.content(content)
    }

    fn num_params(&self) -> usize {
        Module::num_params(self)
    }
}

impl<M: Module + ModuleDisplay, I, O> ModuleDisplay for Graphed<M, I, O> {}

/// The wrapped module's display (as `#[derive(Module)]` gives every module).
impl<M: Module + ModuleDisplay, I, O> fmt::Display for Graphed<M, I, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&ModuleDisplay::format(self, Default::default()))
    }
}

/// How a call's inputs first differ from the capture's signature (shape, dtype, then
/// `require_grad`, input by input); `None` when they match.
fn input_difference(flat: &[FlatTensor], captured: &[TensorSpec]) -> Option<EagerReason> {
    flat.iter()
        .zip(captured)
        .enumerate()
        .find_map(|(index, (tensor, spec))| {
            if tensor.shape != spec.shape {
                Some(EagerReason::Shape { index })
            } else if tensor.dtype != spec.dtype {
                Some(EagerReason::DType { index })
            } else if tensor.require_grad != spec.require_grad {
                Some(EagerReason::RequireGrad { index })
            } else {
                None
            }
        })
}

/// The key of a training call's graphs: its input signature.
fn training_key(flat: &[FlatTensor]) -> Signature {
    Signature {
        inference: None,
        inputs: flat.iter().map(FlatTensor::spec).collect(),
    }
}

/// The key of an inference call's graphs: its input signature and the module's flags.
fn inference_key(flat: &[FlatTensor], flags: Vec<bool>) -> Signature {
    Signature {
        inference: Some(flags),
        inputs: flat.iter().map(FlatTensor::spec).collect(),
    }
}
