use super::errors::without_values;
use super::*;

#[test]
fn full_file_parses() {
    let c = Config::parse(
        r#"
        producer = "orders-service"
        [source]
        dsn = "host=db user=walbox dbname=app"
        slot = "s"
        publication = "p"
        [[outbox]]
        table = "public.outbox"
        topic = "events.{aggregate_type}"
        [outbox.columns]
        payload = "body"
        [sink]
        type = "kafka"
        create_topics = true
        max_in_flight = 500
        [sink.kafka]
        "bootstrap.servers" = "k:9092"
        "linger.ms" = 10
        "enable.ssl.certificate.verification" = true
        [shutdown]
        timeout_ms = 5000
        "#,
        Path::new("t.toml"),
    )
    .unwrap();
    assert_eq!(c.producer, "orders-service");
    assert_eq!(c.outbox[0].columns.payload.as_deref(), Some("body"));
    assert_eq!(c.sink.max_in_flight(), 500);
    let props = c.sink.kafka_properties().unwrap();
    assert!(props.contains(&("linger.ms".into(), "10".into())));
    assert!(props.contains(&("enable.ssl.certificate.verification".into(), "true".into())));
    let kafka = c.sink.kafka_sink().unwrap();
    assert_eq!(kafka.properties, props);
    assert!(kafka.create_topics);
    assert_eq!(kafka.max_in_flight, 500);
    assert_eq!(
        (kafka.topic_partitions, kafka.topic_replication),
        (c.sink.topic_partitions, c.sink.topic_replication)
    );
}

#[test]
fn unknown_keys_and_bad_values_name_the_key() {
    let err = Config::parse("[source]\nslott = \"x\"", Path::new("t.toml")).unwrap_err();
    assert!(format!("{err:#}").contains("slott"), "{err:#}");
    let err = Config::parse("[sink]\nmax_in_flight = \"many\"", Path::new("t.toml")).unwrap_err();
    assert!(format!("{err:#}").contains("max_in_flight"), "{err:#}");
    // The key and the allowed values, never what the file said.
    let err = Config::parse("[sink]\ntype = \"pulsar\"", Path::new("t.toml")).unwrap_err();
    let text = format!("{err:#}");
    assert!(
        text.contains("sink.type") && text.contains("unknown variant"),
        "{text}"
    );
    assert!(!text.contains("pulsar"), "{text}");
    let c = Config::parse(
        "[dead_letter]\ntopic = \"{table}.dlq\"",
        Path::new("t.toml"),
    )
    .unwrap();
    let err = c.validate().unwrap_err();
    assert!(err.to_string().contains("dead_letter.topic"), "{err}");
    let err = Config::parse("[dead_letter]\npolicy = \"ignore\"", Path::new("t.toml")).unwrap_err();
    assert!(format!("{err:#}").contains("dead_letter.policy"), "{err:#}");
    let err = Config::parse("bogus = 1", Path::new("t.toml")).unwrap_err();
    assert!(format!("{err:#}").contains("bogus"), "{err:#}");
    let c = Config::parse("[sink.kafka]\n\"x\" = [1]", Path::new("t.toml")).unwrap();
    let err = c.validate().unwrap_err();
    assert!(err.to_string().contains("sink.kafka.x"), "{err}");
}

