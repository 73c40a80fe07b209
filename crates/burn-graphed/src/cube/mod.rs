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
pub(crate) use values::{AttentionSpec, Bucket, BucketLayout, ConvSpec, StepCut};

#[cfg(feature = "cube")]
mod buffers;
#[cfg(feature = "cube")]
mod collective;
#[cfg(feature = "cube")]
mod copy_op;
#[cfg(feature = "cuda")]
mod cuda_stream;
#[cfg(feature = "cube")]
mod dense;
#[cfg(feature = "cube")]
mod driver_copy;
#[cfg(feature = "cube")]
mod graph;
#[cfg(feature = "cube")]
mod kernel_cache;
#[cfg(feature = "cube")]
mod kernels;
#[cfg(feature = "cube")]
mod ops;
#[cfg(feature = "cuda")]
mod side_stream;
#[cfg(feature = "cube")]
mod step;
#[cfg(feature = "cube")]
mod update;

#[cfg(feature = "cube")]
pub(crate) use self::{
    buffers::check_written,
    collective::{
        UNIQUE_ID_BYTES as NCCL_ID_BYTES, end as nccl_end, is_cuda, join as nccl_join,
        mean as nccl_mean, take_failure as nccl_failure, unique_id as nccl_unique_id,
    },
    copy_op::collective_buffer,
    graph::capture::{capture_group, capture_inference},
    graph::graphs::{Admitted, Graphs, ParamHandles},
    graph::inspect::write_graphs_as_dot,
    graph::lifecycle::supports_graphs,
    graph::progress::report_while,
    graph::random_state::RandomState,
    kernel_cache::{
        enable as enable_kernel_cache, export_tuned, import_tuned,
        location as kernel_cache_location,
    },
    ops::attention_op::{attention, attention_packed, supports_dim as attention_supports_dim},
    ops::conv_op::{MAX_TAPS as CONV_MAX_TAPS, conv2d},
    ops::cross_entropy_op::cross_entropy_rows,
    ops::embedding_op::embedding_rows,
    ops::linear_op::{MAX_ROWS as SMALL_LINEAR_ROWS, linear},
    ops::norm_op::norm,
    ops::pack_op::{join3, join3_biased},
    ops::vendor_matmul::available as vendor_matmul_available,
    step::step_graph::{StepGraph, capture_step},
    step::step_state::StepState,
    update::adam_step::{Batch as AdamBatch, step as adam_step},
};

// Read by `burn_graphed::testing` only.
#[cfg(all(feature = "cube", feature = "testing"))]
pub(crate) use self::{
    collective::{
        inject_error as nccl_inject_error, reductions as nccl_reductions,
        set_abort as nccl_set_abort, set_side_stream as nccl_set_side_stream,
    },
    driver_copy::copies as driver_copies,
    graph::driver::set_global_mode as set_capture_global_mode,
    graph::progress::set_intervals as set_progress_intervals,
    kernels::row_kernels::forwards as fused_norm_forwards,
    ops::attention_op::{
        force_blocks as force_attention_blocks, packed_calls as packed_attention_calls,
        tensor_core_calls as attention_tensor_core_calls,
    },
    ops::conv_tiling::force_tiling as force_conv_tiling,
    ops::norm_op::{grad_rows_per_chunk as norm_rows_per_chunk, grad_sum_lanes as norm_sum_lanes},
    ops::vendor_matmul::gemms as vendor_gemms,
    step::overlap::{
        set_caps as set_overlap_caps, set_enabled as set_overlap, starts as overlap_starts,
    },
};

#[cfg(not(feature = "cube"))]
mod stand_in;
#[cfg(not(feature = "cube"))]
pub(crate) use stand_in::{
    AdamBatch, Admitted, Graphs, NCCL_ID_BYTES, ParamHandles, RandomState, StepGraph, StepState,
    adam_step, attention, attention_packed, attention_supports_dim, capture_group,
    capture_inference, capture_step, check_written, collective_buffer, conv2d, cross_entropy_rows,
    embedding_rows, enable_kernel_cache, export_tuned, import_tuned, is_cuda, join3, join3_biased,
    kernel_cache_location, linear, nccl_end, nccl_failure, nccl_join, nccl_mean, nccl_unique_id,
    norm, report_while, supports_graphs, vendor_matmul_available, write_graphs_as_dot,
};
#[cfg(all(not(feature = "cube"), feature = "testing"))]
pub(crate) use stand_in::{
    attention_tensor_core_calls, driver_copies, force_attention_blocks, force_conv_tiling,
    fused_norm_forwards, nccl_inject_error, nccl_reductions, nccl_set_abort, nccl_set_side_stream,
    norm_rows_per_chunk, norm_sum_lanes, overlap_starts, packed_attention_calls,
    set_capture_global_mode, set_overlap, set_overlap_caps, set_progress_intervals, vendor_gemms,
};
/// Without cubecl no convolution is fused (the value is never used).
#[cfg(not(feature = "cube"))]
pub(crate) const CONV_MAX_TAPS: usize = 0;
/// Without cubecl no linear layer is fused (the value is never used).
#[cfg(not(feature = "cube"))]
pub(crate) const SMALL_LINEAR_ROWS: usize = 0;
