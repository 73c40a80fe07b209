//! Deliberate faults that make graphed results wrong, so that tests can show the equivalence
//! harness fails on them, and the bench can time what a check costs. Public only with the
//! `testing` feature ([`crate::testing`]); never set outside tests and benches.

use std::cell::Cell;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

/// A fault that captures made on this thread while it is injected build into their graphs
/// ([`inject`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FaultInjection {
    /// Correct behaviour.
    #[default]
    None,
    /// Never copy updated parameters into the graphs' buffers (stale parameters).
    SkipParamCopy,
    /// Never copy new inputs into the static input buffers (stale inputs).
    SkipInputCopy,
    /// Never ask cubecl whether the buffers written outside the graphs hold values
    /// (`cube/graph/write_check.rs`): a replay over an unwritten input or parameter runs on stale
    /// values. Results are right whenever every tensor was written, so the bench times the
    /// check with it.
    SkipWriteCheck,
    /// Whole steps: record no optimizer update (the parameters never change).
    SkipUpdate,
    /// Whole steps: write only the first learning rate into the schedule (a frozen rate).
    FreezeLr,
}

thread_local! {
    static INJECTED: Cell<FaultInjection> = const { Cell::new(FaultInjection::None) };
}

/// While the guard lives, every capture made on this thread (by `Graphed::new`,
/// `make_graphed_callables`, `Graphed::prepare`, or a call that captures a new signature)
/// builds `fault` into its graphs; they keep it for their life.
#[must_use = "the fault is injected only while the guard lives"]
pub fn inject(fault: FaultInjection) -> FaultGuard {
    let previous = INJECTED.with(|injected| injected.replace(fault));
    FaultGuard { previous }
}

/// Restores the fault injected before [`inject`] when dropped.
#[derive(Debug)]
pub struct FaultGuard {
    previous: FaultInjection,
}

impl Drop for FaultGuard {
    fn drop(&mut self) {
        INJECTED.with(|injected| injected.set(self.previous));
    }
}

/// The fault a capture on this thread builds in now.
pub(crate) fn injected() -> FaultInjection {
    INJECTED.with(Cell::get)
}

/// The data-parallel step after whose agreement this process ends ([`exit_after_agreement`]),
/// or `u64::MAX`.
static EXIT_AT_STEP: AtomicU64 = AtomicU64::new(u64::MAX);
static EXIT_CODE: AtomicI32 = AtomicI32::new(0);

/// Ends this process with `code` right after the ranks agreed on its data-parallel step
/// `step` (counted from 0, as [`GraphedStep::steps`](crate::GraphedStep::steps) counts
/// updates), before it launches anything of that step: as a process killed mid-step, whose
/// peers go on into the step's all-reduce, which it never joins. No destructor runs.
pub fn exit_after_agreement(step: u64, code: i32) {
    EXIT_CODE.store(code, Ordering::SeqCst);
    EXIT_AT_STEP.store(step, Ordering::SeqCst);
}

/// Where a data-parallel step's agreement passed: ends the process if a test asked for it
/// at `step`.
pub(crate) fn after_agreement(step: u64) {
    if EXIT_AT_STEP.load(Ordering::Relaxed) == step {
        log::warn!("burn-graphed: ending this process after step {step}'s agreement, as asked");
        std::process::exit(EXIT_CODE.load(Ordering::SeqCst));
    }
}
