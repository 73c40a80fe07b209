//! [`Graphed`]: a module wrapper whose calls replay captured forward and backward graphs.

use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::ThreadId;

use burn::module::{
    Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, ModuleVisitor,
};
use burn::tensor::Device;

use crate::build::{Built, build, build_inference};
use crate::callable::Callable;
use crate::config::{GraphedConfig, MismatchPolicy};
use crate::cube::{Graphs, Replayed};
use crate::error::GraphedError;
use crate::host_phases::{self, HostPhase};
use crate::params::{self, ModuleMode};
use crate::shape_cache::{Admission, CacheLimits, ShapeCache, ShapeCacheStats};
use crate::stats::{CaptureSummary, FallbackReason, GraphMemory, GraphStats, Prepared};
use crate::sync::lock;
use crate::tensors::{FlatTensor, TensorGroup, TensorSpec};

/// State shared by every copy of a [`Graphed`] module (optimizer steps and `valid()` make
/// copies): the graphs by input signature, the capture's signature, and the counters.
struct Shared {
    /// The captured graphs, training and inference, by signature; `None` without graphs.
    graphs: Option<Mutex<ShapeCache<Graphs, Signature>>>,
    /// Why there are no graphs, when there are none.
    eager_reason: Option<FallbackReason>,
    /// The signature of the first capture (the sample's).
    inputs: Vec<TensorSpec>,
    mode: ModuleMode,
    device: Device,
    thread: ThreadId,
    /// Configuration of the first capture, for the captures of new signatures.
    config: GraphedConfig,
    /// Whether new signatures may be captured (a callable captured alone, `max_graphs > 1`).
    recapture: bool,
    summary: CaptureSummary,
    memory: GraphMemory,
    /// Counters of eager calls, and the replay counters of graphs evicted from the cache
    /// (live graphs count their own replays).
    eager: Mutex<GraphStats>,
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

/// Which graphs may serve a call, and what the call brings along (the module's float
/// parameters, in visiting order).
enum ReplayPlan {
    /// Training graphs; with how the inputs differ from the capture's sample (graphs of
    /// another signature may still serve the call).
    Training(Vec<FlatTensor>, Option<FallbackReason>),
    /// Inference graphs, for a call without autodiff; with the module's train/eval flags,
    /// part of their key.
    Inference(Vec<FlatTensor>, Vec<bool>),
}

/// What a call needs to know of the module: its float parameters, whether one of them is on
/// autodiff, its train/eval flags, and how its mode compares with the capture's. Collected at a
/// [`Graphed`] value's first call and kept for the value's life: its module never changes,
/// since every way to another module (an optimizer step, `valid()`, a record, a device move)
/// makes a new value ([`Graphed::wrapping`]), which collects again.
struct ModuleFacts {
    params: Vec<FlatTensor>,
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
                .then(|| FallbackReason::Unsupported.to_string()),
            inputs: inputs.len(),
            inputs_requiring_grad: 0,
            outputs: captured.as_ref().map_or(0, |(_, _, outputs)| *outputs),
            params: params.len(),
            trainable_params: 0,
            static_bytes: captured.as_ref().map_or(0, |(_, m, _)| m.static_bytes),
        };
        let memory = captured.as_ref().map(|(_, m, _)| *m).unwrap_or_default();
        let graphs = captured.map(|(graphs, memory, _)| {
            Mutex::new(ShapeCache::new(
                CacheLimits {
                    max_graphs: config.max_graphs,
                    max_bytes: config.max_graph_bytes,
                },
                Signature {
                    inference: Some(mode.flags.clone()),
                    inputs: inputs.clone(),
                },
                graphs,
                memory.held_bytes(),
            ))
        });
        let graphed = Self::wrapping(
            callable.module,
            call,
            Arc::new(Shared {
                eager_reason: graphs.is_none().then_some(FallbackReason::Unsupported),
                graphs,
                inputs,
                mode,
                device,
                thread: std::thread::current().id(),
                config: config.clone(),
                recapture: true,
                summary,
                memory,
                eager: Mutex::new(GraphStats::default()),
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
        let graphs = built.graphs.map(|graphs| {
            Mutex::new(ShapeCache::new(
                CacheLimits {
                    max_graphs: config.max_graphs,
                    max_bytes: config.max_graph_bytes,
                },
                Signature {
                    inference: None,
                    inputs: built.inputs.clone(),
                },
                graphs,
                built.memory.held_bytes(),
            ))
        });
        Self::wrapping(
            module,
            call,
            Arc::new(Shared {
                graphs,
                eager_reason: built.eager_reason,
                inputs: built.inputs,
                mode: built.mode,
                device: built.device,
                thread: std::thread::current().id(),
                config: config.clone(),
                recapture: built.alone && config.max_graphs > 1,
                summary: built.summary,
                memory: built.memory,
                eager: Mutex::new(GraphStats::default()),
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
        let plan = self.replay_plan(&flat)?;
        host_phases::lap(HostPhase::Plan);
        match plan {
            Ok(ReplayPlan::Training(module_params, mismatch)) => {
                self.replay(flat, module_params, mismatch)
            }
            Ok(ReplayPlan::Inference(module_params, flags)) => {
                self.infer(flat, module_params, flags)
            }
            Err(reason) => self.eager(flat, reason),
        }
    }

    /// A call without autodiff: the inference graphs of its signature and the module's
    /// flags (found, or captured now within the shape cache's limits), replayed; or the eager
    /// call with the reason.
    ///
    /// # Errors
    ///
    /// As [`forward`](Self::forward).
    fn infer(
        &self,
        flat: Vec<FlatTensor>,
        params: Vec<FlatTensor>,
        flags: Vec<bool>,
    ) -> Result<O, GraphedError> {
        let key = inference_key(&flat, flags);
        let graphs = match self.graphs_for(&flat, key, None, false)? {
            Ok((graphs, _captured_now)) => graphs,
            Err(reason) => return self.eager(flat, reason),
        };
        host_phases::lap(HostPhase::Lookup);
        let replayed = graphs.replay_inference(flat, params)?;
        self.hand_out(replayed)
    }

    /// Gets graphs ready for calls shaped like `sample` without running a training step:
    /// captures them now when calls with `sample`'s signature would capture them at their
    /// first call (another batch size, dtype or `require_grad`, within
    /// [`GraphedConfig::max_graphs`], evicting the least recently used idle graphs when the
    /// cache is full, as such a call would), or finds them cached. `sample`'s values do not
    /// matter, but the device must have written them. Nothing is trained and no gradient is
    /// left behind; the shape cache counts the capture ([`Graphed::shape_cache`]).
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
        let (key, mismatch) = match self.replay_plan(&flat)? {
            Ok(ReplayPlan::Training(_, mismatch)) => (training_key(&flat), mismatch),
            Ok(ReplayPlan::Inference(_, flags)) => (inference_key(&flat, flags), None),
            Err(reason) => return Ok(Prepared::Eager(reason)),
        };
        Ok(match self.graphs_for(&flat, key, mismatch, true)? {
            Ok((_, true)) => Prepared::Captured,
            Ok((_, false)) => Prepared::Cached,
            Err(reason) => Prepared::Eager(reason),
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

    /// Which graphs may serve this call ([`ReplayPlan`]: training graphs, or for a call
    /// without autodiff inference graphs unless `graph_inference` is off), or why it cannot
    /// replay. Checks go from the general to the particular, so that an eval call is reported
    /// as such rather than as the input differences that eval brings along.
    ///
    /// # Errors
    ///
    /// [`GraphedError::ParametersChanged`] when parameters were added, removed, replaced or
    /// reshaped since capture.
    fn replay_plan(
        &self,
        flat: &[FlatTensor],
    ) -> Result<Result<ReplayPlan, FallbackReason>, GraphedError> {
        if let Some(reason) = &self.shared.eager_reason {
            return self.plan_without_graphs(flat, reason);
        }
        if std::thread::current().id() != self.shared.thread {
            return Ok(Err(FallbackReason::OtherThread));
        }
        let facts = self
            .facts
            .get_or_init(|| ModuleFacts::of(&self.inner, &self.shared.mode));
        // Inputs may come from the inner device (data loaders often make them there); what
        // decides training is the module's parameters, or an input that is on autodiff.
        let autodiff = facts.autodiff || flat.iter().any(|t| t.device.is_autodiff());
        if !autodiff && !self.shared.config.graph_inference {
            return Ok(Err(FallbackReason::NoAutodiff));
        }
        if let Some(detail) = &facts.structural {
            return Err(GraphedError::ParametersChanged {
                detail: detail.clone(),
            });
        }
        let module_params = facts.params.clone();
        if !autodiff {
            return Ok(Ok(ReplayPlan::Inference(
                module_params,
                facts.flags.clone(),
            )));
        }
        if facts.mode_changed {
            return Ok(Err(FallbackReason::ModeChanged));
        }
        let mismatch = input_difference(flat, &self.shared.inputs);
        Ok(Ok(ReplayPlan::Training(module_params, mismatch)))
    }

    /// [`replay_plan`](Self::replay_plan) where the backend cannot capture: every call runs
    /// eagerly for `reason`, but the module is checked as where graphs exist, since that check
    /// needs none: parameters added, removed, replaced or reshaped since capture are
    /// [`GraphedError::ParametersChanged`] on every backend alike.
    ///
    /// # Errors
    ///
    /// [`GraphedError::ParametersChanged`].
    fn plan_without_graphs(
        &self,
        flat: &[FlatTensor],
        reason: &FallbackReason,
    ) -> Result<Result<ReplayPlan, FallbackReason>, GraphedError> {
        let facts = self
            .facts
            .get_or_init(|| ModuleFacts::of(&self.inner, &self.shared.mode));
        let autodiff = facts.autodiff || flat.iter().any(|t| t.device.is_autodiff());
        // As with graphs: a call that would run eagerly anyway is not refused for them.
        if (autodiff || self.shared.config.graph_inference)
            && let Some(detail) = &facts.structural
        {
            return Err(GraphedError::ParametersChanged {
                detail: detail.clone(),
            });
        }
        Ok(Err(reason.clone()))
    }

    /// Under [`MismatchPolicy::Error`], on a backend that cannot capture: why graphs could not
    /// serve this call whatever the device (a call without autodiff where inference graphs
    /// are off, another train/eval mode, or inputs of another signature where this callable
    /// captures no more signatures: one of a group, or `max_graphs = 1`), so that such a call
    /// is refused on every backend alike. The reasons that concern graphs only (another
    /// thread, a pending backward, the shape cache's state) are not asked.
    fn differs_without_graphs(&self, flat: &[FlatTensor]) -> Option<FallbackReason> {
        let facts = self
            .facts
            .get_or_init(|| ModuleFacts::of(&self.inner, &self.shared.mode));
        if !(facts.autodiff || flat.iter().any(|t| t.device.is_autodiff())) {
            return (!self.shared.config.graph_inference).then_some(FallbackReason::NoAutodiff);
        }
        if facts.mode_changed {
            return Some(FallbackReason::ModeChanged);
        }
        input_difference(flat, &self.shared.inputs).filter(|_| !self.shared.recapture)
    }

    fn eager(&self, flat: Vec<FlatTensor>, reason: FallbackReason) -> Result<O, GraphedError> {
        if self.shared.config.on_mismatch == MismatchPolicy::Error {
            let refused = if reason == FallbackReason::Unsupported {
                self.differs_without_graphs(&flat)
            } else {
                Some(reason.clone())
            };
            if let Some(refused) = refused {
                return Err(GraphedError::mismatch(refused, &flat, &self.shared.inputs));
            }
        }
        *self.lock_eager().fallbacks.entry(reason).or_default() += 1;
        // `flat` is this call's inputs flattened, counted against the sample's already.
        let input = I::unflatten(flat).ok_or(GraphedError::INPUTS_MISFIT)?;
        Ok((self.call)(&self.inner, input))
    }

    /// The graphs for this call's input signature: cached, or captured now when the shape
    /// cache allows (see [`ShapeCache`]), with whether they were captured now; or why the call
    /// runs eagerly.
    ///
    /// # Errors
    ///
    /// The capture's error when it fails and [`GraphedConfig::require_graphs`] is set or
    /// `strict` asks for it; the failure is then not recorded, so a later call tries again.
    fn graphs_for(
        &self,
        flat: &[FlatTensor],
        key: Signature,
        mismatch: Option<FallbackReason>,
        strict: bool,
    ) -> Result<Result<(Graphs, bool), FallbackReason>, GraphedError> {
        let Some(cache) = self.shared.graphs.as_ref() else {
            return Ok(Err(FallbackReason::Unsupported));
        };
        if let Some(graphs) = lock(cache).get(&key) {
            return Ok(Ok((graphs.clone(), false)));
        }
        let inference = key.inference.is_some();
        // Only a signature the cache lost can match the sample's.
        let reason = if inference {
            FallbackReason::ShapeCacheFull
        } else {
            mismatch.unwrap_or(FallbackReason::ShapeCacheFull)
        };
        // A callable of a group captures inference graphs too (they share nothing); more
        // training signatures only when captured alone.
        if !inference && !self.shared.recapture {
            return Ok(Err(reason));
        }
        // An inference capture never evicts training graphs: an evaluation pass would
        // otherwise cost the next training step a capture (with `max_graphs = 1`, every epoch).
        let busy =
            |graphs: &Graphs| graphs.backward_pending() || (inference && !graphs.is_inference());
        match lock(cache).admit(&key, busy) {
            Admission::Capture => {}
            Admission::FailedBefore => return Ok(Err(FallbackReason::CaptureFailed)),
            Admission::Full => return Ok(Err(FallbackReason::ShapeCacheFull)),
        }
        let sample = I::unflatten(flat.to_vec()).ok_or(GraphedError::INPUTS_MISFIT)?;
        let mut callable = Callable::new(self.inner.clone(), self.call, sample);
        let built = if inference {
            build_inference(&callable.member(), &self.shared.config)
                .map(|(graphs, memory, _)| (graphs, memory))
        } else {
            self.build_training(&mut callable)
        };
        let (graphs, memory) = match built {
            Ok(built) => built,
            Err(error) if strict || self.shared.config.require_graphs => return Err(error),
            Err(error) => {
                lock(cache).record_failure(key, error.to_string());
                return Ok(Err(FallbackReason::CaptureFailed));
            }
        };
        let inserted = lock(cache).insert(key, graphs.clone(), memory.held_bytes(), busy);
        match inserted {
            Ok(evicted) => {
                let mut retired = self.lock_eager();
                for evicted in evicted {
                    retired.add_replays(&evicted.stats());
                }
                Ok(Ok((graphs, true)))
            }
            Err(_too_large) => Ok(Err(FallbackReason::ShapeCacheFull)),
        }
    }

    /// Captures the training graphs of another signature of this callable.
    fn build_training(
        &self,
        callable: &mut Callable<M, I, O>,
    ) -> Result<(Graphs, GraphMemory), GraphedError> {
        build(vec![callable.member()], &self.shared.config).and_then(|built| {
            let built = built.into_iter().next().ok_or(GraphedError::FEWER_GRAPHS)?;
            let memory = built.memory;
            built
                .graphs
                .map(|graphs| (graphs, memory))
                .ok_or(GraphedError::Unsupported {
                    device: format!("{:?}", self.shared.device),
                })
        })
    }

    fn lock_eager(&self) -> std::sync::MutexGuard<'_, GraphStats> {
        lock(&self.shared.eager)
    }

    /// A call that may replay: the graphs for its signature (found, or captured now), then
    /// the engine's replay, which links the outputs into autodiff; or the eager call, with the
    /// reason either gives.
    fn replay(
        &self,
        flat: Vec<FlatTensor>,
        params: Vec<FlatTensor>,
        mismatch: Option<FallbackReason>,
    ) -> Result<O, GraphedError> {
        let graphs = match self.graphs_for(&flat, training_key(&flat), mismatch, false)? {
            Ok((graphs, _captured_now)) => graphs,
            Err(reason) => return self.eager(flat, reason),
        };
        host_phases::lap(HostPhase::Lookup);
        let replayed = graphs.replay(flat, params)?;
        self.hand_out(replayed)
    }

    /// A replay's outputs as the call's output type, or the eager call where the replay gave
    /// the inputs back with a reason.
    fn hand_out(&self, replayed: Replayed) -> Result<O, GraphedError> {
        match replayed {
            Replayed::Outputs(outputs) => {
                let outputs = O::unflatten(outputs).ok_or(GraphedError::Internal {
                    what: "a replay's outputs do not fit the output type captured",
                });
                host_phases::lap(HostPhase::HandOut);
                outputs
            }
            Replayed::Eager(reason, flat) => self.eager(flat, reason),
        }
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

    /// Counters of replays, copies and eager fallbacks so far, over every copy of this wrapper
    /// and every graph it captured (evicted ones included).
    pub fn stats(&self) -> GraphStats {
        let mut stats = self.lock_eager().clone();
        if let Some(cache) = &self.shared.graphs {
            for graphs in lock(cache).values() {
                stats.add_replays(&graphs.stats());
                stats.graphs.extend_from_slice(graphs.contents());
            }
        }
        stats
    }

    /// The shape cache: graphs held per input signature, hits, captures of new signatures,
    /// evictions (see [`GraphedConfig::max_graphs`]). Empty counters without graphs.
    pub fn shape_cache(&self) -> ShapeCacheStats {
        if let Some(cache) = &self.shared.graphs {
            return lock(cache).stats().clone();
        }
        ShapeCacheStats::default()
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
fn input_difference(flat: &[FlatTensor], captured: &[TensorSpec]) -> Option<FallbackReason> {
    flat.iter()
        .zip(captured)
        .enumerate()
        .find_map(|(index, (tensor, spec))| {
            if tensor.shape != spec.shape {
                Some(FallbackReason::Shape { index })
            } else if tensor.dtype != spec.dtype {
                Some(FallbackReason::DType { index })
            } else if tensor.require_grad != spec.require_grad {
                Some(FallbackReason::RequireGrad { index })
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
