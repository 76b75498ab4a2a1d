//! A TCP proxy between a program under test and a server, for link faults: it
//! forwards every connection it accepts, and on command cuts them all, refuses
//! new ones (closes each as soon as it is accepted) and accepts again. It
//! counts the connections it holds open, so a test sees a client that keeps
//! connections it should have closed. It can also hold each Redis request
//! (RESP) a client sends until a set time after the one before it went on
//! ([`TcpProxy::pace_requests`]): a server that takes that long over each
//! call. It runs on a thread of its own and stops when dropped.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::{Result, TestkitError};

/// A running proxy on `127.0.0.1` and a free port.
pub struct TcpProxy {
    runtime: Option<tokio::runtime::Runtime>,
    addr: SocketAddr,
    target: SocketAddr,
    state: Arc<State>,
}

struct State {
    accepting: AtomicBool,
    live: AtomicUsize,
    accepted: AtomicUsize,
    refused: AtomicUsize,
    /// Milliseconds between the Redis requests forwarded on a paced
    /// connection; a connection accepted while it is 0 is not paced.
    pace_ms: AtomicU64,
    /// The most whole requests a paced connection held at once.
    most_held: AtomicUsize,
    /// Bumped by [`TcpProxy::cut`]: every connection ends when it changes.
    cuts: watch::Sender<u64>,
}

impl std::fmt::Debug for TcpProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpProxy")
            .field("addr", &self.addr)
            .field("target", &self.target)
            .field("live", &self.live())
            .finish()
    }
}

/// Counts a forwarded connection as live until dropped.
struct Live(Arc<State>);

impl Drop for Live {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::SeqCst);
    }
}

impl TcpProxy {
    /// Starts a proxy to `target`, accepting.
    pub fn start(target: SocketAddr) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("testkit-proxy")
            .enable_all()
            .build()
            .map_err(TestkitError::io("starting the proxy's runtime", "."))?;
        // Bound here, without blocking on the runtime: the caller may be in
        // one.
        let listener = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(TestkitError::io("binding", "127.0.0.1:0"))?;
        let addr = listener
            .local_addr()
            .map_err(TestkitError::io("reading the address of", "127.0.0.1:0"))?;
        let listener = {
            let _inside = runtime.enter();
            TcpListener::from_std(listener)
                .map_err(TestkitError::io("registering", addr.to_string()))?
        };
        let state = Arc::new(State {
            accepting: AtomicBool::new(true),
            live: AtomicUsize::new(0),
            accepted: AtomicUsize::new(0),
            refused: AtomicUsize::new(0),
            pace_ms: AtomicU64::new(0),
            most_held: AtomicUsize::new(0),
            cuts: watch::channel(0).0,
        });
        runtime.spawn(serve(listener, target, Arc::clone(&state)));
        Ok(TcpProxy {
            runtime: Some(runtime),
            addr,
            target,
            state,
        })
    }

    /// Where clients connect.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes every connection it forwards now (both ends).
    pub fn cut(&self) {
        self.state.cuts.send_modify(|n| *n += 1);
    }

    /// Closes each new connection as soon as it is accepted, until
    /// [`TcpProxy::accept`].
    pub fn refuse(&self) {
        self.state.accepting.store(false, Ordering::SeqCst);
    }

    /// Forwards new connections again.
    pub fn accept(&self) {
        self.state.accepting.store(true, Ordering::SeqCst);
    }

    /// Holds every Redis request (RESP) a client sends until `pace` after
    /// the one before it on its connection was forwarded: however the
    /// client pipelines its calls, the server gets them one per `pace`, as
    /// if each took that long. Replies go through as they come. It applies
    /// to the connections accepted while a pace is set, each request taking
    /// the pace set when it is forwarded; `Duration::ZERO` forwards at once
    /// (and leaves later connections unpaced).
    pub fn pace_requests(&self, pace: Duration) {
        let ms = u64::try_from(pace.as_millis()).unwrap_or(u64::MAX);
        self.state.pace_ms.store(ms, Ordering::SeqCst);
    }

    /// The most whole requests a paced connection has held at once: how
    /// many the client had sent before the first of them was answered.
    #[must_use]
    pub fn most_held(&self) -> usize {
        self.state.most_held.load(Ordering::SeqCst)
    }

    /// Connections open now.
    #[must_use]
    pub fn live(&self) -> usize {
        self.state.live.load(Ordering::SeqCst)
    }

    /// Connections forwarded so far.
    #[must_use]
    pub fn accepted(&self) -> usize {
        self.state.accepted.load(Ordering::SeqCst)
    }

    /// Connections refused so far.
    #[must_use]
    pub fn refused(&self) -> usize {
        self.state.refused.load(Ordering::SeqCst)
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

async fn serve(listener: TcpListener, target: SocketAddr, state: Arc<State>) {
    loop {
        let Ok((mut client, _)) = listener.accept().await else {
            continue;
        };
        if !state.accepting.load(Ordering::SeqCst) {
            state.refused.fetch_add(1, Ordering::SeqCst);
            drop(client);
            continue;
        }
        state.accepted.fetch_add(1, Ordering::SeqCst);
        state.live.fetch_add(1, Ordering::SeqCst);
        let live = Live(Arc::clone(&state));
        let mut cuts = state.cuts.subscribe();
        let pace_ms = state.pace_ms.load(Ordering::SeqCst);
        let state = Arc::clone(&state);
        tokio::spawn(async move {
            let _live = live;
            let Ok(mut server) = TcpStream::connect(target).await else {
                return;
            };
            match pace_ms {
                0 => tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                    _ = cuts.changed() => {}
                },
                _ => {
                    let (mut from_client, mut to_client) = client.split();
                    let (mut from_server, mut to_server) = server.split();
                    tokio::select! {
                        _ = paced(&mut from_client, &mut to_server, &state) => {}
                        _ = tokio::io::copy(&mut from_server, &mut to_client) => {}
                        _ = cuts.changed() => {}
                    }
                }
            }
        });
    }
}

