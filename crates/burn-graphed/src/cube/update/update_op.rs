//! The optimizer update of many parameters as **one** fusion operation (PyTorch's multi-tensor
//! `fused=True` optimizers): every parameter, gradient and state of a step goes into a single
//! operation registered with fusion by hand, which launches [`update_kernel`] once per chunk of
//! parameters of one dtype and one clock. Every update of the crate goes through here: a
//! `FusedAdam` step (an operation of one parameter), a `MultiTensorAdam` step and the whole
//! step's recorded update. The host profile of the graphed step showed that fusion's cost per
//! registered operation, not the kernels, bounds an eager step: hence one operation, not one
//! per parameter.
//!
//! The `backend_extension` macro cannot express a variable number of tensors, so the operation
//! is built here from the same parts the macro uses (`CustomOpIr` and an `OperationFn` that
//! resolves the input handles and registers the output handles at execution time).

use burn::backend::TensorMetadata;
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use burn_fusion::custom::{
    CustomOpIr, HandleContainer, OperationFn, OperationIr, StreamId, TensorId, TensorIr,
};
use burn_fusion::{FusionBackend, FusionRuntime};
use cubecl::prelude::*;

use super::super::buffers::FusedTensor;
use super::super::dense::{Dense, Target};
use super::update_kernel::{Clock, Hyper, Rule, kernel_elem, schedule_arg, update_kernel};

/// Threads per cube of the update kernel.
const CUBE_THREADS: u32 = 256;

/// Most parameters one launch updates (up to four bindings each: parameter, gradient, two
/// moments). Bounds the kernel's argument size on CUDA and stays under the binding limit of
/// the backends that have one (checked against the device's own limit too).
const MAX_PARAMS_PER_LAUNCH: usize = 24;

/// Most cubes along x per parameter: larger parameters are covered by a grid-stride loop.
const MAX_CUBES_PER_PARAM: u32 = 1024;

/// Where the updates of an operation read their clock (see `update_kernel`).
pub(crate) enum Clocks {
    /// The host's: one clock per step number in the operation (a `MultiTensorAdam` step may
    /// hold parameters at different steps, after a record was loaded); each [`Update`] names
    /// its own.
    Host(Vec<Clock>),
    /// The whole step's schedule buffer, which the operation reads on the device.
    Device(FusedTensor),
}

/// Which buffers an update writes in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Writes {
    /// The parameter and its states are a graph's static buffers (the whole step).
    Static,
    /// The parameter is a graph's static buffer (the caller made sure nobody else reads it);
    /// its states are updated in their own buffers where nothing else holds them, in copies
    /// otherwise.
    StaticParam,
    /// The parameter and its states are updated in their own buffers where nothing else holds
    /// them, in copies otherwise: the tensors handed back are the updated ones.
    Owned,
}

/// One parameter of an update, as handed to [`register`].
pub(crate) struct Update {
    /// The parameter's values.
    pub param: FusedTensor,
    /// Its gradient, by value (fusion frees it after the update without a release operation).
    pub grad: FusedTensor,
    /// Its states, by value: [`Rule::states`] of them (moments, or a velocity).
    pub states: Vec<FusedTensor>,
    /// Which of them the update writes in place.
    pub writes: Writes,
    /// Index of its clock in [`Clocks::Host`] (0 for [`Clocks::Device`]).
    pub clock: usize,
}

/// What one update was, at execution time.
struct Slot {
    param: TensorIr,
    grad: TensorIr,
    states: Vec<TensorIr>,
    writes: Writes,
    clock: usize,
    /// The new parameter, then the new states.
    outputs: Vec<TensorId>,
}

/// Fusion's handles of burn's cubecl backend.
type Handles =
    HandleContainer<<<CubeBackend as FusionBackend>::FusionRuntime as FusionRuntime>::FusionHandle>;

