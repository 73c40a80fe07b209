//! A data-parallel step's all-reduces started during its backward ([`StepCut::InGraph`] with
//! one micro-batch): burn's autodiff hands each parameter's gradient over as soon as it is final
//! (the carried burn-backend's `GradientSync`; the step's leaves marked distributed, their
//! ids their positions), the gradients fill buckets of a fixed plan, and each bucket's
//! all-reduce starts once the bucket is full and the buckets before it started (every rank
//! issues NCCL's collectives in one order), on the group's side stream, beside the rest of the
//! backward. After the backward, the buckets not started yet start (a parameter without a
//! gradient leaves its bucket to then, composed of the gradients there are, alike on every rank
//! whose gradients are alike: the ranks agree on that layout every step); the update reads
//! each bucket after cubecl's stream waited for its all-reduce. The plan's last bucket (the
//! first layers', final as the backward ends) and the buckets that start after the backward run
//! on cubecl's stream once it joined the side stream: nothing is left to overlap them with, and
//! a step's graph then holds one branch without redundant edges (`side_stream`).
//!
//! [`StepCut::InGraph`]: super::super::values::StepCut::InGraph

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use burn::backend::distributed::{DistributedParams, GradientSync, set_gradient_sync};
use burn::backend::ops::FloatTensorOps;
use burn::backend::{AutodiffBackend, Dispatch, DispatchTensor, TensorMetadata};
use burn::module::ParamId;
use burn::tensor::{DType, Shape, Tensor};

use super::super::buffers::{FusedTensor, check_written, dispatch_of};
use super::super::collective::{start_mean, wait_mean};
use super::super::values::BucketLayout;
use super::step_state::StepState;
use crate::callable::StepRunner;
use crate::error::{CapturePhase, GraphedError};
use crate::sync::lock;
use crate::tensors::FlatTensor;

/// Whether data-parallel steps start their all-reduces during the backward, or after it in one
/// bucket (the default): off until two GPUs show it gains. On one rank, where nothing overlaps,
/// it cost 12 us of the MLP's 183 us step and 38 us of the transformer's 751 us
/// (`h200_ddp_one_rank_overlap_ab_9efc0d7.jsonl`; docs/decisions.md).
static ENABLED: AtomicBool = AtomicBool::new(false);

/// Whether the all-reduces start during the backward ([`ENABLED`]).
pub(in crate::cube) fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Turns the start during the backward on or off (the default), for recordings made after.
#[cfg(feature = "testing")]
pub(crate) fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Bucket caps a test asked for instead of [`BUCKET_CAPS`] (both 0: none).
static CAPS: (AtomicUsize, AtomicUsize) = (AtomicUsize::new(0), AtomicUsize::new(0));

/// Buckets started while the backward went on, and after it, in this process.
static STARTS: (AtomicUsize, AtomicUsize) = (AtomicUsize::new(0), AtomicUsize::new(0));

/// The bucket caps in force ([`BUCKET_CAPS`], or a test's).
pub(in crate::cube) fn caps() -> (usize, usize) {
    match (
        CAPS.0.load(Ordering::Relaxed),
        CAPS.1.load(Ordering::Relaxed),
    ) {
        (0, 0) => BUCKET_CAPS,
        caps => caps,
    }
}

/// Makes later plans cut buckets at `caps` (the first bucket's bytes, the others'), or at
/// [`BUCKET_CAPS`] again (`None`).
#[cfg(feature = "testing")]
pub(crate) fn set_caps(caps: Option<(usize, usize)>) {
    let (first, rest) = caps.map_or((0, 0), |(f, r)| (f.max(1), r.max(1)));
    CAPS.0.store(first, Ordering::Relaxed);
    CAPS.1.store(rest, Ordering::Relaxed);
}

/// Buckets started so far in this process: while their backward went on, and after it.
#[cfg(feature = "testing")]
pub(crate) fn starts() -> (usize, usize) {
    (
        STARTS.0.load(Ordering::Relaxed),
        STARTS.1.load(Ordering::Relaxed),
    )
}

