//! The optimizer update of a whole-step graph: every parameter of the step updated in place in
//! its static buffer, with its moments or velocity in theirs, by one kernel launch per chunk of
//! parameters, reading the learning rate and the step count from a device buffer (the
//! *schedule*) instead of taking them as launch arguments, which a graph would freeze.
//!
//! The schedule is three `f32` words: the learning rate, the number of updates done so far,
//! and AdamW's decay factor `1 - lr * weight_decay` (computed on the host in `f64` and rounded,
//! as burn-optim computes it). The host writes words 0 and 2 before a replay when the learning
//! rate changed ([`write_schedule`]); the graph advances word 1 after each update
//! ([`advance`]), so the step count lives on the device. A step count is exact in `f32` up to
//! 2^24 updates (the caller refuses more).
//!
//! The arithmetic is burn-optim 0.22's, operation for operation (`adam.rs`, `adamw.rs`,
//! `sgd.rs`, `momentum.rs`, `decay.rs`), in the parameter's own dtype: each operation's result
//! rounded to that dtype and each constant reaching it as that dtype, as eager burn's tensor
//! operations and their scalars do. So a `bf16` step rounds where burn's `bf16` step rounds;
//! computing in `f32` and rounding once would be more precise, and different. Both moments:
//! `m = m*b1 + g*(1-b1)`, `v = v*b2 + (g*g)*(1-b2)`. Adam folds the bias corrections into two
//! constants computed in `f32` like the host's (`c = sqrt(1-b2^t)`; `delta = (m * (c /
//! (1-b1^t))) / (sqrt(v) + eps*c)`); AdamW divides each moment (`delta = (m / (1-b1^t)) /
//! (sqrt(v / (1-b2^t)) + eps)`, then `p = p*keep - delta*lr`); both compute `b^t` by the host's
//! square-and-multiply `powi`. Adam's update is `p - delta*lr`. SGD: `v = g` at the first
//! update, else `g*(1-d) + v*mu`, `g = nesterov ? v*mu + g : v`, `p - g*lr`. An L2 penalty
//! makes the gradient `p*penalty + g` first.
//!
//! Multiply-adds: cubecl's optimizer (cubecl-opt's `InstCombine`) turns `a*b + c`, `a*b - c`
//! and `c - a*b` into one `fma`, taking the product on the left when it feeds nothing else,
//! else the one on the right. burn's fused kernels go through the same pass, so each
//! expression here is written as burn-optim writes it, operands in its order and products
//! not hidden behind variables: the same product is then fused and the other rounded. On
//! CUDA an `fma` rounds once, so picking the other product changes results: AdamW's
//! `p*keep - delta*lr` was written through a variable and contracted as
//! `fma(-delta, lr, p*keep)` where burn's kernel computes `fma(p, keep, -(delta*lr))`,
//! which parted from burn's by up to 34 units in the last place in f32 (24 in f16, 14 in
//! bf16, after cancellation; H100). wgpu's software Vulkan agreed either way (its `fma`
//! rounds like a multiply and an add, as measured: both forms gave burn's values).
//!
//! Over 600 lines: one update kernel for three rules (Adam, AdamW, SGD with momentum) and the
//! schedule's three small kernels, with their launches and fusion operations: the rules share
//! the kernel, so they stay in one file.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata, backend_extension};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use burn_fusion::custom::{
    CustomOpIr, HandleContainer, OperationFn, OperationIr, StreamId, TensorId, TensorIr,
};
use burn_fusion::{FusionBackend, FusionRuntime};
use cubecl::prelude::*;

use super::super::adam::adam_multi_op::{CUBE_THREADS, cubes_along_x, params_per_launch};
use super::super::adam::adam_op::kernel_elem;
use super::super::buffers::FusedTensor;
use super::super::dense::{Dense, Target};
use crate::step_optim::StepOptimizer;

/// Words of the schedule buffer.
pub(crate) const SCHEDULE_WORDS: usize = 3;

