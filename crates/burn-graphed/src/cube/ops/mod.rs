//! The fused layers' operations: each a lazy fusion operation with its backward (attention,
//! convolution, norms, linear, embedding, cross-entropy, the packed projections), and cuBLASLt's
//! products.

pub(super) mod attention_op;
pub(super) mod conv_op;
pub(super) mod conv_tiling;
pub(super) mod cross_entropy_op;
pub(super) mod embedding_op;
pub(super) mod linear_op;
pub(super) mod norm_op;
pub(super) mod pack_op;
pub(super) mod vendor_matmul;
