//! The host's stacks sampled during the timed reps of one run (`--host-profile FILE`): an
//! in-process sampling profiler, because the GPU machine has no `perf`. Appends to `FILE`, per
//! run, the functions with the most samples on the stack (inclusive) and on top (self).

use std::collections::{HashMap, HashSet};
use std::io::Write;

/// Samples per second asked of the process timer (on the H100 machine's VM it delivered
/// about 250: the timer's resolution).
const FREQUENCY: i32 = 4999;
/// Functions listed per table.
const TOP: usize = 60;

pub struct Profile {
    guard: Option<pprof::ProfilerGuard<'static>>,
    file: String,
    label: String,
}

impl Profile {
    pub fn start(file: &str, label: &str) -> Self {
        let guard = pprof::ProfilerGuardBuilder::default()
            .frequency(FREQUENCY)
            .blocklist(&["libc", "libgcc", "pthread", "vdso"])
            .build()
            .expect("host profiler");
        Self {
            guard: Some(guard),
            file: file.into(),
            label: label.into(),
        }
    }
}

/// A symbol's name without its hash suffix, cut to a readable length.
fn short(name: &str) -> String {
    let name = match name.rfind("::h") {
        Some(at) if name.len() - at == 19 => &name[..at],
        _ => name,
    };
    name.chars().take(150).collect()
}

impl Drop for Profile {
    fn drop(&mut self) {
        let Some(guard) = self.guard.take() else {
            return;
        };
        let report = guard.report().build().expect("host profile report");
        drop(guard);
        let mut total = 0isize;
        let mut inclusive: HashMap<String, isize> = HashMap::new();
        let mut own: HashMap<String, isize> = HashMap::new();
        let mut threads: HashMap<String, isize> = HashMap::new();
        for (frames, count) in &report.data {
            total += count;
            *threads.entry(frames.thread_name.clone()).or_default() += count;
            // Frames run from the sampled function (first) to `main` (last); each frame
            // lists its inlined functions innermost first.
            let names: Vec<String> = frames
                .frames
                .iter()
                .flat_map(|frame| frame.iter().map(|symbol| short(&symbol.name())))
                .collect();
            if let Some(top) = names.first() {
                *own.entry(top.clone()).or_default() += count;
            }
            let mut seen = HashSet::new();
            for name in names {
                if seen.insert(name.clone()) {
                    *inclusive.entry(name).or_default() += count;
                }
            }
        }
        let table = |counts: HashMap<String, isize>| {
            let mut rows: Vec<_> = counts.into_iter().collect();
            rows.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
            rows.truncate(TOP);
            rows.into_iter()
                .map(|(name, count)| {
                    let share = 100.0 * count as f64 / total.max(1) as f64;
                    format!("{share:6.2}% {count:7} {name}\n")
                })
                .collect::<String>()
        };
        let text = format!(
            "## {}: {total} samples ({FREQUENCY} Hz asked; the process timer may deliver fewer)\n### threads\n{}### inclusive\n{}### self\n{}\n",
            self.label,
            table(threads),
            table(inclusive),
            table(own)
        );
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.file)
            .expect("host profile file");
        file.write_all(text.as_bytes()).expect("host profile write");
    }
}
