//! What a run is: the model [`Case`], the [`Mode`]s and their optimizers, and [`run`], which
//! times one (model, mode) pair.

use super::*;

/// A model, its call and loss, and how to make inputs of it.
pub(crate) struct Case<M, I, O> {
    pub(crate) name: String,
    pub(crate) make: fn(&Device) -> M,
    pub(crate) call: fn(&M, I) -> O,
    /// The loss of the outputs of a call on a batch (the batch holds the language model's
    /// targets).
    pub(crate) loss: fn(O, &I) -> Tensor<1>,
    /// `loss(call(m, x), x)` as one function: the callable of the `graphed_loss_*` modes, whose
    /// graphs hold the loss too.
    pub(crate) call_loss: fn(&M, I) -> Tensor<1>,
    /// A batch of the given size.
    pub(crate) input: fn(&Device, usize) -> I,
    /// A batch for the inference modes, where the forward reads less of it than the loss
    /// does (the language model's targets: [`lm_forward_batch`](crate::models::lm_forward_batch))
    /// or the check needs batches further apart ([`cnn_forward_batch`](crate::models::cnn_forward_batch),
    /// [`mlp_forward_batch`](crate::models::mlp_forward_batch));
    /// `None`: [`input`](Self::input).
    pub(crate) forward_input: Option<fn(&Device, usize) -> I>,
    /// Rank `r`'s batch of a data-parallel value check made from a draw of [`input`](Self::input)
    /// that every rank makes alike: shards that differ by construction
    /// ([`negate_odd`](crate::ddp_check::negate_odd), [`lm_shard`](crate::models::lm_shard)).
    pub(crate) shard: fn(I, usize) -> I,
    /// The training batch size.
    pub(crate) batch: usize,
    /// Appended to every row's mode: `_fused_layers` for the models whose layers are
    /// `burn_graphed::nn`'s fused ones (`--models transformer_fused,lm_fused`), so that their
    /// rows pair with the same model's burn-nn rows and PyTorch's; empty otherwise.
    pub(crate) variant: &'static str,
}

/// Every run, in the order they are timed (the default: all but `graphed_static`).
pub(crate) const MODES: [Mode; 36] = [
    Mode::Eager(Optim::Adam),
    Mode::Graphed(FaultInjection::None, Optim::Adam),
    Mode::Graphed(FaultInjection::SkipInputCopy, Optim::Adam),
    Mode::Graphed(FaultInjection::SkipParamCopy, Optim::Adam),
    Mode::GraphedStatic(Optim::Adam),
    Mode::Eager(Optim::FusedAdam),
    Mode::Graphed(FaultInjection::None, Optim::FusedAdam),
    Mode::GraphedStatic(Optim::FusedAdam),
    Mode::GraphedGuarded(Optim::FusedAdam),
    Mode::Eager(Optim::MultiAdam),
    Mode::Graphed(FaultInjection::None, Optim::MultiAdam),
    Mode::GraphedStatic(Optim::MultiAdam),
    Mode::GraphedLoss(Optim::MultiAdam),
    Mode::Graphed(FaultInjection::SkipWriteCheck, Optim::MultiAdam),
    Mode::Graphed(FaultInjection::SkipInputCopy, Optim::MultiAdam),
    Mode::WholeStep(false),
    Mode::WholeStep(true),
    Mode::FirstStep(First::WholeStep),
    Mode::FirstStep(First::Graphed),
    Mode::FirstStep(First::Eager),
    Mode::Inference {
        graphed: false,
        one: false,
    },
    Mode::Inference {
        graphed: true,
        one: false,
    },
    Mode::Inference {
        graphed: false,
        one: true,
    },
    Mode::Inference {
        graphed: true,
        one: true,
    },
    Mode::InferenceFault(FaultInjection::SkipWriteCheck),
    Mode::InferenceFault(FaultInjection::SkipInputCopy),
    Mode::Ddp(DdpStep::Eager),
    Mode::Ddp(DdpStep::Graphed),
    Mode::Ddp(DdpStep::WholeStep),
    Mode::Ddp(DdpStep::InGraph),
    Mode::Ddp(DdpStep::InGraphOverlap),
    Mode::Ddp(DdpStep::BetweenGraphs),
    Mode::Ddp(DdpStep::InGraphSockets),
    Mode::Ddp(DdpStep::ThreadsInGraph),
    Mode::Ddp(DdpStep::ThreadsInGraphOverlap),
    Mode::Ddp(DdpStep::ThreadsInGraphOverlapOneStream),
];

