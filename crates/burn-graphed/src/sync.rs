//! Locking that survives a panic elsewhere.

/// Locks `mutex`, also after a panic elsewhere poisoned it: every mutex of this crate guards
/// counters and records that stay consistent between statements, so a poisoned one is usable.
pub(crate) fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}