/// The first bucket's bytes and the others' at most, as PyTorch's DDP sizes them
/// (`_DEFAULT_FIRST_BUCKET_BYTES`, `bucket_cap_mb=25`): the first holds the last layers'
/// gradients, which come first, so that its all-reduce starts early.
pub(in crate::cube) const BUCKET_CAPS: (usize, usize) = (1 << 20, 25 << 20);

/// Which parameters (positions among the step's float parameters) each bucket holds, in the
/// order the buckets start: the trained parameters in reverse, cut where a bucket would pass
/// its bytes (`caps`: the first bucket's, the others'; a parameter larger is a bucket of its
/// own).
pub(in crate::cube) fn plan(
    numels: &[usize],
    trained: &[bool],
    elem_bytes: usize,
    (first_cap, cap): (usize, usize),
) -> Vec<Vec<usize>> {
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let mut bytes = 0;
    for index in (0..numels.len()).rev().filter(|&i| trained[i]) {
        let size = numels[index] * elem_bytes;
        let cap = if buckets.len() == 1 { first_cap } else { cap };
        match buckets.last_mut() {
            Some(bucket) if bytes + size <= cap => {
                bucket.push(index);
                bytes += size;
            }
            _ => {
                buckets.push(vec![index]);
                bytes = size;
            }
        }
    }
    buckets
}

/// How a started bucket's all-reduce is enqueued (`collective::start_mean` on CUDA; the CPU
/// suite's tests pass their own): bucket `index` of the step, its values, whether it is the
/// step's last (nothing left to overlap it with), to its mean.
pub(in crate::cube) type Start = Box<dyn FnMut(usize, Tensor<1>, bool) -> Tensor<1> + Send>;

/// The buckets of one backward pass: the gradients handed over, the buckets started.
pub(in crate::cube) struct Buckets {
    plan: Vec<Vec<usize>>,
    /// Per parameter position: its bucket in `plan`.
    bucket_of: Vec<Option<usize>>,
    /// Per parameter position: its flat gradient in the bucket's dtype, once handed over.
    arrived: Vec<Option<Tensor<1>>>,
    /// Per bucket of `plan`: gradients not handed over yet.
    waiting: Vec<usize>,
    /// Buckets of `plan` started (a prefix), each with the parameters it holds and its mean.
    started: Vec<(Vec<usize>, Tensor<1>)>,
    /// Buckets of `plan` dealt with: started, or empty (no gradient) and passed over.
    next: usize,
    /// The backward returned ([`finish`](Self::finish) started the rest).
    finishing: bool,
    dtype: DType,
    start: Start,
    /// A gradient of another backend than burn's cubecl one, or of a position outside the plan.
    foreign: Option<String>,
}

impl Buckets {
    /// Buckets by `plan` for parameters of `numels` elements, reduced in `dtype`.
    pub(in crate::cube) fn new(
        plan: Vec<Vec<usize>>,
        params: usize,
        dtype: DType,
        start: Start,
    ) -> Self {
        let mut bucket_of = vec![None; params];
        for (bucket, members) in plan.iter().enumerate() {
            for &index in members {
                bucket_of[index] = Some(bucket);
            }
        }
        let waiting = plan.iter().map(Vec::len).collect();
        Self {
            plan,
            bucket_of,
            arrived: vec![None; params],
            waiting,
            started: Vec::new(),
            next: 0,
            finishing: false,
            dtype,
            start,
            foreign: None,
        }
    }

    /// Parameter `index`'s final gradient; starts the buckets that are full, in order.
    fn arrive(&mut self, index: usize, grad: DispatchTensor) {
        let Some(bucket) = self.bucket_of.get(index).copied().flatten() else {
            self.foreign.get_or_insert_with(|| {
                format!("a gradient of parameter {index}, outside the plan")
            });
            return;
        };
        if self.arrived[index].is_some() {
            return;
        }
        self.arrived[index] = Some(self.flat(grad));
        self.waiting[bucket] -= 1;
        while self.next < self.plan.len() && self.waiting[self.next] == 0 {
            self.start_next();
        }
    }

