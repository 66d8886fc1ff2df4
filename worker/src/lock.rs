//! The one lock helper of the worker's in-process bookkeeping (the runs a worker holds, the
//! routes and processes of a runner host).

/// Locks a mutex of in-process bookkeeping. Its holders only insert, remove and read whole
/// entries, so a lock poisoned by a panicking holder still guards a consistent map and is
/// taken anyway.
pub(crate) fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
