//! `FusedAdam` and `MultiTensorAdam`: burn's Adam as one operation per parameter or per step,
//! bit for bit, updating the graphs' static parameter buffers in place where no user tensor can
//! observe it.

use super::*;
use burn::optim::ModuleOptimizer;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::tensor::FloatDType;
use burn_graphed_testkit::{ModuleStep, deep_copy};

/// One eager step of `model` on `x` with `optim`.
fn eager_step<S: ModuleStep>(model: Mlp, optim: &mut S, x: Tensor<2>, lr: f64) -> Mlp {
    let loss = square_mean(model.forward(x));
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    optim.step_module(lr, model, grads)
}

/// `N` sets of the gradients of one backward of `model` on `x` (the same tensors in each),
/// for comparing optimizers on the same gradients. Two backwards, even of equal models, need
/// not give equal gradients on CUDA: cubecl tunes each matrix product per layout (a deep copy's
/// rows are laid out anew), and the picks for two layouts may differ, TF32 tensor cores in one
/// and f32 in the other, by the timing of their tuning (seen with eight test processes on a
/// GPU: the first backward of a model differed from every later one in four of eight
/// processes). Optimizer comparisons state the optimizers' arithmetic, not that.
fn shared_gradients<const N: usize>(model: &Mlp, x: Tensor<2>) -> [GradientsParams; N] {
    struct Copies<'a>(&'a GradientsParams, Vec<GradientsParams>);
    impl burn::module::ModuleVisitor for Copies<'_> {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            if let Some(grad) = self.0.get::<D>(param.id) {
                for copy in &mut self.1 {
                    copy.register(param.id, grad.clone());
                }
            }
        }
    }
    let loss = square_mean(model.forward(x));
    let first = GradientsParams::from_grads(loss.backward(), model);
    let mut others = Copies(&first, (1..N).map(|_| GradientsParams::new()).collect());
    model.visit(&mut others);
    let Copies(_, copies) = others;
    let mut all = std::iter::once(first).chain(copies);
    std::array::from_fn(|_| all.next().expect("N sets"))
}

/// The two module optimizers of `FusedAdam`: per parameter (through burn's `ModuleOptimizer`)
/// and multi-tensor.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    /// `FusedAdamConfig::init`.
    PerParam,
    /// `FusedAdamConfig::init_multi_tensor`.
    MultiTensor,
}

impl Kind {
    /// The `FusedAdam` module optimizer of this kind ([`fused_adam_config`]: burn's defaults
    /// but the suite's [`ADAM_EPSILON`]).
    pub fn optimizer(self) -> AnyFusedAdam {
        let config = fused_adam_config();
        match self {
            Kind::PerParam => AnyFusedAdam::PerParam(config.init()),
            Kind::MultiTensor => AnyFusedAdam::MultiTensor(config.init_multi_tensor()),
        }
    }
}

/// A `FusedAdam` module optimizer of either [`Kind`].
#[derive(Clone)]
pub enum AnyFusedAdam {
    PerParam(ModuleOptimizer),
    MultiTensor(burn_graphed::MultiTensorAdam),
}

impl ModuleStep for AnyFusedAdam {
    fn step_module<M: Module>(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        match self {
            AnyFusedAdam::PerParam(optim) => optim.step(lr, module, grads),
            AnyFusedAdam::MultiTensor(optim) => optim.step(lr, module, grads),
        }
    }
}

/// Every one of `steps` calls replayed both graphs, none fell back, and only the first call
/// copied parameters: the optimizer wrote the graphs' parameter buffers itself after that.
pub fn assert_updated_in_place(report: &burn_graphed_testkit::EquivalenceReport, steps: usize) {
    assert_eq!(report.stats.forward_replays, steps as u64, "{report}");
    assert_eq!(report.stats.backward_replays, steps as u64, "{report}");
    assert_eq!(
        report.stats.param_copies, report.summary.params as u64,
        "only the first call copies parameters: {report}"
    );
    assert_eq!(report.stats.total_eager(), 0, "{report}");
}

