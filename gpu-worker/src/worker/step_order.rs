//! Steps in the gateway's order: the gateway sends the next step while one runs, and the two
//! requests may reach the worker's handlers in either order; each names the step it comes
//! after, and waits here until that one has run.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How often a waiting step checks whether its caller is gone.
const CANCEL_POLL: Duration = Duration::from_millis(50);

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
    /// step `step` (`None`: not a step, e.g. attaching a cpu-worker). Returns `None` without
    /// running it if `after` has not run within `wait` (it was lost), or if `cancelled` is set
    /// first (the caller went away: a step of a gateway that is gone must not run later, when
    /// a new gateway's step of the same number completes).
    pub fn run_after<R>(&self, after: u64, step: Option<u64>, wait: Duration, cancelled: &AtomicBool, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        // A panic inside a step is a bug; the executor's state is still consistent enough to
        // fail later steps cleanly rather than take the process down.
        let mut guard = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let deadline = Instant::now() + wait;
        while after != 0 && guard.0 != after {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || cancelled.load(Ordering::Relaxed) {
                return None;
            }
            guard = self.step_done.wait_timeout(guard, left.min(CANCEL_POLL)).unwrap_or_else(PoisonError::into_inner).0;
        }
        if cancelled.load(Ordering::Relaxed) {
            return None;
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
                let h = std::thread::spawn(move || o.run_after(s - 1, Some(s), Duration::from_secs(10), &AtomicBool::new(false), |v: &mut Vec<u64>| v.push(s)));
                std::thread::sleep(Duration::from_millis(20));
                h
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), Some(()));
        }
        // A call that is not a step runs at once and leaves the order alone.
        let live = AtomicBool::new(false);
        ordered.run_after(0, None, Duration::ZERO, &live, |v| v.push(0)).unwrap();
        ordered.run_after(6, Some(7), Duration::ZERO, &live, |v| v.push(7)).unwrap();
        assert_eq!(*ordered.state.lock().unwrap(), (7, vec![1, 2, 3, 4, 5, 6, 0, 7]));
    }

    #[test]
    fn a_step_after_one_that_never_comes_gives_up() {
        let ordered = Ordered::new(());
        let live = AtomicBool::new(false);
        let t = Instant::now();
        assert_eq!(ordered.run_after(41, Some(42), Duration::from_millis(120), &live, |_| ()), None);
        assert!(t.elapsed() >= Duration::from_millis(120));
        assert_eq!(ordered.run_after(0, Some(1), Duration::ZERO, &live, |_| 5), Some(5));
    }

    #[test]
    fn a_waiting_step_whose_caller_went_away_never_runs() {
        let ordered = Arc::new(Ordered::new(0u64));
        let cancelled = Arc::new(AtomicBool::new(false));
        let (o, c) = (ordered.clone(), cancelled.clone());
        let waiting = std::thread::spawn(move || o.run_after(1, Some(2), Duration::from_secs(10), &c, |runs| *runs += 1));
        std::thread::sleep(Duration::from_millis(30));
        cancelled.store(true, Ordering::Relaxed);
        let t = Instant::now();
        assert_eq!(waiting.join().unwrap(), None);
        assert!(t.elapsed() < Duration::from_secs(5), "gave up once cancelled, well before its 10 s");
        // Step 1 runs later (a new caller's): the cancelled step 2 stays gone.
        let live = AtomicBool::new(false);
        ordered.run_after(0, Some(1), Duration::ZERO, &live, |_| ()).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(*ordered.state.lock().unwrap(), (1, 0));
        assert_eq!(ordered.run_after(0, None, Duration::ZERO, &cancelled, |runs| *runs += 1), None, "not started once cancelled");
    }
}
