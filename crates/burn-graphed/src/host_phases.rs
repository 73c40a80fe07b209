//! Where a graphed call's host time goes, phase by phase, on a thread that asked for it (the
//! bench's breakdown of a call: [`crate::testing::time_phases`]). Off, a lap costs one
//! thread-local read.

use std::cell::RefCell;
use std::time::{Duration, Instant};

/// The phases of a graphed forward call on the host, in the order they run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostPhase {
    /// The inputs checked, the module's parameters collected and compared with the capture's.
    Plan,
    /// The graphs of the call's signature found in the shape cache.
    Lookup,
    /// The fusion handles of inputs and parameters, and whether a replay may overwrite the
    /// buffers it writes.
    Admit,
    /// The copies into static buffers queued (fusion operations).
    Copy,
    /// Fusion's queue drained onto cubecl's device thread.
    Drain,
    /// The wait for the replay's task on cubecl's device thread, less the task itself
    /// ([`DeviceTask`](Self::DeviceTask)): queueing it, waking that thread, and waking the
    /// caller with the answer (with nothing copied or checked, fusion's drain and the replay
    /// whole).
    Replay,
    /// The replay's task on cubecl's device thread, timed inside it: the copies' launches, the
    /// check of the buffers written since the last replay, and the replay's enqueue.
    DeviceTask,
    /// The outputs handed out to the caller.
    HandOut,
}

impl HostPhase {
    /// Every phase, in order (the order of declaration: a phase's discriminant is its slot).
    pub const ALL: [HostPhase; 8] = [
        HostPhase::Plan,
        HostPhase::Lookup,
        HostPhase::Admit,
        HostPhase::Copy,
        HostPhase::Drain,
        HostPhase::Replay,
        HostPhase::DeviceTask,
        HostPhase::HandOut,
    ];
}

/// One thread's record: time per phase, calls started, and when the running phase began.
struct Record {
    times: [Duration; HostPhase::ALL.len()],
    calls: u64,
    since: Option<Instant>,
}

thread_local! {
    static RECORD: RefCell<Option<Record>> = const { RefCell::new(None) };
}

/// Turns the record of this thread's calls on (emptied) or off.
pub fn time_phases(on: bool) {
    RECORD.with(|record| {
        *record.borrow_mut() = on.then_some(Record {
            times: [Duration::ZERO; HostPhase::ALL.len()],
            calls: 0,
            since: None,
        });
    });
}

/// The calls recorded on this thread since [`time_phases`] turned the record on, and the host
/// time each phase took over them; `None` when the record is off.
pub fn phase_times() -> Option<(u64, Vec<(HostPhase, Duration)>)> {
    RECORD.with(|record| {
        record.borrow().as_ref().map(|record| {
            let times = HostPhase::ALL.iter().copied().zip(record.times).collect();
            (record.calls, times)
        })
    })
}

/// A call starts: the clock of its first phase.
pub(crate) fn start() {
    RECORD.with(|record| {
        if let Some(record) = record.borrow_mut().as_mut() {
            record.calls += 1;
            record.since = Some(Instant::now());
        }
    });
}

/// `phase` of the running call ended now: its time since the previous lap (or the start) is
/// added to it. Ignored outside a call.
pub(crate) fn lap(phase: HostPhase) {
    lap_with_part(phase, phase, Duration::ZERO);
}

/// As [`lap`] for `phase`, of which `part` (at most all of it) was spent in `part_phase`: a
/// wait around work timed where it ran (another thread).
pub(crate) fn lap_with_part(phase: HostPhase, part_phase: HostPhase, part: Duration) {
    RECORD.with(|record| {
        if let Some(record) = record.borrow_mut().as_mut()
            && let Some(since) = record.since
        {
            let now = Instant::now();
            let part = part.min(now - since);
            record.times[part_phase as usize] += part;
            record.times[phase as usize] += now - since - part;
            record.since = Some(now);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_add_to_their_phase_and_only_when_on() {
        for (slot, phase) in HostPhase::ALL.into_iter().enumerate() {
            assert_eq!(
                phase as usize, slot,
                "ALL lists the phases in declaration order"
            );
        }
        lap(HostPhase::Plan);
        start();
        assert_eq!(phase_times(), None, "off: nothing recorded");
        time_phases(true);
        lap(HostPhase::Copy);
        assert_eq!(
            phase_times().map(|(calls, _)| calls),
            Some(0),
            "a lap outside a call"
        );
        for _ in 0..3 {
            start();
            std::thread::sleep(Duration::from_millis(2));
            lap(HostPhase::Replay);
            lap(HostPhase::HandOut);
        }
        let (calls, times) = phase_times().expect("on");
        assert_eq!(calls, 3);
        let time = |phase| times.iter().find(|(p, _)| *p == phase).map(|(_, t)| *t);
        assert!(time(HostPhase::Replay) >= Some(Duration::from_millis(6)));
        assert_eq!(time(HostPhase::Copy), Some(Duration::ZERO));
        assert!(time(HostPhase::HandOut) < time(HostPhase::Replay));
        // A part timed elsewhere moves from the phase to its own, never more than the lap.
        let replay = time(HostPhase::Replay).expect("on");
        start();
        std::thread::sleep(Duration::from_millis(2));
        lap_with_part(
            HostPhase::Replay,
            HostPhase::DeviceTask,
            Duration::from_millis(1),
        );
        start();
        lap_with_part(
            HostPhase::Replay,
            HostPhase::DeviceTask,
            Duration::from_secs(9),
        );
        let (_, times) = phase_times().expect("on");
        let time = |phase| times.iter().find(|(p, _)| *p == phase).map(|(_, t)| *t);
        let task = time(HostPhase::DeviceTask).expect("on");
        assert!(task >= Duration::from_millis(1) && task < Duration::from_secs(1));
        assert!(time(HostPhase::Replay) >= Some(replay + Duration::from_millis(1)));
        time_phases(false);
        assert_eq!(phase_times(), None);
    }
}