/// Modes of `torch_reference.py` alone: `run.sh bench` passes one `--modes` to both sides, and
/// each side runs the modes it has.
pub(crate) const TORCH_ONLY_MODES: [&str; 3] = [
    "graphed_loss_fused_adam",
    "whole_step_fused_adam",
    "whole_step_floor_fused_adam",
];

/// The optimizer of a run: burn's `Adam`, `burn_graphed::FusedAdam` (one kernel per
/// parameter, updating the graphs' parameter buffers in place), or
/// `burn_graphed::MultiTensorAdam` (the same, one fusion operation for all parameters).
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Optim {
    Adam,
    FusedAdam,
    MultiAdam,
}

/// A module optimizer of either kind.
pub(crate) enum Optimizer {
    Module(ModuleOptimizer),
    Multi(MultiTensorAdam),
}

impl Optimizer {
    pub(crate) fn step<M: Module>(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        match self {
            Optimizer::Module(optim) => optim.step(lr, module, grads),
            Optimizer::Multi(optim) => optim.step(lr, module, grads),
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Mode {
    Eager(Optim),
    Graphed(FaultInjection, Optim),
    /// `OutputPolicy::Static`: outputs and gradients handed out as the static buffers (no
    /// hand-out copies), as PyTorch does.
    GraphedStatic(Optim),
    /// `OutputPolicy::Guarded`: static buffers handed out, calls that would overwrite one
    /// still held run eagerly (none in this loop).
    GraphedGuarded(Optim),
    /// `OutputPolicy::Static`, with the loss inside the graphed callable
    /// ([`Case::call_loss`]): the forward graph ends in the loss, and the backward graph starts
    /// from it. PyTorch's counterpart is `graphed_loss_fused_adam`.
    GraphedLoss(Optim),
    /// `GraphedStep` with burn's Adam: forward, loss, backward and update in one graph, the
    /// learning rate written before every replay (a schedule); `true`: the device floor, the
    /// same graph replayed with no input copy (wrong values, timing only) and one learning
    /// rate. PyTorch's counterparts: `whole_step` and `whole_step_floor`.
    WholeStep(bool),
    /// Time from making the model to the end of its first step of a training loop (setup
    /// included), once per process, with its parts ([`First`], `first_step.rs`). PyTorch's
    /// counterparts: `first_step`, `first_step_graphed`, `first_step_eager`.
    FirstStep(First),
    /// Forward calls of the model on the device without autodiff, a new batch each call, no
    /// loss: eagerly, or replaying `Graphed::inference`'s graph (default output policy,
    /// `Guarded`); at the training batch size or (`one`) at batch size 1. PyTorch's
    /// counterparts (eval mode, no grad): `inference*`, graphed with `torch.cuda.graph`.
    Inference {
        graphed: bool,
        one: bool,
    },
    /// `inference_graphed_b1` with a fault built into the graph, to tell what the call's parts
    /// cost (numbers only): `SkipWriteCheck` (`inference_graphed_b1_no_check`: no question to
    /// cubecl before the replay) and `SkipInputCopy` (`inference_graphed_b1_floor`: nothing
    /// copied or asked, the graph replayed on the capture's input; wrong values, no check).
    InferenceFault(FaultInjection),
    /// Data-parallel training on `--ranks` GPUs (one thread per GPU, each on a batch of the
    /// model's size: the global batch grows with the ranks), the gradients averaged by
    /// `burn_graphed::DataParallel` (one bucketed NCCL all-reduce per step) before
    /// `MultiTensorAdam`: eagerly (`ddp_eager`), or graphed with `OutputPolicy::Static`
    /// (`ddp_graphed`, the captures one rank at a time); or `GraphedStep::data_parallel` with
    /// burn's Adam (`ddp_whole_step`: a gradient graph, the bucket's all-reduce, an update
    /// graph). Their one-GPU counterparts: `eager_multi_adam`, `graphed_static_multi_adam` and
    /// `whole_step`. PyTorch's: `ddp_eager`, `ddp_graphed` (`make_graphed_callables` under DDP)
    /// and `ddp_whole_step` (the whole step in one graph, its all-reduces inside). With one
    /// process per GPU and NCCL between them (`Collective::Nccl`, the run's process rank 0, the
    /// others started by it): `ddp_whole_step_in_graph` (the all-reduce inside the step's one
    /// graph; `..._overlap`: its all-reduces started during the backward) and
    /// `ddp_whole_step_processes` (between its two graphs);
    /// `ddp_whole_step_in_graph_sockets`: the first with NCCL on sockets over the loopback, as
    /// between two machines (the run's environment must say so: `processes::SOCKETS`). With
    /// one thread per GPU and burn-graphed's NCCL inside the step's one graph
    /// (`Collective::Nccl` from `DataParallel::group`): `ddp_whole_step_threads_in_graph`, its
    /// all-reduce after the backward in one bucket, `..._overlap`, started during it, and
    /// `..._overlap_one_stream`, started during it on the backward's own stream.
    Ddp(DdpStep),
}

/// The step of a `ddp_*` mode ([`Mode::Ddp`]).
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum DdpStep {
    Eager,
    Graphed,
    WholeStep,
    /// One process per GPU, NCCL inside the step's graph.
    InGraph,
    /// [`DdpStep::InGraph`] with the all-reduces started during the backward, bucket by bucket
    /// (`testing::overlap_all_reduces(true)` in every rank's process).
    InGraphOverlap,
    /// One process per GPU, NCCL between the step's two graphs.
    BetweenGraphs,
    /// [`DdpStep::InGraph`] with NCCL on sockets over the loopback.
    InGraphSockets,
    /// One thread per GPU, burn-graphed's NCCL inside the step's graph.
    ThreadsInGraph,
    /// [`DdpStep::ThreadsInGraph`] with the all-reduces started during the backward, bucket by
    /// bucket (`testing::overlap_all_reduces(true)`): the overlap's A/B.
    ThreadsInGraphOverlap,
    /// [`DdpStep::ThreadsInGraphOverlap`] with the buckets' all-reduces on the backward's own
    /// stream (`testing::overlap_on_side_stream(false)`): what the side stream's fork and joins
    /// cost.
    ThreadsInGraphOverlapOneStream,
}

impl Mode {
    pub(crate) fn label(self) -> &'static str {
        use FaultInjection::{None, SkipInputCopy, SkipParamCopy, SkipWriteCheck};
        use Optim::{Adam, FusedAdam, MultiAdam};
        match self {
            Mode::Eager(Adam) => "eager",
            Mode::Graphed(None, Adam) => "graphed",
            Mode::Graphed(SkipInputCopy, MultiAdam) => "graphed_multi_adam_no_input_copy",
            Mode::Graphed(SkipInputCopy, _) => "graphed_no_input_copy",
            Mode::Graphed(SkipParamCopy, _) => "graphed_no_param_copy",
            Mode::Graphed(SkipWriteCheck, Adam) => "graphed_no_check",
            Mode::Graphed(SkipWriteCheck, FusedAdam) => "graphed_fused_adam_no_check",
            Mode::Graphed(SkipWriteCheck, MultiAdam) => "graphed_multi_adam_no_check",
            Mode::GraphedStatic(Adam) => "graphed_static",
            Mode::Eager(FusedAdam) => "eager_fused_adam",
            Mode::Graphed(_, FusedAdam) => "graphed_fused_adam",
            Mode::GraphedStatic(FusedAdam) => "graphed_static_fused_adam",
            Mode::GraphedGuarded(Adam) => "graphed_guarded",
            Mode::GraphedGuarded(FusedAdam) => "graphed_guarded_fused_adam",
            Mode::Eager(MultiAdam) => "eager_multi_adam",
            Mode::Graphed(_, MultiAdam) => "graphed_multi_adam",
            Mode::GraphedStatic(MultiAdam) => "graphed_static_multi_adam",
            Mode::GraphedGuarded(MultiAdam) => "graphed_guarded_multi_adam",
            Mode::GraphedLoss(Adam) => "graphed_loss_static",
            Mode::GraphedLoss(FusedAdam) => "graphed_loss_static_fused_adam",
            Mode::GraphedLoss(MultiAdam) => "graphed_loss_static_multi_adam",
            // Faults of whole steps: no `Graphed` mode injects them.
            Mode::Graphed(FaultInjection::SkipUpdate | FaultInjection::FreezeLr, _) => {
                "graphed_whole_step_fault"
            }
            Mode::WholeStep(false) => "whole_step",
            Mode::WholeStep(true) => "whole_step_floor",
            Mode::FirstStep(First::WholeStep) => "first_step",
            Mode::FirstStep(First::Graphed) => "first_step_graphed",
            Mode::FirstStep(First::Eager) => "first_step_eager",
            Mode::Inference {
                graphed: false,
                one: false,
            } => "inference",
            Mode::Inference {
                graphed: true,
                one: false,
            } => "inference_graphed",
            Mode::Inference {
                graphed: false,
                one: true,
            } => "inference_b1",
            Mode::Inference {
                graphed: true,
                one: true,
            } => "inference_graphed_b1",
            Mode::InferenceFault(FaultInjection::SkipInputCopy) => "inference_graphed_b1_floor",
            Mode::InferenceFault(_) => "inference_graphed_b1_no_check",
            Mode::Ddp(DdpStep::Eager) => "ddp_eager",
            Mode::Ddp(DdpStep::Graphed) => "ddp_graphed",
            Mode::Ddp(DdpStep::WholeStep) => "ddp_whole_step",
            Mode::Ddp(DdpStep::InGraph) => "ddp_whole_step_in_graph",
            Mode::Ddp(DdpStep::InGraphOverlap) => "ddp_whole_step_in_graph_overlap",
            Mode::Ddp(DdpStep::BetweenGraphs) => "ddp_whole_step_processes",
            Mode::Ddp(DdpStep::InGraphSockets) => "ddp_whole_step_in_graph_sockets",
            Mode::Ddp(DdpStep::ThreadsInGraph) => "ddp_whole_step_threads_in_graph",
            Mode::Ddp(DdpStep::ThreadsInGraphOverlap) => "ddp_whole_step_threads_in_graph_overlap",
            Mode::Ddp(DdpStep::ThreadsInGraphOverlapOneStream) => {
                "ddp_whole_step_threads_in_graph_overlap_one_stream"
            }
        }
    }

    /// The fault the graphed model's capture builds in (graphed modes).
    pub(crate) fn fault(self) -> FaultInjection {
        match self {
            Mode::Graphed(fault, _) | Mode::InferenceFault(fault) => fault,
            Mode::WholeStep(true) => FaultInjection::SkipInputCopy,
            _ => FaultInjection::None,
        }
    }

    /// The graphed model's configuration (graphed modes).
    pub(crate) fn config(self) -> GraphedConfig {
        match self {
            Mode::Graphed(..) => GraphedConfig::new().with_outputs(OutputPolicy::Copy),
            Mode::GraphedGuarded(_) => GraphedConfig::new().with_outputs(OutputPolicy::Guarded),
            _ => GraphedConfig::new().with_outputs(OutputPolicy::Static),
        }
    }

    /// Whether the mode skips a copy on purpose, so that its values are wrong and its check
    /// must fail. Skipping the check of written buffers does not: every tensor of the bench is
    /// written. The inference floor (`inference_graphed_b1_floor`) does: it replays on what its
    /// input buffer held after the capture (the replay validation's draw, not a batch the
    /// bench holds), so its outputs must differ from the eager call's on the batch it is given.
    pub(crate) fn injects_fault(self) -> bool {
        matches!(
            self,
            Mode::Graphed(
                FaultInjection::SkipInputCopy | FaultInjection::SkipParamCopy,
                _
            ) | Mode::InferenceFault(FaultInjection::SkipInputCopy)
        )
    }

    /// Whether the mode's graph trains on the batch it was captured on, whatever it is given
    /// (the whole step's floor skips the input copy to time the device's floor, and its
    /// capture leaves that batch in its input buffer): its check trains both runs on that batch
    /// alone, and must pass.
    pub(crate) fn replays_capture_batch(self) -> bool {
        matches!(self, Mode::WholeStep(true))
    }

    pub(crate) fn optimizer(self) -> Optimizer {
        let optim = match self {
            Mode::Eager(optim)
            | Mode::Graphed(_, optim)
            | Mode::GraphedStatic(optim)
            | Mode::GraphedGuarded(optim)
            | Mode::GraphedLoss(optim) => optim,
            Mode::WholeStep(_)
            | Mode::FirstStep(_)
            | Mode::Inference { .. }
            | Mode::InferenceFault(_) => Optim::Adam,
            Mode::Ddp(_) => Optim::MultiAdam,
        };
        match optim {
            Optim::Adam => Optimizer::Module(AdamConfig::new().init()),
            Optim::FusedAdam => Optimizer::Module(FusedAdamConfig::new().init()),
            Optim::MultiAdam => Optimizer::Multi(FusedAdamConfig::new().init_multi_tensor()),
        }
    }
}

/// Times `reps` x `steps` training steps in `mode`, from a fresh model.
pub(crate) fn run<M, I, O>(
    case: &Case<M, I, O>,
    mode: Mode,
    device: &Device,
    options: &Options,
) -> Row
where
    M: Module,
    I: TensorGroup + Clone,
    O: TensorGroup,
{
    device.memory_cleanup();
    let before = reserved(device);
    let label = format!("{} {}{}", case.name, mode.label(), case.variant);
    trace_phase("setup");
    let unmeasured_before = warn_log::unmeasured();
    #[cfg(feature = "cube")]
    let _trace = options
        .kernel_trace
        .as_deref()
        .map(|file| kernel_trace::Trace::start(file, &label));
    if let Mode::FirstStep(first) = mode {
        return first_step(case, first, &label, device, options, before);
    }
    if let Mode::Ddp(ddp) = mode {
        return data_parallel(case, ddp, device, options, before, unmeasured_before);
    }
    if let Mode::Inference { .. } | Mode::InferenceFault(_) = mode {
        let (graphed, batch) = match mode {
            Mode::Inference { graphed, one } => (graphed, if one { 1 } else { case.batch }),
            _ => (true, 1),
        };
        let (per_step, check) =
            timed_inference(case, graphed, batch, mode.fault(), &label, device, options);
        let mut row = Row::timed(
            case,
            mode,
            per_step,
            device,
            before,
            options,
            unmeasured_before,
        );
        row.check = check.map(Check::Outputs);
        return row;
    }
    let model = (case.make)(device);
    let inputs: Vec<I> = (0..4).map(|_| (case.input)(device, case.batch)).collect();
    let mut optimizer = mode.optimizer();
    // The model moves through the optimizer (`model = optim.step(lr, model, grads)`, no
    // clone), as in a training loop: a clone would keep the old parameters alive during the
    // step, and `FusedAdam` could then not update the graphs' buffers in place.
    let per_step = match mode {
        Mode::Eager(_) => {
            let (per_step, model) = train_steps(
                model,
                case.call,
                case.loss,
                &inputs,
                &mut optimizer,
                &label,
                device,
                options,
                None,
            );
            if let Some(model) = &model {
                assert_ran(model, &label);
            }
            per_step
        }
        Mode::GraphedLoss(_) => timed_graphed(
            model,
            case.call_loss,
            |loss, _| loss,
            mode,
            &inputs,
            &mut optimizer,
            &label,
            device,
            options,
        ),
        Mode::FirstStep(_) | Mode::Inference { .. } | Mode::InferenceFault(_) | Mode::Ddp(_) => {
            unreachable!("measured above")
        }
        Mode::WholeStep(floor) => timed_whole_step(
            model,
            case.call_loss,
            floor,
            &inputs,
            &label,
            device,
            options,
        ),
        Mode::Graphed(..) | Mode::GraphedStatic(_) | Mode::GraphedGuarded(_) => timed_graphed(
            model,
            case.call,
            case.loss,
            mode,
            &inputs,
            &mut optimizer,
            &label,
            device,
            options,
        ),
    };
    let mut row = Row::timed(
        case,
        mode,
        per_step,
        device,
        before,
        options,
        unmeasured_before,
    );
    // After the timed run and its memory reading: the check's models and pools are not in them.
    // Eager runs are the reference the checks compare with (`assert_ran` read them back).
    row.check = (options.check && !matches!(mode, Mode::Eager(_)))
        .then(|| Check::Steps(check(case, mode, &label, device, options)));
    if let Some(check) = &row.check {
        eprintln!("# {label}: value check {check}");
    }
    row
}