/// The optimizer's constants, frozen into the graph like any launch argument (changing one
/// means a new capture).
#[derive(CubeType, CubeLaunch, Clone)]
#[expand(derive(Clone))]
pub(crate) struct Hyper {
    beta_1: f32,
    one_minus_beta_1: f32,
    beta_2: f32,
    one_minus_beta_2: f32,
    epsilon: f32,
    /// L2 penalty (Adam's and SGD's weight decay).
    penalty: f32,
    /// SGD's momentum.
    momentum: f32,
    /// SGD's `1 - dampening`.
    one_minus_dampening: f32,
}

/// Which arithmetic the kernel runs (compile-time switches).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Rule {
    /// Adam or AdamW (two moments); otherwise SGD.
    adam: bool,
    /// AdamW's form of the bias corrections (each moment divided by its own); Adam's folds
    /// them into the step size and epsilon.
    corrected_moments: bool,
    /// AdamW's decoupled decay (the schedule's word 2).
    decoupled: bool,
    /// An L2 penalty added to the gradient.
    l2: bool,
    /// SGD with momentum (one velocity).
    momentum: bool,
    nesterov: bool,
}

impl Rule {
    /// State buffers per parameter: two moments, one velocity, or none.
    pub(crate) fn states(self) -> usize {
        if self.adam {
            2
        } else {
            usize::from(self.momentum)
        }
    }
}

/// The kernel's rule and constants for `optimizer`.
pub(crate) fn rule_of(optimizer: &StepOptimizer) -> (Rule, Hyper) {
    let adam = |beta_1: f32, beta_2: f32, epsilon: f32, penalty: f32| Hyper {
        beta_1,
        one_minus_beta_1: 1.0 - beta_1,
        beta_2,
        one_minus_beta_2: 1.0 - beta_2,
        epsilon,
        penalty,
        momentum: 0.0,
        one_minus_dampening: 0.0,
    };
    let rule = Rule {
        adam: true,
        corrected_moments: false,
        decoupled: false,
        l2: false,
        momentum: false,
        nesterov: false,
    };
    match *optimizer {
        StepOptimizer::Adam {
            beta_1,
            beta_2,
            epsilon,
            weight_decay,
        } => (
            Rule {
                l2: weight_decay.is_some(),
                ..rule
            },
            adam(beta_1, beta_2, epsilon, weight_decay.unwrap_or(0.0)),
        ),
        StepOptimizer::AdamW {
            beta_1,
            beta_2,
            epsilon,
            weight_decay,
        } => (
            Rule {
                corrected_moments: true,
                decoupled: weight_decay != 0.0,
                ..rule
            },
            adam(beta_1, beta_2, epsilon, 0.0),
        ),
        StepOptimizer::Sgd {
            momentum,
            weight_decay,
        } => (
            Rule {
                adam: false,
                l2: weight_decay.is_some(),
                momentum: momentum.is_some(),
                nesterov: momentum.is_some_and(|m| m.nesterov),
                ..rule
            },
            Hyper {
                momentum: momentum.map_or(0.0, |m| m.momentum),
                one_minus_dampening: momentum.map_or(1.0, |m| (1.0 - m.dampening) as f32),
                ..adam(0.0, 0.0, 0.0, weight_decay.unwrap_or(0.0))
            },
        ),
    }
}

/// `base^exp` by square-and-multiply, the algorithm of the host's `f32::powi` (compiler
/// builtins' `__powisf2`), so that the bias corrections are the host's bit for bit.
#[cube]
fn powi(base: f32, exp: u32) -> f32 {
    let mut result = 1.0f32;
    let mut factor = base;
    let mut rest = exp;
    let mut more = rest > 0u32;
    while more {
        if rest % 2u32 == 1u32 {
            result *= factor;
        }
        rest /= 2u32;
        more = rest > 0u32;
        if more {
            factor *= factor;
        }
    }
    result
}