/// Queues the updates of `updates` as one fusion operation. Returns, per update and in order,
/// the new parameter (a tensor over the static buffer where it is one) followed by its new
/// states. Every update has [`Rule::states`] states, all tensors of one update have one shape
/// and one dtype that `kernel_elem` takes (checked by the caller; updates may differ in dtype),
/// and `updates` is not empty. Results over static buffers must be held until the stream
/// drained (fusion skips work whose results nobody holds).
pub(crate) fn register(
    updates: Vec<Update>,
    clocks: Clocks,
    rule: Rule,
    hyper: Hyper,
) -> Vec<Vec<FusedTensor>> {
    let client = updates[0].param.client.clone();
    let (host_clocks, schedule) = match clocks {
        Clocks::Host(clocks) => (clocks, None),
        Clocks::Device(schedule) => (Vec::new(), Some(schedule.into_ir())),
    };
    let rule = rule.with_device_clock(schedule.is_some());
    let mut inputs: Vec<TensorIr> = schedule.iter().cloned().collect();
    let mut outputs = Vec::new();
    let mut slots = Vec::with_capacity(updates.len());
    for update in updates {
        let (shape, dtype) = (update.param.shape(), update.param.dtype());
        let ids: Vec<TensorId> = (0..=update.states.len())
            .map(|_| client.create_empty_handle())
            .collect();
        for &id in &ids {
            outputs.push(TensorIr::uninit(id, shape.clone(), dtype));
        }
        // `into_ir` marks an input the caller handed over (no other holder) as writable, so
        // fusion gives its buffer to the operation and frees it afterwards.
        let slot = Slot {
            param: update.param.into_ir(),
            grad: update.grad.into_ir(),
            states: update.states.into_iter().map(|s| s.into_ir()).collect(),
            writes: update.writes,
            clock: update.clock,
            outputs: ids,
        };
        inputs.push(slot.param.clone());
        inputs.push(slot.grad.clone());
        inputs.extend(slot.states.iter().cloned());
        slots.push(slot);
    }
    let counts: Vec<usize> = slots.iter().map(|slot| slot.outputs.len()).collect();
    let description = CustomOpIr {
        id: "burn_graphed_update".into(),
        inputs,
        outputs,
        scalars: Vec::new(),
    };
    let operation = OperationFn(move |handles: &mut Handles| {
        let schedule = schedule
            .as_ref()
            .map(|ir| handles.get_float_tensor::<CubeBackend>(ir));
        let launched = slots
            .iter()
            .map(|slot| Launched::resolve(slot, handles))
            .collect();
        let updated = update_all(launched, schedule.as_ref(), &host_clocks, rule, &hyper);
        for (slot, tensors) in slots.iter().zip(updated) {
            for (id, tensor) in slot.outputs.iter().zip(tensors) {
                handles.register_float_tensor::<CubeBackend>(id, tensor);
            }
        }
        Ok(())
    });
    let mut tensors = client
        .register(
            StreamId::current(),
            OperationIr::Custom(description),
            operation,
        )
        .into_iter();
    counts
        .into_iter()
        .map(|count| tensors.by_ref().take(count).collect())
        .collect()
}

/// One parameter's buffers in a launch: its target (updated in place), its dense gradient,
/// its state targets, and the index of its clock.
struct Launched {
    target: Target,
    grad: Dense,
    states: Vec<Target>,
    clock: usize,
}

impl Launched {
    /// The buffers of `slot`, on fusion's server.
    fn resolve(slot: &Slot, handles: &mut Handles) -> Self {
        let mut get = |ir: &TensorIr| handles.get_float_tensor::<CubeBackend>(ir);
        let (param, grad) = (get(&slot.param), get(&slot.grad));
        let states = slot.states.iter().map(&mut get).collect();
        Self::new(param, &grad, states, slot.writes, slot.clock)
    }

    /// One update's buffers as its [`Writes`] says: a graph's static buffer is updated in
    /// place (through a dense copy where CUDA pitched it; see `dense`); any other tensor in its
    /// own buffer where the caller handed over the only reference (fusion's rule), otherwise
    /// in a copy.
    fn new(
        param: CubeTensor,
        grad: &CubeTensor,
        states: Vec<CubeTensor>,
        writes: Writes,
        clock: usize,
    ) -> Self {
        let (param_static, states_static) = match writes {
            Writes::Static => (true, true),
            Writes::StaticParam => (true, false),
            Writes::Owned => (false, false),
        };
        let place = |tensor, in_static: bool| {
            if in_static {
                Target::static_buffer(tensor)
            } else {
                Target::owned(tensor)
            }
        };
        Self {
            target: place(param, param_static),
            grad: Dense::of(grad),
            states: states
                .into_iter()
                .map(|state| place(state, states_static))
                .collect(),
            clock,
        }
    }

