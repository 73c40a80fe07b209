//! The router: where one call of a graphed callable or one whole step goes, decided once,
//! before the engine is entered. It answers [`Route::Replay`] with what the engine needs (graphs
//! found in the shape cache or captured now, and admitted by them), or [`Route::Eager`] with the
//! reason; nothing the engine does afterwards sends a call back. It owns the shape cache of the
//! callable's or the step's graphs and the counters of eager calls, so that [`Graphed`] and
//! [`GraphedStep`] route with the same code and count with the same words.
//!
//! [`Graphed`]: crate::Graphed
//! [`GraphedStep`]: crate::GraphedStep

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::thread::ThreadId;

use crate::config::GraphedConfig;
use crate::error::GraphedError;
use crate::shape_cache::{Admission, CacheLimits, ShapeCache, ShapeCacheStats};
use crate::stats::EagerReason;
use crate::sync::lock;

/// Where a call goes.
pub(crate) enum Route<T> {
    /// Replay: what the admitted graphs need for the call.
    Replay(T),
    /// Run eagerly, for this reason.
    Eager(EagerReason),
}

/// What a call whose signature has no graphs does.
pub(crate) enum OnMiss<F> {
    /// Capture them now with `F` (which returns the graphs and the bytes they hold), where the
    /// shape cache admits them.
    Capture(F),
    /// Capture them after the call, where the shape cache admits them (a data-parallel step:
    /// every rank captures in its turn); the call runs eagerly for
    /// [`EagerReason::CaptureAfterStep`].
    After,
    /// Run eagerly for this reason (the callable captures no more signatures).
    Eager(EagerReason),
}

/// The capture of an [`OnMiss`] that captures nothing ([`OnMiss::After`], [`OnMiss::Eager`]).
pub(crate) type NoCapture<G> = fn() -> Result<(G, u64), GraphedError>;

/// A routed call.
pub(crate) struct Routed<T, G> {
    pub route: Route<T>,
    /// Whether this call captured the graphs it found.
    pub captured: bool,
    /// The graphs that capture evicted from the shape cache, least recently used first.
    pub evicted: Vec<G>,
}

impl<T, G> Routed<T, G> {
    /// A call routed eagerly for `reason`.
    pub(crate) fn eager(reason: EagerReason) -> Self {
        Self {
            route: Route::Eager(reason),
            captured: false,
            evicted: Vec::new(),
        }
    }
}

/// The shape cache of one callable's (or one step's) graphs `G` by signature `K`, the thread
/// they replay on, and the eager calls counted by reason.
pub(crate) struct Router<G, K> {
    /// `None` where the backend cannot capture: every call runs eagerly.
    cache: Option<Mutex<ShapeCache<G, K>>>,
    thread: ThreadId,
    /// A failed capture is the call's error ([`GraphedConfig::require_graphs`]), not an eager
    /// call.
    ///
    /// [`GraphedConfig::require_graphs`]: crate::GraphedConfig::require_graphs
    require_graphs: bool,
    eager: Mutex<BTreeMap<EagerReason, u64>>,
}

impl<G: Clone, K: PartialEq + Clone> Router<G, K> {
    /// A router holding the first capture's graphs with their signature and bytes (`None`:
    /// the backend cannot capture), within `config`'s shape cache limits, for calls on this
    /// thread.
    pub(crate) fn new(first: Option<(K, G, u64)>, config: &GraphedConfig) -> Self {
        let limits = CacheLimits {
            max_graphs: config.max_graphs,
            max_bytes: config.max_graph_bytes,
        };
        Self {
            cache: first.map(|(key, graphs, bytes)| {
                Mutex::new(ShapeCache::new(limits, key, graphs, bytes))
            }),
            thread: std::thread::current().id(),
            require_graphs: config.require_graphs,
            eager: Mutex::new(BTreeMap::new()),
        }
    }

    /// Why no call can replay now, whatever its signature: the backend cannot capture, or the
    /// call is on another thread than the capture.
    pub(crate) fn unavailable(&self) -> Option<EagerReason> {
        if self.cache.is_none() {
            Some(EagerReason::Unsupported)
        } else if std::thread::current().id() != self.thread {
            Some(EagerReason::OtherThread)
        } else {
            None
        }
    }

