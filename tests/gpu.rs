//! The GPU suite (CUDA), built and bundled by `cargo xtask gpu-test`: the shared scenarios on
//! `Device::cuda(0)` with more steps, and a smoke test of the backend graph API.

mod scenarios;

use burn::backend::{Backend, Dispatch};
use burn::prelude::*;
use scenarios::processes::Place;

/// The CUDA device. Also sends the libraries' warnings to stderr, tagged with this test's name
/// ([`warnings`]), and sets the process's TF32 choice first ([`choose_tf32`]).
fn cuda() -> Device {
    warnings::install();
    choose_tf32();
    Device::cuda(0)
}

/// The environment variable that runs this process's `f32` products with TF32 allowed (the
/// default of burn-graphed and cubecl); without it the suite turns TF32 off, so that an `f32`
/// formula rounds alike in eager and graphed runs up to the order of its sums and the suite's
/// comparisons hold `Tolerance::default`, a derived bound (`tolerance_for`). The TF32 regime
/// runs in a child process of its own ([`tf32_regime_trains_within_the_tensor_core_bound`]).
const TF32_VAR: &str = "BURN_GRAPHED_TEST_TF32";

/// Sets TF32 for this process's CUDA devices: off, unless [`TF32_VAR`] is `1`. Every test
/// calls it before its first device; the first call decides, later ones agree with it.
fn choose_tf32() {
    let tf32 = std::env::var(TF32_VAR).is_ok_and(|v| v == "1");
    burn_graphed::allow_tf32(tf32).expect("every test of the process makes the same choice");
}

/// With TF32 off (this suite's default), an `f32` product whose operands TF32 would round
/// must come out exact, whatever kernel autotune picks for each layout: rows of `1 + 2^-12`
/// (TF32 keeps 10 mantissa bits and rounds it to 1) times ones sum to `K (1 + 2^-12)`, exact
/// in `f32` in any order for `K` = 64 (every partial sum `k + k 2^-12` is a multiple of its
/// unit in the last place for `k < 128`). TF32 would give `K`. Shapes large enough that
/// tensor-core kernels are among the candidates; plain, transposed and fused (a product
/// followed by an addition) forms.
#[test]
fn tf32_off_keeps_f32_products_exact() {
    let device = cuda();
    if burn_graphed::tf32_allowed() {
        scenarios::skip::skip(&format!("{TF32_VAR}=1 runs this process with TF32 allowed"));
        return;
    }
    let k = 64;
    let exact = k as f32 * (1.0 + 2f32.powi(-12));
    for (m, n) in [(256, 256), (512, 128), (32, 1024)] {
        let a = Tensor::<2>::full([m, k], 1.0 + 2f32.powi(-12), &device);
        let b = Tensor::<2>::ones([k, n], &device);
        let forms = [
            ("plain", a.clone().matmul(b.clone())),
            (
                "transposed",
                b.clone()
                    .transpose()
                    .matmul(a.clone().transpose())
                    .transpose(),
            ),
            ("fused", a.clone().matmul(b.clone()) + 0.0),
        ];
        for (form, product) in forms {
            let values = product.into_data().try_to_vec::<f32>().expect("f32 values");
            let off = values.iter().filter(|v| **v != exact).count();
            assert_eq!(
                off,
                0,
                "{m}x{k}x{n} {form}: {off} of {} elements not {exact} (first {:?}): a product \
                 rounded its operands with TF32 off",
                values.len(),
                values.iter().find(|v| **v != exact)
            );
        }
    }
    assert!(
        matches!(
            burn_graphed::allow_tf32(true),
            Err(burn_graphed::GraphedError::Tf32TooLate {
                requested: true,
                held: false
            })
        ),
        "a change after the device exists is refused"
    );
    burn_graphed::allow_tf32(false).expect("the held setting is accepted again");
}

/// The fused `Linear`'s products through cuBLASLt (more than 8 rows) follow the process's TF32
/// choice, as burn's own do: the product of rows of `1 + 2^-12` and a weight of ones is
/// `K (1 + 2^-12)` exactly with TF32 off ([`tf32_off_keeps_f32_products_exact`] derives it), and
/// `K` with TF32 allowed, where cuBLASLt rounds the operands to TF32 (10 mantissa bits) on
/// tensor cores. Both branches check: this process runs the first, the TF32 child
/// ([`tf32_regime_trains_within_the_tensor_core_bound`]) the second.
#[test]
fn fused_linear_follows_the_tf32_setting() {
    let device = cuda();
    if !burn_graphed::testing::vendor_matmul_available(&device) {
        scenarios::skip::skip("cuBLASLt is not available here");
        return;
    }
    let (rows, k, n) = (256, 64, 256);
    let mut linear: burn_graphed::nn::Linear = burn::nn::LinearConfig::new(k, n)
        .with_bias(false)
        .init(&device)
        .into();
    linear.weight = burn::module::Param::from_tensor(Tensor::ones([k, n], &device));
    let x = Tensor::<2>::full([rows, k], 1.0 + 2f32.powi(-12), &device);
    let before = burn_graphed::testing::vendor_matmuls();
    let values = linear
        .forward(x)
        .into_data()
        .try_to_vec::<f32>()
        .expect("f32 values");
    assert!(
        burn_graphed::testing::vendor_matmuls() > before,
        "the product did not run through cuBLASLt"
    );
    let tf32 = burn_graphed::tf32_allowed();
    let expected = if tf32 {
        k as f32
    } else {
        k as f32 * (1.0 + 2f32.powi(-12))
    };
    let off = values.iter().filter(|v| **v != expected).count();
    assert_eq!(
        off,
        0,
        "TF32 allowed: {tf32}; {off} of {} elements not {expected} (first {:?})",
        values.len(),
        values.iter().find(|v| **v != expected)
    );
}

