//! An HTTP proxy in front of an AWS stand-in (kinesalite, LocalStack) that
//! answers chosen entries of a batch call as failed, the way AWS does when
//! it throttles part of a batch: no stand-in here does that on its own.
//!
//! For Kinesis `PutRecords` (`X-Amz-Target: Kinesis_20131202.PutRecords`)
//! and SQS `SendMessageBatch` (`AmazonSQS.SendMessageBatch`, the JSON
//! protocol), every entry the script picks is taken out of the request
//! before it is forwarded (so the server never stores it) and put back
//! into the answer as failed: a `Records` item with `ErrorCode`
//! `ProvisionedThroughputExceededException` (and `FailedRecordCount`
//! raised), or a `Failed` item with `Code` `InternalError`. A Pub/Sub
//! Publish request (`POST .../topics/T:publish`) is all or nothing: when the
//! script picks any of its `messages`, none reaches the server and the call
//! is answered `400 INVALID_ARGUMENT`, as Pub/Sub refuses a request holding
//! a message it takes for invalid. Every other request is forwarded as it
//! is. The stand-ins check no signatures, so a
//! request changed on its way is still taken.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;

use crate::{Result, TestkitError};

/// One entry of a batch call, as the script sees it.
#[derive(Debug, Clone)]
pub struct Entry<'a> {
    /// The call's action (`PutRecords`, `SendMessageBatch`, `Publish`).
    pub action: &'a str,
    /// How many batch calls came before this one.
    pub call: usize,
    /// The entry's place in its call.
    pub index: usize,
    /// The entry as sent (a Kinesis record: `PartitionKey`, `Data` in
    /// base64; an SQS entry: `Id`, `MessageBody`, `MessageGroupId`, ...; a
    /// Pub/Sub message: `data` in base64, `attributes`, `orderingKey`).
    pub json: &'a Value,
}

type Script = Arc<dyn Fn(&Entry<'_>) -> bool + Send + Sync>;

#[derive(Default)]
struct Counts {
    calls: usize,
    failed: usize,
}

struct Inner {
    target: SocketAddr,
    script: Mutex<Script>,
    counts: Mutex<Counts>,
}

/// A running proxy on `127.0.0.1` and a free port, on a thread of its own;
/// stops when dropped.
pub struct FaultProxy {
    addr: SocketAddr,
    inner: Arc<Inner>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .field("target", &self.inner.target)
            .finish_non_exhaustive()
    }
}