    fn elem(&self) -> Option<ElemType> {
        kernel_elem(self.target.dense().tensor().dtype)
    }
}

/// Launches the updates (one launch per chunk of parameters of one clock and one dtype) and
/// returns, per update and in order, the updated parameter and states.
fn update_all(
    launched: Vec<Launched>,
    schedule: Option<&CubeTensor>,
    host_clocks: &[Clock],
    rule: Rule,
    hyper: &Hyper,
) -> Vec<Vec<CubeTensor>> {
    let mut dtypes: Vec<ElemType> = Vec::new();
    for update in &launched {
        if let Some(elem) = update.elem()
            && !dtypes.contains(&elem)
        {
            dtypes.push(elem);
        }
    }
    // Parameter, gradient and states per parameter; the schedule once.
    let per_launch = params_per_launch(
        launched[0].target.dense().tensor(),
        2 + rule.states(),
        usize::from(schedule.is_some()),
    );
    // The device clock is one clock; its launch argument is not read.
    let unread = [Clock::new(0.0, 0)];
    let clocks = if schedule.is_some() {
        &unread[..]
    } else {
        host_clocks
    };
    for (index, clock) in clocks.iter().enumerate() {
        for &elem in &dtypes {
            let chunk: Vec<&Launched> = launched
                .iter()
                .filter(|update| update.clock == index && update.elem() == Some(elem))
                .collect();
            for part in chunk.chunks(per_launch) {
                launch(part, schedule, clock, rule, hyper, elem);
            }
        }
    }
    launched
        .into_iter()
        .map(|update| {
            std::iter::once(update.target.finish())
                .chain(update.states.into_iter().map(Target::finish))
                .collect()
        })
        .collect()
}

/// Parameters per launch on `tensor`'s device, each binding `per_param` buffers besides
/// `shared` ones: [`MAX_PARAMS_PER_LAUNCH`], fewer where the device binds fewer buffers per
/// kernel.
fn params_per_launch(tensor: &CubeTensor, per_param: usize, shared: usize) -> usize {
    let bindings = tensor.client.properties().hardware.max_bindings as usize;
    MAX_PARAMS_PER_LAUNCH
        .min(bindings.saturating_sub(shared) / per_param)
        .max(1)
}

