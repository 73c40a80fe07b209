//! A bounded, least-recently-used cache of captured graphs keyed by input signature (shapes,
//! dtypes, `require_grad`): how a graphed callable serves several shapes (e.g. the smaller last
//! batch of an epoch) without re-recording without bound.
//!
//! The policy, in one place:
//! - a call whose signature has graphs replays them (a *hit*);
//! - a new signature is captured when the cache may grow or can evict an entry (a *capture*),
//!   evicting least-recently-used entries until both limits hold (*evictions*); an entry whose
//!   backward is still pending is never evicted;
//! - otherwise, or when the capture fails, the call runs eagerly (a fallback, counted with its
//!   reason); a signature whose capture failed, or whose graphs alone exceed the byte limit, is
//!   not captured again (the last 16 such signatures are remembered).
//!
//! The cache is generic over what it holds so that the policy is testable without a GPU.

use crate::tensors::TensorSpec;

/// Counters and contents of a graphed callable's shape cache.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShapeCacheStats {
    /// Calls served by graphs already in the cache.
    pub hits: u64,
    /// Captures made for new signatures after the first (the first capture is not counted).
    pub captures: u64,
    /// Captures for new signatures that failed (the calls ran eagerly).
    pub failed_captures: u64,
    /// Graphs dropped to make room for a new signature.
    pub evictions: u64,
    /// Graphs in the cache now.
    pub graphs: usize,
    /// Device bytes the cached graphs hold now (the sum of their
    /// [`GraphMemory::held_bytes`](crate::GraphMemory::held_bytes)).
    pub held_bytes: u64,
    /// The error of the last failed capture, if any.
    pub last_capture_error: Option<String>,
}

/// Limits of a shape cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CacheLimits {
    /// Signatures with graphs, at most (at least 1: the capture's own).
    pub max_graphs: usize,
    /// Bytes held by all cached graphs, at most (`None`: no limit).
    pub max_bytes: Option<u64>,
}

struct Entry<S, K> {
    key: K,
    value: S,
    bytes: u64,
    last_used: u64,
}

/// What the cache says about a signature it does not hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Capture it: there is room, or an entry can be evicted.
    Capture,
    /// Run eagerly: its capture failed before.
    FailedBefore,
    /// Run eagerly: the cache is full and every entry is in use.
    Full,
}

/// The cache (see the module docs), keyed by `K`: an input signature.
pub(crate) struct ShapeCache<S, K = Vec<TensorSpec>> {
    entries: Vec<Entry<S, K>>,
    /// Signatures not to capture again, with what to answer for them.
    refused: Vec<(K, Admission)>,
    limits: CacheLimits,
    clock: u64,
    stats: ShapeCacheStats,
}

/// Signatures remembered as failed, at most (older ones are forgotten and may be retried).
const MAX_FAILED: usize = 16;

impl<S, K: PartialEq> ShapeCache<S, K> {
    /// A cache holding the first capture's graphs.
    pub fn new(limits: CacheLimits, key: K, value: S, bytes: u64) -> Self {
        let mut cache = Self {
            entries: Vec::new(),
            refused: Vec::new(),
            limits: CacheLimits {
                max_graphs: limits.max_graphs.max(1),
                ..limits
            },
            clock: 0,
            stats: ShapeCacheStats::default(),
        };
        cache.push(key, value, bytes);
        cache
    }

    fn push(&mut self, key: K, value: S, bytes: u64) {
        self.clock += 1;
        self.entries.push(Entry {
            key,
            value,
            bytes,
            last_used: self.clock,
        });
        self.refresh_totals();
    }

    fn refresh_totals(&mut self) {
        self.stats.graphs = self.entries.len();
        self.stats.held_bytes = self.entries.iter().map(|e| e.bytes).sum();
    }

    /// The graphs of `key`, marked as used (a hit).
    pub fn get(&mut self, key: &K) -> Option<&S> {
        self.clock += 1;
        let clock = self.clock;
        let entry = self.entries.iter_mut().find(|e| e.key == *key)?;
        entry.last_used = clock;
        self.stats.hits += 1;
        Some(&entry.value)
    }