/// Without graphs, the multi-tensor optimizer computes what `FusedAdam` computes one parameter
/// at a time and what burn's `Adam` computes (the same kernel; within [`update_tolerance`]:
/// bit for bit on wgpu), with and without weight decay and gradient clipping, over several
/// steps, each on one backward's gradients ([`shared_gradients`]). A clone of the model kept
/// across a step keeps its values.
pub fn multi_tensor_adam_matches_fused_adam(device: &Device) {
    let device = device.clone().autodiff();
    let clipping = Some(GradientClippingConfig::Norm(0.5));
    for (decay, clipping) in [
        (None, None),
        (Some(WeightDecayConfig::new(0.05)), None),
        (None, clipping),
    ] {
        // Widths whose rows CUDA pitches (11 and 3 elements; see `graphed_fused_adam_pitched`).
        let model = Mlp::new(11, 3, 3, &device);
        let mut largest = largest_param(&model);
        let mut reference = deep_copy(&model);
        let mut per_param = deep_copy(&model);
        let mut multi = model;
        let reference_config = adam_config()
            .with_weight_decay(decay.clone())
            .with_grad_clipping(clipping.clone());
        let mut adam = reference_config.init();
        let config = fused_adam_config()
            .with_weight_decay(decay)
            .with_grad_clipping(clipping);
        let mut fused_adam = config.init();
        let mut multi_adam = config.init_multi_tensor();
        for step in 0..4 {
            let x = batch([8, 11], step, &device);
            let [for_reference, for_per_param, for_multi] = shared_gradients(&reference, x);
            reference = adam.step_module(1e-2, reference, for_reference);
            per_param = fused_adam.step_module(1e-2, per_param, for_per_param);
            // A clone kept across the step keeps its values: the update writes a parameter's
            // own buffer only where nothing else holds it.
            let snapshot = multi.clone();
            let frozen = param_values(&snapshot).expect("read back");
            multi = multi_adam.step_module(1e-2, multi, for_multi);
            assert_params_unchanged(&snapshot, &frozen);
            // Every parameter in the one operation on burn's cubecl backend (none on Flex).
            let on_cube = !format!("{device:?}").contains("Flex");
            let params = param_values(&multi).expect("read back").len();
            let expected = if on_cube { params } else { 0 };
            assert_eq!(multi_adam.last_batched(), expected, "{device:?}");
            let what = format!("step {step} ({multi_adam:?})");
            largest = largest.max(largest_param(&reference));
            let tolerance = update_tolerance(&device, FloatDType::F32, largest, step + 1);
            assert_params_close(&what, &per_param, &multi, tolerance);
            assert_params_close(&what, &reference, &multi, tolerance);
        }
    }
}

/// Parameters at different step counts share one operation: the first step leaves out the
/// first layer's gradients, so from then on the first layer is one step behind the rest (two
/// sets of bias corrections in one batch). Matches burn's `Adam` given the same gradients
/// (within [`update_tolerance`]: bit for bit on wgpu).
pub fn multi_tensor_adam_mixes_step_counts(device: &Device) {
    let device = device.clone().autodiff();
    let model = Mlp::new(16, 2, 4, &device);
    let mut largest = largest_param(&model);
    let mut reference = deep_copy(&model);
    let mut multi = model;
    let mut adam = adam_config().init();
    let mut multi_adam = fused_adam_config().init_multi_tensor();
    let first_layer = [
        multi.layers[0].weight.id,
        multi.layers[0].bias.as_ref().unwrap().id,
    ];
    for step in 0..3 {
        let x = batch([8, 16], step, &device);
        let [mut reference_grads, mut multi_grads] = shared_gradients(&reference, x);
        if step == 0 {
            for grads in [&mut reference_grads, &mut multi_grads] {
                let _ = grads.remove::<2>(first_layer[0]);
                let _ = grads.remove::<1>(first_layer[1]);
            }
        }
        reference = adam.step(1e-2, reference, reference_grads);
        multi = multi_adam.step(1e-2, multi, multi_grads);
        let what = format!("step {step}");
        largest = largest.max(largest_param(&reference));
        let tolerance = update_tolerance(&device, FloatDType::F32, largest, step + 1);
        assert_params_close(&what, &reference, &multi, tolerance);
    }
}

