//! Cross-process futex wait and wake on an `AtomicU32` (which may live in shared memory),
//! with a spin-sleep fallback on targets without futexes so the crate still compiles there.
//!
//! The shared (non-`_PRIVATE`) operations are used on purpose: the kernel then keys the
//! waiters by the physical page, so a waker in another process that maps the same segment
//! reaches them. The private variants key by this process's address space and would not.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// How a [`futex_wait`] returned. Every outcome may be spurious: callers re-check their
/// condition and wait again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FutexWait {
    /// Woken by [`futex_wake`] (or spuriously, e.g. by a signal).
    Woken,
    /// The word did not hold `expected` when the wait began.
    Changed,
    /// The timeout passed.
    TimedOut,
}

/// Sleeps while `word` holds `expected`, at most `timeout` (`None`: until woken). The check
/// and the sleep are atomic with respect to [`futex_wake`], so a wake issued after the word
/// changed is never lost. Interrupted waits (EINTR) resume with the time that remains.
#[cfg(any(target_os = "linux", target_os = "android"))]
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) -> FutexWait {
    let deadline = timeout.map(|t| std::time::Instant::now() + t);
    loop {
        let remaining = deadline.map(|d| d.saturating_duration_since(std::time::Instant::now()));
        if remaining == Some(Duration::ZERO) {
            return FutexWait::TimedOut;
        }
        let ts = remaining.map(|r| libc::timespec {
            tv_sec: r.as_secs().min(libc::time_t::MAX as u64) as libc::time_t,
            tv_nsec: r.subsec_nanos() as _,
        });
        let ts_ptr = ts.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: `word` is a valid, aligned u32 for the duration of the call (AtomicU32 has
        // u32's layout); ts_ptr is null or points to a live timespec; FUTEX_WAIT ignores
        // uaddr2 and val3. The kernel only reads the word.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT,
                expected,
                ts_ptr,
                std::ptr::null::<u32>(),
                0u32,
            )
        };
        if rc == 0 {
            return FutexWait::Woken;
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EAGAIN) => return FutexWait::Changed,
            Some(libc::ETIMEDOUT) => return FutexWait::TimedOut,
            Some(libc::EINTR) => continue,
            // EFAULT/EINVAL/ENOSYS cannot happen with a valid reference and a valid timespec.
            other => panic!("futex wait failed: errno {other:?}"),
        }
    }
}

/// Wakes up to `n` waiters sleeping on `word` in any process; returns how many woke.
#[cfg(any(target_os = "linux", target_os = "android"))]
pub fn futex_wake(word: &AtomicU32, n: u32) -> usize {
    let n = n.min(i32::MAX as u32);
    // SAFETY: `word` is a valid, aligned u32; FUTEX_WAKE neither reads nor writes it (it
    // only names the wait queue) and ignores the timeout, uaddr2 and val3 arguments.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            n,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        )
    };
    usize::try_from(rc).unwrap_or(0)
}

/// Fallback without futexes: poll the word with short sleeps (50 µs growing to 1 ms).
#[cfg(not(any(target_os = "linux", target_os = "android")))]
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) -> FutexWait {
    use std::sync::atomic::Ordering;
    let start = std::time::Instant::now();
    let mut nap = Duration::from_micros(50);
    loop {
        if word.load(Ordering::Acquire) != expected {
            return if start.elapsed() == Duration::ZERO { FutexWait::Changed } else { FutexWait::Woken };
        }
        if timeout.is_some_and(|t| start.elapsed() >= t) {
            return FutexWait::TimedOut;
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(1));
    }
}

/// Fallback without futexes: sleepers poll, so there is nobody to wake.
#[cfg(not(any(target_os = "linux", target_os = "android")))]
pub fn futex_wake(_word: &AtomicU32, _n: u32) -> usize {
    0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;
    use std::time::Instant;

    #[test]
    fn mismatch_returns_at_once_and_timeout_expires() {
        let w = AtomicU32::new(7);
        assert_eq!(futex_wait(&w, 8, None), FutexWait::Changed);
        let t = Instant::now();
        assert_eq!(futex_wait(&w, 7, Some(Duration::from_millis(20))), FutexWait::TimedOut);
        assert!(t.elapsed() >= Duration::from_millis(20));
        assert_eq!(futex_wait(&w, 7, Some(Duration::ZERO)), FutexWait::TimedOut);
    }

    #[test]
    fn wake_reaches_a_sleeping_thread() {
        let w = AtomicU32::new(0);
        std::thread::scope(|s| {
            let h = s.spawn(|| {
                while w.load(Ordering::Acquire) == 0 {
                    futex_wait(&w, 0, Some(Duration::from_secs(10)));
                }
            });
            std::thread::sleep(Duration::from_millis(20));
            w.store(1, Ordering::Release);
            futex_wake(&w, 1);
            let t = Instant::now();
            h.join().unwrap();
            assert!(t.elapsed() < Duration::from_secs(5), "the wake was lost");
        });
        assert_eq!(futex_wake(&w, u32::MAX), 0, "nobody is waiting any more");
    }
}
