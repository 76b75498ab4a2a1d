//! Waiting on conditions: a test polls until what it expects holds, with a
//! deadline that names what it waited for, never a fixed sleep.

use std::future::Future;
use std::time::{Duration, Instant};

use crate::{Result, TestkitError};

/// Interval between two checks of a condition. Short, so a test reacts as soon as
/// the condition holds; the deadline, not this, bounds how long a test waits.
const POLL: Duration = Duration::from_millis(20);

/// Checks `condition` until it returns `Some`, or fails after `timeout`.
///
/// `what` names the awaited condition in the timeout error.
pub fn wait_until<T>(
    what: &str,
    timeout: Duration,
    mut condition: impl FnMut() -> Option<T>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = condition() {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            return Err(TestkitError::Timeout {
                what: what.to_owned(),
                after: timeout,
            });
        }
        std::thread::sleep(POLL);
    }
}

/// The async form of [`wait_until`].
pub async fn wait_until_async<T, F, Fut>(
    what: &str,
    timeout: Duration,
    mut condition: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = condition().await {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            return Err(TestkitError::Timeout {
                what: what.to_owned(),
                after: timeout,
            });
        }
        tokio::time::sleep(POLL).await;
    }
}
