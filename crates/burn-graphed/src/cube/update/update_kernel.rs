//! The optimizer update kernel: one multi-tensor kernel for every optimizer the crate runs
//! (burn's Adam, AdamW and SGD with momentum) and every caller (`FusedAdam` one parameter at a
//! time, `MultiTensorAdam` for a module, the whole step's graph). Cube row `y` of a launch
//! updates parameter `y` of its chunk in place, with its moments or velocity.
//!
//! # The clock
//!
//! The learning rate, the step count and AdamW's decay factor `1 - lr * weight_decay` come from
//! one of two places (a compile-time switch, [`Rule::device_clock`]):
//! - the host's [`Clock`], passed as launch arguments (the eager optimizers: each call is a
//!   new launch with this step's values);
//! - a three-word `f32` buffer on the device, the whole step's *schedule* (learning rate,
//!   updates done so far, decay factor), which a graph reads at every replay: launch
//!   arguments would be frozen into it. Word 1 is exact in `f32` up to 2^24 updates (the whole
//!   step refuses more).
//!
//! # The arithmetic
//!
//! burn-optim 0.22's, operation for operation (`adam.rs`, `adamw.rs`, `sgd.rs`,
//! `momentum.rs`, `decay.rs`), in the parameter's own dtype: each operation's result rounded
//! to that dtype and each constant reaching it as that dtype, as eager burn's tensor operations
//! and their scalars do. So a `bf16` update rounds where burn's `bf16` update rounds; computing
//! in `f32` and rounding once would be more precise, and different from burn's. Both moments:
//! `m = m*b1 + g*(1-b1)`, `v = v*b2 + (g*g)*(1-b2)`. Adam folds the bias corrections into two
//! constants computed in `f32` like the host's (`c = sqrt(1-b2^t)`; `delta = (m * (c /
//! (1-b1^t))) / (sqrt(v) + eps*c)`); AdamW divides each moment (`delta = (m / (1-b1^t)) /
//! (sqrt(v / (1-b2^t)) + eps)`, then `p = p*keep - delta*lr`); both compute `b^t` by the host's
//! square-and-multiply `powi`. Adam's update is `p - delta*lr`. SGD: `v = g` at the first
//! update, else `g*(1-d) + v*mu`, `g = nesterov ? v*mu + g : v`, `p - g*lr`. An L2 penalty
//! makes the gradient `p*penalty + g` first. Zero moments at the first update give burn's
//! first-update values exactly (`0*b1 + x` is `x`).
//!
//! Multiply-adds: cubecl's optimizer (cubecl-opt's `InstCombine`) turns `a*b + c`, `a*b - c`
//! and `c - a*b` into one `fma`, taking the product on the left when it feeds nothing else,
//! else the one on the right. burn's fused kernels go through the same pass, so each
//! expression here is written as burn-optim writes it, operands in its order and products
//! not hidden behind variables: the same product is then fused and the other rounded. On
//! CUDA an `fma` rounds once, so picking the other product changes results (AdamW's
//! `p*keep - delta*lr` contracted as `fma(-delta, lr, p*keep)` where burn's kernel computes
//! `fma(p, keep, -(delta*lr))` parted from burn's by up to 34 units in the last place in f32).
//! wgpu's software Vulkan rounds its `fma` like a multiply and an add, so it agrees either way.

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use cubecl::ir::FloatKind;
use cubecl::prelude::*;

use crate::step_optim::StepOptimizer;

/// The optimizer's constants, frozen into a graph like any launch argument (changing one
/// means a new capture).
#[derive(CubeType, CubeLaunch, Clone, Debug)]
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

impl Hyper {
    /// The launch argument.
    pub(in crate::cube) fn arg(&self) -> HyperLaunch {
        HyperLaunch::new(
            self.beta_1,
            self.one_minus_beta_1,
            self.beta_2,
            self.one_minus_beta_2,
            self.epsilon,
            self.penalty,
            self.momentum,
            self.one_minus_dampening,
        )
    }
}

/// Words of the whole step's schedule buffer (the device clock; see the module docs).
pub(crate) const SCHEDULE_WORDS: usize = 3;