/// The TF32 regime (burn-graphed's default): a child process of this binary with
/// [`TF32_VAR`] set runs trainings compared under `Tolerance::tensor_cores` (its bound is
/// measured, not derived: see its docs) and must pass them.
#[test]
fn tf32_regime_trains_within_the_tensor_core_bound() {
    let _ = cuda();
    let tests = [
        "mlp_training_matches_eager",
        "graphed_fused_adam_matches_eager",
        "tf32_off_keeps_f32_products_exact",
        "fused_linear_follows_the_tf32_setting",
    ];
    let exe = std::env::current_exe().expect("the test binary's path");
    // The child's output goes to a file (read at the end), and the child is killed past a
    // deadline, so that a hung child fails this test rather than outliving it.
    let log = std::env::temp_dir().join(format!("tf32-child-{}.log", std::process::id()));
    let file = std::fs::File::create(&log).expect("the child's log");
    let mut child = std::process::Command::new(exe)
        .env(TF32_VAR, "1")
        // NVIDIA's override would turn TF32 off in the child too.
        .env_remove("NVIDIA_TF32_OVERRIDE")
        .args(["--exact", "--test-threads=1", "--nocapture"])
        .args(tests)
        .stdout(file.try_clone().expect("the child's log"))
        .stderr(file)
        .spawn()
        .expect("the child test process starts");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(400);
    let status = loop {
        if let Some(status) = child.try_wait().expect("the child's status") {
            break Some(status);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    // Prefixed, and the child's skip lines renamed, so that the runner's log reader counts
    // this test's result, not the child's.
    for line in text.lines() {
        println!(
            "[tf32 child] {}",
            line.replace("skipped: ", "skipped (child): ")
        );
    }
    let status = status.expect("the child ran past 400 s and was killed (its output above)");
    assert!(status.success(), "the TF32 regime failed (above)");
    assert!(
        text.contains("test result: ok. 4 passed"),
        "the child ran the four tests"
    );
    assert!(
        text.contains("skipped: tf32_off_keeps_f32_products_exact"),
        "the child ran with TF32 allowed"
    );
}

/// The libraries' `log` warnings (cubecl's "A launch error happened", "Autotune measured no
/// candidate for key ...; deciding candidate N unmeasured") on stderr, tagged with the test
/// that last asked for the device, so that a GPU suite log shows when a test ran kernels that
/// autotuning chose without measuring them (BENCHMARKS.md, "The CNN in bf16"). The tag is the
/// test's, not the warning's thread: cubecl warns from its device and fusion threads, and the
/// bundle runs the tests one at a time.
mod warnings {
    use std::sync::Mutex;

    static TEST: Mutex<String> = Mutex::new(String::new());

    struct Stderr;

    impl log::Log for Stderr {
        fn enabled(&self, metadata: &log::Metadata) -> bool {
            metadata.level() <= log::Level::Warn
        }

        fn log(&self, record: &log::Record) {
            if self.enabled(record.metadata()) {
                let test = TEST.lock().unwrap_or_else(|e| e.into_inner()).clone();
                let message = record.args().to_string().replace('\n', " | ");
                eprintln!("[{} {test}] {}: {message}", record.level(), record.target());
            }
        }

        fn flush(&self) {}
    }

    /// Installs the logger (once per process) and tags what follows with the calling test.
    pub fn install() {
        let name = std::thread::current().name().unwrap_or("?").to_string();
        *TEST.lock().unwrap_or_else(|e| e.into_inner()) = name;
        if log::set_logger(&Stderr).is_ok() {
            log::set_max_level(log::LevelFilter::Warn);
        }
    }
}

/// Captures a forward pass through burn's backend graph API, changes the input buffer's
/// contents, replays, and checks the replay against eager execution.
#[test]
fn smoke_backend_graph_replays_against_eager() {
    let device = cuda();
    let dispatch = device.as_dispatch();
    let w = Tensor::<2>::random([64, 64], burn::tensor::Distribution::Default, &device);
    let x = Tensor::<2>::random([8, 64], burn::tensor::Distribution::Default, &device);
    let f = |x: &Tensor<2>| burn::tensor::activation::relu(x.clone().matmul(w.clone())).sum_dim(1);
    Dispatch::graph_prepare(dispatch).expect("prepare");
    for _ in 0..3 {
        let out = f(&x);
        device.sync().expect("sync");
        drop(out);
    }
    Dispatch::graph_start_capture(dispatch).expect("start");
    let out = f(&x);
    let graph = Dispatch::graph_stop_capture(dispatch).expect("stop");
    // Replays with new input values are what the scenarios below check (a new batch every
    // step, compared to eager); here the raw API replays the captured input.
    // SAFETY: every tensor the closure touched (x, w, out) is alive, nothing else runs
    // concurrently, and the replay is issued from the capturing thread.
    unsafe { Dispatch::graph_replay(dispatch, &graph) }.expect("replay");
    let replayed = out.clone().into_data();
    let eager = f(&x).into_data();
    replayed.assert_approx_eq::<f32>(&eager, Default::default());
    drop(graph);
}

#[test]
fn mlp_training_matches_eager() {
    scenarios::mlp_training_matches_eager(&cuda(), 20);
}

#[test]
fn loss_inside_callable_matches_eager() {
    scenarios::loss_inside_callable_matches_eager(&cuda(), 20);
}

#[test]
fn multi_io_matches_eager() {
    scenarios::multi_io_matches_eager(&cuda(), 20);
}

#[test]
fn input_gradient_matches_eager() {
    scenarios::input_gradient_matches_eager(&cuda());
}

#[test]
fn unused_input_is_refused() {
    scenarios::unused_input_is_refused(&cuda());
}

#[test]
fn too_many_parents_is_refused() {
    scenarios::too_many_parents_is_refused(&cuda(), true);
}

#[test]
fn inference_buckets_replay() {
    scenarios::inference_buckets_replay(&cuda());
}

#[test]
fn col_layout_weights_match_eager() {
    scenarios::col_layout_weights_match_eager(&cuda());
}

#[test]
fn eval_calls_replay_inference_graphs() {
    scenarios::eval_calls_replay_inference_graphs(&cuda());
}

#[test]
fn inference_follows_fused_training() {
    for policy in [
        burn_graphed::OutputPolicy::Copy,
        burn_graphed::OutputPolicy::Static,
        burn_graphed::OutputPolicy::Guarded,
    ] {
        scenarios::inference::inference_follows_fused_training(&cuda(), policy);
    }
}

#[test]
fn unwritten_input_inference_call_recovers() {
    scenarios::inference::unwritten_input_inference_call_recovers(&cuda());
}

/// An inference call's input laid out as the graph's buffer is copied in with one driver copy;
/// a transposed view of the same values with cubecl's copy kernel; both calls right.
#[test]
fn input_copies_run_as_driver_copies() {
    scenarios::inference::input_copies_run_as_driver_copies(&cuda(), true);
}

#[test]
fn inner_device_inputs_replay() {
    scenarios::inner_device_inputs_replay(&cuda());
}

#[test]
fn shape_change_falls_back_or_errors() {
    scenarios::shape_change_falls_back_or_errors(&cuda());
}

#[test]
fn lazy_reads_see_later_writes() {
    scenarios::reads::lazy_reads_see_later_writes(&cuda());
}

#[test]
fn second_call_before_backward_is_eager() {
    scenarios::second_call_before_backward_is_eager(&cuda());
}

/// Three callables chained (encoder -> hidden -> decoder). Before `materialize` (capture.rs)
/// this crashed the H100 (an eager kernel reading metadata that a recording had only recorded
/// the upload of); it is the regression test for that.
#[test]
fn chained_group_matches_eager() {
    scenarios::group::chained_group_matches_eager(&cuda(), 20, burn_graphed::OutputPolicy::Copy);
}

/// The same chain handing out the static output buffers.
#[test]
fn chained_group_static_outputs_match_eager() {
    scenarios::group::chained_group_matches_eager(&cuda(), 5, burn_graphed::OutputPolicy::Static);
}

#[test]
fn chained_group_shares_buffers_safely() {
    scenarios::group::chained_group_shares_buffers_safely(&cuda());
}

#[test]
fn chain_errors() {
    scenarios::group::chain_errors(&cuda());
}

#[test]
fn harness_catches_faults() {
    scenarios::harness_catches_faults(&cuda());
}

/// A host read inside the forward capture: CUDA does not refuse it (cubecl 0.11 records the
/// copy); this read does not decide the output, so the graph is right and the capture stands
/// (`replay_validation_refuses_frozen_values` covers a read that does). The device must stay
/// usable either way. Passed alone on an H100 at 52fccda; the error 700 that once followed it
/// came from uninitialized kernel metadata (fixed by `materialize`).
#[test]
fn capture_failure_leaves_device_usable() {
    scenarios::capture_failure_leaves_device_usable(&cuda(), false);
}

#[test]
fn replay_validation_refuses_frozen_values() {
    scenarios::robust::replay_validation_refuses_frozen_values(&cuda());
}

#[test]
fn device_rng_draws_fresh_masks() {
    scenarios::random::device_rng_draws_fresh_masks(&cuda());
}

#[test]
fn graph_dropout_matches_eager() {
    scenarios::random::graph_dropout_matches_eager(&cuda(), 20);
}

#[test]
fn device_rng_draws_uniform_and_normal() {
    scenarios::random::device_rng_draws_uniform_and_normal(&cuda());
}

#[test]
fn graphed_noise_matches_eager() {
    scenarios::random::graphed_noise_matches_eager(&cuda(), 20);
}

/// Thread-local capture mode: another thread's draws and reads on the same GPU go on during
/// captures, none refused; the control, global mode, refuses every capture (3 of 3) and fails
/// that thread's reads.
#[test]
fn other_threads_keep_their_draws() {
    scenarios::random::other_threads_keep_their_draws(&cuda(), true);
    let _control = scenarios::capture_mode::GlobalMode::on();
    scenarios::random::other_threads_keep_their_draws(&cuda(), false);
}

#[test]
fn capture_failures_are_recovered() {
    scenarios::recovery::capture_failures_are_recovered(&cuda(), true);
}

#[test]
fn unwritten_tensors_fail_capture() {
    scenarios::recovery::unwritten_tensors_fail_capture(&cuda());
}

#[test]
fn unwritten_input_call_recovers() {
    scenarios::recovery::unwritten_input_call_recovers(&cuda(), scenarios::copy_config());
}

/// The same under the default hand-outs (`Guarded`).
#[test]
fn unwritten_input_call_recovers_guarded() {
    scenarios::recovery::unwritten_input_call_recovers(&cuda(), burn_graphed::GraphedConfig::new());
}

#[test]
fn backward_twice_matches_eager() {
    scenarios::recovery::backward_twice_matches_eager(&cuda());
}

#[test]
fn dropping_the_model_before_backward() {
    scenarios::recovery::dropping_the_model_before_backward(&cuda());
}

#[test]
fn eager_adams_are_burns_f32() {
    scenarios::optim::eager_adams_are_burns_in(&cuda(), burn::tensor::FloatDType::F32);
}

#[test]
fn graphed_fused_adam_matches_eager() {
    scenarios::optim::graphed_fused_adam_matches_eager(&cuda(), 20);
}

#[test]
fn fused_adam_keeps_snapshots() {
    scenarios::optim::fused_adam_keeps_snapshots(&cuda(), scenarios::optim::Kind::PerParam);
}

#[test]
fn multi_tensor_adam_keeps_snapshots() {
    scenarios::optim::fused_adam_keeps_snapshots(&cuda(), scenarios::optim::Kind::MultiTensor);
}

#[test]
fn multi_tensor_adam_matches_fused_adam() {
    scenarios::optim::multi_tensor_adam_matches_fused_adam(&cuda());
}

#[test]
fn multi_tensor_adam_mixes_step_counts() {
    scenarios::optim::multi_tensor_adam_mixes_step_counts(&cuda());
}

#[test]
fn graphed_multi_tensor_adam_matches_eager() {
    scenarios::optim::graphed_multi_tensor_adam_matches_eager(&cuda(), 20);
}

#[test]
fn fused_adam_records_load_into_adam() {
    scenarios::optim::fused_adam_records_load_into_adam(&cuda());
}

#[test]
fn fused_adam_leaves_shared_moments_alone() {
    let kind = scenarios::optim::Kind::PerParam;
    scenarios::optim::fused_adam_leaves_shared_moments_alone(&cuda(), kind);
}

#[test]
fn multi_tensor_adam_records_load_into_adam() {
    scenarios::optim::multi_tensor_adam_records_load_into_adam(&cuda());
}

#[test]
fn multi_tensor_adam_leaves_shared_moments_alone() {
    let kind = scenarios::optim::Kind::MultiTensor;
    scenarios::optim::fused_adam_leaves_shared_moments_alone(&cuda(), kind);
}

#[test]
fn fused_adam_unwritten_gradient_is_refused() {
    let kind = scenarios::optim::Kind::PerParam;
    scenarios::optim::unwritten_gradient_step_is_refused(&cuda(), kind);
}

#[test]
fn multi_tensor_adam_unwritten_gradient_is_refused() {
    let kind = scenarios::optim::Kind::MultiTensor;
    scenarios::optim::unwritten_gradient_step_is_refused(&cuda(), kind);
}

#[test]
fn guarded_training_matches_eager() {
    scenarios::guarded::guarded_training_matches_eager(&cuda(), 20, false);
}

#[test]
fn guarded_multi_tensor_training_matches_eager() {
    scenarios::guarded::guarded_training_matches_eager(&cuda(), 20, true);
}

#[test]
fn default_loop_replays_every_step() {
    scenarios::guarded::default_loop_replays_every_step(&cuda(), 20);
}

#[test]
fn guarded_hand_outs_keep_their_values() {
    scenarios::guarded::guarded_hand_outs_keep_their_values(&cuda());
}

#[test]
fn other_thread_runs_eagerly() {
    scenarios::robust::other_thread_runs_eagerly(&cuda());
}

/// On CUDA every graph says what it holds (the carried cubecl-cuda patch) and writes its DOT.
#[test]
fn graphs_say_what_they_hold() {
    scenarios::inspect::graphs_say_what_they_hold(&cuda(), true);
}

#[test]
fn prepare_captures_ahead() {
    scenarios::robust::prepare_captures_ahead(&cuda());
}

#[test]
fn capture_releases_warmup_memory() {
    scenarios::robust::capture_releases_warmup_memory(&cuda());
}

#[test]
fn shape_cache_matches_eager() {
    scenarios::robust::shape_cache_matches_eager(&cuda());
}

/// Thousands of graphed Adam steps beside eager ones, eval every 100, parameters compared (and
/// re-synchronized) every 50 (at lr 1e-3 the bound relative to 50 steps' movement is below one
/// step); device memory must stop growing after 250 steps.
#[test]
fn soak() {
    let figures = scenarios::robust::soak(&cuda(), scenarios::robust::adam, 3000, 100, 50, 250)
        .expect("CUDA captures");
    println!("soak figures: {figures:?}");
}

/// The token-id language model (int ids, bool mask, int targets in; loss and int predictions
/// out), graphed against eager for 24 steps.
#[test]
fn token_model_matches_eager() {
    scenarios::tokens::token_model_matches_eager(&cuda(), 24);
}

/// The token-id model in whole steps, two sequence lengths through the shape cache.
#[test]
fn token_whole_step_matches_eager() {
    scenarios::tokens::token_whole_step_matches_eager(&cuda(), 9);
}

/// A token group whose first callable passes its bool mask on to the second.
#[test]
fn token_group_passes_a_mask_on() {
    scenarios::tokens::token_group_passes_a_mask_on(&cuda());
}

#[test]
fn token_facts() {
    scenarios::tokens::token_facts(&cuda());
}

#[test]
fn structural_facts() {
    scenarios::facts::structural_facts(&cuda());
}

/// 12 cases by default (each compiles and autotunes new kernels: about 20 s a case on an
/// H100); 256 with `cargo xtask gpu-test --long`.
#[test]
fn graphed_training_equals_eager() {
    scenarios::prop::graphed_training_equals_eager(&cuda(), 12);
}

/// The whole-step property: 8 cases by default, 256 with `--long`.
#[test]
fn whole_step_equals_eager() {
    scenarios::prop::whole_step_equals_eager(&cuda(), 8);
}

#[test]
fn same_shape_heads_match_eager() {
    scenarios::prop::same_shape_heads_match_eager(&cuda());
}

#[test]
fn cuda_records_graphs() {
    assert!(burn_graphed::supports_graphs(&cuda()));
    assert!(scenarios::capture_records_graphs(&cuda()));
}

#[test]
fn eager_adams_are_burns_bf16() {
    scenarios::optim::eager_adams_are_burns_in(&cuda(), burn::tensor::FloatDType::BF16);
}

#[test]
fn eager_adams_are_burns_f16() {
    scenarios::optim::eager_adams_are_burns_in(&cuda(), burn::tensor::FloatDType::F16);
}

#[test]
fn graphed_fused_adam_trains_in_bf16() {
    let (kind, bf16) = (
        scenarios::optim::Kind::PerParam,
        burn::tensor::FloatDType::BF16,
    );
    scenarios::low_precision::graphed_fused_adam_trains_in(&cuda(), kind, bf16, 20);
}

#[test]
fn graphed_multi_tensor_adam_trains_in_bf16() {
    let (kind, bf16) = (
        scenarios::optim::Kind::MultiTensor,
        burn::tensor::FloatDType::BF16,
    );
    scenarios::low_precision::graphed_fused_adam_trains_in(&cuda(), kind, bf16, 20);
}

#[test]
fn device_rng_fills_pitched_shapes() {
    scenarios::random::device_rng_fills_pitched_shapes(&cuda());
}

#[test]
fn graphed_fused_adam_pitched() {
    let kind = scenarios::optim::Kind::PerParam;
    scenarios::optim::graphed_fused_adam_pitched(&cuda(), kind, 10);
}

#[test]
fn graphed_multi_tensor_adam_pitched() {
    let kind = scenarios::optim::Kind::MultiTensor;
    scenarios::optim::graphed_fused_adam_pitched(&cuda(), kind, 10);
}

/// burn-train's `Learner` trains a graphed model like the plain one (feature `train`).
#[cfg(feature = "train")]
#[test]
fn learner_trains_graphed_like_eager() {
    scenarios::learner::learner_trains_graphed_like_eager(&cuda());
}

/// Negative controls (`scenarios/controls.rs`): every regime's comparisons fail with the
/// smallest real error they must see injected; each prints its margin.
mod controls {
    use super::{cuda, scenarios};
    use scenarios::controls::*;

    #[test]
    fn training_sgd() {
        training_controls(&cuda(), Regime::Sgd);
    }

    #[test]
    fn training_adam_lr_1e3() {
        training_controls(&cuda(), Regime::Adam(1e-3));
    }

    #[test]
    fn training_adam_lr_1e4() {
        training_controls(&cuda(), Regime::Adam(1e-4));
    }

    #[test]
    fn graphs_sgd() {
        graph_controls(&cuda(), Regime::Sgd);
    }

    #[test]
    fn graphs_adam_lr_1e3() {
        graph_controls(&cuda(), Regime::Adam(1e-3));
    }

    #[test]
    fn graphs_adam_lr_1e4() {
        graph_controls(&cuda(), Regime::Adam(1e-4));
    }

    #[test]
    fn inference() {
        inference_controls(&cuda());
    }

    #[test]
    fn params_check_sees_one_step() {
        scenarios::controls::params_check_sees_one_step(&cuda());
    }
}

mod whole_step {
    use super::{cuda, scenarios};
    use burn_graphed::Clipping;
    use scenarios::whole_step::*;

    #[test]
    fn adam_matches_eager() {
        whole_step_matches_eager(&cuda(), adam(), None, 1, &[4], 10);
    }

    #[test]
    fn update_is_burns_in_bf16_f16_f32() {
        use burn::tensor::FloatDType::{BF16, F16, F32};
        let mut failed = Vec::new();
        for dtype in [BF16, F16, F32] {
            for optimizer in [adam(), adamw(), sgd_momentum()] {
                let run = std::panic::catch_unwind(|| {
                    whole_step_update_is_burns_in(&cuda(), dtype, optimizer, 6)
                });
                if run.is_err() {
                    failed.push(format!("{dtype:?} {optimizer:?}"));
                }
            }
        }
        assert!(failed.is_empty(), "differ from burn's update: {failed:?}");
    }

    #[test]
    fn adamw_clipped_matches_eager() {
        whole_step_matches_eager(&cuda(), adamw(), Some(Clipping::Norm(0.05)), 1, &[4], 10);
    }

    #[test]
    fn sgd_accumulated_matches_eager() {
        let clipping = Some(Clipping::Value(0.02));
        whole_step_matches_eager(&cuda(), sgd_momentum(), clipping, 2, &[4], 10);
    }

    #[test]
    fn global_norm_batch_sizes_match_eager() {
        let clipping = Some(Clipping::GlobalNorm(0.1));
        whole_step_matches_eager(&cuda(), adam(), clipping, 1, &[4, 3, 7], 9);
    }

    #[test]
    fn negative_controls() {
        whole_step_negative_controls(&cuda());
    }

    #[test]
    fn update_controls_in_bf16_f16_f32() {
        use burn::tensor::FloatDType::{BF16, F16, F32};
        for dtype in [BF16, F16, F32] {
            whole_step_update_controls_in(&cuda(), dtype);
        }
    }

    #[test]
    fn capture_changes_nothing() {
        whole_step_capture_changes_nothing(&cuda());
    }

    #[test]
    fn dropout_matches_eager() {
        whole_step_dropout_matches_eager(&cuda(), 8);
    }

    #[test]
    fn bad_input() {
        whole_step_bad_input(&cuda());
    }

    #[test]
    fn host_read_is_refused() {
        whole_step_host_read_is_refused(&cuda());
    }

    #[test]
    fn adamw_records_round_trip() {
        whole_step_records_round_trip(&cuda(), adamw());
    }
}

/// The first `n` CUDA devices, or `None` where this process sees fewer, after a `skipped:
/// TEST: ...` line that the runner counts as a skip, not a pass ([`scenarios::skip::skip`]).
/// `nvidia-smi -L` counts the machine's GPUs and ignores `CUDA_VISIBLE_DEVICES`, which CUDA
/// honours: the process sees the fewer of the two (a run restricted to one GPU of two would
/// otherwise ask CUDA for a device it does not have).
fn gpus(n: usize) -> Option<Vec<Device>> {
    warnings::install();
    let listed = std::process::Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.starts_with("GPU "))
                .count()
        })
        .unwrap_or(0);
    let visible = std::env::var("CUDA_VISIBLE_DEVICES")
        .map(|v| v.split(',').filter(|d| !d.trim().is_empty()).count())
        .unwrap_or(listed);
    let seen = listed.min(visible);
    if seen < n {
        scenarios::skip::skip(&format!(
            "needs {n} GPUs, this process sees {seen} (the machine lists {listed})"
        ));
        return None;
    }
    choose_tf32();
    Some((0..n).map(Device::cuda).collect())
}

