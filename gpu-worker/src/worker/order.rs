//! Steps in the gateway's order: the gateway sends the next step while one runs, and the two
//! requests may reach the worker's handlers in either order; each names the step it comes
//! after, and waits here until that one has run.

use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// A value (the executor) used by one caller at a time, numbered steps in the order given.
pub struct Ordered<T> {
    state: Mutex<(u64, T)>,
    step_done: Condvar,
}

impl<T> Ordered<T> {
    pub fn new(value: T) -> Self {
        Ordered { state: Mutex::new((0, value)), step_done: Condvar::new() }
    }

    /// Runs `f` on the value once the step numbered `after` has run (`after` 0: at once), as
    /// step `step` (`None`: not a step, e.g. attaching a cpu-worker). Returns `None` if
    /// `after` has not run within `wait` (it was lost).
    pub fn run_after<R>(&self, after: u64, step: Option<u64>, wait: Duration, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        // A panic inside a step is a bug; the executor's state is still consistent enough to
        // fail later steps cleanly rather than take the process down.
        let mut guard = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let deadline = Instant::now() + wait;
        while after != 0 && guard.0 != after {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            guard = self.step_done.wait_timeout(guard, left).unwrap_or_else(PoisonError::into_inner).0;
        }
        if let Some(s) = step {
            guard.0 = s;
        }
        let result = f(&mut guard.1);
        drop(guard);
        self.step_done.notify_all();
        Some(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn steps_run_in_the_order_named_whatever_order_they_arrive_in() {
        let ordered = Arc::new(Ordered::new(Vec::new()));
        // Steps 1..=6, each after the one before, started last first.
        let handles: Vec<_> = (1..=6u64)
            .rev()
            .map(|s| {
                let o = ordered.clone();
                let h = std::thread::spawn(move || o.run_after(s - 1, Some(s), Duration::from_secs(10), |v: &mut Vec<u64>| v.push(s)));
                std::thread::sleep(Duration::from_millis(20));
                h
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), Some(()));
        }
        // A call that is not a step runs at once and leaves the order alone.
        ordered.run_after(0, None, Duration::ZERO, |v| v.push(0)).unwrap();
        ordered.run_after(6, Some(7), Duration::ZERO, |v| v.push(7)).unwrap();
        assert_eq!(*ordered.state.lock().unwrap(), (7, vec![1, 2, 3, 4, 5, 6, 0, 7]));
    }

    #[test]
    fn a_step_after_one_that_never_comes_gives_up() {
        let ordered = Ordered::new(());
        let t = Instant::now();
        assert_eq!(ordered.run_after(41, Some(42), Duration::from_millis(50), |_| ()), None);
        assert!(t.elapsed() >= Duration::from_millis(50));
        assert_eq!(ordered.run_after(0, Some(1), Duration::ZERO, |_| 5), Some(5));
    }
}
