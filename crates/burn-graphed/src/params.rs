//! The float parameters and train/eval flags of a module, in visiting order.

use burn::module::{Flag, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{Bool, Device, Int, Tensor};

use crate::tensors::FlatTensor;

/// One float parameter as the capture sees it.
#[derive(Debug, Clone)]
pub(crate) struct ParamEntry {
    pub id: ParamId,
    pub tensor: FlatTensor,
}

/// What decides whether a call may replay the graphs of a capture: every float parameter's id,
/// shape and `require_grad`, and every flag (train/eval switches such as dropout's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ModuleMode {
    pub params: Vec<(ParamId, Vec<usize>, bool)>,
    pub flags: Vec<bool>,
}

impl ModuleMode {
    /// Parameters added, removed, replaced (other id) or reshaped since `captured`: the graphs
    /// cannot serve this module.
    pub fn structural_difference(&self, captured: &ModuleMode) -> Option<String> {
        self.params_difference(captured, false)
    }

    /// Why `self` (at a call) differs from `captured`; `None` if it does not.
    pub fn difference(&self, captured: &ModuleMode) -> Option<String> {
        self.params_difference(captured, true).or_else(|| {
            (self.flags != captured.flags).then(|| {
                format!(
                    "train/eval flags are {:?} now, {:?} at capture",
                    self.flags, captured.flags
                )
            })
        })
    }

    /// The first parameter that differs from `captured`'s in count, id, shape or (when asked)
    /// `require_grad`. Compares in place: it runs at every call.
    fn params_difference(&self, captured: &ModuleMode, require_grad: bool) -> Option<String> {
        if self.params.len() != captured.params.len() {
            return Some(format!(
                "{} float parameters now, {} at capture",
                self.params.len(),
                captured.params.len()
            ));
        }
        self.params
            .iter()
            .zip(&captured.params)
            .enumerate()
            .find_map(|(index, (now, then))| {
                if now.0 != then.0 {
                    Some(format!(
                        "parameter {index} has id {} now, {} at capture",
                        now.0, then.0
                    ))
                } else if now.1 != then.1 {
                    Some(format!(
                        "parameter {index} has shape {:?} now, {:?} at capture",
                        now.1, then.1
                    ))
                } else if require_grad && now.2 != then.2 {
                    Some(format!(
                        "parameter {index} has require_grad {} now, {} at capture",
                        now.2, then.2
                    ))
                } else {
                    None
                }
            })
    }
}

#[derive(Default)]
struct Collector {
    params: Vec<ParamEntry>,
    flags: Vec<bool>,
}

impl ModuleVisitor for Collector {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.params.push(ParamEntry {
            id: param.id,
            tensor: FlatTensor::from_tensor(param.val()),
        });
    }

    fn visit_int<const D: usize>(&mut self, _param: &Param<Tensor<D, Int>>) {}

    fn visit_bool<const D: usize>(&mut self, _param: &Param<Tensor<D, Bool>>) {}

    fn visit_flag(&mut self, flag: &Param<Flag>) {
        self.flags.push(flag.is_enabled());
    }
}

/// The module's float parameters (initializing lazy ones) and its mode.
pub(crate) fn collect<M: Module>(module: &M) -> (Vec<ParamEntry>, ModuleMode) {
    let mut collector = Collector::default();
    module.visit(&mut collector);
    let mode = ModuleMode {
        params: collector
            .params
            .iter()
            .map(|p| (p.id, p.tensor.shape.clone(), p.tensor.require_grad))
            .collect(),
        flags: collector.flags,
    };
    (collector.params, mode)
}

/// Replaces every float parameter, in visiting order, by the tensor `replace` returns for it;
/// ids, mappers and train/eval memory are kept.
struct Replacer<'a> {
    index: usize,
    replace: &'a mut dyn FnMut(usize, FlatTensor) -> FlatTensor,
}

impl ModuleMapper for Replacer<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let index = self.index;
        self.index += 1;
        let replace = &mut self.replace;
        param.map(|tensor| {
            Tensor::from_dispatch(replace(index, FlatTensor::from_tensor(tensor)).tensor)
        })
    }
}

/// A copy of `module` whose float parameters are replaced, in visiting order.
pub(crate) fn replace<M: Module>(
    module: M,
    mut replace: impl FnMut(usize, FlatTensor) -> FlatTensor,
) -> M {
    let mut mapper = Replacer {
        index: 0,
        replace: &mut replace,
    };
    module.map(&mut mapper)
}

/// The device of the module's first float parameter.
pub(crate) fn device_of(params: &[ParamEntry]) -> Option<Device> {
    params.first().map(|p| p.tensor.device.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(params: &[(u64, &[usize], bool)], flags: &[bool]) -> ModuleMode {
        ModuleMode {
            params: params
                .iter()
                .map(|(id, shape, grad)| (ParamId::from(*id), shape.to_vec(), *grad))
                .collect(),
            flags: flags.to_vec(),
        }
    }

    #[test]
    fn same_mode_has_no_difference() {
        let a = mode(&[(1, &[2, 3], true)], &[true]);
        assert_eq!(a.difference(&a.clone()), None);
        assert_eq!(a.structural_difference(&a.clone()), None);
    }

    #[test]
    fn require_grad_and_flags_are_mode_changes_not_structural() {
        let captured = mode(&[(1, &[2, 3], true)], &[true]);
        let eval = mode(&[(1, &[2, 3], false)], &[false]);
        assert!(eval.difference(&captured).unwrap().contains("require_grad"));
        assert_eq!(eval.structural_difference(&captured), None);
        let flags = mode(&[(1, &[2, 3], true)], &[false]);
        assert!(flags.difference(&captured).unwrap().contains("flags"));
    }

    #[test]
    fn added_replaced_or_reshaped_parameters_are_structural() {
        let captured = mode(&[(1, &[2, 3], true)], &[]);
        let added = mode(&[(1, &[2, 3], true), (2, &[3], true)], &[]);
        assert!(
            added
                .structural_difference(&captured)
                .unwrap()
                .contains("2 float parameters now, 1 at capture")
        );
        let replaced = mode(&[(7, &[2, 3], true)], &[]);
        assert!(
            replaced
                .structural_difference(&captured)
                .unwrap()
                .contains("id")
        );
        let reshaped = mode(&[(1, &[3, 2], true)], &[]);
        assert!(
            reshaped
                .structural_difference(&captured)
                .unwrap()
                .contains("shape")
        );
    }
}
