//! The timing loop: training steps timed per phase, warm-up and timed reps.

use super::*;

/// Times training steps of `model`, called through `call`: the model moves through the
/// optimizer (`model = optim.step(lr, model, grads)`, no clone), as in a training loop. Prints
/// the host time per phase; returns the per-step times and the trained model. With
/// `data_parallel` (the `ddp_*` modes, one call per rank), the gradients are averaged across
/// the ranks before the optimizer, and every rep starts at a barrier of all ranks.
#[allow(clippy::too_many_arguments)]
pub(crate) fn train_steps<M: Module, I: Clone, O>(
    model: M,
    call: impl Fn(&M, I) -> O,
    loss_of: fn(O, &I) -> Tensor<1>,
    inputs: &[I],
    optimizer: &mut Optimizer,
    label: &str,
    device: &Device,
    options: &Options,
    data_parallel: Option<&DataParallel>,
) -> (Vec<f64>, Option<M>) {
    let mut model = Some(model);
    let mut phases = Phases::new(if data_parallel.is_some() {
        &DDP_PHASES
    } else {
        &STEP_PHASES
    });
    let mut step = |i: usize| {
        let Some(current) = model.take() else { return };
        let mut clock = phases.start();
        let input = &inputs[i % inputs.len()];
        let out = call(&current, input.clone());
        clock.lap(0);
        let loss = loss_of(out, input);
        clock.lap(1);
        let grads = loss.backward();
        clock.lap(2);
        let mut grads = GradientsParams::from_grads(grads, &current);
        clock.lap(3);
        if let Some(dp) = data_parallel {
            grads = dp
                .average(&current, grads)
                .expect("gradients averaged across the ranks");
            clock.lap(4);
        }
        model = Some(optimizer.step(1e-4, current, grads));
        clock.lap(clock.laps.len() - 1);
        phases.add(clock);
    };
    // Data parallel: every rank starts each rep together.
    let before_rep = || {
        if let Some(dp) = data_parallel {
            dp.ranks()
                .barrier("a rep's start")
                .expect("every rank starts the rep");
        }
    };
    let per_step = time_with(device, options, label, &before_rep, &mut step);
    eprintln!("# {label}: {phases}");
    (per_step, model)
}

/// Host time spent in each phase of a step (forward call, loss, `backward()`,
/// `GradientsParams`, optimizer step; the `ddp_*` modes add the gradient average), averaged over
/// the timed steps: where the host's time goes when a step is launch-bound. Not synchronized: a
/// phase that waits for the device (a graph replay drains fusion's queue first) also shows that
/// wait.
pub(crate) struct Phases {
    pub(crate) names: &'static [&'static str],
    pub(crate) total: Vec<std::time::Duration>,
    /// Steps counted (the warm-up's are not: they include kernel compilation).
    pub(crate) steps: u32,
    pub(crate) seen: usize,
}

/// The phases of a one-GPU step.
pub(crate) const STEP_PHASES: [&str; 5] = ["forward", "loss", "backward", "grads", "optimizer"];
/// The phases of a data-parallel step.
pub(crate) const DDP_PHASES: [&str; 6] = [
    "forward",
    "loss",
    "backward",
    "grads",
    "average",
    "optimizer",
];

/// The laps of one step.
pub(crate) struct Clock {
    pub(crate) last: Instant,
    pub(crate) laps: Vec<std::time::Duration>,
}

impl Clock {
    pub(crate) fn lap(&mut self, phase: usize) {
        let now = Instant::now();
        self.laps[phase] += now - self.last;
        self.last = now;
    }
}

impl Phases {
    pub(crate) fn new(names: &'static [&'static str]) -> Self {
        Phases {
            names,
            total: vec![std::time::Duration::ZERO; names.len()],
            steps: 0,
            seen: 0,
        }
    }

    pub(crate) fn start(&self) -> Clock {
        Clock {
            last: Instant::now(),
            laps: vec![std::time::Duration::ZERO; self.names.len()],
        }
    }

    pub(crate) fn add(&mut self, clock: Clock) {
        self.seen += 1;
        if self.seen <= WARM_UP {
            return;
        }
        for (total, lap) in self.total.iter_mut().zip(clock.laps) {
            *total += lap;
        }
        self.steps += 1;
    }
}

impl std::fmt::Display for Phases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "host us per step:")?;
        for (name, total) in self.names.iter().zip(&self.total) {
            let us = total.as_secs_f64() * 1e6 / f64::from(self.steps.max(1));
            write!(f, " {name} {us:.0}")?;
        }
        Ok(())
    }
}

/// Untimed steps before the timed reps.
pub(crate) const WARM_UP: usize = 20;

/// Warm-up ([`WARM_UP`] steps), then `reps` timed reps of `steps` steps; per-step microseconds
/// per rep.
pub(crate) fn time(
    device: &Device,
    options: &Options,
    label: &str,
    step: &mut dyn FnMut(usize),
) -> Vec<f64> {
    time_with(device, options, label, &|| {}, step)
}

/// [`time`], calling `before_rep` before each rep's clock starts.
pub(crate) fn time_with(
    device: &Device,
    options: &Options,
    label: &str,
    before_rep: &dyn Fn(),
    step: &mut dyn FnMut(usize),
) -> Vec<f64> {
    trace_phase("warm-up");
    for i in 0..WARM_UP {
        step(i);
    }
    device.sync().expect("sync");
    #[cfg(feature = "host-profile")]
    let _profile = options
        .host_profile
        .as_deref()
        .map(|file| host_profile::Profile::start(file, label));
    #[cfg(not(feature = "host-profile"))]
    let _ = (label, &options.host_profile);
    // The timed steps are the profiler's range (`ncu --profile-from-start off`, `nsys
    // --capture-range=cudaProfilerApi`): warm-up, capture and value check stay outside.
    let _range = profiler_range::Range::start();
    trace_phase("timed");
    (0..options.reps)
        .map(|_| {
            before_rep();
            let start = Instant::now();
            for i in 0..options.steps {
                step(i);
            }
            device.sync().expect("sync");
            start.elapsed().as_secs_f64() * 1e6 / options.steps as f64
        })
        .collect()
}