#[test]
fn replay_windows_parse_with_units() {
    use std::time::Duration;
    let w = parse_replay_window;
    assert_eq!(w("0").unwrap(), ReplayWindow::None);
    assert_eq!(w("0s").unwrap(), ReplayWindow::None);
    assert_eq!(
        w("500ms").unwrap(),
        ReplayWindow::Time(Duration::from_millis(500))
    );
    assert_eq!(
        w("15min").unwrap(),
        ReplayWindow::Time(Duration::from_secs(900))
    );
    assert_eq!(
        w("2h").unwrap(),
        ReplayWindow::Time(Duration::from_secs(7200))
    );
    assert_eq!(
        w("7d").unwrap(),
        ReplayWindow::Time(Duration::from_secs(604_800))
    );
    assert_eq!(w("64kB").unwrap(), ReplayWindow::Bytes(65_536));
    assert_eq!(w("1GB").unwrap(), ReplayWindow::Bytes(1 << 30));
    for bad in ["", "10", "ten min", "5 parsecs", "-1s", "1.5h"] {
        assert!(w(bad).is_err(), "{bad:?} accepted");
    }
    let c = Config::parse("[source]\nreplay_window = \"5 weeks\"", Path::new("t.toml")).unwrap();
    let err = format!("{:#}", c.validate().unwrap_err());
    assert!(
        err.contains("source.replay_window") && err.contains("weeks"),
        "{err}"
    );
    let c = Config::parse("[source]\nslot = \"Bad-Name\"", Path::new("t.toml")).unwrap();
    assert!(
        c.validate()
            .unwrap_err()
            .to_string()
            .contains("source.slot")
    );
    let err = Config::parse("[snapshot]\nmode = \"always\"", Path::new("t.toml")).unwrap_err();
    let text = format!("{err:#}");
    assert!(
        text.contains("snapshot.mode") && text.contains("initial"),
        "{text}"
    );
    let c = Config::parse(
        "[snapshot]\nmode = \"initial\"\nwhere = \"published_at IS NULL\"\norder_by = [\"seq\"]",
        Path::new("t.toml"),
    )
    .unwrap();
    c.validate().unwrap();
    assert_eq!(c.snapshot.mode, SnapshotMode::Initial);
    assert_eq!(
        c.checkpoint_store().path(),
        Path::new("walbox-walbox.checkpoint.json")
    );
}

#[test]
fn parse_errors_do_not_quote_a_value_under_the_wrong_key() {
    for text in [
        "[source]\nslot = \"s\"\n[snapshot]\nmode = \"pw-51ab\"\n",
        "[sink]\ncreate_topics = \"pw-51ab\"\n",
        "[sink]\ncreate_topics = \"pw-\\\"51ab\"\n",
    ] {
        let err = format!(
            "{:#}",
            Config::parse(text, Path::new("t.toml")).unwrap_err()
        );
        assert!(!err.contains("51ab"), "{err}");
        assert!(err.contains("line"), "{err}");
    }
    assert_eq!(
        without_values("invalid type: string \"x\\\"y\", expected a boolean"),
        "invalid type: string \"(a value)\", expected a boolean"
    );
}

#[test]
fn parse_errors_do_not_quote_the_line() {
    let text = "[source]\ndsn = \"host=a password=pw-51ab\"\npasword = \"pw-51ab\"\n";
    let err = format!(
        "{:#}",
        Config::parse(text, Path::new("t.toml")).unwrap_err()
    );
    assert!(err.contains("pasword") && err.contains("line 3"), "{err}");
    assert!(!err.contains("pw-51ab"), "{err}");
}

#[test]
fn debug_forms_hide_the_dsn_and_secret_kafka_properties() {
    let c = Config::parse(
        r#"
        [source]
        dsn = "host=db user=walbox password=pw-c0ffee01"
        [sink.kafka]
        "bootstrap.servers" = "k:9092"
        "sasl.username" = "walbox"
        "sasl.password" = "pw-c0ffee02"
        "ssl.key.password" = "pw-c0ffee03"
        "sasl.oauthbearer.client.secret" = "pw-c0ffee04"
        "#,
        Path::new("t.toml"),
    )
    .unwrap();
    let o = Overrides {
        dsn: Some("password=pw-c0ffee05".parse().unwrap()),
        ..Overrides::default()
    };
    let shown = format!("{c:?} {c:#?} {o:?}");
    for n in 1..=5 {
        let secret = format!("pw-c0ffee0{n}");
        assert!(!shown.contains(&secret), "{secret} in {shown}");
    }
    assert!(
        shown.contains("k:9092") && shown.contains("<hidden>"),
        "{shown}"
    );
    assert_eq!(c.dsn().unwrap(), "host=db user=walbox password=pw-c0ffee01");
}