/// One kernel launch for `part`, whose tensors are all of element type `elem`.
fn launch(
    part: &[&Launched],
    schedule: Option<&CubeTensor>,
    clock: &Clock,
    rule: Rule,
    hyper: &Hyper,
    elem: ElemType,
) {
    if part.is_empty() {
        return;
    }
    let client = part[0].target.dense().tensor().client.clone();
    let largest = part
        .iter()
        .map(|update| update.target.dense().len())
        .max()
        .unwrap_or(1);
    let cubes_x = (largest as u32)
        .div_ceil(CUBE_THREADS)
        .clamp(1, MAX_CUBES_PER_PARAM);
    // SAFETY (of each `arg` below): the kernel is instantiated for `elem`, the dtype of every
    // parameter, gradient and state of this chunk (the caller checked one dtype per parameter;
    // the chunk holds only parameters of `elem`), and reads each slice below its length only.
    let params = part
        .iter()
        .map(|update| unsafe { update.target.dense().arg() })
        .collect();
    let grads = part
        .iter()
        .map(|update| unsafe { update.grad.arg() })
        .collect();
    let states = |which: usize| {
        part.iter()
            .filter_map(|update| update.states.get(which))
            .map(|state| unsafe { state.dense().arg() })
            .collect()
    };
    let schedule = schedule.map(schedule_arg).into_iter().collect();
    // SAFETY: `launch_unchecked` skips bounds checks; each thread reads and writes only indices
    // below its own parameter's length (the loop bound), which all of that parameter's buffers
    // have (same shape, checked by the caller), and reads words 0-2 of the schedule where the
    // clock is on the device (`schedule_arg` checks its size). The written buffers (parameters
    // and states) are distinct from each other and from the gradients and the schedule, as
    // CUDA's `__restrict__` pointers require: static buffers (or dense copies of them) are
    // held by their graphs only and each is written by one parameter of the operation (the
    // callers claim each at most once), the other targets are buffers that nothing else holds
    // (`Dense::owned`: the handle is unique, or it is a fresh copy).
    unsafe {
        update_kernel::launch_unchecked(
            &client,
            CubeCount::Static(cubes_x, part.len() as u32, 1),
            CubeDim::new_1d(CUBE_THREADS),
            params,
            grads,
            states(0),
            states(1),
            schedule,
            clock.arg(),
            hyper.arg(),
            rule,
            elem,
        );
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::super::super::copy_op::key_of;
    use super::super::super::dense::test_support::*;
    use super::super::update_kernel::rule_of;
    use super::*;
    use crate::step_optim::StepOptimizer;

    /// Adam with weight decay, the rule of the tests below.
    fn adam() -> (Rule, Hyper) {
        rule_of(&StepOptimizer::Adam {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-5,
            weight_decay: Some(0.05),
        })
    }

    /// The buffers of an update of `param` at step 2 (the moments as step 1 left them: dense,
    /// and positive where they must be).
    fn launched(param: CubeTensor, writes: Writes) -> Launched {
        let moment_2: Vec<f32> = values(3.0).iter().map(|v| v * v * 0.01).collect();
        let states = vec![laid_out(&values(2.0), COLS), laid_out(&moment_2, COLS)];
        Launched::new(param, &laid_out(&values(1.0), COLS), states, writes, 0)
    }

    /// The update of `param` (as `writes` says) in one launch with a dense parameter, step 2 on
    /// the host's clock or, with `schedule`, on the device's.
    fn update(
        param: &CubeTensor,
        writes: Writes,
        schedule: Option<&CubeTensor>,
    ) -> Vec<Vec<CubeTensor>> {
        let (rule, hyper) = adam();
        let updates = vec![
            launched(param.clone(), writes),
            launched(laid_out(&values(4.0), COLS), Writes::Owned),
        ];
        let clocks = [Clock::new(1e-2, 2)];
        let rule = rule.with_device_clock(schedule.is_some());
        update_all(updates, schedule, &clocks, rule, &hyper)
    }

    /// In one launch with another parameter, a pitched static buffer is updated in place (the
    /// tensor handed back is that buffer, padding left alone) and a pitched parameter outside
    /// graphs into a dense buffer, both with the elements of the same update of a dense copy;
    /// the parameter outside graphs keeps its values (it is shared: the test holds it).
    #[test]
    fn pitched_parameters_in_one_launch() {
        let param = values(0.0);
        let expected = update(&laid_out(&param, COLS), Writes::Owned, None);
        assert_ne!(
            buffer(&expected[0][0]),
            param,
            "the update changes the parameter"
        );
        for writes in [Writes::StaticParam, Writes::Static, Writes::Owned] {
            let pitched = laid_out(&param, PITCH);
            let updated = update(&pitched, writes, None);
            let in_place = writes != Writes::Owned;
            assert_eq!(key_of(&updated[0][0]) == key_of(&pitched), in_place);
            for (tensor, expected) in updated[0].iter().zip(&expected[0]) {
                assert_eq!(elements(tensor), buffer(expected), "{writes:?}");
            }
            assert_eq!(buffer(&updated[1][0]), buffer(&expected[1][0]));
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

    /// The device's clock (the schedule's words: learning rate, one update done, no decay)
    /// gives the update of the host's clock at step 2 bit for bit; a schedule at another
    /// learning rate (the negative control) does not.
    #[test]
    fn device_clock_reads_the_schedule() {
        let param = values(0.0);
        let host = update(&laid_out(&param, COLS), Writes::Owned, None);
        let schedule = |lr: f32| {
            let words = [lr, 1.0, 1.0].map(f32::to_le_bytes);
            padded(&words, [SCHEDULE], burn::tensor::DType::F32)
        };
        let device = update(
            &laid_out(&param, COLS),
            Writes::Owned,
            Some(&schedule(1e-2)),
        );
        for (host, device) in host.iter().flatten().zip(device.iter().flatten()) {
            assert_eq!(buffer(host), buffer(device));
        }
        let other = update(
            &laid_out(&param, COLS),
            Writes::Owned,
            Some(&schedule(2e-2)),
        );
        assert_ne!(buffer(&host[0][0]), buffer(&other[0][0]));
    }

    /// Words of a schedule.
    const SCHEDULE: usize = super::super::update_kernel::SCHEDULE_WORDS;
}
