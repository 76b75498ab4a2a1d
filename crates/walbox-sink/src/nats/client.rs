//! The thread of one session's client: the NATS connection with its
//! reconnects, the JetStream PubAck tasks and the reporter run on a runtime of
//! their own, so that ending the session ends them all at once. A failed
//! session leaves no client behind that reconnects with its queued
//! publications and PubAcks still awaited: dropping [`ClientThread`] closes the
//! connection and frees the queue, whatever the connection's state (the client
//! library has no call that closes a client while it reconnects).

use std::future::Future;

use tokio::runtime::{Builder, Handle, Runtime};

use crate::SinkError;

/// A runtime with one worker thread for a session's client; shut down, with
/// every task on it, when dropped.
pub(super) struct ClientThread {
    runtime: Option<Runtime>,
}

impl ClientThread {
    pub(super) fn start() -> Result<Self, SinkError> {
        let runtime = Builder::new_multi_thread()
            .worker_threads(1)
            .max_blocking_threads(1)
            .thread_name("walbox-nats")
            .enable_all()
            .build()
            .map_err(|e| SinkError::Nats(format!("starting the client's thread: {e}")))?;
        Ok(ClientThread {
            runtime: Some(runtime),
        })
    }

    pub(super) fn handle(&self) -> &Handle {
        self.runtime
            .as_ref()
            .expect("running until dropped")
            .handle()
    }

    /// Runs `work` on this thread, so that the tasks it starts (the
    /// connection's) live there, and waits for its result.
    pub(super) async fn run<F>(&self, work: F) -> Result<F::Output, SinkError>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.handle()
            .spawn(work)
            .await
            .map_err(|e| SinkError::Nats(format!("the client's thread failed: {e}")))
    }

    /// Calls `make` inside this runtime, so that the tasks it spawns live here.
    pub(super) fn within<T>(&self, make: impl FnOnce() -> T) -> T {
        let _inside = self.handle().enter();
        make()
    }
}

impl Drop for ClientThread {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            // Drops every task (the connection, its reconnects, the queue)
            // without waiting: this may run on the relay's own runtime.
            runtime.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test]
    async fn dropping_the_thread_ends_its_tasks() {
        let thread = ClientThread::start().unwrap();
        let marker = Arc::new(());
        let held = Arc::clone(&marker);
        drop(thread.handle().spawn(async move {
            let _held = held;
            std::future::pending::<()>().await;
        }));
        let id = thread
            .run(async { std::thread::current().name().map(str::to_owned) })
            .await
            .unwrap();
        assert_eq!(id.as_deref(), Some("walbox-nats"));
        assert_eq!(Arc::strong_count(&marker), 2);
        drop(thread);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while Arc::strong_count(&marker) > 1 {
            assert!(std::time::Instant::now() < deadline, "the task lives on");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}
