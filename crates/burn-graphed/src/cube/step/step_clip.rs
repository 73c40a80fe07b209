//! A whole step's gradient clipping inside the graph: burn's `Clipping::Value` and
//! `Clipping::Norm`, and PyTorch's `clip_grad_norm_` for `Clipping::GlobalNorm`, as tensor
//! operations (nothing is read on the host), so that the recorded step clips as eager
//! training does.

use burn::backend::ops::FloatTensorOps;
use burn::backend::{Dispatch, DispatchTensor};
use burn::tensor::{DType, Tensor};

use crate::step_optim::Clipping;

/// `grads` clipped as `clipping` says, with burn's arithmetic for [`Clipping::Value`] and
/// [`Clipping::Norm`] (`grad_clipping/base.rs`: the norm in `f32`, divided by itself plus the
/// smallest positive `f32`, the factor clamped to 1), and PyTorch's `clip_grad_norm_` for
/// [`Clipping::GlobalNorm`] (one factor `max / (norm + 1e-6)`, clamped to 1). Tensor
/// operations only: no value is read on the host.
pub(in crate::cube) fn clip(
    grads: Vec<Option<DispatchTensor>>,
    clipping: Option<Clipping>,
) -> Vec<Option<DispatchTensor>> {
    let Some(clipping) = clipping else {
        return grads;
    };
    let flat = |grad: DispatchTensor| -> (Tensor<1>, burn::tensor::Shape, DType) {
        let tensor = Tensor::<1>::from_dispatch(grad);
        let (shape, dtype) = (tensor.shape(), tensor.dtype());
        let flat = tensor.reshape([shape.num_elements()]);
        let flat = match dtype {
            DType::F16 | DType::BF16 => flat.cast(burn::tensor::FloatDType::F32),
            _ => flat,
        };
        (flat, shape, dtype)
    };
    let back = |flat: Tensor<1>, shape: burn::tensor::Shape, dtype: DType| -> DispatchTensor {
        let flat = if dtype == flat.dtype() {
            flat
        } else {
            flat.cast(dtype)
        };
        Dispatch::float_reshape(flat.into_dispatch(), shape)
    };
    match clipping {
        Clipping::Value(value) => grads
            .into_iter()
            .map(|g| {
                g.map(|g| {
                    let (flat, shape, dtype) = flat(g);
                    back(flat.clamp(-value, value), shape, dtype)
                })
            })
            .collect(),
        Clipping::Norm(max) => grads
            .into_iter()
            .map(|g| {
                g.map(|g| {
                    let (flat, shape, dtype) = flat(g);
                    let norm = flat.clone().square().sum().sqrt();
                    let factor = (max / norm.add_scalar(f32::MIN_POSITIVE)).clamp_max(1.0);
                    back(flat * factor, shape, dtype)
                })
            })
            .collect(),
        Clipping::GlobalNorm(max) => {
            let flats: Vec<Option<(Tensor<1>, burn::tensor::Shape, DType)>> =
                grads.into_iter().map(|g| g.map(flat)).collect();
            let total = flats
                .iter()
                .flatten()
                .map(|(flat, _, _)| flat.clone().square().sum())
                .reduce(|a, b| a + b);
            let Some(total) = total else {
                return flats.into_iter().map(|_| None).collect();
            };
            let factor = (max / total.sqrt().add_scalar(1e-6)).clamp_max(1.0);
            flats
                .into_iter()
                .map(|f| f.map(|(flat, shape, dtype)| back(flat * factor.clone(), shape, dtype)))
                .collect()
        }
    }
}
