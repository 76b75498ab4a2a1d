//! The Redis Streams sink against a real `redis-server`: entries at the ids
//! their positions give; a resend is counted as a duplicate, not stored; an
//! entry at the id with another event id, or another writer's entry at the
//! top, fails the delivery for good naming both; an event below the top with
//! an empty id is appended after the top; a replay stores every event again;
//! a key of another type refuses its entry alone; any other refusal stores
//! nothing after it; dead letters are never trimmed, and pending letters
//! whose entries are gone are named.

use std::time::Duration;

use bytes::Bytes;
use walbox_outbox::{Event, Position};
use walbox_sink::{DeliveryClass, RedisSink, RedisSinkConfig, Sink};
use walbox_testkit::RedisServer;

fn event(id: &str, stream: &str, lsn: u64, index: u32) -> Event {
    Event {
        event_id: id.into(),
        topic: stream.into(),
        key: Some(Bytes::from_static(b"order-1")),
        value: Bytes::from_static(br#"{"n":1}"#),
        json_value: true,
        headers: vec![("event_id".into(), Bytes::copy_from_slice(id.as_bytes()))],
        position: Position {
            commit_lsn: walbox_pgoutput::Lsn(lsn),
            index,
            xid: 7,
        },
        origin: walbox_outbox::Origin::Stream,
    }
}

fn config(redis: &RedisServer, writer: &str) -> RedisSinkConfig {
    RedisSinkConfig {
        url: redis.url(),
        writer: Some(writer.into()),
        ..RedisSinkConfig::default()
    }
}

/// Sends `events` in one go and returns each one's outcome, in order.
async fn send_all(
    cfg: &RedisSinkConfig,
    replay: Option<&str>,
    events: Vec<Event>,
) -> (Vec<Result<(), (DeliveryClass, String)>>, u64) {
    let (mut sink, mut deliveries) = RedisSink::new(cfg.clone()).unwrap();
    let n = events.len();
    for (i, mut e) in events.into_iter().enumerate() {
        if let Some(from) = replay {
            e.origin = walbox_outbox::Origin::Replay {
                from: from.parse().unwrap(),
            };
        }
        sink.send(e, i).await.unwrap();
    }
    sink.flush(Duration::from_secs(30)).await.unwrap();
    let mut out: Vec<Option<Result<(), (DeliveryClass, String)>>> = vec![None; n];
    for _ in 0..n {
        let d = tokio::time::timeout(Duration::from_secs(30), deliveries.recv())
            .await
            .unwrap()
            .unwrap();
        out[d.token] = Some(d.result.map_err(|e| (e.class, e.reason)));
    }
    (
        out.into_iter().map(Option::unwrap).collect(),
        sink.duplicates(),
    )
}

/// Sets one of the server's settings (`CONFIG SET`).
async fn config_set(redis: &RedisServer, name: &str, value: &str) {
    let client = redis::Client::open(redis.url()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg(name)
        .arg(value)
        .query_async(&mut con)
        .await
        .unwrap();
}

async fn ids(redis: &RedisServer, stream: &str) -> Vec<String> {
    let mut out = Vec::new();
    let cfg = RedisSinkConfig {
        url: redis.url(),
        ..RedisSinkConfig::default()
    };
    walbox_sink::read_stream(&cfg, stream, Duration::from_secs(10), |r| {
        out.push(r.header("event_id").unwrap_or_default().to_owned());
    })
    .await
    .unwrap();
    out
}

async fn raw_ids(redis: &RedisServer, stream: &str) -> Vec<String> {
    let client = redis::Client::open(redis.url()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    let v: redis::Value = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query_async(&mut con)
        .await
        .unwrap();
    let redis::Value::Array(items) = v else {
        panic!("{v:?}")
    };
    items
        .iter()
        .map(|i| match i {
            redis::Value::Array(p) => match &p[0] {
                redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                other => panic!("{other:?}"),
            },
            other => panic!("{other:?}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resends_are_duplicates_and_lower_positions_are_appended_after_the_top() {
    let redis = RedisServer::start().expect("redis-server starts");
    let cfg = config(&redis, "slot_a");
    let s = "outbox.order";
    let (r, dups) = send_all(
        &cfg,
        None,
        vec![
            event("e1", s, 100, 0),
            event("e2", s, 100, 1),
            event("e3", s, 200, 0),
        ],
    )
    .await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    assert_eq!(dups, 0);
    assert_eq!(raw_ids(&redis, s).await, ["100-0", "100-1", "200-0"]);

    // A resend after a crash, then a new event: the resend is a duplicate.
    let (r, dups) = send_all(
        &cfg,
        None,
        vec![
            event("e2", s, 100, 1),
            event("e3", s, 200, 0),
            event("e4", s, 300, 0),
        ],
    )
    .await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    assert_eq!(dups, 2);
    assert_eq!(
        raw_ids(&redis, s).await,
        ["100-0", "100-1", "200-0", "300-0"]
    );

    // An event below the top whose id is empty (a retaken snapshot): stored
    // after the top, not dropped.
    let (r, dups) = send_all(&cfg, None, vec![event("e-late", s, 150, 0)]).await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    assert_eq!(dups, 0);
    assert_eq!(
        raw_ids(&redis, s).await,
        ["100-0", "100-1", "200-0", "300-0", "301-0"]
    );
    let events = ids(&redis, s).await;
    assert_eq!(events, ["e1", "e2", "e3", "e4", "e-late"]);

    // A replay stores every event again, after the top, in order.
    let (r, dups) = send_all(
        &cfg,
        Some("0/64"),
        vec![event("e1", s, 100, 0), event("e2", s, 100, 1)],
    )
    .await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    assert_eq!(dups, 0);
    let events = ids(&redis, s).await;
    assert_eq!(events, ["e1", "e2", "e3", "e4", "e-late", "e1", "e2"]);
    // The same replay run again (after a kill): what it stored is counted as
    // a duplicate, the rest stored.
    let (r, dups) = send_all(
        &cfg,
        Some("0/64"),
        vec![
            event("e1", s, 100, 0),
            event("e2", s, 100, 1),
            event("e3", s, 200, 0),
        ],
    )
    .await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    assert_eq!(dups, 2);
    let events = ids(&redis, s).await;
    assert_eq!(events, ["e1", "e2", "e3", "e4", "e-late", "e1", "e2", "e3"]);
    // Another replay (another --from) stores them all again.
    let (_, dups) = send_all(&cfg, Some("0/65"), vec![event("e1", s, 100, 0)]).await;
    assert_eq!(dups, 0);
    assert_eq!(ids(&redis, s).await.len(), 9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_event_at_the_id_or_another_writer_at_the_top_stops_naming_both() {
    let redis = RedisServer::start().expect("redis-server starts");
    let cfg = config(&redis, "slot_a");
    let s = "outbox.taken";
    let (r, _) = send_all(
        &cfg,
        None,
        vec![event("e1", s, 100, 0), event("e2", s, 200, 0)],
    )
    .await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    // The same position with another event id, then a later event: the first
    // fails for good, nothing after it is stored.
    let (r, dups) = send_all(
        &cfg,
        None,
        vec![event("e-other", s, 100, 0), event("e3", s, 400, 0)],
    )
    .await;
    assert_eq!(dups, 0);
    let (class, reason) = r[0].clone().unwrap_err();
    assert_eq!(class, DeliveryClass::DuplicateId);
    assert!(
        reason.contains("\"e1\"") && reason.contains("\"e-other\"") && reason.contains("100-0"),
        "{reason}"
    );
    assert!(r[1].is_err(), "{r:?}");
    assert_eq!(raw_ids(&redis, s).await, ["100-0", "200-0"]);

    // Another walbox (writer slot_b) on the same stream is refused, naming both.
    let other = config(&redis, "slot_b");
    let (r, _) = send_all(&other, None, vec![event("b1", s, 500, 0)]).await;
    let (class, reason) = r[0].clone().unwrap_err();
    assert_eq!(class, DeliveryClass::DuplicateId);
    assert!(
        reason.contains("\"slot_a\"") && reason.contains("\"slot_b\"") && reason.contains("e2"),
        "{reason}"
    );
    assert_eq!(raw_ids(&redis, s).await, ["100-0", "200-0"]);

    // An entry of a writer that is no walbox at the top (an auto id, in
    // wall-clock milliseconds) stops walbox too.
    let client = redis::Client::open(redis.url()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    let _: String = redis::cmd("XADD")
        .arg(s)
        .arg("*")
        .arg("x")
        .arg("1")
        .query_async(&mut con)
        .await
        .unwrap();
    let (r, _) = send_all(&cfg, None, vec![event("e5", s, 600, 0)]).await;
    let (class, reason) = r[0].clone().unwrap_err();
    assert_eq!(class, DeliveryClass::DuplicateId);
    assert!(reason.contains("no walbox"), "{reason}");
}

/// Several script calls of a session in flight at once: when the first one
/// stops (another event at an entry's id), the calls sent after it write
/// nothing, though they went out before its answer came.
#[tokio::test] // one thread: every event is queued before the sink's writer runs, so its calls go out together
async fn calls_in_flight_behind_one_that_stopped_write_nothing() {
    let redis = RedisServer::start().expect("redis-server starts");
    let s = "outbox.chained";
    let cfg = config(&redis, "slot_a");
    let (r, _) = send_all(&cfg, None, vec![event("x", s, 300, 0)]).await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    // Four entries per call: the first call holds the event at 300-0 (taken
    // by x) first, the three calls after it sixteen later positions.
    let cfg = RedisSinkConfig {
        max_in_flight: 4,
        ..cfg
    };
    let mut events = vec![event("y", s, 300, 0)];
    events.extend((1..16u64).map(|i| event(&format!("e{i}"), s, 300 + 8 * i, 0)));
    let (r, _) = send_all(&cfg, None, events).await;
    assert_eq!(
        r[0].clone().unwrap_err().0,
        DeliveryClass::DuplicateId,
        "{r:?}"
    );
    assert!(r.iter().all(Result::is_err), "{r:?}");
    assert_eq!(raw_ids(&redis, s).await, ["300-0"]);
    // A session after it writes again.
    let (r, _) = send_all(&cfg, None, vec![event("e1", s, 308, 0)]).await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    assert_eq!(raw_ids(&redis, s).await, ["300-0", "308-0"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_of_another_type_refuses_its_entry_alone_and_other_refusals_store_nothing_after_them()
{
    let redis = RedisServer::start().expect("redis-server starts");
    let cfg = config(&redis, "slot_a");
    let client = redis::Client::open(redis.url()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    // A key of another type: XADD to it is refused (WRONGTYPE).
    let _: () = redis::cmd("SET")
        .arg("outbox.string")
        .arg("x")
        .query_async(&mut con)
        .await
        .unwrap();
    let (r, _) = send_all(
        &cfg,
        None,
        vec![
            event("a1", "outbox.ok", 100, 0),
            event("s1", "outbox.string", 100, 1),
            event("a2", "outbox.ok", 100, 2),
        ],
    )
    .await;
    // A key of another type refuses that entry alone (it goes to a dead
    // letter); the others are written.
    assert!(r[0].is_ok(), "{r:?}");
    assert_eq!(r[1].clone().unwrap_err().0, DeliveryClass::InvalidTopic);
    assert!(r[2].is_ok(), "{r:?}");
    assert_eq!(raw_ids(&redis, "outbox.ok").await, ["100-0", "100-2"]);
    // Another refusal (the server out of memory) stops the batch there.
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("1")
        .query_async(&mut con)
        .await
        .unwrap();
    let (r, _) = send_all(
        &cfg,
        None,
        vec![
            event("a3", "outbox.ok", 200, 0),
            event("a4", "outbox.ok", 200, 1),
        ],
    )
    .await;
    let (class, reason) = r[0].clone().unwrap_err();
    assert_eq!(class, DeliveryClass::BrokerError, "{reason}");
    assert!(reason.contains("OOM"), "{reason}");
    assert!(r[1].is_err(), "{r:?}");
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("0")
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(raw_ids(&redis, "outbox.ok").await, ["100-0", "100-2"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_fsync_on_every_write_is_refused_unless_allowed() {
    let redis = RedisServer::start().expect("redis-server starts");
    config_set(&redis, "appendfsync", "everysec").await;
    let cfg = config(&redis, "slot_a");
    let (mut sink, _d) = RedisSink::new(cfg.clone()).unwrap();
    let e = sink
        .send(event("e1", "outbox.x", 100, 0), 0)
        .await
        .expect_err("refused");
    assert!(e.to_string().contains("appendfsync everysec"), "{e}");
    let allowed = RedisSinkConfig {
        allow_unsynced: true,
        ..cfg
    };
    let (r, _) = send_all(&allowed, None, vec![event("e1", "outbox.x", 100, 0)]).await;
    assert!(r[0].is_ok(), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_is_an_authentication_error_without_the_password() {
    let redis = RedisServer::start_with(walbox_testkit::RedisOptions {
        password: Some("right-Pw-1".into()),
        ..Default::default()
    })
    .expect("redis-server starts");
    let cfg = RedisSinkConfig {
        password: Some("wrong-Pw-2".into()),
        ..config(&redis, "slot_a")
    };
    let (mut sink, _d) = RedisSink::new(cfg).unwrap();
    let e = sink
        .send(event("e1", "outbox.x", 100, 0), 0)
        .await
        .expect_err("refused");
    assert!(
        matches!(e, walbox_sink::SinkError::RedisAuthentication { .. }),
        "{e:?}"
    );
    assert!(!e.to_string().contains("wrong-Pw-2"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_the_ca_and_a_client_certificate_delivers_and_without_them_fails() {
    let redis = RedisServer::start_with(walbox_testkit::RedisOptions {
        tls: true,
        ..Default::default()
    })
    .expect("redis-server starts with TLS");
    let files = redis.tls_files().unwrap().clone();
    let cfg = RedisSinkConfig {
        url: redis.tls_url().unwrap(),
        ca_file: Some(files.ca_cert.clone()),
        client_cert: Some(files.client_cert.clone()),
        client_key: Some(files.client_key.clone()),
        ..config(&redis, "slot_a")
    };
    let (r, _) = send_all(&cfg, None, vec![event("t1", "outbox.tls", 100, 0)]).await;
    assert!(r[0].is_ok(), "{r:?}");
    assert_eq!(raw_ids(&redis, "outbox.tls").await, ["100-0"]);
    // Without a client certificate the server refuses the handshake.
    let bare = RedisSinkConfig {
        client_cert: None,
        client_key: None,
        ..cfg
    };
    let (mut sink, _d) = RedisSink::new(bare).unwrap();
    sink.send(event("t2", "outbox.tls", 200, 0), 0)
        .await
        .expect_err("no client certificate");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_entry_resent_is_appended_where_no_later_position_can_land() {
    // A transaction at 200 was written in part (200-0, 200-1) when walbox was
    // killed; a consumer deleted 100-0 meanwhile. The resend finds 100-0 empty
    // below the top and appends it, at an odd milliseconds part that no
    // position has: not at 200-2, the id of the transaction's next event,
    // which would then find its id taken by another event and stop walbox.
    let redis = RedisServer::start().expect("redis-server starts");
    let cfg = config(&redis, "slot_a");
    let s = "outbox.deleted";
    let (r, _) = send_all(
        &cfg,
        None,
        vec![
            event("a", s, 100, 0),
            event("c0", s, 200, 0),
            event("c1", s, 200, 1),
        ],
    )
    .await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    let client = redis::Client::open(redis.url()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    let n: i64 = redis::cmd("XDEL")
        .arg(s)
        .arg("100-0")
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(n, 1);
    let (r, dups) = send_all(
        &cfg,
        None,
        vec![
            event("a", s, 100, 0),
            event("c0", s, 200, 0),
            event("c1", s, 200, 1),
            event("c2", s, 200, 2),
            event("d", s, 208, 0),
        ],
    )
    .await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    assert_eq!(dups, 2);
    // The rest of transaction 200 lies below the appended entry: appended
    // after it, in order; the next transaction at its own id.
    assert_eq!(
        raw_ids(&redis, s).await,
        ["200-0", "200-1", "201-0", "201-1", "208-0"]
    );
    assert_eq!(ids(&redis, s).await, ["c0", "c1", "a", "c2", "d"]);
    // A resend of it all again: nothing is refused; what sits at its own id
    // is a duplicate, the appended ones are appended again (at least once).
    let (r, dups) = send_all(
        &cfg,
        None,
        vec![event("c1", s, 200, 1), event("d", s, 208, 0)],
    )
    .await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    assert_eq!(dups, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_committed_at_the_snapshots_point_does_not_meet_its_rows_ids() {
    // The consistent point P is the end of a WAL record, so the next record,
    // the commit of a transaction the snapshot does not show, can start at P:
    // its events have positions (P, 0..) like the snapshot's rows.
    let redis = RedisServer::start().expect("redis-server starts");
    let cfg = config(&redis, "slot_a");
    let s = "outbox.snap";
    let row = |id: &str, index: u32| {
        let mut e = event(id, s, 4096, index);
        e.position.xid = 0;
        e.origin = walbox_outbox::Origin::Snapshot {
            point: walbox_pgoutput::Lsn(4096),
        };
        e
    };
    let events = vec![
        row("row0", 0),
        row("row1", 1),
        event("t0", s, 4096, 0),
        event("t1", s, 4096, 1),
        event("t2", s, 4096, 2),
        event("u0", s, 4104, 0),
    ];
    let (r, dups) = send_all(&cfg, None, events.clone()).await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    assert_eq!(dups, 0);
    assert_eq!(
        ids(&redis, s).await,
        ["row0", "row1", "t0", "t1", "t2", "u0"]
    );
    // Every one at an id of its own: a resend of all finds each there.
    let (r, dups) = send_all(&cfg, None, events).await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    assert_eq!(dups, 6);
    assert_eq!(ids(&redis, s).await.len(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_skips_fsync_while_it_rewrites_is_refused_unless_allowed() {
    // With no-appendfsync-on-rewrite yes, Redis does not fsync while a
    // background save or AOF rewrite runs, even with appendfsync always: an
    // acknowledged entry may not be on disk.
    let redis = RedisServer::start().expect("redis-server starts");
    config_set(&redis, "no-appendfsync-on-rewrite", "yes").await;
    let cfg = config(&redis, "slot_a");
    let (mut sink, _d) = RedisSink::new(cfg.clone()).unwrap();
    let e = sink
        .send(event("e1", "outbox.x", 100, 0), 0)
        .await
        .expect_err("refused");
    assert!(
        e.to_string().contains("no-appendfsync-on-rewrite yes"),
        "{e}"
    );
    let allowed = RedisSinkConfig {
        allow_unsynced: true,
        ..cfg
    };
    let (r, _) = send_all(&allowed, None, vec![event("e1", "outbox.x", 100, 0)]).await;
    assert!(r[0].is_ok(), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_with_more_fields_than_a_script_call_can_pass_is_refused_alone() {
    // Lua unpacks at most about 8,000 values into one call: an entry with
    // more fields would make the whole script fail, for every session again.
    let redis = RedisServer::start().expect("redis-server starts");
    let cfg = config(&redis, "slot_a");
    let s = "outbox.wide";
    let mut wide = event("wide", s, 200, 0);
    wide.headers = (0..4_500)
        .map(|i| (format!("h{i}").into(), Bytes::from_static(b"v")))
        .collect();
    let (r, _) = send_all(
        &cfg,
        None,
        vec![event("before", s, 100, 0), wide, event("after", s, 300, 0)],
    )
    .await;
    assert!(r[0].is_ok() && r[2].is_ok(), "{r:?}");
    let (class, reason) = r[1].clone().expect_err("refused");
    assert_eq!(class, DeliveryClass::MessageTooLarge, "{reason}");
    assert!(reason.contains("fields"), "{reason}");
    assert_eq!(ids(&redis, s).await, ["before", "after"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_run_again_after_its_copies_were_deleted_stores_them_again() {
    // What a replay's progress says it stored counts as stored only while
    // the stream holds the last copy it appended: a stream deleted (or
    // trimmed past it) since gets the range again, not "already stored".
    let redis = RedisServer::start().expect("redis-server starts");
    let cfg = config(&redis, "slot_a");
    let s = "outbox.replayed";
    let range = || vec![event("e1", s, 100, 0), event("e2", s, 200, 0)];
    let (r, dups) = send_all(&cfg, Some("0/64"), range()).await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    assert_eq!(dups, 0);
    // Run again as is (after a kill): nothing twice.
    let (_, dups) = send_all(&cfg, Some("0/64"), range()).await;
    assert_eq!(dups, 2);
    assert_eq!(ids(&redis, s).await, ["e1", "e2"]);
    let client = redis::Client::open(redis.url()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    let _: i64 = redis::cmd("DEL")
        .arg(s)
        .query_async(&mut con)
        .await
        .unwrap();
    let (r, dups) = send_all(&cfg, Some("0/64"), range()).await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    assert_eq!(dups, 0);
    assert_eq!(ids(&redis, s).await, ["e1", "e2"]);
    // Deleted and written again by others since: the last copy is gone, so
    // the range is stored again.
    let _: i64 = redis::cmd("DEL")
        .arg(s)
        .query_async(&mut con)
        .await
        .unwrap();
    let (r, _) = send_all(&cfg, None, vec![event("e9", s, 900, 0)]).await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    let (_, dups) = send_all(&cfg, Some("0/64"), range()).await;
    assert_eq!(dups, 0);
    assert_eq!(ids(&redis, s).await, ["e9", "e1", "e2"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_event_id_with_another_key_at_the_id_is_not_a_duplicate() {
    // A resend counts as stored only when the entry at its id is the same
    // event: its event id and its key (the stream and the position are the
    // entry's own). Event ids a sequence gives can come back after a
    // database is restored to an earlier point, for other rows.
    let redis = RedisServer::start().expect("redis-server starts");
    let cfg = config(&redis, "slot_a");
    let s = "outbox.rekeyed";
    let (r, _) = send_all(&cfg, None, vec![event("e1", s, 100, 0)]).await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    let mut other = event("e1", s, 100, 0);
    other.key = Some(Bytes::from_static(b"order-2"));
    let (r, dups) = send_all(&cfg, None, vec![other, event("e2", s, 200, 0)]).await;
    assert_eq!(dups, 0);
    let (class, reason) = r[0].clone().unwrap_err();
    assert_eq!(class, DeliveryClass::DuplicateId);
    assert!(
        reason.contains("another key") && reason.contains("100-0"),
        "{reason}"
    );
    assert!(r[1].is_err(), "{r:?}");
    assert_eq!(raw_ids(&redis, s).await, ["100-0"]);
    // The same key again: a duplicate.
    let (r, dups) = send_all(&cfg, None, vec![event("e1", s, 100, 0)]).await;
    assert!(r[0].is_ok(), "{r:?}");
    assert_eq!(dups, 1);
}

/// `event` as the dead letter of an event of `stream` (it carries walbox's
/// error class), to `{stream}.dlq`.
fn dead_letter(id: &str, stream: &str, lsn: u64) -> Event {
    let mut e = event(id, &format!("{stream}.dlq"), lsn, 0);
    e.headers.push((
        walbox_outbox::dead_letter_header::ERROR_CLASS.into(),
        Bytes::from_static(b"invalid_topic"),
    ));
    e
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_never_trimmed_by_maxlen_or_minid() {
    // A letter trimmed away before `walbox dlq replay` runs would be gone:
    // trimming applies to the streams of events, never to dead letters.
    let redis = RedisServer::start().expect("redis-server starts");
    let client = redis::Client::open(redis.url()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    // One entry per node, so that `~` trims as far as it is asked to.
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("stream-node-max-entries")
        .arg("1")
        .query_async(&mut con)
        .await
        .unwrap();
    let maxlen = RedisSinkConfig {
        maxlen: Some(1),
        ..config(&redis, "slot_a")
    };
    let minid = RedisSinkConfig {
        minid_behind_bytes: Some(50),
        ..config(&redis, "slot_a")
    };
    for (cfg, s) in [(&maxlen, "outbox.maxlen"), (&minid, "outbox.minid")] {
        let mut events = Vec::new();
        for (n, lsn) in [100u64, 200, 300].into_iter().enumerate() {
            events.push(event(&format!("e{n}"), s, lsn, 0));
            events.push(dead_letter(&format!("d{n}"), s, lsn + 8));
        }
        let (r, _) = send_all(cfg, None, events).await;
        assert!(r.iter().all(Result::is_ok), "{s}: {r:?}");
        // The events' stream is trimmed as configured ...
        assert_eq!(ids(&redis, s).await, ["e2"], "{s}");
        // ... its dead letters are all kept.
        assert_eq!(
            ids(&redis, &format!("{s}.dlq")).await,
            ["d0", "d1", "d2"],
            "{s}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_letters_whose_entries_are_gone_are_named_and_never_pass_over_the_others() {
    // Letters read by an earlier `walbox dlq replay` and left pending (they
    // still failed), then deleted or trimmed from the stream: the consumer
    // group hands them back as ids without fields. They are named, and a
    // page of them never ends the reading of the pending letters after it.
    let redis = RedisServer::start().expect("redis-server starts");
    let cfg = config(&redis, "slot_a");
    let s = "outbox.gone";
    let dlq = format!("{s}.dlq");
    let letters: Vec<Event> = (0..1_002u64)
        .map(|n| dead_letter(&format!("d{n}"), s, 100 + 8 * n))
        .collect();
    let (r, _) = send_all(&cfg, None, letters).await;
    assert!(r.iter().all(Result::is_ok));
    let group = "walbox-dlq-replay.test";
    // A first run reads them all and leaves them pending.
    let read = walbox_sink::StreamLetters::read(&cfg, &dlq, group, Duration::from_secs(30))
        .await
        .unwrap()
        .expect("the stream exists");
    let mut n = 0;
    read.each(|_| n += 1);
    assert_eq!(n, 1_002);
    read.settle(|_| false).await.unwrap();
    // The first 1,001 are deleted; the last one stays.
    let all = raw_ids(&redis, &dlq).await;
    let client = redis::Client::open(redis.url()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    let _: i64 = redis::cmd("XDEL")
        .arg(&dlq)
        .arg(&all[..1_001])
        .query_async(&mut con)
        .await
        .unwrap();
    let read = walbox_sink::StreamLetters::read(&cfg, &dlq, group, Duration::from_secs(30))
        .await
        .unwrap()
        .expect("the stream exists");
    let mut kept = Vec::new();
    read.each(|r| kept.push(r.header("event_id").unwrap_or_default().to_owned()));
    assert_eq!(kept, ["d1001"], "the letter after the gone ones is read");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_run_again_stores_the_events_its_first_run_did_not_write_below_its_mark() {
    // A replay of table A's events, then the same replay (same --from) run
    // again after table B was added to the configuration: B1 lies below
    // what the first run recorded, but the stream holds no copy of it from
    // this replay, so it is stored; A1..A3 are not stored again.
    let redis = RedisServer::start().expect("redis-server starts");
    let cfg = config(&redis, "slot_a");
    let s = "outbox.added";
    let a = || {
        vec![
            event("A1", s, 100, 0),
            event("A2", s, 200, 0),
            event("A3", s, 300, 0),
        ]
    };
    let (r, dups) = send_all(&cfg, Some("0/64"), a()).await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    assert_eq!(dups, 0);
    let mut again = a();
    again.insert(1, event("B1", s, 150, 0));
    let (r, dups) = send_all(&cfg, Some("0/64"), again.clone()).await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    assert_eq!(ids(&redis, s).await, ["A1", "A2", "A3", "B1"]);
    assert_eq!(dups, 3);
    // A third run stores nothing again.
    let (_, dups) = send_all(&cfg, Some("0/64"), again.clone()).await;
    assert_eq!(dups, 4);
    assert_eq!(ids(&redis, s).await, ["A1", "A2", "A3", "B1"]);
    // A copy deleted since is stored again; the others are not.
    let client = redis::Client::open(redis.url()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    let copies = raw_ids(&redis, s).await;
    let _: i64 = redis::cmd("XDEL")
        .arg(s)
        .arg(&copies[1])
        .query_async(&mut con)
        .await
        .unwrap();
    let (r, dups) = send_all(&cfg, Some("0/64"), again).await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    assert_eq!(dups, 3);
    assert_eq!(ids(&redis, s).await, ["A1", "A3", "B1", "A2"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_of_another_writer_added_and_deleted_stops_walbox_naming_the_last_id() {
    // Another writer's entry added and deleted leaves the stream's
    // last-generated-id above walbox's entries (here in wall-clock
    // milliseconds): every later position would be refused as not above the
    // top and appended. walbox stops instead, naming the stream and that id.
    // Its own entries deleted by a consumer, appended after the top, or
    // copied by a replay never stop it.
    let redis = RedisServer::start().expect("redis-server starts");
    let cfg = config(&redis, "slot_a");
    let s = "outbox.lastid";
    let client = redis::Client::open(redis.url()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    let (r, _) = send_all(
        &cfg,
        None,
        vec![event("e1", s, 100, 0), event("e2", s, 200, 0)],
    )
    .await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    // A consumer deletes walbox's newest entry; e2 is resent (appended after
    // the top), e3 goes to its own id.
    let _: i64 = redis::cmd("XDEL")
        .arg(s)
        .arg("200-0")
        .query_async(&mut con)
        .await
        .unwrap();
    let (r, _) = send_all(
        &cfg,
        None,
        vec![event("e2", s, 200, 0), event("e3", s, 300, 0)],
    )
    .await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    // A replay's copy after the top, deleted by a consumer too; then the
    // next event at its own id.
    let (r, _) = send_all(&cfg, Some("0/64"), vec![event("e1", s, 100, 0)]).await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    let top = raw_ids(&redis, s).await.last().cloned().unwrap();
    let _: i64 = redis::cmd("XDEL")
        .arg(s)
        .arg(&top)
        .query_async(&mut con)
        .await
        .unwrap();
    let (r, _) = send_all(&cfg, None, vec![event("e4", s, 400, 0)]).await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    assert_eq!(
        raw_ids(&redis, s).await,
        ["100-0", "201-0", "300-0", "400-0"]
    );

    // Another writer adds an entry (an auto id) and deletes it.
    let foreign: String = redis::cmd("XADD")
        .arg(s)
        .arg("*")
        .arg("x")
        .arg("1")
        .query_async(&mut con)
        .await
        .unwrap();
    let _: i64 = redis::cmd("XDEL")
        .arg(s)
        .arg(&foreign)
        .query_async(&mut con)
        .await
        .unwrap();
    let (r, _) = send_all(
        &cfg,
        None,
        vec![event("e5", s, 500, 0), event("e6", s, 600, 0)],
    )
    .await;
    let (class, reason) = r[0].clone().expect_err("stopped");
    assert_eq!(class, DeliveryClass::DuplicateId, "{reason}");
    assert!(
        reason.contains(s) && reason.contains(&foreign) && reason.contains("another writer"),
        "{reason}"
    );
    assert!(r[1].is_err(), "{r:?}");
    assert_eq!(
        raw_ids(&redis, s).await,
        ["100-0", "201-0", "300-0", "400-0"]
    );

    // The same on a stream walbox has not written yet.
    let fresh = "outbox.lastid.fresh";
    let foreign: String = redis::cmd("XADD")
        .arg(fresh)
        .arg("*")
        .arg("x")
        .arg("1")
        .query_async(&mut con)
        .await
        .unwrap();
    let _: i64 = redis::cmd("XDEL")
        .arg(fresh)
        .arg(&foreign)
        .query_async(&mut con)
        .await
        .unwrap();
    let (r, _) = send_all(&cfg, None, vec![event("f1", fresh, 100, 0)]).await;
    let (class, reason) = r[0].clone().expect_err("stopped");
    assert_eq!(class, DeliveryClass::DuplicateId, "{reason}");
    assert!(reason.contains(&foreign), "{reason}");
    assert!(raw_ids(&redis, fresh).await.is_empty());
}

/// Sends `e` through `sink`, waits for its delivery and returns it.
async fn send_one(
    sink: &mut RedisSink,
    deliveries: &mut walbox_sink::Deliveries,
    e: Event,
    token: usize,
) -> Result<(), (DeliveryClass, String)> {
    sink.send(e, token).await.unwrap();
    sink.flush(Duration::from_secs(30)).await.unwrap();
    let d = tokio::time::timeout(Duration::from_secs(30), deliveries.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(d.token, token);
    d.result.map_err(|e| (e.class, e.reason))
}

/// A dead-letter replay runs beside the relay under the same writer (the
/// slot): each session's calls are chained within its own flow, so neither
/// takes the other's calls for a call of its own that was not stored. (A
/// replayed event is appended after the top at an odd millisecond part:
/// positions are even.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_beside_the_relay_under_the_same_writer_leaves_both_chains_whole() {
    let redis = RedisServer::start().expect("redis-server starts");
    let s = "outbox.beside";
    let cfg = config(&redis, "slot_a");
    let (mut relay, mut relay_d) = RedisSink::new(cfg.clone()).unwrap();
    let (mut replay, mut replay_d) = RedisSink::new(cfg.clone()).unwrap();
    let replayed = |mut e: Event| {
        e.origin = walbox_outbox::Origin::Replay {
            from: "0/64".parse().unwrap(),
        };
        e
    };
    for i in 0..4u64 {
        let r = send_one(
            &mut relay,
            &mut relay_d,
            event(&format!("r{i}"), s, 1000 + 16 * i, 0),
            i as usize,
        )
        .await;
        assert_eq!(r, Ok(()), "relay event {i}");
        let r = send_one(
            &mut replay,
            &mut replay_d,
            replayed(event(&format!("d{i}"), s, 500 + 16 * i, 0)),
            i as usize,
        )
        .await;
        assert_eq!(r, Ok(()), "replayed event {i}");
    }
    assert_eq!(raw_ids(&redis, s).await.len(), 8);
}

/// A proxy in front of `redis` and a sink's settings through it.
fn proxied(
    redis: &RedisServer,
    ack_timeout_ms: u64,
) -> (walbox_testkit::TcpProxy, RedisSinkConfig) {
    let proxy = walbox_testkit::TcpProxy::start(
        format!("127.0.0.1:{}", redis.port())
            .parse()
            .expect("an address"),
    )
    .expect("the proxy starts");
    let cfg = RedisSinkConfig {
        url: format!("redis://127.0.0.1:{}", proxy.addr().port()),
        ack_timeout_ms,
        connect_timeout_ms: 60_000,
        ..config(redis, "slot_a")
    };
    (proxy, cfg)
}

/// The outcomes of the deliveries of tokens `from..from + n`, in token
/// order, as they come.
async fn outcomes(
    deliveries: &mut walbox_sink::Deliveries,
    from: usize,
    n: usize,
) -> Vec<Result<(), (DeliveryClass, String)>> {
    let mut out = vec![None; n];
    for _ in 0..n {
        let d = tokio::time::timeout(Duration::from_secs(60), deliveries.recv())
            .await
            .expect("a delivery in time")
            .expect("the sink is alive");
        out[d.token - from] = Some(d.result.map_err(|e| (e.class, e.reason)));
    }
    out.into_iter().map(Option::unwrap).collect()
}

/// A call's answer is awaited from when the server reaches it: calls queued
/// behind others on the connection, each of which the server takes its
/// time over, are not failed for the time spent on the ones before them,
/// nor is a call sent after the connection sat idle; a call the server
/// itself takes too long over fails as a timeout, and the calls in flight
/// behind it fail with it at once.
#[tokio::test] // one thread: every event is queued before the sink's writer runs, so its calls go out together
async fn a_call_is_timed_from_when_the_server_reaches_it() {
    let redis = RedisServer::start().expect("redis-server starts");
    let (proxy, cfg) = proxied(&redis, 2_500);
    // The server answers one request per second: four calls sent together
    // are answered 1, 2, 3 and 4 s after the first reaches it, each within
    // 2.5 s of the answer before it.
    proxy.pace_requests(Duration::from_secs(1));
    let s = "outbox.paced";
    let cfg = RedisSinkConfig {
        max_in_flight: 4,
        ..cfg
    };
    let (mut sink, mut deliveries) = RedisSink::new(cfg).unwrap();
    let events: Vec<Event> = (0..16u64)
        .map(|i| event(&format!("p{i}"), s, 400 + 8 * i, 0))
        .collect();
    let mut sent: Vec<String> = events.iter().map(|e| e.event_id.clone()).collect();
    for (token, e) in events.into_iter().enumerate() {
        sink.send(e, token).await.unwrap();
    }
    let r = outcomes(&mut deliveries, 0, 16).await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    // The calls were on the connection together: the third was answered
    // 3 s after it was sent.
    assert!(proxy.most_held() >= 3, "{}", proxy.most_held());
    assert_eq!(ids(&redis, s).await, sent);

    // Idle for longer than the timeout, then a call answered at once: its
    // time runs from its sending, not from the last answer.
    proxy.pace_requests(Duration::ZERO);
    tokio::time::sleep(Duration::from_secs(5)).await;
    sink.send(event("after-idle", s, 600, 0), 16).await.unwrap();
    let r = outcomes(&mut deliveries, 16, 1).await;
    assert!(r[0].is_ok(), "{r:?}");
    sent.push("after-idle".into());

    // A server that takes 5 s over each request: the first call times out,
    // and the three in flight behind it fail with it, without their own
    // timeouts to wait for.
    proxy.pace_requests(Duration::from_secs(5));
    for i in 0..16u64 {
        let token = 17 + i as usize;
        sink.send(event(&format!("slow{i}"), s, 700 + 8 * i, 0), token)
            .await
            .unwrap();
    }
    let r = outcomes(&mut deliveries, 17, 16).await;
    for (i, o) in r.iter().enumerate() {
        let (class, reason) = o.clone().unwrap_err();
        if i < 4 {
            // The first call's batch.
            assert_eq!(class, DeliveryClass::Timeout, "event {i}: {reason}");
            assert!(
                reason.contains("within 2500 ms of the server reaching it"),
                "{reason}"
            );
        } else {
            assert_eq!(class, DeliveryClass::BrokerError, "event {i}: {reason}");
        }
    }
    drop(sink);
    // What the server may still have stored of them is a prefix after the
    // events before.
    let stored = ids(&redis, s).await;
    assert_eq!(stored[..sent.len()], sent[..]);
}

/// A read of the server's durability settings that gets no answer says
/// nothing of them: the session does not open (it is retried), rather than
/// going on as if the server could not tell.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durability_read_without_an_answer_does_not_open_the_session() {
    let redis = RedisServer::start().expect("redis-server starts");
    config_set(&redis, "appendfsync", "everysec").await;
    let (proxy, cfg) = proxied(&redis, 1_000);
    // Each request reaches the server 3 s after the one before it: the
    // connection's set-up goes through, CONFIG GET gets no answer in 1 s.
    proxy.pace_requests(Duration::from_secs(3));
    let (mut sink, _d) = RedisSink::new(cfg).unwrap();
    let e = sink
        .send(event("e1", "outbox.d", 100, 0), 0)
        .await
        .expect_err("the session does not open");
    let text = e.to_string();
    assert!(
        text.contains("CONFIG GET") && text.contains("no answer within 1000 ms"),
        "{text}"
    );
    assert!(matches!(e, walbox_sink::SinkError::Redis(_)), "{e:?}");
}
