//! Small synchronisation helpers.

use std::sync::{Mutex, MutexGuard};

/// Locks a mutex, recovering from poisoning (a panicked holder leaves plain data usable).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
