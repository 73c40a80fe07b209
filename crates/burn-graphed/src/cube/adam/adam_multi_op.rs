//! The Adam update of many parameters as **one** fusion operation (PyTorch's multi-tensor
//! `fused=True` Adam): every parameter, gradient and moment of a step goes into a single
//! operation registered with fusion by hand, which launches one kernel per chunk of parameters.
//! `adam_op` registers one operation per parameter; the host profile of the graphed step showed
//! that fusion's cost per registered operation, not the kernels, bounds the step.
//!
//! The `backend_extension` macro cannot express a variable number of tensors, so the operation
//! is built here from the same parts the macro uses (`CustomOpIr` and an `OperationFn` that
//! resolves the input handles and registers the output handles at execution time).
//!
//! The arithmetic is `adam_op`'s (`adam_element`), so both agree to rounding (compilers may
//! contract operations differently in the two kernels).

use burn::backend::TensorMetadata;
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use burn_fusion::custom::{
    CustomOpIr, HandleContainer, OperationFn, OperationIr, StreamId, TensorId, TensorIr,
};
use burn_fusion::{FusionBackend, FusionRuntime};
use cubecl::ir::FloatKind;
use cubecl::prelude::*;

use burn::backend::{Cube, DispatchTensor};
use burn::optim::{AdamState, LearningRate};
use burn::tensor::Tensor;

use super::super::buffers::FusedTensor;
use super::super::dense::{Dense, Target};
use super::super::graph::param_claim::{self, ParamSlot};
use super::super::values::{AdamHyper, Unfused};
use super::adam_op::{AdamOperands, Factors, adam_element, factors, kernel_elem, prepare};

/// Threads per cube of the multi-tensor update kernels (this one and `step_update_op`'s).
pub(in crate::cube) const CUBE_THREADS: u32 = 256;

/// Most parameters one launch updates (up to four bindings each: parameter, gradient, two
/// moments). Bounds the kernel's argument size on CUDA and stays under the binding limit of
/// the backends that have one (checked against the device's own limit too).
const MAX_PARAMS_PER_LAUNCH: usize = 24;

/// Most cubes along x per parameter: larger parameters are covered by a grid-stride loop.
const MAX_CUBES_PER_PARAM: u32 = 1024;

/// The update of a chunk of parameters of one dtype, in place: cube row `y` updates parameter
/// `y`.
#[cube(launch_unchecked)]
fn adam_multi_kernel<F: Float>(
    params: &mut Sequence<Box<[F]>>,
    grads: &Sequence<Box<[F]>>,
    moments_1: &mut Sequence<Box<[F]>>,
    moments_2: &mut Sequence<Box<[F]>>,
    factors: Factors,
    #[comptime] decay: bool,
    #[define(F)] _dtype: ElemType,
) {
    let stride = CUBE_COUNT_X as usize * CUBE_DIM_X as usize;
    #[unroll]
    for k in 0..params.len() {
        if CUBE_POS_Y as usize == k {
            let param = &mut params[k];
            let grad = &grads[k];
            let moment_1 = &mut moments_1[k];
            let moment_2 = &mut moments_2[k];
            let mut i = ABSOLUTE_POS_X as usize;
            while i < param.len() {
                let value = adam_element::<F>(
                    i,
                    param[i],
                    grad,
                    moment_1,
                    moment_2,
                    factors.clone(),
                    decay,
                );
                param[i] = value;
                i += stride;
            }
        }
    }
}

/// One parameter of a multi-tensor update, as handed to [`register`].
pub(crate) struct Update {
    /// The parameter's values: a graph's static parameter buffer when `in_place`, otherwise the
    /// parameter tensor (updated in its own buffer where nothing else holds it, in a copy
    /// otherwise).
    pub param: FusedTensor,
    /// Its gradient, by value (fusion frees it after the update without a release operation).
    pub grad: FusedTensor,
    /// The two moments, by value: updated in their own buffers where nothing else holds them.
    pub moments: (FusedTensor, FusedTensor),
    /// Write the new values into `param`'s buffer (the caller made sure nobody else reads it).
    pub in_place: bool,
    /// Index into the factors given to [`register`] (parameters at different steps).
    pub factors: usize,
}

/// What one update was, at execution time.
struct Slot {
    param: TensorIr,
    grad: TensorIr,
    moment_1: TensorIr,
    moment_2: TensorIr,
    in_place: bool,
    factors: usize,
    outputs: [TensorId; 3],
}