/// Graphed training with the multi-tensor optimizer equals eager training with burn's `Adam`,
/// and, like `FusedAdam`, writes the graphs' parameter buffers in place: only the first call
/// copies parameters.
pub fn graphed_multi_tensor_adam_matches_eager(device: &Device, steps: usize) {
    let optimizer = fused_adam_config().init_multi_tensor();
    let report = mlp_against_eager(device, steps, GraphedConfig::new(), optimizer);
    if report.summary.graphed {
        assert_updated_in_place(&report, steps);
    }
}

/// One unit in the last place of `magnitude` in `dtype`.
fn unit_at(dtype: FloatDType, magnitude: f64) -> f64 {
    let bits = burn_graphed_testkit::mantissa_bits(burn::tensor::DType::from(dtype));
    2f64.powi(magnitude.log2().floor() as i32 - bits as i32)
}

/// The largest magnitude of `model`'s parameters.
fn largest_param<M: Module>(model: &M) -> f64 {
    param_values(model)
        .expect("read back")
        .iter()
        .flat_map(|(_, data)| data.iter::<f32>())
        .fold(0.0f64, |largest, value| largest.max(f64::from(value.abs())))
}

/// How far the eager optimizers may be from burn's `Adam`, and from each other, after `steps`
/// updates in `dtype` of parameters never larger than `largest` in magnitude. They compute
/// burn's operations in burn's order and dtype, so where one compiler builds every kernel the
/// same way they agree bit for bit (wgpu on lavapipe, measured: `Tolerance::exact`). On CUDA,
/// NVRTC compiles each instantiation on its own (burn's fused Adam kernel; ours for one
/// parameter, and for a chunk of several), and a multiply and an add may be contracted into one
/// `fma` in one and not in another: one rounding more or less in the update `p - delta * lr` or
/// in a moment. Measured on an H200: elements one unit of the parameter apart from burn's (f32,
/// step 0), and up to 20 units of the result where the update nearly cancels the parameter
/// (half a unit of the parameter before the update). Such a rounding moves an element by at
/// most a unit in the last place of the larger of the parameter and its update, both below
/// `largest` (the largest magnitude so far) here, and each update may add one; the gradients
/// are shared (one backward), so parameter differences do not feed back: `steps` units of
/// `largest` in `dtype`, absolute. The smallest real error it must see, the negative control
/// of [`eager_adams_are_burns_in`] (a learning rate frozen at step 0's, 0.7x of it apart at step
/// 1), moves elements by about 0.3 lr (9e-3 at lr 3e-2) at step 1, against 2 units of the
/// MLP's largest parameter (about 0.3) in `bf16`, 3.9e-3, the widest bound here.
fn update_tolerance(
    device: &Device,
    dtype: burn::tensor::FloatDType,
    largest: f64,
    steps: usize,
) -> Tolerance {
    // Where two runs may run other kernels (CUDA), they may also be other instantiations.
    if !kernels_may_differ(device) {
        return Tolerance::exact();
    }
    Tolerance {
        abs: steps as f64 * unit_at(dtype, largest),
        ..Tolerance::exact()
    }
}