/// Two graphed replicas on two GPUs, gradients averaged with burn's NCCL all-reduce, equal one
/// model on the whole batches (skipped on one GPU).
#[test]
fn data_parallel_replicas_match_one_model() {
    let Some(devices) = gpus(2) else { return };
    scenarios::data_parallel::replicas_match_one_model(
        &devices,
        burn_graphed::Collective::AllReduce {
            devices: devices.clone(),
        },
    );
}

/// Rank 1's capture failing on two GPUs is a typed error on both ranks (no hang); both GPUs
/// then capture and train, averaging with burn's NCCL all-reduce (skipped on one GPU).
#[test]
fn data_parallel_failed_capture_fails_every_rank() {
    let Some(devices) = gpus(2) else { return };
    scenarios::data_parallel::failed_capture_fails_every_rank(
        &devices,
        burn_graphed::Collective::AllReduce {
            devices: devices.clone(),
        },
    );
}

/// `examples/train_ddp.rs` on two GPUs with burn's NCCL all-reduce (skipped on one GPU).
#[test]
fn data_parallel_example_trains() {
    let Some(devices) = gpus(2) else { return };
    scenarios::data_parallel::example_trains_equal_replicas(
        &devices,
        burn_graphed::Collective::AllReduce {
            devices: devices.clone(),
        },
    );
}

