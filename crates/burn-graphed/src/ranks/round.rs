//! One group's rounds of agreement, in the memory of one process: every rank states what it is
//! about to do ([`Entry`]), and the round ends when all have, with one outcome for all. The
//! ranks are threads of this process ([`super::RankGroup::new`]), or, in the process of rank 0
//! of a group of processes, the threads that serve the other ranks' connections
//! (`super::process`).

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::GraphedError;
use crate::sync::lock;

/// A rank's statement: what it is deciding, and its decision or its failure.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Entry {
    pub(crate) what: String,
    pub(crate) decision: Result<String, String>,
    /// A yes/no that need not be the same on every rank.
    pub(crate) vote: bool,
    /// Values handed to every rank with the outcome as `combine` says, not compared (a
    /// gradient bucket, a model's starting values).
    pub(crate) payload: Vec<f32>,
    /// What the round makes of the payloads (the same on every rank, or the ranks disagree).
    pub(crate) combine: Combine,
}

/// What a round hands every rank of the ranks' payloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Combine {
    /// Every rank's, in rank order.
    Gather,
    /// Their mean, summed in rank order and divided by the group's size: the same bits on
    /// every rank.
    Mean,
    /// Rank 0's.
    First,
}

/// What a round gives every rank when all agreed: whether any rank voted yes, and the payloads
/// as the round combined them ([`Combine`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Gathered {
    pub(crate) any: bool,
    pub(crate) payloads: Arc<Vec<Vec<f32>>>,
}

/// Called once when a group ends in a way that may leave a rank's collective unfinished (a
/// rank's process gone, a rank that never arrived, a rank that abandoned, a collective's own
/// failure), with the error that ended it, by the thread that learned of it and outside any
/// lock of the group: NCCL's communicators are aborted there, so that no device waits for good
/// in an all-reduce a peer will never join. An agreement that ends in an error does not call
/// it: every rank is at the agreement then, and no collective waits for a missing peer.
pub(crate) type OnEnd = Arc<dyn Fn(&GraphedError) + Send + Sync>;

/// The [`OnEnd`]s of a group, called at most once.
#[derive(Default)]
pub(crate) struct Watchers {
    /// The calls, and the error they were called with once they were (then no call again).
    inner: Mutex<(Vec<OnEnd>, Option<GraphedError>)>,
}

impl std::fmt::Debug for Watchers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchers")
            .field("fired", &lock(&self.inner).1.is_some())
            .finish_non_exhaustive()
    }
}

impl Watchers {
    /// Adds `call`; called at once if the group already ended.
    pub(crate) fn add(&self, call: OnEnd) {
        let ended = {
            let mut inner = lock(&self.inner);
            inner.0.push(call.clone());
            inner.1.clone()
        };
        if let Some(error) = ended {
            call(&error);
        }
    }

    /// Calls every [`OnEnd`] with `error`, the first time only (outside the lock: a call may
    /// take seconds).
    pub(crate) fn fire(&self, error: &GraphedError) {
        let calls = {
            let mut inner = lock(&self.inner);
            if inner.1.is_some() {
                return;
            }
            inner.1 = Some(error.clone());
            inner.0.clone()
        };
        for call in calls {
            call(error);
        }
    }
}

/// The shared state of a group's rounds.
#[derive(Debug)]
pub(crate) struct Rounds {
    size: usize,
    timeout: Duration,
    state: Mutex<State>,
    arrived: Condvar,
    watchers: Watchers,
}

#[derive(Debug, Default)]
struct State {
    /// Rounds completed so far; the current one's number.
    round: u64,
    /// What each rank stated in the current round.
    entries: Vec<Option<Entry>>,
    /// The outcome of round `round - 1`, read by the ranks that waited for it.
    last: Option<Result<Gathered, GraphedError>>,
    /// The error that ended the group, returned by every later call.
    spent: Option<GraphedError>,
}

impl Rounds {
    /// The rounds of a group of `size` ranks (at least 1), each waiting at most `timeout`.
    pub(crate) fn new(size: usize, timeout: Duration) -> Self {
        Self {
            size,
            timeout,
            state: Mutex::new(State {
                entries: vec![None; size],
                ..State::default()
            }),
            arrived: Condvar::new(),
            watchers: Watchers::default(),
        }
    }

