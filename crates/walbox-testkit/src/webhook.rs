//! A real HTTP receiver for the webhook sink's tests, demo and benchmark: a
//! hyper server (HTTP/1.1 and HTTP/2, optionally TLS by rustls) on a free
//! port, on a thread of its own, that records every request (key, headers,
//! body, the answer it gave) and answers by a script: a 2xx, a status, a
//! `Retry-After`, a redirect, a slow answer, or a dropped connection.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};

use crate::{Result, TestkitError, TlsFiles};

/// One request as it arrived.
#[derive(Debug, Clone)]
pub struct Arrival {
    /// The request method.
    pub method: String,
    /// The request path.
    pub path: String,
    /// Its `webhook-id`.
    pub id: String,
    /// Its key (`walbox-key`), when it had one.
    pub key: Option<String>,
    /// Every header, names in lower case.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Bytes,
    /// The status answered (0: the connection was dropped).
    pub status: u16,
    /// When it arrived.
    pub at: Instant,
    /// Whether it came over HTTP/2.
    pub http2: bool,
}

impl Arrival {
    /// The first header called `name` (lower case).
    #[must_use]
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Whether the receiver answered 2xx.
    #[must_use]
    pub fn delivered(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// What the receiver answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// 200 with an empty body.
    Ok,
    /// This status, with this body.
    Status(u16, String),
    /// 429 with `Retry-After: <seconds>`.
    RetryAfter(u64),
    /// 200 after a while.
    Slow(Duration),
    /// No answer: the connection is dropped.
    Reset,
    /// A redirect: this status, with `Location` the receiver's own URL with
    /// this path.
    Redirect(u16, String),
}

/// What a script sees of a request: its id, key, and how many times that id
/// arrived before.
#[derive(Debug, Clone)]
pub struct Seen<'a> {
    /// The `webhook-id`.
    pub id: &'a str,
    /// The key.
    pub key: Option<&'a str>,
    /// The request path.
    pub path: &'a str,
    /// Earlier arrivals of the same id.
    pub earlier: usize,
}

