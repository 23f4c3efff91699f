//! The gateway as a library: `serve::run` on listeners bound to port 0 in this process (its
//! workers are the real binaries, which `cargo build --bins` puts beside this test's folder),
//! answering health and a completion over HTTP, then stopping when its shutdown future
//! resolves.

use clap::Parser;
use duet_gateway::cli::{Cli, Command};
use duet_gateway::serve::{run, Listeners};
use duet_model::testutil::model_path;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One HTTP/1.1 exchange: the status code and the body.
async fn http(addr: std::net::SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("send");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("receive");
    let code = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_string();
    (code, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_runs_in_process_on_port_zero_and_stops_when_told() {
    let model = model_path();
    let instance = format!("duet-in-process-{}", std::process::id());
    let argv = [
        "duet-gateway", "serve", "--model", model.to_str().unwrap(), "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
        "--cpu-workers", "1", "--kv-bytes", "64M", "--gpu-threads", "1", "--instance", &instance,
    ];
    let Command::Serve(args) = Cli::try_parse_from(argv).expect("flags").command else { panic!("serve was parsed") };
    let listeners = Listeners::bind(&args).await.expect("port 0 binds");
    let addr = listeners.http.local_addr().unwrap();
    assert_ne!(addr.port(), 0);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let gateway = tokio::spawn(run(args, listeners, async move {
        let _ = stopped.await;
    }));

    // Health answers from the start ("loading" while the workers come up), then "ok".
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let (code, body) = http(addr, "GET", "/health", "").await;
        if code == 200 {
            assert!(body.contains("\"ok\""), "{body}");
            break;
        }
        assert_eq!(code, 503, "{body}");
        assert!(std::time::Instant::now() < deadline, "not serving after 120 s: {body}");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let (code, body) = http(addr, "POST", "/v1/completions", r#"{"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}"#).await;
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");

    stop.send(()).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(60), gateway).await.expect("stops within a minute").unwrap().expect("a clean stop");
}