    /// Calls `call` when the group ends as [`OnEnd`] says.
    pub(crate) fn on_end(&self, call: OnEnd) {
        self.watchers.add(call);
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Rounds completed so far: every rank's statement in and the outcome decided (a success
    /// or an agreed failure).
    pub(crate) fn completed(&self) -> u64 {
        lock(&self.state).round
    }

    /// Ends the group with `error` on every rank (the first error stays).
    pub(crate) fn abandon(&self, error: GraphedError) {
        let spent = {
            let mut state = lock(&self.state);
            let spent = state.spent.get_or_insert(error).clone();
            self.arrived.notify_all();
            spent
        };
        self.watchers.fire(&spent);
    }

    /// States `rank`'s `entry` and waits for every rank's; the round's outcome.
    pub(crate) fn exchange(&self, rank: usize, entry: Entry) -> Result<Gathered, GraphedError> {
        let mut state = lock(&self.state);
        if let Some(error) = &state.spent {
            return Err(error.clone());
        }
        let round = state.round;
        state.entries[rank] = Some(entry);
        if state.entries.iter().all(Option::is_some) {
            let entries: Vec<Entry> = state.entries.iter_mut().filter_map(Option::take).collect();
            let outcome = outcome(&entries).map(|()| Gathered {
                any: entries.iter().any(|e| e.vote),
                payloads: Arc::new(combine(entries)),
            });
            if let Err(error) = &outcome {
                state.spent = Some(error.clone());
            }
            state.last = Some(outcome.clone());
            state.round += 1;
            self.arrived.notify_all();
            return outcome;
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            if state.round != round {
                // The round this rank joined completed; no later one can have, since it needs
                // this rank.
                return state.last.clone().unwrap_or_else(|| {
                    Ok(Gathered {
                        any: false,
                        payloads: Arc::default(),
                    })
                });
            }
            if let Some(error) = &state.spent {
                return Err(error.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                let error = GraphedError::RankTimeout {
                    what: state.entries[rank]
                        .as_ref()
                        .map_or_else(String::new, |e| e.what.clone()),
                    missing: (0..self.size)
                        .filter(|&r| state.entries[r].is_none())
                        .collect(),
                    waited_ms: self.timeout.as_millis() as u64,
                };
                let spent = state.spent.get_or_insert(error).clone();
                self.arrived.notify_all();
                drop(state);
                self.watchers.fire(&spent);
                return Err(spent);
            }
            state = self
                .arrived
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }
}

/// The payloads of a round every rank agreed on, as its entries' [`Combine`] says.
fn combine(entries: Vec<Entry>) -> Vec<Vec<f32>> {
    match entries[0].combine {
        Combine::Gather => entries.into_iter().map(|e| e.payload).collect(),
        Combine::First => entries.into_iter().take(1).map(|e| e.payload).collect(),
        Combine::Mean => {
            let len = entries[0].payload.len();
            let mut sum = vec![0.0f32; len];
            for entry in &entries {
                for (s, v) in sum.iter_mut().zip(&entry.payload) {
                    *s += v;
                }
            }
            let size = entries.len() as f32;
            vec![sum.into_iter().map(|s| s / size).collect()]
        }
    }
}

/// The outcome of a round in which every rank stated `entries` (in rank order).
fn outcome(entries: &[Entry]) -> Result<(), GraphedError> {
    let first = &entries[0];
    if entries
        .iter()
        .any(|e| e.what != first.what || e.combine != first.combine)
    {
        return Err(GraphedError::RanksDisagree {
            what: first.what.clone(),
            decisions: listing(entries, |e| e.what.clone()),
        });
    }
    if let Some((rank, reason)) = entries
        .iter()
        .enumerate()
        .find_map(|(rank, e)| e.decision.as_ref().err().map(|reason| (rank, reason)))
    {
        return Err(GraphedError::RankFailed {
            rank,
            what: first.what.clone(),
            reason: reason.clone(),
        });
    }
    if entries.iter().any(|e| e.decision != first.decision) {
        return Err(GraphedError::RanksDisagree {
            what: first.what.clone(),
            decisions: listing(entries, |e| {
                e.decision.clone().unwrap_or_else(|reason| reason)
            }),
        });
    }
    Ok(())
}

/// "rank 0: A; rank 1: B" of what `text` says of each entry.
fn listing(entries: &[Entry], text: impl Fn(&Entry) -> String) -> String {
    entries
        .iter()
        .enumerate()
        .map(|(rank, e)| format!("rank {rank}: {}", text(e)))
        .collect::<Vec<_>>()
        .join("; ")
}
