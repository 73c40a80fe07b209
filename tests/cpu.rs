//! The CPU suite: burn's wgpu backend on Mesa's software Vulkan (lavapipe), which records and
//! replays real (software) graphs through the same capture lifecycle as CUDA, and Flex, where
//! every call runs eagerly.

mod scenarios;

use burn::prelude::*;

/// The default wgpu adapter: lavapipe on a machine without a GPU. (`.ci/run` sets
/// `XDG_RUNTIME_DIR`, without which lavapipe prints a harmless warning.)
fn wgpu() -> Device {
    Device::wgpu(Default::default())
}

macro_rules! on_devices {
    ($($name:ident => $body:expr;)+) => {
        mod wgpu_suite {
            use super::*;
            $(#[test] fn $name() { let device = wgpu(); let f: fn(&Device) = $body; f(&device); })+
        }
        mod flex_suite {
            use super::*;
            $(#[test] fn $name() { let device = Device::flex(); let f: fn(&Device) = $body; f(&device); })+
        }
    };
}

on_devices! {
    mlp_training_matches_eager => |d| scenarios::mlp_training_matches_eager(d, 5);
    loss_inside_callable_matches_eager => |d| scenarios::loss_inside_callable_matches_eager(d, 4);
    multi_io_matches_eager => |d| scenarios::multi_io_matches_eager(d, 3);
    input_gradient_matches_eager => scenarios::input_gradient_matches_eager;
    unused_input_is_refused => scenarios::unused_input_is_refused;
    eval_mode_falls_back => scenarios::eval_mode_falls_back;
    inner_device_inputs_replay => scenarios::inner_device_inputs_replay;
    shape_change_falls_back_or_errors => scenarios::shape_change_falls_back_or_errors;
    second_call_before_backward_is_eager => scenarios::second_call_before_backward_is_eager;
    harness_catches_faults => scenarios::harness_catches_faults;
    structural_facts => scenarios::facts::structural_facts;
    capture_failure_leaves_device_usable => |d| scenarios::capture_failure_leaves_device_usable(d, false);
    chained_group_matches_eager => |d| scenarios::group::chained_group_matches_eager(d, 3, burn_graphed::OutputPolicy::Copy);
    chained_group_static_outputs_match_eager => |d| scenarios::group::chained_group_matches_eager(d, 2, burn_graphed::OutputPolicy::Static);
    chained_group_shares_buffers_safely => scenarios::group::chained_group_shares_buffers_safely;
    chain_errors => scenarios::group::chain_errors;
    shape_cache_matches_eager => scenarios::robust::shape_cache_matches_eager;
    other_thread_runs_eagerly => scenarios::robust::other_thread_runs_eagerly;
    device_rng_draws_fresh_masks => scenarios::random::device_rng_draws_fresh_masks;
    device_rng_fills_pitched_shapes => scenarios::random::device_rng_fills_pitched_shapes;
    graphed_fused_adam_pitched => |d| scenarios::optim::graphed_fused_adam_pitched(d, scenarios::optim::Kind::PerParam, 3);
    graphed_multi_tensor_adam_pitched => |d| scenarios::optim::graphed_fused_adam_pitched(d, scenarios::optim::Kind::MultiTensor, 3);
    graph_dropout_matches_eager => |d| scenarios::random::graph_dropout_matches_eager(d, 4);
    other_threads_keep_their_draws => |d| scenarios::random::other_threads_keep_their_draws(d, true);
    device_rng_draws_uniform_and_normal => scenarios::random::device_rng_draws_uniform_and_normal;
    graphed_noise_matches_eager => |d| scenarios::random::graphed_noise_matches_eager(d, 4);
    replay_validation_refuses_frozen_values => scenarios::robust::replay_validation_refuses_frozen_values;
    capture_failures_are_recovered => |d| scenarios::recovery::capture_failures_are_recovered(d, false);
    backward_twice_matches_eager => scenarios::recovery::backward_twice_matches_eager;
    dropping_the_model_before_backward => scenarios::recovery::dropping_the_model_before_backward;
    fused_adam_matches_adam => scenarios::optim::fused_adam_matches_adam;
    graphed_fused_adam_matches_eager => |d| scenarios::optim::graphed_fused_adam_matches_eager(d, 4);
    fused_adam_keeps_snapshots => |d| scenarios::optim::fused_adam_keeps_snapshots(d, scenarios::optim::Kind::PerParam);
    multi_tensor_adam_keeps_snapshots => |d| scenarios::optim::fused_adam_keeps_snapshots(d, scenarios::optim::Kind::MultiTensor);
    multi_tensor_adam_matches_fused_adam => scenarios::optim::multi_tensor_adam_matches_fused_adam;
    multi_tensor_adam_mixes_step_counts => scenarios::optim::multi_tensor_adam_mixes_step_counts;
    graphed_multi_tensor_adam_matches_eager => |d| scenarios::optim::graphed_multi_tensor_adam_matches_eager(d, 4);
    fused_adam_records_load_into_adam => scenarios::optim::fused_adam_records_load_into_adam;
    fused_adam_leaves_shared_moments_alone => |d| scenarios::optim::fused_adam_leaves_shared_moments_alone(d, scenarios::optim::Kind::PerParam);
    multi_tensor_adam_records_load_into_adam => scenarios::optim::multi_tensor_adam_records_load_into_adam;
    multi_tensor_adam_leaves_shared_moments_alone => |d| scenarios::optim::fused_adam_leaves_shared_moments_alone(d, scenarios::optim::Kind::MultiTensor);
    guarded_training_matches_eager => |d| scenarios::guarded::guarded_training_matches_eager(d, 4, false);
    guarded_multi_tensor_training_matches_eager => |d| scenarios::guarded::guarded_training_matches_eager(d, 4, true);
    guarded_hand_outs_keep_their_values => scenarios::guarded::guarded_hand_outs_keep_their_values;
}

/// The property test on wgpu; few cases, because lavapipe compiles every new shape's kernels
/// in software (Flex would only compare eager with eager).
#[test]
fn wgpu_graphed_training_equals_eager() {
    scenarios::prop::graphed_training_equals_eager(&wgpu(), 4);
}

/// Graphs on wgpu, an input on Flex (and the other way round): a typed error, nothing runs.
#[test]
fn input_on_another_device_is_refused() {
    scenarios::robust::input_on_another_device_is_refused(&wgpu(), &Device::flex());
    scenarios::robust::input_on_another_device_is_refused(&Device::flex(), &wgpu());
}

#[test]
fn wgpu_records_graphs() {
    assert!(
        scenarios::supports_graphs(&wgpu()),
        "wgpu should capture (software graphs)"
    );
}

#[test]
fn flex_runs_eagerly() {
    assert!(!scenarios::supports_graphs(&Device::flex()));
}
