//! Whether this node should be sent new requests, as balancers and orchestrators read it
//! (`GET /health`, gRPC health): not while it loads the model, drains, has no cpu-worker
//! serving, or has requests waiting because its KV cache is full.

use std::sync::Arc;

use tokio::sync::watch;

/// Where the node is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Starting the workers and loading the model; requests are refused with "loading".
    Loading,
    Serving,
    /// Stopping: health says so at once; requests are still served until the listeners close.
    Draining,
}

/// The node's phase, shared by the front ends and `serve`.
#[derive(Clone)]
pub struct Readiness {
    phase: Arc<watch::Sender<Phase>>,
    /// The phase gRPC health last reported (it is pushed to the health service, not pulled).
    reported: Arc<watch::Sender<Option<Phase>>>,
    /// This node's name (in session ids and health answers).
    pub node: Arc<str>,
}

/// What a health check answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// Whether a balancer should send this node new requests.
    pub serving: bool,
    /// One word for scripts: ok, loading, draining, no_cpu_worker, kv_full, unavailable.
    pub status: &'static str,
    /// The reason, for people.
    pub detail: String,
}

impl Health {
    pub fn serving() -> Health {
        Health { serving: true, status: "ok", detail: "serving".into() }
    }

    pub fn not_serving(status: &'static str, detail: impl Into<String>) -> Health {
        Health { serving: false, status, detail: detail.into() }
    }
}

impl Readiness {
    /// A node named `node`, loading.
    pub fn new(node: &str) -> Self {
        Readiness { phase: Arc::new(watch::channel(Phase::Loading).0), reported: Arc::new(watch::channel(None).0), node: node.into() }
    }

    /// gRPC health now reports what it found in `phase`.
    pub fn reported(&self, phase: Phase) {
        self.reported.send_replace(Some(phase));
    }

    /// Waits until gRPC health has reported `phase` (at most `timeout`).
    pub async fn wait_reported(&self, phase: Phase, timeout: std::time::Duration) {
        let mut rx = self.reported.subscribe();
        let _ = tokio::time::timeout(timeout, rx.wait_for(|p| *p == Some(phase))).await;
    }

    pub fn set(&self, phase: Phase) {
        self.phase.send_replace(phase);
    }

    pub fn phase(&self) -> Phase {
        *self.phase.borrow()
    }

    /// Resolves at each change of phase.
    pub fn subscribe(&self) -> watch::Receiver<Phase> {
        self.phase.subscribe()
    }
}