/// Ranks that are threads of one process, on two GPUs, draw alike in turn (skipped on one GPU).
#[test]
fn data_parallel_draws_in_turn_are_alike() {
    let Some(devices) = gpus(2) else { return };
    scenarios::data_parallel::draws_in_turn_are_alike(&devices);
}

/// Two data-parallel whole steps on two GPUs, each step's bucket averaged with burn's NCCL
/// all-reduce between its two graphs, equal one model on the whole batches (skipped on one
/// GPU).
#[test]
fn data_parallel_whole_steps_match_one_model() {
    let Some(devices) = gpus(2) else { return };
    scenarios::data_parallel::whole_steps_match_one_model(
        &devices,
        burn_graphed::Collective::AllReduce {
            devices: devices.clone(),
        },
    );
}

/// Data-parallel whole steps on two GPUs whose batches change shape (together, then on one
/// rank only) capture the new shapes in turn after an eager step and replay them, through NCCL
/// (skipped on one GPU).
#[test]
fn data_parallel_whole_steps_capture_new_shapes_together() {
    let Some(devices) = gpus(2) else { return };
    scenarios::data_parallel::whole_steps_capture_new_shapes_together(
        &devices,
        burn_graphed::Collective::AllReduce {
            devices: devices.clone(),
        },
    );
}

/// Gradients without values on one GPU end the step on both with a typed error before the
/// all-reduce, which cubecl would skip on that GPU alone, leaving the other in NCCL for good
/// (skipped on one GPU).
#[test]
fn data_parallel_unwritten_gradients_fail_every_rank() {
    let Some(devices) = gpus(2) else { return };
    scenarios::data_parallel::unwritten_gradients_fail_every_rank(
        &devices,
        burn_graphed::Collective::AllReduce {
            devices: devices.clone(),
        },
    );
}

/// The same on four GPUs, a quarter of every batch each (skipped on fewer GPUs).
#[test]
fn data_parallel_whole_steps_four_gpus_match_one_model() {
    let Some(devices) = gpus(4) else { return };
    scenarios::data_parallel::whole_steps_match_one_model(
        &devices,
        burn_graphed::Collective::AllReduce {
            devices: devices.clone(),
        },
    );
}