/// burn's `Adam`, `FusedAdam` (per parameter) and `MultiTensorAdam` (one operation), each
/// given one backward's gradients ([`shared_gradients`]), train an MLP in `dtype` to the same
/// parameters after each of four steps under a decaying learning rate, with and without weight
/// decay: bit for bit where one compiler builds every kernel alike, within one rounding of the
/// update per step on CUDA ([`update_tolerance`]). The update kernel computes burn's operations
/// in burn's order and dtype (`cube/update/update_kernel.rs`). The negative control:
/// `FusedAdam` kept at step 0's learning rate (a frozen schedule: 0.7x of it apart at step 1)
/// fails the same bound from step 1 on; its largest difference is printed beside the bound.
/// Where the device lacks `dtype`, a `skipped:` line.
pub fn eager_adams_are_burns_in(device: &Device, dtype: burn::tensor::FloatDType) {
    if !device.supports_dtype(dtype) {
        return super::skip::skip(&format!("the device has no {dtype:?}"));
    }
    let device = device.clone().autodiff();
    let lr = |step: usize| 3e-2 * 0.7f64.powi(step as i32);
    let on_cube = !format!("{device:?}").contains("Flex");
    for decay in [None, Some(WeightDecayConfig::new(0.05))] {
        // Widths whose rows CUDA pitches (11 and 3 elements).
        let model = burn_graphed_testkit::cast_params(&Mlp::new(11, 2, 3, &device), dtype);
        let mut reference = deep_copy(&model);
        let mut per_param = deep_copy(&model);
        let mut frozen = deep_copy(&model);
        let mut largest = largest_param(&model);
        let mut multi = model;
        let mut adam = adam_config().with_weight_decay(decay.clone()).init();
        let config = fused_adam_config().with_weight_decay(decay.clone());
        let (mut fused_adam, mut frozen_adam) = (config.init(), config.init());
        let mut multi_adam = config.init_multi_tensor();
        for step in 0..4 {
            let x = batch([8, 11], step, &device).cast(dtype);
            let [for_reference, for_per_param, for_multi, for_frozen] =
                shared_gradients(&reference, x);
            reference = adam.step(lr(step), reference, for_reference);
            per_param = fused_adam.step(lr(step), per_param, for_per_param);
            multi = multi_adam.step(lr(step), multi, for_multi);
            frozen = frozen_adam.step(lr(0), frozen, for_frozen);
            let params = param_values(&multi).expect("read back").len();
            assert_eq!(multi_adam.last_batched(), if on_cube { params } else { 0 });
            let what = format!("{dtype:?} decay {decay:?} step {step}");
            largest = largest.max(largest_param(&reference));
            let tolerance = update_tolerance(&device, dtype, largest, step + 1);
            assert_params_close(
                &format!("{what} FusedAdam"),
                &reference,
                &per_param,
                tolerance,
            );
            assert_params_close(
                &format!("{what} MultiTensorAdam"),
                &reference,
                &multi,
                tolerance,
            );
            let control = burn_graphed_testkit::compare_params(
                &format!("{what} control"),
                &reference,
                &frozen,
                tolerance,
            )
            .expect("read back");
            let caught = control.iter().any(|comparison| !comparison.passed());
            let worst = control
                .iter()
                .map(|comparison| comparison.max_abs)
                .fold(0.0f64, f64::max);
            println!(
                "{what}: the frozen learning rate differs by up to {worst:e}, the bound is {:e}",
                tolerance.abs
            );
            assert_eq!(
                caught,
                step > 0,
                "{what}: the control (frozen learning rate)"
            );
        }
    }
}

/// Graphed training with `FusedAdam` equals eager training with burn's `Adam`: outputs, losses,
/// gradients and parameters after every step. After the first step the optimizer writes the
/// graphs' parameter buffers itself, so only the first call copies parameters.
pub fn graphed_fused_adam_matches_eager(device: &Device, steps: usize) {
    let optimizer = fused_adam_config().init();
    let report = mlp_against_eager(device, steps, GraphedConfig::new(), optimizer);
    if report.summary.graphed {
        assert_updated_in_place(&report, steps);
    }
}