/// Decides each answer.
pub type Script = Arc<dyn Fn(&Seen<'_>) -> Reply + Send + Sync>;

#[derive(Default)]
struct State {
    arrivals: Vec<Arrival>,
    per_id: HashMap<String, usize>,
}

struct Inner {
    state: Mutex<State>,
    script: Mutex<Script>,
}

/// The receiver; stopped when dropped.
pub struct Receiver {
    addr: SocketAddr,
    tls: bool,
    inner: Arc<Inner>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Receiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receiver")
            .field("addr", &self.addr)
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

impl Receiver {
    /// A plain-HTTP receiver on a free port of 127.0.0.1 that answers 200.
    pub fn start() -> Result<Self> {
        Self::start_with(None)
    }

    /// A receiver over TLS with the server certificate of `tls`; with
    /// `require_client_cert`, a client must show a certificate its CA signed.
    pub fn start_tls(tls: &TlsFiles, require_client_cert: bool) -> Result<Self> {
        Self::start_with(Some(acceptor(tls, require_client_cert)?))
    }

    fn start_with(tls: Option<tokio_rustls::TlsAcceptor>) -> Result<Self> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")
            .map_err(TestkitError::io("binding", "127.0.0.1:0"))?;
        listener
            .set_nonblocking(true)
            .map_err(TestkitError::io("configuring", "the receiver's socket"))?;
        let addr = listener
            .local_addr()
            .map_err(TestkitError::io("reading", "the receiver's address"))?;
        let ok: Script = Arc::new(|_| Reply::Ok);
        let inner = Arc::new(Inner {
            state: Mutex::new(State::default()),
            script: Mutex::new(ok),
        });
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let served = Arc::clone(&inner);
        let is_tls = tls.is_some();
        let thread = std::thread::Builder::new()
            .name("webhook-receiver".into())
            .spawn(move || {
                let Ok(rt) = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                else {
                    return;
                };
                rt.block_on(serve(listener, tls, served, stopped));
                rt.shutdown_background();
            })
            .map_err(TestkitError::io("starting", "the receiver's thread"))?;
        Ok(Receiver {
            addr,
            tls: is_tls,
            inner,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// `http://127.0.0.1:<port>` (`https://localhost:<port>` over TLS).
    #[must_use]
    pub fn base_url(&self) -> String {
        if self.tls {
            format!("https://localhost:{}", self.addr.port())
        } else {
            format!("http://127.0.0.1:{}", self.addr.port())
        }
    }

    /// Answers from now on by `script`.
    pub fn set_script(&self, script: impl Fn(&Seen<'_>) -> Reply + Send + Sync + 'static) {
        if let Ok(mut s) = self.inner.script.lock() {
            *s = Arc::new(script);
        }
    }

    /// Every request so far, in arrival order.
    #[must_use]
    pub fn arrivals(&self) -> Vec<Arrival> {
        self.inner
            .state
            .lock()
            .map(|s| s.arrivals.clone())
            .unwrap_or_default()
    }

    /// How many requests arrived so far.
    #[must_use]
    pub fn count(&self) -> usize {
        self.inner.state.lock().map_or(0, |s| s.arrivals.len())
    }

    /// The requests answered 2xx, in arrival order.
    #[must_use]
    pub fn delivered(&self) -> Vec<Arrival> {
        self.arrivals()
            .into_iter()
            .filter(Arrival::delivered)
            .collect()
    }

    /// Forgets every request so far.
    pub fn clear(&self) {
        if let Ok(mut s) = self.inner.state.lock() {
            *s = State::default();
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn acceptor(tls: &TlsFiles, require_client_cert: bool) -> Result<tokio_rustls::TlsAcceptor> {
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let bad = |what: &str, e: &dyn std::fmt::Display| TestkitError::Io {
        action: "loading",
        path: what.into(),
        source: std::io::Error::other(e.to_string()),
    };
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&tls.server_cert)
        .map_err(|e| bad("the server certificate", &e))?
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| bad("the server certificate", &e))?;
    let key =
        PrivateKeyDer::from_pem_file(&tls.server_key).map_err(|e| bad("the server key", &e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| bad("TLS versions", &e))?;
    let builder = if require_client_cert {
        let mut roots = rustls::RootCertStore::empty();
        for ca in CertificateDer::pem_file_iter(&tls.ca_cert).map_err(|e| bad("the CA", &e))? {
            roots
                .add(ca.map_err(|e| bad("the CA", &e))?)
                .map_err(|e| bad("the CA", &e))?;
        }
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| bad("the client verifier", &e))?;
        builder.with_client_cert_verifier(verifier)
    } else {
        builder.with_no_client_auth()
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|e| bad("the server certificate", &e))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

async fn serve(
    listener: std::net::TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    inner: Arc<Inner>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        return;
    };
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            _ = &mut stopped => break,
            a = listener.accept() => a,
        };
        let Ok((stream, _)) = accepted else { continue };
        let inner = Arc::clone(&inner);
        let tls = tls.clone();
        connections.spawn(async move {
            let service = hyper::service::service_fn(move |req| handle(Arc::clone(&inner), req));
            let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            match tls {
                Some(acceptor) => {
                    if let Ok(s) = acceptor.accept(stream).await {
                        let _ = builder.serve_connection(TokioIo::new(s), service).await;
                    }
                }
                None => {
                    let _ = builder
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                }
            }
        });
    }
    connections.abort_all();
}

/// Why a connection was dropped on purpose.
#[derive(Debug)]
struct Dropped;

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("dropped by the script")
    }
}

impl std::error::Error for Dropped {}

async fn handle(
    inner: Arc<Inner>,
    req: Request<Incoming>,
) -> std::result::Result<Response<Full<Bytes>>, Dropped> {
    let path = req.uri().path().to_owned();
    let method = req.method().as_str().to_owned();
    let http2 = req.version() == hyper::Version::HTTP_2;
    let headers: Vec<(String, String)> = req
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return Err(Dropped),
    };
    let get = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    let id = get("webhook-id").unwrap_or_default();
    let key = get("walbox-key");
    let script = inner.script.lock().map(|s| Arc::clone(&s)).ok();
    let earlier = inner
        .state
        .lock()
        .map_or(0, |s| s.per_id.get(&id).copied().unwrap_or(0));
    let reply = script.map_or(Reply::Ok, |s| {
        s(&Seen {
            id: &id,
            key: key.as_deref(),
            path: &path,
            earlier,
        })
    });
    let (status, response) = match &reply {
        Reply::Ok => (200, Ok(Response::new(Full::new(Bytes::new())))),
        Reply::Slow(d) => {
            tokio::time::sleep(*d).await;
            (200, Ok(Response::new(Full::new(Bytes::new()))))
        }
        Reply::Status(s, text) => {
            let mut r = Response::new(Full::new(Bytes::from(text.clone())));
            *r.status_mut() = hyper::StatusCode::from_u16(*s).unwrap_or(hyper::StatusCode::OK);
            (*s, Ok(r))
        }
        Reply::RetryAfter(secs) => {
            let mut r = Response::new(Full::new(Bytes::new()));
            *r.status_mut() = hyper::StatusCode::TOO_MANY_REQUESTS;
            if let Ok(v) = hyper::header::HeaderValue::from_str(&secs.to_string()) {
                r.headers_mut().insert(hyper::header::RETRY_AFTER, v);
            }
            (429, Ok(r))
        }
        Reply::Reset => (0, Err(Dropped)),
        Reply::Redirect(status, to) => {
            let mut r = Response::new(Full::new(Bytes::new()));
            *r.status_mut() =
                hyper::StatusCode::from_u16(*status).unwrap_or(hyper::StatusCode::FOUND);
            if let Ok(v) = hyper::header::HeaderValue::from_str(to) {
                r.headers_mut().insert(hyper::header::LOCATION, v);
            }
            (*status, Ok(r))
        }
    };
    if let Ok(mut s) = inner.state.lock() {
        *s.per_id.entry(id.clone()).or_insert(0) += 1;
        s.arrivals.push(Arrival {
            method,
            path,
            id,
            key,
            headers,
            body,
            status,
            at: Instant::now(),
            http2,
        });
    }
    response
}
