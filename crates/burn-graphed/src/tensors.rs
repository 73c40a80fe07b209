//! Inputs and outputs of a graphed callable: a tensor or a tuple of tensors of any kind
//! (float, int, bool), flattened to a list of rank-erased tensors and back.

use burn::backend::DispatchTensor;
use burn::tensor::{Bool, DType, Device, Float, Int, Tensor};

/// The kind of a tensor's elements, as burn's `Float`, `Int` and `Bool` tensor kinds. Only float
/// tensors carry gradients: int and bool tensors are data (token ids, targets, masks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElementKind {
    /// Floating point (and quantized) elements.
    Float,
    /// Signed or unsigned integers.
    Int,
    /// Booleans.
    Bool,
}

impl ElementKind {
    /// The kind of `dtype`'s elements.
    pub fn of(dtype: DType) -> Self {
        if dtype.is_bool() {
            Self::Bool
        } else if dtype.is_int() || dtype.is_uint() {
            Self::Int
        } else {
            Self::Float
        }
    }
}

/// Evaluates `$body` with `$kind` the burn tensor kind (`Float`, `Int` or `Bool`) of `$dtype`'s
/// elements: the one place where a rank-erased tensor of unknown kind meets burn's typed API.
macro_rules! with_kind {
    ($dtype:expr, $kind:ident => $body:expr) => {
        match $crate::tensors::ElementKind::of($dtype) {
            $crate::tensors::ElementKind::Float => {
                type $kind = burn::tensor::Float;
                $body
            }
            $crate::tensors::ElementKind::Int => {
                type $kind = burn::tensor::Int;
                $body
            }
            $crate::tensors::ElementKind::Bool => {
                type $kind = burn::tensor::Bool;
                $body
            }
        }
    };
}
#[cfg_attr(not(feature = "cube"), allow(unused_imports))] // the engine's, with `cube`
pub(crate) use with_kind;

/// The tensor kinds a graphed callable takes and returns: burn's `Float`, `Int` and `Bool`.
pub trait GraphKind: burn::tensor::kind::Basic + sealed::Sealed {
    /// The kind of the elements.
    const ELEMENTS: ElementKind;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for burn::tensor::Float {}
    impl Sealed for burn::tensor::Int {}
    impl Sealed for burn::tensor::Bool {}
}

impl GraphKind for Float {
    const ELEMENTS: ElementKind = ElementKind::Float;
}
impl GraphKind for Int {
    const ELEMENTS: ElementKind = ElementKind::Int;
}
impl GraphKind for Bool {
    const ELEMENTS: ElementKind = ElementKind::Bool;
}

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
    /// Whether it needs a gradient: a float leaf that requires grad, or a float tensor computed
    /// from one (autodiff tracks it). burn's `is_require_grad` is false for the latter, but a
    /// graphed call must still pass the gradient on to it, or the layers before it would get
    /// none. Never for int and bool tensors.
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

impl TensorSpec {
    /// Kind, dtype, shape and `require_grad`, as an error names them.
    pub(crate) fn describe(&self) -> String {
        format!(
            "{:?} {:?} {:?}{}",
            ElementKind::of(self.dtype),
            self.dtype,
            self.shape,
            if self.require_grad {
                " require_grad"
            } else {
                ""
            }
        )
    }
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

    /// The kind of its elements.
    pub fn kind(&self) -> ElementKind {
        ElementKind::of(self.dtype)
    }

    /// Whether its elements are floats (the only tensors that carry gradients).
    #[cfg_attr(not(feature = "cube"), allow(dead_code))] // the engine's, with `cube`
    pub(crate) fn is_float(&self) -> bool {
        self.kind() == ElementKind::Float
    }

    pub(crate) fn from_tensor<const D: usize, K: GraphKind>(tensor: Tensor<D, K>) -> Self {
        let shape = tensor.shape().to_vec();
        let dtype = tensor.dtype();
        let device = tensor.device();
        let tensor = tensor.into_dispatch();
        let require_grad = ElementKind::of(dtype) == ElementKind::Float && {
            let float = Tensor::<D>::from_dispatch(tensor.clone());
            float.is_require_grad() || float.is_tracked()
        };
        Self {
            shape,
            dtype,
            device,
            require_grad,
            tensor,
        }
    }

