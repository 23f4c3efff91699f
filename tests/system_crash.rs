//! Nothing lost when a worker dies, under load: 8 streams run and 4 multi-turn sessions sit
//! idle while the cpu-worker is killed with SIGKILL, then the same while the gpu-worker is.
//! Every stream completes with the tokens of an uninterrupted greedy run (up to near ties),
//! also when the gpu-worker dies while the cpu-worker hangs,
//! and every session's next turn works from the KV kept in the arena. And a gateway killed
//! with SIGKILL takes its workers and their shared memory with it.

use std::path::Path;
use std::time::{Duration, Instant};

use duet_proto::pb;
use duet_tests::{generate, greedy, pids_with, same_up_to_near_tie, Gateway, RefGeneration};

const STREAMS: usize = 8;
const SESSIONS: usize = 4;
const TOKENS: u32 = 48;

fn prompt(i: usize) -> Vec<u32> {
    // Distinct short prompts of the default model's vocabulary (plain word-piece ids).
    vec![1, 504 + i as u32 * 37, 3575, 282 + i as u32, 4649, 314]
}

async fn references(gw: &Gateway) -> Vec<RefGeneration> {
    let mut out = Vec::new();
    for i in 0..STREAMS {
        let g = generate(&mut gw.client(), pb::GenerateRequest { top_logprobs: 2, ..greedy(prompt(i), TOKENS) }).await.unwrap();
        out.push(RefGeneration { margins: g.top.iter().map(|t| (t[0].1 - t[1].1) as f64).collect(), ids: g.ids });
    }
    out
}

/// Starts the 8 streams, once each has a few tokens sends each process `victims` name its
/// signal (and waits the given time after it), and checks they complete as the references.
async fn streams_survive(gw: &Gateway, victims: &[(&[&str], i32, Duration)], refs: &[RefGeneration]) {
    let (tx, mut started) = tokio::sync::mpsc::channel(STREAMS);
    let mut tasks = Vec::new();
    for i in 0..STREAMS {
        let mut client = gw.client();
        let tx = tx.clone();
        tasks.push(tokio::spawn(async move {
            let mut stream = client.generate(pb::GenerateRequest { top_logprobs: 2, ..greedy(prompt(i), TOKENS) }).await?.into_inner();
            let mut ids = Vec::new();
            let mut finished = false;
            while let Some(msg) = stream.message().await? {
                match msg.event {
                    Some(pb::generate_response::Event::Token(t)) => {
                        ids.push(t.id);
                        if ids.len() == 3 {
                            let _ = tx.send(i).await;
                        }
                    }
                    Some(pb::generate_response::Event::Finished(_)) => finished = true,
                    _ => {}
                }
            }
            assert!(finished, "stream {i} ended without Finished");
            Ok::<_, tonic::Status>(ids)
        }));
    }
    for _ in 0..STREAMS {
        started.recv().await.expect("every stream starts");
    }
    let mut killed = Vec::new();
    for &(victim, signal, wait) in victims {
        let pids = pids_with(victim);
        assert_eq!(pids.len(), 1, "one {victim:?}: {pids:?}");
        // SAFETY: signalling the test's own grandchild.
        unsafe { libc::kill(pids[0] as libc::pid_t, signal) };
        if signal == libc::SIGKILL {
            killed.push((victim, pids));
        }
        tokio::time::sleep(wait).await;
    }
    for (i, t) in tasks.into_iter().enumerate() {
        let ids = t.await.unwrap().unwrap_or_else(|e| panic!("stream {i} failed after {victims:?}: {e}"));
        same_up_to_near_tie(&ids, &refs[i], 0.5).unwrap_or_else(|e| panic!("stream {i} after {victims:?} vs uninterrupted: {e}"));
    }
    for (victim, pids) in killed {
        assert_ne!(pids_with(victim), pids, "{victim:?} was restarted");
    }
}