/// Graphed training with `FusedAdam` of `kind` on an MLP whose rows CUDA pitches equals eager
/// training with burn's `Adam`, and the update still goes into the graphs' parameter buffers:
/// only the first call copies parameters. cubecl 0.11 on CUDA pads each row of a new tensor to
/// a power-of-two number of bytes, so the `[11, 11]` and `[11, 3]` `f32` weights here have rows
/// 16 and 4 elements apart, and the graphs' static buffers too; the update kernels index
/// linearly, so they update those through dense copies (`cube/dense.rs`). On wgpu, which
/// allocates rows densely, this is the plain path.
pub fn graphed_fused_adam_pitched(device: &Device, kind: Kind, steps: usize) {
    let run = MlpRun {
        width: 11,
        depth: 2,
        out: 3,
        ..MlpRun::new(device)
    };
    let report = mlp_against_eager_with(device, run, steps, GraphedConfig::new(), kind.optimizer());
    if report.summary.graphed {
        assert_updated_in_place(&report, steps);
    }
}

/// A clone of the graphed module kept across optimizer steps (a snapshot) keeps its values:
/// while it lives, the optimizer writes new buffers and calls run eagerly
/// (`ParamBufferAliased`); once it is dropped, calls replay again. Training stays equal to
/// eager throughout.
pub fn fused_adam_keeps_snapshots(device: &Device, kind: Kind) {
    let mut fused_adam = kind.optimizer();
    let device = device.clone().autodiff();
    let lr = 1e-2;
    let model = Mlp::new(16, 2, 4, &device);
    let mut eager = deep_copy(&model);
    let mut check = ParamsCheck::new(&device, &model);
    let mut graphed = capture_mlp(model, batch([8, 16], 0, &device));
    let mut adam = adam_config().init();
    let mut step = 0;
    let mut train = |graphed: Graphed<Mlp, Tensor<2>, Tensor<2>>,
                     eager: Mlp,
                     steps: usize,
                     check: &mut ParamsCheck| {
        let (mut graphed, mut eager) = (graphed, eager);
        for _ in 0..steps {
            let x = batch([8, 16], step, &device);
            step += 1;
            let loss = square_mean(graphed.forward(x.clone()).expect("call"));
            let grads = GradientsParams::from_grads(loss.backward(), &graphed);
            graphed = fused_adam.step_module(lr, graphed, grads);
            eager = eager_step(eager, &mut adam, x, lr);
            check.advance(&eager);
        }
        (graphed, eager)
    };
    (graphed, eager) = train(graphed, eager, 2, &mut check);
    let snapshot = graphed.clone();
    let frozen = param_values(&snapshot).expect("read back");
    (graphed, eager) = train(graphed, eager, 3, &mut check);
    assert_params_unchanged(&snapshot, &frozen);
    check.assert("with a snapshot", &eager, &graphed);
    let during = graphed.stats();
    drop(snapshot);
    (graphed, eager) = train(graphed, eager, 3, &mut check);
    check.assert("after the snapshot", &eager, &graphed);
    let after = graphed.stats();
    if graphed.summary().graphed {
        let aliased = |stats: &burn_graphed::GraphStats| {
            stats
                .eager
                .get(&EagerReason::ParamBufferAliased)
                .copied()
                .unwrap_or(0)
        };
        // Step 3 updated into new buffers (the snapshot holds the graphs' buffers); the next
        // two calls could not copy them in and ran eagerly.
        assert_eq!(aliased(&during), 2, "{during:?}");
        assert_eq!(during.forward_replays, 3, "{during:?}");
        // Without the snapshot: one copy, then in place again.
        assert_eq!(aliased(&after), 2, "{after:?}");
        assert_eq!(after.forward_replays, 6, "{after:?}");
        assert_eq!(
            after.param_copies,
            2 * graphed.summary().params as u64,
            "{after:?}"
        );
    }
}

/// The same model trained two steps with burn's `Adam` and, as a copy, with `fused_adam`:
/// `(adam's model, adam, fused_adam's model, fused_adam)`.
fn two_steps_each<S: ModuleStep>(
    device: &Device,
    lr: f64,
    mut fused_adam: S,
) -> (Mlp, ModuleOptimizer, Mlp, S) {
    let model = Mlp::new(16, 2, 4, device);
    let mut reference = deep_copy(&model);
    let mut fused = model;
    let mut adam = adam_config().init();
    for step in 0..2 {
        let x = batch([8, 16], step, device);
        reference = eager_step(reference, &mut adam, x.clone(), lr);
        fused = eager_step(fused, &mut fused_adam, x, lr);
    }
    (reference, adam, fused, fused_adam)
}

