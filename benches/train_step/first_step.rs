//! `first_step*`: the time from making a model to the end of its first trained step, once per
//! process, and its parts: making the model and inputs, the setup (a capture's warm-ups,
//! recording and validation; nothing for eager), the step itself (a device sync included).
//! Cold or warm as cubecl's persistent cache is (`BURN_GRAPHED_CUBECL_ENV`).
//!
//! With cubecl's compilation and autotune logs on (`run.sh` writes them for
//! `BURN_GRAPHED_COMPILE_LOG` and `BURN_GRAPHED_AUTOTUNE_LOG`), the row says how many kernels
//! cubecl compiled and how many autotune keys it tuned during the measurement.
//! `BURN_GRAPHED_IMPORT_PICKS=FILE` imports a bundle of autotune picks before the clock starts
//! (the measurement then compiles but does not tune); `BURN_GRAPHED_EXPORT_PICKS=FILE` writes
//! the cubecl environment's autotune picks, and only those (no compiled kernels), after the
//! value check: in a fresh environment, this process's. Making the model enqueues its
//! initialization, whose kernels run (and compile) in the setup or the step. `benches/first_step.py`
//! combines three processes per row into the cold time's parts: tuning, compiling, the rest.

use std::path::Path;

use super::*;

/// Which training loop a `first_step*` row times; PyTorch's counterparts are
/// `torch_reference.py`'s `FIRST_STEP_OF`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum First {
    /// `first_step_eager`: burn's `Adam`, eagerly (the `eager` mode's step).
    Eager,
    /// `first_step_graphed`: forward and loss as one `Graphed` callable with its replayed
    /// backward, `MultiTensorAdam` (the `graphed_loss_static_multi_adam` mode's step).
    Graphed,
    /// `first_step`: one `GraphedStep` (the `whole_step` mode's step).
    WholeStep,
}

impl First {
    /// The timed mode whose setup and step this one times once.
    pub(crate) fn timed(self) -> Mode {
        match self {
            First::Eager => Mode::Eager(Optim::Adam),
            First::Graphed => Mode::GraphedLoss(Optim::MultiAdam),
            First::WholeStep => Mode::WholeStep(false),
        }
    }
}

/// The parts of a first step, in microseconds, and what cubecl compiled and tuned in them.
pub(crate) struct FirstParts {
    pub(crate) make_us: f64,
    pub(crate) setup_us: f64,
    pub(crate) step_us: f64,
    /// Kernels cubecl compiled (`None`: no compilation log).
    pub(crate) compiled: Option<usize>,
    /// Autotune keys cubecl tuned (`None`: no autotune log).
    pub(crate) tuned: Option<usize>,
}

impl FirstParts {
    /// The row's JSON fields (a leading comma).
    pub(crate) fn json(&self) -> String {
        let count = |name: &str, n: Option<usize>| {
            n.map_or_else(String::new, |n| format!(", \"{name}\": {n}"))
        };
        format!(
            ", \"make_us\": {:.0}, \"setup_us\": {:.0}, \"step_us\": {:.0}{}{}",
            self.make_us,
            self.setup_us,
            self.step_us,
            count("kernels_compiled", self.compiled),
            count("keys_tuned", self.tuned)
        )
    }
}

/// Lines of one of cubecl's logs that match, counted from where the log was when made.
struct LogCount {
    file: std::path::PathBuf,
    matches: fn(&str) -> bool,
    before: usize,
}

impl LogCount {
    /// `None` when `var` names no log.
    fn new(var: &str, matches: fn(&str) -> bool) -> Option<LogCount> {
        let file = std::path::PathBuf::from(std::env::var_os(var)?);
        let mut count = LogCount {
            file,
            matches,
            before: 0,
        };
        count.before = count.total();
        Some(count)
    }

    fn total(&self) -> usize {
        std::fs::read_to_string(&self.file)
            .unwrap_or_default()
            .lines()
            .filter(|line| (self.matches)(line))
            .count()
    }

    /// The matching lines written since [`LogCount::new`]. cubecl's logger thread writes
    /// after the work it reports, so the count is read once it stopped growing (nothing runs
    /// on the device after the measurement's sync).
    fn settled(&self) -> usize {
        let mut last = self.total();
        let mut still = 0;
        let deadline = Instant::now() + Duration::from_secs(20);
        while still < 3 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
            let now = self.total();
            still = if now == last { still + 1 } else { 0 };
            last = now;
        }
        last - self.before
    }
}

/// Imports the bundle of autotune picks `BURN_GRAPHED_IMPORT_PICKS` names, if any.
fn import_picks() {
    let Some(path) = std::env::var_os("BURN_GRAPHED_IMPORT_PICKS") else {
        return;
    };
    let report = burn_graphed::import_tuned(&path).expect("the picks bundle imports");
    eprintln!(
        "# picks imported from {}: {report:?}",
        Path::new(&path).display()
    );
}

