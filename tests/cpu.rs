//! The CPU suite: burn's wgpu backend on Mesa's software Vulkan (lavapipe), which records and
//! replays real (software) graphs through the same capture lifecycle as CUDA, and Flex, where
//! every call runs eagerly.

mod scenarios;

use burn::prelude::*;

/// The default wgpu adapter: lavapipe on a machine without a GPU, with the suite's kernel picks
/// imported (`scenarios::picks`). (`.ci/run` sets `XDG_RUNTIME_DIR`, without which lavapipe
/// prints a harmless warning.)
fn wgpu() -> Device {
    scenarios::picks::wgpu()
}

/// `NAME => SCENARIO;` makes the tests `wgpu_suite::NAME` and `flex_suite::NAME`.
/// `NAME => SCENARIO, needs_graphs: "WHY";` is a scenario that checks only what graphs do
/// (it calls `scenarios::require_graphs`, and would fail on Flex): its Flex test is
/// `#[ignore = "WHY"]`, which libtest and the runners report as ignored, never as passed.
/// (The reason is a plain literal: `concat!` there compiles, but libtest then drops it.)
macro_rules! on_devices {
    ($($(#[$attr:meta])* $name:ident => $body:expr $(, needs_graphs: $why:literal)?;)+) => {
        mod wgpu_suite {
            use super::*;
            $($(#[$attr])* #[test] fn $name() { let device = wgpu(); let f: fn(&Device) = $body; f(&device); })+
        }
        mod flex_suite {
            use super::*;
            $($(#[$attr])* $(#[ignore = $why])? #[test] fn $name() { let device = Device::flex(); let f: fn(&Device) = $body; f(&device); })+
        }
    };
}

on_devices! {
    layer_norm_matches_exact_f32 => |d| scenarios::fused_norm::layer_norm_matches_exact(d, burn::tensor::FloatDType::F32);
    layer_norm_matches_exact_f16 => |d| scenarios::fused_norm::layer_norm_matches_exact(d, burn::tensor::FloatDType::F16);
    layer_norm_matches_exact_bf16 => |d| scenarios::fused_norm::layer_norm_matches_exact(d, burn::tensor::FloatDType::BF16);
    layer_norm_graphed_matches_eager => scenarios::fused_norm::layer_norm_graphed_matches_eager;
    rms_norm_matches_exact_f32 => |d| scenarios::fused_norm::rms_norm_matches_exact(d, burn::tensor::FloatDType::F32);
    rms_norm_matches_exact_bf16 => |d| scenarios::fused_norm::rms_norm_matches_exact(d, burn::tensor::FloatDType::BF16);
    layer_norm_checkpoints_load_both_ways => scenarios::fused_norm::layer_norm_checkpoints_load_both_ways;
    encoder_matches_burn_nn => scenarios::fused_attention::encoder_matches_burn_nn;
    attention_matches_exact_f32 => |d| scenarios::fused_attention::attention_matches_exact(d, burn::tensor::FloatDType::F32);
    attention_matches_exact_f16 => |d| scenarios::fused_attention::attention_matches_exact(d, burn::tensor::FloatDType::F16);
    attention_matches_exact_bf16 => |d| scenarios::fused_attention::attention_matches_exact(d, burn::tensor::FloatDType::BF16);
    mha_matches_burn_nn => scenarios::fused_attention::mha_matches_burn_nn;
    packed_attention_matches_separate_f32 => |d| scenarios::fused_attention::packed_attention_matches_separate(d, burn::tensor::FloatDType::F32, false), needs_graphs: "the packed attention kernels are cubecl kernels";
    packed_attention_matches_separate_f16 => |d| scenarios::fused_attention::packed_attention_matches_separate(d, burn::tensor::FloatDType::F16, false), needs_graphs: "the packed attention kernels are cubecl kernels";
    conv_matches_exact_f32 => |d| scenarios::fused_conv::conv_matches_exact(d, burn::tensor::FloatDType::F32);
    conv_matches_exact_f16 => |d| scenarios::fused_conv::conv_matches_exact(d, burn::tensor::FloatDType::F16);
    conv_matches_exact_bf16 => |d| scenarios::fused_conv::conv_matches_exact(d, burn::tensor::FloatDType::BF16);
    conv_matches_burn_nn => scenarios::fused_conv::conv_matches_burn_nn;
    conv_graphed_matches_eager => scenarios::fused_conv::conv_graphed_matches_eager;
    conv_records_load_both_ways => scenarios::fused_conv::conv_records_load_both_ways;
    global_pool_after_elementwise_matches_exact => scenarios::global_pool::global_pool_after_elementwise_matches_exact;
    embedding_matches_exact_f32 => |d| scenarios::fused_embedding::embedding_matches_exact(d, burn::tensor::FloatDType::F32);
    embedding_matches_exact_f16 => |d| scenarios::fused_embedding::embedding_matches_exact(d, burn::tensor::FloatDType::F16);
    embedding_matches_exact_bf16 => |d| scenarios::fused_embedding::embedding_matches_exact(d, burn::tensor::FloatDType::BF16);
    embedding_graphed_matches_eager => scenarios::fused_embedding::embedding_graphed_matches_eager;
    embedding_records_load_both_ways => scenarios::fused_embedding::embedding_records_load_both_ways;
    linear_matches_exact_f32 => |d| scenarios::fused_linear::linear_matches_exact(d, burn::tensor::FloatDType::F32);
    linear_matches_exact_f16 => |d| scenarios::fused_linear::linear_matches_exact(d, burn::tensor::FloatDType::F16);
    linear_matches_exact_bf16 => |d| scenarios::fused_linear::linear_matches_exact(d, burn::tensor::FloatDType::BF16);
    linear_graphed_matches_eager => scenarios::fused_linear::linear_graphed_matches_eager;
    linear_add_matches_exact_f32 => |d| scenarios::fused_linear::linear_add_matches_exact(d, burn::tensor::FloatDType::F32);
    linear_add_matches_exact_f16 => |d| scenarios::fused_linear::linear_add_matches_exact(d, burn::tensor::FloatDType::F16);
    linear_add_matches_exact_bf16 => |d| scenarios::fused_linear::linear_add_matches_exact(d, burn::tensor::FloatDType::BF16);
    linear_relu_matches_exact_f32 => |d| scenarios::fused_linear::linear_relu_matches_exact(d, burn::tensor::FloatDType::F32);
    linear_relu_matches_exact_f16 => |d| scenarios::fused_linear::linear_relu_matches_exact(d, burn::tensor::FloatDType::F16);
    linear_relu_matches_exact_bf16 => |d| scenarios::fused_linear::linear_relu_matches_exact(d, burn::tensor::FloatDType::BF16);
    cross_entropy_matches_exact_f32 => |d| scenarios::fused_loss::cross_entropy_matches_exact(d, burn::tensor::FloatDType::F32);
    cross_entropy_matches_exact_f16 => |d| scenarios::fused_loss::cross_entropy_matches_exact(d, burn::tensor::FloatDType::F16);
    cross_entropy_matches_exact_bf16 => |d| scenarios::fused_loss::cross_entropy_matches_exact(d, burn::tensor::FloatDType::BF16);
    cross_entropy_other_forms_are_burn_nn => scenarios::fused_loss::cross_entropy_other_forms_are_burn_nn;
    cross_entropy_graphed_matches_eager => scenarios::fused_loss::cross_entropy_graphed_matches_eager;
    fused_model_whole_step_matches_eager => scenarios::fused_loss::fused_model_whole_step_matches_eager;
    mlp_training_matches_eager => |d| scenarios::mlp_training_matches_eager(d, 5);
    graphs_say_what_they_hold => |d| scenarios::inspect::graphs_say_what_they_hold(d, false), needs_graphs: "Flex captures no graphs: there is nothing to list";
    loss_inside_callable_matches_eager => |d| scenarios::loss_inside_callable_matches_eager(d, 4);
    multi_io_matches_eager => |d| scenarios::multi_io_matches_eager(d, 3);
    input_gradient_matches_eager => scenarios::input_gradient_matches_eager;
    unused_input_is_refused => scenarios::unused_input_is_refused, needs_graphs: "Flex cannot capture: an unused input is found in the recorded backward (a backward run at construction only to look would be a training step's work)";
    too_many_parents_is_refused => |d| scenarios::too_many_parents_is_refused(d, false), needs_graphs: "Flex cannot capture: the limit is on the parents of a graphed call's autodiff node, which eager calls do not make";
    eval_calls_replay_inference_graphs => scenarios::eval_calls_replay_inference_graphs;
    col_layout_weights_match_eager => scenarios::col_layout_weights_match_eager;
    inference_buckets_replay => scenarios::inference_buckets_replay;
    data_parallel_replicas_match_one_model => |d| scenarios::data_parallel::replicas_match_one_model(&[d.clone(), d.clone()], burn_graphed::Collective::Host);
    data_parallel_example_trains => |d| scenarios::data_parallel::example_trains_equal_replicas(&[d.clone(), d.clone()], burn_graphed::Collective::Host);
    data_parallel_mismatched_ranks_fail => scenarios::data_parallel::mismatched_ranks_fail_on_every_rank;
    data_parallel_failed_capture_fails_every_rank => |d| scenarios::data_parallel::failed_capture_fails_every_rank(&[d.clone(), d.clone()], burn_graphed::Collective::Host), needs_graphs: "Flex cannot capture: a rank's failed capture";
    data_parallel_whole_steps_match_one_model => |d| scenarios::data_parallel::whole_steps_match_one_model(&[d.clone(), d.clone()], burn_graphed::Collective::Host);
    data_parallel_whole_steps_capture_new_shapes_together => |d| scenarios::data_parallel::whole_steps_capture_new_shapes_together(&[d.clone(), d.clone()], burn_graphed::Collective::Host);
    data_parallel_whole_steps_four_ranks_match_one_model => |d| scenarios::data_parallel::whole_steps_match_one_model(&[d.clone(), d.clone(), d.clone(), d.clone()], burn_graphed::Collective::Host);
    data_parallel_unwritten_gradients_fail_every_rank => |d| scenarios::data_parallel::unwritten_gradients_fail_every_rank(&[d.clone(), d.clone()], burn_graphed::Collective::Host), needs_graphs: "Flex cannot capture: tensors the device never wrote exist on cubecl's backends only";
    data_parallel_whole_step_ranks_that_differ_fail_together => |d| scenarios::data_parallel::whole_step_ranks_that_differ_fail_together(&[d.clone(), d.clone()], burn_graphed::Collective::Host);
    inference_follows_fused_training_copy => |d| scenarios::inference::inference_follows_fused_training(d, burn_graphed::OutputPolicy::Copy);
    inference_follows_fused_training_static => |d| scenarios::inference::inference_follows_fused_training(d, burn_graphed::OutputPolicy::Static);
    inference_follows_fused_training_guarded => |d| scenarios::inference::inference_follows_fused_training(d, burn_graphed::OutputPolicy::Guarded);
    unwritten_input_inference_call_recovers => scenarios::inference::unwritten_input_inference_call_recovers, needs_graphs: "Flex cannot capture: tensors the device never wrote exist on cubecl's backends only";
    input_copies_run_as_cubecl_kernels => |d| scenarios::inference::input_copies_run_as_driver_copies(d, false), needs_graphs: "Flex cannot capture: nothing is copied into a graph";
    inner_device_inputs_replay => scenarios::inner_device_inputs_replay;
    shape_change_falls_back_or_errors => scenarios::shape_change_falls_back_or_errors;
    second_call_before_backward_is_eager => scenarios::second_call_before_backward_is_eager;
    harness_catches_faults => scenarios::harness_catches_faults, needs_graphs: "Flex cannot capture: the injected faults skip copies into graphs";
    lazy_reads_see_later_writes => scenarios::reads::lazy_reads_see_later_writes;
    structural_facts => scenarios::facts::structural_facts;
    capture_failure_leaves_device_usable => |d| scenarios::capture_failure_leaves_device_usable(d, false), needs_graphs: "Flex cannot capture: a capture that fails";
    chained_group_matches_eager => |d| scenarios::group::chained_group_matches_eager(d, 3, burn_graphed::OutputPolicy::Copy);
    chained_group_static_outputs_match_eager => |d| scenarios::group::chained_group_matches_eager(d, 2, burn_graphed::OutputPolicy::Static);
    chained_group_shares_buffers_safely => scenarios::group::chained_group_shares_buffers_safely, needs_graphs: "Flex cannot capture: the static buffers chained graphs share";
    chain_errors => scenarios::group::chain_errors;
    shape_cache_matches_eager => scenarios::robust::shape_cache_matches_eager;
    other_thread_runs_eagerly => scenarios::robust::other_thread_runs_eagerly, needs_graphs: "Flex cannot capture: graphs replay on the capturing thread only (without them every call runs eagerly on any thread)";
    prepare_captures_ahead => scenarios::robust::prepare_captures_ahead;
    device_rng_draws_fresh_masks => scenarios::random::device_rng_draws_fresh_masks;
    device_rng_fills_pitched_shapes => scenarios::random::device_rng_fills_pitched_shapes;
    graphed_fused_adam_pitched => |d| scenarios::optim::graphed_fused_adam_pitched(d, scenarios::optim::Kind::PerParam, 3);
    graphed_multi_tensor_adam_pitched => |d| scenarios::optim::graphed_fused_adam_pitched(d, scenarios::optim::Kind::MultiTensor, 3);
    graph_dropout_matches_eager => |d| scenarios::random::graph_dropout_matches_eager(d, 4);
    other_threads_keep_their_draws => |d| scenarios::random::other_threads_keep_their_draws(d, true), needs_graphs: "Flex cannot capture: other threads' draws while captures run";
    device_rng_draws_uniform_and_normal => scenarios::random::device_rng_draws_uniform_and_normal;
    graphed_noise_matches_eager => |d| scenarios::random::graphed_noise_matches_eager(d, 4);
    replay_validation_refuses_frozen_values => scenarios::robust::replay_validation_refuses_frozen_values, needs_graphs: "Flex cannot capture: validation of a captured graph's first replay";
    capture_failures_are_recovered => |d| scenarios::recovery::capture_failures_are_recovered(d, false), needs_graphs: "Flex cannot capture: captures that fail";
    unwritten_tensors_fail_capture => scenarios::recovery::unwritten_tensors_fail_capture, needs_graphs: "Flex cannot capture: tensors the device never wrote exist on cubecl's backends only";
    unwritten_input_call_recovers => |d| scenarios::recovery::unwritten_input_call_recovers(d, scenarios::copy_config()), needs_graphs: "Flex cannot capture: tensors the device never wrote exist on cubecl's backends only";
    unwritten_input_call_recovers_guarded => |d| scenarios::recovery::unwritten_input_call_recovers(d, burn_graphed::GraphedConfig::new()), needs_graphs: "Flex cannot capture: tensors the device never wrote exist on cubecl's backends only";
    backward_twice_matches_eager => scenarios::recovery::backward_twice_matches_eager;
    dropping_the_model_before_backward => scenarios::recovery::dropping_the_model_before_backward;
    eager_adams_are_burns_f32 => |d| scenarios::optim::eager_adams_are_burns_in(d, burn::tensor::FloatDType::F32);
    eager_adams_are_burns_f16 => |d| scenarios::optim::eager_adams_are_burns_in(d, burn::tensor::FloatDType::F16);
    graphed_fused_adam_matches_eager => |d| scenarios::optim::graphed_fused_adam_matches_eager(d, 4);
    fused_adam_keeps_snapshots => |d| scenarios::optim::fused_adam_keeps_snapshots(d, scenarios::optim::Kind::PerParam);
    multi_tensor_adam_keeps_snapshots => |d| scenarios::optim::fused_adam_keeps_snapshots(d, scenarios::optim::Kind::MultiTensor);
    multi_tensor_adam_matches_fused_adam => scenarios::optim::multi_tensor_adam_matches_fused_adam;
    multi_tensor_adam_mixes_step_counts => scenarios::optim::multi_tensor_adam_mixes_step_counts;
    graphed_multi_tensor_adam_matches_eager => |d| scenarios::optim::graphed_multi_tensor_adam_matches_eager(d, 4);
    fused_adam_records_load_into_adam => scenarios::optim::fused_adam_records_load_into_adam;
    fused_adam_leaves_shared_moments_alone => |d| scenarios::optim::fused_adam_leaves_shared_moments_alone(d, scenarios::optim::Kind::PerParam);
    multi_tensor_adam_records_load_into_adam => scenarios::optim::multi_tensor_adam_records_load_into_adam;
    fused_adam_unwritten_gradient_is_refused => |d| scenarios::optim::unwritten_gradient_step_is_refused(d, scenarios::optim::Kind::PerParam), needs_graphs: "Flex cannot capture: tensors the device never wrote exist on cubecl's backends only";
    multi_tensor_adam_unwritten_gradient_is_refused => |d| scenarios::optim::unwritten_gradient_step_is_refused(d, scenarios::optim::Kind::MultiTensor), needs_graphs: "Flex cannot capture: tensors the device never wrote exist on cubecl's backends only";
    multi_tensor_adam_leaves_shared_moments_alone => |d| scenarios::optim::fused_adam_leaves_shared_moments_alone(d, scenarios::optim::Kind::MultiTensor);
    guarded_training_matches_eager => |d| scenarios::guarded::guarded_training_matches_eager(d, 4, false);
    guarded_multi_tensor_training_matches_eager => |d| scenarios::guarded::guarded_training_matches_eager(d, 4, true);
    guarded_hand_outs_keep_their_values => scenarios::guarded::guarded_hand_outs_keep_their_values;
    whole_step_adam_matches_eager => |d| scenarios::whole_step::whole_step_matches_eager(d, scenarios::whole_step::adam(), None, 1, &[4], 4);
    whole_step_adamw_clipped_matches_eager => |d| scenarios::whole_step::whole_step_matches_eager(d, scenarios::whole_step::adamw(), Some(burn_graphed::Clipping::Norm(0.05)), 1, &[4], 4);
    whole_step_sgd_accumulated_matches_eager => |d| scenarios::whole_step::whole_step_matches_eager(d, scenarios::whole_step::sgd_momentum(), Some(burn_graphed::Clipping::Value(0.02)), 2, &[4], 4);
    whole_step_global_norm_batch_sizes_match_eager => |d| scenarios::whole_step::whole_step_matches_eager(d, scenarios::whole_step::adam(), Some(burn_graphed::Clipping::GlobalNorm(0.1)), 1, &[4, 3], 4);
    whole_step_update_is_burns_f32 => |d| for optimizer in [scenarios::whole_step::adam(), scenarios::whole_step::adamw(), scenarios::whole_step::sgd_momentum()] { scenarios::whole_step::whole_step_update_is_burns_in(d, burn::tensor::FloatDType::F32, optimizer, 4) };
    whole_step_negative_controls => scenarios::whole_step::whole_step_negative_controls, needs_graphs: "Flex cannot capture: the injected faults act on the recorded update";
    token_model_matches_eager => |d| scenarios::tokens::token_model_matches_eager(d, 20);
    token_whole_step_matches_eager => |d| scenarios::tokens::token_whole_step_matches_eager(d, 6);
    token_facts => scenarios::tokens::token_facts;
    token_group_passes_a_mask_on => scenarios::tokens::token_group_passes_a_mask_on;
    whole_step_capture_changes_nothing => scenarios::whole_step::whole_step_capture_changes_nothing;
    whole_step_dropout_matches_eager => |d| scenarios::whole_step::whole_step_dropout_matches_eager(d, 4);
    whole_step_bad_input => scenarios::whole_step::whole_step_bad_input;
    whole_step_host_read_is_refused => scenarios::whole_step::whole_step_host_read_is_refused, needs_graphs: "Flex cannot capture: a host read inside a recording";
    whole_step_adam_records_round_trip => |d| scenarios::whole_step::whole_step_records_round_trip(d, scenarios::whole_step::adam());
    whole_step_sgd_records_round_trip => |d| scenarios::whole_step::whole_step_records_round_trip(d, scenarios::whole_step::sgd_momentum());
    default_loop_replays_every_step => |d| scenarios::guarded::default_loop_replays_every_step(d, 4);
    batch_norm_is_refused => scenarios::batch_norm::batch_norm_is_refused;
    dtype_change_falls_back_or_errors => scenarios::robust::dtype_change_falls_back_or_errors;
    changed_parameters_are_refused => scenarios::robust::changed_parameters_are_refused;
    require_graphs_refuses_a_backend_without_graphs => scenarios::robust::require_graphs_refuses_a_backend_without_graphs;
    panicking_forward_is_recovered => scenarios::recovery::panicking_forward_is_recovered, needs_graphs: "Flex cannot capture: a panic inside a capture's warm-ups, recording and validation";
    panicking_loss_is_recovered => scenarios::recovery::panicking_loss_is_recovered, needs_graphs: "Flex cannot capture: a panic inside a whole step's warm-ups and recording";
    group_errors_name_the_callable => scenarios::robust::group_errors_name_the_callable, needs_graphs: "Flex cannot capture: an unused input is found in the recorded backward";
    fused_adam_stepping_a_clone_matches_eager => scenarios::robust::fused_adam_stepping_a_clone_matches_eager, needs_graphs: "Flex cannot capture: the copies into the graphs' parameter buffers";
    controls_training_sgd => |d| scenarios::controls::training_controls(d, scenarios::controls::Regime::Sgd);
    controls_training_adam_lr_1e3 => |d| scenarios::controls::training_controls(d, scenarios::controls::Regime::Adam(1e-3));
    controls_training_adam_lr_1e4 => |d| scenarios::controls::training_controls(d, scenarios::controls::Regime::Adam(1e-4));
    controls_graphs_sgd => |d| scenarios::controls::graph_controls(d, scenarios::controls::Regime::Sgd), needs_graphs: "Flex cannot capture: the injected faults act on the recorded graphs";
    controls_graphs_adam_lr_1e3 => |d| scenarios::controls::graph_controls(d, scenarios::controls::Regime::Adam(1e-3)), needs_graphs: "Flex cannot capture: the injected faults act on the recorded graphs";
    controls_graphs_adam_lr_1e4 => |d| scenarios::controls::graph_controls(d, scenarios::controls::Regime::Adam(1e-4)), needs_graphs: "Flex cannot capture: the injected faults act on the recorded graphs";
    controls_inference => scenarios::controls::inference_controls;
    controls_params_check_sees_one_step => scenarios::controls::params_check_sees_one_step;
    whole_step_update_controls_f32 => |d| scenarios::whole_step::whole_step_update_controls_in(d, burn::tensor::FloatDType::F32), needs_graphs: "Flex cannot capture: the injected faults act on the recorded update";
    whole_step_update_controls_f16 => |d| scenarios::whole_step::whole_step_update_controls_in(d, burn::tensor::FloatDType::F16), needs_graphs: "Flex cannot capture: the injected faults act on the recorded update";
    /// burn-train's `Learner` trains a graphed model like the plain one (feature `train`).
    #[cfg(feature = "train")]
    learner_trains_graphed_like_eager => scenarios::learner::learner_trains_graphed_like_eager;
}

/// The property test on wgpu; few cases, because lavapipe compiles every new shape's kernels
/// in software (Flex would only compare eager with eager).
#[test]
fn wgpu_graphed_training_equals_eager() {
    scenarios::prop::graphed_training_equals_eager(&wgpu(), 4);
}

/// The whole-step property on wgpu (few cases, as above).
#[test]
fn wgpu_whole_step_equals_eager() {
    scenarios::prop::whole_step_equals_eager(&wgpu(), 3);
}

/// Graphs on wgpu, an input on Flex (and the other way round): a typed error, nothing runs.
#[test]
fn input_on_another_device_is_refused() {
    scenarios::robust::input_on_another_device_is_refused(&wgpu(), &Device::flex());
    scenarios::robust::input_on_another_device_is_refused(&Device::flex(), &wgpu());
}

/// `supports_graphs` answers as a capture does: wgpu records (software graphs), Flex runs
/// every call eagerly.
#[test]
fn wgpu_records_graphs() {
    assert!(
        burn_graphed::supports_graphs(&wgpu()),
        "wgpu should capture (software graphs)"
    );
    assert!(scenarios::capture_records_graphs(&wgpu()));
}

#[test]
fn flex_runs_eagerly() {
    assert!(!burn_graphed::supports_graphs(&Device::flex()));
    assert!(!scenarios::capture_records_graphs(&Device::flex()));
}

/// burn-graphed announces each phase of a capture as a `log` debug event of target
/// `burn_graphed::capture`: the bench (`warn_log`, `--kernel-trace`) attributes kernel launches
/// and cubecl's warnings to capture phases with them, among them the autotune keys cubecl had to
/// decide unmeasured because they first came up inside a recording. The sequence of one
/// callable's capture, snapshotted. And a capture that takes long says so: `info` lines of
/// target `burn_graphed::progress` with the phase, the time and the kernels launched so far,
/// then the time it took and the kernels it launched (here after no time at all,
/// `testing::set_capture_progress`).
#[test]
fn capture_announces_its_phases() {
    use std::sync::Mutex;
    use std::thread::ThreadId;

    static EVENTS: Mutex<Vec<(ThreadId, String)>> = Mutex::new(Vec::new());
    static PROGRESS: Mutex<Vec<String>> = Mutex::new(Vec::new());
    struct Phases;
    impl log::Log for Phases {
        fn enabled(&self, metadata: &log::Metadata) -> bool {
            matches!(
                metadata.target(),
                "burn_graphed::capture" | "burn_graphed::progress"
            )
        }
        fn log(&self, record: &log::Record) {
            let line = record.args().to_string();
            match record.target() {
                "burn_graphed::capture" => {
                    let event = (std::thread::current().id(), line);
                    EVENTS.lock().unwrap_or_else(|e| e.into_inner()).push(event);
                }
                "burn_graphed::progress" => PROGRESS
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(line),
                _ => {}
            }
        }
        fn flush(&self) {}
    }
    // The tests of this binary share the process: the first install wins (this is the only
    // logger here), and only this thread's events count. Debug events only for the capture:
    // at that level every `log::debug!` of the libraries (wgpu's included) evaluates its
    // arguments and reaches the logger, in every test running meanwhile.
    let _ = log::set_logger(&Phases);
    log::set_max_level(log::LevelFilter::Debug);
    burn_graphed::testing::set_capture_progress(
        std::time::Duration::ZERO,
        std::time::Duration::from_secs(3600),
    );

    fn forward(model: &burn::nn::Linear, x: Tensor<2>) -> Tensor<2> {
        model.forward(x)
    }
    let device = wgpu().autodiff();
    let model = burn::nn::LinearConfig::new(8, 4).init(&device);
    let sample = Tensor::<2>::ones([2, 8], &device).require_grad();
    let graphed =
        burn_graphed::Graphed::new(model, forward, sample, &burn_graphed::GraphedConfig::new())
            .expect("capture");
    log::set_max_level(log::LevelFilter::Off);
    burn_graphed::testing::set_capture_progress(
        std::time::Duration::from_secs(1),
        std::time::Duration::from_secs(5),
    );
    assert!(graphed.summary().graphed, "wgpu captures");
    // Other tests' captures may report meanwhile too: a report and an end of a callable's
    // capture, in that order, are what this one must have written at least.
    let progress = PROGRESS.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let callable = "burn-graphed: capturing a graphed callable: ";
    let report = progress
        .iter()
        .position(|line| line.starts_with(callable) && line.contains(" s so far"));
    let end = progress
        .iter()
        .rposition(|line| line.starts_with(callable) && line.contains("done in"));
    assert!(
        matches!((report, end), (Some(r), Some(e)) if r < e),
        "{progress:#?}"
    );
    // The end line counts the distinct kernels launched while the capture ran (its warm-ups'
    // and recording's, and any other test's meanwhile): a capture of a linear layer's forward
    // and backward launches some.
    let end_line = &progress[end.expect("an end line")];
    let kernels: usize = end_line
        .split(", ")
        .find_map(|part| part.strip_suffix(" distinct kernels launched"))
        .and_then(|count| count.parse().ok())
        .unwrap_or_else(|| panic!("a kernel count in {end_line:?}"));
    assert!(kernels > 0, "{end_line:?}");
    let me = std::thread::current().id();
    let phases: Vec<String> = EVENTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|(thread, _)| *thread == me)
        .map(|(_, phase)| phase.clone())
        .collect();
    let mut settings = insta::Settings::clone_current();
    settings.set_prepend_module_to_snapshot(false);
    settings.set_snapshot_path("scenarios/snapshots");
    settings.set_omit_expression(true);
    settings.bind(|| insta::assert_snapshot!("capture_phases_wgpu", phases.join("\n")));
}

/// `replica_on` from wgpu to Flex: every parameter kind lands on the target device.
#[test]
fn data_parallel_replica_moves_every_parameter() {
    scenarios::data_parallel::replica_moves_every_parameter(&wgpu(), &Device::flex());
}

/// burn's `BatchNorm` in a whole step built with `allow_non_trainable_params`: where every step
/// runs burn's optimizer (Flex), the running statistics follow eager training.
#[test]
fn flex_batch_norm_whole_step_matches_eager() {
    scenarios::batch_norm::batch_norm_whole_step_matches_eager(&Device::flex(), 6, 1);
}

/// The same with whole-step graphs: losses, trained parameters and running statistics equal
/// eager training's to the bit, the graph keeping the statistics its forward computes.
#[test]
fn wgpu_batch_norm_whole_step_matches_eager() {
    scenarios::batch_norm::batch_norm_whole_step_matches_eager(&wgpu(), 6, 1);
}

/// The same over two micro-batches a step: each forward updates the statistics in turn, as
/// eager accumulation does.
#[test]
fn wgpu_batch_norm_accumulated_step_matches_eager() {
    scenarios::batch_norm::batch_norm_whole_step_matches_eager(&wgpu(), 4, 2);
}