    /// The tensor as a `Tensor<D, K>`, or `None` when its elements are of another kind.
    fn into_typed<const D: usize, K: GraphKind>(self) -> Option<Tensor<D, K>> {
        (self.kind() == K::ELEMENTS).then(|| Tensor::from_dispatch(self.tensor))
    }

    /// Why its values cannot be read back, if they cannot (the work that made it failed on the
    /// device); reads the values (a host sync).
    pub(crate) fn read_back_error(&self) -> Option<String> {
        with_kind!(self.dtype, K => Tensor::<1, K>::from_dispatch(self.tensor.clone())
            .inner()
            .try_into_data()
            .err()
            .map(|error| error.to_string()))
    }
}

/// A group of tensors that a graphed callable takes or returns: `Tensor<D, K>` of any kind
/// (`Float`, `Int`, `Bool`), tuples of up to four groups, or `Vec<Tensor<D, K>>` (whose length
/// is fixed at capture). Int and bool tensors never carry gradients.
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

/// A tensor of another kind than `K` in its place does not fit (`None`).
impl<const D: usize, K: GraphKind> TensorGroup for Tensor<D, K> {
    fn flatten_into(self, out: &mut Vec<FlatTensor>) {
        out.push(FlatTensor::from_tensor(self));
    }

    fn unflatten_from(
        tensors: &mut std::vec::IntoIter<FlatTensor>,
        _len_hint: usize,
    ) -> Option<Self> {
        tensors.next()?.into_typed()
    }
}

/// A vector takes every remaining tensor, so it must come last in a tuple; one of another kind
/// than `K` does not fit.
impl<const D: usize, K: GraphKind> TensorGroup for Vec<Tensor<D, K>> {
    fn flatten_into(self, out: &mut Vec<FlatTensor>) {
        out.extend(self.into_iter().map(FlatTensor::from_tensor));
    }

    fn unflatten_from(
        tensors: &mut std::vec::IntoIter<FlatTensor>,
        _len_hint: usize,
    ) -> Option<Self> {
        tensors.by_ref().map(FlatTensor::into_typed).collect()
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
    fn int_and_bool_tensors_round_trip_and_never_need_grad() {
        let device = Device::flex().autodiff();
        let ids = Tensor::<2, Int>::ones([2, 3], &device);
        let mask = Tensor::<3, Bool>::from_data([[[true, false]]], &device);
        let x = Tensor::<1>::ones([4], &device).require_grad();
        let flat = (ids, mask, x).flatten();
        let kinds: Vec<_> = flat.iter().map(FlatTensor::kind).collect();
        assert_eq!(
            kinds,
            [ElementKind::Int, ElementKind::Bool, ElementKind::Float]
        );
        let grads: Vec<_> = flat.iter().map(FlatTensor::require_grad).collect();
        assert_eq!(grads, [false, false, true]);
        let (ids, mask, x) =
            <(Tensor<2, Int>, Tensor<3, Bool>, Tensor<1>)>::unflatten(flat).expect("same kinds");
        assert_eq!(ids.dims(), [2, 3]);
        assert_eq!(mask.dims(), [1, 1, 2]);
        assert_eq!(x.dims(), [4]);
    }

    #[test]
    fn a_tensor_of_another_kind_does_not_fit() {
        let device = Device::flex();
        let float = TensorGroup::flatten(Tensor::<2>::ones([2, 3], &device));
        assert!(Tensor::<2, Int>::unflatten(float.clone()).is_none());
        assert!(Vec::<Tensor<2, Bool>>::unflatten(float.clone()).is_none());
        assert!(Tensor::<2>::unflatten(float).is_some());
        let ids = TensorGroup::flatten(Tensor::<2, Int>::ones([2, 3], &device));
        assert!(Tensor::<2>::unflatten(ids).is_none());
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
