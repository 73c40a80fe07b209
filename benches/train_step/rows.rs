//! One benchmark row ([`Row`]), its JSON line and the measurements it is made of.

use super::*;

/// One benchmark row, printed as a JSON line.
pub(crate) struct Row {
    pub(crate) framework: &'static str,
    pub(crate) model: String,
    pub(crate) dtype: String,
    pub(crate) mode: &'static str,
    pub(crate) median_us: f64,
    pub(crate) p10_us: f64,
    pub(crate) p90_us: f64,
    pub(crate) reserved_mib: f64,
    /// The fusion optimizations `BURN_GRAPHED_FUSION_REMOVE` removed (empty: none).
    pub(crate) fusion_removed: String,
    /// Graphed runs: the value check against eager Burn ([`check`], [`OutputCheck`]); `None`
    /// for eager runs (the reference) and with `--no-check`.
    pub(crate) check: Option<Check>,
    /// Whether the mode skips a copy on purpose, so that its check must fail (a negative
    /// control of the check, numbers only).
    pub(crate) expect_failure: bool,
    /// Autotune keys that cubecl decided unmeasured before the check ([`warn_log`]): a key
    /// first met inside a recording, where profiling is refused, gets its first candidate
    /// that launches, unmeasured, for the rest of the process.
    pub(crate) autotune_unmeasured: usize,
    /// A one-off measurement (`first_step`): median, p10 and p90 are the one value.
    pub(crate) single: bool,
    /// Data-parallel runs: the number of ranks (the row then has `samples_per_s` too).
    pub(crate) ranks: Option<(usize, usize)>,
    /// Graphed runs on CUDA: the kernel nodes of the graphs the timed steps replayed
    /// ([`note_graphs`]); the launches of a step outside its graphs are not counted.
    pub(crate) graph_kernel_nodes: Option<usize>,
    /// `first_step*` rows: the parts of the one measurement.
    pub(crate) first: Option<FirstParts>,
}

/// The kernel nodes of the graphs of the last timed run, for its row ([`Row::timed`]).
pub(crate) static GRAPH_KERNEL_NODES: std::sync::Mutex<Option<usize>> = std::sync::Mutex::new(None);

/// Notes the kernel nodes of `graphs` (a timed run's `stats().graphs`) for the run's row;
/// nothing where a graph does not say (wgpu) or there are none.
pub(crate) fn note_graphs(graphs: &[burn_graphed::GraphContents]) {
    let kernels = graphs
        .iter()
        .map(|g| g.nodes.map(|n| n.kernels))
        .sum::<Option<usize>>()
        .filter(|_| !graphs.is_empty());
    *GRAPH_KERNEL_NODES.lock().unwrap_or_else(|e| e.into_inner()) = kernels;
}

impl Row {
    /// Why the row's values are not a result: its check failed, or (a fault-injecting mode)
    /// passed where it had to fail; `None` when the row is a result.
    pub(crate) fn check_failure(&self) -> Option<String> {
        let check = self.check.as_ref()?;
        match (check.passed(), self.expect_failure) {
            (false, false) => Some(format!("value check failed: {check}")),
            (true, true) => Some(format!(
                "value check passed although the mode skips copies: the check is blind to it ({check})"
            )),
            _ => None,
        }
    }

    pub(crate) fn print(&self) {
        if let Some(failure) = self.check_failure() {
            // No timing row for values that were not right: the failure, which the report
            // lists.
            println!(
                "{{\"framework\": \"{}\", \"model\": \"{}\", \"dtype\": \"{}\", \"tf32\": {}, \"mode\": \"{}\", \"check_passed\": false, \"error\": \"{}\"}}",
                self.framework,
                self.model,
                self.dtype,
                burn_graphed::tf32_allowed(),
                self.mode,
                failure.replace('\\', "\\\\").replace('"', "\\\"")
            );
            return;
        }
        let mut check = self.check.as_ref().map_or_else(String::new, Check::json);
        if self.check.is_some() && self.expect_failure {
            check.push_str(", \"check_must_fail\": true");
        }
        let unmeasured = if self.autotune_unmeasured == 0 {
            String::new()
        } else {
            format!(", \"autotune_unmeasured\": {}", self.autotune_unmeasured)
        };
        let removed = if self.fusion_removed.is_empty() {
            String::new()
        } else {
            format!(", \"fusion_removed\": \"{}\"", self.fusion_removed)
        };
        let single = if self.single {
            ", \"single\": true"
        } else {
            ""
        };
        let ranks = self.ranks.map_or_else(String::new, |(ranks, batch)| {
            format!(
                ", \"ranks\": {ranks}, \"samples_per_s\": {:.1}",
                (ranks * batch) as f64 * 1e6 / self.median_us
            )
        });
        let nodes = self
            .graph_kernel_nodes
            .map_or_else(String::new, |n| format!(", \"graph_kernel_nodes\": {n}"));
        let first = self
            .first
            .as_ref()
            .map_or_else(String::new, FirstParts::json);
        println!(
            "{{\"framework\": \"{}\", \"model\": \"{}\", \"dtype\": \"{}\", \"tf32\": {}, \"mode\": \"{}\", \"median_us\": {:.1}, \"p10_us\": {:.1}, \"p90_us\": {:.1}, \"reserved_mib\": {:.1}{removed}{unmeasured}{check}{single}{ranks}{nodes}{first}}}",
            self.framework,
            self.model,
            self.dtype,
            burn_graphed::tf32_allowed(),
            self.mode,
            self.median_us,
            self.p10_us,
            self.p90_us,
            self.reserved_mib
        );
    }
}

impl Row {
    /// The row of a timed run of `case` in `mode` (no value check yet): the spread of
    /// `per_step`, the memory reserved since `before`, the autotune keys decided unmeasured
    /// since `unmeasured_before`.
    pub(crate) fn timed<M, I, O>(
        case: &Case<M, I, O>,
        mode: Mode,
        per_step: Vec<f64>,
        device: &Device,
        before: u64,
        options: &Options,
        unmeasured_before: usize,
    ) -> Row {
        let (median_us, p10_us, p90_us) = spread(per_step);
        let reserved_mib = reserved(device).saturating_sub(before) as f64 / (1024.0 * 1024.0);
        let autotune_unmeasured = warn_log::unmeasured() - unmeasured_before;
        if autotune_unmeasured > 0 {
            eprintln!(
                "# {} {}: autotune decided {autotune_unmeasured} key(s) unmeasured (warnings above)",
                case.name,
                mode.label()
            );
        }
        Row {
            framework: "burn",
            model: case.name.clone(),
            dtype: options.dtype.clone(),
            mode: mode.label(),
            median_us,
            p10_us,
            p90_us,
            reserved_mib,
            fusion_removed: options.fusion_removed.clone(),
            check: None,
            expect_failure: mode.injects_fault(),
            autotune_unmeasured,
            single: false,
            ranks: None,
            graph_kernel_nodes: GRAPH_KERNEL_NODES
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
            first: None,
        }
    }
}

pub(crate) fn reserved(device: &Device) -> u64 {
    device
        .memory_pool_usage()
        .map(|usage| usage.bytes_reserved)
        .unwrap_or(0)
}

/// Median, 10th and 90th percentile of per-step times over reps.
pub(crate) fn spread(mut per_step: Vec<f64>) -> (f64, f64, f64) {
    per_step.sort_by(f64::total_cmp);
    let at = |q: f64| per_step[((per_step.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.1), at(0.9))
}