    /// `grad` flat, in the buckets' dtype.
    fn flat(&self, grad: DispatchTensor) -> Tensor<1> {
        let numel = grad.shape().num_elements();
        let flat = Tensor::<1>::from_dispatch(Dispatch::float_reshape(grad, Shape::new([numel])));
        if flat.dtype() == self.dtype {
            flat
        } else {
            flat.cast(self.dtype)
        }
    }

    /// Starts bucket `next` with the gradients it got (passes over one that got none).
    fn start_next(&mut self) {
        let members: Vec<usize> = self.plan[self.next]
            .iter()
            .copied()
            .filter(|&i| self.arrived[i].is_some())
            .collect();
        self.next += 1;
        if members.is_empty() {
            return;
        }
        let parts = members
            .iter()
            .filter_map(|&i| self.arrived[i].clone())
            .collect();
        // A fresh buffer the all-reduce alone holds: reduced in place.
        let bucket = Tensor::cat(parts, 0);
        // The plan's last bucket holds the first layers' gradients, final as the backward ends,
        // as are the buckets that start after it.
        let last = self.finishing || self.next == self.plan.len();
        let mean = (self.start)(self.started.len(), bucket, last);
        self.started.push((members, mean));
        let count = if self.finishing { &STARTS.1 } else { &STARTS.0 };
        count.fetch_add(1, Ordering::Relaxed);
    }

    /// After the backward: the gradients autodiff did not hand over (`grads`: every
    /// parameter's, `None` where it got none) join their buckets, and the buckets not started
    /// yet start. Returns the started buckets and the layout the ranks agree on.
    ///
    /// # Errors
    ///
    /// A gradient handed over of another backend, or for a parameter that has none after
    /// the backward.
    pub(in crate::cube) fn finish(
        mut self,
        grads: &[Option<DispatchTensor>],
    ) -> Result<Started, String> {
        if let Some(reason) = self.foreign.take() {
            return Err(reason);
        }
        for (index, grad) in grads.iter().enumerate() {
            match (grad, self.arrived[index].is_some()) {
                (Some(grad), false) if self.bucket_of[index].is_some() => {
                    self.arrived[index] = Some(self.flat(grad.clone()));
                }
                (None, true) => {
                    return Err(format!(
                        "parameter {index}'s gradient was handed over during the backward and is \
                         missing after it"
                    ));
                }
                _ => {}
            }
        }
        self.finishing = true;
        while self.next < self.plan.len() {
            self.start_next();
        }
        let layout = BucketLayout {
            has_grad: grads.iter().map(Option::is_some).collect(),
            len: self
                .started
                .iter()
                .map(|(_, mean)| mean.shape().num_elements())
                .sum(),
            dtype: self.dtype,
        };
        Ok(Started {
            buckets: self.started,
            layout,
        })
    }
}

/// [`StepState::gradients`] of one micro-batch with the all-reduces of NCCL group `group`
/// started during the backward: the losses, the started buckets with their layout, and the
/// queued results to hold.
///
/// # Errors
///
/// [`StepState::gradients`]' errors, and a gradient that autodiff handed over and the backward
/// then did not return (a capture error of `phase`).
#[allow(clippy::type_complexity)]
pub(in crate::cube) fn gradients(
    state: &StepState,
    run: &StepRunner<'_>,
    leaves: &[DispatchTensor],
    micro_inputs: &[Vec<FlatTensor>],
    phase: CapturePhase,
    group: usize,
) -> Result<(Vec<DispatchTensor>, Started, Vec<FusedTensor>), GraphedError> {
    let specs = state.param_specs();
    let trained = state.trained();
    let numels: Vec<usize> = specs
        .iter()
        .map(|(shape, _)| shape.num_elements())
        .collect();
    let mut dtypes = specs
        .iter()
        .zip(trained)
        .filter(|(_, trained)| **trained)
        .map(|((_, dtype), _)| *dtype);
    let first = dtypes.next().unwrap_or(DType::F32);
    let dtype = if dtypes.all(|d| d == first) {
        first
    } else {
        DType::F32
    };
    let plan = plan(&numels, trained, dtype.size(), caps());
    let start: Start = Box::new(move |index, bucket, last| start_mean(bucket, group, index, last));
    let buckets = Buckets::new(plan, numels.len(), dtype, start);
    let marked = marked(leaves, trained);
    let (gradients, buckets) = during(buckets, || {
        state.gradients(run, &marked, micro_inputs, phase)
    });
    let (losses, grads, kept) = gradients?;
    let started = buckets
        .finish(&grads)
        .map_err(|reason| GraphedError::Capture { phase, reason })?;
    Ok((losses, started, kept))
}

