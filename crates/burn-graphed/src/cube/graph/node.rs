//! The autodiff node of a graphed call: a backend extension whose `Autodiff<Cube, C>`
//! implementation links the replayed float outputs to their parents (float inputs and
//! parameters) and
//! whose backward replays the backward graph.

use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, NodeGuard, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Autodiff, Backend, BackendTensor, Cube, Dispatch, DispatchAutodiffContext, DispatchTensor,
    DispatchTensorKind, ExtensionType, backend_extension,
};

/// The autodiff tensor of burn's cubecl backend.
type AutodiffTensor = FloatTensor<Autodiff<Cube>>;

use super::super::buffers::FusedTensor;
use super::session::{PendingBackward, Session};

/// The parents of a graphed call (float inputs, then parameters), crossing burn's dispatch boundary
/// as one extension value: the derive of `ExtensionType` has no vector fields, so this is the
/// hand-written equivalent.
pub(crate) struct Parents<B: Backend> {
    pub tensors: Vec<FloatTensor<B>>,
}

impl<B: Backend> ExtensionType<B> for Parents<B> {
    type Target = Parents<Dispatch>;

    fn map_to_dispatch<F>(self, map_kind: F, autodiff: DispatchAutodiffContext) -> Self::Target
    where
        F: Fn(BackendTensor<B>) -> DispatchTensorKind,
    {
        Parents {
            tensors: self
                .tensors
                .into_iter()
                .map(|tensor| DispatchTensor {
                    kind: map_kind(BackendTensor::Float(tensor)),
                    autodiff,
                })
                .collect(),
        }
    }

    fn map_from_dispatch<F>(target: Self::Target, unwrap_kind: F) -> Self
    where
        F: Fn(DispatchTensor) -> BackendTensor<B>,
    {
        Parents {
            tensors: target
                .tensors
                .into_iter()
                .map(|tensor| unwrap_kind(tensor).float())
                .collect(),
        }
    }

    fn routing_tensor(target: &Self::Target) -> Option<&DispatchTensor> {
        target.tensors.first()
    }

    fn routing_float_tensor(target: &Self::Target) -> Option<&DispatchTensor> {
        target.tensors.first()
    }
}

/// Shared handle to a session, passed through burn's dispatch as an ordinary argument.
#[derive(Debug, Clone)]
pub(crate) struct SessionHandle(pub Arc<Session>);

/// The outputs of the forward replay, as handed out (on the device without autodiff), passed
/// through burn's dispatch as an ordinary argument.
#[derive(Debug, Clone)]
pub(crate) struct ReplayedOutputs(pub Vec<FusedTensor>);

/// The dispatch entry point of a graphed call.
#[backend_extension(Cube, Autodiff)]
pub(crate) trait GraphedOps: Backend {
    /// Returns `outputs`, the outputs of the forward replay that `session` just ran, as
    /// tensors whose gradient flows to `parents` (the call's inputs, then the module's
    /// parameters) through the backward graph. `route` is one of the parents that is on an
    /// autodiff device: burn's dispatch selects the backend from a plain tensor argument, not
    /// from a vector.
    fn graphed_outputs(
        route: FloatTensor<Self>,
        #[extension_type] parents: Parents<Self>,
        outputs: ReplayedOutputs,
        session: SessionHandle,
    ) -> Vec<FloatTensor<Self>>;
}

/// Without autodiff there is no backward: the outputs are returned as they are.
impl GraphedOps for Cube {
    fn graphed_outputs(
        _route: FusedTensor,
        _parents: Parents<Self>,
        outputs: ReplayedOutputs,
        _session: SessionHandle,
    ) -> Vec<FusedTensor> {
        outputs.0
    }
}

