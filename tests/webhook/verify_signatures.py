"""Verifies webhook requests with the official Standard Webhooks library.

Input (argv[1]): a JSON file {"secret": "whsec_...", "requests": [{"headers":
{name: value}, "body_b64": "..."}]}. Prints one line per request: "ok <id>" or
"bad <id> <error>". Exits 1 when any request fails verification.
"""

import base64
import json
import sys

from standardwebhooks.webhooks import Webhook, WebhookVerificationError


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    hook = Webhook(spec["secret"])
    failed = 0
    for req in spec["requests"]:
        body = base64.b64decode(req["body_b64"])
        headers = req["headers"]
        ident = headers.get("webhook-id", "?")
        try:
            hook.verify(body, headers, json_parse=False)
            print(f"ok {ident}")
        except WebhookVerificationError as e:
            failed += 1
            print(f"bad {ident} {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