/// The schedule's buffer as a kernel argument, after checking its layout (an invariant of the
/// engine, which alone makes schedules: checked in release builds too, since the launches rely
/// on it).
pub(in crate::cube) fn schedule_arg(schedule: &CubeTensor) -> BufferArg {
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

/// The host's clock of one update (see the module docs): the learning rate, the step counted
/// from 1, and AdamW's decay factor (1 for the other rules).
#[derive(CubeType, CubeLaunch, Clone, Copy, Debug, PartialEq)]
pub(crate) struct Clock {
    lr: f32,
    time: u32,
    keep: f32,
}

impl Clock {
    /// Step `time` (counted from 1) at learning rate `lr`, without decoupled decay.
    pub(crate) fn new(lr: f64, time: usize) -> Self {
        Self {
            lr: lr as f32,
            time: time as u32,
            keep: 1.0,
        }
    }

    /// The launch argument.
    pub(in crate::cube) fn arg(&self) -> ClockLaunch {
        ClockLaunch::new(self.lr, self.time, self.keep)
    }
}

/// Which arithmetic the kernel runs (compile-time switches).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Rule {
    /// Adam or AdamW (two moments); otherwise SGD.
    adam: bool,
    /// AdamW's form of the bias corrections (each moment divided by its own); Adam's folds
    /// them into the step size and epsilon.
    corrected_moments: bool,
    /// AdamW's decoupled decay (the clock's decay factor).
    decoupled: bool,
    /// An L2 penalty added to the gradient.
    l2: bool,
    /// SGD with momentum (one velocity).
    momentum: bool,
    nesterov: bool,
    /// The clock is the schedule buffer on the device, not the launch's [`Clock`].
    device_clock: bool,
}

impl Rule {
    /// The rule with its clock on the device (`true`) or the host's.
    pub(in crate::cube) fn with_device_clock(self, device_clock: bool) -> Self {
        Self {
            device_clock,
            ..self
        }
    }

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
        device_clock: false,
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

/// The kernel's element type for tensors of `dtype`, or `None` where the kernels of the crate do
/// not take that dtype (they take `f32`, `f16` and `bf16`).
pub(crate) fn kernel_elem(dtype: DType) -> Option<ElemType> {
    match dtype {
        DType::F32 => Some(ElemType::Float(FloatKind::F32)),
        DType::F16 => Some(ElemType::Float(FloatKind::F16)),
        DType::BF16 => Some(ElemType::Float(FloatKind::BF16)),
        _ => None,
    }
}

/// The element type of a float tensor a fused op's kernels take (`op` names the op in the
/// panic): its caller (`nn`) checked the dtype, so another one here breaks that op's invariant.
pub(crate) fn checked_elem(tensor: &burn_cubecl::tensor::CubeTensor, op: &str) -> ElemType {
    kernel_elem(tensor.dtype).unwrap_or_else(|| {
        panic!(
            "burn-graphed: {op} kernel given {:?} (the caller checks the dtype)",
            tensor.dtype
        )
    })
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
/// `schedule` holds the schedule buffer where the clock is on the device, nothing otherwise.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(in crate::cube) fn update_kernel<F: Float>(
    params: &mut Sequence<Box<[F]>>,
    grads: &Sequence<Box<[F]>>,
    states_1: &mut Sequence<Box<[F]>>,
    states_2: &mut Sequence<Box<[F]>>,
    schedule: &Sequence<Box<[f32]>>,
    clock: Clock,
    hyper: Hyper,
    #[comptime] rule: Rule,
    #[define(F)] _dtype: ElemType,
) {
    let stride = CUBE_COUNT_X as usize * CUBE_DIM_X as usize;
    let mut lr_word = clock.lr;
    let mut time = clock.time;
    let mut keep_word = clock.keep;
    if rule.device_clock {
        let words = &schedule[0];
        lr_word = words[0];
        time = u32::cast_from(words[1]) + 1u32;
        keep_word = words[2];
    }
    let lr = F::cast_from(lr_word);
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
                let keep = F::cast_from(keep_word);
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
                    // kernel (module docs): through a variable, the left product would be
                    // hidden from it and the right one contracted.
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
