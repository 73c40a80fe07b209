//! Inputs and outputs of a graphed callable: a tensor or a tuple of tensors, flattened to a
//! list of rank-erased tensors and back.

use burn::backend::DispatchTensor;
use burn::tensor::{DType, Device, Tensor};

/// One tensor of a flattened input or output, with the metadata the capture compares.
#[derive(Debug, Clone)]
pub struct FlatTensor {
    /// The tensor, rank-erased.
    pub(crate) tensor: DispatchTensor,
    /// Its shape.
    pub(crate) shape: Vec<usize>,
    /// Its dtype.
    pub(crate) dtype: DType,
    /// Its device (with its autodiff setting).
    pub(crate) device: Device,
    /// Whether it needs a gradient: a leaf that requires grad, or a tensor computed from one
    /// (autodiff tracks it). burn's `is_require_grad` is false for the latter, but a graphed
    /// call must still pass the gradient on to it, or the layers before it would get none.
    pub(crate) require_grad: bool,
}

/// What a capture records of one input tensor and a call must match: shape, dtype and
/// `require_grad`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TensorSpec {
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub require_grad: bool,
}

impl FlatTensor {
    /// What a call must match to use a capture made with this tensor.
    pub(crate) fn spec(&self) -> TensorSpec {
        TensorSpec {
            shape: self.shape.clone(),
            dtype: self.dtype,
            require_grad: self.require_grad,
        }
    }

    /// The tensor, rank-erased (`Tensor::from_dispatch` turns it back into a `Tensor<D>`).
    pub fn tensor(&self) -> &DispatchTensor {
        &self.tensor
    }

    /// Its shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Whether it needs a gradient (requires grad, or is computed from a tensor that does).
    pub fn require_grad(&self) -> bool {
        self.require_grad
    }

    pub(crate) fn from_tensor<const D: usize>(tensor: Tensor<D>) -> Self {
        Self {
            shape: tensor.shape().to_vec(),
            dtype: tensor.dtype(),
            device: tensor.device(),
            require_grad: tensor.is_require_grad() || tensor.is_tracked(),
            tensor: tensor.into_dispatch(),
        }
    }
}

/// A group of float tensors that a graphed callable takes or returns: `Tensor<D>`, tuples of
/// up to four groups, or `Vec<Tensor<D>>` (whose length is fixed at capture).
pub trait TensorGroup: Sized {
    /// Appends the group's tensors, in order.
    fn flatten_into(self, out: &mut Vec<FlatTensor>);
    /// Rebuilds the group from the front of `tensors`; `None` if too few remain.
    fn unflatten_from(
        tensors: &mut std::vec::IntoIter<FlatTensor>,
        len_hint: usize,
    ) -> Option<Self>;

    /// The group's tensors as a list.
    fn flatten(self) -> Vec<FlatTensor> {
        let mut out = Vec::new();
        self.flatten_into(&mut out);
        out
    }

    /// Rebuilds the group from a list made by [`flatten`](Self::flatten) of a group of the same
    /// structure; `None` if the count does not fit.
    fn unflatten(tensors: Vec<FlatTensor>) -> Option<Self> {
        let len = tensors.len();
        let mut iter = tensors.into_iter();
        let group = Self::unflatten_from(&mut iter, len)?;
        iter.next().is_none().then_some(group)
    }
}

impl<const D: usize> TensorGroup for Tensor<D> {
    fn flatten_into(self, out: &mut Vec<FlatTensor>) {
        out.push(FlatTensor::from_tensor(self));
    }

    fn unflatten_from(
        tensors: &mut std::vec::IntoIter<FlatTensor>,
        _len_hint: usize,
    ) -> Option<Self> {
        tensors
            .next()
            .map(|flat| Tensor::from_dispatch(flat.tensor))
    }
}

/// A vector takes every remaining tensor, so it must come last in a tuple.
impl<const D: usize> TensorGroup for Vec<Tensor<D>> {
    fn flatten_into(self, out: &mut Vec<FlatTensor>) {
        out.extend(self.into_iter().map(FlatTensor::from_tensor));
    }

    fn unflatten_from(
        tensors: &mut std::vec::IntoIter<FlatTensor>,
        _len_hint: usize,
    ) -> Option<Self> {
        Some(
            tensors
                .by_ref()
                .map(|flat| Tensor::from_dispatch(flat.tensor))
                .collect(),
        )
    }
}

macro_rules! tuple_group {
    ($($name:ident),+) => {
        impl<$($name: TensorGroup),+> TensorGroup for ($($name,)+) {
            #[allow(non_snake_case)]
            fn flatten_into(self, out: &mut Vec<FlatTensor>) {
                let ($($name,)+) = self;
                $($name.flatten_into(out);)+
            }

            fn unflatten_from(
                tensors: &mut std::vec::IntoIter<FlatTensor>,
                len_hint: usize,
            ) -> Option<Self> {
                Some(($($name::unflatten_from(tensors, len_hint)?,)+))
            }
        }
    };
}

tuple_group!(A);
tuple_group!(A, B);
tuple_group!(A, B, C);
tuple_group!(A, B, C, E);

#[cfg(all(test, feature = "flex"))]
mod tests {
    use super::*;

    #[test]
    fn tuples_round_trip_in_order() {
        let device = Device::flex();
        let a = Tensor::<2>::ones([2, 3], &device);
        let b = Tensor::<1>::zeros([4], &device);
        let flat = (a, b).flatten();
        assert_eq!(flat.len(), 2);
        assert_eq!(flat[0].shape, vec![2, 3]);
        assert_eq!(flat[1].shape, vec![4]);
        let (a, b) = <(Tensor<2>, Tensor<1>)>::unflatten(flat).expect("same structure");
        assert_eq!(a.dims(), [2, 3]);
        assert_eq!(b.dims(), [4]);
    }

    #[test]
    fn unflatten_rejects_a_wrong_count() {
        let device = Device::flex();
        let flat = (
            Tensor::<1>::ones([1], &device),
            Tensor::<1>::ones([1], &device),
        )
            .flatten();
        assert!(Tensor::<1>::unflatten(flat).is_none());
    }
}