/// Forwards the Redis requests read from `from` to `to`, each one the pace
/// set in `state` after the one before it; ends when either side does or
/// the stream is not RESP.
async fn paced(
    from: &mut (impl tokio::io::AsyncRead + Unpin),
    to: &mut (impl tokio::io::AsyncWrite + Unpin),
    state: &State,
) -> std::io::Result<()> {
    let not_resp = || std::io::Error::new(std::io::ErrorKind::InvalidData, "not a RESP request");
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    let mut last: Option<tokio::time::Instant> = None;
    loop {
        let n = from.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        let held = whole_requests(&buf).map_err(|()| not_resp())?;
        state.most_held.fetch_max(held, Ordering::SeqCst);
        while let Some(len) = request_len(&buf).map_err(|()| not_resp())? {
            let pace = Duration::from_millis(state.pace_ms.load(Ordering::SeqCst));
            if let Some(last) = last {
                tokio::time::sleep_until(last + pace).await;
            }
            to.write_all(&buf[..len]).await?;
            to.flush().await?;
            last = Some(tokio::time::Instant::now());
            buf.drain(..len);
        }
    }
}

/// How many whole RESP requests `buf` starts with.
fn whole_requests(buf: &[u8]) -> std::result::Result<usize, ()> {
    let mut at = 0;
    let mut n = 0;
    while let Some(len) = request_len(&buf[at..])? {
        at += len;
        n += 1;
    }
    Ok(n)
}