/// The update of a chunk of parameters of one dtype, in place: cube row `y` updates parameter
/// `y`; `states_1` holds each parameter's first moment (Adam) or velocity (SGD with momentum),
/// `states_2` each second moment (Adam); both are empty where the rule keeps no such state.
#[cube(launch_unchecked)]
fn update_kernel<F: Float>(
    params: &mut Sequence<Box<[F]>>,
    grads: &Sequence<Box<[F]>>,
    states_1: &mut Sequence<Box<[F]>>,
    states_2: &mut Sequence<Box<[F]>>,
    schedule: &[f32],
    hyper: Hyper,
    #[comptime] rule: Rule,
    #[define(F)] _dtype: ElemType,
) {
    let stride = CUBE_COUNT_X as usize * CUBE_DIM_X as usize;
    let lr = F::cast_from(schedule[0]);
    let time = u32::cast_from(schedule[1]) + 1u32;
    let penalty = F::cast_from(hyper.penalty);
    #[unroll]
    for k in 0..params.len() {
        if CUBE_POS_Y as usize == k {
            let param = &mut params[k];
            let grad = &grads[k];
            let mut i = ABSOLUTE_POS_X as usize;
            if rule.adam {
                let moment_1 = &mut states_1[k];
                let moment_2 = &mut states_2[k];
                let beta_1 = F::cast_from(hyper.beta_1);
                let one_minus_beta_1 = F::cast_from(hyper.one_minus_beta_1);
                let beta_2 = F::cast_from(hyper.beta_2);
                let one_minus_beta_2 = F::cast_from(hyper.one_minus_beta_2);
                let bias_1 = 1.0f32 - powi(hyper.beta_1, time);
                let bias_2 = 1.0f32 - powi(hyper.beta_2, time);
                // AdamW's divisors, or Adam's folded constants (`c / bias_1`, `eps * c`).
                let mut scale_1 = F::cast_from(bias_1);
                let mut scale_2 = F::cast_from(bias_2);
                let mut epsilon = F::cast_from(hyper.epsilon);
                if !rule.corrected_moments {
                    let root_2 = bias_2.sqrt();
                    scale_1 = F::cast_from(root_2 / bias_1);
                    scale_2 = F::cast_from(1.0f32);
                    epsilon = F::cast_from(hyper.epsilon * root_2);
                }
                let keep = F::cast_from(schedule[2]);
                while i < param.len() {
                    let p = param[i];
                    let mut g = grad[i];
                    if rule.l2 {
                        g = p * penalty + g;
                    }
                    let m = moment_1[i] * beta_1 + g * one_minus_beta_1;
                    let v = moment_2[i] * beta_2 + (g * g) * one_minus_beta_2;
                    moment_1[i] = m;
                    moment_2[i] = v;
                    let delta = if rule.corrected_moments {
                        (m / scale_1) / ((v / scale_2).sqrt() + epsilon)
                    } else {
                        (m * scale_1) / (v.sqrt() + epsilon)
                    };
                    // One expression in burn's operand order, `p * keep - delta * lr`
                    // (`tensor.mul_scalar(1 - lr * decay) - delta.mul_scalar(lr)`), so that
                    // the multiply-add contraction picks the same product as in burn's fused
                    // kernel (module docs). Through a variable, the left product was hidden
                    // from it and the right one contracted: `fma(-delta, lr, p * keep)`
                    // against burn's `fma(p, keep, -(delta * lr))`.
                    if rule.decoupled {
                        param[i] = p * keep - delta * lr;
                    } else {
                        param[i] = p - delta * lr;
                    }
                    i += stride;
                }
            } else if rule.momentum {
                let velocity = &mut states_1[k];
                let momentum = F::cast_from(hyper.momentum);
                let one_minus_dampening = F::cast_from(hyper.one_minus_dampening);
                while i < param.len() {
                    let p = param[i];
                    let mut g = grad[i];
                    if rule.l2 {
                        g = p * penalty + g;
                    }
                    let mut v = g;
                    if time > 1u32 {
                        v = g * one_minus_dampening + velocity[i] * momentum;
                    }
                    velocity[i] = v;
                    if rule.nesterov {
                        g = v * momentum + g;
                    } else {
                        g = v;
                    }
                    param[i] = p - g * lr;
                    i += stride;
                }
            } else {
                while i < param.len() {
                    let p = param[i];
                    let mut g = grad[i];
                    if rule.l2 {
                        g = p * penalty + g;
                    }
                    param[i] = p - g * lr;
                    i += stride;
                }
            }
        }
    }
}