    /// Routes a call of signature `key`: its graphs from the shape cache (a hit), or, on a
    /// miss, what `miss` says, within the cache's limits (`busy` names the graphs that cannot be
    /// evicted now); then `ready` admits the call on the graphs or says why it runs eagerly.
    ///
    /// # Errors
    ///
    /// The capture's error where it fails and `strict` or
    /// [`GraphedConfig::require_graphs`](crate::GraphedConfig::require_graphs) asks for it.
    /// Otherwise a failed capture is remembered (the signature is not tried again) and the call
    /// runs eagerly for [`EagerReason::CaptureFailed`].
    pub(crate) fn route<T, F>(
        &self,
        key: &K,
        miss: OnMiss<F>,
        busy: impl Fn(&G) -> bool,
        strict: bool,
        ready: impl FnOnce(&G) -> Result<T, EagerReason>,
    ) -> Result<Routed<T, G>, GraphedError>
    where
        F: FnOnce() -> Result<(G, u64), GraphedError>,
    {
        if let Some(reason) = self.unavailable() {
            return Ok(Routed::eager(reason));
        }
        let Some(cache) = &self.cache else {
            return Ok(Routed::eager(EagerReason::Unsupported));
        };
        let found = lock(cache).get(key).cloned();
        let (graphs, captured, evicted) = match found {
            Some(graphs) => (graphs, false, Vec::new()),
            None => {
                let capture = match miss {
                    OnMiss::Eager(reason) => return Ok(Routed::eager(reason)),
                    OnMiss::After => None,
                    OnMiss::Capture(capture) => Some(capture),
                };
                match lock(cache).admit(key, &busy) {
                    Admission::Capture => {}
                    Admission::FailedBefore => {
                        return Ok(Routed::eager(EagerReason::CaptureFailed));
                    }
                    Admission::Full => return Ok(Routed::eager(EagerReason::ShapeCacheFull)),
                }
                let Some(capture) = capture else {
                    return Ok(Routed::eager(EagerReason::CaptureAfterStep));
                };
                // The lock is not held while capturing: a capture runs user code, which may
                // ask for this callable's statistics.
                let (graphs, bytes) = match capture() {
                    Ok(captured) => captured,
                    Err(error) if strict || self.require_graphs => return Err(error),
                    Err(error) => {
                        lock(cache).record_failure(key.clone(), error.to_string());
                        return Ok(Routed::eager(EagerReason::CaptureFailed));
                    }
                };
                match lock(cache).insert(key.clone(), graphs.clone(), bytes, &busy) {
                    Ok(evicted) => (graphs, true, evicted),
                    Err(_too_large) => return Ok(Routed::eager(EagerReason::ShapeCacheFull)),
                }
            }
        };
        let route = match ready(&graphs) {
            Ok(admitted) => Route::Replay(admitted),
            Err(reason) => Route::Eager(reason),
        };
        Ok(Routed {
            route,
            captured,
            evicted,
        })
    }

    /// Adds graphs captured after a call that [`OnMiss::After`] routed eagerly; graphs too
    /// large for the cache are dropped (the signature then runs eagerly and asks again).
    pub(crate) fn insert(&self, key: K, graphs: G, bytes: u64) {
        if let Some(cache) = &self.cache {
            let _ = lock(cache).insert(key, graphs, bytes, |_| false);
        }
    }

    /// Counts one eager call.
    pub(crate) fn count_eager(&self, reason: EagerReason) {
        *lock(&self.eager).entry(reason).or_default() += 1;
    }

    /// The eager calls so far, by reason.
    pub(crate) fn eager_calls(&self) -> BTreeMap<EagerReason, u64> {
        lock(&self.eager).clone()
    }

    /// The cached graphs, least recently used first.
    pub(crate) fn graphs(&self) -> Vec<G> {
        self.cache
            .as_ref()
            .map(|cache| lock(cache).values().cloned().collect())
            .unwrap_or_default()
    }