/// One more turn of every session: it works and reuses the KV of the turns before.
async fn sessions_go_on(gw: &Gateway, sessions: &[(String, usize)]) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    for (id, held) in sessions {
        let g = generate(&mut gw.client(), pb::GenerateRequest { session_id: Some(id.clone()), ..greedy(vec![11, 314], 6) })
            .await
            .unwrap_or_else(|e| panic!("session {id}'s next turn: {e}"));
        assert_eq!(g.prompt.cached_tokens as usize, held - 1, "session {id}: the KV of its turns is reused");
        out.push((id.clone(), held + 2 + g.ids.len()));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_and_sessions_survive_a_cpu_worker_and_a_gpu_worker_crash() {
    let mut gw = Gateway::start(&["--cpu-workers", "1", "--kv-bytes", "256M"]);
    let refs = references(&gw).await;
    let mut sessions = Vec::new();
    for i in 0..SESSIONS {
        let g = generate(&mut gw.client(), pb::GenerateRequest { create_session: true, ..greedy(prompt(i), 8) }).await.unwrap();
        sessions.push((g.prompt.session_id.clone(), prompt(i).len() + g.ids.len()));
    }
    let cpu_worker: &[&str] = &["duet-cpu-worker", &gw.instance];
    let runtime_dir = gw.runtime_dir.to_string_lossy().into_owned();
    let gpu_worker: &[&str] = &["duet-gpu-worker", &runtime_dir];
    let now = Duration::ZERO;
    streams_survive(&gw, &[(cpu_worker, libc::SIGKILL, now)], &refs).await;
    let sessions = sessions_go_on(&gw, &sessions).await;
    streams_survive(&gw, &[(gpu_worker, libc::SIGKILL, now)], &refs).await;
    // The gpu-worker may still be attaching its cpu-worker: the first turn waits for it.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let sessions = sessions_go_on(&gw, &sessions).await;
    // Both: the cpu-worker hangs (and is seen down), then the gpu-worker dies as the
    // cpu-worker answers again; the gateway attaches the cpu-worker to the gpu-worker's
    // successor, and must report it serving again, its KV kept (the same process). It once
    // stayed "down" for good, and its streams and sessions waited for it (this test hung).
    let hang = [(cpu_worker, libc::SIGSTOP, Duration::from_secs(3)), (gpu_worker, libc::SIGKILL, now), (cpu_worker, libc::SIGCONT, now)];
    let survived = async {
        streams_survive(&gw, &hang, &refs).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        sessions_go_on(&gw, &sessions).await;
    };
    tokio::time::timeout(Duration::from_secs(120), survived).await.unwrap_or_else(|_| panic!("streams or sessions still waiting for the cpu-worker after 120 s; log:\n{}", gw.log_tail()));
    let status = gw.stop();
    assert!(status.success(), "gateway exit {status}; log:\n{}", gw.log_tail());
}

#[test]
fn a_gateway_killed_with_sigkill_takes_its_workers_and_their_segments_with_it() {
    let mut gw = Gateway::start(&["--cpu-workers", "1"]);
    // The workers the gateway started carry its pid, as their last argument (the space is the
    // NUL after it: pid 12 must not match 123); a worker that exited may stay a zombie (its new
    // parent need not reap it), whose command line is empty, so it no longer matches.
    let its_workers = format!("--parent-pid {} ", gw.pid());
    let workers = pids_with(&[&its_workers]);
    assert_eq!(workers.len(), 2, "a gpu-worker and a cpu-worker: {workers:?}");
    let segments = ["kv", "xchg"].map(|k| Path::new("/dev/shm").join(format!("duet-{}-{k}-0", gw.instance)));
    assert!(segments.iter().all(|s| s.exists()), "the cpu-worker's segments exist: {segments:?}");
    // SAFETY: killing the test's own child.
    unsafe { libc::kill(gw.pid() as libc::pid_t, libc::SIGKILL) };
    let start = Instant::now();
    while !pids_with(&[&its_workers]).is_empty() || segments.iter().any(|s| s.exists()) {
        if start.elapsed() > Duration::from_secs(20) {
            let left = pids_with(&[&its_workers]);
            for &p in &left {
                // SAFETY: killing the orphans of the test's own child, not to leave them running.
                unsafe { libc::kill(p as libc::pid_t, libc::SIGKILL) };
            }
            let segs: Vec<_> = segments.iter().filter(|s| s.exists()).collect();
            panic!("20 s after the gateway's SIGKILL: workers {left:?} still ran, segments {segs:?} remain; log:\n{}", gw.log_tail());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(gw.log_tail().contains("the process that started this worker exited"), "log:\n{}", gw.log_tail());
    gw.stop();
}