/// Counts one more update: word 1 of the schedule.
#[cube(launch_unchecked)]
fn advance_kernel(schedule: &mut [f32]) {
    if ABSOLUTE_POS == 0 {
        schedule[1] += 1.0f32;
    }
}

/// Writes the step count (word 1), where a loaded optimizer state says how many updates were
/// done.
#[cube(launch_unchecked)]
fn count_kernel(schedule: &mut [f32], count: f32) {
    if ABSOLUTE_POS == 0 {
        schedule[1] = count;
    }
}

/// Writes the learning-rate words of the schedule (0 and 2).
#[cube(launch_unchecked)]
fn write_kernel(schedule: &mut [f32], lr: f32, keep: f32) {
    if ABSOLUTE_POS == 0 {
        schedule[0] = lr;
        schedule[2] = keep;
    }
}

/// The two small operations on a schedule buffer, as lazy fusion operations that write it in
/// place (the schedule is a static buffer that its owner holds, like a generator's state).
#[backend_extension(Cube, Fusion)]
pub(crate) trait ScheduleOps: Backend {
    /// Counts one more update on the device; returns `schedule` (the same buffer).
    #[fusion(dtype = schedule, shape = schedule)]
    fn advance_schedule(schedule: &FloatTensor<Self>) -> FloatTensor<Self>;

    /// Writes the learning rate and AdamW's decay factor; returns `schedule`.
    #[fusion(dtype = schedule, shape = schedule)]
    fn write_schedule(schedule: &FloatTensor<Self>, lr: f32, keep: f32) -> FloatTensor<Self>;

    /// Writes the step count; returns `schedule`.
    #[fusion(dtype = schedule, shape = schedule)]
    fn write_count(schedule: &FloatTensor<Self>, count: f32) -> FloatTensor<Self>;
}

/// The schedule's buffer as a kernel argument, after checking its layout (an invariant of the
/// engine, which alone makes schedules: checked in release builds too, since the launches rely
/// on it).
fn schedule_arg(schedule: &CubeTensor) -> BufferArg {
    assert!(
        schedule.dtype == burn::tensor::DType::F32
            && schedule.meta.shape().num_elements() == SCHEDULE_WORDS,
        "a whole-step schedule is {SCHEDULE_WORDS} f32 words, not {:?} of {:?}",
        schedule.meta.shape(),
        schedule.dtype
    );
    // SAFETY: the buffer holds `SCHEDULE_WORDS` f32 values (asserted above); the kernels read
    // and write f32 words below that count.
    unsafe { BufferArg::from_raw_parts(schedule.handle.clone(), SCHEDULE_WORDS) }
}

impl ScheduleOps for CubeBackend {
    fn advance_schedule(schedule: &CubeTensor) -> CubeTensor {
        // SAFETY: one thread writes word 1 of the schedule (`schedule_arg` checked its size).
        unsafe {
            advance_kernel::launch_unchecked(
                &schedule.client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(1),
                schedule_arg(schedule),
            );
        }
        schedule.clone()
    }

    fn write_schedule(schedule: &CubeTensor, lr: f32, keep: f32) -> CubeTensor {
        // SAFETY: one thread writes words 0 and 2 (`schedule_arg` checked the size).
        unsafe {
            write_kernel::launch_unchecked(
                &schedule.client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(1),
                schedule_arg(schedule),
                lr,
                keep,
            );
        }
        schedule.clone()
    }

    fn write_count(schedule: &CubeTensor, count: f32) -> CubeTensor {
        // SAFETY: one thread writes word 1 (`schedule_arg` checked the size).
        unsafe {
            count_kernel::launch_unchecked(
                &schedule.client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(1),
                schedule_arg(schedule),
                count,
            );
        }
        schedule.clone()
    }
}