/// `FusedAdam` keeps burn's `AdamState`, so its records load into burn's `Adam` and back:
/// two steps with `FusedAdam`, then the record continues under either optimizer, and both
/// match four steps of burn's `Adam`.
pub fn fused_adam_records_load_into_adam(device: &Device) {
    let device = device.clone().autodiff();
    let lr = 1e-2;
    let (reference, adam, fused, fused_adam) =
        two_steps_each(&device, lr, fused_adam_config().init());
    // A record is taken twice (it is not `Clone`): the same state both times.
    let continued_adam = adam_config().init().load_record(fused_adam.to_record());
    let continued_fused = fused_adam_config()
        .init()
        .load_record(fused_adam.to_record());
    let continued = ("record into Adam", continued_adam);
    let loaded = ("record into FusedAdam", continued_fused);
    continue_each(&device, lr, (reference, adam), &fused, continued, loaded);
}

/// Steps 2 and 3 of `reference` under `adam`, and of copies of `trained` under each optimizer
/// of `first` and `second`; asserts that every copy matches the reference, named as given.
fn continue_each<A: ModuleStep, B: ModuleStep>(
    device: &Device,
    lr: f64,
    (mut reference, mut adam): (Mlp, ModuleOptimizer),
    trained: &Mlp,
    (first_name, mut first): (&str, A),
    (second_name, mut second): (&str, B),
) {
    let (mut under_first, mut under_second) = (deep_copy(trained), deep_copy(trained));
    let mut check = ParamsCheck::new(device, &reference);
    for step in 2..4 {
        let x = batch([8, 16], step, device);
        reference = eager_step(reference, &mut adam, x.clone(), lr);
        check.advance(&reference);
        under_first = eager_step(under_first, &mut first, x.clone(), lr);
        under_second = eager_step(under_second, &mut second, x, lr);
    }
    check.assert(first_name, &reference, &under_first);
    check.assert(second_name, &reference, &under_second);
}

/// The multi-tensor optimizer's records are burn's: its record continues under burn's `Adam`,
/// and burn's `Adam` record continues under it; both match four steps of burn's `Adam`.
pub fn multi_tensor_adam_records_load_into_adam(device: &Device) {
    let device = device.clone().autodiff();
    let lr = 1e-2;
    let multi = fused_adam_config().init_multi_tensor();
    let (reference, adam, trained, multi) = two_steps_each(&device, lr, multi);
    let continued_adam = adam_config().init().load_record(multi.to_record(&trained));
    let continued_multi = fused_adam_config()
        .init_multi_tensor()
        .load_record(&trained, adam.to_record());
    let continued = ("record into Adam", continued_adam);
    let loaded = ("Adam's record into it", continued_multi);
    continue_each(&device, lr, (reference, adam), &trained, continued, loaded);
}

/// `FusedAdam` updates the moments in their own buffers only where nothing else holds them: a
/// clone of the optimizer (its state shares the moment tensors) taken mid-training continues
/// exactly as the original does, and both equal burn's `Adam` continued from the same point.
/// Were the shared moments overwritten in place, the second optimizer to step would start
/// from moments already advanced by the first.
pub fn fused_adam_leaves_shared_moments_alone(device: &Device, kind: Kind) {
    let optim = kind.optimizer();
    let device = device.clone().autodiff();
    let (mut reference, mut adam, mut fused, mut fused_adam) = two_steps_each(&device, 1e-2, optim);
    let mut twin_optim = fused_adam.clone();
    let mut twin = deep_copy(&fused);
    let mut check = ParamsCheck::new(&device, &reference);
    for step in 2..4 {
        let x = batch([8, 16], step, &device);
        reference = eager_step(reference, &mut adam, x.clone(), 1e-2);
        fused = eager_step(fused, &mut fused_adam, x.clone(), 1e-2);
        twin = eager_step(twin, &mut twin_optim, x, 1e-2);
        let what = format!("step {step}");
        assert_params_close(&what, &fused, &twin, Tolerance::exact());
        check.assert(&what, &reference, &fused);
    }
}