impl FaultProxy {
    /// A proxy to `target` that fails nothing until told.
    pub fn start(target: SocketAddr) -> Result<Self> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")
            .map_err(TestkitError::io("binding", "127.0.0.1:0"))?;
        listener
            .set_nonblocking(true)
            .map_err(TestkitError::io("configuring", "the proxy's socket"))?;
        let addr = listener
            .local_addr()
            .map_err(TestkitError::io("reading", "the proxy's address"))?;
        let none: Script = Arc::new(|_| false);
        let inner = Arc::new(Inner {
            target,
            script: Mutex::new(none),
            counts: Mutex::new(Counts::default()),
        });
        let served = Arc::clone(&inner);
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("fault-proxy".into())
            .spawn(move || {
                let Ok(rt) = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .enable_all()
                    .build()
                else {
                    return;
                };
                rt.block_on(serve(listener, served, stopped));
                rt.shutdown_background();
            })
            .map_err(TestkitError::io("starting", "the proxy's thread"))?;
        Ok(FaultProxy {
            addr,
            inner,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// `http://127.0.0.1:<port>`: the endpoint URL clients use.
    #[must_use]
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// From now on, an entry for which `script` says `true` is answered as
    /// failed and never reaches the server.
    pub fn fail_when(&self, script: impl Fn(&Entry<'_>) -> bool + Send + Sync + 'static) {
        if let Ok(mut s) = self.inner.script.lock() {
            *s = Arc::new(script);
        }
    }

    /// Batch calls seen so far.
    #[must_use]
    pub fn calls(&self) -> usize {
        self.inner.counts.lock().map(|c| c.calls).unwrap_or(0)
    }

    /// Entries answered as failed so far (for Pub/Sub: Publish calls refused).
    #[must_use]
    pub fn failed(&self) -> usize {
        self.inner.counts.lock().map(|c| c.failed).unwrap_or(0)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn serve(
    listener: std::net::TcpListener,
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
        connections.spawn(async move {
            let service = hyper::service::service_fn(move |req| handle(Arc::clone(&inner), req));
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
    connections.abort_all();
}

/// The batch actions the proxy knows: the action, the request's list of
/// entries.
fn batch_action(target: &str) -> Option<(&'static str, &'static str)> {
    match target {
        "Kinesis_20131202.PutRecords" => Some(("PutRecords", "Records")),
        "AmazonSQS.SendMessageBatch" => Some(("SendMessageBatch", "Entries")),
        _ => None,
    }
}

async fn handle(
    inner: Arc<Inner>,
    req: Request<Incoming>,
) -> std::result::Result<Response<Full<Bytes>>, std::io::Error> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map_err(std::io::Error::other)?
        .to_bytes();
    if parts.uri.path().ends_with(":publish")
        && let Some(refused) = refuse_publish(&inner, &body)
    {
        return Ok(refused);
    }
    let target = parts
        .headers
        .get("x-amz-target")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let mut failed: Vec<(usize, Value)> = Vec::new();
    let mut forwarded = body.clone();
    let mut action = None;
    if let Some((name, list)) = batch_action(&target)
        && let Ok(mut request) = serde_json::from_slice::<Value>(&body)
    {
        let call = {
            let mut counts = inner.counts.lock().expect("not poisoned");
            counts.calls += 1;
            counts.calls - 1
        };
        let script = Arc::clone(&inner.script.lock().expect("not poisoned"));
        if let Some(entries) = request.get_mut(list).and_then(Value::as_array_mut) {
            let mut kept = Vec::new();
            for (index, json) in entries.drain(..).enumerate() {
                let entry = Entry {
                    action: name,
                    call,
                    index,
                    json: &json,
                };
                if script(&entry) {
                    failed.push((index, json));
                } else {
                    kept.push(json);
                }
            }
            *entries = kept;
        }
        inner.counts.lock().expect("not poisoned").failed += failed.len();
        forwarded = Bytes::from(serde_json::to_vec(&request).unwrap_or_default());
        action = Some(name);
    }
    let (status, answer, headers) =
        if action.is_some() && !failed.is_empty() && failed_all(&body, &failed) {
            // Every entry failed: no call reaches the server (it would refuse
            // an empty batch); the answer is made here.
            (200, Bytes::new(), Vec::new())
        } else {
            forward(&inner, &parts, forwarded).await?
        };
    let answer = match action {
        Some(name) if !failed.is_empty() && (200..300).contains(&status) => {
            splice(name, &answer, &failed)
        }
        _ => answer,
    };
    let mut response = Response::builder().status(status);
    let has_type = headers.iter().any(|(k, _)| k == "content-type");
    // The server's headers (the SDKs read error codes from some), but for
    // those of the connection and the length, which the body sets anew.
    for (k, v) in &headers {
        response = response.header(k.as_str(), v.as_str());
    }
    if !has_type {
        let content_type = parts
            .headers
            .get("content-type")
            .cloned()
            .unwrap_or_else(|| hyper::header::HeaderValue::from_static("application/json"));
        response = response.header("content-type", content_type);
    }
    response
        .body(Full::new(answer))
        .map_err(std::io::Error::other)
}

/// A Pub/Sub Publish request's answer when the script picks one of its
/// messages: the whole call refused, nothing forwarded.
fn refuse_publish(inner: &Inner, body: &[u8]) -> Option<Response<Full<Bytes>>> {
    let request = serde_json::from_slice::<Value>(body).ok()?;
    let call = {
        let mut counts = inner.counts.lock().expect("not poisoned");
        counts.calls += 1;
        counts.calls - 1
    };
    let script = Arc::clone(&inner.script.lock().expect("not poisoned"));
    let picked = request
        .get("messages")
        .and_then(Value::as_array)?
        .iter()
        .enumerate()
        .any(|(index, json)| {
            script(&Entry {
                action: "Publish",
                call,
                index,
                json,
            })
        });
    if !picked {
        return None;
    }
    inner.counts.lock().expect("not poisoned").failed += 1;
    let answer = serde_json::json!({"error": {
        "code": 400,
        "message": "Invalid message (injected by the test proxy)",
        "status": "INVALID_ARGUMENT",
    }});
    Response::builder()
        .status(400)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(answer.to_string())))
        .ok()
}

/// Whether every entry of the request was picked to fail.
fn failed_all(body: &[u8], failed: &[(usize, Value)]) -> bool {
    let Ok(request) = serde_json::from_slice::<Value>(body) else {
        return false;
    };
    ["Records", "Entries"]
        .iter()
        .filter_map(|l| request.get(*l).and_then(Value::as_array))
        .any(|all| all.len() == failed.len())
}

/// The answer with the failed entries put back in.
fn splice(action: &str, answer: &[u8], failed: &[(usize, Value)]) -> Bytes {
    let mut out: Value = serde_json::from_slice(answer).unwrap_or_else(|_| serde_json::json!({}));
    match action {
        "PutRecords" => {
            let mut records: Vec<Value> = out
                .get("Records")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            for (index, _) in failed {
                let at = (*index).min(records.len());
                records.insert(
                    at,
                    serde_json::json!({
                        "ErrorCode": "ProvisionedThroughputExceededException",
                        "ErrorMessage": "Rate exceeded for shard (injected by the test proxy)",
                    }),
                );
            }
            let count = records
                .iter()
                .filter(|r| r.get("ErrorCode").is_some())
                .count();
            out["Records"] = Value::Array(records);
            out["FailedRecordCount"] = Value::from(count);
        }
        "SendMessageBatch" => {
            let mut list: Vec<Value> = out
                .get("Failed")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            for (_, json) in failed {
                list.push(serde_json::json!({
                    "Id": json.get("Id").cloned().unwrap_or(Value::Null),
                    "SenderFault": false,
                    "Code": "InternalError",
                    "Message": "injected by the test proxy",
                }));
            }
            out["Failed"] = Value::Array(list);
            if out.get("Successful").is_none() {
                out["Successful"] = Value::Array(Vec::new());
            }
        }
        _ => {}
    }
    Bytes::from(serde_json::to_vec(&out).unwrap_or_default())
}

/// Forwards the request (its method, path, headers and `body`) to the
/// target; the target's status, body and headers.
async fn forward(
    inner: &Inner,
    parts: &hyper::http::request::Parts,
    body: Bytes,
) -> std::result::Result<(u16, Bytes, Vec<(String, String)>), std::io::Error> {
    let url = format!(
        "http://{}{}",
        inner.target,
        parts.uri.path_and_query().map_or("/", |p| p.as_str())
    );
    let method = parts.method.as_str().to_owned();
    let headers: Vec<(String, String)> = parts
        .headers
        .iter()
        .filter(|(k, _)| {
            !matches!(
                k.as_str(),
                "host" | "content-length" | "connection" | "transfer-encoding"
            )
        })
        .filter_map(|(k, v)| Some((k.as_str().to_owned(), v.to_str().ok()?.to_owned())))
        .collect();
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let mut request = ureq::http::Request::builder()
            .method(method.as_str())
            .uri(&url);
        for (k, v) in &headers {
            request = request.header(k, v);
        }
        let request = request.body(body.to_vec()).map_err(std::io::Error::other)?;
        let response = agent.run(request).map_err(std::io::Error::other)?;
        let status = response.status().as_u16();
        let headers: Vec<(String, String)> = response
            .headers()
            .iter()
            .filter(|(k, _)| {
                !matches!(
                    k.as_str(),
                    "content-length" | "connection" | "transfer-encoding" | "keep-alive"
                )
            })
            .filter_map(|(k, v)| Some((k.as_str().to_owned(), v.to_str().ok()?.to_owned())))
            .collect();
        let answer = response
            .into_body()
            .read_to_vec()
            .map_err(std::io::Error::other)?;
        Ok((status, Bytes::from(answer), headers))
    })
    .await
    .map_err(std::io::Error::other)?
}
