//! One Adam update of one parameter as one kernel: reads the parameter, its gradient and the
//! two moments, updates the moments in their own buffers (the optimizer state moved in, so
//! nothing else holds them; copies where something does) and writes the new parameter either
//! to a new buffer or into the parameter's own buffer (a graph's static parameter buffer, see
//! `param_claim`). Burn's `Adam` computes the same with about fifteen tensor operations per
//! parameter, each registered with fusion on the host; this is one registration and one launch.
//!
//! The arithmetic is burn-optim 0.22's, operation for operation (`decay.rs`, `adam.rs`):
//! `g += p * penalty`, `m = m * b1 + g * (1 - b1)`, `v = v * b2 + g * g * (1 - b2)`,
//! `p -= (m * c) / (sqrt(v) + eps * s) * lr` with `s = sqrt(1 - b2^t)` and `c = s / (1 - b1^t)`,
//! the factors computed on the host in `f32` as burn does. Compilers may contract a multiply
//! and an add into one rounding, so results agree to rounding, not bit for bit.
//!
//! Parameters in `f16` or `bf16` (with gradients and moments in the same dtype, as burn's `Adam`
//! keeps them) are updated by the same kernels instantiated for that dtype: each element is
//! read, computed in `f32` and rounded once when stored (PyTorch's fused Adam does the same),
//! where burn's `Adam` rounds after each of its tensor operations.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, backend_extension};
use burn::optim::{AdamState, AdaptiveMomentumState, LearningRate};
use burn::tensor::{DType, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::ir::FloatKind;
use cubecl::prelude::*;

use super::super::buffers::FusedTensor;
use super::super::dense::{Dense, Target};
use super::super::graph::param_claim;
use super::super::values::{AdamHyper, Unfused};

/// Threads per cube of the update kernel.
const CUBE_THREADS: u32 = 256;

/// The factors of one Adam update, computed on the host in `f32` as burn-optim computes them
/// (`factors`), and passed to the kernel by value (a graph would capture them like any launch
/// argument).
#[derive(CubeType, CubeLaunch, Clone)]
#[expand(derive(Clone))]
pub(crate) struct Factors {
    /// Learning rate.
    lr: f32,
    /// First-moment decay `b1`.
    beta_1: f32,
    /// `1 - b1`.
    one_minus_beta_1: f32,
    /// Second-moment decay `b2`.
    beta_2: f32,
    /// `1 - b2`.
    one_minus_beta_2: f32,
    /// `sqrt(1 - b2^t) / (1 - b1^t)`.
    combined: f32,
    /// `eps * sqrt(1 - b2^t)`.
    epsilon: f32,
    /// L2 penalty of weight decay (0 without; the kernel skips the term then).
    penalty: f32,
}

impl Factors {
    /// The kernel argument.
    pub(in crate::cube) fn launch(&self) -> FactorsLaunch {
        FactorsLaunch::new(
            self.lr,
            self.beta_1,
            self.one_minus_beta_1,
            self.beta_2,
            self.one_minus_beta_2,
            self.combined,
            self.epsilon,
            self.penalty,
        )
    }
}

/// The kernels' element type for parameters of `dtype`, or `None` where the update kernels do
/// not take that dtype (burn's `Adam` runs instead).
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

/// Element `i` of the update, in `f32` whatever `F` is: updates the moments in place (rounded
/// to `F` once each), returns the new parameter value (for the caller to round once).
#[cube]
pub(in crate::cube) fn adam_element<F: Float>(
    i: usize,
    param: F,
    grad: &[F],
    moment_1: &mut [F],
    moment_2: &mut [F],
    factors: Factors,
    #[comptime] decay: bool,
) -> F {
    let param = f32::cast_from(param);
    let mut g = f32::cast_from(grad[i]);
    if decay {
        g += param * factors.penalty;
    }
    let m = f32::cast_from(moment_1[i]) * factors.beta_1 + g * factors.one_minus_beta_1;
    let v = f32::cast_from(moment_2[i]) * factors.beta_2 + (g * g) * factors.one_minus_beta_2;
    moment_1[i] = F::cast_from(m);
    moment_2[i] = F::cast_from(v);
    let update = (m * factors.combined) / (v.sqrt() + factors.epsilon);
    F::cast_from(param - update * factors.lr)
}

/// The update writing the new parameter into a new buffer (the moments in place).
#[cube(launch_unchecked)]
fn adam_to_new_kernel<F: Float>(
    param: &[F],
    grad: &[F],
    moment_1: &mut [F],
    moment_2: &mut [F],
    new_param: &mut [F],
    factors: Factors,
    #[comptime] decay: bool,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i < new_param.len() {
        new_param[i] = adam_element::<F>(i, param[i], grad, moment_1, moment_2, factors, decay);
    }
}