    /// Whether a signature the cache does not hold may be captured; `busy` says which entries
    /// cannot be evicted now.
    pub fn admit(&self, key: &K, busy: impl Fn(&S) -> bool) -> Admission {
        if let Some((_, answer)) = self.refused.iter().find(|(k, _)| k == key) {
            return *answer;
        }
        if self.entries.len() < self.limits.max_graphs
            || self.entries.iter().any(|e| !busy(&e.value))
        {
            Admission::Capture
        } else {
            Admission::Full
        }
    }

    /// Adds the graphs captured for `key`, evicting least-recently-used entries that are not
    /// `busy` until both limits hold. Returns the evicted values, or `Err(value)` when the new
    /// entry cannot fit (it alone exceeds the byte limit, or every other entry is busy): the
    /// cache is then unchanged, and a signature too large on its own is refused from then on.
    /// A `key` the cache holds already (captured again: a data-parallel rank whose all-reduce
    /// is inside its graphs captures with every rank that must) is replaced, its old value
    /// returned first and not counted as an eviction.
    pub fn insert(
        &mut self,
        key: K,
        value: S,
        bytes: u64,
        busy: impl Fn(&S) -> bool,
    ) -> Result<Vec<S>, S> {
        let Some(index) = self.entries.iter().position(|e| e.key == key) else {
            return self.insert_new(key, value, bytes, busy);
        };
        let old = self.entries.remove(index);
        self.refresh_totals();
        match self.insert_new(key, value, bytes, busy) {
            Ok(mut evicted) => {
                evicted.insert(0, old.value);
                Ok(evicted)
            }
            Err(value) => {
                self.entries.insert(index, old);
                self.refresh_totals();
                Err(value)
            }
        }
    }

    /// [`insert`](Self::insert) of a `key` the cache does not hold.
    fn insert_new(
        &mut self,
        key: K,
        value: S,
        bytes: u64,
        busy: impl Fn(&S) -> bool,
    ) -> Result<Vec<S>, S> {
        let over = |count: usize, held: u64| {
            count > self.limits.max_graphs || self.limits.max_bytes.is_some_and(|max| held > max)
        };
        // Plan the evictions first, so that a new entry that cannot fit changes nothing.
        let mut order: Vec<usize> = (0..self.entries.len())
            .filter(|&i| !busy(&self.entries[i].value))
            .collect();
        order.sort_by_key(|&i| self.entries[i].last_used);
        let mut count = self.entries.len() + 1;
        let mut held = self.stats.held_bytes + bytes;
        let mut victims = Vec::new();
        for index in order {
            if !over(count, held) {
                break;
            }
            count -= 1;
            held -= self.entries[index].bytes;
            victims.push(index);
        }
        if over(count, held) {
            if self.limits.max_bytes.is_some_and(|max| bytes > max) {
                self.refuse(key, Admission::Full);
            }
            return Err(value);
        }
        // Victims were picked least recently used first: hand them out in that order.
        let (mut removed, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.entries)
            .into_iter()
            .enumerate()
            .partition(|(index, _)| victims.contains(index));
        self.entries = kept.into_iter().map(|(_, entry)| entry).collect();
        removed.sort_by_key(|(_, entry)| entry.last_used);
        let evicted: Vec<S> = removed.into_iter().map(|(_, entry)| entry.value).collect();
        self.stats.evictions += evicted.len() as u64;
        self.stats.captures += 1;
        self.push(key, value, bytes);
        Ok(evicted)
    }

    /// Remembers that capturing `key` failed with `error`.
    pub fn record_failure(&mut self, key: K, error: String) {
        self.refuse(key, Admission::FailedBefore);
        self.stats.failed_captures += 1;
        self.stats.last_capture_error = Some(error);
    }

    fn refuse(&mut self, key: K, answer: Admission) {
        if self.refused.len() == MAX_FAILED {
            self.refused.remove(0);
        }
        self.refused.push((key, answer));
    }

    /// The cached values, least recently used first.
    pub fn values(&self) -> impl Iterator<Item = &S> {
        let mut entries: Vec<&Entry<S, K>> = self.entries.iter().collect();
        entries.sort_by_key(|e| e.last_used);
        entries.into_iter().map(|e| &e.value)
    }