/// Queues the updates of `updates` as one fusion operation. Returns, per update and in order,
/// the new parameter (a tensor over the static buffer when `in_place`), first and second
/// moment. All tensors of one update have the same shape, device and dtype, one that
/// `kernel_elem` takes (checked by the caller; updates may differ in dtype), contiguous or not,
/// and `updates` is not empty.
pub(crate) fn register(
    updates: Vec<Update>,
    factors: Vec<Factors>,
    decay: bool,
) -> Vec<(FusedTensor, FusedTensor, FusedTensor)> {
    let client = updates[0].param.client.clone();
    let mut inputs = Vec::with_capacity(updates.len() * 4);
    let mut outputs = Vec::with_capacity(updates.len() * 3);
    let mut slots = Vec::with_capacity(updates.len());
    for update in updates {
        let shape = update.param.shape();
        let dtype = update.param.dtype();
        let ids = [(); 3].map(|()| client.create_empty_handle());
        for id in ids {
            outputs.push(TensorIr::uninit(id, shape.clone(), dtype));
        }
        // `into_ir` marks an input the caller handed over (no other holder) as writable, so
        // fusion gives its buffer to the operation and frees it afterwards.
        let slot = Slot {
            param: update.param.into_ir(),
            grad: update.grad.into_ir(),
            moment_1: update.moments.0.into_ir(),
            moment_2: update.moments.1.into_ir(),
            in_place: update.in_place,
            factors: update.factors,
            outputs: ids,
        };
        inputs.extend([&slot.param, &slot.grad, &slot.moment_1, &slot.moment_2].map(Clone::clone));
        slots.push(slot);
    }
    let description = CustomOpIr {
        id: "burn_graphed_adam_multi".into(),
        inputs,
        outputs,
        scalars: Vec::new(),
    };
    let operation = OperationFn(move |handles: &mut Handles| {
        execute(&slots, &factors, decay, handles);
        Ok(())
    });
    let mut tensors = client
        .register(
            StreamId::current(),
            OperationIr::Custom(description),
            operation,
        )
        .into_iter();
    let mut results = Vec::new();
    while let (Some(param), Some(moment_1), Some(moment_2)) =
        (tensors.next(), tensors.next(), tensors.next())
    {
        results.push((param, moment_1, moment_2));
    }
    results
}

/// Fusion's handles of burn's cubecl backend.
type Handles =
    HandleContainer<<<CubeBackend as FusionBackend>::FusionRuntime as FusionRuntime>::FusionHandle>;

/// The operation, on fusion's server: resolves the buffers, launches the chunks, registers the
/// outputs.
fn execute(slots: &[Slot], factors: &[Factors], decay: bool, handles: &mut Handles) {
    let resolved = slots
        .iter()
        .map(|slot| Resolved {
            param: handles.get_float_tensor::<CubeBackend>(&slot.param),
            grad: handles.get_float_tensor::<CubeBackend>(&slot.grad),
            moment_1: handles.get_float_tensor::<CubeBackend>(&slot.moment_1),
            moment_2: handles.get_float_tensor::<CubeBackend>(&slot.moment_2),
            in_place: slot.in_place,
            factors: slot.factors,
        })
        .collect();
    for (slot, (param, moment_1, moment_2)) in
        slots.iter().zip(update_all(resolved, factors, decay))
    {
        let [param_id, moment_1_id, moment_2_id] = &slot.outputs;
        handles.register_float_tensor::<CubeBackend>(param_id, param);
        handles.register_float_tensor::<CubeBackend>(moment_1_id, moment_1);
        handles.register_float_tensor::<CubeBackend>(moment_2_id, moment_2);
    }
}

/// One update's tensors at execution time (see [`Update`]).
struct Resolved {
    param: CubeTensor,
    grad: CubeTensor,
    moment_1: CubeTensor,
    moment_2: CubeTensor,
    in_place: bool,
    factors: usize,
}

/// Launches the updates of `resolved` (one launch per chunk) and returns, per update and in
/// order, the new parameter (the static buffer itself when `in_place`) and the two moments.
fn update_all(
    resolved: Vec<Resolved>,
    factors: &[Factors],
    decay: bool,
) -> Vec<(CubeTensor, CubeTensor, CubeTensor)> {
    let mut launched = Vec::with_capacity(resolved.len());
    for update in resolved {
        let grad = Dense::of(&update.grad);
        let (moment_1, moment_2) = (Dense::owned(update.moment_1), Dense::owned(update.moment_2));
        let target = if update.in_place {
            // A graph's static buffer (through a dense copy where CUDA pitched it; see `dense`).
            Target::static_buffer(update.param)
        } else {
            // Not a graph's buffer: the parameter's own buffer where the caller handed over
            // the only reference (fusion's rule, as for the moments), otherwise a copy; the
            // kernel then updates it in place.
            Target::owned(update.param)
        };
        launched.push((target, grad, moment_1, moment_2, update.factors));
    }
    // One launch per chunk of parameters at the same step and of the same dtype (usually all
    // of them).
    let mut dtypes: Vec<ElemType> = Vec::new();
    for update in &launched {
        let elem =
            kernel_elem(update.0.dense().tensor().dtype).unwrap_or(ElemType::Float(FloatKind::F32));
        if !dtypes.contains(&elem) {
            dtypes.push(elem);
        }
    }
    for (index, factors) in factors.iter().enumerate() {
        for &elem in &dtypes {
            let chunk: Vec<_> = launched
                .iter()
                .filter(|update| {
                    update.4 == index && kernel_elem(update.0.dense().tensor().dtype) == Some(elem)
                })
                .collect();
            for part in chunk.chunks(params_per_launch(launched[0].0.dense().tensor(), 4, 0)) {
                launch(part, factors, decay, elem);
            }
        }
    }
    launched
        .into_iter()
        .map(|(target, _, moment_1, moment_2, _)| {
            (
                target.finish(),
                moment_1.into_tensor(),
                moment_2.into_tensor(),
            )
        })
        .collect()
}