    /// The shape cache's counters (all zero without graphs).
    pub(crate) fn cache_stats(&self) -> ShapeCacheStats {
        self.cache
            .as_ref()
            .map(|cache| lock(cache).stats().clone())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A router over graphs `u32` keyed by a batch size, holding `1`'s graphs, with room for
    /// two signatures.
    fn two_signatures(require_graphs: bool) -> Router<u32, usize> {
        let config = GraphedConfig::new()
            .with_max_graphs(2)
            .with_require_graphs(require_graphs);
        Router::new(Some((1, 10, 100)), &config)
    }

    fn replayed<T: std::fmt::Debug>(routed: Routed<T, u32>) -> Option<T> {
        match routed.route {
            Route::Replay(call) => Some(call),
            Route::Eager(_) => None,
        }
    }

    fn eager_reason<T>(routed: &Routed<T, u32>) -> Option<EagerReason> {
        match &routed.route {
            Route::Replay(_) => None,
            Route::Eager(reason) => Some(reason.clone()),
        }
    }

    fn capture(graphs: u32) -> impl FnOnce() -> Result<(u32, u64), GraphedError> {
        move || Ok((graphs, 100))
    }

    fn admit(graphs: &u32) -> Result<u32, EagerReason> {
        Ok(*graphs)
    }

    #[test]
    fn a_hit_replays_what_the_graphs_admit() {
        let router = two_signatures(false);
        let routed = router
            .route(&1, OnMiss::Capture(capture(99)), |_| false, false, admit)
            .unwrap();
        assert!(!routed.captured);
        assert_eq!(replayed(routed), Some(10));
        let refused = router
            .route(
                &1,
                OnMiss::Capture(capture(99)),
                |_| false,
                false,
                |_| Err::<u32, _>(EagerReason::BackwardPending),
            )
            .unwrap();
        assert_eq!(eager_reason(&refused), Some(EagerReason::BackwardPending));
        assert_eq!(router.cache_stats().hits, 2);
    }

    #[test]
    fn a_miss_captures_then_hits_and_evicts_beyond_the_limit() {
        let router = two_signatures(false);
        let routed = router
            .route(&2, OnMiss::Capture(capture(20)), |_| false, false, admit)
            .unwrap();
        assert!(routed.captured && routed.evicted.is_empty());
        assert_eq!(replayed(routed), Some(20));
        let again = router
            .route(&2, OnMiss::Capture(capture(99)), |_| false, false, admit)
            .unwrap();
        assert!(!again.captured);
        assert_eq!(replayed(again), Some(20));
        // A third signature evicts the least recently used one: `1`'s graphs.
        let third = router
            .route(&3, OnMiss::Capture(capture(30)), |_| false, false, admit)
            .unwrap();
        assert_eq!(third.evicted, vec![10]);
        assert_eq!(router.graphs(), vec![20, 30]);
        let stats = router.cache_stats();
        assert_eq!((stats.captures, stats.evictions, stats.graphs), (2, 1, 2));
    }

    #[test]
    fn busy_graphs_are_never_evicted() {
        let router = two_signatures(false);
        router
            .route(&2, OnMiss::Capture(capture(20)), |_| false, false, admit)
            .unwrap();
        let full = router
            .route(&3, OnMiss::Capture(capture(30)), |_| true, false, admit)
            .unwrap();
        assert_eq!(eager_reason(&full), Some(EagerReason::ShapeCacheFull));
        assert_eq!(router.graphs(), vec![10, 20]);
    }

    #[test]
    fn a_miss_that_does_not_capture_says_why() {
        let router = two_signatures(false);
        let eager = OnMiss::<NoCapture<u32>>::Eager(EagerReason::Shape { index: 0 });
        let routed = router.route(&2, eager, |_| false, false, admit).unwrap();
        assert_eq!(eager_reason(&routed), Some(EagerReason::Shape { index: 0 }));
        let after = router
            .route(&2, OnMiss::<NoCapture<u32>>::After, |_| false, false, admit)
            .unwrap();
        assert_eq!(eager_reason(&after), Some(EagerReason::CaptureAfterStep));
        router.insert(2, 20, 100);
        let hit = router
            .route(&2, OnMiss::<NoCapture<u32>>::After, |_| false, false, admit)
            .unwrap();
        assert_eq!(replayed(hit), Some(20));
        assert_eq!(router.cache_stats().captures, 1);
    }

    #[test]
    fn a_failed_capture_is_remembered_or_returned() {
        let failing = || -> Result<(u32, u64), GraphedError> { Err(GraphedError::NoInputs) };
        let router = two_signatures(false);
        let routed = router
            .route(&2, OnMiss::Capture(failing), |_| false, false, admit)
            .unwrap();
        assert_eq!(eager_reason(&routed), Some(EagerReason::CaptureFailed));
        // Not tried again.
        let again = router
            .route(&2, OnMiss::Capture(capture(20)), |_| false, false, admit)
            .unwrap();
        assert_eq!(eager_reason(&again), Some(EagerReason::CaptureFailed));
        let stats = router.cache_stats();
        assert_eq!(stats.failed_captures, 1);
        assert!(stats.last_capture_error.is_some());
        // Strict calls and `require_graphs` return the capture's error.
        let strict =
            two_signatures(false).route(&2, OnMiss::Capture(failing), |_| false, true, admit);
        assert!(matches!(strict, Err(GraphedError::NoInputs)));
        let required =
            two_signatures(true).route(&2, OnMiss::Capture(failing), |_| false, false, admit);
        assert!(matches!(required, Err(GraphedError::NoInputs)));
    }

    #[test]
    fn without_graphs_or_on_another_thread_every_call_is_eager() {
        let none: Router<u32, usize> = Router::new(None, &GraphedConfig::new());
        assert_eq!(none.unavailable(), Some(EagerReason::Unsupported));
        let routed = none
            .route(&1, OnMiss::Capture(capture(10)), |_| false, false, admit)
            .unwrap();
        assert_eq!(eager_reason(&routed), Some(EagerReason::Unsupported));
        assert_eq!(none.cache_stats(), ShapeCacheStats::default());
        let router = two_signatures(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                assert_eq!(router.unavailable(), Some(EagerReason::OtherThread));
                let routed = router
                    .route(&1, OnMiss::Capture(capture(10)), |_| false, false, admit)
                    .unwrap();
                assert_eq!(eager_reason(&routed), Some(EagerReason::OtherThread));
            });
        });
        assert_eq!(router.unavailable(), None);
    }

    #[test]
    fn eager_calls_are_counted_by_reason() {
        let router = two_signatures(false);
        router.count_eager(EagerReason::ModeChanged);
        router.count_eager(EagerReason::ModeChanged);
        router.count_eager(EagerReason::OtherThread);
        let counts = router.eager_calls();
        assert_eq!(counts.get(&EagerReason::ModeChanged), Some(&2));
        assert_eq!(counts.get(&EagerReason::OtherThread), Some(&1));
    }
}