/// The id, visiting index and shape of the last two-dimensional float parameter of `module`
/// (the MLP's last weight).
fn last_weight<M: Module>(module: &M) -> (burn::module::ParamId, usize, [usize; 2]) {
    struct Finder {
        visited: usize,
        found: Option<(burn::module::ParamId, usize, [usize; 2])>,
    }
    impl burn::module::ModuleVisitor for Finder {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            let dims = param.val().dims();
            if D == 2 {
                self.found = Some((param.id, self.visited, [dims[0], dims[1]]));
            }
            self.visited += 1;
        }
    }
    let mut finder = Finder {
        visited: 0,
        found: None,
    };
    module.visit(&mut finder);
    finder
        .found
        .expect("the module has a two-dimensional parameter")
}

/// The gradients of `loss` for `model`'s parameters, with the last weight's replaced by a
/// tensor the device never wrote (what a failed launch upstream leaves behind).
fn poisoned_grads<M: Module>(model: &M, loss: Tensor<1>, device: &Device) -> GradientsParams {
    let mut grads = GradientsParams::from_grads(loss.backward(), model);
    let (id, _, shape) = last_weight(model);
    grads.register(id, super::recovery::unwritten(shape, device).inner());
    grads
}

/// A fused optimizer step given a gradient the device never wrote updates nothing: cubecl
/// skips the kernel that reads it and marks the buffers it would have written, among them the
/// graphs' parameter buffers that the step updates in place (`MultiTensorAdam`: every
/// parameter of the skipped launch). The next calls are refused with `ParameterNotWritten`
/// naming such a parameter, as often as they are made: without the record of in-place
/// updates, the replay ran on the stale parameter and its output read back. Eager training
/// (burn's `Adam`) given the same gradient cannot read that parameter back either. Loading the
/// parameters saved before the step recovers: calls replay again and, with fresh optimizers
/// on both sides, train as eagerly. Rows CUDA pitches (width 11, 3 outputs), so the update
/// goes through a dense copy and its write-back there.
pub fn unwritten_gradient_step_is_refused(device: &Device, kind: Kind) {
    let device = device.clone().autodiff();
    require_graphs(&device);
    let lr = 1e-2;
    let model = Mlp::new(11, 2, 3, &device);
    let mut eager = deep_copy(&model);
    let mut check = ParamsCheck::new(&device, &model);
    let mut graphed = capture_mlp(model, batch([8, 11], 0, &device));
    let (mut fused_adam, mut adam) = (kind.optimizer(), adam_config().init());
    // One good step: the first call copies the parameters in, the optimizer then updates the
    // graphs' buffers in place.
    let x = batch([8, 11], 1, &device);
    let loss = square_mean(graphed.forward(x.clone()).expect("call"));
    let grads = GradientsParams::from_grads(loss.backward(), &graphed);
    graphed = fused_adam.step_module(lr, graphed, grads);
    eager = eager_step(eager, &mut adam, x, lr);
    check.advance(&eager);
    // Saved before the bad step, in buffers of their own (read, so that the copies ran).
    let (saved_graphed, saved_eager) = (deep_copy(&graphed), deep_copy(&eager));
    param_values(&saved_graphed).expect("saved graphed parameters read back");
    param_values(&saved_eager).expect("saved eager parameters read back");

    let x = batch([8, 11], 2, &device);
    let loss = square_mean(eager.forward(x.clone()));
    let grads = poisoned_grads(&eager, loss, &device);
    eager = adam.step(lr, eager, grads);
    let (_, poisoned, _) = last_weight(&eager);
    let eager_read = param_values(&eager);
    assert!(
        eager_read.is_err(),
        "eager: a parameter updated from an unwritten gradient read back"
    );
    let loss = square_mean(graphed.forward(x).expect("call"));
    let grads = poisoned_grads(&graphed, loss, &device);
    graphed = fused_adam.step_module(lr, graphed, grads);
    let before = graphed.stats();
    for attempt in 0..2 {
        match graphed.forward(batch([8, 11], 3, &device)) {
            Err(GraphedError::ParameterNotWritten { index, reason, .. }) => {
                assert!(!reason.is_empty());
                match kind {
                    Kind::PerParam => assert_eq!(index, poisoned, "attempt {attempt}"),
                    Kind::MultiTensor => assert!(index <= poisoned, "attempt {attempt}: {index}"),
                }
            }
            Err(other) => panic!("attempt {attempt}: expected ParameterNotWritten, got {other}"),
            Ok(out) => panic!(
                "attempt {attempt}: a call on a parameter the optimizer left unwritten returned \
                 {:?} ({:?})",
                out.inner().try_into_data(),
                graphed.stats()
            ),
        }
    }
    // Refused replays are not counted, and no call fell back to eager.
    let refused = graphed.stats();
    assert_eq!(
        refused.forward_replays, before.forward_replays,
        "{refused:?}"
    );
    assert_eq!(refused.total_eager(), 0, "{refused:?}");

    // Recovery: the saved parameters, fresh optimizers.
    let mut graphed = graphed.load_record(saved_graphed.into_record());
    let mut eager = eager.load_record(saved_eager.into_record());
    let (mut fused_adam, mut adam) = (kind.optimizer(), adam_config().init());
    for step in 4..7 {
        let x = batch([8, 11], step, &device);
        let loss = square_mean(graphed.forward(x.clone()).expect("call after recovery"));
        let grads = GradientsParams::from_grads(loss.backward(), &graphed);
        graphed = fused_adam.step_module(lr, graphed, grads);
        eager = eager_step(eager, &mut adam, x, lr);
        check.assert(&format!("step {step}, after recovery"), &eager, &graphed);
    }
    let after = graphed.stats();
    assert_eq!(
        after.forward_replays,
        refused.forward_replays + 3,
        "{after:?}"
    );
    assert_eq!(after.total_eager(), 0, "{after:?}");
}