/// Parameters per launch of a multi-tensor update on `tensor`'s device, each binding
/// `per_param` buffers besides `shared` ones: [`MAX_PARAMS_PER_LAUNCH`], fewer where the device
/// binds fewer buffers per kernel.
pub(in crate::cube) fn params_per_launch(
    tensor: &CubeTensor,
    per_param: usize,
    shared: usize,
) -> usize {
    let bindings = tensor.client.properties().hardware.max_bindings as usize;
    MAX_PARAMS_PER_LAUNCH
        .min(bindings.saturating_sub(shared) / per_param)
        .max(1)
}

/// Cubes along x of a multi-tensor launch whose largest parameter has `largest` elements (a
/// grid-stride loop covers the rest).
pub(in crate::cube) fn cubes_along_x(largest: usize) -> u32 {
    (largest as u32)
        .div_ceil(CUBE_THREADS)
        .clamp(1, MAX_CUBES_PER_PARAM)
}

/// One parameter's buffers in a launch: target (updated in place), gradient, first and second
/// moment, and the index of its factors.
type Launched = (Target, Dense, Dense, Dense, usize);

/// One kernel launch for `part`, whose tensors are all of element type `elem`.
fn launch(part: &[&Launched], factors: &Factors, decay: bool, elem: ElemType) {
    let client = part[0].0.dense().tensor().client.clone();
    let largest = part
        .iter()
        .map(|update| update.0.dense().len())
        .max()
        .unwrap_or(1);
    let cubes_x = cubes_along_x(largest);
    let buffers = |select: fn(&Launched) -> &Dense| {
        part.iter()
            .map(|update| {
                // SAFETY: the kernel is instantiated for `elem`, the dtype of every tensor of
                // this chunk (checked by the caller: same shape and dtype per parameter, and
                // the chunk holds only tensors of `elem`), and reads each slice below its
                // length only (see the launch below).
                unsafe { select(update).arg() }
            })
            .collect()
    };
    // SAFETY: `launch_unchecked` skips bounds checks; each thread reads and writes only indices
    // below its own parameter's length (the loop bound is that buffer's length, and all four
    // `Dense` buffers of a parameter have it). The written buffers (targets and moments) are
    // distinct from each other and from the gradients, as CUDA's `__restrict__` pointers
    // require: the moments and the targets outside graphs are buffers that nothing else holds
    // (`Dense::owned`: the handle is unique, or it is a fresh copy), the graph buffers (or
    // fresh copies of them) are held by their graphs only and each is written by one parameter
    // of the batch (`Batch::gather`).
    unsafe {
        adam_multi_kernel::launch_unchecked(
            &client,
            CubeCount::Static(cubes_x, part.len() as u32, 1),
            CubeDim::new_1d(CUBE_THREADS),
            buffers(|update| update.0.dense()),
            buffers(|update| &update.1),
            buffers(|update| &update.2),
            buffers(|update| &update.3),
            factors.launch(),
            decay,
            elem,
        );
    }
}

/// The parameters of one optimizer step gathered for [`register`], and the static buffers
/// the in-place ones write.
#[derive(Default)]
pub(crate) struct Batch {
    updates: Vec<Update>,
    /// Per update: the static buffer it writes in place, if any.
    buffers: Vec<Option<ParamSlot>>,
    /// The factors of each step number in the batch: `(time, factors)`.
    factors: Vec<(usize, Factors)>,
    decay: bool,
}

