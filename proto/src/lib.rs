//! gRPC plumbing shared by the processes: the code generated from `proto/duet/v1/`, worker
//! addresses (`unix:PATH` or `HOST:PORT`), connecting a channel and serving a router on
//! either kind of listener; and the [`lifeline`] that stops a gateway's workers with it.

pub mod lifeline;

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, UnixListener, UnixStream};
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};
use tonic::transport::server::Router;
use tonic::transport::{Channel, Endpoint, Uri};

/// Code generated from `proto/duet/v1/*.proto` (package `duet.v1`).
pub mod pb {
    tonic::include_proto!("duet.v1");

    /// The encoded descriptors of the package, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("duet_descriptor");
}

/// Where a gRPC server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    /// A Unix domain socket (`unix:PATH`): only users who may open the path can connect.
    Unix(PathBuf),
    /// A TCP `host:port` (an `http://` prefix is accepted).
    Tcp(String),
}

impl FromStr for Address {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(path) = s.strip_prefix("unix://").or_else(|| s.strip_prefix("unix:")) {
            if path.is_empty() {
                return Err("empty Unix socket path in address".into());
            }
            return Ok(Address::Unix(PathBuf::from(path)));
        }
        let hostport = s.strip_prefix("http://").unwrap_or(s);
        match hostport.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(Address::Tcp(hostport.to_string())),
            _ => Err(format!("address {s:?} is neither unix:PATH nor HOST:PORT")),
        }
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Unix(p) => write!(f, "unix:{}", p.display()),
            Address::Tcp(hp) => f.write_str(hp),
        }
    }
}

/// Connects a channel to `addr` (lazily: the first call reconnects if the server is not
/// up yet).
pub fn channel(addr: &Address) -> Result<Channel, tonic::transport::Error> {
    match addr {
        Address::Tcp(hp) => Ok(Endpoint::from_shared(format!("http://{hp}"))?.connect_lazy()),
        Address::Unix(path) => {
            let path = path.clone();
            // The URI is ignored: the connector dials the socket.
            Ok(Endpoint::from_static("http://[::]:0").connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
            })))
        }
    }
}

/// A bound listener of either kind.
#[derive(Debug)]
pub enum Listener {
    Unix(UnixListener, PathBuf),
    Tcp(TcpListener),
}

impl Listener {
    /// Binds `addr`. A Unix socket is created with mode 0600; a stale socket file nobody
    /// listens on is replaced, a live one is an error.
    pub async fn bind(addr: &Address) -> std::io::Result<Listener> {
        match addr {
            Address::Tcp(hp) => Ok(Listener::Tcp(TcpListener::bind(hp).await?)),
            Address::Unix(path) => {
                if path.exists() {
                    if UnixStream::connect(path).await.is_ok() {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::AddrInUse,
                            format!("{} is in use by a running server", path.display()),
                        ));
                    }
                    std::fs::remove_file(path)?;
                }
                let listener = UnixListener::bind(path)?;
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
                Ok(Listener::Unix(listener, path.clone()))
            }
        }
    }

    /// The address bound (with the real port when TCP port 0 was asked for).
    pub fn local_address(&self) -> std::io::Result<Address> {
        match self {
            Listener::Unix(_, p) => Ok(Address::Unix(p.clone())),
            Listener::Tcp(l) => Ok(Address::Tcp(l.local_addr()?.to_string())),
        }
    }

    /// Serves `router` until `shutdown` resolves; a Unix socket file is removed afterwards.
    pub async fn serve(
        self,
        router: Router,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> Result<(), tonic::transport::Error> {
        match self {
            Listener::Tcp(l) => router.serve_with_incoming_shutdown(incoming_nodelay(l), shutdown).await,
            Listener::Unix(l, path) => {
                let result = router.serve_with_incoming_shutdown(UnixListenerStream::new(l), shutdown).await;
                remove_socket(&path);
                result
            }
        }
    }
}

/// The connections `l` accepts, with Nagle's algorithm off: a stream's small frames (its
/// headers, then each token) would otherwise wait for the client's delayed ACK of the frame
/// before — measured, 44 ms to a first token that takes 12.
fn incoming_nodelay(l: TcpListener) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt;
    TcpListenerStream::new(l).map(|s| s.inspect(|s| _ = s.set_nodelay(true)))
}

fn remove_socket(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(path = %path.display(), "removing the socket: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn accepted_tcp_connections_send_without_waiting_for_acks() {
        use tokio_stream::StreamExt;
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let mut incoming = Box::pin(incoming_nodelay(l));
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let accepted = incoming.next().await.unwrap().unwrap();
        assert!(accepted.nodelay().unwrap(), "Nagle's algorithm is on");
    }

    #[test]
    fn addresses_parse() {
        assert_eq!("unix:/run/duet/gpu.sock".parse(), Ok(Address::Unix("/run/duet/gpu.sock".into())));
        assert_eq!("unix:///tmp/a".parse(), Ok(Address::Unix("/tmp/a".into())));
        assert_eq!("127.0.0.1:50051".parse(), Ok(Address::Tcp("127.0.0.1:50051".into())));
        assert_eq!("http://[::1]:7".parse(), Ok(Address::Tcp("[::1]:7".into())));
        for bad in ["unix:", "localhost", "host:notaport", ":80"] {
            assert!(bad.parse::<Address>().is_err(), "{bad}");
        }
    }
}