/// The gradients of `started`'s buckets, each read after cubecl's stream waited for its
/// all-reduce, in their parameters' shapes and dtypes (`None` for a parameter without).
pub(in crate::cube) fn split(
    state: &StepState,
    started: Started,
    group: usize,
) -> Vec<Option<DispatchTensor>> {
    let specs = state.param_specs();
    let mut grads: Vec<Option<DispatchTensor>> = vec![None; specs.len()];
    for (index, (members, mean)) in started.buckets.into_iter().enumerate() {
        let mean = wait_mean(mean, group, index);
        let mut offset = 0;
        for member in members {
            let (shape, dtype) = &specs[member];
            let numel = shape.num_elements();
            let part = mean.clone().narrow(0, offset, numel);
            offset += numel;
            let part = if part.dtype() == *dtype {
                part
            } else {
                part.cast(*dtype)
            };
            grads[member] = Some(Dispatch::float_reshape(part.into_dispatch(), shape.clone()));
        }
    }
    grads
}

/// The buckets a backward pass started (each with the parameters it holds, in order, and its
/// mean, not yet waited for) and the layout the ranks agree on.
pub(in crate::cube) struct Started {
    pub(in crate::cube) buckets: Vec<(Vec<usize>, Tensor<1>)>,
    pub(in crate::cube) layout: BucketLayout,
}

impl Started {
    /// Whether the device wrote every bucket's values (runs the work queued for them).
    pub(in crate::cube) fn check_written(&self) -> Result<(), String> {
        self.buckets
            .iter()
            .try_for_each(|(_, mean)| check_written(&mean.clone().into_dispatch()))
    }
}

/// A [`Buckets`] installed as this thread's gradient sync.
struct Hook(Arc<Mutex<Option<Buckets>>>);

impl GradientSync for Hook {
    fn begin(&mut self, _params: &[DistributedParams]) {}

    fn gradient(&mut self, tensor: &mut dyn Any, params: &DistributedParams) {
        let mut buckets = lock(&self.0);
        let Some(buckets) = buckets.as_mut() else {
            return;
        };
        match tensor.downcast_ref::<FusedTensor>() {
            Some(fused) => {
                buckets.arrive(params.param_id.val() as usize, dispatch_of(fused.clone()))
            }
            None => {
                buckets
                    .foreign
                    .get_or_insert_with(|| "a gradient not on burn's cubecl backend".into());
            }
        }
    }

    fn end(&mut self) {}
}

/// `leaves` with the trained ones marked distributed, each with its position as its id: the
/// gradients autodiff hands over name their parameters so. Marks fresh leaves for every
/// backward pass: a pass consumes the marks of its graph.
pub(in crate::cube) fn marked(leaves: &[DispatchTensor], trained: &[bool]) -> Vec<DispatchTensor> {
    leaves
        .iter()
        .zip(trained)
        .enumerate()
        .map(|(index, (leaf, &trained))| {
            if trained {
                Dispatch::set_distributed_params(leaf.clone(), ParamId::from(index as u64))
            } else {
                leaf.clone()
            }
        })
        .collect()
}

