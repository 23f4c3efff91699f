//! Tests of the exchange ring: ordering under load across threads and across real processes,
//! crash and re-attach, idle CPU use of a sleeping consumer, layout validation, and a
//! round-trip latency benchmark (printed, run with `--nocapture`).

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use duet_kv::shm::{Consumer, Producer, Ring, Segment, ShmError, Waiter};

/// Set in a re-executed copy of this test binary: the segment name to serve jobs from.
const CHILD_ENV: &str = "DUET_SHM_RING_CHILD";
/// Set together with `CHILD_ENV`: exit without completing the job with this sequence number.
const CHILD_DIE_AT_ENV: &str = "DUET_SHM_RING_DIE_AT";

fn unique(tag: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!("duet-test-{}-{tag}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// A ring in a fresh segment: the creating handle produces, a second mapping consumes.
fn ring_pair(tag: &str, slots: u32, slot_bytes: usize, waiter: Waiter) -> (Producer, Consumer) {
    let name = unique(tag);
    let seg = Segment::create(&name, Ring::bytes_needed(slots, slot_bytes).unwrap()).unwrap();
    let producer = Ring::create(seg, slots, slot_bytes).unwrap().with_waiter(waiter).producer();
    let consumer = Ring::attach(Segment::open(&name).unwrap()).unwrap().with_waiter(waiter).consumer();
    (producer, consumer)
}

fn put(slot: &mut [u8], at: usize, v: u64) {
    slot[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn get(slot: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(slot[at..at + 8].try_into().unwrap())
}

/// Consumer loop: job = counter at 0; writes counter * `factor` at 8 and its pid at 16.
/// Returns the number of jobs served when the ring is closed.
fn serve(consumer: &mut Consumer, factor: u64, die_at: Option<u64>) -> u64 {
    let pid = std::process::id() as u64;
    let mut served = 0;
    loop {
        match consumer.next_job() {
            Ok((seq, slot)) => {
                if die_at == Some(seq) {
                    std::process::exit(0); // a crash in the middle of a job
                }
                let v = get(slot, 0);
                put(slot, 8, v * factor);
                put(slot, 16, pid);
                consumer.complete(seq);
                served += 1;
            }
            Err(ShmError::Closed { .. }) => return served,
            Err(e) => panic!("consumer: {e}"),
        }
    }
}

/// Posts `n` jobs (counter = `base + i`) keeping up to `depth` in flight, and checks every
/// result in order. Returns the pid the consumer wrote.
fn produce_and_check(p: &mut Producer, base: u64, n: u64, depth: u64, factor: u64) -> u64 {
    let mut pid = 0;
    let mut check = |p: &mut Producer, seq: u64, i: u64| {
        let r = p.wait_done(seq).unwrap();
        assert_eq!(get(r, 0), base + i, "job {i}: counter");
        assert_eq!(get(r, 8), (base + i) * factor, "job {i}: result");
        pid = get(r, 16);
    };
    let mut in_flight = std::collections::VecDeque::new();
    let mut last_seq = None;
    for i in 0..n {
        let seq = p.post(|s| put(s, 0, base + i)).unwrap();
        assert!(last_seq.is_none_or(|last| seq == last + 1), "sequence numbers are consecutive");
        last_seq = Some(seq);
        in_flight.push_back((seq, i));
        if in_flight.len() as u64 == depth {
            let (seq, i) = in_flight.pop_front().unwrap();
            check(p, seq, i);
        }
    }
    while let Some((seq, i)) = in_flight.pop_front() {
        check(p, seq, i);
    }
    pid
}

fn run_threads(waiter: Waiter, n: u64) -> Duration {
    let (mut p, mut c) = ring_pair("threads", 8, 64, waiter);
    let t = Instant::now();
    let served = std::thread::scope(|s| {
        let h = s.spawn(move || serve(&mut c, 2, None));
        produce_and_check(&mut p, 0, n, 8, 2);
        p.close();
        h.join().unwrap()
    });
    assert_eq!(served, n);
    t.elapsed()
}

#[test]
fn threads_100k_jobs_in_order() {
    let t = run_threads(Waiter::default(), 100_000);
    println!("100k jobs, spinning then sleeping sides: {:.0} ms", t.as_secs_f64() * 1e3);
}

#[test]
fn threads_jobs_in_order_when_both_sides_always_sleep() {
    // spins = 0: every wait goes through the futex, so a lost wake-up would hang here.
    let t = run_threads(Waiter::spin_then_sleep(0), 20_000);
    println!("20k jobs, futex-only sides: {:.0} ms", t.as_secs_f64() * 1e3);
}

/// Not a test of its own: the consumer role of the multi-process tests, which re-execute
/// this binary with `CHILD_ENV` set. Without it, it returns at once.
#[test]
fn child_serves_jobs() {
    let Ok(name) = std::env::var(CHILD_ENV) else { return };
    let die_at = std::env::var(CHILD_DIE_AT_ENV).ok().map(|v| v.parse().unwrap());
    let mut consumer = Ring::attach(Segment::open(&name).unwrap()).unwrap().consumer();
    serve(&mut consumer, 3, die_at);
}

fn spawn_child(name: &str, die_at: Option<u64>) -> std::process::Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["child_serves_jobs", "--exact", "--nocapture", "--test-threads=1"]).env(CHILD_ENV, name);
    if let Some(seq) = die_at {
        cmd.env(CHILD_DIE_AT_ENV, seq.to_string());
    }
    cmd.spawn().unwrap()
}

#[test]
fn separate_processes_exchange_jobs() {
    let name = unique("procs");
    let seg = Segment::create(&name, Ring::bytes_needed(16, 256).unwrap()).unwrap();
    let mut p = Ring::create(seg, 16, 256).unwrap().producer();
    let mut child = spawn_child(&name, None);
    let pid = produce_and_check(&mut p, 1000, 20_000, 16, 3);
    assert_eq!(pid, child.id() as u64, "the results come from the child process");
    assert_ne!(pid, std::process::id() as u64);
    p.close();
    assert!(child.wait().unwrap().success());
}

#[test]
fn consumer_crash_times_out_and_a_restarted_consumer_reattaches() {
    let name = unique("crash");
    let seg = Segment::create(&name, Ring::bytes_needed(4, 64).unwrap()).unwrap();
    let mut p = Ring::create(seg, 4, 64).unwrap().producer();
    let mut first = spawn_child(&name, Some(5));
    produce_and_check(&mut p, 0, 5, 1, 3); // jobs 0..5 served by the first child
    let seq = p.post(|s| put(s, 0, 77)).unwrap();
    assert_eq!(seq, 5);
    assert!(first.wait().unwrap().success(), "the first child exited at job 5");
    match p.wait_done_timeout(seq, Duration::from_millis(200)) {
        Err(ShmError::TimedOut { waited_us, .. }) => assert!(waited_us >= 200_000),
        other => panic!("expected a timeout, got {other:?}"),
    }
    // A restarted consumer attaches to the same ring and serves the job the first one lost.
    let mut second = spawn_child(&name, None);
    let r = p.wait_done_timeout(seq, Duration::from_secs(30)).unwrap();
    assert_eq!((get(r, 0), get(r, 8), get(r, 16)), (77, 231, second.id() as u64));
    produce_and_check(&mut p, 100, 100, 4, 3);
    p.close();
    assert!(second.wait().unwrap().success());
}

/// CPU time (user + system) of the calling thread.
fn thread_cpu_time() -> Duration {
    // SAFETY: rusage is plain data; getrusage fills it for the calling thread.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) }, 0);
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Blocks a consumer thread in `next_job` for `idle` and returns its (CPU time, wall time).
fn idle_consumer_cpu(waiter: Waiter, idle: Duration) -> (Duration, Duration) {
    idle_consumer_cpu_with(waiter, idle, false)
}

/// [`idle_consumer_cpu`], the producer having set the ring's no-spin flag to `no_spin` first.
fn idle_consumer_cpu_with(waiter: Waiter, idle: Duration, no_spin: bool) -> (Duration, Duration) {
    let (mut p, mut c) = ring_pair("idle", 4, 64, waiter);
    p.set_no_spin(no_spin);
    std::thread::scope(|s| {
        let h = s.spawn(move || {
            let (cpu0, t0) = (thread_cpu_time(), Instant::now());
            let (seq, _) = c.next_job().unwrap();
            let (cpu, wall) = (thread_cpu_time() - cpu0, t0.elapsed());
            c.complete(seq);
            (cpu, wall)
        });
        std::thread::sleep(idle);
        let seq = p.post(|s| put(s, 0, 1)).unwrap();
        p.wait_done(seq).unwrap();
        h.join().unwrap()
    })
}

#[test]
fn idle_consumer_sleeps_instead_of_spinning() {
    let (cpu, wall) = idle_consumer_cpu(Waiter::default(), Duration::from_millis(300));
    let share = cpu.as_secs_f64() / wall.as_secs_f64();
    println!(
        "idle consumer (default waiter, {} spins): {:.2} ms CPU over {:.0} ms idle = {:.2}%",
        Waiter::DEFAULT_SPINS,
        cpu.as_secs_f64() * 1e3,
        wall.as_secs_f64() * 1e3,
        share * 100.0
    );
    // The thread may start late on a loaded machine, so only the CPU share is asserted.
    assert!(wall > Duration::ZERO);
    assert!(share < 0.2, "an idle consumer used {:.1}% of a core", share * 100.0);

    // For contrast (printed only): a consumer that never stops spinning.
    let (cpu, wall) = idle_consumer_cpu(Waiter::spin_then_sleep(u32::MAX), Duration::from_millis(300));
    println!("idle consumer, spinning only: {:.0}% of a core", cpu.as_secs_f64() / wall.as_secs_f64() * 100.0);
}

#[test]
fn the_producers_no_spin_flag_puts_a_spinning_waiter_to_sleep_at_once() {
    // A waiter that would spin for minutes, on a ring whose producer computes on the
    // consumer's cores: it sleeps instead, and still wakes for the job.
    let (cpu, wall) = idle_consumer_cpu_with(Waiter::spin_then_sleep(u32::MAX), Duration::from_millis(300), true);
    let share = cpu.as_secs_f64() / wall.as_secs_f64();
    println!("idle consumer, spinning waiter, no-spin flag: {:.2}% of a core", share * 100.0);
    assert!(share < 0.2, "a consumer told not to spin used {:.1}% of a core", share * 100.0);
}

#[test]
fn full_ring_blocks_post_until_a_completion() {
    let (mut p, mut c) = ring_pair("full", 2, 8, Waiter::spin_then_sleep(100));
    p.post(|s| s[0] = 1).unwrap();
    p.post(|s| s[0] = 2).unwrap();
    std::thread::scope(|s| {
        s.spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            let (seq, slot) = c.next_job().unwrap();
            assert_eq!((seq, slot[0]), (0, 1));
            c.complete(seq);
        });
        let t = Instant::now();
        assert_eq!(p.post(|s| s[0] = 3).unwrap(), 2);
        assert!(t.elapsed() >= Duration::from_millis(90), "post waited for the free slot");
        assert!(p.is_done(0) && !p.is_done(1));
    });
}

#[test]
fn close_wakes_a_sleeping_consumer_and_timeouts_expire() {
    let (p, mut c) = ring_pair("close", 2, 8, Waiter::spin_then_sleep(10));
    assert!(matches!(c.next_job_timeout(Duration::from_millis(30)), Err(ShmError::TimedOut { .. })));
    std::thread::scope(|s| {
        let h = s.spawn(move || c.next_job().map(|(seq, _)| seq));
        std::thread::sleep(Duration::from_millis(50));
        p.close();
        assert!(matches!(h.join().unwrap(), Err(ShmError::Closed { .. })));
    });
}

#[test]
fn attach_validates_the_header() {
    let name = unique("layout");
    let seg = Segment::create(&name, 8192).unwrap();
    let not_a_ring = Ring::attach(Segment::open(&name).unwrap());
    assert!(matches!(not_a_ring, Err(ShmError::BadLayout { .. })), "{not_a_ring:?}");
    assert!(matches!(Ring::attach(Segment::create(&unique("tiny"), 64).unwrap()), Err(ShmError::TooSmall { .. })));
    assert!(matches!(Ring::create(Segment::open(&name).unwrap(), 2, 4096), Err(ShmError::TooSmall { .. })));
    assert!(matches!(Ring::create(Segment::open(&name).unwrap(), 0, 64), Err(ShmError::BadLayout { .. })));

    let ring = Ring::create(Segment::open(&name).unwrap(), 4, 100).unwrap();
    let attached = Ring::attach(Segment::open(&name).unwrap()).unwrap();
    assert_eq!((attached.slots(), attached.slot_bytes()), (4, 100));
    // A future layout version is refused rather than misread.
    ring.segment().atomic_u32(8).store(99, Ordering::Relaxed);
    let r = Ring::attach(Segment::open(&name).unwrap());
    assert!(matches!(&r, Err(ShmError::BadLayout { reason, .. }) if reason.contains("version 99")), "{r:?}");
    drop(seg);
}

fn percentile(sorted: &[Duration], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e6
}

/// `n` round trips post → consumer completes → wait_done (after n/10 warm-up trips);
/// returns the sorted latencies.
fn measure(p: &mut Producer, factor: u64, n: usize) -> Vec<Duration> {
    let mut lat = Vec::with_capacity(n);
    for i in 0..(n + n / 10) as u64 {
        let t = Instant::now();
        let seq = p.post(|s| put(s, 0, i)).unwrap();
        let r = p.wait_done(seq).unwrap();
        let dt = t.elapsed();
        assert_eq!(get(r, 8), factor * i);
        if i as usize >= n / 10 {
            lat.push(dt);
        }
    }
    lat.sort();
    lat
}

fn report(what: &str, lat: &[Duration]) {
    println!(
        "round trip post -> complete -> wait_done, {what}, {} trips: median {:.2} µs, p99 {:.2} µs, max {:.1} µs",
        lat.len(),
        percentile(lat, 0.5),
        percentile(lat, 0.99),
        percentile(lat, 1.0)
    );
}

#[test]
fn round_trip_latency_benchmark() {
    for (what, waiter, n) in [
        ("threads, spinning sides", Waiter::spin_then_sleep(u32::MAX), 10_000),
        ("threads, futex-only sides", Waiter::spin_then_sleep(0), 2_000),
    ] {
        let (mut p, mut c) = ring_pair("latency", 8, 4096, waiter);
        let lat = std::thread::scope(|s| {
            s.spawn(move || serve(&mut c, 2, None));
            let lat = measure(&mut p, 2, n);
            p.close();
            lat
        });
        report(what, &lat);
    }
    // The data plane as deployed: a consumer process (default waiter, busy so it never
    // sleeps) and a spinning producer.
    let name = unique("latency-procs");
    let seg = Segment::create(&name, Ring::bytes_needed(8, 4096).unwrap()).unwrap();
    let mut p = Ring::create(seg, 8, 4096).unwrap().with_waiter(Waiter::spin_then_sleep(u32::MAX)).producer();
    let mut child = spawn_child(&name, None);
    let lat = measure(&mut p, 3, 10_000);
    p.close();
    assert!(child.wait().unwrap().success());
    report("separate processes, spinning producer, default-waiter consumer", &lat);
}
