"""Parses Kafka records with the CloudEvents Python SDK and prints what it reads.

Input (argument 1): a JSON list of records {"mode": "binary" | "structured",
"key": text or null, "headers": [[name, text], ...], "value": text}.
Output (stdout): a JSON list with, per record, every attribute the SDK read
(time as RFC 3339) and the data.
"""

import json
import sys

from cloudevents.core.bindings.kafka import KafkaMessage, from_binary, from_structured
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent

records = json.load(open(sys.argv[1], encoding="utf-8"))
out = []
for r in records:
    message = KafkaMessage(
        headers={name: value.encode("utf-8") for name, value in r["headers"]},
        key=None if r["key"] is None else r["key"].encode("utf-8"),
        value=r["value"].encode("utf-8"),
    )
    read = from_binary if r["mode"] == "binary" else from_structured
    event = read(message, JSONFormat(), CloudEvent)
    attributes = {}
    for name, value in event.get_attributes().items():
        attributes[name] = value.isoformat() if hasattr(value, "isoformat") else value
    attributes["data"] = event.get_data()
    out.append(attributes)
json.dump(out, sys.stdout)