impl<C: CheckpointStrategy> GraphedOps for Autodiff<Cube, C> {
    fn graphed_outputs(
        _route: AutodiffTensor,
        parents: Parents<Self>,
        outputs: ReplayedOutputs,
        session: SessionHandle,
    ) -> Vec<AutodiffTensor> {
        let outputs = outputs.0;
        let mut guards = Vec::with_capacity(parents.tensors.len());
        let mut first = None;
        for parent in parents.tensors {
            let (primitive, guard) = parent.into_parts();
            first.get_or_insert(primitive);
            guards.push(guard);
        }
        // The capture guarantees at least one input, hence one parent.
        let pad_primitive = first.expect("a graphed call has at least one parent");
        let single = outputs.len() == 1;
        let main_output = outputs[0].clone();
        let (main, tracked) = bucketed_node::<C>(
            guards,
            &pad_primitive,
            GraphedBackward {
                session: session.0.clone(),
                single,
                token: None,
            },
            main_output,
        );
        if single {
            return vec![main];
        }
        if !tracked {
            return outputs.into_iter().map(AutodiffTensor::new).collect();
        }
        outputs
            .into_iter()
            .enumerate()
            .map(|(index, output)| {
                let step = OutputBackward {
                    session: session.0.clone(),
                    index,
                };
                match step.prepare::<C>([main.node()]).compute_bound().stateful() {
                    OpsKind::Tracked(prep) => prep.finish((), output),
                    OpsKind::UnTracked(prep) => prep.finish(output),
                }
            })
            .collect()
    }
}

/// Backward of the main node: replays the backward graph and registers the gradient of every
/// parent that requires one.
#[derive(Debug)]
struct GraphedBackward {
    session: Arc<Session>,
    /// One output: the main node is the output, and its gradient arrives here.
    single: bool,
    /// Keeps the session's "backward pending" state alive until this step ran or was dropped.
    token: Option<Arc<PendingBackward>>,
}

impl<const N: usize> Backward<Cube, N> for GraphedBackward {
    type State = ();

    fn backward(self, ops: Ops<(), N>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        if self.single {
            let grad = grads.consume::<Cube>(&ops.node);
            self.session.deposit_grad(0, &grad);
        }
        // A backward step cannot return an error in burn 0.22; a failed replay would leave the
        // gradients wrong, so it stops the program with the backend's reason.
        let parent_grads = self
            .session
            .replay_backward()
            .unwrap_or_else(|error| panic!("burn-graphed: {error}"));
        for (parent, grad) in ops.parents.iter().zip(parent_grads) {
            if let (Some(node), Some(grad)) = (parent, grad) {
                grads.register::<Cube>(node.id, grad);
            }
        }
        drop(self.token);
    }
}

/// Backward of one output of a multi-output call: stores the output's gradient for the main
/// node, which runs after every output node (it is their parent).
#[derive(Debug)]
struct OutputBackward {
    session: Arc<Session>,
    index: usize,
}

impl Backward<Cube, 1> for OutputBackward {
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<Cube>(&ops.node);
        self.session.deposit_grad(self.index, &grad);
    }
}

/// Registers `step` with `guards` as parents. burn's `Backward` takes a fixed parent count, so
/// the count is rounded up to a power of two and padded with untracked parents.
fn bucketed_node<C: CheckpointStrategy>(
    guards: Vec<NodeGuard>,
    pad: &FusedTensor,
    mut step: GraphedBackward,
    output: FusedTensor,
) -> (AutodiffTensor, bool) {
    macro_rules! with_bucket {
        ($($n:literal),+) => {
            $(
                if guards.len() <= $n {
                    let mut guards = guards.into_iter();
                    let array: [NodeGuard; $n] = core::array::from_fn(|_| {
                        guards
                            .next()
                            .unwrap_or_else(|| AutodiffTensor::new(pad.clone()).node())
                    });
                    let prepared = <GraphedBackward as Backward<Cube, $n>>::prepare::<C>(step, array)
                        .compute_bound()
                        .stateful();
                    return match prepared {
                        OpsKind::Tracked(prep) => {
                            // Set after `prepare` so that an untracked call leaves no pending
                            // backward behind.
                            (prep.finish((), output), true)
                        }
                        OpsKind::UnTracked(prep) => (prep.finish(output), false),
                    };
                }
            )+
        };
    }
    step.token = Some(step.session.start_pending());
    with_bucket!(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096);
    unreachable!("the capture refuses more than 4096 parents")
}

/// The most parents (inputs plus parameters) one graphed call can have.
pub(crate) const MAX_PARENTS: usize = 4096;

/// Links the replayed `outputs` into autodiff through the dispatch entry point: returns them
/// as tensors of `route`'s device whose gradients flow to `parents`.
pub(crate) fn link(
    route: burn::backend::DispatchTensor,
    parents: Vec<burn::backend::DispatchTensor>,
    outputs: Vec<FusedTensor>,
    session: &Arc<Session>,
) -> Vec<burn::backend::DispatchTensor> {
    <burn::backend::Dispatch as GraphedOps>::graphed_outputs(
        route,
        Parents { tensors: parents },
        ReplayedOutputs(outputs),
        SessionHandle(session.clone()),
    )
}