/// The update writing the new parameter over the old one (the moments in place).
#[cube(launch_unchecked)]
fn adam_in_place_kernel<F: Float>(
    param: &mut [F],
    grad: &[F],
    moment_1: &mut [F],
    moment_2: &mut [F],
    factors: Factors,
    #[comptime] decay: bool,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i < param.len() {
        param[i] = adam_element::<F>(i, param[i], grad, moment_1, moment_2, factors, decay);
    }
}

/// The fused Adam update as a lazy fusion operation.
#[backend_extension(Cube, Fusion)]
pub(crate) trait FusedAdamOps: Backend {
    /// One Adam update; returns the new parameter, first and second moments. With `in_place`
    /// the new parameter is `param`'s own buffer (the caller made sure nobody else reads it);
    /// otherwise it is a new buffer. The gradient and the moments are taken by value: the
    /// moments are updated in their own buffers where nothing else holds them (the usual case:
    /// the optimizer state moved in), in copies otherwise; taking them by value also spares
    /// fusion a separate release operation for each. Shapes (all equal) and dtypes (all the
    /// same, one that [`kernel_elem`] takes) were checked by the caller.
    #[fusion(meta = |param, _grad, moment_1, moment_2, _lr, _b1, _b1c, _b2, _b2c, _combined, _eps, _penalty, _in_place| {
        (param.clone(), moment_1.clone(), moment_2.clone())
    })]
    #[allow(clippy::too_many_arguments)]
    fn fused_adam(
        param: &FloatTensor<Self>,
        grad: FloatTensor<Self>,
        moment_1: FloatTensor<Self>,
        moment_2: FloatTensor<Self>,
        lr: f32,
        beta_1: f32,
        one_minus_beta_1: f32,
        beta_2: f32,
        one_minus_beta_2: f32,
        combined: f32,
        epsilon: f32,
        penalty: f32,
        in_place: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

impl FusedAdamOps for CubeBackend {
    fn fused_adam(
        param: &CubeTensor,
        grad: CubeTensor,
        moment_1: CubeTensor,
        moment_2: CubeTensor,
        lr: f32,
        beta_1: f32,
        one_minus_beta_1: f32,
        beta_2: f32,
        one_minus_beta_2: f32,
        combined: f32,
        epsilon: f32,
        penalty: f32,
        in_place: bool,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        let factors = FactorsLaunch::new(
            lr,
            beta_1,
            one_minus_beta_1,
            beta_2,
            one_minus_beta_2,
            combined,
            epsilon,
            penalty,
        );
        let client = param.client.clone();
        let grad = Dense::of(&grad);
        let (moment_1, moment_2) = (Dense::owned(moment_1), Dense::owned(moment_2));
        let elements = grad.len();
        let cubes = CubeCount::Static((elements as u32).div_ceil(CUBE_THREADS).max(1), 1, 1);
        let dim = CubeDim::new_1d(CUBE_THREADS);
        let decay = penalty != 0.0;
        // `prepare` fuses only the dtypes `kernel_elem` takes; a kernel of another element
        // type over these buffers would break the launches' safety contract, so this checks
        // it in release builds too (an invariant of this module, not an input error).
        let Some(elem) = kernel_elem(param.dtype) else {
            panic!(
                "FusedAdam's kernel launched on a {:?} parameter, which `prepare` refuses",
                param.dtype
            );
        };
        if in_place {
            // The static buffer itself where it is dense, else a dense copy whose result goes
            // back into it (CUDA pitches rows whose byte width is not a power of two; see
            // `dense`).
            let target = Target::static_buffer(param.clone());
            // SAFETY: `launch_unchecked` skips bounds checks. All four buffers are `Dense`
            // tensors of `elements` values of `elem` (same shape and dtype: checked by the
            // caller; the kernel is instantiated for `elem`), and each thread reads and writes
            // only its index `i < elements`. The three buffers written in place are distinct
            // from each other and from the gradient, as the kernel's `__restrict__` pointers
            // require on CUDA: the moments are buffers that nothing else holds
            // (`Dense::owned`), and the target is the static parameter buffer, held by its
            // graph, or a fresh copy of it, so it is neither of them.
            unsafe {
                adam_in_place_kernel::launch_unchecked(
                    &client,
                    cubes,
                    dim,
                    target.dense().arg(),
                    grad.arg(),
                    moment_1.arg(),
                    moment_2.arg(),
                    factors,
                    decay,
                    elem,
                );
            }
            return (
                target.finish(),
                moment_1.into_tensor(),
                moment_2.into_tensor(),
            );
        }
        let param = Dense::of(param);
        let new_param = Dense::empty_like(param.tensor());
        // SAFETY: as above; the new parameter is a fresh allocation, the moments are buffers
        // that nothing else holds, so the three written buffers alias no other binding.
        unsafe {
            adam_to_new_kernel::launch_unchecked(
                &client,
                cubes,
                dim,
                param.arg(),
                grad.arg(),
                moment_1.arg(),
                moment_2.arg(),
                new_param.arg(),
                factors,
                decay,
                elem,
            );
        }
        (
            new_param.into_tensor(),
            moment_1.into_tensor(),
            moment_2.into_tensor(),
        )
    }
}

/// Queues one fused Adam update on burn's cubecl backend (see [`FusedAdamOps::fused_adam`]).
pub(crate) fn fused_adam(
    param: &FloatTensor<burn::backend::Cube>,
    grad: FloatTensor<burn::backend::Cube>,
    moments: (
        FloatTensor<burn::backend::Cube>,
        FloatTensor<burn::backend::Cube>,
    ),
    factors: &Factors,
    in_place: bool,
) -> (
    FloatTensor<burn::backend::Cube>,
    FloatTensor<burn::backend::Cube>,
    FloatTensor<burn::backend::Cube>,
) {
    <burn::backend::Cube as FusedAdamOps>::fused_adam(
        param,
        grad,
        moments.0,
        moments.1,
        factors.lr,
        factors.beta_1,
        factors.one_minus_beta_1,
        factors.beta_2,
        factors.one_minus_beta_2,
        factors.combined,
        factors.epsilon,
        factors.penalty,
        in_place,
    )
}

/// The factors of step `time` (counted from 1), as burn-optim's `AdaptiveMomentum` computes
/// them.
pub(crate) fn factors(adam: &AdamHyper, lr: LearningRate, time: usize) -> Factors {
    let time = time as i32;
    let bias_correction2_sqrt = (1.0 - adam.beta_2.powi(time)).sqrt();
    Factors {
        lr: lr as f32,
        beta_1: adam.beta_1,
        one_minus_beta_1: 1.0 - adam.beta_1,
        beta_2: adam.beta_2,
        one_minus_beta_2: 1.0 - adam.beta_2,
        combined: bias_correction2_sqrt / (1.0 - adam.beta_1.powi(time)),
        epsilon: adam.epsilon * bias_correction2_sqrt,
        penalty: adam.penalty.unwrap_or(0.0),
    }
}

/// A parameter's step, ready for a fused kernel: its tensors as fusion tensors of burn's cubecl
/// backend, and the step number.
pub(crate) struct AdamOperands {
    /// The parameter.
    pub param: FusedTensor,
    /// Its gradient.
    pub grad: FusedTensor,
    /// First and second moments (zeros at the first step).
    pub moments: (FusedTensor, FusedTensor),
    /// The step, counted from 1.
    pub time: usize,
}

/// The tensors of one Adam step as fusion tensors, or the arguments back (`Err`) where the step
/// cannot be fused: not on burn's cubecl backend, a dtype the kernels do not take (they take
/// `f32`, `f16` and `bf16`), gradient or moments in another dtype than the parameter, AMSGrad,
/// or shapes that differ.
pub(crate) fn prepare<const D: usize>(
    adam: &AdamHyper,
    tensor: Tensor<D>,
    grad: Tensor<D>,
    state: Option<AdamState<D>>,
) -> Result<AdamOperands, Box<Unfused<D>>> {
    use burn::backend::Cube;

    let (shape, dtype) = (tensor.shape(), tensor.dtype());
    let moments_fit = state.as_ref().is_none_or(|state| {
        let momentum = &state.momentum;
        momentum.moment_1.shape() == shape
            && momentum.moment_2.shape() == shape
            && momentum.moment_1.dtype() == dtype
            && momentum.moment_2.dtype() == dtype
            && momentum.max_moment_2.is_none()
    });
    let fusable = adam.fusable
        && moments_fit
        && super::super::graph::lifecycle::supports_graphs(&tensor.device())
        && kernel_elem(dtype).is_some()
        && grad.dtype() == dtype
        && grad.shape() == shape
        && grad.device() == tensor.device();
    if !fusable {
        return Err(Box::new((tensor, grad, state)));
    }
    let primitive = |tensor: &Tensor<D>| tensor.clone().try_into_primitive::<Cube>().ok();
    let (time, moment_1, moment_2) = match &state {
        Some(state) => {
            let momentum = &state.momentum;
            let (moment_1, moment_2) = (&momentum.moment_1, &momentum.moment_2);
            (momentum.time + 1, primitive(moment_1), primitive(moment_2))
        }
        // Zero moments: `0 * b1 + g * (1 - b1)` is burn's first-step `g * (1 - b1)` exactly.
        None => (
            1,
            primitive(&tensor.zeros_like()),
            primitive(&tensor.zeros_like()),
        ),
    };
    // Converted from clones, so that nothing is lost if one does not convert; the originals
    // are dropped right after, and the clones are then the only holders again.
    let (Some(param), Some(grad_primitive), Some(moment_1), Some(moment_2)) =
        (primitive(&tensor), primitive(&grad), moment_1, moment_2)
    else {
        return Err(Box::new((tensor, grad, state)));
    };
    drop((tensor, grad, state));
    Ok(AdamOperands {
        param,
        grad: grad_primitive,
        moments: (moment_1, moment_2),
        time,
    })
}

/// One fused Adam step of one parameter, or the arguments back (`Err`) where the step cannot be
/// fused (see [`prepare`]). The update goes into the graph buffer that holds the parameter's
/// values where [`param_claim::claim`] allows.
pub(crate) fn step<const D: usize>(
    adam: &AdamHyper,
    lr: LearningRate,
    tensor: Tensor<D>,
    grad: Tensor<D>,
    state: Option<AdamState<D>>,
) -> Result<(Tensor<D>, Option<AdamState<D>>), Box<Unfused<D>>> {
    use burn::backend::Cube;

    let AdamOperands {
        param,
        grad,
        moments,
        time,
    } = prepare(adam, tensor, grad, state)?;
    let factors = factors(adam, lr, time);
    let claim = param_claim::claim(param, &[]);
    let in_place = claim.in_place.is_some();
    let (new_param, new_moment_1, new_moment_2) =
        fused_adam(&claim.values, grad, moments, &factors, in_place);
    if let Some(slot) = &claim.in_place {
        slot.hand_over(&new_param);
    }
    let wrap = |primitive| Tensor::<D>::from_primitive::<Cube>(primitive);
    let momentum = AdaptiveMomentumState::new(time, wrap(new_moment_1), wrap(new_moment_2));
    Ok((wrap(new_param), Some(AdamState::new(momentum))))
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::super::super::copy_op::key_of;
    use super::super::super::dense::test_support::*;
    use super::*;

    /// One update of `param` with fixed gradient and moments (step 2, weight decay).
    fn update(param: &CubeTensor, in_place: bool) -> (CubeTensor, CubeTensor, CubeTensor) {
        // The moments as the previous step left them: dense and positive where they must be.
        let moment_2: Vec<f32> = values(3.0).iter().map(|v| v * v * 0.01).collect();
        <CubeBackend as FusedAdamOps>::fused_adam(
            param,
            laid_out(&values(1.0), COLS),
            laid_out(&values(2.0), COLS),
            laid_out(&moment_2, COLS),
            1e-2,
            0.9,
            0.1,
            0.999,
            0.001,
            0.5,
            1e-8,
            0.05,
            in_place,
        )
    }

    /// A graph's static parameter buffer that CUDA pitched is updated in place: the tensor
    /// handed back is that buffer, its elements are those of the same update of a dense copy,
    /// and its padding is left alone. (Without the dense copy the kernel would read and write
    /// the buffer as if it were dense: elements of the later rows would be lost.)
    #[test]
    fn in_place_update_of_a_pitched_buffer() {
        let param = values(0.0);
        let static_buffer = laid_out(&param, PITCH);
        let (updated, moment_1, moment_2) = update(&static_buffer, true);
        assert_eq!(key_of(&updated), key_of(&static_buffer));
        let (expected, expected_1, expected_2) = update(&laid_out(&param, COLS), true);
        assert_ne!(buffer(&expected), param, "the update changes the parameter");
        assert_eq!(elements(&updated), buffer(&expected));
        assert_eq!(elements(&moment_1), buffer(&expected_1));
        assert_eq!(elements(&moment_2), buffer(&expected_2));
        assert!(padding_untouched(&static_buffer));
    }

    /// A pitched parameter updated into a new buffer: the new buffer is dense and holds the
    /// same update as that of a dense copy; the parameter keeps its values.
    #[test]
    fn update_of_a_pitched_parameter_into_a_new_buffer() {
        let param = values(0.0);
        let pitched = laid_out(&param, PITCH);
        let (updated, _, _) = update(&pitched, false);
        let (expected, _, _) = update(&laid_out(&param, COLS), false);
        assert_ne!(key_of(&updated), key_of(&pitched));
        assert_eq!(buffer(&updated), buffer(&expected));
        assert_eq!(elements(&pitched), param);
    }
}