    /// The counters.
    pub fn stats(&self) -> &ShapeCacheStats {
        &self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::DType;

    fn key(batch: usize) -> Vec<TensorSpec> {
        vec![TensorSpec {
            shape: vec![batch, 4],
            dtype: DType::F32,
            require_grad: false,
        }]
    }

    fn limits(max_graphs: usize, max_bytes: Option<u64>) -> CacheLimits {
        CacheLimits {
            max_graphs,
            max_bytes,
        }
    }

    #[test]
    fn evicts_least_recently_used() {
        let mut cache = ShapeCache::new(limits(2, None), key(1), 1, 10);
        assert_eq!(cache.admit(&key(2), |_| false), Admission::Capture);
        assert_eq!(cache.insert(key(2), 2, 10, |_| false), Ok(vec![]));
        // 1 is used after 2: 2 is now the least recently used.
        assert_eq!(cache.get(&key(1)), Some(&1));
        assert_eq!(cache.insert(key(3), 3, 10, |_| false), Ok(vec![2]));
        assert!(cache.get(&key(2)).is_none());
        assert_eq!(cache.values().copied().collect::<Vec<_>>(), vec![1, 3]);
        let stats = cache.stats();
        assert_eq!(
            (stats.hits, stats.captures, stats.evictions, stats.graphs),
            (1, 2, 1, 2)
        );
        assert_eq!(stats.held_bytes, 20);
    }

    #[test]
    fn a_key_captured_again_replaces_its_entry() {
        let mut cache = ShapeCache::new(limits(2, None), key(1), 1, 10);
        assert_eq!(cache.insert(key(2), 2, 10, |_| false), Ok(vec![]));
        // Key 1 again, with other bytes: its old value comes back, nothing else is evicted.
        assert_eq!(cache.insert(key(1), 11, 15, |_| false), Ok(vec![1]));
        assert_eq!(cache.get(&key(1)), Some(&11));
        assert_eq!(cache.get(&key(2)), Some(&2));
        let stats = cache.stats();
        assert_eq!(
            (stats.graphs, stats.evictions, stats.held_bytes),
            (2, 0, 25)
        );
        // A replacement that cannot fit leaves the old entry.
        let mut full = ShapeCache::new(limits(2, Some(20)), key(1), 1, 10);
        assert_eq!(full.insert(key(1), 11, 30, |_| false), Err(11));
        assert_eq!(full.get(&key(1)), Some(&1));
        assert_eq!(full.stats().held_bytes, 10);
    }

    #[test]
    fn byte_limit_evicts_several_or_rejects() {
        let mut cache = ShapeCache::new(limits(8, Some(25)), key(1), 1, 10);
        assert_eq!(cache.insert(key(2), 2, 10, |_| false), Ok(vec![]));
        // 20 held + 20 new > 25: both older entries go.
        assert_eq!(cache.insert(key(3), 3, 20, |_| false), Ok(vec![1, 2]));
        // Larger than the limit on its own: rejected, nothing changes, not tried again.
        assert_eq!(cache.insert(key(4), 4, 30, |_| false), Err(4));
        assert_eq!(cache.values().copied().collect::<Vec<_>>(), vec![3]);
        assert_eq!(cache.admit(&key(4), |_| false), Admission::Full);
        assert_eq!(cache.stats().evictions, 2);
    }

    #[test]
    fn busy_entries_are_never_evicted() {
        let mut cache = ShapeCache::new(limits(1, None), key(1), 1, 10);
        assert_eq!(cache.admit(&key(2), |v| *v == 1), Admission::Full);
        assert_eq!(cache.insert(key(2), 2, 10, |v| *v == 1), Err(2));
        assert_eq!(cache.insert(key(2), 2, 10, |_| false), Ok(vec![1]));
    }

    #[test]
    fn failed_signatures_are_not_retried() {
        let mut cache = ShapeCache::new(limits(4, None), key(1), 1, 10);
        cache.record_failure(key(2), "boom".into());
        assert_eq!(cache.admit(&key(2), |_| false), Admission::FailedBefore);
        assert_eq!(cache.admit(&key(3), |_| false), Admission::Capture);
        assert_eq!(cache.stats().failed_captures, 1);
        assert_eq!(cache.stats().last_capture_error.as_deref(), Some("boom"));
        for batch in 10..10 + MAX_FAILED {
            cache.record_failure(key(batch), "again".into());
        }
        // The oldest failure is forgotten, so that signature may be tried again.
        assert_eq!(cache.admit(&key(2), |_| false), Admission::Capture);
    }
}