/// The length of the whole RESP request at the start of `buf` (an array of
/// bulk strings, `*<n>\r\n` then `$<len>\r\n<bytes>\r\n` each), `None` while
/// part of it is still to come, `Err` for anything else.
fn request_len(buf: &[u8]) -> std::result::Result<Option<usize>, ()> {
    /// The number on the line at `at` after its one-byte prefix `tag`, and
    /// where the next line starts.
    fn line(buf: &[u8], at: usize, tag: u8) -> std::result::Result<Option<(usize, usize)>, ()> {
        let Some(&first) = buf.get(at) else {
            return Ok(None);
        };
        if first != tag {
            return Err(());
        }
        let Some(end) = buf[at..].windows(2).position(|w| w == b"\r\n") else {
            return Ok(None);
        };
        let digits = std::str::from_utf8(&buf[at + 1..at + end]).map_err(|_| ())?;
        let n = digits.parse::<usize>().map_err(|_| ())?;
        Ok(Some((n, at + end + 2)))
    }
    let Some((count, mut at)) = line(buf, 0, b'*')? else {
        return Ok(None);
    };
    for _ in 0..count {
        let Some((len, start)) = line(buf, at, b'$')? else {
            return Ok(None);
        };
        at = start + len + 2;
        if buf.len() < at {
            return Ok(None);
        }
    }
    Ok(Some(at))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::time::Duration;

    /// An echo server on a thread: each connection gets back what it sends.
    fn echo() -> SocketAddr {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut s) = stream else { return };
                std::thread::spawn(move || {
                    let mut buf = [0u8; 1024];
                    while let Ok(n @ 1..) = s.read(&mut buf) {
                        if s.write_all(&buf[..n]).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    fn round_trip(s: &mut std::net::TcpStream) -> std::io::Result<()> {
        s.write_all(b"ping")?;
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf)?;
        assert_eq!(&buf, b"ping");
        Ok(())
    }

    #[test]
    fn a_request_is_whole_only_with_every_bulk_string() {
        let two = b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n";
        assert_eq!(request_len(two), Ok(Some(two.len())));
        for cut in 0..two.len() {
            assert_eq!(request_len(&two[..cut]), Ok(None), "{cut}");
        }
        let mut both = two.to_vec();
        both.extend_from_slice(b"*1\r\n$4\r\nPING\r\n");
        assert_eq!(request_len(&both), Ok(Some(two.len())));
        assert_eq!(whole_requests(&both), Ok(2));
        assert_eq!(whole_requests(&both[..both.len() - 1]), Ok(1));
        assert_eq!(request_len(b"PING\r\n"), Err(()));
    }

    /// Three requests written at once reach the server one per pace.
    #[test]
    fn paced_requests_reach_the_server_one_per_pace() {
        let proxy = TcpProxy::start(echo()).unwrap();
        proxy.pace_requests(Duration::from_millis(300));
        let mut a = std::net::TcpStream::connect(proxy.addr()).unwrap();
        a.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let one = b"*1\r\n$4\r\nPING\r\n";
        let started = std::time::Instant::now();
        a.write_all(&one.repeat(3)).unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 64];
        while got.len() < 3 * one.len() {
            let n = a.read(&mut buf).unwrap();
            assert!(n > 0, "the proxy closed the connection");
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(got, one.repeat(3));
        assert!(
            started.elapsed() >= Duration::from_millis(600),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(proxy.most_held(), 3);
    }

    #[test]
    fn forwards_cuts_refuses_and_accepts_again() {
        let proxy = TcpProxy::start(echo()).unwrap();
        let mut a = std::net::TcpStream::connect(proxy.addr()).unwrap();
        a.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        round_trip(&mut a).unwrap();
        assert_eq!((proxy.live(), proxy.accepted()), (1, 1));

        proxy.refuse();
        proxy.cut();
        assert!(round_trip(&mut a).is_err(), "a cut connection is closed");
        crate::wait_until("the cut connection to end", Duration::from_secs(10), || {
            (proxy.live() == 0).then_some(())
        })
        .unwrap();
        let mut b = std::net::TcpStream::connect(proxy.addr()).unwrap();
        b.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert!(round_trip(&mut b).is_err(), "refused while refusing");
        assert_eq!(proxy.refused(), 1);

        proxy.accept();
        let mut c = std::net::TcpStream::connect(proxy.addr()).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        round_trip(&mut c).unwrap();
        assert_eq!((proxy.live(), proxy.accepted()), (1, 2));
        drop(c);
        crate::wait_until(
            "the closed connection to end",
            Duration::from_secs(10),
            || (proxy.live() == 0).then_some(()),
        )
        .unwrap();
    }
}
