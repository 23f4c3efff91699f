//! Serving the HTTP app: each accepted connection on hyper (HTTP/1.1 and HTTP/2), with
//! timeouts so that idle clients and half-sent requests cannot hold sockets forever — the
//! request head must arrive within the timeout (also between keep-alive requests), and a
//! request body may not stall longer than it — and a graceful shutdown that lets requests in
//! flight finish (`axum::serve` has neither timeout).

use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tower::ServiceBuilder;
use tower_http::timeout::RequestBodyTimeoutLayer;

/// Longest wait for connections in flight after shutdown begins.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// Serves `app` on `listener` until `shutdown` resolves, then waits (up to a grace period) for
/// the connections in flight. `timeout`: how long a request head may take to arrive (or an
/// idle keep-alive connection may wait for one) and a request body may stall.
pub async fn serve(listener: TcpListener, app: Router, timeout: Duration, shutdown: impl std::future::Future<Output = ()>) {
    let service = ServiceBuilder::new().layer(RequestBodyTimeoutLayer::new(timeout)).service(app);
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(x) => x,
                Err(e) => {
                    // Out of file descriptors and the like: back off, keep serving the rest.
                    tracing::warn!("HTTP accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Nagle off: a stream's events are small writes, each of which would otherwise wait
        // for the client's (delayed) ACK of the one before.
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(%peer, "TCP_NODELAY: {e}");
        }
        // A client that connects and sends nothing: hyper's timeouts only start with the
        // first byte (the HTTP version is read from it), so the wait for it is bounded here.
        let service = TowerToHyperService::new(service.clone());
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            // (`peek` waits for a byte; `readable` may report readiness before any arrives.)
            if !matches!(tokio::time::timeout(timeout, stream.peek(&mut [0u8; 1])).await, Ok(Ok(1..))) {
                return tracing::debug!(%peer, "HTTP connection closed: nothing sent within {timeout:?}");
            }
            let mut builder = auto::Builder::new(TokioExecutor::new());
            builder.http1().timer(TokioTimer::new()).header_read_timeout(timeout);
            if let Err(e) = watcher.watch(builder.serve_connection(TokioIo::new(stream), service)).await {
                tracing::debug!(%peer, "HTTP connection ended: {e}");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown()).await.is_err() {
        tracing::warn!("HTTP connections still open {SHUTDOWN_GRACE:?} after shutdown began; closing them");
    }
}