/// Data-parallel whole steps on two GPUs whose ranks differ (a failed capture, another
/// learning rate, replicas that start apart, a refused step) fail on both with a typed error,
/// before NCCL could hang (skipped on one GPU).
#[test]
fn data_parallel_whole_step_ranks_that_differ_fail_together() {
    let Some(devices) = gpus(2) else { return };
    scenarios::data_parallel::whole_step_ranks_that_differ_fail_together(
        &devices,
        burn_graphed::Collective::AllReduce {
            devices: devices.clone(),
        },
    );
}

/// The same through the host, on two GPUs (no NCCL): the replicas' graphs on two devices.
#[test]
fn data_parallel_host_replicas_match_one_model() {
    let Some(devices) = gpus(2) else { return };
    scenarios::data_parallel::replicas_match_one_model(&devices, burn_graphed::Collective::Host);
}

/// Ranks that are threads of one process, one per GPU, each step's bucket averaged by
/// burn-graphed's NCCL communicator inside the step's one graph (`Collective::Nccl { in_graph:
/// true }` from `DataParallel::group`): the ranks warm up, record and replay at once, the
/// devices recording in CUDA's thread-local capture mode; every step replays, the replicas are
/// bitwise equal and equal one model trained on the whole batches, with Adam and with SGD;
/// replicas trained apart differ (skipped on one GPU).
#[test]
fn data_parallel_threads_nccl_in_graph_matches_one_model() {
    let Some(devices) = gpus(2) else { return };
    let in_graph = burn_graphed::Collective::Nccl { in_graph: true };
    scenarios::data_parallel::whole_steps_match_one_model(&devices, in_graph);
}

/// The same with the all-reduces started during the backward, a bucket per parameter on the
/// side stream beside it (`testing::overlap_all_reduces(true)`; skipped on one GPU).
#[test]
fn data_parallel_threads_nccl_in_graph_overlap_matches_one_model() {
    let Some(devices) = gpus(2) else { return };
    scenarios::data_parallel::overlapped_whole_steps_match_one_model(&devices);
}

/// The same with the all-reduce between the step's two graphs (`in_graph: false`), NCCL
/// between threads (skipped on one GPU).
#[test]
fn data_parallel_threads_nccl_two_graphs_matches_one_model() {
    let Some(devices) = gpus(2) else { return };
    let two_graphs = burn_graphed::Collective::Nccl { in_graph: false };
    scenarios::data_parallel::whole_steps_match_one_model(&devices, two_graphs);
}

/// The same in graph on four GPUs, a quarter of every batch each (skipped on fewer GPUs).
#[test]
fn data_parallel_threads_nccl_in_graph_four_gpus_match_one_model() {
    let Some(devices) = gpus(4) else { return };
    let in_graph = burn_graphed::Collective::Nccl { in_graph: true };
    scenarios::data_parallel::whole_steps_match_one_model(&devices, in_graph);
}

/// Thread ranks with the all-reduce inside the graph whose batches change shape capture the
/// new shapes at once after an eager step and replay them (skipped on one GPU).
#[test]
fn data_parallel_threads_nccl_in_graph_captures_new_shapes_together() {
    let Some(devices) = gpus(2) else { return };
    let in_graph = burn_graphed::Collective::Nccl { in_graph: true };
    scenarios::data_parallel::whole_steps_capture_new_shapes_together(&devices, in_graph);
}

/// Thread ranks with the all-reduce inside the graph that differ (a failed capture, another
/// learning rate, replicas that start apart, a refused step) fail on both with a typed error,
/// before NCCL could hang (skipped on one GPU).
#[test]
fn data_parallel_threads_nccl_in_graph_ranks_that_differ_fail_together() {
    let Some(devices) = gpus(2) else { return };
    let in_graph = burn_graphed::Collective::Nccl { in_graph: true };
    scenarios::data_parallel::whole_step_ranks_that_differ_fail_together(&devices, in_graph);
}

/// One thread rank with the all-reduce inside the graph, on one GPU: the thread group's NCCL
/// communicator, its warm-ups and its recording in thread-local capture mode, one graph a
/// step, equal one model trained eagerly on the same batches, and moved by training.
#[test]
fn data_parallel_threads_nccl_in_graph_one_rank_matches_one_model() {
    scenarios::data_parallel::one_rank_in_graph_matches_one_model(&cuda());
}

/// One thread rank with the all-reduce inside the graph and a bucket per parameter: the buckets
/// start during the backward, and the replica equals one model and the one-bucket replica.
#[test]
fn data_parallel_threads_nccl_in_graph_buckets_start_during_the_backward() {
    scenarios::data_parallel::one_rank_in_graph_buckets_start_during_the_backward(&cuda());
}

/// NCCL's mean on one GPU: in the bucket's own buffer where it alone holds the bucket, into a
/// new buffer where the bucket is held elsewhere too.
#[test]
fn data_parallel_nccl_mean_in_place_only_when_unshared() {
    scenarios::data_parallel::nccl_mean_in_place_only_when_unshared(&[cuda()]);
}

/// The same on two GPUs, where the mean differs from each rank's values: a bucket held
/// elsewhere keeps its own (skipped on one GPU).
#[test]
fn data_parallel_nccl_mean_in_place_only_when_unshared_two_gpus() {
    let Some(devices) = gpus(2) else { return };
    scenarios::data_parallel::nccl_mean_in_place_only_when_unshared(&devices);
}

/// A recording in thread-local capture mode (burn-graphed's) holds while another thread of the
/// process allocates and frees device memory without pause; in global mode (the release's, the
/// control) that thread's calls fail or the recordings are refused.
#[test]
fn capture_thread_local_lets_other_threads_call_cuda() {
    scenarios::capture_mode::other_threads_call_cuda_during_captures(&cuda());
}

/// Two processes, one per GPU (as `cargo xtask launch --nproc 2` starts them), each step's
/// bucket averaged by NCCL inside the step's one graph (`Collective::Nccl { in_graph: true }`):
/// every step replays, the replicas are bitwise equal and equal one model trained on the whole
/// batches, with Adam and with SGD; replicas trained apart differ (skipped on one GPU).
#[test]
fn data_parallel_process_nccl_in_graph_matches_one_model() {
    let Some(devices) = gpus(2) else { return };
    scenarios::processes::nccl_processes_match_one_model(PROCESS_CHILD, &devices, Place::InGraph);
}

/// The same with the all-reduces started during the backward, a bucket per parameter on a
/// side stream beside it (`testing::overlap_all_reduces(true)` in every rank's process;
/// skipped on one GPU).
#[test]
fn data_parallel_process_nccl_in_graph_overlap_matches_one_model() {
    let Some(devices) = gpus(2) else { return };
    scenarios::processes::nccl_processes_match_one_model(
        PROCESS_CHILD,
        &devices,
        Place::InGraphOverlap,
    );
}

/// The same with the all-reduce between the step's two graphs (`in_graph: false`, the
/// fallback), NCCL between processes (skipped on one GPU).
#[test]
fn data_parallel_process_nccl_two_graphs_matches_one_model() {
    let Some(devices) = gpus(2) else { return };
    scenarios::processes::nccl_processes_match_one_model(PROCESS_CHILD, &devices, Place::TwoGraphs);
}

/// The same in graph, with NCCL on its network transport over the loopback (sockets;
/// peer-to-peer and shared memory off), as two machines would run it; the children's NCCL log
/// must name the socket transport (skipped on one GPU).
#[test]
fn data_parallel_process_nccl_in_graph_over_sockets_matches_one_model() {
    let Some(devices) = gpus(2) else { return };
    scenarios::processes::nccl_over_sockets_matches_one_model(PROCESS_CHILD, &devices);
}

/// The child processes of the `data_parallel_process_nccl_*` tests.
const PROCESS_CHILD: &str = "data_parallel_process_child";

/// A rank dies right after a step's agreement, its peer inside that step's all-reduce: the
/// peer gets `RankFailed` naming it within 30 s (its NCCL communicator aborted) and its
/// device computes after; with the abort off, the peer still waits 20 s later (the negative
/// control). Skipped on one GPU.
#[test]
fn data_parallel_process_rank_dies_mid_step_fails_the_others() {
    let Some(_) = gpus(2) else { return };
    scenarios::process_faults::rank_dies_mid_step_fails_the_others(FAULT_CHILD);
}

