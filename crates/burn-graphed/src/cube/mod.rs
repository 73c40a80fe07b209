//! The engine: capture and replay on burn's cubecl backend (CUDA graphs, or wgpu's software
//! graphs), the device buffers graphs read and write, and the kernels that write them outside
//! the graphs (copies, fused Adam, random draws). The only code of the crate that names cubecl,
//! fusion or the cubecl backend.
//!
//! This file is the front door: code above the engine uses the names below and nothing else.
//! Plain values go down, results come back as return values. Without the `cube` feature a
//! stand-in with the same names answers "unsupported": nothing captures, every fused step is
//! handed back, every generator keeps its counter on the host.

mod tf32;
mod values;

pub(crate) use tf32::{allowed as tf32_allowed, set_allowed as set_tf32_allowed};
pub(crate) use values::{AdamHyper, AttentionSpec, Bucket, ConvSpec, StepCut};

#[cfg(feature = "cube")]
mod adam_multi_op;
#[cfg(feature = "cube")]
mod adam_op;
#[cfg(feature = "cube")]
mod attention_kernels;
#[cfg(feature = "cube")]
mod attention_op;
#[cfg(feature = "cube")]
mod attention_tc_kernels;
#[cfg(feature = "cube")]
mod buffers;
#[cfg(feature = "cube")]
mod capture;
#[cfg(feature = "cube")]
mod conv_kernels;
#[cfg(feature = "cube")]
mod conv_op;
#[cfg(feature = "cube")]
mod copy_op;
#[cfg(feature = "cube")]
mod cross_entropy_op;
#[cfg(feature = "cuda")]
mod cuda_stream;
#[cfg(feature = "cube")]
mod dense;
#[cfg(feature = "cube")]
mod driver;
#[cfg(feature = "cube")]
mod driver_copy;
#[cfg(feature = "cube")]
mod embedding_op;
#[cfg(feature = "cube")]
mod graphs;
#[cfg(feature = "cube")]
mod inspect;
#[cfg(feature = "cube")]
mod kernel_cache;
#[cfg(feature = "cube")]
mod lifecycle;
#[cfg(feature = "cube")]
mod linear_op;
#[cfg(feature = "cube")]
mod node;
#[cfg(feature = "cube")]
mod norm_op;
#[cfg(feature = "cube")]
mod norm_plane_kernel;
#[cfg(feature = "cube")]
mod pack_op;
#[cfg(feature = "cube")]
mod param_claim;
#[cfg(feature = "cube")]
mod progress;
#[cfg(feature = "cube")]
mod random_op;
#[cfg(feature = "cube")]
mod random_state;
#[cfg(feature = "cube")]
mod row_kernels;
#[cfg(feature = "cube")]
mod session;
#[cfg(feature = "cube")]
mod step_clip;
#[cfg(feature = "cube")]
mod step_graph;
#[cfg(feature = "cube")]
mod step_state;
#[cfg(feature = "cube")]
mod step_update_op;
#[cfg(feature = "cube")]
mod validate;
#[cfg(feature = "cube")]
mod vendor_matmul;
#[cfg(feature = "cube")]
mod write_check;

#[cfg(feature = "cube")]
pub(crate) use self::{
    adam_multi_op::Batch as AdamBatch,
    adam_op::step as adam_step,
    attention_op::{attention, attention_packed, supports_dim as attention_supports_dim},
    buffers::check_written,
    capture::{capture_group, capture_inference},
    conv_op::{MAX_TAPS as CONV_MAX_TAPS, conv2d},
    copy_op::collective_buffer,
    cross_entropy_op::cross_entropy_rows,
    embedding_op::embedding_rows,
    graphs::{Admitted, Graphs, ParamHandles},
    inspect::write_graphs_as_dot,
    kernel_cache::{
        enable as enable_kernel_cache, export_tuned, import_tuned,
        location as kernel_cache_location,
    },
    lifecycle::supports_graphs,
    linear_op::{MAX_ROWS as SMALL_LINEAR_ROWS, linear},
    norm_op::norm,
    pack_op::join3,
    random_state::RandomState,
    step_graph::{StepGraph, capture_step},
    step_state::StepState,
    vendor_matmul::available as vendor_matmul_available,
};

// Read by `burn_graphed::testing` only.
#[cfg(all(feature = "cube", feature = "testing"))]
pub(crate) use self::{
    attention_op::{
        hold_tensor_cores_always as hold_attention_tensor_cores,
        packed_calls as packed_attention_calls, tensor_core_calls as attention_tensor_core_calls,
    },
    conv_op::force_tiling as force_conv_tiling,
    driver_copy::copies as driver_copies,
    norm_op::{grad_rows_per_chunk as norm_rows_per_chunk, grad_sum_lanes as norm_sum_lanes},
    progress::set_intervals as set_progress_intervals,
    row_kernels::forwards as fused_norm_forwards,
    vendor_matmul::gemms as vendor_gemms,
};

#[cfg(not(feature = "cube"))]
mod stand_in;
#[cfg(not(feature = "cube"))]
pub(crate) use stand_in::{
    AdamBatch, Admitted, Graphs, ParamHandles, RandomState, StepGraph, StepState, adam_step,
    attention, attention_packed, attention_supports_dim, capture_group, capture_inference,
    capture_step, check_written, collective_buffer, conv2d, cross_entropy_rows, embedding_rows,
    enable_kernel_cache, export_tuned, import_tuned, join3, kernel_cache_location, linear, norm,
    supports_graphs, vendor_matmul_available, write_graphs_as_dot,
};
#[cfg(all(not(feature = "cube"), feature = "testing"))]
pub(crate) use stand_in::{
    attention_tensor_core_calls, driver_copies, force_conv_tiling, fused_norm_forwards,
    hold_attention_tensor_cores, norm_rows_per_chunk, norm_sum_lanes, packed_attention_calls,
    set_progress_intervals, vendor_gemms,
};
/// Without cubecl no convolution is fused (the value is never used).
#[cfg(not(feature = "cube"))]
pub(crate) const CONV_MAX_TAPS: usize = 0;
/// Without cubecl no linear layer is fused (the value is never used).
#[cfg(not(feature = "cube"))]
pub(crate) const SMALL_LINEAR_ROWS: usize = 0;