#[test]
fn overrides_win_over_the_file() {
    let dir = std::env::temp_dir().join(format!("walbox-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("w.toml");
    std::fs::write(&path, "[source]\nslot = \"from_file\"\ndsn = \"host=a\"").unwrap();
    let c = Config::load(&Overrides {
        config: Some(path),
        slot: Some("from_flag".into()),
        bootstrap_servers: Some("b:1".into()),
        topic: Some("fixed".into()),
        ..Overrides::default()
    })
    .unwrap();
    assert_eq!(c.source.slot, "from_flag");
    assert_eq!(c.dsn().unwrap(), "host=a");
    assert_eq!(c.outbox[0].table, "public.outbox");
    assert_eq!(c.outbox[0].topic, "fixed");
    assert_eq!(c.sink.kafka["bootstrap.servers"].as_str(), Some("b:1"));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn messages_alone_configure_no_table_and_are_validated_by_key() {
    let dir = std::env::temp_dir().join(format!("walbox-msg-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let load = |text: &str| {
        let path = dir.join("m.toml");
        std::fs::write(&path, text).unwrap();
        Config::load(&Overrides {
            config: Some(path),
            ..Overrides::default()
        })
    };
    let c = load("[[messages]]\nprefix = \"walbox\"\n[[messages]]\nprefixes = [\"a\", \"b\"]\nformat = \"cloudevents\"").unwrap();
    assert!(c.outbox.is_empty(), "no default table beside [[messages]]");
    assert_eq!(c.messages.len(), 2);
    assert_eq!(c.messages[1].prefixes, ["a", "b"]);

    let err = |text: &str| format!("{:#}", load(text).unwrap_err());
    let e = err("[[messages]]\nprefix = \"a\"\n[[messages]]\nprefix = \"a\"");
    assert!(
        e.contains("[[messages]]: prefix") && e.contains("configured twice"),
        "{e}"
    );
    let e = err("[[messages]]\nprefix = \"a\"\ncolour = \"red\"");
    assert!(e.contains("unknown field") && e.contains("colour"), "{e}");
    let e = err("[[messages]]\ntopic = \"t\"");
    assert!(e.contains("[[messages]]: no prefix"), "{e}");
    let e = err("[[messages]]\nprefix = \"a\"\ntopic = \"a b\"");
    assert!(
        e.contains("section 1 of [[messages]]") && e.contains("message:a"),
        "{e}"
    );
    let e = err("[[messages]]\nprefix = \"a\"\n[messages.fields]\nkey = \"k\"");
    assert!(e.contains("unknown field") && e.contains("key"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_sink_s_type_gives_every_format_its_cloudevents_binding() {
    let dir = std::env::temp_dir().join(format!("walbox-binding-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("b.toml");
    let text = |sink: &str| {
        format!(
            "[sink]\ntype = \"{sink}\"\n[sink.nats]\nservers = [\"nats://127.0.0.1:4222\"]\n\
             [sink.webhook]\nurl = \"https://h.example/{{topic}}\"\nsecrets = [\"whsec_aGVsbG8=\"]\n\
             [[outbox]]\ntable = \"o\"\nformat = \"cloudevents\"\n\
             [[messages]]\nprefix = \"m\"\nformat = \"cloudevents\""
        )
    };
    let load = |text: &str, sink: Option<SinkKind>| {
        std::fs::write(&path, text).unwrap();
        Config::load(&Overrides {
            config: Some(path.clone()),
            sink,
            ..Overrides::default()
        })
        .unwrap()
    };
    for (sink, over, protocol) in [
        ("kafka", None, walbox_outbox::Protocol::Kafka),
        ("stdout", None, walbox_outbox::Protocol::Kafka),
        ("nats", None, walbox_outbox::Protocol::Nats),
        ("webhook", None, walbox_outbox::Protocol::Http),
        ("rabbitmq", None, walbox_outbox::Protocol::Amqp),
        // The command line's sink decides.
        ("kafka", Some(SinkKind::Nats), walbox_outbox::Protocol::Nats),
        (
            "nats",
            Some(SinkKind::Kafka),
            walbox_outbox::Protocol::Kafka,
        ),
    ] {
        let c = load(&text(sink), over);
        let binding = protocol.cloudevents();
        assert_eq!(c.outbox[0].formatting.binding, binding, "{sink} {over:?}");
        assert_eq!(c.messages[0].formatting.binding, binding, "{sink} {over:?}");
        assert_eq!(c.outbox[0].formatting.cloudevents_mode, None);
    }
    // Parsing alone binds as well.
    let c = Config::parse(&text("nats"), &path).unwrap();
    assert_eq!(
        c.outbox[0].formatting.binding,
        walbox_outbox::Protocol::Nats.cloudevents()
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_webhook_sink_s_settings_are_checked_and_its_dead_letters_have_a_default_file() {
    let dir = std::env::temp_dir().join(format!("walbox-webhook-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("w.toml");
    let load = |text: &str| {
        std::fs::write(&path, text).unwrap();
        Config::load(&Overrides {
            config: Some(path.clone()),
            ..Overrides::default()
        })
    };
    let base = "[source]\nslot = \"s1\"\n[sink]\ntype = \"webhook\"\n[sink.webhook]\n";
    let c = load(&format!(
        "{base}url = \"https://h.example/{{aggregate_type}}\"\nsecrets = [\"whsec_aGVsbG8=\"]"
    ))
    .unwrap();
    let w = c.webhook_sink().unwrap();
    assert_eq!(
        w.dead_letter_file.as_deref(),
        Some(std::path::Path::new("walbox-s1.dead-letters.jsonl"))
    );
    assert_eq!(w.max_retry_duration_s, 3600);
    assert!(!w.follow_redirects);
    assert!(
        !format!("{c:?}").contains("aGVsbG8"),
        "the secret is hidden"
    );
    let err = |text: &str| format!("{:#}", load(text).unwrap_err());
    let e = err(&format!(
        "{base}url = \"https://h.example/\"\nsecrets = [\"whsec_aGVsbG8=\"]\ncolour = 1"
    ));
    assert!(e.contains("unknown field") && e.contains("colour"), "{e}");
    let e = err(&format!("{base}url = \"https://h.example/\""));
    assert!(e.contains("sink.webhook.secrets"), "{e}");
    let e = err(&format!(
        "{base}url = \"https://h.example/\"\nsecret_env = [\"WALBOX_TEST_NO_SUCH_SECRET\"]"
    ));
    assert!(e.contains("WALBOX_TEST_NO_SUCH_SECRET"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_redis_sink_takes_the_slot_as_writer_and_the_in_flight_bound_and_hides_its_password() {
    let c = Config::parse(
        r#"
        [source]
        slot = "orders"
        [sink]
        type = "redis"
        max_in_flight = 250
        [sink.redis]
        url = "redis://app:url-Pw-41@cache:6379/1"
        maxlen = 1000
        "#,
        Path::new("t.toml"),
    )
    .unwrap();
    assert_eq!(c.sink.kind, SinkKind::Redis);
    assert_eq!(c.sink.kind.protocol(), walbox_outbox::Protocol::Kafka);
    let redis = c.sink.redis_sink(&c.source.slot).unwrap();
    assert_eq!(redis.writer.as_deref(), Some("orders"));
    assert_eq!(redis.max_in_flight, 250);
    assert_eq!(redis.maxlen, Some(1000));
    let shown = format!("{c:?}");
    assert!(!shown.contains("url-Pw-41"), "{shown}");
    assert!(shown.contains("***@cache:6379/1"), "{shown}");
    // Unknown keys and settings that do not go together are refused by name.
    let e = Config::parse(
        "[sink]\ntype = \"redis\"\n[sink.redis]\nmax_len = 5\n",
        Path::new("t.toml"),
    )
    .unwrap_err();
    assert!(format!("{e:#}").contains("max_len"), "{e:#}");
    let c = Config::parse(
        "[sink]\ntype = \"redis\"\n[sink.redis]\nmaxlen = 5\nminid_behind_bytes = 9\n",
        Path::new("t.toml"),
    )
    .unwrap();
    let e = c.sink.redis_sink("s").unwrap_err();
    assert!(format!("{e:#}").contains("sink.redis.maxlen"), "{e:#}");
}

#[test]
fn a_rabbitmq_sink_parses_refuses_unknown_keys_and_hides_its_password() {
    let c = Config::parse(
        r#"
        [source]
        slot = "orders"
        [sink]
        type = "rabbitmq"
        [sink.rabbitmq]
        mode = "stream"
        host = "rabbit"
        user = "walbox"
        password = "pw-1c9e"
        "#,
        Path::new("t.toml"),
    )
    .unwrap();
    assert_eq!(c.sink.kind, SinkKind::RabbitMq);
    assert_eq!(c.sink.rabbitmq.mode, walbox_sink::RabbitMqMode::Stream);
    let sink = c.sink.rabbitmq_sink(&c.source.slot).unwrap();
    assert_eq!(sink.producer.as_deref(), Some("walbox.orders"));
    assert!(!format!("{c:?}").contains("pw-1c9e"));
    let e = Config::parse(
        "[sink]\ntype = \"rabbitmq\"\n[sink.rabbitmq]\nexchnage = \"x\"\n",
        Path::new("t.toml"),
    )
    .unwrap_err();
    assert!(format!("{e:#}").contains("exchnage"), "{e:#}");
}

#[test]
fn a_sink_url_whose_password_holds_a_slash_is_refused_without_showing_it() {
    let dir = std::env::temp_dir().join(format!("walbox-url-pw-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("w.toml");
    let hidden = |text: &str| {
        for part in ["Ab1", "Cd2"] {
            assert!(!text.contains(part), "{text}");
        }
    };
    // Webhook: the error of the whole load names the key, not the password.
    let text = "[source]\nslot = \"s1\"\n[sink]\ntype = \"webhook\"\n[sink.webhook]\n\
                url = \"https://user:Ab1/Cd2@example.com/{topic}\"\n\
                secrets = [\"whsec_aGVsbG8=\"]\n";
    std::fs::write(&path, text).unwrap();
    let e = format!(
        "{:#}",
        Config::load(&Overrides {
            config: Some(path.clone()),
            ..Overrides::default()
        })
        .unwrap_err()
    );
    hidden(&e);
    assert!(e.contains("sink.webhook.url"), "{e}");
    let c = Config::parse(text, &path).unwrap();
    hidden(&format!("{c:?}"));
    // Redis: the same for its URL.
    let c = Config::parse(
        "[sink]\ntype = \"redis\"\n[sink.redis]\nurl = \"redis://user:Ab1/Cd2@cache:6379/0\"\n",
        &path,
    )
    .unwrap();
    hidden(&format!("{c:?}"));
    let e = format!("{:#}", c.sink.redis_sink("s").unwrap_err());
    hidden(&e);
    assert!(e.contains("sink.redis.url"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_pubsub_sink_takes_the_relays_bounds_and_topic_creation_and_its_binding() {
    let c = Config::parse(
        r#"
        [sink]
        type = "pubsub"
        create_topics = true
        max_in_flight = 500
        [sink.pubsub]
        project = "orders-prod"
        emulator_host = "127.0.0.1:8085"
        max_requests = 8
        "#,
        Path::new("t.toml"),
    )
    .unwrap();
    assert_eq!(c.sink.kind, SinkKind::PubSub);
    assert_eq!(c.sink.kind.protocol(), walbox_outbox::Protocol::PubSub);
    let binding = walbox_outbox::Protocol::PubSub.cloudevents();
    assert_eq!(binding.prefix, "ce-");
    assert!(!binding.percent_encoded);
    let sink = c.sink.pubsub_sink().unwrap();
    assert_eq!(sink.project, "orders-prod");
    assert_eq!(sink.emulator_host.as_deref(), Some("127.0.0.1:8085"));
    assert!(sink.create_topics);
    assert_eq!(sink.max_in_flight, 500);
    assert_eq!(sink.max_requests, 8);
    let e = Config::parse(
        "[sink]\ntype = \"pubsub\"\n[sink.pubsub]\nprojekt = \"p\"\n",
        Path::new("t.toml"),
    )
    .unwrap_err();
    assert!(format!("{e:#}").contains("projekt"), "{e:#}");
}

/// `sink.max_in_flight` unset takes the sink's default: 2,000 for RabbitMQ
/// exchange mode (each unconfirmed publication holds about 5 KB, and one
/// node confirms no faster with more), 10,000 for every other sink; set, it
/// is the value, whatever the sink; 0 is refused.
#[test]
fn the_in_flight_bound_defaults_per_sink_and_a_set_value_wins() {
    let bound = |toml: &str| {
        let c = Config::parse(toml, Path::new("t.toml")).unwrap();
        c.validate().unwrap();
        (
            c.sink.max_in_flight(),
            c.sink.rabbitmq_sink("s").unwrap().max_in_flight,
        )
    };
    assert_eq!(bound("[sink]\ntype = \"rabbitmq\"\n"), (2_000, 2_000));
    assert_eq!(
        bound("[sink]\ntype = \"rabbitmq\"\n[sink.rabbitmq]\nmode = \"stream\"\n"),
        (10_000, 10_000)
    );
    assert_eq!(
        bound("[sink]\ntype = \"rabbitmq\"\nmax_in_flight = 10000\n"),
        (10_000, 10_000)
    );
    let kafka = Config::parse("[sink]\n", Path::new("t.toml")).unwrap();
    assert_eq!(kafka.sink.max_in_flight(), 10_000);
    let zero = Config::parse(
        "[sink]\ntype = \"rabbitmq\"\nmax_in_flight = 0\n",
        Path::new("t.toml"),
    )
    .unwrap();
    let e = zero.validate().unwrap_err();
    assert!(format!("{e:#}").contains("sink.max_in_flight"), "{e:#}");
}
