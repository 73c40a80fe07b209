//! An embedding lookup whose backward sums a table row's gradients in parallel: the function
//! and burn-nn's module.

use burn::module::{Module, Param};
use burn::tensor::{DType, Int, IntDType, Tensor};

use crate::cube;

/// What `burn::tensor::module::embedding` computes: rows `indices` (`[batch, length]`) of
/// `weights` (`[rows, dim]`), `[batch, length, dim]`. On burn's cubecl backends a gather
/// kernel forward and a backward of its own: one cube per token and block of dimensions, where
/// burn-cubecl walks every token in turn on one unit per dimension; each row's gradient is the
/// sum of its tokens' gradients in token order, in `f32`, rounded once to the dtype (burn
/// rounds after every addition). Elsewhere (not a cubecl backend, another dtype, no tokens)
/// this is burn's function.
///
/// The ids are not checked (a graph cannot read them back): an id outside `0..rows` looks up a
/// row of zeros and adds to no row's gradient, where burn's lookup reads outside the table.
///
/// # Panics
///
/// As burn's function: when the shapes do not fit together.
pub fn embedding(weights: Tensor<2>, indices: Tensor<2, Int>) -> Tensor<3> {
    let [batch, length] = indices.dims();
    let [rows, dim] = weights.dims();
    let fused = matches!(weights.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && batch * length > 0
        && rows > 0
        && dim > 0
        && cube::supports_graphs(&weights.device());
    if !fused {
        return burn::tensor::module::embedding(weights, indices);
    }
    let ids = indices.reshape([batch * length]).cast(IntDType::I32);
    match cube::embedding_rows(weights.into_dispatch(), ids.into_dispatch()) {
        Ok(rows) => Tensor::<2>::from_dispatch(rows).reshape([batch, length, dim]),
        Err(inputs) => {
            let (weights, ids) = *inputs;
            burn::tensor::module::embedding(
                Tensor::from_dispatch(weights),
                Tensor::<1, Int>::from_dispatch(ids).reshape([batch, length]),
            )
        }
    }
}

/// burn-nn's `Embedding` (the same field and record; `From` converts both ways; build it with
/// burn-nn's `EmbeddingConfig` and convert) whose forward is [`embedding`].
#[derive(Module, Debug)]
pub struct Embedding {
    /// The table, `[n_embedding, d_model]`.
    pub weight: Param<Tensor<2>>,
}

impl From<burn::nn::Embedding> for Embedding {
    fn from(embedding: burn::nn::Embedding) -> Self {
        Self {
            weight: embedding.weight,
        }
    }
}

impl From<Embedding> for burn::nn::Embedding {
    fn from(embedding: Embedding) -> Self {
        Self {
            weight: embedding.weight,
        }
    }
}

impl Embedding {
    /// The rows of `input` (`[batch, length]` ids), `[batch, length, d_model]`, as burn-nn's
    /// `forward`.
    ///
    /// # Panics
    ///
    /// As burn-nn's: when the shapes do not fit together.
    pub fn forward(&self, input: Tensor<2, Int>) -> Tensor<3> {
        embedding(self.weight.val(), input)
    }
}