/// Writes the cubecl environment's autotune picks (no compiled kernels) to the bundle
/// `BURN_GRAPHED_EXPORT_PICKS` names, if any.
fn export_picks() {
    let Some(path) = std::env::var_os("BURN_GRAPHED_EXPORT_PICKS") else {
        return;
    };
    #[cfg(feature = "cube")]
    {
        use cubecl::bundle::{BundleFormat, ExportOptions, export};
        let options = ExportOptions {
            name: "first step picks".into(),
            namespaces: vec!["autotune".into()],
            format: BundleFormat::Sqlite,
            ..Default::default()
        };
        let _ = std::fs::remove_file(&path);
        export(&[cubecl::environment::path()], Path::new(&path), &options)
            .expect("the picks export");
        eprintln!(
            "# autotune picks exported to {}",
            Path::new(&path).display()
        );
    }
    #[cfg(not(feature = "cube"))]
    panic!("BURN_GRAPHED_EXPORT_PICKS needs a cubecl backend, not {path:?}");
}

/// The time from making `case`'s model to the end of its first step of `first` (model, inputs,
/// setup, one step, a device sync), as a one-off row with its parts; then, for graphed steps,
/// the value check of the mode it times once.
pub(crate) fn first_step<M, I, O>(
    case: &Case<M, I, O>,
    first: First,
    label: &str,
    device: &Device,
    options: &Options,
    before: u64,
) -> Row
where
    M: Module,
    I: TensorGroup + Clone,
    O: TensorGroup,
{
    import_picks();
    let unmeasured_before = warn_log::unmeasured();
    // A kernel's first line: "[Compiling kernel] NAME" at level basic, the marker at full.
    let compiled = LogCount::new("BURN_GRAPHED_COMPILE_LOG", |line| {
        line.starts_with("[Compiling kernel]") || line == "[START_KERNEL_COMPILATION]"
    });
    let tuned = LogCount::new("BURN_GRAPHED_AUTOTUNE_LOG", |line| {
        line.starts_with("Fastest result")
    });
    let started = Instant::now();
    let model = (case.make)(device);
    let input = (case.input)(device, case.batch);
    let made = started.elapsed();
    // What each step made stays alive until after the sync, as in a training loop.
    let (mut eager, mut graphed, mut whole) = (None, None, None);
    let set_up = match first {
        First::Eager => {
            let mut optimizer = first.timed().optimizer();
            let loss = (case.loss)((case.call)(&model, input.clone()), &input);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            eager = Some((optimizer.step(1e-4, model, grads), optimizer));
            made
        }
        First::Graphed => {
            let mut optimizer = first.timed().optimizer();
            let graphed_model = Graphed::new(
                model,
                case.call_loss,
                input.clone(),
                &first.timed().config(),
            )
            .expect("capture");
            let set_up = started.elapsed();
            let loss = graphed_model.forward(input).expect("graphed call");
            let grads = GradientsParams::from_grads(loss.backward(), &graphed_model);
            graphed = Some((optimizer.step(1e-4, graphed_model, grads), optimizer));
            set_up
        }
        First::WholeStep => {
            let mut step = whole_step(model, case.call_loss, &input, first.timed());
            let set_up = started.elapsed();
            let loss = step.run(input, 1e-4).expect("whole step");
            whole = Some((step, loss));
            set_up
        }
    };
    device.sync().expect("sync");
    let elapsed = started.elapsed();
    drop((eager, graphed, whole));
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let parts = FirstParts {
        make_us: us(made),
        setup_us: us(set_up - made),
        step_us: us(elapsed - set_up),
        compiled: compiled.map(|c| c.settled()),
        tuned: tuned.map(|c| c.settled()),
    };
    eprintln!(
        "# {label}: first step {:.2} s (make {:.2}, setup {:.2}, step {:.2}; kernels compiled {:?}, keys tuned {:?})",
        us(elapsed) / 1e6,
        parts.make_us / 1e6,
        parts.setup_us / 1e6,
        parts.step_us / 1e6,
        parts.compiled,
        parts.tuned
    );
    // After the measurement: the value check of the mode timed once (eager is the reference).
    let check = (options.check && first != First::Eager)
        .then(|| Check::Steps(check(case, first.timed(), label, device, options)));
    export_picks();
    Row {
        framework: "burn",
        model: case.name.clone(),
        dtype: options.dtype.clone(),
        mode: Mode::FirstStep(first).label(),
        median_us: us(elapsed),
        p10_us: us(elapsed),
        p90_us: us(elapsed),
        reserved_mib: reserved(device).saturating_sub(before) as f64 / (1024.0 * 1024.0),
        fusion_removed: options.fusion_removed.clone(),
        check,
        expect_failure: false,
        autotune_unmeasured: warn_log::unmeasured() - unmeasured_before,
        single: true,
        ranks: None,
        graph_kernel_nodes: None,
        first: Some(parts),
    }
}
