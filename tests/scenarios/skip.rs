//! A test that cannot run its checks on this machine (too few GPUs, an adapter without f16)
//! says so in one line that the runners count as a skip, not a pass: `run.sh tests` and
//! `cargo xtask test` read `skipped: TEST: REASON` lines from the tests' stdout, subtract them
//! from the passed tests and list them. Shared by the suites (`mod scenarios`) and by
//! `device_defaults.rs` (`#[path]`), which does not load the scenarios.

use std::io::Write;

/// Prints `skipped: TEST: REASON` on stdout, past the test harness's capture of output, so
/// that the line shows with and without `--nocapture`. TEST is the running test's name:
/// libtest names the thread it runs a test on after the test. Call it on the test's thread,
/// then return from the test.
pub fn skip(reason: &str) {
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("(unnamed thread)");
    // One write of the whole line, so that lines of tests running beside it do not cut it.
    let line = format!("skipped: {test}: {reason}\n");
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_all(line.as_bytes());
    let _ = stdout.flush();
}