/// Runs `backward` with `buckets` as this thread's gradient sync (the one before it back
/// afterwards, a panic included), and gives them back.
pub(in crate::cube) fn during<T>(buckets: Buckets, backward: impl FnOnce() -> T) -> (T, Buckets) {
    /// Puts the thread's gradient sync before back when dropped.
    struct Restore(Option<Box<dyn GradientSync>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            set_gradient_sync(self.0.take());
        }
    }
    let shared = Arc::new(Mutex::new(Some(buckets)));
    let restore = Restore(set_gradient_sync(Some(Box::new(Hook(shared.clone())))));
    let result = backward();
    drop(restore);
    let buckets = lock(&shared)
        .take()
        .expect("the hook keeps the buckets until now");
    (result, buckets)
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use std::sync::{Arc, Mutex};

    use burn::backend::ops::FloatTensorOps;
    use burn::backend::{Dispatch, DispatchTensor};
    use burn::tensor::{DType, Device, Distribution, Tensor};

    use super::super::super::graph::driver::autodiff_leaf;
    use super::{Buckets, during, marked, plan};

    /// A three-layer network's gradients, by the backward alone and through the buckets: autodiff
    /// hands each parameter's gradient over while the backward goes on, so that with a bucket
    /// per parameter every bucket has started (in reverse order: the last layer's first) when
    /// the backward returns, before `finish`; and the buckets' values, split back, are the
    /// backward's gradients bit for bit (the "all-reduce" here is the identity). The control:
    /// the same backward without the marks hands nothing over, and nothing starts before
    /// `finish`.
    #[test]
    fn gradients_start_their_buckets_during_the_backward() {
        let device = Device::wgpu(Default::default());
        let shapes = [[4, 8], [8, 8], [8, 2]];
        let values: Vec<DispatchTensor> = shapes
            .iter()
            .map(|&s| Tensor::<2>::random(s, Distribution::Default, &device).into_dispatch())
            .collect();
        let x = Tensor::<2>::random([3, 4], Distribution::Default, &device.clone().autodiff());
        let trained = [true; 3];
        let numels: Vec<usize> = shapes.iter().map(|s| s[0] * s[1]).collect();
        let run = |leaves: &[DispatchTensor]| {
            let w: Vec<Tensor<2>> = leaves
                .iter()
                .map(|l| Tensor::<2>::from_dispatch(l.clone()))
                .collect();
            let h = burn::tensor::activation::relu(x.clone().matmul(w[0].clone()));
            let h = burn::tensor::activation::relu(h.matmul(w[1].clone()));
            let loss = h.matmul(w[2].clone()).sum();
            let grads = loss.backward();
            w.iter()
                .map(|w| w.grad(&grads).map(|g| g.into_dispatch()))
                .collect::<Vec<_>>()
        };
        for mark in [true, false] {
            let leaves: Vec<DispatchTensor> =
                values.iter().map(|v| autodiff_leaf(v, true)).collect();
            let leaves = if mark {
                marked(&leaves, &trained)
            } else {
                leaves
            };
            let started = Arc::new(Mutex::new(Vec::new()));
            let log = started.clone();
            let start: super::Start = Box::new(move |index, bucket: Tensor<1>, last| {
                log.lock()
                    .unwrap()
                    .push((index, bucket.shape().num_elements(), last));
                bucket
            });
            // One parameter a bucket: caps of one byte.
            let buckets = Buckets::new(plan(&numels, &trained, 4, (1, 1)), 3, DType::F32, start);
            let (grads, buckets) = during(buckets, || run(&leaves));
            let during_backward = started.lock().unwrap().clone();
            if mark {
                assert_eq!(
                    during_backward,
                    vec![(0, 16, false), (1, 64, false), (2, 32, true)],
                    "last layer first; the first layer's bucket, the plan's last, last"
                );
            } else {
                assert!(during_backward.is_empty(), "control: {during_backward:?}");
            }
            let started = buckets.finish(&grads).expect("finish");
            assert_eq!(started.layout.has_grad, vec![true; 3]);
            assert_eq!(started.layout.len, numels.iter().sum::<usize>());
            for (members, mean) in started.buckets {
                let member = members[0];
                let grad = Tensor::<1>::from_dispatch(Dispatch::float_reshape(
                    grads[member].clone().expect("a gradient"),
                    [numels[member]].into(),
                ));
                mean.to_data().assert_eq(&grad.to_data(), true);
            }
        }
    }
}
