"""Parses records with the CloudEvents Python SDK and prints what it reads.

Input (argument 1): a JSON list of records {"mode": ..., "key": text or null,
"headers": [[name, text], ...], "value": text}. Modes:

- "binary", "structured": a Kafka record, read with the SDK's Kafka binding;
- "nats-binary": a NATS message in binary mode. The SDK has no NATS binding;
  the NATS binding's binary mode is the HTTP binding's header mapping (`ce-`
  names, values percent-decoded once) except that `datacontenttype` travels as
  `ce-datacontenttype` like any other attribute, so the SDK's HTTP binary
  reader reads it as the NATS binding says (there is no `Content-Type`);
- "nats-structured": a NATS message in structured mode: the payload is the
  JSON event format, read with the SDK's JSON format.

Output (stdout): a JSON list with, per record, every attribute the SDK read
(time as RFC 3339) and the data.
"""

import json
import sys

from cloudevents.core.bindings import http, kafka
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent

records = json.load(open(sys.argv[1], encoding="utf-8"))
out = []
for r in records:
    mode = r["mode"]
    value = r["value"].encode("utf-8")
    if mode in ("binary", "structured"):
        message = kafka.KafkaMessage(
            headers={name: v.encode("utf-8") for name, v in r["headers"]},
            key=None if r["key"] is None else r["key"].encode("utf-8"),
            value=value,
        )
        read = kafka.from_binary if mode == "binary" else kafka.from_structured
        event = read(message, JSONFormat(), CloudEvent)
    elif mode == "nats-binary":
        headers = dict(r["headers"])
        assert "Content-Type" not in headers and "content-type" not in headers, headers
        event = http.from_binary(http.HTTPMessage(headers=headers, body=value), JSONFormat(), CloudEvent)
    elif mode == "nats-structured":
        event = JSONFormat().read(CloudEvent, value)
    else:
        raise ValueError(f"unknown mode {mode}")
    attributes = {}
    for name, v in event.get_attributes().items():
        attributes[name] = v.isoformat() if hasattr(v, "isoformat") else v
    attributes["data"] = event.get_data()
    out.append(attributes)
json.dump(out, sys.stdout)