/// NCCL reports an asynchronous error on one rank mid-step (injected into the watchdog's
/// poll): every rank gets a typed error within 30 s (skipped on one GPU).
#[test]
fn data_parallel_process_nccl_error_fails_every_rank() {
    let Some(_) = gpus(2) else { return };
    scenarios::process_faults::nccl_error_fails_every_rank(FAULT_CHILD);
}

/// One process's capture fails: every rank gets `RankFailed` naming it, and every device
/// computes after (skipped on one GPU).
#[test]
fn data_parallel_process_capture_fails_on_one_rank_fails_every_rank() {
    let Some(_) = gpus(2) else { return };
    scenarios::process_faults::capture_fails_on_one_rank_fails_every_rank(FAULT_CHILD);
}

/// A rank whose peer never starts gets a typed error after the group's timeout, hosting or
/// joining (skipped on one GPU).
#[test]
fn data_parallel_process_rendezvous_never_completes_fails_in_bounded_time() {
    let Some(_) = gpus(2) else { return };
    scenarios::process_faults::rendezvous_never_completes_fails_in_bounded_time(FAULT_CHILD);
}

/// The child processes of the `data_parallel_process_*` fault tests.
const FAULT_CHILD: &str = "data_parallel_process_fault_child";

/// A rank of the `data_parallel_process_*` fault tests, which start it.
#[test]
#[ignore = "a child process of the data_parallel_process_* fault tests"]
fn data_parallel_process_fault_child() {
    assert!(
        std::env::var_os(scenarios::process_faults::FAULT).is_some(),
        "run by the data_parallel_process_* fault tests"
    );
    scenarios::process_faults::child(&cuda());
}

/// A rank of the `data_parallel_process_nccl_*` tests, which start it.
#[test]
#[ignore = "a child process of the data_parallel_process_nccl_* tests"]
fn data_parallel_process_child() {
    assert!(
        std::env::var_os(scenarios::processes::CHILD).is_some(),
        "run by the data_parallel_process_nccl_* tests"
    );
    scenarios::processes::child(&cuda());
}

/// UPSTREAM.md 8, run by hand on 2 GPUs (`run.sh tests --ignored upstream_8`): a graphed
/// callable that ends in burn's all-reduce, captured by two ranks of one process. Each test
/// prints what happened; a watchdog ends the process with a `reproduced:` line when the ranks
/// are still waiting after 90 s (a collective waiting for a rank that never comes).
mod upstream_8 {
    use std::sync::OnceLock;
    use std::time::Duration;

    use burn::tensor::distributed::ReduceOperation;
    use burn_graphed::{Collective, DataParallel, Graphed, GraphedConfig, replica_on};

    use super::scenarios::Mlp;
    use super::*;

    static GPUS: OnceLock<Vec<Device>> = OnceLock::new();

    /// The mean square of the MLP's output, averaged over the ranks by burn's all-reduce.
    fn reduced_loss(model: &Mlp, x: Tensor<2>) -> Tensor<1> {
        let loss = model.forward(x).powi_scalar(2).mean();
        let gpus = GPUS.get().expect("the GPUs").clone();
        burn::tensor::distributed::all_reduce(loss, ReduceOperation::Mean, gpus).resolve()
    }

    /// Both ranks capture `reduced_loss`, one at a time (`in_turn`) or at once.
    fn capture(in_turn: bool) {
        let Some(gpus) = gpus(2) else { return };
        GPUS.set(gpus.clone()).expect("set once");
        let what = if in_turn { "in turn" } else { "at once" };
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(90));
            println!(
                "reproduced: two ranks capturing a collective {what}: still waiting after 90 s"
            );
            std::process::exit(0);
        });
        let devices: Vec<Device> = gpus.iter().map(|d| d.clone().autodiff()).collect();
        let model = Mlp::new(16, 2, 4, &devices[0]);
        let group = DataParallel::group(
            2,
            Duration::from_secs(600),
            Collective::AllReduce { devices: gpus },
        )
        .expect("group");
        let results: Vec<String> = std::thread::scope(|scope| {
            let ranks: Vec<_> = group
                .into_iter()
                .zip(&devices)
                .map(|(dp, device)| {
                    let model = &model;
                    scope.spawn(move || {
                        let replica = replica_on(model, device);
                        let sample = Tensor::<2>::ones([4, 16], device);
                        let make =
                            || Graphed::new(replica, reduced_loss, sample, &GraphedConfig::new());
                        let graphed = if in_turn {
                            dp.in_turn("capture", device, make)
                        } else {
                            make()
                        };
                        match graphed {
                            Ok(graphed) => {
                                let loss = graphed.forward(Tensor::ones([4, 16], device));
                                format!(
                                    "captured; a call: {:?}",
                                    loss.map(|l| l.into_data().try_to_vec::<f32>())
                                )
                            }
                            Err(error) => format!("capture failed: {error}"),
                        }
                    })
                })
                .collect();
            ranks
                .into_iter()
                .map(|rank| rank.join().map_err(|_| "panicked".to_string()))
                .map(|r| r.unwrap_or_else(|e| e))
                .collect()
        });
        for (rank, result) in results.iter().enumerate() {
            println!("not hung: two ranks capturing a collective {what}: rank {rank}: {result}");
        }
    }

    #[test]
    #[ignore = "UPSTREAM.md 8: may hang until its watchdog; run by hand on 2 GPUs"]
    fn upstream_8_collective_captured_in_turn() {
        capture(true);
    }

    #[test]
    #[ignore = "UPSTREAM.md 8: may hang until its watchdog; run by hand on 2 GPUs"]
    fn upstream_8_collective_captured_at_once() {
        capture(false);
    }
}