impl Batch {
    /// Adds the Adam step of one parameter to the batch and returns the step number and the
    /// tensor that stands in for the parameter until [`finish`](Self::finish) (of the same
    /// shape; its values are not the parameter's), or the arguments back (`Err`) where the step
    /// cannot be fused.
    pub fn gather<const D: usize>(
        &mut self,
        adam: &AdamHyper,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AdamState<D>>,
    ) -> Result<(Tensor<D>, usize), Box<Unfused<D>>> {
        let AdamOperands {
            param,
            grad,
            moments,
            time,
        } = prepare(adam, tensor, grad, state)?;
        let factors = match self.factors.iter().position(|(t, _)| *t == time) {
            Some(index) => index,
            None => {
                self.factors.push((time, factors(adam, lr, time)));
                self.factors.len() - 1
            }
        };
        self.decay = adam.penalty.is_some_and(|penalty| penalty != 0.0);
        // A buffer already written by this batch (two parameters over the same tensor) is
        // not written twice: the second update goes to a new buffer.
        let claim = param_claim::claim(param, &self.buffers);
        // The stand-in holds neither the old parameter (outside graphs its buffer may then be
        // updated in place, as fusion decides) nor a tensor over a graph buffer that user code
        // could read: the graph's own buffer tensor where the update goes in place (dropping
        // it releases nothing), the gradient otherwise (same shape; fusion frees it when the
        // stand-in is dropped).
        let stand_in = match &claim.in_place {
            Some(_) => Tensor::<D>::from_primitive::<Cube>(claim.values.clone()),
            None => Tensor::<D>::from_primitive::<Cube>(grad.clone()),
        };
        self.updates.push(Update {
            param: claim.values,
            grad,
            moments,
            in_place: claim.in_place.is_some(),
            factors,
        });
        self.buffers.push(claim.in_place);
        Ok((stand_in, time))
    }

    /// Queues the batch as one fusion operation; returns per gathered parameter, in order, the
    /// new parameter and moments, as dispatch tensors. The static buffers written in place
    /// record their new parameter tensors as handed out.
    pub fn finish(self) -> Vec<[DispatchTensor; 3]> {
        if self.updates.is_empty() {
            return Vec::new();
        }
        let factors = self
            .factors
            .into_iter()
            .map(|(_, factors)| factors)
            .collect();
        let updated = register(self.updates, factors, self.decay);
        for ((new_param, _, _), buffer) in updated.iter().zip(&self.buffers) {
            if let Some(slot) = buffer {
                slot.hand_over(new_param);
            }
        }
        let dispatch = |primitive| Tensor::<1>::from_primitive::<Cube>(primitive).into_dispatch();
        updated
            .into_iter()
            .map(|(param, moment_1, moment_2)| {
                [dispatch(param), dispatch(moment_1), dispatch(moment_2)]
            })
            .collect()
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::super::super::copy_op::key_of;
    use super::super::super::dense::test_support::*;
    use super::*;

    /// The update of `param` (in place or not) in one batch with a dense parameter, step 2.
    fn update(param: &CubeTensor, in_place: bool) -> Vec<(CubeTensor, CubeTensor, CubeTensor)> {
        let moment_2: Vec<f32> = values(3.0).iter().map(|v| v * v * 0.01).collect();
        let resolved = |param: CubeTensor, in_place| Resolved {
            param,
            grad: laid_out(&values(1.0), COLS),
            moment_1: laid_out(&values(2.0), COLS),
            moment_2: laid_out(&moment_2, COLS),
            in_place,
            factors: 0,
        };
        let adam = AdamHyper {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-5,
            penalty: None,
            fusable: true,
        };
        update_all(
            vec![
                resolved(param.clone(), in_place),
                resolved(laid_out(&values(4.0), COLS), false),
            ],
            &[factors(&adam, 1e-2, 2)],
            false,
        )
    }

    /// In one launch with another parameter, a pitched static buffer is updated in place (the
    /// tensor handed back is that buffer, padding left alone) and a pitched parameter outside
    /// graphs into a dense buffer, both with the elements of the same update of a dense copy.
    #[test]
    fn pitched_parameters_in_a_batch() {
        let param = values(0.0);
        let expected = update(&laid_out(&param, COLS), true);
        assert_ne!(
            buffer(&expected[0].0),
            param,
            "the update changes the parameter"
        );
        for in_place in [true, false] {
            let pitched = laid_out(&param, PITCH);
            let updated = update(&pitched, in_place);
            assert_eq!(key_of(&updated[0].0) == key_of(&pitched), in_place);
            assert_eq!(elements(&updated[0].0), buffer(&expected[0].0));
            assert_eq!(elements(&updated[0].1), buffer(&expected[0].1));
            assert_eq!(elements(&updated[0].2), buffer(&expected[0].2));
            assert_eq!(buffer(&updated[1].0), buffer(&expected[1].0));
            assert!(padding_untouched(&pitched));
            if !in_place {
                assert_eq!(
                    elements(&pitched),
                    param,
                    "outside graphs, a copy is updated"
                );
            }
        }
    }
}