/// Diagnostic, run by hand (the GPU suite's `eager_gradients_repeat`, ignored): the same eager
/// forward and backward of `fused_adam_matches_adam`'s model, `repeats` times on the model and
/// on a deep copy of it, each gradient compared bit for bit with the first one's. Prints every
/// difference and returns how many gradients differed: a kernel whose result depends on timing
/// (atomics, a race) differs on the same model; a pick that depends on the layout (another
/// autotune key tuned apart) differs on the copy only.
pub fn eager_gradients_repeat(device: &Device, repeats: usize) -> usize {
    use burn_graphed_testkit::grad_values;
    let device = device.clone().autodiff();
    let model = Mlp::new(11, 2, 3, &device);
    let copy = deep_copy(&model);
    let x = batch([8, 11], 0, &device);
    let gradients = |m: &Mlp| {
        let loss = square_mean(m.forward(x.clone()));
        let grads = GradientsParams::from_grads(loss.backward(), m);
        grad_values(m, &grads).expect("gradients read back")
    };
    let first = gradients(&model);
    let mut differed = 0;
    for repeat in 0..repeats {
        for (which, m) in [("model", &model), ("copy", &copy)] {
            for (index, (a, b)) in first.iter().zip(gradients(m)).enumerate() {
                let comparison = burn_graphed_testkit::TensorComparison::new(
                    format!("repeat {repeat} {which}: gradient {index}"),
                    a.as_ref().expect("every parameter has a gradient"),
                    &b.expect("every parameter has a gradient"),
                    Tolerance::exact(),
                );
                if !comparison.passed() {
                    differed += 1;
                    println!("{comparison}");
                }
            }
        }
    }
    println!(
        "eager gradients: {differed} of {} differed",
        repeats * 2 * first.len()
    );
    differed
}