/// UPSTREAM.md 9, run by hand on 2 GPUs (`run.sh tests --ignored upstream_9`): two ranks call
/// burn's all-reduce on a tensor each, rank 1's made from memory the device never wrote. cubecl
/// skips that rank's collective; rank 0's then waits in NCCL. A watchdog ends the process with a
/// `reproduced:` line when rank 0 is still waiting after 60 s; otherwise each rank prints what
/// its read of the result gave.
#[test]
#[ignore = "UPSTREAM.md 9: may hang until its watchdog; run by hand on 2 GPUs"]
fn upstream_9_collective_skipped_on_one_rank() {
    use burn::tensor::distributed::ReduceOperation;
    use std::time::Duration;

    let Some(gpus) = gpus(2) else { return };
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(60));
        println!("reproduced: one rank's collective skipped, the other still waiting after 60 s");
        std::process::exit(0);
    });
    let results: Vec<String> = std::thread::scope(|scope| {
        let ranks: Vec<_> = gpus
            .iter()
            .enumerate()
            .map(|(rank, device)| {
                let gpus = gpus.clone();
                scope.spawn(move || {
                    let tensor = if rank == 1 {
                        scenarios::recovery::unwritten([4, 4], device).reshape([16])
                    } else {
                        Tensor::<1>::ones([16], device)
                    };
                    let reduced =
                        burn::tensor::distributed::all_reduce(tensor, ReduceOperation::Mean, gpus)
                            .resolve();
                    let read = reduced
                        .try_into_data()
                        .map(|_| "values")
                        .map_err(|e| e.to_string());
                    format!("rank {rank}: {read:?}")
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|rank| rank.join().expect("rank thread"))
            .collect()
    });
    println!("not reproduced: both ranks came back: {results:?}");
}

/// ROBUSTNESS.md, row by row: the scenarios of the rows that had no test.
mod robustness {
    use super::{cuda, scenarios};

    #[test]
    fn dtype_change_falls_back_or_errors() {
        scenarios::robust::dtype_change_falls_back_or_errors(&cuda());
    }

    #[test]
    fn changed_parameters_are_refused() {
        scenarios::robust::changed_parameters_are_refused(&cuda());
    }

    #[test]
    fn require_graphs_refuses_a_backend_without_graphs() {
        scenarios::robust::require_graphs_refuses_a_backend_without_graphs(&cuda());
    }

    #[test]
    fn group_errors_name_the_callable() {
        scenarios::robust::group_errors_name_the_callable(&cuda());
    }

    #[test]
    fn fused_adam_stepping_a_clone_matches_eager() {
        scenarios::robust::fused_adam_stepping_a_clone_matches_eager(&cuda());
    }

    #[test]
    fn panicking_forward_is_recovered() {
        scenarios::recovery::panicking_forward_is_recovered(&cuda());
    }

    #[test]
    fn panicking_loss_is_recovered() {
        scenarios::recovery::panicking_loss_is_recovered(&cuda());
    }

    #[test]
    fn batch_norm_is_refused() {
        scenarios::batch_norm::batch_norm_is_refused(&cuda());
    }

    /// burn's `BatchNorm` in a whole step (with `allow_non_trainable_params`): losses, trained
    /// parameters and running statistics against eager training.
    #[test]
    fn batch_norm_whole_step_matches_eager() {
        scenarios::batch_norm::batch_norm_whole_step_matches_eager(&cuda(), 10, 1);
    }

    /// The same over two micro-batches a step.
    #[test]
    fn batch_norm_accumulated_step_matches_eager() {
        scenarios::batch_norm::batch_norm_whole_step_matches_eager(&cuda(), 6, 2);
    }
}

/// Diagnostic, run by hand (under contention, several processes per GPU): the same eager
/// gradients, repeated on one model and on a deep copy, bit for bit
/// (`scenarios::optim::eager_gradients_repeat`).
#[test]
#[ignore = "diagnostic: run by hand, several processes per GPU"]
fn eager_gradients_repeat() {
    let differed = scenarios::optim::eager_gradients_repeat(&cuda(), 50);
    assert_eq!(
        differed, 0,
        "the same eager gradients differed {differed} times"
    );
}

/// `NAME => SCENARIO, DTYPE;` makes the test `NAME` running the scenario on CUDA in that float
/// dtype. The exact comparisons are one test per dtype (named as the CPU suite's): each
/// compiles and tunes its own kernels, so that `run.sh tests --jobs` runs the dtypes in
/// parallel processes rather than one process running the three in turn.
macro_rules! per_dtype {
    ($($(#[$doc:meta])* $name:ident => $scenario:path, $dtype:ident;)+) => {
        $($(#[$doc])* #[test] fn $name() { $scenario(&cuda(), burn::tensor::FloatDType::$dtype); })+
    };
}

per_dtype! {
    /// The fused layer norm against the exact norm and burn-nn's, forward and gradients
    /// (`scenarios::fused_norm`).
    layer_norm_matches_exact_f32 => scenarios::fused_norm::layer_norm_matches_exact, F32;
    layer_norm_matches_exact_f16 => scenarios::fused_norm::layer_norm_matches_exact, F16;
    layer_norm_matches_exact_bf16 => scenarios::fused_norm::layer_norm_matches_exact, BF16;
    /// The fused RMS norm, likewise.
    rms_norm_matches_exact_f32 => scenarios::fused_norm::rms_norm_matches_exact, F32;
    rms_norm_matches_exact_f16 => scenarios::fused_norm::rms_norm_matches_exact, F16;
    rms_norm_matches_exact_bf16 => scenarios::fused_norm::rms_norm_matches_exact, BF16;
    /// The fused attention against the exact attention and burn's, output and gradients, with
    /// and without masks (`scenarios::fused_attention`).
    attention_matches_exact_f32 => scenarios::fused_attention::attention_matches_exact, F32;
    /// The fused softmax cross-entropy against the exact loss and burn-nn's, loss and logit
    /// gradient (`scenarios::fused_loss`).
    cross_entropy_matches_exact_f32 => scenarios::fused_loss::cross_entropy_matches_exact, F32;
    cross_entropy_matches_exact_f16 => scenarios::fused_loss::cross_entropy_matches_exact, F16;
    cross_entropy_matches_exact_bf16 => scenarios::fused_loss::cross_entropy_matches_exact, BF16;
    /// The linear layer with a residual (`Linear::forward_add`: the small kernel and cuBLASLt's
    /// `C`) against the exact values and burn's composition, output and gradients.
    linear_add_matches_exact_f32 => scenarios::fused_linear::linear_add_matches_exact, F32;
    linear_add_matches_exact_f16 => scenarios::fused_linear::linear_add_matches_exact, F16;
    /// The linear layer through a ReLU (`Linear::forward_relu`: the small kernel and cuBLASLt's
    /// `RELU_BIAS` epilogue) against the exact values, output and gradients.
    linear_relu_matches_exact_f32 => scenarios::fused_linear::linear_relu_matches_exact, F32;
    linear_relu_matches_exact_f16 => scenarios::fused_linear::linear_relu_matches_exact, F16;
    linear_relu_matches_exact_bf16 => scenarios::fused_linear::linear_relu_matches_exact, BF16;
}

/// The fused layer norm inside a graphed call equals its eager call, bit for bit.
#[test]
fn layer_norm_graphed_matches_eager() {
    scenarios::fused_norm::layer_norm_graphed_matches_eager(&cuda());
}

/// burn-nn's layer norm checkpoint loads into the fused module and back.
#[test]
fn layer_norm_checkpoints_load_both_ways() {
    scenarios::fused_norm::layer_norm_checkpoints_load_both_ways(&cuda());
}

/// The encoder with fused norms against burn-nn's: checkpoints both ways, outputs within the
/// bound.
#[test]
fn encoder_matches_burn_nn() {
    scenarios::fused_attention::encoder_matches_burn_nn(&cuda());
}

/// The fused multi-head attention against burn-nn's (checkpoints both ways, context and
/// gradients within the bound), and graphed against eager, bit for bit.
#[test]
fn mha_matches_burn_nn() {
    scenarios::fused_attention::mha_matches_burn_nn(&cuda());
}

/// The forms the fused cross-entropy does not take are burn-nn's.
#[test]
fn cross_entropy_other_forms_are_burn_nn() {
    scenarios::fused_loss::cross_entropy_other_forms_are_burn_nn(&cuda());
}

/// A graphed call holding the fused cross-entropy equals its eager call, bit for bit.
#[test]
fn cross_entropy_graphed_matches_eager() {
    scenarios::fused_loss::cross_entropy_graphed_matches_eager(&cuda());
}

/// Exact comparisons run in parts of a few cases (`$scenario(device, dtype, cases)`): their
/// references tune per shape on CUDA, burn's attention about 150 s a case in `f16`/`bf16` and
/// burn-nn's matmuls a minute or more, more than one test process's time for all cases.
macro_rules! in_parts {
    ($scenario:path { $($(#[$attr:meta])* $name:ident => $dtype:ident, $cases:expr;)+ }) => {
        $($(#[$attr])* #[test] fn $name() {
            $scenario(&cuda(), burn::tensor::FloatDType::$dtype, $cases);
        })+
    };
}

// The linear layer (few rows: our kernel; more: cuBLASLt) against the exact product and
// burn-nn's, output and gradients.
in_parts!(scenarios::fused_linear::linear_matches_exact_in {
    linear_matches_exact_f32_cases_0_4 => F32, 0..5;
    linear_matches_exact_f32_cases_5_8 => F32, 5..9;
    linear_matches_exact_f16_cases_0_2 => F16, 0..3;
    linear_matches_exact_f16_cases_3_5 => F16, 3..6;
    linear_matches_exact_f16_cases_6_8 => F16, 6..9;
    linear_matches_exact_bf16_cases_0_2 => BF16, 0..3;
    linear_matches_exact_bf16_cases_3_5 => BF16, 3..6;
    linear_matches_exact_bf16_cases_6_8 => BF16, 6..9;
});

// The bf16 linear layer with a residual in three parts: burn-nn's reference tunes its bf16
// products per shape (H200, calls AQ and AR: cases 0 and 1 together 96 s, case 2 about 150 s,
// case 3 past the 280 s that remained).
in_parts!(scenarios::fused_linear::linear_add_matches_exact_in {
    linear_add_matches_exact_bf16_cases_0_1 => BF16, 0..2;
    linear_add_matches_exact_bf16_case_2 => BF16, 2..3;
    linear_add_matches_exact_bf16_case_3 => BF16, 3..4;
});

// The fused attention's `f16` and `bf16` cases, five parts each (cases 1 and 4 to 7 on tensor
// cores). Cases 5 and 6 (a padding and a full mask at head dimensions 16 and 32) take their
// bound from burn's composition without the mask: with it, on CUDA in these dtypes, burn's
// composition and its flash attention were 1.26 and 1.24 of the output's magnitude off the
// exact values (H200; UPSTREAM.md 19; `benches/results/h200x2_tc_attention_tests_logs.tar.xz`).
in_parts!(scenarios::fused_attention::attention_matches_exact_in {
    attention_matches_exact_f16_cases_0_1 => F16, 0..2;
    attention_matches_exact_f16_cases_2_3 => F16, 2..4;
    attention_matches_exact_f16_case_4 => F16, 4..5;
    attention_matches_exact_bf16_cases_0_1 => BF16, 0..2;
    attention_matches_exact_bf16_cases_2_3 => BF16, 2..4;
    attention_matches_exact_bf16_case_4 => BF16, 4..5;
    attention_matches_exact_f16_case_7 => F16, 7..8;
    attention_matches_exact_bf16_case_7 => BF16, 7..8;
});

in_parts!(scenarios::fused_attention::attention_matches_exact_unmasked_reference_in {
    attention_matches_exact_f16_cases_5_6 => F16, 5..7;
    attention_matches_exact_bf16_cases_5_6 => BF16, 5..7;
});

/// Attention in `f16`, `bf16` and `f32` with head dimension 32 runs on tensor cores, forward
/// and backward, the same values on a second call.
#[test]
fn attention_runs_on_tensor_cores() {
    scenarios::fused_attention::attention_runs_on_tensor_cores(&cuda());
}

#[test]
fn packed_attention_matches_separate() {
    use burn::tensor::FloatDType;
    for (dtype, tensor_cores) in [
        (FloatDType::F32, true),
        (FloatDType::F16, true),
        (FloatDType::BF16, true),
    ] {
        scenarios::fused_attention::packed_attention_matches_separate(&cuda(), dtype, tensor_cores);
    }
}

/// The fused convolution against the exact convolution, output and gradients, per dtype.
#[test]
fn conv_matches_exact_f32() {
    scenarios::fused_conv::conv_matches_exact(&cuda(), burn::tensor::FloatDType::F32);
}

/// As [`conv_matches_exact_f32`], in `f16`.
#[test]
fn conv_matches_exact_f16() {
    scenarios::fused_conv::conv_matches_exact(&cuda(), burn::tensor::FloatDType::F16);
}

/// As [`conv_matches_exact_f32`], in `bf16` (where burn-cubecl's own convolution does not train
/// correctly: BENCHMARKS.md).
#[test]
fn conv_matches_exact_bf16() {
    scenarios::fused_conv::conv_matches_exact(&cuda(), burn::tensor::FloatDType::BF16);
}

/// The fused `Conv2d` computes what burn-nn's does (`Same` padding, a stride), within both
/// computations' bounds.
#[test]
fn conv_matches_burn_nn() {
    scenarios::fused_conv::conv_matches_burn_nn(&cuda());
}

/// A graphed call of a small CNN with the fused convolutions equals its eager call, bit for bit.
#[test]
fn conv_graphed_matches_eager() {
    scenarios::fused_conv::conv_graphed_matches_eager(&cuda());
}

/// burn's adaptive average pool after a fused ReLU, to `1x1` (no NHWC relayout with the carried
/// burn-cubecl-fusion) and to `2x3`, within the `f32` sums' bound of the exact means.
#[test]
fn global_pool_after_elementwise_matches_exact() {
    scenarios::global_pool::global_pool_after_elementwise_matches_exact(&cuda());
}

/// The fused embedding's output equals burn's gather and its table gradient the exact one, per
/// dtype.
#[test]
fn embedding_matches_exact_f32() {
    scenarios::fused_embedding::embedding_matches_exact(&cuda(), burn::tensor::FloatDType::F32);
}

/// As [`embedding_matches_exact_f32`], in `f16`.
#[test]
fn embedding_matches_exact_f16() {
    scenarios::fused_embedding::embedding_matches_exact(&cuda(), burn::tensor::FloatDType::F16);
}

/// As [`embedding_matches_exact_f32`], in `bf16`.
#[test]
fn embedding_matches_exact_bf16() {
    scenarios::fused_embedding::embedding_matches_exact(&cuda(), burn::tensor::FloatDType::BF16);
}

/// A graphed call of a model with the fused embedding equals its eager call, bit for bit.
#[test]
fn embedding_graphed_matches_eager() {
    scenarios::fused_embedding::embedding_graphed_matches_eager(&cuda());
}

/// A graphed call of the linear layers (one row and 48) equals its eager call, bit for bit.
#[test]
fn linear_graphed_matches_eager() {
    scenarios::fused_linear::linear_graphed_matches_eager(&cuda());
}

/// The GPU machines have `libcublasLt`: the linear layers' products run through it there, and
/// a machine without it fails this test rather than measuring burn's matmuls unannounced.
#[test]
fn linear_products_run_through_cublaslt() {
    assert!(
        burn_graphed::testing::vendor_matmul_available(&cuda()),
        "cuBLASLt is not available: libcublasLt not found on LD_LIBRARY_PATH, or \
         BURN_GRAPHED_VENDOR_MATMUL=off"
    );
}

/// A model of fused layers only, trained in whole steps against burn's optimizer.
#[test]
fn fused_model_whole_step_matches_eager() {
    scenarios::fused_loss::fused_model_whole_step_matches_eager(&cuda());
}

/// Set in the children of [`kernel_cache_serves_compiled_kernels_to_the_next_process`].
const KERNEL_CACHE_CHILD: &str = "BURN_GRAPHED_TEST_KERNEL_CACHE_CHILD";

/// The kernel cache, on by default (here in a directory of the test's own), serves the next
/// process every kernel the first compiled: the second process compiles none. Counted from
/// cubecl's compilation log, which writes each kernel it compiles and none it loads; the
/// first process's count is the control (the log sees compilations where they happen). On
/// wgpu the CPU suite can show this only for autotune picks (cubecl stores no WGSL kernels).
#[test]
fn kernel_cache_serves_compiled_kernels_to_the_next_process() {
    let dir = std::env::temp_dir().join(format!("gpu-kernel-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    let compiled = |run: usize| {
        let log = dir.join(format!("compilations-{run}.log"));
        let out = std::process::Command::new(std::env::current_exe().expect("this binary"))
            .args(["--exact", "kernel_cache_child", "--ignored", "--nocapture"])
            .env(KERNEL_CACHE_CHILD, "1")
            .env(burn_graphed::KERNEL_CACHE_VAR, dir.join("cache"))
            .env("CUBECL_DEBUG_LOG", &log)
            .output()
            .expect("a child process");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "child {run}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter(|line| *line == "[START_KERNEL_COMPILATION]")
            .count()
    };
    let first = compiled(1);
    let second = compiled(2);
    let _ = std::fs::remove_dir_all(&dir);
    println!("kernels compiled: first process {first}, second {second}");
    assert!(first > 0, "the first process compiled nothing");
    assert_eq!(
        second, 0,
        "the second process compiled kernels the cache held"
    );
}

/// The child process of [`kernel_cache_serves_compiled_kernels_to_the_next_process`].
#[test]
#[ignore = "a child process of kernel_cache_serves_compiled_kernels_to_the_next_process"]
fn kernel_cache_child() {
    assert!(
        std::env::var_os(KERNEL_CACHE_CHILD).is_some(),
        "run by kernel_cache_serves_compiled_kernels_to_the_next_process"
    );
    let device = cuda();
    let x = Tensor::<1>::ones([4096], &device);
    let sum = (x.clone() * 2.0).sum().into_scalar::<f32>();
    assert_eq!(sum, 8192.0);
    let exp = x.exp().sum().into_scalar::<f32>();
    let expected = 4096.0 * std::f32::consts::E;
    assert!((exp - expected).abs() <= 1e-5 * expected, "{exp}");
    assert!(
        burn_graphed::kernel_cache_location().is_some(),
        "the cache is on"
    );
}
