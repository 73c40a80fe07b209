//! The value check of the data-parallel whole steps (`ddp_whole_step*`), run by the ranks that
//! timed them, after the timed steps.
//!
//! Every rank makes one model and [`CHECK_STEPS`] draws alike (seeded, one rank at a time where
//! the ranks are threads of one process), and rank `r` trains on `Case::shard` of each draw:
//! batches that differ by construction (odd ranks' float inputs negated, the language model's
//! ids shifted). Shards drawn apart from one distribution do not do: on the bench's models
//! (inputs in `[0, 1)`, a loss that pulls every output to 0) Adam's first steps, about `lr` times
//! the gradient's sign, came out the same from one rank's gradient as from the ranks' mean, and
//! a check that left the average out passed (`h200x2_ddp_check_blind_294b4e9_logs.tar.xz`).
//!
//! Rank 0 then trains one model eagerly on every rank's shards (each step's loss the mean of
//! the ranks' losses, so its gradient is the mean of theirs, what the all-reduce computes) and
//! compares its own replica with it by [`StepCheck`]. The control: the same eager training on
//! rank 0's shards alone must fail the comparison, or the check could not see a missing
//! all-reduce and the run ends there. With one rank (`--ranks 1`: what the all-reduce's gather,
//! collective and split cost a step) the check is one model on the rank's own shards and the
//! control one on a second rank's, another batch. What it cannot see: a wrong scale of the average (a sum
//! for a mean), which Adam's update divides away; the GPU suite's data-parallel tests train
//! with SGD too, whose update scales with the gradient (`tests/scenarios/data_parallel.rs`).
//! Every rank waits at a barrier until rank 0 has compared, so that no rank ends its process
//! (and its communicator) while rank 0 still works.

use super::*;

/// Rank `rank`'s batch made from a draw of the bench's odd-rank-negated float input.
pub(crate) fn negate_odd<const D: usize>(batch: Tensor<D>, rank: usize) -> Tensor<D> {
    if rank % 2 == 1 { -batch } else { batch }
}

/// The value check of a data-parallel whole step on `dp` (see the module docs): rank 0's
/// [`StepCheck`], `None` on the other ranks. Panics where the control passes.
pub(crate) fn check_data_parallel<M, I, O>(
    case: &Case<M, I, O>,
    dp: &DataParallel,
    device: &Device,
    options: &Options,
    label: &str,
) -> Option<StepCheck>
where
    M: Module,
    I: TensorGroup + Clone,
    O: TensorGroup,
{
    let (rank, ranks) = (dp.ranks().rank(), dp.ranks().size());
    let (initial, draws) = dp
        .in_turn("the check's draws", device, || {
            device.seed(CHECK_SEED);
            let model = (case.make)(device).map(&mut Unconstant);
            let draws: Vec<I> = (0..CHECK_STEPS)
                .map(|_| (case.input)(device, case.batch))
                .collect();
            Ok((model, draws))
        })
        .unwrap_or_else(|error| panic!("{label}: the check's draws: {error}"));
    let initial = dp
        .broadcast(initial)
        .unwrap_or_else(|error| panic!("{label}: the check's model: {error}"));
    let shards: Vec<Vec<I>> = (0..ranks)
        .map(|r| draws.iter().map(|d| (case.shard)(d.clone(), r)).collect())
        .collect();
    // The control's batches: rank 0's alone, which leave the other ranks' out; with one rank,
    // whose check is one model on its own batches, a second rank's (another batch).
    let control: Vec<Vec<I>> = if ranks > 1 {
        shards[..1].to_vec()
    } else {
        vec![draws.iter().map(|d| (case.shard)(d.clone(), 1)).collect()]
    };
    let mine = &shards[rank];
    let step = GraphedStep::data_parallel(
        dp,
        deep_copy(&initial),
        case.call_loss,
        &AdamConfig::new(),
        vec![mine[0].clone()],
        &GraphedConfig::new(),
    )
    .unwrap_or_else(|error| panic!("{label}: the check's capture: {error}"));
    let (graphed_losses, graphed) = check_whole_steps(step, mine);
    let graphed: Vec<TensorData> = graphed.into_iter().map(|(_, data)| data).collect();
    let compared = (rank == 0).then(|| {
        compare_with_eager(
            case,
            options,
            &initial,
            (&shards, &control),
            (&graphed_losses, &graphed),
        )
    });
    dp.ranks()
        .barrier("the value check's end")
        .unwrap_or_else(|error| panic!("{label}: {error}"));
    let (check, control) = compared?;
    eprintln!("# {label}: value check against one model on every rank's shards: {check}");
    eprintln!(
        "# {label}: control, one model on {} (must fail): {control}",
        if ranks > 1 {
            "rank 0's shards alone"
        } else {
            "another rank's shards"
        }
    );
    assert!(
        !control.passed(),
        "{label}: the check is blind: one model trained without the ranks' average passed it \
         ({control})"
    );
    Some(check)
}

/// Rank 0's comparisons: its replica's `graphed` losses and parameters against one model
/// trained eagerly on every rank's `shards` (the check), and on the `control`'s (which leave
/// out what the ranks trained on).
fn compare_with_eager<M, I, O>(
    case: &Case<M, I, O>,
    options: &Options,
    initial: &M,
    (shards, control): (&[Vec<I>], &[Vec<I>]),
    (graphed_losses, graphed): (&[f64], &[TensorData]),
) -> (StepCheck, StepCheck)
where
    M: Module,
    I: TensorGroup + Clone,
    O: TensorGroup,
{
    let eager = |shards: &[Vec<I>]| -> (Vec<f64>, Vec<TensorData>) {
        let mut model = deep_copy(initial);
        let mut optimizer = Mode::WholeStep(false).optimizer();
        let mut losses = Vec::with_capacity(CHECK_STEPS);
        for i in 0..CHECK_STEPS {
            let per_rank: Vec<Tensor<1>> = shards
                .iter()
                .map(|batches| (case.call_loss)(&model, batches[i].clone()))
                .collect();
            // The loss the whole step returns: rank 0's own.
            losses.push(loss_value(per_rank[0].clone()));
            let mean = Tensor::cat(per_rank, 0).mean();
            let grads = GradientsParams::from_grads(mean.backward(), &model);
            model = optimizer.step(CHECK_LR, model, grads);
        }
        let params = param_values(&model).expect("read back");
        (losses, params.into_iter().map(|(_, data)| data).collect())
    };
    // As the one-GPU check ([`check`]): TF32 products in one run and not the other, bf16's
    // rounding; the ranks' mean adds one rounding of the averaged gradient.
    let noise_rel = if options.dtype == "bf16" { 2e-2 } else { 2e-3 };
    let compare = |(losses, params): &(Vec<f64>, Vec<TensorData>)| {
        StepCheck::new(
            CHECK_LR,
            noise_rel,
            (losses, graphed_losses),
            (params, graphed),
        )
    };
    (compare(&eager(shards)), compare(&eager(control)))
}
