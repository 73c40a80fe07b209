//! The plain values that cross the engine's front door, with or without the `cube` feature.

use burn::optim::AdamState;
use burn::tensor::Tensor;

use crate::tensors::TensorSpec;

/// What a successful capture of a group hands up (`G`: the engine's [`Graphs`](super::Graphs)).
pub(crate) struct CapturedGroup<G> {
    /// One per member, in execution order.
    pub members: Vec<CapturedMember<G>>,
    /// Growth of the device's reserved pool bytes over the whole capture (warm-ups included):
    /// an upper bound on the memory that the graphs pin.
    pub pool_growth_bytes: u64,
    /// Reserved bytes that the capture's memory cleanup returned to the device.
    pub released_bytes: u64,
}

/// One captured member of a group.
pub(crate) struct CapturedMember<G> {
    pub graphs: G,
    /// The inputs as captured (for a chained member: the previous member's outputs).
    pub inputs: Vec<TensorSpec>,
    /// How many outputs the callable returns.
    pub outputs: usize,
    /// Bytes of the static buffers the member owns (see `CaptureSummary::static_bytes`).
    pub static_bytes: u64,
}

/// What a fused Adam step hands back when it cannot fuse: the parameter, its gradient and its
/// state, untouched.
pub(crate) type Unfused<const D: usize> = (Tensor<D>, Tensor<D>, Option<AdamState<D>>);

/// How a whole step is recorded: as one graph, or cut at its gradient bucket into two graphs,
/// a gradient graph (forward, loss, backward, the gradients flattened into one bucket) and an
/// update graph (the bucket split back, clipped, the optimizer update), so that a collective
/// can average the bucket between the two replays; or as one graph with the bucket's NCCL
/// all-reduce inside ([`StepCut::InGraph`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StepCut {
    Whole,
    AtBucket,
    /// One graph: gradients, the bucket averaged by NCCL group `group` (the engine's number,
    /// `collective::join`), the update. Every rank captures at once, with a fixed number of
    /// warm-ups (their all-reduces pair up one for one).
    InGraph {
        group: usize,
    },
}

impl StepCut {
    /// The NCCL group of a step with its all-reduce inside.
    #[cfg_attr(not(feature = "cube"), allow(dead_code))]
    pub(crate) fn group(self) -> Option<usize> {
        match self {
            StepCut::InGraph { group } => Some(group),
            StepCut::Whole | StepCut::AtBucket => None,
        }
    }
}

/// How the ranks of a step with its all-reduce inside agree before each all-reduce, so that no
/// rank waits in one that another rank will never reach: every rank states its outcome
/// (`Ok` or its error) on `what` and gets the group's (the first failure, on every rank).
pub(crate) type Meet<'a> = dyn Fn(&str, Result<(), crate::error::GraphedError>) -> Result<(), crate::error::GraphedError>
    + 'a;

/// A step's gradients flattened, in the parameters' visiting order, into one 1-D tensor.
pub(crate) struct Bucket {
    /// Valid until the next step of the same state: a graph's bucket is its own buffer.
    pub tensor: burn::backend::DispatchTensor,
    pub layout: BucketLayout,
}

/// Which parameters a [`Bucket`] holds gradients of, its length and element type: what ranks
/// compare before averaging their buckets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BucketLayout {
    /// Per float parameter, in visiting order: whether its gradient is in the bucket.
    pub has_grad: Vec<bool>,
    /// Elements in the bucket.
    pub len: usize,
    /// The bucket's element type: the gradients', or `f32` where they differ.
    pub dtype: burn::tensor::DType,
}

impl BucketLayout {
    /// Which parameters the bucket holds, as one number (FNV-1a over `has_grad`): two ranks
    /// whose buckets have the same length but hold other parameters' gradients differ here.
    pub fn fingerprint(&self) -> u64 {
        self.has_grad
            .iter()
            .fold(0xcbf2_9ce4_8422_2325, |hash, &grad| {
                (hash ^ u64::from(grad) ^ 0x2).wrapping_mul(0x0100_0000_01b3)
            })
    }
}