/// Queues a write of the step count; hold the result as for [`write_schedule`].
pub(crate) fn write_count(schedule: &FusedTensor, count: f32) -> FusedTensor {
    <burn::backend::Cube as ScheduleOps>::write_count(schedule, count)
}

/// Queues a write of the learning-rate words; the returned tensor must be held until the stream
/// drained (fusion skips work whose results nobody holds).
pub(crate) fn write_schedule(schedule: &FusedTensor, lr: f32, keep: f32) -> FusedTensor {
    <burn::backend::Cube as ScheduleOps>::write_schedule(schedule, lr, keep)
}

/// Queues the count of one more update; hold the result as for [`write_schedule`].
pub(crate) fn advance(schedule: &FusedTensor) -> FusedTensor {
    <burn::backend::Cube as ScheduleOps>::advance_schedule(schedule)
}

/// One parameter of an update: its static buffer, its gradient (by value), its state buffers.
pub(crate) struct Update {
    pub param: FusedTensor,
    pub grad: FusedTensor,
    pub states: Vec<FusedTensor>,
}

/// What one update was, at execution time.
struct Slot {
    param: TensorIr,
    grad: TensorIr,
    states: Vec<TensorIr>,
    output: TensorId,
}

/// Fusion's handles of burn's cubecl backend.
type Handles =
    HandleContainer<<<CubeBackend as FusionBackend>::FusionRuntime as FusionRuntime>::FusionHandle>;

/// Queues the update of every parameter of `updates` (in place in their static buffers and
/// state buffers, reading `schedule`) as one fusion operation. Returns one tensor per update
/// over its parameter's buffer, which the caller holds until the stream drained (fusion skips
/// work whose results nobody holds). Every update has [`Rule::states`] state buffers, all
/// tensors of an update have one shape and a dtype that `kernel_elem` takes (checked by the
/// caller), and `updates` is not empty.
pub(crate) fn register(
    updates: Vec<Update>,
    schedule: &FusedTensor,
    rule: Rule,
    hyper: Hyper,
) -> Vec<FusedTensor> {
    let client = schedule.client.clone();
    let schedule_ir = schedule.clone().into_ir();
    let mut inputs = vec![schedule_ir.clone()];
    let mut outputs = Vec::with_capacity(updates.len());
    let mut slots = Vec::with_capacity(updates.len());
    for update in updates {
        let id = client.create_empty_handle();
        outputs.push(TensorIr::uninit(
            id,
            update.param.shape(),
            update.param.dtype(),
        ));
        let slot = Slot {
            param: update.param.into_ir(),
            grad: update.grad.into_ir(),
            states: update.states.into_iter().map(|s| s.into_ir()).collect(),
            output: id,
        };
        inputs.push(slot.param.clone());
        inputs.push(slot.grad.clone());
        inputs.extend(slot.states.iter().cloned());
        slots.push(slot);
    }
    let description = CustomOpIr {
        id: "burn_graphed_step_update".into(),
        inputs,
        outputs,
        scalars: Vec::new(),
    };
    let operation = OperationFn(move |handles: &mut Handles| {
        let schedule = handles.get_float_tensor::<CubeBackend>(&schedule_ir);
        let resolved: Vec<(CubeTensor, CubeTensor, Vec<CubeTensor>)> = slots
            .iter()
            .map(|slot| {
                (
                    handles.get_float_tensor::<CubeBackend>(&slot.param),
                    handles.get_float_tensor::<CubeBackend>(&slot.grad),
                    slot.states
                        .iter()
                        .map(|s| handles.get_float_tensor::<CubeBackend>(s))
                        .collect(),
                )
            })
            .collect();
        let updated = update_all(resolved, &schedule, rule, &hyper);
        for (slot, param) in slots.iter().zip(updated) {
            handles.register_float_tensor::<CubeBackend>(&slot.output, param);
        }
        Ok(())
    });
    client.register(
        StreamId::current(),
        OperationIr::Custom(description),
        operation,
    )
}

