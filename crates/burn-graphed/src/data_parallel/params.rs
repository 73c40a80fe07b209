//! The module walks of a data-parallel group: a replica on another device, the gradients
//! flattened into one bucket and split back, every parameter read for a broadcast and written
//! from one, and the hash of the replicas' starting values.

use std::collections::HashSet;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};

/// A replica of `module` on `device`, for a rank of a data-parallel group: the same parameter
/// values (and ids, so that [`DataParallel::average`](super::DataParallel::average) lines the ranks' gradients up), each
/// float parameter a new autodiff leaf on `device` keeping its `require_grad`, int and bool
/// parameters copied there too. Reads every parameter back to the host once: for setting a
/// group up, not for every step.
pub fn replica_on<M: Module>(module: &M, device: &Device) -> M {
    module.clone().map(&mut OnDevice(device))
}

/// Moves each parameter to a device through host memory, as a new leaf.
struct OnDevice<'a>(&'a Device);

impl ModuleMapper for OnDevice<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let require_grad = param.is_require_grad();
        param.map(|tensor| {
            let copy = Tensor::<D>::from_data(tensor.inner().into_data(), self.0);
            if require_grad {
                copy.require_grad()
            } else {
                copy
            }
        })
    }

    fn map_int<const D: usize>(&mut self, param: Param<Tensor<D, Int>>) -> Param<Tensor<D, Int>> {
        param.map(|tensor| Tensor::from_data(tensor.into_data(), self.0))
    }

    fn map_bool<const D: usize>(
        &mut self,
        param: Param<Tensor<D, Bool>>,
    ) -> Param<Tensor<D, Bool>> {
        param.map(|tensor| Tensor::from_data(tensor.into_data(), self.0))
    }
}

/// Takes each parameter's gradient out of the gradients, flattened.
pub(super) struct Flatten<'a> {
    pub(super) grads: &'a mut GradientsParams,
    /// Per parameter with a gradient, in visiting order: its id, element count, flat gradient.
    pub(super) parts: Vec<(ParamId, usize, Tensor<1>)>,
    /// The position of each of `parts` among the module's float parameters.
    pub(super) positions: Vec<usize>,
    /// Float parameters visited so far.
    pub(super) visited: usize,
}

impl ModuleVisitor for Flatten<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(grad) = self.grads.remove::<D>(param.id) {
            let numel = grad.shape().num_elements();
            self.parts.push((param.id, numel, grad.reshape([numel])));
            self.positions.push(self.visited);
        }
        self.visited += 1;
    }
}

/// Puts the averaged bucket's slices back as the gradients, in the same order.
pub(super) struct Split<'a> {
    pub(super) grads: &'a mut GradientsParams,
    pub(super) averaged: Tensor<1>,
    pub(super) offset: usize,
    pub(super) ids: HashSet<ParamId>,
}

impl ModuleVisitor for Split<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !self.ids.contains(&param.id) {
            return;
        }
        let dims: [usize; D] = param.val().dims();
        let numel: usize = dims.iter().product();
        let slice = self
            .averaged
            .clone()
            .narrow(0, self.offset, numel)
            .reshape(dims);
        self.offset += numel;
        self.grads.register::<D>(param.id, slice);
    }
}

/// Every float parameter's values as `f32`, in visiting order ([`DataParallel::broadcast`](super::DataParallel::broadcast)).
#[derive(Default)]
pub(super) struct ReadParams {
    pub(super) values: Vec<f32>,
    pub(super) failed: Option<String>,
}

impl ModuleVisitor for ReadParams {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.failed.is_some() {
            return;
        }
        let tensor = param.val();
        if tensor.dtype() == burn::tensor::DType::F64 {
            self.failed = Some(format!(
                "parameter {} is f64, which the broadcast's f32 would round",
                param.id
            ));
            return;
        }
        match tensor
            .try_into_data()
            .map_err(|e| e.to_string())
            .and_then(|data| {
                data.convert::<f32>()
                    .try_into_vec::<f32>()
                    .map_err(|e| format!("{e:?}"))
            }) {
            Ok(values) => self.values.extend(values),
            Err(error) => {
                self.failed = Some(format!("parameter {} did not read back: {error}", param.id));
            }
        }
    }
}

/// Puts `values` (rank 0's, in visiting order) into the float parameters.
pub(super) struct WriteParams<'a> {
    pub(super) values: &'a [f32],
    pub(super) offset: usize,
}

impl ModuleMapper for WriteParams<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let require_grad = param.is_require_grad();
        let (values, offset) = (self.values, &mut self.offset);
        param.map(|tensor| {
            let (device, dtype, dims) = (tensor.device(), tensor.dtype(), tensor.dims());
            let numel: usize = dims.iter().product();
            let slice = values[*offset..*offset + numel].to_vec();
            *offset += numel;
            let copy =
                Tensor::<D>::from_data(TensorData::new(slice, dims).convert_dtype(dtype), &device);
            if require_grad {
                copy.require_grad()
            } else {
                copy
            }
        })
    }
}

/// Hashes every parameter's shape and value bytes, in visiting order (not its id: the replicas
/// of a group of processes were made apart).
pub(super) struct StartHash {
    pub(super) hasher: std::collections::hash_map::DefaultHasher,
    /// Why a parameter could not be read back.
    pub(super) failed: Option<String>,
}

impl StartHash {
    fn add(&mut self, id: ParamId, data: Result<TensorData, String>) {
        use std::hash::Hash;
        match data {
            Ok(data) => {
                data.shape().hash(&mut self.hasher);
                data.as_bytes().hash(&mut self.hasher);
            }
            Err(error) => {
                self.failed
                    .get_or_insert(format!("parameter {id} did not read back: {error}"));
            }
        }
    }
}

impl ModuleVisitor for StartHash {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let data = param.val().try_into_data().map_err(|e| e.to_string());
        self.add(param.id, data);
    }

    fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
        let data = param.val().try_into_data().map_err(|e| e.to_string());
        self.add(param.id, data);
    }

    fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
        let data = param.val().try_into_data().map_err(|e| e.to_string());
        self.add(param.id, data);
    }
}