/// The tensors of a fused op with parameters: the input, its parameter and an optional second
/// one (a norm's gamma and beta, a linear layer's weight and bias).
pub(crate) type OpInputs = (
    burn::backend::DispatchTensor,
    burn::backend::DispatchTensor,
    Option<burn::backend::DispatchTensor>,
);

/// The tensors of a fused linear layer: the input, the weight and the bias, then the residual
/// added to its output (`[rows, d_out]`).
pub(crate) type LinearInputs = (OpInputs, Option<burn::backend::DispatchTensor>);

/// What a fused 2-D convolution computes besides its tensors: burn's `ConvOptions<2>` and
/// whether a bias is added.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ConvSpec {
    pub(crate) stride: [usize; 2],
    /// `(before, after)` per spatial dimension.
    pub(crate) padding: [(usize, usize); 2],
    pub(crate) dilation: [usize; 2],
    pub(crate) groups: usize,
    pub(crate) has_bias: bool,
}

impl ConvSpec {
    /// The output's shape for an input of shape `input` (`[batch, channels, height, width]`)
    /// and a weight of shape `weight` (`[out_channels, channels / groups, kernel_h,
    /// kernel_w]`), as burn computes it; a spatial size the kernel does not fit is 0.
    pub(crate) fn output_shape(&self, input: &[usize; 4], weight: &[usize; 4]) -> [usize; 4] {
        let size = |d: usize| {
            let padded = input[2 + d] + self.padding[d].0 + self.padding[d].1;
            let reach = self.dilation[d] * (weight[2 + d].max(1) - 1) + 1;
            padded
                .checked_sub(reach)
                .map_or(0, |room| room / self.stride[d].max(1) + 1)
        };
        [input[0], weight[0], size(0), size(1)]
    }
}

/// The tensors of a fused cross-entropy: logits, targets.
pub(crate) type LossInputs = (burn::backend::DispatchTensor, burn::backend::DispatchTensor);

/// The tensors of a fused embedding: the table, the ids.
pub(crate) type EmbeddingInputs = (burn::backend::DispatchTensor, burn::backend::DispatchTensor);

/// The tensors of a fused attention: queries, keys, values (`[batch, len, heads, dim]`) and
/// an `i32` mask (read only where the call is masked; otherwise any one-element int tensor,
/// bound and never read).
pub(crate) type AttentionInputs = (
    burn::backend::DispatchTensor,
    burn::backend::DispatchTensor,
    burn::backend::DispatchTensor,
    burn::backend::DispatchTensor,
);

/// The tensors of a packed fused attention: the queries, keys and values as one tensor
/// `[batch, len, 3 * heads, dim]` and the mask as [`AttentionInputs`]'.
pub(crate) type PackedAttentionInputs =
    (burn::backend::DispatchTensor, burn::backend::DispatchTensor);

/// The three tensors of one shape a fused join puts side by side.
pub(crate) type JoinInputs = (
    burn::backend::DispatchTensor,
    burn::backend::DispatchTensor,
    burn::backend::DispatchTensor,
);

/// Three weights of one shape and their three biases, which a fused join puts side by side in
/// one launch.
pub(crate) type JoinBiasedInputs = (JoinInputs, JoinInputs);

/// What a fused attention computes besides its tensors.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct AttentionSpec {
    /// The mask tensor hides keys (nonzero).
    pub(crate) masked: bool,
    /// Keys after their query are hidden.
    pub(crate) causal: bool,
    /// burn's `quiet_softmax`: a virtual score 0 in every row's softmax.
    pub(crate) quiet: bool,
    /// The scores' scale.
    pub(crate) scale: f32,
    /// The score of a hidden key (`-inf` as burn's `attention`, or burn-nn's `min_float`).
    pub(crate) fill: f32,
}
