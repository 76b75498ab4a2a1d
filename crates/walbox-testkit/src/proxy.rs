//! A TCP proxy between a program under test and a server, for link faults: it
//! forwards every connection it accepts, and on command cuts them all, refuses
//! new ones (closes each as soon as it is accepted) and accepts again. It
//! counts the connections it holds open, so a test sees a client that keeps
//! connections it should have closed. It runs on a thread of its own and stops
//! when dropped.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

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
        tokio::spawn(async move {
            let _live = live;
            let Ok(mut server) = TcpStream::connect(target).await else {
                return;
            };
            tokio::select! {
                _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                _ = cuts.changed() => {}
            }
        });
    }
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