/// One parameter's buffers in a launch: its target, its dense gradient, its state targets.
type Launched = (Target, Dense, Vec<Target>);

/// Launches the updates (one launch per chunk of parameters of one dtype) and returns the
/// updated parameter buffers, in order.
fn update_all(
    resolved: Vec<(CubeTensor, CubeTensor, Vec<CubeTensor>)>,
    schedule: &CubeTensor,
    rule: Rule,
    hyper: &Hyper,
) -> Vec<CubeTensor> {
    let launched: Vec<Launched> = resolved
        .into_iter()
        .map(|(param, grad, states)| {
            (
                Target::static_buffer(param),
                Dense::of(&grad),
                states.into_iter().map(Target::static_buffer).collect(),
            )
        })
        .collect();
    let mut dtypes: Vec<ElemType> = Vec::new();
    for update in &launched {
        if let Some(elem) = kernel_elem(update.0.dense().tensor().dtype)
            && !dtypes.contains(&elem)
        {
            dtypes.push(elem);
        }
    }
    for &elem in &dtypes {
        let chunk: Vec<&Launched> = launched
            .iter()
            .filter(|update| kernel_elem(update.0.dense().tensor().dtype) == Some(elem))
            .collect();
        // Parameter, gradient and states per parameter; the schedule once.
        let per_launch = params_per_launch(launched[0].0.dense().tensor(), 2 + rule.states(), 1);
        for part in chunk.chunks(per_launch) {
            launch(part, schedule, rule, hyper, elem);
        }
    }
    launched
        .into_iter()
        .map(|(target, _, states)| {
            for state in states {
                state.finish();
            }
            target.finish()
        })
        .collect()
}

/// One kernel launch for `part`, whose tensors are all of element type `elem`.
fn launch(part: &[&Launched], schedule: &CubeTensor, rule: Rule, hyper: &Hyper, elem: ElemType) {
    let client = part[0].0.dense().tensor().client.clone();
    let largest = part
        .iter()
        .map(|update| update.0.dense().len())
        .max()
        .unwrap_or(1);
    let cubes_x = cubes_along_x(largest);
    // SAFETY (of each `arg` below): the kernel is instantiated for `elem`, the dtype of every
    // parameter, gradient and state of this chunk (the caller checked one dtype per parameter;
    // the chunk holds only parameters of `elem`), and reads each slice below its length only.
    let params = part
        .iter()
        .map(|update| unsafe { update.0.dense().arg() })
        .collect();
    let grads = part
        .iter()
        .map(|update| unsafe { update.1.arg() })
        .collect();
    let states = |which: usize| {
        part.iter()
            .filter_map(|update| update.2.get(which))
            .map(|state| unsafe { state.dense().arg() })
            .collect()
    };
    // SAFETY: `launch_unchecked` skips bounds checks; each thread reads and writes only indices
    // below its own parameter's length (the loop bound), which all of that parameter's buffers
    // have (same shape, checked by the caller), and reads words 0-2 of the schedule
    // (`schedule_arg` checks its size). The written buffers (parameters and states) are
    // distinct static buffers (or dense copies of them) that nothing else writes, and distinct
    // from the gradients and the schedule, as CUDA's `__restrict__` pointers require.
    unsafe {
        update_kernel::launch_unchecked(
            &client,
            CubeCount::Static(cubes_x, part.len() as u32, 1),
            CubeDim::new_1d(CUBE_THREADS),
            params,
            grads,
            states(0),
            states(1),
            schedule_arg(schedule),
            HyperLaunch::new(
                hyper.beta_1,
                hyper.one_minus_beta_1,
                hyper.beta_2,
                hyper.one_minus_beta_2,
                hyper.epsilon,
                hyper.penalty,
                hyper.momentum,
                hyper.one_minus_dampening,
            ),
            rule,
            elem,
        );
    }
}
